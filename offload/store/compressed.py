"""A unit held compressed in host RAM: staged once (encoded, its raw bytes spilled), streamed as its encoded bytes
and decoded on the device into the slot.

`stage_compressed` stages one unit the way `StagingBuffer.in_ram` does, with one more step: its raw bytes go into
a transient buffer, are encoded (`codec.encode`), written to the spill file (its modules view a copy-on-write map
of it between passes, see `spill.py`) and let go; RAM keeps only the encoded blob (pinned where allowed). Peak
host memory while staging rises by about one unit, as for raw staging.

`CompressedSource` is the unit's `UnitSource`: the copy engine moves the blob into the tail of the slot (straight
from pinned RAM, or through the read-ahead thread's bounce buffers), then the decode runs on the transfer stream
after it (`Backend.then`), so the compute stream's wait on the returned event covers copy and decode, and the
copy time the metrics measure includes the decode. A master written in place (`invalidate`) is encoded again
before its next copy.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from ..model.layout import Leaf, TensorLayout
from . import codec
from .sources import BounceReader, DiskSource
from .spill import SpillFile

log = logging.getLogger(__name__)


class CompressedSource:
    """A unit's encoded blob in host RAM, decoded on the device after its copy (see the module docstring)."""

    compression = codec.CODEC

    def __init__(self, encoded: codec.Encoded, blob: torch.Tensor, pinned: bool, backend: Any,
                 reader: BounceReader | None, master: torch.Tensor, leaves: list, alloc_host: Callable,
                 segment: Any = None) -> None:
        self.encoded = encoded
        self.blob = blob  # the encoded bytes in host RAM (pinned where allowed)
        self.pinned = pinned
        self.tier = "pinned" if pinned else "pageable"
        self.nbytes = encoded.nbytes
        self.backend = backend
        self.reader = reader
        self.master = master  # the raw bytes as the modules see them between passes (the spill map)
        self.leaves = leaves
        self.alloc_host = alloc_host
        self.reads = 0
        self.read_ms = 0.0
        self.decode_ms = 0.0  # CPU time spent encoding again after writes
        self._stale = False
        self._lock = threading.Lock()
        self.segment = segment  # the host copy shared between processes the blob lies in (None: this process's own)

    @property
    def host_bytes(self) -> int:
        return int(self.blob.numel())

    def invalidate(self) -> None:
        """The raw master was written in place: encode it again before the next copy."""
        self._stale = True

    def _refresh(self) -> None:
        with self._lock:
            if not self._stale:
                return
            t0 = time.perf_counter()
            encoded = codec.encode(self.master, self.leaves)
            blob, pinned = self.alloc_host(encoded.size, self.pinned)
            blob.copy_(encoded.blob)
            self.encoded, self.blob, self.pinned = encoded, blob, pinned
            self.segment = None  # written in this process: a private blob; the others keep the shared one
            self.tier = "pinned" if pinned else "pageable"
            self._stale = False
            self.decode_ms += (time.perf_counter() - t0) * 1e3
            log.debug("a compressed unit was written in place: encoded again (%d bytes)", encoded.size)

    def _decode(self, dst: torch.Tensor, encoded: codec.Encoded) -> Callable[[], None]:
        scratch = decode_scratch(self.backend)
        return lambda: codec.decode_into(dst, encoded.chunks, encoded.nbytes, encoded.size, scratch)

    def _fill(self, blob: torch.Tensor) -> Callable[[torch.Tensor, int, int], int]:
        def fill(buf: torch.Tensor, start: int, end: int) -> int:
            _, ms = self.reader.clock.timed("bounce", end - start, lambda: buf[:end - start].copy_(blob[start:end]))
            self.read_ms += ms
            return 0
        return fill

    def issue(self, dst: torch.Tensor, after: Any) -> Any:
        if self._stale:
            self._refresh()
        encoded, blob = self.encoded, self.blob
        n, m = encoded.nbytes, encoded.size
        tail = dst[n - m:n]
        decode = self._decode(dst, encoded)
        if self.pinned or not self.backend.supports_pinned_host or self.reader is None:
            return self.backend.then(self.backend.copy_h2d(tail, blob, after), decode)
        self.reads += 1
        return self.reader.submit(self._fill(blob), m, tail, after,
                                  then=lambda event: self.backend.then(event, decode))


