"""Config validation (DESIGN §6), block discovery (§2 blocks.py) and detach (§3)."""
from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch

from tests.models import (resident_modules, streamed_modules, CASES, HintedModel, LayersModel, OddMLP, RepeatedHintModel, SingleLinear,
                          WeirdListModel, module_path, param_inner_tensors, run, same_tensor, seeded, snapshot,
                          streaming_budget)

PRESET_NAMES = ["auto", "high_end", "mid_range", "consumer", "budget"]


# ---------------------------------------------------------------------------------------------- config


def test_presets_cover_every_documented_name():
    from offload import PRESETS, OffloadConfig

    assert set(PRESET_NAMES) <= set(PRESETS)
    for name in PRESET_NAMES:
        cfg = OffloadConfig.from_preset(name)
        assert isinstance(cfg, OffloadConfig)


def test_from_preset_overrides_win():
    from offload import OffloadConfig

    cfg = OffloadConfig.from_preset("budget", device="sim", prefetch=3, vram_budget_bytes=123 << 20)
    assert cfg.device == "sim"
    assert cfg.prefetch == 3
    assert cfg.vram_budget_bytes == 123 << 20


def test_unknown_preset_lists_valid_names():
    from offload import OffloadConfig

    with pytest.raises(ValueError) as ei:
        OffloadConfig.from_preset("ultra_potato", device="sim")
    msg = str(ei.value)
    assert "ultra_potato" in msg
    for name in PRESET_NAMES:
        assert name in msg, f"valid preset {name!r} not listed in: {msg}"


def _expect_config_error(kw, words, offload):
    """ValueError at construction or, at the latest, at offload_module; never a deep error in a forward."""
    from offload import OffloadConfig

    model = CASES["transformer"].build()
    with pytest.raises(ValueError) as ei:
        cfg = OffloadConfig(**kw)
        offload(model, cfg)
    msg = str(ei.value).lower()
    assert any(w in msg for w in words), f"unhelpful message for {kw}: {ei.value}"
    # nothing half-attached
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


@pytest.mark.parametrize("kw,words", [
    (dict(device="sim", vram_budget_bytes=-1), ["budget", "negative", "vram"]),
    (dict(device="sim", vram_budget_bytes=float("nan")), ["budget", "nan", "vram"]),
    (dict(device="sim", vram_budget_bytes=float("inf")), ["budget", "inf", "vram", "finite"]),
    (dict(device="sim", prefetch=-1), ["prefetch"]),
    (dict(device="tpu"), ["tpu", "device"]),
    (dict(device="cuda:99"), ["cuda:99", "device", "cuda"]),
])
def test_bad_config_is_a_clear_value_error(kw, words, offload):
    _expect_config_error(kw, words, offload)


def test_device_error_names_valid_choices(offload):
    from offload import OffloadConfig

    with pytest.raises(ValueError) as ei:
        offload(CASES["transformer"].build(), OffloadConfig(device="tpu"))
    msg = str(ei.value)
    assert "sim" in msg and "cuda" in msg, f"valid devices not listed: {msg}"


# ---------------------------------------------------------------------------------------------- discovery


def _units(handle):
    return streamed_modules(handle) + resident_modules(handle)


def _assert_units_are_blocks(model, handle, expected):
    units = _units(handle)
    ids = {id(u) for u in units}
    for b in expected:
        assert id(b) in ids, (
            f"block {module_path(model, b)} not a unit; units: {[module_path(model, u) for u in units]}")
    inside = {id(m) for b in expected for m in b.modules() if m is not b}
    for u in units:
        assert id(u) not in inside, f"unit {module_path(model, u)} splits a block"


@pytest.mark.parametrize("build,list_path", [
    (lambda: seeded(LayersModel), "layers"),
    (lambda: seeded(HintedModel), "stuff"),
    (lambda: seeded(RepeatedHintModel), "stuff"),
    (lambda: seeded(WeirdListModel), "trunk.zorglubs"),
    (lambda: CASES["dit"].build(), "double_blocks+single_blocks"),
    (lambda: CASES["unet"].build(), "input_blocks+output_blocks"),
], ids=["layers", "no_split_modules", "repeated_blocks", "heuristic", "dit_two_lists", "unet_lists"])
def test_block_discovery(build, list_path, sim_cfg, offload):
    model = build()
    if model.__class__.__name__ == "DiTStack":
        x = CASES["dit"].inputs()
    elif model.__class__.__name__ == "UNetLike":
        x = CASES["unet"].inputs()
    else:
        x = (torch.randn(2, 5, 64),)
    ref = run(model, x)
    expected = [b for p in list_path.split("+") for b in model.get_submodule(p)]
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, expected, 3), prefetch=2))
    _assert_units_are_blocks(model, handle, expected)
    assert streamed_modules(handle)
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_explicit_units(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    paths = ["blocks.0", "blocks.1", "blocks.4"]
    mods = [model.get_submodule(p) for p in paths]
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, mods, 2), prefetch=1),
                     units=paths)
    units = _units(handle)
    assert sorted(module_path(model, u) for u in units) == sorted(paths)
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_explicit_unit_that_does_not_exist(sim_cfg, offload):
    model = CASES["transformer"].build()
    with pytest.raises((ValueError, KeyError, AttributeError)) as ei:
        offload(model, sim_cfg(), units=["blocks.0", "blocks.99"])
    assert "blocks.99" in str(ei.value)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


