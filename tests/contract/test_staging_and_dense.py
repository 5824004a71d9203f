"""The patch record, the call itself, CONTRACT §3 (staging) and dense loads.

What ``load_weights`` receives: one list per chunk, ``(name, staged tensor)`` in input
order; the staged tensor checkpoint-shaped, of the patch dtype, on the values' device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._models import NAN, RecordingModel, SinkModel, same_bits

# -- the record -----------------------------------------------------------------------------


def test_patch_record_is_an_immutable_namedtuple(Patch):
    values = torch.zeros(4)
    p = Patch("w", (2, 2), torch.float32, values)
    assert p.indices is None
    name, shape, dtype, vals, indices = p
    assert (name, shape, dtype, vals, indices) == ("w", (2, 2), torch.float32, values, None)
    q = p._replace(name="v")
    assert (q.name, p.name) == ("v", "w")
    assert Patch._fields == ("name", "shape", "dtype", "values", "indices")
    with pytest.raises(AttributeError):
        p.name = "x"


# -- the call -------------------------------------------------------------------------------


def test_empty_call_returns_empty_set_without_calling(load):
    m = SinkModel(returns="names")
    assert load(m, []) == set()
    assert load(m, iter(())) == set()
    assert load(m, (p for p in ())) == set()
    assert m.calls == []


def test_generator_is_read_once(load, mk):
    m = RecordingModel({"a": torch.zeros(4), "b": torch.zeros(4)})
    produced = []

    def gen():
        for name in "ab":
            produced.append(name)
            yield mk.sparse(name, (4,), [1], [3.0])

    assert load(m, gen(), max_chunk_bytes=16) == {"a", "b"}
    assert produced == ["a", "b"]
    assert m.names_per_call() == [["a"], ["b"]]


def test_single_use_iterable_is_read_once_before_anything_happens(load, mk):
    m = RecordingModel({"a": torch.zeros(4), "b": torch.zeros(4)})
    events = []

    class Once:
        def __iter__(self):
            events.append("iter")
            for name in "ab":
                yield mk.dense(name, torch.ones(4))
            events.append("exhausted")

    m.hook = lambda model, call, name, w: events.append(f"load {name}")
    load(m, Once(), max_chunk_bytes=16)
    assert events == ["iter", "exhausted", "load a", "load b"]


def test_patches_are_read_before_the_budget_is_checked(load, mk):
    # "read once, into a list, before anything else happens": a bad budget too is found
    # only after the iterable was read to its end
    events = []

    class Once:
        def __iter__(self):
            events.append("iter")
            yield mk.dense("a", torch.ones(4))
            events.append("exhausted")

    m = RecordingModel({"a": torch.zeros(4)})
    with pytest.raises(ValueError):
        load(m, Once(), max_chunk_bytes=0)
    assert events == ["iter", "exhausted"]
    assert m.names_per_call() == []


def test_generator_with_a_bad_patch_makes_no_call(load, mk):
    m = RecordingModel({"a": torch.zeros(4)})
    gen = (p for p in [mk.sparse("a", (4,), [0], [1.0]), mk.sparse("a", (4,), [7], [1.0])])
    with pytest.raises(ValueError):
        load(m, gen, max_chunk_bytes=16)
    assert m.calls == []
    assert m.a.detach().eq(0).all()


def test_each_chunk_is_one_call_with_a_list_in_input_order(load, mk):
    m = RecordingModel({n: torch.zeros(3) for n in "zyx"})
    load(m, [mk.dense(n, torch.ones(3)) for n in "zyx"])
    assert m.arg_types == [list]
    assert m.names_per_call() == [["z", "y", "x"]]


def test_loader_runs_under_no_grad(load, mk):
    m = RecordingModel({"a": torch.zeros(2), "b": torch.zeros(2)})
    assert torch.is_grad_enabled()
    load(m, [mk.dense("a", torch.ones(2))])
    load(m, [mk.sparse("b", (2,), [0], [1.0])])
    assert m.grad_enabled == [False, False]
    assert torch.is_grad_enabled()


def test_result_is_the_union_of_returned_names(load, mk):
    class Renaming(RecordingModel):
        def load_weights(self, weights):
            super().load_weights(weights)
            return {f"runtime.{n}" for n, _ in weights} | {"shared"}

    m = Renaming({n: torch.zeros(2) for n in "abc"})
    got = load(m, [mk.dense(n, torch.ones(2)) for n in "abc"], max_chunk_bytes=8)
    assert got == {"runtime.a", "runtime.b", "runtime.c", "shared"}
    assert len(m.calls) == 3


def test_a_call_returning_none_adds_nothing(load, mk):
    class SometimesNone(RecordingModel):
        def load_weights(self, weights):
            names = super().load_weights(weights)
            return None if "a" in names else names

    m = SometimesNone({n: torch.zeros(2) for n in "ab"})
    patches = [mk.dense("a", torch.ones(2)), mk.dense("b", torch.ones(2))]
    assert load(m, patches, max_chunk_bytes=8) == {"b"}
    assert m.a.detach().eq(1).all()


def test_returned_names_may_be_any_iterable(load, mk):
    class ListReturning(RecordingModel):
        def load_weights(self, weights):
            return sorted(super().load_weights(weights))

    m = ListReturning({n: torch.zeros(2) for n in "ab"})
    assert load(m, [mk.sparse("a", (2,), [0], [1.0]), mk.sparse("b", (2,), [1], [1.0])]) == {
        "a",
        "b",
    }


# -- staging --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_dense_staged_tensor_is_values_cast_and_viewed_as_shape(load, Patch, dtype):
    values = torch.arange(24, dtype=torch.float64) * 1.37 - 9.0
    m = SinkModel()
    seen = []
    m.load_weights = lambda ws: seen.extend((n, w.clone()) for n, w in ws) or set()
    load(m, [Patch("w", (2, 3, 4), dtype, values)])
    [(name, staged)] = seen
    assert name == "w"
    assert staged.shape == (2, 3, 4) and staged.dtype == dtype
    assert staged.device == values.device
    assert same_bits(staged, values.to(dtype).reshape(2, 3, 4))


@pytest.mark.parametrize("spelling", ["ints", "numpy ints", "0-d tensors", "list", "Size"])
def test_any_valid_spelling_of_the_shape_stages_the_same_tensor(load, Patch, spelling):
    dims = {
        "ints": (2, 3),
        "numpy ints": (np.int64(2), np.int32(3)),
        "0-d tensors": (torch.tensor(2), torch.tensor(3)),
        "list": [2, 3],
        "Size": torch.Size([2, 3]),
    }[spelling]
    values = torch.arange(6, dtype=torch.float32)
    m = SinkModel()
    seen = []
    m.load_weights = lambda ws: seen.extend(w for _, w in ws) or set()
    load(m, [Patch("w", dims, torch.float32, values)])
    [staged] = seen
    assert type(staged.shape) is torch.Size and staged.shape == (2, 3)
    assert same_bits(staged, values.reshape(2, 3))
    # same dtype and contiguous: the staged tensor is a view of the values, not a copy
    assert staged.data_ptr() == values.data_ptr()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_staged_tensor_is_nan_except_at_indices(load, mk, dtype, index_dtype):
    m = RecordingModel({"w": torch.zeros(3, 4, dtype=dtype)}, returns="empty")
    values = torch.tensor([1.25, -3.5, 1e-3], dtype=torch.float64)
    patch = mk.sparse(
        "w", (3, 4), [11, 0, 5], values, dtype, index_dtype=index_dtype, values_dtype=torch.float64
    )
    load(m, [patch])
    [[(_, staged)]] = m.calls
    assert staged.shape == (3, 4) and staged.dtype == dtype
    assert staged.device == patch.values.device
    flat = staged.reshape(-1)
    assert same_bits(flat[[11, 0, 5]], values.to(dtype))
    mask = torch.ones(12, dtype=torch.bool)
    mask[[11, 0, 5]] = False
    assert torch.isnan(flat[mask]).all()


def test_scalar_shape_is_staged_as_a_zero_dim_tensor(load, mk, Patch):
    m = RecordingModel({"s": torch.tensor(1.0), "t": torch.tensor(2.0)})
    load(m, [Patch("s", (), torch.float32, torch.tensor([5.0]))])
    load(m, [mk.sparse("t", (), [0], [7.0])])
    assert [c[0][1].shape for c in m.calls] == [torch.Size([]), torch.Size([])]
    assert (m.s.item(), m.t.item()) == (5.0, 7.0)


def test_zero_size_tensors_are_staged_and_loaded(load, Patch, mk):
    m = RecordingModel({"e": torch.zeros(0, 3)}, returns="empty")
    load(m, [Patch("e", (0, 3), torch.float32, torch.zeros(0))])
    load(m, [mk.sparse("e", (0, 3), [], [])])
    assert [c[0][1].shape for c in m.calls] == [torch.Size([0, 3])] * 2


# -- dense loads ------------------------------------------------------------------------------


def test_dense_load_replaces_whole_tensors(load, mk):
    m = RecordingModel({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    new_a = torch.arange(6.0).reshape(2, 3)
    assert load(m, [mk.dense("a", new_a), mk.dense("b", torch.full((4,), -1.0))]) == {"a", "b"}
    assert torch.equal(m.a.detach(), new_a)
    assert m.b.detach().eq(-1).all()


def test_dense_load_does_not_mask_nan(load, mk):
    m = RecordingModel({"a": torch.ones(3)})
    load(m, [mk.dense("a", torch.tensor([NAN, 2.0, NAN]))])
    assert torch.isnan(m.a[[0, 2]]).all() and m.a[1].item() == 2.0


def test_dense_load_updates_integer_buffers(load, mk):
    m = RecordingModel({"step": torch.zeros(3, dtype=torch.int64)})
    load(m, [mk.dense("step", torch.tensor([1, 2, 3]))])
    assert m.step.tolist() == [1, 2, 3]


def test_dense_loader_may_write_any_way_it_likes(load, mk):
    # No interception in dense calls: fill_, add_, broadcasting copies, returning None.
    class Free(RecordingModel):
        def load_weights(self, weights):
            for name, w in weights:
                p = getattr(self, name)
                p.fill_(0.0)
                p.add_(w)
                p.data[0] = w[0] * 2
                p.data[[1]] = w[[1]]
            self.calls.append([n for n, _ in weights])
            return None

    m = Free({"a": torch.full((3,), 9.0)})
    assert load(m, [mk.dense("a", torch.tensor([1.0, 2.0, 3.0]))]) == set()
    assert m.a.detach().tolist() == [2.0, 2.0, 3.0]


def test_dense_loader_returning_names_without_copying_is_fine(load, mk):
    m = SinkModel(returns="names")
    assert load(m, [mk.dense("a", torch.ones(2))]) == {"a"}
