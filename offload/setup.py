"""Setting one model up for streaming, top to bottom: config -> facts -> plan -> stage -> stream.

1. config: the device's backend; a vram_budget_bytes larger than the device is refused.
2. facts: the model's units (offload/model/blocks.py) and their layouts with what the model's file can stream
   (`model_layout.lay_out_model`), the devices' budgets (sized from free memory minus an activation reserve when they
   have no total yet, and checked against their devices), and the host memory the model may use.
3. plan: `planner.make_plan` from those facts; the units it puts on the disk tier are checked against the file
   byte for byte (`model_layout.verify_for_disk`), and any the file does not hold make the plan again without them.
4. stage: `staging.stage_model` puts every unit's master where the plan says, one unit at a time.
5. stream: `ModelStreamer` installs the hooks; a model on several devices gets its activation hops. Under a RAM
   ceiling, blocks held compressed were planned at their estimated encoded size: where they came out larger and
   the host RAM passes the ceiling, the setup is undone and made again from step 2 with their encoded sizes
   (`keep_ram_ceiling`); a ceiling no plan keeps then is refused by name.

Nothing here changes the model before step 4, so a refused model is left exactly as it was. The handle then makes
the `PlanKeeper` that keeps the plan current (offload/plan/replan.py) and joins the budget, whose share replaces the
setup plan's device side (which assumes the whole budget) before the first forward.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import psutil
import torch.nn as nn

from .backends import get_backend, resolve_device
from .backends.base import Backend
from .budget.reserve import ReserveMeter
from .budget.vram_budget import VramBudget, default_budget
from .config import OffloadConfig
from .model.blocks import find_units
from .model.layout import unit_tensors
from .plan import planner
from .plan.planner import (GIB, HostFacts, Plan, PlanError, PlanFacts, RamCeilingError, estimate_reserve,
                           read_host_memory)
from .store.codec import CODEC, scratch_estimate
from .store.compressed import estimate_layout_size, unit_compression, unit_host_bytes
from .store import shared_host
from .store.packed import open_weights
from .store.file_keys import stored_units
from .store.leaf_match import planned_casts, planned_residue
from .store.sources import cast_scratch_bytes
from .store.stage_reads import SetupTimes
from .store.model_layout import ModelLayout, lay_out_model, verify_for_disk
from .store.staging import stage_model
from .stream.background_encode import BackgroundEncoder
from .stream.devices import SecondaryDevices
from .stream.streamer import ModelStreamer, PassListener

log = logging.getLogger(__name__)


@dataclass
class SetUp:
    """What setting a model up made: its devices and budgets, the plan and the facts it came from, the streamer."""

    backend: Backend
    device_name: str
    budget: VramBudget
    secondaries: SecondaryDevices
    reserve: ReserveMeter
    facts: PlanFacts  # the facts that hold after staging (the host side is staged: its tiers are facts now)
    plan: Plan
    streamer: ModelStreamer
    file_path: str | None
    notices: dict[str, str]
    times: SetupTimes | None = None  # where the setup's time went (OffloadReport.setup)


class EncodedLarger(Exception):
    """Staged blocks held compressed came out larger than their estimate and the RAM ceiling broke: their encoded
    sizes (unit index -> bytes) for the plan made again (the setup was undone)."""

    def __init__(self, sizes: dict[int, int], ram: int) -> None:
        super().__init__(f"blocks encoded larger than estimated ({ram} bytes of host RAM)")
        self.sizes, self.ram = sizes, ram


def set_up(model: nn.Module, config: OffloadConfig, name: str, budget: VramBudget | dict[str, VramBudget] | None,
           units: list[str] | None, progress: Callable[[int, int], None] | None, listener: PassListener,
           owner: Any) -> SetUp:
    """Set `model` up for streaming (see the module docstring); `owner` is the handle the secondary devices'
    budget shares answer to, `listener` the streamer's pass listener."""
    encoded: dict[int, int] = {}
    t0 = time.perf_counter()
    for _ in range(3):  # planned again with the encoded sizes of the blocks that broke a RAM ceiling
        try:
            done = _set_up(model, config, name, budget, units, progress, listener, owner, encoded)
            done.times.total_ms = (time.perf_counter() - t0) * 1e3
            return done
        except EncodedLarger as exc:
            encoded.update(exc.sizes)
            ram = exc.ram
    raise RamCeilingError(f"{name}: its blocks compress less than estimated, so it needs {ram} bytes of host RAM, "
                          f"over ram_budget_bytes={config.ram_budget_bytes}; raise ram_budget_bytes to at least {ram}, "
                          f"give disk_path (the model's safetensors file, with a preset that allows the disk tier) so "
                          f"blocks can stream from disk, or set host_compression='off'")


