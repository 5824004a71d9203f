"""Input that is no valid patch, and loaders that return something other than names:
refused by patchkit's own errors, naming the patch, with the model as it was, and the
report of such a load readable in every form (tables, text, HTML, pickle, figures,
widgets)."""

from __future__ import annotations

import importlib.util
import pickle
import re

import matplotlib
import pandas as pd
import pytest
import torch

import patchkit
from patchkit import (
    CheckpointWeightPatch,
    ContractViolation,
    PatchTypeError,
    PatchValueError,
    inspect_load,
    load_checkpoint_weight_patches,
    plan_chunks,
)
from patchkit.build import wire_bytes
from patchkit.toymodels import PlainModel

P = CheckpointWeightPatch
HAVE_WIDGETS = importlib.util.find_spec("ipywidgets") is not None
GOOD = P("a", (4,), torch.float32, torch.ones(4))

NOT_A_PATCH = {
    "None": None,
    "4-tuple": ("a", (4,), torch.float32, torch.ones(4)),
    "dict": {"name": "a"},
}
BAD_FIELDS = {
    "values list": P("a", (4,), torch.float32, [1.0] * 4),
    "dtype str": P("a", (4,), "float32", torch.ones(4)),
    "shape None": P("a", None, torch.float32, torch.ones(4)),
    "name int": P(5, (4,), torch.float32, torch.ones(4)),
    "negative dim": P("a", (-4,), torch.float32, torch.ones(4)),
}


def _loaders():
    return {"own": {}, "observed": {"loader": load_checkpoint_weight_patches}}


@pytest.mark.parametrize("loader", ["own", "observed"])
@pytest.mark.parametrize("bad", [*NOT_A_PATCH, *BAD_FIELDS])
def test_a_refused_load_of_a_malformed_patch_has_a_report_that_reads_in_every_form(bad, loader):
    matplotlib.use("Agg")
    item = {**NOT_A_PATCH, **BAD_FIELDS}[bad]
    model = PlainModel({"a": (4,), "b": (4,)})
    before = {n: t.clone() for n, t in model.state_dict().items()}
    good_b = P("b", (4,), torch.float32, torch.full((4,), 2.0))
    with pytest.raises(patchkit.PatchError) as e:
        inspect_load(model, [good_b, item], **_loaders()[loader])
    assert isinstance(e.value, TypeError | ValueError)
    assert e.value.position == 1 and str(e.value).startswith("patch 1")
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    report = e.value.report
    chunks = report.chunks
    assert list(chunks["position"]) == [0, 1]
    assert chunks["name"].iloc[0] == "b" and chunks["bytes"].iloc[0] == 16
    assert chunks["note"].iloc[1].startswith("not a valid patch: patch 1")
    assert chunks["bytes"].iloc[1] is pd.NA and pd.isna(chunks["kind"].iloc[1])
    assert str(chunks["bytes"].dtype) == "Int64"  # (16, not 16.0, beside the missing one)
    assert "patches=2" in repr(report) and "load_weights calls=0" in repr(report)
    assert "LoadReport" in report._repr_html_()
    assert report.summary()["patches"] == 2
    again = pickle.loads(pickle.dumps(e.value))
    assert again.report.chunks["note"].tolist() == chunks["note"].tolist()
    if HAVE_WIDGETS:  # (the notebooks extra; the rest holds without it)
        explorer = report.explore()
        for value, _ in [(v, lab) for lab, v in explorer.dropdown.options]:
            explorer.dropdown.value = value  # each view, or a line saying why there is none
            assert explorer.output.outputs
    report.plot_chunks()
    report.plot_placement()


