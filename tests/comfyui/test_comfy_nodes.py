"""In-process ComfyUI tests (CPU mode, simulated device): nodes, accounting, LoRA equality, interrupt.

Skipped unless COMFYUI_PATH points at a ComfyUI checkout.
"""
from __future__ import annotations

import json
import os

from typing import Any, Dict

import pytest

from conftest import combo_choices, comfy_available, display_names, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

NODE_IDS = ["OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP", "OffloadAny",
            "OffloadVramBudget", "OffloadReport", "OffloadTTSLoader", "OffloadTTSGenerate"]
PRESETS = ["auto", "high_end", "mid_range", "consumer", "budget"]
UNET = "lo_tiny_wan.safetensors"
LORA = "lo_tiny_wan_lora.safetensors"
CKPT = "lo_tiny_wan_ckpt.safetensors"


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    """ComfyUI modules, the pack's node classes and a folder with the tiny Wan model and LoRA."""
    import comfy.model_management as mm
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("models"))
    tiny_wan.write_wan(os.path.join(d, UNET))
    tiny_wan.write_lora(os.path.join(d, LORA))
    tiny_wan.write_checkpoint(os.path.join(d, CKPT))
    folder_paths.add_model_folder_path("checkpoints", d)
    folder_paths.add_model_folder_path("diffusion_models", d)
    folder_paths.add_model_folder_path("loras", d)
    return {"pack": pack, "mm": mm, "nodes": nodes, "M": node_classes(pack)}


def sample(env, model, steps: int = 3, seed: int = 3, callback=None) -> torch.Tensor:
    nodes = env["nodes"]
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        if callback is None:
            out = nodes.common_ksampler(model, seed, steps, 1.0, "euler", "simple", cond, cond, latent)[0]
        else:
            import comfy.sample

            noise = comfy.sample.prepare_noise(latent["samples"], seed)
            s = comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, latent["samples"],
                                    callback=callback, disable_pbar=True, seed=seed)
            return s
    return out["samples"]


def plain_model(env):
    return env["nodes"].UNETLoader().load_unet(UNET, "default")[0]


def offload_model(env, preset: str = "budget", priority: int = 0):
    return env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", preset, None, priority)[0]


def interrupted_exception(mm):
    """ComfyUI's interrupt exception: on comfy.model_management, or in comfy.interruption (the 0.12 fork)."""
    cls = getattr(mm, "InterruptProcessingException", None)
    if cls is None:
        from comfy.interruption import InterruptProcessingException as cls
    return cls


def handle_of(model):
    return model.model.diffusion_model.__dict__["_layer_offload"].handle


# registration ---------------------------------------------------------------------------------------------------
def test_all_node_ids_registered_with_category_and_tooltips(env):
    pack = env["pack"]
    assert sorted(node_classes(pack)) == sorted(NODE_IDS)
    assert set(display_names(pack)) == set(NODE_IDS)
    assert display_names(pack)["OffloadDiffusionModelLoader"] == "Offload Loader (Diffusion Model)"
    assert display_names(pack)["OffloadVramBudget"] == "VRAM Budget"
    assert pack.WEB_DIRECTORY
    for node_id, cls in node_classes(pack).items():
        assert cls.CATEGORY == "Layer Offload", node_id
        spec = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            for name, entry in spec.get(section, {}).items():
                assert len(entry) == 2 and entry[1].get("tooltip"), "{}.{} has no tooltip".format(node_id, name)


def test_preset_dropdowns_offer_the_five_presets(env):
    for node_id in ("OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP",
                    "OffloadAny", "OffloadVramBudget"):
        spec = env["M"][node_id].INPUT_TYPES()["required"]["preset"]
        assert combo_choices(spec) == PRESETS, node_id


def test_loader_inputs_match_comfy(env):
    spec = env["M"]["OffloadDiffusionModelLoader"].INPUT_TYPES()
    core = env["nodes"].UNETLoader.INPUT_TYPES()["required"]
    assert combo_choices(spec["required"]["weight_dtype"]) == combo_choices(core["weight_dtype"])
    assert UNET in combo_choices(spec["required"]["unet_name"])
    assert spec["optional"]["budget"][0] == "OFFLOAD_BUDGET"
    assert spec["optional"]["priority"][0] == "INT"
    assert tuple(env["M"]["OffloadCheckpointLoader"].RETURN_TYPES) == ("MODEL", "CLIP", "VAE")
    assert env["M"]["OffloadReport"].OUTPUT_NODE is True
    assert tuple(env["M"]["OffloadReport"].RETURN_TYPES) == ("STRING",)


