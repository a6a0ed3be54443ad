"""Where the control link is, and the control plane's answers that move it.

:class:`LinkState` is what :class:`~machine.link.connection.ControlLink`
reports. The rest decides how an attempt that failed goes on:
:class:`LinkStopped` (revoked, account deleted) ends the link for good,
:class:`LinkRefused` (any other refusal of this machine) is retried slowly
with the identity kept, and whatever :func:`is_transient` accepts is retried
with the reconnect backoff. :func:`map_error` reads a failed RPC and
:func:`check_notice` a message on the stream; both are the only places that
decide a refusal is final.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Final

import grpc.aio

from machine.link.client import AccountDeleted, ControlNotice, Revoked
from shared.errors import (
    IntegrityError,
    InvalidState,
    MachineRevoked,
    PermissionDenied,
    Unauthenticated,
)
from shared.rpc import domain_error

__all__ = [
    "FINAL_STATES",
    "LinkRefused",
    "LinkState",
    "LinkStopped",
    "check_notice",
    "is_transient",
    "map_error",
]

logger = logging.getLogger(__name__)


class LinkState(enum.Enum):
    """Where the link is."""

    STARTING = "starting"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    BACKING_OFF = "backing_off"
    REVOKED = "revoked"
    """The control plane revoked this machine (or refused its certificate): no retry."""
    ACCOUNT_DELETED = "account_deleted"
    """The owning account was deleted: no retry."""
    STOPPED = "stopped"


FINAL_STATES: Final = frozenset({LinkState.REVOKED, LinkState.ACCOUNT_DELETED, LinkState.STOPPED})
"""States the link does not leave."""


class LinkRefused(Exception):
    """The control plane refused this machine, but not for good: retry slowly."""


class LinkStopped(Exception):
    """The control plane told us to stop for good."""

    def __init__(self, state: LinkState, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


def is_transient(exc: BaseException) -> bool:
    """True for a failure the reconnect backoff retries."""
    return not isinstance(
        exc, LinkStopped | LinkRefused | asyncio.CancelledError | InvalidState | IntegrityError
    )


def map_error(e: grpc.aio.AioRpcError) -> Exception:
    """The failed RPC as a domain error, or as LinkStopped / LinkRefused for a refusal."""
    err = domain_error(e)
    if isinstance(err, PermissionDenied):
        # The control plane's answer for an account deleted or being deleted.
        return LinkStopped(
            LinkState.ACCOUNT_DELETED, f"the control plane refused the account: {err}"
        )
    if isinstance(err, MachineRevoked) or (
        # A control plane without the error detail says it in words.
        isinstance(err, Unauthenticated) and "machine revoked" in err.message
    ):
        return LinkStopped(LinkState.REVOKED, f"the control plane refused this machine: {err}")
    if isinstance(err, Unauthenticated):
        return LinkRefused(f"control link: the control plane refused this machine: {err}")
    return err


def check_notice(notice: ControlNotice) -> None:
    """Raise LinkStopped when ``notice`` says the machine is revoked or its account deleted."""
    if isinstance(notice, Revoked):
        reason = notice.reason or "no reason"
        if reason.startswith("certificate superseded"):
            # A repair: the machine lives on, on another box (not "revoked").
            raise LinkStopped(LinkState.REVOKED, reason)
        raise LinkStopped(LinkState.REVOKED, f"machine revoked: {reason}")
    if isinstance(notice, AccountDeleted):
        raise LinkStopped(LinkState.ACCOUNT_DELETED, "the account was deleted")
