"""`offload.predict`: where every block would live and how long a step would take, before anything is staged.

Two ways to cost a model's blocks:

- `card="measure"`: each block's compute is timed on the model's own device (forward hooks and the backend's
  events, after warm-up runs; a model on the host while the device is a GPU is timed through the engine with every
  block streamed), and the copy speed is the backend's (`Backend.h2d_gbps`: the simulated device's bandwidth, or
  the pinned host-to-device speed measured on CUDA). On the simulated device, whose compute and copy thread share
  the host's CPUs, the blocks are also timed while copies run beside them and the engine's own CPU cost per
  forward is measured (`engine_cpu_ms`): both add to a step there.
- a named card (`offload.cards.CARDS`) or an `offload.Card`: the forward runs on the meta device (a model with real
  weights is viewed on the meta device for the run and given back untouched), so nothing is allocated. FLOPs per
  block come from `torch.utils.flop_counter.FlopCounterMode`; each op is as slow as its FLOPs (matmuls, through the
  flop counter's formulas) or the bytes it moves make it on the card; attention is costed as a fused kernel (its
  FLOPs, not the score matrices the meta device's math fallback would build); the peak of live activations is
  tracked for the fit.

Block sizes come from the engine's own layout (`layout.plan_layout`: aligned bytes as they move), the plan from the
engine's own planner (`_engine_plan`, the one seam to `planner.make_plan`) and the stalls from its ring simulation
(`ring_sim.simulate_pass`, the compute outside the blocks as the gap between passes).
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .backends import get_backend
from .backward import trainable_in_blocks
from .blocks import Unit, find_units
from .budget import VramBudget
from .cards import ATTENTION_EFFICIENCY, MATMUL_EFFICIENCY, MEMORY_EFFICIENCY, Card, get_card
from .config import OffloadConfig
from .layout import plan_layout, unit_tensors
from .plan_host import host_ram_bytes
from .planner import (MIB, HostFacts, Plan, PlanError, PlanFacts, RamCeilingError, default_reserve, estimate_reserve,
                      read_host_memory, settled_plan, want_bytes)
from .reserve import reserve_from_peak
from .ring_sim import UnitCosts, simulate_pass
from .staging import shared_tensor_ids

log = logging.getLogger(__name__)

CONTEXT_BYTES = 512 * MIB  # a named card's memory taken before any model: CUDA context, cuBLAS workspace, display
DEFAULT_DISK_GBPS = 2.0  # sequential read of a consumer NVMe drive (GB/s), for blocks on the disk tier
MAX_HOOK_UNITS = 256  # above this many units the engine's CPU cost is measured on this many and scaled
_hook_ms_cache: dict[int, dict[str, float]] = {}


@dataclass
class BlockPrediction:
    """One unit: where it would live, and its copy, compute and stall milliseconds per forward."""

    name: str
    tier: str  # vram (resident) | pinned | pageable | disk
    bytes: int
    copy_ms: float  # one copy to the device (what streaming it costs the copy engine)
    compute_ms: float
    stall_ms: float  # the compute stream's wait for its copy in a steady-state forward (0 when resident)
    flops: float | None = None  # named card: FLOPs of one call (None when measured)
    placement: str = ""  # the planner's reason

    @property
    def limited_by(self) -> str:
        """copy when its copy shows (a stall), else compute."""
        return "copy" if self.stall_ms > 0.01 * max(self.compute_ms, 1e-9) and self.stall_ms > 1e-3 else "compute"


@dataclass
class Prediction:
    """The engine's plan for a model on a card and its predicted step time, made without running the engine."""

    step_ms: float  # one offloaded forward (inf when nothing fits)
    resident_step_ms: float  # the same forward with every weight on the device
    device_bytes: int  # what the engine would hold on the device: non-block weights, resident blocks, slot ring
    host_bytes: int  # host RAM: block masters (pinned or pageable), non-block weights, bounce buffers
    disk_bytes: int  # blocks left on the disk tier
    fits: bool
    blocks: list[BlockPrediction]
    card: dict[str, Any] = field(default_factory=dict)  # the card's figures (measured ones for "measure")
    preset: str | None = None
    activation_bytes: int = 0  # peak activations on the device (estimated on the meta device, or measured)
    allowance_bytes: int = 0  # device bytes the budget gives the model
    slots: int = 0
    slot_bytes: int = 0
    rest_compute_ms: float = 0.0  # compute outside the blocks (embeddings, heads)
    notes: list[str] = field(default_factory=list)

    @property
    def slowdown(self) -> float:
        """step_ms over resident_step_ms (1.0: streaming costs nothing)."""
        return self.step_ms / self.resident_step_ms if self.resident_step_ms > 0 else math.inf

    @property
    def stall_ms(self) -> float:
        return sum(b.stall_ms for b in self.blocks)

    @property
    def limiting_block(self) -> BlockPrediction | None:
        """The block whose copy stalls most; without stalls the slowest block to compute."""
        if not self.blocks:
            return None
        stalled = max(self.blocks, key=lambda b: b.stall_ms)
        return stalled if stalled.stall_ms > 0 else max(self.blocks, key=lambda b: b.compute_ms)

    @property
    def limited_by(self) -> str:
        """What sets the step time: copy (stalls are more than 5% of it), compute, or nothing fits (none)."""
        if not self.fits or not math.isfinite(self.step_ms):
            return "none"
        return "copy" if self.stall_ms > 0.05 * self.step_ms else "compute"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (strict: an infinite step time is null)."""
        d = asdict(self)
        for key in ("step_ms", "resident_step_ms"):
            if not math.isfinite(d[key]):
                d[key] = None
        slowdown = self.slowdown
        d["slowdown"] = slowdown if math.isfinite(slowdown) else None
        d["stall_ms"] = self.stall_ms
        d["limited_by"] = self.limited_by
        block = self.limiting_block
        d["limiting_block"] = block.name if block is not None else None
        for b, src in zip(d["blocks"], self.blocks):
            b["limited_by"] = src.limited_by
        return d

    def summary(self) -> str:
        """One readable line."""
        gib = 1 << 30
        if not math.isfinite(self.step_ms):
            return f"does not fit: {'; '.join(self.notes) or 'no plan'}"
        block = self.limiting_block
        return (f"{'fits' if self.fits else 'does NOT fit'}: {self.step_ms:.1f} ms/step "
                f"({self.slowdown:.2f}x resident {self.resident_step_ms:.1f} ms), device {self.device_bytes / gib:.2f} "
                f"GiB + {self.activation_bytes / gib:.2f} GiB activations, host RAM {self.host_bytes / gib:.2f} GiB, "
                f"disk {self.disk_bytes / gib:.2f} GiB; limited by {self.limited_by}"
                + (f" ({block.name})" if block is not None else ""))


@dataclass
class Profile:
    """What a plan is costed from, made once per model and card (`profile_model`) and used for any number of configs
    and budgets (`predict_profile`): unit names and sizes, per-unit compute, the rest of the forward, copy speeds,
    device memory and the activation peak."""

    compute_ms: list[float]
    rest_ms: float
    pinned_gbps: float
    pageable_gbps: float
    latency_ms: float
    device_total: int
    device_free: int
    activation_bytes: int
    card: dict[str, Any]
    flops: list[float] | None = None
    # the engine's CPU time per forward with every unit resident / streamed (hooks, pass bookkeeping); the simulated
    # device computes on the CPU, so it adds to the step there; 0 on a GPU, where the kernels queue ahead of it
    hook_ms: dict[str, float] = field(default_factory=lambda: {"resident": 0.0, "streamed": 0.0})
    supports_pinned: bool = True
    backend_name: str = "cuda"
    named: bool = False
    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    rest_bytes: int = 0
    reserve_estimate: int | None = None  # the engine's first activation reserve for this model ("measure")
    # measured while copies ran beside the compute (the simulated device's copy thread shares the CPU with it): used
    # in proportion to how busy a plan keeps the copy engine
    busy_compute_ms: list[float] | None = None
    busy_rest_ms: float | None = None
    model_name: str = ""


# ------------------------------------------------------------------------------------------------------ public API
def predict(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None,
            config: OffloadConfig | None = None, card: "str | Card" = "measure", *,
            budget: "VramBudget | int | None" = None, ram_bytes: int | None = None, disk_tier: bool = False,
            disk_gbps: float = DEFAULT_DISK_GBPS, units: list[str] | None = None, warmup: int = 2,
            runs: int = 3) -> Prediction:
    """The engine's plan for `model` under `config` on `card`, and its predicted step time (see the module doc).

    `args` / `kwargs` are one forward's inputs (meta tensors do for a named card). `budget` is the VRAM budget the
    model would join (a VramBudget or bytes; default: the card's memory, or the device's free memory, less the
    activation reserve). `ram_bytes` caps host RAM (default: the config's `ram_budget_bytes`, else not limited for a
    named card and the machine's available RAM for "measure"); `disk_tier` says the model's file can serve blocks
    that RAM cannot hold (as `disk_path` does), read at `disk_gbps`.
    """
    config = config if config is not None else OffloadConfig.from_preset("auto")
    return predict_configs(model, args, kwargs, {"": config}, card, budget=budget, ram_bytes=ram_bytes,
                           disk_tier=disk_tier, disk_gbps=disk_gbps, units=units, warmup=warmup, runs=runs)[""]


def predict_configs(model: nn.Module, args: Any, kwargs: dict[str, Any] | None,
                    configs: "dict[str, OffloadConfig]", card: "str | Card" = "measure", *,
                    budget: "VramBudget | int | None" = None, ram_bytes: int | None = None, disk_tier: bool = False,
                    disk_gbps: float = DEFAULT_DISK_GBPS, units: list[str] | None = None, warmup: int = 2,
                    runs: int = 3, layout_bytes: tuple[list[int], int] | None = None) -> dict[str, Prediction]:
    """`predict` for several configs (presets) at once: the model is measured or run on the meta device once."""
    for config in configs.values():
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig (OffloadConfig.from_preset(...)), got "
                            f"{type(config).__name__}")
    first = next(iter(configs.values()), None) or OffloadConfig.from_preset("auto")
    profile = profile_model(model, args, kwargs, first, card, units=units, warmup=warmup, runs=runs,
                            layout_bytes=layout_bytes)
    return {label: predict_profile(profile, config, budget=budget, ram_bytes=ram_bytes, disk_tier=disk_tier,
                                   disk_gbps=disk_gbps) for label, config in configs.items()}


def profile_model(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None,
                  config: OffloadConfig | None = None, card: "str | Card" = "measure", *,
                  units: list[str] | None = None, warmup: int = 2, runs: int = 3,
                  layout_bytes: tuple[list[int], int] | None = None) -> Profile:
    """Cost `model`'s units once: measured on `config`'s device (card="measure") or on the meta device for a named
    card. `layout_bytes`: (each unit's bytes, the rest's bytes) as a model file stores them (a float8 file streams a
    byte per weight while its meta model computes in bf16); used when it has as many units as the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"predict needs an nn.Module, got {type(model).__name__}")
    config = config if config is not None else OffloadConfig.from_preset("auto")
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    named = not (isinstance(card, str) and card == "measure")
    card_obj = get_card(card) if named else None  # an unknown name fails before any work
    if getattr(model, "_layer_offload_handle", None) is not None:
        raise ValueError(f"{type(model).__name__} is offloaded already: predict it before offload_module(), or after "
                         f"handle.detach() (its report has the measured figures meanwhile)")
    found = find_units(model, units)
    sizes, rest_bytes = unit_sizes(model, found)
    if layout_bytes is not None and len(layout_bytes[0]) == len(sizes):
        sizes, rest_bytes = list(layout_bytes[0]), int(layout_bytes[1])
    elif layout_bytes is not None:
        log.warning("the file has %d blocks and %s %d units: sizes from the model", len(layout_bytes[0]),
                    type(model).__name__, len(sizes))
    started = time.perf_counter()
    if named:
        profile = _profile_on_card(analyse_on_meta(model, args, kwargs, found), card_obj)
    else:
        profile = _measure(model, found, tuple(args), kwargs, config, warmup, runs)
        profile.reserve_estimate = estimate_reserve(model, profile.device_total, profile.backend_name)
    profile.names, profile.sizes, profile.rest_bytes = [u.name for u in found], sizes, rest_bytes
    profile.model_name = type(model).__name__
    log.info("costed %s on %s in %.2f s", profile.model_name, profile.card.get("name"), time.perf_counter() - started)
    return profile


