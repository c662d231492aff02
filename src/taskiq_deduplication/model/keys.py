"""The lock key of a call, and the digest of its arguments.

``pre_send`` makes a call's key here, and so do the test helpers and the CLI
(through the middleware's ``locks.key_for``, with its options), so they can
never disagree. Nothing here is sent or talks to Redis.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from taskiq_deduplication.model.fingerprint import call_fingerprint, fields_fingerprint
from taskiq_deduplication.model.formats import arguments_digest, lock_key, token_digest
from taskiq_deduplication.model.settings import KEY_FIELDS_LABEL

if TYPE_CHECKING:
    from taskiq import TaskiqMessage

    from taskiq_deduplication.model.settings import SendOptions

# Its warnings are the middleware's: they are about a send.
logger = logging.getLogger(__name__)


def lock_key_of(prefix: str, message: TaskiqMessage, send: SendOptions) -> str:
    """The key of the lock that ``message``, sent with options ``send``, takes.

    Raises:
        TypeError: The arguments cannot be fingerprinted.
    """
    if send.key is not None:
        return lock_key(prefix, send.key)
    if send.key_fields is None:
        return lock_key(prefix, call_fingerprint(message.task_name, message.args, message.kwargs))
    if message.args:
        logger.warning(
            "Task %s is called with positional arguments, which %s leaves out of "
            "its lock key: pass %s as keyword arguments",
            message.task_name,
            KEY_FIELDS_LABEL,
            ", ".join(send.key_fields),
        )
    present = {name: message.kwargs[name] for name in send.key_fields if name in message.kwargs}
    for name in send.key_fields:
        if name not in present:
            logger.warning(
                "Key field %r of task %s is missing from its keyword arguments; "
                "left out of the lock key, so different calls may collide",
                name,
                message.task_name,
            )
    return lock_key(prefix, fields_fingerprint(message.task_name, present))


def arguments_digest_of(message: TaskiqMessage, send: SendOptions) -> str | None:
    """The digest of the call's full arguments, for a lock under a key or key fields."""
    if send.key is None and send.key_fields is None:
        return None  # the lock's key is the full arguments' fingerprint already
    try:
        fingerprint = call_fingerprint(message.task_name, message.args, message.kwargs)
    except (TypeError, ValueError):
        return None
    return arguments_digest(fingerprint)


def same_arguments(holder: str, digest: str | None, send: SendOptions) -> bool | None:
    """Whether a refused call's arguments equal those of the lock's ``holder`` value.

    ``None`` when that cannot be known: a holder this library did not write, or
    arguments that cannot be fingerprinted.
    """
    if send.key is None and send.key_fields is None:
        return True
    theirs = token_digest(holder)
    return None if digest is None or theirs is None else theirs == digest
