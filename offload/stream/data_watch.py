"""Writes through `Parameter.data` seen: peft's `fuse_lora` / `unfuse_lora` (`weight.data += delta`) and
`with torch.no_grad(): p.data.copy_(x)` write in place through a tensor with a version counter of its own, which the
engine's version counters (`WriteWatch.check_writes`) never see.

`nn.Parameter.data` becomes a descriptor of the same behaviour that, for a parameter the engine staged, also marks
its unit as maybe written (a set add); at the next safe point `WriteWatch.check_writes` treats those units as
written (a resident copy catches its host master up when evicted, a streamed unit's queued copies are dropped, a
disk-tier unit whose views differ from the file gets a RAM master). Only a `.data` read pays (a dict lookup); the
engine's own swaps go through `set_data`, the C setter, so the hot path is what it was.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

_BASE = torch._C.TensorBase.data  # the C getset descriptor every tensor's `.data` is
set_data = _BASE.__set__  # `param.data = value` without the watch (the engine's own swaps)
read_data = _BASE.__get__  # `param.data` without the watch (the engine's own reads)
_watched: dict[int, Callable[[], Any]] = {}  # id(parameter) -> mark its unit


class _WatchedData:
    """`Parameter.data`, as torch's, telling the engine which of its parameters were reached through it."""

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self
        mark = _watched.get(id(obj))
        if mark is not None:
            mark()
        return _BASE.__get__(obj, cls)

    def __set__(self, obj: Any, value: Any) -> None:
        _BASE.__set__(obj, value)

    def __delete__(self, obj: Any) -> None:
        _BASE.__delete__(obj)


def install() -> None:
    """Put the watching descriptor on `nn.Parameter` (once per process; a no-op after)."""
    if not isinstance(nn.Parameter.__dict__.get("data"), _WatchedData):
        nn.Parameter.data = _WatchedData()  # type: ignore[assignment]


class DataWatch:
    """The parameters of one model the engine staged, each marking its unit in `touched` when `.data` reaches it."""

    def __init__(self) -> None:
        self.touched: set[int] = set()  # unit indices (-1: the weights outside the blocks) reached through `.data`
        self._ids: list[int] = []
        self._finalizer = weakref.finalize(self, _forget, self._ids)
        install()

    def watch(self, params: Iterable[tuple[int, Any]]) -> None:
        """Watch these (unit index, parameter) pairs from now on, instead of the ones watched before."""
        _forget(self._ids)
        for index, param in params:
            if param is not None:
                _watched[id(param)] = functools.partial(self.touched.add, index)
                self._ids.append(id(param))

    def take(self) -> set[int]:
        """The units reached through `.data` since the last call."""
        if not self.touched:
            return set()
        out = set(self.touched)
        self.touched.clear()
        return out

    def close(self) -> None:
        _forget(self._ids)


def _forget(ids: list[int]) -> None:
    for i in ids:
        _watched.pop(i, None)
    ids.clear()
