"""machine.backups.service: daily timing, restore checks with metrics, status, keys."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from machine.api import codec
from machine.app import Machine, open_machine
from machine.backups.keys import (
    keep_standalone_recovery_key,
    load_backup_keys,
    new_standalone_recovery_key,
)
from machine.backups.service import BackupMetrics, BackupService, parse_daily_time, same_device
from machine.config import MachineConfig
from shared.backup_target import ManifestInfo, PruneResult, StoreTarget
from shared.crypto import BoxKeyPair
from shared.errors import InvalidArgument, InvalidState, TransientError
from shared.ids import id_time_ms, new_id
from shared.store.folder import FolderStore


def _config(root: Path) -> MachineConfig:
    return MachineConfig(data_dir=root, background_loops=False, shutdown_grace_seconds=0).validate()


async def _agent(m: Machine, tmp: Path, text: str) -> str:
    agent = (await m.agents.create(name="a", folder=str(tmp))).id
    async for _ in await m.runs.prompt(agent, text):
        pass
    return agent


def _service(m: Machine, target: Path, registry: CollectorRegistry) -> BackupService:
    return BackupService(
        m.db,
        StoreTarget(FolderStore(target)),
        target_name=f"folder {target}",
        machine_id=m.ids.canonical,
        keys=load_backup_keys(m.config.data_dir),
        data_dir=m.config.data_dir,
        attachments_dir=m.config.attachments_dir,
        keep=3,
        daily_at=dt.time(3, 30),
        metrics=BackupMetrics(registry),
    )


def _metric(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name)


async def test_backup_check_and_metrics(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "hello")
        service = _service(m, tmp_path / "target", registry)
        before = service.status()
        assert before.last_backup_at is None and not before.recovery_key
        assert any("no recovery key" in w for w in before.warnings)
        result = await service.backup_now()
        check = await service.restore_check()
        assert check.ok and check.backup_id == result.backup_id
        assert _metric(registry, "agents_machine_restore_check_ok") == 1
        assert _metric(registry, "agents_machine_backup_last_success_timestamp_seconds")
        assert registry.get_sample_value("agents_machine_backups_total", {"result": "ok"}) == 1
        # Damage the only backup: the next check fails and says so in the metric.
        seg = next((tmp_path / "target" / "segments").iterdir())
        seg.write_bytes(seg.read_bytes()[:-40])
        failed = await service.restore_check()
        assert not failed.ok and failed.problem
        assert _metric(registry, "agents_machine_restore_check_ok") == 0
        assert service.status().last_check == failed


async def test_check_fails_when_a_backed_up_agent_is_missing(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "one")
        service = _service(m, tmp_path / "target", CollectorRegistry())
        await service.backup_now()
    async with open_machine(_config(tmp_path / "other")) as other:
        foreign = BackupService(
            other.db,
            StoreTarget(FolderStore(tmp_path / "target")),
            target_name="t",
            machine_id=service.engine._machine_id,
            keys=load_backup_keys(tmp_path / "m"),
            data_dir=other.config.data_dir,
            attachments_dir=other.config.attachments_dir,
            keep=3,
            daily_at=dt.time(1, 0),
        )
        check = await foreign.restore_check()
        assert not check.ok and "not on this machine" in check.problem


async def test_restore_brings_agents_back_archived(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = await _agent(m, tmp_path, "keep me")
        recovery = new_standalone_recovery_key(m.config.data_dir)
        with pytest.raises(InvalidState, match="has one already"):
            new_standalone_recovery_key(m.config.data_dir)
        service = _service(m, tmp_path / "target", CollectorRegistry())
        assert service.status().recovery_key
        made = await service.backup_now()
    async with open_machine(_config(tmp_path / "new")) as new:
        fresh = BackupService(
            new.db,
            StoreTarget(FolderStore(tmp_path / "target")),
            target_name="t",
            machine_id=service.engine._machine_id,
            keys=load_backup_keys(new.config.data_dir),
            data_dir=new.config.data_dir,
            attachments_dir=new.config.attachments_dir,
            keep=3,
            daily_at=dt.time(1, 0),
        )
        result = await fresh.restore(made.backup_id, recovery=recovery)
        assert result.restored == (agent,)
        assert (await new.agents.get(agent)).state.value == "archived"
        assert not list((new.config.data_dir / "backup-work").glob(".restore-*"))


def test_next_run_is_the_next_local_time_of_day(tmp_path: Path) -> None:
    service = BackupService.__new__(BackupService)
    service.daily_at = dt.time(3, 30)
    service._clock = lambda: 0.0  # type: ignore[method-assign]
    local = dt.datetime(2026, 6, 1, 2, 0).astimezone()
    first = service.next_run(local.timestamp())
    assert dt.datetime.fromtimestamp(first).astimezone().replace(tzinfo=None) == dt.datetime(
        2026, 6, 1, 3, 30
    )
    later = service.next_run(first)
    assert dt.datetime.fromtimestamp(later).astimezone().replace(tzinfo=None) == dt.datetime(
        2026, 6, 2, 3, 30
    )


@pytest.mark.parametrize("bad", ["25:00", "3", "x:y", "", "03:3", " 3:30", "１２:００", "3:30:00"])
def test_bad_daily_time(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="backup_time"):
        parse_daily_time(bad)


def test_same_device(tmp_path: Path) -> None:
    assert same_device(tmp_path / "a", tmp_path / "b" / "c")
    assert not same_device(tmp_path, Path("/proc"))


def test_keys_are_made_once_and_kept(tmp_path: Path) -> None:
    first = load_backup_keys(tmp_path)
    again = load_backup_keys(tmp_path)
    assert first == again
    assert oct((tmp_path / "keys" / "backup.key").stat().st_mode & 0o777) == "0o600"


async def test_staging_left_by_a_killed_run_is_removed_at_start(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        work = m.config.data_dir / "backup-work"
        stale = [work / ".stage-abc123", work / ".restore-4242-1700000000000"]
        for folder in stale:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "agent-ag_x").write_bytes(b"decoded conversation")
        kept = work / "segment-cache.json"
        kept.write_text("{}")
    # A new start of the daemon on the same data folder sweeps them.
    async with open_machine(_config(tmp_path / "m")) as m:
        assert [p for p in stale if p.exists()] == []
        assert kept.read_text() == "{}"


class _Flaky:
    """A BackupTarget that is down (TransientError) while ``down`` is set."""

    replaces_segments = True

    def __init__(self, inner: StoreTarget) -> None:
        self.inner = inner
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise TransientError("target down")

    async def have_segments(self, names: Iterable[str]) -> dict[str, int]:
        self._check()
        return await self.inner.have_segments(names)

    async def put_segment(
        self, name: str, data: AsyncIterable[bytes], *, replace: bool = False
    ) -> None:
        self._check()
        await self.inner.put_segment(name, data)

    async def put_manifest(self, backup_id: str, blob: bytes, names: Iterable[str]) -> None:
        self._check()
        await self.inner.put_manifest(backup_id, blob, names)

    async def list_manifests(self) -> list[ManifestInfo]:
        self._check()
        return await self.inner.list_manifests()

    async def get_manifest(self, backup_id: str) -> bytes:
        self._check()
        return await self.inner.get_manifest(backup_id)

    async def get_segment(self, name: str) -> AsyncIterator[bytes]:
        self._check()
        async for chunk in self.inner.get_segment(name):
            yield chunk

    async def prune(self, keep: int) -> PruneResult:
        self._check()
        return await self.inner.prune(keep)


class _Stop(Exception):
    pass


def _timed_service(
    m: Machine,
    target: _Flaky,
    now: list[float],
    sleep: Callable[[float], Awaitable[None]],
    registry: CollectorRegistry,
) -> BackupService:
    """A service daily at 03:30 on ``target``, on a clock at ``now[0]`` that only
    ``sleep`` moves."""
    return BackupService(
        m.db,
        target,
        target_name="flaky",
        machine_id=m.ids.canonical,
        keys=load_backup_keys(m.config.data_dir),
        data_dir=m.config.data_dir,
        attachments_dir=m.config.attachments_dir,
        keep=3,
        daily_at=dt.time(3, 30),
        metrics=BackupMetrics(registry),
        clock=lambda: now[0],
        sleep=sleep,
    )


async def test_a_restarted_daemon_shows_the_last_backups_whole_size(tmp_path: Path) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "hello")
        made = await _service(m, tmp_path / "target", CollectorRegistry()).backup_now()
        registry = CollectorRegistry()
        restarted = _service(m, tmp_path / "target", registry)
        await restarted.load_last()
        status = restarted.status()
        # The manifest and its segments, as `backup list` counts them (before: the
        # manifest's size alone, a few KiB, after every restart).
        assert (status.last_backup_id, status.last_backup_bytes) == (
            made.backup_id,
            made.stored_bytes,
        )
        manifest = sum(p.stat().st_size for p in (tmp_path / "target").rglob("manifests/*"))
        assert 0 < manifest < made.stored_bytes
        stored = registry.get_sample_value("agents_machine_backup_stored_bytes")
        assert stored == made.stored_bytes
        # One time for one backup: `backup now` answers the manifest's, as the list.
        ((info, manifest),) = await restarted.engine.list()
        assert manifest is not None and made.created_at == manifest.created_at
        now_pb = codec.backup_result_to_pb(made)
        assert now_pb.created_at == codec.backup_info_to_pb(info, manifest).created_at


async def test_daily_backups_retry_a_failure_and_relist_until_the_target_answers(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "hello")
        earlier = await _service(m, tmp_path / "target", CollectorRegistry()).backup_now()
        target = _Flaky(StoreTarget(FolderStore(tmp_path / "target")))
        now = [dt.datetime(2026, 12, 2, 3, 0).timestamp()]  # local 03:00; daily at 03:30
        waits: list[float] = []
        # What the target does at each wait: down at start (a restarted daemon
        # cannot list), up, down at the daily time (two failures), then up.
        plan = [None, False, True, None, False]

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            now[0] += seconds
            if len(waits) > len(plan):
                raise _Stop
            if plan[len(waits) - 1] is not None:
                target.down = bool(plan[len(waits) - 1])

        service = _timed_service(m, target, now, sleep, registry)
        target.down = True
        with pytest.raises(TransientError):
            await service.load_last()  # as at the daemon's start
        assert service.status().last_backup_at is None
        with pytest.raises(_Stop):
            await service.run_daily()
        # Listed again every minute until the target answered; then a wait to 03:30,
        # a failure retried after 5 and 10 minutes, and the next day's time.
        assert waits == [60, 60, 1680, 300, 600, 86400 - 900]
        failed = registry.get_sample_value("agents_machine_backups_total", {"result": "failed"})
        ok = registry.get_sample_value("agents_machine_backups_total", {"result": "ok"})
        assert (failed, ok) == (2, 1)
        status = service.status()
        assert status.last_backup_id not in ("", earlier.backup_id)
        assert status.last_check is not None and status.last_check.ok


async def test_a_day_of_failed_backups_starts_the_next_day_over_and_odd_errors_do_not_stop_it(
    tmp_path: Path,
) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        target = _Flaky(StoreTarget(FolderStore(tmp_path / "target")))
        now = [dt.datetime(2026, 12, 2, 3, 29).timestamp()]  # a minute before the daily time
        waits: list[float] = []
        calls = {"list": 0}

        async def listing() -> list[ManifestInfo]:
            calls["list"] += 1
            if calls["list"] == 1:
                raise RuntimeError("not an AgentsError")  # a bug below: logged, not fatal
            return await StoreTarget(FolderStore(tmp_path / "target")).list_manifests()

        async def no_writes(name: str, data: AsyncIterable[bytes]) -> None:
            raise TransientError("disk gone")  # every backup fails, listing works

        target.list_manifests = listing  # type: ignore[method-assign]
        target.put_segment = no_writes  # type: ignore[method-assign]

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            now[0] += seconds
            if sum(waits) > 1.5 * 86400:
                raise _Stop

        service = _timed_service(m, target, now, sleep, CollectorRegistry())
        await _agent(m, tmp_path, "something to back up")
        with pytest.raises(_Stop):
            await service.run_daily()
    # The odd error cost a minute (listed again then); the backups fail all day:
    # 5, 10, 20, 40 minutes, then hourly, until the next daily time, which starts
    # over at 5 minutes.
    assert waits[0] == 60 and calls["list"] >= 2
    assert waits[1:6] == [300, 600, 1200, 2400, 3600]
    last = next(i for i in range(6, len(waits)) if waits[i] != 3600)
    assert sum(waits[: last + 1]) == 86400 + 60  # that wait ends at the next 03:30
    assert waits[last + 1 : last + 3] == [300, 600], waits


def test_daily_time_with_one_hour_digit() -> None:
    assert parse_daily_time("3:30") == dt.time(3, 30)
    assert parse_daily_time("23:59") == dt.time(23, 59)


def test_an_unusable_recovery_public_key_is_not_kept(tmp_path: Path) -> None:
    """All zeros (a low-order point): every later backup would fail to seal to it."""
    data = tmp_path / "d"
    data.mkdir()
    with pytest.raises(InvalidArgument, match="public_key: not a usable X25519 public key"):
        keep_standalone_recovery_key(data, bytes(32))
    assert not (data / "keys" / "recovery.pub").exists()
    keep_standalone_recovery_key(data, BoxKeyPair.generate().public_key)
    assert load_backup_keys(data).recovery_public_key is not None


async def test_the_check_after_a_backup_is_of_that_backup_not_a_newer_planted_one(
    tmp_path: Path,
) -> None:
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "hello")
        service = _service(m, tmp_path / "target", CollectorRegistry())
        made = await service.backup_now()
        planted = new_id("backup", now_ms=id_time_ms(made.backup_id) + 3_600_000)
        await StoreTarget(FolderStore(tmp_path / "target")).put_manifest(planted, b"junk", [])
        assert not (await service.restore_check()).ok, "the newest listed does not open"
        check = await service.restore_check(made.backup_id)
        assert check.ok and check.backup_id == made.backup_id


async def test_a_restore_check_is_not_failed_by_a_lost_answer(tmp_path: Path) -> None:
    """Before: one transient error of the target failed the check (metric 0, and
    `backup now` said the backup would not restore) though the backup was whole."""
    async with open_machine(_config(tmp_path / "m")) as m:
        await _agent(m, tmp_path, "hello")
        service = _service(m, tmp_path / "target", CollectorRegistry())
        made = await service.backup_now()
        real_verify = service.engine.verify
        lost = [TransientError("get segment: server answered SlowDown")] * 2

        async def flaky_verify(backup_id: str, keypair: object = None) -> object:
            if lost:
                raise lost.pop()
            return await real_verify(backup_id)

        service.engine.verify = flaky_verify  # type: ignore[method-assign,assignment]
        check = await service.restore_check(made.backup_id)
        assert check.ok and not lost, check.problem


async def test_continuous_loop_starts_a_chain_then_ships_only_changes(tmp_path: Path) -> None:
    """Each interval: no chain -> a point; a change -> an increment; idle -> nothing."""
    registry = CollectorRegistry()
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = await _agent(m, tmp_path, "one")
        slept: list[float] = []
        ticks: list[Callable[[], Awaitable[None]]] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            if not ticks:
                raise asyncio.CancelledError
            await ticks.pop(0)()

        async def nothing() -> None:
            pass

        async def prompt() -> None:
            async for _ in await m.runs.prompt(agent, "two"):
                pass

        service = BackupService(
            m.db, StoreTarget(FolderStore(tmp_path / "target")), target_name="t",
            machine_id=m.ids.canonical, keys=load_backup_keys(m.config.data_dir),
            data_dir=m.config.data_dir, attachments_dir=m.config.attachments_dir, keep=3,
            daily_at=dt.time(3, 30), metrics=BackupMetrics(registry), sleep=sleep, interval=15.0,
        )  # fmt: skip
        ticks += [nothing, nothing, prompt, nothing]
        with pytest.raises(asyncio.CancelledError):
            await service.run_continuous()
        assert slept == [7.5] * 5, "a look every half interval"
        listed = [i.backup_id for i in await service.engine._target.list_manifests()]
        assert [b.split("_")[0] for b in listed] == ["bk", "bki"], listed
        increments = {"result": "ok"}
        assert registry.get_sample_value("agents_machine_backup_increments_total", increments) == 1
        assert registry.get_sample_value("agents_machine_backups_total", {"result": "ok"}) == 1


async def test_a_target_down_logs_one_error_then_the_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from shared.errors import PermissionDenied

    class Flaky(StoreTarget):
        down = False

        async def put_segment(self, name: str, data: AsyncIterable[bytes], **kw: bool) -> None:
            if self.down:
                raise PermissionDenied("backups: the test's target is down")
            await super().put_segment(name, data, **kw)

    target = Flaky(FolderStore(tmp_path / "target"))
    async with open_machine(_config(tmp_path / "m")) as m:
        agent = await _agent(m, tmp_path, "one")

        async def down() -> None:
            target.down = True
            async for _ in await m.runs.prompt(agent, "two"):
                pass

        async def still_down() -> None:
            pass

        async def up() -> None:
            target.down = False

        ticks = [still_down, down, still_down, up]

        async def sleep(seconds: float) -> None:
            if not ticks:
                raise asyncio.CancelledError
            await ticks.pop(0)()

        service = BackupService(
            m.db, target, target_name="t", machine_id=m.ids.canonical,
            keys=load_backup_keys(m.config.data_dir), data_dir=m.config.data_dir,
            attachments_dir=m.config.attachments_dir, keep=3, daily_at=dt.time(3, 30),
            sleep=sleep, interval=10.0,
        )  # fmt: skip
        caplog.set_level("DEBUG", logger="machine.backups.service")
        with pytest.raises(asyncio.CancelledError):
            await service.run_continuous()
    failed = [r for r in caplog.records if "continuous backup failed" in r.getMessage()]
    assert [r.levelname for r in failed] == ["ERROR", "DEBUG"]
    assert any("resumed after 2 failed" in r.getMessage() for r in caplog.records)
    listed = await StoreTarget(FolderStore(tmp_path / "target")).list_manifests()
    assert [i.increment for i in listed] == [False, True], "the changes shipped once it was up"
