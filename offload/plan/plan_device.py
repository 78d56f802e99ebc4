"""The device side of a plan: which units stay resident on the compute device and how wide the slot ring is.

Two ways, both called only by `planner.make_plan`: before anything was measured, by count (`plan_units`: every
unit when it fits, else a ring of prefetch+1 slots and as many resident units as the rest holds, spread evenly);
once the units' compute and copy times are known, by predicted stall (`plan_by_cost`: the resident set with the
least stall the simulated ring predicts, offload/plan/ring_sim.py, plus any stall measured beyond the prediction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .ring_sim import UnitCosts, simulate_pass

MIN_SAVING_MS = 1.0  # a new plan replaces the one in place only when it saves more stall per pass than this,
MIN_SAVING_FRACTION = 0.25  # and this fraction of the stall the plan in place has (predicted plus measured excess)
GREEDY_MAX_UNITS = 160  # above this the greedy search (n^3) gives way to ranking by copy/compute ratio
MAX_WIDTHS = 4  # slot widths tried by the search


class DeviceMemoryError(ValueError):
    """Even the smallest plan (one slot) does not fit: names the unit and its size."""


class PlanError(ValueError):
    """The budget cannot hold even the smallest working plan; the message names what does not fit."""


@dataclass
class UnitPlan:
    """Where each unit lives on the device side: resident units and the slot ring for the rest."""

    resident: set[int]
    n_slots: int
    slot_bytes: int
    device_bytes: int
    shrunk_lookahead: bool = False
    notes: list[str] = field(default_factory=list)
    remote: dict[int, str] | None = None  # several devices: units resident on a secondary device
    predicted_stall_ms: list[float] = field(default_factory=list)  # per unit, per pass (empty: not from costs)
    reasons: list[str] = field(default_factory=list)  # per unit, why it is where it is (empty: not from costs)


def ring_slots(prefetch: int, n_streamed: int) -> int:
    """Slots the ring wants: the unit computing plus `prefetch` on their way, never more than units streamed."""
    return max(0, min(prefetch + 1, n_streamed))


def want_bytes(prefetch: int, vram_fraction: float, vram_budget_bytes: int | None, rest_bytes: int,
               sizes: list[int], budget_total: int | None) -> int:
    """The most a model asks of its budget: every unit, or its preset's share of the budget's total (a full ring at
    least), capped by its own `vram_budget_bytes`."""
    everything = rest_bytes + sum(sizes)
    ring = rest_bytes + ring_slots(prefetch, len(sizes)) * max(sizes)
    if vram_fraction <= 0:
        want = ring
    elif vram_fraction < 1 and budget_total is not None:
        want = max(ring, min(everything, int(vram_fraction * budget_total)))
    else:
        want = everything
    if vram_budget_bytes is not None:
        want = min(want, int(vram_budget_bytes))
    return want


def spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n)."""
    if k <= 0:
        return []
    if k >= n:
        return list(range(n))
    return sorted({min(n - 1, int((i + 0.5) * n / k)) for i in range(k)})


def plan_units(sizes: list[int], names: list[str], rest_bytes: int, allowance: int, prefetch: int,
               stream_all: bool = False) -> UnitPlan:
    """Fit rest + resident units + slot ring into `allowance` device bytes.

    Everything resident when it fits (and streaming is not forced); otherwise a ring of prefetch+1 slots
    (shrunk down to one slot when the budget is tight) and as many resident units as the remainder holds,
    with the streamed ones spread evenly so their copies hide behind resident compute.
    """
    n = len(sizes)
    avail = allowance - rest_bytes
    if avail < 0:
        raise PlanError(f"{allowance} bytes of device memory cannot hold the model's non-block weights "
                        f"({rest_bytes} bytes); raise the budget")
    if not stream_all and sum(sizes) <= avail:
        return UnitPlan(set(range(n)), 0, 0, rest_bytes + sum(sizes))
    biggest = max(range(n), key=lambda i: sizes[i])
    slot = sizes[biggest]
    want_slots = ring_slots(prefetch, n)
    k = want_slots
    while k > 1 and k * slot > avail:
        k -= 1
    if k * slot > avail:
        raise PlanError(f"{allowance} bytes of device memory cannot hold one slot for unit {names[biggest]!r} "
                        f"({sizes[biggest]} bytes) plus the non-block weights ({rest_bytes} bytes); "
                        f"raise the budget to at least {rest_bytes + sizes[biggest]} bytes")
    notes = []
    if k < want_slots:
        notes.append(f"lookahead shrunk from {want_slots - 1} to {k - 1} unit(s) to fit the budget")
    if stream_all:
        return UnitPlan(set(), k, slot, rest_bytes + k * slot, k < want_slots, notes)
    best = UnitPlan(set(), k, slot, rest_bytes + k * slot, k < want_slots, notes)
    for n_streamed in range(1, n):
        streamed = set(spread(n, n_streamed))
        resident = set(range(n)) - streamed
        s_slot = max(sizes[i] for i in streamed)
        s_k = min(k, n_streamed)
        need = sum(sizes[i] for i in resident) + s_k * s_slot
        if need <= avail:
            return UnitPlan(resident, s_k, s_slot, rest_bytes + need, k < want_slots, notes)
    return best


