"""`python -m offload demo`: every configuration runs (in rounds, with progress on stderr), offloaded outputs are
bitwise equal, the table holds medians and their spread, exit code tells."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--device", "sim", "--dim", "64", "--depth", "4", "--tokens", "16", "--iters", "1", "--warmup", "1"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "offload", "demo", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def test_demo_subprocess_json_rows_and_bitwise_equality():
    proc = _run(*SMALL, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "copy failed" not in proc.stderr, proc.stderr  # a swallowed copy error would make equality luck
    result = json.loads(proc.stdout)
    configs = [r["config"] for r in result["rows"]]
    assert configs == ["resident (no offload)", "offload: mid_range", "offload: budget"]
    assert result["ok"] is True
    for row in result["rows"]:
        assert row["equal"] is True, row
        assert row["max_abs_diff"] == 0.0, row
        assert row["ms_per_forward"] > 0
    for row in result["rows"][1:]:
        assert row["ratio"] is not None and row["ratio"] > 0
        assert row["peak_device_bytes"] is not None and row["peak_device_bytes"] > 0
        assert row["overlap_ratio"] is not None and 0.0 <= row["overlap_ratio"] <= 1.0
    assert result["sim_bandwidth_gbps"] > 0  # calibrated from the blocks' compute


def test_demo_table_in_process(capsys):
    from offload.__main__ import main

    rc = main(["demo", *SMALL, "--model", "flux", "--presets", "budget"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| config" in out and "bitwise equal" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("| resident") or ln.startswith("| offload: budget")]
    assert len(lines) == 2, out
    assert all("| yes" in ln for ln in lines), out
    assert "OK: every offloaded output is bitwise equal" in out


def test_demo_exit_code_nonzero_when_outputs_differ(monkeypatch, capsys):
    import offload.demo.measure as measure
    from offload.__main__ import main

    real = measure.bitwise_equal
    monkeypatch.setattr(measure, "bitwise_equal", lambda a, b: False if a.dim() else real(a, b))
    rc = main(["demo", *SMALL, "--presets", "budget"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in out and "| NO" in out


def test_demo_rejects_unknown_preset():
    proc = _run(*SMALL, "--presets", "nonsense")
    assert proc.returncode != 0
    assert "nonsense" in proc.stderr and "budget" in proc.stderr  # the valid presets are listed


@pytest.mark.parametrize("args, words", [
    (["--depth", "0"], ["--depth", "at least 2"]),
    (["--dim", "0"], ["--dim", "at least 8"]),
    (["--presets", ""], ["no preset to run", "budget"]),
    (["--presets", " , "], ["no preset to run"]),
    (["--iters", "x"], ["--iters", "whole number"]),
    (["--sim-gbps", "-1"], ["--sim-gbps", "> 0"]),
    (["--rounds", "0"], ["--rounds", "at least 1"]),
    (["--threads", "0"], ["--threads", "at least 1"]),
    (["--budget-frac", "nan"], ["--budget-frac", "> 0"]),
])
def test_demo_usage_errors_are_messages_not_tracebacks(args, words):
    proc = _run(*SMALL, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "OK" not in proc.stdout, "a run that compared nothing must not say OK"
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_demo_with_nothing_offloaded_fails(monkeypatch, capsys):
    """Even when run_demo is asked for no preset (bypassing the CLI's check), it refuses instead of 'OK'."""
    from offload.demo import run_demo

    with pytest.raises(ValueError, match="no preset"):
        run_demo(device="sim", dim=64, depth=2, tokens=4, iters=1, warmup=0, presets=())


def test_demo_ctrl_c_ends_quietly(monkeypatch, capsys):
    import offload.demo.cli as cli
    from offload.__main__ import main

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_demo", interrupted)
    rc = main(["demo", *SMALL])
    err = capsys.readouterr().err
    assert rc == 130 and "interrupted" in err and "Traceback" not in err


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_demo_on_cuda():
    proc = _run("--device", "cuda", "--dim", "128", "--depth", "4", "--tokens", "64", "--iters", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(r["equal"] for r in json.loads(proc.stdout)["rows"])


def test_demo_repeats_each_configuration_and_reports_median_and_spread():
    proc = _run(*SMALL, "--rounds", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["rounds"] == 2
    for row in result["rows"]:
        # the resident model is timed alongside each of the two presets in each round
        assert row["rounds"] == (4 if row["config"].startswith("resident") else 2), row
        assert row["ms_min"] <= row["ms_per_forward"] <= row["ms_max"], row
    for row in result["rows"][1:]:
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"], row


def test_demo_shows_progress_per_configuration_on_stderr():
    """Progress while it works: a line per configuration and round on stderr; stdout stays the table."""
    proc = _run(*SMALL, "--rounds", "2", "--presets", "budget")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("[demo]")]
    for tag in ("round 1/2: offload: budget", "round 2/2: offload: budget", "round 2/2 done"):
        assert any(tag in ln for ln in progress), proc.stderr
    assert not any(ln.startswith("[demo]") for ln in proc.stdout.splitlines())
    assert "ms min-max" in proc.stdout and "ratio min-max" in proc.stdout, proc.stdout
    assert "Medians of 2 rounds" in proc.stdout
    quiet = _run(*SMALL, "--rounds", "1", "--presets", "budget", "--quiet")
    assert quiet.returncode == 0 and "[demo]" not in quiet.stderr, quiet.stderr


def test_median_row_takes_medians_spread_and_all_rounds_equality():
    from offload.demo import Row, median_row

    rows = [Row("offload: x", ms, ratio=ratio, equal=eq, max_abs_diff=d, peak_device_bytes=p)
            for ms, ratio, eq, d, p in [(10.0, 1.1, True, 0.0, 5), (30.0, 1.5, True, 0.0, 7), (20.0, 1.2, False, 0.5, 6)]]
    row = median_row(rows)
    assert (row.ms_per_forward, row.ms_min, row.ms_max) == (20.0, 10.0, 30.0)
    assert (row.ratio, row.ratio_min, row.ratio_max) == (1.2, 1.1, 1.5)
    assert row.equal is False, "one differing round makes the configuration differ"
    assert row.max_abs_diff == 0.5 and row.peak_device_bytes == 7 and row.rounds == 3


def test_demo_threads_setting_is_restored():
    import torch

    from offload.demo import run_demo

    before = torch.get_num_threads()
    rows, info = run_demo(device="sim", dim=64, depth=2, tokens=4, iters=1, warmup=0, presets=("budget",), rounds=1,
                          threads=1, progress=lambda line: None)
    assert info["threads"] == 1 and torch.get_num_threads() == before
    assert all(r.equal for r in rows)
