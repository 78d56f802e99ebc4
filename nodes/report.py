"""Offload Report node: per-model, per-block figures of the last run as JSON, a readable summary in the UI."""
from __future__ import annotations

import json
from typing import Any, Dict

from .common import ANY, CATEGORY
from .registry import managed_of
from .status import build_report, publish, summary_text


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
            st = managed_of(model)
            only = [st] if st is not None else []
        data = build_report(only)
        publish(build_report() if only is not None else data)  # the panel always gets every model
        blob = json.dumps(data)
        # "text" is what the node shows; "report_json" puts the full report in /history for API clients.
        return {"ui": {"text": [summary_text(data)], "report_json": [blob]}, "result": (blob,)}
