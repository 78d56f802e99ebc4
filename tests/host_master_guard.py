"""A test guard: on the simulated device no compute op may read an engine's host master.

On CUDA a forward that computes with a weight still bound to its host master (a unit never entered, a tensor the
engine did not move) fails with a device mismatch. On the simulated device every "device" tensor is a CPU tensor,
so the same bug computes the right numbers and goes unseen. `HostMasterGuard` is a `TorchDispatchMode` that, while
active, looks at every op's tensor arguments (flattened; a tensor subclass's inner tensors too) and raises
`HostMasterRead`, naming the op and the tensor, when one of them lies in an engine's host buffer: a unit's flat
host buffer (`StagingBuffer.host`), the file views of a disk-tier unit, or the buffer behind the weights outside
the blocks (`StagedModel.rest`).

The engine's own work on those buffers is not a compute read: copies into a slot (`SimBackend.copy_h2d`, which
copies with `ctypes.memmove`, or `dst.copy_(src)` for a strided leaf), the byte comparisons of `WriteWatch`,
staging and detach. An op is the engine's when the innermost Python frame outside torch itself is an engine
source file (`offload/*.py` and `offload/backends/`; not `offload/model/fp8.py`, `offload/demo/`, `offload/tts/` and
`offload/generate/`, which hold model code). View ops (`t()`, `view`, `detach`) read no bytes and are let
through: the compute op using the view is the one caught. An op whose schema says it may return a view but that
copied instead (`aten.to.dtype` casting fp8 up, `reshape` of a strided tensor, `contiguous`; under inference mode
these reach the guard whole) did read: it is checked by its result, a tensor sharing no storage with its input. Dispatch modes are thread-local, so copies the sim
backend's copy-engine thread makes are never seen.

Use: ``with host_master_guard(handle): model(x)``, or the `host_guard` pytest fixture (a factory of the same).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload

_ENGINE_DIR = os.path.dirname(os.path.abspath(offload.__file__))
_NOT_ENGINE = ("fp8.py", "kv_cache.py", "kv_pages.py", "kv_layers.py")  # model code shipped with the engine
_NOT_ENGINE_DIRS = (os.path.join(_ENGINE_DIR, "demo") + os.sep, os.path.join(_ENGINE_DIR, "tts") + os.sep)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_THIS = os.path.abspath(__file__)


class HostMasterRead(AssertionError):
    """A compute op read a tensor that lives in an engine's host master (a device mismatch on CUDA)."""


@dataclass
class _Span:
    start: int
    end: int
    handle: Any
    unit: int | None  # None: the weights outside the blocks
    host: torch.Tensor | None  # the flat buffer (None: a disk-tier file view)


def _inner(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """`t`, or the plain tensors a tensor subclass is made of (recursively)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        try:
            names, _ = t.__tensor_flatten__()
        except Exception:  # noqa: BLE001 - not a flattening subclass after all
            names = None
        if names is not None:
            for name in names:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    yield from _inner(inner)
            return
    yield t


def _storage_span(t: torch.Tensor) -> tuple[int, int] | None:
    if t.is_meta or t.device.type != "cpu":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without storage of its own
        return None
    ptr = storage.data_ptr()
    return (ptr, ptr + storage.nbytes()) if ptr else None


def _binding_tensors(binding: Any) -> Iterator[torch.Tensor]:
    for _, value in binding.data_swaps:
        yield from _inner(value)
    for _, _, value in binding.dict_sets:
        if isinstance(value, torch.Tensor):
            yield from _inner(value)


def _master_spans(handle: Any) -> list[_Span]:
    """The host buffers of an attached handle's units and of its weights outside the blocks."""
    streamer = getattr(handle, "streamer", None)
    staged = getattr(streamer, "staged", None)
    if staged is None or not getattr(handle, "attached", False):
        return []
    spans: list[_Span] = []
    masters = [(u.index, u.master) for u in staged.units] + [(None, staged.rest)]
    for index, master in masters:
        if master is None:
            continue
        if master.host is not None:
            span = _storage_span(master.host)
            if span is not None:
                spans.append(_Span(span[0], span[1], handle, index, master.host))
            continue
        for t in _binding_tensors(master.host_binding):  # disk tier: the file's private map
            span = _storage_span(t)
            if span is not None:
                spans.append(_Span(span[0], span[1], handle, index, None))
    return spans


def _engine_frame() -> bool:
    """Whether the innermost Python frame outside torch (and this file) is the engine's own code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path == _THIS or path.startswith("<")):
            path = os.path.abspath(path)
            if not path.startswith(_ENGINE_DIR + os.sep):
                return False
            return os.path.basename(path) not in _NOT_ENGINE and not path.startswith(_NOT_ENGINE_DIRS)
        frame = frame.f_back
    return False


def _name_of(span: _Span, t: torch.Tensor) -> str:
    """The state-dict name of the tensor `t` views in `span`'s master (best effort)."""
    model = span.handle.model
    streamer = span.handle.streamer
    master = streamer.staged.rest if span.unit is None else streamer.staged.units[span.unit].master
    unit_name = ("the weights outside the blocks" if span.unit is None
                 else f"unit {streamer.staged.units[span.unit].name!r}")
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)} if model is not None else {}
    layout = master.layout
    found = None
    if span.host is not None:
        offset = t.data_ptr() - span.start
        for leaf_i, leaf in enumerate(layout.leaves):
            if leaf.offset <= offset < leaf.offset + max(leaf.nbytes, 1):
                found = leaf_i
                break
    for entry in layout.entries:
        leaves = [entry.recipe] if isinstance(entry.recipe, int) else None
        if found is not None and leaves is not None and found not in leaves:
            continue
        mod, attr, _ = entry.locations[0]
        path = paths.get(id(mod), "?")
        name = f"{path}.{attr}" if path else attr
        return f"{name} ({unit_name}, {tuple(t.shape)} {t.dtype})"
    return f"a tensor of {unit_name} ({tuple(t.shape)} {t.dtype})"