@pytest.mark.parametrize("loader", ["own", "observed"])
def test_a_malformed_item_s_row_has_the_name_it_was_given_where_that_is_a_str(loader):
    # (the item's name where it has a str one, a tuple's first field; none otherwise)
    given = {"None": None, "4-tuple": "a", "dict": None, "values list": "a",
             "dtype str": "a", "shape None": "a", "name int": None, "negative dim": "a"}
    for bad, item in {**NOT_A_PATCH, **BAD_FIELDS}.items():
        with pytest.raises(patchkit.PatchError) as e:
            inspect_load(PlainModel({"a": (4,), "b": (4,)}),
                         [P("b", (4,), torch.float32, torch.ones(4)), item],
                         **_loaders()[loader])
        name = e.value.report.chunks["name"].iloc[1]
        assert name == given[bad] if given[bad] else pd.isna(name), bad
    with pytest.raises(patchkit.PatchError) as e:  # (as the repr writes a name: quoted)
        inspect_load(PlainModel({"a": (4,)}), [P("a\n", (4,), "float32", torch.ones(4))])
    assert e.value.report.chunks["name"].iloc[0] == "a\n"
    assert "'a\\n'" in repr(e.value.report)


def test_plan_chunks_refuses_what_the_loader_refuses_by_name_and_position():
    for bad, item in BAD_FIELDS.items():
        if bad == "values list":
            continue  # (a plan reads names, shapes and dtypes only)
        with pytest.raises(patchkit.PatchError) as e:
            plan_chunks([GOOD, item], 1024)
        assert e.value.position == 1, bad
    # the cases a conversion with int() let through: a float dim, a str shape, an empty
    # name, a bool dim
    for item, reason in [
        (P("a", (2.5,), torch.float32, torch.ones(2)), "shape type"),
        (P("a", "44", torch.float32, torch.ones(16)), "shape type"),
        (P("", (4,), torch.float32, torch.ones(4)), "empty name"),
        (P("a", (True, 4), torch.float32, torch.ones(4)), "shape type"),
        (P(["a"], (4,), torch.float32, torch.ones(4)), "name type"),
    ]:
        with pytest.raises((PatchTypeError, PatchValueError)) as e:
            plan_chunks([item, GOOD])
        assert e.value.position == 0 and e.value.reason == reason
    # what it accepts as the loader does: torch.Size, numpy ints, a list
    import numpy as np

    ok = [P("a", torch.Size([4]), torch.float32, torch.ones(4)),
          P("b", [np.int64(2), 2], torch.float32, torch.ones(4)), GOOD]
    assert [c.bytes for c in plan_chunks(ok, 32)] == [32, 16]


def test_the_chunk_figures_refuse_a_malformed_patch_by_name():
    from patchkit.plot import plot_chunks

    for item in (BAD_FIELDS["dtype str"], BAD_FIELDS["shape None"], BAD_FIELDS["negative dim"]):
        with pytest.raises(patchkit.PatchError, match=r"^patch 1 \('a'\)"):
            plot_chunks([GOOD, item])


def test_the_chunk_planner_refuses_a_malformed_patch_by_name():
    pytest.importorskip("ipywidgets")
    from patchkit.widgets import chunk_planner

    for item in (BAD_FIELDS["dtype str"], BAD_FIELDS["shape None"], BAD_FIELDS["negative dim"]):
        with pytest.raises(patchkit.PatchError, match=r"^patch 1 \('a'\)"):
            chunk_planner([GOOD, item])


def test_wire_bytes_names_the_field_that_is_no_tensor():
    with pytest.raises(PatchTypeError, match=r"patch 1 \('a'\): values must be a torch.Tensor"):
        wire_bytes([GOOD, BAD_FIELDS["values list"]])
    with pytest.raises(PatchTypeError, match=r"patch 0 \('a'\): indices must be a torch"):
        wire_bytes([P("a", (4,), torch.float32, torch.ones(1), [0])])


class Returning(PlainModel):
    """Loads as PlainModel, then returns ``self.ret`` instead of the names."""

    ret: object = None

    def load_weights(self, weights):
        super().load_weights(weights)
        return self.ret


