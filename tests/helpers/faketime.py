"""Run a real process with its wall clock moved: Debian's libfaketime.

``faketime_env("+8d")`` is the environment that makes a child see the wall
clock 8 days ahead (``-1d``: a day behind) while its monotonic clock stays
true, so timers and deadlines inside it behave. The thread-safe build is
preloaded (gRPC and the daemons run threads), into that process only and
whatever it starts. scripts/test installs the package.
"""

from __future__ import annotations

import glob

__all__ = ["faketime_env", "libfaketime"]


def libfaketime() -> str:
    """The thread-safe libfaketime's path; AssertionError naming the package if missing."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
    if not found:
        raise AssertionError("libfaketime not found: install it with `apt-get install -y faketime`")
    return found[0]


def faketime_env(offset: str) -> dict[str, str]:
    """Environment entries that shift a child's wall clock by ``offset`` (``+8d``)."""
    return {
        "LD_PRELOAD": libfaketime(),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