def unit_sizes(model: nn.Module, units: Sequence[Unit]) -> tuple[list[int], int]:
    """Each unit's bytes as the engine lays it out (aligned) and the bytes of the weights outside the units, without
    touching a weight (works on the meta device); tensors shared between units, and trainable ones inside them, stay
    with the rest, as `staging.lay_out_model` does."""
    shared = shared_tensor_ids(model, list(units))
    shared |= {id(p) for p in trainable_in_blocks([u.module for u in units], shared)}  # stay with the rest
    sizes, in_units = [], set()
    for unit in units:
        tensors = [t for t in unit_tensors(unit.module) if id(t[3]) not in shared]
        in_units.update((id(sub), name, kind) for sub, name, kind, _ in tensors)
        sizes.append(plan_layout(tensors).nbytes)
    rest = plan_layout([(sub, name, kind, t) for sub, name, kind, t in unit_tensors(model)
                        if (id(sub), name, kind) not in in_units])
    return sizes, (rest.nbytes if rest.entries else 0)


# -------------------------------------------------------------------------------------------- the planner seam
def _engine_plan(facts: PlanFacts, copy_ms: Callable[[list[str]], list[float]], compute_ms: list[float]) -> Plan:
    """The plan the engine settles on once every block was measured: the plan by count it starts with (host tiers
    included), then the plan from costs with that one in place, as `replan.PlanKeeper` asks `make_plan` for them.
    `copy_ms(host tiers)` costs each unit's copy from where its master lives. Raises PlanError when not even one
    slot fits and RamCeilingError when a hard RAM ceiling cannot be kept."""
    return settled_plan(facts, lambda tiers: UnitCosts(list(compute_ms), copy_ms(tiers)))


