"""Additive, position-keyed tensor digest: updatable from the changed elements alone.

A tensor's bytes are read as little-endian 64-bit words (the last one zero-padded); word w with
value x contributes mix_L(w, x) to each of two 64-bit lanes, summed mod 2^64, plus a constant
per (dtype, shape). Because the digest is a sum over positions, a version that changes k
elements moves it by sum(mix(w, new) - mix(w, old)) over the <= k words they touch, so neither
the publisher nor a region re-reads unchanged data to know the new digest (LtHash's idea,
Bellare-Micciancio; here with 2 x 64-bit lanes, which guards against corruption and bugs like
the xxh3 it replaces, not against an adversary: blocks and manifests are what peers could forge,
and those are pinned by SHA-256 pieces roots and Ed25519 signatures).

The full digest runs at memory bandwidth: the kernels vectorize (AVX-512 multiplies) and
spread chunks over the codec's threads.
"""

import sys
from collections.abc import Callable, Sequence

import numpy as np
import xxhash
from numba import njit

from chain.codec.aot import bind
from chain.lanemix import K0, K1, S0, S1, _mix0, _mix1  # noqa: F401  (re-exported)

# lanemix.py's digest, compiled into this module's cached kernels (see
# chain.codec.kernels.LANEMIX_DIGEST; a test checks it).
LANEMIX_DIGEST = "1af0bf58416382d6"
CHUNK_WORDS = 1 << 22  # 32 MiB of tensor per job when a digest is spread over threads
M64 = (1 << 64) - 1


@njit(nogil=True, cache=True)
def sum_words(words, first):
    """Lane sums over whole words; `first` is the index of words[0] in its tensor."""
    a = np.uint64(0)
    b = np.uint64(0)
    base = np.uint64(first)
    for i in range(words.size):
        w = base + np.uint64(i)
        x = words[i]
        a += _mix0(w, x)
        b += _mix1(w, x)
    return a, b


@njit(inline="always")
def _word(arr, words, w, sh, width):
    """Word w of an element array (2^sh elements of `width` bits a word; `words`: the array's
    whole words as uint64), zero-padded past the end."""
    if w < words.size:
        return words[w]
    x = np.uint64(0)
    lo = w << sh
    for j in range(1 << sh):
        i = lo + j
        if i < arr.size:
            x |= np.uint64(arr[i]) << np.uint64(width * j)
    return x


@njit(nogil=True, cache=True)
def _whole(pos, nwords, sh, off):
    """How many of the sorted positions `pos` (of an array whose element 0 is position `off`)
    fall in its whole words (the rest, if any, are in its last, partial word)."""
    m = pos.size
    while m > 0 and ((pos[m - 1] - off) >> sh) >= nwords:
        m -= 1
    return m


@njit(nogil=True, cache=True)
def diff_pairs(old, oldw, new, neww, pos, sh, width):
    """Digest change from old to new at sorted element positions `pos` (only those differ):
    each touched word once, its old value read from `old`, its new one from `new`. One
    straight loop over the positions (a word's later positions add nothing), which the
    compiler vectorizes."""
    a = np.uint64(0)
    b = np.uint64(0)
    m = _whole(pos, oldw.size, sh, 0)
    for k in range(m):
        w = pos[k] >> sh
        first = np.uint64(k == 0 or w != (pos[k - 1] >> sh))
        uw = np.uint64(w)
        a += first * (_mix0(uw, neww[w]) - _mix0(uw, oldw[w]))
        b += first * (_mix1(uw, neww[w]) - _mix1(uw, oldw[w]))
    if m < pos.size:
        w = pos[m] >> sh
        uw = np.uint64(w)
        xo, xn = _word(old, oldw, w, sh, width), _word(new, neww, w, sh, width)
        a += _mix0(uw, xn) - _mix0(uw, xo)
        b += _mix1(uw, xn) - _mix1(uw, xo)
    return a, b


