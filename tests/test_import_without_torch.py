"""`import offload` in a Python without torch says which torch to install (issue 18: it was a bare
ModuleNotFoundError, since torch is deliberately not a dependency of the package)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# torch is hidden by a meta-path finder that answers every `torch` import as a missing module
_CHILD = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError("No module named %r" % name, name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    sys.path.insert(0, {root!r})
    try:
        import offload  # noqa: F401
    except ImportError as exc:
        print(type(exc).__name__)
        print(exc)
        print("CAUSE", type(exc.__cause__).__name__)
        sys.exit(3)
    print("IMPORTED")
""")


def _run() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT)], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


def test_import_without_torch_names_the_torch_to_install():
    proc = _run()
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    kind, message = proc.stdout.splitlines()[0], "\n".join(proc.stdout.splitlines()[1:])
    assert kind == "ImportError", "an ImportError of its own, not the bare ModuleNotFoundError"
    assert "Layer Offload needs PyTorch" in message
    assert "pip install torch" in message and "torch==2.13.0" in message, message
    assert "pytorch.org" in message and "ComfyUI" in message, message
    assert "CAUSE ModuleNotFoundError" in proc.stdout, "the original error stays attached"


def test_import_with_torch_is_unchanged():
    """The check costs nothing where torch is present: the package imports and exposes its API."""
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import offload; "
                           "print(sorted(offload.__all__)[:1], hasattr(offload, '_torch'))"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "False" in proc.stdout, "no helper name left in the package namespace"
