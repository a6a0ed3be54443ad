"""Progress of a long verb, for the person at the terminal: the one helper of both
CLIs (``agents-machine backup now``, ``export``, ``agents-control drill``, …).

Shown on stderr, and only when stderr is a terminal and ``--json`` was not
given: a script, a pipe or a log file gets nothing, and stdout stays the
reply's alone. With counts (``done`` of ``total``) it is a bar; without (a
server that only answers at the end) a spinner with the time elapsed and,
where the CLI can count them, the bytes moved so far.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import IO, Any

__all__ = ["Progress", "human"]

logger = logging.getLogger(__name__)


def human(size: int) -> str:
    """A size in B, KiB, MiB or GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError):  # closed
        return False


class Progress:
    """A bar or a spinner on ``stream`` (stderr) while the ``with`` block runs.

    ``quiet`` (``--json``) or a stream that is not a terminal: every method
    does nothing. The display is transient: it is gone when the block ends,
    so the reply (and an error line) is all that stays on the screen.
    """

    def __init__(self, what: str, *, quiet: bool = False, stream: IO[str] | None = None) -> None:
        self._what = what
        self._stream = stream or sys.stderr
        self._shown = not quiet and _is_terminal(self._stream)
        self._bar: Any = None
        self._task: Any = None
        self._moved = 0

    @property
    def shown(self) -> bool:
        """Whether anything is drawn (a terminal, no ``--json``)."""
        return self._shown

    def __enter__(self) -> Progress:
        if self._shown:
            # Imported late: only a person at a terminal pays for rich.
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                console=Console(file=self._stream, force_terminal=True),
                transient=True,
                # The reply goes to stdout after the block; nothing is rerouted.
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self._what, total=None, count="")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, stage: str, done: int, total: int) -> None:
        """A bar: ``done`` of ``total`` in ``stage``."""
        if self._bar is not None:
            self._bar.update(
                self._task,
                description=f"{self._what}: {stage}" if stage else self._what,
                completed=done,
                total=total or None,
                count=f"{done}/{total}" if total else str(done),
            )

    def moved(self, size: int, total: int | None = None) -> None:
        """``size`` more bytes moved (of ``total``, when known: a bar, else a spinner)."""
        self._moved += size
        if self._bar is not None:
            count = human(self._moved) + (f" of {human(total)}" if total else "")
            self._bar.update(self._task, completed=self._moved, total=total, count=count)

    def note(self, text: str) -> None:
        """What the spinner says beside the time (``12 objects deleted``)."""
        if self._bar is not None:
            self._bar.update(self._task, count=text)
