"""The shell commands of README.md and docs/**/*.md, as the doc-command test runs them.

``tests/integration/test_doc_commands.py`` runs every command block of the docs
against real processes, so a doc that stops working fails the suite. This module
is the pure half: it finds the blocks, reads their markers and fills placeholders;
``tests/helpers/doc_shell.py`` runs them.

Which blocks are command blocks
    A fenced block labelled ``sh``, ``bash``, ``shell``, ``console`` or ``zsh``,
    or an unlabelled one whose first line is a command (``$ …``, ``agents-control``,
    ``agents-machine``, ``./scripts/…``, ``curl``, ``promtool``, …). Blocks in
    any other language (``text``, ``json``, ``promql``) are not run.

    In a block whose lines start with ``$ `` (``console`` style) only those lines
    are commands and the lines after each are its shown output, which it must
    print (``…`` stands for any text, a number for any number); a command
    followed by ``$ echo $?`` and a number is expected to exit with that number.
    In any other command block every line is a command (``\\`` continues a line;
    ``#`` comments are dropped). Every command must exit 0 unless shown otherwise.
    A daemon is started with ``&`` (not "in another terminal"): the runner waits
    until it is ready (``READY`` in tests/helpers/doc_shell.py) and stops it
    with the page.

Markers (an HTML comment on the line just before the opening fence)
    ``<!-- doc-test: skip: REASON -->``
        the block is not run, for the reason given (required): it needs systemd,
        docker or a real cloud, or runs for minutes.
    ``<!-- doc-test: synopsis -->``
        the block is grammar (``[--json]``, ``acct_...``), not run; each of its
        ``agents-control`` / ``agents-machine`` lines must still name real
        subcommands and options (tests/layout/test_doc_extract.py).
    ``<!-- doc-test: needs: PROGRAM -->``
        run the block when PROGRAM is on PATH, else count it skipped.
    An unmarked command block that cannot run fails the test, naming the marker.

    Hidden setup, run in order with the page's blocks but not shown to a reader::

        <!-- doc-test: run
        agents-machine serve &
        -->

Placeholders (filled from what earlier commands of the same page printed)
    ``PREFIX…`` (a literal prefix, then ``…``, U+2026): the last word in the
    earlier output that starts with PREFIX and goes on in id characters
    (``[A-Za-z0-9_-]``, dots allowed inside); each further ``…`` stands for
    more id characters, so ``tok_….…`` is a whole ``tok_ID.SECRET`` token and
    ``sha256:…`` a hash. A ``…`` with no earlier output to fill it fails.
    The documented ports (``WELL_KNOWN_PORTS``) become free ports of the test,
    and ``.venv/bin/activate`` is the virtualenv running the tests.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "WELL_KNOWN_PORTS",
    "Block",
    "Command",
    "DocError",
    "doc_files",
    "fill_placeholders",
    "is_background",
    "parse_doc",
    "remap_ports",
    "strip_comment",
    "unshown_output",
]

SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console", "zsh"})
#: The first word of a line that makes an unlabelled block a command block.
COMMAND_WORDS = (
    "agents-control",
    "agents-machine",
    "./scripts/",
    ".venv/bin/",
    "curl",
    "promtool",
    "moto_server",
    "python",
    "docker",
    "systemctl",
    "export ",
    ". ",
)
#: Ports the docs name (moto, the control plane's public, link and metrics
#: listeners, a machine's metrics): each session maps them to free ports.
WELL_KNOWN_PORTS = (9000, 7443, 7444, 9470, 9471)

_MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<kind>[a-z]+)\s*(?::\s*(?P<arg>.*?))?\s*-->\s*$")
_HIDDEN_START = re.compile(r"^\s*<!--\s*doc-test:\s*run\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
#: A placeholder: optional literal prefix, then ``…`` and more id characters or ``…``.
_PLACEHOLDER = re.compile(r"[\w:.-]*…[\w:.…-]*")
_ID_CHARS = r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*"


class DocError(Exception):
    """A doc's command block the test cannot run as written (message says what to do)."""


