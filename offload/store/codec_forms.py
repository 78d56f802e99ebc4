"""The shapes the codec's data takes (`codec.py` is the codec): the dtypes it codes and how, one chunk of a unit's
encoding (`Chunk`), a unit's encoding (`Encoded`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

CODEC = "expwin"  # the name reports carry in `compression`
ESCAPE_BYTES = 5  # an escape's cost: its position (4 bytes) and its byte

# element size, sign bits and low (raw) bits of the byte holding the sign and the exponent's top
_FORMS: dict[torch.dtype, tuple[int, int, int]] = {
    torch.bfloat16: (2, 1, 0),
    torch.float16: (2, 1, 2),
    torch.float32: (4, 1, 0),
    torch.uint8: (1, 0, 0),
    torch.int8: (1, 0, 0),
}
for _name, _form in (("float8_e4m3fn", (1, 1, 3)), ("float8_e5m2", (1, 1, 2)), ("float8_e4m3fnuz", (1, 1, 3)),
                     ("float8_e5m2fnuz", (1, 1, 2))):
    if hasattr(torch, _name):
        _FORMS[getattr(torch, _name)] = _form
FORMS = _FORMS


def codable(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` may be coded (others are held raw)."""
    return dtype in _FORMS


@dataclass(frozen=True)
class Chunk:
    """One run of a unit's raw bytes [dst, dst + nbytes) and where its encoded form lies in the blob [src, +size).

    A raw chunk has `elem` 0. A coded chunk of version 3 (`n_codes` > 0, `unit_code.py`) codes its elements' top
    bytes as `n_codes` codes from `base` (the last an escape), `m` elements to an index `bits` wide; one of version 2
    (`k` > 0, `chunk_decode.py`: what packed folders of index version 2 hold) as k-bit fields over a window; one of
    version 4 (`smask` > 0, `byte_code.py`: 1-byte elements) codes the `smask` bits of each byte as `n_codes` codes
    (the symbols `base` lists four bits each, and an escape), `m` to a byte, the other bits raw."""

    dst: int
    nbytes: int
    src: int
    size: int
    elem: int = 0  # element size in bytes (0: a raw chunk)
    sbits: int = 0
    rbits: int = 0
    k: int = 0
    base: int = 0
    n_esc: int = 0
    n_codes: int = 0
    m: int = 0
    bits: int = 0
    smask: int = 0  # version 4 (`byte_code.py`): the 4 bits of each byte coded as its symbol

    @property
    def coded(self) -> bool:
        return self.elem > 0

    @property
    def q(self) -> int:
        return self.sbits + self.rbits + self.k

    @property
    def version(self) -> int:
        """4: the byte code of 1-byte elements; 3: the unit-wide code; 2: a k-bit window per chunk (read from old
        packed folders)."""
        if self.smask:
            return 4
        return 2 if self.coded and not self.n_codes else 3


@dataclass
class Encoded:
    """A unit's bytes in the compressed host form: the blob and how it maps onto the raw buffer."""

    blob: torch.Tensor  # uint8, the chunks' encoded bytes one after another
    chunks: tuple[Chunk, ...]
    nbytes: int  # raw bytes of the unit

    @property
    def size(self) -> int:
        return int(self.blob.numel())

    @property
    def ratio(self) -> float:
        return self.size / self.nbytes if self.nbytes else 1.0
