"""Named GPUs for `offload.predict`: memory, host-to-device speed and tensor throughput of common cards.

A `Card` is what the prediction needs to know about a GPU it cannot measure: VRAM, the pinned host-to-device copy
speed the card reaches over its bus, its dense bf16/fp16 tensor-core peak and its memory bandwidth. The figures
below are the vendors' published specifications (dense, no sparsity) and the usual achieved share of the bus
(pinned `cudaMemcpyAsync` reaches about 80% of the PCIe link's raw rate: ~25 GB/s on PCIe 4.0 x16, ~50 GB/s on PCIe
5.0 x16, ~12.5 GB/s on 4.0 x8). They are starting points: `benchmarks/bench_gpu.py` measures the real figures of a
machine, and `Card(...)` takes your own.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from types import MappingProxyType
from typing import Any, Mapping

GB = 10 ** 9
GIB = 1 << 30

# Share of the peak a well-shaped workload reaches (what turns FLOPs and bytes into milliseconds). Large bf16 GEMMs
# (a DiT's linear layers at thousands of tokens) run at 70-85% of the dense peak; elementwise work at about 70% of
# the memory bandwidth. Attention depends on the GPU architecture and the kernel (ATTENTION_EFFICIENCY_BY below).
MATMUL_EFFICIENCY = 0.75
ATTENTION_EFFICIENCY = 0.5  # a card of unknown architecture
MEMORY_EFFICIENCY = 0.7
PAGEABLE_FACTOR = 0.5  # pageable host memory copies through a pinned bounce buffer: about half the pinned speed

# Fused attention's share of the card's dense peak, by architecture and kernel (forward pass, head dim 128, long
# sequences). "sdpa" is PyTorch's scaled_dot_product_attention as ComfyUI and diffusers call it: FlashAttention-2
# inside on Ampere/Ada/Hopper (cuDNN attention on Blackwell datacenter parts).
# - Ampere: FlashAttention-2 paper (Dao, 2023), forward up to 73% of A100's peak; ~60% on long video shapes.
# - Hopper: FlashAttention-3 paper (Shah et al., 2024): FlashAttention-2 reaches about 35% of H100's peak,
#   FlashAttention-3 about 75% (740 TFLOP/s bf16).
# - Ada / Blackwell GeForce: the peak in the table is the fp32-accumulate rate (half the fp16-accumulate one);
#   FlashAttention-2 accumulates in fp32 and reaches most of it (~85%; measured per forward on 4090 / 4090D runs of
#   Wan 2.1, see docs/benchmarks.md).
ATTENTION_EFFICIENCY_BY: Mapping[str, Mapping[str, float]] = MappingProxyType({
    "ampere": MappingProxyType({"sdpa": 0.6, "fa2": 0.6, "fa3": 0.6}),
    "ada": MappingProxyType({"sdpa": 0.85, "fa2": 0.85, "fa3": 0.85}),
    "hopper": MappingProxyType({"sdpa": 0.35, "fa2": 0.35, "fa3": 0.75}),
    "blackwell": MappingProxyType({"sdpa": 0.8, "fa2": 0.8, "fa3": 0.8}),
    "blackwell-dc": MappingProxyType({"sdpa": 0.55, "fa2": 0.4, "fa3": 0.55}),
})
ATTENTION_KERNELS = ("sdpa", "fa2", "fa3")
# GEMMs of a DiT's shapes (M = a few thousand tokens) by architecture: H100/H200 SXM reach 60-70% of the 989 TFLOP/s
# dense peak (its boost clock is not held at 700 W under sustained tensor load); Ampere and Ada 70-80%.
MATMUL_EFFICIENCY_BY: Mapping[str, float] = MappingProxyType({"ampere": 0.75, "ada": 0.75, "hopper": 0.65,
                                                              "blackwell": 0.75, "blackwell-dc": 0.65})


@dataclass(frozen=True)
class Card:
    """One GPU as the prediction sees it: VRAM bytes, pinned host-to-device GB/s, dense bf16 tensor TFLOP/s."""

    name: str
    vram_bytes: int
    h2d_gbps: float  # pinned host-to-device copy speed reached (GB/s, 1e9 bytes)
    tflops: float  # dense bf16/fp16 tensor-core peak, fp32 accumulate (1e12 FLOP/s)
    mem_gbps: float = 0.0  # device memory bandwidth (elementwise work); 0: not counted
    pageable_gbps: float | None = None  # pageable host memory (None: PAGEABLE_FACTOR x h2d_gbps)
    source: str = ""  # where the figures come from
    arch: str = ""  # ampere | ada | hopper | blackwell | blackwell-dc ("" unknown)
    attention: str = "sdpa"  # the attention kernel the run uses (ATTENTION_KERNELS)
    # the share of `tflops` GEMMs / fused attention reach on this card where it differs from its architecture's
    # (None: MATMUL_EFFICIENCY_BY / ATTENTION_EFFICIENCY_BY)
    matmul_share: float | None = None
    attention_share: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Card name must be a non-empty str, got {self.name!r}")
        for field, value in (("vram_bytes", self.vram_bytes), ("h2d_gbps", self.h2d_gbps), ("tflops", self.tflops)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Card {field} must be a finite number > 0, got {value!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"Card attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")
        if isinstance(self.mem_gbps, bool) or not isinstance(self.mem_gbps, (int, float)) or self.mem_gbps < 0:
            raise ValueError(f"Card mem_gbps must be a number >= 0 (0: not counted), got {self.mem_gbps!r}")

    @property
    def attention_efficiency(self) -> float:
        """Fused attention's share of `tflops` on this card with its kernel."""
        if self.attention_share:
            return self.attention_share
        return ATTENTION_EFFICIENCY_BY.get(self.arch, {}).get(self.attention, ATTENTION_EFFICIENCY)

    @property
    def matmul_efficiency(self) -> float:
        """Large bf16 GEMMs' share of `tflops` on this card."""
        return self.matmul_share or MATMUL_EFFICIENCY_BY.get(self.arch, MATMUL_EFFICIENCY)

    @property
    def pageable(self) -> float:
        """GB/s from pageable host memory."""
        return self.pageable_gbps if self.pageable_gbps else self.h2d_gbps * PAGEABLE_FACTOR

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PCIE4_X16 = "pinned H2D ~80% of PCIe 4.0 x16 (31.5 GB/s raw)"
_PCIE4_X8 = "pinned H2D ~80% of PCIe 4.0 x8 (15.8 GB/s raw)"
_PCIE5_X16 = "pinned H2D ~80% of PCIe 5.0 x16 (63 GB/s raw)"
_PCIE5_X8 = "pinned H2D ~80% of PCIe 5.0 x8 (31.5 GB/s raw)"
_AMPERE = ("NVIDIA Ampere GA102 whitepaper, appendix A (Peak FP16 Tensor TFLOPS with FP32 Accumulate, dense; memory "
           "bandwidth)")
