"""The CLI's client for the Admin service: TLS trusting our CA, bearer credential.

Replies come back as the dataclasses of :mod:`controlplane.cli.admin_types`, so
protobuf stops here.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio
from google.protobuf.message import Message

from controlplane.cli.admin_types import (
    Account,
    Deletion,
    JoinToken,
    Machine,
    NewAccount,
    NewCredential,
    NewJoinToken,
    PromptQueue,
    SentPrompt,
)
from controlplane.recovery.rotation import RolloverState, ServerRotated
from shared.errors import TransientError
from shared.pb.control.v1 import admin_pb2, admin_pb2_grpc
from shared.rpc import domain_error
from shared.timestamps import to_datetime

__all__ = ["AdminClient", "ControlPlaneUnreachable"]

logger = logging.getLogger(__name__)

# Every status our servers send on purpose carries this trailer (see shared.rpc).
_DETAILS_KEY = "grpc-status-details-bin"


class ControlPlaneUnreachable(TransientError):
    """No control plane answered at ``address`` (refused, closed, TLS failed)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"control plane not reachable at {address}")
        self.address = address


def _from_transport(exc: grpc.aio.AioRpcError) -> bool:
    """True when UNAVAILABLE came from the channel, not from a handler of ours."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers: Any = exc.trailing_metadata() or ()
    return not any(item[0] == _DETAILS_KEY for item in trailers)


class AdminClient:
    """``async with AdminClient(address, ca_pem, credential) as c: await c.list_machines()``."""

    def __init__(self, address: str, ca_pem: bytes, credential: str, timeout: float = 30) -> None:
        self._address = address
        self._ca_pem = ca_pem
        self._metadata = (("authorization", f"Bearer {credential}"),)
        self._timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: admin_pb2_grpc.AdminStub | None = None

    async def __aenter__(self) -> Self:
        creds = grpc.ssl_channel_credentials(root_certificates=self._ca_pem)
        self._channel = grpc.aio.secure_channel(self._address, creds)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._channel is not None:
            await self._channel.close(None)

    async def _call(self, method: Any, request: Message) -> Any:
        """The reply message of one call; its type is the RPC's (the stubs do not say)."""
        try:
            # The generated stubs are typed for the sync API; on an aio channel they await.
            reply: Message = await method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if _from_transport(exc):
                # gRPC's own text ("failed to connect to all addresses; ...") is noise
                # to an operator; keep it for debugging only.
                logger.debug("admin call to %s failed: %s", self._address, exc.details())
                raise ControlPlaneUnreachable(self._address) from None
            raise domain_error(exc) from exc
        return reply

    @property
    def stub(self) -> admin_pb2_grpc.AdminStub:
        """The raw stub (for tests)."""
        assert self._stub is not None, "use AdminClient as an async context manager"
        return self._stub

    async def create_account(
        self, github_user_id: int, github_login: str, recovery_public_key: bytes = b""
    ) -> NewAccount:
        """CreateAccount (with the recovery private key when the server made the pair)."""
        request = admin_pb2.CreateAccountRequest(
            github_user_id=github_user_id,
            github_login=github_login,
            recovery_public_key=recovery_public_key,
        )
        return NewAccount.from_pb(await self._call(self.stub.CreateAccount, request))

    async def get_account(self, account_id: str) -> Account:
        """GetAccount."""
        request = admin_pb2.GetAccountRequest(account_id=account_id)
        return Account.from_pb(await self._call(self.stub.GetAccount, request))

    async def list_accounts(self) -> list[Account]:
        """ListAccounts, oldest first."""
        reply = await self._call(self.stub.ListAccounts, admin_pb2.ListAccountsRequest())
        return [Account.from_pb(a) for a in reply.accounts]

    async def delete_account(self, account_id: str) -> Deletion:
        """DeleteAccount: the deletion's state after the call."""
        request = admin_pb2.DeleteAccountRequest(account_id=account_id)
        reply = await self._call(self.stub.DeleteAccount, request)
        return Deletion.from_pb(reply.deletion)

    async def get_deletion(self, account_id: str) -> Deletion:
        """GetDeletion."""
        request = admin_pb2.GetDeletionRequest(account_id=account_id)
        return Deletion.from_pb(await self._call(self.stub.GetDeletion, request))

    async def create_token(
        self, account_id: str, ttl_seconds: int = 0, max_uses: int = 0
    ) -> NewJoinToken:
        """CreateJoinToken (its secret value is in the reply only)."""
        request = admin_pb2.CreateJoinTokenRequest(
            account_id=account_id, ttl_seconds=ttl_seconds, max_uses=max_uses
        )
        return NewJoinToken.from_pb(await self._call(self.stub.CreateJoinToken, request))

    async def create_repair_token(self, machine_id: str, ttl_seconds: int = 0) -> NewJoinToken:
        """CreateRepairToken."""
        request = admin_pb2.CreateRepairTokenRequest(machine_id=machine_id, ttl_seconds=ttl_seconds)
        return NewJoinToken.from_pb(await self._call(self.stub.CreateRepairToken, request))

    async def list_tokens(self, account_id: str = "") -> list[JoinToken]:
        """ListJoinTokens, oldest first."""
        request = admin_pb2.ListJoinTokensRequest(account_id=account_id)
        reply = await self._call(self.stub.ListJoinTokens, request)
        return [JoinToken.from_pb(t) for t in reply.tokens]

    async def revoke_token(self, token_id: str) -> JoinToken:
        """RevokeJoinToken."""
        request = admin_pb2.RevokeJoinTokenRequest(token_id=token_id)
        return JoinToken.from_pb(await self._call(self.stub.RevokeJoinToken, request))

    async def list_machines(self, account_id: str = "") -> list[Machine]:
        """ListMachines, oldest first."""
        request = admin_pb2.ListMachinesRequest(account_id=account_id)
        reply = await self._call(self.stub.ListMachines, request)
        return [Machine.from_pb(m) for m in reply.machines]

    async def get_machine(self, machine_id: str) -> Machine:
        """GetMachine."""
        request = admin_pb2.GetMachineRequest(machine_id=machine_id)
        return Machine.from_pb(await self._call(self.stub.GetMachine, request))

    async def rename_machine(self, machine_id: str, name: str) -> Machine:
        """RenameMachine."""
        request = admin_pb2.RenameMachineRequest(machine_id=machine_id, name=name)
        return Machine.from_pb(await self._call(self.stub.RenameMachine, request))

    async def revoke_machine(self, machine_id: str) -> Machine:
        """RevokeMachine."""
        request = admin_pb2.RevokeMachineRequest(machine_id=machine_id)
        return Machine.from_pb(await self._call(self.stub.RevokeMachine, request))

    async def set_provider(self, machine_id: str, provider: str, settings_json: str) -> Machine:
        """SetProvider."""
        request = admin_pb2.SetProviderRequest(
            machine_id=machine_id, provider=provider, settings_json=settings_json
        )
        return Machine.from_pb(await self._call(self.stub.SetProvider, request))

    async def send_prompt(
        self, machine_id: str, agent_id: str, text: str, idempotency_key: str = ""
    ) -> SentPrompt:
        """SendPrompt."""
        request = admin_pb2.SendPromptRequest(
            machine_id=machine_id,
            agent_id=agent_id,
            text=text,
            idempotency_key=idempotency_key,
        )
        return SentPrompt.from_pb(await self._call(self.stub.SendPrompt, request))

    async def list_prompts(self, machine_id: str) -> PromptQueue:
        """ListPrompts (the prompts and the provider's last error)."""
        request = admin_pb2.ListPromptsRequest(machine_id=machine_id)
        return PromptQueue.from_pb(await self._call(self.stub.ListPrompts, request))

    async def create_credential(self, account_id: str, label: str) -> NewCredential:
        """CreateCredential (its secret is in the reply only)."""
        request = admin_pb2.CreateCredentialRequest(account_id=account_id, label=label)
        return NewCredential.from_pb(await self._call(self.stub.CreateCredential, request))

    async def rotate_server_certificate(self) -> ServerRotated:
        """RotateServerCertificate (operator)."""
        reply = await self._call(
            self.stub.RotateServerCertificate, admin_pb2.RotateServerCertificateRequest()
        )
        return ServerRotated(to_datetime(reply.not_after), reply.serial)

    async def rollover_ca(self, retire_old: bool = False) -> RolloverState:
        """RolloverCA (operator): start or report a rollover; retire the old CA."""
        r = await self._call(
            self.stub.RolloverCA, admin_pb2.RolloverCARequest(retire_old=retire_old)
        )
        return RolloverState(
            r.state, r.ca_hash, r.old_ca_hash, r.machines_pending, r.machines_notified
        )
