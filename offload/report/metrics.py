"""Per-unit transfer, compute and stall times, read from events lazily so timing adds no CPU sync per unit."""
from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from ..backends.base import Backend

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
    reads: int = 0  # times its bytes went through a bounce buffer (read from disk, or bounced pageable RAM)
    # backward through the streamed unit (training): times it came back to a slot, bytes copied, copy time, the time
    # autograd held it (its backward, checkpoint re-forward included) and the time backward waited for its copy
    backward_calls: int = 0
    backward_bytes_streamed: int = 0
    backward_h2d_ms: float = 0.0
    backward_ms: float = 0.0
    backward_stall_ms: float = 0.0
    # placement from measured costs: the stall per pass the planner predicted for this unit, and why it is where it is
    predicted_stall_ms: float = 0.0
    placement: str = ""
    device: str = ""  # the device its resident copy lives on, or the compute device it streams to
    # its host master: bytes it holds in host RAM (encoded where compressed, 0 on the disk tier), its raw bytes, and
    # the form it is held in ("none" or the codec's name: decoded on the device after each copy)
    host_bytes: int = 0
    raw_bytes: int = 0
    compression: str = "none"
    shared: bool = False  # its host master is the copy shared with other processes offloading the same file
    residue_bytes: int = 0  # on the disk tier: host RAM it keeps for the leaves its file lacks (in `host_bytes`)


TIERS = ("vram", "pinned", "pageable", "disk")


@dataclass
class OffloadReport:
    """The last runs of one offloaded model, per unit and in total; `to_dict` is THE report shape (JSON-ready)
    that the ComfyUI node, the HTTP route and the panel show."""

    name: str
    device: str
    preset: str | None
    priority: int
    blocks: list[BlockReport]
    total_bytes_streamed: int  # forward and backward (training) copies; `backward_bytes_streamed` is the latter
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
    disk_bytes_read: int = 0  # bytes read from the disk-tier file since the last reset
    notices: list[dict[str, str]] = field(default_factory=list)  # {kind, message}: fallbacks, shrinks, disk in use
    kv: dict[str, Any] | None = None  # the paged KV cache: pages resident / offloaded, bytes moved (when used)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # per device of the model (the compute device first): device_bytes, peak_device_bytes, resident_blocks
    devices: dict[str, dict[str, int]] = field(default_factory=dict)
    demand_loads: int = 0  # streamed units called while not in flight (loaded on demand)
    prefetch_hits: int = 0  # streamed units found in flight (prefetched) when called
    budget_reason: str = ""  # why the model holds what it holds in its VRAM budget (VramBudget.explain_share)
    # one pass: the plan's predicted compute plus stall (None before anything was measured) and the measured mean
    # (the blocks' compute plus stall per forward since the last reset; None before a forward)
    predicted_step_ms: float | None = None
    step_ms: float | None = None
    # the blocks' host masters: bytes held in host RAM (encoded where compressed, none for the disk tier) and the
    # raw bytes of every block (what raw RAM masters would hold)
    host_bytes: int = 0
    host_raw_bytes: int = 0
    # host RAM of the model: what this process holds on its own (blocks, non-block weights, bounce buffers), and the
    # blocks in the copy shared with other processes offloading the same file (OffloadConfig.share_host)
    host_private_bytes: int = 0
    host_shared_bytes: int = 0
    # where offload_module's time went, in ms: total_ms, layout_ms, plan_ms, stage_ms (wall) and, added up over
    # staging's workers, read_ms (file reads), encode_ms (units encoded), spill_ms, pin_ms (host buffers allocated,
    # pinned where planned); workers; encoded_units (encoded at setup), stored_units (a packed folder's encoding taken)
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def streamed_bytes(self) -> int:
        return sum(b.bytes for b in self.blocks if b.tier != "vram")

    @property
    def backward_bytes_streamed(self) -> int:
        """Bytes copied to the device for backward through streamed units (training)."""
        return sum(b.backward_bytes_streamed for b in self.blocks)

    @property
    def tiers(self) -> dict[str, int]:
        """Blocks per tier: vram (resident), pinned / pageable RAM, disk."""
        return {t: sum(1 for b in self.blocks if b.tier == t) for t in TIERS}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        tiers = self.tiers
        d["tiers"] = tiers
        d["tier_bytes"] = {t: sum(b.bytes for b in self.blocks if b.tier == t) for t in TIERS}
        d["streamed_bytes"] = self.streamed_bytes
        d["resident_blocks"] = tiers["vram"]
        d["streamed_blocks"] = len(self.blocks) - tiers["vram"]
        d["backward_bytes_streamed"] = self.backward_bytes_streamed
        d["backward_ms"] = sum(b.backward_ms for b in self.blocks)
        return d

    def summary(self) -> str:
        """A few readable lines for logs and UIs."""
        return summarize(self.to_dict())


