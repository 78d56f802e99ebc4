"""The whole workflow planned before it runs: every model it loads, on one card, from file headers alone.

API (used by the ComfyUI panel's route and `python -m offload plan workflow.json`):

    plan_workflow(graph: dict, find_file: Callable[[str, str], str | None], card: Card | str | None = None,
                  ram_bytes: int | None = None, presets: Sequence[str] | None = None,
                  defs: NodeDefs | None = None, remote: RemoteHeaders | None = None) -> WorkflowPlan
    WorkflowPlan.to_dict() -> dict   # strict JSON (no NaN / infinity): {"card", "models", "run", "ram", "notes",
                                     # "graph", "downloads"}

`remote` (header_source.RemoteHeaders): a file `find_file` does not find is planned from its header read from the
download link the workflow carries (cache or network, as its mode says), as the same file on disk would be; its
model has `url` and `download` ({url, bytes, source}), the plan `downloads` (each linked missing file, its bytes or
why its header was not read).

`graph` is ComfyUI's API JSON or UI JSON (`workflow_graph.read_graph`). `find_file(folder_kind, name)` gives the
path of a loader's file or None: kinds "diffusion_models", "checkpoints", "text_encoders", "vae", "loras",
"unet_gguf" and "tts" (a model folder). `card`: a `cards.Card` (the card ComfyUI runs on), a card name, or None
(rtx4090, said in the notes). `ram_bytes`: the host RAM free for models (default: psutil's available memory).

Per model (`models`): role, family, file bytes, preset, and for that preset whether it fits, VRAM (plan + the
activations), activations, host RAM, disk, time per call and the resident time per call; `without_offloading`
(whether the weights plus the activations fit the card at all, and how much that needs); every preset's figures.
The run (`run`): the text encodes, each sampler's steps x forwards (CFG other than 1: cond and uncond in one
batch of two, as ComfyUI's sampler runs them), the VAE decodes (tiled or not; ComfyUI retries an untiled decode
that runs out of memory tiled), the total, the peak VRAM of the phases (with the CUDA context), and the RAM of
everything loaded at once against `ram_bytes` (what would go to the disk tier). Nothing is loaded: `model_files`
reads headers only.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..config import PRESETS, OffloadConfig
from .cards import MEMORY_EFFICIENCY, Card, get_card
from .file_plan import header_packed_sizes
from .header_costs import Tokens, diffusion_analysis, encoder_analysis, vae_decode_cost
from .model_files import ModelFileError, TensorInfo, read_tensor_infos
from .model_kinds import FAMILIES, ModelDesc, describe, split_checkpoint
from .prediction import CONTEXT_BYTES, Prediction, _profile_on_card, predict_profile
from .comfy_nodes import MODEL_ROLES, NodeDefs
from .workflow_graph import GraphFacts, LoaderRef, read_graph

from .header_source import download_size

if TYPE_CHECKING:
    from .header_source import RemoteHeaders, RemoteModel

log = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_CARD = "rtx4090"
# text tokens of a text encoder by ComfyUI's CLIP loader type (its tokenizer's padding, or a typical prompt)
CLIP_TYPE_TOKENS = {"wan": 512, "flux": 256, "flux2": 512, "sd3": 77, "hunyuan_video": 256, "qwen_image": 256,
                    "ltxv": 128, "lumina2": 256, "chroma": 512, "cogvideox": 226, "stable_diffusion": 77}


@dataclass
class ModelPlan:
    """One model of the workflow on the card: the preset it runs with and every preset's figures."""

    key: str  # the loader node (and its widget for multi-file loaders)
    role: str
    name: str
    path: str | None
    found: bool
    family: str = ""
    label: str = ""
    dtype: str = ""
    file_bytes: int = 0
    preset: str = "auto"
    calls: int = 0  # forwards this run makes of it
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    without_offloading: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    loader: str = ""  # the GraphFacts.loaders key it comes from (a checkpoint's parts share their loader's)
    runs: bool = True  # False: the workflow names it but does not load it (muted, bypassed, an unused branch)
    url: str | None = None  # where the workflow says to download it (properties.models)
    directory: str | None = None
    subgraph: str = ""
    download: dict[str, Any] | None = None  # a missing file planned from its URL's header: url, bytes, source

    @property
    def chosen(self) -> dict[str, Any]:
        return self.presets.get(self.preset, {})

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("key", "role", "name", "path", "found", "family", "label", "dtype",
                                           "file_bytes", "preset", "calls", "presets", "without_offloading", "notes",
                                           "runs", "url", "directory", "subgraph", "download")}
        d.update({k: self.chosen.get(k) for k in ("fits", "vram_bytes", "activation_bytes", "host_bytes",
                                                 "disk_bytes", "ms_per_call", "resident_ms_per_call")})
        return d


