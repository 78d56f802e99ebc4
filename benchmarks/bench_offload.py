#!/usr/bin/env python3
"""Speed/memory benchmark of Layer Offload against baselines, all measured in ONE run on the SAME model.

Configurations (same weights, same input):
  resident            the whole model on the device, no hooks (the reference output and time)
  layer-offload       this engine: stream everything (preset "budget"), then 25% and 50% of the blocks resident
  naive sync .to()    per-block forward pre-hook copies the block to the device with blocking copies, the
                      post-hook points it back at its host tensors (no prefetch, no overlap)
  accelerate          accelerate.cpu_offload (CUDA only; skipped when accelerate is not importable)
  diffusers           diffusers.hooks.apply_group_offloading, block_level, 1 block per group, use_stream=True
                      (CUDA only; skipped when diffusers is not importable)

Speed is reported as a ratio to `resident` measured in the same run, never as a pass/fail bound.
On a machine without CUDA everything runs on the simulated device (CPU), whose copy bandwidth is
calibrated from the blocks' measured compute; accelerate/diffusers need a real device and are skipped.

    python benchmarks/bench_offload.py --model flux          # Flux-shaped DiT, scaled down without CUDA
    python benchmarks/bench_offload.py --model decoder7b     # 7B decoder, batch-1 decode step
    python benchmarks/bench_offload.py --model flux --width-div 1 --depth-div 1   # full size (CUDA)
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from offload.demo import (MIB, Row, bitwise_equal, calibrate_sim_gbps_model, format_table, max_abs_diff,  # noqa: E402
                          resolve_device, synchronize, time_forwards, torch_device, weight_bytes)

log = logging.getLogger("bench_offload")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_RECORD = ROOT / "docs" / "benchmarks.md"


# --------------------------------------------------------------------------------------------- models
def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The model's repeated-block lists (top-level ModuleLists): what every offloader streams."""
    return [m for m in model.children() if isinstance(m, nn.ModuleList)]


