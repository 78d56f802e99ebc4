"""Offload Report node: per-model, per-block figures of the last run as JSON, a readable summary in the UI."""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict, List, Optional

from ..offload import default_budget
from .common import ANY, CATEGORY, Managed, managed_models, state_of
from .comfy_patcher import _managed_root

log = logging.getLogger("layer_offload")

BLOCK_FIELDS = ("name", "tier", "bytes", "h2d_ms", "compute_ms", "stall_ms")


def _model_entry(m: Managed) -> Dict[str, Any]:
    rep = m.handle.report()
    d = rep.to_dict() if hasattr(rep, "to_dict") else dict(rep)
    d.pop("timeline", None)
    d["name"] = m.name
    d["kind"] = m.kind
    d["device_name"] = d.get("device") or m.device  # the engine's description, e.g. "sim (8.00 GiB)"
    d["device"] = m.device  # "sim" under --cpu, else "cuda:N"
    d["preset"] = d.get("preset") or m.preset
    d["priority"] = m.priority
    blocks = d.get("blocks") or []
    d["blocks"] = [{**{k: b.get(k) for k in BLOCK_FIELDS}, **{k: v for k, v in b.items() if k not in BLOCK_FIELDS}}
                   for b in blocks]
    d.setdefault("streamed_bytes", sum(b.get("bytes", 0) or 0 for b in blocks if b.get("tier") != "vram"))
    d["resident_blocks"] = sum(1 for b in blocks if b.get("tier") == "vram")
    d["streamed_blocks"] = len(blocks) - d["resident_blocks"]
    return d


def build_report(only: Optional[List[Managed]] = None) -> Dict[str, Any]:
    """The report JSON: the budget and every managed model (or only the given ones)."""
    budget = default_budget()
    models = []
    for m in (only if only is not None else managed_models()):
        try:
            models.append(_model_entry(m))
        except Exception as e:  # noqa: BLE001 - one broken handle must not hide the others
            log.warning("Layer Offload: no report for %s: %s", m.name, e)
    return {
        "time": time.time(),
        "budget": {"total_bytes": int(budget.total_bytes or 0), "used_bytes": int(budget.used_bytes)},
        "models": models,
    }


def _mb(n: Any) -> str:
    return "{:.1f} MB".format((n or 0) / 2 ** 20)


def summary_text(data: Dict[str, Any]) -> str:
    """A few readable lines for the node's UI text."""
    b = data["budget"]
    lines = ["VRAM budget: {} used of {}".format(_mb(b["used_bytes"]), _mb(b["total_bytes"]))]
    if not data["models"]:
        lines.append("No offloaded model yet.")
    for d in data["models"]:
        lines.append("{} [{}] on {} (preset {}, priority {}): {} resident / {} streamed blocks; resident {}, "
                     "streamed {}".format(d["name"], d.get("kind"), d.get("device"), d.get("preset"),
                                           d.get("priority"), d["resident_blocks"], d["streamed_blocks"],
                                           _mb(d.get("resident_bytes")), _mb(d.get("streamed_bytes"))))
        lines.append("  last runs: {} forward(s), {} moved, overlap {:.2f}, {:.2f} GB/s, stall {:.1f} ms".format(
            d.get("forwards", 0), _mb(d.get("total_bytes_streamed")), float(d.get("overlap_ratio") or 0.0),
            float(d.get("effective_gbps") or 0.0), float(d.get("stall_ms") or 0.0)))
    return "\n".join(lines)


def managed_of_model(model: Any) -> Optional[Managed]:
    """The Managed record behind a MODEL/CLIP patcher (or a raw module), if it is offloaded."""
    target = getattr(model, "patcher", model)
    inner = getattr(target, "model", target)
    _, _, st = _managed_root(inner) if inner is not None else (None, "", None)
    return st if st is not None else state_of(inner)


class OffloadReport:
    """Output node: report JSON (STRING) + readable summary; link `anything` from a sampler or decoder."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {"required": {"anything": (ANY, {"tooltip": "Link any output (e.g. a sampler's LATENT) so the report "
                                                           "runs after it."})},
                "optional": {"model": ("MODEL", {"tooltip": "Report only this model; unlinked: every offloaded "
                                                            "model under the budget."})}}

    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report_json",)
    OUTPUT_TOOLTIPS = ("The report as JSON: budget, models, per-block tier/bytes/h2d/compute/stall.",)
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = CATEGORY
    DESCRIPTION = "Per-model and per-block figures of the last run: tiers, bytes, transfer/compute/stall times."

    @classmethod
    def IS_CHANGED(cls, **kwargs: Any) -> float:
        return float("nan")  # always re-run: it reports the latest figures

    def report(self, anything: Any, model: Any = None) -> Dict[str, Any]:
        only = None
        if model is not None:
            st = managed_of_model(model)
            only = [st] if st is not None else []
        data = build_report(only)
        from .routes import publish

        publish(data)
        text = summary_text(data)
        blob = json.dumps(data)
        # "text" is what the node shows; "report_json" puts the full report in /history for API clients.
        return {"ui": {"text": [text], "report_json": [blob]}, "result": (blob,)}
