"""NATS faults as the replicas' outage lines log them.

A NATS server that went away is an outage, not a bug: :class:`~shared.outage.OutageLog`
logs our own errors as one line and anything else with its traceback, so a
NATS timeout or a closed socket is turned into a :class:`~shared.errors.TransientError`
first (one WARNING per outage, as for the store).
"""

from __future__ import annotations

import nats.errors

from shared.errors import TransientError

__all__ = ["outage_error"]


def outage_error(e: BaseException) -> BaseException:
    """``e`` as an outage line takes it: NATS's and the socket's faults as one line."""
    if isinstance(e, nats.errors.Error | OSError):
        return TransientError(f"nats: {str(e) or type(e).__name__}")
    return e
