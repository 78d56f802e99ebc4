"""The disk tier (DESIGN §2 storage.py, §6): blocks that do not fit the RAM budget stream from the model's
safetensors file through bounce buffers filled by a read-ahead thread.

Checked: tiers in the report, one read per disk unit per forward, parameters that view the file's mmap
between forwards (no RAM copy), bitwise outputs, a model built on the meta device, corrupt or mismatched files
refused before anything is attached, and reads that really happen ahead of the unit that needs them.
"""
from __future__ import annotations

import itertools
import json
import os
import struct
import threading

import pytest
import torch
from safetensors.torch import save_file

from offload import OffloadConfig, VramBudget, offload_module
from offload.backends.sim_clock import SimClock
from tests.models import LayersModel, aligned_bytes, raw_bytes, resident_modules, run, seeded

DEPTH = 6
_caps = itertools.count(1)


def _private_capacity() -> int:
    return (96 << 20) + 512 * next(_caps) + 7


def _model(seed=0, dim=64, depth=DEPTH, dtype=None):
    m = seeded(LayersModel, dim=dim, depth=depth, seed=seed)
    return m.to(dtype) if dtype is not None else m


def _x(dim=64):
    g = torch.Generator().manual_seed(4321)
    return torch.randn(2, 5, dim, generator=g)


def _save(model, path, prefix="model.", drop=(), dtype=None):
    sd = {}
    for k, v in model.state_dict().items():
        if any(k.startswith(d) for d in drop):
            continue
        v = v.detach().contiguous()
        sd[prefix + k] = v.to(dtype) if dtype is not None else v
    save_file(sd, str(path))
    return path


BLK = aligned_bytes(_model().layers[0])


REST = aligned_bytes(_model()) - DEPTH * BLK  # the weights outside the blocks, always in RAM


def _cfg(path, ram_units=2, preset="budget", **kw):
    """`ram_units` blocks' worth of RAM; 0: the least that streams every block from disk (the weights outside the
    blocks plus one block's worth, shared by the bounce buffers: ram_budget_bytes caps the engine's host RAM)."""
    kw.setdefault("device", "sim")
    # the disk tier's own mechanics: no block held compressed in RAM instead (host_compression "auto" keeps blocks
    # off the disk tier where that saves disk reads; tests/test_host_compression.py)
    kw.setdefault("host_compression", "off")
    ram = ram_units * BLK if ram_units else REST + BLK
    return OffloadConfig.from_preset(preset, disk_path=str(path), ram_budget_bytes=ram, **kw)


def _reads(h):
    """Per-unit bounce reads and the disk bytes read so far (the report waits for queued reads first)."""
    rep = h.report()
    return [b.reads for b in rep.blocks], rep.disk_bytes_read


def _disk_indices(h):
    return [i for i, b in enumerate(h.report().blocks) if b.tier == "disk"]


def _param_storage_is_file(p, path):
    """The parameter's storage is the whole file, mapped: same size, same first bytes (the header length)."""
    st = p.untyped_storage()
    size = os.path.getsize(path)
    if st.nbytes() != size:
        return False
    with open(path, "rb") as f:
        head = f.read(64)
    return bytes(st[:64].tolist()) == head


