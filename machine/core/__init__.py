"""The conversation core: agents, their runs and the events runs stream.

``agents`` (create, list, rename, archive, search), ``runs`` (a prompt becomes a
run through the agent's runtime), ``recorder`` (each event committed, then
published), ``feed`` (readers waiting for events), ``run_reader`` (replay then
live), ``run_recovery`` (runs open at a restart), ``permissions`` (the broker a
run waits on), ``runtime_cache`` (one runtime per agent), ``attachments``,
``streams`` (bounds on open streams) and ``search_indexer`` (restored histories
loaded and indexed in the background).

May import: ``machine.storage``, ``machine.formats``, ``machine.runtimes``, the
leaves ``machine.models``/``metrics``/``version``, ``shared``. Never backups,
the link, schedules, erasure, the API or the CLI.
"""

__all__ = [
    "agents",
    "attachments",
    "feed",
    "permissions",
    "recorder",
    "run_reader",
    "run_recovery",
    "runs",
    "runtime_cache",
    "search_indexer",
    "streams",
]
