"""Node identity: each daemon's own Ed25519 key pair, the names other nodes are pinned to, and
the signatures on what a node says about itself.

Why: the bearer token is shared by the whole swarm, so it admits a request but cannot say who
sent it; before this, any token holder could speak for any node (issue 20, finding 3).

- **Own key.** Made at first start as `<state_dir>/node.key` (raw hex, mode 0600, written
  through chain/keys.py like the trainer key), loaded after; its fingerprint is shown in status.
- **Pins.** A node name is bound to the first key seen signing for it and the binding is kept
  in `<state_dir>/known_nodes.json` (trust on first use, like SSH's known_hosts). A second key
  claiming a pinned name is refused: listed in status (`identity.refused`) and counted
  (`deltaswarm_identity_refused_claims_total`). To accept a node's new key (its state_dir was
  lost), stop the daemon and delete that name from the file.
- **Signed requests.** `PeerClient` signs every request it sends (`X-Deltaswarm-Signature`):
  method, path, query, the sha256 of the body, its `X-Deltaswarm-Peer` / `X-Deltaswarm-Region`
  headers, a Unix time and a random nonce. The receiver accepts a signature only within
  `WINDOW_S` of its clock and only once per nonce, so a captured request cannot be replayed
  later. The signer's name is the node field of its `X-Deltaswarm-Peer` header.
- **Signed fleet entries.** A fleet report entry carries its origin's signature over its
  content and the origin's time, so a relay can forward it (changing only `age_s` and `hops`)
  but cannot make one up or alter one.
An unsigned request still works as far as the token admits it; only what it says about its
sender (head-poll `node`/`have`, peer headers, fleet reports, complaints) is not believed.
"""

import hashlib
import json
import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from chain import keys
from chain.atomic import write_atomic
from chain.errors import BadSignature, ChainError
from daemon.peering.names import BadName, check_node

log = logging.getLogger("deltaswarm.identity")
SIG_HEADER = "X-Deltaswarm-Signature"
WINDOW_S = 120.0
"""A signed request is accepted this long either side of the receiver's clock (NTP-synced hosts
differ by far less); its nonce is remembered as long, so it is taken once."""
MAX_NONCES = 400_000
"""Nonces remembered at most (oldest forgotten first): ~100k signed requests a minute."""
MAX_PINS = 200_000
"""Names pinned at most; past it the name seen longest ago is forgotten."""
MAX_REFUSED = 50
SAVE_EVERY_S = 5.0
KEY_FILE = "node.key"
PINS_FILE = "known_nodes.json"
_HEX64 = frozenset("0123456789abcdef")


def fingerprint(key_hex: str) -> str:
    """A short, stable name for a public key (like ssh-keygen -l): SHA256 of the raw key."""
    return "SHA256:" + hashlib.sha256(bytes.fromhex(key_hex)).hexdigest()[:24]


def is_key_hex(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _public(key_hex: str) -> Ed25519PublicKey:
    return keys.parse_public(key_hex)


def verify_sig(key_hex: str, message: bytes, sig_hex: str) -> bool:
    try:
        keys.verify(_public(key_hex), message, sig_hex)
    except (BadSignature, ChainError):
        return False
    return True


def load_or_make(state_dir: Path) -> Ed25519PrivateKey:
    """This daemon's key: `<state_dir>/node.key`, made (mode 0600) if absent."""
    path = Path(state_dir) / KEY_FILE
    if not path.exists():
        key = keys.generate(path)
        log.info("made this node's identity key %s (%s)", path,
                 fingerprint(keys.public_hex(key)))
        return key
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)
        log.warning("%s was readable by others (mode %o); set to 0600", path, mode)
    try:
        return keys.load_private(path)
    except ChainError as e:
        raise ChainError(f"cannot load this node's identity key {path}: {e}; move it away to "
                         "make a new one (peers that pinned the old key will refuse the new "
                         "one until their operators unpin it)") from None


