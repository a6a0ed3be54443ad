"""Checks on deploy/: Prometheus config and alert rules (with promtool), systemd units.

promtool comes from the Debian package ``prometheus``; these tests fail (never
skip) without it, so a CI image that lacks it is noticed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from controlplane.config import DEFAULT_METRICS_LISTEN
from machine.config import SERVICE_METRICS_ADDRESS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
UNITS = DEPLOY / "systemd"
VENV_BIN = Path(sys.executable).parent
TIMEOUT = 60

# Metric names deploy/ relies on that no daemon exports yet; the README lists them
# too. Names outside this set must be found in the code.
ASSUMED_METRICS: frozenset[str] = frozenset()


@pytest.fixture(scope="module")
def promtool() -> str:
    """Path of promtool, or a failure telling how to install it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install it with `apt-get install -y prometheus`")
    return path


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


# --- Prometheus ---------------------------------------------------------------


def test_prometheus_config_is_valid_and_finds_its_rules(promtool: str, tmp_path: Path) -> None:
    # Run from elsewhere: rule_files must resolve against the config file's folder.
    done = _run([promtool, "check", "config", str(PROM / "prometheus.yml")], cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 rule files found" in out, out
    assert "SUCCESS" in out, out


def test_prometheus_scrapes_both_daemons_on_loopback() -> None:
    text = (PROM / "prometheus.yml").read_text()
    assert "job_name: agents-control" in text
    assert "job_name: agents-machine" in text
    targets = re.findall(r'"([^"]+:\d+)"', text.split("scrape_configs:", 1)[1])
    assert targets, "no static targets"
    assert all(t.startswith("127.0.0.1:") for t in targets), targets


def _scrape_targets() -> dict[str, list[str]]:
    """Each scrape job's static targets in prometheus.yml."""
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    return {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }


def test_prometheus_scrapes_each_daemon_on_its_one_metrics_port() -> None:
    # The control plane's default and the machine's service port (docs/metrics.md).
    assert _scrape_targets() == {
        "agents-control": [DEFAULT_METRICS_LISTEN],
        "agents-machine": [SERVICE_METRICS_ADDRESS],
    }


def test_alert_rules_are_valid(promtool: str, tmp_path: Path) -> None:
    done = _run([promtool, "check", "rules", str(PROM / "alerts.yml")], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_unit_tests_pass(promtool: str, tmp_path: Path) -> None:
    done = _run([promtool, "test", "rules", str(PROM / "alerts_test.yml")], cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "SUCCESS" in out and "FAILED" not in out, out


def _alert_names() -> list[str]:
    return re.findall(r"^\s*- alert: (\w+)\s*$", (PROM / "alerts.yml").read_text(), re.M)


def test_the_required_alerts_exist() -> None:
    names = set(_alert_names())
    for required in (
        "AgentsBackupTooOld",
        "AgentsRestoreCheckFailed",
        "AgentsMachineOffline",
        "AgentsPromptQueueBacklog",
        "AgentsErasureStuck",
        "AgentsStoreErrors",
    ):
        assert required in names


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    text = (PROM / "alerts_test.yml").read_text()
    firing: set[str] = set()
    silent: set[str] = set()
    for name, expected in re.findall(r"alertname: (\w+)\s*\n\s*exp_alerts:(.*)", text):
        (silent if expected.strip() == "[]" else firing).add(name)
    for name in _alert_names():
        assert name in firing, f"{name}: no test shows it firing"
        assert name in silent, f"{name}: no test shows it not firing"


def test_every_alert_has_annotations_and_a_runbook_in_the_readme() -> None:
    rules = (PROM / "alerts.yml").read_text()
    readme = (DEPLOY / "README.md").read_text()
    headings = set(re.findall(r"^### (\w+)\s*$", readme, re.M))
    blocks = re.split(r"^\s*- alert: ", rules, flags=re.M)[1:]
    assert len(blocks) == len(_alert_names())
    for block in blocks:
        name = block.split()[0]
        assert "summary:" in block and "description:" in block, name
        assert f'runbook_url: "deploy/README.md#{name.lower()}"' in block, name
        assert name in headings, f"{name}: no runbook section '### {name}' in deploy/README.md"


def _source_metric_names() -> set[str]:
    """Every metric name the daemons' code can export (with exposition suffixes)."""
    bases: set[str] = set()
    for package in ("shared", "machine", "controlplane"):
        for path in (ROOT / package).rglob("*.py"):
            if "/pb/" in path.as_posix():
                continue
            text = path.read_text()
            bases.update(re.findall(r'"(agents_(?:cp|machine)_[a-z0-9_]+)"', text))
            # The store wrappers build names per namespace: f"{namespace}_store_...".
            for suffix in re.findall(r'f"\{namespace\}(_[a-z0-9_]+)"', text):
                bases.update(f"{ns}{suffix}" for ns in ("agents_cp", "agents_machine"))
    names = set(bases)
    for base in bases:
        names.update(base + s for s in ("_total", "_bucket", "_sum", "_count", "_created"))
    return names


def _deploy_metric_names() -> set[str]:
    texts = [(PROM / "alerts.yml").read_text(), (PROM / "alerts_test.yml").read_text()]
    dashboard = json.loads((DEPLOY / "grafana" / "agents.json").read_text())
    texts += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    found = set(re.findall(r"\bagents_(?:cp|machine)_[a-z0-9_]+", "\n".join(texts)))
    # The store rules select both namespaces with one regex on __name__.
    if any("agents_(cp|machine)_store_errors_total" in t for t in texts):
        found.update({"agents_cp_store_errors_total", "agents_machine_store_errors_total"})
    return found


def test_metric_names_exist_in_code_or_are_declared_assumed() -> None:
    used = _deploy_metric_names()
    unknown = used - _source_metric_names() - ASSUMED_METRICS
    assert not unknown, f"metric names neither exported nor listed as assumed: {sorted(unknown)}"
    readme = (DEPLOY / "README.md").read_text()
    for name in ASSUMED_METRICS & used:
        assert name in readme, f"{name}: assumed but not listed in deploy/README.md"


def test_dashboard_panels_have_queries() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "agents.json").read_text())
    assert dashboard["uid"] and dashboard["title"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in ("machines online", "runs", "store latency", "store errors", "backup"):
        assert word in titles, word
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])


