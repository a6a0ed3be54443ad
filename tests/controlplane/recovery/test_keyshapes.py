"""Every key the control plane's key functions make has a shape fsck knows; others have none."""

from __future__ import annotations

import ast
import datetime as dt
import secrets
from pathlib import Path

import pytest

from controlplane.integrity import records
from controlplane.integrity.intents import intent_key
from controlplane.integrity.trusted import DEPLOYMENT_KEY
from controlplane.machines.alive import ALIVE_KEY
from controlplane.machines.backups import backups_prefix
from controlplane.queue.idempotency import _record_key
from controlplane.queue.prompts import _entry_key
from controlplane.queue.starter import provider_key
from controlplane.recovery.fencing import EPOCH_KEY, new_home_id, superseded_key
from controlplane.recovery.keybundle import BUNDLE_KEY
from controlplane.recovery.keyshapes import KeyShape, shape_of
from shared.backup_target import manifest_key, names_key, segment_key
from shared.ids import new_id

# Fixed ids: the parametrised test ids must be the same in every xdist worker.
_BODY = "0123456789abcdefghjkmnpqrs"
A, M, T, U = f"acct_{_BODY}", f"mc_{_BODY}", f"tok_{_BODY}", f"int_{_BODY}"
HEX64 = "5e" * 32


def _made_keys() -> dict[str, str]:
    """shape -> a key made by the code that writes that shape."""
    backups = backups_prefix(A, M)
    return {
        "deployment": DEPLOYMENT_KEY,
        "epoch": EPOCH_KEY,
        "alive": ALIVE_KEY,
        "key_bundle": BUNDLE_KEY,
        "superseded": superseded_key(new_home_id()),
        "intent": intent_key(new_id("intent")),
        "credential": records.credential_key(new_id("credential")),
        "audit": records.audit_key(dt.datetime.now(dt.UTC), new_id("audit")),
        "deleted": records.deleted_key(A),
        "index_account": records.account_index_key(A),
        "index_github": records.github_index_key(123456789),
        "index_machine": records.machine_index_key(M),
        "index_token": records.token_index_key(T),
        "account": records.account_key(A),
        "tombstone": records.deleting_key(A),
        "machine": records.machine_key(A, M),
        "presence": records.presence_key(A, M),
        "roster": records.roster_key(A, M),
        "provider": provider_key(A, M),
        "token": records.token_key(A, T),
        "token_use": records.token_use_key(A, T, new_id("intent")),
        "revoked": records.machine_revoked_key(A, M),
        "retired": records.retired_serial_key(A, M, "1f" * 20),
        "queue_entry": _entry_key(A, M, 1733350000123456),
        "queue_entry_keyed": _entry_key(A, M, 1733350000123457, HEX64),
        "queue_acked": _record_key(A, M, 1733350000123457, HEX64),
        "backup_manifest": backups + manifest_key(new_id("backup")),
        "backup_names": backups + names_key(new_id("backup")),
        # A continuous backup's increment: a manifest as a point's.
        "backup_manifest_keyed": backups + manifest_key(new_id("increment")),
        "backup_segment": backups + segment_key(HEX64),
        "probe": f"_probe/{secrets.token_hex(8)}",  # shared.store.s3.S3Store.probe
    }


@pytest.mark.parametrize("made", sorted(_made_keys()))
def test_every_key_the_control_plane_makes_has_a_shape(made: str) -> None:
    key = _made_keys()[made]
    shape = shape_of(key)
    assert shape is not None, key
    expected = made.removesuffix("_keyed").replace("backup_names", "backup_manifest")
    assert shape.name == expected


def test_a_shape_carries_the_ids_of_its_key() -> None:
    use = new_id("intent")
    assert shape_of(records.token_use_key(A, T, use)) == KeyShape("token_use", A, "", T, use)
    assert shape_of(records.retired_serial_key(A, M, "ab12")) == KeyShape(
        "retired", A, M, "", "ab12"
    )
    assert shape_of(records.github_index_key(77)) == KeyShape("index_github", ident="77")