def summarize(d: dict[str, Any]) -> str:
    """Readable lines for one model's report dict (`OffloadReport.to_dict()`): the one summary everywhere (the
    model, its last runs, its setup)."""
    tiers = d["tiers"]
    mb = 1 << 20
    head = f"{d['name']}"
    if d.get("kind"):
        head += f" [{d['kind']}]"
    head += (f" on {d['device']} (preset {d.get('preset')}, priority {d.get('priority')}): {tiers['vram']} resident / "
             f"{tiers['pinned'] + tiers['pageable']} streamed from RAM / {tiers['disk']} from disk blocks; "
             f"device {d['device_bytes'] / mb:.1f} MB (peak {d['peak_device_bytes'] / mb:.1f} MB)")
    compressed = sum(1 for b in d.get("blocks", ()) if b.get("compression", "none") != "none")
    if compressed:
        head += (f"; host RAM {d['host_bytes'] / mb:.1f} MB for {d['host_raw_bytes'] / mb:.1f} MB of blocks "
                 f"({compressed} compressed)")
    runs = (f"  last runs: {d['forwards']} forward(s), {d['total_bytes_streamed'] / mb:.1f} MB streamed, "
            f"overlap {d['overlap_ratio']:.2f}, {d['effective_gbps']:.2f} GB/s, stall {d['stall_ms']:.1f} ms")
    if d.get("host_shared_bytes"):
        head += (f"; host RAM {d.get('host_private_bytes', 0) / mb:.1f} MB its own, "
                 f"{d['host_shared_bytes'] / mb:.1f} MB in the copy shared with other processes")
    if d.get("backward_bytes_streamed"):
        runs += (f"; backward {d['backward_bytes_streamed'] / mb:.1f} MB of it, blocks held "
                 f"{d.get('backward_ms', 0.0):.1f} ms")
    return head + "\n" + runs + setup_line(d.get("setup") or {})


def setup_line(t: dict[str, Any]) -> str:
    """'\n  setup: 1.23 s (read 0.2 s, encode 0.8 s, ...)' for a report's `setup` (nothing before one was timed)."""
    if not t.get("total_ms"):
        return ""
    parts = [f"{label} {t[key] / 1000:.2f} s" for key, label in
             (("layout_ms", "layout"), ("plan_ms", "plan"), ("read_ms", "read"), ("encode_ms", "encode"),
              ("spill_ms", "spill"), ("pin_ms", "pin")) if t.get(key)]
    line = f"\n  setup: {t['total_ms'] / 1000:.2f} s ({', '.join(parts)}"
    if t.get("workers", 1) > 1:
        line += f"; reads and encodes on {t['workers']} workers, their times added up"
    if t.get("encoded_units") or t.get("stored_units"):
        line += f"; {t.get('encoded_units', 0)} block(s) encoded, {t.get('stored_units', 0)} taken as stored"
    after = []
    if t.get("publish_units"):
        after.append(f"{t.get('published', 0)} of {t['publish_units']} block(s) into the host copy shared between "
                     f"processes ({t.get('publish_ms', 0) / 1000:.2f} s)")
    if t.get("background_units"):
        after.append(f"{t.get('background_done', 0)} of {t['background_units']} block(s) encoded "
                     f"({t.get('background_encode_ms', 0) / 1000:.2f} s)")
    return line + ")" + (f"\n  after setup, on a thread: {'; '.join(after)}" if after else "")


@dataclass
class _Record:
    unit: int
    copy: Any  # copy event (streamed) or None (resident)
    ready: Any  # compute stream reached the unit (before waiting for its copy)
    start: Any  # compute start (after the wait)
    end: Any  # compute end
    nbytes: int
    backward: bool = False


