"""numba kernels that code one tensor segment.

Model: every element has a context e = a few high bits of its *old* pattern (the exponent for
floats). Within a segment, the changed elements of context e are coded as gaps between their
ranks among the elements of context e (Rice codes, parameter chosen per context), and each
change as the difference key(new) - key(old), where key() makes float patterns monotone so a
sign flip near zero is a small step. Most steps are +-1: per context, the changes whose step is
not +-1 (or, when those are the majority, the ones whose step is) are listed as Rice-coded gaps,
every change has a raw sign bit, and only the listed exceptions code a magnitude (adaptive
Exp-Golomb class, adaptive top bit, rest bits).

Everything about a context is stored together, so the decoder reads all symbols first in tight
loops and then finds every change in one pass over the old tensor that only counts elements
down per context; the values are finished in that same pass. A segment has four streams:
the context table (which contexts changed, how often: range coded), the gaps (raw bits),
the exception magnitudes (range coded), and the signs and exception lists (raw bits). The
decoder writes only to scratch (positions and new values); the caller scatters after every
segment checked out.

For 2-byte elements the encoder finds the changes, their contexts and their ranks in a single
pass over 64-bit words (4 elements per load) and the decoder counts down over words too; other
widths take a change scan and then count the elements between changes.

Direct positions (payload mode CODED_POS): each segment's gap stream starts with a bit. 0: the
segment is coded as above. 1: the table keeps its per-context counts but the gap stream holds
one Rice parameter and the gaps between consecutive positions, in position order; the steps are
stored per context as above. The decoder then reads the positions, and only the old elements at
them (their contexts say which context's next step each takes): O(changes), no pass over the
segment. Positions cost more bits this way when the change rate differs between contexts (small
weights flip more often under the same update: ~38 % more bytes on Adam-like bf16 updates at
1 %), the same when it does not. The encoder sizes both and codes a segment directly when that
costs at most its `direct` allowance more (chain.codec.api.DIRECT; the trainer's
`direct_positions_pct`).
"""

import numba
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from chain.codec.rangecoder import (
    INIT,
    dec_bit,
    dec_start,
    enc_bit,
    enc_finish,
    enc_start,
    raw_finish,
    raw_get,
    raw_put,
    rice_get,
    rice_put,
)
from chain.lanemix import _mix0, _mix1

# sha256 of rangecoder.py (first 16 hex digits). numba caches these kernels keyed on this file
# only; the primitives from rangecoder.py are compiled into them. Editing rangecoder.py without
# updating this digest would leave stale machine code in every numba cache (a test checks it).
RANGECODER_DIGEST = "54cae00278c68691"

# sha256 of lanemix.py (first 16 hex digits): numba caches these kernels keyed on
# this file only, and the word mix is compiled into them; the digest here makes an edit of
# lanemix.py invalidate them (a test checks it).
LANEMIX_DIGEST = "1af0bf58416382d6"

KMAX_CLASS = 40
R_BITS = 5
R_MAX = 26
REST = 2

OK = 0
ERR_STREAM = 1
ERR_COUNT = 2
ERR_VALUE = 3
ERR_GAP = 4
NEVER = 1 << 62


@njit
def _layout(nctx, width):
    """Offsets in the model array: 0-1 active-context bits, 2 magnitude rest bits, then the
    change-count code, the listed-count code, the "list is inverted" bit, and per context the
    magnitude classes and top bits."""
    off_k = 3
    off_x = off_k + 2 * KMAX_CLASS
    off_inv = off_x + 2 * KMAX_CLASS
    off_cls = off_inv + 1
    off_top = off_cls + width * nctx
    total = off_top + width * nctx
    return off_k, off_x, off_inv, off_cls, off_top, total


def model_size(nctx: int, width: int) -> int:
    return 4 + 4 * KMAX_CLASS + 2 * width * nctx


@njit(inline="always")
def _ctx(x, shift, cmask):
    """Unsigned on purpose: numba adds a negative-index fix-up to every signed index."""
    return (np.uint64(x) >> shift) & cmask


@njit(inline="always")
def _mask(width):
    return np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)


@njit(inline="always")
def _flip(x, width, is_float):
    """The monotone key of a pattern, and back (it is its own inverse): negative floats get their
    magnitude bits flipped so that key order is value order and -0.0 sits next to +0.0."""
    if is_float:
        wm1 = np.uint64(width - 1)
        return x ^ ((np.uint64(0) - (x >> wm1)) & (_mask(width) >> np.uint64(1)))
    return x


@njit
def _mix(h, v):
    z = h ^ v
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xFF51AFD7ED558CCD)
    z ^= z >> np.uint64(33)
    return z


# ---------------------------------------------------------------- finding the changes


