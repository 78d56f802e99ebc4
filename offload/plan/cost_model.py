"""Measured costs: per-unit compute, copy and stall times per call, from the metrics' running totals.

`CostTracker` is what the planner knows of a model's units once they ran (offload/plan/replan.py folds the metrics in at
the end of passes). The simulation these costs feed is offload/plan/ring_sim.py; the placement they decide is
offload/plan/plan_device.py, called only through `planner.make_plan`. `UnitCosts`, `predict_stalls` and `plan_by_cost`
are importable from here as before.
"""
from __future__ import annotations

from .plan_device import plan_by_cost  # noqa: F401  (placement from costs: decided by the planner)
from .ring_sim import UnitCosts, predict_stalls  # noqa: F401

SMOOTHING = 0.25  # weight of the newest passes in the per-unit averages (timings on a busy host are noisy)
STALL_SMOOTHING = 0.5  # weight of the newest passes in the per-unit stall under the plan in place
SHIFT_FACTOR = 2.0  # a unit's time changing by this factor (and by SHIFT_MIN_MS) re-plans
SHIFT_MIN_MS = 0.5


class CostTracker:
    """Per-unit compute and copy time per call, from the metrics' lifetime totals read at each safe point."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = list(sizes)
        n = len(sizes)
        self._last: tuple[list, ...] | None = None
        self.compute_ms: list[float | None] = [None] * n
        self.copy_ms: list[float | None] = [None] * n
        self.stall_ms: list[float | None] = [None] * n  # per call, since the plan in place was made (None: not yet)
        self.newest_stall_ms: list[float | None] = [None] * n  # per call, over the passes since the last update only
        self._cold = True
        self._copy_bytes = 0
        self._copy_time = 0.0
        self._planned_on: UnitCosts | None = None

    def update(self, calls: list[int], compute_ms: list[float], h2d_ms: list[float], nbytes: list[int],
               stall_ms: list[float] | None = None) -> bool:
        """Fold the totals' growth since the last call into the per-call averages; True when anything was new."""
        last = self._last
        self._last = (list(calls), list(compute_ms), list(h2d_ms), list(nbytes),
                      list(stall_ms) if stall_ms is not None else None)
        new = False
        for i in range(len(self.sizes)):
            dc, dt, dh, db = calls[i], compute_ms[i], h2d_ms[i], nbytes[i]
            if last is not None:
                dc, dt, dh, db = calls[i] - last[0][i], dt - last[1][i], dh - last[2][i], db - last[3][i]
            if dc <= 0:
                continue
            new = True
            if stall_ms is not None and not self._cold:
                ds = stall_ms[i] - (last[4][i] if last is not None and last[4] is not None else 0.0)
                per_call = max(0.0, ds) / dc
                self.newest_stall_ms[i] = per_call
                old = self.stall_ms[i]
                self.stall_ms[i] = per_call if old is None else (1 - STALL_SMOOTHING) * old + STALL_SMOOTHING * per_call
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
        if new:
            self._cold = False
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

    def stalls_measured_anew(self) -> None:
        """Another plan is in place: the stalls measured under the last one say nothing of it."""
        self.stall_ms = [None] * len(self.sizes)
        self.newest_stall_ms = [None] * len(self.sizes)
        self._cold = True  # the first pass on a new plan starts with nothing in flight: its stalls are not counted


