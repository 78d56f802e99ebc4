"""OffloadConfig and the presets: every knob a user can turn, validated up front with clear errors."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

GIB = 1 << 30

_DEVICE_RE = re.compile(r"^(auto|sim(:\d+)?|cuda(:\d+)?)$")


@dataclass(frozen=True)
class PresetPolicy:
    """Everything a preset means, in one place: the engine, the nodes' dropdowns and tooltips, the VRAM Budget
    node and the README table all read it from here."""

    description: str  # one line: the tooltip and the README's "what stays resident"
    vram_fraction: float  # share of the budget the model may keep resident; 1 = all that fits, 0 = ring only
    budget_fraction: float  # VRAM Budget node: share of the device's total memory for all models together
    prefetch: int  # lookahead in streamed units
    allow_disk: bool  # may units whose bytes do not fit the RAM budget stay on disk
    suits: str  # the cards it is meant for
    host_compression: str = "auto"  # blocks held compressed in host RAM (OffloadConfig.host_compression)


PRESETS: Mapping[str, PresetPolicy] = MappingProxyType({
    "auto": PresetPolicy("as much as fits the budget after the activation reserve",
                         vram_fraction=1.0, budget_fraction=0.85, prefetch=2, allow_disk=True, suits="any card"),
    "high_end": PresetPolicy("up to 90% of the budget: nearly everything; streams only what does not fit",
                             vram_fraction=0.9, budget_fraction=0.9, prefetch=1, allow_disk=False,
                             suits="24 GB and larger"),
    "mid_range": PresetPolicy("up to 65% of the budget; the rest streams with a 2-block lookahead",
                              vram_fraction=0.65, budget_fraction=0.65, prefetch=2, allow_disk=False,
                              suits="12-16 GB"),
    "consumer": PresetPolicy("up to 35% of the budget; the rest streams with a 3-block lookahead",
                             vram_fraction=0.35, budget_fraction=0.4, prefetch=3, allow_disk=True, suits="8-12 GB"),
    "budget": PresetPolicy("nothing but the non-block weights; every block streams through the slot ring",
                           vram_fraction=0.0, budget_fraction=0.2, prefetch=2, allow_disk=True,
                           suits="4-8 GB, or models far larger than the card"),
})
DEFAULT_PRESET = "auto"
HOST_COMPRESSION = ("auto", "lossless", "off")  # OffloadConfig.host_compression
SHARE_HOST_CHOICES = ("auto", "off")  # OffloadConfig.share_host


def preset_tooltip() -> str:
    """The preset dropdown's tooltip: one line per preset."""
    return "How much of the model stays in VRAM. " + "; ".join(
        f"{name}: {p.description} ({p.suits})" for name, p in PRESETS.items()) + "."


def budget_preset_tooltip() -> str:
    """The VRAM Budget node's preset tooltip: the share of the device each preset gives all models."""
    parts = [f"{name} {p.budget_fraction:.0%}" for name, p in PRESETS.items()]
    return ("Used when budget_gb is 0: the budget for all offloaded models together, as a share of the device's "
            "total memory (auto also leaves ComfyUI's inference reserve free): " + ", ".join(parts) + ".")


def presets_markdown_table() -> str:
    """The README's presets table, generated from PRESETS (a test keeps the README equal to it)."""
    lines = ["| preset | what stays resident | lookahead (streamed blocks) | disk tier allowed | "
             "VRAM Budget node share | suits |",
             "|---|---|---|---|---|---|"]
    for name, p in PRESETS.items():
        label = f"`{name}` (default)" if name == DEFAULT_PRESET else f"`{name}`"
        lines.append(f"| {label} | {p.description} | {p.prefetch} | {'yes' if p.allow_disk else 'no'} | "
                     f"{p.budget_fraction:.0%} of the device | {p.suits} |")
    return "\n".join(lines)


