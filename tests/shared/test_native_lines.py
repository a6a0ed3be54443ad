"""gRPC's C-core lines become JSON records when a daemon logs JSON; other lines pass whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, os, sys
from shared.logs import setup_logging
setup_logging("info", sys.argv[1], native=True)
logging.getLogger("ours").warning("ours")
import grpc
grpc.insecure_channel("127.0.0.1:1").close()  # gRPC starts: at INFO it warns on fd 2
os.write(2, b"a raw line\\n")
os.write(2, b"E1205 09:38:46.619941   14428 ssl_transport_security.cc:2563] Handshake failed\\n")
"""


def _run(fmt: str) -> list[str]:
    env = {**os.environ, "GRPC_VERBOSITY": "INFO", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, fmt],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == ""
    return done.stderr.splitlines()


def test_json_daemon_logs_grpc_lines_as_records_and_passes_other_lines_whole() -> None:
    lines = _run("json")
    assert "a raw line" in lines  # not ours, not gRPC's: unchanged
    records = [json.loads(line) for line in lines if line != "a raw line"]
    assert [r["logger"] for r in records if r["logger"] == "ours"] == ["ours"]
    grpc_records = [r for r in records if r["logger"] == "grpc"]
    assert {"level": "ERROR", "message": "Handshake failed"}.items() <= grpc_records[-1].items()
    assert grpc_records[-1]["source"] == "ssl_transport_security.cc:2563"
    # gRPC's own start-up warning (the INFO level) came through the pipe too.
    assert any(r["level"] == "WARNING" and r["source"].startswith("log.cc") for r in grpc_records)


@pytest.mark.parametrize("fmt", ["text"])
def test_text_daemon_leaves_descriptor_2_alone(fmt: str) -> None:
    lines = _run(fmt)
    assert any(line.startswith("E1205 09:38:46.619941") for line in lines)
    assert any(line.endswith("WARNING ours: ours") for line in lines)
