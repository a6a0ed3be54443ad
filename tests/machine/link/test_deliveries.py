"""Delivered prompts: opened with the box key, stored once per prompt id, run in
order per agent, started after a restart if acknowledged but never run."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.link.client import Delivery
from machine.link.deliveries import DeliveryHandler
from machine.models import RunState
from shared.crypto import BoxKeyPair, prompt_aad, seal_bytes
from shared.errors import InvalidArgument
from shared.ids import new_id
from tests.helpers.poll import apoll_until

DEADLINE = 10.0


def delivery(box: BoxKeyPair, agent_id: str, text: str, prompt_id: str = "") -> Delivery:
    pid = prompt_id or new_id("prompt")
    sealed = seal_bytes(text.encode(), [box.public_key], aad=prompt_aad(pid, agent_id))
    return Delivery(id=pid, agent_id=agent_id, sealed_prompt=sealed, created_at=None)


async def finished(m: Machine, run_id: str) -> bool:
    return (await m.runs.get_run(run_id)).state is RunState.FINISHED


async def test_redelivery_runs_once_and_order_is_kept(machine_app: Machine, tmp_path: Path) -> None:
    box = BoxKeyPair.generate()
    handle = DeliveryHandler(machine_app.runs, box)
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    sent = [delivery(box, agent, f"prompt {i}") for i in range(5)]
    acks = [await handle(d) for d in sent]
    assert all(a.run_id and not a.refused for a in acks)
    again = await handle(sent[2])  # the control plane crashed before deleting it
    assert again.run_id == acks[2].run_id
    for a in acks:
        await apoll_until(
            lambda a=a: finished(machine_app, a.run_id), deadline=DEADLINE, what="run"
        )
    runs = await machine_app.runs.list_runs(agent)
    assert len(runs) == 5
    by_start = sorted(runs, key=lambda r: r.started_at or 0)
    assert [r.prompt for r in by_start] == [f"prompt {i}" for i in range(5)]
    assert {r.prompt_id for r in runs} == {d.id for d in sent}


async def test_refusals_are_acknowledged_with_a_reason(
    machine_app: Machine, tmp_path: Path
) -> None:
    box = BoxKeyPair.generate()
    handle = DeliveryHandler(machine_app.runs, box)
    missing = await handle(delivery(box, new_id("agent"), "hi"))
    assert not missing.run_id and "not found" in missing.refused
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    await machine_app.agents.archive(agent)
    archived = await handle(delivery(box, agent, "hi"))
    assert "archived" in archived.refused
    await machine_app.agents.unarchive(agent)
    nul = await handle(delivery(box, agent, "a\0b"))
    assert "NUL" in nul.refused and not nul.run_id
    with pytest.raises(InvalidArgument, match="NUL"):
        await machine_app.runs.submit(agent, "a\0b")
    await machine_app.agents.archive(agent)
    other = BoxKeyPair.generate()
    unreadable = await handle(delivery(other, agent, "hi"))
    assert "cannot open" in unreadable.refused
    # Bound to its prompt id: a sealed prompt replayed under another id is refused.
    d = delivery(box, agent, "hi")
    moved = Delivery(new_id("prompt"), d.agent_id, d.sealed_prompt, None)
    assert "cannot open" in (await handle(moved)).refused
    # A malformed id, sealed to it all the same: refused for good, not failed (a
    # failure would have the link take it again and again, before any later prompt).
    for pid, aid in (("pr_../../x", agent), (new_id("prompt"), "ag_bad")):
        sealed = seal_bytes(b"hi", [box.public_key], aad=prompt_aad(pid, aid))
        bad = await handle(Delivery(id=pid, agent_id=aid, sealed_prompt=sealed, created_at=None))
        assert "malformed" in bad.refused and not bad.run_id
    assert await machine_app.runs.list_runs(agent) == []


async def test_acknowledged_but_unstarted_delivery_runs_after_restart(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    box = BoxKeyPair.generate()
    async with open_machine(machine_config) as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
    # A crash right after the run row committed: queued, never started.
    prompt_id, run_id = new_id("prompt"), new_id("run")
    conn = sqlite3.connect(machine_config.db_path)
    conn.execute(
        "INSERT INTO runs (id, agent_id, state, prompt, created_at, prompt_id)"
        " VALUES (?, ?, 'queued', 'later', 1, ?)",
        (run_id, agent, prompt_id),
    )
    conn.commit()
    conn.close()
    async with open_machine(machine_config) as m:
        await apoll_until(lambda: finished(m, run_id), deadline=DEADLINE, what="run")
        again = await DeliveryHandler(m.runs, box)(delivery(box, agent, "later", prompt_id))
        assert again.run_id == run_id
        assert len(await m.runs.list_runs(agent)) == 1
