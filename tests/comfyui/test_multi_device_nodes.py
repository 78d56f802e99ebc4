"""One model across two devices from the nodes (issue 21), in process (CPU mode, simulated devices sim:0 and sim:1).

The Offload nodes' `devices` input and the VRAM Budget node's `per_device` totals: a tiny Wan model too large for
the compute device's budget keeps blocks resident on both devices, samples bitwise like the plain loader, and the
report (and the budget part of it the panel draws) names both devices. Bad text is a clear error that changes
nothing. The process-wide budgets are restored at the end. Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import gc
import os
from importlib import import_module

import pytest

from conftest import comfy_available, node_classes, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import tiny_wan  # noqa: E402

UNET = "lo_multi_device_tiny_wan.safetensors"  # the report name of this module's model
NUM_BLOCKS = 40  # large enough that half the blocks are over the budget floor (8 MB)
MIB = 1 << 20
GIB = 1 << 30
ENV = "LAYER_OFFLOAD_SIM_DEVICES"


def sample(model, seed: int = 3, steps: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    cond = [[torch.randn(1, 8, 4096, generator=g) * 0.1, {}]]
    latent = torch.zeros(1, 16, 1, 8, 8)
    import comfy.sample

    with torch.inference_mode():
        noise = comfy.sample.prepare_noise(latent, seed)
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, latent,
                                   disable_pbar=True, seed=seed)


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    import folder_paths
    import nodes

    d = str(tmp_path_factory.mktemp("multi_device_models"))
    tiny_wan.write_wan(os.path.join(d, UNET), num_blocks=NUM_BLOCKS)
    folder_paths.add_model_folder_path("diffusion_models", d)
    offload = import_module(pack.__name__ + ".offload")
    budget, second = offload.default_budget(), offload.default_budget("sim:1")
    saved = [(b, b.total_bytes, b.origin, b.auto_sized) for b in (budget, second)]
    old_env = os.environ.get(ENV)
    os.environ[ENV] = "2"
    try:
        yield {"pack": pack, "nodes": nodes, "M": node_classes(pack), "offload": offload,
               "common": import_module(pack.__name__ + ".nodes.common"),
               "status": import_module(pack.__name__ + ".nodes.status")}
    finally:
        if old_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old_env
        gc.collect()
        for b, total, origin, auto in saved:
            if total is not None and b.total_bytes != total:
                b.set_total(total, origin=origin)
            b.origin, b.auto_sized = origin, auto


def test_devices_text_resolves_to_engine_names(env, monkeypatch):
    resolve = env["common"].resolve_devices
    assert resolve("", "sim") is None and resolve("  ", "sim") is None  # the default: one device, as always
    assert resolve("auto", "sim") == ["sim:0", "sim:1"]
    assert resolve("sim:1, sim:0", "sim") == ["sim:0", "sim:1"], "the compute device always comes first"
    assert resolve("sim", "sim") is None, "the compute device alone is one device"
    monkeypatch.setenv(ENV, "1")
    assert resolve("auto", "sim") is None, "auto with one visible device is one device"


def test_devices_this_process_lacks_are_left_out_with_one_notice(env, caplog):
    """ComfyUI-Distributed sends the master's workflow to every worker: a device named there that a worker lacks is
    left out (one log notice per text, not per call) instead of failing the worker's prompt."""
    resolve = env["common"].resolve_devices
    with caplog.at_level("WARNING", logger="layer_offload"):
        assert resolve("sim:0, sim:7", "sim") is None, "sim:7 left out: the compute device alone"
        assert resolve("sim:0, sim:7", "sim") is None
        assert resolve("sim:0, sim:1, sim:3", "sim") == ["sim:0", "sim:1"]
        assert resolve("cuda:0, cuda:1", "sim") is None, "a GPU list on a CPU worker: the compute device only"
        assert resolve("sim:5", "sim") is None
    notes = [r.getMessage() for r in caplog.records if "does not have" in r.getMessage()]
    assert len(notes) == 4, notes  # one per text: the repeated 'sim:0, sim:7' logged once
    assert "sim:7" in notes[0] and "it has sim:0, sim:1" in notes[0] and "left out" in notes[0], notes[0]
    before = len(env["status"].build_report()["models"])
    model = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "auto", None, 0, "cuda:0, cuda:1")[0]
    assert len(env["status"].build_report()["models"]) == before + 1, "the prompt runs on this process's device"
    assert model.model.diffusion_model.__dict__["_layer_offload"].handle.config.devices in (None, (), ("sim:0",))
    del model
    gc.collect()


