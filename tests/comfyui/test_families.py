"""Every model family users run (issue 10): the pack's loaders against ComfyUI's plain loaders, bitwise.

Tiny checkpoints in ComfyUI's key layout (tests/comfyui/families) are written to a temp folder, loaded with ComfyUI's
own nodes (UNETLoader / CheckpointLoaderSimple / LoraLoaderModelOnly / KSampler(Advanced)) and with the pack's, under
a preset that streams every block ("budget") and one that keeps blocks resident ("high_end"), and sampled; the
latents must be equal bit for bit, with and without a LoRA. Text encoders go through Offload CLIP (conditioning
bitwise equal), GGUF models through Offload Model where a GGUF loader is importable.

Families ComfyUI cannot build at a tiny width, and features a ComfyUI version lacks, skip with the reason (feature
detection, never version checks). Skipped unless COMFYUI_PATH points at a ComfyUI checkout.
"""
from __future__ import annotations

import gc
import importlib
import importlib.util
import os
from typing import Any, Dict, List, Optional, Tuple

import pytest

from conftest import combo_choices, comfy_available, display_names, node_classes, skip_reason  # noqa: F401

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import families  # noqa: E402
import families.text_encoders  # noqa: E402
from families import FAMILIES, Family  # noqa: E402

PRESETS = ["budget", "high_end"]
FULL = [n for n, f in FAMILIES.items() if f.kind != "probe"]
LORA_STRENGTH = 0.8
SEED = 3


# environment ----------------------------------------------------------------------------------------------------
class Env:
    """ComfyUI modules, the pack's nodes, the temp model folder and caches shared by the tests of this module."""

    def __init__(self, pack: Any, folder: str) -> None:
        import comfy.model_detection
        import comfy.model_management
        import folder_paths
        import nodes

        self.pack = pack
        self.M = node_classes(pack)
        self.nodes = nodes
        self.mm = comfy.model_management
        self.md = comfy.model_detection
        self.folder_paths = folder_paths
        self.folder = folder
        self.files: Dict[str, Dict[str, str]] = {}
        self.refs: Dict[Tuple[str, bool], torch.Tensor] = {}
        self.offloaded: Dict[Tuple[str, str], List[Any]] = {}
        self.checked: Dict[str, Optional[str]] = {}

    def files_of(self, fam: Family) -> Dict[str, str]:
        if fam.name not in self.files:
            self.files[fam.name] = fam.write_all(self.folder)
        return self.files[fam.name]


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths

    d = str(tmp_path_factory.mktemp("family_models"))
    for kind in ("checkpoints", "diffusion_models", "loras"):
        folder_paths.add_model_folder_path(kind, d)
    e = Env(pack, d)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is several times faster on a shared CPU, and deterministic
    try:
        yield e
    finally:
        torch.set_num_threads(threads)
        e.offloaded.clear()
        gc.collect()


# detection ------------------------------------------------------------------------------------------------------
_MISSING = object()


def _fmt(v: Any) -> str:
    return "not read from the file (the model class's full-size default applies)" if v is _MISSING else repr(v)


def detection_problem(env: Env, fam: Family) -> Optional[str]:
    """None when this ComfyUI detects the tiny family as intended, else why not (the skip reason)."""
    sd = fam.state_dict(fam.files[0])
    cfg = env.md.detect_unet_config(sd, "")
    if cfg is None:
        return "this ComfyUI has no model detection for {} (no detect_unet_config branch matches its keys)".format(
            fam.name)
    bad = {k: cfg.get(k, _MISSING) for k, v in fam.expect.items() if cfg.get(k, _MISSING) != v}
    if bad:
        return ("this ComfyUI cannot build {} at a tiny width: detect_unet_config gives {} (a tiny model needs {})"
                .format(fam.name, ", ".join("{}={}".format(k, _fmt(v)) for k, v in bad.items()),
                        ", ".join("{}={!r}".format(k, fam.expect[k]) for k in bad)))
    return None


def require_tiny(env: Env, fam: Family) -> None:
    if fam.name not in env.checked:
        env.checked[fam.name] = detection_problem(env, fam)
    problem = env.checked[fam.name]
    if problem is not None:
        pytest.skip(problem)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_is_detected_at_a_tiny_width(env, name):
    """Full generators must be detected as the intended model class; probes document why a family cannot be tiny."""
    fam = FAMILIES[name]
    require_tiny(env, fam)
    if fam.kind == "probe":
        pytest.fail("this ComfyUI now detects {} at a tiny width ({}): give families/{} a full generator and add "
                    "it to the equality tests".format(fam.name, fam.expect, fam.name))
    mc = env.md.model_config_from_unet(fam.state_dict(fam.files[0]), "")
    assert type(mc).__name__ == fam.model_class


