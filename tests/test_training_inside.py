"""Training in the order people set it up (issue 25): adapters or trainable norms are inside the blocks BEFORE the
model is offloaded (peft's `get_peft_model`, a LayerNorm left trainable over a frozen base). Those parameters live
on the device for the whole run, outside the streamed bytes (with the weights outside the blocks, so every plan
holds them: `rest_bytes`); the frozen weights stream, forward and backward. Five AdamW steps are bitwise those of the
plain model, with and without gradient checkpointing (reentrant and not), every block streamed; the optimizer updates
the parameters in place on the device, the state_dict reads them, and detach() gives them back as ordinary parameters
with their trained values."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

from offload.demo.reference_models import TransformerStack
from offload.model.layout import ALIGN, align
from tests.models import LayersModel, seeded

STEPS = 5
# the no_grad forward after detach() runs the reentrant checkpoint without an input requiring grad (as the plain one)
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")


class CkptTransformerStack(TransformerStack):
    """The demo transformer, its block loop as transformers writes it: gradient checkpointing around each block call
    (`self._gradient_checkpointing_func(layer.__call__, ...)`, modeling_llama.py), set up before offloading."""

    ckpt: bool | None = None  # None: off; True: use_reentrant=True; False: use_reentrant=False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.ckpt is None else checkpoint.checkpoint(block.__call__, x, use_reentrant=self.ckpt)
        return self.head(self.norm(x))


class CkptLayersModel(LayersModel):
    ckpt: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x) if self.ckpt is None else checkpoint.checkpoint(layer.__call__, x, use_reentrant=self.ckpt)
        return self.out(x)


def peft_model(ckpt):
    """peft's LoRA on every Linear of the blocks, through get_peft_model (base weights frozen by peft)."""
    peft = pytest.importorskip("peft")
    model = seeded(CkptTransformerStack, dim=64, depth=4, heads=4)
    model.ckpt = ckpt
    torch.manual_seed(7)  # peft's random init (init_lora_weights=False: A and B both random, so both train at once)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["qkv", "proj", "fc1", "fc2"])
    wrapped = peft.get_peft_model(model, config)
    blocks = list(model.blocks)
    return wrapped, blocks


def norm_model(ckpt):
    """A frozen MLP stack whose blocks' LayerNorms train (weight and bias)."""
    model = seeded(CkptLayersModel, dim=64, depth=5)
    model.ckpt = ckpt
    model.requires_grad_(False)
    for layer in model.layers:
        layer.norm.requires_grad_(True)
    return model, list(model.layers)


BUILDERS = {"peft_lora": peft_model, "layernorm": norm_model}
CKPT = {"none": None, "reentrant": True, "non_reentrant": False}


def _aligned(tensors) -> int:
    return sum(align(t.numel() * t.element_size()) for t in tensors)


