"""Entry point of a segment worker process (``python -m machine.segment_worker_main``).

Its own module so that ``-m`` runs a module nothing else imported first
(machine.segment_workers is imported with the package); see that module.
"""

from machine.segment_workers import main

if __name__ == "__main__":
    main()
