"""Formats: the shapes the machine's data takes outside the database.

The export format (``export``: an agent as a versioned tar of JSONL files, also
a backup segment's plaintext), sealed backups (``backup``: segments and the
manifest naming them, zstd and secretstream), an agent's delta merged onto its
earlier files (``backup_delta``: continuous backups' increments), reading a
segment in place (``segment_files``), cron rules (``cron``: five fields in a time
zone) and attachments' media types (``media_types``).

May import: ``shared`` only. Pure code: no database, no network, no daemon state.
"""

__all__ = ["backup", "backup_delta", "cron", "export", "media_types", "segment_files"]
