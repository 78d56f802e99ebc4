"""What the "Offload this workflow" tests share: ComfyUI's own templates (the pinned `comfyui-workflow-templates-json`
package), the tiny models under the file names the Wan templates load, and the API prompt of a template made
runnable on the CPU with them (text encodes replaced by the stand-in conditioning, a 64x64 single-frame latent, two
steps, every switch on so the LoRAs run, a latent hash on the last sampler, nothing else).
"""
from __future__ import annotations

import copy
import glob
import hashlib
import importlib.util
import json
import os
from typing import Any, Dict, List, Optional

import comfy_server as cs
import tiny_wan

PINNED = "comfyui-workflow-templates-json==0.1.123"
# the files the Wan templates name, as tiny Wan 2.1-shaped models (different weights each) and tiny LoRAs
WAN_MODELS = {"wan2.1_t2v_1.3B_fp16.safetensors": 0, "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": 1,
              "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": 2}
WAN_LORAS = {"wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors": 3,
             "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors": 4}
TEMPLATES = ("text_to_video_wan", "video_wan2_2_14B_t2v")
LATENTS = ("EmptyHunyuanLatentVideo", "EmptyLatentImage", "EmptySD3LatentImage", "Wan22ImageToVideoLatent")
TEXT_ENCODES = ("CLIPTextEncode",)
VIRTUAL = ("Note", "MarkdownNote", "PrimitiveNode", "Reroute")


def templates_dir() -> Optional[str]:
    """The templates folder of the package: this python's, else the repository's .venv (`make env` installs the
    pinned test extras there; a ComfyUI venv need not have them)."""
    spec = importlib.util.find_spec("comfyui_workflow_templates_json")
    if spec is not None and spec.origin:
        return os.path.join(os.path.dirname(spec.origin), "templates")
    found = glob.glob(os.path.join(cs.REPO_ROOT, ".venv", "lib", "python3*", "site-packages",
                                   "comfyui_workflow_templates_json", "templates"))
    return found[0] if found else None


def template(name: str) -> Optional[Dict[str, Any]]:
    folder = templates_dir()
    path = os.path.join(folder, name + ".json") if folder else None
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_models(paths: Dict[str, str]) -> None:
    """The tiny models under the templates' names in a server's model folders (`cs.prepare_base_dir`'s paths)."""
    for name, seed in WAN_MODELS.items():
        tiny_wan.write_wan(os.path.join(paths["diffusion_models"], name), seed=seed)
    for name, seed in WAN_LORAS.items():
        tiny_wan.write_lora(os.path.join(paths["loras"], name), seed=seed)


def node_types(wf: Dict[str, Any]) -> List[str]:
    """Every node type a UI workflow uses (subgraph instances and frontend-only nodes left out)."""
    subs = (wf.get("definitions") or {}).get("subgraphs") or []
    ids = {s["id"] for s in subs}
    return sorted({n["type"] for g in [wf, *subs] for n in g["nodes"] if n["type"] not in ids | set(VIRTUAL)})


def _seed(nid: str) -> int:
    return int(hashlib.sha256(nid.encode()).hexdigest()[:6], 16)


def _ancestors(api: Dict[str, Any], start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        nid = todo.pop()
        if nid in seen or nid not in api:
            continue
        seen.add(nid)
        for value in api[nid]["inputs"].values():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
                todo.append(value[0])
    return seen


def runnable(api: Dict[str, Any]) -> Dict[str, Any]:
    """The API prompt of a Wan template made to run on the CPU with the tiny models (see the module doc)."""
    api = copy.deepcopy(api)
    for nid, node in list(api.items()):
        kind, ins = node["class_type"], node["inputs"]
        if kind in TEXT_ENCODES:
            api[nid] = {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": _seed(nid)}}
        elif kind in LATENTS:
            ins.update({k: v for k, v in (("width", 64), ("height", 64), ("length", 1), ("batch_size", 1))
                        if k in ins})
        elif kind == "PrimitiveBoolean":
            ins["value"] = True  # the templates' switches (the lightning LoRAs on)
        elif kind == "KSampler":
            ins["steps"] = 2
        elif kind == "KSamplerAdvanced":
            ins["steps"] = 2
            start, end = ins.get("start_at_step"), ins.get("end_at_step")
            ins["start_at_step"] = 1 if isinstance(start, list) or (isinstance(start, int) and start > 0) else 0
            ins["end_at_step"] = 1 if isinstance(end, list) or (isinstance(end, int) and end < 1000) else 10000
    decode = next(nid for nid, n in api.items() if n["class_type"] in ("VAEDecode", "VAEDecodeTiled"))
    api["lo_hash"] = {"class_type": "LOTestLatentHash", "inputs": {"samples": list(api[decode]["inputs"]["samples"])}}
    keep = _ancestors(api, "lo_hash")
    return {k: v for k, v in api.items() if k in keep}


def run_hash(server: Any, api: Dict[str, Any]) -> str:
    """The latent hash of the last sampler of a runnable prompt."""
    entry = server.run_prompt(api, timeout=300)
    return cs.ui_texts(entry, "lo_hash")[0].split()[0]
