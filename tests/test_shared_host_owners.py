"""The shared host copy next to other users (issue 41, offload/store/shm_segment.py): only our own segments are used.

Anyone who can read a model file can compute its segment's name and create a file under it in /dev/shm. Before: a
model built on the meta device and read from its file joined such a file (another user's, made readable, its bytes
edited) and computed with the edited weights; another user's private one made a PermissionError warning. Now a
segment is used only when it is a regular file of this process's effective uid with no group/other permission bits
(and the expected size); the name carries the uid, so two users never meet at one name; anything else under our
name is never opened (lstat first; fstat on the O_NOFOLLOW | O_NONBLOCK descriptor that gets mapped), never
removed, and costs the process its shared copy only (a private one, one debug line).

The segments live in a tmpfs mounted for the test (as root; else a private sticky folder like /dev/shm), named by
`LAYER_OFFLOAD_SHM_DIR`. Files of another uid (chown) and processes of other uids (tests/shared_host_worker.py drops to
the uid after its imports) need root: those tests skip without it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests import shared_host_worker as worker

safetensors_torch = pytest.importorskip("safetensors.torch")
shared_host = pytest.importorskip("offload.store.shared_host")
pytestmark = pytest.mark.skipif(not shared_host.fcntl or not os.path.isdir("/proc/self"), reason="needs Linux")

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files and processes of other uids "
                                                          "(chown, setuid)")
UID_A, UID_B, UID_C, UID_D = 43101, 43102, 43103, 43104  # users no one else on the machine is
WIDTH = 256  # tests/shared_host_worker.py's model at this width: 16 blocks of 256 KiB


@pytest.fixture
def shm_dir(monkeypatch):
    """A tmpfs of our own (mode 1777, as /dev/shm) for the segments; a sticky private folder where mounting fails."""
    d = Path(tempfile.mkdtemp(prefix="lo-shm-"))
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256m,mode=1777", "tmpfs", str(d)], capture_output=True).returncode == 0
    if not mounted:
        d.chmod(0o1777)
    monkeypatch.setenv("LAYER_OFFLOAD_SHM_DIR", str(d))
    yield d
    if mounted and subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def model_file(monkeypatch):
    """The worker's model at WIDTH in a file every user may read; the digest of the model's own output."""
    monkeypatch.setattr(worker, "WIDTH", WIDTH)
    d = Path(tempfile.mkdtemp(prefix="lo-model-"))
    d.chmod(0o755)
    torch.manual_seed(0)
    model = worker.build()
    path = d / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    path.chmod(0o644)
    with torch.no_grad():
        want = model(worker.inputs())
    yield path, want
    shutil.rmtree(d, ignore_errors=True)


def _offload(model, path):
    from offload import OffloadConfig, VramBudget, offload_module

    cfg = OffloadConfig.from_preset("budget", device="sim", disk_path=str(path))
    return offload_module(model, cfg, budget=VramBudget(256 << 20))


def _edited_copy(path: Path) -> tuple[bytes, Path]:
    """The bytes of a complete segment of this model with every block's first 256 bytes changed, and its name (the
    segment is filled by an offload of ours and let go)."""
    from safetensors.torch import load_file

    model = worker.build()
    model.load_state_dict(load_file(str(path)))
    h = _offload(model, path)
    copy = h.streamer.staged.shared
    data, name = bytearray(copy.path.read_bytes()), copy.path
    for i, off in copy.offsets.items():
        data[off:off + 256] = b"\x40" * 256
    h.detach()
    assert not name.exists()
    return bytes(data), name


def _squat(kind: str, path: Path) -> Path:
    """Put a file of `kind` under the name our process will look for."""
    data, name = _edited_copy(path)
    if kind == "directory":
        name.mkdir()
    elif kind == "fifo":
        os.mkfifo(name, 0o600)
    elif kind == "symlink":  # to a file of ours with the edited bytes: the name itself is no regular file
        target = name.with_name("elsewhere")
        target.write_bytes(data)
        target.chmod(0o600)
        name.symlink_to(target)
    else:
        mode = 0o644 if kind.endswith("0644") else 0o600
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        os.write(fd, data)
        os.fchmod(fd, mode)
        os.close(fd)
        if kind.startswith("other_uid"):
            os.chown(name, UID_A, UID_A)
    return name


def _fingerprint(name: Path) -> tuple:
    st = os.lstat(name)
    body = hashlib.sha256(name.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
    return st.st_ino, st.st_uid, st.st_mode, st.st_mtime_ns, body


KINDS = [pytest.param("other_uid_0644", "meta", marks=ROOT_ONLY, id="other-uid-0644-edited-meta"),
         pytest.param("other_uid_0644", "ram", marks=ROOT_ONLY, id="other-uid-0644-edited-ram"),
         pytest.param("other_uid_0600", "meta", marks=ROOT_ONLY, id="other-uid-0600-meta"),
         pytest.param("ours_0644", "meta", id="our-uid-but-0644-meta"),
         pytest.param("symlink", "meta", id="symlink-to-our-edited-copy-meta"),
         pytest.param("fifo", "meta", id="fifo-meta"),
         pytest.param("directory", "meta", id="directory-meta")]


@pytest.mark.parametrize("kind,load", KINDS)
def test_a_file_not_ours_under_our_name_is_never_opened_nor_removed(shm_dir, model_file, monkeypatch, caplog,
                                                                    kind, load):
    """The model's output is the file's, no block is shared, the file under our name is as it was (not removed, not
    changed), it was never opened, and the process said so in one debug line (no warning)."""
    path, want = model_file
    name = _squat(kind, path)
    before = _fingerprint(name)
    opened = []
    real_open = os.open

    def recording_open(p, *args, **kwargs):
        opened.append(os.fspath(p))
        return real_open(p, *args, **kwargs)

    if load == "meta":
        model = worker.build("meta")
    else:
        from safetensors.torch import load_file
        model = worker.build()
        model.load_state_dict(load_file(str(path)))
    caplog.set_level(logging.DEBUG, logger="offload.store")
    with monkeypatch.context() as patched:
        patched.setattr(os, "open", recording_open)
        h = _offload(model, path)
    try:
        with torch.no_grad():
            assert torch.equal(model(worker.inputs()), want)
        assert not any(b.shared for b in h.report().blocks)
        assert h.streamer.staged.shared is None
    finally:
        h.detach()
    assert _fingerprint(name) == before
    assert str(name) not in opened
    said = [r for r in caplog.records if str(name) in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG, [r.getMessage() for r in said]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("offload.store")]


@ROOT_ONLY
def test_the_sweep_removes_only_our_own_stale_segments(shm_dir):
    """A killed process's segment of ours goes; another user's, and a file of ours with group/other bits, stay."""
    import time

    old = time.time() - 2 * shared_host.STALE_AFTER_S
    files = {}
    for label, uid, mode in (("ours", os.geteuid(), 0o600), ("theirs", UID_A, 0o600), ("ours_open", os.geteuid(),
                                                                                        0o644)):
        f = shm_dir / shared_host.segment_name(label.ljust(40, "0"), uid=uid)
        f.write_bytes(b"x")
        f.chmod(mode)
        os.chown(f, uid, uid)
        os.utime(f, (old, old))
        files[label] = f
    assert shared_host.sweep_stale() == 1
    assert not files["ours"].exists() and files["theirs"].exists() and files["ours_open"].exists()


def _as(uid: int) -> dict[str, str]:
    return {"LO_TEST_AS_UID": str(uid), "LO_TEST_WIDTH": str(WIDTH), "LAYER_OFFLOAD_SHM_DIR": os.environ[
        "LAYER_OFFLOAD_SHM_DIR"]}


@ROOT_ONLY
def test_two_users_each_share_their_own_copy_and_a_squatted_name_costs_a_private_copy(shm_dir, model_file):
    """Processes of two uids offload the same file: each uid's processes share one segment of their own (named with
    the uid, owned by it, 0600), never the other's. A process of uid A then writes an edited copy of its segment,
    readable by all (0644) or not (0600), under the names uid C's and uid D's processes look for: those compute the
    file's output from a private copy (meta and RAM loads); the squatted files are left alone."""
    from tests.test_shared_host import Worker

    path, want = model_file
    digest = worker.digest(want)
    workers = []

    def start(uid: int, load: str = "meta"):
        workers.append(Worker(path, load=load, env=_as(uid)))
        return workers[-1]

    try:
        a1 = start(UID_A)
        assert a1.ask("offload", "out") == digest
        b1 = start(UID_B)
        assert b1.ask("offload", "out") == digest
        a2 = start(UID_A, "ram")
        assert a2.ask("offload", "out") == digest
        rep_a1, rep_b1, rep_a2 = a1.report(), b1.report(), a2.report()
        for rep, uid in ((rep_a1, UID_A), (rep_b1, UID_B), (rep_a2, UID_A)):
            assert all(rep["shared"]), rep
            st = os.stat(rep["segment"])
            assert f"-{uid}-" in Path(rep["segment"]).name and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o600
        assert rep_a1["segment"] == rep_a2["segment"] != rep_b1["segment"]  # A's processes share; B has its own

        squatted = {UID_C: a1.ask(f"squat {UID_C} 644", "squatted"), UID_D: a1.ask(f"squat {UID_D} 600", "squatted")}
        before = {uid: _fingerprint(Path(p)) for uid, p in squatted.items()}
        for uid, load in ((UID_C, "meta"), (UID_C, "ram"), (UID_D, "meta")):
            victim = start(uid, load)
            assert victim.ask("offload", "out") == digest, (uid, load)
            rep = victim.report()
            assert not any(rep["shared"]) and rep["segment"] is None, rep
            victim.quit()
            assert "Traceback" not in victim.proc.stderr.read()
        assert {uid: _fingerprint(Path(p)) for uid, p in squatted.items()} == before
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.quit()
    assert not os.path.exists(rep_a1["segment"]) and not os.path.exists(rep_b1["segment"])  # the last ones out
    assert all(os.path.exists(p) for p in squatted.values())  # another user's files: never removed
