"""The model's safetensors file, read as the disk tier needs it: the header parsed and checked (`SafetensorsFile`),
tensors matched to a model's by name, dtype and shape, positioned reads of one unit's tensors into a buffer (whole
or in ranges), and change detection.

File reads are positioned reads on the file descriptor, never loads through a memory map: a file truncated
while a model streams from it gives a clear error naming it instead of killing the process with SIGBUS. The
file's size and modification time are checked before each pass and after each read, so a file rewritten in
place is refused, never silently streamed. The mapping exists only so that a disk-tier unit's parameters can
view their bytes between forwards without a copy in RAM. Where a unit's bytes go from here is `sources.py`.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from ..model.layout import Leaf
from .header_check import CorruptFileError, FileTensor, open_regular, read_safetensors_header  # noqa: F401

log = logging.getLogger(__name__)

_IOV_MAX = 1024  # iovecs one preadv takes (Linux IOV_MAX)
_GAP_MAX = 1 << 16  # file ranges at most this far apart are read by one positioned read


class SourceChangedError(RuntimeError):
    """The file a model streams from changed on disk (truncated, rewritten) after it was offloaded."""


class _ModifyWatch:
    """Linux inotify on one file: sees every write and truncation at once, whatever the timestamp granularity.

    Elsewhere (or when inotify is unavailable) it sees nothing and the size/mtime check alone applies.
    """

    IN_MODIFY = 0x2
    IN_NONBLOCK = 0o4000
    IN_CLOEXEC = 0o2000000

    def __init__(self, path: Path) -> None:
        self.fd = -1
        self.seen = False
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
            if fd < 0:
                return
            if libc.inotify_add_watch(fd, os.fsencode(path), self.IN_MODIFY) < 0:
                os.close(fd)
                return
            self.fd = fd
        except (OSError, AttributeError):  # no libc symbol, or no inotify on this kernel
            self.fd = -1

    def modified(self) -> bool:
        """Whether the file was written since the watch began (non-blocking)."""
        if self.fd >= 0 and not self.seen:
            try:
                self.seen = bool(os.read(self.fd, 4096))
            except BlockingIOError:
                pass
            except OSError:
                return False
        return self.seen


def _close_fds(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def strippable(names: list[str]) -> int:
    """How many leading name parts every name shares, up to the part before its first index (a number: the block's
    container and index stay, `layers.0`) and never its last two parts: the parts `keys_for` may strip."""
    split = [n.split(".") for n in names]
    shortest = min(len(parts) for parts in split)
    k = 0
    while k < shortest - 2 and all(parts[k] == split[0][k] for parts in split):
        if split[0][k].isdigit():
            return max(0, k - 1)
        k += 1
    return k


def _writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (no numpy needed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class SafetensorsFile:
    """A validated safetensors header, positioned reads, and a private map for zero-copy parameter views."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = open_regular(self.path, self._what)  # a FIFO, device or folder is refused before it is opened
        try:
            self.tensors = self._read_header(os.fstat(self._fd).st_size)
            self._watch = _ModifyWatch(self.path)
            self._identity = self._stat()
        except BaseException:
            os.close(self._fd)
            raise
        self._mmap: mmap.mmap | None = None
        self._flat: torch.Tensor | None = None
        self._seek_lock = threading.Lock()  # only where os.preadv is missing (Windows)
        # a model dropped without detach() closes its file too (the mapping goes with the last view of it)
        self._closer = weakref.finalize(self, _close_fds, self._fd, self._watch.fd)

    _what = "safetensors file"

    def _fail(self, why: str) -> CorruptFileError:
        return CorruptFileError(f"{self.path}: truncated or corrupt safetensors file ({why})")

    metadata: dict = {}  # the header's __metadata__ (validated: an object)

    def _read_header(self, size: int) -> dict[str, FileTensor]:
        """The header's tensors, validated by `header_check` (size cap, JSON limits, dtypes, shapes, spans)."""
        tensors, self.metadata = read_safetensors_header(self._fd, self.path, size)
        return tensors

    # identity -------------------------------------------------------------------
    def _stat(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def check_unchanged(self) -> None:
        """Raise SourceChangedError if the file was truncated or rewritten since it was opened.

        The open descriptor follows the file itself: a file deleted or replaced by rename keeps serving the
        bytes it had, so only writes into this very file count as a change.
        """
        if self._fd < 0:
            raise SourceChangedError(f"{self.path}: the file was closed (the model was detached)")
        now = self._stat()
        if now != self._identity or self._watch.modified():
            was_size, _ = self._identity
            size, _ = now
            what = (f"truncated from {was_size} to {size} bytes" if size < was_size else
                    f"rewritten in place ({was_size} -> {size} bytes)")
            raise SourceChangedError(
                f"{self.path}: the model's weights file was {what} while the model streams from it; its "
                f"blocks can no longer be read as they were. Load the model again (in ComfyUI: reload it, or re-run "
                f"the loader; in Python: offload it again); restoring the file does not make this copy readable again")

    # matching -------------------------------------------------------------------
    def match(self, names: list[str], leaves: list[Leaf]) -> list[str]:
        """The file keys for the model's tensor names (see `keys_for`); checks dtype/shape."""
        if not names:
            return []
        keys = self.keys_for(names)
        if keys is None:
            missing = [n for n in names if not any(p + n in self.tensors for p in self._prefixes(names[0]))]
            raise CorruptFileError(f"{self.path}: does not hold the model's weights; missing e.g. "
                                   f"{missing[:3]} (file has e.g. {list(self.tensors)[:3]})")
        for key, leaf in zip(keys, leaves):
            ft = self.tensors[key]
            if ft.dtype != leaf.dtype or tuple(ft.shape) != tuple(leaf.shape):
                raise CorruptFileError(f"{self.path}: {key!r} is {tuple(ft.shape)} {ft.dtype} in the file but "
                                       f"{tuple(leaf.shape)} {leaf.dtype} in the model; bytes stream as stored, so "
                                       f"the file must match the model's dtype")
        return keys

    def keys_for(self, names: list[str]) -> list[str] | None:
        """The file keys of the model's tensor names, or None: the names under a common key prefix of the file (a
        checkpoint's `model.diffusion_model.`), else without leading parts all the names share up to their first
        index (a text encoder `t5xxl.transformer.encoder.block.0...` read from a file of the encoder alone, whose keys
        are `encoder.block.0...`), where exactly one prefix of the file then holds them all."""
        if not names:
            return []
        for cand in self._prefixes(names[0]):
            if all(cand + n in self.tensors for n in names):
                return [cand + n for n in names]
        for k in range(1, strippable(names) + 1):
            tails = [n.split(".", k)[k] for n in names]
            found = {cand for cand in self._prefixes(tails[0]) if all(cand + t in self.tensors for t in tails)}
            if len(found) == 1:
                cand = found.pop()
                return [cand + t for t in tails]
            if found:
                return None  # held under several prefixes: which one is the model's cannot be told by name
        return None

    def _prefixes(self, name: str) -> list[str]:
        found = [""]
        for key in self.tensors:
            if key.endswith("." + name):
                found.append(key[: -len(name)])
        return found

    def aligned(self, key: str) -> bool:
        """Whether a tensor's offset allows a zero-copy view of its dtype."""
        ft = self.tensors[key]
        return ft.start % ft.dtype.itemsize == 0

    # reading --------------------------------------------------------------------
    def _read_at(self, dst: torch.Tensor, offset: int) -> None:
        """Fill a contiguous uint8 CPU tensor from `offset` with positioned reads; short reads are errors."""
        self._readv_at([_writable_bytes(dst)], offset)

    def _readv_at(self, views: list[memoryview], offset: int) -> None:
        """Fill `views` in turn from the file range starting at `offset` (one `os.preadv` while none comes up short)."""
        views = [v for v in views if len(v)]
        want = sum(len(v) for v in views)
        done = 0
        while views:
            if hasattr(os, "preadv"):
                n = os.preadv(self._fd, views, offset + done)
            else:  # pragma: no cover - Windows
                with self._seek_lock:
                    os.lseek(self._fd, offset + done, os.SEEK_SET)
                    chunk = os.read(self._fd, len(views[0]))
                    views[0][:len(chunk)] = chunk
                    n = len(chunk)
            if n <= 0:
                self.check_unchanged()
                raise SourceChangedError(f"{self.path}: read {done} of {want} bytes at offset {offset}: the "
                                         f"file ends early (was it truncated?)")
            done += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def _read_spans(self, spans: list[tuple[int, int, torch.Tensor]]) -> None:
        """Read file ranges [lo, hi) into uint8 CPU tensors. Ranges at most `_GAP_MAX` apart in the file are read
        together, by ONE positioned read scattering into their destinations; a gap goes to a scratch buffer, or
        straight into the destination when it lies as far apart there (the padding of a unit laid out as in the
        file). A unit whose tensors are contiguous in the file (a packed model's unit) is one sequential read."""
        for lo, hi, dst in spans:  # the lowest level: a span is read only into a destination exactly its length
            if lo < 0 or dst.dtype != torch.uint8 or not dst.is_contiguous() or dst.numel() != hi - lo:
                raise CorruptFileError(f"{self.path}: refused to read bytes [{lo}, {hi}) into a {dst.numel()}-byte "
                                       f"destination (a corrupt index or header laid the unit out wrong)")
        spans = sorted((s for s in spans if s[1] > s[0]), key=lambda s: s[0])
        by_address = sorted(s[2].data_ptr() for s in spans)
        after = dict(zip(by_address, by_address[1:]))  # the next destination in memory: nothing lies between
        i = 0
        while i < len(spans):
            lo, hi, dst = spans[i]
            prev = dst.data_ptr()
            parts: list[Any] = [[prev, hi - lo]]  # [address, length] or a scratch gap
            i += 1
            while i < len(spans) and len(parts) < _IOV_MAX - 1 and 0 <= spans[i][0] - hi <= _GAP_MAX:
                nlo, nhi, ndst = spans[i]
                last, ptr = parts[-1], ndst.data_ptr()
                if isinstance(last, list) and after.get(prev) == ptr and ptr == last[0] + last[1] + (nlo - hi):
                    last[1] += (nlo - hi) + (nhi - nlo)  # the gap is the destination's own padding
                else:
                    if nlo > hi:
                        parts.append(memoryview(bytearray(nlo - hi)))
                    parts.append([ptr, nhi - nlo])
                prev, hi = ptr, nhi
                i += 1
            self._readv_at([memoryview((ctypes.c_ubyte * p[1]).from_address(p[0])).cast("B")
                            if isinstance(p, list) else p for p in parts], lo)

    def _check_slot(self, dst: torch.Tensor, key: str, off: int, n: int) -> None:
        """A tensor's place in a destination buffer must lie inside it (never a write past its end)."""
        if off < 0 or off + n > dst.numel():
            raise CorruptFileError(f"{self.path}: {key!r} ({n} bytes) does not fit its place at byte {off} of a "
                                   f"{dst.numel()}-byte buffer; the file does not match the model's layout")

    def read_into(self, dst: torch.Tensor, pieces: list[tuple[str, int]]) -> int:
        """Read (key, dst_offset) tensors into a flat uint8 `dst`; returns bytes read. Raises if the file changed."""
        spans = []
        for key, off in pieces:
            ft = self.tensors[key]
            self._check_slot(dst, key, off, ft.end - ft.start)
            spans.append((ft.start, ft.end, dst[off:off + ft.end - ft.start]))
        self._read_spans(spans)
        self.check_unchanged()  # a write that raced the read must not pass as the original bytes
        return sum(hi - lo for lo, hi, _ in spans)

    def read_range(self, dst: torch.Tensor, pieces: list[tuple[str, int]], start: int, end: int) -> int:
        """Read the bytes [start, end) of a unit laid out as (key, unit offset) pieces into `dst[:end - start]`;
        returns bytes read. A bounce buffer smaller than the unit reads it in such ranges."""
        spans = []
        for key, off in pieces:
            ft = self.tensors[key]
            n = ft.end - ft.start
            lo, hi = max(start, off), min(end, off + n)
            if lo >= hi:
                continue
            spans.append((ft.start + (lo - off), ft.start + (hi - off), dst[lo - start:hi - start]))
        self._read_spans(spans)
        self.check_unchanged()  # a write that raced the read must not pass as the original bytes
        return sum(hi - lo for lo, hi, _ in spans)

    def read_tensor(self, key: str) -> torch.Tensor:
        """One tensor as an ordinary, independent CPU tensor (read from the descriptor, not the map)."""
        ft = self.tensors[key]
        buf = torch.empty(ft.end - ft.start, dtype=torch.uint8)
        self._read_at(buf, ft.start)
        self.check_unchanged()
        return buf.view(ft.dtype).view(ft.shape)

    def view(self, key: str) -> torch.Tensor:
        """A zero-copy view of one tensor in the private map (a copy read from the file if misaligned)."""
        ft = self.tensors[key]
        if ft.start % ft.dtype.itemsize:
            return self.read_tensor(key)
        if self._flat is None:
            # Private copy-on-write mapping: a write through a parameter view lands in process memory (the unit
            # then leaves the disk tier) and the file is never modified.
            self._mmap = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
            self._flat = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._flat[ft.start:ft.end].view(ft.dtype).view(ft.shape)

    def close(self) -> None:
        self._flat = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # views still alive; the mapping goes with them
                pass
            self._mmap = None
        self._closer()
        self._fd = -1
        self._watch.fd = -1
