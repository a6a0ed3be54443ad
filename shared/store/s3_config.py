"""Where an S3 store's bucket is and how to reach it: :class:`S3Config`.

Kept apart from :mod:`shared.store.s3` so that parsing a store URL (every CLI
run, a folder-store daemon) does not import aiobotocore, which costs most of a
second at start-up; only :meth:`~shared.store.s3.S3Store.open` needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from shared.errors import InvalidArgument
from shared.store.base import validate_prefix

__all__ = ["MAX_PARTS", "MAX_PUT_SIZE", "MIB", "MIN_PART_SIZE", "S3Config"]

MIB: Final = 1024 * 1024
#: S3's smallest part (except the last) and largest single PutObject.
MIN_PART_SIZE: Final = 5 * MIB
MAX_PUT_SIZE: Final = 5 * 1024 * MIB
MAX_PARTS: Final = 10_000


@dataclass(frozen=True, slots=True)
class S3Config:
    """Where the bucket is and how to reach it. Secrets never appear in ``repr``."""

    bucket: str
    """The bucket's name."""
    prefix: str = ""
    """Key prefix of this deployment inside the bucket ("" or ending in "/")."""
    endpoint_url: str | None = None
    """http(s) URL of an S3-compatible server; None for AWS itself."""
    region: str = "us-east-1"
    """The bucket's region (used for request signing)."""
    access_key: str | None = field(default=None, repr=False)
    """Access key id; None lets botocore find credentials (e.g. an instance role)."""
    secret_key: str | None = field(default=None, repr=False)
    """Secret access key, given with ``access_key``."""
    path_style: bool = True
    """Path-style addressing (``endpoint/bucket/key``), which most servers need."""
    part_size: int = 8 * MIB
    """Multipart part size; also the largest object sent in a single PutObject."""
    connect_timeout: float = 10.0
    """Seconds to open a connection."""
    read_timeout: float = 60.0
    """Seconds to wait for bytes on an open connection."""
    spool_dir: Path | None = None
    """Folder for temp files of large conditional writes (None: the system default)."""
    object_lock: bool = False
    """The bucket must have Object Lock enabled with a default retention: checked when
    the store opens (refused without), and every upload carries a checksum (S3 refuses
    an upload to such a bucket without one)."""

    def validate(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if not self.bucket or not all(c.isalnum() or c in ".-" for c in self.bucket):
            raise InvalidArgument("bucket", "must be a valid bucket name")
        if self.prefix:
            validate_prefix(self.prefix)
            if not self.prefix.endswith("/"):
                raise InvalidArgument("prefix", "must end with '/'")
        if self.part_size < MIN_PART_SIZE:
            raise InvalidArgument("part_size", f"must be at least {MIN_PART_SIZE} bytes")
        if (self.access_key is None) != (self.secret_key is None):
            raise InvalidArgument("secret_key", "access key and secret key go together")
