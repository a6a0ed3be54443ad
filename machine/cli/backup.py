"""``agents-machine backup ...``, ``export`` and ``import``: agents leaving and
arriving as sealed backups or export files."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Final

from machine.api import codec
from machine.api.views import BackupView
from machine.backups.handoff import MAX_IMPORT_BYTES
from machine.backups.transfer import InResult, SettingDiff, SettingsNote
from machine.cli.client import MachineClient
from machine.cli.common import (
    Ctx,
    call,
    human,
    open_regular,
    parse_when,
    show,
    show_record,
    when,
    wire,
)
from shared.atomic import STALE_TEMP_SECONDS, open_atomic, sweep_tagged_temps
from shared.cli import (
    Column,
    ExitCode,
    StdoutError,
    UsageError,
    message_dict,
    stdout_writable,
)
from shared.crypto import BoxKeyPair, encode_private_key, encode_public_key
from shared.errors import AgentsError, InvalidArgument, InvalidState, NotFound, TransientError
from shared.ids import validate_id
from shared.progress import Progress
from shared.recovery_key import read_recovery_key

__all__ = [
    "backup_list",
    "backup_now",
    "backup_recovery_key",
    "backup_restore",
    "backup_verify",
    "cmd_export",
    "cmd_import",
]

logger = logging.getLogger(__name__)

_CHUNK = 256 * 1024


def _recovery(ctx: Ctx) -> BoxKeyPair | None:
    """The key pair of ``--recovery-key FILE``, if given."""
    given = getattr(ctx.args, "recovery_key", None)
    if given is None:
        return None
    if not given:  # "$KEY" of an unset variable: never the machine's own key instead
        raise UsageError("--recovery-key: empty; name the file that holds the key")
    return read_recovery_key(Path(given), warn=ctx.out.note)


def _from_dir(args: argparse.Namespace) -> str:
    """``--from``: a backup folder, made absolute, or an ``s3://`` prefix as given
    (the daemon reaches the bucket with its own settings and credentials)."""
    folder = getattr(args, "from_dir", None)
    if folder is None:
        return ""
    if not folder:  # "$DIR" of an unset variable: never the configured target instead
        raise UsageError("--from: empty; name the backup folder or s3://bucket/prefix")
    if folder.startswith("s3://"):
        return str(folder)
    path = Path(folder).expanduser().absolute()
    if not path.is_dir():
        raise UsageError(f"--from: {folder} is not a folder")
    return str(path)


@contextlib.contextmanager
def _listing_from(ctx: Ctx, from_dir: str) -> Iterator[None]:
    """A backup not found in ``--from DIR`` hints at that folder's listing (the
    usual hint, ``backup list``, lists the machine's own target instead)."""
    try:
        yield
    except NotFound as e:
        if not from_dir:
            raise
        raise UsageError(str(e), f"{ctx.prog} backup list --from {shlex.quote(from_dir)}") from None


def settings_lines(differ: Sequence[SettingDiff]) -> list[str]:
    """The backed-up machine's settings that differ from this one's, as a restore
    prints them. Shown, not applied: machine.toml (and the flags) are the operator's."""
    if not differ:
        return []
    return [
        "the backed-up machine had other settings (set them in machine.toml to keep them):",
        *(f"  {d.name} = {d.in_backup} (here {d.here})" for d in differ),
    ]


def agent_settings_lines(prog: str, notes: Sequence[SettingsNote]) -> list[str]:
    """One line for each agent that came in without all of its runtime settings, saying
    how to set them (a restore, an import, the repair join print them)."""
    lines = []
    for n in notes:
        fix = f"`{prog} agent configure {n.agent_id} --settings …`"
        if n.problem:
            lines.append(f"{n.agent_id}: {n.problem}; set them with {fix}")
            continue
        names = ", ".join(name.replace(".", " ", 1) for name in n.withheld)
        it = "it" if len(n.withheld) == 1 else "them"
        lines.append(f"{n.agent_id}: {names} withheld; set {it} with {fix}")
    return lines


