"""The scaffold both command lines stand on (``agents-machine``, ``agents-control``).

One shape for every CLI of the platform (STYLE.md rule 2):

- :class:`ExitCode` names every exit code; :data:`EXIT_FOR` picks one for each
  kind of error in one table;
- :class:`CliParser` turns argparse's usage errors into :class:`UsageError`;
- :func:`dispatch` finds the handler of ``(command, verb)`` in a table;
- :func:`run_main` runs a CLI's body and turns every expected failure into
  ONE line on stderr (``prog: message``), plus ``Try: …`` when a hint helps;
- :class:`Output` is the only writer of stdout: one JSON object per reply
  (``--json``, in the one style of docs/cli-json.md that :func:`message_dict`
  makes), or text and tables whose id columns are never cut or wrapped.

Nothing here prints except :func:`run_main` (errors) and :class:`Output`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import difflib
import errno
import json
import logging
import math
import os
import re
import select
import shutil
import stat
import sys
import unicodedata
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import IO, Any, Final, NoReturn

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from shared.durations import DurationError, format_duration, parse_duration
from shared.errors import (
    AgentsError,
    AlreadyExists,
    ConfigError,
    InvalidArgument,
    InvalidState,
    NotFound,
)
from shared.version import package_version

__all__ = [
    "EXIT_FOR",
    "INT32_MAX",
    "INT64_MAX",
    "Column",
    "SHELLS",
    "CliParser",
    "ExitCode",
    "Handler",
    "Output",
    "UsageError",
    "add_examples",
    "add_version",
    "bind_error",
    "bounded_int",
    "check_argv",
    "complete",
    "completion_script",
    "dispatch",
    "duration",
    "enum_text",
    "exit_code_for",
    "id_key",
    "json_time",
    "message_dict",
    "one_line",
    "read_stdin_text",
    "render_table",
    "run_main",
    "stdout_writable",
    "table_time",
    "walk_parsers",
    "whole_seconds",
]

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


class ExitCode(IntEnum):
    """Every exit code a CLI of the platform returns."""

    OK = 0
    """Success."""
    FAILED = 1
    """A failed run, an unreachable daemon, a refused credential, a server fault."""
    USAGE = 2
    """Bad input or a request the target refuses: one line on stderr, maybe a hint."""
    INTERRUPTED = 130
    """Ctrl-C."""


class UsageError(Exception):
    """Bad command-line input found by the CLI itself: one line, exit 2."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


#: Domain errors that mean "what you asked for is wrong" exit 2; every other
#: AgentsError exits 1. The first matching class (in order) wins.
EXIT_FOR: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (UsageError, ExitCode.USAGE),
    (ConfigError, ExitCode.USAGE),
    (InvalidArgument, ExitCode.USAGE),
    (NotFound, ExitCode.USAGE),
    (AlreadyExists, ExitCode.USAGE),
    (InvalidState, ExitCode.USAGE),
    (AgentsError, ExitCode.FAILED),
)


def exit_code_for(exc: BaseException) -> ExitCode | None:
    """The exit code :data:`EXIT_FOR` gives ``exc``; None for an unexpected error."""
    for kind, code in EXIT_FOR:
        if isinstance(exc, kind):
            return code
    return None


