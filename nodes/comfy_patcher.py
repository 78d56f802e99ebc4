"""ModelPatcher subclass for offloaded models: truthful accounting with comfy.model_management.

ComfyUI loads every model through `load_models_gpu`, which calls `partially_load` / `load` /
`partially_unload` / `detach` on the patcher and reads `model_size()` / `loaded_size()`. This subclass keeps
those calls working while the engine owns the weights: the streamed and resident units live where the engine
puts them (pinned host master + device slot ring), ComfyUI never moves them with `.to()`, and LoRA and other
weight patches are applied on the fly through ComfyUI's own cast path (`weight_function`), computed exactly the
way a full load bakes them, so results match the plain loaders bitwise while the host master stays untouched.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils
from comfy.model_patcher import ModelPatcher

from .common import Managed, log_once, state_of, track_patcher

log = logging.getLogger("layer_offload")

try:  # CallbacksMP exists on every supported ComfyUI; keep the import soft anyway.
    from comfy.patcher_extension import CallbacksMP
except ImportError:  # pragma: no cover - very old ComfyUI
    CallbacksMP = None


def _string_to_seed(key: str) -> int:
    fn = getattr(comfy.utils, "string_to_seed", None)
    if fn is None:
        fn = comfy.model_patcher.string_to_seed
    return fn(key)


def _lora_compute_dtype(device: Any) -> torch.dtype:
    """The dtype a full load patches weights in: lora_compute_dtype where ComfyUI has it, else float32."""
    fn = getattr(comfy.model_management, "lora_compute_dtype", None)
    return fn(device) if callable(fn) else torch.float32


class ExactPatch:
    """A weight_function that patches a weight exactly as ComfyUI's full load would bake it.

    A full load computes `calculate_weight` in `lora_compute_dtype` from the stored weight and rounds back to
    the stored dtype (seeded by the key); the forward then casts to the compute dtype. Doing the same on the
    device copy of the weight (the slot view or resident copy, never the host master) gives identical bytes.
    """

    is_lowvram_patch = True

    def __init__(self, module: torch.nn.Module, attr: str, key: str, patches: Dict[str, list]) -> None:
        self.module = module
        self.attr = attr
        self.key = key
        self.patches = patches

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        stored = getattr(self.module, self.attr)
        device = weight.device
        temp_dtype = _lora_compute_dtype(device)
        temp = comfy.model_management.cast_to_device(stored, device, temp_dtype, copy=True)
        out = comfy.lora.calculate_weight(self.patches[self.key], temp, self.key)
        out = comfy.float.stochastic_rounding(out, stored.dtype, seed=_string_to_seed(self.key))
        return out.to(dtype=weight.dtype)


def _move_own_tensors(module: torch.nn.Module, device: Any) -> None:
    """Move a module's own parameters and buffers (not its children: those may be the engine's)."""
    for name, p in module._parameters.items():
        if p is not None and p.device != torch.device(device):
            p.data = p.data.to(device)
    for name, b in module._buffers.items():
        if b is not None and b.device != torch.device(device):
            module._buffers[name] = b.to(device)


def _managed_root(model: torch.nn.Module) -> Tuple[Optional[torch.nn.Module], str, Optional[Managed]]:
    """The offloaded root inside a patcher's model: diffusion_model for MODEL, the whole model for CLIP."""
    dm = getattr(model, "diffusion_model", None)
    if isinstance(dm, torch.nn.Module):
        st = state_of(dm)
        if st is not None:
            return dm, "diffusion_model.", st
    st = state_of(model)
    if st is not None:
        return model, "", st
    return None, "", None