@pytest.mark.parametrize("ret, shown", [
    ("ab", "'ab' (str)"),
    (7, "7 (int)"),
    ([1], "a int among its names, 1 (list)"),
    ([["a"]], "[['a']] (list)"),
    ({b"a"}, "a bytes among its names, b'a' (set)"),
])
@pytest.mark.parametrize("transactional", [False, True])
def test_a_loader_that_returns_no_names_is_outside_the_contract(ret, shown, transactional):
    model = Returning({"a": (4,), "b": (4,)})
    model.ret = ret
    patches = [GOOD, P("b", (4,), torch.float32, torch.ones(4))]
    with pytest.raises(ContractViolation) as e:
        load_checkpoint_weight_patches(model, patches, max_chunk_bytes=16,
                                       transactional=transactional)
    assert isinstance(e.value, NotImplementedError)
    assert str(e.value).startswith(f"load_weights (call 0, patch 0 ('a')) returned {shown}")
    assert (e.value.position, e.value.name, e.value.reason) == (0, "a", "returned names")
    # the call's writes stay, unless the load was transactional; nothing after it runs
    assert model.a.tolist() == ([0.0] * 4 if transactional else [1.0] * 4)
    assert model.b.tolist() == [0.0] * 4
    # the report of it says the same
    model = Returning({"a": (4,), "b": (4,)})
    model.ret = ret
    with pytest.raises(ContractViolation) as e:
        inspect_load(model, patches, max_chunk_bytes=16, transactional=transactional)
    assert e.value.report.calls["error"].tolist() == [True]


def test_a_loader_may_return_names_in_any_iterable_or_none():
    for ret, want in [(None, set()), ({"a"}, {"a"}), (("a",), {"a"}), ({"a": 1}, {"a"}),
                      (iter(["a"]), {"a"}), (frozenset(), set())]:
        model = Returning({"a": (4,)})
        model.ret = ret
        assert load_checkpoint_weight_patches(model, [GOOD]) == want
        assert model.a.tolist() == [1.0] * 4


def test_many_patches_in_the_call_are_counted_past_the_first_five():
    model = Returning({n: (1,) for n in "abcdefg"})
    model.ret = 7
    patches = [P(n, (1,), torch.float32, torch.ones(1)) for n in "abcdefg"]
    with pytest.raises(ContractViolation) as e:
        load_checkpoint_weight_patches(model, patches)
    assert str(e.value).startswith(
        "load_weights (call 0, patch 0 ('a'), patch 1 ('b'), patch 2 ('c'), patch 3 ('d'), "
        "patch 4 ('e'), and 2 more) returned 7")
    assert e.value.position is None  # (no one patch is at fault)


def test_a_runtime_tensor_named_by_anything_but_a_str_is_a_type_error_saying_so():
    matplotlib.use("Agg")
    report = inspect_load(PlainModel({"a": (4,)}), [GOOD])
    for method in (report.after, report.before, report.written, report.plot_delta):
        with pytest.raises(TypeError, match=r"(named by a str|name \(str\)).* got list: "):
            method(["a"])
    for bad, shown in ((5, "int: 5"), (b"a", "bytes: b'a'")):
        with pytest.raises(TypeError, match=f"targets must be .* got {shown}"):
            report.plot_placement(bad)
    assert report.plot_placement(("a",)) is not None  # (a tuple of names is a list of them)


class GenModel(PlainModel):
    """A generator-function loader: it copies while it is iterated, then fails."""

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
            yield name
            raise TypeError("a bug inside the loader")


def test_a_type_error_inside_a_generator_loader_propagates_as_it_is():
    import pickle

    for run in (lambda m, ps: load_checkpoint_weight_patches(m, ps),
                lambda m, ps: inspect_load(m, ps),
                lambda m, ps: inspect_load(m, ps, loader=load_checkpoint_weight_patches)):
        with pytest.raises(TypeError, match="a bug inside the loader") as e:
            run(GenModel({"a": (4,)}), [GOOD])
        assert not isinstance(e.value, ContractViolation)
        pickle.loads(pickle.dumps(e.value))  # (with its report, where it has one)


class YieldsNumbers(PlainModel):
    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
            yield 1


def test_a_contract_violation_for_what_a_loader_returned_pickles_and_names_the_items():
    import pickle

    with pytest.raises(ContractViolation) as e:
        inspect_load(YieldsNumbers({"a": (4,)}), [GOOD])
    assert "returned a int among its names, 1 (generator)" in str(e.value)
    assert e.value.value == 1
    again = pickle.loads(pickle.dumps(e.value))
    assert again.report.calls["error"].tolist() == [True]


