"""Every key shape the control plane writes, so that ``fsck`` can name what is not one.

:func:`shape_of` answers which shape a key (relative to the deployment prefix)
has, with the ids it carries, or None for a key nothing of the control plane
writes: a planted object, a genuine one copied to a made-up key, or one of a
newer version's shapes. The table is kept beside the key functions it mirrors
(``controlplane.integrity.records``, ``intents``, ``queue.prompts``,
``queue.idempotency``, ``queue.starter``, ``machines.alive``, ``machines.backups`` with
``shared.backup_target``, ``recovery.fencing``, ``recovery.keybundle``, the
deployment marker and the S3 probe); ``tests/controlplane/recovery/test_keyshapes.py``
makes a key with each of those functions and fails when one is not known here.

Shapes and what authenticates them:

==================  ==========================================================  ==========
shape               key                                                         MAC'd
==================  ==========================================================  ==========
deployment          ``cp/deployment.json``                                      yes
epoch               ``cp/epoch.json``                                           yes
alive               ``cp/alive.json``                                           yes
key_bundle          ``cp/keys.sealed``                                          yes
superseded          ``cp/superseded/<home id>``                                 yes
intent              ``cp/intents/<int>.json``                                   yes
credential          ``credentials/<adm>.json``                                  yes
audit               ``audit/<yyyy>/<mm>/<dd>/<au>.json``                        yes
deleted             ``deleted/<acct>.json``                                     yes
index_account       ``index/accounts/<acct>.json``                              yes
index_github        ``index/github/<github id>.json``                           yes
index_machine       ``index/machines/<mc>.json``                                yes
index_token         ``index/tokens/<tok>.json``                                 yes
account             ``accounts/<a>/account.json``                               yes
tombstone           ``accounts/<a>/deleting.json``                              yes
machine             ``accounts/<a>/machines/<mc>.json``                         yes
presence            ``accounts/<a>/presence/<mc>.json``                         yes
roster              ``accounts/<a>/rosters/<mc>.json``                          yes
provider            ``accounts/<a>/providers/<mc>.sealed``                      yes
token               ``accounts/<a>/tokens/<tok>.json``                          yes
token_use           ``accounts/<a>/token-uses/<tok>/<int>``                     yes
revoked             ``accounts/<a>/revoked/<mc>.json``                          yes
retired             ``accounts/<a>/retired/<mc>/<serial>.json``                 yes
queue_entry         ``accounts/<a>/queue/<mc>/<seq>[-<tag>].sealed``            yes
queue_acked         ``accounts/<a>/queue-acked/<mc>/<seq>-<tag>.json``          yes
backup_manifest     ``accounts/<a>/backups/<mc>/manifests/<bk|bki>.sealed|.names``  yes
backup_segment      ``accounts/<a>/backups/<mc>/segments/<64 hex>``             no
probe               ``_probe/<16 hex>`` (the S3 probe's, deleted as it ends)    no
==================  ==========================================================  ==========
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["KeyShape", "shape_of"]

logger = logging.getLogger(__name__)

_B32: Final = "[0-9a-hjkmnp-tv-z]{26}"


def _id(prefix: str, group: str) -> str:
    return rf"(?P<{group}>{prefix}_{_B32})"


_ACCT: Final = _id("acct", "acct")
_MC: Final = _id("mc", "mc")
_TOK: Final = _id("tok", "tok")

#: (shape, pattern) in the order they are tried; each pattern matches a whole key.
_SHAPES: Final[tuple[tuple[str, re.Pattern[str]], ...]] = tuple(
    (name, re.compile(rf"\A{pattern}\Z"))
    for name, pattern in (
        ("deployment", r"cp/deployment\.json"),
        ("epoch", r"cp/epoch\.json"),
        ("alive", r"cp/alive\.json"),
        ("key_bundle", r"cp/keys\.sealed"),
        ("superseded", r"cp/superseded/(?P<ident>[0-9a-f]{32})"),
        ("intent", rf"cp/intents/{_id('int', 'ident')}\.json"),
        ("credential", rf"credentials/{_id('adm', 'ident')}\.json"),
        ("audit", rf"audit/[0-9]{{4}}/[0-9]{{2}}/[0-9]{{2}}/{_id('au', 'ident')}\.json"),
        ("deleted", rf"deleted/{_ACCT}\.json"),
        ("index_account", rf"index/accounts/{_ACCT}\.json"),
        ("index_github", r"index/github/(?P<ident>[0-9]{1,20})\.json"),
        ("index_machine", rf"index/machines/{_MC}\.json"),
        ("index_token", rf"index/tokens/{_TOK}\.json"),
        ("account", rf"accounts/{_ACCT}/account\.json"),
        ("tombstone", rf"accounts/{_ACCT}/deleting\.json"),
        ("machine", rf"accounts/{_ACCT}/machines/{_MC}\.json"),
        ("presence", rf"accounts/{_ACCT}/presence/{_MC}\.json"),
        ("roster", rf"accounts/{_ACCT}/rosters/{_MC}\.json"),
        ("provider", rf"accounts/{_ACCT}/providers/{_MC}\.sealed"),
        ("token", rf"accounts/{_ACCT}/tokens/{_TOK}\.json"),
        ("token_use", rf"accounts/{_ACCT}/token-uses/{_TOK}/{_id('int', 'ident')}"),
        ("revoked", rf"accounts/{_ACCT}/revoked/{_MC}\.json"),
        ("retired", rf"accounts/{_ACCT}/retired/{_MC}/(?P<ident>[0-9a-f]{{1,40}})\.json"),
        ("queue_entry", rf"accounts/{_ACCT}/queue/{_MC}/[0-9]{{20}}(?:-[0-9a-f]{{16}})?\.sealed"),
        ("queue_acked", rf"accounts/{_ACCT}/queue-acked/{_MC}/[0-9]{{20}}-[0-9a-f]{{16}}\.json"),
        (
            "backup_manifest",
            # A daily point (bk_) or a continuous backup's increment (bki_).
            rf"accounts/{_ACCT}/backups/{_MC}/manifests/{_id('bki?', 'ident')}\.(?:sealed|names)",
        ),
        ("backup_segment", rf"accounts/{_ACCT}/backups/{_MC}/segments/(?P<ident>[0-9a-f]{{64}})"),
        ("probe", r"_probe/[0-9a-f]{16}"),
    )
)


@dataclass(frozen=True)
class KeyShape:
    """What a key is, with the ids it names ("" where it names none)."""

    name: str
    account_id: str = ""
    machine_id: str = ""
    token_id: str = ""
    ident: str = ""
    """The shape's own id: a home, intent, credential, audit, backup or use id, a
    GitHub user id, a certificate serial or a segment name."""


def shape_of(key: str) -> KeyShape | None:
    """The shape of ``key`` (relative to the deployment prefix), None when the
    control plane writes no key like it."""
    for name, pattern in _SHAPES:
        if m := pattern.match(key):
            groups = m.groupdict()
            return KeyShape(
                name,
                groups.get("acct") or "",
                groups.get("mc") or "",
                groups.get("tok") or "",
                groups.get("ident") or "",
            )
    return None
