"""The machine daemon (`agents-machine`): agents, runs, runtimes, store and CLI.

Public entry points live in their modules: :func:`machine.daemon.serve`,
:func:`machine.cli.main`, :class:`machine.config.MachineConfig`.

Nothing is imported here eagerly: a backup's segment worker process imports
``machine.segment_workers`` alone, and the configuration (with what it pulls
in: gRPC stubs, TLS, metrics) cost each worker about 0.25 s of CPU at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from machine.config import MachineConfig
    from machine.version import machine_version

__all__ = ["MachineConfig", "machine_version"]


def __getattr__(name: str) -> Any:
    if name == "MachineConfig":
        from machine.config import MachineConfig

        return MachineConfig
    if name == "machine_version":
        from machine.version import machine_version

        return machine_version
    raise AttributeError(f"module 'machine' has no attribute {name!r}")
