"""Machines and links: the registry, pairing, presence and the rules of a link.

``registry`` (machine records: register, rename, revoke, renew), ``pairing``
(token + CSR -> certificate, renewals), ``presence`` (live links, last seen),
``alive`` (the daemon's alive stamps: until when a link a killed daemon left
online was seen), ``fleet`` (every machine, listed once for the periodic
checks), ``rosters`` (each machine's agent ids), ``links`` (the rules of one
Connect stream, without gRPC) and ``backups`` (machines' sealed backups,
stored, never opened).

May import: ``controlplane.access``, ``controlplane.integrity``, the leaves,
``shared``.
"""

__all__ = ["alive", "backups", "fleet", "links", "pairing", "presence", "registry", "rosters"]
