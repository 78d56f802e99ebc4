"""Layer Offload engine: stream any PyTorch model block by block from host memory to the device.

Everything a caller (the ComfyUI nodes included) may rely on is named in `__all__`; the modules behind it are
free to change.

PyTorch is not a dependency of the package (pip must never replace the torch build a user has for their GPU), so
importing it without torch says which torch to install.
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:
    raise ImportError(
        "Layer Offload needs PyTorch, which this Python cannot import"
        f" ({_exc}). Install the build for your machine first: pip install torch (CPU only: "
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; for CUDA or ROCm pick the "
        "command at https://pytorch.org/get-started/locally/). Inside ComfyUI the pack uses ComfyUI's own torch: "
        "run ComfyUI's Python, not another environment's.") from _exc
del _torch
from .backends import device_memory, resolve_device
from .budget.vram_budget import BudgetError, VramBudget, default_budget
from .config import (DEFAULT_PRESET, PRESETS, OffloadConfig, PresetPolicy, budget_preset_tooltip, preset_tooltip,
                     presets_markdown_table)
from .handle import DetachedError, OffloadHandle, offload_module
from .plan.planner import PlanError, RamCeilingError
from .plan.planner import DeviceMemoryError
from .predict.cards import Card
from .predict.prediction import Prediction, predict
from .report.metrics import BlockReport, OffloadReport, summarize
from .store.storage import CorruptFileError, SourceChangedError
from .stream.backward import TrainableWeightError

__all__ = ["OffloadConfig", "PRESETS", "PresetPolicy", "DEFAULT_PRESET", "preset_tooltip", "budget_preset_tooltip",
           "presets_markdown_table", "offload_module", "OffloadHandle", "VramBudget", "default_budget",
           "OffloadReport", "BlockReport", "summarize", "device_memory", "resolve_device", "DeviceMemoryError",
           "PlanError", "RamCeilingError", "BudgetError", "CorruptFileError", "SourceChangedError",
           "DetachedError", "TrainableWeightError", "predict", "Prediction", "Card"]
