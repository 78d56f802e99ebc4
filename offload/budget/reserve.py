"""The activation reserve of a self-sized budget: device bytes kept free for what a forward (or a training step)
allocates beside the weights; estimated before the first run, then corrected from the measured peak."""
from __future__ import annotations

import logging

from ..backends.base import Backend
from ..plan.planner import GIB, MIB
from .vram_budget import VramBudget

log = logging.getLogger(__name__)


def reserve_from_peak(activation_bytes: int) -> int:
    """The reserve a measured activation peak asks for: a quarter more, plus 256 MiB for the allocator's slack."""
    return int(max(0, activation_bytes) * 1.25) + 256 * MIB


class ReserveMeter:
    """Measures the peak after the first forward (and the first backward) and moves a self-sized budget's total."""

    def __init__(self, reserve_bytes: int, fixed: bool) -> None:
        self.reserve_bytes = reserve_bytes
        self._fixed = fixed  # the user gave reserve_bytes: never corrected
        self.measured = False
        self.measured_backward = False

    def _measured(self, backend: Backend, budget: VramBudget) -> int | None:
        peak = backend.peak_allocated()
        if peak is None or not budget.auto_sized or self._fixed:
            return None
        return reserve_from_peak(peak - budget.used_bytes)

    def after_forward(self, backend: Backend, budget: VramBudget, device_total: int | None) -> None:
        """After the first forward: correct the reserve from the real peak (either way)."""
        if self.measured:
            return
        self.measured = True
        measured = self._measured(backend, budget)
        if measured is not None and abs(measured - self.reserve_bytes) > 64 * MIB:
            budget.adjust_total(self.reserve_bytes - measured, device_total)
            log.info("activation reserve corrected from %.2f to %.2f GiB after the first run",
                     self.reserve_bytes / GIB, measured / GIB)
            self.reserve_bytes = measured

    def after_backward(self, backend: Backend, budget: VramBudget, device_total: int | None) -> None:
        """After the first backward through streamed blocks: a training step's peak holds the saved activations,
        the gradients and the trainable adapters, more than a forward's; the reserve grows to it (never shrinks)."""
        if self.measured_backward:
            return
        self.measured_backward = True
        measured = self._measured(backend, budget)
        if measured is not None and measured > self.reserve_bytes + 64 * MIB:
            budget.adjust_total(self.reserve_bytes - measured, device_total)
            log.info("activation reserve grown from %.2f to %.2f GiB after the first training step",
                     self.reserve_bytes / GIB, measured / GIB)
            self.reserve_bytes = measured
