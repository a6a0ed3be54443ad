"""The README's start command: the whole system on this machine, shown working.

It starts a control plane on a folder store, creates an account and a join
token, runs the printed ``agents-machine join`` command (which joins, then
serves), waits until the machine is listed online, then creates an agent with
the ``echo`` runtime and prompts it. Both daemons keep running until Ctrl-C
(or exit at once with ``--once``, which the tests use).

Everything lives under ``--workdir`` (default ``.local/demo``), which is
emptied at start: it is demo data only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DEADLINE = 30.0


class DemoError(Exception):
    """A step failed; the message says which."""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(argv: list[str], env: dict[str, str], what: str) -> str:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise DemoError(f"{what} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _wait(check: object, what: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DemoError(f"{what}: the process exited with {proc.returncode}")
        if callable(check) and check():
            return
        time.sleep(0.1)  # polling a condition with a deadline
    raise DemoError(f"{what}: not ready within {DEADLINE:.0f}s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def run(workdir: Path, once: bool) -> int:
    """Run the demo; return an exit code."""
    env = _env()
    control, machine_dir, store = workdir / "control", workdir / "machine", workdir / "store"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True, mode=0o700)
    (workdir / "work").mkdir()
    ctl = [str(BIN / "agents-control")]
    mach = [str(BIN / "agents-machine"), "--data-dir", str(machine_dir)]
    cp_proc: subprocess.Popen[bytes] | None = None
    m_proc: subprocess.Popen[bytes] | None = None
    try:
        print("1. agents-control init (folder store)")
        out = _run(
            [*ctl, "init", "--home", str(control), "--store", str(store),
             "--listen", "127.0.0.1:0", "--link-listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0"],
            env, "init",
        )  # fmt: skip
        cred = re.search(r"^(adm_\S+)$", out, re.M)
        if cred is None:
            raise DemoError("init printed no operator credential")
        env["AGENTS_CONTROL_CREDENTIAL"] = cred.group(1)
        # Demo data only: keep the operator credential where the hints below find it.
        cred_file = workdir / "operator-credential"
        cred_file.touch(mode=0o600)
        cred_file.write_text(cred.group(1) + "\n")
        home = ["--home", str(control)]

        print("2. agents-control serve")
        cp_log = (workdir / "control.log").open("wb")
        cp_proc = subprocess.Popen([*ctl, "serve", *home], env=env, stdout=cp_log, stderr=cp_log)
        _wait(lambda: (control / "serve.json").exists(), "control plane", cp_proc)
        serve = json.loads((control / "serve.json").read_text())
        print(f"   public {serve['public']}, link {serve['link']}")

        print("3. account and join token")
        acct = json.loads(
            _run([*ctl, "account", "create", "--github-id", "1", "--github-login", "demo",
                  "--json", *home], env, "account create")
        )  # fmt: skip
        account_id = acct["account_id"]
        tok = json.loads(
            _run([*ctl, "token", "create", "--account", account_id, "--json", *home],
                 env, "token create")
        )  # fmt: skip
        join = shlex.split(tok["join_command"])
        print(f"   {' '.join(join[:2])} … (token shown once)")

        print("4. agents-machine join (then serve)")
        m_log = (workdir / "machine.log").open("wb")
        argv = [str(BIN / join[0]), *join[1:], "--data-dir", str(machine_dir), "--name", "demo"]
        m_proc = subprocess.Popen(argv, env=env, stdout=m_log, stderr=m_log)

        def online() -> bool:
            proc = subprocess.run(
                [*ctl, "machine", "list", "--json", *home], env=env, capture_output=True
            )
            if proc.returncode != 0:
                return False
            return any(m["online"] for m in json.loads(proc.stdout)["machines"])

        _wait(online, "machine online", m_proc)
        print(_run([*ctl, "machine", "list", *home], env, "machine list"))

        print("5. an echo agent, prompted")
        agent = json.loads(
            _run([*mach, "agent", "create", "demo-agent", "--folder", str(workdir / "work"),
                  "--json"], env, "agent create")
        )  # fmt: skip
        agent_id = agent["agent_id"]
        print(_run([*mach, "agent", "prompt", agent_id, "hello from the demo"], env, "prompt"))
        print(_run([*mach, "agent", "list"], env, "agent list"))
        if once:
            print("demo: OK")
            return 0
        print(f"Running. Data in {workdir}. Try:")
        print(f"  {BIN}/agents-machine --data-dir {machine_dir} agent prompt {agent_id} hi")
        print(
            f"  AGENTS_CONTROL_CREDENTIAL=$(cat {cred_file}) "
            f"{BIN}/agents-control machine list --home {control}"
        )
        print("Ctrl-C stops both daemons.")
        try:
            while cp_proc.poll() is None and m_proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 0
        # One daemon ended by itself: say which, and where its log is, before
        # the other is stopped (the demo runs both or neither).
        for name, proc, log in (
            ("control plane", cp_proc, "control.log"),
            ("machine", m_proc, "machine.log"),
        ):
            if proc.poll() is not None:
                print(
                    f"demo: the {name} exited (code {proc.returncode}); its log is "
                    f"{workdir / log}. Stopping the other daemon.",
                    file=sys.stderr,
                )
        return 1
    except DemoError as e:
        print(f"demo: {e} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        _stop(m_proc)
        _stop(cp_proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=ROOT / ".local" / "demo")
    parser.add_argument("--once", action="store_true", help="show it working, then stop")
    args = parser.parse_args(argv)
    return run(args.workdir.absolute(), args.once)


if __name__ == "__main__":
    sys.exit(main())
