"""One bash session that runs a doc's commands as a reader would type them.

``DocShell`` keeps one ``bash`` process per doc, so ``export``, ``cd``, shell
variables and ``&`` jobs carry from one command to the next, in a sandbox: HOME,
the XDG folders and the temp folder point into a fresh folder, no ``AGENTS_*``
or ``AWS_*`` variable of the caller leaks in, and the documented ports
(``doc_commands.WELL_KNOWN_PORTS``) are free loopback ports of this run (the
control plane's default listeners included, through its environment).

Each command's output goes to its own file, which is how placeholders of later
commands are filled. A command ending in ``&`` is waited for until it is ready,
by the check in ``READY`` for its program: a daemon the table does not know
fails the test, naming the table. At exit the session's process group (bash and
everything it started) gets SIGTERM, then SIGKILL after a deadline.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from machine.config import resolve_data_dir
from tests.helpers.doc_commands import (
    WELL_KNOWN_PORTS,
    Command,
    DocError,
    fill_placeholders,
    is_background,
    remap_ports,
    unshown_output,
)
from tests.helpers.machine_proc import SYSTEMD_NOTIFY_VARIABLES
from tests.helpers.moto_server import free_port
from tests.helpers.poll import poll_until

__all__ = ["DocShell", "CommandFailed"]

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(sys.executable).parent.parent
COMMAND_DEADLINE = 60.0
READY_DEADLINE = 30.0
STOP_DEADLINE = 20.0


class CommandFailed(AssertionError):
    """A doc command exited with another code than the doc shows."""


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class DocShell:
    """A sandboxed bash session for one doc (a context manager)."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="doc")  # short: socket paths
        self.work = Path(self._tmp.name)
        self.home = self.work / "home"
        self.ports = {port: free_port() for port in WELL_KNOWN_PORTS}
        self.outputs: list[str] = []
        #: Process ids of the jobs started with ``&``, oldest first.
        self.jobs: list[int] = []
        self._count = 0
        self._bash: subprocess.Popen[bytes] | None = None
        self.env = self._sandbox_env()

    def _sandbox_env(self) -> dict[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("AGENTS_", "AWS_", "XDG_", "VIRTUAL_ENV"))
            and name not in SYSTEMD_NOTIFY_VARIABLES
        }
        for name, folder in [
            ("HOME", "home"),
            ("XDG_CONFIG_HOME", "home/.config"),
            ("XDG_DATA_HOME", "home/.local/share"),
            ("XDG_STATE_HOME", "home/.local/state"),
            ("XDG_CACHE_HOME", "home/.cache"),
            ("XDG_RUNTIME_DIR", "run"),
            ("TMPDIR", "tmp"),
        ]:
            path = self.work / folder
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            env[name] = str(path)
        env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONPATH"] = str(ROOT)  # this checkout's code, whatever the venv installed
        # The control plane's defaults are the documented ports: map them too.
        env["AGENTS_CONTROL_LISTEN"] = f"127.0.0.1:{self.ports[7443]}"
        env["AGENTS_CONTROL_LINK_LISTEN"] = f"127.0.0.1:{self.ports[7444]}"
        env["AGENTS_CONTROL_METRICS"] = f"127.0.0.1:{self.ports[9470]}"
        return env

    def __enter__(self) -> DocShell:
        log = (self.work / "bash.log").open("wb")
        self._bash = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=self.env,
            start_new_session=True,  # its own process group: stopped as one at exit
        )
        log.close()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._stop()
        finally:
            self._tmp.cleanup()

    def _stop(self) -> None:
        bash = self._bash
        if bash is None:
            return
        assert bash.stdin is not None
        bash.stdin.close()
        group = bash.pid

        def gone() -> bool:
            bash.poll()  # reap bash itself, or the group never empties
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return True
            return False

        try:
            os.killpg(group, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            poll_until(gone, deadline=STOP_DEADLINE, what="the doc's processes to stop")
        except TimeoutError:
            os.killpg(group, signal.SIGKILL)
            poll_until(gone, deadline=5, what="the doc's processes to die")

    def log(self) -> str:
        """What bash itself printed (syntax errors, job notices)."""
        return (self.work / "bash.log").read_text(errors="replace")

    def prepare(self, command: Command) -> str:
        """The command as it will run: ports mapped, the venv, placeholders filled."""
        text = remap_ports(command.text, self.ports)
        text = re.sub(r"(?<![\w/.-])\.venv/", f"{VENV}/", text)
        return fill_placeholders(text, self.outputs)

    def run(self, command: Command, where: str) -> str:
        """Run one command; return its output. Raises CommandFailed on an unexpected
        exit code, DocError when it cannot run as written."""
        assert self._bash is not None and self._bash.stdin is not None
        text = self.prepare(command)
        self._count += 1
        out, rc, pid = (self.work / f"cmd{self._count}.{kind}" for kind in ("out", "rc", "pid"))
        q = shlex.quote
        script = (
            f"{{ {text}\n}} >{q(str(out))} 2>&1 </dev/null\n"
            f"__rc=$?; echo $! >{q(str(pid))}; echo $__rc >{q(str(rc))}.tmp; "
            f"mv {q(str(rc))}.tmp {q(str(rc))}; (exit $__rc)\n"
        )
        self._bash.stdin.write(script.encode())
        self._bash.stdin.flush()
        bash = self._bash

        def finished() -> bool:
            if bash.poll() is not None:
                raise CommandFailed(f"{where}: bash exited running {text!r}:\n{self.log()}")
            return rc.exists()

        poll_until(
            finished,
            deadline=COMMAND_DEADLINE,
            what=f"{where}: {text!r}",
            fail=lambda: CommandFailed(
                f"{where}: {text!r} still running after {COMMAND_DEADLINE}s "
                f"(end it with & if it serves):\n{out.read_text(errors='replace')}"
            ),
        )
        code = int(rc.read_text())
        if is_background(text):
            self.jobs.append(int(pid.read_text()))
            self._wait_ready(text, self.jobs[-1], out, where)
            return ""
        output = out.read_text(errors="replace")
        if code != command.expect_code:
            raise CommandFailed(
                f"{where}: {text!r} exited {code}, the doc expects {command.expect_code}:\n{output}"
            )
        missing = unshown_output(command.shown, output)
        if missing:
            raise CommandFailed(
                f"{where}: {text!r} did not print what the doc shows: {missing}; it printed:\n"
                f"{output}"
            )
        self.outputs.append(output)
        return output

    def _wait_ready(self, text: str, pid: int, out: Path, where: str) -> None:
        found = next(((p.search(text), check) for p, check in READY if p.search(text)), None)
        if found is None:
            raise DocError(
                f"{where}: {text!r} runs in the background but tests/helpers/doc_shell.py "
                "READY has no readiness check for it"
            )
        match, check = found
        assert match is not None

        def ready() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise CommandFailed(
                    f"{where}: {text!r} exited:\n{out.read_text(errors='replace')}"
                ) from None
            return check(self, match)

        poll_until(
            ready,
            deadline=READY_DEADLINE,
            what=f"{where}: {text!r} ready",
            fail=lambda: CommandFailed(
                f"{where}: {text!r} not ready in {READY_DEADLINE}s:\n"
                f"{out.read_text(errors='replace')}"
            ),
        )

    def path(self, written: str) -> Path:
        """A path as a doc wrote it (``~`` is the sandbox's home, relative is the root)."""
        if written == "~" or written.startswith("~/"):
            return self.home / written[2:]
        return ROOT / written


def _serve_ready(shell: DocShell, match: re.Match[str]) -> bool:
    home = shell.path(match["home"] or "~/.agents-control")
    return (home / "serve.json").exists()


def _machine_ready(shell: DocShell, match: re.Match[str]) -> bool:
    data = resolve_data_dir(match["data"], shell.env, shell.home)
    if match["data"]:
        data = shell.path(match["data"])
    return (data / "machine.sock").exists()


#: How a daemon started with ``&`` is known to be ready, by its command line.
READY: list[tuple[re.Pattern[str], Callable[[DocShell, re.Match[str]], bool]]] = [
    (
        re.compile(r"^moto_server\b.*\s-p\s+(?P<port>\d+)"),
        lambda shell, match: _listening(int(match["port"])),
    ),
    (re.compile(r"^agents-control\s+serve\b(?:.*\s--home\s+(?P<home>\S+))?"), _serve_ready),
    (
        re.compile(r"^agents-machine\b(?=.*\s(?:serve|join)\b)(?:.*\s--data-dir\s+(?P<data>\S+))?"),
        _machine_ready,
    ),
]
