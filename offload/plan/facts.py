"""The facts a plan is made from (`PlanFacts`, with the host's `HostFacts`): what is known about a model and the
machine, gathered by the handle and the PlanKeeper, read only by `planner.make_plan`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ring_sim import UnitCosts


@dataclass(frozen=True)
class HostFacts:
    """What the host offers one model: the RAM it may hold (a hard ceiling or what is available), pinning, the file."""

    ram_budget: int  # bytes of host RAM for the blocks (hard: everything the engine holds for the model)
    hard: bool  # ram_budget_bytes was given: a ceiling that must hold (else: what the machine has available)
    pin_limit: int  # bytes that may be pinned (0: none)
    pin: bool  # pin the masters (asked for, and the device has pinned memory)
    allow_disk: bool  # the preset allows the disk tier and a file was given
    bounces_pageable: bool  # the device has pinned memory: pageable masters are copied through a bounce buffer
    disk_optional: bool  # blocks the file cannot stream stay in RAM instead of failing
    file_path: str | None = None
    share: bool = False  # the RAM masters may be one host copy shared with other processes (OffloadConfig.share_host)
    # per unit, its form in the shared host copy another process filled already: "" (not there), "none" (raw) or
    # the codec's name (encoded; `PlanFacts.packed_sizes` holds its size there). Facts: such a unit keeps that form
    shared_forms: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanFacts:
    """Everything a plan is made from (see `make_plan`); a re-plan is the same call with some facts changed."""

    name: str  # the model's name, for messages
    sizes: tuple[int, ...]  # bytes of each unit as it moves (aligned layout)
    names: tuple[str, ...]
    rest_bytes: int  # the weights outside the units (always resident on the compute device)
    prefetch: int  # the lookahead asked for, in streamed units
    stream_all: bool  # the preset keeps no unit resident (vram_fraction 0)
    device: str  # the compute device
    allowance: int  # device bytes the compute device's budget lets this model hold now
    remote_allowances: tuple[tuple[str, int], ...] = ()  # the same on each secondary device, in order
    dtypes: tuple[tuple[str, ...], ...] = ()  # each unit's tensor dtypes (what its bytes are)
    disk_ok: tuple[bool, ...] = ()  # per unit: the model's file can stream it (empty: none can)
    from_file: tuple[bool, ...] = ()  # per unit: setup reads its bytes from the model's file (built on meta)
    host: HostFacts | None = None  # None: the host side is staged already (its tiers are kept)
    host_tiers: tuple[str, ...] = ()  # the host tiers in place when `host` is None
    costs: UnitCosts | None = None  # measured per-unit compute and copy times (None: nothing measured yet)
    excess_ms: tuple[float, ...] | None = None  # per unit: stall measured beyond the prediction under `current`
    order: tuple[int, ...] | None = None  # the call order (None: index order)
    current: Any = None  # the plan in place (a planner.Plan, or None): kept unless a new one clearly saves stall
    host_compression: str = "off"  # auto | lossless | off: which units' host masters may be held compressed
    packed_sizes: tuple[int, ...] = ()  # per unit: its encoded size (measured or estimated; empty: unknown)
    host_forms: tuple[str, ...] = ()  # the forms in place when `host` is None ("none" or the codec's name)
    host_notes: tuple[str, ...] = ()  # what the staged host side adds to each unit's reason when `host` is None
    decode_scratch: int = 0  # device bytes a compressed unit's decode holds beside the slot
    file_forms: tuple[str, ...] = ()  # per unit: the form its file stores it in (a packed folder's `pack --compress`
    # units: the codec's name), which it streams in from the disk tier (empty: every unit stored raw)
    disk_refusals: tuple[str, ...] = ()  # per unit: why the file cannot stream it ("" where it can; empty: unknown)
    file_casts: tuple[str, ...] = ()  # per unit: the casts its file's tensors take on read ("float8_e4m3fn from
    # bfloat16", "" for none: ComfyUI's weight_dtype, a bf16 file loaded as fp32), done by the read-ahead thread
    cast_scratch: int = 0  # host bytes the read-ahead thread's cast scratch holds while a cast unit is on disk
    disk_residue: tuple[int, ...] = ()  # per unit: host bytes it keeps in RAM on the disk tier, the leaves its file
    # lacks (store/leaf_match.py: exact where its bytes were checked, else at most this; empty: none)

    @property
    def scratch_bytes(self) -> int:
        """The decode's scratch where a staged unit is held compressed (0 otherwise): held beside the rest."""
        return self.decode_scratch if any(f != "none" for f in self.host_forms) else 0
