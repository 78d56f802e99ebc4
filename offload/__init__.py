"""Layer Offload engine: stream any PyTorch model block by block from host memory to the device."""
from .budget import VramBudget, default_budget
from .config import PRESETS, OffloadConfig, PresetPolicy
from .handle import OffloadHandle, offload_module
from .metrics import BlockReport, OffloadReport
from .planner import PlanError
from .streamer import DeviceMemoryError

__all__ = ["OffloadConfig", "PRESETS", "PresetPolicy", "offload_module", "OffloadHandle", "VramBudget",
           "default_budget", "OffloadReport", "BlockReport", "DeviceMemoryError", "PlanError"]
