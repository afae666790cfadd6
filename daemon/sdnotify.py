"""systemd's notify protocol for `Type=notify` units: READY, STATUS, STOPPING, RELOADING and the
watchdog, as datagrams to $NOTIFY_SOCKET (a path or an abstract `@name`). Everything is a no-op
when NOTIFY_SOCKET is unset (run by hand, in tests). The environment is read here because systemd
passes these values that way. Raw protocol rather than the `sdnotify` package: that one reads the
environment in its constructor and hides every exception (KeyboardInterrupt included).
"""

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | None:
    if raw.startswith("/"):
        return raw
    if raw.startswith("@") and len(raw) > 1:
        return "\0" + raw[1:]
    log.warning("NOTIFY_SOCKET=%r is not a path or @abstract name; systemd notify disabled", raw)
    return None


def _clean(text: str) -> str:
    """One line: a newline would start a new assignment (STATUS='x\\nREADY=1')."""
    return " ".join(text.splitlines())


class Notifier:
    """Sends notify messages to one socket address; `Notifier(None)` sends nothing."""

    def __init__(self, address: str | None, timeout: float = 1.0):
        self.raw = address
        self.address = _address(address) if address else None
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Notifier":
        return cls(environ.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=value` lines as one datagram; True if sent. Failures are logged, not
        raised: a missed notification must not take the daemon down (systemd will time out)."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(self.timeout)
            self._sock.sendto("\n".join(assignments).encode(), self.address)
            return True
        except OSError as e:
            if not self._warned:
                log.warning("systemd notify to %s failed: %s", self.raw, e)
                self._warned = True
            self.close()
            return False

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={_clean(status)}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_clean(text)}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={_clean(status)}"] if status else []))

    def reloading(self) -> bool:
        """Call `ready()` again when the reload is done. MONOTONIC_USEC is what systemd >= 253
        requires for `Type=notify-reload`; older versions ignore it."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before a start/stop timeout (long verify or drain)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(1, round(seconds * 1e6))}")


def watchdog_interval(environ: Mapping[str, str] = os.environ) -> float | None:
    """WatchdogSec in seconds when systemd expects pings from this process, else None."""
    raw = environ.get("WATCHDOG_USEC")
    if not raw:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; watchdog pings disabled", raw)
        return None
    return usec / 1e6 if usec > 0 else None


_default: Notifier = Notifier(None)


def default() -> Notifier:
    """The process's notifier, rebuilt if NOTIFY_SOCKET changed since the last call."""
    global _default
    raw = os.environ.get("NOTIFY_SOCKET") or None
    if raw != _default.raw:
        _default.close()
        _default = Notifier(raw)
    return _default


def ready(status: str | None = None) -> bool:
    return default().ready(status)


def status(text: str) -> bool:
    return default().status(text)


def stopping(status: str | None = None) -> bool:
    return default().stopping(status)


def reloading() -> bool:
    return default().reloading()


def watchdog() -> bool:
    return default().watchdog()


def extend_timeout(seconds: float) -> bool:
    return default().extend_timeout(seconds)


async def watchdog_loop(
    check: Callable[[], bool] | None = None, interval: float | None = None
) -> None:
    """Ping WATCHDOG=1 every half interval while `check()` (if given) is true; returns at once
    when systemd set no watchdog. Run it as a task and cancel it on shutdown."""
    interval = watchdog_interval() if interval is None else interval
    if not interval:
        return
    while True:
        if check is None or check():
            watchdog()
        else:
            log.warning("health check failed; withholding the systemd watchdog ping")
        await asyncio.sleep(interval / 2)
