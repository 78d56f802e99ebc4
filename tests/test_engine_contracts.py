"""What the engine promises every caller (issue 18): a RAM ceiling that holds, argument errors that name the
argument, a file that does not match the model refused up front, one log line per event."""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from offload import CorruptFileError, OffloadConfig, offload_module
from offload import RamCeilingError
from tests.models import LayersModel, aligned_bytes, run, seeded

DIM, DEPTH = 256, 12
MIB = 1 << 20


def _model(seed=0):
    return seeded(LayersModel, dim=DIM, depth=DEPTH, seed=seed)


def _x():
    return torch.randn(3, DIM, generator=torch.Generator().manual_seed(7))


def _save(model, path, dtype=None):
    save_file({k: (v.to(dtype) if dtype else v).detach().contiguous() for k, v in model.state_dict().items()},
              str(path))
    return str(path)


def _sizes():
    m = _model()
    blk = aligned_bytes(m.layers[0])
    return blk, aligned_bytes(m) - DEPTH * blk


@pytest.mark.parametrize("fraction", [0.6, 0.4, 0.15])
@pytest.mark.parametrize("preset", ["budget", "consumer"])
def test_ram_budget_is_a_ceiling_bounce_buffers_included(tmp_path, fraction, preset):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    ceiling = int(fraction * aligned_bytes(model))
    h = offload_module(model, OffloadConfig.from_preset(preset, device="sim", disk_path=path,
                                                        ram_budget_bytes=ceiling))
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    mem = h.host_memory()
    assert mem["ram"] <= ceiling, f"{mem['ram']} bytes of host RAM under a {ceiling}-byte ceiling"
    assert mem["disk"] > 0
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_ram_budget_below_the_least_the_plan_needs_names_that_least(tmp_path):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    blk, rest = _sizes()
    with pytest.raises(ValueError, match=r"ram_budget_bytes=1000 is below the (\d+) bytes") as info:
        offload_module(model, OffloadConfig(device="sim", disk_path=path, ram_budget_bytes=1000))
    msg = str(info.value)
    least = int(msg.split("is below the ")[1].split(" bytes")[0])
    assert rest < least < rest + blk, msg
    assert torch.equal(run(model, (x,)), ref), "a refused model is left as it was"
    h = offload_module(model, OffloadConfig(device="sim", disk_path=path, ram_budget_bytes=least))
    assert torch.equal(run(model, (x,)), ref)
    mem = h.host_memory()
    assert mem["ram"] <= least and mem["disk"] == DEPTH * blk, mem


def test_ram_budget_without_a_disk_tier_must_hold_every_block(tmp_path):
    model = _model()
    blk, rest = _sizes()
    with pytest.raises(RamCeilingError, match=f"at least {rest + DEPTH * blk}.*disk_path"):
        offload_module(model, OffloadConfig(device="sim", ram_budget_bytes=DEPTH * blk, host_compression="off"))
    h = offload_module(model, OffloadConfig(device="sim", ram_budget_bytes=rest + DEPTH * blk))
    assert h.host_memory()["ram"] <= rest + DEPTH * blk


@pytest.mark.parametrize("bad", ["4GB", 4.0e9, 4 << 30, {"sim": 1}])
def test_a_budget_that_is_not_a_vram_budget_is_a_type_error_naming_budget(bad):
    model = _model()
    with pytest.raises(TypeError, match=r"^budget(\[.sim.\])? must be a VramBudget"):
        offload_module(model, OffloadConfig(device="sim"), budget=bad)
    assert not hasattr(model, "_layer_offload_handle")


@pytest.mark.parametrize("kwargs, name", [(dict(name=3), "name"), (dict(units="layers.0"), "units"),
                                          (dict(progress=5), "progress")])
def test_wrong_argument_types_name_the_argument(kwargs, name):
    with pytest.raises(TypeError, match=f"^{name} must be"):
        offload_module(_model(), OffloadConfig(device="sim"), **kwargs)
    with pytest.raises(TypeError, match="^model must be"):
        offload_module("model", OffloadConfig(device="sim"))


def test_a_float16_file_for_a_float32_model_is_refused_up_front(tmp_path):
    """disk_optional=False (the default): the file must match the model even while every block fits in RAM,
    not only later when RAM runs short."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "half.safetensors", dtype=torch.float16)
    with pytest.raises(CorruptFileError, match=r"float16 in the file but .*float32 in the model"):
        offload_module(model, OffloadConfig(device="sim", disk_path=path))
    with pytest.raises(ValueError):
        offload_module(model, OffloadConfig(device="sim", disk_path=path, ram_budget_bytes=aligned_bytes(model) // 3))
    assert torch.equal(run(model, (x,)), ref)
    h = offload_module(model, OffloadConfig(device="sim", disk_path=path, disk_optional=True))
    assert torch.equal(run(model, (x,)), ref)
    assert all(b.tier != "disk" for b in h.report().blocks)


def test_blocks_the_file_does_not_hold_are_one_log_line(tmp_path, caplog):
    model = _model()
    path = _save(_model(seed=9), tmp_path / "other.safetensors")
    blk, rest = _sizes()
    with caplog.at_level(logging.WARNING, logger="offload"):
        offload_module(model, OffloadConfig(device="sim", disk_path=path, disk_optional=True,
                                            ram_budget_bytes=rest + 3 * blk))
    lines = [r.getMessage() for r in caplog.records if "not streaming" in r.getMessage()]
    assert len(lines) == 1, lines
    assert int(lines[0].split("not streaming ")[1].split(" block(s)")[0]) > 1, lines[0]
    assert "stays in RAM" in lines[0]
