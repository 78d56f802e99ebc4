"""`offload_module` and the handle it returns: one offloaded model, a member of a VramBudget.

The model keeps its handle alive (it is stored on the model); the handle refers to the model weakly. The handle
is the streamer's pass listener: at the start of every pass it asks the budget for its allowance and re-plans.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable

import psutil
import torch
import torch.nn as nn

from .backends import get_backend, resolve_device
from .blocks import find_units
from .budget import VramBudget, default_budget
from .config import OffloadConfig
from .cost_model import CostPlan, CostTracker, plan_by_cost
from .devices import ActivationHop, SecondaryShare, place_remote
from .layout import unit_tensors
from .metrics import OffloadReport, effective_gbps, overlap_ratio
from .planner import (GIB, MIB, HostPlan, bounce_buffers, PlanError, RamCeilingError, UnitPlan, default_reserve, estimate_reserve,
                      plan_host,
                      plan_host_capped, plan_units, read_host_memory, ring_slots)
from .staging import lay_out_model, stage_model, verify_for_disk
from .packed import open_weights
from .streamer import DeviceMemoryError, ModelStreamer

log = logging.getLogger(__name__)

HANDLE_ATTR = "_layer_offload_handle"
COST_EVERY = 4  # once every block was measured, per-block timings are folded in every this many passes (O(blocks))


class DetachedError(RuntimeError):
    """A handle was used after `detach()`: offload the model again to stream it."""


class OffloadHandle:
    """Controls one offloaded model: its report, its priority in the budget, and detaching it."""

    def __init__(self, model: nn.Module, config: OffloadConfig, name: str, priority: int,
                 budget: VramBudget | dict[str, VramBudget] | None, units: list[str] | None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload_module needs an nn.Module, got {type(model).__name__}")
        if getattr(model, HANDLE_ATTR, None) is not None:
            raise ValueError(f"{name!r} is already offloaded; detach() its handle first")
        self.config = config
        self.name = name
        self.priority = _check_priority(priority)
        self._model = weakref.ref(model)
        self.backend = get_backend(config)
        free, total = self.backend.mem_get_info()
        if config.vram_budget_bytes is not None and config.vram_budget_bytes > total:
            raise ValueError(f"vram_budget_bytes={config.vram_budget_bytes} is larger than the device "
                             f"{self.backend.describe()} ({total} bytes); the limit is {total} bytes")
        found = find_units(model, units)
        self.device_name = resolve_device(config.device)
        secondaries = list(config.devices[1:]) if config.devices else []
        budgets = budget if isinstance(budget, dict) else {}
        self.budget = (budgets.get(self.device_name) or (budget if isinstance(budget, VramBudget) else None)
                       or default_budget())
        self.secondary_backends = {d: get_backend(config, d) for d in secondaries}
        self._secondary_budgets = {d: budgets.get(d) or default_budget(d) for d in secondaries}
        for d, b in self._secondary_budgets.items():  # sized (when self-sized) and checked before staging
            back = self.secondary_backends[d]
            d_free, d_total = back.mem_get_info()
            b.resolve_total(max(0, min(d_free, d_total) - default_reserve(d_total, back.name)), back)
            b.check_device(d_total)
        reserve = (config.reserve_bytes if config.reserve_bytes is not None
                   else estimate_reserve(model, total, self.backend.name))
        self.budget.resolve_total(max(0, min(free, total) - reserve), self.backend)
        self.budget.check_device(total)  # before staging: a refused model is left exactly as it was
        self.reserve_bytes = reserve
        self._notices: dict[str, str] = {}
        self._in_ram = sum(t.numel() * t.element_size() for u in found for _, _, _, t in unit_tensors(u.module)
                           if t.device.type == "cpu")
        file = open_weights(config.disk_path) if config.disk_path else None  # a safetensors file or a packed folder
        self._file_path = str(file.path) if file is not None else None
        try:
            laid = lay_out_model(model, found, file, config.disk_optional)
            host_plan = self._host_tiers(laid.sizes, laid.rest_bytes)
            tiers = {i: t if t != "disk" or laid.disk_ok[i] else "pageable" for i, t in host_plan.tiers.items()}
            for i in verify_for_disk(laid, [i for i, t in tiers.items() if t == "disk"]):
                tiers[i] = "pageable"
            staged = stage_model(laid, tiers, self.backend, config.pin_memory, bounce_buffers(config.prefetch),
                                 host_plan.bounce_bytes, progress)
        except BaseException:
            if file is not None:
                file.close()
            raise
        self.streamer = ModelStreamer(model, staged, self.backend, self, config.pin_memory, config.prefetch,
                                      config.profile)
        self.streamer.placement.secondaries = dict(self.secondary_backends)
        self._shares = {d: SecondaryShare(self, d, self.secondary_backends[d], b)
                        for d, b in self._secondary_budgets.items()}
        self._remote_allowance: dict[str, int] = {}
        self._hop: ActivationHop | None = None
        if self._shares:
            self._hop = ActivationHop(self.streamer.placement, self.backend, dict(self.secondary_backends))
            self._hop.install([u.staged.module for u in self.streamer.units])
        if config.ram_budget_bytes is not None:
            self._check_ram_ceiling(int(config.ram_budget_bytes))
        self._sizes = [u.nbytes for u in self.streamer.units]
        self._names = [u.staged.name for u in self.streamer.units]
        self._plan: UnitPlan | None = None
        self._costs = CostTracker(self._sizes)  # per-unit compute and copy times, for placement from measured costs
        self._passes = 0
        self._cost_cache: tuple[Any, ...] | None = None
        self._allowance: int | None = None
        self._oom_free: int | None = None  # free device bytes after an out-of-memory shrink; None: not capped
        self._measured_reserve = False
        self._measured_backward = False  # the reserve was re-measured after a training step (after_backward)
        self._grad_said = False
        self._final_report: OffloadReport | None = None
        self._reads_base: dict[int, int] = {}
        self._worker_base = (0, 0)  # demand loads and prefetch hits at the last reset_stats()
        self._disk_read_base = 0
        self._kv: Any = None  # the model's KVPager, once asked for
        if config.pin_memory and self.backend.supports_pinned_host and any(
                u.master.host is not None and not u.master.pinned for u in staged.units):
            self._notice("pinned_fallback", "pinning was refused or over the pin limit: some blocks stream from "
                                            "pageable memory through a bounce buffer (slower copies)")
        disk = sum(1 for u in staged.units if u.master.host is None)
        if disk:
            self._notice("disk_tier", f"{disk} block(s) stream from {self._file_path}: host RAM is short")
        setattr(model, HANDLE_ATTR, self)  # the model keeps its engine alive; the engine refers back weakly
        try:
            self.budget.register(self)
            for share in self._shares.values():
                share.budget.register(share)
            self._remote_allowance = self._remote_allowances()
            self._replan(self.budget.allowance(self))
        except BaseException:
            self.budget.unregister(self)
            for share in self._shares.values():
                share.budget.unregister(share)
            if self._hop is not None:
                self._hop.remove()
            self.streamer.detach()
            model.__dict__.pop(HANDLE_ATTR, None)
            raise
        log.info("offloaded %s: %d units (%s), %s", name, len(found), self.backend.describe(), self.plan_summary())

    # several devices ------------------------------------------------------------------------
    def _remote_allowances(self) -> dict[str, int]:
        """Bytes this model may keep on each secondary device now (idle others give back what it is owed)."""
        return {d: share.budget.allowance(share) for d, share in self._shares.items()}

    def _remote_plan(self, plan: UnitPlan) -> dict[int, str]:
        """Which of the blocks the compute device streams go to which secondary device."""
        if not self._shares:
            return {}
        if plan.remote is not None:
            return plan.remote
        streamed = [i for i in range(len(self._sizes)) if i not in plan.resident]
        return place_remote(streamed, self._sizes, self._remote_allowance)

    def _plan_across_devices(self, plan: UnitPlan, allowance: int) -> UnitPlan:
        """With secondary devices: when the compute device's share and theirs hold every block, fill the compute
        device first and the secondary devices after, with no slot ring (nothing streams); else keep `plan` and
        let the secondary devices take what it streams."""
        if not self._shares or self.config.vram_fraction <= 0 or len(plan.resident) == len(self._sizes):
            return plan
        rest = self.streamer.rest_bytes
        avail, used, first = allowance - rest, 0, set()
        for i, size in enumerate(self._sizes):
            if used + size <= avail:
                first.add(i)
                used += size
        others = [i for i in range(len(self._sizes)) if i not in first]
        remote = place_remote(others, self._sizes, self._remote_allowance)
        if len(remote) < len(others):
            return plan
        return UnitPlan(first, 0, 0, rest + used, remote=remote)

    def remote_want_bytes(self) -> int:
        """What this model could keep on a secondary device: every block (the budget caps it)."""
        return sum(self._sizes)

    def remote_bytes(self, device: str) -> int:
        """Bytes of blocks resident on secondary `device` now."""
        return self.streamer.placement.bytes_on(device) if self.attached else 0

    def shrink_remote(self, device: str, nbytes: int) -> int:
        """Called by a secondary device's budget while this model is idle: keep at most `nbytes` there."""
        if not self.attached:
            return 0
        with self.streamer.exclusive(blocking=False) as idle:
            if not idle or self.streamer.is_busy():
                return 0  # a pass is running: it re-plans at its next start
            freed = self.streamer.placement.unload_remote(device, nbytes)
            if freed:
                self._allowance = None  # re-plan at the next forward: those blocks stream now
            return freed

    def _devices_report(self) -> dict[str, dict[str, int]]:
        p = self.streamer.placement
        out = {self.device_name: {"device_bytes": p.device_bytes(),
                                  "peak_device_bytes": max(p.peak_device_bytes, p.device_bytes()),
                                  "resident_blocks": sum(1 for u in p.units
                                                         if u.resident_buf is not None and u.home is None)}}
        for d in self._shares:
            out[d] = {"device_bytes": p.bytes_on(d), "peak_device_bytes": max(p.peak_on.get(d, 0), p.bytes_on(d)),
                      "resident_blocks": sum(1 for u in p.units if u.home == d)}
            if self._hop is not None:
                out[d]["activation_bytes"] = self._hop.hop_bytes[d]
        return out

    def _check_ram_ceiling(self, ceiling: int) -> None:
        """After staging: blocks planned for disk that could not go there (tensor subclasses, misaligned tensors,
        bytes the file does not hold) may push host RAM over the ceiling; then the model is given back as it was."""
        ram = self.streamer.host_memory()["ram"]
        if ram <= ceiling:
            return
        kept = sum(1 for u in self.streamer.units if u.master.host is not None)
        if self.config.disk_optional:  # asked for: blocks the file does not hold stay in RAM rather than fail
            log.warning("%s: host RAM is %d bytes, over ram_budget_bytes=%d: %d block(s) could not go to the disk tier "
                        "(disk_optional=True keeps them in RAM)", self.name, ram, ceiling, kept)
            return
        self.streamer.detach()
        raise RamCeilingError(f"{self.name}: ram_budget_bytes={ceiling} cannot be kept: {kept} block(s) cannot stream "
                              f"from disk (tensor subclasses, misaligned tensors, or bytes {self._file_path} does not "
                              f"hold) and need {ram} bytes of host RAM; raise ram_budget_bytes to at least {ram}")

    @property
    def model(self) -> nn.Module | None:
        """The offloaded model (None once it was garbage collected)."""
        return self._model()

    @property
    def attached(self) -> bool:
        return self._final_report is None

    def _check_attached(self, what: str) -> None:
        if not self.attached:
            raise DetachedError(f"{self.name}: {what}() after detach(); the model is an ordinary module again "
                                f"(call offload_module() to stream it again)")

    def _notice(self, kind: str, message: str) -> None:
        if kind not in self._notices:
            self._notices[kind] = message

    def _host_tiers(self, sizes: list[int], rest_bytes: int) -> HostPlan:
        """Tiers for the units' host masters: pinned RAM, pageable RAM, or the disk file.

        `ram_budget_bytes` is a ceiling on everything the engine holds in host RAM for this model (the weights
        outside the blocks, the blocks kept in RAM and the read-ahead bounce buffers); without it the planner
        reads what the machine has free and only warns when the blocks need more.
        """
        cfg = self.config
        mem = read_host_memory()
        allow_disk = cfg.allow_disk and cfg.disk_path is not None
        pin = cfg.pin_memory and self.backend.supports_pinned_host
        if cfg.ram_budget_bytes is not None:
            ram_budget = int(cfg.ram_budget_bytes)
            plan = plan_host_capped(sizes, rest_bytes, ram_budget, mem.pin_limit if pin else 0, allow_disk, pin,
                                    cfg.prefetch, self.backend.supports_pinned_host)
        else:
            margin = min(4 * GIB, int(psutil.virtual_memory().total * 0.1))
            ram_budget = max(0, mem.available + self._in_ram - margin)
            plan = plan_host(sizes, ram_budget, mem.pin_limit if pin else 0, allow_disk, pin)
            if plan.ram_bytes > ram_budget:
                log.warning("%s needs %.2f GiB of host RAM for its blocks but about %.2f GiB is available; "
                            "give disk_path (its safetensors file) to stream the rest from disk", self.name,
                            plan.ram_bytes / GIB, ram_budget / GIB)
        disk = sum(1 for t in plan.tiers.values() if t == "disk")
        if disk:
            log.info("%s: %d unit(s) stream from %s (RAM budget %.1f MB)", self.name, disk, cfg.disk_path,
                     ram_budget / MIB)
        return plan

    # pass listener ------------------------------------------------------------------
    def before_pass(self) -> None:
        """The safe point before a forward: take this model's share of the budget, growing back after an OOM."""
        self._warn_grad()
        if not self._measured_reserve:
            self.backend.reset_peak_allocated()
        self.budget.touch(self, self._kv, *self._shares.values())  # recency: the model that runs now (budget.py)
        allowance = self.budget.allowance(self)
        need = min(self.floor_bytes(), self.want_bytes())
        if allowance < need:
            # Models running on other threads still hold bytes a lowered total took from them; they give them back
            # at their next safe point. Hold nothing meanwhile (so none waits on us), then take our share.
            self.streamer.unload()
            self.budget.notify_room()
            allowance = self.budget.wait_for_room(self, need)
        remote = self._remote_allowances()
        if (allowance != self._allowance or remote != self._remote_allowance or not self.streamer.loaded
                or self._may_grow_back(allowance)):
            self._remote_allowance = remote
            self._replan(allowance, place=True)
            self.budget.notify_room()  # a smaller plan may have given bytes back

    def _fold_costs(self) -> bool:
        """Read the last passes' per-unit timings; True when placement should be re-planned from them (the first
        time every unit was measured, and whenever a unit's times moved a lot since)."""
        if not self._costs.update(*self.streamer.metrics.lifetime()):
            return False
        if self._oom_free is not None:
            return False  # capped after an out-of-memory shrink: the plan grows back only when memory frees up
        first = self._plan is not None and not isinstance(self._plan, CostPlan) and self._costs.ready
        return first or self._costs.shifted()

    def after_pass(self) -> None:
        """After the first forward: correct the activation reserve of a self-sized budget from the real peak."""
        self.budget.notify_room()  # models waiting for bytes this one holds look again
        self._passes += 1
        if (self._allowance is not None and self.streamer.loaded
                and (not self._costs.ready or self._passes % COST_EVERY == 0) and self._fold_costs()):
            # re-placed at the end of a pass, so the next pass's first blocks are prefetched in the gap before it
            self._replan(self._allowance, place=True)
            self.streamer.worker.fill()
        if self._measured_reserve:
            return
        self._measured_reserve = True
        peak = self.backend.peak_allocated()
        if peak is None or not self.budget.auto_sized or self.config.reserve_bytes is not None:
            return
        measured = int(max(0, peak - self.budget.used_bytes) * 1.25) + 256 * MIB
        if abs(measured - self.reserve_bytes) > 64 * MIB:
            self.budget.adjust_total(self.reserve_bytes - measured, self.device_total())
            log.info("activation reserve corrected from %.2f to %.2f GiB after the first run",
                     self.reserve_bytes / GIB, measured / GIB)
            self.reserve_bytes = measured

    def after_backward(self) -> None:
        """After the first backward through streamed blocks (training): a step's peak holds the activations saved
        for backward, the gradients and the trainable adapters, more than a forward's; the activation reserve of a
        self-sized budget grows to it (it never shrinks here)."""
        if self._measured_backward:
            return
        self._measured_backward = True
        peak = self.backend.peak_allocated()
        if peak is None or not self.budget.auto_sized or self.config.reserve_bytes is not None:
            return
        measured = int(max(0, peak - self.budget.used_bytes) * 1.25) + 256 * MIB
        if measured > self.reserve_bytes + 64 * MIB:
            self.budget.adjust_total(self.reserve_bytes - measured, self.device_total())
            log.info("activation reserve grown from %.2f to %.2f GiB after the first training step",
                     self.reserve_bytes / GIB, measured / GIB)
            self.reserve_bytes = measured

    def _warn_grad(self) -> None:
        if self._grad_said or not torch.is_grad_enabled():
            return
        model = self.model
        if model is not None and any(p.requires_grad for p in model.parameters()):
            self._grad_said = True
            log.info("%s: running with gradients enabled: backward brings streamed blocks back in reverse order "
                     "(adapters added after offloading train; streamed weights that require grad are refused); "
                     "use torch.no_grad() for inference", self.name)

    # budget member --------------------------------------------------------------------
    def floor_bytes(self) -> int:
        """The least this model can run in: the non-block weights plus one slot of its largest unit."""
        return self.streamer.rest_bytes + max(self._sizes)

    def want_bytes(self) -> int:
        cfg = self.config
        everything = self.streamer.rest_bytes + sum(self._sizes)
        ring = self.streamer.rest_bytes + ring_slots(cfg.prefetch, len(self._sizes)) * max(self._sizes)
        if cfg.vram_fraction <= 0:
            want = ring
        elif cfg.vram_fraction < 1 and self.budget.total_bytes is not None:
            want = max(ring, min(everything, int(cfg.vram_fraction * self.budget.total_bytes)))
        else:
            want = everything
        if cfg.vram_budget_bytes is not None:
            want = min(want, int(cfg.vram_budget_bytes))
        return want

    def device_bytes(self) -> int:
        """Device bytes this model holds now (resident units, the slot ring, the non-block weights)."""
        return self.streamer.device_bytes() if self.attached else 0

    def is_busy(self) -> bool:
        return self.attached and self.streamer.is_busy()

    def pass_thread(self) -> int | None:
        """The thread running a pass over this model now (None between passes)."""
        return self.streamer._pass_owner if self.attached else None

    def kv_device_bytes(self) -> int:
        """Device bytes of this model's paged KV caches now (a budget member of their own)."""
        return self._kv.device_bytes() if self._kv is not None else 0

    def device_total(self) -> int | None:
        return self.backend.mem_get_info()[1]

    def shrink_to(self, nbytes: int) -> int:
        """Called by the budget while this model is idle: hold at most `nbytes` from now on."""
        if not self.attached:
            return 0
        with self.streamer.exclusive(blocking=False) as idle:
            if not idle or self.streamer.is_busy():
                return 0  # a pass is running (maybe on another thread): it re-plans at its next start
            before = self.device_bytes()
            if before <= nbytes:
                return 0
            if nbytes < self.floor_bytes():
                self.streamer.unload()
                self._allowance = None  # replan at the next forward
            else:
                self._replan(nbytes)
            return before - self.device_bytes()

    # planning -----------------------------------------------------------------------------
    def _make_plan(self, allowance: int) -> UnitPlan:
        """Count-based until every unit was measured; from measured costs after that (see cost_model.py)."""
        stream_all = self.config.vram_fraction <= 0
        try:
            if not self._costs.ready:
                return plan_units(self._sizes, self._names, self.streamer.rest_bytes, allowance,
                                  self.config.prefetch, stream_all=stream_all)
            costs = self._costs.costs()
            same_share = self._plan is not None and allowance == self._allowance
            current = set(self._plan.resident) if same_share else None
            key = (allowance, stream_all, tuple(costs.compute_ms), tuple(costs.copy_ms),
                   None if current is None else tuple(sorted(current)))
            if self._cost_cache is not None and self._cost_cache[0] == key:
                return self._cost_cache[1]
            plan = plan_by_cost(self._sizes, self._names, self.streamer.rest_bytes, allowance, self.config.prefetch,
                                costs, stream_all=stream_all, current=current)
            self._cost_cache = (key, plan, costs)
            return plan
        except PlanError as exc:
            raise DeviceMemoryError(f"{self.name}: {exc}. {self._share_explained(allowance)}") from None

    def _share_explained(self, allowance: int) -> str:
        """Where this model's allowance came from: the budget's total, what the others hold, its own limit."""
        total = self.budget.total_bytes
        parts = []
        if total is not None and allowance < total:
            held = self.budget.others_bytes(self)
            parts.append(f"This model's share is {allowance} bytes of the VRAM budget's {total} bytes "
                         f"({held} bytes are held by other models)")
        if self.config.vram_budget_bytes is not None and allowance >= int(self.config.vram_budget_bytes):
            parts.append(f"vram_budget_bytes={int(self.config.vram_budget_bytes)} limits this model")
        parts.append(self.budget.explain())
        return ". ".join(parts)

    def _may_grow_back(self, allowance: int) -> bool:
        """After an out-of-memory shrink: whether the device has room again for the plan the budget allows."""
        if self._oom_free is None:
            return False
        free, _ = self.backend.mem_get_info()
        if free <= self._oom_free:
            return False  # nothing came free since the shrink: do not thrash
        want = self._make_plan(allowance).device_bytes
        return free >= want - self.streamer.device_bytes()

    def _replan(self, allowance: int, place: bool = False) -> None:
        """Plan for `allowance` bytes; place it now when asked or when the model is on the device already.

        An out-of-memory error while placing (the device holds more than the budget knows of) shrinks the
        resident set and retries, with one log line; the resident set grows back at a later pass start once the
        device has room again. A plan that cannot even hold one slot is an error naming the unit and its size.
        """
        plan = self._plan_across_devices(self._make_plan(allowance), allowance)
        if plan.shrunk_lookahead and (self._plan is None or not self._plan.shrunk_lookahead):
            for note in plan.notes:
                log.warning("%s: %s", self.name, note)
                self._notice("lookahead_shrunk", note)
        self._allowance = allowance
        self._plan = plan
        if isinstance(plan, CostPlan) and self._cost_cache is not None:
            self._costs.planned(self._cost_cache[2])
        if not (place or self.streamer.loaded):
            self.streamer.set_plan(plan.resident, plan.n_slots, self._remote_plan(plan))
            return
        shrunk = False
        while True:
            try:
                self.streamer.set_plan(plan.resident, plan.n_slots, self._remote_plan(plan))
                self.streamer.ensure_loaded()
                break
            except torch.OutOfMemoryError as exc:
                self.streamer.unload()
                free, _ = self.backend.mem_get_info()
                smaller = min(plan.device_bytes - 1, free)
                if not shrunk:
                    log.warning("%s: device out of memory while placing blocks (%s); shrinking the resident set "
                                "until memory frees up", self.name, str(exc).splitlines()[0])
                    self._notice("oom_shrink", "the device ran out of memory while placing blocks: fewer blocks "
                                               "stay resident until memory frees up")
                shrunk = True
                try:
                    plan = plan_units(self._sizes, self._names, self.streamer.rest_bytes, smaller,
                                      self.config.prefetch, stream_all=self.config.vram_fraction <= 0)
                except PlanError as err:
                    raise DeviceMemoryError(f"{self.name}: out of device memory: {err}") from None
                self._plan = plan
        if shrunk:
            self._oom_free = self.backend.mem_get_info()[0]
        elif self._oom_free is not None:
            self._oom_free = None
            log.info("%s: device memory is free again; the resident set grew back (%s)", self.name,
                     self.plan_summary())

    # sizes ---------------------------------------------------------------------------------
    def unit_bytes(self) -> dict[str, int]:
        """Each unit's size as it moves (aligned layout): what slots and resident units really take."""
        return dict(zip(self._names, self._sizes))

    @property
    def non_block_bytes(self) -> int:
        """Device bytes of the weights outside the units (always resident)."""
        return self.streamer.rest_bytes

    def budget_for(self, resident_units: int = 0, prefetch: int | None = None) -> int:
        """Device bytes a plan with the `resident_units` largest units resident and a full ring would need."""
        prefetch = self.config.prefetch if prefetch is None else prefetch
        sizes = sorted(self._sizes, reverse=True)
        resident = sizes[:resident_units]
        streamed = sizes[resident_units:]
        ring = ring_slots(prefetch, len(streamed)) * max(streamed) if streamed else 0
        return self.streamer.rest_bytes + sum(resident) + ring

    def planned_device_bytes(self) -> int:
        """Device bytes the plan for this model's current share of the budget holds when placed."""
        if not self.attached:
            return 0
        share = self.budget.targets().get(id(self))
        allowance = self._allowance if share is None else min(share, self.want_bytes())
        if allowance is None:
            allowance = self.budget.allowance(self)
        return self._make_plan(max(allowance, min(self.floor_bytes(), self.want_bytes()))).device_bytes

    def plan_summary(self) -> str:
        p = self._plan
        if p is None:
            return "no plan"
        return (f"{len(p.resident)} resident, {len(self._sizes) - len(p.resident)} streamed, "
                f"{p.n_slots} slot(s) of {p.slot_bytes / 1e6:.1f} MB, plan {p.device_bytes / 1e6:.1f} MB")

    # public API -------------------------------------------------------------------------------
    def load(self) -> None:
        """Place the resident set and the slot ring now instead of at the next forward."""
        self._check_attached("load")
        with self.streamer.exclusive():
            self.before_pass()
            self.streamer.ensure_loaded()

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: all); returns the bytes freed."""
        self._check_attached("unload")
        if nbytes is not None:
            if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0 or \
                    not math.isfinite(nbytes):
                raise ValueError(f"unload(nbytes) takes a number of bytes >= 0 or None (everything), got {nbytes!r}")
        freed = self.streamer.unload(None if nbytes is None else int(nbytes))
        self._allowance = None
        return freed

    def host_memory(self) -> dict[str, int]:
        """Host bytes this model holds: `ram` (blocks, non-block weights, bounce buffers), of which `pinned`, and
        `disk` (blocks streamed from the model's file)."""
        if not self.attached:
            return {"ram": 0, "pinned": 0, "disk": 0}
        return self.streamer.host_memory()

    def release_host_memory(self, nbytes: int) -> int:
        """Give host RAM back: blocks whose exact bytes the model's file (`disk_path`) holds move to the disk tier.

        Returns the bytes freed, net of the bounce buffers the disk tier needs (0 without a file, when no block matches
        it, or when the preset keeps every block in RAM). Streaming goes on, from disk.
        """
        self._check_attached("release_host_memory")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"release_host_memory(nbytes) takes a number of bytes >= 0, got {nbytes!r}")
        if not self.config.allow_disk:
            return 0  # the preset keeps every block in RAM (high_end, mid_range)
        freed = self.streamer.release_host_memory(int(min(nbytes, 1 << 62)))
        if freed:
            self._notice("disk_tier", f"blocks stream from {self._file_path}: host RAM was released on request")
        return freed

    def refresh(self) -> None:
        """Call after writing weights in place through `.data` (writes that version counters cannot see).

        `load_state_dict`, `param.copy_()` and other in-place writes on the parameters are noticed on their own.
        """
        self._check_attached("refresh")
        self.streamer.refresh()

    def set_priority(self, priority: int) -> None:
        """Change this model's priority in its budget; takes effect at its next forward."""
        self._check_attached("set_priority")
        self.priority = _check_priority(priority)
        if self._kv is not None:
            self._kv.priority = self.priority
            self.budget.priority_changed(self._kv)
        self.budget.priority_changed(self)
        for share in self._shares.values():
            share.budget.priority_changed(share)

    def kv_pager(self, page_tokens: int = 64, offload: bool = True) -> Any:
        """This model's paged KV cache store (offload/kv_cache.py): caches made from it live under the same budget
        as the weights, at the same priority, and show in the report. Needs transformers."""
        self._check_attached("kv_pager")
        kv = self._kv
        if kv is None or kv.page_tokens != page_tokens or kv.offload_enabled != offload:
            from .kv_cache import KVPager

            if kv is not None:
                self.budget.unregister(kv)
            self._kv = KVPager(self.backend, self.budget, self.name, self.priority, page_tokens, offload)
        return self._kv

    def mark_active(self) -> None:
        """This model is about to work (ComfyUI loads it for a node): it leads its priority in the budget now."""
        self._check_attached("mark_active")
        self.budget.touch(self, self._kv, *self._shares.values(), explicit=True)

    def prioritize(self) -> None:
        """Give this model the highest priority in its budget and clear its watermark."""
        self._check_attached("prioritize")
        self.budget.prioritize(self)

    def reset_stats(self) -> None:
        """Start the report afresh (what the next runs do, not every run since setup)."""
        self._check_attached("reset_stats")
        s = self.streamer
        if s.staged.reader is not None:
            s.staged.reader.drain()
        s.metrics.reset()
        s.peak_device_bytes = s.device_bytes()
        self.backend.reset_peak()
        self._reads_base = {id(src): src.reads for src in s.sources}
        self._worker_base = (s.worker.demand_loads, s.worker.prefetch_hits)
        self._disk_read_base = s.staged.reader.counters.bytes_read if s.staged.reader is not None else 0

    def report(self) -> OffloadReport:
        """Per-unit and total figures since setup or the last `reset_stats()` (the last report after detach)."""
        if self._final_report is not None:
            return self._final_report
        s = self.streamer
        reader = s.staged.reader
        if reader is not None:
            reader.drain()
        blocks = s.block_reports()
        for b, src in zip(blocks, s.sources):
            b.reads = max(0, b.reads - self._reads_base.get(id(src), 0))
        if isinstance(self._plan, CostPlan):
            for b, stall, reason in zip(blocks, self._plan.predicted_stall_ms, self._plan.reasons):
                b.predicted_stall_ms, b.placement = stall, reason
        for b, u in zip(blocks, s.units):
            b.device = u.home or self.device_name
        h2d, compute, stall, nbytes = s.metrics.totals()
        return OffloadReport(
            name=self.name, device=self.backend.describe(), preset=self.config.preset, priority=self.priority,
            blocks=blocks, total_bytes_streamed=nbytes, overlap_ratio=overlap_ratio(h2d, stall),
            effective_gbps=effective_gbps(nbytes, h2d),
            resident_bytes=s.rest_bytes + sum(u.nbytes for u in s.units if u.index in s.resident_set),
            peak_device_bytes=max(s.peak_device_bytes, s.device_bytes()), device_bytes=s.device_bytes(),
            slot_bytes=s.slot_bytes, slots=len(s.slots), forwards=s.metrics.forwards, stall_ms=stall, h2d_ms=h2d,
            compute_ms=compute,
            disk_bytes_read=(reader.counters.bytes_read - self._disk_read_base) if reader is not None else 0,
            notices=[{"kind": k, "message": m} for k, m in self._notices.items()],
            kv=self._kv.report() if self._kv is not None else None,
            timeline=list(s.metrics.timeline), devices=self._devices_report(),
            budget_reason=self.budget.explain_share(self),
            demand_loads=s.worker.demand_loads - self._worker_base[0],
            prefetch_hits=s.worker.prefetch_hits - self._worker_base[1])

    def detach(self) -> None:
        """Remove every hook; every weight becomes an ordinary tensor with its original values.

        Raises SourceChangedError (and changes nothing) when blocks live only in a file that changed on disk.
        """
        if not self.attached:
            return
        final = self.report()
        self.streamer.detach()
        if self._hop is not None:
            self._hop.remove()
        self.budget.unregister(self)
        for share in self._shares.values():
            share.budget.unregister(share)
        if self._kv is not None:
            self.budget.unregister(self._kv)
        model = self.model
        if model is not None and model.__dict__.get(HANDLE_ATTR) is self:
            del model.__dict__[HANDLE_ATTR]
        self._final_report = final

    def pack(self, out_dir: str, shard_bytes: int | None = None, overwrite: bool = False) -> str:
        """Write this model's weights as a packed folder (offload/packed.py): units in the call order the engine
        learned, each laid out as the engine's flat buffer, so `disk_path=out_dir` streams each unit with one read.
        Returns the index path."""
        self._check_attached("pack")
        from .packed import DEFAULT_SHARD_BYTES, pack_handle

        return str(pack_handle(self, out_dir, shard_bytes or DEFAULT_SHARD_BYTES, overwrite))


