"""Placement from measured costs: which units stay resident so that the copies of the others hide behind compute.

`CostTracker` turns the metrics' running totals into per-unit compute and copy times per call. `predict_stalls`
simulates one steady-state pass of the slot ring (copies in order on one transfer stream, each into the slot the
unit `k` streamed places earlier frees). `plan_by_cost` grows the resident set greedily, each step keeping the unit
that removes the most predicted stall per byte (then, once nothing stalls, the most copy-bound units while room
is left), and says for every unit why it was placed so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .planner import PlanError, UnitPlan, plan_units, ring_slots

MIN_SAVING_MS = 1.0  # a new plan replaces the one in place only when it saves more predicted stall per pass than
MIN_SAVING_FRACTION = 0.25  # this, and this fraction of the stall the plan in place is predicted to have
SMOOTHING = 0.25  # weight of the newest passes in the per-unit averages (timings on a busy host are noisy)
GREEDY_MAX_UNITS = 160  # above this the greedy search (n^3) gives way to ranking by copy/compute ratio
MAX_WIDTHS = 4  # slot widths tried by the search
SHIFT_FACTOR = 2.0  # a unit's time changing by this factor (and by SHIFT_MIN_MS) re-plans
SHIFT_MIN_MS = 0.5


@dataclass
class UnitCosts:
    """Per-call compute and copy milliseconds of every unit (copy estimated from bandwidth where not measured)."""

    compute_ms: list[float]
    copy_ms: list[float]


@dataclass
class CostPlan(UnitPlan):
    """A UnitPlan with, per unit, the predicted stall per pass and the reason for its place."""

    predicted_stall_ms: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


class CostTracker:
    """Per-unit compute and copy time per call, from the metrics' lifetime totals read at each safe point."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = list(sizes)
        n = len(sizes)
        self._last: tuple[list[int], list[float], list[float], list[int]] | None = None
        self.compute_ms: list[float | None] = [None] * n
        self.copy_ms: list[float | None] = [None] * n
        self._copy_bytes = 0
        self._copy_time = 0.0
        self._planned_on: UnitCosts | None = None

    def update(self, calls: list[int], compute_ms: list[float], h2d_ms: list[float], nbytes: list[int]) -> bool:
        """Fold the totals' growth since the last call into the per-call averages; True when anything was new."""
        last = self._last
        self._last = (list(calls), list(compute_ms), list(h2d_ms), list(nbytes))
        new = False
        for i in range(len(self.sizes)):
            dc, dt, dh, db = calls[i], compute_ms[i], h2d_ms[i], nbytes[i]
            if last is not None:
                dc, dt, dh, db = calls[i] - last[0][i], dt - last[1][i], dh - last[2][i], db - last[3][i]
            if dc <= 0:
                continue
            new = True
            per_call = max(0.0, dt) / dc
            old = self.compute_ms[i]
            self.compute_ms[i] = per_call if old is None else (1 - SMOOTHING) * old + SMOOTHING * per_call
            if db > 0 and dh > 0:
                copies = db / self.sizes[i]
                per_copy = dh / copies
                old = self.copy_ms[i]
                self.copy_ms[i] = per_copy if old is None else (1 - SMOOTHING) * old + SMOOTHING * per_copy
                self._copy_bytes += db
                self._copy_time += dh
        return new

    @property
    def ready(self) -> bool:
        """Every unit ran at least once and at least one copy was timed."""
        return all(c is not None for c in self.compute_ms) and self._copy_bytes > 0

    def costs(self) -> UnitCosts:
        """The current estimates; a unit never copied (resident) is costed at the measured bandwidth."""
        ms_per_byte = self._copy_time / self._copy_bytes if self._copy_bytes else 0.0
        copy = [c if c is not None else self.sizes[i] * ms_per_byte for i, c in enumerate(self.copy_ms)]
        return UnitCosts([c or 0.0 for c in self.compute_ms], copy)

    def shifted(self) -> bool:
        """Whether the estimates moved a lot since the plan was made from them (or none was made yet)."""
        if not self.ready:
            return False
        if self._planned_on is None:
            return True
        now = self.costs()
        for old, new in ((self._planned_on.compute_ms, now.compute_ms), (self._planned_on.copy_ms, now.copy_ms)):
            for a, b in zip(old, new):
                if abs(a - b) > SHIFT_MIN_MS and max(a, b) > SHIFT_FACTOR * max(min(a, b), 1e-9):
                    return True
        return False

    def planned(self, costs: UnitCosts) -> None:
        """Remember the estimates a plan was made from."""
        self._planned_on = costs


