"""The one calls-counting interceptor, in front of the error interceptor."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from shared import errors as E
from shared.call_metrics import CallsInterceptor
from shared.rpc import ErrorInterceptor

_raw: dict[str, Any] = {"request_deserializer": None, "response_serializer": None}


async def answer(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    if request == b"missing":
        raise E.NotFound("agent", "ag_x")
    return b"ok"


@pytest.fixture
async def counted() -> AsyncIterator[tuple[grpc.aio.Channel, list[tuple[str, str]]]]:
    seen: list[tuple[str, str]] = []
    counters = {
        "test.Whole": lambda m, c: seen.append((f"whole {m}", c.name)),
        "test.Some/Join": lambda m, c: seen.append((f"some {m}", c.name)),
    }
    server = grpc.aio.server(interceptors=[CallsInterceptor(counters), ErrorInterceptor()])
    for service in ("test.Whole", "test.Some"):
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(answer, **_raw) for name in ("Join", "Other")
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch, seen
    finally:
        await server.stop(None)


async def test_counts_each_listed_call_with_its_final_code(
    counted: tuple[grpc.aio.Channel, list[tuple[str, str]]],
) -> None:
    channel, seen = counted
    await channel.unary_unary("/test.Whole/Other")(b"hi")
    with pytest.raises(grpc.aio.AioRpcError):
        await channel.unary_unary("/test.Some/Join")(b"missing")
    await channel.unary_unary("/test.Some/Other")(b"hi")  # not listed: not counted
    assert seen == [("whole Other", "OK"), ("some Join", "NOT_FOUND")]


async def chunks(
    request: bytes, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    yield b"one"
    if request == b"missing":
        raise E.NotFound("segment", "s_x")
    yield b"two"


async def upload(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> bytes:
    async for chunk in requests:
        if chunk == b"bad":
            raise E.InvalidArgument("chunk", "bad")
    return b"stored"


async def test_counts_streaming_calls_once_each_at_their_end() -> None:
    seen: list[tuple[str, str]] = []
    server = grpc.aio.server(
        interceptors=[
            CallsInterceptor({"test.Stream": lambda m, c: seen.append((m, c.name))}),
            ErrorInterceptor(),
        ]
    )
    handlers = {
        "Get": grpc.unary_stream_rpc_method_handler(chunks, **_raw),
        "Put": grpc.stream_unary_rpc_method_handler(upload, **_raw),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Stream", handlers),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            get, put = ch.unary_stream("/test.Stream/Get"), ch.stream_unary("/test.Stream/Put")
            assert [c async for c in get(b"hi")] == [b"one", b"two"]
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                _ = [c async for c in get(b"missing")]
            assert missing.value.code() is grpc.StatusCode.NOT_FOUND
            assert await put(iter([b"a", b"b"])) == b"stored"
            with pytest.raises(grpc.aio.AioRpcError):
                await put(iter([b"a", b"bad"]))
    finally:
        await server.stop(None)
    assert seen == [
        ("Get", "OK"),
        ("Get", "NOT_FOUND"),
        ("Put", "OK"),
        ("Put", "INVALID_ARGUMENT"),
    ]
