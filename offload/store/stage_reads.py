"""The file reads (and encodes) of staging, ahead of the unit being bound: worker threads, one per core torch is
given, read the next units of a model from its file with large positioned reads straight into their host buffers
(a unit's tensors that lie together in the file are one `preadv`), and encode the units held compressed from a
transient buffer of their own into the blob's final place, while staging binds the units before them. Torch runs
each worker's ops on one thread (the workers are the parallelism; a pool of OpenMP threads per worker would
oversubscribe the cores), and is given its thread count back when staging ends.

`SetupTimes` adds up where the time went (read, encode, spill, pin) for the report.
"""
from __future__ import annotations

import concurrent.futures as futures
import mmap
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..model.layout import TensorLayout
from . import codec



@dataclass
class SetupTimes:
    """Where a model's setup spent its time (milliseconds; read/encode/spill/pin add up the workers' time)."""

    total_ms: float = 0.0
    layout_ms: float = 0.0  # units found, laid out, matched against the file's header
    plan_ms: float = 0.0  # the facts gathered (encoded sizes estimated) and the plan made
    stage_ms: float = 0.0  # every unit's master in place (wall time)
    read_ms: float = 0.0  # positioned reads of the file into host buffers
    encode_ms: float = 0.0  # units encoded (histogram, codes, packing)
    spill_ms: float = 0.0  # raw bytes of units held compressed written to the spill file
    pin_ms: float = 0.0  # host buffers allocated (pinned where the plan says) and registered
    workers: int = 1
    encoded_units: int = 0  # units encoded at setup
    stored_units: int = 0  # units whose encoding a packed folder stores (taken, not encoded)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, what: str, seconds: float) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + seconds * 1e3)

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - t0)

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()
                if not k.startswith("_")}


def fill_from(layout: TensorLayout, dst: torch.Tensor, file: Any, keys: list[Any] | None,
              times: SetupTimes | None = None) -> list[int]:
    """Put a unit's bytes into the flat buffer `dst`: leaves on the meta device (and persistent buffers of a model
    loaded from its file) read from `file`, row-major ones straight into place by one call (neighbours in the file
    by one positioned read), the others copied from the module's tensors. Returns the leaves read from the file."""
    views = None
    pieces, strided, from_file = [], [], []
    with torch.no_grad():
        for i, src in enumerate(layout.sources()):
            leaf = layout.leaves[i]
            if src.is_meta or leaf.meta:
                from_file.append(i)
                (pieces.append((keys[i], leaf.offset)) if leaf.stride is None else strided.append(i))
                continue
            if views is None:
                views = layout.leaf_views(dst)
            views[i].copy_(src)
            del src
        if pieces or strided:
            t0 = time.perf_counter()
            if pieces:
                file.read_into(dst, pieces)
            if strided:
                views = views or layout.leaf_views(dst)
                for i in strided:
                    views[i].copy_(file.read_tensor(keys[i]))
            if times is not None:
                times.add("read_ms", time.perf_counter() - t0)
    return from_file


