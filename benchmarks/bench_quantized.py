"""A quantized checkpoint under a RAM ceiling (issue 42): an fp8_scaled model (comfy_kitchen `QuantizedTensor`
weights, `TensorCoreFP8Layout`: the `*_fp8_scaled` files of ComfyUI's repositories) saved as ComfyUI saves it, then
offloaded with `ram_budget_bytes` at half the model's bytes, so about half its blocks stream from the file. Rows, in
one run on one input:

- `resident (no engine)`: the model as loaded, the reference output and time;
- `all blocks in RAM`: the engine with no ceiling (every block in host RAM, streamed to the device);
- `RAM ceiling 1/2, disk tier`: `disk_path=<the file>`, `host_compression="off"`: each disk-tier block's payload and
  scales read from the file once a step;
- `RAM ceiling 1/2, auto compression`: the same with `host_compression="auto"` (blocks held compressed where the codec
  pays instead of streaming from disk);
- `weight_dtype fp8 from bf16, RAM ceiling 1/2`: the same model's bf16 file, its blocks' weights cast to
  float8_e4m3fn at load as ComfyUI's `weight_dtype` does, streamed from the bf16 file with the cast applied by the
  read-ahead thread (it reads twice the fp8 bytes).

Columns: simulated ms per step and vs `all blocks in RAM` (the simulated device's own clock, `SimClock`: each Linear
at `--gflops`, copies at `--gbps`, disk reads at `--disk-gbps`; what the host's load cannot change), wall-clock ms
per step on this CPU (the fastest of `--steps` after a warm-up: noisy on a shared box), disk MB read per step (the
read-ahead thread's bytes over the timed steps), the disk-tier blocks' bytes in the file, host RAM held and the
ceiling, bitwise against the reference. The file is read through the page cache (warm after the first step): the
rows show bytes and scheduling, not a drive's speed (`bench_disk.py` measures that). No figure is a pass/fail bound.

    .venv/bin/python benchmarks/bench_quantized.py                 # ~100 MB model, a table
    .venv/bin/python benchmarks/bench_quantized.py --dim 512 --depth 8 --steps 2
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.backends.sim_clock import SimClock  # noqa: E402

try:
    from comfy_kitchen.tensor import QuantizedTensor
except ImportError:  # pragma: no cover - the test extras install it
    sys.exit("bench_quantized.py needs comfy_kitchen (pip install comfy-kitchen; it needs no particular torch)")
from safetensors.torch import save_file  # noqa: E402


class QLinear(nn.Module):
    """A linear layer as ComfyUI's mixed-precision ops hold an fp8_scaled one: a QuantizedTensor weight, bf16 bias."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        w = (torch.randn(dim_out, dim_in) * dim_in ** -0.5).to(torch.bfloat16)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim_out, dtype=torch.bfloat16), requires_grad=False)

    def quantize(self) -> None:
        self.weight = nn.Parameter(QuantizedTensor.from_float(self.weight.data, "TensorCoreFP8Layout"),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(x, w if isinstance(w, QuantizedTensor) else w.to(x.dtype), self.bias)


class Block(nn.Module):
    """A DiT-like block: attention projections and a 4x MLP (the shapes Flux's blocks repeat)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=torch.bfloat16)
        self.qkv, self.proj = QLinear(dim, 3 * dim), QLinear(dim, dim)
        self.up, self.down = QLinear(dim, 4 * dim), QLinear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def _build(dim: int, depth: int, how: str) -> Model:
    """The same weights every time: `fp8_scaled` (QuantizedTensor), `bf16`, or `cast_fp8` (weights cast to fp8 at
    load, as ComfyUI's weight_dtype does)."""
    torch.manual_seed(0)
    model = Model(dim, depth).eval()
    for m in model.modules():
        if isinstance(m, QLinear):
            if how == "fp8_scaled":
                m.quantize()
            elif how == "cast_fp8":
                m.weight.data = m.weight.data.to(torch.float8_e4m3fn)
    return model


def _save(model: Model, path: Path) -> None:
    """As ComfyUI saves it: a quantized layer's `QuantizedTensor.state_dict` and its `comfy_quant`."""
    sd = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, QLinear) and isinstance(m.weight, QuantizedTensor):
            sd.update(m.weight.state_dict(p + "weight"))
            sd[p + "bias"] = m.bias.data
            sd[p + "comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
            continue
        for k, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                sd[p + k] = t.data
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))


def _bytes(model: Model) -> int:
    total = 0
    for t in model.parameters():
        if isinstance(t, QuantizedTensor):
            names, _ = t.__tensor_flatten__()
            total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
        else:
            total += t.numel() * t.element_size()
    return total


def _charge(clock: SimClock, model: nn.Module, gflops: float) -> None:
    """Each matmul (nn.Linear, and QLinear: SimClock.charge_flops knows only torch's layer types) takes its
    multiply-adds at `gflops` on the simulated device's clock."""
    def cost(_m: nn.Module, args: tuple, out: torch.Tensor) -> float:
        return 2.0 * args[0].shape[-1] * out.numel() / (gflops * 1e9) * 1e3

    clock.charge([m for m in model.modules() if isinstance(m, (nn.Linear, QLinear))], cost)


