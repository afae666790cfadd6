"""The shared bearer check: exact match only, and any header value (non-ASCII, undecodable
bytes as aiohttp passes them on, empty) is a clean False, never an exception."""

import pytest

from chain.auth import bearer_matches


def test_only_the_exact_bearer_value_matches():
    assert bearer_matches("Bearer secret-token", "secret-token")
    assert bearer_matches(b"Bearer secret-token", "secret-token")
    for wrong in ("Bearer secret-tokeN", "bearer secret-token", "Bearer  secret-token",
                  "secret-token", "Bearer secret-token ", "Basic c2VjcmV0", "", None):
        assert not bearer_matches(wrong, "secret-token"), wrong


@pytest.mark.parametrize("header", [
    "Bearer \udcff\udcfe",           # bytes 0xff 0xfe as aiohttp's surrogateescape decoding gives
    "Bearer \ud800",                 # a lone surrogate
    "Bearer sécret-token",           # non-ASCII text
    b"Bearer \xff\xfe\x00",          # raw bytes
])
def test_non_ascii_or_undecodable_values_are_refused_without_raising(header):
    assert bearer_matches(header, "secret-token") is False


def test_an_empty_token_never_matches():
    assert not bearer_matches("Bearer ", "")