@pytest.mark.parametrize("ret, shown", [("ab", "'ab' (str)"), (7, "7 (int)"),
                                        (b"a", "b'a' (bytes)")])
def test_an_observed_loaders_model_that_returns_no_names_is_named_the_same_way(ret, shown):
    model = Returning({"a": (4,)})
    model.ret = ret
    with pytest.raises(ContractViolation, match=rf"returned {re.escape(shown)}"):
        inspect_load(model, [GOOD], loader=load_checkpoint_weight_patches)


def test_a_shape_too_large_is_checked_after_the_values_as_before():
    from patchkit.patch import _check_structure

    huge = (1 << 62, 4)
    for values, reason in (([1.0, 2.0], "values type"), (torch.ones(2, 2), "values not 1-D"),
                           (torch.ones(3), "shape too large")):
        with pytest.raises(patchkit.PatchError) as e:
            _check_structure(0, ("w", huge, torch.float32, values, None))
        assert e.value.reason == reason


def test_plan_chunks_takes_plain_and_torch_size_shapes_without_the_full_checks(monkeypatch):
    # (every patch of a plan is checked; the common shapes in one pass, not field by field)
    import patchkit.chunking as chunking

    calls = []
    real = chunking._check_metadata
    monkeypatch.setattr(chunking, "_check_metadata", lambda *a: calls.append(a) or real(*a))
    ps = [P("a", (4, 4), torch.float32, torch.ones(16)),
          P("b", torch.Size([4, 4]), torch.float32, torch.ones(16))]
    assert [c.bytes for c in plan_chunks(ps, 64)] == [64, 64]
    assert calls == []
    plan_chunks([P("c", [4, 4], torch.float32, torch.ones(16))], 64)  # (a list: checked)
    assert len(calls) == 1


def test_a_five_tuple_without_the_records_fields_is_refused_by_position_not_attributeerror():
    # A namedtuple of other field names (or a tuple subclass) passed the "a 5-tuple"
    # check and then failed with a bare AttributeError ('W' has no attribute 'indices')
    # in the load, the staging and the inspection, while plan_chunks planned it.
    import collections

    other = collections.namedtuple("W", "n s d v i")
    subclass = type("T", (tuple,), {})
    model = PlainModel({"a": (4,), "b": (4,)})
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for sparse in (False, True):
        fields = ("a", (4,), torch.float32, torch.ones(2), torch.tensor([0, 3])) if sparse \
            else ("a", (4,), torch.float32, torch.ones(4), None)
        for item in (other(*fields), subclass(fields)):
            good_b = P("b", (4,), torch.float32, torch.full((4,), 2.0),
                       torch.arange(4) if sparse else None)
            for call in (lambda ps: load_checkpoint_weight_patches(model, ps),
                         lambda ps: load_checkpoint_weight_patches(model, ps, transactional=True),
                         lambda ps: plan_chunks(ps, 1024),
                         lambda ps: inspect_load(model, ps)):
                with pytest.raises(PatchTypeError, match=r"^patch 1: expected a Checkpoint") as e:
                    call([good_b, item])
                assert (e.value.position, e.value.reason) == (1, "not a patch")
            with pytest.raises(PatchTypeError, match=type(item).__name__):
                patchkit.stage(item)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    # a record of the same fields in the same order (another implementation's) still loads
    import typing

    class Record(typing.NamedTuple):
        name: str
        shape: tuple
        dtype: torch.dtype
        values: torch.Tensor
        indices: torch.Tensor | None = None

    assert load_checkpoint_weight_patches(
        model, [Record("a", (4,), torch.float32, torch.full((4,), 3.0))]) == {"a"}
    assert model.a.tolist() == [3.0] * 4


