"""The store causes: each RPC's calls run under its cause, and the list of causes,
the code that names them and docs/metrics.md agree."""

from __future__ import annotations

import ast
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from controlplane.api.causes import CauseInterceptor, rpc_causes
from controlplane.metrics import STORE_CAUSES
from shared.store.causes import OTHER, current_cause

ROOT = Path(__file__).resolve().parents[3]
_raw: dict[str, Any] = {"request_deserializer": None, "response_serializer": None}


async def _unary(request: bytes, context: Any) -> bytes:
    return current_cause().encode()


async def _stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for _ in requests:
        yield current_cause().encode()


async def test_each_call_runs_under_its_methods_cause() -> None:
    server = grpc.aio.server(interceptors=[CauseInterceptor(rpc_causes("t.Admin", "t.Link"))])
    for service in ("t.Admin", "t.Link", "t.Health"):
        handlers = {
            "ListMachines": grpc.unary_unary_rpc_method_handler(_unary, **_raw),
            "SendPrompt": grpc.unary_unary_rpc_method_handler(_unary, **_raw),
            "Join": grpc.unary_unary_rpc_method_handler(_unary, **_raw),
            "PutManifest": grpc.unary_unary_rpc_method_handler(_unary, **_raw),
            "Connect": grpc.stream_stream_rpc_method_handler(_stream, **_raw),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:

            async def unary(path: str) -> str:
                return bytes(await ch.unary_unary(path)(b"")).decode()

            assert await unary("/t.Admin/ListMachines") == "admin"
            assert await unary("/t.Admin/SendPrompt") == "queue"
            assert await unary("/t.Link/Join") == "join"
            assert await unary("/t.Link/PutManifest") == "backups"
            assert await unary("/t.Health/Join") == OTHER  # not a listed service
            call = ch.stream_stream("/t.Link/Connect")()
            await call.write(b"hello")
            assert bytes(await call.read()).decode() == "link"
            await call.done_writing()
            # One call's cause never reaches the next.
            assert await unary("/t.Health/ListMachines") == OTHER
    finally:
        await server.stop(None)


def _named_causes() -> dict[str, str]:
    """Every literal cause the control plane's code names -> where."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "controlplane").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("store_cause", "set_cause")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found[node.args[0].value] = f"{path.relative_to(ROOT)}:{node.lineno}"
    for cause in rpc_causes("a", "l").values():
        found.setdefault(cause, "controlplane/api/causes.py")
    return found


def test_every_named_cause_is_listed_and_every_listed_cause_is_named() -> None:
    named = _named_causes()
    assert {c: where for c, where in named.items() if c not in STORE_CAUSES} == {}
    assert STORE_CAUSES - {OTHER} - set(named) == set()


def test_every_cause_is_documented() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert "agents_cp_store_requests_total" in page
    section = page[page.index("### Store requests by cause") :]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert documented >= STORE_CAUSES, STORE_CAUSES - documented
