"""One host copy for several processes offloading the same file (issue 36 part 6, offload/store/shared_host.py).

ComfyUI-Distributed runs a master and one worker process per GPU on one machine. Real processes here
(tests/shared_host_worker.py, the simulated device) offload the same safetensors file; their proportional set sizes
(PSS: a page mapped by n processes counts 1/n in each) are read from outside between steps. With the shared copy
the second (and third, fourth) process adds at most its own runtime plus 30% of the model; with `share_host="off"`
(the control) each adds the model again. Outputs are bitwise equal to the model's own in every process; a process
that writes a weight gets a private copy of that block only, the others keep the original bytes; the segment is gone
from /dev/shm once the last process let go. Blocks the plan holds compressed (host_compression under a RAM ceiling)
are shared in their encoded form: the second process takes the first one's forms as facts and maps its blobs.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests import shared_host_worker as worker

safetensors_torch = pytest.importorskip("safetensors.torch")
shared_host = pytest.importorskip("offload.store.shared_host")
from offload.store.sources import SharedSource  # noqa: E402

pytestmark = pytest.mark.skipif(not shared_host.available(), reason="needs Linux's /dev/shm")

ROOT = Path(__file__).resolve().parent.parent
MODEL_BYTES = worker.BLOCKS * worker.WIDTH * worker.WIDTH * 4
# glibc's dynamic mmap threshold keeps the simulated device's freed decode temporaries (CPU tensors of a few MB) in
# the heap of the thread that decoded them: 20-35 MB per process, varying from run to run. A fixed threshold gives
# them back at once, so a process's runtime is measured the same in every process (on a GPU they are device memory).
QUIET_HEAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


class Worker:
    """A worker process and its line protocol (see tests/shared_host_worker.py)."""

    def __init__(self, path: Path, share: str = "auto", load: str = "meta", extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.shared_host_worker", str(path), share, load,
                                      *extra],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **QUIET_HEAP,
                                                     **(env or {})})
        self.expect("ready")

    def expect(self, word: str) -> str:
        line = self.proc.stdout.readline()
        if not line.startswith(word):
            self.proc.kill()
            raise AssertionError(f"worker said {line!r}, expected {word!r}:\n{self.proc.stderr.read()[-3000:]}")
        return line[len(word):].strip()

    def ask(self, cmd: str, answer: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect(answer)

    def report(self) -> dict:
        return json.loads(self.ask("report", "report"))

    def pss(self) -> int:
        return psutil.Process(self.proc.pid).memory_full_info().pss

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=900)
        assert self.proc.returncode == 0, self.proc.stderr.read()[-3000:]


def total_pss(workers: list[Worker]) -> int:
    time.sleep(0.2)  # let a worker's freed memory settle
    return sum(w.pss() for w in workers)


@pytest.fixture
def model_file(tmp_path):
    """The model's file and the digests of the model's own outputs (before and after block 3 is doubled)."""
    torch.manual_seed(0)
    model = worker.build()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    with torch.no_grad():
        want = worker.digest(model(worker.inputs()))
        model[3].weight.mul_(2)
        written = worker.digest(model(worker.inputs()))
    return path, want, written


def _run_processes(path: Path, n: int, share: str) -> tuple[list[int], int, list[Worker], list[str]]:
    """n workers offloading `path` one after another; returns what each added to the total PSS, the first one's
    runtime (what it grew by beyond the model's bytes) and the workers, still running, and their outputs."""
    workers: list[Worker] = []
    added, outs = [], []
    try:
        for _ in range(n):
            workers.append(Worker(path, share))
            before = total_pss(workers)
            outs.append(workers[-1].ask("offload", "out"))
            added.append(total_pss(workers) - before)
    except BaseException:
        for w in workers:
            w.proc.kill()
        raise
    return added, added[0] - MODEL_BYTES, workers, outs


def test_four_processes_share_one_host_copy(model_file):
    """Four local workers (the second, third and fourth each checked against the bound)."""
    path, want, _ = model_file
    n = 4
    added, runtime, workers, outs = _run_processes(path, n, "auto")
    try:
        reports = [w.report() for w in workers]
        segment = reports[0]["segment"]
    finally:
        for w in workers:
            w.quit()
    assert outs == [want] * n  # bitwise the model's own output, in every process
    assert added[0] >= 0.9 * MODEL_BYTES, added  # the first process holds the copy (the measurement sees it)
    for extra in added[1:]:
        assert extra <= max(runtime, 0) + 0.3 * MODEL_BYTES, (added, runtime)
    for rep in reports:
        assert all(rep["shared"]) and rep["host_shared_bytes"] == MODEL_BYTES
        assert rep["segment"] == segment
    assert not os.path.exists(segment)  # the last process out removed it


def test_without_sharing_each_process_holds_its_own_copy(model_file):
    """The control: with share_host="off" the second process adds the model again (so the bound above means
    something)."""
    path, want, _ = model_file
    added, runtime, workers, outs = _run_processes(path, 2, "off")
    try:
        rep = workers[1].report()
    finally:
        for w in workers:
            w.quit()
    assert outs == [want, want]
    assert added[1] > max(runtime, 0) + 0.3 * MODEL_BYTES, (added, runtime)
    assert not any(rep["shared"]) and rep["segment"] is None


def test_processes_share_the_compressed_blocks_in_their_encoded_form(tmp_path):
    """bf16 weights drawn like trained ones under a RAM ceiling of 80% of the model: "auto" holds every block
    compressed. The second process plans with the first one's forms and maps its encoded blobs: it adds at most its
    own runtime plus 30% of the compressed bytes; outputs are bitwise the model's own in both; a process that writes
    a block gets a private blob of that block only; the segment is gone once both let go."""
    torch.manual_seed(0)
    model = worker.build(compressed=True)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    x = worker.inputs(torch.bfloat16)
    with torch.no_grad():
        want = worker.digest(model(x))
        model[3].weight.mul_(2)
        written = worker.digest(model(x))
    extra = ("auto", str(int(0.8 * MODEL_BYTES // 2)))  # bf16: half the fp32 model's bytes
    workers: list[Worker] = []
    added, outs = [], []
    try:
        for _ in range(2):
            workers.append(Worker(path, extra=extra))
            before = total_pss(workers)
            outs.append(workers[-1].ask("offload", "out"))
            added.append(total_pss(workers) - before)
        a, b = workers
        rep_a, rep_b = a.report(), b.report()
        b.ask("write 3", "written")
        assert b.ask("forward", "out") == written
        assert a.ask("forward", "out") == want  # the other process keeps the original bytes
        rep_written = b.report()
    finally:
        for w in workers:
            w.quit() if w.proc.poll() is None else None
    compressed = rep_a["host_bytes"]
    assert outs == [want, want]
    for rep in (rep_a, rep_b):
        assert rep["compression"] == [codec_name()] * worker.BLOCKS and all(rep["shared"])
        assert rep["host_bytes"] == rep["host_shared_bytes"] == compressed <= 0.78 * MODEL_BYTES // 2
        assert rep["segment"] == rep_a["segment"]
    runtime = added[0] - compressed
    assert added[0] >= 0.9 * compressed, added  # the first process holds the copy (the measurement sees it)
    assert added[1] <= max(runtime, 0) + 0.3 * compressed, (added, runtime, compressed)
    assert rep_written["shared"] == [i != 3 for i in range(worker.BLOCKS)]
    assert rep_written["compression"] == [codec_name()] * worker.BLOCKS  # encoded again, privately
    assert not os.path.exists(rep_a["segment"])


def codec_name() -> str:
    from offload.store.codec import CODEC
    return CODEC


def test_a_packed_compressed_folder_shares_its_stored_encoding(tmp_path):
    """A folder packed with --compress, offloaded twice under a RAM ceiling (as two processes would; in one here):
    the first puts each block's stored encoding in the copy, the second maps it; bitwise, and the copy goes with
    the last one."""
    from offload import OffloadConfig, VramBudget, offload_module
    from offload.store.pack_writer import pack_file

    torch.manual_seed(0)
    model = worker.build(compressed=True)
    safetensors_torch.save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    pack_file(tmp_path / "m.safetensors", tmp_path / "m.packed", compress=True)
    x = worker.inputs(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(tmp_path / "m.packed"),
                                    ram_budget_bytes=int(0.8 * MODEL_BYTES // 2))
    models = [worker.build("meta", compressed=True) for _ in range(2)]
    handles = [offload_module(m, cfg, budget=VramBudget(256 << 20)) for m in models]
    try:
        for m in models:
            with torch.no_grad():
                assert torch.equal(m(x), want)
        reports = [h.report() for h in handles]
        segment = handles[0].streamer.staged.shared.path
    finally:
        for h in handles:
            h.detach()
    for rep in reports:
        assert all(b.shared and b.compression == codec_name() for b in rep.blocks)
        assert rep.host_shared_bytes == rep.host_bytes < 0.78 * MODEL_BYTES // 2
    assert not segment.exists()


def test_a_header_with_a_chunk_table_the_codec_would_not_write_is_not_used():
    """The shared copy's header is read like a packed file's index: a chunk whose size is not its parameters'
    makes the whole segment unusable (the process stages its own copy), never a decode out of bounds."""
    from offload.model.layout import Leaf
    from offload.store import codec
    from offload.store.shared_forms import header_json, parse_header

    raw = (torch.randn(8192, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    enc = codec.encode(raw.view(torch.uint8), [Leaf(0, raw.numel() * 2, torch.bfloat16, (raw.numel(),), None)])
    offsets, sizes = {0: 4096}, {0: raw.numel() * 2}
    body = header_json("k", offsets, sizes, [], {0: []}, encoded={0: (enc.size, enc.chunks)})
    assert parse_header(body, "k", offsets, sizes) == ({0: []}, {0: (enc.size, enc.chunks)})
    bad = [c for c in enc.chunks]
    i = next(j for j, c in enumerate(bad) if c.coded)
    bad[i] = codec.Chunk(**{**bad[i].__dict__, "bits": bad[i].bits + 1})  # the same size, another index width
    body = header_json("k", offsets, sizes, [], {0: []}, encoded={0: (enc.size, tuple(bad))})
    assert parse_header(body, "k", offsets, sizes) is None
    assert parse_header(body.replace(b'"k"', b'"other"', 1), "k", offsets, sizes) is None


def test_a_process_that_writes_a_weight_gets_a_private_copy_of_that_block(model_file):
    path, want, written = model_file
    a, b = Worker(path), Worker(path, load="ram")  # b loads the model into RAM first (as ComfyUI does): compared
    try:
        assert a.ask("offload", "out") == want
        assert b.ask("offload", "out") == want
        a.ask("write 3", "written")
        assert a.ask("forward", "out") == written
        assert b.ask("forward", "out") == want  # the other process keeps the original bytes
        rep_a, rep_b = a.report(), b.report()
        assert rep_a["shared"] == [i != 3 for i in range(worker.BLOCKS)]
        assert rep_a["host_shared_bytes"] == MODEL_BYTES - MODEL_BYTES // worker.BLOCKS
        assert all(rep_b["shared"])
        a.ask("detach", "detached")
        assert os.path.exists(rep_b["segment"])  # b still maps it
        b.ask("detach", "detached")
        assert not os.path.exists(rep_b["segment"])
    finally:
        for w in (a, b):
            w.quit()


def _twin_models(tmp_path):
    """Two copies of the worker's model with the same weights, and the safetensors file both offload from (the
    second handle maps the shared copy the first fills, as another process would)."""
    torch.manual_seed(0)
    first, second = worker.build(), worker.build()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(first.state_dict(), str(path))
    second.load_state_dict(first.state_dict())
    return first, second, path


def test_a_process_that_loaded_other_weights_keeps_its_own_copy(tmp_path):
    """Same file, same layout, other bytes in RAM (changed after loading): never the shared copy's bytes."""
    from offload import OffloadConfig, VramBudget, offload_module

    first, second, path = _twin_models(tmp_path)
    with torch.no_grad():
        second[5].weight.add_(1)
        want = second(worker.inputs())
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path))
    h1 = offload_module(first, cfg, budget=VramBudget(256 << 20))
    h2 = offload_module(second, cfg, budget=VramBudget(256 << 20))
    try:
        with torch.no_grad():
            assert torch.equal(second(worker.inputs()), want)
        assert [b.shared for b in h2.report().blocks] == [i != 5 for i in range(worker.BLOCKS)]
        assert all(b.shared for b in h1.report().blocks)
    finally:
        segment = h1.streamer.staged.shared.path
        h1.detach()
        h2.detach()
    assert not segment.exists()


def _saved_model(tmp_path: Path) -> tuple[torch.nn.Module, Path, torch.Tensor, torch.Tensor]:
    """The worker's model (seed 0), its file, an input and the model's own output for it."""
    torch.manual_seed(0)
    model = worker.build()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    x = worker.inputs()
    with torch.no_grad():
        want = model(x)
    return model, path, x, want


def _fail_place_after(n: int, exc: BaseException, monkeypatch) -> None:
    """SharedHostCopy.place raises `exc` from the (n + 1)-th block on (the blocks before it go in)."""
    placed = []
    real_place = shared_host.SharedHostCopy.place

    def failing_place(self, i, *args):
        if len(placed) == n:
            raise exc
        placed.append(i)
        return real_place(self, i, *args)

    monkeypatch.setattr(shared_host.SharedHostCopy, "place", failing_place)


def test_a_staging_that_fails_half_way_leaves_no_copy_behind(tmp_path, monkeypatch):
    """The filler fails during setup after some blocks went into the copy (a RAM ceiling: the copy is filled while
    staging, HostPlan.publish_later is for none): the model is as it was (ordinary tensors, same outputs), the
    half-filled segment is gone, and the next offload fills a complete one."""
    from offload import OffloadConfig, VramBudget, offload_module
    from offload.backends import get_backend

    model, path, x, want = _saved_model(tmp_path)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), sim_capacity_bytes=(1 << 30) + 7,
                                    ram_budget_bytes=1 << 30)
    backend = get_backend(cfg)
    created = []  # this model's segment (other processes on the machine may fill /dev/shm meanwhile)
    real_create = shared_host.SharedHostCopy._create.__func__

    def recording_create(cls, path, *args):
        created.append(path)
        return real_create(cls, path, *args)

    monkeypatch.setattr(shared_host.SharedHostCopy, "_create", classmethod(recording_create))
    _fail_place_after(5, MemoryError("injected"), monkeypatch)
    with pytest.raises(MemoryError):
        offload_module(model, cfg, budget=VramBudget(256 << 20))
    monkeypatch.undo()
    assert len(created) == 1 and not created[0].exists()
    assert not hasattr(model, "_layer_offload_handle")
    with torch.no_grad():
        assert torch.equal(model(x), want)
    h = offload_module(model, cfg, budget=VramBudget(256 << 20))
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert all(b.shared for b in h.report().blocks)
    h.detach()
    assert backend.used_bytes == 0


def test_blocks_go_into_the_copy_after_setup_and_a_failure_there_leaves_the_rest_private(tmp_path, monkeypatch):
    """Without a RAM ceiling the filler stages its blocks in its own RAM (a load as fast as a private one) and a
    thread moves them into the copy after setup, one at a time, each swapped in at a safe point and its private
    buffer freed; a write that fails there (the sixth block) leaves that block and the rest in this process's RAM,
    and the copy is published with the five it holds (a joiner maps those, stages the rest). Outputs are the same
    before, during and after."""
    from offload import OffloadConfig, VramBudget, offload_module

    model, path, x, want = _saved_model(tmp_path)
    _fail_place_after(5, OSError(28, "injected: no space left on device"), monkeypatch)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path))
    h = offload_module(model, cfg, budget=VramBudget(256 << 20))
    try:
        with torch.no_grad():
            assert torch.equal(model(x), want)
        assert h.wait_encoded(60)
        setup = h.report().setup
        assert (setup["publish_units"], setup["published"], setup["publish_kept"]) == (worker.BLOCKS, 5,
                                                                                       worker.BLOCKS - 5)
        from offload.report.metrics import summarize
        assert f"after setup, on a thread: 5 of {worker.BLOCKS} block(s) into the host copy shared between " \
               "processes" in summarize(h.report().to_dict())
        with torch.no_grad():
            assert torch.equal(model(x), want)
        rep = h.report()
        assert [b.shared for b in rep.blocks] == [i < 5 for i in range(worker.BLOCKS)]
        assert rep.host_shared_bytes == 5 * MODEL_BYTES // worker.BLOCKS
        staged = h.streamer.staged
        layouts = [u.layout for u in staged.units]
        forms = shared_host.SharedHostCopy.peek(path, layouts, [u.name for u in staged.units],
                                                directory=staged.shared.path.parent)
        assert sorted(forms) == list(range(5))  # published: the five it holds, a joiner stages the rest
    finally:
        h.detach()
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_ram_given_back_frees_the_copy_only_when_nobody_else_maps_it(tmp_path):
    """Under RAM pressure (ComfyUI's partially_unload_ram, free_pins) blocks move to the disk tier. A block of the
    shared copy frees RAM only when no other process maps the copy: then its pages in the segment go (and a later
    process stages it on its own); while another process maps it, nothing is moved (nothing would be freed). Two
    models of this process (issue 42: two loader nodes of one file, a cached earlier output) share one lock: each
    moves its blocks when asked, and a block's pages go when the last of them has let it go."""
    from offload import OffloadConfig, VramBudget, offload_module

    first, second, path = _twin_models(tmp_path)
    x = worker.inputs()
    with torch.no_grad():
        want = first(x)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path))
    h1 = offload_module(first, cfg, budget=VramBudget(256 << 20))
    other = Worker(path, load="ram")  # another process maps the copy
    try:
        other.ask("offload", "out")
        assert all(other.report()["shared"])
        segment = h1.streamer.staged.shared.path
        held = os.stat(segment).st_blocks * 512
        assert held >= MODEL_BYTES
        assert h1.release_host_memory(1 << 40) == 0 and all(b.shared for b in h1.report().blocks)
    finally:
        other.quit()
    h2 = offload_module(second, cfg, budget=VramBudget(256 << 20))  # another model of this process maps it too
    assert all(b.shared for b in h2.report().blocks)
    assert h1.release_host_memory(1 << 40) == 0, "the blocks' pages stay while the other model holds them"
    assert [b.tier for b in h1.report().blocks] == ["disk"] * worker.BLOCKS
    assert os.stat(segment).st_blocks * 512 == held
    with torch.no_grad():
        assert torch.equal(first(x), want) and torch.equal(second(x), want)
    freed = h2.release_host_memory(1 << 40)  # the last one lets them go: their pages go
    assert freed > MODEL_BYTES // 2
    assert os.stat(segment).st_blocks * 512 <= held - MODEL_BYTES
    with torch.no_grad():
        assert torch.equal(first(x), want) and torch.equal(second(x), want)  # streamed from the file now
    h2.detach()
    third = worker.build("meta")
    h3 = offload_module(third, cfg, budget=VramBudget(256 << 20))  # the blocks given back are its own now
    with torch.no_grad():
        assert torch.equal(third(x), want)
    h3.detach()
    h1.detach()
    assert not segment.exists()