@dataclass
class WorkflowPlan:
    """The workflow on one card: its models, its run and its RAM (see the module doc)."""

    card: dict[str, Any]
    models: list[ModelPlan]
    run: dict[str, Any]
    ram: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    graph: dict[str, Any] = field(default_factory=dict)  # how the workflow was read: {"read_whole", "unread", ...}
    downloads: list[dict[str, Any]] = field(default_factory=list)  # missing files the workflow links (header_source)

    def to_dict(self) -> dict[str, Any]:
        return _finite({"card": self.card, "models": [m.to_dict() for m in self.models], "run": self.run,
                        "ram": self.ram, "notes": self.notes, "graph": self.graph, "downloads": self.downloads})


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _figures(pred: Prediction, calls_batch: int = 1) -> dict[str, Any]:
    ms = pred.step_ms if math.isfinite(pred.step_ms) else None
    return {"fits": bool(pred.fits and ms is not None), "vram_bytes": pred.device_bytes + pred.activation_bytes,
            "plan_bytes": pred.device_bytes, "activation_bytes": pred.activation_bytes, "host_bytes": pred.host_bytes,
            "disk_bytes": pred.disk_bytes, "ms_per_call": ms, "resident_ms_per_call": pred.resident_step_ms,
            "limited_by": pred.limited_by, "notes": list(pred.notes), "compressed_blocks": pred.compressed_blocks,
            "compressed_bytes": pred.compressed_bytes}


def _plan_model(plan: ModelPlan, desc: ModelDesc, analysis: Any, card: Card, presets: Sequence[str],
                ram_bytes: int | None, disk_ok: bool) -> None:
    """Every preset's figures for `desc` costed by `analysis` on `card`, and the without-offloading line."""
    profile = _profile_on_card(analysis, card)
    profile.names = [b.name for b in desc.blocks]
    profile.sizes = [b.nbytes for b in desc.blocks]
    profile.rest_bytes = desc.rest_bytes
    profile.model_name = plan.label or plan.family
    profile.flops = list(analysis.flops)
    profile.packed_sizes = header_packed_sizes(desc)
    for name in presets:
        cfg = OffloadConfig.from_preset(name, device="sim")
        plan.presets[name] = figures = _figures(predict_profile(profile, cfg, ram_bytes=ram_bytes, disk_tier=disk_ok))
        if figures["compressed_blocks"]:  # what the blocks held compressed keep off the disk tier
            raw = predict_profile(profile, replace(cfg, host_compression="off"), ram_bytes=ram_bytes,
                                  disk_tier=disk_ok)
            figures["uncompressed"] = {"fits": bool(raw.fits and math.isfinite(raw.step_ms)),
                                       "host_bytes": raw.host_bytes, "disk_bytes": raw.disk_bytes}
    need = desc.nbytes + analysis.activation_bytes
    room = card.vram_bytes - CONTEXT_BYTES
    resident = profile.rest_ms + sum(profile.compute_ms)
    plan.without_offloading = {"fits": need <= room, "needs_bytes": need, "weights_bytes": desc.nbytes,
                               "activation_bytes": analysis.activation_bytes, "card_bytes": room,
                               "ms_per_call": resident}