def _set_up(model: nn.Module, config: OffloadConfig, name: str, budget: VramBudget | dict[str, VramBudget] | None,
            units: list[str] | None, progress: Callable[[int, int], None] | None, listener: PassListener,
            owner: Any, encoded: dict[int, int]) -> SetUp:
    """One try of `set_up`, with the encoded sizes known from an earlier try (`encoded`)."""
    # 1. config
    times = SetupTimes()
    t0 = time.perf_counter()
    backend = get_backend(config)
    free, total = backend.mem_get_info()
    if config.vram_budget_bytes is not None and config.vram_budget_bytes > total:
        raise ValueError(f"vram_budget_bytes={config.vram_budget_bytes} is larger than the device "
                         f"{backend.describe()} ({total} bytes); the limit is {total} bytes")
    # 2. facts: the units, the devices and their budgets (sized and checked before anything changes)
    found = find_units(model, units)
    device_name = resolve_device(config.device)
    budgets = budget if isinstance(budget, dict) else {}
    vbudget = (budgets.get(device_name) or (budget if isinstance(budget, VramBudget) else None) or default_budget())
    secondaries = SecondaryDevices(owner, config, list(config.devices[1:]) if config.devices else [], budgets)
    reserve = (config.reserve_bytes if config.reserve_bytes is not None
               else estimate_reserve(model, total, backend.name))
    vbudget.resolve_total(max(0, min(free, total) - reserve), backend)
    vbudget.check_device(total)  # before staging: a refused model is left exactly as it was
    in_ram = sum(t.numel() * t.element_size() for u in found for _, _, _, t in unit_tensors(u.module)
                 if t.device.type == "cpu")
    file = open_weights(config.disk_path) if config.disk_path else None  # a safetensors file or a packed folder
    file_path = str(file.path) if file is not None else None
    try:
        laid = lay_out_model(model, found, file, config.disk_optional)
        t1 = time.perf_counter()
        times.layout_ms = (t1 - t0) * 1e3
        facts = _facts(config, name, backend, device_name, vbudget, laid, in_ram, file_path, encoded)
        # 3. plan
        plan = _make_plan(facts, laid)
        for _ in range(len(laid.layouts) + 1):  # the file must hold the very bytes it streams
            refused = verify_for_disk(laid, plan.disk_units)
            checked = replace(facts, disk_ok=tuple(ok and i not in refused for i, ok in enumerate(facts.disk_ok)),
                              disk_refusals=tuple(laid.refusals), **_file_facts(laid))
            if checked == facts:
                break
            facts = checked  # units the file does not hold stay in RAM; casts known exactly: plan again
            plan = planner.make_plan(facts)
        for level, message in plan.messages:
            log.log(level, "%s", message)
        t2 = time.perf_counter()
        times.plan_ms = (t2 - t1) * 1e3
        # 4. stage
        later = plan.host_plan.encode_later
        staged = stage_model(laid, plan.host_tiers, backend, config.pin_memory, plan.bounce_count,
                             plan.bounce_bytes, progress, plan.shared_units, plan.host_plan.compressed,
                             plan.host_plan.rest_spilled, times, later, plan.host_plan.publish_later)
        times.stage_ms = (time.perf_counter() - t2) * 1e3
    except BaseException:
        if file is not None:
            file.close()
        raise
    # 5. stream
    streamer = ModelStreamer(model, staged, backend, listener, config.pin_memory, config.prefetch, config.profile)
    if config.ram_budget_bytes is not None:
        keep_ram_ceiling(streamer, plan, int(config.ram_budget_bytes))
    secondaries.attach(streamer.placement, backend, [u.staged.module for u in streamer.units])
    tiers = tuple(u.tier for u in streamer.units)
    # a unit encoded after setup is planned in the form it will have (the decode's scratch is kept for it)
    forms = tuple(CODEC if u.index in later else unit_compression(u.staged) for u in streamer.units)
    if later or staged.publish_later:
        streamer.background = BackgroundEncoder(streamer, sorted(later), sorted(staged.publish_later))
    notices = {}
    if config.pin_memory and backend.supports_pinned_host and any(  # (those moving into the shared copy: pinned there)
            u.master.host is not None and not u.master.pinned and u.index not in staged.publish_later
            for u in staged.units):
        notices["pinned_fallback"] = ("pinning was refused or over the pin limit: some blocks stream from pageable "
                                      "memory through a bounce buffer (slower copies)")
    if "disk" in tiers:
        notices["disk_tier"] = f"{tiers.count('disk')} block(s) stream from {file_path}: host RAM is short"
    return SetUp(backend, device_name, vbudget, secondaries, ReserveMeter(reserve, config.reserve_bytes is not None),
                 replace(facts, host=None, host_tiers=tiers, host_forms=forms, host_notes=tuple(
                     plan.host_plan.notes.get(i, "") for i in range(len(tiers)))), plan, streamer, file_path, notices,
                 times)


def keep_ram_ceiling(streamer: ModelStreamer, plan: Plan, ceiling: int) -> None:
    """The staged model's host RAM within `ceiling` (see step 5 of the module docstring): blocks held compressed
    may encode larger than their estimate; when they carry the host RAM past the ceiling, the setup is undone (the
    model as it was) and EncodedLarger gives their encoded sizes to plan with."""
    ram = streamer.host_memory()["ram"]
    planned = plan.host_plan.host_sizes if plan.host_plan is not None else None
    if ram <= ceiling or not planned:
        return
    grown = {u.index: unit_host_bytes(u.staged) for u in streamer.units
             if unit_compression(u.staged) != "none" and unit_host_bytes(u.staged) > planned[u.index]}
    if not grown:  # over the ceiling by the plan's own choice (disk_optional keeps blocks in RAM), said already
        return
    streamer.detach()
    raise EncodedLarger(grown, ram)


