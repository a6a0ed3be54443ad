"""``agents_machine_build_info`` and ``agents_cp_build_info``: always 1, labelled
with the installed platform's version and the Python that runs the daemon."""

from __future__ import annotations

import platform
from importlib.metadata import version

import pytest
from prometheus_client import CollectorRegistry

from shared.metrics import build_info
from tests.helpers.metric_names import control_registry, machine_registry


@pytest.mark.parametrize(
    ("daemon", "name"),
    [("machine", "agents_machine_build_info"), ("control", "agents_cp_build_info")],
)
def test_each_daemon_registers_its_build_info(daemon: str, name: str) -> None:
    registry = machine_registry() if daemon == "machine" else control_registry()
    labels = {"version": version("agents-platform"), "python_version": platform.python_version()}
    assert registry.get_sample_value(name, labels) == 1.0
    # One series: the labels are fixed for the life of the process.
    (family,) = [f for f in registry.collect() if f.name == name]
    assert family.type == "gauge"
    assert len(family.samples) == 1


def test_build_info_says_unknown_for_a_tree_that_is_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import PackageNotFoundError

    import shared.version

    def missing(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(shared.version, "version", missing)
    shared.version.package_version.cache_clear()
    try:
        registry = CollectorRegistry()
        build_info(registry, "agents_cp")
        labels = {"version": "unknown", "python_version": platform.python_version()}
        assert registry.get_sample_value("agents_cp_build_info", labels) == 1.0
    finally:
        shared.version.package_version.cache_clear()
