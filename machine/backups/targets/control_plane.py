"""Backups of a joined server, kept by the control plane: a BackupTarget over the link.

:class:`ControlPlaneTarget` turns the :class:`~shared.backup_target.BackupTarget`
calls of the backup engine into the MachineLink backup RPCs (through
:class:`~machine.link.client.LinkClient`, the one module that speaks the link).
The control plane takes this machine's identity from its client certificate;
``source`` names another machine of the same account to READ from (a
replacement box restoring a lost machine's backups before it took over the id).
Writes always go to the caller's own backups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc.aio

from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import SettingDiff, SettingsNote, settings_differ
from machine.core.agents import SessionHomes
from machine.link import identity
from machine.link.client import LinkClient
from machine.link.clock import handshake_clock_problem
from machine.storage.db import Database
from shared.atomic import ensure_private_dir
from shared.backup_target import MAX_LINK_MANIFEST, ManifestInfo, PruneResult, backup_order
from shared.crypto import BoxKeyPair
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    StoreError,
    TooLarge,
    TransientError,
)
from shared.limits import LINK_MAX_MESSAGE
from shared.rpc import domain_error, from_server
from shared.timestamps import Clock, utc_now

__all__ = ["ControlPlaneTarget", "RepairRestore", "newest_authentic", "restore_newest"]

logger = logging.getLogger(__name__)

#: A repair restore's staging folder in ``backup-work`` (+ the process id).
_REPAIR_STAGE: Final = ".restore-repair-"

#: Names per HaveSegments call (the control plane's bound, link.proto).
_HAVE_BATCH: Final = 10_000
#: Deadline of a small call; segment transfers get ``transfer_timeout``.
_CALL_TIMEOUT: Final = 60.0
_TRANSFER_TIMEOUT: Final = 3600.0


class ControlPlaneTarget:
    """A :class:`~shared.backup_target.BackupTarget` kept by the control plane."""

    #: The control plane writes over a stored segment when asked (PutSegment's
    #: ``replace``): one found damaged there is mended by the next backup.
    replaces_segments = True

    def __init__(
        self,
        client: LinkClient,
        *,
        clients: Callable[[], Awaitable[LinkClient]] | None = None,
        source: str = "",
        timeout: float = _CALL_TIMEOUT,
        transfer_timeout: float = _TRANSFER_TIMEOUT,
        where: str = "control plane",
        clock: Clock = utc_now,
    ) -> None:
        self._client = client
        self._clock = clock
        # A daemon's target follows certificate renewals and CA rollovers
        # (machine.link.following); a one-off restore uses ``client`` as it is.
        self._clients = clients
        self._where = where
        self._source = source
        self._timeout = timeout
        self._transfer = transfer_timeout

    async def _link(self) -> LinkClient:
        return await self._clients() if self._clients is not None else self._client

    def _error(self, exc: grpc.aio.AioRpcError) -> AgentsError:
        """The domain error of a failed call; one that reached no control plane
        says which one it tried (the CLI shows it as is)."""
        err = domain_error(exc)
        if isinstance(err, TransientError) and not from_server(exc):
            hint = ""
            if handshake_clock_problem(err):
                # gRPC names the failed date check only deep in its text: say
                # which clock judged it, so the fix (this machine's clock) is plain.
                hint = (
                    f"; the control plane's certificate failed the TLS date check by this"
                    f" machine's clock, which says {self._clock():%Y-%m-%d %H:%M:%S} UTC:"
                    " check it / NTP (timedatectl)"
                )
            return TransientError(f"{self._where}: unreachable ({err.message}){hint}")
        return err

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        wanted = sorted(set(names))
        out: dict[str, int] = {}
        try:
            for i in range(0, len(wanted), _HAVE_BATCH):
                batch = wanted[i : i + _HAVE_BATCH]
                out.update(await (await self._link()).have_segments(batch, timeout=self._timeout))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return out

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        try:
            # Size 0: the engine seals as it streams and does not know it yet.
            stored = await (await self._link()).put_segment(
                name, 0, data, timeout=self._transfer, replace=replace
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        if replace and stored == 0:
            # A control plane that predates `replace` keeps the stored copy (and
            # answers 0): the damaged segment must not be taken for mended.
            raise StoreError(
                f"{self._where}: kept its damaged copy of segment {name[:16]} (it does not"
                " replace segments: upgrade agents-control); the backup was not made"
            )

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        names = list(names)
        # Refused here with what to do, not as the link's RESOURCE_EXHAUSTED.
        if len(blob) > MAX_LINK_MANIFEST or len(blob) + 65 * len(names) > LINK_MAX_MESSAGE:
            raise TooLarge("manifest", MAX_LINK_MANIFEST, len(blob))
        try:
            await (await self._link()).put_manifest(backup_id, blob, names, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    async def list_manifests(self) -> list[ManifestInfo]:
        try:
            entries = await (await self._link()).list_backups(self._source, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        # The link lists newest first; the target contract is oldest first.
        return sorted(
            (ManifestInfo(e.backup_id, e.manifest_size) for e in entries),
            key=lambda m: backup_order(m.backup_id),
        )

    async def get_manifest(self, backup_id: str) -> bytes:
        try:
            return await (await self._link()).get_manifest(
                backup_id, self._source, timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in (await self._link()).get_segment(
                name, self._source, timeout=self._transfer
            ):
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    async def prune(self, keep: int) -> PruneResult:
        if self._source:
            raise ValueError("a target reading another machine's backups cannot prune")
        try:
            manifests, segments = await (await self._link()).prune(keep, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc
        return PruneResult(tuple(manifests), segments)


@dataclass(frozen=True)
class RepairRestore:
    """What restoring a repaired machine's newest backup did."""

    backup_id: str
    """Empty when the control plane kept no backup of the machine."""
    restored: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    attachments: int = 0
    refused: tuple[str, ...] = ()
    """Newer backups passed over: their manifest was refused (forged, altered)."""
    settings: tuple[SettingDiff, ...] = ()
    """The lost machine's settings that differ from this box's (shown, not applied)."""
    agent_settings: tuple[SettingsNote, ...] = ()
    """The agents restored without all of their runtime settings (withheld secrets)."""
    sessions: tuple[str, ...] = ()
    """What putting their CLI session files back said (InResult.sessions)."""


