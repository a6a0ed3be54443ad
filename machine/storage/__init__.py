"""Storage: machine.db and the SQL that reads and writes it.

``db`` (one writer thread with group commit, one reader), ``schema`` (tables and
migrations), ``faults`` (what SQLite and OS errors mean, the integrity check),
``tables/`` (small synchronous SQL functions run inside a ``Database`` job: the
only place with SQL), and ``restored`` (a restore's histories, packed at its
commit and loaded into the tables after it).

May import: ``machine.formats``, ``machine.models``, ``shared``. Never the
conversation core, backups, the link or the CLI.
"""

__all__ = ["db", "faults", "restored", "schema", "tables"]