def _time(model: nn.Module, x: torch.Tensor, steps: int, sync, clock: SimClock) -> tuple[float, float, torch.Tensor]:
    """(wall ms, simulated ms, output) of a step: the fastest of `steps` after a warm-up."""
    with torch.no_grad():
        out = model(x)  # warm-up (and the first reads)
        sync()
        best, sim = float("inf"), float("inf")
        for _ in range(steps):
            t0, s0 = time.perf_counter(), clock.now_ms
            out = model(x)
            sync()
            best, sim = min(best, time.perf_counter() - t0), min(sim, clock.now_ms - s0)
    return best * 1e3, sim, out


def run(dim: int, depth: int, tokens: int, steps: int, gbps: float, folder: Path, gflops: float = 50_000.0,
        disk_gbps: float = 3.0) -> list[dict]:
    x = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fp8_file, bf16_file = folder / "model_fp8_scaled.safetensors", folder / "model_bf16.safetensors"
    _save(_build(dim, depth, "fp8_scaled"), fp8_file)
    _save(_build(dim, depth, "bf16"), bf16_file)
    rows: list[dict] = []
    ref_model = _build(dim, depth, "fp8_scaled")
    ceiling = _bytes(ref_model) // 2
    clock = SimClock()
    _charge(clock, ref_model, gflops)
    ms, sim, ref = _time(ref_model, x, steps, lambda: None, clock)
    rows.append({"row": "resident (no engine)", "ms": ms, "sim_ms": sim, "bitwise": True})
    cast_ref = _time(_build(dim, depth, "cast_fp8"), x, 1, lambda: None, SimClock())[2]
    cases = [("all blocks in RAM", "fp8_scaled", {}, ref),
             ("RAM ceiling 1/2, disk tier", "fp8_scaled",
              {"disk_path": str(fp8_file), "ram_budget_bytes": ceiling, "host_compression": "off"}, ref),
             ("RAM ceiling 1/2, auto compression", "fp8_scaled",
              {"disk_path": str(fp8_file), "ram_budget_bytes": ceiling, "host_compression": "auto"}, ref),
             ("weight_dtype fp8 from bf16, RAM ceiling 1/2", "cast_fp8",
              {"disk_path": str(bf16_file), "ram_budget_bytes": ceiling, "host_compression": "off"}, cast_ref)]
    for label, how, kw, want in cases:
        model = _build(dim, depth, how)
        kw.setdefault("host_compression", "off")
        clock = SimClock(disk_gbps=disk_gbps)
        _charge(clock, model, gflops)
        cfg = OffloadConfig.from_preset("budget", device="sim", sim_bandwidth_gbps=gbps, sim_clock=clock, **kw)
        h = offload_module(model, cfg, budget=VramBudget(None))
        with torch.no_grad():
            model(x)
        read0 = h.report().disk_bytes_read
        ms, sim, out = _time(model, x, steps, h.backend.synchronize, clock)
        rep = h.report()
        staged = h.streamer.staged
        in_file = sum(staged.file.tensors[k].end - staged.file.tensors[k].start
                      for u in staged.units if u.master.host is None for k in u.master.keys) if staged.file else 0
        rows.append({"row": label, "ms": ms, "sim_ms": sim,
                     "disk_mb_per_step": (rep.disk_bytes_read - read0) / (steps + 1) / 1e6,
                     "disk_blocks": sum(b.tier == "disk" for b in rep.blocks), "blocks": len(rep.blocks),
                     "file_mb": in_file / 1e6, "ram_mb": h.host_memory()["ram"] / 1e6,
                     "ceiling_mb": kw["ram_budget_bytes"] / 1e6 if "ram_budget_bytes" in kw else None,
                     "bitwise": torch.equal(out, want)})
        h.detach()
        clock.remove_charges()
    base = rows[1]
    for r in rows:
        r["vs_ram"] = r["ms"] / base["ms"]
        r["sim_vs_ram"] = r["sim_ms"] / base["sim_ms"] if base["sim_ms"] > 0 else float("nan")
    return rows


def _mb(row: dict, key: str) -> str:
    return f"{row[key]:.1f}" if key in row else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gbps", type=float, default=8.0, help="the simulated copy engine's limit")
    ap.add_argument("--disk-gbps", type=float, default=3.0, help="the simulated disk's read rate (an NVMe drive)")
    ap.add_argument("--gflops", type=float, default=50_000.0, help="the simulated device's matmul rate, GFLOP/s")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-quantized-") as d:
        rows = run(args.dim, args.depth, args.tokens, args.steps, args.gbps, Path(d), args.gflops, args.disk_gbps)
    where = f"sim ({platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__})"
    print(f"# fp8_scaled under a RAM ceiling of half its bytes on {where}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.depth} blocks of width {args.dim}, "
          f"{args.tokens} tokens, copy engine at {args.gbps} GB/s, disk at {args.disk_gbps} GB/s, "
          f"{args.gflops:g} GFLOP/s")
    print("| row | sim ms/step | vs all in RAM | wall ms/step | disk MB read/step | disk-tier blocks | "
          "their MB in the file | host RAM MB | ceiling MB | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        disk = f"{r['disk_mb_per_step']:.1f}" if "disk_mb_per_step" in r else ""
        blocks = f"{r['disk_blocks']} of {r['blocks']}" if "blocks" in r else ""
        ceiling = f"{r['ceiling_mb']:.1f}" if r.get("ceiling_mb") else ""
        print(f"| {r['row']} | {r['sim_ms']:.2f} | {r['sim_vs_ram']:.2f}x | {r['ms']:.1f} | {disk} | {blocks} | "
              f"{_mb(r, 'file_mb')} | {_mb(r, 'ram_mb')} | {ceiling} | {r['bitwise']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "where": where, "args": vars(args)}, indent=1))
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
