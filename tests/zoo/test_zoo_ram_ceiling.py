"""Models we did not design, offloaded through the public API under RAM ceilings (issue 36: "a hidden check runs its
own models under RAM ceilings through the public API").

Each case is a tiny model re-created from a peer library's own tests (the file is named in the case: the zoo's
CASES, tests/zoo/zoo_models.py, and Gemma from transformers' tests/models/gemma/test_modeling_gemma.py, whose
GemmaModelTester takes tests/causal_lm_tester.py's CausalLMModelTester defaults), in fp32, fp16 or bf16; tied
weights (accelerate's ModelForTestTiedWeights, T5's shared embedding, Gemma's tied lm_head), non-persistent buffers
(accelerate's ModelForTestNonPersistentBuffers, the rotary tables), one built on the meta device and loaded from its
safetensors file. Only names in `offload.__all__` are used: `offload_module`, `OffloadConfig(ram_budget_bytes=...,
host_compression=..., disk_path=...)`, `RamCeilingError`, the handle's `report()` and `host_memory()`.

For each model, ceilings of 30%, 60%, 80% and 100% of its bytes, with host_compression "auto", "lossless" and "off",
every block streamed (vram_fraction=0):
- the plan keeps the ceiling: `host_memory()["ram"]` (blocks, weights outside them, bounce buffers) and the
  report's `host_bytes` are at most the ceiling; or the offload is refused up front with a `RamCeilingError` that
  names `ram_budget_bytes` and what to change, the model untouched (it still gives the plain outputs);
- outputs are bitwise the plain model's, twice, under the host-master guard (tests/host_master_guard.py);
- a block held compressed holds fewer bytes than raw, a raw one exactly its raw bytes; "off" compresses nothing;
- "auto" is never worse than "off": refused only where "off" is, and no more blocks on the disk tier (nor bytes read
  from disk); "lossless" neither.
Without a disk file, a ceiling below the model is kept by compression or refused naming disk_path.

The peers' widths leave most matrices below the codec's 4 KiB minimum in half precision, where nothing compresses:
the `_wide` cases (the same testers with hidden sizes x4, marked where noted) are where compression pays, and there
"auto" must keep strictly fewer blocks on disk than "off" at one of the ceilings at least (bf16 at 80%; fp16, whose
weights take about 0.9 of raw, at 100%, where "off" loses a block to the bounce buffers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, RamCeilingError, VramBudget, offload_module
from tests.host_master_guard import host_master_guard
from tests.zoo.zoo_models import CASES, call, randint

pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.filterwarnings("ignore:.*FluxPosEmbed.*:FutureWarning")]

CEILINGS = (0.3, 0.6, 0.8, 1.0)
MODES = ("auto", "lossless", "off")


@dataclass(frozen=True)
class Case:
    name: str
    peer: str  # the peer test file imitated
    build: Callable[[], nn.Module]  # seeded, eval mode, fp32
    inputs: Callable[[], dict[str, Any]]
    dtype: torch.dtype
    meta: bool = False  # built on the meta device, loaded from its safetensors file
    pays: bool = False  # compression pays on enough blocks that "auto" keeps fewer on disk than "off" at 80%


def _zoo(name: str) -> tuple[str, Callable[[], nn.Module], Callable[[], dict[str, Any]]]:
    case = CASES[name]
    return case.peer, case.build, lambda: case.inputs(0)


def _gemma(wide: int = 1) -> Callable[[], nn.Module]:
    """transformers tests/models/gemma/test_modeling_gemma.py GemmaModelTester (CausalLMModelTester's defaults:
    vocab 99, hidden 32, 2 layers, 2 heads, 2 KV heads, intermediate 37, gelu; Gemma ties lm_head to the
    embedding), the widths times `wide`."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        cfg = transformers.GemmaConfig(vocab_size=99, hidden_size=32 * wide, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=2, intermediate_size=37 * wide,
                                       head_dim=16 * wide, hidden_act="gelu", max_position_embeddings=512,
                                       initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return transformers.GemmaForCausalLM(cfg).eval()
    return build


