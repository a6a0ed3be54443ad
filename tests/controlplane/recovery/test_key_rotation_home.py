"""The home's key swaps (controlplane.integrity.keys): a crash at any step leaves keys that match.

Each crash is reproduced by doing the swap's renames only up to the step a
killed process would have reached, then loading the home as a restarted
daemon does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from controlplane.integrity.keys import (
    create_home_keys,
    finish_ca_rollover,
    load_home_keys,
    replace_server_cert,
    start_ca_rollover,
)
from controlplane.integrity.trusted import marker_ca_hashes
from shared import tls
from shared.errors import ConfigError, InvalidArgument
from shared.tls import CertKey


def _matches(pair: CertKey) -> bool:
    """Whether the certificate certifies the private key next to it."""
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    cert_key = tls.load_cert(pair.cert_pem).public_key().public_bytes(der, spki)
    key = tls.load_private_key(pair.key_pem).public_key().public_bytes(der, spki)
    return cert_key == key


def test_server_swap_interrupted_after_its_commit_point_is_finished_at_load(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    keys = create_home_keys(home)
    new = tls.issue_server_cert(keys.ca)
    (home / "server.key.new").write_bytes(new.key_pem)
    (home / "server.pem.new").write_bytes(new.cert_pem)
    os.replace(home / "server.key.new", home / "server.key")  # killed right after this

    loaded = load_home_keys(home)
    assert loaded.server == new and _matches(loaded.server)
    assert not list(home.glob("*.new"))


def test_server_swap_staged_but_not_begun_keeps_the_old_certificate(tmp_path: Path) -> None:
    home = tmp_path / "home"
    keys = create_home_keys(home)
    (home / "server.key.new").write_bytes(tls.issue_server_cert(keys.ca).key_pem)
    assert load_home_keys(home).server == keys.server

    new = tls.issue_server_cert(keys.ca)
    replace_server_cert(home, new)
    assert load_home_keys(home).server == new


def test_ca_rollover_is_invisible_until_committed_and_retire_survives_a_crash(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    keys = create_home_keys(home)
    next_ca = tls.make_ca()
    next_server = tls.issue_server_cert(next_ca)
    # Killed before ca-next.pem (the rollover's commit point): no rollover.
    (home / "server-next.key").write_bytes(next_server.key_pem)
    (home / "server-next.pem").write_bytes(next_server.cert_pem)
    (home / "ca-next.key").write_bytes(next_ca.key_pem)
    partial = load_home_keys(home)
    assert partial.next_ca is None and partial.issuing_ca == keys.ca
    with pytest.raises(ConfigError):
        finish_ca_rollover(home)

    start_ca_rollover(home, next_ca, next_server)
    rolling = load_home_keys(home)
    assert rolling.issuing_ca == next_ca and rolling.server == keys.server
    assert tls.split_certs(rolling.ca_bundle_pem) == [keys.ca.cert_pem, next_ca.cert_pem]
    assert rolling.ca_hash == keys.ca_hash  # joins still pin the CA the server presents

    os.replace(home / "server-next.key", home / "server.key")  # retire killed here
    retired = load_home_keys(home)
    assert retired.ca == next_ca and retired.server == next_server and retired.next_ca is None
    assert _matches(retired.server)
    tls.verify_issued_by(retired.server.cert_pem, retired.ca.cert_pem)
    assert not list(home.glob("*-next.*"))


def test_bundles_verify_against_any_of_their_cas() -> None:
    old, new = tls.make_ca(), tls.make_ca()
    leaf = tls.issue_server_cert(new).cert_pem
    bundle = old.cert_pem + new.cert_pem
    tls.verify_issued_by(leaf, bundle)
    tls.check_ca_hash(bundle, tls.ca_hash(old.cert_pem))
    tls.check_ca_hash(bundle, tls.ca_hash(new.cert_pem))
    with pytest.raises(InvalidArgument):
        tls.verify_issued_by(leaf, old.cert_pem)
    with pytest.raises(InvalidArgument):
        tls.check_ca_hash(bundle, tls.ca_hash(tls.make_ca().cert_pem))
    with pytest.raises(InvalidArgument):
        tls.split_certs(b"no certificate here")


def test_marker_accepts_the_retired_ca_hashes() -> None:
    marker = {"ca_hash": "sha256:" + "b" * 64, "previous_ca_hashes": ["sha256:" + "a" * 64]}
    assert marker_ca_hashes(marker) == {"sha256:" + "a" * 64, "sha256:" + "b" * 64}
    assert marker_ca_hashes({"ca_hash": 3, "previous_ca_hashes": "x"}) == set()
