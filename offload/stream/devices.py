"""Several devices for one model: blocks resident on a secondary device run there, activations hop over.

`SecondaryShare` is the model's member in a secondary device's `VramBudget` (it holds no floor: a secondary device
only takes blocks that would otherwise stream). `ActivationHop` moves a block's inputs to the device its resident
copy lives on and its outputs back to the compute device, and counts the bytes each hop moves. `SecondaryDevices`
is all of that for one model. Which blocks go to which device is the planner's (`plan_device.across_devices`).
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..backends.base import Backend

if TYPE_CHECKING:
    from ..budget.vram_budget import VramBudget
    from .placement import DevicePlacement

log = logging.getLogger(__name__)


class SecondaryShare:
    """One model's place in a secondary device's budget: what it may keep resident there, by its priority."""

    def __init__(self, owner: Any, device: str, backend: Backend, budget: "VramBudget") -> None:
        self._owner = weakref.ref(owner)  # the handle; it keeps this share alive, never the other way round
        self.device = device
        self.backend = backend
        self.budget = budget

    @property
    def name(self) -> str:
        owner = self._owner()
        return f"{owner.name if owner is not None else 'model'} on {self.device}"

    @property
    def priority(self) -> int:
        owner = self._owner()
        return owner.priority if owner is not None else 0

    @priority.setter
    def priority(self, value: int) -> None:  # VramBudget.prioritize() raises the member it is given
        owner = self._owner()
        if owner is not None:
            owner.priority = value

    def floor_bytes(self) -> int:
        return 0  # the model runs without this device: its blocks stream instead

    def want_bytes(self) -> int:
        owner = self._owner()
        return owner.remote_want_bytes() if owner is not None else 0

    def device_bytes(self) -> int:
        owner = self._owner()
        return owner.remote_bytes(self.device) if owner is not None else 0

    def is_busy(self) -> bool:
        owner = self._owner()
        return owner is not None and owner.is_busy()

    def pass_thread(self) -> int | None:
        owner = self._owner()
        return owner.pass_thread() if owner is not None else None

    def device_total(self) -> int | None:
        return self.backend.mem_get_info()[1]

    def shrink_to(self, nbytes: int) -> int:
        """Called by the budget while the model is idle: hold at most `nbytes` on this device from now on."""
        owner = self._owner()
        return owner.shrink_remote(self.device, nbytes) if owner is not None else 0


class SecondaryDevices:
    """One model's secondary devices: their backends, its share in each one's budget, and the activation hops.

    Made before staging (each budget is sized and checked against its device, so a refused model is left as it
    was); `attach` installs the hops once the model streams. Which blocks go where is the planner's
    (plan_device.across_devices); this only answers for the budgets and moves activations.
    """

    def __init__(self, owner: Any, config: Any, devices: list[str], budgets: dict[str, "VramBudget"]) -> None:
        from ..backends import get_backend
        from ..budget.vram_budget import default_budget
        from ..plan.planner import default_reserve

        self.backends = {d: get_backend(config, d) for d in devices}
        self.budgets = {d: budgets.get(d) or default_budget(d) for d in devices}
        for d, b in self.budgets.items():  # sized (when self-sized) and checked before staging
            back = self.backends[d]
            d_free, d_total = back.mem_get_info()
            b.resolve_total(max(0, min(d_free, d_total) - default_reserve(d_total, back.name)), back)
            b.check_device(d_total)
        self.shares = {d: SecondaryShare(owner, d, self.backends[d], b) for d, b in self.budgets.items()}
        self.hop: ActivationHop | None = None

    def attach(self, placement: "DevicePlacement", compute: Backend, units: list[nn.Module]) -> None:
        """The model streams now: the placement knows these devices, and blocks resident on one compute there."""
        placement.secondaries = dict(self.backends)
        if self.shares:
            self.hop = ActivationHop(placement, compute, dict(self.backends))
            self.hop.install(units)

    def register(self) -> None:
        for share in self.shares.values():
            share.budget.register(share)

    def unregister(self) -> None:
        for share in self.shares.values():
            share.budget.unregister(share)

    def remove(self) -> None:
        """Detach: the hops go, the budgets forget the model."""
        if self.hop is not None:
            self.hop.remove()
        self.unregister()

    def allowances(self) -> dict[str, int]:
        """Bytes this model may keep on each secondary device now (idle others give back what it is owed)."""
        return {d: share.budget.allowance(share) for d, share in self.shares.items()}

    def priority_changed(self) -> None:
        for share in self.shares.values():
            share.budget.priority_changed(share)

    def report(self, placement: "DevicePlacement") -> dict[str, dict[str, int]]:
        """Per secondary device: bytes held now, the peak, blocks resident, activation bytes moved."""
        out = {}
        for d in self.shares:
            out[d] = {"device_bytes": placement.bytes_on(d),
                      "peak_device_bytes": max(placement.peak_on.get(d, 0), placement.bytes_on(d)),
                      "resident_blocks": sum(1 for u in placement.units if u.home == d)}
            if self.hop is not None:
                out[d]["activation_bytes"] = self.hop.hop_bytes[d]
        return out


class _WeakCall:
    """A hook calling a method of an object held weakly (no model -> hooks -> engine -> model cycle)."""

    __slots__ = ("_ref", "_fn", "_index")

    def __init__(self, obj: Any, fn: Callable[..., Any], index: int) -> None:
        self._ref = weakref.ref(obj)
        self._fn = fn
        self._index = index

    def __call__(self, *args: Any) -> Any:
        obj = self._ref()
        return None if obj is None else self._fn(obj, self._index, *args)


class ActivationHop:
    """Moves a remote-resident block's inputs to its device and its outputs back, counting the bytes moved."""

    def __init__(self, placement: "DevicePlacement", compute: Backend, secondaries: dict[str, Backend]) -> None:
        self.placement = placement
        self.compute = compute
        self.secondaries = secondaries
        self.hop_bytes: dict[str, int] = {d: 0 for d in secondaries}
        self.hops: dict[str, int] = {d: 0 for d in secondaries}
        self._hooks: list[Any] = []

    def install(self, units: list[nn.Module]) -> None:
        """Hooks on every unit: inert while the unit has no secondary home (one dict read per call)."""
        cls = type(self)
        for i, module in enumerate(units):
            self._hooks.append(module.register_forward_pre_hook(_WeakCall(self, cls._pre, i), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(_WeakCall(self, cls._post, i)))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _move(self, obj: Any, src: Backend, dst: Backend, device: str) -> Any:
        moved = 0

        def move(t: Any) -> Any:
            nonlocal moved
            if isinstance(t, torch.Tensor) and t.device == src.device:
                moved += t.numel() * t.element_size()
                return src.move_to(t, dst)
            return t

        out = tree_map(move, obj)
        if moved:
            self.hop_bytes[device] += moved
            self.hops[device] += 1
        return out

    def _pre(self, index: int, module: nn.Module, args: Any, kwargs: Any) -> Any:
        home = self.placement.units[index].home if index < len(self.placement.units) else None
        if home is None:
            return None
        dst = self.secondaries[home]
        return self._move(args, self.compute, dst, home), self._move(kwargs, self.compute, dst, home)

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        home = self.placement.units[index].home if index < len(self.placement.units) else None
        if home is None:
            return None
        return self._move(output, self.secondaries[home], self.compute, home)
