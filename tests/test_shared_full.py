"""A /dev/shm too small for the model (a container's 64 MB): the shared host copy takes the blocks that fit and the
rest stay in the process's own RAM, on every way a block goes in (shared_host.py), with no SIGBUS and no error
surfacing as another: filled while staging (a RAM ceiling) from a model built on the meta device (each block written
from the file's pages through the segment's descriptor: ENOSPC there) or loaded in RAM (pages reserved first), and
moved in after setup (`HostPlan.publish_later`, the default: ENOSPC on the thread's write). A real tmpfs of 1 MiB
(mounted as root; skipped elsewhere) holds the segments: outputs are bitwise the model's own, a second model joins
exactly the blocks that fit, and the folder is empty once both let go.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests import shared_host_worker as worker

safetensors_torch = pytest.importorskip("safetensors.torch")
shared_host = pytest.importorskip("offload.store.shared_host")

pytestmark = pytest.mark.skipif(not shared_host.available(), reason="needs Linux's /dev/shm")

WIDTH = 256  # the worker's model at this width: 16 blocks of 256 KiB (fp32); three fit beside the header


@pytest.fixture
def small_model(monkeypatch, tmp_path):
    """The worker's model at WIDTH, its file, and its own output."""
    monkeypatch.setattr(worker, "WIDTH", WIDTH)
    torch.manual_seed(0)
    model = worker.build()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    with torch.no_grad():
        want = model(worker.inputs())
    return path, want


@pytest.fixture
def tiny_tmpfs(monkeypatch):
    """A tmpfs of 1 MiB for the segments (as root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    d = Path(tempfile.mkdtemp(prefix="lo-shm-full-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(d)],
                      capture_output=True).returncode != 0:
        shutil.rmtree(d, ignore_errors=True)
        pytest.skip("mounting a tmpfs failed")
    monkeypatch.setenv("LAYER_OFFLOAD_SHM_DIR", str(d))
    monkeypatch.setattr(shared_host.SharedHostCopy, "said_full", False)
    yield d
    if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def _offload(path: Path, load: str, ceiling: bool):
    from offload import OffloadConfig, VramBudget, offload_module

    if load == "meta":
        model = worker.build("meta")
    else:
        model = worker.build()
        model.load_state_dict(safetensors_torch.load_file(str(path)))
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path),
                                    **({"ram_budget_bytes": 1 << 30} if ceiling else {}))
    handle = offload_module(model, cfg, budget=VramBudget(256 << 20))
    assert handle.wait_encoded(60)
    return model, handle


@pytest.mark.parametrize("load,ceiling", [("meta", True), ("ram", True), ("meta", False), ("ram", False)],
                         ids=["meta-while-staging", "ram-while-staging", "meta-after-setup", "ram-after-setup"])
def test_a_full_tmpfs_leaves_the_rest_private(small_model, tiny_tmpfs, load, ceiling, caplog):
    path, want = small_model
    model, handle = _offload(path, load, ceiling)
    setup = handle.report().setup
    assert setup.get("publish_units", 0) == (0 if ceiling else worker.BLOCKS)
    second, joined = _offload(path, load, ceiling)
    try:
        with torch.no_grad():
            assert torch.equal(model(worker.inputs()), want)
            assert torch.equal(second(worker.inputs()), want)
        shared = [b.shared for b in handle.report().blocks]
        assert 0 < sum(shared) < worker.BLOCKS, shared
        assert shared == sorted(shared, reverse=True)  # the first blocks, until the room ran out
        assert [b.shared for b in joined.report().blocks] == shared
        assert any("no room for the shared host copy" in r.getMessage() for r in caplog.records)
    finally:
        joined.detach()
        handle.detach()
    assert not list(tiny_tmpfs.iterdir())
    with torch.no_grad():
        assert torch.equal(model(worker.inputs()), want)
