"""`python -m offload demo`: run one model resident and offloaded, check the outputs are bitwise equal, time both.

It exists so a new user sees, in under a minute and without a GPU, that offloading moves bytes and never
changes them, and what it costs. On CUDA it uses the GPU; otherwise the simulated device, with a copy
bandwidth calibrated so that copying the blocks takes about half of their compute (overlap visible).
The helpers here (timing, sim calibration, table) are shared with benchmarks/bench_offload.py.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from . import backends
from .config import OffloadConfig

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


def _report_figures(handle: Any) -> tuple[int | None, float | None, float | None, str]:
    """Peak device bytes, overlap, GB/s and a tier summary from an offload handle's report."""
    rep = handle.report()
    tiers: dict[str, int] = {}
    for unit in rep.blocks:
        tiers[unit.tier] = tiers.get(unit.tier, 0) + 1
    summary = ", ".join(f"{n} {tier}" for tier, n in sorted(tiers.items()))
    return rep.peak_device_bytes, rep.overlap_ratio, rep.effective_gbps, summary


def run_offloaded(model: nn.Module, inputs: Sequence[torch.Tensor], cfg: Any, reference: torch.Tensor,
                  iters: int, warmup: int, name: str, budget_bytes: int | None = None) -> tuple[Row, dict]:
    """Offload `model` with `cfg` under its own budget, time it, compare with `reference`, then detach."""
    from . import VramBudget, offload_module

    budget = VramBudget(int(budget_bytes)) if budget_bytes is not None else None
    handle = offload_module(model, cfg, name=name, budget=budget)
    try:
        ms, out = time_forwards(lambda: model(*inputs), iters, cfg.device, warmup,
                                after_warmup=handle.reset_stats)
        handle.backend.synchronize()
        peak, overlap, gbps, tiers = _report_figures(handle)
        report = handle.report().to_dict()
    finally:
        handle.detach()
    row = Row(config=name, ms_per_forward=ms, peak_device_bytes=peak, overlap_ratio=overlap,
              effective_gbps=gbps, max_abs_diff=max_abs_diff(out, reference),
              equal=bitwise_equal(out, reference), note=tiers)
    return row, report


