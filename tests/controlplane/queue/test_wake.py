"""ScheduleWaker with in-process fakes: who is woken for a schedule, and when."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

import pytest

from controlplane.integrity.records import Machine
from controlplane.machines.presence import MachineStatus
from controlplane.queue.wake import ScheduleWaker
from shared.errors import StoreMisconfigured
from shared.ids import new_id
from tests.helpers.poll import apoll_until

NOW = dt.datetime(2026, 6, 1, 12, tzinfo=dt.UTC)


def _machine(revoked: bool = False) -> Machine:
    return Machine(
        machine_id=new_id("machine"),
        account_id=new_id("account"),
        name="m",
        hostname="h",
        version="1",
        joined_at=NOW,
        cert_serial="01",
        cert_not_after=NOW + dt.timedelta(days=30),
        revoked=revoked,
    )


class _Fleet:
    def __init__(self, machines: list[Machine]) -> None:
        self._machines = machines

    async def machines(self) -> list[Machine]:
        return self._machines


class _Presence:
    def __init__(self, fires: dict[str, dt.datetime | None], online: set[str]) -> None:
        self.fires = fires
        self.linked = online

    def session(self, machine_id: str) -> object | None:
        return object() if machine_id in self.linked else None

    def online(self, machine_id: str) -> bool:
        return machine_id in self.linked

    async def status(self, m: Machine) -> MachineStatus:
        return MachineStatus(m, False, NOW, "1", 1, self.fires.get(m.machine_id))


class _Starter:
    def __init__(self, providers: set[str], waiting: set[str] | None = None) -> None:
        self.providers = providers
        self.waiting = waiting or set()
        self.asked: list[str] = []

    async def has_provider(self, account_id: str, machine_id: str) -> bool:
        return machine_id in self.providers

    def try_request(self, account_id: str, machine_id: str) -> bool:
        self.asked.append(machine_id)
        return True

    async def start_if_waiting(self, machine: Machine) -> bool:
        if machine.machine_id in self.providers and machine.machine_id in self.waiting:
            return self.try_request(machine.account_id, machine.machine_id)
        return False


async def test_wakes_only_offline_machines_with_a_provider_and_a_fire_due() -> None:
    due, later, online, no_provider, none = (_machine() for _ in range(5))
    revoked = _machine(revoked=True)
    everyone = [due, later, online, no_provider, none, revoked]
    fires = {
        due.machine_id: NOW + dt.timedelta(seconds=60),  # within the 120 s lead
        later.machine_id: NOW + dt.timedelta(seconds=600),
        online.machine_id: NOW + dt.timedelta(seconds=10),
        no_provider.machine_id: NOW + dt.timedelta(seconds=10),
        none.machine_id: None,
        revoked.machine_id: NOW,
    }
    starter = _Starter({m.machine_id for m in everyone if m is not no_provider})
    wakes: list[int] = []
    waker = ScheduleWaker(
        _Fleet(everyone),  # type: ignore[arg-type]
        _Presence(fires, {online.machine_id}),  # type: ignore[arg-type]
        starter,  # type: ignore[arg-type]
        lead=120,
        interval=1,
        clock=lambda: NOW,
        on_wake=lambda: wakes.append(1),
    )
    assert await waker.check() == [due.machine_id]
    assert starter.asked == [due.machine_id] and len(wakes) == 1
    status = MachineStatus(later, False, NOW, "1", 1, fires[later.machine_id])
    assert waker.wake_at(status) == NOW + dt.timedelta(seconds=480)
    assert waker.wake_at(MachineStatus(none, False, NOW, "1", 1, None)) is None


async def test_a_fire_time_that_passed_wakes_nothing() -> None:
    """A next fire time in the past (a presence record left from long ago, or an
    older copy put back by a bucket writer) starts nothing: the fire is missed
    already; before, the machine was started at every check."""
    stale = _machine()
    starter = _Starter({stale.machine_id})
    waker = ScheduleWaker(
        _Fleet([stale]),  # type: ignore[arg-type]
        _Presence({stale.machine_id: NOW - dt.timedelta(days=3)}, set()),  # type: ignore[arg-type]
        starter,  # type: ignore[arg-type]
        lead=120,
        interval=1,
        clock=lambda: NOW,
    )
    assert await waker.check() == []
    assert starter.asked == []


async def test_offline_machines_whose_prompts_wait_are_asked_for_too() -> None:
    """Issue 34: prompts waiting for an offline machine start it at the next check,
    not only at a send (a start that failed, or a machine that stopped again)."""
    waits, online, idle, scheduled = (_machine() for _ in range(4))
    everyone = [waits, online, idle, scheduled]
    starter = _Starter(
        {m.machine_id for m in everyone}, waiting={waits.machine_id, online.machine_id}
    )
    wakes: list[int] = []
    waker = ScheduleWaker(
        _Fleet(everyone),  # type: ignore[arg-type]
        _Presence({scheduled.machine_id: NOW + dt.timedelta(seconds=60)}, {online.machine_id}),  # type: ignore[arg-type]
        starter,  # type: ignore[arg-type]
        lead=120,
        interval=1,
        clock=lambda: NOW,
        on_wake=lambda: wakes.append(1),
    )
    assert sorted(await waker.check()) == sorted([waits.machine_id, scheduled.machine_id])
    assert len(wakes) == 1  # the schedule's wake; the prompts' start is counted by the starter


class _GoneFleet:
    """A fleet whose store is gone until ``back`` is set."""

    def __init__(self) -> None:
        self.back = False
        self.calls = 0

    async def machines(self) -> list[Machine]:
        self.calls += 1
        if not self.back:
            raise StoreMisconfigured(
                "store s3://b/cp/: list index/accounts/: the bucket does not exist (NoSuchBucket)"
            )
        return []


async def test_a_store_gone_is_one_warning_without_a_traceback_then_one_recovery_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 34: every check logged a traceback while the bucket was gone."""
    caplog.set_level(logging.INFO, "controlplane.queue.wake")
    fleet = _GoneFleet()
    waker = ScheduleWaker(
        fleet,  # type: ignore[arg-type]
        _Presence({}, set()),  # type: ignore[arg-type]
        _Starter(set()),  # type: ignore[arg-type]
        lead=120,
        interval=0.01,
        clock=lambda: NOW,
    )
    task = asyncio.create_task(waker.run())
    try:
        await apoll_until(lambda: fleet.calls >= 5, deadline=10, what="five failed checks")
        fleet.back = True
        await apoll_until(
            lambda: any("works again" in r.getMessage() for r in caplog.records),
            deadline=10,
            what="the recovery line",
        )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    lines = [r for r in caplog.records if r.name == "controlplane.queue.wake"]
    warnings = [r for r in lines if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "checking machines to wake:" in warnings[0].getMessage()
    assert "NoSuchBucket" in warnings[0].getMessage()
    assert [r.getMessage().split(" (")[0] for r in lines if r.levelno == logging.INFO] == [
        "checking machines to wake: works again"
    ]
