"""Sealed backups against restic and against ``tar | zstd -3``, on the same data, same run.

A machine's data folder is filled with synthetic conversations (default about
200 MB of events in 1,000 agents). Then, each as its own process so that its
peak resident memory can be read:

- ours: a full backup to a folder target; a backup after 1 % of the agents
  changed; a restore of the newest backup into a new, empty machine (timed to
  its commit, every agent listed and its history packed; the loading of the
  histories into machine.db and the search index, which the daemon does in
  the background after it, are timed on their own line);
- restic (Debian package): ``backup`` of the data folder, ``backup`` again
  after the same change, ``restore``;
- ``tar | zstd -3`` of the data folder (one-off compression, no encryption).

Printed: seconds, ratios ours/restic (below 1.0 is faster than restic),
stored sizes and peak RSS of each step; ``--json PATH`` also writes them for
``bench/report.py`` (bench/results.py).

Usage: ``.venv/bin/python -m bench.backup [--agents N] [--mb M] [--json PATH]``.

``--continuous`` runs the continuous backups' case instead (docs/backups.md):
1,000 agents, a daily point, then one prompt each to 10 agents a minute for 10
minutes, an increment shipped at each look, every half minute (the minutes are
simulated: the increments are made back to back). Printed per prompt: bytes and store requests
sent, against the prompt's own events compressed and sealed alone (target:
at most 2x) and against the daily full backup's size; and that an idle interval
makes no store request. ``--quick`` is a small run of it (the smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from bench.results import BenchResult, Row
from machine.backups.workers import segment_workers
from machine.storage.db import Database

ROOT = Path(__file__).resolve().parents[1]
NAMING_KEY_FILE = "naming.key"
PASSWORD = "bench-only-password"
EVENT_BYTES = 1000
EVENTS_PER_RUN = 20


def _paragraphs(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(3000)
    ]
    out = []
    for _ in range(count):
        words: list[str] = []
        size = 0
        while size < EVENT_BYTES:
            w = rng.choice(vocab)
            words.append(w)
            size += len(w) + 1
        out.append(" ".join(words))
    return out


def _fill(
    conn: sqlite3.Connection, agents: list[str], runs_each: int, pool: list[str], tag: str
) -> int:
    """Append ``runs_each`` runs of text to each agent; return the bytes of text added."""
    rng = random.Random(hash(tag) & 0xFFFF)
    added = 0
    now = time.time()
    for agent in agents:
        seq = conn.execute("SELECT last_seq FROM agents WHERE id = ?", (agent,)).fetchone()[0]
        for r in range(runs_each):
            run_id = f"run_{tag}{agent[-10:]}{r:06d}"
            conn.execute(
                "INSERT INTO runs (id, agent_id, state, prompt, created_at, started_at,"
                " finished_at, input_tokens, output_tokens, duration_ms)"
                " VALUES (?, ?, 'finished', ?, ?, ?, ?, 10, 200, 1500)",
                (run_id, agent, f"prompt {tag} {r}", now, now, now),
            )
            rows = [(agent, seq + 1, run_id, "RUN_STARTED", json.dumps({"prompt": f"p {r}"}), now)]
            for i in range(EVENTS_PER_RUN):
                text = pool[rng.randrange(len(pool))]
                added += len(text)
                rows.append(
                    (agent, seq + 2 + i, run_id, "TEXT_DELTA", json.dumps({"text": text}), now)
                )
            rows.append((agent, seq + 2 + EVENTS_PER_RUN, run_id, "RUN_FINISHED", "{}", now))
            conn.executemany(
                "INSERT INTO events (agent_id, seq, run_id, kind, payload_json, time)"
                " VALUES (?,?,?,?,?,?)",
                rows,
            )
            conn.execute(
                "INSERT INTO summaries (run_id, agent_id, text, created_at) VALUES (?,?,?,?)",
                (run_id, agent, f"summary {tag} {r}", now),
            )
            seq += len(rows)
        conn.execute(
            "UPDATE agents SET last_seq = ?, updated_at = ? WHERE id = ?", (seq, now, agent)
        )
    return added


async def _make_data(data: Path, agents: int, mb: int) -> list[str]:
    from shared.ids import new_id

    data.mkdir(mode=0o700, parents=True)
    db = await Database.open(data / "machine.db")
    ids = [new_id("agent") for _ in range(agents)]
    machine = new_id("machine")
    runs_each = max(1, (mb * 1024 * 1024) // (agents * EVENTS_PER_RUN * EVENT_BYTES))
    pool = _paragraphs(20_000, 1)
    try:

        def create(conn: sqlite3.Connection) -> None:
            for i, agent in enumerate(ids):
                conn.execute(
                    "INSERT INTO agents (id, name, folder, runtime, state, origin_machine,"
                    " created_at, updated_at) VALUES (?, ?, '/srv', 'echo', 'archived', ?, 0, 0)",
                    (agent, f"agent-{i}", machine),
                )

        await db.write(create)
        for start in range(0, len(ids), 50):
            part = ids[start : start + 50]
            await db.write(lambda c, part=part: _fill(c, part, runs_each, pool, "a"))
    finally:
        await db.close()
    return ids


async def _change(data: Path, agents: list[str]) -> None:
    db = await Database.open(data / "machine.db")
    pool = _paragraphs(2000, 2)
    try:
        await db.write(lambda c: _fill(c, agents, 1, pool, "b"))
    finally:
        await db.close()


# -- the phases, each run in a child process ---------------------------------


async def _engine(data: Path, work: Path, target: Path) -> Any:
    from machine.backups.engine import BackupEngine
    from machine.backups.source import DatabaseBackupSource
    from shared.backup_folder import FolderTarget
    from shared.crypto import BoxKeyPair
    from shared.store.folder import FolderStore

    keys = json.loads((work / "keys.json").read_text())
    machine_key = BoxKeyPair.from_private(bytes.fromhex(keys["machine"]))
    recovery = BoxKeyPair.from_private(bytes.fromhex(keys["recovery"]))
    db = await Database.open(data / "machine.db")
    engine = BackupEngine(
        DatabaseBackupSource(db, data / "attachments", work / "engine"),
        FolderTarget(FolderStore(target)),
        machine_id=keys["machine_id"],
        naming_key=bytes.fromhex(keys["naming"]),
        recipients=[machine_key.public_key, recovery.public_key],
        keypair=machine_key,
        work_dir=work / "engine",
        keep=3,
    )
    return db, engine, recovery


def _cpu() -> float:
    """CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _phase_backup(data: Path, work: Path, target: Path) -> dict[str, Any]:
    db, engine, _ = await _engine(data, work, target)
    try:
        started, cpu = time.monotonic(), _cpu()
        result = await engine.backup_now()
        seconds, cpu = time.monotonic() - started, _cpu() - cpu
    finally:
        await db.close()
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "uploaded": result.uploaded,
        "segments": result.segments,
        "seconds": seconds,
        # Worker processes (machine.backups.workers.segment_workers) are counted in: their CPU,
        # and the peak RSS of the largest one (each runs beside this process).
        "cpu": cpu + workers.ru_utime + workers.ru_stime,
        "worker_rss_mib": workers.ru_maxrss // 1024,
        "workers": segment_workers.processes()
        if result.uploaded >= segment_workers.MIN_AGENTS
        else 0,
    }


