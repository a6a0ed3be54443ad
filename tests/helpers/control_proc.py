"""Run a real ``agents-control`` (init + serve) as subprocesses for integration tests.

Usage::

    with control_plane(tmp_path, store_url=..., env=...) as cp:
        cp.cli("account", "create", "--github-id", "1", "--github-login", "a")

``cp.public`` / ``cp.link`` are the daemon's actual addresses (read from
serve.json); ``cp.operator`` is the operator credential init printed. The
daemon is stopped with SIGTERM in ``finally`` and killed if it does not exit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.crypto import BoxKeyPair, encode_public_key
from shared.recovery_key import read_recovery_key, write_recovery_key
from tests.helpers.machine_proc import SYSTEMD_NOTIFY_VARIABLES
from tests.helpers.poll import poll_until

if TYPE_CHECKING:
    from controlplane.cli.client import AdminClient

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
START_DEADLINE = 20.0


def agents_control_exe() -> Path:
    """The console script; installed in editable mode if it is missing."""
    exe = VENV_BIN / "agents-control"
    if not exe.exists():
        subprocess.run(
            [str(VENV_BIN / "pip"), "install", "-q", "-e", str(ROOT), "--no-deps"],
            check=True,
            timeout=300,
        )
    return exe


@dataclass
class CliResult:
    """What one CLI run printed."""

    code: int
    out: str
    err: str


@dataclass
class ControlProc:
    """A running control plane and a way to call its CLI."""

    home: Path
    env: dict[str, str]
    operator: str
    ca_hash: str
    process: subprocess.Popen[bytes] | None = None
    serve_info: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def public(self) -> str:
        """host:port of the public listener (Join, Admin)."""
        return self.serve_info["public"]

    @property
    def link(self) -> str:
        """host:port of the mutual-TLS link listener."""
        return self.serve_info["link"]

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate."""
        return (self.home / "ca.pem").read_bytes()

    def admin(self, timeout: float = 10) -> AdminClient:
        """An Admin API client as the operator (``async with cp.admin() as client``)."""
        from controlplane.cli.client import AdminClient

        return AdminClient(self.public, self.ca_pem, self.operator, timeout=timeout)

    def cli(self, *args: str, credential: str | None = None, timeout: float = 30) -> CliResult:
        """Run ``agents-control ARGS --home HOME`` with the operator credential by default."""
        env = dict(self.env)
        env["AGENTS_CONTROL_CREDENTIAL"] = credential if credential is not None else self.operator
        argv = [str(agents_control_exe()), *args, "--home", str(self.home)]
        proc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout)
        return CliResult(proc.returncode, proc.stdout.decode(), proc.stderr.decode())


