"""A model file's header read from its download URL by HTTP range requests, never its weights.

- safetensors: bytes 0-7 (the header's length n), then bytes 8..8+n-1: at most 8 + n bytes are read, whatever the
  server sends (a longer body is cut off by closing the connection).
- GGUF (no length prefix): ranges from the start in growing chunks (64 KiB, doubling up to 16 MiB) until the
  parser (`model_files.parse_gguf`, with its bounds) has the tensor table; at most `MAX_HEADER_BYTES`.
- Redirects: followed by hand, at most `MAX_REDIRECTS`, http and https only; an Authorization header is dropped
  when a redirect leaves the host or changes the scheme (Hugging Face answers with a signed CDN URL).
- Refused, by name: a server that answers 200 to a range request (it would send the whole file: the body is not
  read), a header over the validator's limit (`store.header_check.MAX_HEADER_BYTES`), a wait longer than `timeout`
  for any byte or a header taking longer than `deadline` in all, HTTP errors, a URL that is not http(s).
- Hugging Face URLs (`https://huggingface.co/<repo>/resolve|blob/<revision>/<file>`) are asked through
  `huggingface_hub`'s own pieces where it is installed: `hf_hub_url` (so `HF_ENDPOINT` mirrors apply) and
  `build_hf_headers` (the user's token, `HF_TOKEN`); `HF_HUB_OFFLINE` is honoured. Not `HfApi.
  parse_safetensors_file_metadata`: it asks for the first 100 kB in one request (weights past a small header) and,
  from a server that ignores ranges, reads the whole file into memory; it also gives no raw header for the pack's
  own validator and no file size. Without `huggingface_hub` the URL is asked as it is (`HF_ENDPOINT` still applies).

The bytes come back as `FetchedHeader.prefix` (the file's first bytes up to the header's end) and are read by the same
validators as a local file's header (`header_source.py`). Plain `urllib`: no new dependency.
"""
from __future__ import annotations

import io
import os
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from ..store.header_check import MAX_HEADER_BYTES

MAX_REDIRECTS = 5
TIMEOUT_S = 10.0  # the longest wait for any byte (huggingface_hub's default download timeout)
DEADLINE_S = 120.0  # one header, every request and redirect of it together
GGUF_FIRST_CHUNK = 64 << 10
GGUF_MAX_CHUNK = 16 << 20
HF_HOSTS = ("huggingface.co", "hf.co", "www.huggingface.co")
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.I)


class HeaderFetchError(Exception):
    """A header that could not be read from its URL: `kind` says why (no_range, too_large, timeout, http, redirects,
    scheme, corrupt, network, offline), the message names the URL and what to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.bytes_read = 0  # of the file, before the refusal


@dataclass
class FetchedHeader:
    """The first bytes of a model file, up to its header's end, read from `url`."""

    url: str
    final_url: str  # where the last request ended after redirects
    format: str  # "safetensors" | "gguf"
    prefix: bytes
    total: int | None  # the file's size (Content-Range), None when the server did not say
    bytes_read: int
    requests: int


def file_format(url: str, name: str = "") -> str | None:
    """'safetensors' or 'gguf' from the file name (else the URL's path), None for any other file."""
    for text in (name, unquote(urlsplit(url).path)):
        low = text.lower()
        if low.endswith((".safetensors", ".sft")):
            return "safetensors"
        if low.endswith(".gguf"):
            return "gguf"
    return None


# ------------------------------------------------------------------------------------------------ Hugging Face
def parse_hf_url(url: str) -> tuple[str | None, str, str, str] | None:
    """(repo_type, repo_id, revision, filename) of a Hugging Face file URL (resolve or blob), else None."""
    parts = urlsplit(url)
    hosts = set(HF_HOSTS)
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint:
        hosts.add(urlsplit(endpoint).netloc.lower())
    if parts.netloc.lower() not in hosts:
        return None
    segs = parts.path.strip("/").split("/")
    kind = next((i for i, s in enumerate(segs) if s in ("resolve", "blob")), None)
    if kind is None or kind + 2 >= len(segs):
        return None
    repo = segs[:kind]
    repo_type = None
    if repo and repo[0] in ("datasets", "spaces"):
        repo_type, repo = repo[0][:-1], repo[1:]
    if not 1 <= len(repo) <= 2:
        return None
    return repo_type, "/".join(repo), unquote(segs[kind + 1]), unquote("/".join(segs[kind + 2:]))


