"""The machine daemon (`agents-machine`), one package (a room) per capability.

Bottom to top: ``formats`` (export, sealed backups, cron), ``storage``
(machine.db and its SQL), ``runtimes``, ``core`` (agents, runs, events),
``schedules``, ``erasure`` (and retention), ``link`` (identity, join, live link),
``backups`` (and export/import), ``api`` (the gRPC servicer), ``cli``. Entry
modules beside them: ``app`` (the domain wired together), ``daemon`` (the gRPC
server), ``config``, and the leaves every room may use: ``models``, ``metrics``,
``version``. docs/architecture.md walks a prompt and a backup through them;
tests/layout/test_import_rules.py keeps the import rules.

Nothing is imported here eagerly: a backup's segment worker process imports
``machine.backups.workers.segment_workers`` alone, and the configuration (with what it
pulls in: gRPC stubs, TLS, metrics) cost each worker about 0.25 s of CPU at start.
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
