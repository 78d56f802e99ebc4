"""Packed folders with units stored losslessly compressed (issue 36 part 3: `python -m offload pack --compress`,
`pack_file(..., compress=True)`, `OffloadHandle.pack(..., compress=True)`): fewer bytes on disk and read per streamed
use, decoded on the device as a unit held compressed in RAM is.

Checked: the index (version 3, encoded sizes, chunks; a plain pack stays version 1), every tensor read back bit for
bit; a folder written in version 2 (by earlier engines) still reads and streams, bitwise; models loaded on the meta device from the folder give the outputs of the plain model bit for bit (bf16, fp16,
float8 with scales), streamed from disk with the device decoding the stored bytes (the bytes read per use are the
encoded ones), mixed with units in RAM (raw, or compressed reusing the stored encoding), with peft's LoRA, in
training (backward), packed from a handle; a folder laid out unlike the model falls back to decoding on the CPU (said
once); crafted chunk lists and escape positions are refused naming the file (more cases in tests/crafted_files.py).

The model is the tiny Llama of transformers' own tests (tests/models/llama/test_modeling_llama.py, LlamaModelTester:
few layers, small widths, weights drawn by `_init_weights` as normal(0, initializer_range=0.02)), widened so its
matrices are worth coding, as in tests/test_host_compression.py.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from offload import OffloadConfig
from offload.store import codec
from offload.store.compressed import StoredDiskSource
from offload.store.pack_writer import pack_file
from offload.store.packed import PackedWeights
from offload.store.sources import DiskSource
from offload.store.storage import CorruptFileError
from tests.host_master_guard import host_master_guard
from tests.models import Fp8Stack, seeded

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 3]])


def _llama(dtype=torch.bfloat16, meta=False, layers=4):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).to(dtype).eval()
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _logits(model):
    with torch.no_grad(), host_master_guard():
        return model(input_ids=IDS).logits


def _save(model, path):
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def _block_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())


def _all_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def _cfg(folder, ram, **kw):
    kw.setdefault("device", "sim")
    return OffloadConfig.from_preset("budget", disk_path=str(folder), ram_budget_bytes=ram, **kw)


def _packed(tmp_path, model, name="m.packed"):
    out = tmp_path / name
    pack_file(_save(model, tmp_path / (name + ".safetensors")), out, compress=True)
    return out


def _index(out):
    return json.loads((out / "index.json").read_text())


# the format ------------------------------------------------------------------------------------------------------


def test_compressed_pack_index_and_bytes_read_back(tmp_path):
    model = _llama()
    src = _save(model, tmp_path / "m.safetensors")
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    pack_file(src, plain)
    pack_file(src, packed, compress=True)
    assert _index(plain)["version"] == 1 and not any("compression" in u for u in _index(plain)["units"])
    index = _index(packed)
    assert index["version"] == 3
    units = index["units"]
    assert len(units) == 4 and all(u["compression"] == codec.CODEC for u in units)
    assert all(u["stored"] < 0.8 * u["nbytes"] for u in units), [(u["stored"], u["nbytes"]) for u in units]
    disk = sum(s["nbytes"] for s in index["shards"])
    assert disk < 0.9 * sum(s["nbytes"] for s in _index(plain)["shards"])
    state = model.state_dict()
    folder = PackedWeights(packed)
    try:
        folder.verify()
        assert set(folder.tensors) == set(state)
        for key, value in state.items():
            want = value.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(folder.read_tensor(key).reshape(-1).view(torch.uint8), want), key
            assert torch.equal(folder.view(key).reshape(-1).view(torch.uint8), want), key
    finally:
        folder.close()


# streaming from a compressed pack ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_model_streams_compressed_units_from_disk_bitwise(tmp_path, offload, dtype):
    """Every block on the disk tier: the device decodes the stored bytes (StoredDiskSource), the bytes read per use
    are the encoded ones, the outputs are the plain model's bit for bit."""
    model = _llama(dtype)
    ref = _logits(model)
    out = _packed(tmp_path, model)
    stored = sum(u["stored"] for u in _index(out)["units"])
    empty = _llama(dtype, meta=True)
    h = offload(empty, _cfg(out, _all_bytes(model) - _block_bytes(model) + _block_bytes(model) // 4,
                            host_compression="off"))
    report = h.report()
    assert [(b.tier, b.compression) for b in report.blocks] == [("disk", codec.CODEC)] * 4
    assert all(isinstance(u.source, StoredDiskSource) for u in h.streamer.staged.units)
    reader = h.streamer.staged.reader
    for _ in range(3):
        assert torch.equal(_logits(empty), ref)
    h.report()  # waits for queued reads
    before = reader.counters.bytes_read
    assert torch.equal(_logits(empty), ref)
    h.report()
    assert reader.counters.bytes_read - before == stored  # one pass reads every block's encoded bytes once
    assert stored < (0.8 if dtype == torch.bfloat16 else 0.95) * _block_bytes(model)  # fp16: a 5-bit exponent
    h.detach()
    assert torch.equal(_logits(empty), ref)


