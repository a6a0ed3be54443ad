"""Control-plane code that reads "now" reads the clock it was given."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from controlplane.access.accounts import AccountService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.api.admin import AdminServicer
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import utc_iso
from controlplane.recovery.fencing import EPOCH_KEY, Fence
from shared.pb.control.v1 import admin_pb2
from shared.store import MemoryStore
from tests.helpers.clock import FixedClock

OP = Principal("adm_" + "0" * 26, "operator")


class _Credentials:
    async def authenticate(self, bearer: str | None) -> Principal:
        return OP


class _Context:
    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer x"),)


def _servicer(tokens: TokenService, accounts: AccountService, clock: Any) -> AdminServicer:
    return AdminServicer(
        accounts=accounts,
        credentials=_Credentials(),  # type: ignore[arg-type]
        tokens=tokens,
        machines=None,  # type: ignore[arg-type]
        presence=None,  # type: ignore[arg-type]
        deletion=None,  # type: ignore[arg-type]
        ca_hash="sha256:x",
        join_address="127.0.0.1:1",
        prompts=None,  # type: ignore[arg-type]
        starter=None,  # type: ignore[arg-type]
        clock=clock,
    )


async def test_token_states_are_read_at_the_servicers_clock() -> None:
    store = MemoryStore()
    audit = Auditor(store)
    accounts = AccountService(store, audit)
    tokens = TokenService(store, accounts, audit)
    account = (await accounts.create(1, "u1", None, "test")).account.account_id
    made = await tokens.create(OP, account, ttl_seconds=3600)
    request = admin_pb2.ListJoinTokensRequest(account_id=account)
    ctx: Any = _Context()

    now = FixedClock(dt.datetime.now(dt.UTC))
    listed = await _servicer(tokens, accounts, now).ListJoinTokens(request, ctx)
    assert [t.state for t in listed.tokens] == ["active"]
    now.now += dt.timedelta(hours=2)  # past the token's hour
    listed = await _servicer(tokens, accounts, now).ListJoinTokens(request, ctx)
    assert [t.state for t in listed.tokens] == ["expired"]
    token_id = made.token.token_id
    revoked = await _servicer(tokens, accounts, now).RevokeJoinToken(
        admin_pb2.RevokeJoinTokenRequest(token_id=token_id), ctx
    )
    assert revoked.state == "revoked"


async def test_an_epoch_records_when_it_was_taken_by_the_fences_clock() -> None:
    store = MemoryStore()
    clock = FixedClock(dt.datetime(2031, 2, 3, 4, 5, 6, tzinfo=dt.UTC))
    fence = Fence(store, "h" * 32, "test", clock=clock)
    assert await fence.acquire() == 1
    record = json.loads(await store.get(EPOCH_KEY))
    assert record["started_at"] == utc_iso(clock.now)
