"""Entry point of a segment worker process (``python -m machine.backups.segment_worker_main``).

Its own module so that ``-m`` runs a module nothing else imported first
(machine.backups.segment_workers is imported with the package); see that module.
"""

from machine.backups.segment_workers import main

if __name__ == "__main__":
    main()
