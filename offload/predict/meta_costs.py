"""One forward on the meta device, card-independent, for `offload.predict` with a named card: nothing is allocated.

Per unit (and the rest of the forward) its ops as (kind, FLOPs, bytes): matmuls with FLOPs from
`torch.utils.flop_counter`'s formulas, attention as a fused kernel (its FLOPs, not the score matrices the meta
device's math fallback would build), everything else by the bytes it reads and writes; FlopCounterMode's FLOPs per
unit; the peak of live activations. `MetaAnalysis.unit_ms(card)` prices them on a card (a roofline per op).
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from ..model.blocks import Unit, find_units
from .cards import MEMORY_EFFICIENCY, Card


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_NO_TRAFFIC = ("empty", "new_empty", "empty_like", "empty_strided", "zeros", "ones", "full", "detach", "alias",
               "lift_fresh", "lift_fresh_copy", "_local_scalar_dense")
LAUNCH_MS = 0.004  # a kernel's launch and tail on a GPU: what a tiny op costs however little it moves


@dataclass
class MetaAnalysis:
    """One forward on the meta device, card-independent: per unit (and the rest) its ops as (kind, FLOPs, bytes),
    kind mm (FLOPs from torch.utils.flop_counter's formulas), attn (a fused attention kernel) or mem (elementwise,
    norms, copies: bytes read and written); FlopCounterMode's FLOPs per unit; the peak of live activations."""

    units: list[list[tuple[str, float, float]]]
    rest: list[tuple[str, float, float]]
    flops: list[float]
    activation_bytes: int
    seconds: float = 0.0

    def unit_ms(self, card: Card) -> list[float]:
        return [_ops_ms(ops, card) for ops in self.units]

    def rest_ms(self, card: Card) -> float:
        return _ops_ms(self.rest, card)


def _ops_ms(ops: list[tuple[str, float, float]], card: Card) -> float:
    """Milliseconds of `ops` on `card`: each op as slow as its FLOPs or its bytes make it (a roofline), plus a launch;
    attention at the share of the peak its kernel reaches on the card's architecture (`Card.attention_efficiency`)."""
    peak = card.tflops * 1e12
    mem = card.mem_gbps * 1e9 * MEMORY_EFFICIENCY if card.mem_gbps else math.inf
    eff = {"mm": card.matmul_efficiency, "attn": card.attention_efficiency}
    total = 0.0
    for kind, flops, nbytes in ops:
        t = nbytes / mem
        if kind in eff:
            t = max(t, flops / (peak * eff[kind]))
        total += t
    return total * 1e3 + LAUNCH_MS * len(ops) if card.mem_gbps else total * 1e3


