"""The Python examples of the README and the guides (docs/*.md) run as written (issue 18: the example called `x.cuda()`
even on device="sim"; issue 45: every example of every guide, not only the README's).

Every ```python block must follow a `<!-- runnable ... -->` comment, and each is executed in a fresh namespace from the
repository root; without a GPU `resolve_device("auto")` gives the simulated device. A block that leaves `model`, `x`
and `y` behind is also checked against the plain model: after `handle.detach()`, the model gives the very output the
offloaded forward gave.

No model hub is reachable here and CI has no GPU, so a marker may name stand-ins, `<!-- runnable (stand-ins: hub,
lora_file): ... -->`, each a documented substitution made around the block and nothing else:
- `hub`: diffusers' `from_pretrained` of a pipeline class gives that pipeline at the size diffusers' own pipeline
  tests build it (tests/pipelines/pipeline_builders.py), cast to the `torch_dtype` asked, its default image 16x16;
- `lora_file`: the block runs in a temporary folder holding `my_style_lora.safetensors`, a random LoRA in diffusers'
  format for that test-size Flux transformer;
- `aot_eager`: `torch.compile` without a backend uses "aot_eager" (inductor needs a C++ toolchain and minutes on a
  CPU; tests/test_compile.py runs inductor itself).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import glob
import os
import re
import textwrap
from typing import Any, Iterator

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FENCE = re.compile(r"^( *)```python\n(.*?)\n\1```", re.S | re.M)
_MARKER = re.compile(r"<!--\s*runnable\b([^>]*)-->\s*\n$")
_STAND_INS = re.compile(r"\(stand-ins:\s*([\w, ]+)\)")


def documents() -> list[str]:
    """The README and every guide under docs/, as paths relative to the repository root."""
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def python_blocks() -> list[tuple[str, int, str, str | None]]:
    """Every ```python block of the documents: (document, line, code, the runnable marker's text or None)."""
    out = []
    for doc in documents():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for m in _FENCE.finditer(text):
            before = text[:m.start()]
            marker = _MARKER.search(before[-400:])
            code = textwrap.dedent(m.group(2))
            out.append((doc, before.count("\n") + 1, code, marker.group(1) if marker else None))
    return out


def runnable_blocks() -> list[tuple[str, int, str, str]]:
    return [b for b in python_blocks() if b[3] is not None]  # type: ignore[misc]


def test_every_python_example_is_marked_runnable():
    blocks = python_blocks()
    assert any(doc == "README.md" for doc, *_ in blocks), "the README has no python example"
    assert {doc for doc, *_ in blocks} > {"README.md"}, "no guide under docs/ has a python example"
    unmarked = [f"{doc}:{line}" for doc, line, _, marker in blocks if marker is None]
    assert not unmarked, f"python blocks without a <!-- runnable --> marker (the tests run every example): {unmarked}"
    assert all(".cuda()" not in code for *_, code, _ in blocks), "a runnable example must not assume a GPU"


def test_the_block_finder_sees_markers_and_fences():
    assert len(runnable_blocks()) >= 8
    assert all(code.strip() and "```" not in code for _, _, code, _ in runnable_blocks())


@contextlib.contextmanager
def _hub(mp: pytest.MonkeyPatch, tmp: str) -> Iterator[None]:
    import diffusers

    from pipelines.pipeline_builders import CASES

    def from_pretrained(cls: Any, repo: str, torch_dtype: Any = None, **kwargs: Any) -> Any:
        case = next(c for c in CASES if c.pipeline == cls.__name__)
        pipe = case.build()
        pipe.default_sample_size = 16 // pipe.vae_scale_factor
        return pipe.to(torch_dtype) if torch_dtype is not None else pipe

    for case_cls in {getattr(diffusers, "FluxPipeline"), getattr(diffusers, "DiffusionPipeline")}:
        mp.setattr(case_cls, "from_pretrained", classmethod(from_pretrained))
    yield


@contextlib.contextmanager
def _lora_file(mp: pytest.MonkeyPatch, tmp: str) -> Iterator[None]:
    from safetensors.torch import save_file

    from pipelines.test_lora_flows import _adapter_state

    save_file({k: v.contiguous() for k, v in _adapter_state(1).items()}, os.path.join(tmp, "my_style_lora.safetensors"))
    mp.chdir(tmp)
    yield


