"""What a ComfyUI workflow runs, as the plan needs it: every model file it loads (and those it names but does not
run: a muted or bypassed loader, a LoRA behind a switch that is off), each sampler's steps / CFG / the model and
LoRAs it runs / its latent's size and frames, the text encodes per text encoder, the VAE decodes and the TTS runs.

The graph is read as ComfyUI runs it (`workflow_read.flatten`: subgraphs, reroutes, primitives, muted and bypassed
nodes) and its value nodes evaluated (`workflow_values.Values`: primitives, switches, math); `GraphFacts.unread`
says what could not be read whole (a loader whose file name is computed at run time, a sampler whose model could
not be traced).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .comfy_nodes import DIRECTORY_KINDS, LOADERS, NO_FILE, NodeDefs
from .model_links import ModelLink, node_links
from .workflow_flat import FlatGraph, FlatNode, WorkflowError, is_link
from .workflow_read import flatten
from .workflow_values import UNKNOWN, Values

__all__ = ["WorkflowError", "LoaderRef", "SamplerRef", "GraphFacts", "read_graph", "to_api", "LOADERS"]

SAMPLERS = ("KSampler", "KSamplerAdvanced", "SamplerCustom", "SamplerCustomAdvanced")
TEXT_ENCODES = ("CLIPTextEncode", "CLIPTextEncodeFlux", "CLIPTextEncodeSD3", "CLIPTextEncodeSDXL",
                "TextEncodeQwenImageEdit", "TextEncodeQwenImageEditPlus", "CLIPTextEncodeHunyuanDiT",
                "TextEncodeHunyuanVideo_ImageToVideo", "CLIPTextEncodeLumina2")
VAE_DECODES = ("VAEDecode", "VAEDecodeTiled", "VAEDecodeHunyuan3D")
DIRECTORY_ROLES = {"diffusion_models": "diffusion", "unet": "diffusion", "text_encoders": "text_encoder",
                   "clip": "text_encoder", "vae": "vae", "loras": "lora", "checkpoints": "checkpoint"}
LATENT_INPUTS = ("latent_image", "samples", "latent", "video_latent")


@dataclass
class LoaderRef:
    node: str
    class_type: str
    role: str  # diffusion | checkpoint | text_encoder | vae | audio_vae | lora | tts | clip_vision | controlnet ...
    folder: str  # the folder kind `find_file` is asked
    name: str
    inputs: dict[str, Any] = field(default_factory=dict)
    runs: bool = True  # False: muted, bypassed, or not needed by any output (why says which)
    why: str = ""
    url: str | None = None  # the template's download link (properties.models), where it gives one
    directory: str | None = None
    subgraph: str = ""  # the subgraphs it is inside ("Text to Video(Wan2.2)"), "" at the top level


@dataclass
class SamplerRef:
    node: str
    class_type: str
    steps: int  # steps this sampler runs (end - start for KSamplerAdvanced, a split of the sigmas)
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
    subgraph: str = ""


@dataclass
class GraphFacts:
    """What a workflow runs, as the plan needs it."""

    loaders: dict[str, LoaderRef]
    samplers: list[SamplerRef]
    text_encodes: dict[str, int]  # clip loader node -> prompts encoded with it
    decodes: list[dict[str, Any]]  # {"vae": loader node, "tiled": bool, "tile": px, "temporal": frames}
    tts: list[dict[str, Any]]  # {"loader": node, "max_new_tokens": n, "diffusion_steps": n, "cfg": x}
    notes: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)  # what keeps the graph from being read whole
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # file name -> the template's {url, directory}
    form: str = "api"
    idle_samplers: list[dict[str, Any]] = field(default_factory=list)  # {"node", "class_type", "why", "ref"}

    @property
    def complete(self) -> bool:
        return not self.unread


def to_api(graph: dict[str, Any], defs: NodeDefs | None = None) -> dict[str, dict[str, Any]]:
    """API form {id: {"class_type", "inputs"}} of an API or UI workflow, as ComfyUI's frontend would queue it."""
    return flatten(graph, defs).api()


