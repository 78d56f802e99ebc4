"""Checks of `offload_module`'s arguments: a wrong type or value fails here, naming the argument and what it takes,
before anything is touched."""
from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from .backends import resolve_device
from .budget.vram_budget import VramBudget
from .config import OffloadConfig


def check_priority(priority: Any) -> int:
    """A priority is a whole number (higher keeps more blocks resident)."""
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority) \
            or int(priority) != priority:
        raise ValueError(f"priority must be a whole number (higher keeps more blocks resident), got {priority!r}")
    return int(priority)


def check_arguments(model: Any, config: OffloadConfig, name: Any, budget: Any, units: Any, progress: Any) -> None:
    """Wrong argument types fail here, naming the argument and what it takes, before anything is touched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (shown in logs and the report), got {type(name).__name__} {name!r}")
    if isinstance(budget, dict):
        devices = list(config.devices) if config.devices else [resolve_device(config.device)]
        for device, b in budget.items():
            if device not in devices:
                raise ValueError(f"budget names device {device!r}, which is not one of this model's devices "
                                 f"{devices} (OffloadConfig(devices=[...]))")
            if not isinstance(b, VramBudget):
                raise TypeError(f"budget[{device!r}] must be a VramBudget, got {type(b).__name__} {b!r}")
    elif budget is not None and not isinstance(budget, VramBudget):
        hint = (" (a size in bytes goes in VramBudget(nbytes), e.g. budget=VramBudget(4 << 30) for 4 GiB, or in "
                "OffloadConfig(vram_budget_bytes=...) for this model alone)")
        raise TypeError(f"budget must be a VramBudget, a dict {{device: VramBudget}} or None (the process-wide "
                        f"default_budget()), got {type(budget).__name__} {budget!r}{hint}")
    if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
        raise TypeError(f"units must be a list of module names (e.g. ['blocks.0', 'blocks.1']) or None, got {units!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable(done, total) or None, got {type(progress).__name__}")
