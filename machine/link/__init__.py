"""The control-plane link: the machine's identity, its join, and its live link.

``identity`` (keys, certificate and link record in the data folder),
``machine_ids`` (the machine's own ids and the joined one, kept in machine.db),
``join`` (pin the CA, trade a one-time token for a certificate), ``client`` (the
one client of the control plane's MachineLink service), ``following`` (clients
that follow the keys on disk through renewals and rollovers), ``connection`` (the live
Connect stream and its reconnect loop), ``states`` (the link's states and the
refusals that stop or slow it), ``heartbeats`` (hello, heartbeats and the
agent roster on the stream), ``renewal`` (certificate renewal and CA
rollovers while the stream is up), ``clock`` (this machine's clock against the
control plane's: the measured skew, and a TLS date check that failed, explained)
and ``deliveries`` (prompts the control plane delivers: stored once, then
acknowledged).

May import: ``machine.core`` (deliveries start runs), ``machine.storage``, the
leaves, ``shared``. Never backups (they use the link, not the reverse) or the CLI.
"""

__all__ = [
    "client",
    "clock",
    "connection",
    "deliveries",
    "following",
    "heartbeats",
    "identity",
    "join",
    "machine_ids",
    "renewal",
    "states",
]
