"""A real ComfyUI server short of RAM (issue 42): its RAM-pressure cache (`--cache-ram` with a headroom larger than
the machine's RAM, so RAM is short after every node) asks for RAM between nodes, through `free_pins` (0.33) or the
cache's own `poll` (0.12). Offload Model after Load Diffusion Model gives it back: between the two samplers of one
prompt its blocks have moved to the disk tier (read by a test node from the patcher, as ComfyUI reads it), and both
samplers' results equal the plain loader's bit for bit. Skipped without COMFYUI_PATH, and on a ComfyUI without a
RAM-pressure cache (0.3.6x: it never asks for RAM).
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

UNET = "lo42_server_wan.safetensors"
HEADROOM_GB = "100000"  # more than any machine has: RAM is short after every node


def has_ram_pressure_cache(comfy_path: str) -> bool:
    for rel in ("comfy/cli_args.py",):
        path = os.path.join(comfy_path, rel)
        if os.path.isfile(path) and "--cache-ram" in open(path, encoding="utf-8").read():
            return True
    return False


def graph(offload: bool) -> Dict[str, Any]:
    """Loader [-> Offload Model] -> KSampler -> RAM read -> KSampler (on the first one's latent) -> RAM read -> hash."""
    model = ["2", 0] if offload else ["1", 0]
    sampler = {"positive": ["3", 0], "negative": ["3", 0], "steps": 2, "cfg": 1.0, "sampler_name": "euler",
               "scheduler": "simple", "denoise": 1.0, "model": model}
    p: Dict[str, Any] = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}},
        "3": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": dict(sampler, seed=1, latent_image=["4", 0])},
        "6": {"class_type": "LOTestModelRam", "inputs": {"model": model, "samples": ["5", 0]}},
        "7": {"class_type": "KSampler", "inputs": dict(sampler, seed=2, latent_image=["6", 0])},
        "8": {"class_type": "LOTestModelRam", "inputs": {"model": model, "samples": ["7", 0]}},
        "9": {"class_type": "LOTestLatentHash", "inputs": {"samples": ["7", 0]}},
    }
    if offload:
        p["2"] = {"class_type": "OffloadModel", "inputs": {"model": ["1", 0], "preset": "budget"}}
    return p


def ram_read(entry: Dict[str, Any], node: str) -> tuple[int, int]:
    text = cs.ui_texts(entry, node)[0]
    m = re.match(r"ram=(-?\d+) total=(-?\d+)", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def test_ram_pressure_between_nodes_moves_blocks_to_disk_and_stays_bitwise(tmp_path_factory):
    comfy_path = os.environ["COMFYUI_PATH"]
    if not has_ram_pressure_cache(comfy_path):
        pytest.skip("this ComfyUI has no RAM-pressure cache (--cache-ram): it never asks for RAM between nodes")
    base = str(tmp_path_factory.mktemp("lo42_server"))
    paths = cs.prepare_base_dir(base)
    # float32: what ComfyUI computes in on the CPU, so the file holds the bytes the model holds; 8 blocks (the disk
    # tier pays for its bounce buffers)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET), seed=0, dtype=torch.float32, num_blocks=8)
    srv = cs.ComfyServer(comfy_path, base, startup_timeout=120)
    srv.extra_args = ["--cache-ram", HEADROOM_GB]
    with srv:
        plain = srv.run_prompt(graph(offload=False), timeout=300)
        offloaded = srv.run_prompt(graph(offload=True), timeout=300)
        again = srv.run_prompt(graph(offload=True), timeout=300)
        log = srv.log_tail(200_000)
    want = cs.ui_texts(plain, "9")
    assert want and cs.ui_texts(offloaded, "9") == want, (cs.ui_texts(offloaded, "9"), want)
    assert cs.ui_texts(again, "9") == want
    for entry in (offloaded, again):
        for node in ("6", "8"):
            resident, total = ram_read(entry, node)
            assert 0 <= resident < total, "after a node, the offloaded model's blocks are on the disk tier: {} {}" \
                .format(node, cs.ui_texts(entry, node))
    assert "to the disk tier" in log, log[-3000:]
