"""Replicas: several control-plane processes serving one deployment, through NATS.

Only ``serve --cluster nats://…`` imports this package (and nats-py with it): a
lone process never does. What NATS holds can all be rebuilt from the bucket or
from the machines themselves (docs/controlplane.md, "Replicas"):

- ``replica``: this process as one replica (NATS connection, its presence
  entries and the watch of everyone's), what presence's ``Peers`` asks for;
- ``board``: what the watch saw (who holds which machine, which replicas are
  alive), without I/O;
- ``routing``: notices for a machine linked to another replica, over subjects;
- ``lease``: the periodic jobs' lease, and each job's last due time done, so a
  job runs on one replica, once per due time.

May import: ``controlplane.integrity``, the leaves, ``shared``, ``nats``.
"""

__all__ = ["board", "lease", "replica", "routing"]
