"""The control plane's records, their JSON form and where they live in the store.

Store layout (keys relative to the deployment prefix)::

    accounts/<acct>/account.json           Account
    accounts/<acct>/deleting.json          tombstone while the account is deleted
    accounts/<acct>/machines/<mc>.json     Machine
    accounts/<acct>/presence/<mc>.json     Presence (last seen; written by one writer)
    accounts/<acct>/rosters/<mc>.json      agent ids by state (controlplane.machines.rosters)
    accounts/<acct>/tokens/<tok>.json      JoinToken (hash of the secret only)
    accounts/<acct>/token-uses/<tok>/<int>  one create-only marker per use taken (the join intent)
    accounts/<acct>/revoked/<mc>.json      create-only: the machine was revoked
    accounts/<acct>/retired/<mc>/<serial>.json  create-only: a certificate it no longer accepts
    index/machines/<mc>.json               {"account_id": ...}  machine id -> account
    index/tokens/<tok>.json                {"account_id": ...}  token id -> account
    index/github/<github user id>.json     {"account_id": ...}  one account per GitHub user
    index/accounts/<acct>.json             {}  one per account, for listing
    credentials/<adm>.json                 Credential (hash of the secret only)
    audit/<yyyy>/<mm>/<dd>/<au>.json       AuditRecord
    deleted/<acct>.json                    a finished account deletion (controlplane.deletion)

Every id is validated (:func:`shared.ids.validate_id`) before it is put into a
key. Timestamps are stored as ISO 8601 UTC strings.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Final, Self

from shared.errors import IntegrityError, InvalidArgument
from shared.ids import validate_id

__all__ = [
    "ACCOUNT_INDEX_PREFIX",
    "Account",
    "account_from_dict",
    "account_index_key",
    "account_to_dict",
    "AuditRecord",
    "Credential",
    "JoinToken",
    "Machine",
    "Presence",
    "account_key",
    "audit_key",
    "credential_key",
    "decode",
    "deleted_key",
    "deleting_key",
    "encode",
    "github_index_key",
    "machine_index_key",
    "machine_key",
    "machines_prefix",
    "parse_time",
    "presence_key",
    "roster_key",
    "token_index_key",
    "token_key",
    "machine_revoked_key",
    "retired_serial_key",
    "revoked_prefix",
    "token_use_key",
    "token_uses_prefix",
    "tokens_prefix",
    "utc_iso",
]

logger = logging.getLogger(__name__)


def utc_iso(t: dt.datetime) -> str:
    """A timezone-aware datetime as ISO 8601 UTC with a ``Z``."""
    return t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def parse_time(text: str) -> dt.datetime:
    """Inverse of :func:`utc_iso`."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def account_key(account_id: str) -> str:
    """Key of an account record."""
    return f"accounts/{validate_id('account', account_id, 'account_id')}/account.json"


def deleting_key(account_id: str) -> str:
    """Key of an account's deletion tombstone."""
    return f"accounts/{validate_id('account', account_id, 'account_id')}/deleting.json"


def deleted_key(account_id: str) -> str:
    """Key of the record a finished account deletion leaves behind."""
    return f"deleted/{validate_id('account', account_id, 'account_id')}.json"


def machines_prefix(account_id: str) -> str:
    """Prefix of an account's machine records."""
    return f"accounts/{validate_id('account', account_id, 'account_id')}/machines/"


def revoked_prefix(account_id: str) -> str:
    """Prefix of an account's machine revocation markers."""
    return f"accounts/{validate_id('account', account_id, 'account_id')}/revoked/"


def machine_revoked_key(account_id: str, machine_id: str) -> str:
    """The create-only marker of a revoked machine: its record put back at an older,
    unrevoked version is still revoked while this exists."""
    return revoked_prefix(account_id) + validate_id("machine", machine_id, "machine_id") + ".json"


_SERIAL: Final = re.compile(r"\A[0-9a-f]{1,40}\Z")


def retired_serial_key(account_id: str, machine_id: str, serial: str) -> str:
    """The create-only marker of a certificate serial a machine no longer accepts
    (renewed past, or replaced by a repair): a record put back at an older version
    naming it still refuses it while this exists."""
    if not isinstance(serial, str) or not _SERIAL.match(serial):
        raise InvalidArgument("serial", "not a certificate serial (hex)")
    acct = validate_id("account", account_id, "account_id")
    machine = validate_id("machine", machine_id, "machine_id")
    return f"accounts/{acct}/retired/{machine}/{serial}.json"