def write_through(layout: TensorLayout, file: Any, keys: list[Any] | None,
                  times: SetupTimes | None = None) -> Callable[[int, int], list[int]] | None:
    """For a unit every leaf of which comes from the file (row-major, aligned: a model built on the meta device), a
    writer of its bytes through a descriptor (`fd`, the unit's `offset` there): each tensor written from the file's
    pages (a read-only map of the unit's range, closed at once) straight into the destination's (the shared host
    copy's) by `pwrite`, the padding left a hole (it reads as zeros). None where some leaf is not such (the caller
    fills a mapping instead)."""
    if file is None or not keys or not hasattr(file, "tensors") or not hasattr(os, "pwrite"):
        return None
    stored_name = getattr(file, "stored_name", None)
    leaves = layout.leaves
    if not all(leaf.meta and leaf.stride is None and k is not None and file.aligned(k)
               and (stored_name is None or stored_name(k) is None) for leaf, k in zip(leaves, keys)):
        return None
    if not all(t.is_meta or leaf.meta for t, leaf in zip(layout.sources(), leaves)):
        return None

    def write(fd: int, offset: int) -> list[int]:
        t0 = time.perf_counter()
        by_file: dict[int, list[tuple[Any, Any]]] = {}
        readers = {}
        for key, leaf in zip(keys, leaves):
            reader = file.shard(key) if hasattr(file, "shard") else file  # a packed folder: the shard holding it
            readers[id(reader)] = reader
            by_file.setdefault(id(reader), []).append((reader.tensors[key], leaf))
        for rid, pieces in by_file.items():
            reader = readers[rid]
            lo = min(ft.start for ft, _ in pieces) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            hi = max(ft.end for ft, _ in pieces)
            # a map of this unit's range alone, let go at once: the model's file stays unmapped (no resident pages)
            view = mmap.mmap(reader._fd, hi - lo, offset=lo, access=mmap.ACCESS_READ)
            data = memoryview(view)
            try:
                for ft, leaf in pieces:
                    with data[ft.start - lo:ft.end - lo] as part:
                        done = 0
                        while done < leaf.nbytes:  # a full /dev/shm: ENOSPC here, raised as itself
                            done += os.pwrite(fd, part[done:], offset + leaf.offset + done)
            finally:
                data.release()  # no view of the map left, so closing it cannot mask an error with BufferError
                view.close()
        file.check_unchanged()  # a write that raced the copy must not pass as the original bytes
        if times is not None:
            times.add("read_ms", time.perf_counter() - t0)
        return list(range(len(leaves)))

    return write


_transient = threading.local()


def transient(nbytes: int) -> torch.Tensor:
    """A worker's reusable buffer of at least `nbytes` (a unit's raw bytes on their way to being encoded)."""
    buf = getattr(_transient, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _transient.buf = None  # the old one goes first
        buf = _transient.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes]


def drop_transients() -> None:
    """Let go of this thread's transient buffer and decode scratch (the workers' go with their threads)."""
    _transient.buf = None
    _scratch.s = None


def encode_unit(layout: TensorLayout, file: Any, keys: list[Any] | None,
                alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]] | None, pin: bool,
                times: SetupTimes, spill: Any = None) -> tuple[torch.Tensor, codec.Encoded, bool, list[int]]:
    """A unit read into a transient buffer and encoded straight into its blob (allocated once its exact size is
    known: `alloc_host`, or a plain CPU tensor without it), its raw bytes written to `spill`. Returns (the spill map
    of its raw bytes, or the transient itself without `spill`: the calling thread's, valid until its next unit; the
    encoding; pinned; the leaves read from the file)."""
    raw = transient(layout.nbytes)
    from_file = fill_from(layout, raw, file, keys, times)
    t0 = time.perf_counter()
    chunks = codec.plan(raw, layout.leaves)
    size = codec.encoded_size(chunks)
    times.add("encode_ms", time.perf_counter() - t0)
    t0 = time.perf_counter()
    if alloc_host is not None:
        blob, pinned = alloc_host(size, pin)
    else:
        blob, pinned = torch.empty(size, dtype=torch.uint8), False
    times.add("pin_ms", time.perf_counter() - t0)
    t0 = time.perf_counter()
    encoded = codec.write(raw, chunks, blob)
    times.add("encode_ms", time.perf_counter() - t0)
    with times._lock:
        times.encoded_units += 1
    if spill is not None:
        t0 = time.perf_counter()
        raw = spill.put(raw)
        times.add("spill_ms", time.perf_counter() - t0)
    return raw, encoded, pinned, from_file


_scratch = threading.local()


