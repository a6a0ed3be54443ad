"""Durations as people type them: ``90s``, ``30m``, ``1h30m``, ``2h45m30s``, ``1d``.

One grammar for every duration a CLI flag or an environment variable of the
platform takes (config files take numbers of seconds, as TOML has no
durations). It is Go's ``time.ParseDuration`` (kubectl, restic) with ``d`` for
a day and without signs:

- a plain number is seconds (``3600``, ``2.5``), as the flags took before;
- otherwise one or more parts, each a number (``1``, ``1.5``, ``.5``) and a unit
  of ``ms``, ``s``, ``m``, ``h``, ``d``, with the units from the largest to the
  smallest, each once (``1m1h`` or ``1h1h`` is a typo more often than a sum);
- spaces around the whole are ignored; none inside; units are lower case
  (``30M`` could mean months).

Bad text raises :class:`DurationError` (a ValueError, so config loading names
the variable it came from) with a message saying what is wrong.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Final

__all__ = [
    "EXAMPLES",
    "UNITS",
    "DurationError",
    "format_duration",
    "parse_duration",
    "seconds_value",
]

logger = logging.getLogger(__name__)

#: Each unit and its seconds, from the largest to the smallest.
UNITS: Final = {"d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}

#: What an error message shows as good input.
EXAMPLES: Final = "e.g. 90s, 30m, 1h30m, 1d"

# ASCII digits only: \d also matches other scripts' digits, which float() takes.
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?|\.[0-9]+")
_WORD = re.compile(r"[^0-9.]*")
_LETTERS = re.compile(r"[^\W\d_]+")
_RANK = {unit: rank for rank, unit in enumerate(UNITS)}


class DurationError(ValueError):
    """Text that is not a duration; the message says why (and never spans lines)."""


def parse_duration(text: str) -> float:
    """The seconds ``text`` stands for (see the module docstring), never negative."""
    raw = text
    text = text.strip()
    if not text:
        raise DurationError(f"empty duration ({EXAMPLES})")
    if _NUMBER.fullmatch(text):
        return _finite(float(text), raw)
    total = 0.0
    pos = 0
    last_rank = -1
    while pos < len(text):
        number = _NUMBER.match(text, pos)
        if number is None:
            raise DurationError(_unexpected(raw, text[pos]))
        pos = number.end()
        word = _WORD.match(text, pos).group()  # type: ignore[union-attr]  # matches ""
        # The unit is the longest known one the word starts with ("ms" before "m"):
        # the rest, if any, is the next part's trouble ("1h-5m" stops at "-").
        name = next((u for u in sorted(UNITS, key=len, reverse=True) if word.startswith(u)), "")
        if not name:
            if not word:
                raise DurationError(
                    f"not a duration: {raw!r}: {number.group()} needs a unit"
                    f" (ms, s, m, h, d; {EXAMPLES})"
                )
            letters = _LETTERS.match(word)
            if letters is None:
                raise DurationError(_unexpected(raw, word[0]))
            raise DurationError(
                f"not a duration: {raw!r}: unknown unit {letters.group()!r}"
                f" (ms, s, m, h, d; {EXAMPLES})"
            )
        if _RANK[name] <= last_rank:
            raise DurationError(
                f"not a duration: {raw!r}: units go from the largest to the smallest,"
                f" each once ({EXAMPLES})"
            )
        last_rank = _RANK[name]
        total += float(number.group()) * UNITS[name]
        pos += len(name)
    return _finite(total, raw)


def _unexpected(raw: str, char: str) -> str:
    if char in "-+":
        return f"not a duration: {raw!r}: no signs, a duration is not negative ({EXAMPLES})"
    return f"not a duration: {raw!r}: unexpected {char!r} ({EXAMPLES})"


def _finite(seconds: float, raw: str) -> float:
    if not math.isfinite(seconds):
        shown = raw if len(raw) <= 24 else raw[:20] + "…"
        raise DurationError(f"too long: {shown!r}")
    return seconds


def seconds_value(value: Any) -> float:
    """A duration setting's seconds: a number as it is (a TOML value, a parsed
    flag), text by :func:`parse_duration` (an environment variable)."""
    if isinstance(value, bool):
        raise DurationError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise DurationError(f"must be 0 or more seconds, got {value!r}")
        return float(value)
    return parse_duration(str(value))


def format_duration(seconds: float) -> str:
    """``seconds`` written as :func:`parse_duration` reads it back: ``1h30m``,
    ``1d2h``, ``0s``; a fraction of a second as whole milliseconds (rounded)."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"not a duration: {seconds!r}")
    left = round(seconds * 1000)  # whole milliseconds
    parts = []
    for unit, size in UNITS.items():
        step = round(size * 1000)
        count, left = divmod(left, step)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"
