"""A model file's tensor names, shapes and stored bytes from its header alone: safetensors (through
`store.storage.SafetensorsFile`, whose checks apply) and GGUF (the header parsed here, per the GGUF spec: magic,
version, counts, metadata key/values skipped, then each tensor's name, dims, ggml type and offset).

Nothing past the header is read: a 30 GB model file costs a few kilobytes to megabytes of reading. Used by the
workflow plan (`workflow.py`) and the single-model command (`plan_cli.py`); a header read from a URL (`header_source`)
goes through the same checks (`safetensors_infos_from_header`, `parse_gguf` on its bytes).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..store.header_check import (MAX_BYTES, CorruptFileError, FileTensor, check_no_overlap,
                                  check_safetensors_header, open_regular, parse_json)

# safetensors dtype -> bytes per element
ST_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "C64": 8, "U16": 2, "U32": 4, "U64": 8}
# torch dtype name (as SafetensorsFile gives it) -> safetensors dtype name
ST_NAMES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
            "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
            "bool": "BOOL", "complex64": "C64", "uint16": "U16", "uint32": "U32", "uint64": "U64"}
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
GGUF_MAGIC = b"GGUF"
_MAX_TENSORS = 1 << 20  # more tensors than any model has: a corrupt count, refused before looping on it
_MAX_KV = 1 << 20
_MAX_STRING = 64 << 20  # one metadata string (a tokenizer's merges list is one array of many short strings)
_MAX_DIMS = 8
_MAX_ARRAY = 1 << 24  # items of one metadata array (a tokenizer's vocabulary is ~260k)
_MAX_NESTING = 8  # arrays of arrays in the metadata (the spec allows them; real files nest at most 2)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file stores it: its logical shape (torch order), stored dtype and stored bytes."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int


class ModelFileError(CorruptFileError):
    """A model file the plan cannot read: names the file and what is wrong."""


def read_tensor_infos(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a .safetensors or .gguf file by name, from its header only."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return read_gguf_infos(p)
    return read_safetensors_infos(p)


def read_safetensors_infos(path: Path) -> dict[str, TensorInfo]:
    """The header of a .safetensors file, checked by `store.storage.SafetensorsFile` (lengths, offsets, the file's
    size), without its data."""
    from ..store.storage import SafetensorsFile

    try:
        f = SafetensorsFile(path)
    except ValueError as exc:
        raise ModelFileError(str(exc)) from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc}") from None
    try:
        return infos_of(f.tensors)
    finally:
        f.close()


def infos_of(tensors: dict[str, FileTensor]) -> dict[str, TensorInfo]:
    """TensorInfo by name of a validated safetensors header's tensors."""
    return {name: TensorInfo(t.shape, str(t.dtype).replace("torch.", ""), t.end - t.start)
            for name, t in tensors.items()}


def safetensors_infos_from_header(raw: bytes, size: int, where: str) -> tuple[dict[str, TensorInfo], int]:
    """A safetensors header's JSON text (the bytes after the 8-byte length) read from elsewhere than a local file (a
    URL's range, the header cache), through the same validator as a local file's: `size` is the whole file's.
    Returns the tensors and the file's length the header implies (8 + header + data)."""
    if raw.lstrip(b" \t\r\n")[:1] != b"{":
        raise ModelFileError(f"{where}: the safetensors header is not a JSON object (it starts with {raw[:16]!r})")
    try:
        header = parse_json(raw, where, "safetensors header")
        tensors = check_safetensors_header(header, where, 8 + len(raw), size)[0]
    except ModelFileError:
        raise
    except CorruptFileError as exc:
        raise ModelFileError(str(exc)) from None
    return infos_of(tensors), max((t.end for t in tensors.values()), default=8 + len(raw))


def _need(fh: BinaryIO, n: int, path: "Path | str") -> bytes:
    raw = fh.read(n)
    if len(raw) != n:
        raise ModelFileError(f"{path}: truncated GGUF header")
    return raw


def _string(fh: BinaryIO, path: "Path | str") -> str:
    (n,) = struct.unpack("<Q", _need(fh, 8, path))
    if n > _MAX_STRING:
        raise ModelFileError(f"{path}: GGUF string of {n} bytes: corrupt header")
    return _need(fh, n, path).decode("utf-8", "replace")


