"""Training LoRA adapters through an offloaded model (issue 19): backward brings every streamed block back to a slot
in reverse order, and losses and trained tensors are bitwise those of the same training on the plain model, with and
without activation checkpointing (around the block call, reentrant or not, and ComfyUI's patch of `forward`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

from offload.backends.sim_clock import SimClock
from tests.models import CASES, LayersModel, TransformerStack, seeded, streaming_budget

STEPS = 3


class LoRAHook:
    """A LoRA adapter added after offloading as a forward hook on a Linear: out + x @ A @ B (A, B on the device)."""

    def __init__(self, lin: nn.Linear, rank: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(torch.randn(lin.in_features, rank, generator=g) * 0.1)
        self.B = nn.Parameter(torch.randn(rank, lin.out_features, generator=g) * 0.1)

    owns = None  # set on the offloaded run: backend.owns, to record where the base weight was each call
    on_host: list = []

    def __call__(self, module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        if LoRAHook.owns is not None and not LoRAHook.owns(module.weight):
            LoRAHook.on_host.append(torch.is_grad_enabled())  # a forward (or re-forward in backward) off the device
        x = args[0]
        return out + (x.to(self.A.dtype) @ self.A @ self.B).to(out.dtype)

    def parameters(self):
        return [self.A, self.B]


class LoRALinear(nn.Module):
    """The other common way: a wrapper module replacing the Linear (the base Linear stays in the block)."""

    def __init__(self, base: nn.Linear, rank: int, seed: int) -> None:
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(seed)
        self.down = nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.1)
        self.up = nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + nn.functional.linear(nn.functional.linear(x, self.down), self.up)


def block_lists(model: nn.Module) -> list[nn.ModuleList]:
    return [getattr(model, n) for n in ("blocks", "layers", "double_blocks", "single_blocks") if hasattr(model, n)]


def add_adapters(model: nn.Module, style: str) -> list[nn.Parameter]:
    params: list[nn.Parameter] = []
    seed = 0
    for blocks in block_lists(model):
        for block in blocks:
            for name, lin in list(block.named_modules()):
                if not isinstance(lin, nn.Linear):
                    continue
                seed += 1
                if style == "hook":
                    lora = LoRAHook(lin, 4, seed)
                    lin.register_forward_hook(lora)
                    params += lora.parameters()
                else:
                    parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                    wrapped = LoRALinear(lin, 4, seed)
                    setattr(parent, name.rpartition(".")[2], wrapped)
                    params += [wrapped.down, wrapped.up]
    return params


class Checkpointed(nn.Module):
    """torch.utils.checkpoint around the block call (the block's own hooks run again inside backward)."""

    def __init__(self, block: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.block = block
        self.reentrant = reentrant

    def forward(self, *args):
        return checkpoint.checkpoint(self.block, *args, use_reentrant=self.reentrant)


def patch_forward(m: nn.Module) -> None:
    """ComfyUI's TrainLoraNode gradient_checkpointing: the module's forward re-runs without its hooks."""
    org = m.forward

    def fwd(args, kwargs):
        return org(*args, **kwargs)

    m.forward = lambda *a, **k: checkpoint.checkpoint(fwd, a, k, use_reentrant=False)


def add_checkpointing(model: nn.Module, mode: str) -> None:
    for blocks in block_lists(model):
        for i, block in enumerate(blocks):
            if mode in ("module", "module_reentrant"):
                blocks[i] = Checkpointed(block, reentrant=mode == "module_reentrant")
            elif mode == "forward":
                patch_forward(block)


def loss_of(model: nn.Module, inputs, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*inputs)
    return out.float().square().mean()


def train(model: nn.Module, params, inputs, optimizer: str, autocast: bool = False):
    opt = (torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9))
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, inputs[step % len(inputs)], autocast)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in params]


MODELS = {
    "mlp": (lambda: seeded(LayersModel, dim=64, depth=5), lambda: (torch.randn(2, 8, 64),)),
    "transformer": (lambda: seeded(TransformerStack, dim=64, depth=4, heads=4), lambda: (torch.randn(2, 8, 64),)),
    "dit": (CASES["dit"].build, CASES["dit"].inputs),
}


