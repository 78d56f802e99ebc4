"""Which tensor of the model's file holds each leaf of a unit, and how its bytes become the leaf's.

A unit streams from the disk tier leaf by leaf, so every leaf needs a file tensor holding its bytes:

- a plain tensor, under its own state-dict name (a common key prefix detected, a tied tensor under the name the
  file keeps; leading parts of the unit's names the file lacks left out: a text encoder's `t5xxl.transformer.`
  over a file of the encoder alone, where exactly one prefix of the file then holds the unit);
- an inner tensor of a tensor subclass that flattens (`__tensor_flatten__`: comfy_kitchen's `QuantizedTensor`,
  whose payload ComfyUI stores as `<layer>.weight` and whose scales as `<layer>.weight_scale`, `weight_scale_2`,
  `weight_s_rel`, ... or the older `scale_weight`): one of the tensors stored beside the weight's own name, found by
  its bytes, whatever it is called.

How the file's bytes become the leaf's: as stored (same dtype and shape); the same bytes seen as another dtype or
shape (ComfyUI views uint8 block scales as float8_e8m0fnu); or a dtype cast (ComfyUI's `weight_dtype` fp8_e4m3fn,
a bf16 file loaded as fp32 on the CPU), applied where the bytes arrive (`sources.DiskSource`). The header says which
file tensors may hold a leaf (`unit_candidates`: no bytes read; what the plan knows before it is made), the bytes
decide (`holding_map`: each candidate read and compared with the leaf's current bytes, cast where it is a cast).

A leaf the file LACKS (a plain tensor stored under no name of the file: a parameter or buffer the loader made, such
as ComfyUI 0.3.64's `scale_input` of ones on every scaled-fp8 layer, or a non-persistent buffer) and that no tensor
stored beside it holds stays resident in host RAM: the unit's residue (`(None, None)` among its candidates; a
`FileMap` key of None), one small flat buffer per unit that the disk tier copies into the unit's bytes where that
leaf lies while the rest is read from the file. This is decided here, from the header, before the plan is made
(`planned_residue` is its fact `PlanFacts.disk_residue`), and bounded: the residue (`residue_offsets`, each leaf
64-byte aligned) may be at most 1/RESIDUE_SHARE of the unit's bytes, so the disk tier still frees nearly all of
the unit and a unit whose tensors the file mostly lacks (another model's file) keeps its RAM master. Past the
bound, or for any other leaf no file tensor holds (a tensor changed after loading, a quantized weight's scale), the
unit stays in RAM and the reason names the leaf. A file given as the model's own (`disk_optional=False`) may lack
only non-persistent buffers: without one of the model's persistent tensors it is not the model's file (refused).
"""
from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.layout import Leaf, TensorLayout
from .file_keys import entry_name
from .storage import CorruptFileError, strippable

log = logging.getLogger("offload.store.staging")  # the messages keep the logger they always had

_KEEP_READ = 1 << 16  # file tensors up to this size stay read while one unit is checked (a payload is read, let go)
Candidate = tuple["str | None", "torch.dtype | None"]  # (file key, the file's dtype when the leaf is a cast of it,
# else None); (None, None): the leaf stays resident in RAM (the file lacks it)
RESIDENT: Candidate = (None, None)
RESIDUE_SHARE = 16  # a unit's residue may be at most 1/16 of its bytes (the disk tier frees at least 15/16 of it)
RESIDUE_ALIGN = 64  # each resident leaf's offset in the unit's residue buffer


@dataclass(frozen=True)
class FileMap:
    """Where a unit's leaves come from in the file: per leaf its key, and the file dtype it is cast from (None: the
    bytes as stored)."""

    keys: list[str | None]  # None: the leaf stays resident in RAM (the file lacks it)
    casts: tuple[torch.dtype | None, ...]

    @property
    def cast(self) -> bool:
        return any(c is not None for c in self.casts)

    @property
    def resident(self) -> list[int]:
        """The leaves held in RAM beside the disk tier (the unit's residue)."""
        return [i for i, k in enumerate(self.keys) if k is None]


