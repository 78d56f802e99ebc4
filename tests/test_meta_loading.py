"""Models built on the meta device load from their own safetensors file, whatever the library (issue 18).

Non-persistent buffers (transformers' rotary `inv_freq` / `original_inv_freq`, diffusers Wan's `freqs_cos` /
`freqs_sin`) are in no checkpoint: they are recomputed the way the model computes them, never expected from the
file. Each test saves a tiny randomly initialised model with safetensors, rebuilds it on the meta device, offloads it
from the file on the simulated device and compares with the normally loaded model bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

safetensors_torch = pytest.importorskip("safetensors.torch")

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402
from offload.model.meta_buffers import materialize_non_persistent_buffers, meta_non_persistent_buffers  # noqa: E402


def _save(model: nn.Module, path) -> str:
    safetensors_torch.save_model(model, str(path))  # drops tied duplicates (save_file refuses shared tensors)
    return str(path)


def _meta_context(how: str):
    if how == "torch.device":
        return torch.device("meta")
    accelerate = pytest.importorskip("accelerate")
    return accelerate.init_empty_weights(include_buffers=how == "init_empty_weights+buffers")


def _offload(model: nn.Module, path: str, **kw):
    cfg = OffloadConfig(device="sim", disk_path=path, **kw)
    return offload_module(model, cfg, budget=VramBudget(None))


def _all_real(model: nn.Module) -> bool:
    return not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


# transformers ---------------------------------------------------------------------------------------------------
transformers = None
try:
    import transformers  # noqa: F811
except ImportError:  # pragma: no cover
    pass

needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


def _tiny_config(kind: str):
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@needs_transformers
@pytest.mark.parametrize("how", ["torch.device", "init_empty_weights+buffers", "init_empty_weights"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_meta_transformers_decoder_loads_from_its_file(tmp_path, kind, how):
    """The issue's case: a Llama / Qwen2 built on the meta device, offloaded from its own file, gives the logits of
    the model loaded normally, bit for bit (before: CorruptFileError, missing 'model.rotary_emb.inv_freq')."""
    config, cls = _tiny_config(kind)
    torch.manual_seed(0)
    real = cls(config).eval()
    ref = _logits(real)
    path = _save(real, tmp_path / f"{kind}.safetensors")
    with _meta_context(how):
        model = cls(config).eval()
    assert all(p.is_meta for p in model.parameters())
    if how != "init_empty_weights":  # accelerate's default leaves buffers real: only the parameters come from the file
        assert "model.rotary_emb" in meta_non_persistent_buffers(model), "the rotary buffers start on the meta device"
    handle = _offload(model, path)
    assert _all_real(model)
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, real.model.rotary_emb.inv_freq)
    assert torch.equal(rotary.original_inv_freq, real.model.rotary_emb.original_inv_freq)
    for _ in range(2):
        assert torch.equal(_logits(model), ref)
    handle.detach()
    assert torch.equal(_logits(model), ref)


@needs_transformers
def test_meta_llama_streams_from_the_disk_tier(tmp_path):
    """With a RAM budget of about one block, blocks stream from the file; the rotary buffers are computed, not read."""
    config, cls = _tiny_config("llama")
    torch.manual_seed(0)
    real = cls(config).eval()
    ref = _logits(real)
    path = _save(real, tmp_path / "llama.safetensors")
    with torch.device("meta"):
        model = cls(config).eval()
    block = sum(p.numel() * p.element_size() for p in real.model.layers[0].parameters())
    handle = _offload(model, path, ram_budget_bytes=block + 8192)
    assert "disk" in [b.tier for b in handle.report().blocks]
    assert torch.equal(_logits(model), ref)
    handle.detach()


@needs_transformers
def test_meta_llama_in_bfloat16_keeps_the_buffer_dtype(tmp_path):
    """A model cast before it was saved: buffers take the cast dtype, as `.to(dtype)` gives the loaded model."""
    config, cls = _tiny_config("llama")
    torch.manual_seed(0)
    real = cls(config).to(torch.bfloat16).eval()
    ref = _logits(real)
    path = _save(real, tmp_path / "llama-bf16.safetensors")
    with torch.device("meta"):
        model = cls(config).to(torch.bfloat16).eval()
    handle = _offload(model, path)
    assert model.model.rotary_emb.inv_freq.dtype == real.model.rotary_emb.inv_freq.dtype
    assert torch.equal(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    assert torch.equal(_logits(model), ref)
    handle.detach()


# diffusers --------------------------------------------------------------------------------------------------------
diffusers = None
try:
    import diffusers  # noqa: F811
except ImportError:  # pragma: no cover
    pass

needs_diffusers = pytest.mark.skipif(diffusers is None, reason="diffusers is not installed (make bench-deps)")


def _wan():
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
               text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)
    return diffusers.WanTransformer3DModel(**cfg).eval(), {
        "hidden_states": torch.randn(1, 4, 2, 8, 8), "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 6, 16), "return_dict": False}


def _flux():
    cfg = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6))
    return diffusers.FluxTransformer2DModel(**cfg).eval(), {
        "hidden_states": torch.randn(1, 16, 8), "encoder_hidden_states": torch.randn(1, 5, 24),
        "pooled_projections": torch.randn(1, 12), "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(5, 3), "return_dict": False}


@needs_diffusers
@pytest.mark.parametrize("build", [_wan, _flux], ids=["wan", "flux"])
def test_meta_diffusers_transformer_loads_from_its_file(tmp_path, build):
    """diffusers Wan (non-persistent rotary tables) and Flux built on the meta device load from their file."""
    torch.manual_seed(0)
    real, inputs = build()
    with torch.no_grad():
        ref = real(**inputs)[0]
    path = _save(real, tmp_path / "dit.safetensors")
    with torch.device("meta"):
        torch.manual_seed(0)
        model, _ = build()
    handle = _offload(model, path)
    assert _all_real(model)
    for name, buf in real.named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name
    with torch.no_grad():
        out = model(**inputs)[0]
    assert torch.equal(out, ref)
    handle.detach()


# the rule on plain modules ----------------------------------------------------------------------------------------
class Rope(nn.Module):
    """A module whose non-persistent buffer depends on constructor arguments kept as attributes."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq.repeat(2)


