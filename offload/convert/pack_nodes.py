"""The pack's node types as the converter writes them into a workflow: ids, inputs in the order ComfyUI's frontend
lays them out, widget defaults, outputs.

The contract is nodes/ (its V3 schemas; tests/comfyui/node_defs_v1.json records the saved-workflow view of them):
tests/test_convert_pack_nodes.py holds these tables to node_defs_v1.json, and tests/comfyui/test_convert_server.py to
the live node classes, so a changed input in nodes/ fails a test instead of writing workflows that do not load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BUDGET_TYPE = "OFFLOAD_BUDGET"


@dataclass(frozen=True)
class PackInput:
    """One input: a link socket (`widget` False) or a widget with its default value."""

    name: str
    type: str
    widget: bool
    optional: bool = False
    default: Any = None


@dataclass(frozen=True)
class PackNode:
    """One of the pack's node types: its id, inputs (definition order), outputs (name, type) and size on the canvas."""

    type: str
    display_name: str
    inputs: tuple[PackInput, ...]
    outputs: tuple[tuple[str, str], ...]
    size: tuple[int, int]

    def input(self, name: str) -> PackInput:
        return next(i for i in self.inputs if i.name == name)

    @property
    def widgets(self) -> tuple[PackInput, ...]:
        """The widget inputs in the order `widgets_values` lists them."""
        return tuple(i for i in self.inputs if i.widget)

    @property
    def sockets(self) -> tuple[PackInput, ...]:
        """The link-only inputs (every one is serialized, linked or not, before any linked widget input)."""
        return tuple(i for i in self.inputs if not i.widget)


def _common(first: tuple[PackInput, ...]) -> tuple[PackInput, ...]:
    """An Offload node's inputs: its own, then preset, the budget link, priority, devices and host_compression."""
    return first + (PackInput("preset", "COMBO", True, default="auto"),
                    PackInput("budget", BUDGET_TYPE, False, optional=True),
                    PackInput("priority", "INT", True, optional=True, default=0),
                    PackInput("devices", "STRING", True, optional=True, default=""),
                    PackInput("host_compression", "COMBO", True, optional=True, default="preset"))


DIFFUSION_LOADER = PackNode(
    "OffloadDiffusionModelLoader", "Offload Loader (Diffusion Model)",
    _common((PackInput("unet_name", "COMBO", True), PackInput("weight_dtype", "COMBO", True, default="default"))),
    (("MODEL", "MODEL"),), (360, 190))
CHECKPOINT_LOADER = PackNode(
    "OffloadCheckpointLoader", "Offload Loader (Checkpoint)", _common((PackInput("ckpt_name", "COMBO", True),)),
    (("MODEL", "MODEL"), ("CLIP", "CLIP"), ("VAE", "VAE")), (360, 170))
OFFLOAD_MODEL = PackNode("OffloadModel", "Offload Model", _common((PackInput("model", "MODEL", False),)),
                         (("MODEL", "MODEL"),), (320, 150))
OFFLOAD_CLIP = PackNode("OffloadCLIP", "Offload CLIP", _common((PackInput("clip", "CLIP", False),)),
                        (("CLIP", "CLIP"),), (320, 150))
OFFLOAD_ANY = PackNode("OffloadAny", "Offload Any", _common((PackInput("anything", "*", False),)),
                       (("anything", "*"),), (320, 150))
VRAM_BUDGET = PackNode(
    "OffloadVramBudget", "VRAM Budget",
    (PackInput("budget_gb", "FLOAT", True, default=0.0), PackInput("preset", "COMBO", True, default="auto"),
     PackInput("per_device", "STRING", True, optional=True, default=""),
     PackInput("budget_share", "STRING", True, optional=True, default="")),
    (("budget", BUDGET_TYPE),), (320, 150))

PACK_NODES = {n.type: n for n in (DIFFUSION_LOADER, CHECKPOINT_LOADER, OFFLOAD_MODEL, OFFLOAD_CLIP, OFFLOAD_ANY,
                                  VRAM_BUDGET)}
# every node id of the pack (the TTS nodes and the report are never written by the converter, only recognised)
PACK_TYPES = frozenset(PACK_NODES) | {"OffloadReport", "OffloadTTSLoader", "OffloadTTSGenerate"}
# the pack's nodes that take the budget link
BUDGET_USERS = frozenset({"OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP",
                          "OffloadAny", "OffloadTTSLoader"})
# a model output and the Offload node that streams a model of that type another node loaded
OFFLOAD_AFTER = {"MODEL": OFFLOAD_MODEL, "CLIP": OFFLOAD_CLIP}
# ComfyUI's loaders the converter replaces by the pack's loader of the same file (outputs in the same order):
# loader type -> (the pack's node, {the pack's widget: the loader's widget})
REPLACED = {
    "UNETLoader": (DIFFUSION_LOADER, {"unet_name": "unet_name", "weight_dtype": "weight_dtype"}),
    "CheckpointLoaderSimple": (CHECKPOINT_LOADER, {"ckpt_name": "ckpt_name"}),
}
# the loaders' own widget order (UI JSON's widgets_values), ComfyUI's nodes.py
REPLACED_WIDGETS = {"UNETLoader": ("unet_name", "weight_dtype"), "CheckpointLoaderSimple": ("ckpt_name",)}
# their default titles (a node titled so gets the pack node's title; any other title is the user's and is kept)
DEFAULT_TITLES = {"UNETLoader": ("Load Diffusion Model", "UNETLoader"),
                  "CheckpointLoaderSimple": ("Load Checkpoint", "CheckpointLoaderSimple")}


def widget_values(node: PackNode, values: dict[str, Any]) -> list[Any]:
    """`widgets_values` of `node` with `values` by name, every other widget at its default."""
    return [values.get(w.name, w.default) for w in node.widgets]
