"""The gRPC servicers: thin translation between messages and domain calls.

``admin`` (the Admin service: authenticate, translate, one domain call) and
``link`` (the MachineLink service).

May import: every domain room (``recovery``, ``deletion``, ``queue``,
``machines``, ``access``, ``integrity``), the leaves, ``shared``. Never the
server or the CLI.
"""

__all__ = ["admin", "link"]