async def _phase_restore(data: Path, work: Path, target: Path, dest: Path) -> dict[str, Any]:
    from machine.backups.restore import restore_fetched
    from machine.core.search_indexer import SearchIndexer
    from machine.storage import restored

    db, engine, recovery = await _engine(data, work, target)
    await db.close()
    newest = (await engine.list())[-1][0].backup_id
    dest.mkdir(mode=0o700)
    new_db = await Database.open(dest / "machine.db")
    started, cpu = time.monotonic(), _cpu()
    try:
        fetched = await engine.fetch(newest, work / "fetch", recovery, decode_agents=False)
        result = await restore_fetched(
            new_db, fetched, attachments_dir=dest / "attachments", erased=set()
        )
        shutil.rmtree(work / "fetch")
        seconds, cpu = time.monotonic() - started, _cpu() - cpu
        # What the daemon then does in the background: the histories loaded from
        # the restore's pack into machine.db, then the search index.
        load_cpu = _cpu()
        await restored.ensure_loaded(new_db)
        loaded, load_cpu = time.monotonic() - started, _cpu() - load_cpu
        events = await new_db.read(lambda c: c.execute("SELECT COUNT(*) FROM events").fetchone()[0])
        index_cpu = _cpu()
        await SearchIndexer(new_db).drain()
        indexed, index_cpu = time.monotonic() - started, _cpu() - index_cpu
    finally:
        await new_db.close()
    return {
        "restored": len(result.restored),
        "seconds": seconds,
        "cpu": cpu,
        "loaded": loaded,
        "load_cpu": load_cpu,
        "events": events,
        "indexed": indexed,
        "index_cpu": index_cpu,
    }


