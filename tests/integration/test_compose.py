"""deploy/compose.yaml works as written: its services' own commands, run in the
order depends_on gives against local processes (tests/helpers/compose.py says
what stands in for Docker), make a bucket on moto's server, a control plane
sealed to a recovery key, and a machine joined with the printed command that
comes online; restarted, the machine serves without joining again."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.compose import LocalStack, load_compose
from tests.helpers.poll import poll_until
from tests.helpers.processes import stop_process

pytestmark = pytest.mark.integration

STEP_DEADLINE = 90.0
ONLINE_DEADLINE = 60.0


@pytest.mark.timeout(300)
def test_compose_up(tmp_path: Path) -> None:  # a short name: the machine's socket path
    # The shell that runs `docker compose`: no store or credentials of its own,
    # so the file's defaults (moto, demo keys) apply.
    host_env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTS_", "AWS_"))}
    stack = LocalStack(load_compose(), tmp_path, host_env)
    running: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"{name}.log" for name in stack.order}

    def output() -> str:
        return "\n".join(f"--- {n}:\n{logs[n].read_text()}" for n in running if logs[n].exists())

    def machines() -> list[dict[str, object]]:
        env = dict(stack.service("control").env)
        env["AGENTS_CONTROL_CREDENTIAL"] = (
            (stack.volume("operator") / "init.out").read_text().splitlines()[0]
        )
        done = subprocess.run(
            ["agents-control", "machine", "list", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr + output()
        listed: list[dict[str, object]] = json.loads(done.stdout)["machines"]
        return listed

    def online(want: bool) -> bool:
        if want and running["machine"].poll() is not None:
            raise AssertionError(f"the machine exited {running['machine'].returncode}:\n{output()}")
        listed = machines()
        return len(listed) == 1 and listed[0]["online"] is want

    def wait_online(what: str) -> None:
        poll_until(
            lambda: online(True),
            deadline=ONLINE_DEADLINE,
            step=0.5,
            what=f"{what} online",
            fail=lambda: AssertionError(f"{what} is not online:\n{output()}"),
        )

    try:
        for name in stack.order:
            service = stack.service(name)
            if service.one_shot:
                done = stack.run(service, timeout=STEP_DEADLINE)
                assert done.returncode == 0, (
                    f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n{output()}"
                )
            else:
                running[name] = stack.start(service, logs[name])
        wait_online("the joined machine")
        assert (stack.volume("operator") / "recovery.key").stat().st_mode & 0o077 == 0
        # A restart (restart: on-failure, or `docker compose restart machine`) runs
        # the same command on the joined folder: it serves. (Joining again with
        # the used token would be refused, and the machine would stay offline.)
        stop_process(running["machine"])
        assert running["machine"].returncode == 0, output()
        poll_until(lambda: online(False), deadline=ONLINE_DEADLINE, step=0.5, what="offline")
        running["machine"] = stack.start(stack.service("machine"), logs["machine"])
        wait_online("the restarted machine")
    finally:
        for proc in reversed(running.values()):
            stop_process(proc)
