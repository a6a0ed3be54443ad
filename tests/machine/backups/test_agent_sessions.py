"""An acp agent's settings (without secrets) and its CLI session files through an
export and an import, and through a daily backup, an increment and a restore, on
real machines: it comes back with its command, its session id and its files,
byte-equal, and the secret env value is in no byte of what left the machine."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from machine.app import Machine, open_machine
from machine.backups.engine import BackupEngine
from machine.backups.restore import restore_fetched
from machine.backups.source import DatabaseBackupSource
from machine.config import MachineConfig
from machine.core.agents import SessionHomes, SettingsNote
from machine.storage import tables
from shared.archive import write_tar_gz
from shared.backup_target import StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument
from shared.store.memory import MemoryStore

SID = "0b7c4a52-5a7e-4a38-9c3e-2f1d7e0f9a11"
SECRET = "s3cr3t-value"
SETTINGS = {"command": ["claude-code-acp"], "env": {"SECRET_X": SECRET}, "kind": "claude"}


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root / "data",
        background_loops=False,
        shutdown_grace_seconds=0,
        claude_home=root / "claude",
    ).validate()


def _transcript(m: Machine) -> Path:
    assert m.config.claude_home is not None
    return m.config.claude_home / "projects" / "-srv" / f"{SID}.jsonl"


async def _agent(m: Machine, folder: Path) -> str:
    agent = await m.agents.create(
        name="a", folder=str(folder), runtime="acp", settings_json=json.dumps(SETTINGS)
    )
    await m.db.write(lambda c: tables.set_session_id(c, agent.id, SID))
    path = _transcript(m)
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"turn":1}\n')
    todos = path.parents[2] / "todos"
    todos.mkdir()
    (todos / f"{SID}-agent-{SID}.json").write_bytes(b"[]")
    env = path.parents[2] / "session-env" / SID
    env.mkdir(parents=True)
    (env / "env").write_text(f"SECRET_X={SECRET}")
    return agent.id


def _files(home: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(home)): p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file()
    }


async def test_export_and_import_bring_settings_session_and_files(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "old")) as old:
        agent_id = await _agent(old, tmp_path)
        archive, _ = await old.require_handoff().export([agent_id])
        assert SECRET.encode() not in gzip.decompress(archive.read_bytes())
    async with open_machine(_config(tmp_path / "new")) as new:
        incoming = new.require_handoff().incoming_file()
        shutil.copy(archive, incoming)
        result = await new.require_handoff().import_file(incoming)
        assert result.restored == (agent_id,)
        assert result.agent_settings == (SettingsNote(agent_id, ("env.SECRET_X",)),)
        agent = await new.agents.get(agent_id)
        assert agent.settings == {"command": ["claude-code-acp"], "env": {}, "kind": "claude"}
        assert agent.session_id == SID
        assert new.config.claude_home is not None
        assert _files(new.config.claude_home) == {
            f"projects/-srv/{SID}.jsonl": b'{"turn":1}\n',
            f"todos/{SID}-agent-{SID}.json": b"[]",
        }


def _engine(m: Machine, store: MemoryStore, key: BoxKeyPair, work: Path) -> BackupEngine:
    assert m.config.claude_home is not None
    source = DatabaseBackupSource(
        m.db, m.config.attachments_dir, work, homes=SessionHomes(claude=m.config.claude_home)
    )
    return BackupEngine(
        source,
        StoreTarget(store),
        machine_id=m.ids.canonical,
        naming_key=b"n" * 32,
        recipients=[key.public_key],
        keypair=key,
        work_dir=work,
    )


FAKE_AGENT = Path(__file__).resolve().parents[2] / "helpers" / "fake_acp_agent.py"


async def _prompt(m: Machine, agent_id: str, text: str) -> None:
    async def run() -> None:
        async for _ in await m.runs.prompt(agent_id, text):
            pass

    await asyncio.wait_for(run(), 15)


async def test_a_point_and_increments_restore_the_newest_session_files(tmp_path: Path) -> None:
    """A real acp agent (the fake ACP agent, kind claude): its session id is the
    one it opened; the point holds its files whole, each increment only the
    transcript that changed, and the restore merges them."""
    key, store, work = BoxKeyPair.generate(), MemoryStore(), tmp_path / "work"
    command = [sys.executable, str(FAKE_AGENT), "--state-dir", str(tmp_path / "fake")]
    settings = {"command": command, "env": {"SECRET_X": SECRET}, "kind": "claude"}
    async with open_machine(_config(tmp_path / "old")) as old:
        agent_id = (
            await old.agents.create(
                name="a", folder=str(tmp_path), runtime="acp", settings_json=json.dumps(settings)
            )
        ).id
        await _prompt(old, agent_id, "one")
        sid = (await old.agents.get(agent_id)).session_id
        assert sid is not None
        assert old.config.claude_home is not None
        project = old.config.claude_home / "projects" / "-srv"
        project.mkdir(parents=True)
        transcript = project / f"{sid}.jsonl"
        transcript.write_bytes(b'{"turn":1}\n')
        (old.config.claude_home / "todos").mkdir()
        (old.config.claude_home / "todos" / f"{sid}-agent-{sid}.json").write_bytes(b"[]")
        engine = _engine(old, store, key, work)
        await engine.backup_now()
        for turn in (2, 3):
            await _prompt(old, agent_id, f"turn {turn}")
            transcript.write_bytes(b"".join(b'{"turn":%d}\n' % t for t in range(1, turn + 1)))
            assert await engine.increment_now() is not None
            # The chain keeps a hash per session file: the next delta carries changes only.
            chain_state = json.loads((work / "continuous.json").read_bytes())
            assert sorted(chain_state["sessions"][agent_id]) == [
                f"claude/projects/-srv/{sid}.jsonl",
                f"claude/todos/{sid}-agent-{sid}.json",
            ]
        transcript.write_bytes(transcript.read_bytes() + b'{"half')
        await _prompt(old, agent_id, "turn 4")
        assert await engine.increment_now() is not None
        chain = await engine.chain_at(None)
        fetched = await engine.fetch_chain(chain, tmp_path / "stage")
        # The merged agent is staged as plaintext: no env value in it.
        staged = [p for p in (tmp_path / "stage").rglob("*") if p.is_file()]
        assert staged and not any(SECRET.encode() in p.read_bytes() for p in staged)
    async with open_machine(_config(tmp_path / "new")) as new:
        assert new.config.claude_home is not None
        result = await restore_fetched(
            new.db,
            fetched,
            attachments_dir=new.config.attachments_dir,
            erased=set(),
            homes=SessionHomes(claude=new.config.claude_home),
        )
        assert result.restored == (agent_id,)
        assert result.agent_settings == (SettingsNote(agent_id, ("env.SECRET_X",)),)
        agent = await new.agents.get(agent_id)
        assert agent.session_id == sid
        assert agent.settings == {"command": command, "env": {}, "kind": "claude"}
        # The newest copy, cut after its last whole line, merged onto the point's.
        assert _files(new.config.claude_home) == {
            f"projects/-srv/{sid}.jsonl": b'{"turn":1}\n{"turn":2}\n{"turn":3}\n',
            f"todos/{sid}-agent-{sid}.json": b"[]",
        }


async def test_an_import_whose_session_files_leave_the_session_is_refused_whole(
    tmp_path: Path,
) -> None:
    """A crafted export (its manifest's hashes made to match) that would write the
    CLI's own settings: refused naming the path, no agent, no file written."""
    async with open_machine(_config(tmp_path / "old")) as old:
        agent_id = await _agent(old, tmp_path)
        archive, _ = await old.require_handoff().export([agent_id])
    with tarfile.open(archive) as tar:
        entries = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    hostile = io.BytesIO()
    with tarfile.open(fileobj=hostile, mode="w") as tar:
        info = tarfile.TarInfo("claude/settings.json")
        body = b'{"hooks": "run me"}'
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    name = f"agents/{agent_id}/sessions.tar"
    entries[name] = hostile.getvalue()
    manifest = json.loads(entries.pop("manifest.json"))
    manifest["agents"][0]["files"]["sessions.tar"] = hashlib.sha256(entries[name]).hexdigest()
    crafted = tmp_path / "crafted.tar.gz"
    write_tar_gz(crafted, [*entries.items(), ("manifest.json", json.dumps(manifest).encode())])
    async with open_machine(_config(tmp_path / "new")) as new:
        incoming = new.require_handoff().incoming_file()
        shutil.copy(crafted, incoming)
        with pytest.raises(InvalidArgument) as refused:
            await new.require_handoff().import_file(incoming)
        assert "'claude/settings.json' is not a file of the agent's session" in str(refused.value)
        assert await new.agents.list(include_archived=True) == []
        assert new.config.claude_home is not None
        assert not (new.config.claude_home / "settings.json").exists()
