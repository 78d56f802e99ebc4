"""A wrapped method (offload/stream/method_entry.py) is the plain bound method to whoever looks at it, and only the
methods that read the unit's weights outside a hooked call are wrapped (offload/stream/method_reads.py).

Before: every public method of a block's classes was wrapped, and the wrapper hid the signature, so transformers'
`apply_chunking_to_forward` (which counts `inspect.signature(forward_chunk_fn).parameters`) raised "forward_chunk_fn
expects 2 arguments, but only 1 input tensors are given" on every BERT-family layer (tests/test_bert_family.py).

The table: each check is run on the wrapped method of an offloaded block and on the plain bound method of the same
module (`types.MethodType(type(module).name, module)`), and must give the same answer. The block's methods cover a
docstring, annotations, defaults and keyword-only arguments, a functools.wraps decorator (`__wrapped__`), a method
that calls the block's own forward (one entry), one that only calls the block's children (BERT's
`feed_forward_chunk`'s shape), and a helper that touches no weight (stays plain).
"""
from __future__ import annotations

import copy
import functools
import inspect
import io
import pickle
import types
import typing
import weakref

import pytest
import torch
import torch.nn as nn

from offload.stream.method_entry import MethodEntry
from tests.host_master_guard import host_master_guard


def _traced(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class _Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.chunks = 2

    def modulate(self, x: torch.Tensor, shift: float = 0.0, *, gain: float = 1.0) -> torch.Tensor:
        """Scales by the block's own parameter (a read outside any child's call)."""
        return x * self.scale * gain + shift

    @_traced
    def traced(self, x: torch.Tensor) -> torch.Tensor:
        """Decorated with functools.wraps."""
        return self.modulate(x)

    def through_forward(self, x):
        return self.modulate(self(x))  # the block's forward inside: one entry

    def feed(self, x):  # the block's children only (BertLayer.feed_forward_chunk)
        return self.fc2(self.act(self.fc1(x)))

    def helper_chunks(self, n):  # reads no tensor: stays plain
        return n * self.chunks

    def forward(self, x):
        return self.feed(x) + x


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block.traced(block.through_forward(x))
        return x


def _pickled(method, module) -> bytes:
    """The method's pickle, the module itself by reference (what a bound method's pickle adds to its module's)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf)
    p.persistent_id = lambda obj: "module" if obj is module else None
    p.dump(method)
    return buf.getvalue()


def _unpickled(data: bytes, module):
    u = pickle.Unpickler(io.BytesIO(data))
    u.persistent_load = lambda pid: module
    return u.load()


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))

# (what is looked at, how): each must be equal for the wrapped and the plain bound method
CHECKS = {
    "signature": lambda m, mod: inspect.signature(m),
    "signature str": lambda m, mod: str(inspect.signature(m)),
    "getfullargspec": lambda m, mod: inspect.getfullargspec(m),
    "__name__": lambda m, mod: m.__name__,
    "__qualname__": lambda m, mod: m.__qualname__,
    "__doc__": lambda m, mod: m.__doc__,
    "getdoc": lambda m, mod: inspect.getdoc(m),
    "__module__": lambda m, mod: m.__module__,
    "__annotations__": lambda m, mod: m.__annotations__,
    "__defaults__": lambda m, mod: m.__defaults__,
    "__kwdefaults__": lambda m, mod: m.__kwdefaults__,
    "__wrapped__": lambda m, mod: getattr(m, "__wrapped__", "absent"),
    "unwrap": lambda m, mod: inspect.unwrap(m) if hasattr(m, "__wrapped__") else "no __wrapped__",
    "__self__ is the module": lambda m, mod: m.__self__ is mod,
    "__func__ is the class's": lambda m, mod: m.__func__ is type(mod).__dict__[m.__name__],
    "ismethod": lambda m, mod: inspect.ismethod(m),
    "isinstance MethodType": lambda m, mod: isinstance(m, types.MethodType),
    "isfunction / isroutine": lambda m, mod: (inspect.isfunction(m), inspect.isroutine(m), callable(m)),
    "generator / coroutine": lambda m, mod: (inspect.isgeneratorfunction(m), inspect.iscoroutinefunction(m)),
    "get_type_hints": lambda m, mod: typing.get_type_hints(m),
    "vars": lambda m, mod: vars(m),
    "getsource": lambda m, mod: inspect.getsource(m),
    "equal to a fresh bound method": lambda m, mod: (m == getattr(type(mod), m.__name__).__get__(mod),
                                                     getattr(type(mod), m.__name__).__get__(mod) == m),
    "not equal to another module's": lambda m, mod: m == getattr(type(mod), m.__name__).__get__(_Block()),
    "!= itself": lambda m, mod: m != getattr(mod, m.__name__),
    "hash": lambda m, mod: hash(m) == hash(types.MethodType(m.__func__, mod)),
    "in a set / dict key": lambda m, mod: types.MethodType(m.__func__, mod) in {m},
    "repr": lambda m, mod: repr(m),
    "dir": lambda m, mod: sorted(dir(m)),
    "setattr refused": lambda m, mod: _raises(lambda: setattr(m, "tag", 1)),
    "partial signature": lambda m, mod: str(inspect.signature(functools.partial(m, X))),
    "partial call": lambda m, mod: _value(functools.partial(m, X)),
    "call": lambda m, mod: _value(lambda: m(X, 0.5, gain=2.0) if m.__name__ == "modulate" else m(X)),
    "functools.wraps of it": lambda m, mod: {k: getattr(functools.wraps(m)(lambda: None), k)
                                              for k in ("__name__", "__qualname__", "__doc__", "__module__")},
    "pickle bytes": lambda m, mod: _pickled(m, mod),
    "unpickled equals": lambda m, mod: _unpickled(_pickled(m, mod), mod) == types.MethodType(m.__func__, mod),
    "deepcopy": lambda m, mod: _deepcopied(m, mod),
    "copy.copy": lambda m, mod: copy.copy(m) == types.MethodType(m.__func__, mod),
    "WeakMethod": lambda m, mod: weakref.WeakMethod(m)() == types.MethodType(m.__func__, mod),
}


# computed: the plain bound method of the same block would read its host master, so the plain side is the same
# method of the model before offloading (same weights)
COMPUTED = ("partial call", "call")


def _raises(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the kind of error is what is compared
        return type(exc).__name__
    return "no error"


def _value(fn) -> bytes:
    with torch.no_grad():
        out = fn()
    return out.numpy().tobytes() if torch.is_tensor(out) else repr(out).encode()


def _deepcopied(m, mod):
    """A plain bound method of a copy of the module (an ordinary module, no engine), computing the same."""
    got = copy.deepcopy(m)
    assert type(got) is types.MethodType and got.__func__ is m.__func__ and got.__self__ is not mod
    assert not any(type(v) is MethodEntry for sub in got.__self__.modules() for v in vars(sub).values())
    return type(got).__name__, _value(functools.partial(got, X))


@pytest.fixture(scope="module")
def offloaded():
    import offload as lo

    torch.manual_seed(0)
    model = _Model().eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        want = model(X)
    handle = lo.offload_module(model, lo.OffloadConfig(device="sim", vram_fraction=0.0, prefetch=1))
    yield model, handle, want, reference
    handle.detach()


WRAPPED = ("modulate", "traced", "through_forward", "feed")


@pytest.mark.parametrize("name", WRAPPED)
def test_a_wrapped_method_looks_like_the_plain_bound_method(offloaded, name):
    """Every check of the table, on one wrapped method (one test per method: the table is cheap, a test is not)."""
    model, handle, _, reference = offloaded
    block = model.blocks[1]
    wrapped = getattr(block, name)
    assert type(wrapped) is MethodEntry, f"{name} computes with the block's weights: it must be wrapped"
    differ = {}
    for check, look in CHECKS.items():
        plain_block = reference.blocks[1] if check in COMPUTED else block
        plain = types.MethodType(type(block).__dict__[name], plain_block)
        with host_master_guard(handle):
            got = look(wrapped, block)
        want = look(plain, plain_block)
        if got != want:
            differ[check] = (got, want)
    assert not differ, f"{name}: the wrapped method differs from the plain one in {differ}"


def test_a_helper_that_touches_no_weight_stays_plain_and_a_method_is_one_entry(offloaded):
    """`helper_chunks` reads an int: the plain bound method. Outside any pass `through_forward` (the block's forward
    inside) and `feed` (the block's children) each bring the block in once and let it go: one entry each; the
    model's output is unchanged after."""
    model, handle, want, reference = offloaded
    for block in model.blocks:
        assert "helper_chunks" not in vars(block) and type(block.helper_chunks) is types.MethodType
    before = [b.calls for b in handle.report().blocks]
    with torch.no_grad(), host_master_guard(handle):
        assert torch.equal(model(X), want)  # two entries per block: through_forward, traced
        assert torch.equal(model.blocks[2].through_forward(X), reference.blocks[2].through_forward(X))
        assert torch.equal(model.blocks[0].feed(X), reference.blocks[0].feed(X))
        assert torch.equal(model(X), want)
    after = [b.calls for b in handle.report().blocks]
    assert [a - b for a, b in zip(after, before)] == [5, 4, 5], (before, after)
    assert handle.streamer.active is None and handle.streamer._lock._owner is None  # let go, lock free


def test_detach_takes_the_wrappers_off_and_a_deepcopy_has_none(offloaded):
    import offload as lo

    torch.manual_seed(0)
    model = _Model().eval()
    handle = lo.offload_module(model, lo.OffloadConfig(device="sim", vram_fraction=0.0))
    copied = copy.deepcopy(model)
    assert not any(type(v) is MethodEntry for m in copied.modules() for v in vars(m).values())
    handle.detach()
    assert not any(type(v) is MethodEntry for m in model.modules() for v in vars(m).values())