def _arrived(ctx: Ctx, head: str, result: InResult) -> list[str]:
    """What an import or a restore prints: ``head``, then the agents skipped, then
    those that came without all of their settings."""
    lines = [head]
    if result.skipped_existing:
        lines.append(f"skipped {len(result.skipped_existing)} already on this machine")
    if result.skipped_erased:
        lines.append(f"skipped {len(result.skipped_erased)} erased")
    return [*lines, *agent_settings_lines(ctx.prog, result.agent_settings), *result.sessions]


async def backup_now(ctx: Ctx) -> int:
    """``backup now``: a progress bar on a terminal, then what the backup did."""
    done: BackupView | None = None
    async with MachineClient(ctx.cfg) as client:
        with Progress("backing up", quiet=ctx.out.as_json) as bar:
            async for update in client.backup_now():
                if isinstance(update, BackupView):
                    done = update
                else:
                    bar.update(update.stage, update.done, update.total)
    if done is None:
        raise TransientError("backup now: the daemon ended the call without a result")
    b = done
    text = (
        f"{b.id}: {b.segments} segments ({b.uploaded_segments} new, "
        f"{human(b.uploaded_bytes)} sent), {human(b.size_bytes)} stored"
    )
    pruned = f"pruned {', '.join(b.pruned)}" if b.pruned else ""
    show_record(ctx.out, b, lambda: ctx.out.lines(text, *([pruned] if pruned else [])))
    if b.problem:
        # Made and kept, but it would not restore whole: a person must know now,
        # not at the next look at `status`.
        ctx.out.note(f"{ctx.prog}: backup {b.id} is made, but {b.problem}")
        return ExitCode.FAILED
    return ExitCode.OK


def _short(problem: str) -> str:
    """Why a listed backup does not open, for a table cell (--json has it whole)."""
    if problem.startswith("refused"):
        return "refused: forged or altered"
    return problem or "another key"


async def backup_list(ctx: Ctx) -> int:
    """``backup list [--from DIR] [--recovery-key FILE]``: newest first."""
    from_dir, recovery = _from_dir(ctx.args), _recovery(ctx)
    backups = await call(ctx, lambda c: c.list_backups(from_dir, recovery))
    # A point that does not open cannot say which increments continue it (each
    # names its base inside its sealed manifest): "?", not 0.
    rows = [
        [b.id, when(b.created_at), str(b.agents) if b.opens else "?",
         str(b.segments) if b.opens else "?", "yes" if b.opens else f"no ({_short(b.problem)})",
         str(b.increments) if b.opens else "?", when(b.newest_increment_at)]
        for b in backups
    ]  # fmt: skip
    columns = [Column("backup", whole=True), Column("created", whole=True), Column("agents")]
    # Continuous backups: each daily backup's increments, restorable to the newest.
    more = [Column("increments"), Column("newest increment", whole=True)]
    return show(
        ctx.out,
        {"backups": [wire(b) for b in backups]},
        lambda: ctx.out.table([*columns, Column("segments"), Column("opens"), *more], rows),
    )


async def backup_verify(ctx: Ctx) -> int:
    """``backup verify ID``: open it and authenticate every segment."""
    args = ctx.args
    from_dir, recovery = _from_dir(args), _recovery(ctx)
    async with MachineClient(ctx.cfg) as client:
        # The daemon answers only at the end: a spinner with the time elapsed.
        with _listing_from(ctx, from_dir), Progress("verifying", quiet=ctx.out.as_json):
            report = await client.verify_backup(
                args.backup_id or "", from_dir=from_dir, recovery=recovery
            )
    # A daily backup is verified with every increment continuing it.
    text = (
        f"{args.backup_id or 'the newest backup'}: ok, {report.segments} segments, "
        f"{human(report.plain_bytes)} authenticated in {report.duration_ms / 1000:.1f} s"
    )
    return show_record(ctx.out, report, lambda: ctx.out.lines(text))


def _at(ctx: Ctx) -> float | None:
    """``--at TIME`` (restore to a time: continuous backups' increments included)."""
    text = getattr(ctx.args, "at", None)
    if text is None:
        return None
    if ctx.args.backup_id:
        raise UsageError("restore: give a backup ID or --at TIME, not both")
    return parse_when(text)


