"""Layer Offload for ComfyUI: stream model weights block by block from host RAM to the GPU."""
import sys

# ComfyUI imports this file as a package after it has set itself up (comfy.model_management is loaded by then).
# Anything else that imports the folder as a package (pytest collecting the repository, a script with ComfyUI
# pip-installed) must not import ComfyUI here: that would initialise it before its command line is applied.
# The nodes use ComfyUI's V3 schema: ComfyUI finds them through `comfy_entrypoint` (a V3 pack defines no
# NODE_CLASS_MAPPINGS: with one, ComfyUI would take the V1 path instead).
WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY"]

if __package__ and "comfy.model_management" in sys.modules:
    from .nodes import comfy_entrypoint  # noqa: F401

    __all__.append("comfy_entrypoint")
