"""Schedules: an agent's prompt on a cron, fired as ordinary runs, each fire recorded.

``service`` (the schedules service and the scheduler loop); the cron rule
itself is ``machine.formats.cron``.

May import: ``machine.core``, ``machine.storage``, ``machine.formats``, the
leaves, ``shared``.
"""

__all__ = ["service"]