_ADA = ("NVIDIA Ada Lovelace (AD102) whitepaper, appendix tables (Peak FP16/BF16 Tensor TFLOPS with FP32 Accumulate, "
        "dense: half the FP16-accumulate rate on GeForce; scaled by SM count x boost clock for the SKUs it omits)")
_BLACKWELL = ("NVIDIA RTX Blackwell GPU architecture whitepaper (GB202/GB203/GB205/GB206 tables: FP16/BF16 Tensor "
              "with FP32 Accumulate, dense; memory bandwidth)")


_H20_SHARE = ("kernels: the H20's 148 TFLOP/s is a cap far below what its Hopper SMs issue, so GEMMs and "
              "FlashAttention-2 both run near it (~85% / ~80%); xDiT's HunyuanVideo latencies put H20 at 3.5x the "
              "H100's time where the peaks differ 6.7x")


def _card(name: str, vram_gb: float, h2d: float, tflops: float, mem: float, arch: str, *sources: str) -> Card:
    return Card(name, int(vram_gb * GIB), h2d, tflops, mem, None, "; ".join(sources), arch)


CARDS: Mapping[str, Card] = MappingProxyType({c.name: c for c in (
    _card("rtx3060-12gb", 12, 25.0, 25.6, 360, "ampere", _AMPERE + " (GA106)", _PCIE4_X16),
    _card("rtx3080-10gb", 10, 25.0, 59.5, 760, "ampere", _AMPERE, _PCIE4_X16),
    _card("rtx3090", 24, 25.0, 71.0, 936, "ampere", _AMPERE, _PCIE4_X16),
    _card("rtx4060ti-16gb", 16, 12.5, 44.1, 288, "ada", _ADA, _PCIE4_X8),
    _card("rtx4070-12gb", 12, 25.0, 58.3, 504, "ada", _ADA, _PCIE4_X16),
    _card("rtx4070ti-super", 16, 25.0, 88.2, 672, "ada", _ADA, _PCIE4_X16),
    _card("rtx4080", 16, 25.0, 97.5, 717, "ada", _ADA, _PCIE4_X16),
    _card("rtx4080-super", 16, 25.0, 104.4, 736, "ada", _ADA + " (80 SMs at 2550 MHz)", _PCIE4_X16),
    _card("rtx4090", 24, 25.0, 165.2, 1008, "ada", _ADA, _PCIE4_X16),
    _card("rtx4090d", 24, 25.0, 147.1, 1008, "ada", _ADA + " (RTX 4090 D: 114 of the 4090's 128 SMs, same clocks)",
          _PCIE4_X16),
    _card("rtx5060ti-16gb", 16, 25.0, 47.4, 448, "blackwell", _BLACKWELL, _PCIE5_X8),
    _card("rtx5070ti", 16, 50.0, 87.9, 896, "blackwell", _BLACKWELL, _PCIE5_X16),
    _card("rtx5080", 16, 50.0, 112.6, 960, "blackwell", _BLACKWELL, _PCIE5_X16),
    _card("rtx5090", 32, 50.0, 209.5, 1792, "blackwell", _BLACKWELL, _PCIE5_X16),
    _card("l4", 24, 25.0, 121.0, 300, "ada", "NVIDIA L4 datasheet (BF16 tensor, dense)", _PCIE4_X16),
    _card("l20", 48, 25.0, 119.5, 864, "ada", "NVIDIA L20 product brief (FP16/BF16 tensor, dense; 864 GB/s GDDR6)",
          _PCIE4_X16),
    _card("l40s", 48, 25.0, 362.0, 864, "ada", "NVIDIA L40S datasheet (BF16 tensor 362 TFLOPS dense; 864 GB/s)",
          _PCIE4_X16),
    _card("a100-40gb", 40, 25.0, 312.0, 1555, "ampere", "NVIDIA A100 datasheet (BF16 tensor 312 TFLOPS dense; "
          "1555 GB/s HBM2)", _PCIE4_X16),
    _card("a100-80gb", 80, 25.0, 312.0, 2039, "ampere", "NVIDIA A100 datasheet (BF16 tensor 312 TFLOPS dense; 80GB "
          "SXM 2039 GB/s HBM2e)", _PCIE4_X16),
    replace(_card("h20", 96, 50.0, 148.0, 4000, "hopper", "NVIDIA H20 product brief (FP16/BF16 tensor 148 TFLOPS "
                  "dense; 96 GB HBM3 at 4.0 TB/s)", _PCIE5_X16, _H20_SHARE), matmul_share=0.85, attention_share=0.8),
    _card("h100-pcie", 80, 50.0, 756.0, 2000, "hopper", "NVIDIA H100 datasheet, PCIe column (BF16 tensor 756 TFLOPS "
          "dense; 2.0 TB/s)", _PCIE5_X16),
    _card("h100-sxm", 80, 50.0, 989.0, 3350, "hopper", "NVIDIA H100 datasheet, SXM5 column (BF16 tensor 989 TFLOPS "
          "dense; 3.35 TB/s)", _PCIE5_X16),
    _card("h200", 141, 50.0, 989.0, 4800, "hopper", "NVIDIA H200 datasheet (BF16 tensor 989 TFLOPS dense; 141 GB "
          "HBM3e at 4.8 TB/s)", _PCIE5_X16),
    _card("b200", 180, 50.0, 2250.0, 7700, "blackwell-dc", "NVIDIA DGX B200 / HGX B200 datasheet, per GPU (FP16/BF16 "
          "tensor 2.25 PFLOPS dense; 180 GB HBM3e at 7.7 TB/s)", _PCIE5_X16),
)})