def predict_stalls(order: list[int], costs: UnitCosts, resident: set[int], slots: int) -> list[float]:
    """Per-unit stall (ms) in a steady-state pass: copies run one at a time, in streamed order, each into the slot
    the unit `slots` streamed places earlier frees when its compute ends; a unit waits for its own copy."""
    n = len(costs.compute_ms)
    stalls = [0.0] * n
    streamed = [u for u in order if u not in resident]
    if not streamed or slots < 1:
        return stalls
    ends: list[float] = []  # compute end of each streamed use, in order, over two passes
    t = xfer = 0.0
    for p in range(2):
        for u in order:
            if u in resident:
                t += costs.compute_ms[u]
                continue
            j = len(ends)
            slot_free = ends[j - slots] if j >= slots else 0.0
            done = max(xfer, slot_free) + costs.copy_ms[u]
            xfer = done
            start = max(t, done)
            if p == 1:
                stalls[u] += start - t
            t = start + costs.compute_ms[u]
            ends.append(t)
    return stalls


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
                 current: set[int] | None = None) -> CostPlan:
    """The resident set and ring for `allowance` device bytes that minimise the predicted stall (see module).

    The plan in place (`current`, else the count-based one) is kept unless the new one saves a clear share of
    its predicted stall: timings are noisy, and every change of plan moves bytes."""
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
        return CostPlan(base.resident, base.n_slots, base.slot_bytes, base.device_bytes, base.shrunk_lookahead,
                        base.notes, predicted_stall_ms=[0.0] * n,
                        reasons=["resident: every block fits the budget"] * n)
    avail = allowance - rest_bytes
    want = ring_slots(prefetch, n)
    resident: set[int] = set()
    if not stream_all:
        resident = _search(sizes, avail, want, costs, order)
    fit = _fit(sizes, resident, avail, want)
    if fit is None:  # cannot happen: the empty set fits whenever plan_units did not raise
        raise PlanError(f"no plan fits {allowance} bytes")
    k, slot = fit
    stalls = predict_stalls(order, costs, resident, k)
    base_stalls = predict_stalls(order, costs, base.resident, base.n_slots)
    saved = sum(base_stalls) - sum(stalls)
    if saved <= max(MIN_SAVING_MS, MIN_SAVING_FRACTION * sum(base_stalls)):
        # the plan in place is as good as the model can tell: keep it (no churn for a rounding error)
        resident, k, slot, stalls = base.resident, base.n_slots, base.slot_bytes, base_stalls
    kept_for = _what_each_saves(sizes, avail, want, costs, order, resident, stalls)
    reasons = []
    for i in range(n):
        if i in resident:
            if kept_for.get(i, 0.0) > 0:
                reasons.append(f"resident: streaming it would stall about {kept_for[i]:.2f} ms per pass (its copy, "
                               f"{costs.copy_ms[i]:.2f} ms, does not hide behind the compute before it)")
            else:
                reasons.append(f"resident: room left in the budget (copy {costs.copy_ms[i]:.2f} ms vs compute "
                               f"{costs.compute_ms[i]:.2f} ms)")
        elif stalls[i] > 0:
            reasons.append(f"streamed: no room to keep it resident (predicted stall {stalls[i]:.2f} ms per pass)")
        else:
            reasons.append(f"streamed: its copy ({costs.copy_ms[i]:.2f} ms) hides behind compute")
    notes = [f"lookahead shrunk from {want - 1} to {k - 1} unit(s) to fit the budget"] if k < want else []
    device = rest_bytes + sum(sizes[i] for i in resident) + k * slot
    return CostPlan(resident, k, slot, device, k < want, notes, predicted_stall_ms=stalls, reasons=reasons)


def _what_each_saves(sizes: list[int], avail: int, want: int, costs: UnitCosts, order: list[int],
                     resident: set[int], stalls: list[float]) -> dict[int, float]:
    """Per resident unit: the predicted stall per pass it would add if it streamed (its copy time where streaming
    it alone does not fit: the ring would have to widen)."""
    if len(sizes) > GREEDY_MAX_UNITS:
        return {u: max(0.0, costs.copy_ms[u] - costs.compute_ms[u]) for u in resident}
    total = sum(stalls)
    saves = {}
    for u in resident:
        fit = _fit(sizes, resident - {u}, avail, want)
        if fit is None:
            saves[u] = costs.copy_ms[u]
        else:
            saves[u] = max(0.0, sum(predict_stalls(order, costs, resident - {u}, fit[0])) - total)
    return saves


def _search(sizes: list[int], avail: int, want: int, costs: UnitCosts,
            order: list[int]) -> set[int]:
    """The slot is as wide as the widest streamed unit, so keeping all the wide units resident can pay where
    keeping any one of them does not: try each slot width (the units wider than it resident), grow the resident
    set from there, and keep the plan with the least predicted stall."""
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
            resident = _greedy(sizes, avail, want, costs, order, forced)
        else:
            resident = _by_ratio(sizes, avail, want, costs, forced)
        k = _fit(sizes, resident, avail, want)[0]
        total = sum(predict_stalls(order, costs, resident, k))
        key = (total, -k, -sum(sizes[u] for u in resident))
        if best is None or key < best[:3]:
            best = (*key, resident)
    return set() if best is None else best[3]


def _greedy(sizes: list[int], avail: int, want: int, costs: UnitCosts, order: list[int],
            start: set[int]) -> set[int]:
    resident: set[int] = set(start)
    fit = _fit(sizes, resident, avail, want)
    current = sum(predict_stalls(order, costs, resident, fit[0])) if fit else math.inf
    while len(resident) < len(sizes) - 1:
        best: tuple[float, float, int, float] | None = None  # (gain per byte, ratio, unit, new total)
        for u in range(len(sizes)):
            if u in resident:
                continue
            trial = resident | {u}
            fit = _fit(sizes, trial, avail, want)
            if fit is None:
                continue
            total = sum(predict_stalls(order, costs, trial, fit[0]))
            gain = current - total
            if gain < -1e-9:
                continue  # keeping it would cost lookahead the others need
            if gain <= 1e-9 and fit[0] < min(want, len(sizes) - len(trial)):
                continue  # filling spare room never shrinks the lookahead
            ratio = costs.copy_ms[u] / max(costs.compute_ms[u], 1e-6)
            key = (gain / max(sizes[u], 1) if gain > 1e-9 else 0.0, ratio, u, total)
            if best is None or key[:2] > best[:2]:
                best = key
        if best is None:
            break
        resident.add(best[2])
        current = best[3]
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
