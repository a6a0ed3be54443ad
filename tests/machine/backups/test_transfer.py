"""Export, import and backup-restore through a real machine (database, runs, attachments)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from machine.app import Machine, open_machine
from machine.backups import transfer
from machine.backups.engine import BackupEngine, BackupResult
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.backups.transfer import InResult, export_agents, import_archive
from machine.config import MachineConfig
from machine.formats.export import accept_path
from machine.models import AgentState, EventKind
from shared.archive import extract_staged
from shared.backup_folder import FolderTarget
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import IntegrityError, InvalidArgument
from shared.ids import new_id
from shared.store.folder import FolderStore
from tests.helpers.poll import apoll_until

DEADLINE = 10.0


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root,
        background_loops=False,
        shutdown_grace_seconds=0,
        attachment_limit=256 * 1024,
        prompt_limit=4096,
    ).validate()


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def _populate(m: Machine, tmp: Path, agents: int) -> list[str]:
    ids = []
    for i in range(agents):
        agent = (await m.agents.create(name=f"agent-{i}", folder=str(tmp))).id
        ids.append(agent)
        data = f"attachment {i} MARKER-ATT ".encode() * 500 + os.urandom(16)
        rec = await m.attachments.upload(
            agent_id=agent, file_name=f"f{i}.txt", declared_size=len(data), chunks=_chunks(data)
        )
        await asyncio.wait_for(
            _drain(await m.runs.prompt(agent, f"MARKER-PROMPT {i} hello", [rec.sha256])), DEADLINE
        )
        stream = await m.runs.prompt(agent, f"/tool ls MARKER-TOOL-{i}")
        async for ev in stream:
            if ev.kind is EventKind.PERMISSION_REQUEST:
                await m.runs.answer(ev.run_id, ev.payload["request_id"], "allow_once")
        await m.agents.archive(agent)
    return ids


async def _attachment_refs(m: Machine) -> list[tuple[str, str, str, str]]:
    rows = await m.db.read(
        lambda c: c.execute(
            "SELECT sha256, agent_id, run_id, media_type FROM attachment_refs ORDER BY 1, 2, 3"
        ).fetchall()
    )
    return [tuple(r) for r in rows]


async def _export_files(m: Machine, agents: list[str], dest: Path) -> dict[str, bytes]:
    await export_agents(
        m.db,
        agents,
        dest,
        machine_id=m.ids.canonical,
        attachments_dir=m.config.attachments_dir,
        now=1.0,
    )
    out: dict[str, bytes] = {}
    with tarfile.open(dest) as tar:
        for member in tar:
            f = tar.extractfile(member)
            assert f is not None
            if not member.name.endswith(("record.json", "manifest.json")):
                out[member.name] = f.read()
    return out


async def test_backup_restores_on_a_new_machine_byte_equal(tmp_path: Path) -> None:
    machine_key, recovery = BoxKeyPair.generate(), BoxKeyPair.generate()
    target_root = tmp_path / "target"
    async with open_machine(_config(tmp_path / "old")) as old:
        agents = await _populate(old, tmp_path, 4)
        before = await _export_files(old, agents, tmp_path / "before.tar.gz")
        refs_before = await _attachment_refs(old)
        assert {r[3] for r in refs_before} == {"text/plain", ""}  # uploads, runs' references
        engine = BackupEngine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "work-old"),
            StoreTarget(FolderStore(target_root)),
            machine_id=old.ids.canonical,
            naming_key=os.urandom(32),
            recipients=[machine_key.public_key, recovery.public_key],
            keypair=machine_key,
            work_dir=tmp_path / "work-old",
        )
        made = await engine.backup_now()
        again = await engine.backup_now()
        assert again.uploaded == 0, "an unchanged machine uploads nothing"
    for path in target_root.rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            assert b"MARKER" not in blob and b"agent-0" not in blob
    async with open_machine(_config(tmp_path / "new")) as new:
        # Only the recovery key: the old machine's key is gone with its disk.
        fetched = await engine.fetch(made.backup_id, tmp_path / "fetch", recovery)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        after = await _export_files(new, agents, tmp_path / "after.tar.gz")
        assert after == before
        # Each upload's media type comes back with it.
        assert await _attachment_refs(new) == refs_before
        for agent in agents:
            rec = await new.agents.get(agent)
            assert rec.state is AgentState.ARCHIVED and rec.name.startswith("agent-")
        # The search index is built in the background, after the commit.
        assert new.indexer is not None
        await new.indexer.drain()
        assert await new.agents.search_indexing() == 0
        hits = await new.agents.search("MARKER-TOOL-2")
        assert hits, "restored conversations are searchable"
        # A second restore skips every agent that exists.
        again_fetched = await engine.fetch(made.backup_id, tmp_path / "fetch2", recovery)
        second = await restore_fetched(
            new.db, again_fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert second.restored == () and sorted(second.skipped_existing) == sorted(agents)


async def test_export_import_round_trip_skips_existing_and_erased(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 3)
        archive = tmp_path / "out.tar.gz"
        before = await _export_files(a, agents, archive)
    async with open_machine(_config(tmp_path / "b")) as b:
        result = await import_archive(
            b.db,
            archive,
            staging_dir=tmp_path / "incoming",
            attachments_dir=b.config.attachments_dir,
            erased={agents[0]},
        )
        assert sorted(result.restored) == sorted(agents[1:])
        assert result.skipped_erased == (agents[0],)
        got = await _export_files(b, agents[1:], tmp_path / "b.tar.gz")
        assert {k: v for k, v in got.items() if k.startswith("agents/")} == {
            k: v for k, v in before.items() if k.startswith("agents/") and agents[0] not in k
        }
        atts = {k: v for k, v in got.items() if k.startswith("attachments/")}
        assert len(atts) == 2 and all(before[k] == v for k, v in atts.items())
        again = await import_archive(
            b.db,
            archive,
            staging_dir=tmp_path / "incoming",
            attachments_dir=b.config.attachments_dir,
            erased=set(),
        )
        assert again.restored == (agents[0],) and sorted(again.skipped_existing) == sorted(
            agents[1:]
        )
        assert list((tmp_path / "incoming").iterdir()) == []


async def test_bad_archive_changes_nothing(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 2)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
    # Break one conversation line but keep the manifest's hash right: the load refuses it
    # inside the transaction, so the first (good) agent must not be kept either.
    stage = tmp_path / "x"
    with tarfile.open(archive) as tar:
        tar.extractall(stage, filter="data")
    conv = stage / "agents" / agents[1] / "conversation.jsonl"
    conv.write_bytes(conv.read_bytes() + b'{"seq": 1, "kind": "NOPE"}\n')
    manifest = json.loads((stage / "manifest.json").read_bytes())
    for entry in manifest["agents"]:
        if entry["agent_id"] == agents[1]:
            entry["files"]["conversation.jsonl"] = hashlib.sha256(conv.read_bytes()).hexdigest()
    (stage / "manifest.json").write_text(json.dumps(manifest))
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        for path in sorted(stage.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(stage)))
    async with open_machine(_config(tmp_path / "b")) as b:
        with pytest.raises(InvalidArgument, match="conversation.jsonl line"):
            await import_archive(
                b.db,
                bad,
                staging_dir=tmp_path / "incoming",
                attachments_dir=b.config.attachments_dir,
                erased=set(),
            )
        assert await b.agents.list(include_archived=True) == []
    con = sqlite3.connect(tmp_path / "b" / "machine.db")
    assert con.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 0
    con.close()


async def test_an_import_cancelled_while_it_unpacks_waits_for_its_thread_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 1)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
    with tarfile.open(archive) as tar:
        files = len(tar.getmembers())
    held, release, finished = threading.Event(), threading.Event(), threading.Event()
    calls = 0

    def accept(path: str) -> bool:
        nonlocal calls
        calls += 1
        if calls == files + 2:  # the unpacking pass, one file written
            held.set()
            release.wait(DEADLINE)
        return accept_path(path)

    def extract(*args: Any, **kwargs: Any) -> list[str]:
        try:
            return extract_staged(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(transfer, "accept_path", accept)
    monkeypatch.setattr(transfer, "extract_staged", extract)
    incoming = tmp_path / "incoming"
    async with open_machine(_config(tmp_path / "b")) as b:
        task = asyncio.create_task(
            import_archive(
                b.db,
                archive,
                staging_dir=incoming,
                attachments_dir=b.config.attachments_dir,
                erased=set(),
            )
        )
        assert await asyncio.to_thread(held.wait, DEADLINE)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The cancelled import ended after its thread, then removed what it wrote.
        assert finished.is_set()
        assert list(incoming.iterdir()) == []
        assert await b.agents.list(include_archived=True) == []


@dataclasses.dataclass
class _Old:
    """A machine that was backed up (and is closed): its agents, their export, the backup."""

    agents: list[str]
    before: dict[str, bytes]
    engine: BackupEngine
    made: BackupResult
    machine_id: str
    key: BoxKeyPair


async def _backed_up(tmp_path: Path, agents: int, *, folder_target: bool = False) -> _Old:
    key = BoxKeyPair.generate()
    store = FolderStore(tmp_path / "target")
    async with open_machine(_config(tmp_path / "old")) as old:
        ids = await _populate(old, tmp_path, agents)
        before = await _export_files(old, ids, tmp_path / "before.tar.gz")
        engine = BackupEngine(
            DatabaseBackupSource(old.db, old.config.attachments_dir, tmp_path / "work-old"),
            FolderTarget(store) if folder_target else StoreTarget(store),
            machine_id=old.ids.canonical,
            naming_key=os.urandom(32),
            recipients=[key.public_key],
            keypair=key,
            work_dir=tmp_path / "work-old",
        )
        made = await engine.backup_now()
        return _Old(ids, before, engine, made, old.ids.canonical, key)


async def test_restore_decoding_as_it_loads_refuses_a_tampered_segment_whole(
    tmp_path: Path,
) -> None:
    old = await _backed_up(tmp_path, 3)
    agents, before, engine, made = old.agents, old.before, old.engine, old.made
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "bad", decode_agents=False)
        assert fetched.agent_files == {} and sorted(fetched.stored_agents) == sorted(agents)
        # The last agent loaded is refused after the others went into the transaction.
        _, stored = fetched.stored_agents[list(fetched.stored_agents)[-1]]
        blob = bytearray(stored.read_bytes())
        blob[len(blob) // 2] ^= 1
        stored.write_bytes(bytes(blob))
        with pytest.raises(IntegrityError):
            await restore_fetched(
                new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
            )
        assert await new.agents.list(include_archived=True) == []
        assert list(new.config.attachments_dir.iterdir()) == []
        fetched = await engine.fetch(made.backup_id, tmp_path / "good", decode_agents=False)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        assert await _export_files(new, agents, tmp_path / "after.tar.gz") == before


async def test_restore_reads_a_folder_targets_segments_in_place_and_refuses_a_tampered_one(
    tmp_path: Path,
) -> None:
    old = await _backed_up(tmp_path, 3, folder_target=True)
    agents, before, engine, made = old.agents, old.before, old.engine, old.made
    manifest = await engine.open(made.backup_id)
    last = [r for r in manifest.segments if r.kind == "agent"][-1]
    (stored_file,) = (tmp_path / "target").rglob(f"{last.name}*")
    pristine = stored_file.read_bytes()
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "stage", decode_agents=False)
        # Nothing of the agents' segments was copied: they are read where they are.
        assert [p.name for p in (tmp_path / "stage").iterdir() if p.name.startswith("agent")] == []
        # A byte flipped in the target itself, after the fetch: refused whole.
        blob = bytearray(pristine)
        blob[len(blob) // 2] ^= 1
        stored_file.write_bytes(bytes(blob))
        with pytest.raises(IntegrityError):
            await restore_fetched(
                new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
            )
        assert await new.agents.list(include_archived=True) == []
        # A segment gone from the target is named before anything is read.
        stored_file.unlink()
        with pytest.raises(IntegrityError, match=f"{last.name[:16]}: missing"):
            await engine.fetch(made.backup_id, tmp_path / "stage2", decode_agents=False)
        stored_file.write_bytes(pristine)
        fetched = await engine.fetch(made.backup_id, tmp_path / "stage3", decode_agents=False)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        assert await _export_files(new, agents, tmp_path / "after.tar.gz") == before


# A restore in a child process that stops for ever once it placed the first
# attachment: inside its transaction, after every agent loaded, before the commit.
_RESTORE_CHILD = r"""
import asyncio, sys, threading
from pathlib import Path

