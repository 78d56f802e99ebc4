"""A model file's tensor names, shapes and stored bytes from its header alone: safetensors (through
`store.storage.SafetensorsFile`, whose checks apply) and GGUF (the header parsed by the disk tier's reader,
`store.gguf_file`, per the GGUF spec).

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

from typing import BinaryIO

import torch

from ..store.header_check import FileTensor, check_safetensors_header

from ..store.gguf_file import GGML_TYPES, GGUF_MAGIC, parse_gguf_table, read_gguf_header  # noqa: F401  (re-exported)
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


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's tensor table and where its header ends (`header_end`: the bytes a copy of the header needs)."""

    infos: dict[str, TensorInfo]
    header_end: int
    data_start: int  # the header's end rounded up to the file's general.alignment
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
    `size`-byte file, checked by the disk tier's own parser (`store.gguf_file.parse_gguf_table`)."""
    def read(pos: int, n: int) -> bytes:
        fh.seek(pos)
        return fh.read(n)

    try:
        tensors, header_end, data_start = parse_gguf_table(read, path, size)
    except ModelFileError:
        raise
    except CorruptFileError as exc:
        raise ModelFileError(str(exc)) from None
    infos = {t.name: TensorInfo(t.shape, t.type, t.nbytes) for t in tensors}
    return GgufHeader(infos, header_end, data_start,
                      max((t.start + t.nbytes for t in tensors), default=data_start) - data_start)


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
