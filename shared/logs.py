"""How both daemons log: one line per event, as text or as JSON, on stderr.

:func:`setup_logging` is what ``serve`` calls once its config is built: it
replaces whatever handlers the root logger had with one on stderr, at the
configured level, in one of two formats:

- ``text``: ``<local time> <LEVEL> <logger>: <message>``, then the ids the
  event concerns (passed as ``extra``) as ``key=value`` words in brackets;
- ``json``: one JSON object per line with ``time`` (RFC 3339, UTC,
  milliseconds), ``level``, ``logger``, ``message``, the ids passed as
  ``extra`` as top-level keys, and ``exception`` (the traceback as one
  string) when there is one.

Libraries that are chatty below WARNING (:data:`CAPPED`: botocore logs every
request's headers at DEBUG) are held at WARNING even when our level is DEBUG,
so ``--log-level debug`` shows our debug lines and not theirs. gRPC's C core
logs outside Python; its verbosity is set before gRPC loads
(:func:`shared.entry.quiet_grpc`), and in ``json`` a daemon's ``serve`` turns
its lines into records (:mod:`shared.native_lines`).

A log line never holds a secret: callers pass ids (``machine_id``,
``token_id``), never a token's or credential's value.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
from typing import IO, Any, Final

from shared import native_lines
from shared.errors import ConfigError

__all__ = [
    "CAPPED",
    "FORMATS",
    "LEVELS",
    "JsonFormatter",
    "TextFormatter",
    "add_log_options",
    "check_format",
    "check_level",
    "parse_format",
    "parse_level",
    "setup_logging",
]

logger = logging.getLogger(__name__)

#: The levels an operator may choose (``--log-level``), lowest first.
LEVELS: Final = ("debug", "info", "warning", "error")
#: The formats an operator may choose (``--log-format``).
FORMATS: Final = ("text", "json")
#: Loggers of libraries held at WARNING or above whatever our level is.
CAPPED: Final = ("botocore", "aiobotocore", "urllib3", "asyncio")

_TEXT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord has; anything else on a record came in through ``extra``.
_STANDARD: Final = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def parse_level(value: object) -> str:
    """``value`` as a level name (``"INFO"``), any case accepted; ValueError if unknown
    (:func:`shared.config.pick` names the field and where the value came from)."""
    level = str(value).strip().lower()
    if level not in LEVELS:
        raise ValueError(f"must be one of {', '.join(LEVELS)}, got {str(value)[:16]!r}")
    return level.upper()


def parse_format(value: object) -> str:
    """``value`` as a format name (``"json"``), any case accepted; ValueError if unknown."""
    fmt = str(value).strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"must be one of {', '.join(FORMATS)}, got {str(value)[:16]!r}")
    return fmt


def check_level(value: str, field: str = "log_level") -> str:
    """:func:`parse_level`, raising ConfigError naming ``field``."""
    try:
        return parse_level(value)
    except ValueError as e:
        raise ConfigError(field, str(e)) from None


def check_format(value: str, field: str = "log_format") -> str:
    """:func:`parse_format`, raising ConfigError naming ``field``."""
    try:
        return parse_format(value)
    except ValueError as e:
        raise ConfigError(field, str(e)) from None


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--log-format`` on a daemon's ``serve``: any case, and a
    value not in :data:`LEVELS` / :data:`FORMATS` is argparse's usage error."""
    parser.add_argument(
        "--log-level", type=str.lower, choices=LEVELS, help="the daemon's log level (default info)"
    )
    parser.add_argument(
        "--log-format",
        type=str.lower,
        choices=FORMATS,
        help="the daemon's log lines: text (default) or json, one object per line",
    )


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    items = record.__dict__.items()
    return {k: v for k, v in items if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> [id=value ...]`` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        """The line, with the record's ``extra`` ids after the message."""
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        ids = " ".join(f"{k}={v}" for k, v in extras.items())
        head, sep, tail = line.partition("\n")  # ids before a traceback, not after it
        return f"{head} [{ids}]{sep}{tail}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        when = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _extras(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an id passed as a Path or an enum still makes one line.
        return json.dumps(out, ensure_ascii=False, default=str)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`setup_logging` installs (so a second call replaces it)."""


def setup_logging(
    level: str, fmt: str = "text", stream: IO[str] | None = None, *, native: bool = False
) -> None:
    """Log records at ``level`` and above to ``stream`` (stderr) in ``fmt``
    (``text`` or ``json``); the :data:`CAPPED` libraries log WARNING and above only.

    ``native`` (a daemon's ``serve``): in ``json``, gRPC's C-core lines written
    to descriptor 2 become records too (:mod:`shared.native_lines`), so every
    line of the daemon's stderr parses.

    Replaces the root logger's plain handlers (``logging.basicConfig``'s, the
    NullHandler a CLI sets for its verbs, an earlier call's); others (a test
    runner's capture) stay.
    """
    chosen = logging.getLevelNamesMapping()[check_level(level)]
    if native and stream is None and check_format(fmt) == "json":
        stream = native_lines.route()
    handler = _Handler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if check_format(fmt) == "json" else TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        if isinstance(old, _Handler) or type(old) in (logging.StreamHandler, logging.NullHandler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(chosen)
    for name in CAPPED:
        # A logger's own level decides for its records: the root's does not filter
        # what propagates to it, so the cap is the higher of WARNING and ours.
        logging.getLogger(name).setLevel(max(logging.WARNING, chosen))