# GGUF metadata value types: uint8, int8, uint16, int16, uint32, int32, float32, bool, string, array, uint64, int64,
# float64 (gguf spec: gguf_metadata_value_type)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_value(fh: BinaryIO, vtype: int, path: "Path | str", depth: int = 0) -> None:
    if vtype in _SCALAR:
        _need(fh, _SCALAR[vtype], path)
    elif vtype == 8:
        _string(fh, path)
    elif vtype == 9:
        etype, count = struct.unpack("<IQ", _need(fh, 12, path))
        if count > _MAX_ARRAY:
            raise ModelFileError(f"{path}: GGUF array of {count} items: corrupt header")
        if depth >= _MAX_NESTING:
            raise ModelFileError(f"{path}: GGUF arrays nested deeper than {_MAX_NESTING}: corrupt header")
        if etype in _SCALAR:
            fh.seek(_SCALAR[etype] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(fh, etype, path, depth + 1)
    else:
        raise ModelFileError(f"{path}: unknown GGUF metadata type {vtype}")


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's tensor table and where its header ends (`header_end`: the bytes a copy of the header needs)."""

    infos: dict[str, TensorInfo]
    header_end: int
    data_bytes: int  # the end of the last tensor in the data section (relative to its start)


def read_gguf_infos(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of a GGUF file (v2/v3): names, shapes (reversed from ggml's order to torch's), ggml types and
    stored bytes; the metadata key/values are skipped over."""
    fd = open_regular(path, "GGUF file")  # a FIFO, device or folder is refused before it is opened
    try:
        with os.fdopen(fd, "rb") as fh:
            return parse_gguf(fh, os.fstat(fh.fileno()).st_size, path).infos
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc}") from None


def parse_gguf(fh: BinaryIO, size: int, path: "Path | str") -> GgufHeader:
    """The GGUF header read from `fh` (a local file, a URL read by ranges, a cached copy of the header) of a
    `size`-byte file, with every bound above."""
    if _need(fh, 4, path) != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (no GGUF magic)")
    (version,) = struct.unpack("<I", _need(fh, 4, path))
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version}; versions 2 and 3 are read")
    n_tensors, n_kv = struct.unpack("<QQ", _need(fh, 16, path))
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV:
        raise ModelFileError(f"{path}: GGUF header claims {n_tensors} tensors, {n_kv} keys: corrupt")
    for _ in range(n_kv):
        _string(fh, path)
        (vtype,) = struct.unpack("<I", _need(fh, 4, path))
        _skip_value(fh, vtype, path)
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for _ in range(n_tensors):
        name = _string(fh, path)
        (n_dims,) = struct.unpack("<I", _need(fh, 4, path))
        if n_dims > _MAX_DIMS:
            raise ModelFileError(f"{path}: tensor {name!r} has {n_dims} dims: corrupt header")
        dims = struct.unpack(f"<{n_dims}Q", _need(fh, 8 * n_dims, path))
        gtype, offset = struct.unpack("<IQ", _need(fh, 12, path))
        if gtype not in GGML_TYPES:
            raise ModelFileError(f"{path}: tensor {name!r} has ggml type {gtype}, unknown here")
        tname, block, block_bytes = GGML_TYPES[gtype]
        numel = math.prod(dims)
        nbytes = -(-numel // block) * block_bytes
        if name in out:
            raise ModelFileError(f"{path}: tensor {name[:200]!r} is listed twice")
        if numel > MAX_BYTES or offset + nbytes > size:  # the data section lies inside the file
            raise ModelFileError(f"{path}: tensor {name[:200]!r} ({list(dims)} {tname}, {nbytes} bytes at "
                                 f"data offset {offset}) does not fit the {size}-byte file: corrupt header")
        out[name] = TensorInfo(tuple(int(d) for d in reversed(dims)), tname, nbytes)
        spans.append((offset, offset + nbytes, f"tensor {name[:200]!r}"))
    check_no_overlap(path, spans)  # offsets are relative to the one data section
    return GgufHeader(out, fh.tell(), max((hi for _, hi, _ in spans), default=0))


def file_dtype(infos: dict[str, TensorInfo]) -> str:
    """The dtype most of the file's matrix weights are stored in ('bf16', 'fp16', 'fp8_e4m3fn', 'Q4_K', ...)."""
    counts: dict[str, int] = {}
    for info in infos.values():
        if len(info.shape) == 2:
            counts[info.dtype] = counts.get(info.dtype, 0) + math.prod(info.shape)
    top = max(counts, key=counts.__getitem__) if counts else "bfloat16"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3fn",
            "float8_e5m2": "fp8_e5m2", "BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(top, top)
