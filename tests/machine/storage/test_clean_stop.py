"""The clean-stop mark: a start skips the check only for a file exactly as a clean stop left it."""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from machine.storage import clean_stop
from machine.storage.db import Database
from shared.errors import DatabaseDamaged


async def _filled(path: Path, rows: int = 200) -> None:
    """A database of a few hundred KiB, closed cleanly."""
    db = await Database.open(path)

    def fill(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (n INTEGER, text TEXT)")
        conn.executemany("INSERT INTO filler VALUES (?, ?)", ((i, "x" * 1000) for i in range(rows)))

    await db.write(fill)
    await db.close()


def _damage_middle_page(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.seek((size // 2) // 4096 * 4096)
        f.write(b"\xff" * 4096)


async def test_a_clean_stop_lets_the_next_open_skip_the_check_once(tmp_path: Path) -> None:
    path = tmp_path / "machine.db"
    await _filled(path)
    assert clean_stop.mark_path(path).exists()

    db = await Database.open(path)
    try:
        assert db.after_clean_stop and db.open_check is None
        # Taken at open: a crash of this process leaves no mark to trust.
        assert not clean_stop.mark_path(path).exists()
        count = await db.read(lambda c: c.execute("SELECT COUNT(*) FROM filler").fetchone()[0])
        assert count == 200
    finally:
        await db.close()

    assert clean_stop.mark_path(path).exists()


async def test_a_file_damaged_right_after_a_clean_stop_is_still_refused(tmp_path: Path) -> None:
    # Written in the same instant as the stop where it can be: the change time's
    # coarse ticks must not hide the write. Several rounds, each on a fresh file.
    for n in range(10):
        path = tmp_path / f"{n}.db"
        await _filled(path)
        _damage_middle_page(path)
        before = path.read_bytes()
        with pytest.raises(DatabaseDamaged, match="is damaged"):
            await Database.open(path)
        assert path.read_bytes() == before
        assert not clean_stop.mark_path(path).exists()


@pytest.mark.parametrize(
    "change",
    ["chmod", "touch", "copied over", "wal beside it", "mark garbled", "other file's mark"],
)
async def test_anything_but_the_file_the_stop_left_gets_the_check(
    tmp_path: Path, change: str
) -> None:
    path = tmp_path / "machine.db"
    await _filled(path)
    mark = clean_stop.mark_path(path)
    if change == "chmod":
        os.chmod(path, 0o600)
    elif change == "touch":
        os.utime(path)
    elif change == "copied over":
        shutil.copy2(path, tmp_path / "copy.db")
        os.replace(tmp_path / "copy.db", path)
    elif change == "wal beside it":
        (tmp_path / "machine.db-wal").write_bytes(b"\0" * 32)
    elif change == "mark garbled":
        mark.write_bytes(b"{not json")
    else:
        other = tmp_path / "other.db"
        await _filled(other, rows=3)
        os.replace(clean_stop.mark_path(other), mark)
    if change == "wal beside it":
        # A WAL SQLite did not write: move it away again, but only after the
        # mark saw it (the open below would otherwise read it as a WAL).
        assert not clean_stop.take_mark(path)
        (tmp_path / "machine.db-wal").unlink()
        assert not mark.exists()
        return

    db = await Database.open(path)
    try:
        assert not db.after_clean_stop
        assert db.open_check is not None and db.open_check.ok
        assert not mark.exists()
    finally:
        await db.close()


async def test_no_mark_while_another_connection_reads_in_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "machine.db"
    db = await Database.open(path)
    await db.write(lambda c: c.execute("CREATE TABLE filler (n INTEGER)"))
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN")
        other.execute("SELECT COUNT(*) FROM filler").fetchall()
        await db.write(lambda c: c.execute("INSERT INTO filler VALUES (1)"))
        await db.close()
        assert not clean_stop.mark_path(path).exists()
    finally:
        other.close()


async def test_a_write_by_anyone_after_the_stop_voids_the_mark(tmp_path: Path) -> None:
    path = tmp_path / "machine.db"
    await _filled(path)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("INSERT INTO filler VALUES (1, 'later')")
        db = await Database.open(path)  # the other connection still holds the WAL
        try:
            assert not db.after_clean_stop and db.open_check is not None
        finally:
            await db.close()
    finally:
        other.close()


async def test_no_mark_once_the_file_is_known_damaged(tmp_path: Path) -> None:
    path = tmp_path / "machine.db"
    await _filled(path)
    db = await Database.open(path)
    db.mark_damaged("found by a check")
    await db.close()
    assert not clean_stop.mark_path(path).exists()
