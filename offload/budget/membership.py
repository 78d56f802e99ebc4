"""What a VramBudget asks of an offloaded model (budget.py `BudgetMember`), answered for `OffloadHandle`: the least
and the most it can use, what it holds now, and shrinking while it is idle; the same for its share of each
secondary device; and the sizes ComfyUI's accounting and the nodes ask for (unit bytes, the plan for a share).
The model's plan itself is the PlanKeeper's (offload/plan/replan.py); this only answers for bytes."""
from __future__ import annotations

from typing import Any

from ..plan.planner import ring_slots, want_bytes


class BudgetMembership:
    """Mixed into OffloadHandle: it has `config`, `budget`, `backend`, `streamer`, `keeper`, `attached`, `_kv`."""

    config: Any
    budget: Any
    backend: Any
    streamer: Any
    keeper: Any
    _kv: Any

    def floor_bytes(self) -> int:
        """The least this model can run in: the non-block weights plus one slot of its largest unit."""
        return self.streamer.rest_bytes + self.keeper.base.scratch_bytes + max(self.keeper.base.sizes)

    def want_bytes(self) -> int:
        """The most this model asks for: every unit, or its preset's share of the budget (a full ring at least)."""
        cfg = self.config
        return want_bytes(cfg.prefetch, cfg.vram_fraction, cfg.vram_budget_bytes,
                          self.streamer.rest_bytes + self.keeper.base.scratch_bytes, list(self.keeper.base.sizes),
                          self.budget.total_bytes)

    def device_bytes(self) -> int:
        """Device bytes this model holds now (resident units, the slot ring, the non-block weights)."""
        return self.streamer.device_bytes() if self.attached else 0

    def is_busy(self) -> bool:
        return self.attached and self.streamer.is_busy()

    def pass_thread(self) -> int | None:
        """The thread running a pass over this model now (None between passes)."""
        return self.streamer._pass_owner if self.attached else None

    def kv_device_bytes(self) -> int:
        """Device bytes of this model's paged KV caches now (a budget member of their own)."""
        return self._kv.device_bytes() if self._kv is not None else 0

    def device_total(self) -> int | None:
        return self.backend.mem_get_info()[1]

    def shrink_to(self, nbytes: int) -> int:
        """Called by the budget while this model is idle: hold at most `nbytes` from now on."""
        if not self.attached:
            return 0
        with self.streamer.exclusive(blocking=False) as idle:
            if not idle or self.streamer.is_busy():
                return 0  # a pass is running (maybe on another thread): it re-plans at its next start
            return self.keeper.shrink_to(nbytes, self.floor_bytes())

    # a secondary device's budget (devices.py SecondaryShare asks through these) --------------------
    def remote_want_bytes(self) -> int:
        """What this model could keep on a secondary device: every block (the budget caps it)."""
        return sum(self.keeper.base.sizes)

    def remote_bytes(self, device: str) -> int:
        """Bytes of blocks resident on secondary `device` now."""
        return self.streamer.placement.bytes_on(device) if self.attached else 0

    def shrink_remote(self, device: str, nbytes: int) -> int:
        """Called by a secondary device's budget while this model is idle: keep at most `nbytes` there."""
        if not self.attached:
            return 0
        with self.streamer.exclusive(blocking=False) as idle:
            if not idle or self.streamer.is_busy():
                return 0  # a pass is running: it re-plans at its next start
            return self.keeper.shrink_remote(device, nbytes)

    def share_explained(self, allowance: int) -> str:
        """Where this model's allowance came from: the budget's total, what the others hold, its own limit."""
        total = self.budget.total_bytes
        parts = []
        if total is not None and allowance < total:
            held = self.budget.others_bytes(self)
            parts.append(f"This model's share is {allowance} bytes of the VRAM budget's {total} bytes "
                         f"({held} bytes are held by other models)")
        if self.config.vram_budget_bytes is not None and allowance >= int(self.config.vram_budget_bytes):
            parts.append(f"vram_budget_bytes={int(self.config.vram_budget_bytes)} limits this model")
        parts.append(self.budget.explain())
        return ". ".join(parts)

    def planned_device_bytes(self) -> int:
        """Device bytes the plan for this model's current share of the budget holds when placed."""
        if not self.attached:
            return 0
        share = self.budget.targets().get(id(self))
        allowance = self.keeper.allowance if share is None else min(share, self.want_bytes())
        if allowance is None:
            allowance = self.budget.allowance(self)
        return self.keeper.plan_for(max(allowance, min(self.floor_bytes(), self.want_bytes()))).device_bytes

    # sizes and plans (ComfyUI's accounting and the nodes ask) ---------------------------------------------
    def _make_plan(self, allowance: int) -> Any:
        """The plan for `allowance` device bytes now (DeviceMemoryError when not even one slot fits)."""
        return self.keeper.plan_for(allowance)

    def unit_bytes(self) -> dict[str, int]:
        """Each unit's size as it moves (aligned layout): what slots and resident units really take."""
        return dict(zip(self.keeper.base.names, self.keeper.base.sizes))

    @property
    def non_block_bytes(self) -> int:
        """Device bytes of the weights outside the units (always resident)."""
        return self.streamer.rest_bytes

    def budget_for(self, resident_units: int = 0, prefetch: int | None = None) -> int:
        """Device bytes a plan with the `resident_units` largest units resident and a full ring would need."""
        prefetch = self.config.prefetch if prefetch is None else prefetch
        sizes = sorted(self.keeper.base.sizes, reverse=True)
        resident, streamed = sizes[:resident_units], sizes[resident_units:]
        ring = ring_slots(prefetch, len(streamed)) * max(streamed) if streamed else 0
        return self.streamer.rest_bytes + sum(resident) + ring

    def plan_summary(self) -> str:
        return self.keeper.plan.summary() if self.keeper.plan is not None else "no plan"
