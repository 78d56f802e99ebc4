"""Offload Loaders: load from ComfyUI's model folders and return models already set up for streaming."""
from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

import comfy.sd
import folder_paths
from comfy_api.latest import io

from .apply import offload_clip, offload_patcher
from .model_files import STREAMABLE
from .common import (CATEGORY, WEIGHT_DTYPES_FALLBACK, devices_input, host_compression_input,
                     host_compression_override, optional_inputs, preset_input, resolve_devices)

log = logging.getLogger("layer_offload")


def weight_dtype_choices() -> List[str]:
    """The same weight_dtype options as ComfyUI's own UNETLoader (read from it when available)."""
    core = sys.modules.get("nodes")
    loader = getattr(core, "UNETLoader", None) if core is not None else None
    try:
        if loader is not None:
            spec = loader.INPUT_TYPES()["required"]["weight_dtype"]
            choices = spec[0]
            if not isinstance(choices, (list, tuple)) and len(spec) > 1:  # a V3 node: ("COMBO", {"options": [...]})
                choices = spec[1].get("options")
            if isinstance(choices, (list, tuple)) and choices:
                return list(choices)
    except Exception:  # noqa: BLE001 - fall back to the long-standing list
        pass
    return list(WEIGHT_DTYPES_FALLBACK)


def unet_model_options(weight_dtype: str) -> Dict[str, Any]:
    """model_options for comfy.sd.load_diffusion_model, exactly as UNETLoader builds them."""
    opts: Dict[str, Any] = {}
    if weight_dtype == "fp8_e4m3fn":
        opts["dtype"] = torch.float8_e4m3fn
    elif weight_dtype == "fp8_e4m3fn_fast":
        opts["dtype"] = torch.float8_e4m3fn
        opts["fp8_optimizations"] = True
    elif weight_dtype == "fp8_e5m2":
        opts["dtype"] = torch.float8_e5m2
    return opts


def _streamable_file(path: str) -> Optional[str]:
    """The model's file, when the disk tier can stream blocks from it (a safetensors or GGUF file, the latter where
    this ComfyUI's loader reads one; the engine checks that it holds each block's bytes exactly, and keeps any other
    block in RAM)."""
    return path if path.lower().endswith(STREAMABLE) else None


def _non_dynamic_kwargs(fn: Any) -> Dict[str, Any]:
    """`disable_dynamic=True` where ComfyUI's loader has it (DynamicVRAM): the pack wants a plain ModelPatcher."""
    try:
        return {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(fn).parameters else {}
    except (TypeError, ValueError):
        return {}


class OffloadDiffusionModelLoader(io.ComfyNode):
    """UNETLoader + Offload Model in one node."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadDiffusionModelLoader", display_name="Offload Loader (Diffusion Model)", category=CATEGORY,
            description=("Load a diffusion model and stream its blocks from pinned host RAM under the pack's VRAM "
                         "budget."),
            inputs=[io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                                   tooltip="A diffusion model file from models/diffusion_models."),
                    io.Combo.Input("weight_dtype", options=weight_dtype_choices(),
                                   tooltip="Storage dtype of the weights, as in ComfyUI's Load Diffusion Model node."),
                    preset_input(), *optional_inputs(), devices_input(), host_compression_input()],
            outputs=[io.Model.Output(tooltip="The diffusion model, streamed block by block from pinned RAM.")])

    @classmethod
    def execute(cls, unet_name: str, weight_dtype: str, preset: str, budget: Any = None,
                priority: int = 0, devices: str = "", host_compression: str = "preset") -> io.NodeOutput:
        return io.NodeOutput(*cls.load(unet_name, weight_dtype, preset, budget, priority, devices, host_compression))

    @classmethod
    def load(cls, unet_name: str, weight_dtype: str, preset: str, budget: Any = None,
             priority: int = 0, devices: str = "", host_compression: str = "preset") -> Tuple[Any]:
        """The node's work, as a tuple of its outputs."""
        resolve_devices(devices)  # a bad devices text is an error before the file is read
        host_compression_override(host_compression)  # a bad choice is an error before the file is read
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        model = comfy.sd.load_diffusion_model(path, model_options=unet_model_options(weight_dtype),
                                              **_non_dynamic_kwargs(comfy.sd.load_diffusion_model))
        return (offload_patcher(model, preset, budget, priority, name=unet_name, kind="model",
                                disk_path=_streamable_file(path), shared=False, devices=devices,
                                host_compression=host_compression),)


class OffloadCheckpointLoader(io.ComfyNode):
    """CheckpointLoaderSimple + offloading of its MODEL and CLIP."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="OffloadCheckpointLoader", display_name="Offload Loader (Checkpoint)", category=CATEGORY,
            description="Load a checkpoint; its diffusion model and text encoder stream from pinned host RAM.",
            inputs=[io.Combo.Input("ckpt_name", options=folder_paths.get_filename_list("checkpoints"),
                                   tooltip="A checkpoint file from models/checkpoints."),
                    preset_input(), *optional_inputs(), devices_input(), host_compression_input()],
            outputs=[io.Model.Output(tooltip="The diffusion model, streamed."),
                     io.Clip.Output(tooltip="The text encoder, streamed."),
                     io.Vae.Output(tooltip="The VAE, loaded as ComfyUI does.")])

    @classmethod
    def execute(cls, ckpt_name: str, preset: str, budget: Any = None, priority: int = 0,
                devices: str = "", host_compression: str = "preset") -> io.NodeOutput:
        return io.NodeOutput(*cls.load(ckpt_name, preset, budget, priority, devices, host_compression))

    @classmethod
    def load(cls, ckpt_name: str, preset: str, budget: Any = None, priority: int = 0,
             devices: str = "", host_compression: str = "preset") -> Tuple[Any, Any, Any]:
        """The node's work, as a tuple of its outputs."""
        resolve_devices(devices)  # a bad devices text is an error before the file is read
        host_compression_override(host_compression)  # a bad choice is an error before the file is read
        path = folder_paths.get_full_path_or_raise("checkpoints", ckpt_name)
        out = comfy.sd.load_checkpoint_guess_config(path, output_vae=True, output_clip=True,
                                                    embedding_directory=folder_paths.get_folder_paths("embeddings"),
                                                    **_non_dynamic_kwargs(comfy.sd.load_checkpoint_guess_config))
        model, clip, vae = out[:3]
        if model is not None:
            model = offload_patcher(model, preset, budget, priority, name=ckpt_name, kind="model",
                                    disk_path=_streamable_file(path), shared=False, devices=devices,
                                    host_compression=host_compression)
        if clip is not None:
            clip = offload_clip(clip, preset, budget, priority, name=ckpt_name + ":clip", devices=devices,
                                host_compression=host_compression)
        return (model, clip, vae)
