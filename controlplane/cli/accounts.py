"""``agents-control account ...``, ``token ...`` and ``credential ...``: accounts
and what lets a machine or an admin in (join tokens, admin credentials).

The secrets these verbs make (a recovery private key, a join command, a
credential) are shown once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from controlplane.cli.admin_types import Account, NewJoinToken, rfc3339
from controlplane.cli.common import Ctx, admin_client, emit, listing, once, record
from shared.cli import Column, ExitCode, table_time
from shared.crypto import decode_public_key, encode_private_key, encode_public_key
from shared.progress import Progress

__all__ = [
    "account_create",
    "account_delete",
    "account_deletion",
    "account_list",
    "account_show",
    "credential_create",
    "join_command",
    "join_once",
    "token_create",
    "token_list",
    "token_revoke",
]

logger = logging.getLogger(__name__)


def _account_view(a: Account) -> dict[str, Any]:
    """An account as printed: its recovery public key as ``agpk1_…`` ("" when not a key)."""
    raw = a.recovery_public_key
    return {**a.to_json(), "recovery_public_key": encode_public_key(raw) if len(raw) == 32 else ""}


async def account_create(ctx: Ctx) -> int:
    """``account create --github-id N --github-login L``: a new recovery private
    key, when one was made, is printed once."""
    args = ctx.args
    public = decode_public_key(args.recovery_public_key) if args.recovery_public_key else b""
    async with admin_client(ctx.cfg) as c:
        reply = await c.create_account(args.github_id, args.github_login, public)
    acct = _account_view(reply.account)
    private = reply.recovery_private_key
    if ctx.out.as_json:
        if private:
            acct["recovery_private_key"] = encode_private_key(private)
        return emit(ctx, acct)
    lines = [
        f"account {acct['account_id']} created for {acct['github_login']}",
        f"recovery public key: {acct['recovery_public_key']}",
    ]
    if private:
        lines = [
            encode_private_key(private),
            "^ recovery private key (shown ONCE, never stored; keep it offline)",
            *lines,
        ]
    ctx.out.lines(*lines)
    return ExitCode.OK


async def account_show(ctx: Ctx) -> int:
    """``account show ACCOUNT``."""
    async with admin_client(ctx.cfg) as c:
        return record(ctx, _account_view(await c.get_account(ctx.args.account_id)))


async def account_list(ctx: Ctx) -> int:
    """``account list``."""
    async with admin_client(ctx.cfg) as c:
        accounts = await c.list_accounts()
    rows = [
        [
            a.account_id,
            a.github_login,
            str(a.github_user_id),
            table_time(a.signed_up_at),
            a.state,
        ]
        for a in accounts
    ]
    columns = [Column("account", whole=True), Column("login"), Column("github id", whole=True)]
    views = [_account_view(a) for a in accounts]
    return listing(
        ctx,
        "accounts",
        views,
        [*columns, Column("signed up", whole=True), Column("state", whole=True)],
        rows,
    )


#: Seconds between two progress reads of ``account delete --wait``.
_DELETION_POLL = 0.5


async def account_delete(ctx: Ctx) -> int:
    """``account delete ACCOUNT [--wait]``: the deletion's progress, or its result."""
    async with admin_client(ctx.cfg) as c:
        deletion = await c.delete_account(ctx.args.account_id)
        if ctx.args.wait:
            # No total is known: a spinner with the objects deleted so far.
            with Progress(f"deleting {ctx.args.account_id}", quiet=ctx.out.as_json) as progress:
                while deletion.state != "deleted":
                    progress.note(f"{deletion.deleted_objects} objects deleted")
                    await asyncio.sleep(_DELETION_POLL)  # the daemon does the work; we watch
                    deletion = await c.get_deletion(ctx.args.account_id)
    return record(ctx, deletion.to_json())


async def account_deletion(ctx: Ctx) -> int:
    """``account deletion ACCOUNT``: a deletion's progress or result."""
    async with admin_client(ctx.cfg) as c:
        return record(ctx, (await c.get_deletion(ctx.args.account_id)).to_json())


def join_command(reply: NewJoinToken) -> str:
    """The ``agents-machine join`` command a new join token is used with."""
    return (
        f"agents-machine join {reply.join_address} --token {reply.token_value} "
        f"--ca-hash {reply.ca_hash}"
    )


def join_once(ctx: Ctx, reply: NewJoinToken, command: str, note: str) -> int:
    """A new token's join ``command`` (shown once), with the reply under --json."""
    return once(ctx, {**reply.to_json(), "join_command": command}, command, note)


async def token_create(ctx: Ctx) -> int:
    """``token create --account A``: the join command, printed once."""
    args = ctx.args
    # No --ttl: send 0, which the control plane reads as its configured default.
    ttl = 0 if args.ttl is None else args.ttl
    async with admin_client(ctx.cfg) as c:
        reply = await c.create_token(args.account, ttl, args.uses)
    token = reply.token
    return join_once(
        ctx,
        reply,
        join_command(reply),
        f"token {token.token_id} for {token.account_id}, expires {rfc3339(token.expires_at)}, "
        f"uses {token.max_uses}: run the command above on the machine (shown once)",
    )


async def token_list(ctx: Ctx) -> int:
    """``token list [--account A]``."""
    async with admin_client(ctx.cfg) as c:
        tokens = await c.list_tokens(ctx.args.account)
    rows = [
        [t.token_id, t.account_id, t.state, f"{t.uses}/{t.max_uses}", table_time(t.expires_at)]
        for t in tokens
    ]
    columns = [
        Column("token", whole=True),
        Column("account", whole=True),
        Column("state", whole=True),
    ]
    more = [Column("uses"), Column("expires", whole=True)]
    return listing(ctx, "tokens", [t.to_json() for t in tokens], [*columns, *more], rows)


async def token_revoke(ctx: Ctx) -> int:
    """``token revoke TOKEN``."""
    async with admin_client(ctx.cfg) as c:
        reply = await c.revoke_token(ctx.args.token_id)
    return emit(ctx, reply.to_json(), f"token {reply.token_id} revoked")


async def credential_create(ctx: Ctx) -> int:
    """``credential create --account A``: the credential, printed once."""
    async with admin_client(ctx.cfg) as c:
        reply = await c.create_credential(ctx.args.account, ctx.args.label)
    return once(
        ctx,
        reply.to_json(),
        reply.credential,
        f"credential {reply.credential_id} for {reply.account_id} "
        "(shown ONCE, stored only as a hash)",
    )
