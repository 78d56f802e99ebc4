"""Tiny checkpoints of the model families users run, in ComfyUI's key layout (plain torch + safetensors, seeded).

Each module describes one family as a `Family` (families/common.py): its keys and shapes, the detected config
that makes it tiny, how to sample it and which layers a LoRA patches. tests/comfyui/test_families.py writes the
files, loads them with ComfyUI's plain loaders and with the pack's, and compares the results bitwise.
"""
from __future__ import annotations

from typing import Dict

from .common import Family, Sampling
from .flux import FLUX
from .hunyuan_video import HUNYUAN_VIDEO
from .probes import ACE_STEP, ACE_STEP15, CHROMA, LUMINA2, QWEN_IMAGE
from .sd3 import SD3
from .sd15 import SD15
from .wan import WAN21, WAN22, WAN22_5B

FAMILIES: Dict[str, Family] = {f.name: f for f in (WAN21, WAN22, WAN22_5B, HUNYUAN_VIDEO, SD3, SD15, FLUX, CHROMA,
                                                    LUMINA2, QWEN_IMAGE, ACE_STEP, ACE_STEP15)}

__all__ = ["FAMILIES", "Family", "Sampling"]
