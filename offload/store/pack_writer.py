"""Writing the packed disk format (see `packed.py` for the format and its reader): `pack_file` rewrites a
safetensors file, `pack_handle` an offloaded model in the call order the engine learned; units grouped from key names
(`group_units`), float8 weights with their scales (`scale_for`), shards written in execution order with their
SHA-256, the index last.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.blocks import KNOWN_BLOCK_LISTS
from ..model.layout import ALIGN, SMALL_LEAF, Leaf, align
from . import codec
from .packed import FORMAT, INDEX, UNIT_ALIGN, PackedWeights
from .header_check import CorruptFileError, file_shape, name_of
from .sources import read_cast
from .storage import SafetensorsFile, _writable_bytes

DEFAULT_SHARD_BYTES = 4 << 30
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
    return {"name": t.name, "offset": offset, "nbytes": t.nbytes, "dtype": name_of(t.dtype),
            "shape": file_shape(t.dtype, t.shape), "scale": scale}


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
        self.fd = create_new(self.out / name)
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


def _encoded(unit: PackUnit, buf: torch.Tensor) -> codec.Encoded | None:
    """The unit's bytes in the codec's lossless form, or None where that does not pay (it is stored raw)."""
    enc = codec.encode(buf, [Leaf(t.offset, t.nbytes, t.dtype, t.shape, None) for t in unit.tensors])
    return enc if enc.size < codec.UNIT_PAYS * unit.nbytes else None


def write_packed(out_dir: str | os.PathLike, units: list[PackUnit],
                 other: list[tuple[PackTensor, Callable[[], torch.Tensor]]], names: set[str],
                 shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, source: str | None = None,
                 compress: bool = False) -> Path:
    """Write `units` (in this order) and the `other` tensors as a packed folder; returns the index path.
    `compress`: each unit whose lossless encoding pays is stored encoded (index version 3: the codec's chunks of
    version 3; version 4 where a unit has the byte code's; its tensors' offsets are then within the unit's raw
    bytes); the other tensors stay raw."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; pass overwrite=True (--force) to replace a packed model there")
    out.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(out / INDEX):
        (out / INDEX).unlink()  # a half-rewritten folder must not pass as a packed model (a link: the link goes)
    for old in out.glob("shard-*.bin"):
        old.unlink()  # links included: a shard is written only into a file this call creates
    if shard_bytes < UNIT_ALIGN:
        raise ValueError(f"shard_bytes={shard_bytes} is smaller than one {UNIT_ALIGN}-byte page")
    writer = _ShardWriter(out, shard_bytes)
    index_units: list[dict[str, Any]] = []
    index_other: list[dict[str, Any]] = []
    try:
        for unit in units:
            buf = torch.zeros(unit.nbytes, dtype=torch.uint8)
            unit.fill(buf)
            enc = _encoded(unit, buf) if compress else None
            data = buf if enc is None else enc.blob
            path, start = writer.place(data.numel(), UNIT_ALIGN)
            writer.write(data)
            del buf, data
            entry = {"name": unit.name, "path": path, "offset": start, "nbytes": unit.nbytes}
            base = start
            if enc is not None:  # tensors' offsets within the raw bytes the chunks decode to
                entry.update(compression=codec.CODEC, stored=enc.size, chunks=codec.chunks_to_list(enc.chunks))
                base = 0
            entry["tensors"] = [_entry(t, base + t.offset, scale_for(t.name, t.dtype, names)) for t in unit.tensors]
            index_units.append(entry)
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
    # a plain pack stays readable by version 1, one without the byte code by version 3
    version = 1 if not any("compression" in u for u in index_units) else \
        4 if any(len(c) == len(codec.FIELDS_V4) for u in index_units for c in u.get("chunks", ())) else 3
    index = {"format": FORMAT, "version": version, "alignment": UNIT_ALIGN, "source": source,
             "shards": writer.shards, "units": index_units, "other": index_other}
    fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".json.tmp", dir=out)  # O_EXCL | O_NOFOLLOW, ours alone
    try:
        _write_all(fd, memoryview(json.dumps(index, indent=1).encode()))
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o644)  # mkstemp makes it private; an index is read like the shards
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out / INDEX)  # the index comes last: a folder without one is not a packed model
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return out / INDEX


