"""`offload.predict`: where every block would live and how long a step would take, before anything is staged.

Two ways to cost a model's blocks:

- `card="measure"`: each block's compute is timed on the model's own device (forward hooks and the backend's
  events, after warm-up runs; a model on the host while the device is a GPU is timed through the engine with every
  block streamed), and the copy speed is the backend's (`Backend.h2d_gbps`: the simulated device's bandwidth, or
  the pinned host-to-device speed measured on CUDA). On the simulated device, whose compute and copy thread share
  the host's CPUs, the blocks are also timed while copies run beside them and the engine's own CPU cost per
  forward is measured (`engine_cpu_ms`): both add to a step there.
- a named card (`offload.predict.cards.CARDS`) or an `offload.Card`: the forward runs on the meta device (a model with real
  weights is viewed on the meta device for the run and given back untouched), so nothing is allocated. FLOPs per
  block come from `torch.utils.flop_counter.FlopCounterMode`; each op is as slow as its FLOPs (matmuls, through the
  flop counter's formulas) or the bytes it moves make it on the card; attention is costed as a fused kernel (its
  FLOPs, not the score matrices the meta device's math fallback would build); the peak of live activations is
  tracked for the fit.

The timing lives in `device_timing.py`, the meta-device run in `meta_costs.py`; both give a `cost_profile.Profile`,
which this module turns into a plan and a step time for each config. Block sizes come from the engine's own layout (`layout.plan_layout`: aligned bytes as they move), the plan from the
engine's own planner (`_engine_plan`, the one seam to `planner.make_plan`) and the stalls from its ring simulation
(`ring_sim.simulate_pass`, the compute outside the blocks as the gap between passes).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch.nn as nn

from ..backends import get_backend
from ..budget.reserve import reserve_from_peak
from ..budget.vram_budget import VramBudget
from ..config import OffloadConfig
from ..model.blocks import Unit, find_units
from ..model.layout import plan_layout, unit_tensors
from ..model.trainable import trainable_in_blocks
from ..plan.plan_host import host_ram_bytes
from ..plan.planner import (MIB, HostFacts, Plan, PlanError, PlanFacts, RamCeilingError, default_reserve, make_plan,
                            estimate_reserve, read_host_memory, settled_plan, want_bytes)
from ..plan.ring_sim import UnitCosts, simulate_pass
from ..store.compressed import DEFAULT_DECODE_GBPS, estimated_packed_sizes, measure_decode_gbps
from ..store.model_layout import shared_tensor_ids
from .cards import Card, get_card
from .cost_profile import Profile
from .device_timing import measure_on_device
from .meta_costs import MetaAnalysis, analyse_on_meta

log = logging.getLogger(__name__)

CONTEXT_BYTES = 512 * MIB  # a named card's memory taken before any model: CUDA context, cuBLAS workspace, display
DEFAULT_DISK_GBPS = 2.0  # sequential read of a consumer NVMe drive (GB/s), for blocks on the disk tier


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
    compressed_blocks: int = 0  # blocks held compressed in host RAM (OffloadConfig.host_compression)
    compressed_bytes: int = 0  # host RAM their compression saves

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
        profile = measure_on_device(model, found, tuple(args), kwargs, config, warmup, runs, max(sizes, default=0))
        profile.reserve_estimate = estimate_reserve(model, profile.device_total, profile.backend_name)
    profile.names, profile.sizes, profile.rest_bytes = [u.name for u in found], sizes, rest_bytes
    profile.model_name = type(model).__name__
    profile.packed_sizes = estimated_packed_sizes([u.module for u in found], sizes)
    if not named:
        profile.decode_gbps = measure_decode_gbps(get_backend(config))
    log.info("costed %s on %s in %.2f s", profile.model_name, profile.card.get("name"), time.perf_counter() - started)
    return profile


def unit_sizes(model: nn.Module, units: Sequence[Unit]) -> tuple[list[int], int]:
    """Each unit's bytes as the engine lays it out (aligned) and the bytes of the weights outside the units, without
    touching a weight (works on the meta device); tensors shared between units, and trainable ones inside them, stay
    with the rest, as `model_layout.lay_out_model` does."""
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
    packed = list(profile.packed_sizes or [])
    facts = PlanFacts(name=profile.model_name or "model", sizes=tuple(sizes), names=tuple(names), rest_bytes=rest_bytes,
                      prefetch=config.prefetch, stream_all=config.vram_fraction <= 0, device="predicted",
                      allowance=allowance, disk_ok=(host.allow_disk,) * n, host=host,
                      host_compression=config.host_compression if len(packed) == n else "off",
                      packed_sizes=tuple(packed) if len(packed) == n else ())
    try:  # which units the host side holds compressed: their copies move the encoded bytes and decode after
        compressed = make_plan(facts).compressed
    except (PlanError, RamCeilingError):
        compressed = frozenset()
    decode_gbps = profile.decode_gbps or DEFAULT_DECODE_GBPS

    def copies(tiers: list[str]) -> list[float]:
        return [_copy_ms(packed[i], tiers[i], profile, disk_gbps) + sizes[i] / (decode_gbps * 1e6)
                if i in compressed else _copy_ms(sizes[i], tiers[i], profile, disk_gbps) for i in range(n)]

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
    held = [packed[i] if i in plan.compressed else sizes[i] for i in range(n)]
    rest_held = 0 if hp is not None and hp.rest_spilled else rest_bytes  # blocks compressed: no RAM copy of the rest
    host_bytes = host_ram_bytes(held, rest_held, plan.host_tiers, bounce, config.prefetch, host.bounces_pageable)
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
                      slots=plan.n_slots, slot_bytes=plan.slot_bytes, notes=notes,
                      compressed_blocks=len(plan.compressed),
                      compressed_bytes=sum(sizes[i] - packed[i] for i in plan.compressed), **common)


def _profile_on_card(analysis: MetaAnalysis, card: Card) -> Profile:
    """The meta analysis in milliseconds on `card`."""
    d = card.to_dict()
    d["measured"] = False
    return Profile(analysis.unit_ms(card), analysis.rest_ms(card), card.h2d_gbps, card.pageable, 0.0,
                    card.vram_bytes, card.vram_bytes - CONTEXT_BYTES, analysis.activation_bytes, d,
                    flops=list(analysis.flops), named=True)
