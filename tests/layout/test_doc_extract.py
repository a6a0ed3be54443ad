"""The doc-command extractor (tests/helpers/doc_commands.py), and the docs' synopses.

The integration test runs what the extractor finds; these check that it finds
the right commands, fills placeholders from the right output, and that every
synopsis block of the docs names subcommands and options the CLIs have.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tests.helpers.doc_commands import (
    DocError,
    doc_files,
    fill_placeholders,
    is_background,
    parse_doc,
    remap_ports,
    strip_comment,
    unshown_output,
)

ROOT = Path(__file__).resolve().parents[2]

PAGE = """\
# A page

```sh
. .venv/bin/activate      # made by ./scripts/start
moto_server -p 9000 &   # an S3 server
agents-control init --home ~/cp \\
  --store ~/s   # a folder store

export A=1
```

<!-- doc-test: skip: needs systemd -->
```bash
systemctl start agents-machine
```

```console
$ agents-machine agent prompt "$id" ""
agents-machine: prompt: must not be empty
$ echo $?
2
$ agents-machine agent list
```

```json
{"agents": []}
```

```
accounts/<acct>/account.json
```

<!-- doc-test: synopsis -->
```
agents-control token create --account acct_... [--ttl 1h]
```

<!-- doc-test: run
mkdir -p ~/src
-->
"""


def test_a_page_gives_its_command_blocks_with_markers() -> None:
    blocks = parse_doc(Path("page.md"), PAGE)
    assert [(b.line, b.lang, b.skip, b.hidden) for b in blocks] == [
        (3, "sh", None, False),
        (13, "bash", "needs systemd", False),
        (17, "console", None, False),
        (34, "", "synopsis", False),
        (38, "sh", None, True),
    ]
    sh, _, console, synopsis, hidden = blocks
    assert [c.text for c in sh.commands] == [
        ". .venv/bin/activate",
        "moto_server -p 9000 &",
        "agents-control init --home ~/cp \\\n  --store ~/s",
        "export A=1",
    ]
    assert [c.line for c in sh.commands] == [4, 5, 6, 9]
    # The shown `echo $?` and its 2 are what the command before them exits with.
    assert [(c.text, c.expect_code) for c in console.commands] == [
        ('agents-machine agent prompt "$id" ""', 2),
        ("echo $?", 0),
        ("agents-machine agent list", 0),
    ]
    assert console.commands[0].shown == ("agents-machine: prompt: must not be empty",)
    assert synopsis.synopsis
    assert [c.text for c in hidden.commands] == ["mkdir -p ~/src"]


@pytest.mark.parametrize(
    ("page", "message"),
    [
        ("<!-- doc-test: skip: -->\n```sh\nls\n```\n", "skip: REASON"),
        ("<!-- doc-test: maybe -->\n```sh\nls\n```\n", "skip: REASON"),
        ("```sh\nls\n", "never closed"),
        ("<!-- doc-test: skip: old -->\n```json\n{}\n```\n", "page.md:1: .* not just before"),
        ("<!-- doc-test: skip: old -->\n\ntext\n```sh\nls\n```\n", "not just before"),
        ("<!-- doc-test: run\nls\n", "never ends"),
    ],
)
def test_a_malformed_marker_or_block_is_refused(page: str, message: str) -> None:
    with pytest.raises(DocError, match=message):
        parse_doc(Path("page.md"), page)


def test_placeholders_take_the_last_matching_word_printed() -> None:
    outputs = [
        "operator credential (shown once):\nadm_01abc.SeCrEt-_x9\n",
        "account acct_01old.\n",
        "account acct_01new.\nagents-machine join 127.0.0.1:7443 --token tok_01t.s3cr-et "
        "--ca-hash sha256:00ff\n",
    ]
    command = "x --account acct_… --token tok_….… --ca-hash sha256:… --cred adm_…"
    assert fill_placeholders(command, outputs) == (
        "x --account acct_01new --token tok_01t.s3cr-et --ca-hash sha256:00ff "
        "--cred adm_01abc.SeCrEt-_x9"
    )
    with pytest.raises(DocError, match="'ag_…': no earlier command printed one"):
        fill_placeholders("agents-machine agent prompt ag_… hi", outputs)
    with pytest.raises(DocError, match="no prefix"):
        fill_placeholders("init --recovery-public-key agpk1_x …", outputs)
    assert fill_placeholders("no placeholder at all", []) == "no placeholder at all"


def test_shown_output_must_be_printed_in_order_with_ids_and_numbers_free() -> None:
    shown = ["[run run_01…]", "echo: hello", "[done] end_turn, 1 in / 2 out tokens, 4 ms"]
    printed = "[run run_01abc]\necho: hello\n[done] end_turn, 1 in / 2 out tokens, 0 ms\n"
    assert unshown_output(shown, "log line\n" + printed) == []
    assert unshown_output(shown, printed.replace("echo: hello", "echo: bye")) == ["echo: hello"]
    # Out of order is not what the doc shows.
    assert unshown_output(["b", "a"], "a\nb\n") == ["a"]
    assert unshown_output(['{"seq": 3, …}'], '{"seq": 4, "kind": "X"}\n') == []
    assert unshown_output(['{"seq": 3, …}'], '{"kind": "X", "seq": 4}\n') == ['{"seq": 3, …}']


def test_ports_comments_and_background_jobs() -> None:
    ports = {9000: 41000, 7443: 41001}
    assert (
        remap_ports("moto_server -p 9000 & curl http://127.0.0.1:9000/x 19000 join h:7443", ports)
        == "moto_server -p 41000 & curl http://127.0.0.1:41000/x 19000 join h:41001"
    )
    assert strip_comment("echo '#not' \"#not\" a#b # comment") == "echo '#not' \"#not\" a#b"
    assert is_background("agents-control serve --home ~/cp &")
    assert not is_background("a && b")
    assert not is_background("echo '&'")


def test_every_doc_parses() -> None:
    """Markers are well formed and blocks closed in every doc the integration test reads."""
    pages = {path: parse_doc(path, path.read_text()) for path in doc_files(ROOT)}
    assert len(pages) > 10
    assert any(block.commands and not block.skip for blocks in pages.values() for block in blocks)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from controlplane.cli.main import build_parser
    from machine.cli.main import _parser

    return {"agents-control": build_parser(), "agents-machine": _parser()}


def _subcommand(parser: argparse.ArgumentParser, word: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and word in action.choices:
            found: argparse.ArgumentParser = action.choices[word]
            return found
    return None


def _synopsis_lines() -> list[tuple[str, str]]:
    lines = []
    for path in doc_files(ROOT):
        for block in parse_doc(path.relative_to(ROOT), path.read_text()):
            if block.synopsis:
                lines += [
                    (f"{path.relative_to(ROOT)}:{command.line}", command.text)
                    for command in block.commands
                    if command.text.split()[0] in ("agents-control", "agents-machine")
                ]
    return lines


def _unknown(parsers: dict[str, argparse.ArgumentParser], text: str) -> list[str]:
    """The options (and a missing subcommand) of a synopsis line its CLI lacks."""
    words = text.split()
    chain = [parsers[words[0]]]
    for word in words[1:]:
        sub = _subcommand(chain[-1], word)
        if sub is not None:
            chain.append(sub)
    known = {opt for parser in chain for action in parser._actions for opt in action.option_strings}
    # Options inside quotes are an argument's value; "but --x" excludes one.
    bare = re.sub(r"'[^']*'|\"[^\"]*\"|\bbut --\S+", "", text)
    unknown = [o for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", bare) if o not in known]
    if len(chain) == 1 and not text.rstrip().endswith("..."):
        unknown.append("(no subcommand)")
    return unknown


def test_a_synopsis_with_a_wrong_option_or_verb_is_caught() -> None:
    parsers = _parsers()
    assert _unknown(parsers, "agents-control token create --account acct_... [--ttl 1h]") == []
    assert _unknown(parsers, "agents-control token create --acount acct_...") == ["--acount"]
    assert _unknown(parsers, "agents-machine --json agent list --every") == ["--every"]
    assert _unknown(parsers, "agents-control tokens create") == ["(no subcommand)"]


def test_every_synopsis_names_real_subcommands_and_options() -> None:
    parsers = _parsers()
    lines = _synopsis_lines()
    assert len(lines) > 20
    wrong = [f"{where}: {text}: {_unknown(parsers, text)}" for where, text in lines]
    assert [line for line in wrong if not line.endswith(": []")] == []
