"""The workflow plan (`offload.predict.plan_workflow`, `python -m offload plan workflow.json`): every example
workflow, two experts (Wan 2.2), a GGUF loader, a LoRA chain; headers only.

Model files are header-only safetensors / GGUF files whose data is a sparse hole (`truncate`): a file claiming
tens of GB costs nothing to write, and reading past its header would take far longer than the test allows. The
GGUF header is written here per the GGUF spec (magic, version 3, counts, key/values, tensor infos) since `gguf`
is not a dependency. The Wan keys are tests/comfyui/tiny_wan.py's (ComfyUI's layout).
"""
from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import psutil
import pytest

from offload.__main__ import main
from offload.predict import plan_workflow
from offload.predict.model_files import read_tensor_infos
from offload.predict.model_files import TensorInfo
from offload.predict.published import ROWS, flux_shapes, predict_row, shapes_for, wan_shapes
from offload.predict.workflow_graph import read_graph, to_api

sys.path.insert(0, str(Path(__file__).parent / "comfyui"))
import tiny_wan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "example_workflows").glob("*.json"))
BIG = 1 << 40  # a terabyte of hole after the big files' headers: reading past a header would take minutes


def _bytes_read() -> int | None:
    """Bytes this process has read through read calls so far (Linux: /proc's rchar), or None where unknown."""
    try:
        return psutil.Process().io_counters().read_chars
    except (AttributeError, psutil.Error):
        return None


def write_safetensors(path: Path, shapes: dict[str, tuple], dtype: str = "BF16", pad_to: int = 0) -> Path:
    """A valid .safetensors file of these tensors whose data is a hole (only the header is written)."""
    size = {"BF16": 2, "F16": 2, "F8_E4M3": 1, "F32": 4}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = size * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(8 + len(raw) + max(offset, pad_to))
    return path


def _gguf_string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, shapes: dict[str, tuple], ggml_type: int = 12) -> Path:
    """A GGUF v3 file (ComfyUI-GGUF's layout: tensors named as in the safetensors file, shapes in ggml order) with
    one string key/value and these tensors as Q4_K (type 12: 144 bytes per 256 weights); data a hole."""
    kv = _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string("wan")
    infos, offset = b"", 0
    for name, shape in shapes.items():
        gtype = ggml_type if len(shape) >= 2 and math.prod(shape) % 256 == 0 else 0  # small / odd tensors in F32
        dims = tuple(reversed(shape))
        infos += _gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", gtype, offset)
        offset += math.prod(shape) * 144 // 256 if gtype == 12 else math.prod(shape) * 4
        offset += -offset % 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), 1) + kv + infos
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + (-len(head) % 32) + offset)
    return path


def wan_file(path: Path, dim: int = tiny_wan.DIM, blocks: int = 4, in_dim: int = 16, pad_to: int = 0) -> Path:
    shapes = {"model.diffusion_model." + k: v for k, v in tiny_wan.wan_shapes(blocks).items()}
    if in_dim != 16:
        shapes["model.diffusion_model.patch_embedding.weight"] = (dim, in_dim, 1, 2, 2)
    return write_safetensors(path, shapes, pad_to=pad_to)


def t5_file(path: Path) -> Path:
    s = {"shared.weight": (1000, 64)}
    for i in range(3):
        for x in "qkvo":
            s[f"encoder.block.{i}.layer.0.SelfAttention.{x}.weight"] = (64, 64)
        s[f"encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight"] = (128, 64)
        s[f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight"] = (64, 128)
    return write_safetensors(path, s, "F8_E4M3")


def wan_vae_file(path: Path) -> Path:
    return write_safetensors(path, {"decoder.middle.0.residual.0.gamma": (384, 1, 1, 1),
                                    "decoder.head.0.gamma": (96, 1, 1, 1), "encoder.conv1.weight": (96, 3, 3, 3, 3),
                                    "decoder.conv1.weight": (384, 16, 3, 3, 3),
                                    "decoder.head.2.weight": (3, 96, 3, 3, 3)})


def lora_file(path: Path) -> Path:
    s = {}
    for i in range(4):
        s[f"diffusion_model.blocks.{i}.self_attn.q.lora_A.weight"] = (8, tiny_wan.DIM)
        s[f"diffusion_model.blocks.{i}.self_attn.q.lora_B.weight"] = (tiny_wan.DIM, 8)
    return write_safetensors(path, s)


def tts_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "csm"}))
    s = {"embed_tokens.weight": (256, 64)}
    for i in range(3):
        for x in ("q_proj", "k_proj", "v_proj", "o_proj"):
            s[f"backbone_model.layers.{i}.self_attn.{x}.weight"] = (64, 64)
        s[f"backbone_model.layers.{i}.mlp.gate_proj.weight"] = (128, 64)
        s[f"backbone_model.layers.{i}.mlp.down_proj.weight"] = (64, 128)
    write_safetensors(path / "model.safetensors", s)
    return path


