"""Accounts and access: who may call, and what they may see.

``accounts`` (one per GitHub user, their deletion state), ``principals`` (a
verified caller and its visibility rules), ``authz`` (admin credentials,
verified into principals), ``tokens`` (one-time join tokens, hash only) and
``hashing`` (bearer secrets).

May import: ``controlplane.integrity``, the leaves (``config``, ``metrics``),
``shared``.
"""

__all__ = ["accounts", "authz", "hashing", "principals", "tokens"]
