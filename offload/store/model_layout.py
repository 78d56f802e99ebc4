"""A model laid out against its file before anything changes: each unit's layout and the rest's (`lay_out_model`),
which units the file can stream and why not (`ModelLayout.refusals`), and the check that the file holds the very
bytes (as stored or cast) of the units planned for the disk tier (`verify_for_disk`). Staging applies it
(`staging.stage_model`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..model.blocks import Unit
from ..model.layout import TensorLayout, plan_layout, unit_tensors
from ..model.meta_buffers import materialize_non_persistent_buffers, materialize_tensor_attributes, tie_meta_weights
from ..model.trainable import trainable_in_blocks
from .file_keys import (file_keys, in_stored_order, key_namer, meta_file_keys, non_persistent_buffer,
                        persistent_buffers_from_file)
from .leaf_match import file_index, holding_map, unit_candidates
from .storage import SafetensorsFile

log = logging.getLogger(__name__)


def shared_tensor_ids(model: nn.Module, units: list[Unit]) -> set[int]:
    """Tensors used by more than one unit, or by a unit and the rest: kept resident with the rest."""
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for i, unit in enumerate(units):
        for _, _, _, t in unit_tensors(unit.module):
            if owner.setdefault(id(t), i) != i:
                shared.add(id(t))
    unit_mods = {id(m) for u in units for m in u.module.modules()}
    for sub in model.modules():
        if id(sub) in unit_mods:
            continue
        for t in list(sub._parameters.values()) + list(sub._buffers.values()):
            if t is not None and id(t) in owner:
                shared.add(id(t))
    if shared:
        log.info("%d tensor(s) are shared between units or with the rest of the model; kept resident", len(shared))
    return shared


@dataclass
class ModelLayout:
    """A model laid out for staging, nothing changed yet: each unit's layout, the rest's, and what the file holds."""

    units: list[Unit]
    layouts: list[TensorLayout]
    rest: TensorLayout
    file: SafetensorsFile | None
    key_of: Callable[[nn.Module, str], str]
    file_optional: bool
    keys: dict[int, list[Any]] = field(default_factory=dict)  # file key per leaf: meta units, disk-verified units
    rest_keys: list[Any] | None = None
    disk_ok: list[bool] = field(default_factory=list)  # the unit may stream from the file (before its bytes are checked)
    refusals: list[str] = field(default_factory=list)  # per unit: why it cannot stream from the file ("" if it can)
    candidates: dict[int, Any] = field(default_factory=dict)  # per leaf, the file tensors that may hold it (header)
    casts: dict[int, tuple] = field(default_factory=dict)  # disk-verified units: per leaf the file dtype cast from

    @property
    def sizes(self) -> list[int]:
        return [layout.nbytes for layout in self.layouts]

    @property
    def rest_bytes(self) -> int:
        return self.rest.nbytes if self.rest.entries else 0


def lay_out_model(model: nn.Module, units: list[Unit], file: SafetensorsFile | None,
                  file_optional: bool = False) -> ModelLayout:
    """Lay out every unit and the rest, and read from the file's header which units it can stream; raises before
    touching the model's weights on bad input (meta tensors no file can fill, a header that does not match)."""
    # 0. non-persistent buffers on the meta device are computed as the model computes them, never read from a file;
    # weights the model declares tied and a meta init untied are tied again (a checkpoint holds them once)
    tie_meta_weights(model, file)
    materialize_non_persistent_buffers(model)
    materialize_tensor_attributes(model)  # plain tensor attributes on meta (rotary tables): rebuilt, or refused by name
    shared = shared_tensor_ids(model, units)
    # trainable parameters inside the blocks (a training setup) stay with the rest: on the device, never streamed
    shared |= {id(p) for p in trainable_in_blocks([u.module for u in units], shared)}
    layouts: list[TensorLayout] = []
    in_units: set[tuple[int, str, str]] = set()
    key_of = key_namer(model)
    for unit in units:
        tensors, stored = in_stored_order([t for t in unit_tensors(unit.module) if id(t[3]) not in shared], file,
                                          key_of)
        in_units.update((id(sub), name, kind) for sub, name, kind, _ in tensors)
        layouts.append(plan_layout(tensors, group_dtypes=not stored))
        del tensors
    rest_layout = plan_layout([(sub, name, kind, t) for sub, name, kind, t in unit_tensors(model)
                               if (id(sub), name, kind) not in in_units])
    laid = ModelLayout(units, layouts, rest_layout, file, key_of, file_optional)
    if file is not None and any(leaf.meta for layout in layouts + [rest_layout] for leaf in layout.leaves):
        persistent_buffers_from_file(file, layouts + [rest_layout], laid.key_of)
    index = file_index(file) if file is not None else None
    for i, layout in enumerate(layouts):
        why = "" if file is not None else "no model file was given (disk_path)"
        if any(leaf.meta for leaf in layout.leaves):
            if file is None or not _fillable(layout):
                _refuse_meta(units[i].name, layout, file)
            laid.keys[i] = meta_file_keys(file, layout, laid.key_of)  # the file is the only source: a mismatch is an error
            # part of the unit is in RAM already (recomputed buffers): no file view; a misaligned tensor neither
            if not layout.plain or not all(k is not None and file.aligned(k) for k in laid.keys[i]):
                why = "part of it is computed, not read from the file (or a tensor lies misaligned in it)"
        elif file is not None:
            found, why = unit_candidates(file, layout, laid.key_of, index, lacking_ok=file_optional)
            if found is not None:
                laid.candidates[i] = found
                if not file_optional and layout.plain and any(all(c is not None for _, c in f) for f in found):
                    # the model's own file in another dtype: its values must be the cast, checked now
                    held = holding_map(file, layout, laid.key_of, found, strict=True)
                    laid.keys[i], laid.casts[i] = held.keys, held.casts
            elif not file_optional and layout.plain and non_persistent_buffer(layout) is None:
                file_keys(file, layout, laid.key_of)  # the header must match now (names, dtypes, shapes), not when RAM runs short
        laid.refusals.append(why)
        laid.disk_ok.append(not why)
    if any(leaf.meta for leaf in rest_layout.leaves):
        if file is None or not _fillable(rest_layout):
            _refuse_meta("the weights outside the blocks", rest_layout, file)
        laid.rest_keys = meta_file_keys(file, rest_layout, laid.key_of)
    return laid


