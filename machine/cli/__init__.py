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

__all__ = [
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
