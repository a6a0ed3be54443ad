"""What a console script checks and sets before it loads anything.

Started with descriptor 1 closed (``cmd >&-``), Python leaves ``sys.stdout``
None, and the next descriptor opened takes number 1: loading gRPC made that its
poller's, and the process could end in SIGABRT when "stdout" was touched
again. So each CLI's entry point refuses a closed stdout first, with the
standard library alone, and imports the CLI only after.

gRPC reads its experiments and its C core's log verbosity from the
environment once, as it is imported, so :func:`use_grpc_experiments` and
:func:`quiet_grpc` run before that too.
"""

from __future__ import annotations

import os
import sys
from typing import Final

__all__ = [
    "GRPC_EXPERIMENTS",
    "GRPC_VERBOSITY",
    "quiet_grpc",
    "stdout_closed",
    "use_grpc_experiments",
]

#: The gRPC experiments the control plane runs with (``GRPC_EXPERIMENTS``): its
#: listeners on gRPC's own pollers instead of the EventEngine listener, which
#: hands every read to another thread. Measured with 500 links, one heartbeat a
#: second each and spread over it as a fleet's are (bench/connect.py): 300 us of
#: control-plane CPU per heartbeat with the EventEngine listener, 230 us without;
#: a bare gRPC mutual-TLS server 245 and 150. gRPC names an experiment it does not
#: know in one error line at start (tests/shared/test_entry.py watches for it).
GRPC_EXPERIMENTS: Final = "-event_engine_listener"


#: How much gRPC's C core logs (``GRPC_VERBOSITY``): its ``E…`` lines only. Its
#: ``I…``/``D…`` lines bypass Python's logging (and so ``--log-format json``); an
#: operator chasing a gRPC problem sets ``GRPC_VERBOSITY=debug`` (and
#: ``GRPC_TRACE``) in the environment, which wins.
GRPC_VERBOSITY: Final = "ERROR"


def quiet_grpc() -> None:
    """Run gRPC's C core at :data:`GRPC_VERBOSITY` unless the environment names its own."""
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)


def use_grpc_experiments() -> None:
    """Run gRPC with :data:`GRPC_EXPERIMENTS` unless the environment names its own."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)


def stdout_closed(prog: str) -> bool:
    """True (the refusal printed on stderr) when the process started with stdout closed."""
    if sys.stdout is not None:
        return False
    if sys.stderr is not None:
        sys.stderr.write(f"{prog}: stdout is closed; nothing was done (redirect it: > /dev/null)\n")
        sys.stderr.flush()
    return True
