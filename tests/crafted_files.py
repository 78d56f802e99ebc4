"""A crafted-file corpus (issue 35), generated here: safetensors files with negative and huge shapes, overlapping
and out-of-file spans, huge, nested and non-JSON headers and wrong JSON types; packed folders whose index.json was
edited the same ways or whose shards are FIFOs, links out of the folder or the wrong size; FIFOs, devices, sockets,
folders, link loops and sparse files where a model file is expected; configs for `plan` that are huge, not JSON or
describe a model no one released.

Run as a script, it opens every case with every reader in THIS process under a memory cap (RLIMIT_AS: the address
space after the imports + `--cap-mib`) and an alarm per read (a hang is a result, not a stuck test), and prints one
JSON line per (case, reader). The tests run it in a subprocess, so a crash (a double free, SIGSEGV) fails the test
instead of killing pytest; run against another checkout (`--root`) it shows what the old readers did:

    python tests/crafted_files.py /tmp/corpus --root /path/to/checkout [--only CASE]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Any, Callable

# ------------------------------------------------------------------------------------------------ safetensors
BASE_HEADER = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
               "b": {"dtype": "F16", "shape": [4], "data_offsets": [16, 24]}}
BASE_DATA = bytes(range(24))


def safetensors_bytes(header: Any = None, data: bytes = BASE_DATA, raw: bytes | None = None,
                      length: int | None = None) -> bytes:
    """A safetensors file: `raw` header text (or `header` as JSON) after its 8-byte length (or `length`)."""
    text = raw if raw is not None else json.dumps(BASE_HEADER if header is None else header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def _with(**entries: Any) -> dict:
    header = json.loads(json.dumps(BASE_HEADER))
    for key, value in entries.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = value
    return header


def _entry(dtype: Any = "F32", shape: Any = (4,), offsets: Any = (0, 16)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def _nested(depth: int) -> bytes:
    return b'{"__metadata__": ' + b'{"x": ' * depth + b"1" + b"}" * depth + b"}"


# name -> (file bytes, or a callable writing the file at a path, words the refusal must hold)
SAFETENSORS_CASES: dict[str, tuple[Any, str]] = {
    "negative-dim": (safetensors_bytes(_with(a=_entry(shape=(-4,)))), "shape entry"),
    "negative-dims-and-span": (safetensors_bytes(_with(a=_entry(shape=(-2, 2), offsets=(16, 0)))), "shape entry"),
    "negative-span": (safetensors_bytes(_with(a=_entry(offsets=(-16, 0)))), "start offset"),
    # the old pack laid blocks.0.c out at byte -512 of a 512-byte unit and read its 1024 bytes there: a heap overflow
    "negative-span-in-a-block": (safetensors_bytes({
        "blocks.0.a": _entry("F32", (-256,), (1024, 0)), "blocks.0.b": _entry("F32", (4,), (0, 16)),
        "blocks.0.c": _entry("F32", (256,), (16, 1040)), "blocks.1.a": _entry("F32", (4,), (1040, 1056)),
        "blocks.1.b": _entry("F32", (4,), (1056, 1072))}, data=bytes(2048)), "shape entry"),
    "huge-shape": (safetensors_bytes(_with(a=_entry(shape=(1 << 40, 1 << 40)))), "more elements"),
    "shape-beyond-int64": (safetensors_bytes(_with(a=_entry(shape=(10 ** 19,)))), "shape entry"),
    "shape-beyond-uint64": (safetensors_bytes(_with(a=_entry(shape=(1 << 70,)))), "digits"),
    "zero-dim-huge-dim": (safetensors_bytes(_with(a=_entry(shape=(0, 1 << 63), offsets=(0, 0)))), "shape entry"),
    "out-of-file-span": (safetensors_bytes(_with(a=_entry(shape=(1 << 28,), offsets=(0, 1 << 30)))), "past the end"),
    "span-past-end": (safetensors_bytes(_with(b=_entry("F16", (8,), (16, 32)))), "past the end"),
    "overlapping-spans": (safetensors_bytes(_with(b=_entry("F32", (4,), (8, 24)))), "overlaps"),
    "same-span-twice": (safetensors_bytes(_with(b=_entry("F32", (2, 2), (0, 16)))), "overlaps"),
    "span-shorter-than-shape": (safetensors_bytes(_with(a=_entry(offsets=(0, 8)))), "needs 16"),
    "unknown-dtype": (safetensors_bytes(_with(a=_entry(dtype="Q4_K"))), "dtype"),
    "dtype-not-a-string": (safetensors_bytes(_with(a=_entry(dtype=5))), "dtype"),
    "shape-not-a-list": (safetensors_bytes(_with(a=_entry(shape="abc"))), "shape"),
    "shape-float": (safetensors_bytes(raw=json.dumps(BASE_HEADER).replace("[2, 2]", "[2.0, 2]").encode()),
                    "not a whole number"),
    "shape-bool": (safetensors_bytes(_with(a=_entry(shape=[True, 4]))), "not a whole number"),
    "shape-null": (safetensors_bytes(_with(a=_entry(shape=[None]))), "not a whole number"),
    "shape-nan": (safetensors_bytes(raw=json.dumps(BASE_HEADER).replace("[2, 2]", "[NaN, 2]").encode()), "NaN"),
    "shape-1e400": (safetensors_bytes(raw=json.dumps(BASE_HEADER).replace("[2, 2]", "[1e400, 2]").encode()),
                    "float range"),
    "shape-5000-digits": (safetensors_bytes(raw=json.dumps(BASE_HEADER).replace("[2, 2]", "[" + "9" * 5000 + ", 2]")
                                            .encode()), "digits"),
    "offsets-missing": (safetensors_bytes(_with(a={"dtype": "F32", "shape": [4]})), "data_offsets"),
    "offsets-three": (safetensors_bytes(_with(a=_entry(offsets=[0, 8, 16]))), "data_offsets"),
    "offsets-strings": (safetensors_bytes(_with(a=_entry(offsets=["0", "16"]))), "not a whole number"),
    "entry-not-an-object": (safetensors_bytes(_with(a=5)), "not an object"),
    "header-a-list": (safetensors_bytes([1, 2]), "not a JSON object"),
    "header-a-string": (safetensors_bytes("x"), "not a JSON object"),
    "header-a-list-of-objects": (safetensors_bytes(raw=b' {"a": 1}, {}'), "not valid JSON"),
    "metadata-a-list": (safetensors_bytes(_with(__metadata__=[1])), "__metadata__"),
    "nested-100000": (safetensors_bytes(raw=b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nesting"),
    "nested-metadata-200": (safetensors_bytes(raw=_nested(200)), "nesting"),
    "not-json": (safetensors_bytes(raw=b"{not json at all}"), "not valid JSON"),
    "not-utf8": (safetensors_bytes(raw=b'{"\xff\xfe": 1}'), "not valid JSON"),
    "header-length-2-63": (safetensors_bytes(length=1 << 63), "does not fit"),
    "header-length-zero": (safetensors_bytes(length=0), "does not fit"),
    "header-longer-than-file": (safetensors_bytes(length=10_000), "does not fit"),
    "three-bytes": (b"abc", "only 3 bytes"),
    "empty": (b"", "only 0 bytes"),
    "a-million-values": (safetensors_bytes(raw=b'{"__metadata__": {"x": [' + b"1," * 1_100_000 + b"1]}}"),
                         "values"),
}


def _sparse_header(claimed: int, file_size: int, start: bytes = b"") -> Callable[[Path], None]:
    """A sparse file whose header claims `claimed` bytes of header (`start`, then zeros): nothing on disk, all of it
    readable."""
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", claimed) + start)
            f.truncate(file_size)
    return write


SPARSE_CASES: dict[str, tuple[Any, str]] = {
    "sparse-1gib-header": (_sparse_header(1 << 30, (1 << 30) + 4096), "limit"),
    "sparse-99mb-header-of-zeros": (_sparse_header(99_000_000, 100_000_000), "not a JSON object"),
    "sparse-99mb-header-brace-then-zeros": (_sparse_header(99_000_000, 100_000_000, b" {"), "not valid JSON"),
}


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # left bound: the file stays a socket
    _KEEP.append(s)


def _folder(path: Path) -> None:
    path.mkdir()


def _link_loop(path: Path) -> None:
    os.symlink(path.name + ".other", path)
    os.symlink(path.name, str(path) + ".other")


def _link_to_fifo(path: Path) -> None:
    os.mkfifo(str(path) + ".fifo")
    os.symlink(path.name + ".fifo", path)


def _dev_zero(path: Path) -> None:
    os.symlink("/dev/zero", path)


_KEEP: list[Any] = []
SPECIAL_CASES: dict[str, tuple[Any, str]] = {
    "fifo": (_fifo, "FIFO"),
    "link-to-fifo": (_link_to_fifo, "FIFO"),
    "dev-zero": (_dev_zero, "character device"),
    "socket": (_socket, "socket"),
    "folder": (_folder, "folder"),
    "link-loop": (_link_loop, "cannot read|does not exist"),
    "missing": (lambda path: None, "cannot read|does not exist"),
}


def write_case(folder: Path, name: str, spec: Any, suffix: str = ".safetensors") -> Path:
    path = folder / (name + suffix)
    if isinstance(spec, bytes):
        path.write_bytes(spec)
    else:
        spec(path)
    return path


# ------------------------------------------------------------------------------------------------ packed folders
def _valid_model_file(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({f"blocks.{i}.{n}": torch.randn(8, 8, generator=g) for i in range(3) for n in ("w1", "w2")}
              | {"head.w": torch.randn(8, 8, generator=g)}, str(path))


def _edit(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        index = json.loads((folder / "index.json").read_text())
        fn(index)
        (folder / "index.json").write_text(json.dumps(index))
    return edit


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(index: dict) -> None:
        *head, last = path.split(".")
        node: Any = index
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


def _shift_onto_first(index: dict) -> None:  # unit 1's tensor reads unit 0's bytes
    index["units"][0]["tensors"][1]["offset"] = index["units"][0]["tensors"][0]["offset"]


def _units_overlap(index: dict) -> None:
    u0, u1 = index["units"][0], index["units"][1]
    delta = u1["offset"] - u0["offset"]
    u1["offset"] = u0["offset"]
    for t in u1["tensors"]:
        t["offset"] -= delta


def _replace_shard(kind: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        shard = folder / "shard-00000.bin"
        outside = folder.parent / (folder.name + "-outside.bin")
        shutil.copy(shard, outside)
        shard.unlink()
        if kind == "fifo":
            os.mkfifo(shard)
        else:
            os.symlink(outside, shard)
    return apply


def _index_special(kind: str) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        index = folder / "index.json"
        index.unlink()
        if kind == "fifo":
            os.mkfifo(index)
        elif kind == "huge":
            with open(index, "wb") as f:
                f.truncate(200 << 20)
        elif kind == "nested":
            index.write_bytes(b'{"format": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
        elif kind == "list":
            index.write_text("[]")
        elif kind == "digits":
            index.write_text('{"format": "layer-offload-packed", "version": ' + "1" * 5000 + "}")
    return apply


PACKED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "index-negative-offset": (_edit(_set("units.0.tensors.0.offset", -4096)), "offset"),
    "index-negative-shape": (_edit(_set("units.0.tensors.0.shape", [-8, -8])), "shape entry"),
    "index-tensors-overlap": (_edit(_shift_onto_first), "overlaps"),
    "index-units-overlap": (_edit(_units_overlap), "overlaps"),
    "index-tensor-outside-its-unit": (_edit(_set("units.0.nbytes", 256)), "outside its unit"),
    "index-past-the-shard": (_edit(_set("other.0.offset", 1 << 40)), "past the end"),
    "index-span-mismatch": (_edit(_set("units.0.tensors.0.nbytes", 255)), "needs 256"),
    "index-huge-nbytes": (_edit(_set("units.0.nbytes", 10 ** 19)), "outside"),
    "index-30-digit-nbytes": (_edit(_set("units.0.nbytes", 10 ** 30)), "digits"),
    "index-unknown-dtype": (_edit(_set("units.0.tensors.0.dtype", "Q4_K")), "dtype"),
    "index-name-twice": (_edit(_set("units.1.tensors.0.name", "blocks.0.w1")), "twice"),
    "index-bad-sha256": (_edit(_set("shards.0.sha256", "not a digest")), "SHA-256"),
    "index-version-string": (_edit(_set("version", "1")), "version"),
    "index-units-not-a-list": (_edit(_set("units", "all of them")), "not a list"),
    "index-shard-dotdot": (_edit(_set("units.0.path", "../shard-00000.bin")), "not a plain file name"),
    "index-shard-size-disagrees": (_edit(lambda ix: ix["shards"][0].update(nbytes=ix["shards"][0]["nbytes"] + 4096)),
                                   "truncated"),
    "shard-is-a-fifo": (_replace_shard("fifo"), "FIFO"),
    "shard-links-outside": (_replace_shard("link"), "links outside"),
    "index-is-a-fifo": (_index_special("fifo"), "FIFO"),
    "index-200mb-sparse": (_index_special("huge"), "larger than"),
    "index-nested": (_index_special("nested"), "nesting"),
    "index-a-list": (_index_special("list"), "not a JSON object"),
    "index-5000-digits": (_index_special("digits"), "digits"),
}


def _valid_compressible_file(path: Path) -> None:
    """Blocks of bf16 weights drawn like trained ones (normal, std 0.02): `pack --compress` stores them encoded."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({f"blocks.{i}.{n}": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16) for i in range(3)
               for n in ("w1", "w2")} | {"head.w": torch.randn(8, 8, generator=g)}, str(path))


