"""Property-based tests (hypothesis) for validation (§1) and chunking (§2).

- Random valid patch lists never raise, and the loader's calls follow the contract walk.
- One random corruption of a valid list always raises the error type the contract names,
  before any call; under patchkit the error also names the right position and reason.
- ``plan_chunks`` partitions the positions in order, never repeats a name in a chunk,
  stays within budget unless a chunk is a single patch, gives consistent closing reasons
  and is greedy-maximal; the loader makes exactly the calls it shows.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchkit import plan_chunks

from ._models import SinkModel, reference_chunks, staged_bytes

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NAMES = st.sampled_from(["a", "b", "c", "model.layers.0.mlp.up_proj.weight"])
SHAPES = st.lists(st.integers(0, 4), max_size=3).map(tuple)
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INT_DTYPES = [torch.int32, torch.int64, torch.uint8]


def _tensor(xs, dtype):
    return torch.tensor(xs, dtype=torch.float64).to(dtype)


@st.composite
def dense_spec(draw):
    shape = draw(SHAPES)
    dtype = draw(st.sampled_from(FLOAT_DTYPES + INT_DTYPES))
    values_dtype = dtype
    if dtype.is_floating_point:
        values_dtype = draw(st.sampled_from([dtype, torch.float64]))
    n = math.prod(shape)
    xs = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    return [draw(NAMES), shape, dtype, _tensor(xs, values_dtype), None]


@st.composite
def sparse_spec(draw):
    shape = draw(SHAPES)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    n = math.prod(shape)
    idx = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=6)) if n else []
    xs = draw(
        st.lists(
            st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=len(idx), max_size=len(idx)
        )
    )
    values_dtype = draw(st.sampled_from([dtype, torch.float64]))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    indices = torch.tensor(idx, dtype=index_dtype)
    return [draw(NAMES), shape, dtype, _tensor(xs, values_dtype), indices]


@st.composite
def valid_specs(draw, min_size=0):
    kind = draw(st.sampled_from(["dense", "sparse"]))
    spec = dense_spec() if kind == "dense" else sparse_spec()
    return kind, draw(st.lists(spec, min_size=min_size, max_size=6))


# -- validation -----------------------------------------------------------------------------


@SETTINGS
@given(valid=valid_specs(), budget=st.integers(1, 200))
def test_random_valid_patches_never_raise_and_follow_the_walk(load, Patch, valid, budget):
    _, specs = valid
    patches = [Patch(*s) for s in specs]
    m = SinkModel()
    assert load(m, iter(patches), max_chunk_bytes=budget) == set()
    expected = [[patches[i].name for i in chunk] for chunk in reference_chunks(patches, budget)]
    assert m.names_per_call() == expected
    for call, chunk in zip(m.calls, reference_chunks(patches, budget)):
        assert [(shape, dtype) for _, shape, dtype, _ in call] == [
            (tuple(patches[i].shape), patches[i].dtype) for i in chunk
        ]


def _corrupt(draw, kind, specs, pos):
    """Apply one corruption to ``specs[pos]``; return (error type, reason, position, value)."""
    name, shape, dtype, values, indices = spec = specs[pos]
    options = ["empty name", "dtype type", "negative dimension", "values not 1-D"]
    if kind == "dense":
        options.append("dense count")
        if dtype.is_floating_point and len(specs) > 1:
            options.append("mixed")
    else:
        options += ["sparse dtype", "indices not 1-D", "indices dtype", "length mismatch"]
        if len(specs) > 1:
            options.append("mixed")
        if values.numel():
            options += ["NaN", "out-of-range", "duplicate"]
    what = draw(st.sampled_from(options))
    n = math.prod(shape)
    k = draw(st.integers(0, max(0, values.numel() - 1)))
    value = None
    if what == "empty name":
        spec[0] = ""
    elif what == "dtype type":
        spec[2] = draw(st.sampled_from(["float32", float, None, 4]))
    elif what == "negative dimension":
        d = draw(st.integers(-5, -1))
        spec[1] = (*shape[:-1], d) if shape else (d,)
    elif what == "values not 1-D":
        spec[3] = values.reshape(1, -1) if draw(st.booleans()) else values.reshape(-1, 1, 1)
    elif what == "dense count":
        spec[3] = torch.cat([values, values[:1] if values.numel() else values.new_zeros(1)])
        if values.numel() and draw(st.booleans()):
            spec[3] = values[1:]
    elif what == "sparse dtype":
        spec[2] = draw(st.sampled_from([*INT_DTYPES, torch.bool]))
    elif what == "indices not 1-D":
        spec[4] = indices.reshape(1, -1)
    elif what == "indices dtype":
        spec[4] = indices.to(draw(st.sampled_from([torch.float32, torch.int16, torch.uint8])))
    elif what == "length mismatch":
        spec[3] = torch.cat([values, values.new_zeros(1)])
    elif what == "NaN":
        spec[3] = values.clone()
        spec[3][k] = float("nan")
        value = int(indices[k])
    elif what == "out-of-range":
        value = draw(st.one_of(st.integers(n, n + 10), st.integers(-10, -1)))
        spec[4] = indices.clone()
        spec[4][k] = value
    elif what == "duplicate":
        value = int(indices[k])
        spec[4] = torch.cat([indices, indices[k : k + 1]])
        spec[3] = torch.cat([values, values[k : k + 1]])
    elif what == "mixed":
        if kind == "dense":
            spec[3], spec[4] = values[:0], torch.zeros(0, dtype=torch.int64)
        else:
            spec[3], spec[4] = torch.zeros(n, dtype=dtype), None
        pos = 1 if pos == 0 else pos  # the first patch whose kind differs from an earlier one
        name = specs[pos][0]
    error = TypeError if what in ("dtype type", "sparse dtype", "indices dtype") else ValueError
    return error, what, pos, spec[0] if what != "mixed" else name, value


@SETTINGS
@given(valid=valid_specs(min_size=1), data=st.data())
def test_one_random_corruption_raises_the_right_error_naming_the_right_patch(
    load, Patch, patchkit_selected, valid, data
):
    kind, specs = valid
    pos = data.draw(st.integers(0, len(specs) - 1), label="position")
    error, reason, at, name, value = _corrupt(data.draw, kind, specs, pos)
    m = SinkModel()
    with pytest.raises(error) as excinfo:
        load(m, [Patch(*s) for s in specs], max_chunk_bytes=1)
    assert m.calls == []
    if reason != "mixed":
        other = TypeError if error is ValueError else ValueError
        assert not isinstance(excinfo.value, other)
    if patchkit_selected:
        err = excinfo.value
        assert (err.position, err.reason) == (at, reason)
        assert err.name == name
        assert f"patch {at}" in str(err)
        if value is not None:
            assert err.value == value


# -- chunking -------------------------------------------------------------------------------

CHUNK_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int8])


@st.composite
def chunk_specs(draw):
    items = draw(
        st.lists(
            st.tuples(st.sampled_from("abcde"), st.integers(0, 12), CHUNK_DTYPES), max_size=14
        )
    )
    return items, draw(st.integers(1, 64))


def _patches(Patch, items):
    return [Patch(n, (k,), dtype, torch.zeros(k, dtype=dtype)) for n, k, dtype in items]


@pytest.mark.patchkit_only
@SETTINGS
@given(spec=chunk_specs())
def test_plan_chunks_invariants(Patch, spec):
    items, budget = spec
    patches = _patches(Patch, items)
    chunks = plan_chunks(patches, budget)
    cost = [staged_bytes(p.shape, p.dtype) for p in patches]
    # a partition of the positions, in order
    assert [i for c in chunks for i in c.positions] == list(range(len(patches)))
    assert all(c.positions for c in chunks)
    for j, c in enumerate(chunks):
        assert c.index == j
        assert c.names == tuple(patches[i].name for i in c.positions)
        assert len(set(c.names)) == len(c.names), "a chunk repeats a name"
        assert c.bytes == sum(cost[i] for i in c.positions)
        assert c.over_budget == (c.bytes > budget)
        if len(c.positions) > 1:
            assert c.bytes <= budget
        if j == len(chunks) - 1:
            assert c.closed_by == "end"
            continue
        nxt = c.positions[-1] + 1
        repeated = patches[nxt].name in c.names
        over = c.bytes + cost[nxt] > budget
        # closing reasons are consistent, and the chunk could not have taken the next patch
        assert c.closed_by == ("repeated name" if repeated else "budget")
        assert repeated or over
    assert [list(c.positions) for c in chunks] == reference_chunks(patches, budget)


@SETTINGS
@given(spec=chunk_specs())
def test_loader_calls_equal_the_contract_walk(load, Patch, spec):
    items, budget = spec
    patches = _patches(Patch, items)
    m = SinkModel(returns="names")
    assert load(m, patches, max_chunk_bytes=budget) == {p.name for p in patches}
    expected = [[patches[i].name for i in c] for c in reference_chunks(patches, budget)]
    assert m.names_per_call() == expected


@pytest.mark.patchkit_only
@SETTINGS
@given(spec=chunk_specs(), sparse=st.booleans())
def test_loader_calls_equal_plan_chunks(load, Patch, spec, sparse):
    items, budget = spec
    if sparse:
        items = [(n, k, dt if dt.is_floating_point else torch.float32) for n, k, dt in items]
    patches = _patches(Patch, items)
    if sparse:
        patches = [p._replace(indices=torch.zeros(0, dtype=torch.int64), values=p.values[:0])
                   for p in patches]
    m = SinkModel()
    load(m, patches, max_chunk_bytes=budget)
    assert m.names_per_call() == [list(c.names) for c in plan_chunks(patches, budget)]
