"""Write detection between passes: weights written in place, and parameters another owner replaced.

Version counters of the tensors bound between forwards tell which units were written (load_state_dict, a
merged patch): a streamed unit's queued copies are stale, a disk-tier unit leaves the disk tier, a resident
unit's host master catches up when it is evicted. A module holding a Parameter that is not the engine's own is
taken back when it is over the engine's bytes, and otherwise runs as its owner set it up (a foreign unit).
"""
from __future__ import annotations

import logging
from typing import Any

from .host_tiers import HostTiers
from .placement import DevicePlacement, UnitState
from .prefetch import PrefetchWorker
from .staging import StagedModel

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

    def check_writes(self) -> None:
        """Notice weights written in place between forwards (load_state_dict, a merged patch).

        A streamed unit's host master changed: copies already queued for it are stale, so the lookahead is
        restarted. A disk-tier unit written in place leaves the disk tier (its bytes now differ from the file).
        A resident unit's device copy changed: the host master catches up when it is evicted.
        """
        stale = False
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
                    stale = True
        self._check_rest()
        if stale:
            log.debug("weights changed in place; restarting the lookahead")
            self.worker.restart()

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
        p.rest_device_newer = p.rest_buf is not None
        p.rest_mark = self.staged.rest.layout.version()
        if computing is None:
            self.worker.restart()
