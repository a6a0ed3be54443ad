"""gRPC Admin servicer: authenticate, translate, call one domain method, encode."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any, Final

import grpc
import grpc.aio

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.access.principals import Principal
from controlplane.access.tokens import TokenService
from controlplane.deletion.service import AccountDeletion
from controlplane.deletion.tombstone import Deletion
from controlplane.integrity.records import Account, JoinToken, Machine
from controlplane.machines.presence import MachineStatus, PresenceRegistry
from controlplane.machines.registry import MachineRegistry
from controlplane.queue.delivery import PromptDelivery
from controlplane.queue.starter import MachineStarter
from controlplane.queue.wake import ScheduleWaker
from controlplane.recovery.rotation import KeyRotation
from shared.errors import InvalidState
from shared.ids import validate_id
from shared.pb.control.v1 import admin_pb2, admin_pb2_grpc
from shared.timestamps import Clock, from_datetime, utc_now

__all__ = ["AdminServicer"]

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

#: Presence reads in flight at once while listing machines.
_STATUS_READS: Final = 16


def _account(a: Account) -> admin_pb2.Account:
    return admin_pb2.Account(
        account_id=a.account_id,
        github_user_id=a.github_user_id,
        github_login=a.github_login,
        signed_up_at=from_datetime(a.signed_up_at),
        recovery_public_key=a.recovery_public_key,
        state=a.state,
    )


def _token(t: JoinToken, now: dt.datetime) -> admin_pb2.JoinToken:
    return admin_pb2.JoinToken(
        token_id=t.token_id,
        account_id=t.account_id,
        created_at=from_datetime(t.created_at),
        expires_at=from_datetime(t.expires_at),
        max_uses=t.max_uses,
        uses=t.uses,
        revoked=t.revoked,
        state=t.state(now),
        repair_machine_id=t.repair_machine_id,
    )


def _deletion(d: Deletion) -> admin_pb2.Deletion:
    return admin_pb2.Deletion(
        account_id=d.account_id,
        state=d.state,
        started_at=from_datetime(d.started_at),
        finished_at=from_datetime(d.finished_at),
        deleted_objects=d.deleted_objects,
        deleted_by=d.deleted_by,
    )


def _machine(s: MachineStatus) -> admin_pb2.Machine:
    m: Machine = s.machine
    return admin_pb2.Machine(
        machine_id=m.machine_id,
        account_id=m.account_id,
        name=m.name,
        hostname=m.hostname,
        version=s.version,
        joined_at=from_datetime(m.joined_at),
        last_seen_at=from_datetime(s.last_seen_at),
        online=s.online and not m.revoked,
        agent_count=s.agent_count,
        revoked=m.revoked,
        certificate_serial=m.cert_serial,
        certificate_not_after=from_datetime(m.cert_not_after),
        provider=m.provider,
    )


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Accounts, tokens, machines and credentials for operators and account admins."""

    def __init__(
        self,
        *,
        accounts: AccountService,
        credentials: CredentialService,
        tokens: TokenService,
        machines: MachineRegistry,
        presence: PresenceRegistry,
        deletion: AccountDeletion,
        ca_hash: str,
        join_address: str,
        prompts: PromptDelivery,
        starter: MachineStarter,
        waker: ScheduleWaker | None = None,
        rotation: KeyRotation | None = None,
        clock: Clock = utc_now,
        rotation_refused: str = "",
    ) -> None:
        self._accounts = accounts
        self._credentials = credentials
        self._tokens = tokens
        self._machines = machines
        self._presence = presence
        self._deletion = deletion
        self._ca_hash = ca_hash
        self._join_address = join_address
        self._prompts = prompts
        self._starter = starter
        self._waker = waker
        self._rotation = rotation
        # Why rotations are refused here though keys can be read ("": they are not).
        self._rotation_refused = rotation_refused
        # "Now" for token states and prompt ages (tests move it).
        self._clock = clock

    def _pin(self) -> str:
        # The CA changes at a CA rollover's retirement: join commands follow it.
        return self._rotation.pinned_ca_hash if self._rotation else self._ca_hash

    async def _auth(self, context: Context) -> Principal:
        bearer: str | None = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                if scheme.lower() == "bearer":
                    bearer = rest.strip()
        return await self._credentials.authenticate(bearer)

    async def _status(self, m: Machine) -> admin_pb2.Machine:
        status = await self._presence.status(m)
        pb = _machine(status)
        pb.starting = not pb.online and self._starter.starting(m.machine_id)
        pb.has_provider = await self._starter.has_provider(m.account_id, m.machine_id)
        wake_at = self._waker.wake_at(status) if self._waker is not None else None
        if status.next_fire_at is not None:
            pb.next_fire_at.CopyFrom(from_datetime(status.next_fire_at))
        if wake_at is not None and pb.has_provider:
            pb.next_wake_at.CopyFrom(from_datetime(wake_at))
        return pb

    # Each RPC: authenticate, one domain call, encode. The error interceptor maps
    # errors and shared.call_metrics counts every call (server.py wires both).

    async def CreateAccount(
        self, request: admin_pb2.CreateAccountRequest, context: Context
    ) -> admin_pb2.CreateAccountResponse:
        """See admin.proto."""
        p = await self._auth(context)
        p.require_operator("account create")
        made = await self._accounts.create(
            request.github_user_id,
            request.github_login,
            request.recovery_public_key or None,
            p.credential_id,
        )
        return admin_pb2.CreateAccountResponse(
            account=_account(made.account), recovery_private_key=made.recovery_private_key or b""
        )

    async def GetAccount(
        self, request: admin_pb2.GetAccountRequest, context: Context
    ) -> admin_pb2.Account:
        """See admin.proto."""
        p = await self._auth(context)
        validate_id("account", request.account_id, "account_id")
        p.visible_account(request.account_id, "account", request.account_id)
        return _account(await self._accounts.get(request.account_id))

    async def ListAccounts(
        self, request: admin_pb2.ListAccountsRequest, context: Context
    ) -> admin_pb2.ListAccountsResponse:
        """See admin.proto."""
        p = await self._auth(context)
        if p.is_operator:
            accounts = await self._accounts.list()
        else:
            accounts = [await self._accounts.get(p.account_id)]
        return admin_pb2.ListAccountsResponse(accounts=[_account(a) for a in accounts])

    async def CreateJoinToken(
        self, request: admin_pb2.CreateJoinTokenRequest, context: Context
    ) -> admin_pb2.CreateJoinTokenResponse:
        """See admin.proto."""
        p = await self._auth(context)
        made = await self._tokens.create(
            p, request.account_id, request.ttl_seconds, request.max_uses
        )
        return admin_pb2.CreateJoinTokenResponse(
            token=_token(made.token, made.token.created_at),
            token_value=made.value,
            ca_hash=self._pin(),
            join_address=self._join_address,
        )

    async def CreateRepairToken(
        self, request: admin_pb2.CreateRepairTokenRequest, context: Context
    ) -> admin_pb2.CreateJoinTokenResponse:
        """See admin.proto: a one-use token bound to an existing machine."""
        p = await self._auth(context)
        machine = await self._machines.get(p, request.machine_id)
        made = await self._tokens.create_repair(p, machine, request.ttl_seconds)
        return admin_pb2.CreateJoinTokenResponse(
            token=_token(made.token, made.token.created_at),
            token_value=made.value,
            ca_hash=self._pin(),
            join_address=self._join_address,
        )

    async def ListJoinTokens(
        self, request: admin_pb2.ListJoinTokensRequest, context: Context
    ) -> admin_pb2.ListJoinTokensResponse:
        """See admin.proto."""
        p = await self._auth(context)
        tokens = await self._tokens.list(p, request.account_id)
        now = self._clock()
        return admin_pb2.ListJoinTokensResponse(tokens=[_token(t, now) for t in tokens])

    async def RevokeJoinToken(
        self, request: admin_pb2.RevokeJoinTokenRequest, context: Context
    ) -> admin_pb2.JoinToken:
        """See admin.proto."""
        p = await self._auth(context)
        token = await self._tokens.revoke(p, request.token_id)
        return _token(token, self._clock())

    async def ListMachines(
        self, request: admin_pb2.ListMachinesRequest, context: Context
    ) -> admin_pb2.ListMachinesResponse:
        """See admin.proto."""
        p = await self._auth(context)
        machines = await self._machines.list(p, request.account_id)
        # Each offline machine costs one store read: overlap them, but boundedly.
        limit = asyncio.Semaphore(_STATUS_READS)

        async def status(m: Machine) -> admin_pb2.Machine:
            async with limit:
                return await self._status(m)

        out = await asyncio.gather(*(status(m) for m in machines))
        return admin_pb2.ListMachinesResponse(machines=out)

    async def GetMachine(
        self, request: admin_pb2.GetMachineRequest, context: Context
    ) -> admin_pb2.Machine:
        """See admin.proto."""
        p = await self._auth(context)
        return await self._status(await self._machines.get(p, request.machine_id))

    async def RenameMachine(
        self, request: admin_pb2.RenameMachineRequest, context: Context
    ) -> admin_pb2.Machine:
        """See admin.proto."""
        p = await self._auth(context)
        machine = await self._machines.rename(p, request.machine_id, request.name)
        return await self._status(machine)

    async def RevokeMachine(
        self, request: admin_pb2.RevokeMachineRequest, context: Context
    ) -> admin_pb2.Machine:
        """See admin.proto."""
        p = await self._auth(context)
        machine = await self._machines.revoke(p, request.machine_id)
        return await self._status(machine)

    async def CreateCredential(
        self, request: admin_pb2.CreateCredentialRequest, context: Context
    ) -> admin_pb2.CreateCredentialResponse:
        """See admin.proto."""
        p = await self._auth(context)
        made = await self._credentials.create_for_account(p, request.account_id, request.label)
        return admin_pb2.CreateCredentialResponse(
            credential_id=made.credential.credential_id,
            credential=made.value,
            account_id=made.credential.account_id,
        )

    async def DeleteAccount(
        self, request: admin_pb2.DeleteAccountRequest, context: Context
    ) -> admin_pb2.DeleteAccountResponse:
        """See admin.proto."""
        p = await self._auth(context)
        deletion = await self._deletion.delete(p, request.account_id)
        return admin_pb2.DeleteAccountResponse(deletion=_deletion(deletion))

    async def GetDeletion(
        self, request: admin_pb2.GetDeletionRequest, context: Context
    ) -> admin_pb2.Deletion:
        """See admin.proto."""
        p = await self._auth(context)
        return _deletion(await self._deletion.get(p, request.account_id))

    async def SetProvider(
        self, request: admin_pb2.SetProviderRequest, context: Context
    ) -> admin_pb2.Machine:
        """See admin.proto."""
        p = await self._auth(context)
        machine = await self._starter.set(
            p, request.machine_id, request.provider, request.settings_json
        )
        return await self._status(machine)

    async def SendPrompt(
        self, request: admin_pb2.SendPromptRequest, context: Context
    ) -> admin_pb2.SendPromptResponse:
        """See admin.proto."""
        p = await self._auth(context)
        sent = await self._prompts.send(
            p, request.machine_id, request.agent_id, request.text, request.idempotency_key
        )
        return admin_pb2.SendPromptResponse(
            prompt_id=sent.prompt_id, state=sent.state, run_id=sent.run_id, reason=sent.reason
        )

    async def ListPrompts(
        self, request: admin_pb2.ListPromptsRequest, context: Context
    ) -> admin_pb2.ListPromptsResponse:
        """See admin.proto."""
        p = await self._auth(context)
        states = await self._prompts.states(p, request.machine_id)
        now = self._clock()
        return admin_pb2.ListPromptsResponse(
            provider_error=self._starter.last_error(request.machine_id),
            prompts=[
                admin_pb2.PromptInfo(
                    prompt_id=s.prompt_id,
                    agent_id=s.agent_id,
                    created_at=from_datetime(s.created_at),
                    size=s.size,
                    state=s.state,
                    age_seconds=max(0, int((now - s.created_at).total_seconds())),
                    run_id=s.run_id,
                    reason=s.reason,
                )
                for s in states
            ],
        )

    async def RotateServerCertificate(
        self, request: admin_pb2.RotateServerCertificateRequest, context: Context
    ) -> admin_pb2.RotateServerCertificateResponse:
        """See admin.proto."""
        p = await self._auth(context)
        rotated = await self._require_rotation().rotate_server(p)
        return admin_pb2.RotateServerCertificateResponse(
            not_after=from_datetime(rotated.not_after), serial=rotated.serial
        )

    async def RolloverCA(
        self, request: admin_pb2.RolloverCARequest, context: Context
    ) -> admin_pb2.RolloverCAResponse:
        """See admin.proto."""
        p = await self._auth(context)
        r = await self._require_rotation().rollover(p, retire_old=request.retire_old)
        return admin_pb2.RolloverCAResponse(
            ca_hash=r.ca_hash,
            state=r.state,
            old_ca_hash=r.old_ca_hash,
            machines_pending=r.machines_pending,
            machines_notified=r.machines_notified,
        )

    def _require_rotation(self) -> KeyRotation:
        if self._rotation_refused:
            raise InvalidState("keys", self._rotation_refused)
        if self._rotation is None:
            raise InvalidState("keys", "key rotation is not available in this server")
        return self._rotation
