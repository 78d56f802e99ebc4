"""Auto-configuration: how many units stay resident, how many slots the ring gets, which units live on disk.

Reads free device memory from the backend, available host memory from MemAvailable and the cgroup limit
(a container's limit is lower than what `free` shows), and keeps a reserve for activations.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30


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
    remote: dict[int, str] | None = None  # several devices: units resident on a secondary device (None: decide later)


def ring_slots(prefetch: int, n_streamed: int) -> int:
    """Slots the ring wants: the unit computing plus `prefetch` on their way, never more than units streamed."""
    return max(0, min(prefetch + 1, n_streamed))


def bounce_buffers(prefetch: int) -> int:
    """Pinned bounce buffers the read-ahead thread cycles: one per slot of the ring plus one being filled."""
    return prefetch + 2


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


@dataclass
class HostMemory:
    """Host memory as the planner sees it."""

    mem_available: int
    cgroup_limit: int | None
    cgroup_usage: int | None
    pin_limit: int

    @property
    def available(self) -> int:
        """What we may still use: MemAvailable, lowered to the cgroup's headroom inside a container."""
        if self.cgroup_limit is not None and self.cgroup_usage is not None:
            return max(0, min(self.mem_available, self.cgroup_limit - self.cgroup_usage))
        return self.mem_available


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < (1 << 60) else None  # v1 reports "no limit" as a huge number


def read_cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, v2 or v1; (None, None) when unlimited or unknown."""
    rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[0] == "0" or "memory" in parts[1].split(",")):
                rel = parts[2].lstrip("/")
                if parts[0] == "0":
                    break
    except OSError:
        pass
    for base in ([root / rel, root] if rel else [root]):
        limit = _read_int(base / "memory.max")
        if limit is not None:
            return limit, _read_int(base / "memory.current")
    for base in ([root / "memory" / rel, root / "memory"] if rel else [root / "memory"]):
        limit = _read_int(base / "memory.limit_in_bytes")
        if limit is not None:
            return limit, _read_int(base / "memory.usage_in_bytes")
    return None, None


def read_host_memory(pin_fraction: float | None = None, cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """MemAvailable, the cgroup limit and a pin limit (a fraction of RAM, lower on Windows)."""
    vm = psutil.virtual_memory()
    limit, usage = read_cgroup_memory(cgroup_root)
    if pin_fraction is None:
        pin_fraction = 0.35 if sys.platform == "win32" else 0.8
    mem = HostMemory(int(vm.available), limit, usage, 0)
    mem.pin_limit = int(min(vm.total, limit or vm.total) * pin_fraction)
    return mem


@dataclass
class HostPlan:
    """Which host tier each streamed unit's master lives in."""

    tiers: dict[int, str]  # unit index -> pinned | pageable | disk
    ram_bytes: int
    pinned_bytes: int
    bounce_bytes: int | None = None  # size of each bounce buffer under a RAM ceiling (None: the largest unit)


def plan_host(sizes: list[int], ram_budget: int, pin_limit: int, allow_disk: bool, pin: bool,
              order: list[int] | None = None) -> HostPlan:
    """Put units in pinned RAM while the pin limit allows, pageable RAM after, disk when RAM runs out."""
    tiers: dict[int, str] = {}
    ram = pinned = 0
    for i in (order if order is not None else range(len(sizes))):
        size = sizes[i]
        if ram + size <= ram_budget or not allow_disk:
            if pin and pinned + size <= pin_limit:
                tiers[i] = "pinned"
                pinned += size
            else:
                tiers[i] = "pageable"
            ram += size
        else:
            tiers[i] = "disk"
    return HostPlan(tiers, ram, pinned)


MIN_BOUNCE = 4096  # the smallest bounce buffer a RAM ceiling may shrink the read-ahead ring to
PREFERRED_BOUNCE = 4 * MIB  # below a whole block, reads of this size keep the disk tier near its sequential speed


class RamCeilingError(ValueError):
    """`ram_budget_bytes` is below what the model needs in host RAM at the least: names that minimum."""


