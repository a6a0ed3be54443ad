"""Agent erasure against real daemons: bytes gone, runtime copies gone, receipts,
retries across restarts, and restore/import skipping erased agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc, run_cli
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAKE_AGENT = ROOT / "tests" / "helpers" / "fake_acp_agent.py"
DEADLINE = 30.0
# Lower case: the search index keeps its terms lower-cased, and they must go too.
MARKER = "zq7markerw3x9erasure"


class Setup:
    """A daemon with a temporary HOME, a work folder and a fake ACP agent's state."""

    def __init__(self, tmp_path: Path) -> None:
        self.data = tmp_path / "d"
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.state = tmp_path / "fake"
        self.state.mkdir()
        # An empty CLAUDE_CONFIG_DIR / CODEX_HOME means "unset": ~/.claude, ~/.codex.
        self.env = {"HOME": str(self.home), "CLAUDE_CONFIG_DIR": "", "CODEX_HOME": ""}
        self.daemon = MachineProc(self.data, env=self.env)

    def fake_events(self, event: str) -> list[dict[str, Any]]:
        path = self.state / "events.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [r for r in rows if r["event"] == event]

    def kill_leftover_agents(self) -> None:
        path = self.state / "events.jsonl"
        if not path.exists():
            return
        for pid in {json.loads(x)["pid"] for x in path.read_text().splitlines() if x.strip()}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def acp_settings(self, kind: str, *extra: str) -> str:
        command = [sys.executable, str(FAKE_AGENT), "--state-dir", str(self.state), *extra]
        return json.dumps({"command": command, "kind": kind})


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path)
    try:
        yield s
    finally:
        s.daemon.kill()
        s.kill_leftover_agents()


@contextlib.asynccontextmanager
async def stub_for(daemon: MachineProc) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(daemon.target) as channel:
        yield pb_grpc.MachineServiceStub(channel)


async def prompt(stub: Any, agent_id: str, text: str, attachments: list[str] = ()) -> None:  # type: ignore[assignment]
    """Run a prompt to its end, allowing any tool it asks for."""
    call = stub.Prompt(
        pb.PromptRequest(agent_id=agent_id, text=text, attachments=list(attachments)),
        timeout=DEADLINE,
    )
    async for ev in call:
        kind = ev.WhichOneof("payload")
        if kind == "permission_request":
            await stub.AnswerPermission(
                pb.AnswerPermissionRequest(
                    run_id=ev.run_id,
                    request_id=ev.permission_request.request_id,
                    option_id=ev.permission_request.options[0].option_id,
                ),
                timeout=10,
            )
        elif kind == "run_error":
            raise AssertionError(f"run failed: {ev.run_error.message}")
        elif kind == "run_finished":
            return


async def upload(stub: Any, agent_id: str, data: bytes) -> str:
    async def parts() -> AsyncIterator[pb.UploadAttachmentRequest]:
        yield pb.UploadAttachmentRequest(
            header=pb.AttachmentHeader(agent_id=agent_id, file_name="note.txt", size=len(data))
        )
        yield pb.UploadAttachmentRequest(chunk=data)

    reply = await stub.UploadAttachment(parts(), timeout=10)
    return str(reply.sha256)


async def create(stub: Any, setup: Setup, name: str, runtime: str = "", settings: str = "") -> str:
    agent = await stub.CreateAgent(
        pb.CreateAgentRequest(
            name=name, folder=str(setup.work), runtime=runtime, settings_json=settings
        ),
        timeout=10,
    )
    return str(agent.id)


async def receipts(stub: Any) -> dict[str, Any]:
    listed = await stub.ListErasures(pb.ListErasuresRequest(), timeout=10)
    return {e.agent_id: e for e in listed.erasures}


def raw_bytes(data: Path) -> dict[str, bytes]:
    """Every file the marker must be absent from: the database's three and attachments."""
    files = {name: data / name for name in ("machine.db", "machine.db-wal", "machine.db-shm")}
    files |= {f"attachments/{p.name}": p for p in (data / "attachments").iterdir()}
    return {name: path.read_bytes() for name, path in files.items() if path.exists()}


