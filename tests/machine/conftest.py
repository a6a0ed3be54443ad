"""Fixtures for the machine's unit tests: a config on a temp folder, an open machine,
a daemon served in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.daemon import ServeInfo, serve


@pytest.fixture
def machine_config(tmp_path: Path) -> MachineConfig:
    """A config on a fresh data folder, no background loops, no grace."""
    return MachineConfig(
        data_dir=tmp_path / "data",
        background_loops=False,
        shutdown_grace_seconds=0,
        attachment_limit=64 * 1024,
        prompt_limit=4096,
    ).validate()


@pytest.fixture
async def machine_app(machine_config: MachineConfig) -> AsyncIterator[Machine]:
    """An open machine (database, agents, run engine); closed afterwards."""
    async with open_machine(machine_config) as m:
        yield m


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[MachineConfig]:
    """A daemon served in this process on a temp data folder (its config)."""
    cfg = MachineConfig(
        data_dir=tmp_path / "d", background_loops=False, shutdown_grace_seconds=0
    ).validate()
    ready: asyncio.Future[ServeInfo] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, ready=ready.set_result, stop=stop))
    try:
        await asyncio.wait_for(ready, 10)
        yield cfg
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
