"""Loaders written in less usual ways: generators, rebinding inside a transactional load."""

from __future__ import annotations

import pytest
import torch

from patchkit.bitwise import same_bits
from patchkit.toymodels import PlainModel


class GeneratorLoader(PlainModel):
    """``load_weights`` written as a generator function: it copies only while iterated."""

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
            yield name


# patchkit's: CONTRACT §4 does not say that a load_weights written as a generator function
# (which copies only while iterated) is iterated inside the sparse call, and transactional=
# is patchkit's extension (vLLM's function has neither).
@pytest.mark.patchkit_only
@pytest.mark.parametrize("transactional", [False, True])
def test_a_generator_loader_is_run_inside_the_interception(load, Patch, transactional):
    m = GeneratorLoader({"w": (4,)}, fill=1.0)
    p = Patch("w", (4,), torch.float32, torch.tensor([100.0]), torch.tensor([1]))
    assert load(m, [p], transactional=transactional) == {"w"}
    assert m.w.tolist() == [1.0, 100.0, 1.0, 1.0]  # no NaN leaked through


class Boom(Exception):
    pass


class RebindsThenFails(PlainModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "c":
                raise Boom(name)
            self.get_parameter(name).data = w.clone()
        return {n for n, _ in weights}


@pytest.mark.patchkit_only
def test_transactional_dense_load_undoes_rebinding(load, Patch):
    m = RebindsThenFails({"w": (4,), "c": (4,)}, fill=1.0)
    before = m.w.detach().clone()
    storage = m.w.untyped_storage().data_ptr()
    patches = [
        Patch("w", (4,), torch.float32, torch.full((4,), 7.0)),
        Patch("c", (4,), torch.float32, torch.full((4,), 7.0)),
    ]
    with pytest.raises(Boom):
        load(m, patches, max_chunk_bytes=16, transactional=True)
    assert same_bits(m.w.detach(), before)
    assert m.w.untyped_storage().data_ptr() == storage


class RebindsAnEmptyTensor(PlainModel):
    """Copies each weight, rebinds the empty parameter ``e`` to an empty tensor of another
    dtype, then raises."""

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
            self.e.data = torch.empty(0, dtype=torch.float16)
        raise Boom("after the rebinding")


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_transactional_load_undoes_the_rebinding_of_an_empty_tensor(load, Patch, kind):
    # An empty tensor's data pointer is 0 before and after a rebinding, so only its
    # storage tells that it was rebound: the rollback still binds the original again.
    m = RebindsAnEmptyTensor({"w": (4,), "e": (0,)}, fill=1.0)
    before = m.w.detach().clone()
    original = m.e.data
    patch = (Patch("w", (4,), torch.float32, torch.full((4,), 7.0)) if kind == "dense"
             else Patch("w", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1])))
    with pytest.raises(Boom):
        load(m, [patch], transactional=True)
    assert same_bits(m.w.detach(), before)
    assert m.e.dtype == torch.float32
    assert m.e.untyped_storage()._cdata == original.untyped_storage()._cdata


class TurnsGradOffThenFails(PlainModel):
    """Turns each parameter's ``requires_grad`` off, copies into it, then raises."""

    def load_weights(self, weights):
        for name, w in weights:
            p = self.get_parameter(name)
            p.requires_grad_(False)
            p.copy_(w)
        raise Boom("after turning requires_grad off")


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_transactional_load_restores_requires_grad(load, Patch, kind):
    # A flag is no written region, but a rolled-back model that no longer trains a
    # parameter is not the model the load began with.
    m = TurnsGradOffThenFails({"w": (4,), "v": (4,)}, fill=1.0)
    m.w.requires_grad_(True)  # (v stays off: one flag on, one off)
    patch = (Patch("w", (4,), torch.float32, torch.full((4,), 7.0)) if kind == "dense"
             else Patch("w", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1])))
    with pytest.raises(Boom):
        load(m, [patch], transactional=True)
    assert m.w.requires_grad and not m.v.requires_grad
    assert m.w.tolist() == [1.0] * 4


