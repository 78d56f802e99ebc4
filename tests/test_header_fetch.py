"""A plan before the download (issue 43 part 2): `plan workflow.json --fetch-headers` reads each missing model's header
from the link the workflow names, by HTTP range requests, and plans it as the same file on disk.

The files are tests/test_workflow_plan.py's header-only files (data a sparse hole) served by a loopback server
(tests/header_server.py): with byte ranges, without (200 and the whole file), behind redirects, stalling, and as a
Hugging Face endpoint (HF_ENDPOINT). The workflow is the repository's Wan 2.1 example with `properties.models` on its
loaders, as ComfyUI's templates carry them.
"""
from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest

from header_server import HeaderServer
from offload.__main__ import main
from offload.predict import plan_workflow
from offload.predict.header_cache import HeaderCache
from offload.predict.header_source import RemoteHeaders
from offload.predict.model_files import read_gguf_infos, read_tensor_infos
from offload.predict.model_links import workflow_links
from test_workflow_plan import BIG, finder, t5_file, wan_file, wan_vae_file, write_gguf, write_safetensors

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "example_workflows" / "wan2.1_t2v_layer_offload.json"
FILES = {"diffusion_models": "wan2.1_t2v_1.3B_fp16.safetensors",
         "text_encoders": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "vae": "wan_2.1_vae.safetensors"}
LOADERS = {"OffloadDiffusionModelLoader": "diffusion_models", "CLIPLoader": "text_encoders", "VAELoader": "vae"}


@pytest.fixture
def served(tmp_path):
    """(server, the models folder it serves, an empty models folder): the example workflow's three files."""
    root = tmp_path / "served"
    wan_file(root / FILES["diffusion_models"], pad_to=BIG)
    t5_file(root / FILES["text_encoders"])
    wan_vae_file(root / FILES["vae"])
    with HeaderServer(root) as server:
        yield server, root, tmp_path / "empty"


def linked(urls: dict[str, str], top_level: bool = False) -> dict:
    """The example workflow with a download link on each loader (or in the top-level `models` list)."""
    wf = json.loads(EXAMPLE.read_text())
    models = []
    for node in wf["nodes"]:
        folder = LOADERS.get(node["type"])
        if folder:
            entry = {"name": FILES[folder], "url": urls[folder], "directory": folder}
            if top_level:
                models.append(entry)
            else:
                node["properties"]["models"] = [entry]
    if top_level:
        wf["models"] = models
    return wf


def on_disk(root: Path) -> dict:
    """The plan of the example with the same files on disk, in ComfyUI's folders."""
    models = root.parent / "models"
    for folder, name in FILES.items():
        (models / folder).mkdir(parents=True, exist_ok=True)
        os.link(root / name, models / folder / name)  # the very files (sparse: a copy would write a terabyte)
    return plan_workflow(json.loads(EXAMPLE.read_text()), finder(models), "rtx3060-12gb", 32 << 30).to_dict()


def fetched(wf: dict, empty: Path, cache: Path, mode: str = "fetch", **kw) -> tuple[dict, RemoteHeaders]:
    remote = RemoteHeaders(workflow_links(wf), mode, HeaderCache(cache), **kw)
    return plan_workflow(wf, finder(empty), "rtx3060-12gb", 32 << 30, remote=remote).to_dict(), remote


def comparable(plan: dict) -> dict:
    """A plan without where its files are (a path or a URL) and the download notes."""
    out = json.loads(json.dumps(plan))
    for m in out["models"]:
        for key in ("path", "url", "download"):
            m.pop(key, None)
    out["notes"] = [n for n in out["notes"] if "not downloaded yet" not in n]
    out.pop("downloads")
    return out


def header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def test_the_plan_from_headers_equals_the_plan_from_disk(served, tmp_path):
    server, root, empty = served
    urls = {"diffusion_models": server.url("files", FILES["diffusion_models"]),
            "text_encoders": server.url("redirect", FILES["text_encoders"]),  # a relative redirect
            "vae": server.url("away", FILES["vae"])}  # to another host name
    plan, remote = fetched(linked(urls), empty, tmp_path / "cache")
    disk = on_disk(root)
    assert comparable(plan) == comparable(disk)
    assert all(m["found"] for m in plan["models"]) and plan["run"]["complete"]
    by_name = {d["name"]: d for d in plan["downloads"]}
    assert set(by_name) == set(FILES.values())
    for name, d in by_name.items():
        size = (root / name).stat().st_size
        assert d["bytes"] == size and d["source"] == "network" and d["error"] is None, d
        assert d["header_bytes_read"] == 8 + header_length(root / name), d  # the header and its length, no more
    # the server sent exactly that: two ranges per file, 8 bytes then the header
    for name in FILES.values():
        kind = next(k for k, v in urls.items() if v.endswith(name))
        ranges = [r["range"] for r in server.requests("files") if r["path"].endswith(name)]
        assert ranges == ["bytes=0-7", f"bytes=8-{7 + header_length(root / name)}"], (kind, ranges)
        assert server.sent["/files/" + name] == 8 + header_length(root / name)
    diffusion = next(m for m in plan["models"] if m["role"] == "diffusion")
    assert diffusion["download"] == {"url": urls["diffusion_models"], "bytes": (root / FILES["diffusion_models"])
                                     .stat().st_size, "source": "network"}
    assert any("GB to download" in n for n in plan["notes"])


