"""Erasure and retention: what leaves the machine, and when.

``service`` (an archived agent's rows, bytes and runtime copy erased, the erased
list, the runtime erasure queue), ``retention`` (the sweeps at start and on the
prune timer: machine log, unnamed attachments, old erased-list entries, the
export/import folders through a small ``Sweeper`` interface).

May import: ``machine.core``, ``machine.storage``, ``machine.formats``,
``machine.runtimes``, the leaves, ``shared``. Never backups or the link.
"""

__all__ = ["retention", "service"]
