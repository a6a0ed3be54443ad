"""Replicas: several control-plane processes serving one deployment, through NATS.

Only ``serve --cluster nats://…`` imports this package (and nats-py with it): a
lone process never does. What NATS holds can all be rebuilt from the bucket or
from the machines themselves (docs/controlplane.md, "Replicas"):

- :mod:`controlplane.cluster.replica`: presence (which replica holds which
  machine's link, last seen) in a KV bucket whose entries expire, the routing of
  notices to the replica holding a machine, and which replicas are alive.
- :mod:`controlplane.cluster.lease`: the periodic jobs' lease, and each job's
  last due time done, so a job runs on one replica, once per due time.
"""