class _Recorder:
    """Where the ops of the meta forward go (the unit running, else the rest), and the live activation bytes."""

    def __init__(self, n: int) -> None:
        self.buckets: list[list[tuple[str, float, float]]] = [[] for _ in range(n + 1)]
        self.current = n  # the rest
        self.rest = n
        self.live = 0
        self.peak = 0

    def add(self, kind: str, flops: float, nbytes: float) -> None:
        self.buckets[self.current].append((kind, flops, nbytes))

    def allocated(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


class _FusedAttention(TorchFunctionMode):
    """Scaled dot-product attention on meta tensors as a fused kernel: its FLOPs and bytes recorded and a meta output
    of the right shape returned, instead of the math fallback's score matrices (which would dominate the activation
    peak and hide the kernel a GPU runs)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.flops = 0.0

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = dict(zip(_SDPA_ARGS, args))
            named.update(kwargs)
            q, k, v = named.get("query"), named.get("key"), named.get("value")
            if all(isinstance(t, torch.Tensor) and t.is_meta for t in (q, k, v)):
                lq, d = q.shape[-2], q.shape[-1]
                lk, dv = k.shape[-2], v.shape[-1]
                flops = 2.0 * math.prod(q.shape[:-2]) * lq * lk * (d + dv)
                if named.get("is_causal"):
                    flops /= 2
                out = q.new_empty((*q.shape[:-1], dv))
                self.flops += flops
                self.recorder.add("attn", flops, _nbytes((q, k, v, out)))
                return out
        return func(*args, **kwargs)


class _Traffic(TorchDispatchMode):
    """Every op of the meta forward recorded with its FLOPs (torch.utils.flop_counter's formulas) or the bytes it
    moves, and every fresh output counted live until its tensor dies."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # a value read back on the meta device (`if mask.all():`, `.item()`): there is none; the branch taken is
            # the one a nonzero value takes, which costs about what the other does
            return {torch.bool: True}.get(args[0].dtype, 1)
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return out
        packet = func.overloadpacket
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if packet in flop_registry:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            self.recorder.add("mm", flops, _nbytes(inputs + outputs))
        elif packet.__name__ not in _NO_TRAFFIC:
            self.recorder.add("mem", 0.0, _nbytes(inputs + outputs))
        for t in outputs:
            if not any(t is i for i in inputs):
                self.recorder.allocated(t)
        return out


@contextmanager
def _weights_on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer swapped for a meta tensor of its shape and dtype for the duration; the model's own
    tensors are put back untouched afterwards (nothing is copied or allocated)."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for store in (mod._parameters, mod._buffers):
                for key, t in list(store.items()):
                    if t is None or t.is_meta:
                        continue
                    meta = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                    saved.append((store, key, t))
                    store[key] = nn.Parameter(meta, requires_grad=False) if store is mod._parameters else meta
        yield
    finally:
        for store, key, t in reversed(saved):
            store[key] = t


def _all_nonzero() -> Any:
    """`torch.nonzero` on the meta device as if every element were nonzero (masks of valid tokens, where a model picks
    the tokens it attends to), where this torch offers it."""
    try:
        from torch.fx.experimental import _config as fx_config

        return fx_config.patch(meta_nonzero_assume_all_nonzero=True)
    except (ImportError, AttributeError, KeyError):
        return contextlib.nullcontext()


def _to_meta(tree: Any) -> Any:
    return tree_map(lambda t: t if not isinstance(t, torch.Tensor) or t.is_meta else
                    torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta"), tree)


def analyse_on_meta(model: nn.Module, args: Any = (), kwargs: dict[str, Any] | None = None,
                    units: Sequence[Unit] | None = None) -> MetaAnalysis:
    """One forward of `model` on the meta device (weights and inputs viewed as meta tensors; nothing allocated):
    what each unit computes and moves, card-independent (`predict` costs it on a card)."""
    found = list(units) if units is not None else find_units(model)
    n = len(found)
    recorder = _Recorder(n)
    attention, counter, traffic = _FusedAttention(recorder), FlopCounterMode(display=False), _Traffic(recorder)
    marks: list[list[float]] = [[] for _ in range(n)]

    def enter(i: int) -> None:
        recorder.current = i
        marks[i].append(float(counter.get_total_flops()) + attention.flops)

    def leave(i: int) -> None:
        recorder.current = recorder.rest
        marks[i].append(float(counter.get_total_flops()) + attention.flops)

    handles = []
    for i, unit in enumerate(found):
        handles.append(unit.module.register_forward_pre_hook(lambda *_a, i=i: enter(i)))
        handles.append(unit.module.register_forward_hook(lambda *_a, i=i: leave(i)))
    args = _to_meta(tuple(args) if isinstance(args, (tuple, list)) else (args,))
    kwargs = _to_meta(dict(kwargs or {}))
    started = time.perf_counter()
    try:
        with _weights_on_meta(model), torch.no_grad(), _all_nonzero(), attention, counter, traffic:
            model(*args, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"{type(model).__name__}'s forward cannot run on the meta device ({type(exc).__name__}: "
                         f"{first}); predict it with card='measure' on its device instead") from exc
    finally:
        for h in handles:
            h.remove()
    flops = [sum(b - a for a, b in zip(m[::2], m[1::2])) for m in marks]
    return MetaAnalysis(recorder.buckets[:n], recorder.buckets[n], flops, recorder.peak,
                        time.perf_counter() - started)
