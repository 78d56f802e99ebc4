"""The panel's "plan the download" on the server (issue 43 part 2), in process: POST /layer_offload/plan's work with
"fetch_headers" (nodes/routes.py `handle_post("plan", ...)`). The canvas's API graph names a diffusion model no model
folder holds; the UI workflow sent beside it links it (`properties.models`, as ComfyUI's templates do) on a loopback
server (tests/header_server.py). Without the flag nothing is asked and the model carries its link; with it the server
reads the header by ranges and plans the model as it plans the same file on disk; "cached_headers" plans from the
header cache without a request; a URL outside ComfyUI's download sources is not asked. Skipped unless COMFYUI_PATH
is set."""
from __future__ import annotations

import json
import os
from importlib import import_module

import pytest

from conftest import comfy_available, load_tests_module, skip_reason

if not comfy_available():
    pytest.skip(skip_reason(), allow_module_level=True)

import tiny_wan  # noqa: E402

REMOTE = "lo_remote_tiny_wan.safetensors"
OTHER = "lo_remote_other_wan.safetensors"


def prompt(unet: str) -> dict:
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": {"class_type": "LOTestConditioning", "inputs": {"tokens": 8, "seed": 1}},
        "3": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["2", 0],
                                                     "latent_image": ["3", 0], "seed": 3, "steps": 4, "cfg": 3.5,
                                                     "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
    }


def workflow(unet: str, url: str) -> dict:
    """The UI form the panel sends beside the API graph: the loader's node with its download link."""
    return {"nodes": [{"id": 1, "type": "UNETLoader", "widgets_values": [unet, "default"],
                       "properties": {"models": [{"name": unet, "url": url, "directory": "diffusion_models"}]}}],
            "links": []}


@pytest.fixture(scope="module")
def env(pack, tmp_path_factory):
    served = tmp_path_factory.mktemp("served")
    for name in (REMOTE, OTHER):
        tiny_wan.write_wan(os.path.join(str(served), name))
    servers = load_tests_module("header_server.py")
    old = os.environ.get("LAYER_OFFLOAD_CACHE")
    os.environ["LAYER_OFFLOAD_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    with servers.HeaderServer(served) as server:
        yield {"routes": import_module(pack.__name__ + ".nodes.routes"), "server": server, "served": served}
    if old is None:
        os.environ.pop("LAYER_OFFLOAD_CACHE", None)
    else:
        os.environ["LAYER_OFFLOAD_CACHE"] = old


def post(env, body):
    status, data = env["routes"].handle_post("plan", body)
    assert status == 200 and data["ok"] is True, data
    return data


def model(data, name):
    return next(m for m in data["plan"]["models"] if m["name"] == name)


def comparable(data):
    out = json.loads(json.dumps(data["plan"]))
    for m in out["models"]:
        for key in ("path", "url", "download"):
            m.pop(key)
    out["notes"] = [n for n in out["notes"] if "not downloaded yet" not in n]
    out.pop("downloads")
    out["ram"].pop("free_bytes")
    return out


def test_headers_of_missing_models_are_read_only_when_asked(env, tmp_path):
    server = env["server"]
    url = server.url("files", REMOTE, host="localhost")  # ComfyUI's frontend allows http://localhost: downloads
    body = {"prompt": prompt(REMOTE), "workflow": workflow(REMOTE, url), "card": "rtx3060-12gb"}
    plain = post(env, body)
    m = model(plain, REMOTE)
    assert not m["found"] and m["url"] == url and not server.requests(), m
    fetched = post(env, dict(body, fetch_headers=True))
    m = model(fetched, REMOTE)
    size = os.path.getsize(os.path.join(str(env["served"]), REMOTE))
    assert m["found"] and m["download"] == {"url": url, "bytes": size, "source": "network"}, m
    assert m["family"] == "wan" and m["calls"] == 4 and m["fits"] is True
    assert [r["range"] for r in server.requests()] == ["bytes=0-7", "bytes=8-{}".format(
        7 + int.from_bytes(open(os.path.join(str(env["served"]), REMOTE), "rb").read(8), "little"))]
    assert fetched["plan"]["downloads"][0]["bytes"] == size
    cached = post(env, dict(body, cached_headers=True))
    assert model(cached, REMOTE)["download"]["source"] == "cache" and len(server.requests()) == 2
    # the same file on disk, in a model folder: the same plan
    import folder_paths

    folder = tmp_path / "models"
    folder.mkdir()
    os.link(os.path.join(str(env["served"]), REMOTE), str(folder / REMOTE))
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    local = post(env, body)
    assert model(local, REMOTE)["path"] == str(folder / REMOTE)
    assert comparable(local) == comparable(fetched)


def test_only_comfyui_download_sources_are_asked(env, monkeypatch):
    server = env["server"]
    before = len(server.requests())
    url = server.url("files", OTHER)  # 127.0.0.1: not one of the frontend's download sources
    body = {"prompt": prompt(OTHER), "workflow": workflow(OTHER, url), "fetch_headers": True}
    m = model(post(env, body), OTHER)
    assert not m["found"] and len(server.requests()) == before
    assert any("reads headers only from" in n and "LAYER_OFFLOAD_HEADER_SOURCES" in n for n in m["notes"]), m
    monkeypatch.setenv("LAYER_OFFLOAD_HEADER_SOURCES", "http://127.0.0.1:{}/files/".format(server.port))
    m = model(post(env, body), OTHER)
    assert m["found"] and m["download"]["source"] == "network" and len(server.requests()) == before + 2


@pytest.mark.parametrize("extra,needle", [({"fetch_headers": "yes"}, "fetch_headers must be true or false"),
                                          ({"cached_headers": 1}, "cached_headers must be true or false"),
                                          ({"workflow": [1]}, "workflow must be a JSON object")])
def test_bad_header_requests_answer_400(env, extra, needle):
    status, data = env["routes"].handle_post("plan", dict({"prompt": prompt(REMOTE)}, **extra))
    assert status == 400 and needle in data["error"], data


@pytest.mark.parametrize("url,asked", [
    ("https://huggingface.co/Comfy-Org/x/resolve/main/a.safetensors", True),
    ("https://HuggingFace.co/Comfy-Org/x/resolve/main/a.safetensors", True),
    ("http://localhost:8188/a.safetensors", True),
    ("https://civitai.com/api/download/models/1", True),
    ("http://localhost:80@attacker.example/a.safetensors", False),  # the host is attacker.example
    ("https://huggingface.co@attacker.example/a.safetensors", False),
    ("https://huggingface.co.attacker.example/a.safetensors", False),
    ("http://huggingface.co/Comfy-Org/x/resolve/main/a.safetensors", False),  # another scheme
    ("http://127.0.0.1:8188/a.safetensors", False),
    ("http://localhost:99999/a.safetensors", False),  # no such port: refused, not an exception
])
def test_download_sources_are_matched_by_host_not_by_text(env, url, asked):
    """A URL's host decides, as the request would go: a user part or a longer host name never passes for a source."""
    plan_headers = import_module(env["routes"].__name__.rsplit(".", 1)[0] + ".plan_headers")
    assert (plan_headers.refusal(url) is None) == asked, url
