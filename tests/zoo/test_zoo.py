"""The peer-fixture zoo (tests/zoo/zoo_models.py): every case streamed on the simulated device, bitwise.

Each case is a tiny model from a peer library's own test suite (the file it imitates is named in the case). Every
check runs the offloaded model under the host-master guard (tests/host_master_guard.py), so a tensor the engine
never moved shows up as the device mismatch it would be on a GPU. A case passes, or `offload_module` refuses it up
front with a message naming the tensor or module (the refusals the zoo expects are listed in REFUSED, with the
words the message must hold); never a silent difference, never an error in the forward.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.handle import HANDLE_ATTR
from tests.host_master_guard import host_master_guard
from tests.zoo.zoo_models import CASES, ZooCase, call, leaf_units, output_tensors, to_channels_last, units_for

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
safetensors_torch = pytest.importorskip("safetensors.torch")

# diffusers' own deprecation notices inside the models it builds (Chroma uses the deprecated FluxPosEmbed path)
# and torch's notice on the old weight_norm, which diffusers' Oobleck VAE uses
pytestmark = [pytest.mark.filterwarnings("ignore:.*FluxPosEmbed.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning"),
              # peft 0.21 still asks transformers 5 for is_gradient_checkpointing
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]

NAMES = list(CASES)
# checks whose mechanism does not depend on the model's shape run on a spread of cases (CI time): every library,
# leaf-level units, buffers, weight_norm, an object attribute, convolutions, encoder-decoders, MoE
SPREAD = ["acc_model_for_test", "acc_nested_model_for_test", "acc_tied_weights", "acc_unused_submodules_leaf",
          "go_multiple_blocks", "go_deeply_nested_leaf", "flux", "wan", "qwenimage", "lumina2", "pixart",
          "autoencoder_kl", "autoencoder_oobleck", "consistency_decoder_vae", "unet_2d_condition", "t5_encoder_leaf",
          "clip_text", "llama", "qwen2_moe", "whisper"]
GENERATE = [n for n, c in CASES.items() if c.generate is not None]
CONV = [n for n, c in CASES.items() if c.channels_last]


def _cfg(**kw) -> OffloadConfig:
    kw.setdefault("device", "sim")
    return OffloadConfig(**kw)


def _offload(model: nn.Module, case: ZooCase, **kw):
    return offload_module(model, _cfg(**kw), budget=VramBudget(None), units=units_for(case, model))


def _equal(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref), f"{what}: {len(got)} output tensors, the plain model gives {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: output {i} is {a.shape} {a.dtype}, not {b.shape} " \
                                                          f"{b.dtype}"
        assert torch.equal(a, b), f"{what}: output {i} differs by {(a.double() - b.double()).abs().max().item():.3g}"


_REFS: dict[str, list[list[torch.Tensor]]] = {}


def _refs(model: nn.Module, case: ZooCase) -> list[list[torch.Tensor]]:
    """The plain model's outputs for both inputs (computed once per case: every build of a case is the same model)."""
    if case.name not in _REFS:
        with torch.no_grad():
            _REFS[case.name] = [call(model, case.inputs(v)) for v in (0, 1)]
    return _REFS[case.name]


def _guarded(handle, model: nn.Module, case: ZooCase, v: int) -> list[torch.Tensor]:
    with torch.no_grad(), host_master_guard(handle):
        return call(model, case.inputs(v))


@pytest.mark.parametrize("name", NAMES)
def test_every_block_streamed_bitwise(name):
    """Ring only (vram_fraction 0): both input shapes, twice, under the guard; detach gives back the same outputs."""
    case = CASES[name]
    model = case.build()
    refs = _refs(model, case)
    handle = _offload(model, case, vram_fraction=0)
    blocks = handle.report().blocks
    assert len(blocks) >= 2 and all(b.tier != "vram" for b in blocks), [(b.name, b.tier) for b in blocks]
    for v in (0, 1, 0):  # the first shape again after the second: nothing left over from either pass
        _equal(_guarded(handle, model, case, v), refs[v], f"{name} streamed, input {v}")
    never = [b.name for b in handle.report().blocks if b.calls == 0 and not _tied_only(model, b.name)]
    assert not never, f"{name}: blocks never streamed: {never}"
    handle.detach()
    with torch.no_grad():
        _equal(call(model, case.inputs(0)), refs[0], f"{name} after detach")


