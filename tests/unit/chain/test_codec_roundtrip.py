"""Round trips of the tensor delta codec over every dtype, size, density and special value."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chain.codec import (
    apply_many,
    apply_tensor_delta,
    decode_many,
    encode_changes,
    encode_many,
    encode_tensor_delta,
    payload_stats,
)
from chain.codec.header import claimed_changes
from chain.dtypes import BY_NAME
from chain.errors import BadDelta

DTYPES = sorted(BY_NAME)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _uint(dtype: str) -> np.dtype:
    return BY_NAME[dtype].uint


def _special(dtype: str) -> np.ndarray:
    """Bit patterns worth hitting: zeros, -0.0, infinities, NaN payloads, extremes."""
    d = BY_NAME[dtype]
    bits = d.bits
    top = 1 << (bits - 1)
    full = (1 << bits) - 1
    vals = {0, 1, top, top | 1, full, full - 1, top - 1}
    if d.exponent_bits:
        exp = ((1 << d.exponent_bits) - 1) << d.mantissa_bits
        vals |= {exp, exp | top, exp | 1, exp | top | ((1 << d.mantissa_bits) - 1),
                 exp - 1, (exp - 1) | top}
    return np.array(sorted(vals), dtype=_uint(dtype))


def _roundtrip(old: np.ndarray, new: np.ndarray, dtype: str) -> bytes:
    payload = encode_tensor_delta(old, new, dtype)
    target = old.copy()
    apply_tensor_delta(target, payload, dtype)
    assert np.array_equal(target, new)
    stats = payload_stats(payload)
    assert stats["changed"] == int(np.count_nonzero(old != new))
    assert stats["total"] == old.size
    assert stats["nbytes"] == len(payload)
    parts = stats["bits_header"] + stats["bits_positions"] + stats["bits_values"]
    assert parts == 8 * len(payload)
    return payload


@st.composite
def tensor_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    u = _uint(dtype)
    n = draw(st.sampled_from([0, 1, 2, 3, 7, 64, 1000, 5000]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pool = np.concatenate([_special(dtype), rng.integers(0, np.iinfo(u).max, 64, dtype=u,
                                                         endpoint=True)])
    old = rng.choice(pool, n) if draw(st.booleans()) else rng.integers(
        0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.2, 0.9, 1.0]))
    changed = rng.random(n) < density
    kind = draw(st.sampled_from(["step", "random", "special", "signflip"]))
    new = old.copy()
    k = int(changed.sum())
    if kind == "step":
        steps = rng.choice(np.array([1, 2, 3, 100], dtype=u), k)
        new[changed] = np.where(rng.random(k) < 0.5, old[changed] + steps, old[changed] - steps)
    elif kind == "random":
        new[changed] = rng.integers(0, np.iinfo(u).max, k, dtype=u, endpoint=True)
    elif kind == "special":
        new[changed] = rng.choice(pool, k)
    else:
        new[changed] = old[changed] ^ u.type(1 << (BY_NAME[dtype].bits - 1))
    return dtype, old, new


@SETTINGS
@given(tensor_pairs())
def test_every_delta_round_trips_bit_exactly(case):
    dtype, old, new = case
    _roundtrip(old, new, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_round_trip_in_every_direction(dtype):
    sp = _special(dtype)
    old = np.repeat(sp, sp.size)
    new = np.tile(sp, sp.size)
    _roundtrip(old, new, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_element_tensors(dtype):
    u = _uint(dtype)
    for n in (0, 1):
        old = np.zeros(n, u)
        _roundtrip(old, old.copy(), dtype)
        _roundtrip(old, old + u.type(1), dtype)


def test_unchanged_tensor_costs_a_few_bytes():
    old = np.arange(100_000, dtype=np.uint16)
    payload = _roundtrip(old, old.copy(), "bfloat16")
    assert len(payload) <= 16
    assert payload_stats(payload)["mode"] == "unchanged"


def test_sparse_unit_steps_cost_far_less_than_verbatim_values():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(400_000) * 0.02).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, 4000, replace=False)
    new[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), idx.size)
    payload = _roundtrip(old, new, "bfloat16")
    assert 8 * len(payload) / idx.size < 12


def test_random_rewrite_falls_back_to_raw_and_stays_near_dense_size():
    rng = np.random.default_rng(2)
    old = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    new = rng.integers(0, 2**16, 10_000, dtype=np.uint16)
    payload = _roundtrip(old, new, "float16")
    assert len(payload) <= old.nbytes + 32
    assert payload_stats(payload)["mode"] == "raw"


def test_multi_segment_tensor_round_trips_on_two_threads():
    rng = np.random.default_rng(3)
    n = (1 << 20) * 2 + 12345
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(n, n // 50, replace=False)
    new[idx] += np.uint16(1)
    new[-1] ^= np.uint16(0x8000)
    payload = _roundtrip(old, new, "bfloat16")
    assert payload_stats(payload)["changed"] == int(np.count_nonzero(old != new))
    assert claimed_changes(payload) == int(np.count_nonzero(old != new))


def test_batches_round_trip_like_single_calls():
    rng = np.random.default_rng(4)
    items = []
    for dtype, n in [("bfloat16", 300_000), ("float32", 200_000), ("int64", 5), ("bool", 0),
                     ("float8_e4m3fn", 70_000)]:
        u = _uint(dtype)
        old = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
        new = old.copy()
        new[rng.random(n) < 0.02] += u.type(1)
        items.append((old, new, dtype))
    payloads = encode_many(items)
    assert payloads == [encode_tensor_delta(o, n, d) for o, n, d in items]
    targets = [o.copy() for o, _, _ in items]
    apply_many([(t, p, d) for t, p, (_, _, d) in zip(targets, payloads, items, strict=True)])
    for t, (_, n, _) in zip(targets, items, strict=True):
        assert np.array_equal(t, n)


def test_word_and_element_kernels_agree_on_unaligned_views():
    """2-byte tensors on 8-byte boundaries take the 4-elements-per-load kernels; any other
    start takes the per-element ones. Both must write and read the same format."""
    rng = np.random.default_rng(5)
    n = 300_001
    base_old = (rng.standard_normal(n + 3) * 0.02).astype(np.float32)
    old_all = (base_old.view(np.uint32) >> 16).astype(np.uint16)
    new_all = old_all.copy()
    idx = rng.choice(n + 3, (n + 3) // 60, replace=False)
    new_all[idx] += rng.choice(np.array([1, 0xFFFF, 7], np.uint16), idx.size)
    for off in (1, 2, 3):
        old, new = old_all[off:off + n], new_all[off:off + n]
        assert old.__array_interface__["data"][0] % 8 != 0
        payload = encode_tensor_delta(old, new, "bfloat16")
        assert payload == encode_tensor_delta(old.copy(), new.copy(), "bfloat16")
        target = old_all.copy()[off:off + n]
        apply_tensor_delta(target, payload, "bfloat16")
        assert np.array_equal(target, new)


def test_long_gaps_after_dense_runs_round_trip():
    """A context whose changes are dense at first and then far apart: the Rice parameter fits
    the short gaps, so the long one takes the escape code."""
    old = np.full(1 << 20, 0x3C00, np.uint16)  # one exponent: a single context
    new = old.copy()
    new[:2000] += np.uint16(1)
    new[-1] += np.uint16(1)
    new[700_000] -= np.uint16(1)
    _roundtrip(old, new, "bfloat16")


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_any_share_of_large_steps_round_trips(share):
    """Steps other than +-1 are listed per context (inverted when they are the majority)."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal(200_000) * 0.02).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    idx = rng.choice(old.size, 5000, replace=False)
    big = rng.random(idx.size) < share
    step = np.where(big, rng.integers(2, 300, idx.size), 1).astype(np.uint16)
    new[idx] = np.where(rng.random(idx.size) < 0.5, old[idx] + step, old[idx] - step)
    _roundtrip(old, new, "bfloat16")


