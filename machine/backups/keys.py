"""The keys backups are sealed and named with, in the data folder's ``keys/``.

::

    keys/backup.key     X25519 private key (``agsk1_…``): opens this machine's manifests
    keys/naming.key     32 random bytes (hex): names segments by a keyed hash
    keys/recovery.pub   a stand-alone machine's recovery public key (``agpk1_…``)

A joined machine seals to its account's recovery public key (``link.json``,
delivered at join); a stand-alone machine to the one in ``keys/recovery.pub``,
made once with :func:`new_standalone_recovery_key`, whose private half is
shown once to the person and never stored. Without a recovery key, backups
are sealed to the machine's key alone, and ``status`` says a lost disk then
loses them too. Nothing here logs or formats a private key.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from machine.link.identity import is_joined, load_link
from shared.atomic import ensure_private_dir, write_atomic
from shared.crypto import (
    BoxKeyPair,
    decode_private_key,
    decode_public_key,
    encode_private_key,
    encode_public_key,
    seal_bytes,
)
from shared.errors import AgentsError, ConfigError, InvalidArgument, InvalidState

__all__ = [
    "BackupKeys",
    "has_standalone_recovery_key",
    "keep_standalone_recovery_key",
    "load_backup_keys",
    "new_standalone_recovery_key",
]

logger = logging.getLogger(__name__)

_BACKUP: Final = "backup.key"
_NAMING: Final = "naming.key"
_RECOVERY_PUB: Final = "recovery.pub"


@dataclass(frozen=True)
class BackupKeys:
    """What a backup needs: who may open it, and how segments are named."""

    keypair: BoxKeyPair = field(repr=False)
    naming_key: bytes = field(repr=False)
    recovery_public_key: bytes | None
    """The account's (joined) or the person's (stand-alone) recovery key, if any."""

    @property
    def recipients(self) -> list[bytes]:
        """Public keys a manifest is sealed to."""
        out = [self.keypair.public_key]
        if self.recovery_public_key and self.recovery_public_key != self.keypair.public_key:
            out.append(self.recovery_public_key)
        return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("keys", f"cannot read {path}: {e}") from None


def load_backup_keys(data_dir: Path) -> BackupKeys:
    """Load the backup keys, making the machine's own on first use (0600, fsynced)."""
    keys = data_dir / "keys"
    ensure_private_dir(keys)
    backup_path, naming_path = keys / _BACKUP, keys / _NAMING
    if not backup_path.exists():
        write_atomic(
            backup_path, (encode_private_key(BoxKeyPair.generate().private_key) + "\n").encode()
        )
    if not naming_path.exists():
        write_atomic(naming_path, (secrets.token_bytes(32).hex() + "\n").encode())
    try:
        keypair = BoxKeyPair.from_private(decode_private_key(_read(backup_path)))
        naming = bytes.fromhex(_read(naming_path))
    except ValueError:
        raise ConfigError("keys", f"{backup_path} or {naming_path} is damaged") from None
    if len(naming) != 32:
        raise ConfigError("keys", f"{naming_path} must hold 32 bytes")
    recovery: bytes | None = None
    if is_joined(data_dir):
        try:
            recovery = load_link(data_dir).account_recovery_public_key
        except AgentsError as e:
            # The daemon still starts (its agents run); backups are then sealed to
            # the machine's key alone, and status says there is no recovery key.
            logger.error("backups: cannot read the account's recovery key: %s", e)
    elif (keys / _RECOVERY_PUB).exists():
        try:
            recovery = decode_public_key(_read(keys / _RECOVERY_PUB))
        except ValueError:
            raise ConfigError("keys", f"{keys / _RECOVERY_PUB} is damaged") from None
    return BackupKeys(keypair, naming, recovery)


def has_standalone_recovery_key(data_dir: Path) -> bool:
    """Whether this stand-alone machine made its recovery key pair already."""
    return (data_dir / "keys" / _RECOVERY_PUB).exists()


def new_standalone_recovery_key(
    data_dir: Path, show: Callable[[BoxKeyPair], None] | None = None
) -> BoxKeyPair:
    """Make a stand-alone machine's recovery key pair; keep only the public half.

    The caller shows the private half to the person once: with ``show``,
    before the public half is kept (a key that could not be shown is not used
    to seal anything; ``show`` raising keeps nothing). Refused when the machine
    is joined (its account's key is used) or already has one.
    """
    _may_make_recovery_key(data_dir)
    pair = BoxKeyPair.generate()
    if show is not None:
        show(pair)
    keep_standalone_recovery_key(data_dir, pair.public_key)
    return pair


def keep_standalone_recovery_key(data_dir: Path, public_key: bytes) -> None:
    """Keep the public half of a recovery key pair the caller made and has shown
    already (the CLI prints the private half before it asks the daemon, so a key
    that could not be printed is never used). Refused as
    :func:`new_standalone_recovery_key` is."""
    path = _may_make_recovery_key(data_dir)
    try:
        seal_bytes(b"check", [public_key])  # every later backup is sealed to it
    except InvalidArgument:
        raise InvalidArgument("public_key", "not a usable X25519 public key") from None
    write_atomic(path, (encode_public_key(public_key) + "\n").encode())


def _may_make_recovery_key(data_dir: Path) -> Path:
    """Where the recovery public key goes; InvalidState when there must be none."""
    if is_joined(data_dir):
        raise InvalidState("recovery key", "a joined machine uses its account's recovery key")
    keys = data_dir / "keys"
    ensure_private_dir(keys)
    path = keys / _RECOVERY_PUB
    if path.exists():
        raise InvalidState("recovery key", f"this machine has one already ({path})")
    return path
