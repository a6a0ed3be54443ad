"""Joining a machine (token + CSR -> certificate) and renewing its certificate.

A repair token (``agents-control machine repair M``) binds the join to an
existing machine M: the joining box gets a certificate for M's id, and M's
record is rewritten to name only that certificate, so the old box is refused
from then on (:meth:`MachineRegistry.repair`, one write: the repair's commit
point). An unconfirmed repair is not undone: bringing the old certificate back
would re-admit the box the operator replaced; its roll-back gives the token use
back (after the grace), so that the same token repairs again when the reply
never reached the box. A box that did get it and connects after the roll-back
(killed before it first connected, then run again) still holds the machine:
its confirmation counts the token use again (:meth:`Pairing._confirmed`), so
one token never takes a machine over twice.

A join writes three objects (the token's use, the machine's index entry, its
record) under one ``join`` intent (:mod:`controlplane.integrity.intents`) that is HELD:
the reply may never reach the machine, so the join commits only when the
machine first connects with its new certificate (:meth:`MachineRegistry.confirm`).
Until then the machine is listed but holds the intent. An abandoned join is rolled
back (record, index entry, and the token use given back) at once when no
record was written (no reply can have gone out), else once the machine has had
``confirm_grace`` seconds to connect.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from controlplane.access.accounts import AccountService
from controlplane.access.hashing import bearer_ids
from controlplane.access.tokens import TokenService
from controlplane.integrity.intents import Intent, Intents
from controlplane.integrity.keys import KeyRing
from controlplane.integrity.records import (
    Account,
    JoinToken,
    Machine,
    machine_index_key,
    machine_key,
)
from controlplane.machines.registry import AuthorizedPeer, MachineInfo, MachineRegistry
from shared import tls
from shared.errors import (
    AgentsError,
    IntegrityError,
    InvalidArgument,
    InvalidState,
    TransientError,
    Unauthenticated,
)
from shared.ids import validate_id
from shared.repeats import RepeatLimit
from shared.store.base import ObjectStore
from shared.tls import CertKey, IssuedCert

__all__ = ["JoinResult", "Pairing"]

logger = logging.getLogger(__name__)

#: Renewal is refused while more than this fraction of the lifetime remains
#: (or the configured threshold, if larger): it bounds how often a machine, or a
#: thief of its current key, can mint certificates.
RENEW_EARLIEST = 0.5
_JOIN = "join"


@dataclass(frozen=True)
class JoinResult:
    """Everything a joined machine needs to hear back."""

    machine: Machine
    account: Account
    cert: IssuedCert
    ca_cert_pem: bytes


@contextlib.contextmanager
def _refusal_logged(
    refusals: RepeatLimit, token_value: str, repair_machine_id: str
) -> Iterator[None]:
    """A refused join is one WARNING line naming the token's id when the token has
    the right shape (``token_id``; ``machine_id`` for a repair), never its secret;
    the same refusal again within a minute is a DEBUG line (shared.repeats).
    A transient failure (the store) is not a refusal: the machine tries again."""
    try:
        yield
    except AgentsError as e:
        if not isinstance(e, TransientError):
            ids = bearer_ids(token_value, "token")
            if repair_machine_id:
                ids["machine_id"] = repair_machine_id
            refusals.warning("join refused: %s", e, extra=ids)
        raise


class Pairing:
    """Turns join tokens into machines, and signs renewals."""

    def __init__(
        self,
        tokens: TokenService,
        machines: MachineRegistry,
        accounts: AccountService,
        ca: CertKey,
        cert_lifetime: dt.timedelta,
        *,
        intents: Intents | None = None,
        confirm_grace: float = 300.0,
        store: ObjectStore | None = None,
        keyring: KeyRing | None = None,
    ) -> None:
        self._tokens = tokens
        self._machines = machines
        self._accounts = accounts
        self._fixed_ca = ca
        # With a key ring (the daemon), the CA follows rotations (controlplane.recovery.rotation).
        self._keyring = keyring
        self._lifetime = cert_lifetime
        self._intents = intents
        self._confirm_grace = confirm_grace
        self._store = store
        self._refusals = RepeatLimit(logger)
        if intents is not None:
            intents.register(_JOIN, self._roll_back_join)
        machines.on_confirm(self._confirmed)

    @property
    def _ca(self) -> CertKey:
        """The CA that signs client certificates now."""
        return self._keyring.keys.issuing_ca if self._keyring else self._fixed_ca

    async def join(
        self,
        token_value: str,
        csr_pem: str,
        info: MachineInfo,
        repair_machine_id: str = "",
        *,
        take_over: bool = False,
        recovery_public_key: bytes = b"",
    ) -> JoinResult:
        """Validate everything, use the token once, sign the CSR, write the machine.

        Input is checked before the token is used, so a malformed request does
        not burn a single-use token. ``repair_machine_id`` (a joined box
        re-pairing) must be the machine the token repairs; a new box uses a
        repair token only with ``take_over`` (see link.proto's JoinRequest), and
        with ``recovery_public_key`` (the key it will restore with) only when that
        is the account's. A refusal is logged once (:func:`_refusal_logged`).
        """
        with _refusal_logged(self._refusals, token_value, repair_machine_id):
            clean = info.validate()
            tls.check_csr(csr_pem)
            if repair_machine_id:
                validate_id("machine", repair_machine_id, "repair_machine_id")
            if self._intents is None:
                token = await self._tokens.consume(token_value)
                return await self._register(token.account_id, token.token_id, csr_pem, clean, "")
            token = await self._tokens.check(token_value)
            if repair_machine_id and token.repair_machine_id != repair_machine_id:
                raise await self._not_its_repair_token(token, repair_machine_id)
            if token.repair_machine_id and not repair_machine_id and not take_over:
                raise InvalidState(
                    "join",
                    f"this is a repair token: this box would take over machine "
                    f"{token.repair_machine_id} with none of its data; give --recovery-key FILE to "
                    "restore its newest backup (or --no-restore to take it over empty; an "
                    "agents-machine older than the control plane must be upgraded first); "
                    "the token was not used",
                )
            if token.repair_machine_id:
                return await self._repair(token, csr_pem, clean, recovery_public_key)
            machine_id = self._machines.new_machine_id()
            # Held: committed by the machine's first connection, see the module doc.
            async with self._intents.change(
                _JOIN,
                hold=True,
                account_id=token.account_id,
                token_id=token.token_id,
                machine_id=machine_id,
            ) as intent:
                await self._tokens.use(token, intent.intent_id)
                return await self._register(
                    token.account_id, token.token_id, csr_pem, clean, intent.intent_id, machine_id
                )

    async def _not_its_repair_token(self, token: JoinToken, machine_id: str) -> InvalidState:
        """The refusal of a joined box (``machine_id``) that presents another token than
        its repair token. The box holds a machine this account no longer has when
        its join was rolled back (it never connected): it joins again ``--as-new``."""
        try:
            known = await self._machines.load_any(token.account_id, machine_id) is not None
        except IntegrityError:  # a record that does not verify: refuse as before
            known = True
        if not known:
            return InvalidState(
                "join",
                f"this box is joined as machine {machine_id}, which this account does not"
                " have (a join whose machine never connected is rolled back): join it again"
                " as a new machine, keeping its data, with the same command and --as-new;"
                " the token was not used",
            )
        return InvalidState(
            "join",
            f"this box is already joined as machine {machine_id}: it re-pairs only "
            f"with a repair token for it (`agents-control machine repair "
            f"{machine_id}`); the token was not used",
        )

    async def _repair(
        self, token: JoinToken, csr_pem: str, info: MachineInfo, recovery_public_key: bytes
    ) -> JoinResult:
        """A new box takes over the token's machine (see the module doc)."""
        assert self._intents is not None
        machine_id = validate_id("machine", token.repair_machine_id, "machine_id")
        old = await self._machines.load_any(token.account_id, machine_id)
        if old is None or old.revoked:
            # The machine went (or was revoked) after the token was made.
            raise Unauthenticated("join: the machine this repair token names is gone or revoked")
        account = await self._accounts.require_active(token.account_id, "join")
        if recovery_public_key and recovery_public_key != account.recovery_public_key:
            raise InvalidState(
                "join",
                "the recovery key given is not the recovery key of this machine's account: "
                "no backup of it would open; the token was not used and the machine keeps "
                "its old box",
            )
        async with self._intents.change(
            _JOIN,
            hold=True,
            account_id=token.account_id,
            token_id=token.token_id,
            machine_id=machine_id,
            repair="1",
        ) as intent:
            await self._tokens.use(token, intent.intent_id)
            cert = tls.sign_client_csr(
                self._ca,
                csr_pem,
                account_id=account.account_id,
                machine_id=machine_id,
                lifetime=self._lifetime,
            )
            machine = await self._machines.repair(old, info, cert, token.token_id, intent.intent_id)
            return JoinResult(machine, account, cert, self.ca_cert_pem)

    async def _register(
        self,
        account_id: str,
        token_id: str,
        csr_pem: str,
        info: MachineInfo,
        intent_id: str,
        machine_id: str = "",
    ) -> JoinResult:
        account = await self._accounts.require_active(account_id, "join")
        machine_id = machine_id or self._machines.new_machine_id()
        cert = tls.sign_client_csr(
            self._ca,
            csr_pem,
            account_id=account.account_id,
            machine_id=machine_id,
            lifetime=self._lifetime,
        )
        machine = await self._machines.register(
            account.account_id, machine_id, info, cert, token_id, join_intent=intent_id
        )
        return JoinResult(machine, account, cert, self.ca_cert_pem)

    async def _confirmed(self, machine: Machine, intent_id: str) -> None:
        """A machine connected with its join's certificate: its token use counts,
        also when an unconfirmed repair's roll-back gave it back meanwhile."""
        if machine.token_id:
            await self._tokens.take_again(machine.account_id, machine.token_id, intent_id)

    async def _roll_back_join(self, intent: Intent, age: float) -> bool:
        """Undo a join that was never confirmed (see the module doc); idempotent."""
        assert self._store is not None, "Pairing needs the store to roll joins back"
        acct = validate_id("account", intent.fields.get("account_id", ""), "account_id")
        tok = validate_id("token", intent.fields.get("token_id", ""), "token_id")
        mc = validate_id("machine", intent.fields.get("machine_id", ""), "machine_id")
        machine = await self._machines.load_any(acct, mc)
        if intent.fields.get("repair"):
            # Never undo a repair's record (see the module doc), only the token use.
            written = machine is not None and machine.token_id == tok
            if written and machine is not None and machine.join_intent != intent.intent_id:
                # Confirmed: the new box connected (the use counts, also when the
                # confirming call stopped before it said so).
                await self._tokens.take_again(acct, tok, intent.intent_id)
                return True
            if written and age < self._confirm_grace:
                return False  # the reply may be on its way: give the box time
            await self._tokens.give_back(acct, tok, intent.intent_id)
            # The box may have connected while the use went back: counted again.
            machine = await self._machines.load_any(acct, mc)
            if machine is not None and machine.token_id == tok and not machine.join_intent:
                await self._tokens.take_again(acct, tok, intent.intent_id)
            return True
        if machine is not None:
            if machine.join_intent != intent.intent_id or machine.revoked:
                # Confirmed before the intent was deleted, or revoked by an operator
                # (who saw it): keep the record and the token use.
                return True
            if age < self._confirm_grace:
                return False  # the reply may be on its way: give the machine time
            await self._store.delete(machine_key(acct, mc))
            self._machines.changed()
        await self._store.delete(machine_index_key(mc))
        await self._tokens.give_back(acct, tok, intent.intent_id)
        return True

    async def renew_presented(
        self, peer: AuthorizedPeer, csr_pem: str, threshold: float
    ) -> IssuedCert:
        """Renew for a machine authorised by the certificate it presented.

        Only its current certificate may renew (Unauthenticated otherwise), and
        only once less than ``max(threshold, RENEW_EARLIEST)`` of that
        certificate's lifetime remains (InvalidState otherwise).
        """
        if peer.identity.serial != peer.machine.cert_serial:
            # A superseded certificate may still connect until it expires, but
            # never mint a new one: a stolen old key must not outlive it.
            raise Unauthenticated("renew: only the current certificate may renew")
        if self.issued_by_current_ca(peer.cert_pem):
            due = tls.needs_renewal(peer.cert_pem, max(threshold, RENEW_EARLIEST))
        else:
            due = True  # a CA rollover: every machine moves to the new CA now
        if not due:
            raise InvalidState("renew", "certificate is not due for renewal yet")
        return await self.renew(peer.machine, csr_pem)

    async def renew(self, machine: Machine, csr_pem: str) -> IssuedCert:
        """Sign a fresh certificate for an authorised machine and record its serial."""
        cert = tls.sign_client_csr(
            self._ca,
            csr_pem,
            account_id=machine.account_id,
            machine_id=machine.machine_id,
            lifetime=self._lifetime,
        )
        await self._machines.renewed(machine, cert)
        return cert

    @property
    def ca_cert_pem(self) -> bytes:
        """The CA certificates machines trust: the pinned one first, then (during a CA
        rollover) the new one."""
        return self._keyring.keys.ca_bundle_pem if self._keyring else self._fixed_ca.cert_pem

    def issued_by_current_ca(self, cert_pem: bytes) -> bool:
        """Whether a client certificate is signed by the CA that signs them now."""
        try:
            tls.verify_issued_by(cert_pem, self._ca.cert_pem)
        except InvalidArgument:
            return False
        return True
