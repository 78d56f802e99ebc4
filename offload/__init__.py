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


def _install_moved_modules() -> None:
    """Modules that lived flat in offload/ before the sub-packages (offload.streamer, offload.kv_cache, ...) still
    import under their old names, as the very module at the new place: code and pickles written for the old layout
    keep working. One finder on sys.meta_path answers only for these names."""
    import importlib
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    moved = {"backends": ["pin_gate"],
             "model": ["blocks", "layout", "meta_buffers", "fp8", "model_changes"],
             "store": ["staging"],
             "plan": ["planner", "plan_device", "plan_host", "ring_sim", "cost_model", "replan"],
             "budget": ["recency", "membership", "reserve"],
             "stream": ["streamer", "prefetch", "placement", "host_tiers", "write_watch", "buffer_writes", "outputs",
                        "pass_lock", "backward", "compile_support", "devices"],
             "report": ["metrics"],
             "predict": ["cost_profile", "meta_costs", "device_timing", "cards", "plan_cli"],
             "generate": ["kv_cache"]}
    # modules split in two when they moved: the old name offers the names of both
    split = {"storage": ("store.storage", "store.sources"), "packed": ("store.packed", "store.pack_writer")}
    old_to_new: dict = {f"{__name__}.{m}": (f"{__name__}.{pkg}.{m}",) for pkg, mods in moved.items() for m in mods}
    old_to_new.update({f"{__name__}.{m}": tuple(f"{__name__}.{t}" for t in ts) for m, ts in split.items()})
    own_specs: dict = {}

    class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
            if fullname not in old_to_new:
                return None
            return importlib.machinery.ModuleSpec(fullname, self)

        def create_module(self, spec):  # type: ignore[no-untyped-def]
            parts = [importlib.import_module(name) for name in old_to_new[spec.name]]
            if len(parts) == 1:
                own_specs[parts[0].__name__] = parts[0].__spec__
                return parts[0]
            module = types.ModuleType(spec.name, f"The names of {', '.join(p.__name__ for p in parts)}.")

            def __getattr__(name: str) -> object:
                for part in parts:
                    if hasattr(part, name):
                        return getattr(part, name)
                raise AttributeError(f"module {spec.name!r} has no attribute {name!r}")

            module.__getattr__ = __getattr__  # type: ignore[attr-defined]
            return module

        def exec_module(self, module):  # type: ignore[no-untyped-def]
            if module.__name__ in own_specs:  # the import system stamped the old name's spec on it
                module.__spec__ = own_specs[module.__name__]

    if not any(type(f).__name__ == "MovedModules" and getattr(f, "names", None) == old_to_new
               for f in sys.meta_path):
        finder = MovedModules()
        finder.names = old_to_new  # type: ignore[attr-defined]
        sys.meta_path.append(finder)


_install_moved_modules()
