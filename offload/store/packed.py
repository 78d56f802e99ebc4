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

This module reads the format; `pack_writer.py` writes it (`pack_file`, `pack_handle`).
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
from pathlib import Path
from typing import Any

import torch

from .storage import _DTYPES, CorruptFileError, FileTensor, SafetensorsFile, _writable_bytes

INDEX = "index.json"
FORMAT = "layer-offload-packed"
VERSION = 1
UNIT_ALIGN = 4096


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