def request_message(method: str, path: str, query: list[tuple[str, str]], body_sha: str,
                    peer: str, region: str, ts: int, nonce: str) -> bytes:
    """What a request signature covers (the same bytes on both ends)."""
    return json.dumps(["deltaswarm-request-v1", method.upper(), path, sorted(query), body_sha,
                       peer, region, ts, nonce], separators=(",", ":")).encode()


def entry_message(entry: dict, ts: float) -> bytes:
    """What a fleet entry signature covers: everything but what relays change (age, hops)."""
    content = {k: v for k, v in entry.items() if k not in ("age_s", "hops", "sig")}
    return json.dumps(["deltaswarm-fleet-entry-v1", content, ts], sort_keys=True,
                      separators=(",", ":")).encode()


def hello_message(nonce: str, url: str, node: str) -> bytes:
    return json.dumps(["deltaswarm-hello-v1", nonce, url.rstrip("/"), node],
                      separators=(",", ":")).encode()


def body_digest(data: bytes | None) -> str:
    return "-" if not data else hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Signed:
    """A request whose signature verified: who signed it and the body digest it covers."""

    node: str
    key: str
    body_sha: str

    def body_ok(self, body: bytes) -> bool:
        return body_digest(body) == self.body_sha


class BadIdentity(ValueError):
    """A signature is malformed, stale, replayed, or does not verify; says which."""


class NodeKey:
    """This node's key pair: signs requests, fleet entries and hello answers."""

    def __init__(self, key: Ed25519PrivateKey, node: str) -> None:
        self.key = key
        self.node = node
        self.public = keys.public_hex(key)
        self.fingerprint = fingerprint(self.public)

    def sign(self, message: bytes) -> str:
        return keys.sign(self.key, message)

    def sign_request(self, method: str, path: str, query: list[tuple[str, str]],
                     body: bytes | None, peer: str, region: str,
                     now: float | None = None) -> str:
        """The `X-Deltaswarm-Signature` value: `<key> <ts> <nonce> <body sha256|-> <sig>`."""
        ts = int(time.time() if now is None else now)
        nonce = secrets.token_hex(16)
        sha = body_digest(body)
        sig = self.sign(request_message(method, path, query, sha, peer, region, ts, nonce))
        return f"{self.public} {ts} {nonce} {sha} {sig}"

    def sign_entry(self, entry: dict, now: float | None = None) -> dict:
        """`entry` (a fleet NodeReport as JSON) with its `sig` field set."""
        ts = round(time.time() if now is None else now, 3)
        return entry | {"sig": {"key": self.public, "ts": ts,
                                "sig": self.sign(entry_message(entry, ts))}}

    def hello(self, nonce: str, url: str) -> dict:
        return {"node": self.node, "key": self.public,
                "sig": self.sign(hello_message(nonce, url, self.node))}


def check_hello(doc: object, nonce: str, url: str) -> tuple[str, str] | None:
    """(node, key) from a hello reply's `identity` when its signature verifies, else None."""
    if not isinstance(doc, dict):
        return None
    node, key, sig = doc.get("node"), doc.get("key"), doc.get("sig")
    try:
        check_node(node)
    except BadName:
        return None
    if not is_key_hex(key) or not isinstance(sig, str) or len(sig) != 128:
        return None
    return (node, key) if verify_sig(key, hello_message(nonce, url, node), sig) else None


def parse_signature(value: str) -> tuple[str, int, str, str, str]:
    parts = value.split()
    if len(parts) != 5 or len(value) > 400:
        raise BadIdentity(f"{SIG_HEADER} must be '<key> <ts> <nonce> <body sha256|-> <sig>'")
    key, ts, nonce, sha, sig = parts
    if not is_key_hex(key):
        raise BadIdentity(f"{SIG_HEADER}: the key is not 64 lowercase hex digits")
    if not ts.isdigit() or len(ts) > 12:
        raise BadIdentity(f"{SIG_HEADER}: the time is not a Unix time in seconds")
    if len(nonce) != 32 or not set(nonce) <= _HEX64:
        raise BadIdentity(f"{SIG_HEADER}: the nonce is not 32 lowercase hex digits")
    if sha != "-" and not is_key_hex(sha):
        raise BadIdentity(f"{SIG_HEADER}: the body digest is not a sha256 in hex")
    if len(sig) != 128 or not set(sig) <= _HEX64:
        raise BadIdentity(f"{SIG_HEADER}: the signature is not 128 hex digits")
    return key, int(ts), nonce, sha, sig


