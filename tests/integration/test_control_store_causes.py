"""Every store request of a running control plane is counted under a named cause.

A real control plane in this process (folder store), an account and a token
made over the Admin API, a machine joined with the real join code and its real
link: then ``agents_cp_store_requests_total`` names each piece of that work,
heartbeats cost no store request, and nothing is left as ``other``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controlplane.cli.client import AdminClient
from controlplane.config import ControlConfig
from controlplane.metrics import STORE_CAUSES
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.server import ControlPlane
from machine.link.connection import ControlLink, LinkState
from machine.link.join import join_control_plane
from tests.helpers.poll import apoll_until

pytestmark = pytest.mark.integration

HEARTBEAT = 0.2


def _by_cause(registry: CollectorRegistry) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == "agents_cp_store_requests_total":
                out[s.labels["cause"]] = out.get(s.labels["cause"], 0.0) + s.value
    return out


def _operations(registry: CollectorRegistry) -> float:
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == "agents_cp_store_operations_total"
    )


async def test_each_kind_of_work_names_its_store_requests(tmp_path: Path) -> None:
    cfg = ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
        heartbeat_interval=HEARTBEAT,
    ).validate()
    made = await init_control_plane(cfg)
    ca_pem = (cfg.home / "ca.pem").read_bytes()
    async with ControlPlane(cfg) as cp:
        address = f"127.0.0.1:{cp.public_port}"
        async with AdminClient(address, ca_pem, made.operator_credential) as admin:
            account = (await admin.create_account(1, "causes")).account.account_id
            token = await admin.create_token(account)
            await join_control_plane(
                data_dir=tmp_path / "m",
                address=token.join_address,
                token=token.token_value,
                ca_hash=token.ca_hash,
                name="m",
            )
            beats = CollectorRegistry()

            async def no_agents() -> int:
                return 0

            async with ControlLink(
                data_dir=tmp_path / "m", agent_count=no_agents, version="t", registry=beats
            ) as link:
                await link.wait_for_state(LinkState.CONNECTED, timeout=30)
                before = _by_cause(cp.registry)
                sent = beats.get_sample_value("agents_machine_link_heartbeats_total") or 0.0

                def beaten() -> bool:
                    now = beats.get_sample_value("agents_machine_link_heartbeats_total") or 0.0
                    return now >= sent + 5

                await apoll_until(beaten, deadline=30, what="five heartbeats")
                during = _by_cause(cp.registry)
                listed = await admin.list_machines(account)
                assert [m.online for m in listed] == [True]

    causes = _by_cause(cp.registry)
    assert set(causes) <= STORE_CAUSES
    for cause in ("startup", "admin", "join", "link", "self_check"):
        assert causes.get(cause, 0) > 0, (cause, causes)
    # A heartbeat's handling reads and writes nothing (presence writes are their own).
    assert during.get("heartbeat", 0) == before.get("heartbeat", 0) == 0, during
    # Nothing the daemon did went unnamed, and every operation was counted once.
    assert causes.get("other", 0) == 0, causes
    assert sum(causes.values()) == _operations(cp.registry)
