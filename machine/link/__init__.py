"""The control-plane link: the machine's identity, its join, and its live link.

``identity`` (keys, certificate and link record in the data folder), ``join``
(pin the CA, trade a one-time token for a certificate), ``client`` (the one
client of the control plane's MachineLink service), ``connection`` (the live
Connect stream: hello, heartbeats, renewals, CA rollovers) and ``deliveries``
(prompts the control plane delivers: stored once, then acknowledged).

May import: ``machine.core`` (deliveries start runs), ``machine.storage``, the
leaves, ``shared``. Never backups (they use the link, not the reverse) or the CLI.
"""

__all__ = ["client", "connection", "deliveries", "identity", "join"]