def _ring_stalls(costs: UnitCosts, rest_ms: float, resident: set[int], slots: int) -> list[float]:
    """Per-unit stall in a steady-state forward: the ring simulation the planner uses, with the compute outside the
    blocks as the gap between two passes (the copy engine works through it)."""
    return simulate_pass(list(range(len(costs.compute_ms))), costs, set(resident), slots, gap_ms=rest_ms).stall_ms


# ---------------------------------------------------------------------------------------------------- the plan
def _budget_total(budget: "VramBudget | int | None", profile: Profile, reserve: int) -> int:
    if isinstance(budget, VramBudget) and budget.total_bytes is not None:
        return int(budget.total_bytes)
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return int(budget)
    if budget is not None and not isinstance(budget, VramBudget):
        raise TypeError(f"budget must be a VramBudget, a number of bytes or None, got {type(budget).__name__}")
    return max(0, min(profile.device_free, profile.device_total) - reserve)


def _allowance(config: OffloadConfig, total: int, rest: int, sizes: list[int]) -> int:
    """What a lone model gets from a budget of `total` bytes: what its preset wants (OffloadHandle.want_bytes), capped
    by the total."""
    return min(want_bytes(config.prefetch, config.vram_fraction, config.vram_budget_bytes, rest, sizes, total), total)