class _Reader:
    def __init__(self, flat: FlatGraph, defs: NodeDefs) -> None:
        self.flat, self.defs = flat, defs
        self.values = Values(flat, defs)
        self.runs = self.values.reached()
        self.unread: list[str] = list(dict.fromkeys(flat.broken))
        self._branches: set[str] | None = None

    def node(self, link: Any) -> FlatNode | None:
        return self.flat.nodes.get(link[0]) if is_link(link) else None

    def upstream(self, link: Any, kind: str, stop: Callable[[FlatNode], bool]) -> list[str]:
        """Node ids from `link` upstream along inputs of type `kind` (switches taken as they go) until `stop`."""
        path: list[str] = []
        seen: set[str] = set()
        names = {"MODEL": ("model",), "CLIP": ("clip",), "VAE": ("vae",), "LATENT": LATENT_INPUTS,
                 "SIGMAS": ("sigmas",), "GUIDER": ("guider",)}.get(kind, (kind.lower(),))
        while is_link(link):
            link = self.values.route(link)
            node = self.node(link)
            if node is None or node.id in seen:
                break
            seen.add(node.id)
            path.append(node.id)
            if stop(node):
                break
            ins = node.inputs
            nxt = next((ins[n] for n in names if is_link(ins.get(n))), None)
            if nxt is None:
                nxt = next((v for n, v in ins.items() if is_link(v) and self.defs.input_type(node.class_type, n)
                            == kind), None)
            link = nxt
        return path

    def loaders(self) -> dict[str, LoaderRef]:
        found: dict[str, LoaderRef] = {}
        for nid, node in list(self.flat.nodes.items()) + list(self.flat.skipped.items()):
            declared = _declared(node)
            table = LOADERS.get(node.class_type)
            if table is None:  # a loader this reader does not know: the template names its file and folder
                table = tuple((w, DIRECTORY_KINDS.get(m.directory, m.directory),
                               DIRECTORY_ROLES.get(m.directory, m.directory))
                              for w, v in node.inputs.items() if isinstance(v, str) and (m := declared.get(v)))
            for widget, folder, role in table:
                raw = node.inputs.get(widget)
                name = self.values.value(raw)
                if name in NO_FILE:
                    continue
                if not isinstance(name, str) or not name:
                    if node.id in self.runs:
                        self.unread.append(f"{node.class_type} {self.flat.where(nid)}: its {widget} is "
                                           f"{'set when it runs' if name is UNKNOWN else 'empty'}")
                    continue
                key = nid if len(table) == 1 else f"{nid}:{widget}"
                ref = LoaderRef(nid, node.class_type, role, folder, name,
                                {k: self.values.value(v) for k, v in node.inputs.items() if not is_link(v)})
                ref.runs, ref.why = self._runs(node)
                entry = declared.get(name)
                if entry is not None:
                    ref.url, ref.directory = entry.url, entry.directory or None
                ref.subgraph = self._subgraph(node)
                found[key] = ref
        return found

    def _runs(self, node: FlatNode) -> tuple[bool, str]:
        if node.mode == 2:
            return False, "muted"
        if node.mode == 4:
            return False, "bypassed"
        if node.id not in self.runs:
            if self._branches is None:
                self._branches = self.values.reached(every_branch=True)
            if node.id in self._branches:
                return False, "a switch takes the other branch"
            return False, "no output node needs it (not connected to one)"
        return True, ""

    def _subgraph(self, node: FlatNode) -> str:
        return " > ".join(self.flat.subgraphs.get(":".join(node.path[:i + 1]), "?") for i in range(len(node.path)))

    def num(self, v: Any, default: float) -> float:
        x = self.values.number(v)
        return default if x is None else x


def _declared(node: FlatNode) -> dict[str, ModelLink]:
    """The model files a UI node's `properties.models` links (what the frontend's missing-models dialog lists),
    read as `model_links` reads every link (bounded, http(s) only)."""
    return node_links(node.properties)


def _role(node: FlatNode | None, loaders: dict[str, LoaderRef]) -> str | None:
    if node is None:
        return None
    ref = loaders.get(node.id) or next((r for k, r in loaders.items() if r.node == node.id), None)
    return ref.role if ref is not None else None