def get_card(card: "str | Card") -> Card:
    """A Card by name (see CARDS), or the Card given; an unknown name lists the known ones."""
    if isinstance(card, Card):
        return card
    if not isinstance(card, str):
        raise TypeError(f"card must be a card name, an offload.Card or 'measure', got {type(card).__name__}")
    key = card.strip().lower()
    if key in CARDS:
        return CARDS[key]
    # "RTX 4090", "GeForce RTX 3060 12GB", "H100_PCIe", "rtx4090-24gb": the words, and the memory when given
    words = [w for w in re.split(r"[\s_\-]+", key) if w and w not in ("geforce", "nvidia")]
    mem = None
    if len(words) > 1 and re.fullmatch(r"\d+gb", words[-1]):
        mem, words = int(words[-1][:-2]), words[:-1]
    for name in ("".join(words), "-".join(words), "".join(words[:-1]) + "-" + words[-1] if len(words) > 1 else ""):
        for candidate in (name, f"{name}-{mem}gb" if mem else ""):
            found = CARDS.get(candidate)
            if found is not None and (mem is None or found.vram_bytes == mem * GIB):
                return found
        sized = [c for n, c in CARDS.items() if name and re.fullmatch(re.escape(name) + r"-\d+gb", n)]
        if mem is None and len(sized) == 1:  # "rtx 3060": the one size of it in the table
            return sized[0]
    raise ValueError(f"unknown card {card!r}; known cards: {', '.join(CARDS)} (or 'measure', or "
                     f"offload.Card(name, vram_bytes, h2d_gbps, tflops) for another one)")


