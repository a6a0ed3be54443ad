"""The machine's domain wired together: database, agents, attachments, run engine.

:func:`open_machine` is the one place that builds them, as an async context
manager, so the daemon, tests and benchmarks share the same construction and
shutdown order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from machine.backups.engine import BackupEngine
from machine.backups.handoff import Handoff
from machine.backups.keys import BackupKeys, load_backup_keys
from machine.backups.link_target import ControlPlaneTarget
from machine.backups.service import BackupMetrics, BackupService, parse_daily_time, same_device
from machine.config import MachineConfig
from machine.core.agents import AgentsService
from machine.core.attachments import AttachmentStore, remove_partial_uploads
from machine.core.runs import RunEngine
from machine.core.search_indexer import SearchIndexer
from machine.core.streams import StreamLimits
from machine.erasure.retention import Retention
from machine.erasure.service import ErasureService
from machine.link import identity
from machine.link.client import AgentRoster, LinkClient
from machine.link.deliveries import crash_after
from machine.metrics import MachineMetrics
from machine.models import AgentState, MachineIds
from machine.runtimes import RuntimeRegistry, default_registry
from machine.schedules.service import Scheduler, SchedulesService
from machine.storage import restored, tables
from machine.storage.db import Database
from machine.storage.faults import CheckResult
from shared.atomic import ensure_private_dir
from shared.backup_folder import FolderTarget
from shared.backup_target import BackupTarget
from shared.errors import (
    AgentsError,
    ConfigError,
    IntegrityError,
    InvalidArgument,
    InvalidId,
    InvalidState,
    NotFound,
)
from shared.ids import new_id, validate_id
from shared.store.folder import FolderStore

__all__ = ["Machine", "MachineStatus", "backup_target", "folder_backup_target", "open_machine"]

logger = logging.getLogger(__name__)

_PRUNE_EVERY = 3600.0


@dataclass(frozen=True)
class MachineStatus:
    """Counts for ``agents-machine status``."""

    data_dir: str
    machine_id: str
    joined: bool
    active_agents: int
    archived_agents: int
    open_runs: int
    waiting_runs: int
    runtimes: list[str]
    started_at: float
    schema_version: int
    attachment_limit: int = 0
    """The largest attachment taken, in bytes (0: not told, an older daemon)."""


@dataclass
class Machine:
    """Everything the servicer calls."""

    config: MachineConfig
    db: Database
    ids: MachineIds
    agents: AgentsService
    attachments: AttachmentStore
    runs: RunEngine
    runtimes: RuntimeRegistry
    started_at: float
    streams: StreamLimits
    metrics: MachineMetrics | None = None
    backups: BackupService | None = None
    handoff: Handoff | None = None
    erasure: ErasureService | None = None
    retention: Retention | None = None
    schedules: SchedulesService | None = None
    scheduler: Scheduler | None = None

    def require_schedules(self) -> SchedulesService:
        """Schedules (always built by :func:`open_machine`)."""
        if self.schedules is None:
            raise InvalidState("schedules", "this machine was opened without schedules")
        return self.schedules

    indexer: SearchIndexer | None = None

    @property
    def machine_id(self) -> str:
        """The canonical id: the control plane's once joined, else the local one."""
        return self.ids.canonical

    async def agent_count(self) -> int:
        """How many agents this machine holds, active or archived (one COUNT)."""
        return await self.db.read(tables.count_agents)

    async def agent_roster(self) -> AgentRoster:
        """Ids of the agents this machine runs prompts for (its own), by state,
        for the control plane (never names)."""
        agents = await self.agents.list(include_archived=True)
        mine = sorted((a for a in agents if a.local), key=lambda a: a.id)
        return AgentRoster(
            active=tuple(a.id for a in mine if a.state is AgentState.ACTIVE),
            archived=tuple(a.id for a in mine if a.state is AgentState.ARCHIVED),
        )

    async def status(self) -> MachineStatus:
        """Current counts."""

        def read(conn: sqlite3.Connection) -> tuple[int, int, int, int]:
            counts = tables.state_counts(conn, "agents")
            runs = tables.state_counts(conn, "runs")
            open_runs = sum(runs.get(s, 0) for s in ("queued", "running", "waiting_permission"))
            return (
                counts.get("active", 0),
                counts.get("archived", 0),
                open_runs,
                runs.get("waiting_permission", 0),
            )

        active, archived, open_runs, waiting = await self.db.read(read)
        return MachineStatus(
            data_dir=str(self.config.data_dir),
            machine_id=self.ids.canonical,
            joined=self.ids.joined,
            active_agents=active,
            archived_agents=archived,
            open_runs=open_runs,
            waiting_runs=waiting,
            runtimes=self.runtimes.names(),
            started_at=self.started_at,
            schema_version=self.db.schema_version,
            attachment_limit=self.config.attachment_limit,
        )

    async def check_database(self) -> CheckResult:
        """Run a full integrity check of machine.db now (damage stops writes)."""
        result = await self.db.check(full=True)
        if self.metrics is not None:
            self.metrics.observe_check("full", result.ok, result.seconds)
        return result

    def require_backups(self) -> BackupService:
        """The backup service (always built by :func:`open_machine`)."""
        if self.backups is None:
            raise InvalidState("backups", "this machine was opened without backups")
        return self.backups

    def require_handoff(self) -> Handoff:
        """Exports and imports (always built by :func:`open_machine`)."""
        if self.handoff is None:
            raise InvalidState("export", "this machine was opened without Outgoing/Incoming")
        return self.handoff

    @contextlib.asynccontextmanager
    async def backups_at(self, from_dir: str = "") -> AsyncIterator[BackupEngine]:
        """The engine on the configured target, or on the backup folder ``from_dir``
        (a copied backup dir, perhaps of a lost machine: its ``machine.json`` says whose)."""
        service = self.require_backups()
        if not from_dir:
            yield service.engine
            return
        folder = Path(from_dir)
        if not folder.is_absolute() or not folder.is_dir():
            raise InvalidArgument("--from", f"{from_dir[:200]!r} is not an existing folder")
        # Looked at before the folder store opens it (which makes the folder
        # private and sweeps stale temp files): a wrong folder is left as it was.
        if not (folder / _OWNER_KEY).is_file():
            raise InvalidArgument("--from", f"{folder} is not a backup folder (no {_OWNER_KEY})")
        target, folder_store = await folder_backup_target(folder)
        try:
            machine_id = await _read_backup_owner(folder_store, folder)
            yield service.engine_for(target, machine_id)
        finally:
            await folder_store.close()

    def require_erasure(self) -> ErasureService:
        """Agent erasure (always built by :func:`open_machine`)."""
        if self.erasure is None:
            raise InvalidState("erasure", "this machine was opened without erasure")
        return self.erasure

    async def prune(self) -> int:
        """Run the retention sweeps; return how many machine log entries went."""
        if self.retention is not None:
            return (await self.retention.sweep()).log_entries
        cutoff = time.time() - self.config.event_retention_days * 86400
        return await self.db.write(lambda c: tables.prune_log(c, cutoff))


