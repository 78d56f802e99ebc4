"""Node help (issue 43 part 4): every node has a page in web/docs/ that ComfyUI's frontend shows in its node help,
saying what the node does, describing each input and giving an example. Here against the recorded node definitions
(tests/comfyui/node_defs_v1.json, and the inputs added since, which test_comfy_nodes.py lists); against the nodes'
own schemas in tests/comfyui/test_node_help_live.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from node_help import DOCS, problems

RECORDED = json.loads((Path(__file__).parent / "comfyui" / "node_defs_v1.json").read_text())
# inputs newer than node_defs_v1.json (tests/comfyui/test_comfy_nodes.py ADDED_INPUTS), by node
ADDED = {"devices": ("OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP",
                     "OffloadAny"),
         "host_compression": ("OffloadDiffusionModelLoader", "OffloadCheckpointLoader", "OffloadModel", "OffloadCLIP",
                              "OffloadAny"),
         "per_device": ("OffloadVramBudget",), "budget_share": ("OffloadVramBudget",),
         "voice_text": ("OffloadTTSGenerate",), "temperature": ("OffloadTTSGenerate",),
         "top_k": ("OffloadTTSGenerate",), "top_p": ("OffloadTTSGenerate",)}


@pytest.mark.parametrize("node_id", sorted(RECORDED))
def test_every_recorded_node_has_a_help_page(node_id):
    want = RECORDED[node_id]
    inputs = list(want["input_order"]) + [name for name, nodes in ADDED.items() if node_id in nodes]
    assert problems(node_id, want["display_name"], inputs) == []


def test_no_page_without_a_node():
    assert sorted(p.stem for p in DOCS.glob("*.md")) == sorted(RECORDED)


def test_the_checker_finds_what_is_wrong():
    found = problems("OffloadModel", "Offload Model", ["model", "preset", "missing_one"])
    assert any("'missing_one' is not described" in p for p in found)
    assert any("describes 'budget'" in p for p in found)
    assert problems("NoSuchNode", "x", []) and problems("OffloadModel", "Another Title", [])
