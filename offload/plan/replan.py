"""Keeping one model's plan current: the facts that change while it runs, fed to the one planning function.

`PlanKeeper` holds the plan in place and what it was made from. It gathers the facts that change after setup
(the budget's allowance on each device, the per-unit costs measured at the end of passes, stall measured beyond the
prediction, device memory freed after an out-of-memory shrink), asks `planner.make_plan` for a plan and places it
through the streamer. It decides WHEN to plan again, never WHERE a unit lives:

- the allowance on a device changed (the budget, a secondary device's budget), or the plan is not on the device;
- every unit has been measured once (the first plan from costs), or a unit's times moved a lot since
  (`CostTracker.shifted`);
- the passes on a plan stalled more than it predicted, by more than STALL_MARGIN_MS per pass and
  STALL_MARGIN_FRACTION of the predicted stall (planner.py), both smoothed and in the newest passes, at
  CONFIRM_CHECKS checks in a row (one busy moment on the machine moves no blocks): the stall measured beyond the prediction, per unit
  (smoothed over the passes since the plan was placed, its first pass left out), becomes a fact of the next
  plan (`excess_ms`), which counts it against every plan that still streams that unit, so a plan that keeps the
  stalling unit resident wins over the one in place when it saves a clear share (plan_device.py);
- after an out-of-memory shrink, once the device has room again for the plan the allowance gives.

A plan the measurements ask for at the end of a forward that left a graph for backward through streamed units is
placed when that backward ends (or at the next pass start): backward, and activation checkpointing's re-run of a
forward, must find every unit where the forward had it.

Timings are folded in at the end of every pass for the first passes of a plan (FRESH_PASSES), then every
COST_EVERY passes (the per-pass bookkeeping stays O(1) per unit on long runs).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import replace
from typing import Any

import torch

from ..backends.base import Backend
from . import planner
from .cost_model import CostTracker
from .planner import STALL_MARGIN_FRACTION, STALL_MARGIN_MS, DeviceMemoryError, Plan, PlanError, PlanFacts
from .ring_sim import UnitCosts, simulate_pass

log = logging.getLogger(__name__)

COST_EVERY = 4  # once every block was measured, per-block timings are folded in every this many passes (O(blocks))
FRESH_PASSES = 3  # ... but every pass for the first passes of a new plan, to see soon whether it stalls
CONFIRM_CHECKS = 2  # a stall beyond the prediction must show at this many checks in a row before it moves blocks


class PlanKeeper:
    """The plan in place for one model and the facts it was made from (see the module docstring)."""

    def __init__(self, base: PlanFacts, streamer: Any, backend: Backend, owner: Any) -> None:
        # streamer: stream/streamer.ModelStreamer, which places the plans (duck-typed: plan/ imports nothing above it)
        self.base = base  # the facts that do not change after setup (sizes, names, host tiers, ...)
        self.streamer = streamer
        self.backend = backend
        # the handle, weakly (it holds this keeper): it explains an allowance and collects notices for the report
        self._owner = weakref.ref(owner)
        self.costs = CostTracker(list(base.sizes))
        self.plan: Plan | None = None
        self.allowance: int | None = None  # the compute device's allowance the plan in place was made for
        self.remote: dict[str, int] = dict(base.remote_allowances)
        self.oom_free: int | None = None  # free device bytes after an out-of-memory shrink; None: not capped
        self.excess: tuple[float, ...] | None = None  # per unit: stall measured beyond the simulation when streamed
        self._measured_excess: set[int] = set()  # units whose excess was measured (the others: their tier's rate)
        self.passes = 0
        self._passes_on_plan = 0
        self._checks_beyond = 0  # consecutive checks on the plan in place whose newest passes stalled beyond it
        self._memo: tuple[PlanFacts, Plan] | None = None
        self._read_ms: list[float] = [0.0] * len(base.sizes)  # per unit: bounce-buffer read before each copy
        self._due = False  # the measurements asked for a plan while a backward of the last forward was to come

    # facts -> plan ----------------------------------------------------------------------
    def facts(self, allowance: int) -> PlanFacts:
        """The facts now, for `allowance` device bytes on the compute device."""
        costs = None
        if self.costs.ready:
            costs = self.costs.costs()
            if any(self._read_ms):  # a unit read into a bounce buffer first waits for that read too
                costs = UnitCosts(costs.compute_ms, [c + r for c, r in zip(costs.copy_ms, self._read_ms)])
        return replace(self.base, allowance=allowance, remote_allowances=tuple(self.remote.items()),
                       costs=costs, excess_ms=self.excess, current=self.plan)

    def _fold_reads(self) -> None:
        """Per unit, the time its bytes take to reach a bounce buffer before each copy (disk reads, bounced pageable
        RAM): measured per read where it was read, estimated from the model's other disk reads per byte for a disk
        unit not read yet (kept resident so far), 0 for a unit copied straight from RAM."""
        sources = self.streamer.sources
        per_read = [s.read_ms / s.reads if s.reads else None for s in sources]
        disk = [(s.read_ms, s.reads * s.nbytes) for s in sources if s.tier == "disk" and s.reads]
        rate = sum(ms for ms, _ in disk) / max(1, sum(n for _, n in disk)) if disk else 0.0
        self._read_ms = [r if r is not None else (s.nbytes * rate if s.tier == "disk" else 0.0)
                         for r, s in zip(per_read, sources)]

    def plan_for(self, allowance: int) -> Plan:
        """The plan `make_plan` gives for `allowance` now (the last answer is remembered while the facts hold)."""
        facts = self.facts(allowance)
        if self._memo is not None and self._memo[0] == facts:
            return self._memo[1]
        try:
            plan = planner.make_plan(facts)
        except PlanError as exc:
            owner = self._owner()
            why = owner.share_explained(allowance) if owner is not None else ""
            raise DeviceMemoryError(f"{self.base.name}: {exc}. {why}") from None
        self._memo = (facts, plan)
        return plan

    def resized(self, base: PlanFacts) -> None:
        """The units' sizes changed (laid out again): plan from the new facts; what was measured starts over."""
        self.base = base
        self.costs = CostTracker(list(base.sizes))
        self.excess, self._measured_excess, self._memo = None, set(), None
        self._read_ms = [0.0] * len(base.sizes)

    def stale(self, allowance: int, remote: dict[str, int]) -> bool:
        """Whether the plan in place no longer fits the facts (at a pass start)."""
        return (allowance != self.allowance or remote != self.remote or not self.streamer.loaded or self._due
                or self._may_grow_back(allowance))

    def replan(self, allowance: int, place: bool = False, remote: dict[str, int] | None = None) -> None:
        """Plan for `allowance` bytes; place it now when asked or when the model is on the device already.

        An out-of-memory error while placing (the device holds more than the budget knows of) plans again for the
        memory that is free, with one log line; the resident set grows back at a later pass start once the device
        has room again. A plan that cannot even hold one slot is an error naming the unit and its size.
        """
        if remote is not None:
            self.remote = dict(remote)
        self._due = False  # placed now, from the facts now
        plan = self.plan_for(allowance)
        self._adopt(plan, allowance)
        if not (place or self.streamer.loaded):
            self._set(plan)
            return
        shrunk = False
        while True:
            try:
                self._set(plan)
                self.streamer.ensure_loaded()
                break
            except torch.OutOfMemoryError as exc:
                self.streamer.unload()
                free, _ = self.backend.mem_get_info()
                if not shrunk:
                    log.warning("%s: device out of memory while placing blocks (%s); shrinking the resident set "
                                "until memory frees up", self.base.name, str(exc).splitlines()[0])
                    self._notice("oom_shrink", "the device ran out of memory while placing blocks: fewer blocks "
                                               "stay resident until memory frees up")
                shrunk = True
                plan = self.plan_for(min(plan.device_bytes - 1, free))  # the same function, with the free bytes
                self.plan = plan
        if shrunk:
            self.oom_free = self.backend.mem_get_info()[0]
        elif self.oom_free is not None:
            self.oom_free = None
            log.info("%s: device memory is free again; the resident set grew back (%s)", self.base.name,
                     plan.summary())

    def _adopt(self, plan: Plan, allowance: int) -> None:
        """`plan` becomes the plan in place (its lookahead note said once, its costs remembered)."""
        if plan.shrunk_lookahead and (self.plan is None or not self.plan.shrunk_lookahead):
            for note in plan.notes:
                log.warning("%s: %s", self.base.name, note)
                self._notice("lookahead_shrunk", note)
        if self.plan is None or plan.resident != self.plan.resident or plan.n_slots != self.plan.n_slots:
            self._passes_on_plan = 0
            self._checks_beyond = 0
            self.costs.stalls_measured_anew()  # stalls measured under the last plan say nothing of this one
        self.allowance = allowance
        self.plan = plan
        if plan.from_costs:
            self.costs.planned(self.costs.costs())

    def _notice(self, kind: str, message: str) -> None:
        owner = self._owner()
        if owner is not None:
            owner.notice(kind, message)

    def _set(self, plan: Plan) -> None:
        self.streamer.set_plan(plan.resident, plan.n_slots, plan.remote, plan.eviction_order())

    def _may_grow_back(self, allowance: int) -> bool:
        """After an out-of-memory shrink: whether the device has room again for the plan the budget allows."""
        if self.oom_free is None:
            return False
        free, _ = self.backend.mem_get_info()
        if free <= self.oom_free:
            return False  # nothing came free since the shrink: do not thrash
        return free >= self.plan_for(allowance).device_bytes - self.streamer.device_bytes()

    # measurements -----------------------------------------------------------------------
    def after_pass(self) -> bool:
        """At the end of a pass: fold the timings in when due and plan again when they say so (see the module
        docstring); the plan is placed now, so the next pass's first blocks are prefetched in the gap before it.
        Returns whether it planned again."""
        self.passes += 1
        self._passes_on_plan += 1
        if self.allowance is None or not self.streamer.loaded:
            return False
        due = (not self.costs.ready or self._passes_on_plan <= FRESH_PASSES or self.passes % COST_EVERY == 0)
        if not due or not self.costs.update(*self.streamer.metrics.lifetime()):
            return False
        self._fold_reads()
        if self.oom_free is not None:
            return False  # capped after an out-of-memory shrink: the plan grows back only when memory frees up
        first = self.plan is not None and not self.plan.from_costs and self.costs.ready
        if not (first or self.costs.shifted() or self._stalled_beyond_prediction()):
            return False
        if self.streamer.backward.armed:
            # the forward left a graph whose backward brings its streamed units back and re-runs checkpointed ones,
            # which must find every unit where the forward had it (torch.utils.checkpoint compares what the two
            # save): the new plan is placed when that backward ends (after_backward), else at the next pass start
            self._due = True
            return False
        self.replan(self.allowance, place=True)
        self.streamer.worker.fill()
        return True

    def after_backward(self) -> bool:
        """The backward of the last forward ended: a plan the measurements asked for meanwhile is placed now, so the
        next forward's first blocks are prefetched in the gap. Returns whether it planned again."""
        if not self._due or self.allowance is None or not self.streamer.loaded or self.oom_free is not None:
            return False
        self.replan(self.allowance, place=True)
        self.streamer.worker.fill()
        return True

    def _stalled_beyond_prediction(self) -> bool:
        """Whether the passes on the plan in place stalled more than it predicted (by the margin in planner.py);
        if so, each streamed unit's stall beyond what the ring simulation predicts for it becomes a fact of the next
        plan (`excess`: kept per unit across plans, since a unit kept resident is not measured again)."""
        plan = self.plan
        if plan is None or not plan.from_costs:
            return False
        on_device = plan.resident | set(plan.remote)
        streamed = [i for i in range(len(plan.units)) if i not in on_device]
        measured = self.costs.stall_ms
        if not streamed or any(measured[i] is None for i in streamed):
            return False  # not every streamed unit ran on this plan yet
        predicted = sum(plan.units[i].predicted_stall_ms for i in streamed)
        margin = max(STALL_MARGIN_MS, STALL_MARGIN_FRACTION * predicted)
        beyond = sum(measured[i] for i in streamed) - predicted
        newest = sum(self.costs.newest_stall_ms[i] or 0.0 for i in streamed) - predicted
        # a stall that one busy moment caused (the smoothed value still carries it) is not a reason to move blocks:
        # the newest passes must stall beyond the margin at CONFIRM_CHECKS checks in a row
        self._checks_beyond = self._checks_beyond + 1 if beyond > margin and newest > margin else 0
        if self._checks_beyond < CONFIRM_CHECKS:
            return False
        order = list(self.base.order) if self.base.order else list(range(len(plan.units)))
        simulated = simulate_pass(order, self.facts(plan.allowance).costs, on_device, plan.n_slots).stall_ms
        excess = list(self.excess) if self.excess is not None else [0.0] * len(plan.units)
        for i in streamed:
            excess[i] = max(0.0, measured[i] - simulated[i])
            self._measured_excess.add(i)
        # a unit never measured streaming is charged what its likes (the same host tier, within 2x of its size)
        # stalled per byte: else a plan would swap a stalling unit for an equal one that only looks free because it
        # was kept resident
        sizes, tiers = self.base.sizes, [src.tier for src in self.streamer.sources]
        for i in range(len(excess)):
            if i in self._measured_excess:
                continue
            likes = [j for j in self._measured_excess
                     if tiers[j] == tiers[i] and max(sizes[i], sizes[j]) <= 2 * min(sizes[i], sizes[j])]
            if likes:
                excess[i] = sum(excess[j] for j in likes) / sum(sizes[j] for j in likes) * sizes[i]
        self.excess = tuple(excess)
        log.info("%s: a pass stalled %.2f ms more than planned; planning again with the measured stalls",
                 self.base.name, beyond)
        return True

    # the budget shrinks an idle model --------------------------------------------------------
    def shrink_to(self, nbytes: int, floor: int) -> int:
        """Hold at most `nbytes` from now on (the caller holds the model idle); returns the bytes freed."""
        before = self.streamer.device_bytes()
        if before <= nbytes:
            return 0
        if nbytes < floor:
            self.streamer.unload()
            self.allowance = None  # plan again at the next forward
        else:
            self.replan(nbytes)
        return before - self.streamer.device_bytes()

    def shrink_remote(self, device: str, nbytes: int) -> int:
        """Hold at most `nbytes` on secondary `device` from now on (the model is idle): the blocks the plan for the
        lower allowance no longer puts there go back to streaming; the compute device is planned again at the next
        forward (its ring may have to widen for them)."""
        remote = dict(self.remote)
        remote[device] = min(remote.get(device, nbytes), nbytes)
        if self.allowance is None:
            return 0
        self.remote = remote
        keep = {i for i, d in self.plan_for(self.allowance).remote.items() if d == device}
        freed = self.streamer.placement.unload_remote(device, nbytes, keep)
        if freed:
            self.allowance = None  # plan again at the next forward: those blocks stream now
        return freed
