"""Wan 2.2's two experts on a real ComfyUI server (--cpu), as a new user wires them (issue 26): two Offload Loaders at
the default preset and priority, one VRAM Budget with room for one expert, KSamplerAdvanced steps 0-3 on the
high-noise expert and 3-6 on the low-noise one. Each expert must stream at most a quarter of its block bytes while it
samples (it holds its blocks: the model ComfyUI loads for a sampler leads the budget), in every run, and the latent
must equal the same graph with UNETLoader. Before issue 26 the expert loaded second streamed every block in every run.

The experts are tiny Wan 2.1-shaped models (tests/comfyui/tiny_wan.py; 12 blocks, float32 so the budget node's 8 MB
floor leaves room for one expert only). Skipped unless COMFYUI_PATH is set.
"""
from __future__ import annotations

import os
from typing import Any, Dict

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

HIGH, LOW = "wan22_high_noise.safetensors", "wan22_low_noise.safetensors"
BLOCKS = 12
RUNS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_two_experts"))
    paths = cs.prepare_base_dir(base)
    for name, seed in ((HIGH, 21), (LOW, 22)):
        tiny_wan.write_wan(os.path.join(paths["diffusion_models"], name), seed=seed, dtype=torch.float32,
                           num_blocks=BLOCKS)
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.expert_bytes = os.path.getsize(os.path.join(paths["diffusion_models"], HIGH))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def two_expert_prompt(high: Dict[str, Any], low: Dict[str, Any], seed: int) -> Dict[str, Any]:
    """Wan 2.2's sampling: the high-noise expert for steps 0-3 (leftover noise kept), the low-noise one for 3-6."""
    return {
        "1": high,
        "2": low,
        "3": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "4": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": {"class_type": "KSamplerAdvanced",
              "inputs": {"model": ["1", 0], "add_noise": "enable", "noise_seed": seed, "steps": 6, "cfg": 1.0,
                         "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0], "negative": ["3", 0],
                         "latent_image": ["4", 0], "start_at_step": 0, "end_at_step": 3,
                         "return_with_leftover_noise": "enable"}},
        "6": {"class_type": "KSamplerAdvanced",
              "inputs": {"model": ["2", 0], "add_noise": "disable", "noise_seed": seed, "steps": 6, "cfg": 1.0,
                         "sampler_name": "euler", "scheduler": "simple", "positive": ["3", 0], "negative": ["3", 0],
                         "latent_image": ["5", 0], "start_at_step": 3, "end_at_step": 10000,
                         "return_with_leftover_noise": "disable"}},
        "7": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["6", 0]}},
    }


def unet(name: str) -> Dict[str, Any]:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def offload(name: str) -> Dict[str, Any]:
    """An Offload Loader as a new user leaves it: the default preset and priority, the budget linked."""
    return {"class_type": "OffloadDiffusionModelLoader",
            "inputs": {"unet_name": name, "weight_dtype": "default", "preset": "auto", "budget": ["8", 0]}}


def latent_hash(server: cs.ComfyServer, p: Dict[str, Any]) -> str:
    entry = server.run_prompt(p, timeout=600)
    texts = cs.ui_texts(entry, "7")
    assert texts and "finite=True" in texts[0], entry.get("outputs")
    return texts[0].split()[0]


def test_each_expert_holds_its_blocks_while_it_samples_in_every_run(server):
    budget_gb = server.expert_bytes * 1.02 / (1 << 30)  # room for one expert, not two
    for run in range(RUNS):
        seed = 40 + run
        ref = latent_hash(server, two_expert_prompt(unet(HIGH), unet(LOW), seed))
        p = two_expert_prompt(offload(HIGH), offload(LOW), seed)
        p["8"] = {"class_type": "OffloadVramBudget", "inputs": {"budget_gb": budget_gb, "preset": "auto"}}
        assert latent_hash(server, p) == ref, f"run {run}: the offloaded experts changed the latent"
        # each expert's report covers the sampling its load served (the patcher's load resets it) and nothing after
        models = {m["name"]: m for m in server.get_json("/layer_offload/report")["models"]}
        assert {HIGH, LOW} <= set(models), sorted(models)
        for name in (HIGH, LOW):
            m = models[name]
            block_bytes = sum(b["bytes"] for b in m["blocks"])
            assert len(m["blocks"]) == BLOCKS and m["forwards"] >= 3, (name, len(m["blocks"]), m["forwards"])
            assert m["total_bytes_streamed"] <= block_bytes / 4, (
                f"run {run}: {name} streamed {m['total_bytes_streamed']} bytes while it sampled, more than a quarter "
                f"of its {block_bytes} block bytes ({m['forwards']} forwards); {m.get('budget_reason')}")
        budget = server.get_json("/layer_offload/report")["budget"]
        assert budget["used_bytes"] <= budget["total_bytes"] < 2 * server.expert_bytes