def decode_stored(layout: TensorLayout, file: Any, stored: Any,
                  alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]], pin: bool, times: SetupTimes,
                  spill: Any) -> tuple[torch.Tensor, codec.Encoded, bool, list[int]]:
    """A unit a packed folder stores compressed, laid out as stored: its encoded bytes read once into its blob (the
    encoding it keeps: nothing encoded again; escapes checked by the folder), decoded on the CPU into a transient
    buffer and spilled (what its modules view between passes). Returns what `encode_unit` does."""
    t0 = time.perf_counter()
    blob, pinned = alloc_host(stored.stored, pin)
    times.add("pin_ms", time.perf_counter() - t0)
    t0 = time.perf_counter()
    file.read_stored(stored, blob, 0, stored.stored)  # straight into the blob it keeps
    encoded = codec.Encoded(blob, stored.chunks, stored.nbytes)
    try:
        codec.check_escapes(encoded)
    except ValueError as exc:
        raise file._fail(f"unit {stored.name!r}: {exc}") from None
    times.add("read_ms", time.perf_counter() - t0)
    t0 = time.perf_counter()
    raw = transient(layout.nbytes)
    raw[stored.nbytes - encoded.size:stored.nbytes].copy_(blob)
    scratch = getattr(_scratch, "s", None) or codec.DecodeScratch()
    _scratch.s = scratch
    codec.decode_into(raw, encoded.chunks, stored.nbytes, encoded.size, scratch)
    raw[stored.nbytes:].zero_()
    times.add("encode_ms", time.perf_counter() - t0)
    with times._lock:
        times.stored_units += 1
    t0 = time.perf_counter()
    master = spill.put(raw)
    times.add("spill_ms", time.perf_counter() - t0)
    return master, encoded, pinned, list(range(len(layout.leaves)))


def ram_unit(layout: TensorLayout, file: Any, keys: list[Any] | None,
             alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]], pin: bool,
             times: SetupTimes) -> tuple[torch.Tensor, bool]:
    """A unit's host buffer allocated (pinned where asked) and filled (`fill_from`): (buffer, pinned)."""
    t0 = time.perf_counter()
    host, pinned = alloc_host(layout.nbytes, pin)
    times.add("pin_ms", time.perf_counter() - t0)
    fill_from(layout, host, file, keys, times)
    return host, pinned


def workers() -> int:
    """Worker threads for staging: the cores torch is given."""
    return max(1, min(8, torch.get_num_threads()))


class ReadAhead:
    """Jobs (one per unit, None: nothing to do ahead) run on worker threads in order, at most one per worker ahead of
    the one the caller waits for (host memory rises by about that many units while staging); `take(i)` waits for job i (re-raising its error). Torch runs on one thread per worker
    meanwhile (restored by `close`)."""

    def __init__(self, jobs: list[Callable[[], Any] | None], n_workers: int | None = None) -> None:
        self.jobs = jobs
        self.n = n_workers or workers()
        self._threads = torch.get_num_threads()
        self._pool = futures.ThreadPoolExecutor(self.n, thread_name_prefix="layer-offload-stage") \
            if self.n > 1 and any(j is not None for j in jobs) else None
        self.pooled = self._pool is not None  # workers ran: their arenas hold freed transients until trimmed
        if self._pool is not None:
            torch.set_num_threads(1)
        self._futures: dict[int, futures.Future] = {}
        self._next = 0
        self._fill(0)

    def _fill(self, upto: int) -> None:
        if self._pool is None:
            return
        while self._next < len(self.jobs) and self._next <= upto + self.n:
            job = self.jobs[self._next]
            if job is not None:
                self._futures[self._next] = self._pool.submit(job)
            self._next += 1

    def take(self, i: int) -> Any:
        """Job i's result (run here when there are no workers)."""
        job = self.jobs[i]
        if job is None:
            return None
        if self._pool is None:
            return job()
        self._fill(i)
        return self._futures.pop(i).result()

    def close(self) -> None:
        if self._pool is not None:
            for f in self._futures.values():
                f.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None
            self._futures.clear()
            torch.set_num_threads(self._threads)