def _reserve(config: OffloadConfig, profile: Profile) -> int:
    if config.reserve_bytes is not None:
        return int(config.reserve_bytes)
    if profile.named:  # what the engine's reserve settles at after its first run (OffloadHandle.after_pass)
        if profile.activation_bytes <= 0:
            return default_reserve(profile.device_total, "cuda")
        return reserve_from_peak(profile.activation_bytes)
    if profile.reserve_estimate is not None:
        return profile.reserve_estimate
    return default_reserve(profile.device_total, profile.backend_name)


def _host_facts(config: OffloadConfig, profile: Profile, ram_bytes: int | None, disk_tier: bool) -> HostFacts:
    """The host as the engine's staging would see it: a hard RAM ceiling when one is given, else a named card's
    machine without limit, or this machine's available RAM."""
    ram = ram_bytes if ram_bytes is not None else config.ram_budget_bytes
    pin = config.pin_memory and profile.supports_pinned
    allow_disk = config.allow_disk and (config.disk_path is not None or disk_tier)
    if ram is not None:
        pin_limit = int(int(ram) * 0.8) if profile.named else read_host_memory().pin_limit
        return HostFacts(int(ram), True, pin_limit, pin, allow_disk, profile.supports_pinned, False)
    if profile.named:
        return HostFacts(1 << 62, False, 1 << 62, pin, False, profile.supports_pinned, False)
    mem = read_host_memory()
    return HostFacts(mem.available, False, mem.pin_limit, pin, allow_disk, profile.supports_pinned, False)


def _copy_ms(nbytes: int, tier: str, profile: Profile, disk_gbps: float) -> float:
    gbps = {"pinned": profile.pinned_gbps, "pageable": profile.pageable_gbps,
            "disk": min(disk_gbps, profile.pinned_gbps)}.get(tier, profile.pinned_gbps)
    return profile.latency_ms + nbytes / (gbps * 1e6)


def predict_profile(profile: Profile, config: OffloadConfig, *, budget: "VramBudget | int | None" = None,
                    ram_bytes: int | None = None, disk_tier: bool = False,
                    disk_gbps: float = DEFAULT_DISK_GBPS) -> Prediction:
    """The plan and step time for `config` (and `budget`, RAM, disk tier; see `predict`) from a costed model."""
    names, sizes, rest_bytes = profile.names, profile.sizes, profile.rest_bytes
    n = len(sizes)
    notes: list[str] = []
    reserve = _reserve(config, profile)
    total = _budget_total(budget, profile, reserve)
    allowance = _allowance(config, total, rest_bytes, sizes)
    resident_step = profile.rest_ms + sum(profile.compute_ms)
    host = _host_facts(config, profile, ram_bytes, disk_tier)
    facts = PlanFacts(name=profile.model_name or "model", sizes=tuple(sizes), names=tuple(names), rest_bytes=rest_bytes,
                      prefetch=config.prefetch, stream_all=config.vram_fraction <= 0, device="predicted",
                      allowance=allowance, disk_ok=(host.allow_disk,) * n, host=host)

    def copies(tiers: list[str]) -> list[float]:
        return [_copy_ms(sizes[i], tiers[i], profile, disk_gbps) for i in range(n)]

    common = dict(card=profile.card, preset=config.preset, activation_bytes=profile.activation_bytes,
                  allowance_bytes=allowance, rest_compute_ms=profile.rest_ms)
    try:
        plan = _engine_plan(facts, copies, profile.compute_ms)
    except (PlanError, RamCeilingError) as exc:
        notes.append(str(exc))
        copy = copies(["pinned"] * n)
        blocks = [BlockPrediction(names[i], "pinned", sizes[i], copy[i], profile.compute_ms[i], 0.0,
                                  profile.flops[i] if profile.flops else None, "no plan fits") for i in range(n)]
        ram = rest_bytes + sum(sizes)
        return Prediction(math.inf, resident_step, 0, ram, 0, False, blocks, notes=notes, **common)
    tiers = [plan.host_tiers.get(i, "pinned") for i in range(n)]
    copy = copies(tiers)
    resident = set(plan.resident)
    compute, rest_ms = list(profile.compute_ms), profile.rest_ms
    stalls = _ring_stalls(UnitCosts(compute, copy), rest_ms, resident, plan.n_slots)
    streamed = [i for i in range(n) if i not in resident]
    if profile.busy_compute_ms is not None and streamed:
        # the copies a plan makes take a share of the host's CPU while they run (the simulated device): compute as
        # timed beside copies, in proportion to how much of the step the copy engine is busy
        busy = min(1.0, sum(copy[i] for i in streamed) / max(resident_step + sum(stalls), 1e-9))
        compute = [c + busy * (b - c) for c, b in zip(compute, profile.busy_compute_ms)]
        rest_ms = rest_ms + busy * ((profile.busy_rest_ms or rest_ms) - rest_ms)
        stalls = _ring_stalls(UnitCosts(compute, copy), rest_ms, resident, plan.n_slots)
    blocks = [BlockPrediction(names[i], "vram" if i in resident else tiers[i], sizes[i], copy[i],
                              compute[i], 0.0 if i in resident else stalls[i],
                              profile.flops[i] if profile.flops else None, plan.reasons[i]) for i in range(n)]
    hooks = (profile.hook_ms["resident"] * len(resident) + profile.hook_ms["streamed"] * (n - len(resident))) / n
    step = rest_ms + sum(compute) + sum(b.stall_ms for b in blocks) + hooks
    hp = plan.host_plan
    bounce = hp.bounce_bytes if hp is not None else None
    host_bytes = host_ram_bytes(sizes, rest_bytes, plan.host_tiers, bounce, config.prefetch, host.bounces_pageable)
    disk_bytes = sum(sizes[i] for i in plan.disk_units)
    fits = True
    room = (profile.device_total - CONTEXT_BYTES) if profile.named else profile.device_total
    if plan.device_bytes + profile.activation_bytes > room:
        fits = False
        notes.append(f"{(plan.device_bytes + profile.activation_bytes) / (1 << 30):.2f} GiB (plan "
                     f"{plan.device_bytes / (1 << 30):.2f} + activations {profile.activation_bytes / (1 << 30):.2f}) "
                     f"is more than the {room / (1 << 30):.2f} GiB the device has for them")
    if not host.hard and not profile.named and host_bytes > host.ram_budget + sum(sizes):
        notes.append(f"needs {host_bytes / (1 << 30):.2f} GiB of host RAM, more than is available")
    notes.extend(plan.notes)
    if config.devices and len(config.devices) > 1:
        notes.append("several devices are not predicted: this is the compute device alone")
    return Prediction(step, resident_step, plan.device_bytes, host_bytes, disk_bytes, fits, blocks,
                      slots=plan.n_slots, slot_bytes=plan.slot_bytes, notes=notes, **common)


