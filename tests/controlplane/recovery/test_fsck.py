"""``agents-control fsck``: findings, ``--repair``, ``--json`` and exit codes, on a folder store."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest

from controlplane.access.principals import Principal
from controlplane.cli.main import main
from controlplane.config import ControlConfig
from controlplane.deletion.sweep import AccountSweep
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.records import encode
from controlplane.integrity.trusted import open_trusted_store
from controlplane.machines.backups import MachineBackups
from controlplane.machines.registry import MachineInfo
from controlplane.queue.prompts import PromptQueue, QueueLimits, queue_prefix
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.services import Services
from shared import tls
from shared.backup_target import manifest_key, names_key, segment_key
from shared.crypto import BoxKeyPair
from shared.ids import new_id
from shared.store import FolderStore


def _cfg(tmp_path: Path) -> ControlConfig:
    return ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()


async def _main(*argv: str) -> int:
    # The CLI runs its own event loop: give it a thread.
    return await asyncio.to_thread(main, list(argv))


async def _fsck(
    cfg: ControlConfig, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, Any]:
    code = await _main("fsck", "--home", str(cfg.home), "--json", *args)
    return code, json.loads(capsys.readouterr().out)


async def test_fsck_finds_repairs_and_exits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        services = Services(cfg, trusted.store, keys)
        made = await services.accounts.create(9, "n", None, "test")
        acct = made.account.account_id
        op = Principal(new_id("credential"), "operator")
        token = (await services.tokens.create(op, acct)).token
        store = trusted.store
        # An orphan index entry, a record without its index entry, an unfinished
        # change (a token create that never committed), and a forged object.
        orphan = new_id("machine")
        await store.put(f"index/machines/{orphan}.json", encode({"account_id": acct}))
        await store.delete(f"index/tokens/{token.token_id}.json")
        half = new_id("token")
        intent = await services.intents.begin("token.create", account_id=acct, token_id=half)
        services.intents.release(intent)
        await store.put(f"index/tokens/{half}.json", encode({"account_id": acct}))
        async with FolderStore(tmp_path / "store") as raw:  # bucket access, no key
            await raw.put("credentials/" + new_id("credential") + ".json", b'{"scope": "operator"}')
    finally:
        await trusted.close()

    code, report = await _fsck(cfg, capsys)
    kinds = sorted(f["kind"] for f in report["findings"])
    assert code == 1 and not report["clean"]
    assert kinds == ["missing_index", "orphan_index", "orphan_index", "refused", "unfinished"]

    code, report = await _fsck(cfg, capsys, "--repair")
    # Everything but the forged object is repaired; that one an operator must look at.
    left = [f["kind"] for f in report["findings"] if not f["repaired"]]
    assert left == ["refused"] and code == 1

    code, report = await _fsck(cfg, capsys)
    assert [f["kind"] for f in report["findings"]] == ["refused"] and code == 1


async def test_fsck_clean_store_exits_0_and_refuses_repair_while_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    assert await _main("fsck", "--home", str(cfg.home)) == 0
    assert "clean" in capsys.readouterr().out
    # A live serve (this process stands in for it) makes --repair a usage error.
    cfg.serve_path.write_text(json.dumps({"pid": os.getpid()}))
    assert await _main("fsck", "--home", str(cfg.home), "--repair") == 2
    err = capsys.readouterr().err
    assert "--repair needs serve stopped" in err and len(err.splitlines()) == 2


async def test_fsck_reports_a_deletion_in_progress_and_repair_finishes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        services = Services(cfg, trusted.store, keys)
        op = Principal(new_id("credential"), "operator")
        acct = (await services.accounts.create(9, "n", None, "test")).account.account_id
        kept = (await services.accounts.create(10, "k", None, "test")).account.account_id
        for a in (acct, kept):
            await services.tokens.create(op, a)
        # A deletion that died after removing the index entries, before the records:
        # exactly what fsck would otherwise call missing index entries.
        finish = services.deletion.finish

        async def die_midway(account_id: str) -> None:
            raise RuntimeError("killed")

        services.deletion.finish = die_midway  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await services.deletion.delete(op, acct)
        services.deletion.finish = finish  # type: ignore[method-assign]
        await AccountSweep(trusted.store, acct).index_entries(9)
    finally:
        await trusted.close()

    code, report = await _fsck(cfg, capsys)
    assert (code, report["findings"], report["deleting"]) == (0, [], [acct])

    code, report = await _fsck(cfg, capsys, "--repair")
    assert code == 0 and report["deleting"] == []
    store = FolderStore(tmp_path / "store")
    left = [i.key async for i in store.list("") if acct in i.key]
    assert left == [f"deleted/{acct}.json"]
    assert [i.key async for i in store.list(f"accounts/{kept}/")]
    code, report = await _fsck(cfg, capsys)
    assert (code, report["findings"], report["deleting"]) == (0, [], [])

    # A backup segment that landed after the deletion's last sweep (its upload was
    # under way and the control plane died before it looked for the deletion).
    late = f"accounts/{acct}/backups/{new_id('machine')}/segments/{'ab' * 32}"
    await store.put(late, b"sealed bytes")
    code, report = await _fsck(cfg, capsys)
    assert code == 1
    assert [(f["kind"], f["key"]) for f in report["findings"]] == [("deleted_leftover", late)]
    code, report = await _fsck(cfg, capsys, "--repair")
    assert code == 0 and not [i.key async for i in store.list(f"accounts/{acct}/")]
    # Another account's objects are never touched.
    assert [i.key async for i in store.list(f"accounts/{kept}/")]


async def test_fsck_an_account_delete_intent_without_tombstone_is_unfinished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        services = Services(cfg, trusted.store, keys)
        acct = (await services.accounts.create(9, "n", None, "test")).account.account_id
        # Died between the intent and the tombstone: nobody was told anything.
        intent = await services.intents.begin("account.delete", account_id=acct)
        services.intents.release(intent)
    finally:
        await trusted.close()
    code, report = await _fsck(cfg, capsys)
    assert code == 1 and [f["kind"] for f in report["findings"]] == ["unfinished"]
    assert report["deleting"] == []
    code, report = await _fsck(cfg, capsys, "--repair")
    assert code == 0 and report["findings"][0]["repaired"]
    code, report = await _fsck(cfg, capsys)
    assert (code, report["findings"]) == (0, [])
    store = FolderStore(tmp_path / "store")
    assert [i.key async for i in store.list(f"accounts/{acct}/")] == [
        f"accounts/{acct}/account.json"
    ]


async def test_fsck_refuses_a_planted_backup_manifest_and_leaves_segments_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        services = Services(cfg, trusted.store, keys)
        acct = (await services.accounts.create(9, "n", None, "test")).account.account_id
        machine = await _joined(services, acct)
        assert trusted.backups is not None
        backups = MachineBackups(trusted.backups, records=trusted.store)
        name = os.urandom(32).hex()
        await backups.put_segment(acct, machine, name, _one(b"sealed segment"))
        await backups.put_manifest(acct, machine, new_id("backup"), b"sealed manifest", [name])
    finally:
        await trusted.close()
    code, report = await _fsck(cfg, capsys)
    assert (code, report["findings"]) == (0, [])

    # Bucket access alone: a planted manifest and names list (no MAC at all, as a
    # control plane before manifests were MAC'd wrote them too), a genuine manifest
    # copied to another id (its MAC does not match there), and a segment (segments
    # are authenticated by the manifests that name them, not by a MAC).
    root = f"accounts/{acct}/backups/{machine}/"
    planted, moved = new_id("backup"), new_id("backup")
    async with FolderStore(tmp_path / "store") as raw:
        await raw.put(root + manifest_key(planted), b"forged")
        await raw.put(root + names_key(planted), b"[]")
        genuine = [k async for k in raw.list(root + "manifests/") if k.key.endswith(".sealed")]
        await raw.put(root + manifest_key(moved), await raw.get(genuine[0].key))
        await raw.put(root + segment_key("cd" * 32), b"anything")
    code, report = await _fsck(cfg, capsys)
    found = sorted((f["kind"], f["key"]) for f in report["findings"])
    assert code == 1
    assert found == [
        ("refused", root + manifest_key(moved)),
        ("unmacd_backup", root + names_key(planted)),
        ("unmacd_backup", root + manifest_key(planted)),
    ]
    code, report = await _fsck(cfg, capsys, "--repair")
    assert code == 1 and not any(f["repaired"] for f in report["findings"])
    assert await _main("fsck", "--home", str(cfg.home), "--vouch-backups") == 2
    assert "give --repair too" in capsys.readouterr().err

    # After an upgrade, on a store only this control plane wrote: the operator vouches
    # for the MAC-less ones; one whose MAC does not match is never vouched for.
    code, report = await _fsck(cfg, capsys, "--repair", "--vouch-backups")
    repaired = sorted((f["kind"], f["repaired"]) for f in report["findings"])
    assert repaired == [("refused", False), ("unmacd_backup", True), ("unmacd_backup", True)]
    code, report = await _fsck(cfg, capsys)
    assert [(f["kind"], f["key"]) for f in report["findings"]] == [
        ("refused", root + manifest_key(moved))
    ]
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        assert trusted.backups is not None
        backups = MachineBackups(trusted.backups, records=trusted.store)
        assert await backups.get_manifest(acct, machine, planted) == b"forged"
    finally:
        await trusted.close()


async def _one(data: bytes) -> Any:
    yield data


async def _joined(services: Services, acct: str) -> str:
    """A machine joined to ``acct`` and confirmed (as its first connection does)."""
    op = Principal(new_id("credential"), "operator")
    made = await services.tokens.create(op, acct)
    joined = await services.pairing.join(
        made.value,
        tls.build_csr(tls.new_tls_key()).decode(),
        MachineInfo("m", "0.1", "h", box_public_key=BoxKeyPair.generate().public_key),
    )
    await services.machines.confirm(joined.machine)
    return joined.machine.machine_id


async def test_fsck_finds_and_repairs_queued_prompts_copied_to_other_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a queued prompt copied to a later key or to another machine's queue was
    refused by its MAC when read, but stayed in the bucket and fsck reported clean."""
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        services = Services(cfg, trusted.store, keys)
        op = Principal(new_id("credential"), "operator")
        acct = (await services.accounts.create(9, "n", None, "test")).account.account_id
        machines = [await _joined(services, acct) for _ in range(2)]
        queue = PromptQueue(
            trusted.store,
            services.machines,
            services.auditor,
            limits=QueueLimits(max_depth=10, max_prompt_bytes=1000, ttl=dt.timedelta(days=7)),
        )
        await queue.send(op, machines[0], new_id("agent"), "a prompt for the first machine")
    finally:
        await trusted.close()
    raw = FolderStore(tmp_path / "store")
    try:
        (entry,) = [i.key async for i in raw.list(queue_prefix(acct, machines[0]))]
        data = await raw.get(entry)
        later = entry.replace(entry.rsplit("/", 1)[1][:20], "9" * 20)
        elsewhere = queue_prefix(acct, machines[1]) + entry.rsplit("/", 1)[1]
        for key in (later, elsewhere):
            await raw.put(key, data)
    finally:
        await raw.close()

    code, report = await _fsck(cfg, capsys)
    found = {f["key"]: f for f in report["findings"]}
    assert code == 1 and set(found) == {later, elsewhere}, report
    assert all(f["kind"] == "misplaced" and not f["repaired"] for f in found.values())
    code, report = await _fsck(cfg, capsys, "--repair")
    assert all(f["repaired"] for f in report["findings"]) and len(report["findings"]) == 2
    code, report = await _fsck(cfg, capsys)
    assert code == 0 and report["clean"], report
    raw = FolderStore(tmp_path / "store")
    try:
        assert [i.key async for i in raw.list(f"accounts/{acct}/queue/")] == [entry]
    finally:
        await raw.close()
