"""The engine's folders show its architecture: offload/ keeps the entry points, each job is a sub-package that says
what it is, imports only run down the layers, no import circle, no module of the engine or the nodes over 500 lines,
and the flat layout's module names (offload.streamer, offload.kv_cache, ...) are gone: importing the engine installs
no import machinery (no finder on sys.meta_path), and those names no longer import."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "offload"

# The layers, highest first: a module may import its own package and anything on a lower rank, never a higher one.
# config.py is the vocabulary every layer speaks (OffloadConfig, the presets, byte checks): it imports nothing.
RANKS = {
    "offload": 10, "offload.__main__": 10,
    "offload.convert": 9,  # "offload this workflow": an application of the workflow plan
    "offload.predict": 8, "offload.tts": 8, "offload.demo": 8,
    "offload.handle": 7, "offload.setup": 7, "offload.arguments": 7, "offload.reporting": 7,  # one floor
    "offload.stream": 6, "offload.generate": 6,
    "offload.budget": 5,
    "offload.plan": 4,
    "offload.store": 3,
    "offload.model": 2, "offload.report": 2,
    "offload.backends": 1,
    "offload.config": 0,
}

# The flat layout before the sub-packages: old name -> the module it is now (the old names no longer import).
MOVED = {
    "pin_gate": "backends.pin_gate",
    "blocks": "model.blocks", "layout": "model.layout", "meta_buffers": "model.meta_buffers", "fp8": "model.fp8",
    "model_changes": "model.model_changes",
    "staging": "store.staging",
    "planner": "plan.planner", "plan_device": "plan.plan_device", "plan_host": "plan.plan_host",
    "ring_sim": "plan.ring_sim", "cost_model": "plan.cost_model",
    "recency": "budget.recency", "membership": "budget.membership", "reserve": "budget.reserve",
    "streamer": "stream.streamer", "prefetch": "stream.prefetch", "placement": "stream.placement",
    "host_tiers": "stream.host_tiers", "write_watch": "stream.write_watch", "buffer_writes": "stream.buffer_writes",
    "outputs": "stream.outputs", "pass_lock": "stream.pass_lock", "backward": "stream.backward",
    "compile_support": "stream.compile_support", "devices": "stream.devices", "replan": "plan.replan",
    "metrics": "report.metrics",
    "cost_profile": "predict.cost_profile", "meta_costs": "predict.meta_costs",
    "device_timing": "predict.device_timing", "cards": "predict.cards", "plan_cli": "predict.plan_cli",
    "kv_cache": "generate.kv_cache",
}

PUBLIC = ["OffloadConfig", "PRESETS", "PresetPolicy", "DEFAULT_PRESET", "preset_tooltip", "budget_preset_tooltip",
          "presets_markdown_table", "offload_module", "OffloadHandle", "VramBudget", "default_budget",
          "OffloadReport", "BlockReport", "summarize", "device_memory", "resolve_device", "DeviceMemoryError",
          "PlanError", "RamCeilingError", "BudgetError", "CorruptFileError", "SourceChangedError",
          "DetachedError", "TrainableWeightError", "predict", "Prediction", "Card"]


# ... and the two that were split in two: the old name offers the names of both parts
SPLIT = {"storage": ("store.storage", "store.sources"), "packed": ("store.packed", "store.pack_writer")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ENGINE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every offload module `name` imports: at module level, inside functions and under TYPE_CHECKING alike."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {t for t in found if t in modules and t != name}


ENTRY = ("offload.handle", "offload.setup", "offload.arguments", "offload.reporting")


def _rank(name: str) -> tuple[str, int]:
    if name in ENTRY:
        return "entry", RANKS[name]
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in RANKS:
            return key, RANKS[key]
    raise AssertionError(f"{name} is in no layer: add its package to RANKS and to docs/architecture.md")


def test_top_level_holds_only_the_entry_points():
    top = sorted(p.name for p in ENGINE.glob("*.py"))
    assert len(top) <= 8, top
    packages = sorted(p.parent.name for p in ENGINE.glob("*/__init__.py"))
    assert packages == ["backends", "budget", "convert", "demo", "generate", "model", "plan", "predict", "report",
                        "store", "stream", "tts"]


@pytest.mark.parametrize("package", sorted(p.parent.name for p in ENGINE.glob("*/__init__.py")))
def test_every_sub_package_says_its_job(package):
    doc = ast.get_docstring(ast.parse((ENGINE / package / "__init__.py").read_text()))
    assert doc and len(doc.splitlines()) >= 3, f"offload/{package}/__init__.py needs a docstring: its job"
    assert "Layer:" in doc and "Used from outside:" in doc, package


def test_imports_run_down_the_layers():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        group, rank = _rank(name)
        for target in _imports(name, path, modules):
            tgroup, trank = _rank(target)
            if tgroup != group and trank >= rank:
                wrong.append(f"{name} ({group}, {rank}) imports {target} ({tgroup}, {trank})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle back to it
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state: dict[str, int] = defaultdict(int)
    circles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for t in graph[n]:
            if state[t] == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif state[t] == 0:
                visit(t, stack + [t])
        state[n] = 2

    for n in sorted(graph):
        if state[n] == 0:
            visit(n, [n])
    assert not circles, circles


def test_no_engine_or_nodes_module_over_500_lines():
    modules = [*ENGINE.rglob("*.py"), *(ROOT / "nodes").rglob("*.py"), ROOT / "__init__.py"]
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_public_names_unchanged():
    import offload
    assert offload.__all__ == PUBLIC
    for name in PUBLIC:
        assert getattr(offload, name) is not None


def test_flat_layout_names_no_longer_import_and_no_finder_is_installed():
    """Run in a fresh interpreter: importing the engine (and the public names) leaves sys.meta_path as it was, and
    every module name of the flat layout (offload.streamer, offload.storage, ...) is a ModuleNotFoundError."""
    old_names = [*MOVED, *SPLIT]
    code = "\n".join([
        "import importlib, sys",
        "before = list(sys.meta_path)",
        "import offload",
        "from offload import *",
        "import offload.predict, offload.tts, offload.demo, offload.generate",
        "assert sys.meta_path == before, [type(f).__name__ for f in sys.meta_path if f not in before]",
        f"for old in {old_names!r}:",
        "    try:",
        "        importlib.import_module('offload.' + old)",
        "    except ModuleNotFoundError as e:",
        "        assert e.name == 'offload.' + old, (old, e.name)",
        "    else:",
        "        raise AssertionError('offload.' + old + ' still imports')",
        "    assert 'offload.' + old not in sys.modules, old",
        "assert importlib.import_module('offload.stream.streamer').__name__ == 'offload.stream.streamer'",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr


def test_moved_names_cover_every_old_module():
    """Each flat module of the old layout is named once, and its new home exists."""
    modules = _modules()
    for old, new in [*MOVED.items(), *((o, p) for o, ps in SPLIT.items() for p in ps)]:
        assert f"offload.{new}" in modules, new
        assert not (ENGINE / f"{old}.py").exists(), old
    assert importlib.import_module("offload.stream.streamer").__name__ == "offload.stream.streamer"