class HostMasterGuard(TorchDispatchMode):
    """Raises `HostMasterRead` when an op outside the engine reads a host master of one of `handles`."""

    # higher-order operators (flex_attention) come here too: their tensor arguments are checked, then they run as usual
    supports_higher_order_operators = True

    def __init__(self, *handles: Any) -> None:
        super().__init__()
        self.handles = handles
        self.checked = 0  # ops looked at (a guard that saw nothing proves nothing)
        self._key: tuple | None = None
        self._cached: list[_Span] = []

    def _spans(self) -> list[_Span]:
        """The masters' spans, recomputed only when a master changed (a unit promoted to RAM, a handle detached)."""
        key = tuple(_masters_key(h) for h in self.handles)
        if key != self._key:
            self._key = key
            self._cached = [span for handle in self.handles for span in _master_spans(handle)]
        return self._cached

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.checked += 1
        if func in _METADATA_OPS:
            return func(*args, **kwargs)
        if getattr(func, "is_view", False):
            out = func(*args, **kwargs)
            if not _copied(out, args):
                return out  # a true view reads nothing
            self._check(func, args, kwargs)
            return out
        self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Any, args: Any, kwargs: dict) -> None:
        tensors = _tensors(args, []) if not kwargs else _tensors(list(kwargs.values()), _tensors(args, []))
        if tensors:
            spans = self._spans()
            if spans:
                for arg in tensors:
                    for t in _inner(arg):
                        hit = _hit(spans, t)
                        if hit is not None and not _engine_frame():
                            raise HostMasterRead(
                                f"{func} read a host master on the simulated device: {_name_of(hit, t)}; on a "
                                f"GPU this is a device mismatch (the engine never moved that tensor)")


def _copied(out: Any, args: Any) -> bool:
    """Whether an op that may return a view of its input returned a copy instead (so it read the input)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or not isinstance(out, torch.Tensor) or first.device.type != "cpu" or first.is_meta:
        return False
    try:
        return out.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False


def _tensors(values: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among an op's arguments (lists and tuples of tensors included)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, out)
    return out


def _masters_key(handle: Any) -> tuple:
    streamer = getattr(handle, "streamer", None)
    staged = getattr(streamer, "staged", None)
    if staged is None or not getattr(handle, "attached", False):
        return ()
    return tuple((id(u.master), id(u.master.host) if u.master is not None else 0) for u in staged.units) + (
        id(staged.rest),)


def _hit(spans: list[_Span], t: torch.Tensor) -> _Span | None:
    if t.is_meta or t.device.type != "cpu" or t.numel() == 0:
        return None
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    for span in spans:
        if span.start <= ptr < span.end:
            return span
    return None


_aten = torch.ops.aten
_METADATA_OPS = {_aten.detach.default, _aten.alias.default, _aten.sym_size.int, _aten.sym_stride.int,
                 _aten.sym_numel.default, _aten.sym_storage_offset.default, _aten.is_same_size.default}


@contextlib.contextmanager
def host_master_guard(*handles: Any) -> Iterator[HostMasterGuard]:
    """While active, any op outside the engine that reads one of `handles`' host masters raises `HostMasterRead`."""
    with HostMasterGuard(*handles) as guard:
        yield guard


def step_disk_reads(handle: Any, model: Any, x: Any, ref: Any) -> int:
    """The disk bytes one step reads: two forwards under the guard, each bitwise `ref`; the second one's reads (the
    first builds what a first pass builds)."""
    with host_master_guard(handle) as guard, torch.no_grad():
        assert torch.equal(model(x), ref)
        before = handle.report().disk_bytes_read
        assert torch.equal(model(x), ref)
    assert guard.checked
    return handle.report().disk_bytes_read - before


def disk_units_file_bytes(handle: Any) -> int:
    """The bytes the model's file stores for the tensors of the units now on the disk tier."""
    staged = handle.streamer.staged
    return sum(staged.file.tensors[k].end - staged.file.tensors[k].start
               for u in staged.units if u.master.host is None for k in u.master.keys if k is not None)
