"""Blocks held compressed that setup kept raw and encoded after it (issue 44, `HostPlan.encode_later`): a model set up
from its file with host_compression="lossless", RAM to spare and more than ENCODE_LATER_BYTES to encode (lowered
here) loads at the speed of a raw load, its blocks are
encoded on a thread and held compressed from then on, bitwise throughout; a block written meanwhile stays raw (never
its stale encoding); under a RAM ceiling they are encoded at setup as before; detach stops the thread.

The model is the tiny Llama of transformers' own tests (tests/models/llama/test_modeling_llama.py, LlamaModelTester),
widened so its matrices are worth coding, as in tests/test_host_compression.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from offload import OffloadConfig, VramBudget, offload_module
from offload.store import codec
from tests.host_master_guard import host_master_guard

transformers = pytest.importorskip("transformers")
IDS = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 3]])


def _llama(meta=False):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _logits(model):
    with torch.no_grad(), host_master_guard():
        return model(input_ids=IDS).logits


@pytest.fixture()
def model_file(tmp_path, monkeypatch):
    from offload.plan import plan_compress

    monkeypatch.setattr(plan_compress, "ENCODE_LATER_BYTES", 0)  # a tiny model: left to the thread all the same
    model = _llama()
    path = tmp_path / "m.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, _logits(model)


def _offload(path, share="off", **kw):
    empty = _llama(meta=True)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), host_compression="lossless",
                                    share_host=share, **kw)
    return empty, offload_module(empty, cfg, budget=VramBudget(None))


@pytest.mark.parametrize("share", ["off", "auto"])
def test_blocks_read_from_the_file_are_encoded_after_setup_bitwise(model_file, share):
    """With share_host="auto" the blocks are staged raw in the host copy shared between processes and, this process
    alone mapping it, given back from it once held compressed."""
    path, ref = model_file
    model, handle = _offload(path, share)
    setup = handle.report().setup
    assert setup["background_units"] == 4 and setup["encoded_units"] == 0  # none encoded while loading
    assert torch.equal(_logits(model), ref)  # raw or compressed, whichever each block is now
    assert handle.wait_encoded(60)
    report = handle.report()
    assert report.setup["background_done"] == 4 and report.setup["background_pending"] == 0
    assert all(b.compression == codec.CODEC and b.host_bytes < b.raw_bytes for b in report.blocks)
    assert not any(b.shared for b in report.blocks) and handle.host_memory()["ram"] < handle.host_memory()["blocks_raw"]
    for _ in range(2):
        assert torch.equal(_logits(model), ref)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    handle.detach()
    fresh = _llama().state_dict()
    assert all(torch.equal(sd[k], fresh[k]) for k in fresh)


def test_a_block_written_before_it_is_swapped_in_stays_raw_with_its_written_bytes(model_file, monkeypatch):
    from offload.stream import background_encode

    path, ref = model_file
    threading = __import__("threading")
    reached, gate = threading.Event(), threading.Event()
    real = background_encode._locked

    def held(ref_, state):  # the first block is encoded; its swap waits until the test has written a weight
        reached.set()
        gate.wait(30)
        return real(ref_, state)

    monkeypatch.setattr(background_encode, "_locked", held)
    model, handle = _offload(path)
    assert reached.wait(30)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2)  # written after the thread encoded the old bytes
    gate.set()
    assert handle.wait_encoded(60)
    blocks = handle.report().blocks
    assert blocks[0].compression == "none" and all(b.compression == codec.CODEC for b in blocks[1:])
    want = _llama()
    with torch.no_grad():
        want.model.layers[0].mlp.up_proj.weight.mul_(2)
    assert torch.equal(_logits(model), _logits(want))


def test_under_a_ram_ceiling_blocks_are_encoded_at_setup(model_file):
    path, ref = model_file
    model, handle = _offload(path, ram_budget_bytes=1 << 30)
    setup = handle.report().setup
    assert "background_units" not in setup and setup["encoded_units"] == 4
    assert all(b.compression == codec.CODEC for b in handle.report().blocks)
    assert torch.equal(_logits(model), ref)


def test_detach_stops_the_encoder(model_file):
    path, ref = model_file
    model, handle = _offload(path)
    background = handle.streamer.background
    handle.detach()
    assert background.wait(60)
    assert torch.equal(_logits(model), ref)