# ------------------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model.", "", "diffusion_model.model."])
@pytest.mark.parametrize("prefetch", [1, 3])
def test_disk_tier_end_to_end(tmp_path, offload, prefix, prefetch):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    units = list(model.layers)
    path = _save(model, tmp_path / "m.safetensors", prefix=prefix)
    h = offload(model, _cfg(path, ram_units=2, prefetch=prefetch))
    tiers = [b.tier for b in h.report().blocks]
    disk = _disk_indices(h)
    # two blocks' worth of RAM (one, if the weights outside the blocks count against it too)
    assert DEPTH - 2 <= len(disk) <= DEPTH - 1, f"two blocks fit the RAM budget, the rest stream from disk: {tiers}"
    assert all(tiers[i] in ("pinned", "pageable") for i in range(DEPTH) if i not in disk), tiers
    per_forward = sum(raw_bytes(units[i]) for i in disk)

    assert torch.equal(run(model, (x,)), ref)  # first forward: the read-ahead learns the order
    all_reads, nbytes = _reads(h)
    reads = {i: all_reads[i] for i in disk}
    assert all(r >= 1 for r in reads.values()), reads
    for k in range(1, 4):
        assert torch.equal(run(model, (x,)), ref)
        all_now, now_bytes = _reads(h)
        now = {i: all_now[i] for i in disk}
        assert now == {i: reads[i] + k for i in disk}, f"forward {k}: reads {now}, expected one more each"
        assert now_bytes - nbytes == k * per_forward, "each disk unit's bytes are read once a forward"
    rep = h.report()
    assert [b.tier for b in rep.blocks] == tiers
    assert all(rep.blocks[i].bytes > 0 for i in disk)
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_disk_params_view_the_file_mmap_between_forwards(tmp_path, offload):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = _save(model, tmp_path / "m.safetensors")
    h = offload(model, _cfg(path, ram_units=1))
    disk = _disk_indices(h)
    assert disk
    ram_params = [p for i in range(DEPTH) if i not in disk for p in model.layers[i].parameters()]
    ram_params += list(model.inp.parameters()) + list(model.out.parameters())
    ram_storages = {p.untyped_storage().data_ptr() for p in ram_params}

    def in_ram_buffer(t):
        return t.untyped_storage().data_ptr() in ram_storages

    seen = {}

    def during(i):
        def hook(mod, args):
            seen[i] = [h.backend.owns(p) for p in mod.parameters()]
        return hook

    hooks = [model.layers[i].register_forward_pre_hook(during(i)) for i in disk]
    try:
        for _ in range(3):
            seen.clear()
            assert torch.equal(run(model, (x,)), ref)
            assert set(seen) == set(disk)
            assert all(all(v) for v in seen.values()), "during its forward a disk unit computes from device memory"
            for i in disk:
                for n, p in model.layers[i].named_parameters():
                    name = f"layers.{i}.{n}"
                    assert not h.backend.owns(p), f"{name} left on the device"
                    assert not in_ram_buffer(p), f"{name} points into a RAM staging buffer"
                    assert _param_storage_is_file(p, path), f"{name} is not a view of the file's mmap"
                    assert torch.equal(p.detach(), orig[name]), f"{name} values differ from the file"
            for i in range(DEPTH):
                if i not in disk:
                    for n, p in model.layers[i].named_parameters():
                        assert not _param_storage_is_file(p, path), "RAM-tier units keep their own RAM master"
    finally:
        for hk in hooks:
            hk.remove()
    h.detach()
    for n, p in model.named_parameters():
        assert not _param_storage_is_file(p, path), f"{n} still views the file after detach"
        assert torch.equal(p.detach(), orig[n])
    p = model.layers[disk[0]].fc1.weight
    with torch.no_grad():
        p.copy_(orig[f"layers.{disk[0]}.fc1.weight"])  # an ordinary, writable tensor again
    assert torch.equal(run(model, (x,)), ref)


def test_resident_disk_units_are_read_once(tmp_path, offload):
    """Disk-tier units that end up resident in VRAM are read once, not every forward."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    h = offload(model, _cfg(path, ram_units=0, preset="auto", prefetch=1))
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    assert len(resident_modules(h)) == DEPTH
    reads = _reads(h)
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref)
    assert _reads(h) == reads


def test_no_disk_when_the_preset_forbids_it(tmp_path, offload):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    from offload.plan.planner import RamCeilingError

    with pytest.raises(RamCeilingError, match=f"at least {REST + DEPTH * BLK}") as info:  # a ceiling it cannot keep
        offload(model, _cfg(path, ram_units=1, preset="high_end"))
    assert "allow the disk tier" in str(info.value) and "give disk_path" not in str(info.value)  # it was given
    assert torch.equal(run(model, (x,)), ref)
    h = offload(model, _cfg(path, ram_units=DEPTH + 1, preset="high_end"))
    assert "disk" not in [b.tier for b in h.report().blocks]
    assert torch.equal(run(model, (x,)), ref)


@pytest.mark.parametrize("ram_units", [0, 3, None])
def test_meta_model_offloaded_from_the_file(tmp_path, offload, ram_units):
    ref_model = _model()
    x = _x()
    ref = run(ref_model, (x,))
    path = _save(ref_model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = LayersModel(dim=64, depth=DEPTH).eval()
    assert all(p.is_meta for p in model.parameters())
    cfg = _cfg(path, ram_units=ram_units or 0, prefetch=2)
    if ram_units is None:
        cfg = cfg.replace(ram_budget_bytes=None)
    h = offload(model, cfg)
    assert not any(p.is_meta for p in model.parameters()), "every weight comes from the file"
    tiers = [b.tier for b in h.report().blocks]
    if ram_units == 0:
        assert tiers.count("disk") == DEPTH, tiers
    elif ram_units is not None:
        assert DEPTH - ram_units <= tiers.count("disk") <= DEPTH - ram_units + 1, tiers
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    h.detach()
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(run(model, (x,)), ref)
    for (n, p), (n2, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert n == n2 and torch.equal(p, q), n


# ------------------------------------------------------------------------------------------------------------
# corrupt or mismatched files
# ------------------------------------------------------------------------------------------------------------


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage_header(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"\x00{not json" + b"#" * (n - 10) + data[8 + n:])


def _huge_header(path):
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _random_bytes(path):
    path.write_bytes(os.urandom(64))


def _empty(path):
    path.write_bytes(b"")


def _lying_offsets(path):
    """A well-formed header whose last tensor claims more bytes than its shape needs."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[key]["data_offsets"][1] += 4
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n:] + b"\0" * 4)


