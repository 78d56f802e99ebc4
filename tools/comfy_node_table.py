"""Write offload/predict/comfy_nodes.json: every node ComfyUI defines (its inputs in order, with their types and the
options the frontend reads to make widgets; its output types; whether it is an output node), read from ComfyUI's
own node definitions, for `python -m offload plan` where ComfyUI is not importable.

    COMFYUI_PATH=~/ComfyUI $COMFYUI_PYTHON tools/comfy_node_table.py [custom node folders ...] > \
        offload/predict/comfy_nodes.json

Run with ComfyUI's own interpreter. It imports ComfyUI on the CPU and asks each node class for INPUT_TYPES();
the folders named after it (ComfyUI-GGUF, this pack) are loaded as ComfyUI loads custom nodes. Nothing is written
into the ComfyUI checkout (no bytecode).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(extra: list[str]) -> int:
    comfy = os.path.abspath(os.environ["COMFYUI_PATH"])
    sys.path.insert(0, comfy)
    os.chdir(comfy)
    from comfy.cli_args import args

    args.cpu = True
    import comfyui_version
    import nodes

    from offload.predict.comfy_nodes import input_records

    async def load() -> None:
        started = nodes.init_extra_nodes(init_custom_nodes=False)
        if asyncio.iscoroutine(started):
            await started
        for folder in extra:
            done = nodes.load_custom_node(os.path.abspath(folder))
            if asyncio.iscoroutine(done):
                await done

    asyncio.run(load())
    table = {}
    for name in sorted(nodes.NODE_CLASS_MAPPINGS):
        cls = nodes.NODE_CLASS_MAPPINGS[name]
        try:
            spec = cls.INPUT_TYPES()
        except Exception as exc:  # noqa: BLE001 - a node whose definition fails is left out, said on stderr
            print(f"{name}: INPUT_TYPES() failed: {exc}", file=sys.stderr)
            continue
        table[name] = {"in": input_records(spec), "out": [str(t) for t in getattr(cls, "RETURN_TYPES", ()) or ()],
                       "output_node": bool(getattr(cls, "OUTPUT_NODE", False))}
    packs = ["Layer Offload" if os.path.abspath(f) == ROOT else os.path.basename(os.path.abspath(f)) for f in extra]
    out = {"source": f"ComfyUI {comfyui_version.__version__}" + "".join(f" + {p}" for p in packs), "nodes": table}
    json.dump(out, sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
