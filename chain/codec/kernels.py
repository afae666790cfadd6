"""numba kernels that code one tensor segment: a single pass over the elements plus a range
coder over the changes.

Model: every element has a context e = a few high bits of its *old* pattern (the exponent for
floats). Within a segment, the changed elements of context e are coded as gaps between their
ranks among the elements of context e (Rice split: adaptive unary quotient, raw remainder), and
each change as sign and magnitude of key(new) - key(old), where key() makes float patterns
monotone so a sign flip near zero is a small step. Symbols are interleaved in the order the
decoder asks for them, so one stream per segment suffices and the decoder's single pass over
the old tensor finds every change without an index array. The decoder writes only to scratch
(walk positions and new values); the caller scatters after every segment checked out.
"""

import numpy as np
from numba import njit

from chain.codec.rangecoder import (
    INIT,
    cost,
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
    off_k = 2
    off_gap = off_k + 2 * KMAX_CLASS
    off_cls = off_gap + 2 * nctx
    off_top = off_cls + width * nctx
    off_sgn = off_top + width * nctx
    total = off_sgn + 3 * nctx
    return off_k, off_gap, off_cls, off_top, off_sgn, total


def model_size(nctx: int, width: int) -> int:
    return 2 + 2 * KMAX_CLASS + nctx * (2 * width + 5)


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
    gaps = (n - k) * 11 // (16 * k)
    r = 0
    while r < R_MAX and (np.int64(2) << r) <= gaps:
        r += 1
    return r


# ---------------------------------------------------------------- encoding pieces


@njit
def _enc_count(st, rs, models, off_k, k, out, rbuf):
    """k >= 0 as Exp-Golomb: adaptive unary class, adaptive top bit, raw rest."""
    v = k + 1
    n = 0
    while (v >> (n + 1)) != 0:
        n += 1
    c = 0.0
    for t in range(n):
        c += cost(models, off_k + t, 1)
        st = enc_bit(st, models, off_k + t, 1, out)
    if n < KMAX_CLASS - 1:
        c += cost(models, off_k + n, 0)
        st = enc_bit(st, models, off_k + n, 0, out)
    if n >= 1:
        b = (v >> (n - 1)) & 1
        c += cost(models, off_k + KMAX_CLASS + n, b) + (n - 1)
        st = enc_bit(st, models, off_k + KMAX_CLASS + n, b, out)
        rest = n - 1
        while rest > 0:
            take = min(rest, 24)
            rest -= take
            rs = raw_put(rs, v >> rest, take, rbuf)
    return st, rs, c


@njit
def _enc_gap(st, rs, models, gi, g, r, out, rbuf):
    q = g >> r
    c = 0.0
    for t in range(q):
        j = gi + min(t, 1)
        c += cost(models, j, 1)
        st = enc_bit(st, models, j, 1, out)
    j = gi + min(q, 1)
    c += cost(models, j, 0)
    st = enc_bit(st, models, j, 0, out)
    if r:
        rs = raw_put(rs, g, r, rbuf)
    return st, rs, c + r


@njit
def _enc_value(st, rs, models, ci, ti, si, o, nw, width, is_float, out, rbuf):
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    d = (_key(np.uint64(nw), width, is_float) - _key(np.uint64(o), width, is_float)) & mask
    neg = (d >> np.uint64(width - 1)) & np.uint64(1)
    mag = ((np.uint64(0) - d) & mask) if neg else d
    n = 0
    while (mag >> np.uint64(n + 1)) != np.uint64(0):
        n += 1
    for t in range(n):
        st = enc_bit(st, models, ci + t, 1, out)
    if n < width - 1:
        st = enc_bit(st, models, ci + n, 0, out)
    if n >= 1:
        st = enc_bit(st, models, ti + n, np.int64((mag >> np.uint64(n - 1)) & np.uint64(1)), out)
        rest = n - 1
        while rest > 0:
            take = min(rest, 24)
            rest -= take
            rs = raw_put(rs, np.int64((mag >> np.uint64(rest)) & np.uint64(0xFFFFFF)), take,
                         rbuf)
    st = enc_bit(st, models, si + min(n, 2), np.int64(neg), out)
    return st, rs


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
def _find_changes(old, new, lo, hi, chg_pos):
    m = 0
    for j in range(lo, hi):
        if old[j] != new[j]:
            chg_pos[m] = j
            m += 1
    return m


@njit(nogil=True, cache=True)
def encode_segment(old, new, lo, hi, shift, cmask, nctx, width, is_float,
                   models, h0, h1, h2, h3, kcnt, first, rpar,
                   chg_pos, chg_rank, chg_ctx, nxt, out, rbuf):
    """Code old[lo:hi] -> new[lo:hi]: range-coded part into `out`, raw bits into `rbuf`.
    Returns (range-coded bytes, raw bytes, changes, estimated position bits, result hash); a
    byte count larger than its buffer means it was too small (the caller retries bigger)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    hsh = np.uint64(lo)
    m = _find_changes(old, new, lo, hi, chg_pos)
    if m == 0:
        return 0, 0, 0, 0.0, hsh
    for e in range(nctx):
        h0[e] = 0
        h1[e] = 0
        h2[e] = 0
        h3[e] = 0
        kcnt[e] = 0
        first[e] = -1
    a = lo
    for j in range(m):
        i = chg_pos[j]
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
    rs = (np.int64(0), np.int64(0), np.int64(0))
    pbits = 0.0
    prev = 0
    for e in range(nctx):
        act = 1 if kcnt[e] > 0 else 0
        pbits += cost(models, prev, act)
        st = enc_bit(st, models, prev, act, out)
        prev = act
        if act:
            st, rs, c = _enc_count(st, rs, models, off_k, kcnt[e] - 1, out, rbuf)
            pbits += c + R_BITS
            r = _rice_param(h0[e] + h1[e] + h2[e] + h3[e], kcnt[e])
            rpar[e] = r
            rs = raw_put(rs, r, R_BITS, rbuf)
            st, rs, c = _enc_gap(st, rs, models, off_gap + 2 * e, first[e], r, out, rbuf)
            pbits += c
    for j in range(m):
        e = chg_ctx[j]
        i = chg_pos[j]
        st, rs = _enc_value(st, rs, models, off_cls + width * e, off_top + width * e,
                            off_sgn + 3 * e, old[i], new[i], width, is_float, out, rbuf)
        hsh = _mix(_mix(hsh, np.uint64(i - lo)), np.uint64(new[i]))
        if nxt[j] >= 0:
            st, rs, c = _enc_gap(st, rs, models, off_gap + 2 * e, nxt[j] - chg_rank[j] - 1,
                                 rpar[e], out, rbuf)
            pbits += c
    return enc_finish(st, out), raw_finish(rs, rbuf), m, pbits, hsh


# ---------------------------------------------------------------- decoding


@njit
def _dec_count(st, rs, models, off_k, buf, start, end):
    n = 0
    while n < KMAX_CLASS - 1:
        b, st = dec_bit(st, models, off_k + n, buf, end)
        if b == 0:
            break
        n += 1
    v = np.int64(1)
    if n >= 1:
        b, st = dec_bit(st, models, off_k + KMAX_CLASS + n, buf, end)
        v = np.int64(2) | b
        rest = n - 1
        while rest > 0:
            take = min(rest, 24)
            rest -= take
            chunk, rs = raw_get(rs, take, buf, start, end)
            v = (v << take) | chunk
    return v - 1, st, rs


@njit
def _dec_gap(st, rs, models, gi, r, qmax, buf, start, end):
    q = 0
    while True:
        b, st = dec_bit(st, models, gi + min(q, 1), buf, end)
        if b == 0:
            break
        q += 1
        if q > qmax:
            return np.int64(-1), st, rs
    low = np.int64(0)
    if r:
        low, rs = raw_get(rs, r, buf, start, end)
    return (np.int64(q) << r) | low, st, rs


@njit(nogil=True, cache=True)
def decode_segment(target, lo, hi, buf, start, end, kseg, shift, cmask, nctx, width, is_float,
                   models, slack, rem, rpar, out_pos, out_val, obase):
    """Decode one segment's stream against target[lo:hi] (read only) into out_pos/out_val
    [obase:obase+kseg]. Returns (error code (OK = 0), result hash)."""
    sh = np.uint64(shift)
    cm = np.uint64(cmask)
    seglen = hi - lo
    off_k, off_gap, off_cls, off_top, off_sgn, total = _layout(nctx, width)
    models[:total] = INIT
    st = dec_start(buf, start, end)
    rs = (np.int64(0), np.int64(0), np.int64(0))
    if st[1] >= st[0]:
        return ERR_STREAM, np.uint64(0)
    found = 0
    prev = 0
    for e in range(nctx):
        slack[e] = NEVER
        rem[e] = 0
        act, st = dec_bit(st, models, prev, buf, end)
        prev = act
        if act:
            k, st, rs = _dec_count(st, rs, models, off_k, buf, start, end)
            k += 1
            found += k
            if k > seglen or found > kseg:
                return ERR_COUNT, np.uint64(0)
            r, rs = raw_get(rs, R_BITS, buf, start, end)
            if r > R_MAX:
                return ERR_GAP, np.uint64(0)
            g, st, rs = _dec_gap(st, rs, models, off_gap + 2 * e, r, seglen >> r, buf, start,
                                 end)
            if g < 0 or g >= seglen:
                return ERR_GAP, np.uint64(0)
            slack[e] = g
            rem[e] = k
            rpar[e] = r
    if found != kseg:
        return ERR_COUNT, np.uint64(0)

    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    top = np.uint64(1) << np.uint64(width - 1)
    m = 0
    err = OK
    hsh = np.uint64(lo)
    for i in range(lo, hi):
        x = target[i]
        e = _ctx(x, sh, cm)
        s = slack[e]
        if s != 0:
            slack[e] = s - 1
        else:
            ci = off_cls + width * e
            n = 0
            while n < width - 1:
                b, st = dec_bit(st, models, ci + n, buf, end)
                if b == 0:
                    break
                n += 1
            mag = np.uint64(1) << np.uint64(n)
            if n >= 1:
                b, st = dec_bit(st, models, off_top + width * e + n, buf, end)
                mag |= np.uint64(b) << np.uint64(n - 1)
                rest = n - 1
                while rest > 0:
                    take = min(rest, 24)
                    rest -= take
                    chunk, rs = raw_get(rs, take, buf, start, end)
                    mag |= np.uint64(chunk) << np.uint64(rest)
            neg, st = dec_bit(st, models, off_sgn + 3 * e + min(n, 2), buf, end)
            if mag == top and neg == 0:
                err = ERR_VALUE
            d = ((np.uint64(0) - mag) & mask) if neg else mag
            key = (_key(np.uint64(x), width, is_float) + d) & mask
            nx = _key(key, width, is_float)
            out_pos[obase + m] = i - lo
            out_val[obase + m] = nx
            hsh = _mix(_mix(hsh, np.uint64(i - lo)), nx)
            m += 1
            left = rem[e] - 1
            rem[e] = left
            if left > 0:
                g, st, rs = _dec_gap(st, rs, models, off_gap + 2 * e, rpar[e],
                                     seglen >> rpar[e], buf, start, end)
                if g < 0:
                    return ERR_GAP, np.uint64(0)
                slack[e] = g
            else:
                slack[e] = NEVER
    if err != OK:
        return err, np.uint64(0)
    if m != kseg:
        return ERR_GAP, np.uint64(0)
    if (st[2] - start) + rs[2] != end - start:
        return ERR_STREAM, np.uint64(0)
    return OK, hsh


@njit(nogil=True, cache=True)
def scatter(target, lo, pos, val, start, stop):
    for j in range(start, stop):
        target[lo + pos[j]] = val[j]
