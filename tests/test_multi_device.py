"""One model across several devices (issue 21), on simulated devices sim:0 and sim:1: blocks resident on the
second device run there, streamed ones come from host RAM to the compute device, each device has its own budget."""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from offload import OffloadConfig, VramBudget, default_budget, offload_module
from offload.backends import get_backend
from tests.models import LayersModel, aligned_bytes, run, seeded

DIM, DEPTH = 128, 12
_caps = itertools.count(1)


def _cfg(**kw):
    """Two simulated devices with a capacity no other test uses (their accounting is ours alone)."""
    kw.setdefault("sim_capacity_bytes", (256 << 20) + 4096 * next(_caps) + 7)
    return OffloadConfig(device="sim:0", devices=["sim:0", "sim:1"], **kw)


def _model(seed=0):
    return seeded(LayersModel, dim=DIM, depth=DEPTH, seed=seed)


def _sizes():
    m = _model()
    blk = aligned_bytes(m.layers[0])
    return blk, aligned_bytes(m) - DEPTH * blk


def _x():
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(11))


def test_a_model_larger_than_either_device_runs_resident_across_both():
    blk, rest = _sizes()
    model, x = _model(), _x()
    ref = run(model, (x,))
    single = _model()
    offload_module(single, OffloadConfig(device="sim", vram_budget_bytes=rest + 3 * blk))  # streams
    single_out = run(single, (x,))
    b0, b1 = VramBudget(rest + 7 * blk), VramBudget(6 * blk)  # neither holds the model; both together do
    cfg = _cfg()
    h = offload_module(model, cfg, budget={"sim:0": b0, "sim:1": b1})
    for _ in range(3):
        out = run(model, (x,))
        assert torch.equal(out, ref) and torch.equal(out, single_out)
    rep = h.report()
    assert all(b.tier == "vram" for b in rep.blocks), [b.tier for b in rep.blocks]
    assert {b.device for b in rep.blocks} == {"sim:0", "sim:1"}
    assert rep.total_bytes_streamed == 0, "no block streamed from host"
    devs = rep.to_dict()["devices"]
    assert devs["sim:0"]["peak_device_bytes"] <= b0.total_bytes
    assert devs["sim:1"]["peak_device_bytes"] <= b1.total_bytes
    assert devs["sim:0"]["resident_blocks"] + devs["sim:1"]["resident_blocks"] == DEPTH
    assert devs["sim:1"]["activation_bytes"] > 0, "activations hop to the second device and back"
    for name in ("sim:0", "sim:1"):  # each device's own accounting
        assert get_backend(cfg, name).peak_bytes <= (b0 if name == "sim:0" else b1).total_bytes
    h.detach()
    assert get_backend(cfg, "sim:0").used_bytes == 0 and get_backend(cfg, "sim:1").used_bytes == 0
    assert torch.equal(run(model, (x,)), ref)


def test_blocks_too_large_for_both_stream_and_the_rest_stay_resident():
    blk, rest = _sizes()
    model, x = _model(), _x()
    ref = run(model, (x,))
    b0, b1 = VramBudget(rest + 7 * blk), VramBudget(2 * blk)  # room for 4 resident + a 3-slot ring, and 2 more
    h = offload_module(model, _cfg(), budget={"sim:0": b0, "sim:1": b1})
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    tiers = [b.tier for b in rep.blocks]
    on1 = [b for b in rep.blocks if b.device == "sim:1"]
    assert len(on1) == 2 and all(b.tier == "vram" for b in on1)
    # 4 resident beside a 3-slot ring (or more, once measured costs trade lookahead for residency) and 2 on sim:1
    assert 6 <= tiers.count("vram") < DEPTH
    assert tiers.count("vram") + tiers.count("pageable") + tiers.count("pinned") == DEPTH
    assert rep.total_bytes_streamed > 0
    assert all(b.device == "sim:0" for b in rep.blocks if b.tier != "vram"), "streamed blocks compute on sim:0"
    devs = rep.devices
    assert devs["sim:0"]["peak_device_bytes"] <= b0.total_bytes and devs["sim:1"]["peak_device_bytes"] <= 2 * blk


