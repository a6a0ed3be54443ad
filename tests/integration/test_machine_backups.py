"""Backups, restore, export and import through the CLI against real daemon processes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import os
import pty
import select
import shlex
import shutil
import signal
import sqlite3
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from machine.cli.common import human
from machine.formats.backup import manifest_aad
from shared.backup_target import manifest_key
from shared.crypto import (
    BoxKeyPair,
    decode_private_key,
    decode_public_key,
    encode_public_key,
    seal_bytes,
)
from shared.ids import new_id
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.recovery_key import read_recovery_key
from shared.store.folder import FolderStore
from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc, machine_env, run_cli
from tests.helpers.poll import apoll_until, poll_until

pytestmark = pytest.mark.integration

MakeProc = Callable[..., MachineProc]


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def _refused(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """A refusal: the exit code, one line (plus a hint) on stderr, no traceback."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    first = result.stderr.strip().splitlines()[0]
    for word in words:
        assert word in first, first
    return first


def _populate(data: Path, work: Path, agents: int = 3) -> list[str]:
    """Agents with conversations (echo runtime) and one attachment, made through the CLI."""
    work.mkdir(parents=True, exist_ok=True)
    note = work / "note.txt"
    note.write_text("the attached words of the backup test\n")
    ids = []
    for n in range(agents):
        agent = _ok(run_cli(data, "agent", "create", f"agent-{n}", "--folder", str(work))).strip()
        ids.append(agent)
        attach = ["--attach", str(note)] if n == 0 else []
        _ok(run_cli(data, "agent", "prompt", agent, f"remember the number {n}", *attach))
        _ok(run_cli(data, "agent", "prompt", agent, f"second turn of agent {n}"))
    return ids


def _export_contents(data: Path, agents: list[str], dest: Path) -> dict[str, bytes]:
    """The conversation, summaries and tools files and attachments of an export."""
    _ok(run_cli(data, "export", *agents, "-o", str(dest)))
    out: dict[str, bytes] = {}
    with tarfile.open(dest) as tar:
        for member in tar.getmembers():
            name = member.name
            if name.endswith(("conversation.jsonl", "summaries.jsonl", "tools.jsonl")) or (
                name.startswith("attachments/")
            ):
                f = tar.extractfile(member)
                assert f is not None
                out[name] = f.read()
    return out


def _backup_ids(data: Path, *extra: str) -> list[str]:
    listed = json.loads(_ok(run_cli(data, "--json", "backup", "list", *extra)))
    return [b["backup_id"] for b in listed.get("backups", [])]


def _agents(data: Path) -> list[dict[str, object]]:
    listed = json.loads(_ok(run_cli(data, "--json", "agent", "list", "--all")))
    agents: list[dict[str, object]] = listed.get("agents", [])
    return agents


def _segment_files(backups: Path) -> list[Path]:
    """Segment files, and packs with their indexes (temp files of either included)."""
    return sorted(
        p for folder in ("segments", "packs") for p in (backups / folder).rglob("*") if p.is_file()
    )


