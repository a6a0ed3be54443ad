"""Agent segments made in worker processes, for a backup that reads many agents.

Making an agent's segment is a database dump (Python), a tar, a keyed hash and
zstd. In the daemon's process the dump's reader thread lets go of the GIL on
every row SQLite steps to, so the threads that compress, encrypt and send take
it back and forth hundreds of thousands of times in a full backup: that costs
more CPU than the work, and starves the event loop that serves live prompts
meanwhile. A few worker processes (a fresh interpreter each, nothing of the
daemon's threads, sockets or main module inherited; the entry point is
:mod:`machine.segment_worker_main`) each open the database read-only and make
whole segments: one read transaction per agent, as the in-process path does,
and the same bytes (:func:`dump_agent_spooled` is both's).

The protocol is lines on the worker's stdin and stdout. The daemon first sends
the settings as one JSON line (the naming key goes through the pipe, never argv
or the environment, which other users may read), then one agent id per line.
For each the worker answers a JSON line, then for a made segment its stored
bytes (compressed, then encrypted under the segment's key, as the daemon
would): ``{"name", "plain", "size"}`` and ``size`` bytes, or ``{"name",
"plain", "path"}`` for one past :data:`_IN_PIPE` written to a file in the
backup's private stage folder, or ``{"refused": [field, reason]}`` /
``{"failed": message}``. The daemon sends them as they are. Workers die with
the daemon (``PR_SET_PDEATHSIG`` on Linux), are killed when the backup ends
early, and stop at the end of their stdin.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import io
import json
import logging
import os
import signal
import sqlite3
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from machine.backup_format import SegmentCompressor, encrypt_segment, segment_key
from machine.export_format import AGENT_FILES, OPTIONAL_AGENT_FILES, agent_path
from machine.store import export as store_export
from shared.archive import write_tar
from shared.atomic import FILE_MODE
from shared.errors import InvalidArgument, StoreError

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_AGENTS",
    "MadeSegment",
    "SegmentWorkers",
    "processes",
    "dump_agent_spooled",
]

#: Agents to (re)encode from which a backup starts workers. Starting one (an
#: interpreter and its imports) costs about 0.2 s of CPU; below this a backup
#: takes well under a second in the daemon's process either way.
MIN_AGENTS: Final = 32
#: Compressed bytes a worker hands back through the pipe; past it, a file.
_IN_PIPE: Final = 8 * 1024 * 1024
#: A dumped export file kept in memory up to this size (then a temp file).
_SPOOL: Final = 1024 * 1024
_PR_SET_PDEATHSIG: Final = 1
_F_SETPIPE_SZ: Final = 1031
#: The answer pipe's size (Linux lets any user make one up to 1 MiB).
_PIPE_SIZE: Final = 1024 * 1024


def processes() -> int:
    """Workers for this machine: one per core, at most four."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class MadeSegment:
    """One agent's segment as made: its name, plaintext size and stored bytes."""

    name: str
    plain_size: int
    stored: bytes | Path
    """Its bytes as stored (compressed and encrypted under its key), or a file of
    them (in the stage folder) that the caller now owns and removes."""


