"""Disk tier (DESIGN §2 storage.py, §6): units streamed from the model's safetensors file, models built on the
meta device, and clear errors for truncated or mismatched files."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.models import CASES, TransformerStack, aligned_bytes, run, same_tensor, seeded, snapshot, streaming_budget

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(model, path):
    safetensors_torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)


def _no_hooks(model):
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_disk_tier_streams_exactly(tmp_path, sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    before = snapshot(model)
    path = _save(model, tmp_path / "m.safetensors")
    unit = aligned_bytes(model.blocks[0])
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                                    disk_path=path, ram_budget_bytes=2 * unit))
    tiers = [b.tier for b in handle.report().blocks]
    assert "disk" in tiers, f"RAM budget of two units should leave the rest on disk: {tiers}"
    for _ in range(3):
        assert torch.equal(run(model, x), ref)
    rep = handle.report()
    assert rep.total_bytes_streamed > 0
    handle.detach()
    assert _no_hooks(model)
    sd = model.state_dict()
    for k, v in before.items():
        assert same_tensor(sd[k], v), k
    assert torch.equal(run(model, x), ref)
    # detached weights are ordinary tensors: nothing may still map the file
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # scribble over the tensor data in place (same inode)
        f.seek(size // 4)
        f.write(b"\0" * (size - size // 4))
    assert torch.equal(run(model, x), ref), "detached model still reads its weights from the file"


def test_meta_model_streams_from_its_file(tmp_path, sim_cfg, offload):
    """A model built on the meta device (no weights in RAM) gets its bytes from the file."""
    case = CASES["transformer"]
    real = case.build()
    x = case.inputs()
    ref = run(real, x)
    path = _save(real, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = TransformerStack(dim=64, depth=6, heads=4).eval()
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(real, case.blocks(real), 3), prefetch=2,
                                    disk_path=path))
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
    handle.detach()
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert torch.equal(run(model, x), ref)


def test_truncated_file_is_a_clear_error(tmp_path, sim_cfg, offload):
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    path = _save(model, tmp_path / "m.safetensors")
    data = open(path, "rb").read()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[: len(data) * 2 // 3])
    unit = aligned_bytes(model.blocks[0])
    with pytest.raises(ValueError) as ei:
        offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                               disk_path=str(bad), ram_budget_bytes=2 * unit))
    assert "truncated.safetensors" in str(ei.value), f"error does not name the file: {ei.value}"
    assert _no_hooks(model), "nothing half-loaded may stay attached"
    assert torch.equal(run(model, x), ref)


def test_file_that_does_not_match_the_model(tmp_path, sim_cfg, offload):
    small = seeded(TransformerStack, dim=32, depth=6, heads=4)
    path = _save(small, tmp_path / "other.safetensors")
    with torch.device("meta"):
        model = TransformerStack(dim=64, depth=6, heads=4).eval()
    with pytest.raises(ValueError) as ei:
        offload(model, sim_cfg(prefetch=2, disk_path=path))
        run(model, (torch.randn(2, 3, 64),))
    msg = str(ei.value)
    assert "other.safetensors" in msg or "blocks." in msg, f"unclear mismatch error: {msg}"
    assert _no_hooks(model)


_WRITE_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from safetensors.torch import save_file
    from tests.models import CASES, TransformerStack, aligned_bytes, run, seeded, streaming_budget
    from offload import OffloadConfig, VramBudget, offload_module

    case = CASES["transformer"]
    model = case.build()
    other = seeded(TransformerStack, dim=64, depth=6, heads=4, seed=7)
    x = case.inputs()
    ref_other = run(other, x)
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, {path!r})
    unit = aligned_bytes(model.blocks[0])
    cfg = OffloadConfig(device="sim", vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                        disk_path={path!r}, ram_budget_bytes=2 * unit)
    handle = offload_module(model, cfg, budget=VramBudget(None))
    assert "disk" in [b.tier for b in handle.report().blocks]
    run(model, x)
    try:
        {write}
        out = run(model, x)
    except Exception as err:  # a clear refusal is acceptable
        print("OK-ERROR", type(err).__name__, err)
        sys.exit(0)
    print("OK-EXACT" if torch.equal(out, ref_other) else "WRONG: the write was silently ignored")
""")


@pytest.mark.parametrize("write", [
    "model.load_state_dict(other.state_dict())",
    "[p.data.copy_(q) for p, q in zip(model.parameters(), other.parameters())]; handle.refresh()",
], ids=["load_state_dict", "data_copy"])
def test_in_place_write_to_disk_tier_weights_does_not_crash(write, tmp_path):
    """Between forwards a disk-tier unit's parameters view the file's mapping. Writing them in place
    (load_state_dict, a patcher) must either take effect or raise a clear error; it must never kill the
    process (a write into a read-only mmap is a SIGSEGV). Run in a child process so a crash is a failure,
    not the end of the test session."""
    script = tmp_path / "child.py"
    script.write_text(_WRITE_CHILD.format(root=ROOT, path=str(tmp_path / "m.safetensors"),
                                          write=f"with torch.no_grad(): {write}"))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-1500:]
    assert proc.returncode == 0, f"child died with return code {proc.returncode} (negative = signal):\n{tail}"
    assert "OK-" in proc.stdout, tail


def test_disk_tier_with_complex_and_bool_tensors(tmp_path, sim_cfg, offload):
    """safetensors stores complex64 ('C64') and bool tensors (rotary tables, masks); a valid file holding them
    must stream from disk exactly, not be reported as corrupt."""
    case = CASES["rope_complex"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    path = _save(model, tmp_path / "rope.safetensors")
    unit = aligned_bytes(model.blocks[0])
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 2), prefetch=1,
                                    disk_path=path, ram_budget_bytes=unit))
    assert "disk" in [b.tier for b in handle.report().blocks]
    for _ in range(2):
        assert torch.equal(run(model, x), ref)


def test_disk_tier_reads_a_prefixed_checkpoint(tmp_path, sim_cfg, offload):
    """ComfyUI checkpoints hold the diffusion model under `model.diffusion_model.` next to other models'
    weights: the file's key prefix is found and the unrelated tensors are ignored."""
    case = CASES["transformer"]
    model = case.build()
    x = case.inputs()
    ref = run(model, x)
    tensors = {f"model.diffusion_model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    tensors["first_stage_model.decoder.conv_in.weight"] = torch.randn(8, 4, 3, 3)
    tensors["cond_stage_model.transformer.embeddings.weight"] = torch.randn(10, 64)
    path = str(tmp_path / "checkpoint.safetensors")
    safetensors_torch.save_file(tensors, path)
    unit = aligned_bytes(model.blocks[0])
    handle = offload(model, sim_cfg(vram_budget_bytes=streaming_budget(model, case.blocks(model), 3), prefetch=2,
                                    disk_path=path, ram_budget_bytes=2 * unit))
    assert "disk" in [b.tier for b in handle.report().blocks]
    for _ in range(2):
        assert torch.equal(run(model, x), ref)
