"""The prompt queue: prompts for stopped machines, from send to acknowledgement.

``prompts`` (sealed, in order, in the store; bounds), ``idempotency`` (keys that
outlive their prompt), ``delivery`` (from the queue to a machine's Connect
stream), ``acks`` (acknowledged prompts leave in batches), ``starter`` (start a
stopped machine through its provider when a prompt waits), ``wake`` (the same
for schedules) and ``providers/`` (``local`` and ``ec2``).

May import: ``controlplane.machines``, ``controlplane.access``,
``controlplane.integrity``, the leaves, ``shared``.
"""

__all__ = ["acks", "delivery", "idempotency", "prompts", "providers", "starter", "wake"]
