"""Walk an argparse command tree (for the CLIs' tests)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

__all__ = ["long_options", "positionals"]


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


def long_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--option`` of the tree but ``--help``."""
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= long_options(sub)
        else:
            found |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    return found
