"""Write detection between passes: weights written in place, parameters another owner replaced, and parameters
whose `.data` was replaced (`param.data = tensor`: taken into the engine's copy, see offload/model/model_changes.py).

Version counters of the tensors bound between forwards tell which units were written (load_state_dict, a
merged patch): a streamed unit's queued copies are stale, a disk-tier unit leaves the disk tier, a resident
unit's host master catches up when it is evicted. A module holding a Parameter that is not the engine's own is
taken back when it is over the engine's bytes, and otherwise runs as its owner set it up (a foreign unit).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..model.layout import Binding, Entry, TensorLayout
from ..model.model_changes import ModelChangedError
from ..store.compressed import master_written
from ..store.staging import StagedModel
from .data_watch import DataWatch, read_data
from .host_tiers import HostTiers
from .placement import DevicePlacement, UnitState
from .prefetch import PrefetchWorker

log = logging.getLogger(__name__)


class WriteWatch:
    """Notices, at a safe point, what changed in the model's weights since the last pass."""

    def __init__(self, staged: StagedModel, units: list[UnitState], placement: DevicePlacement, host: HostTiers,
                 worker: PrefetchWorker) -> None:
        self.staged = staged
        self.units = units  # shared with the streamer (the same list object)
        self.placement = placement
        self.host = host
        self.worker = worker
        self.foreign: set[int] = set()  # units whose parameters another owner's tensors replace this pass
        self._bound_key: list[int] | None = None  # what `_bound` was made for (device copies, host bindings)
        self._bound: list[tuple[Any, int]] = []  # (parameter, where its data starts when bound)
        self.data = DataWatch()  # parameters reached through `.data` (peft's fuse_lora writes so)
        self.watch_data()

    def watch_data(self) -> None:
        """Watch `.data` of every parameter the engine staged (again after a unit was laid out anew)."""
        pairs = [(u.index, e.param) for u in self.units for e in u.staged.layout.param_entries]
        pairs += [(-1, e.param) for e in self.staged.rest.layout.param_entries]
        self.data.watch(pairs)

    def reclaim(self) -> None:
        """Take back parameters that hold the engine's own bytes (ComfyUI restoring a backup wraps them in a new
        Parameter), and step aside for units whose parameters another owner replaced with other bytes (a plain clone
        of the same model that baked a LoRA in): those run as that owner set them up until it gives them back."""
        foreign = {u.index for u in self.units if not u.staged.layout.reclaim()}
        self.staged.rest.layout.reclaim()
        if foreign != self.foreign:
            if foreign:
                log.info("%d block(s) hold another patcher's weights this pass (a plain clone of the same model); they "
                         "run as it set them up until it gives them back", len(foreign))
            self.foreign = foreign
            self.worker.set_skip(foreign)  # restarts the lookahead without them
        self.take_replaced_data()

    def take_replaced_data(self) -> None:
        """Parameters whose `.data` someone replaced since the engine bound them (`param.data = tensor`, a merge that
        assigns `.data`): the new values take effect, copied into the engine's copy (the host master of a streamed
        unit, the device copy of a resident one, which marks it newer), and the parameter views the engine's bytes
        again. Another shape or dtype cannot: ModelChangedError naming the parameter and detach()."""
        if self._all_bound():
            return  # the common case, one pointer comparison per parameter
        stale = False
        for u in self.units:
            if u.index in self.foreign:
                continue
            layout = u.staged.layout
            if u.resident_buf is not None:
                if _take_into_device(layout, u.resident_buf, u.staged.name):
                    u.device_newer = True
                continue
            binding = u.master.host_binding
            if _binding_intact(binding):
                continue
            if u.master.host is None:
                _check_replacements(layout, binding, u.staged.name)
                self.host.promote_to_ram(u)  # a disk-tier unit: its RAM master is made from the new values
            else:
                _take_into_host(layout, binding, u.master.host, u.staged.name)
                master_written(u.staged.source)
            u.master.host_binding.apply()
            u.mark = layout.version()
            stale = True
        rest, p = self.staged.rest, self.placement
        if p.rest_buf is not None:
            if _take_into_device(rest.layout, p.rest_buf, "the weights outside the blocks"):
                p.rest_device_newer = True
        elif rest.host is not None and not _binding_intact(rest.host_binding):
            _take_into_host(rest.layout, rest.host_binding, rest.host, "the weights outside the blocks")
            rest.host_binding.apply()
        if stale:
            log.info("parameters had their .data replaced since the last pass: the new values are streamed")
            self.worker.restart()

    def _all_bound(self) -> bool:
        """Every plain parameter views the bytes the engine bound it to (a flat list of expected pointers, rebuilt
        when a unit's device copy or host binding changed)."""
        p, rest = self.placement, self.staged.rest
        key = [id(u.resident_buf) if u.resident_buf is not None else id(u.staged.master.host_binding)
               for u in self.units]
        key.append(id(p.rest_buf) if p.rest_buf is not None else id(rest.host_binding))
        if key != self._bound_key:
            expected: list[tuple[Any, int]] = []
            for u in self.units:
                if u.resident_buf is not None:
                    expected.extend((e.own(), ptr) for e, ptr in _device_ptrs(u.staged.layout, u.resident_buf))
                else:
                    expected.extend(_host_ptrs(u.master.host_binding))
            if p.rest_buf is not None:
                expected.extend((e.own(), ptr) for e, ptr in _device_ptrs(rest.layout, p.rest_buf))
            elif rest.host is not None:
                expected.extend(_host_ptrs(rest.host_binding))
            self._bound_key, self._bound = key, expected
        for param, ptr in self._bound:
            if param.data_ptr() != ptr:
                return False
        return True

    def check_writes(self) -> None:
        """Notice weights written in place between forwards (load_state_dict, a merged patch).

        A streamed unit's host master changed: copies already queued for it are stale, so the lookahead is
        restarted. A disk-tier unit written in place leaves the disk tier (its bytes now differ from the file).
        A resident unit's device copy changed: the host master catches up when it is evicted.
        """
        stale = self._data_written()
        for u in self.units:
            if u.index in self.foreign:
                continue
            v = u.staged.layout.version()
            if v != u.mark:
                u.mark = v
                if u.resident_buf is not None:
                    u.device_newer = True
                else:
                    if u.master.host is None:
                        self.host.promote_to_ram(u)
                    master_written(u.staged.source)
                    stale = True
            if u.master.shared is not None and u.master.shared.written():
                self.host.privatize(u)  # the other processes sharing its host copy keep the original bytes
                stale = True
        self._check_rest()
        if stale:
            log.debug("weights changed in place; restarting the lookahead")
            self.worker.restart()

    def _data_written(self) -> bool:
        """Units whose parameters were reached through `.data` since the last look (a write the version counters
        miss: peft's fuse_lora): a resident copy is newer than its host master, a streamed unit's queued copies are
        stale, a disk-tier unit whose views now differ from the file gets a RAM master. True: restart the lookahead."""
        touched = self.data.take()
        stale = False
        for i in touched:
            if i == -1:
                self.placement.rest_device_newer |= self.placement.rest_buf is not None
                continue
            if i >= len(self.units) or i in self.foreign:
                continue
            u = self.units[i]
            u.mark = u.staged.layout.version()
            if u.resident_buf is not None:
                u.device_newer = True
            else:
                if u.master.host is None and self.host.differs_from_file(u):
                    self.host.promote_to_ram(u)
                stale = True
        if touched:
            log.debug("%d unit(s) reached through .data since the last pass: taken as written", len(touched))
        return stale

    def _check_rest(self) -> None:
        p = self.placement
        v = self.staged.rest.layout.version()
        if v != p.rest_mark:
            p.rest_mark = v
            p.rest_device_newer = p.rest_buf is not None

    def mark_all_written(self, computing: Any) -> None:
        """Weights were written in a way version counters miss (through `.data`): treat everything as changed.
        `computing` is the unit running now (None between passes): the lookahead restarts only when none is."""
        p = self.placement
        for u in self.units:
            u.mark = u.staged.layout.version()
            if u.resident_buf is not None:
                u.device_newer = True
            elif u.master.host is None and self.host.differs_from_file(u):
                self.host.promote_to_ram(u)
            elif u.master.shared is not None and u.master.shared.has_private_pages():
                self.host.privatize(u)
            else:
                master_written(u.staged.source)
        p.rest_device_newer = p.rest_buf is not None
        p.rest_mark = self.staged.rest.layout.version()
        if computing is None:
            self.worker.restart()


