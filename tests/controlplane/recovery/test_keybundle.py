"""The sealed key bundle and recovery key files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from controlplane.integrity.keys import create_home_keys, load_home_keys
from controlplane.recovery.keybundle import KeyBundle, open_bundle, seal_bundle
from shared.crypto import BoxKeyPair, encode_private_key
from shared.errors import IntegrityError, InvalidArgument
from shared.recovery_key import read_recovery_key, write_recovery_key


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> KeyBundle:
    home = tmp_path_factory.mktemp("home")
    create_home_keys(home)
    return KeyBundle("dep-1", load_home_keys(home))


def test_bundle_round_trip_restores_every_key(bundle: KeyBundle) -> None:
    recovery = BoxKeyPair.generate()
    blob = seal_bundle(bundle, recovery.public_key)
    got = open_bundle(blob, recovery, "dep-1")
    assert got.keys == bundle.keys
    for secret in (bundle.keys.ca.key_pem, bundle.keys.server.key_pem, bundle.keys.secrets_key):
        assert secret not in blob
    assert b"PRIVATE KEY" not in blob
    assert "PRIVATE" not in repr(got)


def test_wrong_key_damaged_or_foreign_bundle_refused(bundle: KeyBundle) -> None:
    recovery = BoxKeyPair.generate()
    blob = seal_bundle(bundle, recovery.public_key)
    with pytest.raises(IntegrityError):
        open_bundle(blob, BoxKeyPair.generate(), "dep-1")
    with pytest.raises(IntegrityError):
        open_bundle(blob, recovery, "dep-2")
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x40
    with pytest.raises(IntegrityError):
        open_bundle(bytes(damaged), recovery, "dep-1")
    with pytest.raises(IntegrityError):
        open_bundle(blob[:-10], recovery, "dep-1")


def test_recovery_key_file_written_once_private_and_read_back(tmp_path: Path) -> None:
    kp = BoxKeyPair.generate()
    path = tmp_path / "recovery.key"
    write_recovery_key(path, kp, "the control plane's key bundle")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_recovery_key(path) == kp
    with pytest.raises(InvalidArgument, match="refusing to overwrite"):
        write_recovery_key(path, BoxKeyPair.generate(), "x")
    assert read_recovery_key(path) == kp, "the first key is kept"


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "exactly one key line"),
        (b"# only a comment\n", "exactly one key line"),
        (b"agsk1_abc\nagsk1_def\n", "exactly one key line"),
        (b"agpk1_AAAA\n", "must start with 'agsk1_'"),
        (b"\xff\xfe\n", "not a recovery key file"),
        (b"x" * 5000, "too large"),
    ],
)
def test_bad_key_files_refused_without_echoing(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "k"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument, match=match) as err:
        read_recovery_key(path)
    assert err.value.field == "recovery_key"


def test_mistyped_key_is_caught_and_not_echoed(tmp_path: Path) -> None:
    text = encode_private_key(BoxKeyPair.generate().private_key)
    typo = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
    path = tmp_path / "k"
    path.write_text(typo + "\n")
    with pytest.raises(InvalidArgument, match="checksum") as err:
        read_recovery_key(path)
    assert typo not in str(err.value)


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_recovery_key(tmp_path / "absent.key")


def test_a_key_file_other_users_can_read_is_used_with_a_warning(tmp_path: Path) -> None:
    kp = BoxKeyPair.generate()
    path = tmp_path / "recovery.key"
    write_recovery_key(path, kp, "backups")
    warned: list[str] = []
    assert read_recovery_key(path, warn=warned.append) == kp
    assert warned == [], "0600: nothing to say"
    path.chmod(0o644)
    assert read_recovery_key(path, warn=warned.append) == kp
    assert len(warned) == 1 and "mode 0644" in warned[0] and f"chmod 600 {path}" in warned[0]
    assert encode_private_key(kp.private_key) not in warned[0]