def test_top_level_models_list_and_the_cache(served, tmp_path):
    server, root, empty = served
    urls = {k: server.url("files", v) for k, v in FILES.items()}
    wf = linked(urls, top_level=True)
    first, _ = fetched(wf, empty, tmp_path / "cache")
    asked = len(server.requests())
    assert asked == 6 and all(d["source"] == "network" for d in first["downloads"])
    again, _ = fetched(wf, empty, tmp_path / "cache")  # every header from the cache: no request
    assert len(server.requests()) == asked
    assert [d["source"] for d in again["downloads"]] == ["cache"] * 3
    assert comparable(again) == comparable(first)
    cached_only, _ = fetched(wf, empty, tmp_path / "cache", mode="cache")
    assert comparable(cached_only) == comparable(first) and len(server.requests()) == asked
    none, _ = fetched(wf, empty, tmp_path / "other-cache", mode="cache")  # cache only, nothing kept: nothing asked
    assert not any(m["found"] for m in none["models"]) and len(server.requests()) == asked
    links_only, _ = fetched(wf, empty, tmp_path / "cache", mode="links")
    assert [m["url"] for m in links_only["models"]] == [urls[k] for k in ("diffusion_models", "text_encoders", "vae")]
    assert not any(m["found"] for m in links_only["models"]) and len(server.requests()) == asked


def test_a_model_the_workflow_does_not_load_is_not_asked(served, tmp_path):
    """A muted loader's file keeps its link but its header is never read (the plan says it does not load)."""
    server, root, empty = served
    urls = {k: server.url("files", v) for k, v in FILES.items()}
    wf = linked(urls)
    lora = {"id": 99, "type": "LoraLoaderModelOnly", "mode": 2, "inputs": [], "outputs": [], "properties": {
        "models": [{"name": "lo_muted_lora.safetensors", "url": server.url("files", "lo_muted_lora.safetensors"),
                    "directory": "loras"}]}, "widgets_values": ["lo_muted_lora.safetensors", 1.0]}
    wf["nodes"].append(lora)
    plan, _ = fetched(wf, empty, tmp_path / "cache")
    muted = next(m for m in plan["models"] if m["name"] == "lo_muted_lora.safetensors")
    assert muted["runs"] is False and not muted["found"] and muted["download"] is None, muted
    assert not any("lo_muted_lora" in r["path"] for r in server.requests())
    assert sorted(d["name"] for d in plan["downloads"]) == sorted(FILES.values())
    assert all(m["found"] for m in plan["models"] if m["runs"])


def test_a_server_without_ranges_a_stall_and_a_redirect_loop_are_named(served, tmp_path):
    server, root, empty = served
    urls = {"diffusion_models": server.url("norange", FILES["diffusion_models"]),
            "text_encoders": server.url("stall", FILES["text_encoders"]),
            "vae": server.url("loop", FILES["vae"])}
    started = time.monotonic()
    plan, _ = fetched(linked(urls), empty, tmp_path / "cache", timeout=0.5)
    assert time.monotonic() - started < 10
    by_name = {d["name"]: d for d in plan["downloads"]}
    norange = by_name[FILES["diffusion_models"]]
    assert norange["error_kind"] == "no_range" and "does not serve byte ranges" in norange["error"]
    assert norange["header_bytes_read"] == 0 and norange["bytes"] is None  # not one byte of the body was read
    assert by_name[FILES["text_encoders"]]["error_kind"] == "timeout"
    assert by_name[FILES["vae"]]["error_kind"] == "redirects" and "more than 5" in by_name[FILES["vae"]]["error"]
    assert len(server.requests("loop")) == 6
    for m in plan["models"]:
        assert not m["found"] and any("header not read" in n and m["name"] in n for n in m["notes"]), m
    assert not plan["run"]["complete"]
    assert not list((tmp_path / "cache").glob("*.hdr"))  # nothing kept from a failed read


