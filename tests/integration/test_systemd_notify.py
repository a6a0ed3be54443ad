"""Both daemons under a stand-in for systemd: the notify protocol end to end.

Each test binds the socket systemd would (``NOTIFY_SOCKET``), asks for a watchdog
(``WATCHDOG_USEC``) and starts the real process. READY=1 must come only once the
daemon answers (one health check, no retry, made the moment READY=1 arrives,
succeeds), after the STATUS lines that name the start's steps, then WATCHDOG=1
again and again, and after SIGTERM STOPPING=1 from the daemon's own pid before a
clean exit.

What the check cannot see from outside: a READY=1 sent a few milliseconds before
gRPC's ``start()`` but after its listening socket exists. A client told "ready"
then still gets its answer (the kernel queues its connection), so that is no
harm; one sent before the listener exists fails the check.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.control_proc import ControlProc, run_init, start_serve, stop_serve
from tests.helpers.machine_proc import MachineProc
from tests.helpers.notify_socket import NotifySocket
from tests.helpers.poll import poll_until

pytestmark = pytest.mark.integration

DEADLINE = 20.0
#: 0.4 s: a ping every 0.2 s, so a few arrive within seconds.
WATCHDOG_USEC = "400000"
PINGS = 3


def _running(proc: subprocess.Popen[bytes], log: Callable[[], str]) -> Callable[[], None]:
    def check() -> None:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({proc.returncode}):\n{log()}")

    return check


def _until_ready(
    manager: NotifySocket, proc: subprocess.Popen[bytes], log: Callable[[], str]
) -> dict[str, str]:
    """READY=1's fields, once it came; every datagram before it only a start STATUS."""
    ready = manager.wait_for(
        lambda n: n.has("READY"), deadline=DEADLINE, what="READY=1", alive=_running(proc, log)
    )
    before = manager.received[: manager.index("READY")]
    assert before, "no STATUS line while starting"
    for n in before:
        assert set(n.fields) == {"STATUS"}, n.fields
        assert n.fields["STATUS"].startswith("starting: "), n.fields
    return ready.fields


def _statuses_before_ready(manager: NotifySocket) -> list[str]:
    return [n.fields["STATUS"] for n in manager.received[: manager.index("READY")]]


def _pings_then_stop(
    manager: NotifySocket, proc: subprocess.Popen[bytes], log: Callable[[], str]
) -> dict[str, str]:
    """WATCHDOG=1 repeatedly; then SIGTERM: STOPPING=1's fields, once the process
    exited cleanly."""
    running = _running(proc, log)

    def pinged() -> bool:
        running()
        return manager.count("WATCHDOG") >= PINGS

    poll_until(pinged, deadline=DEADLINE, what=f"{PINGS} watchdog pings")
    assert manager.index("WATCHDOG") > manager.index("READY")
    proc.send_signal(signal.SIGTERM)
    stopping = manager.wait_for(lambda n: n.has("STOPPING"), deadline=DEADLINE, what="STOPPING")
    assert proc.wait(timeout=DEADLINE) == 0, log()
    manager.receive()
    assert manager.index("STOPPING") > manager.index("READY")
    assert manager.count("READY") == 1
    # Every datagram, STOPPING=1 included, came from the daemon itself while it
    # ran (the kernel's credentials): what NotifyAccess=main accepts.
    assert {n.pid for n in manager.received} == {proc.pid}
    return stopping.fields


def test_machine_daemon_tells_systemd_ready_alive_and_stopping(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        daemon = MachineProc(
            tmp_path / "data",
            env={"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": WATCHDOG_USEC},
        )
        try:
            proc = daemon.launch()
            ready = _until_ready(manager, proc, daemon.log)
            assert daemon.healthy(), f"READY=1 before the socket answered:\n{daemon.log()}"
            assert ready["STATUS"] == f"serving on unix://{daemon.socket}"
            # Sent once machine.db is open, and before READY=1 (one sender's
            # datagrams keep their order).
            assert _statuses_before_ready(manager)[-1] == "starting: opening the listeners"
            stopping = _pings_then_stop(manager, proc, daemon.log)
            assert stopping["STATUS"] == "stopping: draining, runs get 2 s to end"
        finally:
            daemon.kill()


def _public_health(cp: ControlProc, port: int) -> int:
    """One health check on the public listener (TLS, no retry)."""
    creds = grpc.ssl_channel_credentials(cp.ca_pem)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def test_control_plane_tells_systemd_ready_alive_and_stopping(tmp_path: Path) -> None:
    cp = run_init(tmp_path / "home", str(tmp_path / "store"), {})
    with NotifySocket.bind(tmp_path / "notify") as manager:
        env = {"NOTIFY_SOCKET": manager.address, "WATCHDOG_USEC": WATCHDOG_USEC}
        try:
            start_serve(cp, env=env, wait=False)
            assert cp.process is not None and cp.log_path is not None
            proc, log_path = cp.process, cp.log_path
            ready = _until_ready(manager, proc, log_path.read_text)
            # The start is over: serve.json names this process, and the public
            # listener answers at once.
            serve_json = cp.home / "serve.json"
            assert serve_json.exists(), f"READY=1 before the start ended:\n{log_path.read_text()}"
            info = json.loads(serve_json.read_text())
            assert info["pid"] == proc.pid
            port = int(info["public"].rsplit(":", 1)[1])
            assert _public_health(cp, port) == health_pb2.HealthCheckResponse.SERVING
            link_port = int(info["link"].rsplit(":", 1)[1])
            assert ready["STATUS"] == f"serving: public port {port}, link port {link_port}"
            # The epoch is taken once the store was verified as this deployment's.
            statuses = _statuses_before_ready(manager)
            assert statuses.index("starting: taking the deployment epoch") > statuses.index(
                "starting: opening and verifying the store"
            )
            stopping = _pings_then_stop(manager, proc, log_path.read_text)
            assert stopping["STATUS"] == "stopping: draining for up to 10 s"
        finally:
            stop_serve(cp)
