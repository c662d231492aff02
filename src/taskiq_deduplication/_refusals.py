"""Refusals that a caller has said it handles, and logs, itself.

A refused send is logged by the middleware as a warning: the caller of ``kiq``
may not catch the error. A caller that does (the
[DeduplicationScheduler][taskiq_deduplication.DeduplicationScheduler]) sets this
flag around its ``kiq``, and the middleware logs the refusal at debug level only.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Final

#: Whether the ``kiq`` running in this context has its refusals handled by its caller.
HANDLED: Final[ContextVar[bool]] = ContextVar("taskiq_deduplication_refusal_handled", default=False)