@pytest.mark.parametrize("case,kind", [("huge", "too_large"), ("not-json", "corrupt"), ("past-the-end", "corrupt"),
                                       ("tiny", "corrupt")])
def test_bad_headers_are_refused_by_the_validator(tmp_path, case, kind):
    root = tmp_path / "served"
    root.mkdir()
    f = root / "x.safetensors"
    with open(f, "wb") as fh:
        if case == "huge":  # claims a 200 MB header: refused after its 8 bytes
            fh.write(struct.pack("<Q", 200_000_000))
            fh.truncate(1 << 30)
        elif case == "not-json":
            fh.write(struct.pack("<Q", 8) + b"[1,2,3] ")
        elif case == "past-the-end":
            head = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
            fh.write(struct.pack("<Q", len(head)) + head + b"\0" * 16)
        else:
            fh.write(b"\1\2\3")
    with HeaderServer(root) as server:
        link = {"name": "x.safetensors", "url": server.url("files", "x.safetensors"), "directory": "vae"}
        wf = {"nodes": [{"id": 1, "type": "VAELoader", "widgets_values": ["x.safetensors"],
                         "properties": {"models": [link]}}], "links": []}
        remote = RemoteHeaders(workflow_links(wf), "fetch", HeaderCache(tmp_path / "cache"))
        got = remote.lookup("vae", "x.safetensors")
    assert got.infos is None and got.error_kind == kind, got
    if case == "huge":
        assert got.bytes_read == 8 and "limit" in got.error


def test_gguf_header_by_ranges(tmp_path):
    root = tmp_path / "served"
    shapes = {f"blocks.{i}.ffn.0.weight": (512, 256) for i in range(40)}
    write_gguf(root / "model.gguf", shapes)
    with HeaderServer(root) as server:
        link = {"name": "model.gguf", "url": server.url("files", "model.gguf"), "directory": "diffusion_models"}
        remote = RemoteHeaders([*workflow_links({"models": [link]})], "fetch", HeaderCache(tmp_path / "cache"))
        got = remote.lookup("unet_gguf", "model.gguf")
    assert got.error is None and got.infos == read_gguf_infos(root / "model.gguf")
    assert got.download_bytes == (root / "model.gguf").stat().st_size
    assert got.bytes_read <= 64 << 10  # the first chunk held the whole tensor table
    cached = RemoteHeaders([*workflow_links({"models": [link]})], "cache", HeaderCache(tmp_path / "cache"))
    assert cached.lookup("unet_gguf", "model.gguf").infos == got.infos


