"""``agents-control``: the CLI, on top of everything.

``main`` (the parser, ``main()``, the COMMANDS table), ``deployment`` (init,
serve), ``recovery`` (recovery-key, restore, drill, fsck, cert, ca),
``accounts`` (account, token, credential), ``machines`` (machine, prompt) and
``store`` (store migrate) (the verbs), ``common`` (what every verb shares), ``client`` (the Admin
client: TLS trusting our CA, bearer credential), ``admin_types`` (what Admin
answers, typed) and ``drill`` (rehearse losing the control plane, with real
processes). Only this room prints and chooses exit codes.

May import: every room and entry module of ``controlplane``, ``shared``.
Nothing imports it.
"""

from __future__ import annotations

__all__ = [
    "entry",
    "accounts",
    "admin_types",
    "client",
    "common",
    "deployment",
    "drill",
    "machines",
    "main",
    "recovery",
    "store",
]


def entry(argv: list[str] | None = None) -> int:
    """The ``agents-control`` console script: a closed stdout is refused before the CLI (and
    gRPC with it) is loaded, and gRPC's experiments and log verbosity set
    (:mod:`shared.entry`); then
    :func:`controlplane.cli.main.main`."""
    from shared.entry import quiet_grpc, stdout_closed, use_grpc_experiments

    if stdout_closed("agents-control"):
        return 2  # a usage error: nothing was done
    use_grpc_experiments()
    quiet_grpc()
    from controlplane.cli.main import main

    return main(argv)
