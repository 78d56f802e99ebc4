"""The ComfyUI face of Layer Offload: node classes, display names, the tts model folder, the web panel's routes."""
from __future__ import annotations

from .apply import OffloadAny, OffloadCLIP, OffloadModel
from .budget import OffloadVramBudget
from .loaders import OffloadCheckpointLoader, OffloadDiffusionModelLoader
from .report import OffloadReport
from .routes import register_routes
from .tts import OffloadTTSGenerate, OffloadTTSLoader, register_tts_folder

NODE_CLASS_MAPPINGS = {
    "OffloadDiffusionModelLoader": OffloadDiffusionModelLoader,
    "OffloadCheckpointLoader": OffloadCheckpointLoader,
    "OffloadModel": OffloadModel,
    "OffloadCLIP": OffloadCLIP,
    "OffloadAny": OffloadAny,
    "OffloadVramBudget": OffloadVramBudget,
    "OffloadReport": OffloadReport,
    "OffloadTTSLoader": OffloadTTSLoader,
    "OffloadTTSGenerate": OffloadTTSGenerate,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "OffloadDiffusionModelLoader": "Offload Loader (Diffusion Model)",
    "OffloadCheckpointLoader": "Offload Loader (Checkpoint)",
    "OffloadModel": "Offload Model",
    "OffloadCLIP": "Offload CLIP",
    "OffloadAny": "Offload Any",
    "OffloadVramBudget": "VRAM Budget",
    "OffloadReport": "Offload Report",
    "OffloadTTSLoader": "Offload TTS Loader",
    "OffloadTTSGenerate": "Offload TTS Generate",
}

register_tts_folder()
register_routes()
