"""benchmarks/bench_budget.py runs at the tiniest scale and prints its four rows (no figure is a bound)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_budget.py"


def test_bench_budget_runs_and_reports_every_row():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dim", "32", "--depth", "3", "--tokens", "4", "--phase", "2",
                          "--chunks", "1", "--device", "sim"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| alternating") or line.startswith("| phases")]
    assert [r.split("|")[1:3] for r in rows] == [[" alternating ", " split "], [" alternating ", " recency "],
                                                [" phases ", " split "], [" phases ", " recency "]], out.stdout
