"""Layer Offload for ComfyUI: stream model weights block by block from pinned host RAM to the GPU."""
try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ModuleNotFoundError as _e:
    # Imported outside ComfyUI (pytest collects the repository root as a package; plain-PyTorch users import
    # `offload` directly): there are no nodes to register then. Inside ComfyUI every import must succeed.
    if (_e.name or "").split(".")[0] not in ("comfy", "folder_paths", "server", "nodes"):
        raise
    NODE_CLASS_MAPPINGS = {}
    NODE_DISPLAY_NAME_MAPPINGS = {}

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
