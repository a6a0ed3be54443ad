"""The stand-alone machine's backup folder: refused when it is not one, its owner named.

A backup folder holds one machine's sealed backups and ``machine.json``
(:data:`_OWNER_KEY`), which names that machine: manifests are sealed with its
id, so a copied folder restores on another machine (``--from``) only if it says
whose it is. :func:`check_backup_folder` refuses a configured folder that is
not one to make private and sweep, and :func:`open_backup_folder` a ``--from``
folder without ``machine.json``, both before the folder store opens it (which
makes the folder private and sweeps stale temp files): a wrong folder is left
as it was.

Crash argument: ``machine.json`` is written once, by the folder store's
temp-fsync-rename, after the folder is checked; a first start killed midway
leaves at most the store's lock file and ``machine.json``'s temp file, which
the next start's check ignores, and that start writes it again. A folder
whose ``machine.json`` names another machine is never rewritten (a warning).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Final

from shared.backup_folder import FolderTarget
from shared.backup_target import BackupTarget
from shared.errors import ConfigError, IntegrityError, InvalidArgument, InvalidId, NotFound
from shared.ids import validate_id
from shared.store.folder import FolderStore

__all__ = [
    "check_backup_folder",
    "folder_backup_target",
    "open_backup_folder",
    "record_backup_owner",
]

logger = logging.getLogger(__name__)


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


def check_backup_folder(folder: Path, data_dir: Path, setting: str = "backup_dir") -> None:
    """Refuse a configured backup folder that is not one to make private and sweep:
    a file, the data folder or a folder holding it, one of the daemon's own
    folders in it (``keys/``: a copy of the backups would carry the private keys),
    or a folder with other files in it (a new disk's ``lost+found`` and what a
    first start that stopped midway leaves, hidden temp and lock files, are not
    others). ``setting``: the one that named the folder, named by the error."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(setting, f"{folder}: {why}")

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


async def record_backup_owner(folder_store: FolderStore, folder: Path, machine_id: str) -> None:
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


@contextlib.asynccontextmanager
async def open_backup_folder(from_dir: str) -> AsyncIterator[tuple[BackupTarget, str]]:
    """The backup folder ``from_dir`` (``--from``: a copied backup dir, perhaps of a
    lost machine) as a target, and the machine whose backups it holds (its
    ``machine.json`` says whose); its store is closed on exit. InvalidArgument
    for anything but an existing backup folder."""
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
        yield target, machine_id
    finally:
        await folder_store.close()
