"""The host side of a plan: which tier each unit's master lives in (pinned RAM, pageable RAM, the disk file) and the
read-ahead thread's bounce buffers, under the RAM the model may use. Called only by `planner.make_plan`."""
from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20
GIB = 1 << 30
MIN_BOUNCE = 4096  # the smallest bounce buffer a RAM ceiling may shrink the read-ahead ring to
PREFERRED_BOUNCE = 4 * MIB  # below a whole block, reads of this size keep the disk tier near its sequential speed


class RamCeilingError(ValueError):
    """`ram_budget_bytes` is below what the model needs in host RAM at the least: names that minimum."""


@dataclass
class HostPlan:
    """Which host tier each streamed unit's master lives in."""

    tiers: dict[int, str]  # unit index -> pinned | pageable | disk
    ram_bytes: int
    pinned_bytes: int
    bounce_bytes: int | None = None  # size of each bounce buffer under a RAM ceiling (None: the largest unit)
    compressed: frozenset[int] = frozenset()  # units held compressed in RAM (plan_compress.py)
    host_sizes: list[int] | None = None  # each unit's host bytes (its encoded size where compressed)
    rest_spilled: bool = False  # the weights outside the blocks keep no RAM copy (their master: the spill map)
    shared: frozenset[int] = frozenset()  # units whose RAM master is the host copy shared between processes
    notes: dict[int, str] = field(default_factory=dict)  # per unit: what its reason adds about its host tier
    # units held compressed that staging may keep raw and have encoded on a thread after setup (RAM holds the raw
    # plan and no ceiling binds: setup then takes what a raw one does; `stream/background_encode.py`)
    encode_later: frozenset[int] = frozenset()
    # units of the shared host copy this process fills that staging keeps in its own RAM and a thread puts in the
    # copy after setup (`published_later`; `stream/background_publish.py`)
    publish_later: frozenset[int] = frozenset()


def published_later(plan: HostPlan, hard: bool, filler: bool) -> frozenset[int]:
    """The units of the shared host copy that setup stages in this process's own RAM and a thread moves into the
    copy afterwards, one at a time (each swapped in at a safe point, its private buffer then freed): tmpfs takes
    pages at a fraction of the speed anonymous memory does (one writer per file, every page added to its page
    cache), so filling the copy during setup would hold the load up about twice as long as a private one. Only for
    the process that fills the copy (a joiner maps what is there), every shared unit raw at setup (one encoded into
    the copy while loading keeps the copy filled at setup), and no hard ceiling (a unit is held twice while it
    moves)."""
    if not plan.shared or hard or not filler or (plan.compressed - plan.encode_later) & plan.shared:
        return frozenset()
    return plan.shared


def shared_units(tiers: dict[int, str], share: bool) -> frozenset[int]:
    """The units held in the shared form: every unit kept in RAM (pinned or pageable) when the model's file names a
    copy other processes can map (`HostFacts.share`); a disk-tier unit is read from the file as before."""
    return frozenset(i for i, t in tiers.items() if t != "disk") if share else frozenset()


def in_shared_copy(forms: tuple[str, ...], share: bool, compression: str) -> dict[int, bool]:
    """The units the host copy another process filled holds in a form this process can map (unit -> held encoded;
    `HostFacts.shared_forms`): all of them, less the encoded ones where compression is off."""
    if not share:
        return {}
    return {i: f != "none" for i, f in enumerate(forms) if f and (f == "none" or compression != "off")}


def bounce_buffers(prefetch: int) -> int:
    """Pinned bounce buffers the read-ahead thread cycles: one per slot of the ring plus one being filled."""
    return prefetch + 2


def plan_host(sizes: list[int], ram_budget: int, pin_limit: int, allow_disk: bool, pin: bool,
              order: list[int] | None = None, residue: list[int] | tuple[int, ...] = ()) -> HostPlan:
    """Put units in pinned RAM while the pin limit allows, pageable RAM after, disk when RAM runs out; a disk-tier
    unit still holds its `residue` in RAM (the leaves its file lacks), which RAM keeps room for."""
    tiers: dict[int, str] = {}
    ram = pinned = 0
    ahead = sum(residue)  # the residue of the units not placed yet: each needs its room if it goes to disk
    for i in (order if order is not None else range(len(sizes))):
        size = sizes[i]
        left = residue[i] if i < len(residue) else 0
        ahead -= left
        if ram + size + ahead <= ram_budget or not allow_disk:
            if pin and pinned + size <= pin_limit:
                tiers[i] = "pinned"
                pinned += size
            else:
                tiers[i] = "pageable"
            ram += size
        else:
            tiers[i] = "disk"
            ram += left
    return HostPlan(tiers, ram, pinned)