# loading and sampling -------------------------------------------------------------------------------------------
def conditioning(fam: Family) -> list:
    s = fam.sampling
    g = torch.Generator().manual_seed(1)
    extra: Dict[str, Any] = dict(s.extra)
    cond = torch.randn((1,) + tuple(s.context), generator=g) * 0.1
    if s.pooled is not None:
        extra["pooled_output"] = torch.randn(1, s.pooled, generator=g) * 0.1
    return [[cond, extra]]


def plain_models(env: Env, fam: Family) -> List[Any]:
    files = env.files_of(fam)
    if fam.kind == "checkpoint":
        out = env.nodes.CheckpointLoaderSimple().load_checkpoint(files["model"])
        return [out[0]]
    return [env.nodes.UNETLoader().load_unet(files[w], "default")[0] for w in fam.files]


def offload_models(env: Env, fam: Family, preset: str) -> List[Any]:
    key = (fam.name, preset)
    if key not in env.offloaded:
        files = env.files_of(fam)
        if fam.kind == "checkpoint":
            model, clip, _vae = env.M["OffloadCheckpointLoader"]().load(files["model"], preset)
            assert clip is None, "the tiny checkpoint holds no text encoder"
            models = [model]
        else:
            models = [env.M["OffloadDiffusionModelLoader"]().load(files[w], "default", preset)[0] for w in fam.files]
        env.offloaded[key] = models
    return env.offloaded[key]


def with_lora(env: Env, fam: Family, models: List[Any], which: str = "lora") -> List[Any]:
    name = env.files_of(fam)[which]
    node = env.nodes.LoraLoaderModelOnly()
    return [node.load_lora_model_only(m, name, LORA_STRENGTH)[0] for m in models]


def sample(env: Env, fam: Family, models: List[Any]) -> torch.Tensor:
    s = fam.sampling
    cond = conditioning(fam)
    latent = {"samples": torch.zeros(s.latent)}
    with torch.inference_mode():
        if len(models) == 1:
            out = env.nodes.common_ksampler(models[0], SEED, s.steps, s.cfg, "euler", "simple", cond, cond, latent)[0]
        else:  # Wan 2.2 A14B: high-noise expert for the first half of the steps, low-noise expert for the rest
            ks = env.nodes.KSamplerAdvanced()
            half = s.steps // 2
            mid = ks.sample(models[0], "enable", SEED, s.steps, s.cfg, "euler", "simple", cond, cond, latent,
                            0, half, "enable")[0]
            out = ks.sample(models[1], "disable", SEED, s.steps, s.cfg, "euler", "simple", cond, cond, mid,
                            half, 10000, "disable")[0]
    x = out["samples"]
    assert torch.isfinite(x).all(), "{}: non-finite latent".format(fam.name)
    return x


def assert_full_coverage(fam: Family, model: Any) -> None:
    """Every weight ComfyUI built comes from the file (nothing left uninitialized), with the file's shape."""
    built = {k: tuple(v.shape) for k, v in model.model.diffusion_model.state_dict().items()}
    shapes = fam.shapes()
    assert sorted(built) == sorted(shapes), (set(built) ^ set(shapes))
    assert {k: tuple(v) for k, v in shapes.items()} == built


def reference(env: Env, fam: Family, lora: bool) -> torch.Tensor:
    key = (fam.name, lora)
    if key not in env.refs:
        models = plain_models(env, fam)
        if not lora:
            assert_full_coverage(fam, models[0])
        if lora:
            models = with_lora(env, fam, models)
            patched = models[0].patches
            for t in list(fam.lora_targets) + list(fam.lora_diffs):
                k = "diffusion_model." + (t if t in fam.lora_diffs else t + ".weight")
                assert k in patched, "ComfyUI did not map the LoRA key for {}".format(k)
        env.refs[key] = sample(env, fam, models)
    return env.refs[key]


def engine_state(model: Any) -> Any:
    return model.model.diffusion_model.__dict__["_layer_offload"]


