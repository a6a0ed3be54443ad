"""Machine providers: settings checks, a real local command, EC2 on moto's server."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import boto3
import pytest

from controlplane.queue.providers import ProviderState, open_provider, parse_settings
from controlplane.queue.providers.base import Ec2Settings, LocalSettings
from shared.errors import InvalidArgument, ProviderError, ProviderUnavailable
from tests.helpers.moto_server import free_port, moto_server
from tests.helpers.poll import apoll_until

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


async def _until(check: Callable[[], Awaitable[bool]], deadline: float = 10.0) -> None:
    fail = AssertionError("condition not met within the deadline")
    await apoll_until(check, deadline=deadline, what="condition", step=0.05, fail=lambda: fail)


# -- settings ------------------------------------------------------------------


def test_local_settings_parsed() -> None:
    got = parse_settings("local", {"command": ["agents-machine", "serve"], "cwd": "/srv"})
    assert got == LocalSettings(("agents-machine", "serve"), "/srv", {})


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("docker", {}, "provider: 'docker' is not one of local, ec2"),
        ("local", [], "settings: must be a JSON object"),
        ("local", {"command": []}, "settings.command"),
        ("local", {"command": ["x", ""]}, "settings.command"),
        ("local", {"command": ["x\x00y"]}, "settings.command"),
        ("local", {"command": ["x"], "cwd": "rel/dir"}, "settings.cwd: must be an absolute"),
        ("local", {"command": ["x"], "env": {"lower": "1"}}, "settings.env"),
        ("local", {"command": ["x"], "shell": True}, "settings.shell: unknown setting"),
        ("ec2", {"instance_id": "i-1", "region": "us-east-1"}, "settings.instance_id"),
        ("ec2", {"instance_id": "i-0123456789abcdef0", "region": "mars"}, "settings.region"),
        (
            "ec2",
            {"instance_id": "i-0123456789abcdef0", "region": "us-east-1", "access_key_id": "AKIA"},
            "settings.access_key_id",
        ),
        (
            "ec2",
            {
                "instance_id": "i-0123456789abcdef0",
                "region": "us-east-1",
                "access_key_id": "AKIAIOSFODNN7EXAMPLE",
            },
            "go together",
        ),
        (
            "ec2",
            {
                "instance_id": "i-0123456789abcdef0",
                "region": "us-east-1",
                "endpoint_url": "ftp://x",
            },
            "settings.endpoint_url",
        ),
    ],
)
def test_bad_settings_refused_naming_the_field(name: str, data: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_settings(name, data)


def test_ec2_secret_is_kept_out_of_listings_and_reprs() -> None:
    s = parse_settings(
        "ec2",
        {
            "instance_id": "i-0123456789abcdef0",
            "region": "eu-central-1",
            "access_key_id": "AKIAIOSFODNN7EXAMPLE",
            "secret_access_key": SECRET,
        },
    )
    assert isinstance(s, Ec2Settings)
    assert SECRET not in json.dumps(s.public())
    assert SECRET not in repr(s)
    assert s.stored()["secret_access_key"] == SECRET
    assert parse_settings("ec2", s.stored()) == s, "stored settings parse back"


# -- local ---------------------------------------------------------------------


async def test_local_provider_runs_watches_and_is_idempotent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    out, stop = tmp_path / "env.json", tmp_path / "stop"
    script = (
        "import json, os, pathlib, sys, time\n"
        f"pathlib.Path({str(out)!r}).write_text(json.dumps(dict(os.environ)))\n"
        f"while not pathlib.Path({str(stop)!r}).exists(): time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    settings = parse_settings(
        "local", {"command": [sys.executable, "-c", script], "env": {"AGENTS_DATA_DIR": "/d"}}
    )
    provider = open_provider(settings, log_dir=tmp_path / "logs")
    try:
        assert (await provider.status()).state is ProviderState.STOPPED
        first = await provider.start()
        assert first.state in (ProviderState.STARTING, ProviderState.RUNNING)
        again = await provider.start()
        assert again.state is ProviderState.RUNNING and again.detail == first.detail

        async def wrote_env() -> bool:
            return out.exists() and out.stat().st_size > 0

        await _until(wrote_env)
        env = json.loads(out.read_text())
        assert env["AGENTS_DATA_DIR"] == "/d"
        assert "AWS_SECRET_ACCESS_KEY" not in env, "the control plane's secrets stay with it"
        stop.write_text("")

        async def ended() -> bool:
            return (await provider.status()).state is ProviderState.FAILED

        await _until(ended)
        assert (await provider.status()).detail == "exited with 3"
    finally:
        stop.write_text("")
        await provider.close()


async def test_local_provider_missing_command_is_a_clear_error(tmp_path: Path) -> None:
    provider = open_provider(
        LocalSettings(("/nonexistent/agents-machine", "serve")), log_dir=tmp_path
    )
    with pytest.raises(ProviderError, match="provider local: cannot run '/nonexistent"):
        await provider.start()


# -- ec2 -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ec2_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


def _stopped_instance(endpoint: str) -> str:
    ec2 = boto3.client(
        "ec2",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
        aws_secret_access_key="x",
    )
    reply = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)
    instance = str(reply["Instances"][0]["InstanceId"])
    ec2.stop_instances(InstanceIds=[instance])
    return instance


def _ec2(endpoint: str, instance: str) -> Ec2Settings:
    return Ec2Settings(instance, "us-east-1", endpoint, "AKIAIOSFODNN7EXAMPLE", SECRET)


async def test_ec2_starts_a_stopped_instance(ec2_endpoint: str, tmp_path: Path) -> None:
    instance = _stopped_instance(ec2_endpoint)
    provider = open_provider(_ec2(ec2_endpoint, instance), log_dir=tmp_path)
    try:
        assert (await provider.status()).state is ProviderState.STOPPED
        started = await provider.start()
        assert started.state in (ProviderState.STARTING, ProviderState.RUNNING)
        assert (await provider.status()).state is ProviderState.RUNNING
        # Asking again is harmless (moto answers "pending", AWS "running").
        again = await provider.start()
        assert again.state in (ProviderState.STARTING, ProviderState.RUNNING)
        assert (await provider.status()).state is ProviderState.RUNNING
    finally:
        await provider.close()


async def test_ec2_unknown_instance(ec2_endpoint: str, tmp_path: Path) -> None:
    provider = open_provider(_ec2(ec2_endpoint, "i-0123456789abcdef0"), log_dir=tmp_path)
    try:
        with pytest.raises(ProviderError, match="i-0123456789abcdef0.*no such instance"):
            await provider.start()
    finally:
        await provider.close()


async def test_ec2_bad_credentials_named_without_the_secret(tmp_path: Path) -> None:
    with moto_server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        provider = open_provider(_ec2(endpoint, "i-0123456789abcdef0"), log_dir=tmp_path)
        try:
            with pytest.raises(ProviderError, match="refused the credentials") as err:
                await provider.start()
            assert SECRET not in str(err.value)
        finally:
            await provider.close()


async def test_ec2_unreachable_is_transient(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    provider = open_provider(_ec2(endpoint, "i-0123456789abcdef0"), log_dir=tmp_path)
    try:
        with pytest.raises(ProviderUnavailable, match="cannot reach EC2"):
            await provider.status()
    finally:
        await provider.close()
