"""Counting RPCs by final status, as one server interceptor for every servicer.

:class:`CallsInterceptor` wraps the handlers it has a counter for (unary and
streaming alike) and calls that counter once per finished call with the method name and the status
the client sees (``OK``, or the code an abort set, which is how
:class:`shared.rpc.ErrorInterceptor` reports a domain error, including a call
refused at authentication). Each counter chooses its metric's labels, so the
metric names and label values of each service stay its own. Install it BEFORE
the error interceptor in ``grpc.aio.server(interceptors=[...])`` so it wraps
the mapped handler and reads the final code from the context. Cancelled calls
(a client gone mid-stream included) are not counted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeAlias

import grpc
import grpc.aio

from shared.errors import AgentsError
from shared.rpc import HandlerInterceptor, rewrap, status_for

__all__ = ["CallCounter", "CallsInterceptor"]

logger = logging.getLogger(__name__)

_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

CallCounter: TypeAlias = Callable[[str, grpc.StatusCode], None]
"""Counts one finished call: the method name and its final status."""


def _final_code(context: _Context, exc: BaseException | None) -> grpc.StatusCode:
    """The status the call ends with, as the client will see it."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    # Only reached when installed inside the error interceptor: map as it would.
    if isinstance(exc, AgentsError):
        return status_for(exc)
    # grpc reports an exception nothing mapped as UNKNOWN.
    return grpc.StatusCode.UNKNOWN


class CallsInterceptor(HandlerInterceptor):
    """Counts the calls, unary or streaming, of each service or method in ``counters``.

    Keys are a full service name (every method of it) or ``service/Method``;
    the most specific key wins.
    """

    def __init__(self, counters: Mapping[str, CallCounter]) -> None:
        self._counters = dict(counters)

    def _counter(self, full: str) -> CallCounter | None:
        path = full.removeprefix("/")
        return self._counters.get(path) or self._counters.get(path.rpartition("/")[0])

    def wrap(self, method: str, handler: _Handler) -> _Handler:
        """``handler``, counted when ``method`` is one of the counted."""
        counter = self._counter(method)
        if counter is None:
            return handler
        name = method.rpartition("/")[2]
        return rewrap(handler, lambda behavior: _counted(name, behavior, counter))


def _counted(method: str, behavior: Callable[..., Any], counter: CallCounter) -> Any:
    """``behavior`` (a coroutine or async generator function), counting its end."""
    if inspect.isasyncgenfunction(behavior):

        async def counted_stream(request: Any, context: _Context) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                counter(method, _final_code(context, exc))
                raise
            counter(method, _final_code(context, None))

        return counted_stream

    async def counted(request: Any, context: _Context) -> Any:
        try:
            reply = await behavior(request, context)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            counter(method, _final_code(context, exc))
            raise
        counter(method, _final_code(context, None))
        return reply

    return counted