def build_model(name: str, width_div: int, depth_div: int, dtype: torch.dtype, img_tokens: int | None,
                txt_tokens: int | None, seed: int) -> tuple[nn.Module, list[torch.Tensor], nn.Module,
                                                          list[torch.Tensor], str]:
    """Model, its CPU inputs, one representative block with its inputs, and a one-line description."""
    from offload.demo.reference_models import build_decoder_7b_like, build_flux_like

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "flux":
        model = build_flux_like(width_div, depth_div, dtype).eval()
        n_img = img_tokens or max(16, 4096 // width_div)
        n_txt = txt_tokens or max(8, 512 // width_div)
        dim = model.dim
        txt_dim = model.txt_in.in_features
        inputs = [torch.randn(1, n_img, 64, generator=gen).to(dtype),
                  torch.randn(1, n_txt, txt_dim, generator=gen).to(dtype),
                  torch.randn(1, dim, generator=gen).to(dtype)]
        block = model.double_blocks[0]
        block_inputs = [torch.randn(1, n_img, dim, generator=gen).to(dtype),
                        torch.randn(1, n_txt, dim, generator=gen).to(dtype),
                        torch.randn(1, dim, generator=gen).to(dtype)]
        desc = (f"Flux-like DiT width {dim}, {len(model.double_blocks)} double + {len(model.single_blocks)} "
                f"single blocks, {str(dtype).replace('torch.', '')}, batch 1, {n_img} image + {n_txt} text tokens")
        return model, inputs, block, block_inputs, desc
    if name == "decoder7b":
        model = build_decoder_7b_like(width_div, depth_div, dtype).eval()
        vocab = model.embed_tokens.num_embeddings
        dim = model.embed_tokens.embedding_dim
        inputs = [torch.randint(0, vocab, (1, 1), generator=gen)]
        block = model.layers[0]
        block_inputs = [torch.randn(1, 1, dim, generator=gen).to(dtype)]
        desc = (f"7B-like decoder width {dim}, {len(model.layers)} layers, {str(dtype).replace('torch.', '')}, "
                f"batch-1 decode step (1 token, no KV cache)")
        return model, inputs, block, block_inputs, desc
    raise ValueError(f"unknown model {name!r}; valid: flux, decoder7b")


# ------------------------------------------------------------------------------------ naive baseline
class NaiveSyncOffload:
    """Blocking per-block offload: pre-hook copies a block's weights to the device, post-hook drops them.

    The post-hook points parameters back at their host tensors instead of copying device-to-host (which would
    only make this baseline slower). On the simulated device the copies go through the same SimBackend
    (same bandwidth limit) as the engine, waited on synchronously.
    """

    def __init__(self, model: nn.Module, device: str, sim_gbps: float | None = None) -> None:
        self.model, self.device = model, device
        self.tdev = torch_device(device)
        self.sim = None
        if device == "sim":
            from offload.backends.sim import SimBackend

            self.sim = SimBackend(capacity_bytes=1 << 50, bandwidth_gbps=sim_gbps)
        self.blocks = [b for lst in block_lists(model) for b in lst]
        self.others = [m for m in model.children() if not isinstance(m, nn.ModuleList)]
        self.resident_bytes = sum(weight_bytes(m) for m in self.others)
        for m in self.others:  # embeddings, norms, heads: resident on the device
            m.to(self.tdev)
        self.host: dict[nn.Parameter, tuple[torch.Tensor, Any]] = {}
        self.copy_s = 0.0
        self.bytes_copied = 0
        self.handles = []
        for b in self.blocks:
            self.handles.append(b.register_forward_pre_hook(self._pre))
            self.handles.append(b.register_forward_hook(self._post))

    def _pre(self, module: nn.Module, args: Any) -> None:
        synchronize(self.device)  # the blocking copy waits for queued compute anyway; keep it out of copy time
        start = time.perf_counter()
        for p in module.parameters():
            host = p.data
            nbytes = host.numel() * host.element_size()
            if self.sim is not None:
                with torch.inference_mode(False):  # the copy thread writes it outside inference mode
                    buf = self.sim.alloc(nbytes)
                    dst = buf.view(host.dtype).view(host.shape)
                self.sim.wait(self.sim.copy_h2d(dst, host))
                p.data = dst
                self.host[p] = (host, buf)
            else:
                p.data = host.to(self.tdev)  # pageable source: a blocking copy
                self.host[p] = (host, None)
            self.bytes_copied += nbytes
        synchronize(self.device)
        self.copy_s += time.perf_counter() - start

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        for p in module.parameters():
            host, buf = self.host.pop(p)
            p.data = host
            if buf is not None:
                self.sim.release(buf)

    def reset_stats(self) -> None:
        """Forget warm-up copies so GB/s covers the timed forwards only."""
        self.copy_s, self.bytes_copied = 0.0, 0
        if self.sim is not None:
            self.sim.reset_peak()

    def peak_device_bytes(self) -> int | None:
        """Resident modules plus the simulated device's peak (sim only; CUDA uses the allocator peak)."""
        return self.resident_bytes + self.sim.peak_bytes if self.sim is not None else None

    def remove(self) -> None:
        """Remove hooks and bring the resident modules back to the CPU."""
        for h in self.handles:
            h.remove()
        for m in self.others:
            m.to("cpu")


# ------------------------------------------------------------------------------------------ runner
class Bench:
    """Runs every configuration on one model and collects rows; the resident time is the baseline."""

    def __init__(self, model: nn.Module, inputs: Sequence[torch.Tensor], device: str, iters: int, warmup: int,
                 sim_gbps: float | None) -> None:
        self.model, self.device, self.iters, self.warmup = model, device, iters, warmup
        self.tdev = torch_device(device)
        self.inputs = [x.to(self.tdev) for x in inputs]
        self.sim_gbps = sim_gbps
        self.total = weight_bytes(model)
        self.rows: list[Row] = []
        self.reference: torch.Tensor | None = None
        self.resident_ms: float | None = None
        self.engine_ok = True

    def _cuda(self) -> bool:
        return self.device.startswith("cuda")

    def _timed(self, fn: Callable[[], Any], after_warmup: Callable[[], None] | None = None) -> tuple[float, Any, int | None]:
        def reset() -> None:
            if after_warmup is not None:
                after_warmup()
            if self._cuda():
                torch.cuda.reset_peak_memory_stats(self.tdev)
        ms, out = time_forwards(fn, self.iters, self.device, self.warmup, after_warmup=reset)
        peak = torch.cuda.max_memory_allocated(self.tdev) if self._cuda() else None
        return ms, out, peak

    def _add(self, row: Row, out: Any) -> Row:
        if self.reference is not None and out is not None:
            row.max_abs_diff = max_abs_diff(out, self.reference)
            row.equal = bitwise_equal(out, self.reference)
        if self.resident_ms:
            row.ratio = row.ms_per_forward / self.resident_ms
        self.rows.append(row)
        log.info("%s: %.1f ms/forward", row.config, row.ms_per_forward)
        return row

    def skip(self, config: str, why: str) -> None:
        """A baseline that could not run: a row with the reason instead of figures."""
        self.rows.append(Row(config=config, ms_per_forward=float("nan"), note=f"skipped: {why}"))
        log.warning("%s skipped: %s", config, why)

    # -- configurations
    def resident(self) -> None:
        model = self.model
        if self._cuda():
            model.to(self.tdev)
        try:
            ms, out, peak = self._timed(lambda: model(*self.inputs))
        finally:
            if self._cuda():
                model.to("cpu")
                torch.cuda.empty_cache()
        self.reference = out.detach().cpu()
        self.resident_ms = ms
        self._add(Row(config="resident (no offload)", ms_per_forward=ms,
                      peak_device_bytes=peak if peak is not None else self.total, note="all weights on device"), out)

    def engine(self, label: str, cfg: Any, budget_bytes: int) -> None:
        from offload import VramBudget, offload_module

        handle = offload_module(self.model, cfg, name="bench", budget=VramBudget(int(budget_bytes)))
        try:
            ms, out, peak = self._timed(lambda: self.model(*self.inputs), after_warmup=handle.reset_stats)
            handle.backend.synchronize()
            rep = handle.report()
            tiers: dict[str, int] = {}
            for unit in rep.blocks:
                tiers[unit.tier] = tiers.get(unit.tier, 0) + 1
            note = ", ".join(f"{n} {t}" for t, n in sorted(tiers.items())) + \
                f"; resident {rep.resident_bytes / MIB:.0f} MiB"
            row = Row(config=label, ms_per_forward=ms,
                      peak_device_bytes=peak if peak is not None else rep.peak_device_bytes,
                      overlap_ratio=rep.overlap_ratio, effective_gbps=rep.effective_gbps, note=note)
        finally:
            handle.detach()
            if self._cuda():
                torch.cuda.empty_cache()
        self._add(row, out)
        if not row.equal:
            self.engine_ok = False

    def naive(self) -> None:
        naive = NaiveSyncOffload(self.model, self.device, self.sim_gbps)
        try:
            ms, out, peak = self._timed(lambda: self.model(*self.inputs), after_warmup=naive.reset_stats)
            gbps = naive.bytes_copied / naive.copy_s / 1e9 if naive.copy_s > 0 else None
            row = Row(config="naive sync .to() per block", ms_per_forward=ms,
                      peak_device_bytes=peak if peak is not None else naive.peak_device_bytes(),
                      overlap_ratio=0.0, effective_gbps=gbps, note="blocking copies, no prefetch")
        finally:
            naive.remove()
            if self._cuda():
                torch.cuda.empty_cache()
        self._add(row, out)

    def accelerate(self) -> None:
        label = "accelerate cpu_offload"
        if not self._cuda():
            return self.skip(label, "needs a CUDA device")
        try:
            from accelerate import cpu_offload
            from accelerate.hooks import remove_hook_from_submodules
        except ImportError as exc:
            return self.skip(label, f"accelerate not importable ({exc.name}); pip install accelerate")
        model = copy.deepcopy(self.model)  # cpu_offload leaves parameters on the meta device
        try:
            cpu_offload(model, execution_device=self.tdev)
            ms, out, peak = self._timed(lambda: model(*self.inputs))
            remove_hook_from_submodules(model)
        finally:
            del model
            torch.cuda.empty_cache()
        self._add(Row(config=label, ms_per_forward=ms, peak_device_bytes=peak, note="leaf modules, sync"), out)

    def diffusers(self) -> None:
        label = "diffusers group offload (block, stream)"
        if not self._cuda():
            return self.skip(label, "needs a CUDA device")
        try:
            from diffusers.hooks import apply_group_offloading
        except ImportError as exc:
            return self.skip(label, f"diffusers not importable ({exc.name}); pip install diffusers")
        model = copy.deepcopy(self.model)  # its hooks and pinned copies stay with the copy
        try:
            # Works on any nn.Module (ModelMixin.enable_group_offload is the same thing for diffusers models).
            apply_group_offloading(model, onload_device=self.tdev, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=True)
            ms, out, peak = self._timed(lambda: model(*self.inputs))
        finally:
            del model
            torch.cuda.empty_cache()
        self._add(Row(config=label, ms_per_forward=ms, peak_device_bytes=peak, note="1 block per group"), out)


def engine_configs(model: nn.Module, device: str, fractions: Sequence[float], prefetch: int,
                   sim_gbps: float | None) -> list[tuple[str, Any, int]]:
    """(label, OffloadConfig, budget bytes) per engine configuration: stream all, then fractions resident."""
    from offload import OffloadConfig

    blocks = [b for lst in block_lists(model) for b in lst]
    block_bytes = sum(weight_bytes(b) for b in blocks)
    largest = max(weight_bytes(b) for b in blocks)
    other = weight_bytes(model) - block_bytes
    ring = (prefetch + 1) * largest  # slot ring: the unit computing plus the lookahead
    out = []
    for frac in fractions:
        budget = int((other + ring + frac * block_bytes) * 1.01) + (1 << 20)  # slack: alignment padding
        # The simulated card must be at least as big as the budget (the engine refuses a budget over the device).
        sim = ({"sim_bandwidth_gbps": sim_gbps, "sim_capacity_bytes": max(8 << 30, 2 * budget)}
               if device == "sim" else {})
        if frac <= 0:
            cfg = OffloadConfig.from_preset("budget", device=device, prefetch=prefetch, vram_budget_bytes=budget, **sim)
            label = "layer-offload: stream all"
        else:
            cfg = OffloadConfig(device=device, prefetch=prefetch, vram_budget_bytes=budget, **sim)
            label = f"layer-offload: {frac:.0%} blocks resident"
        out.append((label, cfg, budget))
    return out


def aggregate(runs: list[list[Row]]) -> list[Row]:
    """One row per configuration over repeated rounds: medians, the ratio as the median of per-round ratios.

    A shared CPU (or a GPU with neighbours) drifts; comparing each configuration with the resident time of its
    own round and taking the median keeps one noisy round from deciding the figure.
    """
    if len(runs) == 1:
        return runs[0]

    def med(values: list[Any]) -> Any:
        values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
        return statistics.median(values) if values else None

    out = []
    for i, first in enumerate(runs[0]):
        group = [run[i] for run in runs]
        ratios = [r.ms_per_forward / run[0].ms_per_forward for r, run in zip(group, runs)
                  if run[0].ms_per_forward and not math.isnan(r.ms_per_forward)]
        equal = [r.equal for r in group if r.equal is not None]
        diffs = [r.max_abs_diff for r in group if r.max_abs_diff is not None]
        ms = med([r.ms_per_forward for r in group])
        out.append(Row(config=first.config, ms_per_forward=ms if ms is not None else float("nan"),
                       ratio=med(ratios), peak_device_bytes=med([r.peak_device_bytes for r in group]),
                       overlap_ratio=med([r.overlap_ratio for r in group]),
                       effective_gbps=med([r.effective_gbps for r in group]),
                       max_abs_diff=max(diffs) if diffs else None, equal=all(equal) if equal else None,
                       note=first.note))
    return out


# ---------------------------------------------------------------------------------------- recording
def device_name(device: str) -> str:
    """Human name of the device for the record: the GPU's name, or the simulated device."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"simulated device (CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def record(path: Path, table: str, meta: dict[str, Any], notes: Sequence[str]) -> None:
    """Append one run (markdown: what, where, when, how, table) to docs/benchmarks.md."""
    lines = ["", f"### {meta['model_name']} on {meta['device_name']} ({meta['date']})", "",
             f"- command: `{meta['command']}`",
             f"- model: {meta['desc']}; {meta['weight_mib']:.1f} MiB of weights",
             f"- torch {meta['torch']}, Python {meta['python']}; {meta['iters']} timed forwards after "
             f"{meta['warmup']} warm-up per configuration, {meta['repeat']} round(s) (medians; each ratio "
             f"against the resident time of its own round)"]
    if meta.get("sim_gbps"):
        lines.append(f"- simulated copy bandwidth {meta['sim_gbps']:.2f} GB/s: copying the blocks takes "
                     f"{meta['copy_to_compute']:.0%} of their compute (a block computes in "
                     f"{meta.get('block_ms', float('nan')):.1f} ms on average, fastest of 5 forwards)")
    lines += [f"- {n}" for n in notes]
    lines += ["", table, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write("\n".join(lines))


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags; defaults fit a 24 GiB CPU box on the simulated device."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("flux", "decoder7b"), default="flux")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else sim), cuda, cuda:N, sim")
    p.add_argument("--width-div", type=int, default=None,
                   help="divide the width (default: 1 on CUDA; 8 for flux / 4 for decoder7b on sim)")
    p.add_argument("--depth-div", type=int, default=None,
                   help="divide the depth (default: 1 on CUDA; 4 for flux / 2 for decoder7b on sim)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--img-tokens", type=int, default=None, help="flux image tokens (default 4096 / width-div)")
    p.add_argument("--txt-tokens", type=int, default=None, help="flux text tokens (default 512 / width-div)")
    p.add_argument("--iters", type=int, default=3, help="timed forwards per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards per configuration")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of all configurations; figures are medians over rounds (use 3+ on a busy machine)")
    p.add_argument("--fractions", default="0,0.25,0.5",
                   help="engine configurations: share of the blocks resident (0 = stream all)")
    p.add_argument("--prefetch", type=int, default=2, help="engine lookahead in streamed units")
    p.add_argument("--sim-gbps", type=float, default=None, help="simulated copy bandwidth (default: calibrated)")
    p.add_argument("--copy-to-compute", type=float, default=0.5,
                   help="sim calibration: the blocks' copy time as a fraction of their compute time")
    p.add_argument("--skip", default="", help="comma-separated configs to skip: naive, accelerate, diffusers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-record", action="store_true", help="do not append the table to docs/benchmarks.md")
    p.add_argument("--record-to", type=Path, default=DEFAULT_RECORD, help="markdown file to append to")
    p.add_argument("--json", type=Path, default=None, help="also write rows and metadata as JSON here")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run all configurations, print the table, optionally record it; non-zero if the engine changed outputs."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    device = resolve_device(args.device)
    on_cuda = device.startswith("cuda")
    width_div = args.width_div or (1 if on_cuda else {"flux": 8, "decoder7b": 4}[args.model])
    depth_div = args.depth_div or (1 if on_cuda else {"flux": 4, "decoder7b": 2}[args.model])
    dtype = DTYPES[args.dtype]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    model, inputs, block, block_inputs, desc = build_model(args.model, width_div, depth_div, dtype,
                                                           args.img_tokens, args.txt_tokens, args.seed)
    sim_gbps, block_ms = args.sim_gbps, None
    if device == "sim" and sim_gbps is None:
        with torch.inference_mode():  # warm the allocator and fresh pages first, or the block times slow
            for _ in range(2):
                model(*inputs)
        blocks = [b for lst in block_lists(model) for b in lst]
        sim_gbps, block_ms = calibrate_sim_gbps_model(model, inputs, blocks, args.copy_to_compute)
    total = weight_bytes(model)
    print(f"{desc}; {total / MIB:.1f} MiB of weights; device: {device_name(device)}"
          + (f"; sim bandwidth {sim_gbps:.2f} GB/s" if device == "sim" else ""), flush=True)

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    runs: list[list[Row]] = []
    engine_ok = True
    for _ in range(max(1, args.repeat)):  # each round re-measures resident, so ratios use a nearby baseline
        bench = Bench(model, inputs, device, args.iters, args.warmup, sim_gbps)
        bench.resident()
        if fractions:
            for label, cfg, budget in engine_configs(model, device, fractions, args.prefetch, sim_gbps):
                bench.engine(label, cfg, budget)
        if "naive" not in skip:
            bench.naive()
        if "accelerate" not in skip:
            bench.accelerate()
        if "diffusers" not in skip:
            bench.diffusers()
        runs.append(bench.rows)
        engine_ok = engine_ok and bench.engine_ok
    rows = aggregate(runs)

    table = format_table(rows)
    print(table)
    notes = ["ratios are against `resident` measured in the same run; speed is never a pass/fail bound",
             "peak device MiB: " + ("torch.cuda.max_memory_allocated during the timed forwards (weights + "
                                    "activations)" if on_cuda else
                                    "weights on the simulated device (its own accounting); activations not counted")]
    if hasattr(os, "getloadavg"):
        notes.append(f"host load average before the run: {load_before:.1f}, after: {os.getloadavg()[0]:.1f} "
                     f"({os.cpu_count()} CPUs); other processes on the machine slow every row alike only roughly")
    if not on_cuda:
        notes.append("simulated device: compute runs on the CPU and copies are throttled to the bandwidth above, "
                     "so the figures show the scheduling (overlap, stalls), not GPU speed")
    meta = {"model_name": args.model, "device": device, "device_name": device_name(device),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_offload.py",
                                                         *(sys.argv[1:] if argv is None else argv)]),
            "desc": desc, "weight_mib": total / MIB, "repeat": max(1, args.repeat), "torch": torch.__version__,
            "python": platform.python_version(), "iters": args.iters, "warmup": args.warmup,
            "sim_gbps": sim_gbps if device == "sim" else None, "block_ms": block_ms,
            "width_div": width_div, "depth_div": depth_div, "copy_to_compute": args.copy_to_compute}
    if not args.no_record:
        record(args.record_to, table, meta, notes)
        print(f"appended to {args.record_to}")
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "rows": [r.to_dict() for r in rows],
                                         "engine_outputs_equal": engine_ok}, indent=2, default=str))
    if not engine_ok:
        print("FAIL: a layer-offload output differs from the resident output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
