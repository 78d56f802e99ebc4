"""Every dtype the safetensors format stores and this torch has is read by every reader (issue 42): the header
validator, SafetensorsFile (positioned reads and the map), the packed format, the disk tier; a dtype torch lacks is
refused by name. The planner reads quantized files (MXFP8's F8_E8M0 block scales were refused outright) and prices
them: bytes as stored, compute as the dequantized op."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from offload import OffloadConfig
from offload.__main__ import main
from offload.predict.header_costs import Tokens, diffusion_analysis
from offload.predict.model_files import read_tensor_infos
from offload.predict.model_kinds import describe
from offload.predict.plan_cli import load_spec
from offload.store.header_check import DTYPES, SAFETENSORS_DTYPES, CorruptFileError, safetensors_tensors
from offload.store.pack_writer import pack_file
from offload.store.packed import open_weights
from offload.store.storage import SafetensorsFile
from tests.host_master_guard import host_master_guard

sys.path.insert(0, str(Path(__file__).parent / "comfyui"))
import tiny_wan  # noqa: E402

# the safetensors crate's Dtype list (safetensors 0.8): what a file may hold
SAFETENSORS_NAMES = {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ",
                     "F8_E5M2FNUZ", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64",
                     "U64"}


def _tensor(dtype: torch.dtype, shape=(4, 8), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def test_the_table_is_safetensors_own_list():
    assert set(SAFETENSORS_DTYPES) == SAFETENSORS_NAMES


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_torch_has_is_read_by_every_reader(name, tmp_path):
    dtype = DTYPES[name]
    t = {"blocks.0.a": _tensor(dtype), "blocks.0.b": _tensor(dtype, (3, 2, 4), 1), "blocks.1.a": _tensor(dtype)}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))  # safetensors writes the file: the header is its own
    header = safetensors_tensors(path)
    assert {k: (v.dtype, v.shape) for k, v in header.items()} == {k: (v.dtype, tuple(v.shape)) for k, v in t.items()}
    f = SafetensorsFile(path)
    pack_file(str(path), str(tmp_path / "packed"))
    packed = open_weights(tmp_path / "packed")
    for key, want in t.items():
        for reader in (f.read_tensor, f.view, packed.read_tensor):
            got = reader(key)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    f.close()
    packed.close()


@pytest.mark.parametrize("name", sorted(SAFETENSORS_NAMES - set(DTYPES)))
def test_a_dtype_this_torch_lacks_is_refused_by_name(name, tmp_path):
    header = json.dumps({"x": {"dtype": name, "shape": [4, 8], "data_offsets": [0, 24]}}).encode()
    path = tmp_path / "f6.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 24)
    with pytest.raises(CorruptFileError, match=f"{name}.*no torch dtype in torch"):
        SafetensorsFile(path)


def test_a_packed_fp4_tensor_counts_elements_in_the_header(tmp_path):
    """F4 holds two elements per byte: the header's last dimension is twice torch's float4_e2m1fn_x2 one."""
    path = tmp_path / "f4.safetensors"
    save_file({"x": _tensor(torch.float4_e2m1fn_x2, (4, 4))}, str(path))
    raw = path.read_bytes()
    stored = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["x"]
    assert stored["dtype"] == "F4" and stored["shape"] == [4, 8]
    assert SafetensorsFile(path).tensors["x"].shape == (4, 4)
    odd = json.dumps({"x": {"dtype": "F4", "shape": [4, 7], "data_offsets": [0, 14]}}).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(odd)) + odd + b"\0" * 14)
    with pytest.raises(CorruptFileError, match="multiple of 2"):
        SafetensorsFile(tmp_path / "odd.safetensors")


class _ScaledBlock(nn.Module):
    """A block holding MXFP8-style block scales (float8_e8m0fnu) and packed fp4 bytes as plain tensors."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("scales", _tensor(torch.float8_e8m0fnu, (dim,), 3))
        self.register_buffer("nibbles", _tensor(torch.float4_e2m1fn_x2, (dim,), 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.scales.view(torch.uint8).float() / 255.0 + self.nibbles.view(torch.uint8).float() / 512.0
        return self.lin(x) * s


class _ScaledStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_e8m0_and_fp4_tensors_stream_from_the_disk_tier(tmp_path, offload):
    torch.manual_seed(0)
    model = _ScaledStack().eval()
    path = str(tmp_path / "m.safetensors")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    x = torch.randn(2, 64)
    ref = model(x)
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", host_compression="off", disk_path=path,
                                                 ram_budget_bytes=4 * 17408))
    with host_master_guard(h), torch.no_grad():
        assert torch.equal(model(x), ref)
    assert "disk" in [b.tier for b in h.report().blocks]


