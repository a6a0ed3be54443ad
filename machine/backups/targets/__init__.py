"""Where a machine's backups are kept, beyond the ``shared`` targets.

``folder`` (a stand-alone machine's backup folder: checked, its owner named, a
copied one opened), ``bucket`` (a stand-alone machine's S3-compatible bucket
prefix: opened on first use, its owner named) and ``control_plane`` (a joined
server's backups, a target over the link). ``machine.backups.wiring`` chooses
between them.

May import: what ``machine.backups`` may, and the rest of that room.
"""

__all__ = ["bucket", "control_plane", "folder"]
