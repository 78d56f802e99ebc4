"""Test-only ComfyUI nodes, copied into the test server's custom_nodes (never shipped with the pack).

LOTestConditioning stands in for a text encoder (a seeded [1, tokens, 4096] tensor); LOTestLatentHash
is an output node that reports a SHA-256 of a LATENT so two prompts can be compared bitwise.
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


NODE_CLASS_MAPPINGS = {"LOTestConditioning": LOTestConditioning, "LOTestLatentHash": LOTestLatentHash}