# Settings keys: the id made with the database (never changes), every id this
# machine has had (JSON list, oldest first), and the last id a control plane gave.
_LOCAL_ID = "machine_id"
_OWN_IDS = "own_machine_ids"
_JOINED_ID = "joined_machine_id"


def _joined_id(data_dir: Path) -> tuple[bool, str | None]:
    """(joined, the control plane's id for us) from ``link.json``.

    A damaged ``link.json`` still means joined; its id is then unknown here
    and the one recorded at an earlier start is used (see _machine_ids).
    """
    if not identity.is_joined(data_dir):
        return False, None
    try:
        return True, identity.load_link(data_dir).machine_id
    except AgentsError as e:
        logger.error("cannot read the control-plane link record: %s", e)
        return True, None


def _machine_ids(conn: sqlite3.Connection, joined: bool, link_id: str | None) -> MachineIds:
    """Record ids first seen now and return who this machine is.

    The id made with the database stays one of this machine's own ids for
    ever, so agents created before a join still run after it.
    """
    local = tables.get_setting(conn, _LOCAL_ID)
    if local is None:
        local = new_id("machine")
        tables.set_setting(conn, _LOCAL_ID, local)
    raw = tables.get_setting(conn, _OWN_IDS)
    own: list[str] = [str(i) for i in json.loads(raw)] if raw else [local]
    if local not in own:
        own.insert(0, local)
    if link_id is not None:
        if link_id not in own:
            logger.info("machine id %s (given at join) recorded as this machine's", link_id)
            own.append(link_id)
        if tables.get_setting(conn, _JOINED_ID) != link_id:
            tables.set_setting(conn, _JOINED_ID, link_id)
    encoded = json.dumps(own)
    if raw != encoded:
        tables.set_setting(conn, _OWN_IDS, encoded)
    canonical = local
    if joined:
        canonical = link_id or tables.get_setting(conn, _JOINED_ID) or local
    return MachineIds(canonical=canonical, own=frozenset(own), joined=joined)