async def backup_restore(ctx: Ctx) -> int:
    """``backup restore ID``: its agents arrive archived; existing ones are skipped."""
    args = ctx.args
    from_dir, recovery, at = _from_dir(args), _recovery(ctx), _at(ctx)
    async with MachineClient(ctx.cfg) as client:
        with _listing_from(ctx, from_dir), Progress("restoring", quiet=ctx.out.as_json):
            result = await client.restore(
                args.backup_id or "", from_dir=from_dir, recovery=recovery, at=at
            )
        restored = set(result.restored)
        # Only this machine's own agents may run once unarchived; another
        # machine's (a backup restored onto a new stand-alone box) stay read-only.
        own = 0
        if restored and not ctx.out.as_json:
            agents = await client.list_agents(include_archived=True)
            own = sum(1 for a in agents if a.id in restored and a.local)
    head = f"restored {len(restored)} agents"
    foreign = len(restored) - own
    if not restored:
        pass
    elif not foreign:
        head += " (archived; `agent unarchive ID` to run one)"
    elif not own:
        # A box replacing a lost stand-alone machine wants its agents to run: the
        # hint names the verb that makes it that machine (docs/backups.md).
        head += (
            " (archived, read-only: their origin is another machine; to make a fresh box"
            " that machine instead: `backup take-over`)"
        )
    else:
        head += (
            f" (archived; {own} of this machine, `agent unarchive ID` to run one;"
            f" {foreign} of another machine, read-only)"
        )
    lines = _arrived(ctx, head, result)
    lines += settings_lines(result.settings)
    data = message_dict(codec.restore_result_to_pb(result)) if ctx.out.as_json else {}
    return show(ctx.out, data, lambda: ctx.out.lines(*lines))


async def backup_recovery_key(ctx: Ctx) -> int:
    """``backup recovery-key``: make the key; print its private half once."""
    if not stdout_writable():
        raise UsageError(
            "backup recovery-key: stdout is closed, a pipe nobody reads or /dev/null, so the"
            " key it prints only once would be lost; nothing was made"
        )
    # The refusals the daemon would give, before a key is printed for nothing.
    st = await call(ctx, lambda c: c.status())
    if st.machine.joined:
        raise InvalidState("recovery key", "a joined machine uses its account's recovery key")
    if st.backup is not None and st.backup.recovery_key:
        raise InvalidState("recovery key", "this machine has one already")
    # Made here and printed (flushed) first; the daemon keeps only the public half,
    # and only once the private half was written out: a stdout that fails on
    # write (a full disk, /dev/full) leaves no key in use that nobody has.
    pair = BoxKeyPair.generate()
    private, public = encode_private_key(pair.private_key), encode_public_key(pair.public_key)
    try:
        if ctx.out.as_json:
            ctx.out.json({"private_key": private, "public_key": public})
        else:
            ctx.out.lines(private)
    except StdoutError as e:
        raise AgentsError(f"backup recovery-key: {e}; nothing was made") from None
    try:
        kept = await call(ctx, lambda c: c.create_recovery_key(public))
    except (InvalidState, InvalidArgument):
        ctx.out.note("The key printed above was NOT kept by the machine: discard it.")
        raise
    except BaseException:
        ctx.out.note(
            "The key printed above may have been kept: keep it until "
            f"`{ctx.prog} status` shows whether the machine has a recovery key."
        )
        raise
    if kept.public_key != public:
        # A daemon older than this CLI makes a pair of its own (it does not know
        # the field): the one in use is not the one printed.
        raise AgentsError(
            "backup recovery-key: the daemon kept a key other than the one printed"
            " (is it older than this CLI? restart it); the printed key opens nothing"
        )
    ctx.out.note(*recovery_key_note(ctx.prog))
    return ExitCode.OK


def recovery_key_note(prog: str) -> tuple[str, ...]:
    """What a person is told beside a recovery key printed once: how to keep it."""
    return (
        "This recovery key is shown once and not stored anywhere on this machine.",
        "Keep it offline (a password manager or paper), away from this disk: with it, "
        "backups restore on a new machine after this one is lost.",
        "Save it to a file and restore with "
        f"`{prog} backup restore ID --from DIR --recovery-key FILE`.",
        "Backups made from now on are sealed to it; `backup now` makes one.",
    )


