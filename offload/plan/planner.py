"""THE plan: where every unit of a model lives, decided by one pure function from facts.

`make_plan(facts)` takes what is known about a model and the machine (`PlanFacts`: unit sizes and dtypes, the
non-block bytes, each device's allowance from its budget, the host RAM the model may use and the pin limit, which
units the file can stream, the measured costs and stalls, the plan in place) and returns a `Plan`: for every unit
its device, its tier (vram on which device, pinned, pageable, disk), whether it streams through the slot ring, the
stall predicted for it and the reason; the ring per device, the lookahead, the bounce buffers. First placement,
budget changes, out-of-memory shrinks, re-plans from measured costs and secondary devices all call it with new
facts; nothing else decides where a unit lives. Applying a plan is `DevicePlacement`'s (device side) and
`staging.stage_model`'s (host side); gathering the facts is the handle's (offload/handle.py, offload/plan/replan.py).

How each side is decided lives beside it: `plan_device.py` (resident set and ring, by count before anything is
measured, by predicted stall after; secondary devices), `plan_host.py` (host tiers under the RAM the model may
use), `ring_sim.py` (the simulated slot ring the stall predictions come from). This module also reads the facts
the machine offers (available host memory, the cgroup limit, the activation reserve).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import psutil

from .plan_device import (DeviceMemoryError, PlanError, UnitPlan, across_devices, plan_by_cost,  # noqa: F401
                          plan_units, ring_slots, spread, want_bytes)
from .plan_host import (GIB, MIB, MIN_BOUNCE, PREFERRED_BOUNCE, HostPlan, RamCeilingError,  # noqa: F401
                        bounce_buffers, host_ram_bytes, in_shared_copy, plan_host, plan_host_capped, published_later,
                        shared_units)
from ..store.codec import CODEC
from .facts import HostFacts, PlanFacts  # noqa: F401  (the facts a plan is made from: importable from here)
from .plan_compress import choose_compressed, encoded_later
from .ring_sim import UnitCosts, simulate_pass

log = logging.getLogger(__name__)

STALL_MARGIN_MS = 1.0  # passes that stall more than their plan predicted by more than this per pass (and by more
STALL_MARGIN_FRACTION = 0.25  # than this fraction of the predicted stall) feed the measured stalls to the next plan


@dataclass(frozen=True)
class UnitPlacement:
    """Where one unit lives and why."""

    name: str
    device: str | None  # the device holding a copy of its own (the compute device or a secondary); None: streamed
    tier: str  # vram (resident on `device`), else its host tier: pinned | pageable | disk
    host_tier: str  # where its master lives: pinned | pageable | disk
    predicted_stall_ms: float  # per pass (0 until costs are known, or when it cannot stall)
    reason: str
    compression: str = "none"  # the form its host master is held in: "none" or the codec's name


@dataclass
class Plan:
    """Where every unit lives: one value, made by `make_plan` (see the module docstring)."""

    units: tuple[UnitPlacement, ...]
    device_plan: UnitPlan  # the compute device: resident set, slot ring, the bytes they take; remote placements
    host_plan: HostPlan | None  # None for a device-only re-plan (the host tiers stay as staged)
    allowance: int  # the compute device's allowance the plan was made for
    prefetch: int  # the lookahead asked for
    bounce_count: int  # the read-ahead thread's bounce buffers
    from_costs: bool  # made from measured costs (else by count)
    predicted_step_ms: float | None  # compute plus predicted stall of one pass (None: nothing measured yet)
    messages: list[tuple[int, str]] = field(default_factory=list)  # (log level, text) for the caller to log
    compute_device: str = ""

    @property
    def compressed(self) -> frozenset[int]:
        """The units whose host masters are held compressed."""
        return frozenset(i for i, u in enumerate(self.units) if u.compression != "none")

    # the device side, as the placement applies it
    @property
    def resident(self) -> set[int]:
        return self.device_plan.resident

    @property
    def remote(self) -> dict[int, str]:
        return dict(self.device_plan.remote or {})

    @property
    def n_slots(self) -> int:
        return self.device_plan.n_slots

    @property
    def slot_bytes(self) -> int:
        return self.device_plan.slot_bytes

    @property
    def device_bytes(self) -> int:
        return self.device_plan.device_bytes

    @property
    def lookahead(self) -> int:
        """Streamed units on their way while one computes (the ring's slots less the one computing)."""
        return max(0, self.device_plan.n_slots - 1)

    @property
    def shrunk_lookahead(self) -> bool:
        return self.device_plan.shrunk_lookahead

    @property
    def notes(self) -> list[str]:
        return self.device_plan.notes

    @property
    def rings(self) -> dict[str, tuple[int, int]]:
        """Per device, (slots, bytes per slot): the compute device's ring (secondary devices hold no ring)."""
        return {self.compute_device: (self.device_plan.n_slots, self.device_plan.slot_bytes)}

    @property
    def predicted_stall_ms(self) -> list[float]:
        return [u.predicted_stall_ms for u in self.units]

    @property
    def reasons(self) -> list[str]:
        return [u.reason for u in self.units]

    @property
    def host_tiers(self) -> dict[int, str]:
        return {i: u.host_tier for i, u in enumerate(self.units)}

    @property
    def shared_units(self) -> frozenset[int]:
        """The units whose RAM master is the host copy shared between processes (empty: each process its own)."""
        return self.host_plan.shared if self.host_plan is not None else frozenset()

    @property
    def disk_units(self) -> list[int]:
        return [i for i, u in enumerate(self.units) if u.host_tier == "disk"]

    @property
    def bounce_bytes(self) -> int | None:
        return self.host_plan.bounce_bytes if self.host_plan is not None else None

    def ram_release_order(self) -> list[int]:
        """The order units give host RAM back in (`release_host_memory`: to the disk tier, where the file holds them):
        the last first, the reverse of the order the host plan fills RAM in."""
        return list(reversed(range(len(self.units))))

    def eviction_order(self) -> list[int]:
        """The order `unload(nbytes)` gives resident units up in: the last first (the first units of the next pass
        stay, and the ring has the whole pass to bring the late ones in)."""
        return sorted(self.device_plan.resident, reverse=True)

    def summary(self) -> str:
        n = len(self.units)
        p = self.device_plan
        return (f"{len(p.resident)} resident, {n - len(p.resident)} streamed, "
                f"{p.n_slots} slot(s) of {p.slot_bytes / 1e6:.1f} MB, plan {p.device_bytes / 1e6:.1f} MB")


def make_plan(facts: PlanFacts) -> Plan:
    """THE plan for `facts` (see the module docstring); raises PlanError when not even one slot fits the allowance
    and RamCeilingError when a hard RAM ceiling cannot be kept."""
    messages: list[tuple[int, str]] = []
    host = _host_plan(facts, messages) if facts.host is not None else None
    if host is not None:
        tiers = [host.tiers.get(i, "pinned") for i in range(len(facts.sizes))]
        stored = facts.file_forms or ("none",) * len(facts.sizes)
        forms = [CODEC if i in host.compressed else stored[i] if tiers[i] == "disk" else "none"
                 for i in range(len(facts.sizes))]
    else:
        tiers = list(facts.host_tiers) or ["pinned"] * len(facts.sizes)
        forms = list(facts.host_forms) or ["none"] * len(facts.sizes)
    scratch = facts.decode_scratch if any(f != "none" for f in forms) else 0
    device = _device_plan(replace(facts, rest_bytes=facts.rest_bytes + scratch) if scratch else facts)
    remote = device.remote or {}
    n = len(facts.sizes)
    stalls = device.predicted_stall_ms or [0.0] * n
    reasons = device.reasons or _count_reasons(facts, device)
    units = []
    for i in range(n):
        if i in remote:
            placed, tier = remote[i], "vram"
            reason = (reasons[i] if reasons[i].startswith("resident on") else
                      f"resident on {remote[i]}: the compute device streams it and {remote[i]} has room")
            stall = 0.0
        elif i in device.resident:
            placed, tier, reason, stall = facts.device, "vram", reasons[i], 0.0
        else:
            placed, tier, reason, stall = None, tiers[i], reasons[i], stalls[i]
        note = host.notes.get(i) if host is not None else (facts.host_notes[i] if facts.host_notes else None)
        units.append(UnitPlacement(facts.names[i], placed, tier, tiers[i], stall,
                                   f"{reason}; {note}" if note else reason, forms[i]))
    step = None
    if facts.costs is not None:
        streamed_on_ring = device.resident | set(remote)
        step = simulate_pass(list(facts.order) if facts.order else list(range(n)), facts.costs,
                             streamed_on_ring, device.n_slots).step_ms
        if facts.excess_ms is not None:
            step += sum(e for i, e in enumerate(facts.excess_ms) if i not in streamed_on_ring)
    return Plan(tuple(units), device, host, facts.allowance, facts.prefetch, bounce_buffers(facts.prefetch),
                facts.costs is not None, step, messages, facts.device)


def settled_plan(facts: PlanFacts, costs_of: Callable[[list[str]], UnitCosts]) -> Plan:
    """The plan a model settles on once every unit was measured: the plan by count it starts with (host tiers
    included), then the plan from costs with that one in place, as the PlanKeeper asks for them in turn (what
    `offload.predict` predicts with). `costs_of(host tiers)` costs each unit from where its master lives."""
    first = make_plan(facts)
    tiers = [first.host_tiers.get(i, "pinned") for i in range(len(facts.sizes))]
    forms = tuple(u.compression for u in first.units)
    held = first.host_plan.notes if first.host_plan is not None else {}
    notes = tuple(held.get(i, "") for i in range(len(facts.sizes)))
    settled = make_plan(replace(facts, host=None, host_tiers=tuple(tiers), host_forms=forms, host_notes=notes,
                                costs=costs_of(tiers), current=first))
    settled.host_plan = first.host_plan
    return settled


def _device_plan(facts: PlanFacts) -> UnitPlan:
    """The compute device's resident set and ring, and what the secondary devices hold."""
    sizes, names = list(facts.sizes), list(facts.names)
    if facts.costs is None:
        plan = plan_units(sizes, names, facts.rest_bytes, facts.allowance, facts.prefetch, facts.stream_all)
    else:
        cur = facts.current
        current = set(cur.resident) if cur is not None and cur.allowance == facts.allowance else None
        plan = plan_by_cost(sizes, names, facts.rest_bytes, facts.allowance, facts.prefetch, facts.costs,
                            list(facts.order) if facts.order else None, facts.stream_all, current,
                            list(facts.excess_ms) if facts.excess_ms is not None else None)
    return across_devices(plan, sizes, facts.rest_bytes, facts.allowance, dict(facts.remote_allowances),
                          facts.stream_all)


def _count_reasons(facts: PlanFacts, plan: UnitPlan) -> list[str]:
    """Why each unit is where a count-based plan (nothing measured yet) put it."""
    n = len(facts.sizes)
    if len(plan.resident) == n:
        return ["resident: every block fits the budget"] * n
    if facts.stream_all:
        return ["streamed: the preset keeps no block resident"] * n
    return [("resident: room left in the budget beside the slot ring (placed by size; costs not measured yet)"
             if i in plan.resident else
             "streamed: spread between resident blocks so its copy hides behind their compute (placed by size; "
             "costs not measured yet)") for i in range(n)]


def _host_plan(facts: PlanFacts, messages: list[tuple[int, str]]) -> HostPlan:
    """Host tiers and forms for the units' masters (plan_compress.py decides which are held compressed; each
    candidate's tiers come from `_host_tiers` with its host sizes)."""
    h = facts.host
    said: dict[int, list[tuple[int, str]]] = {}
    fixed = in_shared_copy(h.shared_forms, h.share, facts.host_compression)

    def plan_for(sizes: list[int]) -> HostPlan:
        notes: list[tuple[int, str]] = []
        # with units compressed, the weights outside the blocks (on the device the whole run) keep no RAM copy:
        # their host master is the spill file's map, read only when they are unloaded
        spill_rest = list(sizes) != list(facts.sizes)
        plan = _host_tiers(facts, sizes, notes, 0 if spill_rest else facts.rest_bytes)
        plan.host_sizes = sizes
        plan.rest_spilled = spill_rest
        said[id(plan)] = notes
        return plan

    def fits(plan: HostPlan) -> bool:
        if any(t == "disk" for t in plan.tiers.values()):
            return False
        if h.hard:
            rest = 0 if plan.rest_spilled else facts.rest_bytes
            return host_ram_bytes(plan.host_sizes, rest, plan.tiers, plan.bounce_bytes, facts.prefetch,
                                  h.bounces_pageable, facts.disk_residue) <= h.ram_budget
        return plan.ram_bytes <= h.ram_budget + sum(plan.host_sizes[i] for i in fixed)

    plan, compressed = choose_compressed(facts.host_compression, list(facts.sizes), list(facts.packed_sizes),
                                         plan_for, fits, h.hard, fixed)
    compressed = frozenset(i for i in compressed if plan.tiers.get(i) != "disk")
    if not compressed and plan.rest_spilled:  # every unit chosen went to the disk tier (read raw): nothing is held
        plan = plan_for(list(facts.sizes))  # compressed, so the weights outside the blocks keep their RAM copy
    plan.compressed = compressed
    plan.rest_spilled = plan.rest_spilled and bool(plan.compressed)
    compressed = plan.compressed
    if compressed and not h.hard and fits(plan_for(list(facts.sizes))):  # RAM holds them raw meanwhile
        plan.encode_later = encoded_later(compressed, fixed, facts.from_file, facts.file_forms, facts.sizes)
    plan.publish_later = published_later(plan, h.hard, filler=h.share and not any(h.shared_forms))
    messages.extend(said.get(id(plan), []))
    if compressed:
        raw = sum(facts.sizes[i] for i in compressed)
        held = sum(plan.host_sizes[i] for i in compressed)
        messages.append((logging.INFO, f"{facts.name}: {len(compressed)} unit(s) held compressed in RAM "
                                       f"({raw / MIB:.1f} MB in {held / MIB:.1f} MB, decoded on the device)"))
    return plan


def _host_tiers(facts: PlanFacts, sizes: list[int], messages: list[tuple[int, str]], rest_bytes: int) -> HostPlan:
    """Host tiers for the units' masters: pinned RAM, pageable RAM, or the disk file (`sizes`: host bytes).

    A hard ceiling (`ram_budget_bytes`) bounds everything the engine holds in host RAM for this model (the weights
    outside the blocks, the blocks kept in RAM and the read-ahead bounce buffers); without it the plan fits the
    blocks into what the machine has available and only warns when they need more. A unit the file cannot stream
    stays in pageable RAM.
    """
    h = facts.host
    pin_limit = h.pin_limit if h.pin else 0
    # the read-ahead thread's cast scratch, held while a unit read with a cast is on the disk tier
    cast_scratch = facts.cast_scratch if h.allow_disk and any(facts.file_casts) else 0
    # the units the shared host copy holds already come first (RAM does not fill them from the disk tier's end);
    # under no hard ceiling they take nothing from the RAM available: their pages are in RAM already
    fixed = in_shared_copy(h.shared_forms, h.share, facts.host_compression)
    order = sorted(fixed) + [i for i in range(len(sizes)) if i not in fixed] if fixed else None
    residue = _residue(facts)
    if h.hard:
        plan = plan_host_capped(sizes, rest_bytes, h.ram_budget - cast_scratch, pin_limit, h.allow_disk, h.pin,
                                facts.prefetch, h.bounces_pageable, max(facts.sizes, default=0), order,
                                file_given=h.file_path is not None, residue=residue)
    else:
        budget = h.ram_budget + sum(sizes[i] for i in fixed)
        plan = plan_host(sizes, budget, pin_limit, h.allow_disk, h.pin, order, residue)
        if plan.ram_bytes > budget:
            messages.append((logging.WARNING, f"{facts.name} needs {plan.ram_bytes / GIB:.2f} GiB of host RAM for its "
                                              f"blocks but about {h.ram_budget / GIB:.2f} GiB is available; give "
                                              f"disk_path (its safetensors file) to stream the rest from disk"))
    disk_ok = facts.disk_ok or (False,) * len(sizes)
    tiers = {i: t if t != "disk" or disk_ok[i] else "pageable" for i, t in plan.tiers.items()}
    refused = {i: _refusal(facts, i) for i, t in plan.tiers.items() if t == "disk" and not disk_ok[i]}
    casts = facts.file_casts or ("",) * len(sizes)
    notes = {i: f"kept in RAM, off the disk tier: {why}" for i, why in refused.items()}
    notes.update({i: f"read from {h.file_path} with a cast ({casts[i]})" for i, t in tiers.items()
                  if t == "disk" and casts[i]})
    for i, t in tiers.items():  # the leaves the file lacks stay in RAM beside the disk tier
        if t == "disk" and residue[i]:
            notes[i] = "; ".join(filter(None, [notes.get(i, ""), f"keeps {residue[i]} bytes in RAM: tensors "
                                                                 f"{h.file_path} lacks"]))
    plan = HostPlan(tiers, plan.ram_bytes, plan.pinned_bytes, plan.bounce_bytes,
                    shared=shared_units(tiers, h.share), notes=notes)
    disk = sum(1 for t in tiers.values() if t == "disk")
    if disk:
        messages.append((logging.INFO, f"{facts.name}: {disk} unit(s) stream from {h.file_path} (RAM budget "
                                       f"{h.ram_budget / MIB:.1f} MB)"))
    if refused:
        first = min(refused)
        messages.append((logging.WARNING, f"{facts.name}: {len(refused)} block(s) stay in RAM although RAM is short, "
                                          f"since the file cannot stream them: {facts.names[first]}: "
                                          f"{refused[first]}" + (" (and more)" if len(refused) > 1 else "")))
    if h.hard:
        held = [facts.sizes[i] if tiers.get(i) == "disk" else s for i, s in enumerate(sizes)]  # disk: read raw
        ram = host_ram_bytes(held, rest_bytes, tiers, plan.bounce_bytes, facts.prefetch, h.bounces_pageable,
                             residue)
        ram += cast_scratch if any(tiers.get(i) == "disk" and casts[i] for i in range(len(sizes))) else 0
        if ram > h.ram_budget:
            kept = [i for i in range(len(sizes)) if tiers.get(i) != "disk"]
            names = ", ".join(f"{facts.names[i]} ({_refusal(facts, i)})" for i in kept[:3]) + \
                (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
            if not h.disk_optional:
                raise RamCeilingError(
                    f"{facts.name}: ram_budget_bytes={h.ram_budget} cannot be kept: {len(kept)} block(s) cannot "
                    f"stream from disk ({names}) and need {ram} bytes of host RAM; raise ram_budget_bytes to at "
                    f"least {ram}")
            # asked for: blocks the file does not hold stay in RAM rather than fail
            messages.append((logging.WARNING, f"{facts.name}: host RAM is {ram} bytes, over ram_budget_bytes="
                                              f"{h.ram_budget}: {len(kept)} block(s) could not go to the disk tier "
                                              f"({names}; disk_optional=True keeps them in RAM)"))
    return plan


def _residue(facts: PlanFacts) -> list[int]:
    """Per unit, the host bytes it keeps in RAM on the disk tier (the leaves its file lacks); 0 where unknown."""
    return [facts.disk_residue[i] if i < len(facts.disk_residue) else 0 for i in range(len(facts.sizes))]


def _refusal(facts: PlanFacts, i: int) -> str:
    """Why unit i cannot stream from the model's file (named by the facts, else the general causes)."""
    why = facts.disk_refusals[i] if i < len(facts.disk_refusals) else ""
    if why:
        return why
    if facts.disk_ok and i < len(facts.disk_ok) and facts.disk_ok[i]:
        return "RAM held it within the budget"
    return (f"bytes {facts.host.file_path} does not hold, misaligned tensors or tensors computed at load"
            if facts.host is not None and facts.host.file_path else "no model file (disk_path) to stream it from")


# Facts the machine offers ---------------------------------------------------------------------------------------


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


