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
other byte planes follow as strided copies and the escapes as a scatter (`chunk_decode.decode_chunk`).

A unit's buffer is cut into chunks that tile it in order (`Chunk`): a coded chunk per run of at most
`CHUNK_ELEMS` elements of a floating or byte dtype where coding pays, raw chunks for the rest (padding, small
tensors, bytes that do not compress). No chunk is larger encoded than raw, so the encoded bytes can be copied into
the TAIL of the unit's own slot and decoded forward into it in place (`decode_into`): the device needs no staging
buffer of its own, only the decode's scratch (`decode_scratch_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .chunk_decode import bytes_to_int, decode_chunk

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


# ---------------------------------------------------------------------------------------------------------------
# the stored form of a unit's chunks (a packed model's index, `pack --compress`): untrusted when read back
# ---------------------------------------------------------------------------------------------------------------

_FIELDS = ("dst", "nbytes", "src", "size", "elem", "sbits", "rbits", "k", "base", "n_esc")
_CODED_FORMS = {(e, s, r) for e, s, r in _FORMS.values()}
MAX_CHUNKS = 1 << 20  # far more than any unit (CHUNK_ELEMS elements each) has


def chunks_to_list(chunks: Iterable[Chunk]) -> list[list[int]]:
    """The chunks as plain lists of integers (JSON), in `_FIELDS` order."""
    return [[getattr(c, f) for f in _FIELDS] for c in chunks]


def coded_size(elem: int, sbits: int, rbits: int, k: int, n_esc: int, nbytes: int) -> int:
    """Encoded bytes of a coded chunk of `nbytes` raw bytes: the other bytes' planes, the packed fields, escapes."""
    n = nbytes // elem
    return (elem - 1) * n + ((n + 7) // 8) * (sbits + rbits + k) + n_esc * ESCAPE_BYTES


def chunks_from_list(value: object, nbytes: int, size: int) -> tuple[Chunk, ...]:
    """Chunks read back from a stored index, checked so that decoding them can only write inside the unit's
    `nbytes` raw bytes and read inside its `size` encoded bytes (`decode_into`'s invariants): raw ranges tile
    [0, nbytes) in order, encoded ranges tile [0, size) in order, no chunk larger encoded than raw, every coded
    chunk of a form the codec writes with its exact encoded size. Raises ValueError saying what is wrong."""
    if not isinstance(value, list) or len(value) > MAX_CHUNKS:
        raise ValueError("'chunks' is not a list of chunks")
    out: list[Chunk] = []
    dst = src = 0
    for i, item in enumerate(value):
        if (not isinstance(item, list) or len(item) != len(_FIELDS)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)):
            raise ValueError(f"chunk {i} is not {len(_FIELDS)} whole numbers >= 0 ({', '.join(_FIELDS)})")
        c = Chunk(*item)
        if c.dst != dst or c.src != src or c.nbytes <= 0 or c.size > c.nbytes:
            raise ValueError(f"chunk {i} does not follow the one before it (raw bytes at {c.dst}, encoded at {c.src}; "
                             f"expected {dst} and {src}) or is larger encoded than raw")
        if c.coded:
            ebits = 8 - c.sbits - c.rbits
            if ((c.elem, c.sbits, c.rbits) not in _CODED_FORMS or not 1 <= c.k <= ebits or c.base >= 1 << ebits
                    or c.nbytes % c.elem or c.n_esc > c.nbytes // c.elem
                    or c.size != coded_size(c.elem, c.sbits, c.rbits, c.k, c.n_esc, c.nbytes)):
                raise ValueError(f"chunk {i} is not a chunk the codec writes (form, code width, base, escapes or "
                                 f"size)")
        elif any((c.sbits, c.rbits, c.k, c.base, c.n_esc)) or c.size != c.nbytes:
            raise ValueError(f"chunk {i} is a raw chunk with coding parameters or another size")
        out.append(c)
        dst, src = dst + c.nbytes, src + c.size
    if dst != nbytes or src != size:
        raise ValueError(f"the chunks cover {dst} raw and {src} encoded bytes, the unit has {nbytes} and {size}")
    return tuple(out)


def check_escapes(enc: Encoded) -> None:
    """Every escape position of a stored unit lies inside its chunk (checked on the CPU where a unit read from an
    untrusted file is first decoded; the device decode also clamps them). Raises ValueError."""
    for c in enc.chunks:
        if c.coded and c.n_esc:
            n = c.nbytes // c.elem
            start = c.src + c.size - ESCAPE_BYTES * c.n_esc
            where = bytes_to_int(enc.blob[start:start + 4 * c.n_esc].view(c.n_esc, 4), 4)
            if int(where.max()) >= n:
                raise ValueError(f"an escape of the chunk at raw byte {c.dst} points past its {n} elements")


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
                decode_chunk(c, payload, out, overlaps=a < c.dst + c.nbytes)
            else:
                out.copy_(payload.clone() if a < c.dst + c.nbytes else payload)


def decode(enc: Encoded, device: torch.device | str = "cpu") -> torch.Tensor:
    """The raw bytes of an encoded unit as a new uint8 tensor on `device` (tests, leaf copies of a compressed unit)."""
    buf = torch.empty(enc.nbytes, dtype=torch.uint8, device=device)
    buf[enc.nbytes - enc.size:].copy_(enc.blob)
    decode_into(buf, enc.chunks, enc.nbytes, enc.size)
    return buf
