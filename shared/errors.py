"""The one exception tree of the platform.

Every error our code raises on purpose derives from :class:`AgentsError`.
Subclasses carry their data as attributes; messages read
``"operation target: cause"``. The gRPC layer (:mod:`shared.rpc`) maps each
class to one status code through a single table, so domain code never
imports ``grpc``.

::

    AgentsError
    ├── InvalidArgument            field, reason            -> INVALID_ARGUMENT
    │   ├── InvalidId              kind, value
    │   └── TooLarge               field, limit, size
    ├── NotFound                   kind, ident              -> NOT_FOUND
    ├── AlreadyExists              kind, ident              -> ALREADY_EXISTS
    ├── InvalidState               what, reason             -> FAILED_PRECONDITION
    │   └── ProviderError          a machine provider refused (bad credentials, no instance)
    ├── PreconditionFailed         key                      -> ABORTED
    ├── QuotaExceeded              what, limit              -> RESOURCE_EXHAUSTED
    ├── DiskFull                   what, folder             -> RESOURCE_EXHAUSTED
    ├── Unauthenticated                                     -> UNAUTHENTICATED
    │   └── MachineRevoked         the machine was revoked: it stops for good
    ├── PermissionDenied                                    -> PERMISSION_DENIED
    ├── IntegrityError             what                     -> DATA_LOSS
    │   └── DatabaseDamaged        what, path
    ├── Cancelled                                           -> CANCELLED
    ├── Unimplemented              what                     -> UNIMPLEMENTED
    ├── DeadlineExceeded                                    -> DEADLINE_EXCEEDED
    ├── TransientError             (retryable)              -> UNAVAILABLE
    │   ├── StoreUnavailable
    │   │   └── StoreUntrusted     the store is not this deployment's (swapped, emptied)
    │   │       └── StoreFenced    a newer control-plane process owns the store: stop
    │   └── ProviderUnavailable    a machine provider did not answer
    ├── StoreError                 (permanent store fault)  -> INTERNAL
    │   ├── StoreIncompatible      the bucket lacks a feature we need
    │   └── StoreMisconfigured     missing bucket, wrong credentials -> FAILED_PRECONDITION
    ├── ConfigError                field, reason            (CLI only)
    ├── RuntimeFailed              message                  (machine: a run's runtime failed)
    └── RpcError                   code, details            (client side, unmapped)
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    # Only the client side builds RpcError; domain code never imports grpc.
    import grpc

__all__ = [
    "AgentsError",
    "AlreadyExists",
    "Cancelled",
    "ConfigError",
    "DatabaseDamaged",
    "DeadlineExceeded",
    "DiskFull",
    "IntegrityError",
    "InvalidArgument",
    "InvalidId",
    "InvalidState",
    "MachineRevoked",
    "NotFound",
    "PermissionDenied",
    "PreconditionFailed",
    "ProviderError",
    "ProviderUnavailable",
    "QuotaExceeded",
    "RpcError",
    "RuntimeFailed",
    "StoreError",
    "StoreIncompatible",
    "StoreMisconfigured",
    "StoreUnavailable",
    "StoreFenced",
    "StoreUntrusted",
    "TooLarge",
    "TransientError",
    "Unauthenticated",
    "Unimplemented",
]

logger = logging.getLogger(__name__)


class AgentsError(Exception):
    """Root of every error the platform raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(AgentsError):
    """A request field is malformed or out of range."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


#: What follows the dot of a token or credential (base64url): never echoed.
_SECRET_PART: Final = re.compile(r"[A-Za-z0-9_-]+")


class InvalidId(InvalidArgument):
    """An identifier does not match its strict pattern."""

    def __init__(self, kind: str, value: str, field: str | None = None) -> None:
        # Only a bounded prefix is kept: the value travels back in error details.
        # No id holds a dot; a token or credential (``<id>.<secret>``) pasted where
        # its id goes does: its secret part is never echoed (logs, terminals).
        head, dot, tail = value.partition(".")
        if dot and len(tail) >= 16 and _SECRET_PART.fullmatch(tail):
            value = head + ".<hidden>"
        shown = value if len(value) <= 64 else value[:61] + "..."
        super().__init__(field or kind, f"invalid {kind} id {shown!r}")
        self.kind = kind
        self.value = shown


class TooLarge(InvalidArgument):
    """A value is larger than its configured limit."""

    def __init__(self, field: str, limit: int, size: int | None = None) -> None:
        got = f" (got {size} bytes)" if size is not None else ""
        super().__init__(field, f"larger than the limit of {limit} bytes{got}")
        self.limit = limit
        self.size = size


class NotFound(AgentsError):
    """The named thing does not exist (or is not visible to the caller)."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident}: not found")
        self.kind = kind
        self.ident = ident