WIDGET_KEYS = ("default", "min", "max", "step", "tooltip", "multiline")
ADDED_INPUTS = ("devices", "per_device", "budget_share", "voice_text", "temperature", "top_k", "top_p",  # newer than
                "host_compression")  # node_defs_v1.json
RETEXTED = ("OffloadTTSLoader", "OffloadTTSGenerate")  # issue 28: their tooltips / descriptions name every TTS model


def _v1_view(cls: Any) -> Dict[str, Any]:
    """A node's definition as the V1 API (and ComfyUI's /object_info) presents it."""
    spec = cls.INPUT_TYPES()
    inputs = {}
    for section in ("required", "optional"):
        for name, entry in spec.get(section, {}).items():
            opts = dict(entry[1]) if len(entry) > 1 else {}
            combo = isinstance(entry[0], (list, tuple)) or entry[0] == "COMBO"
            item = {"section": section, "type": "COMBO" if combo else str(entry[0])}
            if combo:
                item["choices"] = combo_choices(entry)
                opts.pop("options", None)
            item["options"] = {k: v for k, v in opts.items() if k in WIDGET_KEYS}
            inputs[name] = item
    return {"inputs": inputs, "input_order": list(spec.get("required", {})) + list(spec.get("optional", {})),
            "return_types": [str(t) for t in cls.RETURN_TYPES], "return_names": [str(n) for n in cls.RETURN_NAMES],
            "output_tooltips": list(cls.OUTPUT_TOOLTIPS), "category": cls.CATEGORY, "description": cls.DESCRIPTION,
            "output_node": bool(getattr(cls, "OUTPUT_NODE", False))}


