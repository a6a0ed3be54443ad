"""What a console script sets before it loads gRPC."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.entry import GRPC_EXPERIMENTS


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


def test_the_control_plane_entry_sets_them_and_an_operators_choice_wins() -> None:
    script = (
        "import os; from shared.entry import use_grpc_experiments; "
        "use_grpc_experiments(); print(os.environ['GRPC_EXPERIMENTS'])"
    )

    def run(env: dict[str, str]) -> str:
        return subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()

    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    assert run(clean) == GRPC_EXPERIMENTS
    assert run({**clean, "GRPC_EXPERIMENTS": "-something_else"}) == "-something_else"