class StoredDiskSource:
    """A disk-tier unit stored compressed in a packed folder (`pack --compress`): its encoded bytes read from the
    shard into bounce buffers, copied into the tail of the slot, decoded on the device as `CompressedSource` does."""

    tier = "disk"
    compression = codec.CODEC

    def __init__(self, file: Any, unit: Any, nbytes: int, reader: BounceReader, backend: Any) -> None:
        self.file = file
        self.unit = unit  # index_check.StoredUnit
        self.nbytes = nbytes  # the slot's bytes (the unit's raw bytes fit in them)
        self.reader = reader
        self.backend = backend
        self.reads = 0
        self.read_ms = 0.0

    def _fill(self, buf: torch.Tensor, start: int, end: int) -> int:
        n, ms = self.reader.clock.timed("disk", end - start, lambda: self.file.read_stored(self.unit, buf, start, end))
        self.read_ms += ms
        return n

    def issue(self, dst: torch.Tensor, after: Any) -> Any:
        self.reads += 1
        u = self.unit

        scratch = decode_scratch(self.backend)

        def decode() -> None:
            codec.decode_into(dst, u.chunks, u.nbytes, u.stored, scratch)

        return self.reader.submit(self._fill, u.stored, dst[u.nbytes - u.stored:u.nbytes], after,
                                  then=lambda event: self.backend.then(event, decode))


_said_layout: set[str] = set()
_scratches: dict[int, codec.DecodeScratch] = {}
_scratch_lock = threading.Lock()


def decode_scratch(backend: Any) -> codec.DecodeScratch:
    """The decode scratch of a backend's device: one, reused by every unit decoded on it (its decodes run in order on
    its transfer stream)."""
    with _scratch_lock:
        found = _scratches.get(id(backend))
        if found is None:
            found = _scratches[id(backend)] = codec.DecodeScratch()
        return found



def disk_source(file: Any, keys: list[Any], leaves: list[Leaf], nbytes: int, reader: BounceReader,
                backend: Any, casts: tuple | None = None, residue: list | None = None) -> Any:
    """The source of a disk-tier unit: its encoded bytes decoded on the device where the file stores it compressed
    laid out as the unit is (`StoredDiskSource`), else its bytes as stored (`DiskSource`; a unit stored compressed
    but laid out otherwise is then decoded on the CPU, said once per file; leaves cast on read: `casts`; leaves the
    file lacks copied from the unit's residue in RAM: `residue`, as `StagingBuffer.residue_pieces` gives it)."""
    if residue or (casts is not None and any(c is not None for c in casts)):
        return DiskSource(file, keys, leaves, nbytes, reader, casts, residue)
    pieces = [(k, leaf.offset) for k, leaf in zip(keys, leaves)]
    stored_unit = getattr(file, "stored_unit", None)
    unit = stored_unit(pieces, nbytes) if stored_unit is not None else None
    if unit is not None:
        return StoredDiskSource(file, unit, nbytes, reader, backend)
    if stored_unit is not None and any(file.stored_name(k) is not None for k in keys) \
            and str(file.path) not in _said_layout:
        _said_layout.add(str(file.path))
        log.warning("%s: blocks stored compressed are laid out unlike the model's, so they are decoded on the CPU "
                    "each time they stream (slow); pack them from the offloaded model (OffloadHandle.pack(..., "
                    "compress=True)) to decode them on the device", file.path)
    return DiskSource(file, keys, leaves, nbytes, reader)


SAMPLE_RUN = 512  # elements read together by the estimate: a pattern repeating within a run is sampled as it is


