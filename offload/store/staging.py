"""Host staging: every unit's tensors become views of one flat host buffer (or of the model's file), once.

Setup of a model's host side, in the order the handle calls it: `model_layout.lay_out_model` lays out each unit and reads what
the file can hold (names, dtypes, alignment; nothing changes yet), the planner puts each unit in a host tier from
those facts, `model_layout.verify_for_disk` checks that the file holds the very bytes of the units planned for the disk tier,
and `stage_model` applies the plan: it stages the units ONE AT A TIME, releasing each unit's original storage as
soon as its flat buffer holds the bytes. Peak host memory while offloading is therefore the model plus about one
unit, not two copies of the model. A failure half way gives the staged units back as ordinary tensors, so the
model is left as it was. Staging decides no tier: a unit goes where the plan puts it (pinning the OS refuses falls
back to pageable memory, said once).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from ..model.layout import Binding, TensorLayout
from .compressed import CompressedSource, bind_master, disk_source, stage_unit_compressed
from .shared_host import SharedHostCopy, SharedUnit
from .file_keys import stored_unit_of
from .leaf_match import as_leaf, leaf_from_file, residue_offsets
from .model_layout import ModelLayout
from .sources import BouncedSource, BounceReader, HostSource, SharedSource, UnitSource
from .spill import SpillFile, release_free_heap
from .stage_reads import (ReadAhead, SetupTimes, decode_stored, drop_transients, encode_unit, fill_from, ram_unit,
                          write_through)
from .storage import SafetensorsFile

log = logging.getLogger(__name__)


class PinFallbackNotice:
    """Says once per process that pinning was refused and pageable memory is used instead."""

    said = False

    @classmethod
    def say(cls, reason: str, level: int = logging.WARNING) -> None:
        if not cls.said:
            cls.said = True
            log.log(level, "pinned host memory unavailable (%s); staging in pageable memory instead "
                    "(copies are slower and cannot fully overlap compute)", reason)


@dataclass
class StagingBuffer:
    """A unit's host master: one flat RAM buffer (pinned where allowed), or per-tensor views of the file."""

    layout: TensorLayout
    host: torch.Tensor | None  # None: the disk tier (the master is the file)
    pinned: bool
    host_binding: Binding
    file: SafetensorsFile | None = None  # disk tier: the file and each leaf's key in it
    keys: list[str] | None = None
    encoded: Any = None  # held compressed (codec.Encoded): `host` is then a map of the spill file (compressed.py)
    spilled: bool = False  # `host` maps the spill file (no RAM of its own until read)
    segment: SharedHostCopy | None = None  # the encoded blob lies in this host copy shared between processes
    casts: tuple | None = None  # disk tier: per leaf, the file dtype it is cast from on read (None: as stored)
    # disk tier: the leaves the file lacks (key None), held in RAM in one flat buffer (leaf_match.residue_offsets)
    residue: torch.Tensor | None = None

    @classmethod
    def compressed(cls, layout: TensorLayout, alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]],
                   pin: bool, spill: SpillFile, file: SafetensorsFile | None = None,
                   keys: list[str] | None = None, encode: bool = True, copy: SharedHostCopy | None = None,
                   index: int = -1) -> "StagingBuffer":
        """Hold the unit compressed in RAM, its modules viewing the spill map (`compressed.stage_unit_compressed`: with
        `copy`, its blob in the host copy shared between processes); without `encode`, the spill map alone."""
        stored = stored_unit_of(file, keys, layout) if encode else None  # stored compressed: its encoding as is
        encoded = file.encoded(stored) if stored is not None and stored.nbytes == layout.nbytes else None
        host, pinned, encoded, segment = stage_unit_compressed(layout, file, keys, spill, alloc_host, pin, encode,
                                                               copy, index, encoded)
        return cls(layout, host, pinned, bind_master(layout, host), encoded=encoded, spilled=True, segment=segment)

    @classmethod
    def encoded_by(cls, layout: TensorLayout, prepared: tuple[torch.Tensor, Any, bool, list[int]],
                   copy: SharedHostCopy | None = None, index: int = -1, alloc_host: Any = None,
                   pin: bool = False) -> "StagingBuffer":
        """A unit held compressed that a staging worker read, encoded and spilled (`stage_reads.encode_unit`); with
        `copy` (its filler) the blob goes into the host copy shared between processes, or, where it has no room,
        into a host buffer of this process (`alloc_host`, pinned where asked)."""
        host, encoded, pinned, from_file = prepared
        segment = None
        if copy is not None:
            blob = copy.put_encoded(index, encoded, from_file)
            if blob is not None:
                segment = copy
            else:
                blob, pinned = alloc_host(encoded.size, pin)
                blob.copy_(encoded.blob)
            encoded.blob = blob
        return cls(layout, host, pinned, bind_master(layout, host), encoded=encoded, spilled=True, segment=segment)
    shared: SharedUnit | None = None  # the host copy shared between processes (`host` is this process's view)

    @classmethod
    def in_ram(cls, layout: TensorLayout, alloc_host: Callable[[int, bool], tuple[torch.Tensor, bool]], pin: bool,
               file: SafetensorsFile | None = None, keys: list[str] | None = None,
               notice_level: int = logging.WARNING, prepared: tuple[torch.Tensor, bool] | None = None,
               ) -> "StagingBuffer":
        """Copy the unit's tensors into one host buffer and point the modules at views of it.

        Leaves still on the meta device are read from `file` (`keys` names them) straight into the buffer
        (`stage_reads.fill_from`); `prepared`: the buffer a staging worker filled already. Once the binding is
        applied the module no longer refers to the original tensors, so their storage is released here.
        """
        host, pinned = prepared if prepared is not None else ram_unit(layout, file, keys, alloc_host, pin,
                                                                     SetupTimes())
        if pin and not pinned:
            PinFallbackNotice.say("the allocator refused or this torch has no accelerator", notice_level)
        views = layout.leaf_views(host)
        layout.rebind_fresh(views)
        binding = layout.build(host, master=True)
        binding.apply()
        layout.adopt_params()
        return cls(layout, host, pinned, binding)

    @classmethod
    def in_shared(cls, index: int, layout: TensorLayout, copy: SharedHostCopy, file: SafetensorsFile | None = None,
                  keys: list[str] | None = None, prepared: Any = False,
                  times: SetupTimes | None = None) -> "StagingBuffer | None":
        """The unit's master in the host copy shared between processes (offload/store/shared_host.py), the modules
        pointed at this process's view of it; None when the copy cannot hold it (the caller stages it in RAM).
        `prepared`: what a staging worker's `place_shared` gave (the unit placed already)."""
        host = prepared if prepared is not False else place_shared(copy, index, layout, file, keys, times)
        if host is None:
            return None
        views = layout.leaf_views(host)
        layout.rebind_fresh(views)
        binding = layout.build(host, master=True)
        binding.apply()
        layout.adopt_params()
        return cls(layout, host, False, binding, shared=copy.unit(index, host, layout))

    @classmethod
    def on_disk(cls, layout: TensorLayout, file: SafetensorsFile, keys: list[Any], casts: tuple | None = None,
                spill: SpillFile | None = None, apply: bool = True,
                values: list[torch.Tensor] | None = None) -> "StagingBuffer":
        """A disk-tier master: the module views the file's private map between forwards; no RAM copy. A leaf read
        with a cast views its cast bytes written once to the spill file instead (`values`: the leaves' bytes now,
        by default the modules' tensors), as a compressed unit's do (spill.py); a leaf the file lacks (key None)
        views its copy in the unit's residue, a small RAM buffer the disk tier copies from (leaf_match.py).

        `apply=False` for a unit resident on the device now: its views are swapped in when it is evicted.
        """
        casts = tuple(casts) if casts is not None else (None,) * len(keys)
        resident = [k for k, key in enumerate(keys) if key is None]
        current = values if values is not None or not (any(casts) or resident) else list(layout.sources())
        residue, kept = _residue(layout, resident, current)
        views = [leaf.restride(kept[k] if key is None else _spilled(spill, current[k], leaf) if casts[k] is not None
                               else as_leaf(file.view(key), leaf))
                 for k, (key, leaf) in enumerate(zip(keys, layout.leaves))]
        del current, kept
        if apply:
            layout.rebind_fresh(views)
        binding = layout.bind(views, None, master=True)
        if apply:
            binding.apply()
            layout.adopt_params()
        return cls(layout, None, False, binding, file, keys, casts=casts, residue=residue)

    def residue_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """(offset in the unit's bytes, the bytes) of each leaf the disk tier copies from the residue."""
        if self.residue is None:
            return []
        leaves = [(leaf, k) for leaf, k in zip(self.layout.leaves, self.keys) if k is None]
        offsets, _ = residue_offsets([leaf for leaf, _ in leaves])
        return [(leaf.offset, self.residue[at:at + leaf.nbytes]) for (leaf, _), at in zip(leaves, offsets)]

    def leaf_copy(self, i: int, device: torch.device) -> torch.Tensor:
        """Leaf i as an ordinary, independent tensor (from the file by positioned read for the disk tier)."""
        if self.host is None:
            cast = self.casts[i] if self.casts else None
            leaf = self.layout.leaves[i]
            if self.keys[i] is None:  # a leaf of the residue: its RAM copy
                at = [k for k, key in enumerate(self.keys) if key is None].index(i)
                off = self.residue_pieces()[at][1]
                return leaf.restride(off.view(leaf.dtype).view(leaf.shape)).to(device=device, copy=True)
            return leaf.restride(leaf_from_file(self.file, self.keys[i], leaf, cast)).to(device)
        return self.layout.leaf_views(self.host)[i].to(device=device, copy=True)

    def restore_ordinary(self) -> None:
        """Give every tensor back as an ordinary, independent tensor on its original device."""
        views = self.layout.leaf_views(self.host) if self.host is not None else None
        if views is not None:
            self.layout.restore(lambda i, d: views[i].to(device=d, copy=True))
        else:
            self.layout.restore(self.leaf_copy)


