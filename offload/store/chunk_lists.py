"""The stored form of a unit's chunks (a packed model's index, a shared host copy's header): plain lists of integers,
untrusted when read back. `chunks_from_list` accepts only chunks the codec writes, tiling the unit's raw and encoded
bytes in order, none larger encoded than raw, each of its exact encoded size, so decoding can only write inside the
unit; `check_escapes` checks the escape positions (they lie in the encoded bytes, not the index) and, for the byte
code (version 4), that its indices are inside the code and hold as many escapes as the header counts."""
from __future__ import annotations

from typing import Iterable

from .chunk_decode import bytes_to_int
from .codec_forms import ESCAPE_BYTES, FORMS, Chunk, Encoded
from . import byte_code, unit_code

FIELDS_V2 = ("dst", "nbytes", "src", "size", "elem", "sbits", "rbits", "k", "base", "n_esc")
FIELDS_V3 = ("dst", "nbytes", "src", "size", "elem", "sbits", "rbits", "n_codes", "base", "m", "bits", "n_esc")
FIELDS_V4 = FIELDS_V3 + ("smask",)
_CODED_FORMS = {(e, s, r) for e, s, r in FORMS.values()}
MAX_CHUNKS = 1 << 20  # far more than any unit has


def chunks_to_list(chunks: Iterable[Chunk]) -> list[list[int]]:
    """The chunks as plain lists of integers (JSON): version 4's fields (`FIELDS_V4`) where a chunk has the byte
    code, else version 3's (`FIELDS_V3`: what engines before the byte code read), or version 2's where every coded
    chunk is of version 2 (a unit read from an old packed folder)."""
    chunks = list(chunks)
    versions = {c.version for c in chunks if c.coded}
    fields = FIELDS_V2 if 2 in versions else FIELDS_V4 if 4 in versions else FIELDS_V3
    return [[getattr(c, f) for f in fields] for c in chunks]


