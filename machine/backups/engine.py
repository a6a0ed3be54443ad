"""The backup engine: make and prune sealed backups (and read them, through
:class:`~machine.backups.reader.BackupReader`).

It reads the machine's data through a :class:`~machine.backups.source.BackupSource`
and writes to a :class:`~shared.backup_target.BackupTarget`; it knows nothing of
SQL or of where the target is. The format is :mod:`machine.formats.backup`.

Making a backup (one commit point: the manifest)::

    1. each agent's history -> plaintext (a deterministic tar) -> name (keyed hash)
    2. ask the target which names it has; encode and upload only the others
    3. seal the manifest and put it with its segment names   <- commit point
    4. prune (by the target, from the names lists, so a control plane that
       cannot open manifests can do it): delete manifests beyond the newest
       ``keep``, then every segment that no kept backup names

A crash before 3 leaves segments no manifest names (the next prune removes
them); a crash during 4 has deleted only manifests that were not kept, or
segments no kept manifest names, so every kept backup stays restorable.

A transient error is never an answer. The manifest's put whose answer was lost
(a control plane whose store failed after the write) may have committed: it is
put again, with the same id and bytes, under :func:`shared.retry.retrying`
until the target answers; a target holding exactly those bytes already takes
it as done (:meth:`shared.backup_target.StoreTarget.put_manifest`). So a backup
is reported failed only when its manifest is not stored. Once it is stored the
backup is made: a prune that fails after its retries is logged and left to the
next backup, never reported as the backup's failure.

An agent whose change marker and segment are the same as in the last backup
is not read again: its segment is reused as it is (the *cache*).

Continuous backups (docs/backups.md). The backup above is the daily *point*
(``bk_...``); between points :meth:`BackupEngine.increment_now` ships an
*increment* (``bki_...``) of what changed since the newest backup, a delta per
changed agent (:mod:`machine.backups.increments`), with the same one commit
point (its manifest) and no prune. A point starts the chain (written after its
commit); without a chain (a new folder, another target) increments wait for
the next point. Pruning keeps the newest ``keep`` points and the increments
after the oldest of them (:func:`shared.backup_target.kept_by_points`): by
id alone, so the control plane prunes alike. Restoring to a time merges the
newest point at or before it with the increments continuing it
(:mod:`machine.backups.chain`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from machine.backups.chain import BackupChains, Chain, Link
from machine.backups.increments import ChainState, make_increment, point_state
from machine.backups.reader import BackupReader, FetchedBackup, VerifyResult
from machine.backups.source import BackupSource
from machine.backups.writer import SegmentWriter
from machine.formats.backup import BackupManifest, SegmentRef, seal_manifest, segment_key
from shared.atomic import ensure_private_dir, write_atomic
from shared.backup_target import BackupTarget, ManifestInfo, PackTarget, PruneResult
from shared.crypto import BoxKeyPair
from shared.errors import AgentsError, IntegrityError, InvalidArgument
from shared.ids import id_time_ms, new_id
from shared.retry import retrying

__all__ = [
    "KEEP_MAX",
    "KEEP_MIN",
    "BackupEngine",
    "BackupResult",
    "Progress",
    "PruneResult",
    "validate_keep",
]

logger = logging.getLogger(__name__)

KEEP_MIN: Final = 1
KEEP_MAX: Final = 10
_CACHE_FILE: Final = "segment-cache.json"
_DAMAGED_FILE: Final = "damaged-segments.json"


def validate_keep(keep: object, field: str = "backup_keep") -> int:
    """How many backups to keep: a whole number from 1 to 10."""
    if not isinstance(keep, int) or isinstance(keep, bool) or not KEEP_MIN <= keep <= KEEP_MAX:
        raise InvalidArgument(field, f"must be a whole number from {KEEP_MIN} to {KEEP_MAX}")
    return keep


@dataclass(frozen=True)
class BackupResult:
    """What one backup did."""

    backup_id: str
    segments: int
    uploaded: int
    """Segments encoded and sent (the others were reused)."""
    uploaded_bytes: int
    stored_bytes: int
    """Stored size of every segment the backup names, plus its manifest."""
    plain_bytes: int
    seconds: float
    pruned: PruneResult | None = None
    agents: int = 0
    created_at: float = 0.0
    """The manifest's time (what a listing shows); 0 when unknown."""


Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as segments are handled."""


class BackupEngine:
    """Makes and reads one machine's backups on one target."""

    def __init__(
        self,
        source: BackupSource,
        target: BackupTarget,
        *,
        machine_id: str,
        naming_key: bytes,
        recipients: list[bytes],
        keypair: BoxKeyPair,
        work_dir: Path,
        keep: int = 3,
        clock: Callable[[], float] = time.time,
        mend: bool = True,
        chain_target: str = "",
    ) -> None:
        """``mend``: a segment found damaged (verify, the restore check) is sent
        again by the next backup (off for an engine reading another folder).
        ``chain_target`` names the target in the chain's state (increments
        continue only a chain on the same target)."""
        self._chain_target = chain_target
        # Whether the chain's base was seen stored since this engine started (once).
        self._chain_seen = False

        self._source = source
        self._target = target
        self._machine_id = machine_id
        self._naming_key = naming_key
        self._recipients = recipients
        self._work = work_dir
        self.keep = validate_keep(keep)
        self._clock = clock
        self._lock = asyncio.Lock()
        self._mend = mend and target.replaces_segments
        self._reader = BackupReader(
            target,
            machine_id=machine_id,
            naming_key=naming_key,
            keypair=keypair,
            work_dir=work_dir,
            on_damaged=self._note_damaged,
        )
        self._chains = BackupChains(target, self._reader)

    def chain_newest(self) -> str | None:
        """The id of the newest backup of this target's chain (a point or an
        increment; None: no chain), from the chain's state file alone."""
        state = ChainState.load(self._work, self._chain_target)
        return state.base if state is not None else None

    @property
    def machine_id(self) -> str:
        """The machine whose backups this engine reads and writes."""
        return self._machine_id

    def seal_to(self, recipients: list[bytes]) -> None:
        """Seal later manifests to ``recipients`` (a recovery key was just made)."""
        self._recipients = list(recipients)

    # -- cache ---------------------------------------------------------------

    def _load_cache(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads((self._work / _CACHE_FILE).read_bytes())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save_cache(self, cache: dict[str, dict[str, Any]]) -> None:
        write_atomic(self._work / _CACHE_FILE, json.dumps(cache, sort_keys=True).encode())

    def _damaged(self) -> set[str]:
        """Names of stored segments that failed to authenticate since the last backup.

        A segment is reused by name while the target has it; one whose stored
        bytes went bad would be reused, and named by every later backup, for
        ever. The next backup makes these again and sends them over the bad ones.
        """
        try:
            names = json.loads((self._work / _DAMAGED_FILE).read_bytes())
        except (OSError, ValueError):
            return set()
        return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()

    def _forget_damaged(self, names: set[str]) -> None:
        left = self._damaged() - names
        if left:
            write_atomic(self._work / _DAMAGED_FILE, json.dumps(sorted(left)).encode())
        else:
            (self._work / _DAMAGED_FILE).unlink(missing_ok=True)

    def _note_damaged(self, name: str) -> None:
        if not self._mend:
            return
        names = self._damaged() | {name}
        ensure_private_dir(self._work)
        write_atomic(self._work / _DAMAGED_FILE, json.dumps(sorted(names)).encode())
        logger.error("segment %s is damaged where it is stored; the next backup sends it again",
                     name[:16])  # fmt: skip

    # -- making --------------------------------------------------------------

    async def backup_now(self, progress: Progress | None = None) -> BackupResult:
        """Make one backup, then prune; one at a time."""
        async with self._lock:
            started = time.monotonic()
            ensure_private_dir(self._work)
            now_ms = int(self._clock() * 1000)
            stored = await self._target.list_manifests()
            newest = await self._newest_own(stored) if stored else None
            if newest is not None and id_time_ms(newest) >= now_ms:
                # The clock is behind the newest backup (it once ran ahead, or this box
                # took over a machine whose clock did). An id from it would sort before
                # the backups kept, and this backup's own prune would delete it.
                logger.warning(
                    "backup: the clock is behind the newest backup %s; numbering after it",
                    newest,
                )
                now_ms = id_time_ms(newest) + 1
            backup_id = new_id("backup", now_ms=now_ms)
            try:
                with tempfile.TemporaryDirectory(dir=self._work, prefix=".stage-") as stage:
                    result = await self._make(backup_id, Path(stage), progress)
            except BaseException:
                if isinstance(self._target, PackTarget):
                    # Its segments and packs would wait for a sweep at the next start.
                    await asyncio.to_thread(self._target.discard_pending)
                raise
            pruned = await self._prune_after(backup_id)
            return BackupResult(
                **{**result.__dict__, "seconds": time.monotonic() - started, "pruned": pruned}
            )

    async def _prune_after(self, backup_id: str) -> PruneResult | None:
        """Prune after the backup ``backup_id`` was committed; None when the target
        would not (the backup stands, the next one prunes)."""
        try:
            async for attempt in retrying("backup.prune"):
                with attempt:
                    return await self._target.prune(self.keep)
        except AgentsError as e:
            logger.error("backup %s is made, but the prune after it failed: %s", backup_id, e)
        return None

    async def _commit(self, backup_id: str, blob: bytes, names: list[str]) -> None:
        """Store the sealed manifest: THE COMMIT POINT. Put again, same id and bytes,
        while the answer is transient (the first put may have landed: see the module doc)."""
        async for attempt in retrying("backup.commit"):
            with attempt:
                await self._target.put_manifest(backup_id, blob, names)

    async def _newest_own(self, stored: list[ManifestInfo]) -> str | None:
        """The newest listed backup that opens with this machine's key, looked for
        only when the newest listed id is ahead of the clock (rare: one read).

        A listed id alone is not trusted to number the next backup: one planted
        with a far-future time would push every later id past the end of the id
        space. One that does not open (planted, forged, another key's) is passed.
        """
        now_ms = int(self._clock() * 1000)
        if id_time_ms(stored[-1].backup_id) < now_ms:
            return stored[-1].backup_id
        for info in reversed(stored):
            try:
                await self.open(info.backup_id)
            except IntegrityError as e:
                logger.warning("backup %s is not this machine's: %s", info.backup_id, e)
                continue
            return info.backup_id
        return None

    async def _make(self, backup_id: str, stage: Path, progress: Progress | None) -> BackupResult:
        cache = self._load_cache()
        damaged = self._damaged()
        agents = await self._source.agents()
        attachments = await self._source.attachments()
        total = len(agents) + len(attachments)
        counts = {"read": 0, "upload": 0}

        def tick(stage_name: str) -> None:
            counts[stage_name] += 1
            if progress:
                progress(stage_name, counts[stage_name], total)

        # An agent whose change marker is the one of the last backup, and an
        # attachment (content-addressed) backed up before, reuse their segment
        # as it is, if the target still has it.
        cached: list[SegmentRef] = []
        todo_agents: list[str] = []
        for agent in agents:
            hit = cache.get(agent.agent_id)
            if hit and hit.get("marker") == agent.marker and isinstance(hit.get("name"), str):
                cached.append(self._cached_ref(hit, "agent", agent.agent_id))
            else:
                todo_agents.append(agent.agent_id)
        todo_attachments: list[tuple[str, Path]] = []
        paths = dict(attachments)
        for sha, path in attachments:
            hit = cache.get(f"attachment:{sha}")
            if hit and isinstance(hit.get("name"), str):
                cached.append(self._cached_ref(hit, "attachment", sha))
            else:
                todo_attachments.append((sha, path))
        have = await self._target.have_segments({ref.name for ref in cached}) if cached else {}
        refs: list[SegmentRef] = []
        for ref in cached:
            if ref.name in have and ref.name not in damaged:
                refs.append(
                    SegmentRef(ref.name, ref.key, ref.kind, ref.ref, have[ref.name], ref.plain_size)
                )
                tick("read")
                tick("upload")
            elif ref.kind == "agent":
                todo_agents.append(ref.ref)  # the target lost it: read the agent again
            else:
                todo_attachments.append((ref.ref, paths[ref.ref]))
        packs = self._target if isinstance(self._target, PackTarget) else None
        pack_folder = await asyncio.to_thread(packs.pack_folder) if packs else None
        async with self._source.segment_maker(
            naming_key=self._naming_key,
            work_dir=stage,
            agents=len(todo_agents),
            pack_folder=pack_folder,
        ) as maker:
            writer = SegmentWriter(
                self._source.write_agent, self._target, naming_key=self._naming_key,
                work_dir=stage, tick=tick, maker=maker, replace=damaged,
            )  # fmt: skip
            written = await writer.write(todo_agents, todo_attachments)
        refs += written.refs
        # An attachment no agent names any more (its last one was erased while
        # this backup ran) stays out of the manifest; a prune removes its segment.
        still = {sha for sha, _ in await self._source.attachments()}
        refs = [r for r in refs if r.kind != "attachment" or r.ref in still]
        uploaded, uploaded_bytes = written.uploaded, written.uploaded_bytes
        manifest = BackupManifest(
            backup_id,
            self._machine_id,
            self._clock(),
            self._naming_key,
            tuple(refs),
            tuple(await self._source.usage()),
            tuple(await self._source.erased()),
            await self._source.settings(),
        )
        blob = seal_manifest(manifest, self._recipients)
        await self._commit(backup_id, blob, [r.name for r in refs])
        if damaged:
            # Sent again if this backup names them; if not, only older backups
            # do, and they go with those backups' prune. A name a verify noted
            # while this backup ran stays for the next one.
            self._forget_damaged(damaged)
        markers = {a.agent_id: a.marker for a in agents}
        # After the commit: the next increment continues this point.
        point_state(self._chain_target, backup_id, refs, agents).save(self._work)
        self._chain_seen = True
        self._save_cache(
            {
                (r.ref if r.kind == "agent" else f"attachment:{r.ref}"): {
                    "marker": markers.get(r.ref, ""),
                    "name": r.name,
                    "size": r.size,
                    "plain_size": r.plain_size,
                }
                for r in refs
            }
        )
        logger.info("backup %s: %d segments, %d uploaded", backup_id, len(refs), uploaded)
        return BackupResult(
            backup_id,
            len(refs),
            uploaded,
            uploaded_bytes,
            sum(r.size for r in refs) + len(blob),
            sum(r.plain_size for r in refs),
            0.0,
            agents=sum(1 for r in refs if r.kind == "agent"),
            created_at=manifest.created_at,
        )

    def _cached_ref(self, hit: dict[str, Any], kind: str, ref: str) -> SegmentRef:
        name = str(hit["name"])
        size = int(hit.get("size", 0)) if kind == "agent" else 0
        return SegmentRef(
            name, segment_key(self._naming_key, name), kind, ref, size, int(hit["plain_size"])
        )

    # -- increments (machine.backups.increments) ------------------------------

    async def has_agents(self) -> bool:
        """Whether there is any agent to back up."""
        return bool(await self._source.agents())

    def continuing(self) -> bool:
        """Whether a chain is known, so an increment can be made (else a point first)."""
        return ChainState.load(self._work, self._chain_target) is not None

    async def increment_now(self) -> BackupResult | None:
        """Ship an increment of what changed since the newest backup; None when
        nothing changed (nothing is asked of the target) or no chain is known."""
        async with self._lock:
            state = ChainState.load(self._work, self._chain_target)
            if state is None or not await self._base_stored(state):
                return None
            started = time.monotonic()
            # After its base whatever the clock says: a restore follows ids in order.
            now_ms = max(int(self._clock() * 1000), id_time_ms(state.base) + 1)
            backup_id = new_id("increment", now_ms=now_ms)
            ensure_private_dir(self._work)
            try:
                with tempfile.TemporaryDirectory(dir=self._work, prefix=".stage-") as stage:
                    made = await make_increment(
                        self._source, self._target, state, backup_id=backup_id,
                        machine_id=self._machine_id, naming_key=self._naming_key,
                        stage=Path(stage), clock=self._clock,
                    )  # fmt: skip
                    if made is None:
                        return None
                    blob = seal_manifest(made.manifest, self._recipients)
                    await self._commit(backup_id, blob, made.names)
            except BaseException:
                if isinstance(self._target, PackTarget):
                    await asyncio.to_thread(self._target.discard_pending)
                raise
            made.state.save(self._work)
            self._chains.known(Link.of(made.manifest))
            refs = made.manifest.segments
            logger.info("backup increment %s: %d segments", backup_id, len(refs))
            return BackupResult(
                backup_id,
                len(refs),
                made.uploaded,
                made.uploaded_bytes,
                made.uploaded_bytes + len(blob),
                sum(r.plain_size for r in refs),
                time.monotonic() - started,
                agents=sum(1 for r in refs if r.kind == "delta"),
                created_at=made.manifest.created_at,
            )

    async def _base_stored(self, state: ChainState) -> bool:
        """Whether the chain's base is stored (asked once per start: one listing).

        A chain whose base is gone (the target lost it, a data folder copied
        from elsewhere) is forgotten: increments on it would not restore, so
        the next interval starts a new chain with a point.
        """
        if self._chain_seen:
            return True
        listed = {i.backup_id for i in await self._target.list_manifests()}
        if state.base not in listed:
            logger.warning(
                "continuous backups: the chain's base %s is not stored; a point starts a new one",
                state.base,
            )
            ChainState.forget(self._work)
            return False
        self._chain_seen = True
        return True

    async def chain_at(self, at: float | None = None, keypair: BoxKeyPair | None = None) -> Chain:
        """What a restore to ``at`` (None: the newest) restores."""
        return await self._chains.at(at, keypair)

    async def chain_from(
        self, point_id: str, listed: list[ManifestInfo], keypair: BoxKeyPair | None = None
    ) -> Chain:
        """The point ``point_id`` and every increment continuing it (of ``listed``)."""
        return await self._chains.from_point(point_id, listed, keypair)

    async def chain_for(self, backup_id: str, keypair: BoxKeyPair | None = None) -> Chain:
        """The chain a backup id names (:meth:`BackupChains.for_id`)."""
        return await self._chains.for_id(backup_id, keypair)

    async def chains(self, keypair: BoxKeyPair | None = None) -> dict[str, Chain]:
        """Each point that opens, with the increments continuing it."""
        return await self._chains.every(keypair)

    async def fetch_chain(
        self, chain: Chain, dest: Path, keypair: BoxKeyPair | None = None
    ) -> FetchedBackup:
        """Fetch a point and its increments merged, to restore (see :mod:`.chain`)."""
        return await self._chains.fetch(chain, dest, keypair)

    async def verify_chain(self, chain: Chain, keypair: BoxKeyPair | None = None) -> VerifyResult:
        """Authenticate every segment of a point and of each of its increments."""
        return await self._chains.verify(chain, keypair)

    # -- reading (machine.backups.reader) -------------------------------------

    async def list_described(
        self, keypair: BoxKeyPair | None = None
    ) -> list[tuple[ManifestInfo, BackupManifest | None, str]]:
        """Every stored backup, oldest first, with its manifest when it opens (with
        ``keypair``, a recovery key, or the machine's) and why not when it does not
        (:meth:`BackupReader.list_described`)."""
        return await self._reader.list_described(keypair)

    async def list(self) -> list[tuple[ManifestInfo, BackupManifest | None]]:
        """Every stored backup, oldest first, with its manifest when it opens."""
        return await self._reader.list()

    async def open(self, backup_id: str, keypair: BoxKeyPair | None = None) -> BackupManifest:
        """Open one manifest (with the machine's key, or a recovery key)."""
        return await self._reader.open(backup_id, keypair)

    async def verify(self, backup_id: str, keypair: BoxKeyPair | None = None) -> VerifyResult:
        """Open a backup and authenticate every segment (:meth:`BackupReader.verify`)."""
        return await self._reader.verify(backup_id, keypair)

    async def fetch(
        self,
        backup_id: str,
        dest: Path,
        keypair: BoxKeyPair | None = None,
        *,
        decode_agents: bool = True,
    ) -> FetchedBackup:
        """Download and decode a whole backup into the new folder ``dest``
        (:meth:`BackupReader.fetch`)."""
        return await self._reader.fetch(backup_id, dest, keypair, decode_agents=decode_agents)

    # -- pruning -------------------------------------------------------------

    async def prune(self) -> PruneResult:
        """Keep the newest ``keep`` points and their increments; delete the rest and
        unreferenced segments."""
        async with self._lock:
            return await self._target.prune(self.keep)