def test_hugging_face_urls_go_through_huggingface_hub(tmp_path, monkeypatch):
    """A Hub URL is asked of HF_ENDPOINT (a mirror) with the user's token (HF_TOKEN) and huggingface_hub's user agent;
    the token is not sent on when the Hub redirects to another host (its CDN)."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hf_constants

    # its user agent's agent detection asks the endpoint for a registry once a day: not in a test
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    root = tmp_path / "served"
    wan_vae_file(root / "wan_2.1_vae.safetensors")
    with HeaderServer(root) as server:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}/hf")
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        url = ("https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/"
               "wan_2.1_vae.safetensors?download=true")
        remote = RemoteHeaders(workflow_links({"models": [{"name": "wan_2.1_vae.safetensors", "url": url,
                                                           "directory": "vae"}]}), "fetch", HeaderCache(tmp_path / "c"))
        got = remote.lookup("vae", "wan_2.1_vae.safetensors")
        hub = server.requests("hf")
        cdn = server.requests("files")
    assert got.error is None and got.infos == read_tensor_infos(root / "wan_2.1_vae.safetensors"), got.error
    assert [r["path"] for r in hub] == ["/hf/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/vae/"
                                        "wan_2.1_vae.safetensors"] * 2
    assert all(r["auth"] == "Bearer hf_test_token" and "hf_hub/" in r["agent"] for r in hub)
    assert len(cdn) == 2 and all(r["auth"] is None and r["host"].startswith("localhost") for r in cdn)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    remote = RemoteHeaders(remote.links, "fetch", HeaderCache(tmp_path / "other"))
    assert remote.lookup("vae", "wan_2.1_vae.safetensors").error_kind == "offline"


def test_only_http_redirects_and_a_bounded_count_of_files(served, tmp_path):
    server, root, empty = served
    links = workflow_links({"models": [
        {"name": FILES["vae"], "url": server.url("tofile", "etc/passwd.safetensors"), "directory": "vae"},
        {"name": FILES["text_encoders"], "url": server.url("files", FILES["text_encoders"]),
         "directory": "text_encoders"},
        {"name": FILES["diffusion_models"], "url": server.url("files", FILES["diffusion_models"]),
         "directory": "diffusion_models"}]})
    remote = RemoteHeaders(links, "fetch", HeaderCache(tmp_path / "cache"), max_files=2)
    remote.prepare([("vae", FILES["vae"]), ("text_encoders", FILES["text_encoders"]),
                    ("diffusion_models", FILES["diffusion_models"])])
    vae = remote.lookup("vae", FILES["vae"])
    assert vae.error_kind == "scheme" and "file:///etc/passwd.safetensors is not an http(s) URL" in vae.error
    assert remote.lookup("text_encoders", FILES["text_encoders"]).infos is not None
    over = remote.lookup("diffusion_models", FILES["diffusion_models"])
    assert over.error_kind == "too_many"
    assert not [r for r in server.requests() if r["path"].endswith(FILES["diffusion_models"])]


def test_links_are_read_boundedly(tmp_path):
    wf = {"models": [{"name": "a.safetensors", "url": "ftp://x/a.safetensors", "directory": "vae"},
                     {"name": "b.safetensors", "url": "file:///etc/b.safetensors", "directory": "vae"},
                     {"name": "c.ckpt", "url": "https://example.invalid/c.ckpt", "directory": "checkpoints"},
                     "junk", {"name": 5, "url": "https://x"}],
          "nodes": [{"id": 1, "properties": {"models": [{"name": "d.safetensors", "url": "http://h/d.safetensors",
                                                         "directory": "loras"}]}}],
          "definitions": {"subgraphs": [{"nodes": [{"properties": {"models": [
              {"name": "e.safetensors", "url": "https://h/e.safetensors", "directory": "vae"}]}}]}]}}
    links = workflow_links(wf)
    assert [link.name for link in links] == ["c.ckpt", "d.safetensors", "e.safetensors"]  # http(s) only, subgraphs in
    remote = RemoteHeaders(links, "fetch", HeaderCache(tmp_path / "cache"))
    got = remote.lookup("checkpoints", "c.ckpt")
    assert got.error_kind == "format" and got.infos is None  # never asked: not a header this pack reads


@pytest.mark.parametrize("url,linked", [("https://h/v.safetensors", True), ("file:///etc/v.safetensors", False),
                                        ("javascript:alert(1)", False), ("https://h/" + "x" * 5000, False)],
                         ids=["https", "file", "javascript", "too-long"])
def test_a_loaders_own_link_is_read_as_every_link(url, linked):
    """The workflow reader takes a loader node's `properties.models` link through the same reader as the download
    list (model_links: bounded, http(s) only): a link that list refuses is no loader's url either."""
    from offload.predict.workflow_graph import read_graph

    wf = {"version": 0.4, "links": [], "nodes": [{
        "id": 1, "type": "VAELoader", "mode": 0, "inputs": [], "widgets_values": ["v.safetensors"],
        "outputs": [{"name": "VAE", "type": "VAE", "links": []}],
        "properties": {"models": [{"name": "v.safetensors", "url": url, "directory": "vae"}]}}]}
    ref = read_graph(wf).loaders["1"]
    assert (ref.url, ref.directory) == ((url, "vae") if linked else (None, None))
    assert [link.url for link in workflow_links(wf)] == ([url] if linked else [])


def _entry(cache: Path) -> Path:
    found = list(cache.glob("*.hdr"))
    assert len(found) == 1, found
    return found[0]


def test_the_cache_is_used_only_when_it_is_ours(served, tmp_path):
    server, root, empty = served
    name = FILES["vae"]
    wf = {"models": [{"name": name, "url": server.url("files", name), "directory": "vae"}]}
    cache = tmp_path / "cache"

    def read() -> tuple[str, int]:
        before = len(server.requests())
        got = RemoteHeaders(workflow_links(wf), "fetch", HeaderCache(cache)).lookup("vae", name)
        assert got.infos == read_tensor_infos(root / name)
        return got.source, len(server.requests()) - before

    assert read() == ("network", 2)
    entry = _entry(cache)
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700" and oct(os.stat(entry).st_mode & 0o777) == "0o600"
    assert read() == ("cache", 0)
    os.chmod(entry, 0o644)  # others may read it: not ours in the sense of the rule; ignored, kept, not written over
    assert read() == ("network", 2)
    assert oct(os.stat(entry).st_mode & 0o777) == "0o644"
    os.chmod(entry, 0o600)
    data = entry.read_bytes()
    entry.write_bytes(data + b"x")  # not the size its record gives
    assert read() == ("network", 2)  # ours: refetched and written again
    assert entry.read_bytes() != data + b"x"
    if hasattr(os, "getuid") and os.getuid() == 0:
        os.chown(entry, 12345, 12345)
        assert read() == ("network", 2)
        assert os.stat(entry).st_uid == 12345  # left as it is
        os.chown(entry, 0, 0)
    entry.unlink()
    target = tmp_path / "elsewhere.hdr"
    target.write_bytes(data)
    os.chmod(target, 0o600)
    entry.symlink_to(target)  # a link is never followed
    assert read() == ("network", 2) and entry.is_symlink()
    entry.unlink()
    os.chmod(cache, 0o755)  # a folder others may read: not used at all
    assert read() == ("network", 2) and read() == ("network", 2)
    assert not list(cache.glob("*.hdr"))


