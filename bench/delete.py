"""Account deletion objects per second against raw S3 DeleteObjects, same server, same run.

Run from the repository root::

    .venv/bin/python -m bench.delete [--objects 10000] [--rounds 1] [--probe]

It starts one moto S3 server and one real ``agents-control`` process on it, then:

- deletion, backups layout: fills an account as machines' backups fill one
  (``--objects`` sealed segments of two machines, named by their backups'
  names lists, with manifests and machine records; straight into the bucket),
  calls DeleteAccount and polls GetDeletion until the account is gone; the
  rate is segments / (reply of the last poll - call);
- deletion, unindexed: the same with ``--objects`` objects nothing names
  (the deletion can only find them by listing);
- raw: writes the same number of objects under another prefix and deletes
  them with DeleteObjects, 1000 keys a request, one request after the other
  (what a plain script with boto3 would do knowing the keys);
- raw listed: the same, but the keys are found by listing the prefix first,
  as the deletion must (and ``aws s3 rm --recursive`` does).

Objects are written as our stores write them (no checksum header: moto would
list a ChecksumAlgorithm with each key). Each phase reports its wall time, the
CPU seconds moto and the deleting client used, and its S3 calls (the bench's
own timed one by one; the control plane's from its store metrics). Then the
rates and the ratios deletion / raw (target at least 0.5; the backups layout)
and unindexed deletion / raw and / raw listed. ``--probe`` first prints moto's
CPU per ListObjectsV2 page against the prefix size and MaxKeys.

On moto the unindexed ratio is bounded by listing: rendering a ListObjectsV2 page of
1000 keys costs moto ~4x the CPU of deleting them (each key's LastModified is
formatted through dateutil), moto serves every request under one GIL (one
core at most), and an account's keys can only be found by listing. The bench
prints that bound from the measured CPU.
Everything is bounded: sizes by flags, each wait by a deadline. ``--json PATH``
also writes the three ratios for ``bench/report.py`` (bench/results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
from botocore.config import Config
from prometheus_client.parser import text_string_to_metric_families

from bench.results import BenchResult, Row
from controlplane.cli.client import AdminClient
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.records import Machine, encode
from controlplane.integrity.trusted import record_mac_key
from controlplane.machines.backups import backups_prefix
from shared.backup_target import manifest_key, names_key, segment_key
from shared.ids import new_id
from shared.store.authenticated import seal
from tests.helpers.control_proc import ControlProc, run_init, s3_env, start_serve, stop_serve
from tests.helpers.moto_server import moto_server_proc
from tests.helpers.poll import apoll_until

BUCKET = "bench-delete"
PREFIX = "cp/"
#: Seconds one deletion may take before the bench gives up.
DEADLINE = 600.0
#: Seconds between two GetDeletion polls. Each poll is a store read on the same
#: server: more often and the polls take moto CPU from the deletion they time;
#: rarer and the figure is up to one interval low.
POLL = 0.1


def _s3(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        config=Config(
            s3={"addressing_style": "path"},
            max_pool_connections=16,
            # As S3Store writes: boto3's default CRC32 would make moto render a
            # ChecksumAlgorithm per listed key (~7% more CPU per page).
            request_checksum_calculation="when_required",
        ),
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (Linux ``/proc``)."""
    # Fields after the command name (which may hold spaces): utime and stime are
    # the 14th and 15th of the line, so the 12th and 13th after ")".
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Calls:
    """S3 calls of one kind: how many, their wall seconds and the server's CPU seconds."""

    count: int = 0
    wall: float = 0.0
    server_cpu: float = 0.0

    def line(self, what: str) -> str:
        if not self.count:
            return f"{what}: none"
        return (
            f"{what}: {self.count} calls, {self.wall:.2f} s wall "
            f"({1000 * self.wall / self.count:.0f} ms each), "
            f"moto CPU {self.server_cpu:.2f} s ({1000 * self.server_cpu / self.count:.0f} ms each)"
        )


@dataclass
class Phase:
    """One measured deletion of ``objects`` objects."""

    objects: int
    wall: float
    server_cpu: float
    """CPU seconds the moto server used meanwhile (at most one core: one GIL)."""
    client_cpu: float
    """CPU seconds of whoever deleted (the control plane, or this process)."""
    calls: dict[str, Calls] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.objects / self.wall


class Meter:
    """Times a block: wall clock, moto's CPU and the client's CPU."""

    def __init__(self, server_pid: int, client_pid: int) -> None:
        self._pids = (server_pid, client_pid)

    def __enter__(self) -> Meter:
        self._start = (time.perf_counter(), *map(cpu_seconds, self._pids))
        return self

    def __exit__(self, *exc: object) -> None:
        wall0, server0, client0 = self._start
        self.wall = time.perf_counter() - wall0
        self.server_cpu = cpu_seconds(self._pids[0]) - server0
        self.client_cpu = cpu_seconds(self._pids[1]) - client0


