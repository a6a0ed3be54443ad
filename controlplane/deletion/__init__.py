"""Account deletion: tombstone, close, delete everything under the account, then it.

``service`` (the deletion: its steps in order, resumed after a crash from its
tombstone), ``sweep`` (steps 4 and 5: the index entries and every object under
the account, in batches, counted) and ``tombstone`` (a deletion's state as the
tombstone and the ``deleted/`` record hold it).

May import: ``controlplane.machines`` (the machines' backups),
``controlplane.access``, ``controlplane.integrity``, the leaves, ``shared``.
"""

__all__ = ["service", "sweep", "tombstone"]
