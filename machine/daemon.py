"""The machine daemon: the gRPC server on the data folder's Unix socket.

:func:`serve` runs until SIGTERM/SIGINT. The first signal drains: no new
RPCs, runs get ``shutdown_grace_seconds`` to end, then are interrupted (runs
waiting for a person stay waiting). A second signal interrupts at once.

Under systemd (``Type=notify``, shared.sd_notify): ``STATUS=`` lines while it
starts; ``READY=1`` once the database is open and the socket (and the TCP
listener, when configured) answers; ``WATCHDOG=1`` from the event loop while it
serves; ``STOPPING=1`` when the drain begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import grpc.aio

from machine.api.local_auth import TOKEN_FILE, BearerTokenInterceptor, load_or_create_token
from machine.api.servicer import SERVICE_NAME, MachineServicer
from machine.app import Machine, open_machine
from machine.config import MachineConfig, parse_hostport
from machine.link import identity
from machine.link.connection import ControlLink
from machine.link.deliveries import DeliveryHandler, crash_after
from machine.metrics import MachineMetrics
from machine.version import machine_version
from shared.call_metrics import CallsInterceptor
from shared.errors import InvalidState
from shared.metrics import MetricsServer, new_registry, start_metrics_server
from shared.pb.machine.v1 import machine_pb2_grpc as pb_grpc
from shared.rpc import NO_REUSEPORT, ErrorInterceptor, serve_health_and_reflection
from shared.sd_notify import Notifier

__all__ = ["LOCK_FILE", "HeldDataDir", "ServeInfo", "hold_data_dir", "serve"]

logger = logging.getLogger(__name__)

_STREAM_FLUSH_SECONDS = 2.0


@dataclass(frozen=True)
class ServeInfo:
    """Where a started daemon listens (passed to ``serve``'s ``ready`` callback)."""

    socket: Path
    tcp_port: int | None
    metrics_port: int | None
    machine_id: str


#: The data folder's lock file: flock'd while a process uses the folder (docs/machine.md).
LOCK_FILE: Final = "machine.lock"


@dataclass(frozen=True)
class HeldDataDir:
    """This process holds ``data_dir``'s lock (:func:`hold_data_dir`): a ``serve``
    given it serves under that lock instead of taking its own."""

    data_dir: Path


def _holder_pid(fd: int) -> int | None:
    """The pid the lock's holder wrote into the file, when it wrote one."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path, what: str = "serve", then: str = "") -> Iterator[HeldDataDir]:
    """Hold an exclusive lock so two processes never share a data folder.

    The holder writes its pid into the lock file, so that the one refused can
    name it. InvalidState ("``what`` ``data_dir``: another agents-machine (pid N)
    is already using this data folder[; ``then``]") when another process holds it.
    """
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_pid(fd)
            raise InvalidState(
                f"{what} {data_dir}",
                f"another agents-machine{f' (pid {pid})' if pid else ''} is already using"
                " this data folder" + (f"; {then}" if then else ""),
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield HeldDataDir(data_dir)
    finally:
        os.close(fd)


def hold_data_dir(
    data_dir: Path, what: str, then: str = ""
) -> contextlib.AbstractContextManager[HeldDataDir]:
    """The daemon's data-folder lock, for a command that must not run beside a daemon
    (``what`` and ``then``: the refusal's operation and what to do, see
    :func:`_data_dir_lock`). The folder must exist."""
    return _data_dir_lock(data_dir, what, then)


def _control_link(
    config: MachineConfig, machine: Machine, metrics: MachineMetrics
) -> contextlib.AbstractAsyncContextManager[ControlLink | None]:
    """The control-plane link while the daemon serves; nothing for a stand-alone machine."""
    if not identity.is_joined(config.data_dir):
        return contextlib.nullcontext()
    keys = identity.load_keys(config.data_dir)
    return ControlLink(
        data_dir=config.data_dir,
        agent_count=machine.agent_count,
        roster=machine.agent_roster,
        version=machine_version(),
        on_delivery=DeliveryHandler(
            machine.runs, keys.box, after_store=crash_after(config.crash_after_deliveries)
        ),
        next_fire=lambda: machine.scheduler.next_fire_at if machine.scheduler else None,
        registry=metrics.registry,
    )


def _return_large_buffers_to_the_os() -> None:
    """Have glibc serve every allocation over 128 KiB with its own mapping.

    By default glibc raises that threshold after the first large free, so the
    buffers of large events then come from the heap, and a burst of streams
    leaves the daemon's RSS high long after they end. With a fixed threshold a
    freed event buffer is returned to the system at once. Other C libraries:
    nothing to do.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold = -3  # from <malloc.h>
    if not mallopt(m_mmap_threshold, 128 * 1024):
        logger.debug("mallopt(M_MMAP_THRESHOLD) was refused")


def _prepare_socket(path: Path) -> None:
    # The data-folder lock proves no daemon owns a leftover socket: remove it.
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@contextlib.asynccontextmanager
async def _metrics(config: MachineConfig, metrics: MachineMetrics) -> AsyncIterator[int | None]:
    if config.metrics_address is None:
        yield None
        return
    host, port = parse_hostport(config.metrics_address, "metrics_address")
    server: MetricsServer = await asyncio.to_thread(
        start_metrics_server, metrics.registry, host, port
    )
    try:
        yield server.port
    finally:
        await asyncio.to_thread(server.close)


async def serve(
    config: MachineConfig,
    *,
    ready: Callable[[ServeInfo], None] | None = None,
    stop: asyncio.Event | None = None,
    first: Callable[[], None] | None = None,
    held: HeldDataDir | None = None,
) -> None:
    """Run the daemon until SIGTERM/SIGINT (or ``stop`` is set).

    ``ready`` is called once the server accepts connections, with where it
    listens; ``first`` once this process holds the data folder, before anything
    opens (the CLI's first-start steps). ``held``: the caller holds the data
    folder already (``join`` serves under the lock it took before the join).
    Signal handlers are installed only in the main thread.
    """
    config.validate()
    if held is not None and held.data_dir != config.data_dir:
        raise ValueError(f"serve {config.data_dir}: the lock held is {held.data_dir}'s")
    _return_large_buffers_to_the_os()
    stop = stop or asyncio.Event()
    metrics = MachineMetrics(new_registry())
    notifier = Notifier(config.notify)
    loop = asyncio.get_running_loop()
    signals_seen = 0
    machine_ref: list[Machine] = []

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            logger.info("stopping: draining (send the signal again to stop at once)")
            stop.set()
        else:
            logger.warning("second stop signal: interrupting runs now")
            notifier.status("stopping: interrupting runs now (second stop signal)")
            for m in machine_ref:
                m.runs.interrupt_now()

    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (RuntimeError, ValueError):  # not the main thread
            break
    try:
        from shared.atomic import ensure_private_dir

        ensure_private_dir(config.data_dir)
        with contextlib.nullcontext() if held else _data_dir_lock(config.data_dir):
            if identity.restore_pending(config.data_dir):
                # Empty, the machine would back up nothing and in time prune the
                # backup still to restore (keep-newest retention).
                raise InvalidState(
                    f"serve {config.data_dir}",
                    "this machine's repair join committed and the restore of its backup did"
                    " not finish: run the same `agents-machine join` command again (the token"
                    " is not used again), with --no-restore to start without the backup",
                )
            if first is not None:
                first()
            notifier.status(f"starting: opening {config.db_path}")
            async with (
                open_machine(config, metrics=metrics) as machine,
                _metrics(config, metrics) as metrics_port,
            ):
                machine_ref.append(machine)
                notifier.status("starting: opening the listeners")
                await _serve_grpc(config, machine, metrics, metrics_port, ready, stop, notifier)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _serve_grpc(
    config: MachineConfig,
    machine: Machine,
    metrics: MachineMetrics,
    metrics_port: int | None,
    ready: Callable[[ServeInfo], None] | None,
    stop: asyncio.Event,
    notifier: Notifier,
) -> None:
    max_message = max(4 * 1024 * 1024, config.prompt_limit + 64 * 1024)
    servicer = MachineServicer(machine)

    async def make_server(*interceptors: Any) -> tuple[grpc.aio.Server, Any]:
        server = grpc.aio.server(
            # Counting first: it wraps the error mapping and the token check, and
            # so sees the final code of every call (a refused one included).
            interceptors=[
                CallsInterceptor(metrics.call_counters(SERVICE_NAME)),
                *interceptors,
                ErrorInterceptor(),
            ],
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
                NO_REUSEPORT,
            ],
        )
        pb_grpc.add_MachineServiceServicer_to_server(servicer, server)
        return server, await serve_health_and_reflection(server, [SERVICE_NAME])

    server, health = await make_server()
    servers = [server]
    healths = [health]
    socket = config.socket
    _prepare_socket(socket)
    server.add_insecure_port(f"unix://{socket}")
    tcp_port: int | None = None
    if config.tcp_address is not None:
        # TCP reaches every local user: it gets its own server that demands the
        # data folder's token (the socket's file mode does that job for unix://).
        token = await asyncio.to_thread(load_or_create_token, config.data_dir)
        tcp_server, tcp_health = await make_server(
            BearerTokenInterceptor(token, config.data_dir / TOKEN_FILE)
        )
        host, port = parse_hostport(config.tcp_address, "tcp_address")
        tcp_port = tcp_server.add_insecure_port(f"{host}:{port}")
        servers.append(tcp_server)
        healths.append(tcp_health)
    for srv in servers:
        await srv.start()
    os.chmod(socket, 0o600)
    logger.info("agents-machine serving on unix://%s", socket)
    try:
        async with _control_link(config, machine, metrics):
            # Every listener started above: a client told "ready" gets answers.
            notifier.ready(_serving_status(socket, tcp_port))
            if ready is not None:
                ready(ServeInfo(socket, tcp_port, metrics_port, machine.machine_id))
            # Watchdog pings from READY to the end of the drain.
            async with notifier.pinging():
                await stop.wait()
                notifier.stopping(
                    f"stopping: draining, runs get {config.shutdown_grace_seconds:g} s to end"
                )
                for h in healths:
                    await h.enter_graceful_shutdown()
                # Let runs end (or interrupt them) while streams can still carry their
                # last events, then stop the server.
                await machine.runs.close(config.shutdown_grace_seconds)
    finally:
        await asyncio.gather(*(srv.stop(_STREAM_FLUSH_SECONDS) for srv in servers))
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()
        logger.info("agents-machine stopped")


def _serving_status(socket: Path, tcp_port: int | None) -> str:
    return f"serving on unix://{socket}" + (f" and TCP port {tcp_port}" if tcp_port else "")