def _tied_only(model: nn.Module, unit: str) -> bool:
    """Every tensor of `unit` is used elsewhere too (T5's `shared` embedding, called as `encoder.embed_tokens`): such
    a unit holds nothing of its own to stream."""
    inside = {id(t) for t in list(model.get_submodule(unit).parameters()) + list(model.get_submodule(unit).buffers())}
    outside = {id(t) for name, m in model.named_modules(remove_duplicate=False)
               if name != unit and not name.startswith(unit + ".")
               for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}
    return bool(inside) and inside <= outside


def _unit_bytes(handle) -> list[int]:
    return [b.bytes for b in handle.report().blocks]


def _finer_units(model: nn.Module, case: ZooCase) -> list[str]:
    """Three or more units for a mixed plan: the case's units, or the children holding weights of each."""
    from offload.model.blocks import find_units

    units = [u.name for u in find_units(model, units_for(case, model))]
    if len(units) >= 3:
        return units
    finer = []
    for name in units:
        children = [f"{name}.{c}" for c, m in model.get_submodule(name).named_children()
                    if any(True for _ in m.parameters())]
        finer.extend(children if len(children) >= 2 else [name])
    return finer if len(finer) >= 3 else leaf_units(model)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_plan_bitwise(name):
    """Some blocks resident, the others streamed through a one-slot ring (a budget one byte short of everything)."""
    case = CASES[name]
    model = case.build()
    refs = _refs(model, case)
    units = _finer_units(model, case)
    probe = offload_module(model, _cfg(vram_fraction=0), budget=VramBudget(None), units=units)
    sizes, rest = _unit_bytes(probe), probe.streamer.rest_bytes
    probe.detach()
    assert len(sizes) >= 3, f"{name}: {units} cannot make a mixed plan"
    handle = offload_module(model, _cfg(vram_budget_bytes=rest + sum(sizes) - 1, prefetch=0), budget=VramBudget(None),
                            units=units)
    for v in (0, 1):
        _equal(_guarded(handle, model, case, v), refs[v], f"{name} mixed plan, input {v}")
    tiers = [b.tier for b in handle.report().blocks]
    assert "vram" in tiers and any(t != "vram" for t in tiers), tiers
    handle.detach()


def _meta_context(how: str):
    if how == "meta":
        return torch.device("meta")
    import accelerate

    return accelerate.init_empty_weights()


@pytest.mark.parametrize("how", ["meta", "init_empty_weights"])
@pytest.mark.parametrize("name", NAMES)
def test_meta_model_loads_from_its_file(name, how, tmp_path):
    """Built on the meta device (`torch.device("meta")`, or accelerate's default init_empty_weights: parameters on
    meta, buffers real), loaded from the plain model's own safetensors file through disk_path, every block
    streamed: the plain model's outputs. The plain model's floating persistent buffers (BatchNorm running stats,
    learned tables) are moved off their initial values first, as a trained checkpoint's are: only the file has them."""
    case = CASES[name]
    plain = case.build()
    with torch.no_grad():
        trained = [b for m in plain.modules() for n, b in m._buffers.items()
                   if b is not None and b.is_floating_point() and n not in m._non_persistent_buffers_set]
        for b in trained:
            b.add_(torch.rand(b.shape, generator=torch.Generator().manual_seed(3)).to(b.dtype) * 0.1)
        refs = [call(plain, case.inputs(v)) for v in (0, 1)] if trained else _refs(plain, case)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(plain, str(path))
    torch.manual_seed(1)  # whatever the meta build initialises must not matter
    with _meta_context(how):
        model = case.build()
    assert any(p.is_meta for p in model.parameters())
    handle = _offload(model, case, vram_fraction=0, disk_path=str(path))
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    for v in (0, 1) if how == "meta" else (0,):  # the second shape adds nothing to where the bytes came from
        _equal(_guarded(handle, model, case, v), refs[v], f"{name} built with {how}, input {v}")
    handle.detach()
    with torch.no_grad():
        _equal(call(model, case.inputs(0)), refs[0], f"{name} built with {how}, after detach")


