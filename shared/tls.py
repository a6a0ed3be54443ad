"""X.509 for the control plane's private PKI: CA, server and client certificates.

The control plane is its own certificate authority. ``init`` makes the CA
(:func:`make_ca`) and the server certificate (:func:`issue_server_cert`). A
machine joining makes its TLS key (:func:`new_tls_key`) and a CSR
(:func:`build_csr`); the control plane signs it into a client certificate
(:func:`sign_client_csr`) whose only identity is one URI SAN::

    agents://account/<acct_id>/machine/<mc_id>

(the subject common name repeats the machine id for people reading it). The
server reads the identity back with :func:`identity_from_cert` and nothing else.

TLS keys are ECDSA P-256: gRPC's BoringSSL does not accept Ed25519 for TLS
peer signatures by default, so the machine keeps Ed25519 as its *signing* key
(shared/crypto) and uses P-256 only for the TLS handshake.

The CA is pinned by :func:`ca_hash`: ``"sha256:" + hex(SHA-256(DER
SubjectPublicKeyInfo))`` of the CA certificate, the same scheme as kubeadm's
``--discovery-token-ca-cert-hash``. Pinning the public key (not the whole
certificate) survives re-issuing the CA certificate with the same key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.errors import InvalidArgument
from shared.ids import is_valid_id, validate_id

__all__ = [
    "CertKey",
    "IssuedCert",
    "PeerIdentity",
    "build_csr",
    "ca_hash",
    "cert_not_after",
    "cert_serial",
    "check_ca_hash",
    "check_client_cert",
    "check_csr",
    "identity_from_cert",
    "identity_uri",
    "issue_server_cert",
    "load_cert",
    "load_private_key",
    "make_ca",
    "needs_renewal",
    "new_tls_key",
    "private_key_pem",
    "sign_client_csr",
    "split_certs",
    "verify_issued_by",
]

logger = logging.getLogger(__name__)

#: The largest PEM we parse from a request (a CSR or certificate is ~1 KiB).
MAX_PEM_BYTES: Final = 16 * 1024

_URI_PREFIX: Final = "agents://account/"
_URI_RE: Final = re.compile(r"\Aagents://account/([a-z0-9_]+)/machine/([a-z0-9_]+)\Z")
_CA_HASH_RE: Final = re.compile(r"\Asha256:[0-9a-f]{64}\Z")
# Certificates start a little in the past so a machine whose clock is slightly
# behind does not see a "not yet valid" certificate.
_BACKDATE: Final = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertKey:
    """A certificate with its private key, both PEM."""

    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class IssuedCert:
    """A freshly signed client certificate and the facts the machine record keeps."""

    cert_pem: bytes
    serial: str
    """Serial number, lower-case hex."""
    not_after: dt.datetime
    """Expiry, timezone-aware UTC."""
    ca_hash: str = ""
    """The pin (:func:`ca_hash`) of the CA that signed it: a CA rollover retires
    the old CA only once no machine's current certificate names it."""


@dataclass(frozen=True)
class PeerIdentity:
    """Who a client certificate says its holder is."""

    account_id: str
    machine_id: str
    serial: str
    """Serial number of the certificate, lower-case hex."""


def _now(now: dt.datetime | None) -> dt.datetime:
    return now if now is not None else dt.datetime.now(dt.UTC)


def new_tls_key() -> ec.EllipticCurvePrivateKey:
    """Return a fresh ECDSA P-256 private key for TLS."""
    return ec.generate_private_key(ec.SECP256R1())