def plan_host_capped(sizes: list[int], rest_bytes: int, ram_budget: int, pin_limit: int, allow_disk: bool,
                     pin: bool, prefetch: int, bounces_pageable: bool) -> HostPlan:
    """Host tiers under a hard RAM ceiling: the non-block weights, the blocks kept in RAM and the read-ahead
    thread's bounce buffers together stay within `ram_budget`; the rest of the blocks go to the disk tier.

    Bounce buffers are needed for disk blocks, and for pageable blocks where the device has pinned memory
    (`bounces_pageable`). They are whole blocks or PREFERRED_BOUNCE when RAM allows (a quarter of it at most);
    when RAM is tight, blocks kept in RAM come first and the buffers get what is left (MIN_BOUNCE at the least):
    a block is then read in ranges. A ceiling below the least such a plan needs raises RamCeilingError.
    """
    count = bounce_buffers(prefetch)
    biggest = max(sizes, default=0)
    least_bounce = count * min(biggest, MIN_BOUNCE)
    avail = ram_budget - rest_bytes
    in_ram = plan_host(sizes, max(0, avail), pin_limit, False, pin)  # every block in RAM
    bounced_in_ram = bounces_pageable and any(t == "pageable" for t in in_ram.tiers.values())
    if allow_disk:
        minimum = rest_bytes + least_bounce
        how = "or give it more RAM"
    else:
        minimum = rest_bytes + sum(sizes) + (least_bounce if bounced_in_ram else 0)
        how = "or give disk_path (the model's safetensors file) so blocks can stream from disk"
    if ram_budget < minimum:
        raise RamCeilingError(
            f"ram_budget_bytes={ram_budget} is below the {minimum} bytes this model needs in host RAM at the least "
            f"({rest_bytes} bytes of weights outside the blocks"
            + (f", {least_bounce} bytes of bounce buffers" if allow_disk else f", {sum(sizes)} bytes of blocks")
            + f"); raise ram_budget_bytes to at least {minimum} {how}")
    if in_ram.ram_bytes <= avail and not bounced_in_ram:
        return in_ram  # everything in RAM, no bounce buffer at all
    preferred = min(biggest, max(PREFERRED_BOUNCE, avail // 4 // count // 4096 * 4096))
    if count * preferred <= avail // 2:
        chunk = preferred
        plan = plan_host(sizes, avail - count * chunk, pin_limit, allow_disk, pin)
    else:  # tight: blocks in RAM first, the bounce buffers share what they leave
        plan = plan_host(sizes, avail - least_bounce, pin_limit, allow_disk, pin)
        chunk = min(biggest, max(MIN_BOUNCE, (avail - plan.ram_bytes) // count // 4096 * 4096))
    plan.bounce_bytes = chunk
    return plan


def default_reserve(total_device_bytes: int, backend_name: str) -> int:
    """Device bytes kept free for activations before anything is measured."""
    if backend_name == "sim":
        return total_device_bytes // 10
    return max(512 * MIB, min(2 * GIB, total_device_bytes // 10))


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_activation_bytes(model: Any, dtype_bytes: int = 2, tokens: int = 4096) -> int | None:
    """Peak activation bytes of one block, estimated from a transformers/diffusers `config` when there is one.

    Width from `hidden_size` / `d_model` / `heads x head_dim`; sequence from `max_position_embeddings` capped at
    `tokens` (diffusion transformers: `tokens` image tokens); about 12 width-sized tensors live at the peak of
    a block (attention in/out, the 4x MLP hidden, residuals). A first guess only: the measured peak of the
    first run replaces it.
    """
    config = getattr(model, "config", None)
    if config is None:
        return None
    width = _config_value(config, "hidden_size", "d_model", "dim", "inner_dim")
    if width is None:
        heads = _config_value(config, "num_attention_heads")
        head_dim = _config_value(config, "attention_head_dim", "head_dim")
        width = heads * head_dim if heads and head_dim else None
    if width is None:
        return None
    seq = min(tokens, _config_value(config, "max_position_embeddings") or tokens)
    return 12 * seq * width * dtype_bytes


def estimate_reserve(model: Any, total_device_bytes: int, backend_name: str) -> int:
    """The activation reserve before the first run: the config-based estimate where known, else a default."""
    base = default_reserve(total_device_bytes, backend_name)
    estimate = config_activation_bytes(model)
    if estimate is None:
        return base
    return int(min(max(estimate, base // 2), total_device_bytes // 2))


