"""Backups and transfer: agents leaving the machine and coming back.

``engine`` (make and prune sealed backups over a target), ``increments``
(continuous backups: an increment of what changed since the chain's newest
backup), ``chain`` (restoring to a time: a point and the increments
continuing it, merged), ``reader`` (list, open, verify and fetch them),
``source`` (what a backup reads: the contract and the machine's database as
one), ``writer`` (encoding and sending new segments),
``workers/`` (segments made in worker processes: ``segment_workers``, their
entry point ``segment_worker_main``, the process ``pool``), ``keys`` (the keys
backups are sealed and named with), ``service`` (when backups run, where they
go, what is reported), ``wiring`` (the target chosen and the service built from
the machine's settings), ``targets/`` (``folder``: the stand-alone backup
folder, checked, its owner named, a copied one opened; ``control_plane``: a
joined server's backups kept by the control plane), ``transfer`` (export,
import and the commit every arrival goes through), ``restore`` (a fetched
backup's agents committed) and ``handoff`` (``Outgoing/`` and ``Incoming/``).

May import: ``machine.core``, ``machine.storage``, ``machine.formats``,
``machine.link`` (the link client and identity), the leaves, ``shared``.
Nothing here is imported by the core, storage or the link.
"""

__all__ = [
    "chain",
    "engine",
    "handoff",
    "increments",
    "keys",
    "reader",
    "restore",
    "service",
    "source",
    "targets",
    "transfer",
    "wiring",
    "workers",
    "writer",
]