def _preset_of(ref: LoaderRef, facts: GraphFacts, default: str = "auto") -> str:
    preset = ref.inputs.get("preset")
    return preset if isinstance(preset, str) and preset in PRESETS else default


def _text_tokens(ref: LoaderRef, desc: ModelDesc) -> int:
    clip_type = str(ref.inputs.get("type", "")).lower()
    return CLIP_TYPE_TOKENS.get(clip_type, desc.text_tokens or 256)


def plan_workflow(graph: dict, find_file: Callable[[str, str], str | None], card: "Card | str | None" = None,
                  ram_bytes: int | None = None, presets: Sequence[str] | None = None,
                  defs: NodeDefs | None = None, remote: "RemoteHeaders | None" = None) -> WorkflowPlan:
    """The workflow `graph` planned on `card` (see the module doc): headers read, nothing loaded. `defs`: the node
    definitions to read it with (a running ComfyUI's; default the table shipped from ComfyUI's). `remote`: the
    links of missing files and, where its mode says, their headers from the cache or the network."""
    notes: list[str] = []
    if card is None:
        notes.append(f"no card given: planned for {DEFAULT_CARD}")
        card = DEFAULT_CARD
    card_obj = get_card(card)
    if ram_bytes is None:
        import psutil

        ram_bytes = int(psutil.virtual_memory().available)
    names = list(presets) if presets else list(PRESETS)
    facts = read_graph(graph, defs)
    notes.extend(facts.notes)
    models: dict[str, ModelPlan] = {}
    descs: dict[str, ModelDesc] = {}
    paths = {key: _find(find_file, ref) for key, ref in facts.loaders.items()}
    if remote is not None:  # every missing file's header at once
        remote.prepare((ref.folder, ref.name) for key, ref in facts.loaders.items() if ref.runs and paths[key] is None)
    for key, ref in facts.loaders.items():
        plan = ModelPlan(key, ref.role, ref.name, None, False, preset=_preset_of(ref, facts), loader=key,
                         runs=ref.runs, url=ref.url, directory=ref.directory, subgraph=ref.subgraph)
        models[key] = plan
        if not ref.runs:
            plan.notes.append(f"not loaded: {ref.why}")
            continue
        path = paths[key]
        plan.path, plan.found = path, path is not None
        if path is None:
            got = _remote(plan, ref, remote)
            if got is None:
                continue
            path = plan.path
            if ref.role not in MODEL_ROLES:
                _whole_size(plan, got.download_bytes or 0, card_obj)
                continue
            infos = got.infos
        elif ref.role not in MODEL_ROLES:
            _whole_file(plan, path, card_obj)
            continue
        else:
            try:
                infos = _read(path, ref.role)
            except (ModelFileError, OSError) as exc:
                plan.found = False
                plan.notes.append(str(exc))
                continue
        plan.file_bytes = sum(i.nbytes for i in infos.values())
        if ref.role == "checkpoint":
            parts = split_checkpoint(infos)
            for part, part_infos in parts.items():
                sub = ModelPlan(f"{key}:{part}", part, ref.name, path, True, preset=plan.preset, loader=key,
                                url=plan.url, directory=ref.directory, subgraph=ref.subgraph, download=plan.download)
                models[sub.key] = sub
                descs[sub.key] = _describe(sub, part_infos, ref.folder)
            del models[key]
            continue
        descs[key] = _describe(plan, infos, ref.folder)
        if ref.role == "tts":
            plan.family = plan.label = _tts_family(path) or plan.family
    run = _plan_run(facts, models, descs, card_obj, names, ram_bytes, notes)
    ram = _ram(models, descs, ram_bytes)
    if ram["disk_bytes"]:
        notes.append(f"everything loaded at once needs {ram['needed_bytes'] / GIB:.1f} GiB of host RAM, "
                     f"{ram['free_bytes'] / GIB:.1f} GiB is free: {ram['disk_bytes'] / GIB:.1f} GiB would stream from "
                     f"the model files (the disk tier; presets that allow it)")
    graph_read = {"read_whole": facts.complete, "unread": facts.unread, "form": facts.form,
                  "files": len(models), "files_loaded": sum(m.runs for m in models.values()),
                  "samplers": len(facts.samplers),
                  "samplers_not_run": [{k: v for k, v in x.items() if k != "ref"} for x in facts.idle_samplers]}
    downloads = remote.downloads() if remote is not None else []
    got = [d for d in downloads if d["bytes"] is not None]
    if got:
        notes.append(f"planned from the headers of {len(got)} file(s) not downloaded yet: "
                     f"{download_size(sum(d['bytes'] for d in got))} to download")
    return WorkflowPlan(card_obj.to_dict(), list(models.values()), run, ram, notes, graph_read, downloads)