def check_preset(model: Any, preset: str) -> None:
    rep = engine_state(model).handle.report()
    tiers = [b.tier for b in rep.blocks]
    assert len(tiers) >= 2, tiers
    if preset == "budget":
        assert "vram" not in tiers, tiers
    else:
        assert "vram" in tiers, tiers


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", FULL)
def test_family_matches_the_plain_loader(env, name, preset, lora):
    fam = FAMILIES[name]
    require_tiny(env, fam)
    ref_base = reference(env, fam, False)
    off = offload_models(env, fam, preset)
    from comfy.model_patcher import ModelPatcher

    for m in off:
        assert isinstance(m, ModelPatcher) and not m.is_dynamic()
    if not lora:
        out = sample(env, fam, off)
        assert torch.equal(ref_base, out), "{} / {}: offloaded result differs from the plain loader".format(name,
                                                                                                         preset)
        for m in off:
            check_preset(m, preset)
        return
    ref = reference(env, fam, True)
    assert not torch.equal(ref, ref_base), "the test LoRA must change the result"
    patched = with_lora(env, fam, off)
    assert [type(p) for p in patched] == [type(m) for m in off]
    out = sample(env, fam, patched)
    assert torch.equal(ref, out), "{} / {} + LoRA: offloaded result differs from the plain loader".format(name, preset)
    # the host masters stay unpatched: the same offloaded models without the LoRA give the base result again
    assert torch.equal(ref_base, sample(env, fam, off)), "{} / {}: LoRA leaked into the base model".format(name, preset)


@pytest.mark.parametrize("name", FULL)
def test_offload_model_node_matches_with_lora_before_and_after(env, name):
    """Offload Model on a model ComfyUI's own loader made (budget): equal without a LoRA, with a LoRA applied before
    the node (patches already on the input) and after it."""
    fam = FAMILIES[name]
    require_tiny(env, fam)
    node = env.M["OffloadModel"]()
    off = [node.apply(m, "budget")[0] for m in plain_models(env, fam)]
    assert torch.equal(reference(env, fam, False), sample(env, fam, off))
    ref = reference(env, fam, True)
    before = [node.apply(m, "budget")[0] for m in with_lora(env, fam, plain_models(env, fam))]
    assert torch.equal(ref, sample(env, fam, before)), "LoRA applied before Offload Model"
    assert torch.equal(ref, sample(env, fam, with_lora(env, fam, off))), "LoRA applied after Offload Model"


@pytest.mark.parametrize("name", [n for n in FULL if FAMILIES[n].lora_diffs])
def test_plain_parameter_patches_match(env, name):
    """A LoRA of '.diff' patches on plain parameters only (no ComfyUI layer type): Wan's block / head `modulation`,
    the QK-norm RMSNorm scales of the Flux-style stream blocks. Offloaded equals plain under both presets; where
    ComfyUI applies them (leaf modules) they must change the result, so the streamed plain-parameter path is used."""
    fam = FAMILIES[name]
    require_tiny(env, fam)
    ref = sample(env, fam, with_lora(env, fam, plain_models(env, fam), "diffs"))
    applied = not torch.equal(ref, reference(env, fam, False))
    assert applied == fam.diffs_take_effect, "ComfyUI {} these plain-parameter patches".format(
        "applies" if applied else "ignores")
    for preset in PRESETS:
        off = [env.M["OffloadModel"]().apply(m, preset)[0] for m in plain_models(env, fam)]
        assert torch.equal(ref, sample(env, fam, with_lora(env, fam, off, "diffs"))), preset


# one module, two branches: a plain ComfyUI branch next to the offloaded one ---------------------------------------
def _comfy_restores_siblings(env: Env, fam: Family) -> bool:
    """Whether this ComfyUI gives a plain model its own result back after a LoRA clone of it ran (ComfyUI 0.12.1
    on the CPU bakes the clone's patches into the shared weights; 0.3.64 restores them)."""
    base = reference(env, fam, False)
    plain = plain_models(env, fam)
    sample(env, fam, with_lora(env, fam, plain))
    return torch.equal(base, sample(env, fam, plain))


