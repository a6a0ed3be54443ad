"""``agents-control fsck``: find (and with ``repair``, fix) inconsistencies in the store.

Read-only by default. What it looks for (the finding's kind), and what
``repair`` does:

- ``deployment``: ``cp/deployment.json`` missing, forged or another
  deployment's. No repair: nothing else is checked (see docs/security.md).
- ``epoch``: ``cp/epoch.json`` missing, or older than the epoch this home
  held (deleted, or an older copy put back: :mod:`controlplane.recovery.fencing`).
  No repair (``--repair`` refuses to run): restore the record from the bucket's
  versions, or take the deployment over with ``restore``.
- ``unfinished``: an intent record, a multi-object change that did not commit
  (:mod:`controlplane.integrity.intents`). Repair rolls it back with its resolver.
- ``refused``: an object whose MAC does not verify (forged or altered). No
  repair: an operator looks at it.
- ``orphan_index``: an index entry whose record is missing. Repair deletes it.
- ``missing_index``: a record whose index entry is missing or points
  elsewhere. Repair writes it.
- ``mismatch``: a record whose content names other ids than its key. No repair.
- ``deleted_leftover``: any object under an account whose deletion finished
  (``deleted/<a>.json``), or an account credential of it: an upload that outlasted
  the last sweep and a crash before it looked. Repair deletes it.
- ``misplaced``: a queued prompt (``accounts/<a>/queue/<m>/<seq>.sealed``) or an
  acknowledged-prompt record (``queue-acked/``) whose MAC binds it to another key:
  a copy to a later sequence or another machine's queue (or a forgery). The queue
  refuses it and never delivers nor reads it, so repair deletes it.
- ``unknown``: a key of no shape the control plane writes
  (:mod:`controlplane.recovery.keyshapes` lists them all): nothing reads it.
  Repair deletes it only when it carries a MAC header that does not verify at its
  key (a genuine object copied there, or a forgery made to look like one) and it
  is not under a machine's backups. One without a MAC (someone's file) or with a
  MAC that verifies (written by this deployment: a newer version's shape?) is
  reported and kept.
- ``orphan``: a genuine object whose owner has no record: a machine's presence,
  roster, acknowledged-prompt record, revocation marker, retired serial, provider
  settings, queued prompt or backups; a token's use marker; an account credential
  of an account that does not exist. Repair deletes only presence, rosters and
  acknowledged-prompt records (rewritten from the machine's next connection, or
  answering retried sends to a machine nothing sends to any more). The markers
  stay: a record put back at an older version would count them (docs/security.md);
  so do provider settings, queued prompts and backups, which are their owner's.
  A machine's backups are reported once, under its backup prefix.
- ``replay``: a genuine record older than the markers that outlive it (a token
  saying fewer uses than its use markers, a machine saying not revoked beside its
  revocation marker): an older copy a bucket writer put back (or a revoke that
  did not finish). The control plane already refuses what it would grant; kept.
  A machine record naming a retired certificate is not reported: a renewal or
  repair killed after its marker leaves exactly that, and the marker wins.

A machine's backup manifests and their names lists are MAC'd too (a planted
backup would otherwise restore on a repair): one whose MAC does not match is
``refused``; one with no MAC at all is ``unmacd_backup``: written by a control
plane from before manifests were MAC'd, or planted. ``repair`` with
``vouch_backups`` (the CLI's ``--repair --vouch-backups``, once after upgrading,
on a store only this control plane wrote) MACs those; nothing else does. Backup
segments are not MAC'd (their manifest authenticates them) and are not read.

An account with a deletion tombstone (``accounts/<a>/deleting.json``) is a
deletion in progress, not an inconsistency: its objects and the index entries
naming it are not checked (the deletion removes entries before the records
they point to), and the report lists it under ``deleting``. Repair finishes
the deletion, as a restarted ``serve`` would (:mod:`controlplane.deletion.service`).

Repair runs the same roll-back code as ``serve`` does at start, so run it with
the daemon stopped (the CLI refuses ``--repair`` while ``serve`` runs): a live
daemon's in-flight change would look unfinished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Final

from controlplane.config import ControlConfig
from controlplane.integrity import jsonstore
from controlplane.integrity.intents import Intents, intent_key
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.records import (
    account_index_key,
    account_key,
    deleted_key,
    deleting_key,
    encode,
    github_index_key,
    machine_index_key,
    machine_key,
    machine_revoked_key,
    token_index_key,
    token_key,
    token_uses_prefix,
)
from controlplane.integrity.trusted import DEPLOYMENT_KEY, TrustedStore, open_trusted_store
from controlplane.recovery.fencing import EPOCH_KEY, Fence, read_home_id
from controlplane.recovery.keyshapes import KeyShape, shape_of
from controlplane.services import Services
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    StoreFenced,
    StoreUntrusted,
)
from shared.ids import is_valid_id
from shared.store.authenticated import MAC_HEADER, MAX_AUTHENTICATED_BYTES
from shared.store.base import ObjectStore, validate_key

__all__ = ["Finding", "FsckReport", "fsck_deployment", "run_fsck", "serving_pid"]

logger = logging.getLogger(__name__)

_ID = r"[0-9a-z]{26}"
_TOMBSTONE: Final = re.compile(rf"\Aaccounts/(acct_{_ID})/deleting\.json\Z")
_IN_ACCOUNT: Final = re.compile(rf"\Aaccounts/(acct_{_ID})/")
_DELETED: Final = re.compile(rf"\Adeleted/(acct_{_ID})\.json\Z")
#: Where machines' backups live: an unknown key there is never read nor removed.
_BACKUPS: Final = re.compile(r"\Aaccounts/[^/]+/backups/")
_DELETE_KIND: Final = "account.delete"


@dataclass(frozen=True)
class Finding:
    """One inconsistency."""

    kind: str
    """deployment, epoch, unfinished, refused, unmacd_backup, deleted_leftover,
    orphan_index, missing_index, mismatch, misplaced, unknown, orphan or replay."""
    key: str
    """The object concerned."""
    detail: str
    repaired: bool = False


@dataclass(frozen=True)
class FsckReport:
    """What one run found."""

    objects: int
    findings: tuple[Finding, ...]
    deleting: tuple[str, ...] = ()
    """Accounts whose deletion is in progress (tombstoned)."""

    @property
    def clean(self) -> bool:
        """Nothing found, or everything found was repaired."""
        return all(f.repaired for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` form."""
        return {
            "objects": self.objects,
            "clean": self.clean,
            "findings": [asdict(f) for f in self.findings],
            "deleting": list(self.deleting),
        }


