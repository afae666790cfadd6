"""Refusal of bad tensor delta payloads: truncated, bit-flipped, forged or mismatched input
raises BadDelta and leaves the target untouched (the codec decodes into scratch first)."""

import threading

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chain.codec import (
    apply_many,
    apply_tensor_delta,
    encode_changes,
    encode_tensor_delta,
    payload_stats,
)
from chain.codec.header import CHECK, ByteReader, put_varint
from chain.errors import BadDelta

SETTINGS = settings(max_examples=80, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _pair(n: int = 20_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.02).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    # the changes in the smaller half of the weights: ranks within their contexts then cost
    # fewer bits than gaps between positions, so allowance 0 codes them as ranks
    small = np.flatnonzero(np.abs(w) < np.median(np.abs(w)))
    idx = rng.choice(small, n // 40, replace=False)
    new[idx] += rng.choice(np.array([1, 0xFFFF, 3], np.uint16), idx.size)
    return old, new


OLD, NEW = _pair()
PAYLOAD = encode_tensor_delta(OLD, NEW, "bfloat16")
CODINGS = {name: encode_changes([(OLD, NEW, "bfloat16")], direct=direct)[0][0]
           for name, direct in (("ranks", -1), ("flagged-ranks", 0), ("direct", 1000))}
"""The same delta with its positions coded each way (mode CODED; CODED_POS with the segment
coded as ranks, and directly)."""


def test_the_codings_under_test_are_the_ones_named():
    assert payload_stats(CODINGS["ranks"])["direct_segments"] == 0
    assert payload_stats(CODINGS["flagged-ranks"])["direct_segments"] == 0
    assert payload_stats(CODINGS["direct"])["direct_segments"] == 1
    assert len({CODINGS[k][1] for k in CODINGS}) == 2  # mode CODED, CODED_POS (twice)


def _reseal(body: bytes) -> bytes:
    """Give altered bytes a valid checksum, as a forger (not line noise) would."""
    return body + (xxhash.xxh3_64_intdigest(body) & 0xFFFFFFFF).to_bytes(CHECK, "little")


def _refused(payload: bytes, target: np.ndarray | None = None, dtype: str = "bfloat16"):
    target = OLD.copy() if target is None else target
    before = target.copy()
    with pytest.raises(BadDelta):
        apply_tensor_delta(target, payload, dtype)
    assert np.array_equal(target, before)


@pytest.mark.parametrize("coding", sorted(CODINGS))
def test_every_truncation_is_refused(coding):
    """All of them, not a sample: the enumeration takes a fraction of a second."""
    payload = CODINGS[coding]
    assert len(payload) > 100
    for cut in range(len(payload)):
        _refused(payload[:cut])


@pytest.mark.parametrize("coding", sorted(CODINGS))
def test_every_single_bit_flip_is_refused(coding):
    """Every one of the 8 x len(payload) single-bit flips, enumerated."""
    payload = CODINGS[coding]
    for bit in range(8 * len(payload)):
        bad = bytearray(payload)
        bad[bit // 8] ^= 1 << (bit % 8)
        _refused(bytes(bad))


@SETTINGS
@given(st.sampled_from(sorted(CODINGS)), st.integers(0, 1 << 30), st.integers(1, 255))
def test_forged_bodies_are_refused_or_decode_to_the_true_result(coding, at, xor):
    """A forged payload (valid checksum, altered stream) is refused with the target untouched,
    unless the alteration is in bits the decoder never depends on (the coder's flush tail):
    then the result hash proves the outcome is the honest one."""
    payload = CODINGS[coding]
    pos = 3 + at % (len(payload) - CHECK - 3)
    bad = bytearray(payload[:-CHECK])
    bad[pos] ^= xor
    target = OLD.copy()
    try:
        apply_tensor_delta(target, _reseal(bytes(bad)), "bfloat16")
    except BadDelta:
        assert np.array_equal(target, OLD)
    else:
        assert np.array_equal(target, NEW)


def _claiming(payload: bytes, n: int) -> bytes:
    """`payload` resealed with its header claiming `n` elements (its streams unchanged)."""
    r = ByteReader(memoryview(payload), len(payload))
    r.pos = 3
    r.varint()
    head = bytearray(payload[:3])
    put_varint(head, n)
    return _reseal(bytes(head) + payload[r.pos:-CHECK])


def test_direct_positions_past_the_segment_are_refused():
    """A forged direct payload whose positions are consistent streams but run past its
    (claimed, shorter) tensor: refused before any old element past the end is read."""
    last = int(np.flatnonzero(OLD != NEW)[-1])
    short = _claiming(CODINGS["direct"], last)  # the last change now lies past the end
    _refused(short, OLD[:last].copy())


def _in_a_fresh_thread(fn) -> None:
    """fn() on a thread of its own, whose codec scratch is sized for this call alone (one that
    encoded first holds larger scratch, where an overrun would land unseen); its exception is
    raised here."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the caller's thread
            raised.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if raised:
        raise raised[0]


def test_direct_positions_beyond_their_contexts_counts_are_refused():
    """A base whose elements all share the top context sends every change to that context's
    steps, past its count and past the scratch the steps live in: refused at the first."""
    _in_a_fresh_thread(lambda: _refused(CODINGS["direct"], np.full_like(OLD, 0x7F00)))


def test_payload_for_another_length_is_refused():
    _refused(PAYLOAD, OLD[:-1].copy())
    _refused(PAYLOAD, np.concatenate([OLD, OLD[:1]]))


def test_payload_for_another_dtype_is_refused():
    _refused(PAYLOAD, OLD.copy(), "float16")
    with pytest.raises(BadDelta):
        apply_tensor_delta(OLD.astype(np.uint32), PAYLOAD, "bfloat16")


@pytest.mark.parametrize("coding", sorted(CODINGS))
def test_payload_applied_to_the_wrong_base_is_refused(coding):
    other = OLD.copy()
    other[::3] ^= np.uint16(0x0100)
    _refused(CODINGS[coding], other)


@pytest.mark.parametrize("coding", sorted(CODINGS))
def test_payload_applied_twice_is_refused(coding):
    target = OLD.copy()
    apply_tensor_delta(target, CODINGS[coding], "bfloat16")
    assert np.array_equal(target, NEW)
    _refused(CODINGS[coding], target)


def test_garbage_and_empty_input_is_refused():
    for junk in (b"", b"\xd5", b"\x00" * 40, bytes(range(256))):
        _refused(junk)
        with pytest.raises(BadDelta):
            payload_stats(junk)


def test_batch_with_one_bad_payload_writes_no_target():
    old2, new2 = _pair(5000, seed=1)
    good = encode_tensor_delta(old2, new2, "bfloat16")
    t1, t2 = old2.copy(), OLD.copy()
    with pytest.raises(BadDelta):
        apply_many([(t1, good, "bfloat16"), (t2, PAYLOAD[:-1], "bfloat16")])
    assert np.array_equal(t1, old2)
    assert np.array_equal(t2, OLD)


def test_read_only_target_is_refused():
    target = OLD.copy()
    target.flags.writeable = False
    with pytest.raises(BadDelta):
        apply_tensor_delta(target, PAYLOAD, "bfloat16")


@pytest.mark.parametrize(("fmt", "says"), [(1, "older deltaswarm"), (3, "upgrade deltaswarm")])
def test_other_format_versions_are_refused_saying_which_way_to_go(fmt, says):
    bad = bytearray(PAYLOAD[:-CHECK])
    bad[1] = (fmt << 4) | (bad[1] & 0xF)
    with pytest.raises(BadDelta, match=says):
        apply_tensor_delta(OLD.copy(), _reseal(bytes(bad)), "bfloat16")
