"""The zoo: tiny re-creations of the fixture models accelerate, diffusers and transformers use in their own test suites.

Each `ZooCase` names the peer test file it imitates and builds the model from that file's tiny config (random
weights, fixed seed), with the peer's dummy inputs and a second input shape (another batch size or spatial size).
Configs were read from huggingface/diffusers (tests/models/.../test_models_*.py `get_init_dict` /
`get_dummy_inputs`, tests/hooks/test_group_offloading.py), huggingface/transformers (tests/models/*/
test_modeling_*.py ModelTester defaults) and huggingface/accelerate (tests/test_modeling_utils.py,
tests/test_big_modeling.py); only what the installed library versions accept was changed (noted per case).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

Inputs = dict[str, Any]


@dataclass
class ZooCase:
    """One peer fixture: how to build it, feed it, and which checks apply."""

    name: str
    peer: str  # the peer test file imitated
    build: Callable[[], nn.Module]  # seeded; returns the model in eval mode
    inputs: Callable[[int], Inputs]  # variant 0: the peer's dummy inputs; 1: a second shape
    library: str = "torch"  # "diffusers" | "transformers" | "accelerate" | "torch"
    generate: Callable[[nn.Module, int], Any] | None = None  # decoders: greedy generate() on input variant
    units: list[str] | None = None  # explicit units (leaf-level cases)
    meta: bool = True  # can be rebuilt on the meta device and loaded from its file
    channels_last: bool = False  # convolutions: channels-last weights apply
    tags: set[str] = field(default_factory=set)

    def __str__(self) -> str:
        return self.name


def to_channels_last(model: nn.Module) -> nn.Module:
    """`model.to(memory_format=torch.channels_last)`, per tensor rank: 4-d weights channels_last, 5-d ones
    channels_last_3d (a video VAE holds both, and `Module.to` takes one format for all)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dim() in formats:
                t.data = t.data.contiguous(memory_format=formats[t.dim()])
    return model


def seeded_build(fn: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(seed)
        return fn().eval()
    return build


def _gen(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def randint(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen(seed))


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output (ModelOutput, tuple, dict, nested), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # ModelOutput and BaseOutput are dicts
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in output_tensors(v)]
    return []


def call(model: nn.Module, inputs: Inputs) -> list[torch.Tensor]:
    """The model's output tensors for `inputs` (a fresh copy of every tensor input: a model may write into one)."""
    kwargs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    args = kwargs.pop("__args__", ())
    return output_tensors(model(*args, **kwargs))


# accelerate --------------------------------------------------------------------------------------------------------
class ModelForTest(nn.Module):
    """accelerate tests/test_modeling_utils.py / tests/test_big_modeling.py"""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


class NestedModelForTest(nn.Module):
    """accelerate tests/test_modeling_utils.py: the real model under a single wrapper child."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ModelForTest()

    def forward(self, x):
        return self.model(x)


class BiggerModelForTest(nn.Module):
    """accelerate tests/test_big_modeling.py"""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.linear2 = nn.Linear(4, 5)
        self.batchnorm = nn.BatchNorm1d(5)
        self.linear3 = nn.Linear(5, 6)
        self.linear4 = nn.Linear(6, 5)

    def forward(self, x):
        return self.linear4(self.linear3(self.batchnorm(self.linear2(self.linear1(x)))))


class LinearWithNonPersistentBuffers(nn.Module):
    """accelerate tests/test_big_modeling.py: weight a persistent buffer, bias a non-persistent one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.ones((out_features, in_features), **factory_kwargs))
        if bias:
            self.register_buffer("bias", torch.ones(out_features, **factory_kwargs), persistent=False)
        else:
            self.register_buffer("bias", None)

    def forward(self, input):
        return torch.nn.functional.linear(input, self.weight, self.bias)


