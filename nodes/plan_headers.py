"""The panel's "plan the download" button on the server side: the headers of the canvas's missing models, read from the
download links the workflow itself carries (POST /layer_offload/plan with "fetch_headers": true).

The server does the reading (offload.predict's header_source: range requests, the header only, bounded in bytes,
time and count, redirects http(s) only), and only for URLs the workflow names, for files no model folder holds, from
the hosts ComfyUI's own missing-models dialog downloads from (`ALLOWED_SOURCES`, plus HF_ENDPOINT's mirror and any
prefix in LAYER_OFFLOAD_HEADER_SOURCES, comma-separated): a page cannot make the server ask an arbitrary address.
"cached_headers": true plans from the headers read before (the header cache) without asking the network: the panel's
re-plans after the click.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit

# ComfyUI frontend's MissingModelsWarning / missingModelMetadata: the sources its download buttons accept
ALLOWED_SOURCES = ("https://huggingface.co/", "https://hf.co/", "https://civitai.com/", "https://civitai.red/",
                   "http://localhost:")
TIMEOUT_S = 10.0  # the longest wait for any byte of a header
DEADLINE_S = 60.0  # one header, all its requests together
MAX_FILES = 16  # headers one request reads from the network (a template names a handful of models)


class HeaderRequestError(ValueError):
    """A header request the panel must be told about (HTTP 400)."""


def allowed_sources() -> List[str]:
    """URL prefixes the server reads headers from."""
    out = list(ALLOWED_SOURCES)
    endpoint = os.environ.get("HF_ENDPOINT", "").strip()
    if endpoint:
        out.append(endpoint.rstrip("/") + "/")
    extra = os.environ.get("LAYER_OFFLOAD_HEADER_SOURCES", "")
    out += [p.strip() for p in extra.split(",") if p.strip().lower().startswith(("http://", "https://"))]
    return out


def _within(url: str, source: str) -> bool:
    """Whether `url` is under the source prefix `source`: the same scheme and host (and port, where the source names
    one), a path below the source's, and no user part (`http://localhost:80@elsewhere/` is elsewhere's)."""
    try:
        u, s = urlsplit(url), urlsplit(source)
        port, want = u.port, s.port
    except ValueError:
        return False
    if "@" in u.netloc or "\\" in url or u.scheme.lower() != s.scheme.lower() or u.hostname != s.hostname:
        return False
    if want is not None and (port or {"http": 80, "https": 443}.get(u.scheme.lower())) != want:
        return False
    return (u.path or "/").startswith(s.path or "/")


def refusal(url: str) -> Optional[str]:
    """Why the server does not ask `url` (None: it does)."""
    sources = allowed_sources()
    if any(_within(url, s) for s in sources):
        return None
    return ("{}: the server reads headers only from {} (ComfyUI's download sources; more with "
            "LAYER_OFFLOAD_HEADER_SOURCES)".format(url[:200], ", ".join(sources)))


def _flag(body: Dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise HeaderRequestError("{} must be true or false, got {!r}".format(key, value))
    return value


def remote_for(body: Dict[str, Any], graph: Dict[str, Any], max_nodes: int) -> Any:
    """The `remote` argument of plan_workflow for a plan request: the workflow's links (from "workflow", the UI form
    the panel sends beside the API "prompt", or the graph itself), read as the request's flags say."""
    from ..offload.predict.header_source import RemoteHeaders
    from ..offload.predict.model_links import workflow_links

    fetch, cached = _flag(body, "fetch_headers"), _flag(body, "cached_headers")
    ui = body.get("workflow")
    if ui is not None and not isinstance(ui, dict):
        raise HeaderRequestError("workflow must be a JSON object, got {}".format(type(ui).__name__))
    source = ui if isinstance(ui, dict) else graph
    nodes = source.get("nodes")
    if isinstance(nodes, list) and len(nodes) > max_nodes:
        raise HeaderRequestError("the workflow has {} nodes; at most {} are planned".format(len(nodes), max_nodes))
    mode = "fetch" if fetch else "cache" if cached else "links"
    return RemoteHeaders(workflow_links(source), mode, timeout=TIMEOUT_S, deadline=DEADLINE_S, allow=refusal,
                         max_files=MAX_FILES)