def run_training(build, make_inputs, offload=None, cfg=None, style="hook", ckpt="none", optimizer="adamw",
                 autocast=False):
    model = build()
    model.requires_grad_(False)
    torch.manual_seed(1)
    inputs = [make_inputs() for _ in range(2)]
    if ckpt == "module_reentrant":  # reentrant checkpointing needs an input that requires grad to backprop at all
        inputs = [tuple(t.requires_grad_() if t.is_floating_point() else t for t in x) for x in inputs]
    handle = None
    if offload is not None:
        blocks = [b for bl in block_lists(model) for b in bl]
        budget = streaming_budget(model, blocks, slots=2)
        handle = offload(model, cfg(vram_budget_bytes=budget))
    params = add_adapters(model, style)
    add_checkpointing(model, ckpt)
    LoRAHook.owns = handle.backend.owns if handle is not None else None
    LoRAHook.on_host = []
    try:
        losses, trained = train(model, params, inputs, optimizer, autocast)
    finally:
        LoRAHook.owns = None
    # every block computed on weights in device memory, re-forwards inside backward (checkpointing) included
    assert not LoRAHook.on_host, f"{len(LoRAHook.on_host)} block layer call(s) ran on host weights"
    return model, handle, losses, trained


@pytest.fixture
def budget_cfg():
    from offload import OffloadConfig

    def make(**kw):
        return OffloadConfig.from_preset("budget", device="sim", prefetch=1, **kw)

    return make


def assert_same(ref, got):
    _, _, ref_losses, ref_trained = ref
    _, handle, losses, trained = got
    assert [float(x) for x in losses] == [float(x) for x in ref_losses]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert len(trained) == len(ref_trained)
    diff = [i for i, (a, b) in enumerate(zip(trained, ref_trained)) if not torch.equal(a, b)]
    assert not diff, f"{len(diff)} of {len(trained)} trained tensors differ"


def assert_streamed_backward(handle, budget_bytes=None):
    report = handle.report()
    assert all(b.tier != "vram" for b in report.blocks), "the budget preset must stream every block"
    for b in report.blocks:
        assert b.backward_calls >= STEPS, f"{b.name} was not brought back for backward"
        assert b.backward_bytes_streamed == b.backward_calls * b.bytes
    assert report.backward_bytes_streamed > 0
    assert report.total_bytes_streamed == sum(b.bytes_streamed + b.backward_bytes_streamed for b in report.blocks)
    assert report.to_dict()["backward_bytes_streamed"] == report.backward_bytes_streamed
    assert "backward" in report.summary()
    budget = handle.config.vram_budget_bytes
    assert report.peak_device_bytes <= budget
    assert handle.backend.peak_bytes <= budget  # everything the engine put on the device, backward included


@pytest.mark.parametrize("ckpt", ["none", "module", "module_reentrant", "forward"])
@pytest.mark.parametrize("model_name", ["mlp", "transformer", "dit"])
def test_lora_training_bitwise_equal(model_name, ckpt, offload, budget_cfg):
    build, make_inputs = MODELS[model_name]
    ref = run_training(build, make_inputs, ckpt=ckpt)
    got = run_training(build, make_inputs, offload, budget_cfg, ckpt=ckpt)
    assert_same(ref, got)
    assert_streamed_backward(got[1])


@pytest.mark.parametrize("ckpt", ["none", "module"])
def test_lora_wrapper_modules_sgd(ckpt, offload, budget_cfg):
    """Adapters as wrapper modules inside the block (added after offloading), SGD with momentum."""
    build, make_inputs = MODELS["transformer"]
    ref = run_training(build, make_inputs, style="wrap", ckpt=ckpt, optimizer="sgd")
    got = run_training(build, make_inputs, offload, budget_cfg, style="wrap", ckpt=ckpt, optimizer="sgd")
    assert_same(ref, got)
    assert_streamed_backward(got[1])


@pytest.mark.parametrize("ckpt", ["none", "forward"])
def test_lora_training_bf16_autocast(ckpt, offload, budget_cfg):
    """Mixed precision as ComfyUI trains: bf16 autocast over fp32 weights and adapters."""
    build, make_inputs = MODELS["dit"]
    ref = run_training(build, make_inputs, ckpt=ckpt, autocast=True)
    got = run_training(build, make_inputs, offload, budget_cfg, ckpt=ckpt, autocast=True)
    assert_same(ref, got)
    assert_streamed_backward(got[1])


