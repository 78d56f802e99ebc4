"""Device adapters: the only CUDA calls (`cuda.py`), the simulated device (`sim.py`; on a clock of its own,
`sim_clock.py`), the interface both keep (`base.Backend`), the time host work is measured on (`clock.py`) and the
gate every pin asks first (`pin_gate`: a host's pin budget, e.g. ComfyUI's). `get_backend` picks one from a config;
simulated devices with equal settings (the same `sim_clock` included) are shared.

Layer: the lowest; imports only the config vocabulary (`offload/config.py`, which imports nothing).
Used from outside: `get_backend`, `resolve_device`, `device_memory`, `Backend`, `SimBackend`, `SimClock`,
`pin_gate.pin_host`, `pin_gate.set_pin_gate`.
"""
from __future__ import annotations

import threading

import torch

from ..config import OffloadConfig
from .base import Backend
from .sim import SimBackend
from .sim_clock import ClockedSimBackend, SimClock

_lock = threading.Lock()
_backends: dict[tuple, Backend] = {}


def resolve_device(device: str) -> str:
    """'auto' becomes 'cuda' when a GPU is usable, else 'sim'."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    return device


def get_backend(config: OffloadConfig, device: str | None = None) -> Backend:
    """The process-wide backend for a config's device, or for `device` (another of its `devices`): one per CUDA
    device, one per simulated device index and setting ('sim' is 'sim:0')."""
    device = resolve_device(device or config.device)
    if device.startswith("sim"):
        index = int(device.split(":")[1]) if ":" in device else 0
        key: tuple = ("sim", index, config.sim_capacity_bytes, config.sim_bandwidth_gbps,
                      float(config.sim_latency_us), config.sim_clock)
    else:
        index = torch.device(device).index
        if index is None and torch.cuda.is_available():
            index = torch.cuda.current_device()
        key = ("cuda", index)
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            if device.startswith("sim") and config.sim_clock is not None:
                backend = ClockedSimBackend(config.sim_clock, config.sim_capacity_bytes, config.sim_bandwidth_gbps,
                                            config.sim_latency_us, index=key[1])
            elif device.startswith("sim"):
                backend = SimBackend(config.sim_capacity_bytes, config.sim_bandwidth_gbps, config.sim_latency_us,
                                     index=key[1])
            else:
                from .cuda import CudaBackend
                backend = CudaBackend(device)
            _backends[key] = backend
        return backend


def device_memory(device: str = "auto") -> tuple[int, int]:
    """(free, total) bytes of an engine device ('sim': the default simulated device; 'auto': CUDA when usable)."""
    return get_backend(OffloadConfig(device=device)).mem_get_info()


__all__ = ["Backend", "SimBackend", "SimClock", "get_backend", "resolve_device", "device_memory"]