@njit(nogil=True, cache=True)
def pull_put(target, tw, source, ppos, pos, val, sh, width):
    """target[ppos] = source[ppos], then target[pos] = val (both sorted), in one walk over the
    touched words; returns the digest change of target. The pulls, then the puts, each a
    `_put_phase`: a word both touch moves by (after pulls - before) + (after puts - after
    pulls), which is what it moves in all."""
    a, b, _ = _put_phase(target, tw, source, ppos, val[:0], True, sh, width, 0)
    c, d, _ = _put_phase(target, tw, source, pos, val, False, sh, width, 0)
    return a + c, b + d


@njit(nogil=True, cache=True)
def put_at(target, tw, pos, val, sh, width, off):
    """`put` into a row block of a larger tensor (a fused parameter's slice): `pos` are the
    tensor's positions, `target` holds its elements from `off` (a whole word) on. Returns the
    tensor's digest change and the number of words touched."""
    return _put_phase(target, tw, target, pos, val, False, sh, width, off)


CHUNK = 4096
"""Positions `_put_phase` handles per step (two arrays of this many words)."""


@njit(nogil=True, cache=True, inline="always")
def _mix_chunk(pos, c0, c1, sh, xo, xn, base):
    """Lane-sum move of the distinct words of pos[c0:c1] (sorted), each word's value before
    in xo[k - c0] and after in xn[k - c0] at its first position k, and how many words: one
    straight loop the compiler vectorizes. A word continuing from the chunk before counts
    here too (its move in this chunk), so chunks add up. Word `base` of the positions is
    word 0 of the tensor they belong to (a group record's member, 0 otherwise)."""
    a = np.uint64(0)
    b = np.uint64(0)
    n = 0
    for k in range(c0, c1):
        w = pos[k] >> sh
        first = k == c0 or w != (pos[k - 1] >> sh)
        n += first
        uw = np.uint64(w - base)
        f = np.uint64(first)
        a += f * (_mix0(uw, xn[k - c0]) - _mix0(uw, xo[k - c0]))
        b += f * (_mix1(uw, xn[k - c0]) - _mix1(uw, xo[k - c0]))
    return a, b, n


@njit(nogil=True, cache=True, inline="always")
def _phase_words(target, tw, source, pos, val, lo, hi, pulled, sh, off, base, xo, xn):
    """The whole-word part of a `_put_phase`: positions pos[lo:hi], none in a partial word.
    Returns the lane-sum move and the words touched."""
    a = np.uint64(0)
    b = np.uint64(0)
    touched = 0
    for c0 in range(lo, hi, CHUNK):
        c1 = min(hi, c0 + CHUNK)
        for k in range(c0, c1):
            xo[k - c0] = tw[(pos[k] - off) >> sh]
        if pulled:
            for k in range(c0, c1):
                target[pos[k] - off] = source[pos[k] - off]
        else:
            for k in range(c0, c1):
                target[pos[k] - off] = val[k]
        for k in range(c0, c1):
            xn[k - c0] = tw[(pos[k] - off) >> sh]
        ca, cb, words = _mix_chunk(pos, c0, c1, sh, xo, xn, base)
        a, b, touched = a + ca, b + cb, touched + words
        if c0 > lo and (pos[c0] >> sh) == (pos[c0 - 1] >> sh):
            touched -= 1  # a word split over two chunks is one word touched
    return a, b, touched


@njit(nogil=True, cache=True)
def _put_phase(target, tw, source, pos, val, pulled, sh, width, off):
    """target[pos - off] = source[pos - off] (`pulled`) or val, pos sorted; the digest change
    of the tensor whose element `off` (a whole word) is target[0], and the words touched. A
    chunk of positions at a time, each step a straight loop the compiler vectorizes: read
    every position's word, write the elements, read the words again, then mix each distinct
    word once (a word split over two chunks moves by its change in each, which adds up).
    Walking word by word with the reads, writes and mixing interleaved was 6x slower (1 % of
    100M bf16: 81 ms, now 12.5 ms); the scatter alone takes 2.5 ms."""
    n = pos.size
    m = _whole(pos, tw.size, sh, off)
    w0 = off >> sh
    xo = np.empty(CHUNK, np.uint64)
    xn = np.empty(CHUNK, np.uint64)
    a, b, touched = _phase_words(target, tw, source, pos, val, 0, m, pulled, sh, off, 0, xo,
                                 xn)
    if m < n:  # positions in the array's last, partial word
        w = (pos[m] - off) >> sh
        old = _word(target, tw, w, sh, width)
        for k in range(m, n):
            target[pos[k] - off] = source[pos[k] - off] if pulled else val[k]
        new = _word(target, tw, w, sh, width)
        uw = np.uint64(w + w0)
        a += _mix0(uw, new) - _mix0(uw, old)
        b += _mix1(uw, new) - _mix1(uw, old)
        touched += 1
    return a, b, touched