def list_version(value: object) -> int:
    """The version a chunk list was written in (by the length of its entries; 3 for an empty list)."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return {len(FIELDS_V2): 2, len(FIELDS_V4): 4}.get(len(value[0]), 3)
    return 3


def coded_size(elem: int, sbits: int, rbits: int, k: int, n_esc: int, nbytes: int) -> int:
    """Encoded bytes of a version 2 coded chunk: the other bytes' planes, the packed fields, escapes."""
    n = nbytes // elem
    return (elem - 1) * n + ((n + 7) // 8) * (sbits + rbits + k) + n_esc * ESCAPE_BYTES


def _v3_ok(c: Chunk) -> bool:
    ebits = 8 - c.sbits - c.rbits
    if c.k or not 1 <= c.n_codes <= 1 << ebits or c.base >= 1 << ebits or c.m not in (1, 2, 4, 8) \
            or c.m * c.elem > 8 or c.bits not in unit_code.ALLOWED_BITS:
        return False
    word = c.m * c.elem
    return ((c.n_codes << (c.sbits + c.rbits)) ** c.m <= 1 << c.bits and c.nbytes % word == 0 and c.dst % word == 0
            and c.n_esc <= c.nbytes // c.elem
            and c.size == unit_code.piece_size(c.elem, c.m, c.bits, c.n_esc, c.nbytes))


def _v4_ok(c: Chunk) -> bool:
    if (c.elem != 1 or c.smask not in byte_code.MASKS or not 2 <= c.n_codes <= 16 or c.k
            or c.bits not in byte_code.WIDTHS or c.m != byte_code.per_index(c.n_codes, c.bits)
            or c.base >= 1 << (4 * (c.n_codes - 1))):
        return False
    symbols = byte_code.symbols_of(c.base, c.n_codes)
    return (len(set(symbols)) == len(symbols) and byte_code.lcm_ok(c) and c.n_esc <= c.nbytes
            and c.size == byte_code.piece_size(c.m, c.bits, c.n_esc, c.nbytes))


def _v2_ok(c: Chunk) -> bool:
    ebits = 8 - c.sbits - c.rbits
    return (1 <= c.k <= ebits and c.base < 1 << ebits and c.nbytes % c.elem == 0 and c.n_esc <= c.nbytes // c.elem
            and c.size == coded_size(c.elem, c.sbits, c.rbits, c.k, c.n_esc, c.nbytes))


def chunks_from_list(value: object, nbytes: int, size: int, version: int | None = None) -> tuple[Chunk, ...]:
    """Chunks read back from a stored index or header, checked so that decoding them can only write inside the unit's
    `nbytes` raw bytes and read inside its `size` encoded bytes (`codec.decode_into`'s invariants): raw ranges tile
    [0, nbytes) in order, encoded ranges tile [0, size) in order, no chunk larger encoded than raw, every coded chunk
    of a form the codec writes with its exact encoded size. `version`: the list's (2, 3 or 4; None: by its entries'
    length). Raises ValueError saying what is wrong."""
    if not isinstance(value, list) or len(value) > MAX_CHUNKS:
        raise ValueError("'chunks' is not a list of chunks")
    version = list_version(value) if version is None else version
    fields = {2: FIELDS_V2, 4: FIELDS_V4}.get(version, FIELDS_V3)
    out: list[Chunk] = []
    dst = src = 0
    for i, item in enumerate(value):
        if (not isinstance(item, list) or len(item) != len(fields)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)):
            raise ValueError(f"chunk {i} is not {len(fields)} whole numbers >= 0 ({', '.join(fields)})")
        c = Chunk(**dict(zip(fields, item)))
        if c.dst != dst or c.src != src or c.nbytes <= 0 or c.size > c.nbytes:
            raise ValueError(f"chunk {i} does not follow the one before it (raw bytes at {c.dst}, encoded at {c.src}; "
                             f"expected {dst} and {src}) or is larger encoded than raw")
        if c.coded:
            ok = _v2_ok(c) if version == 2 else _v4_ok(c) if c.smask else _v3_ok(c)
            if (c.elem, c.sbits, c.rbits) not in _CODED_FORMS or not ok:
                raise ValueError(f"chunk {i} is not a chunk the codec writes (form, code, index width, alignment, "
                                 f"escapes or size)")
        elif any((c.sbits, c.rbits, c.k, c.base, c.n_esc, c.n_codes, c.m, c.bits, c.smask)) or c.size != c.nbytes:
            raise ValueError(f"chunk {i} is a raw chunk with coding parameters or another size")
        out.append(c)
        dst, src = dst + c.nbytes, src + c.size
    if dst != nbytes or src != size:
        raise ValueError(f"the chunks cover {dst} raw and {src} encoded bytes, the unit has {nbytes} and {size}")
    return tuple(out)


def escape_span(c: Chunk) -> tuple[int, int]:
    """(where the escape positions of a coded chunk start in the blob, their count; none for the byte code)."""
    if c.version == 4:
        return c.src + c.size, 0
    if c.version == 2:
        return c.src + c.size - ESCAPE_BYTES * c.n_esc, c.n_esc
    return c.src + unit_code.layout_of(c.elem, c.m, c.bits, c.n_esc, c.nbytes)[2], c.n_esc


def check_escapes(enc: Encoded) -> None:
    """Every escape position of a stored unit lies inside its chunk, every byte code's index inside its code with as
    many escapes as its header counts (checked on the CPU where a unit read from an untrusted file is first decoded;
    the device decode also clamps them). Raises ValueError."""
    for c in enc.chunks:
        if c.coded and c.version == 4:
            if byte_code.count_escapes(c, enc.blob[c.src:c.src + c.size]) != c.n_esc:
                raise ValueError(f"the byte-coded chunk at raw byte {c.dst} holds an index past its code or another "
                                 f"count of escapes than its {c.n_esc}")
        elif c.coded and c.n_esc:
            n = c.nbytes // c.elem
            start, count = escape_span(c)
            where = bytes_to_int(enc.blob[start:start + 4 * count].view(count, 4), 4)
            if int(where.max()) >= n or int(where.min()) < 0:
                raise ValueError(f"an escape of the chunk at raw byte {c.dst} points past its {n} elements")
