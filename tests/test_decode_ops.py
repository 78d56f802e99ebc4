"""The decode of a unit held compressed is a constant number of device ops (issue 44): each op is a kernel launch on a
GPU, so a unit of many small tensors must not pay a decode per tensor. Counted with a TorchDispatchMode (views
excluded) over the decode of each unit the engine staged (the blob's copy into the slot is the one op a raw unit's copy
is too), after a first decode made the tables and the scratch; deterministic, so exact bounds."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import Leaf
from offload.store import codec, unit_code
from offload.store.compressed import decode_scratch

UNITS = 3


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class Unit(nn.Module):
    """A block of `count` small tensors (norms, biases, modulation vectors), optionally of two dtypes interleaved."""

    def __init__(self, count: int, elems: int, mixed: bool = False) -> None:
        super().__init__()
        self.p = nn.ParameterList(
            nn.Parameter((torch.randn(elems) * 0.02).to(torch.float32 if mixed and i % 2 else torch.bfloat16))
            for i in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p[0][:1]


def second_decode_ops(raw: torch.Tensor, enc: codec.Encoded) -> list[str]:
    """The ops of a second decode of `enc` into a slot (the first made the scratch and the tables; the second reuses
    them, as every decode after a unit's first does), each decode checked bitwise `raw`."""
    slot = torch.empty(raw.numel(), dtype=torch.uint8)
    scratch = codec.DecodeScratch()
    for _ in range(2):
        slot[raw.numel() - enc.size:].copy_(enc.blob)
        with OpCount() as c:
            codec.decode_into(slot, enc.chunks, raw.numel(), enc.size, scratch)
        assert torch.equal(slot, raw)
    return c.ops


def _decode_ops(count: int, elems: int, mixed: bool = False) -> int:
    """The ops one decode of a staged unit dispatches (its scratch and tables made by an earlier decode), checked
    equal for every unit of the model; the model's forward stays bitwise that of the raw model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Unit(count, elems, mixed) for _ in range(UNITS)])
    if not mixed:
        model = model.to(torch.bfloat16)
    x = torch.zeros(1, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    handle = offload_module(model, OffloadConfig.from_preset("budget", device="sim", host_compression="lossless"),
                            budget=VramBudget(None))
    with torch.no_grad():
        assert all(torch.equal(model(x), ref) for _ in range(2))
    blocks = handle.report().blocks
    assert all(b.compression == codec.CODEC and b.host_bytes < b.raw_bytes for b in blocks)
    counts = []
    for unit in handle.streamer.staged.units:
        enc = unit.source.encoded
        slot = handle.backend.alloc(enc.nbytes)
        scratch = decode_scratch(handle.backend)
        for _ in range(2):
            slot[enc.nbytes - enc.size:].copy_(enc.blob)  # the copy a raw unit makes too
            with OpCount() as c:
                codec.decode_into(slot, enc.chunks, enc.nbytes, enc.size, scratch)
            assert torch.equal(slot, unit.master.host)
        handle.backend.release(slot)
        counts.append(len(c.ops))
    handle.detach()
    return max(counts)  # a unit without escapes decodes in two ops fewer


def _extra(count: int, elems: int, mixed: bool = False) -> int:
    return _decode_ops(count, elems, mixed)


PIECE_OPS = 8  # one coded piece: its bytes into the scratch, 3 to widen its indices, the gather, the other byte
# planes, the escapes' clamp and scatter (a code of byte-wide indices widens in 1)


def test_a_unit_of_32_bf16_tensors_decodes_in_at_most_12_ops():
    assert _extra(32, 1000) <= 12


@pytest.mark.parametrize("count,elems", [(8, 1000), (128, 1000), (32, 4096), (32, 65536)])
def test_the_decode_ops_do_not_grow_with_tensors_or_size(count, elems):
    """Up to the scratch size (a piece of unit_code.CHUNK_ELEMS elements), whatever the tensor count: one piece."""
    assert count * elems < unit_code.CHUNK_ELEMS
    assert _extra(count, elems) <= PIECE_OPS


def test_a_unit_of_two_dtypes_interleaved_decodes_in_a_constant_count():
    """A layout groups a unit's tensors by dtype: one stream each, whatever the interleaving in the module (and a
    raw run for the padding between the two, copied through the scratch)."""
    assert _extra(64, 1000, mixed=True) <= 2 * PIECE_OPS + 2
    assert _extra(8, 1000, mixed=True) <= 2 * PIECE_OPS + 2


def test_a_large_unit_pays_a_decode_per_scratch_piece_only():
    n = 3 * unit_code.CHUNK_ELEMS + 1000  # four pieces of one run
    raw = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16).view(torch.uint8)
    enc = codec.encode(raw, [Leaf(0, raw.numel(), torch.bfloat16, (n,), None)])
    assert sum(c.coded for c in enc.chunks) == 4
    ops = second_decode_ops(raw, enc)
    assert len(ops) <= 4 * 8 + 2 and "aten.empty.memory_format" not in ops


@pytest.mark.parametrize("seed", range(4))
def test_garbage_encoded_bytes_decode_inside_the_unit(seed):
    """A hostile stream under a valid chunk list (what a crafted shard holds: the index is checked, the bytes are not
    until the CPU's escape check): every index it holds is inside the table, every escape clamped into its piece,
    so the decode writes only the unit's bytes of the slot, whatever the bytes."""
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        values = torch.randn(20_000, generator=g) * 0.02
        values[::997] = 1e4 if dtype != torch.float8_e4m3fn else 400.0  # outside the window: listed escapes
        raw = values.to(dtype).view(torch.uint8)
        raw = torch.cat([raw, torch.zeros((-raw.numel()) % 512, dtype=torch.uint8)])
        enc = codec.encode(raw, [Leaf(0, raw.numel(), dtype, (raw.numel() // dtype.itemsize,), None)])
        assert any(c.coded for c in enc.chunks)
        garbage = torch.randint(0, 256, (enc.size,), dtype=torch.uint8, generator=g)
        slot = torch.full((raw.numel() + 64,), 7, dtype=torch.uint8)
        slot[raw.numel() - enc.size:raw.numel()] = garbage
        codec.decode_into(slot, enc.chunks, raw.numel(), enc.size, codec.DecodeScratch())
        assert bool((slot[raw.numel():] == 7).all())
        if any(c.n_esc for c in enc.chunks):
            with pytest.raises(ValueError):  # the CPU's check refuses what the device would clamp
                codec.check_escapes(codec.Encoded(torch.full((enc.size,), 0xFF, dtype=torch.uint8), enc.chunks,
                                                  enc.nbytes))
