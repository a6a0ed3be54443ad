"""Integration fixtures: real daemon processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.machine_proc import MachineProc


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
