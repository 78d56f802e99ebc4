"""The unit-wide coded form (the codec's pieces of version 3): one coded stream per run of one dtype, decoded in a
constant number of device ops whatever the number of tensors in it.

A unit's layout groups its tensors by dtype (`layout.plan_layout`), so all its tensors of one dtype, with the padding
between them, form ONE run of elements; the run is coded as one stream with one code and cut into pieces only where
the decode scratch requires (`CHUNK_ELEMS` elements). For every element, the byte holding the sign and the top of the
exponent is split from the others: the other bytes are stored raw, planar; that byte becomes a symbol: its exponent
bits as one of `n_codes` codes (a window of the `n_codes - 1` most frequent consecutive exponents from `base`, and an
escape), its sign and low bits (fp16's, fp8's mantissa bits) riding along. `m` consecutive symbols make one index
(mixed radix: `sum(sym_i * A**i)`, A = n_codes << (sign + low bits)), `bits` wide, packed little-endian in groups of
whole bytes. The escape decodes to exponent 0 (zeros, padding and subnormals cost no escape); every other escaped
element is listed (its position and its byte).

A piece's encoded bytes: [other byte planes: (elem - 1) x n][packed indices][pad to 4][positions: int32 x n_esc]
[escaped bytes: n_esc]. Decoding one piece (`decode_piece`): its encoded bytes copied into the decode scratch (they
lie in the slot's tail), the indices widened out of their groups (a copy, a broadcast shift, a mask; a plain copy for
byte-wide ones), one table gather writing whole words of `m` elements (their top bytes in place, the others zero)
straight into the slot, one strided copy of the other byte planes, a clamp and a scatter of the escapes: 6 to 8
torch ops. The table (2**bits words: any index a hostile stream holds is inside it) and the shift constants are
built once per code and device; the scratch is the caller's, reused (`DecodeScratch`).
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any

import torch

CHUNK_ELEMS = 1 << 22  # elements of one piece: what bounds the decode scratch
SUB_ELEMS = 1 << 18  # elements the encoder works on at a time (its temporaries stay in the cache: about 2 MiB)
ALLOWED_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14)  # index widths whose groups fill at most 8 bytes
MAX_BITS = 14  # the widest index (a table of 16K words)
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def group(bits: int) -> tuple[int, int]:
    """(indices, bytes) of the smallest run of `bits`-wide indices that fills whole bytes."""
    g = 8 // math.gcd(bits, 8)
    return g, g * bits // 8


def layout_of(elem: int, m: int, bits: int, n_esc: int, nbytes: int) -> tuple[int, int, int, int]:
    """(count of indices, packed bytes, where the positions start, encoded size) of a coded piece."""
    n = nbytes // elem
    count = n // m
    g, b = group(bits)
    packed = -(-count // g) * b
    head = (elem - 1) * n + packed
    pos = head + (-head) % 4
    return count, packed, pos, pos + 5 * n_esc


def piece_size(elem: int, m: int, bits: int, n_esc: int, nbytes: int) -> int:
    """Encoded bytes of a coded piece of `nbytes` raw bytes."""
    return layout_of(elem, m, bits, n_esc, nbytes)[3]


def options(elem: int, sbits: int, rbits: int) -> list[tuple[int, int, int]]:
    """(m, bits, n_codes) codes of a form: for every index width and elements per index, the most codes it holds."""
    lowbits, ebits = sbits + rbits, 8 - sbits - rbits
    out = []
    for m in (2, 4, 8):  # one element per index is never smaller than two (its indices: twice the scratch)
        if m * elem > 8:
            continue
        for bits in ALLOWED_BITS:
            a = int(round((1 << bits) ** (1.0 / m)))
            while a ** m > 1 << bits:
                a -= 1
            while (a + 1) ** m <= 1 << bits:
                a += 1
            n_codes = min(a >> lowbits, 1 << ebits)
            if n_codes >= 1 and (not out or (m, bits, n_codes) not in out):
                out.append((m, bits, n_codes))
    return out


def window_cover(hist: torch.Tensor, n_codes: int) -> torch.Tensor:
    """For every base, the elements its window of `n_codes - 1` exponents covers, exponent 0 left out (it costs no
    escape wherever the window lies)."""
    span = hist.numel()
    width = n_codes - 1
    if width <= 0:
        return torch.zeros(span, dtype=torch.int64)
    h = hist.clone()
    h[0] = 0
    doubled = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat([h, h]).cumsum(0)])
    return doubled[width:width + span] - doubled[:span]


def escapes(hist: torch.Tensor, n_codes: int, base: int) -> int:
    """Listed escapes of elements with this exponent histogram under a code (neither in the window nor zero)."""
    return int(hist.sum()) - int(hist[0]) - int(window_cover(hist, n_codes)[base])


def choose(hist: torch.Tensor, n: int, elem: int, sbits: int, rbits: int, m_ok: Any = None) -> tuple[int, int, int, int, int]:
    """(m, bits, n_codes, base, encoded bytes) of the smallest code for n elements with this exponent histogram;
    `m_ok(m)` says which element counts per index the run allows."""
    best = None
    for m, bits, n_codes in options(elem, sbits, rbits):
        if m_ok is not None and not m_ok(m):
            continue
        cover = window_cover(hist, n_codes)
        base = int(torch.argmax(cover))
        n_esc = n - int(hist[0]) - int(cover[base])
        size = (elem - 1) * n + -(-(n // m) * bits // 8) + 5 * n_esc
        key = (size, bits != 8, bits)
        if best is None or key < best[0]:
            best = (key, (m, bits, n_codes, base, size))
    return best[1]


def exponent_map(sbits: int, rbits: int) -> torch.Tensor:
    """For each top byte, its exponent bits (int64, to fold a byte histogram into an exponent one)."""
    t = torch.arange(256, dtype=torch.int64)
    return (t >> rbits) & ((1 << (8 - sbits - rbits)) - 1)


# ---------------------------------------------------------------------------------------------------------------
# encoding a piece (the CPU, while staging; the caller has chosen the code and sized the piece)
# ---------------------------------------------------------------------------------------------------------------


def _lookups(c: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, escape) tables of a code for the encoder: for every key (a top byte, or two elements' top bytes as a
    16-bit key where m > 1), its index (of m = 1 element, or of 2) and which of its elements are listed escapes."""
    key = ("enc", c.elem, c.sbits, c.rbits, c.n_codes, c.base, min(c.m, 2))
    found = _cached(key)
    if found is not None:
        return found
    ebits = 8 - c.sbits - c.rbits
    t = torch.arange(256, dtype=torch.int64)
    e = (t >> c.rbits) & ((1 << ebits) - 1)
    off = (e - c.base) & ((1 << ebits) - 1)
    code = off.clamp(max=c.n_codes - 1)
    low = t & ((1 << c.rbits) - 1)
    if c.sbits:
        low |= (t >> 7) << c.rbits
    sym = code + c.n_codes * low
    esc = ((off >= c.n_codes - 1) & (e != 0)).to(torch.uint8)
    if c.m > 1:  # pairs: key = t0 | t1 << 8
        a_sym = c.n_codes << (c.sbits + c.rbits)
        k = torch.arange(1 << 16, dtype=torch.int64)
        sym = sym[k & 255] + a_sym * sym[k >> 8]
        esc = esc[k & 255] | (esc[k >> 8] << 1)
    return _keep(key, (sym.to(torch.uint8 if int(sym.max()) < 256 else torch.int16), esc))


