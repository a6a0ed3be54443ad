"""Continuous backups: the increments shipped between daily points.

A daily backup (a *point*, ``bk_...``) holds every agent whole. Between two
points the service ships an *increment* (``bki_...``) once something changed:
a sealed manifest of the same format (:mod:`machine.formats.backup`) that names
the backup it continues (``base``), a delta segment for each agent whose change
marker moved (its events after the seq the chain holds, the rows of their runs
whole, its record and schedules: :mod:`machine.formats.backup_delta`), the
attachments new since, the agents gone since, and the usage rows of the
deltas' runs. So one new prompt in a long conversation sends about that
prompt's own events, compressed and sealed, not the conversation.

What the chain holds is kept in the work folder (:class:`ChainState`, written
after each commit, never before): the newest backup (the next increment's
base), each agent's marker and last seq, the attachments. Without it (a new
folder, another target) no increment is made: the next point starts a chain.
A crash between an increment's commit and the state's write leaves the
state at the increment's base: the next increment names the same base again
and holds the same changes and more; a restore follows the newest increment
that continues each backup, so the orphan is passed over (and pruned with its
point).

Idle costs nothing: with no marker moved, no agent gone and no attachment new,
no increment is made and the target is not asked anything.

Commit point: the increment's manifest, as for a point. Its deltas are put
first without asking the target which it has (they are new content; a
segment stored already is kept by the put).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final

from machine.backups.source import AgentItem, BackupSource
from machine.backups.writer import SegmentWriter
from machine.formats.backup import BackupManifest, SegmentRef
from shared.atomic import ensure_private_dir, write_atomic
from shared.backup_target import BackupTarget, is_backup_id

__all__ = ["ChainState", "IncrementMade", "make_increment", "point_state"]

logger = logging.getLogger(__name__)

_STATE_FILE: Final = "continuous.json"


@dataclass
class ChainState:
    """What the chain of backups on one target holds (see the module doc)."""

    target: str
    """Which target the chain is on (its name in ``status``)."""
    base: str
    """The newest backup made: the next increment continues it."""
    markers: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, int] = field(default_factory=dict)
    attachments: set[str] = field(default_factory=set)
    sessions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Each agent's CLI session files the chain holds: SHA-256 by path. Unknown
    after a point (its segments are made apart, maybe in worker processes): the
    first delta of an agent after a point then carries its files whole."""

    @classmethod
    def load(cls, work: Path, target: str) -> ChainState | None:
        """The chain on ``target``; None when unknown (no state, another target's)."""
        try:
            data = json.loads((work / _STATE_FILE).read_bytes())
            state = cls(
                str(data["target"]),
                str(data["base"]),
                {str(k): str(v) for k, v in data["markers"].items()},
                {str(k): int(v) for k, v in data["seqs"].items()},
                {str(s) for s in data["attachments"]},
                {
                    str(a): {str(p): str(h) for p, h in files.items()}
                    for a, files in data.get("sessions", {}).items()
                },
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if state.target != target or not is_backup_id(state.base):
            return None
        return state

    def save(self, work: Path) -> None:
        ensure_private_dir(work)
        data = {
            "target": self.target,
            "base": self.base,
            "markers": self.markers,
            "seqs": self.seqs,
            "attachments": sorted(self.attachments),
            "sessions": self.sessions,
        }
        write_atomic(work / _STATE_FILE, json.dumps(data, sort_keys=True).encode())

    @staticmethod
    def forget(work: Path) -> None:
        """No chain known: the next increment waits for a point."""
        (work / _STATE_FILE).unlink(missing_ok=True)


@dataclass(frozen=True)
class IncrementMade:
    """An increment sealed and ready to commit, and the chain once it is."""

    manifest: BackupManifest
    names: list[str]
    state: ChainState
    uploaded: int
    uploaded_bytes: int


async def make_increment(
    source: BackupSource,
    target: BackupTarget,
    state: ChainState,
    *,
    backup_id: str,
    machine_id: str,
    naming_key: bytes,
    stage: Path,
    clock: Callable[[], float],
) -> IncrementMade | None:
    """The increment ``backup_id`` of what changed since ``state``: its segments
    sent, its manifest made (the caller seals and commits it); None when nothing
    changed (and then nothing was asked of the target)."""
    agents = await source.agents()
    current = {a.agent_id for a in agents}
    changed = [a for a in agents if state.markers.get(a.agent_id) != a.marker]
    removed = sorted(a for a in state.markers if a not in current)
    attachments = await source.attachments()
    new_attachments = [(sha, p) for sha, p in attachments if sha not in state.attachments]
    if not changed and not removed and not new_attachments:
        return None
    # A new agent's delta is from 0: the agent whole.
    bases = {
        a.agent_id: state.seqs.get(a.agent_id, 0) if a.agent_id in state.markers else 0
        for a in changed
    }

    sessions: dict[str, dict[str, str]] = {}

    async def write_delta(agent_id: str, out: BinaryIO) -> None:
        # A session file goes in only when it changed since the chain's copy; a
        # delta from seq 0 replaces the agent whole (merge_delta): all of them.
        known = state.sessions.get(agent_id, {}) if bases[agent_id] else {}
        sessions[agent_id] = await source.write_delta(agent_id, bases[agent_id], out, known)

    writer = SegmentWriter(
        write_delta, target, naming_key=naming_key, work_dir=stage, tick=lambda _: None, ask=False
    )
    written = await writer.write([a.agent_id for a in changed], new_attachments)
    refs: list[SegmentRef] = []
    for r in written.refs:
        if r.kind == "agent":
            r = SegmentRef(r.name, r.key, "delta", r.ref, r.size, r.plain_size, bases[r.ref])
        refs.append(r)
    delta_agents = {r.ref for r in refs if r.kind == "delta"}
    usage = await source.usage_since({a: bases[a] for a in delta_agents})
    # Gone while this ran (erased): named removed, so a restore drops it too.
    removed = sorted({*removed, *(a.agent_id for a in changed if a.agent_id not in delta_agents)})
    manifest = BackupManifest(
        backup_id,
        machine_id,
        clock(),
        naming_key,
        tuple(refs),
        tuple(usage),
        tuple(await source.erased()),
        await source.settings(),
        base=state.base,
        removed=tuple(removed),
    )
    after = ChainState(
        state.target,
        backup_id,
        {a: m for a, m in state.markers.items() if a not in removed},
        {a: s for a, s in state.seqs.items() if a not in removed},
        {*state.attachments, *(r.ref for r in refs if r.kind == "attachment")},
        {a: h for a, h in state.sessions.items() if a not in removed},
    )
    for a in changed:
        if a.agent_id in delta_agents:
            after.markers[a.agent_id] = a.marker
            after.seqs[a.agent_id] = a.last_seq
            after.sessions[a.agent_id] = sessions.get(a.agent_id, {})
    return IncrementMade(
        manifest, [r.name for r in refs], after, written.uploaded, written.uploaded_bytes
    )


def point_state(
    target: str, backup_id: str, refs: list[SegmentRef], agents: list[AgentItem]
) -> ChainState:
    """The chain a point starts: its agents at the markers and seqs they were
    listed with (a segment dumped after its listing holds a little more: a delta
    from the listed seq repeats those events, and the merge keeps them once)."""
    listed = {a.agent_id: a for a in agents}
    held = [r.ref for r in refs if r.kind == "agent" and r.ref in listed]
    return ChainState(
        target,
        backup_id,
        {a: listed[a].marker for a in held},
        {a: listed[a].last_seq for a in held},
        {r.ref for r in refs if r.kind == "attachment"},
    )
