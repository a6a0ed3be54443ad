"""Recovery key files: an X25519 private key kept offline, as one line of text.

The control plane's operator recovery key opens the sealed key bundle; an
account's recovery key opens a machine's backups on a new machine. Both are
files of the same shape::

    # agents recovery key: keep this file offline; it opens <what>
    agsk1_…

A key file is written once (an existing file is never overwritten: it may be
the only copy of a key) with mode 0600, and read back with one clear error
for each way it can be wrong. The key text never appears in an error.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Final

from shared.atomic import fsync_dir
from shared.crypto import BoxKeyPair, decode_private_key, encode_private_key
from shared.errors import InvalidArgument

__all__ = ["read_recovery_key", "write_recovery_key"]

logger = logging.getLogger(__name__)

#: A key file is a few lines; anything larger is not one.
MAX_FILE: Final = 4096


def write_recovery_key(path: Path, keypair: BoxKeyPair, what: str) -> None:
    """Write ``keypair``'s private half to the new file ``path`` (0600, fsynced).

    InvalidArgument("recovery_key", ...) if the file exists or cannot be made.
    """
    text = (
        f"# agents recovery key: keep this file offline; it opens {what}\n"
        f"{encode_private_key(keypair.private_key)}\n"
    )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise InvalidArgument(
            "recovery_key", f"{path} exists; refusing to overwrite a key"
        ) from None
    except OSError as e:
        raise InvalidArgument("recovery_key", f"cannot create {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent if str(path.parent) else Path("."))


def read_recovery_key(path: Path, warn: Callable[[str], None] | None = None) -> BoxKeyPair:
    """The key pair in the key file ``path``; InvalidArgument naming what is wrong.

    ``warn`` is told when other users may read the file (it is used, not
    refused: it may be needed at the worst moment, on a box set up in haste).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise InvalidArgument("recovery_key", f"cannot read {path}: {e.strerror}") from None
    if len(raw) > MAX_FILE:
        raise InvalidArgument("recovery_key", f"{path} is not a recovery key file (too large)")
    try:
        lines = [
            line.strip()
            for line in raw.decode("ascii").splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]
    except UnicodeDecodeError:
        raise InvalidArgument("recovery_key", f"{path} is not a recovery key file") from None
    if len(lines) != 1:
        raise InvalidArgument("recovery_key", f"{path} must hold exactly one key line")
    try:
        private = decode_private_key(lines[0])
    except InvalidArgument as e:
        raise InvalidArgument("recovery_key", f"{path}: the key {e.reason}") from None
    if warn is not None and stat.S_ISREG(mode) and mode & 0o077:
        warn(
            f"warning: {path} can be read by other users (mode {stat.S_IMODE(mode):04o});"
            f" a recovery key opens every backup: chmod 600 {path}, keep it offline"
        )
    return BoxKeyPair.from_private(private)
