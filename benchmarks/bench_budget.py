"""Two models sharing one VRAM budget with room for one: the budget's recency rule vs the split it replaced (issue 26).

Two equal models (TransformerStack), equal priority, one VramBudget of one model's bytes plus the other's floor.
Two ways of using them:

- `alternating`: A, B, A, B, ... one forward each (two models interleaved every step);
- `phases`: A for `--phase` forwards, then B for as many (a text encoder, then the diffusion model; Wan 2.2's experts).

Two policies, each on its own pair of models (same weights) and its own budget, set up side by side and timed in
interleaved chunks (one chunk is one A-then-B cycle of the use), so both see the same machine: `recency` is this
budget (priority first, then the model working in a phase leads; models alternating every forward keep their
split); `split` is the budget before issue 26 (ties broken by registration order: the first model keeps its blocks,
the other streams), obtained by making `touch()` a no-op on that budget. ms per forward is the median over the chunks;
MB copied per forward counts every host-to-device copy (streamed blocks and resident placements alike), of which
streamed is the engine's own count. Outputs are compared bit for bit with the plain models (the script exits
non-zero otherwise).

    .venv/bin/python benchmarks/bench_budget.py [--copy-to-compute 2] [--chunks 12] [--device sim|cuda]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.demo.reference_models import TransformerStack  # noqa: E402

POLICIES = ("split", "recency")


def block_ms(model: torch.nn.Module, x: torch.Tensor) -> float:
    """Compute ms of the model's blocks on the CPU (the simulated device's copy bandwidth is set from it)."""
    with torch.no_grad():
        h = model.embed(x)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            y = h
            for b in model.blocks:
                y = b(y)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


class Pair:
    """Two offloaded copies of the models under one budget with room for one model and the other's floor."""

    def __init__(self, policy: str, models: list, cfg: OffloadConfig) -> None:
        self.policy = policy
        self.models = [copy.deepcopy(m) for m in models]
        probe = offload_module(copy.deepcopy(models[0]), cfg, name="probe", budget=VramBudget(None))
        total = probe.want_bytes() + probe.floor_bytes()
        probe.detach()
        self.budget = VramBudget(total)
        if policy == "split":
            self.budget.touch = lambda *a, **k: False  # the budget before recency: registration order breaks ties
        self.handles = [offload_module(m, cfg, name=f"{policy}-{'ab'[i]}", budget=self.budget)
                        for i, m in enumerate(self.models)]
        self.times: list[float] = []
        self.copied = 0
        self.forwards = 0

    def chunk(self, order: list[int], x: torch.Tensor, refs: list, device: str, counter: list) -> None:
        """One cycle of the use, timed; every output checked."""
        counter[0] = 0
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in order:
                y = self.models[i](x)
                if not torch.equal(y, refs[i]):
                    raise SystemExit(f"{self.policy}: model {'ab'[i]} output differs from the plain model")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        self.times.append((time.perf_counter() - t0) * 1e3 / len(order))
        self.copied += counter[0]
        self.forwards += len(order)

    def reset(self) -> None:
        for h in self.handles:
            h.reset_stats()
        self.times, self.copied, self.forwards = [], 0, 0

    def row(self) -> dict:
        streamed = sum(h.report().total_bytes_streamed for h in self.handles)
        return dict(ms=statistics.median(self.times), best=min(self.times), moved=self.copied / self.forwards / 2 ** 20,
                    mb=streamed / self.forwards / 2 ** 20,
                    resident=tuple(sum(1 for b in h.report().blocks if b.tier == "vram") for h in self.handles))

    def close(self) -> None:
        for h in self.handles:
            h.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "sim")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--phase", type=int, default=6, help="forwards per phase in the phases use")
    ap.add_argument("--chunks", type=int, default=12, help="timed A-then-B cycles per policy and use")
    ap.add_argument("--copy-to-compute", type=float, default=2.0,
                    help="sim: copying the blocks takes this many times their compute (copies that cannot hide)")
    args = ap.parse_args()
    torch.manual_seed(0)
    models = [TransformerStack(dim=args.dim, depth=args.depth).eval() for _ in range(2)]
    x = torch.randn(1, args.tokens, args.dim)
    with torch.no_grad():
        refs = [m(x) for m in models]
    kw = dict(device=args.device, prefetch=2)
    if args.device == "sim":
        nbytes = sum(p.numel() * p.element_size() for p in models[0].blocks.parameters())
        gbps = nbytes / (block_ms(models[0], x) * args.copy_to_compute * 1e-3) / 1e9
        kw.update(sim_bandwidth_gbps=gbps, sim_capacity_bytes=(1 << 30) + 29)
        print(f"sim device: {gbps:.2f} GB/s (copying the blocks takes {args.copy_to_compute}x their compute)")
    else:  # references from resident copies on the device (the offloaded models stay on the host)
        x = x.to(args.device)
        with torch.no_grad():
            refs = [copy.deepcopy(m).to(args.device)(x) for m in models]
    cfg = OffloadConfig(**kw)
    results = {}
    for use in ("alternating", "phases"):
        order = [0, 1] if use == "alternating" else [0] * args.phase + [1] * args.phase
        pairs = [Pair(p, models, cfg) for p in POLICIES]
        backend = pairs[0].handles[0].backend
        counter = [0]
        copy_h2d = backend.copy_h2d

        def counting_copy(dst, src, after=None):  # every host-to-device copy: streamed and resident placements
            counter[0] += dst.numel() * dst.element_size()
            return copy_h2d(dst, src, after)

        backend.copy_h2d = counting_copy
        try:
            for p in pairs:  # warm-up: placement, first copies, the cost tracker's first measurements
                for _ in range(2):
                    p.chunk(order, x, refs, args.device, counter)
                p.reset()
            for c in range(args.chunks):
                for p in (pairs if c % 2 == 0 else pairs[::-1]):
                    p.chunk(order, x, refs, args.device, counter)
            for p in pairs:
                results[(use, p.policy)] = p.row()
        finally:
            del backend.copy_h2d  # the shared backend's own method again
            for p in pairs:
                p.close()
    print(f"\n{args.chunks} timed cycles per row, two TransformerStack(dim={args.dim}, depth={args.depth}) per "
          f"policy, budget: one model + the other's floor, torch {torch.__version__}, device {args.device}\n")
    print("| use | policy | ms/forward median | best cycle | MB copied/forward (all) | of it streamed | blocks "
          "resident at the end (a, b) | vs split (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for use in ("alternating", "phases"):
        base = results[(use, "split")]["ms"]
        for policy in POLICIES:
            r = results[(use, policy)]
            print(f"| {use} | {policy} | {r['ms']:.2f} | {r['best']:.2f} | {r['moved']:.2f} | {r['mb']:.2f} | "
                  f"{r['resident']} | {r['ms'] / base:.2f}x |")


if __name__ == "__main__":
    main()