@njit(nogil=True, cache=True)
def put(target, tw, pos, val, sh, width):
    """target[pos] = val (pos sorted, absolute) in place; returns the digest change, computed
    from the words as they were before and after, so it is exact whatever target held."""
    return pull_put(target, tw, target, pos[:0], pos, val, sh, width)


@njit(nogil=True, cache=True)
def pull(target, tw, source, pos, sh, width):
    """target[pos] = source[pos] (pos sorted) in place; returns the digest change of target."""
    return pull_put(target, tw, source, pos, pos[:0], source[:0], sh, width)


@njit(nogil=True, cache=True, inline="always")
def _unwritten_words(oldw, pos, val, lo, hi, sh, width, base, xo, xn):
    """The lane-sum move `oldw`'s words would make with val written at pos[lo:hi] (sorted,
    all in whole words), without writing: a chunk of positions at a time (never splitting a
    word), each position's word with its own change put in, in one straight loop; then,
    backwards, a position whose word has later changes takes them on (rarely: at 1 % density
    most words hold one change); then each distinct word is mixed once, straight again."""
    a = np.uint64(0)
    b = np.uint64(0)
    emask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    low = (np.int64(1) << sh) - 1
    c0 = lo
    while c0 < hi:
        c1 = min(hi, c0 + CHUNK)
        while c1 < hi and c1 - c0 < CHUNK + 8 and (pos[c1] >> sh) == (pos[c1 - 1] >> sh):
            c1 += 1  # (distinct positions: at most 7 more in one word; the cap guards memory)
        for k in range(c0, c1):
            x = oldw[pos[k] >> sh]
            s = np.uint64(width * (pos[k] & low))
            xo[k - c0] = x
            xn[k - c0] = (x & ~(emask << s)) | (np.uint64(val[k]) << s)
        for k in range(c1 - 2, c0 - 1, -1):
            if (pos[k] >> sh) == (pos[k + 1] >> sh):
                s = np.uint64(width * (pos[k] & low))
                xn[k - c0] = (xn[k + 1 - c0] & ~(emask << s)) | (np.uint64(val[k]) << s)
        ca, cb, _ = _mix_chunk(pos, c0, c1, sh, xo, xn, base)
        a, b = a + ca, b + cb
        c0 = c1
    return a, b


@njit(nogil=True, cache=True)
def put_unwritten(old, oldw, pos, val, sh, width):
    """The digest change that `old[pos] = val` (pos sorted) would make, without writing `old`
    (it may be a read-only map): `_unwritten_words`, then the last, partial word if any."""
    m = _whole(pos, oldw.size, sh, 0)
    emask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    low = (np.int64(1) << sh) - 1
    xo = np.empty(CHUNK + 8, np.uint64)
    xn = np.empty(CHUNK + 8, np.uint64)
    a, b = _unwritten_words(oldw, pos, val, 0, m, sh, width, 0, xo, xn)
    if m < pos.size:  # the last, partial word
        w = pos[m] >> sh
        xo0 = _word(old, oldw, w, sh, width)
        x = xo0
        for k in range(m, pos.size):
            s = np.uint64(width * (pos[k] & low))
            x = (x & ~(emask << s)) | (np.uint64(val[k]) << s)
        uw = np.uint64(w)
        a += _mix0(uw, x) - _mix0(uw, xo0)
        b += _mix1(uw, x) - _mix1(uw, xo0)
    return a, b