def _fill(s3: Any, keys: list[str], mac: bytes | None) -> None:
    def put(key: str) -> None:
        body = json.dumps({"k": key}).encode()
        if mac is not None:
            body = seal(mac, key.removeprefix(PREFIX), body)
        s3.put_object(Bucket=BUCKET, Key=key, Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, keys))


def bench_raw(s3: Any, server_pid: int, objects: int, round_no: int, *, listed: bool) -> Phase:
    """DeleteObjects of known keys; with ``listed``, keys found by listing the prefix
    page by page first (what ``aws s3 rm --recursive`` does). Each call is timed."""
    prefix = f"raw/{round_no}/{'listed' if listed else 'known'}/"
    keys = [f"{prefix}obj_{i:06d}.json" for i in range(objects)]
    _fill(s3, keys, None)
    calls = {"list": Calls(), "delete": Calls()}
    me = os.getpid()

    def call(kind: str, fn: Any, **kwargs: Any) -> Any:
        with Meter(server_pid, me) as m:
            out = fn(**kwargs)
        c = calls[kind]
        c.count, c.wall, c.server_cpu = c.count + 1, c.wall + m.wall, c.server_cpu + m.server_cpu
        return out

    def delete(batch: list[str]) -> None:
        objs = [{"Key": k} for k in batch]
        call("delete", s3.delete_objects, Bucket=BUCKET, Delete={"Objects": objs, "Quiet": True})

    with Meter(server_pid, me) as total:
        if listed:
            request = {"Bucket": BUCKET, "Prefix": prefix}
            while True:
                page = call("list", s3.list_objects_v2, **request)
                delete([item["Key"] for item in page.get("Contents", [])])
                if not page.get("IsTruncated"):
                    break
                request["ContinuationToken"] = page["NextContinuationToken"]
        else:
            for i in range(0, len(keys), 1000):
                delete(keys[i : i + 1000])
    left = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("KeyCount", 0)
    if left:
        raise SystemExit(f"bench: raw delete left {left} objects")
    return Phase(objects, total.wall, total.server_cpu, total.client_cpu, calls)


