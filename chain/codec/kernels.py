"""numba kernels that code one tensor segment.

Model: every element has a context e = a few high bits of its *old* pattern (the exponent for
floats). Within a segment, the changed elements of context e are coded as gaps between their
ranks among the elements of context e (Rice codes, parameter chosen per context), and each
change as the difference key(new) - key(old), where key() makes float patterns monotone so a
sign flip near zero is a small step: an adaptive "is it +-1" bit per context, a direct sign bit,
and for larger steps an adaptive Exp-Golomb class with adaptive top bit.

Everything about a context is stored together (its count, its gaps, its values), so the decoder
reads all symbols first in tight loops, and then finds every change in one pass over the old
tensor that only counts elements down per context; the values are finished in that same pass.
A segment has three streams: range-coded context table (which contexts changed, how often),
raw bits (Rice parameters and gaps), range-coded values. The decoder writes only to scratch
(positions and new values); the caller scatters after every segment checked out.

For 2-byte elements the encoder finds the changes, their contexts and their ranks in a single
pass over 64-bit words (4 elements per load); other widths take a change scan and then count
the elements between changes.
"""

import numpy as np
from numba import njit

from chain.codec.rangecoder import (
    INIT,
    dec_bit,
    dec_direct,
    dec_start,
    enc_bit,
    enc_direct,
    enc_finish,
    enc_start,
    raw_finish,
    raw_get,
    raw_put,
    rice_get,
    rice_put,
)

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
    """Offsets in the model array: 0-1 active-context bits, 2 value rest bits, then the count
    code, then per context the value classes and top bits."""
    off_k = 3
    off_cls = off_k + 2 * KMAX_CLASS
    off_top = off_cls + width * nctx
    total = off_top + width * nctx
    return off_k, off_cls, off_top, total


def model_size(nctx: int, width: int) -> int:
    return 3 + 2 * KMAX_CLASS + 2 * width * nctx


@njit(inline="always")
def _ctx(x, shift, cmask):
    """Unsigned on purpose: numba adds a negative-index fix-up to every signed index."""
    return (np.uint64(x) >> shift) & cmask


@njit
def _mix(h, v):
    z = h ^ v
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xFF51AFD7ED558CCD)
    z ^= z >> np.uint64(33)
    return z


# ---------------------------------------------------------------- finding the changes


@njit
def _find_rank_words(old, new, lo, hi, sh, cm, h0, h1, h2, h3, chg, chg_rank, chg_ctx):
    """2-byte elements whose arrays are 8-byte aligned: offsets (from lo) of the changes, their
    contexts and ranks (elements of the same context before them) in one pass. Four histograms,
    one per lane, keep the counting free of store-to-load chains; lanes of a word that changed
    are recorded branch-free before the word is counted."""
    n4 = (hi - lo) // 4
    wo = old[lo:lo + 4 * n4].view(np.uint64)
    wn = new[lo:lo + 4 * n4].view(np.uint64)
    z = np.uint64(0)
    ff = np.uint64(0xFFFF)
    s1 = sh + np.uint64(16)
    s2 = sh + np.uint64(32)
    s3 = sh + np.uint64(48)
    m = 0
    for u in range(n4):
        v = wo[u]
        e0 = (v >> sh) & cm
        e1 = (v >> s1) & cm
        e2 = (v >> s2) & cm
        e3 = (v >> s3) & cm
        y = v ^ wn[u]
        if y != z:
            b = 4 * u
            chg[m] = b
            chg_ctx[m] = e0
            chg_rank[m] = h0[e0] + h1[e0] + h2[e0] + h3[e0]
            m += (y & ff) != z
            chg[m] = b + 1
            chg_ctx[m] = e1
            chg_rank[m] = h0[e1] + h1[e1] + h2[e1] + h3[e1] + (e0 == e1)
            m += ((y >> np.uint64(16)) & ff) != z
            chg[m] = b + 2
            chg_ctx[m] = e2
            chg_rank[m] = h0[e2] + h1[e2] + h2[e2] + h3[e2] + (e0 == e2) + (e1 == e2)
            m += ((y >> np.uint64(32)) & ff) != z
            chg[m] = b + 3
            chg_ctx[m] = e3
            chg_rank[m] = h0[e3] + h1[e3] + h2[e3] + h3[e3] + (e0 == e3) + (e1 == e3) \
                + (e2 == e3)
            m += (y >> np.uint64(48)) != z
        h0[e0] += 1
        h1[e1] += 1
        h2[e2] += 1
        h3[e3] += 1
    for i in range(lo + 4 * n4, hi):
        e = _ctx(old[i], sh, cm)
        chg[m] = i - lo
        chg_ctx[m] = e
        chg_rank[m] = h0[e] + h1[e] + h2[e] + h3[e]
        m += old[i] != new[i]
        h0[e] += 1
    return m


