"""Quantized checkpoints and cast weights through the Offload Loader (issue 42), on the ComfyUI under test.

Checkpoints are written by ComfyUI's own quantizers: every format of the installed ComfyUI's `comfy.quant_ops.
QUANT_ALGOS` (a format it lacks is skipped by name; 0.3.64 has none), each block matrix quantized with the format's
`comfy_tensor_layout` where that layout takes its shape (`QuantizedTensor.from_float`), stored as ComfyUI stores a
quantized layer (`QuantizedTensor.state_dict` under `<layer>.weight`, and `<layer>.comfy_quant`). Through the Offload
Loader each is bitwise the Load Diffusion Model node's, with and without a LoRA (before, with, and after it), under
several presets; under a RAM ceiling (`ram_budget_bytes`, as a machine short of RAM gives the engine) the host RAM
held stays under it because quantized blocks, and blocks ComfyUI cast from the file (its fp32 CPU compute, the
`weight_dtype` fp8 choice), stream from the file; an MXFP8 file (F8_E8M0 block scales) loads and plans. Skipped
without COMFYUI_PATH.
"""
from __future__ import annotations

import importlib
import json
import os

import pytest

from conftest import comfy_available, load_comfy_and_pack, load_tests_module, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import tiny_wan  # noqa: E402

LORA = "lo_q_lora.safetensors"
BF16 = "lo_q_bf16.safetensors"
BLOCKS = 8


def _algos():
    try:
        load_comfy_and_pack()  # at collection too: which formats this ComfyUI has decides what is skipped
        from comfy.quant_ops import QUANT_ALGOS
    except ImportError:
        return {}
    return QUANT_ALGOS


# what a format may be asked of ComfyUI's quantizer: its name in QUANT_ALGOS, extra comfy_quant fields and the
# quantizer's arguments (int8 rowwise and ConvRot are int8_tensorwise files with per-row scales / a rotation)
VARIANTS = {"float8_e4m3fn": ("float8_e4m3fn", {}, {}), "float8_e5m2": ("float8_e5m2", {}, {}),
            "nvfp4": ("nvfp4", {}, {}), "mxfp8": ("mxfp8", {}, {}), "int8_tensorwise": ("int8_tensorwise", {}, {}),
            "int8_rowwise": ("int8_tensorwise", {}, {"per_channel": True}),
            "int8_convrot": ("int8_tensorwise", {"convrot": True, "convrot_groupsize": 256},
                             {"per_channel": True, "convrot": True}),
            "convrot_w4a4": ("convrot_w4a4", {"convrot_groupsize": 256}, {}),
            "asym_w4a8_int8": ("asym_w4a8_int8", {"group_size": 16, "convrot_groupsize": 256}, {})}


def write_quantized(path: str, variant: str) -> int:
    """tiny_wan (bf16, 8 blocks) with its block matrices quantized by ComfyUI's quantizer for `variant`; returns
    how many layers took the format (ConvRot and W4A8 take only inputs that are a multiple of 256 wide)."""
    from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor

    fmt, extra, kwargs = VARIANTS[variant]
    layout = QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    sd, quantized = {}, 0
    for k, v in tiny_wan.make_wan_state_dict(dtype=torch.bfloat16, num_blocks=BLOCKS).items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2:
            try:
                q = QuantizedTensor.from_float(v, layout, **kwargs)
            except (ValueError, AssertionError, RuntimeError):
                sd[k] = v  # a shape this quantizer does not take: the layer stays bf16 (mixed precision)
                continue
            sd.update({n: t.contiguous() for n, t in q.state_dict(k).items()})
            sd[k[:-len("weight")] + "comfy_quant"] = torch.tensor(
                list(json.dumps({"format": fmt, **extra}).encode("utf-8")), dtype=torch.uint8)
            quantized += 1
        else:
            sd[k] = v
    save_file(sd, path)
    return quantized


def _variants():
    algos = _algos()
    return [pytest.param(v, marks=pytest.mark.skipif(fmt not in algos, reason=f"this ComfyUI lacks {fmt}"))
            for v, (fmt, _, _) in VARIANTS.items()]


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("quantized_models"))
    tiny_wan.write_wan(os.path.join(d, BF16), dtype=torch.bfloat16, num_blocks=BLOCKS)
    save_file(tiny_wan.make_lora_state_dict(), os.path.join(d, LORA))
    folder_paths.add_model_folder_path("diffusion_models", d)
    folder_paths.add_model_folder_path("loras", d)
    apply = importlib.import_module(pack.__name__ + ".nodes.apply")
    return {"pack": pack, "nodes": nodes, "M": node_classes(pack), "dir": d, "apply": apply, "written": {}}