@njit
def _find_rank_words(old, new, lo, hi, sh, cm, h, chg, chg_rank, chg_ctx):
    """2-byte elements whose arrays are 8-byte aligned: offsets (from lo) of the changes, their
    contexts and ranks (elements of the same context before them) in one pass (_words_between
    over whole words, then the last few one at a time)."""
    n4 = (hi - lo) // 4
    # no values kept and no digest moves: `chg` stands in for both, never written there
    m = _words_between(old, new, 0, lo, lo + 4 * n4, lo, sh, cm, h, chg, chg_rank, chg_ctx,
                       chg, False, 0, chg.view(np.uint64), 0, 0, False)
    q1 = np.uint64(256)
    q2 = np.uint64(512)
    q3 = np.uint64(768)
    for i in range(lo + 4 * n4, hi):
        e = _ctx(old[i], sh, cm)
        chg[m] = i - lo
        chg_ctx[m] = e
        chg_rank[m] = h[e] + h[q1 + e] + h[q2 + e] + h[q3 + e]
        m += old[i] != new[i]
        h[e] += 1
    return m


@njit
def _words_between(old, new, noff, a, b, lo, sh, cm, h, chg, chg_rank, chg_ctx, vals, keep_vals,
                   m, moves, slot, word, track):
    """Elements [a, b) (whole 64-bit words of 2-byte elements, 8-byte aligned in both arrays)
    of a segment from lo, old[i] against new[i - noff]: the changes after the `m` found
    before, as _find_rank_words records them (and their new values in `vals`, with
    `keep_vals`; else `vals` is never written, but numba still types the write, so it must be
    a writable array: `old` may be read-only). With `track`, each changed word's move of its
    tensor's digest (chain.lanehash: the words counted from `word`, the index of element a's
    word in its own tensor) is added into moves[2 * slot], moves[2 * slot + 1], from the two
    words the scan holds anyway (`moves` too must be writable without it). Each lane of a word
    counts into its own
    quarter of `h` (4 * 256 entries, one array so the compiler sees the quarters cannot
    alias): equal contexts in neighbouring lanes then form no store-to-load chain. The lanes
    of a word that changed are recorded branch-free before it is counted."""
    n4 = (b - a) // 4
    wo = old[a:a + 4 * n4].view(np.uint64)
    wn = new[a - noff:a - noff + 4 * n4].view(np.uint64)
    z = np.uint64(0)
    ff = np.uint64(0xFFFF)
    s1 = sh + np.uint64(16)
    s2 = sh + np.uint64(32)
    s3 = sh + np.uint64(48)
    q1 = np.uint64(256)
    q2 = np.uint64(512)
    q3 = np.uint64(768)
    for u in range(n4):
        v = wo[u]
        e0 = (v >> sh) & cm
        e1 = (v >> s1) & cm
        e2 = (v >> s2) & cm
        e3 = (v >> s3) & cm
        w = wn[u]
        y = v ^ w
        if y != z:
            b0 = a - lo + 4 * u
            chg[m] = b0
            chg_ctx[m] = e0
            chg_rank[m] = h[e0] + h[q1 + e0] + h[q2 + e0] + h[q3 + e0]
            if keep_vals:
                vals[m] = w & ff
            m += (y & ff) != z
            chg[m] = b0 + 1
            chg_ctx[m] = e1
            chg_rank[m] = h[e1] + h[q1 + e1] + h[q2 + e1] + h[q3 + e1] + (e0 == e1)
            if keep_vals:
                vals[m] = (w >> np.uint64(16)) & ff
            m += ((y >> np.uint64(16)) & ff) != z
            chg[m] = b0 + 2
            chg_ctx[m] = e2
            chg_rank[m] = h[e2] + h[q1 + e2] + h[q2 + e2] + h[q3 + e2] + (e0 == e2) + (e1 == e2)
            if keep_vals:
                vals[m] = (w >> np.uint64(32)) & ff
            m += ((y >> np.uint64(32)) & ff) != z
            chg[m] = b0 + 3
            chg_ctx[m] = e3
            chg_rank[m] = h[e3] + h[q1 + e3] + h[q2 + e3] + h[q3 + e3] + (e0 == e3) + (e1 == e3) \
                + (e2 == e3)
            if keep_vals:
                vals[m] = w >> np.uint64(48)
            m += (y >> np.uint64(48)) != z
            if track:
                uw = np.uint64(word + u)
                moves[2 * slot] += _mix0(uw, w) - _mix0(uw, v)
                moves[2 * slot + 1] += _mix1(uw, w) - _mix1(uw, v)
        h[e0] += 1
        h[q1 + e1] += 1
        h[q2 + e2] += 1
        h[q3 + e3] += 1
    return m