class _Scorer:
    """The stall of a candidate plan per pass: what the ring simulation predicts, plus the stall measured beyond the
    prediction on units that would still stream (a unit kept resident cannot stall)."""

    def __init__(self, order: list[int], costs: UnitCosts, excess_ms: list[float] | None) -> None:
        self.order, self.costs = order, costs
        self.excess = excess_ms if excess_ms is not None and any(e > 0 for e in excess_ms) else None

    def stalls(self, resident: set[int], slots: int) -> list[float]:
        stalls = simulate_pass(self.order, self.costs, resident, slots).stall_ms
        if self.excess is not None:
            stalls = [s + (e if u not in resident else 0.0) for u, (s, e) in enumerate(zip(stalls, self.excess))]
        return stalls

    def total(self, resident: set[int], slots: int) -> float:
        return sum(self.stalls(resident, slots))


def _fit(sizes: list[int], resident: set[int], avail: int, want_slots: int) -> tuple[int, int] | None:
    """(slots, slot bytes) of the widest ring that fits beside `resident`; None when not even one slot fits."""
    streamed = [s for i, s in enumerate(sizes) if i not in resident]
    used = sum(sizes[i] for i in resident)
    if not streamed:
        return (0, 0) if used <= avail else None
    slot = max(streamed)
    k = min(want_slots, len(streamed))
    while k >= 1 and used + k * slot > avail:
        k -= 1
    return (k, slot) if k >= 1 else None