def test_v3_nodes_keep_the_saved_workflow_contract(env):
    """The V3 schema gives every node the ids, input names and order, types, defaults, ranges, tooltips, outputs and
    categories the V1 nodes had (tests/comfyui/node_defs_v1.json, recorded from the V1 classes), so saved workflows
    and example_workflows/ load unchanged."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_defs_v1.json")) as f:
        v1 = json.load(f)
    classes = node_classes(env["pack"])
    assert sorted(classes) == sorted(v1)
    from comfy_api.latest import io

    for node_id, want in v1.items():
        cls = classes[node_id]
        assert issubclass(cls, io.ComfyNode), node_id
        got = _v1_view(cls)
        assert display_names(env["pack"])[node_id] == want["display_name"]
        # inputs added since (issue 21: `devices`, `per_device`) are optional and come after the recorded ones,
        # so a saved workflow's widget values still line up and the new inputs take their defaults
        n = len(want["input_order"])
        assert got["input_order"][:n] == want["input_order"], node_id
        for name in got["input_order"][n:]:
            assert name in ADDED_INPUTS and got["inputs"][name]["section"] == "optional", (node_id, name)
            # "" / 0: as before; "preset": the preset's own choice, as before (host_compression, issue 36)
            assert got["inputs"][name]["options"].get("default") in ("", 0, "preset"), (node_id, name)
        for name, item in want["inputs"].items():
            g = got["inputs"][name]
            assert (g["section"], g["type"]) == (item["section"], item["type"]), (node_id, name, g)
            if "choices" in item:
                assert g["choices"] == item["choices"], (node_id, name)
            opts = {k: v for k, v in item["options"].items() if k in WIDGET_KEYS}
            if node_id in RETEXTED:
                opts.pop("tooltip", None)
                g = dict(g, options={k: v for k, v in g["options"].items() if k != "tooltip"})
            assert g["options"] == opts, (node_id, name, g["options"], item["options"])
        for key in ("return_types", "return_names", "output_tooltips", "category", "description", "output_node"):
            if node_id in RETEXTED and key in ("output_tooltips", "description"):
                continue
            assert got[key] == want[key], (node_id, key, got[key], want[key])


def test_unknown_preset_is_a_clear_error(env):
    with pytest.raises(ValueError, match="budget"):
        env["M"]["OffloadModel"]().apply(plain_model(env), "turbo")


# equality -------------------------------------------------------------------------------------------------------
def test_offload_loader_is_bitwise_equal_to_unet_loader(env):
    ref = sample(env, plain_model(env))
    for preset in ("budget", "consumer", "auto"):
        model = offload_model(env, preset)
        from comfy.model_patcher import ModelPatcher

        assert isinstance(model, ModelPatcher) and not model.is_dynamic()
        out = sample(env, model)
        assert torch.equal(ref, out), preset
        assert torch.equal(ref, sample(env, model)), "repeated run differs ({})".format(preset)


def test_offload_model_node_on_a_loaded_model(env):
    plain = plain_model(env)
    ref = sample(env, plain)
    off = env["M"]["OffloadModel"]().apply(plain, "budget")[0]
    assert off is not plain and off.model is plain.model
    assert torch.equal(ref, sample(env, off))


def test_lora_matches_plain_loader_with_lora(env):
    lora_node = env["nodes"].LoraLoaderModelOnly()
    base = sample(env, plain_model(env))
    ref = sample(env, lora_node.load_lora_model_only(plain_model(env), LORA, 0.8)[0])
    assert not torch.equal(ref, base), "the test LoRA must change the output"
    off = offload_model(env, "budget")
    patched = lora_node.load_lora_model_only(off, LORA, 0.8)[0]
    assert type(patched) is type(off)
    out = sample(env, patched)
    assert torch.equal(ref, out)
    # the host master stays unpatched: the offloaded model without the LoRA still gives the base result
    assert torch.equal(base, sample(env, off))
    assert torch.equal(ref, sample(env, patched))


def test_compressed_host_ram_with_lora_is_bitwise(env):
    """host_compression="lossless" (issue 36): every block held compressed in RAM, decoded on the device; the
    sampler's output and a LoRA on top are those of the plain model, and the unpatched master stays unpatched."""
    lora_node = env["nodes"].LoraLoaderModelOnly()
    base = sample(env, plain_model(env))
    ref = sample(env, lora_node.load_lora_model_only(plain_model(env), LORA, 0.8)[0])
    off = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget", None, 0, "", "lossless")[0]
    assert torch.equal(base, sample(env, off))
    report = handle_of(off).report()
    assert all(b.compression != "none" and b.host_bytes < b.raw_bytes for b in report.blocks)
    assert torch.equal(ref, sample(env, lora_node.load_lora_model_only(off, LORA, 0.8)[0]))
    assert torch.equal(base, sample(env, off))
    with pytest.raises(ValueError, match="host_compression"):
        env["M"]["OffloadModel"]().apply(plain_model(env), "budget", None, 0, "", "zstd")


def test_lora_on_resident_units_matches(env):
    lora_node = env["nodes"].LoraLoaderModelOnly()
    ref = sample(env, lora_node.load_lora_model_only(plain_model(env), LORA, 1.0)[0])
    off = offload_model(env, "high_end")
    out = sample(env, lora_node.load_lora_model_only(off, LORA, 1.0)[0])
    assert torch.equal(ref, out)


def _hooked_sample(env, model, hooks, steps: int = 4) -> torch.Tensor:
    """Sampling with a weight hook on the positive conditioning only (CFG 2): every step switches the weights
    between the cond and uncond passes, as ComfyUI's scheduled LoRA does."""
    import comfy.hooks

    nodes = env["nodes"]
    g = torch.Generator().manual_seed(1)
    c = torch.randn(1, 8, 4096, generator=g) * 0.1
    cond = [[c, {}]] if hooks is None else comfy.hooks.set_hooks_for_conditioning([[c, {}]], hooks)
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        return nodes.common_ksampler(model, 3, steps, 2.0, "euler", "simple", cond, [[c.clone(), {}]], latent)[0][
            "samples"]


def _hook_lora(strength: float, keyframed: bool):
    import comfy.hooks
    import comfy.utils
    import folder_paths

    lora = comfy.utils.load_torch_file(folder_paths.get_full_path("loras", LORA), safe_load=True)
    hooks = comfy.hooks.create_hook_lora(lora, strength, 0.0)
    if keyframed:  # the strength changes mid-sampling: ComfyUI recomputes the hooked weights then
        kf = comfy.hooks.HookKeyframeGroup()
        kf.add(comfy.hooks.HookKeyframe(strength=1.0, start_percent=0.0))
        kf.add(comfy.hooks.HookKeyframe(strength=0.3, start_percent=0.5))
        hooks.set_keyframes_on_hooks(kf)
    return hooks