# ------------------------------------------------------------------------------------------ measuring a device
def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and t.device != device else t, tree)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _measure(model: nn.Module, units: Sequence[Unit], args: tuple, kwargs: dict[str, Any], config: OffloadConfig,
             warmup: int, runs: int) -> Profile:
    """Per-unit compute timed on the config's device; copy speed from its backend."""
    if any(t.is_meta for _, _, _, t in unit_tensors(model)):
        raise ValueError("card='measure' times the model on its device, but its weights are on the meta device; "
                         "name a card instead (offload.cards.CARDS, e.g. card='rtx4090') or pass an offload.Card")
    backend = get_backend(config)
    device = backend.device
    on_device = all(t.device == device for _, _, _, t in unit_tensors(model))
    args, kwargs = _to_device(args, device), _to_device(kwargs, device)
    sim = backend.name == "sim"
    pinned = backend.h2d_gbps(True) or 1.0
    pageable = backend.h2d_gbps(False) or pinned
    latency_ms = float(getattr(backend, "latency_us", 0.0)) / 1e3
    probe = None
    if sim and getattr(backend, "bandwidth_gbps", None):
        sizes, _ = unit_sizes(model, units)
        probe = _CopyProbe(backend, min(max(sizes), 64 * MIB), pinned, latency_ms)
    busy_compute = busy_rest = None
    if on_device:
        compute, rest, activation, busy_compute, busy_rest = _time_blocks(model, units, args, kwargs, backend, warmup,
                                                                          runs, probe)
    else:
        compute, rest, activation = _time_streamed(model, args, kwargs, config, warmup, runs)
    nominal = pinned
    if probe is not None and probe.factor() > 1.0:  # copies run slower beside the compute than nominal
        pinned, pageable = pinned / probe.factor(), pageable / probe.factor()
    free, total = backend.mem_get_info()
    card = {"name": backend.describe(), "vram_bytes": int(total), "h2d_gbps": pinned, "pageable_gbps": pageable,
            "nominal_h2d_gbps": nominal, "tflops": None, "measured": True}
    profile = Profile(compute, rest, pinned, pageable, latency_ms,
                    int(total), int(free) + (sum(_device_bytes(model, device)) if not sim and on_device else 0),
                    activation, card,
                    hook_ms=engine_cpu_ms(len(units)) if sim else {"resident": 0.0, "streamed": 0.0},
                    supports_pinned=backend.supports_pinned_host, backend_name=backend.name)
    profile.busy_compute_ms, profile.busy_rest_ms = busy_compute, busy_rest
    return profile


