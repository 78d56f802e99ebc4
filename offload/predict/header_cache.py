"""Model file headers read from URLs, kept per URL so a plan asks the network once per file.

The cache is a folder of the user's cache (`$LAYER_OFFLOAD_CACHE/headers`, else `$XDG_CACHE_HOME/layer-offload/
headers`, else `~/.cache/layer-offload/headers`), made with mode 0700. One file per URL (`<sha256 of the URL>.hdr`):
a magic line, the length of a small JSON record (url, format, the file's size, the header's bytes, when it was read),
the record, then the file's first bytes up to its header's end.

Another process could put files there, so an entry is used only when it is ours (DESIGN.md's rule for anything
another process can create): the folder and the file owned by our uid with no group or other permission bits, the
file regular (no link followed) and exactly the size its record gives; otherwise it is ignored, never deleted, and
not written over. A trusted entry's header still goes through the pack's validator whenever it is read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..store.header_check import MAX_HEADER_BYTES, CorruptFileError, parse_json, read_at

log = logging.getLogger(__name__)

MAGIC = b"LOHDR1\n"
MAX_RECORD = 64 << 10
_HEAD = len(MAGIC) + 4


@dataclass
class CachedHeader:
    """A header kept for `url`: the file's first `len(prefix)` bytes and its size."""

    url: str
    format: str
    prefix: bytes
    total: int | None
    fetched_at: float


def default_dir() -> Path:
    """The header cache folder under the user's cache."""
    own = os.environ.get("LAYER_OFFLOAD_CACHE")
    if own:
        return Path(own).expanduser() / "headers"
    base = os.environ.get("XDG_CACHE_HOME") or os.environ.get("LOCALAPPDATA") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "layer-offload" / "headers"


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None  # the effective uid, as the shared host copy's rule


def _ours(st: os.stat_result) -> str | None:
    """Why a folder or file of the cache is not ours (None: it is)."""
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not ours ({uid})"
    if uid is not None and stat.S_IMODE(st.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):o} lets others read or write it"
    return None


class HeaderCache:
    """Headers by URL in `folder` (see the module doc)."""

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else default_dir()
        self._warned: set[str] = set()

    def _note(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("Layer Offload: header cache: %s", message)

    def path(self, url: str) -> Path:
        return self.folder / (hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest() + ".hdr")

    def _folder_ok(self, create: bool) -> bool:
        try:
            if create and not self.folder.exists():
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.lstat(self.folder)
        except OSError:
            return False
        why = _ours(st) if stat.S_ISDIR(st.st_mode) else "not a folder"
        if why:
            self._note(str(self.folder), f"{self.folder} is {why}: not used")
        return why is None

    def get(self, url: str, fmt: str) -> CachedHeader | None:
        """The entry kept for `url` when there is one and it is ours and whole; None otherwise."""
        if not self._folder_ok(create=False):
            return None
        path = self.path(url)
        try:
            before = os.lstat(path)  # what is there, before anything is opened (a link, a FIFO: never opened)
        except OSError:
            return None
        why = _ours(before) if stat.S_ISREG(before.st_mode) else "not a regular file"
        if why:
            self._note(str(path), f"{path} is {why}: ignored")
            return None
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_ino, st.st_dev) != (before.st_ino, before.st_dev) or _ours(st):
                self._note(str(path), f"{path} changed while it was opened: ignored")
                return None
            return self._read(fd, st.st_size, path, url, fmt)
        except CorruptFileError as exc:
            self._note(str(path), f"{exc}: ignored")
            return None
        finally:
            os.close(fd)

    def _read(self, fd: int, size: int, path: Path, url: str, fmt: str) -> CachedHeader | None:
        if size < _HEAD or size > _HEAD + MAX_RECORD + MAX_HEADER_BYTES:
            raise CorruptFileError(f"{path}: {size} bytes: not a header cache entry")
        head = read_at(fd, 0, _HEAD, path, "header cache entry")
        (n,) = struct.unpack("<I", head[len(MAGIC):])
        if head[:len(MAGIC)] != MAGIC or n > MAX_RECORD:
            raise CorruptFileError(f"{path}: not a header cache entry")
        record = parse_json(read_at(fd, _HEAD, n, path, "header cache entry"), path, "header cache record")
        if not isinstance(record, dict) or record.get("url") != url or record.get("format") != fmt:
            return None  # another URL's entry under this hash, or another format: not this one
        length, total, when = record.get("prefix_bytes"), record.get("total"), record.get("fetched_at", 0.0)
        if not isinstance(length, int) or isinstance(length, bool) or not 0 < length <= MAX_HEADER_BYTES + 8:
            raise CorruptFileError(f"{path}: its record gives {length!r} header bytes")
        if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < length):
            raise CorruptFileError(f"{path}: its record gives a file of {total!r} bytes")
        if size != _HEAD + n + length:  # the expected size: a cut or padded entry is not used
            raise CorruptFileError(f"{path}: {size} bytes, its record says {_HEAD + n + length}")
        prefix = read_at(fd, _HEAD + n, length, path, "header cache entry")
        return CachedHeader(url, fmt, prefix, total, float(when) if isinstance(when, (int, float)) else 0.0)

    def put(self, url: str, fmt: str, prefix: bytes, total: int | None) -> bool:
        """Keep a header read from `url` (atomically: a temporary file renamed); False when the cache is not ours or
        its place holds a file that is not ours (left as it is)."""
        if not self._folder_ok(create=True):
            return False
        path = self.path(url)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError:
            return False
        if st is not None and (not stat.S_ISREG(st.st_mode) or _ours(st)):
            self._note(str(path), f"{path} is not ours: left as it is, not written over")
            return False
        record = json.dumps({"url": url, "format": fmt, "total": total, "prefix_bytes": len(prefix),
                             "fetched_at": time.time()}).encode()
        if len(record) > MAX_RECORD:
            return False
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".hdr", dir=self.folder)  # mode 0600, O_EXCL
        except OSError as exc:
            self._note("write", f"cannot write in {self.folder}: {exc}")
            return False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(MAGIC + struct.pack("<I", len(record)) + record + prefix)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            self._note("write", f"cannot write {path}: {exc}")
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
