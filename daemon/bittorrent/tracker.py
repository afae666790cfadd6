"""A loopback BitTorrent tracker each swarm runs for its own downloads, so they dial at once.

libtorrent dials the peers a torrent is given (`connect_peer`) from its connect scheduler, which
runs once a second; only a torrent's first tracker response is dialled the moment it arrives
("connect boost"). A daemon already knows whom a download should dial (its peer book), so each
download names this tracker and the tracker answers with exactly those peers: a new artifact's
first connection goes out within milliseconds instead of up to a second later, on every hop of
every version (bench/dial.py measures both ways in one run).

It serves only the swarm it belongs to: bound to the swarm's own address on a free port (the
session announces from that address; loopback when the swarm listens on every interface), it
answers only torrents it was told about (others get a tracker failure), and a reply tells a
caller who already knows a torrent's info-hash (only token holders are served torrents) the
endpoints that peers' handshakes and control planes show anyway.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import libtorrent as lt

Peer = tuple[str, int]
INTERVAL_S = 3600
"""Re-announce interval asked of libtorrent: the peer list changes through add_peers, and the
announce only has to be quick once, when the download starts."""


def compact(peers: Iterable[Peer]) -> tuple[bytes, bytes]:
    """BEP 23 / BEP 7 compact peer lists (IPv4, IPv6); names that are not IP literals are left
    out (the peer book refuses them before they get here)."""
    v4, v6 = bytearray(), bytearray()
    for host, port in peers:
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            continue
        if ip.version == 4:
            v4 += ip.packed + struct.pack(">H", int(port))
        else:
            v6 += ip.packed + struct.pack(">H", int(port))
    return bytes(v4), bytes(v6)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """libtorrent drops an announce it no longer needs (its torrent was removed, the
        session is closing) before the reply is written: not an error worth a traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class LocalTracker:
    """`offer(hashes, peers)` what a torrent should dial; `url` goes into its tracker list."""

    def __init__(self, host: str) -> None:
        self._peers: dict[bytes, set[Peer]] = {}
        self._lock = threading.Lock()
        self.announces = 0
        tracker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                split = urlsplit(self.path)
                if split.path != "/announce":
                    self.send_error(404)
                    return
                query = dict(parse_qsl(split.query, encoding="latin-1"))
                body = tracker.answer(query.get("info_hash", "").encode("latin-1"),
                                      query.get("event", ""))
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self._server = (_Server6 if ":" in host else _Server)((host, 0), Handler)
        name = f"[{host}]" if ":" in host else host
        self.url = f"http://{name}:{self._server.server_address[1]}/announce"
        self._thread = threading.Thread(target=self._server.serve_forever, name="bt-tracker",
                                        daemon=True)
        self._thread.start()

    def answer(self, info_hash: bytes, event: str = "") -> bytes:
        """The bencoded announce reply for a torrent this swarm downloads (a removed torrent's
        last announce, event=stopped, is acknowledged, not failed)."""
        if event == "stopped":
            return lt.bencode({b"interval": INTERVAL_S, b"peers": b""})
        with self._lock:
            peers = self._peers.get(info_hash)
            self.announces += peers is not None
        if peers is None:
            return lt.bencode({b"failure reason": b"not a torrent of this swarm"})
        v4, v6 = compact(sorted(peers))
        return lt.bencode({b"interval": INTERVAL_S, b"min interval": INTERVAL_S,
                           b"peers": v4, b"peers6": v6})

    def offer(self, hashes: Iterable[bytes], peers: Iterable[Peer]) -> None:
        """Add `peers` to what the torrent known by `hashes` is told to dial."""
        peers = {(h, int(p)) for h, p in peers}
        with self._lock:
            for h in hashes:
                self._peers.setdefault(h, set()).update(peers)

    def forget(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            for h in hashes:
                self._peers.pop(h, None)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def announce_hashes(info: lt.torrent_info) -> tuple[bytes, ...]:
    """The info-hashes libtorrent may announce a torrent under: v1's SHA-1, and v2's SHA-256
    truncated to 20 bytes (what a v2-only torrent sends as `info_hash`)."""
    ih = info.info_hashes()
    out = []
    if ih.has_v1():
        out.append(ih.v1.to_bytes())
    if ih.has_v2():
        out.append(ih.v2.to_bytes()[:20])
    return tuple(out)
