"""What a console script checks before it loads anything.

Started with descriptor 1 closed (``cmd >&-``), Python leaves ``sys.stdout``
None, and the next descriptor opened takes number 1: loading gRPC made that its
poller's, and the process could end in SIGABRT when "stdout" was touched
again. So each CLI's entry point refuses a closed stdout first, with the
standard library alone, and imports the CLI only after.
"""

from __future__ import annotations

import sys

__all__ = ["stdout_closed"]


def stdout_closed(prog: str) -> bool:
    """True (the refusal printed on stderr) when the process started with stdout closed."""
    if sys.stdout is not None:
        return False
    if sys.stderr is not None:
        sys.stderr.write(f"{prog}: stdout is closed; nothing was done (redirect it: > /dev/null)\n")
        sys.stderr.flush()
    return True
