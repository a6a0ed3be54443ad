"""machine.api.servicer._send_events: a client gone ends a stream quietly; a fault does not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from machine.api import servicer
from machine.models import EventKind, StoredEvent

AGENT, RUN = "ag_0000000000aaaaaaaaaaaaaaaa", "run_0000000000aaaaaaaaaaaaaaaa"


class _Context:
    def __init__(self, *, closed: bool = False) -> None:
        self.sent: list[Any] = []
        self.closed = closed

    async def write(self, message: Any) -> None:
        if self.closed:
            raise RuntimeError("the call takes no more messages")
        self.sent.append(message)


async def _events(last_time: float) -> AsyncIterator[StoredEvent]:
    yield StoredEvent(AGENT, 1, RUN, EventKind.RUN_STARTED, {"prompt": "hi"}, 1.0)
    yield StoredEvent(AGENT, 2, RUN, EventKind.TEXT_DELTA, {"text": "x"}, last_time)


async def test_an_event_that_cannot_be_encoded_fails_the_stream() -> None:
    # Before, the encoding error was taken for a client that went away: the
    # replay ended early with exit 0 and nothing in the log.
    context = _Context()
    with pytest.raises(OverflowError):
        await servicer._send_events(context, _events(float("inf")))  # type: ignore[arg-type]
    assert len(context.sent) == 1


async def test_a_client_gone_ends_the_stream_quietly() -> None:
    context = _Context(closed=True)
    await servicer._send_events(context, _events(2.0))  # type: ignore[arg-type]
    assert context.sent == []
