"""Hot-path microbenchmark: the CPU cost per unit of each offloading library's hooks, on one model, in one run.

The model is a stack of many tiny blocks (a 16-wide Linear each), so a forward is nearly all hook work: the
figure is microseconds per unit (block) per forward, for

- `plain (no hooks)`: the model as is (the floor: a tiny Linear's own cost);
- `layer-offload: resident`: this engine, every unit resident on the device (hooks, no copies);
- `layer-offload: streamed`: this engine, every unit streamed through the slot ring (hooks + copy scheduling);
- `diffusers group offload (block_level)`: `diffusers.hooks.apply_group_offloading(..., offload_type="block_level",
  num_blocks_per_group=1)`, onload and offload device the same CPU device as the simulated device's compute;
- `accelerate cpu_offload`: `accelerate.cpu_offload(model, execution_device=cpu)` (hooks on every leaf module).

Columns: us/unit (fastest batch: other processes on a shared CPU only add time), the median over batches, the
overhead over `plain` per unit, ms per forward, and whether the output equals the plain model's bit for bit.
On the simulated device (no GPU) every library's copies are CPU copies, so the figures are the hooks' CPU cost;
that is what this benchmark is for. No figure is ever a pass/fail bound.

    .venv/bin/python benchmarks/bench_hooks.py                 # 200 and 2000 units, a table
    .venv/bin/python benchmarks/bench_hooks.py --units 200 --json out.json
    make bench-hooks                                            # the same (BENCH_HOOKS_ARGS="..." to change)

accelerate and diffusers are optional (`make bench-deps` installs them without touching torch); a missing one is
a row marked skipped.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

log = logging.getLogger("bench_hooks")


class TinyStack(nn.Module):
    """`units` blocks of one 16-wide Linear each: a forward is nearly all per-unit hook work."""

    def __init__(self, units: int, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class HookRow:
    """One configuration's per-unit figures."""

    config: str
    units: int
    us_per_unit: float | None = None  # fastest batch
    us_per_unit_median: float | None = None
    overhead_us_per_unit: float | None = None  # us_per_unit minus plain's
    ms_per_forward: float | None = None
    equal: bool | None = None  # output bitwise equal to the plain model's
    note: str = ""


def time_per_forward(fn: Callable[[], Any], forwards: int, batches: int, warmup: int) -> tuple[list[float], Any]:
    """Seconds per forward of each batch of `forwards` forwards (after `warmup`), and the last output."""
    out = None
    with torch.inference_mode():
        for _ in range(warmup):
            out = fn()
        per = []
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(forwards):
                out = fn()
            per.append((time.perf_counter() - start) / forwards)
    return per, out


def bench_case(units: int, forwards: int, batches: int, warmup: int, skip: set[str],
               say: Callable[[str], None]) -> list[HookRow]:
    """Every configuration on one TinyStack of `units` units."""
    from offload import OffloadConfig, VramBudget, offload_module

    torch.manual_seed(0)
    model = TinyStack(units).eval()
    x = torch.randn(1, 16)
    with torch.inference_mode():
        ref = model(x)
    rows: list[HookRow] = []

    def measure(label: str, fn: Callable[[], Any], note: str = "") -> HookRow:
        per, out = time_per_forward(fn, forwards, batches, warmup)
        best, med = min(per), statistics.median(per)
        row = HookRow(label, units, us_per_unit=best * 1e6 / units, us_per_unit_median=med * 1e6 / units,
                      ms_per_forward=best * 1e3, equal=bool(torch.equal(out.detach().cpu(), ref)), note=note)
        rows.append(row)
        say(f"{units} units: {label}: {row.us_per_unit:.2f} us/unit (median {row.us_per_unit_median:.2f})")
        return row

    def skipped(label: str, why: str) -> None:
        rows.append(HookRow(label, units, note=f"skipped: {why}"))
        say(f"{units} units: {label}: skipped ({why})")

    plain = measure("plain (no hooks)", lambda: model(x), "the floor")

    unit_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    for label, resident in (("layer-offload: resident", True), ("layer-offload: streamed", False)):
        net = copy.deepcopy(model)
        if resident:
            cfg = OffloadConfig.from_preset("high_end", device="sim")
            budget = VramBudget(None)
        else:
            cfg = OffloadConfig.from_preset("budget", device="sim")
            budget = VramBudget(64 * 4096 + 16 * unit_bytes + (1 << 20))  # room for the ring, not for the units
        handle = offload_module(net, cfg, name=label, budget=budget)
        try:
            row = measure(label, lambda: net(x))
            rep = handle.report()
            row.note = ", ".join(f"{n} {tier}" for tier, n in sorted(rep.tiers.items()) if n)
        finally:
            handle.detach()
        del net

    label = "diffusers group offload (block_level)"
    if "diffusers" in skip:
        skipped(label, "--skip")
    else:
        try:
            from diffusers.hooks import apply_group_offloading
        except ImportError as exc:
            skipped(label, f"diffusers not importable ({exc.name}); make bench-deps")
        else:
            net = copy.deepcopy(model)
            cpu = torch.device("cpu")
            apply_group_offloading(net, onload_device=cpu, offload_device=cpu, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=False)
            measure(label, lambda: net(x), "1 block per group, no stream (CPU)")
            del net

    label = "accelerate cpu_offload"
    if "accelerate" in skip:
        skipped(label, "--skip")
    else:
        try:
            from accelerate import cpu_offload
            from accelerate.hooks import remove_hook_from_submodules
        except ImportError as exc:
            skipped(label, f"accelerate not importable ({exc.name}); make bench-deps")
        else:
            net = copy.deepcopy(model)
            cpu_offload(net, execution_device=torch.device("cpu"))
            try:
                measure(label, lambda: net(x), "hooks on every leaf module")
            finally:
                remove_hook_from_submodules(net)
            del net

    for row in rows:
        if row.us_per_unit is not None and plain.us_per_unit is not None:
            row.overhead_us_per_unit = row.us_per_unit - plain.us_per_unit
    return rows


