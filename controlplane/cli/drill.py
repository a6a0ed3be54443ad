"""``agents-control drill``: rehearse losing the control plane, with real processes.

On this host, in a temporary folder: ``init`` a control plane (a folder store
unless one is given) sealed to a fresh recovery key, ``serve`` it, join N
``agents-machine`` daemons, stop half of them and queue prompts to those;
then SIGKILL the control plane and delete its home, ``restore`` it from the
store and the recovery key, ``serve`` it again on the same addresses and start
the stopped machines. :class:`DrillReport` says how long the restore took,
when every machine was connected again (from the start of the restore), how
many queued prompts were delivered, lost, and how many machines had to pair
again (a changed machine id or certificate).

:class:`Drill` is also what the integration test drives step by step.
Everything it starts is killed in ``close`` (every wait has a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from controlplane.cli.client import AdminClient
from shared.crypto import BoxKeyPair, encode_public_key
from shared.errors import AgentsError, InvalidArgument, InvalidState
from shared.recovery_key import write_recovery_key

__all__ = ["Drill", "DrillReport", "run_drill"]

logger = logging.getLogger(__name__)

#: Seconds any one step (a start, a join, the reconnection) may take.
STEP_DEADLINE: Final = 60.0
#: Prompts queued to each stopped machine.
PROMPTS_PER_MACHINE: Final = 2
#: Seconds between two polls of the control plane.
_POLL: Final = 0.05
MAX_MACHINES: Final = 100


@dataclass(frozen=True)
class DrillReport:
    """What a drill measured (every time in seconds, from the start of the restore)."""

    machines: int
    stopped: int
    prompts_queued: int
    prompts_delivered: int
    prompts_lost: int
    repaired: int
    """Machines that had to pair again (their id or certificate changed)."""
    not_connected: int
    restore_seconds: float
    listening_seconds: float
    """Until the restored control plane listened (``serve`` started and serving)."""
    connected_seconds: float
    """Until every machine was connected to the restored control plane."""
    delivered_seconds: float

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing paired again, every machine back."""
        return not (self.prompts_lost or self.repaired or self.not_connected)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _exe(name: str) -> str:
    """The console script beside this interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise InvalidState("drill", f"{name} is not installed")
    return found


async def _until(what: str, check: Any, deadline: float = STEP_DEADLINE) -> Any:
    """Poll ``check`` (async) until it returns a true value; InvalidState after ``deadline``."""
    end = time.monotonic() + deadline
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > end:
            raise InvalidState("drill", f"{what}: not within {deadline:.0f}s")
        await asyncio.sleep(_POLL)


@dataclass
class _Machine:
    data_dir: Path
    process: subprocess.Popen[bytes] | None = None
    machine_id: str = ""
    cert: bytes = b""
    agent_id: str = ""
    stopped: bool = False
    prompts: list[str] = field(default_factory=list)


class Drill:
    """One rehearsal in ``workdir`` (see the module doc); an async context manager."""

    def __init__(
        self,
        workdir: Path,
        *,
        machines: int,
        env: Mapping[str, str],
        store_url: str = "",
        store_endpoint: str = "",
    ) -> None:
        if not 1 <= machines <= MAX_MACHINES:
            raise InvalidArgument("machines", f"must be between 1 and {MAX_MACHINES}")
        self.workdir = workdir
        self.home = workdir / "home"
        self.store_url = store_url or str(workdir / "store")
        self._store_flags = ["--store-endpoint", store_endpoint] if store_endpoint else []
        self.recovery_key = workdir / "recovery.key"
        self._env = {k: v for k, v in env.items() if k != "AGENTS_CONTROL_CREDENTIAL"}
        self._machine_env = {k: v for k, v in env.items() if not k.startswith("AGENTS_")}
        self.machines = [_Machine(workdir / f"machine-{i}") for i in range(machines)]
        self.public = f"127.0.0.1:{_free_port()}"
        self.link = f"127.0.0.1:{_free_port()}"
        self.operator = ""
        self.account_id = ""
        self.serve: subprocess.Popen[bytes] | None = None
        self._serves = 0

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------ processes

    def _run(self, argv: Sequence[str], env: Mapping[str, str]) -> str:
        proc = subprocess.run(
            list(argv), env=dict(env), capture_output=True, text=True, timeout=STEP_DEADLINE
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise InvalidState("drill", f"{Path(argv[0]).name} {argv[1]} failed: {last}")
        return proc.stdout

    def control(self, *args: str) -> str:
        """Run ``agents-control ARGS`` (not a daemon) and return its stdout."""
        return self._run([_exe("agents-control"), *args], self._env)

    def machine_cli(self, machine: _Machine, *args: str) -> str:
        """Run ``agents-machine --data-dir D ARGS`` and return its stdout."""
        argv = [_exe("agents-machine"), "--data-dir", str(machine.data_dir), *args]
        return self._run(argv, self._machine_env)

    def _log(self, name: str) -> Any:
        return (self.workdir / f"{name}.log").open("ab")

    def start_serve(self, home: Path | None = None) -> subprocess.Popen[bytes]:
        """``agents-control serve`` on the drill's fixed addresses (not waited for)."""
        self._serves += 1
        argv = [_exe("agents-control"), "serve", "--home", str(home or self.home)]
        argv += ["--listen", self.public, "--link-listen", self.link]
        argv += ["--metrics-listen", "127.0.0.1:0"]
        with self._log(f"serve-{self._serves}") as log:
            return subprocess.Popen(argv, env=self._env, stdout=log, stderr=subprocess.STDOUT)

    def _start_machine(self, machine: _Machine, argv: Sequence[str]) -> None:
        with self._log(machine.data_dir.name) as log:
            machine.process = subprocess.Popen(
                [_exe("agents-machine"), *argv],
                env=self._machine_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def start_machine(self, machine: _Machine) -> None:
        """Start a joined machine's daemon again (not waited for)."""
        self._start_machine(
            machine, ["--data-dir", str(machine.data_dir), "serve", "--no-background"]
        )

    @staticmethod
    def _stop(process: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def close(self) -> None:
        """Stop every process the drill started."""
        for machine in self.machines:
            self._stop(machine.process)
        self._stop(self.serve)

    # ----------------------------------------------------------------- steps

    def admin(self) -> AdminClient:
        """An admin client of the serving control plane (the operator credential)."""
        return AdminClient(self.public, (self.home / "ca.pem").read_bytes(), self.operator, 10)

    async def _serving(self, process: subprocess.Popen[bytes]) -> None:
        async def up() -> bool:
            if process.poll() is not None:
                raise InvalidState("drill", f"serve exited with {process.returncode}")
            try:
                async with self.admin() as client:
                    await client.list_accounts()
            except AgentsError:
                return False
            return True

        await _until("control plane serving", up)

    async def set_up(self) -> None:
        """init, serve, one account, join every machine, one agent on each."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        pair = BoxKeyPair.generate()
        write_recovery_key(self.recovery_key, pair, "a drill's key bundle")
        out = self.control(
            "init",
            "--home",
            str(self.home),
            "--store",
            self.store_url,
            *self._store_flags,
            "--listen",
            self.public,
            "--link-listen",
            self.link,
            "--metrics-listen",
            "127.0.0.1:0",
            "--heartbeat-interval",
            "1",
            "--recovery-public-key",
            encode_public_key(pair.public_key),
        )
        found = re.search(r"^(adm_\S+)$", out, re.M)
        if not found:
            raise InvalidState("drill", "init printed no operator credential")
        self.operator = found.group(1)
        self.serve = self.start_serve()
        await self._serving(self.serve)
        async with self.admin() as client:
            made = await client.create_account(424242, "drill")
            self.account_id = made.account.account_id
            token = await client.create_token(self.account_id, 3600, len(self.machines))
        address, value, ca_hash = token.join_address, token.token_value, token.ca_hash
        for machine in self.machines:
            self._start_machine(
                machine,
                [
                    "join",
                    address,
                    "--token",
                    value,
                    "--ca-hash",
                    ca_hash,
                    "--data-dir",
                    str(machine.data_dir),
                    "--no-background",
                ],
            )
        await self.wait_connected(STEP_DEADLINE)
        for machine in self.machines:
            machine.machine_id, machine.cert = self.identity(machine)
            made_agent = json.loads(
                self.machine_cli(
                    machine, "agent", "create", "drill", "--folder", str(self.workdir), "--json"
                )
            )
            machine.agent_id = str(made_agent["agent_id"])

    def identity(self, machine: _Machine) -> tuple[str, bytes]:
        """(machine id, client certificate) the machine holds."""
        link = json.loads((machine.data_dir / "link.json").read_text())
        return str(link["machine_id"]), (machine.data_dir / "keys" / "tls.crt").read_bytes()

    async def _online(self) -> set[str]:
        try:
            async with self.admin() as client:
                listed = await client.list_machines(self.account_id)
        except AgentsError:
            return set()
        return {m.machine_id for m in listed if m.online}

    async def wait_connected(self, deadline: float) -> None:
        """Until every machine is connected (by its joined machine id once known)."""

        async def every() -> bool:
            online = await self._online()
            known = [m.machine_id for m in self.machines if m.machine_id]
            if known:
                return set(known) <= online
            return len(online) >= len(self.machines)

        await _until("every machine connected", every, deadline)

    async def queue_prompts(self) -> None:
        """Stop every other machine (at least one) and queue prompts to each stopped one."""
        stopped = self.machines[::2]
        for machine in stopped:
            self._stop(machine.process)
            machine.stopped = True

        async def offline() -> bool:
            online = await self._online()
            return not any(m.machine_id in online for m in stopped)

        await _until("stopped machines offline", offline)
        async with self.admin() as client:
            for machine in stopped:
                for i in range(PROMPTS_PER_MACHINE):
                    sent = await client.send_prompt(
                        machine.machine_id, machine.agent_id, f"drill prompt {i}", f"drill-{i}"
                    )
                    if sent.state != "queued":
                        raise InvalidState("drill", f"prompt was {sent.state}, not queued")
                    machine.prompts.append(sent.prompt_id)

    def lose_control_plane(self, keep_copy: Path | None = None) -> None:
        """SIGKILL the control plane and delete its home (``keep_copy``: copy it first)."""
        self._stop(self.serve, signal.SIGKILL)
        if keep_copy is not None:
            shutil.copytree(self.home, keep_copy)
        shutil.rmtree(self.home)

    async def recover(self) -> DrillReport:
        """restore, serve, start the stopped machines; measure until all is back."""
        started = time.monotonic()
        self.control(
            "restore",
            "--home",
            str(self.home),
            "--store",
            self.store_url,
            *self._store_flags,
            "--recovery-key",
            str(self.recovery_key),
        )
        restored = time.monotonic() - started
        self.serve = self.start_serve()
        for machine in self.machines:
            if machine.stopped:
                self.start_machine(machine)
        listening = asyncio.create_task(self._listening(self.serve))
        try:
            await self.wait_connected(STEP_DEADLINE)
        except InvalidState:
            logger.warning("drill: not every machine reconnected")
        connected = time.monotonic() - started
        try:
            listened = await asyncio.wait_for(listening, STEP_DEADLINE) - started
        except TimeoutError:
            listened = float("nan")
        online = await self._online()
        delivered = await self._delivered(started)
        delivered_at = time.monotonic() - started
        queued = sum(len(m.prompts) for m in self.machines)
        repaired = sum(
            1
            for m in self.machines
            if (m.data_dir / "link.json").exists() and self.identity(m) != (m.machine_id, m.cert)
        )
        return DrillReport(
            machines=len(self.machines),
            stopped=sum(m.stopped for m in self.machines),
            prompts_queued=queued,
            prompts_delivered=delivered,
            prompts_lost=queued - delivered,
            repaired=repaired,
            not_connected=sum(m.machine_id not in online for m in self.machines),
            restore_seconds=round(restored, 2),
            listening_seconds=round(listened, 2),
            connected_seconds=round(connected, 2),
            delivered_seconds=round(delivered_at, 2),
        )

    async def _listening(self, process: subprocess.Popen[bytes]) -> float:
        """When ``serve`` wrote serve.json (it listens by then): monotonic seconds."""
        path = self.home / "serve.json"
        while True:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(path.read_text()).get("pid") == process.pid:
                    return time.monotonic()
            await asyncio.sleep(0.01)

    async def _delivered(self, started: float) -> int:
        """Acknowledged prompts, once all are or the step deadline passed."""
        count = 0

        async def all_acknowledged() -> bool:
            nonlocal count
            count = 0
            async with self.admin() as client:
                for machine in self.machines:
                    if machine.prompts:
                        listed = (await client.list_prompts(machine.machine_id)).prompts
                        states = {p.prompt_id: p.state for p in listed}
                        count += sum(states.get(p) == "acknowledged" for p in machine.prompts)
            return count == sum(len(m.prompts) for m in self.machines)

        with contextlib.suppress(InvalidState):
            await _until("queued prompts delivered", all_acknowledged)
        return count


async def run_drill(
    workdir: Path,
    *,
    machines: int,
    env: Mapping[str, str],
    store_url: str = "",
    store_endpoint: str = "",
) -> DrillReport:
    """The whole drill in ``workdir`` (see the module doc)."""
    async with Drill(
        workdir, machines=machines, env=env, store_url=store_url, store_endpoint=store_endpoint
    ) as drill:
        await drill.set_up()
        await drill.queue_prompts()
        drill.lose_control_plane()
        return await drill.recover()
