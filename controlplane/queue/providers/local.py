"""The ``local`` provider: start a machine as a command on the control plane's host.

Meant for a machine that lives beside the control plane (a development box,
the drill, the tests): ``agents-machine serve --data-dir D``. The command runs
in its own session, so it outlives the control plane, with a small
environment (PATH, HOME, LANG and the settings' ``env``): the control plane's
own credentials are never handed to it. Its output goes to a log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Final

from controlplane.queue.providers.base import LocalSettings, ProviderState, ProviderStatus
from shared.atomic import ensure_private_dir
from shared.errors import ProviderError

__all__ = ["LocalProvider"]

logger = logging.getLogger(__name__)

_PASSED_ENV: Final = ("PATH", "HOME", "LANG")


class LocalProvider:
    """Runs the configured command once asked, and watches it."""

    name = "local"

    def __init__(self, settings: LocalSettings, *, log_dir: Path) -> None:
        self._settings = settings
        self._log_dir = log_dir
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._exit: int | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The running command's pid, if this provider started one that still runs."""
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def start(self) -> ProviderStatus:
        async with self._lock:
            if self._proc is not None and self._proc.returncode is None:
                return ProviderStatus(ProviderState.RUNNING, f"pid {self._proc.pid}")
            env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
            env.update(self._settings.env)
            ensure_private_dir(self._log_dir)
            log_path = self._log_dir / "local-provider.log"
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self._settings.command,
                    cwd=self._settings.cwd,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=fd,
                    stderr=fd,
                    start_new_session=True,
                )
            except OSError as e:
                raise ProviderError(
                    "provider local", f"cannot run {self._settings.command[0]!r}: {e.strerror}"
                ) from None
            finally:
                os.close(fd)
            self._exit = None
            self._watch = asyncio.create_task(self._wait(self._proc))
            logger.info("provider local: started pid %d", self._proc.pid)
            return ProviderStatus(ProviderState.STARTING, f"pid {self._proc.pid}")

    async def _wait(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self._exit = code
        logger.info("provider local: pid %d exited with %d", proc.pid, code)

    async def status(self) -> ProviderStatus:
        if self._proc is None:
            return ProviderStatus(ProviderState.STOPPED, "not started by this control plane")
        if self._proc.returncode is None:
            return ProviderStatus(ProviderState.RUNNING, f"pid {self._proc.pid}")
        code = self._proc.returncode
        state = ProviderState.STOPPED if code == 0 else ProviderState.FAILED
        return ProviderStatus(state, f"exited with {code}")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
