"""Per-unit transfer, compute and stall times, read from events lazily so timing adds no CPU sync per unit."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .backends.base import Backend

MAX_PENDING = 8192  # records kept unread before a blocking harvest


@dataclass
class BlockReport:
    """What happened to one unit since the last reset."""

    name: str
    tier: str  # vram | pinned | pageable | disk
    bytes: int
    h2d_ms: float = 0.0
    compute_ms: float = 0.0
    stall_ms: float = 0.0
    calls: int = 0
    bytes_streamed: int = 0


@dataclass
class OffloadReport:
    """The last runs of one offloaded model, per unit and in total; `to_dict` is JSON-ready."""

    name: str
    device: str
    preset: str | None
    priority: int
    blocks: list[BlockReport]
    total_bytes_streamed: int
    overlap_ratio: float
    effective_gbps: float
    resident_bytes: int
    peak_device_bytes: int
    device_bytes: int
    slot_bytes: int
    slots: int
    forwards: int
    stall_ms: float
    h2d_ms: float
    compute_ms: float
    timeline: list[dict[str, Any]] = field(default_factory=list)

    @property
    def streamed_bytes(self) -> int:
        return sum(b.bytes for b in self.blocks if b.tier != "vram")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["streamed_bytes"] = self.streamed_bytes
        d["tiers"] = {t: sum(1 for b in self.blocks if b.tier == t) for t in ("vram", "pinned", "pageable", "disk")}
        return d

    def summary(self) -> str:
        """A few readable lines for logs and UIs."""
        tiers = self.to_dict()["tiers"]
        return (f"{self.name} on {self.device}: {tiers['vram']} resident / "
                f"{tiers['pinned'] + tiers['pageable']} streamed from RAM / {tiers['disk']} from disk; "
                f"{self.total_bytes_streamed / 1e6:.1f} MB streamed in {self.forwards} forward(s), "
                f"overlap {self.overlap_ratio:.2f}, {self.effective_gbps:.2f} GB/s, stall {self.stall_ms:.1f} ms, "
                f"device {self.device_bytes / 1e6:.1f} MB (peak {self.peak_device_bytes / 1e6:.1f} MB)")


@dataclass
class _Record:
    unit: int
    copy: Any  # copy event (streamed) or None (resident)
    ready: Any  # compute stream reached the unit (before waiting for its copy)
    start: Any  # compute start (after the wait)
    end: Any  # compute end
    nbytes: int


class MetricsCollector:
    """Collects event records in the hot path and turns them into milliseconds when they are complete."""

    def __init__(self, backend: Backend, n_units: int, profile: bool = False) -> None:
        self.backend = backend
        self.profile = profile
        self._pending: list[_Record] = []
        self.reset(n_units)

    def reset(self, n_units: int | None = None) -> None:
        if n_units is not None:
            self.n_units = n_units
        self.h2d_ms = [0.0] * self.n_units
        self.compute_ms = [0.0] * self.n_units
        self.stall_ms = [0.0] * self.n_units
        self.calls = [0] * self.n_units
        self.bytes_streamed = [0] * self.n_units
        self.forwards = 0
        self.timeline: list[dict[str, Any]] = []
        self._pending.clear()

    def add(self, unit: int, copy: Any, ready: Any, start: Any, end: Any, nbytes: int) -> None:
        self._pending.append(_Record(unit, copy, ready, start, end, nbytes))
        if len(self._pending) > MAX_PENDING:
            self.harvest(block=True)

    def forward_started(self) -> None:
        self.forwards += 1

    def harvest(self, block: bool = False) -> None:
        """Fold completed records into the totals; with `block`, wait for all of them first."""
        b = self.backend
        done = 0
        for rec in self._pending:
            if block:
                b.event_synchronize(rec.end)
            elif not b.is_done(rec.end) or (rec.copy is not None and not b.is_done(rec.copy)):
                break
            u = rec.unit
            self.calls[u] += 1
            self.compute_ms[u] += max(0.0, b.elapsed_ms(rec.start, rec.end))
            if rec.copy is not None:
                h2d = b.copy_span_ms(rec.copy)
                stall = max(0.0, b.elapsed_ms(rec.ready, rec.copy))
                self.h2d_ms[u] += h2d
                self.stall_ms[u] += stall if math.isfinite(stall) else 0.0
                self.bytes_streamed[u] += rec.nbytes
                if self.profile:
                    self.timeline.append({"unit": u, "h2d_ms": h2d, "stall_ms": stall,
                                          "compute_ms": b.elapsed_ms(rec.start, rec.end)})
            done += 1
        del self._pending[:done]

    def totals(self) -> tuple[float, float, float, int]:
        return sum(self.h2d_ms), sum(self.compute_ms), sum(self.stall_ms), sum(self.bytes_streamed)


def overlap_ratio(h2d_ms: float, stall_ms: float) -> float:
    """Share of copy time hidden behind compute: 1 - exposed/total (1.0 when nothing was copied)."""
    if h2d_ms <= 0:
        return 1.0
    return max(0.0, min(1.0, 1.0 - stall_ms / h2d_ms))


def effective_gbps(nbytes: int, h2d_ms: float) -> float:
    """Achieved copy bandwidth over the time the copies themselves took."""
    return nbytes / (h2d_ms * 1e6) if h2d_ms > 0 else 0.0
