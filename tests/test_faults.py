"""Fault injection on the simulated device: what users' machines do to a streaming model.

Files changed under a disk-tier model (truncated, rewritten in place, deleted), allocation failures at every
allocation site, a transfer that fails mid-pass, an exception at every hook, models dropped without detach with
the cycle collector off, several threads calling one model, a forward interrupted by Ctrl-C, memory pressure
that passes, and every public entry
point used in the wrong state. Everything goes through the public API; scenarios that could kill the process
(SIGBUS from a truncated mapping) run in a child process, so a crash is a test failure, not the end of the run.
"""
from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
from typing import Callable

import pytest
import torch

from offload import BudgetError, DetachedError, DeviceMemoryError, OffloadConfig, VramBudget, offload_module
from offload.backends import get_backend
from tests.models import LayersModel, TransformerStack, aligned_bytes, resident_modules, run, seeded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPTH = 6
_caps = itertools.count(1)


def _private(**kw) -> dict:
    """A simulated device of its own (backends are shared per setting), so its accounting is this test's alone."""
    kw.setdefault("sim_capacity_bytes", (64 << 20) + 4096 * next(_caps) + 13)
    return kw


def _model(seed: int = 0):
    return seeded(LayersModel, dim=64, depth=DEPTH, seed=seed)


def _x():
    return torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------------------------
