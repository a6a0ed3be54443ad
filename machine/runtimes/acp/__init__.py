"""The ``acp`` runtime: an agent program that speaks the Agent Client Protocol.

The runtime starts the agent's configured command as a subprocess (cwd = the
agent's folder), speaks ACP over its stdin/stdout with the client side of the
``agent-client-protocol`` package, and turns the agent's ``session/update``
notifications into :mod:`machine.runtimes.base` events. ``runtime`` holds
:class:`AcpRuntime` and the registry's hooks; ``settings``, ``process``,
``client``, ``updates`` and ``permissions`` the pieces it drives.

Importing this package loads the ACP SDK (pydantic models, about a second):
the registry (:mod:`machine.runtimes`) imports it on first use only.

May import: ``machine.runtimes.base``, ``machine.runtimes.claude_files``,
``shared``. See docs/runtimes-acp.md.
"""

from machine.runtimes.acp.runtime import (
    KINDS,
    AcpRuntime,
    create_runtime,
    validate_acp_settings,
    validate_settings,
)

__all__ = ["KINDS", "AcpRuntime", "create_runtime", "validate_acp_settings", "validate_settings"]