def _find(find_file: Callable[[str, str], str | None], ref: LoaderRef) -> str | None:
    path = find_file(ref.folder, ref.name)
    if path is None and ref.folder == "text_encoders":
        path = find_file("clip", ref.name)
    return path


def _remote(plan: ModelPlan, ref: LoaderRef, remote: "RemoteHeaders | None") -> "RemoteModel | None":
    """A missing file's header read from its URL (`remote`), as a local file's; None (with a note) without."""
    got = remote.lookup(ref.folder, ref.name) if remote is not None else None
    if got is None or got.infos is None:
        url = got.url if got is not None else ref.url
        plan.url = url or plan.url
        plan.notes.append(f"{ref.name} not found in {ref.folder}" + (f" (the workflow's download link: {url})"
                                                                      if url else "") +
                          ": named, not priced (its figures need the file's header)")
        if got is not None:
            plan.notes.append(f"header not read: {got.error}" if got.error else
                              "plan it from its header: --fetch-headers, or the panel's 'Plan the download'")
        return None
    plan.url, plan.path, plan.found = got.url, got.url, True
    plan.download = {"url": got.url, "bytes": got.download_bytes, "source": got.source}
    return got


def _whole_file(plan: ModelPlan, path: str, card: Card) -> None:
    """A model ComfyUI loads whole and the plan does not stream (CLIP vision, ControlNet, upscaler, model patch,
    audio VAE ...): its file's bytes in host RAM and on the card while it runs."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        plan.found = False
        plan.notes.append(f"{path}: {exc.strerror or exc}")
        return
    _whole_size(plan, size, card)


def _whole_size(plan: ModelPlan, size: int, card: Card) -> None:
    plan.file_bytes, plan.preset, plan.calls = size, "comfyui", 1
    room = card.vram_bytes - CONTEXT_BYTES
    plan.presets = {"comfyui": {"fits": size <= room, "vram_bytes": size, "activation_bytes": 0, "host_bytes": size,
                                "disk_bytes": 0, "ms_per_call": None, "resident_ms_per_call": None}}
    plan.notes.append(f"loaded whole by ComfyUI ({plan.role.replace('_', ' ')}): its file's bytes, not costed per "
                      f"call")


def _read(path: str, role: str) -> dict[str, TensorInfo]:
    if os.path.isdir(path):  # a TTS model folder: every safetensors file in it, headers only
        infos: dict[str, TensorInfo] = {}
        for entry in sorted(os.listdir(path)):
            if entry.endswith((".safetensors", ".gguf")):
                infos.update(read_tensor_infos(os.path.join(path, entry)))
        if not infos:
            raise ModelFileError(f"{path}: no .safetensors file in the model folder")
        return infos
    return read_tensor_infos(path)


def _tts_family(folder: str) -> str | None:
    """A TTS model folder's model_type from its config.json (read only when small: a config, not weights)."""
    from ..store.header_check import CorruptFileError, read_json_file

    try:  # a regular, small JSON file only: a FIFO or a 20 GB "config.json" is never opened or read
        config = read_json_file(os.path.join(folder, "config.json"), "config.json", 1 << 20)
    except CorruptFileError:
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return kind if isinstance(kind, str) else None


