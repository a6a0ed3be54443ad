"""The version of the installed platform, as both daemons report it.

Read once from the installed distribution's metadata; a source tree that is
not installed reports ``"unknown"``.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Final

__all__ = ["DISTRIBUTION", "package_version"]

logger = logging.getLogger(__name__)

#: The distribution whose version is reported.
DISTRIBUTION: Final = "agents-platform"


@functools.cache
def package_version() -> str:
    """The installed ``agents-platform`` version, or ``"unknown"``; computed once."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
