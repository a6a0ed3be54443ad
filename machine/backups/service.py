"""The machine's backups as a service: when they run, where they go, what is reported.

:class:`BackupService` owns one :class:`~machine.backups.engine.BackupEngine` on the
machine's target (a folder for a stand-alone machine, the control plane for a
joined one), runs it daily at a configured local time, runs a restore check
(open the newest backup, authenticate every chunk, compare it with the live
data) after each backup, restores, and keeps what ``status`` and the metrics
show: last backup, next run, last restore check.

With an ``interval`` (a joined machine: continuous backups, docs/backups.md)
it also ships an increment of what changed every ``interval`` seconds
(:meth:`BackupService.run_continuous`); an idle interval costs one query of
the agents' change markers and no request to the target.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from machine.backups.engine import BackupEngine, BackupResult, Progress
from machine.backups.keys import (
    BackupKeys,
    keep_standalone_recovery_key,
    new_standalone_recovery_key,
)
from machine.backups.reader import VerifyResult
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import InResult, settings_differ
from machine.core.agents import SessionHomes
from machine.formats.backup import BackupManifest
from machine.storage.db import Database
from machine.storage.tables import erasures as store_erasures
from machine.storage.tables import export as store_export
from shared.backup_target import BackupTarget
from shared.crypto import BoxKeyPair
from shared.errors import AgentsError, IntegrityError, InvalidArgument
from shared.ids import id_time_ms, is_increment
from shared.retry import retrying

__all__ = ["BackupMetrics", "BackupService", "BackupStatus", "RestoreCheck", "parse_daily_time"]

logger = logging.getLogger(__name__)

_DURATIONS: Final = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600)
#: A failed daily backup is tried again after this many seconds, doubling up
#: to :data:`_RETRY_MAX` (never past the next daily run): a control plane or
#: disk that is down at the daily time must not cost a whole day.
_RETRY_FIRST: Final = 300.0
_RETRY_MAX: Final = 3600.0
#: Until the stored backups could be listed once (the target was down at
#: start), they are listed again this often: the last success it shows (and
#: BackupTooOld watches) must not stay at "never".
_RELIST: Final = 60.0


_DAILY_TIME: Final = re.compile(r"([01]?[0-9]|2[0-3]):([0-5][0-9])", re.ASCII)


def parse_daily_time(text: str, field: str = "backup_time") -> dt.time:
    """``HH:MM`` (24-hour, local time) for the daily backup."""
    # ASCII digits, two for the minutes: int() would take "03:3", " 3:30" or other
    # scripts' digits.
    match = _DAILY_TIME.fullmatch(text)
    if match is None:
        raise InvalidArgument(field, f"{text[:16]!r} is not a time of day as HH:MM (00:00-23:59)")
    return dt.time(int(match[1]), int(match[2]))


class BackupMetrics:
    """Backup and restore-check metrics (names the alert rules in deploy/ use)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.last_success = Gauge(
            "agents_machine_backup_last_success_timestamp_seconds",
            "When the last successful backup finished (Unix time).",
            registry=registry,
        )
        self.backups = Counter(
            "agents_machine_backups", "Backups attempted, by result.", ["result"], registry=registry
        )
        self.duration = Histogram(
            "agents_machine_backup_duration_seconds",
            "Time to make one backup.",
            buckets=_DURATIONS,
            registry=registry,
        )
        self.uploaded_bytes = Counter(
            "agents_machine_backup_uploaded_bytes",
            "Sealed segment bytes sent to the target (reused segments are not sent).",
            registry=registry,
        )
        self.stored_bytes = Gauge(
            "agents_machine_backup_stored_bytes",
            "Stored size of the newest backup (its segments and manifest).",
            registry=registry,
        )
        self.check_ok = Gauge(
            "agents_machine_restore_check_ok",
            "1 when the last restore check opened the newest backup whole, 0 when it failed.",
            registry=registry,
        )
        self.check_last = Gauge(
            "agents_machine_restore_check_last_timestamp_seconds",
            "When the last restore check ran (Unix time).",
            registry=registry,
        )
        self.same_device = Gauge(
            "agents_machine_backup_same_device",
            "1 when backups go to a folder on the data folder's device (a failed disk"
            " loses both), 0 when they leave it (another disk, a bucket, the control plane).",
            registry=registry,
        )
        self.increments = Counter(
            "agents_machine_backup_increments",
            "Continuous backup increments shipped, by result.",
            ["result"],
            registry=registry,
        )
        self.last_increment = Gauge(
            "agents_machine_backup_last_increment_timestamp_seconds",
            "When the last continuous backup increment was committed (Unix time).",
            registry=registry,
        )
        self.check_duration = Histogram(
            "agents_machine_restore_check_duration_seconds",
            "Time to open and authenticate the newest backup.",
            buckets=_DURATIONS,
            registry=registry,
        )