def test_kernels_carry_the_digest_of_the_range_coder_they_compile_in():
    """numba's cache is keyed on kernels.py alone; its RANGECODER_DIGEST line is what makes an
    edit of rangecoder.py invalidate the cached kernels."""
    import hashlib
    from pathlib import Path

    from chain.codec import kernels, rangecoder

    digest = hashlib.sha256(Path(rangecoder.__file__).read_bytes()).hexdigest()[:16]
    assert digest == kernels.RANGECODER_DIGEST, (
        f"rangecoder.py changed: set RANGECODER_DIGEST = {digest!r} in chain/codec/kernels.py")



def test_kernels_carry_the_digest_of_the_word_mix_they_compile_in():
    """As above for chain/lanemix.py, compiled into the codec's kernels, lanehash's and
    shards': each module's LANEMIX_DIGEST line is what makes an edit of it invalidate them."""
    import hashlib
    from pathlib import Path

    from chain import lanehash, lanemix, shards
    from chain.codec import kernels

    digest = hashlib.sha256(Path(lanemix.__file__).read_bytes()).hexdigest()[:16]
    for module in (kernels, lanehash, shards):
        assert digest == module.LANEMIX_DIGEST, (
            f"lanemix.py changed: set LANEMIX_DIGEST = {digest!r} in {module.__file__}")

# --- how positions are coded: ranks within contexts, or directly (mode CODED_POS) -----------

