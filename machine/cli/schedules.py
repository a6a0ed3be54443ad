"""``agents-machine schedule ...``: prompts an agent runs on a cron."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from machine.api.views import ScheduleView
from machine.cli.client import MAX_MESSAGE
from machine.cli.common import Ctx, call, show, show_record, when, wire
from shared.cli import Column, Output, UsageError

__all__ = [
    "schedule_add",
    "schedule_delete",
    "schedule_list",
    "schedule_pause",
    "schedule_resume",
    "schedule_runs",
]

logger = logging.getLogger(__name__)


def _schedule_text(args: argparse.Namespace) -> str:
    """The prompt of ``schedule add``: ``--text`` or the UTF-8 file of ``--file``."""
    if args.file is None:
        text: str = args.text
    else:
        try:
            with Path(args.file).expanduser().open("rb") as f:
                data = f.read(MAX_MESSAGE + 1)
        except OSError as e:
            raise UsageError(f"--file: cannot read {args.file}: {e.strerror or e}") from None
        if len(data) > MAX_MESSAGE:
            raise UsageError(f"--file: {args.file} is larger than {MAX_MESSAGE} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--file: {args.file} is not UTF-8 (at byte {e.start})") from None
    if "\0" in text:
        raise UsageError("prompt: contains a NUL byte; prompts are text")
    return text


def _row(view: ScheduleView) -> list[str]:
    s = view.schedule
    state = "enabled" if s.enabled else "paused"
    return [
        s.id,
        s.agent_id,
        s.cron,
        s.time_zone,
        state,
        s.missed,
        when(view.next_run_at),
        s.prompt,
    ]


_COLUMNS = [
    Column("id", whole=True),
    Column("agent", whole=True),
    Column("cron"),
    Column("zone"),
    Column("state", whole=True),
    Column("missed"),
    Column("next", whole=True),
    Column("prompt"),
]


def _show_schedule(out: Output, view: ScheduleView) -> int:
    return show_record(out, view, lambda: out.table(_COLUMNS, [_row(view)]))


async def schedule_add(ctx: Ctx) -> int:
    """``schedule add AGENT --cron C --text T|--file F``: print the new schedule's id."""
    args = ctx.args
    if args.tz == "":  # "$TZ" unset: never the machine's zone instead, unasked
        raise UsageError("--tz: empty; name an IANA zone (Europe/Berlin), or leave --tz out")
    text = _schedule_text(args)
    view = await call(
        ctx,
        lambda c: c.create_schedule(
            args.agent, args.cron, text, time_zone=args.tz or "", missed=args.missed or ""
        ),
    )
    return show_record(ctx.out, view, lambda: ctx.out.lines(view.schedule.id))


async def schedule_list(ctx: Ctx) -> int:
    """``schedule list [AGENT]``."""
    views = await call(ctx, lambda c: c.list_schedules(ctx.args.agent or ""))
    return show(
        ctx.out,
        {"schedules": [wire(v) for v in views]},
        lambda: ctx.out.table(_COLUMNS, [_row(v) for v in views]),
    )


async def schedule_pause(ctx: Ctx) -> int:
    """``schedule pause ID``."""
    return _show_schedule(
        ctx.out, await call(ctx, lambda c: c.pause_schedule(ctx.args.schedule_id))
    )


async def schedule_resume(ctx: Ctx) -> int:
    """``schedule resume ID``: fires again from now."""
    view = await call(ctx, lambda c: c.resume_schedule(ctx.args.schedule_id))
    return _show_schedule(ctx.out, view)


async def schedule_delete(ctx: Ctx) -> int:
    """``schedule delete ID``."""
    await call(ctx, lambda c: c.delete_schedule(ctx.args.schedule_id))
    return show(
        ctx.out,
        {"schedule_id": ctx.args.schedule_id, "deleted": True},
        lambda: ctx.out.lines(f"deleted {ctx.args.schedule_id}"),
    )


async def schedule_runs(ctx: Ctx) -> int:
    """``schedule runs ID``: its fires, newest first."""
    runs = await call(
        ctx, lambda c: c.list_schedule_runs(ctx.args.schedule_id, limit=ctx.args.limit)
    )
    rows = [[when(r.fire_time), r.result, r.run_id or "-", r.detail] for r in runs]
    columns = [
        Column("fire time", whole=True),
        Column("result", whole=True),
        Column("run", whole=True),
    ]
    return show(
        ctx.out,
        {"runs": [wire(r) for r in runs]},
        lambda: ctx.out.table([*columns, Column("detail")], rows),
    )
