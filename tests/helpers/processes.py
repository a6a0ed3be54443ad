"""Stopping a process a test started: SIGTERM, a deadline, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess

__all__ = ["stop_process"]


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM ``proc`` (the daemons drain on it), wait up to ``grace`` seconds,
    then kill it; return once it has exited. A process that exited already is left."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)