class AlreadyExists(AgentsError):
    """Creating a thing that already exists."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident}: already exists")
        self.kind = kind
        self.ident = ident


class InvalidState(AgentsError):
    """The operation is not allowed in the target's current state."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason


class PreconditionFailed(AgentsError):
    """A conditional write lost: the key exists, or its etag changed."""

    def __init__(self, key: str, reason: str = "precondition failed") -> None:
        super().__init__(f"put {key}: {reason}")
        self.key = key


class QuotaExceeded(AgentsError):
    """A bounded resource (queue depth, count) is full."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{what}: limit of {limit} reached")
        self.what = what
        self.limit = limit


class DiskFull(AgentsError):
    """The disk holding a data folder has no space left (or the user's quota is used up).

    Not permanent: writes succeed again once space is freed, without a restart.
    """

    def __init__(self, what: str, folder: str) -> None:
        super().__init__(
            f"{what}: no space left on the disk holding the data folder {folder};"
            " free some space there (writes resume by themselves)"
        )
        self.what = what
        self.folder = folder


class Unauthenticated(AgentsError):
    """No valid credential was presented."""


class MachineRevoked(Unauthenticated):
    """A revoked machine's certificate was presented: unlike other refusals, final."""


class PermissionDenied(AgentsError):
    """The caller is known but may not do this."""


class IntegrityError(AgentsError):
    """Data failed authentication or a checksum: it is corrupt or forged."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason


class DatabaseDamaged(IntegrityError):
    """A local database file is damaged (SQLite reported corruption or a check failed)."""

    def __init__(self, what: str, path: str, reason: str) -> None:
        super().__init__(
            what,
            f"the database {path} is damaged ({reason}); stop the daemon if it runs, keep a copy of"
            " its data folder, then restore the file from a backup or salvage it with"
            ' `sqlite3 <file> .recover` (docs/machine.md, "Damaged database")',
        )
        self.path = path


class Cancelled(AgentsError):
    """The operation was cancelled by its caller."""


class Unimplemented(AgentsError):
    """A call the contract names but this release does not serve yet."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what


class DeadlineExceeded(AgentsError):
    """The operation ran out of time."""


class TransientError(AgentsError):
    """A fault that may go away: retrying an idempotent call is safe."""


class StoreUnavailable(TransientError):
    """The object store did not answer or answered with a server error."""


class ProviderError(InvalidState):
    """A machine provider refused to start or describe a machine (permanent)."""


class ProviderUnavailable(TransientError):
    """A machine provider could not be reached or was throttled (retry later)."""


class StoreUntrusted(StoreUnavailable):
    """The store answers but is not this deployment's (emptied, swapped, forged marker).

    Nothing is read from or written to it until it is the right one again.
    """


class StoreFenced(StoreUntrusted):
    """A newer control-plane process (a higher epoch in ``cp/epoch.json``, e.g. a
    restored one) owns the store: this process must write nothing and stop."""


class StoreError(AgentsError):
    """A permanent object-store fault (bad credentials, bad bucket...)."""


class StoreIncompatible(StoreError):
    """The store lacks a feature we rely on (e.g. conditional writes)."""


class StoreMisconfigured(StoreError):
    """The store cannot work as configured: a missing bucket, refused credentials."""


class ConfigError(AgentsError):
    """Configuration is missing or invalid."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"config {field}: {reason}")
        self.field = field
        self.reason = reason


class RuntimeFailed(AgentsError):
    """An agent runtime's backend failed (process died, protocol error...).

    Raised by a runtime's ``run``; the run engine ends the run with RUN_ERROR
    code RUNTIME_FAILED and ``message`` (which must not contain secrets). It
    never crosses gRPC: a run's failure is an event, not a status.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)


class RpcError(AgentsError):
    """A gRPC call failed with a status that maps to no domain error."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"rpc {code.name}: {details}")
        self.code = code
        self.details = details