@njit(nogil=True, cache=True)
def _wide_word(target, lo, per, s, width):
    """The narrow patterns of target[lo:lo + per] (each target[i] >> s) as one word."""
    x = np.uint64(0)
    for k in range(per):
        x |= (np.uint64(target[lo + k]) >> s) << np.uint64(width * k)
    return x


@njit(nogil=True, cache=True)
def _bf16_word(pairs, w):
    """Word w of the bf16 patterns held as the top halves of fp32 elements, from the two
    64-bit words that hold its four elements (eight scattered element reads made put_wide
    4x slower than put)."""
    q0 = pairs[2 * w]
    q1 = pairs[2 * w + 1]
    m = np.uint64(0xFFFF)
    lo = ((q0 >> np.uint64(16)) & m) | ((q0 >> np.uint64(48)) << np.uint64(16))
    hi = ((q1 >> np.uint64(16)) & m) | ((q1 >> np.uint64(48)) << np.uint64(16))
    return lo | (hi << np.uint64(32))


@njit(nogil=True, cache=True, inline="always")
def _wide_words(target, pairs, bf16, pos, c0, c1, sh, width, s, out):
    """out[k - c0] = the narrow word holding pos[k], for k in [c0, c1)."""
    if bf16:
        for k in range(c0, c1):
            out[k - c0] = _bf16_word(pairs, pos[k] >> sh)
    else:
        for k in range(c0, c1):
            out[k - c0] = _wide_word(target, (pos[k] >> sh) << sh, 1 << sh, s, width)


@njit(nogil=True, cache=True)
def put_wide(target, pairs, pos, val, sh, width, shift):
    """`put` into a copy held widened: element i's `width`-bit pattern is target[i] >> shift
    (bf16 held as fp32: the top 16 bits); writes val << shift, returns the digest change of
    the narrow patterns, from the touched words before and after. Chunked like `_put_phase`
    (reads, writes, reads, then mixing: straight loops), the last partial word on its own.
    `pairs`: target's whole 64-bit words, used for bf16 in fp32 (else empty)."""
    a = np.uint64(0)
    b = np.uint64(0)
    per = 1 << sh
    s = np.uint64(shift)
    m = _whole(pos, target.size >> sh, sh, 0)
    bf16 = pairs.size > 0 and per == 4 and width == 16 and shift == 16
    xo = np.empty(CHUNK, np.uint64)
    xn = np.empty(CHUNK, np.uint64)
    for c0 in range(0, m, CHUNK):
        c1 = min(m, c0 + CHUNK)
        _wide_words(target, pairs, bf16, pos, c0, c1, sh, width, s, xo)
        for k in range(c0, c1):
            target[pos[k]] = np.uint64(val[k]) << s
        _wide_words(target, pairs, bf16, pos, c0, c1, sh, width, s, xn)
        ca, cb, _ = _mix_chunk(pos, c0, c1, sh, xo, xn, 0)
        a, b = a + ca, b + cb
    if m < pos.size:  # the last, partial word
        w = pos[m] >> sh
        lo = w << sh
        tail = target.size - lo
        old = _wide_word(target, lo, tail, s, width)
        for k in range(m, pos.size):
            target[pos[k]] = np.uint64(val[k]) << s
        new = _wide_word(target, lo, tail, s, width)
        uw = np.uint64(w)
        a += _mix0(uw, new) - _mix0(uw, old)
        b += _mix1(uw, new) - _mix1(uw, old)
    return a, b


@njit(nogil=True, cache=True)
def sum_at(widx, wvals):
    """Lane sums of words `wvals` at word indices `widx` (any order)."""
    a = np.uint64(0)
    b = np.uint64(0)
    for i in range(widx.size):
        w = np.uint64(widx[i])
        a += _mix0(w, wvals[i])
        b += _mix1(w, wvals[i])
    return a, b


def moved_by_words(widx: np.ndarray, old: np.ndarray, new: np.ndarray) -> tuple[int, int]:
    """The digest change when the words at indices `widx` go from `old` to `new` (uint64):
    what an engine that patched its own copy reads back around the positions it wrote."""
    a0, b0 = _sum_at(widx, old)
    a1, b1 = _sum_at(widx, new)
    return (int(a1) - int(a0)) & M64, (int(b1) - int(b0)) & M64


