"""shared.sd_notify against a real Unix datagram socket in systemd's place."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.sd_notify import Notifier, NotifyConfig
from tests.helpers.notify_socket import NotifySocket
from tests.helpers.poll import apoll_until

PID = 4242


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, NotifyConfig()),
        ({"NOTIFY_SOCKET": "/run/systemd/notify"}, NotifyConfig("/run/systemd/notify")),
        ({"NOTIFY_SOCKET": "@sd-notify"}, NotifyConfig("@sd-notify")),
        # Not a form systemd gives a service: ignored (libsystemd refuses it too).
        ({"NOTIFY_SOCKET": "run/notify"}, NotifyConfig()),
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "30000000"}, NotifyConfig("/n", 30.0)),
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(PID)},
         NotifyConfig("/n", 0.4)),
        # Inherited from a parent the watchdog was meant for: not ours to ping.
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"},
         NotifyConfig("/n")),
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "0"}, NotifyConfig("/n")),
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "-5"}, NotifyConfig("/n")),
        ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "soon"}, NotifyConfig("/n")),
    ],
)  # fmt: skip
def test_settings_from_the_environment(env: dict[str, str], expected: NotifyConfig) -> None:
    assert NotifyConfig.from_env(env, PID) == expected


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (NotifyConfig("relative/path"), "notify_socket"),
        (NotifyConfig("/a\0b"), "notify_socket"),
        (NotifyConfig("/n", -1.0), "watchdog_seconds"),
        (NotifyConfig("/n", float("nan")), "watchdog_seconds"),
    ],
)
def test_validate_names_the_bad_field(config: NotifyConfig, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert err.value.field == field


def test_nothing_is_sent_and_no_socket_opened_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", refuse)
    notifier = Notifier(NotifyConfig())
    assert not notifier.config.enabled
    assert not notifier.ready("serving")
    assert not notifier.status("x") and not notifier.stopping() and not notifier.watchdog()


def test_each_notification_on_a_path_socket(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address))
        assert notifier.status("starting: opening the store")
        assert notifier.ready("serving on unix:///x")
        assert notifier.watchdog()
        assert notifier.stopping("stopping: draining")
        assert notifier.ready()
        got = manager.receive()
    assert [n.raw for n in got] == [
        b"STATUS=starting: opening the store",
        b"READY=1\nSTATUS=serving on unix:///x",
        b"WATCHDOG=1",
        b"STOPPING=1\nSTATUS=stopping: draining",
        b"READY=1",
    ]
    assert {n.pid for n in got} == {os.getpid()}


def test_an_abstract_socket() -> None:
    name = f"agents-test-{uuid.uuid4().hex}"
    with NotifySocket.abstract(name) as manager:
        assert manager.address == f"@{name}"
        assert Notifier(NotifyConfig(manager.address)).ready("up")
        assert [n.fields for n in manager.receive()] == [{"READY": "1", "STATUS": "up"}]


def test_a_status_is_one_short_line(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address))
        assert notifier.status("a\nREADY=1\n  b")
        # A newline would start a field of its own: READY=1 must not be read here.
        assert [n.fields for n in manager.receive()] == [{"STATUS": "a READY=1 b"}]
        assert not notifier.status(" \n ")  # empty: nothing is sent
        # systemd ignores a datagram over 4096 bytes: a long status is cut instead.
        assert notifier.status("é" * 5000)
        assert [len(n.fields["STATUS"]) for n in manager.receive()] == [1000]
        assert manager.receive() == []


def test_a_missing_socket_is_one_warning_then_one_line_when_it_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "shared.sd_notify")
    path = tmp_path / "notify"
    notifier = Notifier(NotifyConfig(str(path)))
    assert [notifier.watchdog() for _ in range(5)] == [False] * 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"systemd notification: notify {path}: No such file or directory"]
    with NotifySocket.bind(path) as manager:
        assert notifier.watchdog()
        assert [n.raw for n in manager.receive()] == [b"WATCHDOG=1"]
    assert "works again" in caplog.records[-1].getMessage()


def test_a_full_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    # The manager reads nothing: a blocking send would hang here (the test's
    # timeout), a non-blocking one is refused once the queue is full.
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address))
        sent = [notifier.watchdog() for _ in range(1000)]
        assert sent[0] and not sent[-1]
        assert len(manager.receive()) == sent.count(True)


async def test_the_watchdog_pings_every_half_interval(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address, watchdog_seconds=0.1))
        began = time.monotonic()
        async with notifier.pinging():
            await apoll_until(lambda: manager.count("WATCHDOG") >= 4, deadline=10, what="4 pings")
        took = time.monotonic() - began
        # The first at once, then one every 0.05 s: 3 intervals at least.
        assert took >= 0.14
        # Out of the block, nothing is left to ping.
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "systemd-watchdog"]


async def test_no_watchdog_no_pings(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address))
        await asyncio.wait_for(notifier.keep_alive(), 5)  # returns at once
        assert manager.receive() == []


async def test_a_blocked_event_loop_sends_no_pings(tmp_path: Path) -> None:
    with NotifySocket.bind(tmp_path / "notify") as manager:
        notifier = Notifier(NotifyConfig(manager.address, watchdog_seconds=0.02))
        async with notifier.pinging():
            await apoll_until(lambda: manager.count("WATCHDOG") >= 2, deadline=10, what="2 pings")
            # The loop is stuck (a blocking call on it) for 25 intervals: a
            # thread would have pinged through it; the loop's task cannot.
            time.sleep(0.25)
            assert manager.receive() == []
            await apoll_until(
                lambda: manager.receive(), deadline=10, what="a ping once the loop runs"
            )