CORRUPT = {
    "cut_in_half": (None, _truncate),
    "garbage_header": (None, _garbage_header),
    "huge_header_length": (None, _huge_header),
    "random_bytes": (None, _random_bytes),
    "empty": (None, _empty),
    "lying_offsets": (None, _lying_offsets),
    "wrong_dtype": (dict(dtype=torch.float16), None),
    "wrong_shape": ("shape", None),
    "missing_keys": (dict(drop=(f"layers.{DEPTH - 1}.",)), None),
    "missing_one_tensor": (dict(drop=(f"layers.{DEPTH - 2}.fc2.bias",)), None),
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_corrupt_file_refused_before_anything_is_attached(tmp_path, kind):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    save_kw, damage = CORRUPT[kind]
    path = tmp_path / f"{kind}.safetensors"
    if save_kw == "shape":
        _save(_model(dim=32), path)
    else:
        _save(model, path, **(save_kw or {}))
    if damage is not None:
        damage(path)
    before = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    budget = VramBudget(None)
    with pytest.raises(ValueError) as ei:
        offload_module(model, _cfg(path, ram_units=1), budget=budget)
    assert str(path) in str(ei.value) or path.name in str(ei.value), f"the error must name the file: {ei.value}"
    for name, m in model.named_modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, f"{name or 'model'} keeps a hook"
    assert getattr(model, "_layer_offload_handle", None) is None
    assert budget.members == [] and budget.used_bytes == 0
    for n, p in model.named_parameters():
        p0, ptr, val = before[n]
        assert p is p0 and p.data_ptr() == ptr and torch.equal(p, val), f"{n} touched by a refused offload"
    assert torch.equal(run(model, (x,)), ref)
    # nothing half-attached: a good file works right after
    good = _save(model, tmp_path / "good.safetensors")
    h = offload_module(model, _cfg(good, ram_units=1), budget=budget)
    try:
        assert _disk_indices(h)
        assert torch.equal(run(model, (x,)), ref)
    finally:
        h.detach()


@pytest.mark.parametrize("kind", ["missing_rest", "wrong_dtype_rest"])
def test_meta_model_with_incomplete_file_is_refused(tmp_path, kind):
    """A meta model needs every weight from the file, the non-block ones too."""
    src = _model()
    path = tmp_path / "m.safetensors"
    if kind == "missing_rest":
        _save(src, path, drop=("out.",))
    else:
        sd = {"model." + k: v.contiguous() for k, v in src.state_dict().items()}
        sd["model.inp.weight"] = sd["model.inp.weight"].to(torch.float16)
        save_file(sd, str(path))
    with torch.device("meta"):
        model = LayersModel(dim=64, depth=DEPTH).eval()
    budget = VramBudget(None)
    with pytest.raises(ValueError) as ei:
        offload_module(model, _cfg(path, ram_units=2), budget=budget)
    assert str(path) in str(ei.value) or path.name in str(ei.value), str(ei.value)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert all(p.is_meta for p in model.parameters()), "a refused meta model stays as it was"
    assert budget.members == []


def test_missing_file_is_a_clear_error(tmp_path):
    model = _model()
    path = tmp_path / "nope.safetensors"
    with pytest.raises(ValueError) as ei:
        offload_module(model, _cfg(path), budget=VramBudget(None))
    assert "nope.safetensors" in str(ei.value)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


# ------------------------------------------------------------------------------------------------------------
# read-ahead really ahead
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 2])
def test_read_ahead_completes_before_the_unit_needs_it(tmp_path, offload, monkeypatch, prefetch):
    """Every disk unit is fully read before its forward begins.

    A pre-hook PREPENDED to each unit runs before the engine's own pre-hook, i.e. before the engine could
    read or wait for anything for that unit. At that moment the read-ahead thread must already have finished
    reading that unit's bytes (and every use before it). Each unit's compute (a post-hook) waits until the
    read-ahead thread has done every read handed to it so far, standing in for compute long enough to read
    ahead whatever the host's load: an engine that reads a unit only when the unit is reached fails. File reads
    are also recorded by thread: none may happen on the thread running the forward.
    """
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    cfg = _cfg(path, ram_units=0, prefetch=prefetch, sim_capacity_bytes=_private_capacity(),
               sim_latency_us=500.0, sim_bandwidth_gbps=4.0)
    h = offload(model, cfg)
    disk = _disk_indices(h)
    assert disk == list(range(DEPTH)), "a zero RAM budget puts every block on disk"
    assert resident_modules(h) == []
    # which thread reads the file, and how many unit reads have finished when: wrap the file's reader
    from offload.store.storage import SafetensorsFile

    main = threading.get_ident()
    read_threads = []
    finished = [0] * DEPTH  # unit reads the read-ahead thread has completed, by unit (pieces identify the unit)
    unit_of = {}
    real_read_into = SafetensorsFile.read_into

    def read_into(file, dst, pieces):
        read_threads.append(threading.get_ident())
        n = real_read_into(file, dst, pieces)
        unit = unit_of.setdefault(pieces[0][0], len(unit_of))
        finished[unit] += 1
        return n

    real_read_range = SafetensorsFile.read_range

    def read_range(file, dst, pieces, start, end):  # the least RAM budget reads a unit in ranges
        read_threads.append(threading.get_ident())
        n = real_read_range(file, dst, pieces, start, end)
        unit = unit_of.setdefault(pieces[0][0], len(unit_of))
        if end >= max(off + file.tensors[k].end - file.tensors[k].start for k, off in pieces):
            finished[unit] += 1  # its last range: the unit's read is complete
        return n

    monkeypatch.setattr(SafetensorsFile, "read_into", read_into)
    monkeypatch.setattr(SafetensorsFile, "read_range", read_range)
    assert torch.equal(run(model, (x,)), ref)  # warm-up: the order is learned, the pipeline wraps around
    # the warm-up forward has no slow compute, so let the reads it queued for the next forward finish
    _reads(h)
    names = sorted(unit_of, key=unit_of.get)
    assert [n.split("layers.")[1].split(".")[0] for n in names] == [str(i) for i in range(DEPTH)], names
    base_reads = 0
    base_unit = [0] * DEPTH

    # uses counted from before the warm-up (one use of each unit), so reads it did ahead for the next
    # forward count for the units that will use them
    uses = {"n": DEPTH}
    entered = [0] * DEPTH
    late = []

    def before(i):
        def hook(mod, args):
            entered[i] += 1
            uses["n"] += 1
            done = sum(finished) - base_reads  # reads the read-ahead thread has finished
            if done < uses["n"]:
                late.append(f"unit {i} use {entered[i]}: {done} reads finished, {uses['n']} needed")
            if finished[i] - base_unit[i] < 1 + entered[i]:
                late.append(f"unit {i} use {entered[i]}: its own read had not finished")
        return hook

    reader = h.streamer.staged.reader

    def compute(mod, args, out):
        reader.drain()  # the reads queued so far are done: compute as long as the reads it hides

    hooks = [model.layers[i].register_forward_pre_hook(before(i), prepend=True) for i in range(DEPTH)]
    hooks += [model.layers[i].register_forward_hook(compute) for i in range(DEPTH)]
    try:
        for _ in range(3):
            assert torch.equal(run(model, (x,)), ref)
    finally:
        for hk in hooks:
            hk.remove()
    assert entered == [3] * DEPTH, f"the prepended pre-hooks did not run for every unit: {entered}"
    assert uses["n"] == DEPTH + 3 * DEPTH
    assert not late, "reads were not ahead of the units:\n" + "\n".join(late)
    assert read_threads, "no file read was seen at all"
    assert main not in read_threads, "a file read ran on the forward's own thread"