@njit
def _find_rank(old, new, lo, hi, sh, cm, h, chg, chg_rank, chg_ctx):
    """Any width: offsets, contexts and ranks as _find_rank_words finds them (`h`: 4 * 256
    entries), by a change scan and then counting the elements between consecutive changes."""
    m = 0
    for i in range(lo, hi):
        chg[m] = i - lo
        m += old[i] != new[i]
    q1 = np.uint64(256)
    q2 = np.uint64(512)
    q3 = np.uint64(768)
    a = lo
    for j in range(m):
        i = lo + chg[j]
        while a + 4 <= i:
            h[_ctx(old[a], sh, cm)] += 1
            h[q1 + _ctx(old[a + 1], sh, cm)] += 1
            h[q2 + _ctx(old[a + 2], sh, cm)] += 1
            h[q3 + _ctx(old[a + 3], sh, cm)] += 1
            a += 4
        while a < i:
            h[_ctx(old[a], sh, cm)] += 1
            a += 1
        e = _ctx(old[i], sh, cm)
        chg_ctx[j] = e
        chg_rank[j] = h[e] + h[q1 + e] + h[q2 + e] + h[q3 + e]
        h[e] += 1
        a = i + 1
    return m


@intrinsic
def _address(typingctx, addr):
    """An int64 address as a pointer for numba.carray: memory the caller keeps alive and
    vouches for (chain.codec.api.Pieces)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@njit
def _find_rank_pieces(old, addrs, starts, lo, hi, sh, cm, h, chg, chg_rank, chg_ctx, vals,
                      moves):
    """_find_rank where the new elements lie in pieces, read where they are: piece p holds
    elements [starts[p], starts[p + 1]) at address addrs[p] (a group's member tensors in the
    trainer's memory, not copied end to end first). Also each change's new value, in `vals`.
    2-byte elements go a word at a time (_words_between) wherever old and the piece are
    8-byte aligned together, the rest one at a time (_elements_between).

    And each piece's digest move (the member tensor's own, chain.lanehash), found in the word
    scan: the k-th piece the segment touches adds into moves[2k], moves[2k + 1]. It can only
    be found there when the scan's words are the member's own (its start 8-byte aligned in
    `old`) and every change lies in them; where one does not, moves[-1] is set to 1 and the
    caller computes the moves itself (chain.lanehash.moved_by_groups)."""
    m = 0
    obase = old.ctypes.data
    p = np.searchsorted(starts, lo, side="right") - 1
    first = p
    whole = True
    while p < addrs.size and starts[p] < hi:
        a = max(lo, starts[p])
        b = min(hi, starts[p + 1])
        off = starts[p]
        new = numba.carray(_address(addrs[p]), (starts[p + 1] - off,), old.dtype)
        w0 = b
        if old.itemsize == 2 and obase % 2 == 0 and addrs[p] % 2 == 0 and \
                (obase + 2 * a - addrs[p] - 2 * (a - off)) % 8 == 0:
            w0 = min(b, a + (8 - (obase + 2 * a) % 8) % 8 // 2)  # the first aligned element
        w1 = w0 + (b - w0) // 4 * 4
        own = (w0 - off) % 4 == 0  # the scan's words are the member's
        before = m
        m = _elements_between(old, new, off, a, w0, lo, sh, cm, h, chg, chg_rank, chg_ctx,
                              vals, m)
        whole = whole and m == before
        before = m
        m = _words_between(old, new, off, w0, w1, lo, sh, cm, h, chg, chg_rank, chg_ctx, vals,
                           True, m, moves, p - first, (w0 - off) // 4, own)
        whole = whole and (own or m == before)
        before = m
        m = _elements_between(old, new, off, w1, b, lo, sh, cm, h, chg, chg_rank, chg_ctx,
                              vals, m)
        whole = whole and m == before
        p += 1
    if not whole:
        moves[moves.size - 1] = 1
    return m


@njit
def _elements_between(old, new, noff, a, b, lo, sh, cm, h, chg, chg_rank, chg_ctx, vals, m):
    """Elements [a, b) of a segment from lo, old[i] against new[i - noff], one at a time: the
    changes after the `m` found before, with their new values in `vals`. Counts rotate over
    the quarters of `h` by position (a rank sums the four), as the word scan's lanes do."""
    q1 = np.uint64(256)
    q2 = np.uint64(512)
    q3 = np.uint64(768)
    for i in range(a, b):
        x = old[i]
        y = new[i - noff]
        e = _ctx(x, sh, cm)
        if x != y:
            chg[m] = i - lo
            chg_ctx[m] = e
            chg_rank[m] = h[e] + h[q1 + e] + h[q2 + e] + h[q3 + e]
            vals[m] = y
            m += 1
        h[np.uint64((i & 3) << 8) + e] += 1
    return m


# ---------------------------------------------------------------- encoding