def hub_request(url: str) -> tuple[str, dict[str, str]]:
    """The URL to ask for a Hugging Face file and the headers (auth, user agent), through huggingface_hub where it is
    installed; any other URL as it is, no headers."""
    parsed = parse_hf_url(url)
    if parsed is None:
        return url, {}
    repo_type, repo_id, revision, filename = parsed
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/")
    try:
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers
    except ImportError:
        if not endpoint:
            return url.replace("/blob/", "/resolve/", 1), {}
        base = urlsplit(endpoint)
        path = urlsplit(url).path.replace("/blob/", "/resolve/", 1)
        return urlunsplit((base.scheme, base.netloc, base.path.rstrip("/") + path, "", "")), {}
    if constants.HF_HUB_OFFLINE:
        raise HeaderFetchError("offline", f"{url}: HF_HUB_OFFLINE is set: Hugging Face is not asked")
    new = hf_hub_url(repo_id, filename, repo_type=repo_type, revision=revision,
                     endpoint=endpoint or constants.ENDPOINT)
    return new, dict(build_hf_headers())


# ------------------------------------------------------------------------------------------------------ HTTP
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # redirects are followed by `_open`
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class _Session:
    """One header's requests: the deadline, the count of bytes and requests."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float, deadline: float) -> None:
        self.url, self.headers, self.timeout = url, headers, timeout
        self.deadline = time.monotonic() + deadline
        self.bytes_read = 0
        self.requests = 0
        self.final_url = url

    def _wait(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise HeaderFetchError("timeout", f"{self.url}: timed out reading the header (the deadline passed)")
        return min(self.timeout, left)

    def _open(self, start: int, end: int) -> tuple[Any, str]:
        url, headers = self.url, dict(self.headers)
        for _ in range(MAX_REDIRECTS + 1):
            scheme = urlsplit(url).scheme.lower()
            if scheme not in ("http", "https"):
                raise HeaderFetchError("scheme", f"{self.url}: {url[:200]} is not an http(s) URL; not asked")
            req = urllib.request.Request(url, headers={**headers, "Range": f"bytes={start}-{end}",
                                                       "Accept-Encoding": "identity"})
            self.requests += 1
            try:
                return _OPENER.open(req, timeout=self._wait()), url
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location") if exc.code in (301, 302, 303, 307, 308) else None
                exc.close()
                if location is None:
                    raise HeaderFetchError("http", f"{self.url}: HTTP {exc.code} {exc.reason}{_advice(exc.code)}"
                                           ) from None
                new = urljoin(url, location)
                if _origin(new) != _origin(url):  # a token goes to the host it was given for, over its scheme
                    headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
                url = new
            except (socket.timeout, TimeoutError):
                raise HeaderFetchError("timeout", f"{self.url}: no answer within {self.timeout:g} s") from None
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                    raise HeaderFetchError("timeout", f"{self.url}: no answer within {self.timeout:g} s") from None
                raise HeaderFetchError("network", f"{self.url}: cannot connect: {exc.reason}") from None
            except (OSError, ValueError) as exc:
                raise HeaderFetchError("network", f"{self.url}: {exc}") from None
        raise HeaderFetchError("redirects", f"{self.url}: more than {MAX_REDIRECTS} redirects")

    def read_range(self, start: int, end: int) -> tuple[bytes, int | None]:
        """Bytes [start, end] of the file (fewer only where the file ends first) and its size; never more."""
        resp, url = self._open(start, end)
        self.final_url = url
        try:
            status = getattr(resp, "status", None) or resp.getcode()
            if status == 200:  # the whole file is on its way: not one byte of it is read
                raise HeaderFetchError("no_range", f"{self.url}: the server does not serve byte ranges (it answered "
                                       f"200 with the whole file to a range request); the header is not read, and "
                                       f"the file is not downloaded to read it")
            if status != 206:
                raise HeaderFetchError("http", f"{self.url}: HTTP {status} to a range request")
            match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != start or int(match.group(2)) < start:
                raise HeaderFetchError("no_range", f"{self.url}: the server answered a range request with "
                                       f"Content-Range {resp.headers.get('Content-Range')!r}, not bytes {start}-...")
            total = None if match.group(3) == "*" else int(match.group(3))
            want = min(end, int(match.group(2))) - start + 1
            out = bytearray()
            while len(out) < want:
                self._wait()  # the deadline: a server sending a byte now and then cannot hold the read forever
                try:
                    chunk = resp.read1(min(want - len(out), 1 << 20))
                except (socket.timeout, TimeoutError):
                    raise HeaderFetchError("timeout", f"{self.url}: the server stopped sending for "
                                           f"{self.timeout:g} s") from None
                except OSError as exc:
                    raise HeaderFetchError("network", f"{self.url}: {exc}") from None
                if not chunk:
                    break
                out += chunk
                self.bytes_read += len(chunk)
            return bytes(out), total
        finally:
            resp.close()


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _advice(code: int) -> str:
    if code in (401, 403):
        return " (the file needs a login: for Hugging Face set HF_TOKEN, or download it by hand)"
    if code == 404:
        return " (no file at this URL)"
    return ""


# --------------------------------------------------------------------------------------------------- headers
def fetch_header(url: str, name: str = "", timeout: float = TIMEOUT_S, deadline: float = DEADLINE_S) -> FetchedHeader:
    """The header of the model file at `url` (format by `name`, else the URL), read by ranges (see the module doc)."""
    fmt = file_format(url, name)
    if fmt is None:
        raise HeaderFetchError("format", f"{url}: not a .safetensors or .gguf file; only their headers are read")
    if urlsplit(url).scheme.lower() not in ("http", "https"):
        raise HeaderFetchError("scheme", f"{url[:200]}: not an http(s) URL; not asked")
    ask, headers = hub_request(url)
    session = _Session(ask, headers, timeout, deadline)
    try:
        prefix, total = (_safetensors(session) if fmt == "safetensors" else _gguf(session))
    except HeaderFetchError as exc:
        if ask != url:  # name the URL the workflow gave, and the one asked
            exc = HeaderFetchError(exc.kind, f"{url} (asked as {ask}): {str(exc).replace(ask + ': ', '', 1)}")
        exc.bytes_read = session.bytes_read
        raise exc from None
    return FetchedHeader(url, session.final_url, fmt, prefix, total, session.bytes_read, session.requests)


def _safetensors(s: _Session) -> tuple[bytes, int | None]:
    head, total = s.read_range(0, 7)
    if len(head) < 8:
        raise HeaderFetchError("corrupt", f"{s.url}: a file of {len(head)} bytes is no safetensors file")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise HeaderFetchError("too_large", f"{s.url}: the safetensors header claims {n} bytes, more than the "
                               f"{MAX_HEADER_BYTES}-byte limit (the safetensors library's); not read")
    if n < 2 or (total is not None and 8 + n > total):
        raise HeaderFetchError("corrupt", f"{s.url}: truncated or corrupt safetensors file (a header of {n} bytes in "
                               f"a {total}-byte file)")
    raw, _ = s.read_range(8, 8 + n - 1)
    if len(raw) != n:
        raise HeaderFetchError("corrupt", f"{s.url}: the safetensors header ends after {len(raw)} of its {n} bytes")
    return head + raw, total


class _RangeFile(io.RawIOBase):
    """A URL read forward as a file: contiguous ranges from byte 0 in growing chunks, at most MAX_HEADER_BYTES."""

    def __init__(self, session: _Session) -> None:
        self.s, self.buf, self.pos, self.total, self.chunk = session, bytearray(), 0, None, GGUF_FIRST_CHUNK
        self.ended = False

    def _fill(self, upto: int) -> None:
        while len(self.buf) < upto and not self.ended:
            if len(self.buf) >= MAX_HEADER_BYTES:
                raise HeaderFetchError("too_large", f"{self.s.url}: the GGUF header runs past "
                                       f"{MAX_HEADER_BYTES} bytes (the validator's limit); not read further")
            start = len(self.buf)
            end = min(start + max(self.chunk, upto - start), MAX_HEADER_BYTES) - 1
            data, total = self.s.read_range(start, end)
            self.total = total if total is not None else self.total
            self.buf += data
            self.ended = len(data) < end - start + 1
            self.chunk = min(self.chunk * 2, GGUF_MAX_CHUNK)

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            raise ValueError("a GGUF header is read in known lengths")
        self._fill(self.pos + n)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True


def _gguf(s: _Session) -> tuple[bytes, int | None]:
    from .model_files import ModelFileError, parse_gguf

    f = _RangeFile(s)
    f._fill(24)
    size = f.total if f.total is not None else 1 << 62
    try:
        header = parse_gguf(f, size, s.url)
    except ModelFileError as exc:
        raise HeaderFetchError("corrupt", str(exc)) from None
    return bytes(f.buf[:header.header_end]), f.total