def test_a_write_through_data_is_found_by_its_pages(tmp_path):
    """A write through `.data` (no version counter sees it) announced with `handle.refresh()`: the block whose pages
    turned private in this mapping gets a private copy; another mapping of the copy keeps the original bytes."""
    from offload import OffloadConfig, VramBudget, offload_module

    first, second, path = _twin_models(tmp_path)
    x = worker.inputs()
    with torch.no_grad():
        want = first(x)
        reference = worker.build()
        reference.load_state_dict(first.state_dict())
        reference[2].weight.mul_(3)
        written = reference(x)
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path))
    h1 = offload_module(first, cfg, budget=VramBudget(256 << 20))
    h2 = offload_module(second, cfg, budget=VramBudget(256 << 20))
    try:
        first[2].weight.data.mul_(3)
        h1.refresh()
        assert [b.shared for b in h1.report().blocks] == [i != 2 for i in range(worker.BLOCKS)]
        with torch.no_grad():
            assert torch.equal(first(x), written)
            assert torch.equal(second(x), want)
        assert all(b.shared for b in h2.report().blocks)
    finally:
        h1.detach()
        h2.detach()


def test_a_full_dev_shm_leaves_the_rest_private(tmp_path, monkeypatch):
    """/dev/shm runs out of room (a container's 64 MB): the blocks that did not fit stay in the process's own RAM,
    reserved up front so the copy never dies of SIGBUS; outputs are the same."""
    import errno

    from offload import OffloadConfig, VramBudget, offload_module

    model, path, x, want = _saved_model(tmp_path)
    calls = []

    def fallocate(fd, offset, length):
        calls.append(offset)
        if len(calls) > 4:  # the header's pages (reserved when the copy is created), then three blocks
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(shared_host.os, "posix_fallocate", fallocate)
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", disk_path=str(path),
                                                        ram_budget_bytes=1 << 30),  # filled while staging
                       budget=VramBudget(256 << 20))
    try:
        with torch.no_grad():
            assert torch.equal(model(x), want)
        rep = h.report()
        assert [b.shared for b in rep.blocks] == [i < 3 for i in range(worker.BLOCKS)]
        assert rep.host_shared_bytes == 3 * MODEL_BYTES // worker.BLOCKS
    finally:
        h.detach()


