"""How weight patches (LoRA and the like) reach streamed weights: the one module that owns `comfy_cast_weights`.

The host master of an offloaded weight is never patched (one loaded model serves prompts with and without a
LoRA). A patch is computed on the device copy, the way a full load bakes it:

- Weights of ComfyUI's cast-capable layers get an `ExactPatch` in their `weight_function` / `bias_function`:
  the stored weight is cast to `lora_compute_dtype`, patched (`convert_func` / `set_func` for quantized storage,
  exactly as `patch_weight_to_device` does), rounded back to the stored dtype, then cast to the compute dtype.
- Plain parameters of other leaf modules get a forward pre-hook on their module that swaps in the patched tensor
  for that forward and a post-hook that puts the original back. Parameters of non-leaf modules (Wan's
  `modulation` on its block) are left alone, as ComfyUI's own loader leaves them: its `_load_list` skips "random
  weights in non leaf modules", so patching them would differ from the plain loader.

Patches that cannot apply (a LoRA key of the wrong shape) are found once per set of patches, reported in one
log line like ComfyUI's own loader does, and left out instead of failing again on every forward.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils

from .registry import Managed

log = logging.getLogger("layer_offload")

PLAIN_HOOKS_ATTR = "_lo_plain_patch_hooks"


def _string_to_seed(key: str) -> int:
    fn = getattr(comfy.utils, "string_to_seed", None) or getattr(comfy.model_patcher, "string_to_seed")
    return fn(key)


def _lora_compute_dtype(device: Any) -> torch.dtype:
    """The dtype a full load patches weights in: lora_compute_dtype where ComfyUI has it, else float32."""
    fn = getattr(comfy.model_management, "lora_compute_dtype", None)
    return fn(device) if callable(fn) else torch.float32


def patched_weight(model: Any, key: str, patches: Dict[str, list], device: Any) -> torch.Tensor:
    """The weight `key` with its patches applied, in its stored dtype (format), computed like a full load.

    Reads the weight the module holds now (a device slot view during a forward, the host master otherwise) and
    never writes it.
    """
    weight, set_func, convert_func = comfy.model_patcher.get_key_weight(model, key)
    temp = comfy.model_management.cast_to_device(weight, device, _lora_compute_dtype(device), copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patches[key], temp, key)
    if set_func is None:
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=_string_to_seed(key))
    return set_func(out, seed=_string_to_seed(key), return_weight=True)


class ExactPatch:
    """A weight_function that patches a cast layer's weight exactly as ComfyUI's full load would bake it."""

    is_lowvram_patch = True

    def __init__(self, model: Any, key: str, patches: Dict[str, list]) -> None:
        self.model = model
        self.key = key
        self.patches = patches

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return patched_weight(self.model, self.key, self.patches, weight.device).to(dtype=weight.dtype)


class _PlainParamPatch:
    """Forward pre/post hooks that show a module the patched value of one of its plain parameters."""

    def __init__(self, model: Any, key: str, attr: str, patches: Dict[str, list]) -> None:
        self.model = model
        self.key = key
        self.attr = attr
        self.patches = patches
        self.saved: List[torch.nn.Parameter] = []

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        original = module._parameters[self.attr]
        value = patched_weight(self.model, self.key, self.patches, original.device)
        self.saved.append(original)
        module._parameters[self.attr] = torch.nn.Parameter(value, requires_grad=False)

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.saved:
            module._parameters[self.attr] = self.saved.pop()


def loads_own_params(module: torch.nn.Module) -> bool:
    """Whether ComfyUI's loader patches this module's own parameters: a leaf as its `_load_list` sees it (every
    parameter below it is its own, or under torch's `parametrizations.`)."""
    own = set(module._parameters)
    return all(name in own or name.startswith("parametrizations.") for name, _ in module.named_parameters())


def set_cast_flags(root: torch.nn.Module, managed: Managed) -> None:
    """Route every cast-capable layer's weights through `cast_bias_weight`, so weight functions apply to streamed
    weights; the layers' own flags come back when the model is handed back."""
    saved = []
    for m in root.modules():
        if hasattr(m, "comfy_cast_weights"):
            saved.append((m, m.__dict__.get("comfy_cast_weights")))
            m.comfy_cast_weights = True

    def restore() -> None:
        for module, flag in saved:
            if flag is None:
                module.__dict__.pop("comfy_cast_weights", None)
            else:
                module.comfy_cast_weights = flag

    managed.on_release.append(restore)


def _split(key: str) -> Tuple[str, str]:
    module, _, attr = key.rpartition(".")
    return module, attr


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _dry_run(model: Any, key: str, patch: Any, device: Any) -> Optional[str]:
    """Apply one patch to a stand-in of the weight: None when it fits, else ComfyUI's message about it."""
    weight, _, convert_func = comfy.model_patcher.get_key_weight(model, key)
    capture = _LogCapture()
    root = logging.getLogger()
    root.addHandler(capture)
    try:
        temp = torch.zeros(weight.shape, dtype=torch.float32, device=device)
        comfy.lora.calculate_weight([patch], temp, key)
    except Exception as e:  # noqa: BLE001 - the failure is the message
        capture.messages.append("{}: {}".format(type(e).__name__, e))
    finally:
        root.removeHandler(capture)
    problems = [m for m in capture.messages if re.search(r"(?i)error|mismatch|not merged|shape", m)]
    return problems[0] if problems else None


def _usable_patches(patcher: Any, keys: List[str]) -> Dict[str, list]:
    """The patches of `keys` that fit their weights, checked once per set of patches (patches_uuid)."""
    token = getattr(patcher, "patches_uuid", None)
    cache = getattr(patcher, "_lo_patch_check", None)
    if cache is not None and cache[0] == token and cache[1] == frozenset(keys):
        return cache[2]
    usable: Dict[str, list] = {}
    skipped: List[Tuple[str, str]] = []
    for key in keys:
        good = []
        for patch in patcher.patches[key]:
            problem = _dry_run(patcher.model, key, patch, "meta")
            if problem is not None:  # confirm on a real tensor: the meta device lacks a few ops
                problem = _dry_run(patcher.model, key, patch, "cpu")
            if problem is None:
                good.append(patch)
            else:
                skipped.append((key, problem))
        if good:
            usable[key] = good
    if skipped:
        log.warning("Layer Offload: %d patch(es) do not fit their weights and are skipped, as ComfyUI's own loader "
                    "skips them (e.g. %s: %s)", len(skipped), skipped[0][0], skipped[0][1])
    patcher._lo_patch_check = (token, frozenset(keys), usable)
    return usable


def install(patcher: Any, root: torch.nn.Module, prefix: str) -> int:
    """Install the patch functions for every patched weight of the offloaded root; returns how many."""
    clear(patcher, root)
    inside = {id(m) for m in root.modules()}
    keys = [k for k in patcher.patches if k.startswith(prefix)]
    patches = _usable_patches(patcher, keys) if keys else {}
    counter = 0
    hooks = []
    for name, m in patcher.model.named_modules():
        if id(m) not in inside:
            continue
        if hasattr(m, "comfy_cast_weights"):
            m.weight_function = []
            m.bias_function = []
            for attr, fname in (("weight", "weight_function"), ("bias", "bias_function")):
                weight = getattr(m, attr, None)
                if weight is None:
                    continue
                key = "{}.{}".format(name, attr) if name else attr
                if key in patches and is_gguf(weight):
                    # GGUF layers ignore weight_function: they dequantize and apply `weight.patches` themselves, as
                    # GGUF's own patcher sets them; the parameter keeps its identity while it streams
                    weight.patches = [(patches[key], key)]
                    counter += 1
                elif key in patches:
                    getattr(m, fname).append(ExactPatch(patcher.model, key, patches))
                    counter += 1
                if key in patcher.weight_wrapper_patches:
                    getattr(m, fname).extend(patcher.weight_wrapper_patches[key])
            continue
        if not loads_own_params(m):
            continue
        for attr, p in m._parameters.items():
            key = "{}.{}".format(name, attr) if name else attr
            if p is None or key not in patches:
                continue
            plain = _PlainParamPatch(patcher.model, key, attr, patches)
            hooks.append(m.register_forward_pre_hook(plain.pre))
            hooks.append(m.register_forward_hook(plain.post, always_call=True))
            counter += 1
    object.__setattr__(root, PLAIN_HOOKS_ATTR, hooks)
    return counter


def is_gguf(weight: Any) -> bool:
    """A GGUF-quantized weight (ComfyUI-GGUF's or the built-in GGMLTensor): patches go in its `.patches`."""
    return hasattr(weight, "tensor_type") and hasattr(weight, "tensor_shape")


def clear(patcher: Any, root: torch.nn.Module) -> None:
    """Remove every patch function and plain-parameter hook from the offloaded root."""
    for m in root.modules():
        if hasattr(m, "comfy_cast_weights"):
            m.weight_function = []
            m.bias_function = []
            for attr in ("weight", "bias"):
                weight = getattr(m, attr, None)
                if weight is not None and is_gguf(weight) and getattr(weight, "patches", None):
                    weight.patches = []
    for h in root.__dict__.pop(PLAIN_HOOKS_ATTR, []):
        h.remove()