def _codings(old: np.ndarray, new: np.ndarray, dtype: str, direct: int) -> bytes:
    """Encode with `direct` (chain.codec.api.DIRECT), check apply and decode_many agree with
    the truth, return the payload."""
    (payload, changes), = encode_changes([(old, new, dtype)], direct=direct)
    target = old.copy()
    apply_many([(target, payload, dtype)])
    assert np.array_equal(target, new)
    truth = np.flatnonzero(old != new)
    got, = decode_many([(old, payload, dtype)])
    assert np.array_equal(got.pos, truth) and np.array_equal(got.val, new[truth])
    assert np.array_equal(changes.pos, truth)
    return payload


@SETTINGS
@given(tensor_pairs(), st.sampled_from([-1, 0, 10, 1000]))
def test_both_position_codings_round_trip_bit_exactly(case, direct):
    dtype, old, new = case
    _codings(old, new, dtype, direct)


def _two_contexts(n: int = 1 << 21, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """bf16 weights of two magnitudes, mixed at random; only the small ones change (as small
    weights flip more often under the same update): ranks within the small ones' context
    need fewer bits than gaps between positions."""
    rng = np.random.default_rng(seed)
    w = np.where(rng.random(n) < 0.5, 0.001, 1.0).astype(np.float32)
    old = (w.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    small = np.flatnonzero(old == old.min())
    idx = rng.choice(small, small.size // 10, replace=False)
    new[idx] += 1
    return old, new


def test_each_segment_takes_the_cheaper_position_coding_within_its_allowance():
    """Uniform changes: direct gaps cost about what ranks cost, so every segment goes direct
    at the default allowance. Changes confined to one context: ranks are cheaper, chosen at
    allowance 0, and direct only when allowed to cost more; both decode the same."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 1 << 21, dtype=np.uint16)
    new = old.copy()
    new[rng.choice(old.size, old.size // 100, replace=False)] ^= 1
    stats = payload_stats(_codings(old, new, "bfloat16", 10))
    assert stats["segments"] == 2 and stats["direct_segments"] == 2

    old, new = _two_contexts()
    ranks = _codings(old, new, "bfloat16", 0)
    direct = _codings(old, new, "bfloat16", 1000)
    assert payload_stats(ranks)["direct_segments"] == 0
    assert payload_stats(direct)["direct_segments"] == 2
    assert len(ranks) < len(direct)
    plain = _codings(old, new, "bfloat16", -1)  # mode CODED: no mode bits at all
    assert payload_stats(plain)["direct_segments"] == 0 and len(plain) <= len(ranks)


def test_direct_positions_decode_reading_only_the_changed_elements():
    """What makes a direct segment O(changes): a base that differs from the true one only at
    unchanged elements decodes the same changes (ranks would count those elements and fail)."""
    rng = np.random.default_rng(1)
    old = (rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16) \
        .astype(np.uint16)
    new = old.copy()
    idx = np.sort(rng.choice(old.size, old.size // 100, replace=False))
    new[idx] += 1
    other = rng.integers(0, 1 << 16, old.size, dtype=np.uint16)
    other[idx] = old[idx]
    (payload, _), = encode_changes([(old, new, "bfloat16")], direct=1000)
    got, = decode_many([(other, payload, "bfloat16")])
    assert np.array_equal(got.pos, idx) and np.array_equal(got.val, new[idx])
    (ranked, _), = encode_changes([(old, new, "bfloat16")], direct=-1)
    with pytest.raises(BadDelta):
        decode_many([(other, ranked, "bfloat16")])


def test_a_tensor_mixes_direct_and_ranked_segments():
    """Each segment decides alone: a tensor whose first segment has changes spread evenly and
    whose second has them confined to one context codes the first directly and the second as
    ranks, and decodes both (the mode bit of each segment is read where it lies)."""
    rng = np.random.default_rng(4)
    seg = 1 << 20
    old_a = rng.integers(0, 1 << 16, seg, dtype=np.uint16)
    new_a = old_a.copy()
    new_a[rng.choice(seg, seg // 100, replace=False)] ^= 1
    old_b, new_b = _two_contexts(seg, seed=5)
    old, new = np.concatenate([old_a, old_b]), np.concatenate([new_a, new_b])
    stats = payload_stats(_codings(old, new, "bfloat16", 5))
    assert (stats["segments"], stats["direct_segments"]) == (2, 1)
    # the other way round: the ranked segment first
    stats = payload_stats(_codings(np.concatenate([old_b, old_a]),
                                   np.concatenate([new_b, new_a]), "bfloat16", 5))
    assert (stats["segments"], stats["direct_segments"]) == (2, 1)
