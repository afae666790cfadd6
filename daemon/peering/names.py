"""The names daemons give each other, checked in one place (peers, routes and the config):
control URLs of the daemon API's shape, BitTorrent endpoints as IP literals, node names.

Kept free of aiohttp so the config and the CLI can use it cheaply.
"""

import hashlib
import ipaddress
import re

from yarl import URL

from chain.config_base import NAME_PATTERN as NODE_NAME

# Node and region names: 1-64 of [A-Za-z0-9_.-] (no markup, no spaces, no path characters); the
# one pattern every process's config uses too.
_NODE = re.compile(NODE_NAME)
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9\-]{0,62}\.?)*$")

Endpoint = tuple[str, int]


class BadName(ValueError):
    """A URL, endpoint or node name is not of the shape daemons exchange."""


def check_url(url: object) -> str:
    """A daemon control URL, normalised to `scheme://host:port`; BadName otherwise."""
    if not isinstance(url, str) or not 0 < len(url) <= 300:
        raise BadName("peer URL must be a string of 1-300 characters")
    if any(c in url for c in "?#@\\ \t\r\n") or any(ord(c) < 33 or ord(c) > 126 for c in url):
        raise BadName(f"peer URL {url!r:.80} must be scheme://host:port only (no query, "
                      "fragment, user info or spaces)")
    try:
        u = URL(url)
        port = u.port
    except ValueError:
        raise BadName(f"peer URL {url!r:.80} does not parse") from None
    if u.scheme not in ("http", "https") or not u.host or u.path not in ("", "/"):
        raise BadName(f"peer URL {url!r:.80} must be http(s)://host:port with no path "
                      "(the daemon's API root)")
    host = u.host
    try:
        ip = ipaddress.ip_address(host)
        shown = f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        if len(host) > 253 or not _HOSTNAME.match(host):
            raise BadName(f"peer URL {url!r:.80} has an invalid host name") from None
        shown = host.lower()
    return f"{u.scheme}://{shown}:{port}"


def parse_endpoint(text: object) -> Endpoint:
    """`ip:port` or `[ipv6]:port` → (ip, port). Host names are refused: libtorrent dials only IP
    literals, and resolving announced names would let any token holder point every region at a
    name it controls the answers for."""
    if not isinstance(text, str) or len(text) > 64:
        raise BadName("BitTorrent endpoint must be ip:port (a string of at most 64 characters)")
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise BadName(f"BitTorrent endpoint {text!r:.80} is not ip:port")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise BadName(f"BitTorrent endpoint {text!r:.80}: the host must be an IP address, not a "
                      "name (a daemon advertises bittorrent.advertise_host resolved to an "
                      "address)") from None
    if ip.is_unspecified or ip.is_multicast:
        raise BadName(f"BitTorrent endpoint {text!r:.80} is not a unicast address")
    return str(ip), int(port)


def check_node(name: object) -> str:
    if not isinstance(name, str) or not _NODE.match(name):
        raise BadName(f"node name {name!r:.80} must be 1-64 characters of [A-Za-z0-9_.-]")
    return name


def rank(region: str, node: str) -> str:
    """Election order inside a region: the same on every daemon (not Python's salted hash)."""
    return hashlib.sha256(f"{region}/{node}".encode()).hexdigest()
