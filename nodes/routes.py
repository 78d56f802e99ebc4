"""HTTP routes for the panel (web/layer_offload.js): the report, the priority and budget controls, the workflow plan
and "Offload this workflow".

GET  /layer_offload/report                      the report JSON (nodes/status.py)
POST /layer_offload/priority {"model", "priority"}  a model's priority; takes effect at its next forward
POST /layer_offload/budget   {"total_gb"} or {"total_bytes"}  the process-wide budget total
GET  /docs/<node id>/<locale>.md                 the pack's node help pages (nodes/node_help.py), its ids only
POST /layer_offload/plan     {"prompt": API graph} or {"workflow": UI graph}, optional "card": a card's name
                             the workflow plan before the graph is queued (nodes/workflow_plan.py; nothing loads);
                             "fetch_headers": true also plans missing models from the headers of the download links
                             the workflow carries (nodes/plan_headers.py), "cached_headers": true from those read before
POST /layer_offload/convert  {"workflow": UI graph}, optional "card": the edits that put the pack's nodes into the
                             open workflow, presets planned for the card (nodes/workflow_convert.py; nothing loads)

A change answers with the new report and publishes it; a bad value answers 400 (an unknown model 404) with
{"error": "..."} and changes nothing. No route ever answers with a traceback.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Tuple

from ..offload import default_budget
from .budget import GIB, check_total
from .registry import find_managed
from .status import _prompt_server, build_report, publish
from .workflow_convert import convert_graph
from .workflow_plan import plan_graph

log = logging.getLogger("layer_offload")

ROUTE = "/layer_offload/report"
PRIORITY_ROUTE = "/layer_offload/priority"
BUDGET_ROUTE = "/layer_offload/budget"
PLAN_ROUTE = "/layer_offload/plan"
CONVERT_ROUTE = "/layer_offload/convert"
PRIORITY_RANGE = (-100, 100)
PANEL_ORIGIN = "set from the Layer Offload panel"
_registered = False


class RouteError(Exception):
    """A request the panel must be told about: HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _number(body: Dict[str, Any], key: str) -> float:
    value = body.get(key)
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    if isinstance(value, str):
        try:
            value = float(value) if len(value) <= 40 else None
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RouteError(400, "{} must be a number, got {}".format(key, shown))
    try:
        value = float(value)  # an integer beyond float range: OverflowError
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise RouteError(400, "{} must be a finite number, got {}".format(key, shown))
    return value


def set_priority(body: Dict[str, Any]) -> Dict[str, Any]:
    """Change one model's priority; returns the new report."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise RouteError(400, "give the model's name as 'model'")
    managed = find_managed(name)
    if managed is None or not managed.handle.attached:
        raise RouteError(404, "no offloaded model named {!r}".format(name))
    value = _number(body, "priority")
    if value != int(value) or not PRIORITY_RANGE[0] <= value <= PRIORITY_RANGE[1]:
        raise RouteError(400, "priority must be a whole number from {} to {}, got {!r}".format(
            PRIORITY_RANGE[0], PRIORITY_RANGE[1], body.get("priority")))
    managed.handle.set_priority(int(value))
    managed.priority = int(value)
    return publish() or build_report()


def set_budget(body: Dict[str, Any]) -> Dict[str, Any]:
    """Change the process-wide budget total; returns the new report."""
    if "total_bytes" in body:
        total = _number(body, "total_bytes")
    elif "total_gb" in body:
        total = _number(body, "total_gb") * GIB
    else:
        raise RouteError(400, "give the budget as 'total_gb' (or 'total_bytes')")
    try:
        nbytes = check_total(total, PANEL_ORIGIN)
        default_budget().set_total(nbytes, origin=PANEL_ORIGIN)
    except ValueError as e:  # BudgetError included: over the device, under a model's minimum
        raise RouteError(400, str(e)) from None
    log.info("Layer Offload: VRAM budget set to %.2f GB from the panel", nbytes / GIB)
    return publish() or build_report()


def handle_post(kind: str, body: Any) -> Tuple[int, Dict[str, Any]]:
    """(status, JSON) for a control request; the same code serves the routes and the tests."""
    try:
        if not isinstance(body, dict):
            raise RouteError(400, "the request body must be a JSON object")
        if kind == "priority":
            return 200, {"ok": True, "report": set_priority(body)}
        if kind == "budget":
            return 200, {"ok": True, "report": set_budget(body)}
        if kind == "plan":
            return 200, dict(plan_graph(body), ok=True)
        if kind == "convert":
            return 200, dict(convert_graph(body), ok=True)
        raise RouteError(404, "unknown control {!r}".format(kind))
    except RouteError as e:
        return e.status, {"ok": False, "error": str(e)}
    except (ValueError, OverflowError) as e:  # out of any range the engine takes, a plan request it cannot read
        return 400, {"ok": False, "error": str(e)[:500]}
    except Exception as e:  # noqa: BLE001 - a message for the panel, never a traceback
        log.warning("Layer Offload: %s request failed: %s", kind, e)
        return 500, {"ok": False, "error": "{}: {}".format(type(e).__name__, str(e).strip().splitlines()[0][:500]
                                                             if str(e).strip() else "")}


def register_routes() -> bool:
    """Add the routes to ComfyUI's server (once); False when no server is running."""
    global _registered
    if _registered:
        return True
    ps = _prompt_server()
    if ps is None or not hasattr(ps, "routes"):
        return False
    from aiohttp import web

    @ps.routes.get(ROUTE)
    async def _report(request: Any) -> Any:
        try:
            return web.json_response(build_report())
        except Exception as e:  # noqa: BLE001
            return web.json_response({"ok": False, "error": str(e)}, status=500)

    async def _post(request: Any, kind: str) -> Any:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - not JSON
            return web.json_response({"ok": False, "error": "the request body must be JSON"}, status=400)
        if kind in ("plan", "convert"):  # read file headers and run a meta-device forward: off the event loop
            import asyncio

            status, data = await asyncio.get_running_loop().run_in_executor(None, handle_post, kind, body)
        else:
            status, data = handle_post(kind, body)
        return web.json_response(data, status=status)

    @ps.routes.post(PRIORITY_ROUTE)
    async def _priority(request: Any) -> Any:
        return await _post(request, "priority")

    @ps.routes.post(BUDGET_ROUTE)
    async def _budget(request: Any) -> Any:
        return await _post(request, "budget")

    @ps.routes.post(PLAN_ROUTE)
    async def _plan(request: Any) -> Any:
        return await _post(request, "plan")

    @ps.routes.post(CONVERT_ROUTE)
    async def _convert(request: Any) -> Any:
        return await _post(request, "convert")

    from .node_help import register_help_route

    register_help_route(ps)  # the nodes' help where a ComfyUI makes the frontend ask for core docs
    _registered = True
    return True