def _sample(flat: torch.Tensor, sample_elems: int) -> torch.Tensor:
    """About `sample_elems` elements of `flat` as runs of SAMPLE_RUN consecutive ones spread evenly over it (a
    stride of single elements would alias with a pattern of that period: every other element alike, say)."""
    n = flat.numel()
    if n <= sample_elems:
        return flat.contiguous()
    flat = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    runs = max(1, sample_elems // SAMPLE_RUN)
    run = min(SAMPLE_RUN, n // runs)
    starts = torch.linspace(0, n - run, runs).long()
    index = (starts[:, None] + torch.arange(run)[None, :]).reshape(-1)
    return flat[index]


def estimate_layout_size(layout: TensorLayout, sample_elems: int = 1 << 16) -> int:
    """A unit's encoded size before anything is encoded: per dtype, its tensors sampled in evenly spread runs (each
    in proportion to its size) and coded together as the unit-wide code codes them; a tensor still on the meta
    device is estimated from its dtype. Runs of a dtype shorter than the codec codes stay raw."""
    total = layout.nbytes
    by_dtype: dict[torch.dtype, list[tuple[Any, torch.Tensor]]] = {}
    with torch.no_grad():
        for leaf, src in zip(layout.leaves, layout.sources()):
            if not codec.codable(leaf.dtype) or leaf.nbytes == 0:
                continue
            if src.is_meta or leaf.meta:
                total -= leaf.nbytes - codec.estimate_by_dtype([leaf], leaf.nbytes)
                continue
            by_dtype.setdefault(leaf.dtype, []).append((leaf, src))
        for dtype, found in by_dtype.items():
            nbytes = sum(leaf.nbytes for leaf, _ in found)
            if nbytes < codec.MIN_RUN_BYTES:
                continue
            samples = [_sample(src.detach().reshape(-1), max(SAMPLE_RUN, sample_elems * leaf.nbytes // nbytes))
                       .reshape(-1).view(torch.uint8) for leaf, src in found]
            sample = torch.cat(samples) if len(samples) > 1 else samples[0]
            guess = codec.estimate_size(sample, [codec_leaf(sample.numel(), dtype)], sample_elems)
            total -= nbytes - min(nbytes, int(nbytes * guess / max(1, sample.numel())))
    return total


def codec_leaf(nbytes: int, dtype: torch.dtype) -> Any:
    """A stand-in leaf (offset 0) for encoding one tensor's bytes on their own."""
    return Leaf(0, nbytes, dtype, (nbytes,), None)


def unit_host_bytes(staged: Any) -> int:
    """Host RAM a staged unit's master holds: its encoded blob when compressed, its raw bytes in RAM, on disk its
    residue (the leaves the file lacks)."""
    source = staged.source
    if isinstance(source, CompressedSource):
        return source.host_bytes
    if staged.master.host is None:  # the disk tier: the leaves the file lacks, in RAM (its residue)
        residue = getattr(staged.master, "residue", None)
        return 0 if residue is None else int(residue.numel())
    return staged.master.layout.nbytes


def unit_shared(staged: Any) -> bool:
    """Whether a unit's host master lies in the host copy shared between processes (raw, or its encoded blob)."""
    return staged.master.shared is not None or getattr(staged.source, "segment", None) is not None


def unit_segment(staged: Any) -> tuple[Any, int] | None:
    """(the shared host copy, the unit's index in it) where the unit's master lies in one, else None."""
    if staged.master.shared is not None:
        return staged.master.shared.copy, staged.master.shared.index
    segment = getattr(staged.source, "segment", None)
    return (segment, staged.index) if segment is not None else None


def unit_compression(staged: Any) -> str:
    """The form a unit's host master is held in: the codec's name, or "none"."""
    return source_compression(staged.source)


def source_compression(source: Any) -> str:
    """The form a unit's bytes stream in: the codec's name (held compressed, or stored so in a packed folder)."""
    return getattr(source, "compression", "none")


def master_written(source: Any) -> None:
    """A unit's raw host master was written in place: a compressed source encodes it again before its next copy."""
    invalidate = getattr(source, "invalidate", None)
    if invalidate is not None:
        invalidate()


def bind_master(layout: TensorLayout, host: torch.Tensor) -> Any:
    """Point the unit's modules at views of `host` (its new master) and return that binding."""
    layout.rebind_fresh(layout.leaf_views(host))
    binding = layout.build(host, master=True)
    binding.apply()
    layout.adopt_params()
    return binding


def stage_compressed(layout: TensorLayout, sources: list[torch.Tensor], encoded_in: codec.Encoded | None,
                     spill: SpillFile, alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]],
                     pin: bool, encode: bool = True,
                     put: Callable[[codec.Encoded], torch.Tensor | None] | None = None,
                     ) -> tuple[torch.Tensor, Any, bool, Any]:
    """One unit's compressed host form: (raw master viewing the spill file, blob, pinned, encoding); without
    `encode`, the spill map alone (blob and encoding None: the weights outside the blocks, kept on the device).

    `sources` are the leaves' tensors (read from the file already where they were on the meta device); the raw
    bytes exist only transiently here. `put` places the blob in the host copy shared between processes (it
    returns the blob there, pinned later by the copy, or None: a blob of this process's own)."""
    raw = torch.empty(layout.nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for view, src in zip(layout.leaf_views(raw), sources):
            view.copy_(src)
    if not encode:
        master = spill.put(raw)
        return master, None, False, None
    encoded = encoded_in or codec.encode(raw, layout.leaves)
    master = spill.put(raw)
    del raw
    blob = put(encoded) if put is not None else None
    if blob is not None:
        encoded.blob = blob
        return master, blob, False, encoded
    blob, pinned = alloc_host(encoded.size, pin)
    blob.copy_(encoded.blob)
    encoded.blob = blob
    return master, blob, pinned, encoded


def stage_unit_compressed(layout: TensorLayout, file: Any, keys: list[str] | None, spill: SpillFile,
                          alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]], pin: bool, encode: bool,
                          copy: Any = None, index: int = -1, encoded_in: codec.Encoded | None = None,
                          ) -> tuple[torch.Tensor, bool, Any, Any]:
    """(raw master viewing the spill map, pinned, encoding, the shared host copy holding the blob or None) for one
    unit. Leaves on the meta device are read from `file`. With `copy` (the host copy shared between processes,
    `shared_host.SharedHostCopy`), its filler puts the blob there; a joiner takes the blob the copy holds for unit
    `index` (`stage_shared_compressed`); where the copy cannot hold it or holds other bytes, the blob is private.
    `encoded_in`: the unit's encoding as a packed folder stores it (not encoded again)."""
    shared = copy.encoded_unit(index) if copy is not None else None
    if shared is not None:
        host = stage_shared_compressed(layout, shared, set(copy.file_leaves.get(index, ())), spill)
        copy.took(index, host is not None)
        if host is not None:
            return host, False, shared, copy
    from_file = [i for i, src in enumerate(layout.sources()) if src.is_meta or layout.leaves[i].meta]
    sources = [file.read_tensor(keys[i]) if i in from_file else src for i, src in enumerate(layout.sources())]
    put = (lambda enc: copy.put_encoded(index, enc, from_file)) if copy is not None and copy.filler else None
    host, _, pinned, encoded = stage_compressed(layout, sources, encoded_in, spill, alloc_host, pin, encode, put)
    return host, pinned, encoded, copy if put is not None and index in copy.encoded else None


def stage_shared_compressed(layout: TensorLayout, encoded: codec.Encoded, from_file: set[int],
                            spill: SpillFile) -> torch.Tensor | None:
    """A joining process's raw master (the spill map) for a unit the shared host copy holds encoded: the blob is
    decoded on the CPU once, checked against the bytes this process holds (a leaf on the meta device only where the
    filler read that very leaf from the file) and spilled; None when they differ (the unit stays private)."""
    try:
        raw = codec.decode(encoded)
    except (RuntimeError, IndexError, ValueError) as exc:  # a chunk table that does not fit its blob
        log.warning("the shared host copy holds a unit this process cannot decode (%s); it stays private", exc)
        return None
    with torch.no_grad():
        for k, (view, src) in enumerate(zip(layout.leaf_views(raw), layout.sources())):
            if src.is_meta or layout.leaves[k].meta:
                ok = k in from_file
            else:
                ok = torch.equal(view.contiguous().reshape(-1).view(torch.uint8),
                                 src.detach().contiguous().reshape(-1).view(torch.uint8))
            del src
            if not ok:
                return None
    return spill.put(raw)


DEFAULT_DECODE_GBPS = 100.0  # decode rate (GB/s of raw bytes) assumed for a named card until measured on it
_decode_rates: dict[int, float] = {}


def estimated_packed_sizes(modules: list, sizes: list[int]) -> list[int]:
    """Each unit's encoded size estimated from its tensors' dtypes (`codec.estimate_by_dtype`), scaled to `sizes`
    (the bytes a unit streams: a model file's where it is known)."""
    out = []
    for module, size in zip(modules, sizes):
        leaves = [codec_leaf(t.numel() * t.element_size(), t.dtype)
                  for t in list(module.parameters()) + list(module.buffers())]
        raw = sum(leaf.nbytes for leaf in leaves)
        ratio = codec.estimate_by_dtype(leaves, raw) / raw if raw else 1.0
        out.append(int(size * ratio))
    return out


def measure_decode_gbps(backend: Any, nbytes: int = 16 << 20) -> float:
    """The device's decode rate in GB/s of raw bytes: a unit of bf16 weights drawn like trained ones, encoded on the
    CPU, decoded on the device in place after its copy (the copy not timed); best of three, measured once."""
    key = id(backend)
    if key not in _decode_rates:
        g = torch.Generator().manual_seed(0)
        raw = (torch.randn(nbytes // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
        encoded = codec.encode(raw, [codec_leaf(nbytes, torch.bfloat16)])
        buf = backend.alloc(nbytes)
        try:
            best = float("inf")
            for _ in range(3):
                copy = backend.copy_h2d(buf[nbytes - encoded.size:], encoded.blob)
                backend.event_synchronize(copy)
                t0 = time.perf_counter()
                scratch = decode_scratch(backend)
                backend.event_synchronize(backend.then(copy, lambda: codec.decode_into(buf, encoded.chunks, nbytes,
                                                                                         encoded.size, scratch)))
                best = min(best, time.perf_counter() - t0)
        finally:
            backend.release(buf)
        _decode_rates[key] = nbytes / max(best, 1e-9) / 1e9
    return _decode_rates[key]