async def _check_loop(machine: Machine) -> None:
    while True:
        await asyncio.sleep(machine.config.integrity_check_seconds)
        try:
            result = await machine.check_database()
        except Exception:
            logger.exception("the integrity check of machine.db failed to run")
            continue
        if result.ok:
            logger.info("integrity check of machine.db: ok (%.1f s)", result.seconds)


async def _prune_loop(machine: Machine) -> None:
    while True:
        try:
            removed = await machine.prune()
            if removed:
                logger.info("pruned %d machine log entries", removed)
        except Exception:
            logger.exception("pruning the machine log failed")
        await asyncio.sleep(_PRUNE_EVERY)


#: In a backup folder: whose backups it holds (manifests are sealed with that id).
_OWNER_KEY = "machine.json"


async def _read_backup_owner(folder_store: FolderStore, folder: Path) -> str:
    try:
        record = json.loads(await folder_store.get(_OWNER_KEY))
        return validate_id("machine", record["machine_id"], "machine_id")
    except NotFound:
        raise InvalidArgument(
            "--from", f"{folder} is not a backup folder (no {_OWNER_KEY})"
        ) from None
    except (ValueError, KeyError, TypeError, InvalidId, IntegrityError):
        raise InvalidArgument("--from", f"{folder}/{_OWNER_KEY} is damaged") from None


def check_backup_folder(folder: Path, data_dir: Path) -> None:
    """Refuse a configured backup folder that is not one to make private and sweep:
    a file, the data folder or a folder holding it, one of the daemon's own
    folders in it (``keys/``: a copy of the backups would carry the private keys),
    or a folder with other files in it (a new disk's ``lost+found`` and what a
    first start that stopped midway leaves, hidden temp and lock files, are not
    others)."""

    def refuse(why: str) -> ConfigError:
        return ConfigError("backup_dir", f"{folder}: {why}")

    try:
        where, data = folder.resolve(), data_dir.resolve()
        if where.exists() and not where.is_dir():
            raise refuse("not a folder")
        if data.is_relative_to(where):
            raise refuse("holds the data folder; give the backups a folder of their own")
        if where.is_relative_to(data / "keys"):
            raise refuse("inside the keys folder; a copy of the backups would carry the keys")
        if any(where.is_relative_to(data / own) for own in _DAEMON_FOLDERS):
            raise refuse("one of the daemon's own folders; give the backups a folder of their own")
        if where.is_dir() and not (where / _OWNER_KEY).is_file():
            with os.scandir(where) as entries:
                others = [e.name for e in entries if not _ignorable(e.name)]
            if others:
                raise refuse(
                    f"not empty and not a backup folder (no {_OWNER_KEY}); give an empty or"
                    " new folder"
                )
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or e})") from None


#: The daemon's own folders in the data folder, never a backup folder.
_DAEMON_FOLDERS: Final = ("attachments", "backup-work", "Incoming", "Outgoing")


def _ignorable(name: str) -> bool:
    """In a would-be backup folder: a new file system's lost+found, or the store's
    lock file and machine.json's temp file (a first start that stopped midway)."""
    return name in ("lost+found", ".lock") or _OWNER_TEMP.fullmatch(name) is not None


#: machine.json's temp file while it is written (shared.atomic's naming).
_OWNER_TEMP: Final = re.compile(r"\.machine\.json\.[0-9a-f]{12}\.tmp")


async def _record_backup_owner(folder_store: FolderStore, folder: Path, machine_id: str) -> None:
    """Name the machine whose backups ``folder`` holds, so a copy restores elsewhere."""
    try:
        owner = await _read_backup_owner(folder_store, folder)
    except InvalidArgument:
        owner = ""
    if owner and owner != machine_id:
        logger.warning(
            "backup folder %s holds machine %s's backups; this machine is %s",
            folder,
            owner,
            machine_id,
        )
        return
    if not owner:
        await folder_store.put(_OWNER_KEY, json.dumps({"machine_id": machine_id}).encode())


async def folder_backup_target(
    folder: Path, after_delete: Callable[[], None] | None = None
) -> tuple[BackupTarget, FolderStore]:
    """A backup target in ``folder`` (a stand-alone machine's, or a copied backup dir)."""
    store_ = await FolderStore.open(folder)
    return FolderTarget(store_, after_delete=after_delete), store_


