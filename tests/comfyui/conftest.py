"""ComfyUI tests: run only when COMFYUI_PATH points at a ComfyUI checkout; skip cleanly otherwise.

In-process tests import ComfyUI in CPU mode (`args.cpu = True` before any other comfy import) and load this
repository the way ComfyUI does: by file path, under a hyphenated package name, so only relative imports work.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Dict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
PACK_NAME = "layer-offload-inproc"
COMFYUI_PATH = os.environ.get("COMFYUI_PATH") or None

if HERE not in sys.path:
    sys.path.insert(0, HERE)


def comfy_available() -> bool:
    return bool(COMFYUI_PATH) and os.path.isfile(os.path.join(COMFYUI_PATH, "comfy", "model_patcher.py"))


def skip_reason() -> str:
    if not COMFYUI_PATH:
        return "COMFYUI_PATH is not set (point it at a ComfyUI checkout to run the ComfyUI tests)"
    return "COMFYUI_PATH={} is not a ComfyUI checkout".format(COMFYUI_PATH)


_pack: Any = None


def load_tests_module(relpath: str) -> Any:
    """A module of this repository's tests/ by file path (a ComfyUI checkout may put its own `tests` package first
    on sys.path, as the pip-installable fork does)."""
    name = "layer_offload_tests_" + relpath.replace("/", "_").replace(".py", "")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO_ROOT, "tests", relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_comfy_and_pack() -> Any:
    """Import ComfyUI (CPU mode) and this pack as ComfyUI would; returns the pack module."""
    global _pack
    if _pack is not None:
        return _pack
    # This repository's tests/ is imported first: ComfyUI checkouts carry a regular `tests` package that would
    # otherwise shadow it for every test module collected after this one (`make test` with COMFYUI_PATH set).
    importlib.import_module("tests")
    if COMFYUI_PATH in sys.path:
        sys.path.remove(COMFYUI_PATH)
    sys.path.insert(0, COMFYUI_PATH)  # ComfyUI's `nodes.py` must win over this repository's `nodes/`
    if "nodes" in sys.modules and not hasattr(sys.modules["nodes"], "UNETLoader"):
        del sys.modules["nodes"]
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_management  # noqa: F401
    try:  # the pip-installable fork (0.12.x) exposes upstream's top-level modules only in a "vanilla" environment
        from comfy_compatibility.vanilla import prepare_vanilla_environment
    except ImportError:
        pass
    else:
        prepare_vanilla_environment()
    import folder_paths  # noqa: F401
    import nodes  # noqa: F401  (ComfyUI's core nodes: UNETLoader, KSampler, LoraLoaderModelOnly)

    spec = importlib.util.spec_from_file_location(PACK_NAME, os.path.join(REPO_ROOT, "__init__.py"),
                                                  submodule_search_locations=[REPO_ROOT])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    _pack = module
    return module


def node_classes(pack: Any) -> Dict[str, Any]:
    """node id -> node class, as ComfyUI gets them: from the pack's `comfy_entrypoint` extension (V3)."""
    if "classes" not in _nodes:
        import asyncio

        extension = pack.comfy_entrypoint()
        classes = asyncio.run(extension.get_node_list())
        _nodes["classes"] = {cls.GET_SCHEMA().node_id: cls for cls in classes}
        _nodes["names"] = {cls.GET_SCHEMA().node_id: cls.GET_SCHEMA().display_name for cls in classes}
    return _nodes["classes"]


def display_names(pack: Any) -> Dict[str, str]:
    """node id -> display name, from the nodes' V3 schemas."""
    node_classes(pack)
    return _nodes["names"]


def combo_choices(spec: Any) -> list:
    """The choices of a combo input in V1 form: (choices, opts) from a V1 node, ("COMBO", {"options": ...}) from V3."""
    if isinstance(spec[0], (list, tuple)):
        return list(spec[0])
    return list(spec[1]["options"])


_nodes: Dict[str, Any] = {}


@pytest.fixture(scope="session")
def pack() -> Any:
    if not comfy_available():
        pytest.skip(skip_reason())
    try:
        return load_comfy_and_pack()
    except ImportError as e:  # COMFYUI_PATH is set, but this python lacks ComfyUI's requirements
        pytest.skip("COMFYUI_PATH={} is set but this python cannot import ComfyUI: {} (install ComfyUI's "
                    "requirements into it, see docs/development.md, 'Running the ComfyUI tests')".format(COMFYUI_PATH, e))
