"""The lossless host form of a unit's bytes ("expwin"): encoded once on the CPU, decoded on the device with a few
torch ops any backend runs.

Trained weights carry little information in their exponents. For every element, the byte holding the sign and the
(top of the) exponent is split from the others: the other bytes are stored raw, planar; the exponent bits of that
byte become a `k`-bit code over a window of the `2**k - 1` most frequent consecutive exponent values (`base`...),
the last code an escape whose byte is kept in a short list (positions and values); the sign and the exponent byte's
remaining low bits (fp16's, fp8's mantissa bits) ride along raw in the same field. A field is `q = sign + low + k`
bits, eight fields packed into `q` bytes. Decoding is one table gather per chunk: the fields one index covers (a
packed byte, or a pair cut from a whole-byte group of straddling fields by a shift, an or and a mask) index a small
table of their elements' words, top bytes in place and the other bytes zero, written straight into the slot; the
other byte planes follow as strided copies and the escapes as a scatter (`_decode_coded`).

A unit's buffer is cut into chunks that tile it in order (`Chunk`): a coded chunk per run of at most
`CHUNK_ELEMS` elements of a floating or byte dtype where coding pays, raw chunks for the rest (padding, small
tensors, bytes that do not compress). No chunk is larger encoded than raw, so the encoded bytes can be copied into
the TAIL of the unit's own slot and decoded forward into it in place (`decode_into`): the device needs no staging
buffer of its own, only the decode's scratch (`decode_scratch_bytes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

CODEC = "expwin"  # the name reports carry in `compression`
CHUNK_ELEMS = 1 << 22  # elements coded (and decoded) together: bounds the decode scratch, amortizes launches
MIN_CODED_BYTES = 4096  # smaller tensors stay raw (a few kernel launches cost more than they save)
PAYS = 0.97  # a chunk is coded only below this share of its raw size
UNIT_PAYS = 0.95  # a unit is held compressed only below this share of its raw size
ESCAPE_BYTES = 5  # an escape's cost: its position (4 bytes) and its byte

# element size, sign bits and low (raw) bits of the byte holding the sign and the exponent's top
_FORMS: dict[torch.dtype, tuple[int, int, int]] = {
    torch.bfloat16: (2, 1, 0),
    torch.float16: (2, 1, 2),
    torch.float32: (4, 1, 0),
    torch.uint8: (1, 0, 0),
    torch.int8: (1, 0, 0),
}
for _name, _form in (("float8_e4m3fn", (1, 1, 3)), ("float8_e5m2", (1, 1, 2)), ("float8_e4m3fnuz", (1, 1, 3)),
                     ("float8_e5m2fnuz", (1, 1, 2))):
    if hasattr(torch, _name):
        _FORMS[getattr(torch, _name)] = _form


def codable(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` may be coded (others are held raw)."""
    return dtype in _FORMS


@dataclass(frozen=True)
class Chunk:
    """One run of a unit's raw bytes [dst, dst + nbytes) and where its encoded form lies in the blob [src, +size)."""

    dst: int
    nbytes: int
    src: int
    size: int
    elem: int = 0  # element size in bytes (0: a raw chunk)
    sbits: int = 0
    rbits: int = 0
    k: int = 0
    base: int = 0
    n_esc: int = 0

    @property
    def coded(self) -> bool:
        return self.elem > 0

    @property
    def q(self) -> int:
        return self.sbits + self.rbits + self.k


@dataclass
class Encoded:
    """A unit's bytes in the compressed host form: the blob and how it maps onto the raw buffer."""

    blob: torch.Tensor  # uint8, the chunks' encoded bytes one after another
    chunks: tuple[Chunk, ...]
    nbytes: int  # raw bytes of the unit

    @property
    def size(self) -> int:
        return int(self.blob.numel())

    @property
    def ratio(self) -> float:
        return self.size / self.nbytes if self.nbytes else 1.0


