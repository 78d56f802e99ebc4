"""ComfyUI's Train LoRA node through a real server graph (issue 25): EmptyHunyuanLatentVideo (64x64, length 1,
batch 2) and a stand-in text conditioning -> TrainLoraNode (4 steps, batch 1, AdamW lr 1e-3, rank 4, seed 3, fp32
training and LoRA, no existing LoRA) -> Save LoRA, on a Wan 2.1-shaped fp32 model (dim 128, ffn 256, 4 blocks). The
LoRA trained on an Offload Loader model is the plain UNETLoader's bit for bit, with gradient checkpointing on and off,
whichever loader runs first. The in-process test (test_train_lora.py) runs the node on its own; this one runs it as
the server does (loaders under inference mode, cached outputs, the executor's order).

Skipped unless COMFYUI_PATH points at a ComfyUI checkout that has the node.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import comfy_server as cs  # noqa: E402
import tiny_wan  # noqa: E402

UNET = "lo_train_server_wan_fp32.safetensors"
TRAIN = {"batch_size": 1, "grad_accumulation_steps": 1, "steps": 4, "learning_rate": 0.001, "rank": 4,
         "optimizer": "AdamW", "loss_function": "MSE", "seed": 3, "training_dtype": "fp32", "lora_dtype": "fp32",
         "algorithm": "LoRA", "existing_lora": "[None]"}


# ComfyUI 0.12+ runs Wan's rope through comfy_kitchen's `apply_rope1`, which has no autograd formula on the CPU: Train
# LoRA fails there on the plain loader too. The server uses ComfyUI's own pure-torch rope instead (its fallback without
# comfy_kitchen), as test_train_lora.py does in-process; installed as a custom node of the test server only.
TORCH_ROPE_NODE = """
import importlib


def apply_rope1(x, freqs_cis):
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


for _name in ("comfy.ldm.flux.math", "comfy.ldm.wan.model"):
    try:
        _module = importlib.import_module(_name)
    except ImportError:
        continue
    _current = getattr(_module, "apply_rope1", None)
    if _current is not None and "kitchen" in repr(_current).lower() + str(getattr(_current, "__module__", "")):
        _module.apply_rope1 = apply_rope1

NODE_CLASS_MAPPINGS = {}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_train_base"))
    paths = cs.prepare_base_dir(base)
    rope = os.path.join(paths["custom_nodes"], "lo_test_torch_rope")
    os.makedirs(rope, exist_ok=True)
    with open(os.path.join(rope, "__init__.py"), "w") as f:
        f.write(TORCH_ROPE_NODE)
    tiny_wan.write_wan(os.path.join(paths["diffusion_models"], UNET), dtype=torch.float32)
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    try:
        info = srv.get_json("/object_info")
        if "TrainLoraNode" not in info:
            pytest.skip("this ComfyUI has no Train LoRA node")
        srv.info = info
        srv.output_dir = paths["output"]
        yield srv
    finally:
        srv.stop()


def _default(spec: Any) -> Any:
    """A required input's default value as /object_info describes it (V1 or V3 form)."""
    kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if "default" in opts:
        return opts["default"]
    if isinstance(kind, list):
        return kind[0]
    if kind == "COMBO":
        return opts["options"][0]
    raise AssertionError("no default for {}".format(spec))


def _save_node(info: Dict[str, Any]) -> str:
    return "SaveLoRANode" if "SaveLoRANode" in info else "SaveLoRA"


def train_prompt(info: Dict[str, Any], offload: bool, checkpointing: bool, prefix: str,
                 priority: int = 0) -> Dict[str, Any]:
    node = info["TrainLoraNode"]
    values = dict(TRAIN, gradient_checkpointing=checkpointing)
    inputs: Dict[str, Any] = {"model": ["1", 0], "latents": ["3", 0], "positive": ["2", 0]}
    for name, spec in node["input"]["required"].items():
        if name not in inputs:
            inputs[name] = values[name] if name in values else _default(spec)
    for name in ("existing_lora", "gradient_checkpointing"):  # optional in some versions
        if name in node["input"].get("optional", {}):
            inputs[name] = values[name]
    lora_out = list(node["output"]).index("LORA_MODEL")
    loader = ({"class_type": "OffloadDiffusionModelLoader",
               "inputs": {"unet_name": UNET, "weight_dtype": "default", "preset": "budget", "priority": priority}}
              if offload else {"class_type": "UNETLoader", "inputs": {"unet_name": UNET, "weight_dtype": "default"}})
    return {
        "1": loader,
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 2}},
        "4": {"class_type": "TrainLoraNode", "inputs": inputs},
        "5": {"class_type": _save_node(info), "inputs": {"lora": ["4", lora_out], "prefix": prefix}},
    }


def trained_lora(server, offload: bool, checkpointing: bool, tag: str, priority: int = 0) -> Dict[str, torch.Tensor]:
    """Run the graph and read the saved LoRA (a loader input that differs from an earlier prompt's makes ComfyUI run
    the loader and the training again instead of reusing its cached outputs)."""
    prefix = "loras/lo_train_{}".format(tag)
    server.run_prompt(train_prompt(server.info, offload, checkpointing, prefix, priority), timeout=600)
    files = glob.glob(os.path.join(server.output_dir, "loras", "lo_train_{}_*.safetensors".format(tag)))
    assert len(files) == 1, files
    return load_file(files[0])


def assert_same(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> None:
    assert sorted(ref) == sorted(got) and ref
    differ = {k: float((ref[k].float() - got[k].float()).abs().max()) for k in ref if not torch.equal(ref[k], got[k])}
    assert not differ, "{} of {} LoRA tensors differ, largest {}".format(
        len(differ), len(ref), sorted(differ.items(), key=lambda kv: -kv[1])[:3])


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_train_lora_server_graph_offloaded_equals_plain(server, checkpointing):
    """Offloaded first, then plain, then offloaded again: every saved LoRA is the plain loader's bit for bit.

    The node draws its LoRA's initial values (lora_up: kaiming-uniform, about 0.5 in size) from torch's global
    generator before it seeds anything, so a run starts where the previous prompt left that generator, and the first
    prompt of a server starts from a state that differs from one server process to the next (two fresh servers
    training the plain loader give LoRAs 0.99 apart): a warm-up training run comes first. Every later run must then
    leave the generator exactly as the plain loader's run does, or the next LoRA would start from other values: the
    offloaded runs sit before and after the plain one."""
    tag = "ckpt" if checkpointing else "nockpt"
    trained_lora(server, False, checkpointing, tag + "_warmup", priority=0)
    first = trained_lora(server, True, checkpointing, tag + "_off1")
    plain = trained_lora(server, False, checkpointing, tag + "_plain")
    again = trained_lora(server, True, checkpointing, tag + "_off2", priority=1)
    assert any(v.abs().max() > 0 for v in plain.values()), "nothing was trained"
    assert_same(plain, first)
    assert_same(plain, again)
