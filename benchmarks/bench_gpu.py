#!/usr/bin/env python3
"""The GPU truth in one call: this engine against every offloader people use, on one CUDA GPU, in under 8 minutes.

One process (ComfyUI's rows in a child process of their own, so its memory manager and DynamicVRAM start clean):

1. the host-to-device bandwidth floor, pinned and pageable;
2. the CUDA tests (`pytest -m cuda`, in a subprocess with a time cap);
3. a Wan2.1-14B-shaped and a Flux-dev-shaped transformer (diffusers' own classes with the released configs; random
   bf16 weights made once, block by block, straight into host memory from a meta-device model) at two inputs, one
   copy-bound and one compute-bound, and VRAM limits of 8, 12 and 16 GB. Rows: resident (the baseline: ratios and
   bitwise equality are against it, same process), this engine (presets and auto; each row beside the step time
   `offload.predict` gave from the resident run's measured block times), diffusers group offloading (block_level
   with use_stream, leaf_level), accelerate `cpu_offload`, ComfyUI core (the same shapes as ComfyUI's own model
   through its ModelPatcher: DynamicVRAM where comfy-aimdo imports, lowvram otherwise; against ComfyUI's resident
   run), and a GGUF Q8_0 copy through city96's ComfyUI-GGUF ops where the pack is there.

Every row says what limited it (compute: copies hidden; copy: the copy engine busy nearly all the step; stall:
waits the copy engine does not explain) and skips with a reason when a baseline is missing. Every row is
time-boxed (--row-s) and the whole run stops starting rows at --deadline-s; skipped rows still appear. Results:
`bench_gpu.json` and `bench_gpu.md` in --out ($OUT on the lent GPU machine). The runbook (what to carry, the one
command): docs/benchmarks.md, "GPU run"; `benchmarks/gpu_carry.sh` gathers what that machine lacks.

    python benchmarks/bench_gpu.py                          # on a CUDA GPU, full size
    python benchmarks/bench_gpu.py --device sim --scale tiny  # the dry run: every row the simulated device can run
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("bench_gpu")
GIB = 1 << 30
MIB = 1 << 20

# diffusers configs of the released checkpoints (Wan-AI/Wan2.1-T2V-14B-Diffusers, black-forest-labs/FLUX.1-dev)
WAN_14B = dict(attention_head_dim=128, cross_attn_norm=True, eps=1e-6, ffn_dim=13824, freq_dim=256, in_channels=16,
               num_attention_heads=40, num_layers=40, out_channels=16, patch_size=(1, 2, 2),
               qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, text_dim=4096)
FLUX_DEV = dict(attention_head_dim=128, guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
                num_attention_heads=24, num_layers=19, num_single_layers=38, patch_size=1, pooled_projection_dim=768)
WAN_TINY = dict(WAN_14B, ffn_dim=512, num_attention_heads=2, num_layers=4, text_dim=64)
FLUX_TINY = dict(FLUX_DEV, joint_attention_dim=64, num_attention_heads=2, num_layers=2, num_single_layers=4,
                 pooled_projection_dim=32)


@dataclass(frozen=True)
class Shape:
    """One benchmarked model: its diffusers class and config at each scale, and its two inputs."""

    name: str
    family: str  # plan_cli family (how its inputs are made)
    cls: str
    full: dict
    tiny: dict
    inputs: dict  # {"copy-bound": (frames, height, width), "compute-bound": ...} at full scale
    tiny_inputs: dict


SHAPES = {
    "wan": Shape("Wan2.1-14B", "wan", "WanTransformer3DModel", WAN_14B, WAN_TINY,
                 {"copy-bound": (1, 480, 832), "compute-bound": (33, 480, 832)},
                 {"copy-bound": (1, 32, 32), "compute-bound": (9, 128, 128)}),
    "flux": Shape("Flux-dev", "flux", "FluxTransformer2DModel", FLUX_DEV, FLUX_TINY,
                  {"copy-bound": (1, 256, 256), "compute-bound": (1, 1024, 1024)},
                  {"copy-bound": (1, 32, 32), "compute-bound": (1, 256, 256)}),
}
# (bytes outside the blocks, bytes of the blocks) of the full-size models in bf16, as the engine lays them out
FULL_BYTES = {"wan": (int(0.43 * GIB), int(26.18 * GIB)), "flux": (int(0.12 * GIB), int(22.05 * GIB))}
PRESET_ROWS = ("auto", "budget", "consumer", "mid_range")
LIBRARY_ROWS = ("diffusers block_level (stream)", "diffusers leaf_level (stream)", "accelerate cpu_offload")
COMFY_ROWS = ("ComfyUI resident", "ComfyUI core", "ComfyUI-GGUF Q8_0")


@dataclass
class Row:
    """One measurement (or one skipped baseline, with the reason)."""

    section: str  # bandwidth | tests | <model name>
    config: str
    input: str = ""  # copy-bound | compute-bound
    limit_gb: float | None = None  # the VRAM limit at full scale (scaled to the model on --scale tiny)
    status: str = "ok"  # ok | skipped | error | failed
    reason: str = ""
    ms: float | None = None  # median ms per forward
    ratio: float | None = None  # vs the resident run of the same input, same process
    peak_vram_bytes: int | None = None
    host_ram_bytes: int | None = None
    equal: bool | None = None  # bitwise equal to the resident output
    max_abs_diff: float | None = None
    limited_by: str = ""  # compute | copy | stall
    predicted_ms: float | None = None  # offload.predict for this row (engine rows)
    stall_ms: float | None = None
    copy_ms: float | None = None
    gbps: float | None = None
    note: str = ""


# --------------------------------------------------------------------------------------------- small helpers
def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class Clock:
    """The run's deadline and each row's time box."""

    def __init__(self, deadline_s: float, row_s: float) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s
        self.row_s = row_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def limited_by(ms: float, stall_ms: float | None, copy_ms: float | None, ratio: float | None) -> str:
    """compute: copies hidden (stall under 5% of the step, or within 5% of resident); copy: the copy engine was busy
    80% of the step or more (bandwidth-bound); stall: the step waited on something the copy engine does not explain
    (too short a lookahead, synchronous copies, hook overhead)."""
    if stall_ms is not None and stall_ms < 0.05 * ms:
        return "compute"
    if stall_ms is None and ratio is not None and ratio <= 1.05:
        return "compute"
    if copy_ms is not None and copy_ms >= 0.8 * ms:
        return "copy"
    return "stall"


def max_abs_diff(a: Any, b: Any) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max()) if a.numel() else 0.0


def first_tensor(out: Any) -> Any:
    import torch

    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else out.sample
    return out


# -------------------------------------------------------------------------------------------- building models
def random_pool(seed: int = 0, n: int = 1 << 22) -> Any:
    """A pool of small random bf16 values that every weight is tiled from (fast: a memcpy per chunk, and the same
    weights in every row and process)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


