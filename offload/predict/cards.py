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
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Mapping

GB = 10 ** 9
GIB = 1 << 30

# Share of the peak a well-shaped workload reaches (what turns FLOPs and bytes into milliseconds). Large bf16 GEMMs
# (a DiT's linear layers at thousands of tokens) run at 70-85% of the dense peak; fused attention kernels (flash /
# memory-efficient SDPA) at 40-60% on consumer cards; elementwise work at about 70% of the memory bandwidth.
MATMUL_EFFICIENCY = 0.75
ATTENTION_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.7
PAGEABLE_FACTOR = 0.5  # pageable host memory copies through a pinned bounce buffer: about half the pinned speed


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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Card name must be a non-empty str, got {self.name!r}")
        for field, value in (("vram_bytes", self.vram_bytes), ("h2d_gbps", self.h2d_gbps), ("tflops", self.tflops)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Card {field} must be a finite number > 0, got {value!r}")
        if isinstance(self.mem_gbps, bool) or not isinstance(self.mem_gbps, (int, float)) or self.mem_gbps < 0:
            raise ValueError(f"Card mem_gbps must be a number >= 0 (0: not counted), got {self.mem_gbps!r}")

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
_AMPERE = "NVIDIA Ampere GA102/GA106 whitepaper and product page (dense FP16 tensor, FP32 accumulate)"
_ADA = "NVIDIA Ada Lovelace whitepaper, appendix tables (dense FP16/BF16 tensor, FP32 accumulate: half the FP16-accumulate rate on GeForce)"
_BLACKWELL = "NVIDIA RTX Blackwell whitepaper (dense FP16/BF16 tensor, FP32 accumulate)"
_HOPPER = "NVIDIA H100 datasheet (dense BF16 tensor)"


def _card(name: str, vram_gb: float, h2d: float, tflops: float, mem: float, *sources: str) -> Card:
    return Card(name, int(vram_gb * GIB), h2d, tflops, mem, None, "; ".join(sources))


CARDS: Mapping[str, Card] = MappingProxyType({c.name: c for c in (
    _card("rtx3060-12gb", 12, 25.0, 25.6, 360, _AMPERE, _PCIE4_X16),
    _card("rtx3080-10gb", 10, 25.0, 59.5, 760, _AMPERE, _PCIE4_X16),
    _card("rtx3090", 24, 25.0, 71.0, 936, _AMPERE, _PCIE4_X16),
    _card("rtx4060ti-16gb", 16, 12.5, 44.1, 288, _ADA, _PCIE4_X8),
    _card("rtx4070-12gb", 12, 25.0, 58.3, 504, _ADA, _PCIE4_X16),
    _card("rtx4070ti-super", 16, 25.0, 88.2, 672, _ADA, _PCIE4_X16),
    _card("rtx4080", 16, 25.0, 97.5, 717, _ADA, _PCIE4_X16),
    _card("rtx4090", 24, 25.0, 165.2, 1008, _ADA, _PCIE4_X16),
    _card("rtx5060ti-16gb", 16, 25.0, 47.4, 448, _BLACKWELL, _PCIE5_X8),
    _card("rtx5070ti", 16, 50.0, 87.9, 896, _BLACKWELL, _PCIE5_X16),
    _card("rtx5080", 16, 50.0, 112.6, 960, _BLACKWELL, _PCIE5_X16),
    _card("rtx5090", 32, 50.0, 209.5, 1792, _BLACKWELL, _PCIE5_X16),
    _card("l4", 24, 25.0, 121.0, 300, "NVIDIA L4 datasheet (dense BF16 tensor)", _PCIE4_X16),
    _card("a100-40gb", 40, 25.0, 312.0, 1555, "NVIDIA A100 datasheet (dense BF16 tensor)", _PCIE4_X16),
    _card("h100-pcie", 80, 50.0, 756.0, 2000, _HOPPER + ", PCIe card", _PCIE5_X16),
    _card("h100-sxm", 80, 50.0, 989.0, 3350, _HOPPER + ", SXM5", _PCIE5_X16),
    _card("h200", 141, 50.0, 989.0, 4800, "NVIDIA H200 datasheet (dense BF16 tensor)", _PCIE5_X16),
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
