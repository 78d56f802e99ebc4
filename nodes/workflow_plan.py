"""The workflow plan in ComfyUI: the graph on the canvas planned before it is queued (the panel's POST
/layer_offload/plan), on the card ComfyUI runs on (or one named in the panel) against the machine's free RAM.

`offload.predict.plan_workflow` does the planning and reads file headers only: nothing loads. This module gives it
what only ComfyUI knows: where a loader's file is (`find_file`, over `folder_paths`), which card this process runs
on (`this_card`) and the RAM free now (psutil). `plan_graph` is the route's work; bad input is a `PlanRequestError`
(one line, HTTP 400).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

log = logging.getLogger("layer_offload")

GIB = 1 << 30
# a loader's folder kind (offload.predict's names) -> the ComfyUI folder names that may hold it, first match wins
FOLDERS: Dict[str, Tuple[str, ...]] = {
    "diffusion_models": ("diffusion_models", "unet"),
    "checkpoints": ("checkpoints",),
    "text_encoders": ("text_encoders", "clip"),
    "clip": ("text_encoders", "clip"),
    "vae": ("vae",),
    "loras": ("loras",),
    "unet_gguf": ("unet_gguf", "diffusion_models", "unet"),  # ComfyUI-GGUF's folder, else where .gguf files lie
    "clip_gguf": ("clip_gguf", "text_encoders", "clip"),
}
TTS_FOLDER = "tts"
MAX_NODES = 5000  # a canvas larger than this is not a workflow a person made


class PlanRequestError(ValueError):
    """A plan request the panel must be told about (HTTP 400): one line naming what to change."""


def _folder_paths() -> Any:
    import folder_paths

    return folder_paths


def _inside(base: str, path: str) -> bool:
    base, path = os.path.realpath(base), os.path.realpath(path)
    return os.path.commonpath([base, path]) == base


def find_file(kind: str, name: str) -> Optional[str]:
    """The full path of a loader's file (a folder for `tts`), or None when no model folder of that kind holds it.
    Never a path outside ComfyUI's model folders (a name like '../x' finds nothing)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    fp = _folder_paths()
    for folder in (TTS_FOLDER,) if kind == TTS_FOLDER else FOLDERS.get(kind, (kind,)):
        try:
            bases = list(fp.get_folder_paths(folder))
        except (KeyError, AttributeError, TypeError):
            continue  # a folder name this ComfyUI does not know (unet_gguf without ComfyUI-GGUF)
        for base in bases:
            path = os.path.join(base, name)
            found = os.path.isdir(path) if kind == TTS_FOLDER else os.path.isfile(path)
            if found and _inside(base, path):
                return path
    return None


def free_ram_bytes() -> Optional[int]:
    """The machine's available RAM now (psutil: what a new process could use without swapping), None unknown."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - a container without /proc/meminfo: plan without the RAM check
        return None


def _cards() -> Any:
    from ..offload.predict import cards

    return cards


def card_names() -> List[str]:
    """The named cards the panel offers."""
    try:
        return list(_cards().CARDS)
    except Exception:  # noqa: BLE001
        return []


SIM_SOURCE = "the simulated device (--cpu) with "  # how a sim card's `source` starts (times_note reads it)


def card_of(body: Dict[str, Any]) -> Tuple[Any, str]:
    """(the card a panel request plans on, how it was chosen): the card named in the request, or this device's."""
    chosen = body.get("card")
    if chosen is not None and not isinstance(chosen, str):
        raise PlanRequestError("card must be a card's name, got {!r}".format(chosen))
    if chosen and chosen.strip():
        try:
            card = _cards().get_card(chosen)
        except ValueError as e:
            raise PlanRequestError(str(e)) from None
        return card, "{} (chosen in the panel)".format(card.name)
    return this_card()


