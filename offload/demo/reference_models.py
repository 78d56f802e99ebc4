"""Small built-in model stacks (random weights, no download) shaped like the models users offload.

They exist so the demo, the benchmarks and the tests can run the engine on realistic shapes without a
model hub: a plain transformer stack, a Flux-like DiT with two block lists, and a LLaMA/Qwen-like decoder.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, d = q.shape
    s = k.shape[1]
    q = q.view(b, t, heads, d // heads).transpose(1, 2)
    k = k.view(b, s, heads, d // heads).transpose(1, 2)
    v = v.view(b, s, heads, d // heads).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, t, d)


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block, the unit most stacks repeat."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(_attention(q, k, v, self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TransformerStack(nn.Module):
    """Embedding, `blocks` list, head: the demo's model."""

    def __init__(self, dim: int = 256, depth: int = 8, heads: int = 4, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, dim)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DoubleStreamBlock(nn.Module):
    """Flux-style block: image and text streams with their own weights and a joint attention."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads = heads
        hidden = int(dim * mlp_ratio)
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", nn.Linear(dim, 6 * dim))
            setattr(self, f"{s}_norm1", nn.LayerNorm(dim, elementwise_affine=False))
            setattr(self, f"{s}_qkv", nn.Linear(dim, 3 * dim))
            setattr(self, f"{s}_proj", nn.Linear(dim, dim))
            setattr(self, f"{s}_norm2", nn.LayerNorm(dim, elementwise_affine=False))
            setattr(self, f"{s}_fc1", nn.Linear(dim, hidden))
            setattr(self, f"{s}_fc2", nn.Linear(hidden, dim))

    def _stream(self, s: str, x: torch.Tensor, vec: torch.Tensor):
        mod = getattr(self, f"{s}_mod")(F.silu(vec)).chunk(6, dim=-1)
        h = _modulate(getattr(self, f"{s}_norm1")(x), mod[0], mod[1])
        return mod, getattr(self, f"{s}_qkv")(h).chunk(3, dim=-1)

    def _finish(self, s: str, x: torch.Tensor, attn: torch.Tensor, mod) -> torch.Tensor:
        x = x + mod[2].unsqueeze(1) * getattr(self, f"{s}_proj")(attn)
        h = _modulate(getattr(self, f"{s}_norm2")(x), mod[3], mod[4])
        return x + mod[5].unsqueeze(1) * getattr(self, f"{s}_fc2")(F.gelu(getattr(self, f"{s}_fc1")(h)))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor):
        img_mod, (iq, ik, iv) = self._stream("img", img, vec)
        txt_mod, (tq, tk, tv) = self._stream("txt", txt, vec)
        q, k, v = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
        attn = _attention(q, k, v, self.heads)
        t = txt.shape[1]
        return self._finish("img", img, attn[:, t:], img_mod), self._finish("txt", txt, attn[:, :t], txt_mod)


class SingleStreamBlock(nn.Module):
    """Flux-style single block: one fused qkv+mlp projection on the joined sequence."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.heads = heads
        self.dim = dim
        self.hidden = int(dim * mlp_ratio)
        self.mod = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.linear1 = nn.Linear(dim, 3 * dim + self.hidden)
        self.linear2 = nn.Linear(dim + self.hidden, dim)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(F.silu(vec)).chunk(3, dim=-1)
        h = self.linear1(_modulate(self.norm(x), shift, scale))
        qkv, mlp = h.split([3 * self.dim, self.hidden], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)
        out = self.linear2(torch.cat((_attention(q, k, v, self.heads), F.gelu(mlp)), dim=-1))
        return x + gate.unsqueeze(1) * out