class _TinyUnits(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def engine_cpu_ms(n_units: int, batches: int = 5, forwards: int = 8) -> dict[str, float]:
    """The engine's CPU time per forward of a model of `n_units` units, every unit resident and every unit streamed
    (its hooks, the slot hand-off and a throttled copy's hand-off to the copy thread, the per-pass bookkeeping): on
    the simulated device compute runs on the CPU, so this adds to every step. Measured once per process and unit
    count on a model of as many tiny units (a tenth of a second or so), as benchmarks/bench_hooks.py does: the
    fastest batch, over the plain model's."""
    n = max(1, min(int(n_units), MAX_HOOK_UNITS))
    scale = max(1, int(n_units)) / n
    if n in _hook_ms_cache:
        return {k: v * scale for k, v in _hook_ms_cache[n].items()}
    from .handle import offload_module

    torch.manual_seed(0)
    model = _TinyUnits(max(2, n)).eval()
    x = torch.randn(1, 16)

    def per_forward() -> float:
        best = math.inf
        with torch.inference_mode():
            model(x)
            for _ in range(batches):
                start = time.perf_counter()
                for _ in range(forwards):
                    model(x)
                best = min(best, (time.perf_counter() - start) / forwards)
        return best * 1e3

    plain = per_forward()
    out = {}
    for label, preset in (("resident", "high_end"), ("streamed", "budget")):
        cfg = OffloadConfig.from_preset(preset, device="sim", sim_bandwidth_gbps=1000.0,
                                        sim_capacity_bytes=64 * MIB + 1)
        handle = offload_module(model, cfg, name="predict-cpu-cost", budget=VramBudget(None))
        try:
            out[label] = max(0.0, per_forward() - plain)
        finally:
            handle.detach()
    _hook_ms_cache[n] = out
    return {k: v * scale for k, v in out.items()}


def _device_bytes(model: nn.Module, device: torch.device) -> Iterator[int]:
    """Bytes of the model's weights on `device` (counted back as free: the engine's plan replaces them)."""
    seen: set[int] = set()
    for _, _, _, t in unit_tensors(model):
        if t.device == device and id(t) not in seen:
            seen.add(id(t))
            yield t.numel() * t.element_size()


class _CopyProbe:
    """Copies of one block's size queued on the backend's copy engine while the timed forwards compute: how much
    slower than nominal a copy runs beside the compute (the simulated device's copy thread shares the host's CPUs
    with it, as the engine's copies will)."""

    def __init__(self, backend: Any, nbytes: int, gbps: float, latency_ms: float) -> None:
        self.backend, self.nbytes = backend, max(int(nbytes), 4096)
        self.nominal_ms = latency_ms + self.nbytes / (gbps * 1e6)
        self.spans: list[float] = []
        self._events: list[Any] = []
        try:
            with torch.inference_mode(False):
                self.dst = backend.alloc(self.nbytes)
            self.src = torch.empty(self.nbytes, dtype=torch.uint8)
        except torch.OutOfMemoryError:
            self.dst = None

    def start(self, expected_ms: float) -> None:
        """Queue enough copies to cover a forward of about `expected_ms`."""
        if self.dst is None:
            return
        count = min(64, max(2, int(expected_ms / self.nominal_ms) + 2))
        self._events = [self.backend.copy_h2d(self.dst, self.src) for _ in range(count)]

    def finish(self, fwd_start: Any, fwd_ms: float) -> None:
        """Keep the spans of the copies that ran entirely inside the forward."""
        b = self.backend
        for event in self._events:
            b.event_synchronize(event)
            end = b.elapsed_ms(fwd_start, event)
            span = b.copy_span_ms(event)
            if end - span >= 0 and end <= fwd_ms:
                self.spans.append(span)
        self._events = []

    def factor(self) -> float:
        """Median copy time over nominal (1.0 when nothing was seen)."""
        if self.dst is not None:
            self.backend.release(self.dst)
            self.dst = None
        return _median(self.spans) / self.nominal_ms if len(self.spans) >= 3 else 1.0


def _time_blocks(model: nn.Module, units: Sequence[Unit], args: tuple, kwargs: dict[str, Any], backend: Any,
                 warmup: int, runs: int, probe: _CopyProbe | None = None
                 ) -> tuple[list[float], float, int, list[float] | None, float | None]:
    """(median compute ms per unit, median ms outside the units, activation peak bytes; and with `probe` the same
    two medians again over as many forwards timed while copies run beside them, as the engine's would) of a model
    resident on the backend's device: each unit bracketed by the backend's events in whole forwards."""
    n = len(units)
    marks: list[list[Any]] = [[] for _ in range(n)]
    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.module.register_forward_pre_hook(lambda *_a, i=i: marks[i].append(backend.record())))
        handles.append(unit.module.register_forward_hook(lambda *_a, i=i: marks[i].append(backend.record())))
    per_unit: dict[bool, list[list[float]]] = {False: [[] for _ in range(n)], True: [[] for _ in range(n)]}
    forwards: dict[bool, list[float]] = {False: [], True: []}
    activation = 0
    timed = max(1, runs)
    total = max(0, warmup) + timed * (2 if probe is not None else 1)
    try:
        with torch.inference_mode():
            for r in range(total):
                for m in marks:
                    m.clear()
                if r == warmup:
                    backend.reset_peak_allocated()
                busy = probe is not None and r >= warmup + timed  # clean runs first, then runs beside copies
                if busy:
                    probe.start(forwards[False][-1] if forwards[False] else 0.0)
                start = backend.record()
                model(*args, **kwargs)
                end = backend.record()
                if busy:
                    probe.finish(start, backend.elapsed_ms(start, end))
                backend.synchronize()
                if r < warmup:
                    continue
                forwards[busy].append(backend.elapsed_ms(start, end))
                for i, m in enumerate(marks):
                    per_unit[busy][i].append(sum(max(0.0, backend.elapsed_ms(a, b)) for a, b in zip(m[::2], m[1::2])))
        peak = backend.peak_allocated()
        if peak is not None:
            activation = max(0, int(peak) - sum(_device_bytes(model, backend.device)))
    finally:
        for h in handles:
            h.remove()
    compute = [_median(p) for p in per_unit[False]]
    rest = max(0.0, _median(forwards[False]) - sum(compute))
    if probe is None:
        return compute, rest, activation, None, None
    busy_compute = [_median(p) for p in per_unit[True]]
    busy_rest = max(0.0, _median(forwards[True]) - sum(busy_compute))
    return compute, rest, activation, busy_compute, busy_rest


