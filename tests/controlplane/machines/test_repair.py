"""Repair joins: a new box takes over a lost machine's id (controlplane.machines.pairing)."""

from __future__ import annotations

import datetime as dt

import pytest

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.integrity.audit import Auditor
from controlplane.integrity.intents import Intents
from controlplane.machines.pairing import Pairing
from controlplane.machines.presence import PresenceRegistry, RevokedNotice
from controlplane.machines.registry import MachineInfo, MachineRegistry
from shared import tls
from shared.crypto import BoxKeyPair
from shared.errors import InvalidState, NotFound, Unauthenticated
from shared.ids import new_id
from shared.store import MemoryStore

GRACE = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


class World:
    """One control-plane process's services over a shared store (a new World = a restart)."""

    def __init__(self, store: MemoryStore, clock: Clock, ca: tls.CertKey) -> None:
        self.store, self.clock, self.ca = store, clock, ca
        audit = Auditor(store, clock)
        self.intents = Intents(store, clock)
        self.accounts = AccountService(store, audit, clock, intents=self.intents)
        self.creds = CredentialService(store, self.accounts, audit, clock)
        self.tokens = TokenService(store, self.accounts, audit, clock=clock, intents=self.intents)
        self.machines = MachineRegistry(store, self.accounts, audit, clock, self.intents)
        self.pairing = Pairing(
            self.tokens,
            self.machines,
            self.accounts,
            ca,
            dt.timedelta(days=30),
            intents=self.intents,
            confirm_grace=GRACE,
            store=store,
        )
        self.op = Principal("adm_" + "0" * 26, "operator")

    async def join(self, value: str) -> tuple[str, bytes]:
        res = await self.pairing.join(
            value,
            tls.build_csr(tls.new_tls_key()).decode(),
            MachineInfo("m", "0.1", "h"),
            take_over=True,  # a new box that restores (or was told to take it over)
        )
        return res.machine.machine_id, res.cert.cert_pem


@pytest.fixture
def w() -> World:
    return World(MemoryStore(), Clock(), tls.make_ca())


async def _joined(w: World) -> tuple[str, str, bytes]:
    acct = (await w.accounts.create(1, "u1", None, "t")).account.account_id
    mc, cert = await w.join((await w.tokens.create(w.op, acct)).value)
    await w.machines.authorize_peer(tls.identity_from_cert(cert))  # confirms the join
    return acct, mc, cert


async def test_repair_takes_over_the_id_and_refuses_the_old_certificate(w: World) -> None:
    acct, mc, old_cert = await _joined(w)
    machine = await w.machines.authorize_peer(tls.identity_from_cert(old_cert))
    presence = PresenceRegistry(w.store, clock=w.clock)
    w.machines.on_revoke(presence.kick)
    session = await presence.open(machine, "0.1", 0)
    await w.machines.rename(w.op, mc, "build-box")
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    assert made.token.repair_machine_id == mc and made.token.max_uses == 1
    new_id_, new_cert = await w.join(made.value)
    assert new_id_ == mc
    # The machine keeps the name its operator gave it (the new box sends its own).
    assert (await w.machines.get(w.op, mc)).name == "build-box"
    # The old box's live link is closed, told why (not "revoked": the machine
    # lives on), and its certificate refused.
    notice = session.outbox.get_nowait()
    assert isinstance(notice, RevokedNotice)
    assert notice.reason.startswith("certificate superseded: a new box took this machine over")
    with pytest.raises(Unauthenticated, match="superseded"):
        await w.machines.authorize_peer(tls.identity_from_cert(old_cert))
    got = await w.machines.authorize_peer(tls.identity_from_cert(new_cert))
    assert got.machine_id == mc and got.account_id == acct and got.join_intent == ""
    assert await w.intents.pending() == []
    with pytest.raises(Unauthenticated, match="already used"):
        await w.join(made.value)
    assert [m.machine_id for m in await w.machines.list(w.op)] == [mc]


