"""Tensors added to or taken from an offloaded model: laid out again, so they live where their unit lives.

peft adds LoRA layers (`load_lora_weights`, `add_adapter`) on the base weight's device, which between passes is
the engine's host master: left there, a streamed block would compute its adapter from host memory (a device
mismatch on CUDA). `unload_lora_weights` and `fuse_qkv_projections` take tensors away or add others. torch's
process-wide registration hooks (a parameter, buffer or module registered on any module) move a counter; at the
next pass start a model whose counter moved compares the tensors its modules hold with its layouts, and a unit (or
the weights outside the blocks) whose set of tensors changed is laid out and staged again from the values it
holds now: its adapters then stream with it (or stay resident with it), are on the device whenever it computes,
and are written back, fused or not, like its own weights. The model is unloaded first (a resident copy written
on the device catches its host master up) and re-planned for the new sizes. Adapters added to train
(new parameters requiring grad, found at the start of a forward with grad enabled) go with the weights outside the
blocks instead, on the device for the whole run as trainable parameters are at offload time (`model/trainable.py`):
a streamed weight cannot take gradients. A `del` of an adapter (`delete_adapters`) moves no counter: its tensors keep streaming, unused, until the next registration or detach.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from ..model.layout import TensorLayout, plan_layout, unit_tensors
from ..model.trainable import TRAINABLE_DTYPES
from ..store.staging import StagingBuffer, make_ram_source
from .buffer_writes import BufferWatch
from .data_watch import read_data, set_data

log = logging.getLogger(__name__)

_epoch = [0]  # registrations seen in this process since the hooks went in
_installed = [False]


def _registered(*args: Any) -> None:
    _epoch[0] += 1


def install() -> None:
    """torch's global registration hooks, once per process: any parameter, buffer or module registered moves the
    counter (one integer add; setups that build models register many, and each offloaded model then looks once)."""
    if not _installed[0]:
        nn.modules.module.register_module_parameter_registration_hook(_registered)
        nn.modules.module.register_module_buffer_registration_hook(_registered)
        nn.modules.module.register_module_module_registration_hook(_registered)
        _installed[0] = True


def epoch() -> int:
    return _epoch[0]


Location = tuple[int, str, str]


def _locations(layout: TensorLayout) -> set[Location]:
    return {(id(m), a, k) for e in layout.entries for m, a, k in e.locations}


def changed_parts(model: nn.Module, staged: Any) -> tuple[list[int], set[Location] | None]:
    """The units whose modules now hold other tensors than their layouts, and the rest's tensors now if they changed
    (those of the model outside every unit, the ones inside units the rest held already, and new trainable ones)."""
    rest_locs = _locations(staged.rest.layout)
    outside = {(id(m), a, k) for m, a, k, _ in unit_tensors(model)}
    training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    changed: list[int] = []
    for u in staged.units:
        tensors = unit_tensors(u.module)
        live = {(id(m), a, k) for m, a, k, _ in tensors}
        known = _locations(u.master.layout)
        if training:  # adapters added to train (a forward with grad): on the device with the rest, as at offload time
            live -= {(id(m), a, k) for m, a, k, t in tensors if (id(m), a, k) not in known and k == "param"
                     and t.requires_grad and t.dtype in TRAINABLE_DTYPES}
        outside -= live - rest_locs
        if live - rest_locs != known:
            changed.append(u.index)
    return changed, (outside if outside != rest_locs else None)


def _fresh_master(layout_of: list[tuple[nn.Module, str, str, torch.Tensor]], old: StagingBuffer, backend: Any,
                  pin: bool) -> StagingBuffer:
    """A RAM master over `layout_of` (the tensors the part holds now), from their current values; tensors the part no
    longer holds get ordinary copies of their values (their modules were taken out of the model)."""
    kept = {(id(m), a, k) for m, a, k, _ in layout_of}
    for entry in old.layout.entries:
        if entry.plain_param and not any((id(m), a, k) in kept for m, a, k in entry.locations):
            param = entry.own()
            if param is not None:
                set_data(param, read_data(param).clone())
    layout = plan_layout(layout_of)
    return StagingBuffer.in_ram(layout, backend.alloc_host, pin)


def restage(streamer: Any) -> bool:
    """Lay out again the parts of the model whose tensors changed (see the module docstring); True if any did.
    The caller holds the pass lock with nothing computing."""
    model = streamer._model()
    if model is None:
        return False
    staged = streamer.staged
    units, rest_live = changed_parts(model, staged)
    if not units and rest_live is None:
        return False
    streamer.unload()  # nothing on the device: resident copies written there catch their host masters up first
    rest_locs = _locations(staged.rest.layout)
    backend, pin = streamer.backend, streamer.pin_memory
    for i in units:
        u = streamer.units[i]
        in_rest = rest_locs | (rest_live or set())
        tensors = [t for t in unit_tensors(u.staged.module) if (id(t[0]), t[1], t[2]) not in in_rest]
        master = _fresh_master(tensors, u.staged.master, backend, pin)
        u.staged.master = master
        u.staged.source = streamer.sources[i] = make_ram_source(master, backend, staged.reader)
        u.slot_bindings.clear()
        u.device_newer = False
        u.mark = master.layout.version()
        streamer.buffers.watch[i] = BufferWatch(master.layout)
    if rest_live is not None:
        tensors = [t for t in unit_tensors(model) if (id(t[0]), t[1], t[2]) in rest_live]
        staged.rest = _fresh_master(tensors, staged.rest, backend, False)
        staged.rest_bytes = staged.rest.layout.nbytes if staged.rest.layout.entries else 0
        p = streamer.placement
        p.rest_source = make_ram_source(staged.rest, backend, None)
        p.rest_mark = staged.rest.layout.version()
        p.rest_device_newer = False
        streamer.buffers.rest_watch = BufferWatch(staged.rest.layout)
    streamer.changes.layouts[:] = [u.staged.layout for u in streamer.units] + [staged.rest.layout]
    streamer.writes.watch_data()
    streamer.writes._bound_key = None
    streamer.order_learned = False
    streamer._seen = []
    listener = streamer._listener()
    resized = getattr(listener, "units_resized", None)
    if resized is not None:
        resized()
    log.info("%s: tensors added or removed after offloading (adapters) in %d block(s)%s: laid out again",
             type(model).__name__, len(units), " and the weights outside the blocks" if rest_live is not None else "")
    return True


def resized_facts(base: Any, streamer: Any) -> Any:
    """The plan facts of a model whose units were laid out again: their sizes, dtypes and host tiers now."""
    units = streamer.units
    return replace(base, sizes=tuple(u.nbytes for u in units), rest_bytes=streamer.staged.rest_bytes,
                   dtypes=tuple(tuple(sorted({str(leaf.dtype) for leaf in u.staged.layout.leaves})) for u in units),
                   disk_ok=tuple(ok and u.master.host is None for ok, u in zip(base.disk_ok, units))
                   if base.disk_ok else base.disk_ok,
                   host_tiers=tuple("disk" if u.master.host is None else ("pinned" if u.master.pinned else "pageable")
                                    for u in units) if base.host_tiers else base.host_tiers)