def read_graph(graph: dict[str, Any], defs: NodeDefs | None = None) -> GraphFacts:
    """The loaders, samplers, text encodes, decodes and TTS runs of a workflow (API or UI JSON)."""
    defs = defs or NodeDefs()
    flat = flatten(graph, defs)
    r = _Reader(flat, defs)
    loaders = r.loaders()
    run = [n for nid, n in flat.nodes.items() if nid in r.runs]
    is_model = lambda n: _role(n, loaders) in ("diffusion", "checkpoint")  # noqa: E731
    samplers = [_sampler(r, node, loaders, is_model) for node in run if node.class_type in SAMPLERS]
    for s in samplers:
        if s.model_loader is not None:
            _preset_from_path(flat, s.path, loaders, "OffloadModel")
        else:
            r.unread.append(f"{s.class_type} {flat.where(s.node)}: its model could not be traced to a loader")
    text_encodes: dict[str, int] = {}
    for node in run:
        if node.class_type in TEXT_ENCODES or ("clip" in node.inputs and "text" in node.inputs):
            path = r.upstream(node.inputs.get("clip"), "CLIP",
                              lambda n: _role(n, loaders) in ("text_encoder", "checkpoint"))
            if path and _role(flat.nodes[path[-1]], loaders) in ("text_encoder", "checkpoint"):
                text_encodes[path[-1]] = text_encodes.get(path[-1], 0) + 1
                _preset_from_path(flat, [node.id] + path, loaders, "OffloadCLIP")
    decodes = []
    for node in run:
        if node.class_type in VAE_DECODES:
            path = r.upstream(node.inputs.get("vae"), "VAE", lambda n: _role(n, loaders) in ("vae", "checkpoint"))
            ins = node.inputs
            found = bool(path) and _role(flat.nodes[path[-1]], loaders) in ("vae", "checkpoint")
            up = r.upstream(ins.get("samples"), "LATENT", lambda n: n.class_type in SAMPLERS)
            decodes.append({"node": node.id, "vae": path[-1] if found else None,
                            "sampler": up[-1] if up and flat.nodes[up[-1]].class_type in SAMPLERS else None,
                            "tiled": node.class_type == "VAEDecodeTiled", "tile": int(r.num(ins.get("tile_size"), 512)),
                            "temporal": int(r.num(ins.get("temporal_size"), 64))})
    tts = [{"node": n.id, "loader": n.inputs["tts_model"][0] if is_link(n.inputs.get("tts_model")) else None,
            "max_new_tokens": int(r.num(n.inputs.get("max_new_tokens"), 1024)),
            "diffusion_steps": int(r.num(n.inputs.get("diffusion_steps"), 10)),
            "cfg": r.num(n.inputs.get("cfg_scale"), 1.0)} for n in run if n.class_type == "OffloadTTSGenerate"]
    notes = list(flat.notes) + r.values.notes
    if not samplers and not tts:
        notes.append("no sampler (KSampler, KSamplerAdvanced, SamplerCustom[Advanced]) or TTS generate node runs: "
                     "the models are planned, the run is not")
    declared: dict[str, dict[str, Any]] = {}
    for node in list(flat.nodes.values()) + list(flat.skipped.values()):
        for name, m in _declared(node).items():
            declared.setdefault(name, {"url": m.url, "directory": m.directory})
    idle = []  # samplers the workflow holds but does not run: read all the same, said why
    for n in list(flat.nodes.values()) + list(flat.skipped.values()):
        if n.class_type in SAMPLERS and not r._runs(n)[0]:
            kept = len(r.unread)
            ref = _sampler(r, n, loaders, is_model)
            del r.unread[kept:]  # what it would not tell does not keep the run from being read whole
            idle.append({"node": n.id, "class_type": n.class_type, "why": r._runs(n)[1], "ref": ref})
    return GraphFacts(loaders, samplers, text_encodes, decodes, tts, notes, r.unread, declared, flat.form, idle)


def _preset_from_path(flat: FlatGraph, path: list[str], loaders: dict[str, LoaderRef], offload_type: str) -> None:
    """An Offload Model / Offload CLIP node between a loader and its user sets the loader's preset; a core loader
    with none is marked as loaded by ComfyUI itself (`offloaded_by_pack` False)."""
    offload = next((flat.nodes[nid] for nid in path if flat.nodes[nid].class_type == offload_type
                    and isinstance(flat.nodes[nid].inputs.get("preset"), str)), None)
    for ref in loaders.values():
        if ref.node != path[-1]:
            continue
        if offload is not None and "preset" not in ref.inputs:
            ref.inputs["preset"] = offload.inputs["preset"]
        ref.inputs.setdefault("offloaded_by_pack", offload is not None or ref.class_type.startswith("Offload"))


