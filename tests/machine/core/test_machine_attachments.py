"""Attachments: content-addressed, 0600, limit enforced with nothing left behind."""

from __future__ import annotations

import hashlib
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from machine.app import Machine
from machine.models import EventKind
from machine.runtimes.base import RunContext, RunOutcome, TextDelta
from shared.errors import NotFound, TooLarge


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_upload_is_content_addressed(machine_app: Machine, tmp_path: Path) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    data = b"hello " * 1000
    rec = await machine_app.attachments.upload(
        agent_id=agent,
        file_name="notes.txt",
        declared_size=len(data),
        chunks=chunks(data[:10], data[10:]),
    )
    assert rec.sha256 == hashlib.sha256(data).hexdigest() and rec.size == len(data)
    path = machine_app.config.attachments_dir / rec.sha256
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert leftovers(machine_app.config.attachments_dir) == [rec.sha256]
    # A prompt may name it; the run records it.
    events = [e async for e in await machine_app.runs.prompt(agent, "see file", [rec.sha256])]
    assert events[0].kind is EventKind.RUN_STARTED
    assert events[0].payload["attachments"] == [rec.sha256]
    # Another agent may not use it.
    other = (await machine_app.agents.create(name="b", folder=str(tmp_path))).id
    with pytest.raises(NotFound):
        await machine_app.runs.prompt(other, "see file", [rec.sha256])


@pytest.mark.parametrize("declared", [0, 10**9])
async def test_over_the_limit_leaves_nothing(
    machine_app: Machine, tmp_path: Path, declared: int
) -> None:
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path))).id
    limit = machine_app.config.attachment_limit
    with pytest.raises(TooLarge) as err:
        await machine_app.attachments.upload(
            agent_id=agent,
            file_name="big.bin",
            declared_size=declared,
            chunks=chunks(b"x" * (limit // 2), b"x" * (limit // 2), b"x"),
        )
    assert err.value.field == "attachment"
    assert leftovers(machine_app.config.attachments_dir) == []
    rows = await machine_app.db.read(
        lambda c: c.execute("SELECT COUNT(*) FROM attachments").fetchone()[0]
    )
    assert rows == 0


async def test_runtime_sees_attachment_paths(machine_app: Machine, tmp_path: Path) -> None:
    seen: list[tuple[Path, ...]] = []

    class Probe:
        name = "probe"

        async def run(self, ctx: RunContext) -> RunOutcome:
            seen.append(ctx.attachments)
            await ctx.emit(TextDelta("ok"))
            return RunOutcome()

        async def close(self) -> None:
            pass

        async def delete_session(self, session_id: str) -> None:
            pass

    from machine.runtimes import RuntimeKind

    machine_app.runtimes.kinds["probe"] = RuntimeKind("probe", dict, lambda **_: Probe())
    agent = (await machine_app.agents.create(name="a", folder=str(tmp_path), runtime="probe")).id
    rec = await machine_app.attachments.upload(
        agent_id=agent, file_name="f", declared_size=3, chunks=chunks(b"abc")
    )
    _ = [e async for e in await machine_app.runs.prompt(agent, "go", [rec.sha256])]
    assert seen == [(machine_app.config.attachments_dir / rec.sha256,)]
    assert seen[0][0].read_bytes() == b"abc"
