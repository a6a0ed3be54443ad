"""shared/tls.py: CA, server and client certificates, identity, pinning."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from shared import tls
from shared.errors import InvalidArgument
from shared.ids import new_id


def test_client_cert_round_trip_and_pinning() -> None:
    ca = tls.make_ca()
    acct, mc = new_id("account"), new_id("machine")
    issued = tls.sign_client_csr(
        ca,
        tls.build_csr(tls.new_tls_key()),
        account_id=acct,
        machine_id=mc,
        lifetime=dt.timedelta(days=30),
    )
    peer = tls.identity_from_cert(issued.cert_pem)
    assert (peer.account_id, peer.machine_id, peer.serial) == (acct, mc, issued.serial)
    tls.verify_issued_by(issued.cert_pem, ca.cert_pem)
    with pytest.raises(InvalidArgument):
        tls.verify_issued_by(issued.cert_pem, tls.make_ca().cert_pem)
    spki = (
        x509.load_pem_x509_certificate(ca.cert_pem)
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    assert tls.ca_hash(ca.cert_pem) == "sha256:" + hashlib.sha256(spki).hexdigest()
    tls.check_ca_hash(ca.cert_pem, tls.ca_hash(ca.cert_pem))
    with pytest.raises(InvalidArgument, match="does not match"):
        tls.check_ca_hash(ca.cert_pem, tls.ca_hash(tls.make_ca().cert_pem))
    with pytest.raises(InvalidArgument, match="ca_hash"):
        tls.check_ca_hash(ca.cert_pem, "md5:abc")


def test_server_cert_sans_and_csr_checks() -> None:
    ca = tls.make_ca()
    server = tls.issue_server_cert(ca, ["cp.example.com", "10.0.0.5"])
    san = (
        tls.load_cert(server.cert_pem)
        .extensions.get_extension_for_class(x509.SubjectAlternativeName)
        .value
    )
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "cp.example.com"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.5"}
    with pytest.raises(InvalidArgument, match="csr_pem"):
        tls.check_csr("garbage")
    with pytest.raises(InvalidArgument, match="account_id"):
        tls.sign_client_csr(
            ca,
            tls.build_csr(tls.new_tls_key()),
            account_id="../x",
            machine_id=new_id("machine"),
            lifetime=dt.timedelta(days=1),
        )
    with pytest.raises(InvalidArgument, match="identity"):
        tls.identity_from_cert(server.cert_pem)


def test_needs_renewal() -> None:
    ca = tls.make_ca()
    now = dt.datetime.now(dt.UTC)
    issued = tls.sign_client_csr(
        ca,
        tls.build_csr(tls.new_tls_key()),
        account_id=new_id("account"),
        machine_id=new_id("machine"),
        lifetime=dt.timedelta(days=30),
        now=now,
    )
    assert not tls.needs_renewal(issued.cert_pem, 1 / 3, now=now + dt.timedelta(days=10))
    assert tls.needs_renewal(issued.cert_pem, 1 / 3, now=now + dt.timedelta(days=21))
