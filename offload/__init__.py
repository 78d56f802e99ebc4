"""Layer Offload engine: stream any PyTorch model block by block from host memory to the device.

Everything a caller (the ComfyUI nodes included) may rely on is named in `__all__`; the modules behind it are
free to change.
"""
from .backends import device_memory, resolve_device
from .budget import BudgetError, VramBudget, default_budget
from .config import (DEFAULT_PRESET, PRESETS, OffloadConfig, PresetPolicy, budget_preset_tooltip, preset_tooltip,
                     presets_markdown_table)
from .handle import DetachedError, OffloadHandle, offload_module
from .metrics import BlockReport, OffloadReport, summarize
from .planner import PlanError
from .storage import CorruptFileError, SourceChangedError
from .streamer import DeviceMemoryError

__all__ = ["OffloadConfig", "PRESETS", "PresetPolicy", "DEFAULT_PRESET", "preset_tooltip", "budget_preset_tooltip",
           "presets_markdown_table", "offload_module", "OffloadHandle", "VramBudget", "default_budget",
           "OffloadReport", "BlockReport", "summarize", "device_memory", "resolve_device", "DeviceMemoryError",
           "PlanError", "BudgetError", "CorruptFileError", "SourceChangedError", "DetachedError"]