def plan_host_capped(sizes: list[int], rest_bytes: int, ram_budget: int, pin_limit: int, allow_disk: bool,
                     pin: bool, prefetch: int, bounces_pageable: bool, biggest: int | None = None,
                     order: list[int] | None = None, file_given: bool = False,
                     residue: list[int] | tuple[int, ...] = ()) -> HostPlan:
    """Host tiers under a hard RAM ceiling: the non-block weights, the blocks kept in RAM and the read-ahead
    thread's bounce buffers together stay within `ram_budget`; the rest of the blocks go to the disk tier.

    Bounce buffers are needed for disk blocks, and for pageable blocks where the device has pinned memory
    (`bounces_pageable`). They are whole blocks or PREFERRED_BOUNCE when RAM allows (a quarter of it at most);
    when RAM is tight, blocks kept in RAM come first and the buffers get what is left (MIN_BOUNCE at the least):
    a block is then read in ranges. A ceiling below the least such a plan needs raises RamCeilingError (naming the
    way to the disk tier: the model's file, or, where it is given, a config that allows the disk tier).
    """
    count = bounce_buffers(prefetch)
    biggest = max(sizes, default=0) if biggest is None else biggest  # a disk-tier unit is read raw
    least_bounce = count * min(biggest, MIN_BOUNCE)
    avail = ram_budget - rest_bytes
    in_ram = plan_host(sizes, max(0, avail), pin_limit, False, pin, order)  # every block in RAM
    bounced_in_ram = bounces_pageable and any(t == "pageable" for t in in_ram.tiers.values())
    if allow_disk:
        minimum = rest_bytes + least_bounce + sum(residue)
        how = "or give it more RAM"
    else:
        minimum = rest_bytes + sum(sizes) + (least_bounce if bounced_in_ram else 0)
        how = ("or allow the disk tier (allow_disk=True, as the auto, consumer and budget presets do) so blocks can "
               "stream from disk_path" if file_given else
               "or give disk_path (the model's safetensors file) so blocks can stream from disk")
    if ram_budget < minimum:
        raise RamCeilingError(
            f"ram_budget_bytes={ram_budget} is below the {minimum} bytes this model needs in host RAM at the least "
            f"({rest_bytes} bytes of weights outside the blocks"
            + (f", {least_bounce} bytes of bounce buffers" + (f", {sum(residue)} bytes the disk tier keeps in RAM "
                                                              f"(tensors the file lacks)" if any(residue) else "")
               if allow_disk else f", {sum(sizes)} bytes of blocks")
            + f"); raise ram_budget_bytes to at least {minimum} {how}")
    if in_ram.ram_bytes <= avail and not bounced_in_ram:
        return in_ram  # everything in RAM, no bounce buffer at all
    preferred = min(biggest, max(PREFERRED_BOUNCE, avail // 4 // count // 4096 * 4096))
    if count * preferred <= avail // 2:
        chunk = preferred
        plan = plan_host(sizes, avail - count * chunk, pin_limit, allow_disk, pin, order, residue)
    else:  # tight: blocks in RAM first, the bounce buffers share what they leave
        plan = plan_host(sizes, avail - least_bounce, pin_limit, allow_disk, pin, order, residue)
        chunk = min(biggest, max(MIN_BOUNCE, (avail - plan.ram_bytes) // count // 4096 * 4096))
    plan.bounce_bytes = chunk
    return plan


def host_ram_bytes(sizes: list[int], rest_bytes: int, tiers: dict[int, str], bounce_bytes: int | None,
                   prefetch: int, bounces_pageable: bool, residue: list[int] | tuple[int, ...] = ()) -> int:
    """Host RAM a staged model with these tiers holds: the blocks kept in RAM, the disk-tier blocks' residue, the
    non-block weights and the read-ahead thread's bounce buffers (there when a block is bounced: on disk, or
    pageable where pinning exists)."""
    ram = rest_bytes + sum(s for i, s in enumerate(sizes) if tiers.get(i) != "disk")
    ram += sum(r for i, r in enumerate(residue) if tiers.get(i) == "disk")
    bounced = [s for i, s in enumerate(sizes)
               if tiers.get(i) == "disk" or (bounces_pageable and tiers.get(i) == "pageable")]
    if bounced:
        size = max(bounced) if bounce_bytes is None else min(max(bounced), bounce_bytes)
        ram += size * bounce_buffers(prefetch)
    return ram
