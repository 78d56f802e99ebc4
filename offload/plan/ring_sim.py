"""The slot ring, simulated: how long each streamed unit waits for its copy in a steady run of passes.

The model is what the prefetch worker and a copy engine really do (offload/stream/prefetch.py): copies run one at a time
on one transfer stream, in the order the worker queues them; the worker queues a unit when a slot frees, into the
slot the unit `slots` streamed places earlier frees when its compute ends; a unit waits for its own copy. The ring
wraps over the pass boundary: the last units of a pass free the slots the first units of the next pass are copied
into, so those copies start while the pass ends, and when they cannot finish in time the first units of the next
pass wait (the boundary stall). Passes are simulated until one repeats the last (a steady state), because the
first pass starts with every slot free and every copy still to do, which no later pass does.

Pure functions on numbers: the planner (offload/plan/planner.py) calls them to compare plans, `offload.predict` to
predict a step before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_PASSES = 6  # passes simulated at most while looking for the steady state
STEADY_MS = 1e-6  # two passes whose stalls differ by less than this are the same


@dataclass
class UnitCosts:
    """Per-call compute and copy milliseconds of every unit (copy estimated from bandwidth where not measured)."""

    compute_ms: list[float]
    copy_ms: list[float]


@dataclass
class PassTimes:
    """One steady-state pass: each unit's stall and the pass's length (compute plus stalls, plus `gap_ms`)."""

    stall_ms: list[float]
    step_ms: float
    first_pass_stall_ms: float  # the stall of a pass that starts with nothing in flight (after a plan change)


def simulate_pass(order: list[int], costs: UnitCosts, resident: set[int], slots: int,
                  gap_ms: float = 0.0) -> PassTimes:
    """Simulate passes over `order` with the `resident` units on the device and `slots` slots for the rest.

    `gap_ms`: time between the end of one pass and the start of the next (work outside the units), during which
    copies already queued go on. Returns the steady-state pass: a pass whose end leaves the ring as the one before
    it did (the transfer stream's backlog and the slots' free times, relative to the pass end) is what every later
    pass repeats (see the module docstring)."""
    n = len(costs.compute_ms)
    compute, copy = costs.compute_ms, costs.copy_ms
    # the streamed uses in order, each with the compute of the resident units run since the one before it
    steps: list[tuple[int, float, float, float]] = []
    before = 0.0
    for u in order:
        if u in resident:
            before += compute[u]
        else:
            steps.append((u, before, compute[u], copy[u]))
            before = 0.0
    after = before  # resident compute after the last streamed use
    if slots < 1 or not steps:
        return PassTimes([0.0] * n, sum(compute[u] for u in order) + gap_ms, 0.0)
    ring = [0.0] * slots  # compute end of the last `slots` streamed uses: ring[k % slots] frees for use k + slots
    k = 0  # streamed uses so far
    t = xfer = 0.0
    state: tuple[float, ...] | None = None
    first = step = 0.0
    stalls = [0.0] * n
    for p in range(MAX_PASSES):
        stalls = [0.0] * n
        start_of_pass = t
        for u, pre, c, cp in steps:
            t += pre
            j = k % slots
            free = ring[j]  # its slot frees when the use `slots` earlier ends
            done = (xfer if xfer > free else free) + cp
            xfer = done
            if done > t:
                stalls[u] += done - t
                t = done
            t += c
            ring[j] = t
            k += 1
        t += after
        step = t - start_of_pass
        t += gap_ms
        if p == 0:
            first = sum(stalls)
        now = (xfer - t,) + tuple(ring[(k + j) % slots] - t for j in range(slots))
        if state is not None and all(abs(a - b) < STEADY_MS for a, b in zip(now, state)):
            break
        state = now
    return PassTimes(stalls, step + gap_ms, first)


def predict_stalls(order: list[int], costs: UnitCosts, resident: set[int], slots: int) -> list[float]:
    """Per-unit stall (ms) in a steady-state pass (`simulate_pass`)."""
    return simulate_pass(order, costs, resident, slots).stall_ms
