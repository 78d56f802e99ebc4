"""The tiny Wan 2.1 model (families/wan.py) as a GGUF file, quantized the way ComfyUI-GGUF's convert tool does.

2D weights whose rows split into 32-element blocks are Q8_0, one-dimensional tensors and the `modulation` tables
F32 (ComfyUI-GGUF keeps them in high precision), the 5D patch embedding F16 stored flat with its shape under
`comfy.gguf.orig_shape.<key>` (GGUF holds at most 4 dimensions). Needs the `gguf` package (numpy based, no ComfyUI).
"""
from __future__ import annotations

from typing import Dict

from .common import StateDict
from .wan import WAN21

BLOCK = 32  # Q8_0 block size


def qtypes(sd: StateDict) -> Dict[str, str]:
    """The GGUF tensor type each key is written with."""
    out = {}
    for k, t in sd.items():
        if t.dim() == 1 or k.endswith("modulation"):
            out[k] = "F32"
        elif t.dim() == 2 and t.shape[-1] % BLOCK == 0:
            out[k] = "Q8_0"
        else:
            out[k] = "F16"
    return out


def write_gguf(sd: StateDict, path: str, arch: str = "wan") -> Dict[str, str]:
    import gguf  # the writer ComfyUI-GGUF uses; ImportError when the package is missing

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    types = qtypes(sd)
    for key, t in sd.items():
        data = t.float().numpy()
        qtype = getattr(gguf.GGMLQuantizationType, types[key])
        if data.ndim > 2 and types[key] == "F16":
            writer.add_array("comfy.gguf.orig_shape.{}".format(key), [int(d) for d in data.shape])
            data = data.reshape(data.shape[0], -1)
        writer.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def state_dict() -> StateDict:
    return WAN21.state_dict()


FILE = "lo_fam_wan21_q8_0.gguf"
