"""shared.tls.check_client_cert: the checks join and renewal apply to an issued certificate."""

from __future__ import annotations

import datetime as dt

import pytest

from shared import tls
from shared.errors import InvalidArgument
from shared.ids import new_id

ACCOUNT = new_id("account")
MACHINE = new_id("machine")


def _issue(
    ca: tls.CertKey, key_pem: bytes, account: str = ACCOUNT, machine: str = MACHINE
) -> bytes:
    key = tls.load_private_key(key_pem)
    return tls.sign_client_csr(
        ca,
        tls.build_csr(key),
        account_id=account,
        machine_id=machine,
        lifetime=dt.timedelta(days=1),
    ).cert_pem


def test_accepts_our_certificate_and_returns_its_identity() -> None:
    ca = tls.make_ca()
    key = tls.new_tls_key()
    cert = _issue(ca, tls.private_key_pem(key))
    ident = tls.check_client_cert(
        cert, ca.cert_pem, public_key=key.public_key(), account_id=ACCOUNT, machine_id=MACHINE
    )
    assert (ident.account_id, ident.machine_id) == (ACCOUNT, MACHINE)
    # Without machine_id only the account is compared.
    assert (
        tls.check_client_cert(cert, ca.cert_pem, public_key=key.public_key(), account_id=ACCOUNT)
        == ident
    )


def test_refuses_another_ca_another_key_and_another_identity() -> None:
    ca, other_ca = tls.make_ca(), tls.make_ca()
    key = tls.new_tls_key()
    cert = _issue(ca, tls.private_key_pem(key))
    with pytest.raises(InvalidArgument, match="not issued by this CA"):
        tls.check_client_cert(
            cert, other_ca.cert_pem, public_key=key.public_key(), account_id=ACCOUNT
        )
    with pytest.raises(InvalidArgument, match="not for the key"):
        tls.check_client_cert(
            cert, ca.cert_pem, public_key=tls.new_tls_key().public_key(), account_id=ACCOUNT
        )
    with pytest.raises(InvalidArgument, match="names another machine"):
        tls.check_client_cert(
            cert, ca.cert_pem, public_key=key.public_key(), account_id=new_id("account")
        )
    with pytest.raises(InvalidArgument, match="names another machine"):
        tls.check_client_cert(
            cert,
            ca.cert_pem,
            public_key=key.public_key(),
            account_id=ACCOUNT,
            machine_id=new_id("machine"),
        )
