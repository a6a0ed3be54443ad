"""The control-plane daemon (`agents-control`), one package (a room) per capability.

Bottom to top: ``integrity`` (the trusted store: records, MACs, intents, audit),
``access`` (accounts, principals, credentials, join tokens), ``machines``
(registry, pairing, presence, links, backups), ``queue`` (prompts for stopped
machines, delivery, providers, wake), ``deletion``, ``recovery`` (init, key
bundle, epoch and fencing, restore, adopt, rotation, fsck), ``api`` (the gRPC
servicers), ``cli``. Entry modules beside them: ``server`` (the daemon),
``services`` (the domain objects over one store), and the leaves every room may
use: ``config``, ``metrics``. Domain rooms never import grpc; the servicers
translate. docs/architecture.md walks a queued prompt through them;
tests/layout/test_import_rules.py keeps the import rules. Import the modules by
name; this package imports nothing at import time.
"""

__all__ = [
    "access",
    "api",
    "cli",
    "config",
    "deletion",
    "integrity",
    "machines",
    "metrics",
    "queue",
    "recovery",
    "server",
    "services",
]