def _check_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or not math.isfinite(priority) \
            or int(priority) != priority:
        raise ValueError(f"priority must be a whole number (higher keeps more blocks resident), got {priority!r}")
    return int(priority)


def _check_arguments(model: Any, config: OffloadConfig, name: Any, budget: Any, units: Any, progress: Any) -> None:
    """Wrong argument types fail here, naming the argument and what it takes, before anything is touched."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (shown in logs and the report), got {type(name).__name__} {name!r}")
    if isinstance(budget, dict):
        devices = list(config.devices) if config.devices else [resolve_device(config.device)]
        for device, b in budget.items():
            if device not in devices:
                raise ValueError(f"budget names device {device!r}, which is not one of this model's devices "
                                 f"{devices} (OffloadConfig(devices=[...]))")
            if not isinstance(b, VramBudget):
                raise TypeError(f"budget[{device!r}] must be a VramBudget, got {type(b).__name__} {b!r}")
    elif budget is not None and not isinstance(budget, VramBudget):
        hint = (" (a size in bytes goes in VramBudget(nbytes), e.g. budget=VramBudget(4 << 30) for 4 GiB, or in "
                "OffloadConfig(vram_budget_bytes=...) for this model alone)")
        raise TypeError(f"budget must be a VramBudget, a dict {{device: VramBudget}} or None (the process-wide "
                        f"default_budget()), got {type(budget).__name__} {budget!r}{hint}")
    if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
        raise TypeError(f"units must be a list of module names (e.g. ['blocks.0', 'blocks.1']) or None, got {units!r}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable(done, total) or None, got {type(progress).__name__}")


def offload_module(model: nn.Module, config: OffloadConfig | None = None, name: str | None = None,
                   priority: int = 0, budget: VramBudget | dict[str, VramBudget] | None = None,
                   units: list[str] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> OffloadHandle:
    """Stream `model`'s blocks from host memory to the device from now on; returns the handle."""
    config = config if config is not None else OffloadConfig.from_preset("auto")
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (OffloadConfig.from_preset(...)), got {type(config).__name__}")
    _check_arguments(model, config, name, budget, units, progress)
    grad = torch.is_grad_enabled()  # the caller's: trainable parameters in blocks stay on the device only with grad
    with torch.inference_mode(False), torch.set_grad_enabled(grad):  # buffers and views serve grad and inference calls
        return OffloadHandle(model, config, name or type(model).__name__, priority, budget, units, progress)
