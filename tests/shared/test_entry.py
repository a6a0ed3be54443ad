"""What a console script sets before it loads gRPC."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.entry import GRPC_EXPERIMENTS, GRPC_VERBOSITY


def test_grpc_knows_the_experiments_the_control_plane_sets() -> None:
    """gRPC names an experiment it does not know (a newer gRPC dropped it) in one
    error line as it loads; the control plane would then run without it."""
    env = {**os.environ, "GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}
    proc = subprocess.run(
        [sys.executable, "-c", "import grpc.aio; grpc.aio.server()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Unknown experiment" not in proc.stderr, proc.stderr


def _set_by(call: str, name: str, env: dict[str, str]) -> str:
    """``os.environ[name]`` after ``shared.entry.<call>()`` in a process run with ``env``."""
    script = f"import os; from shared.entry import {call}; {call}(); print(os.environ[{name!r}])"
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def test_the_control_plane_entry_sets_them_and_an_operators_choice_wins() -> None:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert _set_by("use_grpc_experiments", "GRPC_EXPERIMENTS", clean) == GRPC_EXPERIMENTS
    mine = {**clean, "GRPC_EXPERIMENTS": "-something_else"}
    assert _set_by("use_grpc_experiments", "GRPC_EXPERIMENTS", mine) == "-something_else"


def test_grpc_logs_errors_only_unless_the_operator_says_otherwise() -> None:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    assert _set_by("quiet_grpc", "GRPC_VERBOSITY", clean) == GRPC_VERBOSITY
    assert _set_by("quiet_grpc", "GRPC_VERBOSITY", {**clean, "GRPC_VERBOSITY": "debug"}) == "debug"


def test_both_console_scripts_quiet_grpc() -> None:
    """Each entry point sets GRPC_VERBOSITY (before it imports its CLI, and gRPC with it)."""
    script = (
        "import os, sys; import {pkg}.cli as c\n"
        "assert 'grpc' not in sys.modules\n"
        "try:\n"
        "    c.entry(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('grpc' in sys.modules, os.environ.get('GRPC_VERBOSITY'))"
    )
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    for pkg in ("machine", "controlplane"):
        proc = subprocess.run(
            [sys.executable, "-c", script.format(pkg=pkg)],
            env=clean,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.stdout.strip().splitlines()[-1] == f"True {GRPC_VERBOSITY}", proc.stderr
