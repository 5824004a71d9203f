"""CONTRACT §1: every check runs before the first ``load_weights`` call, in the stated order.

Every rejection is checked three ways: the error type the contract names, the model's
tensors bit for bit unchanged, and no ``load_weights`` call made (the bad patch comes
last, after valid patches that a small budget would have sent in earlier calls).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import patchkit

from ._models import NAN, RecordingModel, assert_untouched, snapshot

SHAPE = (2, 3)
# (torch 2.8 added float4_e2m1fn_x2: older torch cannot name it in a parametrization)
FP4 = getattr(torch, "float4_e2m1fn_x2", None)
needs_fp4 = pytest.mark.skipif(
    FP4 is None, reason="this torch has no float4_e2m1fn_x2 (torch 2.8 has it)")


def model() -> RecordingModel:
    return RecordingModel(
        {"a": torch.arange(6.0).reshape(SHAPE), "b": torch.arange(6.0).reshape(SHAPE) + 10}
    )


def good_dense(mk, name="a"):
    return mk.dense(name, torch.full(SHAPE, 7.0))


def good_sparse(mk, name="a"):
    return mk.sparse(name, SHAPE, [0, 4], [1.5, 2.5])


def rejected(load, patches, error, *, match=None, **kwargs):
    """Load ``patches`` into a fresh model; assert ``error``, no call, model untouched."""
    m = model()
    before = snapshot(m)
    with pytest.raises(error, match=match) as excinfo:
        load(m, patches, max_chunk_bytes=kwargs.pop("max_chunk_bytes", 24), **kwargs)
    assert m.calls == [], "a load_weights call was made before validation finished"
    assert_untouched(m, before)
    return excinfo.value


# One case per bullet of §1: (id, builder(mk, Patch) -> patches, error type, extra kwargs).
# The offending patch is always the last one.
BULLETS = [
    ("max_chunk_bytes zero", lambda mk, P: [good_dense(mk)], ValueError, {"max_chunk_bytes": 0}),
    (
        "max_chunk_bytes negative",
        lambda mk, P: [good_sparse(mk)],
        ValueError,
        {"max_chunk_bytes": -5},
    ),
    ("empty name", lambda mk, P: [good_dense(mk), good_dense(mk, "")], ValueError, {}),
    ("empty name sparse", lambda mk, P: [good_sparse(mk), good_sparse(mk, "")], ValueError, {}),
    (
        "dtype is a string",
        lambda mk, P: [good_dense(mk), P("b", SHAPE, "float32", torch.zeros(6))],
        TypeError,
        {},
    ),
    (
        "dtype is a python type",
        lambda mk, P: [good_sparse(mk), P("b", SHAPE, float, torch.zeros(1), torch.tensor([0]))],
        TypeError,
        {},
    ),
    (
        "negative dimension",
        lambda mk, P: [good_dense(mk), P("b", (2, -3), torch.float32, torch.zeros(6))],
        ValueError,
        {},
    ),
    (
        "negative dimension sparse",
        lambda mk, P: [
            good_sparse(mk),
            P("b", (-1,), torch.float32, torch.zeros(1), torch.tensor([0])),
        ],
        ValueError,
        {},
    ),
    (
        "dense values 2-D",
        lambda mk, P: [good_dense(mk), P("b", SHAPE, torch.float32, torch.zeros(SHAPE))],
        ValueError,
        {},
    ),
    (
        "dense values 0-D",
        lambda mk, P: [good_dense(mk), P("b", (), torch.float32, torch.tensor(1.0))],
        ValueError,
        {},
    ),
    (
        "sparse values 2-D",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(1, 1), torch.tensor([0])),
        ],
        ValueError,
        {},
    ),
    (
        "dense too few values",
        lambda mk, P: [good_dense(mk), P("b", SHAPE, torch.float32, torch.zeros(5))],
        ValueError,
        {},
    ),
    (
        "dense too many values",
        lambda mk, P: [good_dense(mk), P("b", SHAPE, torch.float32, torch.zeros(7))],
        ValueError,
        {},
    ),
    (
        "sparse int dtype",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.int32, torch.zeros(1, dtype=torch.int32), torch.tensor([0])),
        ],
        TypeError,
        {},
    ),
    (
        "sparse bool dtype",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.bool, torch.zeros(1, dtype=torch.bool), torch.tensor([0])),
        ],
        TypeError,
        {},
    ),
    (
        "sparse indices 2-D",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(2), torch.tensor([[0, 1]])),
        ],
        ValueError,
        {},
    ),
    (
        "sparse indices 0-D",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(1), torch.tensor(0)),
        ],
        ValueError,
        {},
    ),
    (
        "sparse indices float",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(2), torch.tensor([0.0, 1.0])),
        ],
        TypeError,
        {},
    ),
    (
        "sparse indices int16",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(2), torch.tensor([0, 1], dtype=torch.int16)),
        ],
        TypeError,
        {},
    ),
    (
        "sparse length mismatch",
        lambda mk, P: [
            good_sparse(mk),
            P("b", SHAPE, torch.float32, torch.zeros(3), torch.tensor([0, 1])),
        ],
        ValueError,
        {},
    ),
    ("mixed dense, sparse", lambda mk, P: [good_dense(mk), good_sparse(mk, "b")], ValueError, {}),
    ("mixed sparse, dense", lambda mk, P: [good_sparse(mk), good_dense(mk, "b")], ValueError, {}),
    (
        "NaN in values",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", SHAPE, [1, 2], [1.0, NAN])],
        ValueError,
        {},
    ),
    (
        "negative index",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", SHAPE, [1, -1], [1.0, 2.0])],
        ValueError,
        {},
    ),
    (
        "index equal to prod(shape)",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", SHAPE, [6], [1.0])],
        ValueError,
        {},
    ),
    (
        "index far out of range",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", SHAPE, [0, 1000], [1.0, 2.0])],
        ValueError,
        {},
    ),
    (
        "indices into a zero-size tensor",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", (0, 3), [0, 1], [1.0, 2.0])],
        ValueError,
        {},
    ),
    (
        "duplicate index in one patch",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", SHAPE, [3, 1, 3], [1.0, 2.0, 3.0])],
        ValueError,
        {},
    ),
    (
        # few unordered indices into a large tensor (found by sorting them, not by marking
        # every element)
        "duplicate index among few in a large tensor",
        lambda mk, P: [good_sparse(mk), mk.sparse("b", (64, 64), [70, 5, 70], [1.0, 2.0, 3.0])],
        ValueError,
        {},
    ),
]


@pytest.mark.parametrize(
    ("build", "error", "kwargs"),
    [pytest.param(b, e, k, id=i) for i, b, e, k in BULLETS],
)
def test_each_validation_error_raises_before_any_loader_call(load, mk, Patch, build, error, kwargs):
    rejected(load, build(mk, Patch), error, **dict(kwargs))


def test_bad_budget_is_rejected_even_for_an_empty_call(load):
    m = model()
    with pytest.raises(ValueError):
        load(m, [], max_chunk_bytes=0)
    assert m.calls == []


def test_mixing_dense_and_sparse_says_cannot_be_mixed(load, mk):
    rejected(load, [good_sparse(mk), good_dense(mk, "b")], ValueError, match="cannot be mixed")


def test_dense_count_error_names_both_counts(load, mk, Patch):
    err = rejected(load, [Patch("b", (4, 5), torch.float32, torch.zeros(13))], ValueError)
    assert "20" in str(err) and "13" in str(err)


def test_validation_runs_before_the_first_call_even_many_chunks_ahead(load, mk):
    # Budget 24 bytes = one (2, 3) float32 tensor per call: the bad patch is six calls away.
    patches = [good_sparse(mk, name) for name in "ababab"]
    patches.append(mk.sparse("a", SHAPE, [2], [NAN]))
    rejected(load, patches, ValueError)


def test_duplicates_allowed_when_unique_check_is_off(load, mk):
    m = model()
    load(m, [mk.sparse("a", SHAPE, [3, 3], [5.0, 5.0])], validate_unique_indices=False)
    assert m.a[1, 0].item() == 5.0


def test_two_patches_may_touch_the_same_index(load, mk):
    m = model()
    load(m, [mk.sparse("a", SHAPE, [3], [5.0]), mk.sparse("b", SHAPE, [3], [6.0])])
    assert (m.a[1, 0].item(), m.b[1, 0].item()) == (5.0, 6.0)


def test_empty_sparse_patch_and_boundary_indices_are_valid(load, mk):
    m = model()
    load(m, [mk.sparse("a", SHAPE, [], []), mk.sparse("b", SHAPE, [0, 5], [-1.0, -2.0])])
    assert m.b.detach().reshape(-1)[[0, 5]].tolist() == [-1.0, -2.0]


def test_dense_patch_may_carry_nan(load, mk):
    m = model()
    load(m, [mk.dense("a", torch.full(SHAPE, NAN))])
    assert torch.isnan(m.a).all()


# -- order ----------------------------------------------------------------------------------
# Pairs of faults whose error types differ, so the order is visible through the types alone.

ORDER_BY_TYPE = [
    (
        "max_chunk_bytes before patches",
        lambda mk, P: [P("a", SHAPE, "float32", torch.zeros(6))],
        {"max_chunk_bytes": 0},
        ValueError,
    ),
    (
        "empty name before dtype",
        lambda mk, P: [P("", SHAPE, "float32", torch.zeros(6))],
        {},
        ValueError,
    ),
    (
        "dtype before negative dimension",
        lambda mk, P: [P("a", (-1,), "float32", torch.zeros(6))],
        {},
        TypeError,
    ),
    (
        "values 1-D before sparse dtype",
        lambda mk, P: [P("a", SHAPE, torch.int64, torch.zeros(1, 1), torch.tensor([0]))],
        {},
        ValueError,
    ),
    (
        "sparse dtype before indices 1-D",
        lambda mk, P: [P("a", SHAPE, torch.int64, torch.zeros(1), torch.tensor([[0]]))],
        {},
        TypeError,
    ),
    (
        "indices 1-D before indices dtype",
        lambda mk, P: [P("a", SHAPE, torch.float32, torch.zeros(1), torch.tensor([[0.0]]))],
        {},
        ValueError,
    ),
    (
        "indices dtype before length",
        lambda mk, P: [P("a", SHAPE, torch.float32, torch.zeros(3), torch.tensor([0.0]))],
        {},
        TypeError,
    ),
    (
        "earlier patch's later check before later patch's earlier check",
        lambda mk, P: [
            P("a", SHAPE, torch.float32, torch.zeros(3), torch.tensor([0])),
            P("b", SHAPE, "float32", torch.zeros(1), torch.tensor([0])),
        ],
        {},
        ValueError,
    ),
    (
        "every patch's structure before mixing",
        lambda mk, P: [
            good_dense(mk),
            good_sparse(mk, "b"),
            P("c", SHAPE, "float32", torch.zeros(6)),
        ],
        {},
        TypeError,
    ),
    (
        "structure before values",
        lambda mk, P: [
            mk.sparse("a", SHAPE, [0], [NAN]),
            P("b", SHAPE, torch.float32, torch.zeros(1), torch.tensor([0.0])),
        ],
        {},
        TypeError,
    ),
]


@pytest.mark.parametrize(
    ("build", "kwargs", "error"),
    [pytest.param(b, k, e, id=i) for i, b, k, e in ORDER_BY_TYPE],
)
def test_checks_run_in_the_contract_order(load, mk, Patch, build, kwargs, error):
    err = rejected(load, build(mk, Patch), error, **dict(kwargs))
    other = TypeError if error is ValueError else ValueError
    assert not isinstance(err, other)


def test_mixing_is_reported_before_value_checks(load, mk):
    patches = [mk.sparse("a", SHAPE, [0], [NAN]), good_dense(mk, "b")]
    rejected(load, patches, ValueError, match="cannot be mixed")


# -- [patchkit] what the error says ---------------------------------------------------------

REASON_WORDS = {
    "NaN": ("NaN",),
    "out-of-range": ("out-of-range", "out of range"),
    "duplicate": ("duplicate", "more than once"),
}


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("bad", "reason", "value"),
    [
        pytest.param(([4, 1, 5], [1.0, NAN, 2.0]), "NaN", 1, id="NaN"),
        pytest.param(([4, 9, 5], [1.0, 2.0, 3.0]), "out-of-range", 9, id="too-large"),
        pytest.param(([4, -2, 5], [1.0, 2.0, 3.0]), "out-of-range", -2, id="negative"),
        pytest.param(([4, 1, 4], [1.0, 2.0, 3.0]), "duplicate", 4, id="duplicate"),
    ],
)
def test_value_error_names_position_name_reason_and_index(load, mk, bad, reason, value):
    name = "model.layers.0.mlp.down_proj.weight"
    patches = [good_sparse(mk), good_sparse(mk, "b"), mk.sparse(name, SHAPE, *bad)]
    err = rejected(load, patches, ValueError)
    assert isinstance(err, patchkit.PatchValueError)
    assert (err.position, err.name, err.reason, err.value) == (2, name, reason, value)
    text = str(err)
    assert "patch 2" in text and name in text and str(value) in text
    assert any(word in text for word in REASON_WORDS[reason]), text


@pytest.mark.patchkit_only
def test_value_error_names_the_first_offending_patch(load, mk):
    patches = [
        good_sparse(mk),
        mk.sparse("b", SHAPE, [3, 3], [1.0, 1.0]),  # duplicate
        mk.sparse("c", SHAPE, [2], [NAN]),  # NaN: an earlier reason, but a later patch
    ]
    err = rejected(load, patches, ValueError)
    assert (err.position, err.name, err.reason, err.value) == (1, "b", "duplicate", 3)


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("values", "indices", "reason"),
    [
        pytest.param([NAN, 1.0, 2.0], [9, 3, 3], "NaN", id="NaN before out-of-range"),
        pytest.param([0.0, 1.0, 2.0], [9, 3, 3], "out-of-range", id="out-of-range before dup"),
    ],
)
def test_value_checks_report_in_the_contract_order(load, mk, values, indices, reason):
    err = rejected(load, [mk.sparse("a", SHAPE, indices, values)], ValueError)
    assert err.reason == reason


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("build", "reason"),
    [
        pytest.param(lambda P: P("", SHAPE, torch.float32, torch.zeros(6)), "empty name", id="''"),
        pytest.param(lambda P: P("x", SHAPE, "f", torch.zeros(6)), "dtype type", id="dtype"),
        pytest.param(
            lambda P: P("x", (-2, 3), torch.float32, torch.zeros(6)), "negative dimension",
            id="negative",
        ),
        pytest.param(
            lambda P: P("x", SHAPE, torch.float32, torch.zeros(2, 3)), "values not 1-D", id="1-D"
        ),
        pytest.param(lambda P: P("x", SHAPE, torch.float32, torch.zeros(5)), "dense count", id="n"),
        pytest.param(
            lambda P: P("x", SHAPE, torch.int8, torch.zeros(1), torch.tensor([0])),
            "sparse dtype",
            id="sparse dtype",
        ),
        pytest.param(
            lambda P: P("x", SHAPE, torch.float32, torch.zeros(1), torch.tensor([[0]])),
            "indices not 1-D",
            id="indices 1-D",
        ),
        pytest.param(
            lambda P: P("x", SHAPE, torch.float32, torch.zeros(1), torch.tensor([0.0])),
            "indices dtype",
            id="indices dtype",
        ),
        pytest.param(
            lambda P: P("x", SHAPE, torch.float32, torch.zeros(2), torch.tensor([0])),
            "length mismatch",
            id="length",
        ),
    ],
)
def test_structure_error_names_position_name_and_reason(load, Patch, mk, build, reason):
    bad = build(Patch)
    good = good_dense(mk) if bad.indices is None else good_sparse(mk)
    err = rejected(load, [good, good, bad], (ValueError, TypeError))
    assert isinstance(err, patchkit.PatchError)
    assert (err.position, err.name, err.reason) == (2, bad.name, reason)
    assert f"patch 2 ({bad.name!r})" in str(err)


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        pytest.param((-1,), torch.zeros(1, 1), "negative dimension", id="negative before 1-D"),
        pytest.param(SHAPE, torch.zeros(1, 1), "values not 1-D", id="1-D before count"),
    ],
)
def test_same_type_checks_report_in_the_contract_order(load, Patch, first, second, reason):
    err = rejected(load, [Patch("a", first, torch.float32, second)], ValueError)
    assert err.reason == reason


@pytest.mark.patchkit_only
@pytest.mark.parametrize(("first", "later"), [("dense", "sparse"), ("sparse", "dense")])
def test_mixing_error_names_the_later_kind_and_says_mixed(load, mk, first, later):
    make = {"dense": good_dense, "sparse": good_sparse}
    patches = [make[first](mk), make[first](mk, "b"), make[later](mk, "c"), make[first](mk, "d")]
    err = rejected(load, patches, ValueError)
    assert (err.position, err.name, err.reason, err.value) == (2, "c", "mixed", later)
    assert f"(patch 0 is {first}, this one is {later})" in str(err)


@pytest.mark.patchkit_only
@pytest.mark.parametrize("budget", ["64", True, None])
def test_max_chunk_bytes_must_be_a_number(load, mk, budget):
    err = rejected(load, [good_dense(mk)], TypeError, max_chunk_bytes=budget)
    assert isinstance(err, patchkit.PatchTypeError)


@pytest.mark.parametrize("budget", [
    0.0, -1.0,
    # (NaN is not <= 0: refusing it is patchkit's check of a whole number of bytes)
    pytest.param(float("nan"), marks=pytest.mark.patchkit_only),
])
def test_a_budget_that_is_not_positive_is_a_value_error_whatever_its_type(load, mk, budget):
    # CONTRACT §1.1: max_chunk_bytes <= 0 -> ValueError (a float too)
    rejected(load, [good_dense(mk)], ValueError, max_chunk_bytes=budget)


@pytest.mark.patchkit_only
def test_a_whole_number_budget_of_another_type_is_taken_and_a_fraction_is_not(load, mk):
    np = pytest.importorskip("numpy")
    calls = []
    for budget in (24, np.int64(24), 24.0, 2.4e1):
        m = model()
        assert load(m, [good_dense(mk), good_dense(mk, "b")], max_chunk_bytes=budget) == {"a", "b"}
        calls.append([[name for name, _ in call] for call in m.calls])
    assert calls[0] == calls[1] == calls[2] == calls[3] and len(calls[0]) == 2
    assert patchkit.plan_chunks([good_dense(mk), good_dense(mk, "b")], 64.0) == (
        patchkit.plan_chunks([good_dense(mk), good_dense(mk, "b")], 64))
    err = rejected(load, [good_dense(mk)], ValueError, max_chunk_bytes=1.5)
    assert (err.reason, err.value) == ("max_chunk_bytes", 1.5)


@pytest.mark.patchkit_only
def test_valid_input_never_searches_for_an_offending_index(load, mk, monkeypatch):
    def search(*args, **kwargs):
        raise AssertionError("the offending-index search ran on valid input")

    monkeypatch.setattr(patchkit.patch, "_first_offending_index", search)
    m = model()
    load(m, [good_sparse(mk), mk.sparse("b", SHAPE, list(range(6)), [0.5] * 6)])
    assert m.b.detach().eq(0.5).all()
    with pytest.raises(AssertionError, match="offending-index search"):
        load(m, [mk.sparse("a", SHAPE, [0], [NAN])])


@pytest.mark.patchkit_only
@pytest.mark.parametrize("dtype", [torch.qint8, torch.bits8, pytest.param(FP4, marks=needs_fp4)])
def test_a_dtype_that_cannot_be_staged_is_refused_before_the_first_call(load, mk, dtype):
    # patch 0 is good: a load that found out while staging patch 1 had written patch 0
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, dtype, torch.zeros(6), None)
    err = rejected(load, [good_dense(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.name, err.reason, err.value) == (1, "b", "unstageable dtype", dtype)


@pytest.mark.patchkit_only
def test_torch_sparse_values_or_indices_are_refused_by_name(load, mk):
    coo = torch.zeros(6).to_sparse()
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, torch.float32, coo, None)
    err = rejected(load, [good_dense(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.reason) == (1, "values layout")
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, torch.float32, torch.ones(1),
                                torch.tensor([1]).to_sparse())
    err = rejected(load, [good_sparse(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.reason) == (1, "indices layout")


@pytest.mark.patchkit_only
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_values_or_indices_are_refused_by_name(load, mk, layout):
    # (a strided nested tensor cannot even say its shape: its check comes first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that nested tensors are a prototype)
        values = torch.nested.nested_tensor([torch.ones(3), torch.ones(3)], layout=layout)
        indices = torch.nested.nested_tensor([torch.tensor([0]), torch.tensor([1])],
                                             layout=layout)
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, torch.float32, values, None)
    err = rejected(load, [good_dense(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.name, err.reason) == (1, "b", "values layout")
    assert "nested" in str(err)
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, torch.float32, torch.ones(2), indices)
    err = rejected(load, [good_sparse(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.name, err.reason) == (1, "b", "indices layout")


@pytest.mark.patchkit_only
def test_complex_values_for_a_real_dtype_are_refused_before_the_first_call(load, mk):
    # the cast would drop the imaginary part (torch only warns)
    bad = patchkit.CheckpointWeightPatch("b", SHAPE, torch.float32,
                                         torch.full((6,), 1 + 2j, dtype=torch.complex64), None)
    err = rejected(load, [good_dense(mk), bad], TypeError, max_chunk_bytes=24)
    assert (err.position, err.reason) == (1, "unstageable dtype")
    assert "imaginary part" in str(err)


@pytest.mark.patchkit_only
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_a_non_finite_value_for_an_integer_dtype_is_refused(load, mk, bad_value):
    # NaN cast to int32 is -2147483648: an arbitrary integer written into the model
    m = RecordingModel({"i": torch.zeros(3, dtype=torch.int32)})
    vals = torch.tensor([1.0, bad_value, 3.0])
    with pytest.raises(ValueError, match=r"has no torch.int32 value") as info:
        load(m, [patchkit.CheckpointWeightPatch("i", (3,), torch.int32, vals, None)])
    assert (info.value.position, info.value.reason) == (0, "not finite")
    assert m.calls == [] and m.i.tolist() == [0, 0, 0]
    load(m, [patchkit.CheckpointWeightPatch("i", (3,), torch.int32, torch.tensor([1.0, 2, 3]),
                                            None)])
    assert m.i.tolist() == [1, 2, 3]