@njit
def _hist4(old, a, b, sh, cm, h0, h1, h2, h3):
    i = a
    while i + 4 <= b:
        h0[_ctx(old[i], sh, cm)] += 1
        h1[_ctx(old[i + 1], sh, cm)] += 1
        h2[_ctx(old[i + 2], sh, cm)] += 1
        h3[_ctx(old[i + 3], sh, cm)] += 1
        i += 4
    while i < b:
        h0[_ctx(old[i], sh, cm)] += 1
        i += 1


@njit
def _find_rank(old, new, lo, hi, sh, cm, h0, h1, h2, h3, chg, chg_rank, chg_ctx):
    """Any width: the same as _find_rank_words, by a change scan and then counting the
    elements between consecutive changes."""
    m = 0
    for i in range(lo, hi):
        chg[m] = i - lo
        m += old[i] != new[i]
    a = lo
    for j in range(m):
        i = lo + chg[j]
        _hist4(old, a, i, sh, cm, h0, h1, h2, h3)
        e = _ctx(old[i], sh, cm)
        chg_ctx[j] = e
        chg_rank[j] = h0[e] + h1[e] + h2[e] + h3[e]
        h0[e] += 1
        a = i + 1
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
def _enc_step(vs, models, ci, ti, d, width, vout):
    """A key difference other than +-1 (mod 2^width): unary class n = floor(log2 |d|) from
    ci + 0 (whose 1 says "not +-1"), top bit below the leading one, rest bits, direct sign."""
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    neg = (d >> np.uint64(width - 1)) & np.uint64(1)
    mag = ((np.uint64(0) - d) & mask) if neg else d
    n = 0
    while (mag >> np.uint64(n + 1)) != np.uint64(0):
        n += 1
    for t in range(n):
        vs = enc_bit(vs, models, ci + t, 1, vout)
    if n < width - 1:
        vs = enc_bit(vs, models, ci + n, 0, vout)
    vs = enc_bit(vs, models, ti + n, np.int64((mag >> np.uint64(n - 1)) & np.uint64(1)), vout)
    for b in range(n - 2, -1, -1):
        vs = enc_bit(vs, models, REST, np.int64((mag >> np.uint64(b)) & np.uint64(1)), vout)
    return enc_direct(vs, np.int64(neg), vout)


@njit
def _rice_param(chg_rank, order, s, k):
    """The Rice parameter with the fewest bits for one context's gaps: the best of three
    around the one the mean gap suggests."""
    mean = (chg_rank[order[s + k - 1]] + 1 - k) // k
    r0 = 0
    while r0 < R_MAX - 2 and (np.int64(4) << r0) <= mean:
        r0 += 1
    c0 = k * r0
    c1 = k * (r0 + 1)
    c2 = k * (r0 + 2)
    prev = -1
    for t in range(s, s + k):
        rk = chg_rank[order[t]]
        g = rk - prev - 1
        prev = rk
        c0 += g >> r0
        c1 += g >> (r0 + 1)
        c2 += g >> (r0 + 2)
    if c0 <= min(c1, c2):
        return r0
    return r0 + 1 if c1 <= c2 else r0 + 2


