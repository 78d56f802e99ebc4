"""The byte code (the codec's pieces of version 4): one coded stream per run of 1-byte elements (fp8, int8, packed
4-bit payloads), for which the unit-wide code of version 3 (`unit_code.py`) rarely pays: there every element's whole
byte is one symbol, so an index of at most 14 bits holds two elements of at most 7 bits, and each listed escape costs
40 bits (its int32 position and its byte).

Here each byte is split by a mask of 4 of its bits (`smask`: an fp8's exponent, an int8's top nibble; the encoder
picks the mask whose bits are the most skewed): those 4 bits are the element's SYMBOL, the other 4 its RIDER, stored
raw. The symbols are coded as one of `n_codes` codes: the `n_codes - 1` most frequent symbols (`S`, any set, held in
`base` four bits each, ascending) and an escape; `m` codes make one index `bits` wide (8 or 16: mixed radix,
`n_codes ** m <= 2 ** bits`). An escaped element's symbol is stored in order in the escape stream, four bits each:
the decode finds the escaped elements as those whose code is the escape and places the stream's symbols with a
running count (no positions).

A piece's encoded bytes: [indices: n / m, of bits / 8 bytes each, little-endian][riders: two per byte, n / 2]
[escapes: two per byte after one unused slot, ceil((n_esc + 1) / 2), none without escapes]; every index reads inside
its table (2 ** bits rows), so any byte a hostile stream holds decodes inside the piece. Decoding one piece
(`decode_piece`, in place: the payload lies in the slot's tail): the encoded bytes widened into the scratch (the one
read of them; a 16-bit index joined from its two bytes in one more op), one table gather of the symbols (an escape
decodes to a marker symbol outside `S`) straight into the slot, the escapes (the escape stream's gather, the
marker's mask, its running count clamped to `n_esc`, a gather and a select), the riders' gather and one OR: 4 device
ops (5 with 16-bit indices), 6 more with escapes, whatever the tensor count; no host sync (the count of escapes is
the header's).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .unit_code import CHUNK_ELEMS, _al, _cached, _keep

MASKS = tuple(m for m in range(256) if bin(m).count("1") == 4)  # every choice of 4 symbol bits
STEP = 240  # every piece but a run's raw tail is a multiple of lcm(m, 4) for every m: 240
WIDTHS = (8, 16)  # index bits
PIECE_ELEMS = CHUNK_ELEMS - CHUNK_ELEMS % STEP  # elements of one piece (the decode scratch's bound)
SUB_ELEMS = (1 << 18) - (1 << 18) % STEP  # elements the encoder works on at a time
SERIAL_ELEMS = (1 << 15) - (1 << 15) % STEP
ESC_BITS = 4


def per_index(n_codes: int, bits: int = 8) -> int:
    """Codes per index `bits` wide: the most m with n_codes ** m <= 2 ** bits."""
    m = 1
    while n_codes ** (m + 1) <= 1 << bits:
        m += 1
    return m


def _ext(v: int, mask: int) -> int:
    """The bits of `v` under `mask`, packed low (pext)."""
    out = j = 0
    for b in range(8):
        if mask >> b & 1:
            out |= ((v >> b) & 1) << j
            j += 1
    return out


def _dep(v: int, mask: int) -> int:
    """The low bits of `v` spread onto `mask`'s bits (pdep)."""
    out = j = 0
    for b in range(8):
        if mask >> b & 1:
            out |= ((v >> j) & 1) << b
            j += 1
    return out


_SYMBOLS = {mask: [_ext(v, mask) for v in range(256)] for mask in MASKS}


def symbols_of(base: int, n_codes: int) -> list[int]:
    """The coded symbols a chunk's `base` holds (four bits each)."""
    return [(base >> (4 * i)) & 15 for i in range(n_codes - 1)]


def marker(symbols: list[int]) -> int:
    """The symbol an escape decodes to (the smallest outside the coded ones)."""
    return min(set(range(16)) - set(symbols))


