"""Account deletion: tombstone, close, delete everything under the account, then it.

``service`` (the deletion, resumed after a crash from its tombstone).

May import: ``controlplane.machines`` (the machines' backups),
``controlplane.access``, ``controlplane.integrity``, the leaves, ``shared``.
"""

__all__ = ["service"]