@pytest.mark.parametrize("text,needle", [
    ("sim:0, gpu7", "'gpu7' is not a device name; valid devices: sim:0, sim:1"),
    ("sim:0, cuda:x", "'cuda:x' is not a device name"),
    ("sim:1", "must include the compute device"),
    ("sim:0, sim:0, sim:1", "twice"),
], ids=["malformed", "malformed-index", "no-compute", "twice"])
def test_bad_devices_text_is_a_clear_error(env, text, needle):
    plain = env["nodes"].UNETLoader().load_unet(UNET, "default")[0]
    before = len(env["status"].build_report()["models"])
    with pytest.raises(ValueError) as e:
        env["M"]["OffloadModel"]().apply(plain, "auto", None, 0, text)
    assert "devices" in str(e.value) and needle in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="devices"):
        env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "auto", None, 0, text)
    assert len(env["status"].build_report()["models"]) == before, "nothing was offloaded"


@pytest.mark.parametrize("text,needle", [
    ("sim:1=lots", "not a number of GB"),
    ("sim:1", "not 'device=size'"),
    ("sim:0=1", "compute device"),
    ("sim:x=1GB", "not a device name; valid devices other than the compute device (sim:0): sim:1"),
    ("sim:5=lots", "not a number of GB"),
    ("sim:1=1000GB", "larger than the device"),
    ("sim:1=1MB", "below the minimum"),
    ("sim:1=1, sim:1=2", "twice"),
    ("sim:1=" + "9" * 400, "not a number of GB"),  # was an OverflowError (issue 35)
    ("sim:1=" + "9" * 400 + "%", "not a number of GB"),
], ids=["not-a-number", "no-size", "compute", "malformed", "absent-bad-size", "over-device", "tiny", "twice",
          "400-nines", "400-nines-pct"])
def test_bad_per_device_text_is_a_clear_error_and_changes_nothing(env, text, needle):
    budget = env["offload"].default_budget()
    second = env["offload"].default_budget("sim:1")
    before = (budget.total_bytes, second.total_bytes)
    with pytest.raises(ValueError) as e:  # BudgetError is a ValueError
        env["M"]["OffloadVramBudget"]().set_budget(1.0, "budget", text)
    assert "per_device" in str(e.value) and needle in str(e.value), str(e.value)
    assert (budget.total_bytes, second.total_bytes) == before


def test_per_device_naming_a_device_this_process_lacks_leaves_it_out(env, caplog):
    second = env["offload"].default_budget("sim:1")
    with caplog.at_level("WARNING", logger="layer_offload"):
        spec = env["M"]["OffloadVramBudget"]().set_budget(1.0, "budget", "sim:1=20MB, sim:5=2GB, cuda:3=50%")[0]
    assert spec.per_device == {"sim:1": 20 * MIB} and second.total_bytes == 20 * MIB
    notes = [r.getMessage() for r in caplog.records if "does not have" in r.getMessage()]
    assert len(notes) == 1 and "sim:5, cuda:3" in notes[0] and "per_device" in notes[0], notes


@pytest.mark.parametrize("share,capacity_gib", [("50%", 8), ("12.5 %", 8), ("100%", 8)])
def test_budget_share_is_a_share_of_this_process_card(env, share, capacity_gib):
    spec = env["M"]["OffloadVramBudget"]().set_budget(0.0, "auto", "", share)[0]
    want = int(capacity_gib * GIB * float(share.replace("%", "")) / 100)
    assert spec.total_bytes == want == env["offload"].default_budget().total_bytes
    assert "budget_share" in env["offload"].default_budget().origin


