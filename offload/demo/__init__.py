"""The `python -m offload demo` command line, its measuring helpers and the built-in reference models.

Layer: an application of the engine, above the entry points; nothing in the engine imports it (`python -m offload
demo`, the benchmarks and the tests do). It imports the entry points and the layers below them.
Used from outside: `main`, `run_demo`, `build_demo_model`, the measuring helpers below, `reference_models`.
"""
from .cli import add_arguments, build_demo_model, main, run_demo
from .measure import (MIB, Row, bitwise_equal, calibrate_sim_gbps_model, format_table, max_abs_diff, median_row,
                      resolve_device, run_offloaded, synchronize, tier_summary, time_forwards, time_paired,
                      torch_device, weight_bytes)

__all__ = ["add_arguments", "build_demo_model", "main", "run_demo", "MIB", "Row", "bitwise_equal",
           "calibrate_sim_gbps_model", "format_table", "max_abs_diff", "median_row", "resolve_device", "run_offloaded",
           "synchronize", "tier_summary", "time_forwards", "time_paired", "torch_device", "weight_bytes"]
