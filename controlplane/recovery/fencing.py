"""Fencing: one control-plane process writes to a deployment's store at a time.

``cp/epoch.json`` (MAC'd like every object) names the current *epoch* and the
*home* that owns the deployment. Every home has an id (``instance.json`` in the
home, made by ``init``, ``restore`` or the first ``serve``):

- ``serve`` takes the next epoch at start (a compare-and-swap: previous + 1)
  if the record names its own home, after it has bound its listeners (a start
  that cannot serve must not fence out the one that does); a record naming another home means this
  home was superseded (a restore elsewhere) and ``serve`` refuses to start,
  having written nothing.
- ``restore`` takes the next epoch for the new home (:meth:`Fence.acquire`
  with ``take_over``), so the old home can never serve again.
- Before every write (:class:`controlplane.integrity.trusted.GuardedStore` calls
  :meth:`Fence.check`) the process HEADs the record: an etag other than the
  one it wrote means a newer process took over. From then on every write is
  refused (:class:`~shared.errors.StoreFenced`) and ``on_fenced`` asks the
  daemon to stop.

A record that vanished, does not verify, or went *back* to an older epoch (a
store rolled back from a snapshot) is not a newer owner: writes are refused
as untrusted while it lasts, but the process does not stop.

The fence never goes backwards. The home remembers, in ``instance.json``
beside its id, the highest epoch it held (written after each epoch it takes)
and whether it was superseded (written when it saw a record naming another
home). A start then refuses, writing nothing, when the record is missing or
names this home at an older epoch than it held (deleted, or an older copy
put back: an alarm, never a fresh start), and a superseded home never starts
again. A restore or ``init --adopt`` (the only ways to take over) first
creates ``cp/superseded/<old home id>`` (create-only) for the home it takes
over, and a start looks for its own: so a home that was down during the
restore, started against an older copy of its own record put back by a
bucket writer, still refuses. A writer who may also delete can remove that
marker; against that writer S3 Object Lock is the answer (docs/security.md).

Replicas (``serve --cluster``, controlplane.cluster) are copies of one home
folder: one home id, so one owner. A replica does not take the next epoch
(that would fence its peers, as a copied home started by mistake fences the
live one): it *joins* the current one (:meth:`Fence.join`), taking a first
epoch only when there is none yet, with the same refusals as a start (another
home's record, a superseded home, a record older than the home held). Its
check before each write then finds the etag it joined: replicas of one epoch
never fence each other, while a restore (the next epoch, another home) or a
plain ``serve`` of the home (the next epoch) fences every replica at once.

The home itself is held by one process at a time: ``serve`` and ``store
migrate`` take ``serve.lock`` in the home (:func:`lock_home`, an ``flock``
released when the process ends, however it ends), so neither starts while the
other runs on the same home folder.

The check is one HEAD per write; concurrent writers share one in-flight HEAD.
The window between that HEAD and the write itself remains (S3 has no
multi-object transaction): a stale process can land at most the writes it had
already checked, and it stops on its next check.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from controlplane.integrity.records import utc_iso
from shared.atomic import write_atomic
from shared.errors import (
    ConfigError,
    IntegrityError,
    InvalidState,
    NotFound,
    PreconditionFailed,
    StoreFenced,
    StoreUntrusted,
)
from shared.store.base import ObjectStore
from shared.timestamps import Clock, utc_now

__all__ = [
    "EPOCH_KEY",
    "HOME_ID_FILE",
    "HOME_LOCK_FILE",
    "SUPERSEDED_PREFIX",
    "Epoch",
    "Fence",
    "HomeState",
    "lock_home",
    "new_home_id",
    "read_home_id",
    "read_home_state",
    "superseded_key",
    "take_epoch",
    "write_home_id",
    "write_home_state",
]

logger = logging.getLogger(__name__)

#: The fencing record (relative to the deployment prefix).
EPOCH_KEY: Final = "cp/epoch.json"
#: The home's id and fencing state, in the home folder.
HOME_ID_FILE: Final = "instance.json"
#: Held (flock) by the one process that uses the home: ``serve`` or ``store migrate``.
HOME_LOCK_FILE: Final = "serve.lock"
#: Create-only markers of homes a restore or adopt took the deployment from.
SUPERSEDED_PREFIX: Final = "cp/superseded/"
#: Compare-and-swap attempts at taking an epoch before giving up.
_ACQUIRE_ATTEMPTS: Final = 5


def lock_home(home: Path, holder: str) -> int:
    """Hold ``home``'s lock for ``holder`` (``serve``, ``store migrate``) and return
    its file descriptor (close it to let go; the process ending lets go too).

    InvalidState naming the holder when another process holds it; ConfigError
    when the home cannot be opened (a folder that does not exist: not made by
    ``init``, or a typo in ``--home``).
    """
    try:
        fd = os.open(home / HOME_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        hint = " (agents-control init makes one)" if isinstance(e, FileNotFoundError) else ""
        raise ConfigError("home", f"cannot open {home}: {e.strerror or e}{hint}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # Who holds it is written inside (best effort: a lock made by an older
        # version says nothing, and that version only ever served).
        other = os.read(fd, 64).decode(errors="replace").strip() or "serve"
        os.close(fd)
        raise InvalidState(
            f"{holder} {home}",
            f"another agents-control {other} is running on this home; stop it first",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode() + b"\n", 0)
    return fd


def new_home_id() -> str:
    """A fresh random home id."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class HomeState:
    """What a home remembers of the deployment's fence (``instance.json``)."""

    home_id: str
    epoch: int = 0
    """The highest epoch this home held (0: none yet)."""
    superseded: str = ""
    """Why this home may never serve again ("" while it may)."""


