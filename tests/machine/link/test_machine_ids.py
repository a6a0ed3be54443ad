"""The machine's ids across a join: one canonical id, and every id it ever had stays its own."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sqlite3
from pathlib import Path

import grpc
import grpc.aio
import pytest

from machine.api.servicer import MachineServicer
from machine.app import Machine, open_machine
from machine.cli.main import main
from machine.config import MachineConfig
from machine.link import identity
from machine.models import EventKind
from shared.crypto import BoxKeyPair
from shared.errors import InvalidState
from shared.ids import is_valid_id, new_id
from shared.pb.machine.v1 import machine_pb2 as pb
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc

DEADLINE = 10.0
FOREIGN_AGENT = "ag_0000000000aaaaaaaaaaaaaaaa"
FOREIGN_MACHINE = "mc_0000000000bbbbbbbbbbbbbbbb"


def write_link(data_dir: Path, machine_id: str) -> None:
    """A link.json as join writes it (no keys: nothing here dials the control plane)."""
    now = dt.datetime.now(dt.UTC)
    identity.save_link(
        data_dir,
        identity.LinkRecord(
            control_address="127.0.0.1:9",
            machine_id=machine_id,
            account_id=new_id("account"),
            account_recovery_public_key=BoxKeyPair.generate().public_key,
            heartbeat_interval=30.0,
            cert_not_after=now + dt.timedelta(days=30),
            cert_received_at=now,
        ),
    )


async def run_to_end(m: Machine, agent_id: str) -> EventKind:
    stream = await m.runs.prompt(agent_id, "hello")

    async def last() -> EventKind:
        kind = EventKind.RUN_STARTED
        async for ev in stream:
            kind = ev.kind
        return kind

    return await asyncio.wait_for(last(), DEADLINE)


def add_foreign_agent(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    try:
        conn.execute(
            "INSERT INTO agents (id, name, folder, runtime, state, origin_machine, created_at,"
            " updated_at) VALUES (?, 'f', '/', 'echo', 'archived', ?, 0, 0)",
            (FOREIGN_AGENT, FOREIGN_MACHINE),
        )
        conn.commit()
    finally:
        conn.close()


async def rpc_status(m: Machine) -> pb.StatusResponse:
    # The servicer's Status reads nothing from its context.
    return await MachineServicer(m).Status(pb.StatusRequest(), None)  # type: ignore[arg-type]


async def cli_status(m: Machine) -> dict[str, object]:
    """``agents-machine status --json`` against the servicer on the config's socket."""
    server = grpc.aio.server()
    pb_grpc.add_MachineServiceServicer_to_server(MachineServicer(m), server)
    server.add_insecure_port(f"unix://{m.config.socket}")
    await server.start()
    try:
        argv = ["--data-dir", str(m.config.data_dir), "--json", "status"]
        capture = await asyncio.to_thread(_run_main, argv)
    finally:
        await server.stop(None)
    code, out = capture
    assert code == 0, out
    doc: dict[str, object] = json.loads(out)
    return doc


def _run_main(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, buf.getvalue()


async def test_join_makes_the_control_plane_id_canonical(
    machine_config: MachineConfig, tmp_path: Path
) -> None:
    data_dir = machine_config.data_dir
    async with open_machine(machine_config) as m:
        local_id = m.machine_id
        st = await m.status()
        assert is_valid_id("machine", local_id) and st.machine_id == local_id and not st.joined
        before = await m.agents.create(name="before", folder=str(tmp_path))
        assert before.origin_machine == local_id
        await m.agents.archive(before.id)
        assert (await cli_status(m))["joined"] is False

    joined_id = new_id("machine")
    write_link(data_dir, joined_id)
    add_foreign_agent(machine_config.db_path)

    async with open_machine(machine_config) as m:
        st = await m.status()
        assert (st.machine_id, st.joined) == (joined_id, True)
        assert (await m.agents.create(name="x", folder="/")).origin_machine == joined_id
        assert (await rpc_status(m)).machine_id == joined_id
        shown = await cli_status(m)
        assert (shown["machine_id"], shown["joined"]) == (joined_id, True)

        # An agent made before the join is still this machine's own.
        old = await m.agents.unarchive(before.id)
        assert old.local and old.origin_machine == local_id
        assert await run_to_end(m, before.id) is EventKind.RUN_FINISHED

        # New agents carry the control plane's id.
        after = await m.agents.create(name="after", folder=str(tmp_path))
        assert after.origin_machine == joined_id and after.local
        assert await run_to_end(m, after.id) is EventKind.RUN_FINISHED

        # Any other origin is still another machine's.
        foreign = await m.agents.get(FOREIGN_AGENT)
        assert not foreign.local
        with pytest.raises(InvalidState, match="origin is machine"):
            await m.runs.prompt(FOREIGN_AGENT, "hi")
        with pytest.raises(InvalidState, match="origin is machine"):
            await m.agents.unarchive(FOREIGN_AGENT)

    # The ids were recorded durably: without link.json both agents still run.
    (data_dir / identity.LINK_FILE).unlink()
    async with open_machine(machine_config) as m:
        st = await m.status()
        assert (st.machine_id, st.joined) == (local_id, False)
        for agent_id in (before.id, after.id):
            assert (await m.agents.get(agent_id)).local
        assert await run_to_end(m, after.id) is EventKind.RUN_FINISHED
        assert not (await m.agents.get(FOREIGN_AGENT)).local


async def test_damaged_link_keeps_the_last_joined_id(machine_config: MachineConfig) -> None:
    # A join into a fresh data folder: link.json is there before machine.db.
    machine_config.data_dir.mkdir(mode=0o700)
    joined_id = new_id("machine")
    write_link(machine_config.data_dir, joined_id)
    async with open_machine(machine_config) as m:
        assert m.machine_id == joined_id
    (machine_config.data_dir / identity.LINK_FILE).write_text("{not json")
    async with open_machine(machine_config) as m:
        st = await m.status()
        assert (st.machine_id, st.joined) == (joined_id, True)
        assert (await m.agents.create(name="x", folder="/")).origin_machine == joined_id
