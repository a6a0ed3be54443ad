"""The presence board: what a replica makes of the presence bucket (cluster.board)."""

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
    board.apply("m.m1", _machine("peer"), False, fresh)
    board.apply("m.m2", _machine("me"), False, fresh)
    # Read at start, written 2.5 s ago: half a second left.
    board.apply("m.m3", _machine("peer"), False, fresh - dt.timedelta(seconds=2.5))
    held = board.holder("m1")
    assert held is not None and held.replica == "peer" and held.agent_count == 2
    assert board.holder("m2") is None, "our own link is not another replica's"
    assert board.owner_alive("peer-owner") and board.owner_alive("my-owner")
    assert not board.owner_alive("someone")
    board.apply("m.m1", _machine("peer"), False, fresh)  # a refresh
    assert changed == ["m1", "m2", "m3"], "a refresh changes nothing"
    now[0] += 1.0
    assert board.holder("m3") is None and board.holder("m1") is not None
    now[0] += 2.5
    assert board.holder("m1") is None, "no refresh within the TTL: gone"
    assert board.others == 1
    board.drop_gone()
    board.drop_gone()
    assert gone == ["peer"] and not board.owner_alive("peer-owner") and board.others == 0
    board.apply("m.m1", None, True, None)  # withdrawn
    assert changed[-1] == "m1"
    board.apply("m.bad", b"not json", False, None)
    assert board.holder("bad") is None


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
