"""Authentication for the machine API's optional TCP listener.

The Unix socket is protected by its file mode (0600 in a 0700 folder): only
the machine's user reaches it. A TCP port on loopback is reachable by every
user of the host, so calls on it must carry ``authorization: Bearer <token>``
where the token lives in ``<data dir>/keys/local-api-token`` (0600): whoever
can read the data folder may use the API, nobody else.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import grpc.aio

from shared.atomic import ensure_private_dir, write_atomic

__all__ = ["TOKEN_FILE", "BearerTokenInterceptor", "load_or_create_token"]

logger = logging.getLogger(__name__)

TOKEN_FILE = Path("keys") / "local-api-token"
_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


def load_or_create_token(data_dir: Path) -> str:
    """The data folder's API token, made on first use (never logged)."""
    path = data_dir / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    ensure_private_dir(path.parent)
    token = secrets.token_urlsafe(32)
    write_atomic(path, token.encode() + b"\n")
    logger.info("made the local API token at %s", path)
    return token


def _deny(message: str) -> _Handler:
    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str, token_path: Path) -> None:
        self._expected = f"Bearer {token}".encode()
        # The caller is not yet known to be the machine's user: tell it nothing
        # about the host (not even where the token lives). The operator's log says.
        self._deny = _deny("machine api: missing or wrong bearer token")
        logger.info("calls on TCP need the bearer token in %s", token_path)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        given = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str):
                given = value
        if hmac.compare_digest(given.encode(), self._expected):
            return await continuation(handler_call_details)
        return self._deny
