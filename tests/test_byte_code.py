"""The byte code (issue 42: compression of quantized payloads where it pays, bitwise): runs of 1-byte elements (fp8
e4m3fn / e5m2, int8, packed 4-bit) coded as 4 symbol bits per byte (m to an 8- or 16-bit index) with the other 4 bits
raw and escapes placed by a running count (`offload/store/byte_code.py`, chunks of version 4).

Checked: the ratio on the payloads ComfyUI's quantizers write (comfy_kitchen's per-tensor fp8 as `*_fp8_scaled`
files hold, rowwise int8, NVFP4; normal weights, fixed seeds), next to the entropy bound of their bytes; every code
(codes 2..16, both index widths, at aligned and unaligned places, a run that ends off a piece) decodes every byte back
in place; chunk lists read back; a hostile stream under a valid list decodes inside its unit and the CPU's check
refuses it; crafted lists are refused; the decode of a unit of 1-byte payloads is a constant count of device ops."""
from __future__ import annotations

import pytest
import torch

from offload.model.layout import Leaf, group_by_dtype
from offload.store import byte_code, codec
from offload.store.shared_forms import header_json, parse_header
from tests.test_decode_ops import second_decode_ops

ck = pytest.importorskip("comfy_kitchen")  # a test extra: ComfyUI's own quantizers


