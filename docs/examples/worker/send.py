"""A double click: two sign-ups of one user at once, sent to the worker of tasks.py."""

import asyncio
import logging

from tasks import broker, send_welcome_email

from taskiq_deduplication import DuplicateTaskError


# --8<-- [start:send]
async def sign_up(user_id: int) -> None:
    try:
        task = await send_welcome_email.kiq(user_id=user_id)
    except DuplicateTaskError:
        print(f"user {user_id}: a welcome email is already on its way")
        return
    result = await task.wait_result(timeout=10)
    print(result.return_value)


async def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # Refusals are INFO on a logger of their own: show them here.
    logging.getLogger("taskiq_deduplication.refusals").setLevel(logging.INFO)
    await broker.startup()  # the middleware connects to Redis here
    try:
        await asyncio.gather(sign_up(user_id=42), sign_up(user_id=42))
    finally:
        await broker.shutdown()


# --8<-- [end:send]

if __name__ == "__main__":
    asyncio.run(main())
