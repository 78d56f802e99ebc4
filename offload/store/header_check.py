"""Model files are untrusted: the one validator for every header and index the engine reads (safetensors headers,
packed indexes, model configs), and the only way those files are opened.

- `open_regular` / `require_regular`: regular files only; a FIFO, device, socket or folder is refused by `stat`
  before anything is opened (opening a FIFO blocks forever), and the descriptor is checked again after opening.
- `read_json_file` / `parse_json`: a size cap checked before reading (headers and indexes at most 100 MB, as the
  safetensors library allows; configs far less), reads in bounded chunks, JSON nesting at most `MAX_JSON_DEPTH`,
  at most `MAX_JSON_ITEMS` values, integers at most `MAX_INT_DIGITS` digits, no NaN/Infinity: no RecursionError,
  ValueError or OverflowError from a crafted file reaches the caller, only a CorruptFileError naming the file.
- `check_tensor` / `check_no_overlap`: a tensor entry's dtype known, shape entries whole numbers >= 0 whose product
  fits, its byte span >= 0, inside the file and exactly shape x dtype long; spans of one file do not overlap.
- `read_safetensors_header`: all of the above for a safetensors file's header, as `FileTensor`s.
- packed indexes: `index_check.py`, with these checks.

Every refusal is a `CorruptFileError` naming the file, the entry and what is wrong.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from typing import Any

import torch

MAX_HEADER_BYTES = 100_000_000  # safetensors' own cap (MAX_HEADER_SIZE); packed indexes too
MAX_CONFIG_BYTES = 16 << 20  # a config.json / model index is kilobytes; anything larger is not one
MAX_JSON_DEPTH = 64  # a safetensors header nests 3 deep, a packed index 4, a model config rarely 6
MAX_INT_DIGITS = 20  # 2**64 has 20 digits: no byte offset or dimension needs more
MAX_JSON_ITEMS = 1_000_000  # keys + values: ~110k tensors in one header (real files: a few thousand)
MAX_BYTES = 1 << 62  # no span, shape product or file size past this is real (int64 arithmetic stays exact)
READ_CHUNK = 1 << 20  # a header is read in chunks of this size: memory grows with what arrives, not what is claimed

# Every dtype the safetensors format stores (the safetensors crate's `Dtype`): bits per element and the name of the
# torch dtype that holds it. Packed kinds count elements in the header (F4: two 4-bit elements per byte, which torch
# holds as one float4_e2m1fn_x2 element: the last dimension halves); a dtype this torch lacks is refused by name.
SAFETENSORS_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"), "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"), "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"), "F4": (4, "float4_e2m1fn_x2"), "F6_E2M3": (6, None), "F6_E3M2": (6, None),
    "I16": (16, "int16"), "U16": (16, "uint16"), "F16": (16, "float16"), "BF16": (16, "bfloat16"),
    "I32": (32, "int32"), "U32": (32, "uint32"), "F32": (32, "float32"),
    "C64": (64, "complex64"), "F64": (64, "float64"), "I64": (64, "int64"), "U64": (64, "uint64"),
}
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, (_, attr) in SAFETENSORS_DTYPES.items()
                                  if attr is not None and isinstance(getattr(torch, attr, None), torch.dtype)}
PACKED = {"F4": 2}  # elements per torch element of the packed kinds (the header counts the small ones)


def dtype_bits(name: str) -> int | None:
    """Bits per element of a safetensors dtype name (None: not a safetensors dtype)."""
    entry = SAFETENSORS_DTYPES.get(name)
    return entry[0] if entry is not None else None


def torch_shape(name: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape torch gives a tensor the header stores as `dims` (a packed kind's last dimension divides)."""
    per = PACKED.get(name, 1)
    return dims if per == 1 else dims[:-1] + (dims[-1] // per,)


def file_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header stores for a torch tensor of `dtype` and `shape` (inverse of torch_shape)."""
    per = PACKED.get(name_of(dtype), 1)
    dims = list(shape)
    if per != 1 and dims:
        dims[-1] *= per
    return dims


class CorruptFileError(ValueError):
    """A model file or index that is truncated, corrupt, crafted or does not match the model: names the file."""


@dataclass(frozen=True)
class FileTensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


# ---------------------------------------------------------------------------------------------------- files
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def require_regular(path: str | os.PathLike, what: str) -> os.stat_result:
    """`stat` of a regular file (links followed); CorruptFileError for a FIFO, device, socket, folder or a missing
    file, before anything could open it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CorruptFileError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptFileError(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; give the file itself")
    return st


def open_regular(path: str | os.PathLike, what: str) -> int:
    """A read-only descriptor of a regular file, checked by `stat` before opening and by `fstat` after (a FIFO
    swapped in between is opened non-blocking, so the open cannot hang, and refused)."""
    require_regular(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise CorruptFileError(f"{path}: cannot open {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptFileError(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file; give the file itself")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(fd: int, offset: int, nbytes: int, path: str | os.PathLike, what: str) -> bytes:
    """Exactly `nbytes` at `offset`, read in chunks of at most `READ_CHUNK`; CorruptFileError if the file ends first."""
    out = bytearray()
    while len(out) < nbytes:
        want = min(READ_CHUNK, nbytes - len(out))
        try:
            chunk = os.pread(fd, want, offset + len(out)) if hasattr(os, "pread") else _seek_read(fd, offset + len(out),
                                                                                                 want)
        except OSError as exc:
            raise CorruptFileError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
        if not chunk:
            raise CorruptFileError(f"{path}: {what} ends after {len(out)} of its {nbytes} bytes (truncated?)")
        out += chunk
    return bytes(out)


def _seek_read(fd: int, offset: int, n: int) -> bytes:  # pragma: no cover - Windows
    os.lseek(fd, offset, os.SEEK_SET)
    return os.read(fd, n)


# ----------------------------------------------------------------------------------------------------- JSON
class _Refused(Exception):
    pass


def _finite_float(text: str) -> float:
    if len(text) > 64:
        raise _Refused(f"a number written in {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:20]} is beyond float range")
    return value


def _no_constant(text: str) -> Any:
    raise _Refused(f"{text} (not a number JSON allows)")


_ESCAPE = re.compile(rb"\\.", re.S)
_STRING = re.compile(rb'"[^"]*"')
_PAIR = re.compile(rb"\[\]|\{\}")
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


_LONG_NUMBER = re.compile(rb"[0-9]{%d,}" % (MAX_INT_DIGITS + 1))  # no lookaround: one cheap test per byte


def json_shape_refusal(raw: bytes) -> str | None:
    """Why JSON text is refused before it is parsed (None: parse it), found with C-speed regex passes and no
    recursion: strings skipped, nesting deeper than `MAX_JSON_DEPTH` (innermost bracket pairs removed that many
    times), more than `MAX_JSON_ITEMS` values (what the parsed objects cost grows with), or a number with more than
    `MAX_INT_DIGITS` digits in a row. Unbalanced text passes here and fails to parse."""
    outside = _STRING.sub(b"", _ESCAPE.sub(b"", raw))
    items = outside.count(b",") + outside.count(b":")
    if items > MAX_JSON_ITEMS:
        return f"{items} values (at most {MAX_JSON_ITEMS})"
    long_number = _LONG_NUMBER.search(outside)
    if long_number:  # json.dumps writes at most 17 significant digits of a float, and no real int needs 21
        return f"a number of {len(long_number.group())} digits in a row (at most {MAX_INT_DIGITS})"
    brackets = outside.translate(None, _NOT_BRACKET)
    del outside
    for _ in range(MAX_JSON_DEPTH):
        shorter = _PAIR.sub(b"", brackets)
        if shorter == brackets:
            return None
        brackets = shorter
    return f"nesting deeper than {MAX_JSON_DEPTH} levels" if _PAIR.search(brackets) else None


def parse_json(raw: bytes, path: str | os.PathLike, what: str) -> Any:
    """JSON text (UTF-8) from an untrusted file, with depth, size and number limits; CorruptFileError naming the
    file. Duplicate keys: the last one counts, as in the safetensors library."""
    why = json_shape_refusal(raw)
    if why:
        raise CorruptFileError(f"{path}: {what} holds {why}; not a real {what}")
    try:
        return json.loads(raw.decode("utf-8"), parse_float=_finite_float, parse_constant=_no_constant)
    except _Refused as exc:
        raise CorruptFileError(f"{path}: {what} holds {exc}") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptFileError(f"{path}: {what} is not valid JSON ({str(exc)[:200]})") from None


def read_json_file(path: str | os.PathLike, what: str, limit: int = MAX_CONFIG_BYTES) -> Any:
    """A whole JSON file (a config, an index) of at most `limit` bytes, regular files only."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptFileError(f"{path}: {what} of {size} bytes is larger than the {limit}-byte limit; it is not "
                                   f"a {what}")
        raw = read_at(fd, 0, size, path, what)
    finally:
        os.close(fd)
    return parse_json(raw, path, what)


def read_json_object(path: str | os.PathLike, what: str, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """As `read_json_file`, and the top level must be a JSON object."""
    value = read_json_file(path, what, limit)
    if not isinstance(value, dict):
        raise CorruptFileError(f"{path}: {what} is a JSON {type(value).__name__}, not a JSON object")
    return value


# -------------------------------------------------------------------------------------------------- entries
def whole(value: Any, path: str | os.PathLike, where: str, field: str, minimum: int = 0) -> int:
    """An integer field (not a bool, not a float) at least `minimum` and below `MAX_BYTES`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CorruptFileError(f"{path}: {where}: {field} is {_show(value)}, not a whole number")
    if not minimum <= value <= MAX_BYTES:
        raise CorruptFileError(f"{path}: {where}: {field} is {value}, outside [{minimum}, {MAX_BYTES}]")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_dtype(name: Any, path: str | os.PathLike, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; CorruptFileError for an unknown one, or one this torch lacks."""
    if isinstance(name, str) and name in SAFETENSORS_DTYPES and name not in DTYPES:
        bits, attr = SAFETENSORS_DTYPES[name]
        raise CorruptFileError(f"{path}: {where}: dtype {name} ({bits}-bit elements) has no torch dtype in torch "
                               f"{torch.__version__}{f' (torch.{attr})' if attr else ''}; a torch that has it can "
                               f"read this file, or convert the tensor to a dtype torch has")
    if not isinstance(name, str) or name not in DTYPES:
        raise CorruptFileError(f"{path}: {where}: dtype {_show(name)} is not one the engine reads "
                               f"({', '.join(DTYPES)})")
    return DTYPES[name]


def check_shape(shape: Any, path: str | os.PathLike, where: str) -> tuple[int, ...]:
    """A shape: a list of at most 32 whole numbers >= 0 whose product fits `MAX_BYTES`."""
    if not isinstance(shape, list) or len(shape) > 32:
        raise CorruptFileError(f"{path}: {where}: shape {_show(shape)} is not a list of at most 32 dimensions")
    dims = tuple(whole(d, path, where, "a shape entry") for d in shape)
    numel = 1
    for d in dims:
        numel *= d
        if numel > MAX_BYTES:
            raise CorruptFileError(f"{path}: {where}: shape {list(dims)} holds more elements than any file")
    return dims


def check_tensor(path: str | os.PathLike, where: str, dtype_name: Any, shape: Any, start: Any, end: Any,
                 limit: int) -> FileTensor:
    """A tensor entry: dtype known, shape valid, [start, end) inside [0, limit) and exactly shape x dtype long."""
    dtype = check_dtype(dtype_name, path, where)
    dims = check_shape(shape, path, where)
    lo = whole(start, path, where, "its start offset")
    hi = whole(end, path, where, "its end offset")
    numel = 1
    for d in dims:
        numel *= d
    bits = SAFETENSORS_DTYPES[dtype_name][0]
    per = PACKED.get(dtype_name, 1)
    if per != 1 and (not dims or dims[-1] % per):
        raise CorruptFileError(f"{path}: {where}: a {dtype_name} tensor packs {per} elements per byte, so its last "
                               f"dimension must be a multiple of {per}; shape {list(dims)} is not")
    need = numel * bits // 8
    if hi - lo != need:
        raise CorruptFileError(f"{path}: {where}: spans {hi - lo} bytes [{lo}, {hi}) but {list(dims)} x {dtype_name} "
                               f"needs {need}")
    if hi > limit:
        raise CorruptFileError(f"{path}: {where}: ends at byte {hi}, past the end of the data ({limit} bytes; "
                               f"truncated?)")
    return FileTensor(dtype, torch_shape(dtype_name, dims), lo, hi)


def check_no_overlap(path: str | os.PathLike, spans: list[tuple[int, int, str]]) -> None:
    """No two non-empty byte ranges [start, end) of one file overlap (two tensors reading the same bytes would load
    wrong weights silently)."""
    last_end, last_name = -1, ""
    for lo, hi, name in sorted((s for s in spans if s[1] > s[0]), key=lambda s: (s[0], s[1])):
        if lo < last_end:
            raise CorruptFileError(f"{path}: {name} (bytes [{lo}, {hi})) overlaps {last_name}, which ends at byte "
                                   f"{last_end}; every tensor needs bytes of its own")
        if hi > last_end:
            last_end, last_name = hi, name


# ------------------------------------------------------------------------------------------- safetensors
def read_safetensors_header(fd: int, path: str | os.PathLike, size: int) -> tuple[dict[str, FileTensor], dict]:
    """The validated tensors of a safetensors file open as `fd` (`size` bytes), and its header's metadata."""
    what = "safetensors header"
    if size < 8:
        raise CorruptFileError(f"{path}: truncated or corrupt safetensors file (only {size} bytes)")
    (n,) = struct.unpack("<Q", read_at(fd, 0, 8, path, what))
    if n < 2 or 8 + n > size:
        raise CorruptFileError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes does not fit a "
                               f"{size}-byte file)")
    if n > MAX_HEADER_BYTES:
        raise CorruptFileError(f"{path}: the safetensors header claims {n} bytes, more than the {MAX_HEADER_BYTES}-byte"
                               f" limit (the safetensors library's); not a model file")
    raw = read_at(fd, 8, n, path, what)
    if raw.lstrip(b" \t\r\n")[:1] != b"{":  # cheap, before any pass over the text
        raise CorruptFileError(f"{path}: the safetensors header is not a JSON object (it starts with "
                               f"{raw[:16]!r})")
    header = parse_json(raw, path, what)
    del raw
    return check_safetensors_header(header, path, 8 + n, size)


def check_safetensors_header(header: Any, path: str | os.PathLike, base: int,
                             size: int) -> tuple[dict[str, FileTensor], dict]:
    """Validate a parsed header whose data starts at byte `base` of a `size`-byte file: (tensors, metadata)."""
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CorruptFileError(f"{path}: the safetensors header's __metadata__ is {_show(metadata)}, not an object")
    out: dict[str, FileTensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        where = f"tensor {key[:200]!r}"
        if not isinstance(info, dict):
            raise CorruptFileError(f"{path}: {where}: the entry is {_show(info)}, not an object")
        offsets = info.get("data_offsets")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise CorruptFileError(f"{path}: {where}: data_offsets is {_show(offsets)}, not [start, end]")
        ft = check_tensor(path, where, info.get("dtype"), info.get("shape"), offsets[0], offsets[1], size - base)
        out[key] = FileTensor(ft.dtype, ft.shape, base + ft.start, base + ft.end)
    check_no_overlap(path, [(t.start, t.end, f"tensor {k[:200]!r}") for k, t in out.items()])
    return out, metadata


def safetensors_tensors(path: str | os.PathLike) -> dict[str, FileTensor]:
    """The validated tensors of a safetensors file by path (opened, read and closed here)."""
    fd = open_regular(path, "safetensors file")
    try:
        return read_safetensors_header(fd, path, os.fstat(fd).st_size)[0]
    finally:
        os.close(fd)


def name_of(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    return next(k for k, v in DTYPES.items() if v == dtype)