@njit
def _enc_count(st, rs, models, off_k, k, out, rbuf):
    """k >= 0 as Exp-Golomb: adaptive unary class, adaptive top bit, raw rest."""
    v = k + 1
    n = 0
    while (v >> (n + 1)) != 0:
        n += 1
    for t in range(n):
        st = enc_bit(st, models, off_k + t, 1, out)
    if n < KMAX_CLASS - 1:
        st = enc_bit(st, models, off_k + n, 0, out)
    if n >= 1:
        st = enc_bit(st, models, off_k + KMAX_CLASS + n, (v >> (n - 1)) & 1, out)
        rest = n - 1
        while rest > 0:
            take = min(rest, 24)
            rest -= take
            rs = raw_put(rs, v >> rest, take, rbuf)
    return st, rs


@njit
def _enc_mag(vs, models, ci, ti, mag, width, vout):
    """A step magnitude >= 2: unary class n = floor(log2 mag) >= 1, the bit below the leading
    one (adaptive per class), the rest (one shared adaptive context, nearly uniform)."""
    n = 0
    while (mag >> np.uint64(n + 1)) != np.uint64(0):
        n += 1
    for t in range(1, n):
        vs = enc_bit(vs, models, ci + t, 1, vout)
    if n < width - 1:
        vs = enc_bit(vs, models, ci + n, 0, vout)
    vs = enc_bit(vs, models, ti + n, np.int64((mag >> np.uint64(n - 1)) & np.uint64(1)), vout)
    for b in range(n - 2, -1, -1):
        vs = enc_bit(vs, models, REST, np.int64((mag >> np.uint64(b)) & np.uint64(1)), vout)
    return vs


@njit
def _rice_choose(vals, a, k, total):
    """The Rice parameter with the fewest bits for vals[a:a+k] (k >= 1, summing to `total`):
    the best of three around the one the mean suggests."""
    mean = total // k
    r0 = 0
    while r0 < R_MAX - 2 and (np.int64(4) << r0) <= mean:
        r0 += 1
    c0 = k * r0
    c1 = k * (r0 + 1)
    c2 = k * (r0 + 2)
    for t in range(a, a + k):
        g = vals[t]
        c0 += g >> r0
        c1 += g >> (r0 + 1)
        c2 += g >> (r0 + 2)
    if c0 <= min(c1, c2):
        return r0
    return r0 + 1 if c1 <= c2 else r0 + 2


@njit
def _rice_bits(vals, a, k, r):
    """Bits rice_put takes for vals[a:a+k] with parameter r (escapes aside: a chosen r makes
    them rare)."""
    bits = k * (r + 1)
    for t in range(a, a + k):
        bits += vals[t] >> r
    return bits


@njit
def _enc_values(vs, ss, models, off_x, off_inv, ci, ti, steps, width, scratch, vout, sout):
    """One context's steps: exception list, signs, magnitudes."""
    mask = _mask(width)
    one = np.uint64(1)
    wm1 = np.uint64(width - 1)
    k = steps.size
    x = 0  # steps other than +-1; their signs go out with every other sign, 32 at a time
    acc = np.int64(0)
    nb = 0
    for t in range(k):
        d = np.uint64(steps[t])
        x += (d != one) & (d != mask)
        acc |= np.int64((d >> wm1) & one) << nb
        nb += 1
        if nb == 32:
            ss = raw_put(ss, acc, 32, sout)
            acc = np.int64(0)
            nb = 0
    if nb:
        ss = raw_put(ss, acc, nb, sout)
    inv = 1 if 2 * x > k else 0
    vs = enc_bit(vs, models, off_inv, inv, vout)
    listed = k - x if inv else x
    vs, ss = _enc_count(vs, ss, models, off_x, listed, vout, sout)
    if listed:
        n = 0
        prev = -1
        for t in range(k):
            d = np.uint64(steps[t])
            if ((d != one) & (d != mask)) != inv:
                scratch[n] = t - prev - 1
                prev = t
                n += 1
        rx = _rice_choose(scratch, 0, listed, prev + 1 - listed)
        ss = raw_put(ss, rx, R_BITS, sout)
        for i in range(listed):
            ss = rice_put(ss, scratch[i], rx, sout)
    if x:
        for t in range(k):
            d = np.uint64(steps[t])
            if (d != one) & (d != mask):
                mag = ((np.uint64(0) - d) & mask) if (d >> wm1) & one else d
                vs = _enc_mag(vs, models, ci, ti, mag, width, vout)
    return vs, ss


