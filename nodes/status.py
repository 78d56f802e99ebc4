"""The report the node, the HTTP route and the panel show: built here from the engine's report, published here.

`build_report()` is the JSON: `budget` (total, used, where it came from, each model's share) and `models[]`, each
one `OffloadReport.to_dict()` plus what only the pack knows (kind, the ComfyUI device). `publish()` sends it as
the `layer_offload.report` server event; it runs when sampling ends (a patcher wrapper), after TTS generation, at
every change made from the panel, and when an Offload Report node runs.
"""
from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from ..offload import default_budget, summarize
from .common import full_device_name
from .registry import Managed, managed_models
from .workflow_plan import last_plan, workflow_check

log = logging.getLogger("layer_offload")

EVENT = "layer_offload.report"
_publish_lock = threading.Lock()


def model_entry(m: Managed) -> Dict[str, Any]:
    """One model's report: the engine's report shape plus the pack's kind and ComfyUI device."""
    d = m.handle.report().to_dict()
    d.pop("timeline", None)
    d["name"] = m.name
    d["kind"] = m.kind
    d["device_name"] = d["device"]  # the engine's description, e.g. "sim (8.00 GiB)"
    d["device"] = m.device  # "sim" under --cpu, else "cuda:N"
    d["priority"] = m.handle.priority
    d["host"] = m.handle.host_memory()
    d["step"] = step_times(d)
    return d