def _normal(seed: int, shape=(1024, 1024)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def _fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Per-tensor scaled as ComfyUI's quantizer writes `*_fp8_scaled` weights (absmax to the format's max)."""
    scale = (x.abs().max().float() / torch.finfo(dtype).max).reshape(())
    return ck.quantize_per_tensor_fp8(x, scale, dtype)


def _int8(x: torch.Tensor) -> torch.Tensor:
    return ck.quantize_int8_rowwise(x)[0]


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    return ck.quantize_nvfp4(x.to(torch.bfloat16), (x.abs().max().float() / (448.0 * 6.0)).reshape(()))[0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).contiguous()


def _encode(raw: torch.Tensor, dtype: torch.dtype, offset: int = 0, nbytes: int | None = None) -> codec.Encoded:
    nbytes = raw.numel() - offset if nbytes is None else nbytes
    return codec.encode(raw, [Leaf(offset, nbytes, dtype, (nbytes,), None)])


def entropy_bound(raw: torch.Tensor) -> float:
    """The order-0 entropy of the bytes as a share of raw: what no code of bytes one at a time goes below."""
    p = torch.bincount(raw.long(), minlength=256).double() / raw.numel()
    p = p[p > 0]
    return float(-(p * p.log2()).sum()) / 8


# ratios measured 2026-11-29 on these payloads: e4m3fn 0.871 (bound 0.81), e5m2 0.770 (0.69), int8 0.943 (0.90);
# NVFP4's bytes are near uniform (bound 0.99): nothing pays, they stay raw
@pytest.mark.parametrize("kind,make,dtype,most", [
    ("fp8 e4m3fn per-tensor", _fp8, torch.float8_e4m3fn, 0.88),
    ("fp8 e5m2 per-tensor", lambda x: _fp8(x, torch.float8_e5m2), torch.float8_e5m2, 0.78),
    ("int8 rowwise", _int8, torch.int8, 0.95),
])
def test_quantized_payloads_pay_bitwise(kind, make, dtype, most):
    t = make(_normal(0))
    assert t.dtype == dtype
    raw = _bytes(t)
    enc = _encode(raw, dtype)
    assert {c.version for c in enc.chunks if c.coded} == {4}, kind
    assert entropy_bound(raw) < enc.ratio <= most, (kind, enc.ratio, entropy_bound(raw))
    assert torch.equal(codec.decode(enc), raw)
    codec.check_escapes(enc)
    assert codec.chunks_from_list(codec.chunks_to_list(enc.chunks), enc.nbytes, enc.size) == enc.chunks


def test_nvfp4_payloads_stay_raw():
    raw = _bytes(_nvfp4(_normal(0)))
    assert entropy_bound(raw) > 0.97  # two e2m1 values per byte, block-scaled: near uniform bytes
    enc = _encode(raw, torch.uint8)
    assert enc.size == raw.numel() and not any(c.coded for c in enc.chunks)


def test_the_byte_code_is_chosen_only_where_smaller():
    """e5m2 payloads paid under the unit-wide code (0.87); the byte code takes them where it is smaller, and a run
    the unit-wide code codes smaller keeps that code."""
    raw = _bytes(_fp8(_normal(1), torch.float8_e5m2))
    byte = _encode(raw, torch.float8_e5m2)
    codec.BYTE_CODE = False
    try:
        unit = _encode(raw, torch.float8_e5m2)
    finally:
        codec.BYTE_CODE = True
    assert unit.ratio < 0.9 and byte.ratio < unit.ratio - 0.05


def _skewed(n: int, g: torch.Generator, spread: int) -> torch.Tensor:
    """Bytes whose symbols (any 4 bits) are skewed: a geometric spread of values, some rare ones (escapes)."""
    v = (torch.randn(n, generator=g) * spread).round().to(torch.int64) % 256
    return v.to(torch.uint8)


@pytest.mark.parametrize("bits", byte_code.WIDTHS)
def test_every_byte_code_decodes_every_byte(bits, monkeypatch):
    """Every code count and both index widths, forced: a run from an aligned place, one from an odd place (a raw head
    up to a 4-byte boundary) and one whose length leaves a raw tail; decoded in place, and piece by piece."""
    monkeypatch.setattr(codec, "PAYS", 10.0)  # coded even where a code would not pay
    monkeypatch.setattr(codec, "BYTE_CODE", True)
    g = torch.Generator().manual_seed(bits)
    escaped = 0
    real = byte_code.choose
    for n_codes in range(2, 17):

        def forced(hist, n_codes=n_codes):
            smask, *_ = real(hist) or (0xF0,)
            order = sorted(range(16), key=lambda s: -sum(c for v, c in enumerate(hist)
                                                         if byte_code._SYMBOLS[smask][v] == s))
            base = sum(s << (4 * i) for i, s in enumerate(order[:n_codes - 1]))
            return smask, n_codes, byte_code.per_index(n_codes, bits), bits, base, 0
        monkeypatch.setattr(byte_code, "choose", forced)
        monkeypatch.setattr(codec, "_unit_coded_run", lambda *a, **k: None)
        for count, pad in ((4800, 0), (4803, 3), (5000, 1)):
            body = _skewed(count, g, 9 + n_codes)
            raw = torch.cat([torch.full((pad,), 5, dtype=torch.uint8), body, torch.zeros((-pad - count) % 8,
                                                                                        dtype=torch.uint8)])
            enc = _encode(raw, torch.int8, pad, count)
            coded = [c for c in enc.chunks if c.coded]
            assert coded and all(c.version == 4 and c.n_codes == n_codes and c.bits == bits for c in coded)
            escaped += any(c.n_esc for c in coded)
            out = torch.zeros_like(raw)
            for c in enc.chunks:
                part = enc.blob[c.src:c.src + c.size]
                if c.coded:
                    byte_code.decode_piece(c, part, out[c.dst:c.dst + c.nbytes],
                                           torch.empty(byte_code.scratch_need(c), dtype=torch.uint8))
                else:
                    out[c.dst:c.dst + c.nbytes] = part
            assert torch.equal(out, raw), (n_codes, count, pad)
            codec.check_escapes(enc)
            if all(c.size <= c.nbytes for c in enc.chunks):
                assert torch.equal(codec.decode(enc), raw), (n_codes, count, pad)  # in place
                listed = codec.chunks_from_list(codec.chunks_to_list(enc.chunks), enc.nbytes, enc.size)
                assert listed == enc.chunks
    assert escaped >= 20  # most codes met escapes (every code of fewer than 16 with the widest spreads)


def test_escape_rich_run_across_pieces(monkeypatch):
    """A run longer than a piece (pieces are cut at the scratch's bound): each piece its own escapes, bitwise."""
    monkeypatch.setattr(byte_code, "PIECE_ELEMS", 240 * 40)
    raw = _bytes(_fp8(_normal(2, (96, 1000))))
    enc = _encode(raw, torch.float8_e4m3fn)
    coded = [c for c in enc.chunks if c.coded]
    assert len(coded) >= 10 and all(c.n_esc for c in coded)
    assert torch.equal(codec.decode(enc), raw)


@pytest.mark.parametrize("seed", range(3))
def test_hostile_streams_decode_inside_the_unit(seed):
    """Garbage encoded bytes under a valid chunk list: every index reads inside its table, the running count is
    clamped to the escapes the header counts, so the decode writes only the unit's bytes; the CPU's check (where a
    stored unit is first decoded) refuses indices past the code or another count of escapes."""
    g = torch.Generator().manual_seed(seed)
    for make, dtype in ((_fp8, torch.float8_e4m3fn), (_int8, torch.int8)):
        raw = _bytes(make(_normal(seed, (64, 1024))))
        enc = _encode(raw, dtype)
        assert any(c.version == 4 and c.n_esc for c in enc.chunks)
        for garbage in (torch.randint(0, 256, (enc.size,), dtype=torch.uint8, generator=g),
                        torch.full((enc.size,), 0xFF, dtype=torch.uint8), torch.zeros(enc.size, dtype=torch.uint8)):
            slot = torch.full((raw.numel() + 64,), 7, dtype=torch.uint8)
            slot[raw.numel() - enc.size:raw.numel()] = garbage
            codec.decode_into(slot, enc.chunks, raw.numel(), enc.size, codec.DecodeScratch())
            assert bool((slot[raw.numel():] == 7).all())
            with pytest.raises(ValueError, match="byte-coded"):
                codec.check_escapes(codec.Encoded(garbage, enc.chunks, enc.nbytes))


def _a_coded_list() -> tuple[list[list[int]], int, int]:
    enc = _encode(_bytes(_fp8(_normal(3, (16, 1024)))), torch.float8_e4m3fn)
    return codec.chunks_to_list(enc.chunks), enc.nbytes, enc.size


@pytest.mark.parametrize("field,value", [
    (12, 0x0F | 0x10),  # a mask of five bits
    (12, 0),  # no mask: read as the unit-wide code, which this chunk's fields are not
    (7, 17),  # more codes than four bits hold
    (9, 7),  # elements per index other than the width gives
    (10, 12),  # an index width never written
    (8, 1 << 60),  # coded symbols past the code's count
    (11, 1 << 40),  # escapes past the chunk
])
def test_crafted_byte_code_lists_are_refused(field, value):
    listed, nbytes, size = _a_coded_list()
    coded = next(c for c in listed if c[4])
    coded[field] = value
    with pytest.raises(ValueError, match="not a chunk the codec writes|whole numbers"):
        codec.chunks_from_list(listed, nbytes, size)


def test_repeated_symbols_are_refused():
    listed, nbytes, size = _a_coded_list()
    coded = next(c for c in listed if c[4])
    n_codes = coded[7]
    coded[8] = sum(3 << (4 * i) for i in range(n_codes - 1))  # one symbol listed n_codes - 1 times
    with pytest.raises(ValueError, match="not a chunk the codec writes"):
        codec.chunks_from_list(listed, nbytes, size)


def test_the_shared_copy_header_holds_byte_code_lists():
    """The shared host copy's header keeps a unit's chunks of version 4 (thirteen fields) within its room and reads
    them back checked."""
    raw = _bytes(_fp8(_normal(4, (64, 1024))))
    leaves = [Leaf(0, raw.numel(), torch.float8_e4m3fn, (raw.numel(),), None)]
    enc = codec.encode(raw, leaves)

    class Layout:  # what header_json reads of a layout
        def __init__(self) -> None:
            self.leaves, self.nbytes = leaves, raw.numel()
    body = header_json("k", {0: 4096}, {0: raw.numel()}, [Layout()], {0: [0]}, encoded={0: (enc.size, enc.chunks)})
    full = header_json("k", {0: 4096}, {0: raw.numel()}, [Layout()], full=True)
    from offload.store.shared_forms import chunk_room
    assert len(body) <= len(full) + chunk_room(Layout())
    filled, encoded = parse_header(body, "k", {0: 4096}, {0: raw.numel()})
    assert encoded[0] == (enc.size, enc.chunks)


def _unit_of(count: int, elems: int, scales: bool = False) -> tuple[torch.Tensor, list[Leaf]]:
    """A quantized block as a layout holds it: `count` fp8 payloads (ComfyUI's per-tensor scaled), with a float32
    scale each where `scales`, grouped by dtype as `layout.group_by_dtype` lays a unit out."""
    leaves, tensors = [], []
    for i in range(count):
        w = _fp8(_normal(100 + i, (elems,)))
        for t in (w, torch.tensor([0.01 * (i + 1)], dtype=torch.float32))[:1 + scales]:
            leaves.append(Leaf(0, t.numel() * t.element_size(), t.dtype, tuple(t.shape), None))
            tensors.append(t)
    nbytes = group_by_dtype(leaves)
    raw = torch.zeros(nbytes, dtype=torch.uint8)
    for leaf, t in zip(leaves, tensors):
        raw[leaf.offset:leaf.offset + leaf.nbytes] = _bytes(t)
    return raw, leaves


def _ops(count: int, elems: int, scales: bool = False) -> int:
    raw, leaves = _unit_of(count, elems, scales)
    enc = codec.encode(raw, leaves)
    assert any(c.version == 4 and c.n_esc for c in enc.chunks)
    ops = second_decode_ops(raw, enc)
    assert "aten.empty.memory_format" not in ops
    return len(ops)


BYTE_PIECE_OPS = 11  # the widening, the 16-bit join, the gather, 6 for the escapes, the riders' gather and OR


@pytest.mark.parametrize("count,elems", [(8, 4096), (32, 4096), (128, 2048), (32, 65536)])
def test_a_unit_of_fp8_payloads_decodes_in_a_constant_count(count, elems):
    """One piece for the payloads (up to the scratch's bound), whatever their count: within the 12 ops a unit of 32
    bf16 tensors takes (tests/test_decode_ops.py)."""
    assert count * elems < byte_code.PIECE_ELEMS
    assert _ops(count, elems) <= min(12, BYTE_PIECE_OPS + 1)  # + the raw tail of a run off a 240-element step


def test_a_quantized_block_with_scales_decodes_in_a_count_independent_of_its_tensors():
    """Payloads with their scales: the payloads' piece and the scales' run (coded or raw as the unit-wide code
    decides for float32 with its padding), the same count for 8 tensors as for 128."""
    assert _ops(8, 4096, scales=True) == _ops(32, 4096, scales=True) == _ops(128, 2048, scales=True)


def test_decode_scratch_estimate_bounds_the_byte_code():
    """`codec.scratch_estimate` (what the plan holds on the device before encoding) bounds the scratch of every byte
    code a piece may take (every code count and width, with as many escapes as still pay)."""
    raw, leaves = _unit_of(16, 4096)
    enc = codec.encode(raw, leaves)
    assert codec.decode_scratch_bytes(enc.chunks) <= codec.scratch_estimate(leaves)
    n = byte_code.PIECE_ELEMS
    estimate = codec.scratch_estimate([Leaf(0, 1 << 24, torch.float8_e4m3fn, (1 << 24,), None)])
    for n_codes in range(2, 17):
        for bits in byte_code.WIDTHS:
            m = byte_code.per_index(n_codes, bits)
            if byte_code.piece_size(m, bits, 0, n) >= codec.PAYS * n:
                continue
            n_esc = max(k for k in range(0, n, 997) if byte_code.piece_size(m, bits, k, n) < codec.PAYS * n)
            c = codec.Chunk(0, n, 0, byte_code.piece_size(m, bits, n_esc, n), 1, 1, 3, 0, 0, n_esc, n_codes, m,
                            bits, 0x78)
            assert byte_code.scratch_need(c) <= estimate, (n_codes, bits)


def test_a_packed_folder_with_the_byte_code_is_version_4_and_refused_as_version_3(tmp_path):
    """`pack --compress` of fp8 payloads writes index version 4 (an engine before the byte code refuses it by its
    version); a version-4 chunk list under an index that says 3 is refused naming the file; every tensor reads back
    bit for bit."""
    import json

    from safetensors.torch import save_file

    from offload.store.pack_writer import pack_file
    from offload.store.packed import PackedWeights
    from offload.store.storage import CorruptFileError
    state = {f"blocks.{i}.weight": _fp8(_normal(10 + i, (256, 256))) for i in range(3)}
    state.update({f"blocks.{i}.scale_weight": torch.tensor(0.01 * (i + 1)) for i in range(3)})
    save_file(state, str(tmp_path / "m.safetensors"))
    out = pack_file(tmp_path / "m.safetensors", tmp_path / "m.packed", compress=True)
    out = tmp_path / "m.packed"
    index = json.loads((out / "index.json").read_text())
    assert index["version"] == 4 and all(u.get("compression") for u in index["units"])
    folder = PackedWeights(out)
    try:
        for key, value in state.items():
            assert torch.equal(_bytes(folder.read_tensor(key)), _bytes(value)), key
    finally:
        folder.close()
    index["version"] = 3
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptFileError, match="whole numbers") as info:
        PackedWeights(out)
    assert str(out) in str(info.value)