def _describe(plan: ModelPlan, infos: dict[str, TensorInfo], folder: str) -> ModelDesc:
    desc = describe(infos, folder)
    plan.family = desc.family
    plan.label = desc.family_spec.label if desc.family_spec else desc.family
    plan.dtype = desc.dtype
    plan.file_bytes = plan.file_bytes or sum(i.nbytes for i in infos.values())
    if plan.role in ("diffusion", "checkpoint") and desc.role not in ("diffusion", "unknown"):
        plan.notes.append(f"loaded as a diffusion model but its tensors say {desc.role} ({desc.family})")
    plan.notes.extend(desc.notes)
    if plan.role == "checkpoint":
        plan.role = desc.role
    return desc


def _plan_run(facts: GraphFacts, models: dict[str, ModelPlan], descs: dict[str, ModelDesc], card: Card,
              names: list[str], ram_bytes: int, notes: list[str]) -> dict[str, Any]:
    """The run's phases: text encodes, sampling (per sampler), decodes, TTS; per model the plan at its calls."""
    phases: list[dict[str, Any]] = []
    # text encoders: every prompt once
    for key, plan in models.items():
        desc = descs.get(key)
        if desc is None or plan.role != "text_encoder":
            continue
        ref = facts.loaders.get(plan.loader)
        prompts = facts.text_encodes.get(ref.node, 0) if ref is not None else 0
        tokens = _text_tokens(ref, desc) if ref is not None else desc.text_tokens
        _plan_model(plan, desc, encoder_analysis(desc, tokens), card, names, ram_bytes, plan.path is not None)
        plan.calls = prompts
        ms = plan.chosen.get("ms_per_call")
        phases.append({"phase": "text encode", "model": key, "calls": prompts, "tokens": tokens,
                       "ms": ms * prompts if ms is not None else None, "vram_bytes": plan.chosen.get("vram_bytes")})
    # samplers: each on the diffusion model its model input comes from
    samplers_out = []
    for s in facts.samplers:
        key = s.model_loader if s.model_loader in models else f"{s.model_loader}:diffusion"
        desc, plan = descs.get(key), models.get(key)
        entry: dict[str, Any] = {"sampler": s.node, "class_type": s.class_type, "runs": True, "model": key,
                                 "model_file": plan.name if plan is not None else None, "steps": s.steps,
                                 "total_steps": s.total_steps, "cfg": s.cfg, "width": s.width, "height": s.height,
                                 "frames": s.frames, "batch": s.batch, "subgraph": s.subgraph}
        samplers_out.append(entry)
        if desc is None or plan is None or desc.role not in ("diffusion", "unknown"):
            entry["note"] = "its diffusion model was not found or not read: not costed"
            continue
        fam = desc.family_spec or FAMILIES["flux"]
        width, height = s.width or 1024, s.height or 1024
        frames = s.frames or 1
        if s.width is None:
            entry["note"] = "no latent size found: 1024x1024 assumed"
        rule = fam.frame_rule(frames) if s.frames else None
        if rule:
            notes.append(f"sampler {s.node}: {rule}")
            entry["frame_rule"] = rule
        guided = abs(s.cfg - 1.0) > 1e-6
        tok = Tokens(fam.image_tokens(width, height, frames), fam.text_tokens, s.batch * (2 if guided else 1))
        disk_ok = not plan.name.endswith(".gguf")
        _plan_model(plan, desc, diffusion_analysis(desc, tok), card, names, ram_bytes, disk_ok)
        calls_per_step = 1
        if guided and not plan.chosen.get("fits", True):
            # ComfyUI's sampler batches cond and uncond only when free memory allows (calc_cond_batch): else they
            # run one after the other at the latent's own batch
            single = Tokens(tok.image, tok.text, s.batch)
            trial = ModelPlan(plan.key, plan.role, plan.name, plan.path, True, preset=plan.preset)
            _plan_model(trial, desc, diffusion_analysis(desc, single), card, names, ram_bytes, disk_ok)
            if trial.chosen.get("fits"):
                plan.presets, plan.without_offloading, tok, calls_per_step = (trial.presets, trial.without_offloading,
                                                                              single, 2)
                plan.notes.append("cond and uncond do not fit as one batch of two: they run one after the other "
                                  "(as ComfyUI's sampler does when memory is short)")
        plan.calls += s.steps * calls_per_step
        ms = plan.chosen.get("ms_per_call")
        step_ms = ms * calls_per_step if ms is not None else None
        entry.update({"image_tokens": tok.image, "text_tokens": tok.text, "forwards_per_step": 2 if guided else 1,
                      "cond_uncond_batched": guided and calls_per_step == 1, "ms_per_step": step_ms,
                      "ms": step_ms * s.steps if step_ms is not None else None,
                      "resident_ms": plan.chosen.get("resident_ms_per_call", 0.0) * s.steps * calls_per_step,
                      "loras": [models[k].name for k in s.loras if k in models]})
        phases.append({"phase": "sampling", "model": key, "calls": s.steps * calls_per_step, "ms": entry["ms"],
                       "vram_bytes": plan.chosen.get("vram_bytes")})
    for idle in facts.idle_samplers:  # named with what they would run, not costed
        s = idle["ref"]
        model = models.get(s.model_loader) if s.model_loader else None
        samplers_out.append({"sampler": s.node, "class_type": s.class_type, "runs": False, "model": s.model_loader,
                             "model_file": model.name if model is not None else None, "steps": s.steps,
                             "total_steps": s.total_steps, "cfg": s.cfg, "width": s.width, "height": s.height,
                             "frames": s.frames, "batch": s.batch, "subgraph": s.subgraph,
                             "note": f"not run: {idle['why']}"})
    decodes = []
    for d in facts.decodes:
        key = d["vae"] if d["vae"] in descs else f"{d['vae']}:vae"
        desc = descs.get(key)
        s = next((x for x in facts.samplers if x.node == d.get("sampler")), facts.samplers[-1] if facts.samplers
                 else None)
        if desc is None or s is None:
            continue
        width, height, frames = s.width or 1024, s.height or 1024, s.frames or 1
        cost = vae_decode_cost(desc.vae or "kl", width, height, frames, s.batch, d["tiled"], d["tile"], d["temporal"])
        room = card.vram_bytes - CONTEXT_BYTES
        fell_back = not cost.tiled and desc.nbytes + cost.peak_bytes > room
        if fell_back:
            cost = vae_decode_cost(desc.vae or "kl", width, height, frames, s.batch, True)
        ms = (cost.flops / (card.tflops * 1e12 * card.matmul_efficiency) +
              cost.nbytes / (max(card.mem_gbps, 1.0) * 1e9 * MEMORY_EFFICIENCY)) * 1e3
        vram = desc.nbytes + cost.peak_bytes
        plan = models[key]
        plan.calls += 1
        plan.presets = {"comfyui": {"fits": vram <= room, "vram_bytes": vram, "activation_bytes": cost.peak_bytes,
                                    "host_bytes": desc.nbytes, "disk_bytes": 0, "ms_per_call": ms,
                                    "resident_ms_per_call": ms}}
        plan.preset = "comfyui"
        plan.without_offloading = {"fits": vram <= room, "needs_bytes": vram, "weights_bytes": desc.nbytes,
                                   "activation_bytes": cost.peak_bytes, "card_bytes": room, "ms_per_call": ms}
        if fell_back:
            untiled = desc.nbytes + vae_decode_cost(desc.vae or "kl", width, height, frames, s.batch).peak_bytes
            plan.notes.append(f"an untiled decode needs {untiled / GIB:.1f} GiB: ComfyUI retries it tiled when it "
                              f"runs out of memory (planned tiled)")
        decodes.append({"node": d["node"], "vae": key, "kind": cost.kind, "tiled": cost.tiled, "fell_back": fell_back,
                        "ms": ms, "vram_bytes": vram})
        phases.append({"phase": "vae decode", "model": key, "calls": 1, "ms": ms, "vram_bytes": vram})
    for t in facts.tts:
        key = t["loader"]
        desc, plan = descs.get(key), models.get(key)
        if desc is None or plan is None:
            continue
        _plan_model(plan, desc, encoder_analysis(desc, 1), card, names, ram_bytes, True)
        plan.calls += t["max_new_tokens"]
        ms = plan.chosen.get("ms_per_call")
        phases.append({"phase": "tts generate", "model": key, "calls": t["max_new_tokens"],
                       "ms": ms * t["max_new_tokens"] if ms is not None else None,
                       "vram_bytes": plan.chosen.get("vram_bytes"), "note": "at most max_new_tokens decode steps"})
    for key, plan in models.items():  # LoRAs: host RAM; applied to the streamed weights as they are copied
        if plan.role == "lora" and plan.found:
            plan.preset = "comfyui"
            plan.presets = {"comfyui": {"fits": True, "vram_bytes": 0, "activation_bytes": 0,
                                        "host_bytes": plan.file_bytes, "disk_bytes": 0, "ms_per_call": None,
                                        "resident_ms_per_call": None}}
    for key, plan in models.items():
        ref = facts.loaders.get(plan.loader)
        if ref is not None and plan.role in ("diffusion", "text_encoder") and plan.found \
                and ref.inputs.get("offloaded_by_pack") is False:
            plan.notes.append(f"loaded by ComfyUI's {ref.class_type} with no Offload Model / Offload CLIP after it: "
                              f"ComfyUI manages it; the figures are the pack's {plan.preset} preset's")
    total = sum(p["ms"] for p in phases if p.get("ms") is not None)
    peaks = [p["vram_bytes"] + CONTEXT_BYTES for p in phases if p.get("vram_bytes") is not None]
    fits = all(models[p["model"]].chosen.get("fits", True) for p in phases if p["model"] in models)
    return {"phases": phases, "samplers": samplers_out, "decodes": decodes, "total_ms": total,
            "peak_vram_bytes": max(peaks) if peaks else 0, "fits": fits,
            "complete": all(p.get("ms") is not None for p in phases) and all("note" not in x or "assumed" in x["note"]
                                                                              for x in samplers_out if x["runs"])
            and all(m.found for m in models.values() if m.runs)}