def this_card() -> Tuple[Any, str]:
    """(the card to plan on, how it was chosen): the named card matching ComfyUI's CUDA device; the same card with
    this device's memory when the name is not in the table; under --cpu the simulated device's capacity on a
    reference card's speeds (the figures then say nothing of a real GPU, and the note says so)."""
    import dataclasses

    from .common import engine_device

    cards = _cards()
    device = engine_device()
    if device is not None and device.startswith("cuda"):
        import torch

        from ..offload import device_memory

        index = torch.device(device).index
        name = torch.cuda.get_device_name(index if index is not None else torch.cuda.current_device())
        total = int(device_memory(device)[1])
        try:
            card = cards.get_card(name)
            return card, "{} ({}, this process's device)".format(card.name, name)
        except ValueError:
            ref = _nearest_by_memory(cards, total)
            card = dataclasses.replace(ref, name=name, vram_bytes=total,
                                       source="{} with {:.1f} GiB: its speeds are {}'s".format(name, total / GIB,
                                                                                                 ref.name))
            return card, "{} is not in the cards table: its {:.1f} GiB with {}'s speeds; choose a card in the " \
                         "panel for other speeds".format(name, total / GIB, ref.name)
    from ..offload import device_memory

    total = int(device_memory("sim")[1])
    ref = _nearest_by_memory(cards, total)
    card = dataclasses.replace(ref, name="sim ({:.2f} GiB)".format(total / GIB), vram_bytes=total,
                               source="{}{}'s speeds".format(SIM_SOURCE, ref.name))
    return card, "simulated device (--cpu): {:.2f} GiB with {}'s speeds; choose a card in the panel to plan for " \
                 "a GPU".format(total / GIB, ref.name)


def _nearest_by_memory(cards: Any, total: int) -> Any:
    """The table's card whose memory is nearest to `total` (the smaller one on a tie)."""
    table = list(cards.CARDS.values())
    return min(table, key=lambda c: (abs(c.vram_bytes - total), c.vram_bytes))


def _graph_of(body: Dict[str, Any]) -> Dict[str, Any]:
    """The graph a plan request carries: 'prompt' (API form) or 'workflow' (UI form)."""
    graph = body.get("prompt", body.get("workflow"))
    if graph is None:
        raise PlanRequestError("give the graph as 'prompt' (API form) or 'workflow' (UI form)")
    if not isinstance(graph, dict):
        raise PlanRequestError("the graph must be a JSON object, got {}".format(type(graph).__name__))
    size = len(graph.get("nodes") or []) if isinstance(graph.get("nodes"), list) else len(graph)
    if size > MAX_NODES:
        raise PlanRequestError("the graph has {} nodes; at most {} are planned".format(size, MAX_NODES))
    return graph


def node_defs() -> Any:
    """This ComfyUI's node definitions (NODE_CLASS_MAPPINGS, every pack loaded), asked per node type as a workflow
    needs them, for reading the graph as this server will run it; None when the engine cannot take them."""
    import sys

    try:
        from ..offload.predict import NodeDefs
    except ImportError:
        return None
    comfy_nodes = sys.modules.get("nodes")  # ComfyUI's nodes.py, imported before any pack
    classes = getattr(comfy_nodes, "NODE_CLASS_MAPPINGS", None)
    if not isinstance(classes, dict):
        from .common import log_once

        log_once("workflow-plan:node-defs", "Layer Offload: ComfyUI's NODE_CLASS_MAPPINGS not found: workflows are "
                 "read with the node definitions shipped with the pack")
        return None
    return NodeDefs.from_input_types(classes)


def _planner() -> Callable[..., Any]:
    try:
        from ..offload.predict import plan_workflow
    except ImportError:
        raise PlanRequestError("this version of the engine cannot plan a workflow (offload.predict.plan_workflow "
                               "is missing)") from None
    return plan_workflow


