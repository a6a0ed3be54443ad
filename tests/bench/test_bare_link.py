"""bench/bare_link.py measures its floor with the gRPC options it is given."""

from __future__ import annotations

import asyncio
import math

import pytest

from bench.bare_link import main, measure_bare


def test_a_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("bdp_probe=0", "grpc.http2.bdp_probe", "=1"):
        with pytest.raises(SystemExit) as exit_:
            main(["--option", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"expected grpc.NAME=VALUE, got {bad!r}" in err
        assert "Traceback" not in err


def test_an_option_reaches_the_server() -> None:
    # A one-byte receive limit refuses the machine's hello: the stream ends at once,
    # no heartbeat is heard and the CPU per heartbeat is not a number. (Without it
    # the links are heard: the bench smoke test prints their figure.)
    refused = asyncio.run(measure_bare(2, 0.2, 1, [("grpc.max_receive_message_length", 1)]))
    assert math.isnan(refused.us_per_heartbeat)