@pytest.mark.parametrize("preset", ["budget", "high_end"])
@pytest.mark.parametrize("keyframed", [False, True])
def test_weight_hooks_match_the_plain_model(env, preset, keyframed):
    """Scheduled LoRA (weight hooks) on an offloaded model, alone and over a LoRA loaded the usual way, gives the
    plain loader's result bitwise, and leaves the model's own weights unpatched for the next prompt."""
    import comfy.hooks

    def plain_min_vram(model):
        # The reference computes hooked weights afresh at every switch. The 0.12 fork's cached path (MaxSpeed, the
        # default) drops every hook backup when it restores some, so its hooked weights leak into the unhooked
        # passes; ComfyUI upstream and MinVram give the same, correct result.
        model.set_hook_mode(comfy.hooks.EnumHookMode.MinVram)
        return model

    lora_node = env["nodes"].LoraLoaderModelOnly()
    base = _hooked_sample(env, plain_model(env), None)
    ref = _hooked_sample(env, plain_min_vram(plain_model(env)), _hook_lora(0.8, keyframed))
    ref_both = _hooked_sample(env, plain_min_vram(lora_node.load_lora_model_only(plain_model(env), LORA, 0.5)[0]),
                              _hook_lora(0.8, keyframed))
    assert not torch.equal(ref, base), "the hook must change the output"
    off = offload_model(env, preset)
    assert torch.equal(_hooked_sample(env, off, _hook_lora(0.8, keyframed)), ref)
    assert torch.equal(_hooked_sample(env, off, None), base), "the hook's weights must not stay in the model"
    both = lora_node.load_lora_model_only(off, LORA, 0.5)[0]
    assert torch.equal(_hooked_sample(env, both, _hook_lora(0.8, keyframed)), ref_both)
    assert torch.equal(_hooked_sample(env, off, None), base)


