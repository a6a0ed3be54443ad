"""The version this machine reports (status, join, heartbeats).

Read once from the installed distribution's metadata; a source tree that is
not installed reports ``"unknown"``.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version

__all__ = ["DISTRIBUTION", "machine_version"]

logger = logging.getLogger(__name__)

#: The distribution whose version is reported.
DISTRIBUTION = "agents-platform"


@functools.cache
def machine_version() -> str:
    """The installed ``agents-platform`` version, or ``"unknown"``; computed once."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
