"""The headers of a workflow's missing models, from the links the workflow carries: the cache first, then the network
(only when asked), read by the same validators as a local file's header; what the download would be.

`RemoteHeaders(links, mode)` is what `plan_workflow(remote=...)` asks for a loader's file it did not find on disk:
- mode "links": nothing is read; a missing model only learns its URL (the panel offers its button from that);
- mode "cache": headers kept by an earlier fetch (`header_cache`), no network;
- mode "fetch": the cache, else the URL by range requests (`remote_headers.fetch_header`), and the cache filled.
`prepare` reads every missing model's header at once (a few threads); `lookup` answers one; `downloads` lists the
files a download would bring, with their sizes (the server's, or from the header: 8 + header length + data).
"""
from __future__ import annotations

import io
import logging
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .header_cache import HeaderCache
from .model_files import ModelFileError, TensorInfo, parse_gguf, safetensors_infos_from_header
from .model_links import ModelLink, link_for
from .remote_headers import DEADLINE_S, TIMEOUT_S, HeaderFetchError, fetch_header, file_format

log = logging.getLogger(__name__)

MODES = ("links", "cache", "fetch")
MAX_FILES = 64  # headers one plan reads from the network
WORKERS = 4


@dataclass
class RemoteModel:
    """A missing model file the workflow links to: its header's tensors when read, else why not."""

    name: str
    url: str
    directory: str
    infos: dict[str, TensorInfo] | None = None
    download_bytes: int | None = None
    source: str = ""  # "network" | "cache" | "" (not read)
    error: str | None = None
    error_kind: str | None = None
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "directory": self.directory, "bytes": self.download_bytes,
                "source": self.source, "error": self.error, "error_kind": self.error_kind,
                "header_bytes_read": self.bytes_read}


def download_size(nbytes: int) -> str:
    """A download's size as people read one: GB (decimal, as download sites give sizes), MB below 1 GB."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def infos_from_prefix(fmt: str, prefix: bytes, total: int | None, where: str) -> tuple[dict[str, TensorInfo], int]:
    """(tensors, the file's bytes) of a header's bytes (the file's first bytes) and the file's size when known,
    through the validators a local file's header goes through. The bytes: the size the server gave (Content-Range),
    else what the header implies (safetensors: 8 + header + data; GGUF: the header, aligned, + data)."""
    if fmt == "safetensors":
        if len(prefix) < 10:
            raise ModelFileError(f"{where}: {len(prefix)} bytes are no safetensors header")
        (n,) = struct.unpack("<Q", prefix[:8])
        if len(prefix) != 8 + n:
            raise ModelFileError(f"{where}: the header says {n} bytes, {len(prefix) - 8} are held")
        infos, file_end = safetensors_infos_from_header(prefix[8:], total if total is not None else 1 << 62, where)
        return infos, total if total is not None else file_end
    header = parse_gguf(io.BytesIO(prefix), total if total is not None else 1 << 62, where)
    return header.infos, total if total is not None else header.data_start + header.data_bytes


class RemoteHeaders:
    """Headers of missing models by their links (see the module doc). `allow(url)` gives why a URL may not be asked
    (None: it may): the ComfyUI route keeps to the hosts its frontend downloads from."""

    def __init__(self, links: list[ModelLink], mode: str = "fetch", cache: HeaderCache | None = None,
                 timeout: float = TIMEOUT_S, deadline: float = DEADLINE_S,
                 allow: Callable[[str], str | None] | None = None, fetch: Callable[..., Any] = fetch_header,
                 max_files: int = MAX_FILES) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.max_files = max_files
        self.links, self.mode, self.cache = links, mode, cache if cache is not None else HeaderCache()
        self.timeout, self.deadline, self.allow, self._fetch = timeout, deadline, allow, fetch
        self.found: dict[str, RemoteModel] = {}  # by URL
        self.asked: list[RemoteModel] = []  # what lookup answered, in the plan's order (each URL once)

    def link(self, folder: str, name: str) -> ModelLink | None:
        return link_for(self.links, folder, name)

    def prepare(self, wanted: Iterable[tuple[str, str]]) -> None:
        """Read the headers of these (folder, name) files at once (those with a link, each URL once)."""
        links = {}
        for folder, name in wanted:
            link = self.link(folder, name)
            if link is not None and link.url not in self.found:
                links.setdefault(link.url, link)
        todo = list(links.values())
        over = todo[self.max_files:] if self.mode == "fetch" else []
        for link in over:
            self.found[link.url] = RemoteModel(link.name, link.url, link.directory, error_kind="too_many", error=(
                f"{link.url}: more than {self.max_files} missing models in one plan: this one's header is not read"))
        todo = todo[:len(todo) - len(over)]
        if len(todo) > 1 and self.mode == "fetch":
            with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="lo-header") as pool:
                for model in pool.map(self._read, todo):
                    self.found[model.url] = model
        else:
            for link in todo:
                self.found[link.url] = self._read(link)

    def lookup(self, folder: str, name: str) -> RemoteModel | None:
        """The missing file `name`'s remote header (read now unless `prepare` did), None when the workflow gives no
        link for it."""
        link = self.link(folder, name)
        if link is None:
            return None
        if link.url not in self.found:
            self.found[link.url] = self._read(link)
        model = self.found[link.url]
        if model not in self.asked:
            self.asked.append(model)
        return model

    def _read(self, link: ModelLink) -> RemoteModel:
        model = RemoteModel(link.name, link.url, link.directory)
        fmt = file_format(link.url, link.name)
        if self.mode == "links":
            return model
        if fmt is None:
            model.error_kind, model.error = "format", f"{link.url}: not a .safetensors or .gguf file: not read"
            return model
        cached = self.cache.get(link.url, fmt)
        if cached is not None and self._take(model, fmt, cached.prefix, cached.total, "cache"):
            return model
        if self.mode == "cache":
            return model
        why = self.allow(link.url) if self.allow is not None else None
        if why:
            model.error_kind, model.error = "not_allowed", why
            return model
        try:
            got = self._fetch(link.url, link.name, timeout=self.timeout, deadline=self.deadline)
        except HeaderFetchError as exc:
            model.error_kind, model.error, model.bytes_read = exc.kind, str(exc), exc.bytes_read
            log.info("Layer Offload: the header of %s was not read: %s", link.name, exc)
            return model
        model.bytes_read = got.bytes_read
        if self._take(model, fmt, got.prefix, got.total, "network"):
            self.cache.put(link.url, fmt, got.prefix, got.total)
            log.info("Layer Offload: read the header of %s from %s (%d bytes in %d requests)", link.name, link.url,
                     got.bytes_read, got.requests)
        return model

    def _take(self, model: RemoteModel, fmt: str, prefix: bytes, total: int | None, source: str) -> bool:
        try:
            model.infos, model.download_bytes = infos_from_prefix(fmt, prefix, total, model.url)
        except ModelFileError as exc:
            if source == "network":
                model.error_kind, model.error = "corrupt", str(exc)
            return False  # a cached entry that does not validate is not used (and fetched again in "fetch" mode)
        model.source, model.error, model.error_kind = source, None, None
        return True

    def downloads(self) -> list[dict[str, Any]]:
        """The missing files the plan asked for, in its order: name, URL, bytes (from the header), where the header
        came from, or why it was not read."""
        return [m.to_dict() for m in self.asked]
