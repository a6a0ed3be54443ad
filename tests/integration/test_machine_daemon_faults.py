"""The machine daemon as a real process under faults: a full disk, a damaged database."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import sqlite3
import subprocess
import tarfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc, run_cli
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

DEADLINE = 20.0


def stub_for(proc: MachineProc) -> tuple[grpc.aio.Channel, pb_grpc.MachineServiceAsyncStub]:
    channel = grpc.aio.insecure_channel(proc.target)
    return channel, pb_grpc.MachineServiceStub(channel)


async def poll(check: Callable[[], object], what: str) -> None:
    """Wait until ``await check()`` is truthy; fail after the deadline."""
    await apoll_until(check, deadline=DEADLINE, what=what, step=0.05)


# ------------------------------------------------------------------ full disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs (we run as root in CI); skipped where mount is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Write a file into ``folder`` until the disk is full; return it."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (64 * 1024, 4096, 512):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


async def test_full_disk_resource_exhausted_storage_failed_run_and_recovery(
    small_disk: Path, tmp_path: Path
) -> None:
    proc = MachineProc(small_disk / "data")
    proc.log_path = tmp_path / "machine.log"  # not on the disk we fill
    with proc:
        channel, stub = stub_for(proc)
        try:
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
            first = [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="hi"))]
            assert first[-1].kind == pb.RUN_FINISHED

            # A long run in flight when the disk fills up.
            slow = stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="/slow 5 " + "word " * 400))
            seen: list[pb.RunEvent] = []
            stream = slow.__aiter__()
            seen.append(await asyncio.wait_for(stream.__anext__(), DEADLINE))
            assert seen[0].kind == pb.RUN_STARTED
            filler = fill(small_disk)

            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for ev in stream:
                    seen.append(ev)
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(proc.data_dir) in (failed.value.details() or "")
            run_id = seen[0].run_id
            run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
            assert run.state == pb.RUN_STATE_RUNNING

            # New prompts and uploads are refused with the same status, not INTERNAL.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="x"))]
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            async def parts() -> AsyncIterator[pb.UploadAttachmentRequest]:
                yield pb.UploadAttachmentRequest(
                    header=pb.AttachmentHeader(agent_id=agent.id, file_name="f.bin", size=1 << 20)
                )
                for _ in range(16):
                    yield pb.UploadAttachmentRequest(chunk=os.urandom(64 * 1024))

            with pytest.raises(grpc.aio.AioRpcError) as upload:
                await stub.UploadAttachment(parts())
            assert upload.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert str(proc.data_dir) in (upload.value.details() or "")
            assert not [p for p in (proc.data_dir / "attachments").iterdir()]

            # Space comes back: the run ends STORAGE_FAILED by itself, no restart.
            filler.unlink()

            async def ended() -> bool:
                got = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
                return bool(got.state == pb.RUN_STATE_FAILED)

            await poll(ended, "the run to end")
            run = await stub.GetRun(pb.GetRunRequest(run_id=run_id))
            assert run.error_code == pb.STORAGE_FAILED
            events = [
                ev async for ev in stub.Replay(pb.ReplayRequest(agent_id=agent.id, after_seq=0))
            ]
            last = [ev for ev in events if ev.run_id == run_id][-1]
            assert last.kind == pb.RUN_ERROR and last.run_error.code == pb.STORAGE_FAILED
            # Everything the client saw is stored.
            stored = {ev.seq for ev in events}
            assert {ev.seq for ev in seen} <= stored

            again = [
                ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text="back"))
            ]
            assert again[-1].kind == pb.RUN_FINISHED
        finally:
            await channel.close()
    assert "Traceback" not in proc.log()


async def _export_of_one_agent(tmp_path: Path) -> Path:
    """An export of one agent with a few hundred KB of conversation, made by a
    daemon whose data folder is not on the small disk."""
    source = MachineProc(tmp_path / "source")
    archive = tmp_path / "export.tar.gz"
    with source:
        channel, stub = stub_for(source)
        try:
            agent = await stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)))
            text = random.Random(34).randbytes(150_000).hex()  # compresses to about half
            events = [
                ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text=text))
            ]
            assert events[-1].kind == pb.RUN_FINISHED
        finally:
            await channel.close()
        done = run_cli(source.data_dir, "export", agent.id, "-o", str(archive))
        assert done.returncode == 0, done.stderr
    return archive


def _unpacked_size(archive: Path) -> int:
    with tarfile.open(archive) as tar:
        return sum(member.size for member in tar)


async def test_an_import_on_a_full_disk_names_the_data_folder_and_works_once_space_is_freed(
    small_disk: Path, tmp_path: Path
) -> None:
    archive = await _export_of_one_agent(tmp_path)
    packed, unpacked = archive.stat().st_size, _unpacked_size(archive)
    assert unpacked > packed + 128 * 1024, (packed, unpacked)
    proc = MachineProc(small_disk / "data")
    proc.log_path = tmp_path / "machine.log"  # not on the disk we fill
    with proc:
        channel, stub = stub_for(proc)

        async def chunks() -> AsyncIterator[pb.ImportChunk]:
            yield pb.ImportChunk(data=archive.read_bytes())

        def nothing_left() -> None:
            incoming = proc.data_dir / "Incoming"
            assert not incoming.exists() or list(incoming.iterdir()) == []
            assert list((proc.data_dir / "attachments").glob("*")) == []

        try:
            await stub.Status(pb.StatusRequest())
            filler = fill(small_disk)
            full = filler.stat().st_size
            # Too little room for the archive itself, then room for it but not for
            # what it unpacks to: both are a full disk, not a broken archive.
            for room in (packed // 2, packed + 64 * 1024):
                os.truncate(filler, full - room)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Import(chunks())
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, room
                assert str(proc.data_dir) in (refused.value.details() or "")
                nothing_left()
                cli = run_cli(proc.data_dir, "import", str(archive))
                assert cli.returncode == 1, (room, cli.stderr)
                line = cli.stderr.strip().splitlines()[0]
                assert "no space left" in line and str(proc.data_dir) in line, line
                assert "Traceback" not in cli.stderr
                nothing_left()
                listed = await stub.ListAgents(pb.ListAgentsRequest(include_archived=True))
                assert list(listed.agents) == []

            filler.unlink()
            done = run_cli(proc.data_dir, "import", str(archive))
            assert done.returncode == 0, done.stderr
            listed = await stub.ListAgents(pb.ListAgentsRequest(include_archived=True))
            assert [a.state for a in listed.agents] == [pb.AGENT_STATE_ARCHIVED]
            assert list((proc.data_dir / "Incoming").iterdir()) == []
        finally:
            await channel.close()
    assert "Traceback" not in proc.log()


# ------------------------------------------------------------------ damaged database


def damage(db: Path, seed: int = 8) -> None:
    """Write 4 KiB of random bytes over the middle (one page) of ``db``."""
    size = db.stat().st_size
    offset = (size // 2) // 4096 * 4096
    noise = random.Random(seed).randbytes(4096)
    fd = os.open(db, os.O_WRONLY)
    try:
        os.pwrite(fd, noise, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def damaged_then_refused(proc: MachineProc, db: Path) -> bytes:
    """Damage the stopped machine's ``db``; its start must refuse it, writing nothing.
    Returns the damaged file's bytes."""
    damage(db)
    before = db.read_bytes()
    with pytest.raises(RuntimeError, match="exited early"):
        proc.start()
    log = proc.log()
    assert "is damaged" in log and "restore" in log and "Traceback" not in log
    assert db.read_bytes() == before  # nothing was written into the broken file
    return before


