"""Which units' host masters are held compressed (the codec's lossless form, decoded on the device): part of the
host side of a plan, called only by `planner.make_plan`.

- "off": none.
- "lossless": every unit whose encoded size pays (below `codec.UNIT_PAYS` of raw).
- "auto": none when every unit fits in RAM raw; under a hard RAM ceiling (`ram_budget_bytes`) that raw units break,
  all that pay (the ceiling asks for RAM) when that keeps every unit in RAM; else (the RAM the machine has
  available) the fewest units, from the last in the order RAM fills (the ones that would go to the disk tier
  first), that keep every unit in RAM. When compression cannot keep every unit off the disk tier, every unit that
  pays is compressed if that leaves fewer bytes to read from the disk tier than the plan without it (a decode on
  the device costs far less than a read from disk), else the plan is the one without it (compressed only when no
  plan without it keeps a hard ceiling at all). Never a unit that would not pay.
- Units another process already holds in the host copy shared between processes (`fixed`: unit -> held encoded)
  keep that copy's form whatever the mode: they are facts, not choices (a joining process maps them as they are).

The host plan is then made with each unit's host size (its encoded size where compressed).
"""
from __future__ import annotations

from typing import Callable

from ..store.codec import UNIT_PAYS
from .plan_host import HostPlan, RamCeilingError

def paying(sizes: list[int], packed: list[int]) -> list[int]:
    """The units whose encoded size pays."""
    if not packed:
        return []
    return [i for i, (s, p) in enumerate(zip(sizes, packed)) if s and p < UNIT_PAYS * s]


def disk_bytes(plan: HostPlan, sizes: list[int]) -> int:
    """Raw bytes a pass reads from the disk tier with this plan (a disk-tier unit is read raw)."""
    return sum(sizes[i] for i, tier in plan.tiers.items() if tier == "disk")


def choose_compressed(mode: str, sizes: list[int], packed: list[int],
                      plan_for: Callable[[list[int]], HostPlan], fits: Callable[[HostPlan], bool],
                      hard: bool = False, fixed: dict[int, bool] | None = None) -> tuple[HostPlan, frozenset[int]]:
    """(host plan, compressed units) for `mode`. `plan_for(host sizes)` makes the host plan (it may raise
    RamCeilingError); `fits(plan)` says whether a plan keeps every unit in RAM within the RAM the model may use;
    `fixed` the units whose form is a fact (unit -> held encoded; `packed` holds their encoded size)."""
    fixed = fixed or {}
    forced = sorted(i for i, encoded in fixed.items() if encoded)
    candidates = [i for i in paying(sizes, packed) if i not in fixed]

    def with_compressed(chosen: list[int]) -> list[int]:
        eff = list(sizes)
        for i in forced + list(chosen):
            eff[i] = packed[i]
        return eff

    if mode == "off" or not candidates:
        return plan_for(with_compressed([])), frozenset(forced)

    if mode == "lossless":
        return plan_for(with_compressed(candidates)), frozenset(forced + candidates)
    error: RamCeilingError | None = None
    raw: HostPlan | None = None
    try:
        raw = plan_for(with_compressed([]))
        if fits(raw):
            return raw, frozenset(forced)
    except RamCeilingError as exc:
        error = exc
    if hard:  # the ceiling asks for RAM: every unit that pays, when that keeps them all in RAM
        try:
            plan = plan_for(with_compressed(candidates))
            if fits(plan):
                return plan, frozenset(forced + candidates)
        except RamCeilingError:
            pass
    else:  # the units RAM fills last go to the disk tier first: the fewest from the end that keep all in RAM
        order = list(reversed(candidates))
        lo, hi = 1, len(order)
        best: tuple[HostPlan, frozenset[int]] | None = None
        while lo <= hi:  # more units compressed never needs more RAM: bisection
            mid = (lo + hi) // 2
            try:
                plan = plan_for(with_compressed(order[:mid]))
                ok = fits(plan)
            except RamCeilingError:
                ok = False
            if ok:
                best, hi = (plan, frozenset(forced + order[:mid])), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return best
    if raw is not None:  # compression cannot keep every unit off the disk tier: the fewer disk bytes win
        try:
            every = plan_for(with_compressed(candidates))
        except RamCeilingError:
            return raw, frozenset(forced)
        if disk_bytes(every, sizes) < disk_bytes(raw, sizes):
            return every, frozenset(forced + candidates)
        return raw, frozenset(forced)
    try:  # no raw plan keeps the ceiling: compressed, if that one does
        return plan_for(with_compressed(candidates)), frozenset(forced + candidates)
    except RamCeilingError:
        raise error from None


ENCODE_LATER_BYTES = 64 << 20  # raw bytes to encode from the file above which setup leaves them to a thread


def encoded_later(compressed: frozenset[int], fixed: dict[int, bool], from_file: tuple[bool, ...],
                  file_forms: tuple[str, ...], sizes: tuple[int, ...]) -> frozenset[int]:
    """The units held compressed that staging may keep raw and have encoded after setup (the caller checked that RAM
    holds them raw meanwhile and no ceiling binds): those read from the model's file (encoding them at load would
    hold the reads up: the encoder runs at a fraction of a read's speed), not a packed folder's stored encoding (taken
    as is) nor a form another process's shared copy holds (`fixed`); none where they come to less than
    ENCODE_LATER_BYTES (encoded at load in a fraction of a second)."""
    stored = {i for i, f in enumerate(file_forms) if f != "none"}
    later = frozenset(i for i in compressed
                      if i < len(from_file) and from_file[i] and i not in stored and i not in fixed)
    return later if sum(sizes[i] for i in later) >= ENCODE_LATER_BYTES else frozenset()
