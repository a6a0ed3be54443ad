"""Counting Admin RPCs by method and final status, as one server interceptor.

:class:`AdminCallsInterceptor` wraps every handler of one gRPC service (the
Admin service) and counts each finished call in
``agents_cp_admin_calls_total{method,code}``: ``method`` is the RPC name,
``code`` the status the client sees (``OK``, or the code an abort set, which is
how :class:`shared.rpc.ErrorInterceptor` reports a domain error, including a
call refused at authentication). Install it BEFORE the error interceptor in
``grpc.aio.server(interceptors=[...])`` so it wraps the mapped handler and
reads the final code from the context. Cancelled calls are not counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc
import grpc.aio
from prometheus_client import Counter

from shared.errors import AgentsError
from shared.rpc import status_for

__all__ = ["AdminCallsInterceptor"]

logger = logging.getLogger(__name__)

_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


def _final_code(context: _Context, exc: BaseException | None) -> str:
    """The status name the call ends with, as the client will see it."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if exc is None:
        return grpc.StatusCode.OK.name
    # Only reached when installed inside the error interceptor: map as it would.
    if isinstance(exc, AgentsError):
        return status_for(exc).name
    # grpc reports an exception nothing mapped as UNKNOWN.
    return grpc.StatusCode.UNKNOWN.name


class AdminCallsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts every unary call of ``service`` (a full name) in ``calls{method,code}``."""

    def __init__(self, service: str, calls: Counter) -> None:
        self._prefix = f"/{service}/"
        self._calls = calls

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        full: str = handler_call_details.method
        # Unknown methods have no handler: the label set stays bounded by the proto.
        if handler is None or not full.startswith(self._prefix) or not handler.unary_unary:
            return handler
        # The stubs type handlers as synchronous; on an aio server they are coroutines.
        behavior: Callable[[Any, _Context], Awaitable[Any]] = handler.unary_unary  # type: ignore[assignment]
        return grpc.unary_unary_rpc_method_handler(
            self._counted(full.removeprefix(self._prefix), behavior),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _counted(
        self, method: str, behavior: Callable[[Any, _Context], Awaitable[Any]]
    ) -> Callable[[Any, _Context], Awaitable[Any]]:
        async def counted(request: Any, context: _Context) -> Any:
            try:
                reply = await behavior(request, context)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._calls.labels(method, _final_code(context, exc)).inc()
                raise
            self._calls.labels(method, _final_code(context, None)).inc()
            return reply

        return counted
