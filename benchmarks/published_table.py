"""Print docs/benchmarks.md's table of predictions against published measurements (offload/predict/published.py's
rows priced by the workflow plan's code). tests/test_workflow_plan.py checks the docs hold what this prints.

    python benchmarks/published_table.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.predict.published import ROWS, predict_row  # noqa: E402


def table() -> str:
    lines = ["| source | model | card | shape (WxHxframes) | steps | CFG | measured s | per | predicted s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        p = predict_row(row)
        lines.append(f"| {row.source} | {row.model} | {row.card} | {row.width}x{row.height}x{row.frames} | "
                     f"{row.steps} | {'yes' if row.cfg else 'no'} | {row.seconds:g} | {row.per} | "
                     f"{p['predicted_s']:.2f} | {p['ratio']:.2f}x |")
    within = sum(abs(predict_row(r)["ratio"] - 1) <= 0.3 for r in ROWS)
    lines.append("")
    lines.append(f"{within} of {len(ROWS)} rows within 30%.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
