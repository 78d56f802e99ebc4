"""The codec's version 2 encoder ("expwin" chunks of one tensor each, a k-bit window code per chunk): what packed
folders of index version 2 hold. The engine writes version 3 (`unit_code.py`) and still READS version 2 (its decode:
`chunk_decode.py`); this encoder is kept so that the version 2 decode stays tested on every field width."""
from __future__ import annotations

from typing import Iterable

import torch

from .codec_forms import _FORMS, Chunk, Encoded

CHUNK_ELEMS = 1 << 22  # elements coded (and decoded) together
MIN_CODED_BYTES = 4096  # smaller tensors stay raw
PAYS = 0.97  # a chunk is coded only below this share of its raw size
ESCAPE_BYTES = 5

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




def encode_v2(raw: torch.Tensor, leaves: Iterable) -> Encoded:
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