@njit(nogil=True, cache=True)
def encode_segment(old, new, lo, hi, words, shift, cmask, nctx, width, is_float,
                   models, hist, kcnt, start, rpar, chg, chg_rank, chg_ctx, grank,
                   gstep, tout, gout, vout, sout, keep, direct):
    """Code old[lo:hi] -> new[lo:hi] into four buffers (scratch arrays of hi - lo + 1 entries;
    `words`: 2-byte elements, 8-byte aligned). Returns (changes, then the table, gap, magnitude
    and sign stream lengths, result hash); no changes codes nothing, and a length larger than
    its buffer means the buffer was too small. When `keep` has room, the changes' offsets from
    lo go there in position order too (the caller's record of what changed).

    `direct` < 0: positions as ranks within their contexts (mode CODED). Else (mode
    CODED_POS) the gap stream starts with a bit saying how this segment codes them: as ranks,
    or directly as gaps between positions, which the decoder reads without counting every
    old element (O(changes) instead of a pass over the segment); direct when its gaps take at
    most `direct` percent more bits than the ranks'."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    hist[:] = 0
    kcnt[:nctx] = 0
    if words:
        m = _find_rank_words(old, new, lo, hi, sh, cm, hist, chg, chg_rank, chg_ctx)
    else:
        m = _find_rank(old, new, lo, hi, sh, cm, hist, chg, chg_rank, chg_ctx)
    return _code_changes(old, new, False, lo, m, nctx, width, is_float, models, kcnt,
                         start, rpar, chg, chg_rank, chg_ctx, grank, gstep, tout, gout, vout,
                         sout, keep, direct)


@njit(nogil=True, cache=True)
def encode_pieces(old, addrs, starts, lo, hi, shift, cmask, nctx, width, is_float,
                  models, hist, kcnt, start, rpar, chg, chg_rank, chg_ctx, grank,
                  gstep, tout, gout, vout, sout, keep, direct, vals, moves):
    """encode_segment where the new elements lie in pieces (see _find_rank_pieces), read in
    place; each change's new value also goes to `vals` (hi - lo + 1 entries), in position
    order, where `keep` gets its offset; each piece's digest move to `moves` (zeros, two per
    piece the segment touches and one more, set to 1 where they could not all be found)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    hist[:] = 0
    kcnt[:nctx] = 0
    m = _find_rank_pieces(old, addrs, starts, lo, hi, sh, cm, hist, chg, chg_rank, chg_ctx,
                          vals, moves)
    return _code_changes(old, vals, True, lo, m, nctx, width, is_float, models, kcnt,
                         start, rpar, chg, chg_rank, chg_ctx, grank, gstep, tout, gout, vout,
                         sout, keep, direct)


@njit
def _code_changes(old, new, packed, lo, m, nctx, width, is_float, models, kcnt, start,
                  rpar, chg, chg_rank, chg_ctx, grank, gstep, tout, gout, vout, sout, keep,
                  direct):
    """What encode_segment does once the changes are found: `m` changes at offsets chg[:m]
    from lo; their new values new[lo + offset], or new[j] for the j-th change when `packed`."""
    if m == 0:
        return 0, 0, 0, 0, 0, np.uint64(0)

    # group the changes by context (stable: position order within a context) while taking
    # their steps and the result hash; grank/gstep are the ranks and steps in grouped order
    for j in range(m):
        kcnt[chg_ctx[j]] += 1
    total = 0
    for e in range(nctx):
        start[e] = total
        total += kcnt[e]
    mask = _mask(width)
    hsh = np.uint64(0)
    save = keep.size >= m
    for j in range(m):
        i = lo + chg[j]
        if save:
            keep[j] = chg[j]
        kn = np.uint64(new[j] if packed else new[i])
        hsh += _mix(np.uint64(i), kn)
        ko = _flip(np.uint64(old[i]), width, is_float)
        kn = _flip(kn, width, is_float)
        e = chg_ctx[j]
        t = start[e]
        start[e] = t + 1
        grank[t] = chg_rank[j]
        gstep[t] = (kn - ko) & mask
    rank_bits = 0
    for e in range(nctx):  # ranks become gaps, in place
        k = kcnt[e]
        start[e] -= k
        prev = -1
        for t in range(start[e], start[e] + k):
            rk = grank[t]
            grank[t] = rk - prev - 1
            prev = rk
        if k:
            r = _rice_choose(grank, start[e], k, prev + 1 - k)
            rpar[e] = r
            rank_bits += _rice_bits(grank, start[e], k, r) + R_BITS
    use_direct = 0
    rd = 0
    if direct >= 0:  # positions become gaps between them, in place (chg is scratch from here)
        last = chg[m - 1]
        for j in range(m - 1, 0, -1):
            chg[j] -= chg[j - 1] + 1
        rd = _rice_choose(chg, 0, m, last + 1 - m)
        if (_rice_bits(chg, 0, m, rd) + R_BITS) * 100 <= rank_bits * (100 + direct):
            use_direct = 1

    off_k, off_x, off_inv, off_cls, off_top, total = _layout(nctx, width)
    models[:total] = INIT
    ts = enc_start()
    gs = (np.int64(0), np.int64(0), np.int64(0))
    if direct >= 0:
        gs = raw_put(gs, use_direct, 1, gout)
    prev = 0
    for e in range(nctx):
        act = 1 if kcnt[e] > 0 else 0
        ts = enc_bit(ts, models, prev, act, tout)
        prev = act
        if act:
            ts, gs = _enc_count(ts, gs, models, off_k, kcnt[e] - 1, tout, gout)
            if not use_direct:
                gs = raw_put(gs, rpar[e], R_BITS, gout)
    if use_direct:
        gs = raw_put(gs, rd, R_BITS, gout)
        for j in range(m):
            gs = rice_put(gs, chg[j], rd, gout)
    vs = enc_start()
    ss = (np.int64(0), np.int64(0), np.int64(0))
    for e in range(nctx):
        k = kcnt[e]
        if k == 0:
            continue
        r = rpar[e]
        if not use_direct:
            for t in range(start[e], start[e] + k):
                gs = rice_put(gs, grank[t], r, gout)
        # the offsets in chg are no longer needed: it serves as scratch
        vs, ss = _enc_values(vs, ss, models, off_x, off_inv, off_cls + width * e,
                             off_top + width * e, gstep[start[e]:start[e] + k], width, chg,
                             vout, sout)
    return (m, enc_finish(ts, tout), raw_finish(gs, gout), enc_finish(vs, vout),
            raw_finish(ss, sout), hsh)


