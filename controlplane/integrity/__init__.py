"""Store integrity: the deployment's store as the control plane trusts it.

``records`` (the records, their JSON form, where each lives), ``jsonstore``
(read, create-once, compare-and-swap), ``keys`` (the home's keys: what the MACs
are made with), ``trusted`` (MAC'd records, a per-call deadline, the deployment
check), ``intents`` (one intent record per multi-object change), ``audit`` (the
audit trail), ``opening`` (opening the store the config names), ``replays``
(records found older than their markers) and ``clock`` (our clock against the
store's: expiries wait while the two disagree).

May import: ``controlplane.config``, ``controlplane.metrics``, ``shared``. The
bottom room: nothing of accounts, machines, the queue or recovery.
"""

__all__ = [
    "audit",
    "clock",
    "intents",
    "jsonstore",
    "keys",
    "opening",
    "records",
    "replays",
    "trusted",
]
