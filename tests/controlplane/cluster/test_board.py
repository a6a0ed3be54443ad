"""The presence board: what a replica makes of the presence and links buckets (cluster.board)."""

from __future__ import annotations

import datetime as dt
import json

from controlplane.cluster.board import PresenceBoard
from shared.timestamps import utc_now


def _machine(replica: str) -> bytes:
    value = {"replica": replica, "account": "acct", "seen": "2026-01-01T00:00:00Z", "agents": 2}
    return json.dumps(value).encode()


def test_entries_expire_by_their_age_and_a_gone_replica_is_told_once() -> None:
    now = [100.0]
    gone: list[str] = []
    board = PresenceBoard(
        "me", "my-owner", 3.0, on_replica_gone=gone.append, monotonic=lambda: now[0]
    )
    changed: list[str] = []
    board.on_machine_changed = changed.append
    fresh = utc_now()
    board.apply("r.peer", json.dumps({"owner": "peer-owner"}).encode(), False, fresh)
    # Read at start, written 2.5 s ago: half a second left.
    board.apply("r.old", json.dumps({"owner": "old-owner"}).encode(), False, fresh - _S(2.5))
    board.apply("m.m1", _machine("peer"), False, fresh)
    board.apply("m.m2", _machine("me"), False, fresh)
    board.apply("m.m3", _machine("old"), False, fresh)
    held = board.holder("m1")
    assert held is not None and held.replica == "peer" and held.agent_count == 2
    assert board.holder("m2") is None, "our own link is not another replica's"
    assert board.owner_alive("peer-owner") and board.owner_alive("my-owner")
    assert not board.owner_alive("someone")
    board.apply("m.m1", _machine("peer"), False, fresh)  # written again
    assert changed == ["m1", "m2", "m3"], "the same holder again changes nothing"
    now[0] += 1.0
    assert board.holder("m3") is None, "its replica's entry expired: not a holder"
    assert board.holder("m1") is not None, "a machine entry itself does not expire"
    now[0] += 2.5
    assert board.holder("m1") is None, "its replica not refreshed within the TTL: gone"
    assert board.others == 2
    board.drop_gone()
    board.drop_gone()
    assert sorted(gone) == ["old", "peer"] and not board.owner_alive("peer-owner")
    assert board.others == 0
    board.apply("m.m1", None, True, None)  # withdrawn
    assert changed[-1] == "m1"
    board.apply("m.bad", b"not json", False, None)
    assert board.holder("bad") is None


def _S(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def _peer(board: PresenceBoard, rid: str, when: dt.datetime | None = None) -> None:
    board.apply(f"r.{rid}", json.dumps({"owner": f"{rid}-owner"}).encode(), False, when)


def test_a_dead_replicas_machine_is_no_holder_and_online_again_once_linked_elsewhere() -> None:
    now = [100.0]
    board = PresenceBoard("me", "o", 3.0, monotonic=lambda: now[0])
    start = utc_now()
    _peer(board, "a", start)
    _peer(board, "b", start)
    board.apply("m.m1", _machine("a"), False, start, 5)
    held = board.holder("m1")
    assert held is not None and held.replica == "a"
    # Last seen: its replica's last refresh, not the time it linked.
    refreshed = start + _S(10)
    _peer(board, "a", refreshed)
    held = board.holder("m1")
    assert held is not None and held.last_seen_at == refreshed
    now[0] += 2.0
    _peer(board, "b", None)  # b refreshes, a does not
    now[0] += 1.5
    assert board.holder("m1") is None, "a is gone: m1 reads offline"
    board.apply("m.m1", _machine("b"), False, None, 9)  # m1 linked to b
    held = board.holder("m1")
    assert held is not None and held.replica == "b"
    assert board.orphans() == [], "m1 now names a live replica"


def test_sweep_names_only_entries_of_gone_replicas_seen_for_a_ttl() -> None:
    now = [100.0]
    board = PresenceBoard("m", "o", 3.0, monotonic=lambda: now[0])
    _peer(board, "a")
    _peer(board, "z")
    board.apply("m.of-a", _machine("a"), False, None, 1)
    board.apply("m.of-z", _machine("z"), False, None, 2)
    board.apply("m.mine", _machine("m"), False, None, 3)
    assert not board.sweeper, "a has the smallest live id"
    assert board.orphans() == []
    now[0] += 2.0
    _peer(board, "z")  # z refreshes; a does not
    board.apply("m.late", _machine("x"), False, None, 4)  # x's entry not read yet
    now[0] += 1.5
    board.drop_gone()
    assert board.sweeper, "a is gone: m has the smallest live id"
    assert board.orphans() == [("of-a", 1)], "not z's (alive), ours, nor one just seen"
    now[0] += 3.0
    _peer(board, "z")
    assert sorted(board.orphans()) == [("late", 4), ("of-a", 1)]
    board.apply("m.of-a", None, True, None, 5)  # swept
    assert board.orphans() == [("late", 4)]
    assert board.entry("of-a") is None and board.entry("mine") is not None


def test_a_fresh_read_of_the_links_forgets_entries_deleted_meanwhile() -> None:
    board = PresenceBoard("me", "o", 3.0)
    changed: list[str] = []
    _peer(board, "a")
    board.apply("m.m1", _machine("a"), False, None, 1)
    board.apply("m.m2", _machine("a"), False, None, 2)
    board.on_machine_changed = changed.append
    board.keep_machines(["m2"])
    assert board.holder("m1") is None and board.holder("m2") is not None
    assert changed == ["m1"]


def _replica(owner: str, link: object) -> bytes:
    return json.dumps({"owner": owner, "link": link}).encode()


def test_link_addresses_are_the_live_replicas_own_first_bounded_and_checked() -> None:
    now = [100.0]
    board = PresenceBoard("me", "o", 3.0, monotonic=lambda: now[0], link_address="10.0.0.1:7444")
    added: list[str] = []
    board.on_replica_added = added.append
    fresh = utc_now()
    assert board.link_addresses(16) == ("10.0.0.1:7444",), "before the watch saw anything"
    board.apply("r.me", _replica("o", "10.0.0.1:7444"), False, fresh)
    board.apply("r.b", _replica("ob", "10.0.0.3:7444"), False, fresh)
    board.apply("r.a", _replica("oa", "[::1]:7444"), False, fresh)
    board.apply("r.c", _replica("oc", "10.0.0.3:7444"), False, fresh)  # the same as b's
    board.apply("r.d", _replica("od", ""), False, fresh)  # names none
    for bad in ("nohost", "h:0", "a b:1", "h:1\n", 7444, "x" * 300 + ":1"):
        board.apply("r.e", _replica("oe", bad), False, fresh)
        assert len(board.link_addresses(16)) == 3, bad
    assert board.link_addresses(16) == ("10.0.0.1:7444", "[::1]:7444", "10.0.0.3:7444")
    # Each other replica once, when first seen; a refresh is not news.
    board.apply("r.b", _replica("ob", "10.0.0.3:7444"), False, fresh)
    assert added == ["b", "a", "c", "d", "e"]
    assert board.link_addresses(2) == ("10.0.0.1:7444", "[::1]:7444")
    board.apply("r.a", None, True, None)  # a withdrew
    assert board.link_addresses(16) == ("10.0.0.1:7444", "10.0.0.3:7444")
    now[0] += 3.5  # no refresh within the TTL: b, c, d gone
    assert board.link_addresses(16) == ("10.0.0.1:7444",)
