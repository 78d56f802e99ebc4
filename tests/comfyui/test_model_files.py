"""Models from ComfyUI's own loaders get the RAM features (issue 42): Offload Model after Load Diffusion Model
(UNETLoader) and Offload CLIP after Load CLIP / DualCLIPLoader learn the file the loader read (nodes/model_files.py),
so their blocks have a disk tier, and RAM is given back whenever ComfyUI asks for it, through ComfyUI's own functions
where this ComfyUI has them: `free_pins` and `ensure_pin_budget` (0.33), the RAM-pressure cache's `poll` (0.12),
the patcher's `partially_unload_ram`. Outputs are bitwise equal to the plain loader's before and after (LoRA before
and after the offload node, mixed plans). A model no loader recorded is matched to its file by header and bytes;
where no file is found, the report says why. Two live models of one file share the host copy and free it together.
Skipped without COMFYUI_PATH.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import os
from typing import Any, Callable, Dict

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import psutil  # noqa: E402
import torch  # noqa: E402

import tiny_wan  # noqa: E402

UNET, OTHER, LORA = "lo42_wan.safetensors", "lo42_wan_other.safetensors", "lo42_lora.safetensors"
BLOCKS = 8
LAYERS = 8  # text encoder layers
GIB = 1 << 30


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import comfy.model_management as mm
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("lo42_models"))
    # float32: what ComfyUI computes in on the CPU, so the file holds the bytes the model holds
    tiny_wan.write_wan(os.path.join(d, UNET), seed=0, dtype=torch.float32, num_blocks=BLOCKS)
    tiny_wan.write_wan(os.path.join(d, OTHER), seed=5, dtype=torch.float32, num_blocks=BLOCKS)  # same names, shapes
    tiny_wan.write_lora(os.path.join(d, LORA))
    for kind in ("diffusion_models", "loras", "text_encoders"):
        folder_paths.add_model_folder_path(kind, d)
    mod = lambda name: importlib.import_module(pack.__name__ + "." + name)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    e = {"pack": pack, "mm": mm, "nodes": nodes, "M": node_classes(pack), "dir": d, "files": mod("nodes.model_files"),
         "hm": mod("nodes.host_memory"), "VramBudget": mod("offload").VramBudget, "refs": {}}
    try:
        yield e
    finally:
        torch.set_num_threads(threads)
        gc.collect()


def sample(env, model, seed=3):
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        return env["nodes"].common_ksampler(model, seed, 3, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]


def unet(env, name=UNET):
    with torch.inference_mode():
        return env["nodes"].UNETLoader().load_unet(name, "default")[0]


def with_lora(env, model):
    with torch.inference_mode():
        return env["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, LORA, 0.8)[0]


def ref(env, lora=False):
    """The plain loader's result (cached)."""
    if lora not in env["refs"]:
        env["refs"][lora] = sample(env, with_lora(env, unet(env)) if lora else unet(env))
    return env["refs"][lora]


def managed(patcher):
    model = patcher.patcher.model if hasattr(patcher, "cond_stage_model") else patcher.model
    root = getattr(model, "diffusion_model", model)
    return root.__dict__["_layer_offload"]


# how this ComfyUI asks for RAM ------------------------------------------------------------------------------------
def ram_pressure_cache():
    """ComfyUI 0.12's RAMPressureCache, whose poll(ram_headroom) evicts by RAM, or None."""
    try:
        import comfy_execution.caching as caching
    except ImportError:
        return None
    cls = getattr(caching, "RAMPressureCache", None)
    return cls if cls is not None and "poll" in cls.__dict__ else None


def asks(env) -> Dict[str, Callable[[Any, int], Any]]:
    """The ways this ComfyUI asks for `n` bytes of RAM, each through ComfyUI's own function (the patcher: the model
    ComfyUI's memory manager would ask)."""
    mm = env["mm"]
    out: Dict[str, Callable[[Any, int], Any]] = {}
    if callable(getattr(mm, "free_pins", None)):
        out["free_pins"] = lambda patcher, n: mm.free_pins(n)  # what execution's RAM-pressure cache calls (0.33)
    if callable(getattr(mm, "ensure_pin_budget", None)):  # before a load: short of `size` + headroom in RAM
        out["ensure_pin_budget"] = lambda patcher, n: mm.ensure_pin_budget(psutil.virtual_memory().available + n)
    cache = ram_pressure_cache()
    if cache is not None:
        from comfy_execution.caching import CacheKeySetInputSignature

        out["ram_pressure_cache"] = lambda patcher, n: cache(CacheKeySetInputSignature).poll(
            ram_headroom=(psutil.virtual_memory().available + n) / GIB)
    out["partially_unload_ram"] = lambda patcher, n: patcher.partially_unload_ram(n)
    return out


