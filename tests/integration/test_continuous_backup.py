"""Lose at most the last interval (issue 35's first "must show"), real processes.

A joined machine on a real control plane over moto's S3 ships continuous backups
every ``backup_interval`` (10 s here, the least allowed). After a daily point,
20 prompts are run; once the increment that follows the last of them is in the
bucket (within the interval of its finish), the machine is SIGKILLed and its data
folder wiped. ``machine repair`` and ``join --recovery-key`` on a fresh folder
restore all 20 prompts' events, byte-equal.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from machine.link import identity
from shared.crypto import BoxKeyPair, encode_public_key
from shared.ids import id_time_ms
from shared.recovery_key import write_recovery_key
from tests.conftest import _s3_client
from tests.helpers.control_proc import ControlProc
from tests.helpers.poll import poll_until
from tests.integration.test_backup_repair import (  # noqa: F401 - cp is a fixture
    Joined,
    _cli,
    _client,
    _exported,
    _ok,
    _printed_command,
    cp,
)

pytestmark = pytest.mark.integration

INTERVAL = 10.0
PROMPTS = 20


@pytest.mark.timeout(120)
async def test_a_wiped_machine_is_repaired_with_the_last_runs_events(
    cp: ControlProc,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    moto_endpoint: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTS_MACHINE_BACKUP_INTERVAL", str(INTERVAL))
    recovery = BoxKeyPair.generate()
    key_file = tmp_path / "recovery.key"
    write_recovery_key(key_file, recovery, "the test account's backups")
    account = _ok(
        cp.cli(
            "account", "create", "--github-id", "9200", "--github-login", "dana",
            "--recovery-public-key", encode_public_key(recovery.public_key),
        )
    )  # fmt: skip
    account_id = next(w for w in account.split() if w.startswith("acct_"))
    old_dir = tmp_path / "old"
    first = Joined(
        _printed_command(_ok(cp.cli("token", "create", "--account", account_id))),
        old_dir,
        tmp_path / "old.log",
    )
    s3 = _s3_client(moto_endpoint)
    try:
        first.wait_for("serving on")
        machine_id = identity.load_link(old_dir).machine_id
        async with _client(old_dir) as client:
            agent = (await client.create_agent("continuous", str(tmp_path))).id
            point = _cli(old_dir, "backup", "now")  # the daily point the increments continue
            assert "bk_" in point, point
            for i in range(PROMPTS):
                kinds = [ev.kind.name async for ev in client.prompt(agent, f"MARKER-{i} hi")]
                assert kinds[-1] == "RUN_FINISHED", kinds
            finished = time.time()
            before = await _exported(client, [agent])

        prefix = f"cp/accounts/{account_id}/backups/{machine_id}/manifests/bki_"

        after: list[float] = []

        def shipped() -> bool:
            # An increment numbered after the last run finished lists the agents
            # after it: it holds the run.
            listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix=prefix).get("Contents", [])
            names = [o["Key"].rsplit("/", 1)[1] for o in listed]
            ids = [n.removesuffix(".sealed") for n in names if n.endswith(".sealed")]
            after[:] = [id_time_ms(b) / 1000 for b in ids if id_time_ms(b) >= finished * 1000]
            return bool(after)

        poll_until(shipped, deadline=INTERVAL + 20, what="an increment after the last run")
        # Looked at within the interval (a look every half of it), then uploaded.
        assert min(after) - finished < INTERVAL, (min(after), finished)
        # The disk is lost at once: no clean stop, nothing flushed.
        first.proc.kill()
        first.proc.wait(timeout=15)
    finally:
        first.stop()
    shutil.rmtree(old_dir)

    argv = _printed_command(_ok(cp.cli("machine", "repair", machine_id)))
    argv[-1] = str(key_file)
    second = Joined(argv, tmp_path / "new", tmp_path / "new.log")
    try:
        second.wait_for("restored 1 agents (archived) from backup bki_")
        second.wait_for("serving on")
        async with _client(tmp_path / "new") as client:
            after = await _exported(client, [agent])
        assert after == before, "all 20 prompts' events, byte-equal"
        conversation = next(v for k, v in after.items() if k.endswith("conversation.jsonl"))
        assert all(f"MARKER-{i} hi".encode() in conversation for i in range(PROMPTS))
    finally:
        second.stop()