def residue_offsets(leaves: list[Leaf]) -> tuple[list[int], int]:
    """(each resident leaf's offset in the unit's residue buffer, the buffer's bytes): RESIDUE_ALIGN-aligned."""
    offsets, at = [], 0
    for leaf in leaves:
        offsets.append(at)
        at += -(-leaf.nbytes // RESIDUE_ALIGN) * RESIDUE_ALIGN
    return offsets, at


def planned_residue(layout: TensorLayout, candidates: list[list[Candidate]] | None,
                    keys: list[Any] | None = None) -> int:
    """Host bytes the unit keeps in RAM on the disk tier (its residue), for the plan: exact where its bytes were
    checked (`keys`), else every leaf that may stay resident (at most what the bytes leave resident)."""
    if keys is not None:
        return residue_offsets([leaf for leaf, k in zip(layout.leaves, keys) if k is None])[1]
    if not candidates:
        return 0
    return residue_offsets([leaf for leaf, found in zip(layout.leaves, candidates) if RESIDENT in found])[1]


def cast_summary(layout: TensorLayout, casts: tuple[torch.dtype | None, ...] | list[Any]) -> str:
    """"float8_e4m3fn from bfloat16" for a unit read with a cast ("" when none)."""
    pairs = sorted({f"{_short(leaf.dtype)} from {_short(c)}" for leaf, c in zip(layout.leaves, casts) if c is not None})
    return ", ".join(pairs)


def planned_casts(file: Any, layout: TensorLayout, candidates: list[list[Candidate]] | None,
                  casts: tuple | None = None) -> tuple[str, int]:
    """(the casts a unit takes on read, the largest cast tensor's bytes in the file) for the plan: exact where its
    bytes were checked (`casts`), else every leaf some candidate casts (the header cannot tell a cast from the same
    bytes under another dtype of the same size)."""
    if casts is not None:
        pairs = [(leaf, c, key) for leaf, c, key in zip(layout.leaves, casts, [None] * len(casts)) if c is not None]
        return cast_summary(layout, casts), 0 if not pairs else max(
            leaf.nbytes // leaf.dtype.itemsize * c.itemsize for leaf, c, _ in pairs)
    if not candidates:
        return "", 0
    maybe = [next((c for _, c in found if c is not None), None) for found in candidates]
    sizes = [_nbytes(file, next(k for k, c in found if c is not None)) for found in candidates
             if any(c is not None for _, c in found)]
    return cast_summary(layout, maybe), max(sizes, default=0)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=None)
def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether torch casts `src` to `dst` (a packed or exotic dtype may not cast at all)."""
    if src == dst or src in (torch.bool,) or src.is_complex or dst.is_complex:
        return False
    try:
        torch.zeros(2, dtype=src).to(dst)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def leaf_from_file(file: Any, key: str, leaf: Leaf, cast: torch.dtype | None) -> torch.Tensor:
    """The leaf's value read from the file (row-major, an independent CPU tensor): cast, or the stored bytes seen
    as the leaf's dtype and shape."""
    t = file.read_tensor(key)
    if cast is not None:
        return t.to(leaf.dtype).reshape(leaf.shape)
    return as_leaf(t, leaf)


def as_leaf(t: torch.Tensor, leaf: Leaf) -> torch.Tensor:
    """A file tensor's bytes seen as `leaf` (its dtype and shape; the same bytes)."""
    if t.dtype == leaf.dtype and tuple(t.shape) == tuple(leaf.shape):
        return t
    return t.reshape(-1).view(torch.uint8).view(leaf.dtype).view(leaf.shape)


class FileIndex:
    """A file's keys by the module path they hang under, and the key prefixes a name is stored with."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.children: dict[str, list[str]] = {}
        for key in file.tensors:
            parent, _, _ = key.rpartition(".")
            self.children.setdefault(parent, []).append(key)

    def prefixes(self, name: str) -> list[str]:
        found = [""]
        for key in self.file.tensors:
            if key.endswith("." + name):
                found.append(key[: -len(name)])
        return found


_indexes: "weakref.WeakKeyDictionary[Any, FileIndex]" = weakref.WeakKeyDictionary()


def file_index(file: Any) -> FileIndex:
    """The file's index, built once per open file."""
    try:
        index = _indexes.get(file)
        if index is None:
            index = _indexes[file] = FileIndex(file)
        return index
    except TypeError:  # not weak-referenceable
        return FileIndex(file)


def _nbytes(file: Any, key: str) -> int:
    ft = file.tensors[key]
    return ft.end - ft.start


def _plain_candidates(file: Any, key: str, leaf: Leaf) -> list[Candidate]:
    """How a plain tensor's key can give the leaf: as stored, the same bytes under another dtype or shape, a cast."""
    ft = file.tensors[key]
    out: list[Candidate] = []
    if ft.dtype == leaf.dtype and tuple(ft.shape) == tuple(leaf.shape):
        return [(key, None)]
    if _nbytes(file, key) == leaf.nbytes:
        out.append((key, None))
    if tuple(ft.shape) == tuple(leaf.shape) and castable(ft.dtype, leaf.dtype):
        out.append((key, ft.dtype))
    return out


def _inner_candidates(file: Any, keys: list[str], leaf: Leaf, attr: str) -> list[Candidate]:
    """The tensors stored beside a quantized weight that may hold one of its inner tensors: as stored first, then
    the same bytes under another dtype, then casts; names that start with the weight's own name first."""
    ranked = []
    for key in keys:
        name = key.rpartition(".")[2]
        near = 0 if name.startswith(attr) else 1
        for k, cast in _plain_candidates(file, key, leaf):
            ft = file.tensors[k]
            kind = 0 if ft.dtype == leaf.dtype and cast is None else (1 if cast is None else 2)
            ranked.append((kind, near, k, cast))
    ranked.sort(key=lambda r: (r[0], r[1], r[2]))
    return [(k, cast) for _, _, k, cast in ranked]


def _entry_leaves(recipe: Any, path: str = "") -> list[tuple[int, str]]:
    """(leaf index, inner path) of an entry's leaves in layout order (a plain entry: its one leaf, path "")."""
    if isinstance(recipe, int):
        return [(recipe, path)]
    out: list[tuple[int, str]] = []
    for name, r in recipe[2].items():
        out.extend(_entry_leaves(r, f"{path}.{name}" if path else name))
    return out


def _siblings(index: FileIndex, prefix: str, name: str) -> list[str]:
    """The keys stored beside `name` under `prefix` (its module's tensors)."""
    module_path = name.rpartition(".")[0]
    return index.children.get(prefix + module_path if module_path else prefix.rstrip("."), [])


def _unit_prefix(index: FileIndex, names: list[tuple[str, bool]], unique: bool = False,
                 lackable: frozenset[int] = frozenset()) -> str | None:
    """The key prefix under which the file stores the unit: some tensor of the unit under its own name there, and
    every tensor under its name or among the tensors stored beside it (a quantized weight's scales, a tensor the
    loader renamed: ComfyUI's `scale_input` is its `input_scale`), or one the file may lack (`lackable`: the unit's
    residue). `unique`: None where two prefixes would do."""
    if not names:
        return ""
    tried: list[str] = []
    found: str | None = None
    for probe, _ in names:
        for prefix in index.prefixes(probe):
            if prefix in tried:
                continue
            tried.append(prefix)
            held = [prefix + n in index.file.tensors for n, _ in names]
            if any(held) and all(h or j in lackable or _siblings(index, prefix, n)
                                 for j, (h, (n, _)) in enumerate(zip(held, names))):
                if not unique:
                    return prefix
                if found is not None:
                    return None  # held under several prefixes: which one is the model's cannot be told by name
                found = prefix
    return found


def _unit_names(index: FileIndex, names: list[tuple[str, bool]],
                lackable: frozenset[int] = frozenset()) -> tuple[str | None, list[tuple[str, bool]]]:
    """(the prefix under which the file stores the unit, the unit's names there): the model's names, or without the
    leading parts they all share that the file lacks (`storage.strippable`), where exactly one prefix holds them;
    names the file may lack (`lackable`) are allowed only where no prefix holds them all."""
    for lack in ((frozenset(), lackable) if lackable else (frozenset(),)):
        prefix = _unit_prefix(index, names, lackable=lack)
        if prefix is not None:
            return prefix, names
        for k in range(1, strippable([n for n, _ in names]) + 1):
            tails = [(n.split(".", k)[k], plain) for n, plain in names]
            prefix = _unit_prefix(index, tails, unique=True, lackable=lack)
            if prefix is not None:
                return prefix, tails
    return None, names


def _non_persistent(entry: Any) -> bool:
    """A non-persistent buffer (no checkpoint holds one)."""
    return any(kind == "buffer" and name in mod._non_persistent_buffers_set for mod, name, kind in entry.locations)


def unit_candidates(file: Any, layout: TensorLayout, key_of: Callable[[nn.Module, str], str],
                    index: FileIndex | None = None,
                    lacking_ok: bool = True) -> tuple[list[list[Candidate]] | None, str]:
    """Per leaf, the file tensors that may hold it, from the header alone (RESIDENT last for a leaf the file lacks
    that may stay in RAM, within the unit's bound); (None, why) when the unit cannot stream from the file (the
    reason names the tensor). `lacking_ok=False` (a file given as the model's own, `disk_optional=False`): only
    non-persistent buffers may be lacking; a file without one of the model's persistent tensors is not its file."""
    index = index or file_index(file)
    names = [(entry_name(file, e, key_of), isinstance(e.recipe, int)) for e in layout.entries]
    volatile = {j for j, e in enumerate(layout.entries) if _non_persistent(e)}  # never read from a file
    small = layout.nbytes // RESIDUE_SHARE
    lackable = frozenset(j for j, (e, (_, plain)) in enumerate(zip(layout.entries, names))
                         if plain and layout.leaves[e.recipe].nbytes <= small and (lacking_ok or j in volatile))
    prefix, names = _unit_names(index, names, lackable)
    if prefix is None:
        missing = next(n for n, plain in names if plain and not any(p + n in file.tensors for p in index.prefixes(n))) \
            if any(plain for _, plain in names) else names[0][0]
        return None, f"{file.path} does not hold {missing!r}"
    out: list[list[Candidate]] = [[] for _ in layout.leaves]
    lacking: list[tuple[int, str, Any]] = []  # (leaf, name) of plain tensors the file stores under no name of theirs
    for j, (entry, (name, plain)) in enumerate(zip(layout.entries, names)):
        for leaf_i, inner in _entry_leaves(entry.recipe):
            leaf = layout.leaves[leaf_i]
            what = f"{name}{'.' + inner if inner else ''}"
            if not leaf.row_major:
                return None, f"{what} is not row-major (the disk tier views the file's bytes as they lie)"
            if j in volatile:
                found = []
            elif plain and prefix + name in file.tensors:
                found = _plain_candidates(file, prefix + name, leaf)
            else:  # an inner tensor, or a tensor stored under another name: among its module's, by bytes
                found = _inner_candidates(file, _siblings(index, prefix, name), leaf, name.rpartition(".")[2])
            found = [(k, c) for k, c in found if c is not None or file.aligned(k)]  # a view needs aligned bytes
            out[leaf_i] = found
            if j in volatile or (plain and lacking_ok and prefix + name not in file.tensors):
                lacking.append((leaf_i, what, entry))
                continue
            if not found:
                return None, _no_tensor(file, layout, entry, leaf, what, prefix + name if plain else None)
    if lacking:
        residue = residue_offsets([layout.leaves[i] for i, _, _ in lacking])[1]
        if residue <= small:
            for i, _, _ in lacking:
                out[i].append(RESIDENT)
        else:
            empty = [(i, what, entry) for i, what, entry in lacking if not out[i]]
            if empty:
                i, what, entry = empty[0]
                names_ = ", ".join(repr(w) for _, w, _ in lacking[:4]) + (" ..." if len(lacking) > 4 else "")
                return None, (_no_tensor(file, layout, entry, layout.leaves[i], what, None)
                              + f"; the tensors the file lacks ({names_}: {residue} bytes) are more than "
                                f"1/{RESIDUE_SHARE} of the block ({layout.nbytes} bytes), too many to keep in RAM "
                                f"beside the disk tier")
    return out, ""


def _no_tensor(file: Any, layout: TensorLayout, entry: Any, leaf: Leaf, what: str, key: str | None) -> str:
    """Why a leaf has no file tensor: its name, shape and dtype, and what the file holds under its name."""
    ft = file.tensors.get(key) if key is not None else None
    held = f" (the file has {tuple(ft.shape)} {_short(ft.dtype)})" if ft is not None else ""
    inside = "" if isinstance(entry.recipe, int) else f", inside a {entry.recipe[0].__name__}"
    return (f"{what} ({tuple(leaf.shape)} {_short(leaf.dtype)}{inside}) has no tensor in {file.path} that holds its "
            f"bytes or casts to them{held}")


def _leaf_name(file: Any, layout: TensorLayout, key_of: Callable[[nn.Module, str], str], i: int) -> str:
    """Leaf i's name in the model (a subclass's inner tensor after its weight's name)."""
    for entry in layout.entries:
        for k, inner in _entry_leaves(entry.recipe):
            if k == i:
                name = entry_name(file, entry, key_of)
                return f"{name}.{inner}" if inner else name
    return f"leaf {i}"


def holding_map(file: Any, layout: TensorLayout, key_of: Callable[[nn.Module, str], str],
                candidates: list[list[Candidate]] | None = None, strict: bool = False,
                refused: list[str] | None = None) -> FileMap | None:
    """The file tensors holding the unit's current bytes, leaf by leaf (each candidate read and compared, cast where
    it is a cast; a leaf the file lacks that no tensor beside it holds: resident, key None); None when some leaf has
    none (the unit stays in RAM: the reason goes to `refused`, or is logged;
    CorruptFileError when `strict` and the unit is plain: its file was given as the model's own)."""
    why = ""
    if candidates is None:
        candidates, why = unit_candidates(file, layout, key_of)
    keys: list[str] = []
    casts: list[torch.dtype | None] = []
    if candidates is not None:
        read: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, (leaf, src, found) in enumerate(zip(layout.leaves, layout.sources(), candidates)):
                have = src.detach().contiguous().reshape(-1).view(torch.uint8)
                pick: Candidate | None = None
                for key, cast in found:
                    if key is None:  # no file tensor holds it: resident in RAM (the unit's residue)
                        pick = RESIDENT
                        break
                    t = read.get(key)
                    if t is None:
                        t = file.read_tensor(key)
                        if t.numel() * t.element_size() <= _KEEP_READ:  # scales others may try: kept for the unit
                            read[key] = t
                    value = t.to(leaf.dtype) if cast is not None else as_leaf(t, leaf)
                    if torch.equal(value.reshape(-1).view(torch.uint8), have):
                        pick = (key, cast)
                        break
                if pick is None and found and all(c is not None for _, c in found):
                    ft = file.tensors[found[0][0]]
                    why = (f"{file.path}: {found[0][0]!r} is {tuple(ft.shape)} {_short(ft.dtype)} in the file but "
                           f"{tuple(leaf.shape)} {_short(leaf.dtype)} in the model, and the model's values are not "
                           f"its cast (bytes stream as stored, or cast as the model's loader cast them)")
                    break
                if pick is None:
                    tried = [k for k, _ in found]
                    held = (f"{tried[0]!r} holds" if len(tried) == 1 else
                            f"none of {tried[:4]}{' ...' if len(tried) > 4 else ''} holds")
                    why = (f"{file.path}: {held} other values than the model's {_leaf_name(file, layout, key_of, i)!r} "
                           f"({tuple(leaf.shape)} {_short(leaf.dtype)}, leaf {i} of its block), as stored or cast: it "
                           f"was changed or converted after loading")
                    break
                keys.append(pick[0])
                casts.append(pick[1])
        if len(keys) == len(layout.leaves):
            return FileMap(keys, tuple(casts))
    if strict and layout.plain:
        raise CorruptFileError(why if why.startswith(str(file.path)) else f"{file.path}: {why}")
    if refused is not None:
        refused.append(why)
    else:
        log.warning("not streaming a block from disk: %s; it stays in RAM", why)
    return None