ASKS = ["free_pins", "ensure_pin_budget", "ram_pressure_cache", "partially_unload_ram"]


def ask(env, name, patcher, n=1 << 40):
    fn = asks(env).get(name)
    if fn is None:
        pytest.skip("this ComfyUI has no {} (it never asks for RAM that way)".format(name))
    fn(patcher, n)


def tiers(patcher):
    return [b.tier for b in managed(patcher).handle.report().blocks]


# Offload Model after Load Diffusion Model -------------------------------------------------------------------------
@pytest.mark.parametrize("way", ASKS)
def test_offload_model_after_unetloader_gives_ram_back_and_stays_bitwise(env, way):
    """The file UNETLoader read is the disk tier's; RAM asked for moves blocks to it; LoRA before and after the node
    give the plain loader's results before and after."""
    path = os.path.join(env["dir"], UNET)
    lora_first = env["M"]["OffloadModel"]().apply(with_lora(env, unet(env)), "budget")[0]
    off = env["M"]["OffloadModel"]().apply(unet(env), "budget")[0]
    lora_after = with_lora(env, off)
    st = managed(off)
    assert st.config.disk_path == path and managed(lora_first).config.disk_path == path
    assert torch.equal(sample(env, lora_first), ref(env, True))
    assert torch.equal(sample(env, off), ref(env))
    assert torch.equal(sample(env, lora_after), ref(env, True))
    before = st.handle.host_memory()
    ask(env, way, off)
    after = st.handle.host_memory()
    assert after["disk"] > 0 and after["blocks_raw"] < before["blocks_raw"], (way, before, after)
    assert "disk" in tiers(off)
    for model, lora in ((off, False), (lora_after, True), (lora_first, True)):
        assert torch.equal(sample(env, model), ref(env, lora)), "the run after giving RAM back differs"
    if way != "partially_unload_ram":  # ComfyUI asks that of one model; the others it asks of every one
        assert "disk" in tiers(lora_first), "every live model of the workflow is asked"


def test_mixed_plan_gives_ram_back_bitwise(env):
    """A budget that keeps some blocks on the device and streams the rest: after RAM is given back every block's host
    master is the file (resident ones read it when they are evicted), and results stay bitwise."""
    probe = env["M"]["OffloadModel"]().apply(unet(env), "auto", env["VramBudget"](1 << 30))[0]
    full, block = managed(probe).handle.want_bytes(), max(managed(probe).handle.unit_bytes().values())
    del probe
    gc.collect()
    budget = env["VramBudget"](full - 3 * block)  # all but a few blocks resident
    off = env["M"]["OffloadModel"]().apply(unet(env), "auto", budget)[0]
    assert torch.equal(sample(env, off), ref(env))
    kinds = set(tiers(off))
    assert "vram" in kinds and kinds & {"pinned", "pageable"}, kinds
    env["hm"].release_engine_ram(1 << 40)
    assert managed(off).handle.host_memory()["disk"] > 0
    assert torch.equal(sample(env, off), ref(env))
    assert torch.equal(sample(env, with_lora(env, off)), ref(env, True))
    managed(off).handle.unload()  # resident blocks go back to their host masters, the file now
    assert torch.equal(sample(env, off), ref(env))


def test_two_live_models_of_one_file_share_the_host_copy_and_free_it_together(env):
    """Two loader nodes of one file (or a cached earlier output beside a new one): the second maps the first one's
    host copy; asked for RAM, both move their blocks to disk and the copy's pages go."""
    a = env["M"]["OffloadModel"]().apply(unet(env), "budget")[0]
    b = env["M"]["OffloadModel"]().apply(unet(env), "budget")[0]
    ha, hb = managed(a).handle, managed(b).handle
    if not hb.host_memory()["shared"]:
        pytest.skip("no shared host copy here (needs Linux's /dev/shm with room)")
    segment = managed(a).handle.streamer.staged.shared.path
    held = os.stat(segment).st_blocks * 512
    assert torch.equal(sample(env, a), ref(env)) and torch.equal(sample(env, b), ref(env))
    ways = asks(env)
    way = next((w for w in ASKS if w in ways and w != "partially_unload_ram"), None)
    if way is not None:
        ask(env, way, a)
    else:  # a ComfyUI without a RAM-pressure path of its own: each model asked, as 0.12's free_memory asks them
        a.partially_unload_ram(1 << 40)
        b.partially_unload_ram(1 << 40)
    assert ha.host_memory()["shared"] == 0 and hb.host_memory()["shared"] == 0
    assert set(tiers(a)) == {"disk"} and set(tiers(b)) == {"disk"}
    assert os.stat(segment).st_blocks * 512 <= held - managed(a).handle.host_memory()["disk"], "the copy's pages"
    assert torch.equal(sample(env, a), ref(env)) and torch.equal(sample(env, b), ref(env))