def probe_listing(s3: Any, server_pid: int) -> None:
    """Print moto's CPU per ListObjectsV2 call against the prefix size and MaxKeys.

    Shows the two parts of a page's cost: a fixed part that grows with the keys
    under the prefix (moto filters the whole bucket and sorts every match for
    each page, then walks to the continuation point) and a part per returned key
    (rendering it).
    """
    me = os.getpid()
    for size in (1000, 10_000):
        prefix = f"probe/{size}/"
        keys = [f"{prefix}obj_{i:06d}.json" for i in range(size)]
        _fill(s3, keys, None)
        for max_keys in (1, 100, 1000):
            with Meter(server_pid, me) as m:
                for _ in range(5):
                    s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix, MaxKeys=max_keys)
            print(
                f"probe: ListObjectsV2 of a prefix of {size} keys, MaxKeys {max_keys}: "
                f"moto CPU {200 * m.server_cpu:.0f} ms, wall {200 * m.wall:.0f} ms"
            )
        with Meter(server_pid, me) as m:
            for i in range(0, size, 1000):
                batch = [{"Key": k} for k in keys[i : i + 1000]]
                s3.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})
        calls = -(-size // 1000)
        print(
            f"probe: DeleteObjects of 1000 known keys: moto CPU "
            f"{1000 * m.server_cpu / calls:.0f} ms, wall {1000 * m.wall / calls:.0f} ms"
        )


def _store_calls(metrics_addr: str) -> dict[str, tuple[float, float]]:
    """The control plane's store calls so far: operation -> (count, seconds)."""
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "agents_cp_store_operation_seconds":
            continue
        for sample in family.samples:
            op = sample.labels.get("operation", "")
            count, seconds = out.get(op, (0.0, 0.0))
            if sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                seconds += sample.value
            out[op] = (count, seconds)
    return out


def _backup_layout(account_id: str, objects: int) -> tuple[list[str], dict[str, bytes]]:
    """An account as backups fill one: two machines, each with ``objects / 2`` sealed
    segments named by its backups' names lists (three backups sharing most
    segments), their manifests, and the machine records.

    Returns the segment keys (raw bytes) and the other objects (key -> body;
    records are sealed by the caller).
    """
    segments: list[str] = []
    others: dict[str, bytes] = {}
    per_machine = objects // 2
    for m in range(2):
        machine_id = new_id("machine")
        root = f"{PREFIX}{backups_prefix(account_id, machine_id)}"
        names = [f"{m:02x}{i:062x}" for i in range(per_machine)]
        segments += [root + segment_key(n) for n in names]
        cut = len(names) // 10
        for b, named in enumerate((names[: -2 * cut], names[cut:-cut], names[2 * cut :])):
            backup_id = new_id("backup", now_ms=1_800_000_000_000 + b)
            others[root + names_key(backup_id)] = json.dumps(named).encode()
            others[root + manifest_key(backup_id)] = os.urandom(512)
        now = dt.datetime.now(dt.UTC)
        record = Machine(machine_id, account_id, f"m{m}", "bench", "0", now, "01", now)
        others[f"{PREFIX}accounts/{account_id}/machines/{machine_id}.json"] = encode(record)
    return segments, others


async def bench_deletion(
    client: AdminClient,
    s3: Any,
    mac: bytes,
    cp: ControlProc,
    server_pid: int,
    objects: int,
    round_no: int,
    *,
    backups: bool,
) -> Phase:
    """One account deletion: with ``backups``, of an account filled as backups fill
    one; without, of ``objects`` objects nothing names (found only by listing)."""
    reply = await client.create_account(1000 + 2 * round_no + backups, f"bench{round_no}")
    account_id = reply.account.account_id
    if backups:
        keys, others = _backup_layout(account_id, objects)
        _fill(s3, keys, None)
        for key, body in others.items():
            if "/machines/" in key:
                body = seal(mac, key.removeprefix(PREFIX), body)
            s3.put_object(Bucket=BUCKET, Key=key, Body=body)
    else:
        keys = [f"{PREFIX}accounts/{account_id}/backups/seg_{i:06d}.json" for i in range(objects)]
        _fill(s3, keys, mac)
    assert cp.process is not None
    before = _store_calls(cp.serve_info["metrics"])
    with Meter(server_pid, cp.process.pid) as m:
        state = (await client.delete_account(account_id)).state

        async def deleted() -> bool:
            return (await client.get_deletion(account_id)).state == "deleted"

        if state != "deleted":
            fail = f"bench: deletion not finished within {DEADLINE}s"
            await apoll_until(
                deleted,
                deadline=DEADLINE,
                what="deletion",
                step=POLL,
                fail=lambda: SystemExit(fail),
            )
    after = _store_calls(cp.serve_info["metrics"])
    left = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}accounts/{account_id}/")
    if left.get("KeyCount", 0):
        raise SystemExit(f"bench: the deletion left {left['KeyCount']} objects")
    calls = {
        op: Calls(int(count - before.get(op, (0, 0))[0]), seconds - before.get(op, (0, 0))[1])
        for op, (count, seconds) in sorted(after.items())
        if count > before.get(op, (0, 0))[0]
    }
    return Phase(len(keys), m.wall, m.server_cpu, m.client_cpu, calls)


def _report(deletion: Phase, raw: Phase, listed: Phase) -> str:
    """Print one round; return its bound on deletion/raw ("" when too few objects
    to measure it)."""
    print(
        f"  raw known keys: {raw.wall:.2f} s, moto CPU {raw.server_cpu:.2f} s, "
        f"client CPU {raw.client_cpu:.2f} s"
    )
    print("    " + raw.calls["delete"].line("DeleteObjects"))
    print(
        f"  raw list + delete: {listed.wall:.2f} s, moto CPU {listed.server_cpu:.2f} s, "
        f"client CPU {listed.client_cpu:.2f} s"
    )
    print("    " + listed.calls["list"].line("ListObjectsV2"))
    print("    " + listed.calls["delete"].line("DeleteObjects"))
    print(
        f"  account deletion: {deletion.wall:.2f} s, moto CPU {deletion.server_cpu:.2f} s, "
        f"control plane CPU {deletion.client_cpu:.2f} s"
    )
    for op, c in deletion.calls.items():
        mean = 1000 * c.wall / c.count
        print(f"    store {op}: {c.count} calls, {c.wall:.2f} s summed ({mean:.0f} ms each)")
    # moto serves every request under one GIL: a deletion, which must list every
    # key and delete it, needs at least moto's CPU for both, one after the other,
    # while raw needs its own CPU (moto's and the client's, request after request).
    lists, deletes = listed.calls["list"], raw.calls["delete"]
    floor = lists.server_cpu + deletes.server_cpu
    raw_cpu = raw.server_cpu + raw.client_cpu
    if not (lists.server_cpu > 0 and deletes.server_cpu > 0):
        return ""  # too few objects for /proc's 10 ms ticks
    per_list = 1000 * lists.server_cpu / lists.count
    per_delete = 1000 * deletes.server_cpu / deletes.count
    print(
        f"  moto CPU per request of 1000 keys: list {per_list:.0f} ms, delete "
        f"{per_delete:.0f} ms ({per_list / per_delete:.1f}x); moto busy "
        f"{100 * deletion.server_cpu / deletion.wall:.0f}% of the deletion"
    )
    bound = (
        f"the deletion needs >= {floor:.2f} s of moto CPU (one core at most); "
        f"raw used {raw_cpu:.2f} s CPU in {raw.wall:.2f} s -> deletion/raw at most "
        f"{raw.wall / floor:.2f}x with moto on a whole core, ~{raw_cpu / floor:.2f}x "
        "when every process gets the same CPU share"
    )
    print(f"  bound: {bound}")
    return bound


