"""``agents-machine agent ...``: agents, their runs and the events runs stream."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import logging
import math
import os
import sys
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO

from machine.cli.client import MAX_MESSAGE, MachineClient
from machine.cli.common import PROG, Ctx, call, open_regular, show, show_record, when, wire
from machine.models import AgentRecord, EventKind, PendingPermission, RunRecord, StoredEvent
from shared.cli import Column, ExitCode, Output, UsageError, read_stdin_text

__all__ = [
    "agent_answer",
    "agent_archive",
    "agent_cancel",
    "agent_configure",
    "agent_create",
    "agent_delete",
    "agent_erasures",
    "agent_list",
    "agent_prompt",
    "agent_rename",
    "agent_replay",
    "agent_runs",
    "agent_search",
    "agent_show",
    "agent_unarchive",
    "ask_at_terminal",
    "choose",
    "stream_events",
]

logger = logging.getLogger(__name__)

_CHUNK = 256 * 1024
#: A permission request answered by a remembered rule is followed at once by its
#: answer (both are written in one transaction): wait this long for it before
#: telling the person the run waits for them.
_RULE_ANSWER_WAIT = 0.5

# ---------------------------------------------------------------- output


def _state(agent: AgentRecord) -> str:
    return (
        agent.state.value if agent.local else f"{agent.state.value} (from {agent.origin_machine})"
    )


def _utc(seconds: float) -> str:
    # Whole seconds, as the wire's Timestamp.seconds: rounding could show the next one.
    return dt.datetime.fromtimestamp(math.floor(seconds), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _agent_detail(out: Output, a: AgentRecord) -> None:
    out.detail(
        [
            ("id", a.id),
            ("name", a.name),
            ("state", _state(a)),
            ("runtime", a.runtime),
            # The daemon's own rendering of the settings (sorted keys).
            ("settings", json.dumps(a.settings, sort_keys=True)),
            ("folder", a.folder),
            ("origin", a.origin_machine),
            ("session", a.session_id or "-"),
            ("events", str(a.last_seq)),
            ("created", _utc(a.created_at)),
        ]
    )


def _show_agent(out: Output, agent: AgentRecord) -> int:
    return show_record(out, agent, lambda: _agent_detail(out, agent))


def _show_run(out: Output, run: RunRecord) -> int:
    return show_record(out, run, lambda: out.lines(f"{run.id} {run.state.value}"))


def _pending(ev: StoredEvent) -> PendingPermission:
    """The permission request an event carries."""
    p = ev.payload
    return PendingPermission(
        run_id=ev.run_id,
        request_id=p["request_id"],
        agent_id=ev.agent_id,
        call_id=p["call_id"],
        title=p["title"],
        options=tuple((o["option_id"], o["name"], o["kind"]) for o in p["options"]),
        seq=ev.seq,
        state="pending",
    )


def _render_event(
    out: Output, ev: StoredEvent, state: dict[str, bool], prog: str = PROG
) -> int | None:
    """Print one event for people; return an exit code when the run ended.

    ``prog`` starts the commands it suggests (with the ``--data-dir`` in use)."""
    kind, p = ev.kind, ev.payload
    if kind is EventKind.TEXT_DELTA:
        out.write(p["text"])
        state["mid_line"] = True
        return None
    if state.get("mid_line"):
        out.write("\n")
        state["mid_line"] = False
    if kind is EventKind.RUN_STARTED:
        out.lines(f"[run {ev.run_id}]")
    elif kind is EventKind.TOOL_CALL:
        out.lines(f"[tool {p['title']}] {p['input_json']}")
    elif kind is EventKind.TOOL_RESULT:
        out.lines(f"[tool {p['status']}] {p['output']}")
    elif kind is EventKind.PERMISSION_REQUEST:
        options = ", ".join(o["option_id"] for o in p["options"])
        out.lines(
            f"[permission] {p['title']}: waiting for an answer ({options})",
            f"Try: {prog} agent answer {ev.run_id} {p['request_id']} OPTION [--remember]",
        )
    elif kind is EventKind.PERMISSION_ANSWERED:
        how = "by a remembered rule" if p["by_rule"] else "by a person"
        out.lines(f"[permission] {p['option_id']} ({how})")
    elif kind is EventKind.RUN_FINISHED:
        usage = p["usage"]
        out.lines(
            f"[done] {p['stop_reason']}, {_tokens(usage['input_tokens'])} in / "
            f"{_tokens(usage['output_tokens'])} out tokens, {p['duration_ms']} ms"
        )
        return ExitCode.OK
    elif kind is EventKind.RUN_ERROR:
        out.lines(f"[error {p['code']}] {p['message']}")
        return ExitCode.FAILED
    return None


# ---------------------------------------------------------------- answering


#: A person's answer at the terminal: (option id, remember) or None to leave it pending.
Asker = Callable[[PendingPermission], Awaitable[tuple[str, bool] | None]]


def choose(req: PendingPermission, reply: str) -> tuple[str, bool] | None:
    """Map what a person typed (a number or an option id; "+" = remember) to an answer."""
    reply = reply.strip()
    remember = reply.endswith("+")
    reply = reply.rstrip("+").strip()
    options = [option_id for option_id, _, _ in req.options]
    if reply.isdigit() and 1 <= int(reply) <= len(options):
        return options[int(reply) - 1], remember
    if reply in options:
        return reply, remember
    return None


async def ask_at_terminal(req: PendingPermission) -> tuple[str, bool] | None:
    """Ask on the terminal; an empty line leaves the request pending."""
    choices = "  ".join(
        f"{i}) {name or option_id}" for i, (option_id, name, _) in enumerate(req.options, 1)
    )
    prompt = f"allow {req.title}? {choices}  (number, + to remember, Enter to leave it): "
    while True:
        try:
            reply = await asyncio.to_thread(input, prompt)
        except EOFError:
            return None
        if not reply.strip():
            return None
        chosen = choose(req, reply)
        if chosen is not None:
            return chosen


async def _events_with_rule_answers(
    events: AsyncIterable[StoredEvent],
) -> AsyncIterator[StoredEvent]:
    """The stream's events, with a permission request answered by a remembered rule
    folded into its answer: the request is dropped when its answer follows at once.

    Reading the next event runs in a task that is awaited again, never cancelled,
    so no event is lost when the wait times out.
    """
    it = aiter(events)
    pending: asyncio.Future[StoredEvent] | None = None
    while True:
        if pending is None:
            pending = asyncio.ensure_future(anext(it))
        try:
            ev = await pending
        except StopAsyncIteration:
            return
        pending = None
        if ev.kind is not EventKind.PERMISSION_REQUEST:
            yield ev
            continue
        pending = asyncio.ensure_future(anext(it))
        done, _ = await asyncio.wait({pending}, timeout=_RULE_ANSWER_WAIT)
        if done and pending.exception() is None:
            following = pending.result()
            if (
                following.kind is EventKind.PERMISSION_ANSWERED
                and following.payload["by_rule"]
                and following.payload["request_id"] == ev.payload["request_id"]
            ):
                continue  # the answer is printed; the request never waited
        yield ev


async def stream_events(
    out: Output,
    events: AsyncIterable[StoredEvent],
    *,
    ask: Asker | None = None,
    client: MachineClient | None = None,
    prog: str = PROG,
) -> int:
    """Print a run's events (JSON lines for --json); exit 0 when it finished, 1 when
    it failed. With ``ask`` and ``client``, a person answers permission requests here."""
    state: dict[str, bool] = {}
    code: int | None = None
    if out.as_json:
        async for ev in events:
            out.json(wire(ev))
            if ev.terminal:
                code = ExitCode.OK if ev.kind is EventKind.RUN_FINISHED else ExitCode.FAILED
        return code if code is not None else ExitCode.OK
    try:
        async for ev in _events_with_rule_answers(events):
            got = _render_event(out, ev, state, prog)
            code = got if got is not None else code
            if ask is not None and client is not None and ev.kind is EventKind.PERMISSION_REQUEST:
                # A person is at the terminal: answer here (the stream carries the rest).
                req = _pending(ev)
                chosen = await ask(req)
                if chosen is not None:
                    option_id, remember = chosen
                    await client.answer_permission(
                        ev.run_id, req.request_id, option_id, remember=remember
                    )
    finally:
        # Also when the stream breaks (the daemon stopped, Ctrl-C): the error
        # line then starts on a line of its own, not after the last words.
        if state.get("mid_line"):
            with contextlib.suppress(OSError):
                out.write("\n")
    return code if code is not None else ExitCode.OK


# ---------------------------------------------------------------- verbs


async def agent_create(ctx: Ctx) -> int:
    """``agent create NAME``: print the new agent's id."""
    args = ctx.args
    if args.folder == "":  # "$DIR" of an unset variable: never the current folder instead
        raise UsageError("--folder: empty; name the agent's working folder")
    # Made absolute only: the daemon normalises it (and refuses ".." after a link).
    folder = os.path.join(os.getcwd(), args.folder or os.getcwd())
    agent = await call(
        ctx,
        lambda c: c.create_agent(
            args.name, folder, runtime=args.runtime or "", settings_json=args.settings or ""
        ),
    )
    return show_record(ctx.out, agent, lambda: ctx.out.lines(agent.id))


