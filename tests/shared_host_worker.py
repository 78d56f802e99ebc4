"""One process of tests/test_shared_host.py: a local worker offloading a model from its file, driven line by line.

Run as `python -m tests.shared_host_worker FILE SHARE LOAD [COMPRESS CEILING]` from the repository root (SHARE: auto |
off; LOAD: meta, the model built on the meta device and read from FILE, or ram, loaded into RAM first as ComfyUI
does; COMPRESS: the host_compression asked for, "-" for the preset's, which also makes the model's weights bf16
(`build(compressed=True)`); CEILING: ram_budget_bytes, 0 for none). It builds the model and prints `ready`, then
answers one command per line on stdin:
- `offload`: offload it on the simulated device (every block streamed), run one forward; prints `out <sha256>`
- `forward`: one forward; prints `out <sha256 of the output's bytes>`
- `write UNIT`: multiplies the first weight of block UNIT by 2 in place (what a merged patch does)
- `report`: prints `report <json>` with the per-block `shared` flags and forms, the host bytes and the segment's path
- `squat UID MODE`: (another user's process) writes a copy of its own segment, every block's first bytes changed,
  under the name user UID's processes look for, with permission bits MODE (octal); prints `squatted <path>`
- `detach`, `quit`
The parent reads each process's proportional set size from outside (psutil), between commands.

Environment: `LO_TEST_AS_UID=UID` makes the process another user: it imports and warms up as it was started (root:
the interpreter may sit in a folder only root can enter), then drops to UID (its group too) before `ready`.
`LO_TEST_WIDTH` changes WIDTH (a smaller model for tests that run many processes).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.nn as nn

WIDTH = int(os.environ.get("LO_TEST_WIDTH", "1024"))
BLOCKS = 16  # 16 x 4 MiB of fp32 weights: 64 MiB, well above the noise of a process's runtime


def build(device: str = "cpu", compressed: bool = False) -> nn.Sequential:
    """The model: fp32 weights, or (`compressed`) bf16 ones drawn like trained ones (normal, std 0.02: what the
    codec compresses to about 0.7 of raw)."""
    with torch.device(device):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(BLOCKS)])
    if compressed:
        if device != "meta":
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
        model = model.to(torch.bfloat16)
    return model


def inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1)).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _become(uid: int) -> None:
    """Import everything the commands may need and run an offload once, as the process was started, then drop to
    `uid` for good (real, effective and saved ids, its group the same number, no supplementary groups)."""
    import importlib
    import pkgutil

    import offload
    from offload import OffloadConfig, VramBudget, offload_module

    for info in pkgutil.walk_packages(offload.__path__, "offload."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - optional parts (a family's package) may be missing
            pass
    tiny = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    h = offload_module(tiny, OffloadConfig(device="sim", share_host="off", vram_fraction=0.0), budget=VramBudget(None))
    with torch.no_grad():
        tiny(torch.ones(1, 8))
    h.detach()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _squat(handle, uid: int, mode: int) -> str:
    """A copy of this process's segment, each unit's first 256 bytes changed, under user `uid`'s name for it."""
    from offload.store.shm_segment import PREFIX

    shared = handle.streamer.staged.shared
    data = bytearray(shared.path.read_bytes())
    for i, off in shared.offsets.items():
        data[off:off + min(256, shared.sizes[i])] = b"\x40" * min(256, shared.sizes[i])
    target = shared.path.with_name(shared.path.name.replace(f"{PREFIX}{os.geteuid()}-", f"{PREFIX}{uid}-", 1))
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, bytes(data))
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return str(target)


def main(path: str, share: str, load: str, compress: str = "-", ceiling: str = "0") -> None:
    from offload import OffloadConfig, VramBudget, offload_module

    if os.environ.get("LO_TEST_AS_UID"):
        _become(int(os.environ["LO_TEST_AS_UID"]))

    compressed = compress != "-"
    if load == "meta":
        model = build("meta", compressed)
    else:
        from safetensors.torch import load_file
        model = build(compressed=compressed)
        model.load_state_dict(load_file(path))
    handle = None
    x = inputs(torch.bfloat16 if compressed else torch.float32)
    more = ({"host_compression": compress} if compressed else {}) | (
        {"ram_budget_bytes": int(ceiling)} if int(ceiling) else {})
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "offload":
            cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=path, share_host=share,
                                            sim_capacity_bytes=1 << 30, **more)
            handle = offload_module(model, cfg, budget=VramBudget(256 << 20))
            handle.wait_encoded()  # the copy's filler puts its blocks in it after setup (HostPlan.publish_later)
            cmd = "forward"
        if cmd == "forward":
            with torch.no_grad():
                print("out", digest(model(x)), flush=True)
        elif cmd == "write":
            with torch.no_grad():
                model[int(args[0])].weight.mul_(2)
            print("written", flush=True)
        elif cmd == "report":
            rep = handle.report()
            staged = handle.streamer.staged
            print("report", json.dumps({
                "shared": [b.shared for b in rep.blocks], "host_shared_bytes": rep.host_shared_bytes,
                "compression": [b.compression for b in rep.blocks], "host_bytes": rep.host_bytes,
                "host_private_bytes": rep.host_private_bytes,
                "segment": str(staged.shared.path) if staged.shared is not None else None}), flush=True)
        elif cmd == "squat":
            print("squatted", _squat(handle, int(args[0]), int(args[1], 8)), flush=True)
        elif cmd == "detach":
            handle.detach()
            print("detached", flush=True)
        elif cmd == "quit":
            return


if __name__ == "__main__":
    main(*sys.argv[1:6])
