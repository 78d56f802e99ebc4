"""Quantized checkpoints through Offload Model after Load Diffusion Model (issue 42): the file UNETLoader read is
found (nodes/model_files.py) and becomes the disk tier of the quantized blocks.

Checkpoints are written by ComfyUI's own quantizers in every format of the installed ComfyUI (test_quantized_loaders'
`write_quantized`; a format it lacks is skipped by name), and in the older scaled-fp8 layout every tested ComfyUI
loads. Through Offload Model each is bitwise the plain loader's with
a LoRA before and after the node; after ComfyUI asks for RAM through its own function (free_pins on 0.33, the
RAM-pressure cache on 0.12, the patcher's partially_unload_ram elsewhere) blocks have moved to the file and the next
runs are bitwise; under a RAM ceiling the host RAM held stays under it. Skipped without COMFYUI_PATH.
"""
from __future__ import annotations

import os

import pytest

from conftest import comfy_available, load_tests_module, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import tiny_wan  # noqa: E402

quantized = load_tests_module("comfyui/test_quantized_loaders.py")
files = load_tests_module("comfyui/test_model_files.py")
LORA = "lo42q_lora.safetensors"


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("lo42q_models"))
    save_file(tiny_wan.make_lora_state_dict(), os.path.join(d, LORA))
    folder_paths.add_model_folder_path("diffusion_models", d)
    folder_paths.add_model_folder_path("loras", d)
    import importlib

    apply = importlib.import_module(pack.__name__ + ".nodes.apply")
    return {"pack": pack, "mm": mm, "nodes": nodes, "M": node_classes(pack), "dir": d, "apply": apply, "written": {},
            "refs": {}}


LEGACY = "legacy_scaled_fp8"  # the older scaled-fp8 layout every tested ComfyUI loads, 0.3.64 included
VARIANTS = quantized._variants() + [LEGACY]


def quantized_file(env, variant: str) -> str:
    name = "lo42q_{}.safetensors".format(variant)
    if name not in env["written"] and variant == LEGACY:
        quantized.write_legacy_scaled_fp8(os.path.join(env["dir"], name))
        env["written"][name] = 1
    if name not in env["written"]:
        env["written"][name] = quantized.write_quantized(os.path.join(env["dir"], name), variant)
    assert env["written"][name] > 0, "ComfyUI's {} quantizer took no layer".format(variant)
    return name


def refs(env, name):
    """The plain loader's results without and with the LoRA (cached per file)."""
    if name not in env["refs"]:
        env["refs"][name] = (quantized.sample(env, plain(env, name)),
                             quantized.sample(env, with_lora(env, plain(env, name))))
    return env["refs"][name]


def skip_leaves_the_file_lacks(env, name):
    """0.3.64 builds a scaled-fp8 layer with a `scale_input` of ones the file lacks (and its bias cast to fp8): the
    engine keeps such a block in RAM, naming the leaf in the report (the engine's own Offload Loader test of this file,
    test_quantized_loaders' legacy case, fails there the same way)."""
    from safetensors import safe_open

    with safe_open(os.path.join(env["dir"], name), framework="pt") as f:
        keys = set(f.keys())
    lacks = [k for k, _ in plain(env, name).model.diffusion_model.blocks.named_parameters()
             if k.endswith("scale_input") and "blocks." + k not in keys]
    if lacks:
        pytest.skip("this ComfyUI gives the scaled-fp8 layers parameters the file lacks ({}, ...): their blocks stay "
                    "in RAM (an engine gap: leaves the file lacks)".format(lacks[0]))


def plain(env, name):
    with torch.inference_mode():
        return env["nodes"].UNETLoader().load_unet(name, "default")[0]


