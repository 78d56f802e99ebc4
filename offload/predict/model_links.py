"""The download links a ComfyUI workflow carries for its model files, as the frontend's missing-models dialog reads
them: `properties.models` on nodes (top level and inside subgraph definitions, nested) and the workflow's top-level
`models` list (templates), each entry `{"name", "url", "directory"}`.

A workflow is untrusted: the walk is bounded (nodes, entries, nesting, string lengths), keeps http(s) URLs only,
and never follows anything; the first entry for a name wins, one whose directory suits the loader's folder first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_NODES = 100_000  # nodes visited over the workflow and its subgraph definitions
MAX_LINKS = 10_000
MAX_URL = 4096
MAX_NAME = 1024
MAX_DEPTH = 32  # subgraph definitions nested inside subgraph definitions (ComfyUI keeps them flat; some tools nest)

# a loader's folder kind (offload.predict's names) -> the `directory` values a link for it may carry
DIRECTORIES = {"diffusion_models": ("diffusion_models", "unet"), "unet_gguf": ("diffusion_models", "unet", "unet_gguf"),
               "checkpoints": ("checkpoints",), "text_encoders": ("text_encoders", "clip"),
               "clip": ("text_encoders", "clip"), "vae": ("vae",), "loras": ("loras",), "tts": ("tts",)}


@dataclass(frozen=True)
class ModelLink:
    """One model file the workflow says where to download."""

    name: str
    url: str
    directory: str


def _entries(models: Any) -> list[ModelLink]:
    out = []
    if not isinstance(models, list):
        return out
    for m in models[:MAX_LINKS]:
        if not isinstance(m, dict):
            continue
        name, url, directory = m.get("name"), m.get("url"), m.get("directory", "")
        if not (isinstance(name, str) and isinstance(url, str) and 0 < len(name) <= MAX_NAME
                and 0 < len(url) <= MAX_URL):
            continue
        if urlsplit(url).scheme.lower() not in ("http", "https"):
            continue
        out.append(ModelLink(name, url, directory if isinstance(directory, str) else ""))
    return out


def node_links(properties: Any) -> dict[str, ModelLink]:
    """The links one node's `properties.models` carries, by file name (the first entry for a name wins), read with
    the same bounds and checks as the whole workflow's."""
    models = properties.get("models") if isinstance(properties, dict) else None
    out: dict[str, ModelLink] = {}
    for link in _entries(models):
        out.setdefault(link.name, link)
    return out


def workflow_links(graph: Any) -> list[ModelLink]:
    """Every download link of a UI workflow (or an {"workflow": ...} / {"extra_pnginfo": {"workflow": ...}} wrapper),
    in the order the file lists them; [] for an API-form graph, which keeps no links."""
    if isinstance(graph, dict) and isinstance(graph.get("workflow"), dict):
        graph = graph["workflow"]
    if not isinstance(graph, dict):
        return []
    links = _entries(graph.get("models"))
    budget = [MAX_NODES]

    def walk(container: Any, depth: int) -> None:
        if not isinstance(container, dict) or depth > MAX_DEPTH:
            return
        nodes = container.get("nodes")
        for node in nodes if isinstance(nodes, list) else []:
            budget[0] -= 1
            if budget[0] < 0 or len(links) >= MAX_LINKS:
                return
            props = node.get("properties") if isinstance(node, dict) else None
            if isinstance(props, dict):
                links.extend(_entries(props.get("models")))
        defs = container.get("definitions")
        subgraphs = defs.get("subgraphs") if isinstance(defs, dict) else None
        for sub in subgraphs if isinstance(subgraphs, list) else []:
            walk(sub, depth + 1)

    walk(graph, 0)
    return links[:MAX_LINKS]


def link_for(links: list[ModelLink], folder: str, name: str) -> ModelLink | None:
    """The link for a loader's file `name` in folder kind `folder`: an entry of that name whose directory suits the
    folder, else any entry of that name."""
    same = [link for link in links if link.name == name]
    suits = DIRECTORIES.get(folder, (folder,))
    return next((link for link in same if link.directory in suits), same[0] if same else None)