def check_bytes(name: str, value: Any, allow_none: bool = True) -> None:
    """A byte count must be a finite number >= 0 (None allowed where it means 'decide for me')."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of bytes, got {value!r}")
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """How one model is offloaded; `from_preset` fills it from a named policy."""

    device: str = "auto"  # "cuda", "cuda:N", "sim" (simulated device on CPU) or "auto"
    vram_budget_bytes: int | None = None  # device bytes this model may hold (resident units + slot ring)
    prefetch: int = 2  # lookahead in streamed units
    pin_memory: bool = True
    disk_path: str | None = None  # the model's weights for the disk tier: a safetensors or GGUF file, or a packed folder
    disk_optional: bool = False  # True: blocks the file does not hold exactly stay in RAM instead of raising
    profile: bool = False
    ram_budget_bytes: int | None = None  # ceiling on this model's host RAM (blocks, non-block weights, bounce
    # buffers; blocks past it stream from disk_path); None: the planner reads MemAvailable / the cgroup limit
    reserve_bytes: int | None = None  # device bytes kept free for activations; None: planner estimates
    preset: str | None = None
    allow_disk: bool = True
    vram_fraction: float = 1.0
    sim_capacity_bytes: int | None = None
    sim_bandwidth_gbps: float | None = None
    sim_latency_us: float = 0.0
    # the simulated device's own time (offload.backends.sim_clock.SimClock): durations given, none measured, so
    # placement, stalls and reports do not depend on the host's load (tests); None: the host's wall clock
    sim_clock: Any = None
    # several devices: the compute device first, then devices whose memory holds resident blocks (None: one device)
    devices: tuple[str, ...] | None = None
    # blocks held losslessly compressed in host RAM, decoded on the device: "auto" (none while the blocks fit; all
    # that pay under a ram_budget_bytes they break; else those that would go to the disk tier), "lossless" (every
    # block where it pays), "off"
    host_compression: str = "auto"
    # several processes offloading the same file (ComfyUI-Distributed's local workers): "auto" holds the blocks kept
    # in RAM in one read-only host copy they all map (the first fills it; a block a process writes becomes its own);
    # "off": every process stages its own copy. Needs disk_path (the file names the copy) and Linux's /dev/shm.
    share_host: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise ValueError(f"device must be one of 'auto', 'cuda', 'cuda:N', 'sim' or 'sim:N', got {self.device!r}")
        if self.devices is not None:
            self._check_devices()
        check_bytes("vram_budget_bytes", self.vram_budget_bytes)
        check_bytes("ram_budget_bytes", self.ram_budget_bytes)
        check_bytes("reserve_bytes", self.reserve_bytes)
        check_bytes("sim_capacity_bytes", self.sim_capacity_bytes)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch is the lookahead in streamed units and must be an int >= 0, got {self.prefetch!r}")
        if self.prefetch > 64:
            raise ValueError(f"prefetch={self.prefetch} is absurd; use 0..64 (each step costs one slot of VRAM)")
        if self.sim_bandwidth_gbps is not None:
            check_bytes("sim_bandwidth_gbps", self.sim_bandwidth_gbps)
            if self.sim_bandwidth_gbps == 0:
                raise ValueError("sim_bandwidth_gbps must be > 0 (or None for no limit)")
        check_bytes("sim_latency_us", self.sim_latency_us, allow_none=False)
        if self.sim_clock is not None:
            if getattr(self.sim_clock, "virtual", None) is not True:
                raise ValueError(f"sim_clock must be an offload.backends.sim_clock.SimClock (or None: the host's "
                                 f"clock), got {self.sim_clock!r}")
            if not self.device.startswith("sim"):
                raise ValueError(f"sim_clock is the simulated device's time: it needs device='sim' (or 'sim:N'), "
                                 f"got device={self.device!r}")
        if not 0.0 <= float(self.vram_fraction) <= 1.0:
            raise ValueError(f"vram_fraction must be within 0..1, got {self.vram_fraction!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(_unknown_preset(self.preset))
        if self.host_compression not in HOST_COMPRESSION:
            raise ValueError(f"host_compression must be one of {', '.join(map(repr, HOST_COMPRESSION))}, got "
                             f"{self.host_compression!r}")
        if self.share_host not in SHARE_HOST_CHOICES:
            raise ValueError(f"share_host must be one of {', '.join(map(repr, SHARE_HOST_CHOICES))}, got "
                             f"{self.share_host!r}")

    def _check_devices(self) -> None:
        devices = self.devices
        if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
            raise ValueError(f"devices must be a list of device names with the compute device first (e.g. "
                             f"['cuda:0', 'cuda:1']), or None for one device; got {devices!r}")
        for d in devices:
            if not isinstance(d, str) or not _DEVICE_RE.match(d) or d == "auto":
                raise ValueError(f"devices: {d!r} is not a device name ('cuda:N' or 'sim:N')")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices lists a device twice: {list(devices)}")
        kinds = {d.split(":")[0] for d in devices}
        if len(kinds) > 1:
            raise ValueError(f"devices mixes simulated and CUDA devices: {list(devices)}")
        if self.device != "auto" and devices[0] != self.device:
            raise ValueError(f"devices must start with the compute device {self.device!r}, got {list(devices)}")
        object.__setattr__(self, "devices", tuple(devices))
        if self.device == "auto":
            object.__setattr__(self, "device", devices[0])

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "OffloadConfig":
        """Build a config from a preset name; overrides win over the preset's values."""
        if name not in PRESETS:
            raise ValueError(_unknown_preset(name))
        policy = PRESETS[name]
        values: dict[str, Any] = dict(preset=name, prefetch=policy.prefetch, allow_disk=policy.allow_disk,
                                      vram_fraction=policy.vram_fraction, host_compression=policy.host_compression)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown OffloadConfig field(s) {unknown}; valid fields: {sorted(known)}")
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> "OffloadConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _unknown_preset(name: Any) -> str:
    return f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}"