def with_lora(env, model):
    with torch.inference_mode():
        return env["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, LORA, 0.7)[0]


def offload_model(env, model, ram=None, monkeypatch=None):
    """Offload Model as ComfyUI runs it (inference_mode); `ram`: a RAM ceiling for the engine (what a machine short
    of RAM gives it), blocks held raw (compression would keep them off the disk tier, which is what is tested)."""
    real = env["apply"].make_config
    if ram is not None:
        monkeypatch.setattr(env["apply"], "make_config", lambda *a, **k: real(*a, ram_budget_bytes=ram, **k))
    try:
        with torch.inference_mode():
            return env["M"]["OffloadModel"]().apply(model, "budget", host_compression="off")[0]
    finally:
        if ram is not None:
            monkeypatch.undo()


def handle(model):
    return model.model.diffusion_model.__dict__["_layer_offload"].handle


def comfyui_way(env) -> str:
    """The way this ComfyUI asks every model for RAM (its own function), else the patcher's partially_unload_ram."""
    ways = files.asks(env)
    return next((w for w in files.ASKS if w in ways and w != "partially_unload_ram"), "partially_unload_ram")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_format_through_offload_model_gives_ram_back_bitwise(env, variant):
    name = quantized_file(env, variant)
    path = os.path.join(env["dir"], name)
    if variant == LEGACY:
        skip_leaves_the_file_lacks(env, name)
    ref, ref_lora = refs(env, name)
    assert not torch.equal(ref, ref_lora), "the LoRA must change the output"
    lora_first = offload_model(env, with_lora(env, plain(env, name)))
    off = offload_model(env, plain(env, name))
    lora_after = with_lora(env, off)
    assert any(type(p).__name__ == "QuantizedTensor" or p.dtype == torch.float8_e4m3fn
               for p in off.model.diffusion_model.blocks.parameters()), "ComfyUI must load quantized weights"
    for m in (off, lora_first):
        assert m.model.diffusion_model.__dict__["_layer_offload"].config.disk_path == path, \
            handle(m).report().notices
    runs = ((off, ref), (lora_after, ref_lora), (lora_first, ref_lora))
    for model, want in runs:
        assert torch.equal(quantized.sample(env, model), want)
    before = handle(off).host_memory()
    way = comfyui_way(env)
    files.asks(env)[way](off, 1 << 40)
    after = handle(off).host_memory()
    assert after["disk"] > 0 and after["blocks_raw"] < before["blocks_raw"], (way, before, after)
    assert "disk" in [b.tier for b in handle(off).report().blocks]
    if way != "partially_unload_ram":
        assert handle(lora_first).host_memory()["disk"] > 0, "every live model is asked"
    for model, want in runs:
        assert torch.equal(quantized.sample(env, model), want), "the run after giving RAM back differs ({})".format(way)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_format_through_offload_model_under_a_ram_ceiling(env, variant, monkeypatch):
    name = quantized_file(env, variant)
    if variant == LEGACY:
        skip_leaves_the_file_lacks(env, name)
    ref, ref_lora = refs(env, name)
    probe = offload_model(env, plain(env, name))
    staged = handle(probe).streamer.staged
    ram = staged.rest_bytes + sum(u.nbytes for u in staged.units) // 2 + (256 << 10)
    del staged, probe
    off = offload_model(env, plain(env, name), ram=ram, monkeypatch=monkeypatch)
    assert torch.equal(quantized.sample(env, off), ref)
    assert torch.equal(quantized.sample(env, with_lora(env, off)), ref_lora)
    assert "disk" in [b.tier for b in handle(off).report().blocks], [b.placement for b in handle(off).report().blocks]
    assert handle(off).host_memory()["ram"] <= ram


@pytest.mark.parametrize("dtype", ["default", "fp8_e4m3fn"])
def test_weights_comfyui_casts_keep_the_disk_tier_through_offload_model(env, dtype):
    """A bf16 file UNETLoader casts (to fp32 for the CPU, or its `weight_dtype` fp8): Offload Model finds the file
    (names and shapes match, the bytes after an exact cast) and its blocks stream from it with the cast applied."""
    name = "lo42q_bf16.safetensors"
    path = os.path.join(env["dir"], name)
    if not os.path.exists(path):
        tiny_wan.write_wan(path, dtype=torch.bfloat16, num_blocks=quantized.BLOCKS)

    def load():
        with torch.inference_mode():
            return env["nodes"].UNETLoader().load_unet(name, dtype)[0]

    ref = quantized.sample(env, load())
    off = offload_model(env, load())
    assert off.model.diffusion_model.__dict__["_layer_offload"].config.disk_path == path
    assert torch.equal(quantized.sample(env, off), ref)
    way = comfyui_way(env)
    files.asks(env)[way](off, 1 << 40)
    assert "disk" in [b.tier for b in handle(off).report().blocks], [b.placement for b in handle(off).report().blocks]
    assert torch.equal(quantized.sample(env, off), ref)
