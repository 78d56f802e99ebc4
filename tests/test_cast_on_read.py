"""Cast on read (issue 42): a block whose weights are an exact dtype cast of its file's tensors (ComfyUI's
`weight_dtype` fp8_e4m3fn on a bf16 file; a bf16 file loaded as fp32 on the CPU) keeps the disk tier: the
read-ahead thread reads the file's bytes and casts them into the bounce buffer, bitwise the cast the loader made.
The plan knows which units are cast and from what (its reasons say so); a weight that is not the cast of its file's
tensor stays in RAM, named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from offload import OffloadConfig
from offload.backends.sim_clock import SimClock
from offload.store.sources import CAST_CHUNK
from tests.host_master_guard import disk_units_file_bytes, host_master_guard, step_disk_reads
from tests.models import LayersModel, aligned_bytes, seeded

DEPTH = 6


def _bf16_file(tmp_path, dim=64):
    src = seeded(LayersModel, dim=dim, depth=DEPTH).to(torch.bfloat16)
    path = str(tmp_path / "bf16.safetensors")
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, path)
    return path


def _fp8_weights(model, dtype=torch.float8_e4m3fn):
    """ComfyUI's weight_dtype fp8: the blocks' linear weights cast to fp8 at load, computed in the input's dtype."""
    for block in model.layers:
        for lin in (block.fc1, block.fc2):
            lin.weight.data = lin.weight.data.to(dtype)
            lin.forward = (lambda x, lin=lin: F.linear(x, lin.weight.to(x.dtype), lin.bias))
    return model


def _ceiling(model, blocks_in_ram=2):
    blk = aligned_bytes(model.layers[0])
    return aligned_bytes(model) - (DEPTH - blocks_in_ram) * blk + (32 << 10)


def _cfg(path, ram, **kw):
    return OffloadConfig.from_preset("budget", device="sim", host_compression="off", disk_path=path,
                                     ram_budget_bytes=ram, **kw)


@pytest.mark.parametrize("cast", ["fp32_on_cpu", "weight_dtype_fp8_e4m3fn", "weight_dtype_fp8_e5m2"])
def test_cast_blocks_stream_from_their_file_with_the_cast_applied(cast, tmp_path, offload):
    path = _bf16_file(tmp_path)
    model = seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16)
    if cast == "fp32_on_cpu":
        model, dtype = model.float(), torch.float32
    else:
        fp8 = torch.float8_e4m3fn if cast.endswith("e4m3fn") else torch.float8_e5m2
        model, dtype = _fp8_weights(model, fp8), torch.bfloat16
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        ref = model(x)
    ceiling = _ceiling(model)
    h = offload(model, _cfg(path, ceiling))
    read = step_disk_reads(h, model, x, ref)
    rep = h.report()
    disk = [b for b in rep.blocks if b.tier == "disk"]
    assert disk and all("with a cast" in b.placement and "from bfloat16" in b.placement for b in disk), \
        [b.placement for b in rep.blocks]
    assert h.host_memory()["ram"] <= ceiling
    assert read == disk_units_file_bytes(h)  # the file's bf16 bytes, read once a pass
    # between passes a cast block's weights are ordinary tensors holding the cast values (the spill file's map)
    w = model.layers[-1].fc1.weight
    assert w.dtype == (torch.float32 if cast == "fp32_on_cpu" else w.dtype) and torch.isfinite(w.float()).all()
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_cast_larger_than_the_scratch_is_read_in_pieces(tmp_path, offload):
    """A tensor bigger than the read-ahead thread's cast scratch is read and cast a piece at a time."""
    dim = 512  # fc1: 1024 x 512 bf16 = 1 MiB in the file, two pieces of CAST_CHUNK
    path = _bf16_file(tmp_path, dim)
    model = seeded(LayersModel, dim=dim, depth=DEPTH).to(torch.bfloat16).float()
    assert 2 * dim * dim * 2 >= CAST_CHUNK
    x = torch.randn(2, 5, dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    h = offload(model, _cfg(path, _ceiling(model)))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    assert "disk" in [b.tier for b in h.report().blocks]
    assert h.streamer.staged.reader.scratch_bytes <= CAST_CHUNK


def test_weights_that_are_not_the_files_cast_stay_in_ram_named(tmp_path, offload):
    """fp32 weights trained after loading are not a cast of the bf16 file: their blocks stay in RAM (the reason names
    the file tensor); the model's own file in another dtype is refused up front without disk_optional."""
    path = _bf16_file(tmp_path)
    model = seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16).float()
    with torch.no_grad():
        for block in model.layers[3:]:
            block.fc1.weight.add_(1e-3)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        ref = model(x)
    with pytest.raises(ValueError, match=r"layers\.3\.fc1\.weight.*bfloat16 in the file but .*float32 in the model"):
        offload(model, _cfg(path, None))
    h = offload(model, _cfg(path, _ceiling(model), disk_optional=True))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    tiers = [b.tier for b in h.report().blocks]
    assert all(t != "disk" for t in tiers[3:]), tiers
    assert any("not its cast" in b.placement for b in h.report().blocks[3:])
    assert "disk" in tiers[:3]


def test_release_host_memory_moves_cast_blocks_to_the_disk_tier(tmp_path, offload):
    path = _bf16_file(tmp_path)
    model = _fp8_weights(seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16))
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", host_compression="off", disk_path=path,
                                                 disk_optional=True))
    with torch.no_grad():
        model(x)
    freed = h.release_host_memory(h.host_memory()["ram"])
    assert freed > 0
    assert {b.tier for b in h.report().blocks} == {"disk"}
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_handle_read_with_a_cast_packs_the_cast_bytes(tmp_path, offload):
    """`handle.pack` of a model whose disk-tier blocks are cast on read stores them as the model holds them: the
    folder then streams them with no cast."""
    path = _bf16_file(tmp_path)
    model = seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16).float()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        ref = model(x)
    h = offload(model, _cfg(path, _ceiling(model)))
    with torch.no_grad():
        model(x)
    assert "disk" in [b.tier for b in h.report().blocks]
    h.pack(str(tmp_path / "packed"))
    h.detach()
    model = seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16).float()
    h = offload(model, _cfg(str(tmp_path / "packed"), _ceiling(model)))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    disk = [b for b in h.report().blocks if b.tier == "disk"]
    assert disk and not any("cast" in b.placement for b in disk)


def test_the_simulated_disk_charges_a_cast_read_the_files_bytes(tmp_path, offload):
    """On the simulated device's clock a cast block's read takes the bytes the file holds (bf16 for fp32 weights:
    half the bytes that arrive; the layout's padding as it lies), not the bytes the bounce buffer receives."""
    path = _bf16_file(tmp_path)
    model = seeded(LayersModel, dim=64, depth=DEPTH).to(torch.bfloat16).float()
    x = torch.randn(2, 5, 64)
    gbps = 1.0
    h = offload(model, _cfg(path, _ceiling(model), sim_clock=SimClock(disk_gbps=gbps)))
    with torch.no_grad():
        model(x)
    staged = h.streamer.staged
    disk = [u for u in staged.units if u.master.host is None]
    assert disk and all(u.master.casts and all(c is not None for c in u.master.casts) for u in disk)
    for u in disk:
        in_file = sum(staged.file.tensors[k].end - staged.file.tensors[k].start for k in u.master.keys)
        padding = u.source.nbytes - sum(leaf.nbytes for leaf in u.master.layout.leaves)  # read as it lies
        assert u.source.nbytes - padding > 1.9 * in_file
        assert u.source.read_ms == pytest.approx(u.source.reads * (in_file + padding) / (gbps * 1e9) * 1e3)
