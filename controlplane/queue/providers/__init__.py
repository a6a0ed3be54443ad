"""Machine providers: what starts a stopped machine when a prompt or schedule needs it.

One small interface (:class:`MachineProvider`: ``start``, ``status``,
``close``) with two implementations, ``local`` (a command on the control
plane's host) and ``ec2`` (an instance, through aiobotocore).
:func:`open_provider` is the only place that chooses between them.
"""

from controlplane.queue.providers.base import (
    PROVIDER_NAMES,
    MachineProvider,
    ProviderState,
    ProviderStatus,
    parse_settings,
)
from controlplane.queue.providers.registry import open_provider

__all__ = [
    "PROVIDER_NAMES",
    "MachineProvider",
    "ProviderState",
    "ProviderStatus",
    "open_provider",
    "parse_settings",
]
