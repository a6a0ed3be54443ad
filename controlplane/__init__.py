"""The control-plane daemon: accounts, pairing, presence, admin, and its CLI.

Domain services (:mod:`~controlplane.accounts`, :mod:`~controlplane.tokens`,
:mod:`~controlplane.machines`, :mod:`~controlplane.pairing`,
:mod:`~controlplane.presence`, :mod:`~controlplane.authz`) store JSON in the
object store and never import grpc; the servicers translate. Import the
modules by name; this package imports nothing at import time.
"""

__all__ = [
    "accounts",
    "admin_servicer",
    "admin_types",
    "audit",
    "authz",
    "bootstrap",
    "cli",
    "client",
    "config",
    "fsck",
    "hashing",
    "integrity",
    "intents",
    "jsonstore",
    "keys",
    "link_servicer",
    "links",
    "machines",
    "metrics",
    "pairing",
    "presence",
    "records",
    "server",
    "tokens",
]
