"""Walk an argparse command tree (for the CLIs' tests)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

__all__ = ["positionals"]


def positionals(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[str, argparse.Action]]:
    """Every positional argument of the tree, with the prog of its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from positionals(sub)
        elif not action.option_strings:
            yield parser.prog, action
