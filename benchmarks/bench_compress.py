"""The compressed host form (issue 36): how fast a unit decodes on the device against how fast it copies, and a
copy-bound model streamed with and without compression, in one run.

1. Per unit: bf16 weights drawn like trained ones (normal, std 0.02) are encoded once on the CPU
   (`store/codec.encode`), then, on the device, the encoded bytes are copied into the tail of a slot and decoded in
   place (`Backend.then`, as `CompressedSource` does). Rows per unit size: the encoded share of raw, the CPU encode
   rate, the raw copy of the unit, the copy of its encoded bytes, the decode alone; GB/s are raw bytes over the time
   (median of `--repeat`); `decode / raw copy` is how many times faster the decode runs than the copy it saves (the
   goal: at least 10x, so a streamed compressed unit costs its compressed copy).
2. A copy-bound model: a stack of bf16 MLP blocks, every block streamed (preset budget), on a simulated device
   whose copy engine is limited to `--gbps` GB/s, so the copy is the step's bound; the same model with
   host_compression "off" and "lossless", the outputs compared bitwise, the mean step time of `--steps` passes after
   a warm-up, and the host bytes the blocks hold.

    .venv/bin/python benchmarks/bench_compress.py                 # sim (CPU)
    .venv/bin/python benchmarks/bench_compress.py --device cuda   # a GPU (part 2 then runs on CUDA unthrottled)

No figure is a pass/fail bound; the ratios are within one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.backends import get_backend  # noqa: E402
from offload.model.layout import Leaf  # noqa: E402
from offload.store import codec  # noqa: E402


def _timed(backend, fn) -> float:
    backend.synchronize()
    t0 = time.perf_counter()
    backend.event_synchronize(fn())
    return time.perf_counter() - t0


class _OpCount(TorchDispatchMode):
    """Aten ops dispatched (views excluded): each is a kernel launch on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.n += 1
        return func(*args, **(kwargs or {}))


PAYLOADS = {"bf16": torch.bfloat16, "fp8_e4m3fn": getattr(torch, "float8_e4m3fn", None)}


