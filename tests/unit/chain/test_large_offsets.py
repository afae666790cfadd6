"""No 32-bit offset in the digest kernels or the safetensors slots: positions past 2^31 elements
and words past 2^32 are checked against a plain-Python reference on sparse files, touching only
a few pages. The full round trip of a 2.2 GB tensor through encode, blocks and apply is
`chain.bigcheck.roundtrip_large` (minutes; bench/scale.py runs it)."""

import os
from pathlib import Path

import numpy as np

from chain import lanehash
from chain.safetensors_io import TensorFiles, WritableFiles, allocate

M = (1 << 64) - 1


def _fmix(z: int, s1: int, m1: int, s2: int, m2: int, s3: int) -> int:
    z ^= z >> s1
    z = (z * m1) & M
    z ^= z >> s2
    z = (z * m2) & M
    return z ^ (z >> s3)


def _mix(w: int, x: int) -> tuple[int, int]:
    """The lane mixes of word w holding x, in Python integers (no fixed width anywhere)."""
    a = _fmix(x ^ ((w * int(lanehash.K0) + int(lanehash.S0)) & M), 33, 0xFF51AFD7ED558CCD, 33,
              0xC4CEB9FE1A85EC53, 33)
    b = _fmix(x ^ ((w * int(lanehash.K1) + int(lanehash.S1)) & M), 30, 0xBF58476D1CE4E5B9, 27,
              0x94D049BB133111EB, 31)
    return a, b


def test_word_sums_use_the_full_64_bit_word_index():
    words = np.array([0, 1, 0xFFFF_FFFF_FFFF_FFFF, 0x0123_4567_89AB_CDEF], np.uint64)
    for first in (0, (1 << 31) - 2, 1 << 33, (1 << 40) + 7):
        a = b = 0
        for i, x in enumerate(words.tolist()):
            ma, mb = _mix(first + i, x)
            a, b = (a + ma) & M, (b + mb) & M
        assert tuple(int(v) for v in lanehash.sum_words(words, first)) == (a, b)


def test_patching_past_2_to_the_31_elements_writes_and_hashes_the_right_words(tmp_path: Path):
    n = (1 << 31) + 4099  # 4 GiB of bf16 in a sparse file: only the touched pages exist
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(2 * n)
    target = np.memmap(path, np.uint16, "r+")
    pos = np.array([(1 << 31) - 1, 1 << 31, (1 << 31) + 3, n - 1], np.int64)
    val = np.array([7, 8, 9, 10], np.uint16)
    a, b = lanehash.moved_by_put(target, pos, val)
    want_a = want_b = 0
    for w in sorted({int(p) // 4 for p in pos}):
        x = sum(int(target[4 * w + j]) << (16 * j) for j in range(4) if 4 * w + j < n)
        new_a, new_b = _mix(w, x)
        old_a, old_b = _mix(w, 0)
        want_a, want_b = (want_a + new_a - old_a) & M, (want_b + new_b - old_b) & M
    assert (int(a), int(b)) == (want_a, want_b)
    target.flush()
    del target
    fd = os.open(path, os.O_RDONLY)
    try:
        for p, v in zip(pos.tolist(), val.tolist(), strict=True):
            assert int.from_bytes(os.pread(fd, 2, 2 * p), "little") == v
    finally:
        os.close(fd)
    assert os.stat(path).st_blocks * 512 < 1 << 24  # the file stayed sparse


def test_a_slot_past_2_to_the_31_bytes_maps_to_its_file_offset(tmp_path: Path):
    big = (1 << 30) + 5  # bf16 elements: 2 GiB + 10 bytes, after a 6-byte tensor
    allocate(tmp_path / "m.safetensors", [("a", "bfloat16", [3], 6), ("b", "bfloat16", [big],
                                                                      2 * big)])
    files = WritableFiles(tmp_path, ["m.safetensors"])
    slot = files.bits("b")
    assert slot.size == big
    slot[-1] = 0xBEEF
    files.flush()
    start = files.slots["b"].start
    del slot, files
    reread = TensorFiles(tmp_path / "m.safetensors")
    assert int(reread.bits("b")[-1]) == 0xBEEF
    header = (tmp_path / "m.safetensors").stat().st_size - 6 - 2 * big
    with open(tmp_path / "m.safetensors", "rb") as f:
        f.seek(header + start + 2 * (big - 1))
        assert f.read(2) == (0xBEEF).to_bytes(2, "little")