def _sigmas_steps(r: _Reader, link: Any) -> tuple[int | None, int | None, float]:
    """(steps the sigmas run, the schedule's total steps, denoise) of a SIGMAS input: a scheduler's steps, a manual
    list's length, or one part of SplitSigmas / SplitSigmasDenoise (two experts on one schedule)."""
    parts: list[tuple[str, int, float]] = []  # (split kind, output slot, its value), outermost last
    seen: set[str] = set()
    while is_link(link):
        link = r.values.route(link)
        node = r.node(link)
        if node is None or node.id in seen:
            return None, None, 1.0
        seen.add(node.id)
        ins = node.inputs
        if node.class_type in ("SplitSigmas", "SplitSigmasDenoise"):
            key = "step" if node.class_type == "SplitSigmas" else "denoise"
            parts.append((node.class_type, link[1], r.num(ins.get(key), 0 if key == "step" else 1.0)))
            link = ins.get("sigmas")
            continue
        if node.class_type == "ManualSigmas":
            text = r.values.value(ins.get("sigmas"))
            total = len([x for x in str(text).replace(",", " ").split() if x.strip()]) - 1 \
                if isinstance(text, str) else None
            denoise = 1.0
        elif "steps" in ins:
            x = r.values.number(ins.get("steps"))
            total = int(x) if x is not None else None
            denoise = r.num(ins.get("denoise"), 1.0)
        else:
            link = ins.get("sigmas")  # a node that reshapes the schedule (flip, shift, first sigma)
            continue
        if total is None:
            return None, None, denoise
        steps = total
        for kind, slot, value in reversed(parts):  # innermost split first
            if kind == "SplitSigmas":
                cut = max(0, min(int(value), steps))
                steps = cut if slot == 0 else steps - cut
            else:
                low = round(steps * value)
                steps = steps - low if slot == 0 else low
        return max(steps, 0), total, denoise
    return None, None, 1.0


def _sampler(r: _Reader, node: FlatNode, loaders: dict[str, LoaderRef], is_model: Any) -> SamplerRef:
    ins = dict(node.inputs)
    model_link = ins.get("model")
    cfg: Any = ins.get("cfg", 1.0)
    steps_total: tuple[int | None, int | None, float] | None = None
    if node.class_type == "SamplerCustomAdvanced":  # steps in the sigmas, CFG and the model in the guider
        guider = r.node(r.values.route(ins.get("guider")))
        if guider is not None:
            g = guider.inputs
            cfg = g.get("cfg", g.get("cfg_conds", g.get("video_cfg", 1.0)))
            model_link = g.get("model")
        steps_total = _sigmas_steps(r, ins.get("sigmas"))
    elif node.class_type == "SamplerCustom":
        steps_total = _sigmas_steps(r, ins.get("sigmas"))
    if steps_total is not None:
        steps, total, denoise = steps_total
        if steps is None:
            r.unread.append(f"{node.class_type} {r.flat.where(node.id)}: its steps are set when it runs")
            steps = total = 20
    else:
        total = int(r.num(ins.get("steps"), 20))
        steps, denoise = total, r.num(ins.get("denoise"), 1.0)
        if node.class_type == "KSamplerAdvanced":
            start = int(r.num(ins.get("start_at_step"), 0))
            end = min(int(r.num(ins.get("end_at_step"), total)), total)
            steps = max(0, end - start)
    path = r.upstream(model_link, "MODEL", is_model)
    loader = path[-1] if path and is_model(r.flat.nodes[path[-1]]) else None
    if loader is not None:  # a multi-file loader's key is "<node>:<widget>"; a model loader has one file
        loader = next((k for k, ref in loaders.items() if ref.node == loader), loader)
    loras = [k for p in reversed(path) for k, ref in loaders.items() if ref.node == p and ref.role == "lora"]
    ref = SamplerRef(node.id, node.class_type, int(steps), int(total or steps), r.num(cfg, 1.0), loader, loras,
                     [node.id] + path, denoise=denoise, subgraph=r._subgraph(node))
    lat = r.upstream(ins.get("latent_image"), "LATENT", lambda n: "width" in n.inputs and "height" in n.inputs)
    src = r.flat.nodes.get(lat[-1]) if lat else None
    if src is not None and "width" in src.inputs:
        si = src.inputs
        scale = 1.0  # latent upscales between the size's source and the sampler (a second, sharper stage)
        for nid in lat[:-1]:
            up = r.flat.nodes[nid]
            if up.class_type == "LatentUpscaleBy":
                scale *= r.num(up.inputs.get("scale_by"), 1.0)
            elif up.class_type == "LTXVLatentUpsampler":  # LTX's spatial upscaler models are x2 (x1.5 says so)
                model = r.upstream(up.inputs.get("upscale_model"), "LATENT_UPSCALE_MODEL", lambda n: True)
                name = str(r.flat.nodes[model[-1]].inputs.get("model_name", "")) if model else ""
                scale *= 1.5 if "x1.5" in name else 2.0
        w, h = r.values.number(si.get("width")), r.values.number(si.get("height"))
        ref.width = int(w * scale) or None if w else None
        ref.height = int(h * scale) or None if h else None
        with_length = next((r.flat.nodes[n] for n in [*lat[:-1], lat[-1]] if "length" in r.flat.nodes[n].inputs), None)
        length = r.values.number(with_length.inputs.get("length")) if with_length is not None else None
        ref.frames = int(length) if length else None
        ref.batch = max(1, int(r.num(si.get("batch_size"), 1)))
    return ref
