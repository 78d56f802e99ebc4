"""`python -m offload plan workflow.json`: a ComfyUI workflow (API or UI JSON) planned on a card, from the model
files' headers under a ComfyUI models folder (`--models-dir`, laid out as ComfyUI's: diffusion_models/ or unet/,
checkpoints/, text_encoders/ or clip/, vae/, loras/, tts/).

    python -m offload plan my_workflow.json --models-dir ~/ComfyUI/models --card rtx4070-12gb --ram 32GB
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from ..store.header_check import open_regular, read_at, read_json_file
from .header_cache import HeaderCache, default_dir
from .header_source import RemoteHeaders, download_size
from .model_links import workflow_links
from .remote_headers import TIMEOUT_S
from .workflow import WorkflowPlan, plan_workflow

GIB = 1 << 30
# a folder kind -> the folders ComfyUI's folder_paths maps it to (folder_paths.py: "diffusion_models" is
# models/unet + models/diffusion_models, "text_encoders" models/text_encoders + models/clip; ComfyUI-GGUF's
# "unet_gguf" lists .gguf files in the same folders)
FOLDERS = {"diffusion_models": ("diffusion_models", "unet"), "unet_gguf": ("diffusion_models", "unet"),
           "checkpoints": ("checkpoints",), "text_encoders": ("text_encoders", "clip"),
           "clip": ("clip", "text_encoders"), "clip_gguf": ("clip", "text_encoders"), "vae": ("vae", "vae_approx"),
           "loras": ("loras",), "tts": ("tts",), "controlnet": ("controlnet", "t2i_adapter"),
           "upscale_models": ("upscale_models",)}  # other kinds: the folder of the same name


MAX_WORKFLOW_BYTES = 64 << 20  # a workflow's JSON (graphs with thousands of nodes are a few MB)


def read_workflow(path: str | os.PathLike) -> Any:
    """A workflow file's JSON: a regular file of at most MAX_WORKFLOW_BYTES, with the engine's JSON limits
    (`store.header_check`; a CorruptFileError, a ValueError, naming it otherwise)."""
    return read_json_file(path, "workflow", MAX_WORKFLOW_BYTES)


def is_workflow(path: str | os.PathLike) -> bool:
    """Whether `path` is meant as a ComfyUI workflow: a .json file (not a model's config.json) whose first megabyte
    names "nodes" (UI JSON), "class_type" (API JSON) or "prompt". Only that much is read here: a workflow too large
    or too deep is then refused by `read_workflow` as a workflow, not taken for a model config."""
    p = Path(path)
    if p.suffix.lower() != ".json" or not p.is_file() or p.name == "config.json":
        return False
    try:
        fd = open_regular(p, "workflow")
    except ValueError:
        return False
    try:
        head = read_at(fd, 0, min(os.fstat(fd).st_size, 1 << 20), p, "workflow")
    except ValueError:
        return False
    finally:
        os.close(fd)
    return any(key in head for key in (b'"nodes"', b'"class_type"', b'"prompt"'))


def models_dir_finder(roots: list[Path]) -> Callable[[str, str], str | None]:
    """find_file over ComfyUI models folders: <root>/<folder>/<name> for the kind's folders."""
    def find(kind: str, name: str) -> str | None:
        for root in roots:
            for folder in FOLDERS.get(kind, (kind,)):
                candidate = root / folder / name
                if candidate.exists():
                    return str(candidate)
        return None
    return find


def _gib(n: Any) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _secs(ms: Any) -> str:
    if ms is None or not math.isfinite(ms):
        return "-"
    return f"{ms / 1e3:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def format_plan(plan: WorkflowPlan) -> str:
    """The plan as a newcomer reads it: per model, the run, RAM, notes."""
    d = plan.to_dict()
    card = d["card"]
    lines = [f"card {card['name']}: {card['vram_bytes'] / GIB:.0f} GiB, {card['tflops']:g} TFLOP/s, "
             f"{card['mem_gbps']:g} GB/s memory, {card['h2d_gbps']:g} GB/s host-to-device. PREDICTIONS from file "
             f"headers, not measurements."]
    head = ["model", "role", "family", "preset", "fits", "VRAM GiB", "activ. GiB", "host RAM GiB", "disk GiB",
            "per call", "resident", "calls"]
    rows = []
    for m in d["models"]:
        rows.append([m["name"][:40], m["role"], m["label"] or "-", m["preset"] if m["found"] else "-",
                     "-" if m["fits"] is None else ("yes" if m["fits"] else "NO"), _gib(m["vram_bytes"]),
                     _gib(m["activation_bytes"]), _gib(m["host_bytes"]), _gib(m["disk_bytes"]),
                     _secs(m["ms_per_call"]), _secs(m["resident_ms_per_call"]), str(m["calls"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    for m in d["models"]:
        wo = m["without_offloading"]
        if wo:
            verdict = "fits" if wo["fits"] else "does NOT fit"
            lines.append(f"without offloading, {m['name']} {verdict}: needs {_gib(wo['needs_bytes'])} GiB "
                         f"(weights {_gib(wo['weights_bytes'])} + activations {_gib(wo['activation_bytes'])}) of the "
                         f"{_gib(wo['card_bytes'])} GiB the card has for it")
        chosen = m["presets"].get(m["preset"], {})
        if chosen.get("compressed_blocks"):
            raw = chosen.get("uncompressed") or {}
            off = (f"{_gib(raw.get('disk_bytes'))} GiB" if raw.get("fits") else "no plan that fits the RAM")
            lines.append(f"compressed host RAM, {m['name']}: {chosen['compressed_blocks']} block(s) held compressed "
                         f"({_gib(chosen['compressed_bytes'])} GiB saved), {_gib(chosen['disk_bytes'])} GiB on the "
                         f"disk tier; with host_compression=\"off\": {off}")
        for note in m["notes"]:
            lines.append(f"  {m['name']}: {note}")
    run = d["run"]
    lines.append("run:")
    for s in run["samplers"]:
        split = f" of {s['total_steps']}" if s.get("total_steps", s["steps"]) != s["steps"] else ""
        if not s.get("runs", True):
            lines.append(f"  sampler {s['sampler']} ({s.get('class_type')}, {s.get('model_file') or 'no model'}): "
                         f"{s['steps']}{split} steps: {s['note']}")
            continue
        if "ms" not in s:
            size = f" at {s['width']}x{s['height']}" if s["width"] else ""
            frames = f", {s['frames']} frames" if s["frames"] else ""
            lines.append(f"  sampler {s['sampler']} ({s.get('class_type')}, {s.get('model_file') or 'no model'}): "
                         f"{s['steps']}{split} steps, CFG {s['cfg']:g}{size}{frames}: {s.get('note', '')}")
            continue
        frames = f", {s['frames']} frames" if s["frames"] else ""
        batched = (", cond+uncond batched" if s["cond_uncond_batched"] else
                   ", cond then uncond" if s["forwards_per_step"] == 2 else "")
        loras = f"; LoRAs {', '.join(s['loras'])}" if s["loras"] else ""
        lines.append(f"  sampler {s['sampler']}: {s['steps']} steps x {s['forwards_per_step']} forward(s) "
                     f"(CFG {s['cfg']:g}{batched}) at {s['width']}x{s['height']}{frames} ({s['image_tokens']} "
                     f"tokens): {_secs(s['ms_per_step'])}/step, {_secs(s['ms'])} (resident "
                     f"{_secs(s['resident_ms'])}){loras}")
    for p in run["phases"]:
        if p["phase"] in ("text encode", "vae decode", "tts generate"):
            lines.append(f"  {p['phase']} ({p['model']}): {p['calls']} call(s), {_secs(p['ms'])}")
    if run["complete"]:
        lines.append(f"  total {_secs(run['total_ms'])}; peak VRAM {_gib(run['peak_vram_bytes'])} GiB (with the CUDA "
                     f"context); {'fits' if run['fits'] else 'does NOT fit with the presets chosen'}")
    else:
        lines.append(f"  INCOMPLETE: {sum(m['runs'] and not m['found'] for m in d['models'])} model file(s) not found "
                     f"or not read; "
                     f"what was costed takes {_secs(run['total_ms'])}, peak VRAM {_gib(run['peak_vram_bytes'])} GiB")
    ram = d["ram"]
    lines.append(f"host RAM: {_gib(ram['needed_bytes'])} GiB for everything loaded at once, {_gib(ram['free_bytes'])} "
                 f"GiB free" + (f"; {_gib(ram['disk_bytes'])} GiB to the disk tier" if ram["disk_bytes"] else "")
                 + (f"; {_gib(ram['short_bytes'])} GiB short" if ram["short_bytes"] else ""))
    lines += download_lines(d.get("downloads") or [])
    lines += [f"note: {n}" for n in d["notes"]]
    g = d.get("graph") or {}
    if g.get("read_whole"):
        lines.append(f"workflow read whole ({g['form']} JSON): {g['files']} model file(s) named, {g['files_loaded']} "
                     f"loaded by this run, {g['samplers']} sampler(s)")
    elif g:
        lines += [f"workflow NOT read whole: {u}" for u in g.get("unread") or []]
    return "\n".join(lines)


def download_lines(downloads: list[dict[str, Any]]) -> list[str]:
    """What a download would bring, beside the plan: each missing file's size from its header, or why not read."""
    read = [d for d in downloads if d.get("bytes") is not None]
    if not downloads or not (read or any(d.get("error") for d in downloads)):
        return []
    lines = [f"to download (sizes from the headers; nothing else was downloaded): {len(read)} file(s), "
             f"{download_size(sum(d['bytes'] for d in read))}"]
    for d in downloads:
        if d.get("bytes") is not None:
            lines.append(f"  {d['name']}: {download_size(d['bytes'])} ({d['url']}; header from "
                         f"{'the cache' if d['source'] == 'cache' else 'the network'})")
        elif d.get("error"):
            lines.append(f"  {d['name']}: header not read ({d['error_kind']}): {d['error']}")
    return lines


def add_workflow_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags only a workflow takes: reading missing models' headers from the links the workflow carries."""
    parser.add_argument("--fetch-headers", action="store_true",
                        help="workflows: read each missing model's header from the download link the workflow names "
                             "(HTTP range requests: the header only, never the weights; kept in --header-cache) and "
                             "plan it as if it were on disk; prints what the download would be")
    parser.add_argument("--header-timeout", type=float, default=TIMEOUT_S,
                        help=f"seconds to wait for any byte of a header (default {TIMEOUT_S:g})")
    parser.add_argument("--header-cache", default=None,
                        help=f"the folder headers read from URLs are kept in (default {default_dir()})")


def run(args: argparse.Namespace, card: Any, ram: int | None, out: Callable[[str], None] = print) -> int:
    """Plan the workflow file `args.model` and print the table (or JSON)."""
    path = Path(args.model)
    graph = read_workflow(path)
    roots = [Path(d).expanduser() for d in (args.models_dir or [])] or [path.parent / "models", Path("models")]
    presets = [p.strip() for p in args.presets.split(",") if p.strip()] if args.presets else None
    fetch = bool(getattr(args, "fetch_headers", False))
    timeout = getattr(args, "header_timeout", TIMEOUT_S)
    if not 0 < timeout <= 600:
        raise ValueError(f"--header-timeout must be more than 0 and at most 600 seconds, got {timeout:g}")
    remote = RemoteHeaders(workflow_links(graph), "fetch" if fetch else "links",
                           HeaderCache(getattr(args, "header_cache", None)), timeout=timeout)
    plan = plan_workflow(graph, models_dir_finder(roots), card, ram, presets=presets, remote=remote)
    linked = [m for m in plan.models if m.runs and not m.found and m.url]
    if linked and not fetch:
        plan.notes.append(f"{len(linked)} missing model(s) have a download link in the workflow: --fetch-headers "
                          f"plans them from their headers (a few kB each, read by range requests)")
    if any(m.runs and not m.found for m in plan.models):
        plan.notes.append(f"model files were looked for under {', '.join(str(r) for r in roots)} (ComfyUI's layout); "
                          f"pass --models-dir with your ComfyUI models folder")
    if args.json:
        out(json.dumps(plan.to_dict(), indent=1))
    else:
        out(format_plan(plan))
    return 0
