"""`python -m offload plan`: a model from a local config or a ComfyUI model file's header, predicted per preset.

The configs and files are tiny and written here (the Wan file's keys are tests/comfyui/tiny_wan.py's, ComfyUI's
layout; the other families carry the tensor names ComfyUI's comfy/model_detection.py keys on). Nothing is timed.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from offload.__main__ import main
from offload.predict.plan_cli import load_spec, parse_bytes

sys.path.insert(0, str(Path(__file__).parent / "comfyui"))
import tiny_wan  # noqa: E402

H = 256  # two heads of 128


def write_header_file(path: Path, shapes: dict[str, tuple], dtype: str = "BF16") -> Path:
    """A valid .safetensors file of zeros with these tensors (the command reads only its header)."""
    size = {"BF16": 2, "F16": 2, "F8_E4M3": 1}[dtype]
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)
    return path


def run_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


WAN_CONFIG = {"_class_name": "WanTransformer3DModel", "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-6,
              "ffn_dim": 512, "freq_dim": 256, "in_channels": 16, "num_attention_heads": 2, "num_layers": 3,
              "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
              "rope_max_seq_len": 1024, "text_dim": 64}


def test_diffusers_config_every_preset(tmp_path, capsys):
    cfg = tmp_path / "transformer"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps(WAN_CONFIG))
    out = run_json(capsys, str(cfg), "--frames", "9", "--height", "64", "--width", "64", "--card", "rtx3060-12gb")
    assert out["family"] == "wan" and out["tokens"] == 3 * 4 * 4
    assert list(out["presets"]) == ["auto", "high_end", "mid_range", "consumer", "budget"]
    for name, p in out["presets"].items():
        assert p["fits"] is True and len(p["blocks"]) == 3 and p["step_ms"] > 0, name
        assert p["slowdown"] >= 1.0 and p["limiting_block"].startswith("blocks."), name
    assert all(b["tier"] != "vram" for b in out["presets"]["budget"]["blocks"])
    assert all(b["tier"] == "vram" for b in out["presets"]["auto"]["blocks"])  # a tiny model fits a 12 GB card


def test_table_output_says_predictions(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(WAN_CONFIG))
    assert main(["plan", str(cfg), "--frames", "5", "--height", "32", "--width", "32", "--presets", "budget,auto",
                 "--steps", "30", "--ram", "8GB"]) == 0
    text = capsys.readouterr().out
    assert "PREDICTIONS" in text and "| budget" in text and "| auto" in text and "30 steps" in text
    assert "host RAM 8 GiB" in text


def test_transformers_config_decode_step(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "num_hidden_layers": 3, "vocab_size": 256, "max_position_embeddings": 128,
                               "torch_dtype": "bfloat16"}))
    out = run_json(capsys, str(cfg), "--tokens", "16", "--presets", "budget")
    assert out["family"] == "transformers" and out["tokens"] == 16
    assert len(out["presets"]["budget"]["blocks"]) == 3


def _flux(h: int = H) -> dict[str, tuple]:
    s = {"img_in.weight": (h, 64), "txt_in.weight": (h, 64), "vector_in.in_layer.weight": (h, 32),
         "guidance_in.in_layer.weight": (h, 256)}
    for i in range(2):
        s[f"double_blocks.{i}.img_attn.qkv.weight"] = (3 * h, h)
    for i in range(3):
        s[f"single_blocks.{i}.linear1.weight"] = (7 * h, h)
    return {"model.diffusion_model." + k: v for k, v in s.items()}


def _qwen_image() -> dict[str, tuple]:
    s = {"img_in.weight": (H, 64), "txt_norm.weight": (64,), "proj_out.weight": (64, H)}
    for i in range(3):
        s[f"transformer_blocks.{i}.img_mod.1.weight"] = (6 * H, H)
    return s


def _hunyuan_15() -> dict[str, tuple]:
    s = {"img_in.proj.weight": (H, 65, 1, 1, 1), "final_layer.linear.weight": (32, H),
         "txt_in.input_embedder.weight": (H, 64), "cond_type_embedding.weight": (3, H),
         "vision_in.proj.0.weight": (1152, 1152), "byt5_in.fc1.weight": (H, 1472)}
    for i in range(2):
        s[f"txt_in.individual_token_refiner.blocks.{i}.norm1.weight"] = (H,)
        s[f"double_blocks.{i}.img_attn_qkv.weight"] = (3 * H, H)
    return s


def _sd3() -> dict[str, tuple]:
    s = {"x_embedder.proj.weight": (128, 16, 2, 2), "context_embedder.weight": (128, 64),
         "y_embedder.mlp.0.weight": (128, 32), "pos_embed": (1, 64 * 64, 128)}
    for i in range(3):
        s[f"joint_blocks.{i}.x_block.attn.qkv.weight"] = (384, 128)
    return s


@pytest.mark.parametrize("family, shapes, dtype, blocks", [
    ("wan", tiny_wan.wan_shapes(), "BF16", 4),
    ("flux", _flux(), "BF16", 5),
    ("qwen_image", _qwen_image(), "BF16", 3),
    ("hunyuan_video_1.5", _hunyuan_15(), "BF16", 4),
    ("sd3", _sd3(), "F16", 3),
])
def test_comfyui_model_file_header(tmp_path, capsys, family, shapes, dtype, blocks):
    path = write_header_file(tmp_path / f"{family}.safetensors", shapes, dtype)
    spec = load_spec(path)
    assert spec.family == family and len(spec.block_bytes) == blocks
    out = run_json(capsys, str(path), "--frames", "5", "--height", "64", "--width", "64", "--presets", "budget,auto")
    assert out["family"] == family
    budget = out["presets"]["budget"]
    assert len(budget["blocks"]) == blocks and budget["fits"] is True
    # the block sizes are the file's (as they would stream), not the bf16 meta model's
    assert sorted(b["bytes"] for b in budget["blocks"]) == sorted(spec.block_bytes)


def test_float8_file_streams_a_byte_per_weight(tmp_path):
    bf16 = load_spec(write_header_file(tmp_path / "a.safetensors", tiny_wan.wan_shapes(), "BF16"))
    fp8 = load_spec(write_header_file(tmp_path / "b.safetensors", tiny_wan.wan_shapes(), "F8_E4M3"))
    assert fp8.dtype == "fp8_e4m3fn" and bf16.dtype == "bf16"
    assert sum(fp8.block_bytes) < 0.6 * sum(bf16.block_bytes)


@pytest.mark.parametrize("argv, needle", [
    (["/no/such/config.json"], "does not exist"),
    (["{cfg}", "--card", "rtx9999"], "known cards"),
    (["{cfg}", "--presets", "turbo"], "valid presets"),
    (["{cfg}", "--ram", "lots"], "not a size"),
    (["{bad}"], "not a model family"),
])
def test_bad_input_is_a_message(tmp_path, capsys, argv, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(WAN_CONFIG))
    bad = write_header_file(tmp_path / "other.safetensors", {"foo.weight": (4, 4)})
    argv = [a.format(cfg=cfg, bad=bad) for a in argv]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_parse_bytes():
    assert parse_bytes("32GB") == 32 << 30 and parse_bytes("12 GiB") == 12 << 30 and parse_bytes("512MB") == 512 << 20
    assert parse_bytes("16") == 16 << 30


def test_newcomer_output(tmp_path, capsys):
    """The without-offloading line, the resident time beside every preset's, --cfg doubling the batch, and no
    library warning (diffusers' float32-modules notice) in the output."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(WAN_CONFIG))
    assert main(["plan", str(cfg), "--frames", "9", "--height", "64", "--width", "64", "--cfg", "5", "--steps", "20",
                 "--presets", "budget,auto"]) == 0
    out = capsys.readouterr()
    assert "without offloading: fits" in out.out and "resident ms/step" in out.out and "20 steps" in out.out
    assert "CFG 5" in out.out and "batch 2" in out.out
    assert "float32" not in out.out + out.err and "Warning" not in out.err
    one = run_json(capsys, str(cfg), "--frames", "9", "--height", "64", "--width", "64", "--presets", "budget")
    two = run_json(capsys, str(cfg), "--frames", "9", "--height", "64", "--width", "64", "--presets", "budget",
                   "--cfg", "5")
    assert two["batch"] == 2 * one["batch"] == 2
    assert two["presets"]["budget"]["activation_bytes"] > one["presets"]["budget"]["activation_bytes"]


def test_big_model_does_not_fit_without_offloading(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**WAN_CONFIG, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
                               "text_dim": 4096}))
    out = run_json(capsys, str(cfg), "--frames", "5", "--height", "64", "--width", "64", "--card", "rtx3060-12gb",
                   "--presets", "budget")
    assert out["without_offloading"]["fits"] is False and out["without_offloading"]["needs_bytes"] > 26 << 30
    assert out["presets"]["budget"]["fits"] is True


