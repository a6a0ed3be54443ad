"""The control plane's keeping of machines' sealed backups."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from controlplane.machines.backups import BackupLimits, MachineBackups, backups_prefix
from shared.backup_target import manifest_key, names_key, segment_key
from shared.errors import (
    IntegrityError,
    InvalidArgument,
    InvalidId,
    NotFound,
    PermissionDenied,
    TooLarge,
)
from shared.ids import new_id
from shared.store.authenticated import MAC_HEADER, AuthenticatedStore
from shared.store.memory import MemoryStore

ACCT = new_id("account")


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def test_machines_never_see_each_others_backups() -> None:
    store = MemoryStore()
    backups = MachineBackups(store)
    mine, other = new_id("machine"), new_id("machine")
    name, backup = os.urandom(32).hex(), new_id("backup")
    assert await backups.put_segment(ACCT, mine, name, _chunks(b"sealed", b"bytes")) == 11
    await backups.put_manifest(ACCT, mine, backup, b"manifest", [name])
    assert await backups.have_segments(ACCT, other, [name]) == {}
    assert await backups.list_manifests(ACCT, other) == []
    with pytest.raises(NotFound):
        await backups.get_manifest(ACCT, other, backup)
    assert [m.backup_id for m in await backups.list_manifests(ACCT, mine)] == [backup]
    keys = [i.key async for i in store.list("")]
    assert all(k.startswith(backups_prefix(ACCT, mine)) for k in keys)


async def test_oversized_segment_and_manifest_refused_and_not_kept() -> None:
    backups = MachineBackups(MemoryStore(), BackupLimits(max_manifest=10, max_segment=8))
    machine, name = new_id("machine"), os.urandom(32).hex()
    with pytest.raises(TooLarge):
        await backups.put_segment(ACCT, machine, name, _chunks(b"12345", b"67890"))
    assert await backups.have_segments(ACCT, machine, [name]) == {}
    with pytest.raises(TooLarge):
        await backups.put_manifest(ACCT, machine, new_id("backup"), b"x" * 11, [])
    assert await backups.list_manifests(ACCT, machine) == []


async def test_prune_and_bad_ids() -> None:
    backups = MachineBackups(MemoryStore())
    machine = new_id("machine")
    with pytest.raises(InvalidArgument, match="keep"):
        await backups.prune(ACCT, machine, 0)
    with pytest.raises(InvalidId):
        await backups.list_manifests("acct_../../x", machine)
    for t in (1000, 2000):
        await backups.put_manifest(ACCT, machine, new_id("backup", now_ms=t), b"m", [])
    assert len((await backups.prune(ACCT, machine, 1)).manifests) == 1


async def test_prune_keeps_increments_with_their_point() -> None:
    """The control plane cannot open manifests: it tells increments by their ids."""
    backups = MachineBackups(MemoryStore())
    machine = new_id("machine")
    ids = [new_id(k, now_ms=t) for k, t in (("backup", 1000), ("increment", 1500),
                                            ("backup", 2000), ("increment", 2500))]  # fmt: skip
    for backup in ids:
        await backups.put_manifest(ACCT, machine, backup, b"m", [])
    assert set((await backups.prune(ACCT, machine, 1)).manifests) == set(ids[:2])
    assert [i.backup_id for i in await backups.list_manifests(ACCT, machine)] == ids[2:]


async def test_reads_of_another_machine_only_within_the_account() -> None:
    mine, sibling, stranger = new_id("machine"), new_id("machine"), new_id("machine")
    owners = {(ACCT, mine), (ACCT, sibling)}

    async def exists(account_id: str, machine_id: str) -> bool:
        return (account_id, machine_id) in owners

    backups = MachineBackups(MemoryStore(), exists=exists)
    assert await backups.source(ACCT, mine, "") == mine
    assert await backups.source(ACCT, mine, sibling) == sibling
    other_acct = new_id("account")
    owners.add((other_acct, stranger))
    with pytest.raises(NotFound) as foreign:
        await backups.source(ACCT, mine, stranger)
    missing = new_id("machine")
    with pytest.raises(NotFound) as absent:
        await backups.source(ACCT, mine, missing)
    assert str(foreign.value).replace(stranger, "X") == str(absent.value).replace(missing, "X")
    with pytest.raises(InvalidId):
        await backups.source(ACCT, mine, "mc_../../x")


async def test_segment_stream_must_match_its_declared_size_and_is_stored_once() -> None:
    backups = MachineBackups(MemoryStore())
    machine, name = new_id("machine"), os.urandom(32).hex()
    for parts in ((b"12345",), (b"1234567", b"89")):
        with pytest.raises((InvalidArgument, TooLarge)):
            await backups.put_segment(ACCT, machine, name, _chunks(*parts), declared=8)
        assert await backups.have_segments(ACCT, machine, [name]) == {}
    assert await backups.put_segment(ACCT, machine, name, _chunks(b"12345678"), declared=8) == 8
    assert await backups.put_segment(ACCT, machine, name, _chunks(b"12345678"), declared=8) == 0
    assert await backups.have_segments(ACCT, machine, [name]) == {name: 8}
    with pytest.raises(InvalidArgument, match="hash"):
        await backups.have_segments(ACCT, machine, ["../etc"])
    with pytest.raises(TooLarge):
        await backups.have_segments(ACCT, machine, [name] * 10_001)


async def test_replace_writes_over_a_stored_segment_whole_or_not_at_all() -> None:
    """A machine that found its stored copy damaged sends it again with ``replace``:
    the new bytes take its place; a failed upload leaves the old copy; another
    machine's segment of the same name is not touched."""
    store = MemoryStore()
    backups = MachineBackups(store)
    machine, other, name = new_id("machine"), new_id("machine"), os.urandom(32).hex()
    key = backups_prefix(ACCT, machine) + segment_key(name)
    assert await backups.put_segment(ACCT, machine, name, _chunks(b"damaged!")) == 8
    assert await backups.put_segment(ACCT, other, name, _chunks(b"theirs")) == 6
    assert await backups.put_segment(ACCT, machine, name, _chunks(b"good")) == 0
    assert (await store.get(key)) == b"damaged!"
    with pytest.raises(InvalidArgument):
        await backups.put_segment(ACCT, machine, name, _chunks(b"short"), declared=9, replace=True)
    assert (await store.get(key)) == b"damaged!"
    assert await backups.put_segment(ACCT, machine, name, _chunks(b"go", b"od"), replace=True) == 4
    assert (await store.get(key)) == b"good"
    assert await backups.have_segments(ACCT, machine, [name]) == {name: 4}
    assert await backups.have_segments(ACCT, other, [name]) == {name: 6}