#: The tables a restore fills, in an order their foreign keys accept.
_RESTORED_TABLES: Final = ("agents", "runs", "events", "summaries", "tool_log")


async def _phase_floor(data: Path, dest: Path) -> dict[str, Any]:
    """What any restore into machine.db costs at the least, on this machine: the
    rows a restore writes, copied by SQLite itself (no Python, no parsing, no
    decryption) from the source database into an empty machine.db opened with
    the daemon's settings (WAL, synchronous FULL), to the commit."""
    from machine.storage.db import _connect

    dest.mkdir(mode=0o700)
    await (await Database.open(dest / "machine.db")).close()  # the schema
    conn = _connect(dest / "machine.db")
    try:
        conn.execute("ATTACH DATABASE ? AS src", (str(data / "machine.db"),))
        os.sync()
        started, cpu = time.monotonic(), _cpu()
        conn.execute("BEGIN IMMEDIATE")
        for table in _RESTORED_TABLES:
            conn.execute(f"INSERT INTO main.{table} SELECT * FROM src.{table}")
        conn.execute("COMMIT")
        seconds, cpu = time.monotonic() - started, _cpu() - cpu
        events = conn.execute("SELECT COUNT(*) FROM main.events").fetchone()[0]
    finally:
        conn.close()
    return {"seconds": seconds, "cpu": cpu, "events": events}


def _child(argv: list[str]) -> None:
    phase, data, work, target = argv[0], Path(argv[1]), Path(argv[2]), Path(argv[3])
    if phase == "backup":
        out = asyncio.run(_phase_backup(data, work, target))
    elif phase == "floor":
        out = asyncio.run(_phase_floor(data, target))
    else:
        out = asyncio.run(_phase_restore(data, work, target, Path(argv[4])))
    print(json.dumps(out))


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str, float]:
    """Run ``cmd``; return its seconds, its own peak RSS in MiB (wait4), its stdout and
    its CPU seconds."""
    # Each step starts with nothing left to write back: otherwise a step pays for
    # the previous step's writes (the kernel flushing them while it runs), and
    # whichever tool runs first after a big write is the slower one.
    os.sync()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd[0]} failed: {err.read().decode()[-2000:]}")
        cpu = usage.ru_utime + usage.ru_stime
        return seconds, usage.ru_maxrss // 1024, out.read().decode(), cpu


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- continuous backups ------------------------------------------------------


def _counting_store(root: Path) -> Any:
    """A folder store counting the requests made of it (what a bucket would bill)."""
    from shared.store.folder import FolderStore

    class Counting(FolderStore):
        requests = 0

        async def get(self, key: str) -> bytes:
            Counting.requests += 1
            return await super().get(key)

        def get_stream(self, key: str, *a: Any, **k: Any) -> Any:
            Counting.requests += 1
            return super().get_stream(key, *a, **k)

        async def head(self, key: str) -> Any:
            Counting.requests += 1
            return await super().head(key)

        async def put(self, key: str, *a: Any, **k: Any) -> Any:
            Counting.requests += 1
            return await super().put(key, *a, **k)

        async def delete(self, key: str) -> None:
            Counting.requests += 1
            await super().delete(key)

        def list_pages(self, *a: Any, **k: Any) -> Any:
            Counting.requests += 1
            return super().list_pages(*a, **k)

    return Counting(root)


def _own_sealed(conn: sqlite3.Connection, agent: str, since: int, naming_key: bytes) -> int:
    """The prompt's own events (after ``since``) as the export writes them,
    compressed and sealed alone: the least a backup of them could send."""
    import contextlib
    import io

    from machine.formats.backup import encode_segment, segment_key, segment_name
    from machine.storage.tables.export import dump_agent_to

    files: dict[str, bytes] = {}

    @contextlib.contextmanager
    def open_file(name: str) -> Any:
        buf = io.BytesIO()
        yield buf
        files[name] = buf.getvalue()

    # The record's settings do not count: only the conversation's events are compared.
    dump_agent_to(conn, agent, open_file, portable=lambda _runtime, _s: ({}, []), since_seq=since)
    own = files["conversation.jsonl"]
    name = segment_name(naming_key, [own])
    return sum(len(c) for c in encode_segment([own], name=name, key=segment_key(naming_key, name)))


