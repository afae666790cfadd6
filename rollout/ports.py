"""Free loopback ports for a program that binds them a moment (or seconds) after the probe.

Why not `bind(0)`: the kernel hands out such ports from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), the same range every outgoing
connection on the host draws its local port from. Between the probe and the program's own bind
(vLLM binds seconds after it is spawned) any running daemon's outgoing connection can take the
port, and the start fails with "address already in use". Ports drawn below that range are taken
only by a program that binds them on purpose, and the probe sees those.
"""

import random
import socket
import threading

EPHEMERAL_DEFAULT_LOW = 32_768
LOW = 20_000
"""The lowest port drawn: above the well-known and most registered service ports."""


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_DEFAULT_LOW


_handed_out: set[int] = set()
"""Ports this process was given already: a port is free until its program binds it, so a
second probe before that bind would find it free again and hand it out twice."""
_lock = threading.Lock()


def free_port_block(span: int = 1, step: int = 1, low: int = LOW, host: str = "127.0.0.1",
                    tries: int = 200) -> int:
    """A base port with ports base..base+span-1 all free on `host` now and none handed out
    before in this process, drawn at random (a multiple of `step` from `low`) below the
    ephemeral range."""
    high = max(low + step, ephemeral_low() - span)
    with _lock:
        for _ in range(tries):
            base = random.randrange(low, high, step)
            block = range(base, base + span)
            if any(p in _handed_out for p in block):
                continue
            socks: list[socket.socket] = []
            try:
                for port in block:
                    s = socket.socket()
                    socks.append(s)
                    s.bind((host, port))
            except OSError:
                continue
            finally:
                for s in socks:
                    s.close()
            _handed_out.update(block)
            return base
    raise OSError(f"no block of {span} free ports on {host} between {low} and {high + span} "
                  f"after {tries} draws")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now, below the ephemeral range."""
    return free_port_block(1, 1, LOW, host)