@pytest.mark.parametrize("name", GENERATE)
def test_generate_streamed_bitwise(name):
    case = CASES[name]
    model = case.build()
    with torch.no_grad():
        refs = [case.generate(model, v) for v in (0, 1)]
    handle = _offload(model, case, vram_fraction=0)
    for v in (0, 1):
        with torch.no_grad(), host_master_guard(handle):
            out = case.generate(model, v)
        _equal(output_tensors(out), output_tensors(refs[v]), f"{name} generate(), input {v}")
    handle.detach()


@pytest.mark.parametrize("name", NAMES)
def test_train_mode_bitwise(name):
    """model.train(): dropout (same seed), BatchNorm batch statistics and their running-stat updates; after
    detach the buffers hold what the plain model's hold."""
    case = CASES[name]
    plain = case.build().train()
    model = case.build().train()
    handle = _offload(model, case, vram_fraction=0)
    for step, v in enumerate((0, 1)):
        torch.manual_seed(100 + step)
        with torch.no_grad():
            ref = call(plain, case.inputs(v))
        torch.manual_seed(100 + step)
        _equal(_guarded(handle, model, case, v), ref, f"{name} train mode, step {step}")
    handle.detach()
    for (key, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), f"{name}: {key} after train-mode passes differs from the plain model's"


@pytest.mark.parametrize("name", SPREAD)
def test_deepcopy_runs_independently(name):
    """copy.deepcopy of an offloaded model: a model of its own that runs (offloaded too, or plain), the same outputs,
    still running after the original is detached."""
    case = CASES[name]
    model = case.build()
    refs = _refs(model, case)
    handle = _offload(model, case, vram_fraction=0)
    _equal(_guarded(handle, model, case, 0), refs[0], f"{name} before deepcopy")
    twin = copy.deepcopy(model)
    twin_handle = twin.__dict__.get(HANDLE_ATTR)
    assert twin_handle is not handle
    with torch.no_grad(), host_master_guard(handle, *([twin_handle] if twin_handle is not None else [])):
        _equal(call(twin, case.inputs(0)), refs[0], f"{name} deepcopy")
    _equal(_guarded(handle, model, case, 1), refs[1], f"{name} after deepcopy")
    handle.detach()
    with torch.no_grad(), host_master_guard(*([twin_handle] if twin_handle is not None else [])):
        _equal(call(twin, case.inputs(1)), refs[1], f"{name} deepcopy after the original's detach")
    if twin_handle is not None:
        twin_handle.detach()


@pytest.mark.parametrize("name", SPREAD)
def test_cast_after_offloading(name):
    """`.to(torch.bfloat16)` after offloading takes effect (the bf16 model's outputs) or raises at the call naming
    detach(); never reverted at the next pass."""
    case = CASES[name]
    plain = case.build().to(torch.bfloat16)
    model = case.build()
    handle = _offload(model, case, vram_fraction=0)
    _guarded(handle, model, case, 0)
    try:
        model.to(torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - a refusal is allowed if it says what to do
        assert "detach" in str(exc), f"{name}: .to(bfloat16) refused without naming detach(): {exc}"
        return
    inputs = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in case.inputs(0).items()}
    with torch.no_grad():
        ref = call(plain, inputs)
    with torch.no_grad(), host_master_guard(handle):
        got = call(model, inputs)
    _equal(got, ref, f"{name} cast to bfloat16 after offloading")
    handle.detach()


LAYERWISE = ["go_dummy_model", "flux", "wan", "sd3", "autoencoder_kl", "unet_2d_condition"]


