"""The machine's backup service built from its settings: the target chosen, the service started.

:func:`build_backups` is what :func:`machine.app.open_machine` calls: it loads
the backup keys, chooses the target (:func:`backup_target`, the one place that
chooses: stand-alone, the backup folder or the bucket ``backup_target`` names;
once joined, the control plane), builds
the :class:`~machine.backups.service.BackupService` on it, sweeps what a killed
backup left in the work folder and lists the stored backups once. What must be
closed at shutdown (the folder store, the link client) is appended to
``closing`` as it is opened, so a failure halfway closes what was opened.

The settings are read through :class:`BackupSettings`, the few fields of
``machine.config.MachineConfig`` this needs: the config module imports this
room, not the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry

from machine.backups.keys import BackupKeys, load_backup_keys
from machine.backups.service import BackupMetrics, BackupService, parse_daily_time, same_device
from machine.backups.targets.bucket import BucketTarget, open_bucket_from, open_bucket_target
from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.backups.targets.folder import (
    check_backup_folder,
    folder_backup_target,
    open_backup_folder,
    record_backup_owner,
)
from machine.core.agents import SessionHomes
from machine.link import identity
from machine.link.deliveries import crash_after
from machine.link.following import FollowingLinkClients
from machine.metrics import MachineMetrics
from machine.models import MachineIds
from machine.storage.db import Database
from shared.backup_target import BackupTarget
from shared.errors import AgentsError, ConfigError, InvalidArgument
from shared.store.s3_config import S3Config
from shared.store.url import StoreOptions, parse_store_url

__all__ = [
    "BackupSettings",
    "backup_target",
    "backup_times",
    "backup_warnings",
    "build_backups",
    "continuous_interval",
    "open_backups_from",
    "shares_data_device",
]

logger = logging.getLogger(__name__)


class BackupSettings(Protocol):
    """The machine settings backups are built from (``MachineConfig`` has them all)."""

    @property
    def claude_home(self) -> Path | None:
        """Claude Code's folder (its agents' session files travel in backups)."""
        ...

    @property
    def codex_home(self) -> Path | None:
        """Codex's folder, as ``claude_home``."""
        ...

    @property
    def data_dir(self) -> Path:
        """The data folder (the keys, machine.db)."""
        ...

    @property
    def attachments_dir(self) -> Path:
        """Attachment bytes, backed up beside the database."""
        ...

    @property
    def backups_dir(self) -> Path:
        """The stand-alone backup folder."""
        ...

    @property
    def backup_target(self) -> str | None:
        """``backup_target`` as set (a folder or a bucket URL), or ``None``."""
        ...

    @property
    def backup_bucket(self) -> str | None:
        """The ``s3://`` URL of a stand-alone machine's bucket target, or ``None``."""
        ...

    def backup_store_options(self) -> StoreOptions:
        """How to reach the bucket (endpoint, region, credentials read now)."""
        ...

    def describe_backup_bucket(self, url: str) -> str:
        """The bucket for messages and ``status``: never a credential."""
        ...

    @property
    def backup_keep(self) -> int:
        """How many backups to keep."""
        ...

    @property
    def backup_time(self) -> str:
        """Local time of day (``HH:MM``) of the daily backup."""
        ...

    @property
    def backup_interval(self) -> float:
        """Seconds between a joined machine's continuous backups (increments)."""
        ...

    @property
    def crash_in_prune_after(self) -> int:
        """A test's fault hook: SIGKILL after this many objects pruned (0: never)."""
        ...

    @property
    def crash_in_transfer_after(self) -> int:
        """A test's fault hook: SIGKILL after this many agents loaded (0: never)."""
        ...

    def backup_settings(self) -> dict[str, str]:
        """The non-secret settings each backup carries (MachineConfig.backup_settings)."""
        ...


async def backup_target(
    config: BackupSettings,
    ids: MachineIds,
    closing: list[Callable[[], Awaitable[None]]],
    registry: CollectorRegistry | None = None,
) -> tuple[BackupTarget, str]:
    """The machine's backup target and a name for ``status``; what to close goes to ``closing``.

    Stand-alone: the bucket ``config.backup_bucket`` (``backup_target =
    "s3://..."``; a :class:`BucketTarget`, ConfigError at start when the bucket
    refuses us) or else the folder ``config.backups_dir``. Joined: the control
    plane (``ControlPlaneTarget`` over a mutual-TLS link client), which keeps
    the sealed backups in its store without being able to open them; a
    ``backup_target`` is then ignored (:func:`backup_warnings` says so). The
    one place that chooses the target. ``registry``: where the bucket's store
    metrics go.
    """
    if ids.joined:
        try:
            link = await asyncio.to_thread(identity.load_link, config.data_dir)
            clients = FollowingLinkClients(config.data_dir, link.control_address)
            client = await clients.current()
        except AgentsError as e:
            logger.warning(
                "joined, but the link record cannot be read (%s): backing up to %s",
                e,
                config.backups_dir,
            )
        else:
            closing.append(clients.aclose)
            where = f"control plane {link.control_address}"
            if config.backup_bucket is not None:
                logger.warning(
                    "backup_target %s is ignored: a joined machine backs up to its %s",
                    config.describe_backup_bucket(config.backup_bucket),
                    where,
                )
            return ControlPlaneTarget(client, clients=clients.current, where=where), where
    url = config.backup_bucket
    if url is not None:
        where = config.describe_backup_bucket(url)
        options = await asyncio.to_thread(config.backup_store_options)  # reads a file
        bucket = await open_bucket_target(
            url,
            options,
            where=where,
            machine_id=ids.canonical,
            registry=registry,
            after_delete=crash_after(config.crash_in_prune_after, "objects pruned"),
        )
        closing.append(bucket.close)
        return bucket, f"bucket {where}"
    setting = "backup_target" if config.backup_target is not None else "backup_dir"
    await asyncio.to_thread(check_backup_folder, config.backups_dir, config.data_dir, setting)
    try:
        target, folder = await folder_backup_target(
            config.backups_dir, crash_after(config.crash_in_prune_after, "objects pruned")
        )
    except OSError as e:  # a parent that is a file, a read-only or virtual file system
        raise ConfigError(
            setting, f"{config.backups_dir}: cannot be made or opened ({e.strerror or e})"
        ) from None
    closing.append(folder.close)
    await record_backup_owner(folder, config.backups_dir, ids.canonical)
    return target, f"folder {config.backups_dir}"