def verify_for_disk(laid: ModelLayout, planned: list[int]) -> list[int]:
    """Check that the file holds the very bytes of the units `planned` for the disk tier whose weights are in RAM
    now, leaf by leaf (as stored, or cast as ComfyUI cast them when it loaded the file: `leaf_match.holding_map`);
    returns the units it does not hold (they stay in RAM: the plan is made again without them on disk). Strict
    (CorruptFileError) for plain units unless the file is optional."""
    file = laid.file
    refused: list[str] = []  # blocks the file does not hold exactly (disk_optional): one log line for all
    out = []
    for i in planned:
        if i in laid.keys:
            continue  # a meta unit: its keys were matched against the file already
        found = holding_map(file, laid.layouts[i], laid.key_of, laid.candidates.get(i),
                            strict=not laid.file_optional, refused=refused)
        if found is None:
            laid.refusals[i] = refused[-1] if refused else "the file does not hold its bytes"
            out.append(i)
            continue
        laid.keys[i], laid.casts[i] = found.keys, found.casts
    if refused:
        log.warning("not streaming %d block(s) from disk: %s%s; each stays in RAM", len(refused), refused[0],
                    f" (and {len(refused) - 1} more like it)" if len(refused) > 1 else "")
    return out


def _fillable(layout: TensorLayout) -> bool:
    """Every tensor is a plain one: its meta leaves can be read from a safetensors file, whatever their strides (a
    transposed or channels_last weight is read in row-major order and copied into its strided place)."""
    return all(isinstance(e.recipe, int) for e in layout.entries)


def _refuse_meta(what: str, layout: TensorLayout, file: SafetensorsFile | None) -> None:
    leaf = next(leaf for leaf in layout.leaves if leaf.meta)
    if file is None:
        raise ValueError(f"{what}: a {tuple(leaf.shape)} {leaf.dtype} tensor is on the meta device and no "
                         f"disk_path was given to read it from")
    raise ValueError(f"{what}: holds meta tensors that {file.path} cannot fill (a tensor subclass cannot be read from a "
                     f"safetensors file); build those modules with real weights, or quantize after loading")
