"""Replicas over a real nats-server: presence, routing, the jobs' lease (cluster.*)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.cluster.lease import JobLease
from controlplane.cluster.replica import Replica
from shared.errors import TransientError
from tests.helpers.nats_proc import NatsProc, nats_binary, nats_server
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="nats-server not installed")

HOME = "ab" * 16


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsProc]:
    with nats_server(tmp_path / "nats") as proc:
        yield proc


def _replica(
    url: str,
    owner: str,
    got: list[tuple[str, str, str]],
    deleted: list[str],
    link_address: str = "",
) -> Replica:
    async def notice(machine_id: str, kind: str, fields: dict[str, str]) -> bool:
        got.append((owner, machine_id, kind))
        return True

    return Replica(
        (url,),
        HOME,
        heartbeat_interval=0.5,
        owner=owner,
        on_notice=notice,
        on_account_deleted=deleted.append,
        link_address=link_address,
    )


async def test_presence_and_routing_between_two_replicas(nats: NatsProc) -> None:
    got: list[tuple[str, str, str]] = []
    deleted: list[str] = []
    a, b = _replica(nats.url, "owner-a", got, deleted), _replica(nats.url, "owner-b", got, [])
    await a.start()
    await b.start()
    try:
        assert a.owner_alive("owner-b") and b.owner_alive("owner-a")
        assert not a.owner_alive("owner-gone")
        changed: list[str] = []
        b.board.on_machine_changed = changed.append  # b's cached presence record of it is stale
        await a.linked("m1", "acct", "1.0", 2)
        held = await apoll_until(lambda: b.holder("m1"), deadline=5, what="b sees m1 at a")
        assert changed == ["m1"]
        assert held.replica == a.replica_id and held.agent_count == 2
        assert a.holder("m1") is None, "not 'another replica' for its own link"
        # A notice through b reaches a's handler; one for an unlinked machine none.
        assert await b.route("m1", "renew_now", reason="x")
        assert got == [("owner-a", "m1", "renew_now")]
        assert not await b.route("m2", "revoked", reason="y")
        # Account deletions reach every replica.
        b.announce_account_deleted("acct")
        await apoll_until(lambda: deleted == ["acct"], deadline=5, what="a told")
        # The link ends at a: b no longer sees it, and a route finds nobody.
        await a.unlinked("m1")
        await apoll_until(lambda: b.holder("m1") is None, deadline=5, what="m1 withdrawn")
        assert changed == ["m1", "m1"], "refreshes change nothing; the end does"
        assert not await b.route("m1", "renew_now", reason="x")
        # A replica that stops refreshing is gone within the TTL: its machines too.
        await a.linked("m3", "acct", "1.0", 0)
        await apoll_until(lambda: b.holder("m3"), deadline=5, what="b sees m3")
        for task in a._tasks:  # a frozen replica: alive in NATS, refreshing nothing
            task.cancel()
        await apoll_until(
            lambda: b.holder("m3") is None and not b.owner_alive("owner-a"),
            deadline=3 * b.ttl,
            what="a's entries expired",
        )
        # What a left is swept by the replica left (its delete is read back).
        await apoll_until(lambda: b.board.entry("m3") is None, deadline=5, what="m3 swept")
    finally:
        await a.close()
        await b.close()


async def test_machine_entries_are_not_rewritten_each_interval_but_put_back_if_gone(
    nats: NatsProc,
) -> None:
    a, b = _replica(nats.url, "owner-a", [], []), _replica(nats.url, "owner-b", [], [])
    await a.start()
    await b.start()
    try:
        await a.linked("m1", "acct", "1.0", 0)
        held = await apoll_until(lambda: b.board.entry("m1"), deadline=5, what="b sees m1")
        first = held.revision
        # Several refresh periods: a's own entry moves on, m1's does not.
        assert a._kv is not None
        seen = {(await a._kv.get(f"r.{a.replica_id}")).revision}

        async def refreshed_twice() -> bool:
            assert a._kv is not None
            seen.add((await a._kv.get(f"r.{a.replica_id}")).revision)
            return len(seen) >= 3

        await apoll_until(refreshed_twice, deadline=5, what="a's entry refreshed")
        entry = b.board.entry("m1")
        assert entry is not None and entry.revision == first, "m1 was not written again"
        # Deleted behind a's back (as a sweep while a was cut off does): put again.
        assert a._links_kv is not None
        await a._links_kv.delete("m.m1")
        again = await apoll_until(
            lambda: (e := b.board.entry("m1")) is not None and e.revision > first and e,
            deadline=5,
            what="m1 put back",
        )
        assert again.replica == a.replica_id and b.holder("m1") is not None
    finally:
        await a.close()
        await b.close()


async def test_without_nats_a_route_is_unavailable_naming_it(nats: NatsProc) -> None:
    a = _replica(nats.url, "owner-a", [], [])
    await a.start()
    try:
        nats.stop()
        await apoll_until(lambda: not a.connected, deadline=5, what="a disconnected")
        with pytest.raises(TransientError, match="NATS at nats://127.0.0.1"):
            await a.route("m1", "revoked", reason="x")
        with pytest.raises(TransientError, match="NATS"):
            a.check_connected("machine status")
    finally:
        await a.close()


async def test_one_lease_holder_and_each_slot_claimed_once(nats: NatsProc) -> None:
    a, b = _replica(nats.url, "a", [], []), _replica(nats.url, "b", [], [])
    await a.start()
    await b.start()
    try:
        assert a.js_kv is not None and b.js_kv is not None
        la = JobLease(await a.js_kv("lease", 1.5), await a.js_kv("jobs", None), "a", ttl=1.5)
        lb = JobLease(await b.js_kv("lease", 1.5), await b.js_kv("jobs", None), "b", ttl=1.5)
        await la.tick()
        await lb.tick()
        assert la.held and not lb.held
        assert await la.claim("wake", 10)
        assert not await la.claim("wake", 10), "a slot runs once"
        assert not await lb.claim("wake", 11), "only the holder claims"

        # The holder dies (no renewal): the other takes the lease within the TTL,
        # and does not run again the slot the first one ran.
        async def taken() -> bool:
            await lb.tick()
            return lb.held

        await apoll_until(taken, deadline=5, what="b takes the lease")
        assert not await lb.claim("wake", 10)
        assert await lb.claim("wake", 11)
        await la.tick()
        assert not la.held, "the old holder learns it lost the lease"
    finally:
        await a.close()
        await b.close()


async def test_presence_follows_again_after_nats_restarts(nats: NatsProc) -> None:
    a = _replica(nats.url, "owner-a", [], [], link_address="127.0.0.1:7451")
    b = _replica(nats.url, "owner-b", [], [], link_address="127.0.0.1:7452")
    await a.start()
    await b.start()
    try:
        await apoll_until(lambda: len(a.link_addresses(16)) == 2, deadline=5, what="b listed")
        nats.stop()
        await apoll_until(lambda: not a.connected and not b.connected, deadline=5, what="down")
        # Seeing no other replica, it lists none (its machines forget nothing).
        assert a.link_addresses(16) == ()
        # A link opened meanwhile waits for nothing, and is announced once NATS is back.
        async with asyncio.timeout(1):
            await a.linked("m0", "acct", "1.0", 0)
        nats.start()  # the same port and folder: the buckets are still there
        await apoll_until(lambda: a.connected and b.connected, deadline=10, what="back")
        await a.linked("m1", "acct", "1.0", 0)
        await apoll_until(lambda: b.holder("m1"), deadline=5, what="b sees a's new link")
        assert await b.route("m1", "renew_now", reason="x")
        await apoll_until(lambda: b.holder("m0"), deadline=5, what="b sees the one made meanwhile")
        assert await b.route("m0", "renew_now", reason="x")
    finally:
        await a.close()
        await b.close()


async def test_a_replica_without_nats_does_not_start_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.cluster import replica
    from controlplane.config import ControlConfig
    from controlplane.recovery.bootstrap import init_control_plane
    from controlplane.server import ControlPlane
    from tests.helpers.moto_server import free_port

    monkeypatch.setattr(replica, "CONNECT_TIMEOUT", 0.5)
    cfg = ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
        cluster_url=f"nats://127.0.0.1:{free_port()}",
    ).validate()
    await init_control_plane(cfg)
    with pytest.raises(TransientError, match="cannot reach NATS at nats://127.0.0.1:"):
        async with ControlPlane(cfg):
            pass
    assert not (cfg.home / "serve.json").exists()


async def test_a_machine_that_moved_is_answered_for_by_its_new_replica_only(
    nats: NatsProc,
) -> None:
    got: list[tuple[str, str, str]] = []
    a, b = _replica(nats.url, "owner-a", got, []), _replica(nats.url, "owner-b", got, [])
    await a.start()
    await b.start()
    try:
        await a.linked("m1", "acct", "1.0", 0)
        await apoll_until(lambda: b.holder("m1"), deadline=5, what="b sees m1 at a")
        # It links to b while a has not noticed its old link died yet.
        await b.linked("m1", "acct", "1.0", 0)
        await apoll_until(lambda: a.holder("m1"), deadline=5, what="a sees m1 at b")
        for _ in range(5):
            assert await a.route("m1", "renew_now", reason="x")
        assert {owner for owner, _, _ in got} == {"owner-b"}, got
    finally:
        await a.close()
        await b.close()


async def test_nats_gone_is_one_warning_line_per_job_without_a_traceback(
    nats: NatsProc, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, "controlplane.cluster")
    a = _replica(nats.url, "a", [], [])
    await a.start()
    assert a.js_kv is not None
    lease = JobLease(await a.js_kv("lease", 1.5), await a.js_kv("jobs", None), "a", ttl=1.5)
    task = asyncio.create_task(lease.run())
    try:
        await apoll_until(lambda: lease.held, deadline=5, what="lease held")
        nats.stop()

        def warned() -> list[logging.LogRecord]:
            return [
                r
                for r in caplog.records
                if r.levelno == logging.WARNING
                and r.name in ("controlplane.cluster.lease", "controlplane.cluster.replica")
                and "nats" in r.getMessage().lower()
                and "disconnected" not in r.getMessage()
            ]

        await apoll_until(
            lambda: {r.name for r in warned()} >= {"controlplane.cluster.lease",
                                                   "controlplane.cluster.replica"},
            deadline=15,
            what="the lease's and the presence refresh's outage lines",
        )  # fmt: skip
        assert not lease.held
        lines = warned()
        assert all(r.exc_info is None for r in lines), [r.getMessage() for r in lines]
        assert "Traceback" not in caplog.text
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a.close()