def test_cli_fetch_headers(served, tmp_path, capsys):
    server, root, empty = served
    urls = {k: server.url("files", v) for k, v in FILES.items()}
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(linked(urls)))
    args = ["plan", str(wf), "--models-dir", str(empty), "--card", "rtx3060-12gb", "--ram", "32GB"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert not server.requests(), "nothing is asked without --fetch-headers"
    assert "INCOMPLETE" in text and "--fetch-headers plans them" in text
    cache = ["--header-cache", str(tmp_path / "cache")]
    assert main(args + ["--fetch-headers"] + cache) == 0
    text = capsys.readouterr().out
    total = sum((root / n).stat().st_size for n in FILES.values())
    assert f"to download (sizes from the headers; nothing else was downloaded): 3 file(s), {total / 1e9:.2f} GB" \
        in text and "MB (http://" in text  # the text encoder and the VAE: under 1 GB
    assert "INCOMPLETE" not in text and "header from the network" in text
    assert main(args + ["--fetch-headers", "--json"] + cache) == 0
    d = json.loads(capsys.readouterr().out)
    assert [x["source"] for x in d["downloads"]] == ["cache"] * 3 and sum(x["bytes"] for x in d["downloads"]) == total
    assert main(["plan", str(root / FILES["vae"]), "--fetch-headers"]) != 0
    assert "give a workflow .json" in capsys.readouterr().err


def test_comfyuis_own_template_planned_from_the_hub_as_from_disk(tmp_path, monkeypatch, capsys):
    """ComfyUI's own Wan 2.1 text-to-video template (comfyui-workflow-templates-json, as the template browser opens
    it), with the Hugging Face links it carries (`?download=true` and all), planned with `--fetch-headers` against a
    Hub mirror on loopback (HF_ENDPOINT; the Hub redirects to its CDN): the same plan as its files on disk, and only
    each header and its length read."""
    pytest.importorskip("huggingface_hub")
    templates = pytest.importorskip("comfyui_workflow_templates_json")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    template = Path(templates.__file__).parent / "templates" / "text_to_video_wan.json"
    links = workflow_links(json.loads(template.read_text()))
    assert sorted(link.name for link in links) == sorted(FILES.values())
    assert all(link.url.startswith("https://huggingface.co/Comfy-Org/") for link in links)
    root = tmp_path / "served"
    wan_file(root / FILES["diffusion_models"], pad_to=BIG)
    t5_file(root / FILES["text_encoders"])
    wan_vae_file(root / FILES["vae"])
    models = tmp_path / "models"
    for folder, name in FILES.items():
        (models / folder).mkdir(parents=True)
        os.link(root / name, models / folder / name)
    args = ["plan", str(template), "--card", "rtx4070-12gb", "--ram", "32GB", "--json"]
    assert main(args + ["--models-dir", str(models)]) == 0
    disk = json.loads(capsys.readouterr().out)
    with HeaderServer(root) as server:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}/hf")
        assert main(args + ["--models-dir", str(tmp_path / "empty"), "--fetch-headers",
                            "--header-cache", str(tmp_path / "cache")]) == 0
        remote = json.loads(capsys.readouterr().out)
        hub, cdn = server.requests("hf"), server.requests("files")
    assert disk["graph"]["read_whole"] and disk["run"]["complete"]
    assert comparable(remote) == comparable(disk)
    assert {d["name"]: d["bytes"] for d in remote["downloads"]} == {n: (root / n).stat().st_size
                                                                    for n in FILES.values()}
    assert len(hub) == len(cdn) == 6  # per file: the Hub's redirect, then the CDN's two ranges
    for name in FILES.values():
        assert [r["range"] for r in cdn if r["path"].endswith(name)] == [
            "bytes=0-7", f"bytes=8-{7 + header_length(root / name)}"]
