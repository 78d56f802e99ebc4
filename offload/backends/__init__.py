"""Device adapters. `get_backend` picks one from a config; simulated devices with equal settings are shared."""
from __future__ import annotations

import threading

import torch

from ..config import OffloadConfig
from .base import Backend
from .sim import SimBackend

_lock = threading.Lock()
_backends: dict[tuple, Backend] = {}


def resolve_device(device: str) -> str:
    """'auto' becomes 'cuda' when a GPU is usable, else 'sim'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    return device


def get_backend(config: OffloadConfig) -> Backend:
    """The process-wide backend for a config's device (one per CUDA device / per simulated-device setting)."""
    device = resolve_device(config.device)
    if device == "sim":
        key: tuple = ("sim", config.sim_capacity_bytes, config.sim_bandwidth_gbps, float(config.sim_latency_us))
    else:
        index = torch.device(device).index
        if index is None and torch.cuda.is_available():
            index = torch.cuda.current_device()
        key = ("cuda", index)
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            if device == "sim":
                backend = SimBackend(config.sim_capacity_bytes, config.sim_bandwidth_gbps, config.sim_latency_us)
            else:
                from .cuda import CudaBackend
                backend = CudaBackend(device)
            _backends[key] = backend
        return backend


def device_memory(device: str = "auto") -> tuple[int, int]:
    """(free, total) bytes of an engine device ('sim': the default simulated device; 'auto': CUDA when usable)."""
    return get_backend(OffloadConfig(device=device)).mem_get_info()


__all__ = ["Backend", "SimBackend", "get_backend", "resolve_device", "device_memory"]
