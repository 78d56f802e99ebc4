"""The ModelPatcher class for offloaded models: truthful accounting with comfy.model_management.

ComfyUI loads every model through `load_models_gpu`, which calls `partially_load` / `load` / `partially_unload`
/ `detach` on the patcher and reads `model_size()` / `loaded_size()` (and, where it has them, the RAM and pin
figures). The offload class keeps those calls working while the engine owns the weights: units live where the
engine puts them (host master + device slot ring), ComfyUI never moves them with `.to()`, and patches apply on
the fly (nodes/patches.py).

How the class is made, so that it survives ComfyUI's class changes (0.12's ModelPatcher has typing.Protocol
bases): `offload_class_for(base)` is `type("Offload" + base.__name__, (base,), methods)`, a plain subclass with
the base's own layout, and an offload patcher is built (our class's `clone`, which constructs `self.__class__`)
or made by moving a base clone's state into a new instance. Nothing assigns `__class__`.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.utils
from comfy.model_patcher import ModelPatcher

from . import host_memory, patches
from . import patcher_accounting as pa
from . import patcher_baking as pb
from .common import log_once
from .registry import Managed, managed_root, track_patcher

log = logging.getLogger("layer_offload")

try:  # CallbacksMP / WrappersMP exist on every supported ComfyUI; keep the import soft anyway.
    from comfy.patcher_extension import CallbacksMP, WrappersMP
except ImportError:  # pragma: no cover - very old ComfyUI
    CallbacksMP = WrappersMP = None

REPORT_WRAPPER_KEY = "layer_offload_report"


class OffloadPatcherMethods:
    """The methods every offload patcher class gets, copied into a subclass of the patcher class it wraps.

    Calls to the wrapped class go through `self._lo_base` (never zero-argument super(): the methods are not
    defined inside the class that uses them).
    """

    _lo_base: type = ModelPatcher
    _lo_offload = True

    def clone(self, *args: Any, **kwargs: Any) -> Any:
        """A clone of the same offload class (tracked, so the engine lets the model go with its last patcher)."""
        n = type(self)._lo_base.clone(self, *args, **kwargs)
        if not isinstance(n, type(self)):  # a pack's clone that builds its own class (ComfyUI-GGUF's does)
            n = adopt(n, type(self))
        _, _, st = managed_root(n.model)
        src = managed_root(self.model)[2]
        if st is None and src is not None and n.model is not self.model and src.reoffload is not None:
            # clone(force_deepcopy=True) (Train LoRA since ComfyUI 0.2x) re-loads a model of its own: offload that
            # copy the way this one is, so training streams it too instead of loading all of it
            n = src.reoffload(n, src)
            _, _, st = managed_root(n.model)
        if st is not None:
            track_patcher(n, st)
            # ComfyUI's clone keeps current_hooks (a plain model's weights still carry them): so do the patch stages
            n.__dict__[patches.HOOK_PATCHES_ATTR] = self.__dict__.get(patches.HOOK_PATCHES_ATTR)
        if "fast_disk" in self.__dict__ and getattr(n, "fast_disk", None) != self.fast_disk:
            n.fast_disk = self.fast_disk  # 0.39's per-model setting, which a pack's own clone may not carry over
        return n

    def is_dynamic(self) -> bool:
        """Never dynamic: the engine, not DynamicVRAM, decides what lives on the device."""
        return False

    def get_non_dynamic_delegate(self) -> Any:
        return self

    def _lo(self) -> Tuple[Optional[torch.nn.Module], str, Optional[Managed]]:
        return managed_root(self.model)

    # accounting -----------------------------------------------------------------
    def loaded_size(self) -> int:
        """Device bytes held now: resident units + slot ring + non-block tensors + KV pages (asked of the engine)."""
        root, _, st = self._lo()
        if st is None:
            return self._lo_base.loaded_size(self)
        return int(st.handle.device_bytes()) + int(st.handle.kv_device_bytes()) + pa.outside_device_bytes(self, root)

    def model_size(self) -> int:
        """What this model wants on the device at most: its planned resident set + slot ring, not its full size."""
        root, _, st = self._lo()
        if st is None:
            return self._lo_base.model_size(self)
        planned = max(int(st.handle.planned_device_bytes()), int(st.handle.device_bytes()))
        full = comfy.model_management.module_size(self.model)
        return max(1, min(full, planned)) if full > 0 else planned

    def get_ram_usage(self) -> int:
        """Host RAM the model holds: its blocks in RAM (not those on the disk tier) and everything else."""
        root, _, st = self._lo()
        if st is None:
            return self._lo_base.get_ram_usage(self)
        host = st.handle.host_memory()
        outside = sum(t.nelement() * t.element_size() for _, m in pa.outside_modules(self, root)
                      for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
        return int(host["ram"]) + outside

    def loaded_ram_size(self) -> int:
        return self.get_ram_usage()

    def pinned_memory_size(self) -> int:
        """Pinned host bytes the engine holds for this model (staging buffers and bounce buffers)."""
        _, _, st = self._lo()
        if st is None:
            fn = getattr(self._lo_base, "pinned_memory_size", None)
            return fn(self) if callable(fn) else 0
        return int(st.handle.host_memory()["pinned"])

    def model_mmap_residency(self, free: bool = False) -> Tuple[int, int]:
        """(bytes resident in RAM, bytes of the model): blocks on the disk tier are the part not resident."""
        _, _, st = self._lo()
        if st is None:
            fn = getattr(self._lo_base, "model_mmap_residency", None)
            if callable(fn):
                return fn(self, free=free)
            size = comfy.model_management.module_size(self.model)
            return size, size
        ram = self.get_ram_usage()
        return ram, ram + int(st.handle.host_memory()["disk"])

    def partially_unload_ram(self, ram_to_unload: int, *args: Any, **kwargs: Any) -> int:
        """ComfyUI is short of RAM: move blocks to the disk tier where the model's file holds their exact bytes."""
        _, _, st = self._lo()
        if st is None:
            fn = getattr(self._lo_base, "partially_unload_ram", None)
            return fn(self, ram_to_unload, *args, **kwargs) if callable(fn) else 0
        freed = int(st.handle.release_host_memory(int(max(0, ram_to_unload))))
        if freed:
            log.info("Layer Offload: %s moved %.1f MB of blocks from RAM to the disk tier at ComfyUI's request",
                     st.name, freed / 2 ** 20)
        return freed

    # load / unload --------------------------------------------------------------
    def load(self, device_to: Any = None, lowvram_model_memory: int = 0, force_patch_weights: bool = False,
             full_load: bool = False, **kwargs: Any) -> None:
        """Place the engine's resident set and slot ring (within the pack's budget) and install patch functions.

        `force_patch_weights` (how ComfyUI 0.3.x saves a checkpoint) bakes the patches into the host weights, with
        backups that the next load of any patcher of this model restores first, exactly as a plain load does.
        """
        root, prefix, st = self._lo()
        if st is None:
            return self._lo_base.load(self, device_to, lowvram_model_memory=lowvram_model_memory,
                                      force_patch_weights=force_patch_weights, full_load=full_load, **kwargs)
        if device_to is None:
            device_to = self.load_device
        with self.use_ejected():
            self.unpatch_hooks()
            pb.restore_baked(st)
            pb.restore_shared_backups(self)
            pa.reassert_budget(st)
            if force_patch_weights:
                pb.bake(self, st, prefix)
                patch_counter = 0
                patches.clear(self, root)
            else:
                patch_counter = patches.install(self, root, prefix)
            st.handle.reset_stats()  # the report describes the run this load serves, not every run since setup
            pa.mark_active(self, st)
            st.handle.load()
            for _, m in pa.outside_modules(self, root):
                pa.move_own_tensors(m, device_to)
            pa.set_loaded(self, self.loaded_size(), True, patch_counter, self.patches_uuid, device_to)
            if CallbacksMP is not None:
                for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
                    callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
            self.apply_hooks(self.forced_hooks, force_apply=True)

    def partially_load(self, device_to: Any, extra_memory: int = 0, force_patch_weights: bool = False,
                       **kwargs: Any) -> int:
        """Load up to the engine's plan (the pack's budget decides, not ComfyUI's lowvram split); return bytes added."""
        _, _, st = self._lo()
        if st is None:
            return self._lo_base.partially_load(self, device_to, extra_memory, force_patch_weights=force_patch_weights,
                                                **kwargs)
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

    def partially_unload(self, device_to: Any, memory_to_free: int = 0, *args: Any, **kwargs: Any) -> int:
        """Free at least `memory_to_free` device bytes (the engine evicts resident units, then the ring)."""
        _, _, st = self._lo()
        if st is None:
            return self._lo_base.partially_unload(self, device_to, memory_to_free, *args, **kwargs)
        before = self.loaded_size()
        freed = int(st.handle.unload(int(memory_to_free)) or 0)
        if freed < memory_to_free:
            freed += int(st.handle.unload() or 0)
        after = self.loaded_size()
        freed = max(freed, before - after)
        pa.accounting(self).model_loaded_weight_memory = after
        log.debug("Layer Offload: %s freed %.1f MB (asked %.1f MB), %.1f MB remain", st.name, freed / 2 ** 20,
                  memory_to_free / 2 ** 20, after / 2 ** 20)
        return freed

    # weight hooks --------------------------------------------------------------
    def patch_hooks(self, hooks: Any) -> None:
        """Weight hooks (scheduled LoRA) as a patch stage computed on the device, not written into the host master.

        ComfyUI writes them into the weights in place (through `.data`, between the passes of a step); the engine's
        host copy is the truth and copies already queued for the next pass would miss such a write. Weights outside
        the offloaded root are ComfyUI's own and patched its way."""
        root, prefix, st = self._lo()
        if st is None:
            return self._lo_base.patch_hooks(self, hooks)
        with self.use_ejected():
            self.unpatch_hooks()
            if hooks is not None:
                combined = self.get_combined_hook_patches(hooks=hooks)
                inside = {k: v for k, v in combined.items() if k.startswith(prefix)}
                outside = {k: v for k, v in combined.items() if not k.startswith(prefix)}
                if outside:
                    pb.patch_hooks_outside(self, hooks, outside)
                if inside:
                    originals = self.get_key_patches() if patches.needs_original_weights(inside) else None
                    patches.set_hook_patches(self, inside, originals)
                    if patches.installed_for(self, root):  # else: its load clears current_hooks, so they come back
                        patches.install(self, root, prefix)
            self.current_hooks = hooks

    def unpatch_hooks(self, whitelist_keys_set: Optional[set] = None) -> None:
        """Drop the weight-hook patch stage (and ComfyUI's in-place hook writes outside the offloaded root)."""
        root, prefix, st = self._lo()
        if st is None:
            return self._lo_base.unpatch_hooks(self, whitelist_keys_set)
        self._lo_base.unpatch_hooks(self, whitelist_keys_set)
        if patches.hook_patches_of(self)[0]:
            patches.set_hook_patches(self, None, None)
            if patches.installed_for(self, root):
                patches.install(self, root, prefix)
        self.current_hooks = None

    def unpatch_model(self, device_to: Any = None, unpatch_weights: bool = True) -> None:
        """Undo object patches; with unpatch_weights, also drop every device copy (the host master stays)."""
        root, _, st = self._lo()
        if st is None:
            return self._lo_base.unpatch_model(self, device_to, unpatch_weights)
        self.eject_model()
        if unpatch_weights:
            self.unpatch_hooks()
            st.handle.unload()
            pb.restore_baked(st)
            pb.restore_shared_backups(self)
            patches.clear(self, root)
            self.backup.clear()
            if device_to is not None:
                for _, m in pa.outside_modules(self, root):
                    pa.move_own_tensors(m, device_to)
            pa.set_loaded(self, 0, False, 0, None, device_to)
        for k in list(self.object_patches_backup.keys()):
            comfy.utils.set_attr(self.model, k, self.object_patches_backup[k])
        self.object_patches_backup.clear()

    def patch_weight_to_device(self, key: str, device_to: Any = None, inplace_update: bool = False,
                               return_weight: bool = False, **kwargs: Any) -> Any:
        """Never bake patches into an offloaded weight (its host master must stay the original); with
        `return_weight` (how ComfyUI saves and merges a model) return the patched weight, computed like a full load."""
        root, prefix, st = self._lo()
        if st is None or not key.startswith(prefix):
            if return_weight:
                kwargs["return_weight"] = True
            return self._lo_base.patch_weight_to_device(self, key, device_to=device_to, inplace_update=inplace_update,
                                                        **kwargs)
        if return_weight:
            weight, _, _ = comfy.model_patcher.get_key_weight(self.model, key)
            if key not in self.patches or key in st.baked:
                return weight
            return patches.patched_weight(self.model, key, self.patches, device_to or self.offload_device)
        log_once("patch-weight", "Layer Offload: baking patches into offloaded weights is skipped; they are applied "
                 "on the fly instead.", level=logging.INFO)
        return None

    def state_dict_for_saving(self, *args: Any, **kwargs: Any) -> Any:
        """What ComfyUI 0.8+ saves: every patched weight of the offloaded model (plain parameters included) is
        handed out patched, computed from the unpatched host master like a full load bakes it."""
        root, prefix, st = self._lo()
        base = getattr(self._lo_base, "state_dict_for_saving", None)
        if st is None or prefix != "diffusion_model.":
            return base(self, *args, **kwargs)
        lazy = getattr(comfy.model_patcher, "LazyCastingParam", None)
        unet = self.model.diffusion_model.state_dict()
        for k in list(unet):
            key = prefix + k
            if key in self.patches and key not in st.baked:
                current = comfy.utils.get_attr(self.model, key)
                unet[k] = lazy(self, key, current) if lazy is not None else \
                    patches.patched_weight(self.model, key, self.patches, self.offload_device)
        return self.model.state_dict_for_saving(unet, *args, **kwargs)

    def pin_weight_to_device(self, key: str) -> None:
        """The engine already keeps offloaded weights pinned; ComfyUI must not pin them again."""
        _, prefix, st = self._lo()
        if st is not None and key.startswith(prefix):
            return None
        return self._lo_base.pin_weight_to_device(self, key)