def _host_ptrs(binding: Binding) -> list[tuple[Any, int]]:
    return [(param, ptr) for (param, _), ptr in zip(binding.data_swaps, binding.param_ptrs()) if ptr != -1]


def _binding_intact(binding: Binding) -> bool:
    """Every parameter of a host binding still views the bytes the binding gave it."""
    for (param, _), ptr in zip(binding.data_swaps, binding.param_ptrs()):
        if ptr != -1 and param.data_ptr() != ptr:
            return False
    return True


def _replacement(entry: Entry, layout: TensorLayout, where: str) -> torch.Tensor:
    """The data a parameter holds now, checked to fit its place in the layout."""
    param = entry.own()
    new = read_data(param)
    leaf = layout.leaves[entry.recipe]
    if tuple(new.shape) != tuple(leaf.shape) or new.dtype != leaf.dtype or new.is_meta:
        module, attr, _ = entry.locations[0]
        raise ModelChangedError(
            f"{type(module).__name__}.{attr} in {where}: its .data was replaced after offloading with a "
            f"{tuple(new.shape)} {new.dtype} tensor (it streams as {tuple(leaf.shape)} {leaf.dtype}); an offloaded "
            f"parameter keeps its shape and dtype. Call handle.detach() first, change the model, then offload it again")
    return new