def _fp8_stack():
    """tests/models.Fp8Stack with weights as a float8 checkpoint stores them (cast from normal(0, 0.05), a scale per
    row near 1), not scaled to the format's range."""
    model = seeded(Fp8Stack, dim=256, depth=4)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.blocks:
            for lin in (block.up, block.down):
                lin.weight.data = (torch.randn(lin.weight.shape, generator=g) * 0.05).to(lin.weight.dtype)
                lin.scale.uniform_(0.9, 1.1, generator=g)
    return model


def test_float8_with_scales_streams_compressed_bitwise(tmp_path, offload):
    model = _fp8_stack()
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
    out = tmp_path / "f.packed"
    pack_file(_save(model, tmp_path / "f.safetensors"), out, compress=True)
    index = _index(out)
    coded = [u for u in index["units"] if "compression" in u]
    assert coded, "float8 blocks of normal weights pay"
    assert all(t["scale"] for u in index["units"] for t in u["tensors"] if t["dtype"] == "F8_E4M3")
    with torch.device("meta"):
        empty = Fp8Stack(dim=256, depth=4).eval()
    blocks = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    h = offload(empty, _cfg(out, _all_bytes(model) - blocks + blocks // 4, host_compression="off"))
    assert [b.tier for b in h.report().blocks] == ["disk"] * 4
    assert {b.compression for b in h.report().blocks} == {codec.CODEC}
    for _ in range(2):
        with torch.no_grad(), host_master_guard():
            assert torch.equal(empty(x), ref)


@pytest.mark.parametrize("compression", ["off", "lossless"])
def test_mixed_ram_and_compressed_disk_units_bitwise(tmp_path, offload, monkeypatch, compression):
    """Half the blocks in RAM (raw, or held compressed reusing the encoding the folder stores: nothing encoded
    again), the rest streamed encoded from disk."""
    model = _llama()
    ref = _logits(model)
    out = _packed(tmp_path, model)
    encodes, reads = [], []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda *a, **k: encodes.append(1) or real(*a, **k))
    real_read = PackedWeights.read_stored
    monkeypatch.setattr(PackedWeights, "read_stored",
                        lambda self, unit, *a: reads.append(unit.name) or real_read(self, unit, *a))
    empty = _llama(meta=True)
    blk = _block_bytes(model) // 4
    ram = _all_bytes(model) - 4 * blk + 2 * blk
    h = offload(empty, _cfg(out, ram, host_compression=compression))
    assert sorted(reads) == sorted(u["name"] for u in _index(out)["units"]), reads  # staging reads each unit once
    assert h.streamer.staged.file._last is None  # no decoded unit held past staging
    blocks = h.report().blocks
    tiers = [b.tier for b in blocks]
    assert "disk" in tiers and any(t != "disk" for t in tiers), tiers
    assert all(b.compression == codec.CODEC for b in blocks if b.tier == "disk")
    if compression == "lossless":
        assert all(b.compression == codec.CODEC and b.host_bytes < b.raw_bytes for b in blocks if b.tier != "disk")
        assert not encodes, "units stored compressed are held in the stored encoding"
    for _ in range(2):
        assert torch.equal(_logits(empty), ref)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft asks transformers the old name
def test_lora_and_training_on_compressed_disk_units(tmp_path, offload):
    """peft's LoRA on a model whose blocks stream encoded from disk: outputs and gradients those of the same LoRA
    on the plain model."""
    peft = pytest.importorskip("peft")
    model = _llama()
    out = _packed(tmp_path, model)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(7)
    plain = peft.get_peft_model(model, lora)
    empty = _llama(meta=True)
    blocks = _block_bytes(model)
    h = offload(empty, _cfg(out, _all_bytes(model) - blocks + blocks // 4, host_compression="off"))
    assert {b.tier for b in h.report().blocks} == {"disk"}
    torch.manual_seed(7)
    wrapped = peft.get_peft_model(empty, lora)
    wrapped.load_state_dict({k: v for k, v in plain.state_dict().items() if "lora_" in k}, strict=False)
    labels = IDS.clone()
    losses, grads = [], []
    for m in (plain, wrapped):
        m.zero_grad()
        loss = m(input_ids=IDS, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert {b.compression for b in h.report().blocks if b.tier == "disk"} == {codec.CODEC}


def test_pack_from_a_handle_with_compression(tmp_path, offload):
    """OffloadHandle.pack(compress=True): units laid out as the engine's flat buffers, stored encoded; the model
    loaded from it decodes them on the device."""
    model = _llama()
    ref = _logits(model)
    h = offload(model, OffloadConfig.from_preset("budget", device="sim"))
    assert torch.equal(_logits(model), ref)
    out = tmp_path / "h.packed"
    h.pack(str(out), compress=True)
    h.detach()
    assert all(u.get("compression") == codec.CODEC for u in _index(out)["units"])
    empty = _llama(meta=True)
    blocks = _block_bytes(model)
    h2 = offload(empty, _cfg(out, _all_bytes(model) - blocks + blocks // 4, host_compression="off"))
    assert all(isinstance(u.source, StoredDiskSource) for u in h2.streamer.staged.units)
    assert torch.equal(_logits(empty), ref)


def test_units_laid_out_otherwise_decode_on_the_cpu(tmp_path, offload, caplog):
    """A folder whose units are laid out unlike the model's (here: a page of padding before every tensor) still
    streams bit for bit, decoded on the CPU by the read-ahead thread, and says so once."""
    model = _llama()
    ref = _logits(model)
    src = _save(model, tmp_path / "m.safetensors")
    state = model.state_dict()
    units = []
    for i in range(4):
        pos, laid = 0, []
        for k in (k for k in state if k.startswith(f"model.layers.{i}.")):
            pos += 4096  # a page of padding before every tensor: a layout no model's flat buffer has
            laid.append((k, pos))
            pos += -(-state[k].numel() * state[k].element_size() // 512) * 512
        units.append((f"model.layers.{i}", laid))
    out = tmp_path / "odd.packed"
    pack_file(src, out, units=units, compress=True)
    empty = _llama(meta=True)
    blocks = _block_bytes(model)
    with caplog.at_level(logging.WARNING, logger="offload"):
        h = offload(empty, _cfg(out, _all_bytes(model) - blocks + blocks // 4, host_compression="off"))
    assert {b.tier for b in h.report().blocks} == {"disk"}
    assert all(type(u.source) is DiskSource for u in h.streamer.staged.units)
    assert sum("decoded on the CPU" in r.getMessage() for r in caplog.records) == 1
    for _ in range(2):
        assert torch.equal(_logits(empty), ref)


# untrusted folders ----------------------------------------------------------------------------------------------


def _edit_index(out, fn):
    index = _index(out)
    fn(index)
    (out / "index.json").write_text(json.dumps(index))


def _coded(ix):
    return next(c for c in ix["units"][0]["chunks"] if c[4])


@pytest.mark.parametrize("edit,words", [
    (lambda ix: _coded(ix).__setitem__(0, 7), "does not follow"),
    (lambda ix: _coded(ix).__setitem__(7, 200), "not a chunk the codec writes"),  # more codes than the index holds
    (lambda ix: _coded(ix).__setitem__(10, 9), "not a chunk the codec writes"),  # an index width it never writes
    (lambda ix: _coded(ix).__setitem__(9, 3), "not a chunk the codec writes"),  # elements per index
    (lambda ix: _coded(ix).__setitem__(11, 1 << 40), "not a chunk the codec writes"),  # escapes past the chunk
    (lambda ix: ix["units"][0]["chunks"].append([ix["units"][0]["nbytes"], 512, ix["units"][0]["stored"], 512,
                                                 0, 0, 0, 3, 0, 0, 0, 0]), "raw chunk with coding parameters"),
    (lambda ix: ix["units"][0]["chunks"][0].append(0), "whole numbers"),  # neither version's length
    (lambda ix: ix["units"][0].__setitem__("stored", ix["units"][0]["stored"] - 1), "cover"),
    (lambda ix: ix["units"][0].__setitem__("stored", 1 << 40), "past its shard"),
    (lambda ix: ix["units"][0].__setitem__("compression", "zstd"), "stored as"),
    (lambda ix: ix.__setitem__("version", 1), "version 1"),
    (lambda ix: ix.__setitem__("version", 5), "version <= 4"),
    (lambda ix: ix["units"][0].__setitem__("chunks", "all"), "not a list of chunks"),
    (lambda ix: ix["units"][0]["tensors"][0].__setitem__("offset", ix["units"][0]["nbytes"]), "past the end"),
])
def test_crafted_chunk_lists_are_refused_at_open(tmp_path, edit, words):
    out = _packed(tmp_path, _llama(layers=2))
    _edit_index(out, edit)
    with pytest.raises(CorruptFileError, match=words) as info:
        PackedWeights(out)
    assert str(out) in str(info.value)


def test_an_escape_pointing_past_its_chunk_is_refused_before_streaming(tmp_path, offload):
    """The escape list lives in the shard (not the index): a position past its chunk is refused when the unit is
    first decoded on the CPU (staging), naming the folder; the device decode never indexes past the chunk."""
    model = _llama(layers=2)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, :64] = 1e30  # values far outside the window: escapes
    out = _packed(tmp_path, model)
    unit = _index(out)["units"][0]
    chunk = next(c for c in codec.chunks_from_list(unit["chunks"], unit["nbytes"], unit["stored"]) if c.n_esc)
    where = unit["offset"] + codec.escape_span(chunk)[0]
    shard = out / unit["path"]
    data = bytearray(shard.read_bytes())
    data[where:where + 4] = (0xFFFFFFF0).to_bytes(4, "little")
    shard.write_bytes(bytes(data))
    empty = _llama(meta=True, layers=2)
    with pytest.raises(CorruptFileError, match="escape") as info:
        offload(empty, _cfg(out, 1 << 40, host_compression="off"))
    assert str(out) in str(info.value)


def test_command_line_pack_compress(tmp_path):
    src = _save(_llama(layers=2), tmp_path / "m.safetensors")
    out = tmp_path / "cli.packed"
    proc = subprocess.run([sys.executable, "-m", "offload", "pack", str(src), str(out), "--compress"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "2 unit(s) compressed" in proc.stdout
    assert _index(out)["version"] == 3


# folders of index version 2 (earlier engines) --------------------------------------------------------------------


def _as_version_2(out):
    """Rewrite a packed folder as an earlier engine wrote it: every compressed unit re-encoded in version 2's chunks
    (a k-bit window per tensor chunk, `codec_v2`), index version 2, shards and hashes rewritten."""
    import hashlib

    from offload.model.layout import Leaf
    from offload.store import codec_v2
    from offload.store.header_check import check_dtype

    index = _index(out)
    folder = PackedWeights(out)
    blobs = {}
    for u in index["units"]:
        if "compression" in u:
            raw = codec.decode(folder.encoded(folder.stored[u["name"]]))
            leaves = [Leaf(t["offset"], t["nbytes"], check_dtype(t["dtype"], out, "test"), tuple(t["shape"]), None)
                      for t in u["tensors"]]
            enc = codec_v2.encode_v2(raw, leaves)
            assert all(c.version == 2 for c in enc.chunks if c.coded) and any(c.coded for c in enc.chunks)
            blobs[u["name"]] = enc
    folder.close()
    for shard in index["shards"]:
        data = bytearray((out / shard["path"]).read_bytes())
        for u in index["units"]:
            if u["path"] == shard["path"] and u["name"] in blobs:
                enc = blobs[u["name"]]
                assert enc.size <= u["stored"] or u["offset"] + enc.size <= len(data)
                data[u["offset"]:u["offset"] + enc.size] = bytes(enc.blob.numpy())
                u.update(stored=enc.size, chunks=codec.chunks_to_list(enc.chunks))
        (out / shard["path"]).write_bytes(bytes(data))
        shard["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    index["version"] = 2
    (out / "index.json").write_text(json.dumps(index))
    assert all(len(c) == 10 for u in index["units"] if "chunks" in u for c in u["chunks"])


def test_a_version_2_folder_still_reads_and_streams(tmp_path, offload):
    """A folder of index version 2 (chunks of the old k-bit window code, written by earlier engines) still opens,
    verifies, reads back every tensor and streams from disk with the device decoding its stored bytes, bitwise; its
    crafted chunk lists are refused as before."""
    model = _llama(layers=2)
    ref = _logits(model)
    out = _packed(tmp_path, model)
    _as_version_2(out)
    folder = PackedWeights(out)
    folder.verify()
    for name, t in model.state_dict().items():
        assert torch.equal(folder.read_tensor(name), t), name
    folder.close()
    empty = _llama(meta=True, layers=2)
    h = offload(empty, _cfg(out, _all_bytes(model) // 2, host_compression="off"))
    assert {b.tier for b in h.report().blocks} == {"disk"}
    assert all(type(u.source) is StoredDiskSource for u in h.streamer.staged.units)
    assert all(c.version == 2 for u in h.streamer.staged.units for c in u.source.unit.chunks if c.coded)
    for _ in range(2):
        assert torch.equal(_logits(empty), ref)
    _edit_index(out, lambda ix: _coded(ix).__setitem__(7, 9))  # k past the exponent bits
    with pytest.raises(CorruptFileError, match="not a chunk the codec writes"):
        PackedWeights(out)