def touch(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


async def test_delete_erases_the_bytes_and_the_runtime_copies(setup: Setup) -> None:
    daemon = setup.daemon
    daemon.start()
    async with stub_for(daemon) as stub:
        echo = await create(stub, setup, "echo")
        sha = await upload(stub, echo, f"attached {MARKER} words\n".encode())
        await prompt(stub, echo, f"remember {MARKER}", [sha])
        await prompt(stub, echo, f"/tool write {MARKER}")
        claude = await create(stub, setup, "claude", "acp", setup.acp_settings("claude"))
        codex = await create(stub, setup, "codex", "acp", setup.acp_settings("codex"))
        sessions = {}
        for agent_id in (claude, codex):
            await prompt(stub, agent_id, f"hello {MARKER}")
            got = await stub.GetAgent(pb.GetAgentRequest(agent_id=agent_id), timeout=10)
            sessions[agent_id] = got.session_id
        claude_home = setup.home / ".claude"
        claude_files = [
            touch(claude_home / "projects" / "-work" / f"{sessions[claude]}.jsonl", MARKER),
            touch(claude_home / "debug" / f"{sessions[claude]}.txt", MARKER),
        ]
        codex_file = touch(
            setup.home / ".codex" / "sessions" / "2026" / "01" / "02"
            / f"rollout-2026-01-02T03-04-05-{sessions[codex]}.jsonl",
            MARKER,
        )  # fmt: skip
        other = touch(setup.home / ".claude" / "projects" / "-work" / "keep.jsonl", "other")
        # The test can fail: the marker is in the files before the delete.
        assert any(MARKER.encode() in b for b in raw_bytes(setup.data).values())

        # Active agents are refused, and nothing changes.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=echo), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "archive it first" in (err.value.details() or "")
        await stub.GetAgent(pb.GetAgentRequest(agent_id=echo), timeout=10)

        for agent_id in (echo, claude, codex):
            await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=agent_id), timeout=10)
            reply = await stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=agent_id), timeout=30)
            assert reply.agent_id == agent_id and reply.runtime_erasure_queued

        async def all_done() -> dict[str, Any] | None:
            got = await receipts(stub)
            ok = all(got[a].state not in ("queued",) for a in (echo, claude, codex))
            return got if ok else None

        got = await apoll_until(all_done, deadline=DEADLINE, what="runtime erasures")
        for agent_id in (echo, claude, codex):
            r = got[agent_id]
            assert (r.machine_data, r.attachments, r.runtime_copy) == ("done", "done", "done"), r
        for agent_id in (echo, claude, codex):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetAgent(pb.GetAgentRequest(agent_id=agent_id), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        hits = await stub.Search(pb.SearchRequest(query=MARKER), timeout=10)
        assert list(hits.hits) == []

    for name, content in raw_bytes(setup.data).items():
        assert MARKER.encode() not in content, f"the marker is still in {name}"
    assert not (setup.data / "attachments" / sha).exists()
    # The runtimes' own copies: session/delete reached the agent; CLI files are gone.
    deleted = {e["session_id"] for e in setup.fake_events("delete_session")}
    assert deleted == {sessions[claude], sessions[codex]}
    assert not any((setup.state / "sessions" / f"{s}.json").exists() for s in deleted)
    assert not any(p.exists() for p in [*claude_files, codex_file])
    assert other.exists()
    daemon.stop()


async def test_a_failing_runtime_is_tried_at_each_start_then_given_up(setup: Setup) -> None:
    daemon = setup.daemon
    daemon.start()
    async with stub_for(daemon) as stub:
        agent = await create(
            stub, setup, "stuck", "acp", setup.acp_settings("generic", "--fail-delete")
        )
        await prompt(stub, agent, "hello")
        await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=agent), timeout=10)
        await stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=agent), timeout=30)

    for tries in (1, 2, 3):
        if tries > 1:
            daemon.stop()
            daemon.start()
        async with stub_for(daemon) as stub:

            async def tried(n: int = tries) -> Any:
                r = (await receipts(stub))[agent]
                return r if r.attempts >= n else None

            r = await apoll_until(tried, deadline=DEADLINE, what=f"erasure try {tries}")
        assert r.attempts == tries
        assert len(setup.fake_events("delete_session")) == tries
        if tries < 3:
            assert (r.state, r.runtime_copy) == ("queued", "pending"), r
            assert "tried again at the next start" in r.detail
    assert (r.state, r.runtime_copy, r.machine_data) == ("failed", "failed", "done"), r
    assert "given up after 3 tries" in r.detail
    out = run_cli(setup.data, "agent", "erasures", env=setup.env)
    assert out.returncode == 0, out.stderr
    assert agent in out.stdout and "failed" in out.stdout
    listed = json.loads(run_cli(setup.data, "--json", "agent", "erasures", env=setup.env).stdout)
    assert listed["erasures"][0]["runtime_copy"] == "failed"
    daemon.stop()