# accounting -----------------------------------------------------------------------------------------------------
def test_accounting_through_load_models_gpu_and_free_memory(env):
    mm = env["mm"]
    model = offload_model(env, "budget")
    h = handle_of(model)
    mm.load_models_gpu([model])
    assert any(lm.model is model for lm in mm.current_loaded_models)
    loaded = model.loaded_size()
    assert loaded == h.device_bytes() > 0
    full = mm.module_size(model.model)
    assert loaded <= model.model_size() <= full
    assert model.model_size() < full, "preset budget must not claim the whole model"
    freed = model.partially_unload(model.offload_device, loaded // 2)
    assert freed >= loaded // 2
    assert model.loaded_size() == h.device_bytes() == loaded - freed
    mm.load_models_gpu([model])
    assert model.loaded_size() == h.device_bytes() > 0
    lm = next(lm for lm in mm.current_loaded_models if lm.model is model)
    lm.model_unload()  # ComfyUI's full unload: detach
    mm.current_loaded_models.remove(lm)
    assert h.device_bytes() == 0 and model.loaded_size() == 0
    ref = sample(env, plain_model(env))
    assert torch.equal(ref, sample(env, model)), "a model unloaded by ComfyUI must load again and match"


def test_free_memory_unloads_offloaded_model(env):
    mm = env["mm"]
    model = offload_model(env, "budget")
    mm.load_models_gpu([model])
    assert model.loaded_size() > 0
    dev = model.load_device
    mm.free_memory(1 << 60, dev)  # ask for everything: ComfyUI partially unloads or detaches
    assert model.loaded_size() == handle_of(model).device_bytes()
    assert model.loaded_size() == 0 or not any(lm.model is model for lm in mm.current_loaded_models)


# interrupt ------------------------------------------------------------------------------------------------------
def test_interrupt_mid_block_leaves_nothing_broken(env):
    mm = env["mm"]
    model = offload_model(env, "budget")
    ref = sample(env, plain_model(env))
    block = model.model.diffusion_model.blocks[2].cross_attn
    calls = {"n": 0}

    def interrupt(module, args):
        calls["n"] += 1
        if calls["n"] == 2:  # second step, in the middle of a streamed block
            raise interrupted_exception(mm)()

    hook = block.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(interrupted_exception(mm)):
            sample(env, model)
    finally:
        hook.remove()
        mm.interrupt_current_processing(False)
    assert torch.equal(ref, sample(env, model)), "the run after an interrupt must match a fresh one"
    fresh = offload_model(env, "budget")
    assert torch.equal(ref, sample(env, fresh))


def test_interrupt_flag_between_steps(env):
    mm = env["mm"]
    model = offload_model(env, "consumer")
    ref = sample(env, plain_model(env))

    def cb(step, x0, x, total):
        if step == 1:
            mm.interrupt_current_processing(True)
            mm.throw_exception_if_processing_interrupted()

    with pytest.raises(interrupted_exception(mm)):
        sample(env, model, callback=cb)
    mm.interrupt_current_processing(False)
    assert torch.equal(ref, sample(env, model))


# budget, report, any --------------------------------------------------------------------------------------------
def test_vram_budget_is_process_wide_and_persists(env):
    from importlib import import_module

    offload = import_module(env["pack"].__name__ + ".offload")
    node = env["M"]["OffloadVramBudget"]()
    spec = node.set_budget(3.0, "auto")[0]
    assert offload.default_budget().total_bytes == 3 << 30
    model = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget", spec, 5)[0]
    h = handle_of(model)
    assert h.budget is offload.default_budget() and h.priority == 5
    assert offload.default_budget().total_bytes == 3 << 30  # still in force after other nodes ran
    spec2 = node.set_budget(0.0, "consumer")[0]
    assert offload.default_budget().total_bytes == spec2.total_bytes > 0
    with pytest.raises(ValueError):
        node.set_budget(-1.0, "auto")
    with pytest.raises(ValueError, match="larger than the device"):
        node.set_budget(1000.0, "auto")
    node.set_budget(4.0, "auto")


def test_report_describes_streamed_blocks(env):
    model = offload_model(env, "budget")
    latent = sample(env, model)
    out = env["M"]["OffloadReport"]().report({"samples": latent}, model)
    data = json.loads(out["result"][0])
    assert out["ui"]["text"] and "streamed" in out["ui"]["text"][0]
    assert len(data["models"]) == 1
    m = data["models"][0]
    assert m["device"] == "sim" and m["preset"] == "budget" and m["priority"] == 0
    assert m["streamed_blocks"] == 4 and m["resident_bytes"] > 0 and m["streamed_bytes"] > 0
    assert m["total_bytes_streamed"] > 0 and m["forwards"] >= 3
    for key in ("overlap_ratio", "effective_gbps"):
        assert key in m
    for b in m["blocks"]:
        for key in ("name", "tier", "bytes", "h2d_ms", "compute_ms", "stall_ms"):
            assert key in b
        assert b["tier"] in ("pinned", "pageable", "disk")
    everything = json.loads(env["M"]["OffloadReport"]().report(None)["result"][0])
    assert len(everything["models"]) >= 1 and "budget" in everything


def test_offload_any_finds_modules_inside_objects(env):
    class TTSBundle:
        def __init__(self):
            self.config = {"sr": 24000}
            self.model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
                                               for _ in range(4)])
            self.extras = {"vocoder": torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))}

    torch.manual_seed(0)
    obj = TTSBundle()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = obj.model(x)
        ref_v = obj.extras["vocoder"](x)
    out = env["M"]["OffloadAny"]().apply(obj, "budget")[0]
    assert out is obj
    assert "_layer_offload" in obj.model.__dict__ and "_layer_offload" in obj.extras["vocoder"].__dict__
    with torch.no_grad():
        assert torch.equal(ref, obj.model(x))
        assert torch.equal(ref_v, obj.extras["vocoder"](x))
    same = env["M"]["OffloadAny"]().apply("just a string", "budget")[0]
    assert same == "just a string"


def test_offload_any_routes_model_patchers(env):
    plain = plain_model(env)
    ref = sample(env, plain)
    out = env["M"]["OffloadAny"]().apply(plain, "budget")[0]
    from comfy.model_patcher import ModelPatcher

    assert isinstance(out, ModelPatcher) and out is not plain
    assert torch.equal(ref, sample(env, out))


