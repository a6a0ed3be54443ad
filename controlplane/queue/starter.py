"""Starting stopped machines through their providers when a prompt waits for them.

``machine provider set`` stores a machine's provider settings, credentials
included, as ONE object ``accounts/<a>/providers/<m>.sealed`` (its put is the
commit point): sealed (``shared.crypto.seal_bytes``) to a box key derived from
the home's ``secrets.key``, bound to its key, and MAC'd like every record. No
listing, log or metric shows a secret; listings show ``public()`` settings.

A queued prompt asks the machine's provider to start it, at most once per
``debounce`` seconds per machine; the machine is "starting" from then until it
connects (or the window ends). So do prompts that already wait when a provider
is set (:meth:`MachineStarter.set`), and, while they wait for an offline
machine, the periodic check (:meth:`MachineStarter.start_if_waiting`, called by
:mod:`controlplane.queue.wake`): a start that failed, or a machine that stopped
again before it connected, is asked again once the window is over. Whether
prompts wait comes from the queue's view of its keys (no store request once
this process knows the machine's queue). A provider that refuses (bad
credentials, no such instance) is counted and its message kept for ``prompt
list``, logged as a warning when it differs from the last one; it never fails
the send.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from controlplane.access.principals import Principal
from controlplane.integrity.audit import Auditor
from controlplane.integrity.records import Machine
from controlplane.machines.registry import MachineRegistry
from controlplane.queue.providers import MachineProvider, open_provider, parse_settings
from shared.crypto import BoxKeyPair, open_bytes, seal_bytes
from shared.errors import AgentsError, IntegrityError, InvalidArgument, NotFound
from shared.ids import validate_id
from shared.store.base import ObjectStore
from shared.store.causes import set_cause

__all__ = ["DEBOUNCE", "MachineStarter", "provider_key"]

logger = logging.getLogger(__name__)

#: Least seconds between two start requests for one machine.
DEBOUNCE: Final = 60.0
_BOX_INFO: Final = b"agents-cp provider settings v1"
_MAX_SETTINGS: Final = 16 * 1024


def provider_key(account_id: str, machine_id: str) -> str:
    """Key of a machine's sealed provider settings."""
    acct = validate_id("account", account_id, "account_id")
    return f"accounts/{acct}/providers/{validate_id('machine', machine_id, 'machine_id')}.sealed"