async def restore_newest(
    data_dir: Path,
    db: Database,
    attachments_dir: Path,
    recovery: BoxKeyPair,
    *,
    after_load: Callable[[], None] | None = None,
    settings: Mapping[str, str] | None = None,
    homes: SessionHomes | None = None,
) -> RepairRestore:
    """Restore this joined machine's newest backup kept by the control plane: its
    newest daily point that opens, and the increments shipped since; ``settings``:
    this box's (MachineConfig.backup_settings), to name the backed-up ones that differ.

    Run once after a repair join (the box took over a lost machine's id, so
    the backups are "its own"). Opened with the account recovery key only.
    The backup's naming key is not adopted: a manifest sealed to the recovery
    key proves nothing about who sealed it (anyone holding the public key can),
    and a forged one must not choose the keys of this machine's next backups.
    The next backup uploads every segment once, under the box's own key.
    The restore commits whole or not at all (machine.backups.restore); running it
    again skips the agents already restored.
    """
    link = await asyncio.to_thread(identity.load_link, data_dir)
    if recovery.public_key != link.account_recovery_public_key:
        raise InvalidArgument(
            "recovery_key", "this is not the recovery key of the account the machine joined"
        )
    keys = await asyncio.to_thread(identity.load_keys, data_dir)
    client = LinkClient.mutual(
        link.control_address,
        ca_pem=keys.ca_cert_pem,
        key_pem=keys.tls_key_pem,
        cert_pem=keys.tls_cert_pem,
    )
    async with contextlib.aclosing(client):
        target = ControlPlaneTarget(client, where=f"control plane {link.control_address}")
        backups = await target.list_manifests()
        if not backups:
            return RepairRestore("")
        work = data_dir / "backup-work"
        ensure_private_dir(work)
        # A repair restore killed midway left its stage (downloaded segments and
        # attachments): the join run again removes it (so does the daemon's start,
        # BackupService.sweep_stale, as the name starts with ".restore-").
        for stale in work.glob(f"{_REPAIR_STAGE}*"):
            if stale.is_dir() and not stale.is_symlink():
                await asyncio.to_thread(shutil.rmtree, stale, True)
        source = DatabaseBackupSource(db, attachments_dir, work)
        # Only fetch is used: the engine's own keys do not matter, the recovery key opens.
        engine = BackupEngine(
            source,
            target,
            machine_id=link.machine_id,
            naming_key=bytes(32),
            recipients=[recovery.public_key],
            keypair=recovery,
            work_dir=work,
            keep=1,
        )
        points = [b for b in backups if not b.increment]
        if not points:
            return RepairRestore("")
        _, refused = await newest_authentic(engine, points, recovery)
        # The newest point and the increments shipped since (continuous backups).
        chain = await engine.chain_at(None, recovery)
        newest = chain.backup_id
        stage = work / f"{_REPAIR_STAGE}{os.getpid()}"
        try:
            fetched = await engine.fetch_chain(chain, stage, recovery)
            result = await restore_fetched(
                db,
                fetched,
                attachments_dir=attachments_dir,
                erased=set(),
                after_load=after_load,
                homes=homes,
            )
            differ = settings_differ(fetched.manifest.settings, settings or {})
        finally:
            await asyncio.to_thread(shutil.rmtree, stage, True)
    logger.info("restored %d agents of backup %s", len(result.restored), newest)
    return RepairRestore(
        newest,
        result.restored,
        result.skipped_existing + result.skipped_erased,
        result.attachments,
        tuple(refused),
        differ,
        result.agent_settings,
        result.sessions,
    )


async def newest_authentic(
    engine: BackupEngine, backups: list[ManifestInfo], recovery: BoxKeyPair
) -> tuple[str, list[str]]:
    """The newest backup whose manifest opens, and the newer ones refused.

    A manifest the control plane refuses (its MAC: planted or altered in the
    bucket) or that does not open is passed over loudly: the machine's own
    newest genuine backup is the one to restore, and an older one restored
    first would make the newer one's agents "already here". IntegrityError
    when none opens. Other errors (the link down) are raised as they are.
    """
    refused: list[str] = []
    first: IntegrityError | None = None
    for info in reversed(backups):
        try:
            await engine.open(info.backup_id, recovery)
        except IntegrityError as e:
            logger.error("backup %s refused, trying the one before: %s", info.backup_id, e)
            refused.append(info.backup_id)
            first = first or e
            continue
        return info.backup_id, refused
    assert first is not None
    raise IntegrityError(
        "restore",
        f"none of the {len(backups)} backups the control plane keeps opens"
        f" (newest: {first.message})",
    )
