"""agents-machine --json: every listing verb, against a daemon in this process,
prints the one style of docs/cli-json.md."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import pytest

from machine.cli.main import main
from machine.config import MachineConfig
from tests.helpers.json_style import assert_json_style, assert_listing


async def _json(
    capsys: pytest.CaptureFixture[str], cfg: MachineConfig, *argv: str, first: bool = False
) -> list[object]:
    """The JSON lines ``argv`` prints; ``first``: --json before the command."""
    where = ["--data-dir", str(cfg.data_dir)]
    words = ["--json", *where, *argv] if first else [*where, *argv, "--json"]
    code = await asyncio.to_thread(main, words)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err == ""  # no progress, no notes under --json
    return [json.loads(line) for line in out.splitlines()]


async def test_listings_and_records_share_one_style(
    daemon: MachineConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    [made] = await _json(capsys, daemon, "agent", "create", "a", "--folder", str(tmp_path))
    assert isinstance(made, dict) and made["state"] == "active"
    assert_json_style(made)
    agent = str(made["agent_id"])

    events = await _json(capsys, daemon, "agent", "prompt", agent, "hello")
    for ev in events:
        assert_json_style(ev)
    kinds = [ev["kind"] for ev in events if isinstance(ev, dict)]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished", kinds

    [sched] = await _json(
        capsys, daemon, "schedule", "add", agent, "--cron", "0 7 * * *", "--text", "hi"
    )
    assert_json_style(sched)

    [listed] = await _json(capsys, daemon, "agent", "list", first=True)
    assert [a["agent_id"] for a in assert_listing(listed, "agents")] == [agent]
    [runs] = await _json(capsys, daemon, "agent", "runs", agent)
    [run] = assert_listing(runs, "runs")
    assert run["state"] == "finished" and run["agent_id"] == agent and run["run_id"]
    [schedules] = await _json(capsys, daemon, "schedule", "list")
    [one] = assert_listing(schedules, "schedules")
    [fires] = await _json(capsys, daemon, "schedule", "runs", one["schedule_id"])
    assert assert_listing(fires, "runs") == []
    [erasures] = await _json(capsys, daemon, "agent", "erasures")
    assert assert_listing(erasures, "erasures") == []
    [status] = await _json(capsys, daemon, "status")
    assert_json_style(status)


class Terminal(io.StringIO):
    """stderr as a terminal: what is written to it is kept."""

    def isatty(self) -> bool:
        return True


async def test_long_verbs_show_progress_on_a_terminal_only_without_json(
    daemon: MachineConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = ["--data-dir", str(daemon.data_dir)]
    made = await asyncio.to_thread(
        main, [*where, "agent", "create", "a", "--folder", str(tmp_path), "--json"]
    )
    assert made == 0
    seen: list[str] = []
    cases = ((Terminal(), []), (Terminal(), ["--json"]), (io.StringIO(), []))
    for n, (stderr, json_flag) in enumerate(cases):
        monkeypatch.setattr(sys, "stderr", stderr)
        archive = tmp_path / f"out{n}.tar.gz"
        exported = await asyncio.to_thread(
            main, [*where, "export", "--folder", str(tmp_path), "-o", str(archive), *json_flag]
        )
        imported = await asyncio.to_thread(main, [*where, "import", str(archive), *json_flag])
        assert (exported, imported) == (0, 0), stderr.getvalue()
        seen.append(stderr.getvalue())
    assert "exporting" in seen[0] and "importing" in seen[0]
    assert seen[1] == ""  # --json: nothing on stderr, even at a terminal
    assert seen[2] == ""  # a pipe or a file: nothing either
