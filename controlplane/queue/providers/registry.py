"""Choosing a provider implementation for a machine's settings.

Its own module so that the interface (``base``) never imports its
implementations, which import it.
"""

from __future__ import annotations

from pathlib import Path

from controlplane.queue.providers.base import LocalSettings, MachineProvider, ProviderSettings

__all__ = ["open_provider"]


def open_provider(settings: ProviderSettings, *, log_dir: Path) -> MachineProvider:
    """The provider for ``settings``: the only place that chooses an implementation."""
    # Imported here: the EC2 client pulls in aiobotocore only when it is used.
    if isinstance(settings, LocalSettings):
        from controlplane.queue.providers.local import LocalProvider

        return LocalProvider(settings, log_dir=log_dir)
    from controlplane.queue.providers.ec2 import Ec2Provider

    return Ec2Provider(settings)