class MetricsCollector:
    """Collects event records in the hot path and turns them into milliseconds when they are complete."""

    def __init__(self, backend: Backend, n_units: int, profile: bool = False) -> None:
        self.backend = backend
        self.profile = profile
        self._pending: list[_Record] = []
        self.lock = threading.Lock()  # a report read from another thread (a UI route) while a pass runs
        self.n_units = n_units
        self._lifetime_base: list[list] = [[0] * n_units, [0.0] * n_units, [0.0] * n_units, [0] * n_units,
                                           [0.0] * n_units]
        self._zero()

    def reset(self) -> None:
        """Start counting afresh: records not yet harvested are waited for and dropped."""
        with self.lock:
            self._harvest(block=True)
            base = self._lifetime_base
            for k, now in enumerate(self._forward_totals()):
                base[k] = [a + b for a, b in zip(base[k], now)]
            self._zero()

    def _forward_totals(self) -> tuple[list, list, list, list, list]:
        return self.calls, self.compute_ms, self.h2d_ms, self.bytes_streamed, self.stall_ms

    def lifetime(self) -> tuple[list[int], list[float], list[float], list[int], list[float]]:
        """Forward calls, compute ms, copy ms, bytes streamed and stall ms per unit since setup, resets included
        (the placement planner's running totals; a user's reset_stats() must not make it forget)."""
        with self.lock:
            return tuple([a + b for a, b in zip(base, now)]  # type: ignore[return-value]
                         for base, now in zip(self._lifetime_base, self._forward_totals()))

    def _zero(self) -> None:
        self.h2d_ms = [0.0] * self.n_units
        self.compute_ms = [0.0] * self.n_units
        self.stall_ms = [0.0] * self.n_units
        self.calls = [0] * self.n_units
        self.bytes_streamed = [0] * self.n_units
        self.bwd_calls = [0] * self.n_units
        self.bwd_bytes = [0] * self.n_units
        self.bwd_h2d_ms = [0.0] * self.n_units
        self.bwd_ms = [0.0] * self.n_units
        self.bwd_stall_ms = [0.0] * self.n_units
        self.forwards = 0
        self.timeline: list[dict[str, Any]] = []
        self._pending.clear()

    def add(self, unit: int, copy: Any, ready: Any, start: Any, end: Any, nbytes: int, backward: bool = False) -> None:
        with self.lock:
            self._pending.append(_Record(unit, copy, ready, start, end, nbytes, backward))
            full = len(self._pending) > MAX_PENDING
        if full:
            self.harvest(block=True)

    def forward_started(self) -> None:
        self.forwards += 1

    def harvest(self, block: bool = False) -> None:
        """Fold completed records into the totals; with `block`, wait for all of them first."""
        with self.lock:
            self._harvest(block)

    def _harvest(self, block: bool) -> None:
        b = self.backend
        is_done, elapsed_ms, copy_span_ms = b.is_done, b.elapsed_ms, b.copy_span_ms  # bound once: one call per record
        calls, compute_ms, h2d_ms, stall_ms, streamed = (self.calls, self.compute_ms, self.h2d_ms, self.stall_ms,
                                                          self.bytes_streamed)
        done = 0
        for rec in self._pending:
            if block:
                b.event_synchronize(rec.end)
            elif not is_done(rec.end) or (rec.copy is not None and not is_done(rec.copy)):
                break
            u = rec.unit
            if rec.backward:
                self.bwd_calls[u] += 1
                self.bwd_ms[u] += max(0.0, b.elapsed_ms(rec.start, rec.end))
                if rec.copy is not None:
                    self.bwd_h2d_ms[u] += b.copy_span_ms(rec.copy)
                    stall = max(0.0, b.elapsed_ms(rec.ready, rec.copy))
                    self.bwd_stall_ms[u] += stall if math.isfinite(stall) else 0.0
                    self.bwd_bytes[u] += rec.nbytes
                done += 1
                continue
            calls[u] += 1
            compute_ms[u] += max(0.0, elapsed_ms(rec.start, rec.end))
            if rec.copy is not None:
                h2d = copy_span_ms(rec.copy)
                stall = max(0.0, elapsed_ms(rec.ready, rec.copy))
                h2d_ms[u] += h2d
                stall_ms[u] += stall if math.isfinite(stall) else 0.0
                streamed[u] += rec.nbytes
                if self.profile:
                    self.timeline.append({"unit": u, "h2d_ms": h2d, "stall_ms": stall,
                                          "compute_ms": elapsed_ms(rec.start, rec.end)})
            done += 1
        del self._pending[:done]

    def totals(self) -> tuple[float, float, float, int]:
        """Copy ms, compute ms, stall ms and bytes streamed in total: copies for backward (training) included, forward
        compute only."""
        return (sum(self.h2d_ms) + sum(self.bwd_h2d_ms), sum(self.compute_ms),
                sum(self.stall_ms) + sum(self.bwd_stall_ms), sum(self.bytes_streamed) + sum(self.bwd_bytes))


def overlap_ratio(h2d_ms: float, stall_ms: float) -> float:
    """Share of copy time hidden behind compute: 1 - exposed/total (1.0 when nothing was copied)."""
    if h2d_ms <= 0:
        return 1.0
    return max(0.0, min(1.0, 1.0 - stall_ms / h2d_ms))


def effective_gbps(nbytes: int, h2d_ms: float) -> float:
    """Achieved copy bandwidth over the time the copies themselves took."""
    return nbytes / (h2d_ms * 1e6) if h2d_ms > 0 else 0.0
