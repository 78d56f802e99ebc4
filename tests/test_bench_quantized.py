"""benchmarks/bench_quantized.py at the tiniest scale: every row bitwise, the RAM ceiling held, and a step reads
from disk exactly the disk-tier blocks' bytes in the file (a cast block: the file's bf16 bytes)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("comfy_kitchen")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quantized.py"


def test_rows_bytes_and_ceiling(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_quantized", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["row"]: r for r in bench.run(dim=256, depth=4, tokens=8, steps=1, gbps=8.0, folder=tmp_path)}
    assert all(r["bitwise"] for r in rows.values())
    assert rows["all blocks in RAM"]["disk_blocks"] == 0 and rows["all blocks in RAM"]["disk_mb_per_step"] == 0
    for name in ("RAM ceiling 1/2, disk tier", "weight_dtype fp8 from bf16, RAM ceiling 1/2"):
        r = rows[name]
        assert r["disk_blocks"] > 0 and r["ram_mb"] <= r["ceiling_mb"]
        assert r["disk_mb_per_step"] == pytest.approx(r["file_mb"], rel=1e-9)
    fp8, cast = rows["RAM ceiling 1/2, disk tier"], rows["weight_dtype fp8 from bf16, RAM ceiling 1/2"]
    assert cast["file_mb"] / cast["disk_blocks"] > 1.9 * fp8["file_mb"] / fp8["disk_blocks"]  # bf16 read, fp8 held