def test_streamed_weight_requiring_grad_is_refused_before_the_forward(offload, budget_cfg):
    from offload.stream.backward import TrainableWeightError

    build, make_inputs = MODELS["transformer"]
    model = build()
    model.requires_grad_(False)
    x = make_inputs()
    with torch.no_grad():
        ref = model(*x)
    blocks = list(model.blocks)
    handle = offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, blocks, slots=2)))
    adapters = add_adapters(model, "hook")  # a training setup: adapters added after offloading
    for p in adapters:
        p.requires_grad_(False)
    with torch.no_grad():
        ref = model(*x)
    for p in adapters:
        p.requires_grad_(True)
    model.blocks[2].fc1.weight.requires_grad_(True)
    forwards = handle.report().forwards
    with pytest.raises(TrainableWeightError, match=r"'blocks\.2\.fc1\.weight' requires grad"):
        model(*x)
    rep = handle.report()
    assert sum(b.calls for b in rep.blocks) == len(rep.blocks), "no block may run before the refusal"
    with torch.no_grad():  # inference is unaffected
        assert torch.equal(model(*x), ref)
    model.blocks[2].fc1.weight.requires_grad_(False)
    out = model(*x)  # frozen again: a forward with grad enabled runs
    assert torch.equal(out, ref)
    assert handle.report().forwards > forwards


def test_resident_trainable_norm_and_streamed_adapters(offload, sim_cfg):
    """A trainable parameter in a block the plan keeps resident trains as on the plain model, while the streamed
    blocks' adapters train through backward streaming."""
    x = (torch.randn(2, 8, 64),)

    def go(handle_of=None, resident=None):
        model = seeded(LayersModel, dim=64, depth=5)
        model.requires_grad_(False)
        handle = None
        if handle_of is not None:
            handle = handle_of(model)
            handle.load()
            resident = next(i for i, b in enumerate(handle.report().blocks) if b.tier == "vram")
        model.layers[resident].norm.weight.requires_grad_(True)
        params = add_adapters(model, "hook") + [model.layers[resident].norm.weight]
        return handle, resident, train(model, params, [x], "adamw")

    # on a clock of the simulated device's own where nothing takes time: no measured cost moves the resident block
    handle, resident, (losses, trained) = go(
        lambda m: offload(m, sim_cfg(vram_budget_bytes=streaming_budget(m, list(m.layers), slots=3), prefetch=1,
                                     sim_clock=SimClock())))
    tiers = [b.tier for b in handle.report().blocks]
    assert tiers.count("vram") >= 1 and tiers.count("vram") < len(tiers)
    _, _, (ref_losses, ref_trained) = go(resident=resident)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(trained, ref_trained))
    assert handle.report().backward_bytes_streamed > 0


def test_inference_with_grad_enabled_keeps_no_slot(offload, budget_cfg):
    """A forward with grad enabled (frozen base, adapters requiring grad) saves handles, not slot memory: outputs
    are exact, and two graphs alive at once still backprop to the plain model's gradients."""
    build, make_inputs = MODELS["transformer"]
    plain = build().requires_grad_(False)
    model = build().requires_grad_(False)
    x1, x2 = make_inputs(), make_inputs()
    offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, list(model.blocks), slots=2)))
    p_plain = add_adapters(plain, "hook")
    p_off = add_adapters(model, "hook")
    ref1, ref2 = loss_of(plain, x1, False), loss_of(plain, x2, False)
    out1, out2 = loss_of(model, x1, False), loss_of(model, x2, False)
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)
    (ref1 + ref2).backward()
    out2.backward(retain_graph=True)  # the second graph first, then the first
    out1.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(p_plain, p_off))


def test_backward_after_detach_is_refused_clearly(offload, budget_cfg):
    build, make_inputs = MODELS["mlp"]
    model = build().requires_grad_(False)
    x = make_inputs()
    handle = offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, list(model.layers), slots=2)))
    add_adapters(model, "hook")
    loss = loss_of(model, x, False)
    handle.detach()
    with pytest.raises(RuntimeError, match="detached"):
        loss.backward()
    loss_of(model, x, False).backward()  # an ordinary module again: trains as one


def test_full_fine_tuning_of_streamed_blocks_is_refused_at_backward_start(offload, budget_cfg):
    """Every parameter requiring grad is any nn.Module's default (inference code that forgot no_grad): the forward
    runs exactly; a backward is refused, naming a streamed weight, before any parameter of the model gets a grad."""
    from offload.stream.backward import TrainableWeightError

    build, make_inputs = MODELS["transformer"]
    model = build()
    x = make_inputs()
    ref = model(*x).detach()
    offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, list(model.blocks), slots=2)))
    out = model(*x)
    assert torch.equal(out.detach(), ref)
    with pytest.raises(TrainableWeightError, match=r"'blocks\.0\.\w+\.weight' requires grad"):
        out.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())