# ---------------------------------------------------------------------------------------------------------------
# encoding (CPU, once, while staging)
# ---------------------------------------------------------------------------------------------------------------


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _split(raw: torch.Tensor, elem: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the top byte of every element, the other bytes as planes from the lowest), by shifts of whole elements
    (contiguous ops, no strided byte copies)."""
    if elem == 1:
        return raw, []
    if raw.storage_offset() % elem:
        raw = raw.clone()  # an unaligned run (no layout makes one; the codec takes it anyway)
    x = raw.view(_INT[elem])
    top = (x >> (8 * (elem - 1))).to(torch.uint8)
    return top, [(x >> (8 * j)).to(torch.uint8) for j in range(elem - 1)]


def _pack_fields(field: torch.Tensor, q: int) -> torch.Tensor:
    """Fields of q bits (uint8, a multiple of 8 of them) packed eight to q bytes, little-endian."""
    if 8 % q == 0:  # whole fields per byte: uint8 ops only
        per = 8 // q
        cols = field.view(-1, per)
        packed = cols[:, 0].clone()
        for m in range(1, per):
            packed |= cols[:, m] << (m * q)
        return packed
    groups = field.view(-1, 8).to(torch.int64)
    word = groups[:, 0].clone()
    for i in range(1, 8):
        word |= groups[:, i] << (q * i)
    return word.view(torch.uint8).view(-1, 8)[:, :q].reshape(-1)


def _unpack_fields(packed: torch.Tensor, q: int, n: int) -> torch.Tensor:
    """The inverse of `_pack_fields`: n fields (uint8, masked to q bits)."""
    mask = (1 << q) - 1
    if 8 % q == 0:
        per = 8 // q
        if per == 1:
            return packed[:n]
        parts = [(packed >> (m * q)) & mask for m in range(per)]
        return torch.stack(parts, dim=1).reshape(-1)[:n]
    groups = packed.numel() // q
    wide = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    wide[:, :q] = packed.view(groups, q)
    word = wide.view(torch.int64).reshape(-1)
    parts = [(word >> (q * i)).to(torch.uint8) for i in range(8)]
    return (torch.stack(parts, dim=1).reshape(-1)[:n]) & mask


def _best_window(hist: torch.Tensor, ebits: int, n: int, fixed_bits: int) -> tuple[int, int, int, int]:
    """(k, base, escapes, encoded bytes) minimizing the coded size of a chunk with this exponent histogram."""
    span = 1 << ebits
    doubled = torch.cat([hist, hist]).cumsum(0)
    doubled = torch.cat([torch.zeros(1, dtype=doubled.dtype), doubled])
    best = None
    for k in range(1, ebits + 1):
        width = (1 << k) - 1
        covered = doubled[width:width + span] - doubled[:span]  # window starting at each base (cyclic)
        base = int(torch.argmax(covered))
        esc = n - int(covered[base])
        q = fixed_bits + k
        size = ((n + 7) // 8) * q + esc * ESCAPE_BYTES
        if best is None or size < best[3]:
            best = (k, base, esc, size)
    return best


def _code_chunk(raw: torch.Tensor, elem: int, sbits: int, rbits: int) -> tuple[dict, list[torch.Tensor]] | None:
    """The coded form of one chunk (`raw`: its bytes), or None when coding would not pay."""
    n = raw.numel() // elem
    ebits = 8 - sbits - rbits
    emask = (1 << ebits) - 1
    h, low = _split(raw, elem)
    e = (h >> rbits) & emask if rbits else (h & emask if sbits else h)
    hist = torch.bincount(e.reshape(-1), minlength=1 << ebits)
    k, base, n_esc, coded = _best_window(hist, ebits, n, sbits + rbits)
    total = (elem - 1) * n + coded
    if total >= PAYS * raw.numel():
        return None
    width = (1 << k) - 1
    off = (e - base) & emask  # uint8 arithmetic wraps: the window may wrap around too
    field = torch.clamp(off, max=width)  # past the window: the escape code
    if rbits:
        field |= (h & ((1 << rbits) - 1)) << k
    if sbits:
        field |= (h >> 7) << (k + rbits)
    q = sbits + rbits + k
    pad = (-n) % 8
    if pad:
        field = torch.cat([field, field.new_zeros(pad)])
    parts = list(low)  # the other bytes, planar, lowest first
    parts.append(_pack_fields(field, q))
    if n_esc:
        pos = torch.nonzero(off >= width).reshape(-1)
        parts.append(pos.to(torch.int32).view(torch.uint8))
        parts.append(h[pos])
    params = dict(elem=elem, sbits=sbits, rbits=rbits, k=k, base=base, n_esc=n_esc)
    return params, parts


def _runs(layout_leaves: Iterable, nbytes: int) -> list[tuple[int, int, torch.dtype | None]]:
    """The unit's bytes cut into runs in order: (start, end, dtype) for coded candidates, dtype None for raw."""
    runs: list[tuple[int, int, torch.dtype | None]] = []
    pos = 0
    for leaf in sorted(layout_leaves, key=lambda lf: lf.offset):
        form = _FORMS.get(leaf.dtype)
        if form is None or leaf.nbytes < MIN_CODED_BYTES or leaf.offset < pos:
            continue
        if leaf.offset > pos:
            runs.append((pos, leaf.offset, None))
        step = CHUNK_ELEMS * form[0]
        for start in range(leaf.offset, leaf.offset + leaf.nbytes, step):
            runs.append((start, min(leaf.offset + leaf.nbytes, start + step), leaf.dtype))
        pos = leaf.offset + leaf.nbytes
    if pos < nbytes:
        runs.append((pos, nbytes, None))
    return runs


