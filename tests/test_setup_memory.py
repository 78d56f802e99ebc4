"""Offloading (and detaching) a model holds each weight once: peak host RAM rises by about one unit, not by the
model (DESIGN §4.1). Measured on Linux in a fresh child process: VmHWM reset through /proc/self/clear_refs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                                reason="needs Linux /proc/self/status VmHWM and a writable /proc/self/clear_refs")

CHILD = textwrap.dedent("""
    import gc, json, sys
    import torch
    sys.path.insert(0, {root!r})
    from offload import OffloadConfig, VramBudget, offload_module
    from offload.demo.reference_models import TransformerStack

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    torch.manual_seed(0)
    model = TransformerStack(dim={dim}, depth={depth}).eval()
    x = torch.randn(1, 4, {dim})
    with torch.no_grad():
        ref = model(x)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    gc.collect()
    reset_peak()
    before = status("VmRSS")
    handle = offload_module(model, OffloadConfig.from_preset("{preset}", device="sim"), budget=VramBudget(None))
    setup_peak = status("VmHWM") - before
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    gc.collect()
    reset_peak()
    before = status("VmRSS")
    handle.detach()
    detach_peak = status("VmHWM") - before
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    print(json.dumps(dict(size=size, unit=unit, setup_peak=setup_peak, detach_peak=detach_peak)))
""")


@pytest.mark.parametrize("preset", ["budget", "auto"])
def test_offloading_raises_peak_host_ram_by_about_one_unit(preset):
    # 16 units of 12 MiB (194 MiB): units above glibc's mmap threshold behaviour, small enough for CI
    script = CHILD.format(root=ROOT, dim=512, depth=16, preset=preset)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    limit = 2 * r["unit"] + 4 * mib  # "about two units": one unit in flight, plus allocator slack
    assert r["setup_peak"] <= limit, (
        f"offloading a {r['size'] / mib:.0f} MiB model raised peak RSS by {r['setup_peak'] / mib:.1f} MiB; "
        f"a unit is {r['unit'] / mib:.1f} MiB, so at most {limit / mib:.1f} MiB was expected")
    assert r["detach_peak"] <= limit, (
        f"detaching raised peak RSS by {r['detach_peak'] / mib:.1f} MiB (limit {limit / mib:.1f} MiB)")