@contextlib.contextmanager
def _aot_eager(mp: pytest.MonkeyPatch, tmp: str) -> Iterator[None]:
    compile_ = torch.compile

    @functools.wraps(compile_)
    def compile_aot_eager(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", "aot_eager")
        return compile_(*args, **kwargs)

    mp.setattr(torch, "compile", compile_aot_eager)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


STAND_INS = {"hub": _hub, "lora_file": _lora_file, "aot_eager": _aot_eager}


def _ids() -> list[str]:
    return [f"{doc}:{line}" for doc, line, _, _ in runnable_blocks()]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("index", range(len(runnable_blocks())), ids=_ids())
def test_example_runs_as_written(index, capsys, monkeypatch, tmp_path):
    doc, line, code, marker = runnable_blocks()[index]
    names = [n.strip() for m in _STAND_INS.findall(marker) for n in m.split(",") if n.strip()]
    assert all(n in STAND_INS for n in names), f"{doc}:{line}: unknown stand-in in {names}; known: {list(STAND_INS)}"
    import offload

    monkeypatch.chdir(ROOT)
    made: list = []  # every handle the example makes: detached at the end (the simulated device is the process's)
    real = offload.offload_module
    monkeypatch.setattr(offload, "offload_module", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    namespace: dict = {"__name__": f"example_{index}"}
    try:
        with contextlib.ExitStack() as stack:
            for n in names:
                stack.enter_context(STAND_INS[n](monkeypatch, str(tmp_path)))
            exec(compile(code, f"{doc} python block at line {line}", "exec"), namespace)  # noqa: S102 - the docs
        if all(k in namespace for k in ("model", "x", "y")):
            model, x, y = namespace["model"], namespace["x"], namespace["y"]
            assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()), "detach() left hooks"
            with torch.no_grad():
                assert torch.equal(model(x.to(y.device)).to(y.device), y), "offloaded output differs from the plain one"
        assert capsys.readouterr().out.strip(), f"{doc}:{line}: the example prints what it shows"
    finally:
        for handle in made:
            with contextlib.suppress(offload.DetachedError):
                handle.detach()
        namespace.clear()
        gc.collect()


_SHELL_FENCE = re.compile(r"^( *)```(?:bash|sh|shell)\n(.*?)\n\1```", re.S | re.M)


def shell_lines() -> list[tuple[str, str]]:
    """Every command line of the documents' ```bash blocks (comments cut, continuation lines joined)."""
    out = []
    for doc in documents():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for m in _SHELL_FENCE.finditer(text):
            for line in textwrap.dedent(m.group(2)).replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append((doc, line))
    return out


def test_the_documented_commands_exist(monkeypatch):
    """The shell examples cannot all run here (they install things, start ComfyUI, need a GPU), but what they name
    must exist: every `python -m offload ...` line parses with the CLI's own parser and names known cards, every
    `make <target>` is a target of the Makefile, and every script run with `python` is in the repository."""
    import shlex

    import offload.__main__ as cli
    import offload.demo as demo
    from offload.predict import cards, plan_cli

    lines = shell_lines()
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([\w-]+):", f.read(), re.M))
    parsed: list = []
    monkeypatch.setattr(plan_cli, "main", lambda args: parsed.append(args) or 0)
    monkeypatch.setattr(demo, "main", lambda args: parsed.append(args) or 0)
    monkeypatch.setattr(cli, "_pack", lambda args: parsed.append(args) or 0)
    offload_lines = [(d, line) for d, line in lines if line.startswith("python -m offload ")]
    assert offload_lines, "no `python -m offload` command in the documents"
    for doc, line in offload_lines:
        argv = shlex.split(line)[3:]
        try:
            assert cli.main(argv) == 0, (doc, line)
        except SystemExit as e:  # argparse refused it
            raise AssertionError(f"{doc}: `{line}` does not parse ({e})") from None
        card = getattr(parsed[-1], "card", None)
        if card and card != "measure":
            cards.get_card(card)  # a ValueError names the unknown card
    for doc, line in lines:
        for script in re.findall(r"\bpython3? ((?:benchmarks|tools|tests)/[\w/.-]+\.py)", line):
            assert os.path.isfile(os.path.join(ROOT, script)), f"{doc}: `{line}` names {script}, which does not exist"
        for target in re.findall(r"(?:^|&&\s*|\s)make\s+([a-z][\w-]*)", line):
            assert target in targets, f"{doc}: `{line}` names make target {target!r}, not in the Makefile"
