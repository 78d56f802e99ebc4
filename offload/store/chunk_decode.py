"""Decoding one coded chunk of the compressed host form (`codec.py`) on the device: a few torch ops any backend
runs, called by `codec.decode_into` for each chunk of a unit in its slot.

The top bytes (sign and exponent) go straight into place by one table gather: the fields one index covers (a packed
byte where the field width q divides 8; else two or four fields of a group that fills whole bytes, e.g. four 6-bit
fields in three bytes, widened into an int64 and cut into int32 index pairs by one shift, an or and a mask) index a
small table (built once per chunk parameters and device) whose words are those elements' raw little-endian bytes
with every byte but the top one zero, and `index_select` writes them into the slot. The other byte planes follow as
strided copies, the escapes as a scatter. A chunk that ends mid-group or lies at an offset its word type cannot
view decodes field by field (`_unpack_top`). Chunks are duck-typed (`codec.Chunk`): this module imports nothing of
the codec's.
"""
from __future__ import annotations

import math
from typing import Any

import torch

def bytes_to_int(b: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned integers from a (count, width) uint8 tensor, as int64 (zero-extended to 8 bytes)."""
    wide = torch.zeros(b.shape[0], 8, dtype=torch.uint8, device=b.device)
    wide[:, :width] = b
    return wide.view(torch.int64).reshape(-1)


def _unpack_fields(packed: torch.Tensor, q: int, n: int) -> torch.Tensor:
    """The inverse of `codec._pack_fields`: n fields (uint8, masked to q bits)."""
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


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLES: dict[tuple, torch.Tensor] = {}  # (chunk parameters, fields per index, device) -> table (bounded)
TABLE_BITS = 14  # the widest index a table takes (16K words: stays in the cache)


def _group(q: int) -> tuple[int, int]:
    """(fields, bytes) of the smallest run of q-bit fields that fills whole bytes: 8 // q fields in one byte where
    q divides 8, four 6-bit fields in three bytes, eight odd-width fields in q bytes."""
    g = 8 // math.gcd(q, 8)
    return g, g * q // 8


def _per_index(c: Any) -> int:
    """Fields one table index covers: a whole group where it fits TABLE_BITS (a packed byte, for q dividing 8),
    else as many of it as keep the index within TABLE_BITS; the word of their elements at most 8 bytes (0: none)."""
    g, b = _group(c.q)
    for f in (8, 4, 2, 1):
        if g % f == 0 and f * c.q <= TABLE_BITS and f * c.elem <= 8 and (b == 1 and f == g or g // f % 2 == 0):
            return f
    return 0


def _table(c: Any, f: int, device: torch.device) -> torch.Tensor:
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


def _indices(packed: torch.Tensor, c: Any, f: int, n: int) -> torch.Tensor:
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


def _table_fits(c: Any, f: int, out: torch.Tensor) -> bool:
    """Whether the table path applies: whole words of f elements (whole groups of eight where fields straddle
    bytes) at an offset the word type can view."""
    n = c.nbytes // c.elem
    return f > 0 and n % _group(c.q)[0] == 0 and out.storage_offset() % (f * c.elem) == 0


def decode_chunk(c: Any, payload: torch.Tensor, out: torch.Tensor, overlaps: bool = False) -> None:
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
        where = bytes_to_int(esc[:4 * c.n_esc].view(c.n_esc, 4), 4).clamp_(max=n - 1)  # never past
        cols[:, elem - 1].index_put_((where,), esc[4 * c.n_esc:])


def packed_at(c: Any) -> int:
    """Where a coded chunk's packed fields start in its encoded bytes (after its raw planes)."""
    return (c.elem - 1) * (c.nbytes // c.elem)


def _unpack_top(packed: torch.Tensor, c: Any, n: int) -> torch.Tensor:
    """The top bytes of n elements from fields that straddle bytes (uint8, escapes not yet in place)."""
    k = c.k
    field = _unpack_fields(packed, c.q, n)
    top = field.bitwise_and((1 << k) - 1).add_(c.base).bitwise_and_((1 << (8 - c.sbits - c.rbits)) - 1)
    if c.rbits:
        top.bitwise_left_shift_(c.rbits).bitwise_or_(field.bitwise_right_shift(k).bitwise_and_((1 << c.rbits) - 1))
    if c.sbits:
        top.bitwise_or_(field.bitwise_right_shift(k + c.rbits).bitwise_left_shift_(7))
    return top
