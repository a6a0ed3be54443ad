"""Which store cause each RPC's requests count under (``agents_cp_store_requests_total``).

:class:`CauseInterceptor` names the cause (:mod:`shared.store.causes`) at the
start of every call it knows, before the handler runs, so every store request
the call makes (and every task it starts, which copies its context) is counted
under it. gRPC runs each call in a task of its own, so the cause ends with the
call. Code under a call that is its own kind of work (a presence write, a
heartbeat on the Connect stream) names itself inside it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final, TypeAlias

import grpc

from shared.rpc import HandlerInterceptor, rewrap
from shared.store.causes import set_cause

__all__ = ["CauseInterceptor", "rpc_causes"]

_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

#: Admin methods whose work is not plain administration.
_ADMIN: Final = {
    "SendPrompt": "queue",
    "ListPrompts": "queue",
    "DeleteAccount": "deletion",
    "GetDeletion": "deletion",
    "RotateServerCertificate": "rotation",
    "RolloverCA": "rotation",
}
_LINK: Final = {"Join": "join", "RenewCertificate": "renewal", "Connect": "link"}


def rpc_causes(admin_service: str, link_service: str) -> dict[str, str]:
    """The table for the daemon's two services: a full service name (every method
    of it) or ``service/Method`` -> cause. The link's other methods are backups."""
    return {
        admin_service: "admin",
        **{f"{admin_service}/{method}": cause for method, cause in _ADMIN.items()},
        link_service: "backups",
        **{f"{link_service}/{method}": cause for method, cause in _LINK.items()},
    }


class CauseInterceptor(HandlerInterceptor):
    """Names the store cause of each call of the services in ``causes`` (the most
    specific key wins); calls of other services are left as they are."""

    def __init__(self, causes: Mapping[str, str]) -> None:
        self._causes = dict(causes)

    def wrap(self, method: str, handler: _Handler) -> _Handler:
        """``handler``, run under its method's cause."""
        path = method.removeprefix("/")
        cause = self._causes.get(path) or self._causes.get(path.rpartition("/")[0])
        if cause is None:
            return handler
        return rewrap(handler, lambda behavior: _under(cause, behavior))


def _under(cause: str, behavior: Callable[..., Any]) -> Any:
    """``behavior`` (a coroutine or async generator function), run under ``cause``."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            set_cause(cause)
            async for item in behavior(request, context):
                yield item

        return stream

    async def unary(request: Any, context: Any) -> Any:
        set_cause(cause)
        return await behavior(request, context)

    return unary
