"""Host RAM of N local workers offloading the same file, with one shared host copy against a copy each.

ComfyUI-Distributed runs a master and one worker process per GPU on one machine. This starts N real processes
(`tests/shared_host_worker.py`, the simulated device, a 64 MiB fp32 model of 16 blocks read from its file) one after
another, each offloading the model and running one forward, and reads the sum of their proportional set sizes
(PSS) after each; `share_host="off"` is the baseline of the same run. Prints per count of workers the total PSS
growth (what the workers added over their bare runtime before offloading) and the ratio shared / off.
`--compressed`: the model's weights bf16 drawn like trained ones, offloaded with host_compression="auto" under a RAM
ceiling of 80% of them, so every block is held compressed (shared in its encoded form).

    python benchmarks/bench_shared_host.py --workers 4 [--compressed]
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


def run(path: Path, n: int, share: str, extra: tuple[str, ...] = ()) -> list[int]:
    """The total PSS growth after 1..n workers offloaded the model (bytes)."""
    workers, growth, base = [], [], 0
    try:
        for _ in range(n):
            workers.append(Worker(path, share, extra=extra))
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
    ap.add_argument("--compressed", action="store_true", help="bf16 blocks held compressed under a RAM ceiling")
    args = ap.parse_args()
    size = MODEL_BYTES // 2 if args.compressed else MODEL_BYTES
    extra = ("auto", str(int(0.8 * size))) if args.compressed else ()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        torch.manual_seed(0)
        save_file(worker.build(compressed=args.compressed).state_dict(), str(path))
        off = run(path, args.workers, "off", extra)
        shared = run(path, args.workers, "auto", extra)
    mib = 1 << 20
    print(f"model {size / mib:.0f} MiB{' (bf16, held compressed)' if args.compressed else ''}; {os.cpu_count()} "
          f"CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("workers | host RAM added, a copy each (off) | one shared copy (auto) | shared / off")
    for k, (a, b) in enumerate(zip(off, shared), 1):
        print(f"{k} | {a / mib:.0f} MiB | {b / mib:.0f} MiB | {b / a:.2f}")


if __name__ == "__main__":
    main()