def plan_graph(body: Any) -> Dict[str, Any]:
    """The plan of a graph sent by the panel: {"plan", "card", "card_note", "ram_bytes", "cards"}. With
    "fetch_headers": true, missing models the workflow links are planned from their headers (nodes/plan_headers.py).
    PlanRequestError (HTTP 400) names what to change; nothing is loaded whatever happens."""
    if not isinstance(body, dict):
        raise PlanRequestError("the request body must be a JSON object")
    graph = _graph_of(body)
    card, note = card_of(body)
    plan_workflow = _planner()
    ram = free_ram_bytes()
    from .plan_headers import HeaderRequestError, remote_for

    try:
        remote = remote_for(body, graph, MAX_NODES)  # the workflow's download links; headers where asked
    except HeaderRequestError as e:
        raise PlanRequestError(str(e)) from None
    try:
        plan = plan_workflow(graph, find_file, card=card, ram_bytes=ram, defs=node_defs(), remote=remote)
    except (ValueError, KeyError, TypeError) as e:  # a graph the planner cannot read: its message, one line
        raise PlanRequestError(_one_line(e)) from None
    return {"plan": plan.to_dict(), "card": card.name, "card_note": note, "ram_bytes": ram, "cards": card_names()}


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]


# ------------------------------------------------------------------------------------------- plan beside measured
_last: Dict[str, Any] = {}  # the plan of the prompt the Offload Report node ran in: {"key", "plan", "card_note"}


def plan_for_prompt(prompt: Any) -> Optional[Dict[str, Any]]:
    """The plan of the prompt being run (the Offload Report node's hidden PROMPT), on this process's card, kept for
    the report (`workflow_check`); planned once per prompt. None when it cannot be planned (logged once)."""
    import hashlib
    import json

    if not isinstance(prompt, dict) or not prompt:
        return _last.get("plan")
    try:
        key = hashlib.sha256(json.dumps(prompt, sort_keys=True, default=str).encode()).hexdigest()
    except (TypeError, ValueError):
        return None
    if _last.get("key") == key:
        return _last["plan"]
    try:
        answer = plan_graph({"prompt": prompt})
    except Exception as e:  # noqa: BLE001 - the report still shows what was measured
        from .common import log_once

        log_once("workflow-plan:" + _one_line(e), "Layer Offload: the workflow could not be planned for the report: "
                 "%s", _one_line(e))
        return None
    _last.update(key=key, plan=answer["plan"], card_note=answer["card_note"])
    return answer["plan"]


def _off_by(measured: Optional[float], planned: Optional[float]) -> Optional[float]:
    if measured is None or not planned:
        return None
    return measured / planned - 1.0


def _pair(planned: Any, measured: Any) -> Dict[str, Any]:
    p = float(planned) if isinstance(planned, (int, float)) and not isinstance(planned, bool) else None
    m = float(measured) if isinstance(measured, (int, float)) and not isinstance(measured, bool) else None
    return {"planned": p, "measured": m, "off_by": _off_by(m, p)}


def _match(plan_models: List[Dict[str, Any]], measured: List[Dict[str, Any]]) -> List[Tuple[Dict, Dict]]:
    """(plan model, reported model) pairs: by file name (the Offload Loaders name models by their file; a
    checkpoint's text encoder is '<file>:clip'), then one unmatched diffusion model with one unmatched 'model'."""
    pairs, used = [], set()
    for m in measured:
        for p in plan_models:
            if id(p) in used or not p.get("found") or not p.get("name"):
                continue
            role_ok = p.get("role") != "text_encoder" or m.get("kind") == "clip"
            if role_ok and (m["name"] == p["name"] or (m["name"].startswith(p["name"] + ":") and
                                                       p.get("role") == "text_encoder")):
                pairs.append((p, m))
                used.add(id(p))
                break
    matched = {id(m) for _, m in pairs}
    free_p = [p for p in plan_models if id(p) not in used and p.get("found") and p.get("role") == "diffusion"]
    free_m = [m for m in measured if id(m) not in matched and m.get("kind") == "model"]
    if len(free_p) == 1 and len(free_m) == 1:
        pairs.append((free_p[0], free_m[0]))
    return pairs


