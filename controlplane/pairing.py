"""Joining a machine (token + CSR -> certificate) and renewing its certificate.

Repair (re-pairing a known machine id with a fresh key) arrives in a later
release: every join makes a new machine.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from controlplane.accounts import AccountService
from controlplane.machines import AuthorizedPeer, MachineInfo, MachineService
from controlplane.records import Account, Machine
from controlplane.tokens import TokenService
from shared import tls
from shared.errors import InvalidState, Unauthenticated
from shared.tls import CertKey, IssuedCert

__all__ = ["JoinResult", "Pairing"]

logger = logging.getLogger(__name__)

#: Renewal is refused while more than this fraction of the lifetime remains
#: (or the configured threshold, if larger): it bounds how often a machine, or a
#: thief of its current key, can mint certificates.
RENEW_EARLIEST = 0.5


@dataclass(frozen=True)
class JoinResult:
    """Everything a joined machine needs to hear back."""

    machine: Machine
    account: Account
    cert: IssuedCert
    ca_cert_pem: bytes


class Pairing:
    """Turns join tokens into machines, and signs renewals."""

    def __init__(
        self,
        tokens: TokenService,
        machines: MachineService,
        accounts: AccountService,
        ca: CertKey,
        cert_lifetime: dt.timedelta,
    ) -> None:
        self._tokens = tokens
        self._machines = machines
        self._accounts = accounts
        self._ca = ca
        self._lifetime = cert_lifetime

    async def join(self, token_value: str, csr_pem: str, info: MachineInfo) -> JoinResult:
        """Validate everything, use the token once, sign the CSR, write the machine.

        Input is checked before the token is used, so a malformed request does
        not burn a single-use token.
        """
        clean = info.validate()
        tls.check_csr(csr_pem)
        token = await self._tokens.consume(token_value)
        account = await self._accounts.require_active(token.account_id, "join")
        machine_id = self._machines.new_machine_id()
        cert = tls.sign_client_csr(
            self._ca,
            csr_pem,
            account_id=account.account_id,
            machine_id=machine_id,
            lifetime=self._lifetime,
        )
        machine = await self._machines.register(
            account.account_id, machine_id, clean, cert, token.token_id
        )
        return JoinResult(machine, account, cert, self._ca.cert_pem)

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
        if not tls.needs_renewal(peer.cert_pem, max(threshold, RENEW_EARLIEST)):
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
        """The CA certificate machines pin."""
        return self._ca.cert_pem