@pytest.fixture
def models(tmp_path):
    """A ComfyUI models folder holding every file the example workflows name (tiny headers)."""
    root = tmp_path / "models"
    wan_file(root / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors")
    t5_file(root / "text_encoders" / "umt5_xxl_fp8_e4m3fn_scaled.safetensors")
    wan_vae_file(root / "vae" / "wan_2.1_vae.safetensors")
    for name in ("csm-1b", "Dia-1.6B", "higgs-audio-v2-generation-3B-base", "VibeVoice-1.5B"):
        tts_folder(root / "tts" / name)
    return root


def finder(root: Path):
    folders = {"diffusion_models": ("diffusion_models", "unet"), "unet_gguf": ("diffusion_models", "unet"),
               "text_encoders": ("text_encoders", "clip"), "clip": ("clip",), "vae": ("vae",), "loras": ("loras",),
               "tts": ("tts",), "checkpoints": ("checkpoints",)}

    def find(kind: str, name: str):
        for folder in folders[kind]:
            p = root / folder / name
            if p.exists():
                return str(p)
        return None
    return find


@pytest.mark.parametrize("workflow", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_workflow_plans(models, workflow):
    plan = plan_workflow(json.loads(workflow.read_text()), finder(models), "rtx3060-12gb", 32 << 30)
    d = plan.to_dict()
    json.dumps(d, allow_nan=False)  # strict JSON for the panel
    assert d["models"] and all(m["found"] for m in d["models"]), [m["notes"] for m in d["models"]]
    assert d["run"]["complete"] and d["run"]["total_ms"] > 0
    if "wan" in workflow.name:
        roles = {m["role"]: m for m in d["models"]}
        assert set(roles) == {"diffusion", "text_encoder", "vae"}
        assert roles["diffusion"]["preset"] == "consumer" and roles["diffusion"]["calls"] == 30
        assert roles["text_encoder"]["preset"] == "budget" and roles["text_encoder"]["calls"] == 2  # via Offload CLIP
        s = d["run"]["samplers"][0]
        assert (s["steps"], s["cfg"], s["frames"], s["width"], s["height"]) == (30, 6.0, 33, 832, 480)
        assert s["forwards_per_step"] == 2 and s["image_tokens"] == 9 * 30 * 52
        assert [p["phase"] for p in d["run"]["phases"]] == ["text encode", "sampling", "vae decode"]
    else:
        tts = [m for m in d["models"] if m["role"] == "tts"]
        assert len(tts) == 1 and tts[0]["family"] == "csm" and tts[0]["calls"] > 0  # the folder's model_type
        assert [p["phase"] for p in d["run"]["phases"]] == ["tts generate"]


def _api_two_experts(high: str, low: str, loader: str = "UNETLoader", lora: bool = False) -> dict:
    """Wan 2.2 A14B as ComfyUI's template wires it: two KSamplerAdvanced, the high-noise expert for steps 0-10,
    the low-noise one for 10-20, each through ModelSamplingSD3; optionally two LoRAs chained on the first."""
    g = {
        "1": {"class_type": loader, "inputs": {"unet_name": high, "weight_dtype": "default"}},
        "2": {"class_type": loader, "inputs": {"unet_name": low, "weight_dtype": "default"}},
        "3": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "4": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "5": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5.safetensors", "type": "wan"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["5", 0], "text": "a fox"}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["5", 0], "text": "blurry"}},
        "8": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 640, "height": 480, "length": 81,
                                                                   "batch_size": 1}},
        "9": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["3", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["8", 0], "steps": 20,
            "cfg": 3.5, "start_at_step": 0, "end_at_step": 10, "add_noise": "enable", "noise_seed": 1}},
        "10": {"class_type": "KSamplerAdvanced", "inputs": {
            "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["9", 0], "steps": 20,
            "cfg": 3.5, "start_at_step": 10, "end_at_step": 10000, "add_noise": "disable", "noise_seed": 1}},
        "11": {"class_type": "VAELoader", "inputs": {"vae_name": "vae.safetensors"}},
        "12": {"class_type": "VAEDecodeTiled", "inputs": {"samples": ["10", 0], "vae": ["11", 0], "tile_size": 256,
                                                          "overlap": 64, "temporal_size": 32, "temporal_overlap": 8}},
    }
    if lora:
        g["13"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["1", 0], "lora_name": "a.safetensors",
                                                                   "strength_model": 1.0}}
        g["14"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["13", 0], "lora_name": "b.safetensors",
                                                                   "strength_model": 0.5}}
        g["3"]["inputs"]["model"] = ["14", 0]
    return g


