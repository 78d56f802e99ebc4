"""Layer Offload for ComfyUI: stream model weights block by block from pinned host RAM to the GPU."""
NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

if __package__:  # imported as a package: how ComfyUI loads custom_nodes/<folder>/__init__.py
    try:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811
    except ModuleNotFoundError as _e:
        # Imported outside ComfyUI (pytest collects the repository root as a package; plain-PyTorch users import
        # `offload` directly): there are no nodes to register then. Inside ComfyUI every import must succeed.
        if (_e.name or "").split(".")[0] not in ("comfy", "folder_paths", "server", "nodes"):
            raise
# else: imported as a lone module (pytest collecting a checkout whose folder name is not a valid package name)

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