async def _continuous(args: argparse.Namespace) -> int:
    from machine.backups.engine import BackupEngine
    from machine.backups.source import DatabaseBackupSource
    from shared.backup_target import StoreTarget
    from shared.crypto import BoxKeyPair

    minutes, per_minute = (2, 5) if args.quick else (10, 10)
    agents, mb = (30, 1) if args.quick else (args.agents, args.mb)
    with tempfile.TemporaryDirectory(prefix="bench-continuous-") as tmp:
        base = Path(tmp)
        data, work, target = base / "data", base / "work", base / "target"
        t0 = time.monotonic()
        ids = await _make_data(data, agents, mb)
        print(
            f"data: {agents} agents, machine.db {_du(data) / 1e6:.1f} MB "
            f"(made in {time.monotonic() - t0:.1f} s)"
        )
        key, naming = BoxKeyPair.generate(), os.urandom(32)
        store = _counting_store(target)
        db = await Database.open(data / "machine.db")
        try:
            engine = BackupEngine(
                DatabaseBackupSource(db, data / "attachments", work),
                StoreTarget(store),
                machine_id=new_machine_id(),
                naming_key=naming,
                recipients=[key.public_key, BoxKeyPair.generate().public_key],
                keypair=key,
                work_dir=work,
            )
            point = await engine.backup_now()
            full = _du(target)
            requests = type(store).requests
            idle = await engine.increment_now()
            idle_requests = type(store).requests - requests
            pool = _paragraphs(2000, 3)
            sent = requests_sent = own = prompts = 0
            started = time.monotonic()
            # The daemon looks every half interval and ships what it finds: prompts
            # spread over the minute give two increments a minute, half each.
            looks, increments = 2 * minutes, 0
            for look in range(looks):
                first = look * per_minute // 2
                chosen = ids[first % len(ids) :][: (look + 1) * per_minute // 2 - first]
                seqs = await db.read(
                    lambda c, chosen=chosen: {
                        a: c.execute("SELECT last_seq FROM agents WHERE id = ?", (a,)).fetchone()[0]
                        for a in chosen
                    }
                )
                await db.write(
                    lambda c, chosen=chosen, look=look: _fill(c, chosen, 1, pool, f"l{look}")
                )
                for a in chosen:
                    since = seqs[a]
                    own += await db.read(
                        lambda c, a=a, since=since: _own_sealed(c, a, since, naming)
                    )
                before = type(store).requests
                made = await engine.increment_now()
                assert made is not None and made.agents == len(chosen), made
                sent += made.stored_bytes  # its deltas and its manifest
                requests_sent += type(store).requests - before
                prompts += len(chosen)
                increments += 1
            seconds = time.monotonic() - started
        finally:
            await db.close()
    per_prompt, own_per = sent / prompts, own / prompts
    print(
        f"continuous: {prompts} prompts ({per_minute} agents a minute, {minutes} minutes),"
        f" {increments} increments (a look every half minute) in {seconds:.2f} s"
    )
    print(
        f"per prompt: {per_prompt / 1024:.1f} KiB sent, {requests_sent / prompts:.2f} store"
        f" requests; its own events compressed and sealed {own_per / 1024:.1f} KiB:"
        f" ratio {per_prompt / own_per:.2f}x (target <= 2x)"
    )
    print(
        f"daily full backup: {full / 1e6:.1f} MB stored ({point.uploaded} segments);"
        f" per prompt {per_prompt / full * 100:.4f} % of it"
    )
    print(f"idle interval: increment {'none' if idle is None else idle.backup_id},"
          f" {idle_requests} store requests")  # fmt: skip
    figures = BenchResult(
        bench="backup-continuous",
        command="python -m bench.backup --continuous" + (" --quick" if args.quick else ""),
        notes=[
            f"{agents} agents; one prompt each to {per_minute} agents a minute for"
            f" {minutes} minutes, an increment every half minute; {requests_sent / prompts:.2f}"
            f" store requests a prompt; an idle interval made {idle_requests}",
        ],
        rows=[
            Row("bytes sent per prompt", per_prompt, own_per, "B",
                "the prompt's own events compressed and sealed", target="<= 2x"),
            Row("bytes sent per prompt", per_prompt, full, "B", "daily full backup"),
        ],
    )  # fmt: skip
    figures.write(args.json)
    return 0


def new_machine_id() -> str:
    from shared.ids import new_id

    return new_id("machine")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=1000)
    parser.add_argument("--mb", type=int, default=200, help="MB of conversation text")
    parser.add_argument("--json", type=Path, help="also write the figures here (bench/results.py)")
    parser.add_argument(
        "--continuous", action="store_true", help="the continuous backups' case instead"
    )
    parser.add_argument("--quick", action="store_true", help="a small continuous run (smoke)")
    args = parser.parse_args()
    if args.continuous or args.quick:
        return asyncio.run(_continuous(args))
    restic = shutil.which("restic")
    with tempfile.TemporaryDirectory(prefix="bench-backup-") as tmp:
        base = Path(tmp)
        data, work, target = base / "data", base / "work", base / "target"
        work.mkdir()
        t0 = time.monotonic()
        ids = asyncio.run(_make_data(data, args.agents, args.mb))
        from shared.crypto import BoxKeyPair
        from shared.ids import new_id

        (work / "keys.json").write_text(
            json.dumps(
                {
                    "machine": BoxKeyPair.generate().private_key.hex(),
                    "recovery": BoxKeyPair.generate().private_key.hex(),
                    "naming": os.urandom(32).hex(),
                    "machine_id": new_id("machine"),
                }
            )
        )
        size = _du(data)
        print(
            f"data: {args.agents} agents, machine.db {size / 1e6:.1f} MB "
            f"(made in {time.monotonic() - t0:.1f} s)"
        )
        me = [sys.executable, "-m", "bench.backup", "--child"]
        # step -> (seconds of the operation in the process, seconds of the whole
        # process with interpreter start and imports, peak RSS MiB)
        rows: dict[str, tuple[float, float, int]] = {}
        # step -> CPU seconds of the operation (every thread; ours without the start)
        cpus: dict[str, float] = {}

        s, rss, out, _ = _timed([*me, "backup", str(data), str(work), str(target)])
        rows["full backup"] = (json.loads(out)["seconds"], s, rss)
        cpus["full backup"] = json.loads(out)["cpu"]
        full_workers = (json.loads(out)["workers"], json.loads(out)["worker_rss_mib"])
        full_stored = _du(target)
        results: dict[str, tuple[float, int, str, float]] = {}
        env = {**os.environ, "RESTIC_PASSWORD": PASSWORD, "RESTIC_CACHE_DIR": str(base / "rc")}
        repo = base / "restic"
        if restic:
            subprocess.run(
                [restic, "-r", str(repo), "init", "-q"], env=env, check=True, capture_output=True
            )
            results["full backup"] = _timed(
                [restic, "-r", str(repo), "backup", "-q", str(data)], env
            )
        restic_full = _du(repo) if restic else 0
        s, _, _, _ = _timed(
            ["sh", "-c", f"tar -C {data} -cf - . | zstd -q -3 -o {base}/data.tar.zst"]
        )
        tar_seconds, tar_size = s, (base / "data.tar.zst").stat().st_size

        changed = ids[: max(1, len(ids) // 100)]
        asyncio.run(_change(data, changed))
        s, rss, out, _ = _timed([*me, "backup", str(data), str(work), str(target)])
        rows["backup after 1 % changed"] = (json.loads(out)["seconds"], s, rss)
        cpus["backup after 1 % changed"] = json.loads(out)["cpu"]
        uploaded = json.loads(out)["uploaded"]
        if restic:
            results["backup after 1 % changed"] = _timed(
                [restic, "-r", str(repo), "backup", "-q", str(data)], env
            )
        s, rss, out, _ = _timed(
            [*me, "restore", str(data), str(work), str(target), str(base / "new")]
        )
        rows["restore"] = (json.loads(out)["seconds"], s, rss)
        cpus["restore"] = json.loads(out)["cpu"]
        restore_out = json.loads(out)
        indexed, loaded = restore_out["indexed"], restore_out["loaded"]
        if restic:
            results["restore"] = _timed(
                [restic, "-r", str(repo), "restore", "latest", "-q", "--target", str(base / "rr")],
                env,
            )
        _, _, out, _ = _timed([*me, "floor", str(data), str(work), str(base / "floor")])
        floor = json.loads(out)

        print(
            f"incremental: {uploaded} of {len(ids)} agent segments uploaded "
            f"({len(changed)} agents changed)"
        )
        print(
            f"stored: ours {full_stored / 1e6:.1f} MB, restic {restic_full / 1e6:.1f} MB, "
            f"tar|zstd -3 {tar_size / 1e6:.1f} MB ({tar_seconds:.2f} s)"
        )
        print("ours s: the operation in a running process (as in the daemon); wall s adds")
        print("the interpreter's start and imports; restic s is its whole process.")
        head = ("step", "ours s", "wall s", "restic s", "ratio", "ours MiB", "restic MiB")
        print(
            f"{head[0]:26} {head[1]:>7} {head[2]:>7} {head[3]:>9} {head[4]:>7}"
            f" {head[5]:>9} {head[6]:>11}"
        )
        nothing = (float("nan"), -1, "", float("nan"))
        for step, (ours, wall, rss) in rows.items():
            theirs, trss, _, _ = results.get(step, nothing)
            ratio = ours / theirs if restic else float("nan")
            print(
                f"{step:26} {ours:7.2f} {wall:7.2f} {theirs:9.2f} {ratio:6.2f}x {rss:9} {trss:11}"
            )
        # CPU time moves less than seconds with what else the machine runs.
        print("CPU s (user + sys, every thread):")
        for step, ours in cpus.items():
            theirs = results.get(step, nothing)[3]
            print(
                f"  {step:24} ours {ours:6.2f}  restic {theirs:6.2f}  ratio {ours / theirs:5.2f}x"
            )
        if full_workers[0]:
            print(
                f"full backup: ours MiB is the daemon's process; beside it {full_workers[0]}"
                f" segment worker processes of at most {full_workers[1]} MiB each"
            )
        print(f"full backup vs tar|zstd -3: ratio {rows['full backup'][0] / tar_seconds:.2f}x")
        theirs = results.get("restore", nothing)[0]
        print(
            f"restore: committed (every agent listed, every history durable and read on"
            f" demand) in {rows['restore'][0]:.2f} s; then every history loaded into"
            f" machine.db ({restore_out['events']:,} events) at {loaded:.2f} s ="
            f" {loaded / theirs:.2f}x restic's restore; then searchable at {indexed:.2f} s"
            f" = {indexed / theirs:.2f}x (the daemon loads and indexes in the background;"
            f" CPU of the load {restore_out['load_cpu']:.2f} s, of the index"
            f" {restore_out['index_cpu']:.2f} s: on shared cores, compare these)"
        )
        print(
            f"restore floor: {floor['seconds']:.2f} s (CPU {floor['cpu']:.2f} s) = "
            f"{floor['seconds'] / theirs:.2f}x restic's restore: SQLite alone copying the"
            f" {floor['events']:,} events and the agents, runs, summaries and tool log"
            " into an empty machine.db with the daemon's settings (WAL, synchronous FULL),"
            " no parsing, no decryption; loading every history into machine.db takes at"
            " least this"
        )
        if not restic:
            print("restic not found: `apt-get install restic` for the restic columns")
        figures = BenchResult(
            bench="backup",
            command=f"python -m bench.backup --agents {args.agents} --mb {args.mb}",
            notes=[
                f"{args.agents} agents, machine.db {size / 1e6:.1f} MB; {uploaded} of"
                f" {len(ids)} agent segments uploaded after {len(changed)} agents changed",
                "ours: the operation in a running process (as in the daemon), without the"
                " interpreter's start; restic: its whole process; `sync` before each step",
                f"restore floor: {floor['seconds']:.2f} s, SQLite alone copying the rows a"
                " restore writes into an empty machine.db with the daemon's settings",
            ],
        )
        if full_workers[0]:
            figures.notes.append(
                f"full backup peak RSS is the daemon's process; beside it {full_workers[0]}"
                f" segment worker processes of at most {full_workers[1]} MiB each"
            )
        if restic:
            restore_s = results["restore"][0]
            for step, (ours, _, rss) in rows.items():
                theirs, trss, _, tcpu = results[step]
                figures.rows += [
                    Row(step, ours, theirs, "s", "restic"),
                    Row(f"{step}, CPU", cpus[step], tcpu, "s", "restic"),
                    Row(f"{step}, peak RSS", rss, trss, "MiB", "restic"),
                ]
            figures.rows += [
                Row("restore, every history in machine.db", loaded, restore_s, "s", "restic"),
                Row("restore, searchable", indexed, restore_s, "s", "restic"),
                Row("stored, full backup", full_stored / 1e6, restic_full / 1e6, "MB", "restic"),
            ]
        else:
            figures.notes.append("restic not found: no restic baseline")
        figures.rows += [
            Row("full backup", rows["full backup"][0], tar_seconds, "s", "tar | zstd -3"),
            Row("stored, full backup", full_stored / 1e6, tar_size / 1e6, "MB", "tar | zstd -3"),
        ]
        figures.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