@contextlib.asynccontextmanager
async def open_backups_from(
    config: BackupSettings, source: str, registry: CollectorRegistry | None = None
) -> AsyncIterator[tuple[BackupTarget, str]]:
    """``--from``: another machine's backups (a lost one's) as a target, and whose
    they are. ``s3://bucket/prefix`` is a bucket prefix, reached with the
    machine's ``backup_store_*`` settings and credentials; anything else a
    copied backup folder. InvalidArgument naming ``--from`` for anything that
    holds no backups."""
    if not source.startswith("s3://"):
        async with open_backup_folder(source) as opened:
            yield opened
        return
    try:
        parsed = parse_store_url(source)
        where = config.describe_backup_bucket(source)
    except InvalidArgument as e:
        raise InvalidArgument("--from", e.reason) from None
    if isinstance(parsed, S3Config) and (parsed.access_key or parsed.secret_key):
        # As backup_target: a command line is seen by every user (ps) and kept in shells.
        raise InvalidArgument(
            "--from", "credentials never go in the URL: the daemon uses its own (backup_store_*)"
        )
    options = await asyncio.to_thread(config.backup_store_options)  # reads a file
    async with open_bucket_from(source, options, where=where, registry=registry) as opened:
        yield opened


def shares_data_device(config: BackupSettings, target: BackupTarget) -> bool:
    """Whether backups go to a folder on the data folder's device (a failed disk
    loses both): never for a bucket or the control plane, off this machine."""
    if isinstance(target, ControlPlaneTarget | BucketTarget):
        return False
    return same_device(config.backups_dir, config.data_dir)


def backup_warnings(config: BackupSettings, target: BackupTarget) -> tuple[str, ...]:
    """What ``status`` warns of about where backups go."""
    if isinstance(target, ControlPlaneTarget) and config.backup_bucket is not None:
        return (
            f"backup_target {config.describe_backup_bucket(config.backup_bucket)} is ignored:"
            " a joined machine backs up to its control plane (unset it)",
        )
    if shares_data_device(config, target):
        return (
            f"the backup folder {config.backups_dir} is on the same device as the data: "
            'a failed disk loses both (set backup_target to a folder on another disk or "s3://…")',
        )
    return ()


async def build_backups(
    config: BackupSettings,
    db: Database,
    ids: MachineIds,
    metrics: MachineMetrics | None,
    closing: list[Callable[[], Awaitable[None]]],
) -> BackupService:
    """The machine's backup service on its target, its stale work swept and its
    stored backups listed once (a target that is down at start is only logged:
    the service lists them again later). What to close goes to ``closing``."""
    keys: BackupKeys = await asyncio.to_thread(load_backup_keys, config.data_dir)
    registry = metrics.registry if metrics is not None else None
    target, name = await backup_target(config, ids, closing, registry)
    backup_metrics = BackupMetrics(metrics.registry) if metrics is not None else None
    if backup_metrics is not None:
        shared = await asyncio.to_thread(shares_data_device, config, target)
        backup_metrics.same_device.set(1 if shared else 0)
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
        metrics=backup_metrics,
        warnings=await asyncio.to_thread(backup_warnings, config, target),
        after_load=crash_after(config.crash_in_transfer_after, "agents loaded in a transfer"),
        settings=config.backup_settings(),
        interval=continuous_interval(config, target),
        homes=SessionHomes(config.claude_home, config.codex_home),
    )
    await asyncio.to_thread(service.sweep_stale)
    try:
        await service.load_last()
    except AgentsError as e:
        logger.warning("cannot list the stored backups at start: %s", e)
    return service


def continuous_interval(config: BackupSettings, target: BackupTarget) -> float | None:
    """Seconds between continuous backups' increments: ``backup_interval`` when
    backups leave the machine for a store (a joined machine's control plane, a
    stand-alone machine's bucket), None (daily only) for a folder: increments every
    minute to a folder on this box's own disk would not outlive that disk."""
    leaves = isinstance(target, ControlPlaneTarget | BucketTarget)
    return config.backup_interval if leaves else None


def backup_times(service: BackupService) -> Callable[[], Awaitable[list[float]]]:
    """When each stored backup was made, listed when asked (an erasure receipt
    stays "pending" while a backup older than the erasure may hold the agent)."""

    async def times() -> list[float]:
        return [m.created_at for _, m in await service.engine.list() if m is not None]

    return times
