"""Command line: `python -m offload demo [...]` (see `python -m offload demo --help`),
`python -m offload pack SRC.safetensors OUT_DIR` (the packed disk format, offload/store/packed.py),
`python -m offload plan MODEL [--card ...]` (will it fit, and how slow: offload/predict/plan_cli.py) and
`python -m offload convert WORKFLOW.json -o OUT.json` (the pack's nodes put into a ComfyUI workflow: offload/convert/)."""
from __future__ import annotations

import argparse
import logging
import math
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
    pack.add_argument("--shard-gb", type=_shard_gb, default=4.0, help="largest shard file, in GiB (default 4)")
    pack.add_argument("--force", action="store_true", help="replace a packed model already in OUT_DIR")
    pack.add_argument("--compress", action="store_true",
                      help="store blocks losslessly compressed where that pays (bf16 weights: about 0.7 of their "
                           "bytes): fewer bytes read from disk, decoded on the device")
    plan = sub.add_parser("plan", help="will a model fit a card, and how slow: the plan and predicted step time per "
                                       "preset, from a config.json or a model file's header (nothing downloaded)")
    from .predict import plan_cli

    plan_cli.add_arguments(plan)
    convert = sub.add_parser("convert", help="put the pack's nodes into a ComfyUI workflow (subgraphs too): Offload "
                                             "Loaders, Offload CLIP / Model after other loaders, one VRAM Budget, "
                                             "presets planned for the card")
    from .convert import cli as convert_cli

    convert_cli.add_arguments(convert)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    run = {"demo": demo_mod.main, "pack": _pack, "plan": plan_cli.main, "convert": convert_cli.main}[args.command]
    try:
        return run(args)
    except (ValueError, OSError, OverflowError) as exc:  # bad device / preset / size / file: a message, no traceback
        print(f"python -m offload {args.command}: error: {_first_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"python -m offload {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line; the traceback with -v
        if args.verbose:
            raise
        print(f"python -m offload {args.command}: failed: {_first_line(exc)} (run with -v for the traceback)",
              file=sys.stderr)
        return 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0][:500] if text else type(exc).__name__) + ("" if isinstance(exc, ValueError) else
                                                                          f" ({type(exc).__name__})")


def _shard_gb(text: str) -> float:
    """--shard-gb: a finite size from one page to 1 TiB, in GiB (a usage error otherwise)."""
    try:
        value = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 4096 / 2 ** 30 <= value <= 1024):
        raise argparse.ArgumentTypeError(f"--shard-gb takes a size in GiB from {4096 / 2 ** 30:.7f} (one 4 KiB page) "
                                         f"to 1024, got {text[:40]!r}")
    return value


def _pack(args: argparse.Namespace) -> int:
    import json

    from .store.pack_writer import pack_file
    from .store.storage import CorruptFileError

    try:
        index = pack_file(args.src, args.out_dir, shard_bytes=max(4096, int(args.shard_gb * 2 ** 30)),
                          overwrite=args.force, compress=args.compress)
    except (ValueError, OSError, OverflowError) as exc:  # CorruptFileError is a ValueError
        kind = "bad input" if isinstance(exc, CorruptFileError) else "error"
        print(f"python -m offload pack: {kind}: {_first_line(exc)}", file=sys.stderr)
        return 2
    info = json.loads(index.read_text())
    total = sum(s["nbytes"] for s in info["shards"])
    stored = [u for u in info["units"] if "compression" in u]
    held = (f"; {len(stored)} unit(s) compressed, {sum(u['nbytes'] for u in stored) / 2 ** 20:.1f} MiB in "
            f"{sum(u['stored'] for u in stored) / 2 ** 20:.1f} MiB" if args.compress else "")
    print(f"packed {len(info['units'])} units and {len(info['other'])} other tensors into {len(info['shards'])} "
          f"shard(s), {total / 2 ** 20:.1f} MiB{held}: {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
