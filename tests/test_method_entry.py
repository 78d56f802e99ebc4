"""Units entered through a method other than `forward` (offload/stream/method_entry.py) compute on the device: a
WAN-Animate-2-like DiT whose model calls its blocks through `forward_pose` / `kv_from_input` / `forward_gen`, which
read the block's own `modulation` before any child runs (re-created from ComfyUI 0.33's
comfy/ldm/wan/model_animate2.py and comfy/ldm/wan/model.py: tiny widths, its call pattern), and Mimi's quantizer
called through `.encode()` / `.decode()` (transformers' MimiModel at the tiny width of tests/tts/tiny_tts.py, with a
projection in the quantizer as the release has). Bitwise equal to the plain model under the host-read guard, which
also sees reads through a dtype conversion under inference mode (`aten.to.dtype`, an fp8 weight cast up)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.host_master_guard import HostMasterRead, host_master_guard


class _SelfAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def kv(self, x):
        return self.k(x), self.v(x)

    def forward_pose(self, x):
        k, v = self.kv(x)
        att = torch.softmax(self.q(x) @ k.transpose(1, 2), -1)
        return self.o(att @ v), k, v

    def forward_gen(self, x, k_pose, v_pose):
        k, v = self.kv(x)
        k, v = torch.cat([k, k_pose], 1), torch.cat([v, v_pose], 1)
        return self.o(torch.softmax(self.q(x) @ k.transpose(1, 2), -1) @ v)


class _Block(nn.Module):
    """WanAnimate2Block's shape: `_modulation` reads the block's own parameter first (cast to the input dtype, as
    ComfyUI's cast_to does), then the children run."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 3, dim) / dim ** 0.5)
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = _SelfAttention(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def _modulation(self, e, x):
        return (self.modulation.to(x.dtype) + e).chunk(3, dim=1)

    def forward_pose(self, x, e):
        e = self._modulation(e, x)
        y, k, v = self.self_attn.forward_pose(self.norm1(x) * (1 + e[0]))
        x = x + y * e[1]
        return x + self.ffn(x) * e[2], k, v

    def kv_from_input(self, x, e):
        e = self._modulation(e, x)
        return self.self_attn.kv(self.norm1(x) * (1 + e[0]))

    def forward_gen(self, x, e, k_pose, v_pose):
        e = self._modulation(e, x)
        x = x + self.self_attn.forward_gen(self.norm1(x) * (1 + e[0]), k_pose, v_pose) * e[1]
        return x + self.ffn(x) * e[2]

    def forward(self, x, e):  # never called by the model (as in ComfyUI's WanAnimate2Model)
        raise AssertionError("forward is not how this model calls its blocks")


class _Animate(nn.Module):
    """WanAnimate2Model.forward_orig's loop: a pose pass over every block, then per block `kv_from_input` and
    `forward_gen`."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(dim, dim)
        self.time = nn.Linear(dim, 3 * dim)
        self.blocks = nn.ModuleList(_Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x, pose, t):
        e = self.time(t).unflatten(-1, (3, -1)).squeeze(1)
        x, pose = self.patch(x), self.patch(pose)
        pose_in = []
        for block in self.blocks:
            pose_in.append(pose)
            pose = block.forward_pose(pose, e)[0]
        for block, p in zip(self.blocks, pose_in):
            k_pose, v_pose = block.kv_from_input(p, e)
            x = block.forward_gen(x, e, k_pose, v_pose)
        return self.head(x)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g), torch.randn(2, 1, 16, generator=g)


@pytest.mark.parametrize("plan", ["streamed", "mixed"])
def test_blocks_entered_through_their_methods_are_brought_in(sim_cfg, offload, plan):
    torch.manual_seed(0)
    model = _Animate().eval()
    args = _inputs()
    with torch.inference_mode():
        ref = model(*args)
    cfg = sim_cfg(vram_fraction=0.0, prefetch=1)
    if plan == "mixed":  # one block resident, the others through a ring of two
        probe = offload(model, cfg)
        cfg = sim_cfg(vram_budget_bytes=probe.budget_for(1), prefetch=1)
        probe.detach()
    handle = offload(model, cfg)
    resident = len(handle.streamer.resident_set)
    assert (resident == 0) if plan == "streamed" else (0 < resident < 4), handle.plan_summary()
    for _ in range(2):
        with torch.inference_mode(), host_master_guard(handle):
            assert torch.equal(model(*args), ref)
    calls = [b.calls for b in handle.report().blocks if b.name.startswith("blocks.")]
    assert calls and all(c > 0 for c in calls), calls
    copied = copy.deepcopy(model)  # an ordinary model: its methods are its own
    assert "forward_gen" not in vars(copied.blocks[0]) or copied.blocks[0].forward_gen.__self__ is copied.blocks[0]
    with torch.inference_mode():
        assert torch.equal(copied(*args), ref)
    handle.detach()
    assert "forward_gen" not in vars(model.blocks[0]), "detach takes the wrappers off"


def test_the_guard_sees_a_read_through_a_dtype_conversion(sim_cfg, offload):
    """`aten.to.dtype` reaches the guard whole under inference mode; it copies, so it read the host master."""
    torch.manual_seed(0)
    model = _Animate().eval()
    handle = offload(model, sim_cfg(vram_fraction=0.0))
    with torch.inference_mode():
        model(*_inputs())
        with pytest.raises(HostMasterRead, match=r"aten\.to\.dtype.*blocks\.1\.modulation"):
            with host_master_guard(handle):
                model.blocks[1].modulation.to(torch.float16)
        with host_master_guard(handle):  # a true view reads nothing
            model.blocks[1].modulation.to(torch.float32)


def _mimi():
    transformers = pytest.importorskip("transformers")
    from tests.tts.tiny_tts import tiny_mimi_config

    kw = tiny_mimi_config()
    kw.pop("model_type")
    kw.update(hidden_size=32, upsample_groups=32)  # wider than the quantizer's 16: input/output projections
    torch.manual_seed(0)
    return transformers.MimiModel(transformers.MimiConfig(**kw)).eval()


def test_mimi_quantizer_entered_through_encode_and_decode(sim_cfg, offload):
    model = _mimi()
    with torch.no_grad():
        emb = model.encoder(torch.randn(1, 1, 3840, generator=torch.Generator().manual_seed(2)))
        emb = emb if torch.is_tensor(emb) else emb[0]
        codes = model.quantizer.encode(emb)
        decoded = model.quantizer.decode(codes)
    handle = offload(model, sim_cfg(vram_fraction=0.0))
    assert "quantizer" in [b.name for b in handle.report().blocks]
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model.quantizer.decode(codes), decoded)  # decode first: no forward brought it in
        assert torch.equal(model.quantizer.encode(emb), codes)
    assert [b.calls for b in handle.report().blocks if b.name == "quantizer"] == [2]