def streaming_budget(model, blocks, slots=2) -> int:
    """The weights outside the blocks and the blocks' trainable parameters (all on the device), plus `slots` of the
    largest block's frozen weights: no block can be resident, every one streams."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    trainable = [p for b in blocks for p in b.parameters() if p.requires_grad]
    outside = [p for p in model.parameters() if id(p) not in inside] + list(model.buffers())
    frozen = max(_aligned([p for p in b.parameters() if not p.requires_grad]) for b in blocks)
    return max(_aligned(outside + trainable), ALIGN) + slots * frozen + 2 * ALIGN


def inputs(ckpt):
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(2, 8, 64, generator=g) for _ in range(2)]
    if ckpt is True:  # reentrant checkpointing backprops into a region only when an input requires grad
        xs = [x.requires_grad_() for x in xs]
    return xs


def train(model, params, xs):
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(xs[step % len(xs)]).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def run(name, ckpt_mode, offload=None, cfg=None):
    ckpt = CKPT[ckpt_mode]
    model, blocks = BUILDERS[name](ckpt)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and len(params) < len(list(model.parameters()))
    handle = None
    if offload is not None:
        handle = offload(model, cfg(vram_budget_bytes=streaming_budget(model, blocks)))
    xs = inputs(ckpt)
    losses = train(model, params, xs)
    return model, blocks, params, handle, losses


@pytest.fixture
def budget_cfg():
    from offload import OffloadConfig

    def make(**kw):
        return OffloadConfig.from_preset("budget", device="sim", prefetch=1, **kw)

    return make


def _unit_tensor_ids(handle) -> set[int]:
    return {id(e.own()) for u in handle.streamer.staged.units for e in u.layout.entries}


@pytest.mark.parametrize("ckpt_mode", list(CKPT))
@pytest.mark.parametrize("name", list(BUILDERS))
def test_trainable_inside_blocks_trains_bitwise_and_streams_the_frozen_weights(name, ckpt_mode, offload, budget_cfg):
    ref_model, _, ref_params, _, ref_losses = run(name, ckpt_mode)
    model, blocks, params, handle, losses = run(name, ckpt_mode, offload, budget_cfg)

    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert len(params) == len(ref_params)
    differ = [i for i, (a, b) in enumerate(zip(params, ref_params)) if not torch.equal(a.detach(), b.detach())]
    assert not differ, f"{len(differ)} of {len(params)} trained parameters differ"
    fresh = [p for p in BUILDERS[name](CKPT[ckpt_mode])[0].parameters() if p.requires_grad]
    assert all(not torch.equal(p.detach(), q) for p, q in zip(params, fresh)), "every trainable parameter trained"

    # every block streamed, forward and backward; only frozen weights move
    report = handle.report()
    assert all(b.tier != "vram" for b in report.blocks), [b.tier for b in report.blocks]
    frozen = [_aligned([p for p in b.parameters() if not p.requires_grad] + list(b.buffers())) for b in blocks]
    assert [b.bytes for b in report.blocks] == [max(n, ALIGN) for n in frozen]
    for b in report.blocks:
        assert b.calls >= STEPS and b.backward_calls >= STEPS
        assert b.bytes_streamed == b.calls * b.bytes
    # the trainable parameters are outside every unit's flat buffer; their bytes are in the device bytes every plan
    # holds (rest_bytes), and they sit in the rest's device buffer: the optimizer updated them there, in place
    streamer = handle.streamer
    assert not {id(p) for p in params} & _unit_tensor_ids(handle)
    assert streamer.rest_bytes >= _aligned(params)
    rest = streamer.placement.rest_buf
    assert rest is not None
    assert all(p.untyped_storage().data_ptr() == rest.untyped_storage().data_ptr() for p in params)
    assert all(handle.backend.owns(p) for p in params)
    assert report.peak_device_bytes <= handle.config.vram_budget_bytes

    # the state_dict reads the trained values
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    assert sorted(sd) == sorted(ref_sd)
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)

    # detach: the same Parameter objects, ordinary tensors off the device, with their trained values
    trained = [p.detach().clone() for p in params]
    handle.detach()
    now = [p for p in model.parameters() if p.requires_grad]
    assert [id(p) for p in now] == [id(p) for p in params]
    assert all(type(p) is nn.Parameter and p.requires_grad and not handle.backend.owns(p) for p in params)
    assert all(torch.equal(p.detach(), t) for p, t in zip(params, trained))
    x = inputs(None)[0]
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))


def test_trained_values_survive_an_unload(offload, budget_cfg):
    """The device copy is the truth for trained parameters: an unload (the budget wanting the memory back) writes
    them to the host first, so the state_dict, the next steps and detach() see the trained values."""
    ref_model, _, ref_params, _, ref_losses = run("layernorm", "none")
    model, blocks = norm_model(None)
    params = [p for p in model.parameters() if p.requires_grad]
    handle = offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, blocks)))
    xs = inputs(None)
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = model(xs[step % len(xs)]).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        handle.unload()  # everything off the device between steps
        sd = model.state_dict()
        assert all(torch.equal(sd[k], p) for k, p in zip(_names(model, params), params))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params))
    handle.detach()
    assert all(torch.equal(p.detach(), r.detach()) for p, r in zip(params, ref_params))


def _names(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_inference_setups_keep_streaming_every_weight(offload, budget_cfg):
    """Only a training setup keeps parameters on the device: every parameter requiring grad (any nn.Module's
    default), a model offloaded under no_grad / inference_mode, and trainable parameters that outweigh the frozen
    ones all stream as before (and a backward is refused naming the weight)."""
    from offload.stream.backward import TrainableWeightError

    def units_hold_everything(model, blocks, handle):
        ids = _unit_tensor_ids(handle)
        return all(id(p) in ids for b in blocks for p in b.parameters())

    x = inputs(None)[0]
    # the nn.Module default: everything requires grad
    model = seeded(LayersModel, dim=64, depth=4)
    handle = offload(model, budget_cfg())
    assert units_hold_everything(model, list(model.layers), handle)
    handle.detach()
    # a training setup offloaded for inference
    for ctx in (torch.no_grad, torch.inference_mode):
        model, blocks = norm_model(None)
        with ctx():
            handle = offload(model, budget_cfg())
        assert units_hold_everything(model, blocks, handle)
        out = model(x)
        with pytest.raises(TrainableWeightError, match="offloaded with gradients enabled"):
            out.square().mean().backward()
        handle.detach()
    # more trainable than frozen: not adapters (full fine-tuning of the blocks with a frozen input layer)
    model = seeded(LayersModel, dim=64, depth=4)
    model.layers[0].requires_grad_(False)
    handle = offload(model, budget_cfg())
    assert units_hold_everything(model, list(model.layers), handle)
