"""The machine API: the gRPC servicer of ``MachineService`` and its translation.

``servicer`` (decode, one domain call, encode), ``codec/`` (domain records to
and from machine.v1 messages, shared with the CLI's client: a package by area,
``agents``, ``schedules``, ``erasure``, ``backups``, ``status``), ``views``
(replies no domain record carries whole) and ``local_auth`` (the optional TCP
listener's bearer token).

May import: ``machine.app`` and every room below it, ``shared``. Never the CLI
or the daemon.
"""

__all__ = ["codec", "local_auth", "servicer", "views"]
