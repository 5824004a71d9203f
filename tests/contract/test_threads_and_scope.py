"""CONTRACT §4, last bullet: the interception is scoped.

It is active only inside sparse ``load_weights`` calls, only on the calling thread, and
gone afterwards however the call ends; ``torch.Tensor.copy_`` is never replaced.
The thread tests make the overlap deterministic: the loader blocks inside
``load_weights`` until the other thread has done its copies.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ._models import NAN, RecordingModel, same_bits

WAIT = 10.0  # seconds; only reached if the other thread is broken

SRC = torch.tensor([NAN, 1.0, NAN, 2.0, -0.0, NAN])


def _nan_bits_match(t: torch.Tensor) -> bool:
    return same_bits(t.detach(), SRC)


class Run:
    """Runs ``body`` on another thread; re-raises its exception in the caller on ``join``."""

    def __init__(self, body) -> None:
        self.error: BaseException | None = None
        device = torch.get_default_device()  # the test's default device (--device)

        def target():
            try:
                with torch.device(device):
                    body()
            except BaseException as e:  # surfaced by join()
                self.error = e

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the other thread hung"
        if self.error is not None:
            raise self.error


def test_other_thread_copying_nan_during_a_sparse_load_is_not_masked(load, mk):
    inside, done = threading.Event(), threading.Event()
    model = RecordingModel({"a": torch.zeros(6), "b": torch.full((6,), 5.0)})
    results = {}

    def block(model, call, name, staged):
        inside.set()
        assert done.wait(WAIT), "the other thread never finished its copies"

    model.hook = block

    def other():
        assert inside.wait(WAIT)
        plain = torch.zeros(6)
        plain.copy_(SRC)
        results["plain"] = plain
        with torch.no_grad():
            model.b.copy_(SRC)  # the same module's parameter, during the sparse call
            model.b.data[0:3] = SRC[0:3]
        done.set()

    runner = Run(other)
    load(model, [mk.sparse("a", (6,), [1, 4], [7.0, 8.0])])
    runner.join()
    assert _nan_bits_match(results["plain"])
    assert _nan_bits_match(model.b)
    assert model.a.detach().tolist() == [0.0, 7.0, 0.0, 0.0, 8.0, 0.0]


@pytest.mark.patchkit_only
def test_other_thread_may_write_runtime_storage_freely_during_a_sparse_load(load, mk):
    # Ops a sparse call would reject are ordinary on another thread.
    inside, done = threading.Event(), threading.Event()
    model = RecordingModel({"a": torch.zeros(4), "b": torch.zeros(4)})
    model.hook = lambda *args: (inside.set(), done.wait(WAIT))

    def other():
        assert inside.wait(WAIT)
        with torch.no_grad():
            model.b.fill_(3.0)
            model.b.add_(1.0)
            model.b[torch.tensor([0])] = 9.0
        done.set()

    runner = Run(other)
    load(model, [mk.sparse("a", (4,), [2], [1.0])])
    runner.join()
    assert model.b.detach().tolist() == [9.0, 4.0, 4.0, 4.0]
    assert model.a.detach().tolist() == [0.0, 0.0, 1.0, 0.0]


def test_concurrent_copies_stay_unmasked_while_the_loader_copies(load, mk):
    # Both threads copy at the same time, many times: the other thread's results always
    # carry the NaNs, the load's result is always merged.
    rounds = 30
    barrier = threading.Barrier(2, timeout=WAIT)
    model = RecordingModel({"a": torch.zeros(6), "b": torch.zeros(6)})

    def meet(model, call, name, staged):
        barrier.wait()

    model.hook = meet
    seen = []

    def other():
        for _ in range(rounds):
            barrier.wait()
            t = torch.zeros(6)
            t.copy_(SRC)
            with torch.no_grad():
                model.b.copy_(SRC)
            seen.append(_nan_bits_match(t) and _nan_bits_match(model.b))

    runner = Run(other)
    for k in range(rounds):
        load(model, [mk.sparse("a", (6,), [k % 6], [float(k)])])
    runner.join()
    assert seen == [True] * rounds
    assert not torch.isnan(model.a).any()


def test_tensor_copy_is_the_same_object_after_the_call(load, mk):
    original = torch.Tensor.copy_
    model = RecordingModel({"a": torch.zeros(3)})
    load(model, [mk.sparse("a", (3,), [0], [1.0])])
    assert torch.Tensor.copy_ is original
    model.hook = lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        load(model, [mk.sparse("a", (3,), [0], [1.0])])
    assert torch.Tensor.copy_ is original


@pytest.mark.patchkit_only
def test_tensor_copy_is_never_replaced_even_during_the_call(load, mk):
    original = torch.Tensor.copy_
    during = []
    model = RecordingModel({"a": torch.zeros(3)})
    model.hook = lambda *args: during.append(torch.Tensor.copy_ is original)
    load(model, [mk.sparse("a", (3,), [0], [1.0])])
    assert during == [True]


def _nan_copy_writes_nan(model: RecordingModel) -> None:
    with torch.no_grad():
        model.a.copy_(torch.full((3,), NAN))
    assert torch.isnan(model.a).all(), "a NaN copy outside the loader was masked"


def test_interception_is_gone_after_a_successful_call(load, mk):
    model = RecordingModel({"a": torch.zeros(3)})
    load(model, [mk.sparse("a", (3,), [0], [1.0])])
    _nan_copy_writes_nan(model)


@pytest.mark.parametrize(
    "fail",
    [
        pytest.param(lambda m: (_ for _ in ()).throw(KeyError("loader bug")), id="loader raises"),
        pytest.param(lambda m: m.a.copy_(torch.ones(1)), id="contract violation"),
    ],
)
def test_interception_is_gone_after_a_raising_call(load, mk, fail):
    model = RecordingModel({"a": torch.zeros(3)})
    model.hook = lambda m, *args: fail(m)
    with pytest.raises((KeyError, NotImplementedError)):
        load(model, [mk.sparse("a", (3,), [0], [1.0])])
    _nan_copy_writes_nan(model)


def test_dense_calls_are_not_masked(load, mk):
    model = RecordingModel({"a": torch.zeros(3)})
    load(model, [mk.dense("a", torch.tensor([NAN, 1.0, NAN]))])
    assert torch.isnan(model.a[[0, 2]]).all()