@dataclass(frozen=True)
class Command:
    """One command of a block: its text and the exit code the doc expects."""

    text: str
    line: int
    expect_code: int = 0
    #: The output a console block shows after it (see :func:`unshown_output`).
    shown: tuple[str, ...] = ()


@dataclass
class Block:
    """One command block of a doc."""

    path: Path
    line: int
    lang: str
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None
    needs: str | None = None
    hidden: bool = False
    synopsis: bool = False

    @property
    def where(self) -> str:
        """``path:line`` of the opening fence, for messages."""
        return f"{self.path}:{self.line}"


def doc_files(root: Path) -> list[Path]:
    """README.md and every docs/**/*.md under ``root``, sorted (stable test ids)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _is_command_line(line: str) -> bool:
    stripped = line.strip()
    return stripped.startswith("$ ") or stripped.startswith(COMMAND_WORDS)


def _join_continued(lines: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines ending in ``\\`` joined to the next (numbers: the first line's)."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + "\n" + line
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip())
            continue
        pending = None
        joined.append((number, line))
    if pending is not None:
        joined.append(pending)
    return joined


def _console_commands(body: Sequence[tuple[int, str]]) -> list[Command]:
    """``$ `` lines are commands, the rest their shown output; ``$ echo $?`` then N
    means the command before it exits N."""
    entries: list[tuple[int, str, list[str]]] = []  # line, command, shown output
    continuing = False
    for number, raw in body:
        line = raw.strip()
        if continuing:
            line = strip_comment(line)
            entries[-1] = (entries[-1][0], entries[-1][1] + "\n" + line, [])
            continuing = line.endswith("\\")
        elif line.startswith("$ "):
            line = strip_comment(line[2:])
            entries.append((number, line, []))
            continuing = line.endswith("\\")
        elif entries and line:
            entries[-1][2].append(line)
    expect: dict[int, int] = {}
    for index, (_, text, shown) in enumerate(entries):
        if text.strip() == "echo $?" and index > 0 and shown and shown[0].isdigit():
            expect[index - 1] = int(shown[0])
    return [
        Command(text, number, expect.get(i, 0), tuple(shown))
        for i, (number, text, shown) in enumerate(entries)
    ]


def _shown_pattern(line: str) -> re.Pattern[str]:
    parts = [re.sub(r"\\?\d+", r"\\d+", re.escape(part)) for part in line.split("…")]
    return re.compile(".*".join(parts))


def unshown_output(shown: Sequence[str], output: str) -> list[str]:
    """The shown lines ``output`` lacks: each must match a later line of it, in
    order; ``…`` stands for any text and a number for any number (ids, times and
    counts vary from run to run)."""
    actual = [line.strip() for line in output.splitlines()]
    missing = []
    position = 0
    for line in shown:
        pattern = _shown_pattern(line)
        found = next(
            (i for i in range(position, len(actual)) if pattern.fullmatch(actual[i])), None
        )
        if found is None:
            missing.append(line)
        else:
            position = found + 1
    return missing


def strip_comment(line: str) -> str:
    """``line`` without its shell comment (a ``#`` starting a word outside quotes)."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def _script_commands(body: Sequence[tuple[int, str]]) -> list[Command]:
    lines = [(n, strip_comment(line)) for n, line in body]
    lines = [(n, line) for n, line in lines if line.strip()]
    return [Command(text.strip(), n) for n, text in _join_continued(lines)]


def _block(path: Path, line: int, lang: str, body: list[tuple[int, str]]) -> Block | None:
    """The command block of a fence, or None when it is not one."""
    texts = [text for _, text in body if text.strip() and not text.strip().startswith("#")]
    if lang not in SHELL_LANGUAGES and not (lang == "" and texts and _is_command_line(texts[0])):
        return None
    console = lang == "console" or any(t.strip().startswith("$ ") for t in texts)
    commands = _console_commands(body) if console else _script_commands(body)
    return Block(path, line, lang, commands)


def _apply_marker(block: Block, marker: re.Match[str] | None) -> None:
    if marker is None:
        return
    kind, arg = marker["kind"], (marker["arg"] or "").strip()
    if kind == "synopsis" and not arg:
        block.skip = "synopsis"
        block.synopsis = True
        return
    if kind not in ("skip", "needs") or not arg:
        raise DocError(
            f"{block.where}: marker {marker.group(0).strip()!r}: use "
            "'<!-- doc-test: skip: REASON -->', '<!-- doc-test: needs: PROGRAM -->' "
            "or '<!-- doc-test: synopsis -->'"
        )
    if kind == "skip":
        block.skip = arg
    else:
        block.needs = arg


def parse_doc(path: Path, text: str) -> list[Block]:
    """The command blocks of one doc (hidden setup blocks included), in order.

    Raises DocError for a malformed marker, a marker with no command block after
    it, or an unterminated block.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    used: set[int] = set()  # the lines of markers that found their block
    index = 0
    while index < len(lines):
        line = lines[index]
        if _HIDDEN_START.match(line):
            start = index
            body: list[tuple[int, str]] = []
            index += 1
            while index < len(lines) and lines[index].strip() != "-->":
                body.append((index + 1, lines[index]))
                index += 1
            if index == len(lines):
                raise DocError(f"{path}:{start + 1}: hidden doc-test block never ends ('-->')")
            blocks.append(Block(path, start + 1, "sh", _script_commands(body), hidden=True))
            index += 1
            continue
        fence = _FENCE.match(line)
        if fence is None:
            index += 1
            continue
        start = index
        body = []
        index += 1
        closing = fence["fence"]
        while index < len(lines) and not lines[index].strip().startswith(closing):
            body.append((index + 1, lines[index]))
            index += 1
        if index == len(lines):
            raise DocError(f"{path}:{start + 1}: code block never closed")
        index += 1
        block = _block(path, start + 1, fence["lang"].lower(), body)
        if block is None:
            continue
        above = next((n for n in range(start - 1, -1, -1) if lines[n].strip()), None)
        if above is not None and _MARKER.match(lines[above]):
            _apply_marker(block, _MARKER.match(lines[above]))
            used.add(above)
        blocks.append(block)
    stray = [n for n, line in enumerate(lines) if _MARKER.match(line) and n not in used]
    if stray:
        raise DocError(f"{path}:{stray[0] + 1}: a doc-test marker not just before a command block")
    return blocks


def _placeholder_pattern(placeholder: str) -> re.Pattern[str]:
    parts = [re.escape(part) for part in placeholder.split("…")]
    return re.compile(r"(?<![\w.-])" + _ID_CHARS.join(parts) + r"(?![A-Za-z0-9_-])")


def fill_placeholders(command: str, outputs: Iterable[str]) -> str:
    """``command`` with each ``PREFIX…`` placeholder replaced by the last match in
    ``outputs`` (earlier commands' output, oldest first).

    Raises DocError naming a placeholder nothing printed, or one with no prefix.
    """
    history = list(outputs)

    def fill(match: re.Match[str]) -> str:
        placeholder = match.group(0).rstrip(".:")
        rest = match.group(0)[len(placeholder) :]
        if placeholder.startswith("…"):
            raise DocError(
                f"placeholder {placeholder!r} has no prefix to find it by (write e.g. 'ag_…')"
            )
        pattern = _placeholder_pattern(placeholder)
        for output in reversed(history):
            found = pattern.findall(output)
            if found:
                return str(found[-1]) + rest
        raise DocError(f"placeholder {placeholder!r}: no earlier command printed one")

    return _PLACEHOLDER.sub(fill, command)


def remap_ports(command: str, ports: Mapping[int, int]) -> str:
    """``command`` with each documented port (after ``:`` or a space) replaced."""
    for documented, actual in ports.items():
        command = re.sub(rf"(?<=[:\s]){documented}\b", str(actual), command)
    return command


def is_background(command: str) -> bool:
    """Whether the command ends in ``&`` (comments and quotes read as bash does)."""
    lexer = shlex.shlex(command, posix=False, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return False
    return bool(tokens) and tokens[-1] == "&"
