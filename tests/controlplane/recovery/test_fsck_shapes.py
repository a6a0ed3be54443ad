"""``fsck`` knows every key shape: a store after normal use is clean; an unknown key,
a copy of a genuine object at another key and an orphaned object are each named,
and ``--repair`` removes only what is garbage (folder store; tests/integration/test_fsck.py
does the same against a real control plane on S3)."""

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
from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.records import (
    Presence,
    encode,
    machine_revoked_key,
    presence_key,
    roster_key,
    token_use_key,
)
from controlplane.integrity.trusted import open_trusted_store
from controlplane.machines.backups import MachineBackups
from controlplane.machines.registry import MachineInfo
from controlplane.machines.rosters import AgentRosters
from controlplane.queue.idempotency import acked_prefix
from controlplane.queue.prompts import PromptQueue, QueueLimits
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.services import Services
from shared import tls
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


async def _fsck(
    cfg: ControlConfig, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, Any]:
    code = await asyncio.to_thread(main, ["fsck", "--home", str(cfg.home), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


async def _one(data: bytes) -> Any:
    yield data


async def _used(tmp_path: Path) -> dict[str, str]:
    """A deployment after normal use: accounts, an account credential, tokens, joins, a
    revoked machine, a roster and presence, a keyed prompt sent and acknowledged, one
    queued, a backup, a provider removed, a deleted account. Returns the ids."""
    cfg = _cfg(tmp_path)
    await init_control_plane(cfg)
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        s = Services(cfg, trusted.store, keys, trusted.backups)
        op = Principal(new_id("credential"), "operator")
        acct = (await s.accounts.create(9, "n", None, "test")).account.account_id
        gone = (await s.accounts.create(10, "g", None, "test")).account.account_id
        await s.credentials.create_for_account(op, acct, "admin")
        machines = []
        for a in (acct, acct, gone):
            made = await s.tokens.create(op, a)
            joined = await s.pairing.join(
                made.value,
                tls.build_csr(tls.new_tls_key()).decode(),
                MachineInfo("m", "0.1", "h", box_public_key=BoxKeyPair.generate().public_key),
            )
            await s.machines.confirm(joined.machine)
            machines.append(joined.machine.machine_id)
        await s.tokens.create(op, acct)  # never used
        await s.machines.revoke(op, machines[1])
        await AgentRosters(trusted.store).report(acct, machines[0], (new_id("agent"),), ())
        await trusted.store.put(
            presence_key(acct, machines[0]),
            encode(Presence(machines[0], dt.datetime.now(dt.UTC), "0.1", 1)),
        )
        queue = PromptQueue(
            trusted.store,
            s.machines,
            s.auditor,
            limits=QueueLimits(max_depth=10, max_prompt_bytes=1000, ttl=dt.timedelta(days=7)),
        )
        agent = new_id("agent")
        await queue.send(op, machines[0], agent, "acknowledged", "key-1")
        (entry,) = await queue.pending(acct, machines[0])
        await queue.acknowledged(entry, run_id=new_id("run"))
        await queue.send(op, machines[0], agent, "still queued")
        assert trusted.backups is not None
        backups = MachineBackups(trusted.backups, records=trusted.store)
        name = os.urandom(32).hex()
        await backups.put_segment(acct, machines[0], name, _one(b"sealed segment"))
        await backups.put_manifest(acct, machines[0], new_id("backup"), b"sealed", [name])
        await s.deletion.delete(op, gone)
        await s.deletion.finish(gone)
    finally:
        await trusted.close()
    return {"acct": acct, "gone": gone, "machine": machines[0], "revoked": machines[1]}


async def test_a_store_after_normal_use_is_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await _used(tmp_path)
    store = FolderStore(tmp_path / "store")
    keys = [i.key async for i in store.list("")]
    # Every kind of object normal use makes is there to be checked.
    made = ("/token-uses/", "/revoked/", "/queue-acked/", "/queue/", "/rosters/", "/presence/")
    for part in made:
        assert any(part in k for k in keys), part
    assert f"deleted/{ids['gone']}.json" in keys
    code, report = await _fsck(_cfg(tmp_path), capsys)
    assert (code, report["findings"]) == (0, []), report


async def test_unknown_forged_and_orphaned_keys_are_named_and_only_garbage_repaired(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await _used(tmp_path)
    acct, machine = ids["acct"], ids["machine"]
    cfg = _cfg(tmp_path)
    ghost_machine, ghost_token = new_id("machine"), new_id("token")
    raw = FolderStore(tmp_path / "store")
    (acked,) = [i.key async for i in raw.list(acked_prefix(acct, machine))]
    genuine_machine = f"accounts/{acct}/machines/{machine}.json"
    planted = {
        # Unknown shapes: no MAC (kept), a genuine object's copy (MAC fails: removed),
        # and anything under a machine's backups (never read, kept).
        "notes.txt": ("unknown", False),
        f"accounts/{acct}/machines/{machine}.json.old": ("unknown", True),
        f"accounts/{acct}/backups/{machine}/junk": ("unknown", False),
        # Known shapes whose MAC binds them elsewhere.
        f"accounts/{acct}/revoked/{machine}.json": ("refused", False),
        acked.replace(machine, ids["revoked"]): ("misplaced", True),
    }
    async with raw:
        await raw.put("notes.txt", b"someone's file")
        copy = await raw.get(genuine_machine)
        await raw.put(f"accounts/{acct}/machines/{machine}.json.old", copy)
        await raw.put(f"accounts/{acct}/backups/{machine}/junk", b"sealed?")
        await raw.put(f"accounts/{acct}/revoked/{machine}.json", copy)
        await raw.put(acked.replace(machine, ids["revoked"]), await raw.get(acked))
    # Genuine objects (sealed with the home's key) that nothing owns any more.
    keys = load_home_keys(cfg.home)
    trusted = await open_trusted_store(cfg, keys, None)
    try:
        orphans = {
            presence_key(acct, ghost_machine): True,
            roster_key(acct, ghost_machine): True,
            machine_revoked_key(acct, ghost_machine): False,
            token_use_key(acct, ghost_token, new_id("intent")): False,
        }
        for key in orphans:
            await trusted.store.put(key, encode({"machine_id": ghost_machine}))
        # A shape no version of this code writes, with a MAC that verifies: kept.
        await trusted.store.put("cp/from-a-newer-version.json", b"{}")
    finally:
        await trusted.close()
    planted |= {k: ("orphan", r) for k, r in orphans.items()}
    planted["cp/from-a-newer-version.json"] = ("unknown", False)

    code, report = await _fsck(cfg, capsys)
    found = {f["key"]: (f["kind"], f["repaired"]) for f in report["findings"]}
    assert code == 1
    assert found == {k: (kind, False) for k, (kind, _) in planted.items()}, report

    code, report = await _fsck(cfg, capsys, "--repair")
    found = {f["key"]: (f["kind"], f["repaired"]) for f in report["findings"]}
    assert found == planted and code == 1, report
    async with FolderStore(tmp_path / "store") as after:
        left = {i.key async for i in after.list("")}
    assert {k for k, (_, gone) in planted.items() if gone} & left == set()
    assert {k for k, (_, gone) in planted.items() if not gone} <= left
    assert genuine_machine in left and acked in left

    code, report = await _fsck(cfg, capsys)
    assert {f["key"] for f in report["findings"]} == {
        k for k, (_, gone) in planted.items() if not gone
    }
