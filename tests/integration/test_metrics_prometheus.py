"""Both daemons' /metrics, scraped by a real Prometheus and read back with PromQL.

A real control plane (folder store) and a real machine that joined it with the
printed ``agents-machine join`` command, then restarted with ``serve --metrics``
(as its systemd unit serves it). One prompt goes through the echo runtime.
A real ``prometheus`` (tests/helpers/prometheus_proc.py) scrapes both every
second; the test waits, with deadlines, until PromQL shows the expected values,
and checks the raw /metrics pages for ids in label values and for secrets.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from machine.link import identity
from shared.ids import KINDS
from tests.helpers.control_proc import ControlProc, control_plane
from tests.helpers.machine_proc import MachineProc, run_cli
from tests.helpers.poll import poll_until
from tests.helpers.prometheus_proc import PrometheusProc, ScrapeJob, prometheus_binary

pytestmark = pytest.mark.integration

MACHINE_EXE = Path(sys.executable).parent / "agents-machine"
PROCESS_DEADLINE = 15.0
PROMQL_DEADLINE = 10.0
#: A label value starting like an id (``mc_``, ``acct_``, ``ag_``, ``run_``, ``tok_``...).
ID_PREFIX = re.compile(rf"\A(?:{'|'.join(sorted(KINDS.values()))})_")
#: A whole id anywhere in a text.
ANY_ID = re.compile(rf"\b(?:{'|'.join(sorted(KINDS.values()))})_[0-9a-z]{{26}}\b")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=15) as reply:
        return str(reply.read().decode())


def _label_values(page: str) -> list[tuple[str, str, str]]:
    """(sample name, label name, label value) for every label of every sample."""
    return [
        (sample.name, key, value)
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        for key, value in sample.labels.items()
    ]


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProc]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with control_plane(
        tmp_path / "cp-home",
        str(tmp_path / "store"),
        env=env,
        init_args=["--heartbeat-interval", "0.5"],
    ) as running:
        yield running


def _join(cp: ControlProc, data_dir: Path, log: Path) -> tuple[str, str]:
    """Create an account, run the printed join command until its link is up, stop it.

    Returns (account id, token value)."""
    res = cp.cli("account", "create", "--github-id", "31", "--github-login", "metrics")
    assert res.code == 0, res.err
    account = re.search(r"account (acct_[0-9a-z]{26})", res.out)
    assert account, res.out
    res = cp.cli("token", "create", "--account", account.group(1))
    assert res.code == 0, res.err
    argv = shlex.split(res.out.strip().splitlines()[-1])
    assert argv[:2] == ["agents-machine", "join"], res.out
    token = argv[argv.index("--token") + 1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(MACHINE_EXE), *argv[1:], "--data-dir", str(data_dir)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def failed() -> AssertionError:
        return AssertionError(f"join failed:\n{log.read_text(errors='replace')}")

    def link_up() -> bool:
        if proc.poll() is not None:
            raise failed()
        return "control link up" in log.read_text(errors="replace")

    try:
        # "control link up" comes after the daemon's signal handlers are installed.
        poll_until(link_up, deadline=PROCESS_DEADLINE, what="control link up", fail=failed)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=PROCESS_DEADLINE) == 0, log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=PROCESS_DEADLINE)
    return account.group(1), token


def test_machine_metrics_must_be_loopback(tmp_path: Path) -> None:
    res = run_cli(tmp_path / "data", "serve", "--metrics", "0.0.0.0:0", timeout=30)
    assert res.returncode != 0
    assert "loopback" in res.stderr, res.stderr


def test_prometheus_scrapes_both_daemons(cp: ControlProc, tmp_path: Path) -> None:
    if prometheus_binary() is None:
        pytest.fail("prometheus not found: install it with `apt-get install -y prometheus`")
    cp_metrics = cp.serve_info["metrics"]
    assert re.fullmatch(r"127\.0\.0\.1:[1-9][0-9]*", cp_metrics), cp.serve_info

    data_dir = tmp_path / "machine"
    account_id, token = _join(cp, data_dir, tmp_path / "join.log")
    machine_id = identity.load_link(data_dir).machine_id
    m_metrics = f"127.0.0.1:{_free_port()}"
    jobs = [ScrapeJob("agents-control", (cp_metrics,)), ScrapeJob("agents-machine", (m_metrics,))]
    with (
        MachineProc(data_dir, "--metrics", m_metrics) as machine,
        PrometheusProc(tmp_path / "prometheus", jobs) as prom,
    ):
        try:
            prom.wait_for('up{job="agents-control"} == 1', PROMQL_DEADLINE)
            prom.wait_for('up{job="agents-machine"} == 1', PROMQL_DEADLINE)
            prom.wait_for("agents_cp_machines_online == 1", PROMQL_DEADLINE)
            prom.wait_for("agents_machine_link_connected == 1", PROMQL_DEADLINE)
            # Scraped at 0 before the prompt, so the increase below is a real change.
            prom.wait_for("agents_machine_runs_started_total == 0", PROMQL_DEADLINE)

            work = tmp_path / "work"
            work.mkdir()
            res = run_cli(data_dir, "agent", "create", "echo-1", "--folder", str(work), "--json")
            assert res.returncode == 0, res.stderr
            created = json.loads(res.stdout)
            agent_id = (created.get("agent") or created)["agent_id"]
            res = run_cli(data_dir, "agent", "prompt", agent_id, "hello metrics")
            assert res.returncode == 0, res.stderr
            assert "hello metrics" in res.stdout

            prom.wait_for(
                'agents_machine_runs_finished_total{outcome="finished"} == 1', PROMQL_DEADLINE
            )
            prom.wait_for("increase(agents_machine_runs_started_total[1m]) > 0", PROMQL_DEADLINE)
            prom.wait_for("agents_machine_runs_open == 0", PROMQL_DEADLINE)
            prom.wait_for("sum(agents_cp_store_operations_total) > 0", PROMQL_DEADLINE)
            prom.wait_for('agents_cp_joins_total{outcome="ok"} == 1', PROMQL_DEADLINE)
            # Two Connect streams: the joining process's, then the restarted daemon's.
            prom.wait_for('agents_cp_connects_total{outcome="ok"} >= 2', PROMQL_DEADLINE)
        except AssertionError as e:
            raise AssertionError(f"{e}\nprometheus log:\n{prom.log()}") from None

        pages = {"control": _scrape(cp_metrics), "machine": _scrape(m_metrics)}
        stored = prom.series('{job=~"agents-.+"}')
        assert machine.proc is not None and machine.proc.poll() is None

    # No id in any label value: of the live pages nor of what Prometheus stored.
    for which, page in pages.items():
        labels = _label_values(page)
        assert labels, which
        bad = [x for x in labels if ID_PREFIX.match(x[2]) or ANY_ID.search(x[2])]
        assert bad == [], f"{which}: id-like label values {bad}"
    stored_values = [(s["__name__"], k, v) for s in stored for k, v in s.items()]
    assert len({s["job"] for s in stored}) == 2
    bad = [x for x in stored_values if ID_PREFIX.match(x[2]) or ANY_ID.search(x[2])]
    assert bad == [], f"stored series with id-like label values {bad}"

    # No secret and no id anywhere in either page.
    secrets = {
        "operator credential": cp.operator,
        "operator secret": cp.operator.split(".", 1)[1],
        "join token": token,
        "token secret": token.split(".", 1)[1],
    }
    ids = {"account": account_id, "machine": machine_id, "agent": agent_id}
    for which, page in pages.items():
        for what, value in {**secrets, **ids}.items():
            assert value not in page, f"{which} /metrics contains the {what}"
        assert ANY_ID.search(page) is None, f"{which} /metrics: {ANY_ID.search(page)}"
