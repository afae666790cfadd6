"""Free loopback ports for a program that binds them a moment (or seconds) after the probe.

Why not `bind(0)`: the kernel hands out such ports from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), the same range every outgoing
connection on the host draws its local port from. Between the probe and the program's own bind
(vLLM binds seconds after it is spawned) any running daemon's outgoing connection can take the
port, and the start fails with "address already in use". Ports drawn outside that range are
taken only by a program that binds them on purpose, and the probe sees those. Where a host's
ephemeral range leaves too few ports outside it (a tuned `1024 65535`), the kernel's `bind(0)`
is used after all: the race is back, but nothing fails for want of ports.
"""

import random
import socket
import threading

EPHEMERAL_DEFAULT = (32_768, 60_999)
LOW = 20_000
"""The lowest port drawn: above the well-known and most registered service ports."""
MIN_SPACE = 1_000
"""Fewer ports than this outside the ephemeral range: use the kernel's bind(0) instead."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral range, both ends included."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


_handed_out: set[int] = set()
"""Ports this process was given already: a port is free until its program binds it, so a
second probe before that bind would find it free again and hand it out twice."""
_lock = threading.Lock()


def _spaces(span: int, low: int, high: int) -> list[range]:
    """Where a block of `span` ports in low..high may start: below the ephemeral range, and
    above it."""
    e_low, e_high = ephemeral_range()
    top = min(high, 65_535) + 1
    out = [range(low, min(e_low, top) - span + 1), range(max(low, e_high + 1), top - span + 1)]
    return [r for r in out if len(r) > 0]


def _bindable(host: str, block: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in block:
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(span: int = 1, step: int = 1, low: int = LOW, host: str = "127.0.0.1",
                    tries: int = 200, high: int = 65_535) -> int:
    """A base port with ports base..base+span-1 all free on `host` now and none handed out
    before in this process, drawn at random (a multiple of `step`) from `low` to `high` (the
    highest port the program accepts), outside the ephemeral range."""
    with _lock:
        spaces = _spaces(span, low, high)
        if sum(len(r) for r in spaces) < MIN_SPACE:
            if span == 1:
                return _kernel_port(host)
            raise OSError(f"fewer than {MIN_SPACE} ports in {low}-{high} lie outside the "
                          f"ephemeral range {ephemeral_range()}: no block of {span} to draw; "
                          "narrow net.ipv4.ip_local_port_range or give the program fixed ports")
        starts = [range(-(-r.start // step) * step, r.stop, step) for r in spaces]
        starts = [r for r in starts if len(r) > 0]
        for _ in range(tries if starts else 0):
            base = random.choice(random.choices(starts, weights=[len(r) for r in starts])[0])
            block = range(base, base + span)
            if any(p in _handed_out for p in block) or not _bindable(host, block):
                continue
            _handed_out.update(block)
            return base
    raise OSError(f"no block of {span} free ports on {host} outside the ephemeral range "
                  f"after {tries} draws: free some of those ports or give the program fixed "
                  "ones")


def _kernel_port(host: str) -> int:
    """A port from the kernel's bind(0), not handed out before in this process."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise OSError(f"the kernel gave {host} only ports this process had handed out already")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now, outside the ephemeral range where the host leaves room."""
    return free_port_block(1, 1, LOW, host)
