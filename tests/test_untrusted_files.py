"""Files are untrusted (issue 35): every byte read from a model file, a packed index or a config is checked,
bounded and named (`offload/store/header_check.py`).

The crafted-file corpus and the fuzzer live in tests/crafted_files.py and run in a subprocess under a memory cap
(RLIMIT_AS), so a crash (the old readers died with "double free or corruption" or SIGSEGV on a negative span) or a
hang (a FIFO) fails a test instead of killing or stalling pytest.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offload.store.header_check import MAX_HEADER_BYTES, CorruptFileError, json_shape_refusal
from offload.store.pack_writer import pack_file
from offload.store.packed import INDEX, open_weights
from offload.store.storage import SafetensorsFile, SourceChangedError
from offload.tts import find_model_folders
from tests import crafted_files as corpus

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "crafted_files.py"


def _child(args: list[str], timeout: int = 900) -> list[dict]:
    proc = subprocess.run([sys.executable, str(CORPUS), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [r for r in rows if r.get("start")]
    assert proc.returncode == 0, (f"the readers' process died (return code {proc.returncode}; -6 is an abort such as "
                                  f"'double free', -11 SIGSEGV) during {started[-1] if started else 'setup'}:\n"
                                  f"{proc.stderr[-3000:]}")
    return [r for r in rows if not r.get("start")]


def test_crafted_corpus_is_refused_by_every_reader_naming_file_and_problem(tmp_path):
    """Each crafted safetensors file, packed folder, special file and config, through every reader (SafetensorsFile /
    open_weights, pack_file, a model's disk_path, the TTS folder check, `python -m offload pack` and `plan`), under a
    1.5 GiB address-space cap: a ValueError (CorruptFileError, TTSModelError) naming the file and the problem, or for
    the CLIs exit code 2 and one line; never a crash, a hang or an accepted file."""
    rows = _child([str(tmp_path / "corpus")])

    names = (set(corpus.SAFETENSORS_CASES) | set(corpus.SPARSE_CASES) | set(corpus.SPECIAL_CASES)
             | set(corpus.PACKED_CASES) | set(corpus.COMPRESSED_CASES) | set(corpus.CONFIG_CASES))
    assert {r["case"] for r in rows} == names
    assert len(rows) == sum(len(corpus.KINDS[k]) for k, table in (
        ("file", corpus.SAFETENSORS_CASES), ("file", corpus.SPARSE_CASES), ("file", corpus.SPECIAL_CASES),
        ("packed", corpus.PACKED_CASES), ("packed", corpus.COMPRESSED_CASES), ("config", corpus.CONFIG_CASES))
        for _ in table)
    wrong = []
    for r in rows:
        if r["outcome"] != "refused":
            wrong.append(f"{r['case']} / {r['reader']}: {r['outcome']}")
            continue
        msg = r["message"]
        cli = r["type"] == "CLIRefused"
        named = Path(r["path"]).name in msg or Path(r["path"]).parent.name in msg
        if cli and not msg.startswith("rc=2 lines=1 "):
            wrong.append(f"{r['case']} / {r['reader']}: not exit code 2 with one line: {msg[:300]}")
        elif not cli and "ValueError" not in r["bases"]:
            wrong.append(f"{r['case']} / {r['reader']}: {r['type']} (not a ValueError): {msg[:300]}")
        elif not named or not re.search(r["words"], msg) or "Traceback" in msg:
            wrong.append(f"{r['case']} / {r['reader']}: the message must name the file and say {r['words']!r}: "
                         f"{msg[:300]}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("seed", [0])
def test_fuzzed_headers_never_crash_and_never_read_wrong_bytes(tmp_path, seed):
    """300 seeded mutations of a valid header (numbers, dtypes, shapes, spans pointed into other tensors, bytes):
    each is refused with a CorruptFileError naming the file, or accepted only when every span is inside the data,
    exactly shape x dtype long and overlapping no other, and then read_tensor, read_into and a pack read back give
    exactly the file's bytes there. The old reader accepted overlapping spans (silently wrong weights)."""
    (result,) = _child([str(tmp_path / "fuzz"), "--fuzz", "300", "--seed", str(seed)], timeout=900)
    assert result["problems"] == [], "\n".join(result["problems"][:20])
    assert 10 < result["accepted"] < 290, result  # both sides exercised


def _header_file(path: Path, text: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


HWM = re.compile(r"VmHWM:\s+(\d+) kB")
MEMORY_CHILD = """
import os, re, struct, sys
sys.path.insert(0, {root!r})
from offload.store.header_check import CorruptFileError, safetensors_tensors

def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10

for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    before = rss()
    try:
        n = len(safetensors_tensors(path))
    except CorruptFileError as e:
        n = -1
    print(path, n, hwm() - before, os.path.getsize(path), flush=True)
"""


def test_header_reads_are_bounded_in_memory(tmp_path):
    """The bound docs/troubleshooting.md states: reading a header grows peak RSS by at most ~4x the header's size (its bytes,
    their text, the parsed values); a header claiming more than the 100 MB cap is refused before it is read (a
    sparse file claiming 1 GiB costs nothing)."""
    big = _header_file(tmp_path / "big.safetensors", json.dumps({"__metadata__": {"x": "a" * (40 << 20)}}).encode())
    sparse = tmp_path / "sparse.safetensors"
    with open(sparse, "wb") as f:
        f.write(struct.pack("<Q", 1 << 30))
        f.truncate((1 << 30) + 4096)
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD.format(root=str(ROOT)), str(big), str(sparse)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (_, n_big, grew_big, size_big), (_, n_sparse, grew_sparse, _) = [line.split() for line in proc.stdout.splitlines()]
    assert int(n_big) == 0 and int(n_sparse) == -1
    assert int(grew_big) <= 4 * int(size_big) + (32 << 20), (grew_big, size_big)
    assert int(grew_sparse) < 32 << 20, grew_sparse
    assert MAX_HEADER_BYTES == 100_000_000


def test_pack_force_never_writes_through_links(tmp_path):
    """`pack --force` into a folder where someone left links named like its temp index, its index and its shard:
    the files they lead to are untouched and the folder holds a real packed model (the old writer wrote the index
    through `index.json.tmp`)."""
    src = tmp_path / "m.safetensors"
    save_file({f"blocks.{i}.w": torch.full((8, 8), float(i)) for i in range(3)}, str(src))
    out = tmp_path / "out"
    out.mkdir()
    victims = {}
    for name in ("index.json.tmp", INDEX, "shard-00000.bin"):
        victim = tmp_path / f"victim-{name}"
        victim.write_text("precious")
        os.symlink(victim, out / name)
        victims[name] = victim
    pack_file(src, out, overwrite=True)
    assert all(v.read_text() == "precious" for v in victims.values())
    assert not any(os.path.islink(out / n) for n in os.listdir(out) if n == INDEX or n.startswith("shard-"))
    w = open_weights(out)
    try:
        assert torch.equal(w.read_tensor("blocks.2.w"), torch.full((8, 8), 2.0))
    finally:
        w.close()
    assert [n for n in os.listdir(out) if n.endswith(".tmp")] == ["index.json.tmp"], "no temp file of its own left"


def test_tts_folder_walk_survives_link_loops_and_depth(tmp_path):
    """models/tts with link loops (two links back up in every folder: the old os.walk(followlinks=True) visited 2^n
    paths) and a deep chain: the walk visits each real folder once, stops at the depth limit, and finds the model."""
    base = tmp_path / "tts"
    model = base / "vendor" / "my-model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "csm"}')
    for folder in (base, base / "vendor"):
        os.symlink(base, folder / "loop-a")
        os.symlink(folder, folder / "loop-b")
    deep = base
    for i in range(30):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "config.json").write_text("{}")
    assert find_model_folders(base) == ["vendor/my-model"]


def test_non_regular_config_is_never_opened(tmp_path):
    """A FIFO named config.json under models/tts is reported unreadable without opening it (opening would block)."""
    from offload.tts import config_readable, model_type_of

    folder = tmp_path / "m"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    assert model_type_of(folder) is None and not config_readable(folder)


def _two_tensor_file(path: Path) -> Path:
    save_file({"a": torch.arange(16, dtype=torch.float32), "b": torch.arange(8, dtype=torch.float32)}, str(path))
    return path


def test_rewritten_file_is_refused_saying_to_reload(tmp_path):
    """A file rewritten in place: refused with what works (load the model again); restoring its bytes does not make
    this copy readable again, and the message no longer says it would."""
    path = _two_tensor_file(tmp_path / "m.safetensors")
    original = path.read_bytes()
    f = SafetensorsFile(path)
    try:
        with open(path, "r+b") as fh:
            fh.seek(len(original) - 4)
            fh.write(b"\x00\x00\x80\x7f")
        with pytest.raises(SourceChangedError) as first:
            f.check_unchanged()
        assert "Load the model again" in str(first.value) and "Restore the file" not in str(first.value)
        path.write_bytes(original)
        with pytest.raises(SourceChangedError, match="restoring the file does not make this copy readable"):
            f.check_unchanged()
    finally:
        f.close()
    fresh = SafetensorsFile(path)  # what the message says works
    try:
        fresh.check_unchanged()
        assert torch.equal(fresh.read_tensor("b"), torch.arange(8, dtype=torch.float32))
    finally:
        fresh.close()


def test_reads_never_write_past_their_destination(tmp_path):
    """The lowest level refuses a span whose destination slice has another length, and a tensor placed past the end
    of the buffer; the bytes around the buffer are untouched."""
    f = SafetensorsFile(_two_tensor_file(tmp_path / "m.safetensors"))
    try:
        whole = torch.full((256,), 7, dtype=torch.uint8)
        buf = whole[64:64 + 96]
        with pytest.raises(CorruptFileError, match="does not fit"):
            f.read_into(buf, [("a", 64)])  # 64 bytes at 64 of a 96-byte buffer
        with pytest.raises(CorruptFileError, match="does not fit"):
            f.read_into(buf, [("b", -16)])
        ft = f.tensors["a"]
        with pytest.raises(CorruptFileError, match="into a 32-byte destination"):
            f._read_spans([(ft.start, ft.end, buf[:32])])
        assert torch.equal(whole, torch.full((256,), 7, dtype=torch.uint8))
        assert f.read_into(buf, [("a", 0), ("b", 64)]) == 96
        assert torch.equal(buf[:64].view(torch.float32), torch.arange(16, dtype=torch.float32))
    finally:
        f.close()


def test_json_limits_are_found_without_parsing():
    assert json_shape_refusal(b'{"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}') is None
    assert json_shape_refusal(b'{"s": "[[[[[[[[[[[[ \\" {{{{{{{{"}') is None  # brackets in strings do not count
    assert "nesting" in json_shape_refusal(b"[" * 65 + b"]" * 65)
    assert json_shape_refusal(b"[" * 64 + b"]" * 64) is None
    assert "digits" in json_shape_refusal(b'{"a": ' + b"1" * 21 + b"}")
    assert json_shape_refusal(b'{"a": 1.0000000000000002, "b": 1e-25}') is None  # what json.dumps writes
    assert "digits" in json_shape_refusal(b'{"a": 0.' + b"0" * 5000 + b"1}")


def _main(argv: list[str]) -> tuple[int, str]:
    from offload.__main__ import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, err.getvalue()


@pytest.mark.parametrize("argv", [
    ["plan", "{config}", "--ram", "9" * 400],
    ["plan", "{config}", "--vram", "1e400GB"],
    ["plan", "{config}", "--tokens", "-1"],
    ["plan", "{config}", "--batch", "9" * 30],
    ["plan", "{config}", "--frames", "0"],
    ["pack", "{src}", "{out}", "--shard-gb", "inf"],
    ["pack", "{src}", "{out}", "--shard-gb", "nan"],
    ["pack", "{src}", "{out}", "--shard-gb", "9" * 400],
    ["demo", "--dim", "9" * 30],
    ["demo", "--dim", "1000000"],
    ["demo", "--tokens", "-1"],
    ["demo", "--sim-gbps", "9" * 400],
], ids=["plan-ram-400-nines", "plan-vram-1e400", "plan-tokens-negative", "plan-batch-huge", "plan-frames-zero",
        "pack-shard-inf", "pack-shard-nan", "pack-shard-400-nines", "demo-dim-huge", "demo-dim-million",
        "demo-tokens-negative", "demo-sim-gbps-400-nines"])
def test_cli_bad_numbers_are_one_line_errors(tmp_path, argv):
    """Numbers no command can use: a non-zero exit and a message naming the flag, never a traceback (these were
    OverflowError / RuntimeError tracebacks, or a process killed for memory)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128}))
    src = _two_tensor_file(tmp_path / "m.safetensors")
    argv = [a.format(config=config, src=src, out=tmp_path / "out") for a in argv]
    rc, err = _main(argv)
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"python -m offload {argv[0]}: error")
    flag = next((a for a in argv if a.startswith("--")), None)
    assert flag in err or "size" in err, err
    assert not (tmp_path / "out").exists(), "nothing written for a refused command"


def test_a_fifo_given_to_the_cli_does_not_hang(tmp_path):
    """`python -m offload pack FIFO OUT` (a real process): refused at once, one line, exit code 2."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "offload", "pack", str(fifo), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 2 and "FIFO" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
