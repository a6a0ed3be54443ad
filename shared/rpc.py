"""The one edge between domain errors and gRPC status codes.

Servers install :class:`ErrorInterceptor`; handlers simply raise
:class:`shared.errors.AgentsError` subclasses. The interceptor turns each one
into a status code from :data:`STATUS_TABLE`, with the error's message as
details and a google.rpc ``Status`` in the trailing metadata carrying an
``ErrorInfo`` (reason = the error class) and, for bad input, a
``BadRequest`` field violation. Anything unmapped is logged and becomes
INTERNAL with no detail leaked. ``asyncio.CancelledError`` passes through.

Clients mirror it with :func:`rpc_errors` / :func:`domain_error`: a failed
call becomes the same domain error class (any class of :mod:`shared.errors`),
with the same message and data attributes, or :class:`shared.errors.RpcError`
carrying the :class:`grpc.StatusCode`; the gRPC error is kept as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Final, NoReturn, TypeAlias

import grpc
import grpc.aio
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from shared import errors as E

__all__ = [
    "check_can_listen",
    "NO_REUSEPORT",
    "STATUS_TABLE",
    "ErrorInterceptor",
    "HandlerInterceptor",
    "domain_error",
    "from_server",
    "rewrap",
    "rpc_errors",
    "serve_health_and_reflection",
    "status_for",
    "unimplemented",
]

logger = logging.getLogger(__name__)

ERROR_DOMAIN = "agents.platform"
#: A server option for every gRPC server here: gRPC sets SO_REUSEPORT on its
#: listening sockets by default, so a second server on a port another one
#: (with the option too) holds would start and take some of its connections.
NO_REUSEPORT: Final = ("grpc.so_reuseport", 0)


def check_can_listen(host: str, port: int, field: str) -> None:
    """ConfigError naming ``field`` when ``host:port`` cannot be listened on now.

    gRPC's own failure to bind writes a line from its C core to stderr before it
    raises, so a daemon checks its fixed ports first and a refused start stays
    one line. gRPC's bind right after remains the real test (a port taken in
    between still fails the start, only less quietly). Port 0 always passes.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As gRPC binds: a port in TIME_WAIT is free, a listening one is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # The same words as gRPC's own refusal (shared.cli.bind_error).
        reason = f"cannot listen on {where}: in use, or not this host's"
        raise E.ConfigError(field, reason) from None


_DETAILS_KEY = "grpc-status-details-bin"

