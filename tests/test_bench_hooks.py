"""benchmarks/bench_hooks.py at the tiniest scale: it runs, reports every configuration's per-unit fields, and the
engine's outputs equal the plain model's. No figure is checked against a bound (speed is never pass/fail)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_hooks.py"
CONFIGS = ["plain (no hooks)", "layer-offload: resident", "layer-offload: streamed",
           "diffusers group offload (block_level)", "accelerate cpu_offload"]
FIELDS = ["us_per_unit", "us_per_unit_median", "overhead_us_per_unit", "ms_per_forward", "equal"]


def test_bench_hooks_reports_per_unit_fields(tmp_path):
    out = tmp_path / "hooks.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--units", "3", "5", "--forwards", "1", "--batches", "2",
                           "--warmup", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["engine_outputs_equal"] is True
    assert {"date", "machine", "torch", "accelerate", "diffusers", "command"} <= set(result)
    for units in (3, 5):
        rows = {r["config"]: r for r in result["rows"] if r["units"] == units}
        assert list(rows) == CONFIGS
        for name, row in rows.items():
            if row["note"].startswith("skipped"):
                assert name in CONFIGS[3:], "only the optional libraries may be skipped"
                continue
            for field in FIELDS:
                assert row[field] is not None, (name, field)
            assert row["us_per_unit"] > 0 and row["equal"] is True, row
    assert "| config" in proc.stdout and "us/unit" in proc.stdout
    assert "[bench_hooks] 5 units: layer-offload: streamed" in proc.stderr, "progress per configuration"


def test_bench_hooks_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--units", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 2 and "--units" in proc.stderr
