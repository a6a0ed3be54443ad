"""Every state a join can leave, reached by the command docs/join.md names (issue 34).

Real processes: ``agents-control serve`` on a folder store
(``tests/helpers/control_proc.py``), ``agents-machine serve``
(``tests/helpers/machine_proc.py``) and ``agents-machine join`` as the operator
runs them.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cli.client import AdminClient
from machine.link import identity
from tests.helpers.control_proc import ControlProc, run_init, start_serve, stop_serve
from tests.helpers.machine_proc import AGENTS_MACHINE, MachineProc, machine_env
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

PROCESS_DEADLINE = 60.0


#: Seconds a joined machine has to connect before the control plane rolls its join
#: back (AGENTS_CONTROL_JOIN_CONFIRM_GRACE), where a test waits for a roll-back: long
#: enough for a join that serves to start its daemon and connect on a loaded box.
CONFIRM_GRACE = 8.0
#: Seconds before the self-check asks again about a held join (config
#: intent_recheck_seconds, 30 by default): the roll-back comes within this of
#: CONFIRM_GRACE, not 30 s after the join.
INTENT_RECHECK = 0.5


@pytest.fixture
def cp(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ControlProc]:
    grace = getattr(request, "param", None)
    env = {"AGENTS_CONTROL_JOIN_CONFIRM_GRACE": str(grace)} if grace else {}
    # The self-check that rolls joins back ticks once a heartbeat interval.
    proc = run_init(
        tmp_path / "cp-home", str(tmp_path / "cp-store"), env, ["--heartbeat-interval", "0.3"]
    )
    if grace:
        with (proc.home / "config.toml").open("a") as f:
            f.write(f"intent_recheck_seconds = {INTENT_RECHECK}\n")
    try:
        start_serve(proc)
        yield proc
    finally:
        stop_serve(proc)


async def _join_args(client: AdminClient, account_id: str) -> list[str]:
    """``join ADDRESS --token T --ca-hash H`` for a fresh token (after the program name)."""
    reply = await client.create_token(account_id)
    return ["join", reply.join_address, "--token", reply.token_value, "--ca-hash", reply.ca_hash]


def _join_argv(data_dir: Path, join_args: list[str]) -> list[str]:
    return [str(AGENTS_MACHINE), *join_args, "--data-dir", str(data_dir), "--no-background"]


def _run_join(
    data_dir: Path, join_args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A join expected to stop (refused, killed), so it returns instead of serving."""
    return subprocess.run(
        _join_argv(data_dir, join_args),
        capture_output=True,
        text=True,
        timeout=PROCESS_DEADLINE,
        env=machine_env(env),
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
            assert daemon.proc.poll() is None and daemon.healthy(), daemon.log()
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


@pytest.mark.parametrize("cp", [CONFIRM_GRACE], indirect=True)
@pytest.mark.timeout(300)  # several daemons and joins: slower on a loaded box
async def test_a_join_the_control_plane_rolled_back_joins_again_as_new(
    cp: ControlProc, tmp_path: Path
) -> None:
    """Joined, but killed before the daemon started, so the control plane rolled
    the join back: the same command again says the join is not
    confirmed and the daemon's log how to go on; a new token without --as-new
    is refused, unused, naming --as-new; --as-new with the token the roll-back
    gave back joins the folder as a new machine, which confirms by connecting."""
    data_dir = tmp_path / "data"
    log = tmp_path / "join.log"
    async with cp.admin() as client:
        account_id = (await client.create_account(35, "rolled")).account.account_id
        join_args = await _join_args(client, account_id)
        res = _run_join(data_dir, join_args, {"AGENTS_MACHINE_TEST_CRASH_AFTER_JOIN": "1"})
        assert res.returncode == -signal.SIGKILL, (res.stdout, res.stderr)
        assert "joined as machine" in res.stdout, res.stdout
        stranded = identity.load_link(data_dir).machine_id
        assert identity.unconfirmed_join(data_dir) is not None

        async def rolled_back() -> bool:
            # The record goes first, then the token's use is given back.
            if await client.list_machines(account_id):
                return False
            return await _token_uses(client, account_id, join_args) == 0

        await apoll_until(rolled_back, deadline=CONFIRM_GRACE + 120, what="join rolled back")

        # The same command again: no token used; the daemon says what happened.
        with _serving_join(data_dir, join_args, log) as again:

            def explained() -> bool:
                if again.poll() is not None:
                    raise AssertionError(log.read_text())
                return "never confirmed" in log.read_text()

            await apoll_until(explained, deadline=PROCESS_DEADLINE, what="roll-back logged")
        out = log.read_text()
        assert f"machine {stranded} is joined already and has not connected" in out, out
        assert "--as-new" in out.split("never confirmed", 1)[1], out

        # A new token without --as-new: refused by the control plane, unused.
        other = await _join_args(client, account_id)
        res = _run_join(data_dir, other)
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "which this account does not have" in res.stderr, res.stderr
        assert "--as-new" in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert await _token_uses(client, account_id, other) == 0

        # --as-new with the token the roll-back gave back: a new machine, same folder.
        with _serving_join(data_dir, [*join_args, "--as-new"], log) as joined:

            async def confirmed() -> bool:
                if joined.poll() is not None:
                    raise AssertionError(log.read_text())
                machines = await client.list_machines(account_id)
                return bool(machines and machines[0].online)

            await apoll_until(confirmed, deadline=PROCESS_DEADLINE, what="new machine online")
            machines = await client.list_machines(account_id)
            assert [m.machine_id for m in machines] == [identity.load_link(data_dir).machine_id]
            assert machines[0].machine_id != stranded
            await apoll_until(
                lambda: identity.unconfirmed_join(data_dir) is None,
                deadline=PROCESS_DEADLINE,
                what="join confirmed",
            )
        assert f"joined again as the new machine {machines[0].machine_id}" in log.read_text()