def plan_by_cost(sizes: list[int], names: list[str], rest_bytes: int, allowance: int, prefetch: int,
                 costs: UnitCosts, order: list[int] | None = None, stream_all: bool = False,
                 current: set[int] | None = None, excess_ms: list[float] | None = None) -> UnitPlan:
    """The resident set and ring for `allowance` device bytes with the least stall (see the module docstring).

    `excess_ms`: per unit, stall measured under the plan in place beyond what the simulation predicted for it;
    it counts against every plan that still streams the unit, so a plan that keeps the stalling unit resident wins.
    The plan in place (`current`, else the count-based one) is kept unless the new one saves a clear share of
    its stall: timings are noisy, and every change of plan moves bytes."""
    base = plan_units(sizes, names, rest_bytes, allowance, prefetch, stream_all)  # the errors, the all-fits case
    if current is not None and not stream_all and len(base.resident) < len(sizes):
        fit = _fit(sizes, current, allowance - rest_bytes, ring_slots(prefetch, len(sizes)))
        if fit is not None and len(current) < len(sizes):
            k, slot = fit
            base = UnitPlan(set(current), k, slot, rest_bytes + sum(sizes[i] for i in current) + k * slot,
                            k < ring_slots(prefetch, len(sizes)))
    n = len(sizes)
    order = list(order) if order is not None else list(range(n))
    if len(base.resident) == n:
        return UnitPlan(base.resident, base.n_slots, base.slot_bytes, base.device_bytes, base.shrunk_lookahead,
                        base.notes, predicted_stall_ms=[0.0] * n,
                        reasons=["resident: every block fits the budget"] * n)
    score = _Scorer(order, costs, excess_ms)
    avail = allowance - rest_bytes
    want = ring_slots(prefetch, n)
    resident: set[int] = set()
    if not stream_all:
        resident = _search(sizes, avail, want, costs, score)
    fit = _fit(sizes, resident, avail, want)
    if fit is None:  # cannot happen: the empty set fits whenever plan_units did not raise
        raise PlanError(f"no plan fits {allowance} bytes")
    k, slot = fit
    stalls = score.stalls(resident, k)
    base_stalls = score.stalls(base.resident, base.n_slots)
    saved = sum(base_stalls) - sum(stalls)
    if saved <= max(MIN_SAVING_MS, MIN_SAVING_FRACTION * sum(base_stalls)):
        # the plan in place is as good as the model can tell: keep it (no churn for a rounding error)
        resident, k, slot, stalls = base.resident, base.n_slots, base.slot_bytes, base_stalls
    kept_for = _what_each_saves(sizes, avail, want, costs, score, resident, stalls)
    excess = score.excess or [0.0] * n
    reasons = []
    for i in range(n):
        if i in resident:
            if kept_for.get(i, 0.0) > 0:
                why = ("it stalled when streamed, more than predicted" if excess[i] > 0 else
                       f"its copy, {costs.copy_ms[i]:.2f} ms, does not hide behind the compute before it")
                reasons.append(f"resident: streaming it would stall about {kept_for[i]:.2f} ms per pass ({why})")
            else:
                reasons.append(f"resident: room left in the budget (copy {costs.copy_ms[i]:.2f} ms vs compute "
                               f"{costs.compute_ms[i]:.2f} ms)")
        elif stalls[i] > 0:
            reasons.append(f"streamed: no room to keep it resident (predicted stall {stalls[i]:.2f} ms per pass)")
        else:
            reasons.append(f"streamed: its copy ({costs.copy_ms[i]:.2f} ms) hides behind compute")
    notes = [f"lookahead shrunk from {want - 1} to {k - 1} unit(s) to fit the budget"] if k < want else []
    device = rest_bytes + sum(sizes[i] for i in resident) + k * slot
    return UnitPlan(resident, k, slot, device, k < want, notes, predicted_stall_ms=stalls, reasons=reasons)


def _what_each_saves(sizes: list[int], avail: int, want: int, costs: UnitCosts, score: _Scorer,
                     resident: set[int], stalls: list[float]) -> dict[int, float]:
    """Per resident unit: the stall per pass it would add if it streamed (its copy time where streaming it alone
    does not fit: the ring would have to widen)."""
    if len(sizes) > GREEDY_MAX_UNITS:
        return {u: max(0.0, costs.copy_ms[u] - costs.compute_ms[u]) for u in resident}
    total = sum(stalls)
    saves = {}
    for u in resident:
        fit = _fit(sizes, resident - {u}, avail, want)
        if fit is None:
            saves[u] = costs.copy_ms[u]
        else:
            saves[u] = max(0.0, score.total(resident - {u}, fit[0]) - total)
    return saves


def _search(sizes: list[int], avail: int, want: int, costs: UnitCosts, score: _Scorer) -> set[int]:
    """The slot is as wide as the widest streamed unit, so keeping all the wide units resident can pay where
    keeping any one of them does not: try each slot width (the units wider than it resident), grow the resident
    set from there, and keep the plan with the least stall."""
    widths = sorted(set(sizes), reverse=True)
    if len(widths) > MAX_WIDTHS:  # many distinct sizes: a few widths spread over them
        widths = [widths[round(i * (len(widths) - 1) / (MAX_WIDTHS - 1))] for i in range(MAX_WIDTHS)]
    best: tuple[float, int, int, set[int]] | None = None
    for width in widths:
        forced = {u for u, size in enumerate(sizes) if size > width}
        fit = _fit(sizes, forced, avail, want)
        if fit is None:
            continue
        if len(sizes) <= GREEDY_MAX_UNITS:
            resident = _greedy(sizes, avail, want, costs, score, forced)
        else:
            resident = _by_ratio(sizes, avail, want, costs, forced)
        k = _fit(sizes, resident, avail, want)[0]
        total = score.total(resident, k)
        key = (total, -k, -sum(sizes[u] for u in resident))
        if best is None or key < best[:3]:
            best = (*key, resident)
    return set() if best is None else best[3]