async def agent_list(ctx: Ctx) -> int:
    """``agent list [--all]``."""
    agents = await call(ctx, lambda c: c.list_agents(include_archived=ctx.args.all))
    columns = [
        Column("id", whole=True),
        Column("name"),
        Column("runtime"),
        Column("state", whole=True),
    ]
    rows = [[a.id, a.name, a.runtime, _state(a), a.folder] for a in agents]
    return show(
        ctx.out,
        {"agents": [wire(a) for a in agents]},
        lambda: ctx.out.table([*columns, Column("folder")], rows),
    )


async def agent_show(ctx: Ctx) -> int:
    """``agent show ID``."""
    return _show_agent(ctx.out, await call(ctx, lambda c: c.get_agent(ctx.args.id)))


async def agent_rename(ctx: Ctx) -> int:
    """``agent rename ID NAME``."""
    agent = await call(ctx, lambda c: c.rename_agent(ctx.args.id, ctx.args.name))
    return _show_agent(ctx.out, agent)


#: The largest settings JSON the daemon takes (machine.core.agents).
_MAX_SETTINGS = 64 * 1024


async def agent_configure(ctx: Ctx) -> int:
    """``agent configure ID --settings JSON|-``: replace the agent's runtime settings.

    ``-`` reads the JSON from stdin, so secret values (an ``env`` token) need not
    sit in the shell's history or the process list. The settings are not printed
    back (they may hold those values): ``agent show`` shows them.
    """
    raw = ctx.args.settings
    if raw == "-":
        raw = read_stdin_text("--settings", _MAX_SETTINGS)
    agent = await call(ctx, lambda c: c.configure_agent(ctx.args.id, raw))
    return show_record(
        ctx.out,
        agent,
        lambda: ctx.out.lines(f"{agent.id}: settings replaced; its next run uses them"),
    )


