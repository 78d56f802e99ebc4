"""HTTP route and server event that feed the web panel (web/layer_offload.js)."""
from __future__ import annotations

import logging
import sys
from typing import Any, Dict

log = logging.getLogger("layer_offload")

EVENT = "layer_offload.report"
ROUTE = "/layer_offload/report"
_registered = False


def _prompt_server() -> Any:
    """ComfyUI's running PromptServer, or None (unit tests, scripts): never import the server module ourselves."""
    server = sys.modules.get("server")
    cls = getattr(server, "PromptServer", None) if server is not None else None
    return getattr(cls, "instance", None) if cls is not None else None


def publish(data: Dict[str, Any]) -> None:
    """Send the report to every connected browser."""
    ps = _prompt_server()
    if ps is None:
        return
    try:
        ps.send_sync(EVENT, data)
    except Exception as e:  # noqa: BLE001 - the UI event is a nicety; the node result already carries the data
        log.debug("Layer Offload: could not send %s: %s", EVENT, e)


def register_routes() -> bool:
    """Add GET /layer_offload/report to ComfyUI's server (once); False when no server is running."""
    global _registered
    if _registered:
        return True
    ps = _prompt_server()
    if ps is None or not hasattr(ps, "routes"):
        return False
    from aiohttp import web

    @ps.routes.get(ROUTE)
    async def _report(request: Any) -> Any:
        from .report import build_report

        return web.json_response(build_report())

    _registered = True
    return True
