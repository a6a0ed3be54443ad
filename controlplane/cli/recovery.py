"""The deployment's recovery and its own keys: ``agents-control recovery-key new``,
``restore``, ``drill``, ``fsck``, ``cert rotate-server`` and ``ca rollover``.

``restore`` rebuilds a home from the store and the recovery key; ``drill``
rehearses that with real processes (:mod:`controlplane.cli.drill`); ``fsck``
checks the store (and with ``--repair``, serve stopped, fixes it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
from pathlib import Path

from controlplane.cli.admin_types import rfc3339
from controlplane.cli.common import PROG, Ctx, admin_client, emit, once
from controlplane.cli.drill import DrillReport, run_drill
from controlplane.recovery.fsck import fsck_deployment, serving_pid
from controlplane.recovery.restore import restore_home
from shared.cli import ExitCode, UsageError
from shared.crypto import BoxKeyPair, encode_public_key
from shared.progress import Progress
from shared.recovery_key import read_recovery_key, write_recovery_key

__all__ = [
    "ca_rollover",
    "cert_rotate_server",
    "cmd_drill",
    "cmd_fsck",
    "cmd_restore",
    "recovery_key_new",
]

logger = logging.getLogger(__name__)


async def recovery_key_new(ctx: Ctx) -> int:
    """``recovery-key new --out FILE``: the private half to FILE, the public
    half printed."""
    pair = BoxKeyPair.generate()
    out = Path(ctx.args.out)
    write_recovery_key(out, pair, "the control plane's key bundle (agents-control restore)")
    public = encode_public_key(pair.public_key)
    return once(
        ctx,
        {"public_key": public, "private_key_file": str(out)},
        public,
        f"private key written to {out} (0600): keep it offline; give the public key "
        "above to `agents-control init --recovery-public-key`",
    )


async def cmd_restore(ctx: Ctx) -> int:
    """``restore --store S --recovery-key FILE``: rebuild the home."""
    recovery = read_recovery_key(Path(ctx.args.recovery_key), warn=ctx.out.note)
    result = await restore_home(ctx.cfg, recovery)
    data = {
        "home": str(result.home),
        "deployment_id": result.deployment_id,
        "ca_hash": result.ca_hash,
        "epoch": result.epoch,
    }
    return emit(
        ctx,
        data,
        f"restored {result.home} (deployment {result.deployment_id}, epoch {result.epoch})",
        f"CA hash: {result.ca_hash} (unchanged: machines reconnect with their certificates)",
        f"next: agents-control serve --home {result.home}",
    )


async def cmd_fsck(ctx: Ctx) -> int:
    """Exit 0 when clean (or all repaired), 1 when something is left, 2 for bad usage."""
    args, cfg = ctx.args, ctx.cfg
    pid = serving_pid(cfg) if args.repair else None
    if pid is not None:
        raise UsageError(
            f"fsck: --repair needs serve stopped (pid {pid} runs)",
            "stop agents-control serve, then run fsck --repair again",
        )
    if args.vouch_backups and not args.repair:
        raise UsageError(
            "fsck: --vouch-backups writes: give --repair too",
            "agents-control fsck --repair --vouch-backups",
        )
    report = await fsck_deployment(cfg, repair=args.repair, vouch_backups=args.vouch_backups)
    if ctx.out.as_json:
        ctx.out.json(report.to_dict())
    else:
        ctx.out.lines(
            *(
                f"{f.kind} {f.key}: {f.detail}" + (" [repaired]" if f.repaired else "")
                for f in report.findings
            )
        )
        ctx.out.lines(
            *(f"deleting {acct}: account deletion in progress" for acct in report.deleting)
        )
        state = "clean" if report.clean else f"{len(report.findings)} finding(s)"
        ctx.out.lines(f"checked {report.objects} objects: {state}")
    return ExitCode.OK if report.clean else ExitCode.FAILED


def _drill_text(r: DrillReport) -> list[str]:
    return [
        f"drill: {r.machines} machines, {r.stopped} stopped with {r.prompts_queued} "
        "prompts queued; control plane SIGKILLed and its home deleted",
        f"restore:            {r.restore_seconds:.2f} s",
        f"serving again:      {r.listening_seconds:.2f} s from the start of the restore",
        f"every machine back: {r.connected_seconds:.2f} s from the start of the restore "
        "(target < 5 s; the reference product's drill: 26 s for one machine)",
        f"prompts delivered:  {r.prompts_delivered}/{r.prompts_queued} "
        f"({r.delivered_seconds:.2f} s)",
        f"lost: {r.prompts_lost}  re-paired: {r.repaired}  not connected: {r.not_connected}",
        "result: " + ("OK" if r.ok else "FAILED"),
    ]


async def cmd_drill(ctx: Ctx) -> int:
    """Exit 0 when nothing was lost or paired again, 1 otherwise."""
    args = ctx.args
    env = dict(os.environ)  # the daemons it starts read their settings from it
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agents-drill-")))
        # A minute or more of starting, killing and restoring: a spinner with the time.
        with Progress(f"drill with {args.machines} machines", quiet=ctx.out.as_json):
            report = await run_drill(
                workdir,
                machines=args.machines,
                env=env,
                store_url=args.store_url or "",
                store_endpoint=args.store_endpoint or "",
            )
    emit(ctx, report.to_dict(), *_drill_text(report))
    return ExitCode.OK if report.ok else ExitCode.FAILED


async def cert_rotate_server(ctx: Ctx) -> int:
    """``cert rotate-server``: a new server certificate under the same CA."""
    async with admin_client(ctx.cfg) as c:
        rotated = await c.rotate_server_certificate()
    data = {"serial": rotated.serial, "not_after": rfc3339(rotated.not_after)}
    return emit(
        ctx,
        data,
        f"server certificate rotated: serial {rotated.serial}, valid until {data['not_after']}",
    )


async def ca_rollover(ctx: Ctx) -> int:
    """``ca rollover [--retire-old]``: start a CA rollover, report on it, or end it."""
    async with admin_client(ctx.cfg) as c:
        r = await c.rollover_ca(retire_old=ctx.args.retire_old)
    data = dataclasses.asdict(r)
    if r.state == "retired":
        text = f"old CA {r.old_ca_hash} retired; the CA is now {r.ca_hash}"
    else:
        text = (
            f"CA rollover in progress: new CA {r.ca_hash} (old {r.old_ca_hash} still trusted); "
            f"{r.machines_pending} machine(s) still to renew, {r.machines_notified} told now; "
            f"retire with `{PROG} ca rollover --retire-old` once none is left"
        )
    return emit(ctx, data, text)
