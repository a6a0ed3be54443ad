"""A month in minutes: a control plane on moto and three joined machines, run
through the equivalent of ``--days`` days (default 48) with every interval that
a month exercises made short through config.

    python -m bench.soak                 # 48 days of 2.5 s: about 2.5 minutes
    python -m bench.soak --days 6        # the CI smoke (tests/bench)

What a "day" holds (real processes throughout: agents-control serve, three
agents-machine daemons with the echo runtime, moto's S3 server):

- client certificates live 60 s (``cert_lifetime_days``) and are renewed at a
  third left, so a machine renews every 40 s: three or more renewals in 48
  days, plus the one a CA rollover (day ``days // 2``) asks for; the old CA is
  retired once no machine holds a certificate from it;
- a backup a day (``backup now`` on each machine in turn, to the control
  plane), verified (``backup verify``);
- a schedule on every machine firing every 10 s (the seconds test hook);
- a prompt a day to a running machine, and to the last machine, which is
  stopped every fifth day and started two days later, prompts queued while it
  is stopped (each machine start runs the retention sweeps);
- the daemons' RSS taken on day 2 (the soak's "first hour") and at the end.

It ends with nothing lost and nothing stuck: every prompt ran exactly once,
no queue entry is left in the bucket, every backup verified, the schedules
fired, ``agents-control fsck`` is clean, and each long-lived daemon's RSS at
the end is within 20 % of day 2's. It prints the figures, and exits 1 naming
every promise that did not hold.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import psutil

from machine.link import identity
from tests.helpers.control_proc import ControlProc, run_init, s3_env, start_serve, stop_serve
from tests.helpers.machine_proc import run_cli
from tests.helpers.moto_server import free_port, moto_server
from tests.helpers.poll import poll_until

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
CERT_SECONDS = 60
SCHEDULE_EVERY = 10
RSS_SLACK = 1.20
DEADLINE = 60.0


@dataclass
class Machine:
    name: str
    data: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    machine_id: str = ""
    agent: str = ""
    prompts: list[str] = field(default_factory=list)
    starts: int = 1
    rss_day2: int = 0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(MACHINE_EXE), "--data-dir", str(self.data), "serve", "--no-background"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=DEADLINE)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _ok(res: Any, what: str) -> str:
    code = getattr(res, "code", getattr(res, "returncode", 1))
    if code != 0:
        err = getattr(res, "err", getattr(res, "stderr", ""))
        raise SystemExit(f"soak: {what} failed ({code}): {str(err).strip()[-500:]}")
    return str(getattr(res, "out", getattr(res, "stdout", "")))


def _metrics(cp: ControlProc) -> str:
    with urllib.request.urlopen(f"http://{cp.serve_info['metrics']}/metrics", timeout=15) as r:
        return str(r.read().decode())


def _sample(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _online(cp: ControlProc) -> dict[str, bool]:
    listed = json.loads(_ok(cp.cli("machine", "list", "--json"), "machine list"))
    return {m["machine_id"]: bool(m["online"]) for m in listed["machines"]}


def _join(cp: ControlProc, m: Machine, github_id: int) -> None:
    made = _ok(
        cp.cli("account", "create", "--github-id", str(github_id), "--github-login", m.name),
        "account create",
    )
    account = re.search(r"account (acct_[0-9a-z]{26})", made)
    assert account, made
    token = json.loads(
        _ok(cp.cli("token", "create", "--account", account.group(1), "--json"), "token")
    )
    join = shlex.split(token["join_command"])
    m.data.mkdir(mode=0o700)
    (m.data / "machine.toml").write_text(f"schedule_test_seconds = {SCHEDULE_EVERY}\n")
    with m.log.open("wb") as out:
        m.proc = subprocess.Popen(
            [str(MACHINE_EXE), *join[1:], "--data-dir", str(m.data), "--no-background"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _rows(data: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{data / 'machine.db'}?mode=ro", uri=True)
    try:
        return list(conn.execute(sql, params).fetchall())
    finally:
        conn.close()


def _rss(proc: subprocess.Popen[bytes] | None) -> int:
    if proc is None or proc.poll() is not None:
        return 0
    return int(psutil.Process(proc.pid).memory_info().rss)


def _send(cp: ControlProc, m: Machine, day: int, n: int) -> None:
    key = f"soak-{m.name}-{day}-{n}"

    def send() -> Any:
        res = cp.cli(
            "prompt", "send", "--machine", m.machine_id, "--agent", m.agent,
            "--text", f"day {day} prompt {n}", "--idempotency-key", key,
        )  # fmt: skip
        # Just stopped, the machine's roster may reach the store a moment after
        # its goodbye: refused (nothing queued) until then.
        return None if res.code == 2 and "not found" in res.err else res

    out = _ok(poll_until(send, deadline=DEADLINE, what="the agent known"), "prompt send")
    found = re.search(r"prompt (pr_[0-9a-z]{26})", out)
    assert found, out
    if found.group(1) not in m.prompts:
        m.prompts.append(found.group(1))


def _backup(m: Machine) -> bool:
    made = run_cli(m.data, "backup", "now", "--json", timeout=DEADLINE)
    if made.returncode != 0:
        print(f"  backup on {m.name} failed: {made.stderr.strip()[-300:]}")
        return False
    backup_id = str(json.loads(made.stdout)["backup_id"])
    checked = run_cli(m.data, "backup", "verify", backup_id, timeout=DEADLINE)
    if checked.returncode != 0:
        print(f"  backup {backup_id} on {m.name} does not verify: {checked.stderr.strip()}")
        return False
    return True


def soak(days: int, day_seconds: float, root: Path) -> list[str]:
    """Run the soak; return the promises that did not hold (empty: all held)."""
    failed: list[str] = []
    with moto_server() as endpoint:
        bucket = "soak-bucket"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
        ).create_bucket(Bucket=bucket)
        ports = ["--listen", f"127.0.0.1:{free_port()}"]
        ports += ["--link-listen", f"127.0.0.1:{free_port()}"]
        cp = run_init(
            root / "home", f"s3://{bucket}/cp", s3_env(endpoint),
            ["--heartbeat-interval", "0.5", *ports],
        )  # fmt: skip
        config = cp.home / "config.toml"
        kept = [
            line
            for line in config.read_text().splitlines()
            if not line.startswith("cert_lifetime_days")
        ]
        config.write_text("\n".join([*kept, f"cert_lifetime_days = {CERT_SECONDS / 86400!r}", ""]))
        start_serve(cp)
        machines = [Machine(n, root / n, root / f"{n}.log") for n in ("m0", "m1", "m2")]
        try:
            failed = _run(cp, machines, days, day_seconds, endpoint, bucket)
        finally:
            for m in machines:
                m.stop()
            stop_serve(cp)
        report = json.loads(_ok(cp.cli("fsck", "--json", timeout=120), "fsck"))
        findings = report.get("findings", [])
        print(f"fsck after the soak             : {len(findings)} finding(s)")
        if findings:
            failed.append(f"fsck found {findings[:5]}")
    return failed


def _run(
    cp: ControlProc,
    machines: list[Machine],
    days: int,
    day_seconds: float,
    endpoint: str,
    bucket: str,
) -> list[str]:
    failed: list[str] = []
    for i, m in enumerate(machines):
        _join(cp, m, 9000 + i)
    poll_until(
        lambda: len(_online(cp)) == 3 and all(_online(cp).values()),
        deadline=DEADLINE,
        what="three machines online",
    )
    for m in machines:
        m.machine_id = identity.load_link(m.data).machine_id
        made = json.loads(
            _ok(
                run_cli(m.data, "agent", "create", m.name, "--folder", str(m.data), "--json"),
                "agent",
            )
        )
        m.agent = str(made["agent_id"])
        _ok(
            run_cli(m.data, "schedule", "add", m.agent, "--cron", "* * * * *", "--text", "tick"),
            "schedule add",
        )
    cp_rss_day2 = 0
    backups = verified = 0
    rolled = retired = False
    stopped = machines[-1]
    started = time.monotonic()
    for day in range(1, days + 1):
        begin = time.monotonic()
        if day % 5 == 0 and stopped.running:
            stopped.stop()
        elif day % 5 == 2 and not stopped.running:
            stopped.start()
        for m in machines:
            if m is not stopped or day % 2 == 0:
                _send(cp, m, day, 0)
        if not stopped.running:
            _send(cp, stopped, day, 1)  # queued while it is stopped
        today = machines[day % len(machines)]
        if today.running:
            backups += 1
            verified += _backup(today)
        if day == max(1, days // 2):
            state = json.loads(_ok(cp.cli("ca", "rollover", "--json"), "ca rollover"))
            rolled = state["state"] == "rolling"
        elif rolled and not retired and stopped.running:
            state = json.loads(_ok(cp.cli("ca", "rollover", "--json"), "ca rollover"))
            if state["machines_pending"] == 0:
                _ok(cp.cli("ca", "rollover", "--retire-old", "--json"), "retire old CA")
                retired = True
        if day == 2:
            cp_rss_day2 = _rss(cp.process)
            for m in machines[:-1]:
                m.rss_day2 = _rss(m.proc)
        # The soak's own clock: each day lasts day_seconds (a pace, not a wait).
        time.sleep(max(0.0, begin + day_seconds - time.monotonic()))
    if not stopped.running:
        stopped.start()
    soaked = time.monotonic() - started

    def all_ran() -> bool:
        return all(
            all(_runs(m, p) == ["finished"] for p in m.prompts) for m in machines if m.prompts
        )

    try:
        poll_until(all_ran, deadline=DEADLINE, what="every prompt run")
    except TimeoutError:
        pass
    metrics = _metrics(cp)
    renewals = _sample(metrics, "agents_cp_cert_renewals_total", 'outcome="ok"')
    prompts = sum(len(m.prompts) for m in machines)
    once = sum(1 for m in machines for p in m.prompts if _runs(m, p) == ["finished"])
    # An entry goes after its run is stored and acknowledged: wait for it a while.
    try:
        poll_until(
            lambda: not _queue_left(endpoint, bucket), deadline=DEADLINE, what="queue drained"
        )
    except TimeoutError:
        pass
    left = _queue_left(endpoint, bucket)
    fires = {m.name: _fires(m) for m in machines}
    cp_rss_end = _rss(cp.process)
    print(f"soak                            : {days} days of {day_seconds:.1f} s ({soaked:.0f} s)")
    print(f"certificate renewals (all)      : {renewals:.0f} (3 machines, {CERT_SECONDS} s certs)")
    print(f"CA rollover                     : started {rolled}, old CA retired {retired}")
    print(f"backups made / verified         : {backups} / {verified}")
    print(f"prompts sent / ran exactly once : {prompts} / {once}")
    print(f"queue entries left in the bucket: {len(left)}")
    print(f"schedule fires per machine      : {fires}")
    print(f"machine starts (retention sweeps): {[m.starts for m in machines]}")
    rss = [("agents-control", cp_rss_day2, cp_rss_end)]
    rss += [(f"agents-machine {m.name}", m.rss_day2, _rss(m.proc)) for m in machines[:-1]]
    for name, first, end in rss:
        ratio = end / first if first else float("inf")
        print(f"RSS {name:<28}: day 2 {first / 2**20:.1f} MiB, end {end / 2**20:.1f} MiB, "
              f"ratio end/day 2 {ratio:.2f}x")  # fmt: skip
        if days >= 20 and ratio > RSS_SLACK:
            failed.append(f"{name} grew {ratio:.2f}x (over {RSS_SLACK:.2f}x)")
    if days >= 40 and renewals < 3 * len(machines):
        failed.append(f"only {renewals:.0f} renewals")
    if days >= 4 and not rolled:
        failed.append("the CA rollover did not start")
    if days >= 20 and not retired:
        failed.append("the old CA was never retired")
    if verified != backups:
        failed.append(f"{backups - verified} backup(s) failed or did not verify")
    if once != prompts:
        failed.append(f"{prompts - once} prompt(s) not run exactly once")
    if left:
        failed.append(f"queue entries left: {left[:3]}")
    expected_fires = int(soaked // SCHEDULE_EVERY) - 2
    for m in machines[:-1]:
        if fires[m.name] < expected_fires:
            failed.append(f"{m.name} fired {fires[m.name]} times, want {expected_fires}+")
    return failed


def _runs(m: Machine, prompt_id: str) -> list[str]:
    return [
        str(r[0]) for r in _rows(m.data, "SELECT state FROM runs WHERE prompt_id = ?", prompt_id)
    ]


def _fires(m: Machine) -> int:
    return int(_rows(m.data, "SELECT COUNT(*) FROM schedule_runs")[0][0])


def _queue_left(endpoint: str, bucket: str) -> list[str]:
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
    )
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for p in pages for o in p.get("Contents", []) if "/queue/" in o["Key"]]


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=int, default=48, help="days to run (default 48)")
    parser.add_argument(
        "--day-seconds", type=float, default=2.5, help="real seconds per day (default 2.5)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and data folders")
    args = parser.parse_args(argv)
    if args.days < 1 or args.day_seconds <= 0:
        parser.error("--days must be at least 1 and --day-seconds positive")
    # A short root: machine sockets live under it (a Unix socket path has 108 bytes).
    if args.keep:
        root = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
        report(f"soak: logs and data kept in {root}")
        failed = soak(args.days, args.day_seconds, root)
    else:
        with tempfile.TemporaryDirectory(prefix="soak-", dir="/tmp") as tmp:
            failed = soak(args.days, args.day_seconds, Path(tmp))
    for line in failed:
        report(f"soak: NOT HELD: {line}")
    if not failed:
        report("soak: every promise held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
