"""Attachments over the daemon's API: the media type given back, a malformed id
answered as an unknown one, and a directory where the file goes refused (not
INTERNAL) and logged once."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import grpc
import pytest

from machine.cli.client import MachineClient
from machine.config import MachineConfig
from shared.errors import InvalidArgument, InvalidState, NotFound


def _code(err: BaseException) -> grpc.StatusCode:
    cause = err.__cause__
    assert isinstance(cause, grpc.aio.AioRpcError), cause
    return cause.code()


async def test_the_media_type_is_stored_and_given_back(
    daemon: MachineConfig, tmp_path: Path
) -> None:
    async with MachineClient(daemon) as client:
        agent = (await client.create_agent("a", str(tmp_path))).id
        declared = await client.upload_attachment(agent, "x.bin", 2, [b"hi"], "Text/Markdown")
        assert declared.media_type == "text/markdown"
        guessed = await client.upload_attachment(agent, "photo.png", 3, [b"png"])
        assert guessed.media_type == "image/png"
        unknown = await client.upload_attachment(agent, "blob.zzz-unknown", 1, [b"z"])
        assert unknown.media_type == "application/octet-stream"
        for bad in ["text", "text/plain; charset=utf-8", "a/" + "b" * 300, "te xt/plain"]:
            with pytest.raises(InvalidArgument) as refused:
                await client.upload_attachment(agent, "f.txt", 1, [b"y"], bad)
            assert refused.value.field == "media_type"
    rows = await _stored_media_types(daemon)
    assert rows == {
        hashlib.sha256(b"hi").hexdigest(): "text/markdown",
        hashlib.sha256(b"png").hexdigest(): "image/png",
        hashlib.sha256(b"z").hexdigest(): "application/octet-stream",
    }


async def _stored_media_types(cfg: MachineConfig) -> dict[str, str]:
    import sqlite3

    conn = sqlite3.connect(cfg.data_dir / "machine.db")
    try:
        rows = conn.execute("SELECT sha256, media_type FROM attachment_refs").fetchall()
    finally:
        conn.close()
    return dict(rows)


async def test_a_malformed_id_answers_as_an_unknown_one(
    daemon: MachineConfig, tmp_path: Path
) -> None:
    async with MachineClient(daemon) as client:
        agent = (await client.create_agent("a", str(tmp_path))).id
        unknown_id = "0" * 64
        with pytest.raises(NotFound) as unknown:
            _ = [e async for e in client.prompt(agent, "see", [unknown_id])]
        for malformed in ["not-a-sha", "A" * 64, "0" * 63, "0" * 500]:
            with pytest.raises(NotFound) as refused:
                _ = [e async for e in client.prompt(agent, "see", [malformed])]
            assert _code(refused.value) == _code(unknown.value) == grpc.StatusCode.NOT_FOUND
            shown = malformed if len(malformed) <= 64 else malformed[:61] + "..."
            assert str(refused.value) == str(unknown.value).replace(unknown_id, shown)
        assert await client.list_runs(agent) == []


async def test_a_directory_where_the_file_goes_is_refused_and_logged_once(
    daemon: MachineConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with MachineClient(daemon) as client:
        agent = (await client.create_agent("a", str(tmp_path))).id
        rec = await client.upload_attachment(agent, "f.txt", 3, [b"abc"])
        path = daemon.attachments_dir / rec.sha256
        path.unlink()
        path.mkdir()
        with caplog.at_level(logging.ERROR, logger="machine.core.attachments"):
            for _ in range(2):
                with pytest.raises(InvalidState, match="a directory stands where") as used:
                    _ = [e async for e in client.prompt(agent, "see", [rec.sha256])]
                assert _code(used.value) == grpc.StatusCode.FAILED_PRECONDITION
                # Uploading the same bytes again does not replace the directory either.
                with pytest.raises(InvalidState) as upload:
                    await client.upload_attachment(agent, "f.txt", 3, [b"abc"])
                assert _code(upload.value) == grpc.StatusCode.FAILED_PRECONDITION
        lines = [r for r in caplog.records if "is a directory" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert path.is_dir() and await client.list_runs(agent) == []
        # Once it is gone, the upload works again and the prompt uses it.
        path.rmdir()
        await client.upload_attachment(agent, "f.txt", 3, [b"abc"])
        events = [e async for e in client.prompt(agent, "see", [rec.sha256])]
        assert events[0].payload["attachments"] == [rec.sha256]
