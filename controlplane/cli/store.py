"""``agents-control store migrate --to URL``: move the control plane to another store.

The work is :func:`controlplane.recovery.migrate.migrate_store`; this verb
names the new store from its flags, shows a progress bar on a terminal (quiet
when piped or with ``--json``) and prints one summary line.
"""

from __future__ import annotations

import logging

from controlplane.cli.common import PROG, Ctx, emit
from controlplane.recovery.migrate import StoreTarget, crash_after, migrate_store
from shared.cli import ExitCode
from shared.progress import Progress

__all__ = ["store_migrate"]

logger = logging.getLogger(__name__)


async def store_migrate(ctx: Ctx) -> int:
    """``store migrate --to URL``: copy, verify, then switch the home (serve stopped)."""
    args = ctx.args
    target = StoreTarget(
        url=args.to_url,
        endpoint=args.to_endpoint or None,
        region=args.to_region or None,
        object_lock=bool(args.to_object_lock),
    )
    with Progress("migrating the store", quiet=ctx.out.as_json) as bar:
        result = await migrate_store(
            ctx.cfg,
            target,
            on_progress=bar.update,
            after_copy=crash_after(ctx.cfg.crash_in_migrate_after),
        )
    data = {
        "source": result.source,
        "target": result.target,
        "objects": result.objects,
        "bytes": result.bytes,
        "copied": result.copied,
        "seconds": round(result.seconds, 3),
        "unverified_macs": result.unverified_macs,
        "already": result.already,
    }
    if result.already:
        return emit(ctx, data, f"the home already uses {result.target}: migration done")
    lines = [
        f"migrated {result.objects} objects ({result.bytes} bytes) from {result.source} to "
        f"{result.target} in {result.seconds:.1f} s ({result.copied} copied by this run); "
        "the home now uses the new store",
    ]
    emit(ctx, data, *lines)
    if not ctx.out.as_json:
        if result.unverified_macs:
            ctx.out.note(
                f"{result.unverified_macs} object(s) carry a MAC that did not verify in the "
                f"old store and were copied as they were: run `{PROG} fsck`"
            )
        ctx.out.note(
            f"the old store {result.source} is left as it was: remove it once "
            f"`{PROG} serve` runs on the new one"
        )
    return ExitCode.OK
