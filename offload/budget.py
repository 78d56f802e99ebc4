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

import itertools
import logging
import math
import threading
import time
import weakref
from typing import Protocol

from .config import check_bytes

log = logging.getLogger(__name__)

PHASE_PASSES = 2  # passes in a row that make a phase: a model working in one leads its priority (see the rule above)


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
        self._tick = itertools.count(1)  # one clock for registrations, pass starts and changes of lead
        self._order: dict[int, int] = {}  # id(member) -> registration tick (the tie-break, as before recency)
        self._caps: dict[int, int] = {}  # watermarks: id(member) -> max bytes until prioritize()
        self._last_best: dict[int, int] = {}  # the most each member could hold as its priority's lead (watermark)
        self._touched: dict[int, int] = {}  # tick of the member's last pass start (its registration before that)
        self._led: dict[int, int] = {}  # tick at which the member last took the lead of its priority (0: never)
        self._run: dict[int, int] = {}  # passes of the member's current (or last) run
        self._prev_run: dict[int, int] = {}  # passes of its previous completed run (absent: it never ran)
        self._running: dict[int, int] = {}  # priority -> id of the member whose run goes on
        self._ran: set[int] = set()  # members that started a pass at least once
        self._released: set[int] = set()  # never ran, but a lead ran alone long enough to park them (see _parked)
        self._last_touch: int | None = None  # the member that started the latest pass (any priority)
        self._alone: dict[int, int] = {}  # passes in a row a member started with no other member's pass between
        self._asked: set[int] = set()  # members whose lead was asked for (explicit), not earned by a phase

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
            tick = next(self._tick)
            self._order[id(member)] = tick
            self._touched[id(member)] = tick
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
            for key in [k for k in self._order if k not in live]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        for d in (self._order, self._caps, self._last_best, self._touched, self._led, self._run, self._prev_run):
            d.pop(key, None)
        self._ran.discard(key)
        self._released.discard(key)
        self._asked.discard(key)
        self._alone.pop(key, None)
        if self._last_touch == key:
            self._last_touch = None
        for prio in [p for p, k in self._running.items() if k == key]:
            del self._running[prio]

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
            if key not in self._order:
                return False
            tick = next(self._tick)
            prio = member.priority
            current = self._running.get(prio)
            if current == key:
                self._run[key] = self._run.get(key, 0) + 1
            else:
                if current is not None:
                    self._prev_run[current] = self._run.get(current, 0)
                self._running[prio] = key
                self._run[key] = 1
            previous = self._prev_run.get(key)
            phase = explicit or previous is None or previous >= PHASE_PASSES or self._run[key] >= PHASE_PASSES
            lead = self._leader(prio)
            # never from a lead in a pass (a model called inside its forward, or running on another thread): it works
            # now too and could not give its bytes back before its next safe point
            takes = phase and lead is not member and (lead is None or not lead.is_busy())
            self._touched[key] = tick
            self._ran.add(key)
            self._alone[key] = self._alone.get(key, 0) + 1 if self._last_touch == key else 1
            self._last_touch = key
            if takes:
                self._led[key] = tick
                (self._asked.add if explicit else self._asked.discard)(key)
            if (takes or lead is member) and self._alone[key] >= PHASE_PASSES:
                # it ran alone for a phase: no model is called inside its forward, so the ones of its priority that
                # never ran may be parked (once released they stay so: a flag that flipped back would move bytes)
                self._released.update(id(m) for m in self._members
                                      if m.priority == prio and id(m) not in self._ran)
            for f in followers:  # ranked with it (after it: registered later), never parked while it works
                if f is not None and getattr(f, "budget", self) is self and id(f) in self._order:
                    self._touched[id(f)] = tick
                    self._led[id(f)] = self._led.get(key, 0)
            if takes:
                log.debug("%s leads priority %d in the VRAM budget now (%s)", member.name, prio,
                          "asked" if explicit else "its phase")
        for f in followers:
            other = getattr(f, "budget", self) if f is not None else self
            if f is not None and other is not self:
                other.touch(f, explicit=explicit)
        return takes or lead is member

    def recency(self, member: BudgetMember) -> int:
        """When `member` last started a pass, on the budget's clock (higher is more recent; 0 for a stranger)."""
        with self._lock:
            return self._touched.get(id(member), 0) if id(member) in self._ran else 0

    def _leader(self, priority: int) -> BudgetMember | None:
        """The member of `priority` that took the lead last (None while none of them ever ran)."""
        best, best_tick = None, 0
        for m in self._members:
            tick = self._led.get(id(m), 0)
            if m.priority == priority and tick > best_tick:
                best, best_tick = m, tick
        return best

    # policy ---------------------------------------------------------------------
    def _ranked(self, lead: BudgetMember | None = None) -> list[BudgetMember]:
        """Priority first, then the latest to take the lead (`lead`: as if it took it now), then registration."""
        def key(m: BudgetMember) -> tuple[int, float, int]:
            led = math.inf if m is lead else self._led.get(id(m), 0)
            return (-m.priority, -led, self._order.get(id(m), 0))
        return sorted(self._members, key=key)

    def _parked(self, members: list[BudgetMember], lead: BudgetMember | None = None) -> set[int]:
        """Members another of their priority took the lead from since they last ran: their floor is not kept for
        them while they are idle (they take it back at their next pass). A member that never ran is parked only by a
        lead that was asked for (ComfyUI loading a model for a node), or once the lead ran `PHASE_PASSES` passes with
        no other model's pass between them: a lead found by its first pass may be running a model it calls inside its
        own forward. With `lead`, every other member of its priority is parked."""
        newest: dict[int, tuple[float, int]] = {}
        for m in members:
            led = math.inf if m is lead else self._led.get(id(m), 0)
            if led > newest.get(m.priority, (0, 0))[0]:  # the latest lead (its followers tie with it, after it)
                newest[m.priority] = (led, id(m))
        parked = set()
        for m in members:
            led, by = newest.get(m.priority, (0, 0))
            if m is lead or by in (0, id(m)) or led <= self._touched.get(id(m), 0):
                continue
            if id(m) in self._ran or id(m) in self._released or lead is not None or by in self._asked:
                parked.add(id(m))
        return parked

    def _shares(self, lead: BudgetMember | None = None, uncapped: BudgetMember | None = None) -> dict[int, int]:
        """Bytes each member may hold (by id): floors first (not for parked idle members), then the rest in ranked
        order up to each one's want (capped by its watermark). `lead`: as if it led its priority now and every other
        member of that priority were idle; `uncapped`: a member whose own watermark is left out."""
        total = self._total if self._total is not None else sum(m.want_bytes() for m in self._members)
        remaining = total
        t: dict[int, int] = {}
        ranked = self._ranked(lead)
        parked = self._parked(ranked, lead)
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
            lead = self._leader(member.priority)
            if peers:
                if lead is member:
                    parts.append(f"it leads priority {member.priority} (the latest of {len(peers) + 1} models there to "
                                 f"work in a phase): idle ones of that priority give it their bytes")
                elif id(member) in self._parked(self._members):
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
