"""A signal (Ctrl-C, a handler that raises) that lands at the edge of a ``load_weights``
call, and loads nested in another load's loader. Each test failed before its fix: the
call's block was never resumed, so its interception modes stayed on the thread (the
rollback ran under them, was refused, and left the model half-written; every later
write into the model raised), and a nested load's rollback ran under the outer load's
mode."""

from __future__ import annotations

import gc
import math
import signal

import pytest
import torch
from torch import nn

from patchkit import CheckpointWeightPatch as CWP
from patchkit import inspect_load, load_checkpoint_weight_patches
from patchkit.intercept import WriteSession
from patchkit.toymodels import PlainModel


def _stacks() -> tuple[int, int]:
    return torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()


class _SignalAtExit:
    """A call's block whose ``__exit__`` raises ``KeyboardInterrupt`` before it resumes
    the block: what a SIGINT that lands in ``contextlib``'s ``__exit__`` does."""

    def __init__(self, scope) -> None:
        self.scope = scope

    def __enter__(self):
        return self.scope.__enter__()

    def __exit__(self, *exc):
        raise KeyboardInterrupt


@pytest.fixture
def signal_at_call_exit(monkeypatch):
    real = WriteSession.call
    monkeypatch.setattr(WriteSession, "call",
                        lambda self, *a, **k: _SignalAtExit(real(self, *a, **k)))
    before = _stacks(), signal.getsignal(signal.SIGINT), gc.isenabled()
    yield before
    # (on failure, what was left is cleared, so that later tests run on a clean thread)
    from torch.utils._python_dispatch import _pop_mode

    while torch._C._len_torch_dispatch_stack():
        _pop_mode()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()


# (a plain dense load watches nothing: it has no call block)
@pytest.mark.parametrize("kind, how", [("sparse", "transactional"), ("sparse", "inspect"),
                                       ("sparse", "plain"), ("dense", "transactional"),
                                       ("dense", "inspect")])
def test_a_signal_at_the_end_of_a_call_leaves_no_interception_and_rolls_back(
        signal_at_call_exit, kind, how):
    stacks, handler, collecting = signal_at_call_exit
    m = PlainModel({"a": (8,), "b": (8,)}, fill=0.5)
    if kind == "sparse":
        ps = [CWP(n, (8,), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 6]))
              for n in "ab"]
    else:
        ps = [CWP(n, (8,), torch.float32, torch.full((8,), 2.0)) for n in "ab"]
    with pytest.raises(KeyboardInterrupt):
        if how == "inspect":
            inspect_load(m, ps, transactional=True, max_chunk_bytes=32)
        else:
            load_checkpoint_weight_patches(m, ps, transactional=how == "transactional",
                                           max_chunk_bytes=32)
    assert _stacks() == stacks  # no mode of the load's left on this thread
    assert signal.getsignal(signal.SIGINT) == handler and gc.isenabled() == collecting
    if how != "plain":
        assert m.a.tolist() == m.b.tolist() == [0.5] * 8  # rolled back, both
    else:
        assert m.a.tolist() == [0.5, 0.5, 0.5, 1.0, 0.5, 0.5, 2.0, 0.5]  # the first call
    # the thread's ordinary writes into the model are its own again
    m.a.data.fill_(0.0)
    m.b.data.copy_(torch.full((8,), math.nan))
    assert m.a.tolist() == [0.0] * 8 and m.b.isnan().all()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.tensor([math.nan, 1.0, 2.0, math.nan]), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.v.data.copy_(t)
        raise RuntimeError("inner loader fails after writing")


class _Outer(nn.Module):
    """Its loader runs a transactional load of another model, which fails."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.inner = _Inner()
        self.inner_error: BaseException | None = None

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(t)
        try:
            load_checkpoint_weight_patches(
                self.inner, [CWP("v", (4,), torch.float32, torch.full((4,), 5.0))],
                transactional=True)
        except RuntimeError as e:
            self.inner_error = e
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["sparse", "sparse-transactional", "inspect", "dense-inspect"])
def test_a_load_nested_in_another_loads_loader_rolls_back_outside_its_interception(how):
    # the inner rollback ran under the outer sparse load's mode, which refused it as an
    # overlapping write: 'rollback incomplete', and the inner model kept 5.0
    m = _Outer()
    if how.startswith("sparse"):
        p = CWP("w", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
        load_checkpoint_weight_patches(m, [p], transactional=how.endswith("transactional"))
    elif how == "inspect":
        r = inspect_load(m, [CWP("w", (4,), torch.float32, torch.tensor([1.0]),
                                 torch.tensor([0]))])
        # the inner load's write is one into the outer model's runtime; its rollback
        # runs outside every interception, the outer report's too (as documented)
        assert r.writes["target"].tolist() == ["w", "inner.v"]
    else:
        inspect_load(m, [CWP("w", (4,), torch.float32, torch.ones(4))])
    assert str(m.inner_error) == "inner loader fails after writing"
    assert torch.equal(m.inner.v.isnan(), torch.tensor([True, False, False, True]))
    assert m.inner.v[1:3].tolist() == [1.0, 2.0]
    assert m.w[0].item() == 1.0
