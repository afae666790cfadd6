"""The one HTTP client a daemon uses for other daemons and its upstream: whole replies, bounded.

Every reply body is read completely, chunk by chunk, up to an explicit cap for its kind, and
refused past it (`ReplyTooLarge`); one `content.read(n)` returns only what is buffered (a 300 KB
manifest came back as 111 KB). Failures are exception types, never text to re-parse:
`PeerUnreachable` (connect, timeout, reset), `PeerHttpError` (a non-200 status; the body is read
to `CAPS["error"]` and kept on the exception, never put in its message, so a third party's reply
text is never echoed into status or logs), `ReplyTooLarge`, `BadReply` (not UTF-8, not JSON, too
deep, NaN, wrong shape, numbers out of range).

Caps, sized for a 1T-parameter bf16 model (2 TB) in the default 8 MiB blocks (238,419 blocks):
- manifest: a block entry is ~125 bytes of JSON (32-hex id, size, 64-hex root), a tensor entry
  ~160 (name, dtype, shape, 32-hex digest); 238k blocks + 100k tensors (a 61-layer, 384-expert
  MoE has ~71k) is ~46 MB → 64 MiB, the size `ChainStore` accepts.
- torrent: per block a file-tree entry (~120 bytes) plus its piece layer, 32 bytes per piece;
  at 1 MiB pieces ~420 bytes a block, ~100 MB for 1T. It depends on the piece size, so the cap
  is computed from the signed manifest's blocks (`torrent_cap`), never above 1 GiB.
- index: artifact names (~20 bytes; retention ≤ 100k versions × 2 kinds = 4 MB) plus up to
  `max_peers` ≤ 10k peer entries of ~450 bytes (4.5 MB) → 16 MiB.
- head: one version's artifact names and three addresses, < 2 KB → 64 KiB.
- ack (trajectory upstream reply): `batch_size` ≤ 100k ids of ≤ 128 characters → 16 MiB.
- hello (the peer proof, below): 4 KiB. error bodies: 4 KiB.

Peer proof: the swarm token is sent only to bootstrap URLs (the operator's config) and to peers
that proved they hold the token without being sent it: `GET <url>/healthz?challenge=<nonce>`
(open route, no Authorization) must answer `proof = HMAC-SHA256(token, nonce, url)`
(`hello_proof`). The nonce makes replays useless and binding the URL stops a relay through
a real daemon (that daemon would prove its own URL, not the announced one).
"""

import hashlib
import hmac
import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from daemon.peering.identity import SIG_HEADER, NodeKey, check_hello

KIB, MIB = 1 << 10, 1 << 20
CAPS: dict[str, int] = {
    "head": 64 * KIB,
    "hello": 4 * KIB,
    "index": 16 * MIB,
    "manifest": 64 * MIB,
    "torrent": 1 << 30,
    "ack": 16 * MIB,
    "error": 4 * KIB,
}
MAX_VERSION = 2**62
"""Versions, heads and counts from peers must be ints in [0, MAX_VERSION) (as the routes take)."""
MAX_JSON_DEPTH = 64
_CHUNK = 256 * KIB


class PeerError(Exception):
    """A request to a peer or upstream failed; the message never quotes the other side's reply."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class PeerUnreachable(PeerError):
    """No reply: refused, reset, DNS failure, or timed out."""


class PeerHttpError(PeerError):
    """The reply status was not 200. `body` holds at most CAPS["error"] bytes of it, for callers
    that talk to a trusted upstream; it is deliberately not in the message."""

    def __init__(self, url: str, status: int, body: bytes = b"",
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(url, f"HTTP {status}")
        self.status = status
        self.body = body
        self.headers = dict(headers or {})


class ReplyTooLarge(PeerError):
    """The reply body (or its Content-Length) exceeds the cap for its kind."""

    def __init__(self, url: str, kind: str, cap: int) -> None:
        super().__init__(url, f"{kind} reply larger than {cap} bytes")
        self.kind = kind
        self.cap = cap


class BadReply(PeerError):
    """The reply arrived whole but is not what the protocol says (JSON, shape, ranges)."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str]


