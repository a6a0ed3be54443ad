"""machine.formats.backup_delta: an agent's delta dump merged onto its earlier files
gives what a whole dump gives, byte for byte; a broken chain is refused."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import pytest

from machine.app import Machine, open_machine
from machine.config import MachineConfig
from machine.core.agents import portable_settings
from machine.formats.backup_delta import (
    AgentSegment,
    merge_delta,
    read_agent_segment,
    segment_entries,
)
from machine.models import EventKind
from machine.storage.tables.export import dump_agent_to
from shared.archive import write_tar
from shared.errors import IntegrityError

DEADLINE = 10.0


def _config(root: Path) -> MachineConfig:
    return MachineConfig(
        data_dir=root, background_loops=False, shutdown_grace_seconds=0, prompt_limit=4096
    ).validate()


def _dump(conn: sqlite3.Connection, agent: str, since: int = 0) -> AgentSegment:
    files: AgentSegment = {}

    @contextlib.contextmanager
    def open_file(name: str) -> Iterator[IO[bytes]]:
        buf = io.BytesIO()
        yield buf
        files[name] = buf.getvalue()

    dump_agent_to(conn, agent, open_file, portable=portable_settings, since_seq=since)
    return files


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


async def _prompt(m: Machine, agent: str, text: str) -> None:
    stream = await m.runs.prompt(agent, text)
    async for ev in stream:
        if getattr(ev, "kind", None) is EventKind.PERMISSION_REQUEST:
            await m.runs.answer(ev.run_id, ev.payload["request_id"], "allow_once")  # type: ignore[attr-defined]


async def _last_seq(m: Machine, agent: str) -> int:
    return int(
        await m.db.read(
            lambda c: c.execute("SELECT last_seq FROM agents WHERE id = ?", (agent,)).fetchone()[0],
            what="t",
        )
    )


async def test_point_and_deltas_merge_to_the_whole_dump_byte_equal(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        for i in range(3):
            await asyncio.wait_for(_prompt(m, agent, f"first {i}"), DEADLINE)
        point = await m.db.read(lambda c: _dump(c, agent), what="t")
        base = await _last_seq(m, agent)
        # A tool call (a tool log row) and more prompts after the point.
        await asyncio.wait_for(_prompt(m, agent, "/tool ls MARKER-TOOL"), DEADLINE)
        await asyncio.wait_for(_prompt(m, agent, "second ü ☃"), DEADLINE)
        delta1 = await m.db.read(lambda c: _dump(c, agent, base), what="t")
        base2 = await _last_seq(m, agent)
        await asyncio.wait_for(_prompt(m, agent, "third"), DEADLINE)
        await m.agents.rename(agent, "renamed")
        delta2 = await m.db.read(lambda c: _dump(c, agent, base2), what="t")
        whole = await m.db.read(lambda c: _dump(c, agent), what="t")

    # A delta holds only the events after its base, and no run of the point's.
    assert delta1["conversation.jsonl"] and len(delta1["conversation.jsonl"]) < len(
        whole["conversation.jsonl"]
    )
    assert b"first 0" not in delta1["conversation.jsonl"] + delta1["summaries.jsonl"]
    assert b"MARKER-TOOL" in delta1["tools.jsonl"] and not delta2["tools.jsonl"]
    merged = merge_delta(point, delta1, base_seq=base, agent_id=agent, increment="bki_1")
    merged = merge_delta(merged, delta2, base_seq=base2, agent_id=agent, increment="bki_2")
    assert merged == whole
    # As a segment: written as a tar and read back, the same files.
    out = io.BytesIO()
    write_tar(out, segment_entries(agent, merged))
    assert read_agent_segment(out.getvalue(), agent) == whole


async def test_overlap_is_dropped_a_gap_is_refused(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = (await m.agents.create(name="a", folder=str(tmp_path))).id
        await asyncio.wait_for(_prompt(m, agent, "one"), DEADLINE)
        first = await _last_seq(m, agent)
        await asyncio.wait_for(_prompt(m, agent, "two"), DEADLINE)
        point = await m.db.read(lambda c: _dump(c, agent), what="t")
        base = await _last_seq(m, agent)
        await asyncio.wait_for(_prompt(m, agent, "three"), DEADLINE)
        # Dumped from an earlier seq than the point reached (the point was dumped
        # after its listing): the repeated lines are the same ones, kept once.
        overlapping = await m.db.read(lambda c: _dump(c, agent, first), what="t")
        gap = await m.db.read(lambda c: _dump(c, agent, base + 2), what="t")
        whole = await m.db.read(lambda c: _dump(c, agent), what="t")
    merged = merge_delta(point, overlapping, base_seq=first, agent_id=agent, increment="bki_x")
    assert merged == whole
    with pytest.raises(IntegrityError, match="bki_gap.*continues from event"):
        merge_delta(point, gap, base_seq=base + 2, agent_id=agent, increment="bki_gap")
    with pytest.raises(IntegrityError, match="no earlier backup holds"):
        merge_delta(None, gap, base_seq=base + 2, agent_id=agent, increment="bki_gap")
    # From 0: the agent whole, whatever came before.
    assert merge_delta(None, whole, base_seq=0, agent_id=agent, increment="bki_y") == whole


def test_a_row_changed_after_the_base_replaces_the_earlier_one_in_place() -> None:
    """A tool call started before the base and ended after it: the delta holds the
    run's rows whole, and its row replaces the earlier one where it stood."""
    agent = "ag_0000000000aaaaaaaaaaaaaaaa"

    def line(**row: object) -> bytes:
        return json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    event = '{{"kind":"TEXT_DELTA","payload":{{"text": "x"}},"run_id":"r{}","seq":{},"time":1}}\n'
    earlier: AgentSegment = {
        "record.json": b"{}",
        "conversation.jsonl": "".join(event.format(1, s) for s in (1, 2)).encode(),
        "summaries.jsonl": line(run_id="r1", text="old", created_at=1),
        "tools.jsonl": line(run_id="r0", call_id="a", status="completed")
        + line(run_id="r1", call_id="c", status=None)
        + line(run_id="r1", call_id="d", status=None),
        "schedules.jsonl": b"gone\n",
    }
    delta: AgentSegment = {
        "record.json": b'{"new":1}',
        "conversation.jsonl": event.format(1, 3).encode(),
        "summaries.jsonl": line(run_id="r1", text="new", created_at=1),
        "tools.jsonl": line(run_id="r1", call_id="c", status="completed")
        + line(run_id="r1", call_id="e", status=None),
    }
    merged = merge_delta(earlier, delta, base_seq=2, agent_id=agent, increment="bki_z")
    assert merged["tools.jsonl"] == (
        line(run_id="r0", call_id="a", status="completed")
        + line(run_id="r1", call_id="c", status="completed")
        + line(run_id="r1", call_id="d", status=None)
        + line(run_id="r1", call_id="e", status=None)
    )
    assert merged["summaries.jsonl"] == line(run_id="r1", text="new", created_at=1)
    assert merged["record.json"] == b'{"new":1}'
    assert "schedules.jsonl" not in merged, "the delta has none: the agent has none now"
    assert merged["conversation.jsonl"].count(b"\n") == 3
