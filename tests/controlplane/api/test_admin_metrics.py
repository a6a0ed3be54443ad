"""agents_cp_admin_calls_total is counted by one interceptor, with the final status."""

from __future__ import annotations

from pathlib import Path

import grpc
import grpc.aio
import pytest

from controlplane.config import ControlConfig
from controlplane.recovery.bootstrap import init_control_plane
from controlplane.server import ControlPlane
from shared.pb.control.v1 import admin_pb2, admin_pb2_grpc, link_pb2, link_pb2_grpc


async def test_admin_calls_counted_by_method_and_final_code(tmp_path: Path) -> None:
    cfg = ControlConfig(
        home=tmp_path / "home",
        store_url=str(tmp_path / "store"),
        listen="127.0.0.1:0",
        link_listen="127.0.0.1:0",
        metrics_listen="",
    ).validate()
    made = await init_control_plane(cfg)
    cp = ControlPlane(cfg)
    try:
        await cp.start()
        creds = grpc.ssl_channel_credentials((cfg.home / "ca.pem").read_bytes())
        good = (("authorization", f"Bearer {made.operator_credential}"),)
        bad = (("authorization", "Bearer nonsense"),)
        async with grpc.aio.secure_channel(f"127.0.0.1:{cp.public_port}", creds) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            await admin.ListAccounts(admin_pb2.ListAccountsRequest(), metadata=good)
            await admin.ListAccounts(admin_pb2.ListAccountsRequest(), metadata=good)
            with pytest.raises(grpc.aio.AioRpcError):
                await admin.ListAccounts(admin_pb2.ListAccountsRequest(), metadata=bad)
            with pytest.raises(grpc.aio.AioRpcError):
                await admin.GetMachine(admin_pb2.GetMachineRequest(machine_id="x"))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admin.GetAccount(
                    admin_pb2.GetAccountRequest(account_id="acct_" + "0" * 26), metadata=good
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError):
                # Nothing to retire: refused.
                await admin.RolloverCA(admin_pb2.RolloverCARequest(retire_old=True), metadata=good)
            # Not an Admin call: never counted.
            with pytest.raises(grpc.aio.AioRpcError):
                await link_pb2_grpc.MachineLinkStub(ch).Join(link_pb2.JoinRequest(token="x"))

        def calls(method: str, code: str) -> float:
            value = cp.registry.get_sample_value(
                "agents_cp_admin_calls_total", {"method": method, "code": code}
            )
            return value or 0.0

        assert calls("ListAccounts", "OK") == 2
        assert calls("ListAccounts", "UNAUTHENTICATED") == 1
        assert calls("GetMachine", "UNAUTHENTICATED") == 1  # no credential at all
        assert calls("GetAccount", "NOT_FOUND") == 1
        assert calls("RolloverCA", "FAILED_PRECONDITION") == 1
        methods = {
            s.labels["method"]
            for m in cp.registry.collect()
            if m.name == "agents_cp_admin_calls"
            for s in m.samples
        }
        assert methods == {"ListAccounts", "GetMachine", "GetAccount", "RolloverCA"}
    finally:
        await cp.stop(0)
