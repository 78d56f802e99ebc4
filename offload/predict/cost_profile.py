"""`Profile`: what `offload.predict` costs a plan from, made once per model and card.

Measured on a device (`device_timing.measure_on_device`) or computed for a named card from a meta-device run
(`meta_costs.analyse_on_meta`, priced by `predict`); used by `predict.predict_profile` for any number of configs and
budgets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Profile:
    """What a plan is costed from, made once per model and card (`profile_model`) and used for any number of configs
    and budgets (`predict_profile`): unit names and sizes, per-unit compute, the rest of the forward, copy speeds,
    device memory and the activation peak."""

    compute_ms: list[float]
    rest_ms: float
    pinned_gbps: float
    pageable_gbps: float
    latency_ms: float
    device_total: int
    device_free: int
    activation_bytes: int
    card: dict[str, Any]
    flops: list[float] | None = None
    # the engine's CPU time per forward with every unit resident / streamed (hooks, pass bookkeeping); the simulated
    # device computes on the CPU, so it adds to the step there; 0 on a GPU, where the kernels queue ahead of it
    hook_ms: dict[str, float] = field(default_factory=lambda: {"resident": 0.0, "streamed": 0.0})
    supports_pinned: bool = True
    backend_name: str = "cuda"
    named: bool = False
    names: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    rest_bytes: int = 0
    reserve_estimate: int | None = None  # the engine's first activation reserve for this model ("measure")
    # measured while copies ran beside the compute (the simulated device's copy thread shares the CPU with it): used
    # in proportion to how busy a plan keeps the copy engine
    busy_compute_ms: list[float] | None = None
    busy_rest_ms: float | None = None
    model_name: str = ""
    # the host form (issue 36): each unit's encoded size (estimated from its dtypes) and the device's decode rate in
    # GB/s of raw bytes (measured on the device for "measure"; None: the codec's default estimate)
    packed_sizes: list[int] | None = None
    decode_gbps: float | None = None
