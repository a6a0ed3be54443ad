"""Shell completion for ``agents-machine``: the ``completion SHELL`` verb, and
agent ids completed from the running daemon.

The shell runs ``agents-machine`` with argcomplete's variables set on every
<Tab>; :func:`shared.cli.complete` answers before anything else happens. Where
an agent id goes, the daemon is asked over its local socket, briefly: a daemon
that is down or slow gives no ids and prints nothing (completion must never
spill an error into the command line being typed).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from machine.cli.client import MachineClient
from machine.cli.common import PROG, Ctx, build_config
from shared.cli import ExitCode, completion_script, walk_parsers

__all__ = ["AGENT_ID_ARGS", "ID_TIMEOUT", "add_completers", "agent_ids", "cmd_completion"]

logger = logging.getLogger(__name__)

#: Seconds the daemon gets to list its agents for one <Tab>.
ID_TIMEOUT: Final = 1.0

#: Arguments (by dest) that take agent ids.
AGENT_ID_ARGS: Final = frozenset({"id", "agent", "agents"})


def cmd_completion(ctx: Ctx) -> int:
    """``completion SHELL``: print the script that makes SHELL complete this CLI."""
    ctx.out.write(completion_script(PROG, ctx.args.shell))
    return ExitCode.OK


def agent_ids(
    prefix: str, parsed_args: argparse.Namespace, env: Mapping[str, str], home: Path
) -> dict[str, str]:
    """The daemon's agent ids starting with ``prefix``, each with its name (zsh and
    fish show it); ``{}`` when the daemon cannot say within :data:`ID_TIMEOUT`."""

    async def listed() -> dict[str, str]:
        cfg = build_config(parsed_args, dict(env), home)
        async with MachineClient(cfg) as client:
            agents = await client.list_agents(include_archived=True)
        return {a.id: a.name for a in agents if a.id.startswith(prefix)}

    try:
        return asyncio.run(asyncio.wait_for(listed(), ID_TIMEOUT))
    except Exception:  # down, slow, misconfigured: nothing to offer, nothing printed
        logger.debug("no agent ids to complete", exc_info=True)
        return {}


def add_completers(parser: argparse.ArgumentParser, env: Mapping[str, str], home: Path) -> None:
    """Complete agent ids (:data:`AGENT_ID_ARGS`) from the daemon, everywhere in the tree."""

    def completer(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> dict[str, str]:
        return agent_ids(prefix, parsed_args, env, home)

    for _, sub in walk_parsers(parser):
        for action in sub._actions:
            if action.dest in AGENT_ID_ARGS:
                action.completer = completer  # type: ignore[attr-defined]  # argcomplete's
