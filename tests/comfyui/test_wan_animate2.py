"""ComfyUI 0.33's Wan-Animate-2 (comfy/ldm/wan/model_animate2.py) calls its blocks through `forward_pose`,
`kv_from_input` and `forward_gen`, never `forward`, and those read the block's own `modulation` before any child
runs: every block streamed, the pose branch and the generation branch equal the plain model bitwise, and no op reads
a host master (tests/host_master_guard.py; before issue 37 `blocks.0.modulation` was read from it). Tiny widths
(dim 128, one head, 4 blocks, i2v's 36 input channels), ComfyUI's own classes and CPU ops. Skipped where the
ComfyUI checkout has no Wan-Animate-2 (before 0.33)."""
from __future__ import annotations

import pytest
import torch

from conftest import load_tests_module


def test_wan_animate2_blocks_entered_through_their_methods_stream_with_no_host_read(pack):
    try:
        from comfy.ldm.wan.model_animate2 import WanAnimate2Model
    except ImportError:
        pytest.skip("this ComfyUI has no Wan-Animate-2 (comfy/ldm/wan/model_animate2.py, 0.33 and later)")
    import comfy.ops
    from offload import OffloadConfig, VramBudget, offload_module

    guard = load_tests_module("host_master_guard.py")
    torch.manual_seed(0)
    model = WanAnimate2Model(in_dim=36, dim=128, ffn_dim=256, freq_dim=256, text_dim=4096, out_dim=16, num_heads=1,
                             num_layers=4, operations=comfy.ops.disable_weight_init).eval()
    for p in model.parameters():
        p.data = torch.randn_like(p) * 0.05
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 36, 3, 8, 8, generator=g), torch.tensor([500.0])
    context, pose = torch.randn(1, 8, 4096, generator=g), torch.randn(1, 16, 2, 8, 8, generator=g)
    with torch.inference_mode():
        ref = model._forward(x, t, context, pose_latents=pose)
    handle = offload_module(model, OffloadConfig(device="sim", vram_fraction=0.0), budget=VramBudget(None))
    try:
        assert len(handle.streamer.resident_set) == 0
        for _ in range(2):
            with torch.inference_mode(), guard.host_master_guard(handle):
                assert torch.equal(model._forward(x, t, context, pose_latents=pose), ref)
        calls = [b.calls for b in handle.report().blocks if b.name.startswith("blocks.")]
        assert len(calls) == 4 and all(c == 4 for c in calls), calls  # forward_pose and forward_gen, two steps
    finally:
        handle.detach()
