"""LoRA training step through an offloaded model vs the resident model (issue 19).

Rows (each trains the same LoRA adapters, rank `--rank`, on every Linear of every block, AdamW, the same data):
  resident (no offload)                 the plain model on the device
  layer-offload: stream all             offload_module with the `budget` preset: every block streams in forward and,
                                        in reverse order, in backward (the adapters stay on the device)
  layer-offload: 50% blocks resident    a budget that keeps about half the blocks
  block swap (musubi-style)             CUDA only: a simplified re-implementation of musubi-tuner / ai-toolkit block
                                        swap at the VRAM the stream-all row used: the first blocks stay on the GPU,
                                        each swapped block is moved to the GPU (.to(), pinned host copy) before it
                                        runs and back after; it needs activation checkpointing (--ckpt block), as the
                                        real tools recommend, since the weights a block saved would otherwise leave

On CUDA the peak device bytes of every row are torch's peak allocation during the steps (weights, activations,
adapters, optimizer state); on the simulated device they are the engine's own device bytes (resident: the model).
Each row reports ms per step (the median over the steps of a round, then over `--rounds` rounds run in rotated
order), peak device bytes, bytes streamed forward and backward, the per-block backward ms, and whether its per-step
losses and trained adapters are bitwise those of the resident row (in every round).

    python benchmarks/bench_training.py --device sim                 # the simulated device (CPU), a few seconds
    python benchmarks/bench_training.py --device cuda --dim 3072 --depth 24 --ckpt block --autocast bf16
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint as checkpoint  # noqa: E402

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.demo.reference_models import TransformerStack  # noqa: E402
from offload.model.layout import align  # noqa: E402


class LoRAHook:
    """out + x @ A @ B on a Linear, registered as a forward hook after offloading (A, B on the device)."""

    def __init__(self, lin: nn.Linear, rank: int, seed: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter((torch.randn(lin.in_features, rank, generator=g) * 0.02).to(device))
        self.B = nn.Parameter(torch.zeros(rank, lin.out_features).to(device))

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        return out + (x.to(self.A.dtype) @ self.A @ self.B).to(out.dtype)


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint.checkpoint(self.block, x, use_reentrant=False)


def build(args: argparse.Namespace) -> TransformerStack:
    torch.manual_seed(0)
    model = TransformerStack(dim=args.dim, depth=args.depth, heads=args.heads).eval()
    return model.requires_grad_(False)


def nbytes(m: nn.Module) -> int:
    return sum(align(t.numel() * t.element_size()) for t in list(m.parameters()) + list(m.buffers()))


def add_lora(model: TransformerStack, rank: int, device: torch.device) -> list[nn.Parameter]:
    params, seed = [], 0
    for block in model.blocks:
        for lin in block.modules():
            if isinstance(lin, nn.Linear):
                seed += 1
                lora = LoRAHook(lin, rank, seed, device)
                lin.register_forward_hook(lora)
                params += [lora.A, lora.B]
    return params


class BlockSwap:
    """musubi-style block swap, simplified: blocks [keep:] live in pinned host memory and are moved to the GPU right
    before they run (forward, and the re-forward activation checkpointing does in backward) and back after."""

    def __init__(self, blocks: nn.ModuleList, keep: int, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.swapped = list(blocks)[keep:]
        for b in list(blocks)[:keep]:
            b.to(device)
        self.host: dict[int, torch.Tensor] = {}  # the frozen weights' pinned host copies (never written back)
        for b in self.swapped:
            for p in b.parameters():
                p.data = p.data.cpu().pin_memory()
                self.host[id(p)] = p.data
            b.register_forward_pre_hook(self._in)
            b.register_forward_hook(self._out)
        self.bytes_in = 0

    def _in(self, block: nn.Module, args: Any) -> None:
        with torch.cuda.stream(self.stream):
            for p in block.parameters():
                p.data = p.data.to(self.device, non_blocking=True)
                self.bytes_in += p.numel() * p.element_size()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _out(self, block: nn.Module, args: Any, out: Any) -> None:
        for p in block.parameters():  # frozen: back to the host copy, the GPU copy is freed once autograd lets go
            p.data = self.host[id(p)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_row(args: argparse.Namespace, name: str, device: torch.device, data: list[tuple[torch.Tensor, torch.Tensor]],
            mode: str, budget_bytes: int | None = None, keep: int = 0, preset: bool = True) -> dict[str, Any]:
    model = build(args)
    handle = swap = None
    row: dict[str, Any] = {"config": name}
    if mode == "resident":
        model.to(device)
    elif mode == "offload":
        # the `budget` preset streams every block; the plain config keeps what fits the budget resident
        cfg = OffloadConfig.from_preset("budget" if preset else "auto", device=args.device,
                                        vram_budget_bytes=budget_bytes, prefetch=args.prefetch,
                                        sim_bandwidth_gbps=args.sim_bandwidth if args.device == "sim" else None)
        handle = offload_module(model, cfg, budget=VramBudget(None))
        handle.load()
    else:  # block swap
        if device.type != "cuda":
            return {"config": name, "note": "skipped: needs CUDA (on the simulated device nothing would move)"}
        if args.ckpt != "block":
            return {"config": name, "note": "skipped: block swap needs --ckpt block"}
        for attr in ("embed", "norm", "head"):
            getattr(model, attr).to(device)
        swap = BlockSwap(model.blocks, keep, device)
    params = add_lora(model, args.rank, device)
    if args.ckpt == "block":
        for i, b in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(b)
    opt = torch.optim.AdamW(params, lr=1e-3)
    if device.type == "cuda":  # every row: everything allocated on the GPU (weights, activations, adapters, state)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    amp = torch.bfloat16 if args.autocast == "bf16" else None
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        x, y = data[step % len(data)]
        if step == args.warmup and handle is not None:
            handle.reset_stats()
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            out = model(x)
        loss = (out.float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach().cpu())
    row["ms_per_step"] = statistics.median(times[args.warmup:])
    row["losses"] = losses
    row["trained"] = [p.detach().cpu() for p in params]
    if handle is not None:
        rep = handle.report()
        streamed = [b for b in rep.blocks if b.tier != "vram"]
        row["peak_device_bytes"] = (int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                                    else rep.peak_device_bytes)
        row["engine_device_bytes"] = rep.peak_device_bytes
        row["blocks_streamed"] = len(streamed)
        row["fwd_bytes_per_step"] = sum(b.bytes_streamed for b in rep.blocks) // args.steps
        row["bwd_bytes_per_step"] = rep.backward_bytes_streamed // args.steps
        calls = sum(b.backward_calls for b in streamed)
        row["bwd_ms_per_block"] = sum(b.backward_ms for b in streamed) / calls if calls else 0.0
        row["bwd_stall_ms_per_step"] = sum(b.backward_stall_ms for b in streamed) / args.steps
        row["overlap_ratio"] = rep.overlap_ratio
        handle.detach()
    elif device.type == "cuda":
        row["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))
        if swap is not None:
            row["fwd_bytes_per_step"] = swap.bytes_in // (args.warmup + args.steps)
    else:
        row["peak_device_bytes"] = nbytes(model)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="sim", choices=["sim", "cuda"])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all rows, in rotated order (median)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--ckpt", default="none", choices=["none", "block"])
    ap.add_argument("--autocast", default="none", choices=["none", "bf16"])
    ap.add_argument("--sim-bandwidth", type=float, default=16.0, help="simulated host-to-device GB/s")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--no-record", action="store_true", help="do not append the table to docs/benchmarks.md")
    ap.add_argument("--record-to", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args(argv)
    device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(1)
    data = [(torch.randn(args.batch, args.tokens, args.dim).to(device),
             torch.randn(args.batch, args.tokens, args.dim).to(device)) for _ in range(2)]

    probe = build(args)
    block = nbytes(probe.blocks[0])
    rest = nbytes(probe) - sum(nbytes(b) for b in probe.blocks)
    all_streamed = rest + (args.prefetch + 1) * block + 4096
    half = rest + (args.depth // 2 + args.prefetch + 1) * block + 4096
    del probe

    keep = max(0, (all_streamed - rest) // block - 1)  # equal VRAM: blocks the stream-all ring would hold, less one
    configs = [("resident (no offload)", "resident", None, {}),
               ("layer-offload: stream all", "offload", all_streamed, {}),
               ("layer-offload: 50% blocks resident", "offload", half, {"preset": False}),
               (f"block swap (musubi-style, {args.depth - keep} of {args.depth} swapped)", "swap", None,
                {"keep": keep})]
    # Rounds in a rotated order, each row's figure the median over rounds: on a shared machine the load moves by
    # several times within a minute, and a row run while it peaks would otherwise stand for the configuration.
    runs: dict[str, list[dict[str, Any]]] = {c[0]: [] for c in configs}
    for rnd in range(args.rounds):
        for k in range(len(configs)):
            name, mode, budget_bytes, kw = configs[(k + rnd) % len(configs)]
            runs[name].append(run_row(args, name, device, data, mode, budget_bytes, **kw))
    rows = []
    for name, _, _, _ in configs:
        first = runs[name][0]
        row = dict(runs[name][-1])
        if "ms_per_step" in first:
            row["ms_per_step_rounds"] = [r["ms_per_step"] for r in runs[name]]
            row["ms_per_step"] = statistics.median(row["ms_per_step_rounds"])
            row["losses"], row["trained"] = first["losses"], first["trained"]
            row["same_every_round"] = all(
                all(torch.equal(a, b) for a, b in zip(r["losses"], first["losses"])) for r in runs[name])
        rows.append(row)
    ref_losses, ref_trained, ref_ms = rows[0]["losses"], rows[0]["trained"], rows[0]["ms_per_step"]
    for r in rows:
        if "losses" in r:
            r["equal"] = (all(torch.equal(a, b) for a, b in zip(r["losses"], ref_losses))
                          and all(torch.equal(a, b) for a, b in zip(r["trained"], ref_trained)))
            r["ratio"] = r["ms_per_step"] / ref_ms
            r["equal"] = r["equal"] and r.get("same_every_round", True)
            r["final_loss"] = float(r["losses"][-1])
            del r["losses"], r["trained"]
    meta = {"device": args.device, "torch": torch.__version__, "cpu": platform.machine(),
            "threads": torch.get_num_threads(), "time": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python benchmarks/bench_training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "model": f"TransformerStack dim {args.dim}, depth {args.depth}, {args.tokens} tokens x {args.batch}, "
                     f"LoRA rank {args.rank} on every block Linear, AdamW, ckpt {args.ckpt}, autocast {args.autocast}",
            "block_bytes": block, "rest_bytes": rest,
            "sim_bandwidth_gbps": args.sim_bandwidth if args.device == "sim" else None}
    result = {"meta": meta, "rows": rows}
    table = markdown(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.no_record:
        with open(args.record_to, "a") as f:
            f.write("\n" + table)
    return result


def markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    mb = 1 << 20
    where = (f"simulated device ({m['sim_bandwidth_gbps']} GB/s; CPU: {m['cpu']}, {m['threads']} threads)"
             if m["device"] == "sim" else m["device"])
    lines = [f"### LoRA training step on {where} ({m['time']})", "",
             f"- {m['model']}; block {m['block_bytes'] / mb:.1f} MB, non-block {m['rest_bytes'] / mb:.1f} MB",
             f"- command: `{m['command']}`; torch {m['torch']}", "",
             "| config | ms/step | vs resident | peak device MB | fwd MB/step | bwd MB/step | bwd ms/block "
             "| bwd stall ms/step | bitwise equal | rounds ms/step | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def f(key: str, fmt: str, scale: float = 1.0) -> str:
            return format(r[key] / scale, fmt) if key in r else "-"
        lines.append(f"| {r['config']} | {f('ms_per_step', '.1f')} | {f('ratio', '.2f')} | "
                     f"{f('peak_device_bytes', '.1f', mb)} | {f('fwd_bytes_per_step', '.1f', mb)} | "
                     f"{f('bwd_bytes_per_step', '.1f', mb)} | {f('bwd_ms_per_block', '.2f')} | "
                     f"{f('bwd_stall_ms_per_step', '.1f')} | {r.get('equal', '-')} | "
                     f"{', '.join(format(v, '.0f') for v in r.get('ms_per_step_rounds', []))} | {r.get('note', '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
