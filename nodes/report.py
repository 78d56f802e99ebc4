"""Offload Report node: per-model, per-block figures of the last run as JSON, a readable summary in the UI."""
from __future__ import annotations

import json
from typing import Any, Dict

from comfy_api.latest import io

from .common import CATEGORY
from .registry import managed_of
from .status import build_report, publish, summary_text
from .workflow_plan import plan_for_prompt


class OffloadReport(io.ComfyNode):
    """Output node: report JSON (STRING) + readable summary; link `anything` from a sampler or decoder."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadReport", display_name="Offload Report", category=CATEGORY, is_output_node=True,
            description="Per-model and per-block figures of the last run: tiers, bytes, transfer/compute/stall times.",
            inputs=[io.AnyType.Input("anything", tooltip="Link any output (e.g. a sampler's LATENT) so the report "
                                                         "runs after it."),
                    io.Model.Input("model", optional=True, tooltip="Report only this model; unlinked: every "
                                                                   "offloaded model under the budget.")],
            outputs=[io.String.Output(display_name="report_json", tooltip=(
                "The report as JSON: budget, models, per-block tier/bytes/h2d/compute/stall."))],
            hidden=[io.Hidden.prompt])  # the prompt it runs in: planned (headers only) to set beside the run

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> float:
        return float("nan")  # always re-run: it reports the latest figures

    @classmethod
    def execute(cls, anything: Any, model: Any = None) -> io.NodeOutput:
        hidden = getattr(cls, "hidden", None)
        out = cls.report(anything, model, prompt=getattr(hidden, "prompt", None))
        return io.NodeOutput(*out["result"], ui=out["ui"])

    @classmethod
    def report(cls, anything: Any, model: Any = None, prompt: Any = None) -> Dict[str, Any]:
        """The node's work: {"ui": what the node shows, "result": its outputs}. `prompt`: the API graph it runs in,
        planned (file headers only) so the report sets the plan's figures beside the measured ones."""
        if prompt is not None:
            plan_for_prompt(prompt)
        only = None
        if model is not None:
            st = managed_of(model)
            only = [st] if st is not None else []
        data = build_report(only)
        publish(build_report() if only is not None else data)  # the panel always gets every model
        blob = json.dumps(data)
        # "text" is what the node shows; "report_json" puts the full report in /history for API clients.
        return {"ui": {"text": [summary_text(data)], "report_json": [blob]}, "result": (blob,)}
