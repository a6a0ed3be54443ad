"""Prompts the control plane delivers: open, store once, answer the acknowledgement.

A delivery carries the prompt sealed to this machine's box key and bound to
its prompt id and agent (:func:`shared.crypto.prompt_aad`). It is opened here,
stored as a queued run deduplicated by prompt id
(:meth:`machine.core.runs.RunEngine.accept_delivery`) and only then acknowledged:
a crash before the commit means no ack, so the control plane delivers it
again; a crash after it means the redelivery finds the run and starts nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from machine.core.runs import RunEngine
from machine.link.client import Delivery, DeliveryAck
from shared.crypto import BoxKeyPair, open_bytes, prompt_aad
from shared.errors import IntegrityError
from shared.ids import is_valid_id

__all__ = ["DeliveryHandler", "crash_after"]

logger = logging.getLogger(__name__)


class DeliveryHandler:
    """The link's ``on_delivery``: one instance per daemon."""

    def __init__(
        self,
        engine: RunEngine,
        box: BoxKeyPair,
        *,
        after_store: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._box = box
        self._after_store = after_store

    async def __call__(self, delivery: Delivery) -> DeliveryAck:
        """Store ``delivery`` durably (once) and say what it became."""
        if not (is_valid_id("prompt", delivery.id) and is_valid_id("agent", delivery.agent_id)):
            # Refused for good, not failed: a failure would have the link reconnect
            # and be sent this delivery again, forever, before any later prompt.
            logger.warning("delivery refused: a malformed prompt or agent id")
            return DeliveryAck(refused="the prompt or agent id is malformed")
        try:
            raw = open_bytes(
                delivery.sealed_prompt,
                self._box,
                aad=prompt_aad(delivery.id, delivery.agent_id),
                what=f"prompt {delivery.id}",
            )
            text = raw.decode("utf-8")
        except (IntegrityError, UnicodeDecodeError) as e:
            # Never openable by us: refuse it so the control plane stops resending.
            logger.warning("delivery %s refused: %s", delivery.id, e)
            return DeliveryAck(refused=f"the machine cannot open the prompt: {e}")
        got = await self._engine.accept_delivery(delivery.id, delivery.agent_id, text)
        if got.refused:
            logger.info("delivery %s refused: %s", delivery.id, got.refused)
        else:
            logger.info("delivery %s stored as run %s", delivery.id, got.run_id)
        if self._after_store is not None:
            self._after_store()  # a test's fault point: stored, not yet acknowledged
        return DeliveryAck(run_id=got.run_id, refused=got.refused)


def crash_after(count: int, what: str = "stored deliveries") -> Callable[[], None] | None:
    """A test's fault hook (``MachineConfig.crash_after_deliveries``, ...): SIGKILL
    this process at the ``count``-th call (e.g. once ``count`` deliveries were
    stored, before the last one is acknowledged)."""
    if count <= 0:
        return None
    done = 0

    def hook() -> None:
        nonlocal done
        done += 1
        if done >= count:
            logger.error("test fault: killing the daemon after %d %s", done, what)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
