"""A ComfyUI workflow read for planning: API JSON as is, UI JSON converted to API form (links followed, widget values
named by each node type's widget order), then what the plan needs found in it: the loaders and their files, each
sampler's steps / CFG / the model and LoRAs it runs / its latent's size and frames, the text encodes per text
encoder, the VAE decodes (tiled or not) and the TTS generations.

Only node types whose inputs are known here are read (ComfyUI's core loaders, samplers and empty latents, the pack's
loaders, ComfyUI-GGUF's loaders); any other node is passed through when tracing a model, clip, vae or latent input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# node type -> its widget names in the order UI JSON stores `widgets_values` ("control_after_generate" is the UI-only
# value after a seed). From ComfyUI's nodes.py / comfy_extras (INPUT_TYPES order), ComfyUI-GGUF's nodes.py and
# this pack's nodes/.
WIDGETS: dict[str, tuple[str, ...]] = {
    "KSampler": ("seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "denoise"),
    "KSamplerAdvanced": ("add_noise", "noise_seed", "control_after_generate", "steps", "cfg", "sampler_name",
                         "scheduler", "start_at_step", "end_at_step", "return_with_leftover_noise"),
    "SamplerCustom": ("add_noise", "noise_seed", "control_after_generate", "cfg"),
    "BasicScheduler": ("scheduler", "steps", "denoise"),
    "CFGGuider": ("cfg",),
    "UNETLoader": ("unet_name", "weight_dtype"),
    "UnetLoaderGGUF": ("unet_name",),
    "UnetLoaderGGUFAdvanced": ("unet_name", "dequant_dtype", "patch_dtype", "patch_on_device"),
    "CheckpointLoaderSimple": ("ckpt_name",),
    "CLIPLoader": ("clip_name", "type", "device"),
    "DualCLIPLoader": ("clip_name1", "clip_name2", "type", "device"),
    "TripleCLIPLoader": ("clip_name1", "clip_name2", "clip_name3"),
    "QuadrupleCLIPLoader": ("clip_name1", "clip_name2", "clip_name3", "clip_name4"),
    "CLIPLoaderGGUF": ("clip_name", "type"),
    "DualCLIPLoaderGGUF": ("clip_name1", "clip_name2", "type"),
    "TripleCLIPLoaderGGUF": ("clip_name1", "clip_name2", "clip_name3"),
    "QuadrupleCLIPLoaderGGUF": ("clip_name1", "clip_name2", "clip_name3", "clip_name4"),
    "VAELoader": ("vae_name",),
    "LoraLoader": ("lora_name", "strength_model", "strength_clip"),
    "LoraLoaderModelOnly": ("lora_name", "strength_model"),
    "OffloadDiffusionModelLoader": ("unet_name", "weight_dtype", "preset", "priority", "devices"),
    "OffloadCheckpointLoader": ("ckpt_name", "preset", "priority", "devices"),
    "OffloadModel": ("preset", "priority", "devices"),
    "OffloadCLIP": ("preset", "priority", "devices"),
    "OffloadTTSLoader": ("model_name", "preset", "priority", "dtype", "kv_offload"),
    "OffloadTTSGenerate": ("text", "seed", "control_after_generate", "cfg_scale", "diffusion_steps",
                           "max_new_tokens", "voice_text", "temperature", "top_k", "top_p"),
    "OffloadVramBudget": ("budget_gb", "mode", "per_device"),
    "EmptyLatentImage": ("width", "height", "batch_size"),
    "EmptySD3LatentImage": ("width", "height", "batch_size"),
    "EmptyFlux2LatentImage": ("width", "height", "batch_size"),
    "EmptyHunyuanImageLatent": ("width", "height", "batch_size"),
    "EmptyHunyuanLatentVideo": ("width", "height", "length", "batch_size"),
    "EmptyHunyuanVideo15Latent": ("width", "height", "length", "batch_size"),
    "EmptyLTXVLatentVideo": ("width", "height", "length", "batch_size"),
    "EmptyMochiLatentVideo": ("width", "height", "length", "batch_size"),
    "EmptyCosmosLatentVideo": ("width", "height", "length", "batch_size"),
    "Wan22ImageToVideoLatent": ("width", "height", "length", "batch_size"),
    "WanImageToVideo": ("width", "height", "length", "batch_size"),
    "WanFirstLastFrameToVideo": ("width", "height", "length", "batch_size"),
    "HunyuanImageToVideo": ("width", "height", "length", "batch_size"),
    "LTXVImgToVideo": ("width", "height", "length", "batch_size", "strength"),
    "VAEDecodeTiled": ("tile_size", "overlap", "temporal_size", "temporal_overlap"),
    "ModelSamplingSD3": ("shift",),
    "CLIPTextEncode": ("text",),
}

# loader type -> (the widget holding its file, the folder kind `find_file` is asked, what it loads)
LOADERS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "UNETLoader": (("unet_name", "diffusion_models", "diffusion"),),
    "OffloadDiffusionModelLoader": (("unet_name", "diffusion_models", "diffusion"),),
    "UnetLoaderGGUF": (("unet_name", "unet_gguf", "diffusion"),),
    "UnetLoaderGGUFAdvanced": (("unet_name", "unet_gguf", "diffusion"),),
    "CheckpointLoaderSimple": (("ckpt_name", "checkpoints", "checkpoint"),),
    "OffloadCheckpointLoader": (("ckpt_name", "checkpoints", "checkpoint"),),
    "VAELoader": (("vae_name", "vae", "vae"),),
    "LoraLoader": (("lora_name", "loras", "lora"),),
    "LoraLoaderModelOnly": (("lora_name", "loras", "lora"),),
    "OffloadTTSLoader": (("model_name", "tts", "tts"),),
}
for _t in ("CLIPLoader", "CLIPLoaderGGUF"):
    LOADERS[_t] = (("clip_name", "text_encoders", "text_encoder"),)
for _t, _n in (("DualCLIPLoader", 2), ("TripleCLIPLoader", 3), ("QuadrupleCLIPLoader", 4), ("DualCLIPLoaderGGUF", 2),
               ("TripleCLIPLoaderGGUF", 3), ("QuadrupleCLIPLoaderGGUF", 4)):
    LOADERS[_t] = tuple((f"clip_name{i}", "text_encoders", "text_encoder") for i in range(1, _n + 1))

SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")
TEXT_ENCODES = ("CLIPTextEncode", "CLIPTextEncodeFlux", "CLIPTextEncodeSD3", "CLIPTextEncodeSDXL",
                "TextEncodeQwenImageEdit", "TextEncodeQwenImageEditPlus", "CLIPTextEncodeHunyuanDiT",
                "TextEncodeHunyuanVideo_ImageToVideo", "CLIPTextEncodeLumina2")
VAE_DECODES = ("VAEDecode", "VAEDecodeTiled", "VAEDecodeHunyuan3D")
_MUTED = (2, 4)  # UI node modes: never, bypass


class WorkflowError(ValueError):
    """A graph the plan cannot read: says what is wrong with it."""


@dataclass
class LoaderRef:
    node: str
    class_type: str
    role: str  # diffusion | checkpoint | text_encoder | vae | lora | tts
    folder: str  # the folder kind `find_file` is asked
    name: str
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplerRef:
    node: str
    class_type: str
    steps: int  # steps this sampler runs (end - start for KSamplerAdvanced)
    total_steps: int
    cfg: float
    model_loader: str | None  # node id of the diffusion / checkpoint loader its model comes from
    loras: list[str]  # node ids of LoRA loaders on its model path
    path: list[str] = field(default_factory=list)  # node ids from the sampler to its model loader
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    batch: int = 1
    denoise: float = 1.0


@dataclass
class GraphFacts:
    """What a workflow runs, as the plan needs it."""

    loaders: dict[str, LoaderRef]
    samplers: list[SamplerRef]
    text_encodes: dict[str, int]  # clip loader node -> prompts encoded with it
    decodes: list[dict[str, Any]]  # {"vae": loader node, "tiled": bool, "tile": px, "temporal": frames}
    tts: list[dict[str, Any]]  # {"loader": node, "max_new_tokens": n, "diffusion_steps": n, "cfg": x}
    notes: list[str] = field(default_factory=list)


def to_api(graph: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """API form {id: {"class_type", "inputs"}} of an API or UI (`nodes` + `links`) workflow, or {"prompt": api}."""
    if not isinstance(graph, dict):
        raise WorkflowError(f"a workflow is a JSON object, got {type(graph).__name__}")
    if isinstance(graph.get("prompt"), dict):
        graph = graph["prompt"]
    if isinstance(graph.get("nodes"), list):
        return _ui_to_api(graph)
    api = {str(k): v for k, v in graph.items() if isinstance(v, dict) and "class_type" in v}
    if not api:
        raise WorkflowError("neither ComfyUI API JSON (nodes with class_type) nor UI JSON (a nodes list)")
    return api


def _ui_to_api(graph: dict[str, Any]) -> dict[str, dict[str, Any]]:
    links: dict[Any, tuple[str, int]] = {}
    for link in graph.get("links") or []:
        if isinstance(link, list) and len(link) >= 5:
            links[link[0]] = (str(link[1]), int(link[2]))
        elif isinstance(link, dict) and "id" in link:
            links[link["id"]] = (str(link.get("origin_id")), int(link.get("origin_slot", 0)))
    api: dict[str, dict[str, Any]] = {}
    for node in graph["nodes"]:
        if not isinstance(node, dict) or "type" not in node:
            continue
        ctype = str(node["type"])
        inputs: dict[str, Any] = {}
        values = node.get("widgets_values")
        if isinstance(values, dict):
            inputs.update(values)
        elif isinstance(values, list):
            names = WIDGETS.get(ctype)
            if names is None:  # widgets named by the node's own inputs list, where the UI records them
                names = tuple(i["widget"]["name"] for i in node.get("inputs") or []
                              if isinstance(i, dict) and isinstance(i.get("widget"), dict))
            inputs.update({n: v for n, v in zip(names, values) if n != "control_after_generate"})
        for inp in node.get("inputs") or []:
            if isinstance(inp, dict) and inp.get("link") is not None and inp.get("link") in links:
                inputs[str(inp.get("name"))] = list(links[inp["link"]])
        api[str(node.get("id"))] = {"class_type": ctype, "inputs": inputs, "mode": node.get("mode", 0)}
    return api


def _link(value: Any) -> str | None:
    return str(value[0]) if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) else None


class _Graph:
    def __init__(self, api: dict[str, dict[str, Any]]) -> None:
        self.api = api

    def node(self, nid: str | None) -> dict[str, Any] | None:
        return self.api.get(nid) if nid is not None else None

    def trace(self, nid: str, names: tuple[str, ...], stop: Any, seen: set[str] | None = None) -> list[str]:
        """Node ids upstream of `nid` through inputs named `names` until `stop(node)`; the path, `stop`'s last."""
        seen = seen if seen is not None else set()
        path: list[str] = []
        current: str | None = nid
        while current is not None and current not in seen:
            seen.add(current)
            node = self.api.get(current)
            if node is None:
                break
            path.append(current)
            if current != nid and stop(node):
                return path
            ins = node.get("inputs", {})
            current = next((_link(ins[n]) for n in names if _link(ins.get(n))), None)
        return path