# ------------------------------------------------------------------------------------------------------------
# disk tier under the budget: resident and streamed disk units, replanning, detach with reads in flight
# ------------------------------------------------------------------------------------------------------------


def test_disk_units_partly_resident(tmp_path, offload):
    """A VRAM budget that holds some blocks: resident disk units are read once, streamed ones once a forward (on a
    clock of the simulated device's own where nothing takes time, so no measured cost moves a block)."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    rest = aligned_bytes(model) - DEPTH * BLK
    path = _save(model, tmp_path / "m.safetensors")
    h = offload(model, _cfg(path, ram_units=0, preset="auto", prefetch=1, vram_budget_bytes=rest + 5 * BLK,
                            sim_clock=SimClock()))
    assert torch.equal(run(model, (x,)), ref)
    resident = {i for i in range(DEPTH) if any(model.layers[i] is m for m in resident_modules(h))}
    streamed = set(range(DEPTH)) - resident
    assert resident and streamed, (resident, streamed)
    tiers = [b.tier for b in h.report().blocks]
    assert all(tiers[i] == "vram" for i in resident) and all(tiers[i] == "disk" for i in streamed), tiers
    reads, _ = _reads(h)
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    now, _ = _reads(h)
    for i in range(DEPTH):
        assert now[i] - reads[i] == (3 if i in streamed else 0), (i, reads, now)
    assert h.device_bytes() <= rest + 5 * BLK


def test_disk_models_share_a_budget_and_swap_priority(tmp_path):
    """Two disk-tier models on one budget; priorities flip, resident units go back to streaming from the file
    and come back: outputs stay bitwise and the budget holds."""
    a, b = _model(seed=0), _model(seed=1)
    x = _x()
    ra, rb = run(a, (x,)), run(b, (x,))
    full = aligned_bytes(a)
    rest = full - DEPTH * BLK
    pa, pb = _save(a, tmp_path / "a.safetensors"), _save(b, tmp_path / "b.safetensors", prefix="")
    budget = VramBudget(full + rest + 2 * BLK)
    cfg = dict(ram_units=1, preset="auto", prefetch=1)
    ha = offload_module(a, _cfg(pa, **cfg), name="a", priority=0, budget=budget)
    hb = offload_module(b, _cfg(pb, **cfg), name="b", priority=1, budget=budget)
    try:
        for step in range(6):
            assert torch.equal(run(a, (x,)), ra), f"step {step}: a"
            assert budget.used_bytes <= budget.total_bytes
            assert torch.equal(run(b, (x,)), rb), f"step {step}: b"
            assert budget.used_bytes <= budget.total_bytes
            if step == 1:
                assert len(resident_modules(hb)) > len(resident_modules(ha))
                ha.prioritize()
            if step == 3:
                assert len(resident_modules(ha)) > len(resident_modules(hb))
                hb.prioritize()
        assert len(resident_modules(hb)) > len(resident_modules(ha))
        assert "disk" in [blk.tier for blk in ha.report().blocks]
    finally:
        ha.detach()
        hb.detach()
    assert torch.equal(run(a, (x,)), ra)
    assert torch.equal(run(b, (x,)), rb)


def test_detach_with_reads_in_flight(tmp_path):
    """Detaching right after a forward, while the read-ahead for the next one is still going, is clean."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")

    def readers():
        return [t for t in threading.enumerate() if "read-ahead" in t.name]

    before = len(readers())
    for k in range(4):
        cfg = _cfg(path, ram_units=0, prefetch=3, sim_capacity_bytes=_private_capacity(), sim_latency_us=300.0)
        h = offload_module(model, cfg, budget=VramBudget(None))
        for _ in range(k % 2 + 1):
            assert torch.equal(run(model, (x,)), ref)
        h.detach()
        assert h.backend.used_bytes == 0
        for n, p in model.named_parameters():
            assert not _param_storage_is_file(p, path), n
        assert torch.equal(run(model, (x,)), ref)
    for t in readers():
        t.join(timeout=120)  # a guard against a hang only
    assert len(readers()) <= before, f"read-ahead threads left running after detach: {readers()}"


