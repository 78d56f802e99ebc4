"""Blocks held losslessly compressed in host RAM and decoded on the device (issue 36): the codec round-trips every
byte, an offloaded model with host_compression="lossless" gives the uncompressed outputs bit for bit (bf16, fp16, fp8
with scales, a quantized tensor subclass; streamed, mixed, loaded from its file, written in place, trained with
peft's LoRA), and under a RAM ceiling "auto" keeps in RAM what "off" sends to the disk tier.

The transformers model is the tiny Llama of transformers' own tests (tests/models/llama/test_modeling_llama.py,
LlamaModelTester: a few layers, small widths, weights drawn by `_init_weights` as normal(0, initializer_range=0.02)),
widened so its matrices are worth coding.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from offload import OffloadConfig, VramBudget, offload_module
from offload.model.layout import Leaf
from offload.plan.plan_compress import choose_compressed
from offload.plan.plan_host import HostPlan, RamCeilingError
from offload.store import chunk_decode, codec, codec_v2, unit_code
from tests.host_master_guard import host_master_guard
from tests.models import Fp8Stack, QuantStack, seeded

transformers = pytest.importorskip("transformers")

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]


def _llama(dtype=torch.bfloat16, hidden=128, layers=4, meta=False):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, torch_dtype=dtype)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config).to(dtype)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def _logits(model):
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 40, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _offload(model, **kw):
    kw.setdefault("device", "sim")
    return offload_module(model, OffloadConfig(**kw), budget=VramBudget(None))


def _leaves(module):
    return [Leaf(0, p.numel() * p.element_size(), p.dtype, tuple(p.shape), None) for p in module.parameters()]


def _block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())


# the codec ------------------------------------------------------------------------------------------------------


def _edge_values(dtype):
    """Values that stress the exponent window: zeros of both signs, subnormals, the largest finite, inf/nan where
    the format has them."""
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, info.tiny, -info.tiny, info.max, -info.max, info.tiny / 4, 1.0, -1.0]
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        vals += [float("inf"), float("-inf"), float("nan")]
    return torch.tensor(vals, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8] + FP8)
def test_codec_round_trips_every_byte(dtype):
    g = torch.Generator().manual_seed(3)
    if dtype in (torch.uint8, torch.int8):
        body = (torch.randn(40_003, generator=g) * 6).round().clamp(-128, 127).to(torch.int8).view(dtype)
    else:
        body = (torch.randn(40_003, generator=g) * 0.02).to(dtype)
        edge = _edge_values(dtype)
        body[100:100 + edge.numel()] = edge
    raw = body.view(torch.uint8)
    buf = torch.cat([raw, torch.full((777,), 0xAB, dtype=torch.uint8), raw[:9000]])  # padding, a second tensor
    leaves = [Leaf(0, raw.numel(), dtype, (body.numel(),), None),
              Leaf(raw.numel() + 777, 9000, dtype, (9000 // body.element_size(),), None)]
    enc = codec.encode(buf, leaves)
    assert torch.equal(codec.decode(enc), buf)
    assert all(c.size <= c.nbytes for c in enc.chunks)  # what lets the decode run in place
    assert [c.dst for c in enc.chunks] == sorted(c.dst for c in enc.chunks)
    assert sum(c.nbytes for c in enc.chunks) == buf.numel()
    if dtype in (torch.bfloat16, torch.float32) + tuple(FP8):
        assert enc.ratio < 0.9, enc.ratio
    # decoding in place in a larger slot leaves the bytes past the unit alone
    slot = torch.full((buf.numel() + 100,), 7, dtype=torch.uint8)
    slot[buf.numel() - enc.size:buf.numel()] = enc.blob
    codec.decode_into(slot, enc.chunks, buf.numel(), enc.size)
    assert torch.equal(slot[:buf.numel()], buf) and bool((slot[buf.numel():] == 7).all())


def _window(hist, ebits, n, fixed_bits, k):
    """`codec_v2._best_window` held to one code width k (what the encoder would pick for other weights)."""
    span, width = 1 << ebits, (1 << k) - 1
    doubled = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat([hist, hist]).cumsum(0)])
    covered = doubled[width:width + span] - doubled[:span]
    base = int(torch.argmax(covered))
    esc = n - int(covered[base])
    return k, base, esc, (n + 7) // 8 * (fixed_bits + k) + esc * codec.ESCAPE_BYTES


def _body(dtype, count, g):
    if dtype == torch.uint8:
        return (torch.randn(count, generator=g) * 3).round().clamp(-128, 127).to(torch.int8).view(dtype)
    return (torch.randn(count, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8] + FP8)
def test_every_field_width_decodes_every_byte_v2(dtype, monkeypatch):
    """Version 2 chunks (what packed folders of index version 2 hold; still decoded): every code width k the old
    encoder chose, so every field width (sign + low bits + k: whole fields per byte, or fields straddling bytes), in a
    chunk of whole groups of eight at an aligned offset (the table gather), one that ends mid-group and one at an odd
    offset (field by field): the decode gives every byte back."""
    elem, sbits, rbits = codec._FORMS[dtype]
    ebits = 8 - sbits - rbits
    monkeypatch.setattr(codec_v2, "PAYS", 10.0)  # coded even where a code would not pay
    g = torch.Generator().manual_seed(5)
    for k in range(1, ebits + 1):
        monkeypatch.setattr(codec_v2, "_best_window", lambda h, e, n, fixed, k=k: _window(h, e, n, fixed, k))
        for count, pad in ((4096, 0), (4099, 0), (4096, 3)):
            body = _body(dtype, count, g)
            raw = torch.cat([torch.full((pad,), 5, dtype=torch.uint8), body.view(torch.uint8)])
            enc = codec_v2.encode_v2(raw, [Leaf(pad, count * elem, dtype, (count,), None)])
            assert [c.k for c in enc.chunks if c.coded] == [k] and all(c.version == 2 for c in enc.chunks if c.coded)
            out = torch.zeros_like(raw)  # chunks decoded apart: a wide code may be larger than raw here
            for c in enc.chunks:
                part = enc.blob[c.src:c.src + c.size]
                if c.coded:
                    chunk_decode.decode_chunk(c, part, out[c.dst:c.dst + c.nbytes])
                else:
                    out[c.dst:c.dst + c.nbytes] = part
            assert torch.equal(out, raw), (k, count, pad)
            if enc.size <= raw.numel():
                assert torch.equal(codec.decode(enc), raw), (k, count, pad)  # in place
                listed = codec.chunks_from_list(codec.chunks_to_list(enc.chunks), raw.numel(), enc.size)
                assert listed == enc.chunks  # a version 2 list reads back as it was


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8] + FP8)
def test_every_code_decodes_every_byte(dtype, monkeypatch):
    """Every code the unit-wide encoder may choose for a dtype (elements per index m, index width bits, codes): whole
    words at an aligned offset, a run that ends mid-word (its last elements raw) and one at an odd offset (only
    codes whose words it can view): the decode gives every byte back, in place, and the chunk list reads back."""
    elem, sbits, rbits = codec._FORMS[dtype]
    monkeypatch.setattr(codec, "PAYS", 10.0)  # coded even where a code would not pay
    monkeypatch.setattr(codec, "BYTE_CODE", False)  # the unit-wide code's every code (test_byte_code: the byte code's)
    real_choose = unit_code.choose
    g = torch.Generator().manual_seed(5)
    for m, bits, n_codes in unit_code.options(elem, sbits, rbits):
        def forced(hist, n, elem_, sb, rb, m_ok=None, m=m, bits=bits, n_codes=n_codes):
            if m_ok is not None and not m_ok(m):
                return real_choose(hist, n, elem_, sb, rb, m_ok)
            base = int(torch.argmax(unit_code.window_cover(hist, n_codes)))
            return m, bits, n_codes, base, 0
        monkeypatch.setattr(unit_code, "choose", forced)
        for count, pad in ((4096, 0), (4099, 0), (4096, elem)):
            body = _body(dtype, count, g)
            raw = torch.cat([torch.full((pad,), 5, dtype=torch.uint8), body.view(torch.uint8)])
            enc = codec.encode(raw, [Leaf(pad, count * elem, dtype, (count,), None)])
            coded = [c for c in enc.chunks if c.coded]
            assert coded and all(c.version == 3 for c in coded)
            if pad % (m * elem) == 0:
                assert [(c.m, c.bits, c.n_codes) for c in coded] == [(m, bits, n_codes)], (m, bits, n_codes, pad)
            out = torch.zeros_like(raw)
            for c in enc.chunks:  # pieces decoded apart: a wide code may be larger than raw here
                part = enc.blob[c.src:c.src + c.size]
                if c.coded:
                    scratch = torch.empty(unit_code.scratch_need(c), dtype=torch.uint8)
                    unit_code.decode_piece(c, part, out[c.dst:c.dst + c.nbytes], scratch)
                else:
                    out[c.dst:c.dst + c.nbytes] = part
            assert torch.equal(out, raw), (m, bits, n_codes, count, pad)
            if all(c.size <= c.nbytes for c in enc.chunks):  # what a stored unit holds (a wide code may not pay)
                assert torch.equal(codec.decode(enc), raw), (m, bits, n_codes, count, pad)  # in place
                assert codec.chunks_from_list(codec.chunks_to_list(enc.chunks), raw.numel(), enc.size) == enc.chunks


def test_codec_keeps_incompressible_bytes_raw():
    raw = torch.randint(0, 256, (50_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    enc = codec.encode(raw, [Leaf(0, raw.numel(), torch.uint8, (raw.numel(),), None)])
    assert enc.size == raw.numel() and not any(c.coded for c in enc.chunks)
    assert torch.equal(codec.decode(enc), raw)


def test_auto_compresses_only_what_would_go_to_disk():
    sizes, packed = [100] * 6, [70] * 6

    def plan_for(eff):  # RAM for 500 bytes: blocks past it go to disk
        tiers, used = {}, 0
        for i, s in enumerate(eff):
            tiers[i] = "pageable" if used + s <= 500 else "disk"
            used += s if tiers[i] != "disk" else 0
        return HostPlan(tiers, used, 0)

    fits = lambda p: "disk" not in p.tiers.values()  # noqa: E731
    plan, chosen = choose_compressed("auto", sizes, packed, plan_for, fits)
    assert chosen == {2, 3, 4, 5} and fits(plan)  # the last ones, the fewest that fit: 2 * 100 + 4 * 70 <= 500
    assert choose_compressed("off", sizes, packed, plan_for, fits)[1] == frozenset()
    assert choose_compressed("lossless", sizes, packed, plan_for, fits)[1] == frozenset(range(6))
    assert choose_compressed("auto", [100] * 4, [70] * 4, plan_for, fits)[1] == frozenset()  # fits raw: none
    assert choose_compressed("auto", sizes, [99] * 6, plan_for, fits)[1] == frozenset()  # would not pay

    def refuse(eff):
        if sum(eff) > 450:
            raise RamCeilingError("too much")
        return HostPlan({i: "pageable" for i in range(len(eff))}, sum(eff), 0)

    assert choose_compressed("auto", sizes, packed, refuse, lambda p: True)[1] == frozenset(range(1, 6))
    # a hard RAM ceiling that raw blocks break asks for all the RAM compression gives
    assert choose_compressed("auto", sizes, packed, plan_for, fits, hard=True)[1] == frozenset(range(6))
    assert choose_compressed("auto", [100] * 4, [70] * 4, plan_for, fits, hard=True)[1] == frozenset()
    with pytest.raises(RamCeilingError):
        choose_compressed("auto", sizes, [90] * 6, refuse, lambda p: True)

    def small(eff):  # RAM for 400 bytes
        tiers, used = {}, 0
        for i, s in enumerate(eff):
            tiers[i] = "pageable" if used + s <= 400 else "disk"
            used += s if tiers[i] != "disk" else 0
        return HostPlan(tiers, used, 0)

    # no choice keeps every unit in RAM: compressed, one unit read from disk instead of two (auto never does worse
    # than off); where compression saves no disk read, nothing is compressed
    for hard in (False, True):
        plan, chosen = choose_compressed("auto", sizes, [80] * 6, small, fits, hard=hard)
        assert chosen == frozenset(range(6)) and list(plan.tiers.values()).count("disk") == 1
        assert choose_compressed("auto", sizes, [90] * 6, plan_for, fits, hard=hard)[1] == frozenset()


def test_the_forms_of_a_shared_host_copy_are_facts_for_a_joining_plan():
    """A process joining the host copy another process filled (tests/test_shared_host.py) plans with that copy's
    forms: the units it holds encoded stay compressed and the raw ones raw, whatever the mode; with compression off
    the encoded ones are not mapped (planned as if not there). Under no hard ceiling the units in the copy take
    nothing from the RAM available (their pages are in RAM already), so the rest is planned as if they were not
    there."""
    from offload.plan.planner import HostFacts, PlanFacts, make_plan

    mb = 1 << 20
    host = HostFacts(ram_budget=2 * mb, hard=False, pin_limit=0, pin=False, allow_disk=True, bounces_pageable=False,
                     disk_optional=False, file_path="m.safetensors", share=True,
                     shared_forms=(codec.CODEC, codec.CODEC, "none", "none", "", ""))
    facts = PlanFacts(name="m", sizes=(mb,) * 6, names=tuple(map(str, range(6))), rest_bytes=0, prefetch=1,
                      stream_all=True, device="sim:0", allowance=4 * mb, disk_ok=(True,) * 6, host=host,
                      host_compression="auto", packed_sizes=(700_000,) * 6)
    plan = make_plan(facts)
    assert plan.compressed == {0, 1}  # the copy's; 2 and 3 raw there, 4 and 5 fit the RAM available raw
    assert plan.disk_units == [] and plan.shared_units == set(range(6))
    assert make_plan(dataclasses.replace(facts, host_compression="lossless")).compressed == {0, 1, 4, 5}
    off = make_plan(dataclasses.replace(facts, host_compression="off", packed_sizes=()))
    assert off.compressed == set() and sorted(off.disk_units) == [4, 5]  # 0, 1 raw of its own: 2 MB for 0 to 5
    alone = make_plan(dataclasses.replace(facts, host=dataclasses.replace(host, shared_forms=())))
    assert alone.compressed == set() and sorted(alone.disk_units) == [2, 3, 4, 5]  # without the copy (control)


# bitwise through the engine ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("placement", ["streamed", "mixed"])
def test_lossless_llama_is_bitwise(dtype, placement):
    ref = _logits(_llama(dtype))
    model = _llama(dtype)
    blocks = _block_bytes(model)
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) - blocks
    if placement == "streamed":
        kw = dict(preset="budget", vram_fraction=0.0)
    else:  # half the blocks resident, the rest through the ring
        # the weights outside the blocks and the decode's scratch, a ring of 2 slots and one block resident
        scratch = max(codec.scratch_estimate(_leaves(layer)) for layer in model.model.layers)  # one unit's pieces
        kw = dict(vram_budget_bytes=rest + scratch + 7 * (blocks // 8) + (16 << 10), reserve_bytes=0, prefetch=1)
    handle = _offload(model, host_compression="lossless", **kw)
    with host_master_guard(handle):
        outs = [_logits(model)]
        if placement == "mixed":  # the first pass (by count) keeps some blocks resident, loaded through the decode
            assert 0 < len(handle.streamer.resident_set) < 4
        outs += [_logits(model) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    report = handle.report()
    streamed = [b for b in report.blocks if b.tier != "vram"]
    assert streamed and all(b.compression == codec.CODEC for b in report.blocks)
    assert all(b.host_bytes < b.raw_bytes for b in report.blocks)
    assert report.host_bytes == sum(b.host_bytes for b in report.blocks)
    assert report.host_raw_bytes == sum(b.raw_bytes for b in report.blocks)
    # the copy engine moved the encoded bytes only
    assert handle.host_memory()["ram"] < handle.host_memory()["blocks_raw"] + rest + (1 << 20)
    # between passes the weights read as ever; detach gives ordinary tensors with the same values
    fresh = _llama(dtype).state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())
    handle.detach()
    assert torch.equal(_logits(model), ref)


@pytest.mark.parametrize("build", ["fp8_e4m3", "fp8_e5m2", "quantized_subclass"])
def test_lossless_quantized_payloads_are_bitwise(build):
    if build.startswith("fp8"):
        dtype = getattr(torch, {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[build], None)
        if dtype is None:
            pytest.skip("this torch has no float8")
        make = lambda: seeded(Fp8Stack, dim=128, depth=4, dtype=dtype)  # noqa: E731
    else:
        make = lambda: seeded(QuantStack, dim=128, depth=4)  # noqa: E731
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = make()(x)
        model = make()
        handle = _offload(model, host_compression="lossless", preset="budget", vram_fraction=0.0)
        outs = [model(x) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    report = handle.report()
    assert all(b.tier != "vram" for b in report.blocks)
    # held compressed only where it pays (e4m3 scaled to its full range spreads over its exponents), never larger
    assert all(b.host_bytes < b.raw_bytes if b.compression != "none" else b.host_bytes == b.raw_bytes
               for b in report.blocks)
    if build == "fp8_e5m2":
        assert all(b.compression == codec.CODEC for b in report.blocks)


def test_lossless_from_the_file_of_a_meta_model(tmp_path):
    path = tmp_path / "llama.safetensors"
    src = _llama(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in src.state_dict().items() if k != "lm_head.weight"} |
              {"lm_head.weight": src.lm_head.weight.detach().clone()}, str(path))
    ref = _logits(src)
    model = _llama(torch.bfloat16, meta=True)
    handle = _offload(model, host_compression="lossless", disk_path=str(path), preset="budget", vram_fraction=0.0)
    assert torch.equal(_logits(model.eval()), ref)
    report = handle.report()
    assert all(b.compression == codec.CODEC and b.tier != "disk" for b in report.blocks)
    assert report.disk_bytes_read == 0


def test_weights_written_in_place_are_encoded_again():
    model = _llama(torch.bfloat16)
    handle = _offload(model, host_compression="lossless", preset="budget", vram_fraction=0.0)
    _logits(model)
    other = _llama(torch.bfloat16)
    with torch.no_grad():
        for p in other.model.layers[2].parameters():
            p.mul_(-1.5)
    model.load_state_dict(other.state_dict())
    assert torch.equal(_logits(model), _logits(other))
    assert handle.report().blocks[2].compression == codec.CODEC


def test_lora_training_is_bitwise_with_compressed_blocks(offload):
    from tests.test_training_inside import run

    def cfg(**kw):
        if "vram_budget_bytes" in kw:  # a budget for streaming raw blocks, plus the decode's scratch on the device
            kw["vram_budget_bytes"] += 1 << 20
        return OffloadConfig.from_preset("budget", device="sim", prefetch=1, host_compression="lossless", **kw)

    _, _, ref_params, _, ref_losses = run("peft_lora", "none")
    _, _, params, handle, losses = run("peft_lora", "none", offload, cfg)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, ref_params))
    report = handle.report()
    assert all(b.compression == codec.CODEC and b.backward_calls > 0 for b in report.blocks)


# memory: what compression keeps out of the disk tier -----------------------------------------------------------------


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 0.78), (torch.float16, 0.95)])
def test_ram_ceiling_keeps_every_block_in_ram_compressed(tmp_path, dtype, bound):
    path = tmp_path / "model.safetensors"
    src = _llama(dtype, hidden=192)
    save_file({k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}, str(path))
    ref = _logits(src)
    total = sum(p.numel() * p.element_size() for p in src.parameters())
    ceiling = int(0.8 * total) if dtype == torch.bfloat16 else int(0.95 * total)
    mode = "auto" if dtype == torch.bfloat16 else "lossless"
    reports = {}
    for how in (mode, "off"):
        model = _llama(dtype, hidden=192)
        handle = _offload(model, host_compression=how, disk_path=str(path), ram_budget_bytes=ceiling,
                          preset="budget", vram_fraction=0.0)
        assert torch.equal(_logits(model), ref)
        reports[how] = handle.report()
        handle.detach()
    on = reports[mode]
    assert on.tiers["disk"] == 0 and on.disk_bytes_read == 0
    assert on.host_bytes <= bound * on.host_raw_bytes, on.host_bytes / on.host_raw_bytes
    off = reports["off"]
    assert off.tiers["disk"] > 0 and off.disk_bytes_read > 0  # the control: without compression blocks go to disk
    assert all(b.compression == "none" for b in off.blocks)


def test_auto_holds_nothing_compressed_when_ram_suffices():
    model = _llama(torch.bfloat16)
    handle = _offload(model, preset="budget", vram_fraction=0.0)
    report = handle.report()
    assert all(b.compression == "none" for b in report.blocks)
    assert report.host_bytes == report.host_raw_bytes


def test_host_compression_is_checked():
    with pytest.raises(ValueError, match="host_compression"):
        OffloadConfig(host_compression="zstd")


def test_blocks_that_encode_larger_than_estimated_keep_the_ceiling(tmp_path, monkeypatch):
    """The plan places compressed blocks at their estimated encoded size; blocks that come out larger must not
    carry the host RAM past ram_budget_bytes: the last ones go to the disk tier, or (no file) the offload is refused
    by name and the model is left as it was."""
    import offload.setup

    monkeypatch.setattr(offload.setup, "estimate_layout_size", lambda layout: layout.nbytes // 2)  # bf16 takes ~0.7
    path = tmp_path / "model.safetensors"
    src = _llama(torch.bfloat16, hidden=192)
    save_file({k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}, str(path))
    ref = _logits(src)
    total = sum(p.numel() * p.element_size() for p in src.parameters())
    ceiling = int(0.6 * total)
    model = _llama(torch.bfloat16, hidden=192)
    handle = _offload(model, host_compression="auto", disk_path=str(path), ram_budget_bytes=ceiling,
                      preset="budget", vram_fraction=0.0)
    with host_master_guard(handle):
        assert torch.equal(_logits(model), ref)
    report = handle.report()
    assert handle.host_memory()["ram"] <= ceiling
    assert report.tiers["disk"] > 0 and any(b.compression == codec.CODEC for b in report.blocks)
    handle.detach()
    model = _llama(torch.bfloat16, hidden=192)
    with pytest.raises(RamCeilingError, match="ram_budget_bytes.*disk_path"):  # planned again: no plan keeps it
        _offload(model, host_compression="auto", ram_budget_bytes=ceiling, preset="budget", vram_fraction=0.0)
    assert torch.equal(_logits(model), ref)  # left as it was
    assert not any(t.device.type != "cpu" for t in model.parameters())


def test_the_estimate_samples_runs_not_a_stride():
    """The plan decides with an estimate of each block's encoded size from a sample: a weight whose every other
    element is alike (a stride of two would read only those) is estimated at what it encodes to."""
    from offload.store.compressed import _sample, codec_leaf

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16)[1::2] = torch.randint(0, 1 << 14, (1 << 17,), dtype=torch.int16, generator=g)
    sample = _sample(w, 1 << 16).view(torch.uint8)
    estimate = codec.estimate_size(sample, [codec_leaf(sample.numel(), torch.bfloat16)]) / sample.numel()
    actual = codec.encode(w.view(torch.uint8), [codec_leaf(w.numel() * 2, torch.bfloat16)]).ratio
    assert abs(estimate - actual) < 0.02, (estimate, actual)


def test_a_ceiling_off_cannot_keep_names_compression_when_it_would():
    """host_compression='off' under a RAM ceiling the raw blocks break (no disk file): the refusal says that holding
    blocks compressed keeps it, and 'auto' then does (every block compressed, outputs bitwise)."""
    model = _llama()
    ref = _logits(model)
    ceiling = int(0.85 * sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    with pytest.raises(RamCeilingError, match="host_compression='auto'"):
        _offload(model, ram_budget_bytes=ceiling, host_compression="off")
    assert not any(p.is_meta for p in model.parameters())  # refused before anything moved
    h = _offload(model, ram_budget_bytes=ceiling)
    assert all(b.compression == codec.CODEC for b in h.report().blocks)
    assert h.host_memory()["ram"] <= ceiling
    assert torch.equal(_logits(model), ref)
    h.detach()
