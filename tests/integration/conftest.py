"""Integration fixtures: real daemon processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.machine_proc import MachineProc
from tests.helpers.nats_proc import NatsProc, nats_server


@pytest.fixture
def machine_proc(tmp_path: Path) -> Iterator[Callable[..., MachineProc]]:
    """Factory: ``machine_proc(*serve_args)`` makes a (not yet started) daemon on
    ``tmp_path/data``; every process it made is killed at teardown."""
    made: list[MachineProc] = []

    def make(*extra_args: str) -> MachineProc:
        proc = MachineProc(tmp_path / "data", *extra_args)
        made.append(proc)
        return proc

    try:
        yield make
    finally:
        for proc in made:
            proc.kill()


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsProc]:
    """A real nats-server with JetStream (tests.helpers.nats_proc), stopped at
    teardown; the replicas' tests (tests.helpers.replicas) run on it."""
    with nats_server(tmp_path / "nats") as proc:
        yield proc
