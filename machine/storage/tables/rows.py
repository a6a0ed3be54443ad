"""Shapes the store modules share: a row read into a record, a field of an archive row."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from shared.errors import InvalidArgument
from shared.timestamps import MAX_SECONDS

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["archive_field", "archive_time", "from_row", "present"]

R = TypeVar("R", bound="DataclassInstance")


def from_row(cls: type[R], row: sqlite3.Row) -> R:
    """The record ``cls`` (a dataclass) whose every field is the row's column of that name."""
    return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls)})


# SQLite binds at most 999 parameters in older builds: ask in chunks well under it.
_IN_CHUNK = 500


def present(conn: sqlite3.Connection, table: str, column: str, ids: Iterable[str]) -> set[str]:
    """Which of ``ids`` are in ``table``'s ``column`` (both names are ours, never input)."""
    wanted = list(ids)
    found: set[str] = set()
    for i in range(0, len(wanted), _IN_CHUNK):
        part = wanted[i : i + _IN_CHUNK]
        marks = ",".join("?" * len(part))
        sql = f"SELECT {column} FROM {table} WHERE {column} IN ({marks})"
        found |= {r[0] for r in conn.execute(sql, part)}
    return found


def archive_field(row: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``row[key]`` of an archive's JSON line, checked to be a ``kind`` (never a bool
    standing in for a number): InvalidArgument naming the line otherwise."""
    value = row.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidArgument("archive", f"{where}: {key} missing or of the wrong type")
    return value


def archive_time(row: dict[str, Any], key: str, where: str, *, optional: bool = False) -> Any:
    """``row[key]`` of an archive's JSON line, checked to be a time: Unix seconds from
    0 to :data:`~shared.timestamps.MAX_SECONDS` (``1e400`` reads as infinity, which no
    listing could show). With ``optional``, None (or absent) passes as None."""
    if optional and row.get(key) is None:
        return None
    value = archive_field(row, key, (int, float), where)
    if not 0 <= value <= MAX_SECONDS:  # false for NaN too
        raise InvalidArgument(
            "archive", f"{where}: {key} is not a time (Unix seconds up to the year 9999)"
        )
    return value