@njit(nogil=True, cache=True)
def encode_segment(old, new, lo, hi, words, shift, cmask, nctx, width, is_float,
                   models, h0, h1, h2, h3, kcnt, start, rpar, chg, chg_rank, chg_ctx, order,
                   chg_d, pout, rout, vout):
    """Code old[lo:hi] -> new[lo:hi] into three buffers (scratch arrays of hi - lo + 1 entries;
    `words`: 2-byte elements, 8-byte aligned). Returns (changes, table bytes, raw bytes, value
    bytes, result hash); no changes codes nothing, and a count larger than its buffer means
    the buffer was too small."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    for e in range(nctx):
        h0[e] = 0
        h1[e] = 0
        h2[e] = 0
        h3[e] = 0
        kcnt[e] = 0
    if words:
        m = _find_rank_words(old, new, lo, hi, sh, cm, h0, h1, h2, h3, chg, chg_rank, chg_ctx)
    else:
        m = _find_rank(old, new, lo, hi, sh, cm, h0, h1, h2, h3, chg, chg_rank, chg_ctx)
    if m == 0:
        return 0, 0, 0, 0, np.uint64(0)

    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    half = mask >> np.uint64(1)
    wm1 = np.uint64(width - 1)
    zero = np.uint64(0)
    hsh = np.uint64(0)
    for j in range(m):
        kcnt[chg_ctx[j]] += 1
        i = lo + chg[j]
        ko = np.uint64(old[i])
        kn = np.uint64(new[i])
        hsh += _mix(np.uint64(i), kn)
        if is_float:
            ko ^= (zero - (ko >> wm1)) & half
            kn ^= (zero - (kn >> wm1)) & half
        chg_d[j] = (kn - ko) & mask
    # group the changes by context (stable, so position order within a context)
    total = 0
    for e in range(nctx):
        start[e] = total
        total += kcnt[e]
    for j in range(m):
        e = chg_ctx[j]
        order[start[e]] = j
        start[e] += 1
    for e in range(nctx):
        start[e] -= kcnt[e]
        if kcnt[e]:
            rpar[e] = _rice_param(chg_rank, order, start[e], kcnt[e])

    off_k, off_cls, off_top, total = _layout(nctx, width)
    models[:total] = INIT
    st = enc_start()
    vs = enc_start()
    rs = (np.int64(0), np.int64(0), np.int64(0))
    prev = 0
    for e in range(nctx):
        act = 1 if kcnt[e] > 0 else 0
        st = enc_bit(st, models, prev, act, pout)
        prev = act
        if act:
            st, rs = _enc_count(st, rs, models, off_k, kcnt[e] - 1, pout, rout)
            rs = raw_put(rs, rpar[e], R_BITS, rout)
    for e in range(nctx):
        r = rpar[e]
        ci = off_cls + width * e
        ti = off_top + width * e
        prev = -1
        for t in range(start[e], start[e] + kcnt[e]):
            j = order[t]
            rk = chg_rank[j]
            rs = rice_put(rs, rk - prev - 1, r, rout)
            prev = rk
            d = np.uint64(chg_d[j])
            if d == 1 or d == mask:
                vs = enc_bit(vs, models, ci, 0, vout)
                vs = enc_direct(vs, np.int64(d != 1), vout)
            else:
                vs = _enc_step(vs, models, ci, ti, d, width, vout)
    return m, enc_finish(st, pout), raw_finish(rs, rout), enc_finish(vs, vout), hsh


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
def _dec_step(vs, models, ci, ti, width, buf, vend):
    """The key difference after a 1 at ci + 0, and whether it was coded canonically."""
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
    neg, vs = dec_direct(vs, buf, vend)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    top = np.uint64(1) << np.uint64(width - 1)
    ok = mag < top or (mag == top and neg == 1)
    d = ((np.uint64(0) - mag) & mask) if neg else mag
    return d, ok, vs


@njit(inline="always")
def _hit(i, x, e, lo, slack, ptr, gp, gaps, out_pos, out_val, width, is_float):
    """Element i (old pattern x, context e) is its context's next change: finish its new
    value, arm the context's next gap, and return the change's share of the result hash."""
    j = ptr[e]
    ptr[e] = j + 1
    g = gp[e]
    slack[e] = gaps[g]
    gp[e] = g + 1
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    half = mask >> np.uint64(1)
    wm1 = np.uint64(width - 1)
    zero = np.uint64(0)
    ko = np.uint64(x)
    if is_float:
        ko ^= (zero - (ko >> wm1)) & half
    kn = (ko + np.uint64(out_val[j])) & mask
    if is_float:
        kn ^= (zero - (kn >> wm1)) & half
    out_val[j] = kn
    out_pos[j] = i - lo
    return _mix(np.uint64(i), kn)


@njit(nogil=True, cache=True)
def decode_segment(target, lo, hi, words, buf, pstart, rstart, vstart, vend, kseg, shift, cmask,
                   nctx, width, is_float, models, slack, kk, rpar, ptr, gp, gaps,
                   out_pos, out_val, obase):
    """Decode one segment's streams (table buf[pstart:rstart], raw bits [rstart:vstart],
    values [vstart:vend]) against target[lo:hi] (read only; `words`: as for encoding) into
    out_pos/out_val[obase:obase+kseg] (`gaps`: scratch of kseg + nctx entries). Returns (error
    code, OK = 0; result hash)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    seglen = hi - lo
    none = np.uint64(0)
    off_k, off_cls, off_top, total = _layout(nctx, width)
    models[:total] = INIT
    st = dec_start(buf, pstart, rstart)
    vs = dec_start(buf, vstart, vend)
    rs = (np.int64(0), np.int64(0), rstart)
    if st[1] >= st[0] or vs[1] >= vs[0]:
        return ERR_STREAM, none
    found = 0
    prev = 0
    for e in range(nctx):
        kk[e] = 0
        act, st = dec_bit(st, models, prev, buf, rstart)
        prev = act
        if act:
            k, st, rs = _dec_count(st, rs, models, off_k, buf, rstart, vstart)
            k += 1
            found += k
            if k > seglen or found > kseg:
                return ERR_COUNT, none
            r, rs = raw_get(rs, R_BITS, buf, vstart)
            if r > R_MAX:
                return ERR_GAP, none
            kk[e] = k
            rpar[e] = r
    if found != kseg:
        return ERR_COUNT, none
    if st[2] != rstart:
        return ERR_STREAM, none

    # gaps and step sizes, context by context; each context's gaps end with a sentinel
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    o = obase
    at = 0
    canonical = True
    for e in range(nctx):
        k = kk[e]
        if k == 0:
            slack[e] = NEVER
            continue
        r = rpar[e]
        used = 0
        for t in range(k):
            g, rs = rice_get(rs, r, buf, vstart)
            used += g + 1
            if g < 0 or used > seglen:
                return ERR_GAP, none
            gaps[at + t] = g
        gaps[at + k] = NEVER
        slack[e] = gaps[at]
        gp[e] = at + 1
        ptr[e] = o
        at += k + 1
        ci = off_cls + width * e
        ti = off_top + width * e
        for t in range(o, o + k):
            b, vs = dec_bit(vs, models, ci, buf, vend)
            if b == 0:
                neg, vs = dec_direct(vs, buf, vend)
                out_val[t] = mask if neg else np.uint64(1)
            else:
                d, ok, vs = _dec_step(vs, models, ci, ti, width, buf, vend)
                canonical &= ok
                out_val[t] = d
        o += k
    consumed = 8 * rs[2] - rs[1]
    if consumed > 8 * vstart or consumed <= 8 * vstart - 8 or vs[2] != vend:
        return ERR_STREAM, none
    if not canonical:
        return ERR_VALUE, none

    # one pass over the old elements finds every change and finishes its new value
    hsh = np.uint64(0)
    tail = lo
    if words:
        n4 = seglen // 4
        wt = target[lo:lo + 4 * n4].view(np.uint64)
        ff = np.uint64(0xFFFF)
        for u in range(n4):
            v = wt[u]
            for lane in range(4):
                e = (v >> (sh + np.uint64(16 * lane))) & cm
                s = slack[e]
                slack[e] = s - 1
                if s == 0:
                    hsh += _hit(lo + 4 * u + lane, (v >> np.uint64(16 * lane)) & ff, e, lo,
                                slack, ptr, gp, gaps, out_pos, out_val, width, is_float)
        tail = lo + 4 * n4
    for i in range(tail, hi):
        x = target[i]
        e = _ctx(x, sh, cm)
        s = slack[e]
        slack[e] = s - 1
        if s == 0:
            hsh += _hit(i, x, e, lo, slack, ptr, gp, gaps, out_pos, out_val, width, is_float)
    o = obase
    for e in range(nctx):
        o += kk[e]
        if kk[e] and ptr[e] != o:
            return ERR_GAP, none
    return OK, hsh


@njit(nogil=True, cache=True)
def scatter(target, lo, pos, val, start, stop):
    for j in range(start, stop):
        target[lo + pos[j]] = val[j]
