"""A binary adaptive range coder (LZMA-style carry handling) written for numba, plus a raw bit
stream and Rice codes on it.

Each adaptive context is one int32: the 12-bit probability of a 0 in the low 16 bits and an
update count in the high bits, so a context learns at rate 1/(count+2) (the KT estimator) until
it settles at 1/LIMIT. Coder state travels as tuples of int64 so LLVM keeps it in registers.
Decoding never reads past `end` (it feeds zeros instead; the caller rejects a stream whose
position ran past its end) and keeps code < range, so corrupted input cannot overflow.
numba's on-disk cache keys the kernels on kernels.py alone, so kernels.py carries a digest of
this file (RANGECODER_DIGEST): after editing this file, update it (a test says to), which
invalidates the cached kernels everywhere, including installs that upgrade in place.
"""

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

PROB_BITS = 12
PONE = 1 << PROB_BITS
PMIN = 4
PMAX = PONE - PMIN
LIMIT = 40
TOP = 1 << 24
INIT = PONE // 2
# MUL[c] = 2^16 / (c + 2): the learning rate of a context updated c times before
MUL = np.array([65536 // (c + 2) for c in range(LIMIT + 1)], dtype=np.int64)


@njit(inline="always")
def adapt(models, i, bit):
    s = models[i]
    p = np.int64(s & 0xFFFF)
    c = np.int64(s >> 16)
    target = PONE & (bit - 1)
    p += ((target - p) * MUL[c]) >> 16
    p = min(max(p, PMIN), PMAX)
    c = min(c + 1, LIMIT)
    models[i] = np.int32(p | (c << 16))


# ---------------------------------------------------------------- encoder
# state: (low, rng, cache, csize, pos); pos starts at -1 so the always-zero first byte is
# never written. Returns pos > cap when `out` was too small (the caller retries bigger).


@njit(inline="always")
def _shift_low(low, cache, csize, out, pos):
    if low < 0xFF000000 or low >= 0x100000000:
        carry = low >> 32
        temp = cache
        while True:
            if 0 <= pos < out.size:
                out[pos] = np.uint8((temp + carry) & 0xFF)
            pos += 1
            temp = 0xFF
            csize -= 1
            if csize == 0:
                break
        cache = (low >> 24) & 0xFF
    csize += 1
    low = (low & 0x00FFFFFF) << 8
    return low, cache, csize, pos


@njit
def enc_start():
    return np.int64(0), np.int64(0xFFFFFFFF), np.int64(0), np.int64(1), np.int64(-1)


@njit(inline="always")
def enc_bit(st, models, i, bit, out):
    low, rng, cache, csize, pos = st
    p = np.int64(models[i] & 0xFFFF)
    bound = (rng >> PROB_BITS) * p
    mb = -np.int64(bit)
    low += bound & mb
    rng = bound + ((rng - 2 * bound) & mb)
    adapt(models, i, bit)
    while rng < TOP:
        rng <<= 8
        low, cache, csize, pos = _shift_low(low, cache, csize, out, pos)
    return low, rng, cache, csize, pos


@njit
def enc_finish(st, out):
    low, _, cache, csize, pos = st
    for _ in range(5):
        low, cache, csize, pos = _shift_low(low, cache, csize, out, pos)
    return pos


# ---------------------------------------------------------------- decoder
# state: (rng, code, pos)


@njit(inline="always")
def _byte(buf, pos, end):
    if pos < end:
        return np.int64(buf[pos])
    return np.int64(0)


@njit
def dec_start(buf, start, end):
    code = np.int64(0)
    pos = start
    for _ in range(4):
        code = (code << 8) | _byte(buf, pos, end)
        pos += 1
    return np.int64(0xFFFFFFFF), code, pos


@njit(inline="always")
def dec_bit(st, models, i, buf, end):
    rng, code, pos = st
    p = np.int64(models[i] & 0xFFFF)
    bound = (rng >> PROB_BITS) * p
    bit = np.int64(code >= bound)
    mb = -bit
    code -= bound & mb
    rng = bound + ((rng - 2 * bound) & mb)
    adapt(models, i, bit)
    while rng < TOP:
        rng <<= 8
        code = (code << 8) | _byte(buf, pos, end)
        pos += 1
    return bit, (rng, code, pos)


# ---------------------------------------------------------------- raw bits
# Bits that are close to uniform skip the range coder: LSB-first into their own stream.
# Writer state: (acc, nacc, pos); reader state the same, reading zeros past `end` (pos still
# counts, so the caller's exact-length check fails).


@njit(inline="always")
def raw_put(rs, value, nbits, rbuf):
    """Append the low `nbits` (<= 32) of `value`; whole 32-bit words go out at once."""
    acc, nacc, rpos = rs
    acc |= (value & ((np.int64(1) << nbits) - 1)) << nacc
    nacc += nbits
    if nacc >= 32:
        if rpos + 4 <= rbuf.size:
            rbuf[rpos] = np.uint8(acc & 0xFF)
            rbuf[rpos + 1] = np.uint8((acc >> 8) & 0xFF)
            rbuf[rpos + 2] = np.uint8((acc >> 16) & 0xFF)
            rbuf[rpos + 3] = np.uint8((acc >> 24) & 0xFF)
        rpos += 4
        acc >>= 32
        nacc -= 32
    return acc, nacc, rpos


@njit
def raw_finish(rs, rbuf):
    acc, nacc, rpos = rs
    while nacc > 0:
        if rpos < rbuf.size:
            rbuf[rpos] = np.uint8(acc & 0xFF)
        rpos += 1
        acc >>= 8
        nacc -= 8
    return rpos


@njit(inline="always")
def raw_get(rs, nbits, buf, end):
    """Read `nbits` (<= 32)."""
    acc, nacc, rpos = rs
    while nacc < nbits:
        acc |= _byte(buf, rpos, end) << nacc
        rpos += 1
        nacc += 8
    value = acc & ((np.int64(1) << nbits) - 1)
    return value, (acc >> nbits, nacc - nbits, rpos)


# ---------------------------------------------------------------- Rice codes
# A gap g with parameter r: q = g >> r in unary (q zeros, then a one), then the low r bits.
# Unary runs of QESC or more escape to an Elias-gamma code of q - QESC + 1. The reader keeps at
# least 49 bits buffered so a unary run is found with one count of trailing zeros.

QESC = 31


@njit(inline="always")
def rice_put(rs, g, r, rbuf):
    q = g >> r
    if q < QESC and q + 1 + r <= 32:
        return raw_put(rs, (np.int64(1) << q) | ((g & ((np.int64(1) << r) - 1)) << (q + 1)),
                       q + 1 + r, rbuf)
    if q < QESC:
        rs = raw_put(rs, np.int64(1) << q, q + 1, rbuf)
    else:
        rs = raw_put(rs, np.int64(1) << QESC, QESC + 1, rbuf)
        v = q - QESC + 1
        n = 0
        while (v >> (n + 1)) != 0:
            n += 1
        rs = raw_put(rs, n, 5, rbuf)
        rs = raw_put(rs, v, n, rbuf)
    if r:
        rs = raw_put(rs, g, r, rbuf)
    return rs


@njit(inline="always")
def _refill(rs, buf, end):
    """Top the buffer up to at least 49 bits, a byte at a time."""
    acc, nacc, rpos = rs
    while nacc <= 48:
        acc |= _byte(buf, rpos, end) << nacc
        rpos += 1
        nacc += 8
    return acc, nacc, rpos


@njit(inline="always")
def rice_get(rs, r, buf, end):
    """A gap coded by rice_put with the same r, or -1 for a malformed code. The reader reads
    ahead: bits consumed = 8 * position - buffered bits."""
    acc, nacc, rpos = _refill(rs, buf, end)
    run = acc & ((np.int64(1) << (QESC + 1)) - 1)
    if run == 0:
        return np.int64(-1), (acc, nacc, rpos)
    q = np.int64(trailing_zeros(run))
    acc >>= q + 1
    nacc -= q + 1
    if q == QESC:
        acc, nacc, rpos = _refill((acc, nacc, rpos), buf, end)
        n = acc & 31
        if n > 26:
            return np.int64(-1), (acc, nacc, rpos)
        acc >>= 5
        v = (acc & ((np.int64(1) << n) - 1)) | (np.int64(1) << n)
        acc >>= n
        nacc -= 5 + n
        q = QESC - 1 + v
    if r:
        if nacc < r:
            acc, nacc, rpos = _refill((acc, nacc, rpos), buf, end)
        low = acc & ((np.int64(1) << r) - 1)
        return (q << r) | low, (acc >> r, nacc - r, rpos)
    return q, (acc, nacc, rpos)