#: Series Prometheus makes itself for every target, not exported by a daemon.
_PROMETHEUS_SERIES = frozenset({"up"})
#: PromQL's keywords and operators spelled as words.
_PROMQL_WORDS = frozenset({"and", "or", "unless", "bool", "offset"})


def _queried_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every word left once string
    literals, label matchers, ranges and grouping clauses are gone that is not a
    function call or a keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\w+", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    words = re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b(?!\s*\()", text)
    return set(words) - _PROMQL_WORDS


def test_queried_metrics_reads_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, operation) (rate(agents_cp_store_operation_seconds"
        '_bucket{job="agents-control", operation=~"get|put"}[5m]))) > bool 1e3'
    )
    assert _queried_metrics(expr) == {"agents_cp_store_operation_seconds_bucket"}
    other = "max(time() - a_timestamp offset 1h) or on (x) b"
    assert _queried_metrics(other) == {"a_timestamp", "b"}


def test_dashboard_queries_only_metrics_the_daemons_register() -> None:
    from tests.helpers.metric_names import control_registry, exposed_names, machine_registry

    registered = exposed_names(machine_registry()) | exposed_names(control_registry())
    dashboard = json.loads((DEPLOY / "grafana" / "agents.json").read_text())
    queried: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried.setdefault(panel["title"], set()).update(_queried_metrics(target["expr"]))
    assert all(queried.values()), f"a panel queries no metric: {queried}"
    missing = {
        title: sorted(names - registered - _PROMETHEUS_SERIES)
        for title, names in queried.items()
        if names - registered - _PROMETHEUS_SERIES
    }
    assert not missing, f"the dashboard queries metrics no daemon registers: {missing}"


# --- systemd ------------------------------------------------------------------


def _unit(name: str, text: str | None = None) -> dict[str, dict[str, list[str]]]:
    """Parse a unit file (``deploy/systemd/<name>``, or ``text``) into
    section -> key -> values (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    text = (UNITS / name).read_text() if text is None else text
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{name}: key outside a section: {line!r}"
        assert "=" in line, f"{name}: not key=value: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(unit: dict[str, dict[str, list[str]]], key: str) -> str:
    values = unit["Service"].get(key, [])
    assert len(values) == 1, f"{key}: expected one value, got {values}"
    return values[0]


@pytest.mark.parametrize("name", ["agents-control.service", "agents-machine.service"])
def test_unit_is_hardened(name: str) -> None:
    unit = _unit(name)
    assert set(unit) == {"Unit", "Service", "Install"}
    assert _one(unit, "User") not in ("", "root")
    assert _one(unit, "NoNewPrivileges") == "yes"
    assert _one(unit, "ProtectSystem") == "strict"
    assert _one(unit, "PrivateTmp") == "yes"
    assert _one(unit, "Restart") == "on-failure"
    assert _one(unit, "KillSignal") == "SIGTERM"
    assert _one(unit, "UMask") == "0077"
    assert _one(unit, "CapabilityBoundingSet") == ""
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    argv = shlex.split(_one(unit, "ExecStart"))
    assert "serve" in argv
    writable = _one(unit, "ReadWritePaths").split()
    data = argv[argv.index("--home" if "control" in name else "--data-dir") + 1]
    assert any(data == w or data.startswith(w.rstrip("/") + "/") for w in writable), (
        f"{name}: data folder {data} is not under ReadWritePaths {writable}"
    )


#: The unit ``agents-machine join --install-service`` writes, checked beside deploy/'s.
JOIN_UNIT = "agents-machine-join.service"


def _join_unit_text() -> str:
    from machine.cli.service_unit import render_unit

    return render_unit(executable=VENV_BIN / "agents-machine", data_dir=Path("/srv/agents"))


@pytest.mark.parametrize("name", ["agents-control.service", "agents-machine.service", JOIN_UNIT])
def test_unit_waits_for_ready_and_has_a_watchdog(name: str) -> None:
    unit = _unit(name, _join_unit_text() if name == JOIN_UNIT else None)
    # The daemons send READY=1, STOPPING=1 and WATCHDOG=1 (shared/sd_notify.py)
    # from their main process, and ping every 15 s.
    assert _one(unit, "Type") == "notify"
    assert _one(unit, "NotifyAccess") == "main"
    assert _one(unit, "WatchdogSec") == "30s"
    # The start ends at READY=1 and may read the whole store or database first.
    assert int(_one(unit, "TimeoutStartSec")) >= 120


def test_control_unit_runs_the_real_cli_and_leaves_time_to_drain() -> None:
    from controlplane.cli.main import build_parser

    unit = _unit("agents-control.service")
    argv = shlex.split(_one(unit, "ExecStart"))
    assert Path(argv[0]).name == "agents-control"
    args = build_parser().parse_args(argv[1:])
    assert args.cmd == "serve"
    assert str(args.home) == "/var/lib/agents-control"
    # /metrics comes from config.toml (init writes the default): no flag overrides it.
    assert args.metrics_listen is None
    assert unit["Service"]["StateDirectory"] == ["agents-control"]
    # run_daemon drains for 10 s on the first SIGTERM; SIGKILL must come later.
    assert int(_one(unit, "TimeoutStopSec")) >= 20


def test_machine_unit_runs_the_real_cli_and_leaves_time_to_drain() -> None:
    from machine.cli import main as cli

    unit = _unit("agents-machine.service")
    argv = shlex.split(_one(unit, "ExecStart"))
    assert Path(argv[0]).name == "agents-machine"
    # machine.cli.main exposes no public parser; its private one is the real command line.
    args = cli._parser().parse_args(argv[1:])
    assert args.command == "serve"
    assert args.data_dir.endswith("/.agents-server/root")
    assert args.metrics == SERVICE_METRICS_ADDRESS
    # Runs get --grace seconds after the first SIGTERM; then the database and
    # link close. SIGKILL (after TimeoutStopSec) must not cut that short.
    assert int(_one(unit, "TimeoutStopSec")) >= args.grace + 15


@pytest.fixture
def installable_units(tmp_path: Path) -> Iterator[Path]:
    """Copies of the units whose ExecStart points at this venv's real scripts
    (systemd-analyze checks that the command exists and is executable), and the
    unit ``join --install-service`` writes."""
    for unit in UNITS.glob("*.service"):
        text = unit.read_text().replace("/usr/local/bin/", f"{VENV_BIN}/")
        (tmp_path / unit.name).write_text(text)
    (tmp_path / JOIN_UNIT).write_text(_join_unit_text())
    yield tmp_path


def test_units_pass_systemd_analyze_verify(installable_units: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed; test_unit_is_hardened covers the syntax")
    units = sorted(str(p) for p in installable_units.glob("*.service"))
    assert len(units) == 3
    done = _run([analyze, "verify", *units], cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # Warnings (unknown keys, bad values) do not change the exit code: reject them.
    for unit in units:
        assert Path(unit).name not in out, out


#: ``systemd-analyze security`` exposure of each unit (0.0 safest, 10.0 least safe)
#: as measured when the units became Type=notify (systemd 252; the same as before
#: it): a change may lower it, never raise it. The machine's units are looser on
#: purpose (deploy/README.md, hardening); the unit join writes leaves the file
#: system and the account's powers alone (it knows neither): 7.0, was 9.4.
EXPOSURE_CEILING = {
    "agents-control.service": 1.7,
    "agents-machine.service": 4.2,
    JOIN_UNIT: 7.0,
}


def test_units_are_no_more_exposed_than_before(installable_units: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed; test_unit_is_hardened covers the basics")
    units = sorted(installable_units.glob("*.service"))
    assert {u.name for u in units} == set(EXPOSURE_CEILING)
    for unit in units:
        # --offline: read the file alone, no running systemd needed.
        done = _run([analyze, "security", "--offline=true", "--no-pager", str(unit)], cwd=tmp_path)
        out = done.stdout + done.stderr
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert found, out
        assert float(found.group(1)) <= EXPOSURE_CEILING[unit.name], out
