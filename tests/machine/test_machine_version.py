"""The one version string the machine reports."""

from __future__ import annotations

from importlib.metadata import version

from machine import machine_version


def test_version_is_the_installed_distributions_and_computed_once() -> None:
    assert machine_version() == version("agents-platform")
    assert machine_version.cache_info().currsize == 1