async def main_async(args: argparse.Namespace) -> int:
    bound = ""
    with (
        moto_server_proc() as (endpoint, moto),
        tempfile.TemporaryDirectory(prefix="bench-delete-") as tmp,
    ):
        s3 = _s3(endpoint)
        s3.create_bucket(Bucket=BUCKET)
        cp = run_init(Path(tmp) / "cp-home", f"s3://{BUCKET}/cp", s3_env(endpoint))
        try:
            start_serve(cp)
            mac = record_mac_key(load_home_keys(cp.home))
            deletion: list[Phase] = []
            unindexed: list[Phase] = []
            raw: list[Phase] = []
            listed: list[Phase] = []
            if args.probe:
                probe_listing(s3, moto.pid)
            async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
                for r in range(args.rounds):
                    deletion.append(
                        await bench_deletion(
                            client, s3, mac, cp, moto.pid, args.objects, r, backups=True
                        )
                    )
                    unindexed.append(
                        await bench_deletion(
                            client, s3, mac, cp, moto.pid, args.objects, r, backups=False
                        )
                    )
                    raw.append(bench_raw(s3, moto.pid, args.objects, r, listed=False))
                    listed.append(bench_raw(s3, moto.pid, args.objects, r, listed=True))
                    print(f"round {r + 1}:")
                    bound = _report(unindexed[-1], raw[-1], listed[-1])
                    print(
                        f"  account deletion, backups layout: {deletion[-1].wall:.2f} s,"
                        f" moto CPU {deletion[-1].server_cpu:.2f} s"
                    )
                    for op, c in deletion[-1].calls.items():
                        print(f"    store {op}: {c.count} calls, {c.wall:.2f} s summed")
        finally:
            stop_serve(cp)
            assert cp.log_path is not None
            for line in cp.log_path.read_text().splitlines():
                if ": deleted (" in line:
                    print("control plane:", line.split("] ", 1)[-1])
    best_raw = max(p.rate for p in raw)
    best_listed = max(p.rate for p in listed)
    best_deletion = max(p.rate for p in deletion)
    best_unindexed = max(p.rate for p in unindexed)
    print(f"objects per account: {args.objects}, rounds: {args.rounds} (best of each)")
    print(f"raw S3 DeleteObjects of known keys (1000 keys/request): {best_raw:.0f} objects/s")
    print(f"raw list + DeleteObjects (aws s3 rm --recursive): {best_listed:.0f} objects/s")
    print(
        "account deletion, backups layout (segments named by their backups):"
        f" {best_deletion:.0f} objects/s"
    )
    print(f"ratio deletion/raw {best_deletion / best_raw:.2f}x (target >= 0.5)")
    print(
        "account deletion, objects nothing names (found by listing):"
        f" {best_unindexed:.0f} objects/s"
    )
    print(f"ratio unindexed deletion/raw {best_unindexed / best_raw:.2f}x")
    print(f"ratio unindexed deletion/list+delete {best_unindexed / best_listed:.2f}x")
    rate = "objects/s"
    BenchResult(
        bench="delete",
        command=f"python -m bench.delete --objects {args.objects} --rounds {args.rounds}",
        rows=[
            Row(
                "account deletion, backups layout",
                best_deletion,
                best_raw,
                rate,
                "raw DeleteObjects of known keys",
                "higher",
                ">= 0.5x",
            ),
            Row(
                "account deletion, objects nothing names",
                best_unindexed,
                best_raw,
                rate,
                "raw DeleteObjects of known keys",
                "higher",
            ),
            Row(
                "account deletion, objects nothing names",
                best_unindexed,
                best_listed,
                rate,
                "raw list + DeleteObjects",
                "higher",
            ),
        ],
        notes=[
            f"{args.objects} objects per account on moto, best of {args.rounds} round(s)",
            *([f"moto's CPU bound (last round): {bound}"] if bound else []),
        ],
    ).write(args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000, help="objects in the account")
    parser.add_argument("--rounds", type=int, default=1, help="repeat and keep the best")
    parser.add_argument(
        "--probe", action="store_true", help="first print moto's CPU per listing page"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here (bench/results.py)")
    args = parser.parse_args(argv)
    if not 1 <= args.objects <= 200_000 or not 1 <= args.rounds <= 10:
        parser.error("--objects 1..200000, --rounds 1..10")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