def test_restore_on_a_fresh_daemon_with_the_recovery_key(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    data = tmp_path / "data"
    key_file = tmp_path / "recovery.key"
    with machine_proc() as proc:
        agents = _populate(data, tmp_path / "work")
        # A public key the caller made that is malformed or unusable: INVALID_ARGUMENT
        # naming it, and none kept.
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb_grpc.MachineServiceStub(channel)
            for bad in ("agpk1_nonsense", "agsk1_" + "A" * 48, encode_public_key(bytes(32))):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.CreateRecoveryKey(pb.CreateRecoveryKeyRequest(public_key=bad))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "public_key" in (refused.value.details() or "")
        assert not (data / "keys" / "recovery.pub").exists()
        # A stdout that fails on write (a full disk): the key could not be shown,
        # so none is kept and backups are not sealed to it.
        with open("/dev/full", "w") as full:
            lost = subprocess.run(
                [str(AGENTS_MACHINE), "--data-dir", str(data), "backup", "recovery-key"],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                env=machine_env(),
                timeout=30,
                check=False,
            )
        assert lost.returncode == 1 and "could not write to stdout" in lost.stderr
        assert "nothing was made" in lost.stderr and "Traceback" not in lost.stderr
        assert "recovery key   none" in _ok(run_cli(data, "status"))
        key = _ok(run_cli(data, "backup", "recovery-key")).strip()
        assert key.startswith("agsk1_")
        public = (data / "keys" / "recovery.pub").read_text().strip()
        assert (
            decode_public_key(public) == BoxKeyPair.from_private(decode_private_key(key)).public_key
        )
        key_file.write_text(f"# test recovery key\n{key}\n")
        key_file.chmod(0o600)  # kept private, as its advice says
        _refused(run_cli(data, "backup", "recovery-key"), 2, "has one already")
        out = _ok(run_cli(data, "backup", "now"))
        ids = _backup_ids(data)
        assert len(ids) == 1 and ids[0] in out
        # Listed, it has the size `backup now` gave: every segment it names and its
        # manifest (the folder store's files add a header of their own to each).
        made = json.loads(_ok(run_cli(data, "--json", "backup", "list")))["backups"]
        files = [*_segment_files(data / "backups"), *(data / "backups").glob("manifests/*.sealed")]
        on_disk = sum(p.stat().st_size for p in files)
        assert on_disk - 100 * len(files) < int(made[0]["size_bytes"]) < on_disk
        assert f"{human(int(made[0]['size_bytes']))} stored" in out
        verify = _ok(run_cli(data, "backup", "verify", ids[0]))
        assert "ok" in verify
        status = _ok(run_cli(data, "status"))
        assert ids[0] in status and "restore check  ok" in status
        before = _export_contents(data, agents, tmp_path / "before.tar.gz")
    assert any(k.startswith("attachments/") for k in before)
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    # The key file is never needed to read the backup on the machine that made it,
    # and the backup holds no plaintext of the conversations.
    for path in copy.rglob("*"):
        if path.is_file():
            assert b"remember the number" not in path.read_bytes()
    shutil.rmtree(data)

    proc = machine_proc()
    with proc:
        # Without the recovery key, a new machine's own key does not open it; nor does
        # another recovery key.
        own_key = run_cli(data, "backup", "restore", ids[0], "--from", str(copy))
        _refused(own_key, 2, "not sealed to this key", "another machine made it")
        assert "Try: " in own_key.stderr and "--recovery-key FILE" in own_key.stderr
        assert "no (another key)" in _ok(run_cli(data, "backup", "list", "--from", str(copy)))
        listed = json.loads(_ok(run_cli(data, "--json", "backup", "list", "--from", str(copy))))
        assert [(b["opens"], b["problem"]) for b in listed["backups"]] == [(False, "another key")]
        wrong = tmp_path / "wrong.key"
        wrong.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        wrong.chmod(0o600)  # kept private, as its advice says
        line = _refused(
            run_cli(data, "backup", "restore", ids[0], "--from", str(copy), "--recovery-key",
                    str(wrong)),
            2,
        )  # fmt: skip
        assert "not sealed to this key (the recovery key given is not the one" in line
        verify = run_cli(
            data, "backup", "verify", ids[0], "--from", str(copy), "--recovery-key", str(wrong)
        )
        assert "recovery_key:" in _refused(verify, 2, "not sealed to this key")
        assert _agents(data) == []
        # A backup that is not there, and two sealed to the recovery key that are not
        # manifests this version reads: each named, and nothing restored.
        refused = {
            new_id("backup"): (2, "not found"),
            _plant_manifest(copy, key_file, b"{not json"): (1, "not valid JSON"),
            _plant_manifest(copy, key_file, b'{"version": 2}'): (1, "unknown manifest version 2"),
        }
        for backup_id, (code, says) in refused.items():
            line = _refused(
                run_cli(data, "backup", "restore", backup_id, "--from", str(copy),
                        "--recovery-key", str(key_file)),
                code,
            )  # fmt: skip
            assert backup_id in line and says in line, line
        assert _agents(data) == []
        restored = _ok(
            run_cli(
                data, "backup", "restore", ids[0], "--from", str(copy), "--recovery-key",
                str(key_file),
            )
        )  # fmt: skip
        assert f"restored {len(agents)} agents" in restored
        listed = _agents(data)
        assert sorted(str(a["agent_id"]) for a in listed) == sorted(agents)
        assert all(a["state"] == "archived" for a in listed), listed
        after = _export_contents(data, agents, tmp_path / "after.tar.gz")
        assert after == before
        # Restoring again skips them all.
        again = _ok(
            run_cli(
                data, "backup", "restore", ids[0], "--from", str(copy), "--recovery-key",
                str(key_file),
            )
        )  # fmt: skip
        assert f"skipped {len(agents)} already on this machine" in again
        proc.stop()
    # The private key never reaches the daemon's log.
    assert key not in proc.log()


def _plant_manifest(folder: Path, key_file: Path, plain: bytes) -> str:
    """A manifest sealed to the recovery key in a copied backup folder, holding
    ``plain``; returns its backup id."""
    store = FolderStore(folder)
    owner = json.loads(asyncio.run(store.get("machine.json")))["machine_id"]
    backup_id = new_id("backup")
    public = read_recovery_key(key_file).public_key
    sealed = seal_bytes(plain, [public], aad=manifest_aad(owner, backup_id))
    asyncio.run(store.put(manifest_key(backup_id), sealed))
    return backup_id


def test_a_tampered_backup_is_refused_and_changes_nothing(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    data = tmp_path / "data"
    key_file = tmp_path / "recovery.key"
    with machine_proc():
        _populate(data, tmp_path / "work", agents=2)
        key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        key_file.chmod(0o600)  # kept private, as its advice says
        _ok(run_cli(data, "backup", "now"))
        (backup_id,) = _backup_ids(data)
        segment = max(_segment_files(data / "backups"), key=lambda p: p.stat().st_size)
        raw = bytearray(segment.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        segment.write_bytes(bytes(raw))
        line = _refused(run_cli(data, "backup", "verify", backup_id), 1)
        assert "segment" in line or "chunk" in line, line
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    shutil.rmtree(data)
    with machine_proc():
        from_copy = ["--from", str(copy), "--recovery-key", str(key_file)]
        _refused(run_cli(data, "backup", "verify", backup_id, *from_copy), 1, "segment")
        line = _refused(run_cli(data, "backup", "restore", backup_id, *from_copy), 1)
        assert "segment" in line or "chunk" in line, line
        assert _agents(data) == []
        assert list((data / "attachments").iterdir()) == []
        # An id that folder does not hold: the hint lists that folder, not this
        # machine's own target.
        missing = "bk_" + "0" * 26
        for verb in ("verify", "restore"):
            gone = run_cli(data, "backup", verb, missing, *from_copy)
            assert gone.returncode == 2, gone.stderr
            assert gone.stderr.splitlines()[-1].endswith(
                f"backup list --from {shlex.quote(str(copy))}"
            ), gone.stderr


def test_keep_two_prunes_the_oldest(tmp_path: Path, machine_proc: MakeProc) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text("backup_keep = 2\n")
    with machine_proc():
        agents = _populate(data, tmp_path / "work", agents=2)
        made = []
        for n in range(3):
            _ok(run_cli(data, "agent", "prompt", agents[0], f"change {n}"))
            made.append(_ok(run_cli(data, "--json", "backup", "now")))
        ids = [json.loads(m)["backup_id"] for m in made]
        assert json.loads(made[2])["pruned"] == [ids[0]]
        assert _backup_ids(data) == [ids[2], ids[1]]
        for backup_id in ids[1:]:
            _ok(run_cli(data, "backup", "verify", backup_id))
        _refused(run_cli(data, "backup", "verify", ids[0]), 2, "not found")


def test_keep_out_of_range_is_refused_at_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text("backup_keep = 11\n")
    line = _refused(run_cli(data, "serve", "--no-background"), 2, "backup_keep", "1 to 10")
    assert "11" in line


def _big_agents(
    target: str, work: Path, agents: int, prompt_bytes: int, *, varied: bool = False
) -> None:
    """Agents with large conversations, through the RPC (the CLI would be slow here);
    ``varied`` text compresses like prose, not a thousand-fold."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        for n in range(agents):
            agent = stub.CreateAgent(pb.CreateAgentRequest(name=f"big-{n}", folder=str(work)))
            if varied:
                text = f"agent {n} " + os.urandom(prompt_bytes // 2).hex()
            else:
                text = f"agent {n} " + "lorem ipsum dolor sit amet " * (prompt_bytes // 27)
            for _ in stub.Prompt(pb.PromptRequest(agent_id=agent.id, text=text)):
                pass


def test_sigkill_during_a_backup_leaves_kept_backups_whole(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text("backup_keep = 1\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = machine_proc("--prompt-limit", "2MiB")
    with proc:
        _big_agents(proc.target, work, agents=4, prompt_bytes=200_000)
        _ok(run_cli(data, "backup", "now", timeout=120))
        (first,) = _backup_ids(data)
        # Enough agents that worker processes make the segments, into packs of a
        # few MiB (prose-like text: a pack fills with a few agents).
        _big_agents(proc.target, work, agents=60, prompt_bytes=1_000_000, varied=True)
        seen = len(_segment_files(data / "backups"))
        child = subprocess.Popen(
            [str(AGENTS_MACHINE), "--data-dir", str(data), "backup", "now"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            poll_until(
                lambda: len(_segment_files(data / "backups")) > seen + 2,
                deadline=60,
                what="the backup's first new segments",
            )
            proc.kill()
        finally:
            child.wait(timeout=30)
    with proc:
        assert _backup_ids(data) == [first]
        _ok(run_cli(data, "backup", "verify", first, timeout=120))
        _ok(run_cli(data, "backup", "now", timeout=300))
        (newest,) = _backup_ids(data)
        assert newest != first
        _ok(run_cli(data, "backup", "verify", newest, timeout=300))


def test_sigkill_at_each_delete_of_a_prune_leaves_both_kept_backups_restorable(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    """keep = 2: a new backup's prune deletes the oldest manifest, its names list,
    then the segment only it named. The daemon SIGKILLs itself after the 1st, the 2nd,
    then the 3rd of those deletes (a test hook, one round each, each after a whole
    backup): every time both kept backups verify, and in the end both restore on a
    new machine byte-equal."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text("backup_keep = 2\n")
    work, key_file = tmp_path / "work", tmp_path / "recovery.key"
    proc = machine_proc()
    contents: dict[str, dict[str, bytes]] = {}

    def changed_then_exported(turn: int) -> dict[str, bytes]:
        _ok(run_cli(data, "agent", "prompt", agents[0], f"turn {turn} changes agent 0"))
        return _export_contents(data, agents, tmp_path / f"export-{turn}.tar.gz")

    with proc:
        agents = _populate(data, work, agents=3)
        key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        key_file.chmod(0o600)  # kept private, as its advice says
        now = changed_then_exported(1)
        _ok(run_cli(data, "backup", "now"))
        contents[_backup_ids(data)[0]] = now
    for deletes in (1, 2, 3):
        with proc:
            # A whole backup and prune first (it clears what the last round's kill
            # left), then a change: the next prune deletes the oldest manifest, its
            # names list, then agent 0's segment that only that backup named.
            now = changed_then_exported(10 * deletes)
            _ok(run_cli(data, "backup", "now"))
            contents[_backup_ids(data)[0]] = now
            now = changed_then_exported(10 * deletes + 1)
            segments = len(_segment_files(data / "backups"))
        crashing = MachineProc(
            data, env={"AGENTS_MACHINE_TEST_CRASH_IN_PRUNE_AFTER_DELETES": str(deletes)}
        )
        with crashing:
            assert run_cli(data, "backup", "now", timeout=120).returncode != 0
            assert crashing.proc is not None
            assert crashing.proc.wait(timeout=30) == -signal.SIGKILL
        assert f"killing the daemon after {deletes} objects pruned" in crashing.log()
        # One new segment (agent 0's), less the orphan once the 3rd delete happened.
        assert len(_segment_files(data / "backups")) == segments + 1 - (deletes == 3)
        with proc:
            kept = _backup_ids(data)
            assert len(kept) == 2 and kept[1] in contents, (kept, list(contents))
            contents[kept[0]] = now  # made before the kill: its manifest is the commit
            for backup_id in kept:
                _ok(run_cli(data, "backup", "verify", backup_id, timeout=120))
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    for backup_id in kept:
        shutil.rmtree(data)
        with proc:
            said = _ok(
                run_cli(
                    data, "backup", "restore", backup_id, "--from", str(copy), "--recovery-key",
                    str(key_file), timeout=120,
                )
            )  # fmt: skip
            # A new box: its agents are another machine's, never run (before, the
            # line advised `agent unarchive`, which refuses them).
            assert said.splitlines()[0] == (
                f"restored {len(agents)} agents (archived, read-only: their origin is another"
                " machine; to make a fresh box that machine instead: `backup take-over`)"
            ), said
            after = _export_contents(data, agents, tmp_path / f"after-{backup_id}.tar.gz")
            assert after == contents[backup_id]


def _prompt_each(target: str, agents: list[str], text: str) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        for agent in agents:
            for _ in stub.Prompt(pb.PromptRequest(agent_id=agent, text=f"{text} {agent}")):
                pass


@pytest.mark.parametrize("steps", [3, 5])
def test_sigkill_in_a_prune_that_repacks_leaves_both_kept_backups_restorable(
    tmp_path: Path, machine_proc: MakeProc, steps: int
) -> None:
    """keep = 2, 40 agents: each backup changes 35 of them, so worker processes pack
    the segments. The third backup's prune deletes the first backup's manifest and
    names list (steps 1, 2), then goes through that backup's packs (one per
    worker): a pack holding some of the 5 segments still named is copied without
    the rest into a new pack (a step), then its index and itself are deleted (two
    steps); a pack holding none is just deleted. The daemon SIGKILLs itself after
    step 3 or 5 (a test hook; by step 5 a repack has happened): both kept backups
    verify, the next backup's prune leaves no pack holding a dropped segment, and
    both restore on a new machine byte-equal."""
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "machine.toml").write_text("backup_keep = 2\n")
    work, key_file = tmp_path / "work", tmp_path / "recovery.key"
    work.mkdir()
    proc = machine_proc()
    contents: dict[str, dict[str, bytes]] = {}
    with proc:
        _big_agents(proc.target, work, agents=40, prompt_bytes=4_000, varied=True)
        agents = sorted(str(a["agent_id"]) for a in _agents(data))
        key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        key_file.chmod(0o600)  # kept private, as its advice says
        for turn in (1, 2):
            _prompt_each(proc.target, agents[:35], f"turn {turn}")
            _ok(run_cli(data, "backup", "now", timeout=120))
            contents[_backup_ids(data)[0]] = _export_contents(
                data, agents, tmp_path / f"export-{turn}.tar.gz"
            )
        packs = sorted((data / "backups" / "packs").glob("*.index"))
        assert packs, "the backups are packed"
        _prompt_each(proc.target, agents[:35], "turn 3")
        now = _export_contents(data, agents, tmp_path / "export-3.tar.gz")
    crashing = MachineProc(
        data, env={"AGENTS_MACHINE_TEST_CRASH_IN_PRUNE_AFTER_DELETES": str(steps)}
    )
    with crashing:
        assert run_cli(data, "backup", "now", timeout=120).returncode != 0
        assert crashing.proc is not None
        assert crashing.proc.wait(timeout=30) == -signal.SIGKILL
    assert f"killing the daemon after {steps} objects pruned" in crashing.log()
    if steps == 5:
        assert " kept in pack " in crashing.log(), "a pack was repacked before the kill"
    with proc:
        kept = _backup_ids(data)  # newest first
        assert len(kept) == 2 and kept[1] in contents, (kept, list(contents))
        contents[kept[0]] = now  # made before the kill: its manifest is the commit
        for backup_id in kept:
            _ok(run_cli(data, "backup", "verify", backup_id, timeout=120))
        _ok(run_cli(data, "backup", "now", timeout=120))  # its prune ends the last one's
        kept = _backup_ids(data)
        contents[kept[0]] = now
        for backup_id in kept:
            _ok(run_cli(data, "backup", "verify", backup_id, timeout=120))
    # Of the first backup's packs, none is left; no pack without its index.
    names = {p.name for p in (data / "backups" / "packs").iterdir()}
    assert not {p.name for p in packs} & names
    assert all((n + ".index" in names) for n in names if not n.endswith(".index")), names
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    for backup_id in kept:
        shutil.rmtree(data)
        with proc:
            _ok(
                run_cli(
                    data, "backup", "restore", backup_id, "--from", str(copy), "--recovery-key",
                    str(key_file), timeout=120,
                )
            )  # fmt: skip
            after = _export_contents(data, agents, tmp_path / f"after-{backup_id}.tar.gz")
            assert after == contents[backup_id]


def test_sigkill_during_a_restore_or_an_import_leaves_nothing_and_it_runs_again_whole(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    data = tmp_path / "data"
    key_file = tmp_path / "recovery.key"
    work = tmp_path / "work"
    proc = machine_proc("--prompt-limit", "2MiB")
    with proc:
        agents = _populate(data, work, agents=1)
        _big_agents(proc.target, work, agents=10, prompt_bytes=1_000_000, varied=True)
        agents = [str(a["agent_id"]) for a in _agents(data)]
        key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        key_file.chmod(0o600)  # kept private, as its advice says
        _ok(run_cli(data, "backup", "now", timeout=120))
        (backup_id,) = _backup_ids(data)
        before = _export_contents(data, agents, tmp_path / "before.tar.gz")
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    restore = [
        "backup", "restore", backup_id, "--from", str(copy), "--recovery-key", str(key_file)
    ]  # fmt: skip
    imported = ["import", str(tmp_path / "before.tar.gz")]
    # A daemon that SIGKILLs itself inside the verb's one transaction, after 5 of
    # its 11 agents are in.
    crashing = MachineProc(
        data, "--prompt-limit", "2MiB",
        env={"AGENTS_MACHINE_TEST_CRASH_IN_TRANSFER_AFTER_AGENTS": "5"},
    )  # fmt: skip
    for n, verb in enumerate((restore, imported), 1):
        shutil.rmtree(data, ignore_errors=True)  # a new machine for each
        with crashing:
            cut = run_cli(data, *verb, timeout=120)
            # Not "not running": it was, and went away while the call ran.
            assert cut.returncode == 1 and "Traceback" not in cut.stderr, cut.stderr
            assert "stopped answering during the call" in cut.stderr, cut.stderr
            assert crashing.proc is not None
            assert crashing.proc.wait(timeout=30) == -signal.SIGKILL
        assert crashing.log().count("test fault: killing the daemon after 5 agents loaded") == n
        with proc:
            # Nothing of it was committed, and the machine.db is sound; the
            # restore's pack, written up to the kill, was removed at start.
            assert _agents(data) == []
            assert not list(data.glob("restored/*.pack"))
            assert _ok(run_cli(data, "check", timeout=120)).strip().endswith("machine.db: ok")
            _ok(run_cli(data, *verb, timeout=300))
            after = tmp_path / f"after-{verb[0]}.tar.gz"
            assert _export_contents(data, agents, after) == before


def test_sigkill_while_a_restores_histories_load_resumes_at_the_next_start(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    """A restore commits the agents with their histories packed; a daemon killed
    while it loads them into machine.db (after its first transaction) loads the
    rest at its next start, and every conversation comes back byte-equal."""
    data = tmp_path / "data"
    key_file = tmp_path / "recovery.key"
    work = tmp_path / "work"
    proc = machine_proc("--prompt-limit", "2MiB")
    with proc:
        _populate(data, work, agents=1)
        # About 1 MB packed each: a few agents per load transaction.
        _big_agents(proc.target, work, agents=10, prompt_bytes=1_000_000, varied=True)
        agents = [str(a["agent_id"]) for a in _agents(data)]
        key_file.write_text(_ok(run_cli(data, "backup", "recovery-key")))
        key_file.chmod(0o600)
        _ok(run_cli(data, "backup", "now", timeout=120))
        (backup_id,) = _backup_ids(data)
        before = _export_contents(data, agents, tmp_path / "before.tar.gz")
    copy = tmp_path / "backup-copy"
    shutil.copytree(data / "backups", copy)
    shutil.rmtree(data)  # a new machine
    crashing = MachineProc(
        data, "--prompt-limit", "2MiB",
        env={"AGENTS_MACHINE_TEST_CRASH_IN_HISTORY_LOAD_AFTER_AGENTS": "1"},
    )  # fmt: skip
    with crashing:
        # Answered, or cut by the kill: either way the restore committed first.
        run_cli(
            data, "backup", "restore", backup_id, "--from", str(copy),
            "--recovery-key", str(key_file), timeout=120,
        )  # fmt: skip
        assert crashing.proc is not None
        assert crashing.proc.wait(timeout=60) == -signal.SIGKILL
    assert "test fault: killing the daemon after 1 restored histories loaded" in crashing.log()
    (pack,) = (data / "restored").iterdir()  # some histories still in it
    with sqlite3.connect(f"file:{data / 'machine.db'}?mode=ro", uri=True) as db:
        pending = db.execute("SELECT COUNT(*) FROM restore_pending").fetchone()[0]
        listed = db.execute("SELECT COUNT(*) FROM agents").fetchone()[0]
    assert 0 < pending < len(agents) and listed == len(agents)
    with proc:
        # The start resumes the load in the background: the pack goes once all is in.
        poll_until(lambda: not pack.exists(), deadline=60, what="the restart loading the rest")
        assert sorted(str(a["agent_id"]) for a in _agents(data)) == sorted(agents)
        assert _export_contents(data, agents, tmp_path / "after.tar.gz") == before


def _tar_gz(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, content in entries:
            if content is None:
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _file(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = 0o600
    return info


def test_hostile_imports_are_refused_and_import_nothing(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    data = tmp_path / "data"
    outside = tmp_path / "outside" / "escape.txt"

    agent = new_id("agent")  # paths the export format has, so the entry's own check runs
    record, conversation = f"agents/{agent}/record.json", f"agents/{agent}/conversation.jsonl"

    def special(kind: bytes, linkname: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(record)
        info.type, info.linkname = kind, linkname
        return info

    claims_10_gb = tarfile.TarInfo(record)
    claims_10_gb.size = 10 * 1024**3  # only the header: the bytes never come
    manifest_v9 = json.dumps(
        {"format": "agents-export", "format_version": 9, "machine_id": "mc_x", "agents": []}
    ).encode()
    hostile = {
        "dotdot": _tar_gz([(_file("../" * 12 + str(outside).lstrip("/")), b"out")]),
        "absolute": _tar_gz([(_file(str(outside)), b"out")]),
        "symlink": _tar_gz([(special(tarfile.SYMTYPE, "/etc/passwd"), None)]),
        "hardlink": _tar_gz([(special(tarfile.LNKTYPE, "/etc/passwd"), None)]),
        "device": _tar_gz([(special(tarfile.CHRTYPE), None)]),
        "fifo": _tar_gz([(special(tarfile.FIFOTYPE), None)]),
        "10 GB": gzip.compress(claims_10_gb.tobuf()),
        "bomb": _tar_gz([(_file(conversation), b"\0" * 64 * 1024**2)]),
        "version": _tar_gz([(_file("manifest.json"), manifest_v9)]),
        "malformed": _tar_gz([(_file("manifest.json"), b"{not json")]),
        "no-manifest": _tar_gz([(_file(record), b"{}")]),
        "not-a-tar": b"this is not an archive at all",
    }
    says = {
        "dotdot": "path escapes the archive",
        "absolute": "absolute path",
        "symlink": "a symbolic link; only regular files",
        "hardlink": "a hard link; only regular files",
        "device": "a device; only regular files",
        "fifo": "a FIFO; only regular files",
        "10 GB": "10737418240",
        "bomb": "ratio",
        "version": "unknown format version 9",
        "malformed": "manifest.json: not valid JSON",
        "no-manifest": "manifest.json: missing",
        "not-a-tar": "not a tar archive",
    }
    with machine_proc():
        for name, blob in hostile.items():
            path = tmp_path / f"{name}.tar.gz"
            path.write_bytes(blob)
            line = _refused(run_cli(data, "import", str(path)), 2)
            assert says[name] in line, (name, line)
        assert _agents(data) == []
        assert not outside.parent.exists() and not (tmp_path / "escape.txt").exists()
        assert list((data / "Incoming").iterdir()) == []


def _many_empty_files(dest: Path, entries: int) -> Path:
    """A ``.tar.gz`` of ``entries`` empty files at paths the export format has
    (``attachments/<64 hex>``), about 2 MB for 200,000: one header with its name
    and checksum changed each time, in about a second (tarfile's writer takes
    twenty times as long)."""
    info = _file("attachments/" + "0" * 64)
    header = info.tobuf(tarfile.USTAR_FORMAT)
    start, end = len("attachments/"), len("attachments/") + 64
    # A header's checksum (bytes 148 to 155) sums its bytes, itself counted as spaces.
    base = sum(header[:148]) + 8 * ord(" ") + sum(header[156:]) - sum(header[start:end])
    with gzip.open(dest, "wb", compresslevel=1) as gz:
        for first in range(0, entries, 10_000):
            batch = []
            for n in range(first, min(first + 10_000, entries)):
                name = b"%064x" % n
                checksum = b"%06o\0 " % (base + sum(name))
                batch.append(header[:start] + name + header[end:148] + checksum + header[156:])
            gz.write(b"".join(batch))
        gz.write(b"\0" * 2 * tarfile.BLOCKSIZE)
    return dest


async def test_an_import_of_200000_small_entries_is_refused_while_the_daemon_answers(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    """The daemon goes on answering while it checks an archive, and the entry limit
    refuses it with nothing written: no agent, nothing left in Incoming/."""
    data = tmp_path / "data"
    archive = _many_empty_files(tmp_path / "many.tar.gz", 200_000)
    incoming = data / "Incoming"

    def received_whole() -> bool:
        with contextlib.suppress(FileNotFoundError):  # removed once refused
            return any(p.stat().st_size == archive.stat().st_size for p in incoming.iterdir())
        return False

    with machine_proc() as proc:
        channel = grpc.aio.insecure_channel(proc.target)
        stub = pb_grpc.MachineServiceStub(channel)
        try:
            await stub.Status(pb.StatusRequest(), timeout=30)
            args = [str(AGENTS_MACHINE), "--data-dir", str(data), "import", str(archive)]
            cli = await asyncio.create_subprocess_exec(
                *args, env=machine_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            await apoll_until(
                lambda: received_whole() or cli.returncode is not None,
                deadline=60,
                what="the archive received whole",
            )
            answered_meanwhile = 0

            async def answers_within_a_second() -> bool:
                nonlocal answered_meanwhile
                await stub.Status(pb.StatusRequest(), timeout=1.0)
                listed = await stub.ListAgents(
                    pb.ListAgentsRequest(include_archived=True), timeout=1.0
                )
                assert list(listed.agents) == []
                if cli.returncode is not None:
                    return True
                answered_meanwhile += 1
                return False

            await apoll_until(
                answers_within_a_second, deadline=120, what="the import to end", step=0.1
            )
            _, err = await cli.communicate()
        finally:
            await channel.close()
        assert answered_meanwhile >= 1, "the import ended before the daemon was asked"
        refused = subprocess.CompletedProcess(args, cli.returncode, "", err.decode())
        _refused(refused, 2, "more than 100000 entries")
        assert _agents(data) == []
        assert list(incoming.iterdir()) == []
    assert "Traceback" not in proc.log()


def test_an_export_sigkilled_mid_way_leaves_no_file_and_the_next_removes_its_debris(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    """A CLI export killed while it writes: nothing at -o, only a hidden temp file
    (part of the conversations, 0600); a later export into that folder removes it
    once it is an hour old, says so on stderr, and writes its own file whole."""
    data = tmp_path / "data"
    out = tmp_path / "exports"
    out.mkdir()
    with machine_proc() as daemon:
        agents = _populate(data, tmp_path / "work", agents=2)
        dest = out / "killed.tar.gz"
        # Held mid-way for certain: the daemon is stopped, so the CLI has made its
        # temp file and waits for the export's first bytes when it is killed.
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            cli = subprocess.Popen(
                [str(AGENTS_MACHINE), "--data-dir", str(data), "export", *agents, "-o", str(dest)],
                env=machine_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

            def temps() -> list[Path]:
                return [p for p in out.iterdir() if p.name.endswith(".agents-export.tmp")]

            poll_until(lambda: len(temps()) == 1, deadline=30, what="the export's temp file")
            cli.kill()
            assert cli.wait(timeout=30) == -signal.SIGKILL
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        (left,) = temps()
        assert not dest.exists() and stat.S_IMODE(left.stat().st_mode) == 0o600
        # A fresh one may be another export still writing: kept.
        again = out / "again.tar.gz"
        _ok(run_cli(data, "export", *agents, "-o", str(again)))
        assert left.exists() and again.exists()
        old = left.stat().st_mtime - 7200
        os.utime(left, (old, old))
        third = run_cli(data, "export", *agents, "-o", str(out / "third.tar.gz"))
        assert third.returncode == 0, third.stderr
        assert "removed 1 unfinished export(s)" in third.stderr
        assert sorted(p.name for p in out.iterdir()) == ["again.tar.gz", "third.tar.gz"]
        with tarfile.open(out / "third.tar.gz") as tar:
            manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert sorted(a["agent_id"] for a in manifest["agents"]) == sorted(agents)


def test_export_then_import_on_another_daemon_skips_existing(
    tmp_path: Path, machine_proc: MakeProc
) -> None:
    a_data = tmp_path / "data"
    with machine_proc():
        agents = _populate(a_data, tmp_path / "work", agents=2)
        archive = tmp_path / "out.tar.gz"
        _ok(run_cli(a_data, "export", *agents, "-o", str(archive)))
        assert list((a_data / "Outgoing").iterdir()) == []
        assert stat.S_IMODE(archive.stat().st_mode) == 0o600  # conversations: private
        _refused(run_cli(a_data, "export", agents[0], "-o", str(archive)), 2, "exists")
        by_folder = tmp_path / "folder.tar.gz"
        _ok(run_cli(a_data, "export", "--folder", str(tmp_path / "work"), "-o", str(by_folder)))
        with tarfile.open(by_folder) as tar:
            manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert sorted(a["agent_id"] for a in manifest["agents"]) == sorted(agents)
        _refused(run_cli(a_data, "export", "-o", str(tmp_path / "none.tar.gz")), 2, "AGENT")
    b_data = tmp_path / "b" / "data"
    with MachineProc(b_data) as b:
        first = json.loads(_ok(run_cli(b_data, "--json", "import", str(archive))))
        assert sorted(first["imported"]) == sorted(agents)
        second = json.loads(_ok(run_cli(b_data, "--json", "import", str(archive))))
        assert second.get("imported", []) == [] and sorted(second["skipped"]) == sorted(agents)
        assert len(_agents(b_data)) == 2
        assert list((b_data / "Incoming").iterdir()) == []
        b.stop()


def _serve_in_a_terminal(data: Path, log: Path) -> str:
    """Start ``agents-machine serve`` with its stdout on a pseudo-terminal (as a person
    starts it), wait until it serves, stop it; return what it printed on stdout."""
    main_fd, term_fd = pty.openpty()
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [str(AGENTS_MACHINE), "--data-dir", str(data), "serve"],
            stdin=subprocess.DEVNULL,
            stdout=term_fd,
            stderr=err,
            env=machine_env(),
        )
    os.close(term_fd)
    printed = bytearray()

    def drain() -> None:
        while select.select([main_fd], [], [], 0)[0]:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # the terminal closed: the daemon exited
                return
            if not chunk:
                return
            printed.extend(chunk)

    try:

        def serving() -> bool:
            drain()
            if proc.poll() is not None:
                raise AssertionError(f"serve exited:\n{log.read_text()}")
            return "serving on" in log.read_text(errors="replace")

        poll_until(serving, deadline=30, what="the daemon serving")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        drain()  # whatever it wrote before it stopped
        os.close(main_fd)
    return printed.decode(errors="replace")


def test_a_stand_alone_machines_first_start_in_a_terminal_prints_its_recovery_key_once(
    tmp_path: Path,
) -> None:
    data, log = tmp_path / "data", tmp_path / "serve.log"
    first = _serve_in_a_terminal(data, log)  # each start logs to its own file
    keys = [w for w in first.split() if w.startswith("agsk1_")]
    assert len(keys) == 1, first
    assert "Keep it offline" in first and "--recovery-key FILE" in first
    pair = BoxKeyPair.from_private(decode_private_key(keys[0]))
    stored = (data / "keys" / "recovery.pub").read_text().strip()
    assert decode_public_key(stored) == pair.public_key
    assert keys[0] not in log.read_text()  # printed for the person, never logged
    # Not again: the next start prints no key and keeps the one made.
    again = _serve_in_a_terminal(data, tmp_path / "serve-again.log")
    assert "agsk1_" not in again
    assert (data / "keys" / "recovery.pub").read_text().strip() == stored
    # A start that is not in a terminal (a service manager's) makes none: the key
    # would land in its journal; status says how to make one.
    other = tmp_path / "other"
    proc = MachineProc(other)
    with proc:
        assert not (other / "keys" / "recovery.pub").exists()
        assert "no recovery key" in _ok(run_cli(other, "status"))