@pytest.mark.parametrize("gb,share,needle", [
    (0.0, "50", "a share of the card such as '50%'"),
    (0.0, "4GB", "for GB use budget_gb"),
    (0.0, "0%", "above 0%"),
    (0.0, "150%", "at most 100%"),
    (2.0, "50%", "both set"),
    (100.0, "", "budget_share (e.g. '50%'"),
], ids=["no-percent", "gb", "zero", "over", "both", "gb-over-card-hints-share"])
def test_bad_budget_share_is_a_clear_error_and_changes_nothing(env, gb, share, needle):
    budget = env["offload"].default_budget()
    before = budget.total_bytes
    with pytest.raises(ValueError) as e:
        env["M"]["OffloadVramBudget"]().set_budget(gb, "auto", "", share)
    assert needle in str(e.value), str(e.value)
    assert budget.total_bytes == before


def test_two_devices_sample_like_the_plain_loader_with_blocks_on_each(env):
    plain = env["nodes"].UNETLoader().load_unet(UNET, "default")[0]
    ref = sample(plain)
    dm = plain.model.diffusion_model
    blk = sum(t.numel() * t.element_size() for t in dm.blocks[0].parameters())
    total = sum(t.numel() * t.element_size() for t in dm.parameters())
    rest = total - NUM_BLOCKS * blk
    del plain, dm
    gc.collect()
    # the compute device holds the non-block weights and about half the blocks, sim:1 the other half and more
    compute_bytes = max(rest + (NUM_BLOCKS // 2) * (blk + 4096) + MIB, 9 * MIB)
    second_bytes = max(NUM_BLOCKS * (blk + 4096) - compute_bytes + rest + 2 * MIB, 9 * MIB)
    env["M"]["OffloadVramBudget"]().set_budget(compute_bytes / GIB, "auto", "sim:1={:.3f}MB".format(second_bytes / MIB))
    assert env["offload"].default_budget("sim:1").total_bytes == int(round(second_bytes / MIB, 3) * MIB)
    # unlinked: the budgets the node set stay in force (a linked spec would re-apply itself at each load)
    model = env["M"]["OffloadDiffusionModelLoader"]().load(UNET, "default", "auto", None, 0, "sim:0, sim:1")[0]
    for _ in range(2):
        assert torch.equal(ref, sample(model)), "two devices changed the output"
    handle = model.model.diffusion_model.__dict__["_layer_offload"].handle
    assert handle.config.devices == ("sim:0", "sim:1")
    data = env["status"].build_report()
    m = [x for x in data["models"] if x["name"] == UNET][0]
    assert list(m["devices"]) == ["sim:0", "sim:1"], m["devices"]
    on = {d: sum(1 for b in m["blocks"] if b["device"] == d and b["tier"] == "vram") for d in m["devices"]}
    assert on["sim:0"] > 0 and on["sim:1"] > 0, on
    for d in ("sim:0", "sim:1"):
        assert m["devices"][d]["resident_blocks"] == on[d] and m["devices"][d]["device_bytes"] > 0
    assert m["devices"]["sim:1"]["activation_bytes"] > 0, "activations hop to sim:1 and back"
    assert m["devices"]["sim:1"]["peak_device_bytes"] <= second_bytes
    devs = data["budget"]["devices"]
    assert devs["sim:0"]["compute"] is True and devs["sim:1"]["compute"] is False
    assert devs["sim:1"]["total_bytes"] == env["offload"].default_budget("sim:1").total_bytes
    assert 0 < devs["sim:1"]["used_bytes"] <= devs["sim:1"]["total_bytes"]
    assert devs["sim:0"]["total_bytes"] == data["budget"]["total_bytes"]
    # setting sim:1 to zero gives its blocks back at the next run (they stream); the output stays the same
    env["M"]["OffloadVramBudget"]().set_budget(compute_bytes / GIB, "auto", "sim:1=0")
    assert torch.equal(ref, sample(model))
    m = [x for x in env["status"].build_report()["models"] if x["name"] == UNET][0]
    assert m["devices"]["sim:1"]["resident_blocks"] == 0
    assert not [b for b in m["blocks"] if b["device"] == "sim:1"]
    del model, handle
    gc.collect()
