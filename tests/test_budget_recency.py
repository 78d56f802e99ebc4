"""Priority first, then recency (issue 26): among models of equal priority the one that works now leads the budget.

Models used in phases (a text encoder, then the diffusion model, then the VAE; Wan 2.2's high-noise then low-noise
expert) each hold their blocks resident while they work; two models alternating every forward keep the split they
have (hysteresis) instead of copying resident sets back and forth; a higher priority still always wins. Models and
helpers are those of tests/test_budget.py (LayersModel, dim 64, 6 blocks), so the figures compare with its tests.
"""
from __future__ import annotations

import pytest
import torch

from offload import OffloadConfig, VramBudget, offload_module
from offload.budget import PHASE_PASSES
from tests.models import LayersModel, resident_modules, run, seeded
from tests.test_budget import BLK, DEPTH, FLOOR, FULL, REST, Fleet, _x

BLOCK_BYTES = DEPTH * BLK


@pytest.fixture
def fleet_factory():
    made = []

    def make(*a, **kw):
        f = Fleet(*a, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def _phase(f: Fleet, name: str, passes: int) -> tuple[int, list[int]]:
    """Run `passes` forwards of one model (outputs checked bitwise by Fleet.fwd): (bytes it streamed, the number of
    its blocks resident at the start of each pass)."""
    h = f.handles[name]
    h.reset_stats()
    at_start: list[int] = []
    hook = f.models[name].layers[0].register_forward_pre_hook(
        lambda m, a: at_start.append(len(resident_modules(h))))
    try:
        for _ in range(passes):
            f.fwd(name)
    finally:
        hook.remove()
    return h.report().total_bytes_streamed, at_start


@pytest.mark.parametrize("total, asked", [(FULL + FLOOR, False), (FULL, True)],
                         ids=["one-plus-a-floor", "exactly-one-asked"])
def test_equal_priority_models_in_phases_each_hold_their_blocks_while_they_work(fleet_factory, total, asked):
    """A, B, A, B: the model that works holds every block resident from the first pass of its phase and streams
    nothing, in every phase, though the budget fits one model; before recency, B streamed 100% in all its phases.
    With room for exactly one model the idle one's floor goes too: in every phase once both ran, and from the first
    phase when the lead is asked for (`mark_active`, as ComfyUI's loading does)."""
    budget = VramBudget(total)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    b = f.add("b", priority=0)
    f.watch()
    for phase, name in enumerate(["a", "b", "a", "b", "a"]):
        if asked:
            f.handles[name].mark_active()
        streamed, at_start = _phase(f, name, 3)
        assert at_start == [DEPTH] * 3, f"phase {phase} ({name}): resident blocks at each pass start {at_start}"
        assert streamed == 0, f"phase {phase} ({name}) streamed {streamed} of {BLOCK_BYTES} block bytes"
        other = b if name == "a" else a
        assert other.device_bytes() + f.handles[name].device_bytes() <= total
    assert not f.violations, f.violations


def test_higher_priority_keeps_its_blocks_while_the_lower_one_works(fleet_factory):
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    high = f.add("high", priority=1)
    f.add("low", priority=0)
    f.watch()
    _phase(f, "high", 2)
    for _ in range(2):
        ids = frozenset(map(id, resident_modules(high)))
        streamed, at_start = _phase(f, "low", 3)
        assert len(ids) == DEPTH and frozenset(map(id, resident_modules(high))) == ids, \
            "the higher-priority model lost blocks to a lower one that works"
        assert streamed == 3 * BLOCK_BYTES and at_start == [0, 0, 0], "the lower one streams every block"
        streamed, _ = _phase(f, "high", 2)
        assert streamed == 0
    assert "priority 1 comes first" in f.handles["low"].report().budget_reason
    assert not f.violations, f.violations


def test_models_alternating_every_forward_keep_their_split(fleet_factory):
    """Hysteresis: after the first round the resident sets never move, and each round streams no more than one
    model's blocks (the split before recency: one model resident, the other streaming)."""
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    b = f.add("b", priority=0)
    f.watch()
    rounds = []
    for _ in range(6):
        for h in (a, b):
            h.reset_stats()
        f.fwd("a")
        f.fwd("b")
        streamed = a.report().total_bytes_streamed + b.report().total_bytes_streamed
        rounds.append((frozenset(map(id, resident_modules(a))), frozenset(map(id, resident_modules(b))), streamed))
    assert len(set(rounds[1:])) == 1, f"resident sets or bytes moved changed between rounds: {[r[2] for r in rounds]}"
    assert rounds[-1][2] <= BLOCK_BYTES, f"a round streams {rounds[-1][2]} bytes, more than one model's blocks"
    assert len(rounds[-1][0]) + len(rounds[-1][1]) >= DEPTH, "together they keep at least one model's blocks"
    assert not f.violations, f.violations


def test_a_phase_after_alternating_takes_the_lead_at_its_second_pass(fleet_factory):
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    f.add("a", priority=0)
    f.add("b", priority=0)
    for _ in range(3):
        f.fwd("a")
        f.fwd("b")
    follower = "a" if f.resident("a") < f.resident("b") else "b"
    assert f.resident(follower) < DEPTH
    _, at_start = _phase(f, follower, 4)
    assert at_start[0] < DEPTH, "one pass in between is alternating, not a phase"
    assert at_start[PHASE_PASSES - 1:] == [DEPTH] * (4 - PHASE_PASSES + 1), at_start
    assert not f.violations, f.violations


def test_mark_active_gives_the_lead_at_once(fleet_factory):
    """ComfyUI loading a model for a node (load_models_gpu -> the pack's patcher) calls mark_active: the model leads
    from its first pass even while the two alternate."""
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    f.add("a", priority=0)
    f.add("b", priority=0)
    for _ in range(3):
        f.fwd("a")
        f.fwd("b")
    follower = "a" if f.resident("a") < f.resident("b") else "b"
    f.handles[follower].mark_active()
    f.handles[follower].load()
    assert f.resident(follower) == DEPTH
    streamed, _ = _phase(f, follower, 1)
    assert streamed == 0
    assert "leads priority 0" in f.handles[follower].report().budget_reason
    other = "b" if follower == "a" else "a"
    assert "idle since" in f.handles[other].report().budget_reason
    assert not f.violations, f.violations


def test_three_models_the_least_recently_used_gives_first(fleet_factory):
    """Room for one model and half of another: while C works, the bytes left go to B (used after A), not A."""
    budget = VramBudget(2 * FULL - 2 * BLK)
    f = fleet_factory(budget)
    for name in "abc":
        f.add(name, priority=0)
    f.watch()
    for name in "abc":
        _phase(f, name, 2)
    assert f.resident("c") == DEPTH
    assert f.handles["b"].device_bytes() > f.handles["a"].device_bytes(), (
        f.handles["a"].device_bytes(), f.handles["b"].device_bytes())
    assert f.handles["a"].device_bytes() == 0, "the least recently used gives everything first"
    assert not f.violations, f.violations


def test_watermark_still_holds_against_a_higher_priority(fleet_factory):
    """A model that lost bytes to a higher-priority one does not win them back when that one steps down; taking the
    lead of its own priority back from another model does not lift it (only prioritize() does)."""
    budget = VramBudget(FULL + FLOOR + 2 * BLK)
    f = fleet_factory(budget)
    a = f.add("a", priority=0)
    _phase(f, "a", 2)
    assert f.resident("a") == DEPTH
    b = f.add("b", priority=1)
    f.fwd("b")
    _phase(f, "a", 2)
    lost = f.resident("a")
    assert lost < DEPTH
    b.set_priority(-1)
    f.add("a2", priority=0)
    _phase(f, "a2", 2)
    _phase(f, "a", 3)
    assert f.resident("a") == lost, "the watermark must keep the units a lost to a higher priority streaming"
    assert "watermark" in a.report().budget_reason
    a.prioritize()
    _phase(f, "a", 1)
    assert f.resident("a") == DEPTH
    assert not f.violations, f.violations


def test_explain_share_names_the_rule():
    budget = VramBudget(FULL + FLOOR)
    a = seeded(LayersModel, dim=64, depth=DEPTH, seed=0)
    b = seeded(LayersModel, dim=64, depth=DEPTH, seed=1)
    ha = offload_module(a, OffloadConfig(device="sim", prefetch=1), name="a", budget=budget)
    hb = offload_module(b, OffloadConfig(device="sim", prefetch=1), name="b", budget=budget)
    try:
        run(a, (_x(),))
        assert "served after a (same priority 0" in budget.explain_share(hb), budget.explain_share(hb)
        for _ in range(2):
            run(b, (_x(),))
        text = budget.explain_share(hb)
        assert text.startswith("b: share") and "leads priority 0" in text, text
        assert "idle since b" in budget.explain_share(ha), budget.explain_share(ha)
        assert hb.report().budget_reason == budget.explain_share(hb)
        assert hb.report().to_dict()["budget_reason"] == hb.report().budget_reason
    finally:
        ha.detach()
        hb.detach()
    assert "not in this VRAM budget" in budget.explain_share(ha)


def test_exactly_one_model_of_room_without_asking_holds_every_block_from_the_second_pass(fleet_factory):
    """Room for exactly one model, leads found by phases only: the first pass keeps the floor of the model that never
    ran (it could be called inside the first one's forward); once the lead ran a phase alone, every pass holds every
    block, in every phase."""
    f = fleet_factory(VramBudget(FULL))
    f.add("a", priority=0)
    f.add("b", priority=0)
    f.watch()
    _, first = _phase(f, "a", 3)
    assert 0 < first[0] < DEPTH and first[1:] == [DEPTH, DEPTH], first
    for name in ["b", "a", "b"]:
        streamed, at_start = _phase(f, name, 3)
        assert at_start == [DEPTH] * 3 and streamed == 0, (name, at_start, streamed)
    assert not f.violations, f.violations


def test_a_model_called_inside_another_keeps_its_floor(fleet_factory):
    """An inner model run inside the outer one's forward, every pass: the outer never runs alone, so the inner's
    floor stays reserved and the budget holds inside the nested call too (tests/test_engine_memory.py's nested case
    with equal priorities and room for one model)."""
    budget = VramBudget(FULL + FLOOR)
    f = fleet_factory(budget)
    f.add("outer", priority=0)
    f.add("inner", priority=0)
    f.watch()
    inner = f.models["inner"]
    calls = []
    hook = f.models["outer"].layers[3].register_forward_pre_hook(lambda m, a: calls.append(run(inner, (_x(),))))
    try:
        for _ in range(4):
            run(f.models["outer"], (_x(),))
    finally:
        hook.remove()
    assert len(calls) == 4
    assert not f.violations, f.violations


def test_kv_pager_and_a_model_that_leads_keep_the_pager_floor():
    """A model's KV pager starts each pass with it (a follower): it is never parked while its model works, so its
    floor stays reserved beside the lead's share."""

    class Pager:  # the budget member protocol, as offload/generate/kv_cache.py's KVPager implements it
        name, priority = "kv", 0

        def __init__(self, budget):
            self.budget = budget
            budget.register(self)

        def floor_bytes(self):
            return 4 * BLK

        def want_bytes(self):
            return 4 * BLK

        def device_bytes(self):
            return 0

        def is_busy(self):
            return False

        def shrink_to(self, n):
            return 0

        def device_total(self):
            return None

        def pass_thread(self):
            return None

    budget = VramBudget(2 * FULL)
    a = seeded(LayersModel, dim=64, depth=DEPTH, seed=0)
    b = seeded(LayersModel, dim=64, depth=DEPTH, seed=1)
    ha = offload_module(a, OffloadConfig(device="sim", prefetch=1), name="a", budget=budget)
    hb = offload_module(b, OffloadConfig(device="sim", prefetch=1), name="b", budget=budget)
    try:
        pager = Pager(budget)
        budget.touch(hb)
        budget.touch(ha, pager)
        t = budget.targets()
        assert t[id(pager)] == 4 * BLK, "the pager's floor was given to another model"
        assert t[id(ha)] == FULL
        ranked = [m.name for m in budget._ranked()]
        assert ranked.index("a") < ranked.index("kv") < ranked.index("b"), ranked
    finally:
        ha.detach()
        hb.detach()


def test_touch_of_a_stranger_is_ignored():
    budget = VramBudget(FULL)
    model = seeded(LayersModel, dim=64, depth=DEPTH, seed=0)
    h = offload_module(model, OffloadConfig(device="sim"), name="m", budget=VramBudget(FULL))
    try:
        assert budget.touch(h) is False
        assert budget.targets() == {}
    finally:
        h.detach()
    assert torch.equal(run(model, (_x(),)), run(seeded(LayersModel, dim=64, depth=DEPTH, seed=0), (_x(),)))
    assert REST > 0