# ---------------------------------------------------------------- decoding


@njit
def _dec_count(st, rs, models, off_k, buf, pend, rend):
    n = 0
    while n < KMAX_CLASS - 1:
        b, st = dec_bit(st, models, off_k + n, buf, pend)
        if b == 0:
            break
        n += 1
    v = np.int64(1)
    if n >= 1:
        b, st = dec_bit(st, models, off_k + KMAX_CLASS + n, buf, pend)
        v = np.int64(2) | b
        rest = n - 1
        while rest > 0:
            take = min(rest, 24)
            rest -= take
            chunk, rs = raw_get(rs, take, buf, rend)
            v = (v << take) | chunk
    return v - 1, st, rs


@njit
def _dec_mag(vs, models, ci, ti, width, buf, vend):
    n = 1
    while n < width - 1:
        b, vs = dec_bit(vs, models, ci + n, buf, vend)
        if b == 0:
            break
        n += 1
    mag = np.uint64(1) << np.uint64(n)
    b, vs = dec_bit(vs, models, ti + n, buf, vend)
    mag |= np.uint64(b) << np.uint64(n - 1)
    for k in range(n - 2, -1, -1):
        b, vs = dec_bit(vs, models, REST, buf, vend)
        mag |= np.uint64(b) << np.uint64(k)
    return mag, vs


@njit
def _dec_values(vs, ss, models, off_x, off_inv, ci, ti, k, width, buf, vend, send, lst, val,
                o):
    """One context's k steps into val[o:o+k] (lst[o:o+k]: scratch). Returns (error code, vs,
    ss)."""
    mask = _mask(width)
    top = np.uint64(1) << np.uint64(width - 1)
    one = np.uint64(1)
    for t in range(0, k, 32):
        nb = min(32, k - t)
        bits, ss = raw_get(ss, nb, buf, send)
        for b in range(nb):
            val[o + t + b] = mask if (bits >> b) & 1 else one
    inv, vs = dec_bit(vs, models, off_inv, buf, vend)
    listed, vs, ss = _dec_count(vs, ss, models, off_x, buf, vend, send)
    if listed > k:
        return ERR_COUNT, vs, ss
    if listed:
        rx, ss = raw_get(ss, R_BITS, buf, send)
        if rx > R_MAX:
            return ERR_GAP, vs, ss
        idx = -1
        for i in range(listed):
            g, ss = rice_get(ss, rx, buf, send)
            idx += g + 1
            if g < 0 or idx >= k:
                return ERR_GAP, vs, ss
            lst[o + i] = idx
    if (k - listed if inv else listed) == 0:
        return OK, vs, ss
    li = 0
    for t in range(k):
        hit = li < listed and lst[o + li] == t
        li += hit
        if hit == (inv == 1):
            continue
        mag, vs = _dec_mag(vs, models, ci, ti, width, buf, vend)
        neg = np.uint64(val[o + t]) == mask
        if mag > top or (mag == top and not neg):
            return ERR_VALUE, vs, ss
        val[o + t] = ((np.uint64(0) - mag) & mask) if neg else mag
    return OK, vs, ss