async def cmd_export(ctx: Ctx) -> int:
    """``export AGENT… | --folder F``: write the .tar.gz whole, or nothing."""
    args = ctx.args
    ids = [validate_id("agent", a, "agent_id") for a in args.agents]
    folder = os.path.abspath(os.path.expanduser(args.folder)) if args.folder else ""
    if not ids and not folder:
        raise UsageError(
            "export: name agents (AGENT…) or --folder F", f"{ctx.prog} agent list --all"
        )
    if args.output is not None and args.output in ("", "-"):
        # Not stdout: an export holds whole conversations and is made private
        # (0600) and whole or not at all, which a terminal or pipe is not.
        raise UsageError(f"export: -o {args.output!r}: name the file to write (.tar.gz)")
    dest = Path(args.output or f"agents-export-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz").absolute()
    if dest.is_dir():
        raise UsageError(f"export: {dest} is a folder; -o names the file to write (.tar.gz)")
    if dest.exists():
        raise UsageError(f"export: {dest} exists; refusing to overwrite it")
    _sweep_unfinished_exports(ctx, dest.parent)
    try:
        async with MachineClient(ctx.cfg) as client:
            # Private (0600: conversations), whole at dest or absent, never over
            # a file that appeared meanwhile.
            with (
                Progress("exporting", quiet=ctx.out.as_json) as progress,
                open_atomic(dest, create_new=True, tag=_EXPORT_TAG) as f,
            ):
                # The size is known only at the end: a spinner with the bytes so far.
                async for chunk in client.export(ids, folder):
                    f.write(chunk)
                    progress.moved(len(chunk))
    except FileExistsError:
        raise UsageError(f"export: {dest} exists; refusing to overwrite it") from None
    except OSError as e:
        raise UsageError(f"export: cannot write {dest}: {e.strerror}") from None
    if ctx.out.as_json:
        ctx.out.json({"file": str(dest), "size": dest.stat().st_size})
    else:
        ctx.out.lines(str(dest))
    return ExitCode.OK


def _sent(handle: IO[bytes], size: int, progress: Progress) -> Iterator[bytes]:
    """The file in chunks, each counted as sent (of ``size``: a bar)."""
    for chunk in iter(lambda: handle.read(_CHUNK), b""):
        progress.moved(len(chunk), size)
        yield chunk


#: In the name of an export's temp file, so that a later export can tell an
#: interrupted one's debris from anyone else's temp files in that folder.
_EXPORT_TAG: Final = ".agents-export"


def _sweep_unfinished_exports(ctx: Ctx, folder: Path) -> None:
    """Remove what an export killed mid-way (SIGKILL, a power cut) left in ``folder``.

    An interrupted export leaves a hidden temp file holding part of the
    conversations; an export removes it only when untouched for an hour, so
    that one still being written by another export is never taken.
    """
    try:
        removed = sweep_tagged_temps(folder, _EXPORT_TAG)
    except OSError:
        return  # a folder we cannot list: writing there fails next, and says why
    if removed:
        ctx.out.note(
            f"export: removed {len(removed)} unfinished export(s) left in {folder} by an"
            f" interrupted export (untouched for over {int(STALE_TEMP_SECONDS // 60)} min)"
        )


async def cmd_import(ctx: Ctx) -> int:
    """``import FILE``: the export's agents arrive archived."""
    path = Path(ctx.args.file)
    if not ctx.args.file:
        raise UsageError("import: FILE is empty; name an export (.tar.gz)")
    # Looked at here, before anything is sent: a device or a pipe never ends
    # (/dev/zero), and the daemon refuses an archive past its limit only once
    # it has received that much.
    handle, size = open_regular(path, "import", " (an export is a .tar.gz)")
    with handle:
        if size > MAX_IMPORT_BYTES:
            raise UsageError(
                f"import: {path} is {human(size)}, larger than an import may be"
                f" ({human(MAX_IMPORT_BYTES)})"
            )
        async with MachineClient(ctx.cfg) as client:
            with Progress("importing", quiet=ctx.out.as_json) as progress:
                result = await client.import_export(_sent(handle, size, progress))
    lines = _arrived(ctx, f"imported {len(result.restored)} agents (archived)", result)
    return show_record(ctx.out, result, lambda: ctx.out.lines(*lines))