def _make_plan(facts: PlanFacts, laid: ModelLayout) -> Plan:
    """`make_plan`; a RAM ceiling refused with host_compression="off" says so when blocks held compressed would keep
    it (the refusal names what to change)."""
    try:
        return planner.make_plan(facts)
    except RamCeilingError as exc:
        if facts.host_compression != "off" or facts.host is None or not facts.host.hard or not facts.sizes:
            raise
        packed = tuple(estimate_layout_size(layout) for layout in laid.layouts)
        try:
            planner.make_plan(replace(facts, host_compression="lossless", packed_sizes=packed))
        except (RamCeilingError, PlanError):
            raise exc from None
        raise RamCeilingError(f"{exc}; or let blocks be held compressed in RAM (host_compression='auto' or "
                              f"'lossless' keeps this ceiling)") from None


def _file_facts(laid: ModelLayout) -> dict[str, Any]:
    """`file_casts`, `cast_scratch` and `disk_residue` for the plan: per unit the casts its leaves take on read and
    the RAM it keeps on the disk tier for the leaves its file lacks (exact for units whose bytes were checked, from
    the header for the others), and the read-ahead thread's scratch for the casts."""
    found = [planned_casts(laid.file, layout, laid.candidates.get(i), laid.casts.get(i))
             for i, layout in enumerate(laid.layouts)] if laid.file is not None else []
    residue = tuple(planned_residue(layout, laid.candidates.get(i), laid.keys.get(i) if i in laid.casts else None)
                    for i, layout in enumerate(laid.layouts)) if laid.file is not None else ()
    return {"file_casts": tuple(c for c, _ in found),
            "cast_scratch": cast_scratch_bytes(max((n for c, n in found if c), default=0)),
            "disk_residue": residue if any(residue) else ()}


def _facts(config: OffloadConfig, name: str, backend: Backend, device_name: str, budget: VramBudget,
           laid: ModelLayout, in_ram: int, file_path: str | None, encoded: dict[int, int]) -> PlanFacts:
    """What the plan is made from at setup; the compute device's share is the whole budget until the model is
    a member (the PlanKeeper plans again for its share then)."""
    mem = read_host_memory()
    if config.ram_budget_bytes is not None:
        ram, hard = int(config.ram_budget_bytes), True
    else:  # what the machine has available, less a margin
        ram, hard = max(0, mem.available + in_ram - min(4 * GIB, int(psutil.virtual_memory().total * 0.1))), False
    share = config.share_host == "auto" and file_path is not None and shared_host.available()
    # the forms of a copy another process filled already: facts for this plan (its encoded sizes are exact)
    in_copy = (shared_host.SharedHostCopy.peek(file_path, laid.layouts, [u.name for u in laid.units]) or {}
               if share and laid.layouts else {})
    host = HostFacts(ram, hard, mem.pin_limit, config.pin_memory and backend.supports_pinned_host,
                     config.allow_disk and file_path is not None, backend.supports_pinned_host, config.disk_optional,
                     file_path, share, tuple(in_copy.get(i, ("", 0))[0] for i in range(len(laid.layouts))))
    sizes = tuple(laid.sizes)
    packed: tuple[int, ...] = ()
    stored = stored_units(laid)  # units a packed folder stores compressed: exact encoded sizes, decoded from disk
    if config.host_compression != "off" and sizes:
        packed = tuple(in_copy[i][1] if in_copy.get(i, ("",))[0] not in ("", "none")
                       else s.stored if s is not None else encoded.get(i) or estimate_layout_size(layout)
                       for i, (s, layout) in enumerate(zip(stored, laid.layouts)))
    forms = tuple(CODEC if s is not None else "none" for s in stored)
    scratch = packed or CODEC in forms
    return PlanFacts(disk_refusals=tuple(laid.refusals), **_file_facts(laid),
        host_compression=config.host_compression, packed_sizes=packed, file_forms=forms,
        decode_scratch=max(scratch_estimate(layout.leaves) for layout in laid.layouts) if scratch else 0,
        name=name, sizes=sizes, names=tuple(u.name for u in laid.units), rest_bytes=laid.rest_bytes,
        prefetch=config.prefetch, stream_all=config.vram_fraction <= 0, device=device_name,
        allowance=max(laid.rest_bytes + max(sizes), budget.total_bytes or 0),
        dtypes=tuple(tuple(sorted({str(leaf.dtype) for leaf in layout.leaves})) for layout in laid.layouts),
        disk_ok=tuple(laid.disk_ok), host=host,
        from_file=tuple(any(leaf.meta for leaf in layout.leaves) for layout in laid.layouts))
