"""A GGUF file as the disk tier reads it: its header parsed and checked (per the GGUF spec, versions 2 and 3: magic,
version, counts, metadata key/values, each tensor's name, dims, ggml type and offset; the data section after the
header at the file's `general.alignment`), its tensors as the torch tensors a GGUF loader makes of them, and the
positioned reads, map and change detection of `storage.SafetensorsFile`, whose interface it has.

A tensor is what city96's ComfyUI-GGUF loader (and ComfyUI's own `comfy.gguf`) holds: F32 / F16 / F64 / integer
types as that dtype in torch order (ggml's dims reversed), BF16 as bfloat16, a quantized type (Q8_0, Q4_K, ...) as
its bytes, uint8 of shape (rows..., bytes per row). A loader that reshapes a tensor (its `orig_shape` metadata) or
casts it (BF16 vectors to float32) holds the same bytes, or their cast: the disk tier finds them by their bytes
(`leaf_match`). The header is untrusted: every count, length and span is bounded and checked before it is used.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Callable

import torch

from .header_check import MAX_BYTES, CorruptFileError, FileTensor, check_no_overlap, read_at
from .storage import SafetensorsFile

GGUF_MAGIC = b"GGUF"
# ggml type id -> (name, elements per block, bytes per block): ggml/include/ggml.h's enum ggml_type and ggml.c's
# type_traits table (blck_size, type_size)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
              19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
              23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
              28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
              35: ("TQ2_0", 256, 66)}
# the ggml types a loader holds as that torch dtype (every other one as its bytes)
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
               "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
MAX_TENSORS = 1 << 20  # more tensors than any model has: a corrupt count, refused before looping on it
MAX_KV = 1 << 20
MAX_STRING = 64 << 20  # one metadata string (a tokenizer's merges list is one array of many short strings)
MAX_DIMS = 8
MAX_ARRAY = 1 << 24  # items of one metadata array (a tokenizer's vocabulary is ~260k)
MAX_NESTING = 8  # arrays of arrays in the metadata (the spec allows them; real files nest at most 2)
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: uint8, int8, uint16, int16, uint32, int32, float32, bool, string, array, uint64, int64,
# float64 (gguf spec: gguf_metadata_value_type)
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class GgufTensor:
    """One tensor of the header: name, ggml dims (ggml order), ggml type name, bytes, absolute span in the file."""

    __slots__ = ("name", "dims", "type", "nbytes", "start")

    def __init__(self, name: str, dims: tuple[int, ...], gtype: str, nbytes: int, start: int) -> None:
        self.name, self.dims, self.type, self.nbytes, self.start = name, dims, gtype, nbytes, start

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape in torch order."""
        return tuple(reversed(self.dims))


class _Cursor:
    """Sequential, bounded reads of the header through positioned reads."""

    def __init__(self, read: Callable[[int, int], bytes], path: Path, size: int) -> None:
        self.read, self.path, self.size, self.pos = read, path, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise CorruptFileError(f"{self.path}: truncated or corrupt GGUF header")
        raw = self.read(self.pos, n)
        if len(raw) != n:
            raise CorruptFileError(f"{self.path}: truncated GGUF header")
        self.pos += n
        return raw

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise CorruptFileError(f"{self.path}: truncated or corrupt GGUF header")
        self.pos += n

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if n > MAX_STRING:
            raise CorruptFileError(f"{self.path}: GGUF string of {n} bytes: corrupt header")
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int, depth: int = 0) -> int | None:
        """Skip one metadata value; an unsigned integer's value is returned (the alignment is one)."""
        if vtype in SCALAR:
            raw = self.take(SCALAR[vtype])
            return int.from_bytes(raw, "little") if vtype in (0, 2, 4, 10) else None
        if vtype == 8:
            self.string()
            return None
        if vtype == 9:
            etype, count = self.unpack("<IQ")
            if count > MAX_ARRAY:
                raise CorruptFileError(f"{self.path}: GGUF array of {count} items: corrupt header")
            if depth >= MAX_NESTING:
                raise CorruptFileError(f"{self.path}: GGUF arrays nested deeper than {MAX_NESTING}: corrupt header")
            if etype in SCALAR:
                self.skip(SCALAR[etype] * count)
            else:
                for _ in range(count):
                    self.value(etype, depth + 1)
            return None
        raise CorruptFileError(f"{self.path}: unknown GGUF metadata type {vtype}")


