"""Every command of README.md and docs/**/*.md runs as written, against real processes.

The commands are read from the docs at test time (tests/helpers/doc_commands.py
says which blocks count, how a block is skipped with a reason and how
placeholders are filled), so a changed doc is tested as changed. Each doc runs
in its own sandboxed bash session (tests/helpers/doc_shell.py). A doc's summary
(commands run, blocks skipped and why) is printed: ``pytest -rA`` shows it, and
a failure shows it with the failing command.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.doc_commands import Block, Command, DocError, doc_files, parse_doc
from tests.helpers.doc_shell import DocShell

ROOT = Path(__file__).resolve().parents[2]
DOCS = [path.relative_to(ROOT) for path in doc_files(ROOT)]

pytestmark = pytest.mark.integration


def _skip_reason(block: Block) -> str | None:
    if block.skip is not None:
        return block.skip
    if block.needs is not None and shutil.which(block.needs) is None:
        return f"{block.needs} is not installed"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_doc_commands_run_as_written(doc: Path) -> None:
    blocks = parse_doc(doc, (ROOT / doc).read_text())
    runnable = [block for block in blocks if _skip_reason(block) is None]
    skipped = [f"  skipped {b.where}: {_skip_reason(b)}" for b in blocks if b not in runnable]
    ran = 0

    def summary() -> str:
        return "\n".join([f"{doc}: ran {ran} commands, skipped {len(skipped)} blocks", *skipped])

    if runnable:
        with DocShell() as shell:
            for block in runnable:
                for command in block.commands:
                    try:
                        shell.run(command, f"{doc}:{command.line}")
                    except Exception as error:
                        raise AssertionError(
                            f"{error}\n(fix the doc, or mark the block with "
                            "'<!-- doc-test: skip: REASON -->' on the line before it)\n" + summary()
                        ) from None
                    ran += 1
    print(summary())


def test_the_shell_carries_state_checks_exit_codes_and_names_what_it_cannot_run() -> None:
    page = """\
```console
$ export GREETING=hello
$ cd ~ && pwd
$ echo "$GREETING" ag_01x
$ false
$ echo $?
1
$ echo ag_…
```

```sh
sleep 600 &
```
"""
    console, background = parse_doc(Path("page.md"), page)
    with DocShell() as shell:
        outputs = [shell.run(command, "page.md") for command in console.commands]
        assert outputs[1].strip() == str(shell.home)  # never the real home
        assert outputs[2] == "hello ag_01x\n"
        assert outputs[4:] == ["1\n", "ag_01x\n"]  # `false` exited 1 as the doc shows
        with pytest.raises(AssertionError, match=r"page.md: 'false' exited 1, the doc expects 0"):
            shell.run(Command("false", 1), "page.md")
        with pytest.raises(AssertionError, match=r"did not print what the doc shows: \['bye'\]"):
            shell.run(Command("echo hi", 1, shown=("bye",)), "page.md")
        shell.outputs.clear()
        with pytest.raises(DocError, match="'ag_…': no earlier command printed one"):
            shell.run(Command("echo ag_…", 1), "page.md")
        with pytest.raises(DocError, match="READY has no readiness check"):
            shell.run(background.commands[0], "page.md")
        (pid,) = shell.jobs
    with pytest.raises(ProcessLookupError):  # the session's jobs were stopped with it
        os.kill(pid, 0)
