"""The periodic jobs' lease: one replica runs them, once per due time.

The lease is one key (``lease``) in a KV bucket whose entries expire after
:data:`LEASE_TTL` seconds (``agents-<deployment>-lease``). A replica without it
tries to create the key (create-only); the holder renews it every third of the
TTL with an update conditional on the revision it last wrote. A renewal that
finds another revision means the lease was lost (the holder stalled past the
TTL and another took it): it stops running jobs at once. A SIGKILLed holder's
key expires and the next replica to try takes it, within the TTL and a third.

Each job's last due time done is kept in another bucket, without expiry
(``agents-<deployment>-jobs``, key ``done.<job>``): a job whose period is P is
due once per slot ``floor(unix time / P)``, and the lease holder claims the
slot (a conditional update of that key) before it runs the job. A new holder
therefore never runs again a slot its predecessor ran, and two holders (one
that lost the lease without knowing yet) cannot both claim one slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

import nats.js.errors
from nats.js.kv import KeyValue

from controlplane.cluster.faults import outage_error
from shared.outage import OutageLog

__all__ = ["LEASE_TTL", "JobLease"]

logger = logging.getLogger(__name__)

#: Seconds the lease outlives its holder's last renewal.
LEASE_TTL: Final = 3.0


class JobLease:
    """Hold the lease when possible; run periodic jobs only while holding it."""

    def __init__(
        self,
        lease_kv: KeyValue,
        jobs_kv: KeyValue,
        holder: str,
        *,
        ttl: float = LEASE_TTL,
        on_held: Callable[[bool], None] | None = None,
        on_run: Callable[[str], None] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lease = lease_kv
        self._jobs = jobs_kv
        self._holder = holder
        self._ttl = ttl
        self._on_held = on_held
        self._on_run = on_run
        self._wall = wall
        self._revision = 0
        self.held = False

    def _set(self, held: bool) -> None:
        if held != self.held:
            logger.info(
                "periodic jobs' lease %s by replica %s", "taken" if held else "lost", self._holder
            )
        self.held = held
        if self._on_held is not None:
            self._on_held(held)

    async def tick(self) -> None:
        """Renew the lease, or try to take it."""
        value = self._holder.encode()
        try:
            if self.held:
                self._revision = await self._lease.update("lease", value, last=self._revision)
            else:
                self._revision = await self._lease.create("lease", value)
                self._set(True)
        except nats.js.errors.KeyWrongLastSequenceError:
            self._set(False)  # held by another (or taken over from us)
        except nats.js.errors.KeyNotFoundError:
            # nats-py's create, refused because the key exists, reads it back to
            # see whether it is a delete marker; the holder's key can expire in
            # between. Nobody holds it now: the next tick tries again.
            self._set(False)

    async def run(self) -> None:
        """Keep trying / renewing every third of the TTL until cancelled."""
        outage = OutageLog(logger, "periodic jobs' lease")
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # NATS gone: not holding what we cannot renew
                self._set(False)
                outage.failed(outage_error(e))
            else:
                outage.recovered()
            await asyncio.sleep(self._ttl / 3)  # a period, not synchronisation

    async def claim(self, job: str, slot: int) -> bool:
        """Whether this holder runs ``job``'s ``slot`` (recorded as done first: a
        holder killed during the run leaves it done, never run twice)."""
        if not self.held:
            return False
        key = f"done.{job}"
        try:
            entry = await self._jobs.get(key)
        except nats.js.errors.KeyNotFoundError:
            with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                await self._jobs.create(key, str(slot).encode())
                return True
            return False
        try:
            done = int(entry.value or b"-1")
        except ValueError:
            done = -1
        if done >= slot:
            return False
        try:
            await self._jobs.update(key, str(slot).encode(), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True

    async def every(self, job: str, period: float, once: Callable[[], Awaitable[object]]) -> None:
        """Run ``once`` for each due slot of ``period`` seconds, while holding the
        lease, until cancelled (its own task). Failures: one line per outage."""
        outage = OutageLog(logger, f"periodic job {job}")
        last = -1
        while True:
            slot = int(self._wall() // period)
            if slot != last and self.held:
                try:
                    if await self.claim(job, slot):
                        logger.debug("periodic job %s: slot %d runs here", job, slot)
                        if self._on_run is not None:
                            self._on_run(job)
                        await once()
                    last = slot
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the next slot tries again
                    outage.failed(outage_error(e))
                else:
                    outage.recovered()
            # Look again soon: a lease taken over mid-period runs the slot at once.
            await asyncio.sleep(min(period, self._ttl) / 3)
