"""AgentsService.configure: an agent's runtime settings replaced, checked as create
checks them, and used by its next run (the acp runtime restarts its program)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.models import AgentRecord, AgentState, EventKind
from machine.storage import tables
from shared.errors import InvalidArgument, InvalidState, NotFound
from shared.ids import new_id

FAKE_AGENT = Path(__file__).resolve().parents[2] / "helpers" / "fake_acp_agent.py"
DEADLINE = 15.0


def _config(root: Path) -> MachineConfig:
    return MachineConfig(data_dir=root, background_loops=False, shutdown_grace_seconds=0).validate()


async def _prompt(m: Machine, agent_id: str, text: str) -> EventKind:
    last = EventKind.RUN_STARTED
    async for ev in await m.runs.prompt(agent_id, text):
        last = ev.kind
    return last


async def test_configure_replaces_checked_settings(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = await m.agents.create(name="a", folder=str(tmp_path))
        done = await m.agents.configure(agent.id, '{"delay_ms": 3}')
        assert done.settings == {"delay_ms": 3}
        assert done.updated_at >= agent.updated_at
        assert (await m.agents.get(agent.id)).settings == {"delay_ms": 3}
        # Archived: allowed (a restored agent's withheld values go back before it runs).
        await m.agents.archive(agent.id)
        assert (await m.agents.configure(agent.id, "")).settings == {}

        for bad, reason in [
            ("{not json", "not valid JSON"),
            ("[1]", "must be a JSON object"),
            ('{"colour": 1}', "unknown echo setting 'colour'"),
            ('{"delay_ms": -1}', "delay_ms must be 0 to"),
        ]:
            with pytest.raises(InvalidArgument) as err:
                await m.agents.configure(agent.id, bad)
            assert err.value.field == "settings_json" and reason in err.value.reason
        assert (await m.agents.get(agent.id)).settings == {}  # nothing half-written

        with pytest.raises(NotFound):
            await m.agents.configure(new_id("agent"), "{}")
        with pytest.raises(InvalidArgument) as bad_id:
            await m.agents.configure("ag_../x", "{}")
        assert bad_id.value.field == "agent_id"


async def test_an_agent_of_another_machine_cannot_be_configured(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        foreign = AgentRecord(
            id=new_id("agent"),
            name="f",
            folder=str(tmp_path),
            runtime="echo",
            settings={},
            state=AgentState.ARCHIVED,
            origin_machine=new_id("machine"),
            local=False,
            session_id=None,
            created_at=1.0,
            updated_at=1.0,
            last_seq=0,
        )
        await m.db.write(lambda c: tables.insert_agent(c, foreign))
        with pytest.raises(InvalidState, match="it can only be read"):
            await m.agents.configure(foreign.id, '{"delay_ms": 1}')


def _fake_events(state: Path) -> list[dict[str, Any]]:
    path = state / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_the_next_run_uses_the_new_settings(tmp_path: Path) -> None:
    """The acp runtime compares each run's settings with its program's: new ones
    restart it, so an env value set back reaches the agent program."""
    state = tmp_path / "fake"
    command = [sys.executable, str(FAKE_AGENT), "--state-dir", str(state)]
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = await m.agents.create(
            name="a",
            folder=str(tmp_path),
            runtime="acp",
            settings_json=json.dumps({"command": command, "kind": "generic"}),
        )
        assert await asyncio.wait_for(_prompt(m, agent.id, "one"), DEADLINE) is (
            EventKind.RUN_FINISHED
        )
        settings = {"command": command, "env": {"FAKE_AGENT_TOKEN": "tok"}, "kind": "generic"}
        await m.agents.configure(agent.id, json.dumps(settings))
        assert await asyncio.wait_for(_prompt(m, agent.id, "two"), DEADLINE) is (
            EventKind.RUN_FINISHED
        )
    starts = [e["has_token"] for e in _fake_events(state) if e["event"] == "initialize"]
    assert starts == [False, True]
