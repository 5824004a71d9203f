"""Tensors with torch's lazy negative or conjugate bit (``torch._neg_view``,
``z.conj()``, ``z.conj().imag``): their memory does not hold their values, and patchkit's
compiled paths and bit comparisons read memory. Each test failed before its fix (wrong
signs written silently, or a bare RuntimeError from ``Tensor.view``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import ContractViolation, inspect_load, load_checkpoint_weight_patches, native

PATHS = [True, False]
PATH_IDS = ["compiled", "torch-ops"]


def _path(compiled: bool):
    return contextlib.nullcontext() if compiled else native.disabled()


class CopiesThrough(torch.nn.Module):
    """One float parameter ``w``; its loader copies ``how(staged)`` into it."""

    def __init__(self, how, fill: float = 1.0, n: int = 4) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((n,), fill), requires_grad=False)
        self.how = how

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(self.how(t))
        return {"w"}


def _neg(t):
    return torch._neg_view(t)


def _conj_imag(t):
    # a complex tensor whose imaginary part is t, conjugated: .imag is -t, lazily
    z = torch.complex(torch.zeros_like(t), t).conj()
    return z.imag


@pytest.mark.parametrize("compiled", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("how", [_neg, _conj_imag], ids=["neg_view", "conj_imag"])
@pytest.mark.parametrize("mode", ["sparse", "sparse-transactional", "sparse-inspect",
                                  "dense-transactional", "dense-inspect"])
def test_a_loader_copying_from_a_lazily_negated_view_writes_the_negated_values(
        compiled, how, mode):
    # compiled: +5 written for -5 (the merge and the compared copy read memory as it
    # is); torch-ops: a bare RuntimeError from bits()
    sparse = mode.startswith("sparse")
    m = CopiesThrough(how)
    assert how(torch.ones(2)).is_neg()
    if sparse:
        p = CWP("w", (4,), torch.float32, torch.tensor([5.0, 6.0]), torch.tensor([1, 3]))
        want = [1.0, -5.0, 1.0, -6.0]
    else:
        p = CWP("w", (4,), torch.float32, torch.tensor([5.0, 6.0, 7.0, 8.0]))
        want = [-5.0, -6.0, -7.0, -8.0]
    with _path(compiled):
        if mode.endswith("inspect"):
            r = inspect_load(m, [p])
            assert r.after("w").tolist() == want
            assert r.before("w").tolist() == [1.0] * 4
            # the write is still the patch's (the resolved copy keeps where it came from)
            assert r.writes["name"].tolist() == ["w"]
            assert int(r.deltas.loc["w", "changed"]) == (2 if sparse else 4)
        else:
            load_checkpoint_weight_patches(m, [p], transactional=mode.endswith("transactional"))
    assert m.w.tolist() == want


@pytest.mark.parametrize("compiled", PATHS, ids=PATH_IDS)
def test_a_transactional_load_from_a_negated_view_rolls_back_exactly(compiled):
    class Fails(CopiesThrough):
        def load_weights(self, weights):
            out = super().load_weights(weights)
            if self.calls:
                raise RuntimeError("simulated failure")
            self.calls += 1
            return out

    m = Fails(_neg)
    m.calls = 0
    ps = [CWP("w", (4,), torch.float32, torch.tensor([5.0]), torch.tensor([0])),
          CWP("w", (4,), torch.float32, torch.tensor([6.0]), torch.tensor([1]))]
    with _path(compiled), pytest.raises(RuntimeError, match="simulated"):
        load_checkpoint_weight_patches(m, ps, transactional=True)
    assert m.w.tolist() == [1.0] * 4


class LazyRuntime(torch.nn.Module):
    """A runtime tensor that is itself a lazy view: a negated float buffer, or a
    conjugated complex parameter."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "neg":
            self.register_buffer("w", _neg(torch.tensor([1.0, 2.0, 3.0, 4.0])))
        else:
            z = torch.complex(torch.ones(4), torch.full((4,), 10.0))
            self.w = torch.nn.Parameter(z.conj(), requires_grad=False)
        self.kind = kind

    def load_weights(self, weights):
        for _, t in weights:
            (self.w if self.kind == "neg" else self.w.real).copy_(t)
        return {"w"}


