"""Host RAM of N local workers offloading the same file, with one shared host copy against a copy each.

ComfyUI-Distributed runs a master and one worker process per GPU on one machine. This starts N real processes
(`tests/shared_host_worker.py`, the simulated device, a 64 MiB fp32 model of 16 blocks read from its file) one after
another, each offloading the model and running one forward, and reads the sum of their proportional set sizes
(PSS) after each; `share_host="off"` is the baseline of the same run. Prints per count of workers the total PSS
growth (what the workers added over their bare runtime before offloading) and the ratio shared / off.

    python benchmarks/bench_shared_host.py --workers 4
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests import shared_host_worker as worker  # noqa: E402
from tests.test_shared_host import MODEL_BYTES, Worker, total_pss  # noqa: E402


def run(path: Path, n: int, share: str) -> list[int]:
    """The total PSS growth after 1..n workers offloaded the model (bytes)."""
    workers, growth, base = [], [], 0
    try:
        for _ in range(n):
            workers.append(Worker(path, share))
            before = total_pss(workers)
            workers[-1].ask("offload", "out")
            after = total_pss(workers)
            base += after - before
            growth.append(base)
    finally:
        for w in workers:
            w.quit()
    return growth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        torch.manual_seed(0)
        save_file(worker.build().state_dict(), str(path))
        off = run(path, args.workers, "off")
        shared = run(path, args.workers, "auto")
    mib = 1 << 20
    print(f"model {MODEL_BYTES / mib:.0f} MiB; {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}")
    print("workers | host RAM added, a copy each (off) | one shared copy (auto) | shared / off")
    for k, (a, b) in enumerate(zip(off, shared), 1):
        print(f"{k} | {a / mib:.0f} MiB | {b / mib:.0f} MiB | {b / a:.2f}")


if __name__ == "__main__":
    main()
