"""`offload_module` and the handle it returns: the user's grip on one offloaded model, a member of a VramBudget.

Setup reads top to bottom: the config is checked; the facts are gathered (the model's units and their layouts,
what the file holds, the devices and their budgets, the host memory); `planner.make_plan` turns them into the plan;
`staging.stage_model` stages the host side as the plan says; `ModelStreamer` streams, and `PlanKeeper` keeps the
plan current from then on (new facts: the budget's share, measured costs, stalls). The handle decides nothing
about placement itself. The model keeps its handle alive (it is stored on the model); the handle refers to the
model weakly. The handle is the streamer's pass listener: at every pass start it answers for the budget.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from .arguments import check_arguments, check_priority
from .budget.membership import BudgetMembership
from .budget.vram_budget import VramBudget
from .config import OffloadConfig
from .plan.planner import DeviceMemoryError  # noqa: F401  (raised through the handle: importable from here as before)
from .plan.replan import PlanKeeper
from .report.metrics import OffloadReport
from .reporting import ReportBase, build_report
from .setup import set_up
from .stream.restage import resized_facts

log = logging.getLogger(__name__)

HANDLE_ATTR = "_layer_offload_handle"


class DetachedError(RuntimeError):
    """A handle was used after `detach()`: offload the model again to stream it."""


class OffloadHandle(BudgetMembership):
    """Controls one offloaded model: its report, its priority in the budget, and detaching it."""

    def __init__(self, model: nn.Module, config: OffloadConfig, name: str, priority: int,
                 budget: VramBudget | dict[str, VramBudget] | None, units: list[str] | None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if getattr(model, HANDLE_ATTR, None) is not None:
            raise ValueError(f"{name!r} is already offloaded; detach() its handle first")
        self.config, self.name, self.priority = config, name, check_priority(priority)
        self._model = weakref.ref(model)
        s = set_up(model, config, name, budget, units, progress, listener=self, owner=self)  # config .. stream
        self.backend, self.device_name, self.budget, self.secondaries = s.backend, s.device_name, s.budget, \
            s.secondaries
        self.streamer, self._reserve, self._file_path, self._notices = s.streamer, s.reserve, s.file_path, s.notices
        self.setup_times = s.times  # where offload_module's time went (the report's `setup`)
        self.keeper = PlanKeeper(s.facts, s.streamer, s.backend, self)  # keeps the plan current from here on
        self._final_report: OffloadReport | None = None
        self._report_base = ReportBase()
        self._grad_said = False
        self._kv: Any = None  # the model's KVPager, once asked for
        setattr(model, HANDLE_ATTR, self)  # the model keeps its engine alive; the engine refers back weakly
        try:
            self.budget.register(self)
            self.secondaries.register()
            self.keeper.replan(self.budget.allowance(self), remote=self.secondaries.allowances())
        except BaseException:
            self.budget.unregister(self)
            self.secondaries.remove()
            self.streamer.detach()
            model.__dict__.pop(HANDLE_ATTR, None)
            raise
        log.info("offloaded %s: %d units (%s), %s", name, len(s.facts.sizes), self.backend.describe(),
                 self.plan_summary())

    @property
    def model(self) -> nn.Module | None:
        """The offloaded model (None once it was garbage collected)."""
        return self._model()

    @property
    def attached(self) -> bool:
        return self._final_report is None

    @property
    def reserve_bytes(self) -> int:
        """Device bytes kept free for activations (measured after the first forward of a self-sized budget)."""
        return self._reserve.reserve_bytes

    @property
    def plan(self) -> Any:
        """The plan in place (`offload.plan.planner.Plan`): where every unit lives and why."""
        return self.keeper.plan

    def _check_attached(self, what: str) -> None:
        if not self.attached:
            raise DetachedError(f"{self.name}: {what}() after detach(); the model is an ordinary module again "
                                f"(call offload_module() to stream it again)")

    def notice(self, kind: str, message: str) -> None:
        if kind not in self._notices:
            self._notices[kind] = message

    # pass listener ------------------------------------------------------------------
    def before_pass(self) -> None:
        """The safe point before a forward: take this model's share of the budget, growing back after an OOM."""
        self._warn_grad()
        if not self._reserve.measured:
            self.backend.reset_peak_allocated()
        self.budget.touch(self, self._kv, *self.secondaries.shares.values())  # recency: the model that runs now
        allowance = self.budget.allowance(self)
        need = min(self.floor_bytes(), self.want_bytes())
        if allowance < need:
            # Models running on other threads still hold bytes a lowered total took from them; they give them back
            # at their next safe point. Hold nothing meanwhile (so none waits on us), then take our share.
            self.streamer.unload()
            self.budget.notify_room()
            allowance = self.budget.wait_for_room(self, need)
        remote = self.secondaries.allowances()
        if self.keeper.stale(allowance, remote):
            self.keeper.replan(allowance, place=True, remote=remote)
            self.budget.notify_room()  # a smaller plan may have given bytes back

    def units_resized(self) -> None:
        """Units were laid out again (adapters added after offloading): plans from now on use their new sizes."""
        self.keeper.resized(resized_facts(self.keeper.base, self.streamer))

    def after_pass(self) -> None:
        """After a forward: the plan may change from what was measured; the first forward corrects the reserve."""
        self.budget.notify_room()  # models waiting for bytes this one holds look again
        self.keeper.after_pass()
        self._reserve.after_forward(self.backend, self.budget, self.device_total())

    def after_backward(self) -> None:
        """After a backward through streamed blocks (training): the reserve grows to a step's peak (the first one),
        and a plan the measurements asked for during the step is placed."""
        self._reserve.after_backward(self.backend, self.budget, self.device_total())
        if self.keeper.after_backward():
            self.budget.notify_room()  # a smaller plan may have given bytes back

    def _warn_grad(self) -> None:
        if self._grad_said or not torch.is_grad_enabled():
            return
        model = self.model
        if model is not None and any(p.requires_grad for p in model.parameters()):
            self._grad_said = True
            log.info("%s: running with gradients enabled: backward brings streamed blocks back in reverse order "
                     "(adapters train whether added before offloading, where they stay on the device, or after; a "
                     "streamed weight made trainable later is refused); use torch.no_grad() for inference", self.name)

    # public API -------------------------------------------------------------------------------
    def load(self) -> None:
        """Place the resident set and the slot ring now instead of at the next forward."""
        self._check_attached("load")
        with self.streamer.exclusive():
            self.before_pass()
            self.streamer.ensure_loaded()

    def unload(self, nbytes: int | None = None) -> int:
        """Free at least `nbytes` device bytes (None: all); returns the bytes freed."""
        self._check_attached("unload")
        if nbytes is not None:
            if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0 or \
                    not math.isfinite(nbytes):
                raise ValueError(f"unload(nbytes) takes a number of bytes >= 0 or None (everything), got {nbytes!r}")
        freed = self.streamer.unload(None if nbytes is None else int(nbytes))
        self.keeper.allowance = None  # plan again at the next forward
        return freed

    def host_memory(self) -> dict[str, int]:
        """Host bytes this model holds: `ram` (blocks, non-block weights, bounce buffers), of which `pinned`, and
        `disk` (blocks streamed from the model's file)."""
        if not self.attached:
            return {"ram": 0, "pinned": 0, "disk": 0}
        return self.streamer.host_memory()

    def release_host_memory(self, nbytes: int) -> int:
        """Give host RAM back: blocks whose exact bytes the model's file (`disk_path`) holds move to the disk tier.

        Returns the bytes freed, net of the bounce buffers the disk tier needs (0 without a file, when no block matches
        it, or when the preset keeps every block in RAM). Streaming goes on, from disk.
        """
        self._check_attached("release_host_memory")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"release_host_memory(nbytes) takes a number of bytes >= 0, got {nbytes!r}")
        if not self.config.allow_disk:
            return 0  # the preset keeps every block in RAM (high_end, mid_range)
        freed = self.streamer.release_host_memory(int(min(nbytes, 1 << 62)), self.keeper.plan.ram_release_order())
        if freed:
            self.notice("disk_tier", f"blocks stream from {self._file_path}: host RAM was released on request")
        return freed

    def refresh(self) -> None:
        """Call after writing weights in place through `.data` (writes that version counters cannot see).

        `load_state_dict`, `param.copy_()` and other in-place writes on the parameters are noticed on their own.
        """
        self._check_attached("refresh")
        self.streamer.refresh()

    def set_priority(self, priority: int) -> None:
        """Change this model's priority in its budget; takes effect at its next forward."""
        self._check_attached("set_priority")
        self.priority = check_priority(priority)
        if self._kv is not None:
            self._kv.priority = self.priority
            self.budget.priority_changed(self._kv)
        self.budget.priority_changed(self)
        self.secondaries.priority_changed()

    def kv_pager(self, page_tokens: int = 64, offload: bool = True) -> Any:
        """This model's paged KV cache store (offload/generate/kv_cache.py): caches made from it live under the same
        budget as the weights, at the same priority, and show in the report. Needs transformers."""
        self._check_attached("kv_pager")
        kv = self._kv
        if kv is None or kv.page_tokens != page_tokens or kv.offload_enabled != offload:
            from .generate.kv_cache import KVPager

            if kv is not None:
                self.budget.unregister(kv)
            self._kv = KVPager(self.backend, self.budget, self.name, self.priority, page_tokens, offload)
        return self._kv

    def mark_active(self) -> None:
        """This model is about to work (ComfyUI loads it for a node): it leads its priority in the budget now."""
        self._check_attached("mark_active")
        self.budget.touch(self, self._kv, *self.secondaries.shares.values(), explicit=True)

    def prioritize(self) -> None:
        """Give this model the highest priority in its budget and clear its watermark."""
        self._check_attached("prioritize")
        self.budget.prioritize(self)

    def reset_stats(self) -> None:
        """Start the report afresh (what the next runs do, not every run since setup)."""
        self._check_attached("reset_stats")
        self._report_base.reset(self.streamer)

    def report(self) -> OffloadReport:
        """Per-unit and total figures since setup or the last `reset_stats()` (the last report after detach)."""
        if self._final_report is not None:
            return self._final_report
        return build_report(self.streamer, self.keeper.plan, self._report_base, self.device_name, self.secondaries,
                            name=self.name, device=self.backend.describe(), preset=self.config.preset,
                            priority=self.priority, notices=[{"kind": k, "message": m} for k, m in self._notices.items()],
                            kv=self._kv.report() if self._kv is not None else None,
                            budget_reason=self.budget.explain_share(self),
                            setup=self._setup_report())

    def _setup_report(self) -> dict:
        """Where setup's time went, and the blocks encoded after it (held raw until each is done)."""
        out = self.setup_times.to_dict() if self.setup_times is not None else {}
        background = self.streamer.background
        if background is not None:
            out.update(background.status())
        return out

    def wait_encoded(self, timeout: float | None = None) -> bool:
        """Wait until the blocks put in the host copy shared between processes after setup
        (`report().setup["publish_units"]`) are there and those encoded after setup (`["background_units"]`: the plan
        holds them compressed, staging kept them raw so the load takes what a raw one does) are held compressed;
        False on timeout. Nothing to wait for: True."""
        background = self.streamer.background
        return True if background is None else background.wait(timeout)

    def detach(self) -> None:
        """Remove every hook; every weight becomes an ordinary tensor with its original values.

        Raises SourceChangedError (and changes nothing) when blocks live only in a file that changed on disk.
        """
        if not self.attached:
            return
        final = self.report()
        self.streamer.detach()
        self.secondaries.remove()
        self.budget.unregister(self)
        if self._kv is not None:
            self.budget.unregister(self._kv)
        model = self.model
        if model is not None and model.__dict__.get(HANDLE_ATTR) is self:
            del model.__dict__[HANDLE_ATTR]
        self._final_report = final

    def pack(self, out_dir: str, shard_bytes: int | None = None, overwrite: bool = False,
             compress: bool = False) -> str:
        """Write this model's weights as a packed folder (offload/store/packed.py): units in the call order the engine
        learned, each laid out as the engine's flat buffer, so `disk_path=out_dir` streams each unit with one read;
        `compress`: units stored losslessly compressed where that pays (fewer bytes read, decoded on the device).
        Returns the index path."""
        self._check_attached("pack")
        from .store.pack_writer import DEFAULT_SHARD_BYTES, pack_handle

        return str(pack_handle(self, out_dir, shard_bytes or DEFAULT_SHARD_BYTES, overwrite, compress))


def offload_module(model: nn.Module, config: OffloadConfig | None = None, name: str | None = None,
                   priority: int = 0, budget: VramBudget | dict[str, VramBudget] | None = None,
                   units: list[str] | None = None,
                   progress: Callable[[int, int], None] | None = None) -> OffloadHandle:
    """Stream `model`'s blocks from host memory to the device from now on; returns the handle."""
    config = config if config is not None else OffloadConfig.from_preset("auto")
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (OffloadConfig.from_preset(...)), got {type(config).__name__}")
    check_arguments(model, config, name, budget, units, progress)
    grad = torch.is_grad_enabled()  # the caller's: trainable parameters in blocks stay on the device only with grad
    with torch.inference_mode(False), torch.set_grad_enabled(grad):  # buffers and views serve grad and inference calls
        return OffloadHandle(model, config, name or type(model).__name__, priority, budget, units, progress)