def _wan22_models(root: Path, gguf: bool = False) -> None:
    big = {"pad_to": BIG}
    wan_file(root / "diffusion_models" / "high.safetensors", **big)
    if gguf:
        write_gguf(root / "diffusion_models" / "low.gguf",
                   {k: v for k, v in tiny_wan.wan_shapes(4).items()})
    else:
        wan_file(root / "diffusion_models" / "low.safetensors", **big)
    t5_file(root / "text_encoders" / "umt5.safetensors")
    wan_vae_file(root / "vae" / "vae.safetensors")
    lora_file(root / "loras" / "a.safetensors")
    lora_file(root / "loras" / "b.safetensors")


def test_two_experts_lora_chain_headers_only(tmp_path):
    _wan22_models(tmp_path)
    before = _bytes_read()
    plan = plan_workflow(_api_two_experts("high.safetensors", "low.safetensors", lora=True), finder(tmp_path),
                         "rtx4090", 64 << 30)
    if before is not None:  # two 1 TB files: their headers only
        assert _bytes_read() - before < 64 << 20
    d = plan.to_dict()
    experts = [m for m in d["models"] if m["role"] == "diffusion"]
    assert [m["name"] for m in experts] == ["high.safetensors", "low.safetensors"]
    assert [m["calls"] for m in experts] == [10, 10]
    high, low = d["run"]["samplers"]
    assert (high["steps"], low["steps"]) == (10, 10) and high["model"] == "1" and low["model"] == "2"
    assert high["loras"] == ["a.safetensors", "b.safetensors"] and low["loras"] == []
    assert high["frames"] == low["frames"] == 81 and high["image_tokens"] == 21 * 30 * 40
    loras = [m for m in d["models"] if m["role"] == "lora"]
    assert len(loras) == 2 and all(m["host_bytes"] == m["file_bytes"] > 0 for m in loras)
    decode = d["run"]["decodes"][0]
    assert decode["tiled"] and not decode["fell_back"]
    assert all("ComfyUI manages it" in " ".join(m["notes"]) for m in experts)  # UNETLoader, no Offload Model
    # the RAM of everything at once counts both experts and the LoRAs
    assert d["ram"]["needed_bytes"] >= sum(m["host_bytes"] for m in experts + loras)


