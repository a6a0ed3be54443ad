"""``agents-control machine ...`` and ``prompt ...``: machines, and the prompts
queued for them while they are off."""

from __future__ import annotations

import argparse
import logging

from controlplane.cli.accounts import join_command, join_once
from controlplane.cli.admin_types import Machine, rfc3339
from controlplane.cli.common import Ctx, admin_client, emit, listing, record
from shared.cli import Column, ExitCode, UsageError, table_time

__all__ = [
    "machine_list",
    "machine_provider",
    "machine_rename",
    "machine_repair",
    "machine_revoke",
    "machine_show",
    "prompt_list",
    "prompt_send",
]

logger = logging.getLogger(__name__)


def _wake(m: Machine) -> str:
    """When a schedule of the machine wakes it (through its provider), or why not."""
    if m.next_fire_at is None:
        return "-"
    if not m.has_provider:
        return "no provider set"
    return table_time(m.next_wake_at)


async def machine_list(ctx: Ctx) -> int:
    """``machine list [--account A]``, with when a schedule next wakes each."""
    async with admin_client(ctx.cfg) as c:
        machines = await c.list_machines(ctx.args.account)
    rows = [
        [
            m.machine_id,
            m.name,
            m.account_id,
            m.presence,
            table_time(m.last_seen_at),
            m.version,
            str(m.agent_count),
            _wake(m),
        ]
        for m in machines
    ]
    columns = [Column("machine", whole=True), Column("name"), Column("account", whole=True)]
    more = [
        Column("status", whole=True),
        Column("last seen", whole=True),
        Column("version"),
        Column("agents"),
    ]
    more.append(Column("next wake", whole=True))
    return listing(ctx, "machines", [m.to_json() for m in machines], [*columns, *more], rows)


async def machine_show(ctx: Ctx) -> int:
    """``machine show MACHINE``."""
    async with admin_client(ctx.cfg) as c:
        return record(ctx, (await c.get_machine(ctx.args.machine_id)).to_json())


async def machine_rename(ctx: Ctx) -> int:
    """``machine rename MACHINE NAME``."""
    async with admin_client(ctx.cfg) as c:
        reply = await c.rename_machine(ctx.args.machine_id, ctx.args.name)
    return emit(ctx, reply.to_json(), f"machine {reply.machine_id} renamed to {reply.name}")


async def machine_revoke(ctx: Ctx) -> int:
    """``machine revoke MACHINE``."""
    async with admin_client(ctx.cfg) as c:
        reply = await c.revoke_machine(ctx.args.machine_id)
    return emit(ctx, reply.to_json(), f"machine {reply.machine_id} revoked")


async def machine_repair(ctx: Ctx) -> int:
    """``machine repair MACHINE``: the join command that replaces a lost machine
    (keeping its id), printed once."""
    ttl = 0 if ctx.args.ttl is None else ctx.args.ttl
    async with admin_client(ctx.cfg) as c:
        reply = await c.create_repair_token(ctx.args.machine_id, ttl)
    # The new box restores the machine's newest backup with the account's recovery key.
    command = join_command(reply) + " --recovery-key RECOVERY-KEY-FILE"
    return join_once(
        ctx,
        reply,
        command,
        f"repair token {reply.token.token_id} for machine {ctx.args.machine_id}, expires "
        f"{rfc3339(reply.token.expires_at)}: run the command above on the NEW machine "
        "(shown once); the old machine's certificate is refused once it joins",
    )


async def machine_provider(ctx: Ctx) -> int:
    """``machine provider set|clear MACHINE [PROVIDER]``."""
    args = ctx.args
    if args.action == "set" and not args.provider:
        raise UsageError("machine provider set: name a provider (local or ec2)")
    name = args.provider if args.action == "set" else ""
    async with admin_client(ctx.cfg) as c:
        reply = await c.set_provider(args.machine_id, name, args.settings)
    what = f"provider {name} set" if name else "provider cleared"
    return emit(ctx, reply.to_json(), f"machine {reply.machine_id}: {what}")


#: The most a control plane takes as a prompt (``prompt_max_bytes`` is at most 4 MiB):
#: a --file read stops one byte past it (``/dev/zero`` must not fill the memory).
_PROMPT_FILE_MAX = 4 * 1024 * 1024


def _prompt_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return str(args.text)
    try:
        with open(args.file, "rb") as f:
            raw = f.read(_PROMPT_FILE_MAX + 1)
        if len(raw) > _PROMPT_FILE_MAX:
            raise UsageError(
                f"prompt send: {args.file} is larger than the 4 MiB a prompt may be at most"
                " (the control plane's prompt_max_bytes, 1 MiB by default)"
            )
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"prompt send: {args.file} is not UTF-8 text (byte {e.start}); prompts are text"
        ) from None
    except OSError as e:
        raise UsageError(f"prompt send: cannot read {args.file}: {e.strerror or e}") from None


async def prompt_send(ctx: Ctx) -> int:
    """``prompt send --machine M --agent A --text T|--file F``; a prompt the
    machine refused is a refusal (exit 2)."""
    args = ctx.args
    text = _prompt_text(args)
    async with admin_client(ctx.cfg) as c:
        reply = await c.send_prompt(args.machine, args.agent, text, args.idempotency_key)
    if reply.state == "refused":
        # The machine refused it for good (an online machine answers at once; a
        # key sent again answers the first outcome): nothing will run. Exit 2,
        # as any refusal.
        raise UsageError(
            f"prompt send: prompt {reply.prompt_id} was refused by the machine:"
            f" {reply.reason or 'no reason given'}"
        )
    line = f"prompt {reply.prompt_id} {reply.state}"
    if reply.run_id:
        line += f" (run {reply.run_id})"
    return emit(ctx, reply.to_json(), line)


async def prompt_list(ctx: Ctx) -> int:
    """``prompt list --machine M``."""
    async with admin_client(ctx.cfg) as c:
        reply = await c.list_prompts(ctx.args.machine)
    if ctx.out.as_json:
        ctx.out.json(reply.to_json())
        return ExitCode.OK
    rows = [
        [
            p.prompt_id,
            p.agent_id,
            p.state + (f": {p.reason}" if p.reason else ""),
            p.run_id or "-",
            f"{p.age_seconds}s",
            str(p.size),
        ]
        for p in reply.prompts
    ]
    columns = [
        Column("prompt", whole=True),
        Column("agent", whole=True),
        Column("state", whole=True),
    ]
    more = [Column("run", whole=True), Column("age"), Column("size")]
    ctx.out.table([*columns, *more], rows)
    if reply.provider_error:
        ctx.out.note(f"provider: {reply.provider_error}")
    return ExitCode.OK