def test_offload_patcher_is_built_never_retyped(env):
    """The offload class is a plain subclass of the patcher class it wraps; instances come from construction (our
    clone) or from a base clone's state moved into a new instance: nothing assigns __class__ (ComfyUI 0.12's
    ModelPatcher has typing.Protocol bases and refuses that)."""
    from importlib import import_module

    from comfy.model_patcher import ModelPatcher

    cp = import_module(env["pack"].__name__ + ".nodes.comfy_patcher")
    plain = plain_model(env)
    n = cp.as_offload_patcher(plain)
    assert type(n) is cp.OffloadModelPatcher and n.model is plain.model and type(plain) is ModelPatcher
    assert type(n.clone()) is cp.OffloadModelPatcher and cp.OffloadModelPatcher.__bases__ == (ModelPatcher,)
    assert not n.is_dynamic() and cp.is_offload_patcher(n) and not cp.is_offload_patcher(plain)

    class OtherPackPatcher(ModelPatcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    src = OtherPackPatcher(plain.model, plain.load_device, plain.offload_device)
    mixed = cp.as_offload_patcher(src)
    assert isinstance(mixed, OtherPackPatcher) and cp.is_offload_patcher(mixed)
    assert type(mixed).__bases__ == (OtherPackPatcher,) and cp.offload_class_for(OtherPackPatcher) is type(mixed)


def test_loader_under_inference_mode_like_the_server(env):
    with torch.inference_mode():
        plain = plain_model(env)
        off = offload_model(env, "budget")
    ref = sample(env, plain)
    assert torch.equal(ref, sample(env, off))


def test_dropped_model_is_released_from_the_budget(env):
    import gc

    model = offload_model(env, "budget")
    h = handle_of(model)
    sample(env, model)
    budget = h.budget
    assert h in budget.members
    root = model.model.diffusion_model
    root_model_holder = [model.model]
    clone = model.clone()
    del model
    gc.collect()
    assert h in budget.members, "a live clone must keep the model offloaded"
    del clone
    gc.collect()
    assert h not in budget.members, "the last patcher gone: the handle must leave the budget"
    assert "_layer_offload" not in root.__dict__
    assert not root.blocks[0].self_attn.q.comfy_cast_weights, "ComfyUI's own cast flag is restored"
    ref = sample(env, plain_model(env))
    from comfy.model_patcher import ModelPatcher

    plain_again = ModelPatcher(root_model_holder[0], torch.device("cpu"), torch.device("cpu"))
    assert torch.equal(ref, sample(env, plain_again)), "the released model works as an ordinary model"


def test_dynamic_patchers_become_plain_offload_patchers(env):
    from importlib import import_module

    from comfy.model_patcher import ModelPatcher

    cp = import_module(env["pack"].__name__ + ".nodes.comfy_patcher")
    plain = plain_model(env)
    ref = sample(env, plain)

    class FakeDynamic(ModelPatcher):  # what DynamicVRAM's ModelPatcherDynamic looks like from outside
        def is_dynamic(self):
            return True

    dyn = FakeDynamic(plain.model, plain.load_device, plain.offload_device)
    out = env["M"]["OffloadModel"]().apply(dyn, "budget")[0]
    assert type(out) is cp.OffloadModelPatcher and not out.is_dynamic()
    assert torch.equal(ref, sample(env, out))


TINY_CLIP_CONFIG = {"architectures": ["CLIPTextModel"], "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0,
                    "eos_token_id": 49407, "hidden_act": "quick_gelu", "hidden_size": 64, "initializer_factor": 1.0,
                    "initializer_range": 0.02, "intermediate_size": 128, "layer_norm_eps": 1e-05,
                    "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 2,
                    "num_hidden_layers": 4, "pad_token_id": 1, "projection_dim": 64, "torch_dtype": "float32",
                    "vocab_size": 49408}


def tiny_clip():
    """A ComfyUI CLIP object around a 4-layer, width-64 CLIP-L-shaped text encoder with seeded weights."""
    import comfy.sd
    import comfy.sd1_clip

    class Target:
        params = {}
        tokenizer = comfy.sd1_clip.SD1Tokenizer

        @staticmethod
        def clip(**kw):
            return comfy.sd1_clip.SD1ClipModel(clip_model=comfy.sd1_clip.SDClipModel,
                                               textmodel_json_config=TINY_CLIP_CONFIG, **kw)

    clip = comfy.sd.CLIP(target=Target())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in clip.cond_stage_model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return clip


def test_offload_clip_encodes_bitwise_like_the_plain_clip(env):
    clip = tiny_clip()
    with torch.inference_mode():
        ref, ref_pooled = clip.encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
        off = env["M"]["OffloadCLIP"]().apply(clip, "budget")[0]
        out, pooled = off.encode_from_tokens(off.tokenize("a photo of a cat"), return_pooled=True)
        again, _ = off.encode_from_tokens(off.tokenize("a photo of a cat"), return_pooled=True)
    assert off is not clip
    assert torch.equal(ref, out) and torch.equal(ref_pooled, pooled) and torch.equal(ref, again)
    st = off.patcher.model.__dict__["_layer_offload"]
    assert st.kind == "clip" and sum(1 for b in st.handle.report().blocks if b.tier != "vram") == 4
    data = json.loads(env["M"]["OffloadReport"]().report(None, None)["result"][0])
    assert any(m["kind"] == "clip" and m["streamed_blocks"] == 4 for m in data["models"])


def _clip_hook_lora(clip, strength: float):
    """A hook LoRA on every 2-D weight of the tiny CLIP, in the names ComfyUI maps for text encoders."""
    import comfy.hooks
    import comfy.lora

    g = torch.Generator().manual_seed(5)
    sd = {}
    state = clip.cond_stage_model.state_dict()
    for lora_name, key in comfy.lora.model_lora_keys_clip(clip.cond_stage_model).items():
        weight = state.get(key) if isinstance(key, str) else None
        if weight is None or weight.ndim != 2 or not lora_name.startswith("lora_te"):
            continue
        sd[lora_name + ".lora_up.weight"] = torch.randn(weight.shape[0], 4, generator=g) * 0.5
        sd[lora_name + ".lora_down.weight"] = torch.randn(4, weight.shape[1], generator=g) / weight.shape[1] ** 0.5
        sd[lora_name + ".alpha"] = torch.tensor(4.0)
    assert sd, "no CLIP weight to hook"
    return comfy.hooks.create_hook_lora(sd, 0.0, strength)


def _set_clip_hooks(clip, hooks):
    """What the *Set CLIP Hooks* node does (not scheduled)."""
    import comfy.hooks

    clip = clip.clone()
    clip.patcher.forced_hooks = hooks.clone()
    clip.use_clip_schedule = False
    clip.patcher.forced_hooks.set_keyframes_on_hooks(None)
    clip.patcher.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Clip))
    return clip