def _llama_wide() -> nn.Module:
    """transformers tests/models/llama/test_modeling_llama.py LlamaModelTester, hidden and intermediate x4."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=99, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=148, max_position_embeddings=512,
                                   initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(cfg).eval()


def _flux_wide() -> nn.Module:
    """diffusers tests/models/transformers/test_models_transformer_flux.py, attention_head_dim 16 -> 64."""
    import diffusers

    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2,
                                            attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
                                            pooled_projection_dim=32, axes_dims_rope=[16, 16, 32]).eval()


def _ids() -> dict[str, Any]:
    return {"input_ids": randint(99, 2, 7, seed=1), "use_cache": False}


def _cases() -> list[Case]:
    out = []
    for name, dtype in (("flux", torch.bfloat16), ("sd3", torch.float32), ("wan", torch.float16),
                        ("t5_encoder", torch.bfloat16), ("llama", torch.float32), ("qwen2", torch.float16),
                        ("acc_tied_weights", torch.float32), ("acc_non_persistent_buffers", torch.float16)):
        peer, build, inputs = _zoo(name)
        out.append(Case(f"{name}_{str(dtype)[6:]}", peer, build, inputs, dtype))
    peer, build, inputs = _zoo("llama")
    out.append(Case("llama_meta_bfloat16", peer, build, inputs, torch.bfloat16, meta=True))
    gemma = "transformers tests/models/gemma/test_modeling_gemma.py GemmaModelTester"
    out.append(Case("gemma_bfloat16", gemma, _gemma(), _ids, torch.bfloat16))
    out.append(Case("gemma_wide_bfloat16", gemma + " (widths x4)", _gemma(4), _ids, torch.bfloat16, pays=True))
    out.append(Case("llama_wide_float16", "transformers tests/models/llama/test_modeling_llama.py (widths x4)",
                    _llama_wide, _ids, torch.float16, pays=True))
    flux_peer, _, flux_inputs = _zoo("flux")
    out.append(Case("flux_wide_bfloat16", flux_peer + " (head dim x4)", _flux_wide, flux_inputs, torch.bfloat16,
                    meta=True, pays=True))
    return out


ALL = {c.name: c for c in _cases()}
HEAVY = {"flux_wide_bfloat16", "llama_wide_float16"}  # each repeats what a lighter case already checks
PARAMS = [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in ALL]


def _cast_inputs(inputs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inputs.items()}


def _model(case: Case, path: str | None = None) -> nn.Module:
    if not case.meta or path is None:
        return case.build().to(case.dtype)
    with torch.device("meta"):
        model = case.build()
    return model.to(case.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits, NaNs included (fp16 random weights can overflow the same way twice)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref), what
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), f"{what}: output {i}"


def _model_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if not t.is_meta else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _offload_under(case: Case, ceiling: int, mode: str, path: str | None, ref: list[torch.Tensor]) -> dict | None:
    """One model offloaded under `ceiling` with `mode`: its report's figures, or None where refused (checked)."""
    model = _model(case, path)
    what = f"{case.name} ({case.peer}) under {ceiling} bytes, host_compression={mode!r}"
    config = OffloadConfig(device="sim", vram_fraction=0, ram_budget_bytes=ceiling, host_compression=mode,
                           disk_path=path)
    try:
        handle = offload_module(model, config, budget=VramBudget(None))
    except RamCeilingError as exc:
        msg = str(exc)
        assert "ram_budget_bytes" in msg and (path is not None or "disk_path" in msg or "compress" in msg), msg
        if not case.meta:  # refused before any work was lost: the model is as it was
            with torch.no_grad():
                _assert_bitwise(call(model, _cast_inputs(case.inputs(), case.dtype)), ref, what + " after refusal")
        return None
    inputs = _cast_inputs(case.inputs(), case.dtype)
    for _ in range(2):
        with torch.no_grad(), host_master_guard(handle):
            _assert_bitwise(call(model, inputs), ref, what)
    report, ram = handle.report(), handle.host_memory()["ram"]
    assert ram <= ceiling, f"{what}: {ram} bytes of host RAM"
    assert report.host_bytes <= ceiling, f"{what}: the blocks hold {report.host_bytes} bytes"
    assert report.host_private_bytes + report.host_shared_bytes == ram, what
    for b in report.blocks:  # a disk-tier block holds no RAM (its `compression`: the form a packed folder stores)
        if b.tier == "disk":
            assert b.host_bytes == 0, (what, b.name, b.host_bytes)
        elif b.compression == "none":
            assert b.host_bytes == b.raw_bytes, (what, b.name, b.tier, b.host_bytes)
        else:
            assert b.host_bytes < b.raw_bytes, (what, b.name, b.host_bytes, b.raw_bytes)
    in_ram = [b for b in report.blocks if b.tier != "disk"]
    if mode == "off":
        assert all(b.compression == "none" for b in in_ram), what
    out = dict(disk=report.tiers["disk"], disk_read=report.disk_bytes_read, ram=ram,
               compressed=sum(b.compression != "none" for b in in_ram), blocks=len(report.blocks))
    handle.detach()
    return out