@njit(inline="always")
def _hit(i, x, e, lo, slack, ptr, gp, gaps, steps, out_pos, out_val, m, width, is_float):
    """Element i (old pattern x, context e) is its context's next change and the m-th change
    in position order: finish its new value, arm the context's next gap, and return the
    change's share of the result hash."""
    j = ptr[e]
    ptr[e] = j + 1
    g = gp[e]
    slack[e] = gaps[g]
    gp[e] = g + 1
    kn = _flip((_flip(np.uint64(x), width, is_float) + np.uint64(steps[j])) & _mask(width),
               width, is_float)
    out_val[m] = kn
    out_pos[m] = i - lo
    return _mix(np.uint64(i), kn)


@njit(inline="always")
def _streams_end(gs, vstart, ss, send, vs, sstart):
    """Whether the gap and sign readers stopped inside their streams' last byte and the
    magnitude decoder at its stream's end: a segment's symbols used exactly its bytes."""
    for state, end in ((gs, vstart), (ss, send)):
        consumed = 8 * state[2] - state[1]
        if consumed > 8 * end or consumed <= 8 * end - 8:
            return False
    return vs[2] == sstart


@njit
def _decode_direct(target, lo, hi, buf, gs, vs, vstart, sstart, send, kseg, shift, cmask, nctx,
                   width, is_float, models, kk, ptr, gp, gaps, steps, out_pos, out_val, obase,
                   toff):
    """decode_segment's rest for a segment whose positions are gaps between them: read the
    positions, then each context's steps, then only the changed old elements (their context
    says whose next step each takes). Each context's steps run from ptr[e] to gp[e]."""
    none = np.uint64(0)
    seglen = hi - lo
    _, off_x, off_inv, off_cls, off_top, _ = _layout(nctx, width)
    rd, gs = raw_get(gs, R_BITS, buf, vstart)
    if rd > R_MAX:
        return ERR_GAP, none
    used = 0
    for j in range(kseg):
        g, gs = rice_get(gs, rd, buf, vstart)
        used += g + 1
        if g < 0 or used > seglen:
            return ERR_GAP, none
        out_pos[obase + j] = used - 1
    ss = (np.int64(0), np.int64(0), sstart)
    o = 0
    for e in range(nctx):
        k = kk[e]
        ptr[e] = o
        gp[e] = o + k
        if k == 0:
            continue
        err, vs, ss = _dec_values(vs, ss, models, off_x, off_inv, off_cls + width * e,
                                  off_top + width * e, k, width, buf, sstart, send, gaps,
                                  steps, o)
        if err:
            return err, none
        o += k
    if not _streams_end(gs, vstart, ss, send, vs, sstart):
        return ERR_STREAM, none
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    hsh = np.uint64(0)
    # the old elements first, in a loop of independent loads whose cache misses overlap
    for j in range(kseg):
        gaps[j] = target[lo + out_pos[obase + j] - toff]
    for m in range(obase, obase + kseg):
        i = lo + out_pos[m]
        x = gaps[m - obase]
        e = _ctx(x, sh, cm)
        j = ptr[e]
        if j >= gp[e]:  # more changes in this context than the table says
            return ERR_GAP, none
        ptr[e] = j + 1
        kn = _flip((_flip(np.uint64(x), width, is_float) + np.uint64(steps[j])) & _mask(width),
                   width, is_float)
        out_val[m] = kn
        hsh += _mix(np.uint64(i), kn)
    return OK, hsh