def _coded_chunk(index: dict) -> list:
    return next(c for c in index["units"][0]["chunks"] if c[4])


# a packed folder written with compress=True, its index edited: the chunks must decode inside the unit
COMPRESSED_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "stored-chunk-gap": (_edit(lambda ix: ix["units"][0]["chunks"][-1].__setitem__(0, 1)), "does not follow"),
    # version 3 chunks: [dst, nbytes, src, size, elem, sbits, rbits, n_codes, base, m, bits, n_esc]
    "stored-chunk-code-width": (_edit(lambda ix: _coded_chunk(ix).__setitem__(7, 200)), "not a chunk the codec"),
    "stored-chunk-index-width": (_edit(lambda ix: _coded_chunk(ix).__setitem__(10, 9)), "not a chunk the codec"),
    "stored-chunk-elements-per-index": (_edit(lambda ix: _coded_chunk(ix).__setitem__(9, 3)),
                                        "not a chunk the codec"),
    "stored-chunk-larger-encoded": (_edit(lambda ix: _coded_chunk(ix).__setitem__(3, 10 ** 9)), "does not follow"),
    "stored-escapes-past-chunk": (_edit(lambda ix: _coded_chunk(ix).__setitem__(11, 10 ** 9)),
                                  "not a chunk the codec"),
    "stored-chunk-of-neither-version": (_edit(lambda ix: _coded_chunk(ix).append(0)), "whole numbers"),
    "stored-past-the-shard": (_edit(_set("units.0.stored", 1 << 40)), "past its shard"),
    "stored-unknown-codec": (_edit(_set("units.0.compression", "zstd")), "stored as"),
    "stored-in-a-version-1-index": (_edit(_set("version", 1)), "version 1"),
    "stored-chunks-a-string": (_edit(_set("units.0.chunks", "x" * 100)), "not a list of chunks"),
    "stored-chunk-negative": (_edit(lambda ix: ix["units"][0]["chunks"][0].__setitem__(1, -4096)), "whole numbers"),
    "stored-tensor-past-raw": (_edit(_set("units.0.tensors.0.offset", 1 << 30)), "past the end"),
}