_METHODS = {k: v for k, v in vars(OffloadPatcherMethods).items() if not k.startswith("__") or k == "__doc__"}
_CLASSES: Dict[type, type] = {}


def offload_class_for(base: type) -> type:
    """The offload patcher class over `base` (ModelPatcher or another pack's subclass), made once per base.

    A DynamicVRAM class is never used as a base: its offload class is the one over plain ModelPatcher.
    """
    if getattr(base, "_lo_offload", False):
        return base
    dynamic_cls = getattr(comfy.model_patcher, "ModelPatcherDynamic", None)
    if dynamic_cls is not None and issubclass(base, dynamic_cls):
        base = ModelPatcher
    if not issubclass(base, ModelPatcher):
        raise TypeError("not a ComfyUI ModelPatcher: {}".format(base.__name__))
    cls = _CLASSES.get(base)
    if cls is None:
        ns = dict(_METHODS, _lo_base=base, __module__=__name__,
                  __doc__="{} whose weights the Layer Offload engine streams.".format(base.__name__))
        if not callable(getattr(base, "state_dict_for_saving", None)):
            del ns["state_dict_for_saving"]  # ComfyUI < 0.8 has none: savers feature-detect it on the patcher
        cls = type("Offload" + base.__name__, (base,), ns)
        _CLASSES[base] = cls
    return cls


