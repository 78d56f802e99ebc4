"""The `python -m offload demo` command line, its measuring helpers and the built-in reference models.

Apart from the engine: nothing in `offload/` imports this package; the demo, the benchmark and the tests do.
"""
from .cli import add_arguments, build_demo_model, main, run_demo
from .measure import (MIB, Row, bitwise_equal, calibrate_sim_gbps_model, format_table, max_abs_diff, median_row,
                      resolve_device, run_offloaded, synchronize, tier_summary, time_forwards, time_paired,
                      torch_device, weight_bytes)

__all__ = ["add_arguments", "build_demo_model", "main", "run_demo", "MIB", "Row", "bitwise_equal",
           "calibrate_sim_gbps_model", "format_table", "max_abs_diff", "median_row", "resolve_device", "run_offloaded",
           "synchronize", "tier_summary", "time_forwards", "time_paired", "torch_device", "weight_bytes"]
