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

Version 3 (`pack --compress`): a unit whose lossless encoding pays (`codec.py`) is stored encoded and its entry adds
`"compression": "expwin", "stored": <encoded bytes at offset>, "chunks": [[dst, nbytes, src, size, elem, sbits,
rbits, n_codes, base, m, bits, n_esc], ...]` (`codec.chunks_to_list`: the unit-wide code, one stream per dtype);
its tensors' `offset`s are then within the unit's `nbytes` raw bytes. Version 4 is version 3 where a unit's chunks
include the byte code of 1-byte payloads (fp8, int8, packed 4-bit: `byte_code.py`): such a unit's chunk lists have a
thirteenth field, `smask`; an engine before it refuses the index by its version, naming the version it reads. Version 2 (what earlier engines wrote) is the
same with chunks of `[dst, nbytes, src, size, elem, sbits, rbits, k, base, n_esc]` (a k-bit window per tensor
chunk): still read, and decoded on the device as well. A disk-tier unit laid out as stored (the engine lays a unit out in its stored order) streams its encoded
bytes and the device decodes them in the slot (`compressed.StoredDiskSource`); otherwise `read_into` decodes on the
CPU. Between passes its tensors view a copy-on-write map of its decoded bytes, written once to a spill file
(`spill.py`). A folder without compressed units is written as version 1.

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
import threading
from pathlib import Path
from typing import Any

import torch