@pytest.mark.parametrize("name", PARAMS)
def test_ram_ceilings_are_kept_bitwise(name, tmp_path):
    case = ALL[name]
    torch.set_num_threads(1)  # tiny matmuls; deterministic on a shared CPU
    plain = case.build().to(case.dtype)
    with torch.no_grad():
        ref = call(plain, _cast_inputs(case.inputs(), case.dtype))
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_model(plain, path)
    total = _model_bytes(plain)
    del plain
    results: dict[tuple[float, str], dict | None] = {}
    for frac in CEILINGS:
        for mode in MODES:
            results[frac, mode] = _offload_under(case, int(frac * total), mode, path, ref)
        off = results[frac, "off"]
        for mode in ("auto", "lossless"):
            got = results[frac, mode]
            if got is None:
                assert off is None, f"{name} at {frac:.0%}: {mode!r} refused where 'off' plans"
            elif off is not None:
                assert got["disk"] <= off["disk"] and got["disk_read"] <= off["disk_read"], (name, frac, mode, got,
                                                                                             off)
    if case.pays:  # compression keeps a block off the disk tier that "off" sends there
        kept = [frac for frac in CEILINGS if results[frac, "auto"] is not None and results[frac, "off"] is not None
                and results[frac, "auto"]["disk"] < results[frac, "off"]["disk"]]
        assert kept and all(results[f, "auto"]["compressed"] for f in kept), (name, results)
    # no file to stream from: compression keeps the ceiling, or the refusal names disk_path
    if not case.meta:
        for mode in MODES:
            _offload_under(case, int(0.8 * total), mode, None, ref)


@pytest.mark.parametrize("frac,mode", [(0.8, "auto"), (0.6, "lossless"), (0.6, "off")])
def test_backward_under_a_ram_ceiling_is_bitwise(frac, mode, tmp_path):
    """Gradients through a frozen model (what a LoRA or an embedding being trained needs) under a RAM ceiling: the
    blocks held compressed, on the disk tier, or both, give the plain model's gradients bit for bit."""
    case = ALL["gemma_wide_bfloat16"]
    torch.set_num_threads(1)

    def grads(model: nn.Module) -> list[torch.Tensor]:
        model.requires_grad_(False)
        ids = torch.tensor([[1, 5, 9, 13, 2, 7, 40]])
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = model(inputs_embeds=emb, use_cache=False).logits
        out.float().square().sum().backward()
        return [out.detach(), emb.grad]

    plain = _model(case)
    ref = grads(plain)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_model(plain, path)
    ceiling = int(frac * _model_bytes(plain))
    model = _model(case)
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0, ram_budget_bytes=ceiling,
                                                 host_compression=mode, disk_path=path), budget=VramBudget(None))
    with host_master_guard(handle):
        _assert_bitwise(grads(model), ref, f"backward under {frac:.0%} with {mode!r}")
    report = handle.report()
    assert handle.host_memory()["ram"] <= ceiling
    assert all(b.backward_calls > 0 for b in report.blocks)
    held = sum(b.compression != "none" for b in report.blocks)
    assert (held > 0) == (mode != "off"), [(b.name, b.tier, b.compression) for b in report.blocks]
    if frac == 0.8:
        assert report.tiers["disk"] == 0
    else:
        assert report.tiers["disk"] > 0


@pytest.mark.parametrize("name", ["gemma_wide_bfloat16", pytest.param("flux_wide_bfloat16", marks=pytest.mark.slow)])
def test_packed_compressed_folder_under_ram_ceilings(name, tmp_path):
    """The disk tier from a folder packed with `handle.pack(..., compress=True)` (issue 36 part 3): under the same
    ceilings and modes, outputs bitwise, the ceiling kept, "auto" never more on disk than "off"."""
    case = ALL[name]
    torch.set_num_threads(1)
    plain = case.build().to(case.dtype)
    with torch.no_grad():
        ref = call(plain, _cast_inputs(case.inputs(), case.dtype))
    total = _model_bytes(plain)
    packer = offload_module(plain, OffloadConfig(device="sim", vram_fraction=0), budget=VramBudget(None))
    with torch.no_grad():
        call(plain, _cast_inputs(case.inputs(), case.dtype))  # the call order the folder is laid out in
    folder = str(tmp_path / "packed")
    packer.pack(folder, compress=True)
    packer.detach()
    for frac in (0.3, 0.6, 0.8):
        got = {mode: _offload_under(case, int(frac * total), mode, folder, ref) for mode in MODES}
        if got["off"] is not None:
            for mode in ("auto", "lossless"):
                assert got[mode] is not None and got[mode]["disk"] <= got["off"]["disk"], (name, frac, got)
