"""The README's Python examples run as written (issue 18: the example called `x.cuda()` even on device="sim").

Every ```python block right after a `<!-- runnable ... -->` comment is executed in a fresh namespace; without a GPU
`resolve_device("auto")` gives the simulated device. A block that leaves `model`, `x` and `y` behind is also checked
against the plain model: after `handle.detach()`, the model gives the very output the offloaded forward gave.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK = re.compile(r"<!--\s*runnable\b[^>]*-->\s*\n```python\n(.*?)\n```", re.S)


def runnable_blocks() -> list[str]:
    """The README's python code blocks marked runnable."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return _BLOCK.findall(f.read())


def test_the_readme_has_runnable_python_examples():
    blocks = runnable_blocks()
    assert blocks, "no ```python block is marked <!-- runnable --> in README.md"
    assert all(".cuda()" not in b for b in blocks), "a runnable example must not assume a GPU"


@pytest.mark.parametrize("index", range(len(runnable_blocks())))
def test_readme_example_runs_as_written(index, capsys):
    code = runnable_blocks()[index]
    namespace: dict = {"__name__": f"readme_example_{index}"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102 - the README is the test
    if all(k in namespace for k in ("model", "x", "y")):
        model, x, y = namespace["model"], namespace["x"], namespace["y"]
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()), "detach() left hooks"
        with torch.no_grad():
            assert torch.equal(model(x.to(y.device)).to(y.device), y), "offloaded output differs from the plain one"
    assert capsys.readouterr().out.strip(), "the example prints its report"
