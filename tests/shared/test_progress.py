"""shared.progress: a bar or spinner on a terminal's stderr, nothing in a pipe or
under --json."""

from __future__ import annotations

import io

from shared.progress import Progress, human


class Terminal(io.StringIO):
    """A stream that says it is a terminal, keeping what is written."""

    def isatty(self) -> bool:
        if self.closed:
            raise ValueError("I/O operation on closed file")  # as a real one does
        return True


def test_a_terminal_gets_the_bar_with_its_counts() -> None:
    stream = Terminal()
    with Progress("backing up", stream=stream) as progress:
        assert progress.shown
        progress.update("segments", 3, 8)
    text = stream.getvalue()
    assert "backing up" in text


def test_a_terminal_gets_a_spinner_with_the_bytes_moved() -> None:
    stream = Terminal()
    with Progress("exporting", stream=stream) as progress:
        progress.moved(3 * 1024 * 1024)
        progress.moved(1024 * 1024)
        progress._bar.refresh()  # what the refresh thread does every 0.1 s
    assert "4.0 MiB" in stream.getvalue()


def test_a_pipe_gets_nothing() -> None:
    stream = io.StringIO()  # isatty() is False, as for a pipe or a file
    with Progress("exporting", stream=stream) as progress:
        assert not progress.shown
        progress.update("x", 1, 2)
        progress.moved(10, 20)
        progress.note("12 objects deleted")
    assert stream.getvalue() == ""


def test_json_gets_nothing_even_on_a_terminal() -> None:
    stream = Terminal()
    with Progress("verifying", quiet=True, stream=stream) as progress:
        assert not progress.shown
        progress.update("x", 1, 2)
    assert stream.getvalue() == ""


def test_a_closed_stream_is_not_a_terminal() -> None:
    stream = Terminal()
    stream.close()
    with Progress("x", stream=stream) as progress:
        assert not progress.shown


def test_human_sizes() -> None:
    assert [human(n) for n in (0, 1023, 1024, 5 * 1024**3, 3 * 1024**4)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 GiB",
        "3072.0 GiB",
    ]
