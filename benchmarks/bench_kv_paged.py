"""Decode speed and device bytes of the KV cache: this engine's paged KV (`paged_generation`) against transformers'
own `OffloadedCache` (`cache_implementation="offloaded"`) and its resident `DynamicCache`, on the same model, the same
weights streamed under the same budget, the same prompt (issue 37).

Rows, each a greedy `generate()` of `--new` tokens after a `--prompt`-token prompt on a Llama of `--layers` layers:
- `dynamic (resident KV)`: transformers' default cache; every layer's keys and values stay on the device;
- `offloaded (transformers)`: transformers' OffloadedCache (CUDA only: its copies use CUDA streams); it keeps the
  layer computing and the one it prefetches on the device;
- `paged (this engine)`: the pager under the budget: the weights' need plus `--kv-layers` layers' KV at the final
  length, so the rest of the pages go to pinned host memory and come back ahead of use.
Decode tokens/s = (new - 1) / (time of `new` tokens - time of 1 token), fastest of `--repeat` runs, so the prefill
cancels. KV device bytes: the pager's own peak (measured every step); for transformers' caches what their code holds
at the end (every layer for DynamicCache; two layers for OffloadedCache), from the layer sizes. Tokens must be equal
bitwise across rows (the script exits non-zero otherwise). On the simulated device the copies go through its
transfer thread (`--sim-gbps`); the figures show scheduling, not a GPU's speed; nothing here is a test bound.

    .venv/bin/python benchmarks/bench_kv_paged.py [--device sim|cuda] [--layers 8] [--prompt 128] [--new 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadConfig, VramBudget, offload_module  # noqa: E402


def build(layers: int, dim: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                                   num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 128),
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def kv_layer_bytes(model: torch.nn.Module, tokens: int) -> int:
    c = model.config
    return 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * tokens * 4


def timed(model: torch.nn.Module, ids: torch.Tensor, new: int, sync, **kw) -> tuple[float, torch.Tensor]:
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
    sync()
    return time.perf_counter() - t0, out


def decode_rate(model, ids, new, repeat, sync, each=None, **kw) -> tuple[float, torch.Tensor]:
    best_n = best_1 = float("inf")
    out = None
    for _ in range(repeat):
        if each is not None:
            each()
        t1, _ = timed(model, ids, 1, sync, **kw)
        tn, out = timed(model, ids, new, sync, **kw)
        best_n, best_1 = min(best_n, tn), min(best_1, t1)
    return (new - 1) / max(best_n - best_1, 1e-9), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="sim")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--kv-layers", type=int, default=2)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sim-gbps", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from offload.generate.kv_cache import paged_generation

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build(args.layers, args.dim)
    ids = torch.randint(3, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    extra = {} if cuda else {"sim_bandwidth_gbps": args.sim_gbps, "sim_capacity_bytes": 1 << 30}
    cfg = OffloadConfig(device=args.device, vram_fraction=0.0, prefetch=1, **extra)
    probe = offload_module(model, cfg, budget=VramBudget(None), name="probe")
    weights = probe.budget_for(0)
    probe.detach()
    per_layer = kv_layer_bytes(model, args.prompt + args.new)
    budget = VramBudget(weights + args.kv_layers * per_layer, origin="bench")
    handle = offload_module(model, cfg, budget=budget, name="llama")
    if cuda:
        ids = ids.cuda()
    rows = []
    rate, ref = decode_rate(model, ids, args.new, args.repeat, sync)
    rows.append(("dynamic (resident KV)", rate, args.layers * per_layer, "every layer on the device"))
    if cuda:
        rate, out = decode_rate(model, ids, args.new, args.repeat, sync, cache_implementation="offloaded")
        rows.append(("offloaded (transformers)", rate, 2 * per_layer, "the layer computing and the next"))
        assert torch.equal(out, ref), "transformers' OffloadedCache changed the tokens"
    else:
        rows.append(("offloaded (transformers)", None, 2 * per_layer, "skipped: needs CUDA streams"))
    pager = handle.kv_pager(page_tokens=args.page_tokens)
    peak = [0]

    def watch(input_ids, scores, **kw):
        peak[0] = max(peak[0], pager.device_bytes())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    from transformers import StoppingCriteriaList

    with paged_generation(model, pager):
        rate, out = decode_rate(model, ids, args.new, args.repeat, sync,
                                stopping_criteria=StoppingCriteriaList([watch]))
    assert torch.equal(out, ref), "the paged KV cache changed the tokens"
    kv = pager.report()
    rows.append(("paged (this engine)", rate, peak[0],
                 f"{kv['offloads']} layer offloads, {kv['restores']} restores ({kv['prefetched']} ahead of use)"))
    handle.detach()
    base = rows[0][1]
    print(f"{args.layers} layers, dim {args.dim}, prompt {args.prompt}, {args.new} new tokens, KV "
          f"{per_layer / 2**20:.2f} MB a layer at the end, budget: weights + {args.kv_layers} layers of KV, "
          f"device {args.device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| cache | decode tokens/s | vs dynamic | KV bytes on the device (MB) | note |")
    print("|---|---|---|---|---|")
    for name, r, nbytes, note in rows:
        speed = "-" if r is None else f"{r:.1f}"
        ratio = "-" if r is None else f"{r / base:.2f}x"
        print(f"| {name} | {speed} | {ratio} | {nbytes / 2**20:.2f} | {note} |")


if __name__ == "__main__":
    main()