@pytest.mark.parametrize("order", ["plain_lora_first", "offloaded_first"])
def test_plain_lora_branch_beside_an_offloaded_model(env, order):
    """UNETLoader's MODEL feeds both Offload Model and LoraLoaderModelOnly (an A/B workflow). Each branch must give
    what it gives without the other: the plain branch its LoRA result, the offloaded branch the base result."""
    fam = FAMILIES["wan21"]
    require_tiny(env, fam)
    if order == "offloaded_first" and not _comfy_restores_siblings(env, fam):
        pytest.skip("this ComfyUI itself bakes a LoRA clone's patches into the weights its siblings share (CPU "
                    "mode), so no sibling of a LoRA branch keeps its own result")
    base, ref = reference(env, fam, False), reference(env, fam, True)
    plain = plain_models(env, fam)
    off = [env.M["OffloadModel"]().apply(m, "budget")[0] for m in plain]
    if order == "offloaded_first":
        assert torch.equal(base, sample(env, fam, off))
    assert torch.equal(ref, sample(env, fam, with_lora(env, fam, plain))), "the plain LoRA branch"
    assert torch.equal(base, sample(env, fam, off)), "the offloaded branch after the plain LoRA branch ran"


def test_plain_clip_lora_branch_beside_an_offloaded_clip(env):
    """The CLIP analog: Load CLIP feeds Offload CLIP and a LoraLoader branch."""
    import comfy.sd

    te = families.text_encoders.TEXT_ENCODERS["sd1_clip_l"]
    base = encode(build_text_encoder(te), PROMPT)
    lsd = te_lora(te, build_text_encoder(te))
    ref = encode(comfy.sd.load_lora_for_models(None, build_text_encoder(te), lsd, 0.0, LORA_STRENGTH)[1], PROMPT)
    clip = build_text_encoder(te)
    off = env.M["OffloadCLIP"]().apply(clip, "budget")[0]
    assert_encodes_equal(ref, comfy.sd.load_lora_for_models(None, clip, lsd, 0.0, LORA_STRENGTH)[1], PROMPT)
    assert_encodes_equal(base, off, PROMPT)


# SD1.5 checkpoint: its CLIP --------------------------------------------------------------------------------------
def test_sd15_checkpoint_clip_through_offload_clip(env):
    """A checkpoint holding a tiny CLIP: where ComfyUI builds it from the checkpoint, Offload Loader (Checkpoint)'s
    CLIP must encode bitwise like CheckpointLoaderSimple's; ComfyUI 0.3.64 / 0.12.1 build SD1's CLIP from a fixed
    12-layer, 768-wide config, so the tiny one is refused there (skip, with ComfyUI's own error)."""
    from families.common import make_state_dict, write
    from families.sd15 import SD15, TINY_CLIP, tiny_clip_shapes

    import comfy.sd

    require_tiny(env, SD15)
    name = "lo_fam_sd15_with_tiny_clip.safetensors"
    path = os.path.join(env.folder, name)
    if not os.path.exists(path):
        sd = {SD15.prefix + k: v for k, v in SD15.state_dict().items()}
        sd.update(make_state_dict(tiny_clip_shapes(), 5))
        write(sd, path)
    try:
        out = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=True)
    except Exception as e:  # noqa: BLE001 - ComfyUI's refusal is the reason
        pytest.skip("ComfyUI does not detect a tiny CLIP in an SD1.5 checkpoint (its SD1 CLIP has a fixed config); "
                    "loading one fails with {}: {}".format(type(e).__name__, str(e).strip().splitlines()[0][:160]))
    clip = out[1]
    width = None if clip is None else clip.cond_stage_model.state_dict()[
        "clip_l.transformer.text_model.embeddings.token_embedding.weight"].shape[1]
    if width != TINY_CLIP["hidden"]:
        pytest.skip("ComfyUI builds the checkpoint's CLIP at width {} from a fixed config, not the tiny one in the "
                    "file".format(width))
    plain = env.nodes.CheckpointLoaderSimple().load_checkpoint(name)[1]
    off = env.M["OffloadCheckpointLoader"]().load(name, "budget")[1]
    assert_encodes_equal(plain, off, "a photo of a cat")