runs_of = _runs  # how the encoder cuts a unit (the most chunks it can give: a shared copy's header room)


def valid_params(c: Chunk) -> bool:
    """Whether a coded chunk's parameters are ones the encoder gives, its encoded size theirs (a chunk table read
    from outside: a shared copy's header)."""
    forms = {(e, s, r) for e, s, r in _FORMS.values()}
    if (c.elem, c.sbits, c.rbits) not in forms or c.nbytes % c.elem or not 1 <= c.k <= 8 - c.sbits - c.rbits:
        return False
    n = c.nbytes // c.elem
    ebits = 8 - c.sbits - c.rbits
    return (0 <= c.base < 1 << ebits and 0 <= c.n_esc <= n
            and c.size == (c.elem - 1) * n + (n + 7) // 8 * c.q + ESCAPE_BYTES * c.n_esc)


def encode(raw: torch.Tensor, leaves: Iterable) -> Encoded:
    """Encode a unit's flat host buffer (`raw`, uint8 on the CPU) whose tensors lie at `leaves` (layout leaves:
    offset, nbytes, dtype). Chunks whose coding does not pay stay raw; raw neighbours merge."""
    nbytes = int(raw.numel())
    chunks: list[Chunk] = []
    parts: list[torch.Tensor] = []
    src = 0
    pending: tuple[int, int] | None = None  # a raw run not written yet (merged with raw neighbours)

    def flush() -> None:
        nonlocal src, pending
        if pending is not None:
            a, b = pending
            chunks.append(Chunk(a, b - a, src, b - a))
            parts.append(raw[a:b])
            src += b - a
            pending = None

    for a, b, dtype in _runs(leaves, nbytes):
        coded = None
        if dtype is not None:
            elem, sbits, rbits = _FORMS[dtype]
            coded = _code_chunk(raw[a:b], elem, sbits, rbits)
        if coded is None:
            pending = (pending[0], b) if pending is not None else (a, b)
            continue
        flush()
        params, pieces = coded
        size = sum(int(p.numel()) for p in pieces)
        chunks.append(Chunk(a, b - a, src, size, **params))
        parts.extend(pieces)
        src += size
    flush()
    blob = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.empty(0, dtype=torch.uint8)
    return Encoded(blob, tuple(chunks), nbytes)


def estimate_size(raw: torch.Tensor, leaves: Iterable, sample_elems: int = 1 << 16) -> int:
    """The encoded size of a unit, estimated from an evenly spaced sample of each codable tensor (what the plan
    decides with before anything is encoded)."""
    nbytes = int(raw.numel())
    total = 0
    for a, b, dtype in _runs(leaves, nbytes):
        if dtype is None:
            total += b - a
            continue
        elem, sbits, rbits = _FORMS[dtype]
        n = (b - a) // elem
        step = max(1, n // sample_elems)
        sample = raw[a:b].view(-1, elem)[::step].reshape(-1)
        coded = _code_chunk(sample.contiguous(), elem, sbits, rbits)
        if coded is None:
            total += b - a
        else:
            ratio = sum(int(p.numel()) for p in coded[1]) / sample.numel()
            total += min(b - a, int((b - a) * ratio * 1.01) + 64)
    return total


def estimate_by_dtype(leaves: Iterable, nbytes: int) -> int:
    """The encoded size of a unit whose bytes are not in RAM yet (a model loaded from its file), from its dtypes:
    what weights drawn like trained ones give (bf16 0.76, fp16 0.89, fp8 0.88, fp32 0.88 of raw)."""
    ratios = {torch.bfloat16: 0.76, torch.float16: 0.89, torch.float32: 0.88}
    total = nbytes
    for leaf in leaves:
        r = ratios.get(leaf.dtype, 0.88 if str(leaf.dtype).startswith("torch.float8") else 1.0)
        if leaf.nbytes >= MIN_CODED_BYTES and r < 1.0:
            total -= int(leaf.nbytes * (1 - r))
    return total


# ---------------------------------------------------------------------------------------------------------------
# decoding (on the device, after the copy)
# ---------------------------------------------------------------------------------------------------------------


SCRATCH_PER_ELEM = 6  # decode temporaries per element of a coded chunk: the unpacked fields and their steps


def decode_scratch_bytes(chunks: Iterable[Chunk]) -> int:
    """Device bytes the decode of these chunks holds at its peak besides the slot (its temporaries)."""
    peak = 0
    for c in chunks:
        n = c.nbytes // c.elem if c.coded else 0
        peak = max(peak, c.size + SCRATCH_PER_ELEM * n)
    return peak


def scratch_estimate(leaves: Iterable) -> int:
    """`decode_scratch_bytes` before encoding, from the largest chunk these leaves can give."""
    peak = 0
    for leaf in leaves:
        form = _FORMS.get(leaf.dtype)
        if form is not None and leaf.nbytes >= MIN_CODED_BYTES:
            n = min(CHUNK_ELEMS, leaf.nbytes // form[0])
            peak = max(peak, n * form[0] + SCRATCH_PER_ELEM * n)
    return peak


def _bytes_to_int(b: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned integers from a (count, width) uint8 tensor, as int64 (zero-extended to 8 bytes)."""
    wide = torch.zeros(b.shape[0], 8, dtype=torch.uint8, device=b.device)
    wide[:, :width] = b
    return wide.view(torch.int64).reshape(-1)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLES: dict[tuple, torch.Tensor] = {}  # (chunk parameters, fields per index, device) -> table (bounded)
TABLE_BITS = 14  # the widest index a table takes (16K words: stays in the cache)


def _group(q: int) -> tuple[int, int]:
    """(fields, bytes) of the smallest run of q-bit fields that fills whole bytes: 8 // q fields in one byte where
    q divides 8, four 6-bit fields in three bytes, eight odd-width fields in q bytes."""
    g = 8 // math.gcd(q, 8)
    return g, g * q // 8


def _per_index(c: Chunk) -> int:
    """Fields one table index covers: a whole group where it fits TABLE_BITS (a packed byte, for q dividing 8),
    else as many of it as keep the index within TABLE_BITS; the word of their elements at most 8 bytes (0: none)."""
    g, b = _group(c.q)
    for f in (8, 4, 2, 1):
        if g % f == 0 and f * c.q <= TABLE_BITS and f * c.elem <= 8 and (b == 1 and f == g or g // f % 2 == 0):
            return f
    return 0


def _table(c: Chunk, f: int, device: torch.device) -> torch.Tensor:
    """For every index of f fields, the raw little-endian word of their f elements with every byte but the
    elements' top bytes zero (the escape code maps to any byte: the escapes are scattered after)."""
    key = (c.elem, c.sbits, c.rbits, c.k, c.base, f, str(device))
    table = _TABLES.get(key)
    if table is None:
        v = torch.arange(1 << (f * c.q), dtype=torch.int64, device=device)  # built where it is used
        word = torch.zeros_like(v)
        ebits, mask = 8 - c.sbits - c.rbits, (1 << c.q) - 1
        for m in range(f):
            field = (v >> (m * c.q)) & mask
            top = (((field & ((1 << c.k) - 1)) + c.base) & ((1 << ebits) - 1)) << c.rbits
            top |= (field >> c.k) & ((1 << c.rbits) - 1)
            if c.sbits:
                top |= ((field >> (c.k + c.rbits)) & 1) << 7
            word |= top << (8 * (c.elem * m + c.elem - 1))
        if len(_TABLES) > 64:
            _TABLES.clear()
        table = _TABLES[key] = word.to(_WORDS[f * c.elem])  # narrowing keeps the low bytes
    return table


def _indices(packed: torch.Tensor, c: Chunk, f: int, n: int) -> torch.Tensor:
    """The table indices of n elements' fields, f fields each, in element order (int32). Where fields straddle
    bytes, each group of them that fills whole bytes (at most 7) is widened into an int64 word, and each pair of
    its indices is spread into the two int32 halves of a word by one shift, an or and a mask (no strided writes)."""
    g, b = _group(c.q)
    groups = n // g
    if b == 1 and f == g:  # the packed byte is the index
        return packed[:groups].to(torch.int32)
    wide = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    wide[:, :b] = packed[:groups * b].view(groups, b)
    word = wide.view(torch.int64)  # (groups, 1): the group's fields, zero-extended
    bits = f * c.q
    mask = (1 << bits) - 1
    pairs = []
    for h in range(g // f // 2):
        x = word if b * 8 <= 2 * bits else torch.bitwise_right_shift(word, 2 * bits * h).bitwise_and_(
            (1 << 2 * bits) - 1)  # the pair's fields alone
        pairs.append(torch.bitwise_left_shift(x, 32 - bits).bitwise_or_(x).bitwise_and_(mask | mask << 32))
        del x
    spread = pairs[0] if len(pairs) == 1 else torch.cat(pairs, dim=1)
    return spread.view(torch.int32).reshape(-1)


def _table_fits(c: Chunk, f: int, out: torch.Tensor) -> bool:
    """Whether the table path applies: whole words of f elements (whole groups of eight where fields straddle
    bytes) at an offset the word type can view."""
    n = c.nbytes // c.elem
    return f > 0 and n % _group(c.q)[0] == 0 and out.storage_offset() % (f * c.elem) == 0


def _decode_coded(c: Chunk, payload: torch.Tensor, out: torch.Tensor, overlaps: bool = False) -> None:
    """One coded chunk: `payload` its encoded bytes, `out` its raw bytes (both on the device; `overlaps`: the
    payload lies inside `out`, so what is read after `out` is written is copied first). The top bytes go straight
    into place by one table gather (fields decoded into words with every other byte zero), the other bytes are
    strided copies of their planes, the escapes a scatter; chunks the table cannot take decode field by field."""
    elem, q = c.elem, c.q
    n = c.nbytes // elem
    pos = (elem - 1) * n
    packed = payload[pos:pos + (n + 7) // 8 * q]
    pos += packed.numel()
    esc = payload[pos:pos + 5 * c.n_esc]
    f = _per_index(c)
    cols = out.view(-1, elem)
    if _table_fits(c, f, out):
        idx = _indices(packed, c, f, n)
        lows = payload[:pos - packed.numel()]
        if overlaps:
            lows, esc = lows.clone(), esc.clone()
        torch.index_select(_table(c, f, out.device), 0, idx, out=out.view(_WORDS[f * elem]))
        del idx
    else:
        if overlaps:
            payload = payload.clone()
            packed, esc = payload[packed_at(c):packed_at(c) + packed.numel()], payload[pos:pos + 5 * c.n_esc]
        lows = payload[:(elem - 1) * n]
        cols[:, elem - 1].copy_(_unpack_top(packed, c, n))
    for j in range(elem - 1):
        cols[:, j].copy_(lows[j * n:(j + 1) * n])
    if c.n_esc:
        where = _bytes_to_int(esc[:4 * c.n_esc].view(c.n_esc, 4), 4)
        cols[:, elem - 1].index_put_((where,), esc[4 * c.n_esc:])


def packed_at(c: Chunk) -> int:
    """Where a coded chunk's packed fields start in its encoded bytes (after its raw planes)."""
    return (c.elem - 1) * (c.nbytes // c.elem)


def _unpack_top(packed: torch.Tensor, c: Chunk, n: int) -> torch.Tensor:
    """The top bytes of n elements from fields that straddle bytes (uint8, escapes not yet in place)."""
    k = c.k
    field = _unpack_fields(packed, c.q, n)
    top = field.bitwise_and((1 << k) - 1).add_(c.base).bitwise_and_((1 << (8 - c.sbits - c.rbits)) - 1)
    if c.rbits:
        top.bitwise_left_shift_(c.rbits).bitwise_or_(field.bitwise_right_shift(k).bitwise_and_((1 << c.rbits) - 1))
    if c.sbits:
        top.bitwise_or_(field.bitwise_right_shift(k + c.rbits).bitwise_left_shift_(7))
    return top


def decode_into(buf: torch.Tensor, chunks: Iterable[Chunk], nbytes: int, size: int) -> None:
    """Decode in place: `buf[nbytes - size:nbytes]` holds the encoded blob (copied there), `buf[:nbytes]` gets the
    raw bytes. Chunks go in order; a chunk whose encoded bytes overlap its output is read into scratch first (no
    chunk's output reaches the encoded bytes of a later chunk: none is larger encoded than raw)."""
    tail = nbytes - size
    with torch.inference_mode():  # a slot may be an inference tensor (allocated under inference mode)
        for c in chunks:
            a = tail + c.src
            if not c.coded and a == c.dst:
                continue  # already in place
            payload = buf[a:a + c.size]
            out = buf[c.dst:c.dst + c.nbytes]
            if c.coded:
                _decode_coded(c, payload, out, overlaps=a < c.dst + c.nbytes)
            else:
                out.copy_(payload.clone() if a < c.dst + c.nbytes else payload)


def decode(enc: Encoded, device: torch.device | str = "cpu") -> torch.Tensor:
    """The raw bytes of an encoded unit as a new uint8 tensor on `device` (tests, leaf copies of a compressed unit)."""
    buf = torch.empty(enc.nbytes, dtype=torch.uint8, device=device)
    buf[enc.nbytes - enc.size:].copy_(enc.blob)
    decode_into(buf, enc.chunks, enc.nbytes, enc.size)
    return buf