class DiTStack(nn.Module):
    """Flux-shaped diffusion transformer: `double_blocks` then `single_blocks` (two block lists)."""

    def __init__(self, dim: int = 256, double: int = 4, single: int = 8, heads: int = 4,
                 in_channels: int = 64, txt_dim: int = 128) -> None:
        super().__init__()
        self.img_in = nn.Linear(in_channels, dim)
        self.txt_in = nn.Linear(txt_dim, dim)
        self.time_in = nn.Linear(dim, dim)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(dim, heads) for _ in range(double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(dim, heads) for _ in range(single))
        self.final = nn.Linear(dim, in_channels)
        self.dim = dim

    def forward(self, img: torch.Tensor, txt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        img, txt = self.img_in(img), self.txt_in(txt)
        vec = self.time_in(t)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = block(x, vec)
        return self.final(x[:, txt.shape[1]:])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    """LLaMA/Qwen-style decoder layer (grouped-query attention, gated MLP)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        head_dim = dim // heads
        self.input_layernorm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DecoderStack(nn.Module):
    """A 7B-decoder-shaped stack (`layers`), run as batch-1 decode in the benchmark."""

    def __init__(self, dim: int = 256, depth: int = 4, heads: int = 8, kv_heads: int = 2,
                 intermediate: int = 704, vocab: int = 512) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, intermediate) for _ in range(depth))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@dataclass(frozen=True)
class ReferenceSpec:
    """Full-size shape of a reference model; `scale` divides width (and depth where asked) for small machines."""

    kind: str
    dim: int
    depth: tuple[int, ...]
    heads: int


FLUX_SPEC = ReferenceSpec("dit", 3072, (19, 38), 24)
DECODER_7B_SPEC = ReferenceSpec("decoder", 3584, (28,), 28)


def build_flux_like(width_div: int = 1, depth_div: int = 1, dtype: torch.dtype = torch.bfloat16) -> DiTStack:
    """Flux-sized DiT (width 3072, 19 double + 38 single blocks), optionally scaled down."""
    dim = FLUX_SPEC.dim // width_div
    heads = max(1, FLUX_SPEC.heads // width_div)
    model = DiTStack(dim=dim, double=max(1, 19 // depth_div), single=max(1, 38 // depth_div), heads=heads,
                     in_channels=64, txt_dim=max(64, 4096 // width_div))
    return model.to(dtype)


def build_decoder_7b_like(width_div: int = 1, depth_div: int = 1, dtype: torch.dtype = torch.bfloat16) -> DecoderStack:
    """Qwen2-7B-sized decoder (28 layers, width 3584, GQA 28/4, MLP 18944), optionally scaled down."""
    dim = DECODER_7B_SPEC.dim // width_div
    head_dim = 128 if dim >= 512 else 32
    heads = max(1, dim // head_dim)
    kv = max(d for d in (1, 2, 4) if heads % d == 0)
    model = DecoderStack(dim=dim, depth=max(1, 28 // depth_div), heads=heads, kv_heads=kv,
                         intermediate=18944 // width_div, vocab=max(512, 32768 // width_div))
    return model.to(dtype)


class FatCheapBlock(nn.Module):
    """Many bytes, almost no compute (`x + w[0, :dim]`): its copy cannot hide behind it."""

    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) * 0.01)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w[0, :self.dim]


class LeanComputeBlock(nn.Module):
    """Few bytes, much compute (one small Linear applied `repeats` times): its copy hides behind compute."""

    def __init__(self, dim: int, repeats: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = torch.tanh(self.lin(x))
        return x


class MixedCostStack(nn.Module):
    """Blocks whose costs differ, for placement from measured costs: `kinds` is a string of F (fat, cheap) and
    L (lean, compute-heavy) blocks in call order; `input_layer` puts a Linear before them."""

    def __init__(self, kinds: str, dim: int = 64, width: int = 1024, repeats: int = 24,
                 input_layer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim) if input_layer else None
        self.blocks = nn.ModuleList(FatCheapBlock(dim, width) if k == "F" else LeanComputeBlock(dim, repeats)
                                    for k in kinds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x
