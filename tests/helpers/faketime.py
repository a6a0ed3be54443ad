"""Run a real process with its wall clock moved: Debian's libfaketime.

``faketime_env("+8d")`` is the environment that makes a child see the wall
clock 8 days ahead (``-1d``: a day behind) while its monotonic clock stays
true, so timers and deadlines inside it behave. The library is preloaded into
that process (and whatever it starts), nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["LIBFAKETIME", "faketime_env"]

LIBFAKETIME: Final = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def faketime_env(offset: str) -> dict[str, str]:
    """Environment entries that shift a child's wall clock by ``offset`` (``+8d``)."""
    if not LIBFAKETIME.exists():
        raise AssertionError(f"{LIBFAKETIME} is missing: install Debian's libfaketime")
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
