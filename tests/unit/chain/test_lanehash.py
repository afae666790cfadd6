"""The additive tensor digest: moving it by the changed elements gives exactly the digest of the
new tensor, for every element width and a ragged last word; any changed byte, dtype or shape
moves it; and the codec reports the changes and the digest move it found while encoding."""

import numpy as np
import pytest

from chain import codec, lanehash
from chain.digest import tensor_digest, tensor_digests


@pytest.mark.parametrize(("uint", "dtype"), [(np.uint8, "int8"), (np.uint16, "bfloat16"),
                                             (np.uint32, "float32"), (np.uint64, "int64")])
@pytest.mark.parametrize("n", [0, 1, 3, 1001, 4099, 40_003])
def test_moving_a_digest_by_the_changes_equals_hashing_the_new_tensor(uint, dtype, n):
    rng = np.random.default_rng(n)
    old = rng.integers(0, np.iinfo(uint).max, n, dtype=uint, endpoint=True)
    new = old.copy()
    pos = np.unique(rng.integers(0, max(n, 1), n // 7 + (n > 0))) if n else np.empty(0, np.int64)
    new[pos] ^= uint(1)
    moved = lanehash.add(tensor_digest(dtype, [n], old), lanehash.moved_between(old, new, pos))
    assert moved == tensor_digest(dtype, [n], new)
    unwritten = lanehash.add(tensor_digest(dtype, [n], old),
                             lanehash.moved_by_changes(old, pos, new[pos]))
    assert unwritten == moved
    target = old.copy()
    put = lanehash.add(tensor_digest(dtype, [n], old),
                       lanehash.moved_by_put(target, pos, new[pos]))
    assert put == moved and np.array_equal(target, new)
    back = old.copy()
    pulled = lanehash.add(tensor_digest(dtype, [n], old),
                          lanehash.moved_by_pull(back, new, pos))
    assert pulled == moved and np.array_equal(back, new)
    both = old.copy()  # positions to pull from `new`, then others (and some the same) to put
    later = new.copy()
    put_pos = pos[::2]
    later[put_pos] ^= uint(2)
    merged = lanehash.add(tensor_digest(dtype, [n], old),
                          lanehash.moved_by_pull_put(both, new, pos, put_pos, later[put_pos]))
    assert np.array_equal(both, later) and merged == tensor_digest(dtype, [n], later)


@pytest.mark.parametrize(("uint", "dtype"), [(np.uint16, "bfloat16"), (np.uint32, "float32")])
def test_a_put_into_a_row_block_moves_the_whole_tensors_digest(uint, dtype):
    """put_at writes into one row block of a larger tensor (a fused parameter's slice) and
    moves the whole tensor's digest; more touched words than one chunk of the kernel."""
    rng = np.random.default_rng(3)
    whole = rng.integers(0, np.iinfo(uint).max, (64, 1024), dtype=uint, endpoint=True)
    before = tensor_digest(dtype, [64, 1024], whole.reshape(-1))
    block = whole[16:48].reshape(-1)  # a view: the put lands in `whole`
    pos = np.unique(rng.integers(0, block.size, 9000))
    val = (block[pos] ^ uint(3)).astype(uint)
    per = 8 // block.itemsize
    off = 16 * 1024  # the block's first element, as a position of the whole tensor
    a, b, touched = lanehash.moved_by_put_at(block, pos + off, val, off)
    assert np.array_equal(block[pos], val)
    assert lanehash.add(before, (a, b)) == tensor_digest(dtype, [64, 1024], whole.reshape(-1))
    assert touched == np.unique(pos // per).size


@pytest.mark.parametrize("n", [5, 4099, 40_003])
def test_a_put_into_a_widened_copy_moves_the_digest_as_a_narrow_put_does(n):
    """bf16 held as fp32 (the torch engine on CPU): put_wide moves the bf16 digest exactly as
    a put into the bf16 array does, across chunks and a ragged last word."""
    rng = np.random.default_rng(n)
    narrow = rng.integers(0, 2**16 - 1, n, dtype=np.uint16, endpoint=True)
    wide = narrow.astype(np.uint32) << np.uint32(16)
    pos = np.unique(rng.integers(0, n, n // 5 + 1))
    val = (narrow[pos] ^ np.uint16(5)).astype(np.uint16)
    want = lanehash.moved_by_put(narrow, pos, val)
    assert lanehash.moved_by_put_wide(wide, pos, val, 16) == want
    assert np.array_equal(wide >> np.uint32(16), narrow.astype(np.uint32))


def test_any_flipped_byte_dtype_or_shape_changes_the_digest():
    a = np.random.default_rng(0).integers(0, 1 << 16, 999, dtype=np.uint16)
    base = tensor_digest("bfloat16", [999], a)
    for i in (0, 1, 500, 997, 998):
        b = a.copy()
        b[i] ^= np.uint16(0x0100)
        assert tensor_digest("bfloat16", [999], b) != base
    assert tensor_digest("float16", [999], a) != base
    assert tensor_digest("bfloat16", [9, 111], a) != base
    swapped = a.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert a[3] == a[4] or tensor_digest("bfloat16", [999], swapped) != base


def test_a_digest_spread_over_threads_equals_one_computed_in_one_piece(monkeypatch):
    a = np.random.default_rng(1).integers(0, 1 << 16, 100_003, dtype=np.uint16)
    whole = tensor_digests([("bfloat16", [100_003], a)], threads=1)
    monkeypatch.setattr(lanehash, "CHUNK_WORDS", 1000)
    assert tensor_digests([("bfloat16", [100_003], a)], threads=2) == whole
    assert tensor_digest("bfloat16", [100_003], a.tobytes()) == whole[0]


def test_the_encoder_reports_exactly_the_changed_positions_values_and_digest_move():
    rng = np.random.default_rng(2)
    old = (rng.standard_normal(3 << 20).astype(np.float32) * 0.02)
    old = (old.view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    hit = rng.random(old.size) < 0.01
    new[hit] += np.uint16(1)
    (payload, ch), = codec.encode_changes([(old, new, "bfloat16")])
    assert np.array_equal(ch.pos, np.flatnonzero(old != new))
    assert np.array_equal(ch.val, new[ch.pos])
    assert lanehash.add(tensor_digest("bfloat16", [old.size], old), ch.digest) == \
        tensor_digest("bfloat16", [old.size], new)
    (dec,) = codec.decode_many([(old, payload, "bfloat16")])
    assert np.array_equal(dec.pos, ch.pos) and np.array_equal(dec.val, ch.val)
    ro = old.copy()
    ro.flags.writeable = False  # decoding needs no write access to its base
    assert np.array_equal(codec.decode_many([(ro, payload, "bfloat16")])[0].pos, ch.pos)
    (moved,) = codec.decode_many([(ro, payload, "bfloat16")], moves=True)
    assert moved.digest == ch.digest  # summed over its 48 segments, each moved by its thread
    assert codec.decode_many([(old, payload, "bfloat16")])[0].digest is None


def test_many_digests_move_as_each_would_alone():
    rng = np.random.default_rng(3)
    digests = [lanehash.to_hex(int(a), int(b))
               for a, b in rng.integers(0, 2**63, (50, 2), dtype=np.uint64)]
    digests[0] = "f" * 32  # both lanes wrap around
    moves = [(int(a), int(b)) for a, b in rng.integers(0, 2**63, (50, 2), dtype=np.uint64)]
    moves[1] = (2**64 + 5, 3 * 2**64)  # sums of parts past 64 bits
    moves[2] = (np.uint64(7), np.uint64(2**64 - 1))
    assert lanehash.add_many(digests, moves) == [lanehash.add(d, m) for d, m in
                                                  zip(digests, moves, strict=True)]
    assert lanehash.add_many([], []) == []
    # the one-conversion forms: all in [0, 2^64), an integer array, negatives (the fallback)
    small = [(int(a), int(b)) for a, b in rng.integers(0, 2**64 - 1, (50, 2), dtype=np.uint64)]
    signed = rng.integers(-2**62, 2**62, (50, 2), dtype=np.int64)
    for these in (small, signed, [(int(a), -int(b)) for a, b in small]):
        assert lanehash.add_many(digests, these) == [lanehash.add(d, (int(m[0]), int(m[1])))
                                                     for d, m in zip(digests, these,
                                                                     strict=True)]


def test_a_malformed_digest_among_many_spoils_only_its_own():
    good = lanehash.to_hex(5, 6)
    got = lanehash.add_many([good, good[:30], good], [(1, 2), (0, 0), (3, 4)])
    assert got[0] == lanehash.add(good, (1, 2)) and got[2] == lanehash.add(good, (3, 4))
    assert got[1] == lanehash.add(good[:30], (0, 0)) != good