def match_card(device_name: str, vram_bytes: int | None = None) -> Card | None:
    """The table's card for a device name as CUDA reports it ("NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB"), with the device's own memory when given; None when the table has no such card."""
    name = device_name.lower().replace("nvidia", "").replace("geforce", "")
    words = re.findall(r"[a-z]*\d+[a-z]*", name)
    model = next((w for w in words if re.fullmatch(r"(rtx)?\d{4}[a-z]*|[ahlb]\d{1,3}[a-z]*", w)), None)
    if model is None:
        return None
    model = model if not model.isdigit() else "rtx" + model
    if re.search(r"\d{4}\s*ti\b", name):
        model += "ti"
    if model in ("rtx4070", "rtx4080", "rtx4070ti") and "super" in name:
        model = {"rtx4080": "rtx4080-super", "rtx4070ti": "rtx4070ti-super"}.get(model, model)
    if model == "rtx4070ti" and "super" not in name:
        model = "rtx4070ti-super"  # the nearest in the table
    if model == "rtx4090" and re.search(r"4090\s*d\b", name):
        model = "rtx4090d"
    candidates = [c for n, c in CARDS.items() if n == model or n.startswith(model + "-")]
    if model == "h100":
        candidates = [CARDS["h100-pcie" if "pcie" in name else "h100-sxm"]]
    if not candidates:
        return None
    if vram_bytes:
        best = min(candidates, key=lambda c: abs(c.vram_bytes - vram_bytes))
        return replace(best, vram_bytes=int(vram_bytes))
    return candidates[0]
