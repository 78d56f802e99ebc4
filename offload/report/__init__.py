"""What a run measured and the report's shape: `metrics.MetricsCollector` (per-unit copy, compute and stall times,
read from events lazily, fed by the streamer), `BlockReport` / `OffloadReport` (THE report shape: JSON-ready, shown
by the ComfyUI node, the route and the panel) and `summarize`. The report of one model is assembled from the
streamer, the plan and the budget by `offload/reporting.py`, at the entry level.

Layer: below stream/; imports only backends/.
Used from outside: `metrics.OffloadReport`, `metrics.BlockReport`, `metrics.summarize`.
"""
