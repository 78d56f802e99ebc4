"""Disk-tier read speed: the packed format (offload/store/packed.py) against the original safetensors file, and both
against the same device read sequentially with O_DIRECT, in one run.

The model is a stack of transformer-like blocks (bf16 Linear weights, a float32 LayerNorm per block, as mixed-
precision checkpoints store them) written with `safetensors.torch.save_file`, then packed with `pack_file`. Two
copies of the model, built on the meta device, are offloaded with every block on the disk tier: one with
`disk_path=<the .safetensors file>`, one with `disk_path=<the packed folder>`. The timed work is the disk tier's
own read, `DiskSource` filling a unit's buffer (what the read-ahead thread does for each streamed block), for every
block in execution order, with the page cache of the files dropped before each pass. Rows:

- `O_DIRECT sequential (device)`: the .safetensors file read front to back with O_DIRECT in 8 MiB requests: what
  the device gives a sequential reader with no page cache involved;
- `disk tier: original .safetensors`: the engine's reads of the original file, blocks in execution order;
- `buffered sequential (device)`: the same through the page cache (the kernel's read-ahead), cache dropped first;
- `disk tier: packed`: the same from the packed folder;
- `disk tier: packed, page cache warm`: a packed pass right after another, the shards cached (what dropping the
  cache takes away);
- `disk tier: packed --compress`: the same from a folder packed with `compress=True`: the blocks' encoded bytes
  (`StoredDiskSource` filling a buffer), GB/s counted in the blocks' raw bytes, so the row shows what reading fewer
  bytes gives;
- `... + decode`: the same, each block then decoded in place in the buffer as the device does after the copy (here
  on the CPU: on the simulated device the decode is CPU work; on CUDA it runs on the copy stream).

Columns: GB/s (bytes of the blocks over the time; median of `--repeat` rounds, each round runs every row once, in
an order rotated from round to round), positioned reads per block per pass, and the share of the O_DIRECT figure.
The page cache is dropped with `echo 3 > /proc/sys/vm/drop_caches` where permitted (`--cache drop`, the default),
else with `posix_fadvise(POSIX_FADV_DONTNEED)` on every file read (`--cache fadvise`; clean pages are dropped, the
files are fsynced first); the output says which was used. Every block read is compared bitwise with the source. No
figure is a pass/fail bound.

    .venv/bin/python benchmarks/bench_disk.py                    # ~400 MB, a table
    .venv/bin/python benchmarks/bench_disk.py --blocks 24 --dim 1024 --json out.json
"""
from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.store import codec  # noqa: E402
from offload.store.compressed import StoredDiskSource  # noqa: E402
from offload.store.pack_writer import pack_file  # noqa: E402

CHUNK = 8 << 20


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)  # float32
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, dtype=torch.bfloat16)
        self.proj = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)
        self.fc1 = nn.Linear(dim, 4 * dim, bias=False, dtype=torch.bfloat16)
        self.fc2 = nn.Linear(4 * dim, dim, bias=False, dtype=torch.bfloat16)


class Stack(nn.Module):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm_out = nn.LayerNorm(dim)


def write_model(path: Path, dim: int, blocks: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in Stack(dim, blocks).state_dict().items()}
    sd = {k: torch.randn(*s, generator=g).to(dt) for k, (s, dt) in shapes.items()}
    save_file(sd, str(path))
    return sd


USE_DROP_CACHES = True  # --cache fadvise: only posix_fadvise on the benchmark's own files (what the test uses)


