"""Test-only ComfyUI nodes, copied into the test server's custom_nodes (never shipped with the pack).

LOTestConditioning stands in for a text encoder (a seeded [1, tokens, 4096] tensor); LOTestLatentHash
is an output node that reports a SHA-256 of a LATENT so two prompts can be compared bitwise; LOTestModelRam reports a
MODEL's host RAM between two nodes.
"""
import hashlib

import torch


class LOTestConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"tokens": ("INT", {"default": 8, "min": 1, "max": 512}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn(1, tokens, 4096, generator=g) * 0.1
        return ([[cond, {}]],)


class LOTestLatentHash:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "hash"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def hash(self, samples):
        t = samples["samples"].detach().to("cpu").contiguous()
        digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()
        info = "{} {} {} finite={} mean={:.6f}".format(
            digest, list(t.shape), str(t.dtype), bool(torch.isfinite(t).all()), float(t.float().mean()))
        return {"ui": {"text": [info]}}


class LOTestAudioHash:
    """Output node: SHA-256 of an AUDIO's waveform bytes, its shape and sample rate (compares prompts bitwise)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"audio": ("AUDIO",)}}

    RETURN_TYPES = ()
    FUNCTION = "hash"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def hash(self, audio):
        w = audio["waveform"].detach().to("cpu").contiguous()
        digest = hashlib.sha256(w.numpy().tobytes()).hexdigest()
        info = "{} {} {} rate={} peak={:.6f}".format(digest, list(w.shape), str(w.dtype), audio["sample_rate"],
                                                     float(w.abs().max()) if w.numel() else 0.0)
        return {"ui": {"text": [info]}}


class LOTestWavAudio:
    """A 16-bit PCM WAV from the input folder as AUDIO, read with the standard library (no torchaudio)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"name": ("STRING", {"default": "voice.wav"})}}

    RETURN_TYPES = ("AUDIO",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, name):
        import os
        import wave

        import folder_paths

        with wave.open(os.path.join(folder_paths.get_input_directory(), name), "rb") as f:
            channels, rate, frames = f.getnchannels(), f.getframerate(), f.readframes(f.getnframes())
        data = torch.frombuffer(bytearray(frames), dtype=torch.int16).to(torch.float32) / 32768.0
        return ({"waveform": data.reshape(-1, channels).t().unsqueeze(0).contiguous(), "sample_rate": rate},)


class LOTestModelRam:
    """A MODEL's host RAM as ComfyUI reads it (`model_mmap_residency`: bytes in RAM, bytes in all); passes a LATENT
    through, so a prompt can read it between two samplers."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "read"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def read(self, model, samples):
        fn = getattr(model, "model_mmap_residency", None)
        resident, total = fn() if callable(fn) else (-1, -1)
        return {"ui": {"text": ["ram={} total={}".format(int(resident), int(total))]}, "result": (samples,)}


NODE_CLASS_MAPPINGS = {"LOTestConditioning": LOTestConditioning, "LOTestLatentHash": LOTestLatentHash,
                       "LOTestAudioHash": LOTestAudioHash, "LOTestWavAudio": LOTestWavAudio,
                       "LOTestModelRam": LOTestModelRam}