def test_gguf_expert(tmp_path):
    _wan22_models(tmp_path, gguf=True)
    infos = read_tensor_infos(tmp_path / "diffusion_models" / "low.gguf")
    shapes = tiny_wan.wan_shapes(4)
    assert {k: v.shape for k, v in infos.items()} == {k: tuple(v) for k, v in shapes.items()}
    assert infos["blocks.0.ffn.0.weight"].dtype == "Q4_K"
    assert infos["blocks.0.ffn.0.weight"].nbytes == tiny_wan.FFN * tiny_wan.DIM * 144 // 256
    graph = _api_two_experts("high.safetensors", "low.gguf")
    graph["2"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": "low.gguf"}}
    d = plan_workflow(graph, finder(tmp_path), "rtx4060ti-16gb", 32 << 30).to_dict()
    low = next(m for m in d["models"] if m["name"] == "low.gguf")
    high = next(m for m in d["models"] if m["name"] == "high.safetensors")
    assert low["found"] and low["family"] == "wan" and low["dtype"] == "Q4_K"
    # a 4.5-bit file holds about a quarter of the bf16 one's bytes, and streams those
    assert low["file_bytes"] < 0.4 * high["file_bytes"]
    assert low["calls"] == 10 and low["ms_per_call"] > 0


def test_ui_json_converts_to_api_form():
    ui = json.loads((ROOT / "example_workflows" / "wan2.1_t2v_layer_offload.json").read_text())
    api = to_api(ui)
    assert api["9"]["class_type"] == "KSampler" and api["9"]["inputs"]["steps"] == 30
    assert api["9"]["inputs"]["cfg"] == 6.0 and api["9"]["inputs"]["latent_image"] == ["8", 0]
    assert "control_after_generate" not in api["9"]["inputs"]
    facts = read_graph(ui)
    assert facts.text_encodes == {"4": 2} and facts.decodes[0]["vae"] == "10"


def test_missing_file_is_named_not_fatal(tmp_path):
    d = plan_workflow(_api_two_experts("high.safetensors", "low.safetensors"), finder(tmp_path), "rtx4090",
                      16 << 30).to_dict()
    assert not any(m["found"] for m in d["models"])
    assert all("not found" in m["notes"][0] for m in d["models"])
    assert not d["run"]["complete"]


def test_frame_rule_and_cfg_one(tmp_path):
    _wan22_models(tmp_path)
    graph = _api_two_experts("high.safetensors", "low.safetensors")
    graph["8"]["inputs"]["length"] = 80
    graph["9"]["inputs"]["cfg"] = graph["10"]["inputs"]["cfg"] = 1.0
    d = plan_workflow(graph, finder(tmp_path), "rtx4090", 64 << 30).to_dict()
    assert any("4k+1" in n and "77" in n and "81" in n for n in d["notes"])
    assert all(s["forwards_per_step"] == 1 for s in d["run"]["samplers"])


def test_big_model_does_not_fit_small_card_without_offloading(tmp_path):
    """Wan 2.1 14B's shapes on a 12 GB card: without offloading it needs ~30 GB; the budget preset fits."""
    from offload.predict.published import shapes_for

    shapes = {"model.diffusion_model." + k: v.shape for k, v in shapes_for("wan2.1-t2v-14b").items()}
    write_safetensors(tmp_path / "diffusion_models" / "wan14.safetensors", shapes)
    graph = _api_two_experts("wan14.safetensors", "wan14.safetensors")
    del graph["10"], graph["2"], graph["4"], graph["12"]
    graph["9"]["inputs"]["end_at_step"] = 20
    d = plan_workflow(graph, finder(tmp_path), "rtx3060-12gb", 64 << 30, presets=["budget", "high_end"]).to_dict()
    m = next(m for m in d["models"] if m["role"] == "diffusion")
    assert m["without_offloading"]["fits"] is False and m["without_offloading"]["needs_bytes"] > 28 << 30
    assert m["presets"]["budget"]["fits"] is True
    assert m["presets"]["budget"]["ms_per_call"] >= m["presets"]["budget"]["resident_ms_per_call"]


def test_cli_plans_a_workflow(models, capsys):
    wf = ROOT / "example_workflows" / "wan2.1_t2v_layer_offload.json"
    assert main(["plan", str(wf), "--models-dir", str(models), "--card", "rtx3060-12gb", "--ram", "32GB"]) == 0
    out = capsys.readouterr()
    text = out.out
    assert "PREDICTIONS" in text and "without offloading" in text and "30 steps x 2 forward(s)" in text
    assert "cond+uncond batched" in text and "host RAM" in text and "33 frames" in text
    assert "Warning" not in out.err and "warn" not in text.lower()
    assert main(["plan", str(wf), "--models-dir", str(models), "--tflops", "50", "--mem-gbps", "500",
                 "--vram", "8GB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["card"]["tflops"] == 50 and d["card"]["vram_bytes"] == 8 << 30


def test_cli_says_what_compression_keeps_off_the_disk_tier(models, capsys):
    """Issue 36 part 4: `plan workflow.json --ram` shows what holding blocks compressed in RAM keeps out of the disk
    tier. Wan 2.1 14B in bf16 (26.6 GiB) under the example workflow's file name: 32 GB holds it raw (nothing said),
    24 GB only compressed (0 GiB on disk; host_compression="off" would put 5.9 GiB there), 16 GB neither."""
    shapes = {"model.diffusion_model." + k: tuple(v.shape) for k, v in wan_shapes(5120, 13824, 40, False).items()}
    write_safetensors(models / "diffusion_models" / "wan2.1_t2v_1.3B_fp16.safetensors", shapes)
    wf = str(ROOT / "example_workflows" / "wan2.1_t2v_layer_offload.json")
    base = ["plan", wf, "--models-dir", str(models), "--card", "rtx4090"]
    figures = {}
    for ram in ("32GB", "24GB", "16GB"):
        assert main(base + ["--ram", ram, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        m = next(x for x in d["models"] if x["role"] == "diffusion")
        figures[ram] = (m, m["presets"][m["preset"]])
    m, chosen = figures["32GB"]
    assert chosen["compressed_blocks"] == 0 and m["disk_bytes"] == 0 and "uncompressed" not in chosen
    m, chosen = figures["24GB"]
    assert chosen["compressed_blocks"] == 40 and m["disk_bytes"] == 0 and m["host_bytes"] < 24 << 30
    assert chosen["uncompressed"]["disk_bytes"] > 5 << 30
    m, chosen = figures["16GB"]
    assert 0 < chosen["compressed_blocks"] < 40 and 0 < m["disk_bytes"] < chosen["uncompressed"]["disk_bytes"]
    assert main(base + ["--ram", "24GB"]) == 0
    text = capsys.readouterr().out
    assert "40 block(s) held compressed" in text and 'with host_compression="off": 5.89 GiB' in text
    assert main(base + ["--ram", "32GB"]) == 0
    assert "held compressed" not in capsys.readouterr().out


def test_published_table_matches_docs():
    """docs/benchmarks.md's table of published measurements is what the code predicts today (within its rounding):
    the table is the code's, not hand-written figures."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Predictions against published measurements"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:len(ROWS) + 1]
    assert len(rows) == len(ROWS) >= 15
    within = 0
    for line, row in zip(rows, ROWS):
        cells = [c.strip() for c in line.strip("|").split("|")]
        predicted = predict_row(row)
        assert float(cells[-2]) == pytest.approx(predicted["predicted_s"], rel=0.02, abs=0.02), line
        assert float(cells[-1].rstrip("x")) == pytest.approx(predicted["ratio"], abs=0.011), line
        within += abs(predicted["ratio"] - 1.0) <= 0.3
    assert within >= 0.8 * len(ROWS)


def _diffusers_wan():
    import diffusers
    import torch

    # diffusers' tests/models/transformers/test_models_transformer_wan.py config, two heads of 128 wide
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=64, freq_dim=256, ffn_dim=512, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    kw = dict(hidden_states=torch.empty(1, 16, 3, 32, 32, device="meta"), timestep=torch.empty(1, device="meta"),
              encoder_hidden_states=torch.empty(1, 20, 64, device="meta"), return_dict=False)
    return model, kw, 3 * 16 * 16, 20


def _diffusers_flux():
    import diffusers
    import torch

    # diffusers' tests/models/transformers/test_models_transformer_flux.py config, two heads of 128 wide
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(16, 56, 56))
    mk = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    kw = dict(hidden_states=mk(1, 256, 64), encoder_hidden_states=mk(1, 30, 64), pooled_projections=mk(1, 32),
              timestep=mk(1), img_ids=mk(256, 3), txt_ids=mk(30, 3), return_dict=False)
    return model, kw, 256, 30


def _wan_file_shapes():
    return {**wan_shapes(256, 512, 2, False), "text_embedding.0.weight": TensorInfo((256, 64), "bfloat16", 256 * 128)}


@pytest.mark.parametrize("build, shapes", [(_diffusers_wan, _wan_file_shapes),
                                           (_diffusers_flux, lambda: flux_shapes(256, 1, 1))], ids=["wan", "flux"])
def test_header_costs_match_the_flop_counter(build, shapes):
    """Per block, the FLOPs priced from ComfyUI-layout shapes equal torch.utils.flop_counter's (and the fused
    attention's) on diffusers' own model of the same dims run on the meta device; the activation peak is close."""
    import torch

    from offload.predict.header_costs import Tokens, diffusion_analysis
    from offload.predict.meta_costs import analyse_on_meta
    from offload.predict.model_kinds import describe

    model, kw, image, text = build()
    model = model.to(torch.bfloat16)
    kw = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and k in ("hidden_states", "encoder_hidden_states",
                                                                           "pooled_projections") else v
          for k, v in kw.items()}
    meta = analyse_on_meta(model, (), kw)
    header = diffusion_analysis(describe(shapes()), Tokens(image, text, 1))
    assert header.flops == pytest.approx(meta.flops, rel=0.02)
    assert header.activation_bytes == pytest.approx(meta.activation_bytes, rel=0.25)


REQUIRED_CARDS = ("rtx3060-12gb", "rtx3090", "rtx4060ti-16gb", "rtx4070-12gb", "rtx4070ti-super", "rtx4080-super",
                  "rtx4090", "rtx4090d", "rtx5060ti-16gb", "rtx5070ti", "rtx5080", "rtx5090", "a100-40gb", "a100-80gb",
                  "l40s", "l20", "h20", "h100-pcie", "h100-sxm", "h200", "b200")


def test_cards_table():
    from offload.predict.cards import CARDS, match_card

    for name in REQUIRED_CARDS:
        card = CARDS[name]
        assert card.source and card.arch and card.mem_gbps > 0, name
        assert 0 < card.attention_efficiency <= 1 and 0 < card.matmul_efficiency <= 1, name
    # attention by architecture: FlashAttention-2 reaches less of Hopper's peak than of Ada's; FA3 more on Hopper
    assert CARDS["h100-sxm"].attention_efficiency < CARDS["rtx4090"].attention_efficiency
    from dataclasses import replace
    assert replace(CARDS["h100-sxm"], attention="fa3").attention_efficiency > CARDS["h100-sxm"].attention_efficiency
    for device, want in (("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                         ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                         ("NVIDIA GeForce RTX 4070 Ti SUPER", "rtx4070ti-super"),
                         ("NVIDIA GeForce RTX 5060 Ti", "rtx5060ti-16gb"), ("NVIDIA H20", "h20")):
        assert match_card(device, 17 << 30).name == want and match_card(device, 17 << 30).vram_bytes == 17 << 30
    assert match_card("NVIDIA GeForce GTX 1080") is None


def _sdxl_checkpoint(path: Path) -> Path:
    """An SDXL-shaped checkpoint (ComfyUI's key layout, tiny widths): UNet levels with a downsample, attention at
    the inner level, an upsample; a CLIP text model; an AutoencoderKL decoder."""
    s = {}
    u = "model.diffusion_model."
    s[u + "input_blocks.0.0.weight"] = (32, 4, 3, 3)
    s[u + "input_blocks.1.0.in_layers.2.weight"] = (32, 32, 3, 3)
    s[u + "input_blocks.2.0.op.weight"] = (32, 32, 3, 3)
    s[u + "input_blocks.3.0.in_layers.2.weight"] = (64, 32, 3, 3)
    for x in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.to_v"):
        s[u + f"input_blocks.3.1.transformer_blocks.0.{x}.weight"] = (64, 64 if not x.startswith("attn2.to_") or
                                                                     x == "attn2.to_q" else 80)
    s[u + "middle_block.0.in_layers.2.weight"] = (64, 64, 3, 3)
    s[u + "output_blocks.0.0.in_layers.2.weight"] = (64, 128, 3, 3)
    s[u + "output_blocks.0.1.conv.weight"] = (64, 64, 3, 3)
    s[u + "output_blocks.1.0.in_layers.2.weight"] = (32, 96, 3, 3)
    s[u + "out.2.weight"] = (4, 32, 3, 3)
    t = "conditioner.embedders.0.transformer.text_model."
    for i in range(2):
        for x in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[t + f"encoder.layers.{i}.self_attn.{x}.weight"] = (80, 80)
        s[t + f"encoder.layers.{i}.mlp.fc1.weight"] = (320, 80)
    s["first_stage_model.decoder.conv_in.weight"] = (512, 4, 3, 3)
    s["first_stage_model.decoder.conv_out.weight"] = (3, 128, 3, 3)
    return write_safetensors(path, s, "F16")


def test_sdxl_checkpoint_workflow(tmp_path):
    _sdxl_checkpoint(tmp_path / "checkpoints" / "sdxl.safetensors")
    graph = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sdxl.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": "a cat"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": ""}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0],
                                                   "latent_image": ["4", 0], "steps": 25, "cfg": 7.0, "seed": 1}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
    }
    d = plan_workflow(graph, finder(tmp_path), "rtx3060-12gb", 16 << 30).to_dict()
    roles = {m["role"]: m for m in d["models"]}
    assert set(roles) == {"diffusion", "text_encoder", "vae"}
    assert roles["diffusion"]["family"] == "unet" and roles["diffusion"]["calls"] == 25
    assert roles["text_encoder"]["calls"] == 2 and roles["vae"]["calls"] == 1
    assert d["run"]["samplers"][0]["image_tokens"] == 128 * 128 and d["run"]["complete"]
    # a 1024x1024 decode: ComfyUI's own estimate of its memory (2178 x 64 x latent pixels x 2 bytes)
    assert roles["vae"]["activation_bytes"] == 2178 * 64 * 128 * 128 * 2


def _keys(*names: str, shape: tuple = (64, 64)) -> dict[str, tuple]:
    return {n: shape for n in names}


# per family, the keys comfy/model_detection.py tells it by, plus one block (ComfyUI's layout)
FAMILY_KEYS = {
    "flux2": _keys("double_blocks.0.img_attn.norm.key_norm.scale", "double_stream_modulation_img.lin.weight",
                   "img_in.weight", "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"),
    "chroma": _keys("double_blocks.0.img_attn.norm.key_norm.scale", "distilled_guidance_layer.norms.0.scale",
                    "img_in.weight", "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"),
    "qwen_image": _keys("txt_norm.weight", "transformer_blocks.0.img_mod.1.weight", "img_in.weight"),
    "hunyuan_video_1.5": _keys("txt_in.individual_token_refiner.blocks.0.norm1.weight", "cond_type_embedding.weight",
                               "double_blocks.0.img_attn_qkv.weight"),
    "ltxav": _keys("adaln_single.emb.timestep_embedder.linear_1.bias", "audio_adaln_single.linear.weight",
                   "transformer_blocks.0.attn1.to_q.weight", "transformer_blocks.0.attn2.to_k.weight"),
    "cogvideox": _keys("blocks.0.norm1.linear.weight", "blocks.0.attn1.to_q.weight"),
    "z_image": {**_keys("noise_refiner.0.attention.k_norm.weight", "layers.0.attention.qkv.weight"),
                "cap_embedder.1.weight": (3840, 2560)},
    "lumina2": {**_keys("noise_refiner.0.attention.k_norm.weight", "layers.0.attention.qkv.weight"),
                "cap_embedder.1.weight": (2304, 2304)},
    "sd3": _keys("joint_blocks.0.x_block.attn.qkv.weight", "joint_blocks.0.context_block.attn.qkv.weight"),
}


@pytest.mark.parametrize("family", sorted(FAMILY_KEYS))
def test_families_by_their_keys(tmp_path, family):
    """Each family a user runs is told by its keys and planned from a UNETLoader (a GGUF file for one of them)."""
    from offload.predict.model_kinds import describe

    shapes = {"model.diffusion_model." + k: v for k, v in FAMILY_KEYS[family].items()}
    desc = describe({k: TensorInfo(v, "bfloat16", 2 * math.prod(v)) for k, v in shapes.items()})
    assert desc.role == "diffusion" and desc.family == family and desc.blocks
    gguf = family == "qwen_image"
    name = f"{family}.gguf" if gguf else f"{family}.safetensors"
    if gguf:
        write_gguf(tmp_path / "diffusion_models" / name, FAMILY_KEYS[family])
    else:
        write_safetensors(tmp_path / "diffusion_models" / name, shapes)
    graph = {"1": {"class_type": "UnetLoaderGGUF" if gguf else "UNETLoader", "inputs": {"unet_name": name}},
             "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 768, "height": 512, "length": 93,
                                                                       "batch_size": 1}},
             "3": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "latent_image": ["2", 0], "steps": 8,
                                                        "cfg": 1.0}}}
    d = plan_workflow(graph, finder(tmp_path), "rtx5090", 64 << 30).to_dict()
    sampler = d["run"]["samplers"][0]
    assert sampler["ms"] > 0 and sampler["image_tokens"] > 0
    rule_broken = any("frames" in n for n in d["notes"])
    assert rule_broken == (family == "ltxav")  # 93 = 4x23+1 but not 8k+1


def test_bypassed_lora_passes_through(tmp_path):
    """A bypassed node (UI mode 4) passes its input through: the model is still traced, the LoRA not applied."""
    _wan22_models(tmp_path)
    graph = _api_two_experts("high.safetensors", "low.safetensors", lora=True)
    graph["14"]["mode"] = 4
    d = plan_workflow(graph, finder(tmp_path), "rtx4090", 64 << 30).to_dict()
    high = d["run"]["samplers"][0]
    assert high["model"] == "1" and high["loras"] == ["a.safetensors"]


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0)), "corrupt"),
    (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 0)), "truncated"),
    (lambda p: p.write_bytes(b"GGML" + b"\0" * 20), "not a GGUF file"),
    (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string("k")
                             + struct.pack("<IIQ", 9, 4, 1 << 40)), "corrupt"),
])
def test_bad_gguf_headers_are_refused(tmp_path, make, needle):
    from offload.predict.model_files import ModelFileError

    path = tmp_path / "bad.gguf"
    make(path)
    with pytest.raises(ModelFileError, match=needle):
        read_tensor_infos(path)


def test_cond_and_uncond_split_when_the_pair_does_not_fit(tmp_path):
    """Wan 14B at 720p on a 12 GB card: the batch of two's activations do not fit, one sample's do; ComfyUI then
    runs cond and uncond one after the other, and so does the plan (two calls a step, batch one)."""
    shapes = {"model.diffusion_model." + k: v.shape for k, v in shapes_for("wan2.1-t2v-14b").items()}
    write_safetensors(tmp_path / "diffusion_models" / "wan14.safetensors", shapes)
    graph = {"1": {"class_type": "OffloadDiffusionModelLoader", "inputs": {"unet_name": "wan14.safetensors",
                                                                          "preset": "budget"}},
             "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 1280, "height": 720, "length": 33,
                                                                       "batch_size": 1}},
             "3": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "latent_image": ["2", 0], "steps": 4,
                                                        "cfg": 5.0}}}
    d = plan_workflow(graph, finder(tmp_path), "rtx3060-12gb", 64 << 30).to_dict()
    s = d["run"]["samplers"][0]
    m = next(m for m in d["models"] if m["role"] == "diffusion")
    assert s["forwards_per_step"] == 2 and not s["cond_uncond_batched"] and m["calls"] == 8 and m["fits"]
    assert s["ms_per_step"] == pytest.approx(2 * m["ms_per_call"])
    graph["2"]["inputs"].update(width=480, height=320)  # small enough for the pair
    d = plan_workflow(graph, finder(tmp_path), "rtx3060-12gb", 64 << 30).to_dict()
    assert d["run"]["samplers"][0]["cond_uncond_batched"] and d["models"][0]["calls"] == 4