@dataclass(frozen=True)
class RestoreCheck:
    """The outcome of opening the newest backup and comparing it with the live data."""

    ok: bool
    backup_id: str
    at: float
    seconds: float
    problem: str = ""


@dataclass(frozen=True)
class BackupStatus:
    """What ``status`` shows of backups."""

    target: str
    keep: int
    last_backup_at: float | None
    last_backup_id: str
    last_backup_bytes: int
    next_run_at: float
    last_check: RestoreCheck | None
    recovery_key: bool
    warnings: tuple[str, ...]
    increment_interval: float | None = None
    """Seconds between continuous backups' increments (None: daily only)."""
    last_increment_at: float | None = None
    """When the chain's newest increment was made (None: none since its point)."""


#: Staging folders in the work folder: a backup's (BackupEngine.backup_now) and a
#: restore's (BackupService.restore; a repair join's, machine.backups.targets.control_plane).
_STALE_PREFIXES: Final = (".stage-", ".restore-")


class BackupService:
    """Daily sealed backups of one machine, their restore checks, and restores."""

    def __init__(
        self,
        db: Database,
        target: BackupTarget,
        *,
        target_name: str,
        machine_id: str,
        keys: BackupKeys,
        data_dir: Path,
        attachments_dir: Path,
        keep: int,
        daily_at: dt.time,
        metrics: BackupMetrics | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        warnings: tuple[str, ...] = (),
        after_load: Callable[[], None] | None = None,
        settings: Mapping[str, str] | None = None,
        interval: float | None = None,
        homes: SessionHomes | None = None,
    ) -> None:
        """``interval``: seconds between continuous backups' increments (None: daily
        only); ``homes``: the CLIs' homes, whose agents' session files backups carry
        and restores put back."""
        self._db = db
        self._homes = homes
        # The machine's non-secret settings: each backup carries them, and a
        # restore names those of the backup that differ (MachineConfig.backup_settings).
        self._settings = dict(settings or {})
        self.interval = interval
        self._sleep = sleep
        self._after_load = after_load  # a test's fault point (machine.backups.transfer)
        self._target = target
        self.target_name = target_name
        self._keys = keys
        self._data_dir = data_dir
        self._attachments = attachments_dir
        self._work = data_dir / "backup-work"
        self._metrics = metrics
        self._clock = clock
        self.daily_at = daily_at
        self._warnings = warnings
        self._keep = keep
        self.engine = self.engine_for(target, machine_id, mend=True, chain_target=target_name)
        self._last: BackupResult | None = None
        self._last_at: float | None = None
        self._last_check: RestoreCheck | None = None
        self._last_id = ""
        self._last_bytes = 0
        self._listed = False  # the stored backups were listed once (load_last)
        #: Called after a restore committed (wakes the search indexer).
        self.on_restored: Callable[[], None] | None = None

    def engine_for(
        self, target: BackupTarget, machine_id: str, *, mend: bool = False, chain_target: str = ""
    ) -> BackupEngine:
        """An engine on ``target`` reading ``machine_id``'s backups (a copied backup
        folder of another machine, for restore and verify); ``mend``: the
        machine's own engine (see :class:`BackupEngine`)."""
        return BackupEngine(
            DatabaseBackupSource(
                self._db, self._attachments, self._work, self._settings, self._homes
            ),
            target,
            machine_id=machine_id,
            naming_key=self._keys.naming_key,
            recipients=self._keys.recipients,
            keypair=self._keys.keypair,
            work_dir=self._work,
            keep=self._keep,
            clock=self._clock,
            mend=mend,
            chain_target=chain_target,
        )

    def create_recovery_key(self) -> BoxKeyPair:
        """Make a stand-alone machine's recovery key pair; later backups are sealed to it.

        The caller shows the private half once; only the public half is kept.
        """
        pair = new_standalone_recovery_key(self._data_dir)
        self._seal_to_recovery(pair.public_key)
        return pair

    def keep_recovery_key(self, public_key: bytes) -> None:
        """Seal later backups to the recovery key whose private half the caller
        made and showed (see :func:`keep_standalone_recovery_key`)."""
        keep_standalone_recovery_key(self._data_dir, public_key)
        self._seal_to_recovery(public_key)

    def _seal_to_recovery(self, public_key: bytes) -> None:
        self._keys = dataclasses.replace(self._keys, recovery_public_key=public_key)
        self.engine.seal_to(self._keys.recipients)

    # -- making and checking -------------------------------------------------

    async def backup_now(self, progress: Progress | None = None) -> BackupResult:
        """Make a backup now, prune, then check that the new backup restores."""
        started = time.monotonic()
        try:
            result = await self.engine.backup_now(progress)
        except BaseException:
            if self._metrics:
                self._metrics.backups.labels("failed").inc()
            raise
        self._last, self._last_at = result, self._clock()
        self._last_id, self._last_bytes = result.backup_id, result.stored_bytes
        self._listed = True  # nothing older can be newer than this one
        if self._metrics:
            self._metrics.backups.labels("ok").inc()
            self._metrics.last_success.set(self._last_at)
            self._metrics.duration.observe(time.monotonic() - started)
            self._metrics.uploaded_bytes.inc(result.uploaded_bytes)
            self._metrics.stored_bytes.set(result.stored_bytes)
        return result

    def sweep_stale(self) -> int:
        """Remove what a backup or restore killed midway left in the work folder: its
        staging folders (compressed or downloaded segments, a restore's decoded
        files). Call it at start, before any backup or restore can run (the data
        folder's lock keeps other daemons out). Returns the folders removed."""
        removed = 0
        if not self._work.is_dir():
            return 0
        for path in self._work.iterdir():
            if path.is_dir() and path.name.startswith(_STALE_PREFIXES):
                shutil.rmtree(path, ignore_errors=True)
                removed += not path.exists()
        if removed:
            logger.info("backups: removed %d staging folder(s) of a stopped run", removed)
        return removed

    async def load_last(self) -> None:
        """Take the newest stored backup as the last success (at start: a restarted
        daemon must not look as if it never backed up, which fires BackupTooOld)."""
        listed = await self.engine.list()
        if self._listed:
            return  # a backup made meanwhile is the last one
        self._listed = True
        for info, manifest in reversed(listed):
            if manifest is not None:
                self._last_at = manifest.created_at
                # As `backup list` counts it: the manifest and every segment it names
                # (before: the manifest alone, after each restart).
                stored = info.size + sum(s.size for s in manifest.segments)
                self._last_id, self._last_bytes = info.backup_id, stored
                if self._metrics:
                    self._metrics.last_success.set(manifest.created_at)
                    self._metrics.stored_bytes.set(stored)
                return

    async def restore_check(self, backup_id: str | None = None) -> RestoreCheck:
        """Open a backup (``backup_id``: the one just made; else the newest listed),
        authenticate every chunk, compare with the live data.

        Every agent the backup holds must still be on this machine (or have
        been erased since); a backup that cannot be opened whole fails. After a
        backup its own id is checked: a newer one listed may not be this
        machine's (planted, another key's).
        """
        started = time.monotonic()
        at = self._clock()
        if backup_id is None:
            backups = await self.engine.list()
            backup_id = backups[-1][0].backup_id if backups else None
        if backup_id is None:
            check = RestoreCheck(False, "", at, 0.0, "no backup to check")
        else:
            try:
                verified, manifest = await self._verify_and_open(backup_id)
                agents = {s.ref for s in manifest.segments if s.kind == "agent"}
                live = await self._db.read(
                    lambda c: (
                        store_export.existing_agents(c, agents)
                        | store_erasures.erased_among(c, agents)
                    ),  # erased since: not missing
                    what="restore check",
                )
                missing = agents - live
                problem = (
                    f"{len(missing)} agents in the backup are not on this machine"
                    if missing
                    else ""
                )
                check = RestoreCheck(not missing, backup_id, at, verified.seconds, problem)
            except (IntegrityError, AgentsError) as e:
                check = RestoreCheck(False, backup_id, at, time.monotonic() - started, str(e))
        self._last_check = check
        if self._metrics:
            self._metrics.check_ok.set(1 if check.ok else 0)
            self._metrics.check_last.set(at)
            self._metrics.check_duration.observe(time.monotonic() - started)
        if not check.ok:
            logger.error("restore check of backup %s failed: %s", check.backup_id, check.problem)
        return check

    async def _verify_and_open(self, backup_id: str) -> tuple[VerifyResult, BackupManifest]:
        """Verify and open ``backup_id``, again while the target's answer is transient:
        a lost answer says nothing of the backup, and a check failed on one (before)
        reported a backup that restores as one that does not."""
        async for attempt in retrying("backup.restore_check"):
            with attempt:
                verified = await self.engine.verify(backup_id)
                return verified, await self.engine.open(backup_id)
        raise AssertionError("unreachable: tenacity re-raises the last error")

    # -- restoring -----------------------------------------------------------

    async def restore(
        self,
        backup_id: str | None,
        *,
        at: float | None = None,
        recovery: BoxKeyPair | None = None,
        erased: set[str] | None = None,
        engine: BackupEngine | None = None,
        in_commit: Callable[[Any], None] | None = None,
    ) -> InResult:
        """Restore a backup's agents (archived), skipping existing and erased ones.

        ``backup_id``: a daily point alone, or an increment with its point and
        the increments before it; None: the time ``at`` (None: the newest), the
        newest point at or before it and its increments up to it.
        ``recovery`` opens a backup made by another machine's key (the disk is
        gone); without it the machine's own key is used. ``engine`` reads
        another target (:meth:`engine_for`). ``in_commit(conn)`` writes in the
        restore's one transaction (a take-over's adopted id: :mod:`machine.cli.take_over`).
        """
        engine = engine or self.engine
        stage = self._work / f".restore-{os.getpid()}-{int(self._clock() * 1000)}"
        try:
            if backup_id is not None and not is_increment(backup_id):
                fetched = await engine.fetch(backup_id, stage, recovery, decode_agents=False)
            else:
                chain = await (
                    engine.chain_for(backup_id, recovery)
                    if backup_id is not None
                    else engine.chain_at(at, recovery)
                )
                fetched = await engine.fetch_chain(chain, stage, recovery)
            result = await restore_fetched(
                self._db,
                fetched,
                attachments_dir=self._attachments,
                erased=erased or set(),
                after_load=self._after_load,
                in_commit=in_commit,
                homes=self._homes,
            )
            differ = settings_differ(fetched.manifest.settings, self._settings)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if self.on_restored is not None:
            self.on_restored()
        if differ:
            logger.info(
                "backup %s was made with other settings (machine.toml sets them): %s",
                backup_id,
                ", ".join(f"{d.name} = {d.in_backup} (here {d.here})" for d in differ),
            )
        return dataclasses.replace(result, settings=differ)

    # -- scheduling ----------------------------------------------------------

    def next_run(self, now: float | None = None) -> float:
        """The next daily run time after ``now`` (local time of day ``daily_at``)."""
        now = self._clock() if now is None else now
        local = dt.datetime.fromtimestamp(now).astimezone()
        candidate = local.replace(
            hour=self.daily_at.hour, minute=self.daily_at.minute, second=0, microsecond=0
        )
        if candidate.timestamp() <= now:
            candidate = (candidate + dt.timedelta(days=1)).replace(
                hour=self.daily_at.hour, minute=self.daily_at.minute
            )
        return candidate.timestamp()

    async def run_daily(self) -> None:
        """Back up (then check) every day at ``daily_at``, until cancelled.

        A failed backup is tried again after 5 minutes, then 10, 20, up to an
        hour apart, until one succeeds or the next daily run is due. Until the
        stored backups were listed once, they are listed again every minute.
        """
        due = self.next_run()
        retry = _RETRY_FIRST
        while True:
            if not self._listed:
                try:
                    await self.load_last()
                except AgentsError as e:
                    logger.debug("stored backups still cannot be listed: %s", e)
                except Exception:  # the daily task must go on: tried again in a minute
                    logger.exception("listing the stored backups failed")
            wait = max(0.0, due - self._clock())
            await self._sleep(wait if self._listed else min(wait, _RELIST))
            if self._clock() < due:
                continue
            try:
                made = await self.backup_now()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                daily = self.next_run()
                if self._clock() + retry < daily:
                    due, retry = self._clock() + retry, min(retry * 2, _RETRY_MAX)
                else:  # the next daily run comes first; its failures start over at 5 min
                    due, retry = daily, _RETRY_FIRST
                when = dt.datetime.fromtimestamp(due).astimezone().isoformat(timespec="seconds")
                if isinstance(e, AgentsError):
                    logger.error("the daily backup failed (%s); trying again at %s", e, when)
                else:
                    logger.exception("the daily backup failed; trying again at %s", when)
                continue
            retry, due = _RETRY_FIRST, self.next_run()
            try:
                await self.restore_check(made.backup_id)
            except Exception:  # the backup stands; the check runs again tomorrow
                logger.exception("the restore check could not run")

    async def increment_now(self) -> BackupResult | None:
        """Ship an increment of what changed (None: nothing did, or no chain yet)."""
        try:
            result = await self.engine.increment_now()
        except Exception:  # a daemon stopping mid-increment is not a failure
            if self._metrics:
                self._metrics.increments.labels("failed").inc()
            raise
        if result is not None and self._metrics:
            self._metrics.increments.labels("ok").inc()
            self._metrics.last_increment.set(result.created_at)
            self._metrics.uploaded_bytes.inc(result.uploaded_bytes)
        return result

    async def run_continuous(self) -> None:
        """Every half ``interval``, ship what changed, until cancelled.

        Half: a change committed just after a look waits for the next one, then
        for its upload; looking every half interval ships it within the
        interval (half of it, plus the upload), at the cost of one marker query
        more per interval on an idle machine (no request to the target).

        Without a chain (no point made on this target from this data folder: a
        first join, a new folder) something to back up starts one with a point.
        A failure is logged; the next interval tries again with all it missed.
        While the target stays down only the first failure is an ERROR (the
        others are DEBUG lines, counted in the metric), and the recovery says
        how many intervals failed.
        """
        assert self.interval is not None
        failing = 0
        while True:
            await self._sleep(self.interval / 2)
            try:
                if not self.engine.continuing():
                    if await self.engine.has_agents():
                        logger.info("continuous backups: no chain yet; making a point")
                        await self.backup_now()
                else:
                    await self.increment_now()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failing += 1
                level = logging.ERROR if failing == 1 else logging.DEBUG
                known = isinstance(e, AgentsError)
                logger.log(level, "continuous backup failed (%s); trying again every %.0f s",
                           e if known else type(e).__name__, self.interval,
                           exc_info=not known)  # fmt: skip
                continue
            if failing:
                logger.info("continuous backups resumed after %d failed interval(s)", failing)
                failing = 0

    def status(self) -> BackupStatus:
        warnings = list(self._warnings)
        if self._keys.recovery_public_key is None:
            warnings.append(
                "no recovery key: backups open only with this machine's key, so a lost disk "
                "loses them too (agents-machine backup recovery-key)"
            )
        return BackupStatus(
            target=self.target_name,
            keep=self.engine.keep,
            last_backup_at=self._last_at,
            last_backup_id=self._last_id,
            last_backup_bytes=self._last_bytes,
            next_run_at=self.next_run(),
            last_check=self._last_check,
            recovery_key=self._keys.recovery_public_key is not None,
            warnings=tuple(warnings),
            increment_interval=self.interval,
            last_increment_at=self._last_increment_at() if self.interval else None,
        )

    def _last_increment_at(self) -> float | None:
        # The chain's newest backup, from its state file (no request): its id says
        # when it was made, and an increment's is the recovery point a lost disk keeps.
        newest = self.engine.chain_newest()
        return id_time_ms(newest) / 1000 if newest and is_increment(newest) else None


def same_device(a: Path, b: Path) -> bool:
    """Whether two folders (or their nearest existing parents) are on one device."""

    def dev(p: Path) -> int:
        for q in (p, *p.parents):
            if q.exists():
                return os.stat(q).st_dev
        return -1

    return dev(a) == dev(b)
