"""VramBudget: one device-memory budget shared by every offloaded model: priority first, then recency.

Every model registers with a budget. The rule, in order:

1. **Priority.** A higher priority always wins: its models take their floors and then what they want before any
   lower-priority model gets more than its floor (the floor: non-block weights plus a one-slot ring).
2. **Recency among equal priorities.** The model that runs now leads its priority: it may take bytes from idle
   models of the same priority (least recently used first), their floors included, at its next safe point.
3. **Hysteresis.** A model takes the lead only when it works in a *phase*: its previous run (passes in a row with no
   pass of another model of its priority in between) or its current run is at least `PHASE_PASSES` passes long, the
   first time it runs at all, or when told (`touch(..., explicit=True)`: ComfyUI loading a model for a node), and
   never while the model leading now is itself in a pass (a model called inside another's forward).
   Two models alternating every forward therefore keep the split they have instead of copying their resident sets
   back and forth; an idle model that ran since the last change of lead keeps its floor (it is part of the work).
4. **Watermark.** A model that lost bytes to a higher-priority one keeps streaming them instead of winning them back
   every forward; `prioritize()`, a total set anew or a model leaving clears it.

Bytes move only at safe points: a model grows at the start of its own forward; an idle model is shrunk at once when
another needs its bytes. `explain_share(member)` says in words why a member holds what it holds.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import Protocol

from ..config import check_bytes
from .recency import PHASE_PASSES, Recency

log = logging.getLogger(__name__)


class BudgetMember(Protocol):
    """What the budget needs to know about a registered model."""

    name: str
    priority: int

    def floor_bytes(self) -> int: ...

    def want_bytes(self) -> int: ...

    def device_bytes(self) -> int: ...

    def is_busy(self) -> bool: ...

    def shrink_to(self, nbytes: int) -> int: ...

    def device_total(self) -> int | None: ...

    def pass_thread(self) -> int | None: ...


def _validate_total(total: object) -> None:
    check_bytes("VRAM budget", total)


class BudgetError(ValueError):
    """A budget total that cannot work: names the limit, where the budget came from and how to change it."""


HOW_TO_CHANGE = ("it is process-wide and stays until changed: set another total with a VRAM Budget node in "
                 "ComfyUI, or default_budget().set_total(nbytes) in Python")


class VramBudget:
    """A device-memory budget in bytes shared by several models; `total_bytes=None` sizes itself on first use."""

    def __init__(self, total_bytes: int | None = None, origin: str | None = None) -> None:
        _validate_total(total_bytes)
        self._total = None if total_bytes is None else int(total_bytes)
        self.origin = origin or ("sized from free device memory when the first model joins" if total_bytes is None
                                 else f"given as VramBudget({int(total_bytes)})")
        self.auto_sized = False  # sized from free device memory rather than by the user
        self._sized_from: object = None  # the backend a self-sized total was read from
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # told when a member ends a pass or gives bytes back
        # Weak references: a model its owner dropped without detach() must not be kept alive (with its device
        # memory) by the budget; the model and its handle refer to each other, so either keeps both alive.
        self._refs: list[weakref.ReferenceType] = []
        self._recency = Recency()  # registrations, pass starts and leads: the ranking among equal priorities
        self._caps: dict[int, int] = {}  # watermarks: id(member) -> max bytes until prioritize()
        self._last_best: dict[int, int] = {}  # the most each member could hold as its priority's lead (watermark)

    # totals -------------------------------------------------------------------
    @property
    def total_bytes(self) -> int | None:
        return self._total

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(m.device_bytes() for m in self._members)

    @property
    def _members(self) -> list[BudgetMember]:
        live = [m for m in (r() for r in self._refs) if m is not None]
        if len(live) != len(self._refs):
            self._refs = [r for r in self._refs if r() is not None]
        return live

    @property
    def members(self) -> list[BudgetMember]:
        with self._lock:
            return list(self._members)

    def set_total(self, total_bytes: int, device_total: int | None = None, origin: str | None = None) -> None:
        """Change the total; members over their new share are shrunk now if idle, else at their next forward.

        Refused (BudgetError, the old total kept) when larger than the device or smaller than what one registered
        model needs to run at all (its non-block weights plus one slot): the message names the limit.
        """
        _validate_total(total_bytes)
        if total_bytes is None:
            raise ValueError("set_total needs a number of bytes")
        with self._lock:
            if device_total is None:  # the devices of the registered models are known
                totals = [t for t in (m.device_total() for m in self._members) if t is not None]
                device_total = min(totals) if totals else None
            self._check_device(int(total_bytes), device_total)
            self.check_floor(int(total_bytes))
            self._total = int(total_bytes)
            self.origin = origin or f"set with set_total({int(total_bytes)})"
            self.auto_sized = False
            self._caps.clear()
            self.rebalance()

    def minimum_bytes(self) -> int:
        """The least total that lets every registered model run (each one alone, the others streamed out)."""
        with self._lock:
            return max((min(m.floor_bytes(), m.want_bytes()) for m in self._members), default=0)

    def check_floor(self, total: int) -> None:
        """Refuse a total below what one registered model needs: its non-block weights plus one slot."""
        with self._lock:
            for m in self._members:
                need = min(m.floor_bytes(), m.want_bytes())
                if total < need:
                    raise BudgetError(
                        f"VRAM budget {total / (1 << 30):.3f} GiB ({total} bytes) cannot run {m.name!r}: it needs at "
                        f"least {need} bytes ({need / (1 << 30):.3f} GiB: its weights outside the blocks plus one slot "
                        f"for its largest block); the minimum for the models loaded now is {self.minimum_bytes()} bytes")

    def explain(self) -> str:
        """Where this budget's total came from and how to change it (for error messages)."""
        total = "not sized yet" if self._total is None else f"{self._total / (1 << 30):.3f} GiB ({self._total} bytes)"
        return f"The VRAM budget is {total}, {self.origin}; {HOW_TO_CHANGE}"

    def resolve_total(self, default: int, device: object = None) -> None:
        """Size a budget created without a total (the process-wide default) from the device a model is on.

        A self-sized budget follows its devices: sized afresh when it is empty, and grown when a model on
        another device joins, so the first small device seen does not cap every later model.
        """
        with self._lock:
            if self._total is not None and not self.auto_sized:
                return
            empty = not self._members
            if self._total is None or (empty and device is not self._sized_from):
                self._total = int(default)
            elif device is not self._sized_from and default > self._total:
                log.info("a model on another device joined a self-sized VRAM budget; growing it to %.2f GiB",
                         default / (1 << 30))
                self._total = int(default)
            else:
                return
            self.auto_sized = True
            self._sized_from = device
            self.origin = "sized from free device memory minus an activation reserve (the default budget)"
            log.info("VRAM budget set to %.2f GiB from free device memory", self._total / (1 << 30))

    def adjust_total(self, delta: int, device_total: int | None) -> None:
        """Move a self-sized total by `delta` bytes (the activation reserve was re-measured)."""
        with self._lock:
            if self._total is None or not self.auto_sized:
                return
            limit = device_total if device_total is not None else self._total + max(0, delta)
            self._total = int(max(0, min(limit, self._total + delta)))
            self.rebalance()

    def check_device(self, device_total: int | None) -> None:
        """Refuse (ValueError with the limit) if this budget's total is larger than the device."""
        with self._lock:
            if self._total is not None:
                self._check_device(self._total, device_total)

    def _check_device(self, total: int, device_total: int | None) -> None:
        if device_total is not None and total > device_total:
            raise BudgetError(f"VRAM budget {total / (1 << 30):.2f} GiB ({total} bytes) is larger than the device "
                             f"({device_total / (1 << 30):.2f} GiB, {device_total} bytes); the limit is "
                             f"{device_total} bytes")

    # membership -----------------------------------------------------------------
    def register(self, member: BudgetMember) -> None:
        with self._lock:
            if self._total is not None:
                self._check_device(self._total, member.device_total())
            self._refs.append(weakref.ref(member, self._forget))
            self._recency.joined(id(member))
            self.rebalance()

    def unregister(self, member: BudgetMember) -> None:
        with self._lock:
            if any(m is member for m in self._members):
                self._refs = [r for r in self._refs if r() is not member]
                self._drop(id(member))
                self._caps.clear()  # bytes came free: everyone may grow back into them
                self.rebalance()

    def _forget(self, ref: weakref.ReferenceType) -> None:
        """A member was garbage collected without detach(): drop it so the others can grow into its bytes."""
        with self._lock:
            self._refs = [r for r in self._refs if r is not ref and r() is not None]
            live = {id(m) for m in self._members}
            for key in [k for k in self._recency.order if k not in live]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        self._recency.drop(key)
        self._caps.pop(key, None)
        self._last_best.pop(key, None)

    def prioritize(self, member: BudgetMember) -> None:
        """Give `member` the highest priority and clear its watermark."""
        with self._lock:
            top = max((m.priority for m in self._members), default=0)
            if member.priority <= top and any(m is not member and m.priority >= member.priority
                                              for m in self._members):
                member.priority = top + 1
            self._caps.pop(id(member), None)
            self.rebalance()

    def priority_changed(self, member: BudgetMember) -> None:
        with self._lock:
            self._caps.pop(id(member), None)
            self.rebalance()

    # recency ---------------------------------------------------------------------
    def touch(self, member: BudgetMember, *followers: BudgetMember | None, explicit: bool = False) -> bool:
        """`member` starts a pass (or, `explicit`, is about to work for a node): note it, and let it lead its priority
        when it works in a phase (see the module's rule). Returns whether it leads its priority now.

        `followers` (its KV pager, its share of another device's budget) start with it: in this budget they take
        the lead with it, ranked after it; one in another budget (`follower.budget`) is touched there.
        """
        with self._lock:
            key = id(member)
            if key not in self._recency.order:
                return False
            takes, lead = self._recency.start_pass(member, self._members, explicit)
            for f in followers:  # ranked with it (after it: registered later), never parked while it works
                if f is not None and getattr(f, "budget", self) is self and id(f) in self._recency.order:
                    self._recency.follow(key, id(f))
            if takes:
                log.debug("%s leads priority %d in the VRAM budget now (%s)", member.name, member.priority,
                          "asked" if explicit else "its phase")
        for f in followers:
            other = getattr(f, "budget", self) if f is not None else self
            if f is not None and other is not self:
                other.touch(f, explicit=explicit)
        return takes or lead is member

    def recency(self, member: BudgetMember) -> int:
        """When `member` last started a pass, on the budget's clock (higher is more recent; 0 for a stranger)."""
        with self._lock:
            return self._recency.last_pass(id(member))

    # policy ---------------------------------------------------------------------
    def _ranked(self, lead: BudgetMember | None = None) -> list[BudgetMember]:
        return self._recency.ranked(self._members, lead)

    def _shares(self, lead: BudgetMember | None = None, uncapped: BudgetMember | None = None) -> dict[int, int]:
        """Bytes each member may hold (by id): floors first (not for parked idle members), then the rest in ranked
        order up to each one's want (capped by its watermark). `lead`: as if it led its priority now and every other
        member of that priority were idle; `uncapped`: a member whose own watermark is left out."""
        total = self._total if self._total is not None else sum(m.want_bytes() for m in self._members)
        remaining = total
        t: dict[int, int] = {}
        ranked = self._ranked(lead)
        parked = self._recency.parked(ranked, lead)
        for m in ranked:
            if id(m) in parked and (lead is not None or not m.is_busy()):
                t[id(m)] = 0
                continue
            give = min(m.floor_bytes(), m.want_bytes(), remaining)
            t[id(m)] = give
            remaining -= give
        for m in ranked:
            want = m.want_bytes()
            cap = None if m is uncapped else self._caps.get(id(m))
            if cap is not None:
                want = min(want, max(cap, t[id(m)]))
            extra = min(max(0, want - t[id(m)]), remaining)
            t[id(m)] += extra
            remaining -= extra
        return t

    def targets(self) -> dict[int, int]:
        """Bytes each member may hold (by id): floors first, then the rest by priority and recency up to each one's
        want (the module's rule)."""
        with self._lock:
            return self._shares()

    def best_share(self, member: BudgetMember) -> int:
        """The most `member` could hold now if it led its priority (what models of other priorities leave it)."""
        with self._lock:
            return self._shares(lead=member, uncapped=member).get(id(member), 0)

    def rebalance(self) -> dict[int, int]:
        """Recompute shares, set watermarks for members whose best share fell (a higher priority or a new model took
        bytes; never a model of their own priority taking the lead), shrink idle members over their share."""
        with self._lock:
            t = self.targets()
            for m in self._members:
                best = self.best_share(m)
                old = self._last_best.get(id(m))
                if old is not None and best < old:
                    self._caps[id(m)] = best
                self._last_best[id(m)] = best
                if not m.is_busy() and m.device_bytes() > t[id(m)]:
                    m.shrink_to(t[id(m)])
            return t

    def explain_share(self, member: BudgetMember) -> str:
        """Why `member` holds what it holds: its share, the rule that gave it, who took the rest (one line)."""
        mib = 1 << 20
        with self._lock:
            if not any(m is member for m in self._members):
                return f"{member.name} is not in this VRAM budget"
            t = self._shares()
            mine = t.get(id(member), 0)
            want = member.want_bytes()
            total = self._total
            parts = [f"{member.name}: share {mine / mib:.1f} MB of the {'unsized' if total is None else f'{total / mib:.1f} MB'}"
                     f" VRAM budget (wants {want / mib:.1f} MB, holds {member.device_bytes() / mib:.1f} MB)"]
            higher = [m for m in self._members if m.priority > member.priority and t.get(id(m), 0) > 0]
            if higher:
                parts.append("priority {} comes first: {} hold {:.1f} MB".format(
                    ", ".join(str(p) for p in sorted({m.priority for m in higher}, reverse=True)),
                    ", ".join(m.name for m in higher), sum(t[id(m)] for m in higher) / mib))
            peers = [m for m in self._members if m is not member and m.priority == member.priority]
            lead = self._recency.leader(self._members, member.priority)
            if peers:
                if lead is member:
                    parts.append(f"it leads priority {member.priority} (the latest of {len(peers) + 1} models there to "
                                 f"work in a phase): idle ones of that priority give it their bytes")
                elif id(member) in self._recency.parked(self._members):
                    parts.append(f"idle since {lead.name if lead is not None else 'another model'} (same priority "
                                 f"{member.priority}) took the lead: no floor is kept for it; it takes its share back "
                                 f"when it runs again")
                else:
                    first = [m for m in self._ranked() if m.priority == member.priority]
                    ahead = [m.name for m in first[:first.index(member)]]
                    if ahead:
                        parts.append(f"served after {', '.join(ahead)} (same priority {member.priority}, led more "
                                     f"recently); models alternating every pass keep their split (a phase, which "
                                     f"takes the lead, is {PHASE_PASSES} passes in a row)")
            cap = self._caps.get(id(member))
            if cap is not None and cap < want and mine >= cap:
                parts.append(f"watermark: capped at {cap / mib:.1f} MB since a higher priority or a new model took "
                             f"bytes (prioritize() lifts it)")
            if mine >= want:
                parts.append("it gets all it wants")
            return "; ".join(parts)

    def allowance(self, member: BudgetMember) -> int:
        """Bytes `member` may hold for its next forward; idle others give back what it is owed."""
        with self._lock:
            t = self.targets()
            mine = max(t.get(id(member), 0), min(member.floor_bytes(), member.want_bytes()))
            total = self._total if self._total is not None else math.inf
            others = [m for m in self._members if m is not member]
            used = sum(m.device_bytes() for m in others)
            if used + mine > total:
                for m in reversed(self._ranked()):  # first: idle members over their share, least recent first
                    if m is not member and not m.is_busy() and m.device_bytes() > t.get(id(m), 0):
                        m.shrink_to(t.get(id(m), 0))
                used = sum(m.device_bytes() for m in others)
            if used + mine > total:  # then: idle members, lowest priority first, down to nothing
                for m in reversed(self._ranked()):
                    if m is member or m.is_busy():
                        continue
                    m.shrink_to(0)
                    used = sum(o.device_bytes() for o in others)
                    if used + mine <= total:
                        break
            return int(max(0, min(mine, total - used)))

    def others_bytes(self, member: BudgetMember) -> int:
        """Device bytes the other members hold now."""
        with self._lock:
            return sum(m.device_bytes() for m in self._members if m is not member)

    def wait_for_room(self, member: BudgetMember, need: int, timeout_s: float = 60.0) -> int:
        """An allowance of at least `need` bytes for `member`, waiting while models running on other threads still
        hold bytes the budget took from them (they give them back at their next safe point).

        The caller holds no device bytes while it waits, so two models never wait on each other. Members running
        on the caller's own thread (a model called inside another's forward) cannot reach a safe point before the
        caller does: then, or after `timeout_s`, the caller gets `need` anyway and the total is exceeded for that
        pass, with one log line, rather than failing the forward.
        """
        deadline = time.monotonic() + timeout_s
        me = threading.get_ident()
        with self._lock:
            while True:
                got = self.allowance(member)
                if got >= need:
                    return got
                blockers = [m for m in self._members if m is not member and m.device_bytes() > 0
                            and m.is_busy() and m.pass_thread() not in (None, me)]
                left = deadline - time.monotonic()
                if not blockers or left <= 0:
                    break
                self._room.wait(min(left, 0.05))  # woken when a member ends a pass; polls as a fallback
            held = self.others_bytes(member)
            log.warning("%s: the VRAM budget (%s bytes) cannot give it %d bytes while other models hold %d bytes "
                        "in passes that have not reached a safe point; running this pass over the budget",
                        member.name, self._total, need, held)
            return need

    def notify_room(self) -> None:
        """A member ended a pass or gave bytes back: waiting members look again."""
        with self._lock:
            self._room.notify_all()


_default_lock = threading.Lock()
_default: VramBudget | None = None
_per_device: dict[str, VramBudget] = {}


def default_budget(device: str | None = None) -> VramBudget:
    """The process-wide budget every model joins unless given another; sized from free VRAM on first use.

    `default_budget()` is the compute device's (whichever device a model computes on); `default_budget(name)` is
    the budget of another device a model keeps resident blocks on (`OffloadConfig(devices=[...])`), one per name.
    """
    global _default
    with _default_lock:
        if device is None:
            if _default is None:
                _default = VramBudget(None)
            return _default
        if not isinstance(device, str):
            raise TypeError(f"device must be a device name such as 'cuda:1' or 'sim:1', got {device!r}")
        budget = _per_device.get(device)
        if budget is None:
            budget = _per_device[device] = VramBudget(None)
        return budget