COLUMNS = (("config", "config", "{}"), ("units", "units", "{}"), ("us/unit", "us_per_unit", "{:.2f}"),
           ("us/unit median", "us_per_unit_median", "{:.2f}"), ("hook overhead us/unit", "overhead_us_per_unit",
                                                                "{:.2f}"),
           ("ms/forward", "ms_per_forward", "{:.2f}"), ("equal to plain", "equal", "{}"), ("note", "note", "{}"))


def format_rows(rows: list[HookRow]) -> str:
    """A markdown table of the rows."""
    def cell(row: HookRow, attr: str, fmt: str) -> str:
        value = getattr(row, attr)
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        return fmt.format(value)

    header = [c[0] for c in COLUMNS]
    body = [[cell(r, attr, fmt) for _, attr, fmt in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    found = {"torch": torch.__version__}
    for name in ("accelerate", "diffusers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = "not installed"
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table (and --json); non-zero when an engine row's output differs from plain."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, nargs="+", default=[200, 2000], help="units per model (default 200 2000)")
    parser.add_argument("--forwards", type=int, default=None,
                        help="forwards per timed batch (default: about 4000 unit calls per batch, at least 2)")
    parser.add_argument("--batches", type=int, default=7, help="timed batches per configuration (default 7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed forwards per configuration (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings)")
    parser.add_argument("--skip", default="", help="comma-separated: diffusers, accelerate")
    parser.add_argument("--json", default=None, help="also write the rows and run info to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    for name in ("forwards", "batches", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0 or any(u < 2 for u in args.units):
        parser.error("--warmup must be >= 0 and every --units >= 2")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[bench_hooks] {line}", file=sys.stderr, flush=True)

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows: list[HookRow] = []
    for units in args.units:
        forwards = args.forwards if args.forwards is not None else max(2, 4000 // units)
        rows += bench_case(units, forwards, args.batches, args.warmup, skip, say)
    info = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": "sim",
            "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})", "threads": args.threads,
            **_versions(), "command": " ".join(["benchmarks/bench_hooks.py", *(argv if argv is not None
                                                                                else sys.argv[1:])])}
    print(f"Hot path per unit, simulated device on a {info['machine']}, {args.threads} torch thread(s), "
          f"torch {info['torch']}, accelerate {info['accelerate']}, diffusers {info['diffusers']}, {info['date']}")
    print(format_rows(rows))
    engine_ok = all(r.equal for r in rows if r.config.startswith("layer-offload") and r.equal is not None)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": [asdict(r) for r in rows], "engine_outputs_equal": engine_ok, **info}, f, indent=2)
    if not engine_ok:
        print("FAIL: an engine output differs from the plain model's")
    return 0 if engine_ok else 1


if __name__ == "__main__":
    sys.exit(main())
