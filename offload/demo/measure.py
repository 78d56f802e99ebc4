"""Measuring helpers shared by the demo CLI and benchmarks/bench_offload.py: timing, sim calibration, the table.

Speed is measured, never asserted: figures are reported as ratios to a baseline timed in the same run.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from .. import backends
from ..config import OffloadConfig

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass
class Row:
    """One configuration's figures; `None` prints as "-" (not measured for that configuration)."""

    config: str
    ms_per_forward: float
    ratio: float | None = None  # ms_per_forward / resident ms_per_forward, same run
    peak_device_bytes: int | None = None
    overlap_ratio: float | None = None
    effective_gbps: float | None = None
    max_abs_diff: float | None = None
    equal: bool | None = None  # bitwise equal to the resident output
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, so tests and scripts need not parse the table."""
        return dataclasses.asdict(self)


def resolve_device(device: str) -> str:
    """Map "auto" to "cuda" when a GPU is usable, else "sim"; a GPU asked for but missing is a ValueError."""
    cfg = OffloadConfig(device=device)  # validates the name (ValueError lists the valid ones)
    resolved = backends.resolve_device(cfg.device)
    if resolved != "sim":
        backends.get_backend(cfg.replace(device=resolved))  # ValueError when this torch has no such GPU
    return resolved


def torch_device(device: str) -> torch.device:
    """The torch device that holds "device" tensors: the GPU, or the CPU for the simulated device."""
    return torch.device("cpu") if device == "sim" else torch.device(device)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers: what a fully resident copy keeps on the device."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def synchronize(device: str) -> None:
    """Wait for queued device work so a timer measures finished forwards."""
    if device != "sim":
        backends.get_backend(OffloadConfig(device=device)).synchronize()


def time_forwards(fn: Callable[[], Any], iters: int, device: str, warmup: int = 1,
                  after_warmup: Callable[[], None] | None = None) -> tuple[float, Any]:
    """Ms per forward after `warmup` untimed calls, and the last output.

    On CUDA: the mean over `iters` forwards, synchronized once at the end (so the next forward's prefetch may
    overlap the previous one, as in a sampling loop). On the simulated device compute is synchronous, so each
    forward is timed on its own and the fastest is returned: other processes on a shared CPU only ever add
    time, so the minimum is the least disturbed figure.
    """
    out = None
    iters = max(iters, 1)
    with torch.inference_mode():
        for _ in range(warmup):
            out = fn()
        synchronize(device)
        if after_warmup is not None:
            after_warmup()
        if device.startswith("cuda"):
            start = time.perf_counter()
            for _ in range(iters):
                out = fn()
            synchronize(device)
            return (time.perf_counter() - start) * 1000.0 / iters, out
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
    return min(times) * 1000.0, out


def calibrate_sim_gbps_model(model: nn.Module, inputs: Sequence[torch.Tensor], blocks: Sequence[nn.Module],
                             copy_to_compute: float = 0.5, forwards: int = 5) -> tuple[float, float]:
    """Bandwidth (GB/s) at which copying all `blocks` takes `copy_to_compute` times their compute in a forward.

    Times every block inside real forwards of the whole model (its own activations, not made-up inputs) and
    keeps each block's fastest time over `forwards` runs, so bursts of other work on a shared CPU drop out.
    Returns (gbps, mean block compute ms).
    """
    best = [math.inf] * len(blocks)
    starts: dict[int, float] = {}
    handles = []
    for i, block in enumerate(blocks):
        def pre(_m: nn.Module, _a: Any, i: int = i) -> None:
            starts[i] = time.perf_counter()

        def post(_m: nn.Module, _a: Any, _o: Any, i: int = i) -> None:
            best[i] = min(best[i], time.perf_counter() - starts[i])
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        with torch.inference_mode():
            for _ in range(forwards):
                model(*inputs)
    finally:
        for h in handles:
            h.remove()
    compute_s = sum(best)
    nbytes = sum(weight_bytes(b) for b in blocks)
    return nbytes / (copy_to_compute * compute_s) / 1e9, compute_s * 1000.0 / len(blocks)


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two outputs (0.0 when bitwise equal)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes: the promise offloading makes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().cpu(), b.detach().cpu())


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "mib":
        return f"{value / MIB:.1f}"
    if kind == "frac":
        return f"{value:.2f}"
    if kind == "gbps":
        return f"{value:.2f}"
    if kind == "diff":
        return f"{value:.3g}"
    if kind == "bool":
        return "yes" if value else "NO"
    return str(value)


TABLE_COLUMNS = (
    ("config", "config", "str"),
    ("ms/forward", "ms_per_forward", "ms"),
    ("vs resident", "ratio", "ratio"),
    ("peak device MiB", "peak_device_bytes", "mib"),
    ("overlap", "overlap_ratio", "frac"),
    ("GB/s", "effective_gbps", "gbps"),
    ("max abs diff", "max_abs_diff", "diff"),
    ("bitwise equal", "equal", "bool"),
    ("note", "note", "str"),
)


def format_table(rows: Iterable[Row]) -> str:
    """A markdown table of the rows (readable in a terminal and pasteable into docs/benchmarks.md)."""
    rows = list(rows)
    header = [c[0] for c in TABLE_COLUMNS]
    body = [[_fmt(getattr(r, attr), kind) for _, attr, kind in TABLE_COLUMNS] for r in rows]
    if not any(r.note for r in rows):
        header, body = header[:-1], [b[:-1] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def tier_summary(rep: Any) -> str:
    """'2 pinned, 6 vram': a report's blocks per tier, for the table's note column."""
    return ", ".join(f"{n} {tier}" for tier, n in sorted(rep.tiers.items()) if n)


def run_offloaded(model: nn.Module, inputs: Sequence[torch.Tensor], cfg: Any, reference: torch.Tensor,
                  iters: int, warmup: int, name: str, budget_bytes: int | None = None) -> tuple[Row, dict]:
    """Offload `model` with `cfg` under its own budget, time it, compare with `reference`, then detach."""
    from .. import VramBudget, offload_module

    budget = VramBudget(int(budget_bytes)) if budget_bytes is not None else None
    handle = offload_module(model, cfg, name=name, budget=budget)
    try:
        ms, out = time_forwards(lambda: model(*inputs), iters, cfg.device, warmup,
                                after_warmup=handle.reset_stats)
        rep = handle.report()
    finally:
        handle.detach()
    row = Row(config=name, ms_per_forward=ms, peak_device_bytes=rep.peak_device_bytes, overlap_ratio=rep.overlap_ratio,
              effective_gbps=rep.effective_gbps, max_abs_diff=max_abs_diff(out, reference),
              equal=bitwise_equal(out, reference), note=tier_summary(rep))
    return row, rep.to_dict()
