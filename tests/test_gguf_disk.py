"""The disk tier from a GGUF file (issue 42): a model loaded from a .gguf file as city96's ComfyUI-GGUF loads one
(gguf_sd_loader in its loader.py: quantized tensors kept as their bytes in a `GGMLTensor` with `tensor_type` /
`tensor_shape`, F32 / F16 ones viewed in torch order, BF16 vectors dequantized to float32) streams its blocks from
that file under a RAM ceiling: quantized bytes and F16 weights as stored, the float32 vectors with the cast applied on
read. The GGUF file is written here per the GGUF spec (v3: header, metadata, tensor infos, data at the alignment)."""
from __future__ import annotations

import struct

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from offload import OffloadConfig
from offload.store.gguf_file import GgufFile
from offload.store.header_check import CorruptFileError
from tests.host_master_guard import host_master_guard

DIM, DEPTH = 64, 6
Q8_0, F32, F16, BF16 = 8, 0, 1, 30


class GGMLTensor(torch.Tensor):
    """As ComfyUI-GGUF's ops.py defines it: a plain tensor subclass carrying the ggml type and the logical shape."""

    def __init__(self, *args, tensor_type, tensor_shape, patches=(), **kwargs):
        super().__init__()
        self.tensor_type = tensor_type
        self.tensor_shape = tensor_shape
        self.patches = list(patches)

    def __new__(cls, *args, tensor_type, tensor_shape, patches=(), **kwargs):
        return super().__new__(cls, *args, **kwargs)

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        new.tensor_type = getattr(self, "tensor_type", None)
        new.tensor_shape = getattr(self, "tensor_shape", new.data.shape)
        new.patches = getattr(self, "patches", []).copy()
        return new

    def clone(self, *args, **kwargs):
        return self

    def detach(self, *args, **kwargs):
        return self


def _q8_0(w: torch.Tensor) -> bytes:
    """ggml's Q8_0: per 32 weights an fp16 scale and 32 int8s."""
    blocks = w.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(blocks / d.clamp(min=1e-12)).to(torch.int8)
    return b"".join(d[i].half().numpy().tobytes() + q[i].numpy().tobytes() for i in range(blocks.shape[0]))


def _dequant_q8_0(raw: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(shape)


def _string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path, tensors: dict[str, tuple[int, tuple[int, ...], bytes]], alignment: int = 32) -> None:
    """A GGUF v3 file: `general.alignment` (uint32) and the tensors (name -> ggml type, torch-order shape, bytes)."""
    kv = _string("general.alignment") + struct.pack("<I", 4) + struct.pack("<I", alignment)
    infos, data = b"", b""
    for name, (gtype, shape, raw) in tensors.items():
        data += b"\0" * (-len(data) % alignment)
        dims = tuple(reversed(shape))
        infos += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", gtype, len(data))
        data += raw
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + kv + infos
    path.write_bytes(head + b"\0" * (-len(head) % alignment) + data)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # Q8_0 bytes (a GGMLTensor)
        self.norm = nn.Parameter(torch.empty(0), requires_grad=False)  # F16, viewed in torch order
        self.gain = nn.Parameter(torch.empty(0), requires_grad=False)  # BF16 vector dequantized to float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _dequant_q8_0(self.weight, tuple(self.weight.tensor_shape))
        return x + F.linear(F.layer_norm(x, (DIM,), self.norm.float()), w) * self.gain


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(DEPTH):
        w = torch.randn(DIM, DIM, generator=g) / DIM ** 0.5
        tensors[f"model.diffusion_model.blocks.{i}.weight"] = (Q8_0, (DIM, DIM), _q8_0(w))
        tensors[f"model.diffusion_model.blocks.{i}.norm"] = (F16, (DIM,), (1 + 0.1 * torch.randn(DIM, generator=g))
                                                              .half().numpy().tobytes())
        gain = (1 + 0.1 * torch.randn(DIM, generator=g)).to(torch.bfloat16)
        tensors[f"model.diffusion_model.blocks.{i}.gain"] = (BF16, (DIM,), gain.view(torch.int16).numpy().tobytes())
    path = tmp_path / "model.gguf"
    write_gguf(path, tensors)
    return path


def _load(path) -> Model:
    """As ComfyUI-GGUF's gguf_sd_loader: the prefix stripped, quantized bytes kept, BF16 vectors to float32."""
    f = GgufFile(path)
    model = Model().eval()
    for i, block in enumerate(model.blocks):
        p = f"model.diffusion_model.blocks.{i}."
        raw = f.read_tensor(p + "weight")
        block.weight = nn.Parameter(GGMLTensor(raw, tensor_type=Q8_0, tensor_shape=torch.Size((DIM, DIM))),
                                    requires_grad=False)
        block.norm = nn.Parameter(f.read_tensor(p + "norm"), requires_grad=False)
        block.gain = nn.Parameter(f.read_tensor(p + "gain").to(torch.float32), requires_grad=False)
    f.close()
    return model


def test_the_reader_gives_what_a_gguf_loader_holds(tmp_path):
    f = GgufFile(_file(tmp_path))
    t = f.tensors["model.diffusion_model.blocks.0.weight"]
    assert t.dtype == torch.uint8 and t.shape == (DIM, DIM // 32 * 34) and t.start % 32 == 0
    assert f.tensors["model.diffusion_model.blocks.0.norm"].dtype == torch.float16
    assert f.tensors["model.diffusion_model.blocks.0.gain"].dtype == torch.bfloat16
    assert f.view("model.diffusion_model.blocks.0.norm").dtype == torch.float16


def test_a_gguf_model_streams_from_its_file_under_a_ram_ceiling(tmp_path, offload):
    path = _file(tmp_path)
    model = _load(path)
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    block = sum(t.numel() * t.element_size() for t in model.blocks[0].parameters())
    ceiling = 3 * (block + 1536)  # about half the blocks (each 512-byte aligned leaf) and the bounce buffers
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", host_compression="off", disk_path=str(path),
                                                 ram_budget_bytes=ceiling))
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
        assert torch.equal(model(x), ref)
    rep = h.report()
    disk = [b for b in rep.blocks if b.tier == "disk"]
    assert disk and all("float32 from bfloat16" in b.placement for b in disk), [b.placement for b in rep.blocks]
    assert h.host_memory()["ram"] <= ceiling
    assert type(model.blocks[-1].weight) is GGMLTensor and model.blocks[-1].weight.tensor_type == Q8_0
    h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_corrupt_gguf_span_is_refused_by_name(tmp_path):
    path = tmp_path / "bad.gguf"
    write_gguf(path, {"a": (F32, (4, 4), b"\0" * 64)})
    path.write_bytes(path.read_bytes()[:-8])  # the data section ends early
    with pytest.raises(CorruptFileError, match="'a'.*does not fit"):
        GgufFile(path)
