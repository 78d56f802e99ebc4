"""Who leads each priority of a VRAM budget: pass starts, runs and changes of lead on one clock.

The bookkeeping behind rules 2 and 3 of `budget.py` (recency among equal priorities, with hysteresis): which member
started a pass when, how long its runs are, which one took the lead of its priority last, and which idle members
that lead parks. `VramBudget` holds one `Recency` under its lock and asks it for the ranking its shares follow;
the shares themselves (floors, wants, watermarks) stay in the budget.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable

PHASE_PASSES = 2  # passes in a row that make a phase: a model working in one leads its priority (budget.py's rule)


class Recency:
    """Per member (by id): registration, pass starts, runs and leads, on one clock (callers hold the budget's lock)."""

    def __init__(self) -> None:
        self._tick = itertools.count(1)  # one clock for registrations, pass starts and changes of lead
        self.order: dict[int, int] = {}  # id(member) -> registration tick (the tie-break, as before recency)
        self._touched: dict[int, int] = {}  # tick of the member's last pass start (its registration before that)
        self._led: dict[int, int] = {}  # tick at which the member last took the lead of its priority (0: never)
        self._run: dict[int, int] = {}  # passes of the member's current (or last) run
        self._prev_run: dict[int, int] = {}  # passes of its previous completed run (absent: it never ran)
        self._running: dict[int, int] = {}  # priority -> id of the member whose run goes on
        self._ran: set[int] = set()  # members that started a pass at least once
        self._released: set[int] = set()  # never ran, but a lead ran alone long enough to park them (see parked)
        self._last_touch: int | None = None  # the member that started the latest pass (any priority)
        self._alone: dict[int, int] = {}  # passes in a row a member started with no other member's pass between
        self._asked: set[int] = set()  # members whose lead was asked for (explicit), not earned by a phase

    def joined(self, key: int) -> None:
        """A member registered: it ranks after the ones before it until it runs."""
        tick = next(self._tick)
        self.order[key] = tick
        self._touched[key] = tick

    def drop(self, key: int) -> None:
        """A member left: forget all of it."""
        for d in (self.order, self._touched, self._led, self._run, self._prev_run, self._alone):
            d.pop(key, None)
        for s in (self._ran, self._released, self._asked):
            s.discard(key)
        if self._last_touch == key:
            self._last_touch = None
        for prio in [p for p, k in self._running.items() if k == key]:
            del self._running[prio]

    def start_pass(self, member: Any, members: list[Any], explicit: bool) -> tuple[bool, Any]:
        """`member` starts a pass (or, `explicit`, is about to work for a node): count its run and let it take the
        lead of its priority when it works in a phase. Returns (whether it took the lead now, the lead before)."""
        key = id(member)
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
        lead = self.leader(members, prio)
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
            self._released.update(id(m) for m in members if m.priority == prio and id(m) not in self._ran)
        return takes, lead

    def follow(self, key: int, follower: int) -> None:
        """`follower` (a KV pager, a share on another device) started with `key`: ranked with it, after it."""
        self._touched[follower] = self._touched[key]
        self._led[follower] = self._led.get(key, 0)

    def last_pass(self, key: int) -> int:
        """When the member last started a pass, on the clock (higher is more recent; 0 if it never ran)."""
        return self._touched.get(key, 0) if key in self._ran else 0

    def leader(self, members: Iterable[Any], priority: int) -> Any:
        """The member of `priority` that took the lead last (None while none of them ever ran)."""
        best, best_tick = None, 0
        for m in members:
            tick = self._led.get(id(m), 0)
            if m.priority == priority and tick > best_tick:
                best, best_tick = m, tick
        return best

    def ranked(self, members: list[Any], lead: Any = None) -> list[Any]:
        """Priority first, then the latest to take the lead (`lead`: as if it took it now), then registration."""
        def key(m: Any) -> tuple[int, float, int]:
            led = math.inf if m is lead else self._led.get(id(m), 0)
            return (-m.priority, -led, self.order.get(id(m), 0))
        return sorted(members, key=key)

    def parked(self, members: list[Any], lead: Any = None) -> set[int]:
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
