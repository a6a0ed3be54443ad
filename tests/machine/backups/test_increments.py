"""Continuous backups through a real machine: increments of what changed, restored
to a time byte-equal; idle ships nothing; a broken chain is refused by name."""

from __future__ import annotations

import asyncio
import json
import os
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from machine.app import Machine, open_machine
from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import export_agents
from machine.config import MachineConfig
from machine.models import EventKind
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError
from shared.store.memory import MemoryStore

DEADLINE = 10.0


class CountingStore(MemoryStore):
    """A memory store counting every request made of it."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    async def get(self, key: str) -> bytes:
        self.requests += 1
        return await super().get(key)

    def get_stream(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.requests += 1
        return super().get_stream(key, *args, **kwargs)

    async def head(self, key: str) -> Any:
        self.requests += 1
        return await super().head(key)

    async def put(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.requests += 1
        return await super().put(key, *args, **kwargs)

    async def delete(self, key: str) -> None:
        self.requests += 1
        await super().delete(key)

    def list_pages(self, *args: Any, **kwargs: Any) -> Any:
        self.requests += 1
        return super().list_pages(*args, **kwargs)


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root, background_loops=False, shutdown_grace_seconds=0, prompt_limit=4096
    ).validate()


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _prompt(m: Machine, agent: str, text: str, attachments: list[str] = []) -> None:  # noqa: B006
    async def run() -> None:
        stream = await m.runs.prompt(agent, text, attachments)
        async for ev in stream:
            if ev.kind is EventKind.PERMISSION_REQUEST:
                await m.runs.answer(ev.run_id, ev.payload["request_id"], "allow_once")

    await asyncio.wait_for(run(), DEADLINE)


async def _export(m: Machine, agents: list[str], dest: Path) -> dict[str, bytes]:
    await export_agents(
        m.db, agents, dest, machine_id=m.ids.canonical,
        attachments_dir=m.config.attachments_dir, now=1.0,
    )  # fmt: skip
    out: dict[str, bytes] = {}
    with tarfile.open(dest) as tar:
        for member in tar:
            f = tar.extractfile(member)
            if f is not None and not member.name.endswith(("record.json", "manifest.json")):
                out[member.name] = f.read()
    return out


def _engine(m: Machine, store: MemoryStore, work: Path, key: BoxKeyPair) -> BackupEngine:
    return BackupEngine(
        DatabaseBackupSource(m.db, m.config.attachments_dir, work),
        StoreTarget(store),
        machine_id=m.ids.canonical,
        naming_key=b"n" * 32,
        recipients=[key.public_key],
        keypair=key,
        work_dir=work,
    )


async def _restore(new: Machine, engine: BackupEngine, dest: Path, at: float | None = None) -> Any:
    chain = await engine.chain_at(at)
    fetched = await engine.fetch_chain(chain, dest)
    return await restore_fetched(
        new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
    )


async def test_increments_restore_byte_equal_and_idle_ships_nothing(tmp_path: Path) -> None:
    key, store = BoxKeyPair.generate(), CountingStore()
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        b = (await old.agents.create(name="b", folder=str(tmp_path))).id
        gone = (await old.agents.create(name="gone", folder=str(tmp_path))).id
        for agent in (a, b, gone):
            # Text that compresses about as a conversation does: the deltas' whole
            # records (settings, session id) are small beside it.
            for i in range(5):
                words = " ".join(f"w{(i * 7919 + j * 104729) % 100003}" for j in range(200))
                await _prompt(old, agent, f"before the point {i} " + words)
        engine = _engine(old, store, tmp_path / "work", key)
        machine_id = old.ids.canonical
        point = await engine.backup_now()
        at_point = await _export(old, [a, b], tmp_path / "p.tar.gz")

        before = store.requests
        assert await engine.increment_now() is None
        assert store.requests == before, "an idle interval makes no store request"

        await _prompt(old, a, "/tool ls MARKER-TOOL")
        data = b"an attachment MARKER-ATT " * 100
        rec = await old.attachments.upload(
            agent_id=b, file_name="f.txt", declared_size=len(data), chunks=_chunks(data)
        )
        await _prompt(old, b, "with a file", [rec.sha256])
        c = (await old.agents.create(name="c", folder=str(tmp_path))).id
        await _prompt(old, c, "a new agent")
        await old.agents.archive(gone)
        await old.require_erasure().delete(gone)
        first = await engine.increment_now()
        assert first is not None and first.backup_id.startswith("bki_")
        # About the prompts' own events, not the conversations.
        assert first.uploaded_bytes < point.uploaded_bytes / 2

        await _prompt(old, a, "after the first increment ü ☃")
        await old.agents.rename(b, "b renamed")
        second = await engine.increment_now()
        assert second is not None and second.agents == 2
        assert await engine.increment_now() is None
        final = await _export(old, [a, b, c], tmp_path / "f.tar.gz")

    async with open_machine(_config(tmp_path / "new")) as new:
        result = await _restore(new, engine, tmp_path / "fetch")
        assert sorted(result.restored) == sorted([a, b, c]), "the deleted agent stays out"
        assert await _export(new, [a, b, c], tmp_path / "after.tar.gz") == final
        assert (await new.agents.get(b)).name == "b renamed"
    # To the point's time: the point alone.
    async with open_machine(_config(tmp_path / "at")) as at:
        result = await _restore(at, engine, tmp_path / "fetch2", point.created_at)
        assert sorted(result.restored) == sorted([a, b, gone])
        assert await _export(at, [a, b], tmp_path / "at.tar.gz") == at_point
    # The prune keeps the increments with their point; a new point drops neither yet.
    chains = await engine.chains()
    assert [i.backup_id for i in chains[point.backup_id].increments] == [
        first.backup_id, second.backup_id,
    ]  # fmt: skip
    verified = await engine.verify_chain(chains[point.backup_id])
    assert verified.segments >= point.segments + first.segments + second.segments
    # A listing opens each increment once (a restarted daemon's engine), then
    # knows its link: the next listing reads the listing and the point only.
    async with open_machine(_config(tmp_path / "again")) as again:
        fresh = BackupEngine(
            DatabaseBackupSource(again.db, again.config.attachments_dir, tmp_path / "work2"),
            StoreTarget(store), machine_id=machine_id, naming_key=b"n" * 32,
            recipients=[key.public_key], keypair=key, work_dir=tmp_path / "work2",
        )  # fmt: skip
        before = store.requests
        assert (await fresh.chains())[point.backup_id].backup_id == second.backup_id
        first_listing, before = store.requests - before, store.requests
        await fresh.chains()
        assert (first_listing, store.requests - before) == (4, 2)


async def test_a_broken_chain_is_refused_naming_the_increment(tmp_path: Path) -> None:
    key, store = BoxKeyPair.generate(), MemoryStore()
    work = tmp_path / "work"
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "one")
        engine = _engine(old, store, work, key)
        await engine.backup_now()
        await _prompt(old, a, "two")
        # The chain's state claims more than the point holds: the delta leaves a gap.
        state = json.loads((work / "continuous.json").read_bytes())
        state["seqs"][a] += 3
        (work / "continuous.json").write_text(json.dumps(state))
        made = await engine.increment_now()
        assert made is not None
    async with open_machine(_config(tmp_path / "new")) as new:
        with pytest.raises(IntegrityError, match=f"{made.backup_id}.*continues from event"):
            await _restore(new, engine, tmp_path / "fetch")
        assert not (tmp_path / "fetch").exists(), "nothing is left staged"
        assert await new.agents.list() == []
    assert os.path.exists(work / "continuous.json")


async def test_an_orphan_increment_is_passed_over_and_a_lost_base_restarts_the_chain(
    tmp_path: Path,
) -> None:
    """A crash between an increment's commit and the chain's write: the next increment
    continues the same base with more, and a restore follows it. A chain whose base
    the target lost is forgotten: the next backup must be a point."""
    key, store = BoxKeyPair.generate(), MemoryStore()
    work = tmp_path / "work"
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "one")
        engine = _engine(old, store, work, key)
        await engine.backup_now()
        state = (work / "continuous.json").read_bytes()
        await _prompt(old, a, "two")
        orphan = await engine.increment_now()
        (work / "continuous.json").write_bytes(state)  # as if killed before the write
        await _prompt(old, a, "three")
        newer = await engine.increment_now()
        assert orphan is not None and newer is not None
        final = await _export(old, [a], tmp_path / "f.tar.gz")
        chain = await engine.chain_at()
        assert [m.backup_id for m in chain.increments] == [newer.backup_id]
        async with open_machine(_config(tmp_path / "new")) as new:
            await _restore(new, engine, tmp_path / "fetch")
            assert await _export(new, [a], tmp_path / "n.tar.gz") == final

        # The target lost the chain's base (a new engine: a restarted daemon).
        await store.delete(f"manifests/{newer.backup_id}.sealed")
        restarted = _engine(old, store, work, key)
        await _prompt(old, a, "four")
        assert restarted.continuing()
        assert await restarted.increment_now() is None
        assert not restarted.continuing(), "forgotten: the next backup is a point"


async def test_the_api_lists_verifies_and_restores_to_a_time(tmp_path: Path) -> None:
    """ListBackups counts a point's increments; VerifyBackup (no id) checks the point
    and its increments; Restore --at restores to a time between increments."""
    from machine.api.servicer import MachineServicer
    from shared.crypto import encode_private_key
    from shared.pb.machine.v1 import machine_pb2 as pb
    from shared.timestamps import from_seconds, to_seconds

    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "MARKER-ONE")
        service = old.require_backups()
        pair = service.create_recovery_key()
        point = await service.backup_now()
        await _prompt(old, a, "MARKER-TWO")
        first = await service.increment_now()
        await _prompt(old, a, "MARKER-THREE")
        second = await service.increment_now()
        assert first is not None and second is not None
        api = MachineServicer(old)
        listed = await api.ListBackups(pb.ListBackupsRequest(), None)  # type: ignore[arg-type]
        (shown,) = listed.backups
        assert (shown.id, shown.increments) == (point.backup_id, 2)
        assert abs(to_seconds(shown.newest_increment_at) - second.created_at) < 1e-3
        verified = await api.VerifyBackup(pb.VerifyBackupRequest(), None)  # type: ignore[arg-type]
        assert verified.ok and verified.segments == point.segments + 2
        folder = str(old.config.backups_dir)
    async with open_machine(_config(tmp_path / "new")) as new:
        # Another machine's backups: listed, not opened, without its recovery key;
        # with it, the point opens and its increments are counted.
        api = MachineServicer(new)
        (theirs,) = (await api.ListBackups(pb.ListBackupsRequest(from_dir=folder), None)).backups  # type: ignore[arg-type]
        assert (theirs.opens, theirs.increments) == (False, 0)
        keyed = pb.ListBackupsRequest(
            from_dir=folder, recovery_private_key=encode_private_key(pair.private_key)
        )
        (opened,) = (await api.ListBackups(keyed, None)).backups  # type: ignore[arg-type]
        assert (opened.opens, opened.increments, opened.agents) == (True, 2, 1)
        request = pb.RestoreRequest(
            from_dir=folder,
            recovery_private_key=encode_private_key(pair.private_key),
            at=from_seconds(first.created_at),
        )
        restored = await MachineServicer(new).Restore(request, None)  # type: ignore[arg-type]
        assert list(restored.restored) == [a]
        texts = await _payloads(new, a)
        assert any("MARKER-TWO" in t for t in texts)
        assert not any("MARKER-THREE" in t for t in texts), "restored to the first increment"


async def _payloads(m: Machine, agent: str) -> list[str]:
    from machine.storage import restored

    await restored.ensure_loaded(m.db)  # a restore loads histories after its commit
    rows = await m.db.read(
        lambda c: c.execute(
            "SELECT payload_json FROM events WHERE agent_id = ? ORDER BY seq", (agent,)
        ).fetchall(),
        what="t",
    )
    return [str(r[0]) for r in rows]


async def test_an_increment_that_did_not_commit_is_shipped_again_by_the_next(
    tmp_path: Path,
) -> None:
    """Its deltas were sent, its manifest was not (the commit point): the chain did
    not move, so the next increment holds those changes too, and a prune removes
    the deltas no manifest names."""
    key, store = BoxKeyPair.generate(), MemoryStore()
    work = tmp_path / "work"
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "one")
        engine = _engine(old, store, work, key)
        await engine.backup_now()
        await _prompt(old, a, "two")
        target = engine._target  # noqa: SLF001 - the fault point is the target's commit

        async def refused(*args: Any, **kwargs: Any) -> None:
            raise IntegrityError("backup", "the test refuses this commit")

        commit, target.put_manifest = target.put_manifest, refused  # type: ignore[method-assign]
        with pytest.raises(IntegrityError, match="refuses this commit"):
            await engine.increment_now()
        target.put_manifest = commit  # type: ignore[method-assign]
        await _prompt(old, a, "three")
        made = await engine.increment_now()
        assert made is not None
        final = await _export(old, [a], tmp_path / "f.tar.gz")
    async with open_machine(_config(tmp_path / "new")) as new:
        await _restore(new, engine, tmp_path / "fetch")
        assert await _export(new, [a], tmp_path / "n.tar.gz") == final
    pruned = await engine.prune()
    assert pruned.segments == 1 and not pruned.manifests, "the uncommitted delta goes"


async def test_one_prompt_in_a_conversation_of_100000_events_ships_about_its_own(
    tmp_path: Path,
) -> None:
    """The increment after one prompt costs about that prompt's events compressed and
    sealed alone (at most 2x), whatever the conversation's length."""
    import contextlib
    import io

    from machine.core.agents import portable_settings
    from machine.formats.backup import encode_segment, segment_key, segment_name
    from machine.storage.tables.export import dump_agent_to

    key, store = BoxKeyPair.generate(), MemoryStore()
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "the first prompt")
        run = await old.db.read(
            lambda c: c.execute("SELECT run_id FROM events WHERE agent_id = ?", (a,)).fetchone()[0],
            what="t",
        )

        def history(conn: Any) -> None:
            start = conn.execute("SELECT last_seq FROM agents WHERE id = ?", (a,)).fetchone()[0]
            rows = [
                (a, start + i, run, "TEXT_DELTA", json.dumps({"text": f"line {i} " * 8}), 1.0)
                for i in range(1, 100_001)
            ]
            conn.executemany(
                "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
                " VALUES (?,?,?,?,?,?)",
                rows,
            )
            conn.execute("UPDATE agents SET last_seq = ? WHERE id = ?", (start + 100_000, a))

        await old.db.write(history, what="t")
        engine = _engine(old, store, tmp_path / "work", key)
        point = await engine.backup_now()
        since = await old.db.read(
            lambda c: c.execute("SELECT last_seq FROM agents WHERE id = ?", (a,)).fetchone()[0],
            what="t",
        )
        await _prompt(old, a, "one more prompt " * 20)
        made = await engine.increment_now()
        assert made is not None

        def own(conn: Any) -> bytes:
            files: dict[str, bytes] = {}

            @contextlib.contextmanager
            def open_file(name: str) -> Any:
                buf = io.BytesIO()
                yield buf
                files[name] = buf.getvalue()

            dump_agent_to(conn, a, open_file, portable=portable_settings, since_seq=since)
            return files["conversation.jsonl"]

        events = await old.db.read(own, what="t")
    name = segment_name(b"n" * 32, [events])
    sealed = sum(
        len(c) for c in encode_segment([events], name=name, key=segment_key(b"n" * 32, name))
    )
    assert made.uploaded_bytes <= 2 * sealed, (made.uploaded_bytes, sealed)
    assert made.uploaded_bytes * 100 < point.uploaded_bytes


