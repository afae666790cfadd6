"""numba kernels that code one tensor segment: a single pass over the elements plus a range
coder over the changes.

Model: every element has a context e = a few high bits of its *old* pattern (the exponent for
floats). Within a segment, the changed elements of context e are coded as gaps between their
ranks among the elements of context e (Rice split: adaptive unary quotient, raw remainder), and
each change as sign and magnitude of key(new) - key(old), where key() makes float patterns
monotone so a sign flip near zero is a small step. A segment has three streams: range-coded
position decisions, raw position bits, range-coded values; each is read in the order the
decoder asks, so its single pass over the old tensor finds every change without an index
array. The decoder writes only to scratch (walk positions and new values); the caller scatters
after every segment checked out.
"""

import numpy as np
from numba import njit

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
)

KMAX_CLASS = 40
R_BITS = 5
R_MAX = 26

OK = 0
ERR_STREAM = 1
ERR_COUNT = 2
ERR_VALUE = 3
ERR_GAP = 4
NEVER = 1 << 62


@njit
def _layout(nctx, width):
    off_k = 3
    off_gap = off_k + 2 * KMAX_CLASS
    off_cls = off_gap + 2 * nctx
    off_top = off_cls + width * nctx
    off_sgn = off_top + width * nctx
    total = off_sgn + 3 * nctx
    return off_k, off_gap, off_cls, off_top, off_sgn, total


REST = 2


def model_size(nctx: int, width: int) -> int:
    return 3 + 2 * KMAX_CLASS + nctx * (2 * width + 5)


@njit
def _key(x, width, is_float):
    """Monotone integer key of a pattern (floats: flip magnitude bits of negatives)."""
    if is_float:
        sgn = (x >> np.uint64(width - 1)) & np.uint64(1)
        half = (np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(65 - width))
        return x ^ ((np.uint64(0) - sgn) & half)
    return x


@njit
def _ctx(x, shift, cmask):
    return np.int64((np.uint64(x) >> shift) & cmask)


@njit
def _mix(h, v):
    z = h ^ v
    z ^= z >> np.uint64(33)
    z *= np.uint64(0xFF51AFD7ED558CCD)
    z ^= z >> np.uint64(33)
    return z


@njit
def _rice_param(n, k):
    gaps = (n - k) * 22 // (16 * k)
    r = 0
    while r < R_MAX and (np.int64(2) << r) <= gaps:
        r += 1
    return r


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
def _enc_gap(st, rs, models, gi, g, r, out, rbuf):
    q = g >> r
    for t in range(q):
        st = enc_bit(st, models, gi + min(t, 1), 1, out)
    st = enc_bit(st, models, gi + min(q, 1), 0, out)
    if r:
        rs = raw_put(rs, g, r, rbuf)
    return st, rs


@njit
def _enc_value(vs, models, ci, ti, si, o, nw, width, is_float, vout):
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    d = (_key(np.uint64(nw), width, is_float) - _key(np.uint64(o), width, is_float)) & mask
    neg = (d >> np.uint64(width - 1)) & np.uint64(1)
    mag = ((np.uint64(0) - d) & mask) if neg else d
    n = 0
    while (mag >> np.uint64(n + 1)) != np.uint64(0):
        n += 1
    for t in range(n):
        vs = enc_bit(vs, models, ci + t, 1, vout)
    if n < width - 1:
        vs = enc_bit(vs, models, ci + n, 0, vout)
    if n >= 1:
        vs = enc_bit(vs, models, ti + n, np.int64((mag >> np.uint64(n - 1)) & np.uint64(1)),
                     vout)
        for b in range(n - 2, -1, -1):
            vs = enc_bit(vs, models, REST, np.int64((mag >> np.uint64(b)) & np.uint64(1)), vout)
    vs = enc_bit(vs, models, si + min(n, 2), np.int64(neg), vout)
    return vs


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
def _find_changes(old, new, lo, hi, words, chg):
    """Offsets (from lo) of the elements where old and new differ, into chg; their count.
    With `words` (2-byte elements, 8-byte aligned) four elements are compared per uint64 and
    16 per test; lanes are stored branch-free."""
    m = 0
    i = lo
    if words:
        n4 = (hi - lo) // 16 * 4
        wo = old[lo:lo + 4 * n4].view(np.uint64)
        wn = new[lo:lo + 4 * n4].view(np.uint64)
        z = np.uint64(0)
        ff = np.uint64(0xFFFF)
        for w in range(0, n4, 4):
            x = (wo[w] ^ wn[w]) | (wo[w + 1] ^ wn[w + 1]) | (wo[w + 2] ^ wn[w + 2]) \
                | (wo[w + 3] ^ wn[w + 3])
            if x == z:
                continue
            for u in range(w, w + 4):
                y = wo[u] ^ wn[u]
                if y != z:
                    chg[m] = 4 * u
                    m += (y & ff) != z
                    chg[m] = 4 * u + 1
                    m += ((y >> np.uint64(16)) & ff) != z
                    chg[m] = 4 * u + 2
                    m += ((y >> np.uint64(32)) & ff) != z
                    chg[m] = 4 * u + 3
                    m += (y >> np.uint64(48)) != z
        i = lo + 4 * n4
    while i < hi:
        chg[m] = i - lo
        m += old[i] != new[i]
        i += 1
    return m


