"""Host tiers of one staged model: which units' masters live in RAM and which are read from the disk file.

`HostTiers` moves units between tiers after staging: a disk-tier unit written in place gets a RAM master
(`promote_to_ram`), and RAM is given back on request by moving units whose exact bytes the file holds to the
disk tier (`release_host_memory`; a unit's leaves its file lacks stay in RAM as its residue, see
store/leaf_match.py). It also reports the host bytes the model holds, the residue included.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ..backends.base import Backend
from ..plan.planner import bounce_buffers
from ..store.compressed import disk_source, unit_host_bytes, unit_segment, unit_shared
from ..store.sources import BounceReader
from ..store.leaf_match import FileMap, holding_map, leaf_from_file
from ..store.spill import SpillFile
from ..store.staging import StagedModel, StagingBuffer, make_ram_source
from .placement import UnitState, quiesce
from .prefetch import PrefetchWorker

log = logging.getLogger(__name__)


class HostTiers:
    """The host side of a staged model's units: RAM or disk masters, the read-ahead thread's bounce buffers."""

    def __init__(self, staged: StagedModel, units: list[UnitState], sources: list[Any], backend: Backend,
                 worker: PrefetchWorker, pin_memory: bool, prefetch: int) -> None:
        self.staged = staged
        self.units = units  # shared with the streamer (the same list object)
        self.sources = sources  # shared with the worker
        self.backend = backend
        self.worker = worker
        self.pin_memory = pin_memory
        self.prefetch = prefetch

    def differs_from_file(self, u: UnitState) -> bool:
        """Whether a disk-tier unit's views hold other bytes than its file (a write through `.data`)."""
        master = u.master
        master.file.check_unchanged()  # reading the map of a truncated file would be fatal
        casts = master.casts or (None,) * len(master.keys)
        layout = master.layout
        if any(e.current() is None for e in layout.entries):
            return True
        for leaf, t, key, cast in zip(layout.leaves, layout.sources(), master.keys, casts):
            if key is None:  # a leaf of the residue: its RAM copy is the master, written in place or not
                continue
            want = leaf_from_file(master.file, key, leaf, cast)
            if not torch.equal(t.detach().contiguous().reshape(-1).view(torch.uint8),
                               want.reshape(-1).view(torch.uint8)):
                return True
        return False

    def promote_to_ram(self, u: UnitState, device_copy: torch.Tensor | None = None) -> None:
        """A disk-tier unit whose bytes were written in place gets a RAM master (from the written views, or from
        its device copy) and streams from RAM from now on: pread would return the file's, not the written, bytes."""
        old = u.master
        layout = old.layout
        host, pinned = self.backend.alloc_host(layout.nbytes, self.pin_memory)
        with torch.no_grad():
            if device_copy is not None:
                self.backend.synchronize()
                host.copy_(device_copy)
            else:
                old.file.check_unchanged()
                for view, src in zip(layout.leaf_views(host), layout.sources()):
                    view.copy_(src.detach())
        binding = layout.build(host, master=True)
        master = StagingBuffer(layout, host, pinned, binding)
        if u.resident_buf is None:
            binding.apply()
        u.staged.master = master
        u.staged.source = self.sources[u.index] = make_ram_source(master, self.backend, self.staged.reader)
        u.mark = layout.version()
        log.info("%s was written in place; it streams from RAM from now on instead of %s", u.staged.name,
                 old.file.path if old.file is not None else "its file")

    def privatize(self, u: UnitState) -> None:
        """A unit of the host copy shared between processes that this process wrote gets a RAM master of its own
        (copy-on-write at unit granularity): the other processes keep the original bytes, this one streams what it
        wrote. The pages the write made private in the shared mapping are given back."""
        old = u.master
        layout = old.layout
        host, pinned = self.backend.alloc_host(layout.nbytes, self.pin_memory)
        with torch.no_grad():
            host.copy_(old.host)  # this process's copy-on-write view: the written bytes
        binding = layout.build(host, master=True)
        if u.resident_buf is None:
            binding.apply()
        u.staged.master = StagingBuffer(layout, host, pinned, binding)
        u.staged.source = self.sources[u.index] = make_ram_source(u.staged.master, self.backend, self.staged.reader)
        u.mark = layout.version()
        quiesce(self.staged, self.backend)  # no read or copy may still use the pages about to be given back
        old.shared.drop_private_pages()
        old.shared.copy.let_go.add(old.shared.index)  # this model no longer holds the unit in the shared copy
        log.info("%s was written in this process: it keeps a private copy; the other processes sharing its host copy "
                 "keep the original bytes", u.staged.name)

    def take_encoded(self, i: int, old: StagingBuffer, version: int, raw: torch.Tensor, encoded: Any,
                     pinned: bool) -> bool:
        """Unit i, encoded in the background from its raw master `old` (at `version`), held compressed from now on:
        its modules view `raw` (the spill map of the same bytes), it streams `encoded`. Refused (False) where the
        unit moved or was written since. The caller holds the pass lock."""
        u = self.units[i]
        layout = u.staged.layout
        if u.staged.master is not old or layout.version() != version:
            return False
        self._swap_in(u, StagingBuffer(layout, raw, pinned, layout.build(raw, master=True), encoded=encoded,
                                       spilled=True))
        if old.shared is not None:
            old.shared.copy.give_back(old.shared.index)  # alone (checked before encoding): its pages go
        self.worker.restart()  # copies queued from the raw master are issued again from the encoded one
        return True

    def take_shared(self, i: int, old: StagingBuffer, version: int, host: torch.Tensor) -> bool:
        """Unit i, put in the shared host copy after setup from its private master `old` (at `version`): its modules
        view `host` (this process's copy-on-write mapping of it) from now on, and the private buffer goes. Refused
        (False) where the unit moved or was written since. The caller holds the pass lock."""
        u = self.units[i]
        layout = u.staged.layout
        copy = self.staged.shared
        if copy is None or u.staged.master is not old or layout.version() != version:
            return False
        self._swap_in(u, StagingBuffer(layout, host, False, layout.build(host, master=True),
                                       shared=copy.unit(i, host, layout)))
        self.worker.restart()  # copies queued from the private master are issued again from the shared one
        return True

    def _swap_in(self, u: UnitState, master: StagingBuffer) -> None:
        """`master` becomes u's master at a safe point: nothing in flight still reads the old one, the modules view
        the new one (a resident unit's views are swapped in when it is evicted), and u streams from it."""
        quiesce(self.staged, self.backend)
        if u.resident_buf is None:
            master.host_binding.apply()
        u.staged.master = master
        u.staged.source = self.sources[u.index] = make_ram_source(master, self.backend, self.staged.reader)
        u.mark = u.staged.layout.version()

    def pin_published(self, units: list[int]) -> None:
        """The units moved into the shared host copy after setup copy to the device from its registered (pinned)
        mapping once the copy is finished, where it registered them. The caller holds the pass lock."""
        copy = self.staged.shared
        if copy is None:
            return
        for i in units:
            u = self.units[i]
            m = u.staged.master
            if m.shared is None or m.shared.copy is not copy or copy.pinned_view(i) is None:
                continue
            u.staged.master = replace(m, pinned=True, shared=copy.unit(i, m.host, m.layout))
            u.staged.source = self.sources[i] = make_ram_source(u.staged.master, self.backend, self.staged.reader)
        self.worker.restart()

    def host_memory(self) -> dict[str, int]:
        """Host bytes this model holds: in RAM (blocks and non-block weights), of which pinned, of which in the copy
        shared with other processes, and on disk; the blocks' raw bytes in RAM (`blocks_raw`: what `ram` holds
        compressed, counted as raw); `residue`: the RAM the disk-tier blocks keep for the leaves their file lacks
        (counted in `ram`)."""
        ram = pinned = disk = shared = raw = residue = 0
        for u in self.units:
            if u.master.host is None:
                disk += u.nbytes
                held = unit_host_bytes(u.staged)  # the unit's residue
                ram += held
                residue += held
            else:
                held = unit_host_bytes(u.staged)
                ram += held
                raw += u.nbytes
                pinned += held if u.master.pinned else 0
                shared += held if unit_shared(u.staged) else 0
        ram += 0 if self.staged.rest.spilled else self.staged.rest.layout.nbytes
        reader = self.staged.reader
        if reader is not None:
            ram += reader.bounce_bytes * reader.count + reader.scratch_bytes
            pinned += reader.bounce_bytes * reader.count if reader.pinned else 0
        return {"ram": ram, "pinned": pinned, "disk": disk, "shared": shared, "blocks_raw": raw, "residue": residue}

    def release_host_memory(self, nbytes: int, order: list[int]) -> int:
        """Free at least `nbytes` of host RAM by moving blocks to the disk tier in the plan's `order`, where the
        model's file holds their exact bytes (checked; a block of the host copy shared between processes only while
        no other process maps the copy: otherwise letting go of it frees nothing); returns the bytes freed, net of
        any bounce buffers the disk tier needed (0 without a file). A block another model of this process still holds
        in the shared copy is freed when that one lets it go too: it counts towards `nbytes` here but not in the bytes
        returned (asked the same, that model frees it). The caller holds the pass lock."""
        staged = self.staged
        file = staged.file
        if file is None or nbytes <= 0:
            return 0
        candidates = [self.units[i] for i in order if self.units[i].master.host is not None]
        biggest = max((x.nbytes for x in self.units), default=0)
        reader = staged.reader
        if reader is None or reader.bounce_bytes < biggest:  # the disk tier would need new bounce buffers
            extra = biggest * bounce_buffers(self.prefetch) - (0 if reader is None else
                                                               reader.bounce_bytes * reader.count)
            if sum(u.nbytes for u in candidates) <= extra:
                return 0  # moving every block could not even pay for the bounce buffers
        freed = cost = pending = 0
        refused: list[str] = []
        for u in candidates:
            if freed + pending - cost >= nbytes:
                break
            shared = unit_segment(u.staged)  # (copy, index): raw or encoded in the copy shared between processes
            if shared is not None and not shared[0].alone():
                continue
            found = holding_map(file, u.staged.layout, staged.key_of, refused=refused)
            if found is None:
                continue
            quiesce(staged, self.backend)  # no read or copy may still use the RAM master about to go
            if staged.reader is None or staged.reader.bounce_bytes < u.nbytes:
                cost += self._replace_reader(biggest)
            held = unit_host_bytes(u.staged)  # a compressed unit frees its encoded blob
            layout = u.staged.layout
            # cast leaves: their bytes spilled; the leaves the file lacks: kept as the unit's residue
            values = layout.leaf_views(u.master.host) if found.cast or found.resident else None
            u.staged.master = StagingBuffer.on_disk(layout, file, found.keys, found.casts, self._spill(found),
                                                    apply=u.resident_buf is None, values=values)
            del values
            u.staged.source = self.sources[u.index] = disk_source(file, found.keys, layout.leaves, u.nbytes,
                                                                  staged.reader, self.backend, found.casts,
                                                                  u.staged.master.residue_pieces())
            u.mark = u.staged.layout.version()
            held -= unit_host_bytes(u.staged)  # the residue stays in RAM
            if shared is None or shared[0].give_back(shared[1]):
                freed += held
            else:
                pending += held  # another model of this process still holds it: freed when that one lets it go
        if refused:
            log.warning("not moving %d block(s) to the disk tier: %s%s; each stays in RAM", len(refused), refused[0],
                        f" (and {len(refused) - 1} more like it)" if len(refused) > 1 else "")
        if freed or pending:
            self.worker.restart()  # copies queued from the old masters are replaced by reads of the file
            self.backend.release_host_cache()  # freed pinned masters leave the process, not the allocator's cache
            log.info("moved %.1f MB of blocks to the disk tier (%s) to give RAM back%s", (freed + pending) / 2 ** 20,
                     file.path, f" ({pending / 2 ** 20:.1f} MB of them once the other models of this process holding "
                                f"them in the shared copy let them go)" if pending else "")
        return max(0, freed - cost)

    @staticmethod
    def _spill(found: FileMap) -> SpillFile | None:
        """A spill file for a unit whose leaves are cast on read (its maps outlive the file object)."""
        return SpillFile() if found.cast else None

    def _replace_reader(self, bounce_bytes: int) -> int:
        """A read-ahead thread with bounce buffers of `bounce_bytes`; returns the host bytes it added."""
        staged = self.staged
        old = staged.reader
        before = 0 if old is None else old.bounce_bytes * old.count
        if old is not None:
            old.close()
        staged.reader = BounceReader(self.backend, bounce_bytes, bounce_buffers(self.prefetch))
        for src in self.sources:  # sources bound to the old reader move to the new one
            if hasattr(src, "reader"):
                src.reader = staged.reader
        return staged.reader.bounce_bytes * staged.reader.count - before
