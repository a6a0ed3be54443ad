"""The gRPC servicers: thin translation between messages and domain calls.

``admin`` (the Admin service: authenticate, translate, one domain call),
``link`` (the MachineLink service) and ``causes`` (the store cause of each RPC).

May import: every domain room (``recovery``, ``deletion``, ``queue``,
``machines``, ``access``, ``integrity``), the leaves, ``shared``. Never the
server or the CLI.
"""

__all__ = ["admin", "causes", "link"]