def read_home_state(home: Path) -> HomeState | None:
    """The home's fencing state, None when the home has no id yet (made before fencing)."""
    try:
        data = json.loads((home / HOME_ID_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise InvalidState(f"home {home}", f"{HOME_ID_FILE} is unreadable: {e}") from None
    ident = data.get("home_id") if isinstance(data, dict) else None
    if not isinstance(ident, str) or not ident:
        raise InvalidState(f"home {home}", f"{HOME_ID_FILE} names no home_id")
    epoch, superseded = data.get("epoch", 0), data.get("superseded", "")
    if not isinstance(epoch, int) or epoch < 0 or not isinstance(superseded, str):
        raise InvalidState(f"home {home}", f"{HOME_ID_FILE} is not a home's fencing state")
    return HomeState(ident, epoch, superseded)


def read_home_id(home: Path) -> str | None:
    """The home's id, None when the home has none yet (made before fencing)."""
    state = read_home_state(home)
    return state.home_id if state is not None else None


def write_home_state(home: Path, state: HomeState) -> None:
    """Record ``state`` in ``home`` (0600, atomic)."""
    data = {"home_id": state.home_id, "epoch": state.epoch, "superseded": state.superseded}
    write_atomic(home / HOME_ID_FILE, json.dumps(data).encode() + b"\n", 0o600)


def write_home_id(home: Path, home_id: str) -> None:
    """Record a new home's id in ``home`` (it has held no epoch yet)."""
    write_home_state(home, HomeState(home_id))


def superseded_key(home_id: str) -> str:
    """The create-only marker a take-over leaves for the home it supersedes."""
    return f"{SUPERSEDED_PREFIX}{home_id}"


@dataclass(frozen=True)
class Epoch:
    """The content of ``cp/epoch.json``."""

    epoch: int
    home_id: str
    started_at: str
    host: str
    pid: int

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Epoch:
        """IntegrityError for a record that is not one."""
        try:
            data = json.loads(raw)
            epoch = cls(
                int(data["epoch"]),
                str(data["home_id"]),
                str(data.get("started_at", "")),
                str(data.get("host", "")),
                int(data.get("pid", 0)),
            )
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise IntegrityError(EPOCH_KEY, "not an epoch record") from None
        if epoch.epoch < 1 or not epoch.home_id:
            raise IntegrityError(EPOCH_KEY, "not an epoch record")
        return epoch


class Fence:
    """This process's epoch, and the check before every write (see the module doc)."""

    def __init__(
        self,
        store: ObjectStore,
        home_id: str,
        where: str,
        on_fenced: Callable[[StoreFenced], None] | None = None,
        clock: Clock = utc_now,
        home: Path | None = None,
    ) -> None:
        self._store = store
        # Where this home remembers its fencing state (None: a fence of no home,
        # e.g. a test's); see the module doc.
        self._home = home
        self._clock = clock
        self._home_id = home_id
        self._where = where
        self._on_fenced = on_fenced
        self._etag = ""
        self.epoch = 0
        self.problem: StoreFenced | None = None
        self._inflight: asyncio.Task[None] | None = None

    @property
    def home_id(self) -> str:
        """The home this fence writes for."""
        return self._home_id

    def _fenced(self, current: Epoch) -> StoreFenced:
        return StoreFenced(
            f"store {self._where}: fenced out: epoch {current.epoch} of {EPOCH_KEY} belongs "
            f"to another control plane (started {current.started_at or '?'} on "
            f"{current.host or '?'}, e.g. a restored one); this one "
            f"(epoch {self.epoch or 'none'}) writes nothing more and stops"
        )

    async def _read(self) -> tuple[str, Epoch] | None:
        try:
            etag = (await self._store.head(EPOCH_KEY)).etag
            return etag, Epoch.parse(await self._store.get(EPOCH_KEY))
        except NotFound:
            return None

    def _state(self) -> HomeState:
        state = read_home_state(self._home) if self._home is not None else None
        if state is None or state.home_id != self._home_id:
            return HomeState(self._home_id)
        return state

    def _remember(self, state: HomeState) -> None:
        if self._home is not None:
            write_home_state(self._home, state)

    def _superseded(self, why: str) -> StoreFenced:
        return StoreFenced(
            f"store {self._where}: fenced out: this home was superseded ({why}); it never "
            "serves this deployment again (restore or init --adopt make a home that does)"
        )

    def _mark_superseded(self, why: str) -> None:
        state = self._state()
        if not state.superseded:
            self._remember(dataclasses.replace(state, superseded=why))

    async def _check_not_superseded(self) -> None:
        state = self._state()
        if state.superseded:
            raise self._superseded(state.superseded)
        key = superseded_key(self._home_id)
        try:
            # Read, not HEAD: the MAC shows a take-over wrote it; a forged one
            # (write access alone) must not stop a live home for good.
            await self._store.get(key)
        except NotFound:
            return
        except IntegrityError:
            logger.warning("%s does not verify: ignored (a forgery, not a take-over)", key)
            return
        why = f"{key} names it"
        self._mark_superseded(why)
        raise self._superseded(why)

    def _refuse_going_back(self, previous: Epoch | None) -> None:
        """StoreUntrusted when the record is older than what this home held."""
        held = self._state().epoch
        if previous is None and held:
            raise StoreUntrusted(
                f"store {self._where}: {EPOCH_KEY} is missing, but this home held epoch "
                f"{held}: the record was deleted or the store rolled back; refusing to start "
                "(an alarm, not a fresh start)"
            )
        if previous is not None and previous.home_id == self._home_id and previous.epoch < held:
            raise StoreUntrusted(
                f"store {self._where}: {EPOCH_KEY} went back to epoch {previous.epoch}, but "
                f"this home held epoch {held}: an older copy was put back or the store "
                "rolled back; refusing to start"
            )

    async def acquire(self, *, take_over: bool = False) -> int:
        """Take the next epoch (previous + 1) for this home; return it.

        StoreFenced, writing nothing, when the record names another home and
        ``take_over`` is False, or this home was superseded; StoreUntrusted,
        writing nothing, when the record is missing or older than the epoch
        this home held. With ``take_over`` (restore, adopt), the home the record
        names is marked superseded (create-only) before the epoch is taken.
        """
        if not take_over:
            await self._check_not_superseded()
        for _ in range(_ACQUIRE_ATTEMPTS):
            found = await self._read()
            previous = found[1] if found is not None else None
            if previous is not None and previous.home_id != self._home_id and not take_over:
                if previous.epoch < self._state().epoch:
                    # An older record of another home put back: a rollback to
                    # refuse, not a newer owner to give the deployment up to.
                    raise StoreUntrusted(
                        f"store {self._where}: {EPOCH_KEY} names another home at epoch "
                        f"{previous.epoch}, older than epoch {self._state().epoch} this home "
                        "held: an older copy was put back; refusing to start"
                    )
                self._mark_superseded(f"{EPOCH_KEY} names home {previous.home_id[:8]}…")
                raise self._fenced(previous)
            if not take_over:
                self._refuse_going_back(previous)
            elif previous is not None and previous.home_id != self._home_id:
                # Before the epoch: the old home must never start again, also if a
                # bucket writer puts its own older record back (module doc).
                with contextlib.suppress(PreconditionFailed):  # there already
                    await self._store.put(
                        superseded_key(previous.home_id),
                        json.dumps({"by": self._home_id, "at": utc_iso(self._clock())}).encode(),
                        if_none_match=True,
                    )
            mine = Epoch(
                (previous.epoch if previous is not None else 0) + 1,
                self._home_id,
                utc_iso(self._clock()),
                socket.gethostname(),
                os.getpid(),
            )
            try:
                if found is None:
                    etag = await self._store.put(EPOCH_KEY, mine.to_json(), if_none_match=True)
                else:
                    etag = await self._store.put(EPOCH_KEY, mine.to_json(), if_match=found[0])
            except PreconditionFailed:
                continue  # another process took one at the same moment: look again
            self._etag, self.epoch, self.problem = etag, mine.epoch, None
            # After the record: remembered too early, a failed write would make the
            # next start take its own record for a rolled-back one.
            self._remember(dataclasses.replace(self._state(), epoch=mine.epoch))
            logger.info("%s: epoch %d taken", EPOCH_KEY, mine.epoch)
            return mine.epoch
        raise InvalidState(
            "epoch", f"{EPOCH_KEY} keeps changing; is another control plane starting?"
        )

    async def join(self) -> int:
        """A replica's start (module doc): the current epoch when the record names
        this home; the first one when there is none (create-only: replicas
        starting together all join the one that landed); else as :meth:`acquire`
        (with its refusals). Writes the record only when there was none."""
        await self._check_not_superseded()
        for _ in range(_ACQUIRE_ATTEMPTS):
            found = await self._read()
            if found is not None and found[1].home_id != self._home_id:
                return await self.acquire()  # refused as a start is, or (none) taken
            if found is not None:
                etag, current = found
                self._refuse_going_back(current)
                self._etag, self.epoch, self.problem = etag, current.epoch, None
                if self._state().epoch != current.epoch:
                    self._remember(dataclasses.replace(self._state(), epoch=current.epoch))
                logger.info("%s: epoch %d joined (a replica of this home)", EPOCH_KEY, self.epoch)
                return self.epoch
            self._refuse_going_back(None)
            first = Epoch(
                1, self._home_id, utc_iso(self._clock()), socket.gethostname(), os.getpid()
            )
            try:
                etag = await self._store.put(EPOCH_KEY, first.to_json(), if_none_match=True)
            except PreconditionFailed:
                continue  # a peer took it at the same moment: join it
            self._etag, self.epoch, self.problem = etag, first.epoch, None
            self._remember(dataclasses.replace(self._state(), epoch=first.epoch))
            logger.info("%s: epoch %d taken", EPOCH_KEY, first.epoch)
            return first.epoch
        raise InvalidState(
            "epoch", f"{EPOCH_KEY} keeps changing; is another control plane starting?"
        )

    async def hold_current(self) -> int:
        """Write under the current epoch without taking a new one (``fsck --repair``,
        run while ``serve`` is stopped): StoreFenced when another home owns it.
        Returns the epoch (0: no record yet, nothing to check against)."""
        await self._check_not_superseded()
        found = await self._read()
        self._refuse_going_back(found[1] if found is not None else None)
        if found is None:
            return 0
        etag, current = found
        if current.home_id != self._home_id:
            raise self._fenced(current)
        self._etag, self.epoch = etag, current.epoch
        return current.epoch

    async def check(self) -> None:
        """Raise unless this process still holds the current epoch (one shared HEAD)."""
        if self.problem is not None:
            raise self.problem
        task = self._inflight
        if task is None:
            task = self._inflight = asyncio.ensure_future(self._check_now())
            task.add_done_callback(self._clear_inflight)
        await asyncio.shield(task)

    def _clear_inflight(self, task: asyncio.Task[None]) -> None:
        if self._inflight is task:
            self._inflight = None
        if not task.cancelled():
            task.exception()  # retrieved: each waiter sees it through the shield

    async def _check_now(self) -> None:
        try:
            etag = (await self._store.head(EPOCH_KEY)).etag
        except NotFound:
            raise StoreUntrusted(
                f"store {self._where}: {EPOCH_KEY} is missing; refusing to write"
            ) from None
        if etag == self._etag:
            return
        try:
            current = Epoch.parse(await self._store.get(EPOCH_KEY))
        except NotFound:
            raise StoreUntrusted(
                f"store {self._where}: {EPOCH_KEY} is missing; refusing to write"
            ) from None
        except IntegrityError:
            raise StoreUntrusted(
                f"store {self._where}: {EPOCH_KEY} does not verify; refusing to write"
            ) from None
        if current.epoch > self.epoch or (
            current.epoch == self.epoch and current.home_id != self._home_id
        ):
            problem = self._fenced(current)
            if current.home_id != self._home_id:
                self._mark_superseded(f"{EPOCH_KEY} named home {current.home_id[:8]}…")
            if self.problem is None:
                self.problem = problem
                logger.error("%s", problem)
                if self._on_fenced is not None:
                    self._on_fenced(problem)
            raise problem
        raise StoreUntrusted(
            f"store {self._where}: {EPOCH_KEY} went back to epoch {current.epoch} "
            f"(ours is {self.epoch}): the store was rolled back; refusing to write"
        )


async def take_epoch(
    home: Path,
    store: ObjectStore,
    where: str,
    on_fenced: Callable[[StoreFenced], None] | None = None,
    *,
    replica: bool = False,
) -> Fence:
    """``serve``'s start: the home's fence with the next epoch taken (a
    ``replica`` joins the current one instead: :meth:`Fence.join`).

    A home made before fencing gets an id now, but only when the store has no
    epoch record yet (otherwise another home owns the deployment).
    StoreFenced, having written nothing, when this home was superseded.
    """
    home_id = read_home_id(home)
    made = home_id is None
    fence = Fence(store, home_id or new_home_id(), where, on_fenced, home=home)
    if made:
        try:
            await store.head(EPOCH_KEY)
        except NotFound:
            pass
        else:
            raise StoreFenced(
                f"store {where}: fenced out: {EPOCH_KEY} names another control plane's "
                f"home and {home} has no {HOME_ID_FILE}; this home is stale"
            )
        # The id first, then the epoch record naming it: killed between the two,
        # the next start has its id and takes the epoch. The other way round it
        # found an epoch of a home without an id, and refused itself as stale.
        write_home_id(home, fence.home_id)
    if replica:
        await fence.join()
    else:
        await fence.acquire()
    return fence
