"""deploy/compose.yaml as a file: the stack its header describes, started in that
order, with nothing compose would fill in from the host unasked, each daemon's
one metrics port, and an image that installs this checkout. Running its
commands is tests/integration/test_compose.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from controlplane.config import DEFAULT_METRICS_LISTEN
from machine.config import SERVICE_METRICS_ADDRESS
from tests.helpers.compose import COMPOSE, interpolate, load_compose, one_shots, start_order

DEPLOY = COMPOSE.parent


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    loaded: dict[str, Any] = load_compose()["services"]
    return loaded


def _script(services: dict[str, Any], name: str) -> str:
    """A service's command as one text (the ``sh -c`` script is its last word)."""
    return " ".join(str(word) for word in services[name]["command"])


def test_services_start_in_the_order_the_header_gives(services: dict[str, Any]) -> None:
    order = ["s3", "bucket", "init", "control", "enroll", "machine"]
    assert start_order(services) == order
    assert one_shots(services) == {"bucket", "init", "enroll"}
    header = COMPOSE.read_text().split("\nx-agents:", 1)[0]
    listed = re.findall(r"^#   (\w+) {2,}", header, re.M)
    assert listed == order


def test_every_dollar_is_escaped_or_a_variable_the_header_names() -> None:
    text = COMPOSE.read_text()
    interpolate(text, {})  # raises on a '$' compose would take from the host
    variables = set(re.findall(r"\$\{(\w+):-", text))
    assert variables == {"AGENTS_STORE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    header = text.split("\nx-agents:", 1)[0]
    for name in variables:
        assert name in header, f"{name}: not explained in the header"


def test_init_seals_to_a_recovery_key_made_first(services: dict[str, Any]) -> None:
    init = _script(services, "init")
    assert init.index("agents-control recovery-key new") < init.index("agents-control init")
    assert '--recovery-public-key "$$(cat /operator/recovery.pub)"' in init
    # The recovery key stays out of the control plane's own container.
    assert all(not v.startswith("operator:") for v in services["control"]["volumes"])


def test_the_machine_runs_the_printed_join_command_only_on_a_fresh_folder(
    services: dict[str, Any],
) -> None:
    enroll = _script(services, "enroll")
    assert 'agents-control token create --account "$$account" > /join/command.new' in enroll
    machine = services["machine"]["command"]
    assert machine[:2] == ["sh", "-c"]
    # A joined folder serves; only a fresh one joins (nothing serves it yet).
    assert machine[2].splitlines() == [
        'test -f "$$HOME/.agents-server/root/link.json" && exec agents-machine serve',
        "exec $$(cat /join/command)",
    ]


def test_each_daemon_uses_its_one_metrics_port(services: dict[str, Any]) -> None:
    port = DEFAULT_METRICS_LISTEN.rsplit(":", 1)[1]
    assert f"--metrics-listen 0.0.0.0:{port}" in _script(services, "init")
    assert f"127.0.0.1:{port}:{port}" in services["control"]["ports"]
    assert services["machine"]["environment"]["AGENTS_MACHINE_METRICS"] == SERVICE_METRICS_ADDRESS


def test_the_bucket_script_is_python(services: dict[str, Any]) -> None:
    assert services["bucket"]["command"][:2] == ["python", "-c"]
    compile(services["bucket"]["command"][2], "compose.yaml:bucket", "exec")


def test_the_image_installs_this_checkout() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY . /src" in dockerfile
    assert "pip install --no-cache-dir /src" in dockerfile
    kept = re.findall(r"^!(\S+)$", (DEPLOY / "Dockerfile.dockerignore").read_text(), re.M)
    # What setuptools needs: the project file, its readme, every package it finds.
    assert set(kept) == {"pyproject.toml", "README.md", "shared", "machine", "controlplane"}
    root = Path(__file__).resolve().parents[2]
    assert (
        'include = ["shared*", "machine*", "controlplane*"]'
        in (root / "pyproject.toml").read_text()
    )
