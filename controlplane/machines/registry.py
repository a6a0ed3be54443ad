"""Machine records: register at join, read with authorisation, rename, revoke, renew.

A revocation is written twice: a create-only marker
(``accounts/<a>/revoked/<mc>.json``) first, then the record's ``revoked``. A
bucket writer can put the record back at an older, unrevoked version (the MAC
cannot tell), but cannot take the marker away without delete rights: every
read of a record looks for the marker too, so the machine stays revoked (and a
revoke killed between the two writes has already taken effect).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.integrity import jsonstore
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intents
from controlplane.integrity.records import (
    Machine,
    machine_index_key,
    machine_key,
    machine_revoked_key,
    machines_prefix,
    retired_serial_key,
    revoked_prefix,
    utc_iso,
)
from controlplane.integrity.replays import ReplayLog
from shared.errors import (
    AgentsError,
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    MachineRevoked,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from shared.ids import new_id, validate_id
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now
from shared.tls import IssuedCert, PeerIdentity

__all__ = ["AuthorizedPeer", "MachineInfo", "MachineRegistry", "validate_name"]

logger = logging.getLogger(__name__)

_MAX_NAME: Final = 64
_MAX_VERSION: Final = 64
_MAX_HOSTNAME: Final = 253

RevokeHook = Callable[[str, str, str], Awaitable[None]]
"""Called with (account id, machine id, why) when a machine's certificate stops counting."""
ConfirmHook = Callable[[Machine, str], Awaitable[None]]
"""Called with the machine and its join's intent id once the machine confirmed its join."""

#: What a repaired machine's old box is told (not "revoked": the machine lives on).
SUPERSEDED = "certificate superseded: a new box took this machine over (machine repair)"
#: What a revoked machine is told.
REVOKED = "machine revoked by an administrator"


def validate_name(name: str, field: str = "name") -> str:
    """A machine name: 1..64 printable characters, trimmed."""
    if not isinstance(name, str):
        raise InvalidArgument(field, "must be a string")
    name = name.strip()
    if not name or len(name) > _MAX_NAME or not name.isprintable():
        raise InvalidArgument(field, f"must be 1-{_MAX_NAME} printable characters")
    return name