class _Checker:
    def __init__(
        self,
        store: ObjectStore,
        intents: Intents,
        repair: bool,
        raw: ObjectStore | None = None,
        vouch: bool = False,
    ) -> None:
        self._store = store
        self._raw = raw
        self._vouch = vouch and repair
        self._intents = intents
        self._repair = repair
        self.findings: list[Finding] = []
        self._records: dict[str, dict[str, Any] | None] = {}
        self.deleting: frozenset[str] = frozenset()
        self.finished: set[str] = set()
        """Accounts whose deletion finished (an authentic ``deleted/<a>.json``)."""
        self.sizes: dict[str, int] = {}
        """Every listed key's size."""
        self.orphan_backups: dict[tuple[str, str], int] = {}
        """(account, machine) -> backup objects of a machine that has no record."""

    def add(self, kind: str, key: str, detail: str, repaired: bool = False) -> None:
        self.findings.append(Finding(kind, key, detail, repaired))

    async def read(self, key: str) -> dict[str, Any] | None:
        """The record at ``key``; None when missing; a refused one is reported once."""
        if key not in self._records:
            try:
                self._records[key] = await jsonstore.read(self._store, key)
            except NotFound:
                self._records[key] = None
            except IntegrityError as e:
                self._records[key] = None
                self.add("refused", key, e.reason)
        return self._records[key]

    async def verify(self, key: str) -> None:
        """Read an object that is not JSON (a backup manifest) to check its MAC."""
        try:
            await self._store.get(key)
        except NotFound:
            pass  # deleted since the listing
        except IntegrityError as e:
            stored = await self._raw.get(key) if self._raw is not None else MAC_HEADER
            if stored.startswith(MAC_HEADER):
                self.add("refused", key, e.reason)
                return
            if self._vouch:
                await self._store.put(key, stored)  # MAC'd as it is, by the operator's word
            self.add(
                "unmacd_backup",
                key,
                "written without a MAC (by a control plane before manifests were MAC'd, or"
                " planted); vouch with --repair --vouch-backups",
                self._vouch,
            )

    async def raw_get(self, key: str) -> bytes:
        """The stored bytes at ``key``, MAC header and all, nothing verified."""
        if self._raw is None:
            raise NotFound("object", key)
        return await self._raw.get(key)

    async def mac_refusal(self, key: str) -> str | None:
        """Why the object at ``key`` fails its MAC; None when it verifies or is gone."""
        try:
            await self._store.get(key)
        except NotFound:
            return None  # deleted since the listing (a prompt acknowledged meanwhile)
        except IntegrityError as e:
            return e.reason
        return None

    async def fix_write(self, kind: str, key: str, data: dict[str, Any], detail: str) -> None:
        if self._repair:
            await self._store.put(key, encode(data))
        self.add(kind, key, detail, self._repair)

    async def fix_delete(self, kind: str, key: str, detail: str) -> None:
        if self._repair:
            await self._store.delete(key)
        self.add(kind, key, detail, self._repair)


