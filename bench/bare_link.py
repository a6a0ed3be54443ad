"""The floor under a machine link: a bare gRPC mutual-TLS stream server.

``bench/connect.py`` measures the control plane's memory per link and CPU per
heartbeat against this baseline, in the same run and with the same number of
streams: a server with the control plane's gRPC options and a TLS listener that
requires a client certificate, whose one handler reads the machine's messages
and does nothing else; clients with a certificate each, sending hello, then a
heartbeat every interval. What the control plane costs beyond it is ours; what
it costs is gRPC's and BoringSSL's (per connection: TLS buffers, HTTP/2). The
heartbeats are spread over the interval, as a fleet's are: beats that arrive
together cost a server much less each than beats that arrive one by one.

The server runs in its own process (``python -m bench.bare_link --serve CONFIG``),
so its RSS and CPU are its own, as the control plane's are.

Alone, it measures the floor with other server options, to see what a gRPC
option saves before the control plane takes it up::

    .venv/bin/python -m bench.bare_link --streams 500 --option grpc.enable_channelz=0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import psutil

from controlplane.server import LINK_SERVICE, SERVER_OPTIONS
from shared import tls
from shared.entry import GRPC_EXPERIMENTS
from shared.pb.control.v1 import link_pb2

__all__ = ["BareFigures", "ServerOption", "measure_bare"]

#: A gRPC server option (channel argument): name and value.
ServerOption = tuple[str, int | str]

_CONNECT = f"/{LINK_SERVICE}/Connect"
#: What a machine's channel sets that changes the wire (machine/link/client.py).
_CLIENT_OPTIONS = (("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000))


@dataclass(frozen=True)
class BareFigures:
    """The bare server's cost of ``streams`` links."""

    streams: int
    rss_per_stream_kib: float
    us_per_heartbeat: float