def test_offload_loader_gives_ram_back_the_way_comfyui_asks(env):
    off = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "budget")[0]
    assert torch.equal(sample(env, off), ref(env))
    way = next(w for w in ASKS if w in asks(env))
    ask(env, way, off)
    assert managed(off).handle.host_memory()["disk"] > 0, way
    assert torch.equal(sample(env, off), ref(env))


def test_offload_model_after_a_checkpoint_loader_streams_from_the_checkpoint(env):
    import folder_paths

    name = "lo42_ckpt.safetensors"
    path = os.path.join(env["dir"], name)
    sd = {"model.diffusion_model." + k: v for k, v in
          tiny_wan.make_wan_state_dict(seed=0, dtype=torch.float32, num_blocks=BLOCKS).items()}
    from safetensors.torch import save_file

    save_file(sd, path)
    folder_paths.add_model_folder_path("checkpoints", env["dir"])
    with torch.inference_mode():
        model = env["nodes"].CheckpointLoaderSimple().load_checkpoint(name)[0]
    off = env["M"]["OffloadModel"]().apply(model, "budget")[0]
    assert managed(off).config.disk_path == path
    env["hm"].release_engine_ram(1 << 40)
    assert "disk" in tiers(off)
    assert torch.equal(sample(env, off), ref(env))


def test_offload_any_finds_the_file_of_a_bare_module(env):
    """Offload Any on another pack's object holding a bare module: the module carries no record, its file is matched
    among ComfyUI's model folders."""
    plain = unet(env)
    holder = {"net": plain.model.diffusion_model}
    env["M"]["OffloadAny"]().apply(holder, "budget")
    st = holder["net"].__dict__["_layer_offload"]
    assert st.config.disk_path == os.path.join(env["dir"], UNET)
    env["hm"].release_engine_ram(1 << 40)
    assert "disk" in [b.tier for b in st.handle.report().blocks]
    assert torch.equal(sample(env, plain), ref(env))


# a model no loader recorded ---------------------------------------------------------------------------------------
def test_a_model_no_loader_recorded_is_matched_to_its_file(env):
    """A pack that reads the file its own way: the file is found among ComfyUI's model folders by names, shapes and
    bytes (the other file with the same names and shapes holds other values and is passed over)."""
    import comfy.sd
    from safetensors.torch import load_file

    sd = load_file(os.path.join(env["dir"], UNET))  # not through comfy.utils.load_torch_file
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(sd)
    assert env["files"].FILES_ATTR not in model.model.__dict__
    found = env["files"].find_file(model.model, model.model.diffusion_model, "model")
    assert (found.path, found.how) == (os.path.join(env["dir"], UNET), "matched"), found
    off = env["M"]["OffloadModel"]().apply(model, "budget")[0]
    assert managed(off).config.disk_path == found.path
    env["hm"].release_engine_ram(1 << 40)
    assert "disk" in tiers(off)
    assert torch.equal(sample(env, off), ref(env))


def test_where_no_file_is_found_the_report_says_why(env):
    import comfy.sd

    sd = tiny_wan.make_wan_state_dict(seed=11, dtype=torch.float32, num_blocks=BLOCKS)  # in no file
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(sd)
    off = env["M"]["OffloadModel"]().apply(model, "budget")[0]
    notices = {n["kind"]: n["message"] for n in managed(off).handle.report().notices}
    assert managed(off).config.disk_path is None
    assert "no file among" in notices.get("disk_file", ""), notices
    ckpt = os.path.join(env["dir"], "lo42_old.ckpt")  # a pickled checkpoint: not a format the disk tier reads
    torch.save(tiny_wan.make_wan_state_dict(seed=12, dtype=torch.float32, num_blocks=BLOCKS), ckpt)
    with torch.inference_mode():
        old = comfy.sd.load_diffusion_model(ckpt)
    assert old.model.__dict__[env["files"].FILES_ATTR] == (ckpt,)
    off = env["M"]["OffloadModel"]().apply(old, "budget")[0]
    notices = {n["kind"]: n["message"] for n in managed(off).handle.report().notices}
    assert managed(off).config.disk_path is None
    assert ".ckpt file" in notices.get("disk_file", ""), notices


