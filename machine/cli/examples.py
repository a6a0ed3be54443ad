"""The "Examples:" section of every ``agents-machine`` help page, by command path.

Each line is a real command (a test parses every line that starts with
``agents-machine`` with the CLI's own parser and checks its ids) or a ``#``
comment; ids are well-formed ones to replace with yours.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXAMPLES"]

_P = "agents-machine"
_AGENT = "ag_01jfa2b3c4d5e6f7g8h9j0k1m2"
_RUN = "run_01jfa2b3c4d5e6f7g8h9j0k1m2"
_BACKUP = "bk_01jfa2b3c4d5e6f7g8h9j0k1m2"
_SCHEDULE = "sch_01jfa2b3c4d5e6f7g8h9j0k1m2"
_CA_HASH = "sha256:" + "3f" * 32

#: Command path (``()`` for the root, ``("agent", "list")``) -> its example lines.
EXAMPLES: Final[dict[tuple[str, ...], tuple[str, ...]]] = {
    (): (
        f"{_P} serve",
        f"{_P} agent create demo --folder ~/src/demo",
        f"{_P} --json agent list",
        f"{_P} --data-dir /var/lib/agents status",
        f"{_P} --version",
    ),
    ("serve",): (
        f"{_P} serve",
        f"{_P} serve --data-dir /var/lib/agents --metrics 127.0.0.1:9471 --grace 30s",
        f"{_P} serve --log-format json --log-level debug",
    ),
    ("join",): (
        "# the command `agents-control token create` prints",
        f"{_P} join cp.example.com:7443 --token tok_... --ca-hash {_CA_HASH}",
        f"{_P} join cp.example.com:7443 --token tok_... --ca-hash {_CA_HASH} "
        "--name build-box --install-service",
        "# a repair token on a new box: restore the lost machine's newest backup",
        f"{_P} join cp.example.com:7443 --token tok_... --ca-hash {_CA_HASH} "
        "--recovery-key ~/offline/recovery.key",
    ),
    ("status",): (f"{_P} status", f"{_P} status --json"),
    ("check",): (f"{_P} check",),
    ("agent",): (f"{_P} agent list", f"{_P} agent prompt {_AGENT} summarise the open issues"),
    ("agent", "create"): (
        f"{_P} agent create demo --folder ~/src/demo",
        f"{_P} agent create reviewer --runtime acp "
        """--settings '{"command": ["claude-code-acp"]}'""",
    ),
    ("agent", "list"): (f"{_P} agent list", f"{_P} agent list --all --json"),
    ("agent", "show"): (f"{_P} agent show {_AGENT}",),
    ("agent", "archive"): (f"{_P} agent archive {_AGENT}",),
    ("agent", "unarchive"): (f"{_P} agent unarchive {_AGENT}",),
    ("agent", "rename"): (f'{_P} agent rename {_AGENT} "release notes"',),
    ("agent", "configure"): (
        f"{_P} agent configure {_AGENT} "
        """--settings '{"command": ["claude-code-acp"], "kind": "claude"}'""",
        "# a secret value read from stdin, not from the command line",
        f"{_P} agent configure {_AGENT} --settings - < settings.json",
    ),
    ("agent", "prompt"): (
        f"{_P} agent prompt {_AGENT} summarise the open issues",
        f"{_P} agent prompt {_AGENT} --attach trace.log why does this fail",
        f"{_P} agent prompt {_AGENT} --stdin < prompt.md",
    ),
    ("agent", "replay"): (
        f"{_P} agent replay {_AGENT}",
        f"{_P} agent replay {_AGENT} --after 120 --follow --json",
    ),
    ("agent", "cancel"): (f"{_P} agent cancel {_RUN}",),
    ("agent", "answer"): (
        "# ids as printed with the [permission] request",
        f"{_P} agent answer {_RUN} perm-1 allow_once",
        f"{_P} agent answer {_RUN} perm-2 allow_always --remember",
    ),
    ("agent", "runs"): (f"{_P} agent runs {_AGENT}", f"{_P} agent runs {_AGENT} --limit 5 --json"),
    ("agent", "search"): (
        f"{_P} agent search flaky test",
        f"{_P} agent search --agent {_AGENT} --limit 5 timeout",
    ),
    ("agent", "delete"): (
        "# archived agents only; cannot be undone",
        f"{_P} agent delete {_AGENT}",
    ),
    ("agent", "erasures"): (f"{_P} agent erasures", f"{_P} agent erasures --json"),
    ("backup",): (f"{_P} backup now", f"{_P} backup list"),
    ("backup", "now"): (f"{_P} backup now",),
    ("backup", "list"): (
        f"{_P} backup list",
        f"{_P} backup list --from /mnt/usb/agents-backups",
        f"{_P} backup list --from s3://acme-backups/old-laptop",
        f"{_P} backup list --from s3://acme-backups/old-laptop "
        "--recovery-key ~/offline/recovery.key",
    ),
    ("backup", "verify"): (
        f"{_P} backup verify {_BACKUP}",
        f"{_P} backup verify {_BACKUP} --from /mnt/usb/agents-backups "
        "--recovery-key ~/offline/recovery.key",
    ),
    ("backup", "restore"): (
        f"{_P} backup restore {_BACKUP}",
        f"{_P} backup restore {_BACKUP} --recovery-key ~/offline/recovery.key",
        f"{_P} backup restore {_BACKUP} --from s3://acme-backups/old-laptop "
        "--recovery-key ~/offline/recovery.key",
    ),
    ("backup", "recovery-key"): (
        "# stand-alone machines: prints the private half once; keep it offline",
        f"{_P} backup recovery-key",
    ),
    ("backup", "take-over"): (
        "# a new stand-alone box replacing a lost one (daemon stopped): becomes that machine",
        f"{_P} backup take-over --from s3://acme-backups/old-laptop "
        "--recovery-key ~/offline/recovery.key",
        f"{_P} backup take-over --from /mnt/usb/agents-backups --recovery-key recovery.key "
        '--at "2026-12-05 09:40:00Z"',
    ),
    ("schedule",): (
        f'{_P} schedule add {_AGENT} --cron "0 7 * * 1-5" --text "triage new issues"',
        f"{_P} schedule list",
    ),
    ("schedule", "add"): (
        f'{_P} schedule add {_AGENT} --cron "0 7 * * 1-5" --text "triage new issues"',
        f'{_P} schedule add {_AGENT} --cron "30 22 * * *" --file nightly.md '
        "--tz Europe/Berlin --missed once",
    ),
    ("schedule", "list"): (f"{_P} schedule list", f"{_P} schedule list {_AGENT} --json"),
    ("schedule", "pause"): (f"{_P} schedule pause {_SCHEDULE}",),
    ("schedule", "resume"): (f"{_P} schedule resume {_SCHEDULE}",),
    ("schedule", "delete"): (f"{_P} schedule delete {_SCHEDULE}",),
    ("schedule", "runs"): (f"{_P} schedule runs {_SCHEDULE} --limit 10",),
    ("export",): (
        f"{_P} export {_AGENT} -o demo.tar.gz",
        f"{_P} export --folder ~/src/demo",
    ),
    ("import",): (f"{_P} import demo.tar.gz",),
    ("completion",): (
        "# bash: in ~/.bashrc",
        f'eval "$({_P} completion bash)"',
        "# zsh: in ~/.zshrc, after compinit",
        f'eval "$({_P} completion zsh)"',
        "# fish",
        f"{_P} completion fish > ~/.config/fish/completions/{_P}.fish",
    ),
}
