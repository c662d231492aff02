"""A reindex that runs once a burst of edits has settled."""

import asyncio
import os
import time
import uuid

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware

REDIS_URL = os.environ.get("REDIS_URL", "redis://localhost:6379")
broker = InMemoryBroker().with_middlewares(
    RedisDeduplicationMiddleware(REDIS_URL, key_prefix=f"debounce-{uuid.uuid4().hex[:8]}"),
)
START = time.monotonic()


# --8<-- [start:debounce]
@broker.task(
    deduplication_key_fields=["doc_id"],
    deduplication_debounce=1,  # once no edit came for 1 s...
    deduplication_debounce_max=5,  # ...and never more than 5 s after the first
)
async def reindex(doc_id: str, revision: int) -> None:
    print(f"reindexing {doc_id} at revision {revision}")


async def document_saved(doc_id: str, revision: int) -> None:
    # Sent, or merged into the reindex that waits for the edits to settle:
    # kiq() returns its handle either way.
    await reindex.kiq(doc_id=doc_id, revision=revision)


# --8<-- [end:debounce]


async def main() -> None:
    await broker.startup()
    for revision in range(1, 6):  # five saves, 0.2 s apart
        await document_saved("handbook", revision)
        await asyncio.sleep(0.2)
    print("five saves sent")
    await broker.wait_all()
    await broker.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
