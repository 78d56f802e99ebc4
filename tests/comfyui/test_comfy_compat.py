"""What current ComfyUI does with a model, done to an offloaded one: saving and merging, patches on plain
parameters, patches that do not fit, quantized weights with a LoRA, DynamicVRAM's own patcher class, and
ComfyUI's RAM accounting. Every result is compared bitwise with the plain loader's. Skipped without ComfyUI.
"""
from __future__ import annotations

import logging
import os

from typing import Any

import pytest

from conftest import combo_choices, comfy_available, display_names, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_compat_wan.safetensors"
UNET_FP8 = "lo_compat_wan_scaled_fp8.safetensors"
UNET_FP32 = "lo_compat_wan_fp32.safetensors"
LORA = "lo_compat_wan_lora.safetensors"


def write_scaled_fp8(path: str) -> None:
    """The tiny Wan model in ComfyUI's scaled-fp8 layout: fp8 matrices, each with its float32 scale_weight."""
    sd = {}
    for k, v in tiny_wan.make_wan_state_dict(seed=0, dtype=torch.float32).items():
        if k.endswith(".weight") and v.dim() == 2 and "norm" not in k:
            scale = v.abs().max() / 448.0
            sd[k] = (v / scale).to(torch.float8_e4m3fn)
            sd[k[:-len("weight")] + "scale_weight"] = scale.reshape(()).to(torch.float32)
        else:
            sd[k] = v.to(torch.float16)
    sd["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    save_file(sd, path)


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("compat_models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    # the dtype ComfyUI computes in on the CPU; 8 blocks, so the disk tier's bounce buffers leave a net gain
    tiny_wan.write_wan(os.path.join(d, UNET_FP32), dtype=torch.float32, num_blocks=8)
    tiny_wan.write_lora(os.path.join(d, LORA))
    write_scaled_fp8(os.path.join(d, UNET_FP8))
    folder_paths.add_model_folder_path("diffusion_models", d)
    folder_paths.add_model_folder_path("loras", d)
    return {"pack": pack, "mm": mm, "nodes": nodes, "M": node_classes(pack), "dir": d}


def sample(env, model, steps: int = 3, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        return env["nodes"].common_ksampler(model, seed, steps, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]


# Loaders run under inference mode, as in ComfyUI's executor (0.12's mixed-precision ops need it).
def plain(env, name=UNET, dtype="default"):
    with torch.inference_mode():
        return env["nodes"].UNETLoader().load_unet(name, dtype)[0]


def offloaded(env, preset="budget", name=UNET, dtype="default"):
    with torch.inference_mode():
        return env["M"]["OffloadDiffusionModelLoader"]().load(name, dtype, preset)[0]


def with_lora(env, model, strength=0.8):
    with torch.inference_mode():
        return env["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, LORA, strength)[0]


def managed(model):
    return model.model.diffusion_model.__dict__["_layer_offload"]


# saving and merging ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["budget", "high_end"])
def test_saving_an_offloaded_model_equals_saving_the_plain_one(env, tmp_path, preset):
    import comfy.sd

    a, b = str(tmp_path / "plain.safetensors"), str(tmp_path / "offloaded.safetensors")
    comfy.sd.save_checkpoint(a, with_lora(env, plain(env)))
    off = offloaded(env, preset)
    comfy.sd.save_checkpoint(b, with_lora(env, off))
    sa, sb = load_file(a), load_file(b)
    assert sorted(sa) == sorted(sb)
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, "saved weights differ: {}".format(differ[:5])
    base = load_file(os.path.join(env["dir"], UNET))
    assert not torch.equal(sa["model.diffusion_model.blocks.0.self_attn.q.weight"], base["blocks.0.self_attn.q.weight"]), \
        "the LoRA must be in the saved weights"
    # saving left the shared host weights unpatched: the model without the LoRA is the base model again
    assert torch.equal(sample(env, plain(env)), sample(env, off))


def test_merging_an_offloaded_model_matches_the_plain_merge(env):
    try:
        from comfy_extras.nodes_model_merging import ModelMergeSimple
    except ImportError:  # the pip-installable fork keeps its extra nodes in a subpackage
        from comfy_extras.nodes.nodes_model_merging import ModelMergeSimple
    merge = ModelMergeSimple()
    other_path = os.path.join(env["dir"], "lo_compat_other.safetensors")
    if not os.path.exists(other_path):
        tiny_wan.write_wan(other_path, seed=7)
    other = plain(env, "lo_compat_other.safetensors")
    ref = sample(env, merge.merge(plain(env), other, 0.6)[0])
    off = offloaded(env, "budget")
    assert torch.equal(ref, sample(env, merge.merge(off, other, 0.6)[0]))
    assert torch.equal(sample(env, plain(env)), sample(env, off)), "merging left the offloaded model unchanged"


# patches on plain parameters, and patches that do not fit --------------------------------------------------------
def _modulation_patch(scale: float = 0.05):
    g = torch.Generator().manual_seed(11)
    return {"diffusion_model.blocks.{}.modulation".format(i): (scale * torch.randn(1, 6, tiny_wan.DIM, generator=g),)
            for i in range(tiny_wan.NUM_BLOCKS)}


def _with_plain_linear(model):
    """Swap one FFN layer inside block 1 for a plain torch Linear (a leaf module outside ComfyUI's layer types)."""
    block = model.model.diffusion_model.blocks[1]
    old = block.ffn[0]
    new = torch.nn.Linear(old.in_features, old.out_features, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(old.bias)
    block.ffn[0] = new
    return model


@pytest.mark.parametrize("preset", ["budget", "high_end"])
def test_patches_on_plain_parameters_match_the_plain_loader(env, preset):
    """A patch on a leaf module's plain parameter outside ComfyUI's layer types reaches the streamed (and the
    resident) weight as the plain loader bakes it; a patch on a non-leaf module's own parameter (Wan's
    `modulation`) is left out, as the plain loader leaves it out."""
    g = torch.Generator().manual_seed(12)
    leaf = {"diffusion_model.blocks.1.ffn.0.weight": (0.05 * torch.randn(tiny_wan.FFN, tiny_wan.DIM, generator=g),)}
    ref_model = _with_plain_linear(plain(env)).clone()
    ref_model.add_patches(leaf, 0.7)
    ref_model.add_patches(_modulation_patch(), 0.7)
    ref = sample(env, ref_model)
    assert not torch.equal(ref, sample(env, _with_plain_linear(plain(env)))), "the leaf patch must change the output"
    off = env["M"]["OffloadModel"]().apply(_with_plain_linear(plain(env)), preset)[0].clone()
    off.add_patches(leaf, 0.7)
    off.add_patches(_modulation_patch(), 0.7)
    assert torch.equal(ref, sample(env, off))
    only_modulation = plain(env).clone()
    only_modulation.add_patches(_modulation_patch(), 0.7)
    off2 = offloaded(env, preset).clone()
    off2.add_patches(_modulation_patch(), 0.7)
    assert torch.equal(sample(env, only_modulation), sample(env, off2))


def test_a_patch_that_does_not_fit_is_reported_once_per_load(env, caplog):
    bad = {"diffusion_model.blocks.0.self_attn.q.weight": (torch.randn(3, 3),),
           "diffusion_model.blocks.1.modulation": (torch.randn(2, 2),)}
    ref_model = plain(env).clone()
    ref_model.add_patches(bad, 1.0)
    ref = sample(env, ref_model)
    off = offloaded(env, "budget").clone()
    off.add_patches(bad, 1.0)
    with caplog.at_level(logging.WARNING):
        out = sample(env, off, steps=4)
        again = sample(env, off, steps=4)
    assert torch.equal(ref, sample(env, ref_model))
    assert torch.equal(out, again) and torch.equal(sample(env, ref_model, steps=4), out)
    ours = [r for r in caplog.records if "do not fit" in r.getMessage()]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert "2 patch(es)" in ours[0].getMessage()
    noisy = [r for r in caplog.records if "layer-offload" in r.name or r.name == "layer_offload"]
    assert len(noisy) <= 3, [r.getMessage() for r in noisy]


# quantized weights ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["budget", "high_end"])
def test_scaled_fp8_weights_with_a_lora_match_a_full_load(env, preset):
    """Weights stored as fp8 with a scale (ComfyUI's scaled-fp8 format): streamed as stored, and a LoRA patched
    through the layer's own convert/set functions exactly as ComfyUI's full load bakes it."""
    ref_plain = plain(env, UNET_FP8)
    quantized = [p for p in ref_plain.model.diffusion_model.parameters()  # fp8 storage, or a quantized tensor type
                 if p.dtype == torch.float8_e4m3fn or type(p).__name__ == "QuantizedTensor"]
    assert quantized, "ComfyUI must load the scaled-fp8 file as fp8 weights"
    off = offloaded(env, preset, UNET_FP8)
    assert torch.equal(sample(env, ref_plain), sample(env, off))
    ref = sample(env, with_lora(env, plain(env, UNET_FP8), 0.7))
    assert torch.equal(ref, sample(env, with_lora(env, off, 0.7)))
    blocks = managed(off).handle.report().blocks
    assert blocks and all(b.bytes < 700_000 for b in blocks), "fp8 blocks move as fp8, not upcast"


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_offload_model_on_a_loaded_quantized_model_leaves_the_loader_model_unchanged(env, lora):
    """UNETLoader's scaled-fp8 model (QuantizedTensor layouts where ComfyUI has them, fp8 weights with scales before)
    through Offload Model: equal to the loader alone, before and after, with and without a LoRA; where the weights
    are a quantized tensor type, the loader's model keeps every weight object and its bytes (Offload Model works on
    its own copy), and the copy streams the quantized bytes as stored."""
    cached = plain(env, UNET_FP8)
    ref = sample(env, with_lora(env, plain(env, UNET_FP8), 0.7) if lora else plain(env, UNET_FP8))

    def run(model):
        return sample(env, with_lora(env, model, 0.7) if lora else model)

    def weights():
        out = {}
        for k, p in cached.model.named_parameters():
            inner = [getattr(p, n) for n in p.__tensor_flatten__()[0]] if hasattr(p, "__tensor_flatten__") else [p]
            out[k] = (p, type(p), [(t.data_ptr(), tuple(t.shape)) for t in inner])
        return out

    first = plain(env, UNET_FP8)  # plain branch first, then Offload Model on the same loader output
    assert torch.equal(ref, run(first)), "the plain branch before offloading"
    with torch.inference_mode():
        assert torch.equal(ref, run(env["M"]["OffloadModel"]().apply(first, "budget")[0])), "offloaded after plain"
    before = weights()  # Offload Model first, then the plain branch
    with torch.inference_mode():
        off = env["M"]["OffloadModel"]().apply(cached, "budget")[0]
    assert torch.equal(ref, run(off))
    quantized = [k for k, p in cached.model.named_parameters() if hasattr(p, "__tensor_flatten__")]
    if quantized:
        after = weights()
        changed = [k for k in before if before[k][0] is not after[k][0] or before[k][1:] != after[k][1:]]
        assert not changed, "the loader's model was changed: {}".format(changed[:5])
        q = dict(off.model.named_parameters())[quantized[0]]
        assert type(q) is type(dict(cached.model.named_parameters())[quantized[0]])
    assert torch.equal(ref, run(cached)), "the plain branch after offloading"
    assert torch.equal(ref, run(off)), "a second offloaded run"
    blocks = managed(off).handle.report().blocks
    assert blocks and all(b.tier != "vram" for b in blocks) and all(b.bytes < 700_000 for b in blocks)


# DynamicVRAM ----------------------------------------------------------------------------------------------------
def _dynamic_patcher(dynamic_cls: Any, base: Any, monkeypatch: Any) -> Any:
    """A real ModelPatcherDynamic over `base`'s model (on the CPU its __new__ reroutes to ModelPatcher: build the class
    itself). Where its host-buffer bookkeeping needs comfy-aimdo's native library, which is not loaded on the CPU
    (0.23+: `register_load_device`), that one step records the same per-device entries without host buffers."""
    dyn = object.__new__(dynamic_cls)
    try:
        dynamic_cls.__init__(dyn, base.model, base.load_device, base.offload_device)
        return dyn
    except Exception:  # noqa: BLE001 - comfy-aimdo without its native library
        if not hasattr(dynamic_cls, "register_load_device"):
            raise

    def register_load_device(self: Any, device: Any) -> None:
        subsets = {s: (None, [], [-1], [0], [0], {}) for s in ("weights", "patches", "weights-loaded", "patches-loaded")}
        self.model.dynamic_pins.setdefault(device, dict(subsets, hostbufs_initialized=False, failed=False, active=False,
                                                        current_prompt=False))

    monkeypatch.setattr(dynamic_cls, "register_load_device", register_load_device)
    dyn = object.__new__(dynamic_cls)
    dynamic_cls.__init__(dyn, base.model, base.load_device, base.offload_device)
    return dyn


def test_a_model_dynamicvram_loaded_is_stripped_and_offloaded(env, monkeypatch):
    """With ComfyUI's real ModelPatcherDynamic (0.12+): after DynamicVRAM prepared a model (its per-module VBAR
    state set), Offload Model releases it, strips that state and offloads a plain patcher; results are exact."""
    import comfy.model_patcher as mp

    dynamic_cls = getattr(mp, "ModelPatcherDynamic", None)
    if dynamic_cls is None:
        pytest.skip("this ComfyUI has no DynamicVRAM (ModelPatcherDynamic)")
    base = plain(env)
    ref = sample(env, with_lora(env, plain(env), 0.5))
    dyn = _dynamic_patcher(dynamic_cls, base, monkeypatch)
    assert dyn.is_dynamic()
    try:
        with torch.inference_mode():
            dyn.load(dyn.load_device)  # DynamicVRAM prepares the modules
    except Exception:  # noqa: BLE001 - its own load() cannot run on the CPU (0.12.1: its _load_list tuples; 0.33: no
        pass  # VBAR without comfy-aimdo's native library): set what it would have set
    for n, m in base.model.named_modules():
        if hasattr(m, "comfy_cast_weights"):  # what ModelPatcherDynamic.load leaves on every cast layer
            m.__dict__.update(_v_signature=None, weight_lowvram_function=None, bias_lowvram_function=None,
                              pin_failed=False, seed_key=n)
            m._v = object()  # as on a GPU: a VBAR allocation (cast_bias_weight would take the VBAR path)
    marked = [m for m in base.model.modules() if "_v" in m.__dict__]
    assert marked
    out = env["M"]["OffloadModel"]().apply(dyn, "budget")[0]
    assert not out.is_dynamic() and type(out).__name__ == "OffloadModelPatcher"
    leftovers = [m for m in base.model.modules() if any(a in m.__dict__ for a in ("_v", "_v_signature",
                                                                                  "weight_lowvram_function"))]
    assert not leftovers, "DynamicVRAM state left on {} module(s)".format(len(leftovers))
    assert torch.equal(ref, sample(env, with_lora(env, out, 0.5)))


# host RAM -------------------------------------------------------------------------------------------------------
def test_ram_accounting_and_release_to_the_disk_tier(env):
    """ComfyUI's RAM view of an offloaded model is the engine's, and partially_unload_ram moves blocks to the disk
    tier where the model's file holds their bytes (the Offload Loader passes its file); results stay exact. A file
    in another dtype than the loaded weights holds other bytes: nothing moves."""
    half = offloaded(env, "budget")
    if next(half.model.diffusion_model.parameters()).dtype != torch.float16:
        assert half.partially_unload_ram(1 << 40) == 0, "the fp16 file does not hold the weights ComfyUI cast"
    off = offloaded(env, "budget", UNET_FP32)
    ref = sample(env, plain(env, UNET_FP32))
    assert torch.equal(ref, sample(env, off))
    ram = off.get_ram_usage()
    resident, total = off.model_mmap_residency()
    assert ram > 0 and resident == ram and total == ram
    assert off.pinned_memory_size() == 0  # nothing is pinned on the CPU
    freed = off.partially_unload_ram(1 << 40)
    assert freed > 0 and off.get_ram_usage() == ram - freed, (freed, ram, off.get_ram_usage())
    resident, total = off.model_mmap_residency()
    assert total - resident >= freed
    tiers = {b.tier for b in managed(off).handle.report().blocks}
    assert "disk" in tiers, tiers
    assert torch.equal(ref, sample(env, off))
    assert torch.equal(sample(env, with_lora(env, plain(env, UNET_FP32))), sample(env, with_lora(env, off)))
