"""The packed disk format (offload/store/packed.py, issue 20): units in execution order, each one contiguous range at a
4 KiB-aligned offset of a shard, plus index.json; `disk_path` accepts the folder.

Checked: the index (schema, execution order blocks.2 before blocks.10, aligned offsets, scales of float8 weights),
bytes bitwise those of the source, a model streaming every block from the packed folder bitwise (a meta-device
model too), one positioned read per unit per streamed use, truncated / rewritten shards refused, packing from a
handle in the call order it learned (a model that runs its blocks in reverse), and the command line.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload import OffloadConfig
from offload.store.packed import PackedWeights, open_weights
from offload.store.pack_writer import group_units, pack_file, scale_for
from offload.store.storage import CorruptFileError, SafetensorsFile, SourceChangedError
from tests.models import Fp8Stack, LayersModel, ReorderStack, aligned_bytes, run, seeded

DEPTH = 12  # >= 11: name order would put layers.10 before layers.2


def _x(dim=64, seed=4321):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, dim, generator=g)


def _save(model, path, prefix=""):
    save_file({prefix + k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _least_ram(model, blocks):
    """The least RAM budget: the weights outside the blocks plus one block's worth (every block on disk)."""
    blk = max(aligned_bytes(b) for b in blocks)
    return aligned_bytes(model) - sum(aligned_bytes(b) for b in blocks) + blk


def _cfg(path, ram, **kw):
    kw.setdefault("device", "sim")
    return OffloadConfig.from_preset("budget", disk_path=str(path), ram_budget_bytes=ram, **kw)


def _index(out):
    return json.loads((out / "index.json").read_text())


