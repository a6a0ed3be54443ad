"""Key rotation without re-pairing: the server certificate, and a CA rollover.

**Server certificate** (:meth:`KeyRotation.rotate_server`): a new key and
certificate under the same CA, swapped into the home (controlplane.integrity.keys) and
into the live :class:`~controlplane.integrity.keys.KeyRing`; the TLS listeners read the
ring at each handshake, so new connections get the new certificate and
machines, which pin the CA, notice nothing.

**CA rollover** (:meth:`KeyRotation.rollover`), in two steps so that no machine
ever has to pair again:

1. *Start*: a new CA and a server certificate under it are written beside the
   current ones (the ``*-next`` home files). From then on every client
   certificate (join, renewal) is signed by the new CA; client certificates
   of both CAs are accepted; joins and renewals hand out both CAs (the pinned
   one first), which machines keep as their trusted set. The server keeps
   presenting the old chain, so a machine that was offline all along still
   connects. Every live link is told ``renew_now`` at once, and a machine
   that connects later with an old-CA certificate is told at connect
   (controlplane.machines.links); renewal is allowed at once for such a certificate.
2. *Retire* (``retire_old``): refused while any machine that is not revoked
   still holds a certificate of the old CA (its record's ``cert_ca_hash``).
   Then the deployment marker names the new CA (the old one stays accepted),
   the ``*-next`` files replace the current ones (commit point: the first
   rename, see controlplane.integrity.keys), and the listeners present the new chain
   and accept the new CA only. Machines trust it already (step 1).

Every key change ends in :meth:`KeyRotation._keys_changed`, which reseals the
key bundle (controlplane.recovery.keybundle) so a restore brings back the current keys.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from controlplane.access.principals import Principal
from controlplane.integrity.audit import Auditor
from controlplane.integrity.keys import (
    KeyRing,
    abort_ca_rollover,
    finish_ca_rollover,
    load_home_keys,
    replace_server_cert,
    start_ca_rollover,
)
from controlplane.integrity.trusted import move_deployment_ca
from controlplane.machines.links import CA_ROLLOVER_REASON
from controlplane.machines.presence import PresenceRegistry, RenewNowNotice
from controlplane.machines.registry import MachineRegistry
from controlplane.recovery.keybundle import reseal_key_bundle
from shared import tls
from shared.errors import AgentsError, InvalidState, TransientError
from shared.store.base import ObjectStore

__all__ = ["KeyRotation", "RolloverState", "ServerRotated"]

logger = logging.getLogger(__name__)

#: Rollover states reported to the operator.
ROLLING: Final = "rolling"
RETIRED: Final = "retired"


@dataclass(frozen=True)
class ServerRotated:
    """A new server certificate is in use."""

    not_after: dt.datetime
    serial: str


@dataclass(frozen=True)
class RolloverState:
    """Where a CA rollover stands."""

    state: str
    """``rolling`` (both CAs trusted) or ``retired`` (only the new CA is left)."""
    ca_hash: str
    """The new CA's pin (it signs every client certificate now)."""
    old_ca_hash: str
    """The CA being (or just) retired."""
    machines_pending: int
    """Machines not revoked whose current certificate is still of the old CA."""
    machines_notified: int
    """Live links told to renew by this call."""