def _check_replacements(layout: TensorLayout, binding: Binding, where: str) -> None:
    for entry, (param, _), ptr in zip(layout.param_entries, binding.data_swaps, binding.param_ptrs()):
        if ptr != -1 and param.data_ptr() != ptr:
            _replacement(entry, layout, where)


def _take_into_host(layout: TensorLayout, binding: Binding, host: torch.Tensor, where: str) -> None:
    """Copy replaced parameters' values into the host master (the caller applies the binding again)."""
    views = None
    for entry, (param, _), ptr in zip(layout.param_entries, binding.data_swaps, binding.param_ptrs()):
        if ptr == -1 or param.data_ptr() == ptr:
            continue
        new = _replacement(entry, layout, where)
        views = views if views is not None else layout.leaf_views(host)
        with torch.no_grad():
            views[entry.recipe].copy_(new)


def _device_ptrs(layout: TensorLayout, buf: torch.Tensor) -> list[tuple[Entry, int]]:
    """Where each plain parameter's data starts in the device copy `buf` (cached while the copy stays the same)."""
    base = buf.data_ptr()
    cached = layout.__dict__.get("_device_ptrs")
    if cached is None or cached[0] != base:
        cached = (base, [(e, base + layout.leaves[e.recipe].offset) for e in layout.param_entries
                         if layout.leaves[e.recipe].nbytes])
        layout.__dict__["_device_ptrs"] = cached
    return cached[1]


def _take_into_device(layout: TensorLayout, buf: torch.Tensor, where: str) -> bool:
    """A resident copy: replaced parameters' values go into it and the parameters view it again; True if any did."""
    views = None
    for entry, ptr in _device_ptrs(layout, buf):
        param = entry.param if entry.param is not None else entry.current()
        if param.data_ptr() == ptr:
            continue
        new = _replacement(entry, layout, where)
        views = views if views is not None else layout.leaf_views(buf)
        with torch.no_grad():
            views[entry.recipe].copy_(new)
        param.data = views[entry.recipe]
    return views is not None
