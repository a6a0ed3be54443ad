"""What a join does after the link is made: restore the machine's backup (a repair
join), then back up at once under the new box's own keys.

In the CLI's room, not the link's: these open the whole machine (database,
backups) over the identity the join wrote, and the link never imports backups.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from machine.link import identity
from shared.atomic import ensure_private_dir
from shared.crypto import BoxKeyPair

if TYPE_CHECKING:
    from machine.backups.engine import BackupResult
    from machine.backups.targets.control_plane import RepairRestore
    from machine.config import MachineConfig
    from machine.core.agents import SessionHomes

__all__ = ["backup_after_repair", "restore_after_join"]

logger = logging.getLogger(__name__)


async def backup_after_repair(config: MachineConfig) -> BackupResult:
    """Upload a fresh backup to the control plane at once (after a re-pair, or the
    restore of a repair join); what it stored.

    The caller holds the data folder (no daemon runs on it meanwhile).
    """
    # Imported here: a plain join needs neither the database nor the backup code.
    from machine.app import open_machine

    quiet = dataclasses.replace(config, background_loops=False)
    async with open_machine(quiet) as machine:
        result = await machine.require_backups().backup_now()
    logger.info("after the repair: backup %s uploaded", result.backup_id)
    return result


async def restore_after_join(
    *,
    data_dir: Path,
    db_path: Path,
    attachments_dir: Path,
    recovery: BoxKeyPair,
    after_load: Callable[[], None] | None = None,
    settings: Mapping[str, str] | None = None,
    homes: SessionHomes | None = None,
) -> RepairRestore:
    """After a repair join: restore the machine's newest backup from the control plane,
    then clear the join's restore-pending mark (:func:`machine.link.identity.restore_pending`).

    The database is opened only for the restore (the daemon starts after it);
    see :func:`machine.backups.targets.control_plane.restore_newest`. Run again after a crash,
    it restores what the first run did not commit. ``after_load`` is a test's
    fault point (machine.backups.transfer).
    """
    # Imported here: a plain join needs neither the database nor the backup code.
    from machine.backups.targets.control_plane import restore_newest
    from machine.storage.db import Database

    ensure_private_dir(attachments_dir)
    db = await Database.open(db_path)
    try:
        done = await restore_newest(
            data_dir,
            db,
            attachments_dir,
            recovery,
            after_load=after_load,
            settings=settings,
            homes=homes,
        )
    finally:
        await db.close()
    await asyncio.to_thread(identity.clear_restore_pending, data_dir)
    return done