async def backup_target(
    config: MachineConfig, ids: MachineIds, closing: list[Callable[[], Awaitable[None]]]
) -> tuple[BackupTarget, str]:
    """The machine's backup target and a name for ``status``; what to close goes to ``closing``.

    Stand-alone: the folder ``config.backups_dir``. Joined: the control plane
    (``ControlPlaneTarget`` over a mutual-TLS link client), which keeps the
    sealed backups in its store without being able to open them. The one
    place that chooses the target.
    """
    if ids.joined:
        try:
            link = await asyncio.to_thread(identity.load_link, config.data_dir)
            keys = await asyncio.to_thread(identity.load_keys, config.data_dir)
        except AgentsError as e:
            logger.warning(
                "joined, but the link record cannot be read (%s): backing up to %s",
                e,
                config.backups_dir,
            )
        else:
            client = LinkClient.mutual(
                link.control_address,
                ca_pem=keys.ca_cert_pem,
                key_pem=keys.tls_key_pem,
                cert_pem=keys.tls_cert_pem,
            )
            closing.append(client.aclose)
            where = f"control plane {link.control_address}"
            return ControlPlaneTarget(client, where=where), where
    await asyncio.to_thread(check_backup_folder, config.backups_dir, config.data_dir)
    try:
        target, folder = await folder_backup_target(
            config.backups_dir, crash_after(config.crash_in_prune_after, "objects pruned")
        )
    except OSError as e:  # a parent that is a file, a read-only or virtual file system
        raise ConfigError(
            "backup_dir", f"{config.backups_dir}: cannot be made or opened ({e.strerror or e})"
        ) from None
    closing.append(folder.close)
    await _record_backup_owner(folder, config.backups_dir, ids.canonical)
    return target, f"folder {config.backups_dir}"


def backup_warnings(config: MachineConfig, target: BackupTarget) -> tuple[str, ...]:
    """What ``status`` warns of about where backups go."""
    if isinstance(target, ControlPlaneTarget):
        return ()  # off the machine: the folder is not used
    if same_device(config.backups_dir, config.data_dir):
        return (
            f"the backup folder {config.backups_dir} is on the same device as the data: "
            "a failed disk loses both (set backup_dir to another disk)",
        )
    return ()


async def _build_backups(
    config: MachineConfig,
    db: Database,
    ids: MachineIds,
    metrics: MachineMetrics | None,
    closing: list[Callable[[], Awaitable[None]]],
) -> BackupService:
    keys: BackupKeys = await asyncio.to_thread(load_backup_keys, config.data_dir)
    target, name = await backup_target(config, ids, closing)
    service = BackupService(
        db,
        target,
        target_name=name,
        machine_id=ids.canonical,
        keys=keys,
        data_dir=config.data_dir,
        attachments_dir=config.attachments_dir,
        keep=config.backup_keep,
        daily_at=parse_daily_time(config.backup_time),
        metrics=BackupMetrics(metrics.registry) if metrics is not None else None,
        warnings=await asyncio.to_thread(backup_warnings, config, target),
        after_load=crash_after(config.crash_in_transfer_after, "agents loaded in a transfer"),
    )
    await asyncio.to_thread(service.sweep_stale)
    try:
        await service.load_last()
    except AgentsError as e:
        logger.warning("cannot list the stored backups at start: %s", e)
    return service


def _backup_times(service: BackupService) -> Callable[[], Awaitable[list[float]]]:
    async def times() -> list[float]:
        return [m.created_at for _, m in await service.engine.list() if m is not None]

    return times


