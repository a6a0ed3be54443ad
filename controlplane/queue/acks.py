"""Acknowledged prompts leave the queue in batches.

A machine acknowledges each delivery on its own, and each acknowledged entry
must be deleted from the store (controlplane.queue.prompts). Deleting them one round
trip at a time made a drain cost a GET and a DELETE per prompt. The
:class:`AckBatcher` deletes whatever was acknowledged while the previous delete
was in flight in one request (up to ``DELETE_BATCH`` keys, S3 DeleteObjects),
so a fast drain costs about one delete per batch, and a lone acknowledgement is
still deleted at once (one DELETE).

The order of the crash argument is unchanged: an entry is deleted only after
the machine's acknowledgement, and what an acknowledgement leads to (the
listing's state, the waiting send) happens only after its delete. A control
plane killed with acknowledgements waiting delivers those entries again and
the machine answers the runs it already made.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from controlplane.queue.prompts import Acknowledgement, PromptQueue, QueuedPrompt
from shared.store.base import DELETE_BATCH

__all__ = ["AckBatcher"]

logger = logging.getLogger(__name__)


class AckBatcher:
    """Deletes acknowledged queue entries, batching those that arrive together."""

    def __init__(self, queue: PromptQueue) -> None:
        self._queue = queue
        self._pending: list[tuple[Acknowledgement, asyncio.Future[None]]] = []
        self._flying: list[tuple[Acknowledgement, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None

    def add(
        self, entry: QueuedPrompt, *, run_id: str = "", refused: str = ""
    ) -> asyncio.Future[None]:
        """Delete ``entry`` soon (the machine stored it as ``run_id``, or refused it
        for the reason ``refused``); the future ends when it is deleted (or with
        the store's error, and then the entry is still queued)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((Acknowledgement(entry, run_id, refused), done))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(), name="prompt-acks")
        return done

    async def _flush(self) -> None:
        while self._pending:
            self._flying = batch = self._pending[:DELETE_BATCH]
            del self._pending[:DELETE_BATCH]
            try:
                failed = await self._queue.acknowledged_many([ack for ack, _ in batch])
            except Exception as e:  # the delete failed: every waiter hears it
                for _ack, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            # An entry whose outcome record failed stays queued: its waiter alone hears it.
            for (_ack, done), error in zip(batch, failed, strict=True):
                if done.done():
                    continue
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(error)

    async def close(self) -> None:
        """Stop (at shutdown): entries not deleted yet are delivered again later."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _ack, done in (*self._flying, *self._pending):
            done.cancel()
        self._pending.clear()
        self._flying = []