def read_gguf_header(fd: int, path: str | os.PathLike, size: int) -> list[GgufTensor]:
    """The checked tensor table of a GGUF file open as `fd` (`size` bytes), spans absolute in the file."""
    return parse_gguf_table(lambda pos, n: read_at(fd, pos, n, path, "GGUF header"), path, size)[0]


def parse_gguf_table(read: Callable[[int, int], bytes], path: str | os.PathLike,
                     size: int) -> tuple[list[GgufTensor], int, int]:
    """(the checked tensor table, where the header ends, where the data section starts) of a `size`-byte GGUF file whose bytes `read(pos, n)` gives:
    a local file, or a header read from a URL by ranges (one parser, one set of bounds, for both)."""
    path = Path(path)
    cur = _Cursor(read, path, size)
    if cur.take(4) != GGUF_MAGIC:
        raise CorruptFileError(f"{path}: not a GGUF file (no GGUF magic)")
    (version,) = cur.unpack("<I")
    if version not in (2, 3):
        raise CorruptFileError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = cur.unpack("<QQ")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise CorruptFileError(f"{path}: GGUF header claims {n_tensors} tensors, {n_kv} keys: corrupt")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.unpack("<I")
        value = cur.value(vtype)
        if key == "general.alignment":
            if value is None or not 1 <= value <= 1 << 20 or value & (value - 1):
                raise CorruptFileError(f"{path}: general.alignment {value!r} is not a power of two up to 1 MiB")
            alignment = value
    raw: list[tuple[str, tuple[int, ...], str, int, int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        if n_dims > MAX_DIMS:
            raise CorruptFileError(f"{path}: tensor {name[:200]!r} has {n_dims} dims: corrupt header")
        dims = cur.unpack(f"<{n_dims}Q")
        gtype, offset = cur.unpack("<IQ")
        if gtype not in GGML_TYPES:
            raise CorruptFileError(f"{path}: tensor {name[:200]!r} has ggml type {gtype}, unknown here")
        tname, block, block_bytes = GGML_TYPES[gtype]
        numel = math.prod(dims)
        if numel > MAX_BYTES:
            raise CorruptFileError(f"{path}: tensor {name[:200]!r} ({list(reversed(dims))} {tname}) does not fit "
                                   f"any file: corrupt header")
        if name in names:
            raise CorruptFileError(f"{path}: tensor {name[:200]!r} is listed twice")
        names.add(name)
        raw.append((name, tuple(int(d) for d in dims), tname, -(-numel // block) * block_bytes, offset))
    data = -(-cur.pos // alignment) * alignment
    out = []
    for name, dims, tname, nbytes, offset in raw:
        start = data + offset
        if offset % alignment or offset > MAX_BYTES or start + nbytes > size:
            raise CorruptFileError(f"{path}: tensor {name[:200]!r} ({list(reversed(dims))} {tname}, {nbytes} bytes at "
                                   f"data offset {offset}) is misaligned or does not fit the {size}-byte file: "
                                   f"corrupt header")
        out.append(GgufTensor(name, dims, tname, nbytes, start))
    check_no_overlap(path, [(t.start, t.start + t.nbytes, f"tensor {t.name[:200]!r}") for t in out])
    return out, cur.pos, data


def as_loaded(t: GgufTensor) -> FileTensor:
    """The tensor as a GGUF loader holds it in torch: a plain type as itself, a quantized one as its bytes."""
    dtype = PLAIN_TYPES.get(t.type)
    shape = t.shape
    if dtype is None:  # (rows..., bytes per row) where rows are whole blocks, as every GGUF writer makes them
        _, block, block_bytes = next(v for v in GGML_TYPES.values() if v[0] == t.type)
        dtype = torch.uint8
        shape = shape[:-1] + (shape[-1] // block * block_bytes,) if shape and shape[-1] % block == 0 else (t.nbytes,)
    return FileTensor(dtype, shape, t.start, t.start + t.nbytes)


class GgufFile(SafetensorsFile):
    """A .gguf file with SafetensorsFile's interface (`tensors`, `match`, `aligned`, `view`, `read_tensor`,
    `read_into`, `read_range`, `check_unchanged`, `close`)."""

    _what = "GGUF file"

    def _fail(self, why: str) -> CorruptFileError:
        return CorruptFileError(f"{self.path}: truncated or corrupt GGUF file ({why})")

    def _read_header(self, size: int) -> dict[str, FileTensor]:
        self.metadata = {}
        return {t.name: as_loaded(t) for t in read_gguf_header(self._fd, self.path, size)}


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix: nothing is opened here)."""
    return Path(path).suffix.lower() == ".gguf"
