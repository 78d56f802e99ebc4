"""The header of a shared host copy's segment as JSON: per unit its place, the leaves the filler read from the file,
and its form (raw, or the codec's encoded form with its chunk table). `shared_host.py` writes and reads it; nothing
here touches the segment itself.

A joining process trusts no field it reads: offsets and sizes must match its own layout, and an encoded unit's chunks
must be ones the codec writes, tiling its raw and encoded bytes in order (`codec.chunks_from_list`, as for a packed
file's index), or the segment is not used.
"""
from __future__ import annotations

import json
from typing import Any

from ..model.layout import TensorLayout
from . import codec

_CHUNK_ROOM = 16 + 21 * 13  # the most one chunk's JSON takes (thirteen 64-bit integers and separators)


def chunk_room(layout: TensorLayout) -> int:
    """Header bytes one unit's chunk table may take at the most (its runs, as the encoder cuts them)."""
    return _CHUNK_ROOM * (codec.max_chunks(layout.leaves, layout.nbytes) + 1)


def header_json(key: str, offsets: dict[int, int], sizes: dict[int, int], layouts: list[TensorLayout],
                file_leaves: dict[int, list[int]] | None = None, full: bool = False,
                encoded: dict[int, tuple[int, tuple[codec.Chunk, ...]]] | None = None) -> bytes:
    """The header's JSON (`full`: as large as it can be for these layouts, with every unit filled encoded and every
    leaf read from the file, less the chunk tables: `chunk_room` adds those)."""
    units = []
    for i in offsets:
        leaves = list(range(len(layouts[i].leaves))) if full else (file_leaves or {}).get(i)
        unit: dict[str, Any] = {"offset": offsets[i], "nbytes": sizes[i], "filled": full or i in (file_leaves or {}),
                                "file_leaves": leaves or []}
        if full or i in (encoded or {}):
            size, chunks = (sizes[i], ()) if full else encoded[i]
            unit.update(form=codec.CODEC, size=size, chunks=codec.chunks_to_list(chunks))
        units.append(unit)
    return json.dumps({"key": key, "units": units}).encode()


def parse_header(body: bytes, key: str, offsets: dict[int, int], sizes: dict[int, int],
                 ) -> tuple[dict[int, list[int]], dict[int, tuple[int, tuple[codec.Chunk, ...]]]] | None:
    """(the filled units and their file-read leaves, the encoded ones' sizes and chunks), or None for a header
    that is not this model's copy."""
    try:
        header = json.loads(body)
        units = header["units"]
        if header["key"] != key or len(units) != len(offsets):
            return None
        out, encoded = {}, {}
        for i, u in zip(offsets, units):
            if u["offset"] != offsets[i] or u["nbytes"] != sizes[i]:
                return None
            if u["filled"]:
                out[i] = [int(k) for k in u["file_leaves"]]
                if u.get("form", "none") != "none":
                    size = int(u["size"])
                    if u["form"] != codec.CODEC or not 0 <= size <= sizes[i]:
                        return None
                    encoded[i] = (size, codec.chunks_from_list(u["chunks"], sizes[i], size))
        return out, encoded
    except (ValueError, KeyError, TypeError):
        return None
