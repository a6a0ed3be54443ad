"""The version this machine reports (status, join, heartbeats).

The platform's version (:func:`shared.version.package_version`): read once
from the installed distribution's metadata, ``"unknown"`` for a source tree
that is not installed.
"""

from __future__ import annotations

import logging
from typing import Final

from shared.version import DISTRIBUTION, package_version

__all__ = ["DISTRIBUTION", "machine_version"]

logger = logging.getLogger(__name__)

#: The installed ``agents-platform`` version, or ``"unknown"``; computed once.
machine_version: Final = package_version
