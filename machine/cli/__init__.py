"""``agents-machine``: the CLI, on top of everything.

``main`` (the parser, ``main()``, the COMMANDS table), ``daemon_verbs``
(serve, status, check), ``joining`` (join and its re-pair paths), ``agents``,
``backup`` (also export and import) and ``schedules`` (the verb groups),
``common`` (what every command shares), ``client`` (the typed client of the
local daemon), ``after_join`` (restore and first backup after a repair join)
and ``service_unit`` (``join --install-service``). Only this room prints and
chooses exit codes.

May import: every room and entry module of ``machine``, ``shared``. Nothing
imports it.
"""

from __future__ import annotations

__all__ = [
    "entry",
    "after_join",
    "agents",
    "backup",
    "client",
    "common",
    "daemon_verbs",
    "joining",
    "main",
    "schedules",
    "service_unit",
]


def entry(argv: list[str] | None = None) -> int:
    """The ``agents-machine`` console script: a closed stdout is refused before the CLI (and
    gRPC with it) is loaded, and gRPC's log verbosity set (:mod:`shared.entry`); then
    :func:`machine.cli.main.main`."""
    from shared.entry import quiet_grpc, stdout_closed

    if stdout_closed("agents-machine"):
        return 2  # a usage error: nothing was done
    quiet_grpc()
    from machine.cli.main import main

    return main(argv)
