"""Run ``agents-machine serve`` as a real subprocess on a temp data folder.

``MachineProc.start()`` launches the daemon (``.venv/bin/agents-machine``),
waits with a deadline until its gRPC health check answers SERVING on the
Unix socket (``launch()`` does not wait), and ``stop()`` / ``kill()`` end it,
always waiting with a deadline. Use it as a context manager so teardown kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.poll import poll_until

__all__ = ["AGENTS_MACHINE", "SYSTEMD_NOTIFY_VARIABLES", "MachineProc", "machine_env", "run_cli"]

AGENTS_MACHINE = Path(sys.executable).parent / "agents-machine"
START_DEADLINE = 20.0
STOP_DEADLINE = 15.0


#: What systemd gives a Type=notify unit: a test's daemon never notifies the
#: service manager the test runner may run under (tests set their own).
SYSTEMD_NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENTS_") and k not in SYSTEMD_NOTIFY_VARIABLES
    }
    env.update(extra or {})
    return env


def machine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a test's agents-machine process gets: ours without any
    ``AGENTS_*`` setting or systemd's notify variables, plus ``extra``."""
    return _env(extra)


def run_cli(
    data_dir: Path,
    *args: str,
    timeout: float = 30.0,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``agents-machine --data-dir DATA ARGS...`` and capture its output
    (``env``: variables added to the environment, e.g. a temporary HOME)."""
    return subprocess.run(
        [str(AGENTS_MACHINE), "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        env=_env(env),
        check=False,
    )


class MachineProc:
    """One daemon process over one data folder (restartable)."""

    def __init__(self, data_dir: Path, *extra_args: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.extra_args = extra_args
        self.env = env  # added to the daemon's environment (e.g. a temporary HOME)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def socket(self) -> Path:
        """The daemon's Unix socket."""
        return self.data_dir / "machine.sock"

    @property
    def target(self) -> str:
        """gRPC target for the socket."""
        return f"unix://{self.socket}"

    def start(self) -> MachineProc:
        """Start the daemon and wait until it is healthy."""
        proc = self.launch()

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"agents-machine exited early:\n{self.log()}")
            return self.healthy()

        def unhealthy() -> RuntimeError:
            self.kill()
            return RuntimeError(f"agents-machine did not become healthy:\n{self.log()}")

        poll_until(up, deadline=START_DEADLINE, what="agents-machine", fail=unhealthy)
        return self

    def launch(self) -> subprocess.Popen[bytes]:
        """Start the daemon and return its process at once (``start`` waits)."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                str(AGENTS_MACHINE),
                "--data-dir",
                str(self.data_dir),
                "serve",
                "--no-background",
                "--grace",
                "2",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(self.env),
        )
        log.close()
        return self.proc

    def healthy(self) -> bool:
        """One health check on the socket (no retry): True when it answers SERVING."""
        if not self.socket.exists():
            return False
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def log(self) -> str:
        """The daemon's output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> int:
        """SIGTERM, then wait (with a deadline) for a clean exit; return its code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self.proc = None if self.proc.poll() is not None else self.proc

    def kill(self) -> None:
        """SIGKILL (a crash, or a failed teardown) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_DEADLINE)
        self.proc = None

    def __enter__(self) -> MachineProc:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