def join_new_account(
    cp: ControlProc,
    data: Path,
    log: Path,
    *,
    github_id: int,
    login: str,
    extra: Sequence[str] = (),
    out: Path | None = None,
) -> subprocess.Popen[bytes]:
    """A new account, and a machine joined to it by the printed join command, serving
    in the foreground on ``data`` with its output in ``log`` (``extra``: more
    arguments for the join, e.g. ``--log-format json``; ``out``: its stdout there
    instead, so ``log`` holds only its log lines)."""

    def ok(res: CliResult) -> str:
        assert res.code == 0, res.err
        return res.out

    made = ok(cp.cli("account", "create", "--github-id", str(github_id), "--github-login", login))
    account = re.search(r"account (acct_[0-9a-z]{26})", made)
    assert account, made
    token = json.loads(ok(cp.cli("token", "create", "--account", account.group(1), "--json")))
    join = shlex.split(token["join_command"])
    with log.open("wb") as err, (out or log).open("ab") as stdout:
        return subprocess.Popen(
            [str(VENV_BIN / "agents-machine"), *join[1:], "--data-dir", str(data)]
            + ["--no-background", *extra],
            stdout=stdout if out is not None else err,
            stderr=err,
        )


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment that points a control plane at an S3 endpoint with test credentials."""
    return {
        "AGENTS_CONTROL_STORE_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
    }


def recovery_key_path(home: Path) -> Path:
    """Where :func:`init_argv` keeps the recovery key it made for an S3 store."""
    return home.parent / f"{home.name}.recovery.key"


def _recovery_flag(home: Path, store_url: str, extra: Sequence[str]) -> list[str]:
    """An S3 store needs ``--recovery-public-key``: make a key file beside the home."""
    if not store_url.startswith("s3://") or "--recovery-public-key" in extra:
        return []
    path = recovery_key_path(home)
    if path.exists():
        pair = read_recovery_key(path)
    else:
        pair = BoxKeyPair.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_recovery_key(path, pair, "a test control plane's key bundle")
    return ["--recovery-public-key", encode_public_key(pair.public_key)]


def init_argv(home: Path, store_url: str, extra: Sequence[str] = ()) -> list[str]:
    """``agents-control init`` on ephemeral loopback ports (with a recovery key made
    beside the home for an S3 store, see :func:`recovery_key_path`)."""
    return [
        str(agents_control_exe()),
        "init",
        "--home",
        str(home),
        "--store",
        store_url,
        "--listen",
        "127.0.0.1:0",
        "--link-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        *_recovery_flag(home, store_url, extra),
        *extra,
    ]


def run_init(
    home: Path, store_url: str, env: Mapping[str, str], extra: Sequence[str] = ()
) -> ControlProc:
    """``agents-control init`` with ephemeral ports; returns the credential it printed."""
    full_env = {**os.environ, **env}
    for name in ("AGENTS_CONTROL_CREDENTIAL", *SYSTEMD_NOTIFY_VARIABLES):
        full_env.pop(name, None)
    proc = subprocess.run(
        init_argv(home, store_url, extra), env=full_env, capture_output=True, timeout=60
    )
    out = proc.stdout.decode()
    if proc.returncode != 0:
        raise AssertionError(f"init failed ({proc.returncode}): {proc.stderr.decode()}")
    cred = re.search(r"^(adm_[0-9a-z]{26}\.[A-Za-z0-9_-]{43})$", out, re.M)
    ca = re.search(r"CA hash: (sha256:[0-9a-f]{64})", out)
    assert cred and ca, out
    return ControlProc(home=home, env=full_env, operator=cred.group(1), ca_hash=ca.group(1))


def start_serve(
    cp: ControlProc,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    *,
    wait: bool = True,
) -> None:
    """Start ``serve`` (``env``: entries added to the control plane's environment)
    and wait (deadline) until serve.json names its ports; ``wait=False``: return
    at once (``cp.serve_info`` stays empty)."""
    serve_json = cp.home / "serve.json"
    cp.log_path = log_path = cp.home.parent / f"{cp.home.name}-serve.log"
    log = log_path.open("wb")
    cp.process = subprocess.Popen(
        [str(agents_control_exe()), "serve", "--home", str(cp.home), *extra],
        env={**cp.env, **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    if not wait:
        return
    process = cp.process

    def ready() -> dict[str, Any] | None:
        if process.poll() is not None:
            raise AssertionError(f"serve exited early:\n{log_path.read_text()}")
        try:
            info = json.loads(serve_json.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return info if info.get("pid") == process.pid else None

    cp.serve_info = poll_until(
        ready,
        deadline=START_DEADLINE,
        what="serve",
        fail=lambda: AssertionError(
            f"serve not ready in {START_DEADLINE}s:\n{log_path.read_text()}"
        ),
    )


def stop_serve(cp: ControlProc) -> None:
    """SIGTERM, wait with a deadline, then kill."""
    if cp.process is None or cp.process.poll() is not None:
        return
    cp.process.send_signal(signal.SIGTERM)
    try:
        cp.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        cp.process.kill()
        cp.process.wait(timeout=5)


@contextmanager
def control_plane(
    home: Path,
    store_url: str,
    env: Mapping[str, str] | None = None,
    init_args: Sequence[str] = (),
    serve_args: Sequence[str] = (),
) -> Iterator[ControlProc]:
    """init + serve; the daemon is stopped in ``finally``."""
    cp = run_init(home, store_url, env or {}, init_args)
    try:
        start_serve(cp, serve_args)
        yield cp
    finally:
        stop_serve(cp)


def wait_serve(cp: ControlProc) -> None:
    """Wait (deadline) until a ``serve`` started with ``start_serve(cp, wait=False)``
    names its ports in serve.json (several started at once, then waited for)."""
    process, log_path = cp.process, cp.log_path
    assert process is not None and log_path is not None

    def ready() -> dict[str, Any] | None:
        if process.poll() is not None:
            raise AssertionError(f"serve exited early:\n{log_path.read_text()}")
        try:
            info = json.loads((cp.home / "serve.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return info if info.get("pid") == process.pid else None

    cp.serve_info = poll_until(ready, deadline=START_DEADLINE, what="serve")
