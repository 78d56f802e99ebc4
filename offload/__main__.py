"""Command line: `python -m offload demo [...]` (see `python -m offload demo --help`)."""
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
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
