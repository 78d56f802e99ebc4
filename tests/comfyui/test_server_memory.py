"""Host memory across prompts on a real ComfyUI server: 60 prompts that each load an offloaded model anew keep the
server's RSS within 10% of the plain loader doing the same (a dropped offloaded model is freed at once, never two
dead models alive). Linux only (reads /proc/<pid>/status). Skipped without COMFYUI_PATH."""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Dict

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)
if not sys.platform.startswith("linux"):
    pytest.skip("reads /proc/<pid>/status", allow_module_level=True)

import torch  # noqa: E402

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

FILES = ["mem_wan_a.safetensors", "mem_wan_b.safetensors", "mem_wan_c.safetensors"]
PROMPTS = 60


def rss_bytes(pid: int) -> int:
    with open("/proc/{}/status".format(pid)) as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def prompt(loader: Dict[str, Any], seed: int) -> Dict[str, Any]:
    return {
        "1": loader,
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": ["3", 0], "seed": seed, "steps": 2, "cfg": 1.0,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["5", 0]}},
    }


def run_series(tmp_path_factory, offloaded: bool) -> tuple[int, int, int]:
    """(RSS after 10 prompts, RSS after all, model bytes): each prompt loads another file, so a new model."""
    base = str(tmp_path_factory.mktemp("mem_offload" if offloaded else "mem_plain"))
    paths = cs.prepare_base_dir(base)
    for i, name in enumerate(FILES):
        tiny_wan.write_wan(os.path.join(paths["diffusion_models"], name), seed=i, dtype=torch.float32, num_blocks=8)
    size = os.path.getsize(os.path.join(paths["diffusion_models"], FILES[0]))
    with cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600) as srv:
        early = 0
        for i in range(PROMPTS):
            name = FILES[i % len(FILES)]
            loader = ({"class_type": "OffloadDiffusionModelLoader",
                       "inputs": {"unet_name": name, "weight_dtype": "default", "preset": "budget"}} if offloaded else
                      {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}})
            srv.run_prompt(prompt(loader, seed=i), timeout=600)
            if i == 9:
                early = rss_bytes(srv.proc.pid)
        return early, rss_bytes(srv.proc.pid), size


def test_sixty_reloads_keep_rss_within_ten_percent_of_the_plain_loader(tmp_path_factory):
    plain_early, plain_end, size = run_series(tmp_path_factory, offloaded=False)
    off_early, off_end, _ = run_series(tmp_path_factory, offloaded=True)
    mib = 1 << 20
    detail = "offloaded {:.0f} MiB (after 10: {:.0f}), plain {:.0f} MiB (after 10: {:.0f}), model {:.1f} MiB".format(
        off_end / mib, off_early / mib, plain_end / mib, plain_early / mib, size / mib)
    logging.getLogger(__name__).info(detail)  # shown with --log-cli-level=INFO
    assert off_end <= 1.10 * plain_end, detail
    assert off_end - off_early < 10 * size, "RSS keeps growing with every reload: " + detail