def serving_pid(cfg: ControlConfig) -> int | None:
    """The pid of a live ``serve`` of this home, if one runs (from serve.json)."""
    try:
        pid = int(json.loads(cfg.serve_path.read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pid


async def fsck_deployment(
    cfg: ControlConfig, *, repair: bool, vouch_backups: bool = False
) -> FsckReport:
    """Open the configured store with the home's keys and run :func:`run_fsck`."""
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        # The fence first: a superseded home (a restore elsewhere) repairs nothing,
        # and an epoch record missing or older than this home held is an alarm.
        home_id = read_home_id(cfg.home) or ""
        fence = Fence(trusted.authenticated, home_id, trusted.where, home=cfg.home)
        alarm: Finding | None = None
        try:
            held = await fence.hold_current()
        except StoreUntrusted as e:
            if repair:
                raise
            alarm = Finding("epoch", EPOCH_KEY, e.message)
        except StoreFenced:
            if repair:
                raise
        else:
            if repair and held:
                trusted.set_fence(fence)
        services = Services(cfg, trusted.store, keys, trusted.backups)
        report = await run_fsck(
            trusted, services.intents, repair=repair, vouch_backups=vouch_backups
        )
        if alarm is not None:
            report = dataclasses.replace(report, findings=(alarm, *report.findings))
        return report
    finally:
        await trusted.close()


async def run_fsck(
    trusted: TrustedStore, intents: Intents, *, repair: bool, vouch_backups: bool = False
) -> FsckReport:
    """Check every object of the store (see the module doc); repair when asked."""
    store = trusted.store
    try:
        await trusted.guard.verify()
        trusted.guard.check()
    except StoreUntrusted as e:
        return FsckReport(0, (Finding("deployment", DEPLOYMENT_KEY, e.message),))
    c = _Checker(store, intents, repair, trusted.backups, vouch_backups)
    # Unfinished changes first: rolling them back removes most other findings.
    for intent in await intents.pending():
        if intent.kind == _DELETE_KIND and await _tombstoned(c, intent.fields):
            if repair:
                await intents.resolve(intent)  # finishes the deletion
            continue  # a deletion in progress: reported through its tombstone below
        key = intent_key(intent.intent_id)
        detail = f"{intent.kind} started {intent.started_at} did not commit"
        done = repair and await intents.resolve(intent)
        if repair and not done:
            detail += " (waiting: the machine may still connect)"
        c.add("unfinished", key, detail, done)
    listed = [(info.key, info.size) async for info in store.list("")]
    keys = [key for key, _ in listed]
    c.sizes = dict(listed)
    # Only an authentic tombstone counts (a forged one is reported as refused).
    tombstoned = [m.group(1) for key in keys if (m := _TOMBSTONE.match(key))]
    # A finished deletion (only an authentic marker counts) leaves nothing under
    # the account: anything there landed after its last sweep (a write already
    # under way, then a crash before it looked for the deletion), or was put back
    # by a bucket writer, its tombstone too (the marker is written after the
    # sweep: a tombstone beside it is a crash before its removal, or a replay).
    finished = {m.group(1) for key in keys if (m := _DELETED.match(key))}
    c.finished = {a for a in finished if await c.read(deleted_key(a)) is not None}
    c.deleting = frozenset(
        [
            a
            for a in tombstoned
            if a not in c.finished and await c.read(f"accounts/{a}/deleting.json") is not None
        ]
    )
    for key in keys:
        try:
            validate_key(key)
        except InvalidArgument as e:
            # Only a writer with the bucket's own tools makes such a key (S3 lists it),
            # and no store call of ours can read or delete it.
            c.add("unknown", key, f"not a key the control plane can use ({e.reason}); kept")
            continue
        if (m := _IN_ACCOUNT.match(key)) and m.group(1) in c.deleting:
            continue
        if m and m.group(1) in c.finished:
            await c.fix_delete("deleted_leftover", key, "left under a deleted account")
            continue
        shape = shape_of(key)
        if shape is None:
            await _check_unknown(c, key)
        elif shape.name == "intent":
            if not repair:
                await c.read(key)  # a forged intent is reported, never resolved
        else:
            await _check_key(c, key, shape)
    for (acct, machine), count in sorted(c.orphan_backups.items()):
        c.add(
            "orphan",
            f"accounts/{acct}/backups/{machine}/",
            f"{count} backup object(s) of machine {machine}, which has no record; "
            "never removed by fsck (a machine's backups are its owner's to drop)",
        )
    return FsckReport(len(keys), tuple(c.findings), tuple(sorted(c.deleting)))


async def _tombstoned(c: _Checker, fields: dict[str, str]) -> bool:
    """Whether the account an ``account.delete`` intent names carries its tombstone
    (without one the intent is an ordinary unfinished change: repair drops it)."""
    acct = fields.get("account_id", "")
    return is_valid_id("account", acct) and await c.read(deleting_key(acct)) is not None


async def _check_key(c: _Checker, key: str, shape: KeyShape) -> None:
    name, acct = shape.name, shape.account_id
    if name == "account":
        await _check_account(c, key, acct)
    elif name == "index_account":
        if acct in c.deleting:
            return
        if await c.read(key) is not None and await c.read(account_key(acct)) is None:
            await c.fix_delete("orphan_index", key, f"account {acct} does not exist")
    elif name == "index_github":
        entry = await c.read(key)
        owner = str((entry or {}).get("account_id", ""))
        if entry is None or owner in c.deleting:
            return
        account = await c.read(account_key(owner)) if is_valid_id("account", owner) else None
        if account is None:
            await c.fix_delete("orphan_index", key, f"account {owner or '?'} does not exist")
    elif name in ("machine", "token"):
        ident = shape.machine_id if name == "machine" else shape.token_id
        await _check_owned(c, key, name, acct, ident)
    elif name == "index_machine":
        await _check_index(c, key, "machine", shape.machine_id)
    elif name == "index_token":
        await _check_index(c, key, "token", shape.token_id)
    elif name == "backup_manifest":
        await c.verify(key)
        await _note_backup_owner(c, acct, shape.machine_id)
    elif name == "backup_segment":
        # Not MAC'd (its manifest authenticates it) and never read here.
        await _note_backup_owner(c, acct, shape.machine_id)
    elif name == "queue_entry":
        await _check_queue_entry(c, key, shape)
    elif name in _OF_MACHINE:
        await _check_of_machine(c, key, shape)
    elif name == "token_use":
        await _check_token_use(c, key, shape)
    elif name == "credential":
        await _check_credential(c, key)
    elif name in _MACD_BLOBS:
        reason = await c.mac_refusal(key)
        if reason is not None:
            c.add("refused", key, reason)
    elif name not in ("deployment", "probe"):
        # Epoch, superseded markers, audit records, deletion records, tombstones:
        # they must verify.
        await c.read(key)


async def _check_account(c: _Checker, key: str, acct: str) -> None:
    data = await c.read(key)
    if data is None:
        return
    if data.get("account_id") != acct:
        c.add("mismatch", key, "names another account id")
        return
    if await c.read(account_index_key(acct)) is None:
        await c.fix_write("missing_index", account_index_key(acct), {}, f"{acct} unlisted")
    gid = int(data.get("github_user_id", 0) or 0)
    if gid > 0:
        owner = await c.read(github_index_key(gid))
        if owner is None:
            await c.fix_write(
                "missing_index",
                github_index_key(gid),
                {"account_id": acct},
                f"GitHub user {gid} -> {acct} missing",
            )


#: Objects that are not JSON but carry the record MAC.
_MACD_BLOBS: Final = frozenset({"key_bundle"})

#: Per-machine objects -> whether ``repair`` deletes one whose machine has no record.
#: Presence and rosters are rewritten from the machine's next connection, and the
#: acknowledged-prompt records only answer retried sends to that machine, which a
#: machine without a record never gets: garbage. The revocation and retired-serial
#: markers are what keeps a record put back at an older version refused, and a
#: machine's provider settings are the operator's: reported, never removed.
_OF_MACHINE: Final = {
    "presence": True,
    "roster": True,
    "queue_acked": True,
    "revoked": False,
    "retired": False,
    "provider": False,
}


async def _machine_exists(c: _Checker, acct: str, machine: str) -> bool:
    return await c.read(machine_key(acct, machine)) is not None


async def _check_of_machine(c: _Checker, key: str, shape: KeyShape) -> None:
    """An object that belongs to one machine: it verifies, and its machine exists."""
    if shape.name == "provider":
        reason = await c.mac_refusal(key)
        if reason is not None:
            c.add("refused", key, reason)
            return
    elif shape.name == "queue_acked":
        reason = await c.mac_refusal(key)
        if reason is not None:
            # The queue skips a record that does not verify (queue.idempotency): it
            # answers no retried send, so it is garbage wherever it came from.
            await c.fix_delete(
                "misplaced",
                key,
                f"an acknowledged-prompt record its MAC binds to another key (a copy, or "
                f"forged): {reason}; the queue never reads it",
            )
            return
    elif await c.read(key) is None:
        return  # refused (reported) or gone since the listing
    if await _machine_exists(c, shape.account_id, shape.machine_id):
        return
    detail = f"{shape.name} of machine {shape.machine_id}, which has no record"
    if _OF_MACHINE[shape.name]:
        await c.fix_delete("orphan", key, detail)
    else:
        c.add("orphan", key, detail + "; never removed by fsck (kept as it is)")


async def _check_token_use(c: _Checker, key: str, shape: KeyShape) -> None:
    """A token's use marker verifies; its token exists. Never removed: a marker is what
    keeps a token record put back at an older use count from granting the use again."""
    if await c.read(key) is None:
        return
    if await c.read(token_key(shape.account_id, shape.token_id)) is None:
        c.add(
            "orphan",
            key,
            f"use marker of token {shape.token_id}, which has no record; never removed "
            "by fsck (a token record put back would count it)",
        )


async def _check_credential(c: _Checker, key: str) -> None:
    """An admin credential verifies; an account credential's account exists."""
    data = await c.read(key)
    if data is None or data.get("scope") != "account":
        return
    acct = str(data.get("account_id", ""))
    if acct in c.deleting:
        return
    if acct in c.finished:
        # The deletion sweeps credentials before its marker: a later one is garbage.
        await c.fix_delete("deleted_leftover", key, f"a credential of deleted account {acct}")
    elif not is_valid_id("account", acct) or await c.read(account_key(acct)) is None:
        c.add("orphan", key, f"an account credential of account {acct or '?'}, which has no record")


async def _note_backup_owner(c: _Checker, acct: str, machine: str) -> None:
    """Count a backup object whose machine has no record (reported once per machine)."""
    if not await _machine_exists(c, acct, machine):
        c.orphan_backups[(acct, machine)] = c.orphan_backups.get((acct, machine), 0) + 1


async def _check_unknown(c: _Checker, key: str) -> None:
    """A key of no shape the control plane writes: nothing reads it. Repair removes it
    only when it claims to be ours and is not: it carries a MAC header that does not
    verify at its key (a genuine object copied there, or a forgery), outside the
    machines' backups. A MAC that verifies (a newer version's object) or none at all
    (someone else's file) is reported and kept."""
    detail = "no object of the control plane has a key of this shape"
    garbage = False
    if c.sizes.get(key, 0) <= MAX_AUTHENTICATED_BYTES and not _BACKUPS.match(key):
        try:
            stored = await c.raw_get(key)
        except NotFound:
            return  # deleted since the listing
        if stored.startswith(MAC_HEADER):
            reason = await c.mac_refusal(key)
            if reason is None:
                detail += "; its MAC verifies (written by this deployment: a newer version?)"
            else:
                detail += f"; {reason}"
                garbage = True
        else:
            detail += "; it carries no MAC (not written by the control plane)"
    if garbage:
        await c.fix_delete("unknown", key, detail)
    else:
        c.add("unknown", key, detail + "; never removed by fsck")


async def _check_queue_entry(c: _Checker, key: str, shape: KeyShape) -> None:
    """A queued prompt is MAC'd at its own key: anywhere else it is garbage."""
    reason = await c.mac_refusal(key)
    if reason is not None:
        await c.fix_delete(
            "misplaced",
            key,
            f"a queued prompt its MAC binds to another key (a copy, or forged): {reason}; "
            "the queue never delivers it",
        )
        return
    if not await _machine_exists(c, shape.account_id, shape.machine_id):
        c.add(
            "orphan",
            key,
            f"a prompt queued for machine {shape.machine_id}, which has no record; "
            "never removed by fsck",
        )


#: kind -> (its record's key, its index entry's key), for records owned by an account.
_OWNED: Final = {
    "machine": (machine_key, machine_index_key),
    "token": (token_key, token_index_key),
}


async def _check_owned(c: _Checker, key: str, kind: str, acct: str, ident: str) -> None:
    """A machine or token record: its ids match its key, its index entry points back."""
    data = await c.read(key)
    if data is None:
        return
    if data.get(f"{kind}_id") != ident or data.get("account_id") != acct:
        c.add("mismatch", key, f"names another {kind} or account id")
        return
    index_key = _OWNED[kind][1](ident)
    entry = await c.read(index_key)
    if entry is None or entry.get("account_id") != acct:
        await c.fix_write("missing_index", index_key, {"account_id": acct}, f"{ident} -> {acct}")
    await _check_replayed(c, key, kind, acct, ident, data)


async def _check_replayed(
    c: _Checker, key: str, kind: str, acct: str, ident: str, data: dict[str, Any]
) -> None:
    """A record older than the markers that outlive it: an older genuine copy put
    back. The control plane already refuses what it would grant (the markers win,
    counted in agents_cp_store_replays_refused_total); reported so the operator
    learns of the bucket writer. Kept: the record is genuine, only older."""
    if kind == "token":
        prefix = token_uses_prefix(acct, ident)
        markers = [k for k in c.sizes if k.startswith(prefix)]
        taken = sum([1 for k in markers if await c.read(k) is not None])
        uses = int(data.get("uses", 0) or 0)
        if taken > uses:
            c.add(
                "replay",
                key,
                f"says {uses} use(s) but {taken} use marker(s) exist: an older copy put "
                "back; the markers win (kept)",
            )
        return
    if not data.get("revoked") and await c.read(machine_revoked_key(acct, ident)) is not None:
        c.add(
            "replay",
            key,
            "says not revoked but its revocation marker exists (an older copy put back, "
            "or a revoke that did not finish): the machine is revoked (kept)",
        )


async def _check_index(c: _Checker, key: str, kind: str, ident: str) -> None:
    """A machine or token index entry: the record it names exists."""
    entry = await c.read(key)
    if entry is None:
        return
    acct = str(entry.get("account_id", ""))
    if acct in c.deleting:
        return
    if not acct.startswith("acct_") or await c.read(_OWNED[kind][0](acct, ident)) is None:
        await c.fix_delete("orphan_index", key, f"{kind} {ident} has no record")
