"""Timing a model on its own device for `offload.predict(card="measure")`.

Each unit's compute is bracketed by the backend's events over whole forwards after warm-up runs (a model on the host
while the device is a GPU is timed through the engine with every block streamed); the copy speed is the backend's.
On the simulated device, whose compute and copy thread share the host's CPUs, the units are timed again while
copies run beside them (`_CopyProbe`) and the engine's own CPU cost per forward is measured (`engine_cpu_ms`).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..backends import get_backend
from ..budget.vram_budget import VramBudget
from ..config import OffloadConfig
from ..model.blocks import Unit
from ..model.layout import unit_tensors
from ..plan.planner import MIB
from .cost_profile import Profile

MAX_HOOK_UNITS = 256  # above this many units the engine's CPU cost is measured on this many and scaled
_hook_ms_cache: dict[int, dict[str, float]] = {}


def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t, tree)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measure_on_device(model: nn.Module, units: Sequence[Unit], args: tuple, kwargs: dict[str, Any],
                      config: OffloadConfig, warmup: int, runs: int, max_unit_bytes: int) -> Profile:
    """Per-unit compute timed on the config's device; copy speed from its backend (`max_unit_bytes`: the largest
    unit's bytes as it moves, the size of the copies timed beside the compute on the simulated device)."""
    if any(t.is_meta for _, _, _, t in unit_tensors(model)):
        raise ValueError("card='measure' times the model on its device, but its weights are on the meta device; "
                         "name a card instead (offload.predict.cards.CARDS, e.g. card='rtx4090') or pass an offload.Card")
    backend = get_backend(config)
    device = backend.device
    on_device = all(t.device == device for _, _, _, t in unit_tensors(model))
    args, kwargs = _to_device(args, device), _to_device(kwargs, device)
    sim = backend.name == "sim"
    pinned = backend.h2d_gbps(True) or 1.0
    pageable = backend.h2d_gbps(False) or pinned
    latency_ms = float(getattr(backend, "latency_us", 0.0)) / 1e3
    probe = None
    if sim and getattr(backend, "bandwidth_gbps", None):
        probe = _CopyProbe(backend, min(max_unit_bytes, 64 * MIB), pinned, latency_ms)
    busy_compute = busy_rest = None
    if on_device:
        compute, rest, activation, busy_compute, busy_rest = _time_blocks(model, units, args, kwargs, backend, warmup,
                                                                          runs, probe)
    else:
        compute, rest, activation = _time_streamed(model, args, kwargs, config, warmup, runs)
    nominal = pinned
    if probe is not None and probe.factor() > 1.0:  # copies run slower beside the compute than nominal
        pinned, pageable = pinned / probe.factor(), pageable / probe.factor()
    free, total = backend.mem_get_info()
    card = {"name": backend.describe(), "vram_bytes": int(total), "h2d_gbps": pinned, "pageable_gbps": pageable,
            "nominal_h2d_gbps": nominal, "tflops": None, "measured": True}
    profile = Profile(compute, rest, pinned, pageable, latency_ms,
                    int(total), int(free) + (sum(_device_bytes(model, device)) if not sim and on_device else 0),
                    activation, card,
                    hook_ms=(engine_cpu_ms(len(units)) if sim and not backend.clock.virtual
                             else {"resident": 0.0, "streamed": 0.0}),  # on its own clock the hooks take no time
                    supports_pinned=backend.supports_pinned_host, backend_name=backend.name)
    profile.busy_compute_ms, profile.busy_rest_ms = busy_compute, busy_rest
    return profile