async def agent_archive(ctx: Ctx) -> int:
    """``agent archive ID``."""
    return _show_agent(ctx.out, await call(ctx, lambda c: c.archive_agent(ctx.args.id)))


async def agent_unarchive(ctx: Ctx) -> int:
    """``agent unarchive ID``."""
    return _show_agent(ctx.out, await call(ctx, lambda c: c.unarchive_agent(ctx.args.id)))


def _prompt_text(args: argparse.Namespace, limit: int) -> str:
    """The prompt from the arguments or stdin. A NUL byte is refused: prompts are
    text, and neither a terminal nor the conversation views can show one."""
    if args.stdin and args.text:
        raise UsageError("prompt: give the text or --stdin, not both")
    text = read_stdin_text("prompt", limit) if args.stdin else " ".join(args.text)
    if "\0" in text:
        where = text.index("\0")
        raise UsageError(f"prompt: contains a NUL byte (at character {where}); prompts are text")
    return text


_Attachment = tuple[Path, int, IO[bytes]]
"""An ``--attach`` file: its path, size and open handle."""


def _open_attachments(given: list[str], stack: contextlib.ExitStack) -> list[_Attachment]:
    """Every ``--attach`` file open, each checked before any is sent: a regular
    file (a device or FIFO never ends), readable; closed with ``stack``."""
    opened: list[_Attachment] = []
    for name in given:
        if not name:
            raise UsageError("--attach: empty; name the file to attach")
        path = Path(name)
        handle, size = open_regular(path, "attach")
        opened.append((path, size, stack.enter_context(handle)))
    return opened


async def _upload_all(client: MachineClient, agent_id: str, files: list[_Attachment]) -> list[str]:
    """Upload the opened files; a file over the daemon's limit is refused before
    anything is sent (a refusal mid-upload can reach the client as gRPC's
    INTERNAL "Internal error from Core", not the daemon's own answer)."""
    if not files:
        return []
    limit = (await client.status()).machine.attachment_limit
    for path, size, _ in files:
        if limit and size > limit:
            raise UsageError(f"attachment: {path} is larger than the limit of {limit} bytes")
    shas = []
    for path, size, handle in files:
        chunks = iter(functools.partial(handle.read, _CHUNK), b"")
        shas.append((await client.upload_attachment(agent_id, path.name, size, chunks)).sha256)
    return shas


