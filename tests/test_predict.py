"""offload.predict: the plan and step time of an offloaded model, before anything is staged.

No test bounds a speed: predictions are compared with the engine's own plan (the same planner), with their own
parts (step = compute + stalls), and between two inputs of one model (long sequences compute-bound, short ones
copy-bound); memory is checked by what stays on the meta device and what the process allocates.
"""
from __future__ import annotations

import json
import math

import psutil
import pytest
import torch
import torch.nn as nn

from offload import Card, OffloadConfig, Prediction, VramBudget, offload_module, predict
from offload.backends.sim_clock import SimClock
from offload.predict.cards import CARDS, get_card
from offload.demo.reference_models import FatCheapBlock, MixedCostStack, TransformerStack
from offload.predict import analyse_on_meta, unit_sizes
from offload.model.blocks import find_units

GIB = 1 << 30


def _aligned(m: nn.Module) -> int:
    return sum(((p.numel() * p.element_size() + 511) // 512) * 512 for p in m.parameters())


# ---------------------------------------------------------------------------------------------------- cards
def test_card_table_has_the_common_cards_with_sources():
    for name in ("rtx3060-12gb", "rtx4070-12gb", "rtx4090", "rtx5090", "h100-pcie"):
        card = CARDS[name]
        assert card.vram_bytes >= 12 * GIB and card.h2d_gbps > 0 and card.tflops > 0 and card.mem_gbps > 0
        assert card.source, name
    assert CARDS["rtx4090"].vram_bytes == 24 * GIB and CARDS["rtx5090"].vram_bytes == 32 * GIB
    assert get_card("RTX4090") is CARDS["rtx4090"]
    for alias, name in (("GeForce RTX 3060 12GB", "rtx3060-12gb"), ("rtx4080-16gb", "rtx4080"), ("H100 PCIe", "h100-pcie"),
                        ("RTX 4070", "rtx4070-12gb"), ("rtx 4060 ti 16gb", "rtx4060ti-16gb")):
        assert get_card(alias) is CARDS[name], alias
    with pytest.raises(ValueError, match="known cards"):
        get_card("rtx4090-16gb")  # a memory the card does not have
    with pytest.raises(ValueError, match="rtx3060-12gb"):
        get_card("rtx9999")
    with pytest.raises(ValueError, match="tflops"):
        Card("x", 8 * GIB, 25.0, 0)
    mine = Card("mine", 10 * GIB, 12.0, 40.0)
    assert get_card(mine) is mine and mine.pageable == pytest.approx(6.0)


# --------------------------------------------------------------------------------- the meta device, named card
def _wan14b_like() -> TransformerStack:
    """40 blocks of width 5120 in bf16 (about 25 GiB of blocks), built on the meta device."""
    with torch.device("meta"):
        return TransformerStack(dim=5120, depth=40, heads=40, mlp_ratio=4.0).to(torch.bfloat16)


def test_14b_shaped_model_on_meta_fits_16gb_card_without_allocating():
    model = _wan14b_like()
    rss = psutil.Process().memory_info().rss
    stream = OffloadConfig.from_preset("budget")
    long = predict(model, (torch.empty(1, 32760, 5120, device="meta", dtype=torch.bfloat16),), config=stream,
                   card="rtx4080")
    short = predict(model, (torch.empty(1, 64, 5120, device="meta", dtype=torch.bfloat16),), config=stream,
                    card="rtx4080")
    assert psutil.Process().memory_info().rss - rss < GIB  # 25 GiB of weights were never allocated
    assert all(p.is_meta for p in model.parameters())
    assert isinstance(long, Prediction) and long.fits and short.fits
    assert len(long.blocks) == 40 and all(b.tier != "vram" for b in long.blocks)  # budget: every block streams
    assert long.device_bytes < 16 * GIB and long.host_bytes > 20 * GIB
    assert long.slots == 3 and long.slot_bytes == max(b.bytes for b in long.blocks)
    # compute-bound at 32760 tokens: the copies hide; copy-bound at 64 tokens: the step is the copies
    assert long.slowdown < 1.1 and long.limited_by == "compute"
    assert short.slowdown > 3 and short.limited_by == "copy"
    assert short.step_ms == pytest.approx(short.resident_step_ms + short.stall_ms, rel=1e-9)
    assert all(b.flops and b.flops > 0 for b in long.blocks)
    json.dumps(long.to_dict(), allow_nan=False)


def test_named_card_on_a_real_model_leaves_its_weights_untouched():
    torch.manual_seed(0)
    model = TransformerStack(dim=64, depth=4, heads=2)
    before = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    pred = predict(model, (torch.randn(1, 16, 64),), config=OffloadConfig.from_preset("auto"), card="rtx3060-12gb")
    assert pred.fits and len(pred.blocks) == 4
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n


def test_attention_is_costed_as_a_fused_kernel_on_meta():
    """The meta device's math fallback would build the score matrices (L x L per head); the analysis must not."""
    model = _wan14b_like()
    analysis = analyse_on_meta(model, (torch.empty(1, 75600, 5120, device="meta", dtype=torch.bfloat16),))
    assert analysis.activation_bytes < 16 * GIB  # the 75600^2 scores of 40 heads would be ~450 GB
    attn = [op for op in analysis.units[0] if op[0] == "attn"]
    assert len(attn) == 1 and attn[0][1] == pytest.approx(4 * 75600 ** 2 * 5120)


def test_units_and_sizes_are_the_engines(sim_budget):
    torch.manual_seed(0)
    model = TransformerStack(dim=64, depth=4, heads=2)
    sizes, rest = unit_sizes(model, find_units(model))
    handle = offload_module(model, OffloadConfig.from_preset("budget", device="sim"), budget=sim_budget)
    try:
        assert sizes == list(handle.unit_bytes().values()) and rest == handle.non_block_bytes
    finally:
        handle.detach()


def test_a_card_too_small_for_one_slot_does_not_fit():
    model = _wan14b_like()
    pred = predict(model, (torch.empty(1, 256, 5120, device="meta", dtype=torch.bfloat16),),
                   config=OffloadConfig.from_preset("budget"), card=Card("tiny", GIB, 25.0, 100.0))
    assert not pred.fits and math.isinf(pred.step_ms) and pred.notes
    assert "raise the budget" in " ".join(pred.notes)
    assert pred.to_dict()["step_ms"] is None
    json.dumps(pred.to_dict(), allow_nan=False)


def test_host_ram_limit_sends_blocks_to_disk_or_does_not_fit():
    model = _wan14b_like()
    x = (torch.empty(1, 1024, 5120, device="meta", dtype=torch.bfloat16),)
    with_disk = predict(model, x, config=OffloadConfig.from_preset("budget"), card="rtx4090", ram_bytes=16 * GIB,
                        disk_tier=True)
    assert with_disk.fits and with_disk.disk_bytes > 0 and with_disk.host_bytes <= 16 * GIB
    assert any(b.tier == "disk" for b in with_disk.blocks)
    no_disk = predict(model, x, config=OffloadConfig.from_preset("budget"), card="rtx4090", ram_bytes=16 * GIB)
    assert not no_disk.fits and "ram_budget_bytes" in " ".join(no_disk.notes)


def test_an_offloaded_model_is_refused_until_detached(sim_budget):
    torch.manual_seed(0)
    model = TransformerStack(dim=32, depth=3, heads=2)
    x = torch.randn(1, 8, 32)
    handle = offload_module(model, OffloadConfig.from_preset("budget", device="sim"), budget=sim_budget)
    with pytest.raises(ValueError, match="offloaded already"):
        predict(model, (x,), card="rtx4090")
    handle.detach()
    assert predict(model, (x,), card="rtx4090").fits


def test_measure_refuses_a_meta_model_with_a_clear_message():
    model = _wan14b_like()
    with pytest.raises(ValueError, match="name a card"):
        predict(model, (torch.empty(1, 8, 5120, device="meta", dtype=torch.bfloat16),), card="measure")


# ---------------------------------------------------------------------------- measured on the simulated device
def test_measure_on_sim_plans_as_the_engine_does(sim_budget):
    """Stream-all and all-resident are plans whatever the timings: the prediction must say the same as the engine."""
    torch.manual_seed(0)
    model = TransformerStack(dim=64, depth=6, heads=2).eval()
    x = torch.randn(1, 32, 64)
    for preset, resident in (("budget", 0), ("high_end", 6)):
        cfg = OffloadConfig.from_preset(preset, device="sim", sim_bandwidth_gbps=2.0)
        pred = predict(model, (x,), config=cfg, runs=2, warmup=1)
        assert sum(b.tier == "vram" for b in pred.blocks) == resident, preset
        handle = offload_module(model, cfg, budget=sim_budget)
        try:
            with torch.inference_mode():
                model(x)
            rep = handle.report()
            assert [b.tier == "vram" for b in rep.blocks] == [b.tier == "vram" for b in pred.blocks], preset
            assert pred.device_bytes == handle.streamer.device_bytes(), preset
        finally:
            handle.detach()
        assert pred.card["measured"] is True and pred.card["nominal_h2d_gbps"] == pytest.approx(2.0)
        assert 0 < pred.card["h2d_gbps"] <= 2.0  # what copies reach beside the compute
        assert pred.resident_step_ms > 0
        # blocks' compute and stalls, plus the compute outside them and the engine's hook time on the CPU
        assert pred.step_ms >= sum(b.compute_ms for b in pred.blocks) + pred.stall_ms


def test_fat_cheap_blocks_are_kept_resident_in_the_prediction():
    """Four fat blocks (copies that cannot hide) and four lean ones, a budget for the fat ones and three lean slots
    (benchmarks/bench_placement.py): the plan from costs timed on the simulated device (on its own clock, so the
    costs are the ones given) keeps the fat blocks resident, and says why."""
    torch.manual_seed(0)
    model = MixedCostStack("FFFFLLLL", repeats=2).eval()
    fat = [b for b in model.blocks if isinstance(b, FatCheapBlock)]
    lean = [b for b in model.blocks if not isinstance(b, FatCheapBlock)]
    budget = sum(_aligned(b) for b in fat) + 3 * _aligned(lean[0]) + 4096
    clock = SimClock()
    clock.charge(fat, 0.05)  # 4 MiB each: a 4.2 ms copy at 1 GB/s
    clock.charge(lean, 3.0)
    cfg = OffloadConfig(device="sim", prefetch=2, sim_bandwidth_gbps=1.0, sim_capacity_bytes=(96 << 20) + 17,
                        sim_clock=clock)
    pred = predict(model, (torch.randn(256, 64),), config=cfg, budget=VramBudget(budget), runs=2, warmup=1)
    assert "".join("R" if b.tier == "vram" else "s" for b in pred.blocks) == "RRRRssss"
    assert all(b.stall_ms == 0 for b in pred.blocks) and pred.blocks[0].placement.startswith("resident")
    assert [b.compute_ms for b in pred.blocks] == pytest.approx([0.05] * 4 + [3.0] * 4)
    assert pred.step_ms == pytest.approx(4 * 0.05 + 4 * 3.0)
    assert pred.device_bytes <= budget


def test_prediction_to_dict_is_strict_json():
    torch.manual_seed(0)
    model = TransformerStack(dim=32, depth=3, heads=2)
    pred = predict(model, (torch.randn(1, 8, 32),), config=OffloadConfig.from_preset("budget", device="sim"),
                   runs=1, warmup=1)
    d = json.loads(json.dumps(pred.to_dict(), allow_nan=False))
    assert set(d) >= {"step_ms", "resident_step_ms", "device_bytes", "host_bytes", "disk_bytes", "fits", "blocks",
                      "slowdown", "limited_by", "limiting_block"}
    assert set(d["blocks"][0]) >= {"name", "tier", "copy_ms", "compute_ms", "stall_ms", "limited_by"}
    assert d["limiting_block"] in [b["name"] for b in d["blocks"]]
