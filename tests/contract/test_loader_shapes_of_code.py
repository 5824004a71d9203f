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
