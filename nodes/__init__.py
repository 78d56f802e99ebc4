"""The ComfyUI face of Layer Offload: the V3 node classes and their extension, the tts folder, the panel's routes,
and the record of the files ComfyUI's loaders read (so Offload Model / CLIP / Any know a model's file)."""
from __future__ import annotations

from typing import List

from comfy_api.latest import ComfyExtension, io

from .apply import OffloadAny, OffloadCLIP, OffloadModel
from .budget import OffloadVramBudget
from .loaders import OffloadCheckpointLoader, OffloadDiffusionModelLoader
from .model_files import install as record_model_files
from .report import OffloadReport
from .routes import register_routes
from .tts import OffloadTTSGenerate, OffloadTTSLoader, register_tts_folder

NODES: List[type] = [OffloadDiffusionModelLoader, OffloadCheckpointLoader, OffloadModel, OffloadCLIP, OffloadAny,
                     OffloadVramBudget, OffloadReport, OffloadTTSLoader, OffloadTTSGenerate]


class LayerOffloadExtension(ComfyExtension):
    """The pack's one extension: every node; the model folder and the panel's routes are set up on load."""

    async def on_load(self) -> None:
        """Register models/tts and the panel's HTTP routes (again: both are idempotent)."""
        register_tts_folder()
        register_routes()

    async def get_node_list(self) -> List[type[io.ComfyNode]]:
        """The node classes, each with its V3 schema."""
        return list(NODES)


def comfy_entrypoint() -> LayerOffloadExtension:
    """ComfyUI's entry point for V3 node packs."""
    return LayerOffloadExtension()


register_tts_folder()
register_routes()
record_model_files()  # the files ComfyUI's loaders read, so Offload Model / CLIP / Any get the disk tier