def _leaves(n: int, tensors: int, dtype: torch.dtype = torch.bfloat16) -> list[Leaf]:
    """A unit of `n` bytes of `dtype` as `tensors` tensors, laid out as the engine lays a unit out (512-byte
    aligned)."""
    per = n // tensors // 512 * 512
    size = torch.empty(0, dtype=dtype).element_size()
    return [Leaf(i * per, per, dtype, (per // size,), None) for i in range(tensors)]


def _payload(n: int, payload: str, g: torch.Generator) -> torch.Tensor:
    """`n` raw bytes of weights drawn like trained ones: bf16, or fp8 e4m3fn scaled per tensor to its range as
    ComfyUI's quantizers write `*_fp8_scaled` payloads (the byte code's case)."""
    if payload == "bf16":
        return (torch.randn(n // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    w = torch.randn(n, generator=g) * 0.02
    return (w * (448.0 / w.abs().max())).to(PAYLOADS[payload]).view(torch.uint8)


def unit_rates(device: str, sizes_mb: list[float], repeat: int, tensors: int = 1,
               payload: str = "bf16") -> list[dict]:
    """Per unit size: encode rate (CPU), raw copy, encoded copy and decode alone (with the device's reused decode
    scratch, as the engine decodes), the decode's ops; a unit of `tensors` tensors of `payload` (PAYLOADS)."""
    from offload.store.compressed import decode_scratch
    backend = get_backend(OffloadConfig(device=device))
    scratch = decode_scratch(backend)
    rows = []
    for mb in sizes_mb:
        n = int(mb * (1 << 20)) // (512 * tensors) * 512 * tensors
        g = torch.Generator().manual_seed(0)
        raw = _payload(n, payload, g)
        t0 = time.perf_counter()
        enc = codec.encode(raw, _leaves(n, tensors, PAYLOADS[payload]))
        encode_s = time.perf_counter() - t0
        host_raw, _ = backend.alloc_host(n, True)
        host_raw.copy_(raw)
        host_enc, _ = backend.alloc_host(enc.size, True)
        host_enc.copy_(enc.blob)
        slot = backend.alloc(n)
        tail = slot[n - enc.size:]
        decode = lambda: codec.decode_into(slot, enc.chunks, n, enc.size, scratch)  # noqa: E731
        backend.copy_h2d(tail, host_enc)
        backend.synchronize()
        decode()  # the tables and the scratch, once
        backend.synchronize()
        with _OpCount() as ops:
            decode()
        backend.synchronize()
        copies, enc_copies, decodes = [], [], []
        for _ in range(repeat):
            copies.append(_timed(backend, lambda: backend.copy_h2d(slot, host_raw)))
            enc_copies.append(_timed(backend, lambda: backend.copy_h2d(tail, host_enc)))
            done = backend.copy_h2d(tail, host_enc)
            backend.event_synchronize(done)
            decodes.append(_timed(backend, lambda: backend.then(done, decode)))
        backend.synchronize()
        ok = torch.equal(slot.cpu(), raw)
        backend.release(slot)
        med = {k: statistics.median(v) for k, v in (("copy", copies), ("enc_copy", enc_copies), ("decode", decodes))}
        rows.append({"unit_mb": mb, "tensors": tensors, "payload": payload, "decode_ops": ops.n,
                     "ratio": round(enc.ratio, 4),
                     "encode_gbps": n / encode_s / 1e9,
                     "raw_copy_gbps": n / med["copy"] / 1e9, "encoded_copy_gbps": n / med["enc_copy"] / 1e9,
                     "decode_gbps": n / med["decode"] / 1e9, "decode_vs_raw_copy": med["copy"] / med["decode"],
                     "bitwise": ok})
    return rows


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _stack(dim: int, depth: int) -> Stack:
    torch.manual_seed(0)
    m = Stack(dim, depth).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    return m


def copy_bound(device: str, dim: int, depth: int, gbps: float | None, steps: int) -> list[dict]:
    x = torch.randn(1, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    rows, ref = [], None
    for mode in ("off", "lossless"):
        model = _stack(dim, depth)
        kw = dict(sim_bandwidth_gbps=gbps) if device.startswith("sim") and gbps else {}
        cfg = OffloadConfig.from_preset("budget", device=device, host_compression=mode, **kw)
        handle = offload_module(model, cfg, budget=VramBudget(None))
        xd = x.to(handle.backend.device)
        with torch.no_grad():
            out = model(xd)
            for _ in range(2):
                model(xd)
            handle.backend.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(xd)
            handle.backend.synchronize()
            step = (time.perf_counter() - t0) / steps
        ref = out.cpu() if ref is None else ref
        report = handle.report()
        rows.append({"host_compression": mode, "step_ms": step * 1e3, "host_bytes": report.host_bytes,
                     "host_raw_bytes": report.host_raw_bytes, "stall_ms": report.stall_ms / max(1, report.forwards),
                     "bitwise": torch.equal(out.cpu(), ref)})
        handle.detach()
    rows[1]["vs_off"] = rows[1]["step_ms"] / rows[0]["step_ms"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--sizes", default="16,64", help="unit sizes in MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--gbps", type=float, default=2.0, help="the simulated copy engine's limit (sim only)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    units = unit_rates(args.device, [int(s) for s in args.sizes.split(",")], args.repeat)
    model = copy_bound(args.device, args.dim, args.depth, args.gbps, args.steps)
    where = f"{args.device} ({platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__})"
    print(f"# compressed host form on {where}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| unit MiB | encoded share | encode GB/s (CPU) | raw copy GB/s | encoded copy GB/s | decode GB/s | "
          "decode / raw copy | bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    for r in units:
        print(f"| {r['unit_mb']} | {r['ratio']:.3f} | {r['encode_gbps']:.2f} | {r['raw_copy_gbps']:.2f} | "
              f"{r['encoded_copy_gbps']:.2f} | {r['decode_gbps']:.2f} | {r['decode_vs_raw_copy']:.2f}x | "
              f"{r['bitwise']} |")
    print(f"\ncopy-bound stack ({args.depth} x bf16 MLP blocks of dim {args.dim}, every block streamed"
          + (f", copy engine at {args.gbps} GB/s" if args.device.startswith("sim") else "") + "):")
    print("| host_compression | ms/step | stall ms/step | host MiB of blocks | raw MiB | vs off | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for r in model:
        print(f"| {r['host_compression']} | {r['step_ms']:.1f} | {r['stall_ms']:.1f} | {r['host_bytes'] / 2**20:.1f} "
              f"| {r['host_raw_bytes'] / 2**20:.1f} | {r.get('vs_off', 1.0):.2f}x | {r['bitwise']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"units": units, "model": model, "where": where}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