@pytest.mark.parametrize(
    "key",
    [
        "notes.txt",
        "cp/deployment.json.bak",
        "cp/superseded/not-a-home",
        f"cp/intents/{U}",
        f"accounts/{A}/account.json/x",
        f"accounts/{A}/machines/{M}.sealed",
        f"accounts/{A}/machines/mc_{'I' * 26}.json",  # not an id: never made
        f"accounts/{A}/presence/{T}.json",  # a token id where a machine id goes
        f"accounts/{A}/queue/{M}/123.sealed",
        f"accounts/{A}/queue-acked/{M}/{'0' * 20}.json",
        f"accounts/{A}/token-uses/{T}/{U}.json",
        f"accounts/{A}/retired/{M}/XYZ.json",
        f"accounts/{A}/backups/{M}/segments/{HEX64}.tmp",
        f"accounts/{A}/backups/{M}/other/{HEX64}",
        f"accounts/{A}/",
        f"index/tokens/{M}.json",
        f"deleted/{A}",
        f"audit/2026/1/5/au_{_BODY}.json",
        "_probe/zz",
    ],
)
def test_a_key_nothing_writes_has_no_shape(key: str) -> None:
    assert shape_of(key) is None


#: Every function and constant in controlplane/ named like a store key or prefix, as
#: ``module:name``. Those ``_made_keys`` covers (a constant through the key function
#: built on it):
_EXERCISED = {
    "controlplane.integrity.records:" + name
    for name in (
        "account_key deleting_key deleted_key machines_prefix revoked_prefix "
        "machine_revoked_key retired_serial_key machine_key presence_key roster_key "
        "tokens_prefix token_uses_prefix token_use_key token_key machine_index_key "
        "token_index_key github_index_key ACCOUNT_INDEX_PREFIX account_index_key "
        "credential_key audit_key"
    ).split()
} | {
    "controlplane.machines.backups:backups_prefix",
    "controlplane.integrity.audit:AUDIT_PREFIX",  # the folder of audit_key's keys
    "controlplane.machines.alive:ALIVE_KEY",
    "controlplane.integrity.intents:INTENTS_PREFIX",
    "controlplane.integrity.intents:intent_key",
    "controlplane.integrity.trusted:DEPLOYMENT_KEY",
    "controlplane.queue.idempotency:acked_prefix",
    "controlplane.queue.idempotency:_record_key",
    "controlplane.queue.prompts:queue_prefix",
    "controlplane.queue.prompts:_entry_key",
    "controlplane.queue.starter:provider_key",
    "controlplane.recovery.fencing:EPOCH_KEY",
    "controlplane.recovery.fencing:SUPERSEDED_PREFIX",
    "controlplane.recovery.fencing:superseded_key",
    "controlplane.recovery.keybundle:BUNDLE_KEY",
    "controlplane.deletion.service:DELETED_PREFIX",
    "controlplane.deletion.sweep:CREDENTIALS_PREFIX",
}
#: Named like one but no store key.
_NOT_STORE_KEYS = {
    "controlplane.cli.client:_DETAILS_KEY",
    "controlplane.config:FILE_KEYS",
    "controlplane.integrity.trusted:record_mac_key",
    "controlplane.queue.prompts:MAX_IDEMPOTENCY_KEY",
    "controlplane.queue.prompts:_parse_key",
    "controlplane.queue.providers.base:_ACCESS_KEY",
    "controlplane.recovery.keybundle:write_recovery_public_key",
    "controlplane.recovery.keybundle:read_recovery_public_key",
    "controlplane.recovery.restore:_STAGING_PREFIX",
}


def _key_names() -> set[str]:
    root = Path(__file__).resolve().parents[3]
    out = set()
    for path in (root / "controlplane").rglob("*.py"):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, ast.FunctionDef):
                names = [node.name]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            for name in names:
                if name.lower().endswith(("_key", "_prefix")):
                    out.add(f"{module}:{name}")
    return out


def test_every_key_function_of_the_control_plane_is_exercised_above() -> None:
    """A new key function or constant fails here until a key it makes is added to
    ``_made_keys`` (and its shape to controlplane/recovery/keyshapes.py)."""
    found = _key_names()
    assert found - _EXERCISED - _NOT_STORE_KEYS == set()
    assert _EXERCISED - found == set()  # a renamed one: update the list
