"""Limits the control plane and its machines must agree on.

A module of its own, with no imports: the backup format's readers (segment
worker processes among them) need these numbers without loading gRPC.
"""

from __future__ import annotations

from typing import Final

__all__ = ["LINK_MAX_MESSAGE"]

#: The largest gRPC message the control plane and its machines exchange, the same
#: at both ends (gRPC's default receive limit is 4 MiB): prompts and segments go in
#: chunks below it, a sealed backup manifest and its names list in one message.
LINK_MAX_MESSAGE: Final = 8 * 1024 * 1024