@njit(nogil=True, cache=True)
def gather(source, pos, out):
    for j in range(pos.size):
        out[j] = source[pos[j]]


@njit(nogil=True, cache=True)
def moved_words(oldw, neww, first, pos, sh, w0, w1):
    """Lane-sum move of the tensor's words [w0, w1) where `pos` (sorted, local) changed;
    oldw[i] and neww[i] are the tensor's word first + i, before and after. One straight
    loop (a word's later positions and words outside [w0, w1) add nothing)."""
    a = np.uint64(0)
    b = np.uint64(0)
    if oldw.size == 0:
        return a, b
    for j in range(pos.size):
        w = first + (pos[j] >> sh)
        keep = (j == 0 or (pos[j] >> sh) != (pos[j - 1] >> sh)) and w >= w0 and w < w1
        i = min(max(w - first, 0), oldw.size - 1)
        uw = np.uint64(w)
        f = np.uint64(keep)
        a += f * (_mix0(uw, neww[i]) - _mix0(uw, oldw[i]))
        b += f * (_mix1(uw, neww[i]) - _mix1(uw, oldw[i]))
    return a, b


@njit(nogil=True, cache=True)
def moved_in_groups(old, pos, val, offsets, sh, width, out):
    """Each member's digest move, for members laid end to end in `old` (member j holds
    elements offsets[j]..offsets[j + 1] - 1) when `val` is written at sorted `pos`: into
    out[2j], out[2j + 1]. A member's words count from its own first element, zero-padded
    past its end, as its digest alone would have them; one walk over the positions, each
    touched word assembled once (what a group record's tensors cost, chain/writer.py)."""
    per = 1 << sh
    emask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    j = 0
    i = 0
    n = pos.size
    while i < n:
        p = pos[i]
        while p >= offsets[j + 1]:
            j += 1
        lo = offsets[j]
        hi = offsets[j + 1]
        w = (p - lo) >> sh
        e0 = lo + (w << sh)
        xo = np.uint64(0)
        for k in range(per):
            if e0 + k < hi:
                xo |= np.uint64(old[e0 + k]) << np.uint64(width * k)
        xn = xo
        while i < n and pos[i] < e0 + per and pos[i] < hi:
            sft = np.uint64(width * (pos[i] - e0))
            xn = (xn & ~(emask << sft)) | (np.uint64(val[i]) << sft)
            i += 1
        uw = np.uint64(w)
        out[2 * j] += _mix0(uw, xn) - _mix0(uw, xo)
        out[2 * j + 1] += _mix1(uw, xn) - _mix1(uw, xo)


@njit(nogil=True, cache=True)
def moved_in_word_groups(oldw, pos, val, offsets, cuts, sh, width, out):
    """`moved_in_groups` where every member starts at a whole word and holds whole words
    (offsets all multiples of the word's elements): member j's positions pos[cuts[j]:
    cuts[j + 1]] take `_unwritten_words`' straight loops, its words counted from its own
    first. About 3x faster than the general walk, which assembles each touched word from
    its elements and so cannot be vectorized (1 % of 2^25 bf16 in members of 20,000:
    20 ms there)."""
    xo = np.empty(CHUNK + 8, np.uint64)
    xn = np.empty(CHUNK + 8, np.uint64)
    for j in range(offsets.size - 1):
        if cuts[j] < cuts[j + 1]:
            a, b = _unwritten_words(oldw, pos, val, cuts[j], cuts[j + 1], sh, width,
                                    offsets[j] >> sh, xo, xn)
            out[2 * j] += a
            out[2 * j + 1] += b


@njit(nogil=True, cache=True)
def pull_put_word_groups(target, tw, source, offsets, pcuts, ppos, cuts, pos, val, sh, out):
    """`pull_put_groups` where every member holds whole words (as moved_in_word_groups):
    per member, the pulls then the puts, each `_phase_words`' straight loops (the general
    walk interleaves both lists word by word: 3-4x slower)."""
    xo = np.empty(CHUNK, np.uint64)
    xn = np.empty(CHUNK, np.uint64)
    for j in range(offsets.size - 1):
        base = offsets[j] >> sh
        a, b, _ = _phase_words(target, tw, source, ppos, val, pcuts[j], pcuts[j + 1], True,
                               sh, 0, base, xo, xn)
        c, d, _ = _phase_words(target, tw, source, pos, val, cuts[j], cuts[j + 1], False,
                               sh, 0, base, xo, xn)
        out[2 * j] += a + c
        out[2 * j + 1] += b + d