def create_new(path: Path) -> int:
    """A descriptor of a file this call creates: O_EXCL | O_NOFOLLOW, so an existing file or a link planted under
    the name (leading out of the folder) is never written through."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
             | getattr(os, "O_BINARY", 0))
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        raise ValueError(f"{path} appeared while the pack was written (another pack into the same folder?); "
                         f"pack again") from None


def pack_file(src: str | os.PathLike | SafetensorsFile, out_dir: str | os.PathLike,
              units: list[tuple[str, list[tuple[str, int]]]] | None = None, order: list[str] | None = None,
              shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, compress: bool = False) -> Path:
    """Pack a safetensors file (or an open one) into `out_dir`; returns the index path.

    `units`: (unit name, [(key, offset in the unit)]) in execution order, e.g. from a model's layouts; by default
    they are grouped from the key names (`group_units`), tensors at 512-byte aligned offsets, one dtype's together
    (dtypes in the order the file first names them; within each, tensors of SMALL_LEAF bytes and more first, each
    group in the file's order), as the engine lays a unit out.
    `order`: unit names in execution order (the units it does not name follow in their own order).
    `compress`: units stored losslessly compressed where that pays (`write_packed`).
    """
    file = src if isinstance(src, (SafetensorsFile, PackedWeights)) else SafetensorsFile(src)
    try:
        keys = list(file.tensors)
        if units is None:
            grouped, _ = group_units(keys)
            units = []
            for name, unit_keys in grouped:
                pieces, off = [], 0
                rank: dict[torch.dtype, int] = {}
                for key in unit_keys:  # one dtype's tensors together, as the engine lays a unit out
                    rank.setdefault(file.tensors[key].dtype, len(rank))
                for key in sorted(unit_keys, key=lambda k: (rank[file.tensors[k].dtype],
                                                            file.tensors[k].end - file.tensors[k].start < SMALL_LEAF)):
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
                            source=Path(file.path).name, compress=compress)
    finally:
        if file is not src:
            file.close()


def pack_handle(handle: Any, out_dir: str | os.PathLike, shard_bytes: int = DEFAULT_SHARD_BYTES,
                overwrite: bool = False, compress: bool = False) -> Path:
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
            if not all(leaf.row_major for leaf in layout.leaves):
                raise ValueError(f"{su.name}: holds non-contiguous tensors, which the packed format (row-major "
                                 f"tensors) cannot hold")
            tensors = [PackTensor(name, layout.leaves[k].offset, layout.leaves[k].dtype, tuple(layout.leaves[k].shape))
                       for e in layout.entries if not _non_persistent(e)
                       for k, name in _leaf_names(key_of(*e.locations[0][:2]), e.recipe)]
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
        return write_packed(out_dir, plan, other, names, shard_bytes, overwrite, source=handle.name,
                            compress=compress)


def _non_persistent(entry: Any) -> bool:
    mod, attr, kind = entry.locations[0]
    return kind == "buffer" and attr in mod._non_persistent_buffers_set


def _leaf_names(name: str, recipe: Any, path: str = "") -> list[tuple[int, str]]:
    """(leaf index, stored name) of one tensor's leaves: a plain tensor under its own name; a tensor subclass's
    payload under its name and its other inner tensors beside it (`<name>_<inner>`, as ComfyUI stores a quantized
    weight's scales as `<layer>.weight_scale`), where reading the folder back finds them by their bytes."""
    if isinstance(recipe, int):
        return [(recipe, name + ("_" + path if path else ""))]
    out: list[tuple[int, str]] = []
    for inner, r in recipe[2].items():
        out += _leaf_names(name, r, f"{path}_{inner.strip('_')}".strip("_") if out or path else path)
    return out


def _unit_filler(master: Any) -> Callable[[torch.Tensor], None]:
    if master.host is not None:
        host = master.host
        return lambda buf: buf.copy_(host[:buf.numel()])
    casts = master.casts or (None,) * len(master.keys)
    pieces = [(k, leaf.offset) for k, leaf, c in zip(master.keys, master.layout.leaves, casts)
              if c is None and k is not None]
    cast = [(k, leaf, c) for k, leaf, c in zip(master.keys, master.layout.leaves, casts) if c is not None]
    residue = master.residue_pieces()  # the leaves the file lacks: their RAM copy, stored like the others

    def fill(buf: torch.Tensor) -> None:  # a unit read with a cast is stored as the model holds it (cast)
        master.file.read_into(buf, pieces)
        for off, raw in residue:
            buf[off:off + raw.numel()].copy_(raw)
        scratch = torch.empty(0, dtype=torch.uint8)

        def grow(n: int) -> torch.Tensor:
            nonlocal scratch
            scratch = scratch if scratch.numel() >= n else torch.empty(n, dtype=torch.uint8)
            return scratch[:n]

        for key, leaf, c in cast:
            read_cast(master.file, key, leaf, c, buf, 0, buf.numel(), grow)

    return fill


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