def _short_text(value: str, field: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise InvalidArgument(field, f"must be at most {limit} printable characters")
    return value


@dataclass(frozen=True)
class MachineInfo:
    """What a machine says about itself at join (validated by :meth:`validate`)."""

    name: str
    version: str
    hostname: str
    box_public_key: bytes = b""
    signing_public_key: bytes = b""

    def validate(self) -> MachineInfo:
        """Return a cleaned copy or raise InvalidArgument naming the field."""
        hostname = _short_text(self.hostname, "machine.hostname", _MAX_HOSTNAME)
        name = validate_name(self.name or hostname or "machine", "machine.name")
        version = _short_text(self.version, "machine.version", _MAX_VERSION)
        for field, key in (
            ("machine.box_public_key", self.box_public_key),
            ("machine.signing_public_key", self.signing_public_key),
        ):
            if key and len(key) != 32:
                raise InvalidArgument(field, "must be 32 bytes")
        return MachineInfo(name, version, hostname, self.box_public_key, self.signing_public_key)


@dataclass(frozen=True)
class AuthorizedPeer:
    """A machine that may act, with the certificate it presented, parsed once."""

    machine: Machine
    identity: PeerIdentity
    """What the presented certificate says (its serial may be the previous one)."""
    cert_pem: bytes
    """The presented certificate itself."""


class MachineRegistry:
    """Machines of every account, and the checks on a machine's certificate."""

    def __init__(
        self,
        store: ObjectStore,
        accounts: AccountService,
        auditor: Auditor,
        clock: Clock = utc_now,
        intents: Intents | None = None,
        replays: ReplayLog | None = None,
    ) -> None:
        self._store = store
        self._replays = replays if replays is not None else ReplayLog()
        self._accounts = accounts
        self._audit = auditor
        self._clock = clock
        self._intents = intents if intents is not None else Intents(store, clock)
        self._revoke_hooks: list[RevokeHook] = []
        self._confirm_hooks: list[ConfirmHook] = []
        self._join_hooks: list[Callable[[Machine], None]] = []
        # Revoked machine ids seen by this process: refused without a store read.
        self._revoked: set[str] = set()
        self.generation = 0
        """Moves whenever this process revokes or removes a machine record (what
        machines.fleet lists again for; a join it is told of, see on_join)."""

    def on_confirm(self, hook: ConfirmHook) -> None:
        """Call ``hook(machine, join intent id)`` once a machine's join is confirmed
        (after the write; an error it raises is logged, the confirmation stands)."""
        self._confirm_hooks.append(hook)

    def on_join(self, hook: Callable[[Machine], None]) -> None:
        """Call ``hook(machine)`` once a join wrote a new machine's record."""
        self._join_hooks.append(hook)

    def changed(self) -> None:
        """A machine record was added or removed outside this class (a join rolled back)."""
        self.generation += 1

    def on_revoke(self, hook: RevokeHook) -> None:
        """Call ``hook(account_id, machine_id)`` after a machine is revoked."""
        self._revoke_hooks.append(hook)

    @staticmethod
    def new_machine_id() -> str:
        """A fresh machine id (made before signing, as it goes into the certificate)."""
        return new_id("machine")

    async def register(
        self,
        account_id: str,
        machine_id: str,
        info: MachineInfo,
        cert: IssuedCert,
        token_id: str,
        join_intent: str = "",
    ) -> Machine:
        """Write a new machine's record and its id -> account index entry.

        With ``join_intent`` the join is held until :meth:`confirm` (the
        machine's first connection) commits that intent.
        """
        machine = Machine(
            machine_id=validate_id("machine", machine_id, "machine_id"),
            account_id=validate_id("account", account_id, "account_id"),
            name=info.name,
            hostname=info.hostname,
            version=info.version,
            joined_at=self._clock(),
            cert_serial=cert.serial,
            cert_not_after=cert.not_after,
            box_public_key=info.box_public_key,
            signing_public_key=info.signing_public_key,
            token_id=token_id,
            join_intent=join_intent,
            cert_ca_hash=cert.ca_hash,
        )
        await jsonstore.create(
            self._store, machine_index_key(machine_id), {"account_id": account_id}
        )
        if not await jsonstore.create(
            self._store, machine_key(account_id, machine_id), machine.to_dict()
        ):
            # Ids are fresh per join, so this is never a retry: refuse rather than
            # hand out a certificate whose serial no record accepts.
            raise AlreadyExists("machine", machine_id)
        for hook in self._join_hooks:
            hook(machine)
        await self._audit.record(token_id, "machine.join", machine_id, account_id)
        logger.info(
            "machine %s joined account %s",
            machine_id,
            account_id,
            extra={"machine_id": machine_id, "account_id": account_id, "token_id": token_id},
        )
        return machine

    async def repair(
        self,
        machine: Machine,
        info: MachineInfo,
        cert: IssuedCert,
        token_id: str,
        join_intent: str,
    ) -> Machine:
        """A new box takes over ``machine``'s id (a repair join, controlplane.machines.pairing).

        One write, the commit point: the record names the new certificate only
        (no previous serial), so the old box's certificates are refused from here
        on; its live link, if any, is closed.
        """

        def change(d: dict[str, Any]) -> dict[str, Any]:
            if d.get("revoked"):
                raise MachineRevoked("join: the machine to repair was revoked")
            return {
                **d,
                # The machine's name is the operator's (a rename, or its first
                # join): the new box takes over the machine, name and all.
                "name": d.get("name") or info.name,
                "hostname": info.hostname,
                "version": info.version,
                "cert_serial": cert.serial,
                "previous_cert_serial": "",
                "cert_not_after": utc_iso(cert.not_after),
                "cert_ca_hash": cert.ca_hash,
                "box_public_key": info.box_public_key.hex(),
                "signing_public_key": info.signing_public_key.hex(),
                "token_id": token_id,
                "join_intent": join_intent,
            }

        # The old box's serials first (fail closed: a repair is never undone), so a
        # record put back at its older version does not let the old box in again.
        current = await self._load(machine.account_id, machine.machine_id)
        await self._retire(current, current.cert_serial, current.previous_cert_serial)
        data = await jsonstore.update(
            self._store, machine_key(machine.account_id, machine.machine_id), change
        )
        await self._audit.record(token_id, "machine.repair", machine.machine_id, machine.account_id)
        # The old box may still be connected: close its stream (it hears why).
        for hook in self._revoke_hooks:
            await hook(machine.account_id, machine.machine_id, SUPERSEDED)
        logger.info("machine %s repaired: a new box took over its id", machine.machine_id)
        return Machine.from_dict(data)

    async def _load(self, account_id: str, machine_id: str) -> Machine:
        """The record, pending joins included; a refused (forged) one is NotFound."""
        try:
            data = await jsonstore.read(self._store, machine_key(account_id, machine_id))
        except (NotFound, IntegrityError):
            raise NotFound("machine", machine_id) from None
        machine = Machine.from_dict(data)
        if machine.machine_id != machine_id or machine.account_id != account_id:
            raise NotFound("machine", machine_id)
        return await self._with_marker(machine)

    async def _with_marker(self, machine: Machine) -> Machine:
        """``machine`` revoked when its revocation marker exists (see the module doc)."""
        if machine.revoked:
            return machine
        key = machine_revoked_key(machine.account_id, machine.machine_id)
        try:
            await self._store.get(key)
        except NotFound:
            return machine
        except IntegrityError:
            logger.warning("%s does not verify: ignored (a forgery, not a revocation)", key)
            return machine
        self._replays.report(
            "machine",
            f"machine {machine.machine_id}: its record says not revoked, its revocation "
            "marker says revoked (an older record put back, or a revoke killed mid-way): revoked",
        )
        return dataclasses.replace(machine, revoked=True)

    async def load_any(self, account_id: str, machine_id: str) -> Machine | None:
        """The record whatever its state (for roll-back and fsck), or None."""
        try:
            return await self._load(account_id, machine_id)
        except NotFound:
            return None

    async def _owner(self, machine_id: str) -> str:
        try:
            data = await jsonstore.read(self._store, machine_index_key(machine_id))
        except (NotFound, IntegrityError):
            raise NotFound("machine", machine_id) from None
        return validate_id("account", str(data.get("account_id", "")), "account_id")

    async def get(self, principal: Principal, machine_id: str) -> Machine:
        """One machine; NotFound when missing or not visible to ``principal``."""
        validate_id("machine", machine_id, "machine_id")
        account_id = await self._owner(machine_id)
        principal.visible_account(account_id, "machine", machine_id)
        return await self._load(account_id, machine_id)

    async def list(self, principal: Principal, account_id: str = "") -> list[Machine]:
        """Machines of one account, or of every account for the operator; oldest first.

        A machine whose join is not confirmed yet is listed (it is joining, not
        an orphan): it connects, or its join is rolled back and it goes.
        """
        out: list[Machine] = []
        for acct in await self._accounts.scope_ids(principal, account_id):
            records = await jsonstore.read_all(self._store, machines_prefix(acct), "machine")
            machines = [Machine.from_dict(d) for d in records]
            revoked = await self._revoked_markers(acct) if machines else set()
            out.extend(
                dataclasses.replace(m, revoked=True) if m.machine_id in revoked else m
                for m in machines
                if m.account_id == acct
            )
        return out

    async def _revoked_markers(self, account_id: str) -> set[str]:
        """Machine ids with a revocation marker in ``account_id`` (one listing)."""
        prefix = revoked_prefix(account_id)
        return {
            info.key[len(prefix) :].removesuffix(".json") async for info in self._store.list(prefix)
        }

    async def confirm(self, machine: Machine) -> Machine:
        """The machine connected with its certificate: commit its join (idempotent)."""
        intent_id = machine.join_intent
        if not intent_id:
            return machine
        cleared = False

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            nonlocal cleared
            if d.get("join_intent") != intent_id:
                return None
            cleared = True
            return {**d, "join_intent": ""}

        data = await jsonstore.update(
            self._store, machine_key(machine.account_id, machine.machine_id), change
        )
        # After the write, and only by the call that made it: a record a roll-back
        # deleted meanwhile never gets here. A crash before the hooks leaves the
        # intent, whose roll-back finds the join confirmed (and calls them itself).
        if cleared:
            confirmed = Machine.from_dict(data)
            for hook in self._confirm_hooks:
                try:
                    await hook(confirmed, intent_id)
                except AgentsError as e:  # the confirmation stands
                    logger.error("machine %s: after its join confirmed: %s", machine.machine_id, e)
        # The record no longer names the intent, so a crash here leaves an intent
        # whose roll-back finds the join confirmed and keeps it.
        await self._intents.commit_id(intent_id)
        logger.info(
            "machine %s: join confirmed",
            machine.machine_id,
            extra={"machine_id": machine.machine_id, "account_id": machine.account_id},
        )
        return Machine.from_dict(data)

    async def rename(self, principal: Principal, machine_id: str, name: str) -> Machine:
        """Rename a machine."""
        new_name = validate_name(name)
        machine = await self.get(principal, machine_id)

        def change(d: dict[str, Any]) -> dict[str, Any]:
            return {**d, "name": new_name}

        data = await jsonstore.update(
            self._store, machine_key(machine.account_id, machine_id), change
        )
        await self._audit.record(
            principal.credential_id, "machine.rename", machine_id, machine.account_id
        )
        return Machine.from_dict(data)

    async def revoke(self, principal: Principal, machine_id: str) -> Machine:
        """Revoke a machine: its certificates are refused and its stream closed. Idempotent."""
        machine = await self.get(principal, machine_id)
        now = self._clock()

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d.get("revoked"):
                return None
            return {**d, "revoked": True, "revoked_at": utc_iso(now)}

        # The marker first: it outlives a replayed record (module doc).
        marker = {"machine_id": machine_id, "revoked_at": utc_iso(now)}
        await jsonstore.create(
            self._store, machine_revoked_key(machine.account_id, machine_id), marker
        )
        data = await jsonstore.update(
            self._store, machine_key(machine.account_id, machine_id), change
        )
        self._revoked.add(machine_id)
        self.changed()
        await self._audit.record(
            principal.credential_id, "machine.revoke", machine_id, machine.account_id
        )
        for hook in self._revoke_hooks:
            await hook(machine.account_id, machine_id, REVOKED)
        return Machine.from_dict(data)

    async def authorize_peer(self, peer: PeerIdentity) -> Machine:
        """The machine a verified client certificate names, if it may still act.

        Unauthenticated when the machine is unknown, revoked, or the certificate
        is not its current (or previous) one; PermissionDenied when the account
        is being deleted or was deleted.
        """
        if peer.machine_id in self._revoked:
            raise MachineRevoked("link: machine revoked")
        try:
            machine = await self._load(peer.account_id, peer.machine_id)
        except NotFound:
            if await self._accounts.was_deleted(peer.account_id):
                # A machine offline during the deletion hears it now, the way a
                # connected one did (it stops reconnecting and keeps its data).
                raise PermissionDenied("link: account deleted") from None
            raise Unauthenticated("link: unknown machine") from None
        if machine.revoked:
            self._revoked.add(machine.machine_id)
            raise MachineRevoked("link: machine revoked")
        if not machine.accepts_serial(peer.serial):
            raise Unauthenticated("link: certificate superseded")
        if await self._retired(machine, peer.serial):
            self._replays.report(
                "machine",
                f"machine {machine.machine_id}: its record accepts certificate {peer.serial}, "
                "a retired serial (an older record put back): refused",
            )
            raise Unauthenticated("link: certificate superseded")
        # Its certificate proves the machine got the join reply: commit the join.
        machine = await self.confirm(machine)
        if await self._accounts.is_deleting(peer.account_id):
            raise PermissionDenied("link: account is being deleted")
        # A deletion that finished since the machine was read (it writes
        # deleted/<a> before it removes the tombstone read just now).
        if await self._accounts.was_deleted(peer.account_id):
            raise PermissionDenied("link: account deleted")
        return machine

    async def _retire(self, machine: Machine, *serials: str) -> None:
        """Create the retired-serial markers of ``serials`` (create-only, idempotent)."""
        for serial in serials:
            if serial:
                key = retired_serial_key(machine.account_id, machine.machine_id, serial)
                await jsonstore.create(self._store, key, {"serial": serial})

    async def _retired(self, machine: Machine, serial: str) -> bool:
        """Whether ``serial`` has a retired marker (a forged one does not count)."""
        key = retired_serial_key(machine.account_id, machine.machine_id, serial)
        try:
            await self._store.get(key)
        except NotFound:
            return False
        except IntegrityError:
            logger.warning("%s does not verify: ignored (a forgery, not a retirement)", key)
            return False
        return True

    def is_revoked(self, machine_id: str) -> bool:
        """Whether this process saw ``machine_id`` revoked."""
        return machine_id in self._revoked

    async def renewed(self, machine: Machine, cert: IssuedCert) -> Machine:
        """Record a renewed certificate; the previous one stays valid until it expires."""

        def change(d: dict[str, Any]) -> dict[str, Any]:
            if d.get("revoked"):
                raise MachineRevoked("link: machine revoked")
            return {
                **d,
                "previous_cert_serial": d.get("cert_serial", ""),
                "cert_serial": cert.serial,
                "cert_not_after": utc_iso(cert.not_after),
                "cert_ca_hash": cert.ca_hash,
            }

        # The serial that stops being accepted (the previous one) first: the box
        # holds the current one, so retiring it early refuses nobody.
        await self._retire(machine, machine.previous_cert_serial)
        data = await jsonstore.update(
            self._store, machine_key(machine.account_id, machine.machine_id), change
        )
        await self._audit.record(
            machine.machine_id, "machine.renew", machine.machine_id, machine.account_id
        )
        return Machine.from_dict(data)