@dataclass
class StagedUnit:
    """One unit after staging: its module, layout, host master and where its bytes stream from."""

    index: int
    name: str
    module: nn.Module
    master: StagingBuffer
    source: UnitSource

    @property
    def layout(self) -> TensorLayout:
        return self.master.layout

    @property
    def nbytes(self) -> int:
        return self.master.layout.nbytes


@dataclass
class StagedModel:
    """A model's host side: its staged units, the non-block tensors (always resident), the read-ahead thread."""

    units: list[StagedUnit]
    rest: StagingBuffer
    rest_bytes: int
    reader: BounceReader | None
    file: SafetensorsFile | None
    key_of: Callable[[nn.Module, str], str] | None = None  # a tensor's state-dict name (matching units to the file)
    shared: SharedHostCopy | None = None  # the host copy shared with other processes, as this process maps it
    publish_later: frozenset[int] = frozenset()  # units in this process's RAM that a thread puts in `shared`
    publish_pinned: frozenset[int] = frozenset()  # those of them the plan pins (registered in the copy once there)

    def check_sources(self) -> None:
        """Raise SourceChangedError if the file behind the disk tier changed since setup."""
        if self.file is not None and any(u.master.host is None for u in self.units):
            self.file.check_unchanged()

    def close(self, backend: Any = None) -> None:
        """Let go of the read-ahead thread and the shared copy; with `backend`, the pinned memory freed (bounce
        buffers, masters dropped before) leaves its allocator's cache too."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if backend is not None:
            backend.release_host_cache()


def _jobs(laid: ModelLayout, tiers: dict[int, str], backend: Any, pin: bool, shared: frozenset[int],
          compressed: frozenset[int] | set[int], spill: SpillFile | None, copy: Any,
          times: SetupTimes) -> list[Callable[[], Any] | None]:
    """What staging's workers do ahead for each unit: a unit in RAM allocated and filled; a unit held compressed
    read, encoded into its blob and spilled. Units in the shared host copy, on the disk tier, or whose encoding a
    packed folder stores are staged in order by the caller (None)."""
    jobs: list[Callable[[], Any] | None] = []
    for i, layout in enumerate(laid.layouts):
        keys = laid.keys.get(i)
        unit_pin = pin and tiers.get(i) != "pageable"
        in_copy = copy is not None and i in shared
        if tiers.get(i) == "disk" or (in_copy and i in compressed and not copy.filler):
            jobs.append(None)  # disk views; a joiner takes the copy's encoded form
        elif i in compressed:  # the filler of a shared copy encodes into its room there, in order put in it
            stored = stored_unit_of(laid.file, keys, layout)
            alloc = _room_in(copy, i, backend.alloc_host) if in_copy else backend.alloc_host
            if stored is not None and stored.nbytes == layout.nbytes:
                jobs.append(functools.partial(decode_stored, layout, laid.file, stored, alloc, unit_pin,
                                              times, spill))
            else:
                jobs.append(functools.partial(encode_unit, layout, laid.file, keys, alloc, unit_pin,
                                              times, spill))
        elif in_copy:
            jobs.append(functools.partial(place_shared, copy, i, layout, laid.file, keys, times))
        elif any(leaf.meta for leaf in layout.leaves) or any(t.is_meta for t in layout.sources()):
            jobs.append(functools.partial(ram_unit, layout, laid.file, keys, backend.alloc_host, unit_pin, times))
        else:  # a unit in RAM already: copied in order, so host memory rises by one unit at a time
            jobs.append(None)
    return jobs


def stage_model(laid: ModelLayout, tiers: dict[int, str], backend: Any, pin: bool, bounce_count: int,
                bounce_bytes: int | None = None, progress: Callable[[int, int], None] | None = None,
                shared: frozenset[int] = frozenset(), compressed: frozenset[int] | set[int] = frozenset(),
                spill_rest: bool = False, times: SetupTimes | None = None,
                encode_later: frozenset[int] = frozenset(), publish_later: frozenset[int] = frozenset()) -> StagedModel:
    """Apply a host plan: each unit into its tier (`tiers`: pinned, pageable or disk; the units in `shared` in the
    host copy shared with other processes offloading the same file) and form (`compressed`: held in RAM in the
    codec's form), one unit at a time in order, with the next units read (and encoded) ahead on staging's workers
    (`stage_reads.py`), and the read-ahead thread (`bounce_count` buffers of at most `bounce_bytes`) for the units
    that are bounced. `times` adds up where the time went. The units in `encode_later` are staged raw (encoded on a
    thread after setup, `stream/background_encode.py`). The units in `publish_later` are staged in this process's
    own RAM when it fills the shared copy (put in it on a thread after setup, `stream/background_publish.py`), in
    the copy now when another process filled it."""
    units, layouts, file, keys = laid.units, laid.layouts, laid.file, laid.keys
    compressed = frozenset(compressed) - encode_later
    times = times if times is not None else SetupTimes()
    masters: list[StagingBuffer] = []
    total = len(units) + 1
    notice = logging.WARNING if backend.supports_pinned_host else logging.INFO  # quiet where pinning cannot exist
    reader = rest = ahead = None
    casting = {i for i, c in laid.casts.items() if tiers.get(i) == "disk" and any(x is not None for x in c)}
    spill = SpillFile() if spill_rest or casting or any(tiers.get(i) != "disk" for i in compressed) else None
    copy = (SharedHostCopy.open(file.path, layouts, [u.name for u in units], shared)
            if shared and file is not None else None)
    later = frozenset(publish_later) if copy is not None and copy.filler else frozenset()
    shared = frozenset(shared) - later  # the units in the copy at setup
    # until they move into the copy (registered there, where the plan pins them) they are pageable and copied
    # straight: no pin made to be let go, no bounce buffers kept for them
    pinned_later = frozenset(i for i in later if pin and tiers.get(i) == "pinned")
    tiers = {**tiers, **{i: "pageable" for i in later}}
    try:
        ahead = ReadAhead(_jobs(laid, tiers, backend, pin, shared, compressed, spill, copy, times))
        times.workers = ahead.n
        for i, layout in enumerate(layouts):
            prepared = ahead.take(i)
            if tiers.get(i) == "disk":
                masters.append(StagingBuffer.on_disk(layout, file, keys[i], laid.casts.get(i), spill))
            elif i in compressed:
                if prepared is not None:
                    unit_pin = pin and tiers.get(i) != "pageable"
                    masters.append(StagingBuffer.encoded_by(layout, prepared, copy if i in shared else None, i,
                                                            backend.alloc_host, unit_pin))
                else:
                    unit_pin = pin and tiers.get(i) != "pageable"
                    with times.timed("encode_ms"):
                        masters.append(StagingBuffer.compressed(layout, backend.alloc_host, unit_pin, spill, file,
                                                                keys.get(i), copy=copy if i in shared else None,
                                                                index=i))
                    if masters[-1].encoded is not None and stored_unit_of(file, keys.get(i), layout) is not None:
                        times.stored_units += 1
            else:
                master = (StagingBuffer.in_shared(i, layout, copy, file, keys.get(i), prepared, times)
                          if copy is not None and i in shared else None)
                prepared = None if copy is not None and i in shared else prepared
                masters.append(master or StagingBuffer.in_ram(layout, backend.alloc_host,
                                                              pin and tiers.get(i) != "pageable", file, keys.get(i),
                                                              notice, prepared))
            if progress:
                progress(i + 1, total)
        if copy is not None and not later:  # else the thread putting the rest in finishes it
            copy.finish(backend, {i for i in shared if pin and tiers.get(i) == "pinned"})
            for k, m in enumerate(masters):  # the copy is pinned (registered) now, or not
                if m.shared is not None or m.segment is not None:  # raw in the copy, or its encoded blob there
                    unit = copy.unit(k, m.host, m.layout) if m.shared is not None else None
                    masters[k] = replace(m, pinned=copy.pinned_view(k) is not None, shared=unit)
        # Non-block tensors: always resident; the host copy stays the master for unload and detach.
        if spill_rest and laid.rest.nbytes:
            rest = StagingBuffer.compressed(laid.rest, backend.alloc_host, False, spill, file, laid.rest_keys,
                                            encode=False)
        else:
            rest = StagingBuffer.in_ram(laid.rest, backend.alloc_host, False, file, laid.rest_keys)
        # the read-ahead thread, for units that are bounced: the disk tier, and pageable RAM (planned so, or
        # pinning refused) on a device with pinned memory, whose straight copies would block the forward
        bounced = [m.layout.nbytes if m.encoded is None else m.encoded.size for k, m in enumerate(masters)
                   if m.host is None or (not m.pinned and backend.supports_pinned_host and k not in later)]
        if bounced:
            size = max(bounced) if bounce_bytes is None else min(max(bounced), bounce_bytes)
            reader = BounceReader(backend, size, bounce_count)  # a smaller buffer reads a unit in ranges
    except BaseException:
        if ahead is not None:
            ahead.close()
        for m in reversed(masters + ([rest] if rest is not None else [])):
            m.restore_ordinary()
        if copy is not None:
            copy.close()
        raise
    finally:
        if ahead is not None:
            ahead.close()
        drop_transients()
        forget = getattr(file, "forget_decoded", None)  # a packed folder's last decoded unit: not held past staging
        if forget is not None:
            forget()
        if spill is not None:
            spill.close()  # the maps handed out keep their bytes
        if spill is not None or (ahead is not None and ahead.pooled):
            release_free_heap()  # the encoder's and the workers' transient buffers: freed, handed back to the OS
    staged = []
    for i, (unit, master) in enumerate(zip(units, masters)):
        source: UnitSource = (disk_source(file, keys[i], master.layout.leaves, master.layout.nbytes, reader, backend,
                                          master.casts, master.residue_pieces()) if master.host is None else
                              make_ram_source(master, backend, reader))
        staged.append(StagedUnit(i, unit.name, unit.module, master, source))
    if progress:
        progress(total, total)
    return StagedModel(staged, rest, laid.rest_bytes, reader, file, laid.key_of,
                       copy if copy is not None and (copy.placed or later) else None, later, pinned_later)


def _room_in(copy: SharedHostCopy, index: int, alloc_host: Any) -> Callable[[int, bool], tuple[torch.Tensor, bool]]:
    """Where a filler's worker encodes unit `index`: straight into the shared copy, else a host buffer of its own."""
    def alloc(size: int, pin: bool) -> tuple[torch.Tensor, bool]:
        room = copy.room(index, size)
        return (room, False) if room is not None else alloc_host(size, pin)
    return alloc


def place_shared(copy: SharedHostCopy, index: int, layout: TensorLayout, file: Any, keys: list[Any] | None,
                 times: SetupTimes | None = None) -> torch.Tensor | None:
    """Unit `index` placed in the host copy shared between processes: the filler reads it from the file straight
    into the segment (`stage_reads.fill_from`); None where the copy cannot hold it."""
    return copy.place(index, layout, lambda dst: fill_from(layout, dst, file, keys, times),
                      write_through(layout, file, keys, times))


def make_ram_source(master: StagingBuffer, backend: Any, reader: BounceReader | None) -> UnitSource:
    """The source for a RAM master: straight copies when pinned (or no pinned memory exists), else bounced; a unit
    in the shared host copy from its registered shared mapping (SharedSource) where the copy is pinned; a compressed
    master's encoded bytes, decoded on the device."""
    if master.encoded is not None:
        return CompressedSource(master.encoded, master.encoded.blob, master.pinned, backend, reader,
                                master.host, list(master.layout.leaves), backend.alloc_host, master.segment)
    if master.shared is not None and master.shared.pinned:
        return SharedSource(master.shared, backend)
    if not master.pinned and backend.supports_pinned_host and reader is not None:
        return BouncedSource(master.host, reader)
    return HostSource(master.host, master.pinned, backend)


def _spilled(spill: SpillFile, value: torch.Tensor, leaf: Any) -> torch.Tensor:
    """A leaf's bytes written to the spill file, viewed back as the leaf (a cast leaf's master between passes)."""
    raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
    return spill.put(raw).view(leaf.dtype).view(leaf.shape)


def _residue(layout: TensorLayout, resident: list[int], current: list[torch.Tensor] | None,
             ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """The unit's residue: the leaves the file lacks copied into one flat RAM buffer (leaf_match.residue_offsets),
    and each one's view there as the leaf."""
    if not resident:
        return None, {}
    leaves = [layout.leaves[k] for k in resident]
    offsets, total = residue_offsets(leaves)
    residue = torch.zeros(total, dtype=torch.uint8)
    kept = {}
    with torch.no_grad():
        for k, leaf, at in zip(resident, leaves, offsets):
            raw = residue[at:at + leaf.nbytes]
            raw.copy_(current[k].detach().contiguous().reshape(-1).view(torch.uint8))
            kept[k] = raw.view(leaf.dtype).view(leaf.shape)
    return residue, kept