def test_a_huge_field_is_shown_cut_short_in_the_message():
    """A name, shape or dtype that is a huge list or string (fields in the wrong order,
    a file's text) is refused with a message of a few lines, not one that holds its whole
    repr; the attribute keeps the object itself."""
    huge = [0.5] * 100_000
    model = PlainModel({"a": (4,)})
    cases = [
        (P(huge, (4,), torch.float32, torch.ones(4)), "name type", r"^patch 0 \(\[0\.5, 0\.5"),
        (P("a", huge, torch.float32, torch.ones(4)), "shape type",
         r"^patch 0 \('a'\): shape must be a tuple of ints, got \[0\.5, 0\.5.*\.\.\.$"),
        (P("a", "x" * 100_000, torch.float32, torch.ones(4)), "shape type",
         r"got 'xxxx.*\.\.\.$"),
        (P("a", (4,), huge, torch.ones(4)), "dtype type",
         r"^patch 0 \('a'\): dtype must be a torch\.dtype, got \[0\.5, 0\.5.*\.\.\. \(list\)$"),
    ]
    for patch, reason, pattern in cases:
        for call in (lambda ps: load_checkpoint_weight_patches(model, ps),
                     lambda ps: plan_chunks(ps, 1024)):
            with pytest.raises(PatchTypeError) as e:
                call([patch])
            assert re.search(pattern, str(e.value)), str(e.value)[:300]
            assert len(str(e.value)) < 300
            assert (e.value.position, e.value.reason) == (0, reason)
    assert model.a.tolist() == [0.0] * 4


def test_a_newcomers_patch_mistakes_say_what_to_do():
    # The natural first mistakes in building a patch: a numpy array or a list as values
    # or indices, the 2-D tensor itself as dense values, (row, col) pairs as indices, a
    # dtype given by its name. Each error says what to pass instead, and the model is
    # left as it was.
    import numpy as np

    model = PlainModel({"w": (2, 3)}, fill=1.0)
    cases = [
        (P("w", (2, 3), torch.float32, np.ones(6, dtype=np.float32)),
         PatchTypeError, r"values must be a torch\.Tensor, got ndarray \(convert it: "
         r"torch\.as_tensor\(\.\.\.\)\)"),
        (P("w", (2, 3), torch.float32, [1.0] * 6),
         PatchTypeError, r"got list \(convert it: torch\.as_tensor"),
        (P("w", (2, 3), torch.float32, torch.ones(1), np.array([4])),
         PatchTypeError, r"indices must be a torch\.Tensor or None, got ndarray \(convert "
         r"it: torch\.as_tensor"),
        (P("w", (2, 3), torch.float32, torch.ones(2, 3)),
         PatchValueError, r"values must be 1-D, got shape \(2, 3\): a dense patch's values "
         r"are the whole tensor flattened row-major \(t\.flatten\(\)\)"),
        (P("w", (2, 3), torch.float32, torch.ones(2), torch.tensor([[0, 1], [1, 2]])),
         PatchValueError, r"indices must be 1-D, got shape \(2, 2\): they are flat "
         r"positions into the whole tensor, row-major \(element \[r, c\] of a 2-D weight "
         r"is r \* shape\[1\] \+ c\)"),
        (P("w", (2, 3), "bfloat16", torch.ones(6)),
         PatchTypeError, r"got 'bfloat16' \(str\); pass torch\.bfloat16$"),
        (P("w", (2, 3), "torch.float16", torch.ones(6)),
         PatchTypeError, r"got 'torch\.float16' \(str\); pass torch\.float16$"),
    ]
    for patch, error, message in cases:
        with pytest.raises(error, match=r"^patch 0 \('w'\): .*" + message) as e:
            load_checkpoint_weight_patches(model, [patch])
        assert e.value.position == 0 and e.value.name == "w"
        assert torch.equal(model.w, torch.ones(2, 3))
    # a type torch.as_tensor does not take, or a str that names no dtype, gets no advice
    with pytest.raises(PatchTypeError, match=r"got str$"):
        load_checkpoint_weight_patches(model, [P("w", (2, 3), torch.float32, "ones")])
    with pytest.raises(PatchTypeError, match=r"got 'bf16' \(str\)$"):
        load_checkpoint_weight_patches(model, [P("w", (2, 3), "bf16", torch.ones(6))])
