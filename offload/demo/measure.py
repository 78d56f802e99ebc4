"""Measuring helpers shared by the demo CLI and benchmarks/bench_offload.py: timing, sim calibration, the table.

Speed is measured, never asserted: figures are reported as ratios to a baseline timed in the same run.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
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
    # over several rounds (the demo's --rounds): ms_per_forward and ratio are medians, these their spread
    ms_min: float | None = None
    ms_max: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    rounds: int | None = None

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


def time_paired(baseline: Callable[[], Any], fn: Callable[[], Any], iters: int, device: str, warmup: int = 1,
                after_warmup: Callable[[], None] | None = None) -> tuple[float, float, Any]:
    """(baseline ms, fn ms, fn's last output), the two timed in alternation: forward for forward, so a slow spell
    of a shared machine lands on both and their ratio holds. Per side, like `time_forwards`: the fastest forward
    on the simulated device, the mean on CUDA."""
    out = None
    iters = max(iters, 1)
    times: tuple[list[float], list[float]] = ([], [])
    with torch.inference_mode():
        for _ in range(warmup):
            baseline()
            out = fn()
        synchronize(device)
        if after_warmup is not None:
            after_warmup()
        for _ in range(iters):
            for side, call in enumerate((baseline, fn)):
                start = time.perf_counter()
                result = call()
                synchronize(device)
                times[side].append(time.perf_counter() - start)
                if side:
                    out = result
    pick = (lambda t: sum(t) / len(t)) if device.startswith("cuda") else min
    return pick(times[0]) * 1000.0, pick(times[1]) * 1000.0, out


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


def median_row(rows: Sequence[Row]) -> Row:
    """One configuration's rounds as one row: medians of time, ratio, overlap and GB/s with the time and ratio
    spread (min-max), the largest peak and difference, and bitwise equal only if every round was."""
    def med(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(values) if values else None

    ms = [r.ms_per_forward for r in rows]
    ratios = [r.ratio for r in rows if r.ratio is not None]
    peaks = [r.peak_device_bytes for r in rows if r.peak_device_bytes is not None]
    diffs = [r.max_abs_diff for r in rows if r.max_abs_diff is not None]
    notes = list(dict.fromkeys(r.note for r in rows if r.note))
    return Row(config=rows[0].config, ms_per_forward=med(ms) or float("nan"), ratio=med(ratios),
               peak_device_bytes=max(peaks) if peaks else None, overlap_ratio=med([r.overlap_ratio for r in rows]),
               effective_gbps=med([r.effective_gbps for r in rows]), max_abs_diff=max(diffs) if diffs else None,
               equal=None if any(r.equal is None for r in rows) else all(r.equal for r in rows),
               note=" / ".join(notes), ms_min=min(ms), ms_max=max(ms),
               ratio_min=min(ratios) if ratios else None, ratio_max=max(ratios) if ratios else None,
               rounds=len(rows))


def _fmt(value: Any, kind: str) -> str:
    if kind in ("msrange", "ratiorange"):
        low, high = value
        if low is None or high is None:
            return "-"
        return f"{low:.1f}-{high:.1f}" if kind == "msrange" else f"{low:.2f}-{high:.2f}x"
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
    ("ms min-max", ("ms_min", "ms_max"), "msrange"),
    ("vs resident", "ratio", "ratio"),
    ("ratio min-max", ("ratio_min", "ratio_max"), "ratiorange"),
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

    def get(r: Row, attr: Any) -> Any:
        return tuple(getattr(r, a) for a in attr) if isinstance(attr, tuple) else getattr(r, attr)

    header = [c[0] for c in TABLE_COLUMNS]
    body = [[_fmt(get(r, attr), kind) for _, attr, kind in TABLE_COLUMNS] for r in rows]
    # optional columns (the spread of several rounds, the note) are left out when no row has them
    optional = {i for i, (_, attr, kind) in enumerate(TABLE_COLUMNS) if kind.endswith("range") or attr == "note"}
    keep = [i for i in range(len(header)) if i not in optional or any(b[i] not in ("-", "") for b in body)]
    header, body = [header[i] for i in keep], [[b[i] for i in keep] for b in body]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def tier_summary(rep: Any) -> str:
    """'2 pinned, 6 vram': a report's blocks per tier, for the table's note column."""
    return ", ".join(f"{n} {tier}" for tier, n in sorted(rep.tiers.items()) if n)


def run_offloaded(model: nn.Module, inputs: Sequence[torch.Tensor], cfg: Any, reference: torch.Tensor,
                  iters: int, warmup: int, name: str, budget_bytes: int | None = None,
                  baseline: Callable[[], Any] | None = None) -> tuple[Row, dict]:
    """Offload `model` with `cfg` under its own budget, time it, compare with `reference`, then detach.

    With `baseline` (a resident copy's forward), the two are timed in alternation (`time_paired`): the row's ratio
    is against that baseline, whose ms per forward the report dict holds as `baseline_ms_per_forward`."""
    from ..budget.vram_budget import VramBudget
    from ..handle import offload_module

    budget = VramBudget(int(budget_bytes)) if budget_bytes is not None else None
    handle = offload_module(model, cfg, name=name, budget=budget)
    base_ms = None
    try:
        if baseline is None:
            ms, out = time_forwards(lambda: model(*inputs), iters, cfg.device, warmup,
                                    after_warmup=handle.reset_stats)
        else:
            base_ms, ms, out = time_paired(baseline, lambda: model(*inputs), iters, cfg.device, warmup,
                                           after_warmup=handle.reset_stats)
        rep = handle.report()
    finally:
        handle.detach()
    row = Row(config=name, ms_per_forward=ms, peak_device_bytes=rep.peak_device_bytes, overlap_ratio=rep.overlap_ratio,
              effective_gbps=rep.effective_gbps, max_abs_diff=max_abs_diff(out, reference),
              equal=bitwise_equal(out, reference), note=tier_summary(rep))
    report = rep.to_dict()
    if base_ms is not None:
        row.ratio = ms / base_ms if base_ms > 0 else None
        report["baseline_ms_per_forward"] = base_ms
    return row, report
