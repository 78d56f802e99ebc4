"""benchmarks/bench_offload.py at the tiniest scale: every configuration row, engine outputs equal resident."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_offload.py"
TINY = {
    "flux": ["--width-div", "48", "--depth-div", "19", "--img-tokens", "16", "--txt-tokens", "8"],
    "decoder7b": ["--width-div", "28", "--depth-div", "14"],
}
EXPECTED = [
    "resident (no offload)",
    "layer-offload: stream all",
    "layer-offload: 25% blocks resident",
    "layer-offload: 50% blocks resident",
    "naive sync .to() per block",
    "accelerate cpu_offload",
    "diffusers group offload (block, stream)",
]


def _bench(tmp_path: Path, model: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{model}.json"
    cmd = [sys.executable, str(SCRIPT), "--model", model, "--device", "sim", *TINY[model],
           "--iters", "1", "--warmup", "1", "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "copy failed" not in proc.stderr, proc.stderr  # a swallowed copy error would make equality luck
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize("model", ["flux", "decoder7b"])
def test_benchmark_rows_and_equality(tmp_path, model):
    record = ROOT / "docs" / "benchmarks.md"
    before = record.read_bytes() if record.exists() else None
    proc, result = _bench(tmp_path, model, "--no-record")
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == EXPECTED
    assert result["engine_outputs_equal"] is True
    for name in EXPECTED[:5]:  # resident, the engine at three budgets, the naive baseline
        assert rows[name]["equal"] is True, rows[name]
        assert rows[name]["max_abs_diff"] == 0.0, rows[name]
        assert rows[name]["ms_per_forward"] > 0
        assert rows[name]["peak_device_bytes"] > 0
    assert rows["resident (no offload)"]["ratio"] == 1.0
    for name in EXPECTED[1:4]:
        assert 0.0 <= rows[name]["overlap_ratio"] <= 1.0
    # Without CUDA the library baselines are reported as skipped, with the reason.
    for name in EXPECTED[5:]:
        assert rows[name]["note"].startswith("skipped") or rows[name]["equal"] is True
    for name in EXPECTED:
        assert f"| {name}" in proc.stdout
    assert (record.read_bytes() if record.exists() else None) == before  # --no-record kept the docs as they were
    assert result["meta"]["device"] == "sim"


def test_benchmark_records_markdown(tmp_path):
    md = tmp_path / "bench.md"
    _bench(tmp_path, "decoder7b", "--record-to", str(md), "--skip", "naive,accelerate,diffusers",
           "--fractions", "0")
    text = md.read_text()
    assert "decoder7b on simulated device" in text
    assert "- command: `python benchmarks/bench_offload.py" in text
    assert "| resident (no offload)" in text and "| layer-offload: stream all" in text
    assert f"torch {__import__('torch').__version__}" in text
