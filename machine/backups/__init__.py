"""Backups and transfer: agents leaving the machine and coming back.

``engine`` (make, list, verify, fetch, prune sealed backups over a target),
``writer`` (encoding and sending new segments), ``segment_workers``,
``segment_worker_main`` and ``worker_pool`` (segments made in worker processes),
``keys`` (the keys backups are sealed and named with), ``service`` (when backups
run, where they go, what is reported), ``link_target`` (a joined server's
backups kept by the control plane), ``transfer`` (export, import, the backup
source, restore) and ``handoff`` (``Outgoing/`` and ``Incoming/``).

May import: ``machine.core``, ``machine.storage``, ``machine.formats``,
``machine.link`` (the link client and identity), the leaves, ``shared``.
Nothing here is imported by the core, storage or the link.
"""

__all__ = [
    "engine",
    "handoff",
    "keys",
    "link_target",
    "segment_worker_main",
    "segment_workers",
    "service",
    "transfer",
    "worker_pool",
    "writer",
]