# ------------------------------------------------------------------------------------------------------------
# giving host RAM back (ComfyUI's partially_unload_ram), and a disk tier that verifies the file's bytes
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["budget", "auto"])
def test_release_host_memory_moves_blocks_to_disk_exactly(tmp_path, offload, preset):
    """Blocks whose bytes the file holds leave RAM for the disk tier on request; outputs stay bitwise equal, for
    streamed and for resident blocks (these read their file views when they are evicted later)."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    h = offload(model, OffloadConfig.from_preset(preset, device="sim", disk_path=str(path), disk_optional=True,
                                                 sim_capacity_bytes=_private_capacity()))
    assert torch.equal(run(model, (x,)), ref)
    before = h.host_memory()
    assert before["disk"] == 0
    freed = h.release_host_memory(1 << 40)  # everything it can: the disk tier needs bounce buffers, net of them
    after = h.host_memory()
    assert freed > 0 and before["ram"] - after["ram"] == freed, (before, after, freed)
    assert after["disk"] == DEPTH * BLK, "every block the file holds moved to the disk tier"
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    if preset == "auto":
        h.unload()  # resident blocks go back to their (now file-backed) host masters
        assert torch.equal(run(model, (x,)), ref)
    rep = h.report()
    streamed_disk = [b for b in rep.blocks if b.tier == "disk"]
    if preset == "budget":
        assert len(streamed_disk) == DEPTH and all(b.reads >= 3 for b in streamed_disk), rep.blocks
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_ram_given_back_leaves_the_pinned_allocators_cache_too(tmp_path, offload, monkeypatch):
    """Pinned buffers freed on CUDA go to torch's caching host allocator, not to the OS: giving RAM back (and
    detaching) asks the backend to empty that cache once the old masters and bounce buffers are gone, so the RAM
    leaves the process. The CUDA backend finds the call by name (torch.accelerator.empty_host_cache, else
    torch._C._host_emptyCache, else nothing) without a GPU."""
    from offload.backends.cuda import CudaBackend

    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(model, tmp_path / "m.safetensors")
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), disk_optional=True,
                                                 sim_capacity_bytes=_private_capacity()))
    calls = []
    monkeypatch.setattr(h.streamer.backend, "release_host_cache", lambda: calls.append(h.host_memory()["ram"]))
    assert h.release_host_memory(0) == 0 and calls == []  # nothing freed: nothing to ask
    ram = h.host_memory()["ram"]
    assert h.release_host_memory(1 << 40) > 0
    assert len(calls) == 1 and calls[0] < ram  # asked after the masters were replaced
    assert torch.equal(run(model, (x,)), ref)
    h.detach()
    assert len(calls) == 2
    assert torch.equal(run(model, (x,)), ref)
    emptied = []
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        monkeypatch.setattr(accelerator, "empty_host_cache", lambda: emptied.append("accelerator"), raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append("_C"), raising=False)
    CudaBackend.release_host_cache(object.__new__(CudaBackend))
    assert emptied == (["accelerator"] if accelerator is not None else ["_C"])
    if accelerator is not None:
        monkeypatch.delattr(accelerator, "empty_host_cache")
        CudaBackend.release_host_cache(object.__new__(CudaBackend))
        assert emptied[-1] == "_C"


def test_release_host_memory_keeps_blocks_the_file_does_not_hold(tmp_path, offload):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(_model(seed=5), tmp_path / "other.safetensors")  # same names, dtypes and shapes; other values
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), disk_optional=True))
    assert h.release_host_memory(1 << 40) == 0
    assert "disk" not in [b.tier for b in h.report().blocks]
    assert torch.equal(run(model, (x,)), ref)


def test_release_host_memory_without_a_file_frees_nothing(offload):
    model = _model()
    h = offload(model, OffloadConfig.from_preset("budget", device="sim"))
    assert h.release_host_memory(1 << 30) == 0
    with pytest.raises(ValueError):
        h.release_host_memory(-1)


def test_disk_tier_verifies_the_files_values(tmp_path, offload, caplog):
    """A file with the model's names, dtypes and shapes but other values: strict (the default) refuses it naming
    the file; disk_optional keeps those blocks in RAM and says so; outputs never come from the wrong bytes."""
    from offload import CorruptFileError

    model = _model()
    x = _x()
    ref = run(model, (x,))
    path = _save(_model(seed=5), tmp_path / "other.safetensors")
    with pytest.raises(CorruptFileError, match="other values"):
        offload(model, _cfg(path, ram_units=1))
    assert torch.equal(run(model, (x,)), ref)
    with caplog.at_level("WARNING"):
        h = offload(model, _cfg(path, ram_units=1, disk_optional=True))
    assert "disk" not in [b.tier for b in h.report().blocks]
    assert "stays in RAM" in caplog.text
    assert torch.equal(run(model, (x,)), ref)
