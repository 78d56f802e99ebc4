"""Which key of the model's file holds each tensor of a unit: names as the model's state dict gives them (a tied
tensor under the name the file holds), matched against the file's header (a common key prefix, dtypes, shapes),
the bytes compared where the unit's weights are in RAM already, persistent buffers of a model loaded from its file,
and the units a packed folder stores compressed exactly as the model lays them out."""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.layout import TensorLayout
from .storage import CorruptFileError, SafetensorsFile

log = logging.getLogger("offload.store.staging")  # the messages keep the logger they always had


def key_namer(model: nn.Module) -> Callable[[nn.Module, str], str]:
    paths: dict[int, str] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(mod), path)

    def key_of(sub: nn.Module, name: str) -> str:
        return f"{paths[id(sub)]}.{name}" if paths.get(id(sub)) else name

    return key_of


def entry_name(file: SafetensorsFile, entry: Any, key_of: Callable[[nn.Module, str], str]) -> str:
    """The state-dict name a tensor is saved under: of a tensor several modules share (tied embeddings), the name
    the file holds (`safetensors.torch.save_model` keeps one of them), else the first."""
    names = [key_of(mod, attr) for mod, attr, _ in entry.locations]
    if len(names) > 1:
        for name in names:
            if any(k == name or k.endswith("." + name) for k in file.tensors):
                return name
    return names[0]


def file_keys(file: SafetensorsFile, layout: TensorLayout, key_of: Callable[[nn.Module, str], str]) -> list[str]:
    return file.match([entry_name(file, e, key_of) for e in layout.entries], layout.leaves)


def meta_file_keys(file: SafetensorsFile, layout: TensorLayout,
                    key_of: Callable[[nn.Module, str], str]) -> list[str | None]:
    """The file key of every leaf still on the meta device (None for the others: already in RAM, such as the
    recomputed non-persistent buffers, which no checkpoint holds)."""
    meta = [e for e in layout.entries if layout.leaves[e.recipe].meta]
    matched = file.match([entry_name(file, e, key_of) for e in meta], [layout.leaves[e.recipe] for e in meta])
    keys: list[str | None] = [None] * len(layout.leaves)
    for entry, key in zip(meta, matched):
        keys[entry.recipe] = key
    return keys


def persistent_buffers_from_file(file: SafetensorsFile, layouts: list[TensorLayout],
                                 key_of: Callable[[nn.Module, str], str]) -> int:
    """A model being loaded from its file (some tensor is on the meta device) takes every persistent buffer the file
    holds from the file, as `load_state_dict` would: a buffer the init left real (accelerate's `init_empty_weights()`
    keeps buffers real by default) holds the constructor's value, not the checkpoint's (BatchNorm running stats).
    Their leaves are marked to be read from the file like meta ones; a buffer the file lacks keeps its value."""
    suffixes = set()
    for key in file.tensors:
        parts = key.split(".")
        suffixes.update(".".join(parts[j:]) for j in range(len(parts)))
    marked = 0
    for layout in layouts:
        if not layout.plain:
            continue  # a tensor subclass or a strided leaf: no file can fill it, so its buffers stay as they are
        for entry in layout.entries:
            leaf = layout.leaves[entry.recipe]
            if leaf.meta or not all(kind == "buffer" and name not in mod._non_persistent_buffers_set
                                    for mod, name, kind in entry.locations):
                continue
            if entry_name(file, entry, key_of) in suffixes:
                leaf.meta = True
                marked += 1
    if marked:
        log.info("%d persistent buffer(s) come from %s (the model is being loaded from it)", marked, file.path)
    return marked


def non_persistent_buffer(layout: TensorLayout) -> str | None:
    """The name of a non-persistent buffer in the layout (no checkpoint holds it), if any."""
    for entry in layout.entries:
        for mod, name, kind in entry.locations:
            if kind == "buffer" and name in mod._non_persistent_buffers_set:
                return name
    return None


def stored_unit_of(file: Any, keys: list[Any] | None, layout: TensorLayout) -> Any:
    """The unit a packed folder stores compressed exactly as `layout` lays it out (index_check.StoredUnit), or
    None (no such file, keys not all known, laid out otherwise)."""
    find = getattr(file, "stored_unit", None)
    if find is None or not keys or any(k is None for k in keys):
        return None
    return find([(k, leaf.offset) for k, leaf in zip(keys, layout.leaves)], layout.nbytes)


def stored_units(laid: Any) -> list[Any]:
    """Per unit, the unit its file stores compressed laid out as the model's (`stored_unit_of`), or None: what the
    plan knows of a packed folder before staging (exact encoded sizes; units that stream encoded from disk)."""
    if getattr(laid.file, "stored", None) is None or not laid.file.stored:
        return [None] * len(laid.layouts)
    out = []
    for i, layout in enumerate(laid.layouts):
        keys = laid.keys.get(i)
        if keys is None and layout.plain:
            try:
                keys = file_keys(laid.file, layout, laid.key_of)
            except (CorruptFileError, KeyError):
                keys = None
        out.append(stored_unit_of(laid.file, keys, layout))
    return out


def in_stored_order(tensors: list[tuple[nn.Module, str, str, torch.Tensor]], file: Any,
                    key_of: Callable[[nn.Module, str], str],
                    ) -> tuple[list[tuple[nn.Module, str, str, torch.Tensor]], bool]:
    """(a unit's tensors in the order its packed folder stores them compressed, True), so that the unit's layout is
    the stored one and the device decodes the stored bytes in place (`pack_file` lays tensors out in the file's
    order, the model in its modules'); (as given, False) when the file stores no unit holding exactly these
    tensors (the layout then groups them by dtype)."""
    stored_name = getattr(file, "stored_name", None)
    if stored_name is None or not tensors or not file.stored:
        return tensors, False
    names = [key_of(sub, name) for sub, name, _, _ in tensors]
    prefix = next((p for p in file._prefixes(names[0]) if all(p + n in file.tensors for n in names)), None)
    if prefix is None:
        return tensors, False
    keys = [prefix + n for n in names]
    units = {stored_name(k) for k in keys}
    if len(units) != 1 or None in units:
        return tensors, False
    order = sorted(range(len(tensors)), key=lambda j: file.tensors[keys[j]].start)
    return [tensors[j] for j in order], True
