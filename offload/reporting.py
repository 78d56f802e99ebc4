"""The report of one offloaded model, built by asking its parts: the streamer's per-block figures, the plan in place
(predicted stall and the reason per block), the budget (why the model holds what it holds), the devices and the KV
cache. `ReportBase` remembers the counters at the last `reset_stats()`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .plan.planner import Plan
from .report.metrics import BlockReport, OffloadReport, effective_gbps, overlap_ratio
from .store.compressed import unit_compression, unit_host_bytes, unit_shared
from .stream.streamer import ModelStreamer


@dataclass
class ReportBase:
    """Counters that only grow, as they were at the last reset (the report shows what happened since)."""

    reads: dict[int, int] = field(default_factory=dict)
    demand_loads: int = 0
    prefetch_hits: int = 0
    disk_bytes_read: int = 0

    def reset(self, s: ModelStreamer) -> None:
        """Start the report afresh (what the next runs do, not every run since setup)."""
        if s.staged.reader is not None:
            s.staged.reader.drain()
        s.metrics.reset()
        s.peak_device_bytes = s.device_bytes()
        s.backend.reset_peak()
        self.reads = {id(src): src.reads for src in s.sources}
        self.demand_loads, self.prefetch_hits = s.worker.demand_loads, s.worker.prefetch_hits
        self.disk_bytes_read = s.staged.reader.counters.bytes_read if s.staged.reader is not None else 0


def build_report(s: ModelStreamer, plan: Plan | None, base: ReportBase, device_name: str, secondaries: Any,
                 **fields: Any) -> OffloadReport:
    """The report now: per block and in total since setup or the last reset; `fields` are the handle's own (name,
    device, preset, priority, notices, kv, budget_reason)."""
    p = s.placement
    devices = {device_name: {"device_bytes": p.device_bytes(),
                             "peak_device_bytes": max(p.peak_device_bytes, p.device_bytes()),
                             "resident_blocks": sum(1 for u in p.units if u.resident_buf is not None and u.home is None)},
               **secondaries.report(p)}
    reader = s.staged.reader
    if reader is not None:
        reader.drain()
    blocks = block_reports(s)
    for b, src in zip(blocks, s.sources):
        b.reads = max(0, b.reads - base.reads.get(id(src), 0))
    if plan is not None:
        for b, unit in zip(blocks, plan.units):
            b.predicted_stall_ms, b.placement = unit.predicted_stall_ms, unit.reason
    for b, u in zip(blocks, s.units):
        b.device = u.home or device_name
        b.host_bytes, b.raw_bytes, b.compression = unit_host_bytes(u.staged), u.nbytes, unit_compression(u.staged)
        b.shared = u.master is not None and unit_shared(u.staged)
        b.residue_bytes = b.host_bytes if u.master is not None and u.master.host is None else 0
    host = s.host_memory()
    h2d, compute, stall, nbytes = s.metrics.totals()
    forwards = s.metrics.forwards
    return OffloadReport(
        blocks=blocks, total_bytes_streamed=nbytes, overlap_ratio=overlap_ratio(h2d, stall),
        effective_gbps=effective_gbps(nbytes, h2d),
        resident_bytes=s.rest_bytes + sum(u.nbytes for u in s.units if u.index in s.resident_set),
        peak_device_bytes=max(s.peak_device_bytes, s.device_bytes()), device_bytes=s.device_bytes(),
        slot_bytes=s.slot_bytes, slots=len(s.slots), forwards=forwards, stall_ms=stall, h2d_ms=h2d,
        compute_ms=compute,
        disk_bytes_read=(reader.counters.bytes_read - base.disk_bytes_read) if reader is not None else 0,
        timeline=list(s.metrics.timeline), devices=devices,
        demand_loads=s.worker.demand_loads - base.demand_loads,
        prefetch_hits=s.worker.prefetch_hits - base.prefetch_hits,
        predicted_step_ms=plan.predicted_step_ms if plan is not None else None,
        step_ms=(sum(b.compute_ms + b.stall_ms for b in blocks) / forwards) if forwards else None,
        host_bytes=sum(b.host_bytes for b in blocks), host_raw_bytes=sum(b.raw_bytes for b in blocks),
        host_private_bytes=host["ram"] - host["shared"], host_shared_bytes=host["shared"],
        **fields)


def block_reports(s: ModelStreamer) -> list[BlockReport]:
    """Per-unit figures since the last reset (waits for the timing events recorded so far)."""
    m = s.metrics
    with m.lock:
        m._harvest(block=True)
        return [BlockReport(u.staged.name, u.tier, u.nbytes, m.h2d_ms[u.index], m.compute_ms[u.index],
                            m.stall_ms[u.index], m.calls[u.index], m.bytes_streamed[u.index],
                            s.sources[u.index].reads, m.bwd_calls[u.index], m.bwd_bytes[u.index],
                            m.bwd_h2d_ms[u.index], m.bwd_ms[u.index], m.bwd_stall_ms[u.index])
                for u in s.units]
