"""Step time of placement from measured costs vs count-based placement, on a bandwidth-limited simulated device.

One model whose blocks differ: fat blocks with little compute (their copies cannot hide) and lean blocks with
much compute, in one of three layouts (fat first, interleaved, fat last). The same budget, the same input, one run:
`count` pins the count-based plan (the cost tracker is never ready), `cost` lets the engine re-plan from what it
measured. ms per forward is the median of the timed forwards after warm-up; stall is the engine's own measurement.
Outputs are compared bit for bit with the plain model (the script exits non-zero otherwise).

    .venv/bin/python benchmarks/bench_placement.py [--gbps 1.0] [--iters 6]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.demo.reference_models import FatCheapBlock, LeanComputeBlock, MixedCostStack  # noqa: E402


def _nbytes(m: nn.Module) -> int:
    return sum(((p.numel() * p.element_size() + 511) // 512) * 512 for p in m.parameters())


def measure(kinds: str, mode: str, gbps: float, iters: int, x: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = MixedCostStack(kinds).eval()
    with torch.no_grad():
        ref = model(x)
    fat = [b for b in model.blocks if isinstance(b, FatCheapBlock)]
    lean = [b for b in model.blocks if isinstance(b, LeanComputeBlock)]
    budget = VramBudget(sum(_nbytes(b) for b in fat) + 3 * _nbytes(lean[0]) + 4096)
    cfg = OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=gbps, sim_capacity_bytes=(96 << 20) + 17)
    h = offload_module(model, cfg, budget=budget)
    if mode == "count":
        h.keeper.costs.update = lambda *a, **k: False  # the tracker never becomes ready: count-based plan throughout
    for _ in range(4):  # measure, then (cost mode) re-plan at the end of a pass
        with torch.no_grad():
            model(x)
    h.reset_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        with torch.no_grad():
            y = model(x)
        times.append((time.perf_counter() - t0) * 1e3)
        if not torch.equal(y, ref):
            raise SystemExit(f"{mode} {kinds}: output differs from the plain model")
    rep = h.report()
    row = dict(layout=kinds, mode=mode, ms=statistics.median(times), stall_ms=rep.stall_ms / iters,
               resident="".join("R" if b.tier == "vram" else "s" for b in rep.blocks),
               mb_streamed=rep.total_bytes_streamed / iters / 2 ** 20)
    h.detach()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbps", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(256, 64)
    rows = []
    for kinds in ("FFFFLLLL", "FLFLFLFL", "LLLLFFFF"):
        for mode in ("count", "cost"):
            rows.append(measure(kinds, mode, args.gbps, args.iters, x))
    print("| layout | placement | ms/forward | stall ms/forward | MB streamed/forward | resident (R) / streamed (s) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['mode']} | {r['ms']:.1f} | {r['stall_ms']:.1f} | {r['mb_streamed']:.1f} | "
              f"{r['resident']} |")
    by = {(r["layout"], r["mode"]): r for r in rows}
    for kinds in ("FFFFLLLL", "FLFLFLFL", "LLLLFFFF"):
        c, k = by[(kinds, "cost")], by[(kinds, "count")]
        print(f"{kinds}: cost-aware / count-based step time = {c['ms'] / k['ms']:.2f}")


if __name__ == "__main__":
    main()
