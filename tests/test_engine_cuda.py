"""The same contracts on a real CUDA device (skipped without one)."""
from __future__ import annotations

import pytest
import torch

from tests.models import (CASES, DiTStack, module_path, param_inner_tensors, run, same_tensor, seeded, snapshot,
                          streamed_modules, streaming_budget)

pytestmark = pytest.mark.cuda


def _to(inputs, device):
    return tuple(t.to(device) for t in inputs)


def _cuda_case(name, offload, slots=3, prefetch=2, model=None):
    from offload import OffloadConfig

    case = CASES[name]
    model = case.build() if model is None else model
    x_cpu = case.inputs()
    # reference: the same model fully resident on the GPU (same kernels as the offloaded run)
    ref = run(model.to("cuda"), _to(x_cpu, "cuda"))
    model.to("cpu")
    torch.cuda.synchronize()
    cfg = OffloadConfig(device="cuda", vram_budget_bytes=streaming_budget(model, case.blocks(model), slots),
                        prefetch=prefetch)
    handle = offload(model, cfg)
    return case, model, _to(x_cpu, "cuda"), ref, handle


@pytest.mark.parametrize("case_name", ["transformer", "dit", "tied_buffers", "fp8_e4m3", "int8_subclass",
                                       "comfy_unet", "unet", "rope_complex"])
def test_cuda_outputs_bitwise_equal(case_name, offload):
    case, model, x, ref, handle = _cuda_case(case_name, offload)
    assert streamed_modules(handle)
    for _ in range(3):
        out = run(model, x)
        assert out.device.type == "cuda"
        assert torch.equal(out, ref), case_name