# the disk-tier file changes while the model streams from it (child processes: SIGBUS must not happen)
# ----------------------------------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import gc, os, sys
    import torch
    sys.path.insert(0, {root!r})
    from safetensors.torch import save_file
    from offload import OffloadConfig, SourceChangedError, VramBudget, offload_module
    from tests.models import LayersModel, aligned_bytes, run, seeded

    path = {path!r}
    model = seeded(LayersModel, dim=64, depth=6)
    other = seeded(LayersModel, dim=64, depth=6, seed=9)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(7))
    ref = run(model, (x,))
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, path)
    blk = aligned_bytes(model.layers[0])
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=path, ram_budget_bytes=blk, prefetch=2)
    handle = offload_module(model, cfg, budget=VramBudget(None))
    tiers = [b.tier for b in handle.report().blocks]
    assert tiers.count("disk") >= 4, tiers
    assert torch.equal(run(model, (x,)), ref)
    size = os.path.getsize(path)

    def truncate():
        os.truncate(path, size // 2)

    def rewrite():
        data = open(path, "rb").read()
        header = 8 + int.from_bytes(data[:8], "little")
        other_sd = {{k: v.contiguous() for k, v in other.state_dict().items()}}
        save_file(other_sd, path + ".other")
        new = open(path + ".other", "rb").read()
        assert len(new) == len(data) and new[:header] == data[:header], "same layout, other bytes"
        with open(path, "r+b") as f:  # in place: same inode, same size
            f.write(new)

    def delete():
        os.remove(path)

    def replace():  # a re-download: a new file renamed over the old one
        save_file({{k: v.contiguous() for k, v in other.state_dict().items()}}, path + ".new")
        os.replace(path + ".new", path)

    scenario = {scenario!r}
    when = {when!r}
    change = {{"truncate": truncate, "rewrite": rewrite, "delete": delete, "replace": replace}}[scenario]
    if when == "between":
        change()
    else:  # in the middle of a pass: at the third unit's forward
        hook = model.layers[2].register_forward_pre_hook(lambda m, a: change())
    outcomes = []
    for i in range(3):
        try:
            out = run(model, (x,))
            outcomes.append("exact" if torch.equal(out, ref) else "DIFFERENT")
        except SourceChangedError as err:
            assert path in str(err), err
            outcomes.append("error")
        if when == "mid" and i == 0:
            hook.remove()
    try:
        handle.detach()
        detached = "detached"
        assert torch.equal(run(model, (x,)), ref), "detached weights differ from the original ones"
    except SourceChangedError as err:
        assert path in str(err), err
        detached = "refused"
    del model, handle
    gc.collect()
    print("RESULT", ",".join(outcomes), detached)
""")


def _child(tmp_path, scenario: str, when: str) -> tuple[list[str], str]:
    script = CHILD.format(root=ROOT, path=str(tmp_path / "m.safetensors"), scenario=scenario, when=when)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=ROOT)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, f"the process died (return code {proc.returncode}; -7 is SIGBUS):\n{tail}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    _, outcomes, detached = line.split()
    return outcomes.split(","), detached


@pytest.mark.parametrize("when", ["between", "mid"])
@pytest.mark.parametrize("scenario", ["truncate", "rewrite"])
def test_file_changed_under_a_streaming_model_is_a_clear_error(tmp_path, scenario, when):
    outcomes, detached = _child(tmp_path, scenario, when)
    assert "DIFFERENT" not in outcomes, f"a changed file silently gave other outputs: {outcomes}"
    if when == "between":
        assert outcomes == ["error"] * 3, outcomes
    else:  # units read before the change were the original bytes: that pass may finish exactly
        assert outcomes[0] in ("exact", "error") and outcomes[1:] == ["error", "error"], outcomes
    assert detached == "refused", "detach must not hand back weights read from a changed file"


@pytest.mark.parametrize("scenario", ["delete", "replace"])
def test_file_deleted_or_replaced_keeps_streaming_the_original_bytes(tmp_path, scenario):
    """The open file stays readable after unlink or a rename over it: the model keeps its weights exactly."""
    outcomes, detached = _child(tmp_path, scenario, "between")
    assert outcomes == ["exact"] * 3, outcomes
    assert detached == "detached"


# ----------------------------------------------------------------------------------------------------------------
# allocation failures, failed transfers, exceptions at every hook
# ----------------------------------------------------------------------------------------------------------------


def _no_hooks(model) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


class _FailNth:
    """Wraps a backend method: the n-th call raises `exc` (counting from 0), the others pass through."""

    def __init__(self, real, n: int, exc: BaseException) -> None:
        self.real, self.n, self.exc, self.calls = real, n, exc, 0

    def __call__(self, *a, **kw):
        k = self.calls
        self.calls += 1
        if k == self.n:
            raise self.exc
        return self.real(*a, **kw)


def _count_calls(monkeypatch, backend, name: str, fn) -> int:
    """How many times `name` is called on `backend` while fn() runs."""
    counter = _FailNth(getattr(backend, name), -1, RuntimeError())
    monkeypatch.setattr(backend, name, counter)
    fn()
    monkeypatch.undo()
    return counter.calls


@pytest.mark.parametrize("preset", ["budget", "mid_range", "auto"])
def test_device_allocation_failure_at_every_site(monkeypatch, preset):
    """Every device allocation (non-block weights, resident units, slots) failing once in turn: the model either
    runs exactly (the resident set shrank) or raises a clear DeviceMemoryError, and the next call works."""
    x = _x()
    ref = run(_model(), (x,))
    cfg = OffloadConfig.from_preset(preset, device="sim", **_private())
    backend = get_backend(cfg)

    def session():
        model = _model()
        h = offload_module(model, cfg, budget=VramBudget(None))
        out = run(model, (x,))
        h.detach()
        return out

    n = _count_calls(monkeypatch, backend, "alloc", session)
    assert n >= 2
    for k in range(n):
        model = _model()
        h = offload_module(model, cfg, budget=VramBudget(None))
        monkeypatch.setattr(backend, "alloc", _FailNth(backend.alloc, k,
                                                       torch.OutOfMemoryError("injected: device full")))
        try:
            out = run(model, (x,))
            assert torch.equal(out, ref), f"allocation {k} failed: wrong output"
        except DeviceMemoryError as err:
            assert "out of device memory" in str(err) or "budget" in str(err), err
        monkeypatch.undo()
        assert torch.equal(run(model, (x,)), ref), f"allocation {k} failed: the next forward is wrong"
        h.detach()
        assert torch.equal(run(model, (x,)), ref)
    assert backend.used_bytes == 0, "every failed placement gave its device memory back"


def test_host_allocation_failure_at_every_site_leaves_the_model_untouched(monkeypatch, tmp_path):
    """Host staging buffers and bounce buffers failing in turn: offload_module raises, the model is exactly as it
    was (no hooks, ordinary tensors, same outputs), and a later offload of it works."""
    from safetensors.torch import save_file

    x = _x()
    model = _model()
    ref = run(model, (x,))
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path), share_host="off",  # own buffers
                                    ram_budget_bytes=3 * aligned_bytes(model.layers[0]), **_private())
    backend = get_backend(cfg)
    n = _count_calls(monkeypatch, backend, "alloc_host",
                     lambda: offload_module(_model(), cfg, budget=VramBudget(None)).detach())
    assert n >= DEPTH
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for k in range(n):
        monkeypatch.setattr(backend, "alloc_host", _FailNth(backend.alloc_host, k, MemoryError("injected")))
        with pytest.raises(MemoryError):
            offload_module(model, cfg, budget=VramBudget(None))
        monkeypatch.undo()
        assert _no_hooks(model), f"host allocation {k}: hooks left behind"
        assert not hasattr(model, "_layer_offload_handle")
        for name, v in model.state_dict().items():
            assert torch.equal(v, before[name]), f"host allocation {k}: {name} changed"
        assert torch.equal(run(model, (x,)), ref)
    h = offload_module(model, cfg, budget=VramBudget(None))
    assert torch.equal(run(model, (x,)), ref)
    h.detach()


def test_a_transfer_that_fails_mid_pass(monkeypatch):
    """One host-to-device copy fails: it is retried once (the forward stays exact); a copy that keeps failing makes
    the forward raise; either way the next forwards are exact and the ring is whole."""
    import offload.backends.sim as sim

    x = _x()
    model = _model()
    ref = run(model, (x,))
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=VramBudget(None))
    assert torch.equal(run(model, (x,)), ref)
    for k in range(2 * DEPTH):
        real = sim.copy_bytes
        calls = itertools.count()

        def flaky(dst, src, k=k):
            if next(calls) == k:
                raise OSError("injected: PCIe error")
            real(dst, src)

        monkeypatch.setattr(sim, "copy_bytes", flaky)
        try:
            out = run(model, (x,))
            assert torch.equal(out, ref), f"copy {k} failed: wrong output"  # the failed copy was never used
        except RuntimeError as err:
            assert "injected" in str(err), err
        monkeypatch.setattr(sim, "copy_bytes", real)
        for _ in range(2):
            assert torch.equal(run(model, (x,)), ref), f"after failed copy {k}"

    def broken(dst, src):
        raise OSError("injected: the link is down")

    monkeypatch.setattr(sim, "copy_bytes", broken)  # a persistent failure is not retried forever: it raises
    with pytest.raises(RuntimeError, match="link is down"):
        run(model, (x,))
    monkeypatch.undo()
    for _ in range(2):
        assert torch.equal(run(model, (x,)), ref), "after the link came back"
    assert h.report().slots >= 1
    h.detach()


@pytest.mark.parametrize("where", ["pre", "post", "inside"])
def test_an_exception_at_every_hook_leaves_the_model_exact(where):
    """An exception (a user interrupt) raised before, inside or after each unit in turn: nothing leaks, the next
    forward is exact, device memory stays within the plan."""
    x = _x()
    model = _model()
    ref = run(model, (x,))
    h = offload_module(model, OffloadConfig.from_preset("mid_range", device="sim", **_private()),
                       budget=VramBudget(None))
    assert torch.equal(run(model, (x,)), ref)
    steady = h.device_bytes()

    class Interrupt(Exception):
        pass

    def boom(*a):
        raise Interrupt()

    for i in range(DEPTH):
        layer = model.layers[i]
        if where == "pre":
            hook = layer.register_forward_pre_hook(boom)
        elif where == "post":
            hook = layer.register_forward_hook(boom)
        else:
            hook = layer.fc2.register_forward_pre_hook(boom)
        with pytest.raises(Interrupt):
            run(model, (x,))
        hook.remove()
        assert torch.equal(run(model, (x,)), ref), f"after an exception at unit {i} ({where})"
        assert h.device_bytes() == steady
    h.detach()
    assert _no_hooks(model)


# ----------------------------------------------------------------------------------------------------------------
# lifetimes without the cycle collector
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_dropped_model_is_freed_without_the_cycle_collector(no_gc):
    import weakref

    cfg = OffloadConfig.from_preset("mid_range", device="sim", **_private())
    backend = get_backend(cfg)
    budget = VramBudget(None)
    model = _model()
    h = offload_module(model, cfg, budget=budget, name="dropped")
    run(model, (_x(),))
    assert backend.used_bytes > 0 and len(budget.members) == 1
    refs = [weakref.ref(model), weakref.ref(h), weakref.ref(model.layers[0].fc1.weight)]
    del model, h
    assert all(r() is None for r in refs), "model, handle and weights must be freed by reference counting alone"
    assert backend.used_bytes == 0, "its device memory is given back at once"
    assert budget.members == [] and budget.used_bytes == 0


def test_model_kept_alive_by_itself_even_with_the_handle_dropped(no_gc):
    model = _model()
    x = _x()
    ref = run(model, (x,))
    budget = VramBudget(None)
    offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=budget)
    assert torch.equal(run(model, (x,)), ref)
    assert len(budget.members) == 1 and budget.used_bytes > 0


RSS_LOOP = textwrap.dedent("""
    import ctypes, gc, json, sys
    import torch
    sys.path.insert(0, {root!r})
    from safetensors.torch import save_file
    from offload import OffloadConfig, VramBudget, offload_module
    from tests.models import TransformerStack, run, seeded

    def rss():
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))

    gc.disable()
    x = torch.randn(1, 4, 256)
    model = seeded(TransformerStack, dim=256, depth=6)
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, {path!r})
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    cfg_ram = OffloadConfig.from_preset("budget", device="sim", **{private!r})
    cfg_disk = cfg_ram.replace(disk_path={path!r}, ram_budget_bytes=size // 3)
    samples = []
    for i in range(28):
        model = seeded(TransformerStack, dim=256, depth=6)
        h = offload_module(model, cfg_disk if i % 2 else cfg_ram, budget=VramBudget(None))
        run(model, (x,))
        if i % 3 == 0:
            h.detach()
        del model, h
        samples.append(rss())
    import threading
    left = [t.name for t in threading.enumerate() if "read-ahead" in t.name]
    print("RESULT " + json.dumps({{"size": size, "samples": samples, "left": left}}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_models_created_and_dropped_in_a_loop_keep_rss_flat(tmp_path):
    """Loading, running and dropping an offloaded model many times (as ComfyUI does per prompt) holds RSS flat.

    Measured in a fresh process without the cycle collector: inside the suite, earlier tests' worker arenas and
    threads make the process's RSS swing by more than a model, whatever this loop does."""
    import json

    script = RSS_LOOP.format(root=ROOT, path=str(tmp_path / "t.safetensors"), private=_private())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[len("RESULT "):])
    size, samples = result["size"], result["samples"]
    # Compare the lowest of five readings after warm-up with the lowest of the last five (a single reading swings by
    # a worker thread's arena). A model kept per prompt would add 19 sizes; half a size covers the noise.
    start, end = min(samples[4:9]), min(samples[-5:])
    grown = end - start
    assert grown < size // 2, f"RSS grew by {grown / 2**20:.1f} MiB over 19 models of {size / 2**20:.1f} MiB"
    assert not result["left"], f"read-ahead threads left running: {result['left']}"


# ----------------------------------------------------------------------------------------------------------------
# threads, memory pressure that passes, entry points in the wrong state
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["budget", "mid_range"])
def test_one_model_called_from_several_threads(preset):
    x = [torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    model = _model()
    refs = [run(model, (xi,)) for xi in x]
    h = offload_module(model, OffloadConfig.from_preset(preset, device="sim", sim_bandwidth_gbps=2.0, **_private()),
                       budget=VramBudget(None))
    errors, results = [], {}

    def worker(t):
        try:
            for k in range(6):
                results[(t, k)] = torch.equal(run(model, (x[t],)), refs[t])
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not errors, errors
    assert len(results) == 24 and all(results.values()), results
    h.detach()


class _InterruptOnce:
    """A forward pre-hook raising KeyboardInterrupt (Ctrl-C) the first time: torch skips always-called hooks then."""

    def __init__(self) -> None:
        self.fired = False

    def __call__(self, module: torch.nn.Module, args: object) -> None:
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def _interrupt(call: Callable[[], object], module: torch.nn.Module) -> None:
    hook = module.register_forward_pre_hook(_InterruptOnce())  # after the engine's: the unit is in place
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        hook.remove()


def _run_in_thread(model, x, timeout: float = 300.0):  # a guard against a hang, not a speed bound
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", run(model, (x,))), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "another thread still waits for the interrupted pass"
    return result["out"]


@pytest.mark.parametrize("preset,where", [("budget", "streamed"), ("mid_range", "resident"),
                                          ("budget", "outside_root"), ("mid_range", "outside_root_resident")])
def test_interrupted_forward_frees_the_model(preset, where):
    """Ctrl-C inside a unit (mid-pass, or a unit called on its own) leaves nothing held: the next forward, on this
    thread or another, runs a fresh pass with the same outputs and the same device memory, and detach works."""
    model, x = _model(), _x()
    ref = run(model, (x,))
    xu = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    unit_ref = run(model.layers[2], (xu,))
    h = offload_module(model, OffloadConfig.from_preset(preset, device="sim", **_private()), budget=VramBudget(None))
    assert torch.equal(run(model, (x,)), ref)
    used = h.backend.used_bytes
    resident = set(map(id, resident_modules(h)))
    wanted_resident = where.endswith("resident")
    unit = next(m for m in model.layers if (id(m) in resident) == wanted_resident)
    if where.startswith("outside_root"):
        _interrupt(lambda: run(unit, (torch.randn(2, 5, 64),)), unit.fc2)
    else:
        _interrupt(lambda: run(model, (x,)), unit.fc2)
    assert _run_in_thread(model, x).equal(ref), "another thread runs the model after the interrupt"
    assert not h.is_busy()
    assert h.backend.used_bytes == used, "the interrupted unit's slot went back to the ring"
    if where.startswith("outside_root"):
        _interrupt(lambda: run(unit, (torch.randn(2, 5, 64),)), unit.fc2)
    else:
        _interrupt(lambda: run(model, (x,)), unit.fc2)
    h.reset_stats()
    assert torch.equal(run(model, (x,)), ref), "the same thread runs a fresh pass"
    assert not h.is_busy()
    assert h.report().blocks and all(b.calls == 1 for b in h.report().blocks), "one whole pass was counted"
    assert torch.equal(run(model.layers[2], (xu,)), unit_ref), "a unit called on its own still runs"
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_interrupted_thread_that_ended_does_not_block_the_next():
    """A worker thread interrupted mid-pass and gone (a cancelled request in a web UI): the next caller takes over."""
    model, x = _model(), _x()
    ref = run(model, (x,))
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=VramBudget(None))
    errors = []

    def cancelled():
        try:
            _interrupt(lambda: run(model, (x,)), model.layers[3].fc1)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    t = threading.Thread(target=cancelled)
    t.start()
    t.join(300)
    assert not errors, errors
    assert torch.equal(_run_in_thread(model, x), ref)
    assert torch.equal(run(model, (x,)), ref)
    assert not h.is_busy()
    h.detach()


def _swap(module: torch.nn.Module, name: str, value: Callable[[], torch.Tensor]) -> None:
    """What ComfyUI's LoRA patching does: the value computed in inference mode, set as a new Parameter object."""
    with torch.inference_mode():
        module._parameters[name] = torch.nn.Parameter(value(), requires_grad=False)


@pytest.mark.parametrize("preset", ["budget", "mid_range", "high_end"])
def test_parameters_replaced_by_another_owner(preset):
    """Another owner of the same module (a plain ComfyUI clone baking a LoRA in) swaps in its own Parameters, in a
    block and outside the blocks, with other bytes: the model runs with them, the engine's host copy is untouched,
    and once the owner puts back Parameters over the engine's bytes the engine takes its own objects back."""
    import copy

    model, x = _model(), _x()
    ref = run(model, (x,))
    patched = copy.deepcopy(model)
    h = offload_module(model, OffloadConfig.from_preset(preset, device="sim", **_private()), budget=VramBudget(None))
    with torch.inference_mode():
        assert torch.equal(model(x), ref)
    sites = [(model.layers[2].fc1, patched.layers[2].fc1), (model.out, patched.out)]
    ours = [m.weight for m, _ in sites]
    for (m, p), own in zip(sites, ours):
        delta = torch.full_like(p.weight, 0.25)
        p.weight.data += delta
        _swap(m, "weight", lambda: own.detach().cpu() + delta)
    expected = run(patched, (x,))
    assert not torch.equal(expected, ref)
    for reload in (False, True, False):  # `unload` first: the next pass places the rest and resident blocks again
        if reload:
            h.unload()
        with torch.inference_mode():
            assert torch.equal(model(x), expected)
    for (m, _), own in zip(sites, ours):
        _swap(m, "weight", lambda: own)  # the owner's backup restored: a new Parameter over the engine's own bytes
    with torch.inference_mode():
        assert torch.equal(model(x), ref), "the engine's host copy must not have taken the other owner's bytes"
    assert all(m.weight is own for (m, _), own in zip(sites, ours)), "the engine takes its own Parameters back"
    h.detach()
    assert torch.equal(run(model, (x,)), ref)


def test_units_on_another_owners_weights_are_not_copied():
    """While a streamed unit runs on another owner's Parameters, the prefetch worker copies only the units the engine
    still streams: every pass moves exactly their bytes, none for the foreign unit and no wasted lookahead."""
    model, x = _model(), _x()
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=VramBudget(None))
    run(model, (x,))
    h.reset_stats()
    run(model, (x,))
    sizes = {b.name: b.bytes_streamed for b in h.report().blocks if b.tier != "vram"}
    assert "layers.2" in sizes and all(sizes.values())
    copied = []
    copy_h2d = h.backend.copy_h2d

    def counting(dst, src, after=None):
        copied.append(src.numel() * src.element_size())
        return copy_h2d(dst, src, after)

    h.backend.copy_h2d = counting
    _swap(model.layers[2].fc1, "weight", lambda: torch.ones(128, 64))
    run(model, (x,))  # the pass that notices: queued copies are dropped and the lookahead restarts without it
    copied.clear()
    h.reset_stats()
    for _ in range(3):
        run(model, (x,))
    moved = {b.name: b.bytes_streamed for b in h.report().blocks if b.tier != "vram"}
    assert moved["layers.2"] == 0
    assert sum(copied) == 3 * (sum(sizes.values()) - sizes["layers.2"]), "only the engine's streamed units are copied"
    h.backend.copy_h2d = copy_h2d
    h.detach()


