"""machine.db access: one writer thread with group commit, one reader thread.

SQLite work never runs on the event loop. Writes are callables queued to a
dedicated writer thread that owns the only writing connection; the thread
takes every write waiting in the queue, runs each in its own SAVEPOINT inside
one transaction and commits once. With ``synchronous=FULL`` that commit is
one fsync for the whole batch, so concurrent appenders share it (group
commit) and a write's future resolves only after its data is on disk.

Reads run on a second connection in a single reader thread; WAL mode lets
them proceed while the writer commits. A read always ends its statements and
its transaction, whatever the reading code raised (see :class:`_Reader`).

Storage faults become our errors at this edge (:mod:`machine.storage.faults`): a
full disk is DiskFull, a damaged file DatabaseDamaged. The file gets a
``quick_check`` before it is opened for writing, unless the last stop was clean
and left it untouched since (:mod:`machine.storage.clean_stop`); once it is known
to be damaged every write is refused.

Every queued write is answered: a batch that fails for any reason fails all
its jobs, the commit observer cannot break the writer, and once the writer
thread has stopped, :meth:`Database.write` raises instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from machine.storage import clean_stop
from machine.storage import faults as dbfaults
from machine.storage.faults import CheckResult
from machine.storage.schema import migrate
from shared.errors import AgentsError, DatabaseDamaged, StoreError

__all__ = ["CommitObserver", "Database"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Called by the writer thread after each commit with (batch size, seconds).
CommitObserver = Callable[[int, float], None]
#: Called (from any thread) with "disk_full" or "damaged" when a storage fault is seen.
FaultObserver = Callable[[str], None]

_MAX_BATCH = 512
#: SQLite's own default: a commit that leaves this many WAL pages checkpoints.
_AUTOCHECKPOINT = 1000


@dataclass
class _Job:
    fn: Callable[[sqlite3.Connection], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    what: str
    bulk: bool = False
    #: Called in the writer thread when the job's changes will not commit (it
    #: raised, or its batch failed), before any later job runs: a stream of
    #: dependent jobs (:class:`machine.core.recorder.RunStream`) stops there.
    on_abort: Callable[[BaseException], None] | None = None
    #: Called on the job's loop right after its future is answered (cheaper than a
    #: done callback: no extra loop turn per job).
    on_done: Callable[[asyncio.Future[Any]], None] | None = None

    def aborted(self, error: BaseException) -> None:
        """Tell ``on_abort`` (once) that this job will not commit."""
        on_abort, self.on_abort = self.on_abort, None
        if on_abort is not None:
            try:
                on_abort(error)
            except Exception:
                logger.exception("machine.db abort observer failed")


class _ReaderConnection(sqlite3.Connection):
    """The reader connection: remembers every cursor a read opens.

    A cursor left mid-iteration (a reader that raised, or returned early)
    keeps its statement active, and an active statement keeps the connection's
    WAL snapshot after COMMIT: every later read would see the database as it
    was then. :meth:`Database.read` closes them all when the read ends.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opened: list[sqlite3.Cursor] = []

    def cursor(self, factory: Any = sqlite3.Cursor) -> Any:
        cur = super().cursor(factory)
        self.opened.append(cur)
        return cur

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        # The C implementation does not go through cursor(): route it there.
        cur: sqlite3.Cursor = self.cursor().execute(sql, parameters)
        return cur

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        cur: sqlite3.Cursor = self.cursor().executemany(sql, parameters)
        return cur

    def close_cursors(self) -> None:
        """Close (and so reset) every cursor opened since the last call."""
        opened, self.opened = self.opened, []
        for cur in opened:
            cur.close()


