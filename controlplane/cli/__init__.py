"""``agents-control``: the CLI, on top of everything.

``main`` (the parser, ``main()``, the COMMANDS table), ``deployment`` (init,
serve), ``recovery`` (recovery-key, restore, drill, fsck, cert, ca),
``accounts`` (account, token, credential) and ``machines`` (machine, prompt)
(the verbs), ``common`` (what every verb shares), ``client`` (the Admin
client: TLS trusting our CA, bearer credential), ``admin_types`` (what Admin
answers, typed) and ``drill`` (rehearse losing the control plane, with real
processes). Only this room prints and chooses exit codes.

May import: every room and entry module of ``controlplane``, ``shared``.
Nothing imports it.
"""

__all__ = [
    "accounts",
    "admin_types",
    "client",
    "common",
    "deployment",
    "drill",
    "machines",
    "main",
    "recovery",
]
