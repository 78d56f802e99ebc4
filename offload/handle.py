"""`offload_module` and the handle it returns: one offloaded model, a member of a VramBudget."""
from __future__ import annotations

import logging
from typing import Callable

import psutil
import torch
import torch.nn as nn

from .backends import get_backend
from .blocks import find_units
from .budget import VramBudget, default_budget
from .config import OffloadConfig
from .metrics import BlockReport, OffloadReport, effective_gbps, overlap_ratio
from .planner import GIB, MIB, HostPlan, PlanError, UnitPlan, estimate_reserve, plan_host, plan_units, read_host_memory
from .staging import unit_tensors
from .storage import SafetensorsFile
from .streamer import DeviceMemoryError, ModelStreamer

log = logging.getLogger(__name__)


class OffloadHandle:
    """Controls one offloaded model: its report, its priority in the budget, and detaching it."""

    def __init__(self, model: nn.Module, config: OffloadConfig, name: str, priority: int,
                 budget: VramBudget | None, units: list[str] | None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"offload_module needs an nn.Module, got {type(model).__name__}")
        if getattr(model, "_layer_offload_handle", None) is not None:
            raise ValueError(f"{name!r} is already offloaded; detach() its handle first")
        self.config = config
        self.name = name
        self.priority = int(priority)
        self.model = model
        self.backend = get_backend(config)
        free, total = self.backend.mem_get_info()
        if config.vram_budget_bytes is not None and config.vram_budget_bytes > total:
            raise ValueError(f"vram_budget_bytes={config.vram_budget_bytes} is larger than the device "
                             f"{self.backend.describe()} ({total} bytes); the limit is {total} bytes")
        found = find_units(model, units)
        self.budget = budget if budget is not None else default_budget()
        reserve = (config.reserve_bytes if config.reserve_bytes is not None
                   else estimate_reserve(model, total, self.backend.name))
        self.budget.resolve_total(max(0, min(free, total) - reserve), self.backend)
        self.budget.check_device(total)  # before staging: a refused model is left exactly as it was
        self.file = SafetensorsFile(config.disk_path) if config.disk_path else None
        self.reserve_bytes = reserve
        self.host_plan: HostPlan | None = None
        self._in_ram = sum(t.numel() * t.element_size() for u in found for _, _, _, t in unit_tensors(u.module)
                           if t.device.type == "cpu")
        try:
            self.streamer = ModelStreamer(model, found, self.backend, config.pin_memory, config.profile,
                                          on_forward_start=self._on_forward_start, progress=progress,
                                          prefetch=config.prefetch, file=self.file, host_plan=self._plan_host)
        except Exception:
            if self.file is not None:
                self.file.close()
            raise
        self.streamer.on_forward_end = self._on_forward_end
        self.streamer.on_forward_begin = self._warn_grad
        self._measured_reserve = False
        self._sizes = [u.nbytes for u in self.streamer.units]
        self._names = [u.name for u in self.streamer.units]
        self._plan: UnitPlan | None = None
        self._allowance: int | None = None
        self._oom_said = False
        model._layer_offload_handle = self
        try:
            self.budget.register(self)
            self._replan(self.budget.allowance(self))
        except Exception:
            self._undo()
            raise
        log.info("offloaded %s: %d units (%s), %s", name, len(found), self.backend.describe(), self.plan_summary())

    def _plan_host(self, sizes: list[int]) -> dict[int, str]:
        """Tiers for the units' host masters: pinned RAM, pageable RAM, or the disk file."""
        cfg = self.config
        mem = read_host_memory()
        if cfg.ram_budget_bytes is not None:
            ram_budget = int(cfg.ram_budget_bytes)
        else:
            margin = min(4 * GIB, int(psutil.virtual_memory().total * 0.1))
            ram_budget = max(0, mem.available + self._in_ram - margin)
        allow_disk = cfg.allow_disk and self.file is not None
        pin = cfg.pin_memory and self.backend.supports_pinned_host
        plan = plan_host(sizes, ram_budget, mem.pin_limit if pin else 0, allow_disk, pin)
        self.host_plan = plan
        if plan.ram_bytes > ram_budget:
            log.warning("%s needs %.2f GiB of host RAM for its blocks but about %.2f GiB is available; "
                        "give disk_path (its safetensors file) to stream the rest from disk", self.name,
                        plan.ram_bytes / GIB, ram_budget / GIB)
        disk = sum(1 for t in plan.tiers.values() if t == "disk")
        if disk:
            log.info("%s: %d unit(s) stream from %s (RAM budget %.1f MB)", self.name, disk, self.file.path,
                     ram_budget / MIB)
        return dict(plan.tiers)

    def _on_forward_end(self) -> None:
        """After the first forward: correct the activation reserve of a self-sized budget from the real peak."""
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

    def _undo(self) -> None:
        self.budget.unregister(self)
        self.streamer.detach()
        self.model.__dict__.pop("_layer_offload_handle", None)
        if self.file is not None:
            self.file.close()

    # budget member --------------------------------------------------------------
    def floor_bytes(self) -> int:
        return self.streamer.rest_bytes + max(self._sizes)

    def want_bytes(self) -> int:
        cfg = self.config
        everything = self.streamer.rest_bytes + sum(self._sizes)
        ring = self.streamer.rest_bytes + min(cfg.prefetch + 1, len(self._sizes)) * max(self._sizes)
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
        return self.streamer.device_bytes()

    def is_busy(self) -> bool:
        return self.streamer.depth > 0

    def device_total(self) -> int | None:
        return self.backend.mem_get_info()[1]

    def shrink_to(self, nbytes: int) -> int:
        """Called by the budget while this model is idle: hold at most `nbytes` from now on."""
        before = self.device_bytes()
        if before <= nbytes:
            return 0
        if nbytes < self.floor_bytes():
            self.streamer.unload()
            self._allowance = None  # replan at the next forward
        else:
            self._replan(nbytes)
        return before - self.device_bytes()

    # planning -------------------------------------------------------------------
    def _on_forward_start(self) -> None:
        allowance = self.budget.allowance(self)
        if allowance != self._allowance or not self.streamer.loaded:
            self._replan(allowance, place=True)

    def _warn_grad(self) -> None:
        if torch.is_grad_enabled() and not getattr(self, "_grad_said", False):
            if any(p.requires_grad for p in self.model.parameters()):
                self._grad_said = True
                log.warning("%s: running with gradients enabled; backward through streamed blocks raises "
                            "(their slots are reused), so use torch.no_grad() for inference", self.name)

    def _make_plan(self, allowance: int) -> UnitPlan:
        try:
            return plan_units(self._sizes, self._names, self.streamer.rest_bytes, allowance, self.config.prefetch,
                              stream_all=self.config.vram_fraction <= 0)
        except PlanError as exc:
            raise DeviceMemoryError(f"{self.name}: {exc}") from None

    def _replan(self, allowance: int, place: bool = False) -> None:
        """Plan for `allowance` bytes; place it now when asked or when the model is on the device already.

        An out-of-memory error while placing (the device holds more than the budget knows of) shrinks the
        resident set and retries, with one log line; a plan that cannot even hold one slot is an error naming
        the unit and its size.
        """
        plan = self._make_plan(allowance)
        if plan.shrunk_lookahead and (self._plan is None or not self._plan.shrunk_lookahead):
            for note in plan.notes:
                log.warning("%s: %s", self.name, note)
        self._allowance = allowance
        self._plan = plan
        if not (place or self.streamer.loaded):
            self.streamer.set_plan(plan.resident, plan.n_slots)
            return
        while True:
            try:
                self.streamer.set_plan(plan.resident, plan.n_slots)
                self.streamer.ensure_loaded()
                return
            except torch.OutOfMemoryError as exc:
                self.streamer.unload()
                free, _ = self.backend.mem_get_info()
                smaller = min(plan.device_bytes - 1, free)
                if not self._oom_said:
                    self._oom_said = True
                    log.warning("%s: device out of memory while placing blocks (%s); shrinking the resident set",
                                self.name, str(exc).splitlines()[0])
                try:
                    plan = plan_units(self._sizes, self._names, self.streamer.rest_bytes, smaller,
                                      self.config.prefetch, stream_all=self.config.vram_fraction <= 0)
                except PlanError as err:
                    raise DeviceMemoryError(f"{self.name}: out of device memory: {err}") from None
                self._plan = plan

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
        ring = min(prefetch + 1, len(streamed)) * max(streamed) if streamed else 0
        return self.streamer.rest_bytes + sum(resident) + ring

    def planned_device_bytes(self) -> int:
        """Device bytes the current plan holds when placed (what a host application should reserve for it)."""
        if self._plan is None or self._allowance is None:
            return self._make_plan(self.budget.allowance(self)).device_bytes
        return self._plan.device_bytes

    def plan_summary(self) -> str:
        p = self._plan
        if p is None:
            return "no plan"
        return (f"{len(p.resident)} resident, {len(self._sizes) - len(p.resident)} streamed, "
                f"{p.n_slots} slot(s) of {p.slot_bytes / 1e6:.1f} MB, plan {p.device_bytes / 1e6:.1f} MB")

    # public API -----------------------------------------------------------------
    def load(self) -> None:
        """Place the resident set and the slot ring now instead of at the next forward."""
        self._on_forward_start()
        self.streamer.ensure_loaded()

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: all); returns the bytes freed."""
        freed = self.streamer.unload(nbytes)
        self._allowance = None
        return freed

    def refresh(self) -> None:
        """Call after writing weights in place through `.data` (writes that version counters cannot see).

        `load_state_dict`, `param.copy_()` and other in-place writes on the parameters are noticed on their own.
        """
        self.streamer.refresh()

    def set_priority(self, priority: int) -> None:
        self.priority = int(priority)
        self.budget.priority_changed(self)

    def prioritize(self) -> None:
        self.budget.prioritize(self)

    def reset_stats(self) -> None:
        self.streamer.metrics.harvest(block=True)
        self.streamer.metrics.reset()
        self.streamer.peak_device_bytes = self.device_bytes()
        if hasattr(self.backend, "reset_peak"):
            self.backend.reset_peak()

    def streamed_unit_modules(self) -> list[nn.Module]:
        return [u.module for u in self.streamer.units if u.resident_buf is None and
                u.index not in self.streamer.resident_set]

    def resident_unit_modules(self) -> list[nn.Module]:
        return [u.module for u in self.streamer.units if u.index in self.streamer.resident_set]

    def report(self) -> OffloadReport:
        s = self.streamer
        m = s.metrics
        m.harvest(block=True)
        blocks = [BlockReport(u.name, "vram" if u.index in s.resident_set else u.host_tier, u.nbytes,
                              m.h2d_ms[u.index], m.compute_ms[u.index], m.stall_ms[u.index], m.calls[u.index],
                              m.bytes_streamed[u.index]) for u in s.units]
        h2d, compute, stall, nbytes = m.totals()
        return OffloadReport(
            name=self.name, device=self.backend.describe(), preset=self.config.preset, priority=self.priority,
            blocks=blocks, total_bytes_streamed=nbytes, overlap_ratio=overlap_ratio(h2d, stall),
            effective_gbps=effective_gbps(nbytes, h2d),
            resident_bytes=s.rest_bytes + sum(u.nbytes for u in s.units if u.index in s.resident_set),
            peak_device_bytes=max(s.peak_device_bytes, s.device_bytes()), device_bytes=s.device_bytes(),
            slot_bytes=s.slot_bytes, slots=len(s.slots), forwards=m.forwards, stall_ms=stall, h2d_ms=h2d,
            compute_ms=compute, timeline=list(m.timeline))

    def detach(self) -> None:
        """Remove every hook; every weight becomes an ordinary tensor with its original values."""
        if getattr(self.model, "_layer_offload_handle", None) is not self:
            return
        self.budget.unregister(self)
        self.streamer.detach()
        self.model.__dict__.pop("_layer_offload_handle", None)
        if self.file is not None:
            self.file.close()


def offload_module(model: nn.Module, config: OffloadConfig | None = None, name: str | None = None,
                   priority: int = 0, budget: VramBudget | None = None, units: list[str] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> OffloadHandle:
    """Stream `model`'s blocks from host memory to the device from now on; returns the handle."""
    config = config if config is not None else OffloadConfig.from_preset("auto")
    with torch.inference_mode(False):  # our buffers and views must serve grad-mode and inference-mode calls
        return OffloadHandle(model, config, name or type(model).__name__, priority, budget, units, progress)
