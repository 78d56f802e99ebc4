"""benchmarks/bench_gpu.py's dry run on the simulated device (`--device sim --scale tiny`): every row is listed, every
row it can run runs (the engine's bitwise equal to resident, with a prediction beside it), and every baseline it
cannot run is skipped with a reason, so the GPU run cannot rot between lent machines. No timing bound."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
MODELS = ("Wan2.1-14B", "Flux-dev")
PRESETS = ("auto", "budget", "consumer", "mid_range")
LIMITS = (8.0, 12.0, 16.0)
INPUTS = ("copy-bound", "compute-bound")


def test_dry_run_lists_every_row(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "GGUF_PACK", "OUT")}
    # no deadline a loaded machine could reach: which rows run must not depend on the wall clock (the subprocess
    # timeout only guards against a hang)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "sim", "--scale", "tiny", "--iters", "1",
                           "--deadline-s", "86400", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    rows = data["rows"]
    for r in rows:  # a row that did not run says why
        assert r["status"] in ("ok", "skipped"), r
        assert r["status"] == "ok" or len(r["reason"]) > 10, r
    assert data["env"]["device"] == "sim" and data["env"]["sim_gbps"] > 0
    assert [r for r in rows if r["section"] == "bandwidth" and r["status"] == "ok" and r["gbps"] > 0]
    decodes = [r for r in rows if r["section"] == "compression"]  # bf16 units and fp8 payloads (the byte code)
    assert {"bf16", "fp8_e4m3fn"} <= {p for r in decodes for p in ("bf16", "fp8_e4m3fn") if p in r["config"]}, decodes
    assert all(r["status"] == "ok" and r["equal"] is True for r in decodes), decodes
    tests = [r for r in rows if r["section"] == "tests"]
    assert len(tests) == 1 and tests[0]["status"] == "skipped" and "CUDA" in tests[0]["reason"]

    def find(model: str, config: str, inp: str, limit: float | None = None) -> dict:
        found = [r for r in rows if r["section"] == model and r["config"] == config and r["input"] == inp
                 and r["limit_gb"] == limit]
        assert len(found) == 1, (model, config, inp, limit, len(found))
        return found[0]

    for model in MODELS:
        for inp in INPUTS:
            resident = find(model, "resident", inp)
            assert resident["status"] == "ok" and resident["ms"] > 0 and resident["ratio"] == 1.0
            for preset in PRESETS:
                for limit in LIMITS:
                    r = find(model, f"layer-offload {preset}", inp, limit)
                    if r["status"] == "skipped":
                        assert "does not fit" in r["reason"] or "time box" in r["reason"], r
                        continue
                    assert r["equal"] is True and r["max_abs_diff"] == 0.0, r  # offloading never changes bytes
                    assert r["ms"] > 0 and r["ratio"] > 0 and r["limited_by"] in ("compute", "copy", "stall"), r
                    assert r["predicted_ms"] is not None and r["predicted_ms"] > 0, r
                    assert r["host_ram_bytes"] > 0 and r["peak_vram_bytes"] > 0, r
            # what the simulated device cannot run is listed with the reason
            for config in ("diffusers block_level (stream)", "diffusers leaf_level (stream)",
                           "accelerate cpu_offload", "ComfyUI resident"):
                r = find(model, config, inp)
                assert r["status"] == "skipped" and ("CUDA" in r["reason"] or "ComfyUI" in r["reason"]), r
            for config in ("ComfyUI core", "ComfyUI-GGUF Q8_0"):
                for limit in LIMITS:
                    r = find(model, config, inp, limit)
                    assert r["status"] == "skipped" and r["reason"], r
        ran = [r for r in rows if r["section"] == model and r["config"].startswith("layer-offload")
               and r["status"] == "ok"]
        assert len(ran) >= 12, f"{model}: only {len(ran)} engine rows ran"
    table = (tmp_path / "bench_gpu.md").read_text()
    for label in ("resident", "layer-offload budget", "diffusers leaf_level (stream)", "accelerate cpu_offload",
                  "ComfyUI core", "ComfyUI-GGUF Q8_0", "skipped: needs a CUDA device"):
        assert label in table, label