@njit(nogil=True, cache=True)
def pull_put_groups(target, source, offsets, ppos, pos, val, sh, width, out):
    """Members laid end to end (as moved_in_groups) written in place: target[e] = source[e]
    at sorted unique `ppos` (the changes since the target's own version), then target[e] =
    val at sorted `pos`; each member's digest move, read from the target's words before and
    after, added into out[2j], out[2j + 1]. One walk over both position lists: what a group
    of small tensors costs a region's disk, instead of a kernel call per tensor."""
    per = 1 << sh
    j = 0
    a = 0
    b = 0
    while a < ppos.size or b < pos.size:
        p = ppos[a] if b >= pos.size or (a < ppos.size and ppos[a] < pos[b]) else pos[b]
        while p >= offsets[j + 1]:
            j += 1
        lo = offsets[j]
        e0 = lo + (((p - lo) >> sh) << sh)
        e1 = min(e0 + per, offsets[j + 1])
        xo = np.uint64(0)
        for k in range(e1 - e0):
            xo |= np.uint64(target[e0 + k]) << np.uint64(width * k)
        while a < ppos.size and ppos[a] < e1:
            target[ppos[a]] = source[ppos[a]]
            a += 1
        while b < pos.size and pos[b] < e1:
            target[pos[b]] = val[b]
            b += 1
        xn = np.uint64(0)
        for k in range(e1 - e0):
            xn |= np.uint64(target[e0 + k]) << np.uint64(width * k)
        uw = np.uint64((p - lo) >> sh)
        out[2 * j] += _mix0(uw, xn) - _mix0(uw, xo)
        out[2 * j + 1] += _mix1(uw, xn) - _mix1(uw, xo)