class OffloadPatcherMixin:
    """The overrides; combined with ModelPatcher (or another loader's ModelPatcher subclass, e.g. GGUF's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _, _, st = _managed_root(self.model)
        if st is not None:
            track_patcher(self, st)
            self._lo_tracked_for = st

    # install --------------------------------------------------------------------
    def clone(self, *args: Any, **kwargs: Any) -> Any:
        """Clone into the offload class; also works unbound as `OffloadModelPatcher.clone(patcher)`."""
        target = self.__class__ if isinstance(self, OffloadPatcherMixin) else patcher_class_for(self)
        src_cls = self.__class__
        self.__class__ = target
        try:
            n = super(OffloadPatcherMixin, self).clone(*args, **kwargs)
        finally:
            self.__class__ = src_cls
        if not isinstance(n, OffloadPatcherMixin):  # a base clone that ignored self.__class__ (e.g. GGUF's)
            n.__class__ = target
            _, _, st = _managed_root(n.model)
            if st is not None and getattr(n, "_lo_tracked_for", None) is not st:
                track_patcher(n, st)
                n._lo_tracked_for = st
        return n

    def is_dynamic(self) -> bool:
        """Never dynamic: the engine, not DynamicVRAM, decides what lives on the device."""
        return False

    # accounting -----------------------------------------------------------------
    def _lo(self) -> Tuple[Optional[torch.nn.Module], str, Optional[Managed]]:
        return _managed_root(self.model)

    def _lo_outside_params(self, root: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
        """Modules of the patcher's model that hold tensors but are outside the offloaded root."""
        inside = {id(m) for m in root.modules()}
        out = []
        for name, m in self.model.named_modules():
            if id(m) in inside:
                continue
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                out.append((name, m))
        return out

    def _lo_outside_device_bytes(self, root: torch.nn.Module) -> int:
        total = 0
        load = self.load_device
        for _, m in self._lo_outside_params(root):
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if t.device == load and not comfy.model_management.is_device_cpu(load):
                    total += t.nelement() * t.element_size()
        return total

    def loaded_size(self) -> int:
        """Device bytes held now: resident units + slot ring + non-block tensors (asked of the engine)."""
        root, _, st = self._lo()
        if st is None:
            return super().loaded_size()
        return int(st.handle.device_bytes()) + self._lo_outside_device_bytes(root)

    def model_size(self) -> int:
        """What this model wants on the device at most: its planned resident set + slot ring, not its full size."""
        root, _, st = self._lo()
        if st is None:
            return super().model_size()
        planned = _planned_bytes(st)
        if planned is None:
            planned = int(st.handle.device_bytes())
        full = comfy.model_management.module_size(self.model)
        return max(1, min(full, max(planned, int(st.handle.device_bytes())))) if full > 0 else planned

    def get_ram_usage(self) -> int:
        """Host RAM the model holds (all of it: the host master is the truth)."""
        return comfy.model_management.module_size(self.model)

    # load / unload --------------------------------------------------------------
    def _lo_set_weight_functions(self, root: torch.nn.Module, prefix: str) -> int:
        """(Re)install weight/bias functions for every patched key: the LoRA path that leaves masters untouched."""
        counter = 0
        inside = {id(m) for m in root.modules()}
        untouched = 0
        for name, m in self.model.named_modules():
            if id(m) not in inside:
                continue
            if not hasattr(m, "comfy_cast_weights"):
                for pname, _ in m.named_parameters(recurse=False):
                    key = "{}.{}".format(name, pname) if name else pname
                    if key in self.patches:
                        untouched += 1
                continue
            m.weight_function = []
            m.bias_function = []
            for attr, fname in (("weight", "weight_function"), ("bias", "bias_function")):
                if getattr(m, attr, None) is None:
                    continue
                key = "{}.{}".format(name, attr) if name else attr
                if key in self.patches:
                    _, set_func, convert_func = comfy.model_patcher.get_key_weight(self.model, key)
                    if set_func is None and convert_func is None:
                        f = ExactPatch(m, attr, key, self.patches)
                    else:  # quantized / custom storage: ComfyUI's own lowvram patch knows how to handle it
                        f = comfy.model_patcher.LowVramPatch(key, self.patches, convert_func, set_func)
                    getattr(m, fname).append(f)
                    counter += 1
                if key in self.weight_wrapper_patches:
                    getattr(m, fname).extend(self.weight_wrapper_patches[key])
        if untouched:
            log_once("unpatchable-keys", "Layer Offload: %d patched weight(s) are not on ComfyUI cast-capable "
                     "layers and are left unpatched (LoRA on plain nn.Parameters is not supported while offloaded).",
                     untouched)
        return counter

    def _lo_clear_weight_functions(self, root: torch.nn.Module) -> None:
        for m in root.modules():
            if hasattr(m, "comfy_cast_weights"):
                m.weight_function = []
                m.bias_function = []

    def load(self, device_to: Any = None, lowvram_model_memory: int = 0, force_patch_weights: bool = False,
             full_load: bool = False, **kwargs: Any) -> None:
        """Place the engine's resident set and slot ring (within the pack's budget) and install patch functions."""
        root, prefix, st = self._lo()
        if st is None:
            return super().load(device_to, lowvram_model_memory=lowvram_model_memory,
                                force_patch_weights=force_patch_weights, full_load=full_load, **kwargs)
        if force_patch_weights:
            log_once("force-patch", "Layer Offload: force_patch_weights is ignored; patches are applied on the fly "
                     "so the pinned host weights stay unpatched.", level=logging.INFO)
        if device_to is None:
            device_to = self.load_device
        with self.use_ejected():
            self.unpatch_hooks()
            _reassert_budget(st)
            patch_counter = self._lo_set_weight_functions(root, prefix)
            reset = getattr(st.handle, "reset_stats", None)
            if callable(reset):
                reset()  # the report describes the run this load serves, not every run since setup
            st.handle.load()
            for _, m in self._lo_outside_params(root):
                _move_own_tensors(m, device_to)
            self.model.device = device_to
            self.model.model_lowvram = True
            self.model.lowvram_patch_counter = patch_counter
            self.model.model_loaded_weight_memory = self.loaded_size()
            self.model.model_offload_buffer_memory = 0
            self.model.current_weight_patches_uuid = self.patches_uuid
            if CallbacksMP is not None:
                for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
                    callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
            self.apply_hooks(self.forced_hooks, force_apply=True)

    def partially_load(self, device_to: Any, extra_memory: int = 0, force_patch_weights: bool = False,
                       **kwargs: Any) -> int:
        """Load up to the engine's plan (the pack's budget decides, not ComfyUI's lowvram split); return bytes added."""
        root, _, st = self._lo()
        if st is None:
            return super().partially_load(device_to, extra_memory, force_patch_weights=force_patch_weights, **kwargs)
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            before = self.loaded_size()
            self.unpatch_model(self.offload_device, unpatch_weights=False)
            self.patch_model(load_weights=False)
            if extra_memory < 0:
                self.partially_unload(self.offload_device, -extra_memory)
                return 0
            try:
                self.load(device_to, lowvram_model_memory=before + extra_memory,
                          force_patch_weights=force_patch_weights, full_load=False)
            except Exception:
                self.detach()
                raise
            return max(0, self.loaded_size() - before)

    def partially_unload(self, device_to: Any, memory_to_free: int = 0, force_patch_weights: bool = False,
                         **kwargs: Any) -> int:
        """Free at least `memory_to_free` device bytes (the engine evicts resident units, then the ring)."""
        root, _, st = self._lo()
        if st is None:
            return super().partially_unload(device_to, memory_to_free, force_patch_weights=force_patch_weights,
                                            **kwargs)
        before = self.loaded_size()
        freed = int(st.handle.unload(int(memory_to_free)) or 0)
        if freed < memory_to_free:
            freed += int(st.handle.unload(None) or 0)
        after = self.loaded_size()
        freed = max(freed, before - after)
        self.model.model_loaded_weight_memory = after
        log.debug("Layer Offload: %s freed %.1f MB (asked %.1f MB), %.1f MB remain", st.name, freed / 2 ** 20,
                  memory_to_free / 2 ** 20, after / 2 ** 20)
        return freed

    def unpatch_model(self, device_to: Any = None, unpatch_weights: bool = True) -> None:
        """Undo object patches; with unpatch_weights, also drop every device copy (the host master stays)."""
        root, _, st = self._lo()
        if st is None:
            return super().unpatch_model(device_to, unpatch_weights)
        self.eject_model()
        if unpatch_weights:
            self.unpatch_hooks()
            st.handle.unload(None)
            self._lo_clear_weight_functions(root)
            self.model.model_lowvram = False
            self.model.lowvram_patch_counter = 0
            self.model.current_weight_patches_uuid = None
            self.backup.clear()
            if device_to is not None:
                for _, m in self._lo_outside_params(root):
                    _move_own_tensors(m, device_to)
                self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
            self.model.model_offload_buffer_memory = 0
        for k in list(self.object_patches_backup.keys()):
            comfy.utils.set_attr(self.model, k, self.object_patches_backup[k])
        self.object_patches_backup.clear()

    def patch_weight_to_device(self, key: str, device_to: Any = None, inplace_update: bool = False,
                               **kwargs: Any) -> Any:
        """Never bake patches into an offloaded weight: the pinned host master must stay the original."""
        root, prefix, st = self._lo()
        if st is not None and key.startswith(prefix):
            log_once("patch-weight", "Layer Offload: baking patches into offloaded weights is skipped; "
                     "they are applied on the fly instead.", level=logging.INFO)
            return None
        return super().patch_weight_to_device(key, device_to=device_to, inplace_update=inplace_update, **kwargs)

    def pin_weight_to_device(self, key: str) -> None:
        """The engine already keeps offloaded weights pinned; ComfyUI must not pin them again."""
        root, prefix, st = self._lo()
        if st is not None and key.startswith(prefix):
            return None
        return super().pin_weight_to_device(key)