@pytest.mark.parametrize("frames, ok", [(80, False), (81, True), (1, True)])
def test_frames_checked_against_the_rule(tmp_path, capsys, frames, ok):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(WAN_CONFIG))
    code = main(["plan", str(cfg), "--frames", str(frames), "--height", "32", "--width", "32", "--presets", "budget"])
    err = capsys.readouterr().err
    assert code == (0 if ok else 2)
    if not ok:
        assert "4k+1" in err and "77" in err and "81" in err


# diffusers' tests/models/transformers/test_models_transformer_cogvideox.py and ..._ltx.py configs
COG_CONFIG = {"_class_name": "CogVideoXTransformer3DModel", "num_attention_heads": 2, "attention_head_dim": 32,
              "in_channels": 16, "out_channels": 16, "time_embed_dim": 64, "text_embed_dim": 64, "num_layers": 2,
              "sample_width": 8, "sample_height": 8, "sample_frames": 9, "patch_size": 2, "max_text_seq_length": 226,
              "use_rotary_positional_embeddings": True}
LTX_CONFIG = {"_class_name": "LTXVideoTransformer3DModel", "in_channels": 8, "out_channels": 8, "patch_size": 1,
              "patch_size_t": 1, "num_attention_heads": 4, "attention_head_dim": 8, "cross_attention_dim": 32,
              "num_layers": 1, "caption_channels": 16}


