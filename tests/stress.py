"""`make test-stress`: the timing-adjacent test files, run again and again while other processes keep cores busy.

A test that reads the wall clock to decide its verdict passes on an idle machine and fails on a loaded one (CI's
shared 2-core box). This runner starts `--busy` busy-loop processes (each keeps one core at 100%), runs pytest on the
given files `--runs` times in a row, stops the busy loops (also on Ctrl-C or an error), and prints how many runs
passed; a failing run's output is kept under `--logs`. Exit code 0 only when every run passed. Not part of CI.

    python tests/stress.py --runs 20 --busy 1 tests/test_cost_placement.py ...
    python tests/stress.py --runs 10 --busy 1          # no files: the whole suite (`make test` under load)
    python tests/stress.py --runs 3 --busy 0 --jitter-ms 1   # the wall clock jumps at random (tests/wall_clock_jitter.py)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY_LOOP = "import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\nwhile True:\n    pass\n"


def start_busy(n: int) -> list[subprocess.Popen]:
    """`n` processes, each spinning one core until stopped."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test files or node ids (none: the whole suite)")
    ap.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    ap.add_argument("--busy", type=int, default=1, help="cores kept busy by a busy-loop process each (default 1)")
    ap.add_argument("--logs", default=str(ROOT / ".make" / "stress"), help="where a failing run's output goes")
    ap.add_argument("--pytest-args", default="-q -p no:cacheprovider", help="extra pytest arguments")
    ap.add_argument("--jitter-ms", type=float, default=None,
                    help="also push the engine's wall clock ahead at random, this many ms per reading on average, "
                         "with a busy moment now and then (tests/wall_clock_jitter.py; a new seed per run)")
    ap.add_argument("--jitter-seed", type=int, default=1000, help="the first run's jitter seed (the next ones follow)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.busy < 0:
        ap.error("--runs must be at least 1 and --busy at least 0")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", *args.pytest_args.split(), *args.files]
    env = dict(os.environ)
    if args.jitter_ms is not None:
        cmd[3:3] = ["-p", "tests.wall_clock_jitter"]
        env["LO_JITTER_MS"] = str(args.jitter_ms)
    what = " ".join(args.files) if args.files else "the whole suite"
    print(f"[stress] {args.runs} runs of {what} with {args.busy} core(s) kept busy"
          f"{'' if args.jitter_ms is None else f', the wall clock jittered ({args.jitter_ms} ms)'}", flush=True)
    busy = start_busy(args.busy)
    passed, failed = 0, []
    started = time.monotonic()
    try:
        for k in range(1, args.runs + 1):
            t0 = time.monotonic()
            env["LO_JITTER_SEED"] = str(args.jitter_seed + k)
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            tail = (proc.stdout.strip().splitlines() or [""])[-1]
            if proc.returncode == 0:
                passed += 1
            else:
                failed.append(k)
                log = logs / f"run-{k}.log"
                log.write_text(proc.stdout + proc.stderr)
                tail += f" (output: {log})"
            print(f"[stress] run {k}/{args.runs}: {'passed' if proc.returncode == 0 else 'FAILED'} in "
                  f"{time.monotonic() - t0:.0f} s: {tail}", flush=True)
    finally:
        stop_busy(busy)
    print(f"[stress] {passed} of {args.runs} runs passed ({time.monotonic() - started:.0f} s with {args.busy} busy "
          f"core(s)){'; failed: ' + ', '.join(map(str, failed)) if failed else ''}", flush=True)
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
