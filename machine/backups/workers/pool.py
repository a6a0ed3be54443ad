"""Worker processes for the daemon's CPU-heavy batch work (backups, restores).

In the daemon's process, work that reads SQLite row by row lets go of the
interpreter lock on every row; with threads compressing, decrypting or
sending beside it, the lock changes hands hundreds of thousands of times,
which costs more CPU than the work and slows the event loop that serves live
traffic. A few worker processes (a fresh interpreter each, ``python -m
<module>``: nothing of the daemon's threads, sockets or main module
inherited) do such work for one operation and stop with it.

The protocol is lines on the worker's stdin and stdout. The daemon first sends
the settings as one JSON line (secrets such as keys go through the pipe, never
argv or the environment, which other users may read), then one JSON request
per line. The worker answers each, in order, with one JSON line, followed by
``size`` bytes when the line has a ``size``. Workers die with the daemon
(``PR_SET_PDEATHSIG`` on Linux), are killed when the operation ends early,
and stop at the end of their stdin.

Worker side: :func:`serve`. Daemon side: :class:`WorkerPool`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Final

from shared.errors import StoreError

__all__ = ["Answer", "Handler", "WorkerGone", "WorkerPool", "serve"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1
_F_SETPIPE_SZ: Final = 1031
#: The answer pipe's size (Linux lets any user make one up to 1 MiB): room for
#: a whole answer, so a worker goes on while the daemon is busy.
_PIPE_SIZE: Final = 1024 * 1024

Answer = tuple[dict[str, Any], bytes]
"""An answer's JSON object and the bytes that follow it (may be empty)."""
Handler = Callable[[dict[str, Any]], Answer]


class WorkerGone(StoreError):
    """The worker process ended before answering."""


# -- in the worker process ---------------------------------------------------


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The daemon may have gone before prctl: then nobody is left to answer.
    if os.getppid() == 1:
        os._exit(1)


def serve(start: Callable[[dict[str, Any]], Handler]) -> None:
    """Be a worker: ``start(settings)`` gives the handler of each request."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    with contextlib.suppress(OSError):
        fcntl.fcntl(answers.fileno(), _F_SETPIPE_SZ, _PIPE_SIZE)
    handle = start(json.loads(requests.readline()))
    while line := requests.readline():
        answer, data = handle(json.loads(line))
        if data:
            answer = {**answer, "size": len(data)}
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.write(data)
        answers.flush()


# -- in the daemon -----------------------------------------------------------


class _Worker:
    """One worker process: requests written as they come, answers read in order.

    A worker has its next request waiting, so it does not idle while the
    daemon handles the answer before. Answers are read by one task, also
    those of a caller cancelled meanwhile: the worker stays in step.
    """

    def __init__(
        self, proc: asyncio.subprocess.Process, dropped: Callable[[dict[str, Any]], None]
    ) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._requests = proc.stdin
        self._answers = proc.stdout
        self._dropped = dropped
        self._pending: collections.deque[asyncio.Future[Answer]] = collections.deque()
        self._reader = asyncio.create_task(self._read())

    @property
    def load(self) -> int:
        return len(self._pending)

    def send(self, message: dict[str, Any]) -> None:
        self._requests.write(json.dumps(message).encode() + b"\n")

    async def request(self, message: dict[str, Any]) -> Answer:
        if self._reader.done():  # no one reads its answers any more
            raise WorkerGone("a worker process exited")
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending.append(future)
        try:
            self.send(message)
            await self._requests.drain()
        except ConnectionError:
            pass  # it is gone: its reader tells every waiter, this one too
        return await future

    async def _read(self) -> None:
        while self._pending or not self._requests.is_closing():
            try:
                line = await self._answers.readline()
                if not line:
                    break
                answer = json.loads(line)
                data = await self._answers.readexactly(answer["size"]) if "size" in answer else b""
            except Exception as e:  # out of step: every waiter is told
                self._fail(StoreError(f"a worker process answered badly ({e})"))
                return
            future = self._pending.popleft()
            if future.done():  # its caller is gone
                self._dropped(answer)
            else:
                future.set_result((answer, data))
        code = await self.proc.wait()
        self._fail(WorkerGone(f"a worker process exited (code {code})"))

    def _fail(self, error: Exception) -> None:
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    async def stop(self, *, kill: bool) -> None:
        if kill:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        else:
            self._requests.close()  # the end of its stdin: it exits
        code = await self.proc.wait()
        await asyncio.gather(self._reader, return_exceptions=True)
        if not kill and code != 0:
            # What it finished on the way out (a pack's fsync) may not have happened.
            raise WorkerGone(f"a worker process exited with status {code}")


class WorkerPool:
    """``count`` workers running ``python -m module``; ``async with`` it, then
    :meth:`request`. Leaving the block early (a failure, a cancellation) kills
    the workers rather than waiting for what they are on.

    ``dropped(answer)`` is told of each answer whose caller was cancelled
    (to remove a file the answer names, say).
    """

    def __init__(
        self,
        module: str,
        settings: dict[str, Any],
        *,
        count: int,
        dropped: Callable[[dict[str, Any]], None] = lambda answer: None,
    ) -> None:
        self._module = module
        self._settings = settings
        self._count = count
        self._dropped = dropped
        self._workers: list[_Worker] = []

    async def __aenter__(self) -> WorkerPool:
        try:
            for _ in range(self._count):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    self._module,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
                worker = _Worker(proc, self._dropped)
                self._workers.append(worker)
                worker.send(self._settings)
        except BaseException:
            await self._stop(kill=True)
            raise
        logger.info("%d worker processes started (%s)", self._count, self._module)
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self._stop(kill=exc_type is not None)

    async def _stop(self, *, kill: bool) -> None:
        workers, self._workers = self._workers, []
        # Every worker has ended before any failure is raised.
        results = await asyncio.gather(
            *(w.stop(kill=kill) for w in workers), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def request(self, message: dict[str, Any]) -> Answer:
        """Send ``message`` to the least busy worker; its answer."""
        assert self._workers, "use WorkerPool inside 'async with'"
        return await min(self._workers, key=lambda w: w.load).request(message)


def processes() -> int:
    """Workers for this machine: one per core, at most four."""
    return max(1, min(4, os.cpu_count() or 1))
