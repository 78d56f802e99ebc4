"""What ComfyUI's nodes are, as a workflow reader needs it: each node type's inputs in order (which of them are
widgets, and so which name each entry of a UI node's `widgets_values` has), its output types, whether it is an
output node, and which nodes load which model files from which folder.

The definitions come from ComfyUI itself: inside ComfyUI the pack passes the running server's own node classes
(`NodeDefs.from_input_types`, built in nodes/workflow_plan.py from `NODE_CLASS_MAPPINGS`); elsewhere
`comfy_nodes.json`, written by tools/comfy_node_table.py from ComfyUI 0.33.0's node classes (with ComfyUI-GGUF and
this pack), is read. A node type neither knows is named by the UI JSON's own widget records where they name every
value (`inputs[].widget`), else its widget values stay unnamed.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any, Iterable, Mapping

# input types the frontend draws as a widget (a value stored in widgets_values) rather than a socket only
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COLOR", "CURVE", "COMFY_DYNAMICCOMBO_V3"})
# an upload option adds a button widget whose value is stored after the combo's ("image", "video", ...)
UPLOAD_OPTIONS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload", "model_upload")
SEED_NAMES = ("seed", "noise_seed")  # an INT of this name gets the frontend's control widget unless told otherwise
CONTROL = "control_after_generate"
TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comfy_nodes.json")

# loader type -> ((the widget holding its file, the folder kind find_file is asked, the role of what it loads), ...)
# (ComfyUI 0.33's nodes.py and comfy_extras, ComfyUI-GGUF, this pack; tests/comfyui checks the table against every
# node of the running ComfyUI whose combo lists a model folder's files)
LOADERS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "UNETLoader": (("unet_name", "diffusion_models", "diffusion"),),
    "OffloadDiffusionModelLoader": (("unet_name", "diffusion_models", "diffusion"),),
    "UnetLoaderGGUF": (("unet_name", "unet_gguf", "diffusion"),),
    "UnetLoaderGGUFAdvanced": (("unet_name", "unet_gguf", "diffusion"),),
    "CheckpointLoaderSimple": (("ckpt_name", "checkpoints", "checkpoint"),),
    "CheckpointLoader": (("ckpt_name", "checkpoints", "checkpoint"),),
    "unCLIPCheckpointLoader": (("ckpt_name", "checkpoints", "checkpoint"),),
    "ImageOnlyCheckpointLoader": (("ckpt_name", "checkpoints", "checkpoint"),),
    "OffloadCheckpointLoader": (("ckpt_name", "checkpoints", "checkpoint"),),
    "VAELoader": (("vae_name", "vae", "vae"),),
    "LTXVAudioVAELoader": (("ckpt_name", "checkpoints", "audio_vae"),),
    "LTXAVTextEncoderLoader": (("text_encoder", "text_encoders", "text_encoder"),
                               ("ckpt_name", "checkpoints", "text_projection")),
    "LoraLoader": (("lora_name", "loras", "lora"),),
    "LoraLoaderModelOnly": (("lora_name", "loras", "lora"),),
    "LoraLoaderBypass": (("lora_name", "loras", "lora"),),
    "LoraLoaderBypassModelOnly": (("lora_name", "loras", "lora"),),
    "CreateHookLora": (("lora_name", "loras", "lora"),),
    "CreateHookLoraModelOnly": (("lora_name", "loras", "lora"),),
    "CreateHookModelAsLora": (("ckpt_name", "checkpoints", "lora"),),
    "CreateHookModelAsLoraModelOnly": (("ckpt_name", "checkpoints", "lora"),),
    "TrainLoraNode": (("existing_lora", "loras", "lora"),),
    "OffloadTTSLoader": (("model_name", "tts", "tts"),),
    "CLIPVisionLoader": (("clip_name", "clip_vision", "clip_vision"),),
    "ControlNetLoader": (("control_net_name", "controlnet", "controlnet"),),
    "DiffControlNetLoader": (("control_net_name", "controlnet", "controlnet"),),
    "StyleModelLoader": (("style_model_name", "style_models", "style_model"),),
    "GLIGENLoader": (("gligen_name", "gligen", "gligen"),),
    "HypernetworkLoader": (("hypernetwork_name", "hypernetworks", "hypernetwork"),),
    "PhotoMakerLoader": (("photomaker_model_name", "photomaker", "photomaker"),),
    "UpscaleModelLoader": (("model_name", "upscale_models", "upscale_model"),),
    "LatentUpscaleModelLoader": (("model_name", "latent_upscale_models", "latent_upscale_model"),),
    "ModelPatchLoader": (("name", "model_patches", "model_patch"),),
    "AudioEncoderLoader": (("audio_encoder_name", "audio_encoders", "audio_encoder"),),
    "LoadMoGeModel": (("model_name", "geometry_estimation", "geometry_estimation"),),
    "LoadDA3Model": (("model_name", "geometry_estimation", "geometry_estimation"),),
    "LoadBackgroundRemovalModel": (("bg_removal_name", "background_removal", "background_removal"),),
    "FrameInterpolationModelLoader": (("model_name", "frame_interpolation", "frame_interpolation"),),
    "OpticalFlowLoader": (("model_name", "optical_flow", "optical_flow"),),
    "LoadMediaPipeFaceLandmarker": (("model_name", "detection", "detection"),),
    # the pip-installable fork's (0.12) own names for some of the above
    "ControlNetLoaderWeights": (("control_net_name", "controlnet", "controlnet"),),
    "LTXVAudioVAELoader1": (("ckpt_name", "checkpoints", "audio_vae"),),
    "LatentUpscaleModelLoader1": (("model_name", "latent_upscale_models", "latent_upscale_model"),),
}
for _t in ("CLIPLoader", "CLIPLoaderGGUF"):
    LOADERS[_t] = (("clip_name", "clip_gguf" if _t.endswith("GGUF") else "text_encoders", "text_encoder"),)
for _t, _n in (("DualCLIPLoader", 2), ("TripleCLIPLoader", 3), ("QuadrupleCLIPLoader", 4), ("DualCLIPLoaderGGUF", 2),
               ("TripleCLIPLoaderGGUF", 3), ("QuadrupleCLIPLoaderGGUF", 4)):
    LOADERS[_t] = tuple((f"clip_name{i}", "clip_gguf" if _t.endswith("GGUF") else "text_encoders", "text_encoder")
                        for i in range(1, _n + 1))
NO_FILE = ("[None]", "None", "none")  # a loader's "no file" choice (TrainLoraNode's existing_lora)
# the roles the plan prices as models it streams or runs; the others are loaded whole by ComfyUI (file bytes)
MODEL_ROLES = ("diffusion", "checkpoint", "text_encoder", "vae", "lora", "tts")
# a template's `properties.models[].directory` -> the folder kind (where they differ)
DIRECTORY_KINDS = {"unet": "diffusion_models", "clip": "text_encoders"}

# node types the frontend never sends to the server (they only route links or hold values for other nodes)
VIRTUAL = frozenset({"Reroute", "PrimitiveNode", "Note", "MarkdownNote", "Label (rgthree)", "Fast Groups Bypasser "
                     "(rgthree)", "Fast Groups Muter (rgthree)", "Bookmark (rgthree)"})


def input_records(input_types: Mapping[str, Any]) -> list[list[Any]]:
    """A node class's INPUT_TYPES() as [name, type, flags] in the frontend's order (required, then optional);
    type "COMBO" for a list of options; flags: f forceInput, c control_after_generate, n control explicitly off,
    u an upload button after it, l lazy, o optional."""
    records: list[list[Any]] = []
    for section in ("required", "optional"):
        group = input_types.get(section) if isinstance(input_types, Mapping) else None
        if not isinstance(group, Mapping):
            continue
        for name, spec in group.items():
            spec = spec if isinstance(spec, (list, tuple)) else (spec,)
            kind = spec[0] if spec else "*"
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], Mapping) else {}
            kind = "COMBO" if isinstance(kind, (list, tuple)) else str(kind)
            flags = "".join(flag for flag, on in (
                ("f", opts.get("forceInput")), ("c", opts.get(CONTROL) not in (None, False)),
                ("n", opts.get(CONTROL) is False), ("u", any(opts.get(o) for o in UPLOAD_OPTIONS)),
                ("l", opts.get("lazy")), ("o", section == "optional")) if on)
            records.append([str(name), kind, flags])
    return records


def widget_names(records: Iterable[list[Any]]) -> list[str]:
    """The names of a UI node's widgets_values entries, in order, from its input records: the widget inputs, the
    control widget after a seed ("control_after_generate"), the upload button after an upload combo ("upload")."""
    names: list[str] = []
    for name, kind, flags in records:
        if kind not in WIDGET_TYPES or "f" in flags:
            continue
        names.append(name)
        if "c" in flags or (kind == "INT" and name in SEED_NAMES and "n" not in flags):
            names.append(CONTROL)
        if "u" in flags:
            names.append("upload")
    return names


class NodeDefs:
    """Node definitions by type: {"in": input records, "out": output types, "output_node": bool}. A running
    ComfyUI's node classes (`classes`, asked lazily, one type at a time) come first; types they lack, or whose
    INPUT_TYPES() fails, are looked up in the table shipped with the package."""

    def __init__(self, own: Mapping[str, Mapping[str, Any]] | None = None, table: bool = True,
                 classes: Mapping[str, Any] | None = None) -> None:
        self.own = dict(own or {})
        self.classes = classes
        self.table = _table() if table else {}

    @classmethod
    def from_input_types(cls, classes: Mapping[str, Any]) -> NodeDefs:
        """From node classes (ComfyUI's NODE_CLASS_MAPPINGS), each asked for INPUT_TYPES() when first needed."""
        return cls(classes=classes)

    def _own(self, ctype: str) -> Mapping[str, Any] | None:
        if ctype in self.own or self.classes is None:
            return self.own.get(ctype)
        node_class = self.classes.get(ctype)
        record = None
        if node_class is not None:
            try:
                record = {"in": input_records(node_class.INPUT_TYPES()),
                          "out": [str(t) for t in getattr(node_class, "RETURN_TYPES", ()) or ()],
                          "output_node": bool(getattr(node_class, "OUTPUT_NODE", False))}
            except Exception:  # noqa: BLE001 - another pack's node failing: the shipped table, else the UI's records
                record = None
        self.own[ctype] = record
        return record

    def get(self, ctype: str) -> Mapping[str, Any] | None:
        return self._own(ctype) or self.table.get(ctype)

    def widgets(self, ctype: str) -> list[str] | None:
        d = self.get(ctype)
        return widget_names(d["in"]) if d else None

    def input_type(self, ctype: str, name: str) -> str | None:
        d = self.get(ctype)
        return next((k for n, k, _ in d["in"] if n == name), None) if d else None

    def outputs(self, ctype: str) -> list[str] | None:
        d = self.get(ctype)
        return list(d["out"]) if d else None

    def is_output(self, ctype: str) -> bool | None:
        d = self.get(ctype)
        return bool(d["output_node"]) if d else None

    def lazy(self, ctype: str) -> set[str]:
        d = self.get(ctype)
        return {n for n, _, f in d["in"] if "l" in f} if d else set()

    def source(self) -> str:
        return "this ComfyUI's node definitions" if self.classes is not None else \
            f"{_table_source()}'s node definitions"


@lru_cache(maxsize=1)
def _table_file() -> dict[str, Any]:
    try:
        with open(TABLE_FILE, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {"source": "no", "nodes": {}}
    return data if isinstance(data, dict) and isinstance(data.get("nodes"), dict) else {"source": "no", "nodes": {}}


def _table() -> dict[str, Any]:
    return _table_file()["nodes"]


def _table_source() -> str:
    return str(_table_file().get("source", "ComfyUI"))
