"""A budget changed while several threads run its models (issue 18): the change takes effect at each model's next
safe point, no forward fails while the new total covers every model's minimum, and errors state consistent numbers."""
from __future__ import annotations

import threading

import pytest
import torch

from offload import DeviceMemoryError, OffloadConfig, VramBudget, offload_module
from tests.models import LayersModel, seeded

DIM, DEPTH, FORWARDS = 128, 8, 120


def _pair():
    a = seeded(LayersModel, dim=DIM, depth=DEPTH, seed=0)
    b = seeded(LayersModel, dim=DIM, depth=DEPTH, seed=1)
    return a, b


def _run_threads(models, refs, x, change, forwards=FORWARDS, after=10):
    """Run each model's forwards on its own thread; `change()` runs on this thread once every thread has finished a
    forward, and each thread goes on for at least `after` forwards begun after it: the change lands while they run,
    however loaded the host is. Timeouts only guard against a hang."""
    failures: list[str] = []
    wrong: list[int] = []
    running = [threading.Event() for _ in models]
    changed = threading.Event()

    def loop(k):
        done = since = 0
        while done < forwards or since < after:
            late = changed.is_set()
            try:
                with torch.no_grad():
                    y = models[k](x)
                if not torch.equal(y, refs[k]):
                    wrong.append(k)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                failures.append(f"{type(exc).__name__}: {exc}")
            done, since = done + 1, since + late
            running[k].set()

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(len(models))]
    for t in threads:
        t.start()
    try:
        assert all(r.wait(300) for r in running), "a thread never finished its first forward"
        change()
    finally:
        changed.set()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a forward never returned (models waiting on each other)"
    return failures, wrong


@pytest.mark.parametrize("factor", [2, 4])
def test_budget_lowered_while_two_threads_run_fails_no_forward(factor):
    a, b = _pair()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        refs = [a(x), b(x)]
    total = 4 << 20
    budget = VramBudget(total)
    ha = offload_module(a, OffloadConfig(device="sim"), name="a", budget=budget)
    hb = offload_module(b, OffloadConfig(device="sim"), name="b", budget=budget)
    lowered = total // factor
    assert lowered >= ha.floor_bytes() + hb.floor_bytes(), "the test wants a total that covers both minimums"

    failures, wrong = _run_threads([a, b], refs, x, lambda: budget.set_total(lowered))

    assert failures == [], f"{len(failures)} forwards failed, e.g. {failures[:1]}"
    assert wrong == []
    with torch.no_grad():  # one more safe point each: both now hold their new share
        a(x)
        b(x)
    assert budget.used_bytes <= lowered
    assert ha.device_bytes() + hb.device_bytes() <= lowered


def test_budget_below_both_floors_together_serializes_the_models_instead_of_failing():
    """A total that holds either model alone, but not both at once: the threads take turns."""
    a, b = _pair()
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        refs = [a(x), b(x)]
    budget = VramBudget(4 << 20)
    ha = offload_module(a, OffloadConfig(device="sim"), name="a", budget=budget)
    hb = offload_module(b, OffloadConfig(device="sim"), name="b", budget=budget)
    lowered = budget.minimum_bytes() + ha.floor_bytes() // 2  # one floor fits, two do not
    assert lowered < ha.floor_bytes() + hb.floor_bytes()

    failures, wrong = _run_threads([a, b], refs, x, lambda: budget.set_total(lowered), forwards=40)

    assert failures == [] and wrong == []


def test_plan_error_states_the_share_and_the_total_consistently():
    model = seeded(LayersModel, dim=DIM, depth=DEPTH)
    budget = VramBudget(8 << 20)
    handle = offload_module(model, OffloadConfig(device="sim"), name="m", budget=budget)
    too_small = handle.floor_bytes() - 1
    with pytest.raises(DeviceMemoryError) as info:
        handle._make_plan(too_small)
    msg = str(info.value)
    assert f"{too_small} bytes of device memory" in msg
    assert f"share is {too_small} bytes of the VRAM budget's {8 << 20} bytes" in msg
    assert "0 bytes" not in msg.split(".")[0]
