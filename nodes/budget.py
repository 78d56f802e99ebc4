"""VRAM Budget node: one process-wide device budget shared by every offloaded model."""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

from ..offload import PRESETS, VramBudget, default_budget
from .common import BUDGET_TYPE, CATEGORY, PRESET_CHOICES, engine_device, make_config

log = logging.getLogger("layer_offload")

GIB = 1 << 30
# Share of the device's total memory the whole pack may hold, per preset (the per-model split is the engine's).
PRESET_FRACTION: Dict[str, float] = {"auto": 0.85, "high_end": 0.9, "mid_range": 0.65, "consumer": 0.4,
                                     "budget": 0.2}


def device_total_bytes() -> int:
    """Total memory of the engine's device (the simulated device's capacity under --cpu)."""
    device = engine_device()
    if device is not None:
        try:
            from ..offload.backends import get_backend

            return int(get_backend(make_config("auto", device)).mem_get_info()[1])
        except Exception as e:  # noqa: BLE001 - fall back to ComfyUI's own figure
            log.debug("Layer Offload: engine device size unknown (%s); asking ComfyUI", e)
    import comfy.model_management as mm

    return int(mm.get_total_memory(mm.get_torch_device()))


def preset_total_bytes(preset: str) -> int:
    """The pack-wide budget a preset stands for on this machine."""
    if preset not in PRESETS:
        raise ValueError("unknown preset {!r}; valid presets: {}".format(preset, ", ".join(PRESET_CHOICES)))
    total = device_total_bytes()
    if preset == "auto":
        import comfy.model_management as mm

        reserve = int(mm.minimum_inference_memory()) if engine_device() != "sim" else 0
        return max(GIB // 4, int(total * PRESET_FRACTION["auto"]) - reserve)
    return max(GIB // 4, int(total * PRESET_FRACTION.get(preset, 0.5)))


class BudgetSpec:
    """What a VRAM Budget node asked for; applying it sets the process-wide budget (it persists until changed)."""

    def __init__(self, total_bytes: int, preset: Optional[str]) -> None:
        self.total_bytes = int(total_bytes)
        self.preset = preset

    def apply(self) -> VramBudget:
        """Make this the process-wide budget and return it."""
        budget = default_budget()
        current = budget.total_bytes
        if current is None or int(current) != self.total_bytes:
            budget.set_total(self.total_bytes)
            log.info("Layer Offload: VRAM budget set to %.2f GB", self.total_bytes / GIB)
        return budget

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BudgetSpec) and other.total_bytes == self.total_bytes

    def __hash__(self) -> int:
        return hash(self.total_bytes)

    def __repr__(self) -> str:
        return "BudgetSpec({:.2f} GB, preset={})".format(self.total_bytes / GIB, self.preset)


class OffloadVramBudget:
    """Set the process-wide VRAM budget (GB, or a preset when GB is 0); holds across prompts until changed."""

    @classmethod
    def INPUT_TYPES(cls) -> Dict[str, Any]:
        return {"required": {
            "budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.25,
                                    "tooltip": "Device memory (GB) all offloaded models together may hold. "
                                               "0 = use the preset below."}),
            "preset": (PRESET_CHOICES, {"default": "auto",
                                        "tooltip": "Used when budget_gb is 0: auto = free VRAM minus ComfyUI's "
                                                   "inference reserve; high_end 90%, mid_range 65%, consumer 40%, "
                                                   "budget 20% of the device's memory."}),
        }}

    RETURN_TYPES = (BUDGET_TYPE,)
    RETURN_NAMES = ("budget",)
    OUTPUT_TOOLTIPS = ("The process-wide budget; link it to Offload loaders to make the dependency explicit.",)
    FUNCTION = "set_budget"
    CATEGORY = CATEGORY
    DESCRIPTION = ("One VRAM budget for every offloaded model in this ComfyUI process, shared by priority. "
                   "It stays in force across prompts and workflows until another VRAM Budget node changes it.")

    def set_budget(self, budget_gb: float, preset: str) -> Tuple[BudgetSpec]:
        if budget_gb != budget_gb or budget_gb < 0:  # NaN or negative
            raise ValueError("budget_gb must be >= 0, got {!r}".format(budget_gb))
        if budget_gb > 0:
            total = device_total_bytes()
            if budget_gb * GIB > total:
                raise ValueError("budget_gb={} is larger than the device ({:.2f} GB); the limit is {:.2f} GB".format(
                    budget_gb, total / GIB, total / GIB))
            spec = BudgetSpec(int(budget_gb * GIB), None)
        else:
            spec = BudgetSpec(preset_total_bytes(preset), preset)
        spec.apply()
        return (spec,)
