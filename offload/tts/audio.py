"""Audio in and out of a text-to-speech model: a voice reference as processors want it, the waveform a model made.

`resample` is a band-limited (Hann-windowed sinc) resampler as torchaudio's default, in plain torch, so no family
needs torchaudio for it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .common import Voice


def resample(wave: torch.Tensor, orig: int, new: int, width: int = 6, rolloff: float = 0.99) -> torch.Tensor:
    """Band-limited resampling (Hann-windowed sinc, as torchaudio's default) of [..., T] float audio."""
    if orig == new:
        return wave
    g = math.gcd(int(orig), int(new))
    orig, new = int(orig) // g, int(new) // g
    base = min(orig, new) * rolloff
    radius = math.ceil(width * orig / base)
    idx = torch.arange(-radius, radius + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx
    t = (t * base).clamp(-width, width)
    window = torch.cos(t * math.pi / width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0, dtype=torch.float64), t.sin() / t) * window * base / orig
    kernel = kernel.to(device=wave.device, dtype=torch.float32)
    shape = wave.shape
    x = wave.reshape(-1, shape[-1]).to(torch.float32)
    length = x.shape[-1]
    x = torch.nn.functional.pad(x, (radius, radius + orig))
    y = torch.nn.functional.conv1d(x[:, None], kernel, stride=orig)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    out_len = math.ceil(new * length / orig)
    return y[..., :out_len].reshape(*shape[:-1], out_len)


def mono(voice: Voice, rate: int) -> Any:
    """A voice as processors want it: 1-D float32 numpy, mono (channels averaged), at `rate` (resampled here:
    processors take any rate silently as theirs)."""
    w = voice.waveform.detach().to(torch.float32).cpu()
    while w.dim() > 2:
        w = w[0]
    if w.dim() == 2:
        w = w.mean(dim=0)
    if w.numel() == 0:
        raise ValueError("a voice reference holds no samples")
    return resample(w, int(voice.sample_rate), int(rate)).numpy()


def finite_audio(wave: torch.Tensor | None, model: str) -> torch.Tensor:
    """The waveform as float32 [channels, T]; a clear error when the model produced none."""
    if wave is None or wave.numel() == 0:
        raise ValueError(f"{model} produced no speech for this text (it ended before its first audio frame); try "
                         f"another seed, a longer text or a larger max_new_tokens")
    wave = wave.detach().to(torch.float32).cpu()
    while wave.dim() > 2:
        wave = wave[0]
    if wave.dim() == 1:
        wave = wave[None]
    return wave
