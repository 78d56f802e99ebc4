"""Which parameters inside the blocks train (adapters a library added before offloading, a norm left trainable): a
fact about the model that staging and the predictor read, so they stay on the device outside the streamed bytes
(the backward side is `stream/backward.py`)."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


# dtypes a parameter is trained in: a frozen float8 or integer weight is frozen because it cannot train, so it says
# nothing about whether the model is being set up for training
_TRAINABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRAINABLE_DTYPES = _TRAINABLE_DTYPES  # (used by stream/restage.py for adapters added after offloading)


def trainable_in_blocks(modules: list[nn.Module], skip: set[int]) -> list[nn.Parameter]:
    """The parameters the blocks hold that train, kept on the device outside the streamed bytes (see
    stream/backward.py): adapters a library added before offloading (peft's LoRA layers), norms left trainable. Empty
    unless the model is set up for training: offloaded with gradients enabled (not under no_grad or inference_mode),
    some of the blocks' parameters frozen, and the trainable ones the smaller part of the two. A model whose parameters all
    require grad (any nn.Module's default) streams all of them, as does one offloaded for inference."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return []
    trainable: list[nn.Parameter] = []
    seen = set(skip)
    trainable_bytes = frozen_bytes = 0
    for module in modules:
        for sub in module.modules():
            for p in sub._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                if p.dtype not in _TRAINABLE_DTYPES:
                    continue
                nbytes = p.numel() * p.element_size()
                if not p.requires_grad:
                    frozen_bytes += nbytes
                elif type(p) is nn.Parameter:
                    trainable.append(p)
                    trainable_bytes += nbytes
    if not trainable or trainable_bytes >= frozen_bytes:
        return []
    log.info("%d trainable parameter(s) inside the blocks (%.2f MB) are kept on the device; the frozen weights "
             "stream", len(trainable), trainable_bytes / 2**20)
    return trainable
