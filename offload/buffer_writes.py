"""Buffers a block writes during its own forward: the host copy catches up, so it stays the truth.

BatchNorm's running statistics in train mode, a step counter (`self.steps += 1`), a buffer reassigned
(`self.step = self.step + 1`): a streamed unit computes in a slot the next unit reuses, so without this such writes
would be thrown away when the unit's tensors go back to the host master. After a streamed unit's forward, the bytes
of the buffers it wrote (and only those) are copied device-to-host into its host master; a disk-tier unit gets a RAM
master first (its bytes are no longer the file's). A resident unit (and the weights outside the blocks) computes
on its own device copy: a write marks that copy newer, and the host master catches up when it is evicted, unloaded
or detached.

How a write is seen, per buffer:
- its version counter moved (any in-place op through it: `add_`, `copy_`, `fill_`); every buffer bound to a device
  copy has a version counter of its own (`layout.bind`), so one written buffer does not drag the others along;
- the module holds another tensor under the name (reassigned): the new value is copied into the engine's tensor,
  which goes back in its place; a value of another shape or dtype is refused, naming the buffer;
- a torch norm with running statistics (`_NormBase`: BatchNorm*, InstanceNorm* with `track_running_stats`) in
  training mode: its kernel updates `running_mean` / `running_var` without bumping their version counters, so its
  buffers count as written after every training-mode forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _NormBase

from .layout import TensorLayout


class BufferShapeError(ValueError):
    """A block reassigned one of its buffers with a tensor of another shape or dtype during its forward."""


@dataclass
class _Spot:
    """One buffer of a unit: the module and name it is registered under, and its leaf in the unit's layout."""

    module: nn.Module
    attr: str
    leaf: int
    norm: nn.Module | None  # a running-stats norm that writes it without a version bump


class BufferWatch:
    """The buffers of one unit (or of the weights outside the blocks), and which ones a forward wrote."""

    def __init__(self, layout: TensorLayout) -> None:
        self.layout = layout
        self.spots: list[_Spot] = []
        for entry in layout.entries:
            if not isinstance(entry.recipe, int):
                continue  # a tensor-subclass buffer: not watched
            for module, attr, kind in entry.locations:
                if kind == "buffer":
                    norm = module if isinstance(module, _NormBase) and module.track_running_stats else None
                    self.spots.append(_Spot(module, attr, entry.recipe, norm))

    def __bool__(self) -> bool:
        return bool(self.spots)

    def mark(self) -> list[tuple[torch.Tensor | None, int]]:
        """The tensor each buffer is bound to now and its version (taken right before the forward)."""
        marks = []
        for spot in self.spots:
            t = spot.module._buffers.get(spot.attr)
            marks.append((t, _version(t)))
        return marks

    def written(self, marks: list[tuple[torch.Tensor | None, int]]) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
        """Since `marks`: the spots written in place, and the spots reassigned with their new tensor."""
        in_place: list[int] = []
        reassigned: list[tuple[int, torch.Tensor]] = []
        for k, (spot, (ours, version)) in enumerate(zip(self.spots, marks)):
            if ours is None:
                continue
            now = spot.module._buffers.get(spot.attr)
            if now is not ours:
                if now is not None:
                    reassigned.append((k, now))
            elif _version(now) != version or (spot.norm is not None and spot.norm.training):
                in_place.append(k)
        return in_place, reassigned

    def check_value(self, k: int, value: torch.Tensor) -> None:
        """A reassigned value must fit the buffer's place in the layout."""
        spot, leaf = self.spots[k], self.layout.leaves[self.spots[k].leaf]
        if tuple(value.shape) != tuple(leaf.shape) or value.dtype != leaf.dtype:
            raise BufferShapeError(
                f"{type(spot.module).__name__}.{spot.attr}: the forward replaced this buffer of an offloaded block with "
                f"a {tuple(value.shape)} {value.dtype} tensor (it was {tuple(leaf.shape)} {leaf.dtype}); a streamed "
                f"buffer keeps its shape and dtype: write into it in place, keep the value as a plain attribute, or "
                f"detach() the model first")

    def leaf_bytes(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Spot k's bytes in a flat buffer laid out as this layout (a host master or a device copy)."""
        leaf = self.layout.leaves[self.spots[k].leaf]
        return buf[leaf.offset:leaf.offset + leaf.nbytes]

    def leaf_view(self, buf: torch.Tensor, k: int) -> torch.Tensor:
        """Spot k as a tensor of its shape over a flat buffer laid out as this layout."""
        leaf = self.layout.leaves[self.spots[k].leaf]
        raw = self.leaf_bytes(buf, k).view(leaf.dtype)
        return raw.as_strided(leaf.shape, leaf.stride) if leaf.stride is not None else raw.view(leaf.shape)

    def put_back(self, marks: list[tuple[torch.Tensor | None, int]],
                 reassigned: list[tuple[int, torch.Tensor]]) -> None:
        """Copy reassigned values into the engine's tensors (device copies) and put those back in the modules."""
        with torch.no_grad():
            for k, value in reassigned:
                ours = marks[k][0]
                self.check_value(k, value)
                ours.copy_(value)
                spot = self.spots[k]
                spot.module._buffers[spot.attr] = ours


def _version(t: Any) -> int:
    if t is None or t.is_inference():
        return -1  # inference tensors have no version counter
    try:
        return t._version
    except RuntimeError:
        return -1