@njit(nogil=True, cache=True)
def decode_segment(target, lo, hi, words, buf, tstart, gstart, vstart, sstart, send, kseg,
                   shift, cmask, nctx, width, is_float, models, slack, kk, rpar, ptr, gp, gaps,
                   steps, out_pos, out_val, obase, toff, flagged):
    """Decode one segment's streams (table buf[tstart:gstart], gaps [gstart:vstart],
    magnitudes [vstart:sstart], signs [sstart:send]) against elements lo..hi of the old
    tensor, which `target` holds from element `toff` on (read only; `words`: as for encoding)
    into out_pos/out_val[obase:obase+kseg], in position order (`gaps`, `steps`: scratch of
    kseg + nctx entries). `flagged`: the payload is CODED_POS, whose segments say how they code
    their positions (encode_segment's `direct`). Returns (error code, OK = 0; result hash)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    seglen = hi - lo
    none = np.uint64(0)
    off_k, off_x, off_inv, off_cls, off_top, total = _layout(nctx, width)
    models[:total] = INIT
    ts = dec_start(buf, tstart, gstart)
    vs = dec_start(buf, vstart, sstart)
    gs = (np.int64(0), np.int64(0), gstart)
    ss = (np.int64(0), np.int64(0), sstart)
    if ts[1] >= ts[0] or vs[1] >= vs[0]:
        return ERR_STREAM, none
    use_direct = np.int64(0)
    if flagged:
        use_direct, gs = raw_get(gs, 1, buf, vstart)
    found = 0
    prev = 0
    for e in range(nctx):
        kk[e] = 0
        act, ts = dec_bit(ts, models, prev, buf, gstart)
        prev = act
        if act:
            k, ts, gs = _dec_count(ts, gs, models, off_k, buf, gstart, vstart)
            k += 1
            found += k
            if k > seglen or found > kseg:
                return ERR_COUNT, none
            if not use_direct:
                r, gs = raw_get(gs, R_BITS, buf, vstart)
                if r > R_MAX:
                    return ERR_GAP, none
                rpar[e] = r
            kk[e] = k
    if found != kseg:
        return ERR_COUNT, none
    if ts[2] != gstart:
        return ERR_STREAM, none
    if use_direct:
        return _decode_direct(target, lo, hi, buf, gs, vs, vstart, sstart, send, kseg, shift,
                              cmask, nctx, width, is_float, models, kk, ptr, gp, gaps, steps,
                              out_pos, out_val, obase, toff)

    # gaps and steps, context by context; each context's gaps end with a sentinel
    o = 0
    at = 0
    lst = out_pos[obase:obase + kseg]  # scratch for the exception lists until the pass
    for e in range(nctx):
        k = kk[e]
        if k == 0:
            slack[e] = NEVER
            continue
        r = rpar[e]
        used = 0
        for t in range(k):
            g, gs = rice_get(gs, r, buf, vstart)
            used += g + 1
            if g < 0 or used > seglen:
                return ERR_GAP, none
            gaps[at + t] = g
        gaps[at + k] = NEVER
        slack[e] = gaps[at]
        gp[e] = at + 1
        ptr[e] = o
        at += k + 1
        err, vs, ss = _dec_values(vs, ss, models, off_x, off_inv, off_cls + width * e,
                                  off_top + width * e, k, width, buf, sstart, send, lst,
                                  steps, o)
        if err:
            return err, none
        o += k
    if not _streams_end(gs, vstart, ss, send, vs, sstart):
        return ERR_STREAM, none

    # one pass over the old elements finds every change and finishes its new value
    hsh = np.uint64(0)
    m = obase
    tail = lo
    if words:
        n4 = seglen // 4
        wt = target[lo - toff:lo - toff + 4 * n4].view(np.uint64)
        ff = np.uint64(0xFFFF)
        for u in range(n4):
            v = wt[u]
            for lane in range(4):
                e = (v >> (sh + np.uint64(16 * lane))) & cm
                s = slack[e]
                slack[e] = s - 1
                if s == 0:
                    hsh += _hit(lo + 4 * u + lane, (v >> np.uint64(16 * lane)) & ff, e, lo,
                                slack, ptr, gp, gaps, steps, out_pos, out_val, m, width,
                                is_float)
                    m += 1
        tail = lo + 4 * n4
    for i in range(tail, hi):
        x = target[i - toff]
        e = _ctx(x, sh, cm)
        s = slack[e]
        slack[e] = s - 1
        if s == 0:
            hsh += _hit(i, x, e, lo, slack, ptr, gp, gaps, steps, out_pos, out_val, m, width,
                        is_float)
            m += 1
    o = 0
    for e in range(nctx):
        o += kk[e]
        if kk[e] and ptr[e] != o:
            return ERR_GAP, none
    return OK, hsh


@njit(nogil=True, cache=True)
def scatter(target, lo, pos, val, start, stop):
    for j in range(start, stop):
        target[lo + pos[j]] = val[j]


@njit(nogil=True, cache=True)
def scatter_from(target, pos, val, off, start, stop):
    """target[pos[j] - off] = val[j] for j in start..stop: tensor positions written into a
    buffer holding the tensor's elements from `off` on (a decode's overlaid segment)."""
    for j in range(start, stop):
        target[pos[j] - off] = val[j]


@njit(nogil=True, cache=True)
def merge_sorted(pa, va, pb, vb, out_p, out_v):
    """The union of two sets of changes with ascending, distinct positions (pa/va then the later
    pb/vb, whose value wins at a position both hold) into out_p/out_v, ascending; returns how
    many. One linear walk: np.unique over the concatenation sorted 40 M positions in 1 s for a
    region's batch of four versions at 1B."""
    i = j = n = 0
    while i < pa.size and j < pb.size:
        a, b = pa[i], pb[j]
        if a < b:
            out_p[n] = a
            out_v[n] = va[i]
            i += 1
        else:
            out_p[n] = b
            out_v[n] = vb[j]
            j += 1
            if a == b:
                i += 1
        n += 1
    while i < pa.size:
        out_p[n] = pa[i]
        out_v[n] = va[i]
        i += 1
        n += 1
    while j < pb.size:
        out_p[n] = pb[j]
        out_v[n] = vb[j]
        j += 1
        n += 1
    return n