# text encoders through Offload CLIP -------------------------------------------------------------------------------
def build_text_encoder(te) -> Any:
    import comfy.sd
    import comfy.supported_models_base
    from families.common import init_tensor

    try:
        module = importlib.import_module(te.module)
        tokenizer, model = getattr(module, te.tokenizer), getattr(module, te.model)
    except (ImportError, AttributeError) as e:
        pytest.skip("this ComfyUI has no {}.{} / {}: {}".format(te.module, te.tokenizer, te.model, e))
    te_dir = os.path.join(os.path.dirname(os.path.abspath(comfy.sd.__file__)), "text_encoders")
    data = {k: os.path.join(te_dir, v) for k, v in te.tokenizer_data.items()}
    try:
        clip = comfy.sd.CLIP(target=comfy.supported_models_base.ClipTarget(tokenizer, model),
                             model_options=dict(te.model_options), tokenizer_data=data)
    except FileNotFoundError as e:  # a tokenizer file ComfyUI ships is missing from this checkout (a partial snapshot)
        if not str(getattr(e, "filename", "") or "").startswith(te_dir):
            raise
        pytest.skip("this ComfyUI checkout lacks {} (a tokenizer file ComfyUI ships)".format(e.filename))
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in clip.cond_stage_model.named_modules()
             if n.count(".") <= 2}
    if sizes[""] > families.text_encoders.MAX_PARAMS:
        big = max((n for n in sizes if sizes[n] > families.text_encoders.MAX_PARAMS),
                  key=lambda n: (n.count("."), sizes[n]))  # the deepest module that is too big
        pytest.skip("ComfyUI builds part of {} at full size whatever its model config says ({}: {:.0f}M parameters, "
                    "{:.0f}M in all)".format(te.name, big, sizes[big] / 1e6, sizes[""] / 1e6))
    try:
        clip.clone()
    except AttributeError as e:  # Offload CLIP and LoraLoader both clone the CLIP
        pytest.skip("this ComfyUI cannot clone a {} CLIP ({}: {}): LoraLoader and Offload CLIP fail alike".format(
            te.name, type(e).__name__, e))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for n, p in clip.cond_stage_model.named_parameters():
            p.copy_(init_tensor(n, tuple(p.shape), g).to(p.dtype))
    return clip


def encode(clip: Any, text: str) -> Dict[str, Any]:
    with torch.inference_mode():
        return clip.encode_from_tokens(clip.tokenize(text), return_dict=True)


def assert_encodes_equal(ref: Any, off: Any, text: str) -> None:
    """`ref`: a plain CLIP or its encode() result; `off`: the CLIP under test."""
    if not isinstance(ref, dict):
        ref = encode(ref, text)
    out = encode(off, text)
    assert sorted(ref) == sorted(out)
    tensors = 0
    for k, v in ref.items():
        if torch.is_tensor(v):
            tensors += 1
            assert torch.isfinite(v.float()).all(), k
            assert torch.equal(v, out[k]), "{} differs".format(k)
        else:
            assert v == out[k], k
    assert tensors >= 1


def te_lora(te, clip) -> Dict[str, torch.Tensor]:
    from families.common import make_lora

    shapes = {k: tuple(v.shape) for k, v in clip.cond_stage_model.state_dict().items()}
    layer = [k for k in shapes if k.endswith(".weight") and any(f in k for f in te.lora_layer)]
    targets = [k[:-len(".weight")] for k in layer if len(shapes[k]) == 2]
    diffs = [k for k in layer if len(shapes[k]) == 1]  # norm weights: RMSNorm / T5LayerNorm are plain parameters
    assert targets and diffs, te.name
    return make_lora(shapes, targets, 11, diffs=diffs, prefix="text_encoders.")


PROMPT = "a photo of a cat playing a violin"


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("te_name", list(families.text_encoders.TEXT_ENCODERS))
def test_text_encoder_through_offload_clip_is_bitwise_equal(env, te_name, preset, lora):
    """Every path gets its own CLIP with the same seeded weights: Offload CLIP streams the encoder module in place,
    and ComfyUI 0.12.1 (CPU) bakes a LoRA clone's patches into the module its siblings share, so sharing one CLIP
    between the plain and the offloaded path would test that instead (test_plain_branch_beside_an_offloaded_model)."""
    import comfy.sd

    te = families.text_encoders.TEXT_ENCODERS[te_name]
    plain = build_text_encoder(te)
    base = encode(plain, PROMPT)
    off = env.M["OffloadCLIP"]().apply(build_text_encoder(te), preset)[0]
    if not lora:
        assert_encodes_equal(base, off, PROMPT)
        st = off.patcher.model.__dict__["_layer_offload"]
        tiers = [b.tier for b in st.handle.report().blocks]  # the plan after a run: resident blocks are placed
        assert st.kind == "clip" and len(tiers) >= 2
        assert ("vram" in tiers) == (preset != "budget"), tiers
        return
    lsd = te_lora(te, plain)
    plain_l = comfy.sd.load_lora_for_models(None, build_text_encoder(te), lsd, 0.0, LORA_STRENGTH)[1]
    assert len(plain_l.patcher.patches) == len([k for k in lsd if k.endswith((".lora_up.weight", ".diff"))])
    ref = encode(plain_l, PROMPT)
    assert not torch.equal(ref["cond"], base["cond"]), "the LoRA must change the conditioning"
    after = comfy.sd.load_lora_for_models(None, off, lsd, 0.0, LORA_STRENGTH)[1]
    assert_encodes_equal(ref, after, PROMPT)
    lora_first = comfy.sd.load_lora_for_models(None, build_text_encoder(te), lsd, 0.0, LORA_STRENGTH)[1]
    assert_encodes_equal(ref, env.M["OffloadCLIP"]().apply(lora_first, preset)[0], PROMPT)
    assert_encodes_equal(base, off, PROMPT)  # the offloaded CLIP without the LoRA is unchanged