def _layouts(n: int = 2):
    from offload.model.layout import plan_layout, unit_tensors

    blocks = [torch.nn.Linear(8, 8) for _ in range(n)]
    return blocks, [plan_layout(unit_tensors(b)) for b in blocks]


def test_a_segment_with_another_header_is_never_used(tmp_path):
    """A file under the segment's name that is not this model's complete copy: taken over when nobody holds it
    (a filler that died), left alone and not used when someone does."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"x" * 100)
    blocks, layouts = _layouts()
    key = shared_host.segment_key(shared_host.file_identity(path), layouts, ["0", "1"])
    name = tmp_path / shared_host.segment_name(key)
    name.write_bytes(b"\0" * 8192)  # no header: a filler died before writing it
    name.chmod(0o600)
    holder = os.open(name, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # someone still holds it
    try:
        assert shared_host.SharedHostCopy.open(path, layouts, ["0", "1"], {0, 1}, tmp_path) is None
        assert name.read_bytes() == b"\0" * 8192
    finally:
        os.close(holder)
    copy = shared_host.SharedHostCopy.open(path, layouts, ["0", "1"], {0, 1}, tmp_path)  # nobody: taken over
    assert copy is not None and copy.filler
    copy.close()
    assert not name.exists()


def test_a_segment_left_by_a_killed_process_is_swept(tmp_path):
    """A process killed while holding a segment cannot unlink it: the next one to create a segment removes every
    segment nobody holds (older than a minute); one in use stays."""
    left, used = tmp_path / shared_host.segment_name("a" * 40), tmp_path / shared_host.segment_name("b" * 40)
    left.write_bytes(b"1")
    used.write_bytes(b"2")
    left.chmod(0o600)
    used.chmod(0o600)
    old = time.time() - 2 * shared_host.STALE_AFTER_S
    os.utime(left, (old, old))
    os.utime(used, (old, old))
    holder = os.open(used, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        assert shared_host.sweep_stale(tmp_path) == 1
    finally:
        os.close(holder)
    assert not left.exists() and used.exists()


def test_a_write_stops_copies_from_the_pinned_view_at_once(tmp_path):
    """Where the device pins the shared mapping (CUDA), copies come from it while the unit is unwritten; a write in
    this process (its parameters, or the engine into its host views) sends copies to the process's own
    copy-on-write view at once. A backend that 'registers' stands in for CUDA here."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"x" * 100)
    blocks, layouts = _layouts(1)
    want = blocks[0].weight.detach().clone()
    registered, copies = [], []

    class Pinning:
        supports_pinned_host = True

        def register_host(self, buf):
            registered.append(buf.numel())
            return lambda: registered.pop()

        def copy_h2d(self, dst, src, after=None):
            copies.append(src)
            dst.copy_(src)

    from offload.store.stage_reads import fill_from

    copy = shared_host.SharedHostCopy.open(path, layouts, ["0"], {0}, tmp_path)
    try:
        host = copy.place(0, layouts[0], lambda dst: fill_from(layouts[0], dst, None, None))
        layouts[0].build(host, master=True).apply()
        copy.finish(Pinning(), {0})
        assert registered == [layouts[0].nbytes]
        unit = copy.unit(0, host, layouts[0])
        source = SharedSource(unit, Pinning())
        dst = torch.empty(layouts[0].nbytes, dtype=torch.uint8)
        source.issue(dst, None)
        assert copies[-1].data_ptr() == unit.pinned_view.data_ptr() != host.data_ptr()
        assert not unit.written() and not unit.has_private_pages()
        with torch.no_grad():
            blocks[0].weight.add_(1)
        assert unit.written() and unit.has_private_pages()
        source.issue(dst, None)
        assert copies[-1].data_ptr() == host.data_ptr()
        assert torch.equal(unit.pinned_view[:want.numel() * 4].view(torch.float32).view_as(want), want)  # unchanged
    finally:
        del copies[:]
        copy.close()
    assert registered == []  # unregistered when let go


