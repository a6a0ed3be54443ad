"""The error edge: domain errors cross a real gRPC connection and come back typed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from google.rpc import error_details_pb2, status_pb2

from shared import errors as E
from shared.rpc import (
    STATUS_TABLE,
    ErrorInterceptor,
    domain_error,
    rpc_errors,
    serve_health_and_reflection,
    status_for,
)

_raw: dict[str, Any] = {"request_deserializer": None, "response_serializer": None}


def _server_error(name: str) -> Exception:
    return {
        "invalid": E.InvalidId("agent", "../etc", field="agent_id"),
        "toolarge": E.TooLarge("prompt", 10, 11),
        "missing": E.NotFound("agent", "ag_x"),
        "state": E.InvalidState("prompt ag_x", "agent is archived"),
        "quota": E.QuotaExceeded("queue", 5),
        "later": E.Unimplemented("BackupNow", "arrives with a later issue"),
        "store": E.StoreError("s3 bucket: access denied (secret=abc)"),
        "misconfigured": E.StoreMisconfigured("s3 bucket: no such bucket"),
        "provider": E.ProviderError("start machine", "the provider refused the credentials"),
        "boom": RuntimeError("secret detail"),
    }[name]


async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    raise _server_error(request.decode())


async def stream(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    yield b"first"
    raise _server_error(request.decode())


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    handler = grpc.method_handlers_generic_handler(
        "test.Svc",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, **_raw),
            "Stream": grpc.unary_stream_rpc_method_handler(stream, **_raw),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    await serve_health_and_reflection(server, ["test.Svc"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("name", "code", "cls"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, E.InvalidId),
        ("toolarge", grpc.StatusCode.INVALID_ARGUMENT, E.TooLarge),
        ("missing", grpc.StatusCode.NOT_FOUND, E.NotFound),
        ("state", grpc.StatusCode.FAILED_PRECONDITION, E.InvalidState),
        ("quota", grpc.StatusCode.RESOURCE_EXHAUSTED, E.QuotaExceeded),
        ("later", grpc.StatusCode.UNIMPLEMENTED, E.Unimplemented),
    ],
)
async def test_domain_errors_map_to_status_and_back(
    channel: grpc.aio.Channel, name: str, code: grpc.StatusCode, cls: type[E.AgentsError]
) -> None:
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(name.encode())
    assert info.value.code() == code
    assert info.value.details() == str(_server_error(name))
    err = domain_error(info.value)
    assert type(err) is cls
    assert str(err) == str(_server_error(name))


async def test_invalid_argument_names_the_field(channel: grpc.aio.Channel) -> None:
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(E.InvalidId) as info:
        async with rpc_errors():
            await call(b"invalid")
    assert info.value.field == "agent_id"
    assert "agent_id" in str(info.value)
    # The google.rpc status carries a BadRequest field violation too.
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await call(b"invalid")
    md = dict(raw.value.trailing_metadata() or ())
    status = status_pb2.Status.FromString(md["grpc-status-details-bin"])
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details if d.Is(bad.DESCRIPTOR))
    assert bad.field_violations[0].field == "agent_id"


@pytest.mark.parametrize("name", ["boom", "store"])
async def test_unmapped_and_internal_errors_leak_nothing(
    channel: grpc.aio.Channel, name: str
) -> None:
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(name.encode())
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error"
    assert isinstance(domain_error(info.value), E.RpcError)


async def test_stream_error_after_items(channel: grpc.aio.Channel) -> None:
    call = channel.unary_stream("/test.Svc/Stream")
    got: list[bytes] = []
    with pytest.raises(E.NotFound):
        async with rpc_errors():
            async for item in call(b"missing"):
                got.append(item)
    assert got == [b"first"]


async def test_health_reports_serving(channel: grpc.aio.Channel) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service="test.Svc"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_client_error_is_the_real_class_with_the_grpc_error_as_cause(
    channel: grpc.aio.Channel,
) -> None:
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(E.ProviderError) as info:
        async with rpc_errors():
            await call(b"provider")
    assert info.value.what == "start machine"
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
    assert info.value.__cause__.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(E.QuotaExceeded) as quota:
        async with rpc_errors():
            await call(b"quota")
    assert quota.value.limit == 5  # a number again, as the server raised it


async def test_unmapped_status_carries_a_grpc_status_code(channel: grpc.aio.Channel) -> None:
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(E.RpcError) as info:
        async with rpc_errors():
            await call(b"boom")
    assert info.value.code is grpc.StatusCode.INTERNAL
    assert str(info.value) == "rpc INTERNAL: internal error"


async def test_most_specific_class_wins_whatever_the_table_order(
    channel: grpc.aio.Channel,
) -> None:
    # StoreError comes before its subclass StoreMisconfigured in the table.
    classes = [cls for cls, _ in STATUS_TABLE]
    assert classes.index(E.StoreError) < classes.index(E.StoreMisconfigured)
    misconfigured = E.StoreMisconfigured("s3 bucket: no such bucket")
    assert status_for(misconfigured) == grpc.StatusCode.FAILED_PRECONDITION
    call = channel.unary_unary("/test.Svc/Unary")
    with pytest.raises(E.StoreMisconfigured):
        async with rpc_errors():
            await call(b"misconfigured")