from . import codec
from .header_check import MAX_HEADER_BYTES, CorruptFileError, FileTensor, read_json_object
from .index_check import PACKED_FORMAT, PACKED_VERSION, StoredUnit, check_inside, check_packed_index
from .gguf_file import GgufFile, is_gguf
from .spill import SpillFile
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
    keys_for = SafetensorsFile.keys_for
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
        self.stored: dict[str, StoredUnit] = index.stored  # units stored compressed (`pack --compress`)
        self._unit_of: dict[str, str] = index.unit_of  # their tensors (offsets within the unit's raw bytes)
        self._last: tuple[str, codec.Encoded, torch.Tensor | None] | None = None  # the last unit read (and decoded)
        self._decode_lock = threading.Lock()  # staging and the read-ahead thread may both decode
        self._spill: SpillFile | None = None
        self._spilled: dict[str, torch.Tensor] = {}  # decoded units the modules view between passes
        by_shard: dict[str, dict[str, FileTensor]] = {p: {} for p in sizes}
        for name, shard in self._shard_of.items():
            if name not in self._unit_of:
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
            if key not in self._unit_of:
                out.setdefault(self._shard_of[key], []).append((key, off))
        return out

    def read_into(self, dst: torch.Tensor, pieces: list[tuple[str, int]]) -> int:
        """As SafetensorsFile.read_into: a unit packed in one shard is one positioned read (a unit stored compressed:
        read and decoded on the CPU; `stored_unit` finds the units the device can decode itself)."""
        return (sum(self._shards[s].read_into(dst, p) for s, p in self._by_shard(pieces).items())
                + self._read_decoded(dst, pieces, 0, dst.numel(), whole=True))

    def read_range(self, dst: torch.Tensor, pieces: list[tuple[str, int]], start: int, end: int) -> int:
        """As SafetensorsFile.read_range."""
        return (sum(self._shards[s].read_range(dst, p, start, end) for s, p in self._by_shard(pieces).items())
                + self._read_decoded(dst, pieces, start, end))

    def read_tensor(self, key: str) -> torch.Tensor:
        unit = self._unit_of.get(key)
        if unit is None:
            return self.shard(key).read_tensor(key)
        ft = self.tensors[key]
        return self._raw(unit)[ft.start:ft.end].clone().view(ft.dtype).view(ft.shape)

    def view(self, key: str) -> torch.Tensor:
        """As SafetensorsFile.view; a tensor of a unit stored compressed views a copy-on-write map of its decoded
        bytes, written once to a spill file (`spill.py`): the file's own bytes are encoded."""
        unit = self._unit_of.get(key)
        if unit is None:
            return self.shard(key).view(key)
        with self._decode_lock:
            flat = self._spilled.get(unit)
        if flat is None:
            raw = self._raw(unit)
            with self._decode_lock:
                if unit not in self._spilled:
                    self._spill = self._spill or SpillFile()
                    self._spilled[unit] = self._spill.put(raw)
                flat = self._spilled[unit]
            del raw
            self.forget_decoded()  # its bytes are in the spill map now
        ft = self.tensors[key]
        return flat[ft.start:ft.end].view(ft.dtype).view(ft.shape)

    # units stored compressed --------------------------------------------------------
    def stored_name(self, key: str) -> str | None:
        """The unit stored compressed that holds tensor `key`, or None."""
        return self._unit_of.get(key)

    def stored_unit(self, pieces: list[tuple[str, int]], nbytes: int) -> StoredUnit | None:
        """The unit stored compressed that `pieces` (key, offset in a buffer of `nbytes`) lay out exactly as it was
        packed (every tensor of it, each at its packed offset): its encoded bytes can be copied to the device and
        decoded there. None otherwise (a plain unit, or laid out otherwise: `read_into` decodes on the CPU)."""
        if not pieces:
            return None
        unit = self.stored.get(self._unit_of.get(pieces[0][0], ""))
        if unit is None or unit.nbytes > nbytes or {k for k, _ in pieces} != set(unit.keys) \
                or len(pieces) != len(unit.keys):
            return None
        return unit if all(self.tensors[k].start == off for k, off in pieces) else None

    def read_stored(self, unit: StoredUnit, dst: torch.Tensor, start: int, end: int) -> int:
        """Read the encoded bytes [start, end) of a unit stored compressed into `dst[:end - start]` (one positioned
        read); returns the bytes read. Raises if the shard changed."""
        shard = self._shards[unit.shard]
        if not 0 <= start <= end <= unit.stored:
            raise CorruptFileError(f"{self.path}: refused to read bytes [{start}, {end}) of the {unit.stored} "
                                   f"encoded bytes of {unit.name!r}")
        shard._read_at(dst[:end - start], unit.offset + start)
        shard.check_unchanged()
        return end - start

    def encoded(self, unit: StoredUnit) -> codec.Encoded:
        """A unit stored compressed as the codec's `Encoded` in RAM, its escapes checked (the index was checked at
        open: decoding it writes only inside the unit). The last unit read is kept until another is read or
        `forget_decoded`, so staging reads each unit once for its encoding and its tensors."""
        with self._decode_lock:
            if self._last is not None and self._last[0] == unit.name:
                return self._last[1]
        blob = torch.empty(unit.stored, dtype=torch.uint8)
        self.read_stored(unit, blob, 0, unit.stored)
        enc = codec.Encoded(blob, unit.chunks, unit.nbytes)
        try:
            codec.check_escapes(enc)
        except ValueError as exc:
            raise self._fail(f"unit {unit.name!r}: {exc}") from None
        with self._decode_lock:
            self._last = (unit.name, enc, None)
        return enc

    def _raw(self, name: str) -> torch.Tensor:
        """The decoded bytes of a unit stored compressed (kept with its encoding, as `encoded` says)."""
        with self._decode_lock:
            if self._last is not None and self._last[0] == name and self._last[2] is not None:
                return self._last[2]
        enc = self.encoded(self.stored[name])
        raw = codec.decode(enc)
        with self._decode_lock:
            self._last = (name, enc, raw)
        return raw

    def forget_decoded(self) -> None:
        """Let go of the last unit read and decoded (its encoded and raw bytes): staging is done with it."""
        with self._decode_lock:
            self._last = None

    def _read_decoded(self, dst: torch.Tensor, pieces: list[tuple[str, int]], start: int, end: int,
                      whole: bool = False) -> int:
        """The pieces of units stored compressed, decoded on the CPU, into `dst` (bytes [start, end) of the
        buffer `pieces` lay out; `whole`: `dst` is that whole buffer); returns the encoded bytes read."""
        done, read = set(), 0
        for key, off in pieces:
            unit = self._unit_of.get(key)
            if unit is None:
                continue
            ft = self.tensors[key]
            n = ft.end - ft.start
            if off < 0 or (whole and off + n > dst.numel()):
                raise CorruptFileError(f"{self.path}: {key!r} ({n} bytes) does not fit its place at byte {off}; "
                                       f"the packed model does not match the model's layout")
            lo, hi = max(start, off), min(end, off + n)
            if lo >= hi:
                continue
            raw = self._raw(unit)
            dst[lo - start:hi - start].copy_(raw[ft.start + lo - off:ft.start + hi - off])
            if unit not in done:
                done.add(unit)
                read += self.stored[unit].stored
        return read

    def close(self) -> None:
        for s in self._shards.values():
            s.close()
        self.forget_decoded()
        self._spilled.clear()
        if self._spill is not None:
            self._spill.close()


def is_packed(path: str | os.PathLike) -> bool:
    """Whether `path` is a packed folder (or its index.json)."""
    p = Path(path)
    return (p / INDEX).is_file() if p.is_dir() else p.name == INDEX


def open_weights(path: str | os.PathLike) -> SafetensorsFile | PackedWeights:
    """A model's weights for the disk tier: a packed folder (see the module docstring), a GGUF file
    (`gguf_file.GgufFile`) or a safetensors file."""
    p = Path(path)
    if p.is_dir() or p.name == INDEX:
        if not os.path.lexists(p / INDEX if p.is_dir() else p):  # present but not a file: refused when it is read
            raise CorruptFileError(f"{p}: a folder without {INDEX} is not a packed model (python -m offload pack)")
        return PackedWeights(p)
    if is_gguf(p):
        return GgufFile(p)
    return SafetensorsFile(p)
