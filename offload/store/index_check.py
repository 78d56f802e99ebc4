"""A packed model's index is untrusted: `check_packed_index` validates it entry by entry with `header_check`'s
checks (format and version, plain shard names, every tensor's dtype, shape and span, no overlaps, no name twice, the
chunks of a unit stored compressed) before any shard is opened; `check_inside` keeps a shard inside its folder."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .codec import CODEC, Chunk, chunks_from_list, list_version
from .header_check import CorruptFileError, FileTensor, _show, check_no_overlap, check_tensor, require_regular, whole

PACKED_FORMAT = "layer-offload-packed"
PACKED_VERSION = 4  # 4: units stored compressed in the codec's chunks of version 4 (the byte code) or 3; 3: of version
# 3; 2: of version 2; 1: none
_SEPARATORS = ("/", "\\", ":", "\x00")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class PackedIndex:
    """A validated packed index: shard sizes and hashes, the unit and other entries, every tensor and its shard."""

    sizes: dict[str, int]
    sha256: dict[str, str | None]
    units: list[dict[str, Any]]
    other: list[dict[str, Any]]
    tensors: dict[str, FileTensor]
    shard_of: dict[str, str]
    stored: dict[str, StoredUnit] = field(default_factory=dict)  # compressed units by name
    unit_of: dict[str, str] = field(default_factory=dict)  # a compressed unit's tensors: their unit


@dataclass(frozen=True)
class StoredUnit:
    """A unit stored compressed in a packed shard: `stored` encoded bytes at `offset`, `nbytes` raw; its tensors'
    offsets (`PackedIndex.tensors`) are within the raw bytes."""

    name: str
    shard: str
    offset: int
    stored: int
    nbytes: int
    chunks: tuple[Chunk, ...]
    keys: tuple[str, ...]


def check_shard_name(index_path: str | os.PathLike, where: str, name: Any) -> str:
    """A path in a packed index must be a plain file name in the folder: the index is shared like a model file, so
    an absolute path, `..`, a separator or a hidden name is refused before anything is opened (and nothing about
    the file it names is read)."""
    if (not isinstance(name, str) or not name or len(name) > 255 or name.startswith(".")
            or any(c in name for c in _SEPARATORS) or os.path.isabs(name) or os.path.basename(name) != name):
        raise CorruptFileError(f"{index_path}: {where} names the shard {_show(name)}, which is not a plain file name "
                               f"in the packed folder; pack the model again")
    return name


def _entries(index: dict[str, Any], key: str, index_path: str | os.PathLike) -> list[dict[str, Any]]:
    value = index.get(key)
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise CorruptFileError(f"{index_path}: malformed packed index: {key!r} is not a list of objects")
    return value


def _name(entry: dict[str, Any], index_path: str | os.PathLike, what: str) -> str:
    name = entry.get("name")
    if not isinstance(name, str) or not name or len(name) > 4096:
        raise CorruptFileError(f"{index_path}: malformed packed index: a {what} has the name {_show(name)}")
    return name


def check_packed_index(index: Any, index_path: str | os.PathLike) -> PackedIndex:
    """Validate a parsed packed index (see `packed.py` for the format) against itself: format and version, plain
    shard names, every tensor's dtype, shape and span (inside its shard, inside its unit, exactly shape x dtype),
    units and tensors that do not overlap, no name twice. The shard files are checked by the reader."""
    if not isinstance(index, dict):
        raise CorruptFileError(f"{index_path}: the packed index is a JSON {type(index).__name__}, not an object")
    version = index.get("version", 0)
    if index.get("format") != PACKED_FORMAT or isinstance(version, bool) or not isinstance(version, int) \
            or not 1 <= version <= PACKED_VERSION:
        raise CorruptFileError(f"{index_path}: not a {PACKED_FORMAT} index of version <= {PACKED_VERSION}")
    shards, units, other = (_entries(index, k, index_path) for k in ("shards", "units", "other"))
    # every path the index names is checked before any file is opened or stat'ed (the index is untrusted)
    for s in shards:
        check_shard_name(index_path, "the shard list", s.get("path"))
    for u in units:
        check_shard_name(index_path, f"unit {_show(u.get('name'))}", u.get("path"))
    for t in other:
        check_shard_name(index_path, f"tensor {_show(t.get('name'))}", t.get("path"))
    out = PackedIndex({}, {}, units, other, {}, {})
    for s in shards:
        path = s["path"]
        if path in out.sizes:
            raise CorruptFileError(f"{index_path}: the shard {path!r} is listed twice")
        out.sizes[path] = whole(s.get("nbytes"), index_path, f"shard {path!r}", "nbytes")
        sha = s.get("sha256")
        if sha is not None and (not isinstance(sha, str) or not _SHA256.match(sha)):
            raise CorruptFileError(f"{index_path}: shard {path!r}: sha256 {_show(sha)} is not a SHA-256 hex digest")
        out.sha256[path] = sha
    spans: dict[str, list[tuple[int, int, str]]] = {p: [] for p in out.sizes}  # units and other tensors
    tensor_spans: dict[str, list[tuple[int, int, str]]] = {p: [] for p in out.sizes}

    def add(t: dict[str, Any], shard: str, where: str, limit: int | None = None,
            own: list[tuple[int, int, str]] | None = None) -> FileTensor:
        name = _name(t, index_path, "tensor")
        if shard not in out.sizes:
            raise CorruptFileError(f"{index_path}: {where} names the unknown shard {shard!r}")
        if name in out.tensors:
            raise CorruptFileError(f"{index_path}: {name!r} is listed twice")
        start = t.get("offset")
        nbytes = whole(t.get("nbytes"), index_path, where, "nbytes")
        ft = check_tensor(index_path, where, t.get("dtype"), t.get("shape"), start,
                          whole(start, index_path, where, "offset") + nbytes,
                          out.sizes[shard] if limit is None else limit)
        scale = t.get("scale")
        if scale is not None and not isinstance(scale, str):
            raise CorruptFileError(f"{index_path}: {where}: scale {_show(scale)} is not a tensor name")
        out.tensors[name], out.shard_of[name] = ft, shard
        (tensor_spans[shard] if own is None else own).append((ft.start, ft.end, where))
        return ft

    for u in units:
        uname = _name(u, index_path, "unit")
        where = f"unit {uname!r}"
        if u["path"] not in out.sizes:
            raise CorruptFileError(f"{index_path}: {where} names the unknown shard {u['path']!r}")
        lo = whole(u.get("offset"), index_path, where, "offset")
        nbytes = whole(u.get("nbytes"), index_path, where, "nbytes")
        if "compression" in u:
            spans[u["path"]].append(_stored_unit(u, uname, lo, nbytes, version, index_path, out, add))
            continue
        hi = lo + nbytes
        if hi > out.sizes[u["path"]]:
            raise CorruptFileError(f"{index_path}: {where} ends at byte {hi}, past its shard's "
                                   f"{out.sizes[u['path']]} bytes")
        tensors = u.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise CorruptFileError(f"{index_path}: {where}: 'tensors' is not a list of objects")
        for t in tensors:
            ft = add(t, u["path"], f"tensor {_show(t.get('name'))} of {where}")
            if ft.start < lo or ft.end > hi:
                raise CorruptFileError(f"{index_path}: tensor {t['name']!r} (bytes [{ft.start}, {ft.end})) lies "
                                       f"outside its {where} (bytes [{lo}, {hi}))")
        spans[u["path"]].append((lo, hi, where))
    for t in other:
        ft = add(t, t["path"], f"tensor {_show(t.get('name'))}")
        spans[t["path"]].append((ft.start, ft.end, f"tensor {t['name']!r}"))
    for shard in out.sizes:
        check_no_overlap(index_path, spans[shard])
        check_no_overlap(index_path, tensor_spans[shard])
    return out


def _stored_unit(u: dict[str, Any], uname: str, lo: int, nbytes: int, version: int, index_path: str | os.PathLike,
                 out: PackedIndex, add: Any) -> tuple[int, int, str]:
    """A unit stored compressed: its codec, encoded span inside its shard, chunks that decode inside it, and
    tensors inside its raw bytes that do not overlap; returns its span in the shard."""
    where = f"unit {uname!r}"
    if version < 2 or u["compression"] != CODEC:
        raise CorruptFileError(f"{index_path}: {where} is stored as {_show(u['compression'])}, which a version "
                               f"{version} index does not hold (this engine reads {CODEC!r} from versions 2 to 4)")
    stored = whole(u.get("stored"), index_path, where, "stored")
    if lo + stored > out.sizes[u["path"]]:
        raise CorruptFileError(f"{index_path}: {where} ends at byte {lo + stored}, past its shard's "
                               f"{out.sizes[u['path']]} bytes")
    try:
        listed = list_version(u.get("chunks"))
        if version == 2 or listed > version:
            listed = version  # read as the index's version says (a list of a later version: refused by its form)
        chunks = chunks_from_list(u.get("chunks"), nbytes, stored, version=listed)
    except ValueError as exc:
        raise CorruptFileError(f"{index_path}: {where}: {exc}") from None
    tensors = u.get("tensors")
    if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
        raise CorruptFileError(f"{index_path}: {where}: 'tensors' is not a list of objects")
    own: list[tuple[int, int, str]] = []
    for t in tensors:  # offsets within the unit's raw bytes
        add(t, u["path"], f"tensor {_show(t.get('name'))} of {where}", nbytes, own)
        out.unit_of[t["name"]] = uname
    check_no_overlap(index_path, own)
    if uname in out.stored:
        raise CorruptFileError(f"{index_path}: {where} is listed twice")
    out.stored[uname] = StoredUnit(uname, u["path"], lo, stored, nbytes, chunks, tuple(t["name"] for t in tensors))
    return lo, lo + stored, where


def check_inside(folder: str | os.PathLike, name: str, index_path: str | os.PathLike) -> os.stat_result:
    """A shard must be a regular file, and a shard that is a link must stay in the folder (checked before the shard
    is opened)."""
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(folder, name))
    if os.path.dirname(real) != real_folder:
        raise CorruptFileError(f"{index_path}: the shard {name!r} links outside the packed folder; copy the shard "
                               f"into the folder or pack the model again")
    return require_regular(os.path.join(folder, name), "packed shard")
