"""A join meets a daemon on its data folder (issue 34).

Real processes: ``agents-control serve`` on a folder store
(``tests/helpers/control_proc.py``), ``agents-machine serve``
(``tests/helpers/machine_proc.py``) and ``agents-machine join`` as the operator
runs them.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.client import AdminClient
from machine.link import identity
from tests.helpers.control_proc import ControlProc, control_plane
from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc, machine_env
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

PROCESS_DEADLINE = 60.0


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProc]:
    with control_plane(tmp_path / "cp-home", str(tmp_path / "cp-store")) as proc:
        yield proc


async def _join_args(client: AdminClient, account_id: str) -> list[str]:
    """``join ADDRESS --token T --ca-hash H`` for a fresh token (after the program name)."""
    reply = await client.create_token(account_id)
    return ["join", reply.join_address, "--token", reply.token_value, "--ca-hash", reply.ca_hash]


def _join_argv(data_dir: Path, join_args: list[str]) -> list[str]:
    return [str(AGENTS_MACHINE), *join_args, "--data-dir", str(data_dir), "--no-background"]


def _run_join(data_dir: Path, join_args: list[str]) -> subprocess.CompletedProcess[str]:
    """A join expected to stop (refused), so it returns instead of serving."""
    return subprocess.run(
        _join_argv(data_dir, join_args),
        capture_output=True,
        text=True,
        timeout=PROCESS_DEADLINE,
        env=machine_env(),
        check=False,
    )


@contextlib.contextmanager
def _serving_join(
    data_dir: Path, join_args: list[str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A join that serves once joined; killed (and reaped) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _join_argv(data_dir, join_args), stdout=out, stderr=subprocess.STDOUT, env=machine_env()
        )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=PROCESS_DEADLINE)


async def _token_uses(client: AdminClient, account_id: str, join_args: list[str]) -> int:
    token_id = join_args[join_args.index("--token") + 1].split(".")[0]
    by_id = {t.token_id: t for t in await client.list_tokens(account_id)}
    return by_id[token_id].uses


async def test_join_into_a_folder_a_daemon_serves_is_refused_before_the_token_is_used(
    cp: ControlProc, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    async with cp.admin() as client:
        account_id = (await client.create_account(34, "issue34")).account.account_id
        join_args = await _join_args(client, account_id)
        with MachineProc(data_dir) as daemon:
            assert daemon.proc is not None
            res = _run_join(data_dir, join_args)
            assert res.returncode == 2, (res.stdout, res.stderr)
            assert "Traceback" not in res.stderr, res.stderr
            assert "joined as machine" not in res.stdout, res.stdout
            # One line naming the folder, the process holding it and what to do.
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1, res.stderr
            assert str(data_dir) in lines[0], res.stderr
            assert f"pid {daemon.proc.pid}" in lines[0], res.stderr
            assert "systemctl stop agents-machine" in lines[0], res.stderr
            assert "the token was not used" in lines[0], res.stderr
            # Nothing written, the token unused, the daemon unaffected.
            assert not identity.is_joined(data_dir)
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".data")] == []
            assert await _token_uses(client, account_id, join_args) == 0
            assert daemon.proc.poll() is None and daemon._healthy(), daemon.log()
            assert daemon.stop() == 0, daemon.log()

        # Stopped, the same command (the same token) joins and serves.
        with _serving_join(data_dir, join_args, tmp_path / "join.log") as joined:

            async def online() -> bool:
                if joined.poll() is not None:
                    raise AssertionError((tmp_path / "join.log").read_text())
                machines = await client.list_machines(account_id)
                return bool(machines and machines[0].online)

            await apoll_until(online, deadline=PROCESS_DEADLINE, what="joined machine online")
            machines = await client.list_machines(account_id)
            assert [m.machine_id for m in machines] == [identity.load_link(data_dir).machine_id]
            assert await _token_uses(client, account_id, join_args) == 1
            out = (tmp_path / "join.log").read_text()
            assert re.search(r"joined as machine mc_\w+", out), out