#: Domain error class -> gRPC status. The most specific class wins (the error's
#: nearest base in the table), whatever the order of the rows.
STATUS_TABLE: tuple[tuple[type[E.AgentsError], grpc.StatusCode], ...] = (
    (E.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFound, grpc.StatusCode.NOT_FOUND),
    (E.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (E.InvalidState, grpc.StatusCode.FAILED_PRECONDITION),
    (E.PreconditionFailed, grpc.StatusCode.ABORTED),
    (E.QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.DiskFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (E.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (E.IntegrityError, grpc.StatusCode.DATA_LOSS),
    (E.Cancelled, grpc.StatusCode.CANCELLED),
    (E.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (E.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (E.TransientError, grpc.StatusCode.UNAVAILABLE),
    (E.ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.StoreError, grpc.StatusCode.INTERNAL),
    # A missing bucket or refused credentials is the operator's to fix, and the
    # message (naming the store) helps them; other store faults stay INTERNAL.
    (E.StoreMisconfigured, grpc.StatusCode.FAILED_PRECONDITION),
)
_STATUS_BY_CLASS: dict[type[BaseException], grpc.StatusCode] = dict(STATUS_TABLE)

# Classes a client may rebuild from ErrorInfo.reason: every class of the tree
# but its root and RpcError (a client-side wrapper); anything else becomes RpcError.
_BY_NAME: dict[str, type[E.AgentsError]] = {
    cls.__name__: cls
    for cls in vars(E).values()
    if isinstance(cls, type)
    and issubclass(cls, E.AgentsError)
    and cls not in (E.AgentsError, E.RpcError)
}
# Attributes worth carrying across the wire (never secrets: they are ids and limits).
_CARRIED = (
    "field",
    "reason",
    "kind",
    "ident",
    "value",
    "what",
    "key",
    "limit",
    "size",
    "folder",
    "path",
)
# Carried attributes that are numbers on the server side.
_NUMERIC = frozenset({"limit", "size"})


def status_for(exc: E.AgentsError) -> grpc.StatusCode:
    """Return the status code for a domain error (INTERNAL when unmapped)."""
    for cls in type(exc).__mro__:
        code = _STATUS_BY_CLASS.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def _rich_status(exc: E.AgentsError, code: grpc.StatusCode) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason=type(exc).__name__, domain=ERROR_DOMAIN)
    for attr in _CARRIED:
        value = getattr(exc, attr, None)
        if value is not None:
            info.metadata[attr] = str(value)
    status = status_pb2.Status(code=code.value[0], message=exc.message)
    status.details.add().Pack(info)
    if isinstance(exc, E.InvalidArgument):
        bad = error_details_pb2.BadRequest()
        bad.field_violations.add(field=exc.field, description=exc.reason)
        status.details.add().Pack(bad)
    return status


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: BaseException) -> NoReturn:
    if isinstance(exc, E.AgentsError):
        code = status_for(exc)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("internal error: %s", exc)
            await context.abort(code, "internal error")
        status = _rich_status(exc, code)
        await context.abort(
            code, exc.message, trailing_metadata=((_DETAILS_KEY, status.SerializeToString()),)
        )
    logger.exception("unhandled error in handler", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises grpc's own AbortError; it must pass through untouched.
    return type(exc).__name__ == "AbortError" or isinstance(exc, grpc.RpcError)


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:
            if _is_abort(exc):
                raise
            await _abort(context, exc)

    return wrapper


def _mapped(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` (a coroutine or async generator function), errors mapped."""
    if inspect.isasyncgenfunction(behavior):

        async def gen_wrapper(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except Exception as exc:
                if _is_abort(exc):
                    raise
                await _abort(context, exc)

        return gen_wrapper
    return _wrap_unary(behavior)


_Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


class HandlerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Base of our server interceptors: each wraps the handler of a known method."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        # Unknown methods have no handler: nothing to wrap.
        return handler if handler is None else self.wrap(handler_call_details.method, handler)

    def wrap(self, method: str, handler: _Handler) -> _Handler:
        """The handler to serve ``method`` (``/service/Method``) with instead."""
        raise NotImplementedError


class ErrorInterceptor(HandlerInterceptor):
    """Maps domain errors raised by any handler to gRPC statuses (see module doc)."""

    def wrap(self, method: str, handler: _Handler) -> _Handler:
        """``handler``, its domain errors mapped to statuses."""
        return rewrap(handler, _mapped)


def rewrap(handler: _Handler, wrap: Callable[[Callable[..., Any]], Any]) -> _Handler:
    """A handler of ``handler``'s kind (unary or streaming either side) serving
    ``wrap(behavior)`` instead of its behavior, with the same (de)serializers."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)
    return handler


def _details_status(metadata: Iterable[tuple[str, Any]] | None) -> status_pb2.Status | None:
    for key, value in metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # malformed details: fall back to the plain status
                return None
            return status
    return None


def from_server(exc: BaseException | None) -> bool:
    """Whether ``exc`` (a gRPC failure) carries a domain error a server raised, as
    opposed to a failure of the call itself (no server answered, a deadline)."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    status = _details_status(exc.trailing_metadata())  # type: ignore[arg-type]
    return status is not None and any(
        d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) for d in status.details
    )


def domain_error(exc: grpc.aio.AioRpcError) -> E.AgentsError:
    """Rebuild the domain error a server raised, or an RpcError carrying the code."""
    code = exc.code()
    details = exc.details() or ""
    status = _details_status(exc.trailing_metadata())  # type: ignore[arg-type]
    if status is not None:
        for any_detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if any_detail.Is(info.DESCRIPTOR) and any_detail.Unpack(info):
                cls = _BY_NAME.get(info.reason)
                if cls is not None and info.domain == ERROR_DOMAIN:
                    err = cls.__new__(cls)
                    E.AgentsError.__init__(err, details)
                    for attr, value in info.metadata.items():
                        if attr in _NUMERIC and value.isdigit():
                            setattr(err, attr, int(value))
                        elif attr in _CARRIED:
                            setattr(err, attr, value)
                    return err
    if code == grpc.StatusCode.UNAVAILABLE:
        return E.TransientError(details or "service unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return E.DeadlineExceeded(details or "deadline exceeded")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return E.Unauthenticated(details or "unauthenticated")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return E.PermissionDenied(details or "permission denied")
    return E.RpcError(code if code is not None else grpc.StatusCode.UNKNOWN, details)


@contextlib.asynccontextmanager
async def rpc_errors() -> AsyncIterator[None]:
    """Re-raise gRPC failures inside the block as domain errors (the gRPC error as
    their ``__cause__``)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise domain_error(exc) from exc


def unimplemented(
    method: str, reason: str, *, check: str | None = None, what: str | None = None
) -> Any:
    """A servicer method for an RPC that arrives later, assigned in the class body
    (``Prune = unimplemented("Prune", _LATER)``): it answers UNIMPLEMENTED
    ("<what>: <reason>", ``what`` defaulting to the method name), after awaiting
    the servicer's ``check`` method (its authorisation, so an unauthenticated
    caller learns nothing more) when one is named. Typed ``Any`` so it stands in
    for the generated base's abstract method whatever its signature."""

    async def later(self: Any, request: Any, context: Any) -> Any:
        if check is not None:
            await getattr(self, check)(context)
        raise E.Unimplemented(what or method, reason)

    later.__name__ = method
    later.__doc__ = f"Not implemented yet: {reason}."
    return later


async def serve_health_and_reflection(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> HealthServicer:
    """Register gRPC health checking (every service SERVING) and reflection.

    Returns the health servicer so the daemon can flip it to NOT_SERVING
    while it drains at shutdown.
    """
    names = list(service_names)
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in [*names, ""]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*names, health_name, reflection.SERVICE_NAME], server)
    return servicer