def build_demo_model(model: str, dim: int, depth: int, tokens: int, seed: int) -> tuple[nn.Module, list[torch.Tensor], nn.Module, list[torch.Tensor]]:
    """The demo model (float32, random weights), its CPU inputs, and one block with that block's inputs."""
    from .reference_models import DiTStack, TransformerStack

    torch.manual_seed(seed)
    heads = max(1, dim // 64)
    gen = torch.Generator().manual_seed(seed + 1)
    if model == "transformer":
        net = TransformerStack(dim=dim, depth=depth, heads=heads).eval()
        x = torch.randn(1, tokens, dim, generator=gen)
        return net, [x], net.blocks[0], [torch.randn(1, tokens, dim, generator=gen)]
    if model == "flux":
        double, single = max(1, depth // 3), max(1, depth - depth // 3)
        net = DiTStack(dim=dim, double=double, single=single, heads=heads, in_channels=64, txt_dim=128).eval()
        txt_tokens = max(1, tokens // 8)
        img = torch.randn(1, tokens, 64, generator=gen)
        txt = torch.randn(1, txt_tokens, 128, generator=gen)
        t = torch.randn(1, dim, generator=gen)
        block = net.single_blocks[0]
        return net, [img, txt, t], block, [torch.randn(1, tokens + txt_tokens, dim, generator=gen),
                                          torch.randn(1, dim, generator=gen)]
    raise ValueError(f"unknown demo model {model!r}; valid: transformer, flux")


def run_demo(device: str = "auto", model: str = "transformer", dim: int = 512, depth: int = 8,
             tokens: int = 256, iters: int = 3, warmup: int = 2, presets: Sequence[str] = ("mid_range", "budget"),
             sim_gbps: float | None = None, copy_to_compute: float = 0.5, budget_frac: float = 1.0,
             seed: int = 0) -> tuple[list[Row], dict]:
    """Resident run, then one offloaded run per preset on the same model and input; rows plus run info."""

    device = resolve_device(device)
    for preset in presets:  # fail before any work on a typo
        OffloadConfig.from_preset(preset, device=device)
    net, inputs, block, block_inputs = build_demo_model(model, dim, depth, tokens, seed)
    total = weight_bytes(net)
    info: dict[str, Any] = {"device": device, "model": model, "dim": dim, "depth": depth, "tokens": tokens,
                            "weight_bytes": total, "torch": torch.__version__}
    tdev = torch_device(device)

    overrides: dict[str, Any] = {"device": device}
    # On the simulated device the calibration's forwards also warm the process up (allocator, thread pool), so
    # the resident baseline timed next is not charged for first-run costs the offloaded rows never pay.
    if device == "sim":
        if sim_gbps is None:
            blocks = [b for lst in net.children() if isinstance(lst, nn.ModuleList) for b in lst]
            sim_gbps, block_ms = calibrate_sim_gbps_model(net, inputs, blocks, copy_to_compute)
            info["block_compute_ms"] = block_ms
            log.info("simulated device: a block computes in %.2f ms on average; bandwidth set to %.3f GB/s "
                     "(copies take %.0f%% of block compute)", block_ms, sim_gbps, 100 * copy_to_compute)
        overrides["sim_bandwidth_gbps"] = sim_gbps
        info["sim_bandwidth_gbps"] = sim_gbps

    # Resident reference: the whole model on the device, no hooks.
    resident = net if device == "sim" else copy.deepcopy(net).to(tdev)
    dev_inputs = [x.to(tdev) for x in inputs]
    ms_res, ref = time_forwards(lambda: resident(*dev_inputs), iters, device, warmup)
    ref = ref.detach().cpu()
    rows = [Row(config="resident (no offload)", ms_per_forward=ms_res, ratio=1.0, peak_device_bytes=total,
                max_abs_diff=0.0, equal=True, note="all on device")]
    if resident is not net:
        del resident
        if device != "sim":
            backends.get_backend(OffloadConfig(device=device)).empty_cache()

    # The VRAM budget plays the card: as big as the model's weights (budget_frac=1), so a preset that keeps
    # a share of it (mid_range: 65%) streams the rest, and "budget" streams everything through the ring.
    budget_bytes = int(total * budget_frac)
    info["budget_bytes"] = budget_bytes
    if device == "sim":  # the simulated card must hold the budget (the engine refuses a budget over the device)
        overrides["sim_capacity_bytes"] = max(8 << 30, 2 * budget_bytes)
    for preset in presets:
        cfg = OffloadConfig.from_preset(preset, **overrides)
        row, report = run_offloaded(net, dev_inputs, cfg, ref, iters, warmup, name=f"offload: {preset}",
                                    budget_bytes=budget_bytes)
        rows.append(row)
        info.setdefault("reports", {})[preset] = report
    if device == "sim":
        # Time the resident model once more: detach() gave it freshly allocated weights, like the engine's own
        # buffers. On a shared CPU the weights allocated at model build are sometimes markedly slower, and
        # ratios below 1.00x would credit the engine with an effect of memory placement, not of streaming.
        again, _ = time_forwards(lambda: net(*dev_inputs), iters, device, warmup)
        rows[0].ms_per_forward = ms_res = min(ms_res, again)
    for row in rows[1:]:
        row.ratio = row.ms_per_forward / ms_res if ms_res > 0 else None
    return rows, info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags (shared by `python -m offload demo`)."""
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else sim), cuda, cuda:N or sim")
    parser.add_argument("--model", default="transformer", choices=("transformer", "flux"),
                        help="TransformerStack, or a small Flux-shaped DiT (double + single blocks)")
    parser.add_argument("--dim", type=int, default=512, help="model width")
    parser.add_argument("--depth", type=int, default=8, help="number of blocks")
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the random input")
    parser.add_argument("--iters", type=int, default=3, help="timed forwards per configuration (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed forwards per configuration")
    parser.add_argument("--presets", default="mid_range,budget", help="comma-separated presets to run")
    parser.add_argument("--sim-gbps", type=float, default=None,
                        help="simulated copy bandwidth in GB/s (default: calibrated from the blocks' compute)")
    parser.add_argument("--copy-to-compute", type=float, default=0.5,
                        help="sim calibration: the blocks' copy time as a fraction of their compute time")
    parser.add_argument("--budget-frac", type=float, default=1.0,
                        help="VRAM budget given to each offloaded run, as a multiple of the model's weight bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments, print the table; non-zero exit when any output differs."""
    import json

    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    rows, info = run_demo(device=args.device, model=args.model, dim=args.dim, depth=args.depth,
                          tokens=args.tokens, iters=args.iters, warmup=args.warmup, presets=presets,
                          sim_gbps=args.sim_gbps, copy_to_compute=args.copy_to_compute,
                          budget_frac=args.budget_frac, seed=args.seed)
    ok = all(r.equal for r in rows)
    if args.json:
        print(json.dumps({"rows": [r.to_dict() for r in rows], "ok": ok,
                          **{k: v for k, v in info.items() if k != "reports"}}, indent=2))
    else:
        dev = info["device"]
        if dev == "sim":
            dev = f"simulated device (CPU), copy bandwidth {info['sim_bandwidth_gbps']:.2f} GB/s"
        else:
            dev = backends.get_backend(OffloadConfig(device=dev)).describe()
        print(f"Layer Offload demo: {info['model']} dim={info['dim']} depth={info['depth']} "
              f"tokens={info['tokens']}, {info['weight_bytes'] / MIB:.1f} MiB of weights, on {dev}, "
              f"torch {info['torch']}; VRAM budget per offloaded run {info['budget_bytes'] / MIB:.1f} MiB")
        print(format_table(rows))
        print("OK: every offloaded output is bitwise equal to the resident one" if ok
              else "FAIL: an offloaded output differs from the resident one")
    return 0 if ok else 1
