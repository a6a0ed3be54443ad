"""Several ``serve --cluster`` replicas of one home, on one bucket and one NATS.

``serve_replicas(...)`` runs ``agents-control init`` once, copies the home
folder for each further replica (a replica's home is a copy of the first's:
docs/controlplane.md "Replicas"; its ports are 0, so each binds its own),
starts every replica at once (so all join the first epoch) and yields them
once each serves. At teardown every replica still running is sent SIGTERM at
once (they drain together), then each is waited for with a deadline and
killed past it. The caller owns NATS (tests stop and start it).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tests.helpers.control_proc import ControlProc, run_init, s3_env, start_serve, wait_serve
from tests.helpers.nats_proc import NatsProc

__all__ = ["add_replica", "serve_replicas"]

#: Seconds a replica has to drain at teardown before it is killed.
STOP_DEADLINE = 15.0


@contextlib.contextmanager
def serve_replicas(
    tmp_path: Path,
    s3_bucket: str,
    moto_endpoint: str,
    nats: NatsProc,
    count: int,
    *,
    heartbeat: float,
    env: Mapping[str, str] | None = None,
    config: Sequence[str] = (),
) -> Iterator[list[ControlProc]]:
    """``count`` replicas (homes ``tmp_path/home0`` …), serving; ``env`` is added to
    the moto environment, ``config`` lines to the first home's config.toml (before
    it is copied)."""
    first = run_init(
        tmp_path / "home0",
        f"s3://{s3_bucket}/cp",
        {**s3_env(moto_endpoint), **(env or {})},
        ["--heartbeat-interval", str(heartbeat)],
    )
    if config:
        with (first.home / "config.toml").open("a") as f:
            f.writelines(f"{line}\n" for line in config)
    procs = [first]
    for _ in range(1, count):
        procs.append(_copy(procs))
    try:
        for cp in procs:  # together: the first epoch is joined by all
            start_serve(cp, ["--cluster", nats.url], wait=False)
        for cp in procs:
            wait_serve(cp)
        yield procs
    finally:
        for cp in procs:  # all drain at once
            if cp.process is not None and cp.process.poll() is None:
                cp.process.send_signal(signal.SIGTERM)
        for cp in procs:
            if cp.process is not None:
                try:
                    cp.process.wait(timeout=STOP_DEADLINE)
                except subprocess.TimeoutExpired:
                    cp.process.kill()
                    cp.process.wait(timeout=5)


def add_replica(procs: list[ControlProc], nats: NatsProc) -> ControlProc:
    """One more replica of the running ones' home, serving once this returns;
    appended to ``procs`` (the list :func:`serve_replicas` yielded), so its
    teardown stops it too."""
    cp = _copy(procs)
    procs.append(cp)
    start_serve(cp, ["--cluster", nats.url])
    return cp


def _copy(procs: list[ControlProc]) -> ControlProc:
    """A copy of the first replica's home, beside it (``home<N>``)."""
    first = procs[0]
    home = first.home.parent / f"home{len(procs)}"
    shutil.copytree(first.home, home, ignore=shutil.ignore_patterns("serve.*", "*.log"))
    return ControlProc(home, first.env, first.operator, first.ca_hash)