def _finite(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def step_times(d: Dict[str, Any]) -> Dict[str, Any]:
    """The last runs' step time (blocks' compute plus stalls, ms per forward) beside the plan's prediction for the
    same (`predicted_step_ms`: the ring simulation over the measured costs; None until every block ran once)."""
    measured, predicted = _finite(d.get("step_ms")), _finite(d.get("predicted_step_ms"))
    d["step_ms"], d["predicted_step_ms"] = measured, predicted  # strict JSON: never NaN or infinity
    off = measured / predicted - 1.0 if measured is not None and predicted else None
    return {"measured_ms": measured, "predicted_ms": predicted, "off_by": off}


def build_report(only: Optional[List[Managed]] = None) -> Dict[str, Any]:
    """The report JSON: the budget and every managed model (or only the given ones)."""
    budget = default_budget()
    models = []
    for m in (only if only is not None else managed_models()):
        try:
            models.append(model_entry(m))
        except Exception as e:  # noqa: BLE001 - one broken handle must not hide the others
            log.warning("Layer Offload: no report for %s: %s", m.name, e)
    shares = budget.targets()
    return {
        "time": time.time(),
        "budget": {
            "total_bytes": int(budget.total_bytes or 0),
            "used_bytes": int(budget.used_bytes),
            "minimum_bytes": int(budget.minimum_bytes()),
            "origin": budget.origin,
            "models": [{"name": m.name, "used_bytes": int(m.handle.device_bytes()),
                        "share_bytes": int(shares.get(id(m.handle), 0))}
                       for m in (only if only is not None else managed_models()) if m.handle.attached],
            "devices": device_budgets(models, budget),
        },
        "models": models,
        # the plan of the last prompt an Offload Report node ran in, beside what was measured (None before one ran)
        "workflow": _workflow(models),
    }


def _workflow(models: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    try:
        return workflow_check(last_plan(), models)
    except Exception as e:  # noqa: BLE001 - the comparison is a nicety: never lose the report over it
        log.warning("Layer Offload: plan beside measured unavailable: %s", e)
        return None


def device_budgets(models: List[Dict[str, Any]], budget: Any) -> Dict[str, Dict[str, Any]]:
    """Each device the reported models keep blocks on: its budget's total and what it holds now (the compute
    device's is the process-wide budget); one entry when every model uses one device."""
    out: Dict[str, Dict[str, Any]] = {}
    for d in models:
        for i, name in enumerate(d.get("devices") or {}):
            b = budget if i == 0 else default_budget(name)  # the compute device is listed first
            name = full_device_name(name)  # one bar for 'sim' and 'sim:0'
            if name in out:
                continue
            out[name] = {"total_bytes": int(b.total_bytes or 0), "used_bytes": int(b.used_bytes),
                         "origin": b.origin, "compute": i == 0}
    return out


def summary_text(data: Dict[str, Any]) -> str:
    """A few readable lines for the node's UI text: the budget, then the engine's summary of each model."""
    b = data["budget"]
    mb = 1 << 20
    lines = ["VRAM budget: {:.1f} MB used of {:.1f} MB ({})".format(b["used_bytes"] / mb, b["total_bytes"] / mb,
                                                                   b["origin"])]
    if not data["models"]:
        lines.append("No offloaded model yet.")
    for d in data["models"]:
        lines.append(summarize(d))
        lines.append(step_line(d.get("step") or step_times(dict(d))))
    lines.extend(workflow_lines(data.get("workflow")))
    return "\n".join(lines)


def _fmt(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return "{:.2f} s".format(value / 1000) if value >= 1000 else "{:.1f} ms".format(value)
    return "{:.2f} GB".format(value / (1 << 30)) if value >= 1 << 30 else "{:.1f} MB".format(value / (1 << 20))


def workflow_lines(w: Optional[Dict[str, Any]]) -> List[str]:
    """The whole workflow, planned beside measured, for the node's text."""
    if not w:
        return []
    lines = ["Workflow plan on {} beside this run (the offloaded models it names):".format(w.get("card") or "?")]
    for key, label, unit in (("time_ms", "time", "ms"), ("peak_vram_bytes", "peak VRAM", "b"),
                             ("host_bytes", "host RAM", "b"), ("disk_bytes", "disk", "b")):
        pair = w.get(key) or {}
        off = pair.get("off_by")
        lines.append("  {}: planned {}, measured {}{}".format(label, _fmt(pair.get("planned"), unit),
                                                          _fmt(pair.get("measured"), unit),
                                                          "" if off is None else " ({:+.0%})".format(off)))
    if w.get("times_note"):
        lines.append("  times: {} (not this run's to compare; the memory figures are)".format(w["times_note"]))
    run = w.get("run") or {}
    lines.append("  whole run as planned: {}, peak VRAM {}, RAM {} of {} free{}".format(
        _fmt(run.get("total_ms"), "ms"), _fmt(run.get("peak_vram_bytes"), "b"), _fmt(run.get("ram_needed_bytes"), "b"),
        _fmt(run.get("ram_free_bytes"), "b"), "" if run.get("fits", True) else "; does not fit the card"))
    return lines


def step_line(step: Dict[str, Any]) -> str:
    """'  step: 123.4 ms measured, 118.0 ms predicted (+4.6%)' for the node's text."""
    measured, predicted = step.get("measured_ms"), step.get("predicted_ms")
    if measured is None:
        return "  step: no forward measured yet"
    if predicted is None:
        return f"  step: {measured:.1f} ms measured; predicted once every block has run"
    return f"  step: {measured:.1f} ms measured, {predicted:.1f} ms predicted by the plan ({step['off_by']:+.1%})"


def _prompt_server() -> Any:
    """ComfyUI's running PromptServer, or None (unit tests, scripts): never import the server module ourselves."""
    for name in ("server", "comfy.cmd.server"):
        module = sys.modules.get(name)
        cls = getattr(module, "PromptServer", None) if module is not None else None
        instance = getattr(cls, "instance", None) if cls is not None else None
        if instance is not None:
            return instance
    return None


def publish(data: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """Send the report (built now unless given) to every connected browser; returns what was sent."""
    ps = _prompt_server()
    if ps is None:
        return None
    with _publish_lock:
        try:
            data = build_report() if data is None else data
            ps.send_sync(EVENT, data)
        except Exception as e:  # noqa: BLE001 - the UI event is a nicety; it must never fail a prompt
            log.debug("Layer Offload: could not send %s: %s", EVENT, e)
    return data