def workflow_check(plan: Optional[Dict[str, Any]], models: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The plan's figures beside the measured ones for the whole workflow and per offloaded model it names: time
    (the plan's calls x time per call against the measured forwards x step time), peak VRAM, host RAM and disk.
    Only what the engine measured is compared: phases of models left to ComfyUI (a plain VAE decode) are listed as
    planned only (`unmeasured_ms`)."""
    if not plan:
        return None
    phases = (plan.get("run") or {}).get("phases") or []
    rows, planned_ms, measured_ms = [], 0.0, 0.0
    measured_keys = set()
    for p, m in _match(plan.get("models") or [], models):
        key = p.get("key")
        p_ms = sum(float(ph["ms"]) for ph in phases if ph.get("model") == key and ph.get("ms") is not None)
        step = m.get("step_ms")
        m_ms = float(step) * int(m.get("forwards") or 0) if step is not None else None
        host = m.get("host") or {}
        rows.append({"name": m["name"], "plan_key": key, "role": p.get("role"), "preset": p.get("preset"),
                     "calls": _pair(p.get("calls"), m.get("forwards")),
                     "ms_per_call": _pair(p.get("ms_per_call"), step),
                     "time_ms": _pair(p_ms if p_ms else None, m_ms),
                     "vram_bytes": _pair(p.get("vram_bytes"), m.get("peak_device_bytes")),
                     "host_bytes": _pair(p.get("host_bytes"), host.get("ram")),
                     "disk_bytes": _pair(p.get("disk_bytes"), host.get("disk"))})
        if p_ms and m_ms is not None:
            planned_ms += p_ms
            measured_ms += m_ms
            measured_keys.add(key)
    run, ram = plan.get("run") or {}, plan.get("ram") or {}

    def total(field: str, side: str, combine: Callable[[List[float]], float] = sum) -> Optional[float]:
        values = [r[field][side] for r in rows if r[field][side] is not None]
        return combine(values) if values else None

    return {
        "card": (plan.get("card") or {}).get("name"),
        "card_note": _last.get("card_note"),
        # under --cpu the plan's card is the simulated device's memory with a table card's speeds while the CPU
        # computes: its times are not this run's to compare (the memory figures are)
        "times_note": times_note(plan),
        # the offloaded models the plan names, together: what both sides know
        "time_ms": _pair(planned_ms if measured_keys else None, measured_ms if measured_keys else None),
        "peak_vram_bytes": _pair(total("vram_bytes", "planned", max), total("vram_bytes", "measured", max)),
        "host_bytes": _pair(total("host_bytes", "planned"), total("host_bytes", "measured")),
        "disk_bytes": _pair(total("disk_bytes", "planned"), total("disk_bytes", "measured")),
        # the whole run as planned (text encodes, sampling, decodes of every model, offloaded or not)
        "run": {"total_ms": run.get("total_ms"), "peak_vram_bytes": run.get("peak_vram_bytes"),
                "fits": run.get("fits"), "ram_needed_bytes": ram.get("needed_bytes"),
                "ram_free_bytes": ram.get("free_bytes"), "disk_bytes": ram.get("disk_bytes"),
                "unmeasured_ms": sum(float(ph["ms"]) for ph in phases if ph.get("ms") is not None and
                                     ph.get("model") not in measured_keys)},
        "models": rows,
    }


def times_note(plan: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why the plan's times cannot be set beside the measured ones, or None when they can: a plan for the simulated
    device (--cpu) prices its compute at a table card's speeds, and the CPU computes."""
    source = str(((plan or {}).get("card") or {}).get("source") or "")
    if not source.startswith(SIM_SOURCE):
        return None
    return "the simulated device computes on the CPU; the plan's times are {}'s".format(source[len(SIM_SOURCE):]
                                                                                        .split("'s speeds")[0])


def last_plan() -> Optional[Dict[str, Any]]:
    """The plan the last Offload Report node made (None before one ran)."""
    return _last.get("plan")