# GGUF through Offload Model ---------------------------------------------------------------------------------------
def _comfyui_gguf_dir() -> Tuple[Optional[str], str]:
    """A ComfyUI-GGUF checkout: $LO_COMFYUI_GGUF (or $GGUF_PACK, as comfy_envs/setup.sh names it), else a custom_nodes
    folder whose nodes.py has UnetLoaderGGUF."""
    from conftest import COMFYUI_PATH

    explicit = os.environ.get("LO_COMFYUI_GGUF") or os.environ.get("GGUF_PACK")
    if explicit:
        return (explicit if os.path.isfile(os.path.join(explicit, "nodes.py")) else None), explicit
    root = os.path.join(COMFYUI_PATH, "custom_nodes")
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        nodes_py = os.path.join(root, entry, "nodes.py")
        if os.path.isfile(nodes_py):
            with open(nodes_py, encoding="utf-8", errors="replace") as f:
                if "UnetLoaderGGUF" in f.read():
                    return os.path.join(root, entry), nodes_py
    return None, root


_gguf_pack: Dict[str, Any] = {}


def gguf_loader(env: Env, which: str):
    """(load(file name) -> MODEL, the tensor class) for the built-in loader of ComfyUI forks that ship comfy.gguf,
    or for the ComfyUI-GGUF custom node; skips with the reason where the loader is not importable."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the `gguf` package is not importable in this environment (GGUF files cannot be written or read)")
    if which == "builtin":
        try:
            mod = importlib.import_module("comfy.gguf")
            tensor_cls = mod.GGMLTensor
        except (ImportError, AttributeError) as e:
            pytest.skip("this ComfyUI has no built-in GGUF support (comfy.gguf.GGMLTensor: {})".format(e))
        return (lambda n: env.nodes.UNETLoader().load_unet(n, "default")[0]), tensor_cls
    folder, where = _comfyui_gguf_dir()
    if folder is None:
        pytest.skip("ComfyUI-GGUF is not installed (no custom node with UnetLoaderGGUF under {}; set LO_COMFYUI_GGUF "
                    "to a ComfyUI-GGUF checkout)".format(where))
    if "module" not in _gguf_pack:
        spec = importlib.util.spec_from_file_location("lo_test_comfyui_gguf", os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
        module = importlib.util.module_from_spec(spec)
        import sys

        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - e.g. the 0.12 fork's folder_paths refuses ComfyUI-GGUF's calls
            del sys.modules[spec.name]
            pytest.skip("ComfyUI-GGUF at {} does not import in this ComfyUI ({}: {})".format(
                folder, type(e).__name__, str(e).splitlines()[0][:120] if str(e) else ""))
        _gguf_pack["module"] = module
    module = _gguf_pack["module"]
    env.folder_paths.add_model_folder_path("unet_gguf", env.folder)
    loader = module.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]()
    tensor_cls = importlib.import_module(module.__name__ + ".ops").GGMLTensor
    return (lambda n: loader.load_unet(n)[0]), tensor_cls


def _gguf_file(env: Env, main: str) -> str:
    from families import gguf_wan

    name = gguf_wan.file_name(main)
    path = os.path.join(env.folder, name)
    if not os.path.exists(path):
        gguf_wan.write_gguf(gguf_wan.state_dict(), path, main=main)
    return name


def _weights(model: Any) -> Dict[str, Any]:
    """name -> (the parameter object, its class, its stored bytes' address and size) of a patcher's model."""
    return {k: (p, type(p), p.data_ptr(), tuple(p.size())) for k, p in model.model.named_parameters()}


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("first", ["plain-first", "offload-first"])
@pytest.mark.parametrize("main", ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16"])
@pytest.mark.parametrize("which", ["builtin", "ComfyUI-GGUF"])
def test_gguf_loader_output_through_offload_model(env, which, main, first, lora):
    """One GGUF loader output feeds a plain branch and an Offload Model branch (as a graph does: ComfyUI caches the
    loader's output): both give the plain result bitwise, in either order, with and without a LoRA; the weights stream
    as their quantized bytes; the loader's model is never changed."""
    from families import gguf_wan
    from families.wan import WAN21

    load, tensor_cls = gguf_loader(env, which)
    name = _gguf_file(env, main)
    expected = set(gguf_wan.qtypes(gguf_wan.state_dict(), main).values()) - {"F32", "F16"} or {"F16"}
    def fresh() -> Any:
        with torch.inference_mode():  # ComfyUI runs every node under inference_mode
            return load(name)

    cached = fresh()
    found = {getattr(getattr(p, "tensor_type", None), "name", None) for p in cached.model.parameters()}
    assert expected <= found, (expected, found)
    assert isinstance(cached.model.diffusion_model.blocks[1].self_attn.q.weight, tensor_cls)
    ref = sample(env, WAN21, with_lora(env, WAN21, [fresh()]) if lora else [fresh()])
    if lora:  # a model of its own: a GGUF clone's LoRA can stay on weights it shares with its source
        assert not torch.equal(ref, sample(env, WAN21, [fresh()])), "the LoRA must change the result"

    def plain_branch() -> torch.Tensor:
        return sample(env, WAN21, with_lora(env, WAN21, [cached]) if lora else [cached])

    def offload_branch() -> Any:
        with torch.inference_mode():
            off = env.M["OffloadModel"]().apply(cached, "budget")[0]
        assert isinstance(off, type(cached)), (type(off), type(cached))  # GGUFModelPatcher stays one
        return with_lora(env, WAN21, [off])[0] if lora else off

    if first == "plain-first":
        assert torch.equal(ref, plain_branch()), "the plain branch differs before offloading"
    env.mm.unload_all_models()  # a plain LoRA branch bakes F16 weights while its model is loaded
    before = _weights(cached)
    off = offload_branch()
    assert torch.equal(ref, sample(env, WAN21, [off])), "GGUF {} ({}): offloaded result differs".format(main, which)
    after = _weights(cached)
    changed = [k for k in before if before[k][0] is not after[k][0] or before[k][1:] != after[k][1:]]
    assert after.keys() == before.keys() and not changed, "the loader's cached model was changed: {}".format(changed)
    assert torch.equal(ref, plain_branch()), "the plain branch differs after the offload branch ran"
    assert torch.equal(ref, sample(env, WAN21, [off])), "a second offloaded run differs"
    st = engine_state(off)
    rep = st.handle.report()
    assert rep.blocks and all(b.tier != "vram" for b in rep.blocks)
    streamed = dict(off.model.diffusion_model.named_parameters())
    q = streamed["blocks.1.self_attn.q.weight"]
    assert isinstance(q, tensor_cls) and q.tensor_type.name == ("Q8_0" if main in gguf_wan.K_SCALES else main)
    assert tuple(q.shape) == tuple(gguf_wan.state_dict()["blocks.1.self_attn.q.weight"].shape)
    stored = [p.numel() * p.element_size() for k, p in streamed.items() if k.startswith("blocks.1.")]
    block = [b for b in rep.blocks if b.name == "blocks.1"]
    assert block and sum(stored) <= block[0].bytes <= sum(stored) + 512 * len(stored), \
        "the block moves its quantized bytes as stored, not a dequantized copy"


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("which", ["builtin", "ComfyUI-GGUF"])
def test_gguf_model_through_offload_model(env, which, preset, lora):
    from families import gguf_wan
    from families.wan import WAN21

    load, tensor_cls = gguf_loader(env, which)
    path = os.path.join(env.folder, gguf_wan.FILE)
    if not os.path.exists(path):
        gguf_wan.write_gguf(gguf_wan.state_dict(), path)
    plain = load(gguf_wan.FILE)
    q = plain.model.diffusion_model.blocks[1].self_attn.q.weight
    qtype = getattr(q, "tensor_type", None)
    assert isinstance(q, tensor_cls) and getattr(qtype, "name", None) == "Q8_0", (type(q), qtype)
    models = [plain]
    if lora:
        models = with_lora(env, WAN21, models)
    ref = sample(env, WAN21, models)
    if lora:
        assert not torch.equal(ref, sample(env, WAN21, [load(gguf_wan.FILE)])), "the LoRA must change the result"
    off = env.M["OffloadModel"]().apply(load(gguf_wan.FILE), preset)[0]
    assert isinstance(off, type(plain)), (type(off), type(plain))  # GGUFModelPatcher stays a GGUFModelPatcher
    if lora:
        off = with_lora(env, WAN21, [off])[0]
    assert torch.equal(ref, sample(env, WAN21, [off])), "GGUF ({}) / {}: offloaded result differs".format(which, preset)
    check_preset(off, preset)


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("main", ["Q8_0", "Q4_0", "F16"])
@pytest.mark.parametrize("which", ["builtin", "ComfyUI-GGUF"])
def test_gguf_model_held_compressed_in_ram_is_bitwise(env, which, main, lora):
    """Issue 36 with a GGUF model: Offload Model with host_compression "lossless" gives the plain GGUF result bitwise,
    also with a LoRA on top (applied by the GGUF ops at compute time: the stored payload is never patched); the blocks
    are held in the codec's form only where that pays (F16 payloads do; a block that stays raw holds its raw bytes,
    never more), and the report's model totals are the blocks'."""
    from families import gguf_wan
    from families.wan import WAN21
    from offload.model.layout import Leaf
    from offload.store import codec

    load, tensor_cls = gguf_loader(env, which)
    name = _gguf_file(env, main)

    def fresh() -> Any:
        with torch.inference_mode():
            return load(name)

    plain = fresh()
    ref = sample(env, WAN21, with_lora(env, WAN21, [plain]) if lora else [plain])
    if lora:
        assert not torch.equal(ref, sample(env, WAN21, [fresh()])), "the LoRA must change the result"
    with torch.inference_mode():
        off = env.M["OffloadModel"]().apply(fresh(), "budget", None, 0, "", "lossless")[0]
    assert isinstance(off, type(plain)), (type(off), type(plain))  # GGUFModelPatcher stays one
    if lora:
        off = with_lora(env, WAN21, [off])[0]
    assert torch.equal(ref, sample(env, WAN21, [off])), "GGUF {} ({}) lossless: result differs".format(main, which)
    assert torch.equal(ref, sample(env, WAN21, [off])), "a second run differs"
    rep = engine_state(off).handle.report()
    blocks = rep.blocks
    assert blocks and all(b.tier != "vram" for b in blocks)
    q = dict(off.model.diffusion_model.named_parameters())["blocks.1.self_attn.q.weight"]
    assert isinstance(q, tensor_cls) and q.tensor_type.name == main, "the payload streams as stored"
    for b in blocks:
        if b.compression == "none":
            assert b.host_bytes == b.raw_bytes, (b.name, b.host_bytes, b.raw_bytes)
        else:
            assert b.compression == codec.CODEC and b.host_bytes < codec.UNIT_PAYS * b.raw_bytes, \
                (b.name, b.host_bytes, b.raw_bytes)
    assert rep.host_bytes == sum(b.host_bytes for b in blocks)
    assert rep.host_raw_bytes == sum(b.raw_bytes for b in blocks)
    streamed = dict(off.model.diffusion_model.named_parameters())
    for b in blocks:  # the codec's own verdict on the block's stored bytes: held compressed exactly where it pays
        ts = [t for k, t in streamed.items() if k.startswith(b.name + ".")]
        ts = [t.detach().as_subclass(torch.Tensor).contiguous().reshape(-1) for t in ts]
        raw = torch.cat([t.view(torch.uint8) for t in ts])
        leaves, at = [], 0
        for t in ts:
            n = t.numel() * t.element_size()
            leaves.append(Leaf(at, n, t.dtype, (t.numel(),), None))
            at += n
        ratio = codec.encode(raw, leaves).ratio
        if ratio < 0.9 * codec.UNIT_PAYS:
            assert b.compression == codec.CODEC, (b.name, ratio)
        elif ratio > codec.UNIT_PAYS:
            assert b.compression == "none", (b.name, ratio)
    held = {b.compression for b in blocks}
    if main == "F16":  # half floats pay: every block is held compressed
        assert held == {codec.CODEC}, [(b.name, b.compression, b.host_bytes, b.raw_bytes) for b in blocks]
        assert rep.host_bytes < rep.host_raw_bytes
    else:  # 8- and 4-bit quantized payloads spread over all byte values: they stay raw, as stored
        assert held == {"none"} and rep.host_bytes == rep.host_raw_bytes
