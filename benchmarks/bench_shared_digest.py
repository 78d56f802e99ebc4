"""What a per-unit check of a joined shared host copy against the model's file would cost, against a plain load.

A process whose model is built on the meta device joins our own segment trusting the filler's word that the bytes
came from the file (the segment is ours: same uid, mode 0600; issue 41). Checking each unit against the file instead
means reading the unit's bytes from the file and comparing them with the segment's: this measures that check (two
ways: the file's bytes compared with the segment's, and a BLAKE2b digest of each) against the plain load it would
save (`share_host="off"`: the file read into the process's own RAM) and against the join itself, in one process on
the simulated device, the file in the page cache (the check's best case: no disk read). Issue 41 asked for the check
only if it costs under 5% of a plain load.

    python benchmarks/bench_shared_digest.py [--width 2048] [--repeat 5]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests import shared_host_worker as worker  # noqa: E402


def _offload(path: Path, share: str):
    from offload import OffloadConfig, VramBudget, offload_module

    model = worker.build("meta")
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), share_host=share,
                                    sim_capacity_bytes=4 << 30)
    start = time.perf_counter()
    handle = offload_module(model, cfg, budget=VramBudget(1 << 30))
    return handle, time.perf_counter() - start


def _check(handle, path: Path, digest: bool) -> float:
    """Seconds to check every unit the handle took from the shared copy against the file's bytes (the worker's
    model: unit i is `i.weight` alone, at offset 0 of its range)."""
    from offload.store.storage import SafetensorsFile

    copy = handle.streamer.staged.shared
    file = SafetensorsFile(str(path))
    start = time.perf_counter()
    for i in copy.placed:
        seg = copy._frombuffer(copy._shared, copy.offsets[i], copy.sizes[i])
        raw = torch.empty(copy.sizes[i], dtype=torch.uint8)
        file.read_into(raw, [(f"{i}.weight", 0)])  # the read a plain load makes
        if digest:
            ok = hashlib.blake2b(raw.numpy()).digest() == hashlib.blake2b(seg.numpy()).digest()
        else:
            ok = torch.equal(raw, seg)
        assert ok, i
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    worker.WIDTH = args.width
    rows: dict[str, list[float]] = {"plain load (share_host=off)": [], "join (share_host=auto)": [],
                                    "check: compare with the file": [], "check: BLAKE2b digests": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        torch.manual_seed(0)
        save_file(worker.build().state_dict(), str(path))
        nbytes = path.stat().st_size
        for _ in range(args.repeat):
            plain, t = _offload(path, "off")
            rows["plain load (share_host=off)"].append(t)
            plain.detach()
            filler, _ = _offload(path, "auto")
            joiner, t = _offload(path, "auto")
            rows["join (share_host=auto)"].append(t)
            assert all(b.shared for b in joiner.report().blocks)
            rows["check: compare with the file"].append(_check(joiner, path, digest=False))
            rows["check: BLAKE2b digests"].append(_check(joiner, path, digest=True))
            joiner.detach()
            filler.detach()
    base = statistics.median(rows["plain load (share_host=off)"])
    print(f"model: {nbytes / 2**20:.0f} MiB in 16 blocks; median of {args.repeat}; the file in the page cache")
    print("| step | seconds (median) | / plain load |")
    print("|---|---|---|")
    for name, ts in rows.items():
        print(f"| {name} | {statistics.median(ts):.3f} | {statistics.median(ts) / base:.2f} |")


if __name__ == "__main__":
    main()