def _preset_from_path(api: dict[str, dict[str, Any]], path: list[str], loaders: dict[str, LoaderRef],
                      offload_type: str) -> None:
    """An Offload Model / Offload CLIP node between a loader and its user sets the loader's preset; a core loader
    with none is marked as loaded by ComfyUI itself (`offloaded_by_pack` False)."""
    offload = next((nid for nid in path if api[nid]["class_type"] == offload_type
                    and isinstance(api[nid]["inputs"].get("preset"), str)), None)
    for ref in loaders.values():
        if ref.node != path[-1]:
            continue
        if offload is not None and "preset" not in ref.inputs:
            ref.inputs["preset"] = api[offload]["inputs"]["preset"]
        ref.inputs.setdefault("offloaded_by_pack", offload is not None or ref.class_type.startswith("Offload"))


def _role(node: dict[str, Any]) -> str | None:
    found = LOADERS.get(node["class_type"])
    return found[0][2] if found else None


def _num(value: Any, default: float) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def read_graph(graph: dict[str, Any]) -> GraphFacts:
    """The loaders, samplers, text encodes, decodes and TTS runs of a workflow (API or UI JSON)."""
    # a muted node (mode 2) is gone; a bypassed one (mode 4) passes its inputs through: kept for tracing, never run
    api = {k: v for k, v in to_api(graph).items() if v.get("mode", 0) != 2}
    g = _Graph(api)
    loaders: dict[str, LoaderRef] = {}
    notes: list[str] = []
    definitions = graph.get("definitions") if isinstance(graph, dict) else None
    if isinstance(definitions, dict) and definitions.get("subgraphs"):
        notes.append("the workflow has subgraphs: nodes inside them are not planned (convert them to nodes first)")
    for nid, node in api.items():
        ctype = node["class_type"]
        if node.get("mode", 0) in _MUTED:
            continue
        for widget, folder, role in LOADERS.get(ctype, ()):
            name = node["inputs"].get(widget)
            if isinstance(name, str) and name:
                key = nid if len(LOADERS[ctype]) == 1 else f"{nid}:{widget}"
                loaders[key] = LoaderRef(nid, ctype, role, folder, name, dict(node["inputs"]))
    is_model_loader = lambda n: _role(n) in ("diffusion", "checkpoint")  # noqa: E731
    samplers = [_sampler(g, nid, node, is_model_loader) for nid, node in api.items()
                if node["class_type"] in SAMPLERS and node.get("mode", 0) not in _MUTED]
    for s in samplers:
        if s.model_loader is not None:
            _preset_from_path(api, s.path, loaders, "OffloadModel")
    text_encodes: dict[str, int] = {}
    for nid, node in api.items():
        if node["class_type"] in TEXT_ENCODES or ("clip" in node.get("inputs", {}) and "text" in node["inputs"]):
            path = g.trace(nid, ("clip",), lambda n: _role(n) in ("text_encoder", "checkpoint"))
            if len(path) > 1 and _role(api[path[-1]]) in ("text_encoder", "checkpoint"):
                text_encodes[path[-1]] = text_encodes.get(path[-1], 0) + 1
                _preset_from_path(api, path, loaders, "OffloadCLIP")
    decodes = []
    for nid, node in api.items():
        if node["class_type"] in VAE_DECODES:
            path = g.trace(nid, ("vae",), lambda n: _role(n) in ("vae", "checkpoint"))
            ins = node["inputs"]
            found = len(path) > 1 and _role(api[path[-1]]) in ("vae", "checkpoint")
            up = g.trace(nid, ("samples", "latent", "latent_image"), lambda n: n["class_type"] in SAMPLERS)
            decodes.append({"node": nid, "vae": path[-1] if found else None,
                            "sampler": up[-1] if len(up) > 1 and api[up[-1]]["class_type"] in SAMPLERS else None,
                             "tiled": node["class_type"] == "VAEDecodeTiled",
                             "tile": int(_num(ins.get("tile_size"), 512)),
                             "temporal": int(_num(ins.get("temporal_size"), 64))})
    tts = [{"node": nid, "loader": _link(node["inputs"].get("tts_model")),
            "max_new_tokens": int(_num(node["inputs"].get("max_new_tokens"), 1024)),
            "diffusion_steps": int(_num(node["inputs"].get("diffusion_steps"), 10)),
            "cfg": _num(node["inputs"].get("cfg_scale"), 1.0)}
           for nid, node in api.items() if node["class_type"] == "OffloadTTSGenerate"]
    if not samplers and not tts:
        notes.append("no sampler (KSampler, KSamplerAdvanced, SamplerCustom[Advanced]) or TTS generate node found: "
                     "the models are planned, the run is not")
    return GraphFacts(loaders, samplers, text_encodes, decodes, tts, notes)