async def agent_prompt(ctx: Ctx) -> int:
    """``agent prompt ID TEXT``: upload the attachments, start a run, stream it."""
    args = ctx.args
    # Read no more than one message can carry; the daemon applies its own limit.
    text = _prompt_text(args, MAX_MESSAGE)
    with contextlib.ExitStack() as stack:
        files = _open_attachments(args.attach or [], stack)
        async with MachineClient(ctx.cfg) as client:
            shas = await _upload_all(client, args.id, files)
            stack.close()  # the files are sent: not held open while the run streams
            # Ask inline only when a person is at the terminal (never for --stdin or scripts).
            interactive = not args.stdin and sys.stdin.isatty() and sys.stdout.isatty()
            return await stream_events(
                ctx.out,
                client.prompt(args.id, text, shas),
                ask=ask_at_terminal if interactive else None,
                client=client,
                prog=ctx.prog,
            )


async def agent_replay(ctx: Ctx) -> int:
    """``agent replay ID [--after SEQ] [--follow]``."""
    args = ctx.args
    async with MachineClient(ctx.cfg) as client:
        events = client.replay(args.id, after_seq=args.after, follow=args.follow)
        return await stream_events(ctx.out, events, prog=ctx.prog)


async def agent_cancel(ctx: Ctx) -> int:
    """``agent cancel RUN``."""
    return _show_run(ctx.out, await call(ctx, lambda c: c.cancel_run(ctx.args.run_id)))


async def agent_answer(ctx: Ctx) -> int:
    """``agent answer RUN REQUEST OPTION [--remember]``."""
    a = ctx.args
    run = await call(
        ctx,
        lambda c: c.answer_permission(a.run_id, a.request_id, a.option_id, remember=a.remember),
    )
    return _show_run(ctx.out, run)


def _tokens(count: int | None) -> str:
    """A token count, or "?" when the runtime did not report it (unknown, not 0)."""
    return "?" if count is None else str(count)


async def agent_runs(ctx: Ctx) -> int:
    """``agent runs ID``: usage and time history."""
    runs = await call(ctx, lambda c: c.list_runs(ctx.args.id, limit=ctx.args.limit))
    rows = [
        [r.id, r.state.value, f"{_tokens(r.input_tokens)}/{_tokens(r.output_tokens)}",
         str(r.duration_ms), r.prompt]
        for r in runs
    ]  # fmt: skip
    columns = [Column("run", whole=True), Column("state", whole=True), Column("tokens in/out")]
    return show(
        ctx.out,
        {"runs": [wire(r) for r in runs]},
        lambda: ctx.out.table([*columns, Column("ms"), Column("prompt")], rows),
    )


async def agent_delete(ctx: Ctx) -> int:
    """``agent delete ID``: erase an archived agent."""
    done = await call(ctx, lambda c: c.delete_agent(ctx.args.id))
    text = f"{done.agent_id} erased"
    if done.runtime_erasure_queued:
        text += "; its runtime's copy is being erased"
    return show_record(
        ctx.out, done, lambda: ctx.out.lines(text, f"Try: {ctx.prog} agent erasures  (the receipt)")
    )


async def agent_erasures(ctx: Ctx) -> int:
    """``agent erasures``: the receipts, per layer."""
    erasures = await call(ctx, lambda c: c.list_erasures())
    rows = [
        [e.agent_id, e.state, when(e.erased_at), e.machine_data, e.attachments, e.runtime_copy,
         e.backups, str(e.attempts), e.detail]
        for e in erasures
    ]  # fmt: skip
    columns = [
        Column("agent", whole=True),
        Column("state", whole=True),
        Column("erased", whole=True),
        Column("machine data"),
        Column("attachments"),
        Column("runtime copy"),
        Column("backups"),
        Column("tries"),
        Column("detail"),
    ]
    return show(
        ctx.out, {"erasures": [wire(e) for e in erasures]}, lambda: ctx.out.table(columns, rows)
    )


async def agent_search(ctx: Ctx) -> int:
    """``agent search WORDS [--agent ID]``."""
    args = ctx.args
    found = await call(
        ctx, lambda c: c.search(" ".join(args.query), agent_id=args.agent or "", limit=args.limit)
    )
    rows = [
        [h.agent_id, h.agent_name + (" (archived)" if h.archived else ""), str(h.seq), h.source,
         h.snippet]
        for h in found.hits
    ]  # fmt: skip
    columns = [Column("agent", whole=True), Column("name"), Column("seq", whole=True)]
    if found.indexing and not ctx.out.as_json:
        ctx.out.note(
            f"{found.indexing} restored agent(s) still being indexed: "
            "their conversations are not found yet"
        )
    return show_record(
        ctx.out, found, lambda: ctx.out.table([*columns, Column("source"), Column("match")], rows)
    )