@pytest.mark.parametrize("name", LAYERWISE)
def test_layerwise_casting_after_offloading(name):
    """diffusers' enable_layerwise_casting on an offloaded model: float8 storage, float32 compute, as on the plain
    model (or a refusal naming detach())."""
    case = CASES[name]
    plain = case.build()
    plain.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with torch.no_grad():
        ref = call(plain, case.inputs(0))
    model = case.build()
    handle = _offload(model, case, vram_fraction=0)
    try:
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001
        assert "detach" in str(exc), f"{name}: layerwise casting refused without naming detach(): {exc}"
        return
    _equal(_guarded(handle, model, case, 0), ref, f"{name} layerwise casting after offloading")
    handle.detach()


@pytest.mark.parametrize("name", CONV)
def test_channels_last_bitwise(name):
    case = CASES[name]
    model = to_channels_last(case.build())
    with torch.no_grad():
        refs = [call(model, case.inputs(v)) for v in (0, 1)]  # this model's own strides: not the cached outputs
    handle = _offload(model, case, vram_fraction=0)
    for v in (0, 1):
        _equal(_guarded(handle, model, case, v), refs[v], f"{name} channels_last, input {v}")
    handle.detach()


COMPILE = [("go_dummy_model", "model", "eager"), ("llama", "model", "eager"), ("flux", "blocks", "aot_eager")]


@pytest.mark.parametrize("name,region,backend", COMPILE)
def test_compile_after_another_instance_streams(name, region, backend):
    """torch.compile of an offloaded model after another instance of its class was compiled in the process (two
    pipelines, Wan 2.2's two experts): the same outputs as that compiled plain instance, bytes streamed, no host
    master read. `region`: the whole model, or each repeated block (diffusers' regional compile)."""
    import torch._dynamo

    torch._dynamo.reset()
    case = CASES[name]

    def compiled(model: nn.Module) -> nn.Module:
        if region == "model":
            return torch.compile(model, backend=backend)
        for block in model.transformer_blocks + model.single_transformer_blocks:
            block.compile(backend=backend)
        return model

    plain = compiled(case.build())
    with torch.no_grad():
        ref = call(plain, case.inputs(0))
    model = case.build()
    handle = _offload(model, case, vram_fraction=0)
    runner = compiled(model)
    for _ in range(2):
        _equal(_guarded(handle, runner, case, 0), ref, f"{name} compiled ({region}, {backend})")
    assert all(b.bytes_streamed > 0 for b in handle.report().blocks), "the compiled model streamed no bytes"
    handle.detach()
    torch._dynamo.reset()


ADAPTERS = [("go_dummy_model", ["proj_in", "proj_out"], False), ("flux", ["to_q", "to_k", "to_v"], False),
            ("llama", ["q_proj", "v_proj"], False), ("llama", ["q_proj", "v_proj"], True)]


def _peft(case: ZooCase, targets: list[str], checkpointing: bool) -> nn.Module:
    """peft's LoRA added before offloading (the order people set training up), both A and B random."""
    peft = pytest.importorskip("peft")
    model = case.build().train()
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
    return peft.get_peft_model(model, config)


def _train(model: nn.Module, case: ZooCase, handle=None) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(2):
        torch.manual_seed(200 + step)
        with host_master_guard(*([handle] if handle is not None else [])):
            loss = call(model, case.inputs(0))[0].float().pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("name,targets,checkpointing", ADAPTERS)
def test_adapters_added_before_offloading_train_bitwise(name, targets, checkpointing):
    """LoRA adapters inside the blocks at offload time: two AdamW steps give the plain model's losses and adapter
    weights, every block streamed (with gradient checkpointing where the library has it)."""
    case = CASES[name]
    plain = _peft(case, targets, checkpointing)
    ref_losses = _train(plain, case)
    model = _peft(case, targets, checkpointing)
    handle = offload_module(model, _cfg(vram_fraction=0), budget=VramBudget(None), units=units_for(case, model))
    assert all(b.tier != "vram" for b in handle.report().blocks)
    losses = _train(model, case, handle)
    _equal(losses, ref_losses, f"{name} LoRA losses")
    handle.detach()
    trained = {k: v for k, v in plain.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