class MachineStarter:
    """Provider settings and start requests; one instance per daemon."""

    def __init__(
        self,
        store: ObjectStore,
        machines: MachineRegistry,
        auditor: Auditor,
        secrets_key: bytes,
        *,
        log_dir: Path,
        debounce: float = DEBOUNCE,
        on_result: Callable[[str], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        waiting: Callable[[Machine], Awaitable[bool]] | None = None,
    ) -> None:
        self._store = store
        # Whether a prompt waits for the machine, offline (None: never asked).
        self._waiting = waiting
        self._machines = machines
        self._audit = auditor
        self._box = BoxKeyPair.from_private(
            hmac.new(secrets_key, _BOX_INFO, hashlib.sha256).digest()
        )
        self._log_dir = log_dir
        self._debounce = debounce
        self._on_result = on_result
        self._monotonic = monotonic
        self._providers: dict[str, MachineProvider] = {}
        # Machines found with no provider: `set` is the only writer (this process,
        # fenced), so `machine list` asks the store once per machine, not per call.
        self._none: set[str] = set()
        self._asked: dict[str, float] = {}
        self._starting: set[str] = set()
        self._errors: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        """The start request in flight for each machine."""

    async def set(
        self, principal: Principal, machine_id: str, name: str, settings_json: str
    ) -> Machine:
        """Store (or with an empty ``name``, remove) a machine's provider."""
        machine = await self._machines.get(principal, machine_id)
        key = provider_key(machine.account_id, machine_id)
        if not name:
            await self._store.delete(key)
        else:
            if len(settings_json) > _MAX_SETTINGS:
                raise InvalidArgument("settings_json", f"longer than {_MAX_SETTINGS} characters")
            try:
                data = json.loads(settings_json or "{}")
            except ValueError:
                raise InvalidArgument("settings_json", "not valid JSON") from None
            settings = parse_settings(name, data)
            if name == "local":
                # It runs a command on the control plane's own host.
                principal.require_operator("machine provider set local")
            plain = json.dumps({"provider": name, "settings": settings.stored()}).encode()
            # THE COMMIT POINT: the one put of the sealed settings.
            await self._store.put(key, seal_bytes(plain, [self._box.public_key], aad=key.encode()))
        # A start in flight used the old settings (or found none): it is moot.
        running = self._tasks.pop(machine_id, None)
        if running is not None:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        old = self._providers.pop(machine_id, None)
        self._none.discard(machine_id)
        if old is not None:
            await old.close()
        self._errors.pop(machine_id, None)
        self._asked.pop(machine_id, None)  # new settings may be tried at once
        await self._audit.record(
            principal.credential_id, "machine.provider", machine_id, machine.account_id
        )
        if name:
            # Prompts that waited for a machine without a provider: start it now,
            # not at the next send. The settings are stored whatever this finds;
            # the periodic check asks again when it cannot tell.
            try:
                await self.start_if_waiting(machine)
            except AgentsError as e:
                logger.warning(
                    "machine %s: cannot tell whether prompts wait for it: %s", machine_id, e
                )
        return machine

    async def _provider(self, account_id: str, machine_id: str) -> MachineProvider | None:
        provider = self._providers.get(machine_id)
        if provider is not None or machine_id in self._none:
            return provider
        key = provider_key(account_id, machine_id)
        try:
            plain = open_bytes(await self._store.get(key), self._box, aad=key.encode())
        except NotFound:
            self._none.add(machine_id)
            return None
        data = json.loads(plain)
        settings = parse_settings(str(data["provider"]), data["settings"])
        provider = open_provider(settings, log_dir=self._log_dir / machine_id)
        self._providers[machine_id] = provider
        return provider

    def request(self, account_id: str, machine_id: str) -> None:
        """A prompt waits for this offline machine: ask its provider (debounced)."""
        self.try_request(account_id, machine_id)

    def try_request(self, account_id: str, machine_id: str) -> bool:
        """As :meth:`request` (a schedule is due); whether a request was made now."""
        running = self._tasks.get(machine_id)
        if self._asked_lately(machine_id) or (running is not None and not running.done()):
            return False
        self._asked[machine_id] = self._monotonic()
        task = asyncio.create_task(self._start(account_id, machine_id), name=f"start-{machine_id}")
        self._tasks[machine_id] = task
        task.add_done_callback(functools.partial(self._done, machine_id))
        return True

    def _done(self, machine_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(machine_id) is task:
            del self._tasks[machine_id]

    def _asked_lately(self, machine_id: str) -> bool:
        last = self._asked.get(machine_id)
        return last is not None and self._monotonic() - last < self._debounce

    async def start_if_waiting(self, machine: Machine) -> bool:
        """Ask the provider of ``machine`` (offline) to start it when a prompt waits
        for it (debounced, as :meth:`request`); whether a request was made now.

        Store requests: the provider's settings once per process (as
        :meth:`has_provider`) and, for a machine with a provider, one listing of
        its queue once per process (``PromptQueue.waiting``); none afterwards.
        """
        machine_id = machine.machine_id
        if self._waiting is None or machine.revoked or self._asked_lately(machine_id):
            return False
        if not await self.has_provider(machine.account_id, machine_id):
            return False
        if not await self._waiting(machine):
            return False
        return self.try_request(machine.account_id, machine_id)

    async def has_provider(self, account_id: str, machine_id: str) -> bool:
        """Whether a provider is set for the machine (an unreadable one counts: a
        start then reports what is wrong with it)."""
        try:
            return await self._provider(account_id, machine_id) is not None
        except (AgentsError, IntegrityError, KeyError, ValueError):
            return True

    async def _start(self, account_id: str, machine_id: str) -> None:
        set_cause("provider")  # a task of its own (try_request)
        try:
            provider = await self._provider(account_id, machine_id)
            if provider is None:
                # No provider: the prompt waits for the machine to come by itself,
                # and the window does not hold back a provider set later.
                self._asked.pop(machine_id, None)
                return
            status = await provider.start()
        except (AgentsError, IntegrityError, KeyError, ValueError) as e:
            # Asked again while prompts wait (the periodic check): the same refusal
            # is logged once, as a warning, until it changes or a start works.
            again = self._errors.get(machine_id) == str(e)
            self._errors[machine_id] = str(e)
            self._count("error")
            logger.log(
                logging.DEBUG if again else logging.WARNING,
                "machine %s: provider start failed: %s",
                machine_id,
                e,
            )
            return
        self._errors.pop(machine_id, None)
        self._starting.add(machine_id)
        self._count("ok")
        logger.info("machine %s: provider asked to start it (%s)", machine_id, status.state)

    def _count(self, result: str) -> None:
        if self._on_result is not None:
            self._on_result(result)

    def connected(self, machine_id: str) -> None:
        """The machine connected: no longer starting, and a later prompt may start it again."""
        self._starting.discard(machine_id)
        self._asked.pop(machine_id, None)

    def starting(self, machine_id: str) -> bool:
        """Asked to start and not connected yet."""
        return machine_id in self._starting

    def last_error(self, machine_id: str) -> str:
        """The provider's last refusal for this machine, or ""."""
        return self._errors.get(machine_id, "")

    async def close(self) -> None:
        """Stop start requests in flight; started machines keep running."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for provider in self._providers.values():
            await provider.close()
        self._providers.clear()
