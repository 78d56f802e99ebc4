"""One read-only host copy of a model's blocks for every process that offloads the same file.

ComfyUI-Distributed runs a master and one worker per GPU on one machine, each offloading the same model; with a
copy each, four local workers need four times the model's host RAM. Processes offloading the same file (the same
path, size and modification time) with the same layout (every unit's tensors: offsets, dtypes, shapes, strides)
share ONE copy instead: a named segment under /dev/shm (`SharedHostCopy`), which the first process fills unit by
unit while it stages (`place`) and the others map once it is complete.

- Naming: `layer-offload-<uid>-<sha256 of the file's identity and the layout>`; created with O_EXCL (mode 0600),
  so exactly one process fills it. Only our own files are used (shm_segment.py: this uid's, no group/other bits,
  checked before opening and on the descriptor mapped, the expected size): another user's file under our name is
  never opened nor removed, and this process stages a private copy. A header (magic, the full key, the size, per
  unit its offset, which leaves were read from the file and its form) is written last; a segment whose header does
  not match is ignored (the process stages its own copy).
- Forms: a unit the filler's plan holds compressed is in the segment in its encoded form (`put_encoded`: the blob
  at the start of the unit's range, its chunk table in the header), decoded on the device as a private compressed
  unit is. A joining process reads the forms before it plans (`peek`) and takes them as facts (`planner.make_plan`
  holds those units in the segment's form); it maps an encoded unit with `encoded_unit` (shared_encoded.py).
- A joining process compares the bytes it holds (a model loaded in RAM) with the segment's before it drops its
  own; a leaf it does not hold (on the meta device, read from the file) joins only where the filler read that very
  leaf from the file. A unit that differs stays private to the process: a shared copy never changes an output.
- Mapped twice: a private copy-on-write mapping the unit's parameters view between forwards (a write lands in this
  process's own pages, never in the others'), and a read-only shared one the device copies from, pinned where the
  backend can register host memory (`Backend.register_host`, asked of the pin gate). A unit written in place stops
  copying from the shared view at once (`SharedSource` compares version counters) and gets a private RAM master at
  the next pass start (`HostTiers.privatize`: copy-on-write at unit granularity).
- Cleanup: every process holds a shared `flock` on the segment while it maps it (the filler an exclusive one until
  the header is written); the last one to let go (detach, garbage collection, exit) takes the lock exclusively
  and unlinks the segment. A segment left by a killed process is removed by the next process that creates one.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

from ..model.layout import TensorLayout
from . import codec, shared_local
from .shared_forms import chunk_room, header_json, parse_header
from .shm_segment import (PAGE, PREFIX, SEGMENT_DIR, STALE_AFTER_S, ForeignSegment, available,  # noqa: F401
                          fcntl, file_identity, is_ours, map_segment, open_own, private_pages, punch_hole, release,
                          round_up, segment_dir, segment_key, segment_name, sweep_stale, unlink_own)

log = logging.getLogger(__name__)

MAGIC = b"LOSHARE3"  # 3: encoded units in the codec's chunks of version 3; 2: of version 2
_HEAD = struct.Struct("<8sQQ")  # magic, ready (0 | 1), length of the JSON that follows


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class SharedUnit:
    """Where one unit lies in this process's mappings: `host` views the private copy-on-write mapping (what the
    modules see); `pinned_view` the registered read-only shared mapping (what the device copies from), or None.
    The version counters at placement tell whether this process wrote the unit since (`written`)."""

    def __init__(self, index: int, host: torch.Tensor, pinned_view: torch.Tensor | None, copy: "SharedHostCopy",
                 layout: TensorLayout) -> None:
        self.index = index
        self.host = host
        self.pinned_view = pinned_view
        self.copy = copy
        self.layout = layout
        self._marks = self._versions()

    @property
    def pinned(self) -> bool:
        return self.pinned_view is not None

    def _versions(self) -> tuple[int, int]:
        return self.host._version, self.layout.version()

    def written(self) -> bool:
        """Whether this process wrote the unit since it was placed: through its parameters (version counters), or
        the engine into its host views (buffers written back, a device copy caught up)."""
        return self._versions() != self._marks

    def has_private_pages(self) -> bool:
        """Whether a write this process made reached the unit's pages in a way no version counter saw (through
        `.data`): a page of the copy-on-write mapping turned private (/proc/self/pagemap)."""
        return private_pages(self.host.data_ptr(), self.host.numel())

    def drop_private_pages(self) -> None:
        """Give back the pages a write made private in this process (after the unit got a RAM master of its own)."""
        self.copy.drop_private_pages(self.index)


class SharedHostCopy:
    """The segment one model's shared units live in, as this process maps it (see the module docstring)."""

    said_full = False  # the warning that /dev/shm is full was given (once per process)

    def __init__(self, path: Path, fd: int, filler: bool, key: str, offsets: dict[int, int],
                 sizes: dict[int, int], total: int) -> None:
        self.path = path
        self.fd = fd
        self.stat = os.fstat(fd)  # the file we hold: every later open of the name must be this very file
        self.filler = filler
        self.key = key
        self.offsets = offsets  # unit index -> byte offset in the segment
        self.sizes = sizes
        self.total = total
        self.file_leaves: dict[int, list[int]] = {}  # filled units -> leaves read from the file (the header's)
        self.encoded: dict[int, tuple[int, tuple[codec.Chunk, ...]]] = {}  # units filled encoded: (size, chunks)
        self.placed: list[int] = []
        self.let_go: set[int] = set()  # placed units this model no longer holds in RAM (disk tier, a private copy)
        self.refused = 0
        self._fill: mmap.mmap | None = map_segment(path, self.stat, total, mmap.ACCESS_WRITE) if filler else None
        self._private: mmap.mmap | None = map_segment(path, self.stat, total, mmap.ACCESS_COPY)
        self._shared: mmap.mmap | None = map_segment(path, self.stat, total, mmap.ACCESS_READ)
        self._unregisters: list[Callable[[], None]] = []
        self._pinned: dict[int, torch.Tensor] = {}  # unit -> its registered view in the shared mapping
        # a model dropped without detach() lets go too (device registrations first, while the mappings exist)
        self._closer = weakref.finalize(self, release, fd, str(path), self.stat, self._unregisters)
        shared_local.add(self)  # another model of this process maps it through our lock (shared_local.py)

    # opening ------------------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, file_path: str | os.PathLike, layouts: list[TensorLayout], names: list[str],
             wanted: set[int] | frozenset[int], directory: Path | None = None) -> "SharedHostCopy | None":
        """This process's mapping of the segment for these units, filling it when none exists; None (logged) where
        none can be had (each process then stages its own copy)."""
        directory = segment_dir() if directory is None else directory
        if not wanted:
            return None
        try:
            key = segment_key(file_identity(file_path), layouts, names)
        except OSError as exc:
            log.info("no shared host copy: cannot read %s (%s)", file_path, exc)
            return None
        offsets, sizes, total = cls._places(key, layouts)
        path = directory / segment_name(key)
        for _ in range(3):  # a segment the last process unlinked while we opened it: look again
            try:
                copy = cls._join(path, key, offsets, sizes, total)
                if copy is not None:
                    return copy
                return cls._create(path, key, offsets, sizes, total, directory)
            except FileExistsError:
                continue  # another process created it between our look and our create: join it
            except _Retry:
                continue
            except ForeignSegment as exc:  # someone else's file under our name: never opened, never removed
                log.debug("no shared host copy of %s: %s; this process stages its own", file_path, exc)
                return None
            except OSError as exc:
                log.warning("no shared host copy of %s (%s: %s); this process stages its own", file_path,
                            type(exc).__name__, exc)
                return None
        return None

    @classmethod
    def _places(cls, key: str, layouts: list[TensorLayout]) -> tuple[dict[int, int], dict[int, int], int]:
        """(each unit's offset in the segment, its raw bytes, the segment's size): every unit has its place at its
        raw size, so processes with other tiers or forms agree (an encoded unit fills the start of its range)."""
        offsets, sizes, pos = {}, {}, 0
        for i, layout in enumerate(layouts):
            offsets[i], sizes[i] = pos, layout.nbytes
            pos += round_up(layout.nbytes)
        # the header is written last: room for it with every unit filled encoded and every leaf read from the file
        head = round_up(_HEAD.size + len(header_json(key, offsets, sizes, layouts, full=True))
                        + 32 * len(offsets) + 256 + sum(chunk_room(layout) for layout in layouts))
        return {i: head + off for i, off in offsets.items()}, sizes, max(head + pos, PAGE)

    @classmethod
    def _create(cls, path: Path, key: str, offsets: dict[int, int], sizes: dict[int, int], total: int,
                directory: Path) -> "SharedHostCopy":
        sweep_stale(directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: ours alone, readable and writable by us
            fcntl.flock(fd, fcntl.LOCK_EX)  # joiners wait until the header says it is complete
            os.ftruncate(fd, total)  # tmpfs: pages exist once written
            # the header's pages now: written last through the mapping, where a full tmpfs would be a SIGBUS
            os.posix_fallocate(fd, 0, min(offsets.values(), default=total))
            copy = cls(path, fd, True, key, offsets, sizes, total)
        except BaseException:
            unlink_own(path, os.fstat(fd))
            os.close(fd)
            raise
        log.debug("filling the shared host copy %s (%.1f MB) for other processes offloading the same file", path,
                  total / 2 ** 20)
        return copy

    @classmethod
    def _join(cls, path: Path, key: str, offsets: dict[int, int], sizes: dict[int, int],
              total: int) -> "SharedHostCopy | None":
        fd = shared_local.lock_descriptor(path)  # another model of this process maps it: share its lock
        try:
            fd = open_own(path, os.O_RDONLY) if fd is None else fd  # ForeignSegment: not ours, never opened
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the filler still fills it (held already through a duplicate)
            st = os.fstat(fd)
            try:
                here = os.lstat(path)
                same = (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)
            except FileNotFoundError:
                same = False
            if not same:
                raise _Retry()
            header = cls._read_header(fd, key, offsets, sizes, total) if is_ours(st) else None
            if header is None:
                cls._take_over(fd, path, st)  # raises: look again, or stage a private copy
            copy = cls(path, fd, False, key, offsets, sizes, total)
        except BaseException:
            os.close(fd)
            raise
        copy.file_leaves, copy.encoded = header
        log.info("mapping the shared host copy %s another process filled (%d unit(s), %d of them compressed)", path,
                 len(copy.file_leaves), len(copy.encoded))
        return copy

    @classmethod
    def peek(cls, file_path: str | os.PathLike, layouts: list[TensorLayout], names: list[str],
             directory: Path | None = None) -> dict[int, tuple[str, int]] | None:
        """The forms of the units a complete segment for this model holds: unit -> (its form, "none" or the
        codec's name; its bytes there), waiting while a filler still fills it; None when there is none (this
        process would fill it). What a joining process plans with (`HostFacts.shared_forms`)."""
        try:
            key = segment_key(file_identity(file_path), layouts, names)
            offsets, sizes, total = cls._places(key, layouts)
            fd = open_own((segment_dir() if directory is None else directory) / segment_name(key), os.O_RDONLY)
        except OSError:  # none, or not ours (never opened)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            header = cls._read_header(fd, key, offsets, sizes, total)
        except OSError:
            return None
        finally:
            os.close(fd)
        if header is None:
            return None
        filled, encoded = header
        return {i: (codec.CODEC, encoded[i][0]) if i in encoded else ("none", sizes[i]) for i in filled}

    @staticmethod
    def _read_header(fd: int, key: str, offsets: dict[int, int], sizes: dict[int, int],
                     total: int) -> tuple[dict[int, list[int]], dict[int, tuple[int, tuple[codec.Chunk, ...]]]] | None:
        """(the filled units and their file-read leaves, the encoded ones' sizes and chunks), or None for a segment
        that is not this model's copy or was never completed."""
        try:
            if os.fstat(fd).st_size != total:
                return None
            magic, ready, n = _HEAD.unpack(os.pread(fd, _HEAD.size, 0))
            if magic != MAGIC or not ready or n > min(offsets.values(), default=total):
                return None
            return parse_header(os.pread(fd, n, _HEAD.size), key, offsets, sizes)
        except (OSError, struct.error):
            return None

    @staticmethod
    def _take_over(fd: int, path: Path, st: os.stat_result) -> None:
        """Our file under our name that does not hold this model's complete copy (`fd`, held shared): removed when
        nobody else holds it (its filler died half way), else left alone."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only when no other process holds it
        except BlockingIOError:
            log.warning("%s is not a complete shared host copy of this model and is in use; this process stages its "
                        "own copy", path)
            raise OSError("segment in use with another header") from None
        unlink_own(path, st)
        raise _Retry()

    # staging ------------------------------------------------------------------------------------------------------
    def place(self, i: int, layout: TensorLayout, fill: Callable[[torch.Tensor], list[int]],
              write: Callable[[int, int], list[int]] | None = None) -> torch.Tensor | None:
        """Unit i's bytes in the segment, as this process's private mapping of them (None: keep a private copy).
        The filler puts the unit's tensors in: `write(fd, offset)` writes them through the segment's descriptor
        (one copy from the model file's pages into the segment's, no page zeroed first; a full /dev/shm is ENOSPC
        there), else `fill(unit_bytes)` into its reserved pages (meta leaves read from the file straight into the
        segment, the others copied); both return the leaves read from the file. A joiner checks that the segment
        holds the bytes it holds. Units may be placed from several threads."""
        off, n = self.offsets[i], self.sizes[i]
        if self.filler:
            if write is not None:
                try:
                    self.file_leaves[i] = write(self.fd, off)
                except OSError as exc:
                    self._full(exc)
                    return None
            elif not self._reserve(off, n):
                return None
            else:
                self.file_leaves[i] = fill(self._frombuffer(self._fill, off, n))
        else:
            if i not in self.file_leaves or i in self.encoded:
                return None  # the filler kept this unit out of RAM (disk tier), or holds it encoded
            theirs = set(self.file_leaves[i])
            seg = self._frombuffer(self._shared, off, n)
            with torch.no_grad():
                for k, (view, src) in enumerate(zip(layout.leaf_views(seg), layout.sources())):
                    if src.is_meta or layout.leaves[k].meta:
                        ok = k in theirs  # read from the very file by the filler too
                    else:
                        ok = torch.equal(_bytes_of(view), _bytes_of(src))
                    del src
                    if not ok:
                        self.refused += 1
                        return None
        self.placed.append(i)
        return self._frombuffer(self._private, off, n)

    def _reserve(self, off: int, n: int) -> bool:
        """The filler reserves a unit's pages now: a full /dev/shm is ENOSPC here, not SIGBUS while copying into the
        mapping (False: said once per process, the unit stays private)."""
        try:
            os.posix_fallocate(self.fd, off, round_up(n))
            return True
        except OSError as exc:
            self._full(exc)
            return False

    def _full(self, exc: OSError) -> None:
        if not SharedHostCopy.said_full:  # once per process: a single-process user need not hear it twice
            SharedHostCopy.said_full = True
            log.warning("%s has no room for the shared host copy (%s); the rest stays in this process's own "
                        "RAM (a container's /dev/shm may be small: docker run --shm-size)", segment_dir(), exc)
        self.refused += 1

    def put_encoded(self, i: int, encoded: codec.Encoded, from_file: list[int]) -> torch.Tensor | None:
        """The filler puts unit i in its encoded form (the blob at the start of its range, the chunk table into the
        header); returns the blob in the read-only shared mapping (what the device copies from), or None (no
        room: the unit keeps a private blob)."""
        if not self.filler or encoded.size > self.sizes[i]:
            return None
        target = self._frombuffer(self._fill, self.offsets[i], encoded.size) if encoded.size else None
        in_place = target is not None and encoded.blob.data_ptr() == target.data_ptr()  # encoded there (`room`)
        if not in_place and not self._reserve(self.offsets[i], encoded.size):
            return None
        if encoded.size and not in_place:
            target.copy_(encoded.blob)
        self.file_leaves[i] = list(from_file)
        self.encoded[i] = (encoded.size, tuple(encoded.chunks))
        self.placed.append(i)
        return self._frombuffer(self._shared, self.offsets[i], encoded.size)

    def room(self, i: int, size: int) -> torch.Tensor | None:
        """The filler's room for unit i's encoded blob of `size` bytes at the start of its range (reserved; the encoder
        writes it there, then `put_encoded` records it), or None (not the filler, or no room: a private blob)."""
        if not self.filler or size > self.sizes[i] or not self._reserve(self.offsets[i], size):
            return None
        return self._frombuffer(self._fill, self.offsets[i], size)

    def encoded_unit(self, i: int) -> codec.Encoded | None:
        """A joiner's view of unit i held encoded in the segment (the blob in the read-only shared mapping), or None
        when the segment does not hold it encoded. The caller checks the bytes and then calls `took`."""
        if self.filler or i not in self.encoded:
            return None
        size, chunks = self.encoded[i]
        return codec.Encoded(self._frombuffer(self._shared, self.offsets[i], size), chunks, self.sizes[i])

    def took(self, i: int, ok: bool) -> None:
        """A joiner took unit i's encoded form (ok) or found other bytes in it than its own (the unit stays private)."""
        if ok:
            self.placed.append(i)
        else:
            self.refused += 1

    def unplace(self, i: int) -> None:
        """The filler takes unit i back out before the header is written (it changed while being put in): its pages
        freed, a joiner stages it on its own."""
        if self.filler and self._fill is not None:
            if self.file_leaves.pop(i, None) is not None:
                self.placed.remove(i)
            with contextlib.suppress(OSError):  # a write that failed half way may have taken some
                punch_hole(self.fd, self.offsets[i], round_up(self.sizes[i]))

    def held_bytes(self, i: int) -> int:
        """Unit i's bytes in the segment: its encoded size where it is held encoded, else its raw size."""
        return self.encoded[i][0] if i in self.encoded else self.sizes[i]

    def finish(self, backend: Any, pinned: set[int] | frozenset[int]) -> None:
        """Staging is over: the filler publishes the header and lets joiners in; the units planned `pinned` are
        registered for this process's device in the shared mapping (each asked of the pin gate), where it can."""
        if self.filler and self._fill is not None:
            body = header_json(self.key, self.offsets, self.sizes, [], self.file_leaves, encoded=self.encoded)
            self._fill[_HEAD.size:_HEAD.size + len(body)] = body
            self._fill[:_HEAD.size] = _HEAD.pack(MAGIC, 1, len(body))
            self._fill.close()
            self._fill = None
            os.utime(self.fd)  # young: no other process's sweep takes it for a leftover while the lock changes
            fcntl.flock(self.fd, fcntl.LOCK_SH)  # joiners may map it now
        if self.refused and not self.filler:
            log.warning("%d unit(s) hold other bytes than the shared host copy of the same file (changed after "
                        "loading?); they keep a private copy in this process", self.refused)
        if not getattr(backend, "supports_pinned_host", False):
            return
        for i in self.placed:
            if i in pinned and self._shared is not None:
                view = self._frombuffer(self._shared, self.offsets[i], self.held_bytes(i))
                unregister = backend.register_host(view)
                if unregister is None:
                    break  # refused (the pin gate, the driver): the rest are copied from pageable memory too
                self._unregisters.append(unregister)
                self._pinned[i] = view

    def pinned_view(self, i: int) -> torch.Tensor | None:
        """Unit i in the registered shared mapping (what the device copies from), or None when it is not pinned."""
        return self._pinned.get(i)

    def unit(self, i: int, host: torch.Tensor, layout: TensorLayout) -> SharedUnit:
        return SharedUnit(i, host, self.pinned_view(i), self, layout)

    @staticmethod
    def _frombuffer(m: mmap.mmap | None, off: int, n: int) -> torch.Tensor:
        """A tensor of its own (its own version counter) over bytes [off, off + n) of a mapping."""
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the read-only mapping: torch warns it is not writable
            return torch.frombuffer(m, dtype=torch.uint8, count=n, offset=off)

    def open_here(self) -> bool:
        return self._closer.alive

    def filler_busy(self) -> bool:
        return self._fill is not None

    def alone(self) -> bool:
        """Whether no other process maps the copy now (other models of this one share this process's lock)."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            return False
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_SH)  # back to shared (a failed conversion gave it up)

    def give_back(self, i: int) -> bool:
        """Free unit i's pages in the segment (it left this process's RAM for the disk tier); False where another
        process maps the copy or another model of this one holds the unit (the last to let it go frees them)."""
        self.let_go.add(i)
        if shared_local.holds_elsewhere(self, i):
            self.drop_private_pages(i)
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only when no other process holds it
        except OSError:
            fcntl.flock(self.fd, fcntl.LOCK_SH)  # a failed conversion gave up the shared lock: take it again
            return False
        try:
            self.file_leaves.pop(i, None)  # a later process stages this unit on its own
            self.encoded.pop(i, None)
            body = header_json(self.key, self.offsets, self.sizes, [], self.file_leaves, encoded=self.encoded)
            fd = open_own(self.path, os.O_RDWR, same_as=self.stat)
            try:
                os.pwrite(fd, body, _HEAD.size)
                os.pwrite(fd, _HEAD.pack(MAGIC, 1, len(body)), 0)
                punch_hole(fd, self.offsets[i], round_up(self.sizes[i]))
            finally:
                os.close(fd)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
        self.drop_private_pages(i)
        return True

    def drop_private_pages(self, i: int) -> None:
        if self._private is not None and hasattr(self._private, "madvise"):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self._private.madvise(mmap.MADV_DONTNEED, self.offsets[i], round_up(self.sizes[i]))

    # the end --------------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Let go of the segment (unlinked when no other process maps it); views still alive keep their pages."""
        if self._fill is not None:  # a staging that failed half way: nobody else may map a half-filled copy
            self._fill.close()
            self._fill = None
            unlink_own(self.path, self.stat)
        self._closer()  # device registrations, then the lock; the last process out unlinks
        self._pinned.clear()
        for m in (self._private, self._shared):
            with contextlib.suppress(BufferError, AttributeError):  # tensors still view it: it goes with them
                m.close()
        self._private = self._shared = None


class _Retry(Exception):
    """The segment went away (or was a dead filler's) while we opened it: look again."""