def _shard_bytes(out, path, offset, nbytes):
    with open(out / path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _tensor_bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class CountPreadv:
    """Wraps os.preadv: (fd, iovec count, bytes, offset) of every positioned read."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = os.preadv

        def preadv(fd, buffers, offset, *a):
            self.calls.append((fd, len(buffers), sum(len(b) for b in buffers), offset))
            return real(fd, buffers, offset, *a)

        monkeypatch.setattr(os, "preadv", preadv)


# ------------------------------------------------------------------------------------------------------------
# the format
# ------------------------------------------------------------------------------------------------------------


def test_index_in_execution_order_aligned_and_bitwise(tmp_path):
    model = seeded(LayersModel, dim=64, depth=DEPTH)
    src = _save(model, tmp_path / "m.safetensors", prefix="model.")
    out = tmp_path / "m.packed"
    pack_file(src, out, shard_bytes=300_000)  # small shards: units spread over several
    index = _index(out)
    names = [u["name"] for u in index["units"]]
    assert names == [f"model.layers.{i}" for i in range(DEPTH)], "numeric (execution) order, not name order"
    assert len({u["path"] for u in index["units"]}) > 1, "several shards"
    source = load_file(str(src))
    seen = set()
    for u in index["units"]:
        assert u["offset"] % 4096 == 0 and u["nbytes"] > 0
        assert {t["name"] for t in u["tensors"]} == {k for k in source if k.startswith(u["name"] + ".")}
        for t in u["tensors"]:
            assert set(t) == {"name", "offset", "nbytes", "dtype", "shape", "scale"}
            assert u["offset"] <= t["offset"] and t["offset"] + t["nbytes"] <= u["offset"] + u["nbytes"]
            assert t["scale"] is None and t["dtype"] == "F32" and t["shape"] == list(source[t["name"]].shape)
            assert _shard_bytes(out, u["path"], t["offset"], t["nbytes"]) == _tensor_bytes(source[t["name"]])
            seen.add(t["name"])
    for t in index["other"]:
        assert _shard_bytes(out, t["path"], t["offset"], t["nbytes"]) == _tensor_bytes(source[t["name"]])
        seen.add(t["name"])
    assert seen == set(source), "every tensor of the source, once"
    for s in index["shards"]:
        assert os.path.getsize(out / s["path"]) == s["nbytes"]
    # units never share a shard range, and within a shard they come in execution order
    by_shard = {}
    for u in index["units"]:
        by_shard.setdefault(u["path"], []).append((u["offset"], u["offset"] + u["nbytes"]))
    for spans in by_shard.values():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    w = PackedWeights(out)
    try:
        for k, v in source.items():
            assert torch.equal(w.read_tensor(k).view(torch.uint8), v.view(torch.uint8))
            assert torch.equal(w.view(k).view(torch.uint8), v.view(torch.uint8))
    finally:
        w.close()


def test_float8_weights_name_their_scale(tmp_path):
    model = seeded(Fp8Stack, dim=64, depth=4)
    src = _save(model, tmp_path / "f8.safetensors")
    out = tmp_path / "f8.packed"
    pack_file(src, out)
    entries = {t["name"]: t for u in _index(out)["units"] for t in u["tensors"]}
    assert entries["blocks.0.up.weight"]["dtype"] == "F8_E4M3"
    assert entries["blocks.0.up.weight"]["scale"] == "blocks.0.up.scale"
    assert entries["blocks.3.down.weight"]["scale"] == "blocks.3.down.scale"
    assert entries["blocks.0.up.bias"]["scale"] is None and entries["blocks.0.up.scale"]["scale"] is None
    assert all(t["scale"] is None for t in _index(out)["other"])  # inp is a float32 Linear
    # the naming conventions the engine's fp8 loader knows, too
    names = {"a.weight", "a.weight_scale", "b.weight", "b.scale_weight", "c.weight", "c.weight.scale"}
    assert scale_for("a.weight", torch.float8_e4m3fn, names) == "a.weight_scale"
    assert scale_for("b.weight", torch.float8_e5m2, names) == "b.scale_weight"
    assert scale_for("c.weight", torch.float8_e4m3fn, names) == "c.weight.scale"
    assert scale_for("a.weight", torch.bfloat16, names) is None


def test_units_grouped_by_block_prefix():
    keys = ["double_blocks.1.x", "double_blocks.0.x", "double_blocks.10.x", "double_blocks.2.x", "img_in.weight",
            "single_blocks.0.a", "single_blocks.1.a", "time_in.0.weight", "time_in.2.weight"]
    units, other = group_units(keys)
    assert [n for n, _ in units] == ["double_blocks.0", "double_blocks.1", "double_blocks.2", "double_blocks.10",
                                     "single_blocks.0", "single_blocks.1"]
    assert other == ["img_in.weight", "time_in.0.weight", "time_in.2.weight"]


# ------------------------------------------------------------------------------------------------------------
# streaming from a packed folder
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["layers", "fp8"])
def test_packed_model_streams_entirely_from_disk_bitwise(tmp_path, offload, kind):
    if kind == "layers":
        model = seeded(LayersModel, dim=64, depth=DEPTH)
        blocks, x = list(model.layers), _x()
    else:
        model = seeded(Fp8Stack, dim=64, depth=4)
        blocks, x = list(model.blocks), _x()
    ref = run(model, (x,))
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    h = offload(model, _cfg(out, _least_ram(model, blocks), host_compression="off"))
    rep = h.report()
    assert [b.tier for b in rep.blocks] == ["disk"] * len(blocks)
    assert rep.to_dict()["blocks"]  # the report still renders
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    assert all(b.reads >= 3 for b in h.report().blocks)
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_meta_model_loads_from_a_packed_folder(tmp_path, offload):
    model = seeded(LayersModel, dim=64, depth=DEPTH)
    x = _x()
    ref = run(model, (x,))
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    with torch.device("meta"):
        empty = LayersModel(dim=64, depth=DEPTH).eval()
    h = offload(empty, _cfg(out, _least_ram(model, list(model.layers)), host_compression="off"))
    assert not any(p.is_meta for p in empty.parameters())
    assert [b.tier for b in h.report().blocks] == ["disk"] * DEPTH
    for _ in range(2):
        assert torch.equal(run(empty, (x,)), ref)


def test_one_positioned_read_per_unit_use(tmp_path, offload, monkeypatch):
    """Each streamed use of a unit is one os.preadv of its shard range (bounce buffers as large as a unit); with
    the least RAM budget (bounce buffers smaller than a unit) one per range, never one per tensor."""
    model = seeded(LayersModel, dim=64, depth=DEPTH)
    x = _x()
    ref = run(model, (x,))
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    tensors_per_unit = len(list(model.layers[0].state_dict()))
    assert tensors_per_unit > 1
    h = offload(model, _cfg(out, _least_ram(model, list(model.layers)), host_compression="off"))
    reader = h.streamer.staged.reader
    unit_bytes = h.streamer.units[0].nbytes
    ranges = -(-unit_bytes // reader.bounce_bytes)
    assert torch.equal(run(model, (x,)), ref)
    h.report()  # waits for queued reads
    count = CountPreadv(monkeypatch)
    reads0 = [b.reads for b in h.report().blocks]
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    uses = sum(a - b for a, b in zip([b.reads for b in h.report().blocks], reads0))
    assert uses >= 3 * DEPTH
    assert len(count.calls) == uses * ranges, (len(count.calls), uses, ranges)
    assert ranges < tensors_per_unit


def test_one_read_per_unit_with_unit_sized_bounce_buffers(tmp_path, offload, monkeypatch):
    """RAM for the weights outside the blocks and eight blocks' worth: whole-block bounce buffers, the blocks that
    do not fit on disk, each streamed use of one of them one positioned read of one shard range."""
    model = seeded(LayersModel, dim=64, depth=DEPTH)
    x = _x()
    ref = run(model, (x,))
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    blk = aligned_bytes(model.layers[0])
    h = offload(model, _cfg(out, _least_ram(model, list(model.layers)) + 7 * blk))
    disk = [i for i, b in enumerate(h.report().blocks) if b.tier == "disk"]
    assert len(disk) >= 4, [b.tier for b in h.report().blocks]
    assert h.streamer.staged.reader.bounce_bytes >= h.streamer.units[0].nbytes
    assert torch.equal(run(model, (x,)), ref)
    h.report()
    count = CountPreadv(monkeypatch)
    reads0 = [b.reads for b in h.report().blocks]
    for _ in range(3):
        assert torch.equal(run(model, (x,)), ref)
    now = [b.reads for b in h.report().blocks]
    uses = sum(now[i] - reads0[i] for i in disk)
    assert uses >= 3 * len(disk)
    assert len(count.calls) == uses, "one positioned read per streamed unit use"
    # each read starts at a unit's first byte: one sequential range of the shard
    starts = {u["offset"] for u in _index(out)["units"]}
    assert all(off in starts for _, _, _, off in count.calls)


# ------------------------------------------------------------------------------------------------------------
# change detection
# ------------------------------------------------------------------------------------------------------------


def test_truncated_shard_refused_at_open(tmp_path):
    model = seeded(LayersModel, dim=64, depth=4)
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    shard = out / _index(out)["shards"][0]["path"]
    os.truncate(shard, os.path.getsize(shard) - 4096)
    with pytest.raises(CorruptFileError, match="truncated"):
        open_weights(out)
    with pytest.raises(CorruptFileError, match="index.json"):
        open_weights(tmp_path)  # a folder that is not a packed model


def test_verify_finds_a_changed_byte(tmp_path):
    model = seeded(LayersModel, dim=64, depth=4)
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    assert all(len(s["sha256"]) == 64 for s in _index(out)["shards"])
    w = PackedWeights(out)
    w.verify()
    w.close()
    unit = _index(out)["units"][1]
    with open(out / unit["path"], "r+b") as f:  # same size, one byte flipped: only the checksum sees it at open
        f.seek(unit["tensors"][0]["offset"])
        b = f.read(1)
        f.seek(unit["tensors"][0]["offset"])
        f.write(bytes([b[0] ^ 1]))
    w = PackedWeights(out)
    try:
        with pytest.raises(CorruptFileError, match="SHA-256"):
            w.verify()
    finally:
        w.close()


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_changed_shard_detected_while_streaming(tmp_path, offload, how):
    model = seeded(LayersModel, dim=64, depth=DEPTH)
    x = _x()
    ref = run(model, (x,))
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out, shard_bytes=300_000)
    h = offload(model, _cfg(out, _least_ram(model, list(model.layers))))
    assert torch.equal(run(model, (x,)), ref)
    h.report()  # no read in flight while the shard changes
    index = _index(out)
    unit = index["units"][-1]
    shard = out / unit["path"]
    if how == "truncate":
        os.truncate(shard, unit["offset"])
    else:
        with open(shard, "r+b") as f:
            f.seek(unit["tensors"][0]["offset"])
            f.write(b"\x01" * 16)
    with pytest.raises(SourceChangedError, match=unit["path"]):
        run(model, (x,))


# ------------------------------------------------------------------------------------------------------------
# packing from a handle: the learned order, the engine's layout
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("masters", ["disk", "ram"])
def test_pack_from_handle_follows_the_learned_order(tmp_path, offload, monkeypatch, masters):
    """A model that runs its blocks in reverse, its blocks on the disk tier or in RAM: the handle's pack lists them
    in that order, laid out as the engine lays them out, bytes bitwise those of the model."""
    depth = 6
    model = seeded(ReorderStack, dim=64, depth=depth)
    model.order = list(reversed(range(depth)))
    x = _x()
    ref = run(model, (x,))
    blocks = list(model.blocks)
    src = _save(model, tmp_path / "m.safetensors")
    # the prefetch worker learns the order of the blocks it streams: stream them all (from RAM, or from disk)
    cfg = (_cfg(src, _least_ram(model, blocks)) if masters == "disk" else
           OffloadConfig(device="sim", vram_fraction=0.0))
    h = offload(model, cfg)
    assert all((b.tier == "disk") == (masters == "disk") for b in h.report().blocks)
    for _ in range(2):  # the order is learned at the start of the second forward
        assert torch.equal(run(model, (x,)), ref)
    out = tmp_path / "from_handle"
    h.pack(str(out))
    index = _index(out)
    assert [u["name"] for u in index["units"]] == [f"blocks.{i}" for i in reversed(range(depth))]
    offsets = [u["offset"] for u in index["units"]]
    assert offsets == sorted(offsets) and all(o % 4096 == 0 for o in offsets)
    # each unit is laid out as the engine's flat buffer: tensor offsets are the layout's leaf offsets
    for u, su in zip(index["units"], [h.streamer.staged.units[i] for i in reversed(range(depth))]):
        assert u["nbytes"] == su.layout.nbytes
        assert sorted(t["offset"] - u["offset"] for t in u["tensors"]) == sorted(l.offset for l in su.layout.leaves)
    source = load_file(str(src))
    for u in index["units"]:
        for t in u["tensors"]:
            assert _shard_bytes(out, u["path"], t["offset"], t["nbytes"]) == _tensor_bytes(source[t["name"]])
    assert {t["name"] for t in index["other"]} == {k for k in source if not k.startswith("blocks.")}
    h.detach()

    # a fresh copy of the model streams from the handle's pack: one read of one range per unit use
    fresh = seeded(ReorderStack, dim=64, depth=depth)
    fresh.order = model.order
    h2 = offload(fresh, _cfg(out, _least_ram(fresh, list(fresh.blocks))))
    assert [b.tier for b in h2.report().blocks] == ["disk"] * depth
    assert torch.equal(run(fresh, (x,)), ref)
    h2.report()
    ranges = -(-h2.streamer.units[0].nbytes // h2.streamer.staged.reader.bounce_bytes)
    reads0 = [b.reads for b in h2.report().blocks]
    count = CountPreadv(monkeypatch)
    for _ in range(2):
        assert torch.equal(run(fresh, (x,)), ref)
    uses = sum(a - b for a, b in zip([b.reads for b in h2.report().blocks], reads0))
    assert uses >= 2 * depth
    assert len(count.calls) == uses * ranges, "one positioned read per bounce-buffer range of a unit"
    assert all(n == 1 for _, n, _, _ in count.calls), "the unit's bytes land in place: one iovec"


def test_pack_refuses_a_non_empty_folder(tmp_path):
    model = seeded(LayersModel, dim=64, depth=4)
    src = _save(model, tmp_path / "m.safetensors")
    out = tmp_path / "p"
    pack_file(src, out)
    with pytest.raises(ValueError, match="not empty"):
        pack_file(src, out)
    pack_file(src, out, overwrite=True)
    assert isinstance(open_weights(out), PackedWeights)
    assert isinstance(open_weights(src), SafetensorsFile)


# ------------------------------------------------------------------------------------------------------------
# the index is untrusted input
# ------------------------------------------------------------------------------------------------------------


class _OpenSpy:
    """Records every path os.open / os.stat / os.lstat is asked about while a packed folder is opened."""

    def __init__(self, monkeypatch):
        self.paths = []
        for name in ("open", "stat", "lstat"):
            real = getattr(os, name)

            def spy(path, *a, _real=real, **k):
                self.paths.append(os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else path)
                return _real(path, *a, **k)

            monkeypatch.setattr(os, name, spy)


def _packed_with(tmp_path, edit):
    model = seeded(LayersModel, dim=64, depth=4)
    out = tmp_path / "m.packed"
    pack_file(_save(model, tmp_path / "m.safetensors"), out)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"s" * 12345)  # a file the index must never reach (its size must not leak either)
    index = _index(out)
    edit(index)
    (out / "index.json").write_text(json.dumps(index))
    return out


_BAD_NAMES = ["../outside.bin", "/etc/shadow", "sub/shard.bin", "..", "", ".hidden", "C:shard.bin",
              "..\\outside.bin"]


@pytest.mark.parametrize("name", _BAD_NAMES)
@pytest.mark.parametrize("where", ["unused shard", "unit", "other"])
def test_index_paths_must_be_plain_names_in_the_folder(tmp_path, monkeypatch, name, where):
    """Every path in index.json is a plain file name inside the folder, checked before any file is opened or
    stat'ed: a shard listed but used by no tensor included (it was opened without the check, and the error told
    the size of the file it named)."""

    def edit(index):
        if where == "unused shard":
            index["shards"].append({"path": name, "nbytes": 4096, "sha256": None})
        elif where == "unit":
            index["shards"].append({"path": name, "nbytes": 1 << 20, "sha256": None})
            index["units"][1]["path"] = name
        else:
            index["other"][0]["path"] = name

    out = _packed_with(tmp_path, edit)
    spy = _OpenSpy(monkeypatch)
    with pytest.raises(CorruptFileError, match="not a plain file name") as exc:
        PackedWeights(out)
    assert "12345" not in str(exc.value)
    touched = [p for p in spy.paths if isinstance(p, str) and not p.endswith("index.json")]
    assert not touched, f"opened or stat'ed {touched} before refusing the index"
    with pytest.raises(CorruptFileError, match="not a plain file name"):
        open_weights(out)


def test_index_shard_linking_outside_the_folder_is_refused(tmp_path, monkeypatch):
    """A shard that is a symbolic link out of the folder is refused before it is opened; a link inside is fine."""
    out = _packed_with(tmp_path, lambda index: index["shards"].append(
        {"path": "shard-00009.bin", "nbytes": 4096, "sha256": None}))
    os.symlink(tmp_path / "outside.bin", out / "shard-00009.bin")
    opened = []
    monkeypatch.setattr("offload.store.packed._Shard.__init__", lambda self, path, *a: opened.append(path))
    with pytest.raises(CorruptFileError, match="links outside the packed folder") as exc:
        PackedWeights(out)
    assert "12345" not in str(exc.value) and not opened
    monkeypatch.undo()
    shard = _index(out)["shards"][0]["path"]
    os.remove(out / "shard-00009.bin")
    os.symlink(shard, out / "shard-00009.bin")  # a link to a shard in the same folder (size is wrong: refused so)
    with pytest.raises(CorruptFileError, match="changed"):
        PackedWeights(out)


def test_bench_disk_runs(tmp_path, capsys):
    """benchmarks/bench_disk.py runs at the tiniest scale and reports its rows (no figure is checked)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_disk.py"
    spec = importlib.util.spec_from_file_location("bench_disk", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--dim", "64", "--blocks", "4", "--repeat", "1", "--cache", "fadvise", "--dir",
                       str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["disk tier: packed"]["reads_per_block"] == 1
    assert rows["disk tier: original .safetensors"]["reads_per_block"] >= 1
    assert result["bitwise"] and result["page_cache"] == "posix_fadvise(DONTNEED)"


def test_command_line(tmp_path, capsys):
    from offload.__main__ import main

    model = seeded(LayersModel, dim=64, depth=4)
    src = _save(model, tmp_path / "m.safetensors")
    assert main(["pack", str(src), str(tmp_path / "p")]) == 0
    assert "packed 4 units" in capsys.readouterr().out
    assert [u["name"] for u in _index(tmp_path / "p")["units"]] == [f"layers.{i}" for i in range(4)]
    assert main(["pack", str(tmp_path / "missing.safetensors"), str(tmp_path / "q")]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
