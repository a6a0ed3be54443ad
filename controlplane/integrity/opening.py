"""Opening the deployment's object store as the configuration names it.

The one place the control plane turns its config's store settings into a store
(:func:`shared.store.open_store` chooses the kind; retries and metrics wrap it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from controlplane.config import ControlConfig
from shared.store import ObjectStore, StoreOptions, open_store

__all__ = ["open_control_store", "store_options"]


def store_options(cfg: ControlConfig, call_deadline: float | None = None) -> StoreOptions:
    """The store settings of the configuration (the one place that reads them)."""
    return StoreOptions(
        access_key=cfg.store_access_key,
        secret_key=cfg.store_secret_key,
        region=cfg.store_region,
        endpoint_url=cfg.store_endpoint,
        call_deadline=call_deadline,
        retry_initial=cfg.store_retry_seconds,
        object_lock=cfg.store_object_lock,
    )


async def open_control_store(cfg: ControlConfig, registry: CollectorRegistry | None) -> ObjectStore:
    """Open the configured store (metrics under ``agents_cp_store_*``)."""
    return await open_store(
        cfg.store_url, options=store_options(cfg), namespace="agents_cp", registry=registry
    )
