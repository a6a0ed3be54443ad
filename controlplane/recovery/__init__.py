"""Disaster recovery and the deployment's own keys.

``bootstrap`` (``init``), ``keybundle`` (every key of the home sealed to the
recovery key), ``fencing`` (one process writes a deployment's store at a time:
the epoch), ``restore`` (rebuild a home from the store and the recovery key),
``adopt`` (new keys over an existing store), ``migrate`` (move the deployment
to another store), ``rotation`` (server certificate,
CA rollover), ``fsck`` (find and repair what a crash or a bucket writer left) and
``keyshapes`` (every key shape the control plane writes, for ``fsck``).

May import: ``controlplane.services``, ``controlplane.machines``,
``controlplane.access``, ``controlplane.integrity``, the leaves, ``shared``.
"""

__all__ = [
    "adopt",
    "bootstrap",
    "fencing",
    "fsck",
    "keybundle",
    "keyshapes",
    "migrate",
    "restore",
    "rotation",
]