def _time_streamed(model: nn.Module, args: tuple, kwargs: dict[str, Any], config: OffloadConfig, warmup: int,
                   runs: int) -> tuple[list[float], float, int]:
    """A model in host memory while the device is a GPU: time it through the engine with every block streamed (the
    engine's own per-block compute events), then detach (the weights stay ordinary host tensors)."""
    from .handle import offload_module

    handle = offload_module(model, config.replace(vram_fraction=0.0, preset=None), name="predict",
                            budget=VramBudget(None))
    try:
        forwards = []
        with torch.inference_mode():
            for r in range(max(0, warmup) + max(1, runs)):
                if r == warmup:
                    handle.reset_stats()
                start = time.perf_counter()
                model(*args, **kwargs)
                handle.backend.synchronize()
                if r >= warmup:
                    forwards.append((time.perf_counter() - start) * 1e3)
        rep = handle.report()
    finally:
        handle.detach()
    compute = [b.compute_ms / b.calls if b.calls else 0.0 for b in rep.blocks]
    fwd = max(1, rep.forwards)
    rest = max(0.0, _median(forwards) - sum(compute) - rep.stall_ms / fwd)
    return compute, rest, 0


# ---------------------------------------------------------------------------------------- the meta-device run
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_NO_TRAFFIC = ("empty", "new_empty", "empty_like", "empty_strided", "zeros", "ones", "full", "detach", "alias",
               "lift_fresh", "lift_fresh_copy", "_local_scalar_dense")
LAUNCH_MS = 0.004  # a kernel's launch and tail on a GPU: what a tiny op costs however little it moves


@dataclass
class MetaAnalysis:
    """One forward on the meta device, card-independent: per unit (and the rest) its ops as (kind, FLOPs, bytes),
    kind mm (FLOPs from torch.utils.flop_counter's formulas), attn (a fused attention kernel) or mem (elementwise,
    norms, copies: bytes read and written); FlopCounterMode's FLOPs per unit; the peak of live activations."""

    units: list[list[tuple[str, float, float]]]
    rest: list[tuple[str, float, float]]
    flops: list[float]
    activation_bytes: int
    seconds: float = 0.0

    def unit_ms(self, card: Card) -> list[float]:
        return [_ops_ms(ops, card) for ops in self.units]

    def rest_ms(self, card: Card) -> float:
        return _ops_ms(self.rest, card)


def _ops_ms(ops: list[tuple[str, float, float]], card: Card) -> float:
    """Milliseconds of `ops` on `card`: each op as slow as its FLOPs or its bytes make it (a roofline), plus a launch."""
    peak = card.tflops * 1e12
    mem = card.mem_gbps * 1e9 * MEMORY_EFFICIENCY if card.mem_gbps else math.inf
    eff = {"mm": MATMUL_EFFICIENCY, "attn": ATTENTION_EFFICIENCY}
    total = 0.0
    for kind, flops, nbytes in ops:
        t = nbytes / mem
        if kind in eff:
            t = max(t, flops / (peak * eff[kind]))
        total += t
    return total * 1e3 + LAUNCH_MS * len(ops) if card.mem_gbps else total * 1e3


