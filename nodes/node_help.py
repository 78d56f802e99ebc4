"""The nodes' help pages (web/docs/<node id>.md) where ComfyUI's frontend asks for a core node's help.

The frontend's node help fetches `/extensions/<pack folder>/docs/<node id>/<locale>.md`, then
`/extensions/<pack folder>/docs/<node id>.md`, for a node whose `python_module` names its custom-node folder: ComfyUI
serves those from the pack's web directory with nothing more. A ComfyUI that reports another `python_module` for V3
nodes (the pip-installable 0.12 fork gives every V3 node "."), makes the frontend take the pack's nodes for core ones
and ask `/docs/<node id>/<locale>.md`, which ComfyUI serves from its embedded docs. This route answers that path for
the pack's own node ids only (the pattern lists them, so every other node's docs stay ComfyUI's), with the same page
for every locale.
"""
from __future__ import annotations

import os
import re
from typing import Any, List

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "web", "docs")
_NODE_ID = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


def documented_nodes() -> List[str]:
    """The node ids that have a page in web/docs."""
    try:
        names = os.listdir(DOCS)
    except OSError:
        return []
    return sorted(n[:-3] for n in names if n.endswith(".md") and _NODE_ID.match(n[:-3]))


def help_route_path() -> str:
    """The aiohttp path of the core-docs route, matching the pack's node ids only ('' when there is none)."""
    nodes = documented_nodes()
    if not nodes:
        return ""
    return "/docs/{node:(?:" + "|".join(nodes) + ")}/{locale:[A-Za-z_-]{1,16}}.md"


def register_help_route(ps: Any) -> bool:
    """Add the route to ComfyUI's server routes (before its static /docs, so the pack's ids are answered here)."""
    path = help_route_path()
    if not path:
        return False
    from aiohttp import web

    @ps.routes.get(path)
    async def _help(request: Any) -> Any:
        page = os.path.join(DOCS, request.match_info["node"] + ".md")
        try:
            with open(page, encoding="utf-8") as f:
                text = f.read(1 << 20)
        except OSError:
            raise web.HTTPNotFound() from None
        return web.Response(text=text, content_type="text/markdown", charset="utf-8")

    return True
