"""benchmarks/bench_payload_codes.py at the tiniest scale: every payload decodes bitwise (the script asserts it),
the fp8 and int8 payloads pay under the byte code where the unit-wide code alone did not (e4m3fn, int8) or paid less
(e5m2), NVFP4 stays raw, and the bf16 reference keeps the unit-wide code."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("comfy_kitchen")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_payload_codes.py"


def test_rows():
    spec = importlib.util.spec_from_file_location("bench_payload_codes", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = {r["payload"]: r for r in bench.run(rows=128, repeat=1)}
    for kind in ("fp8 e4m3fn per-tensor", "fp8 e5m2 per-tensor", "int8 rowwise"):
        r = rows[kind]
        assert r["code"] == [4] and r["bound"] < r["ratio"] < r["unit_wide"] and r["decode_ops"] <= 12, r
    assert rows["NVFP4 (uint8, two e2m1 a byte)"]["code"] == "raw"
    assert rows["bf16 (reference)"]["code"] == [3] and rows["bf16 (reference)"]["bound"] is None
