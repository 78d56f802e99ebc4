"""The ComfyUI face of Layer Offload: node classes, display names, and the web panel's route."""
from __future__ import annotations

from .apply import OffloadAny, OffloadCLIP, OffloadModel
from .budget import OffloadVramBudget
from .loaders import OffloadCheckpointLoader, OffloadDiffusionModelLoader
from .report import OffloadReport
from .routes import register_routes

NODE_CLASS_MAPPINGS = {
    "OffloadDiffusionModelLoader": OffloadDiffusionModelLoader,
    "OffloadCheckpointLoader": OffloadCheckpointLoader,
    "OffloadModel": OffloadModel,
    "OffloadCLIP": OffloadCLIP,
    "OffloadAny": OffloadAny,
    "OffloadVramBudget": OffloadVramBudget,
    "OffloadReport": OffloadReport,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "OffloadDiffusionModelLoader": "Offload Loader (Diffusion Model)",
    "OffloadCheckpointLoader": "Offload Loader (Checkpoint)",
    "OffloadModel": "Offload Model",
    "OffloadCLIP": "Offload CLIP",
    "OffloadAny": "Offload Any",
    "OffloadVramBudget": "VRAM Budget",
    "OffloadReport": "Offload Report",
}

register_routes()