def _sampler(g: _Graph, nid: str, node: dict[str, Any], is_model_loader: Any) -> SamplerRef:
    ins = dict(node["inputs"])
    model_from = nid
    if node["class_type"] == "SamplerCustomAdvanced":  # steps in the scheduler (sigmas), CFG in the guider
        guider = g.node(_link(ins.get("guider")))
        sched = g.node(_link(ins.get("sigmas")))
        if guider is not None:
            ins["cfg"] = guider["inputs"].get("cfg", 1.0)
            model_from = _link(ins.get("guider")) or nid
        if sched is not None:
            ins["steps"] = sched["inputs"].get("steps", 20)
            ins["denoise"] = sched["inputs"].get("denoise", 1.0)
    elif node["class_type"] == "SamplerCustom":
        sched = g.node(_link(ins.get("sigmas")))
        ins["steps"] = sched["inputs"].get("steps", 20) if sched is not None else 20
    total = int(_num(ins.get("steps"), 20))
    steps = total
    if node["class_type"] == "KSamplerAdvanced":
        start = int(_num(ins.get("start_at_step"), 0))
        end = min(int(_num(ins.get("end_at_step"), total)), total)
        steps = max(0, end - start)
    path = g.trace(model_from, ("model",), is_model_loader)
    loader = path[-1] if len(path) > 1 and is_model_loader(g.api[path[-1]]) else None
    loras = [p for p in reversed(path) if _role(g.api[p]) == "lora"  # in the order they apply; bypassed ones not
             and g.api[p].get("mode", 0) not in _MUTED]
    ref = SamplerRef(nid, node["class_type"], steps, total, _num(ins.get("cfg"), 1.0), loader, loras, path,
                     denoise=_num(ins.get("denoise"), 1.0))
    lat = g.trace(nid, ("latent_image", "samples", "latent", "latent_image"),
                  lambda n: "width" in n.get("inputs", {}) and "height" in n["inputs"])
    src = g.node(lat[-1]) if len(lat) > 1 else None
    if src is not None and "width" in src["inputs"]:
        si = src["inputs"]
        ref.width, ref.height = int(_num(si.get("width"), 0)) or None, int(_num(si.get("height"), 0)) or None
        ref.frames = int(_num(si["length"], 1)) if "length" in si else None
        ref.batch = max(1, int(_num(si.get("batch_size"), 1)))
    return ref
