"""The machine reads "now" from the clock open_machine was given."""

from __future__ import annotations

from machine.app import open_machine
from machine.config import MachineConfig


async def test_status_reports_the_start_by_the_injected_clock(
    machine_config: MachineConfig,
) -> None:
    async with open_machine(machine_config, clock=lambda: 1_800_000_000.5) as machine:
        assert (await machine.status()).started_at == 1_800_000_000.5
