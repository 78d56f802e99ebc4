"""Helpers shared by the family generators: seeded, well-scaled weights, LoRAs and files (plain torch + safetensors).

No ComfyUI import here: the generators describe checkpoints in ComfyUI's key layout by hand.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import save_file

Shapes = Dict[str, Tuple[int, ...]]
StateDict = Dict[str, torch.Tensor]


def init_tensor(key: str, shape: Tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random but well-scaled: norm weights near 1, biases and modulation tables small, matrices ~ 1/sqrt(fan_in)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in ("bias", "diff_b") or key.endswith("modulation") or leaf == "pos_embed":
        return 0.02 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # norm weights / RMSNorm scales
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return torch.randn(shape, generator=g) / fan_in ** 0.5


def make_state_dict(shapes: Shapes, seed: int, dtype: torch.dtype = torch.float16) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    return {k: init_tensor(k, s, g).to(dtype).contiguous() for k, s in shapes.items()}


def linear(s: Shapes, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
    s[name + ".weight"] = (out_f, in_f)
    if bias:
        s[name + ".bias"] = (out_f,)


def norm(s: Shapes, name: str, dim: int, bias: bool = True, leaf: str = "weight") -> None:
    s["{}.{}".format(name, leaf)] = (dim,)
    if bias:
        s[name + ".bias"] = (dim,)


def make_lora(shapes: Shapes, targets: Sequence[str], seed: int, rank: int = 4, scale: float = 0.5,
              diffs: Sequence[str] = (), prefix: str = "diffusion_model.") -> StateDict:
    """A LoRA in ComfyUI's generic '<prefix><module>.lora_up/lora_down.weight' + alpha layout.

    `targets` are modules with a 2D (Linear) or 4D (Conv) weight; `diffs` are full parameter keys (plain
    parameters such as Wan's `modulation` or an RMSNorm `scale`) patched with a '<prefix><key>.diff' tensor.
    """
    g = torch.Generator().manual_seed(seed)
    sd: StateDict = {}
    for t in targets:
        shape = shapes[t + ".weight"]
        out_f, in_f = shape[0], shape[1]
        kernel = tuple(shape[2:])
        up = scale * torch.randn((out_f, rank) + (1,) * len(kernel), generator=g)
        fan_in = in_f
        for k in kernel:
            fan_in *= k
        down = torch.randn((rank, in_f) + kernel, generator=g) / fan_in ** 0.5
        sd["{}{}.lora_up.weight".format(prefix, t)] = up.to(torch.float16)
        sd["{}{}.lora_down.weight".format(prefix, t)] = down.to(torch.float16)
        sd["{}{}.alpha".format(prefix, t)] = torch.tensor(float(rank))
    for key in diffs:  # ComfyUI maps '<module>' to '<module>.weight' and any other key to itself
        base = key[:-len(".weight")] if key.endswith(".weight") else key
        sd["{}{}.diff".format(prefix, base)] = (0.05 * torch.randn(shapes[key], generator=g)).to(torch.float16)
    return sd


def write(sd: StateDict, path: str, prefix: str = "") -> str:
    save_file({prefix + k: v.contiguous() for k, v in sd.items()}, path)
    return path


@dataclass
class Sampling:
    """What one sampling run of the family needs (the test turns it into a cond list and a latent)."""

    latent: Tuple[int, ...]            # latent shape, batch 1
    context: Tuple[int, int]           # (tokens, width) of the cross-attention conditioning
    pooled: Optional[int] = None       # width of cond["pooled_output"], when the model needs one
    extra: Dict[str, Any] = field(default_factory=dict)   # more cond keys (e.g. guidance)
    steps: int = 3
    cfg: float = 1.0


@dataclass
class Family:
    """One model family: how to write its tiny files and what ComfyUI must detect for them to be tiny.

    kind: "diffusion_model" (models/diffusion_models, UNETLoader), "checkpoint" (models/checkpoints,
    CheckpointLoaderSimple) or "probe" (no full generator: only the keys ComfyUI's detection reads, to show the
    family cannot be detected at a tiny width).
    expect: fields of comfy.model_detection.detect_unet_config that must hold for ComfyUI to build the tiny
    model (a mismatch means this ComfyUI sizes the family by fixed constants: the test skips with the reason).
    """

    name: str
    kind: str
    shapes: Callable[[], Shapes]
    expect: Dict[str, Any]
    model_class: str = ""              # the supported_models class ComfyUI must pick
    sampling: Optional[Sampling] = None
    lora_targets: Sequence[str] = ()
    lora_diffs: Sequence[str] = ()
    diffs_take_effect: bool = False    # ComfyUI applies `lora_diffs` (leaf-module parameters; a non-leaf module's own
    #                                    parameter such as Wan's block `modulation` is mapped but never patched)
    files: Sequence[str] = ("model",)  # one file per expert (Wan 2.2: high noise, low noise)
    prefix: str = ""                   # key prefix inside the file ("model.diffusion_model." for checkpoints)
    dtype: torch.dtype = torch.float16
    seed: int = 0
    note: str = ""

    def file_name(self, which: str = "model") -> str:
        return "lo_fam_{}_{}.safetensors".format(self.name, which)

    def lora_name(self) -> str:
        return "lo_fam_{}_lora.safetensors".format(self.name)

    def state_dict(self, which: str = "model") -> StateDict:
        return make_state_dict(self.shapes(), self.seed + 101 * list(self.files).index(which), self.dtype)

    def lora(self) -> Optional[StateDict]:
        if not self.lora_targets and not self.lora_diffs:
            return None
        return make_lora(self.shapes(), self.lora_targets, self.seed + 7, diffs=self.lora_diffs)

    def write_all(self, folder: str) -> Dict[str, str]:
        """Write every file of the family into `folder`; returns {which: file name} (+ "lora", "diffs": a LoRA of
        the plain-parameter diffs alone)."""
        out: Dict[str, str] = {}
        for which in self.files:
            write(self.state_dict(which), os.path.join(folder, self.file_name(which)), self.prefix)
            out[which] = self.file_name(which)
        lora = self.lora()
        if lora is not None:
            write(lora, os.path.join(folder, self.lora_name()))
            out["lora"] = self.lora_name()
        if self.lora_diffs:
            name = "lo_fam_{}_diffs.safetensors".format(self.name)
            write(make_lora(self.shapes(), (), self.seed + 8, diffs=self.lora_diffs), os.path.join(folder, name))
            out["diffs"] = name
        return out


def block_list(n: int, fn: Callable[[Shapes, str], None], prefix: str) -> Shapes:
    s: Shapes = {}
    for i in range(n):
        fn(s, "{}.{}".format(prefix, i))
    return s


def names(shapes: Shapes, contains: Iterable[str], suffix: str = ".weight") -> List[str]:
    """Module names (weight key minus '.weight') whose key contains any of `contains` and has a 2D+ weight."""
    out = []
    for k, v in shapes.items():
        if k.endswith(suffix) and len(v) >= 2 and any(c in k for c in contains):
            out.append(k[:-len(suffix)])
    return out
