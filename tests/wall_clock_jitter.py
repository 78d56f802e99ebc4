"""A pytest plugin for `tests/stress.py --jitter-ms`: the host's clock, as the engine's wall-clock paths read it, jumps.

Every `time.perf_counter()` the plain simulated device (`offload/backends/sim.py`: compute and copy events) and the
host clock of reads (`offload/backends/clock.py`) take is pushed ahead by a random amount (exponential, mean
LO_JITTER_MS; with chance LO_JITTER_SPIKE_P also a 5-50 ms busy moment), so every measured duration is stretched at
random, far more than a loaded machine usually does. A test whose verdict rests on a measured time (which plan costs
lead to, a stall, how many blocks stay resident after the plan from costs) fails within a few runs; one on the
simulated device's own clock (`SimClock`) or asserting behaviour only does not. Seeded by LO_JITTER_SEED (0: random).
"""
from __future__ import annotations

import os
import random
import threading
import time
import types

_real = time.perf_counter
_lock = threading.Lock()
_offset = [0.0]
_rng = random.Random(int(os.environ.get("LO_JITTER_SEED", "0")) or None)
_MEAN_S = float(os.environ.get("LO_JITTER_MS", "1.0")) / 1e3
_SPIKE_P = float(os.environ.get("LO_JITTER_SPIKE_P", "0.02"))


def jittered_perf_counter() -> float:
    """perf_counter(), pushed ahead by a random amount that only grows (so it stays monotonic)."""
    with _lock:
        _offset[0] += _rng.expovariate(1.0 / _MEAN_S) if _MEAN_S > 0 else 0.0
        if _SPIKE_P and _rng.random() < _SPIKE_P:
            _offset[0] += _rng.uniform(0.005, 0.05)
        return _real() + _offset[0]


def pytest_configure(config) -> None:
    jittered = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    jittered.perf_counter = jittered_perf_counter
    import offload.backends.clock as clock
    import offload.backends.sim as sim

    sim.time = jittered  # the module's own name for the time module: only these two read the jumpy clock
    clock.time = jittered
