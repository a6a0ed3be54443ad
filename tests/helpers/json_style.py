"""What every ``--json`` reply of both CLIs must look like (docs/cli-json.md)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["assert_json_style", "assert_listing"]

_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
_ENUM_NAME = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$")


def assert_json_style(data: Any, where: str = "$") -> None:
    """No ``id`` key, every ``*_at`` time RFC 3339 UTC to the second (or null),
    no upper-case enum names, no 64-bit number as text, anywhere in ``data``."""
    if isinstance(data, dict):
        for key, value in data.items():
            at = f"{where}.{key}"
            assert key != "id", f"{at}: an own id goes under <thing>_id"
            if key.endswith("_at") or key in ("time", "fire_time"):
                assert value is None or _TIME.match(str(value)), f"{at}: {value!r}"
            if key.endswith(("_seq", "_bytes", "_ms")) or key in ("seq", "size"):
                assert isinstance(value, int), f"{at}: {value!r} is not a number"
            assert_json_style(value, at)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            assert_json_style(value, f"{where}[{i}]")
    elif isinstance(data, str):
        assert not _ENUM_NAME.match(data), f"{where}: {data!r} looks like a raw enum name"


def assert_listing(data: Any, key: str) -> list[Any]:
    """``{"<things>": [...]}``: an object holding the list under ``key``; the list."""
    assert isinstance(data, dict) and isinstance(data.get(key), list), data
    assert_json_style(data)
    return list(data[key])
