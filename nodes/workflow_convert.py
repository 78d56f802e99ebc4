""""Offload this workflow" in ComfyUI: the panel sends the open workflow (UI JSON, as the frontend serializes it) to
POST /layer_offload/convert and gets back the edits `offload.convert` decides, with the presets the workflow plan
chooses on the card ComfyUI runs on (or the one chosen in the panel), from the model files in ComfyUI's folders.
The panel applies the edits with the frontend's graph API (web/offload_convert.js), so ComfyUI's undo takes them back.

`convert_graph` is the route's work; bad input is a `PlanRequestError` (one line, HTTP 400). Nothing is loaded.
"""
from __future__ import annotations

from typing import Any, Dict

from .workflow_plan import PlanRequestError, _one_line, card_of, find_file, free_ram_bytes

MAX_NODES = 20_000  # every graph of the workflow together (the converter's own limit)


def convert_graph(body: Any) -> Dict[str, Any]:
    """{"edits", "changes", "notes", "card", "card_note", "workflow"} for the workflow a request carries."""
    if not isinstance(body, dict):
        raise PlanRequestError("the request body must be a JSON object")
    workflow = body.get("workflow")
    if not isinstance(workflow, dict) or not isinstance(workflow.get("nodes"), list):
        raise PlanRequestError("give the open workflow as 'workflow' (UI form: the graph the frontend serializes)")
    card, note = card_of(body)
    try:
        from ..offload.convert import ConvertError, convert_workflow
    except ImportError:
        raise PlanRequestError("this version of the engine cannot convert a workflow (offload.convert is missing)") \
            from None
    try:
        result = convert_workflow(workflow, find_file, card=card, ram_bytes=free_ram_bytes())
    except ConvertError as e:
        raise PlanRequestError(_one_line(e)) from None
    answer = result.to_dict()
    answer.update(card=card.name, card_note=note)
    return answer
