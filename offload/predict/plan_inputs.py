"""What `python -m offload plan` accepts, checked before any work: the model file read through the engine's
validator (`store/header_check.py`: a regular file, a capped, validated safetensors header; a config only if it is
small JSON), a model no larger than any released one (a config claiming 10^6 layers is refused up front instead of
built until the machine runs out of memory), and command-line numbers in range.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Callable

from ..store.header_check import CorruptFileError, read_json_object

GIB = 1 << 30
MAX_LAYERS = 1024  # the deepest released models have ~200 layers (blocks of a diffusion transformer: ~60)
MAX_WIDTH = 1 << 17  # hidden / intermediate / channel sizes: the widest released models are ~30k (MoE FFNs ~50k)
MAX_HEADS = 4096
MAX_EXPERTS = 4096
MAX_VOCAB = 1 << 23
MAX_BYTES = 1 << 50  # a RAM or VRAM size past 1 PiB is a typo
_LAYERS = re.compile(r"(^|_)(layers?|depth|blocks)$|^n_layers?$")
_WIDTH = re.compile(r"(hidden_size|intermediate_size|d_model|n_embd|n_inner|d_ff|_dim|^dim|channels)$")
_HEADS = re.compile(r"(heads|head_count)$")
_EXPERTS = re.compile(r"experts$")
_LIMITS = ((_LAYERS, MAX_LAYERS, "layers"), (_WIDTH, MAX_WIDTH, "width"), (_HEADS, MAX_HEADS, "attention heads"),
           (_EXPERTS, MAX_EXPERTS, "experts"), (re.compile(r"vocab_size$"), MAX_VOCAB, "vocabulary"))


def read_config(path: Path) -> dict[str, Any]:
    """A config.json: a regular file of at most a few MB holding a JSON object (a .gguf or any large or
    non-regular file is refused by size or type before it is read)."""
    if path.suffix.lower() == ".gguf":  # read as a model file (its header) by the file plan, never as JSON
        raise ValueError(f"{path}: a GGUF file is not a config.json")
    return read_json_object(path, "config.json")


class ModelBoundsError(ValueError):
    """A config (or a model file's names and shapes) describing a model larger than any released one."""


def check_model_size(config: dict[str, Any], source: str) -> None:
    """Refuse a config (or a config read from a file's tensor names and shapes) describing a model larger than any
    released one, or with negative sizes, before anything is built."""
    def visit(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{where}{key}" if not where else f"{where}.{key}")
        elif isinstance(node, (list, tuple)):
            for value in node[:4096]:
                visit(value, where)
        elif isinstance(node, int) and not isinstance(node, bool):
            key = where.rpartition(".")[2]
            for pattern, limit, what in _LIMITS:
                if pattern.search(key):
                    if node < 0:
                        raise ModelBoundsError(f"{source}: {where} is {node}; a model size cannot be negative")
                    if node > limit:
                        raise ModelBoundsError(f"{source}: {where} is {node}, more {what} than any released model "
                                         f"(at most {limit} here); the config looks corrupt or crafted")

    visit(config, "")


# ------------------------------------------------------------------------------------------------ the flags
_SIZE = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{0,9})?|\.[0-9]{1,9})\s*(gib|gb|g|mib|mb|m)?\s*$", re.I)


def parse_bytes(text: str) -> int:
    """'32GB', '32 GiB', '12g', '512MB' -> bytes (GB and GiB both mean 2**30 here, as a card's '12 GB' does)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{str(text)[:40]!r} is not a size; write e.g. 32GB or 512MB")
    unit = (m.group(2) or "gb").lower()
    value = float(m.group(1)) * (GIB if unit.startswith("g") else 1 << 20)
    if not 0 < value <= MAX_BYTES:
        raise ValueError(f"{str(text)[:40]!r} is not a size between 1 MB and {MAX_BYTES // GIB} GB")
    return int(value)


def int_in(flag: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [lo, hi], else a one-line usage error naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 20 else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number from {lo} to {hi}, got {text[:40]!r}")
        return value
    return parse


__all__ = ["CorruptFileError", "ModelBoundsError", "check_model_size", "int_in", "parse_bytes", "read_config"]