def words(arr: np.ndarray) -> np.ndarray:
    """The whole 64-bit words of a flat element array, as a uint64 view (no copy)."""
    per = 8 // arr.itemsize
    if arr.size % per == 0 and arr.flags.c_contiguous:  # one view instead of three
        return arr.reshape(-1).view(np.uint64)
    return arr[: arr.size // per * per].view(np.uint8).view(np.uint64)


# The entry points below run the kernels compiled at install when present (chain/codec/aot.py).
_sum_words = bind(sum_words, "sum_words")
_diff_pairs = bind(diff_pairs, "diff_pairs")
_pull_put = bind(pull_put, "pull_put")
_put = bind(put, "put")
_put_at = bind(put_at, "put_at")
_put_unwritten = bind(put_unwritten, "put_unwritten")
_put_wide = bind(put_wide, "put_wide")
_sum_at = bind(sum_at, "sum_at")
_pull = bind(pull, "pull")
fast_gather = bind(gather, "gather")
fast_moved_words = bind(moved_words, "moved_words")
_moved_in_groups = bind(moved_in_groups, "moved_in_groups")
_pull_put_groups = bind(pull_put_groups, "pull_put_groups")
_moved_in_word_groups = bind(moved_in_word_groups, "moved_in_word_groups")
_pull_put_word_groups = bind(pull_put_word_groups, "pull_put_word_groups")


def moved_by_put(target: np.ndarray, pos: np.ndarray, val: np.ndarray) -> tuple[int, int]:
    return _put(target, words(target), pos, val, *word_layout(target))


def moved_by_put_at(target: np.ndarray, pos: np.ndarray, val: np.ndarray, off: int
                    ) -> tuple[int, int, int]:
    """moved_by_put for `target` holding a larger tensor's elements from `off` (a whole
    word) on, `pos` the tensor's positions: (digest change, words touched). No temporary
    arrays: at 10 M changes, shifting the positions and counting the words in numpy took as
    long as the patch."""
    return _put_at(target, words(target), pos, val, *word_layout(target), off)


def moved_by_pull(target: np.ndarray, source: np.ndarray, pos: np.ndarray) -> tuple[int, int]:
    return _pull(target, words(target), source, pos, *word_layout(target))


def moved_by_pull_put(target: np.ndarray, source: np.ndarray, ppos: np.ndarray,
                      pos: np.ndarray, val: np.ndarray) -> tuple[int, int]:
    return _pull_put(target, words(target), source, ppos, pos, val, *word_layout(target))


def moved_by_put_wide(target: np.ndarray, pos: np.ndarray, val: np.ndarray,
                     shift: int) -> tuple[int, int]:
    """moved_by_put for a copy whose elements hold `val`'s patterns shifted up by `shift`."""
    sh, width = word_layout(val)
    pairs = words(target) if target.itemsize == 4 and sys.byteorder == "little" \
        else np.empty(0, np.uint64)
    return _put_wide(target, pairs, pos, val, sh, width, shift)


def moved_by_changes(old: np.ndarray, pos: np.ndarray, val: np.ndarray) -> tuple[int, int]:
    """How writing `val` at sorted `pos` would move `old`'s digest; `old` is only read."""
    return _put_unwritten(old, words(old), pos, val, *word_layout(old))


def moved_between(old: np.ndarray, new: np.ndarray, pos: np.ndarray) -> tuple[int, int]:
    return _diff_pairs(old, words(old), new, words(new), pos, *word_layout(old))


def moved_by_groups(old: np.ndarray, pos: np.ndarray, val: np.ndarray, offsets: np.ndarray
                    ) -> np.ndarray:
    """`moved_by_changes` for every member of a group at once (see moved_in_groups): a
    (members, 2) array of lane sums. `pos` must lie in [0, offsets[-1]); `offsets` int64."""
    if pos.size and (pos[0] < 0 or pos[-1] >= offsets[-1] or offsets[-1] > old.size):
        raise ValueError("positions or members past the group's elements")
    out = np.zeros(2 * (offsets.size - 1), np.uint64)
    sh, width = word_layout(old)
    if _whole_words(old, offsets, sh):
        _moved_in_word_groups(words(old), pos, val, offsets, np.searchsorted(pos, offsets),
                              sh, width, out)
    else:
        _moved_in_groups(old, pos, val, offsets, sh, width, out)
    return out.reshape(-1, 2)


def _whole_words(arr: np.ndarray, offsets: np.ndarray, sh: int) -> bool:
    """Whether every member of a group (elements offsets[j]..offsets[j + 1] of `arr`) is
    whole 64-bit words of `arr`'s word view."""
    return (arr.__array_interface__["data"][0] % 8 == 0 and arr.flags.c_contiguous
            and not (offsets & ((1 << sh) - 1)).any())


def moved_by_group_writes(target: np.ndarray, source: np.ndarray, offsets: np.ndarray,
                          ppos: np.ndarray, pos: np.ndarray, val: np.ndarray) -> np.ndarray:
    """pull_put_groups: write a group's members in place and return a (members, 2) array of
    their digest moves. Positions are the group's (members end to end), sorted; `ppos`
    unique."""
    end = int(offsets[-1])
    for p in (ppos, pos):
        if p.size and (p[0] < 0 or p[-1] >= end):
            raise ValueError("positions past the group's elements")
    if end > min(target.size, source.size) or val.size != pos.size:
        raise ValueError("the group's members do not fit its target and source")
    out = np.zeros(2 * (offsets.size - 1), np.uint64)
    sh, width = word_layout(target)
    if _whole_words(target, offsets, sh):
        _pull_put_word_groups(target, words(target), source, offsets,
                              np.searchsorted(ppos, offsets), ppos,
                              np.searchsorted(pos, offsets), pos, val, sh, out)
    else:
        _pull_put_groups(target, source, offsets, ppos, pos, val, sh, width, out)
    return out.reshape(-1, 2)


# ---------------------------------------------------------------- digests as strings


def base(dtype: str, shape: Sequence[int]) -> tuple[int, int]:
    """The per-(dtype, shape) constant, so equal bytes of another type or shape differ."""
    h = xxhash.xxh3_128_intdigest(f'["{dtype}",{list(shape)}]'.encode())
    return h >> 64, h & M64


def to_hex(a: int, b: int) -> str:
    return f"{a & M64:016x}{b & M64:016x}"


def from_hex(digest: str) -> tuple[int, int]:
    return int(digest[:16], 16), int(digest[16:], 16)


def add(digest: str, delta: tuple[int, int]) -> str:
    """A digest moved by a change computed by `diff_pairs`, `put` or `pull`."""
    a, b = from_hex(digest)
    return to_hex(a + int(delta[0]), b + int(delta[1]))


def add_many(digests: Sequence[str], deltas: Sequence[tuple[int, int]]) -> list[str]:
    """`add` of each digest and its move, in a few array operations instead of two integer
    parses and a format a digest (what 50,000 tensors' digests cost a region's apply)."""
    if not digests:
        return []
    if any(len(d) != 32 for d in digests):  # a malformed one spoils only its own, as in `add`
        return [add(d, m) for d, m in zip(digests, deltas, strict=True)]
    text = add_raw(bytes.fromhex("".join(digests)), _lanes(deltas)).hex()
    return [text[i:i + 32] for i in range(0, len(text), 32)]


def add_raw(raw: bytes, moves: np.ndarray) -> bytes:
    """Digests held as raw bytes (16 a digest: its two lanes, big-endian, as its hex reads),
    each moved by its row of `moves` ((n, 2) uint64 lane sums, modulo 2^64): `add_many`
    without the hex, for a table that keeps its digests as bytes (TensorTable.moved)."""
    lanes = np.frombuffer(raw, ">u8").reshape(-1, 2).astype(np.uint64)
    return (lanes + moves.reshape(-1, 2)).astype(">u8").tobytes()


def _lanes(deltas: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
    """The moves as (n, 2) uint64 lane sums modulo 2^64: in one conversion where every sum
    is an integer array's or already in [0, 2^64) (the kernels' lane sums; numpy wraps an
    integer array as `& M64` does), else one Python integer at a time (sums of parts may pass
    2^64 or be negative)."""
    try:
        return np.array(deltas, np.uint64).reshape(-1, 2)
    except (OverflowError, ValueError, TypeError):
        return np.array([(int(a) & M64, int(b) & M64) for a, b in deltas], np.uint64)


def word_layout(arr: np.ndarray) -> tuple[int, int]:
    """(log2 of elements per 64-bit word, bits per element) of a flat unsigned element array."""
    return _LOG2_PER_WORD[arr.itemsize], 8 * arr.itemsize


_LOG2_PER_WORD = {1: 3, 2: 2, 4: 1, 8: 0}


def _bytes(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr).reshape(-1)
    return arr.view(np.uint8)


def partial_jobs(data: np.ndarray, out: list, slot: int) -> list[tuple[int, Callable[[], None]]]:
    """Jobs whose lane sums, added, are the word sum of flat array `data` (tail included);
    each writes its (a, b) into out[slot] (a list it appends to)."""
    raw = _bytes(data)
    nwords = raw.size // 8
    jobs = []
    words = raw[: 8 * nwords].view(np.uint64) if sys.byteorder == "little" else None
    if words is None:
        raise RuntimeError("deltaswarm digests assume a little-endian machine")
    for lo in range(0, nwords, CHUNK_WORDS):
        hi = min(nwords, lo + CHUNK_WORDS)

        def job(lo: int = lo, hi: int = hi) -> None:
            out[slot].append(_sum_words(words[lo:hi], lo))
        jobs.append((hi - lo, job))
    tail = raw[8 * nwords:]
    if tail.size:
        x = int.from_bytes(tail.tobytes(), "little")
        w = np.array([x], np.uint64)
        out[slot].append(_sum_words(w, nwords))
    return jobs


def finish(dtype: str, shape: Sequence[int], parts: list[tuple[int, int]]) -> str:
    a, b = base(dtype, shape)
    for pa, pb in parts:
        a += int(pa)
        b += int(pb)
    return to_hex(a, b)
