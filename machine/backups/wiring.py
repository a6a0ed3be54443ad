"""The machine's backup service built from its settings: the target chosen, the service started.

:func:`build_backups` is what :func:`machine.app.open_machine` calls: it loads
the backup keys, chooses the target (:func:`backup_target`, the one place that
chooses: the backup folder stand-alone, the control plane once joined), builds
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
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from machine.backups.keys import BackupKeys, load_backup_keys
from machine.backups.service import BackupMetrics, BackupService, parse_daily_time, same_device
from machine.backups.targets.control_plane import ControlPlaneTarget
from machine.backups.targets.folder import (
    check_backup_folder,
    folder_backup_target,
    record_backup_owner,
)
from machine.link import identity
from machine.link.deliveries import crash_after
from machine.link.following import FollowingLinkClients
from machine.metrics import MachineMetrics
from machine.models import MachineIds
from machine.storage.db import Database
from shared.backup_target import BackupTarget
from shared.errors import AgentsError, ConfigError

__all__ = [
    "BackupSettings",
    "backup_target",
    "backup_times",
    "backup_warnings",
    "build_backups",
    "continuous_interval",
]

logger = logging.getLogger(__name__)


class BackupSettings(Protocol):
    """The machine settings backups are built from (``MachineConfig`` has them all)."""

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


async def backup_target(
    config: BackupSettings, ids: MachineIds, closing: list[Callable[[], Awaitable[None]]]
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
            return ControlPlaneTarget(client, clients=clients.current, where=where), where
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
    await record_backup_owner(folder, config.backups_dir, ids.canonical)
    return target, f"folder {config.backups_dir}"


def backup_warnings(config: BackupSettings, target: BackupTarget) -> tuple[str, ...]:
    """What ``status`` warns of about where backups go."""
    if isinstance(target, ControlPlaneTarget):
        return ()  # off the machine: the folder is not used
    if same_device(config.backups_dir, config.data_dir):
        return (
            f"the backup folder {config.backups_dir} is on the same device as the data: "
            "a failed disk loses both (set backup_dir to another disk)",
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
        interval=continuous_interval(config, target),
    )
    await asyncio.to_thread(service.sweep_stale)
    try:
        await service.load_last()
    except AgentsError as e:
        logger.warning("cannot list the stored backups at start: %s", e)
    return service


def continuous_interval(config: BackupSettings, target: BackupTarget) -> float | None:
    """Seconds between continuous backups' increments: ``backup_interval`` for a
    joined machine (its backups leave the machine), None (daily only) else."""
    return config.backup_interval if isinstance(target, ControlPlaneTarget) else None


def backup_times(service: BackupService) -> Callable[[], Awaitable[list[float]]]:
    """When each stored backup was made, listed when asked (an erasure receipt
    stays "pending" while a backup older than the erasure may hold the agent)."""

    async def times() -> list[float]:
        return [m.created_at for _, m in await service.engine.list() if m is not None]

    return times
