"""Layer Offload for ComfyUI: stream model weights block by block from host RAM to the GPU."""
import sys

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

# ComfyUI imports this file as a package after it has set itself up (comfy.model_management is loaded by then).
# Anything else that imports the folder as a package (pytest collecting the repository, a script with ComfyUI
# pip-installed) must not import ComfyUI here: that would initialise it before its command line is applied.
if __package__ and "comfy.model_management" in sys.modules:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
