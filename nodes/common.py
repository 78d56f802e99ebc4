"""Shared pieces of the ComfyUI nodes: category, types, the preset dropdown, the engine device, the budget."""
from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Dict, List, Optional

from ..offload import DEFAULT_PRESET, PRESETS, OffloadConfig, VramBudget, default_budget, preset_tooltip

HOST_COMPRESSION = ("auto", "lossless", "off")  # OffloadConfig.host_compression

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


HOST_COMPRESSION_CHOICES = ("preset",) + HOST_COMPRESSION
TIP_HOST_COMPRESSION = ("Blocks held losslessly compressed in host RAM and decoded on the GPU (outputs bit for bit "
                        "the same): preset = the preset's choice (auto); auto = only the blocks that would otherwise "
                        "stream from disk or not fit your RAM; lossless = every block where it pays (bf16 about 75% "
                        "of the RAM, fp16 about 90%); off = never.")


def host_compression_input() -> Any:
    """The optional `host_compression` override of the Offload nodes (default: the preset's)."""
    from comfy_api.latest import io

    return io.Combo.Input("host_compression", options=list(HOST_COMPRESSION_CHOICES), default="preset",
                          optional=True, tooltip=TIP_HOST_COMPRESSION)


def host_compression_override(choice: Optional[str]) -> Dict[str, Any]:
    """OffloadConfig overrides for the node's `host_compression` choice ("preset": none)."""
    if not choice or choice == "preset":
        return {}
    if choice not in HOST_COMPRESSION:
        raise ValueError(f"host_compression must be one of {', '.join(HOST_COMPRESSION_CHOICES)}, got {choice!r}")
    return {"host_compression": choice}


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


def make_config(preset: str, device: str, devices: Optional[List[str]] = None, **overrides: Any) -> OffloadConfig:
    """OffloadConfig for a node's preset on the given engine device (ValueError names the valid presets).

    `devices` (from `resolve_devices`): the compute device first, then the devices that hold resident blocks too;
    None: one device, as always."""
    if devices:
        return OffloadConfig.from_preset(preset, device=devices[0], devices=tuple(devices), **overrides)
    return OffloadConfig.from_preset(preset, device=device, **overrides)


SIM_DEVICES_ENV = "LAYER_OFFLOAD_SIM_DEVICES"  # under --cpu: how many simulated devices "auto" and lists may use
TIP_DEVICES = ("Devices whose memory holds this model's blocks. Empty: the compute device only (as always). 'auto': "
               "every visible GPU. Or a list such as 'cuda:0, cuda:1' (the compute device is always one of them and "
               "computes; blocks that fit on no card stream from RAM). A listed device this process does not have "
               "is left out with a notice (ComfyUI-Distributed workers run the same workflow). Each device has its "
               "own budget (VRAM Budget node: per_device).")


def full_device_name(name: str) -> str:
    """'cuda' -> 'cuda:<current>', 'sim' -> 'sim:0'; other names as they are."""
    if name == "sim":
        return "sim:0"
    if name == "cuda":
        import torch

        return "cuda:{}".format(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return name


def visible_devices(compute: Optional[str] = None) -> List[str]:
    """The devices a `devices` input may name: every CUDA device torch sees, or under --cpu the simulated devices
    sim:0 .. sim:N-1 (N from LAYER_OFFLOAD_SIM_DEVICES, default 1)."""
    compute = compute if compute is not None else engine_device()
    if compute is None:
        return []
    if compute.startswith("sim"):
        raw = os.environ.get(SIM_DEVICES_ENV, "").strip() or "1"
        try:
            count = int(raw)
        except ValueError:
            raise ValueError("{}={!r} must be a whole number of simulated devices".format(SIM_DEVICES_ENV, raw)) \
                from None
        return ["sim:{}".format(i) for i in range(max(1, count))]
    import torch

    return ["cuda:{}".format(i) for i in range(torch.cuda.device_count())]


def resolve_devices(text: Any, compute: Optional[str] = None, input_name: str = "devices") -> Optional[List[str]]:
    """A node's `devices` input as engine device names, the compute device first; None for one device (empty text,
    or 'auto' when only one device is visible). A well-formed device this process lacks is left out with one notice
    (`drop_absent_devices`); a malformed name, a device twice or a list without the compute device is a ValueError
    naming the input and the valid devices."""
    compute = compute if compute is not None else engine_device()
    if compute is None or text is None:
        return None
    if not isinstance(text, str):
        raise ValueError("{} must be text ('auto' or a list such as 'cuda:0, cuda:1'), got {!r}".format(
            input_name, text))
    raw = text.strip()
    if raw == "" or raw.lower() in ("compute only", "none", "one"):
        return None
    first = full_device_name(compute)
    visible = visible_devices(compute)
    if raw.lower() == "auto":
        names = [first] + [d for d in visible if d != first]
        return names if len(names) > 1 else None
    names = [full_device_name(n) for n in re.split(r"[\s,;]+", raw) if n]
    bad = [n for n in names if n not in visible and not DEVICE_NAME_RE.match(n)]
    if bad:
        hint = " (set {}=N for N simulated devices)".format(SIM_DEVICES_ENV) if first.startswith("sim") else ""
        raise ValueError("{}: {} {} not a device name; valid devices: {}, or 'auto' for all, or empty for the "
                         "compute device only{}".format(input_name, ", ".join(repr(n) for n in bad),
                                                        "is" if len(bad) == 1 else "are", ", ".join(visible), hint))
    if len(set(names)) != len(names):
        raise ValueError("{}: {!r} lists a device twice".format(input_name, text))
    names = drop_absent_devices(names, visible, input_name, text)
    if not names:
        return None
    if first not in names:
        raise ValueError("{}: {!r} must include the compute device ComfyUI runs on ({}); it computes, the others "
                         "hold blocks".format(input_name, text, first))
    names = [first] + [n for n in names if n != first]
    return names if len(names) > 1 else None


DEVICE_NAME_RE = re.compile(r"^(cuda|sim):\d+$")  # a well-formed name of a device some process may have


def drop_absent_devices(names: List[str], visible: List[str], input_name: str, text: str) -> List[str]:
    """The names this process has; the well-formed ones it lacks are left out with one notice per process (the same
    workflow goes to every ComfyUI-Distributed worker, each with its own devices)."""
    absent = [n for n in names if n not in visible]
    if absent:
        hint = " (set {}=N for N simulated devices)".format(SIM_DEVICES_ENV) if visible[:1] and \
            visible[0].startswith("sim") else ""
        log_once("absent-devices:{}:{}".format(input_name, text),
                 "Layer Offload: %s %r names %s, which this process does not have (it has %s); %s left out%s",
                 input_name, text, ", ".join(absent), ", ".join(visible) or "no device", "it is" if len(absent) == 1
                 else "they are", hint)
    return [n for n in names if n in visible]


def devices_input() -> Any:
    """The optional `devices` text of the Offload nodes (default: the compute device only, as before)."""
    from comfy_api.latest import io

    return io.String.Input("devices", default="", optional=True, tooltip=TIP_DEVICES)


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
