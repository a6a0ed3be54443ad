"""JobLease against a KV whose answers are chosen (the NATS-backed cases are in
test_replica_nats.py)."""

from __future__ import annotations

import nats.js.errors

from controlplane.cluster.lease import JobLease


class _ExpiringLeaseKV:
    """A lease key that expires between nats-py's refused create and the read it
    makes to check for a delete marker: create raises KeyNotFoundError once."""

    def __init__(self) -> None:
        self.creates = 0

    async def create(self, key: str, value: bytes) -> int:
        self.creates += 1
        if self.creates == 1:
            raise nats.js.errors.KeyNotFoundError
        return 7

    async def update(self, key: str, value: bytes, last: int) -> int:
        assert last == 7
        return 8


async def test_a_lease_key_that_expires_during_create_is_tried_again() -> None:
    kv = _ExpiringLeaseKV()
    held: list[bool] = []
    lease = JobLease(kv, kv, "a", on_held=held.append)  # type: ignore[arg-type]
    await lease.tick()
    assert not lease.held and held == [False]
    await lease.tick()
    assert lease.held and kv.creates == 2
    await lease.tick()  # renews on the revision it wrote
    assert lease.held


async def test_a_refused_renewal_loses_the_lease() -> None:
    class Taken(_ExpiringLeaseKV):
        async def update(self, key: str, value: bytes, last: int) -> int:
            raise nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence: 9")

    kv = Taken()
    kv.creates = 1
    lease = JobLease(kv, kv, "a")  # type: ignore[arg-type]
    await lease.tick()
    assert lease.held
    await lease.tick()
    assert not lease.held