@pytest.mark.parametrize("config, family, frames", [(COG_CONFIG, "cogvideox", 9), (LTX_CONFIG, "ltx_video", 17)])
def test_cogvideox_and_ltx_configs(tmp_path, capsys, config, family, frames):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    out = run_json(capsys, str(cfg), "--frames", str(frames), "--height", "64", "--width", "64", "--presets", "budget")
    assert out["family"] == family and out["tokens"] > 0 and out["presets"]["budget"]["step_ms"] > 0


def _ltx_file_shapes() -> dict[str, tuple]:
    s = {"adaln_single.emb.timestep_embedder.linear_1.bias": (256,), "patchify_proj.weight": (H, 128),
         "caption_projection.linear_1.weight": (H, 64), "proj_out.weight": (128, H)}
    for i in range(3):
        p = f"transformer_blocks.{i}."
        for attn in ("attn1", "attn2"):
            for lin in ("to_q", "to_k", "to_v", "to_out.0"):
                s[f"{p}{attn}.{lin}.weight"] = (H, H)
        s[p + "ff.net.0.proj.weight"] = (4 * H, H)
        s[p + "ff.net.2.weight"] = (H, 4 * H)
        s[p + "scale_shift_table"] = (6, H)
    return {"model.diffusion_model." + k: v for k, v in s.items()}


def test_ltx_file_from_its_header(tmp_path, capsys):
    """A family the meta-device path does not build from a file (LTX-Video) is priced from its header."""
    path = write_header_file(tmp_path / "ltx.safetensors", _ltx_file_shapes())
    out = run_json(capsys, str(path), "--frames", "121", "--height", "512", "--width", "768", "--presets", "budget")
    assert out["family"] == "ltxv" and out["tokens"] == 16 * 16 * 24
    assert len(out["presets"]["budget"]["blocks"]) == 3
    assert main(["plan", str(path), "--frames", "120"]) == 2 and "8k+1" in capsys.readouterr().err
