"""Saving an offloaded model the way other packs do (KJNodes' ModelSaveKJ: `model.state_dict_for_saving(None, None,
None)` on the patcher where ComfyUI's ModelPatcher has it, else ComfyUI's own `save_checkpoint` path): the offload
patcher has the method exactly where the base class has one, so a saver that feature-detects it takes the same path
as for the plain patcher, and the saved weights are the plain loader's bit for bit. Skipped without ComfyUI.
"""
from __future__ import annotations

import os

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_saving_wan.safetensors"
LORA = "lo_saving_wan_lora.safetensors"


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("saving_models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    tiny_wan.write_lora(os.path.join(d, LORA))
    folder_paths.add_model_folder_path("diffusion_models", d)
    folder_paths.add_model_folder_path("loras", d)
    return {"nodes": nodes, "M": node_classes(pack), "dir": d}


def _loaded(env, offload: bool):
    with torch.inference_mode():
        if offload:
            model = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget")[0]
        else:
            model = env["nodes"].UNETLoader().load_unet(UNET, "default")[0]
        return env["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, LORA, 0.8)[0]


def save_like_a_pack(patcher, path: str) -> str:
    """KJNodes' ModelSaveKJ where the patcher has `state_dict_for_saving` (ComfyUI 0.8+); ComfyUI's own
    `save_checkpoint` path (a full patched load, then the model's method) where it has none."""
    import comfy.model_management as mm
    import comfy.utils

    if hasattr(patcher, "state_dict_for_saving"):
        mm.load_models_gpu([patcher])
        sd = patcher.state_dict_for_saving(None, None, None)
        how = "patcher"
    else:
        mm.load_models_gpu([patcher], force_patch_weights=True)
        sd = patcher.model.state_dict_for_saving(None, None, None)
        how = "model"
    comfy.utils.save_torch_file({k: v.contiguous() for k, v in sd.items()}, path)
    return how


def test_offload_patcher_has_state_dict_for_saving_where_comfyui_has_it(env):
    from comfy.model_patcher import ModelPatcher

    plain, off = _loaded(env, False), _loaded(env, True)
    assert type(off) is not type(plain)
    has = callable(getattr(ModelPatcher, "state_dict_for_saving", None))
    assert hasattr(plain, "state_dict_for_saving") == has
    assert hasattr(off, "state_dict_for_saving") == has, \
        "the offload patcher must not offer a method its ComfyUI base lacks (it would call None)"

    class OtherPacksPatcher(ModelPatcher):  # another pack's subclass: same rule for its offload class
        pass

    from importlib import import_module

    comfy_patcher = import_module(type(off).__module__)
    assert hasattr(comfy_patcher.offload_class_for(OtherPacksPatcher), "state_dict_for_saving") == has


def test_a_pack_saver_saves_the_offloaded_model_like_the_plain_one(env, tmp_path):
    a, b = str(tmp_path / "plain.safetensors"), str(tmp_path / "offloaded.safetensors")
    how_plain = save_like_a_pack(_loaded(env, False), a)
    how_off = save_like_a_pack(_loaded(env, True), b)
    assert how_plain == how_off
    sa, sb = load_file(a), load_file(b)
    assert sorted(sa) == sorted(sb)
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, "saved weights differ: {}".format(differ[:5])
    key = next(k for k in sa if k.endswith("blocks.0.self_attn.q.weight"))
    base = load_file(os.path.join(env["dir"], UNET))["blocks.0.self_attn.q.weight"]
    assert not torch.equal(sb[key], base.to(sb[key].dtype)), "the LoRA must be in the saved weights"