_CLASSES: Dict[type, type] = {}


def patcher_class_for(patcher: Any) -> type:
    """The offload class for a patcher: OffloadModelPatcher, or a mix-in over another pack's subclass.

    A dynamic (DynamicVRAM) patcher class is never used as a base: the result stays a plain ModelPatcher.
    """
    base = type(patcher)
    if isinstance(patcher, OffloadPatcherMixin):
        return base
    dynamic_cls = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if base is ModelPatcher or _claims_dynamic(patcher) or (dynamic_cls is not None and issubclass(base, dynamic_cls)):
        return OffloadModelPatcher
    if not issubclass(base, ModelPatcher):
        raise TypeError("not a ComfyUI ModelPatcher: {}".format(base.__name__))
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type("Offload" + base.__name__, (OffloadPatcherMixin, base), {"__module__": __name__})
        _CLASSES[base] = cls
    return cls


class OffloadModelPatcher(OffloadPatcherMixin, ModelPatcher):
    """A plain, non-dynamic ModelPatcher whose weights the Layer Offload engine streams."""


def _claims_dynamic(patcher: Any) -> bool:
    """True for DynamicVRAM patchers (feature-detected: older ComfyUI has no is_dynamic at all)."""
    fn = getattr(patcher, "is_dynamic", None)
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:  # noqa: BLE001 - a broken is_dynamic means: treat as not dynamic
        return False