#: How alike (difflib's ratio) a mistyped choice and the one suggested must be.
_NEAR = 0.7


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise :class:`UsageError`.

    The message names the subcommand (``agent show: the following arguments
    are required: id``); the CLI puts its own name in front once.
    """

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # A mistyped command or verb names the nearest one (git, kubectl, gh do):
        # "invalid choice: 'machin'; did you mean 'machine'?".
        choices = action.choices
        if choices is not None and value not in choices:
            # 0.7, above difflib's 0.6: a typo ('agnet', 'lsit', 'machin') is near,
            # another word ('explode' for 'export', 0.62) is not.
            close = difflib.get_close_matches(
                str(value), [str(c) for c in choices], n=1, cutoff=_NEAR
            )
            if close:
                # A command or verb needs no "argument cmd:" in front: the error's
                # prefix already says where (``machine: invalid choice …``).
                named = None if isinstance(action, argparse._SubParsersAction) else action
                raise argparse.ArgumentError(
                    named, f"invalid choice: {value!r}; did you mean {close[0]!r}?"
                )
        super()._check_value(action, value)

    def error(self, message: str) -> NoReturn:
        root = self.prog.split(" ", 1)[0]
        where = self.prog.removeprefix(root).strip()
        raise UsageError(f"{where}: {message}" if where else message, f"{self.prog} --help")


#: The shells ``completion SHELL`` writes a script for.
SHELLS: Final = ("bash", "zsh", "fish")


def completion_script(prog: str, shell: str) -> str:
    """The script that makes ``shell`` complete ``prog``'s commands, verbs and
    options (argcomplete's: the shell runs ``prog`` with ``_ARGCOMPLETE`` set)."""
    from argcomplete.shell_integration import shellcode  # here: no cost to other commands

    return shellcode([prog], shell=shell)


def complete(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """When the shell asks for completions (``_ARGCOMPLETE`` in ``env``), write them
    where its script reads them and end the process; otherwise do nothing.

    Called before anything else a CLI does: completing must not dial a daemon
    (but for a completer's own short call), read a config or print.
    """
    if "_ARGCOMPLETE" not in env:
        return
    import argcomplete

    argcomplete.autocomplete(parser)


def walk_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of a command tree with its command path (``()`` for the root,
    ``("machine", "list")``), parents before their subcommands."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk_parsers(sub, (*path, name))


def add_examples(
    root: argparse.ArgumentParser, examples: Mapping[tuple[str, ...], Sequence[str]]
) -> None:
    """Give each parser of the tree the "Examples:" section ``examples`` holds for
    its command path, at the end of its ``--help``, laid out as written."""
    for path, parser in walk_parsers(root):
        lines = examples.get(path)
        if lines:
            parser.epilog = "Examples:\n" + "\n".join(f"  {line}" for line in lines)
            # Examples keep their lines (argparse would re-wrap them into one);
            # descriptions here are one line, so keeping their layout costs nothing.
            parser.formatter_class = argparse.RawDescriptionHelpFormatter


def add_version(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``PROG VERSION`` (the installed distribution's) and exit 0."""
    parser.add_argument(
        "--version",
        action="version",
        version=f"{parser.prog} {package_version()}",
        help="print the version and exit",
    )


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number from ``low`` to ``high``.

    The bounds are the wire field's (an int32 ``limit``, an int64 ``after_seq``),
    so a value protobuf cannot carry is a usage error, not a traceback.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    parse.__name__ = "whole number"
    return parse


def duration(low: float = 0, high: float | None = None) -> Callable[[str], float]:
    """An argparse ``type`` for a duration (``90s``, ``1h30m``, ``2.5``; shared.durations)
    from ``low`` to ``high`` seconds (None: no upper bound), as seconds."""

    def parse(text: str) -> float:
        try:
            seconds = parse_duration(text)
        except DurationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if seconds < low:
            least = format_duration(low) if low else "0s"
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text!r}")
        if high is not None and seconds > high:
            raise argparse.ArgumentTypeError(
                f"too long: {text!r} (at most {format_duration(high)})"
            )
        return seconds

    parse.__name__ = "duration"
    return parse


def whole_seconds(low: int, high: int) -> Callable[[str], int]:
    """:func:`duration` for a field of whole seconds (a uint32 ``ttl_seconds``):
    a fraction of a second is refused rather than rounded."""
    seconds = duration(low, high)

    def parse(text: str) -> int:
        value = seconds(text)
        if value != int(value):
            raise argparse.ArgumentTypeError(f"must be whole seconds, got {text!r}")
        return int(value)

    parse.__name__ = "duration"
    return parse


def check_argv(argv: Sequence[str]) -> None:
    """Refuse an argument that is not valid UTF-8 (it cannot go on the wire).

    Python decodes such bytes to lone surrogates (``surrogateescape``);
    encoding them strictly finds them.
    """
    for index, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UsageError(
                f"argument {index} is not valid UTF-8 (byte {e.start + 1} of it)"
            ) from None


def read_stdin_text(what: str, limit: int, stream: IO[bytes] | None = None) -> str:
    """All of stdin as text, at most ``limit`` bytes (more is never read into memory);
    bytes that are not UTF-8, or too many, are a usage error naming ``what``."""
    data = (stream or sys.stdin.buffer).read(limit + 1)
    if len(data) > limit:
        raise UsageError(f"{what}: stdin holds more than the limit of {limit} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what}: stdin is not valid UTF-8 (at byte {e.start})") from None


# ---------------------------------------------------------------- dispatch

#: A handler gets the CLI's context objects and returns an exit code (maybe awaited).
Handler = Callable[..., int | Awaitable[int]]


def dispatch(
    table: Mapping[tuple[str, str | None], Handler],
    prog: str,
    command: str | None,
    verb: str | None,
    *context: Any,
) -> int:
    """Run the handler of ``(command, verb)`` with ``context``; return its exit code.

    A command without verbs is listed as ``(command, None)``. A missing command
    or verb is a usage error with the matching ``--help`` as hint.
    """
    if command is None:
        raise UsageError("missing command", f"{prog} --help")
    handler = table.get((command, verb))
    if handler is None:
        if verb is None:
            raise UsageError(f"{command}: missing verb", f"{prog} {command} --help")
        raise UsageError(f"{command}: unknown verb {verb!r}", f"{prog} {command} --help")
    result = handler(*context)
    if isinstance(result, Awaitable):
        return int(asyncio.run(_awaited(result)))
    return int(result)


async def _awaited(result: Awaitable[int]) -> int:
    return await result


# ---------------------------------------------------------------- errors


def one_line(text: str) -> str:
    """Fold newlines, tabs and other control characters into single spaces."""
    cleaned = "".join(" " if unicodedata.category(c).startswith("C") else c for c in text)
    return " ".join(cleaned.split())


def _report(prog: str, message: str, hint: str | None) -> None:
    # Plain writes, never a wrapping renderer: one would cut the line at the
    # terminal width (80 columns in a pipe).
    text = f"{prog}: {one_line(message)}\n"
    if hint:
        text += f"Try: {one_line(hint)}\n"
    sys.stderr.write(text)
    sys.stderr.flush()


def _silence_stdout() -> None:
    # The reader went away: point fd 1 at /dev/null so the interpreter's final
    # flush does not raise a second BrokenPipeError at exit.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def run_main(
    prog: str,
    body: Callable[[], int],
    *,
    hint_for: Callable[[BaseException], str | None] = lambda e: None,
    message_for: Callable[[BaseException], str | None] = lambda e: None,
    interrupted: str = "interrupted",
) -> int:
    """Run a CLI's ``body`` and return its exit code; expected failures print one line.

    ``hint_for`` gives the "Try: …" line for an error (None: no hint);
    ``message_for`` may replace an error's message (None: ``str(exc)``).
    Exceptions that :data:`EXIT_FOR` does not know are not caught: they are bugs.
    """
    if sys.stdout is None:
        # Started with descriptor 1 closed (`cmd >&-`): a verb would fail at its
        # first print, perhaps after making what it prints (a new id, lost).
        if sys.stderr is not None:
            _report(prog, "stdout is closed; nothing was done (redirect it: > /dev/null)", None)
        return ExitCode.USAGE
    for stream in (sys.stdout, sys.stderr):
        # Names, prompts and replies are any Unicode: in a terminal whose locale
        # cannot show a character, print an escape rather than raise.
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        return body()
    except BrokenPipeError:
        _silence_stdout()
        with contextlib.suppress(OSError):  # stderr may be the same closed pipe
            _report(prog, "stdout was closed before all output was written", None)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        _report(prog, interrupted, None)
        return ExitCode.INTERRUPTED
    except (UsageError, AgentsError) as exc:
        if isinstance(exc, StdoutError):
            # What stdout refused stays buffered: the interpreter's last flush
            # would fail again ("Exception ignored", exit 120).
            _silence_stdout()
        code = exit_code_for(exc) or ExitCode.FAILED
        message = message_for(exc) or (exc.message if isinstance(exc, UsageError) else str(exc))
        hint = exc.hint if isinstance(exc, UsageError) else hint_for(exc)
        _report(prog, message, hint)
        return code


_GRPC_BIND = re.compile(r"Failed to bind to address (\S+?);")


def bind_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError a daemon's failure to listen means, or None for anything else.

    gRPC reports a port it cannot bind as a RuntimeError with a fixed text
    (naming the address), the standard library as OSError EADDRINUSE or
    EADDRNOTAVAIL: both are a setting to change, not a crash.
    """
    if isinstance(exc, RuntimeError) and (m := _GRPC_BIND.search(str(exc))):
        return ConfigError("listen", f"cannot listen on {m.group(1)}: in use, or not this host's")
    if isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
        return ConfigError("listen", f"cannot listen on a configured address: {exc.strerror}")
    return None


def stdout_writable(stream: IO[str] | None = None) -> bool:
    """False when stdout is closed, is a pipe whose reader has gone, or is
    /dev/null (``> /dev/null``, the usual answer to a closed stdout).

    Checked before a command makes a secret it prints only once (a credential,
    a recovery key): better to refuse than to make one nobody can see.
    """
    out = stream or sys.stdout
    if out is None:  # Python started with fd 1 closed
        return False
    try:
        fd = out.fileno()
    except (OSError, ValueError):
        return True  # a stream in memory (tests capture output this way)
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    if stat.S_ISCHR(st.st_mode):
        with contextlib.suppress(OSError):
            if st.st_rdev == os.stat(os.devnull).st_rdev:
                return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    for _, events in poller.poll(0):
        if events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
            return False
    return True


# ---------------------------------------------------------------- JSON

_INT64_TYPES = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}

_TIMESTAMP = "google.protobuf.Timestamp"
_FRACTION = re.compile(r"\.\d+Z$")
_WORD_START = re.compile(r"(?<!^)(?=[A-Z])")


def _snake(name: str) -> str:
    """``RunEventKind`` → ``run_event_kind``."""
    return _WORD_START.sub("_", name).lower()


def id_key(message_name: str) -> str:
    """The key a message's own ``id`` field is printed under: ``Agent`` →
    ``agent_id``, the key every other message refers to an agent by."""
    return f"{_snake(message_name)}_id"


def enum_text(enum_name: str, value: str | int) -> str | int:
    """An enum value as printed: its name without the enum type's prefix, in lower
    case (``RunState`` ``RUN_STATE_FINISHED`` → ``finished``, ``RunEventKind``
    ``TEXT_DELTA`` → ``text_delta``). A number this CLI does not know stays a number."""
    if not isinstance(value, str):
        return value
    return value.removeprefix(f"{_snake(enum_name).upper()}_").lower()


def json_time(text: str) -> str:
    """protobuf's RFC 3339 text of a Timestamp cut to whole seconds
    (``2026-12-05T09:40:12.250Z`` → ``2026-12-05T09:40:12Z``): one fixed shape,
    which jq's ``fromdate`` reads (it refuses fractions)."""
    return _FRACTION.sub("Z", text)


def message_dict(msg: Message) -> dict[str, Any]:
    """A protobuf message as the JSON both CLIs print (docs/cli-json.md).

    Every field is present (zero, empty, ``[]``, ``null`` for an unset message),
    under its proto name, but a message's own ``id``, which is under
    ``<message>_id`` (:func:`id_key`); 64-bit integers are numbers, not the strings
    proto3 JSON makes of them; timestamps RFC 3339 UTC to the second
    (:func:`json_time`); enums lower case without their type's prefix
    (:func:`enum_text`); bytes base64.
    """
    data = MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    desc: Any = msg.DESCRIPTOR  # upb's and the pure-Python descriptor types differ
    return _fields(desc, data)


def _fields(desc: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in desc.fields:
        key = id_key(desc.name) if f.name == "id" else f.name
        if f.name not in data:
            # A message field that is not set (a timestamp never reached): null,
            # so that every field of the reply is present.
            if f.message_type is not None and not f.is_repeated and f.containing_oneof is None:
                out[key] = None
            continue
        value = data[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value_field = f.message_type.fields_by_name["value"]
            out[key] = {k: _convert(value_field, v) for k, v in value.items()}
        elif f.is_repeated:
            out[key] = [_convert(f, v) for v in value]
        else:
            out[key] = _convert(f, value)
    return out


def _convert(f: FieldDescriptor, value: Any) -> Any:
    if f.type in _INT64_TYPES and isinstance(value, str):
        return int(value)
    if f.enum_type is not None:
        return enum_text(f.enum_type.name, value)
    if f.message_type is not None:
        if f.message_type.full_name == _TIMESTAMP and isinstance(value, str):
            return json_time(value)
        if f.message_type.full_name.startswith("google.protobuf."):
            return value  # other well-known types keep their JSON form
        if isinstance(value, dict):
            return _fields(f.message_type, value)
    return value


# ---------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    """A table column; ``whole`` ones (ids, states, times) are never cut or wrapped:
    a cut one ("start…", "2026-12-…") says nothing."""

    title: str
    whole: bool = False


def table_time(value: dt.datetime | float | None) -> str:
    """A time as every table of both CLIs shows it: UTC to the second, the zone
    written (``2026-12-05 09:40:12Z``); "-" when not set.

    ``value`` is an aware datetime (the control plane's) or Unix seconds (the
    machine's, where 0 means not set). UTC, not the local zone: a table pasted
    into a ticket reads the same everywhere, and matches the daemons' logs and
    the JSON output (RFC 3339, UTC).
    """
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        moment = value.astimezone(dt.UTC)
    else:
        # Whole seconds, as the wire's Timestamp.seconds: rounding could show the next one.
        if math.floor(value) == 0:
            return "-"
        moment = dt.datetime.fromtimestamp(math.floor(value), dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


#: C0 and C1 control characters but newline and tab, for str.translate to drop.
_CONTROLS = {c: None for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in "\n\t"}

_GAP = "  "
_ELLIPSIS = "…"


def render_table(
    columns: Sequence[Column], rows: Iterable[Sequence[str]], width: int | None
) -> list[str]:
    """Lay out ``rows`` as plain text lines, one per row after a header.

    Cells are folded to one line. ``whole`` columns keep their full width;
    when ``width`` (the terminal's) is too narrow, the other columns give way,
    widest first, and their cells end in "…". ``width=None`` (a pipe) cuts
    nothing.
    """
    body = [[one_line(str(cell)) for cell in row] for row in rows]
    widths = [max([len(c.title), *(len(r[i]) for r in body)]) for i, c in enumerate(columns)]
    if width is not None:
        excess = sum(widths) + len(_GAP) * (len(widths) - 1) - width
        shrinkable = [i for i, c in enumerate(columns) if not c.whole]
        while excess > 0 and shrinkable:
            widest = max(shrinkable, key=lambda i: widths[i])
            floor = max(len(columns[widest].title), 3)
            if widths[widest] <= floor:
                shrinkable.remove(widest)
                continue
            widths[widest] -= 1
            excess -= 1

    def fit(text: str, size: int) -> str:
        return text if len(text) <= size else text[: size - 1] + _ELLIPSIS

    lines = []
    for row in [[c.title for c in columns], *body]:
        cells = [fit(cell, widths[i]).ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append(_GAP.join(cells).rstrip())
    return lines


class StdoutError(AgentsError):
    """stdout refused a write (a full disk, an I/O error): what was to be shown
    was not. A command that prints a secret once says what that leaves."""


class Output:
    """The only writer of a CLI's stdout.

    ``--json``: each reply is one JSON object on one line (a listing is an object
    holding a list, never a bare list or ``{}``). Otherwise text and tables.
    Each call writes its whole text at once, so a reader that stops after the
    first line (``| head -1``) gets whole lines.
    """

    def __init__(self, as_json: bool, stream: IO[str] | None = None) -> None:
        self.as_json = as_json
        self._stream = stream

    @property
    def stream(self) -> IO[str]:
        """The stream written to (stdout unless given)."""
        return self._stream or sys.stdout

    def _table_width(self) -> int | None:
        try:
            if not os.isatty(self.stream.fileno()):
                return None
        except (OSError, ValueError):
            return None
        return shutil.get_terminal_size().columns

    def write(self, text: str) -> None:
        """Write ``text`` (streamed run output) and flush.

        Control characters other than newline and tab are dropped: an agent's
        reply or a tool's output must not drive the terminal (escape sequences
        can retitle it, hide text or forge hyperlinks).
        """
        try:
            self.stream.write(text.translate(_CONTROLS))
            self.stream.flush()
        except BrokenPipeError:
            raise  # the reader went away: run_main says so
        except OSError as e:
            raise StdoutError(f"could not write to stdout ({e.strerror or e})") from None

    def lines(self, *lines: str) -> None:
        """Write lines of text in one write."""
        self.write("".join(f"{line}\n" for line in lines))

    def note(self, *lines: str) -> None:
        """Lines for the person, not the script, on stderr: what a secret printed
        alone on stdout is (so ``$(…)`` and ``| head -1`` get just the secret)."""
        sys.stderr.write("".join(f"{one_line(line)}\n" for line in lines))
        sys.stderr.flush()

    def json(self, data: Mapping[str, Any]) -> None:
        """One JSON object on one line."""
        # ASCII only: JSON escapes every other character, so no locale can fail
        # to print it and no control character reaches a terminal.
        self.write(json.dumps(data, sort_keys=True) + "\n")

    def table(self, columns: Sequence[Column], rows: Iterable[Sequence[str]]) -> None:
        """A table; id columns (``whole``) are never cut, other columns give way."""
        self.lines(*render_table(columns, rows, self._table_width()))

    def detail(self, pairs: Iterable[tuple[str, str]]) -> None:
        """One record as ``key  value`` lines; values are never cut."""
        pairs = list(pairs)
        self.lines(*render_table([Column("", whole=True), Column("", whole=True)], pairs, None)[1:])