def _ram(models: dict[str, ModelPlan], descs: dict[str, ModelDesc], ram_bytes: int) -> dict[str, Any]:
    """Host RAM of everything loaded at once (ComfyUI keeps loaded models cached between runs) against the free RAM;
    what does not fit goes to the disk tier (safetensors files only: a GGUF or LoRA file has no disk tier)."""
    needed = sum(m.chosen.get("host_bytes") or 0 for m in models.values())
    spill = max(0, needed - ram_bytes)
    streamable = sum(m.chosen.get("host_bytes") or 0 for m in models.values()
                     if m.role == "diffusion" and m.path and m.name.endswith(".safetensors"))
    return {"free_bytes": ram_bytes, "needed_bytes": needed, "fits": spill == 0, "disk_bytes": min(spill, streamable),
            "short_bytes": max(0, spill - streamable)}


def card_from_figures(name: str, tflops: float, mem_gbps: float, h2d_gbps: float, vram_bytes: int,
                      arch: str = "", base: Card | None = None) -> Card:
    """A card from its figures (`--tflops --mem-gbps --h2d-gbps --vram`), starting from `base`'s where one is
    missing (0 / None)."""
    if base is not None:
        return replace(base, name=name or base.name, tflops=tflops or base.tflops, mem_gbps=mem_gbps or base.mem_gbps,
                       h2d_gbps=h2d_gbps or base.h2d_gbps, vram_bytes=vram_bytes or base.vram_bytes,
                       arch=arch or base.arch, source="given on the command line, the rest from " + base.name)
    return Card(name or "custom", vram_bytes, h2d_gbps, tflops, mem_gbps, None, "given on the command line", arch)