def quantized_file(env, variant: str) -> str:
    name = f"lo_q_{variant}.safetensors"
    if name not in env["written"]:
        env["written"][name] = write_quantized(os.path.join(env["dir"], name), variant)
    assert env["written"][name] > 0, f"ComfyUI's {variant} quantizer took no layer"
    return name


def sample(env, model, steps: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    with torch.inference_mode():
        return env["nodes"].common_ksampler(model, 3, steps, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]


def plain(env, name, dtype="default"):
    with torch.inference_mode():
        return env["nodes"].UNETLoader().load_unet(name, dtype)[0]


def offloaded(env, name, preset="budget", dtype="default", ram=None, monkeypatch=None, compression="off"):
    """The Offload Loader's model; `ram`: a RAM ceiling for the engine (what a machine short of RAM gives it);
    blocks held raw by default (the disk tier is what is tested; compression would keep them off it)."""
    if ram is not None:
        real = env["apply"].make_config
        monkeypatch.setattr(env["apply"], "make_config", lambda *a, **k: real(*a, ram_budget_bytes=ram, **k))
    try:
        with torch.inference_mode():
            return env["M"]["OffloadDiffusionModelLoader"]().load(name, dtype, preset,
                                                                  host_compression=compression)[0]
    finally:
        if ram is not None:
            monkeypatch.undo()


def with_lora(env, model, strength=0.7):
    with torch.inference_mode():
        return env["nodes"].LoraLoaderModelOnly().load_lora_model_only(model, LORA, strength)[0]


def handle(model):
    return model.model.diffusion_model.__dict__["_layer_offload"].handle


def half_ceiling(env, name, dtype="default") -> int:
    """The weights outside the blocks, half the blocks, and room for the bounce buffers."""
    model = offloaded(env, name, dtype=dtype)
    staged = handle(model).streamer.staged
    return staged.rest_bytes + sum(u.nbytes for u in staged.units) // 2 + (256 << 10)


def under_a_ram_ceiling(env, name: str, ref, ref_lora, monkeypatch):
    """`name` through the Offload Loader with a RAM ceiling of half its blocks: bitwise `ref` (and `ref_lora` with
    the LoRA, and `ref` again after it), some blocks on the disk tier, host RAM under the ceiling. (model, handle)"""
    ram = half_ceiling(env, name)
    off = offloaded(env, name, ram=ram, monkeypatch=monkeypatch)
    h = handle(off)
    assert torch.equal(sample(env, off), ref)
    assert torch.equal(sample(env, with_lora(env, off)), ref_lora)
    assert torch.equal(sample(env, off), ref), "after the LoRA"
    blocks = h.report().blocks
    assert "disk" in [b.tier for b in blocks], [b.placement for b in blocks]
    assert h.host_memory()["ram"] <= ram
    return off, h


@pytest.mark.parametrize("variant", _variants())
def test_every_format_through_the_offload_loader_is_bitwise_under_a_ram_ceiling(env, variant, monkeypatch):
    name = quantized_file(env, variant)
    ref, ref_lora = sample(env, plain(env, name)), sample(env, with_lora(env, plain(env, name)))
    assert not torch.equal(ref, ref_lora), "the LoRA must change the output"
    quantized = [p for p in plain(env, name).model.diffusion_model.parameters() if type(p).__name__ ==
                 "QuantizedTensor"]
    assert quantized, "ComfyUI must load the file's quantized layers as QuantizedTensor weights"
    under_a_ram_ceiling(env, name, ref, ref_lora, monkeypatch)


def write_legacy_scaled_fp8(path: str) -> None:
    """tiny_wan (8 blocks) in the older scaled-fp8 layout every tested ComfyUI loads: fp8 matrices with a float32
    `scale_weight` each and the file's `scaled_fp8` marker (0.3.64 keeps them fp8 weights with scale parameters;
    0.33 converts them to QuantizedTensor, renaming the scale: convert_old_quants)."""
    sd = {}
    for k, v in tiny_wan.make_wan_state_dict(dtype=torch.float32, num_blocks=BLOCKS).items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2:
            scale = v.abs().max() / 448.0
            sd[k] = (v / scale).to(torch.float8_e4m3fn)
            sd[k[:-len("weight")] + "scale_weight"] = scale.reshape(()).to(torch.float32)
        else:
            sd[k] = v.to(torch.bfloat16)
    sd["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    save_file(sd, path)


def test_a_legacy_scaled_fp8_file_is_bitwise_under_a_ram_ceiling(env, monkeypatch):
    """The scaled-fp8 files every tested ComfyUI loads (however it holds them: fp8 weights with scales, or
    QuantizedTensor) stream from the file under a RAM ceiling, bitwise the Load Diffusion Model node's, LoRA on and
    off, and after ComfyUI asks for RAM back (partially_unload_ram)."""
    name = "lo_q_legacy_scaled_fp8.safetensors"
    if name not in env["written"]:
        write_legacy_scaled_fp8(os.path.join(env["dir"], name))
        env["written"][name] = 1
    ref, ref_lora = sample(env, plain(env, name)), sample(env, with_lora(env, plain(env, name)))
    held = [p for p in plain(env, name).model.diffusion_model.blocks.parameters()
            if p.dtype == torch.float8_e4m3fn or type(p).__name__ == "QuantizedTensor"]
    assert held, "ComfyUI must load the scaled-fp8 file as fp8 weights"
    off, h = under_a_ram_ceiling(env, name, ref, ref_lora, monkeypatch)
    blocks = h.report().blocks
    if not any(type(p).__name__ == "QuantizedTensor" for p in held):
        # 0.3.64's scaled-fp8 layers hold a float32 `scale_input` of ones made at load that the file lacks: each
        # disk-tier block keeps those few bytes in RAM (its residue, reported) and reads the rest from the file
        disk = [b for b in blocks if b.tier == "disk"]
        assert all(0 < b.residue_bytes == b.host_bytes < b.bytes // 16 for b in disk), \
            [(b.residue_bytes, b.bytes) for b in disk]
        assert h.host_memory()["residue"] == sum(b.residue_bytes for b in disk)
    # RAM given back the way ComfyUI asks (every block the file holds moves to the disk tier): still bitwise
    assert off.partially_unload_ram(1 << 40) > 0
    assert torch.equal(sample(env, off), ref), "after giving RAM back"
    assert torch.equal(sample(env, with_lora(env, off)), ref_lora), "a LoRA after giving RAM back"
    assert all(b.tier == "disk" for b in h.report().blocks), [b.placement for b in h.report().blocks]


@pytest.mark.parametrize("preset,ceiling", [("mid_range", False), ("high_end", False), ("auto", True),
                                            ("consumer", True)],
                         ids=["mid_range-ram", "high_end-ram", "auto-ram-ceiling", "consumer-ram-ceiling"])
def test_mixed_plans_of_a_quantized_model_with_a_lora(env, preset, ceiling, monkeypatch):
    """Resident, streamed and (under a RAM ceiling) disk-tier blocks of one quantized model, LoRA on and off. The
    RAM ceiling goes with the presets that allow the disk tier (mid_range and high_end refuse a ceiling the blocks
    break, by design: RamCeilingError names what to change)."""
    variant = "nvfp4" if "nvfp4" in _algos() else pytest.skip("this ComfyUI has no nvfp4")
    name = quantized_file(env, variant)
    ref, ref_lora = sample(env, plain(env, name)), sample(env, with_lora(env, plain(env, name)))
    device_budget = None
    if ceiling:  # a VRAM budget keeping some blocks resident and the rest streamed, half of those from disk
        probe = offloaded(env, name)
        staged = handle(probe).streamer.staged
        # a ring of up to 4 slots (consumer's prefetch 3) and two blocks resident beside it
        device_budget = staged.rest_bytes + 6 * max(u.nbytes for u in staged.units)
        del staged, probe
    real = env["apply"].make_config
    extra = {"ram_budget_bytes": half_ceiling(env, name)} if ceiling else {}
    if device_budget:
        extra["vram_budget_bytes"] = device_budget
    monkeypatch.setattr(env["apply"], "make_config", lambda *a, **k: real(*a, **extra, **k))
    with torch.inference_mode():
        off = env["M"]["OffloadDiffusionModelLoader"]().load(name, "default", preset, host_compression="off")[0]
    monkeypatch.undo()
    assert torch.equal(sample(env, with_lora(env, off)), ref_lora)
    assert torch.equal(sample(env, off), ref)
    tiers = {b.tier for b in handle(off).report().blocks}
    assert "vram" in tiers and (not ceiling or "disk" in tiers), tiers


@pytest.mark.parametrize("dtype", ["default", "fp8_e4m3fn"])
def test_weights_comfyui_casts_keep_the_disk_tier(env, dtype, monkeypatch):
    """A bf16 file ComfyUI casts at load (to fp32 for the CPU, or to fp8 by `weight_dtype`): its blocks stream from
    the file with the cast applied on the way, bitwise the loader's model, under a RAM ceiling."""
    ref = sample(env, plain(env, BF16, dtype))
    ram = half_ceiling(env, BF16, dtype)
    off = offloaded(env, BF16, dtype=dtype, ram=ram, monkeypatch=monkeypatch)
    h = handle(off)
    assert torch.equal(sample(env, off), ref)
    disk = [b for b in h.report().blocks if b.tier == "disk"]
    assert disk and all("with a cast" in b.placement for b in disk), [b.placement for b in h.report().blocks]
    if dtype.startswith("fp8"):
        assert all("float8_e4m3fn from bfloat16" in b.placement for b in disk)
    assert h.host_memory()["ram"] <= ram
    assert torch.equal(sample(env, with_lora(env, off)), sample(env, with_lora(env, plain(env, BF16, dtype))))


def test_quantized_blocks_held_compressed_through_the_offload_loader(env):
    """host_compression lossless on an e5m2 fp8_scaled file: the blocks' payloads are held in the codec's form (the
    codec pays on e5m2's wider exponent) and decoded bitwise, LoRA on and off."""
    if "float8_e5m2" not in _algos():
        pytest.skip("this ComfyUI lacks float8_e5m2")
    name = quantized_file(env, "float8_e5m2")
    ref, ref_lora = sample(env, plain(env, name)), sample(env, with_lora(env, plain(env, name)))
    off = offloaded(env, name, compression="lossless")
    assert handle(off).wait_encoded(60)  # blocks a large file leaves to the background encoder: held compressed now
    blocks = handle(off).report().blocks
    assert any(b.compression != "none" and b.host_bytes < b.raw_bytes for b in blocks), \
        [(b.name, b.compression, b.host_bytes, b.raw_bytes) for b in blocks]
    assert torch.equal(sample(env, off), ref)
    assert torch.equal(sample(env, with_lora(env, off)), ref_lora)
    assert torch.equal(sample(env, off), ref), "after the LoRA"


def test_an_mxfp8_file_loads_and_plans(env, capsys):
    if "mxfp8" not in _algos():
        pytest.skip("this ComfyUI lacks mxfp8")
    name = quantized_file(env, "mxfp8")
    path = os.path.join(env["dir"], name)
    off = offloaded(env, name)
    assert torch.equal(sample(env, off), sample(env, plain(env, name)))
    main = importlib.import_module(env["pack"].__name__ + ".offload.__main__").main
    assert main(["plan", path, "--frames", "5", "--height", "64", "--width", "64", "--presets", "budget",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "wan" and out["presets"]["budget"]["blocks"]


@pytest.mark.parametrize("which", ["builtin", "ComfyUI-GGUF"])
def test_a_gguf_model_streams_from_its_gguf_file(env, which, monkeypatch):
    """A GGUF loader's model (city96's ComfyUI-GGUF, or a fork's built-in comfy.gguf) offloaded with its .gguf file
    as the disk tier (what the pack passes once it knows the file): under a RAM ceiling its blocks stream their
    quantized bytes from the GGUF file, bitwise the loader's result."""
    families = load_tests_module("comfyui/test_families.py")
    from families.wan import WAN21

    fenv = families.Env(env["pack"], env["dir"])
    load, tensor_cls = families.gguf_loader(fenv, which)
    name = families._gguf_file(fenv, "Q8_0")
    path = os.path.join(env["dir"], name)

    def fresh():
        with torch.inference_mode():
            return load(name)

    ref = families.sample(fenv, WAN21, [fresh()])
    with torch.inference_mode():  # as ComfyUI runs every node
        probe = env["apply"].offload_patcher(fresh(), "budget", disk_path=path, host_compression="off")
    staged = handle(probe).streamer.staged
    ram = staged.rest_bytes + sum(u.nbytes for u in staged.units) // 2 + (256 << 10)
    del staged, probe
    real = env["apply"].make_config
    monkeypatch.setattr(env["apply"], "make_config", lambda *a, **k: real(*a, ram_budget_bytes=ram, **k))
    with torch.inference_mode():
        off = env["apply"].offload_patcher(fresh(), "budget", disk_path=path, host_compression="off")
    monkeypatch.undo()
    h = handle(off)
    assert torch.equal(ref, families.sample(fenv, WAN21, [off]))
    assert "disk" in [b.tier for b in h.report().blocks], [b.placement for b in h.report().blocks]
    assert h.host_memory()["ram"] <= ram
    assert isinstance(off.model.diffusion_model.blocks[-1].self_attn.q.weight, tensor_cls)