def fill_from_pool(shape: tuple, dtype: Any, pool: Any, offset: int, ones: bool = False) -> Any:
    """One host tensor of `shape`, filled from the pool starting at `offset` (norm weights: ones)."""
    import torch

    t = torch.empty(shape, dtype=dtype)
    flat = t.view(-1)
    if ones:
        flat.fill_(1.0)
        return t
    n, p = flat.numel(), pool.numel()
    pos, start = 0, offset % p
    while pos < n:
        take = min(n - pos, p - start)
        flat[pos:pos + take].copy_(pool[start:start + take])
        pos += take
        start = 0
    return t


def master_weights(model: Any, pool: Any) -> dict[str, Any]:
    """Random host weights for every parameter of a meta-device model, one tensor at a time (never a full fp32
    copy): what every row's model is assigned (the same bytes, shared, in every row)."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        ones = p.dim() == 1 and ("norm" in name and name.endswith("weight"))
        out[name] = fill_from_pool(tuple(p.shape), p.dtype, pool, i * 7919, ones)
    return out


class ModelFactory:
    """Builds one benchmarked model again and again over the same host weights (no copy: parameters are assigned)."""

    def __init__(self, shape: Shape, scale: str) -> None:
        import torch

        from offload.predict.plan_cli import ModelSpec

        self.shape = shape
        self.scale = scale
        self.config = dict(shape.full if scale == "full" else shape.tiny)
        # bf16 as released; float32 for the tiny dry run, where the CPU computes (bf16 matmuls are emulated there)
        self.dtype = torch.bfloat16 if scale == "full" else torch.float32
        self.spec = ModelSpec(shape.family, shape.cls, self.config, "bench_gpu")
        import importlib.util

        self.library = "diffusers" if importlib.util.find_spec("diffusers") is not None else None
        if self.library is None:
            raise RuntimeError("diffusers is not importable here (benchmarks/gpu_carry.sh carries its wheel)")
        meta = self._meta_model()
        started = time.monotonic()
        self.weights = master_weights(meta, random_pool())
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.weights.values())
        log.info("%s: %.2f GiB of random weights made in %.1f s", shape.name, self.weight_bytes / GIB,
                 time.monotonic() - started)

    def _meta_model(self) -> Any:
        """The model with its parameters on the meta device and its buffers (rope tables) computed for real."""
        import diffusers
        from accelerate import init_empty_weights

        cls = getattr(diffusers, self.shape.cls)
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(self.config)
        return model.to(self.dtype).eval()

    def build(self) -> Any:
        model = self._meta_model()
        model.load_state_dict(self.weights, strict=False, assign=True)
        return model.eval()

    def block_bytes(self, model: Any) -> int:
        from offload.model.blocks import find_units
        from offload.predict import unit_sizes

        return sum(unit_sizes(model, find_units(model))[0])

    def inputs(self, model: Any, which: str, scale: str, device: Any) -> tuple[tuple, dict, int]:
        from offload.predict.plan_cli import InputSize, make_inputs

        frames, h, w = (self.shape.inputs if scale == "full" else self.shape.tiny_inputs)[which]
        size = InputSize(frames=frames, height=h, width=w, text_tokens=512 if scale == "full" else 16)
        return make_inputs(self.spec, model, size, device=device)


# ------------------------------------------------------------------------------------------------ the runner
class Bench:
    """Runs the sections, collects rows, keeps the time."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.clock = Clock(args.deadline_s, args.row_s)
        self.section_end = self.clock.deadline  # each model's sections get a share of what is left (main)
        self.rows: list[Row] = []
        self.device = args.device
        self.cuda = self.device.startswith("cuda")
        self.tdev = torch.device(self.device) if self.cuda else torch.device("cpu")
        self.env: dict[str, Any] = {}
        self.sim_gbps: float | None = args.sim_gbps

    # rows ----------------------------------------------------------------------------------
    def add(self, row: Row) -> Row:
        self.rows.append(row)
        ms = f"{row.ms:.1f} ms" if row.ms is not None else row.status
        extra = f" ({row.reason})" if row.reason else ""
        print(f"[{self.clock.elapsed():6.1f}s] {row.section} | {row.config} | {row.input} | "
              f"{'' if row.limit_gb is None else f'{row.limit_gb:g} GB'} | {ms}{extra}", file=sys.stderr, flush=True)
        return row

    def skip(self, section: str, config: str, reason: str, inputs: tuple[str, ...] = ("",),
             limits: tuple[float | None, ...] = (None,)) -> None:
        for inp in inputs:
            for limit in limits:
                self.add(Row(section, config, inp, limit, status="skipped", reason=reason))

    def out_of_time(self, need_s: float = 5.0) -> bool:
        """Whether less than `need_s` is left of the run, or of the share of it the current section was given."""
        return min(self.clock.left(), self.section_end - time.monotonic()) < need_s

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.tdev)

    def empty(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.tdev)

    def peak(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated(self.tdev)) if self.cuda else None

    def time_forwards(self, fn: Callable[[], Any], warmup: int | None = None,
                      after_warmup: Callable[[], None] | None = None) -> tuple[float, Any, int]:
        """(median ms per forward, the last output, forwards timed), stopping early at the row's time box."""
        import torch

        warmup = self.args.warmup if warmup is None else warmup
        out = None
        started = time.monotonic()
        times: list[float] = []
        with torch.inference_mode():
            for _ in range(warmup):
                out = fn()
            self.sync()
            if after_warmup is not None:
                after_warmup()
            self.reset_peak()
            for _ in range(max(1, self.args.iters)):
                t0 = time.perf_counter()
                out = fn()
                self.sync()
                times.append((time.perf_counter() - t0) * 1e3)
                if time.monotonic() - started > self.clock.row_s or self.out_of_time(1.0):
                    break
        return statistics.median(times), out, len(times)

    # 1. environment and bandwidth ------------------------------------------------------------
    def environment(self) -> None:
        import torch

        env = {"python": platform.python_version(), "torch": torch.__version__, "device": self.device,
               "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "scale": self.args.scale,
               "host": platform.node(), "cpus": os.cpu_count()}
        if self.cuda:
            props = torch.cuda.get_device_properties(self.tdev)
            env.update(gpu=props.name, gpu_total_bytes=int(props.total_memory), cuda=torch.version.cuda)
        for mod in ("diffusers", "accelerate", "gguf", "transformers"):
            try:
                env[mod] = __import__(mod).__version__
            except Exception as exc:  # noqa: BLE001 - a missing library is a row's skip reason, not a failure
                env[mod] = f"missing ({type(exc).__name__})"
        try:
            import psutil

            env["host_ram_bytes"] = int(psutil.virtual_memory().total)
        except ImportError:
            pass
        self.env = env

    def bandwidth(self) -> None:
        """Pinned and pageable host-to-device GB/s: the floor every streamed block's copy stands on."""
        from offload import OffloadConfig
        from offload.backends import get_backend

        backend = get_backend(OffloadConfig(device=self.device, sim_bandwidth_gbps=self.sim_gbps))
        sizes = (64 * MIB, 256 * MIB, GIB) if self.cuda else (4 * MIB, 16 * MIB)
        for pinned in (True, False):
            for n in sizes:
                if self.out_of_time(30):
                    return self.skip("bandwidth", f"{'pinned' if pinned else 'pageable'} {n // MIB} MiB",
                                     "time box")
                host, got = backend.alloc_host(n, pinned)
                dev = backend.alloc(n)
                try:
                    spans = []
                    for _ in range(4):
                        event = backend.copy_h2d(dev, host)
                        backend.event_synchronize(event)
                        spans.append(backend.copy_span_ms(event))
                finally:
                    backend.release(dev)
                    del host, dev
                best = min(spans)
                label = f"{'pinned' if got else 'pageable'} {n // MIB} MiB"
                note = "" if got == pinned else "pinning refused: pageable"
                if not self.cuda:
                    note = (note + "; " if note else "") + "simulated device: the host's memcpy (and the sim limit)"
                self.add(Row("bandwidth", label, ms=best, gbps=n / (best * 1e6), note=note))
        self.env["pinned_gbps"] = backend.h2d_gbps(True)
        self.env["pageable_gbps"] = backend.h2d_gbps(False)

    def compression(self) -> None:
        """The compressed host form (issue 36): per unit of bf16 weights drawn like trained ones, the raw copy, the
        copy of its encoded bytes and the decode alone in the slot (`benchmarks/bench_compress.py: unit_rates`);
        `gbps` is the decode's rate in raw bytes, the note says how many times faster than the raw copy it runs (the
        goal: at least 10x, so that a streamed compressed unit costs its compressed copy)."""
        if "compression" in self.args.skip:
            return self.skip("compression", "decode vs copy", "--skip compression")
        if self.out_of_time(60):
            return self.skip("compression", "decode vs copy", "time box")
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_compress", ROOT / "benchmarks" / "bench_compress.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sizes = [1, 16, 64, 256] if self.cuda else [4]
        try:
            rows = mod.unit_rates(self.device, sizes, 5 if self.cuda else 2)
            # a block of many small tensors (norms, biases, modulation vectors): one stream, a constant op count
            rows += mod.unit_rates(self.device, [1, 16] if self.cuda else [1], 5 if self.cuda else 2, tensors=128)
            # quantized payloads (issue 42's byte code: escapes placed by a running count, no host sync)
            rows += mod.unit_rates(self.device, [16, 64] if self.cuda else [1], 5 if self.cuda else 2,
                                   payload="fp8_e4m3fn")
        except Exception as exc:  # noqa: BLE001 - a row that says why, not a lost run
            return self.skip("compression", "decode vs copy", f"{type(exc).__name__}: {exc}"[:300])
        for r in rows:
            self.add(Row("compression", f"decode {r['unit_mb']} MiB unit of {r['tensors']} {r['payload']} tensor(s)",
                         ms=None,
                         gbps=r["decode_gbps"], equal=r["bitwise"],
                         note=(f"encoded {r['ratio']:.3f} of raw; raw copy {r['raw_copy_gbps']:.1f} GB/s, encoded "
                               f"copy {r['encoded_copy_gbps']:.1f} GB/s (raw bytes), decode "
                               f"{r['decode_vs_raw_copy']:.2f}x the raw copy's speed in {r['decode_ops']} ops")))

    # 2. the CUDA tests ------------------------------------------------------------------------
    def cuda_tests(self) -> None:
        if not self.cuda:
            return self.skip("tests", "pytest -m cuda", "needs a CUDA device (the CUDA tests skip themselves here)")
        if "tests" in self.args.skip:
            return self.skip("tests", "pytest -m cuda", "--skip tests")
        cap = min(self.args.tests_s, max(0.0, self.clock.left() - 240))
        if cap < 20:
            return self.skip("tests", "pytest -m cuda", "time box")
        files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()]
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cap)
            text = proc.stdout + proc.stderr
            status = "ok" if proc.returncode == 0 else "failed"
            summary = next((line for line in reversed(text.splitlines()) if " passed" in line or " failed" in line
                            or " error" in line), text.strip().splitlines()[-1] if text.strip() else "")
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or "") + (exc.stderr or "") if isinstance(exc.stdout, str) else ""
            status, summary = "failed", f"time cap of {cap:.0f} s reached"
        if self.args.out:
            (Path(self.args.out) / "cuda_tests.log").write_text(text[-200_000:])
        self.add(Row("tests", "pytest -m cuda", status=status, reason=summary,
                     ms=(time.monotonic() - started) * 1e3, note=" ".join(Path(f).name for f in files)))

    # 3. the models ----------------------------------------------------------------------------
    def limits(self, factory: ModelFactory, model: Any) -> dict[float, int]:
        """The VRAM limits in bytes: as given at full scale; at the tiny scale, the weights outside the blocks plus
        the share of the blocks the limit holds of the full model's (8 GB holds about 30% of Wan 14B's blocks)."""
        from offload.model.blocks import find_units
        from offload.predict import unit_sizes

        gbs = self.args.limits
        if self.args.scale == "full":
            return {g: int(g * GIB) for g in gbs}
        full_rest, full_blocks = FULL_BYTES[next(k for k, s in SHAPES.items() if s is factory.shape)]
        sizes, rest = unit_sizes(model, find_units(model))
        out = {}
        for g in gbs:
            share = min(1.0, max(0.0, (g * GIB - full_rest) / full_blocks))
            out[g] = rest + max(max(sizes), int(share * sum(sizes)))
        return out

    def model_section(self, key: str) -> None:
        shape = SHAPES[key]
        inputs = ("copy-bound", "compute-bound")
        limits = tuple(self.args.limits)
        if self.out_of_time(60):
            self.skip(shape.name, "every row", "time box", inputs)
            return
        try:
            factory = ModelFactory(shape, self.args.scale)
        except Exception as exc:  # noqa: BLE001 - no model, every row skips with the reason
            reason = f"cannot build the model: {type(exc).__name__}: {exc}"
            self.skip(shape.name, "resident", reason, inputs)
            for preset in PRESET_ROWS:
                self.skip(shape.name, f"layer-offload {preset}", reason, inputs, limits)
            for label in LIBRARY_ROWS:
                self.skip(shape.name, label, reason, inputs)
            return
        state = self.resident(factory, inputs)
        for preset in PRESET_ROWS:
            self.engine(factory, preset, inputs, state)
        self.library_rows(factory, inputs, state)
        del factory
        self.empty()

    def resident(self, factory: ModelFactory, inputs: tuple[str, ...]) -> dict[str, Any]:
        """The baseline: every weight on the device. Keeps each input's output, time, activation peak and the
        measured profile `offload.predict` costs the engine rows from."""
        from offload.predict import profile_model

        name = factory.shape.name
        state: dict[str, Any] = {"ref": {}, "ms": {}, "act": {}, "profile": {}, "inputs": {}}
        model = factory.build()
        state["block_bytes"] = factory.block_bytes(model)
        state["limits"] = self.limits(factory, model)
        if self.sim_gbps is None and not self.cuda:
            self.sim_gbps = self.calibrate_sim(factory, model)
            self.env["sim_gbps"] = self.sim_gbps
        try:
            model.to(self.tdev)
        except Exception as exc:  # noqa: BLE001 - torch.OutOfMemoryError: the model does not fit this GPU
            self.skip(name, "resident", f"does not fit the device: {type(exc).__name__}", inputs)
            model = None
        for inp in inputs:
            args, kwargs, tokens = factory.inputs(model or factory.build(), inp, self.args.scale, self.tdev)
            state["inputs"][inp] = (args, kwargs, tokens)
            if model is None:
                continue
            base = rss()
            ms, out, n = self.time_forwards(lambda: model(*args, **kwargs))
            out = first_tensor(out)
            state["ref"][inp] = out.detach().cpu()
            state["ms"][inp] = ms
            peak = self.peak()
            state["act"][inp] = max(0, (peak or 0) - factory.weight_bytes)
            cfg = self.engine_config("auto", None)
            try:
                state["profile"][inp] = profile_model(model, args, kwargs, cfg, "measure", warmup=1, runs=2)
            except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made leaves the column empty
                log.warning("no prediction profile for %s %s: %s", name, inp, exc)
            self.add(Row(name, "resident", inp, ratio=1.0, ms=ms, peak_vram_bytes=peak,
                         host_ram_bytes=rss() - base, equal=True, max_abs_diff=0.0, limited_by="compute",
                         note=f"{tokens} tokens; {n} timed forward(s); all {factory.weight_bytes / GIB:.2f} GiB on "
                              f"the device"))
        model = None
        self.empty()
        return state

    def calibrate_sim(self, factory: ModelFactory, model: Any) -> float:
        """Simulated bandwidth at which copying the blocks takes half their compute at the compute-bound input (so the
        copy-bound input is copy-bound and the compute-bound one compute-bound)."""
        from offload.model.blocks import find_units
        from offload.demo.measure import calibrate_sim_gbps_model

        args, kwargs, _ = factory.inputs(model, "compute-bound", self.args.scale, self.tdev)
        blocks = [u.module for u in find_units(model)]

        class Call(__import__("torch").nn.Module):
            def forward(self, *a: Any) -> Any:
                return model(*args, **kwargs)

        gbps, _ = calibrate_sim_gbps_model(Call(), (), blocks, copy_to_compute=0.5, forwards=3)
        return gbps

    def engine_config(self, preset: str, limit: int | None) -> Any:
        from offload import OffloadConfig

        if self.cuda:
            return OffloadConfig.from_preset(preset, device=self.device)
        capacity = max(8 * GIB, 4 * (limit or 0))
        return OffloadConfig.from_preset(preset, device="sim", sim_bandwidth_gbps=self.sim_gbps,
                                         sim_capacity_bytes=capacity)

    def preset_limits(self, preset: str) -> list[float]:
        """The limits a preset runs at: every one for auto and budget (and everywhere with --all-limits or on the
        simulated device); the middle one for the other presets on CUDA, where the 8 minutes do not hold them all."""
        limits = list(self.args.limits)
        if preset in ("auto", "budget") or self.args.all_limits or not self.cuda:
            return limits
        return [limits[len(limits) // 2]]

    def gguf_limits(self) -> list[float]:
        """The GGUF rows' limits: the middle one on CUDA (quantizing 14B weights takes its own time), else all."""
        limits = list(self.args.limits)
        return limits if self.args.all_limits or not self.cuda else [limits[len(limits) // 2]]

    def weight_budget(self, limit: int, act: int) -> int:
        """The engine's budget for weights under a VRAM limit: the limit less the input's activation peak (measured
        in the resident run) and some room for the CUDA context and the allocator."""
        if not self.cuda:
            return limit
        return max(64 * MIB, limit - act - 768 * MIB)

    def engine(self, factory: ModelFactory, preset: str, inputs: tuple[str, ...], state: dict[str, Any]) -> None:
        """One staging per preset; every VRAM limit and input is a re-plan of the same handle (budget.set_total)."""
        from offload import VramBudget, offload_module
        from offload.predict import predict_profile

        name, label = factory.shape.name, f"layer-offload {preset}"
        limits = state["limits"]
        if f"engine-{preset}" in self.args.skip or "engine" in self.args.skip:
            return self.skip(name, label, "--skip", inputs, tuple(limits))
        if self.out_of_time(30):
            return self.skip(name, label, "time box", inputs, tuple(limits))
        biggest = max(limits.values())
        model = factory.build()
        base = rss()
        cfg = self.engine_config(preset, biggest)
        budget = VramBudget(self.weight_budget(biggest, 0))
        try:
            handle = offload_module(model, cfg, name=f"{name} {preset}", budget=budget)
        except Exception as exc:  # noqa: BLE001
            model = None
            self.empty()
            return self.skip(name, label, f"offload_module failed: {type(exc).__name__}: {exc}", inputs,
                             tuple(limits))
        try:
            for gb, limit in limits.items():
                for inp in inputs:
                    if gb not in self.preset_limits(preset):
                        self.add(Row(name, label, inp, gb, status="skipped", reason=(
                            f"on CUDA {preset} runs at {', '.join(f'{g:g}' for g in self.preset_limits(preset))} GB "
                            f"only, to fit the 8 minutes (--all-limits runs every limit)")))
                        continue
                    if self.out_of_time(10):
                        self.add(Row(name, label, inp, gb, status="skipped", reason="time box"))
                        continue
                    self.engine_row(factory, handle, budget, preset, label, gb, limit, inp, state, base,
                                    predict_profile)
        finally:
            handle.detach()
            del handle, model  # before the next preset stages its own copy
            self.empty()

    def engine_row(self, factory: ModelFactory, handle: Any, budget: Any, preset: str, label: str, gb: float,
                   limit: int, inp: str, state: dict[str, Any], base: int, predict_profile: Callable) -> None:
        from offload.budget import BudgetError

        name = factory.shape.name
        model = handle.model
        args, kwargs, tokens = state["inputs"][inp]
        total = self.weight_budget(limit, state["act"].get(inp, 0))
        try:
            budget.set_total(total)
        except (BudgetError, ValueError) as exc:
            self.add(Row(name, label, inp, gb, status="skipped", reason=f"does not fit: {exc}"[:300]))
            return
        try:
            ms, out, n = self.time_forwards(lambda: model(*args, **kwargs), after_warmup=handle.reset_stats)
        except Exception as exc:  # noqa: BLE001 - an engine failure is a row's finding, not the end of the run
            self.add(Row(name, label, inp, gb, status="error", reason=f"{type(exc).__name__}: {exc}"[:300]))
            return
        rep = handle.report()
        fwd = max(1, rep.forwards)
        stall, copy = rep.stall_ms / fwd, rep.h2d_ms / fwd
        out = first_tensor(out)
        ref = state["ref"].get(inp)
        row = Row(name, label, inp, gb, ms=ms, peak_vram_bytes=self.peak() or rep.peak_device_bytes,
                  host_ram_bytes=handle.host_memory()["ram"], stall_ms=stall, copy_ms=copy,
                  gbps=rep.effective_gbps or None,
                  note=f"{rep.tiers['vram']} resident / {len(rep.blocks) - rep.tiers['vram']} streamed, "
                       f"{rep.slots} slot(s); budget {total / GIB:.2f} GiB for weights; {n} timed")
        if ref is not None:
            row.equal = bool(out.dtype == ref.dtype and out.shape == ref.shape and
                             __import__("torch").equal(out.detach().cpu(), ref))
            row.max_abs_diff = max_abs_diff(out, ref)
        if state["ms"].get(inp):
            row.ratio = ms / state["ms"][inp]
        row.limited_by = limited_by(ms, stall, copy, row.ratio)
        profile = state["profile"].get(inp)
        if profile is not None:
            try:
                row.predicted_ms = predict_profile(profile, self.engine_config(preset, limit), budget=total).step_ms
            except Exception as exc:  # noqa: BLE001
                row.note += f"; no prediction ({type(exc).__name__})"
        self.add(row)

    def library_rows(self, factory: ModelFactory, inputs: tuple[str, ...], state: dict[str, Any]) -> None:
        name = factory.shape.name
        if not self.cuda:
            for label in LIBRARY_ROWS:
                self.skip(name, label, "needs a CUDA device (their copy streams and execution device)", inputs)
            return
        for label in LIBRARY_ROWS:
            key = label.split()[0]
            if key in self.args.skip:
                self.skip(name, label, "--skip", inputs)
                continue
            if self.out_of_time(30):
                self.skip(name, label, "time box", inputs)
                continue
            try:
                if key == "diffusers":
                    from diffusers.hooks import apply_group_offloading
                else:
                    from accelerate import cpu_offload
            except ImportError as exc:
                self.skip(name, label, f"{key} not importable ({exc}); benchmarks/gpu_carry.sh carries it", inputs)
                continue
            model = factory.build()
            base = rss()
            try:
                if label.startswith("diffusers block"):
                    apply_group_offloading(model, onload_device=self.tdev, offload_device=__import__("torch").device(
                        "cpu"), offload_type="block_level", num_blocks_per_group=1, use_stream=True)
                elif label.startswith("diffusers leaf"):
                    apply_group_offloading(model, onload_device=self.tdev, offload_device=__import__("torch").device(
                        "cpu"), offload_type="leaf_level", use_stream=True)
                else:
                    cpu_offload(model, execution_device=self.tdev)
            except Exception as exc:  # noqa: BLE001
                self.skip(name, label, f"setup failed: {type(exc).__name__}: {exc}"[:300], inputs)
                del model
                self.empty()
                continue
            for inp in inputs:
                if self.out_of_time(10):
                    self.add(Row(name, label, inp, status="skipped", reason="time box"))
                    continue
                args, kwargs, tokens = state["inputs"][inp]
                try:
                    ms, out, n = self.time_forwards(lambda: model(*args, **kwargs))
                except Exception as exc:  # noqa: BLE001
                    self.add(Row(name, label, inp, status="error", reason=f"{type(exc).__name__}: {exc}"[:300]))
                    continue
                out = first_tensor(out)
                ref = state["ref"].get(inp)
                row = Row(name, label, inp, ms=ms, peak_vram_bytes=self.peak(), host_ram_bytes=rss() - base,
                          note=f"no VRAM limit: its own footprint; {n} timed")
                if ref is not None:
                    row.equal = bool(__import__("torch").equal(out.detach().cpu(), ref))
                    row.max_abs_diff = max_abs_diff(out, ref)
                if state["ms"].get(inp):
                    row.ratio = ms / state["ms"][inp]
                # every block crosses the bus once a forward: the copy time that takes at the measured pinned speed
                pinned = self.env.get("pinned_gbps") or 0
                copy = state["block_bytes"] / (pinned * 1e6) if pinned else None
                row.copy_ms = copy
                row.limited_by = limited_by(ms, None, copy, row.ratio)
                self.add(row)
            model = None
            self.empty()

    # 4. ComfyUI (a child process) --------------------------------------------------------------
    def comfy_section(self, key: str) -> None:
        shape = SHAPES[key]
        inputs = ("copy-bound", "compute-bound")
        limits = tuple(self.args.limits)

        def skip_all(reason: str) -> None:
            self.skip(shape.name, COMFY_ROWS[0], reason, inputs)
            self.skip(shape.name, COMFY_ROWS[1], reason, inputs, limits)
            self.skip(shape.name, COMFY_ROWS[2], reason, inputs, limits)

        if "comfy" in self.args.skip:
            return skip_all("--skip comfy")
        path = self.args.comfyui or os.environ.get("COMFYUI_PATH")
        if not path or not (Path(path) / "comfy" / "model_management.py").exists():
            return skip_all("no ComfyUI checkout: --comfyui PATH or COMFYUI_PATH (benchmarks/gpu_carry.sh carries one)")
        if not self.cuda and not self.args.comfy_on_cpu:
            return skip_all("ComfyUI streams only to a CUDA device (under --cpu it keeps every weight on the CPU)")
        if self.out_of_time(60):
            return skip_all("time box")
        out = Path(self.args.out or ".") / f"comfy_{key}.json"
        cmd = [self.args.comfy_python or sys.executable, str(Path(__file__).resolve()), "--comfy-worker", key,
               "--device", self.device, "--scale", self.args.scale, "--comfyui", str(path), "--worker-out", str(out),
               "--limits", ",".join(f"{g:g}" for g in limits), "--iters", str(self.args.iters),
               "--warmup", str(self.args.warmup), "--row-s", str(self.args.row_s),
               "--deadline-s", str(max(30.0, min(self.clock.left(), self.section_end - time.monotonic()) - 10)),
               "--gguf-limits", ",".join(f"{g:g}" for g in self.gguf_limits())]
        if self.args.gguf_pack:
            cmd += ["--gguf-pack", self.args.gguf_pack]
        if self.args.comfy_on_cpu:
            cmd.append("--comfy-on-cpu")
        env = dict(os.environ, BENCH_GPU_PINNED_GBPS=str(self.env.get("pinned_gbps") or ""))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                                  timeout=max(30, self.clock.left() + 5))
        except subprocess.TimeoutExpired:
            return skip_all("the ComfyUI worker ran past the deadline")
        if out.exists():
            for d in json.loads(out.read_text()):
                self.add(Row(**d))
            out.unlink()
        else:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
            skip_all(f"the ComfyUI worker failed (exit {proc.returncode}): {' / '.join(tail)}"[:400])

    # outputs -----------------------------------------------------------------------------------
    def write(self) -> tuple[str, str]:
        data = {"env": self.env, "seconds": self.clock.elapsed(), "rows": [asdict(r) for r in self.rows]}
        text = json.dumps(data, indent=1, default=str)
        table = markdown(self.rows, self.env)
        if self.args.out:
            out = Path(self.args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_gpu.json").write_text(text)
            (out / "bench_gpu.md").write_text(table)
        return text, table


def _fmt(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "gib":
        return f"{value / GIB:.2f}"
    if kind == "bool":
        return "yes" if value else "NO"
    if kind == "diff":
        return f"{value:.3g}"
    if kind == "gbps":
        return f"{value:.1f}"
    return str(value)


def markdown(rows: list[Row], env: dict[str, Any]) -> str:
    """The results as markdown: what ran where, then one table per section."""
    head = (f"bench_gpu on {env.get('gpu') or env.get('device')} ({env.get('date')}), torch {env.get('torch')}, "
            f"Python {env.get('python')}, scale {env.get('scale')}; diffusers {env.get('diffusers')}, accelerate "
            f"{env.get('accelerate')}, gguf {env.get('gguf')}; pinned {_fmt(env.get('pinned_gbps'), 'gbps')} GB/s, "
            f"pageable {_fmt(env.get('pageable_gbps'), 'gbps')} GB/s"
            + (f"; simulated bandwidth {env['sim_gbps']:.3f} GB/s" if env.get("sim_gbps") else ""))
    cols = [("config", "config", ""), ("input", "input", ""), ("limit GB", "limit_gb", ""), ("ms", "ms", "ms"),
            ("vs resident", "ratio", "x"), ("predicted ms", "predicted_ms", "ms"),
            ("peak VRAM GiB", "peak_vram_bytes", "gib"), ("host RAM GiB", "host_ram_bytes", "gib"),
            ("stall ms", "stall_ms", "ms"), ("copy ms", "copy_ms", "ms"), ("GB/s", "gbps", "gbps"),
            ("limited by", "limited_by", ""), ("equal", "equal", "bool"), ("max abs diff", "max_abs_diff", "diff"),
            ("status", "status", ""), ("note", "note", "")]
    parts = [head, ""]
    for section in dict.fromkeys(r.section for r in rows):
        sub = [r for r in rows if r.section == section]
        parts += [f"### {section}", "", "| " + " | ".join(c[0] for c in cols) + " |",
                  "|" + "|".join("---" for _ in cols) + "|"]
        for r in sub:
            cells = []
            for _, attr, kind in cols:
                value = getattr(r, attr)
                if attr == "status" and r.reason:
                    value = f"{r.status}: {r.reason}"
                cells.append(_fmt(value, kind).replace("|", "/") if value not in ("", None) else "-")
            parts.append("| " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ the ComfyUI worker
def comfy_seed_keys(key: str, config: dict) -> dict[str, tuple]:
    """The tensor names and shapes ComfyUI's model detection reads (comfy/model_detection.py), for the shapes of
    `config` (a diffusers config of SHAPES): ComfyUI builds the full key set of its own model from them."""
    if key == "wan":
        dim = config["num_attention_heads"] * config["attention_head_dim"]
        s = {"head.modulation": (1, 2, dim), "head.head.weight": (config["out_channels"] * 4, dim),
             "patch_embedding.weight": (dim, config["in_channels"], 1, 2, 2),
             "blocks.0.ffn.0.weight": (config["ffn_dim"], dim)}
        for i in range(config["num_layers"]):
            s[f"blocks.{i}.self_attn.q.weight"] = (dim, dim)
        return s
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    s = {"img_in.weight": (hidden, config["in_channels"]), "txt_in.weight": (hidden, config["joint_attention_dim"]),
         "vector_in.in_layer.weight": (hidden, config["pooled_projection_dim"]),
         "guidance_in.in_layer.weight": (hidden, 256)}
    for i in range(config["num_layers"]):
        s[f"double_blocks.{i}.img_attn.norm.key_norm.scale"] = (config["attention_head_dim"],)
    for i in range(config["num_single_layers"]):
        s[f"single_blocks.{i}.linear1.weight"] = (7 * hidden, hidden)
    return s


def q8_0(t: Any, device: Any) -> Any:
    """GGML Q8_0 bytes of a 2-D weight whose rows are whole 32-value blocks: per block an fp16 scale (max |x| / 127)
    and 32 int8 values, 34 bytes (computed on `device`, returned on the CPU)."""
    import torch

    x = t.to(device).float().reshape(-1, 32)
    d = x.abs().amax(1, keepdim=True) / 127.0
    q = torch.where(d > 0, x / d.clamp_min(1e-30), torch.zeros_like(x)).round().clamp(-127, 127).to(torch.int8)
    raw = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], 1)
    return raw.reshape(t.shape[0], -1).cpu()


def comfy_worker(args: argparse.Namespace) -> int:
    """Run in a child process: ComfyUI's own model of the same shapes through its ModelPatcher (DynamicVRAM where
    comfy-aimdo imports and starts, lowvram otherwise), resident and at each VRAM limit, and a GGUF Q8_0 copy through
    ComfyUI-GGUF's ops. Writes its rows as JSON to --worker-out."""
    key, shape = args.comfy_worker, SHAPES[args.comfy_worker]
    config = shape.full if args.scale == "full" else shape.tiny
    clock = Clock(args.deadline_s, args.row_s)
    rows: list[Row] = []
    cuda = args.device.startswith("cuda")
    sys.path.insert(0, str(Path(args.comfyui).resolve()))
    mode, why = "lowvram", ""
    aimdo = None
    if cuda:  # DynamicVRAM starts before anything touches CUDA, as ComfyUI's main.py starts it
        try:
            import comfy_aimdo.control as aimdo

            try:
                aimdo.init()
            except TypeError:
                aimdo.init(simple_vram_headroom=None)
        except Exception as exc:  # noqa: BLE001 - no DynamicVRAM: ComfyUI's lowvram path
            aimdo, why = None, f"comfy-aimdo: {type(exc).__name__}: {exc}"
    import torch
    from comfy.cli_args import args as comfy_args

    if not cuda:
        comfy_args.cpu = True
    import comfy.memory_management
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    if aimdo is not None:
        try:
            try:
                ok = aimdo.init_devices((d.index, 0) for d in mm.get_all_torch_devices())
            except TypeError:
                ok = aimdo.init_devices(d.index for d in mm.get_all_torch_devices())
        except Exception as exc:  # noqa: BLE001
            ok, why = False, f"comfy-aimdo init_devices: {type(exc).__name__}: {exc}"
        if ok:
            comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
            comfy.memory_management.aimdo_enabled = True
            mode = "DynamicVRAM"
        elif not why:
            why = "comfy-aimdo found no device it supports"
    if not cuda:
        mode, why = "cpu", "--comfy-on-cpu: every weight stays on the CPU"
    dev = mm.get_torch_device()
    name = shape.name

    def add(row: Row) -> None:
        rows.append(row)
        print(f"[comfy {clock.elapsed():6.1f}s] {row.config} | {row.input} | {row.limit_gb} | "
              f"{row.ms if row.ms is None else round(row.ms, 1)} {row.reason}", file=sys.stderr, flush=True)

    # ComfyUI's own model of these shapes: its detection on the key names, its class on the meta device for the
    # full key set, random bf16 weights made once from the same pool as the parent's
    dtype = torch.bfloat16 if args.scale == "full" else torch.float32  # as the parent's rows
    if not cuda:
        torch.set_num_threads(1)
    seed = {k: torch.empty(v, device="meta", dtype=dtype) for k, v in comfy_seed_keys(key, config).items()}
    unet_config = comfy.model_detection.detect_unet_config(seed, "")
    model_config = comfy.model_detection.model_config_from_unet_config(unet_config, seed)
    model_config.set_inference_dtype(dtype, None)
    template = model_config.get_model({}, "", device="meta").diffusion_model.state_dict()
    pool = random_pool()
    base_rss = rss()
    master = {k: fill_from_pool(tuple(v.shape), dtype if v.is_floating_point() else v.dtype, pool, i * 7919,
                                v.dim() == 1 and "norm" in k)
              for i, (k, v) in enumerate(template.items())}
    weight_bytes = sum(t.numel() * t.element_size() for t in master.values())
    del template, seed

    def inputs(which: str) -> tuple[Any, dict]:
        frames, h, w = (shape.inputs if args.scale == "full" else shape.tiny_inputs)[which]
        g = torch.Generator().manual_seed(1)
        if key == "wan":
            x = torch.randn(1, 16, (frames - 1) // 4 + 1, h // 8, w // 8, generator=g)
            kw = {"c_crossattn": torch.randn(1, 512, 4096, generator=g)}
        else:
            x = torch.randn(1, 16, h // 8, w // 8, generator=g)
            kw = {"c_crossattn": torch.randn(1, 512, config["joint_attention_dim"], generator=g),
                  "y": torch.randn(1, config["pooled_projection_dim"], generator=g),
                  "guidance": torch.full((1,), 3.5)}
        return x.to(dev), {k: v.to(dev) for k, v in kw.items()}

    def timed(patcher: Any, x: Any, kw: dict) -> tuple[float, Any, int]:
        sigma = torch.full((x.shape[0],), 0.5, device=dev)
        times: list[float] = []
        out = None
        started = time.monotonic()
        with torch.inference_mode():
            for i in range(args.warmup + max(1, args.iters)):
                if i == args.warmup and cuda:
                    torch.cuda.synchronize(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                out = patcher.model.apply_model(x, sigma, **kw)
                if cuda:
                    torch.cuda.synchronize(dev)
                if i >= args.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
                    if time.monotonic() - started > clock.row_s:
                        break
        return statistics.median(times), out.detach().float().cpu(), len(times)

    def peak() -> int | None:
        return int(torch.cuda.max_memory_allocated(dev)) if cuda else None

    inputs_list = ("copy-bound", "compute-bound")
    total_vram = mm.get_total_memory(dev) if cuda else 0
    ref: dict[str, Any] = {}
    res_ms: dict[str, float] = {}
    act: dict[str, int] = {}
    pinned = float(os.environ.get("BENCH_GPU_PINNED_GBPS", "0") or 0)

    def load(sd: dict, options: dict) -> Any:
        return comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options=options)

    def run_limits(label: str, patcher: Any, model_bytes: int, note: str, exact: bool,
                   only: list[float] | None = None) -> None:
        for gb in args.limits:
            if only is not None and gb not in only:
                for inp in inputs_list:
                    add(Row(name, label, inp, gb, status="skipped", reason=(
                        f"runs at {', '.join(f'{g:g}' for g in only)} GB only on CUDA, to fit the 8 minutes "
                        f"(--all-limits runs every limit)")))
                continue
            limit = int(gb * GIB) if args.scale == "full" else None
            for inp in inputs_list:
                if clock.left() < 10:
                    add(Row(name, label, inp, gb, status="skipped", reason="time box"))
                    continue
                mm.unload_all_models()
                mm.soft_empty_cache()
                if limit is not None and cuda:
                    mm.EXTRA_RESERVED_VRAM = max(0, int(total_vram - limit))
                x, kw = inputs(inp)
                try:
                    mm.load_models_gpu([patcher], memory_required=act.get(inp, 0))
                    ms, out, n = timed(patcher, x, kw)
                except Exception as exc:  # noqa: BLE001
                    add(Row(name, label, inp, gb, status="error", reason=f"{type(exc).__name__}: {exc}"[:300]))
                    continue
                loaded = int(patcher.loaded_size()) if hasattr(patcher, "loaded_size") else 0
                streamed = max(0, model_bytes - loaded)
                copy = streamed / (pinned * 1e6) if pinned else None
                row = Row(name, label, inp, gb, ms=ms, peak_vram_bytes=peak(), host_ram_bytes=rss() - base_rss,
                          copy_ms=copy, note=f"{mode}; {loaded / GIB:.2f} GiB loaded on the device; {note}; "
                                             f"{n} timed" + (f" ({why})" if why and mode != "DynamicVRAM" else ""))
                if inp in ref:
                    row.max_abs_diff = max_abs_diff(out, ref[inp])
                    row.equal = bool(torch.equal(out, ref[inp])) if exact else None
                if res_ms.get(inp):
                    row.ratio = ms / res_ms[inp]
                row.limited_by = limited_by(ms, None, copy, row.ratio)
                add(row)
        mm.EXTRA_RESERVED_VRAM = 0

    try:
        patcher = load(master, {})
    except Exception as exc:  # noqa: BLE001
        for label in COMFY_ROWS:
            add(Row(name, label, status="error", reason=f"ComfyUI could not load the model: {type(exc).__name__}: "
                                                        f"{exc}"[:300]))
        Path(args.worker_out).write_text(json.dumps([asdict(r) for r in rows]))
        return 0
    # resident: every weight loaded, no reserve beyond ComfyUI's own
    for inp in inputs_list:
        x, kw = inputs(inp)
        try:
            mm.load_models_gpu([patcher], force_full_load=True)
            ms, out, n = timed(patcher, x, kw)
        except Exception as exc:  # noqa: BLE001
            add(Row(name, COMFY_ROWS[0], inp, status="error", reason=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        ref[inp], res_ms[inp] = out, ms
        p = peak()
        act[inp] = max(0, (p or 0) - weight_bytes)
        add(Row(name, COMFY_ROWS[0], inp, ms=ms, ratio=1.0, peak_vram_bytes=p, host_ram_bytes=rss() - base_rss,
                equal=True,
                max_abs_diff=0.0, limited_by="compute",
                note=f"ComfyUI's {type(patcher.model.diffusion_model).__name__} through {type(patcher).__name__}; "
                     f"{weight_bytes / GIB:.2f} GiB; {n} timed"))
    run_limits(COMFY_ROWS[1], patcher, weight_bytes, type(patcher).__name__, exact=True)
    mm.unload_all_models()
    del patcher
    gc.collect()
    mm.soft_empty_cache()
    # GGUF Q8_0 through city96's ops
    label = COMFY_ROWS[2]
    pack = args.gguf_pack
    if not pack or not (Path(pack) / "ops.py").exists():
        for inp in inputs_list:
            for gb in args.limits:
                add(Row(name, label, inp, gb, status="skipped", reason="no ComfyUI-GGUF pack: --gguf-pack PATH or "
                                                                       "GGUF_PACK (benchmarks/gpu_carry.sh carries it)"))
    elif clock.left() < 60:
        for inp in inputs_list:
            for gb in args.limits:
                add(Row(name, label, inp, gb, status="skipped", reason="time box"))
    else:
        try:
            import importlib
            import importlib.util

            import gguf

            try:
                importlib.import_module("nodes")  # ComfyUI's node module, which the pack's nodes.py imports
            except ImportError as exc:  # its video types need PyAV, which the GPU machine lacks: the pack uses
                import types  # `nodes` only for its CLIP loader's inputs, never on the path measured here

                log.info("ComfyUI's nodes module does not import (%s): the GGUF pack gets a stand-in", exc)
                sys.modules["nodes"] = types.ModuleType("nodes")
            spec = importlib.util.spec_from_file_location("comfyui_gguf", str(Path(pack) / "__init__.py"),
                                                          submodule_search_locations=[str(pack)])
            module = importlib.util.module_from_spec(spec)
            sys.modules["comfyui_gguf"] = module
            spec.loader.exec_module(module)
            ops = importlib.import_module("comfyui_gguf.ops")
            nodes = importlib.import_module("comfyui_gguf.nodes")
            qdev = dev if cuda else torch.device("cpu")
            quant = {}
            for k, t in master.items():
                if t.dim() == 2 and t.shape[1] % 32 == 0 and t.numel() >= 4096:
                    quant[k] = ops.GGMLTensor(q8_0(t, qdev), tensor_type=gguf.GGMLQuantizationType.Q8_0,
                                              tensor_shape=t.shape)
                else:
                    quant[k] = t
            del master
            qbytes = sum(t.numel() * t.element_size() for t in quant.values())
            ops.GGMLOps.Linear.dequant_dtype = None
            ops.GGMLOps.Linear.patch_dtype = None
            gpatcher = nodes.GGUFModelPatcher.clone(load(quant, {"custom_operations": ops.GGMLOps}))
            run_limits(label, gpatcher, qbytes, f"Q8_0, {qbytes / GIB:.2f} GiB", exact=False, only=args.gguf_limits)
        except Exception as exc:  # noqa: BLE001
            for inp in inputs_list:
                add(Row(name, label, inp, status="error", reason=f"{type(exc).__name__}: {exc}"[:300]))
    Path(args.worker_out).write_text(json.dumps([asdict(r) for r in rows]))
    return 0


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda when there is one, else sim), cuda, cuda:N, sim")
    p.add_argument("--scale", choices=("full", "tiny"), default=None, help="full shapes (default on CUDA) or tiny ones "
                                                                          "(default on sim)")
    p.add_argument("--models", default="wan,flux", help="comma-separated: wan, flux")
    p.add_argument("--limits", default="8,12,16", help="VRAM limits in GB (scaled to the model on --scale tiny)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for bench_gpu.json / .md (default $OUT)")
    p.add_argument("--iters", type=int, default=2, help="timed forwards per row (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards per row")
    p.add_argument("--deadline-s", type=float, default=450.0, help="start no row after this many seconds")
    p.add_argument("--row-s", type=float, default=40.0, help="a row's timed forwards stop after this many seconds")
    p.add_argument("--tests-s", type=float, default=90.0, help="time cap of the CUDA tests")
    p.add_argument("--sim-gbps", type=float, default=None, help="simulated bandwidth (default: calibrated)")
    p.add_argument("--skip", default="", help="comma-separated: tests, compression, engine, diffusers, accelerate, comfy, gguf")
    p.add_argument("--comfyui", default=None, help="a ComfyUI checkout (default $COMFYUI_PATH)")
    p.add_argument("--comfy-python", default=None, help="the Python for the ComfyUI worker (default this one)")
    p.add_argument("--gguf-pack", default=os.environ.get("GGUF_PACK"), help="a ComfyUI-GGUF checkout ($GGUF_PACK)")
    p.add_argument("--comfy-on-cpu", action="store_true", help="run the ComfyUI rows on the CPU (a check of the code "
                                                                "path; nothing streams)")
    p.add_argument("--all-limits", action="store_true", help="on CUDA, run consumer / mid_range and GGUF at every "
                                                              "limit too (longer than 8 minutes)")
    p.add_argument("--gguf-limits", default=None, help=argparse.SUPPRESS)
    p.add_argument("--comfy-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.limits = [float(x) for x in str(args.limits).split(",") if x.strip()]
    args.gguf_limits = ([float(x) for x in args.gguf_limits.split(",") if x.strip()] if args.gguf_limits
                        else list(args.limits))
    return args


def resolve(args: argparse.Namespace) -> None:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "sim"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch has no usable CUDA device; use --device sim")
    if args.scale is None:
        args.scale = "full" if args.device.startswith("cuda") else "tiny"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    resolve(args)
    if args.comfy_worker:
        return comfy_worker(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.device.startswith("cuda"):
        import torch

        torch.set_num_threads(1)  # the simulated device computes on the CPU; more threads only contend there
    bench = Bench(args)
    bench.environment()
    bench.bandwidth()
    bench.cuda_tests()
    bench.compression()
    keys = [m.strip() for m in args.models.split(",") if m.strip()]
    for key in keys:
        if key not in SHAPES:
            raise SystemExit(f"--models: unknown model {key!r}; valid: {', '.join(SHAPES)}")
    for i, key in enumerate(keys):  # each model gets its share of what is left: 60% its own rows, then ComfyUI's
        start, share = time.monotonic(), bench.clock.left() / (len(keys) - i)
        bench.section_end = start + 0.6 * share
        bench.model_section(key)
        last = i == len(keys) - 1
        bench.section_end = bench.clock.deadline if last else max(start + share, time.monotonic() + 30.0)
        bench.comfy_section(key)
        bench.section_end = bench.clock.deadline
    _, table = bench.write()
    print(table)
    bad = [r for r in bench.rows if r.config.startswith("layer-offload") and r.status == "ok" and r.equal is False]
    if bad:
        print(f"FAIL: {len(bad)} layer-offload row(s) differ from the resident output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