class _TinyUnits(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def engine_cpu_ms(n_units: int, batches: int = 5, forwards: int = 8) -> dict[str, float]:
    """The engine's CPU time per forward of a model of `n_units` units, every unit resident and every unit streamed
    (its hooks, the slot hand-off and a throttled copy's hand-off to the copy thread, the per-pass bookkeeping): on
    the simulated device compute runs on the CPU, so this adds to every step. Measured once per process and unit
    count on a model of as many tiny units (a tenth of a second or so), as benchmarks/bench_hooks.py does: the
    fastest batch, over the plain model's."""
    n = max(1, min(int(n_units), MAX_HOOK_UNITS))
    scale = max(1, int(n_units)) / n
    if n in _hook_ms_cache:
        return {k: v * scale for k, v in _hook_ms_cache[n].items()}
    from ..handle import offload_module

    torch.manual_seed(0)
    model = _TinyUnits(max(2, n)).eval()
    x = torch.randn(1, 16)

    def per_forward() -> float:
        best = math.inf
        with torch.inference_mode():
            model(x)
            for _ in range(batches):
                start = time.perf_counter()
                for _ in range(forwards):
                    model(x)
                best = min(best, (time.perf_counter() - start) / forwards)
        return best * 1e3

    plain = per_forward()
    out = {}
    for label, preset in (("resident", "high_end"), ("streamed", "budget")):
        cfg = OffloadConfig.from_preset(preset, device="sim", sim_bandwidth_gbps=1000.0,
                                        sim_capacity_bytes=64 * MIB + 1)
        handle = offload_module(model, cfg, name="predict-cpu-cost", budget=VramBudget(None))
        try:
            out[label] = max(0.0, per_forward() - plain)
        finally:
            handle.detach()
    _hook_ms_cache[n] = out
    return {k: v * scale for k, v in out.items()}


def _device_bytes(model: nn.Module, device: torch.device) -> Iterator[int]:
    """Bytes of the model's weights on `device` (counted back as free: the engine's plan replaces them)."""
    seen: set[int] = set()
    for _, _, _, t in unit_tensors(model):
        if t.device == device and id(t) not in seen:
            seen.add(id(t))
            yield t.numel() * t.element_size()


class _CopyProbe:
    """Copies of one block's size queued on the backend's copy engine while the timed forwards compute: how much
    slower than nominal a copy runs beside the compute (the simulated device's copy thread shares the host's CPUs
    with it, as the engine's copies will)."""

    def __init__(self, backend: Any, nbytes: int, gbps: float, latency_ms: float) -> None:
        self.backend, self.nbytes = backend, max(int(nbytes), 4096)
        self.nominal_ms = latency_ms + self.nbytes / (gbps * 1e6)
        self.spans: list[float] = []
        self._events: list[Any] = []
        try:
            with torch.inference_mode(False):
                self.dst = backend.alloc(self.nbytes)
            self.src = torch.empty(self.nbytes, dtype=torch.uint8)
        except torch.OutOfMemoryError:
            self.dst = None

    def start(self, expected_ms: float) -> None:
        """Queue enough copies to cover a forward of about `expected_ms`."""
        if self.dst is None:
            return
        count = min(64, max(2, int(expected_ms / self.nominal_ms) + 2))
        self._events = [self.backend.copy_h2d(self.dst, self.src) for _ in range(count)]

    def finish(self, fwd_start: Any, fwd_ms: float) -> None:
        """Keep the spans of the copies that ran entirely inside the forward."""
        b = self.backend
        for event in self._events:
            b.event_synchronize(event)
            end = b.elapsed_ms(fwd_start, event)
            span = b.copy_span_ms(event)
            if end - span >= 0 and end <= fwd_ms:
                self.spans.append(span)
        self._events = []

    def factor(self) -> float:
        """Median copy time over nominal (1.0 when nothing was seen)."""
        if self.dst is not None:
            self.backend.release(self.dst)
            self.dst = None
        return _median(self.spans) / self.nominal_ms if len(self.spans) >= 3 else 1.0


def _time_blocks(model: nn.Module, units: Sequence[Unit], args: tuple, kwargs: dict[str, Any], backend: Any,
                 warmup: int, runs: int, probe: _CopyProbe | None = None
                 ) -> tuple[list[float], float, int, list[float] | None, float | None]:
    """(median compute ms per unit, median ms outside the units, activation peak bytes; and with `probe` the same
    two medians again over as many forwards timed while copies run beside them, as the engine's would) of a model
    resident on the backend's device: each unit bracketed by the backend's events in whole forwards."""
    n = len(units)
    marks: list[list[Any]] = [[] for _ in range(n)]
    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.module.register_forward_pre_hook(lambda *_a, i=i: marks[i].append(backend.record())))
        handles.append(unit.module.register_forward_hook(lambda *_a, i=i: marks[i].append(backend.record())))
    per_unit: dict[bool, list[list[float]]] = {False: [[] for _ in range(n)], True: [[] for _ in range(n)]}
    forwards: dict[bool, list[float]] = {False: [], True: []}
    activation = 0
    timed = max(1, runs)
    total = max(0, warmup) + timed * (2 if probe is not None else 1)
    try:
        with torch.inference_mode():
            for r in range(total):
                for m in marks:
                    m.clear()
                if r == warmup:
                    backend.reset_peak_allocated()
                busy = probe is not None and r >= warmup + timed  # clean runs first, then runs beside copies
                if busy:
                    probe.start(forwards[False][-1] if forwards[False] else 0.0)
                start = backend.record()
                model(*args, **kwargs)
                end = backend.record()
                if busy:
                    probe.finish(start, backend.elapsed_ms(start, end))
                backend.synchronize()
                if r < warmup:
                    continue
                forwards[busy].append(backend.elapsed_ms(start, end))
                for i, m in enumerate(marks):
                    per_unit[busy][i].append(sum(max(0.0, backend.elapsed_ms(a, b)) for a, b in zip(m[::2], m[1::2])))
        peak = backend.peak_allocated()
        if peak is not None:
            activation = max(0, int(peak) - sum(_device_bytes(model, backend.device)))
    finally:
        for h in handles:
            h.remove()
    compute = [_median(p) for p in per_unit[False]]
    rest = max(0.0, _median(forwards[False]) - sum(compute))
    if probe is None:
        return compute, rest, activation, None, None
    busy_compute = [_median(p) for p in per_unit[True]]
    busy_rest = max(0.0, _median(forwards[True]) - sum(busy_compute))
    return compute, rest, activation, busy_compute, busy_rest


def _time_streamed(model: nn.Module, args: tuple, kwargs: dict[str, Any], config: OffloadConfig, warmup: int,
                   runs: int) -> tuple[list[float], float, int]:
    """A model in host memory while the device is a GPU: time it through the engine with every block streamed (the
    engine's own per-block compute events), then detach (the weights stay ordinary host tensors)."""
    from ..handle import offload_module

    handle = offload_module(model, config.replace(vram_fraction=0.0, preset=None), name="predict",
                            budget=VramBudget(None))
    try:
        forwards = []
        with torch.inference_mode():
            for r in range(max(0, warmup) + max(1, runs)):
                if r == warmup:
                    handle.reset_stats()
                start = time.perf_counter()
                model(*args, **kwargs)
                handle.backend.synchronize()
                if r >= warmup:
                    forwards.append((time.perf_counter() - start) * 1e3)
        rep = handle.report()
    finally:
        handle.detach()
    compute = [b.compute_ms / b.calls if b.calls else 0.0 for b in rep.blocks]
    fwd = max(1, rep.forwards)
    rest = max(0.0, _median(forwards) - sum(compute) - rep.stall_ms / fwd)
    return compute, rest, 0
