"""torch.compile of an offloaded model streams, whatever else was compiled in the process (issue 25).

dynamo skips guards on module hooks by default (`torch._dynamo.config.skip_nnmodule_hook_guards`): a graph traced for
another instance of the same class without hooks (a plain pipeline compiled first, Wan 2.2's other expert) was reused
for the offloaded instance, which then streamed 0 bytes and computed on its host masters (a device mismatch on CUDA).
Each test compiles a plain instance first, then offloads a second instance of the same class (every block streamed)
and compiles it, whole model or regionally (`torch.compile` of the root, `block.compile()` per block, diffusers'
`compile_repeated_blocks`).

What the compiled graphs really read is checked at run time: every case compiles through a recording backend that
wraps the real one (aot_eager, or inductor) and looks at each tensor handed to a compiled graph; none may lie in an
engine host master (the host-master guard of tests/host_master_guard.py cannot be used here: dynamo runs eagerly
while a TorchDispatchMode is active). Outputs: bitwise against the eager offloaded model with aot_eager; with
inductor (which reorders math) bitwise against the compiled plain model, allclose against eager. Inductor cases skip
only when inductor cannot compile on this machine (no C compiler); aot_eager needs none.

The diffusers fixture imitates tests/models/transformers/test_models_transformer_flux.py (`get_init_dict`,
`get_dummy_inputs` of the compile tester), with two double and two single blocks.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

from offload import OffloadConfig, VramBudget, offload_module
from tests.host_master_guard import _hit, _master_spans

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _inductor_runs() -> bool:
    try:
        fn = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend="inductor")
        return bool(torch.equal(fn(torch.ones(4)), torch.full((4,), 3.0)))
    except Exception:  # noqa: BLE001 - no C compiler, or inductor broken on this box
        return False


_INDUCTOR: bool | None = None


def _backend_or_skip(name: str) -> str:
    global _INDUCTOR
    if name == "inductor":
        if _INDUCTOR is None:
            _INDUCTOR = _inductor_runs()
        if not _INDUCTOR:
            pytest.skip("inductor cannot compile on this machine (no working C compiler); the aot_eager cases run")
    return name


class Recorder:
    """A dynamo backend over a real one that records, at run time, the tensors each compiled graph is given."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.handles: list[Any] = []
        self.tensors = 0
        self.host_reads: list[tuple[int, ...]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inner = torch._dynamo.lookup_backend(self.name)(gm, example_inputs)

        def run(*args: Any) -> Any:
            spans = [s for h in self.handles for s in _master_spans(h)]
            for a in args:
                if isinstance(a, torch.Tensor):
                    self.tensors += 1
                    if _hit(spans, a) is not None:
                        self.host_reads.append(tuple(a.shape))
            return inner(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 10, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _stack_case():
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    return model, (lambda m: m(x)), (lambda m, be, full: [b.compile(backend=be, fullgraph=full) for b in m.blocks])


FLUX_INIT = {"patch_size": 1, "in_channels": 4, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
             "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
             "axes_dims_rope": [4, 4, 8]}


def _flux_case():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**FLUX_INIT).eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, 24, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), img_ids=torch.randn(16, 3, generator=g),
                  txt_ids=torch.randn(24, 3, generator=g), timestep=torch.tensor([1.0]))
    return (model, (lambda m: m(**inputs).sample),
            (lambda m, be, full: m.compile_repeated_blocks(backend=be, fullgraph=full)))


def _compile(model: nn.Module, how: str, regional: Callable, backend: Recorder, fullgraph: bool) -> nn.Module:
    if how == "whole":
        return torch.compile(model, backend=backend)
    regional(model, backend, fullgraph)
    return model


CASES = [("stack", "whole", "aot_eager", False), ("stack", "regional", "aot_eager", True),
         ("flux", "whole", "aot_eager", False), ("flux", "regional", "aot_eager", True),
         ("stack", "whole", "inductor", False), ("flux", "regional", "inductor", True)]


@pytest.mark.parametrize("case,how,backend_name,fullgraph", CASES,
                         ids=[f"{c}-{h}-{b}" for c, h, b, _ in CASES])
def test_compiled_after_another_instance_streams(case, how, backend_name, fullgraph):
    backend_name = _backend_or_skip(backend_name)
    build = _stack_case if case == "stack" else _flux_case
    plain, call, regional = build()
    offloaded = copy.deepcopy(plain)
    with torch.no_grad():
        eager_plain = call(plain)
    # one backend object for both, as `backend="inductor"` is: dynamo's cache does not tell them apart by backend
    backend = Recorder(backend_name)
    compiled_plain = _compile(plain, how, regional, backend, fullgraph)
    with torch.no_grad():
        ref_compiled = call(compiled_plain)
    assert backend.tensors > 0, "the plain model ran compiled"

    handle = offload_module(offloaded, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    with torch.no_grad():
        eager = call(offloaded)
    assert torch.equal(eager, eager_plain)
    handle.reset_stats()
    backend.tensors = 0
    backend.handles.append(handle)
    compiled = _compile(offloaded, how, regional, backend, fullgraph)
    with torch.no_grad():
        outs = [call(compiled) for _ in range(2)]
    report = handle.report()
    assert backend.tensors > 0, "the offloaded model ran compiled"
    assert not backend.host_reads, f"compiled graphs read host masters: {backend.host_reads[:4]}"
    assert report.total_bytes_streamed > 0 and all(b.calls == 2 for b in report.blocks), \
        [(b.name, b.calls) for b in report.blocks]
    for out in outs:
        if backend_name == "aot_eager":
            assert torch.equal(out, eager)
        else:
            assert torch.equal(out, ref_compiled), "compiled offloaded differs from compiled plain"
            torch.testing.assert_close(out, eager)

    # a third, plain instance compiled after the offloaded one: its own graphs, never the engine's hooks
    third, call3, regional3 = build()
    forwards = handle.report().forwards
    compiled_third = _compile(third, how, regional3, backend, fullgraph)
    with torch.no_grad():
        out3 = call3(compiled_third)
    assert handle.report().forwards == forwards, "the plain model ran the offloaded model's hooks"
    assert torch.equal(out3, ref_compiled) if backend_name == "inductor" else torch.equal(out3, eager_plain)
    handle.detach()


def test_compiled_offloaded_model_then_detach_runs_plain():
    """After detach() a compiled offloaded model is an ordinary compiled model (hooks gone, recompiled once)."""
    plain, call, regional = _stack_case()
    with torch.no_grad():
        ref = call(plain)
    model = copy.deepcopy(plain)
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(call(compiled), ref)
    handle.detach()
    assert "compile" not in model.blocks[0].__dict__
    with torch.no_grad():
        assert torch.equal(call(compiled), ref)


def test_blocks_compiled_before_offloading_stream():
    """`block.compile()` before offload_module (torch's compiled `_call_impl`): the graphs traced without the engine
    are dropped and the blocks recompile around its hooks (without fullgraph, which cannot hold there)."""
    plain, call, regional = _stack_case()
    with torch.no_grad():
        ref = call(plain)
    model = copy.deepcopy(plain)
    backend = Recorder("aot_eager")
    regional(model, backend, False)
    with torch.no_grad():
        assert torch.equal(call(model), ref)
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    backend.handles.append(handle)
    backend.tensors = 0
    with torch.no_grad():
        assert torch.equal(call(model), ref)
    assert backend.tensors > 0 and not backend.host_reads, backend.host_reads[:4]
    assert all(b.calls == 1 for b in handle.report().blocks)
    handle.detach()
