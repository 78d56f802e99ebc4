"""The lossless host form of a unit's bytes ("expwin"): encoded once on the CPU, decoded on the device with a few
torch ops any backend runs.

Trained weights carry little information in their exponents. For every element, the byte holding the sign and the
(top of the) exponent is split from the others: the other bytes are stored raw, planar; the exponent bits of that
byte become one of a few codes over a window of the most frequent consecutive exponents (the last code an escape,
decoded as exponent 0; other escaped bytes are listed), the sign and low bits riding along.

Version 3 (what this engine writes, `unit_code.py`): a unit is cut into runs, one per dtype (its layout groups its
tensors by dtype, `layout.plan_layout`, so all its tensors of one dtype and the padding between them are one run),
each coded as ONE stream with one code chosen from the run's exponent histogram, cut into pieces only where the
decode scratch requires (`unit_code.CHUNK_ELEMS` elements); so a unit's decode is a constant number of device ops
whatever its tensor count. Several codes are packed into one index (mixed radix), so a code needs no power-of-two
count. Version 2 (`chunk_decode.py`, a k-bit window per tensor chunk) is what packed folders of index version 2 hold:
still read and decoded, no longer written (`codec_v2.py` keeps its encoder for the tests).

`plan(raw, leaves)` cuts a unit and chooses its codes (one histogram pass) and gives every chunk's exact encoded
size, so the caller can place the blob (pinned, in the shared host copy) before `write(raw, chunks, blob)` fills it:
no second copy of the blob. `encode` does both. Chunks tile the unit's bytes in order and none is larger encoded
than raw, so the encoded bytes can be copied into the TAIL of the unit's own slot and decoded forward into it in
place (`decode_into`): the device needs only the decode scratch (`decode_scratch_bytes`), one per device, reused.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from . import byte_code, unit_code
from .chunk_decode import decode_chunk
from .chunk_lists import (FIELDS_V3, FIELDS_V4, MAX_CHUNKS, check_escapes, chunks_from_list,  # noqa: F401
                          chunks_to_list, coded_size, escape_span, list_version)
from .codec_forms import _FORMS, CODEC, ESCAPE_BYTES, Chunk, Encoded, codable  # noqa: F401
from ..model.layout import SMALL_LEAF
from .unit_code import CHUNK_ELEMS, DecodeScratch  # noqa: F401

MIN_RUN_BYTES = 2048  # a shorter run stays raw (its decode ops cost more than they save)
PAYS = 0.97  # a run (or a piece) is coded only below this share of its raw size
UNIT_PAYS = 0.95  # a unit is held compressed only below this share of its raw size


# ---------------------------------------------------------------------------------------------------------------
# cutting a unit into runs and pieces, choosing codes (one histogram pass), writing them
# ---------------------------------------------------------------------------------------------------------------


def runs(leaves: Iterable, nbytes: int) -> list[tuple[int, int, torch.dtype | None]]:
    """The unit's bytes [0, nbytes) cut into runs in order: (start, end, dtype) for a run of one codable dtype (its
    tensors with the padding between them, and after the last where it holds whole elements), dtype None for raw."""
    segs: list[list[Any]] = []
    pos = 0
    for leaf in sorted((lf for lf in leaves if lf.nbytes > 0), key=lambda lf: lf.offset):
        a, b = leaf.offset, leaf.offset + leaf.nbytes
        if a < pos or b > nbytes:
            continue  # overlapping or past the buffer: whatever holds these bytes stays raw
        form = _FORMS.get(leaf.dtype)
        dtype = leaf.dtype if form is not None and a % form[0] == 0 and leaf.nbytes % form[0] == 0 else None
        last = segs[-1] if segs else None
        if last is not None and dtype is not None and last[2] == dtype and (a - last[1]) % form[0] == 0:
            last[1] = b  # the padding between two tensors of one dtype: part of the run
        else:
            if last is not None and last[1] < a:  # padding: the run before takes it where it is whole elements
                if last[2] is not None and (a - last[1]) % _FORMS[last[2]][0] == 0:
                    last[1] = a
                else:
                    segs.append([last[1], a, None])
            elif last is None and a > 0:
                segs.append([0, a, None])
            segs.append([a, b, dtype])
        pos = b
    end = segs[-1][1] if segs else 0
    if end < nbytes:
        last = segs[-1] if segs else None
        if last is not None and last[2] is not None and (nbytes - end) % _FORMS[last[2]][0] == 0:
            last[1] = nbytes
        else:
            segs.append([end, nbytes, None])
    out: list[tuple[int, int, torch.dtype | None]] = []
    for a, b, dtype in segs:
        if dtype is not None and b - a < MIN_RUN_BYTES:
            dtype = None
        if out and out[-1][2] is None and dtype is None:
            out[-1] = (out[-1][0], b, None)
        else:
            out.append((a, b, dtype))
    return out


def max_chunks(leaves: Iterable, nbytes: int) -> int:
    """The most chunks `plan` can cut these leaves into (a shared copy's header room)."""
    total = 0
    for a, b, dtype in runs(list(leaves), nbytes):
        elem = _FORMS[dtype][0] if dtype is not None else 0
        piece = byte_code.PIECE_ELEMS if elem == 1 else CHUNK_ELEMS  # the byte code: a raw head and tail too
        total += 1 if dtype is None else 3 + (b - a) // (elem * piece)
    return total


def _hist(top: torch.Tensor) -> torch.Tensor:
    return torch.bincount(top, minlength=256)


def _coded_run(raw: torch.Tensor, a: int, b: int, dtype: torch.dtype, cut: int | None = None) -> list[Chunk] | None:
    """The pieces of one run of `dtype` under the smaller of the unit-wide code and (1-byte elements) the byte code,
    or None where neither pays."""
    best = _unit_coded_run(raw, a, b, dtype, cut)
    if _FORMS[dtype][0] == 1 and BYTE_CODE:
        bytewise = _byte_coded_run(raw, a, b, dtype)
        if bytewise is not None and (best is None or sum(c.size for c in bytewise) < sum(c.size for c in best)):
            best = bytewise
    return best


BYTE_CODE = True  # 1-byte runs may take the byte code (version 4); off: the unit-wide code only (its tests)


def _byte_coded_run(raw: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> list[Chunk] | None:
    """The pieces of one run of 1-byte elements under the byte code (`byte_code.py`), or None where it does not pay:
    pieces of `byte_code.PIECE_ELEMS` elements from a 4-byte boundary, the last few elements raw."""
    _, sbits, rbits = _FORMS[dtype]
    lead = (-a) % 4
    n = (b - a - lead) // byte_code.STEP * byte_code.STEP
    if n * 1 < MIN_RUN_BYTES:
        return None
    start = a + lead
    bounds = [(s, min(n, s + byte_code.PIECE_ELEMS)) for s in range(0, n, byte_code.PIECE_ELEMS)]
    hists = [_hist(raw[start + s:start + e]).tolist() for s, e in bounds]
    total = [sum(h[v] for h in hists) for v in range(256)]
    code = byte_code.choose(total)
    if code is None:
        return None
    smask, n_codes, m, bits, base, _ = code
    pieces = [Chunk(a, lead, 0, lead)] if lead else []
    for (s, e), h in zip(bounds, hists):
        n_esc = byte_code.escapes(h, smask, base, n_codes)
        psize = byte_code.piece_size(m, bits, n_esc, e - s)
        if psize < PAYS * (e - s):
            pieces.append(Chunk(start + s, e - s, 0, psize, 1, sbits, rbits, 0, base, n_esc, n_codes, m, bits, smask))
        else:
            pieces.append(Chunk(start + s, e - s, 0, e - s))
    if start + n < b:
        pieces.append(Chunk(start + n, b - start - n, 0, b - start - n))
    if sum(c.size for c in pieces) >= PAYS * (b - a):
        return None
    return pieces


def _unit_coded_run(raw: torch.Tensor, a: int, b: int, dtype: torch.dtype, cut: int | None = None) -> list[Chunk] | None:
    """The pieces of one run of `dtype` (src 0: placed by `plan`), or None where coding it does not pay. A run that
    starts off a word boundary (8 bytes) keeps its first elements raw: the decode writes whole words. `cut`: where
    the run's tail of small tensors starts (laid out last, `layout.group_by_dtype`); that tail is kept raw where the
    run codes smaller without it (a window that fits the large tensors may not fit a norm's weights)."""
    elem, sbits, rbits = _FORMS[dtype]
    lead = (-a) % 8
    if lead:
        rest = _unit_coded_run(raw, a + lead, b, dtype, cut) if b - a - lead >= MIN_RUN_BYTES else None
        return None if rest is None else [Chunk(a, lead, 0, lead)] + rest
    n = (b - a) // elem
    if n % 8:  # whole words of any code: the last few elements raw
        end = b - (n % 8) * elem
        rest = (_unit_coded_run(raw, a, end, dtype, cut if cut is not None and cut < end else None)
                if end - a >= MIN_RUN_BYTES else None)
        return None if rest is None else rest + [Chunk(end, b - end, 0, b - end)]
    top = raw[a:b].view(n, elem)[:, elem - 1]
    bounds = [(s, min(n, s + CHUNK_ELEMS)) for s in range(0, n, CHUNK_ELEMS)]
    fold = unit_code.exponent_map(sbits, rbits)
    span = 1 << (8 - sbits - rbits)

    def hist(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(span, dtype=torch.int64).index_add_(0, fold, _hist(t))

    hists = [hist(top[s:e]) for s, e in bounds]
    best = _pieces(a, n, bounds, hists, elem, sbits, rbits)
    k = (cut - a) // elem if cut is not None and a < cut < b and (cut - a) % (8 * elem) == 0 else None
    if k is not None and k >= bounds[-1][0] and (cut - a) >= MIN_RUN_BYTES:  # the small tail in the last piece
        tail = hist(top[k:])
        head = _pieces(a, k, bounds[:-1] + [(bounds[-1][0], k)], hists[:-1] + [hists[-1] - tail], elem, sbits,
                       rbits)
        if head is not None:
            head.append(Chunk(cut, b - cut, 0, b - cut))
            if best is None or sum(c.size for c in head) < sum(c.size for c in best):
                best = head
    return best


def _pieces(a: int, n: int, bounds: list[tuple[int, int]], hists: list[torch.Tensor], elem: int, sbits: int,
            rbits: int) -> list[Chunk] | None:
    """A run's pieces under the code its histograms choose (None where coding does not pay)."""
    bounds = [(s, e) for s, e in bounds if e > s]
    total = torch.stack(hists[:len(bounds)]).sum(0)
    m, bits, n_codes, base, size = unit_code.choose(total, n, elem, sbits, rbits)
    if size >= PAYS * n * elem:
        return None
    pieces: list[Chunk] = []
    for (s, e), h in zip(bounds, hists):
        whole = (e - s) - (e - s) % m
        dst, nb = a + s * elem, whole * elem
        if whole < e - s:  # a piece that ends mid-word: its whole words coded, the rest raw (the histogram counted
            return None if len(bounds) > 1 else _pieces(a, whole, [(s, s + whole)], [h], elem, sbits, rbits) \
                and None  # the elements of the last word: never more than m - 1; the caller keeps the run raw
        n_esc = unit_code.escapes(h, n_codes, base)
        psize = unit_code.piece_size(elem, m, bits, n_esc, nb)
        if psize < PAYS * nb:
            pieces.append(Chunk(dst, nb, 0, psize, elem, sbits, rbits, 0, base, n_esc, n_codes, m, bits))
        else:
            pieces.append(Chunk(dst, nb, 0, nb))
    return pieces


def _small_tail(leaves: list, a: int, b: int, dtype: torch.dtype) -> int | None:
    """Where the tensors of less than SMALL_LEAF bytes at the end of a run start (None: the run ends with a large
    one, or holds only small ones)."""
    inside = sorted((lf for lf in leaves if lf.dtype == dtype and a <= lf.offset < b and lf.nbytes),
                    key=lambda lf: lf.offset)
    j = len(inside)
    while j and inside[j - 1].nbytes < SMALL_LEAF:
        j -= 1
    return inside[j].offset if 0 < j < len(inside) else None


def plan(raw: torch.Tensor, leaves: Iterable) -> tuple[Chunk, ...]:
    """A unit's chunks with their exact encoded places (one histogram pass over its bytes; nothing written): `raw` is
    the unit's flat buffer (uint8, CPU), `leaves` its tensors' places (offset, nbytes, dtype). Raw neighbours merge."""
    nbytes = int(raw.numel())
    leaves = list(leaves)
    chunks: list[Chunk] = []
    for a, b, dtype in runs(leaves, nbytes):
        pieces = _coded_run(raw, a, b, dtype, _small_tail(leaves, a, b, dtype)) if dtype is not None else None
        chunks.extend(pieces if pieces is not None else [Chunk(a, b - a, 0, b - a)])
    out: list[Chunk] = []
    src = 0
    for c in chunks:
        if out and not c.coded and not out[-1].coded:
            last = out[-1]
            out[-1] = Chunk(last.dst, last.nbytes + c.nbytes, last.src, last.size + c.size)
        else:
            out.append(Chunk(**{**c.__dict__, "src": src}))
        src += c.size
    return tuple(out)


def encoded_size(chunks: Iterable[Chunk]) -> int:
    """The blob's bytes for these chunks."""
    return sum(c.size for c in chunks)


def write(raw: torch.Tensor, chunks: tuple[Chunk, ...], blob: torch.Tensor, serial: bool = False) -> Encoded:
    """Encode `raw` as `chunks` (from `plan`) into `blob` (uint8 of `encoded_size(chunks)` bytes, anywhere on the CPU:
    pinned, or the shared host copy). `serial`: in sub-blocks small enough that torch runs every op on this thread
    (a thread beside the model's own compute: no OpenMP team of its own to contend with it)."""
    sub = unit_code.SERIAL_ELEMS if serial else unit_code.SUB_ELEMS
    with torch.no_grad():
        for c in chunks:
            piece = raw[c.dst:c.dst + c.nbytes]
            out = blob[c.src:c.src + c.size]
            if c.coded and c.version == 4:
                byte_code.encode_piece(piece, c, out, byte_code.SERIAL_ELEMS if serial else byte_code.SUB_ELEMS)
            elif c.coded:
                unit_code.encode_piece(piece, c, out, sub)
            else:
                out.copy_(piece)
    return Encoded(blob, chunks, int(raw.numel()))


def encode(raw: torch.Tensor, leaves: Iterable) -> Encoded:
    """Encode a unit's flat host buffer (`raw`, uint8 on the CPU) whose tensors lie at `leaves` (layout leaves:
    offset, nbytes, dtype). Runs whose coding does not pay stay raw; raw neighbours merge."""
    chunks = plan(raw, leaves)
    return write(raw, chunks, torch.empty(encoded_size(chunks), dtype=torch.uint8))


def estimate_size(raw: torch.Tensor, leaves: Iterable, sample_elems: int = 1 << 16) -> int:
    """The encoded size of a unit, estimated from evenly spread runs of elements of each codable run (what the plan
    decides with before anything is encoded)."""
    nbytes = int(raw.numel())
    total = 0
    for a, b, dtype in runs(list(leaves), nbytes):
        if dtype is None:
            total += b - a
            continue
        elem = _FORMS[dtype][0]
        n = (b - a) // elem
        if n <= 2 * sample_elems:
            sample = raw[a:b]
        else:
            per, k = 512, max(1, sample_elems // 512)
            starts = torch.linspace(0, n - per, k).long()
            index = (starts[:, None] + torch.arange(per)[None, :]).reshape(-1)
            sample = raw[a:b].view(n, elem)[index].reshape(-1)
        pieces = _coded_run(sample.contiguous(), 0, sample.numel(), dtype)
        if pieces is None:
            total += b - a
        else:
            ratio = sum(c.size for c in pieces) / sample.numel()
            total += min(b - a, int((b - a) * ratio * 1.01) + 64)
    return total


def estimate_by_dtype(leaves: Iterable, nbytes: int) -> int:
    """The encoded size of a unit whose bytes are not in RAM yet (a model loaded from its file), from its dtypes:
    what weights drawn like trained ones give (bf16 0.76, fp16 0.89, fp32 0.88 of raw; per-tensor scaled fp8
    e4m3fn 0.92 and e5m2 0.80 under the byte code, docs/benchmarks.md); int8 and packed 4-bit payloads, which pay
    little or nothing, count as raw until their bytes are sampled (`compressed.estimate_layout_size`)."""
    ratios = {torch.bfloat16: 0.76, torch.float16: 0.89, torch.float32: 0.88}
    for name, r in (("float8_e4m3fn", 0.92), ("float8_e5m2", 0.80), ("float8_e4m3fnuz", 0.92),
                    ("float8_e5m2fnuz", 0.80)):
        if hasattr(torch, name):
            ratios[getattr(torch, name)] = r
    total = nbytes
    for leaf in leaves:
        r = ratios.get(leaf.dtype, 1.0)
        if leaf.nbytes >= MIN_RUN_BYTES and r < 1.0:
            total -= int(leaf.nbytes * (1 - r))
    return total


# ---------------------------------------------------------------------------------------------------------------
# decoding (on the device, after the copy)
# ---------------------------------------------------------------------------------------------------------------


SCRATCH_PER_ELEM = 6  # decode temporaries per element of a version 2 chunk: the unpacked fields and their steps


def _chunk_scratch(c: Chunk) -> int:
    if c.version == 4:
        return byte_code.scratch_need(c)
    if c.version == 3:
        return unit_code.scratch_need(c)
    return c.size + SCRATCH_PER_ELEM * (c.nbytes // c.elem) if c.coded else c.size


def decode_scratch_bytes(chunks: Iterable[Chunk]) -> int:
    """Device bytes the decode of these chunks holds at its peak besides the slot (the scratch)."""
    return max((_chunk_scratch(c) for c in chunks), default=0)


def scratch_estimate(leaves: Iterable) -> int:
    """`decode_scratch_bytes` before encoding, from ONE unit's leaves: its largest piece (a run of one dtype holds at
    most the unit's bytes of it, at most CHUNK_ELEMS elements), with the code that needs the most scratch."""
    by_dtype: dict[torch.dtype, int] = {}
    for leaf in leaves:
        if leaf.dtype in _FORMS and leaf.nbytes:
            by_dtype[leaf.dtype] = by_dtype.get(leaf.dtype, 0) + -(-leaf.nbytes // 512) * 512
    peak = 0
    for dtype, total in by_dtype.items():
        elem, sbits, rbits = _FORMS[dtype]
        if total < MIN_RUN_BYTES:
            continue
        n = min(CHUNK_ELEMS, total // elem)
        if elem == 1:  # the byte code's widened bytes (below PAYS of raw), escapes' mask and count, riders
            peak = max(peak, 4 * int(PAYS * n) + 8 * n + 128)
        for m, bits, n_codes in unit_code.options(elem, sbits, rbits):
            n_m = n - n % m
            c = Chunk(0, n_m * elem, 0, n_m * elem, elem, sbits, rbits, 0, 0, 0, n_codes, m, bits)
            extra = unit_code.scratch_need(c) - unit_code.piece_size(elem, m, bits, 0, n_m * elem)
            peak = max(peak, int(PAYS * n_m * elem) + extra + 16)
    return peak


def decode_into(buf: torch.Tensor, chunks: Iterable[Chunk], nbytes: int, size: int,
                scratch: DecodeScratch | None = None) -> None:
    """Decode in place: `buf[nbytes - size:nbytes]` holds the encoded blob (copied there), `buf[:nbytes]` gets the
    raw bytes. Chunks go in order; a chunk's encoded bytes are read into the scratch before its output is written
    (no chunk's output reaches the encoded bytes of a later chunk: none is larger encoded than raw). `scratch`: the
    device's decode scratch (one per device, reused); without it, a scratch of this call's own."""
    chunks = tuple(chunks)
    tail = nbytes - size
    need = decode_scratch_bytes(chunks)
    if scratch is None:
        _decode_all(buf, chunks, tail, torch.empty(need, dtype=torch.uint8, device=buf.device))
        return
    with scratch.lock:
        _decode_all(buf, chunks, tail, scratch.get(buf.device, need))


def _decode_all(buf: torch.Tensor, chunks: tuple[Chunk, ...], tail: int, scratch: torch.Tensor) -> None:
    with torch.inference_mode():  # a slot may be an inference tensor (allocated under inference mode)
        for c in chunks:
            a = tail + c.src
            if not c.coded and a == c.dst:
                continue  # already in place
            payload = buf[a:a + c.size]
            out = buf[c.dst:c.dst + c.nbytes]
            overlaps = a < c.dst + c.nbytes
            if c.version == 4:
                byte_code.decode_piece(c, payload, out, scratch)
            elif c.version == 3 and c.coded:
                unit_code.decode_piece(c, payload, out, scratch)
            elif c.coded:
                decode_chunk(c, payload, out, overlaps=overlaps)
            elif overlaps:
                scratch[:c.size].copy_(payload)
                out.copy_(scratch[:c.size])
            else:
                out.copy_(payload)


def decode(enc: Encoded, device: torch.device | str = "cpu") -> torch.Tensor:
    """The raw bytes of an encoded unit as a new uint8 tensor on `device` (tests, leaf copies of a compressed unit)."""
    buf = torch.empty(enc.nbytes, dtype=torch.uint8, device=device)
    buf[enc.nbytes - enc.size:].copy_(enc.blob)
    decode_into(buf, enc.chunks, enc.nbytes, enc.size)
    return buf
