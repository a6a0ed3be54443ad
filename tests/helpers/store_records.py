"""Read and write control-plane objects straight in the bucket, as an attacker or a test.

The control plane MACs every object (``shared.store.authenticated``) under a key
derived from its home's ``secrets.key``. :func:`sealed` makes the stored form a
genuine control plane would write (it needs the home: an attacker with only
bucket access cannot call it); :func:`payload` strips the header without
checking it (anyone can read the bucket's contents).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controlplane.integrity.keys import load_home_keys
from controlplane.integrity.trusted import record_mac_key
from shared.store.authenticated import MAC_HEADER, seal

__all__ = ["payload", "read_json", "sealed"]


def sealed(home: Path, key: str, data: bytes) -> bytes:
    """``data`` as the control plane of ``home`` stores it at ``key`` (key below the prefix)."""
    return seal(record_mac_key(load_home_keys(home)), key, data)


def payload(stored: bytes) -> bytes:
    """The record inside a stored object (the MAC header dropped, not checked)."""
    if stored.startswith(MAC_HEADER):
        return stored.split(b"\n", 1)[1]
    return stored


def read_json(stored: bytes) -> dict[str, Any]:
    """The JSON record inside a stored object."""
    data = json.loads(payload(stored))
    assert isinstance(data, dict)
    return data