class Hidden(nn.Module):
    """Its buffer depends on an argument it does not keep: it cannot be recomputed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(n).float(), persistent=False)


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3, base: float = 500.0) -> None:
        super().__init__()
        self.rope = Rope(dim, base)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rope(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_plain_module_buffer_is_rebuilt_by_its_constructor(tmp_path):
    """No library init: the module's constructor runs again on the CPU with its recovered (non-default) base."""
    torch.manual_seed(0)
    real = Net().eval()
    x = torch.randn(2, 16)
    ref = real(x)
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_file(real.state_dict(), str(path))
    with torch.device("meta"):
        model = Net().eval()
    handle = _offload(model, str(path))
    assert torch.equal(model.rope.inv_freq, real.rope.inv_freq)
    assert torch.equal(model(x), ref)
    handle.detach()


def test_a_buffer_that_cannot_be_recomputed_is_a_clear_error():
    with torch.device("meta"):
        holder = nn.Sequential(Hidden(5))
    with pytest.raises(ValueError, match=r"0\.table.*non-persistent"):
        materialize_non_persistent_buffers(holder)


def test_persistent_meta_buffers_still_come_from_the_file(tmp_path):
    """Only non-persistent buffers are recomputed: a persistent one is read from the file like a weight."""
    torch.manual_seed(0)
    real = Net().eval()
    real.rope.register_buffer("scale", torch.randn(16))  # persistent: in state_dict, so in the file
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_file(real.state_dict(), str(path))
    with torch.device("meta"):
        model = Net().eval()
        model.rope.register_buffer("scale", torch.empty(16))
    assert list(meta_non_persistent_buffers(model)) == ["rope"]
    handle = _offload(model, str(path))
    assert torch.equal(model.rope.scale, real.rope.scale)
    handle.detach()
