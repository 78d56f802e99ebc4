"""The packed disk format: a model's weights rewritten in execution order, one contiguous aligned range per unit.

`python -m offload pack model.safetensors model.packed/` (or `OffloadHandle.pack(out_dir)`, which uses the call
order the engine learned) writes shard files and `index.json`:

    {"format": "layer-offload-packed", "version": 1, "alignment": 4096,
     "shards": [{"path": "shard-00000.bin", "nbytes": <int>, "sha256": <hex>}, ...],
     "units": [{"name": "blocks.0", "path": "shard-00000.bin", "offset": <int>, "nbytes": <int>,
                "tensors": [{"name", "offset", "nbytes", "dtype", "shape", "scale"}, ...]}, ...],
     "other": [{"name", "path", "offset", "nbytes", "dtype", "shape", "scale"}, ...]}

Units are listed (and stored) in execution order; every unit's `offset` is a multiple of 4096; a tensor's `offset`
is its absolute byte offset in the unit's shard, at the place the engine's flat buffer gives it when the unit was
packed from a handle (`layout.plan_layout`: 512-byte aligned leaves), so a unit is one read straight into a bounce
buffer. `dtype` uses the safetensors names (`F32`, `BF16`, `F8_E4M3`...); `scale` names the scale tensor a float8
weight goes with, else null. Bytes are those of the source, bit for bit; padding is zeros.

`PackedWeights` reads a packed folder with the same interface the engine uses on `SafetensorsFile` (tensors, match,
aligned, view, read_tensor, read_into, read_range, check_unchanged, close): each shard is read by a
`SafetensorsFile` whose tensors come from the index, so positioned reads, the private map, and the change
detection (inotify + size/mtime: a truncated or rewritten shard is refused) are those of a safetensors file. A shard
whose size is not the one the index records is refused when the folder is opened; `PackedWeights.verify()` reads
every shard through and checks the SHA-256 recorded when it was written. `open_weights(path)` opens either.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.blocks import KNOWN_BLOCK_LISTS
from ..model.layout import ALIGN, align
from .storage import _DTYPES, CorruptFileError, FileTensor, SafetensorsFile, _writable_bytes

INDEX = "index.json"
FORMAT = "layer-offload-packed"
VERSION = 1
UNIT_ALIGN = 4096
DEFAULT_SHARD_BYTES = 4 << 30
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
_SCALE_SUFFIXES = ("_scale", ".scale")  # <p>.weight -> <p>.weight_scale / <p>.weight.scale
_SCALE_SIBLINGS = ("scale_weight", "scale")  # <p>.weight -> <p>.scale_weight / <p>.scale
_BLOCK_KEY = re.compile(r"^(?:(.*?)\.)?(\d+)\.")


# ----------------------------------------------------------------------------------------------------------------
# what goes where
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PackTensor:
    name: str
    offset: int  # within the unit (units) or ignored (other)
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class PackUnit:
    """One unit to write: its tensors at their offsets in the unit, and how to fill a buffer of `nbytes` with them."""

    name: str
    nbytes: int
    tensors: list[PackTensor]
    fill: Callable[[torch.Tensor], None]


def scale_for(name: str, dtype: torch.dtype, names: set[str] | dict) -> str | None:
    """The scale tensor a float8 weight goes with (`<p>.weight_scale`, `<p>.scale_weight`, `<p>.weight.scale`,
    `<p>.scale`), or None: not float8, or no such tensor."""
    if dtype not in _FP8:
        return None
    for suffix in _SCALE_SUFFIXES:
        if name + suffix in names:
            return name + suffix
    head, _, leaf = name.rpartition(".")
    if leaf == "weight":
        for sib in _SCALE_SIBLINGS:
            cand = f"{head}.{sib}" if head else sib
            if cand in names:
                return cand
    return None


def group_units(keys: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Units of a plain file from its key names: keys under `<list>.<int>.` (`blocks.3.`, `model.layers.3.`,
    `double_blocks.3.`) make the unit `<list>.<int>`; a list counts when it has at least two indices (only those
    with a known block-list name when there are any). Units come list by list (lists in the order the file first
    names them), each list in numeric order (blocks.2 before blocks.10). Returns (units, other keys)."""
    lists: dict[str, dict[int, list[str]]] = {}
    for key in keys:
        m = _BLOCK_KEY.match(key)
        if m:
            lists.setdefault(m.group(1) or "", {}).setdefault(int(m.group(2)), []).append(key)
    lists = {k: v for k, v in lists.items() if len(v) >= 2}
    known = {k: v for k, v in lists.items() if k.rpartition(".")[2] in KNOWN_BLOCK_LISTS}
    lists = known or lists
    units = [(f"{prefix}.{i}" if prefix else str(i), lists[prefix][i]) for prefix in lists
             for i in sorted(lists[prefix])]
    taken = {k for _, ks in units for k in ks}
    return units, [k for k in keys if k not in taken]