# ------------------------------------------------------------------------------------------------ plan configs
def _config(cfg: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return write


_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 128}


def _sparse(size: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(size)
    return write


def _gguf_str(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _gguf(tensors: list[tuple[str, tuple[int, ...], int, int]], kv: bytes = b"", n_kv: int = 0,
          data: int = 1 << 16) -> Callable[[Path], None]:
    """A GGUF v3 file (the layout tests/test_workflow_plan.py writes, after the GGUF spec): key/values, then
    (name, ggml dims, ggml type, data offset) per tensor, the data a sparse hole of `data` bytes."""
    def write(path: Path) -> None:
        infos = b"".join(_gguf_str(n) + struct.pack("<I", len(d)) + struct.pack(f"<{len(d)}Q", *d) +
                         struct.pack("<IQ", t, o) for n, d, t, o in tensors)
        head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), n_kv) + kv + infos
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + data)
    return write


_NESTED_GGUF_KV = _gguf_str("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 4, 0)
CONFIG_CASES: dict[str, tuple[Any, str, str]] = {  # name -> (writer, file name, words)
    "gguf-nested-arrays": (_gguf([], _NESTED_GGUF_KV, 1), "model.gguf", "nested deeper"),
    "gguf-tensor-past-the-file": (_gguf([("w", (256, 256), 0, 1 << 40)]), "model.gguf", "does not fit"),
    "gguf-huge-dims": (_gguf([("w", (1 << 40, 1 << 40), 0, 0)]), "model.gguf", "does not fit"),
    "gguf-overlapping-tensors": (_gguf([("a", (64, 64), 0, 0), ("b", (64, 64), 0, 1024)]), "model.gguf", "overlaps"),
    "gguf-fifo": (_fifo, "model.gguf", "FIFO"),
    "config-million-layers": (_config(_LLAMA | {"num_hidden_layers": 10 ** 6}), "config.json", "than any released"),
    "config-huge-hidden": (_config(_LLAMA | {"hidden_size": 1 << 30}), "config.json", "than any released"),
    "config-negative-layers": (_config(_LLAMA | {"num_hidden_layers": -3}), "config.json", "negative"),
    "config-wrong-types": (_config(_LLAMA | {"hidden_size": "wide"}), "config.json", "cannot be built"),
    "config-a-list": (_config([1, 2]), "config.json", "not a JSON object"),
    "config-nested": (_config('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "config.json", "nesting"),
    "config-5000-digits": (_config('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}"), "config.json",
                           "digits"),
    "config-512mb-sparse": (_sparse(512 << 20), "config.json", "larger than"),
    "gguf-512mb-sparse": (_sparse(512 << 20), "model.gguf", "GGUF"),
    "config-fifo": (_fifo, "config.json", "FIFO"),
    "config-dev-zero": (_dev_zero, "config.json", "character device"),
    "comfy-file-million-blocks": (lambda p: p.write_bytes(safetensors_bytes(
        {k: _entry("F32", (0, 16, 16), (0, 0)) for k in (
            "head.modulation", "patch_embedding.weight", "head.head.weight", "text_embedding.0.weight",
            "time_embedding.0.weight", "blocks.0.ffn.0.weight", "blocks.999999.ffn.0.weight")}, data=b"")),
                                  "wan.safetensors", "than any released"),
}


# ------------------------------------------------------------------------------------------------ readers
def _outcome(fn: Callable[[], Any], seconds: int = 90) -> dict[str, Any]:
    """Run one read: refused (the error's type and message), accepted, or hung (the alarm)."""
    class Hung(Exception):
        pass

    def alarm(signum: int, frame: Any) -> None:
        raise Hung()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        fn()
        return {"outcome": "accepted"}
    except Hung:
        return {"outcome": "hung"}
    except BaseException as exc:  # noqa: BLE001 - the test judges the type
        return {"outcome": "refused", "type": type(exc).__name__,
                "bases": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:2000]}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _cli(argv: list[str]) -> None:
    from offload.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    text = err.getvalue().strip()
    if rc == 0:
        return
    raise CLIRefused(f"rc={rc} lines={len(text.splitlines())} {text}")


class CLIRefused(Exception):
    pass


def file_readers(out: Path) -> dict[str, Callable[[Path], Any]]:
    """Every reader of a model file or packed folder, by name."""
    import torch

    from offload import OffloadConfig, VramBudget, offload_module
    from offload.store.pack_writer import pack_file
    from offload.store.packed import open_weights

    def disk_path(p: Path) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
        cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(p), ram_budget_bytes=1)
        offload_module(model, cfg, budget=VramBudget(None)).detach()

    readers: dict[str, Callable[[Path], Any]] = {
        "open_weights": lambda p: open_weights(p).close(),
        "pack_file": lambda p: pack_file(p, out / "pack-api", overwrite=True),
        "disk_path": disk_path,
        "pack_cli": lambda p: _cli(["pack", str(p), str(out / "pack-cli"), "--force"]),
    }
    try:
        from offload.tts.folders import check_weights
    except ImportError:  # older checkouts: the check lived in common.py
        from offload.tts.common import check_weights
    readers["tts_check_weights"] = lambda p: check_weights(p.parent, [p])
    readers["plan_cli"] = lambda p: _cli(["plan", str(p), "--card", "rtx4090"])
    return readers


# ------------------------------------------------------------------------------------------------ fuzzing
def _mutate(header_text: str, rng: Any) -> tuple[str, str]:
    """One seeded mutation of a header's JSON text: (what was done, new text)."""
    import re

    numbers = [m.span() for m in re.finditer(r"-?\d+", header_text)]
    choice = rng.randrange(7)
    if choice <= 1 and numbers:  # a number replaced (the likeliest corruption of offsets and shapes)
        lo, hi = numbers[rng.randrange(len(numbers))]
        old = int(header_text[lo:hi])
        new = rng.choice([-1, 0, 1, old + 1, old - 1, old * 2, -old, 1 << 31, 1 << 62, (1 << 63) + 1, old + 4, 7])
        return f"number {old}->{new} at {lo}", header_text[:lo] + str(new) + header_text[hi:]
    if choice == 2:  # a dtype replaced
        dtypes = ["F32", "F16", "BF16", "I8", "U8", "F64", "BOOL", "F8_E4M3", "Q4", "", "f32"]
        m = list(re.finditer(r'"dtype": "([^"]*)"', header_text))
        if m:
            pick = m[rng.randrange(len(m))]
            new = rng.choice(dtypes)
            return f"dtype {pick.group(1)}->{new}", header_text[:pick.start(1)] + new + header_text[pick.end(1):]
    if choice == 3:  # two entries' offsets swapped
        header = json.loads(header_text)
        keys = [k for k in header if k != "__metadata__"]
        a, b = rng.sample(keys, 2)
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        return f"offsets of {a} and {b} swapped", json.dumps(header)
    if choice == 4:  # a shape entry changed, or a dimension added / removed
        header = json.loads(header_text)
        key = rng.choice([k for k in header if k != "__metadata__"])
        shape = header[key]["shape"]
        op = rng.randrange(3)
        if op == 0 and shape:
            shape[rng.randrange(len(shape))] = rng.choice([0, -1, 1, 2, 3, 1 << 40])
        elif op == 1:
            shape.insert(0, rng.choice([1, 2, 0]))
        elif shape:
            shape.pop()
        return f"shape of {key} -> {shape}", json.dumps(header)
    if choice == 5:  # an entry pointed at the bytes of another (a shifted or copied span)
        header = json.loads(header_text)
        keys = [k for k in header if k != "__metadata__"]
        a, b = rng.sample(keys, 2)
        lo, hi = header[b]["data_offsets"]
        size = header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
        start = rng.choice([lo, max(0, hi - size), lo + 1])
        header[a]["data_offsets"] = [start, start + size]
        return f"{a} pointed into {b} at {start}", json.dumps(header)
    pos = rng.randrange(len(header_text))  # a byte changed
    return f"byte {pos} changed", header_text[:pos] + chr(rng.randrange(32, 127)) + header_text[pos + 1:]


def fuzz(folder: Path, seed: int, count: int) -> tuple[list[str], int]:
    """`count` seeded header mutations of a valid file, each opened by the reader: refused with CorruptFileError,
    or accepted and then every tensor read (by read_tensor, read_into and through a pack) equal to the file's bytes
    at a span that lies inside the data, matches its shape x dtype and overlaps no other. Returns the violations and
    how many mutations were accepted."""
    import random

    import torch
    from safetensors.torch import save_file

    from offload.store.pack_writer import pack_file
    from offload.store.packed import open_weights
    from offload.store.storage import CorruptFileError, SafetensorsFile

    g = torch.Generator().manual_seed(seed)
    base = folder / "base.safetensors"
    save_file({"blocks.0.w": torch.randn(4, 6, generator=g), "blocks.0.b": torch.randn(6, generator=g).half(),
               "blocks.1.w": torch.randn(4, 6, generator=g), "blocks.1.b": torch.randint(0, 9, (5,), generator=g,
                                                                                        dtype=torch.int8),
               "head": torch.randn(3, 3, generator=g).bfloat16()}, str(base))
    raw = base.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    text, data = raw[8:8 + n].decode(), raw[8 + n:]
    rng = random.Random(seed)
    problems: list[str] = []
    accepted = 0
    for i in range(count):
        what, new = _mutate(text, rng)
        body = new.encode()
        blob = struct.pack("<Q", len(body)) + body + data
        path = folder / f"fuzz-{i}.safetensors"
        path.write_bytes(blob)
        try:
            f = SafetensorsFile(path)
        except CorruptFileError as exc:
            if str(path) not in str(exc):
                problems.append(f"{i} ({what}): the refusal does not name the file: {exc}")
            path.unlink()
            continue
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"{i} ({what}): {type(exc).__name__} escaped: {exc}")
            continue
        accepted += 1
        try:
            base_at, spans = 8 + len(body), []
            for key, ft in f.tensors.items():
                numel = 1
                for d in ft.shape:
                    numel *= d
                if not (base_at <= ft.start <= ft.end <= len(blob) and ft.end - ft.start == numel * ft.dtype.itemsize):
                    problems.append(f"{i} ({what}): {key} accepted at [{ft.start}, {ft.end}) for {ft.shape} {ft.dtype}")
                spans.append((ft.start, ft.end, key))
                got = f.read_tensor(key).reshape(-1).view(torch.uint8)
                if bytes(got.tolist()) != blob[ft.start:ft.end]:
                    problems.append(f"{i} ({what}): read_tensor({key}) differs from the file's bytes")
            live = sorted(s for s in spans if s[1] > s[0])
            for (_, e0, k0), (s1, _, k1) in zip(live, live[1:]):
                if s1 < e0:
                    problems.append(f"{i} ({what}): {k0} and {k1} overlap and were accepted")
            pieces, off = [], 0
            for key, ft in f.tensors.items():
                pieces.append((key, off))
                off += ft.end - ft.start
            buf = torch.full((off + 16,), 0xAB, dtype=torch.uint8)
            f.read_into(buf, pieces)
            want = b"".join(blob[f.tensors[k].start:f.tensors[k].end] for k, _ in pieces) + b"\xab" * 16
            if bytes(buf.tolist()) != want:
                problems.append(f"{i} ({what}): read_into wrote other bytes (or past the pieces)")
            out = folder / f"fuzz-{i}.packed"
            pack_file(f, out, shard_bytes=1 << 16)
            packed = open_weights(out)
            try:
                for key, ft in f.tensors.items():
                    got = packed.read_tensor(key).reshape(-1).view(torch.uint8)
                    if bytes(got.tolist()) != blob[ft.start:ft.end]:
                        problems.append(f"{i} ({what}): {key} packed and read back differs")
            finally:
                packed.close()
            shutil.rmtree(out)
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"{i} ({what}): accepted, then {type(exc).__name__}: {exc}")
        finally:
            f.close()
            path.unlink()
    return problems, accepted