@pytest.mark.parametrize("build", [lambda: seeded(SingleLinear), lambda: seeded(OddMLP)], ids=["linear", "odd_mlp"])
def test_model_without_repeated_blocks(build, sim_cfg, offload, caplog):
    """DESIGN §6: one unit with a warning, or a clear refusal; never a traceback from deep inside."""
    model = build()
    x = (torch.randn(3, 64),)
    ref = run(model, x)
    before = snapshot(model)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        try:
            handle = offload(model, sim_cfg(prefetch=1))
        except Exception as err:  # refused: must be a clear, shallow error
            assert isinstance(err, (ValueError, TypeError)) or type(err).__module__.startswith("offload"), (
                f"{type(err).__name__}: {err}")
            assert re.search(r"block|unit|repeat", str(err), re.I), f"unclear refusal: {err}"
            for m in model.modules():
                assert not m._forward_pre_hooks and not m._forward_hooks
            assert torch.equal(run(model, x), ref)
            return
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] + [str(w.message) for w in rec]
    assert any(re.search(r"block|unit|repeat", m, re.I) for m in msgs), f"accepted without a warning: {msgs}"
    assert len(_units(handle)) >= 1
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    handle.detach()
    for k, v in before.items():
        assert same_tensor(model.state_dict()[k], v)


# ---------------------------------------------------------------------------------------------- detach


def _hook_state(model):
    return {name: (tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for name, m in model.named_modules()}


@pytest.mark.parametrize("case_name", ["transformer", "dit", "tied_buffers", "fp8_e5m2", "int8_subclass",
                                       "decoder_bf16", "transposed"])
def test_detach_restores_everything(case_name, sim_cfg, offload):
    case = CASES[case_name]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    before = snapshot(model)
    keys = list(model.state_dict())
    hooks = _hook_state(model)
    param_ids = [id(p) for p in model.parameters()]
    orig_storage = {n: [t.untyped_storage().nbytes() for t in param_inner_tensors(v)]
                    for n, v in list(model.named_parameters()) + list(model.named_buffers())}
    tied = model.__class__.__name__ == "TiedBufferModel"
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    backend = handle.backend
    assert list(model.state_dict()) == keys
    assert torch.equal(run(model, x), ref)
    handle.detach()
    assert _hook_state(model) == hooks, "hooks left behind after detach"
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == param_ids, "parameter objects replaced or untied"
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        for inner in param_inner_tensors(t):
            assert not backend.owns(inner), f"{name} still in device memory after detach"
            assert inner.device.type == "cpu", name
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        for inner, before_nbytes in zip(param_inner_tensors(t), orig_storage[name]):
            st = inner.untyped_storage().nbytes()
            own = inner.numel() * inner.element_size()
            assert st <= max(own, before_nbytes), (
                f"{name} is still a view into a larger (staging) buffer: storage {st} B for a {own} B tensor "
                f"(its storage was {before_nbytes} B before offloading)")
    sd = model.state_dict()
    for k, v in before.items():
        assert same_tensor(sd[k], v), f"{k} changed by offload+detach"
    if tied:
        assert model.head.weight is model.embed.weight
        assert model.blocks[0].shared is model.blocks[1].shared
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_detach_twice_and_reattach(sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    hooks = _hook_state(model)
    cfg = sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2)
    handle = offload(model, cfg)
    run(model, x)
    handle.detach()
    handle.detach()  # harmless
    assert _hook_state(model) == hooks
    assert torch.equal(run(model, x), ref)
    handle2 = offload(model, cfg)  # a detached model can be offloaded again
    assert torch.equal(run(model, x), ref)
    handle2.detach()
    assert _hook_state(model) == hooks
    assert torch.equal(run(model, x), ref)


def test_detach_preserves_user_hooks(sim_cfg, offload):
    """Hooks the user installed before offloading survive detach and keep firing in order."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    calls = []
    model.blocks[2].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model.blocks[2].register_forward_hook(lambda m, a, o: calls.append("post"))
    ref = run(model, x)
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2))
    calls.clear()
    assert torch.equal(run(model, x), ref)
    assert calls == ["pre", "post"]
    handle.detach()
    calls.clear()
    assert torch.equal(run(model, x), ref)
    assert calls == ["pre", "post"]
    assert len(model.blocks[2]._forward_pre_hooks) == 1 and len(model.blocks[2]._forward_hooks) == 1


def test_overlapping_explicit_units(sim_cfg, offload):
    """A unit inside another unit makes no sense as a transfer plan: refuse clearly, or stay exact."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    try:
        handle = offload(model, sim_cfg(prefetch=1), units=["blocks.0", "blocks.0.fc1", "blocks.1"])
    except ValueError as err:
        assert "blocks.0" in str(err), f"refusal does not name the overlapping unit: {err}"
        for m in model.modules():
            assert not m._forward_pre_hooks and not m._forward_hooks
        assert torch.equal(run(model, x), ref)
        return
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    handle.detach()
    assert torch.equal(run(model, x), ref)


def test_default_budget_is_process_wide():
    """budget=None joins default_budget(): the same object every time, and it accounts for the model."""
    from offload import OffloadConfig, default_budget, offload_module

    assert default_budget() is default_budget()
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    shared = default_budget()
    before = shared.used_bytes
    handle = offload_module(model, OffloadConfig(device="sim", prefetch=1))
    try:
        assert torch.equal(run(model, x), ref)
        assert handle.device_bytes() > 0
        assert shared.used_bytes == before + handle.device_bytes()
        assert shared.total_bytes is not None and shared.used_bytes <= shared.total_bytes
    finally:
        handle.detach()
    assert shared.used_bytes == before
    assert torch.equal(run(model, x), ref)