def drop_cache(paths: list[Path]) -> str:
    if USE_DROP_CACHES:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def sequential_read(path: Path, direct: bool) -> tuple[float, str]:
    """Seconds to read `path` front to back in 8 MiB requests (O_DIRECT: aligned, no page cache), and how."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, CHUNK)  # page aligned, as O_DIRECT needs
    view = memoryview(buf)
    how = "buffered"
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            how = "O_DIRECT"
        except (OSError, AttributeError):
            how = "buffered (O_DIRECT refused)"
    if fd < 0:
        fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < size:
            try:
                n = os.preadv(fd, [view], off)
            except OSError:  # O_DIRECT refused by this filesystem at read time
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
                how = "buffered (O_DIRECT refused)"
                continue
            if n <= 0:
                break
            off += n
        return time.perf_counter() - t0, how
    finally:
        os.close(fd)
        view.release()
        buf.close()


def attach(path: Path, dim: int, blocks: int, name: str):
    """A meta-device copy of the model offloaded from `path` with every block on the disk tier."""
    with torch.device("meta"):
        model = Stack(dim, blocks)
    def aligned(m: nn.Module) -> int:
        return sum(-(-t.numel() * t.element_size() // 512) * 512 for t in m.state_dict().values())

    # about the least RAM (the weights outside the blocks, the smallest bounce buffers): every block on disk. The
    # timed reads fill a buffer of their own, a whole block each, as whole-block bounce buffers would be filled.
    cfg = OffloadConfig(device="sim", disk_path=str(path), prefetch=1,
                        ram_budget_bytes=aligned(model.norm_out) + 4 * 4096)
    h = offload_module(model, cfg, name=name, budget=VramBudget(None))
    disk = [s for s in h.streamer.sources if s.tier == "disk"]
    if len(disk) != blocks:
        raise SystemExit(f"{name}: {blocks - len(disk)} block(s) not on the disk tier")
    return model, h, disk


def _fill_raw(src, buf: torch.Tensor, decode: bool) -> int:
    """One block as the disk tier delivers it; returns its raw bytes (a stored-compressed block: its encoded bytes
    read into the tail of the block's room in `buf`, decoded in place when `decode`)."""
    if not isinstance(src, StoredDiskSource):
        return src._fill(buf, 0, src.nbytes)
    u = src.unit
    src._fill(buf[u.nbytes - u.stored:u.nbytes], 0, u.stored)
    if decode:
        codec.decode_into(buf, u.chunks, u.nbytes, u.stored)
    return sum(ft.end - ft.start for ft in (src.file.tensors[k] for k in u.keys))


def time_disk_tier(sources, buf: torch.Tensor, decode: bool = True) -> tuple[float, int, int]:
    calls = [0]
    real = os.preadv

    def counting(*a):
        calls[0] += 1
        return real(*a)

    os.preadv = counting
    try:
        t0 = time.perf_counter()
        nbytes = 0
        for src in sources:  # execution order: blocks.0, blocks.1, ...
            nbytes += _fill_raw(src, buf, decode)
        return time.perf_counter() - t0, nbytes, calls[0]
    finally:
        os.preadv = real


def check_bitwise(sources, buf: torch.Tensor, sd: dict[str, torch.Tensor], file) -> None:
    for src in sources:
        _fill_raw(src, buf, decode=True)
        pieces = src.pieces if not isinstance(src, StoredDiskSource) else [(k, file.tensors[k].start)
                                                                            for k in src.unit.keys]
        for key, off in pieces:
            ft = file.tensors[key]
            want = sd[key.split("model.", 1)[-1]].reshape(-1).view(torch.uint8)
            if not torch.equal(buf[off:off + ft.end - ft.start], want):
                raise SystemExit(f"{key}: the disk tier read other bytes than the source")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write the files (default: a temporary folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", choices=["drop", "fadvise"], default="drop",
                    help="drop: echo 3 > /proc/sys/vm/drop_caches where permitted (else fadvise); fadvise: "
                         "posix_fadvise(DONTNEED) on the benchmark's files only")
    args = ap.parse_args(argv)
    global USE_DROP_CACHES
    USE_DROP_CACHES = args.cache == "drop"
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        src = tmp / "model.safetensors"
        t0 = time.perf_counter()
        sd = write_model(src, args.dim, args.blocks)
        drop_cache([src])
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack_file(src, tmp / "model.packed")
        t_pack = time.perf_counter() - t0
        t0 = time.perf_counter()
        pack_file(src, tmp / "model.cpacked", compress=True)
        t_cpack = time.perf_counter() - t0
        shards = sorted((tmp / "model.packed").glob("shard-*.bin"))
        cshards = sorted((tmp / "model.cpacked").glob("shard-*.bin"))
        orig_model, h_orig, orig = attach(src, args.dim, args.blocks, "original")
        packed_model, h_packed, packed = attach(tmp / "model.packed", args.dim, args.blocks, "packed")
        cpacked_model, h_cpacked, cpacked = attach(tmp / "model.cpacked", args.dim, args.blocks, "packed-compressed")
        if not all(isinstance(s, StoredDiskSource) for s in cpacked):
            raise SystemExit("the compressed folder's blocks do not stream encoded")
        stored = sum(s.unit.stored for s in cpacked)
        biggest = max(s.nbytes for s in orig + packed + cpacked)
        buf = torch.empty(biggest, dtype=torch.uint8)
        check_bitwise(orig, buf, sd, orig[0].file)
        check_bitwise(packed, buf, sd, packed[0].file)
        check_bitwise(cpacked, buf, sd, cpacked[0].file)
        block_bytes = sum(sum(ft.end - ft.start for ft in (s.file.tensors[k] for k, _ in s.pieces)) for s in orig)
        seq, buffered = "O_DIRECT sequential (device)", "buffered sequential (device)"
        comp, comp_dec = "disk tier: packed --compress", "disk tier: packed --compress + decode"
        names = [seq, buffered, "disk tier: original .safetensors", "disk tier: packed",
                 "disk tier: packed, page cache warm", comp, comp_dec]
        rows: dict[str, list[float]] = {n: [] for n in names}
        reads: dict[str, int] = {}
        tiers = {"disk tier: original .safetensors": (orig, [src]), "disk tier: packed": (packed, shards),
                 comp: (cpacked, cshards), comp_dec: (cpacked, cshards)}
        how_cache = how_direct = ""
        size = src.stat().st_size
        for k in range(args.repeat):
            todo = [seq, buffered, *tiers]
            todo = todo[k % len(todo):] + todo[:k % len(todo)]  # rotate: no row always runs first
            for name in todo:
                if name in (seq, buffered):
                    how_cache = drop_cache([src])
                    dt, how = sequential_read(src, direct=name == seq)
                    how_direct = how if name == seq else how_direct
                    rows[name].append(size / dt / 1e9)
                    continue
                sources, files = tiers[name]
                drop_cache(files)
                dt, nbytes, calls = time_disk_tier(sources, buf, decode=name != comp)
                assert nbytes == block_bytes
                rows[name].append(nbytes / dt / 1e9)
                reads[name] = calls
            time_disk_tier(packed, buf)  # a pass to fill the page cache, then the timed one
            dt, nbytes, calls = time_disk_tier(packed, buf)
            rows["disk tier: packed, page cache warm"].append(nbytes / dt / 1e9)
            reads["disk tier: packed, page cache warm"] = calls
        h_orig.detach()
        h_packed.detach()
        h_cpacked.detach()
        file_mb = src.stat().st_size / 1e6
    base = statistics.median(rows[seq])
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "torch": torch.__version__, "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
        "file_mb": round(file_mb, 1), "blocks": args.blocks, "block_mb": round(block_bytes / args.blocks / 1e6, 2),
        "page_cache": how_cache, "sequential_read": how_direct, "write_s": round(t_write, 2),
        "pack_s": round(t_pack, 2), "pack_compress_s": round(t_cpack, 2),
        "encoded_share": round(stored / block_bytes, 3), "bitwise": True,
        "rows": [{"name": n, "gbps_median": round(statistics.median(v), 3), "gbps_all": [round(x, 3) for x in v],
                  "reads_per_block": round(reads[n] / args.blocks, 2) if n in reads else None,
                  "vs_sequential": round(statistics.median(v) / base, 2)} for n, v in rows.items()],
    }
    print(f"disk tier read speed: {args.blocks} blocks of {result['block_mb']} MB ({file_mb:.0f} MB file), "
          f"{result['machine']}, {result['date']}")
    print(f"page cache dropped with {how_cache} before each pass; device baseline read {how_direct}; "
          f"packing took {t_pack:.1f} s (--compress {t_cpack:.1f} s, blocks stored in "
          f"{result['encoded_share']:.3f} of their bytes); every block bitwise equal to the source")
    print(f"{'row':36} {'GB/s (median)':>14} {'reads/block':>12} {'vs O_DIRECT':>12}   passes")
    for r in result["rows"]:
        rb = "" if r["reads_per_block"] is None else f"{r['reads_per_block']:g}"
        print(f"{r['name']:36} {r['gbps_median']:>14.2f} {rb:>12} {r['vs_sequential']:>12.2f}   "
              f"{', '.join(f'{x:.2f}' for x in r['gbps_all'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