def test_resident_set_grows_back_after_memory_pressure_passes():
    """An allocation outside the budget fills the device: the model shrinks its resident set instead of failing,
    and once that memory is freed it grows back at a later pass start, without thrashing meanwhile."""
    model = _model()
    x = _x()
    ref = run(model, (x,))
    full = aligned_bytes(model)
    cfg = OffloadConfig.from_preset("auto", device="sim", sim_capacity_bytes=2 * full + 4096 * next(_caps))
    backend = get_backend(cfg)
    h = offload_module(model, cfg, budget=VramBudget(full + 64 * 1024))
    assert torch.equal(run(model, (x,)), ref)
    assert len(resident_modules(h)) == DEPTH
    h.unload()
    blocker = backend.alloc(backend.mem_get_info()[0] - full // 3)  # another program takes most of the card
    assert torch.equal(run(model, (x,)), ref)
    shrunk = len(resident_modules(h))
    assert shrunk < DEPTH, "the model must shrink to fit what is left"
    assert "oom_shrink" in {n["kind"] for n in h.report().notices}
    for _ in range(2):  # nothing freed yet: stays as it is (no retry storm)
        assert torch.equal(run(model, (x,)), ref)
        assert len(resident_modules(h)) == shrunk
    backend.release(blocker)
    del blocker
    assert torch.equal(run(model, (x,)), ref)
    assert len(resident_modules(h)) == DEPTH, "the resident set grows back once the memory is free"
    h.detach()


def test_entry_points_after_detach_raise_clearly():
    model = _model()
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=VramBudget(None))
    run(model, (_x(),))
    h.detach()
    for call in (h.load, h.unload, h.refresh, h.prioritize, h.reset_stats, lambda: h.set_priority(3)):
        with pytest.raises(DetachedError, match="detach"):
            call()
    assert h.device_bytes() == 0
    assert h.report().forwards >= 1, "the last report stays readable"
    h.detach()  # twice is harmless