def piece_size(m: int, bits: int, n_esc: int, nbytes: int) -> int:
    """Encoded bytes of a piece of `nbytes` elements: indices, riders, escapes."""
    return nbytes // m * (bits // 8) + nbytes // 2 + ((n_esc + 2) // 2 if n_esc else 0)


def choose(hist: list[int]) -> tuple[int, int, int, int, int, int] | None:
    """(smask, n_codes, m, bits, base, n_esc) of the smallest byte code for elements with this byte histogram (256
    counts), None where no byte code is smaller than raw."""
    n = sum(hist)
    best = None
    for mask in MASKS:
        sym = _SYMBOLS[mask]
        hs = [0] * 16
        for v, c in enumerate(hist):
            if c:
                hs[sym[v]] += c
        order = sorted(range(16), key=lambda s: (-hs[s], s))
        covered = 0
        for n_codes in range(2, 17):
            covered += hs[order[n_codes - 2]]
            for bits in WIDTHS:
                m = per_index(n_codes, bits)
                size = n / m * bits / 8 + n / 2 + ((n - covered) * ESC_BITS / 8 if covered < n else 0)
                if best is None or size < best[0]:
                    # the set in ascending order: units whose payloads code the same set share one table
                    base = sum(s << (4 * i) for i, s in enumerate(sorted(order[:n_codes - 1])))
                    best = (size, (mask, n_codes, m, bits, base, n - covered))
    return None if best is None or best[0] >= n else best[1]


def escapes(hist: list[int], smask: int, base: int, n_codes: int) -> int:
    """Escaped elements of a piece with this byte histogram under a code."""
    coded = set(symbols_of(base, n_codes))
    sym = _SYMBOLS[smask]
    return sum(c for v, c in enumerate(hist) if sym[v] not in coded)


# ---------------------------------------------------------------------------------------------------------------
# encoding a piece (the CPU, while staging; the caller has chosen the code and sized the piece)
# ---------------------------------------------------------------------------------------------------------------


