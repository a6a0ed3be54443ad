"""The ``ec2`` provider: start and describe an instance through aiobotocore.

Errors are sorted at this one edge: a refusal (credentials, permissions, no
such instance, an instance that cannot start) is a ProviderError; a fault
that may pass (throttling, a 5xx, no connection, a timeout) is
ProviderUnavailable. Messages name the instance and the cause, never a key.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any, Final, Self

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from controlplane.queue.providers.base import Ec2Settings, ProviderState, ProviderStatus
from shared.errors import ProviderError, ProviderUnavailable

__all__ = ["Ec2Provider"]

logger = logging.getLogger(__name__)

#: EC2 instance states -> ours.
_STATES: Final = {
    "pending": ProviderState.STARTING,
    "running": ProviderState.RUNNING,
    "stopping": ProviderState.STOPPING,
    "stopped": ProviderState.STOPPED,
    "shutting-down": ProviderState.FAILED,
    "terminated": ProviderState.FAILED,
}
_CREDENTIALS: Final = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "OptInRequired",
    }
)
_TRANSIENT: Final = frozenset(
    {"RequestLimitExceeded", "Throttling", "ServiceUnavailable", "InternalError", "Unavailable"}
)


class Ec2Provider:
    """One EC2 instance; the client is made on first use and kept."""

    name = "ec2"

    def __init__(self, settings: Ec2Settings) -> None:
        self._settings = settings
        self._what = f"provider ec2 {settings.instance_id}"
        self._exit = contextlib.AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _ec2(self) -> Any:
        if self._client is None:
            s = self._settings
            config = AioConfig(
                retries={"total_max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=15,
            )
            self._client = await self._exit.enter_async_context(
                get_session().create_client(
                    "ec2",
                    region_name=s.region,
                    endpoint_url=s.endpoint_url,
                    aws_access_key_id=s.access_key_id,
                    aws_secret_access_key=s.secret_access_key,
                    config=config,
                )
            )
        return self._client

    def _translate(self, exc: BaseException, op: str) -> Exception:
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _CREDENTIALS:
                return ProviderError(self._what, f"{op}: AWS refused the credentials ({code})")
            if code.startswith("InvalidInstanceID"):
                return ProviderError(self._what, f"{op}: no such instance ({code})")
            if code == "IncorrectInstanceState":
                return ProviderError(self._what, f"{op}: the instance cannot start in its state")
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in _TRANSIENT or status >= 500:
                return ProviderUnavailable(f"{self._what}: {op}: EC2 answered {code or status}")
            return ProviderError(self._what, f"{op}: EC2 refused ({code or status})")
        return ProviderUnavailable(f"{self._what}: {op}: cannot reach EC2 ({type(exc).__name__})")

    async def start(self) -> ProviderStatus:
        try:
            ec2 = await self._ec2()
            reply = await ec2.start_instances(InstanceIds=[self._settings.instance_id])
        except (ClientError, BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as e:
            raise self._translate(e, "start") from None
        states = reply.get("StartingInstances", [])
        name = states[0].get("CurrentState", {}).get("Name", "") if states else ""
        logger.info("%s: start asked, now %s", self._what, name or "unknown")
        return ProviderStatus(_STATES.get(name, ProviderState.UNKNOWN), name)

    async def status(self) -> ProviderStatus:
        try:
            ec2 = await self._ec2()
            reply = await ec2.describe_instances(InstanceIds=[self._settings.instance_id])
        except (ClientError, BotoCoreError, aiohttp.ClientError, OSError, TimeoutError) as e:
            raise self._translate(e, "describe") from None
        instances = [i for r in reply.get("Reservations", []) for i in r.get("Instances", [])]
        if not instances:
            raise ProviderError(self._what, "describe: no such instance")
        name = str(instances[0].get("State", {}).get("Name", ""))
        return ProviderStatus(_STATES.get(name, ProviderState.UNKNOWN), name)

    async def close(self) -> None:
        self._client = None
        await self._exit.aclose()
