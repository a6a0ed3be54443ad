"""The permission bridge: an ACP agent's ``session/request_permission`` asked of the engine.

:func:`bridge_permission` turns the agent's request into a
:class:`~machine.runtimes.base.PermissionRequest`, waits for
``ctx.ask_permission`` (a person may take hours), and answers the agent with
the option chosen. Whatever goes wrong (the run is cancelled, the agent dies
meanwhile, the answer names an option the agent did not offer) the agent is
answered ``cancelled``, never left waiting. A resumed run's re-asked request
keeps the paused request's id so the engine can answer it with the stored
decision (see :func:`_request_id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from acp.schema import AllowedOutcome, RequestPermissionResponse

from machine.runtimes.acp.client import CANCELLED, PendingPermission, Turn
from machine.runtimes.base import (
    PermissionDecision,
    PermissionOption,
    PermissionRequest,
    RunContext,
)

__all__ = ["bridge_permission"]

logger = logging.getLogger(__name__)


async def bridge_permission(
    item: PendingPermission,
    turn: Turn,
    ctx: RunContext,
    prompt_task: asyncio.Task[None],
) -> None:
    """Ask the engine about ``item`` and set its reply; cancelled when no answer comes."""
    call_id = item.tool_call.tool_call_id
    title = item.tool_call.title or turn.titles.get(call_id) or call_id
    options = tuple(PermissionOption(o.option_id, o.name, o.kind) for o in item.options)
    request = PermissionRequest(
        request_id=_request_id(ctx, turn, call_id, title, options),
        call_id=call_id,
        title=title,
        options=options,
    )
    ask = asyncio.ensure_future(ctx.ask_permission(request))
    try:
        # The agent may die while a person thinks: stop waiting then.
        await asyncio.wait({ask, prompt_task}, return_when=asyncio.FIRST_COMPLETED)
        if not ask.done():
            return
        decision = ask.result()
        if not item.reply.done():
            item.reply.set_result(_answer(decision, options))
    finally:
        if not ask.done():
            ask.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ask
        if not item.reply.done():
            item.reply.set_result(CANCELLED)


def _request_id(
    ctx: RunContext,
    turn: Turn,
    call_id: str,
    title: str,
    options: tuple[PermissionOption, ...],
) -> str:
    """The tool call id, except for the request a resumed run re-asks.

    An agent may give the re-asked tool call a new id (Claude does); the
    first request of a resumed run with the paused request's title and
    options is that same request, so it keeps the paused request's id and
    the engine can answer it with the stored decision.
    """
    resume = ctx.resume
    if resume is None or turn.resume_matched:
        return call_id
    pending = resume.pending
    if call_id == pending.request_id or (
        title == pending.title
        and [o.option_id for o in options] == [o.option_id for o in pending.options]
    ):
        turn.resume_matched = True
        return pending.request_id
    return call_id


def _answer(
    decision: PermissionDecision, options: tuple[PermissionOption, ...]
) -> RequestPermissionResponse:
    if decision.cancelled or not decision.option_id:
        return CANCELLED
    if decision.option_id not in {o.option_id for o in options}:
        logger.warning("acp: permission answer names an option the agent did not offer")
        return CANCELLED
    return RequestPermissionResponse(
        outcome=AllowedOutcome(outcome="selected", option_id=decision.option_id)
    )