def _cli(setup: Setup, *args: str, data: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli(data or setup.data, *args, env=setup.env)


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    first = result.stderr.strip().splitlines()[0]
    for word in words:
        assert word in first, first
    return first


def test_bad_input_is_refused_in_one_line(setup: Setup) -> None:
    setup.daemon.start()
    _refused(_cli(setup, "agent", "delete", "not-an-id"), "agent_id")
    missing = "ag_" + "0" * 26
    unknown = _cli(setup, "agent", "delete", missing)
    if "agent_id" in unknown.stderr:  # a made-up id of the right shape may not validate
        pytest.fail(unknown.stderr)
    _refused(unknown, "not found")
    agent = _ok(_cli(setup, "agent", "create", "active", "--folder", str(setup.work))).strip()
    active = _cli(setup, "agent", "delete", agent)
    _refused(active, "archive it first")
    assert "agent archive ID" in active.stderr  # the hint
    assert agent in _ok(_cli(setup, "agent", "list"))
    with grpc.insecure_channel(setup.daemon.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        for bad, code in ((missing, grpc.StatusCode.NOT_FOUND),
                          ("../x", grpc.StatusCode.INVALID_ARGUMENT)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                stub.DeleteAgent(pb.DeleteAgentRequest(agent_id=bad), timeout=10)
            assert err.value.code() == code  # type: ignore[attr-defined]
    setup.daemon.stop()


def _export(stub: Any, agent_id: str, dest: Path) -> None:
    dest.write_bytes(
        b"".join(c.data for c in stub.Export(pb.ExportRequest(agent_ids=[agent_id]), timeout=30))
    )


def _import(stub: Any, archive: Path) -> Any:
    return stub.Import(iter([pb.ImportChunk(data=archive.read_bytes())]), timeout=30)


def _backup(stub: Any) -> str:
    updates = list(stub.BackupNow(pb.BackupNowRequest(), timeout=60))
    return str(updates[-1].backup.id)


def test_restore_and_import_skip_an_erased_agent_also_on_a_new_machine(
    setup: Setup, tmp_path: Path
) -> None:
    export = tmp_path / "gone.tar.gz"
    with setup.daemon, grpc.insecure_channel(setup.daemon.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        ids = []
        for name in ("gone", "kept"):
            req = pb.CreateAgentRequest(name=name, folder=str(setup.work))
            ids.append(stub.CreateAgent(req, timeout=10).id)
            for _ in stub.Prompt(pb.PromptRequest(agent_id=ids[-1], text=f"words of {name}")):
                pass
        gone, kept = ids
        key = stub.CreateRecoveryKey(pb.CreateRecoveryKeyRequest(), timeout=10).private_key
        before = _backup(stub)
        _export(stub, gone, export)
        stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=gone), timeout=10)
        assert gone in _ok(_cli(setup, "agent", "delete", gone))

        restored = stub.Restore(pb.RestoreRequest(backup_id=before), timeout=60)
        assert list(restored.skipped_erased) == [gone] and list(restored.restored) == []
        assert list(_import(stub, export).skipped_erased) == [gone]
        listed = stub.ListAgents(pb.ListAgentsRequest(include_archived=True), timeout=10)
        assert [a.id for a in listed.agents] == [kept]
        receipt = (sync_receipts(stub))[gone]
        assert receipt.backups == "pending"  # the backup made before still holds it
        after = _backup(stub)
        setup.daemon.stop()
    copy = tmp_path / "backup-copy"
    shutil.copytree(setup.data / "backups", copy)

    # A new machine: the backup made after the delete brings the erased list back.
    new = MachineProc(tmp_path / "new" / "d", env=setup.env)
    with new, grpc.insecure_channel(new.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)

        def restore(backup_id: str) -> Any:
            req = pb.RestoreRequest(
                backup_id=backup_id, from_dir=str(copy), recovery_private_key=key
            )
            return stub.Restore(req, timeout=60)

        out = restore(after)
        assert list(out.restored) == [kept] and list(out.skipped_erased) == []
        erasures = stub.ListErasures(pb.ListErasuresRequest(), timeout=10).erasures
        assert [(e.agent_id, e.state) for e in erasures] == [(gone, "listed")]
        assert list(_import(stub, export).skipped_erased) == [gone]
        # The backup made before the delete does not bring the agent back either.
        assert list(restore(before).skipped_erased) == [gone]
        new.stop()


def sync_receipts(stub: Any) -> dict[str, Any]:
    listed = stub.ListErasures(pb.ListErasuresRequest(), timeout=10)
    return {e.agent_id: e for e in listed.erasures}


async def test_sigkill_right_after_the_commit_is_finished_at_the_next_start(
    setup: Setup,
) -> None:
    daemon = setup.daemon
    daemon.start()
    async with stub_for(daemon) as stub:
        agent = await create(stub, setup, "killed")
        sha = await upload(stub, agent, f"attached {MARKER}\n".encode())
        await prompt(stub, agent, f"remember {MARKER}", [sha])
        await stub.ArchiveAgent(pb.ArchiveAgentRequest(agent_id=agent), timeout=10)

    def erased_here() -> bool:
        # A reader of its own: WAL lets it look while the daemon writes.
        conn = sqlite3.connect(f"file:{setup.data / 'machine.db'}?mode=ro", uri=True)
        try:
            return bool(conn.execute("SELECT COUNT(*) FROM erased").fetchone()[0])
        except sqlite3.OperationalError:  # busy for a moment: look again
            return False
        finally:
            conn.close()

    deleting = asyncio.create_task(
        asyncio.to_thread(run_cli, setup.data, "agent", "delete", agent, env=setup.env)
    )
    # SIGKILL as soon as the delete's transaction is committed (the bytes may still
    # be in the files): the next start must finish the erasure by itself.
    await apoll_until(erased_here, deadline=DEADLINE, what="the delete's commit", step=0.001)
    daemon.kill()
    await deleting
    daemon.start()
    async with stub_for(daemon) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetAgent(pb.GetAgentRequest(agent_id=agent), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        got = await receipts(stub)
        assert (got[agent].machine_data, got[agent].attachments) == ("done", "done")
    for name, content in raw_bytes(setup.data).items():
        assert MARKER.encode() not in content, f"the marker is still in {name}"
    daemon.stop()
