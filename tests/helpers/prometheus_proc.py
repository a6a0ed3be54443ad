"""Run the real ``prometheus`` binary as a subprocess for integration tests.

Usage::

    jobs = [ScrapeJob("agents-control", ("127.0.0.1:9470",))]
    with PrometheusProc(tmp_path / "prom", jobs) as prom:
        prom.wait_for('up{job="agents-control"} == 1', deadline=10)

The helper writes a ``prometheus.yml`` (1 s scrape interval, static targets)
into a temp folder, keeps the TSDB there too, listens on a free loopback port,
waits with a deadline until ``/-/ready`` answers, and at teardown sends
SIGTERM, waits with a deadline and kills. Queries go through the HTTP API
(``/api/v1/query``) with urllib. The binary comes from the Debian package
``prometheus`` (``apt-get install -y prometheus``).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.helpers.poll import poll_until

__all__ = [
    "PrometheusError",
    "PrometheusProc",
    "ScrapeJob",
    "Series",
    "prometheus_binary",
]

logger = logging.getLogger(__name__)

START_DEADLINE = 20.0
STOP_DEADLINE = 10.0
HTTP_TIMEOUT = 5.0


class PrometheusError(RuntimeError):
    """Prometheus did not start, or a query failed (the message says which)."""


@dataclass(frozen=True)
class ScrapeJob:
    """One scrape job: a name (the ``job`` label) and its ``host:port`` targets."""

    name: str
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Series:
    """One element of an instant-vector result."""

    labels: dict[str, str]
    value: float


def prometheus_binary() -> str | None:
    """Path of the ``prometheus`` server binary, or None when it is not installed."""
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render_config(jobs: Sequence[ScrapeJob], scrape_interval: str = "1s") -> str:
    """A minimal prometheus.yml scraping ``jobs`` (JSON is valid YAML: no quoting worries)."""
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": scrape_interval,
        },
        "scrape_configs": [
            {"job_name": job.name, "static_configs": [{"targets": list(job.targets)}]}
            for job in jobs
        ],
    }
    return json.dumps(config, indent=2) + "\n"


class PrometheusProc:
    """One Prometheus server over a temp folder; a context manager that kills it at exit."""

    def __init__(
        self, workdir: Path, jobs: Sequence[ScrapeJob], scrape_interval: str = "1s"
    ) -> None:
        self.workdir = workdir
        self.jobs = tuple(jobs)
        self.scrape_interval = scrape_interval
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        """Base URL of the HTTP API."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusProc:
        """Write the config, start the server and wait (deadline) until it is ready."""
        binary = prometheus_binary()
        if binary is None:
            raise PrometheusError("prometheus not found: apt-get install -y prometheus")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(render_config(self.jobs, self.scrape_interval))
        self.port = _free_port()
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {proc.returncode}:\n{self.log()}")
            return self._ready()

        def not_ready() -> PrometheusError:
            self.kill()
            return PrometheusError(f"prometheus not ready within {START_DEADLINE}s:\n{self.log()}")

        poll_until(ready, deadline=START_DEADLINE, what="prometheus", step=0.1, fail=not_ready)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False

    def log(self) -> str:
        """Prometheus's output so far (its last 4000 characters)."""
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def api(self, path: str, params: dict[str, str]) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data`` (raise PrometheusError otherwise)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as e:  # a bad query answers 400 with a JSON error
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[Series]:
        """Evaluate an instant-vector PromQL expression now."""
        data = self.api("query", {"query": expr})
        if data["resultType"] != "vector":
            raise PrometheusError(f"query {expr!r}: expected a vector, got {data['resultType']}")
        return [Series(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]

    def series(self, match: str) -> list[dict[str, str]]:
        """Label sets of every stored series matching the selector ``match``."""
        return [dict(s) for s in self.api("series", {"match[]": match})]

    def wait_for(
        self,
        expr: str,
        deadline: float,
        check: Callable[[list[Series]], bool] = bool,
    ) -> list[Series]:
        """Poll ``expr`` until ``check(result)`` holds (default: non-empty); return it.

        A comparison such as ``x == 1`` filters the vector, so "non-empty" means
        "true". Raises AssertionError naming the expression and its last result.
        """
        last: list[list[Series]] = [[]]

        def holds() -> bool:
            last[0] = self.query(expr)
            return check(last[0])

        def failed() -> AssertionError:
            return AssertionError(f"PromQL {expr!r} not true within {deadline}s; last: {last[0]}")

        poll_until(holds, deadline=deadline, what=expr, step=0.2, fail=failed)
        return last[0]

    def stop(self) -> None:
        """SIGTERM, wait with a deadline, then kill."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_DEADLINE)
            except subprocess.TimeoutExpired:
                logger.warning("prometheus ignored SIGTERM for %ss: killing it", STOP_DEADLINE)
        self.kill()

    def kill(self) -> None:
        """SIGKILL and reap (no-op once it has exited)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_DEADLINE)
        self.proc = None

    def __enter__(self) -> PrometheusProc:
        try:
            return self.start()
        except BaseException:
            self.kill()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