class KeyRotation:
    """Rotates the serving control plane's TLS keys (see the module doc)."""

    def __init__(
        self,
        *,
        home: Path,
        server_names: Sequence[str],
        keyring: KeyRing,
        machines: MachineRegistry,
        presence: PresenceRegistry,
        auditor: Auditor,
        marker_store: ObjectStore,
        bundle_store: ObjectStore | None = None,
        on_result: Callable[[str, str], None] = lambda kind, result: None,
        on_resealed: Callable[[bool], None] = lambda sealed: None,
    ) -> None:
        self._home = home
        self._names = tuple(server_names)
        self._ring = keyring
        self._machines = machines
        self._presence = presence
        self._audit = auditor
        self._marker_store = marker_store
        self._bundle_store = bundle_store
        self._on_result = on_result
        self._on_resealed = on_resealed
        # One rotation at a time: each reads the home, writes it and swaps the ring.
        self._lock = asyncio.Lock()
        # Whether the last key change reached the sealed bundle; None: none yet, or
        # a deployment whose bundle cannot be kept (none, and no recovery key to
        # seal one: serve's start says so), which a rollover does not wait for.
        self._sealed: bool | None = None

    async def _keys_changed(self) -> None:
        """Every key change ends here: the sealed key bundle (``cp/keys.sealed``)
        follows the home, ``*-next`` CA files included, so a restore never
        brings back keys older than the ones machines were told to trust.

        The rotation itself has happened: a bundle that cannot be written is
        logged and shown by ``agents_cp_key_bundle_sealed`` (0), not raised.
        """
        if self._bundle_store is None:
            return
        try:
            await reseal_key_bundle(self._home, self._bundle_store)
        except InvalidState as e:
            logger.error("keys changed; there is no sealed key bundle to follow: %s", e)
            self._sealed = None
            self._on_resealed(False)
        except AgentsError as e:
            logger.error("keys changed but the sealed key bundle could not follow: %s", e)
            self._sealed = False
            self._on_resealed(False)
        else:
            self._sealed = True
            self._on_resealed(True)

    @property
    def pinned_ca_hash(self) -> str:
        """The pin new join commands print (the CA the server's chain presents)."""
        return self._ring.keys.ca_hash

    async def rotate_server(self, principal: Principal) -> ServerRotated:
        """Issue and serve a new server certificate under the current CA (operator only)."""
        principal.require_operator("cert rotate-server")
        async with self._lock, self._counted("server"):
            keys = self._ring.keys
            server = tls.issue_server_cert(keys.ca, self._names)
            await asyncio.to_thread(replace_server_cert, self._home, server)
            self._ring.replace(await asyncio.to_thread(load_home_keys, self._home))
            await self._keys_changed()
            await self._audit.record(principal.credential_id, "keys.rotate_server", "server")
            logger.info("server certificate rotated (same CA %s)", keys.ca_hash)
            pem = server.cert_pem
            return ServerRotated(tls.cert_not_after(pem), tls.cert_serial(pem))

    async def rollover(self, principal: Principal, *, retire_old: bool = False) -> RolloverState:
        """Start a CA rollover, or report on the one in progress; retire the old CA
        with ``retire_old`` once no machine depends on it (operator only).

        Idempotent: calling it again during a rollover starts nothing new, tells
        live links to renew again and reports how many machines are pending.
        """
        principal.require_operator("ca rollover")
        kind = "ca_retire" if retire_old else "ca_rollover"
        async with self._lock, self._counted(kind):
            keys = self._ring.keys
            if keys.next_ca is None:
                if retire_old:
                    raise InvalidState("ca rollover", "no CA rollover in progress to retire")
                await self._start(principal)
                keys = self._ring.keys
            assert keys.next_ca is not None
            old_hash, new_hash = keys.ca_hash, tls.ca_hash(keys.next_ca.cert_pem)
            waiting = await self._pending(principal, new_hash)
            pending = len(waiting)
            if not retire_old:
                if self._sealed is False:
                    await self._keys_changed()  # tried again, as a call again promises
                if self._sealed is False:
                    # Machines renewed under a CA the bundle does not hold would be
                    # refused after a restore from it: none is told to, yet.
                    raise TransientError(
                        "ca rollover: the new CA is made but the sealed key bundle "
                        "(cp/keys.sealed) could not be written, so no machine was told to "
                        "renew; run it again once the store answers"
                    )
                # Only the machines still on the old CA: one that renewed already
                # (a rollover run again) would ask with the certificate its link
                # opened with, be refused, and keep asking.
                notice = RenewNowNotice(CA_ROLLOVER_REASON)
                notified = sum(1 for m in waiting if self._presence.notify(m, notice))
                return RolloverState(ROLLING, new_hash, old_hash, pending, notified)
            if pending:
                raise InvalidState(
                    "ca rollover",
                    f"{pending} machine(s) still hold a certificate of the old CA; they renew "
                    "when they next connect (or revoke them), then retire again",
                )
            await self._retire(principal, new_hash)
            return RolloverState(RETIRED, new_hash, old_hash, 0, 0)

    async def _start(self, principal: Principal) -> None:
        next_ca = tls.make_ca()
        next_server = tls.issue_server_cert(next_ca, self._names)
        # COMMIT POINT: ca-next.pem, written last by start_ca_rollover.
        await asyncio.to_thread(start_ca_rollover, self._home, next_ca, next_server)
        # The bundle before the ring: the new CA signs nothing (renewals, joins)
        # that a restore from the bundle would not trust.
        await self._keys_changed()
        if self._sealed is False:
            await asyncio.to_thread(abort_ca_rollover, self._home)
            raise TransientError(
                "ca rollover: the sealed key bundle (cp/keys.sealed) could not be written, "
                "so no rollover was started; run it again once the store answers"
            )
        self._ring.replace(await asyncio.to_thread(load_home_keys, self._home))
        await self._audit.record(principal.credential_id, "keys.ca_rollover", "ca")
        logger.warning(
            "CA rollover started: new CA %s signs client certificates; the old one stays "
            "trusted until retired",
            tls.ca_hash(next_ca.cert_pem),
        )

    async def _retire(self, principal: Principal, new_hash: str) -> None:
        # The marker first: it keeps the old CA accepted, so a crash before the
        # home swap leaves a home that still opens its store.
        await move_deployment_ca(self._marker_store, new_hash)
        # COMMIT POINT: the first rename in finish_ca_rollover (finished at load).
        await asyncio.to_thread(finish_ca_rollover, self._home)
        self._ring.replace(await asyncio.to_thread(load_home_keys, self._home))
        await self._keys_changed()
        await self._audit.record(principal.credential_id, "keys.ca_retire", "ca")
        logger.warning("CA rollover finished: the old CA is retired; %s is the CA now", new_hash)

    async def _pending(self, principal: Principal, new_hash: str) -> list[str]:
        """The machines (ids) whose certificate is not yet of the new CA."""
        machines = await self._machines.list(principal)
        return [m.machine_id for m in machines if not m.revoked and m.cert_ca_hash != new_hash]

    def _counted(self, kind: str) -> _Counted:
        return _Counted(kind, self._on_result)


class _Counted:
    """Reports one rotation's result (ok / error) to the metrics callback."""

    def __init__(self, kind: str, on_result: Callable[[str, str], None]) -> None:
        self._kind = kind
        self._on_result = on_result

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self._on_result(self._kind, "ok")
        elif issubclass(exc_type, AgentsError):
            self._on_result(self._kind, "refused")
        else:
            self._on_result(self._kind, "error")