def machine_key(account_id: str, machine_id: str) -> str:
    """Key of a machine record."""
    return machines_prefix(account_id) + validate_id("machine", machine_id, "machine_id") + ".json"


def presence_key(account_id: str, machine_id: str) -> str:
    """Key of a machine's last-seen record."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/presence/{validate_id('machine', machine_id, 'machine_id')}.json"


def roster_key(account_id: str, machine_id: str) -> str:
    """Key of a machine's agent roster (controlplane.machines.rosters)."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/rosters/{validate_id('machine', machine_id, 'machine_id')}.json"


def tokens_prefix(account_id: str) -> str:
    """Prefix of an account's join tokens."""
    return f"accounts/{validate_id('account', account_id, 'account_id')}/tokens/"


def token_uses_prefix(account_id: str, token_id: str) -> str:
    """Prefix of a join token's use markers: one create-only object per use taken,
    so a token record put back at an older use count grants no use again."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/token-uses/{validate_id('token', token_id, 'token_id')}/"


def token_use_key(account_id: str, token_id: str, use_id: str) -> str:
    """Key of one use of a join token (``use_id``: the join's intent id)."""
    return token_uses_prefix(account_id, token_id) + validate_id("intent", use_id, "use_id")


def token_key(account_id: str, token_id: str) -> str:
    """Key of a join token record."""
    return tokens_prefix(account_id) + validate_id("token", token_id, "token_id") + ".json"


def machine_index_key(machine_id: str) -> str:
    """Key of the machine id -> account index entry."""
    return f"index/machines/{validate_id('machine', machine_id, 'machine_id')}.json"


def token_index_key(token_id: str) -> str:
    """Key of the token id -> account index entry."""
    return f"index/tokens/{validate_id('token', token_id, 'token_id')}.json"


def github_index_key(github_user_id: int) -> str:
    """Key of the GitHub user id -> account index entry."""
    return f"index/github/{int(github_user_id)}.json"


ACCOUNT_INDEX_PREFIX: Final = "index/accounts/"


def account_index_key(account_id: str) -> str:
    """Key of the account listing entry."""
    return ACCOUNT_INDEX_PREFIX + validate_id("account", account_id, "account_id") + ".json"


def credential_key(credential_id: str) -> str:
    """Key of an admin credential record."""
    return f"credentials/{validate_id('credential', credential_id, 'credential_id')}.json"


def audit_key(at: dt.datetime, audit_id: str) -> str:
    """Key of one audit record, grouped by UTC day."""
    day = at.astimezone(dt.UTC)
    return f"audit/{day:%Y/%m/%d}/{validate_id('audit', audit_id, 'audit_id')}.json"


class _Record:
    """JSON (de)serialisation shared by the records: datetimes as ISO strings."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, dt.datetime):
                value = utc_iso(value)
            elif isinstance(value, bytes):
                value = value.hex()
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        kwargs: dict[str, Any] = {}
        hints = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        for name, f in hints.items():
            if name not in data:
                continue  # the dataclass default applies (older records)
            value = data[name]
            kind = str(f.type)
            if "datetime" in kind and isinstance(value, str):
                value = parse_time(value)
            elif "bytes" in kind and isinstance(value, str):
                value = bytes.fromhex(value)
            elif "tuple" in kind and isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except TypeError as e:  # a field missing: MAC'd, so ours, but not this version's
            raise IntegrityError(f"{cls.__name__.lower()} record", f"malformed: {e}") from None


def encode(record: _Record | dict[str, Any]) -> bytes:
    """A record (or a plain dict) as compact, sorted JSON bytes."""
    data = record.to_dict() if isinstance(record, _Record) else record
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes, key: str) -> dict[str, Any]:
    """Parse a JSON object from the store; anything else is an IntegrityError."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise IntegrityError(key, "not valid JSON") from None
    if not isinstance(data, dict):
        raise IntegrityError(key, "not a JSON object")
    return data


@dataclass(frozen=True)
class Account:
    """One person's account."""

    account_id: str
    github_user_id: int
    github_login: str
    signed_up_at: dt.datetime
    recovery_public_key: bytes
    """X25519 public key backups are also sealed to (32 bytes)."""
    state: str = "active"
    """"active" or "deleting" (the latter derived from the tombstone)."""


@dataclass(frozen=True)
class JoinToken(_Record):
    """A join token; only a hash of its secret is kept."""

    token_id: str
    account_id: str
    secret_hash: str
    created_at: dt.datetime
    expires_at: dt.datetime
    max_uses: int = 1
    uses: int = 0
    revoked: bool = False
    created_by: str = ""
    """The credential id that created it."""
    repair_machine_id: str = ""
    used_by: tuple[str, ...] = ()
    """Intent ids of the joins that took a use: a join rolled back gives its use back."""

    def state(self, now: dt.datetime) -> str:
        """ "revoked", "used", "expired" or "active", in that order of precedence."""
        if self.revoked:
            return "revoked"
        if self.uses >= self.max_uses:
            return "used"
        if now >= self.expires_at:
            return "expired"
        return "active"


@dataclass(frozen=True)
class Machine(_Record):
    """A joined machine."""

    machine_id: str
    account_id: str
    name: str
    hostname: str
    version: str
    joined_at: dt.datetime
    cert_serial: str
    """Serial (hex) of the newest client certificate."""
    cert_not_after: dt.datetime
    box_public_key: bytes = b""
    signing_public_key: bytes = b""
    previous_cert_serial: str = ""
    """The certificate before the last renewal: still accepted until it expires."""
    revoked: bool = False
    revoked_at: dt.datetime | None = None
    provider: str = ""
    token_id: str = ""
    """The join token it joined with."""
    join_intent: str = ""
    """Set while the join is not confirmed (the machine has not connected yet): such a
    machine is rolled back if it never connects (controlplane.machines.pairing)."""
    cert_ca_hash: str = ""
    """Pin of the CA that signed the current certificate ("" in records older than
    CA rollover: the CA of that time). A rollover retires the old CA only once no
    machine's current certificate names it."""

    def accepts_serial(self, serial: str) -> bool:
        """Whether a client certificate with ``serial`` may act as this machine."""
        return not self.revoked and serial in {self.cert_serial, self.previous_cert_serial} - {""}


@dataclass(frozen=True)
class Presence(_Record):
    """When a machine was last heard from, and what it said then."""

    machine_id: str
    last_seen_at: dt.datetime
    version: str = ""
    agent_count: int = 0
    next_fire_at: dt.datetime | None = None
    """The soonest schedule fire time it reported (to wake it for), or None."""
    online: bool = False
    """Written while its link was up (False: at its end, or by an older version)."""
    epoch: int = 0
    """The epoch of the control plane that wrote it (controlplane.machines.alive)."""


@dataclass(frozen=True)
class Credential(_Record):
    """An admin credential; only a hash of its secret is kept."""

    credential_id: str
    scope: str
    """"operator" or "account"."""
    account_id: str
    """The account for scope "account"; "" for the operator."""
    secret_hash: str
    created_at: dt.datetime
    label: str = ""
    revoked: bool = False


@dataclass(frozen=True)
class AuditRecord(_Record):
    """Who did what, when."""

    audit_id: str
    at: dt.datetime
    actor: str
    """A credential id, a machine id, or "system"."""
    action: str
    target: str
    account_id: str = ""
    outcome: str = "ok"


def account_to_dict(a: Account) -> dict[str, Any]:
    """The stored form of an account (state is not stored: the tombstone is)."""
    d = asdict(a)
    d.pop("state")
    d["signed_up_at"] = utc_iso(a.signed_up_at)
    d["recovery_public_key"] = a.recovery_public_key.hex()
    return d


def account_from_dict(d: dict[str, Any], state: str = "active") -> Account:
    """Inverse of :func:`account_to_dict`."""
    return Account(
        account_id=validate_id("account", str(d["account_id"])),
        github_user_id=int(d["github_user_id"]),
        github_login=str(d["github_login"]),
        signed_up_at=parse_time(str(d["signed_up_at"])),
        recovery_public_key=bytes.fromhex(str(d["recovery_public_key"])),
        state=state,
    )
