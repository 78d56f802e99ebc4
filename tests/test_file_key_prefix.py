"""A model whose tensor names carry a leading part its file lacks (issue 42): ComfyUI's text encoders name their
weights `clip_l.transformer.text_model...` / `t5xxl.transformer.encoder...` while the file Load CLIP read holds the
encoder alone (`text_model...`, `encoder...`). The disk tier matches them (`SafetensorsFile.keys_for`): blocks move
to the file on request and stream from it bitwise; a name held under two prefixes is refused, never guessed."""
from __future__ import annotations

import torch
import torch.nn as nn
from safetensors.torch import save_file

from offload import OffloadConfig
from offload.store.storage import SafetensorsFile
from tests.models import LayersModel, run, seeded

DEPTH = 8


class Wrapped(nn.Module):
    """The encoder under two more name parts, as ComfyUI's SD1ClipModel holds `clip_l.transformer`."""

    def __init__(self) -> None:
        super().__init__()
        self.clip_l = nn.Module()
        self.clip_l.transformer = seeded(LayersModel, dim=64, depth=DEPTH, seed=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.clip_l.transformer(x)


def _x() -> torch.Tensor:
    return torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7))


def test_blocks_of_a_wrapped_encoder_move_to_its_file_and_stream_bitwise(tmp_path, offload):
    model = Wrapped().eval()
    ref = run(model, (_x(),))
    path = tmp_path / "encoder.safetensors"
    save_file({k: v.contiguous() for k, v in model.clip_l.transformer.state_dict().items()}, str(path))
    h = offload(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), disk_optional=True,
                                                 host_compression="off"))
    assert torch.equal(run(model, (_x(),)), ref)
    assert h.release_host_memory(1 << 40) > 0
    tiers = [b.tier for b in h.report().blocks]
    assert tiers == ["disk"] * DEPTH, tiers
    for _ in range(2):
        assert torch.equal(run(model, (_x(),)), ref)
    h.detach()
    assert torch.equal(run(model, (_x(),)), ref)


def test_a_name_held_under_two_prefixes_is_not_guessed(tmp_path):
    block = seeded(LayersModel, dim=8, depth=1).layers[0]
    sd = {}
    for prefix in ("a.", "b."):
        sd.update({prefix + "layers.0." + k: v.clone() for k, v in block.state_dict().items()})
    path = tmp_path / "two.safetensors"
    save_file(sd, str(path))
    f = SafetensorsFile(path)
    try:
        names = ["enc.layers.0." + k for k in block.state_dict()]
        assert f.keys_for(names) is None
        assert f.keys_for(["a.layers.0." + k for k in block.state_dict()]) == ["a.layers.0." + k
                                                                               for k in block.state_dict()]
    finally:
        f.close()


def test_stripping_keeps_the_block_index(tmp_path):
    """`x.layers.0.w` never matches the file's `layers.1.w`: the block's container and index stay in the name."""
    block = seeded(LayersModel, dim=8, depth=2)
    path = tmp_path / "m.safetensors"
    save_file({"layers.1." + k: v.contiguous() for k, v in block.layers[1].state_dict().items()}, str(path))
    f = SafetensorsFile(path)
    try:
        assert f.keys_for(["x.layers.0." + k for k in block.layers[0].state_dict()]) is None
        assert f.keys_for(["x.layers.1." + k for k in block.layers[1].state_dict()]) is not None
    finally:
        f.close()