def gguf_file(env) -> str:
    """A Q8_0 GGUF file of the tiny Wan with BLOCKS blocks (enough that the disk tier pays for its bounce buffers)."""
    from families import gguf_wan
    from families.common import make_state_dict
    from families.wan import WAN21, wan_shapes

    name = "lo42_wan{}_q8_0.gguf".format(BLOCKS)
    path = os.path.join(env["dir"], name)
    if not os.path.exists(path):
        gguf_wan.write_gguf(make_state_dict(wan_shapes(num_blocks=BLOCKS), WAN21.seed, WAN21.dtype), path, main="Q8_0")
    return name


@pytest.mark.parametrize("way", ASKS)
@pytest.mark.parametrize("which", ["builtin", "ComfyUI-GGUF"])
def test_a_gguf_loaders_model_streams_from_its_gguf_file(env, which, way):
    """A GGUF loader's model (city96's ComfyUI-GGUF, a fork's built-in comfy.gguf): its weights still view the .gguf
    file (memory-mapped), which names it; Offload Model streams from it once ComfyUI asks for RAM (each way this
    ComfyUI asks), bitwise before and after, with a LoRA after the node too."""
    import test_families as families
    from families.wan import WAN21

    fenv = families.Env(env["pack"], env["dir"])
    load, tensor_cls = families.gguf_loader(fenv, which)
    name = gguf_file(env)

    def fresh():
        with torch.inference_mode():
            return load(name)

    want = families.sample(fenv, WAN21, [fresh()])
    want_lora = families.sample(fenv, WAN21, families.with_lora(fenv, WAN21, [fresh()]))  # its own model (see
    env["mm"].unload_all_models()  # test_families: a plain LoRA branch bakes F16 weights while its model is loaded)
    assert not torch.equal(want_lora, want), "the LoRA must change the result"
    with torch.inference_mode():  # as ComfyUI runs every node
        off = env["M"]["OffloadModel"]().apply(fresh(), "budget")[0]
    st = managed(off)
    assert st.config.disk_path == os.path.join(env["dir"], name), st.handle.report().notices
    assert torch.equal(families.sample(fenv, WAN21, [off]), want)
    before = st.handle.host_memory()
    ask(env, way, off)
    after = st.handle.host_memory()
    assert after["disk"] > 0 and after["blocks_raw"] < before["blocks_raw"], (way, before, after)
    assert "disk" in tiers(off), st.handle.report().notices
    assert isinstance(off.model.diffusion_model.blocks[-1].self_attn.q.weight, tensor_cls)
    assert torch.equal(families.sample(fenv, WAN21, [off]), want), "the run after giving RAM back differs"
    assert torch.equal(families.sample(fenv, WAN21, families.with_lora(fenv, WAN21, [off])), want_lora)


def test_the_offload_loader_streams_a_gguf_file_from_it(env):
    """Where ComfyUI's own loader reads GGUF files (a fork's built-in comfy.gguf), the Offload Loader does too, with
    the .gguf file as its disk tier: RAM asked for moves blocks to it, bitwise."""
    import test_families as families
    from families.wan import WAN21

    fenv = families.Env(env["pack"], env["dir"])
    load, tensor_cls = families.gguf_loader(fenv, "builtin")
    name = gguf_file(env)
    with torch.inference_mode():
        want = families.sample(fenv, WAN21, [load(name)])
        off = env["M"]["OffloadDiffusionModelLoader"]().load(name, "default", "budget")[0]
    st = managed(off)
    assert st.config.disk_path == os.path.join(env["dir"], name)
    assert isinstance(off.model.diffusion_model.blocks[-1].self_attn.q.weight, tensor_cls)
    assert torch.equal(families.sample(fenv, WAN21, [off]), want)
    way = next(w for w in ASKS if w in asks(env))
    ask(env, way, off)
    assert st.handle.host_memory()["disk"] > 0 and "disk" in tiers(off), (way, st.handle.report().notices)
    assert torch.equal(families.sample(fenv, WAN21, [off]), want)