def test_first_training_step_grows_the_activation_reserve(offload, budget_cfg):
    """The budget accounts for what training holds: after the first backward, a self-sized budget's activation
    reserve grows to the step's measured peak (saved activations, gradients, adapters), so later steps keep to it."""
    build, make_inputs = MODELS["mlp"]
    model = build().requires_grad_(False)
    x = make_inputs()
    handle = offload(model, budget_cfg(sim_capacity_bytes=8 << 30))  # no vram_budget_bytes: the budget sizes itself
    assert handle.budget.auto_sized
    params = add_adapters(model, "hook")
    total_before, reserve_before = handle.budget.total_bytes, handle.reserve_bytes
    step_peak = 3 << 30  # what the device's allocator would report as the step's peak
    with torch.no_grad():
        model(*x)  # the first forward (the simulated device has no allocator peak: the reserve stays)
    assert handle.reserve_bytes == reserve_before
    handle.backend.peak_allocated = lambda: step_peak
    train(model, params, [x], "sgd")
    assert handle.reserve_bytes >= step_peak - handle.budget.used_bytes
    assert handle.budget.total_bytes < total_before
    total = handle.budget.total_bytes
    train(model, params, [x], "sgd")
    assert handle.budget.total_bytes == total  # measured once


def _hook_adapters(blocks) -> list[nn.Parameter]:
    """LoRA hooks on every 2-D weight's module in the blocks (quantized layers included: float32 adapters)."""
    params: list[nn.Parameter] = []
    for block in blocks:
        for m in block.modules():
            w = getattr(m, "weight", None)
            if m is block or w is None or w.dim() != 2:
                continue
            g = torch.Generator().manual_seed(len(params))
            out_f, in_f = w.shape
            A = nn.Parameter(torch.randn(in_f, 4, generator=g) * 0.1)
            B = nn.Parameter(torch.randn(4, out_f, generator=g) * 0.1)
            m.register_forward_hook(lambda mod, args, out, A=A, B=B: out + args[0].float() @ A @ B)
            params += [A, B]
    return params


@pytest.mark.parametrize("case_name", ["int8_subclass", "fp8_e4m3"])
def test_lora_over_quantized_streamed_weights(case_name, offload, budget_cfg):
    """Blocks of float8 weights with their scales, and of a tensor-subclass weight (int8 data and scales moved through
    __tensor_flatten__), train adapters exactly as on the plain model."""
    case = CASES[case_name]
    results = []
    for off in (False, True):
        model = case.build().requires_grad_(False)
        torch.manual_seed(3)
        x = case.inputs()
        handle = None
        if off:
            handle = offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 2)))
        results.append(train(model, _hook_adapters(case.blocks(model)), [x], "adamw"))
    (ref_losses, ref_trained), (losses, trained) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(trained, ref_trained))
    assert_streamed_backward(handle)


class _MatmulSavingWeight(torch.autograd.Function):
    """x @ w.T that saves the (quantized, tensor-subclass) weight itself for backward, as custom kernels do."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x @ w.dequantize().t()

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad @ w.dequantize(), None


class _SavingQLinear(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        from tests.models import Int8WeightTensor

        self.weight = nn.Parameter(Int8WeightTensor.quantize(torch.randn(dim, dim) * 0.2), requires_grad=False)

    def forward(self, x):
        return _MatmulSavingWeight.apply(x, self.weight)


class _SavingStack(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(_SavingQLinear(dim), nn.Tanh()) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_saved_tensor_subclass_viewing_the_slot(offload, budget_cfg):
    """A weight saved for backward as a tensor subclass whose inner tensors view the slot is saved as a handle and
    rebuilt over the slot that holds its bytes in backward (without that, later blocks overwrite it)."""
    results = []
    for off in (False, True):
        torch.manual_seed(0)
        model = _SavingStack().requires_grad_(False)
        x = torch.randn(3, 32)
        handle = None
        if off:
            handle = offload(model, budget_cfg(vram_budget_bytes=streaming_budget(model, list(model.blocks), 2)))
        results.append(train(model, _hook_adapters(model.blocks), [(x,)], "adamw"))
    (ref_losses, ref_trained), (losses, trained) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(trained, ref_trained))
    assert_streamed_backward(handle)