def _connect(
    path: Path, factory: type[sqlite3.Connection] = sqlite3.Connection
) -> sqlite3.Connection:
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=30, factory=factory
    )
    conn.row_factory = sqlite3.Row
    # Durability and hygiene settings are per connection (journal_mode is persistent).
    row = conn.execute("PRAGMA journal_mode = WAL").fetchone()
    mode = str(row[0]).lower() if row is not None else "unknown"
    if mode != "wal":
        # SQLite answers with the mode it kept when WAL is impossible (typically a
        # network or otherwise limited filesystem without shared memory); group
        # commit and concurrent reads rely on WAL, so refuse rather than run without.
        conn.close()
        raise StoreError(
            f"open {path}: SQLite cannot use WAL mode on the data folder's filesystem"
            f" (journal_mode stayed {mode!r}); put the data folder on a local filesystem"
        )
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("PRAGMA secure_delete = ON")
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def _deliverable(error: BaseException, where: Path) -> BaseException:
    """``error`` as something a future can carry and a caller can catch.

    A future refuses StopIteration (TypeError, and the caller would wait for
    ever), and BaseExceptions other than cancellation would escape ``except
    Exception`` handlers far from their cause: both become a StoreError.
    """
    if isinstance(error, StopIteration | StopAsyncIteration) or not isinstance(error, Exception):
        wrapped = StoreError(f"write {where}: the write raised {type(error).__name__}")
        wrapped.__cause__ = error
        return wrapped
    return error


_Outcome = tuple[_Job, Any, BaseException | None]


def _settle(job: _Job, result: Any, error: BaseException | None) -> None:
    _settle_all([(job, result, error)])