def _serve(config: Path) -> None:
    """The server process: serve until killed; print the port once listening."""
    c = json.loads(config.read_text())

    async def connect(
        requests: AsyncIterator[link_pb2.MachineMessage], context: Any
    ) -> AsyncIterator[link_pb2.ControlMessage]:
        async for _ in requests:
            pass
        return
        yield  # an async generator, as the real Connect

    async def run() -> None:
        # The ones being tried, then the control plane's: of two options of one
        # name, gRPC takes the first.
        options = [*(tuple(o) for o in c["options"]), *SERVER_OPTIONS]
        server = grpc.aio.server(options=options)
        handler = grpc.stream_stream_rpc_method_handler(
            connect,
            request_deserializer=link_pb2.MachineMessage.FromString,
            response_serializer=link_pb2.ControlMessage.SerializeToString,
        )
        service = grpc.method_handlers_generic_handler(LINK_SERVICE, {"Connect": handler})
        server.add_generic_rpc_handlers((service,))
        creds = grpc.ssl_server_credentials(
            [(c["key"].encode(), c["chain"].encode())],
            root_certificates=c["ca"].encode(),
            require_client_auth=True,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


@contextlib.asynccontextmanager
async def _server(
    tmp: Path, ca: tls.CertKey, options: Sequence[ServerOption]
) -> AsyncIterator[tuple[int, psutil.Process]]:
    issued = tls.issue_server_cert(ca)
    config = tmp / "bare.json"
    config.write_text(
        json.dumps(
            {
                "key": issued.key_pem.decode(),
                "chain": (issued.cert_pem + ca.cert_pem).decode(),
                "ca": ca.cert_pem.decode(),
                "options": list(options),
            }
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.bare_link", "--serve", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        # gRPC as the control plane runs it (its console script sets this).
        env={**os.environ, "GRPC_EXPERIMENTS": GRPC_EXPERIMENTS},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        yield int(line), psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


async def measure_bare(
    streams: int, heartbeat: float, window: float, options: Sequence[ServerOption] = ()
) -> BareFigures:
    """Open ``streams`` links to a bare server (``options`` added to the control
    plane's); its RSS growth per link, and its CPU per heartbeat over ``window``
    seconds (figures as bench/connect.py takes ours)."""
    ca = tls.make_ca()
    lifetime = dt.timedelta(days=1)
    certs = []
    for i in range(streams):
        key = tls.new_tls_key()
        issued = tls.sign_client_csr(
            ca,
            tls.build_csr(key),
            account_id="acct_" + "0" * 26,
            machine_id=f"mc_{i:026d}",
            lifetime=lifetime,
        )
        certs.append((tls.private_key_pem(key), issued.cert_pem))
    beats = 0
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as tmp_name:
        async with _server(Path(tmp_name), ca, options) as (port, server):
            rss_before = server.memory_info().rss
            channels = [
                grpc.aio.secure_channel(
                    f"127.0.0.1:{port}",
                    grpc.ssl_channel_credentials(ca.cert_pem, key_pem, cert_pem),
                    options=_CLIENT_OPTIONS,
                )
                for key_pem, cert_pem in certs
            ]
            calls = [
                ch.stream_stream(
                    _CONNECT,
                    request_serializer=link_pb2.MachineMessage.SerializeToString,
                    response_deserializer=link_pb2.ControlMessage.FromString,
                )()  # type: ignore[call-arg]  # driven by write(); the stubs lack that form
                for ch in channels
            ]

            async def beat(call: Any, phase: float) -> None:
                nonlocal beats
                await call.write(link_pb2.MachineMessage(hello=link_pb2.Hello(version="bare")))
                # On a grid, as machine.link.heartbeats does, each link at its own
                # point of the interval: a fleet's links came up at different times.
                # (Beats that arrive together cost the server much less each.)
                next_at = time.monotonic() + heartbeat * (1 + phase)
                while True:
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    next_at += heartbeat
                    await call.write(link_pb2.MachineMessage(heartbeat=link_pb2.Heartbeat()))
                    beats += 1

            tasks = [asyncio.create_task(beat(call, i / streams)) for i, call in enumerate(calls)]
            try:
                await asyncio.sleep(2 + 2 * heartbeat)  # the bench's own pace: as for ours
                rss_after = server.memory_info().rss
                cpu0, beats0 = sum(server.cpu_times()[:2]), beats
                await asyncio.sleep(window)
                cpu1, beats1 = sum(server.cpu_times()[:2]), beats
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.gather(*(ch.close(None) for ch in channels))
    heard = beats1 - beats0
    return BareFigures(
        streams=streams,
        rss_per_stream_kib=(rss_after - rss_before) / streams / 1024,
        us_per_heartbeat=(cpu1 - cpu0) / heard * 1e6 if heard else float("nan"),
    )


def _option(text: str) -> ServerOption:
    """``NAME=VALUE`` (an integer value, or else a string)."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("grpc."):
        raise argparse.ArgumentTypeError(f"expected grpc.NAME=VALUE, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The bare gRPC mutual-TLS link server's cost.")
    parser.add_argument("--serve", type=Path, metavar="CONFIG", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=500, help="concurrent streams")
    parser.add_argument("--window", type=float, default=10.0, help="CPU window in seconds")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="grpc.NAME=VALUE",
        help="a server option added to the control plane's (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
        return 0
    if not 1 <= args.streams <= 5000 or not 1 <= args.window <= 120:
        parser.error("--streams 1..5000, --window 1..120")
    from bench.connect import raise_fd_limit  # bench.connect imports this module

    raise_fd_limit()
    f = asyncio.run(measure_bare(args.streams, args.heartbeat, args.window, args.option))
    added = " ".join(f"{n}={v}" for n, v in args.option) or "none"
    print(
        f"bare, {f.streams} streams (options added: {added}): "
        f"{f.rss_per_stream_kib:.1f} KiB per stream, {f.us_per_heartbeat:.0f} us per heartbeat"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