class RegistersAnew(torch.nn.Module):
    """A loader that puts a new Parameter (``w``) and a new buffer (``scale``) in place of
    the registered ones instead of copying into them; ``fail_on`` raises afterwards."""

    def __init__(self, fail_on=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.register_buffer("scale", torch.ones(4))
        self.fail_on = fail_on

    def load_weights(self, weights):
        for name, t in weights:
            if name == self.fail_on:
                raise Boom(name)
            if name == "w":
                self.w = torch.nn.Parameter(t.clone(), requires_grad=False)
            else:
                self.scale = t.clone()
        return {n for n, _ in weights}


@pytest.mark.patchkit_only
def test_a_sparse_call_that_registers_a_new_tensor_is_refused_and_undone(load, Patch):
    # the NaN-staged tensor would have become the live parameter: [nan, 5, nan, nan]
    from patchkit import ContractViolation

    m = RegistersAnew()
    w, scale = m.w, m.scale
    p = Patch("w", (4,), torch.float32, torch.tensor([5.0]), torch.tensor([1]))
    with pytest.raises(ContractViolation, match="registered a new tensor") as info:
        load(m, [p])
    assert (info.value.reason, info.value.value, info.value.name) == ("rebinding", "w", "w")
    assert m.w is w and m.w.tolist() == [0.0] * 4 and m.scale is scale
    assert dict(m.named_parameters()) == {"w": w} and dict(m.named_buffers()) == {"scale": scale}


@pytest.mark.patchkit_only
def test_a_failed_transactional_load_registers_the_original_tensors_again(load, Patch):
    m = RegistersAnew(fail_on="c")
    w, scale = m.w, m.scale
    patches = [Patch("w", (4,), torch.float32, torch.full((4,), 2.0)),
               Patch("scale", (4,), torch.float32, torch.full((4,), 3.0)),
               Patch("c", (4,), torch.float32, torch.full((4,), 7.0))]
    with pytest.raises(Boom):
        load(m, patches, max_chunk_bytes=16, transactional=True)
    assert m.w is w and m.scale is scale
    assert m.w.tolist() == [0.0] * 4 and m.scale.tolist() == [1.0] * 4
    assert "scale" in m._buffers and "w" in m._parameters


class ReplacesChild(torch.nn.Module):
    """A loader that swaps a whole submodule for a new one holding the staged tensor."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "inner.w":
                fresh = torch.nn.Module()
                fresh.w = torch.nn.Parameter(t, requires_grad=False)
                self.inner = fresh
            else:
                self.v.data.copy_(t)
        return {n for n, _ in weights}


@pytest.mark.patchkit_only
def test_a_sparse_call_that_replaces_a_submodule_is_refused(load, Patch):
    from patchkit import ContractViolation

    m = ReplacesChild()
    w = m.inner.w
    p = Patch("inner.w", (4,), torch.float32, torch.tensor([5.0]), torch.tensor([1]))
    with pytest.raises(ContractViolation, match="registered a new tensor") as info:
        load(m, [p])
    assert (info.value.reason, info.value.value) == ("rebinding", "inner.w")
    assert m.inner.w is w and m.inner.w.tolist() == [0.0] * 4


@pytest.mark.patchkit_only
def test_rebinding_in_a_later_sparse_call_is_caught_and_undone(load, Patch):
    # the storages are recorded once per load: the check after call 2 still sees call 2's
    from patchkit import ContractViolation

    class RebindsW(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                if name == "w":
                    self.w.data = t
                else:
                    self.v.data.copy_(t)
            return {n for n, _ in weights}

    m = RebindsW()
    w_storage = m.w.untyped_storage().data_ptr()
    ps = [Patch(n, (4,), torch.float32, torch.tensor([5.0]), torch.tensor([1])) for n in "vvw"]
    with pytest.raises(ContractViolation, match="replaced the storage") as info:
        load(m, ps)  # two calls: the repeated v starts the second, which carries w
    assert (info.value.reason, info.value.value) == ("rebinding", "w")
    assert m.w.untyped_storage().data_ptr() == w_storage and m.w.tolist() == [0.0] * 4
    assert m.v.tolist() == [0.0, 5.0, 0.0, 0.0]