async def test_a_new_box_takes_a_machine_over_only_when_it_says_so(w: World) -> None:
    """A repair token on a new box without ``take_over`` (no --recovery-key, no
    --no-restore) is refused before it is used: the machine and its old box stay
    as they were, and the same token then works with ``take_over``."""
    acct, mc, old_cert = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    csr = tls.build_csr(tls.new_tls_key()).decode()
    with pytest.raises(InvalidState, match=f"take over machine {mc}.*--recovery-key FILE"):
        await w.pairing.join(made.value, csr, MachineInfo("m", "0.1", "h"), take_over=False)
    assert (await w.machines.authorize_peer(tls.identity_from_cert(old_cert))).machine_id == mc
    assert await w.intents.pending() == []
    new_id_, _ = await w.join(made.value)  # take_over
    assert new_id_ == mc


async def test_a_recovery_key_of_another_account_is_refused_before_the_takeover(
    w: World,
) -> None:
    """The box says which recovery key it will restore with: not the account's,
    the takeover would cut the old box off for a backup nobody can open. Refused
    before the token is used; the account's own key then takes it over."""
    acct, mc, old_cert = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    csr = tls.build_csr(tls.new_tls_key()).decode()
    other_key = BoxKeyPair.generate().public_key
    with pytest.raises(InvalidState, match="not the recovery key of this machine's account"):
        await w.pairing.join(
            made.value, csr, MachineInfo("m", "0.1", "h"), take_over=True,
            recovery_public_key=other_key,
        )  # fmt: skip
    assert (await w.machines.authorize_peer(tls.identity_from_cert(old_cert))).machine_id == mc
    assert await w.intents.pending() == []
    account = await w.accounts.require_active(acct, "test")
    res = await w.pairing.join(
        made.value, csr, MachineInfo("m", "0.1", "h"), take_over=True,
        recovery_public_key=account.recovery_public_key,
    )  # fmt: skip
    assert res.machine.machine_id == mc


async def test_repair_token_refusals(w: World) -> None:
    acct, mc, _ = await _joined(w)
    other = (await w.accounts.create(2, "u2", None, "t")).account.account_id
    admin_b = await w.creds.authenticate((await w.creds.create_for_account(w.op, other, "b")).value)
    with pytest.raises(NotFound):  # another account's machine: as if missing
        await w.machines.get(admin_b, mc)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    await w.machines.revoke(w.op, mc)
    with pytest.raises(InvalidState, match="revoked"):
        await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    # A token made before the revocation no longer repairs it, and costs no use.
    with pytest.raises(Unauthenticated, match="revoked"):
        await w.join(made.value)
    assert (await w.tokens.get(w.op, made.token.token_id)).uses == 0
    assert acct


async def test_a_repair_that_fails_midway_gives_the_token_back_and_changes_nothing(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, mc, old_cert = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))

    async def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("store write failed")

    monkeypatch.setattr(w.machines, "repair", crash)
    with pytest.raises(RuntimeError):
        await w.join(made.value)
    assert await w.intents.pending() == []
    assert (await w.tokens.get(w.op, made.token.token_id)).uses == 0
    await w.machines.authorize_peer(tls.identity_from_cert(old_cert))  # still the machine's


async def test_an_unconfirmed_repair_gives_its_use_back_but_never_readmits_the_old_box(
    w: World,
) -> None:
    _, mc, old_cert = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    await w.join(made.value)  # the reply is lost: the new box never connects
    # A restart within the grace keeps the repair waiting for the box.
    w.clock.now += dt.timedelta(seconds=GRACE / 2)
    restarted = World(w.store, w.clock, w.ca)
    assert await restarted.intents.recover() == 0
    w.clock.now += dt.timedelta(seconds=GRACE)
    assert await restarted.intents.recover() == 1
    assert await restarted.intents.pending() == []
    assert (await restarted.tokens.get(w.op, made.token.token_id)).uses == 0
    with pytest.raises(Unauthenticated, match="superseded"):
        await restarted.machines.authorize_peer(tls.identity_from_cert(old_cert))
    # The operator repairs again with the same (given back) token.
    again, cert = await restarted.join(made.value)
    assert again == mc
    await restarted.machines.authorize_peer(tls.identity_from_cert(cert))


