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

Weight hooks (ComfyUI's scheduled LoRA: *Create Hook LoRA*, hook keyframes) write their weights in place on a plain
model, between the passes of one sampling step. On an offloaded model they become a second patch stage instead
(`set_hook_patches`): computed on the device after the model's own patches, in float32 and rounded like ComfyUI's
`patch_hook_weight_to_device`, so the result equals the plain model's and the host master is never written.

Patches that cannot apply (a LoRA key of the wrong shape) are found once per patch, reported in one log line like
ComfyUI's own loader does, and left out instead of failing again on every forward.
"""
from __future__ import annotations

import logging
import re
import weakref
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
OWNER_ATTR = "_lo_patch_owner"  # on the root: the patcher whose patch functions are installed (weakly)
HOOK_PATCHES_ATTR = "_lo_hook_patches"  # on the patcher: (combined weight-hook patches, original weights) or None


def _string_to_seed(key: str) -> int:
    fn = getattr(comfy.utils, "string_to_seed", None) or getattr(comfy.model_patcher, "string_to_seed")
    return fn(key)


def _lora_compute_dtype(device: Any) -> torch.dtype:
    """The dtype a full load patches weights in: lora_compute_dtype where ComfyUI has it, else float32."""
    fn = getattr(comfy.model_management, "lora_compute_dtype", None)
    return fn(device) if callable(fn) else torch.float32


def _patch_stage(key_patches: list, weight: torch.Tensor, key: str, set_func: Any, convert_func: Any, device: Any,
                 dtype: torch.dtype, originals: Optional[dict] = None) -> torch.Tensor:
    temp = comfy.model_management.cast_to_device(weight, device, dtype, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    if originals is None:
        out = comfy.lora.calculate_weight(key_patches, temp, key)
    else:
        out = comfy.lora.calculate_weight(key_patches, temp, key, original_weights=originals)
    if set_func is None:
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=_string_to_seed(key))
    return set_func(out, seed=_string_to_seed(key), return_weight=True)


def patched_weight(model: Any, key: str, patches: Dict[str, list], device: Any,
                   hook_patches: Optional[Dict[str, list]] = None, originals: Optional[dict] = None) -> torch.Tensor:
    """The weight `key` with its patches applied, in its stored dtype (format), computed like a full load; then the
    weight hooks' patches, computed like ComfyUI applies them to the loaded (already patched) weight.

    Reads the weight the module holds now (a device slot view during a forward, the host master otherwise) and
    never writes it.
    """
    weight, set_func, convert_func = comfy.model_patcher.get_key_weight(model, key)
    out = weight
    if key in patches:
        out = _patch_stage(patches[key], weight, key, set_func, convert_func, device, _lora_compute_dtype(device))
    if hook_patches and key in hook_patches:
        out = _patch_stage(hook_patches[key], out, key, set_func, convert_func, device, torch.float32, originals)
    return out


class ExactPatch:
    """A weight_function that patches a cast layer's weight exactly as ComfyUI's full load would bake it."""

    is_lowvram_patch = True

    def __init__(self, model: Any, key: str, patches: Dict[str, list], hook_patches: Optional[Dict[str, list]] = None,
                 originals: Optional[dict] = None) -> None:
        self.model = model
        self.key = key
        self.patches = patches
        self.hook_patches = hook_patches
        self.originals = originals

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return patched_weight(self.model, self.key, self.patches, weight.device, self.hook_patches,
                              self.originals).to(dtype=weight.dtype)


class _PlainParamPatch:
    """Forward pre/post hooks that show a module the patched value of one of its plain parameters."""

    def __init__(self, model: Any, key: str, attr: str, patches: Dict[str, list],
                 hook_patches: Optional[Dict[str, list]] = None, originals: Optional[dict] = None) -> None:
        self.model = model
        self.key = key
        self.attr = attr
        self.patches = patches
        self.hook_patches = hook_patches
        self.originals = originals
        self.saved: List[torch.nn.Parameter] = []

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        original = module._parameters[self.attr]
        value = patched_weight(self.model, self.key, self.patches, original.device, self.hook_patches, self.originals)
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


def _patch_data(patch: Any) -> Any:
    """What a patch applies (its weights or adapter), without the strengths ComfyUI keeps around it."""
    return patch[1] if isinstance(patch, tuple) and len(patch) > 1 else patch


def _fitting(patcher: Any, source: Dict[str, list], keys: List[str]) -> Dict[str, list]:
    """The patches of `keys` in `source` that fit their weights; each patch's verdict is kept on the patcher, so a
    set combined again (weight hooks, at every switch) is not checked again, and a misfit is logged once."""
    verdicts = patcher.__dict__.setdefault("_lo_patch_fit", {})
    usable: Dict[str, list] = {}
    skipped: List[Tuple[str, str]] = []
    for key in keys:
        good = []
        for patch in source[key]:
            data = _patch_data(patch)
            known = verdicts.get((key, id(data)))
            if known is None or known[0] is not data:
                problem = _dry_run(patcher.model, key, patch, "meta")
                if problem is not None:  # confirm on a real tensor: the meta device lacks a few ops
                    problem = _dry_run(patcher.model, key, patch, "cpu")
                known = verdicts[(key, id(data))] = (data, problem)  # keeps `data` alive, so the id stays its own
                if problem is not None:
                    skipped.append((key, problem))
            if known[1] is None:
                good.append(patch)
        if good:
            usable[key] = good
    if skipped:
        log.warning("Layer Offload: %d patch(es) do not fit their weights and are skipped, as ComfyUI's own loader "
                    "skips them (e.g. %s: %s)", len(skipped), skipped[0][0], skipped[0][1])
    return usable


def _usable_patches(patcher: Any, keys: List[str]) -> Dict[str, list]:
    """The patches of `keys` that fit their weights (the result kept per set of patches, patches_uuid)."""
    token = getattr(patcher, "patches_uuid", None)
    cache = getattr(patcher, "_lo_patch_check", None)
    if cache is not None and cache[0] == token and cache[1] == frozenset(keys):
        return cache[2]
    usable = _fitting(patcher, patcher.patches, keys)
    patcher._lo_patch_check = (token, frozenset(keys), usable)
    return usable


def set_hook_patches(patcher: Any, combined: Optional[Dict[str, list]], originals: Optional[dict]) -> None:
    """The weight-hook patches in force from now on (None: none); `install` applies them after the model's own."""
    patcher.__dict__[HOOK_PATCHES_ATTR] = (combined, originals) if combined else None


def hook_patches_of(patcher: Any) -> Tuple[Dict[str, list], Optional[dict]]:
    """The weight-hook patches in force and the original weights they may refer to ({} and None: none)."""
    hooks = patcher.__dict__.get(HOOK_PATCHES_ATTR)
    return hooks if hooks else ({}, None)


def needs_original_weights(combined: Dict[str, list]) -> bool:
    """Whether a patch refers to the unpatched weights (a "model_as_lora" hook), as calculate_weight reads them."""
    for key_patches in combined.values():
        for patch in key_patches:
            data = _patch_data(patch)
            if data is not patch and isinstance(data, tuple) and data and data[0] == "model_as_lora":
                return True
    return False


def install(patcher: Any, root: torch.nn.Module, prefix: str) -> int:
    """Install the patch functions for every patched weight of the offloaded root; returns how many."""
    clear(patcher, root)
    inside = {id(m) for m in root.modules()}
    keys = [k for k in patcher.patches if k.startswith(prefix)]
    patches = _usable_patches(patcher, keys) if keys else {}
    hook_source, originals = hook_patches_of(patcher)
    hook_keys = [k for k in hook_source if k.startswith(prefix)]
    hooked = _fitting(patcher, hook_source, hook_keys) if hook_keys else {}
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
                if (key in patches or key in hooked) and gguf_quantized(weight):
                    # GGUF layers ignore weight_function: they dequantize and apply `weight.patches` themselves, as
                    # GGUF's own patcher sets them; the parameter keeps its identity while it streams
                    weight.patches = [(p[key], key) for p in (patches, hooked) if key in p]
                    counter += 1
                elif key in patches or key in hooked:
                    getattr(m, fname).append(ExactPatch(patcher.model, key, patches, hooked, originals))
                    counter += 1
                if key in patcher.weight_wrapper_patches:
                    getattr(m, fname).extend(patcher.weight_wrapper_patches[key])
            continue
        if not loads_own_params(m):
            continue
        for attr, p in m._parameters.items():
            key = "{}.{}".format(name, attr) if name else attr
            if p is None or (key not in patches and key not in hooked):
                continue
            plain = _PlainParamPatch(patcher.model, key, attr, patches, hooked, originals)
            hooks.append(m.register_forward_pre_hook(plain.pre))
            hooks.append(m.register_forward_hook(plain.post, always_call=True))
            counter += 1
    object.__setattr__(root, PLAIN_HOOKS_ATTR, hooks)
    object.__setattr__(root, OWNER_ATTR, weakref.ref(patcher))
    return counter


def installed_for(patcher: Any, root: torch.nn.Module) -> bool:
    """Whether the patch functions on the root now are this patcher's (the one loaded, of several clones)."""
    owner = root.__dict__.get(OWNER_ATTR)
    return owner is not None and owner() is patcher


def is_gguf(weight: Any) -> bool:
    """A GGUF-quantized weight (ComfyUI-GGUF's or the built-in GGMLTensor): patches go in its `.patches`."""
    return hasattr(weight, "tensor_type") and hasattr(weight, "tensor_shape")


def gguf_quantized(weight: Any) -> bool:
    """A GGUF weight its layer dequantizes itself (applying `.patches`); F32 / F16 GGUF weights go through ComfyUI's
    ordinary cast path instead (ComfyUI-GGUF bakes patches into those, as a full load does)."""
    if not is_gguf(weight):
        return False
    qtype = weight.tensor_type
    return qtype is not None and getattr(qtype, "name", str(qtype)) not in ("F32", "F16")


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
    root.__dict__.pop(OWNER_ATTR, None)
