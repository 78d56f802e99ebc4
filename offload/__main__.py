"""Command line: `python -m offload demo [...]` (see `python -m offload demo --help`),
`python -m offload pack SRC.safetensors OUT_DIR` (the packed disk format, offload/store/packed.py) and
`python -m offload plan MODEL [--card ...]` (will it fit, and how slow: offload/predict/plan_cli.py)."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the sub-command and run it; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m offload", description="Layer Offload command line")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's log messages")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a model resident and offloaded; check outputs are bitwise equal")
    from . import demo as demo_mod

    demo_mod.add_arguments(demo)
    pack = sub.add_parser("pack", help="rewrite a safetensors file as a packed folder: every block's bytes "
                                       "contiguous, in execution order, at 4 KiB-aligned offsets, plus index.json")
    pack.add_argument("src", help="the model's .safetensors file")
    pack.add_argument("out_dir", help="the folder to write (give it as disk_path)")
    pack.add_argument("--shard-gb", type=float, default=4.0, help="largest shard file, in GiB (default 4)")
    pack.add_argument("--force", action="store_true", help="replace a packed model already in OUT_DIR")
    plan = sub.add_parser("plan", help="will a model fit a card, and how slow: the plan and predicted step time per "
                                       "preset, from a config.json or a model file's header (nothing downloaded)")
    from .predict import plan_cli

    plan_cli.add_arguments(plan)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        try:
            return demo_mod.main(args)
        except ValueError as exc:  # bad device / preset / size: a message, not a traceback
            print(f"python -m offload demo: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("python -m offload demo: interrupted", file=sys.stderr)
            return 130
    if args.command == "pack":
        return _pack(args)
    if args.command == "plan":
        return plan_cli.main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _pack(args: argparse.Namespace) -> int:
    import json

    from .store.pack_writer import pack_file
    from .store.storage import CorruptFileError

    try:
        index = pack_file(args.src, args.out_dir, shard_bytes=max(4096, int(args.shard_gb * 2 ** 30)),
                          overwrite=args.force)
    except (ValueError, OSError) as exc:  # CorruptFileError is a ValueError
        kind = "bad input" if isinstance(exc, CorruptFileError) else "error"
        print(f"python -m offload pack: {kind}: {exc}", file=sys.stderr)
        return 2
    info = json.loads(index.read_text())
    total = sum(s["nbytes"] for s in info["shards"])
    print(f"packed {len(info['units'])} units and {len(info['other'])} other tensors into {len(info['shards'])} "
          f"shard(s), {total / 2 ** 20:.1f} MiB: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