async def test_killed_between_a_points_commit_and_the_chains_write(tmp_path: Path) -> None:
    """The chain still names the point before: increments go on continuing it, past
    the new point, and a restore to the newest follows them (not the new point alone)."""
    key, store = BoxKeyPair.generate(), MemoryStore()
    work = tmp_path / "work"
    async with open_machine(_config(tmp_path / "old")) as old:
        a = (await old.agents.create(name="a", folder=str(tmp_path))).id
        await _prompt(old, a, "one")
        engine = _engine(old, store, work, key)
        await engine.backup_now()
        await _prompt(old, a, "two")
        assert await engine.increment_now() is not None
        state = (work / "continuous.json").read_bytes()
        await _prompt(old, a, "three")
        await engine.backup_now()
        (work / "continuous.json").write_bytes(state)  # as if killed before the write
        await _prompt(old, a, "four")
        made = await engine.increment_now()
        assert made is not None
        final = await _export(old, [a], tmp_path / "f.tar.gz")
    assert (await engine.chain_at()).backup_id == made.backup_id
    async with open_machine(_config(tmp_path / "new")) as new:
        await _restore(new, engine, tmp_path / "fetch")
        assert await _export(new, [a], tmp_path / "n.tar.gz") == final


async def test_status_names_the_newest_increment_from_the_chain_alone(tmp_path: Path) -> None:
    """`status` says how often increments ship and when the newest was made: read
    from the chain's state (no request), so a restarted daemon says it too."""
    from machine.api import codec
    from machine.cli.daemon_verbs import _backup_detail
    from shared.ids import id_time_ms

    async with open_machine(_config(tmp_path / "m")) as m:
        a = (await m.agents.create(name="a", folder=str(tmp_path))).id
        service = m.require_backups()
        service.interval = 60.0  # as on a joined machine or a bucket target
        await service.backup_now()
        assert service.status().last_increment_at is None  # a point, no increment yet
        await _prompt(m, a, "MARKER-ONE")
        made = await service.increment_now()
        assert made is not None
    async with open_machine(_config(tmp_path / "m")) as again:
        service = again.require_backups()
        service.interval = 60.0
        st = service.status()
        assert st.last_increment_at is not None
        # The time its id carries (taken as the increment began), to the millisecond.
        assert st.last_increment_at == id_time_ms(made.backup_id) / 1000
        assert made.created_at - 60 < st.last_increment_at <= made.created_at
        shown = codec.backup_status_from_pb(codec.backup_status_to_pb(st))
        assert shown.increment_interval == 60.0
        assert shown.last_increment_at == pytest.approx(st.last_increment_at, abs=1e-6)
        lines = dict(_backup_detail(shown))
        assert lines["increments"].startswith("every 1m; newest ")
        await service.backup_now()  # a new point: no increment continues it yet
        assert service.status().last_increment_at is None
        assert dict(_backup_detail(service.status()))["increments"] == (
            "every 1m; none since the last backup"
        )
