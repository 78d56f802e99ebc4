"""The tiny Wan 2.1 model (families/wan.py) as a GGUF file, quantized the way ComfyUI-GGUF's convert tool does.

2D weights whose rows split into 32-element blocks get the file's main type (Q8_0 by default; Q4_0; F16), one-
dimensional tensors and the `modulation` tables F32 (ComfyUI-GGUF keeps them in high precision), the 5D patch
embedding F16 stored flat with its shape under `comfy.gguf.orig_shape.<key>` (GGUF holds at most 4 dimensions).
K-quants (Q4_K, Q5_K, Q6_K: 256-element super-blocks) go to the weights whose rows split into 256-element blocks
(the others stay Q8_0); the gguf package cannot quantize them, so their blocks are seeded random bytes with finite
scales, which dequantize to a valid (if meaningless) weight. Needs the `gguf` package (numpy based, no ComfyUI).
"""
from __future__ import annotations

from typing import Any, Dict

from .common import StateDict
from .wan import WAN21

BLOCK = 32  # Q8_0 / Q4_0 block size
K_BLOCK = 256  # K-quant super-block size
# byte offsets of the float16 scale fields in one K-quant block, and the block's size
K_SCALES = {"Q4_K": ((0, 2), 144), "Q5_K": ((0, 2), 176), "Q6_K": ((208,), 210)}
QTYPES = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "F16"]


def qtypes(sd: StateDict, main: str = "Q8_0") -> Dict[str, str]:
    """The GGUF tensor type each key is written with."""
    out = {}
    for k, t in sd.items():
        if t.dim() == 1 or k.endswith("modulation"):
            out[k] = "F32"
        elif main in K_SCALES and t.dim() == 2 and t.shape[-1] % K_BLOCK == 0:
            out[k] = main
        elif t.dim() == 2 and t.shape[-1] % BLOCK == 0:
            out[k] = main if main in ("Q8_0", "Q4_0", "F16") else "Q8_0"
        else:
            out[k] = "F16"
    return out


def _k_quant_bytes(rows: int, cols: int, qtype: str, seed: int) -> Any:
    """Seeded random K-quant blocks whose float16 scales are small and finite."""
    import numpy as np

    offsets, size = K_SCALES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // K_BLOCK, size), dtype=np.uint8)
    for off in offsets:
        scale = (rng.random((rows, cols // K_BLOCK)) * 0.01 + 0.001).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // K_BLOCK, 2)
    return data.reshape(rows, -1)


def write_gguf(sd: StateDict, path: str, arch: str = "wan", main: str = "Q8_0") -> Dict[str, str]:
    import gguf  # the writer ComfyUI-GGUF uses; ImportError when the package is missing

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    types = qtypes(sd, main)
    for i, (key, t) in enumerate(sd.items()):
        data = t.float().numpy()
        qtype = getattr(gguf.GGMLQuantizationType, types[key])
        if data.ndim > 2 and types[key] == "F16":
            writer.add_array("comfy.gguf.orig_shape.{}".format(key), [int(d) for d in data.shape])
            data = data.reshape(data.shape[0], -1)
        if types[key] in K_SCALES:
            raw = _k_quant_bytes(data.shape[0], data.shape[1], types[key], seed=i)
        else:
            raw = gguf.quants.quantize(data, qtype)
        writer.add_tensor(key, raw, raw_dtype=qtype)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def state_dict() -> StateDict:
    return WAN21.state_dict()


FILE = "lo_fam_wan21_q8_0.gguf"


def file_name(main: str) -> str:
    """The test file written with `main` as its main tensor type."""
    return "lo_fam_wan21_{}.gguf".format(main.lower())
