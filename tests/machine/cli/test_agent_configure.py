"""UpdateAgentSettings through a real daemon (client and ``agent configure``), and
how a restore or an import names the agents that came without their settings."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import pytest

from machine.api import codec
from machine.backups.transfer import InResult, SettingsNote
from machine.cli.backup import agent_settings_lines
from machine.cli.client import MachineClient
from machine.cli.main import main
from machine.config import MachineConfig
from shared.errors import InvalidArgument, NotFound
from shared.ids import new_id


async def test_the_rpc_replaces_settings_and_names_what_is_wrong(
    daemon: MachineConfig, tmp_path: Path
) -> None:
    async with MachineClient(daemon) as client:
        agent = await client.create_agent("a", str(tmp_path))
        done = await client.configure_agent(agent.id, '{"delay_ms": 7}')
        assert done.id == agent.id and done.settings == {"delay_ms": 7}
        assert (await client.get_agent(agent.id)).settings == {"delay_ms": 7}
        with pytest.raises(InvalidArgument) as bad_json:
            await client.configure_agent(agent.id, '{"delay_ms": ')
        assert bad_json.value.field == "settings_json"
        assert "not valid JSON" in bad_json.value.reason
        with pytest.raises(InvalidArgument) as unknown:
            await client.configure_agent(agent.id, '{"model": "x"}')
        assert "unknown echo setting 'model'" in unknown.value.reason
        with pytest.raises(NotFound):
            await client.configure_agent(new_id("agent"), "{}")
        assert (await client.get_agent(agent.id)).settings == {"delay_ms": 7}


async def _cli(
    capsys: pytest.CaptureFixture[str], cfg: MachineConfig, *argv: str
) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["--data-dir", str(cfg.data_dir), *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_agent_configure_from_an_argument_or_stdin(
    daemon: MachineConfig,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with MachineClient(daemon) as client:
        agent = await client.create_agent("a", str(tmp_path))
    code, out, _ = await _cli(
        capsys, daemon, "agent", "configure", agent.id, "--settings", '{"delay_ms": 1}'
    )
    assert code == 0 and out == f"{agent.id}: settings replaced; its next run uses them\n"

    stdin = io.TextIOWrapper(io.BytesIO(b'{"delay_ms": 2}'))
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, _ = await _cli(
        capsys, daemon, "agent", "configure", agent.id, "--settings", "-", "--json"
    )
    assert code == 0 and json.loads(out)["settings_json"] == '{"delay_ms": 2}'

    code, out, err = await _cli(
        capsys, daemon, "agent", "configure", agent.id, "--settings", "{nope"
    )
    assert code == 2 and out == ""
    assert err.count("\n") <= 2 and "settings_json: not valid JSON" in err
    assert "Traceback" not in err
    code, _, err = await _cli(capsys, daemon, "agent", "configure", agent.id)
    assert code == 2 and "--settings" in err


def test_withheld_settings_are_named_one_line_each() -> None:
    notes = [
        SettingsNote("ag_a", ("env.ANTHROPIC_API_KEY",)),
        SettingsNote("ag_b", ("env.A", "env.B")),
        SettingsNote("ag_c", (), "its settings were not restored (runtime: unknown runtime 'x')"),
    ]
    assert agent_settings_lines("agents-machine", notes) == [
        "ag_a: env ANTHROPIC_API_KEY withheld; set it with"
        " `agents-machine agent configure ag_a --settings …`",
        "ag_b: env A, env B withheld; set them with"
        " `agents-machine agent configure ag_b --settings …`",
        "ag_c: its settings were not restored (runtime: unknown runtime 'x'); set them with"
        " `agents-machine agent configure ag_c --settings …`",
    ]


def test_the_notes_travel_in_import_and_restore_replies() -> None:
    result = InResult(("ag_a",), agent_settings=(SettingsNote("ag_a", ("env.K",), ""),))
    assert codec.in_result_from_pb(codec.in_result_to_pb(result)) == result
    assert codec.in_result_from_pb(codec.restore_result_to_pb(result)) == result
