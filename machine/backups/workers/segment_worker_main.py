"""A segment worker's entry point: ``python -m machine.backups.workers.segment_worker_main``.

Its own module so that ``-m`` runs a module nothing else imported first
(machine.backups.workers.segment_workers is imported with the package); see that module.
"""

from machine.backups.workers.segment_workers import main

if __name__ == "__main__":
    main()