class ModelForTestNonPersistentBuffers(nn.Module):
    """accelerate tests/test_big_modeling.py"""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = LinearWithNonPersistentBuffers(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = LinearWithNonPersistentBuffers(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


class ModelForTestTiedWeights(nn.Module):
    """accelerate tests/test_big_modeling.py (tied by the test: linear2.weight = linear1.weight)"""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(4, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 4)
        self.linear2.weight = self.linear1.weight

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


class ModuleWithUnusedSubModules(nn.Module):
    """accelerate tests/test_big_modeling.py: reads its child's weight without calling the child."""

    def __init__(self, input_dim: int, output_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(input_dim, output_dim)

    def forward(self, x):
        return x @ self.linear.weight.t() + self.linear.bias


class ModelWithUnusedSubModulesForTest(nn.Module):
    """accelerate tests/test_big_modeling.py"""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = ModuleWithUnusedSubModules(3, 4)
        self.linear2 = ModuleWithUnusedSubModules(4, 5)
        self.batchnorm = nn.BatchNorm1d(5)
        self.linear3 = ModuleWithUnusedSubModules(5, 6)
        self.linear4 = ModuleWithUnusedSubModules(6, 5)

    def forward(self, x):
        return self.linear4(self.linear3(self.batchnorm(self.linear2(self.linear1(x)))))


def _accelerate_inputs(features: int) -> Callable[[int], Inputs]:
    return lambda v: {"x": randn(2 if v == 0 else 5, features, seed=v)}


# diffusers tests/hooks/test_group_offloading.py ---------------------------------------------------------------------
def _group_offloading_classes():
    from diffusers.models import ModelMixin

    class DummyBlock(nn.Module):
        def __init__(self, in_features: int, hidden_features: int, out_features: int) -> None:
            super().__init__()
            self.proj_in = nn.Linear(in_features, hidden_features)
            self.activation = nn.ReLU()
            self.proj_out = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            return self.proj_out(self.activation(self.proj_in(x)))

    class DummyModel(ModelMixin):
        def __init__(self, in_features: int, hidden_features: int, out_features: int, num_layers: int) -> None:
            super().__init__()
            self.linear_1 = nn.Linear(in_features, hidden_features)
            self.activation = nn.ReLU()
            self.blocks = nn.ModuleList(
                [DummyBlock(hidden_features, hidden_features, hidden_features) for _ in range(num_layers)])
            self.linear_2 = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            x = self.activation(self.linear_1(x))
            for block in self.blocks:
                x = block(x)
            return self.linear_2(x)

    class DummyModelWithMultipleBlocks(ModelMixin):
        def __init__(self, in_features, hidden_features, out_features, num_layers, num_single_layers) -> None:
            super().__init__()
            self.linear_1 = nn.Linear(in_features, hidden_features)
            self.activation = nn.ReLU()
            self.single_blocks = nn.ModuleList(
                [DummyBlock(hidden_features, hidden_features, hidden_features) for _ in range(num_single_layers)])
            self.double_blocks = nn.ModuleList(
                [DummyBlock(hidden_features, hidden_features, hidden_features) for _ in range(num_layers)])
            self.linear_2 = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            x = self.activation(self.linear_1(x))
            for block in self.double_blocks:  # called in another order than registered
                x = block(x)
            for block in self.single_blocks:
                x = block(x)
            return self.linear_2(x)

    class DummyModelWithLayerNorm(ModelMixin):
        def __init__(self, in_features, hidden_features, out_features, num_layers) -> None:
            super().__init__()
            self.linear_1 = nn.Linear(in_features, hidden_features)
            self.activation = nn.ReLU()
            self.blocks = nn.ModuleList(
                [DummyBlock(hidden_features, hidden_features, hidden_features) for _ in range(num_layers)])
            self.layer_norm = nn.LayerNorm(hidden_features, elementwise_affine=True)
            self.linear_2 = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            x = self.activation(self.linear_1(x))
            for block in self.blocks:
                x = block(x)
            return self.linear_2(self.layer_norm(x))

    class DummyModelWithStandaloneLayers(ModelMixin):
        def __init__(self, in_features, hidden_features, out_features) -> None:
            super().__init__()
            self.layer1 = nn.Linear(in_features, hidden_features)
            self.activation = nn.ReLU()
            self.layer2 = nn.Linear(hidden_features, hidden_features)
            self.layer3 = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            return self.layer3(self.layer2(self.activation(self.layer1(x))))

    class NestedContainer(nn.Module):
        def __init__(self, features: int) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(features, features), nn.Linear(features, features)])
            self.norm = nn.LayerNorm(features)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    class ContainerWithNestedModuleList(nn.Module):
        def __init__(self, features: int) -> None:
            super().__init__()
            self.proj_in = nn.Linear(features, features)
            self.nested_container = NestedContainer(features)
            self.proj_out = nn.Linear(features, features)

        def forward(self, x):
            return self.proj_out(self.nested_container(self.proj_in(x)))

    class DummyModelWithDeeplyNestedBlocks(ModelMixin):
        def __init__(self, in_features, hidden_features, out_features) -> None:
            super().__init__()
            self.input_layer = nn.Linear(in_features, hidden_features)
            self.container = ContainerWithNestedModuleList(hidden_features)
            self.output_layer = nn.Linear(hidden_features, out_features)

        def forward(self, x):
            return self.output_layer(self.container(self.input_layer(x)))

    return dict(DummyModel=DummyModel, DummyModelWithMultipleBlocks=DummyModelWithMultipleBlocks,
                DummyModelWithLayerNorm=DummyModelWithLayerNorm,
                DummyModelWithStandaloneLayers=DummyModelWithStandaloneLayers,
                DummyModelWithDeeplyNestedBlocks=DummyModelWithDeeplyNestedBlocks)


_GROUP = {}


def _group(name: str, **kw) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        if not _GROUP:
            _GROUP.update(_group_offloading_classes())
        return _GROUP[name](**kw)
    return make


def leaf_units(model: nn.Module) -> list[str]:
    """diffusers' offload_type="leaf_level": every leaf module holding weights is a unit (tensors of modules with
    children stay with the rest, as diffusers keeps them in a group of their own)."""
    return [n for n, m in model.named_modules() if n and not m._modules and (list(m.parameters(recurse=False)) or
                                                                             list(m.buffers(recurse=False)))]


# diffusers models ---------------------------------------------------------------------------------------------------
def _diffusers(cls_name: str, **config) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import diffusers

        return getattr(diffusers, cls_name)(**config)
    return make


def _flux_inputs(v: int, pooled: bool = True) -> Inputs:
    # tests/models/transformers/test_models_transformer_flux.py get_dummy_inputs (height = width = 4, seq 48)
    batch, hw, seq = (1, 4, 48) if v == 0 else (2, 2, 24)
    out = {"hidden_states": randn(batch, hw * hw, 4, seed=1), "encoder_hidden_states": randn(batch, seq, 32, seed=2),
           "img_ids": randn(hw * hw, 3, seed=4), "txt_ids": randn(seq, 3, seed=5),
           "timestep": torch.tensor([1.0]).expand(batch)}
    if pooled:
        out["pooled_projections"] = randn(batch, 32, seed=3)
    return out


def _wan_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_wan.py
    batch, frames, hw = (1, 2, 16) if v == 0 else (2, 1, 8)
    return {"hidden_states": randn(batch, 4, frames, hw, hw, seed=1), "encoder_hidden_states": randn(batch, 12, 16,
                                                                                                     seed=2),
            "timestep": randint(1000, batch, seed=3)}


def _hunyuan_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_hunyuan_video.py
    batch, hw = (1, 16) if v == 0 else (2, 8)
    return {"hidden_states": randn(batch, 4, 1, hw, hw, seed=1), "timestep": randint(1000, batch, seed=2).float(),
            "encoder_hidden_states": randn(batch, 12, 16, seed=3), "pooled_projections": randn(batch, 8, seed=4),
            "encoder_attention_mask": torch.ones(batch, 12), "guidance": randint(1000, batch, seed=5).float()}


def _ltx_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_ltx.py
    batch, frames, hw = (2, 2, 16) if v == 0 else (1, 1, 8)
    return {"hidden_states": randn(batch, frames * hw * hw, 4, seed=1), "encoder_hidden_states": randn(batch, 16, 16,
                                                                                                       seed=2),
            "timestep": randint(1000, batch, seed=3), "encoder_attention_mask": torch.ones(batch, 16).bool(),
            "num_frames": frames, "height": hw, "width": hw}


def _qwenimage_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_qwenimage.py
    batch, hw = (1, 4) if v == 0 else (2, 2)
    return {"hidden_states": randn(batch, hw * hw, 16, seed=1), "encoder_hidden_states": randn(batch, 8, 16, seed=2),
            "encoder_hidden_states_mask": torch.ones(batch, 8, dtype=torch.long),
            "timestep": torch.tensor([1.0]).expand(batch), "img_shapes": [(1, hw, hw)] * batch}


def _image_inputs(channels: int, size: int, batch: int, seed: int = 1, frames: int | None = None) -> torch.Tensor:
    shape = (batch, channels, size, size) if frames is None else (batch, channels, frames, size, size)
    return randn(*shape, seed=seed)


def _pixart_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_pixart_transformer2d.py (batch 4, sample 8)
    batch, size = (4, 8) if v == 0 else (2, 16)
    return {"hidden_states": _image_inputs(4, size, batch), "timestep": randint(1000, batch, seed=2),
            "encoder_hidden_states": randn(batch, 8, 8, seed=3),
            "added_cond_kwargs": {"aspect_ratio": None, "resolution": None}}


def _sana_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_sana.py
    batch, size = (2, 32) if v == 0 else (1, 16)
    return {"hidden_states": _image_inputs(4, size, batch), "encoder_hidden_states": randn(batch, 8, 8, seed=2),
            "timestep": randint(1000, batch, seed=3)}


def _sd3_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_sd3.py
    batch, size, seq = (1, 16, 77) if v == 0 else (2, 8, 20)  # the peer's (2, 32, 154) made this case 10x slower
    return {"hidden_states": _image_inputs(4, size, batch), "encoder_hidden_states": randn(batch, seq, 32, seed=2),
            "pooled_projections": randn(batch, 64, seed=3), "timestep": randint(1000, batch, seed=4)}


def _lumina2_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_lumina2.py
    batch, size = (2, 16) if v == 0 else (1, 8)
    return {"hidden_states": _image_inputs(4, size, batch), "encoder_hidden_states": randn(batch, 16, 32, seed=2),
            "timestep": torch.rand(batch, generator=_gen(3)),
            "encoder_attention_mask": torch.ones(batch, 16, dtype=torch.bool)}


def _dit_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_dit_transformer2d.py
    batch = 4 if v == 0 else 2
    return {"hidden_states": _image_inputs(4, 8, batch), "timestep": randint(1000, batch, seed=2),
            "class_labels": randint(4, batch, seed=3)}


def _latte_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_latte.py
    batch, frames = (2, 1) if v == 0 else (1, 1)
    return {"hidden_states": _image_inputs(4, 8, batch, frames=frames), "encoder_hidden_states": randn(batch, 8, 8,
                                                                                                       seed=2),
            "timestep": randint(1000, batch, seed=3), "enable_temporal_attentions": True}


def _omnigen_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_transformer_omnigen.py
    batch, size, seq = (2, 8, 24) if v == 0 else (1, 8, 24)
    attn = seq + 1 + size * size // 4
    return {"hidden_states": _image_inputs(4, size, batch), "timestep": torch.rand(batch, generator=_gen(2)),
            "input_ids": randint(10, batch, seq, seed=3), "input_img_latents": [_image_inputs(4, size, 1, seed=4)],
            "input_image_sizes": {0: [[0, size * size // 4]]}, "attention_mask": torch.ones(batch, attn, attn),
            "position_ids": torch.arange(attn).repeat(batch, 1)}


def _prior_inputs(v: int) -> Inputs:
    # tests/models/transformers/test_models_prior.py
    batch = 4 if v == 0 else 2
    return {"hidden_states": randn(batch, 8, seed=1), "timestep": 2, "proj_embedding": randn(batch, 8, seed=2),
            "encoder_hidden_states": randn(batch, 7, 8, seed=3)}


def _vae_inputs(v: int) -> Inputs:
    # tests/models/autoencoders/test_models_autoencoder_kl.py (batch 4, 32x32; 2 x 16x16 here)
    batch, size = (2, 16) if v == 0 else (1, 8)
    return {"sample": _image_inputs(3, size, batch)}


def _oobleck_inputs(v: int) -> Inputs:
    # tests/models/autoencoders/test_models_autoencoder_oobleck.py (batch 4, 2 channels, 24 samples; batch 2 here)
    batch, length = (2, 24) if v == 0 else (1, 48)
    return {"sample": randn(batch, 2, length, seed=1), "sample_posterior": False}


def _tiny_vae_inputs(v: int) -> Inputs:
    # tests/models/autoencoders/test_models_autoencoder_tiny.py (batch 4, 32x32; 2 x 16x16 here)
    batch, size = (2, 16) if v == 0 else (1, 8)
    return {"sample": _image_inputs(3, size, batch)}


def _consistency_inputs(v: int) -> Inputs:
    # tests/models/autoencoders/test_models_consistency_decoder_vae.py (batch 4, 32x32, a seeded generator;
    # 1 x 16x16 here)
    batch, size = (1, 16) if v == 0 else (2, 8)
    return {"sample": _image_inputs(3, size, batch), "generator": _gen(0)}


def _unet_cond_inputs(v: int) -> Inputs:
    # tests/models/unets/test_models_unet_2d_condition.py (batch 4; 1 here)
    batch, size = (1, 16) if v == 0 else (2, 8)
    return {"sample": _image_inputs(4, size, batch), "timestep": torch.tensor([10]),
            "encoder_hidden_states": randn(batch, 4, 8, seed=2)}


def _unet2d_inputs(v: int) -> Inputs:
    # tests/models/unets/test_models_unet_2d.py (UNet2DModel, batch 4, 32x32; 1 x 16x16 here)
    batch, size = (1, 16) if v == 0 else (2, 8)
    return {"sample": _image_inputs(3, size, batch), "timestep": torch.tensor([10])}


def _wan_vae_inputs(v: int) -> Inputs:
    # tests/models/autoencoders/test_models_autoencoder_wan.py (batch 2, 3 channels, 9 frames, 16x16; 1 x 5 x 8x8 here)
    batch, frames, size = (1, 5, 8) if v == 0 else (1, 1, 8)
    return {"sample": _image_inputs(3, size, batch, frames=frames)}


# transformers ------------------------------------------------------------------------------------------------------
def _hf(cls_name: str, config_name: str, **config) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, cls_name)(cfg)
    return make


def _ids_inputs(vocab: int, key: str = "input_ids", **extra) -> Callable[[int], Inputs]:
    def inputs(v: int) -> Inputs:
        batch, seq = (2, 7) if v == 0 else (3, 11)  # ModelTester seq_length 7
        out = {key: randint(vocab, batch, seq, seed=v + 1), **extra}
        return out
    return inputs


def _t5_inputs(v: int) -> Inputs:
    batch, seq = (2, 7) if v == 0 else (3, 11)
    return {"input_ids": randint(99, batch, seq, seed=1), "decoder_input_ids": randint(99, batch, 4, seed=2),
            "use_cache": False}


def _whisper_inputs(v: int) -> Inputs:
    # tests/models/whisper/test_modeling_whisper.py WhisperModelTester: 80 mel bins, seq_length 60
    batch = 2 if v == 0 else 3
    return {"input_features": randn(batch, 80, 60, seed=v + 1), "decoder_input_ids": randint(200, batch, 5, seed=2),
            "use_cache": False}


def _generate_ids(vocab: int) -> Callable[[nn.Module, int], Any]:
    def gen(model: nn.Module, v: int) -> Any:
        ids = randint(vocab, 2 if v == 0 else 1, 5 if v == 0 else 9, seed=7 + v)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
    return gen


def _generate_t5(model: nn.Module, v: int) -> Any:
    ids = randint(99, 2 if v == 0 else 1, 7, seed=9 + v)
    return model.generate(ids, max_new_tokens=4, do_sample=False)


def _generate_whisper(model: nn.Module, v: int) -> Any:
    feats = randn(2 if v == 0 else 1, 80, 60, seed=11 + v)
    return model.generate(feats, max_new_tokens=4, do_sample=False)


_LM = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=37, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_T5 = dict(vocab_size=99, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
           dropout_rate=0.1, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def _cases() -> list[ZooCase]:
    acc = "accelerate"
    go = "diffusers tests/hooks/test_group_offloading.py"
    dm = "diffusers tests/models/"
    tm = "transformers tests/models/"
    cases = [
        # accelerate
        ZooCase("acc_model_for_test", "accelerate tests/test_modeling_utils.py ModelForTest",
                seeded_build(ModelForTest), _accelerate_inputs(3), acc, tags={"batchnorm"}),
        ZooCase("acc_nested_model_for_test", "accelerate tests/test_modeling_utils.py NestedModelForTest",
                seeded_build(NestedModelForTest), _accelerate_inputs(3), acc, tags={"batchnorm"}),
        ZooCase("acc_bigger_model_for_test", "accelerate tests/test_big_modeling.py BiggerModelForTest",
                seeded_build(BiggerModelForTest), _accelerate_inputs(3), acc, tags={"batchnorm"}),
        ZooCase("acc_non_persistent_buffers", "accelerate tests/test_big_modeling.py ModelForTestNonPersistentBuffers",
                seeded_build(ModelForTestNonPersistentBuffers), _accelerate_inputs(3), acc, tags={"batchnorm"}),
        ZooCase("acc_tied_weights", "accelerate tests/test_big_modeling.py ModelForTestTiedWeights",
                seeded_build(ModelForTestTiedWeights), _accelerate_inputs(4), acc, tags={"batchnorm"}),
        ZooCase("acc_unused_submodules", "accelerate tests/test_big_modeling.py ModelWithUnusedSubModulesForTest",
                seeded_build(ModelWithUnusedSubModulesForTest), _accelerate_inputs(3), acc, tags={"batchnorm"}),
        ZooCase("acc_unused_submodules_leaf", "accelerate tests/test_big_modeling.py ModelWithUnusedSubModulesForTest"
                " (leaf-level units)", seeded_build(ModelWithUnusedSubModulesForTest), _accelerate_inputs(3), acc,
                units=["linear1.linear", "linear2.linear", "batchnorm", "linear3.linear", "linear4.linear"],
                tags={"batchnorm"}),
        # diffusers group offloading fixtures (in_features 64, hidden 256, out 64, 4 layers; input (4, 64))
        ZooCase("go_dummy_model", go + " DummyModel", seeded_build(_group("DummyModel", in_features=64,
                hidden_features=256, out_features=64, num_layers=4)), lambda v: {"x": randn(4 if v == 0 else 1, 64,
                                                                                           seed=v)}, "diffusers"),
        ZooCase("go_dummy_model_leaf", go + " DummyModel (offload_type=leaf_level)", seeded_build(_group(
            "DummyModel", in_features=64, hidden_features=256, out_features=64, num_layers=4)),
            lambda v: {"x": randn(4 if v == 0 else 1, 64, seed=v)}, "diffusers", units=["__leaf__"]),
        ZooCase("go_multiple_blocks", go + " DummyModelWithMultipleBlocks", seeded_build(_group(
            "DummyModelWithMultipleBlocks", in_features=64, hidden_features=256, out_features=64, num_layers=4,
            num_single_layers=5)), lambda v: {"x": randn(4 if v == 0 else 2, 64, seed=v)}, "diffusers"),
        ZooCase("go_layer_norm", go + " DummyModelWithLayerNorm", seeded_build(_group(
            "DummyModelWithLayerNorm", in_features=64, hidden_features=256, out_features=64, num_layers=4)),
            lambda v: {"x": randn(4 if v == 0 else 3, 64, seed=v)}, "diffusers"),
        ZooCase("go_standalone_layers", go + " DummyModelWithStandaloneLayers", seeded_build(_group(
            "DummyModelWithStandaloneLayers", in_features=64, hidden_features=256, out_features=64)),
            lambda v: {"x": randn(4 if v == 0 else 3, 64, seed=v)}, "diffusers"),
        ZooCase("go_deeply_nested", go + " DummyModelWithDeeplyNestedBlocks", seeded_build(_group(
            "DummyModelWithDeeplyNestedBlocks", in_features=64, hidden_features=256, out_features=64)),
            lambda v: {"x": randn(4 if v == 0 else 3, 64, seed=v)}, "diffusers"),
        ZooCase("go_deeply_nested_leaf", go + " DummyModelWithDeeplyNestedBlocks (offload_type=leaf_level)",
                seeded_build(_group("DummyModelWithDeeplyNestedBlocks", in_features=64, hidden_features=256,
                                    out_features=64)), lambda v: {"x": randn(4 if v == 0 else 3, 64, seed=v)},
                "diffusers", units=["__leaf__"]),
        # diffusers transformers
        ZooCase("flux", dm + "transformers/test_models_transformer_flux.py", seeded_build(_diffusers(
            "FluxTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8])), _flux_inputs, "diffusers"),
        ZooCase("chroma", dm + "transformers/test_models_transformer_chroma.py", seeded_build(_diffusers(
            "ChromaTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8],
            approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1)),
            lambda v: _flux_inputs(v, pooled=False), "diffusers"),
        ZooCase("wan", dm + "transformers/test_models_transformer_wan.py", seeded_build(_diffusers(
            "WanTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
            in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)), _wan_inputs, "diffusers"),
        ZooCase("hunyuan_video", dm + "transformers/test_models_transformer_hunyuan_video.py", seeded_build(
            _diffusers("HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                       attention_head_dim=10, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                       patch_size_t=1, guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
                       rope_axes_dim=(2, 4, 4), image_condition_type=None)), _hunyuan_inputs, "diffusers"),
        ZooCase("ltx", dm + "transformers/test_models_transformer_ltx.py", seeded_build(_diffusers(
            "LTXVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=1, qk_norm="rms_norm_across_heads", caption_channels=16)),
            _ltx_inputs, "diffusers"),
        ZooCase("qwenimage", dm + "transformers/test_models_transformer_qwenimage.py", seeded_build(_diffusers(
            "QwenImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
            axes_dims_rope=(8, 4, 4))), _qwenimage_inputs, "diffusers"),
        ZooCase("pixart", dm + "transformers/test_models_pixart_transformer2d.py", seeded_build(_diffusers(
            "PixArtTransformer2DModel", sample_size=8, num_layers=1, patch_size=2, attention_head_dim=2,
            num_attention_heads=2, in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
            activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
            norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=False, caption_channels=None)),
            _pixart_inputs, "diffusers"),
        ZooCase("sana", dm + "transformers/test_models_transformer_sana.py", seeded_build(_diffusers(
            "SanaTransformer2DModel", patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4,
            num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8,
            caption_channels=8, sample_size=32)), _sana_inputs, "diffusers", channels_last=True),
        ZooCase("sd3", dm + "transformers/test_models_transformer_sd3.py", seeded_build(_diffusers(
            "SD3Transformer2DModel", sample_size=32, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64,
            out_channels=4, pos_embed_max_size=96, dual_attention_layers=(), qk_norm=None)), _sd3_inputs,
            "diffusers"),
        ZooCase("lumina2", dm + "transformers/test_models_transformer_lumina2.py", seeded_build(_diffusers(
            "Lumina2Transformer2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
            num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None,
            norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128),
            cap_feat_dim=32)), _lumina2_inputs, "diffusers"),
        ZooCase("dit", dm + "transformers/test_models_dit_transformer2d.py", seeded_build(_diffusers(
            "DiTTransformer2DModel", in_channels=4, out_channels=8, activation_fn="gelu-approximate",
            num_attention_heads=2, attention_head_dim=4, attention_bias=True, num_layers=1, norm_type="ada_norm_zero",
            num_embeds_ada_norm=8, patch_size=2, sample_size=8)), _dit_inputs, "diffusers"),
        ZooCase("latte", dm + "transformers/test_models_transformer_latte.py", seeded_build(_diffusers(
            "LatteTransformer3DModel", sample_size=8, num_layers=1, patch_size=2, attention_head_dim=4,
            num_attention_heads=2, caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8,
            attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
            norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)), _latte_inputs, "diffusers"),
        # OmniGen: the peer's 20 layers cut to 2 (each adds nothing the zoo needs)
        ZooCase("omnigen", dm + "transformers/test_models_transformer_omnigen.py", seeded_build(_diffusers(
            "OmniGenTransformer2DModel", hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=32, num_layers=2, pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
            rope_scaling={"long_factor": list(range(1, 3)), "short_factor": list(range(1, 3))})), _omnigen_inputs,
            "diffusers"),
        ZooCase("prior", dm + "transformers/test_models_prior.py", seeded_build(_diffusers(
            "PriorTransformer", num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=8,
            num_embeddings=7, additional_embeddings=4)), _prior_inputs, "diffusers"),
        ZooCase("autoencoder_kl", dm + "autoencoders/test_models_autoencoder_kl.py", seeded_build(_diffusers(
            "AutoencoderKL", block_out_channels=[2, 4], in_channels=3, out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4,
            norm_num_groups=2)), _vae_inputs, "diffusers", channels_last=True),
        ZooCase("autoencoder_kl_wan", dm + "autoencoders/test_models_autoencoder_wan.py", seeded_build(_diffusers(
            "AutoencoderKLWan", base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True])), _wan_vae_inputs, "diffusers", channels_last=True),
        # weight_norm'ed convolutions: `weight` is an attribute recomputed before every forward
        ZooCase("autoencoder_oobleck", dm + "autoencoders/test_models_autoencoder_oobleck.py", seeded_build(_diffusers(
            "AutoencoderOobleck", encoder_hidden_size=12, decoder_channels=12, decoder_input_channels=6,
            audio_channels=2, downsampling_ratios=[2, 4], channel_multiples=[1, 2])), _oobleck_inputs, "diffusers"),
        ZooCase("autoencoder_tiny", dm + "autoencoders/test_models_autoencoder_tiny.py", seeded_build(_diffusers(
            "AutoencoderTiny", in_channels=3, out_channels=3, encoder_block_out_channels=[32, 32],
            decoder_block_out_channels=[32, 32], num_encoder_blocks=[1, 1], num_decoder_blocks=[1, 1])),
            _tiny_vae_inputs, "diffusers", channels_last=True),
        # keeps its scheduler (a plain object holding tensor tables) as an attribute
        ZooCase("consistency_decoder_vae", dm + "autoencoders/test_models_consistency_decoder_vae.py", seeded_build(
            _diffusers("ConsistencyDecoderVAE", encoder_block_out_channels=[2, 4], encoder_in_channels=3,
                       encoder_out_channels=4, encoder_down_block_types=["DownEncoderBlock2D"] * 2,
                       decoder_add_attention=False, decoder_block_out_channels=[2, 4],
                       decoder_down_block_types=["ResnetDownsampleBlock2D"] * 2, decoder_downsample_padding=1,
                       decoder_in_channels=7, decoder_layers_per_block=1, decoder_norm_eps=1e-05,
                       decoder_norm_num_groups=2, encoder_norm_num_groups=2, decoder_num_train_timesteps=1024,
                       decoder_out_channels=6, decoder_resnet_time_scale_shift="scale_shift",
                       decoder_time_embedding_type="learned", decoder_up_block_types=["ResnetUpsampleBlock2D"] * 2,
                       scaling_factor=1, latent_channels=4)), _consistency_inputs, "diffusers"),
        ZooCase("unet_2d_condition", dm + "unets/test_models_unet_2d_condition.py", seeded_build(_diffusers(
            "UNet2DConditionModel", block_out_channels=(4, 8), norm_num_groups=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=8, attention_head_dim=2, out_channels=4, in_channels=4, layers_per_block=1,
            sample_size=16)), _unet_cond_inputs, "diffusers", channels_last=True),
        ZooCase("unet_2d", dm + "unets/test_models_unet_2d.py", seeded_build(_diffusers(
            "UNet2DModel", block_out_channels=(4, 8), norm_num_groups=2, down_block_types=("DownBlock2D",
                                                                                          "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=3, out_channels=3, in_channels=3,
            layers_per_block=2, sample_size=32)), _unet2d_inputs, "diffusers", channels_last=True),
        # transformers (ModelTester defaults)
        ZooCase("t5_encoder", tm + "t5/test_modeling_t5.py T5EncoderOnlyModelTester", seeded_build(_hf(
            "T5EncoderModel", "T5Config", **_T5)), _ids_inputs(99), "transformers"),
        ZooCase("umt5_encoder", tm + "umt5/test_modeling_umt5.py UMT5EncoderOnlyModelTester", seeded_build(_hf(
            "UMT5EncoderModel", "UMT5Config", **_T5)), _ids_inputs(99), "transformers"),
        ZooCase("t5_conditional_generation", tm + "t5/test_modeling_t5.py T5ModelTester", seeded_build(_hf(
            "T5ForConditionalGeneration", "T5Config", **_T5)), _t5_inputs, "transformers", generate=_generate_t5),
        ZooCase("clip_text", tm + "clip/test_modeling_clip.py CLIPTextModelTester", seeded_build(_hf(
            "CLIPTextModel", "CLIPTextConfig", vocab_size=99, hidden_size=32, projection_dim=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=37, dropout=0.1, attention_dropout=0.1,
            max_position_embeddings=512)), _ids_inputs(99), "transformers"),
        ZooCase("llama", tm + "llama/test_modeling_llama.py LlamaModelTester", seeded_build(_hf(
            "LlamaForCausalLM", "LlamaConfig", **_LM)), _ids_inputs(99, use_cache=False), "transformers",
            generate=_generate_ids(99)),
        ZooCase("qwen2", tm + "qwen2/test_modeling_qwen2.py Qwen2ModelTester", seeded_build(_hf(
            "Qwen2ForCausalLM", "Qwen2Config", **_LM)), _ids_inputs(99, use_cache=False), "transformers",
            generate=_generate_ids(99)),
        ZooCase("mixtral", tm + "mixtral/test_modeling_mixtral.py MixtralModelTester", seeded_build(_hf(
            "MixtralForCausalLM", "MixtralConfig", **{**_LM, "intermediate_size": 32}, num_local_experts=4,
            num_experts_per_tok=2)),
            _ids_inputs(99, use_cache=False), "transformers", generate=_generate_ids(99)),
        ZooCase("qwen2_moe", tm + "qwen2_moe/test_modeling_qwen2_moe.py Qwen2MoeModelTester", seeded_build(_hf(
            "Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_LM, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=12, shared_expert_intermediate_size=36)), _ids_inputs(99, use_cache=False),
            "transformers", generate=_generate_ids(99)),
        ZooCase("whisper", tm + "whisper/test_modeling_whisper.py WhisperModelTester", seeded_build(_hf(
            "WhisperForConditionalGeneration", "WhisperConfig", vocab_size=200, d_model=16, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=16,
            decoder_ffn_dim=16, max_source_positions=30, max_target_positions=40, bos_token_id=98, eos_token_id=98,
            pad_token_id=0, num_mel_bins=80, decoder_start_token_id=85)), _whisper_inputs, "transformers",
            generate=_generate_whisper),
    ]
    # leaf-level units (diffusers' offload_type="leaf_level") on real models: T5's attention reads its
    # relative_attention_bias weight without calling it, so those leaves merge into their attention module
    by_name = {c.name: c for c in cases}
    for base in ("flux", "t5_encoder"):
        c = by_name[base]
        cases.append(ZooCase(f"{base}_leaf", c.peer + " (offload_type=leaf_level)", c.build, c.inputs, c.library,
                             units=["__leaf__"]))
    return cases


CASES: dict[str, ZooCase] = {c.name: c for c in _cases()}


def units_for(case: ZooCase, model: nn.Module) -> list[str] | None:
    if case.units == ["__leaf__"]:
        return leaf_units(model)
    return case.units
