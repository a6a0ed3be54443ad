"""Helpers for the daemons' typed config objects.

Each daemon has one frozen config dataclass built once by its CLI. Values
come from, in order of precedence: command-line flags, then the environment,
then a TOML config file, then the default. The environment is passed in as a
mapping (the CLI passes ``os.environ``) so nothing below the CLI reads it.
A config module gathers the three sources in one :class:`Sources` and asks it
for each field.
"""

from __future__ import annotations

import datetime
import json
import logging
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared.errors import ConfigError

__all__ = [
    "Sources",
    "check_file",
    "check_folder",
    "load_toml",
    "parse_bool",
    "parse_size",
    "pick",
    "split_hostport",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def load_toml(path: Path | None, *, required: bool = False) -> dict[str, Any]:
    """Read a TOML config file; a bad file raises ConfigError.

    A missing file gives ``{}`` unless ``required`` (a file named on the
    command line), when it raises ConfigError naming the path.
    """
    if path is None:
        return {}
    try:
        exists = path.exists()
    except OSError as e:  # a folder on the way this user may not enter
        raise ConfigError(str(path), f"cannot read: {e.strerror or e}") from None
    if not exists:
        if required:
            raise ConfigError("file", f"{path}: no such file")
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(str(path), f"cannot read: {e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8
        raise ConfigError(str(path), f"cannot read: not UTF-8 (byte {e.start})") from None


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "a list", dict: "a table", datetime.datetime: "a date and time",
               datetime.date: "a date", datetime.time: "a time of day"}  # fmt: skip


def _as_toml(value: Any) -> str:
    """``value`` as the file wrote it (a TOML time is 03:30:00, not datetime.time(3, 30))."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, int | float):
        return repr(value)
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 40 else text[:39] + "…"


def check_file(file: Mapping[str, Any], schema: Mapping[str, tuple[type, ...]], path: Path) -> None:
    """Refuse a config file with a key ``schema`` does not know or a value of the wrong type.

    ``schema`` maps each key the file may hold to the TOML types it accepts.
    A misspelt key (``prompt_limt``) would otherwise be ignored in silence and
    the daemon would run with the default. Raises ConfigError naming the key
    and the file.
    """
    for key, value in file.items():
        types = schema.get(key)
        if types is None:
            known = ", ".join(sorted(schema))
            raise ConfigError(key, f"unknown key in {path} (known keys: {known})")
        # TOML's booleans are Python ints too: accept one only where bool is listed.
        wrong_bool = isinstance(value, bool) and bool not in types
        if wrong_bool or not isinstance(value, types):
            # "a number" covers both of TOML's (1 and 1.0 are both fine for a float).
            shown = [t for t in types if not (t is int and float in types)]
            wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in shown)
            got = _TYPE_NAMES.get(type(value), type(value).__name__)
            hint = ""
            if str in types and not isinstance(value, str | list | dict):
                hint = f' (TOML strings are in quotes: {key} = "…")'
            as_written = _as_toml(value)
            raise ConfigError(key, f"must be {wanted} in {path}, got {got}: {as_written}{hint}")


def check_folder(path: Path, field: str) -> None:
    """Raise ConfigError naming ``field`` when ``path``, or the nearest part of it
    that exists, is not a folder (a file given where a folder is meant)."""
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(field, f"{folder} is a file, not a folder")
            return


def pick(
    name: str,
    *,
    flag: Any,
    env: Mapping[str, str],
    env_key: str | None,
    file: Mapping[str, Any],
    default: T,
    parse: Callable[[Any], T] | None = None,
) -> T:
    """Return the first of flag, ``env[env_key]``, ``file[name]``, default that is set.

    ``parse`` converts a string/file value to the field's type; a value it
    rejects (ValueError/TypeError) raises ConfigError naming the field.
    """
    sources: list[tuple[str, Any]] = [("flag", flag)]
    if env_key is not None:
        sources.append((f"${env_key}", env.get(env_key)))
    sources.append(("config file", file.get(name)))
    for origin, value in sources:
        if value is None or value == "":
            continue
        if parse is None:
            return value  # type: ignore[no-any-return]
        try:
            return parse(value)
        except (ValueError, TypeError) as e:
            raise ConfigError(name, f"bad value from {origin}: {e}") from None
    return default


@dataclass(frozen=True)
class Sources:
    """The places one daemon's settings come from, in order of precedence.

    ``flags`` holds the CLI's parsed options by field name (None when not
    given), ``env`` the environment, ``file`` the parsed TOML config file.
    """

    flags: Mapping[str, Any]
    env: Mapping[str, str]
    file: Mapping[str, Any]

    def get(
        self,
        name: str,
        env_key: str | None,
        default: T,
        parse: Callable[[Any], T] | None = None,
    ) -> T:
        """Field ``name`` from the flags, ``env[env_key]``, the file, else ``default``.

        See :func:`pick`: ``parse`` converts the value found, and a value it
        rejects raises ConfigError naming the field and where the value came from.
        """
        return pick(
            name,
            flag=self.flags.get(name),
            env=self.env,
            env_key=env_key,
            file=self.file,
            default=default,
            parse=parse,
        )


def split_hostport(value: str, field: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """Split ``host:port`` into its host and port, or raise ConfigError naming ``field``.

    An IPv6 host may be written in brackets (``[::1]:7443``); the brackets are
    not part of the returned host. Without brackets the last colon separates
    the port. The port is decimal, 0 to 65535 (1 to 65535 unless
    ``allow_port_zero``, port 0 meaning "pick a free one"). The host is not
    resolved or checked beyond being non-empty; callers add their own rules.
    """
    text = str(value)
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        sep, port_text = rest[:1], rest[1:]
        if not bracket or sep != ":":
            raise ConfigError(field, f"must be [host]:port, got {text!r}")
    else:
        host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(field, f"must be host:port, got {text!r}")
    # isdigit alone accepts non-ASCII digits that int() may refuse.
    if not (port_text.isascii() and port_text.isdigit()):
        raise ConfigError(field, f"port must be a number, got {text!r}")
    port = int(port_text)
    lowest = 0 if allow_port_zero else 1
    if not lowest <= port <= 65535:
        raise ConfigError(field, f"port must be between {lowest} and 65535, got {text!r}")
    return host, port


def parse_bool(value: Any) -> bool:
    """Parse yes/no style booleans from env or file."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gib": 1024**3,
}


def parse_size(value: Any) -> int:
    """Parse a byte size such as ``1048576``, ``20MiB`` or ``512k``."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must not be negative")
        return value
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {value!r}")
    return int(float(num) * _UNITS[unit])