def private_key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Serialise a private key as unencrypted PKCS#8 PEM (callers store it 0600)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private_key(pem: bytes) -> ec.EllipticCurvePrivateKey:
    """Load a PEM private key made by :func:`private_key_pem`."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise InvalidArgument("private_key", f"cannot parse PEM: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument("private_key", "not an EC private key")
    return key


def _as_bytes(pem: bytes | str, field: str) -> bytes:
    data = pem.encode("ascii", "replace") if isinstance(pem, str) else bytes(pem)
    if len(data) > MAX_PEM_BYTES:
        raise InvalidArgument(field, f"larger than {MAX_PEM_BYTES} bytes")
    return data


def load_cert(pem: bytes | str, field: str = "certificate") -> x509.Certificate:
    """Parse one PEM certificate; a bad one raises InvalidArgument naming ``field``."""
    try:
        return x509.load_pem_x509_certificate(_as_bytes(pem, field))
    except ValueError as e:
        raise InvalidArgument(field, f"cannot parse PEM certificate: {e}") from None


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _serial_hex(cert: x509.Certificate) -> str:
    return format(cert.serial_number, "x")


def make_ca(
    common_name: str = "agents control plane CA",
    lifetime: dt.timedelta = dt.timedelta(days=3650),
    now: dt.datetime | None = None,
) -> CertKey:
    """Make a CA: a new P-256 key and a self-signed certificate for it."""
    key = new_tls_key()
    start = _now(now) - _BACKDATE
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertKey(cert_pem=_pem(cert), key_pem=private_key_pem(key))


def _leaf_builder(
    ca: CertKey, subject: x509.Name, public_key: ec.EllipticCurvePublicKey, start: dt.datetime
) -> tuple[x509.CertificateBuilder, ec.EllipticCurvePrivateKey]:
    ca_cert = load_cert(ca.cert_pem, "ca_certificate")
    ca_key = load_private_key(ca.key_pem)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    return builder, ca_key


def issue_server_cert(
    ca: CertKey,
    names: Sequence[str] = (),
    lifetime: dt.timedelta = dt.timedelta(days=825),
    now: dt.datetime | None = None,
) -> CertKey:
    """Issue the server certificate: SANs 127.0.0.1, localhost and every extra name.

    A name that parses as an IP address becomes an IP SAN, anything else a DNS SAN.
    """
    key = new_tls_key()
    start = _now(now) - _BACKDATE
    sans: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in ("localhost", "127.0.0.1", *names):
        name = raw.strip().lower()
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            if not re.fullmatch(r"[a-z0-9.*-]{1,253}", name):
                raise InvalidArgument("server_names", f"not a host name: {raw!r}") from None
            sans.append(x509.DNSName(name))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agents control plane")])
    builder, ca_key = _leaf_builder(ca, subject, key.public_key(), start)
    cert = (
        builder.not_valid_after(start + lifetime)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return CertKey(cert_pem=_pem(cert), key_pem=private_key_pem(key))


def build_csr(key: ec.EllipticCurvePrivateKey, common_name: str = "agents machine") -> bytes:
    """Return a PEM CSR for ``key``. The control plane ignores its subject."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def check_csr(csr_pem: bytes | str) -> None:
    """Raise InvalidArgument (field ``csr_pem``) unless the CSR is one we would sign."""
    _load_csr(csr_pem)


def _load_csr(csr_pem: bytes | str) -> ec.EllipticCurvePublicKey:
    try:
        csr = x509.load_pem_x509_csr(_as_bytes(csr_pem, "csr_pem"))
    except ValueError as e:
        raise InvalidArgument("csr_pem", f"cannot parse PEM CSR: {e}") from None
    if not csr.is_signature_valid:
        raise InvalidArgument("csr_pem", "signature does not verify")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP256R1
    ):
        raise InvalidArgument("csr_pem", "key must be ECDSA P-256")
    return public_key


def identity_uri(account_id: str, machine_id: str) -> str:
    """The URI SAN that names a machine of an account."""
    validate_id("account", account_id, "account_id")
    validate_id("machine", machine_id, "machine_id")
    return f"{_URI_PREFIX}{account_id}/machine/{machine_id}"