def _settle_all(outcomes: list[_Outcome]) -> None:
    """Answer each job's future on its own loop: one wake-up per loop for the whole
    batch (a wake-up is a write to the loop's self-pipe), futures set in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for outcome in outcomes:
        job, _, error = outcome
        if error is not None:
            job.aborted(error)
        by_loop.setdefault(job.loop, []).append(outcome)

    def done(answers: list[_Outcome]) -> None:
        for job, result, error in answers:
            # A future already done: its caller went away; the write stands anyway.
            if job.future.done():
                pass
            elif error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)
            if job.on_done is not None:
                try:
                    job.on_done(job.future)
                except Exception:
                    logger.exception("machine.db: a write's completion hook failed")

    for loop, answers in by_loop.items():
        try:
            loop.call_soon_threadsafe(done, answers)
        except RuntimeError:  # loop closed during shutdown
            pass


class _Reader:
    """The reader thread and its connection.

    Every read ends its statements and its transaction, whatever the reading
    code raised; if even that fails, the connection is replaced (a connection
    left in a read transaction would serve a stale snapshot for ever).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn: sqlite3.Connection | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="machine-db-read")

    def open(self) -> None:
        """Connect (in any thread; before the first read)."""
        self.conn = _connect(self.path, _ReaderConnection)

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one read transaction (in the reader thread)."""
        if self.conn is None:  # replaced after a read that could not be ended
            self.open()
        conn = self.conn
        assert conn is not None
        try:
            conn.execute("BEGIN")
            return fn(conn)
        finally:
            self._end(conn)

    def _end(self, conn: sqlite3.Connection) -> None:
        try:
            if isinstance(conn, _ReaderConnection):
                conn.close_cursors()
            if conn.in_transaction:
                sqlite3.Connection.execute(conn, "COMMIT").close()
        except BaseException as e:
            logger.error("ending a read of %s failed (%s): reopening the reader", self.path, e)
            with contextlib.suppress(sqlite3.Error):
                conn.close()
            self.conn = None  # the next read opens a fresh one

    async def close(self) -> None:
        """Close the connection in the reader thread, then stop the thread."""
        conn = self.conn
        if conn is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, conn.close)
        self.executor.shutdown(wait=True)
        self.conn = None


class Database:
    """The machine database. Use :meth:`open`, then :meth:`write`/:meth:`read`."""

    def __init__(
        self,
        path: Path,
        *,
        on_commit: CommitObserver | None = None,
        on_fault: FaultObserver | None = None,
    ) -> None:
        self.path = path
        self.schema_version = 0
        self._on_commit = on_commit
        self._on_fault = on_fault
        # Why the file is known to be damaged (None: not known to be). Once set,
        # writes are refused: writing into a damaged b-tree can spread the damage.
        self.damaged: str | None = None
        #: The quick_check run when the file was opened (None for a new, empty file,
        #: or one the last clean stop left untouched: see ``after_clean_stop``).
        self.open_check: CheckResult | None = None
        #: The file was opened without a check: it is exactly as a clean stop left it.
        self.after_clean_stop = False
        # Set when the writer thread ended other than by close(): no clean-stop mark.
        self._writer_failed = False
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._wconn: sqlite3.Connection | None = None
        self._reader = _Reader(path)
        self._closed = False
        # Guards the hand-over between write() and a stopping writer thread, so
        # no job is queued after the writer's last look at the queue.
        self._accepting_lock = threading.Lock()
        self._accepting = True

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        on_commit: CommitObserver | None = None,
        on_fault: FaultObserver | None = None,
    ) -> Database:
        """Open (creating 0600 if needed), check and migrate the database; start its
        threads. A file that fails SQLite's ``quick_check`` is refused
        (DatabaseDamaged) before anything is written to it; the check is skipped
        for a file exactly as the last clean stop left it."""
        db = cls(path, on_commit=on_commit, on_fault=on_fault)
        await asyncio.to_thread(db._open_sync)
        db._writer = threading.Thread(target=db._write_loop, name="machine-db-write", daemon=True)
        db._writer.start()
        return db

    def _open_sync(self) -> None:
        # Taken first, whatever follows (a chmod changes the file's identity too):
        # a crash from here on leaves no mark behind.
        self.after_clean_stop = clean_stop.take_mark(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        os.chmod(self.path, 0o600)
        if self.path.stat().st_size > 0 and not self.after_clean_stop:
            check = self.open_check = dbfaults.run_check(self.path, full=False)
            if not check.ok:
                self._fault("damaged")
                raise DatabaseDamaged(f"open {self.path.name}", str(self.path), check.problems[0])
            logger.info("%s: quick_check at open: ok (%.2f s)", self.path.name, check.seconds)
        elif self.after_clean_stop:
            logger.info("%s: as the last clean stop left it: no check at open", self.path.name)
        try:
            self._wconn = _connect(self.path)
            self.schema_version = migrate(self._wconn, where=str(self.path))
            self._reader.open()
        except sqlite3.DatabaseError as e:
            self._close_conns()
            raise self._translated(e, f"open {self.path.name}") or StoreError(
                f"open {self.path}: {e}"
            ) from None
        except BaseException:
            self._close_conns()
            raise
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                os.chmod(side, 0o600)

    def _close_conns(self) -> None:
        for conn in (self._wconn, self._reader.conn):
            if conn is not None:
                conn.close()
        self._wconn = self._reader.conn = None

    async def write(
        self, fn: Callable[[sqlite3.Connection], T], *, what: str = "", bulk: bool = False
    ) -> T:
        """Run ``fn(conn)`` in the writer thread inside a transaction; return its result
        once the transaction is committed (fsync'd). If ``fn`` raises, its changes are
        rolled back and the exception is re-raised here; other writes of the batch stand.

        ``bulk`` (a restore or an import: hundreds of MB in one transaction): the
        checkpoint that copies the transaction from the WAL into the database file
        runs after the caller is answered, not inside its commit. The data is
        durable at the commit either way (the WAL is fsync'd); the next write
        waits for the checkpoint instead of this one.

        A full disk raises DiskFull, a damaged file DatabaseDamaged (and every later
        write too); ``what`` names the operation and its target in those errors.
        """
        return await self.submit(fn, what=what, bulk=bulk)

    def submit(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        what: str = "",
        bulk: bool = False,
        on_abort: Callable[[BaseException], None] | None = None,
        on_done: Callable[[asyncio.Future[T]], None] | None = None,
    ) -> asyncio.Future[T]:
        """Queue ``fn`` as :meth:`write` does and return its future at once (call from
        the event loop). Jobs commit in the order they are submitted, so a caller can
        queue several without waiting for each commit and they share one. The future
        resolves once the job's transaction is committed (or failed).

        ``on_abort`` is called in the writer thread, before any later job runs, when
        this job's changes will not commit; ``on_done`` on the loop once its future
        is answered (or was cancelled by its caller). Raises like :meth:`write` when the
        database is closed, damaged or its writer has stopped.
        """
        what = what or f"write {self.path.name}"
        if self._closed:
            raise StoreError(f"write {self.path}: database is closed")
        if self.damaged is not None:
            raise DatabaseDamaged(what, str(self.path), self.damaged)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._accepting_lock:
            if not self._accepting or self._writer is None or not self._writer.is_alive():
                raise StoreError(f"write {self.path}: the database writer has stopped")
            self._queue.put(_Job(fn, future, loop, what, bulk, on_abort, on_done))
        return future

    async def read(self, fn: Callable[[sqlite3.Connection], T], *, what: str = "") -> T:
        """Run ``fn(conn)`` on the reader connection (sees committed data only).

        ``what`` names the operation and its target ("replay agent ag_...") in
        the DiskFull / DatabaseDamaged / IntegrityError a storage fault becomes.
        """
        if self._closed:
            raise StoreError(f"read {self.path}: database is closed")

        def run() -> T:
            if self._closed:
                raise StoreError(f"read {self.path}: database is closed")
            try:
                return self._reader.run(fn)
            except (sqlite3.Error, OSError) as e:
                ours = self._translated(e, what or f"read {self.path.name}")
                if ours is None:
                    raise
                raise ours from e

        return await asyncio.get_running_loop().run_in_executor(self._reader.executor, run)

    async def maintain(self, fn: Callable[[sqlite3.Connection], T], *, what: str = "") -> T:
        """Run ``fn`` on a short-lived connection of its own, outside any transaction.

        For statements SQLite refuses inside one (``PRAGMA wal_checkpoint``);
        ordinary writes go through :meth:`write`. Storage faults become our errors.
        """
        if self._closed:
            raise StoreError(f"maintain {self.path}: database is closed")

        def run() -> T:
            conn = _connect(self.path)
            try:
                return fn(conn)
            except (sqlite3.Error, OSError) as e:
                ours = self._translated(e, what or f"maintain {self.path.name}")
                if ours is None:
                    raise
                raise ours from e
            finally:
                conn.close()

        return await asyncio.to_thread(run)

    def _fault(self, kind: str) -> None:
        if self._on_fault is not None:
            try:
                self._on_fault(kind)
            except Exception:
                logger.exception("machine.db fault observer failed")

    def _translated(self, error: BaseException, what: str) -> AgentsError | None:
        """Our error for a storage fault (see :mod:`machine.storage.faults`), recording
        damage so that writes stop; None for any other error."""
        ours = dbfaults.translate(error, what, self.path)
        if isinstance(ours, DatabaseDamaged):
            self.mark_damaged(dbfaults.damage_reason(error) or ours.reason)
        elif ours is not None and dbfaults.is_disk_full(error):
            self._fault("disk_full")
        return ours

    def mark_damaged(self, reason: str) -> None:
        """Record that the file is damaged: from now on every write is refused."""
        if self.damaged is None:
            logger.error(
                "%s is damaged (%s): refusing writes until it is restored", self.path, reason
            )
            self.damaged = reason
        self._fault("damaged")

    async def check(self, *, full: bool = True) -> CheckResult:
        """Run an integrity check now (``integrity_check``, or ``quick_check``) on a
        connection of its own; problems mark the database damaged."""
        if self._closed:
            raise StoreError(f"check {self.path}: database is closed")
        result = await asyncio.to_thread(dbfaults.run_check, self.path, full=full)
        if not result.ok:
            logger.error(
                "integrity check of %s found %d problem(s)", self.path, len(result.problems)
            )
            self.mark_damaged(result.problems[0])
        return result

    def _write_loop(self) -> None:
        assert self._wconn is not None
        conn = self._wconn
        try:
            self._serve(conn)
        except BaseException:
            self._writer_failed = True
            logger.exception("machine.db writer stopped unexpectedly")
        finally:
            self._stop_accepting()
            if not self._writer_failed and self.damaged is None:
                self._fold_wal(conn)
            try:
                conn.close()
            except sqlite3.Error as e:
                self._writer_failed = True
                logger.error("closing the machine.db writer connection failed: %s", e)

    def _fold_wal(self, conn: sqlite3.Connection) -> None:
        """At a stop: copy the WAL into the file and empty it, so the file alone is
        the database (a connection object still alive elsewhere, not yet collected,
        would keep SQLite from doing it at close). Not done: no clean-stop mark."""
        try:
            # A reader outside this process is not waited for: the stop goes on
            # without a mark, and the next start checks.
            conn.execute("PRAGMA busy_timeout = 0")
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        except sqlite3.Error as e:
            busy, reason = 1, str(e)
        else:
            reason = "a reader was still in the WAL"
        if busy:
            self._writer_failed = True
            logger.warning("machine.db: the WAL was not folded in at stop (%s)", reason)

    def _stop_accepting(self) -> None:
        """Refuse new writes and fail any still queued: nobody waits for ever."""
        with self._accepting_lock:
            self._accepting = False
        failure = StoreError(f"write {self.path}: the database writer has stopped")
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                _settle(job, None, failure)

    def _serve(self, conn: sqlite3.Connection) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < _MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                self._run_batch(conn, batch)
            except BaseException as e:
                # Whatever went wrong, every job of the batch gets an answer and
                # the writer carries on with the next batch.
                logger.exception("machine.db write batch failed")
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.rollback()
                failure = StoreError(f"write {self.path}: {type(e).__name__}")
                for job in batch:
                    _settle(job, None, failure)

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Job]) -> None:
        start = time.perf_counter()
        if self.damaged is not None:  # queued before the damage was found
            for job in batch:
                _settle(job, None, DatabaseDamaged(job.what, str(self.path), self.damaged))
            return
        outcomes: list[_Outcome] = []
        bulk = any(job.bulk for job in batch)
        if bulk:
            conn.execute("PRAGMA wal_autocheckpoint = 0")  # see write(bulk=True)
        try:
            conn.execute("BEGIN IMMEDIATE")
            for job in batch:
                conn.execute("SAVEPOINT job")
                try:
                    result = job.fn(conn)
                except BaseException as e:  # handed to the caller
                    fatal = dbfaults.is_disk_full(e) or dbfaults.damage_reason(e) is not None
                    if fatal or not conn.in_transaction:
                        # A full disk or a damaged file fails the whole batch (its
                        # commit could not succeed either); SQLite may already have
                        # rolled the transaction back.
                        raise
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                    ours = dbfaults.translate(e, job.what, self.path)
                    failure = ours or _deliverable(e, self.path)
                    job.aborted(failure)  # before the batch's later jobs run
                    outcomes.append((job, None, failure))
                else:
                    conn.execute("RELEASE job")
                    outcomes.append((job, result, None))
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            logger.error("machine.db commit failed: %s", e)
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.rollback()
            for job in batch:
                failure = self._translated(e, job.what) or StoreError(f"write {self.path}: {e}")
                _settle(job, None, failure)
            return
        finally:
            if bulk:
                with contextlib.suppress(sqlite3.Error):  # the commit stands either way
                    conn.execute(f"PRAGMA wal_autocheckpoint = {_AUTOCHECKPOINT}")
        elapsed = time.perf_counter() - start
        # Callers first: the data is committed whatever the observer does.
        _settle_all(outcomes)
        if self._on_commit is not None:
            try:
                self._on_commit(len(batch), elapsed)
            except Exception:
                logger.exception("machine.db commit observer failed")
        if bulk:
            self._checkpoint_after_bulk(conn)

    def _checkpoint_after_bulk(self, conn: sqlite3.Connection) -> None:
        """Copy a bulk write's WAL frames into the database file (its callers have
        their answer). A failure only leaves the WAL longer: the next commit's
        automatic checkpoint tries again."""
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as e:
            logger.warning("machine.db: checkpoint after a bulk write failed: %s", e)

    async def close(self) -> None:
        """Finish queued writes, stop the threads and close the connections."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._writer is not None:
            await asyncio.to_thread(self._writer.join)
        await self._reader.close()
        self._wconn = None
        if self.damaged is None and not self._writer_failed and self._writer is not None:
            # Last: every connection of ours is closed and the WAL folded in.
            await asyncio.to_thread(clean_stop.write_mark, self.path)
