"""Shared pieces of the ComfyUI nodes: category, types, the preset dropdown, the engine device, the budget."""
from __future__ import annotations

import logging
import threading
from typing import Any, List, Optional

from ..offload import DEFAULT_PRESET, PRESETS, OffloadConfig, VramBudget, default_budget, preset_tooltip

log = logging.getLogger("layer_offload")

CATEGORY = "Layer Offload"
BUDGET_TYPE = "OFFLOAD_BUDGET"
PRESET_CHOICES = list(PRESETS)  # the one preset table's order
WEIGHT_DTYPES_FALLBACK = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


class AnyType(str):
    """A ComfyUI type string that matches every other type (validation compares with `!=`)."""

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return str.__hash__(self)


ANY = AnyType("*")

TIP_BUDGET = ("Optional link from a VRAM Budget node: the process-wide device budget shared by every offloaded model. "
              "Unlinked: the current process-wide budget is used.")
TIP_PRIORITY = "Higher priority models keep more resident blocks when several offloaded models share the budget."


def io_type(name: Any) -> Any:
    """The V3 io class for a type name the pack defines (OFFLOAD_BUDGET, TTS_MODEL, the any-type `*`)."""
    from comfy_api.latest import io

    return io.Custom(name)


def preset_input(name: str = "preset", tooltip: Optional[str] = None) -> Any:
    """The preset dropdown, identical on every node (choices and tooltip from the engine's preset table)."""
    from comfy_api.latest import io

    return io.Combo.Input(name, options=list(PRESET_CHOICES), default=DEFAULT_PRESET,
                          tooltip=tooltip if tooltip is not None else preset_tooltip())


def optional_inputs() -> List[Any]:
    """The optional `budget` link and `priority` shared by every offload node."""
    from comfy_api.latest import io

    return [io_type(BUDGET_TYPE).Input("budget", optional=True, tooltip=TIP_BUDGET),
            io.Int.Input("priority", default=0, min=-100, max=100, step=1, optional=True, tooltip=TIP_PRIORITY)]


_logged_once: set = set()
_log_lock = threading.Lock()


def log_once(key: str, msg: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log a fallback or limitation once per process, not once per prompt."""
    with _log_lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    log.log(level, msg, *args)


def engine_device() -> Optional[str]:
    """The engine device matching ComfyUI's torch device: 'cuda:N', 'sim' for --cpu, None when unsupported."""
    import comfy.model_management as mm

    dev = mm.get_torch_device()
    dev_type = getattr(dev, "type", str(dev))
    if dev_type == "cuda":
        return "cuda" if dev.index is None else "cuda:{}".format(dev.index)  # the engine resolves "cuda"
    if dev_type == "cpu":
        return "sim"
    log_once("device-" + dev_type, "Layer Offload: device type %r is not supported by the engine; "
             "models are left as ComfyUI loaded them (no offloading).", dev_type)
    return None


def make_config(preset: str, device: str, **overrides: Any) -> OffloadConfig:
    """OffloadConfig for a node's preset on the given engine device (ValueError names the valid presets)."""
    return OffloadConfig.from_preset(preset, device=device, **overrides)


def resolve_budget(budget: Any) -> VramBudget:
    """The VramBudget a node should use: its linked OFFLOAD_BUDGET, else the process-wide one."""
    if budget is None:
        return default_budget()
    spec_apply = getattr(budget, "apply", None)
    if callable(spec_apply):
        return spec_apply()
    if isinstance(budget, VramBudget):
        return budget
    raise ValueError("budget must come from a VRAM Budget node, got {!r}".format(type(budget).__name__))
