"""VRAM Budget node: one process-wide device budget shared by every offloaded model."""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Tuple

from ..offload import (PRESETS, BudgetError, VramBudget, budget_preset_tooltip, default_budget,
                       device_memory)
from comfy_api.latest import io

from .common import BUDGET_TYPE, CATEGORY, PRESET_CHOICES, engine_device, io_type, preset_input

log = logging.getLogger("layer_offload")

GIB = 1 << 30
MIN_BUDGET_BYTES = 8 << 20  # catches a typo (0.000001 GB); the models loaded now set larger minimums


def device_total_bytes() -> int:
    """Total memory of the engine's device (the simulated device's capacity under --cpu)."""
    device = engine_device()
    if device is not None:
        return int(device_memory(device)[1])
    import comfy.model_management as mm

    return int(mm.get_total_memory(mm.get_torch_device()))


def preset_total_bytes(preset: str) -> int:
    """The pack-wide budget a preset stands for on this machine: its share of the device's total memory (auto
    also leaves ComfyUI's inference reserve free)."""
    if preset not in PRESETS:
        raise ValueError("unknown preset {!r}; valid presets: {}".format(preset, ", ".join(PRESET_CHOICES)))
    total = device_total_bytes()
    share = int(total * PRESETS[preset].budget_fraction)
    if preset == "auto" and engine_device() != "sim":
        import comfy.model_management as mm

        share -= int(mm.minimum_inference_memory())
    return max(MIN_BUDGET_BYTES, share)


def check_total(total_bytes: Any, origin: str) -> int:
    """A budget total someone asked for, as bytes: a number, not above the device, not below what the models
    loaded now need (or a floor no model runs under). BudgetError / ValueError name the limit and the origin."""
    if isinstance(total_bytes, bool) or not isinstance(total_bytes, (int, float)) or not math.isfinite(total_bytes):
        raise ValueError("the VRAM budget must be a number of bytes, got {!r} ({})".format(total_bytes, origin))
    total = int(total_bytes)
    device_total = device_total_bytes()
    if total > device_total:
        raise BudgetError("VRAM budget {:.2f} GB ({}) is larger than the device ({:.2f} GB); the limit is {:.2f} GB"
                          .format(total / GIB, origin, device_total / GIB, device_total / GIB))
    minimum = max(MIN_BUDGET_BYTES, default_budget().minimum_bytes())
    if total < minimum:
        raise BudgetError("VRAM budget {:.3f} GB ({}) is below the minimum of {:.3f} GB ({} bytes): the least an "
                          "offloaded model runs in (its weights outside the blocks plus one block){}"
                          .format(total / GIB, origin, minimum / GIB, minimum,
                                  "" if minimum == MIN_BUDGET_BYTES else " for the models loaded now"))
    return total


class BudgetSpec:
    """What a VRAM Budget node asked for; applying it sets the process-wide budget (it persists until changed)."""

    def __init__(self, total_bytes: int, preset: Optional[str], origin: str) -> None:
        self.total_bytes = int(total_bytes)
        self.preset = preset
        self.origin = origin

    def apply(self) -> VramBudget:
        """Make this the process-wide budget and return it."""
        budget = default_budget()
        if budget.total_bytes is None or int(budget.total_bytes) != self.total_bytes or budget.auto_sized:
            budget.set_total(self.total_bytes, origin=self.origin)
            log.info("Layer Offload: VRAM budget set to %.2f GB (%s)", self.total_bytes / GIB, self.origin)
        return budget

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BudgetSpec) and other.total_bytes == self.total_bytes

    def __hash__(self) -> int:
        return hash(self.total_bytes)

    def __repr__(self) -> str:
        return "BudgetSpec({:.2f} GB, {})".format(self.total_bytes / GIB, self.origin)


class OffloadVramBudget(io.ComfyNode):
    """Set the process-wide VRAM budget (GB, or a preset when GB is 0); holds across prompts until changed."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadVramBudget", display_name="VRAM Budget", category=CATEGORY,
            description=("One VRAM budget for every offloaded model in this ComfyUI process, shared by priority. "
                         "It stays in force across prompts and workflows until another VRAM Budget node (or the Layer "
                         "Offload panel) changes it."),
            inputs=[io.Float.Input("budget_gb", default=0.0, min=0.0, max=1024.0, step=0.25,
                                   tooltip="Device memory (GB) all offloaded models together may hold; at least "
                                           "{:.2f} GB. 0 = use the preset below.".format(MIN_BUDGET_BYTES / GIB)),
                    preset_input(tooltip=budget_preset_tooltip())],
            outputs=[io_type(BUDGET_TYPE).Output(display_name="budget", tooltip=(
                "The process-wide budget; link it to Offload loaders to make the dependency explicit."))])

    @classmethod
    def execute(cls, budget_gb: float, preset: str) -> io.NodeOutput:
        return io.NodeOutput(*cls.set_budget(budget_gb, preset))

    @classmethod
    def set_budget(cls, budget_gb: float, preset: str) -> Tuple[BudgetSpec]:
        """The node's work, as a tuple of its outputs."""
        if budget_gb != budget_gb or budget_gb < 0:  # NaN or negative
            raise ValueError("budget_gb must be >= 0, got {!r}".format(budget_gb))
        if budget_gb > 0:
            origin = "set by a VRAM Budget node (budget_gb={:g})".format(budget_gb)
            spec = BudgetSpec(check_total(budget_gb * GIB, origin), None, origin)
        else:
            origin = "set by a VRAM Budget node (preset {}: {:.0%} of the device)".format(
                preset, PRESETS[preset].budget_fraction if preset in PRESETS else 0)
            spec = BudgetSpec(preset_total_bytes(preset), preset, origin)
        spec.apply()
        return (spec,)
