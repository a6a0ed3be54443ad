"""Link clients that follow the machine's identity on disk.

The live link (``connection``, ``renewal``) writes a renewed certificate, or
the CA set of a rollover, into ``keys/``. A client built once at start would go
on presenting the certificate of that moment: after ``ca rollover
--retire-old``, or once a routine renewal's old certificate expired, every
call was refused until the daemon restarted (backups stopped on day 30). So a
long-lived user of the link (the backup target) asks :meth:`current` before each
call: a ``stat`` of the three files, and a new client when one of them changed.

The same goes for the address: the live link saves the link address that
last worked first in ``link.json`` (a replica that went away, docs/
controlplane.md "Replicas"), so ``link.json`` is stamped too and the client
dials the record's first address.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from machine.link import identity
from machine.link.client import LinkClient

__all__ = ["FollowingLinkClients"]

logger = logging.getLogger(__name__)


class FollowingLinkClients:
    """Mutual-TLS clients of the record's first link address (``address`` until
    there is a record) built from ``data_dir``'s current keys."""

    def __init__(self, data_dir: Path, address: str) -> None:
        self._data_dir = data_dir
        self._address = address
        self._client: LinkClient | None = None
        self._stamp: tuple[int, ...] = ()
        # Replaced clients stay open until aclose: a call in flight on one finishes.
        self._replaced: list[LinkClient] = []
        self._lock = asyncio.Lock()

    def _files_stamp(self) -> tuple[int, ...]:
        keys = self._data_dir / identity.KEYS_DIR
        stamp: list[int] = []
        for name in (identity.TLS_KEY, identity.TLS_CERT, identity.CA_CERT):
            try:
                st = (keys / name).stat()
            except OSError:
                return ()  # load_keys says what is wrong
            # The inode too: certificates are replaced by rename, maybe within one tick.
            stamp += [st.st_ino, st.st_mtime_ns, st.st_size]
        try:
            st = (self._data_dir / identity.LINK_FILE).stat()
            stamp += [st.st_ino, st.st_mtime_ns, st.st_size]
        except OSError:
            stamp += [0, 0, 0]  # no record: the address given at start
        return tuple(stamp)

    def _record_address(self) -> str:
        """The record's first link address (the one that last worked), else the last known."""
        if not (self._data_dir / identity.LINK_FILE).is_file():
            return self._address
        return identity.load_link(self._data_dir).control_address

    async def current(self) -> LinkClient:
        """The client for the keys on disk now (a new one when they changed)."""
        async with self._lock:
            stamp = await asyncio.to_thread(self._files_stamp)
            if self._client is not None and stamp and stamp == self._stamp:
                return self._client
            keys = await asyncio.to_thread(identity.load_keys, self._data_dir)
            address = await asyncio.to_thread(self._record_address)
            if self._client is not None:
                self._replaced.append(self._client)
                logger.info(
                    "the machine's certificate or link address changed on disk:"
                    " the link client follows (%s)",
                    address,
                )
            self._address = address
            self._client = LinkClient.mutual(
                self._address,
                ca_pem=keys.ca_cert_pem,
                key_pem=keys.tls_key_pem,
                cert_pem=keys.tls_cert_pem,
            )
            self._stamp = stamp
            return self._client

    async def aclose(self) -> None:
        """Close every client made (idempotent)."""
        clients = [*self._replaced, *([self._client] if self._client is not None else [])]
        self._replaced, self._client = [], None
        for client in clients:
            await client.aclose()
