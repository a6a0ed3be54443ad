"""The rooms of each daemon and what each may import (ARCHITECTURE.md §2, STYLE.md 28).

Each package under ``machine/`` and ``controlplane/`` is a room; a module
directly in the daemon's folder is an entry module (wiring, config, the leaves
every room shares). ``ALLOWED`` lists, for each room and entry module, the
other rooms and entry modules of its daemon it may import; anything not listed
is forbidden. Imports are read from the source (every ``import`` statement,
also those inside functions and ``if TYPE_CHECKING:``), so a lazy import
counts like any other. ``shared`` imports neither daemon, and neither daemon
imports the other.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("machine", "controlplane")

# The leaves every room of a daemon may use: they import nothing of the daemon.
_MACHINE_LEAVES = {"machine.models", "machine.metrics", "machine.version"}
_CONTROL_LEAVES = {"controlplane.config", "controlplane.metrics"}

# machine: storage at the bottom, the conversation core on it, then the
# capabilities that use the core, then the API, the entry modules and the CLI.
_M_LOW = {"machine.storage", "machine.formats", *_MACHINE_LEAVES}
_M_ROOMS = {
    *_M_LOW,
    "machine.runtimes",
    "machine.core",
    "machine.schedules",
    "machine.erasure",
    "machine.link",
    "machine.backups",
}
# controlplane: the trusted store at the bottom, then accounts, machines, the
# queue and deletion, recovery over them, the servicers, the daemon, the CLI.
_C_LOW = {"controlplane.integrity", *_CONTROL_LEAVES}
_C_DOMAIN = {*_C_LOW, "controlplane.access", "controlplane.machines"}
_C_ROOMS = {
    *_C_DOMAIN,
    "controlplane.queue",
    "controlplane.deletion",
    "controlplane.recovery",
}

ALLOWED: dict[str, set[str]] = {
    "machine": {"machine.config", "machine.version"},
    **{leaf: set() for leaf in _MACHINE_LEAVES},
    "machine.formats": set(),
    "machine.storage": {"machine.formats", "machine.models"},
    "machine.runtimes": {"machine.models"},
    "machine.core": _M_LOW | {"machine.runtimes"},
    "machine.schedules": _M_LOW | {"machine.core"},
    "machine.erasure": _M_LOW | {"machine.core", "machine.runtimes"},
    "machine.link": {"machine.core", "machine.storage", *_MACHINE_LEAVES},
    "machine.backups": _M_LOW | {"machine.core", "machine.link"},
    "machine.config": {"machine.formats", "machine.runtimes", "machine.backups"},
    "machine.app": _M_ROOMS | {"machine.config"},
    "machine.api": (_M_ROOMS - {"machine.runtimes"}) | {"machine.app", "machine.config"},
    "machine.daemon": {
        "machine.app",
        "machine.api",
        "machine.config",
        "machine.link",
        *_MACHINE_LEAVES,
    },
    # The CLI sits on top: it may use every room; nothing imports it.
    "machine.cli": _M_ROOMS | {"machine.app", "machine.api", "machine.config", "machine.daemon"},
    "controlplane": set(),
    **{leaf: set() for leaf in _CONTROL_LEAVES},
    "controlplane.integrity": set(_CONTROL_LEAVES),
    "controlplane.access": _C_LOW,
    "controlplane.machines": _C_LOW | {"controlplane.access"},
    "controlplane.queue": _C_DOMAIN,
    "controlplane.deletion": _C_DOMAIN,
    "controlplane.services": _C_DOMAIN | {"controlplane.deletion"},
    "controlplane.recovery": _C_DOMAIN | {"controlplane.services"},
    "controlplane.api": _C_ROOMS,
    # Replicas over NATS (only serve --cluster loads it): presence, routing, the lease.
    "controlplane.cluster": _C_LOW,
    "controlplane.server": _C_ROOMS
    | {"controlplane.api", "controlplane.services", "controlplane.cluster"},
    "controlplane.cli": _C_ROOMS
    | {"controlplane.api", "controlplane.services", "controlplane.server"},
}


def module_name(path: Path, root: Path) -> str:
    """``machine/core/runs.py`` -> ``machine.core.runs`` (a package is its folder's name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(source: str, modules: set[str]) -> Iterator[tuple[int, str]]:
    """Every (line, module) a source imports, ``from a import b`` naming ``a.b``
    when that is a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield node.lineno, full if full in modules else node.module


def room_of(module: str, root: Path) -> str | None:
    """The room (``machine.core``) or entry module (``machine.app``) a module is in;
    None outside the two daemons."""
    parts = module.split(".")
    if parts[0] not in DAEMONS:
        return None
    if len(parts) == 1:
        return parts[0]
    return f"{parts[0]}.{parts[1]}"


def violations(root: Path, files: Iterable[Path]) -> list[str]:
    """Each import of a room or entry module that ``ALLOWED`` does not list."""
    files = list(files)
    modules = {module_name(f, root) for f in files}
    found = []
    for f in files:
        mod = module_name(f, root)
        top = mod.split(".")[0]
        own = room_of(mod, root)
        for line, target in imported(f.read_text(), modules):
            other = target.split(".")[0]
            where = f"{f.relative_to(root)}:{line} imports {target}"
            if top == "shared" and other in DAEMONS:
                found.append(f"{where}: shared imports neither daemon")
                continue
            if top in DAEMONS and other in DAEMONS and other != top:
                found.append(f"{where}: one daemon never imports the other")
                continue
            theirs = room_of(target, root)
            if own is None or theirs is None or theirs == own:
                continue
            allowed = ALLOWED.get(own)
            if allowed is None:
                found.append(f"{where}: {own} is not in the import rules (add it)")
            elif theirs not in allowed:
                found.append(f"{where}: {own} may not import {theirs}")
    return found


def _sources(root: Path) -> list[Path]:
    out = []
    for pkg in ("shared", *DAEMONS):
        out += [p for p in (root / pkg).rglob("*.py") if "pb" not in p.relative_to(root).parts]
    return out


def cycles(root: Path, files: Iterable[Path]) -> list[list[str]]:
    """Import cycles between modules (every import counted, lazy ones too)."""
    files = list(files)
    modules = {module_name(f, root) for f in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for f in files:
        mod = module_name(f, root)
        for _, target in imported(f.read_text(), modules):
            # ``from pkg import name`` also runs pkg/__init__: that is not a cycle of ours.
            if target in modules and target != mod and not mod.startswith(target + "."):
                graph[mod].add(target)
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_every_room_imports_only_what_the_rules_allow() -> None:
    assert violations(ROOT, _sources(ROOT)) == []


def test_no_module_import_cycle() -> None:
    assert cycles(ROOT, _sources(ROOT)) == []


def test_every_package_is_a_room_with_rules_and_a_docstring() -> None:
    for daemon in DAEMONS:
        for init in (ROOT / daemon).glob("*/__init__.py"):
            room = f"{daemon}.{init.parent.name}"
            assert room in ALLOWED, room
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and "import" in doc, f"{room}: say what it holds and may import"


def test_each_daemon_folder_holds_only_entry_modules() -> None:
    for daemon in DAEMONS:
        entries = sorted(p.name for p in (ROOT / daemon).glob("*.py"))
        assert len(entries) <= 8, (daemon, entries)


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "machine/storage/bad.py",
            "from machine.link.client import LinkClient\n",
            "machine.storage may not import machine.link",
        ),
        (
            "machine/core/bad.py",
            "def f():\n    from machine.backups import engine\n",
            "machine.core may not import machine.backups",
        ),
        ("machine/backups/bad.py", "import machine.cli.main\n", "may not import machine.cli"),
        ("shared/bad.py", "from controlplane import services\n", "shared imports neither"),
        ("machine/bad.py", "from controlplane.config import X\n", "never imports the other"),
        (
            "controlplane/integrity/bad.py",
            "from controlplane.access.accounts import AccountService\n",
            "controlplane.integrity may not import controlplane.access",
        ),
    ],
)
def test_a_forbidden_import_is_reported(
    tmp_path: Path, path: str, source: str, expected: str
) -> None:
    files = []
    for name in (
        "machine/__init__.py",
        "machine/storage/__init__.py",
        "machine/core/__init__.py",
        "machine/backups/__init__.py",
        "machine/backups/engine.py",
        "machine/link/__init__.py",
        "machine/link/client.py",
        "machine/cli/__init__.py",
        "machine/cli/main.py",
        "controlplane/__init__.py",
        "controlplane/services.py",
        "controlplane/config.py",
        "controlplane/integrity/__init__.py",
        "controlplane/access/__init__.py",
        "controlplane/access/accounts.py",
        "shared/__init__.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
        files.append(tmp_path / name)
    bad = tmp_path / path
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text(source)
    found = violations(tmp_path, [*files, bad])
    assert len(found) == 1 and expected in found[0], found


def test_a_cycle_is_reported(tmp_path: Path) -> None:
    (tmp_path / "machine" / "core").mkdir(parents=True)
    a = tmp_path / "machine" / "core" / "a.py"
    b = tmp_path / "machine" / "core" / "b.py"
    a.write_text("from machine.core.b import x\n")
    b.write_text("def f():\n    from machine.core import a\n")
    assert cycles(tmp_path, [a, b]) == [["machine.core.a", "machine.core.b", "machine.core.a"]]


def test_the_architecture_page_names_only_modules_that_exist() -> None:
    """docs/architecture.md walks a prompt, a backup and a queued prompt through the
    rooms: every module path it names must be where it says."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:machine|controlplane|shared)/[\w/]+\.py)`", page))
    assert len(named) > 30, "the paths are still cited as `pkg/.../module.py`"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert missing == []