def _greedy(sizes: list[int], avail: int, want: int, costs: UnitCosts, score: _Scorer,
            start: set[int]) -> set[int]:
    resident: set[int] = set(start)
    fit = _fit(sizes, resident, avail, want)
    current = score.total(resident, fit[0]) if fit else math.inf
    slots = fit[0] if fit else 0
    while len(resident) < len(sizes) - 1:
        best: tuple[float, float, int, float, int] | None = None  # (gain per byte, ratio, unit, new total, slots)
        for u in range(len(sizes)):
            if u in resident:
                continue
            trial = resident | {u}
            fit = _fit(sizes, trial, avail, want)
            if fit is None:
                continue
            if current <= 0.0 and fit[0] >= slots:
                total = 0.0  # one unit more resident, no fewer slots: no stall can appear (ring_sim.simulate_pass)
            else:
                total = score.total(trial, fit[0])
            gain = current - total
            if gain < -1e-9:
                continue  # keeping it would cost lookahead the others need
            if gain <= 1e-9 and fit[0] < min(want, len(sizes) - len(trial)):
                continue  # filling spare room never shrinks the lookahead
            ratio = costs.copy_ms[u] / max(costs.compute_ms[u], 1e-6)
            key = (gain / max(sizes[u], 1) if gain > 1e-9 else 0.0, ratio, u, total, fit[0])
            if best is None or key[:2] > best[:2]:
                best = key
        if best is None:
            break
        resident.add(best[2])
        current, slots = best[3], best[4]
    return resident


def _by_ratio(sizes: list[int], avail: int, want: int, costs: UnitCosts,
              start: set[int]) -> set[int]:
    """Many units: keep the most copy-bound ones (copy time over compute time) while they fit."""
    ranked = sorted(range(len(sizes)), key=lambda u: -costs.copy_ms[u] / max(costs.compute_ms[u], 1e-6))
    resident: set[int] = set(start)
    for u in ranked:
        if u in resident:
            continue
        if len(resident) == len(sizes) - 1:
            break
        if _fit(sizes, resident | {u}, avail, want) is not None:
            resident.add(u)
    return resident


def place_remote(candidates: list[int], sizes: list[int], allowances: dict[str, int]) -> dict[int, str]:
    """Blocks the compute device streams, placed on the secondary devices in order while each one's allowance
    lasts (largest first, so the fewest bytes are left to stream); `candidates` come most wanted first."""
    remote: dict[int, str] = {}
    left = dict(allowances)
    ranked = sorted(candidates, key=lambda u: -sizes[u])
    for device in allowances:
        for u in ranked:
            if u not in remote and sizes[u] <= left[device]:
                remote[u] = device
                left[device] -= sizes[u]
    return remote


def across_devices(plan: UnitPlan, sizes: list[int], rest_bytes: int, allowance: int,
                   remote_allowances: dict[str, int], stream_all: bool) -> UnitPlan:
    """With secondary devices: when the compute device's share and theirs hold every block, fill the compute device
    first and the secondary devices after, with no slot ring (nothing streams); else keep `plan` and let the
    secondary devices take the blocks it streams, while their allowances last."""
    if not remote_allowances:
        return plan
    n = len(sizes)
    if not stream_all and len(plan.resident) < n:
        avail, used, first = allowance - rest_bytes, 0, set()
        for i, size in enumerate(sizes):
            if used + size <= avail:
                first.add(i)
                used += size
        others = [i for i in range(n) if i not in first]
        remote = place_remote(others, sizes, remote_allowances)
        if len(remote) == len(others):
            return UnitPlan(first, 0, 0, rest_bytes + used, remote=remote,
                            predicted_stall_ms=[0.0] * n if plan.predicted_stall_ms else [],
                            reasons=[("resident" if i in first else f"resident on {remote[i]}") +
                                     ": the devices together hold every block" for i in range(n)]
                            if plan.reasons else [])
    streamed = [i for i in range(n) if i not in plan.resident]
    return replace(plan, remote=place_remote(streamed, sizes, remote_allowances))
