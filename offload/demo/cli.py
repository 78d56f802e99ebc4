"""`python -m offload demo`: run one model resident and offloaded, check the outputs are bitwise equal, time both.

It exists so a new user sees, in under a minute and without a GPU, that offloading moves bytes and never
changes them, and what it costs. On CUDA it uses the GPU; otherwise the simulated device, with a copy
bandwidth calibrated so that copying the blocks takes about half of their compute (overlap visible).
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .. import backends
from ..config import PRESETS, OffloadConfig
from .measure import (MIB, Row, calibrate_sim_gbps_model, format_table, median_row, resolve_device, run_offloaded,
                      torch_device, weight_bytes)

log = logging.getLogger(__name__)


def build_demo_model(model: str, dim: int, depth: int, tokens: int,
                     seed: int) -> tuple[nn.Module, list[torch.Tensor], nn.Module, list[torch.Tensor]]:
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
             seed: int = 0, rounds: int = 3, progress: Callable[[str], None] | None = None,
             threads: int | None = None) -> tuple[list[Row], dict]:
    """`rounds` rounds of one offloaded run per preset, each timed in alternation with a resident copy of the model,
    on the same model and input.

    Returns one row per configuration (medians over the rounds, with their spread; each ratio is against the
    resident forwards timed alongside, so a slow spell of a shared machine moves both) plus run info. `progress(line)` is
    told what runs and what each configuration measured, as it goes (default: the module's logger, INFO).
    `threads`: torch's CPU threads while measuring (default on the simulated device: 1, so the copy thread and
    other processes on a small shared CPU disturb the timings least; elsewhere torch's own setting)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a whole number >= 1, got {threads!r}")
    if threads is None and resolve_device(device) == "sim":
        threads = 1
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        rows, info = _run_demo(device, model, dim, depth, tokens, iters, warmup, presets, sim_gbps, copy_to_compute,
                               budget_frac, seed, rounds, progress)
    finally:
        torch.set_num_threads(before)
    info["threads"] = threads if threads is not None else before
    return rows, info


def _run_demo(device: str, model: str, dim: int, depth: int, tokens: int, iters: int, warmup: int,
              presets: Sequence[str], sim_gbps: float | None, copy_to_compute: float, budget_frac: float,
              seed: int, rounds: int, progress: Callable[[str], None] | None) -> tuple[list[Row], dict]:
    say = progress or log.info
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number >= 1, got {rounds!r}")
    device = resolve_device(device)
    if not presets:
        raise ValueError(f"no preset to run; give one or more of: {', '.join(PRESETS)}")
    for preset in presets:  # fail before any work on a typo
        OffloadConfig.from_preset(preset, device=device)
    started = time.perf_counter()

    def elapsed() -> str:
        return f"{time.perf_counter() - started:.0f} s"

    _check_fits_in_ram(dim, depth)
    net, inputs, block, block_inputs = build_demo_model(model, dim, depth, tokens, seed)
    total = weight_bytes(net)
    info: dict[str, Any] = {"device": device, "model": model, "dim": dim, "depth": depth, "tokens": tokens,
                            "weight_bytes": total, "torch": torch.__version__, "rounds": rounds}
    tdev = torch_device(device)
    say(f"{model} dim={dim} depth={depth} tokens={tokens}: {total / MIB:.1f} MiB of weights on {device}; "
        f"{rounds} round(s) of {', '.join(presets)}, each against the resident model, {warmup} warm-up + {iters} "
        f"timed forward(s) per side")

    overrides: dict[str, Any] = {"device": device}
    # On the simulated device the calibration's forwards also warm the process up (allocator, thread pool), so
    # the resident baseline timed next is not charged for first-run costs the offloaded rows never pay.
    if device == "sim":
        if sim_gbps is None:
            say("calibrating the simulated copy bandwidth from the blocks' compute ...")
            blocks = [b for lst in net.children() if isinstance(lst, nn.ModuleList) for b in lst]
            sim_gbps, block_ms = calibrate_sim_gbps_model(net, inputs, blocks, copy_to_compute)
            info["block_compute_ms"] = block_ms
            say(f"a block computes in {block_ms:.2f} ms; simulated copy bandwidth {sim_gbps:.3f} GB/s "
                f"(copies take {100 * copy_to_compute:.0f}% of block compute) [{elapsed()}]")
        overrides["sim_bandwidth_gbps"] = sim_gbps
        info["sim_bandwidth_gbps"] = sim_gbps

    # The VRAM budget plays the card: as big as the model's weights (budget_frac=1), so a preset that keeps
    # a share of it (mid_range: 65%) streams the rest, and "budget" streams everything through the ring.
    budget_bytes = int(total * budget_frac)
    info["budget_bytes"] = budget_bytes
    if device == "sim":  # the simulated card must hold the budget (the engine refuses a budget over the device)
        overrides["sim_capacity_bytes"] = max(8 << 30, 2 * budget_bytes)
    dev_inputs = [x.to(tdev) for x in inputs]
    # The resident reference: a copy of the whole model on the device, no hooks (freshly allocated, like the
    # engine's own buffers: on a shared CPU the weights allocated at model build are sometimes markedly slower).
    # It is timed forward for forward in alternation with each offloaded run (see time_paired), so a slow spell
    # of a busy machine lands on both sides of a ratio.
    resident = copy.deepcopy(net).to(tdev)
    with torch.inference_mode():
        ref = resident(*dev_inputs).detach().cpu()
    per_config: dict[str, list[Row]] = {"resident (no offload)": []}
    for r in range(rounds):
        tag = f"round {r + 1}/{rounds}"
        ratios = []
        for preset in presets:
            cfg = OffloadConfig.from_preset(preset, **overrides)
            row, report = run_offloaded(net, dev_inputs, cfg, ref, iters, warmup, name=f"offload: {preset}",
                                        budget_bytes=budget_bytes, baseline=lambda: resident(*dev_inputs))
            base_ms = report["baseline_ms_per_forward"]
            per_config["resident (no offload)"].append(
                Row(config="resident (no offload)", ms_per_forward=base_ms, ratio=1.0, peak_device_bytes=total,
                    max_abs_diff=0.0, equal=True, note="all on device"))
            per_config.setdefault(row.config, []).append(row)
            info.setdefault("reports", {})[preset] = report
            ratios.append(f"{preset} {row.ratio:.2f}x" if row.ratio is not None else preset)
            say(f"{tag}: offload: {preset}: {row.ms_per_forward:.1f} ms/forward vs resident {base_ms:.1f} "
                f"({ratios[-1].split()[-1]}), "
                f"{'bitwise equal' if row.equal else 'DIFFERS from the resident output'} ({row.note}) [{elapsed()}]")
        say(f"{tag} done: {', '.join(ratios)} [{elapsed()}]")
    rows = [median_row(rs) for rs in per_config.values()]
    rows[0].ratio, rows[0].ratio_min, rows[0].ratio_max = 1.0, None, None
    info["seconds"] = round(time.perf_counter() - started, 1)
    return rows, info


_HIGHEST = {"--dim": 16384, "--depth": 1024, "--tokens": 1 << 16, "--iters": 10_000, "--rounds": 1000,
            "--warmup": 10_000, "--threads": 4096}  # far past a demo; a typo is a usage error, not a killed process


def _check_fits_in_ram(dim: int, depth: int) -> None:
    """Refuse a demo model whose copies (the model, a resident copy, the offloaded runs' buffers) cannot fit the RAM
    available now, before any is built (a ValueError, not an allocation failure or the OOM killer)."""
    import psutil

    need = 3 * 4 * (12 * dim * dim * depth + 4 * dim * dim)  # float32; a block holds ~12 dim^2 weights
    available = psutil.virtual_memory().available
    if need > available:
        raise ValueError(f"dim={dim} depth={depth} needs about {need / 2 ** 30:.1f} GiB of RAM for the demo's copies "
                         f"of the model; {available / 2 ** 30:.1f} GiB is available; give a smaller --dim or --depth")


def _int_at_least(low: int, what: str) -> Any:
    high = _HIGHEST.get(what, 1 << 31)

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 20 else None
        except ValueError:
            value = None
        if value is None:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {text[:40]!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{what} must be at least {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{what} must be at most {high}, got {value}")
        return value
    return parse


def _positive_float(what: str) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else None
        except ValueError:
            value = None
        if value is None:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text[:40]!r}")
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{what} must be a finite number > 0, got {text}")
        return value
    return parse


def _presets(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no preset to run; give one or more of: {', '.join(PRESETS)}")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown preset(s) {', '.join(unknown)}; valid: {', '.join(PRESETS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags (shared by `python -m offload demo`); bad values are usage errors."""
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else sim), cuda, cuda:N or sim")
    parser.add_argument("--model", default="transformer", choices=("transformer", "flux"),
                        help="TransformerStack, or a small Flux-shaped DiT (double + single blocks)")
    parser.add_argument("--dim", type=_int_at_least(8, "--dim"), default=512, help="model width (>= 8)")
    parser.add_argument("--depth", type=_int_at_least(2, "--depth"), default=8,
                        help="number of blocks (>= 2: there is nothing to stream block by block in one)")
    parser.add_argument("--tokens", type=_int_at_least(1, "--tokens"), default=256,
                        help="sequence length of the random input")
    parser.add_argument("--iters", type=_int_at_least(1, "--iters"), default=3,
                        help="timed forwards per configuration and round (after warm-up)")
    parser.add_argument("--rounds", type=_int_at_least(1, "--rounds"), default=3,
                        help="rounds of every configuration; the table shows medians and their min-max (default 3)")
    parser.add_argument("--warmup", type=_int_at_least(0, "--warmup"), default=2,
                        help="untimed forwards per configuration")
    parser.add_argument("--presets", type=_presets, default=["mid_range", "budget"],
                        help="comma-separated presets to run (default: mid_range,budget)")
    parser.add_argument("--sim-gbps", type=_positive_float("--sim-gbps"), default=None,
                        help="simulated copy bandwidth in GB/s (default: calibrated from the blocks' compute)")
    parser.add_argument("--copy-to-compute", type=_positive_float("--copy-to-compute"), default=0.5,
                        help="sim calibration: the blocks' copy time as a fraction of their compute time")
    parser.add_argument("--budget-frac", type=_positive_float("--budget-frac"), default=1.0,
                        help="VRAM budget given to each offloaded run, as a multiple of the model's weight bytes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--threads", type=_int_at_least(1, "--threads"), default=None,
                        help="torch CPU threads while measuring (default: 1 on the simulated device, else torch's)")


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments, print the table; non-zero exit when any output differs."""
    presets = list(args.presets)
    quiet = getattr(args, "quiet", False)

    def progress(line: str) -> None:  # the CLI's own progress lines: stderr, so stdout stays the table / JSON
        if not quiet:
            print(f"[demo] {line}", file=sys.stderr, flush=True)

    rows, info = run_demo(device=args.device, model=args.model, dim=args.dim, depth=args.depth,
                          tokens=args.tokens, iters=args.iters, warmup=args.warmup, presets=presets,
                          sim_gbps=args.sim_gbps, copy_to_compute=args.copy_to_compute,
                          budget_frac=args.budget_frac, seed=args.seed, rounds=getattr(args, "rounds", 3),
                          progress=progress, threads=getattr(args, "threads", None))
    offloaded = rows[1:]
    ok = bool(offloaded) and all(r.equal for r in rows)
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
        if info["rounds"] > 1:
            print(f"Medians of {info['rounds']} rounds; min-max: their spread. Each offloaded run is timed forward for "
                  f"forward in alternation with the resident model, and its ratio is against those resident forwards; "
                  f"{info['threads']} torch thread(s), {info['seconds']:.0f} s in all")
        print(format_table(rows))
        if not offloaded:
            print("FAIL: no offloaded configuration ran, so nothing was compared")
        else:
            print(f"OK: every offloaded output is bitwise equal to the resident one ({len(offloaded)} configuration(s))"
                  if ok else "FAIL: an offloaded output differs from the resident one")
    return 0 if ok else 1
