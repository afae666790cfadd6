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


def _jit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in (api.encode_segment, api.decode_segment, api.scatter, lanehash._put,
              lanehash._pull, lanehash._pull_put, lanehash._diff_pairs, lanehash._sum_words,
              lanehash.fast_gather):
        monkeypatch.setattr(k, "_table", {})


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_and_jit_kernels_agree_bit_for_bit(dtype: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = _pair(dtype, (1 << 20) + 4099, seed=len(dtype))
    before = dict(aot.status()["jit_fallbacks"])
    got = api.encode_changes([(old, new, dtype)])[0]
    target = old.copy()
    api.apply_many([(target, got[0], dtype)])
    decoded = api.decode_many([(old, got[0], dtype)])[0]
    moved = lanehash.moved_by_put(old.copy(), decoded.pos, decoded.val)
    digest = lanehash.partial_jobs(new, [[]], 0)
    assert aot.status()["jit_fallbacks"] == before, "a codec call missed its compiled variant"

    _jit_only(monkeypatch)
    want = api.encode_changes([(old, new, dtype)])[0]
    assert got[0] == want[0]
    assert np.array_equal(got[1].pos, want[1].pos) and np.array_equal(got[1].val, want[1].val)
    assert got[1].digest == want[1].digest
    assert np.array_equal(target, new)
    jit_target = old.copy()
    api.apply_many([(jit_target, want[0], dtype)])
    assert np.array_equal(jit_target, target)
    assert moved == lanehash.moved_by_put(old.copy(), decoded.pos, decoded.val)
    assert len(digest) == len(lanehash.partial_jobs(new, [[]], 0))


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