@pytest.mark.parametrize("kind", ["neg", "conj"])
@pytest.mark.parametrize("mode", ["sparse", "transactional", "inspect"])
def test_a_runtime_tensor_that_is_a_lazy_view_is_refused_before_any_write(kind, mode):
    # its saves held the memory, not the values: before() showed [1, 2, 3, 4] for
    # [-1, -2, -3, -4], a rollback put the wrong sign back, a sparse one was incomplete
    m = LazyRuntime(kind)
    before = m.w.clone()
    n = 4
    p = (CWP("w", (n,), torch.float32, torch.tensor([9.0]), torch.tensor([1]))
         if mode == "sparse" else CWP("w", (n,), torch.float32, torch.full((n,), 9.0)))
    with pytest.raises(ContractViolation, match=r"runtime tensor 'w' is a lazily "
                       r"(negated|conjugated) view") as e:
        if mode == "inspect":
            inspect_load(m, [p])
        else:
            load_checkpoint_weight_patches(m, [p], transactional=mode == "transactional")
    assert e.value.reason == "lazy view"
    assert patchkit.same_bits(m.w, before)
    # a plain dense load is not watched, and torch writes through the view
    load_checkpoint_weight_patches(m, [CWP("w", (n,), torch.float32, torch.full((n,), 9.0))])
    assert (m.w.real if kind == "conj" else m.w).tolist() == [9.0] * n


@pytest.mark.parametrize("compiled", PATHS, ids=PATH_IDS)
def test_a_write_through_a_lazily_conjugated_view_of_a_plain_runtime_tensor_is_refused(
        compiled):
    class WritesConjImag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.z = torch.nn.Parameter(torch.complex(torch.ones(4), torch.ones(4)),
                                        requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.z.data.conj().imag.copy_(t)  # (writes -t into the imaginary part)
            return {"z"}

    m = WritesConjImag()
    p = CWP("z", (4,), torch.float32, torch.tensor([3.0]), torch.tensor([2]))
    with _path(compiled), pytest.raises(ContractViolation, match="lazily negated view") as e:
        load_checkpoint_weight_patches(m, [p])
    assert (e.value.reason, e.value.position, e.value.name, e.value.value) == (
        "lazy view", 0, "z", "z")
    assert m.z.tolist() == [1 + 1j] * 4  # nothing written
    # its plain imaginary part is written as any float view is
    m.load_weights = lambda ws: [m.z.data.imag.copy_(t) for _, t in ws] and {"z"}
    with _path(compiled):
        load_checkpoint_weight_patches(m, [p])
    assert m.z.tolist() == [1 + 1j, 1 + 1j, 1 + 3j, 1 + 1j]


@pytest.mark.parametrize("mode", ["transactional", "inspect"])
def test_a_write_through_a_lazily_conjugated_view_of_a_complex_runtime_tensor_is_refused(mode):
    # (mutation testing: a check of the negative bit alone passed every test, and let a
    # watched load save and count the conjugated memory as the values written)
    class WritesConj(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.z = torch.nn.Parameter(torch.complex(torch.ones(4), torch.ones(4)),
                                        requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.z.data.conj().copy_(torch.complex(t, t))
            return {"z"}

    m = WritesConj()
    p = CWP("z", (4,), torch.float32, torch.full((4,), 3.0))
    with pytest.raises(ContractViolation, match="lazily conjugated view") as e:
        if mode == "inspect":
            inspect_load(m, [p])
        else:
            load_checkpoint_weight_patches(m, [p], transactional=True)
    assert (e.value.reason, e.value.value) == ("lazy view", "z")
    assert m.z.tolist() == [1 + 1j] * 4  # nothing written
