"""Code both daemons use: errors, ids, atomic files, config helpers, the CLI scaffold
and its progress display, crypto, the object store, retry policy, metrics helpers,
TLS helpers, gRPC error mapping, logging setup, systemd's notify protocol, and
the generated protobuf stubs under ``shared.pb``.

Modules are imported by name (``from shared.store import open_store``);
this package deliberately imports nothing at import time so that the light
modules do not pull in grpc or aiobotocore.
"""

__all__ = [
    "atomic",
    "cli",
    "config",
    "crypto",
    "errors",
    "ids",
    "logs",
    "metrics",
    "outage",
    "progress",
    "retry",
    "rpc",
    "sd_notify",
    "store",
    "tls",
    "version",
]