def _encode_luts(c: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(code | rider << 4, symbol) of every byte under a code, uint8."""
    key = ("b-enc", c.smask, c.base, c.n_codes)
    found = _cached(key)
    if found is not None:
        return found
    coded = symbols_of(c.base, c.n_codes)
    where = {s: i for i, s in enumerate(coded)}
    sym = _SYMBOLS[c.smask]
    both = torch.tensor([where.get(sym[v], c.n_codes - 1) | _ext(v, 255 ^ c.smask) << 4 for v in range(256)],
                        dtype=torch.uint8)
    return _keep(key, (both, torch.tensor(sym, dtype=torch.uint8)))


def _digits(c: Any) -> torch.Tensor:
    """(2 ** bits, m) the codes every index holds (an index past the code's last: escapes)."""
    v = torch.arange(1 << c.bits, dtype=torch.int64)
    d = torch.stack([(v // c.n_codes ** i) % c.n_codes for i in range(c.m)], 1)
    d[v >= c.n_codes ** c.m] = c.n_codes - 1
    return d


def encode_piece(raw: torch.Tensor, c: Any, out: torch.Tensor, sub: int = SUB_ELEMS) -> None:
    """Write piece `c` (a codec.Chunk of version 4) of the raw bytes `raw` (its `nbytes`, uint8) into `out` (its
    `size` encoded bytes). Table-driven: each byte's code, rider and symbol looked up, m codes combined per index, the
    escapes' symbols taken by a running count (no scan for their positions)."""
    n, m, nc, ib = c.nbytes, c.m, c.n_codes, c.bits // 8
    both_lut, sym_lut = _encode_luts(c)
    idx_out = out[:n // m * ib].view(n // m, ib)
    rider_out = out[n // m * ib:n // m * ib + n // 2]
    slots = torch.zeros(2 * ((c.n_esc + 2) // 2) if c.n_esc else 0, dtype=torch.uint8)  # slot 0 unused
    found = 0
    step = max(STEP, sub - sub % STEP)
    z0 = min(n, step)
    key = torch.empty(z0, dtype=torch.int32)
    both = torch.empty(z0, dtype=torch.uint8)
    codes = torch.empty(z0, dtype=torch.uint8)
    acc16 = torch.empty(z0 // m, dtype=torch.int16) if ib == 2 else None  # wraps: the low 16 bits are the index
    if c.n_esc:
        hit = torch.empty(z0, dtype=torch.bool)
        cnt = torch.empty(z0, dtype=torch.int64)
        room = torch.empty(z0 + 1, dtype=torch.uint8)
    for a in range(0, n, step):
        z = min(n, a + step) - a
        b = raw[a:a + z]
        k = key[:z]
        k.copy_(b)
        bo = torch.index_select(both_lut, 0, k, out=both[:z])
        cd = torch.bitwise_and(bo, 15, out=codes[:z])
        cv = cd.view(z // m, m)
        acc = idx_out[a // m:(a + z) // m, 0] if ib == 1 else acc16[:z // m]
        acc.copy_(cv[:, m - 1])
        for i in range(m - 2, -1, -1):
            acc.mul_(nc).add_(cv[:, i])  # modulo 2 ** bits, and the index is below it
        if ib == 2:
            idx_out[a // m:(a + z) // m].copy_(acc.view(torch.uint8).view(-1, 2))  # little-endian
        r = bo.view(torch.int16)  # (c0 | r0 << 4) | (c1 | r1 << 4) << 8
        rider_out[a // 2:(a + z) // 2].copy_(((r >> 4) & 15) | ((r >> 8) & 0xF0))
        if c.n_esc:
            h = torch.eq(cd, nc - 1, out=hit[:z])
            at = cnt[:z]
            torch.cumsum(h, 0, out=at)
            k_here = int(at[-1])
            if found + k_here > c.n_esc:
                raise ValueError("more escapes than the histogram counted")
            if k_here:
                at.mul_(h)  # an escape's place in order (from 1); every other element: 0, the unused slot
                room[:k_here + 1].scatter_(0, at, b)  # the escaped bytes in order
                torch.index_select(sym_lut, 0, room[1:k_here + 1].to(torch.int32),
                                   out=slots[1 + found:1 + found + k_here])
            found += k_here
    if found != c.n_esc:
        raise ValueError(f"{found} escapes found, {c.n_esc} counted")
    if c.n_esc:
        slots[0] = 0
        pairs = slots.view(-1, 2)
        eo = out[n // m * ib + n // 2:]
        torch.bitwise_left_shift(pairs[:, 1], 4, out=eo)
        eo.bitwise_or_(pairs[:, 0])


# ---------------------------------------------------------------------------------------------------------------
# decoding a piece (on the device, on the transfer stream, after the copy)
# ---------------------------------------------------------------------------------------------------------------


def tables(c: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(symbols, riders, escapes) tables of a code: for every index (2 ** bits rows) its m symbols at the mask's bits
    (an escape's, and any past the code's last: the marker's), for every rider byte its two riders at the other bits,
    for every escape byte its two symbols at the mask's bits."""
    key = ("b", c.smask, c.base, c.n_codes, c.m, c.bits, str(device))
    found = _cached(key)
    if found is not None:
        return found
    coded = symbols_of(c.base, c.n_codes)
    placed = torch.tensor([_dep(s, c.smask) for s in coded] + [_dep(marker(coded), c.smask)], dtype=torch.uint8)
    sym = placed[_digits(c)]
    rider = torch.tensor([[_dep(v & 15, 255 ^ c.smask), _dep(v >> 4, 255 ^ c.smask)] for v in range(256)],
                         dtype=torch.uint8)
    esc = torch.tensor([[_dep(v & 15, c.smask), _dep(v >> 4, c.smask)] for v in range(256)], dtype=torch.uint8)
    return _keep(key, (sym.to(device), rider.to(device), esc.to(device)))


def _layout(c: Any) -> tuple[int, int, int, int]:
    """(index bytes, rider bytes, escape bytes, encoded size) of a piece."""
    n = c.nbytes
    ne = (c.n_esc + 2) // 2 if c.n_esc else 0
    ni = n // c.m * (c.bits // 8)
    return ni, n // 2, ne, ni + n // 2 + ne


def scratch_need(c: Any) -> int:
    """Scratch bytes the decode of piece `c` uses: its widened bytes (and joined 16-bit indices), the escapes'
    symbols, mask and count, the riders (the escapes' gather shares their room)."""
    n = c.nbytes
    _, _, ne, size = _layout(c)
    joined = _al(4 * (n // c.m)) if c.bits == 16 else 0
    esc = _al(2 * ne) + _al(n) + _al(4 * n) if c.n_esc else 0
    return _al(4 * size) + joined + esc + _al(n)


def decode_piece(c: Any, payload: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Decode piece `c`: `payload` its encoded bytes (in the slot's tail), `out` its raw bytes in the slot (4-byte
    aligned), `scratch` at least `scratch_need(c)` bytes on the same device."""
    n, count = c.nbytes, c.nbytes // c.m
    ni, nr, ne, size = _layout(c)
    wide = scratch[:4 * size].view(torch.int32)
    wide.copy_(payload)  # the one read of the encoded bytes: the slot may be written over them from here on
    at = _al(4 * size)
    idx = wide[:ni]
    if c.bits == 16:
        pairs = wide[:ni].view(count, 2)
        idx = scratch[at:at + 4 * count].view(torch.int32)
        torch.add(pairs[:, 0], pairs[:, 1], alpha=256, out=idx)
        at += _al(4 * count)
    sym_t, rider_t, esc_t = tables(c, out.device)
    torch.index_select(sym_t, 0, idx, out=out.view(count, c.m))
    riders = scratch[at:at + n]
    if c.n_esc:
        at += _al(n)
        vals = scratch[at:at + 2 * ne]
        torch.index_select(esc_t, 0, wide[ni + nr:], out=vals.view(ne, 2))
        at += _al(2 * ne)
        mask = scratch[at:at + n].view(torch.bool)
        torch.eq(out, _dep(marker(symbols_of(c.base, c.n_codes)), c.smask), out=mask)
        at += _al(n)
        cnt = scratch[at:at + 4 * n].view(torch.int32)
        torch.cumsum(mask, 0, dtype=torch.int32, out=cnt)
        cnt.clamp_(max=c.n_esc)  # never past the escapes the header counts, whatever the stream says
        got = riders  # the riders' room, free until their gather
        torch.index_select(vals, 0, cnt, out=got)
        torch.where(mask, got, out, out=out)
    torch.index_select(rider_t, 0, wide[ni:ni + nr], out=riders.view(nr, 2))
    out.view(torch.int32).bitwise_or_(riders.view(torch.int32))


def count_escapes(c: Any, blob: torch.Tensor) -> int:
    """The escapes a stored piece's indices hold (the CPU's check of an untrusted stream), -1 where an index is past
    the code's last."""
    count = c.nbytes // c.m
    if not count:
        return 0
    idx = blob[:count * (c.bits // 8)].view(count, c.bits // 8).to(torch.int64)
    if c.bits == 16:
        idx = idx[:, 0] + 256 * idx[:, 1]
    idx = idx.reshape(-1)
    if int(idx.max()) >= c.n_codes ** c.m:
        return -1
    per = (_digits(c) == c.n_codes - 1).sum(1)
    return int(per.index_select(0, idx).sum())


def lcm_ok(c: Any) -> bool:
    """Whether a piece's size and place suit its code (whole indices, riders and 4-byte words)."""
    return c.nbytes % math.lcm(c.m, 4) == 0 and c.dst % 4 == 0