# Offload CLIP after Load CLIP -------------------------------------------------------------------------------------
def clip_files(env, te_name):
    """The tiny text encoder's files as Load CLIP reads them (one per encoder, HF key layout, its own dtypes)."""
    from safetensors.torch import save_file
    from test_families import build_text_encoder

    import families.text_encoders

    te = families.text_encoders.TEXT_ENCODERS[te_name]
    # more layers than the family tests use: the disk tier pays for its bounce buffers only with several blocks
    opts = {k: dict(v, **{"num_hidden_layers" if k.startswith("clip") else "num_layers": LAYERS})
            for k, v in te.model_options.items()}
    te = dataclasses.replace(te, model_options=opts)
    clip = build_text_encoder(te)
    paths = []
    for part in ("clip_l", "t5xxl"):
        encoder = getattr(clip.cond_stage_model, part, None)
        if encoder is None:
            continue
        path = os.path.join(env["dir"], "lo42_{}_{}.safetensors".format(te_name, part))
        save_file({k: v.detach().clone().contiguous() for k, v in encoder.transformer.state_dict().items()}, path)
        paths.append(path)
    return te, paths


def load_clip(te, paths, clip_type):
    """comfy.sd.load_clip as Load CLIP / DualCLIPLoader call it, with the tiny widths in model_options (CLIP-L's
    under "model_config" too: ComfyUI sizes CLIP-L from that one when it reads the position embeddings)."""
    import comfy.sd

    opts = dict(te.model_options)
    if "clip_l_model_config" in opts:
        opts["model_config"] = dict(opts["clip_l_model_config"])
    with torch.inference_mode():
        return comfy.sd.load_clip(ckpt_paths=paths, clip_type=clip_type, model_options=opts)


@pytest.mark.parametrize("way", ASKS)
def test_offload_clip_after_load_clip_gives_ram_back(env, way):
    import comfy.sd
    from test_families import PROMPT, assert_encodes_equal, encode, te_lora

    te, paths = clip_files(env, "sd1_clip_l")
    base = encode(load_clip(te, paths, comfy.sd.CLIPType.STABLE_DIFFUSION), PROMPT)
    lsd = te_lora(te, load_clip(te, paths, comfy.sd.CLIPType.STABLE_DIFFUSION))
    with_l = comfy.sd.load_lora_for_models(None, load_clip(te, paths, comfy.sd.CLIPType.STABLE_DIFFUSION), lsd,
                                           0.0, 0.8)[1]
    lora_ref = encode(with_l, PROMPT)
    off = env["M"]["OffloadCLIP"]().apply(load_clip(te, paths, comfy.sd.CLIPType.STABLE_DIFFUSION), "budget")[0]
    assert managed(off).config.disk_path == paths[0]
    assert_encodes_equal(base, off, PROMPT)
    before = managed(off).handle.host_memory()
    ask(env, way, off.patcher)
    after = managed(off).handle.host_memory()
    assert after["disk"] > 0 and after["blocks_raw"] < before["blocks_raw"], (before, after)
    assert_encodes_equal(base, off, PROMPT)
    assert_encodes_equal(lora_ref, comfy.sd.load_lora_for_models(None, off, lsd, 0.0, 0.8)[1], PROMPT)


def test_dual_clip_streams_the_larger_file_and_says_so(env):
    """DualCLIPLoader (Flux: CLIP-L + T5): the disk tier reads one file per model, the one holding most of its bytes
    (T5); CLIP-L's blocks stay in RAM and the report names its file."""
    import comfy.sd

    from test_families import PROMPT, assert_encodes_equal, encode

    te, paths = clip_files(env, "flux_clip_l_t5")
    if len(paths) != 2 or not hasattr(comfy.sd.CLIPType, "FLUX"):
        pytest.skip("this ComfyUI has no Flux dual text encoder")
    base = encode(load_clip(te, paths, comfy.sd.CLIPType.FLUX), PROMPT)
    off = env["M"]["OffloadCLIP"]().apply(load_clip(te, paths, comfy.sd.CLIPType.FLUX), "budget")[0]
    st = managed(off)
    assert st.config.disk_path == paths[1], "T5 holds most of the bytes"
    notices = {n["kind"]: n["message"] for n in st.handle.report().notices}
    assert paths[0] in notices.get("disk_file", ""), notices
    env["hm"].release_engine_ram(1 << 40)
    names = [b.name for b in st.handle.report().blocks]
    on_disk = [n for n, t in zip(names, tiers(off)) if t == "disk"]
    assert on_disk and all(n.startswith("t5xxl.") for n in on_disk), list(zip(names, tiers(off)))
    assert_encodes_equal(base, off, PROMPT)

