"""LoRA after offloading the way users load it: diffusers' `load_lora_weights` (two adapters), `set_adapters`,
`fuse_lora` / `unfuse_lora`, `delete_adapters`, `unload_lora_weights`, on streamed, mixed and disk plans; writes
through `.data` without `handle.refresh()`. Each step bitwise the plain pipeline's, under the host-master guard.
Pipelines and inputs: tests/pipelines/pipeline_builders.py (diffusers' tests/pipelines/flux/test_pipeline_flux.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import offload as lo

from .pipeline_builders import CASES
from .test_pipelines import _assert_equal, _call, _modules

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
FLUX = next(c for c in CASES if c.name == "flux")


def _adapter_state(seed: int) -> dict[str, torch.Tensor]:
    """A LoRA for the Flux transformer in diffusers' format (`transformer.<peft key>`), random and non-zero."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    den = FLUX.build().transformer
    torch.manual_seed(seed)
    den.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "proj_out"],
                               init_lora_weights=False))
    return {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(den).items()}


def _steps(pipe: Any, handles: list[Any]) -> list[list[torch.Tensor]]:
    outs = []
    pipe.load_lora_weights(_adapter_state(1), adapter_name="a")
    outs.append(_call(FLUX, pipe, handles))
    pipe.load_lora_weights(_adapter_state(2), adapter_name="b")
    pipe.set_adapters(["a", "b"], adapter_weights=[0.7, 0.3])
    outs.append(_call(FLUX, pipe, handles))
    pipe.fuse_lora(components=["transformer"], lora_scale=0.8)
    outs.append(_call(FLUX, pipe, handles))
    for h in handles:
        h.unload()
    outs.append(_call(FLUX, pipe, handles))
    pipe.unfuse_lora(components=["transformer"])
    pipe.delete_adapters("b")
    outs.append(_call(FLUX, pipe, handles))
    pipe.unload_lora_weights()
    outs.append(_call(FLUX, pipe, handles))
    return outs


def _disk_config(model: nn.Module, path: str) -> lo.OffloadConfig:
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return lo.OffloadConfig(device="sim", vram_fraction=0.0, prefetch=1, disk_path=path, disk_optional=True,
                            ram_budget_bytes=total // 2)


@pytest.mark.parametrize("plan", ["streamed", pytest.param("mixed", marks=pytest.mark.slow),
                                  pytest.param("disk", marks=pytest.mark.slow)])
def test_load_lora_weights_after_offloading(plan: str, tmp_path: Any) -> None:
    plain = _steps(FLUX.build(), [])
    pipe = FLUX.build()
    handles = []
    for name, m in _modules(pipe).items():
        if plan == "disk" and name == "transformer":
            cfg = _disk_config(m, str(tmp_path / "transformer.safetensors"))
        else:
            cfg = lo.OffloadConfig(device="sim", vram_fraction=0.5 if plan == "mixed" else 0.0, prefetch=1)
        handles.append(lo.offload_module(m, cfg, name=name, budget=lo.VramBudget(None)))
    _call(FLUX, pipe, handles)
    if plan == "disk":
        assert any(u.master.host is None for u in handles[[h.name for h in handles].index("transformer")]
                   .streamer.units), "the disk plan put no block on the disk tier"
    try:
        got = _steps(pipe, handles)
    finally:
        for h in handles:
            h.detach()
    names = ("a loaded", "a+b set", "fused", "fused+evicted", "unfused, b deleted", "unloaded")
    for step, a, b in zip(names, plain, got):
        _assert_equal(FLUX, f"{plan}: {step}", a, b)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_data_writes_found_without_refresh(fraction: float, tmp_path: Any) -> None:
    """`with torch.no_grad(): p.data.mul_(...)` between passes, streamed and resident, then eviction and detach:
    the engine follows without handle.refresh(); the written values survive both."""
    pipe = FLUX.build()
    den = pipe.transformer
    ref = FLUX.build().transformer
    h = lo.offload_module(den, lo.OffloadConfig(device="sim", vram_fraction=fraction, prefetch=1),
                          budget=lo.VramBudget(None))
    x = {"hidden_states": torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(0)),
         "encoder_hidden_states": torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)),
         "pooled_projections": torch.randn(1, 32, generator=torch.Generator().manual_seed(2)),
         "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}
    with torch.no_grad():
        den(**x)
        for m in (den, ref):
            for p in m.transformer_blocks[0].parameters():
                p.data.mul_(1.5)
            m.single_transformer_blocks[0].proj_out.weight.data += 0.25
            m.proj_out.weight.data.copy_(m.proj_out.weight.data * -1)  # outside the blocks
        want = ref(**x).sample
        assert torch.equal(den(**x).sample, want)
        h.unload()
        assert torch.equal(den(**x).sample, want)
    h.detach()
    with torch.no_grad():
        assert torch.equal(den(**x).sample, want)
