"""Node help (issue 43 part 4) against the nodes' own schemas: each node ComfyUI gets from the pack's extension has a
page web/docs/<node id>.md (what ComfyUI's frontend fetches as /extensions/<pack>/docs/<node id>.md) whose title is
the node's display name and whose Inputs section describes every input of its schema (required and optional) and
nothing else. The browser test (test_panel_browser.py) opens one in the frontend's node help."""
from __future__ import annotations

import pytest

from conftest import comfy_available, display_names, load_tests_module, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)


def test_every_node_has_a_help_page_describing_its_inputs(pack):
    help_pages = load_tests_module("node_help.py")
    classes = node_classes(pack)
    assert len(classes) == 9
    found = []
    for node_id, cls in classes.items():
        spec = cls.INPUT_TYPES()
        inputs = list(spec.get("required", {})) + list(spec.get("optional", {}))
        found += help_pages.problems(node_id, display_names(pack)[node_id], inputs)
    assert found == []
    assert sorted(p.stem for p in help_pages.DOCS.glob("*.md")) == sorted(classes)
