"""Agent segments made in worker processes, for a backup that reads many agents.

``segment_workers`` (the daemon's side and the worker's work), ``segment_worker_main``
(the worker process's entry point, ``python -m
machine.backups.workers.segment_worker_main``) and ``pool`` (the worker processes
for CPU-heavy batch work). Kept light: a worker imports this package and
``segment_workers`` alone, never the daemon's configuration.

May import: what ``machine.backups`` may (``machine.storage``,
``machine.formats``, ``shared``), nothing of the daemon's wiring.
"""

__all__ = ["pool", "segment_worker_main", "segment_workers"]