@pytest.mark.parametrize("call, bad", [("set_priority", "high"), ("set_priority", float("nan")),
                                       ("set_priority", 1.5), ("unload", -1), ("unload", "all")])
def test_entry_point_arguments_are_checked(call, bad):
    model = _model()
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=VramBudget(None))
    with pytest.raises(ValueError):
        getattr(h, call)(bad)
    assert torch.equal(run(model, (_x(),)), run(_model(), (_x(),)))
    h.detach()


def test_budget_below_one_models_ring_is_refused_naming_the_minimum():
    model = _model()
    budget = VramBudget(None)
    h = offload_module(model, OffloadConfig.from_preset("budget", device="sim", **_private()), budget=budget, name="m")
    run(model, (_x(),))
    before = budget.total_bytes
    with pytest.raises(BudgetError) as err:
        budget.set_total(1073)
    msg = str(err.value)
    assert "'m'" in msg and str(budget.minimum_bytes()) in msg, msg
    assert budget.total_bytes == before, "a refused total leaves the old one in place"
    h.detach()


def test_budget_errors_say_where_the_budget_came_from():
    budget = VramBudget(2048, origin="set by a VRAM Budget node (budget_gb=0.000002)")
    with pytest.raises(DeviceMemoryError) as err:
        offload_module(_model(), OffloadConfig.from_preset("budget", device="sim", **_private()), budget=budget)
    msg = str(err.value)
    assert "VRAM Budget node (budget_gb=0.000002)" in msg and "set_total" in msg, msg