import machine.backups.transfer as transfer
from machine.backups.engine import BackupEngine, BackupResult
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.storage.db import Database
from shared.backup_folder import FolderTarget
from shared.archive import extract_staged
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.store.folder import FolderStore

data, target, key, machine_id, backup_id = sys.argv[1:]
data = Path(data)
place = transfer._place_attachment


def placed_then_stop(src, sha, folder):
    place(src, sha, folder)
    threading.Event().wait()  # parked here until the test kills this process


transfer._place_attachment = placed_then_stop


async def main():
    keypair = BoxKeyPair.from_private(bytes.fromhex(key))
    db = await Database.open(data / "machine.db")
    source = DatabaseBackupSource(db, data / "attachments", data / "work")
    engine = BackupEngine(
        source, StoreTarget(FolderStore(Path(target))), machine_id=machine_id,
        naming_key=bytes(32), recipients=[keypair.public_key], keypair=keypair,
        work_dir=data / "work",
    )
    fetched = await engine.fetch(backup_id, data / "stage", decode_agents=False)
    await restore_fetched(
        db, fetched, attachments_dir=data / "attachments", erased=set()
    )


asyncio.run(main())
"""


async def test_a_restore_killed_after_placing_attachments_commits_nothing(
    tmp_path: Path,
) -> None:
    old = await _backed_up(tmp_path, 2)
    agents, before, engine, made = old.agents, old.before, old.engine, old.made
    machine_key, old_id = old.key, old.machine_id
    new_config = _config(tmp_path / "new")
    async with open_machine(new_config):
        pass  # a new machine's data folder, closed for the child
    attachments = new_config.attachments_dir
    args = [str(new_config.data_dir), str(tmp_path / "target"), machine_key.private_key.hex()]
    child = subprocess.Popen([sys.executable, "-c", _RESTORE_CHILD, *args, old_id, made.backup_id])
    try:

        def placed() -> bool:
            if child.poll() is not None:
                raise AssertionError(f"the restore ended ({child.returncode}) before the kill")
            return attachments.is_dir() and any(attachments.iterdir())

        await apoll_until(placed, deadline=60, what="the first attachment placed")
    finally:
        child.kill()
        child.wait(timeout=30)
    assert any(attachments.iterdir())
    async with open_machine(new_config) as new:
        # The transaction never committed: no agent, only a file nothing names.
        assert await new.agents.list(include_archived=True) == []
        fetched = await engine.fetch(made.backup_id, tmp_path / "again", machine_key)
        result = await restore_fetched(
            new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted(agents)
        assert await _export_files(new, agents, tmp_path / "after.tar.gz") == before


def _repack(archive: Path, dest: Path, edit: Callable[[Path, dict[str, Any]], None]) -> Path:
    """The export ``archive`` unpacked, changed by ``edit(stage, manifest)`` and packed
    again as ``dest`` with every file hash in its manifest made right again."""
    stage = dest.with_suffix(".stage")
    with tarfile.open(archive) as tar:
        tar.extractall(stage, filter="data")
    manifest = json.loads((stage / "manifest.json").read_bytes())
    edit(stage, manifest)
    for entry in manifest["agents"]:
        folder = stage / "agents" / entry["agent_id"]
        entry["files"] = {
            name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in entry["files"]
        }
    (stage / "manifest.json").write_text(json.dumps(manifest))
    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(stage.rglob("*")):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(stage)))
    return dest


async def _import(
    m: Machine, archive: Path, tmp: Path, erased: frozenset[str] = frozenset(), **kw: Any
) -> InResult:
    return await import_archive(
        m.db,
        archive,
        staging_dir=tmp / "incoming",
        attachments_dir=m.config.attachments_dir,
        erased=set(erased),
        **kw,
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_an_import_never_writes_into_another_agents_rows(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 2)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
    first, second = agents

    def only(agent_id: str) -> Callable[[Path, dict[str, Any]], None]:
        def edit(stage: Path, manifest: dict[str, Any]) -> None:
            manifest["agents"] = [e for e in manifest["agents"] if e["agent_id"] == agent_id]
            for other in agents:
                if other != agent_id:
                    shutil.rmtree(stage / "agents" / other)
            named = {s for e in manifest["agents"] for s in e["attachments"]}
            for f in (stage / "attachments").iterdir():
                if f.name not in named:
                    f.unlink()

        return edit

    async with open_machine(_config(tmp_path / "b")) as b:
        await _import(b, _repack(archive, tmp_path / "first.tar.gz", only(first)), tmp_path)
        mine = tmp_path / "first-export.tar.gz"
        before = await _export_files(b, [first], mine)

        # The second agent's summaries name a run of the first: a summary would have
        # replaced the first agent's.
        def steal_summary(stage: Path, manifest: dict[str, Any]) -> None:
            only(second)(stage, manifest)
            runs = [e["run_id"] for e in _lines(tmp_path / "runs-of-first.jsonl")]
            path = stage / "agents" / second / "summaries.jsonl"
            rows = _lines(path)
            rows.append({"run_id": runs[0], "text": "STOLEN", "created_at": 1.0})
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

        with tarfile.open(mine) as tar:
            f = tar.extractfile(f"agents/{first}/conversation.jsonl")
            assert f is not None
            (tmp_path / "runs-of-first.jsonl").write_bytes(f.read())
        bad = _repack(archive, tmp_path / "steal.tar.gz", steal_summary)
        with pytest.raises(InvalidArgument, match="names a run its conversation does not start"):
            await _import(b, bad, tmp_path)

        # The second agent under a new id with the first's runs: the run ids collide.
        def clone_first(stage: Path, manifest: dict[str, Any]) -> None:
            only(first)(stage, manifest)
            clone = new_id("agent")
            (stage / "agents" / first).rename(stage / "agents" / clone)
            record = json.loads((stage / "agents" / clone / "record.json").read_text())
            record["agent_id"] = clone
            (stage / "agents" / clone / "record.json").write_text(json.dumps(record))
            manifest["agents"][0]["agent_id"] = clone

        clone = _repack(archive, tmp_path / "clone.tar.gz", clone_first)
        with pytest.raises(InvalidArgument, match="already on this machine"):
            await _import(b, clone, tmp_path)
        assert [x.id for x in await b.agents.list(include_archived=True)] == [first]
        assert await _export_files(b, [first], tmp_path / "after.tar.gz") == before


async def test_an_import_of_this_machines_own_agent_is_refused(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 1)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
        own = a.ids.own
    # The agent left the machine's database (and its erased list): an import must
    # still not bring it back as one that runs here.
    db = sqlite3.connect(tmp_path / "a" / "machine.db")
    with db:
        db.execute("PRAGMA foreign_keys = ON")
        db.execute("DELETE FROM agents")
    db.close()
    async with open_machine(_config(tmp_path / "a")) as a:
        with pytest.raises(InvalidArgument, match="its origin is this machine"):
            await _import(a, archive, tmp_path, own_ids=own)
        assert await a.agents.list(include_archived=True) == []


async def test_a_skipped_agents_attachments_stay_out(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 2)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
    async with open_machine(_config(tmp_path / "b")) as b:
        result = await _import(b, archive, tmp_path, erased=frozenset({agents[0]}))
        assert result.restored == (agents[1],) and result.attachments == 1
        placed = sorted(p.name for p in b.config.attachments_dir.iterdir())
        con = sqlite3.connect(tmp_path / "b" / "machine.db")
        named = sorted(r[0] for r in con.execute("SELECT DISTINCT sha256 FROM attachment_refs"))
        con.close()
        assert placed == named and len(placed) == 1


async def test_an_agent_erased_while_an_import_was_staged_is_not_brought_back(
    tmp_path: Path,
) -> None:
    async with open_machine(_config(tmp_path / "a")) as a:
        agents = await _populate(a, tmp_path, 2)
        archive = tmp_path / "out.tar.gz"
        await _export_files(a, agents, archive)
    async with open_machine(_config(tmp_path / "b")) as b:
        stage = tmp_path / "stage"
        with tarfile.open(archive) as tar:
            tar.extractall(stage, filter="data")

        def erased_meanwhile(todo: list[str]) -> None:
            # Between the look at the erased list and the transaction, another
            # connection commits an erasure of the first agent.
            assert agents[0] in todo
            con = sqlite3.connect(tmp_path / "b" / "machine.db")
            with con:
                con.execute(
                    "INSERT INTO erased (agent_id, erased_at) VALUES (?, 1.0)", (agents[0],)
                )
            con.close()

        result = await transfer.commit_staged(
            b.db,
            {a: stage / "agents" / a for a in agents},
            {p.name: p for p in (stage / "attachments").iterdir()},
            b.config.attachments_dir,
            usage=[],
            erased=set(),
            what="import test",
            start=erased_meanwhile,
        )
        assert result.restored == (agents[1],)
        assert result.skipped_erased == (agents[0],)
        assert [x.id for x in await b.agents.list(include_archived=True)] == [agents[1]]


async def _with_a_cancelled_queued_run(m: Machine, tmp: Path) -> tuple[str, str]:
    """An agent whose second run was cancelled while queued behind the first: the
    conversation ends that run without ever starting it. Returns (agent, that run)."""
    agent = (await m.agents.create(name="queued", folder=str(tmp))).id
    stream = await m.runs.prompt(agent, "/tool ls X")  # waits for a permission
    first = None
    async for ev in stream:
        if ev.kind is EventKind.PERMISSION_REQUEST:
            first = ev
            break
    assert first is not None
    queued, _ = await m.runs.submit(agent, "queued one", ())
    await m.runs.cancel(queued.id)
    await m.runs.answer(first.run_id, first.payload["request_id"], "allow_once")
    await asyncio.wait_for(_drain(stream), DEADLINE)
    await m.agents.archive(agent)
    return agent, queued.id


async def test_a_run_cancelled_before_it_started_exports_imports_and_restores(
    tmp_path: Path,
) -> None:
    key = BoxKeyPair.generate()
    async with open_machine(_config(tmp_path / "a")) as a:
        (good,) = await _populate(a, tmp_path, 1)
        agent, never = await _with_a_cancelled_queued_run(a, tmp_path)
        archive = tmp_path / "out.tar.gz"
        before = await _export_files(a, [good, agent], archive)
        assert never.encode() in before[f"agents/{agent}/conversation.jsonl"]
        engine = BackupEngine(
            DatabaseBackupSource(a.db, a.config.attachments_dir, tmp_path / "w"),
            StoreTarget(FolderStore(tmp_path / "t")),
            machine_id=a.ids.canonical,
            naming_key=os.urandom(32),
            recipients=[key.public_key],
            keypair=key,
            work_dir=tmp_path / "w",
        )
        made = await engine.backup_now()
    async with open_machine(_config(tmp_path / "b")) as b:
        assert sorted((await _import(b, archive, tmp_path)).restored) == sorted([good, agent])
        assert await _export_files(b, [good, agent], tmp_path / "b.tar.gz") == before
        run = await b.runs.get_run(never)
        assert run.agent_id == agent and run.started_at is None
    async with open_machine(_config(tmp_path / "c")) as c:
        fetched = await engine.fetch(made.backup_id, tmp_path / "fetch", key, decode_agents=False)
        result = await restore_fetched(
            c.db, fetched, attachments_dir=c.config.attachments_dir, erased=set()
        )
        assert sorted(result.restored) == sorted([good, agent])
        assert await _export_files(c, [good, agent], tmp_path / "c.tar.gz") == before
        assert (await c.runs.get_run(never)).state.value == "cancelled"


def _hostile_segment(kind: str, agent: str, outside: Path) -> bytes:
    """An agent's segment plaintext: a tar that is not the agent's four files."""
    record = f"agents/{agent}/record.json"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(info: tarfile.TarInfo, data: bytes = b"") -> None:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        if kind == "dotdot":
            add(tarfile.TarInfo("../" * 8 + str(outside).lstrip("/")), b"x")
        elif kind == "absolute":
            add(tarfile.TarInfo(str(outside)), b"x")
        elif kind in ("symlink", "hardlink"):
            info = tarfile.TarInfo(record)
            info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
            info.linkname = str(outside)
            add(info)
        elif kind in ("device", "fifo"):
            info = tarfile.TarInfo(record)
            info.type = tarfile.CHRTYPE if kind == "device" else tarfile.FIFOTYPE
            add(info)
        elif kind == "many":
            for i in range(1000):
                add(tarfile.TarInfo(f"agents/{agent}/junk-{i}"), b"{}")
    if kind == "10 GB":
        # Only the header: the entry claims 10 GB that never come.
        info = tarfile.TarInfo(record)
        info.size = 10 * 1024**3
        return info.tobuf(format=tarfile.PAX_FORMAT)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("dotdot", "holds '../"),
        ("absolute", "holds '/"),
        ("symlink", "holds record.json as a symbolic link to '/"),
        ("hardlink", "holds record.json as a hard link to '/"),
        ("device", "holds record.json as a device"),
        ("fifo", "holds record.json as a FIFO"),
        ("10 GB", "claims 10737418240 bytes for record.json"),
        ("many", "/junk-0' where"),
    ],
)
async def test_a_hostile_tar_in_an_authentic_segment_is_refused_by_a_restore_and_writes_nothing(
    tmp_path: Path, kind: str, says: str
) -> None:
    """A segment that authenticates (sealed with the backup's keys, named by its hash)
    but whose plaintext is a hostile tar: the restore refuses it whole, clearly, and
    writes nothing, in the machine or outside it."""
    from tests.machine.backups.test_backup_engine import FakeSource

    outside = tmp_path / "outside" / "escape.txt"
    source = FakeSource(tmp_path, 1)
    agent = next(iter(source.data))
    source.data[agent] = _hostile_segment(kind, agent, outside)
    key = BoxKeyPair.generate()
    engine = BackupEngine(
        source,
        StoreTarget(FolderStore(tmp_path / "target")),
        machine_id=new_id("machine"),
        naming_key=os.urandom(32),
        recipients=[key.public_key],
        keypair=key,
        work_dir=tmp_path / "work",
    )
    made = await engine.backup_now()
    async with open_machine(_config(tmp_path / "new")) as new:
        fetched = await engine.fetch(made.backup_id, tmp_path / "stage", decode_agents=False)
        with pytest.raises(IntegrityError, match=f"backup agent {agent}: segment") as refused:
            await restore_fetched(
                new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
            )
        assert says in str(refused.value) and len(str(refused.value).splitlines()) == 1
        assert await new.agents.list(include_archived=True) == []
        assert list(new.config.attachments_dir.iterdir()) == []
    assert not outside.parent.exists()
    assert not list((tmp_path / "new").rglob("escape.txt"))


@pytest.mark.parametrize(
    "damage", ["truncate", "swap_chunks", "drop_chunk", "append", "another_backup"]
)
async def test_a_damaged_segment_is_refused_by_the_restore_as_it_loads(
    tmp_path: Path, damage: str
) -> None:
    """Each way a stored segment can be cut, reordered or swapped is refused by the
    restore that decodes as it loads (not only by verify), and nothing is kept."""
    from tests.machine.backups.test_backup_engine import FakeSource
    from tests.machine.formats.test_backup_format import _frames

    def backed_up(where: str) -> tuple[BackupEngine, FakeSource]:
        source = FakeSource(tmp_path / where, 1)
        agent = next(iter(source.data))
        source.data[agent] = os.urandom(3 * 1024 * 1024)  # several 1 MiB chunks
        key = BoxKeyPair.generate()
        engine = BackupEngine(
            source,
            StoreTarget(FolderStore(tmp_path / where / "target")),
            machine_id=new_id("machine"),
            naming_key=os.urandom(32),
            recipients=[key.public_key],
            keypair=key,
            work_dir=tmp_path / where / "work",
        )
        return engine, source

    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    engine, source = backed_up("ours")
    made = await engine.backup_now()
    async with open_machine(_config(tmp_path / "new")) as new:

        async def restore(stage: str) -> None:
            fetched = await engine.fetch(made.backup_id, tmp_path / stage, decode_agents=False)
            if stage == "damaged":
                ((_, stored),) = fetched.stored_agents.values()
                stored.write_bytes(await damaged(stored.read_bytes()))
            await restore_fetched(
                new.db, fetched, attachments_dir=new.config.attachments_dir, erased=set()
            )

        async def damaged(blob: bytes) -> bytes:
            frames = _frames(blob)
            assert len(frames) >= 3
            if damage == "truncate":
                return blob[:-100]
            if damage == "swap_chunks":
                return blob[:24] + frames[1] + frames[0] + b"".join(frames[2:])
            if damage == "drop_chunk":
                return blob[:24] + frames[0] + b"".join(frames[2:])
            if damage == "append":
                return blob + b"x"
            # A segment of another machine's backup, stored under this one's name.
            other, _ = backed_up("theirs")
            await other.backup_now()
            theirs = FolderStore(tmp_path / "theirs" / "target")
            listed = [i async for i in theirs.list("segments/")]
            return await theirs.get(max(listed, key=lambda i: i.size).key)

        # Undamaged, the segment authenticates and only then fails as a tar (it is
        # random bytes): so a refusal below is the damage's, found by authentication.
        with pytest.raises(IntegrityError, match="not a tar"):
            await restore("pristine")
        with pytest.raises(IntegrityError) as refused:
            await restore("damaged")
        assert "not a tar" not in str(refused.value)
        assert await new.agents.list(include_archived=True) == []
        assert list(new.config.attachments_dir.iterdir()) == []
