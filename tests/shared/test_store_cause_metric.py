"""Store requests counted by cause: the cause set in the context shows on the counter."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from shared.errors import NotFound
from shared.store import MemoryStore, MeteredStore
from shared.store.causes import current_cause, set_cause, store_cause

CAUSES = frozenset({"presence", "self_check", "other"})


def _requests(registry: CollectorRegistry, cause: str, operation: str) -> float:
    value = registry.get_sample_value(
        "agents_cp_store_requests_total", {"cause": cause, "operation": operation}
    )
    return value or 0.0


def _total(registry: CollectorRegistry, name: str) -> float:
    return sum(
        s.value
        for m in registry.collect()
        for s in m.samples
        if s.name == name and not s.name.endswith("_created")
    )


async def test_a_cause_set_in_the_context_shows_on_the_counter() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(MemoryStore(), "agents_cp", registry, causes=CAUSES)
    with store_cause("presence"):
        await store.put("p/a.json", b"{}")
        await store.get("p/a.json")
        with store_cause("self_check"):  # the innermost cause wins
            await store.head("p/a.json")
        with pytest.raises(NotFound):  # a failed request counts too
            await store.get("p/missing.json")
    await store.get("p/a.json")  # outside every cause

    assert _requests(registry, "presence", "put") == 1
    assert _requests(registry, "presence", "get") == 2
    assert _requests(registry, "self_check", "head") == 1
    assert _requests(registry, "other", "get") == 1
    # Summed over causes, the requests are the operations.
    assert _total(registry, "agents_cp_store_requests_total") == _total(
        registry, "agents_cp_store_operations_total"
    )


async def test_tasks_inherit_the_cause_and_a_task_names_its_own() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(MemoryStore(), "agents_cp", registry, causes=CAUSES)
    await store.put("k/a", b"x")

    async def loop_body() -> None:
        set_cause("self_check")  # a task's own entry point
        await store.get("k/a")

    with store_cause("presence"):
        inherited = asyncio.create_task(store.head("k/a"))
        own = asyncio.create_task(loop_body())
        await asyncio.gather(inherited, own)
        # The task's own cause ended with the task.
        assert current_cause() == "presence"
    assert current_cause() == "other"
    assert _requests(registry, "presence", "head") == 1
    assert _requests(registry, "self_check", "get") == 1


async def test_unknown_causes_count_as_other_and_listing_pages_count_each() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(MemoryStore(), "agents_cp", registry, causes=CAUSES)
    for i in range(5):
        await store.put(f"l/{i}", b"x")
    with store_cause("no-such-cause"):
        pages = [page async for page in store.list_pages("l/", page_size=2)]
    assert len(pages) == 3
    # Three pages plus the call that found the end.
    assert _requests(registry, "other", "list") == 4
    assert {
        s.labels["cause"]
        for m in registry.collect()
        for s in m.samples
        if s.name == "agents_cp_store_requests_total"
    } == {"other"}


async def test_without_causes_nothing_is_counted_by_cause() -> None:
    registry = CollectorRegistry()
    store = MeteredStore(MemoryStore(), "agents_machine", registry)
    with store_cause("presence"):
        await store.put("a", b"x")
    assert (
        registry.get_sample_value(
            "agents_machine_store_operations_total", {"operation": "put", "outcome": "ok"}
        )
        == 1
    )
    assert _total(registry, "agents_machine_store_requests_total") == 0
