"""The "Examples:" section of every ``agents-control`` help page, by command path.

Each line is a real command (a test parses every line that starts with
``agents-control`` with the CLI's own parser) or a ``#`` comment; ids are
well-formed ones to replace with yours.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXAMPLES"]

_P = "agents-control"
_ACCOUNT = "acct_01jfa2b3c4d5e6f7g8h9j0k1m2"
_MACHINE = "mc_01jfa2b3c4d5e6f7g8h9j0k1m2"
_AGENT = "ag_01jfa2b3c4d5e6f7g8h9j0k1m2"
_TOKEN = "tok_01jfa2b3c4d5e6f7g8h9j0k1m2"
_HOME = "/srv/agents-control"
_STORE = "s3://agents-state/prod"

#: Command path (``()`` for the root, ``("machine", "list")``) -> its example lines.
EXAMPLES: Final[dict[tuple[str, ...], tuple[str, ...]]] = {
    (): (
        f"{_P} init --home {_HOME} --store {_STORE}",
        f"{_P} serve --home {_HOME}",
        f"{_P} --home {_HOME} machine list --credential-file ~/.config/agents/admin.cred",
        f"{_P} --json account list",
        f"{_P} --version",
    ),
    ("init",): (
        "# a folder store on this host (tests, a single box)",
        f"{_P} init --home ~/.agents-control --store ~/agents-store",
        "# S3, reachable from other hosts as cp.example.com",
        f"{_P} init --home {_HOME} --store {_STORE} --store-region eu-west-1 "
        "--listen 0.0.0.0:7443 --link-listen 0.0.0.0:7444 --advertise-host cp.example.com "
        "--server-name cp.example.com --recovery-public-key agpk1_...",
    ),
    ("recovery-key",): (f"{_P} recovery-key new --out /media/offline/agents-recovery.key",),
    ("recovery-key", "new"): (
        "# keep the private half offline; give the public one to init",
        f"{_P} recovery-key new --out /media/offline/agents-recovery.key",
    ),
    ("restore",): (
        f"{_P} restore --home {_HOME} --store {_STORE} "
        "--recovery-key /media/offline/agents-recovery.key",
    ),
    ("drill",): (
        f"{_P} drill --machines 3",
        f"{_P} drill --machines 2 --workdir /tmp/agents-drill --json",
    ),
    ("serve",): (
        f"{_P} serve --home {_HOME}",
        f"{_P} serve --home {_HOME} --log-format json --log-level debug --heartbeat-interval 30s",
    ),
    ("fsck",): (
        f"{_P} fsck --home {_HOME}",
        "# with serve stopped",
        f"{_P} fsck --home {_HOME} --repair --json",
    ),
    ("store",): (f"{_P} store migrate --home {_HOME} --to {_STORE}",),
    ("store", "migrate"): (
        "# with serve stopped; S3 credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
        f"{_P} store migrate --home {_HOME} --to {_STORE} --store-region eu-west-1",
        "# and back to a folder (an empty one); run again after an interruption",
        f"{_P} store migrate --home {_HOME} --to /srv/agents-store",
    ),
    ("account",): (f"{_P} account list", f"{_P} account show {_ACCOUNT}"),
    ("account", "create"): (f"{_P} account create --github-id 583231 --github-login octocat",),
    ("account", "show"): (f"{_P} account show {_ACCOUNT}", f"{_P} account show {_ACCOUNT} --json"),
    ("account", "list"): (
        f"{_P} account list",
        f"{_P} account list --json",
        f"{_P} --json account list --credential-file ~/.config/agents/admin.cred",
    ),
    ("account", "delete"): (f"{_P} account delete {_ACCOUNT} --wait",),
    ("account", "deletion"): (f"{_P} account deletion {_ACCOUNT} --json",),
    ("token",): (f"{_P} token create --account {_ACCOUNT}", f"{_P} token list"),
    ("token", "create"): (
        f"{_P} token create --account {_ACCOUNT}",
        "# three machines may join with it within 2 hours 30 minutes",
        f"{_P} token create --account {_ACCOUNT} --ttl 2h30m --uses 3",
    ),
    ("token", "list"): (f"{_P} token list", f"{_P} token list --account {_ACCOUNT} --json"),
    ("token", "revoke"): (f"{_P} token revoke {_TOKEN}",),
    ("machine",): (f"{_P} machine list", f"{_P} machine show {_MACHINE}"),
    ("machine", "list"): (
        f"{_P} machine list",
        f"{_P} machine list --account {_ACCOUNT} --json",
    ),
    ("machine", "show"): (f"{_P} machine show {_MACHINE}",),
    ("machine", "revoke"): (f"{_P} machine revoke {_MACHINE}",),
    ("machine", "repair"): (f"{_P} machine repair {_MACHINE} --ttl 30m",),
    ("machine", "provider"): (
        f"{_P} machine provider set {_MACHINE} local "
        """--settings '{"command": ["agents-machine", "serve"]}'""",
        f"{_P} machine provider set {_MACHINE} ec2 "
        """--settings '{"instance_id": "i-0abc1234", "region": "eu-west-1"}'""",
        f"{_P} machine provider clear {_MACHINE}",
    ),
    ("machine", "rename"): (f"{_P} machine rename {_MACHINE} build-box-2",),
    ("prompt",): (
        f'{_P} prompt send --machine {_MACHINE} --agent {_AGENT} --text "run the tests"',
        f"{_P} prompt list --machine {_MACHINE}",
    ),
    ("prompt", "send"): (
        f'{_P} prompt send --machine {_MACHINE} --agent {_AGENT} --text "run the tests"',
        "# a retry with the same key queues nothing new",
        f"{_P} prompt send --machine {_MACHINE} --agent {_AGENT} --file nightly.md "
        "--idempotency-key nightly-2026-12-05",
    ),
    ("prompt", "list"): (f"{_P} prompt list --machine {_MACHINE} --json",),
    ("credential",): (f"{_P} credential create --account {_ACCOUNT}",),
    ("credential", "create"): (
        "# printed once: keep it in a file (0600) and use --credential-file",
        f'{_P} credential create --account {_ACCOUNT} --label "alice laptop"',
    ),
    ("cert",): (f"{_P} cert rotate-server",),
    ("cert", "rotate-server"): (f"{_P} cert rotate-server --home {_HOME}",),
    ("ca",): (f"{_P} ca rollover",),
    ("ca", "rollover"): (
        f"{_P} ca rollover",
        "# once every machine has renewed",
        f"{_P} ca rollover --retire-old",
    ),
    ("completion",): (
        "# bash: in ~/.bashrc",
        f'eval "$({_P} completion bash)"',
        "# zsh: in ~/.zshrc, after compinit",
        f'eval "$({_P} completion zsh)"',
        "# fish",
        f"{_P} completion fish > ~/.config/fish/completions/{_P}.fish",
    ),
}