def test_lowering_the_second_budget_replans_at_the_next_forward_without_a_failed_forward():
    blk, rest = _sizes()
    model, x = _model(), _x()
    ref = run(model, (x,))
    b0, b1 = VramBudget(rest + 7 * blk), VramBudget(6 * blk)
    h = offload_module(model, _cfg(), budget={"sim:0": b0, "sim:1": b1})
    assert torch.equal(run(model, (x,)), ref)
    assert h.report().devices["sim:1"]["resident_blocks"] == 5
    failures: list[str] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                with torch.no_grad():
                    if not torch.equal(model(x), ref):
                        failures.append("wrong output")
            except Exception as exc:  # noqa: BLE001 - counted
                failures.append(repr(exc))

    t = threading.Thread(target=loop)
    t.start()
    try:
        b1.set_total(2 * blk)
        for _ in range(3):
            assert torch.equal(run(model, (x,)), ref)
        b1.set_total(0)  # the device leaves
        for _ in range(3):
            assert torch.equal(run(model, (x,)), ref)
    finally:
        stop.set()
        t.join()
    assert failures == []
    rep = h.report()
    assert rep.devices["sim:1"]["resident_blocks"] == 0 and rep.devices["sim:1"]["device_bytes"] == 0
    b1.set_total(6 * blk)  # it comes back
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref)
    assert h.report().devices["sim:1"]["resident_blocks"] > 0


def test_priorities_hold_on_the_second_device():
    blk, rest = _sizes()
    x = _x()
    lo, hi = _model(0), _model(1)
    rlo, rhi = run(lo, (x,)), run(hi, (x,))
    cfg = _cfg()
    shared1 = VramBudget(8 * blk)
    hl = offload_module(lo, cfg, name="lo", priority=0,
                        budget={"sim:0": VramBudget(rest + 3 * blk), "sim:1": shared1})
    hh = offload_module(hi, cfg, name="hi", priority=5,
                        budget={"sim:0": VramBudget(rest + 3 * blk), "sim:1": shared1})
    for _ in range(2):
        assert torch.equal(run(lo, (x,)), rlo)
        assert torch.equal(run(hi, (x,)), rhi)
    on1 = {h.name: h.report().devices["sim:1"]["resident_blocks"] for h in (hl, hh)}
    assert on1["hi"] >= on1["lo"] and on1["hi"] > 0, on1
    assert hl.remote_bytes("sim:1") + hh.remote_bytes("sim:1") <= shared1.total_bytes


def test_device_api_errors_and_per_device_default_budgets():
    with pytest.raises(ValueError, match="start with the compute device"):
        OffloadConfig(device="sim:0", devices=["sim:1", "sim:0"])
    with pytest.raises(ValueError, match="twice"):
        OffloadConfig(device="sim:0", devices=["sim:0", "sim:0"])
    with pytest.raises(ValueError, match="mixes"):
        OffloadConfig(device="sim:0", devices=["sim:0", "cuda:1"])
    assert OffloadConfig(devices=["sim:0", "sim:1"]).device == "sim:0"  # 'auto' takes the first
    with pytest.raises(ValueError, match="not one of this model's devices"):
        offload_module(_model(), _cfg(), budget={"sim:7": VramBudget(1 << 20)})
    assert default_budget("sim:1") is default_budget("sim:1")
    assert default_budget("sim:1") is not default_budget("sim:2")
    assert default_budget("sim:1") is not default_budget()


def test_deepcopy_of_a_model_on_two_devices_leaves_the_activation_hops_out():
    """A deepcopy of a model whose blocks live on sim:0 and sim:1 is an ordinary model: no engine hook, the
    activation hops to the second device included (the handle keeps them with its secondary devices)."""
    import copy

    blk, rest = _sizes()
    model, x = _model(), _x()
    ref = run(model, (x,))
    h = offload_module(model, _cfg(), budget={"sim:0": VramBudget(rest + 7 * blk), "sim:1": VramBudget(6 * blk)})
    assert torch.equal(run(model, (x,)), ref)
    assert h.report().to_dict()["devices"]["sim:1"]["activation_bytes"] > 0
    twin = copy.deepcopy(model)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in twin.modules()), "an engine hook was copied"
    assert torch.equal(run(twin, (x,)), ref)
    assert torch.equal(run(model, (x,)), ref)
    h.detach()
