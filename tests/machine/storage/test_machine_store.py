"""machine.storage.db: pragmas, file modes, migrations, refusal of newer schemas, group commit."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from pathlib import Path

import pytest

from machine.models import EventKind
from machine.storage import tables
from machine.storage.db import Database
from machine.storage.schema import SCHEMA_VERSION
from shared.errors import InvalidState
from tests.helpers.poll import apoll_until


async def test_open_sets_pragmas_modes_and_schema(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "machine.db")
    try:
        assert db.schema_version == SCHEMA_VERSION

        def pragmas(conn: sqlite3.Connection) -> tuple[str, int, int, int]:
            return (
                conn.execute("PRAGMA journal_mode").fetchone()[0],
                conn.execute("PRAGMA synchronous").fetchone()[0],
                conn.execute("PRAGMA foreign_keys").fetchone()[0],
                conn.execute("PRAGMA secure_delete").fetchone()[0],
            )

        assert await db.read(pragmas) == ("wal", 2, 1, 1)  # 2 == FULL
        assert await db.write(pragmas) == ("wal", 2, 1, 1)
        mode = stat.S_IMODE((tmp_path / "machine.db").stat().st_mode)
        assert mode == 0o600
    finally:
        await db.close()


async def test_reopen_keeps_version_and_data(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "machine.db")
    await db.write(lambda c: tables.set_setting(c, "k", "v"))
    await db.close()
    db = await Database.open(tmp_path / "machine.db")
    try:
        assert await db.read(lambda c: tables.get_setting(c, "k")) == "v"
        rows = await db.read(lambda c: c.execute("SELECT version FROM schema_version").fetchall())
        assert [r[0] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    finally:
        await db.close()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "machine.db"
    db = await Database.open(path)
    await db.close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (?, 0)", (SCHEMA_VERSION + 5,))
    conn.commit()
    conn.close()
    with pytest.raises(InvalidState, match="newer than this agents-machine supports"):
        await Database.open(path)


async def test_failed_write_rolls_back_only_itself(tmp_path: Path) -> None:
    db = await Database.open(tmp_path / "machine.db")
    try:

        def bad(conn: sqlite3.Connection) -> None:
            tables.set_setting(conn, "bad", "1")
            raise ValueError("boom")

        results = await asyncio.gather(
            db.write(lambda c: tables.set_setting(c, "good", "1")),
            db.write(bad),
            return_exceptions=True,
        )
        assert isinstance(results[1], ValueError)
        assert await db.read(lambda c: tables.get_setting(c, "good")) == "1"
        assert await db.read(lambda c: tables.get_setting(c, "bad")) is None
    finally:
        await db.close()


async def test_concurrent_appends_share_commits(tmp_path: Path) -> None:
    batches: list[int] = []
    db = await Database.open(tmp_path / "machine.db", on_commit=lambda n, s: batches.append(n))
    try:
        await db.write(
            lambda c: c.execute(
                "INSERT INTO agents (id, name, folder, runtime, state, origin_machine,"
                " created_at, updated_at) VALUES ('ag_x', 'x', '/', 'echo', 'active', 'm', 0, 0)"
            )
        )
        # The observer runs after writers are answered: wait for the setup commit's
        # report so it is not counted with the appends.
        await apoll_until(lambda: batches, deadline=5, what="the setup commit observed", step=0.005)
        batches.clear()

        async def appender(i: int) -> None:
            for j in range(20):
                await db.write(
                    lambda c, i=i, j=j: tables.append_event(
                        c, "ag_x", f"run_{i}", EventKind.TEXT_DELTA, {"text": f"{i}.{j}"}, 0.0
                    )
                )

        await asyncio.gather(*(appender(i) for i in range(16)))
        seqs = await db.read(
            lambda c: [r[0] for r in c.execute("SELECT seq FROM events ORDER BY seq")]
        )
        assert seqs == list(range(1, 321))  # no gaps, no duplicates
    finally:
        # Closing joins the writer thread: the commit observer, which runs after
        # writers are answered, has then seen every batch.
        await db.close()
    assert sum(batches) == 320
    assert len(batches) < 320  # group commit: fewer commits than writes


async def test_bulk_write_checkpoints_after_its_commit(tmp_path: Path) -> None:
    """A bulk write (restore, import) commits without the automatic checkpoint in its
    commit; the writer copies the WAL into the database file once the caller has its
    answer, with no other write needed, and puts the automatic checkpoint back."""
    path = tmp_path / "machine.db"
    db = await Database.open(path)
    try:
        before = path.stat().st_size
        value = "x" * 4000
        seen: list[int] = []

        def bulk(conn: sqlite3.Connection) -> None:
            seen.append(conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
            for i in range(2000):  # about 8 MB: far past the 1000 WAL pages that checkpoint
                tables.set_setting(conn, f"k{i}", value)

        await db.write(bulk, bulk=True)
        assert seen == [0]  # no checkpoint inside the bulk commit
        assert await db.read(lambda c: tables.get_setting(c, "k1999")) == value
        grown = await apoll_until(
            lambda: path.stat().st_size > before + 2000 * 4000 or None,
            deadline=10,
            what="the bulk write's pages copied into the database file",
        )
        assert grown
        level = await db.write(lambda c: c.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
        assert level == 1000
    finally:
        await db.close()
