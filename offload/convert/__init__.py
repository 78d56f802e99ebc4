""""Offload this workflow": a ComfyUI workflow (UI JSON, subgraphs included) with the pack's nodes put in, so it
runs offloaded and otherwise unchanged. `edits` decides the changes (which loaders, which node after which output,
the VRAM Budget and its links through subgraph inputs), `presets` picks each loader's preset from the workflow plan
on a card, `apply` writes the edits into the JSON (`ui_graph` reads and edits the graphs, `layout` places new nodes,
`pack_nodes` is the pack's node types as nodes/ defines them), `cli` is `python -m offload convert`.

    convert_workflow(workflow: dict, find_file=None, card=None, ram_bytes=None, preset=None) -> Conversion
    Conversion.workflow (the converted copy), .edits (what the panel applies with the graph API), .changes, .notes

Layer: an application of the workflow plan (offload.predict), above it; plain JSON, no ComfyUI import. Only
`offload/__main__` (the command) and nodes/ (the panel's route) import it.
Used from outside: `convert_workflow`, `Conversion`, `ConvertError`, `cli.add_arguments`, `cli.main`,
`pack_nodes` (the tests hold it to nodes/).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

from .apply import apply_edits
from .edits import Change, plan_edits
from .presets import PlanPresets
from .ui_graph import ConvertError, Workflow

__all__ = ["convert_workflow", "Conversion", "ConvertError"]


@dataclass
class Conversion:
    """A converted workflow and how it came about."""

    workflow: dict[str, Any]
    edits: list[dict[str, Any]]
    changes: list[Change]
    card: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.edits)

    def to_dict(self) -> dict[str, Any]:
        return {"workflow": self.workflow, "edits": self.edits, "changes": [c.to_dict() for c in self.changes],
                "card": self.card, "notes": self.notes}


def convert_workflow(workflow: Any, find_file: Callable[[str, str], str | None] | None = None, card: Any = None,
                     ram_bytes: int | None = None, preset: str | None = None) -> Conversion:
    """`workflow` with the pack's nodes put in (a new dict; the argument is not changed). Presets: `preset` for every
    node when given, else the workflow plan's on `card` from the files `find_file` finds (see `presets`)."""
    data = copy.deepcopy(workflow)
    wf = Workflow(data)
    notes: list[str] = []
    card_name = None
    if preset is not None:
        from ..config import PRESETS

        if preset not in PRESETS:
            raise ConvertError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
        preset_for: Callable[[str, int, str], str] = lambda gid, nid, role: preset  # noqa: E731
    else:
        plan, card_name = _plan(workflow, find_file, card, ram_bytes, notes)
        preset_for = PlanPresets(wf, plan)
    edits, changes = plan_edits(wf, preset_for)
    apply_edits(wf, edits)
    if not edits:
        notes.append("nothing to change: every loader is offloaded already")
    return Conversion(data, edits, changes, card_name, notes)


def _plan(workflow: Any, find_file: Callable[[str, str], str | None] | None, card: Any, ram_bytes: int | None,
          notes: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """The workflow plan the presets come from, or None (then every preset is auto) with the reason in `notes`."""
    from ..predict import plan_workflow

    try:
        plan = plan_workflow(workflow, find_file or (lambda kind, name: None), card, ram_bytes).to_dict()
    except (ValueError, KeyError, TypeError) as exc:  # a graph the plan cannot read: convert with auto presets
        notes.append(f"the workflow could not be planned ({str(exc).splitlines()[0][:200] if str(exc) else exc!r}): "
                     f"every preset is auto")
        return None, None
    missing = sorted({m["name"] for m in plan.get("models", []) if not m.get("found") and m.get("name")
                      and m.get("role") in ("diffusion", "checkpoint", "text_encoder")})
    if missing:
        notes.append(f"{len(missing)} model file(s) not found ({', '.join(missing[:4])}"
                     f"{', ...' if len(missing) > 4 else ''}): their loaders get preset auto")
    return plan, (plan.get("card") or {}).get("name")