class _Recorder:
    """Where the ops of the meta forward go (the unit running, else the rest), and the live activation bytes."""

    def __init__(self, n: int) -> None:
        self.buckets: list[list[tuple[str, float, float]]] = [[] for _ in range(n + 1)]
        self.current = n  # the rest
        self.rest = n
        self.live = 0
        self.peak = 0

    def add(self, kind: str, flops: float, nbytes: float) -> None:
        self.buckets[self.current].append((kind, flops, nbytes))

    def allocated(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


class _FusedAttention(TorchFunctionMode):
    """Scaled dot-product attention on meta tensors as a fused kernel: its FLOPs and bytes recorded and a meta output
    of the right shape returned, instead of the math fallback's score matrices (which would dominate the activation
    peak and hide the kernel a GPU runs)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.flops = 0.0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = dict(zip(_SDPA_ARGS, args))
            named.update(kwargs)
            q, k, v = named.get("query"), named.get("key"), named.get("value")
            if all(isinstance(t, torch.Tensor) and t.is_meta for t in (q, k, v)):
                lq, d = q.shape[-2], q.shape[-1]
                lk, dv = k.shape[-2], v.shape[-1]
                flops = 2.0 * math.prod(q.shape[:-2]) * lq * lk * (d + dv)
                if named.get("is_causal"):
                    flops /= 2
                out = q.new_empty((*q.shape[:-1], dv))
                self.flops += flops
                self.recorder.add("attn", flops, _nbytes((q, k, v, out)))
                return out
        return func(*args, **kwargs)


class _Traffic(TorchDispatchMode):
    """Every op of the meta forward recorded with its FLOPs (torch.utils.flop_counter's formulas) or the bytes it
    moves, and every fresh output counted live until its tensor dies."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # a value read back on the meta device (`if mask.all():`, `.item()`): there is none; the branch taken is
            # the one a nonzero value takes, which costs about what the other does
            return {torch.bool: True}.get(args[0].dtype, 1)
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out
        packet = func.overloadpacket
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            self.recorder.add("mm", flops, _nbytes(inputs + outputs))
        elif packet.__name__ not in _NO_TRAFFIC:
            self.recorder.add("mem", 0.0, _nbytes(inputs + outputs))
        for t in outputs:
            if not any(t is i for i in inputs):
                self.recorder.allocated(t)
        return out


@contextmanager
def _weights_on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer swapped for a meta tensor of its shape and dtype for the duration; the model's own
    tensors are put back untouched afterwards (nothing is copied or allocated)."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for key, t in list(store.items()):
                    if t is None or t.is_meta:
                        continue
                    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    saved.append((store, key, t))
                    store[key] = nn.Parameter(meta, requires_grad=False) if store is mod._parameters else meta
        yield
    finally:
        for store, key, t in reversed(saved):
            store[key] = t


def _all_nonzero() -> Any:
    """`torch.nonzero` on the meta device as if every element were nonzero (masks of valid tokens, where a model picks
    the tokens it attends to), where this torch offers it."""
    try:
        from torch.fx.experimental import _config as fx_config

        return fx_config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError, KeyError):
        return contextlib.nullcontext()


def _to_meta(tree: Any) -> Any:
    return tree_map(lambda t: t if not isinstance(t, torch.Tensor) or t.is_meta else
                    torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta"), tree)


def analyse_on_meta(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None,
                    units: Sequence[Unit] | None = None) -> MetaAnalysis:
    """One forward of `model` on the meta device (weights and inputs viewed as meta tensors; nothing allocated):
    what each unit computes and moves, card-independent (`predict` costs it on a card)."""
    found = list(units) if units is not None else find_units(model)
    n = len(found)
    recorder = _Recorder(n)
    attention, counter, traffic = _FusedAttention(recorder), FlopCounterMode(display=False), _Traffic(recorder)
    marks: list[list[float]] = [[] for _ in range(n)]

    def enter(i: int) -> None:
        recorder.current = i
        marks[i].append(float(counter.get_total_flops()) + attention.flops)

    def leave(i: int) -> None:
        recorder.current = recorder.rest
        marks[i].append(float(counter.get_total_flops()) + attention.flops)

    handles = []
    for i, unit in enumerate(found):
        handles.append(unit.module.register_forward_pre_hook(lambda *_a, i=i: enter(i)))
        handles.append(unit.module.register_forward_hook(lambda *_a, i=i: leave(i)))
    args = _to_meta(tuple(args) if isinstance(args, (tuple, list)) else (args,))
    kwargs = _to_meta(dict(kwargs or {}))
    started = time.perf_counter()
    try:
        with _weights_on_meta(model), torch.no_grad(), _all_nonzero(), attention, counter, traffic:
            model(*args, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{type(model).__name__}'s forward cannot run on the meta device ({type(exc).__name__}: "
                         f"{first}); predict it with card='measure' on its device instead") from exc
    finally:
        for h in handles:
            h.remove()
    flops = [sum(b - a for a, b in zip(m[::2], m[1::2])) for m in marks]
    return MetaAnalysis(recorder.buckets[:n], recorder.buckets[n], flops, recorder.peak,
                        time.perf_counter() - started)


def _profile_on_card(analysis: MetaAnalysis, card: Card) -> Profile:
    """The meta analysis in milliseconds on `card`."""
    d = card.to_dict()
    d["measured"] = False
    return Profile(analysis.unit_ms(card), analysis.rest_ms(card), card.h2d_gbps, card.pageable, 0.0,
                    card.vram_bytes, card.vram_bytes - CONTEXT_BYTES, analysis.activation_bytes, d,
                    flops=list(analysis.flops), named=True)
