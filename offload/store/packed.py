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
import os
from pathlib import Path
from typing import Any

import torch

from .header_check import (MAX_HEADER_BYTES, PACKED_FORMAT, PACKED_VERSION, CorruptFileError, FileTensor,
                           check_inside, check_packed_index, read_json_object)
from .storage import SafetensorsFile, _writable_bytes

INDEX = "index.json"
FORMAT = PACKED_FORMAT
VERSION = PACKED_VERSION
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

    _what = "packed shard"

    def _read_header(self, size: int) -> dict[str, FileTensor]:
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
        # the index is untrusted: size-capped, JSON-limited and validated entry by entry before any shard is opened
        index = check_packed_index(read_json_object(index_path, "packed index", MAX_HEADER_BYTES), index_path)
        sizes = index.sizes
        self._sha256 = index.sha256
        self.units: list[dict[str, Any]] = index.units
        self.other: list[dict[str, Any]] = index.other
        self.tensors: dict[str, FileTensor] = index.tensors
        self._shard_of: dict[str, str] = index.shard_of
        by_shard: dict[str, dict[str, FileTensor]] = {p: {} for p in sizes}
        for name, shard in self._shard_of.items():
            by_shard[shard][name] = self.tensors[name]
        for shard in sizes:
            check_inside(self.path, shard, index_path)  # a regular file, not a link leading out of the folder
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


def is_packed(path: str | os.PathLike) -> bool:
    """Whether `path` is a packed folder (or its index.json)."""
    p = Path(path)
    return (p / INDEX).is_file() if p.is_dir() else p.name == INDEX


def open_weights(path: str | os.PathLike) -> SafetensorsFile | PackedWeights:
    """A model's weights for the disk tier: a packed folder (see the module docstring) or a safetensors file."""
    p = Path(path)
    if p.is_dir() or p.name == INDEX:
        if not os.path.lexists(p / INDEX if p.is_dir() else p):  # present but not a file: refused when it is read
            raise CorruptFileError(f"{p}: a folder without {INDEX} is not a packed model (python -m offload pack)")
        return PackedWeights(p)
    return SafetensorsFile(p)