async def test_a_box_connecting_after_its_repair_was_rolled_back_spends_the_token(
    w: World,
) -> None:
    """The reply did reach the box, which was killed before it first connected and
    ran again after the grace: it holds the machine, so its token use counts again
    and the token cannot take the machine over a second time (before: it could)."""
    _, mc, _ = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    _, cert = await w.join(made.value)
    w.clock.now += dt.timedelta(seconds=GRACE * 2)
    restarted = World(w.store, w.clock, w.ca)
    assert await restarted.intents.recover() == 1
    assert (await restarted.tokens.get(w.op, made.token.token_id)).uses == 0
    assert (await restarted.machines.authorize_peer(tls.identity_from_cert(cert))).machine_id == mc
    token = await restarted.tokens.get(w.op, made.token.token_id)
    assert token.uses == 1 and token.state(w.clock()) == "used"
    with pytest.raises(Unauthenticated, match="already used"):
        await restarted.join(made.value)
    # Connecting again changes nothing.
    await restarted.machines.authorize_peer(tls.identity_from_cert(cert))
    assert (await restarted.tokens.get(w.op, made.token.token_id)).uses == 1


async def test_a_box_connecting_while_its_repair_is_rolled_back_keeps_the_token_spent(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The roll-back saw the repair unconfirmed; the box confirmed before the use
    went back: the roll-back counts it again (one token, one takeover)."""
    _, mc, _ = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    _, cert = await w.join(made.value)
    w.clock.now += dt.timedelta(seconds=GRACE * 2)
    restarted = World(w.store, w.clock, w.ca)
    give_back = restarted.tokens.give_back

    async def box_connects_first(*args: str) -> None:
        await restarted.machines.authorize_peer(tls.identity_from_cert(cert))
        await give_back(*args)

    monkeypatch.setattr(restarted.tokens, "give_back", box_connects_first)
    assert await restarted.intents.recover() == 1
    assert (await restarted.tokens.get(w.op, made.token.token_id)).uses == 1
    with pytest.raises(Unauthenticated, match="already used"):
        await restarted.join(made.value)


async def test_a_plain_join_confirmed_after_its_roll_back_gets_no_use_back(w: World) -> None:
    """A connection read the machine just before the roll-back deleted it: its
    confirmation fails and the token's use stays given back."""
    acct = (await w.accounts.create(1, "u1", None, "t")).account.account_id
    made = await w.tokens.create(w.op, acct)
    mc, _ = await w.join(made.value)
    stale = await w.machines.load_any(acct, mc)
    assert stale is not None and stale.join_intent
    w.clock.now += dt.timedelta(seconds=GRACE * 2)
    assert await w.intents.recover() == 1
    with pytest.raises(NotFound):
        await w.machines.confirm(stale)
    assert (await w.tokens.get(w.op, made.token.token_id)).uses == 0


async def test_a_confirmed_repair_keeps_its_token_use_on_recovery(w: World) -> None:
    _, mc, _ = await _joined(w)
    made = await w.tokens.create_repair(w.op, await w.machines.get(w.op, mc))
    _, cert = await w.join(made.value)
    await w.machines.authorize_peer(tls.identity_from_cert(cert))
    w.clock.now += dt.timedelta(seconds=GRACE * 2)
    restarted = World(w.store, w.clock, w.ca)
    await restarted.intents.recover()
    assert (await restarted.tokens.get(w.op, made.token.token_id)).uses == 1


async def test_a_joined_box_with_a_plain_token_is_told_how_to_go_on(w: World) -> None:
    """Refused before the token is used. A box whose machine this account no longer
    has (a join rolled back as it never connected) is pointed at ``--as-new``."""
    acct, mc, _ = await _joined(w)
    token = await w.tokens.create(w.op, acct)
    csr = tls.build_csr(tls.new_tls_key()).decode()
    info = MachineInfo("m", "0.1", "h")
    with pytest.raises(InvalidState, match="re-pairs only with a repair token"):
        await w.pairing.join(token.value, csr, info, mc)
    with pytest.raises(InvalidState, match="which this account does not have.*--as-new"):
        await w.pairing.join(token.value, csr, info, new_id("machine"))
    assert (await w.tokens.check(token.value)).uses == 0
