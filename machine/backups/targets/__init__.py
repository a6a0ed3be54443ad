"""Where a machine's backups are kept, beyond the ``shared`` targets.

``folder`` (a stand-alone machine's backup folder: checked, its owner named, a
copied one opened) and ``control_plane`` (a joined server's backups, a target
over the link). ``machine.backups.wiring`` chooses between them.

May import: what ``machine.backups`` may, and the rest of that room.
"""

__all__ = ["control_plane", "folder"]