def _order_units(units: list[PackUnit], order: list[str] | None) -> list[PackUnit]:
    if not order:
        return units
    by_name = {u.name: u for u in units}
    unknown = [n for n in order if n not in by_name]
    if unknown:
        raise ValueError(f"order names units the source does not have: {unknown[:3]}")
    first = [by_name[n] for n in dict.fromkeys(order)]
    return first + [u for u in units if u.name not in set(order)]


# ----------------------------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------------------------


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _entry(t: PackTensor, offset: int, scale: str | None) -> dict[str, Any]:
    return {"name": t.name, "offset": offset, "nbytes": t.nbytes, "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape), "scale": scale}


class _ShardWriter:
    def __init__(self, out: Path, shard_bytes: int) -> None:
        self.out = out
        self.shard_bytes = shard_bytes
        self.shards: list[dict[str, Any]] = []
        self.fd = -1
        self.pos = 0
        self.hash: Any = None

    def _open(self) -> None:
        self.close()
        name = f"shard-{len(self.shards):05d}.bin"
        self.fd = os.open(self.out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o644)
        self.shards.append({"path": name, "nbytes": 0, "sha256": None})
        self.pos = 0
        self.hash = hashlib.sha256()

    def place(self, nbytes: int, alignment: int) -> tuple[str, int]:
        """Room for `nbytes` at an `alignment` boundary (a new shard when this one would pass shard_bytes)."""
        if self.fd < 0:
            self._open()
        start = (self.pos + alignment - 1) // alignment * alignment
        if self.pos and start + nbytes > self.shard_bytes:
            self._open()
            start = 0
        if start > self.pos:
            self._write(memoryview(bytes(start - self.pos)))
        self.pos = start
        return self.shards[-1]["path"], start

    def _write(self, data: memoryview) -> None:
        _write_all(self.fd, data)
        self.hash.update(data)

    def write(self, buf: torch.Tensor) -> None:
        self._write(_writable_bytes(buf))
        self.pos += buf.numel()

    def close(self) -> None:
        if self.fd >= 0:
            pad = (-self.pos) % UNIT_ALIGN  # shards end on a 4 KiB boundary: O_DIRECT reads of the last unit fit
            if pad:
                self._write(memoryview(bytes(pad)))
                self.pos += pad
            os.fsync(self.fd)
            os.close(self.fd)
            self.shards[-1]["nbytes"] = self.pos
            self.shards[-1]["sha256"] = self.hash.hexdigest()
            self.fd = -1


def write_packed(out_dir: str | os.PathLike, units: list[PackUnit],
                 other: list[tuple[PackTensor, Callable[[], torch.Tensor]]], names: set[str],
                 shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, source: str | None = None) -> Path:
    """Write `units` (in this order) and the `other` tensors as a packed folder; returns the index path."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; pass overwrite=True (--force) to replace a packed model there")
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX).exists():
        (out / INDEX).unlink()  # a half-rewritten folder must not pass as a packed model
    for old in out.glob("shard-*.bin"):
        old.unlink()
    if shard_bytes < UNIT_ALIGN:
        raise ValueError(f"shard_bytes={shard_bytes} is smaller than one {UNIT_ALIGN}-byte page")
    writer = _ShardWriter(out, shard_bytes)
    index_units: list[dict[str, Any]] = []
    index_other: list[dict[str, Any]] = []
    try:
        for unit in units:
            path, start = writer.place(unit.nbytes, UNIT_ALIGN)
            buf = torch.zeros(unit.nbytes, dtype=torch.uint8)
            unit.fill(buf)
            writer.write(buf)
            del buf
            index_units.append({"name": unit.name, "path": path, "offset": start, "nbytes": unit.nbytes,
                                "tensors": [_entry(t, start + t.offset, scale_for(t.name, t.dtype, names))
                                            for t in unit.tensors]})
        for t, read in other:
            path, start = writer.place(t.nbytes, ALIGN)
            data = read().contiguous().reshape(-1).view(torch.uint8)
            if data.numel() != t.nbytes:
                raise CorruptFileError(f"{t.name}: {data.numel()} bytes read, {t.nbytes} expected")
            writer.write(data)
            entry = _entry(t, start, scale_for(t.name, t.dtype, names))
            index_other.append({"name": entry.pop("name"), "path": path, **entry})
    finally:
        writer.close()
    index = {"format": FORMAT, "version": VERSION, "alignment": UNIT_ALIGN, "source": source,
             "shards": writer.shards, "units": index_units, "other": index_other}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)  # the index comes last: a folder without one is not a packed model
    return out / INDEX


def pack_file(src: str | os.PathLike | SafetensorsFile, out_dir: str | os.PathLike,
              units: list[tuple[str, list[tuple[str, int]]]] | None = None, order: list[str] | None = None,
              shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> Path:
    """Pack a safetensors file (or an open one) into `out_dir`; returns the index path.

    `units`: (unit name, [(key, offset in the unit)]) in execution order, e.g. from a model's layouts; by default
    they are grouped from the key names (`group_units`), tensors at 512-byte aligned offsets in the file's order.
    `order`: unit names in execution order (the units it does not name follow in their own order).
    """
    file = src if isinstance(src, (SafetensorsFile, PackedWeights)) else SafetensorsFile(src)
    try:
        keys = list(file.tensors)
        if units is None:
            grouped, _ = group_units(keys)
            units = []
            for name, unit_keys in grouped:
                pieces, off = [], 0
                for key in unit_keys:
                    ft = file.tensors[key]
                    pieces.append((key, off))
                    off = align(off + ft.end - ft.start)
                units.append((name, pieces))
        taken = {k for _, pieces in units for k, _ in pieces}
        missing = [k for _, pieces in units for k, _ in pieces if k not in file.tensors]
        if missing:
            raise ValueError(f"{file.path} has no tensor {missing[0]!r}")
        plan = []
        for name, pieces in units:
            tensors = [PackTensor(k, off, file.tensors[k].dtype, tuple(file.tensors[k].shape)) for k, off in pieces]
            nbytes = align(max((t.offset + t.nbytes for t in tensors), default=1))
            plan.append(PackUnit(name, nbytes, tensors,
                                 lambda buf, pieces=pieces: file.read_into(buf, pieces)))
        other = [(PackTensor(k, 0, file.tensors[k].dtype, tuple(file.tensors[k].shape)),
                  lambda k=k: file.read_tensor(k)) for k in keys if k not in taken]
        return write_packed(out_dir, _order_units(plan, order), other, set(keys), shard_bytes, overwrite,
                            source=Path(file.path).name)
    finally:
        if file is not src:
            file.close()


def pack_handle(handle: Any, out_dir: str | os.PathLike, shard_bytes: int = DEFAULT_SHARD_BYTES,
                overwrite: bool = False) -> Path:
    """Pack an offloaded model: its units in the call order the engine learned (units never seen streaming keep
    their place after the unit before them), each unit laid out exactly as the engine's flat buffer, so a unit read
    back is one read straight into a bounce buffer. Bytes come from the host masters (or the disk-tier file)."""
    streamer = handle.streamer
    staged = streamer.staged
    key_of = staged.key_of
    with streamer._lock:  # no pass may move weights while they are read
        order = _learned_order(streamer)
        plan: list[PackUnit] = []
        for i in order:
            su = staged.units[i]
            layout = su.layout
            if not layout.plain:
                raise ValueError(f"{su.name}: holds tensor subclasses or non-contiguous tensors, which the packed "
                                 f"format (plain tensors) cannot hold")
            tensors = [PackTensor(key_of(*e.locations[0][:2]), layout.leaves[e.recipe].offset,
                                  layout.leaves[e.recipe].dtype, tuple(layout.leaves[e.recipe].shape))
                       for e in layout.entries if not _non_persistent(e)]
            plan.append(PackUnit(su.name, layout.nbytes, tensors, _unit_filler(su.master)))
        rest = staged.rest
        if not rest.layout.plain:
            raise ValueError("the weights outside the blocks hold tensor subclasses, which the packed format "
                             "cannot hold")
        views = rest.layout.leaf_views(rest.host)
        other = [(PackTensor(key_of(*e.locations[0][:2]), 0, views[e.recipe].dtype, tuple(views[e.recipe].shape)),
                  lambda v=views[e.recipe]: v.clone())
                 for e in rest.layout.entries if not _non_persistent(e)]
        names = {t.name for u in plan for t in u.tensors} | {t.name for t, _ in other}
        return write_packed(out_dir, plan, other, names, shard_bytes, overwrite, source=handle.name)


def _non_persistent(entry: Any) -> bool:
    mod, attr, kind = entry.locations[0]
    return kind == "buffer" and attr in mod._non_persistent_buffers_set


def _unit_filler(master: Any) -> Callable[[torch.Tensor], None]:
    if master.host is not None:
        host = master.host
        return lambda buf: buf.copy_(host[:buf.numel()])
    pieces = [(k, leaf.offset) for k, leaf in zip(master.keys, master.layout.leaves)]
    return lambda buf: master.file.read_into(buf, pieces)


def _learned_order(streamer: Any) -> list[int]:
    """Every unit index in execution order: the order the prefetch worker learned (the forward one, also during a
    backward); units it does not hold (resident, not seen yet) go right after the unit before them by index."""
    n = len(streamer.units)
    worker = streamer.worker
    forward = getattr(worker, "_forward", None) if getattr(worker, "reversed", False) else None
    learned = list(forward if forward is not None else worker.order)
    learned = [i for i in dict.fromkeys(learned) if 0 <= i < n] if streamer.order_learned else []
    order = list(learned)
    for i in range(n):
        if i in order:
            continue
        before = [j for j in order if j < i]
        order.insert(order.index(max(before)) + 1 if before else 0, i)
    return order


# ----------------------------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------------------------


class _Shard(SafetensorsFile):
    """One shard file: a SafetensorsFile whose tensors come from the index instead of a header."""

    def __init__(self, path: Path, tensors: dict[str, FileTensor], nbytes: int) -> None:
        self._given = tensors
        self._expect = nbytes
        super().__init__(path)

    def _read_header(self) -> dict[str, FileTensor]:
        try:
            size = self.path.stat().st_size
        except OSError as exc:
            raise CorruptFileError(f"{self.path}: cannot read the packed shard: {exc}") from None
        if size != self._expect:
            what = "truncated" if size < self._expect else "changed"
            raise CorruptFileError(f"{self.path}: packed shard {what}: {size} bytes, the index records "
                                   f"{self._expect}; pack the model again")
        return self._given


class PackedWeights:
    """A packed folder, read with the interface the engine uses on a SafetensorsFile."""

    match = SafetensorsFile.match
    _prefixes = SafetensorsFile._prefixes
    aligned = SafetensorsFile.aligned

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        self.path = path.parent if path.name == INDEX else path
        index_path = self.path / INDEX
        try:
            index = json.loads(index_path.read_text())
        except OSError as exc:
            raise CorruptFileError(f"{index_path}: cannot read the packed index: {exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptFileError(f"{index_path}: the packed index is not JSON: {exc}") from None
        try:
            if index.get("format") != FORMAT or int(index.get("version", 0)) > VERSION:
                raise CorruptFileError(f"{index_path}: not a {FORMAT} index of version <= {VERSION}")
            # every path the index names is checked before any file is opened or stat'ed (the index is untrusted)
            for s in index["shards"]:
                _check_shard_name(index_path, "the shard list", s["path"])
            for u in index["units"]:
                _check_shard_name(index_path, f"unit {u.get('name')!r}", u["path"])
            for t in index["other"]:
                _check_shard_name(index_path, f"tensor {t.get('name')!r}", t["path"])
            sizes = {str(s["path"]): int(s["nbytes"]) for s in index["shards"]}
            self._sha256 = {str(s["path"]): s.get("sha256") for s in index["shards"]}
            self.units: list[dict[str, Any]] = list(index["units"])
            self.other: list[dict[str, Any]] = list(index["other"])
            entries = [(u["path"], t) for u in self.units for t in u["tensors"]] + [(t["path"], t) for t in self.other]
            by_shard: dict[str, dict[str, FileTensor]] = {p: {} for p in sizes}
            self.tensors: dict[str, FileTensor] = {}
            self._shard_of: dict[str, str] = {}
            for shard, t in entries:
                ft = _file_tensor(t)
                name = str(t["name"])
                if shard not in sizes:
                    raise CorruptFileError(f"{index_path}: {name!r} names the unknown shard {shard!r}")
                if name in self.tensors:
                    raise CorruptFileError(f"{index_path}: {name!r} is listed twice")
                if ft.end > sizes[shard]:
                    raise CorruptFileError(f"{index_path}: {name!r} ends at byte {ft.end} past its shard's "
                                           f"{sizes[shard]} bytes")
                self.tensors[name] = by_shard[shard][name] = ft
                self._shard_of[name] = shard
        except CorruptFileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptFileError(f"{index_path}: malformed packed index ({exc!r})") from None
        for shard in sizes:
            _check_inside(self.path, shard, index_path)
        self._shards: dict[str, _Shard] = {}
        try:
            for shard, tensors in by_shard.items():
                self._shards[shard] = _Shard(self.path / shard, tensors, sizes[shard])
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CorruptFileError:
        return CorruptFileError(f"{self.path}: corrupt packed model ({why})")

    def shard(self, key: str) -> SafetensorsFile:
        """The reader of the shard holding `key`."""
        return self._shards[self._shard_of[key]]

    def verify(self) -> None:
        """Read every shard through and compare its SHA-256 with the one recorded when it was packed (a full read:
        not done at open, where the sizes are checked); raises CorruptFileError naming the first shard that differs."""
        for name, shard in self._shards.items():
            want = self._sha256.get(name)
            if not want:
                continue
            h = hashlib.sha256()
            buf = torch.empty(min(64 << 20, max(1, shard._identity[0])), dtype=torch.uint8)
            off, size = 0, shard._identity[0]
            while off < size:
                n = min(buf.numel(), size - off)
                shard._read_at(buf[:n], off)
                h.update(_writable_bytes(buf[:n]))
                off += n
            if h.hexdigest() != want:
                raise CorruptFileError(f"{shard.path}: the packed shard's bytes differ from those packed (SHA-256 "
                                       f"{h.hexdigest()[:16]}..., the index records {want[:16]}...); pack it again")
        self.check_unchanged()

    def check_unchanged(self) -> None:
        """Raise SourceChangedError if any shard was truncated or rewritten since it was opened."""
        for s in self._shards.values():
            s.check_unchanged()

    def _by_shard(self, pieces: list[tuple[str, int]]) -> dict[str, list[tuple[str, int]]]:
        out: dict[str, list[tuple[str, int]]] = {}
        for key, off in pieces:
            out.setdefault(self._shard_of[key], []).append((key, off))
        return out

    def read_into(self, dst: torch.Tensor, pieces: list[tuple[str, int]]) -> int:
        """As SafetensorsFile.read_into: a unit packed in one shard is one positioned read."""
        return sum(self._shards[s].read_into(dst, p) for s, p in self._by_shard(pieces).items())

    def read_range(self, dst: torch.Tensor, pieces: list[tuple[str, int]], start: int, end: int) -> int:
        """As SafetensorsFile.read_range."""
        return sum(self._shards[s].read_range(dst, p, start, end) for s, p in self._by_shard(pieces).items())

    def read_tensor(self, key: str) -> torch.Tensor:
        return self.shard(key).read_tensor(key)

    def view(self, key: str) -> torch.Tensor:
        return self.shard(key).view(key)

    def close(self) -> None:
        for s in self._shards.values():
            s.close()


_SEPARATORS = ("/", "\\", ":", "\x00")


def _check_shard_name(index_path: Path, where: str, name: Any) -> None:
    """A path in a packed index must be a plain file name in the folder: the index is shared like a model file, so
    an absolute path, `..`, a separator or a hidden name is refused before anything is opened (and nothing about
    the file it names is read)."""
    if (not isinstance(name, str) or not name or name.startswith(".") or any(c in name for c in _SEPARATORS)
            or os.path.isabs(name) or Path(name).name != name):
        raise CorruptFileError(f"{index_path}: {where} names the shard {name!r}, which is not a plain file name in "
                               f"the packed folder; pack the model again")


def _check_inside(folder: Path, name: str, index_path: Path) -> None:
    """A shard that is a link must stay in the folder (checked before the shard is opened)."""
    real_folder = os.path.realpath(folder)
    real = os.path.realpath(folder / name)
    if os.path.dirname(real) != real_folder:
        raise CorruptFileError(f"{index_path}: the shard {name!r} links outside the packed folder; copy the shard "
                               f"into the folder or pack the model again")


def _file_tensor(t: dict[str, Any]) -> FileTensor:
    dtype = _DTYPES[t["dtype"]]
    shape = tuple(int(d) for d in t["shape"])
    start, nbytes = int(t["offset"]), int(t["nbytes"])
    numel = 1
    for d in shape:
        numel *= d
    if start < 0 or nbytes != numel * dtype.itemsize:
        raise CorruptFileError(f"{t['name']!r}: {nbytes} bytes at {start} do not hold {shape} x {dtype}")
    return FileTensor(dtype, shape, start, start + nbytes)


def is_packed(path: str | os.PathLike) -> bool:
    """Whether `path` is a packed folder (or its index.json)."""
    p = Path(path)
    return (p / INDEX).is_file() if p.is_dir() else p.name == INDEX


def open_weights(path: str | os.PathLike) -> SafetensorsFile | PackedWeights:
    """A model's weights for the disk tier: a packed folder (see the module docstring) or a safetensors file."""
    p = Path(path)
    if p.is_dir() or p.name == INDEX:
        if not is_packed(p):
            raise CorruptFileError(f"{p}: a folder without {INDEX} is not a packed model (python -m offload pack)")
        return PackedWeights(p)
    return SafetensorsFile(p)