def sign_client_csr(
    ca: CertKey,
    csr_pem: bytes | str,
    *,
    account_id: str,
    machine_id: str,
    lifetime: dt.timedelta,
    now: dt.datetime | None = None,
) -> IssuedCert:
    """Check a CSR's self-signature and sign its key into a client certificate.

    The identity comes only from ``account_id``/``machine_id``; the CSR's own
    subject and extensions are ignored. Only P-256 keys are accepted.
    """
    uri = identity_uri(account_id, machine_id)
    public_key = _load_csr(csr_pem)
    start = _now(now) - _BACKDATE
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, machine_id)])
    builder, ca_key = _leaf_builder(ca, subject, public_key, start)
    not_after = start + _BACKDATE + lifetime
    cert = (
        builder.not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return IssuedCert(
        cert_pem=_pem(cert),
        serial=_serial_hex(cert),
        not_after=cert.not_valid_after_utc,
        ca_hash=ca_hash(ca.cert_pem),
    )


_PEM_CERT_RE: Final = re.compile(
    rb"-----BEGIN CERTIFICATE-----\r?\n.+?\r?\n-----END CERTIFICATE-----", re.DOTALL
)


def split_certs(pem: bytes | str, field: str = "ca_certificate") -> list[bytes]:
    """The PEM certificates of a bundle, in order (a CA rollover trusts two CAs).

    InvalidArgument naming ``field`` when it holds none.
    """
    found = [m.group(0) + b"\n" for m in _PEM_CERT_RE.finditer(_as_bytes(pem, field))]
    if not found:
        raise InvalidArgument(field, "no PEM certificate")
    return found


def verify_issued_by(cert_pem: bytes | str, ca_cert_pem: bytes | str) -> None:
    """Raise InvalidArgument unless ``cert_pem`` carries a valid signature of the CA.

    ``ca_cert_pem`` may be a bundle: any one of its CAs will do.
    """
    cert = load_cert(cert_pem)
    for one in split_certs(ca_cert_pem):
        ca_cert = load_cert(one, "ca_certificate")
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return
    raise InvalidArgument("certificate", "not issued by this CA")


def identity_from_cert(cert_pem: bytes | str) -> PeerIdentity:
    """Read the account and machine ids from a client certificate's URI SAN.

    Raises InvalidArgument when the certificate carries no well-formed identity.
    The caller is responsible for the chain (gRPC verifies it against our CA at
    the handshake) and for revocation.
    """
    cert = load_cert(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise InvalidArgument("certificate", "no subject alternative name") from None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        m = _URI_RE.match(uri)
        if m and is_valid_id("account", m.group(1)) and is_valid_id("machine", m.group(2)):
            return PeerIdentity(
                account_id=m.group(1), machine_id=m.group(2), serial=_serial_hex(cert)
            )
    raise InvalidArgument("certificate", "no agents identity URI")


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def check_client_cert(
    cert_pem: bytes | str,
    ca_cert_pem: bytes | str,
    *,
    public_key: ec.EllipticCurvePublicKey,
    account_id: str,
    machine_id: str | None = None,
) -> PeerIdentity:
    """Check a client certificate the control plane issued to us; return its identity.

    It must be signed by the CA, certify ``public_key`` (the key we sent in
    the CSR) and name ``account_id`` (and ``machine_id`` when given). Raises
    InvalidArgument naming ``certificate`` otherwise.
    """
    verify_issued_by(cert_pem, ca_cert_pem)
    ident = identity_from_cert(cert_pem)
    issued_key = load_cert(cert_pem).public_key()
    if not isinstance(issued_key, ec.EllipticCurvePublicKey) or _spki(issued_key) != _spki(
        public_key
    ):
        raise InvalidArgument("certificate", "not for the key in our request")
    if ident.account_id != account_id or (
        machine_id is not None and ident.machine_id != machine_id
    ):
        raise InvalidArgument("certificate", "names another machine")
    return ident


def ca_hash(ca_cert_pem: bytes | str) -> str:
    """``"sha256:<hex>"`` of the CA certificate's DER SubjectPublicKeyInfo."""
    cert = load_cert(ca_cert_pem, "ca_certificate")
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def check_ca_hash(ca_cert_pem: bytes | str, expected: str) -> None:
    """Raise InvalidArgument unless the CA certificate matches the pinned hash.

    ``ca_cert_pem`` may be a bundle (during a CA rollover): one of its CAs must match.
    """
    if not isinstance(expected, str) or not _CA_HASH_RE.match(expected.lower()):
        raise InvalidArgument("ca_hash", "must look like sha256:<64 hex chars>")
    hashes_ = [ca_hash(one) for one in split_certs(ca_cert_pem)]
    if not any(hmac.compare_digest(h, expected.lower()) for h in hashes_):
        raise InvalidArgument("ca_hash", "the control plane's CA does not match the pinned hash")


def cert_not_after(cert_pem: bytes | str) -> dt.datetime:
    """The certificate's expiry, timezone-aware UTC."""
    return load_cert(cert_pem).not_valid_after_utc


def cert_serial(cert_pem: bytes | str) -> str:
    """The certificate's serial number, lower-case hex."""
    return _serial_hex(load_cert(cert_pem))


def needs_renewal(
    cert_pem: bytes | str, threshold: float = 1 / 3, now: dt.datetime | None = None
) -> bool:
    """True once less than ``threshold`` of the certificate's lifetime remains."""
    if not 0 < threshold < 1:
        raise InvalidArgument("threshold", "must be between 0 and 1")
    cert = load_cert(cert_pem)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    remaining = end - _now(now)
    return remaining <= (end - start) * threshold