def test_clip_weight_hooks_match_the_plain_clip(env):
    """*Set CLIP Hooks* on an offloaded CLIP encodes like the plain CLIP with the same hooks, and the offloaded CLIP
    without them still encodes like the plain one."""
    tokens = "a photo of a cat"
    plain = tiny_clip()
    with torch.inference_mode():
        base = plain.encode_from_tokens(plain.tokenize(tokens))
        hooked = _set_clip_hooks(plain, _clip_hook_lora(plain, 0.8))
        ref = hooked.encode_from_tokens(hooked.tokenize(tokens))
        assert not torch.equal(ref, base), "the hook must change the encoding"
        off = env["M"]["OffloadCLIP"]().apply(tiny_clip(), "budget")[0]
        off_hooked = _set_clip_hooks(off, _clip_hook_lora(off, 0.8))
        assert torch.equal(off_hooked.encode_from_tokens(off_hooked.tokenize(tokens)), ref)
        assert torch.equal(off.encode_from_tokens(off.tokenize(tokens)), base)
        assert torch.equal(off_hooked.encode_from_tokens(off_hooked.tokenize(tokens)), ref)


def test_offload_any_routes_clip(env):
    clip = tiny_clip()
    with torch.inference_mode():
        ref = clip.encode_from_tokens(clip.tokenize("hello"))
        out = env["M"]["OffloadAny"]().apply(clip, "consumer")[0]
        got = out.encode_from_tokens(out.tokenize("hello"))
    assert torch.equal(ref, got)