def torrent_cap(block_sizes: list[int], piece_size: int) -> int:
    """Upper bound on the bencoded size of an artifact's torrent (`daemon/bittorrent/torrents.py`
    layout):
    per block ~160 bytes of file tree plus 32 bytes per piece of its piece layer."""
    pieces = sum(-(-size // piece_size) for size in block_sizes)
    return min(CAPS["torrent"], 4 * KIB + 200 * len(block_sizes) + 32 * pieces + 64 * KIB)


def _depth_ok(data: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Nesting depth of a JSON text without parsing it (brackets inside strings skipped)."""
    depth, in_str, esc = 0, False, False
    for c in data:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif c in (0x5D, 0x7D):
            depth -= 1
    return True


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(data: bytes, url: str = "", what: str = "reply") -> Any:
    """JSON from an untrusted peer: UTF-8, depth ≤ MAX_JSON_DEPTH, no NaN/Infinity; else
    BadReply (never RecursionError). Replies up to 64 KiB (heads, hellos) are depth-checked by a
    byte scan (~50 ns a byte); larger ones rely on the C decoder's RecursionError."""
    if len(data) <= 64 * KIB and not _depth_ok(data):
        raise BadReply(url, f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise BadReply(url, f"{what} is not UTF-8") from None
    except RecursionError:
        raise BadReply(url, f"{what} nests too deep") from None
    except ValueError as e:  # JSONDecodeError, NaN, ints past the 4300-digit limit
        raise BadReply(url, f"{what} is not valid JSON ({type(e).__name__})") from None


def json_object(data: bytes, url: str = "", what: str = "reply") -> dict:
    doc = decode_json(data, url, what)
    if not isinstance(doc, dict):
        raise BadReply(url, f"{what} is not a JSON object")
    return doc


def bounded_int(value: object, url: str = "", what: str = "version",
                hi: int = MAX_VERSION) -> int:
    """An int in [0, hi) from a peer's JSON (bools refused); BadReply names the field only."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < hi:
        raise BadReply(url, f"{what} is not an int in [0, {hi})")
    return value


def hello_proof(token: str, nonce: str, url: str) -> str:
    """What a daemon at `url` holding `token` answers to `/healthz?challenge=<nonce>`."""
    msg = b"deltaswarm-hello\0" + nonce.encode() + b"\0" + url.rstrip("/").encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


class PeerClient:
    """Requests to peers and upstreams over one aiohttp session.

    `auth=True` adds `Authorization: Bearer <token>`; callers pass it only for bootstrap or
    proven peers (see `daemon/peering/peers.py`) and configured upstreams. `announce()` gives this
    node's `X-Deltaswarm-Peer` header value, sent on every request to other daemons."""

    def __init__(self, session: aiohttp.ClientSession | None, token: str,
                 announce: Callable[[], dict[str, str]] | None = None,
                 connect_timeout: float = 5.0) -> None:
        self.session = session
        self.token = token
        self.announce = announce or (lambda: {})
        self.connect_timeout = connect_timeout
        self.signer: NodeKey | None = None
        """This node's key: every request is signed with it (daemon/peering/identity.py)."""

    def reconfigure(self, token: str) -> None:
        """New swarm token (SIGHUP): every later request carries it."""
        self.token = token

    def headers(self, auth: bool, token: str | None = None) -> dict[str, str]:
        out = dict(self.announce())
        if auth:
            out["Authorization"] = f"Bearer {token or self.token}"
        return out

    async def request(self, method: str, url: str, kind: str, *, auth: bool, timeout: float,
                      params: Mapping[str, str] | None = None, data: bytes | None = None,
                      headers: Mapping[str, str] | None = None, token: str | None = None,
                      cap: int | None = None, ok: tuple[int, ...] = (200,)) -> Reply:
        """One request; the body read whole up to `cap` (default CAPS[kind]). A status not in
        `ok` raises PeerHttpError with at most CAPS["error"] bytes of body."""
        limit = CAPS[kind] if cap is None else cap
        if self.session is None:
            raise PeerUnreachable(url, "the HTTP client is not started")
        hdrs = {**self.headers(auth, token), **(headers or {})}
        if self.signer is not None:
            hdrs[SIG_HEADER] = self.sign(method, url, params, data, hdrs)
        to = aiohttp.ClientTimeout(total=timeout, sock_connect=min(self.connect_timeout, timeout))
        try:
            async with self.session.request(method, url, params=params, data=data,
                                            headers=hdrs, timeout=to,
                                            allow_redirects=False) as r:
                if r.status not in ok:
                    body = await _read(r, url, "error", CAPS["error"], truncate=True)
                    raise PeerHttpError(url, r.status, body, r.headers)
                return Reply(r.status, await _read(r, url, kind, limit), r.headers)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            # ValueError: aiohttp/yarl refusing a malformed URL or header.
            raise PeerUnreachable(url, f"{type(e).__name__}") from None

    def sign(self, method: str, url: str, params: Mapping[str, str] | None,
             data: bytes | None, hdrs: Mapping[str, str]) -> str:
        """The request's signature: what it says (path, query, body, this node's peer
        headers) under this node's key, so a receiver believes what it says about us."""
        assert self.signer is not None
        try:
            u = URL(url)
            query = [(k, str(v)) for k, v in u.query.items()]
            path = u.path
        except ValueError:
            query, path = [], ""
        query += [(k, str(v)) for k, v in (params or {}).items()]
        return self.signer.sign_request(method, path, query, data,
                                        hdrs.get("X-Deltaswarm-Peer", ""),
                                        hdrs.get("X-Deltaswarm-Region", ""))

    async def get(self, url: str, kind: str, *, auth: bool = True, timeout: float = 30.0,
                  params: Mapping[str, str] | None = None, cap: int | None = None) -> bytes:
        return (await self.request("GET", url, kind, auth=auth, timeout=timeout, params=params,
                                   cap=cap)).body

    async def get_json(self, url: str, kind: str, *, auth: bool = True, timeout: float = 30.0,
                       params: Mapping[str, str] | None = None) -> dict:
        return json_object(await self.get(url, kind, auth=auth, timeout=timeout, params=params),
                           url, f"{kind} reply")

    async def prove(self, url: str, timeout: float = 10.0) -> bool:
        """Whether the daemon at `url` holds this swarm's token (see the module docstring);
        sends no token. Raises PeerError when it cannot be asked."""
        return (await self.prove_identity(url, timeout))[0]

    async def prove_identity(self, url: str, timeout: float = 10.0
                             ) -> tuple[bool, tuple[str, str] | None]:
        """(holds the token, (node, key) the URL signed for with its identity key, or None for
        a daemon without one): the URL's own answer, which binds its key in the peer book."""
        nonce = secrets.token_hex(16)
        doc = await self.get_json(f"{url}/healthz", "hello", auth=False, timeout=timeout,
                                  params={"challenge": nonce})
        proof = doc.get("proof")
        ok = isinstance(proof, str) and hmac.compare_digest(
            proof.encode(), hello_proof(self.token, nonce, url).encode())
        return ok, (check_hello(doc.get("identity"), nonce, url) if ok else None)


async def _read(r: aiohttp.ClientResponse, url: str, kind: str, cap: int,
                truncate: bool = False) -> bytes:
    """The whole body up to `cap`; past it ReplyTooLarge (or, with truncate, the first `cap`
    bytes). The connection is closed rather than drained when the body is cut."""
    if r.content_length is not None and r.content_length > cap and not truncate:
        r.close()
        raise ReplyTooLarge(url, kind, cap)
    buf = bytearray()
    async for chunk in r.content.iter_chunked(_CHUNK):
        buf += chunk
        if len(buf) > cap:
            r.close()
            if truncate:
                return bytes(buf[:cap])
            raise ReplyTooLarge(url, kind, cap)
    return bytes(buf)
