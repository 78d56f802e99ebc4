"""The preset each converted loader gets: the one the workflow plan (`offload.predict.plan_workflow`) predicts runs
its models fastest on the card while they fit; `auto` where that is as fast (within AUTO_MARGIN: it adapts to the
card it finds), and where the plan cannot tell (a model file not on this machine, a model the plan does not cost).

The plan names a model by its loader's execution id: the node id at the root, `<instance>:<node>` inside a subgraph
(nested: every instance on the way, as ComfyUI's frontend flattens the graph), with `:<widget>` or `:<part>` after
it for a loader of several files or a checkpoint's parts. A subgraph definition is converted once for all its
instances: its loader's preset is the best over every instance's models together.
"""
from __future__ import annotations

from typing import Any, Iterable

from ..config import PRESETS
from .ui_graph import ROOT, Workflow

AUTO = "auto"
AUTO_MARGIN = 0.03  # auto is taken when its predicted time is within 3% of the fastest preset's


def choose_preset(models: Iterable[dict[str, Any]]) -> str:
    """The preset for one loader node whose models (the plan's `models` entries) run together: the fastest total
    time per call over the presets where every one of them fits; `auto` when it is within AUTO_MARGIN of that or when
    the plan has no figures."""
    models = [m for m in models if m.get("found") and isinstance(m.get("presets"), dict)]
    totals: dict[str, float] = {}
    for name in PRESETS:
        figures = [m["presets"].get(name) for m in models]
        if not figures or any(not f or not f.get("fits") or f.get("ms_per_call") is None for f in figures):
            continue
        totals[name] = sum(float(f["ms_per_call"]) * max(1, int(m.get("calls") or 0))
                           for f, m in zip(figures, models))
    if not totals:
        return AUTO
    best = min(totals.values())
    if AUTO in totals and totals[AUTO] <= best * (1 + AUTO_MARGIN):
        return AUTO
    return min(totals, key=lambda name: (totals[name], list(PRESETS).index(name)))


def execution_prefixes(wf: Workflow) -> dict[str, list[str]]:
    """Graph id -> the execution-id prefixes its nodes run under ("" at the root; "128:" in subgraph instance 128)."""
    out: dict[str, list[str]] = {ROOT: [""]}
    limit = 10_000  # instances of instances multiply: past this many paths a definition takes the plain default

    def prefixes(gid: str, depth: int = 0) -> list[str]:
        if gid in out:
            return out[gid]
        out[gid] = []  # nesting is acyclic (checked by Workflow); this only guards the recursion
        found: list[str] = []
        for parent in wf.graphs():
            for node in parent.nodes:
                if node["type"] == gid:
                    found += [f"{p}{node['id']}:" for p in prefixes(parent.gid, depth + 1)]
                    if len(found) > limit:
                        out[gid] = []
                        return []
        out[gid] = found
        return found

    for gid in wf.subgraphs:
        prefixes(gid)
    return out


class PlanPresets:
    """`edits.PresetFor` answered from a workflow plan (`WorkflowPlan.to_dict()`)."""

    def __init__(self, wf: Workflow, plan: dict[str, Any] | None) -> None:
        self.models = (plan or {}).get("models") or []
        self.prefixes = execution_prefixes(wf)
        self.chosen: dict[tuple[str, int], str] = {}

    def models_of(self, gid: str, nid: int, role: str) -> list[dict[str, Any]]:
        """The plan's models a loader node loads, in every instance of its graph."""
        keys = [f"{p}{nid}" for p in self.prefixes.get(gid, [])]
        found = [m for m in self.models if any(str(m.get("key")) == k or str(m.get("key")).startswith(k + ":")
                                              for k in keys)]
        if role == "diffusion":
            found = [m for m in found if m.get("role") in ("diffusion", "unknown")]
        elif role == "text_encoder":
            found = [m for m in found if m.get("role") == "text_encoder"]
        elif role == "checkpoint":
            found = [m for m in found if m.get("role") in ("diffusion", "text_encoder", "unknown")]
        return found

    def __call__(self, gid: str, nid: int, role: str) -> str:
        key = (gid, nid)
        if key not in self.chosen:
            self.chosen[key] = choose_preset(self.models_of(gid, nid, role))
        return self.chosen[key]