@njit(nogil=True, cache=True)
def encode_segment(old, new, lo, hi, words, shift, cmask, nctx, width, is_float,
                   models, h0, h1, h2, h3, kcnt, first, rpar, chg, chg_rank, chg_ctx, nxt,
                   pout, rout, vout):
    """Code old[lo:hi] -> new[lo:hi] into three buffers (scratch arrays of hi - lo entries;
    `words`: see _find_changes).
    Returns (changes, position bytes, raw bytes, value bytes, result hash); no changes codes
    nothing, and a count larger than its buffer means the buffer was too small."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    for e in range(nctx):
        h0[e] = 0
        h1[e] = 0
        h2[e] = 0
        h3[e] = 0
        kcnt[e] = 0
        first[e] = -1
    m = _find_changes(old, new, lo, hi, words, chg)
    if m == 0:
        return 0, 0, 0, 0, np.uint64(0)
    a = lo
    for j in range(m):
        i = lo + chg[j]
        _hist4(old, a, i, sh, cm, h0, h1, h2, h3)
        e = _ctx(old[i], sh, cm)
        chg_ctx[j] = e
        chg_rank[j] = h0[e] + h1[e] + h2[e] + h3[e]
        h0[e] += 1
        a = i + 1
    _hist4(old, a, hi, sh, cm, h0, h1, h2, h3)
    for j in range(m - 1, -1, -1):
        e = chg_ctx[j]
        nxt[j] = first[e]
        first[e] = chg_rank[j]
        kcnt[e] += 1

    off_k, off_gap, off_cls, off_top, off_sgn, total = _layout(nctx, width)
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
            r = _rice_param(h0[e] + h1[e] + h2[e] + h3[e], kcnt[e])
            rpar[e] = r
            rs = raw_put(rs, r, R_BITS, rout)
            st, rs = _enc_gap(st, rs, models, off_gap + 2 * e, first[e], r, pout, rout)
    hsh = np.uint64(lo)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    half = mask >> np.uint64(1)
    wm1 = np.uint64(width - 1)
    zero = np.uint64(0)
    for j in range(m):
        e = chg_ctx[j]
        i = lo + chg[j]
        ko = np.uint64(old[i])
        kn = np.uint64(new[i])
        hsh = _mix(_mix(hsh, np.uint64(chg[j])), kn)
        if is_float:
            ko ^= (zero - (ko >> wm1)) & half
            kn ^= (zero - (kn >> wm1)) & half
        d = (kn - ko) & mask
        if d == 1 or d == mask:
            vs = enc_bit(vs, models, off_cls + width * e, 0, vout)
            vs = enc_bit(vs, models, off_sgn + 3 * e, np.int64(d != 1), vout)
        else:
            vs = _enc_value(vs, models, off_cls + width * e, off_top + width * e,
                            off_sgn + 3 * e, old[i], new[i], width, is_float, vout)
        if nxt[j] >= 0:
            g = nxt[j] - chg_rank[j] - 1
            r = rpar[e]
            gi = off_gap + 2 * e
            if (g >> r) == 0:
                st = enc_bit(st, models, gi, 0, pout)
                if r:
                    rs = raw_put(rs, g, r, rout)
            else:
                st, rs = _enc_gap(st, rs, models, gi, g, r, pout, rout)
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
def _dec_gap(st, rs, models, gi, r, qmax, buf, pend, rend, q=0):
    """A gap; `q` > 0 when the caller already read that many unary ones."""
    while True:
        b, st = dec_bit(st, models, gi + min(q, 1), buf, pend)
        if b == 0:
            break
        q += 1
        if q > qmax:
            return np.int64(-1), st, rs
    low = np.int64(0)
    if r:
        low, rs = raw_get(rs, r, buf, rend)
    return (np.int64(q) << r) | low, st, rs


@njit
def _dec_value(vs, models, ci, ti, si, x, width, is_float, buf, vend, n=0):
    """New pattern for old pattern x, and whether the coded value was canonical; `n` > 0 when
    the caller already read that many unary ones."""
    while n < width - 1:
        b, vs = dec_bit(vs, models, ci + n, buf, vend)
        if b == 0:
            break
        n += 1
    mag = np.uint64(1) << np.uint64(n)
    if n >= 1:
        b, vs = dec_bit(vs, models, ti + n, buf, vend)
        mag |= np.uint64(b) << np.uint64(n - 1)
        for k in range(n - 2, -1, -1):
            b, vs = dec_bit(vs, models, REST, buf, vend)
            mag |= np.uint64(b) << np.uint64(k)
    neg, vs = dec_bit(vs, models, si + min(n, 2), buf, vend)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    ok = not (neg == 0 and mag == (np.uint64(1) << np.uint64(width - 1)))
    d = ((np.uint64(0) - mag) & mask) if neg else mag
    key = (_key(np.uint64(x), width, is_float) + d) & mask
    return _key(key, width, is_float), ok, vs


@njit(nogil=True, cache=True)
def decode_segment(target, lo, hi, buf, pstart, rstart, vstart, vend, kseg, shift, cmask,
                   nctx, width, is_float, models, slack, rem, rpar, out_pos, out_val, obase):
    """Decode one segment's streams (positions buf[pstart:rstart], raw bits [rstart:vstart],
    values [vstart:vend]) against target[lo:hi] (read only) into out_pos/out_val
    [obase:obase+kseg]. Returns (error code, OK = 0; result hash)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    seglen = hi - lo
    off_k, off_gap, off_cls, off_top, off_sgn, total = _layout(nctx, width)
    models[:total] = INIT
    st = dec_start(buf, pstart, rstart)
    vs = dec_start(buf, vstart, vend)
    rs = (np.int64(0), np.int64(0), rstart)
    none = np.uint64(0)
    if st[1] >= st[0] or vs[1] >= vs[0]:
        return ERR_STREAM, none
    found = 0
    prev = 0
    for e in range(nctx):
        slack[e] = NEVER
        rem[e] = 0
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
            g, st, rs = _dec_gap(st, rs, models, off_gap + 2 * e, r, seglen >> r, buf, rstart,
                                 vstart)
            if g < 0 or g >= seglen:
                return ERR_GAP, none
            slack[e] = g
            rem[e] = k
            rpar[e] = r
    if found != kseg:
        return ERR_COUNT, none

    m = 0
    canonical = True
    hsh = np.uint64(lo)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    half = mask >> np.uint64(1)
    wm1 = np.uint64(width - 1)
    zero = np.uint64(0)
    for i in range(lo, hi):
        x = target[i]
        e = _ctx(x, sh, cm)
        s = slack[e]
        if s != 0:
            slack[e] = s - 1
            continue
        ci = off_cls + width * e
        b, vs = dec_bit(vs, models, ci, buf, vend)
        if b == 0:
            neg, vs = dec_bit(vs, models, off_sgn + 3 * e, buf, vend)
            ko = np.uint64(x)
            if is_float:
                ko ^= (zero - (ko >> wm1)) & half
            kn = (ko + (mask if neg else np.uint64(1))) & mask
            if is_float:
                kn ^= (zero - (kn >> wm1)) & half
            nx = kn
        else:
            nx, ok, vs = _dec_value(vs, models, ci, off_top + width * e, off_sgn + 3 * e, x,
                                    width, is_float, buf, vend, 1)
            canonical &= ok
        out_pos[obase + m] = i - lo
        out_val[obase + m] = nx
        hsh = _mix(_mix(hsh, np.uint64(i - lo)), nx)
        m += 1
        left = rem[e] - 1
        rem[e] = left
        if left > 0:
            r = rpar[e]
            gi = off_gap + 2 * e
            b, st = dec_bit(st, models, gi, buf, rstart)
            if b == 0:
                g = np.int64(0)
                if r:
                    g, rs = raw_get(rs, r, buf, vstart)
            else:
                g, st, rs = _dec_gap(st, rs, models, gi, r, seglen >> r, buf, rstart, vstart, 1)
                if g < 0:
                    return ERR_GAP, none
            slack[e] = g
        else:
            slack[e] = NEVER
    if not canonical:
        return ERR_VALUE, none
    if m != kseg:
        return ERR_GAP, none
    if st[2] != rstart or rs[2] != vstart or vs[2] != vend:
        return ERR_STREAM, none
    return OK, hsh


@njit(nogil=True, cache=True)
def scatter(target, lo, pos, val, start, stop):
    for j in range(start, stop):
        target[lo + pos[j]] = val[j]