def non_dynamic(patcher: Any) -> Any:
    """A non-dynamic equivalent of `patcher` (DynamicVRAM patchers re-created without it when ComfyUI can)."""
    if not _claims_dynamic(patcher):
        return patcher
    try:
        n = patcher.clone(disable_dynamic=True)
        if not _claims_dynamic(n):
            log_once("dynamic-delegate", "Layer Offload: DynamicVRAM model re-created as a plain ModelPatcher for "
                     "offloading.", level=logging.INFO)
            return n
    except Exception as e:  # noqa: BLE001 - any failure just means: offload the dynamic model's weights as they are
        log_once("dynamic-fallback", "Layer Offload: could not get a non-dynamic copy of a DynamicVRAM model (%s); "
                 "offloading its weights directly.", e)
    return patcher


def _planned_bytes(st: Managed) -> Optional[int]:
    """Device bytes the engine plans for this model: what it wants, capped by its share of the budget."""
    handle = st.handle
    want = getattr(handle, "want_bytes", None)
    if not callable(want):
        return None
    planned = int(want())
    budget = getattr(handle, "budget", None)
    targets = getattr(budget, "targets", None)
    if callable(targets):
        share = targets().get(id(handle))
        if share is not None:
            planned = min(planned, int(share))
    return planned


def _reassert_budget(st: Managed) -> None:
    """A model wired to a VRAM Budget node re-applies that budget when it loads (the latest loaded wins)."""
    spec = st.budget
    apply = getattr(spec, "apply", None)
    if callable(apply):
        apply()
