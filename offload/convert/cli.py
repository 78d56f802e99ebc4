"""`python -m offload convert workflow.json -o out.json`: the workflow with the pack's nodes put in (see
offload/convert/__init__.py), presets from the workflow plan on a card: `--card`, else this machine's CUDA card,
else the planner's reference card. Model files are looked for under `--models-dir` (ComfyUI's models folder layout);
where a file is missing its loader gets preset auto.

    python -m offload convert video_wan2_2_14B_t2v.json -o wan_offload.json --card rtx4070-12gb \
        --models-dir ~/ComfyUI/models
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..config import PRESETS
    from ..predict.cards import CARDS

    parser.add_argument("workflow", help="a workflow saved by ComfyUI's frontend (UI JSON; subgraphs included)")
    parser.add_argument("-o", "--output", default=None,
                        help="where to write the converted workflow (default: <name>_offload.json beside it; '-' "
                             "for standard output)")
    parser.add_argument("--card", default=None, help=f"plan the presets for this GPU: {', '.join(CARDS)} (default: "
                                                     "this machine's CUDA card, else the planner's reference card)")
    parser.add_argument("--models-dir", action="append", default=None,
                        help="a ComfyUI models folder to read the model files' headers from (repeatable; default: "
                             "models/ beside the workflow and in the current folder)")
    parser.add_argument("--ram", default=None, help="host RAM free for the models, e.g. 32GB (default: what is free)")
    parser.add_argument("--preset", default=None, choices=list(PRESETS),
                        help="give every offload node this preset instead of the plan's choice")
    parser.add_argument("--force", action="store_true", help="overwrite the output file when it exists")
    parser.add_argument("--json", action="store_true", help="print what changed as JSON (changes, edits, notes)")


def this_machines_card() -> tuple[Any, str | None]:
    """(the named card matching this machine's first CUDA device, a note) or (None, None) without one."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    from ..predict.cards import match_card

    name = torch.cuda.get_device_name(0)
    total = torch.cuda.get_device_properties(0).total_memory
    card = match_card(name, total)
    if card is None:
        return None, f"this machine's {name} is not in the cards table: planned for the reference card"
    return card, f"this machine's {name}"


def _output_path(args: argparse.Namespace) -> str:
    if args.output:
        return args.output
    src = Path(args.workflow)
    return str(src.with_name(src.stem + "_offload.json"))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def main(args: argparse.Namespace, out: Callable[[str], None] = print, err: Callable[[str], None] = _stderr) -> int:
    """Convert `args.workflow` and write it; print what changed. ValueError / OSError: the caller's one-line error."""
    from ..predict.plan_cli import parse_bytes
    from ..predict.workflow_cli import models_dir_finder, read_workflow
    from . import convert_workflow

    path = Path(args.workflow)
    graph = read_workflow(path)
    target = _output_path(args)
    if target != "-" and os.path.exists(target) and not args.force and \
            os.path.realpath(target) != os.path.realpath(path):
        raise ValueError(f"{target} exists: pass --force to overwrite it, or -o another file")
    roots = [Path(d).expanduser() for d in (args.models_dir or [])] or [path.parent / "models", Path("models")]
    card, note = args.card, None
    if card is None and args.preset is None:
        card, note = this_machines_card()
    ram = parse_bytes(args.ram) if args.ram else None
    result = convert_workflow(graph, models_dir_finder(roots), card, ram, args.preset)
    if note:
        result.notes.append(note)
    text = json.dumps(result.workflow, indent=2, ensure_ascii=False)
    in_place = target != "-" and os.path.realpath(target) == os.path.realpath(path)
    if target == "-":
        out(text)
    elif result.changed or not in_place:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        summary = result.to_dict()
        summary.pop("workflow")
        summary["output"] = target
        (err if target == "-" else out)(json.dumps(summary, indent=1))
        return 0
    report = out if target != "-" else err
    on = f" (presets planned for {result.card})" if result.card else ""
    for change in result.changes:
        where = "" if change.graph == "the workflow" else f" in {change.graph}"
        preset = f", preset {change.preset}" if change.preset else ""
        node = f" #{change.node}" if change.node else ""
        report(f"{change.type}{node}{where}: {change.action}{preset}")
    for line in result.notes:
        report(f"note: {line}")
    if target != "-":
        report(f"{target} left as it was" if in_place and not result.changed else f"wrote {target}{on}")
    return 0