async def test_an_upload_that_outlasts_its_accounts_deletion_keeps_nothing() -> None:
    store = MemoryStore()
    deleting: set[str] = set()

    async def gone(account_id: str) -> bool:
        return account_id in deleting

    backups = MachineBackups(store, gone=gone)
    machine, name = new_id("machine"), os.urandom(32).hex()

    async def slow_upload() -> AsyncIterator[bytes]:
        yield b"sealed"
        # Authorized at the call's start; the deletion began (and may have
        # finished its sweep) while the bytes were on their way.
        deleting.add(ACCT)
        yield b"bytes"

    with pytest.raises(PermissionDenied, match="account is being deleted"):
        await backups.put_segment(ACCT, machine, name, slow_upload())
    with pytest.raises(PermissionDenied):
        await backups.put_manifest(ACCT, machine, new_id("backup"), b"manifest", [name])
    assert [i.key async for i in store.list("")] == []
    # Another account's uploads go on.
    other = new_id("account")
    assert await backups.put_segment(other, machine, name, _chunks(b"x")) == 1


async def test_manifests_are_macd_so_one_planted_or_moved_in_the_bucket_is_refused() -> None:
    raw = MemoryStore()  # what write access to the bucket reaches
    backups = MachineBackups(raw, records=AuthenticatedStore(raw, os.urandom(32)))
    mine, sibling = new_id("machine"), new_id("machine")
    name, kept = os.urandom(32).hex(), new_id("backup", now_ms=1000)
    await backups.put_segment(ACCT, mine, name, _chunks(b"sealed segment"))
    await backups.put_manifest(ACCT, mine, kept, b"sealed manifest", [name])
    root = backups_prefix(ACCT, mine)
    # The manifest and its names list carry the MAC; the segment is stored as sent.
    assert (await raw.get(root + manifest_key(kept))).startswith(MAC_HEADER)
    assert (await raw.get(root + names_key(kept))).startswith(MAC_HEADER)
    assert await raw.get(root + segment_key(name)) == b"sealed segment"
    assert await backups.get_manifest(ACCT, mine, kept) == b"sealed manifest"

    # A newer backup planted without the key: listed (listings read nothing), but
    # never handed out; nor a genuine manifest moved to another machine.
    planted = new_id("backup", now_ms=2000)
    await raw.put(root + manifest_key(planted), b"forged manifest")
    await raw.put(root + names_key(planted), b"[]")
    assert [m.backup_id for m in await backups.list_manifests(ACCT, mine)] == [kept, planted]
    with pytest.raises(IntegrityError, match="carries no MAC"):
        await backups.get_manifest(ACCT, mine, planted)
    moved = backups_prefix(ACCT, sibling) + manifest_key(kept)
    await raw.put(moved, await raw.get(root + manifest_key(kept)))
    with pytest.raises(IntegrityError, match="MAC does not match"):
        await backups.get_manifest(ACCT, sibling, kept)

    # A kept backup whose names list does not verify: prune deletes nothing (it
    # cannot tell which segments the kept backups need).
    await raw.put(root + names_key(planted), b"[]")
    assert (await backups.prune(ACCT, mine, 1)).manifests == ()
    assert await backups.have_segments(ACCT, mine, [name]) == {name: 14}
    assert await backups.get_manifest(ACCT, mine, kept) == b"sealed manifest"
