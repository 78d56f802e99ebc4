"""Leaves the file lacks (issue 42): a block whose tensors the model's file holds except a few small ones made at
load keeps the disk tier, those leaves staying resident in host RAM (the block's residue).

The model imitates ComfyUI 0.3.64's scaled-fp8 layers (comfy/ops.py `scaled_fp8_ops`: fp8 weights, a float32
`scale_weight` the file holds, and a float32 `scale_input` Parameter that `reset_parameters` makes at load and no
`*_fp8_scaled` file holds), plus a non-persistent buffer per block (no checkpoint holds one). Under a RAM ceiling
its blocks stream from the file bitwise (the host-master guard on), the host RAM held stays under the ceiling with
the residue counted, a step reads from the file exactly the file-held leaves' bytes, and each disk block reports its
residue; RAM given back, detach, pack and compression keep the bytes. A block whose leaves the file lacks are more
than 1/16 of it stays in RAM, the reason naming the leaf.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from offload import CorruptFileError, OffloadConfig
from offload.plan.plan_host import plan_host
from offload.store.leaf_match import RESIDUE_ALIGN
from tests.host_master_guard import host_master_guard, step_disk_reads
from tests.models import aligned_bytes

DIM, DEPTH = 64, 6


class ScaledFP8Linear(nn.Linear):
    """0.3.64's `scaled_fp8_op.Linear`: an fp8 weight with a float32 `scale_weight` (in the file) and a float32
    `scale_input` made at load (ones there; here 0.5 so the output shows whether its bytes arrived)."""

    def made_at_load(self) -> None:
        self.scale_input = nn.Parameter(torch.full((), 0.5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype) * self.scale_weight.to(x.dtype)
        return F.linear(x * self.scale_input.to(x.dtype), w, self.bias)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = ScaledFP8Linear(dim, 2 * dim)
        self.fc2 = ScaledFP8Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.gate


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(DEPTH))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, ScaledFP8Linear)]


def _loaded(tmp_path, extra=None):
    """(the model as a 0.3.64-style loader leaves it, its scaled-fp8 file, the bytes the file holds per block)."""
    torch.manual_seed(0)
    model = Net().eval()
    for lin in _linears(model):  # quantized as the scaled-fp8 files are: fp8 payload, float32 per-tensor scale
        scale = lin.weight.detach().abs().max() / 448.0
        lin.weight = nn.Parameter((lin.weight.detach() / scale).to(torch.float8_e4m3fn), requires_grad=False)
        lin.scale_weight = nn.Parameter(scale.reshape(()).float(), requires_grad=False)
    path = str(tmp_path / "scaled_fp8.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    for lin in _linears(model):
        lin.made_at_load()
    if extra is not None:
        extra(model)
    held = sum(t.numel() * t.element_size() for n, t in model.layers[0].state_dict().items()
               if not n.endswith("scale_input"))
    return model, path, held


def _x():
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(3))


def _cfg(path, **kw):
    """disk_optional: the file is the one the model was loaded from, not asserted to be all of it (ComfyUI's nodes
    pass their model's file so); without it a file lacking a persistent tensor is not the model's own, refused."""
    kw.setdefault("host_compression", "off")
    kw.setdefault("disk_optional", True)
    return OffloadConfig.from_preset("budget", device="sim", disk_path=path, **kw)


def _ceiling(model, blocks_in_ram=2):
    blk = aligned_bytes(model.layers[0])
    return aligned_bytes(model) - (DEPTH - blocks_in_ram) * blk + (32 << 10)


RESIDUE = 2 * RESIDUE_ALIGN + 4 * RESIDUE_ALIGN  # two scale_input scalars, the 64-float gate (256 bytes)


def test_leaves_the_file_lacks_stay_resident_while_the_block_streams_from_disk(tmp_path, offload):
    model, path, held = _loaded(tmp_path)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    ceiling = _ceiling(model)
    with pytest.raises(CorruptFileError, match=r"fc1\.scale_input"):  # given as the model's own file: it is not
        offload(model, _cfg(path, ram_budget_bytes=ceiling, disk_optional=False))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    h = offload(model, _cfg(path, ram_budget_bytes=ceiling))
    read = step_disk_reads(h, model, x, ref)
    rep = h.report()
    disk = [b for b in rep.blocks if b.tier == "disk"]
    assert disk, [b.placement for b in rep.blocks]
    assert read == held * len(disk)  # only the file-held leaves are read, once a step
    assert all(b.residue_bytes == b.host_bytes == RESIDUE for b in disk), [(b.residue_bytes, b.host_bytes)
                                                                            for b in disk]
    assert all(f"keeps {RESIDUE} bytes in RAM" in b.placement for b in disk), [b.placement for b in disk]
    assert all(b.residue_bytes == 0 for b in rep.blocks if b.tier != "disk")
    mem = h.host_memory()
    assert mem["residue"] == RESIDUE * len(disk) and mem["ram"] <= ceiling
    # between passes a disk block's made-at-load leaves are its RAM copy, its weights views of the file
    assert float(model.layers[-1].fc1.scale_input) == 0.5
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_ram_given_back_keeps_the_residue_and_the_bytes(tmp_path, offload):
    model, path, _ = _loaded(tmp_path)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    h = offload(model, _cfg(path, disk_optional=True))
    with torch.no_grad():
        model(x)
    ram = h.host_memory()["ram"]
    freed = h.release_host_memory(ram)
    assert {b.tier for b in h.report().blocks} == {"disk"}
    after = h.host_memory()
    assert after["residue"] == RESIDUE * DEPTH and after["ram"] == ram - freed
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
        assert torch.equal(model(x), ref)
    # a made-at-load leaf written in place is the block's own: it streams the written value from then on
    with torch.no_grad():
        model.layers[2].fc1.scale_input.fill_(0.25)
        changed = model(x)
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), changed) and not torch.equal(changed, ref)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "compressed"])
def test_a_packed_folder_holds_the_residue_leaves_too(compress, tmp_path, offload):
    """`handle.pack` stores every leaf, the residue's from RAM: the folder then holds the made-at-load scales too,
    and only the non-persistent buffer (never read from a file) stays resident."""
    model, path, _ = _loaded(tmp_path)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    h = offload(model, _cfg(path, ram_budget_bytes=_ceiling(model)))
    with torch.no_grad():
        model(x)
    h.pack(str(tmp_path / "packed"), compress=compress)
    h.detach()
    h = offload(model, _cfg(str(tmp_path / "packed"), ram_budget_bytes=_ceiling(model)))
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
    disk = [b for b in h.report().blocks if b.tier == "disk"]
    assert disk and all(b.residue_bytes == 4 * RESIDUE_ALIGN for b in disk), [b.residue_bytes for b in disk]


def test_blocks_held_compressed_and_on_disk_with_a_residue_are_bitwise(tmp_path, offload):
    model, path, _ = _loaded(tmp_path)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    ceiling = _ceiling(model, blocks_in_ram=1)
    h = offload(model, _cfg(path, ram_budget_bytes=ceiling, host_compression="lossless"))
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
        assert torch.equal(model(x), ref)
    assert h.host_memory()["ram"] <= ceiling
    assert "disk" in {b.tier for b in h.report().blocks}


def test_a_residue_over_its_bound_keeps_the_block_in_ram_named(tmp_path, offload):
    """A block whose leaves the file lacks are more than 1/16 of it (a tensor larger than its weights, added after
    load) is not the file's: it stays in RAM, the reason naming the leaf (over the ceiling, said)."""
    def adapter(model):
        for block in model.layers:
            block.fc1.delta = nn.Parameter(torch.zeros(100, DIM), requires_grad=False)

    model, path, _ = _loaded(tmp_path, adapter)
    x = _x()
    with torch.no_grad():
        ref = model(x)
    with pytest.raises(ValueError, match=r"fc1\.delta"):  # given as the model's own file: the ceiling cannot hold
        offload(model, _cfg(path, ram_budget_bytes=_ceiling(model), disk_optional=False))
    h = offload(model, _cfg(path, ram_budget_bytes=_ceiling(model)))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    rep = h.report()
    assert all(b.tier != "disk" for b in rep.blocks)
    kept = [b.placement for b in rep.blocks if "off the disk tier" in b.placement]
    assert kept and all("fc1.delta" in p and "1/16" in p for p in kept), kept


def test_the_host_plan_keeps_room_for_the_disk_tiers_residue():
    """plan_host: a disk-tier unit still holds its residue in RAM, so the units kept in RAM leave room for it."""
    plan = plan_host([100] * 4, 250, 0, True, False, residue=[10] * 4)
    assert plan.tiers == {0: "pageable", 1: "pageable", 2: "disk", 3: "disk"}
    assert plan.ram_bytes == 220
    plan = plan_host([100] * 4, 230, 0, True, False, residue=[20] * 4)
    assert plan.tiers == {0: "pageable", 1: "disk", 2: "disk", 3: "disk"} and plan.ram_bytes == 160