@dataclass
class Pin:
    key: str
    first: float
    seen: float


@dataclass
class Identities:
    """This node's key, the names it has pinned, and the claims it refused."""

    own: NodeKey
    path: Path | None = None
    """Where pins are kept (None: memory only, for tests)."""
    pins: "OrderedDict[str, Pin]" = field(default_factory=OrderedDict)
    refused: list[dict] = field(default_factory=list)
    refused_total: int = 0
    bad_signatures: int = 0
    last_bad: str = ""
    nonces: "OrderedDict[str, float]" = field(default_factory=OrderedDict)
    _dirty: bool = False
    _saved: float = 0.0

    @classmethod
    def open(cls, state_dir: Path, node: str) -> "Identities":
        ids = cls(NodeKey(load_or_make(state_dir), node), Path(state_dir) / PINS_FILE)
        ids._load()
        return ids

    # --- pins -------------------------------------------------------------------------------
    def _load(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        try:
            doc = json.loads(self.path.read_bytes())
            for name, p in sorted(doc.items(), key=lambda kv: kv[1]["seen"]):
                if is_key_hex(p["key"]):
                    self.pins[check_node(name)] = Pin(p["key"], float(p["first"]),
                                                      float(p["seen"]))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            # Our own file, written atomically: damage means the disk. Starting empty re-pins
            # on next contact, which is what a new node would do; say so loudly.
            log.warning("%s is unreadable (%s); starting with no pinned nodes", self.path, e)
            self.pins.clear()

    def dump(self, force: bool = False) -> bytes | None:
        """The pins file's new content if it is due (changed, and SAVE_EVERY_S since the last
        save, or `force`), else None; built where the pins change (the event loop), so the
        write can run in a thread."""
        now = time.monotonic()
        if self.path is None or not self._dirty or (not force and now - self._saved
                                                    < SAVE_EVERY_S):
            return None
        doc = {n: {"key": p.key, "first": p.first, "seen": round(p.seen, 1)}
               for n, p in self.pins.items()}
        self._dirty, self._saved = False, now
        return json.dumps(doc, separators=(",", ":")).encode()

    def save(self, force: bool = False) -> None:
        data = self.dump(force)
        if data is not None:
            write_atomic(self.path, data)

    def pinned(self, node: str) -> str | None:
        pin = self.pins.get(node)
        return None if pin is None else pin.key

    def claim(self, node: str, key: str, source: str, now: float | None = None,
              pin: bool = True) -> bool:
        """Whether `key` may speak for `node`: its pinned key, or (unpinned, `pin`) the first
        key seen for it, pinned now. A second key is refused and recorded."""
        now = time.time() if now is None else now
        if node == self.own.node and key != self.own.public:
            self._refuse(node, key, source, now, "this node's own name")
            return False
        p = self.pins.get(node)
        if p is not None:
            if p.key != key:
                self._refuse(node, key, source, now, f"pinned to {fingerprint(p.key)}")
                return False
            if now - p.seen > 60:
                p.seen = now
                self.pins.move_to_end(node)
                self._dirty = True
            return True
        if not pin:
            return True
        self.pins[node] = Pin(key, now, now)
        while len(self.pins) > MAX_PINS:
            self.pins.popitem(last=False)
        self._dirty = True
        log.info("pinned node %s to key %s (first seen from %s)", node, fingerprint(key),
                 source)
        return True

    def _refuse(self, node: str, key: str, source: str, now: float, why: str) -> None:
        self.refused_total += 1
        self.refused.append({"node": node, "fingerprint": fingerprint(key), "from": source,
                             "at": round(now, 3), "why": why})
        del self.refused[:-MAX_REFUSED]
        log.warning("refused key %s claiming node %s from %s: %s", fingerprint(key), node,
                    source, why)

    # --- requests ---------------------------------------------------------------------------
    def verify_request(self, method: str, path: str, query: list[tuple[str, str]], peer: str,
                       region: str, value: str, node: str, source: str,
                       now: float | None = None) -> Signed:
        """The signer of a request, its signature checked (time window, nonce, Ed25519) and
        its key checked against the pin for `node`; BadIdentity says what failed."""
        now = time.time() if now is None else now
        try:
            key, ts, nonce, sha, sig = parse_signature(value)
            if abs(now - ts) > WINDOW_S:
                raise BadIdentity(f"signed {now - ts:+.0f}s from this node's clock, outside "
                                  f"±{WINDOW_S:.0f}s (check NTP)")
            if nonce in self.nonces:
                raise BadIdentity("a replayed request (its nonce was seen already)")
            if not verify_sig(key, request_message(method, path, query, sha, peer, region, ts,
                                                   nonce), sig):
                raise BadIdentity("the request signature does not verify")
        except BadIdentity as e:
            self.bad_signatures += 1
            self.last_bad = f"{source}: {e}"[:300]
            raise
        self._remember(nonce, now)
        if not self.claim(node, key, source, now):
            raise BadIdentity(f"node {node} is pinned to another key than {fingerprint(key)}")
        return Signed(node, key, sha)

    def _remember(self, nonce: str, now: float) -> None:
        self.nonces[nonce] = now + WINDOW_S
        while self.nonces:
            first, until = next(iter(self.nonces.items()))
            if until > now and len(self.nonces) <= MAX_NONCES:
                break
            del self.nonces[first]

    # --- status -----------------------------------------------------------------------------
    def status(self) -> dict:
        return {"node": self.own.node, "key": self.own.public,
                "fingerprint": self.own.fingerprint, "pinned": len(self.pins),
                "refused_total": self.refused_total, "refused": list(self.refused[-20:]),
                "bad_signatures": self.bad_signatures, "last_bad_signature": self.last_bad
                or None}

    def metrics(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_IdentityCollector(self))
        return registry


def check_entry(entry: dict, now: float, max_age_s: float) -> str | None:
    """An entry's origin signature: present, made within `max_age_s` (plus WINDOW_S of clock
    difference) before `now`, and verifying; None when good, else why not."""
    sig = entry.get("sig")
    if not isinstance(sig, dict):
        return "unsigned (a node signs its own entry; an old daemon's entries are not taken)"
    key, ts, s = sig.get("key"), sig.get("ts"), sig.get("sig")
    if not is_key_hex(key) or not isinstance(s, str) or len(s) != 128:
        return "malformed signature"
    if not isinstance(ts, float | int) or isinstance(ts, bool):
        return "malformed signature time"
    if ts > now + WINDOW_S or ts < now - max_age_s - WINDOW_S:
        return f"signed {now - ts:.0f}s ago by its origin's clock: too old or in the future"
    if not verify_sig(key, entry_message(entry, float(ts)), s):
        return "the origin's signature does not verify (altered or forged)"
    return None


class _IdentityCollector(Collector):
    def __init__(self, ids: Identities) -> None:
        self.ids = ids

    def collect(self):
        yield CounterMetricFamily(
            "deltaswarm_identity_refused_claims",
            "Claims to speak for a node name refused because another key is pinned to it",
            value=self.ids.refused_total)
        yield CounterMetricFamily(
            "deltaswarm_identity_bad_signatures",
            "Request signatures refused (malformed, stale, replayed, not verifying)",
            value=self.ids.bad_signatures)
        yield GaugeMetricFamily("deltaswarm_identity_pinned_nodes",
                                "Node names pinned to a key", value=len(self.ids.pins))