def test_cuda_params_pinned_between_and_on_device_during(offload):
    case, model, x, ref, handle = _cuda_case("transformer", offload)
    streamed = streamed_modules(handle)
    unit = streamed[len(streamed) // 2]
    path = module_path(model, unit)
    host = {n: (t.data_ptr(), t.device.type, t.is_pinned()) for n, p in unit.named_parameters()
            for t in param_inner_tensors(p)}
    for n, (ptr, dev, pinned) in host.items():
        assert dev == "cpu" and pinned, f"{path}.{n} between forwards: device {dev}, pinned {pinned}"
    seen = []
    hook = unit.register_forward_pre_hook(
        lambda m, a: seen.append({n: (t.device.type, t.data_ptr()) for n, p in m.named_parameters()
                                  for t in param_inner_tensors(p)}))
    try:
        for _ in range(2):
            assert torch.equal(run(model, x), ref)
    finally:
        hook.remove()
    assert len(seen) == 2
    for during in seen:
        for n, (dev, ptr) in during.items():
            assert dev == "cuda", f"{path}.{n} on {dev} during its forward"
            assert ptr != host[n][0]
    for n, p in unit.named_parameters():
        for t in param_inner_tensors(p):
            assert t.device.type == "cpu" and t.is_pinned() and t.data_ptr() == host[n][0], n


def test_cuda_report_and_budget(offload):
    case, model, x, ref, handle = _cuda_case("dit", offload, slots=3, prefetch=2)
    cfg_budget = streaming_budget(model, case.blocks(model), 3)
    for _ in range(3):
        assert torch.equal(run(model, x), ref)
    torch.cuda.synchronize()
    rep = handle.report()
    names = {b.name: b for b in rep.blocks}
    for u in streamed_modules(handle):
        b = names[module_path(model, u)]
        assert b.tier == "pinned", f"{b.name}: pin_memory=True on a CUDA machine, tier {b.tier}"
        assert b.h2d_ms > 0 and b.bytes > 0
    assert rep.total_bytes_streamed > 0
    assert 0.0 <= rep.overlap_ratio <= 1.0
    assert rep.effective_gbps > 0
    assert 0 < rep.peak_device_bytes <= cfg_budget
    assert handle.device_bytes() <= cfg_budget


def test_cuda_detach_restores(offload):
    case = CASES["transformer"]
    model = case.build()
    before = snapshot(model)
    case, model, x, ref, handle = _cuda_case("transformer", offload, model=model)
    assert torch.equal(run(model, x), ref)
    handle.detach()
    assert list(model.state_dict()) == list(before)
    for n, p in model.named_parameters():
        for t in param_inner_tensors(p):
            assert t.device.type == "cpu", f"{n} on {t.device} after detach (it started on the CPU)"
    sd = model.state_dict()
    for k, v in before.items():
        assert same_tensor(sd[k], v), k
    model.to("cuda")
    assert torch.equal(run(model, x), ref)


def test_cuda_real_vram_stays_within_budget(offload):
    """The engine's own accounting is one thing; the caching allocator's peak is the truth. Weights on the GPU
    during an offloaded forward may not exceed the budget (activations measured on a resident run aside)."""
    from offload import OffloadConfig

    # wide enough that the weights (~47 MB) dwarf the allocator slack allowed below
    model = seeded(DiTStack, dim=256, double=2, single=8, heads=4, in_channels=32, txt_dim=48)
    blocks = list(model.double_blocks) + list(model.single_blocks)
    x = (torch.randn(1, 16, 32).cuda(), torch.randn(1, 6, 48).cuda(), torch.randn(1, 256).cuda())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref = run(model, x)
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - base
    model.cpu()
    del ref
    torch.cuda.empty_cache()
    budget = streaming_budget(model, blocks, 2)
    assert budget < weights // 2
    base = torch.cuda.memory_allocated()
    handle = offload(model, OffloadConfig(device="cuda", vram_budget_bytes=budget, prefetch=1))
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        run(model, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget + activations + (4 << 20), (
        f"GPU peak {peak} B > budget {budget} B + activations {activations} B")
    assert handle.device_bytes() <= budget


def test_cuda_inference_mode_then_grad_mode(offload):
    case, model, x, ref, handle = _cuda_case("transformer", offload)
    with torch.inference_mode():
        assert torch.equal(model(*x), ref)
    assert torch.equal(model(*x).detach(), ref)


def test_cuda_pre_existing_unit_hook_computes_on_device(offload):
    """A pre-hook already on a block before offloading that computes with the block's weights (a cache or
    skip heuristic): it must get GPU weights, not fail with a device mismatch."""
    from offload import OffloadConfig

    case = CASES["transformer"]
    model = case.build()
    x_cpu = case.inputs()
    ref = run(model.to("cuda"), _to(x_cpu, "cuda"))
    model.to("cpu")
    probes = []
    hooks = [b.register_forward_pre_hook(lambda m, a: probes.append((a[0] @ m.fc1.weight.t()).sum().item()))
             for b in model.blocks]
    try:
        offload(model, OffloadConfig(device="cuda", vram_budget_bytes=streaming_budget(model, case.blocks(model), 3),
                                     prefetch=2))
        assert torch.equal(run(model, _to(x_cpu, "cuda")), ref)
        assert len(probes) == len(model.blocks)
    finally:
        for h in hooks:
            h.remove()


def test_cuda_pinned_masters_take_the_host_ram_the_report_says(offload):
    """The host RAM pinned masters take is what `host_memory()["pinned"]` reports (the plan and `ram_budget_bytes`
    count those bytes): torch's caching host allocator rounds each pinned allocation up to a power of two, so a
    21 MB block pinned through it would take 32 MB. Blocks of a size far from a power of two, measured by the
    allocator's own counters; after detach (and Backend.release_host_cache) the pinned bytes leave the process."""
    from offload import OffloadConfig

    torch.manual_seed(0)
    width = 2304  # a Linear of 2304 x 2304 fp32: 21.2 MB, 0.66 of the next power of two
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    x = torch.randn(2, width)
    ref = model.to("cuda")(x.cuda())
    model.to("cpu")
    torch.cuda.synchronize()
    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    handle = offload(model, OffloadConfig.from_preset("budget", device="cuda", share_host="off"))
    assert torch.equal(model(x.cuda()), ref)
    pinned = handle.host_memory()["pinned"]
    assert pinned >= 4 * width * width * 4
    taken = stats().get("allocated_bytes.current", 0) - before
    assert taken <= pinned * 1.05 + (8 << 20), (taken, pinned)
    handle.detach()
    assert stats().get("allocated_bytes.current", 0) - before <= 8 << 20
