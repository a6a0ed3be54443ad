"""What the Admin service answers, as typed values: the client side of admin.proto.

Each type mirrors one reply message of ``shared/pb/control/v1/admin.proto``
field for field, under the proto field names: ``from_pb`` reads each field
from the message field of its name (unset timestamps become None, nested
replies their own types), so :class:`~controlplane.cli.client.AdminClient` is the
only place that sees those messages and its callers never see protobuf. A
field added to the proto and not here (or the other way round) fails the unit
tests, not a user.

``to_json()`` gives the shape ``agents-control --json`` prints, the one of
docs/cli-json.md (what :func:`shared.cli.message_dict` makes of the message):
every field present, times as RFC 3339 UTC text to the second or ``null`` when
unset, bytes as base64, integers as numbers. Scripts parse that shape, so it
must not drift; the unit tests compare the two for every type.

The one-time secrets (a join token's value, a new credential, a generated
recovery private key) are kept out of ``repr`` so that logging a reply never
writes one.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from shared.cli import json_time
from shared.timestamps import from_datetime, to_datetime

__all__ = [
    "Account",
    "Deletion",
    "JoinToken",
    "Machine",
    "NewAccount",
    "NewCredential",
    "NewJoinToken",
    "PromptQueue",
    "QueuedPrompt",
    "SentPrompt",
    "rfc3339",
]

Presence = Literal["revoked", "online", "starting", "offline"]


def rfc3339(value: dt.datetime | None) -> str | None:
    """``value`` as the CLIs print a Timestamp: RFC 3339 UTC to the second (None: None)."""
    return None if value is None else json_time(from_datetime(value).ToJsonString())


def _json_value(value: object) -> Any:
    if isinstance(value, _Reply):
        return value.to_json()
    if isinstance(value, dt.datetime):
        return rfc3339(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


class _Reply:
    """What every reply type shares: read from its message, and its ``--json`` shape."""

    __slots__ = ()

    #: Fields that hold other replies (one, or a tuple of them for a repeated field).
    _parts: ClassVar[Mapping[str, type[_Reply]]] = {}

    @classmethod
    def from_pb(cls, msg: Message) -> Self:
        """The reply from its message: each field from the message field of its name."""
        assert dataclasses.is_dataclass(cls)
        return cls(**{f.name: cls._read(msg, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def _read(cls, msg: Message, name: str) -> Any:
        value = getattr(msg, name)
        desc: Any = msg.DESCRIPTOR  # upb's and the pure-Python descriptor types differ
        repeated = desc.fields_by_name[name].is_repeated
        part = cls._parts.get(name)
        if part is not None:
            return tuple(part.from_pb(v) for v in value) if repeated else part.from_pb(value)
        if isinstance(value, Timestamp):
            # An unset Timestamp reads as 1970, not as "never": ask whether it was sent.
            return to_datetime(value) if msg.HasField(name) else None
        return tuple(value) if repeated else value

    def to_json(self) -> dict[str, Any]:
        """Every field under its proto name, as ``--json`` prints it (see the module doc)."""
        assert dataclasses.is_dataclass(self)
        return {f.name: _json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class Account(_Reply):
    """An account (``Account``)."""

    account_id: str
    github_user_id: int
    github_login: str
    signed_up_at: dt.datetime | None
    recovery_public_key: bytes
    """The recovery X25519 public key (32 bytes)."""
    state: str
    """``active`` or ``deleting``."""


@dataclass(frozen=True, slots=True)
class NewAccount(_Reply):
    """A created account, with the recovery private key when the server made the pair."""

    _parts = {"account": Account}

    account: Account
    recovery_private_key: bytes = field(repr=False)
    """32 bytes, shown once and never stored; empty when the caller gave a public key."""


@dataclass(frozen=True, slots=True)
class Deletion(_Reply):
    """An account deletion's progress or result (``Deletion``)."""

    account_id: str
    state: str
    """``deleting`` or ``deleted``."""
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    """None while deleting."""
    deleted_objects: int
    deleted_by: str
    """The credential id that asked for it."""


@dataclass(frozen=True, slots=True)
class JoinToken(_Reply):
    """A join (or re-pair) token's record, never its secret (``JoinToken``)."""

    token_id: str
    account_id: str
    created_at: dt.datetime | None
    expires_at: dt.datetime | None
    max_uses: int
    uses: int
    revoked: bool
    state: str
    """``active``, ``expired``, ``used`` or ``revoked``."""
    repair_machine_id: str
    """For a re-pair token: the machine id it keeps; else empty."""


@dataclass(frozen=True, slots=True)
class NewJoinToken(_Reply):
    """A created join or re-pair token, with what a machine needs to join with it."""

    _parts = {"token": JoinToken}

    token: JoinToken
    token_value: str = field(repr=False)
    """The whole token ``<tok_id>.<secret>``: shown once, never stored."""
    ca_hash: str
    """The CA hash to pin, ``sha256:<hex>``."""
    join_address: str
    """``host:port`` machines join."""


@dataclass(frozen=True, slots=True)
class Machine(_Reply):
    """A machine with its presence, provider and next wake (``Machine``)."""

    machine_id: str
    account_id: str
    name: str
    hostname: str
    version: str
    joined_at: dt.datetime | None
    last_seen_at: dt.datetime | None
    online: bool
    agent_count: int
    revoked: bool
    certificate_serial: str
    certificate_not_after: dt.datetime | None
    provider: str
    starting: bool
    """Its provider was asked to start it and it has not connected yet."""
    next_fire_at: dt.datetime | None
    """The soonest schedule fire it last reported (None: none)."""
    next_wake_at: dt.datetime | None
    """When its provider will be asked to start it for that fire (None: not planned)."""
    has_provider: bool

    @property
    def presence(self) -> Presence:
        """One word for where it stands, revocation first."""
        if self.revoked:
            return "revoked"
        if self.online:
            return "online"
        return "starting" if self.starting else "offline"


@dataclass(frozen=True, slots=True)
class SentPrompt(_Reply):
    """A sent prompt's id and state (``SendPromptResponse``)."""

    prompt_id: str
    state: str
    """``queued``, ``delivered`` or ``acknowledged``; for a key sent again after the
    machine answered, ``acknowledged`` or ``refused``."""
    run_id: str
    """The machine's run id, once acknowledged; else empty."""
    reason: str
    """Why the machine refused it (state ``refused``); else empty."""


@dataclass(frozen=True, slots=True)
class QueuedPrompt(_Reply):
    """One prompt of a machine's queue (``PromptInfo``)."""

    prompt_id: str
    agent_id: str
    created_at: dt.datetime | None
    size: int
    """Bytes of the sealed prompt."""
    state: str
    """``queued``, ``delivered``, ``acknowledged``, ``expired`` or ``refused``."""
    age_seconds: int
    run_id: str
    reason: str
    """Why the machine refused it (state ``refused``)."""


@dataclass(frozen=True, slots=True)
class PromptQueue(_Reply):
    """A machine's prompts, oldest first, and its provider's last error."""

    _parts = {"prompts": QueuedPrompt}

    prompts: tuple[QueuedPrompt, ...]
    provider_error: str
    """The last error of the machine's provider (e.g. bad credentials), or empty."""


@dataclass(frozen=True, slots=True)
class NewCredential(_Reply):
    """A created account-scoped admin credential (``CreateCredentialResponse``)."""

    credential_id: str
    credential: str = field(repr=False)
    """The whole credential ``adm_<id>.<secret>``: shown once, stored only as a hash."""
    account_id: str
