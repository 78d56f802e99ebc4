"""A model file's tensor names, shapes and stored bytes from its header alone: safetensors (through
`store.storage.SafetensorsFile`, whose checks apply) and GGUF (the header parsed here, per the GGUF spec: magic,
version, counts, metadata key/values skipped, then each tensor's name, dims, ggml type and offset).

Nothing past the header is read but the few bytes of JSON each quantized layer's `comfy_quant` tensor holds (its
format: a packed 4-bit payload computes as twice its stored last dimension), so a 30 GB model file costs kilobytes
to megabytes of reading. Shapes are what the model computes with, bytes what the file stores. Used by the workflow
plan (`workflow.py`) and the single-model command (`plan_cli.py`); a header read from a URL (`header_source`) goes
through the same checks (`safetensors_infos_from_header`, `parse_gguf` on its bytes).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import struct
from typing import BinaryIO

import torch

from ..store.header_check import MAX_BYTES, FileTensor, check_no_overlap, check_safetensors_header
_MAX_TENSORS = 1 << 20  # more tensors than any model has: a corrupt count, refused before looping on it
_MAX_KV = 1 << 20
_MAX_STRING = 64 << 20  # one metadata string (a tokenizer's merges list is one array of many short strings)
_MAX_DIMS = 8
_MAX_ARRAY = 1 << 24  # items of one metadata array (a tokenizer's vocabulary is ~260k)
_MAX_NESTING = 8  # arrays of arrays in the metadata (the spec allows them; real files nest at most 2)

from ..store.gguf_file import GGML_TYPES, GGUF_MAGIC, read_gguf_header  # noqa: F401  (re-exported)
from ..store.header_check import DTYPES, SAFETENSORS_DTYPES, CorruptFileError, open_regular, parse_json

# safetensors dtype -> bytes per element (a packed kind's: a fraction), and the torch dtype's name (as
# SafetensorsFile gives it) -> safetensors dtype name: the engine's one table (store/header_check.py)
ST_BYTES = {name: bits / 8 for name, (bits, _) in SAFETENSORS_DTYPES.items()}
ST_NAMES = {str(dtype).replace("torch.", ""): name for name, dtype in DTYPES.items()}
# ComfyUI's quantized formats whose payload packs two 4-bit weights per stored byte (comfy/quant_ops.py QUANT_ALGOS:
# a layer's `comfy_quant` names its format): the weight's logical last dimension is twice the stored one
PACKED_FORMATS = {"nvfp4": 2, "convrot_w4a4": 2, "asym_w4a8_int8": 2}
_MAX_QUANT_CONF = 4096  # a comfy_quant tensor is a few dozen bytes of JSON
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file stores it: its logical shape (torch order), stored dtype and stored bytes."""

    shape: tuple[int, ...]  # as the model computes with it (a packed 4-bit payload's logical shape)
    dtype: str
    nbytes: int  # as stored
    quant: str = ""  # its layer's quantized format (ComfyUI's comfy_quant), "" when plain
    scale: bool = False  # a quantized layer's scale or format tensor, not a weight the model computes with


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
        formats = quant_formats(f)
        out = {}
        for name, t in f.tensors.items():
            layer, _, leaf = name.rpartition(".")
            per = PACKED_FORMATS.get(formats.get(layer, ""), 1) if leaf == "weight" else 1
            shape = t.shape[:-1] + (t.shape[-1] * per,) if per > 1 and t.shape else t.shape
            quant = formats.get(layer, "")
            out[name] = TensorInfo(shape, str(t.dtype).replace("torch.", ""), t.end - t.start, quant,
                                   bool(quant) and leaf not in ("weight", "bias"))
        return out
    finally:
        f.close()


def quant_formats(f: Any) -> dict[str, str]:
    """Each quantized layer's format (ComfyUI's: its `<layer>.comfy_quant` tensor, a few bytes of JSON read from
    the file, or the header's `_quantization_metadata`); a malformed entry is left out (the layer is priced as
    stored)."""
    out: dict[str, str] = {}
    meta = f.metadata.get("_quantization_metadata") if isinstance(f.metadata, dict) else None
    confs: list[tuple[str, Any]] = []
    if isinstance(meta, str):
        try:
            layers = parse_json(meta.encode("utf-8"), f.path, "quantization metadata").get("layers", {})
            confs += list(layers.items()) if isinstance(layers, dict) else []
        except (CorruptFileError, AttributeError):
            pass
    for key, t in f.tensors.items():
        if key.endswith(".comfy_quant") and t.dtype == torch.uint8 and t.end - t.start <= _MAX_QUANT_CONF:
            try:
                confs.append((key[:-len(".comfy_quant")],
                              parse_json(bytes(f.read_tensor(key).tolist()), f.path, f"{key} (a layer's format)")))
            except CorruptFileError:
                continue
    for layer, conf in confs:
        if isinstance(conf, dict) and isinstance(conf.get("format"), str):
            out[layer] = conf["format"]
    return out


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
    stored bytes, read and checked by `store.gguf_file` (the disk tier's reader)."""
    fd = open_regular(path, "GGUF file")  # a FIFO, device or folder is refused before it is opened
    try:
        tensors = read_gguf_header(fd, path, os.fstat(fd).st_size)
    except ModelFileError:
        raise
    except CorruptFileError as exc:
        raise ModelFileError(str(exc)) from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read: {exc}") from None
    finally:
        os.close(fd)
    return {t.name: TensorInfo(t.shape, t.type, t.nbytes) for t in tensors}


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
        if len(info.shape) == 2 and not info.scale:
            kind = info.quant or info.dtype  # a quantized layer counts as its format (nvfp4, mxfp8, int8_tensorwise)
            counts[kind] = counts.get(kind, 0) + math.prod(info.shape)
    top = max(counts, key=counts.__getitem__) if counts else "bfloat16"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3fn",
            "float8_e5m2": "fp8_e5m2", "BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(top, top)