OffloadModelPatcher = offload_class_for(ModelPatcher)


def is_offload_patcher(patcher: Any) -> bool:
    return bool(getattr(type(patcher), "_lo_offload", False))


def adopt(patcher: Any, cls: type) -> Any:
    """A new `cls` instance holding `patcher`'s state: how a base clone becomes an offload patcher."""
    n = cls.__new__(cls)
    n.__dict__.update(patcher.__dict__)
    n.__dict__.pop("_lo_tracked_for", None)
    return n


def as_offload_patcher(patcher: Any) -> Any:
    """An offload patcher for `patcher`'s model: a clone of an offload patcher, or a base clone's state moved
    into the offload class over the patcher's own class (plain ModelPatcher for a DynamicVRAM one)."""
    if is_offload_patcher(patcher):
        return patcher.clone()
    cls = offload_class_for(type(patcher))
    if _claims_dynamic(patcher):
        cls = OffloadModelPatcher
    return adopt(patcher.clone(), cls)


def _claims_dynamic(patcher: Any) -> bool:
    """True for DynamicVRAM patchers (feature-detected: older ComfyUI has no is_dynamic at all)."""
    fn = getattr(patcher, "is_dynamic", None)
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:  # noqa: BLE001 - a broken is_dynamic means: treat as not dynamic
        return False


def add_report_wrapper(patcher: Any, publish: Any) -> None:
    """Publish the report when sampling ends (an OUTER_SAMPLE wrapper), so the panel is live in every workflow."""
    if WrappersMP is None or not hasattr(patcher, "add_wrapper_with_key"):
        return

    def outer_sample(executor: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return executor(*args, **kwargs)
        finally:
            publish()

    patcher.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, REPORT_WRAPPER_KEY) \
        if hasattr(patcher, "remove_wrappers_with_key") else None
    patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, REPORT_WRAPPER_KEY, outer_sample)


host_memory.install()  # the engine's pins in ComfyUI's pin budget, its RAM under ComfyUI's RAM pressure
