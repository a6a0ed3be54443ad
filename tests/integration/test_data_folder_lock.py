"""A second ``agents-machine serve`` on a data folder a daemon is serving is
refused (one line naming the first one, exit code 2), touches nothing, and the
first daemon goes on serving (machine.daemon: the data folder's lock)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from tests.helpers.machine_proc import MachineProc, run_cli

pytestmark = pytest.mark.integration


def _prompt(proc: MachineProc, agent_id: str, text: str) -> list[int]:
    with grpc.insecure_channel(proc.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        events = stub.Prompt(pb.PromptRequest(agent_id=agent_id, text=text), timeout=20)
        return [e.kind for e in events]


def test_a_second_serve_on_one_data_folder_is_refused_and_the_first_keeps_serving(
    machine_proc: Callable[..., MachineProc], tmp_path: Path
) -> None:
    first = machine_proc().start()
    assert first.proc is not None
    with grpc.insecure_channel(first.target) as channel:
        stub = pb_grpc.MachineServiceStub(channel)
        agent = stub.CreateAgent(pb.CreateAgentRequest(name="a", folder=str(tmp_path)), timeout=20)
    assert _prompt(first, agent.id, "before")[-1] == pb.RUN_FINISHED
    socket_inode = os.stat(first.socket).st_ino

    second = run_cli(first.data_dir, "serve", "--no-background", "--grace", "1")

    assert second.returncode == 2, (second.stdout, second.stderr)
    assert second.stdout == ""
    assert second.stderr.strip() == (
        f"agents-machine: serve {first.data_dir}: another agents-machine "
        f"(pid {first.proc.pid}) is already using this data folder"
    ), second.stderr
    assert "Traceback" not in second.stderr
    # The second touched nothing of the first's: its socket, its lock, its answers.
    assert first.proc.poll() is None
    assert os.stat(first.socket).st_ino == socket_inode
    assert (first.data_dir / "machine.lock").read_text().strip() == str(first.proc.pid)
    assert first.healthy()
    assert _prompt(first, agent.id, "after")[-1] == pb.RUN_FINISHED
    assert first.stop() == 0