# -------------------------------------------------------------------------------------------------- the planner
def _quantized_wan(tmp_path: Path, fmt: str) -> Path:
    """tiny_wan's file with every block matrix quantized as ComfyUI stores it (comfy_kitchen's layouts)."""
    ck = pytest.importorskip("comfy_kitchen.tensor")
    layouts = {"mxfp8": ("TensorCoreMXFP8Layout", {}), "nvfp4": ("TensorCoreNVFP4Layout", {}),
               "float8_e4m3fn": ("TensorCoreFP8Layout", {}), "int8_tensorwise": ("TensorWiseINT8Layout", {})}
    layout, kw = layouts[fmt]
    sd = {}
    for k, v in tiny_wan.make_wan_state_dict(dtype=torch.bfloat16).items():
        if k.startswith("blocks.") and k.endswith(".weight") and v.dim() == 2:
            q = ck.QuantizedTensor.from_float(v, layout, **kw)
            sd.update({n: t.contiguous() for n, t in q.state_dict(k).items()})
            sd[k[:-len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()),
                                                                  dtype=torch.uint8)
        else:
            sd[k] = v
    path = tmp_path / f"wan_{fmt}.safetensors"
    save_file(sd, str(path))
    return path


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4", "float8_e4m3fn", "int8_tensorwise"])
def test_the_planner_prices_a_quantized_file(fmt, tmp_path):
    path = _quantized_wan(tmp_path, fmt)
    plain = tmp_path / "wan_bf16.safetensors"
    tiny_wan.write_wan(str(plain), dtype=torch.bfloat16)
    spec, spec_bf16 = load_spec(path), load_spec(plain)  # `python -m offload plan` reads the file (MXFP8 included)
    assert spec.family == "wan" and spec.config == spec_bf16.config
    assert spec.dtype == fmt
    stored = sum(i.nbytes for k, i in read_tensor_infos(path).items() if k.startswith("blocks."))
    assert sum(spec.block_bytes) >= stored and sum(spec.block_bytes) < 0.75 * sum(spec_bf16.block_bytes)
    # the workflow plan: the same shapes (compute as the dequantized op), the file's bytes
    infos, infos_bf16 = read_tensor_infos(path), read_tensor_infos(plain)
    assert {k: i.shape for k, i in infos.items() if k in infos_bf16} == {k: i.shape for k, i in infos_bf16.items()}
    tok = Tokens(64, 16)
    quant, bf16 = diffusion_analysis(describe(infos), tok), diffusion_analysis(describe(infos_bf16), tok)
    assert quant.flops == bf16.flops
    mm = lambda a: sum(b for ops in a.units for kind, _, b in ops if kind == "mm")  # noqa: E731
    assert mm(quant) < mm(bf16)


def test_python_m_offload_plan_plans_an_mxfp8_file(tmp_path, capsys):
    path = _quantized_wan(tmp_path, "mxfp8")
    assert main(["plan", str(path), "--frames", "5", "--height", "64", "--width", "64", "--presets", "budget",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "wan" and out["presets"]["budget"]["fits"] is True
