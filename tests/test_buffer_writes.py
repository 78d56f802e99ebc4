"""Buffers a block writes during its own forward reach the host master (issue 25): the host copy stays the truth.

BatchNorm running statistics in train mode (written by the kernel without a version bump), a step counter written
in place (`steps += 1`) and one reassigned (`self.step = self.step + 1`): after N train-mode forwards the offloaded
model's buffers equal the plain model's, while attached (its state_dict reads the host masters), after `unload()`
and after `detach()`; an eval-mode forward afterwards uses the updated statistics. Before the fix the writes were
made on the slot and thrown away: `detach()` handed back the untouched statistics.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends.sim_clock import SimClock
from offload.stream.buffer_writes import BufferShapeError
from offload.model.layout import plan_layout, unit_tensors
from tests.host_master_guard import host_master_guard


class CountingBlock(nn.Module):
    """Conv + BatchNorm, a counter written in place and one reassigned each forward."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = torch.relu(self.bn(self.conv(x)))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.mean(dim=(0, 2, 3))  # reassigned, not written in place
        return h + x + self.steps.to(x.dtype) * 1e-3 + self.ema.view(1, -1, 1, 1)


class CountingNet(nn.Module):
    def __init__(self, n: int = 5, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.BatchNorm2d(c)  # outside the blocks: always resident
        self.blocks = nn.ModuleList(CountingBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


class ReusingNet(CountingNet):
    """Calls its first block again at the end of the pass: the second call must see the first call's writes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](super().forward(x))


def _inputs(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 8, 6, 6, generator=g) for _ in range(n)]


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _same_buffers(a: nn.Module, b: nn.Module, when: str) -> None:
    ba, bb = _buffers(a), _buffers(b)
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k], bb[k]), f"{when}: {k} differs from the plain model's"


def _unit_bytes(model: nn.Module) -> int:
    return plan_layout(unit_tensors(model.blocks[0])).nbytes


def _cfg(plan: str, model: nn.Module, tmp_path) -> OffloadConfig:
    if plan == "streamed":
        return OffloadConfig(device="sim", vram_fraction=0.0)
    unit = _unit_bytes(model)
    if plan == "mixed":  # the rest, two resident blocks and a ring of two slots
        rest = plan_layout([t for t in unit_tensors(model) if not any(t[0] is m for m in model.blocks.modules())])
        return OffloadConfig(device="sim", vram_budget_bytes=rest.nbytes + 4 * unit + 4096, prefetch=1)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "net.safetensors"
    safetensors_torch.save_model(model, str(path))
    return OffloadConfig(device="sim", vram_fraction=0.0, disk_path=str(path), ram_budget_bytes=6 * unit + 4096,
                         disk_optional=True)


@pytest.mark.parametrize("plan", ["streamed", "mixed", "disk"])
@pytest.mark.parametrize("cls", [CountingNet, ReusingNet])
def test_train_mode_buffers_reach_the_host_master(cls, plan, tmp_path):
    torch.manual_seed(0)
    plain = cls(n=8 if plan == "disk" else 5).train()
    model = copy.deepcopy(plain)
    handle = offload_module(model, _cfg(plan, model, tmp_path), budget=VramBudget(None))
    if plan == "disk":
        assert "disk" in [b.tier for b in handle.report().blocks]
    for step, x in enumerate(_inputs()):
        with torch.no_grad():
            ref = plain(x)
            with host_master_guard(handle):
                out = model(x)
        assert torch.equal(out, ref), f"{plan}: train-mode forward {step} differs"
        _same_buffers(model, plain, f"{plan}, attached, after forward {step}")
    tiers = [b.tier for b in handle.report().blocks]
    if plan == "mixed":
        assert "vram" in tiers and any(t != "vram" for t in tiers), tiers
    elif plan == "disk":
        assert "disk" not in tiers, f"written blocks stream from RAM now (the file has the old bytes): {tiers}"
    else:
        assert all(t != "vram" for t in tiers), tiers
    handle.unload()  # resident copies give their written bytes back to the host
    _same_buffers(model, plain, f"{plan}, after unload()")
    plain.eval()
    model.eval()
    x = _inputs(1)[0]
    with torch.no_grad():
        ref = plain(x)
        with host_master_guard(handle):
            assert torch.equal(model(x), ref), f"{plan}: eval forward after training uses other statistics"
    assert handle.report().total_bytes_streamed > 0
    handle.detach()
    _same_buffers(model, plain, f"{plan}, after detach()")


def test_a_buffer_reassigned_with_another_shape_is_refused_naming_it():
    """A forward that swaps an offloaded buffer for one of another shape is refused (the model keeps working)."""

    class Growing(CountingBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ema = torch.cat([self.ema, self.ema])
            return x

    model = CountingNet(n=3)
    model.blocks[1] = Growing()
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    with pytest.raises(BufferShapeError, match="ema"):
        with torch.no_grad():
            model(_inputs(1)[0])
    assert model.blocks[1].ema.shape == (8,)
    model.blocks[1].forward = lambda x: x  # the model still runs: no slot was lost
    with torch.no_grad():
        model(_inputs(1)[0])
    handle.detach()


def test_transformers_resnet_train_mode_statistics():
    """transformers' ResNet (BatchNorm in every layer), a config like tests/models/resnet/test_modeling_resnet.py's
    ResNetModelTester, in train mode with every block streamed: outputs and running statistics as the plain model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(num_channels=3, embedding_size=10, hidden_sizes=[10, 20, 30, 40],
                                       depths=[1, 1, 2, 1], hidden_act="relu", out_features=["stage2", "stage3"])
    torch.manual_seed(0)
    plain = transformers.ResNetModel(config).train()
    model = copy.deepcopy(plain)
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    assert all(b.tier != "vram" for b in handle.report().blocks)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(3, 3, 32, 32, generator=g)
        with torch.no_grad():
            ref = plain(x).last_hidden_state
            with host_master_guard(handle):
                out = model(x).last_hidden_state
        assert torch.equal(out, ref), f"forward {step}"
    _same_buffers(model, plain, "ResNet, attached")
    handle.detach()
    _same_buffers(model, plain, "ResNet, after detach()")


class TrainedBlock(CountingBlock):
    """CountingBlock whose running mean of activations carries no gradient history from one step to the next."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = torch.relu(self.bn(self.conv(x)))
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(dim=(0, 2, 3))
        return h + x + self.steps.to(x.dtype) * 1e-3 + self.ema.view(1, -1, 1, 1)


class CheckpointedNet(CountingNet):
    """Each block under non-reentrant activation checkpointing: backward re-runs its forward, which writes its
    buffers a second time on a plain model (BatchNorm statistics, the counters) - the offloaded one must too."""

    def __init__(self, n: int = 5, c: int = 8) -> None:
        super().__init__(n, c)
        self.blocks = nn.ModuleList(TrainedBlock(c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("plan", ["streamed", "mixed", "disk"])
def test_buffers_written_again_when_checkpointing_recomputes(plan, tmp_path):
    torch.manual_seed(0)
    plain = CheckpointedNet(n=8 if plan == "disk" else 5).train()
    plain.requires_grad_(False)  # frozen base weights, gradients to the input (as when training adapters)
    model = copy.deepcopy(plain)
    handle = offload_module(model, _cfg(plan, model, tmp_path), budget=VramBudget(None))
    for step, x in enumerate(_inputs(3)):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ref = plain(xa)
        ref.square().sum().backward()
        out = model(xb)
        out.square().sum().backward()
        assert torch.equal(out, ref), f"{plan}: forward {step} differs"
        assert torch.equal(xb.grad, xa.grad), f"{plan}: input gradient {step} differs"
        assert int(plain.blocks[0].steps) == 2 * (step + 1)  # the plain model counts each recompute
        _same_buffers(model, plain, f"{plan}, attached, after backward {step}")
    handle.unload()
    _same_buffers(model, plain, f"{plan}, after unload()")
    handle.detach()
    _same_buffers(model, plain, f"{plan}, after detach()")


def test_a_plan_the_measurements_ask_for_waits_for_the_backward_of_the_step(tmp_path):
    """Placement from measured costs plans again at the end of a forward. When that forward left a graph whose
    backward re-runs checkpointed blocks, each block must be where the forward had it (torch.utils.checkpoint compares
    what the forward and its re-run save, and a streamed block saves its weights as slot views): the new plan is
    placed once the backward ends. On the simulated device's own clock the costs ask for another plan after a step's
    forward (light blocks streamed, copies of 8 ms); every step matches the plain model's."""
    torch.manual_seed(0)
    plain = CheckpointedNet(n=5).train()
    plain.requires_grad_(False)
    model = copy.deepcopy(plain)
    clock = SimClock()
    for block, ms in zip(model.blocks, (0.01, 5.0, 0.01, 5.0, 5.0)):
        clock.charge(block, ms)
    cfg = _cfg("mixed", model, tmp_path).replace(sim_clock=clock, sim_bandwidth_gbps=_unit_bytes(model) / 8e-3 / 1e9)
    handle = offload_module(model, cfg, budget=VramBudget(None))
    moved = []
    for step, x in enumerate(_inputs(6)):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ref = plain(xa)
        ref.square().sum().backward()
        out = model(xb)
        during = set(handle.plan.resident)
        out.square().sum().backward()
        if set(handle.plan.resident) != during:
            moved.append(step)
        assert torch.equal(out, ref) and torch.equal(xb.grad, xa.grad), f"step {step}"
        _same_buffers(model, plain, f"after backward {step}")
    assert moved, "the measurements never asked for another plan after a forward: nothing was tested"
    handle.detach()


@pytest.mark.parametrize("plan", ["streamed", "mixed", "resident"])
def test_transformers_conformer_checkpointed_training_statistics(plan):
    """transformers' Wav2Vec2-Conformer (a BatchNorm1d in every layer's convolution module), a config like
    tests/models/wav2vec2_conformer/test_modeling_wav2vec2_conformer.py's Wav2Vec2ConformerModelTester with 4 layers
    (streamed, some resident, all resident), trained with its own gradient checkpointing: backward re-runs each
    layer's forward (transformers 5 checkpoints `forward`, so only the layer's children's hooks run again), which
    updates the BatchNorm statistics a second time on the plain model; outputs, input gradients and every buffer
    as the plain model's, attached and after detach()."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2ConformerConfig(
        hidden_size=16, feat_extract_norm="group", conv_dim=(32, 32, 32), conv_stride=(4, 4, 4),
        conv_kernel=(8, 8, 8), conv_bias=False, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        num_hidden_layers=4, num_attention_heads=2, intermediate_size=20, layer_norm_eps=1e-5, hidden_act="gelu",
        vocab_size=32, position_embeddings_type="relative",
        # deterministic training: no dropout, no layer drop, no SpecAugment masking (they draw random numbers)
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, conformer_conv_dropout=0.0, layerdrop=0.0, apply_spec_augment=False)
    torch.manual_seed(0)
    plain = transformers.Wav2Vec2ConformerModel(config).train()
    plain.freeze_feature_encoder()  # frozen base weights, gradients to the input (as when training adapters)
    plain.requires_grad_(False)
    enable = getattr(plain, "activation_checkpointing_enable", None)  # the name since transformers 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = copy.deepcopy(plain)
    layer = plan_layout(unit_tensors(model.encoder.layers[0])).nbytes
    rest = plan_layout([t for t in unit_tensors(model) if not any(t[0] is m for m in model.encoder.layers.modules())])
    cfg = {"streamed": OffloadConfig(device="sim", vram_fraction=0.0),
           "mixed": OffloadConfig(device="sim", vram_budget_bytes=rest.nbytes + 3 * layer + 4096, prefetch=1),
           "resident": OffloadConfig(device="sim")}[plan]
    handle = offload_module(model, cfg, budget=VramBudget(None))
    blocks = handle.report().blocks
    assert [b.name for b in blocks] == [f"encoder.layers.{i}" for i in range(4)], [b.name for b in blocks]
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        x = torch.randn(2, 1024, generator=g)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ref = plain(xa).last_hidden_state
        ref.square().sum().backward()
        out = model(xb).last_hidden_state
        out.square().sum().backward()
        assert torch.equal(out, ref), f"forward {step}"
        assert torch.equal(xb.grad, xa.grad), f"input gradient {step}"
    tiers = {b.tier for b in handle.report().blocks}
    assert tiers == {"streamed": {"pageable"}, "mixed": {"pageable", "vram"}, "resident": {"vram"}}[plan], tiers
    tracked = plain.encoder.layers[0].conv_module.batch_norm.num_batches_tracked
    assert int(tracked) == 4, "the plain model updates the statistics in the forward and again in its re-run"
    _same_buffers(model, plain, f"Conformer {plan}, attached")
    handle.detach()
    _same_buffers(model, plain, f"Conformer {plan}, after detach()")