@pytest.mark.cuda
def test_on_cuda_the_copy_is_pinned_read_only_and_a_write_stays_private(tmp_path):
    """On a GPU the shared mapping is registered (cudaHostRegister, read-only) for the blocks the plan pins: copies
    come from it; a block written in place gets a private (pinned) master at the next forward; outputs are bitwise
    the resident model's."""
    from offload import OffloadConfig, VramBudget, offload_module

    torch.manual_seed(0)
    model = worker.build()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    x = worker.inputs()
    with torch.no_grad():
        want = model.cuda()(x.cuda()).cpu()
        model[2].weight.mul_(3)
        written = model(x.cuda()).cpu()
    offloaded = worker.build("meta")
    h = offload_module(offloaded, OffloadConfig.from_preset("budget", device="cuda", disk_path=str(path)),
                       budget=VramBudget(256 << 20))
    try:
        assert h.wait_encoded(60)  # this process fills the copy: its blocks move in after setup, pinned there
        assert h.host_memory()["pinned"] >= MODEL_BYTES and h.host_memory()["shared"] == MODEL_BYTES
        with torch.no_grad():
            assert torch.equal(offloaded(x.cuda()).cpu(), want)
            offloaded[2].weight.mul_(3)
            assert torch.equal(offloaded(x.cuda()).cpu(), written)
        assert [b.shared for b in h.report().blocks] == [i != 2 for i in range(worker.BLOCKS)]
    finally:
        h.detach()