@contextlib.asynccontextmanager
async def open_machine(
    config: MachineConfig,
    *,
    metrics: MachineMetrics | None = None,
    runtimes: RuntimeRegistry | None = None,
    clock: Callable[[], float] = time.time,
) -> AsyncIterator[Machine]:
    """Open the data folder and database, recover runs, and yield the machine.

    ``clock`` is the time the retention sweeps and erasures read (tests move it).

    On exit, runs get ``config.shutdown_grace_seconds`` to end, then are
    interrupted; runs waiting for a person stay waiting.
    """
    ensure_private_dir(config.data_dir)
    ensure_private_dir(config.attachments_dir)
    # No upload runs yet: any upload temp file is left over from a killed process.
    await asyncio.to_thread(remove_partial_uploads, config.attachments_dir)
    db = await Database.open(
        config.db_path,
        on_commit=metrics.observe_commit if metrics is not None else None,
        on_fault=metrics.observe_fault if metrics is not None else None,
    )
    if metrics is not None:
        metrics.db_damaged.set(0)
        if db.open_check is not None:
            metrics.observe_check("quick", db.open_check.ok, db.open_check.seconds)
    loops: list[asyncio.Task[None]] = []
    closing: list[Callable[[], Awaitable[None]]] = []
    engine: RunEngine | None = None
    try:
        joined, link_id = await asyncio.to_thread(_joined_id, config.data_dir)
        ids = await db.write(lambda c: _machine_ids(c, joined, link_id))
        registry = runtimes or default_registry(
            claude_home=config.claude_home, codex_home=config.codex_home
        )
        attachments = AttachmentStore(
            db, config.attachments_dir, limit=config.attachment_limit, machine_id=ids.canonical
        )
        engine = RunEngine(
            db,
            ids=ids,
            runtimes=registry,
            attachments=attachments,
            prompt_limit=config.prompt_limit,
            metrics=metrics,
        )
        handoff = Handoff(
            db,
            machine_id=ids.canonical,
            own_ids=ids.own,
            after_load=crash_after(config.crash_in_transfer_after, "agents loaded in a transfer"),
            attachments_dir=config.attachments_dir,
            outgoing=config.outgoing_dir,
            incoming=config.incoming_dir,
            clock=clock,
        )
        backups = await _build_backups(config, db, ids, metrics, closing)
        erasure = ErasureService(
            db,
            ids=ids,
            runs=engine,
            registry=registry,
            attachments_dir=config.attachments_dir,
            metrics=metrics,
            backup_times=_backup_times(backups),
            clock=clock,
        )
        retention = Retention(
            db,
            attachments_dir=config.attachments_dir,
            erasure=erasure,
            handoff=handoff,
            log_days=config.event_retention_days,
            clock=clock,
        )
        machine = Machine(
            config=config,
            db=db,
            ids=ids,
            agents=AgentsService(db, ids=ids, runtimes=registry),
            attachments=attachments,
            runs=engine,
            runtimes=registry,
            started_at=clock(),
            streams=StreamLimits(
                per_client=config.max_streams_per_client,
                total=config.max_streams,
                metrics=metrics,
            ),
            metrics=metrics,
            backups=backups,
            handoff=handoff,
            erasure=erasure,
            retention=retention,
        )
        scheduler = Scheduler(
            db,
            engine,
            ids=ids,
            metrics=metrics,
            test_seconds=config.schedule_test_seconds,
        )
        machine.scheduler = scheduler
        machine.schedules = SchedulesService(
            db,
            ids=ids,
            prompt_limit=config.prompt_limit,
            default_zone=config.time_zone,
            on_change=scheduler.changed,
            test_seconds=config.schedule_test_seconds,
        )
        # Always on (not a timer but unfinished work): resumes a killed daemon's backlog
        # (restored histories to load, then to index); packs no history is in go first.
        await restored.sweep_packs(db)
        machine.indexer = SearchIndexer(
            db,
            registry=metrics.registry if metrics is not None else None,
            after_load=crash_after(config.crash_in_history_load_after, "restored histories loaded"),
        )
        if machine.backups is not None:
            machine.backups.on_restored = machine.indexer.kick
        loops.append(asyncio.create_task(machine.indexer.run(), name="machine-search-indexer"))
        # Exports and imports a killed daemon left behind for over an hour go now.
        await handoff.sweep()
        # Bytes a delete left behind (a crash after its commit), then every
        # retention rule: exports and imports a killed daemon left for over an
        # hour, unnamed attachments, old log and erased-list entries.
        await erasure.finish_pending()
        await retention.sweep()
        await erasure.refresh_gauges()
        interrupted = await engine.start()
        if interrupted:
            logger.warning(
                "%d run(s) were in flight at the last stop: marked interrupted", interrupted
            )
        if config.scheduler:
            # After the engine's recovery: a fire's run recorded before a crash is
            # started by the engine, and the scheduler sees the fire as recorded.
            loops.append(asyncio.create_task(scheduler.run(), name="machine-scheduler"))
        # Not a periodic job: queued runtime erasures get their one try per start.
        loops.append(asyncio.create_task(erasure.queue.run(), name="machine-erasure-queue"))
        if config.background_loops:
            loops.append(asyncio.create_task(_prune_loop(machine), name="machine-log-prune"))
            loops.append(asyncio.create_task(_check_loop(machine), name="machine-db-check"))
            if machine.backups is not None:
                loops.append(
                    asyncio.create_task(machine.backups.run_daily(), name="machine-backup-daily")
                )
        yield machine
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if engine is not None:
            await engine.close(config.shutdown_grace_seconds)
        for close in closing:
            await close()
        await db.close()