def db_counts(data_dir: Path) -> tuple[int, int]:
    conn = sqlite3.connect(f"file:{data_dir / 'machine.db'}?mode=ro", uri=True)
    try:
        runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        agents = conn.execute("SELECT COUNT(*) FROM agents").fetchone()[0]
        return int(runs), int(agents)
    finally:
        conn.close()


async def populate(proc: MachineProc, folder: Path) -> list[str]:
    """Four agents with a few long runs each (a database of a few MiB)."""
    channel, stub = stub_for(proc)
    try:
        agents = [
            (await stub.CreateAgent(pb.CreateAgentRequest(name=f"a{i}", folder=str(folder)))).id
            for i in range(4)
        ]

        async def runs(agent_id: str) -> None:
            for n in range(4):
                text = f"run {n} " + " ".join(f"w{i}" for i in range(8000))
                events = [
                    ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agent_id, text=text))
                ]
                assert events[-1].kind == pb.RUN_FINISHED

        await asyncio.gather(*(runs(a) for a in agents))
        return agents
    finally:
        await channel.close()


async def test_damaged_database_is_refused_at_start_and_check_names_it(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    await populate(proc, tmp_path)
    assert proc.stop() == 0  # a clean stop checkpoints the WAL into machine.db
    db = proc.data_dir / "machine.db"
    before = damaged_then_refused(proc, db)

    checked = await asyncio.to_thread(run_cli, proc.data_dir, "check")
    assert checked.returncode == 1, checked.stderr
    assert "damaged" in checked.stdout and "restore" in checked.stdout
    assert db.read_bytes() == before


async def test_damage_found_while_serving_stops_writes_and_answers_data_loss(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    agents = await populate(proc, tmp_path)
    assert proc.stop() == 0
    proc.start()  # passes its quick_check: the damage comes after
    channel, stub = stub_for(proc)
    try:
        ok = await asyncio.to_thread(run_cli, proc.data_dir, "check")
        assert ok.returncode == 0 and ": ok" in ok.stdout, ok.stdout + ok.stderr
        damage(proc.data_dir / "machine.db")
        counts = db_counts(proc.data_dir)

        # Replays either succeed or fail with DATA_LOSS naming their agent; never INTERNAL.
        for agent_id in agents:
            try:
                [ev async for ev in stub.Replay(pb.ReplayRequest(agent_id=agent_id))]
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.DATA_LOSS, e
                assert agent_id in (e.details() or "")

        checked = await asyncio.to_thread(run_cli, proc.data_dir, "check")
        assert checked.returncode == 1 and "damaged" in checked.stdout, checked.stdout

        # Known damaged: no more writes, with DATA_LOSS naming the agent and the way out.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [ev async for ev in stub.Prompt(pb.PromptRequest(agent_id=agents[0], text="hi"))]
        assert refused.value.code() == grpc.StatusCode.DATA_LOSS
        details = refused.value.details() or ""
        assert agents[0] in details and "restore" in details
        with pytest.raises(grpc.aio.AioRpcError) as create:
            await stub.CreateAgent(pb.CreateAgentRequest(name="new", folder=str(tmp_path)))
        assert create.value.code() == grpc.StatusCode.DATA_LOSS
        assert db_counts(proc.data_dir) == counts
    finally:
        await channel.close()
    assert "Traceback" not in proc.log()


async def test_only_a_clean_stop_spares_the_check_and_a_kill_then_damage_is_refused(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    proc = machine_proc().start()
    await populate(proc, tmp_path)
    assert proc.stop() == 0
    db = proc.data_dir / "machine.db"
    assert (proc.data_dir / "machine.db.clean-stop").exists()

    proc.start()  # a clean stop before: no check on the path to the first answer
    assert "as the last clean stop left it" in proc.log()
    channel, stub = stub_for(proc)
    try:
        await stub.CreateAgent(pb.CreateAgentRequest(name="k", folder=str(tmp_path)))
    finally:
        await channel.close()
    proc.kill()
    assert not (proc.data_dir / "machine.db.clean-stop").exists()

    # SIGKILLed, then a page goes bad: the start checks and refuses the file.
    damaged_then_refused(proc, db)
