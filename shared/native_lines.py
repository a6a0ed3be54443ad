"""gRPC's own log lines, in the daemon's log when it logs JSON.

gRPC's C core writes its lines (``E1205 09:38:46.619941  14428
ssl_transport_security.cc:2563] Handshake failed …``) straight to file
descriptor 2, past Python's logging, so a daemon run with ``--log-format
json`` would mix them, unparsed, into its JSON lines. :func:`route` points
descriptor 2 at a pipe and reads it on a thread:

- a line in that shape becomes a record of the ``grpc`` logger, at the level
  its first letter names (E, W, I; anything else DEBUG), with ``source``
  (``file.cc:line``): the daemon's formatter writes it like any other;
- any other line (a crash dump from ``faulthandler``, a child process that
  shares our stderr) goes to the real stderr unchanged, so nothing a crash
  says is lost to a parser;

and returns the stream the daemon's own handler must write to (a copy of the
real stderr, which ``sys.stderr`` also becomes: Python's own last-resort
tracebacks stay whole). The level gRPC runs at is still
:data:`shared.entry.GRPC_VERBOSITY` (``ERROR``) unless the environment says
otherwise: routing decides where its lines go, not how many there are.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from typing import IO, Final

__all__ = ["route"]

logger = logging.getLogger("grpc")

_LINE: Final = re.compile(
    rb"(?P<level>[EWID])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (?P<source>[^\]\s]+)\] (?P<message>.*)"
)
_LEVELS: Final = {b"E": logging.ERROR, b"W": logging.WARNING, b"I": logging.INFO}
#: Seconds the process waits at exit for lines still in the pipe.
_DRAIN: Final = 2.0


def _pump(pipe: IO[bytes], raw: IO[str]) -> None:
    for line in pipe:
        m = _LINE.fullmatch(line.rstrip(b"\r\n"))
        if m is None:
            with contextlib.suppress(OSError, ValueError):
                raw.write(line.decode("utf-8", "replace"))
                raw.flush()
            continue
        logger.log(
            _LEVELS.get(m["level"], logging.DEBUG),
            "%s",
            m["message"].decode("utf-8", "replace"),
            extra={"source": m["source"].decode("utf-8", "replace")},
        )


def route() -> IO[str]:
    """Route descriptor 2 through the pump (see the module doc); return the real
    stderr for the daemon's handler. Undone at exit, after the pipe drains."""
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pipe = os.fdopen(read_fd, "rb")
    thread = threading.Thread(target=_pump, args=(pipe, real), name="native-lines", daemon=True)
    thread.start()
    sys.stderr = real

    def undo() -> None:
        # Descriptor 2 back on the real stderr closes our last write end of the
        # pipe: the pump reads what is left, then the end of it.
        os.dup2(real.fileno(), 2)
        thread.join(_DRAIN)

    atexit.register(undo)
    return real
