"""systemd notify protocol against real AF_UNIX datagram sockets (a path and an abstract name)."""

import asyncio
import os
import socket
import time
import uuid
from types import SimpleNamespace

import pytest

from daemon import sdnotify


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path, monkeypatch):
    """A bound datagram socket standing in for systemd; NOTIFY_SOCKET points at it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        addr = str(tmp_path / "notify.sock")
        sock.bind(addr)
        env = addr
    else:
        name = f"deltaswarm-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        env = "@" + name
    sock.settimeout(2.0)
    monkeypatch.setenv("NOTIFY_SOCKET", env)
    try:
        yield sock
    finally:
        sdnotify.default().close()
        sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_ready_status_stopping_send_exact_messages(listener):
    assert sdnotify.ready()
    assert recv(listener) == "READY=1"
    assert sdnotify.status("syncing v7 (42%)")
    assert recv(listener) == "STATUS=syncing v7 (42%)"
    assert sdnotify.ready("serving v7")
    assert recv(listener) == "READY=1\nSTATUS=serving v7"
    assert sdnotify.stopping("draining")
    assert recv(listener) == "STOPPING=1\nSTATUS=draining"
    assert sdnotify.watchdog()
    assert recv(listener) == "WATCHDOG=1"
    assert sdnotify.extend_timeout(2.5)
    assert recv(listener) == "EXTEND_TIMEOUT_USEC=2500000"


def test_reloading_carries_monotonic_usec(listener):
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading()
    first, second = recv(listener).split("\n")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC" and before <= int(value) <= after


def test_status_text_cannot_inject_assignments(listener):
    sdnotify.status("bad\nREADY=1\r\nWATCHDOG=1")
    msg = recv(listener)
    assert "\n" not in msg
    assert msg.startswith("STATUS=bad")


def test_unicode_status_is_sent_as_utf8(listener):
    sdnotify.status("région ↓ 3 MiB/s")
    assert recv(listener) == "STATUS=région ↓ 3 MiB/s"


def test_everything_is_a_noop_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.default().enabled
    assert sdnotify.ready() is False
    assert sdnotify.status("x") is False
    assert sdnotify.stopping() is False
    assert sdnotify.watchdog() is False


def test_missing_socket_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.ready() is False
    assert sdnotify.status("still alive") is False
    warnings = [r for r in caplog.records if "systemd notify" in r.getMessage()]
    assert len(warnings) == 1 and "gone.sock" in warnings[0].getMessage()
    sdnotify.default().close()


def test_unsupported_address_disables_notify(monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sdnotify.ready() is False
    assert any("not a path" in r.getMessage() for r in caplog.records)


def test_watchdog_interval_reads_usec_and_checks_pid():
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": pid}) == 0.5
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def drain(sock: socket.socket) -> list[str]:
    """Every datagram waiting on the non-blocking `sock`."""
    out = []
    while True:
        try:
            out.append(sock.recv(64).decode())
        except BlockingIOError:
            return out


class Ticks:
    """Stands in for the loop's asyncio.sleep: records each requested pause, runs `on_tick`
    after it, and stops the loop (CancelledError, as a shutdown would) after `n` pauses. No
    real time passes, so the count of pings per pause is exact on a loaded host."""

    def __init__(self, monkeypatch, n: int, on_tick=lambda i: None) -> None:
        self.pauses: list[float] = []
        self.n, self.on_tick = n, on_tick
        real = asyncio.sleep

        async def sleep(seconds: float) -> None:
            self.pauses.append(seconds)
            self.on_tick(len(self.pauses))
            if len(self.pauses) >= self.n:
                raise asyncio.CancelledError
            await real(0)

        monkeypatch.setattr(sdnotify, "asyncio", SimpleNamespace(sleep=sleep))


async def test_watchdog_loop_pings_at_half_the_interval(listener, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    listener.setblocking(False)
    ticks = Ticks(monkeypatch, 5)
    with pytest.raises(asyncio.CancelledError):
        await sdnotify.watchdog_loop()
    # one ping before each pause of half the 0.4 s interval
    assert ticks.pauses == [0.2] * 5
    assert drain(listener) == ["WATCHDOG=1"] * 5


async def test_watchdog_loop_withholds_pings_while_unhealthy(listener, monkeypatch, caplog):
    listener.setblocking(False)
    healthy = [True]

    def tick(i: int) -> None:
        if i == 2:
            healthy[0] = False  # healthy for the first two rounds, then not

    ticks = Ticks(monkeypatch, 5, tick)
    with pytest.raises(asyncio.CancelledError):
        await sdnotify.watchdog_loop(lambda: healthy[0], interval=0.1)
    assert ticks.pauses == [0.05] * 5
    assert drain(listener) == ["WATCHDOG=1"] * 2, "no ping in the three unhealthy rounds"
    assert caplog.text.count("withholding the systemd watchdog ping") == 3


async def test_watchdog_loop_returns_when_systemd_set_no_watchdog(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert await asyncio.wait_for(sdnotify.watchdog_loop(), timeout=1.0) is None
