"""The bearer-token check shared by every HTTP surface (the daemon's control plane, the trainer's
ingest): one pure function, so the daemon and the trainer (which never import each other) agree
on it and each keeps only a thin aiohttp middleware.

The comparison is constant-time over bytes, so any header value compares (and fails) cleanly:
aiohttp hands over undecodable bytes as surrogate escapes, which a plain `str.encode()` would turn
into an exception and a 500 instead of a 401.
"""

import hmac

SCHEME = "Bearer"


def bearer_matches(header: str | bytes | None, token: str) -> bool:
    """True only when the `Authorization` value `header` is exactly `Bearer <token>`."""
    if header is None or not token:
        return False
    got = header if isinstance(header, bytes) else header.encode("utf-8", "surrogatepass")
    return hmac.compare_digest(got, f"{SCHEME} {token}".encode("utf-8", "surrogatepass"))
