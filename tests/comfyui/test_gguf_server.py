"""End to end with city96's ComfyUI-GGUF: a real ComfyUI server (--cpu) with ComfyUI-GGUF and this pack (under a
hyphenated name) in custom_nodes, tiny Wan 2.1 GGUF files (Q8_0, Q4_0) written with the gguf package.

The loader's MODEL goes straight into a KSampler (the plain branch) and through Offload Model into another; both must
give the plain GGUF result bitwise, with and without a LoRA, whichever branch runs first: plain then offloaded and
offloaded then plain in two prompts (ComfyUI caches the loader's output between them, so the second prompt gets the
very model the first one used), and both in one prompt. Each order uses its own copy of the file, so ComfyUI's cache
never answers for a branch that has not run. Skipped unless COMFYUI_PATH is set, the `gguf` package is importable
and a ComfyUI-GGUF checkout is named by GGUF_PACK / LO_COMFYUI_GGUF.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, List

import pytest

from conftest import comfy_available, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import comfy_server as cs  # noqa: E402

GGUF_DIR = os.environ.get("LO_COMFYUI_GGUF") or os.environ.get("GGUF_PACK") or ""
if importlib.util.find_spec("gguf") is None:
    pytest.skip("the `gguf` package is not importable (GGUF files cannot be written)", allow_module_level=True)
if not os.path.isfile(os.path.join(GGUF_DIR, "nodes.py")):
    pytest.skip("no ComfyUI-GGUF checkout: set GGUF_PACK (or LO_COMFYUI_GGUF) to one", allow_module_level=True)

from families import gguf_wan  # noqa: E402
from families.common import write  # noqa: E402
from families.wan import WAN21  # noqa: E402

QTYPES = ["Q8_0", "Q4_0"]
ORDERS = ["plain-first", "offload-first", "together"]
LORA = "lo_gguf_wan21_lora.safetensors"


def file_name(qtype: str, order: str) -> str:
    return "{}_{}.gguf".format(gguf_wan.file_name(qtype)[:-len(".gguf")], order.replace("-", "_"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("comfy_gguf_base"))
    paths = cs.prepare_base_dir(base)
    os.symlink(os.path.abspath(GGUF_DIR), os.path.join(paths["custom_nodes"], "ComfyUI-GGUF"),
               target_is_directory=True)
    for q in QTYPES:
        for order in ORDERS:
            gguf_wan.write_gguf(gguf_wan.state_dict(), os.path.join(paths["diffusion_models"], file_name(q, order)),
                                main=q)
    write(WAN21.lora(), os.path.join(paths["loras"], LORA))
    srv = cs.ComfyServer(os.environ["COMFYUI_PATH"], base, startup_timeout=600)
    srv.start()
    try:
        info = srv.get_json("/object_info/UnetLoaderGGUF")
        if "UnetLoaderGGUF" not in info:
            pytest.skip("ComfyUI-GGUF did not load in this ComfyUI:\n" + srv.log_tail(3000))
        yield srv
    finally:
        srv.stop()


def branch(p: Dict[str, Any], prefix: str, model: List[Any], lora: bool, offload: bool) -> str:
    """Add [Offload Model] -> [LoRA] -> KSampler -> latent hash fed by `model`; returns the hash node's id."""
    m = model
    if offload:
        p[prefix + "o"] = {"class_type": "OffloadModel", "inputs": {"model": m, "preset": "budget"}}
        m = [prefix + "o", 0]
    if lora:
        p[prefix + "l"] = {"class_type": "LoraLoaderModelOnly",
                           "inputs": {"model": m, "lora_name": LORA, "strength_model": 0.8}}
        m = [prefix + "l", 0]
    p[prefix + "k"] = {"class_type": "KSampler", "inputs": {
        "model": m, "positive": ["c", 0], "negative": ["c", 0], "latent_image": ["e", 0], "seed": 3, "steps": 3,
        "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
    p[prefix + "h"] = {"class_type": "LOTestLatentHash", "inputs": {"samples": [prefix + "k", 0]}}
    return prefix + "h"


def graph(name: str, lora: bool, branches: List[str]) -> Dict[str, Any]:
    """One GGUF loader of file `name` feeding the named branches ("plain", "offload")."""
    p: Dict[str, Any] = {
        "g": {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}},
        "c": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "e": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
    }
    for i, kind in enumerate(branches):
        branch(p, "{}{}".format(i, kind[0]), ["g", 0], lora, offload=kind == "offload")
    return p


def hashes(server: Any, p: Dict[str, Any]) -> Dict[str, str]:
    entry = server.run_prompt(p, timeout=600)
    out = {}
    for node_id in p:
        if p[node_id]["class_type"] == "LOTestLatentHash":
            texts = cs.ui_texts(entry, node_id)
            assert texts and "finite=True" in texts[0], (node_id, texts)
            out[node_id] = texts[0].split()[0]
    return out


_refs: Dict[Any, str] = {}


def one(server: Any, name: str, lora: bool, branches: List[str]) -> List[str]:
    return list(hashes(server, graph(name, lora, branches)).values())


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_loader_then_offload_model_equals_the_gguf_loader(server, qtype, lora):
    ref = one(server, file_name(qtype, "plain-first"), lora, ["plain"])[0]  # the GGUF loader alone
    _refs[(qtype, lora)] = ref
    if lora and (qtype, False) in _refs:
        assert ref != _refs[(qtype, False)], "the LoRA must change the result"
    # plain first, then Offload Model on the loader's cached output
    assert one(server, file_name(qtype, "plain-first"), lora, ["offload"]) == [ref], "offloaded after plain"
    # Offload Model first, then the plain branch on the loader's cached output
    assert one(server, file_name(qtype, "offload-first"), lora, ["offload"]) == [ref], "offloaded first"
    assert one(server, file_name(qtype, "offload-first"), lora, ["plain"]) == [ref], "plain after offloaded"
    # both branches in one prompt, fed by one loader output
    assert one(server, file_name(qtype, "together"), lora, ["offload", "plain"]) == [ref, ref], "one prompt"