class _Work:
    """The encoder's temporaries for SUB_ELEMS elements, reused across sub-blocks (one set per thread)."""

    def __init__(self, n: int) -> None:  # n elements: n / 2 keys (pairs), at most n / 4 groups of indices
        self.n = n
        self.key = torch.empty(n // 2, dtype=torch.int32)
        self.idx = torch.empty(n // 2 + n // 4, dtype=torch.int16)
        self.esc = torch.empty(n // 2, dtype=torch.uint8)
        self.u8 = torch.empty(n // 2, dtype=torch.uint8)
        self.w64 = torch.empty(n // 4 + 1, dtype=torch.int64)
        self.t64 = torch.empty(n // 4 + 1, dtype=torch.int64)


_work_local = threading.local()


def _work(n: int) -> _Work:
    w = getattr(_work_local, "w", None)
    if w is None or w.n < n:
        w = _work_local.w = None  # the old one goes first
        w = _work_local.w = _Work(max(n, SUB_ELEMS))
    return w


SERIAL_ELEMS = 1 << 15  # sub-blocks this small run every torch op on the calling thread (under its parallel grain)


def encode_piece(raw: torch.Tensor, c: Any, out: torch.Tensor, sub: int = SUB_ELEMS) -> None:
    """Write piece `c` (a codec.Chunk of version 3) of the raw bytes `raw` (its `nbytes`, uint8) into `out` (its
    `size` encoded bytes). Table-driven: a key of each element's (or pair of elements') top bytes looks its index
    and its escapes up in tables of the code, so a sub-block costs a handful of passes whatever the code."""
    elem, m, bits = c.elem, c.m, c.bits
    n = c.nbytes // elem
    count, packed_n, pos_at, _ = layout_of(elem, m, bits, c.n_esc, c.nbytes)
    g, b = group(bits)
    a_pair = (c.n_codes << (c.sbits + c.rbits)) ** 2
    lut, esc_lut = _lookups(c)
    cols = raw.view(n, elem)
    if elem > 1:
        out[:(elem - 1) * n].view(elem - 1, n).copy_(cols[:, :elem - 1].t())
    packed = out[(elem - 1) * n:(elem - 1) * n + packed_n]
    out[(elem - 1) * n + packed_n:pos_at].zero_()
    found = 0
    step = sub - sub % (m * g * 2)
    for a in range(0, n, step):
        z = min(n, a + step) - a
        w = _work(z)
        top = cols[a:a + z, elem - 1]
        per = 2 if m > 1 else 1  # elements per key
        nk = z // per
        key = w.key[:nk] if nk <= w.key.numel() else torch.empty(nk, dtype=torch.int32)
        if per == 2:
            pairs = top.view(nk, 2)
            key.copy_(pairs[:, 1])
            key.bitwise_left_shift_(8)
            key.add_(pairs[:, 0])
        else:
            key.copy_(top)
        if c.n_esc:  # listed escapes: their keys' elements
            e = w.esc[:nk]
            torch.index_select(esc_lut, 0, key, out=e)
            hit = torch.nonzero(e).reshape(-1)
            if hit.numel():
                flags = e[hit].to(torch.int64)
                where = torch.cat([hit[(flags & 1) > 0] * per, hit[(flags & 2) > 0] * per + 1]).sort().values
                k = where.numel()
                if found + k > c.n_esc:
                    raise ValueError("more escapes than the histogram counted")
                out[pos_at + 4 * found:pos_at + 4 * (found + k)].copy_((where + a).to(torch.int32).view(torch.uint8))
                out[pos_at + 4 * c.n_esc + found:pos_at + 4 * c.n_esc + found + k].copy_(top[where])
                found += k
        j = a // m
        ni = z // m
        if bits == 8 and m <= 2 and lut.dtype == torch.uint8:  # the key's entry is the packed byte itself
            torch.index_select(lut, 0, key, out=packed[j:j + ni])
            continue
        idx = w.idx[:nk]
        if lut.dtype == torch.int16:
            torch.index_select(lut, 0, key, out=idx)
        else:
            idx.copy_(torch.index_select(lut, 0, key, out=w.u8[:nk]))
        if m > 2:  # pairs of pairs: idx = p0 + A**2 * p1 (+ A**4 * p2 ...)
            pv = idx.view(ni, m // 2)
            comb = w.idx[nk:nk + ni] if nk + ni <= w.idx.numel() else torch.empty(ni, dtype=torch.int16)
            comb.copy_(pv[:, m // 2 - 1])
            for i in range(m // 2 - 2, -1, -1):
                comb.mul_(a_pair).add_(pv[:, i])
            idx = comb
        if bits == 8:
            packed[j:j + ni].copy_(idx)
            continue
        groups = -(-ni // g)
        words = w.w64[:groups]
        iv = idx
        if groups * g != ni:  # the last group filled with zero indices
            iv = torch.cat([idx, idx.new_zeros(groups * g - ni)])
        iv = iv.view(groups, g)
        words.copy_(iv[:, 0])
        t64 = w.t64[:groups]
        for i in range(1, g):
            t64.copy_(iv[:, i])
            t64.bitwise_left_shift_(i * bits)
            words.bitwise_or_(t64)
        gj = j // g
        packed[gj * b:(gj + groups) * b].view(groups, b).copy_(words.view(torch.uint8).view(groups, 8)[:, :b])
    if found != c.n_esc:
        raise ValueError(f"{found} escapes found, {c.n_esc} counted")


# ---------------------------------------------------------------------------------------------------------------
# decoding a piece (on the device, on the transfer stream, after the copy)
# ---------------------------------------------------------------------------------------------------------------


_TABLES: "OrderedDict[tuple, Any]" = OrderedDict()  # (code, device) -> decode table; encoder lookups; shifts
_TABLE_LOCK = threading.Lock()
TABLE_CACHE_BYTES = 8 << 20  # the tables kept, least recently used dropped first (a long run meets many codes; a
# byte code's of 16-bit indices: 64K rows of m bytes)


def _cached(key: tuple) -> Any:
    with _TABLE_LOCK:
        found = _TABLES.get(key)
        if found is not None:
            _TABLES.move_to_end(key)
        return found


def _keep(key: tuple, value: Any) -> Any:
    """Cache `value` (a tensor or a tuple of them), dropping the least recently used past TABLE_CACHE_BYTES."""
    def size(v: Any) -> int:
        return sum(t.numel() * t.element_size() for t in (v if isinstance(v, tuple) else (v,)))
    with _TABLE_LOCK:
        _TABLES[key] = value
        total = sum(size(v) for v in _TABLES.values())
        while total > TABLE_CACHE_BYTES and len(_TABLES) > 1:
            _, old = _TABLES.popitem(last=False)
            total -= size(old)
    return value


def table(c: Any, device: torch.device) -> torch.Tensor:
    """For every index (2**bits of them), the word of its m elements: their top bytes in place, the other bytes zero,
    an escape's exponent 0; an index past the code's last gives a zero word (a hostile stream reads inside it)."""
    key = ("t", c.elem, c.sbits, c.rbits, c.n_codes, c.base, c.m, c.bits, str(device))
    found = _cached(key)
    if found is not None:
        return found
    ebits = 8 - c.sbits - c.rbits
    a_sym = c.n_codes << (c.sbits + c.rbits)
    v = torch.arange(1 << c.bits, dtype=torch.int64)
    word = torch.zeros_like(v)
    rest = v.clone()
    for i in range(c.m):
        sym = rest % a_sym
        rest //= a_sym
        code, low = sym % c.n_codes, sym // c.n_codes
        exp = torch.where(code < c.n_codes - 1, (code + c.base) & ((1 << ebits) - 1), torch.zeros_like(code))
        top = (exp << c.rbits) | (low & ((1 << c.rbits) - 1))
        if c.sbits:
            top |= (low >> c.rbits) << 7
        word |= top << (8 * (c.elem * i + c.elem - 1))
    word[v >= a_sym ** c.m] = 0
    return _keep(key, word.to(WORDS[c.m * c.elem]).to(device))  # narrowing keeps the low bytes


def _shifts(g: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = ("s", g, bits, dtype, str(device))
    found = _cached(key)
    if found is None:
        found = _keep(key, (torch.arange(g, dtype=torch.int64) * bits).to(dtype).to(device))
    return found


def _al(n: int) -> int:
    return -(-n // 16) * 16


def scratch_need(c: Any) -> int:
    """Scratch bytes the decode of piece `c` uses (its encoded bytes, the widened groups, the indices)."""
    if not c.coded:
        return _al(c.size)
    count, packed, _, size = layout_of(c.elem, c.m, c.bits, c.n_esc, c.nbytes)
    g, b = group(c.bits)
    groups = -(-count // g)
    wide = 0 if c.bits == 8 else groups * (4 if b <= 4 else 8)
    return _al(size) + _al(wide) + _al(groups * g * 4)


def decode_piece(c: Any, payload: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Decode piece `c`: `payload` its encoded bytes (in the slot's tail), `out` its raw bytes in the slot, `scratch`
    at least `scratch_need(c)` bytes on the same device."""
    elem, m, bits = c.elem, c.m, c.bits
    n = c.nbytes // elem
    count, packed_n, pos_at, size = layout_of(elem, m, bits, c.n_esc, c.nbytes)
    sp = scratch[:size]
    sp.copy_(payload)  # read before the slot is written over them
    lows = (elem - 1) * n
    at = _al(size)
    g, b = group(bits)
    if bits == 8:
        idx = scratch[at:at + 4 * count].view(torch.int32)
        idx.copy_(sp[lows:lows + count])
    else:
        groups = -(-count // g)
        wb = 4 if b <= 4 else 8
        wdt = WORDS[wb]
        wide = scratch[at:at + groups * wb]
        wide.view(groups, wb)[:, :b].copy_(sp[lows:lows + groups * b].view(groups, b))
        at += _al(groups * wb)
        spread = scratch[at:at + 4 * groups * g].view(torch.int32).view(groups, g)
        torch.bitwise_right_shift(wide.view(wdt).view(groups, 1), _shifts(g, bits, wdt, out.device), out=spread)
        spread.bitwise_and_((1 << bits) - 1)
        idx = spread.view(-1)[:count]
    torch.index_select(table(c, out.device), 0, idx, out=out.view(WORDS[m * elem]))
    cols = out.view(n, elem)
    if elem > 1:
        cols[:, :elem - 1].copy_(sp[:lows].view(elem - 1, n).t())
    if c.n_esc:
        where = sp[pos_at:pos_at + 4 * c.n_esc].view(torch.int32)
        where.clamp_(0, n - 1)  # never past the piece, whatever the stream says
        cols[:, elem - 1].index_put_((where,), sp[pos_at + 4 * c.n_esc:size])


class DecodeScratch:
    """One device's decode scratch, reused by every decode on it (grown when a larger piece comes); `lock` is held
    while a decode uses it (decodes on one transfer stream run in the order they were queued)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buf: dict[str, torch.Tensor] = {}

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        key = str(device)
        buf = self._buf.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._buf[key] = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buf.values())
