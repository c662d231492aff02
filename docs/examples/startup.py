"""What a broker start looks like when Redis cannot be reached."""

import asyncio
import logging
import socket

from taskiq import InMemoryBroker

from taskiq_deduplication import RedisDeduplicationMiddleware


def closed_port() -> int:
    """A loopback port that nothing listens on, standing in for a Redis that is down."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    redis_url = f"redis://127.0.0.1:{closed_port()}"
    # --8<-- [start:startup]
    broker = InMemoryBroker().with_middlewares(
        RedisDeduplicationMiddleware(
            redis_url=redis_url,
            startup_retries=3,  # three PINGs in all
            startup_retry_delay=0.1,  # then wait 0.1 s, then 0.2 s
        ),
    )
    try:
        await broker.startup()
    except ConnectionError as err:
        # The worker (or the web app) should not start without its locks.
        print(f"broker did not start: {err}")
        await broker.shutdown()  # closes what the attempt opened
    # --8<-- [end:startup]


if __name__ == "__main__":
    asyncio.run(main())
