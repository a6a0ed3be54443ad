"""The control plane's domain objects over one store: what the daemon serves and
what ``fsck`` checks, built the same way for both.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from controlplane.access.accounts import AccountService
from controlplane.access.authz import CredentialService
from controlplane.access.tokens import TokenService
from controlplane.config import ControlConfig
from controlplane.deletion.service import AccountDeletion
from controlplane.integrity.audit import Auditor
from controlplane.integrity.clock import ClockCheck
from controlplane.integrity.intents import Intents
from controlplane.integrity.keys import HomeKeys, KeyRing
from controlplane.integrity.replays import ReplayLog
from controlplane.machines.pairing import Pairing
from controlplane.machines.registry import MachineRegistry
from shared.store import ObjectStore

__all__ = ["Services"]


class Services:
    """The domain objects of one daemon, built from a store and keys."""

    def __init__(
        self,
        cfg: ControlConfig,
        store: ObjectStore,
        keys: HomeKeys,
        backups: ObjectStore | None = None,
        keyring: KeyRing | None = None,
        on_replay: Callable[[str], None] | None = None,
        clock_check: ClockCheck | None = None,
    ) -> None:
        # The live keys: rotation (controlplane.recovery.rotation) swaps them while
        # serving. The daemon passes the ring its listeners were bound with.
        self.keyring = keyring if keyring is not None else KeyRing(keys)
        self.auditor = Auditor(store)
        # One intent log for every multi-object change (controlplane.integrity.intents).
        self.intents = Intents(store, recheck=cfg.intent_recheck_seconds)
        # Records found older than their markers (controlplane.integrity.replays).
        replays = ReplayLog(on_replay)
        self.accounts = AccountService(store, self.auditor, intents=self.intents, replays=replays)
        self.credentials = CredentialService(store, self.accounts, self.auditor)
        self.tokens = TokenService(
            store,
            self.accounts,
            self.auditor,
            default_ttl=cfg.token_ttl,
            intents=self.intents,
            replays=replays,
            validity_clock=clock_check.latest_now if clock_check is not None else None,
        )
        self.machines = MachineRegistry(
            store, self.accounts, self.auditor, intents=self.intents, replays=replays
        )
        self.pairing = Pairing(
            self.tokens,
            self.machines,
            self.accounts,
            keys.ca,
            dt.timedelta(days=cfg.cert_lifetime_days),
            intents=self.intents,
            confirm_grace=cfg.join_confirm_grace,
            store=store,
            keyring=self.keyring,
        )
        # Account deletion reads the backups' names lists (controlplane.deletion.service).
        self.deletion = AccountDeletion(
            store, self.accounts, self.auditor, self.intents, backups=backups
        )
