"""The machine daemon (`agents-machine`): agents, runs, runtimes, store and CLI.

Public entry points live in their modules: :func:`machine.daemon.serve`,
:func:`machine.cli.main`, :class:`machine.config.MachineConfig`.
"""

from machine.config import MachineConfig
from machine.version import machine_version

__all__ = ["MachineConfig", "machine_version"]