KINDS = {"file": ("open_weights", "pack_file", "disk_path", "pack_cli", "tts_check_weights", "plan_cli"),
         "packed": ("open_weights", "disk_path"), "config": ("plan_cli",)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--cap-mib", type=int, default=1536)
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--readers", default=None, help="comma-separated reader names")
    parser.add_argument("--fuzz", type=int, default=0, help="run this many seeded header mutations instead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    os.chdir(args.root)
    import resource

    import torch  # noqa: F401 - imported before the cap: its address space is not the readers'

    from offload.store.pack_writer import pack_file

    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    if args.fuzz:
        vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (args.cap_mib << 20), resource.RLIM_INFINITY))
        problems, accepted = fuzz(folder, args.seed, args.fuzz)
        print(json.dumps({"fuzz": args.fuzz, "seed": args.seed, "accepted": accepted, "problems": problems}),
              flush=True)
        return
    only = set(args.only.split(",")) if args.only else None
    cases: list[tuple[str, Path, str, str]] = []  # name, path, words, kind
    for table in (SAFETENSORS_CASES, SPARSE_CASES, SPECIAL_CASES):
        for name, (spec, words) in table.items():
            if only is None or name in only:
                cases.append((name, write_case(folder, name, spec), words, "file"))
    good = folder / "good.safetensors"
    _valid_model_file(good)
    for name, (edit, words) in PACKED_CASES.items():
        if only is None or name in only:
            target = folder / name
            pack_file(good, target, shard_bytes=1 << 20)
            edit(target)
            cases.append((name, target, words, "packed"))
    compressible = folder / "compressible.safetensors"
    _valid_compressible_file(compressible)
    for name, (edit, words) in COMPRESSED_CASES.items():
        if only is None or name in only:
            target = folder / name
            pack_file(compressible, target, shard_bytes=1 << 20, compress=True)
            edit(target)
            cases.append((name, target, words, "packed"))
    for name, (write, file_name, words) in CONFIG_CASES.items():
        if only is None or name in only:
            sub = folder / name
            sub.mkdir()
            path = sub / file_name
            write(path)
            cases.append((name, path, words, "config"))
    readers = file_readers(folder)
    wanted = set(args.readers.split(",")) if args.readers else None
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (args.cap_mib << 20), resource.RLIM_INFINITY))
    for name, path, words, kind in cases:
        for reader, fn in readers.items():
            if (wanted and reader not in wanted) or reader not in KINDS[kind]:
                continue
            print(json.dumps({"case": name, "reader": reader, "start": True}), flush=True)
            result = _outcome(lambda: fn(path))
            print(json.dumps({"case": name, "reader": reader, "path": str(path), "words": words, **result}),
                  flush=True)


if __name__ == "__main__":
    main()
