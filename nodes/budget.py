"""VRAM Budget node: one process-wide device budget shared by every offloaded model."""
from __future__ import annotations

import logging
import math
import re
from typing import Any, Dict, List, Optional, Tuple

from ..offload import (PRESETS, BudgetError, VramBudget, budget_preset_tooltip, default_budget,
                       device_memory)
from comfy_api.latest import io

from .common import (BUDGET_TYPE, CATEGORY, DEVICE_NAME_RE, PRESET_CHOICES, drop_absent_devices, engine_device,
                     full_device_name, io_type, preset_input, visible_devices)

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


_SHARE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*%$")


def parse_share(text: Any, input_name: str = "budget_share") -> Optional[float]:
    """`budget_share` text ('50%') as a fraction of the card (0.5); None when empty. ValueError names the input."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    m = _SHARE_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError("{} must be a share of the card such as '50%', got {!r} (for GB use budget_gb)".format(
            input_name, text))
    value = float(m.group(1))
    if not 0 < value <= 100:
        raise ValueError("{} must be above 0% and at most 100%, got {!r}".format(input_name, text))
    return value / 100


_SIZE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(gb|gib|g|mb|mib|m|%)?$", re.IGNORECASE)


def parse_per_device(text: Any, input_name: str = "per_device") -> Dict[str, int]:
    """`per_device` text ('cuda:1=10GB, cuda:2=50%') as {device: bytes}: the totals of the budgets of the devices
    other than the compute device that hold resident blocks (the compute device's total is budget_gb). A number is
    GB; MB and a percentage of that device's memory are allowed; 0 keeps every block off that device. ValueError /
    BudgetError name the entry, the valid devices and the limit. A well-formed device this process lacks (a
    ComfyUI-Distributed worker with fewer GPUs than the master) is left out with one notice."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}
    if not isinstance(text, str):
        raise ValueError("{} must be text such as 'cuda:1=10GB', got {!r}".format(input_name, text))
    compute = engine_device()
    first = full_device_name(compute) if compute is not None else None
    every = visible_devices(compute)
    visible = [d for d in every if d != first]
    out: Dict[str, int] = {}
    absent: List[str] = []
    for item in (p.strip() for p in re.split(r"[,;\n]+", text)):
        if not item:
            continue
        name, sep, size = (x.strip() for x in item.partition("="))
        if not sep or not name or not size:
            raise ValueError("{}: {!r} is not 'device=size' (e.g. 'cuda:1=10GB' or 'cuda:1=50%')".format(
                input_name, item))
        device = full_device_name(name)
        if device == first:
            raise ValueError("{}: {} is the compute device; its total is budget_gb (or the preset)".format(
                input_name, device))
        if device not in visible and not DEVICE_NAME_RE.match(device):
            raise ValueError("{}: {!r} is not a device name; valid devices other than the compute device ({}): "
                             "{}".format(input_name, name, first, ", ".join(visible) or "none (one device only)"))
        if device in out or device in absent:
            raise ValueError("{}: {} is given twice".format(input_name, device))
        m = _SIZE_RE.match(size)
        if m is None:
            raise ValueError("{}: the size {!r} of {} is not a number of GB (e.g. 10, 10GB, 512MB or 50%)".format(
                input_name, size, device))
        if device not in visible:  # a device of another process (ComfyUI-Distributed): left out below
            absent.append(device)
            continue
        value, unit = float(m.group(1)), (m.group(2) or "gb").lower()
        if not math.isfinite(value) or value > 1 << 40:  # 400 nines is not a size (int(inf) would overflow)
            raise ValueError("{}: the size {!r} of {} is not a number of GB a device has".format(
                input_name, size[:40], device))
        device_total = int(device_memory(device)[1])
        nbytes = int(value / 100 * device_total) if unit == "%" else int(value * (GIB if unit.startswith("g")
                                                                                   else 1 << 20))
        if nbytes > device_total:
            raise BudgetError("{}: {} = {:.2f} GB is larger than the device ({:.2f} GB); the limit is {:.2f} GB"
                              .format(input_name, device, nbytes / GIB, device_total / GIB, device_total / GIB))
        if 0 < nbytes < MIN_BUDGET_BYTES:
            raise BudgetError("{}: {} = {} bytes is below the minimum of {:.3f} GB (or 0: no blocks there)".format(
                input_name, device, nbytes, MIN_BUDGET_BYTES / GIB))
        out[device] = nbytes
    drop_absent_devices(absent, every, input_name, text)  # the one notice naming what was left out
    return out


class BudgetSpec:
    """What a VRAM Budget node asked for; applying it sets the process-wide budget (it persists until changed) and
    the budgets of the other devices it names (`per_device`)."""

    def __init__(self, total_bytes: int, preset: Optional[str], origin: str,
                 per_device: Optional[Dict[str, int]] = None) -> None:
        self.total_bytes = int(total_bytes)
        self.preset = preset
        self.origin = origin
        self.per_device = dict(per_device or {})

    def apply(self) -> VramBudget:
        """Make this the process-wide budget and return it."""
        budget = default_budget()
        if budget.total_bytes is None or int(budget.total_bytes) != self.total_bytes or budget.auto_sized:
            budget.set_total(self.total_bytes, origin=self.origin)
            log.info("Layer Offload: VRAM budget set to %.2f GB (%s)", self.total_bytes / GIB, self.origin)
        for device, nbytes in self.per_device.items():
            other = default_budget(device)
            if other.total_bytes is None or int(other.total_bytes) != nbytes or other.auto_sized:
                other.set_total(nbytes, origin="set by a VRAM Budget node (per_device {})".format(device))
                log.info("Layer Offload: VRAM budget of %s set to %.2f GB", device, nbytes / GIB)
        return budget

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BudgetSpec) and other.total_bytes == self.total_bytes
                and other.per_device == self.per_device)

    def __hash__(self) -> int:
        return hash((self.total_bytes, tuple(sorted(self.per_device.items()))))

    def __repr__(self) -> str:
        extra = "".join(", {} {:.2f} GB".format(d, n / GIB) for d, n in self.per_device.items())
        return "BudgetSpec({:.2f} GB{}, {})".format(self.total_bytes / GIB, extra, self.origin)


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
                    preset_input(tooltip=budget_preset_tooltip()),
                    io.String.Input("per_device", default="", optional=True, tooltip=(
                        "Budgets of the other devices that hold blocks of models whose Offload node lists them "
                        "(devices input), e.g. 'cuda:1=10GB, cuda:2=50%' (GB, MB or a share of that device; 0 keeps "
                        "blocks off it). Empty: each such device sizes its own from its free memory. The compute "
                        "device's total is budget_gb. A device this process lacks is left out with a notice.")),
                    io.String.Input("budget_share", default="", optional=True, tooltip=(
                        "The budget as a share of this process's card, e.g. '50%' (instead of budget_gb, which must "
                        "then be 0): the same workflow sent to ComfyUI-Distributed workers gives each half of its own "
                        "card, whatever its size. Empty: budget_gb, or the preset."))],
            outputs=[io_type(BUDGET_TYPE).Output(display_name="budget", tooltip=(
                "The process-wide budget; link it to Offload loaders to make the dependency explicit."))])

    @classmethod
    def execute(cls, budget_gb: float, preset: str, per_device: str = "", budget_share: str = "") -> io.NodeOutput:
        return io.NodeOutput(*cls.set_budget(budget_gb, preset, per_device, budget_share))

    @classmethod
    def set_budget(cls, budget_gb: float, preset: str, per_device: str = "",
                   budget_share: str = "") -> Tuple[BudgetSpec]:
        """The node's work, as a tuple of its outputs."""
        if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
            raise ValueError("budget_gb must be a number, got {!r}".format(budget_gb))
        try:
            budget_gb = float(budget_gb)  # an integer beyond float range: OverflowError
        except OverflowError:
            budget_gb = math.inf
        if budget_gb != budget_gb or budget_gb < 0:  # NaN or negative
            raise ValueError("budget_gb must be >= 0, got {!r}".format(budget_gb))
        share = parse_share(budget_share)
        if share is not None and budget_gb > 0:
            raise ValueError("budget_gb ({:g}) and budget_share ({!r}) are both set; set budget_gb to 0 to use the "
                             "share, or empty budget_share to use GB".format(budget_gb, budget_share))
        others = parse_per_device(per_device)
        if share is not None:
            total = device_total_bytes()
            origin = "set by a VRAM Budget node (budget_share {:g}% of {:.2f} GB)".format(share * 100, total / GIB)
            spec = BudgetSpec(check_total(int(total * share), origin), None, origin, others)
        elif budget_gb > 0:
            origin = "set by a VRAM Budget node (budget_gb={:g})".format(budget_gb)
            try:
                total = check_total(budget_gb * GIB, origin)
            except BudgetError as e:
                if "larger than the device" not in str(e):
                    raise
                raise BudgetError("{}; budget_share (e.g. '50%', budget_gb 0) gives every process a share of its own "
                                  "card (ComfyUI-Distributed workers of other sizes)".format(e)) from None
            spec = BudgetSpec(total, None, origin, others)
        else:
            origin = "set by a VRAM Budget node (preset {}: {:.0%} of the device)".format(
                preset, PRESETS[preset].budget_fraction if preset in PRESETS else 0)
            spec = BudgetSpec(preset_total_bytes(preset), preset, origin, others)
        spec.apply()
        return (spec,)
