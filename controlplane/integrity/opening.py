"""Opening the deployment's object store as the configuration names it.

The one place the control plane turns its config's store settings into a store
(:func:`shared.store.open_store` chooses the kind; retries and metrics wrap it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from controlplane.config import ControlConfig
from shared.store import ObjectStore, StoreOptions, open_store

__all__ = ["open_control_store"]


async def open_control_store(cfg: ControlConfig, registry: CollectorRegistry | None) -> ObjectStore:
    """Open the configured store (metrics under ``agents_cp_store_*``)."""
    options = StoreOptions(
        access_key=cfg.store_access_key,
        secret_key=cfg.store_secret_key,
        region=cfg.store_region,
        endpoint_url=cfg.store_endpoint,
        object_lock=cfg.store_object_lock,
    )
    return await open_store(
        cfg.store_url, options=options, namespace="agents_cp", registry=registry
    )
