"""The kernels compiled at install (chain/codec/aot.py) against numba's JIT of the same source.

Both paths must produce identical payloads, identical applied tensors and identical digest
moves for every element width; the compiled path must really be taken (no silent fallback for
the types the codec passes), and must be refused when the stamp does not match the sources
or the arguments do not match a variant. Skipped where the kernels were not compiled (no C
compiler): the JIT path is then what every other test covers.
"""

import json

import numpy as np
import pytest

from chain import lanehash
from chain.codec import aot, api, kernels
from chain.dtypes import lookup

pytestmark = pytest.mark.skipif(
    aot.status()["kernels"] != "aot",
    reason=f"no compiled kernels here ({aot.status()['reason']}); make install builds them")

DTYPES = ["bfloat16", "float32", "float64", "int8", "float16"]


def _pair(dtype: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    uint = lookup(dtype).uint
    rng = np.random.default_rng(seed)
    old = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    new = old.copy()
    idx = rng.choice(n, n // 50, replace=False)
    new[idx] = new[idx] + rng.integers(1, 3, idx.size).astype(uint)
    new[idx[:20]] = rng.integers(0, np.iinfo(uint).max, 20, dtype=uint, endpoint=True)
    return old, new


def _digest_parts(arr: np.ndarray) -> list[tuple[int, int]]:
    out: list = [[]]
    for _, job in lanehash.partial_jobs(arr, out, 0):
        job()
    return [(int(a), int(b)) for a, b in out[0]]


def _jit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (api.encode_segment, api.decode_segment, api.scatter, api.scatter_from,
              lanehash._put,
              lanehash._pull, lanehash._pull_put, lanehash._diff_pairs, lanehash._sum_words,
              lanehash._put_unwritten, lanehash._put_wide, lanehash._sum_at,
              lanehash.fast_gather):
        monkeypatch.setattr(k, "_table", {})


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernels_round_trip_every_width_without_the_jit(dtype: str) -> None:
    old, new = _pair(dtype, (1 << 20) + 4099, seed=len(dtype))
    before = dict(aot.status()["jit_fallbacks"])
    payload, changes = api.encode_changes([(old, new, dtype)])[0]
    target = old.copy()
    api.apply_many([(target, payload, dtype)])
    assert np.array_equal(target, new)
    decoded = api.decode_many([(old, payload, dtype)])[0]
    assert np.array_equal(decoded.pos, changes.pos) and np.array_equal(decoded.val, changes.val)
    # a region's decode over patches its disk lacks: here a layer that brings `old` back
    # from a copy with some elements zeroed
    gone = changes.pos[::7].copy()
    behind = old.copy()
    behind[gone] = 0
    overlaid = api.decode_many([(behind, payload, dtype)], overlays=[[(gone, old[gone])]])[0]
    assert np.array_equal(overlaid.pos, changes.pos)
    moved = lanehash.moved_by_put(old.copy(), decoded.pos, decoded.val)
    assert (moved[0] & lanehash.M64, moved[1] & lanehash.M64) == changes.digest
    assert lanehash.moved_by_changes(old, decoded.pos, decoded.val) == \
        (moved[0] & lanehash.M64, moved[1] & lanehash.M64)  # what a region's decode uses
    assert _digest_parts(new)
    assert aot.status()["jit_fallbacks"] == before, "a codec call missed its compiled variant"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_and_jit_kernels_agree_bit_for_bit(dtype: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = _pair(dtype, (1 << 20) + 4099, seed=len(dtype))
    payload, changes = api.encode_changes([(old, new, dtype)])[0]
    target = old.copy()
    api.apply_many([(target, payload, dtype)])
    parts = _digest_parts(new)
    _jit_only(monkeypatch)
    jit_payload, jit_changes = api.encode_changes([(old, new, dtype)])[0]
    assert payload == jit_payload
    assert changes.digest == jit_changes.digest
    jit_target = old.copy()
    api.apply_many([(jit_target, payload, dtype)])
    assert np.array_equal(jit_target, target)
    assert parts == _digest_parts(new)


def test_the_engines_helpers_run_compiled_and_agree_with_the_jit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's first patch (bf16 changes into an fp32 copy, and the read-back word check)
    must not wait on numba: both helpers have compiled variants, equal to the JIT's."""
    old, new = _pair("bfloat16", 40_000, seed=3)
    pos = np.flatnonzero(old != new).astype(np.int64)
    widx = np.unique(pos >> 2)
    w_old, w_new = lanehash.words(old)[widx].copy(), lanehash.words(new)[widx].copy()
    wide = old.astype(np.uint32) << 16
    before = dict(aot.status()["jit_fallbacks"])
    put = lanehash.moved_by_put_wide(wide, pos, new[pos], 16)
    summed = lanehash.moved_by_words(widx, w_old, w_new)
    assert aot.status()["jit_fallbacks"] == before, "an engine helper missed its variant"
    assert np.array_equal(wide >> 16, new)
    assert put == summed == lanehash.moved_between(old, new, pos)
    _jit_only(monkeypatch)
    assert lanehash.moved_by_put_wide(old.astype(np.uint32) << 16, pos, new[pos], 16) == put
    assert lanehash.moved_by_words(widx, w_old, w_new) == summed


def test_stale_stamp_falls_back_to_the_jit(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stamp = tmp_path / "_aot.json"
    built = json.loads(aot.STAMP.read_text())
    built["built"]["sources"] = "0" * 32
    stamp.write_text(json.dumps(built))
    monkeypatch.setattr(aot, "STAMP", stamp)
    monkeypatch.setattr(aot, "_state", aot._State())
    assert aot.status()["kernels"] == "jit"
    assert "stale" in aot.status()["reason"] and "sources" in aot.status()["reason"]
    k = aot.bind(kernels.scatter, "scatter")
    target = np.zeros(8, np.uint16)
    k(target, 0, np.array([1, 3], np.int32), np.array([5, 6], np.uint16), 0, 2)
    assert target.tolist() == [0, 5, 0, 6, 0, 0, 0, 0]


def test_mismatched_arguments_take_the_jit_not_the_compiled_code() -> None:
    """The compiled wrappers do not check dtypes; the binding must (a wrong one would crash)."""
    before = aot.status()["jit_fallbacks"].get("scatter", 0)
    target = np.zeros(8, np.uint16)
    api.scatter(target, 0, np.array([2], np.int64), np.array([9], np.uint16), 0, 1)
    assert target[2] == 9
    assert aot.status()["jit_fallbacks"]["scatter"] == before + 1
