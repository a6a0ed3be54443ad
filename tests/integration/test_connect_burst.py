"""A fleet connecting at once gets in at the first try.

A real control plane (folder store); 200 machines joined with the real join
code (one token, 16 at a time), then their real links opened together, each its
own mutual-TLS connection: every link is up within the deadline and none had
to try again (before, a burst like this met welcomes later than the link's
handshake timeout and store calls past their deadline, and retried).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controlplane.cli.client import AdminClient
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from tests.helpers.control_proc import ControlProc, control_plane
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

FLEET = 200
JOINS_AT_ONCE = 16
CONNECT_DEADLINE = 60.0


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProc]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    with control_plane(
        tmp_path / "cp-home",
        str(tmp_path / "store"),
        env=env,
        init_args=["--heartbeat-interval", "1"],
    ) as running:
        yield running


class _Failures(logging.Handler):
    """The links' failed connect attempts (each logs one warning)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


async def test_two_hundred_machines_connect_at_once_without_a_retry(
    cp: ControlProc, tmp_path: Path
) -> None:
    async with AdminClient(cp.public, cp.ca_pem, cp.operator, timeout=30) as client:
        account = (await client.create_account(1, "burst")).account.account_id
        token = await client.create_token(account, ttl_seconds=3600, max_uses=FLEET)
        joining = asyncio.Semaphore(JOINS_AT_ONCE)

        async def join(i: int) -> None:
            async with joining:
                await join_control_plane(
                    data_dir=tmp_path / f"m{i}",
                    address=token.join_address,
                    token=token.token_value,
                    ca_hash=token.ca_hash,
                    name=f"burst-{i}",
                )

        await asyncio.gather(*(join(i) for i in range(FLEET)))

        async def no_agents() -> int:
            return 0

        registries = [CollectorRegistry() for _ in range(FLEET)]
        links = [
            ControlLink(
                data_dir=tmp_path / f"m{i}",
                agent_count=no_agents,
                version="burst",
                registry=registries[i],
            )
            for i in range(FLEET)
        ]
        failures = _Failures()
        log = logging.getLogger("machine.link.connection")
        log.addHandler(failures)
        try:
            for link in links:
                await link.__aenter__()
            await apoll_until(
                lambda: all(link.state is LinkState.CONNECTED for link in links),
                deadline=CONNECT_DEADLINE,
                what=f"{FLEET} links up",
                step=0.1,
            )
            retries = sum(
                r.get_sample_value("agents_machine_link_reconnects_total") or 0.0
                for r in registries
            )
            listed = await client.list_machines(account)
        finally:
            log.removeHandler(failures)
            await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
    assert retries == 0, failures.seen[:5]
    assert [m for m in failures.seen if "failed (attempt" in m] == []
    assert sum(1 for m in listed if m.online) == FLEET
