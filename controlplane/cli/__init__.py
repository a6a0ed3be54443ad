"""``agents-control``: the CLI, on top of everything.

``main`` (the parser, ``main()``, every verb), ``client`` (the Admin client:
TLS trusting our CA, bearer credential), ``admin_types`` (what Admin answers,
typed) and ``drill`` (rehearse losing the control plane, with real processes).
Only this room prints and chooses exit codes.

May import: every room and entry module of ``controlplane``, ``shared``.
Nothing imports it.
"""

__all__ = ["admin_types", "client", "drill", "main"]
