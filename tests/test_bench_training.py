"""benchmarks/bench_training.py at the tiniest scale: every row present, the engine rows bitwise equal to resident."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_training_rows_and_equality(tmp_path):
    out = tmp_path / "train.json"
    record = tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--device", "sim", "--dim", "64",
           "--depth", "4", "--heads", "4", "--tokens", "8", "--rank", "4", "--steps", "2", "--rounds", "2",
           "--json", str(out), "--record-to", str(record)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    names = list(rows)
    assert names[:3] == ["resident (no offload)", "layer-offload: stream all", "layer-offload: 50% blocks resident"]
    assert names[3].startswith("block swap (musubi-style")
    assert rows[names[3]]["note"].startswith("skipped")  # needs CUDA
    for name in names[:3]:
        assert rows[name]["equal"] is True, rows[name]
        assert rows[name]["ms_per_step"] > 0 and len(rows[name]["ms_per_step_rounds"]) == 2
    stream_all = rows["layer-offload: stream all"]
    assert stream_all["blocks_streamed"] == 4
    assert stream_all["bwd_bytes_per_step"] == stream_all["fwd_bytes_per_step"] > 0
    assert stream_all["peak_device_bytes"] < rows["resident (no offload)"]["peak_device_bytes"]
    assert "### LoRA training step on simulated device" in record.read_text()