def dump_agent_spooled(
    conn: sqlite3.Connection, agent_id: str, stack: contextlib.ExitStack, work_dir: Path
) -> list[tuple[str, IO[bytes]]]:
    """Dump ``agent_id`` (one read of ``conn``: call it inside one read transaction)
    into spooled files closed with ``stack``; return them as its segment's tar entries.

    Spooled (in memory, on disk past :data:`_SPOOL`) because a tar header names
    its file's size before the file. Write the entries with
    :func:`shared.archive.write_tar`: that is the agent's plaintext segment.
    """
    spools: dict[str, IO[bytes]] = {}

    def spool(name: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        # Made when the dump opens the file: optional files only when written.
        if name not in spools:
            spools[name] = stack.enter_context(
                tempfile.SpooledTemporaryFile(max_size=_SPOOL, mode="w+b", dir=str(work_dir))
            )
        return contextlib.nullcontext(spools[name])

    store_export.dump_agent_to(conn, agent_id, spool)
    names = [*AGENT_FILES, *(n for n in OPTIONAL_AGENT_FILES if n in spools)]
    return [(agent_path(agent_id, n), spools[n]) for n in names]


# -- in the worker process ---------------------------------------------------


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The daemon may have gone before prctl: then nobody is left to answer.
    if os.getppid() == 1:
        os._exit(1)


def _make(
    conn: sqlite3.Connection, agent_id: str, naming_key: bytes, work: Path
) -> tuple[dict[str, Any], bytes]:
    """The answer line for ``agent_id``, and the bytes that follow it."""
    compressed = io.BytesIO()
    compressor = SegmentCompressor(naming_key, compressed)
    try:
        with contextlib.ExitStack() as stack:
            conn.execute("BEGIN")
            try:
                entries = dump_agent_spooled(conn, agent_id, stack, work)
            finally:
                conn.execute("COMMIT")
            write_tar(compressor, entries)  # type: ignore[arg-type]
        name = compressor.finish()
    except InvalidArgument as e:
        return {"refused": [e.field, e.reason]}, b""
    except (sqlite3.Error, OSError) as e:
        return {"failed": f"{type(e).__name__}: {e}"}, b""
    key = segment_key(naming_key, name)
    data = b"".join(encrypt_segment([compressed.getvalue()], name=name, key=key))
    if len(data) <= _IN_PIPE:
        return {"name": name, "plain": compressor.plain_size, "size": len(data)}, data
    fd, path = tempfile.mkstemp(dir=work, prefix=".made-")
    with open(fd, "wb") as f:
        os.fchmod(f.fileno(), FILE_MODE)
        f.write(data)
    return {"name": name, "plain": compressor.plain_size, "path": path}, b""


def main() -> None:
    """Serve one backup's agents on stdin/stdout (see the module doc)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    with contextlib.suppress(OSError):
        # Room for a whole answer or more in the pipe: the worker goes on to the
        # next agent while the daemon is busy, instead of waiting for it to read.
        fcntl.fcntl(answers.fileno(), _F_SETPIPE_SZ, _PIPE_SIZE)
    settings = json.loads(requests.readline())
    uri = f"file:{urllib.parse.quote(settings['db'])}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 30000")
    naming_key, work = bytes.fromhex(settings["naming_key"]), Path(settings["work"])
    while line := requests.readline():
        answer, data = _make(conn, line.decode().strip(), naming_key, work)
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.write(data)
        answers.flush()


# -- in the daemon -----------------------------------------------------------


class _WorkerGone(StoreError):
    """The worker process ended before answering."""


class _Worker:
    """One worker process: requests written as they come, answers read in order.

    A worker always has its next request waiting, so it never idles while
    the daemon handles the answer before. Answers are read by one task, also
    those of a caller that was cancelled meanwhile: the worker stays in step.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        assert proc.stdin is not None and proc.stdout is not None
        self._requests = proc.stdin
        self._answers = proc.stdout
        self._pending: collections.deque[tuple[str, asyncio.Future[MadeSegment]]] = (
            collections.deque()
        )
        self._reader = asyncio.create_task(self._read())

    @property
    def load(self) -> int:
        return len(self._pending)

    def send(self, line: bytes) -> None:
        self._requests.write(line)

    async def make(self, agent_id: str) -> MadeSegment:
        if self._reader.done():  # no one reads its answers any more
            raise _WorkerGone(f"back up agent {agent_id}: a segment worker exited")
        future: asyncio.Future[MadeSegment] = asyncio.get_running_loop().create_future()
        self._pending.append((agent_id, future))
        try:
            self._requests.write(agent_id.encode() + b"\n")
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
                agent_id, future = self._pending.popleft()
                made = await self._answer(agent_id, json.loads(line))
            except Exception as e:  # an answer out of step: every waiter is told
                self._fail(StoreError(f"back up: a segment worker answered badly ({e})"))
                return
            if future.done():  # its caller is gone: nothing may be left behind
                if isinstance(made, MadeSegment) and isinstance(made.stored, Path):
                    made.stored.unlink(missing_ok=True)
            elif isinstance(made, BaseException):
                future.set_exception(made)
            else:
                future.set_result(made)
        code = await self.proc.wait()
        self._fail(_WorkerGone(f"back up: a segment worker exited (code {code})"))

    async def _answer(self, agent_id: str, answer: dict[str, Any]) -> MadeSegment | Exception:
        if "refused" in answer:
            return InvalidArgument(*answer["refused"])
        if "failed" in answer:
            return StoreError(f"back up agent {agent_id}: {answer['failed']}")
        if "path" in answer:
            return MadeSegment(answer["name"], answer["plain"], Path(answer["path"]))
        data = await self._answers.readexactly(answer["size"])
        return MadeSegment(answer["name"], answer["plain"], data)

    def _fail(self, error: Exception) -> None:
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(error)

    async def stop(self, *, kill: bool) -> None:
        if kill:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        else:
            self._requests.close()  # the end of its stdin: it exits
        await self.proc.wait()
        await asyncio.gather(self._reader, return_exceptions=True)


class SegmentWorkers:
    """Worker processes making agent segments; ``async with`` it, then call it.

    Leaving the block early (a failure, a cancelled backup) kills the workers
    rather than waiting for the agents they are on.
    """

    def __init__(self, db_path: Path, *, naming_key: bytes, work_dir: Path, count: int) -> None:
        self._settings = {"db": str(db_path), "naming_key": naming_key.hex(), "work": str(work_dir)}
        self._count = count
        self._workers: list[_Worker] = []
        #: Agents to have in hand at once: one in each worker, one waiting each.
        self.parallel = 2 * count

    async def __aenter__(self) -> SegmentWorkers:
        try:
            for _ in range(self._count):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "machine.segment_worker_main",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
                worker = _Worker(proc)
                self._workers.append(worker)
                worker.send(json.dumps(self._settings).encode() + b"\n")
        except BaseException:
            await self._stop(kill=True)
            raise
        logger.info("backup: %d segment worker processes started", self._count)
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self._stop(kill=exc_type is not None)

    async def _stop(self, *, kill: bool) -> None:
        workers, self._workers = self._workers, []
        await asyncio.gather(*(w.stop(kill=kill) for w in workers))

    async def __call__(self, agent_id: str) -> MadeSegment:
        """Make ``agent_id``'s segment in the least busy worker."""
        assert self._workers, "use SegmentWorkers inside 'async with'"
        return await min(self._workers, key=lambda w: w.load).make(agent_id)