def test_offload_checkpoint_loader(env):
    ref = sample(env, plain_model(env))
    model, clip, vae = env["M"]["OffloadCheckpointLoader"]().load(CKPT, "budget")
    assert clip is None  # the tiny checkpoint holds no text encoder
    assert "_layer_offload" in model.model.diffusion_model.__dict__
    assert torch.equal(ref, sample(env, model))


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_fp8_weights_with_and_without_lora_match(env, weight_dtype):
    nodes = env["nodes"]
    lora_node = nodes.LoraLoaderModelOnly()
    plain = nodes.UNETLoader().load_unet(UNET, weight_dtype)[0]
    off = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, weight_dtype, "budget")[0]
    assert torch.equal(sample(env, plain), sample(env, off))
    ref = sample(env, lora_node.load_lora_model_only(plain, LORA, 0.7)[0])
    assert torch.equal(ref, sample(env, lora_node.load_lora_model_only(off, LORA, 0.7)[0]))


def test_two_models_share_a_small_budget_by_priority(env):
    import gc
    from importlib import import_module

    offload = import_module(env["pack"].__name__ + ".offload")
    mm = env["mm"]
    gc.collect()  # models of earlier tests leave the budget with their last patcher
    budget_node = env["M"]["OffloadVramBudget"]()
    try:
        spec = budget_node.set_budget(0.01, "auto")[0]  # ~10 MB: less than both models fully resident
        hi = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "high_end", spec, 10)[0]
        lo = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "high_end", spec, 0)[0]
        ref = sample(env, plain_model(env))
        assert torch.equal(ref, sample(env, hi)) and torch.equal(ref, sample(env, lo))
        mm.load_models_gpu([hi, lo])
        budget = offload.default_budget()
        assert budget.used_bytes <= budget.total_bytes == spec.total_bytes
        assert 0 < hi.loaded_size() + lo.loaded_size() <= budget.used_bytes
        assert hi.loaded_size() >= lo.loaded_size(), "the higher priority model keeps more resident"
        data = json.loads(env["M"]["OffloadReport"]().report(None)["result"][0])
        prios = sorted(m["priority"] for m in data["models"] if m["name"] == UNET)
        assert prios[-2:] == [0, 10] or prios == [0, 10]
    finally:
        budget_node.set_budget(4.0, "auto")


def test_other_packs_patcher_subclass_keeps_its_class_and_works(env):
    """GGUF-style patchers re-type their clones themselves; the offload mix-in must survive that."""
    from importlib import import_module

    from comfy.model_patcher import ModelPatcher

    cp = import_module(env["pack"].__name__ + ".nodes.comfy_patcher")

    class GGUFLikePatcher(ModelPatcher):
        def clone(self, *args, **kwargs):
            src_cls = self.__class__
            self.__class__ = GGUFLikePatcher
            n = super().clone(*args, **kwargs)
            n.__class__ = GGUFLikePatcher
            self.__class__ = src_cls
            return n

    plain = plain_model(env)
    ref = sample(env, plain)
    src = GGUFLikePatcher(plain.model, plain.load_device, plain.offload_device)
    out = env["M"]["OffloadModel"]().apply(src, "budget")[0]
    assert isinstance(out, GGUFLikePatcher) and cp.is_offload_patcher(out)
    again = out.clone()
    assert type(again) is type(out)
    assert torch.equal(ref, sample(env, out)) and torch.equal(ref, sample(env, again))
    lora = env["nodes"].LoraLoaderModelOnly().load_lora_model_only(out, LORA, 0.5)[0]
    assert type(lora) is type(out)
    ref_lora = sample(env, env["nodes"].LoraLoaderModelOnly().load_lora_model_only(plain_model(env), LORA, 0.5)[0])
    assert torch.equal(ref_lora, sample(env, lora))


def test_model_setup_drives_a_comfy_progress_bar(env):
    import comfy.utils

    if not hasattr(comfy.utils, "set_progress_bar_global_hook"):
        pytest.skip("this ComfyUI sends progress through its execution context, not a global hook")
    calls = []
    previous = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview=None, node_id=None: calls.append((value,
                                                                                                           total)))
    try:
        offload_model(env, "budget")
    finally:
        comfy.utils.set_progress_bar_global_hook(previous)
    assert len(calls) >= 2, calls
    assert calls[-1][0] == calls[-1][1] > 0
