"""``agents-control init`` and ``serve``: make a control plane's home (keys,
config, the first operator credential), or with ``init --adopt`` new keys over
an existing store; then run the daemon on it.

``init`` prints the operator credential first, alone on its line: it is never
shown again.
"""

from __future__ import annotations

import logging

from controlplane.cli.common import PROG, Ctx
from controlplane.recovery.adopt import adopt_control_plane
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.server import run_daemon
from shared.cli import ExitCode, StdoutError, bind_error
from shared.crypto import decode_public_key, encode_private_key
from shared.errors import AgentsError

__all__ = ["cmd_init", "cmd_serve"]

logger = logging.getLogger(__name__)


def _recovery_lines(private: bytes | None) -> list[str]:
    """The recovery private key init/adopt made, with what to do with it (shown once)."""
    if private is None:
        return []
    return [
        encode_private_key(private),
        "^ recovery private key (shown ONCE, never stored): save it to a file kept "
        "OFFLINE; `agents-control restore` needs it to rebuild this control plane",
    ]


async def cmd_init(ctx: Ctx) -> int:
    """``init``: a new home (or ``--adopt``: new keys over an existing store); the
    operator credential is printed first, once."""
    if ctx.args.adopt:
        return await _adopt(ctx)
    given = ctx.args.recovery_public_key
    public = decode_public_key(given) if given else None
    result = await init_control_plane(ctx.cfg, public)
    # The credential first, in one write: a reader that keeps only the first line
    # (`| head -1`) still gets the one thing that is never shown again.
    lines = [
        result.operator_credential,
        "^ operator credential (shown ONCE, stored only as a hash)",
    ]
    lines += _recovery_lines(result.recovery_private_key)
    try:
        ctx.out.lines(
            *lines,
            f"control plane initialised in {ctx.cfg.home}",
            f"CA hash: {result.ca_hash}",
        )
    except StdoutError as e:
        raise AgentsError(
            f"init: {e}: the control plane in {ctx.cfg.home} is made, but nobody has its"
            " operator credential (shown only once); remove that folder and the store's"
            " objects, then run init again with a working stdout"
        ) from None
    return ExitCode.OK


async def _adopt(ctx: Ctx) -> int:
    given = ctx.args.recovery_public_key
    adopted = await adopt_control_plane(ctx.cfg, decode_public_key(given) if given else None)
    # As for init: the credential first, on a line of its own.
    ctx.out.lines(
        adopted.operator_credential,
        "^ operator credential (shown ONCE, stored only as a hash)",
        *_recovery_lines(adopted.recovery_private_key),
        f"store adopted with new keys in {ctx.cfg.home} "
        f"({adopted.objects_adopted} objects re-authenticated)",
        f"CA hash: {adopted.ca_hash}",
    )
    ctx.out.note(
        f"machines must re-pair: `{PROG} machine repair MACHINE` for each, then run the "
        "printed join command on that machine (it keeps its id, agents and backups)"
    )
    if adopted.provider_secrets_lost:
        ctx.out.note(
            f"{adopted.provider_secrets_lost} machine provider setting(s) were sealed with the "
            f"lost key: set them again (`{PROG} machine provider set`)"
        )
    return ExitCode.OK


async def cmd_serve(ctx: Ctx) -> int:
    """``serve``: run the daemon."""
    try:
        await run_daemon(ctx.cfg)
    except (OSError, RuntimeError) as e:
        raise bind_error(e) or e from None
    return ExitCode.OK
