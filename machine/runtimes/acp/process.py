"""One ACP agent program: its subprocess and the ACP connection to it.

:meth:`AgentProcess.start` starts the agent's command (cwd = the agent's
folder, in its own process group) and connects the client side of the
``agent-client-protocol`` package to its stdin/stdout;
:meth:`~AgentProcess.initialize` does the ``initialize`` handshake, which
advertises neither file-system nor terminal capabilities. The setup requests
(``initialize``, ``session/new``, ``session/load``, ``session/delete``) each
have a deadline, and every way they fail (no answer, an agent error, the
process gone, a reply that does not fit the schema) becomes a
:class:`~machine.runtimes.base.RuntimeFailed` naming the step and only the
program's base name. :meth:`~AgentProcess.close` leaves no process behind:
stdin closed, then SIGTERM, then SIGKILL to the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import acp
from acp.schema import ClientCapabilities, FileSystemCapabilities, Implementation

from machine.runtimes.acp.client import AcpClient
from machine.runtimes.acp.settings import AcpSettings
from machine.runtimes.base import RuntimeFailed

__all__ = ["AgentProcess"]

logger = logging.getLogger(__name__)

_MAX_SESSION_ID_CHARS = 256
# One JSON-RPC line may carry a large tool result or file; asyncio's 64 KiB
# default line limit would break the connection on it.
_STREAM_LIMIT = 32 * 1024 * 1024
_CLIENT_NAME = "agents-machine"
# JSON-RPC error ACP agents answer for an unknown session: already gone.
_RESOURCE_NOT_FOUND = -32002
_CLIENT_VERSION = "0.1.0"


class AgentProcess:
    """One running agent program and the ACP connection to it.

    ``handshake_timeout`` is the deadline of each setup request (see the
    module docstring); ``session/prompt`` has none, a run takes what it takes.
    """

    def __init__(
        self,
        settings: AcpSettings,
        folder: Path,
        process: asyncio.subprocess.Process,
        conn: Any,
        client: AcpClient,
        *,
        handshake_timeout: float,
    ) -> None:
        self.settings = settings
        self.folder = folder
        self.process = process
        self.conn = conn
        self.client = client
        self.handshake_timeout = handshake_timeout
        self.can_load = False
        self.can_delete = False
        self.sessions: set[str] = set()
        self._stderr_task = asyncio.create_task(self._drain_stderr())

    @classmethod
    async def start(
        cls,
        settings: AcpSettings,
        folder: Path,
        env: Mapping[str, str],
        *,
        handshake_timeout: float,
    ) -> AgentProcess:
        """Start the agent's command in ``folder`` with ``env`` and connect to it.

        The connection is not initialised yet (:meth:`initialize`). RuntimeFailed
        when the program cannot be started.
        """
        try:
            process = await asyncio.create_subprocess_exec(
                *settings.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=folder,
                env=env,
                limit=_STREAM_LIMIT,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise RuntimeFailed(f"acp start {settings.program}: command not found") from None
        except PermissionError:
            raise RuntimeFailed(f"acp start {settings.program}: not executable") from None
        except OSError as exc:
            raise RuntimeFailed(f"acp start {settings.program}: {exc.strerror}") from None
        client = AcpClient()
        conn = acp.connect_to_agent(client, process.stdin, process.stdout)
        return cls(settings, folder, process, conn, client, handshake_timeout=handshake_timeout)

    @property
    def alive(self) -> bool:
        """True until the process has exited."""
        return self.process.returncode is None

    # -- requests ---------------------------------------------------------

    async def initialize(self) -> None:
        """The ``initialize`` handshake: check the protocol version, note what the agent can do."""
        init = await self.request(
            "initialize",
            self.conn.initialize(
                protocol_version=acp.PROTOCOL_VERSION,
                client_capabilities=ClientCapabilities(
                    fs=FileSystemCapabilities(read_text_file=False, write_text_file=False),
                    terminal=False,
                ),
                client_info=Implementation(name=_CLIENT_NAME, version=_CLIENT_VERSION),
            ),
        )
        if init.protocol_version != acp.PROTOCOL_VERSION:
            raise RuntimeFailed(
                f"acp initialize {self.settings.program}: agent speaks protocol version "
                f"{init.protocol_version}, we speak {acp.PROTOCOL_VERSION}"
            )
        caps = init.agent_capabilities
        self.can_load = bool(caps is not None and caps.load_session)
        session_caps = caps.session_capabilities if caps is not None else None
        self.can_delete = session_caps is not None and session_caps.delete is not None

    async def request(self, step: str, call: Any) -> Any:
        """Await one setup request with a deadline, mapping failures to RuntimeFailed."""
        program = self.settings.program
        try:
            return await asyncio.wait_for(call, self.handshake_timeout)
        except TimeoutError:
            raise RuntimeFailed(
                f"acp {step} {program}: no answer within {self.handshake_timeout:g}s"
            ) from None
        except acp.RequestError as exc:
            if exc.code == -32000:
                raise RuntimeFailed(
                    f"acp {step} {program}: the agent needs authentication; "
                    "log in with the agent's own CLI first"
                ) from None
            raise RuntimeFailed(f"acp {step} {program}: agent error {exc.code}: {exc}") from None
        except OSError:
            # ConnectionError (the pipe closed) is an OSError: the agent went away.
            code = await self.exit_code(2.0)
            raise RuntimeFailed(
                f"acp {step} {program}: agent process exited (code {code})"
            ) from None
        except (ValueError, TypeError) as exc:
            # pydantic's ValidationError is a ValueError: the reply did not fit the schema.
            raise RuntimeFailed(
                f"acp {step} {program}: malformed reply ({type(exc).__name__})"
            ) from None

    async def open_session(self, folder: Path, wanted: str | None) -> str:
        """The session a run uses: ``wanted`` if this process has or can load it, else a new one."""
        cwd = str(folder.resolve())
        if wanted and wanted in self.sessions:
            return wanted
        if wanted and self.can_load:
            try:
                await self.request(
                    "session/load", self.conn.load_session(cwd=cwd, session_id=wanted)
                )
            except RuntimeFailed as exc:
                if not self.alive:
                    raise
                logger.warning(
                    "acp: could not load the agent's session, starting a new one: %s", exc
                )
            else:
                self.sessions.add(wanted)
                return wanted
        elif wanted:
            logger.info(
                "acp agent %s cannot load sessions; starting a new one", self.settings.program
            )
        resp = await self.request("session/new", self.conn.new_session(cwd=cwd))
        session_id = resp.session_id
        if not session_id or len(session_id) > _MAX_SESSION_ID_CHARS:
            raise RuntimeFailed(f"acp session/new {self.settings.program}: bad session id")
        self.sessions.add(session_id)
        return str(session_id)

    async def delete_on_agent(self, session_id: str) -> bool:
        """``session/delete`` for ``session_id``; an unknown session counts as deleted."""
        program = self.settings.program
        # The package knows session/delete's schema but has no client method for
        # it yet: send the request on its connection ourselves.
        call = self.conn._conn.send_request("session/delete", {"sessionId": session_id})
        try:
            await asyncio.wait_for(call, self.handshake_timeout)
        except acp.RequestError as exc:
            if exc.code == _RESOURCE_NOT_FOUND:
                return True  # a missing session is a deleted one
            raise RuntimeFailed(
                f"acp session/delete {program}: agent error {exc.code}: {exc}"
            ) from None
        except TimeoutError:
            raise RuntimeFailed(
                f"acp session/delete {program}: no answer within {self.handshake_timeout:g}s"
            ) from None
        except OSError:
            code = await self.exit_code(2.0)
            raise RuntimeFailed(
                f"acp session/delete {program}: agent process exited (code {code})"
            ) from None
        return True

    async def prompt_failure(self, error: Exception) -> RuntimeFailed:
        """The RuntimeFailed for a ``session/prompt`` request that failed with ``error``."""
        program = self.settings.program
        if isinstance(error, acp.RequestError):
            return RuntimeFailed(f"acp session/prompt {program}: agent error {error.code}: {error}")
        if isinstance(error, OSError):
            code = await self.exit_code(2.0)
            return RuntimeFailed(
                f"acp session/prompt {program}: agent process exited (code {code}) during the run"
            )
        return RuntimeFailed(
            f"acp session/prompt {program}: protocol error ({type(error).__name__})"
        )

    # -- the process ------------------------------------------------------

    async def _drain_stderr(self) -> None:
        # Read stderr so a chatty agent never blocks on a full pipe. It is
        # the agent's own output and may hold anything: debug level only.
        stream = self.process.stderr
        if stream is None:
            return
        with contextlib.suppress(Exception):
            while line := await stream.readline():
                logger.debug(
                    "acp agent %s stderr: %s",
                    self.settings.program,
                    line[:500].decode("utf-8", "replace").rstrip(),
                )

    async def exit_code(self, timeout: float) -> int | None:
        """The process's exit code, waiting up to ``timeout`` seconds for it to exit."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), timeout)
        return self.process.returncode

    def _signal(self, sig: signal.Signals) -> None:
        if self.process.returncode is not None:
            return
        # The agent runs in its own session; signal the group so tools it
        # started go too. The group id is the pid, still ours while unreaped.
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.process.send_signal(sig)

    async def close(self, grace: float) -> None:
        """Close stdin, wait ``grace`` seconds, then SIGTERM, then SIGKILL."""
        try:
            with contextlib.suppress(Exception):
                await self.conn.close()
            if self.process.stdin is not None:
                with contextlib.suppress(Exception):
                    self.process.stdin.close()
            if await self.exit_code(grace) is None:
                self._signal(signal.SIGTERM)
                if await self.exit_code(grace) is None:
                    self._signal(signal.SIGKILL)
                    await self.process.wait()
        finally:
            # Even when cancelled halfway, leave no process behind.
            self._signal(signal.SIGKILL)
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stderr_task
