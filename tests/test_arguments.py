"""Arguments and values a docstring audit found unchecked or mis-counted: each test here
failed before its fix (a silent wrong result, or a bare error from deep inside)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
from _torch_features import E8M0, NO_E8M0

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import density_map, inspect_load, plan_chunks
from patchkit.build import sparse_patches_from_diff, wire_bytes
from patchkit.errors import PatchError, PatchTypeError, PatchValueError
from patchkit.patch import validate_patches
from patchkit.toymodels import (
    PlainModel,
    TinyLlamaConfig,
    TinyLlamaRuntime,
    tiny_llama_checkpoint,
)
from patchkit.units import format_bytes


def _p(name="a", n=4):
    return CWP(name, (n,), torch.float32, torch.ones(n))


# -- a list of patches, and nothing else -------------------------------------------------


@pytest.mark.parametrize("bad", [None, 5, "a", {"a": torch.ones(4)}])
@pytest.mark.parametrize("call", ["load", "inspect", "plan", "wire", "save"])
def test_something_that_is_not_a_list_of_patches_is_a_type_error(call, bad, tmp_path):
    m = PlainModel({"a": (4,)})
    run = {
        "load": lambda: patchkit.load_checkpoint_weight_patches(m, bad),
        "inspect": lambda: inspect_load(m, bad),
        "plan": lambda: plan_chunks(bad),
        "wire": lambda: wire_bytes(bad),
        "save": lambda: patchkit.save_patches(str(tmp_path / "p.safetensors"), bad),
    }[call]
    with pytest.raises(PatchTypeError) as info:
        run()
    if bad == "a" and call != "wire":
        # a str is no list of patches (wire_bytes takes one patch or a list of them)
        assert "must be a list of patches, got str" in str(info.value)
    if isinstance(bad, dict):
        assert "state dict" in str(info.value)
    assert m.a.tolist() == [0.0] * 4


def test_one_patch_where_a_list_is_expected_says_to_pass_a_list():
    m = PlainModel({"a": (4,)})
    with pytest.raises(PatchTypeError, match=r"got one patch \('a'\): pass \[patch\]"):
        patchkit.load_checkpoint_weight_patches(m, _p())
    assert m.a.tolist() == [0.0] * 4
    assert wire_bytes(_p()) == 16  # wire_bytes takes one patch, as documented
    # one patch whose name is no str is still one patch ("patch 0: expected a
    # CheckpointWeightPatch ..., got int", of its first field), and validate_patches says
    # so too (it said "got str" of a good patch's name)
    with pytest.raises(PatchTypeError, match=r"got one patch \(5\): pass \[patch\]"):
        patchkit.load_checkpoint_weight_patches(m, CWP(5, (4,), torch.float32, torch.ones(4)))
    from patchkit.patch import validate_patches
    with pytest.raises(PatchTypeError, match=r"got one patch \('a'\): pass \[patch\]"):
        validate_patches(_p())
    assert validate_patches(iter([_p()])) == "dense"  # (an iterable of patches is taken)


@pytest.mark.parametrize("kind", [set, frozenset])
@pytest.mark.parametrize(
    "call", ["load", "transactional", "inspect", "plan", "save", "plot_chunks", "chunk_planner"])
def test_a_set_of_patches_that_repeat_a_name_is_refused(call, kind, tmp_path):
    """Two patches of one name in a set: which wins (CONTRACT §2: the later one) depends
    on the set's order, that of the patches' hashes (their tensors' addresses), so the
    model could end with either from run to run; refused before anything is written or
    saved, naming the second of the two in the set's order."""
    m = PlainModel({"a": (4,), "b": (4,)})
    one = CWP("a", (4,), torch.float32, torch.full((4,), 1.0))
    other = ("a", (4,), torch.float32, torch.full((4,), 2.0), None)  # (a plain 5-tuple too)
    patches = kind([one, _p("b"), other])
    path = tmp_path / "p.safetensors"
    run = {
        "load": lambda: patchkit.load_checkpoint_weight_patches(m, patches),
        "transactional": lambda: patchkit.load_checkpoint_weight_patches(
            m, patches, transactional=True),
        "inspect": lambda: inspect_load(m, patches),
        "plan": lambda: plan_chunks(patches),
        "save": lambda: patchkit.save_patches(str(path), patches),
        "plot_chunks": lambda: _plot_chunks()(patches),
        "chunk_planner": lambda: _chunk_planner()(patches),
    }[call]
    what = {"plot_chunks": "plot_chunks's patches",
            "chunk_planner": "chunk_planner's patches"}.get(call, "patches")
    with pytest.raises(PatchValueError) as e:
        run()
    order = [p[0] for p in patches]
    second = max(i for i, n in enumerate(order) if n == "a")
    first = order.index("a")
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        second, "a", "unordered", kind.__name__)
    assert str(e.value) == (
        f"patch {second} ('a'): {what} came as a {kind.__name__}, which has no order, and "
        f"patch {first} has the same name; which of them a load applies last, and so which "
        "wins where both write, depends on that order, which can change from run to run: "
        "pass a list, in the order to apply them")
    assert m.a.tolist() == m.b.tolist() == [0.0] * 4
    assert not path.exists()


def _plot_chunks():
    pytest.importorskip("matplotlib")
    from patchkit.plot import plot_chunks
    return plot_chunks


def _chunk_planner():
    pytest.importorskip("ipywidgets")
    from patchkit.widgets import chunk_planner
    return chunk_planner


def test_a_set_of_distinct_names_loads_and_order_free_helpers_take_any_set():
    """A set whose names are distinct loads as its list would (no element is written
    twice, so the order changes nothing but the chunks); wire_bytes and patch_summary,
    whose results do not depend on the order, take a set that repeats a name too."""
    m = PlainModel({"a": (4,), "b": (4,)})
    assert patchkit.load_checkpoint_weight_patches(m, {_p("a"), _p("b")}) == {"a", "b"}
    assert m.a.tolist() == m.b.tolist() == [1.0] * 4
    twice = {_p("a"), _p("a"), _p("b")}  # (three patches: a NamedTuple of tensors hashes
    assert len(twice) == 3               # by the tensors' identity)
    assert wire_bytes(twice) == 48
    assert sorted(patchkit.patch_summary(twice)["name"]) == ["a", "a", "b"]


_NOT_FIVE = {
    "four": (("b", (4,), torch.float32, torch.ones(4)),
             "got a tuple of 4 items; a plain tuple needs all five (indices None for a dense "
             "patch): pass CheckpointWeightPatch(*item)"),
    "pair": (("b", torch.ones(4)),
             "got a (name, tensor) pair, what load_weights takes; "
             "patchkit.dense_patches(dict(pairs)) makes dense patches of such pairs"),
}


@pytest.mark.parametrize("kind", list(_NOT_FIVE))
@pytest.mark.parametrize("call", ["load", "inspect", "plan", "wire", "save"])
def test_a_tuple_of_the_wrong_length_is_named_and_counted(call, kind, tmp_path):
    # A plain tuple is a patch only with all five fields: a dense one written without its
    # indices (the NamedTuple's default), or the (name, tensor) pairs load_weights takes,
    # said only "expected a CheckpointWeightPatch (...), got tuple" (a tuple is what it
    # takes), with no name and no count.
    m = PlainModel({"a": (4,), "b": (4,)})
    bad, says = _NOT_FIVE[kind]
    run = {
        "load": lambda: patchkit.load_checkpoint_weight_patches(m, [_p(), bad]),
        "inspect": lambda: inspect_load(m, [_p(), bad]),
        "plan": lambda: plan_chunks([_p(), bad]),
        "wire": lambda: wire_bytes([_p(), bad]),
        "save": lambda: patchkit.save_patches(str(tmp_path / "p.safetensors"), [_p(), bad]),
    }[call]
    with pytest.raises(PatchTypeError) as info:
        run()
    e = info.value
    assert "patch 1 ('b'): expected a CheckpointWeightPatch (name, shape, dtype, values, " \
           "indices), " + says in str(e)
    assert (e.position, e.name, e.reason, e.value) == (1, "b", "not a patch", len(bad))
    assert not m.a.detach().any()  # (refused before any call)


def test_plan_chunks_names_an_item_that_is_not_a_patch():
    with pytest.raises(PatchTypeError, match=r"patch 1: expected a CheckpointWeightPatch"):
        plan_chunks([_p(), "b"])
    with pytest.raises(PatchTypeError, match=r"patch 7 \('a'\): dtype must be a torch.dtype"):
        plan_chunks([CWP("a", (4,), "float32", torch.ones(4))], positions=[7])


def test_plan_chunks_takes_plain_5_tuples_as_the_loader_does():
    t = ("w", (4,), torch.float32, torch.ones(4), None)
    plan = plan_chunks([t, t], max_chunk_bytes=1024)
    assert [(c.names, c.bytes, c.closed_by) for c in plan] == [
        (("w",), 16, "repeated name"), (("w",), 16, "end")]
    assert plan == plan_chunks([CWP(*t), CWP(*t)], max_chunk_bytes=1024)


@pytest.mark.parametrize("shape", [[4], (np.int64(4),), [np.int32(2), 2]])
def test_plan_chunks_costs_a_shape_given_as_a_list_or_numpy_ints_in_the_patch_dtype(shape):
    # (such a shape takes the planner's full checks, not its one-pass common case: its
    # bytes are still the patch dtype's, 2 per bfloat16 element, not the values' 4)
    p = CWP("w", shape, torch.bfloat16, torch.ones(4), None)
    assert [(c.bytes, c.closed_by) for c in plan_chunks([p, p._replace(name="v")], 16)] == [
        (16, "end")]
    assert [c.bytes for c in plan_chunks([p, p._replace(name="v")], 15)] == [8, 8]


def test_plan_chunks_refuses_an_empty_name_at_its_position():
    with pytest.raises(PatchValueError, match=r"^patch 3 \(''\): name is empty"):
        plan_chunks([CWP("", (4,), torch.float32, torch.ones(4))], positions=[3])
    with pytest.raises(PatchValueError, match=r"^patch 1 \(''\): name is empty"):
        plan_chunks([_p(), ("", (4,), torch.float32, torch.ones(4), None)])


@pytest.mark.parametrize("positions", [[5], [0, 1, 2, 3]])
def test_plan_chunks_wants_one_position_per_patch(positions):
    with pytest.raises(PatchValueError, match=r"positions has \d entries for 3 patches"):
        plan_chunks([_p("a"), _p("b"), _p("c")], positions=positions)


def test_density_map_of_something_that_is_not_a_patch_is_a_type_error():
    with pytest.raises(PatchTypeError, match="density_map: patch must be a CheckpointWeightPatch"):
        density_map("w")
    # something with some of a patch's fields is no patch either: refused by density_map
    # by name, as what has none of them is
    with pytest.raises(PatchTypeError,
                       match=r"^density_map: patch must be a CheckpointWeightPatch, got Simple"):
        density_map(types.SimpleNamespace(name="w", shape=(2, 2), dtype=torch.float32))
    # a plain 5-tuple is a patch, as a load takes it
    t = ("w", (2, 2), torch.float32, torch.ones(1), torch.tensor([3]))
    assert density_map(t, bins=2).tolist() == [[0.0, 0.0], [0.0, 1.0]]


# -- numbers an integer weight cannot hold --------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "values", "bad", "reason"),
    [
        (torch.int32, [1e20, 2.0], 1e20, "out-of-range"),  # was written as -2147483648
        (torch.int32, [2.0, 3e9], 3e9, "out-of-range"),
        (torch.int32, torch.tensor([3_000_000_000, 5]), 3_000_000_000, "out-of-range"),  # wrapped
        (torch.uint8, torch.tensor([7, 300]), 300, "out-of-range"),  # was written as 44
        (torch.uint8, [-1.0], -1.0, "out-of-range"),
        (torch.int64, [2.0**63], 2.0**63, "out-of-range"),
        (torch.int32, [float("inf")], float("inf"), "not finite"),
        (torch.int8, [-129.0], -129.0, "out-of-range"),  # truncates to -129
        (torch.int8, torch.tensor([1.0, -448.0]).to(torch.float8_e4m3fn), -448.0, "out-of-range"),
        (torch.int8, torch.tensor([float("nan")]).to(torch.float8_e4m3fn), math.nan,
         "not finite"),
        # unsigned values and dtypes, which torch compares only in part
        (torch.uint64, torch.tensor([1, -2]), -2, "out-of-range"),
        (torch.uint8, torch.tensor([300], dtype=torch.uint16), 300, "out-of-range"),
        (torch.int8, torch.tensor([5, 200], dtype=torch.uint32), 200, "out-of-range"),
        (torch.int64, torch.tensor([2**63 + 5], dtype=torch.uint64), 2**63 + 5, "out-of-range"),
    ],
)
def test_a_value_outside_an_integer_dtype_is_refused_before_the_first_call(
    dtype, values, bad, reason
):
    values = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    m = PlainModel({"i": (values.numel(),)}, dtype=dtype)
    p = CWP("i", (values.numel(),), dtype, values)
    with pytest.raises(PatchValueError, match=r"patch 0 \('i'\): value ") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (info.value.reason, info.value.value) == (reason, pytest.approx(bad, nan_ok=True))
    assert m.i.tolist() == [0] * values.numel()


@pytest.mark.parametrize(
    ("dtype", "values", "want"),
    [
        (torch.uint8, [0.0, 255.9], [0, 255]),  # truncated toward zero, as a cast does
        (torch.int64, [-(2.0**63), 5.0], [-(2**63), 5]),
        (torch.int8, [True, False], [1, 0]),
        (torch.int64, [2**40], [2**40]),  # int64 values into int64: nothing to check
        (torch.int16, torch.tensor([-5, 7], dtype=torch.int8), [-5, 7]),  # a narrower int
        (torch.uint64, torch.tensor([1, 2**62]), [1, 2**62]),  # uint64's max is no int64
        (torch.uint32, torch.tensor([2**32 - 1]), [2**32 - 1]),
        (torch.uint8, torch.tensor([7], dtype=torch.uint64), [7]),
        (torch.int32, torch.tensor([65535], dtype=torch.uint16), [65535]),
        # truncated toward zero into the range (-128.5 and -0.5 were refused)
        (torch.int8, [-128.5, 127.5], [-128, 127]),
        (torch.uint8, [-0.5, 0.5], [0, 0]),
        # 8-bit float values (were a raw NotImplementedError: no isfinite or >= kernels)
        (torch.int32, torch.tensor([1.0, 2.0, -4.0]).to(torch.float8_e4m3fn), [1, 2, -4]),
        (torch.int32, torch.tensor([1.0, 2.0, -4.0]).to(torch.float8_e5m2fnuz), [1, 2, -4]),
        pytest.param(
            torch.int16, torch.tensor([1.0, 2.0, 4.0]).to(E8M0) if E8M0 else None, [1, 2, 4],
            marks=pytest.mark.skipif(E8M0 is None, reason=NO_E8M0)),
    ],
)
def test_values_an_integer_dtype_holds_load(dtype, values, want):
    values = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    m = PlainModel({"i": (values.numel(),)}, dtype=dtype)
    patchkit.load_checkpoint_weight_patches(m, [CWP("i", (values.numel(),), dtype, values)])
    assert m.i.tolist() == want


# -- what a report counts ------------------------------------------------------------------


def test_summary_counts_the_bytes_the_calls_staged():
    cfg = TinyLlamaConfig(tie_word_embeddings=True)
    e = tiny_llama_checkpoint(cfg)["model.embed_tokens.weight"]
    ps = [CWP(n, tuple(e.shape), e.dtype, e.flatten())
          for n in ("model.embed_tokens.weight", "lm_head.weight")]
    r = inspect_load(TinyLlamaRuntime(cfg), ps)  # lm_head: a tied alias, dropped
    assert r.chunks["note"].iloc[1].startswith("dropped")
    staged = e.numel() * e.element_size()
    assert r.summary()["staged bytes"] == staged == sum(c.bytes for c in r.plan)


def test_a_rejected_load_staged_nothing():
    m = PlainModel({"a": (1024,)})
    bad = [CWP("a", (1024,), torch.float32, torch.ones(1024)),
           CWP("a", (1024,), torch.float32, torch.ones(3))]  # wrong count
    with pytest.raises(PatchValueError) as info:
        inspect_load(m, bad)
    s = info.value.report.summary()
    assert (s["load_weights calls"], s["staged bytes"]) == (0, 0)


def test_a_failed_load_counts_the_calls_that_ran():
    m = PlainModel({"a": (4,), "b": (4,)})
    plain = m.load_weights

    def fails_on_b(weights):
        weights = list(weights)
        if weights[0][0] == "b":
            raise RuntimeError("b")
        return plain(weights)

    m.load_weights = fails_on_b
    with pytest.raises(RuntimeError) as info:
        inspect_load(m, [_p("a"), _p("b"), _p("c")], max_chunk_bytes=16)  # a call each
    r = info.value.report
    assert len(r.calls) == 2 and r.summary()["staged bytes"] == 32  # a and b, not c


def test_density_map_counts_a_repeated_index_once():
    p = CWP("w", (2,), torch.float32, torch.ones(3), torch.tensor([0, 0, 0]))
    assert density_map(p, bins=1).tolist() == [[0.5]]  # was 1.5: above "[0, 1]"
    q = CWP("w", (4, 4), torch.float32, torch.ones(4), torch.tensor([5, 0, 5, 15]))
    assert density_map(q, bins=(2, 2)).tolist() == [[0.5, 0.0], [0.0, 0.25]]
    # unsorted, distinct: the same map as sorted
    r = CWP("w", (4, 4), torch.float32, torch.ones(3), torch.tensor([15, 0, 5]))
    assert density_map(r, bins=(2, 2)).tolist() == density_map(
        r._replace(indices=torch.tensor([0, 5, 15])), bins=(2, 2)).tolist()


# -- flags ---------------------------------------------------------------------------------


NOT_BOOLS = [None, "no", "", 0, 1, np.True_, torch.tensor(True)]


@pytest.mark.parametrize("bad", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("flag", ["transactional", "validate_unique_indices"])
@pytest.mark.parametrize("call", ["load", "inspect", "inspect with loader"])
def test_a_flag_that_is_not_a_bool_is_refused_before_anything_is_done(call, flag, bad):
    m = PlainModel({"a": (4,)})
    read = []

    def patches():  # an iterable read once
        read.append(True)
        yield CWP("a", (4,), torch.float32, torch.ones(2), torch.tensor([0, 1]))

    ran = []

    def loader(*args, **kw):
        ran.append(kw)
        return patchkit.load_checkpoint_weight_patches(*args, **kw)

    run = {
        "load": patchkit.load_checkpoint_weight_patches,
        "inspect": inspect_load,
        "inspect with loader": lambda m, ps, **kw: inspect_load(m, ps, loader=loader, **kw),
    }[call]
    with pytest.raises(PatchTypeError, match=f"{flag} must be True or False, got ") as info:
        run(m, patches(), **{flag: bad})
    assert info.value.reason == f"{flag} type" and info.value.value is bad
    # (the loader reads patches first, as CONTRACT.md says; inspect_load checks its
    # arguments before it reads them)
    assert read == ([True] if call == "load" else []) and ran == []
    assert m.a.tolist() == [0.0] * 4
    run(m, patches(), **{flag: True})  # a bool is taken
    assert m.a.tolist() == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("flag", ["transactional", "validate_unique_indices"])
def test_a_flag_that_is_not_a_bool_is_refused_before_a_bad_patch_is_named(flag):
    # (the docstring: refused once ``patches`` is read, before any patch is checked)
    bad_patch = CWP("a", (4,), torch.float32, torch.ones(3))  # 3 values for 4 elements
    with pytest.raises(PatchTypeError, match=f"^{flag} must be True or False, got str"):
        patchkit.load_checkpoint_weight_patches(PlainModel({"a": (4,)}), [bad_patch],
                                                **{flag: "no"})


def test_validate_patches_and_dense_patches_take_bools_only():
    with pytest.raises(PatchTypeError, match="validate_unique_indices must be True or False"):
        validate_patches([_p()], validate_unique_indices="no")
    with pytest.raises(PatchTypeError, match=r"clone must be True or False, got int: 1"):
        patchkit.dense_patches({"a": torch.ones(2)}, clone=1)
    t = torch.ones(2)
    assert patchkit.dense_patches({"a": t}, clone=True)[0].values.data_ptr() != t.data_ptr()


# -- comparisons ---------------------------------------------------------------------------


def test_same_bits_and_same_state_name_what_is_not_a_tensor_or_a_state():
    t = torch.ones(2)
    for a, b, match in ((np.ones(2), np.ones(2), "same_bits: a must be a torch.Tensor, got "
                                                 "ndarray"),
                        (t, [1.0, 1.0], "same_bits: b must be a torch.Tensor, got list")):
        with pytest.raises(TypeError, match=match):
            patchkit.same_bits(a, b)
    for a, b, match in (({"w": t}, None, "same_state: b must be a mapping .* got NoneType"),
                        ([t], {"w": t}, "same_state: a must be a mapping .* got list"),
                        ({"w": t}, {"w": np.ones(2)},
                         r"same_state: b\['w'\] must be a torch.Tensor, got ndarray")):
        with pytest.raises(TypeError, match=match):
            patchkit.same_state(a, b)
    assert patchkit.same_bits(t, torch.ones(2)) and not patchkit.same_bits(t, -t)
    assert not patchkit.same_state({"w": t}, {"v": np.ones(2)})  # other names: not equal
    assert patchkit.same_state({"w": t}, {"w": t.clone()})


# -- builders ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "error", "match"),
    [
        ({1: torch.zeros(1)}, {1: torch.ones(1)}, PatchTypeError, "a key of before must be a str"),
        ([1], {"x": torch.ones(1)}, PatchTypeError, "before must be a mapping"),
        ({"x": torch.zeros(1)}, ["x"], PatchTypeError, "after must be a mapping"),
        ({"x": torch.zeros(1)}, {"x": [1.0]}, PatchTypeError, r"after\['x'\] must be a torch"),
        ({"": torch.zeros(1)}, {"": torch.ones(1)}, PatchValueError, "empty"),
    ],
)
def test_diff_checks_both_mappings_first(before, after, error, match):
    with pytest.raises(error, match=match):
        sparse_patches_from_diff(before, after)


# -- figures -------------------------------------------------------------------------------


def test_placement_checks_max_targets_and_targets():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from patchkit.plot import plot_placement

    r = inspect_load(PlainModel({"a": (4,), "b": (3,)}),
                     patchkit.dense_patches({"a": torch.ones(4), "b": torch.ones(3)}))
    for kw, error, match in (
        ({"max_targets": 0}, ValueError, r"max_targets must be from 1 to 32 .*, got 0"),
        ({"max_targets": -1}, ValueError, "from 1 to 32"),
        ({"max_targets": "2"}, TypeError, "max_targets must be an int"),
        ({"max_targets": True}, TypeError, "max_targets must be an int"),
        ({"targets": []}, ValueError, "targets is empty"),
        ({"targets": [3]}, TypeError, "targets must be names"),
    ):
        with pytest.raises(error, match=match):
            plot_placement(r, **kw)
    fig = plot_placement(r, max_targets=np.int64(1))
    assert "showing 1 of 2 runtime tensors" in fig._suptitle.get_text()


# -- the inspect command -------------------------------------------------------------------


def _command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "patchkit", *args], capture_output=True,
                          text=True, timeout=120)


def test_inspect_refuses_a_header_shape_no_tensor_can_hold(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    from patchkit.io import FORMAT_KEY, read_patch_index

    header = {"format": "patchkit.patches", "version": 1, "patches": [
        {"name": "a", "shape": [2**40, 2**40], "dtype": "float32", "kind": "sparse", "nnz": 1,
         "values_dtype": "float32", "indices_dtype": "int64"}]}
    path = str(tmp_path / "huge.safetensors")
    safetensors.save_file({"000000.values": torch.ones(1),
                           "000000.indices": torch.zeros(1, dtype=torch.int64)},
                          path, metadata={FORMAT_KEY: json.dumps(header)})
    with pytest.raises(PatchValueError, match="more than a tensor can"):
        read_patch_index(path)
    done = _command("inspect", path)
    assert done.returncode == 2 and "more than a tensor can" in done.stderr
    assert "PiB" not in done.stdout


def test_inspect_refuses_a_bad_budget_for_a_file_of_no_patches(tmp_path):
    pytest.importorskip("safetensors")
    path = str(tmp_path / "empty.safetensors")
    patchkit.save_patches(path, [])
    done = _command("inspect", path, "--max-chunk-bytes", "0")
    assert done.returncode == 2 and "--max-chunk-bytes must be a positive" in done.stderr


# -- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [(1023, "1023 B"), (1024, "1 KiB"), (1048575, "1 MiB"), (1024**2, "1 MiB"),
     (1023 * 1024, "1023 KiB"), (2**30 - 1, "1 GiB"), (1000 * 1024, "1000 KiB"),
     (int(1.18 * 2**30), "1.18 GiB"), (1024**5 * 3000, "2.93 EiB"), (-1048575, "-1 MiB")],
)
def test_a_size_never_reads_1024_of_a_unit(n, text):
    assert format_bytes(n) == text


SIZES = [(2**63 - 1, "8 EiB"), (1024**7 * 5, "5 ZiB"), (1024**8 * 1023, "1023 YiB"),
         (10**30, "8.27e5 YiB"), (1024**9 - 1, "1.02e3 YiB"), (-(10**30), "-8.27e5 YiB"),
         (10**400, "8.27e375 YiB"), (1024**8 * 999_900, "1e6 YiB"),  # 9.999e5: not 10e5
         (np.int64(5000), "4.88 KiB"),
         (np.int64(9 * 2**57 + 1), "1.13 EiB"),  # (a numpy int divided exactly, as an int)
         # one decimal from 10 to 100 of a unit, none from 100 on (10.449 and 100.4 KiB)
         (10700, "10.4 KiB"), (102810, "100 KiB"),
         (1.5, "1.5 B"), (204.8, "205 B"), (512.0, "512 B"), (2.5 * 2**20, "2.5 MiB")]


@pytest.mark.parametrize(("n", "text"), SIZES, ids=[text for _, text in SIZES])
def test_a_size_has_three_significant_digits_in_any_unit_or_beyond_the_last(n, text):
    # 10**30 read '888178419700125 PiB'
    assert format_bytes(n) == text
    if "e" in text:
        mantissa = text.split("e")[0].lstrip("-")
        assert len(mantissa.replace(".", "")) <= 3


@pytest.mark.parametrize(
    ("n", "text"),
    [(9 * 2**57, "1.12 EiB"), (9 * 2**57 + 1, "1.13 EiB"),  # 1.125 EiB, and one byte more
     (1025 * 10**7 * 1024**8, "1.02e10 YiB"), (1025 * 10**7 * 1024**8 + 1, "1.03e10 YiB"),
     (-(9 * 2**57 + 1), "-1.13 EiB")],
)
def test_an_int_just_above_a_tie_rounds_up_exactly(n, text):
    # a float holds 9 * 2**57 + 1 as 9 * 2**57 (past 2**53), and 28 digits of Decimal the
    # quotient past the last unit as its tie: both read as ties and rounded to even
    assert format_bytes(n) == text


@pytest.mark.parametrize(("n", "error"), [(True, TypeError), (np.bool_(False), TypeError),
                                          ("1", TypeError), (None, TypeError),
                                          (torch.tensor(3), TypeError),
                                          (float("nan"), ValueError), (-math.inf, ValueError)],
                         ids=repr)
def test_a_size_that_is_not_a_finite_number_is_refused(n, error):
    # True read 'True B'
    with pytest.raises(error, match="format_bytes: n must be a"):
        format_bytes(n)


def test_every_error_here_is_a_patch_error():
    # the README: every error about patches or a load's arguments is a PatchError
    for f in (lambda: plan_chunks(["a"]), lambda: density_map("w"),
              lambda: wire_bytes(5), lambda: patchkit.inspect_load(PlainModel({}), None)):
        with pytest.raises(PatchError):
            f()


def test_an_infinite_budget_says_how_to_ask_for_no_limit():
    m = PlainModel({"a": (4,)})
    with pytest.raises(PatchValueError, match=r"for no limit, pass an int") as info:
        patchkit.load_checkpoint_weight_patches(m, [_p()], max_chunk_bytes=float("inf"))
    assert info.value.reason == "max_chunk_bytes"
    with pytest.raises(PatchValueError) as info:
        patchkit.load_checkpoint_weight_patches(m, [_p()], max_chunk_bytes=1.5)
    assert "no limit" not in str(info.value)
    assert patchkit.load_checkpoint_weight_patches(m, [_p()], max_chunk_bytes=1 << 62) == {"a"}


# -- shapes ------------------------------------------------------------------------------


def test_a_shape_given_as_an_iterator_is_refused_not_used_up():
    p = CWP("w", (d for d in (2, 3)), torch.float32, torch.ones(6))
    with pytest.raises(PatchTypeError, match=r"patch 0 \('w'\): shape .* generator") as e:
        validate_patches([p])
    assert e.value.reason == "shape type"


@pytest.mark.parametrize(("dims", "shown"), [
    ((10,) * 4400, "..., 10; 4400 dims)"), ((3,) * 100_000, "..., 3; 100000 dims)"),
    ((10**5000,), "(<a 16610-bit int>,)")])
def test_a_shape_of_very_many_dims_is_refused_with_a_short_message(dims, shown):
    # the product, or a dim, has thousands of digits (more than Python prints), or its
    # product would be slow to take
    p = CWP("w", dims, torch.float32, torch.ones(4))
    with pytest.raises(PatchValueError, match="more than a tensor can hold") as e:
        validate_patches([p])
    assert e.value.reason == "shape too large"
    assert shown in str(e.value) and len(str(e.value)) < 300


# A shape of very many dims whose product is small (ones, or a 0) passes the size check,
# so the errors after it must shorten it too: the README promises that a list of a
# million numbers passed as a shape makes no megabyte message.
_MANY = (1,) * 1_000_000


@pytest.mark.parametrize(("make", "check", "reason"), [
    (lambda: CWP("w", [*range(10**6)], torch.float32, torch.ones(4)),
     lambda p: validate_patches([p]), "dense count"),
    (lambda: CWP("w", _MANY, torch.float32, torch.ones(4)),
     lambda p: validate_patches([p]), "dense count"),
    (lambda: CWP("w", _MANY, torch.float32, torch.ones(1), torch.tensor([5])),
     lambda p: validate_patches([p]), "out-of-range"),
    (lambda: CWP("w", _MANY, torch.float32, torch.ones(1), torch.tensor([5])),
     lambda p: density_map(p), "out-of-range"),
])
def test_a_long_shape_of_few_elements_gets_a_short_message(make, check, reason):
    with pytest.raises(PatchValueError) as e:
        check(make())
    assert e.value.reason == reason
    assert "dims)" in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize(("dtype", "shape"), [
    (torch.float32, (2**61,)), (torch.bfloat16, (2**31, 2**31)),
    (torch.float8_e4m3fn, (2**62, 2))])
def test_a_shape_of_exactly_2_63_bytes_is_refused_and_one_element_less_is_taken(dtype, shape):
    # torch counts a tensor's bytes in an int64: 2**63 bytes is one byte too many, the
    # boundary of "its bytes must stay below 2**63" (nothing here allocates)
    at = CWP("w", shape, dtype, torch.zeros(1), torch.tensor([0]))
    with pytest.raises(PatchValueError, match=r"its bytes must stay below 2\*\*63") as e:
        validate_patches([at])
    assert e.value.reason == "shape too large"
    with pytest.raises(PatchValueError, match=r"below 2\*\*63"):
        plan_chunks([at])
    size = dtype.itemsize
    below = at._replace(shape=(2**63 // size - 1,))
    assert validate_patches([below]) == "sparse"
    assert plan_chunks([below])[0].bytes == 2**63 - size


def test_a_torch_size_shape_too_large_is_refused_with_its_dims_as_a_tuple():
    # a torch.Size (as ``t.shape`` gives) is read dim by dim as any other shape: the
    # error's value is the dims as a plain tuple, as for a tuple shape
    p = CWP("w", torch.Size([2**40, 2**40]), torch.float32, torch.zeros(0), None)
    for check in (validate_patches, plan_chunks):
        with pytest.raises(PatchValueError, match="more than a tensor can hold") as e:
            check([p])
        assert e.value.reason == "shape too large"
        assert type(e.value.value) is tuple and e.value.value == (2**40, 2**40)


def test_a_zero_dim_makes_any_shape_empty():
    p = CWP("w", (0,) + (10,) * 30, torch.float32, torch.ones(0))
    validate_patches([p])


def test_patches_on_the_meta_device_pass_the_checks_of_their_numbers():
    # a dry run (a model on meta, to plan chunks, say) has no numbers to check
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime

    meta = torch.device("meta")
    sparse = CWP("w", (4,), torch.float32, torch.ones(2, device=meta),
                 torch.tensor([0, 0], device=meta))  # (a duplicate nobody can see)
    assert validate_patches([sparse]) == "sparse"
    assert validate_patches([CWP("i", (4,), torch.int8, torch.ones(4, device=meta))]) == "dense"
    cfg = TinyLlamaConfig()
    m = TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2, dtype=torch.bfloat16, device=meta)
    p = CWP("model.norm.weight", (cfg.hidden_size,), torch.bfloat16,
            torch.ones(3, device=meta, dtype=torch.bfloat16), torch.tensor([0, 1, 2], device=meta))
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"model.norm.weight"}
    # on a real device the same duplicate is found
    with pytest.raises(PatchValueError, match="duplicate index 0"):
        validate_patches([CWP("w", (4,), torch.float32, torch.ones(2), torch.tensor([0, 0]))])


@pytest.mark.parametrize("kind", ["sparse", "dense int", "dense float"])
def test_a_meta_patch_for_a_real_model_is_refused_before_the_first_call(kind):
    meta = torch.device("meta")
    m = PlainModel({"a": (4,), "b": (4,)}, fill=1.0)
    if kind == "sparse":
        ps = [CWP("a", (4,), torch.float32, torch.full((2,), 5.0), torch.tensor([0, 1])),
              CWP("b", (4,), torch.float32, torch.ones(2, device=meta),
                  torch.tensor([0, 1], device=meta))]
    else:
        dtype = torch.int8 if kind == "dense int" else torch.float32
        m.b.data = torch.ones(4, dtype=dtype)
        ps = [CWP("a", (4,), torch.float32, torch.full((4,), 5.0)),
              CWP("b", (4,), dtype, torch.ones(4, device=meta, dtype=dtype))]
    for run in (patchkit.load_checkpoint_weight_patches, inspect_load):
        with pytest.raises(PatchValueError, match=r"patch 1 \('b'\): values are on the meta") as e:
            run(m, ps, max_chunk_bytes=16)
        assert (e.value.reason, str(e.value.value)) == ("meta device", "cpu")
        assert m.get_parameter("a").tolist() == [1.0] * 4  # untouched


@pytest.mark.parametrize("dims", [(2**32, 2**32), (3,) * 100_000])
def test_plan_chunks_refuses_a_shape_no_tensor_holds(dims):
    p = CWP("w", dims, torch.float32, torch.ones(4))
    with pytest.raises(PatchValueError, match=r"patch 0 \('w'\): shape .* more than a tensor"):
        plan_chunks([p])
    with pytest.raises(PatchValueError, match="more than a tensor can hold"):
        inspect_load(PlainModel({"w": (4,)}), [p])


def test_a_dry_run_on_a_meta_model_with_real_buffers_loads_meta_patches():
    # accelerate's init_empty_weights() leaves buffers (rotary inv_freq) on the CPU
    meta = torch.device("meta")
    m = PlainModel({"w": (4,)}, device="meta")
    m.register_buffer("inv_freq", torch.ones(2), persistent=False)
    assert patchkit.load_checkpoint_weight_patches(
        m, [CWP("w", (4,), torch.float32, torch.ones(4, device=meta))]) == {"w"}


# -- found by the sixth hunt (every public callable's arguments) --------------------------


def _neg(values):
    """``values`` negated lazily: torch's negative bit, as ``complex.conj().imag`` sets it."""
    return torch._neg_view(values)


@pytest.mark.parametrize("how", ["plain", "transactional", "inspect", "sparse", "sparse-inspect"])
@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_values_with_the_negative_bit_load_negated_on_every_path(how, fill):
    # the compiled copy read their memory as it is (5, 6 written for -5, -6) under
    # transactional=True and inspect_load; a sparse load raised a bare RuntimeError
    # after its first chunk had been written
    sparse = how.startswith("sparse")
    m = PlainModel({"a": (4,), "b": (4,)}, fill=fill)
    vals = _neg(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert vals.is_neg()
    if sparse:
        idx = torch.tensor([0, 2])
        ps = [CWP("a", (4,), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([0, 1])),
              CWP("b", (4,), torch.float32, vals[:2], idx)]
        want = [-5.0, fill, -6.0, fill]
    else:
        ps = [_p("a"), CWP("b", (4,), torch.float32, vals)]
        want = [-5.0, -6.0, -7.0, -8.0]
    kw = {"max_chunk_bytes": 16}  # a call per patch
    if how == "transactional":
        kw["transactional"] = True
    if how.endswith("inspect"):
        r = inspect_load(m, ps, **kw)
        assert r.after("b").tolist() == want
    else:
        patchkit.load_checkpoint_weight_patches(m, ps, **kw)
    assert m.b.tolist() == want
    # (the caller's tensor is left as it was: still a lazily negated view)
    assert vals.is_neg() and vals.tolist() == [-5.0, -6.0, -7.0, -8.0]


def test_stage_of_values_with_the_negative_bit_stages_them_negated():
    p = CWP("b", (4,), torch.float32, _neg(torch.tensor([5.0, 6.0])), torch.tensor([1, 3]))
    staged = patchkit.stage(p)
    assert staged[1::2].tolist() == [-5.0, -6.0] and staged[::2].isnan().all()


def test_a_shape_with_a_zero_and_a_dimension_beyond_int64_is_refused_before_any_call():
    # 0 in the dims made every check pass: the first chunk was written, then torch's own
    # TypeError ('Overflow when unpacking long long') came from staging, naming nothing
    huge = CWP("a", (2**70, 0), torch.float32, torch.ones(0))
    m = PlainModel({"a": (4,)})
    with pytest.raises(PatchValueError, match=r"patch 1 \(.a.\): shape .* \(each dimension "
                                              r"must stay below 2\*\*63") as e:
        patchkit.load_checkpoint_weight_patches(m, [_p("a"), huge])
    assert e.value.position == 1 and e.value.reason == "shape too large"
    assert m.a.tolist() == [0.0] * 4
    with pytest.raises(PatchValueError, match="below 2\\*\\*63"):
        plan_chunks([huge])
    assert plan_chunks([CWP("a", (2**62, 0), torch.float32, torch.ones(0))])[0].bytes == 0


def test_split_patch_splits_a_dense_patch_on_the_meta_device():
    p = CWP("w", (4,), torch.float32, torch.empty(4, device="meta"))
    parts = patchkit.split_patch(p, 2)
    assert [tuple(q.indices.shape) for q in parts] == [(2,), (2,)]
    assert all(q.values.is_meta and q.indices.is_meta for q in parts)


@pytest.mark.parametrize("layout", ["sparse_coo", "nested"])
def test_dense_patches_and_the_trainer_refuse_a_tensor_that_is_not_plain(layout):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch calls nested tensors a prototype)
        t = (torch.ones(3).to_sparse() if layout == "sparse_coo"
             else torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    sd = {"ok": torch.ones(2), "w": t}
    with pytest.raises(PatchTypeError, match=r"weight 'w': state_dict\['w'\] is ") as e:
        patchkit.dense_patches(sd)
    assert (e.value.name, e.value.reason) == ("w", "layout")
    with pytest.raises(PatchTypeError, match=r"weight 'w'"):
        patchkit.AdamLikeTrainer(sd)


@pytest.mark.parametrize("shape", [{3, 2}, frozenset({4}), {2: 3}, b"\x02\x03", "23",
                                   bytearray(b"\x04")])
def test_a_shape_with_no_order_or_made_of_text_is_refused(shape):
    # a set validated (in its own order: {3, 2} loaded as (2, 3)); bytes and str read
    # their bytes and characters as dims
    with pytest.raises(PatchTypeError, match="shape must be a tuple of ints"):
        validate_patches([CWP("w", shape, torch.float32, torch.ones(6))])
    with pytest.raises(PatchTypeError, match="shape must be a tuple of ints"):
        patchkit.random_sparse_patch("w", shape, torch.float32, 0.5)
    with pytest.raises(TypeError, match="must be a sequence of ints"):
        PlainModel({"w": shape})


def test_plain_model_takes_shapes_as_tuples_lists_sizes_and_numpy_ints_not_bools():
    m = PlainModel({"a": [2, 3], "b": torch.Size([4]), "c": (np.int64(2),)})
    assert [tuple(p.shape) for p in m.parameters()] == [(2, 3), (4,), (2,)]
    for bad in [(True,), (2.5,)]:
        with pytest.raises(TypeError, match="must be a sequence of ints"):
            PlainModel({"a": bad})


def test_stage_checks_the_patch_as_a_load_does():
    # stage() took anything: an index out of range was a bare IndexError, and duplicate
    # indices, NaN values and 2-D values were staged silently
    cases = [
        (CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([9])), "out-of-range index"),
        (CWP("w", (4,), torch.float32, torch.ones(2), torch.tensor([0, 0])), "duplicate index"),
        (CWP("w", (4,), torch.float32, torch.tensor([math.nan]), torch.tensor([1])), "NaN value"),
        (CWP("w", (4,), torch.float32, torch.ones(2, 2)), "must be 1-D"),
    ]
    for p, match in cases:
        with pytest.raises(PatchError, match=match):
            patchkit.stage(p)


@pytest.mark.parametrize("positions, error, match", [
    ("ab", PatchTypeError, "must be a list of ints"),
    (b"ab", PatchTypeError, "must be a list of ints"),
    ((i for i in range(2)), PatchTypeError, "must be a list of ints"),
    ([1.5, 2], PatchTypeError, r"positions\[0\] must be an int"),
    ([True, 2], PatchTypeError, r"positions\[0\] must be an int"),
    ([None, 2], PatchTypeError, r"positions\[0\] must be an int"),
    ([0, -1], PatchValueError, r"positions\[1\] is negative"),
    ([0], PatchValueError, "1 entries for 2 patches"),
])
def test_plan_chunks_checks_its_positions(positions, error, match):
    with pytest.raises(error, match=match):
        plan_chunks([_p("a"), _p("b")], positions=positions)


def test_plan_chunks_takes_positions_as_ints_of_any_kind():
    for positions in [(np.int64(5), 7), np.array([5, 7]), torch.tensor([5, 7]), [5, 7]]:
        plan = plan_chunks([_p("a"), _p("b")], 16, positions=positions)
        assert [c.positions for c in plan] == [(5,), (7,)]
        assert all(type(i) is int for c in plan for i in c.positions)
    # (a position may repeat: an observed loader that sent a patch twice re-plans so)
    assert [c.positions for c in plan_chunks([_p("a"), _p("a")], 64, positions=[0, 0])] == [
        (0,), (0,)]


def test_a_negative_position_of_numpy_is_shown_as_a_number():
    # (shown by its repr, a numpy int read 'positions[1] is negative: np.int64(-1)')
    for positions in (np.array([0, -1]), [0, np.int32(-1)]):
        with pytest.raises(PatchValueError, match=r"^positions\[1\] is negative: -1$"):
            plan_chunks([_p("a"), _p("b")], 16, positions=positions)


def test_stage_takes_a_plain_5_tuple_as_a_load_does():
    staged = patchkit.stage(("w", (2, 2), torch.float32, torch.arange(4.0), None))
    assert staged.tolist() == [[0.0, 1.0], [2.0, 3.0]]


def test_a_report_of_a_loader_that_sent_a_patch_twice_replans_and_draws():
    # the positions check refused the plan's repeated position: plot_chunks(report,
    # max_chunk_bytes=16) raised, and chunk_planner(report) showed an error
    from patchkit.plot import plot_chunks

    def twice(model, patches, max_chunk_bytes=None, validate_unique_indices=True):
        staged = [(p.name, p.values.view(p.shape)) for p in patches]
        model.load_weights(staged)
        model.load_weights(staged[:1])

    r = inspect_load(PlainModel({"a": (4,), "b": (4,)}), [_p("a"), _p("b")], loader=twice)
    assert [c.positions for c in r.plan] == [(0, 1), (0,)]
    fig = plot_chunks(r, max_chunk_bytes=16)
    assert len(fig.axes[0].patches) >= 2


def test_a_load_weights_that_calls_itself_under_an_observed_loader_is_watched_throughout():
    # (a fix of this stop ended the outer call's interception when the inner one began:
    # writes after the nested call went unwatched, and a device context was popped)
    class Delegates(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.b = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            out = set()
            for n, w in weights:
                if n.startswith("old."):
                    out |= self.load_weights([(n[4:], w)])
                    continue
                getattr(self, n).data.copy_(w)
                out.add(n)
            return out

    def loader(model, patches, max_chunk_bytes=None, validate_unique_indices=True):
        return model.load_weights([(p.name, p.values.view(p.shape)) for p in patches])

    ps = [CWP("old.a", (4,), torch.float32, torch.ones(4)),
          CWP("b", (4,), torch.float32, torch.full((4,), 2.0))]
    with torch.device("cpu"):  # (a function mode of the user's, under the load's)
        r = inspect_load(Delegates(), ps, loader=loader)
    assert set(r.writes["target"]) == {"a", "b"}
    assert r.writes["target"].tolist()[-1] == "b"  # (the write after the nested call)
    assert r.written("b").all() and r.written("a").all()
    assert torch._C._len_torch_function_stack() == 0


def test_public_helpers_refuse_arguments_of_the_wrong_kind_with_type_and_value_errors(tmp_path):
    import io

    from patchkit import plot
    from patchkit.io import print_patch_file_summary, save_patches
    from patchkit.toymodels import tiny_llama_shapes

    path = str(tmp_path / "p.safetensors")
    save_patches(path, [_p("a")])
    report = inspect_load(PlainModel({"a": (4,)}), [_p("a")])
    cases = [
        (lambda: plot.to_png(None), TypeError, "fig must be a matplotlib Figure"),
        (lambda: plot.to_png(plot.plot_chunks(report), dpi=0), ValueError, "dpi"),
        (lambda: plot.written_mask(None, "a"), TypeError, "report must be a LoadReport"),
        (lambda: plot.view_rects(2**70, (2, 2), (4, 1), 4), ValueError, "beyond int64"),
        (lambda: plot.view_rects(0, (2, 2), (4, 1), math.nan), TypeError, "cols must be"),
        (lambda: plot.view_rects(0, (2, 2), (4, 1), 1.5), TypeError, "cols must be an int"),
        (lambda: plot.view_rects(0, (2, 2), (4,), 4), ValueError, "differ in length"),
        (lambda: plot.view_rects(0, "ab", (4, 1), 4), TypeError, "shape must be a sequence"),
        (lambda: print_patch_file_summary(path, file="out.txt"), TypeError, "write method"),
        (lambda: tiny_llama_shapes(None), TypeError, "config must be a TinyLlamaConfig"),
        (lambda: PlainModel([("a", (2,))]), TypeError, "shapes must be a mapping"),
        (lambda: PlainModel({"a": (2,)}, dtype=torch.int8, fill=1000.0), ValueError,
         "fill 1000.0 is not a value of torch.int8"),
        (lambda: PlainModel({"a": (2,)}, fill="1"), TypeError, "fill must be a real number"),
        # (torch itself saturates a one-element fill of inf to 448, and refuses a longer one)
        (lambda: PlainModel({"a": (2,)}, dtype=torch.float8_e4m3fn, fill=math.inf),
         ValueError, "fill inf is not a value of torch.float8_e4m3fn"),
        (lambda: patchkit.same_bits(torch.ones(2).to_sparse(), torch.ones(2)), TypeError,
         "same_bits: a is of layout torch.sparse_coo"),
        (lambda: patchkit.same_bits(torch.ones(2), torch.ones(2, device="meta")), ValueError,
         "same_bits: b is on the meta device"),
        (lambda: patchkit.same_state({"w": torch.ones(2)}, {"w": torch.ones(2).to_sparse()}),
         TypeError, r"same_state: b\['w'\] is of layout"),
    ]
    if importlib.util.find_spec("ipywidgets") is not None:  # (the notebooks extra)
        from patchkit import widgets

        cases += [
            (lambda: widgets.figure_output("x"), TypeError, "fig must be a matplotlib Figure"),
            (lambda: widgets.plan_text("ab", 100), TypeError, "plan must be a list of Chunk"),
            (lambda: widgets.plan_text([1], 100), TypeError, r"plan\[0\] must be a Chunk"),
            (lambda: widgets.plan_text(report.plan, -1), ValueError, "max_chunk_bytes"),
            (lambda: widgets.text_output(5), TypeError, "text must be a str"),
        ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    # what they take still works
    out = io.StringIO()
    assert print_patch_file_summary(path, file=out) == 0 and "a" in out.getvalue()
    assert plot.view_rects(np.int64(0), torch.Size([2, 2]), (4, 1), 4) == (
        [(0, 2, 0, 2)], True)
    assert plot.written_mask(report, "a").tolist() == [True] * 4


@pytest.mark.parametrize("kind", ["dense", "sparse", "transactional"])
def test_a_model_that_is_not_a_module_is_refused_by_type_before_any_call(kind):
    # A duck-typed model with load_weights failed with a bare AttributeError
    # ('named_modules') from deep inside the load
    class Duck:
        calls = 0

        def load_weights(self, weights):
            Duck.calls += 1
            return {n for n, _ in weights}

    if kind == "sparse":
        p = CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([2]))
    else:
        p = CWP("w", (4,), torch.float32, torch.ones(4))
    said = r"Duck is not a torch\.nn\.Module \(it has no named_modules\)"
    with pytest.raises(TypeError, match=said) as info:
        patchkit.load_checkpoint_weight_patches(
            Duck(), [p], transactional=kind == "transactional")
    e = info.value
    assert isinstance(e, patchkit.PatchTypeError)
    assert (e.reason, e.value, Duck.calls) == ("not a module", "Duck", 0)
    with pytest.raises(TypeError, match="no load_weights") as info:
        patchkit.load_checkpoint_weight_patches(torch.nn.Linear(2, 2), [p])
    assert info.value.reason == "no load_weights"


def test_a_model_without_load_weights_is_told_what_load_weights_must_do():
    # A newcomer's first try is a plain module (an nn.Linear, a Hugging Face model): the
    # error says what the missing method takes, does and returns, and where to see one,
    # from the loader and from inspect_load alike.
    p = CWP("weight", (2, 2), torch.float32, torch.ones(4))
    said = (r"give it one that takes a list of \(checkpoint name, tensor\) pairs, writes "
            r"each into the model and returns the names it loaded \(docs/CONTRACT\.md; "
            r"patchkit\.toymodels\.PlainModel is a minimal one\)$")
    for load in (patchkit.load_checkpoint_weight_patches, patchkit.inspect_load):
        model = torch.nn.Linear(2, 2)
        before = model.weight.detach().clone()
        with pytest.raises(patchkit.PatchTypeError, match=said) as info:
            load(model, [p])
        assert (info.value.reason, info.value.value) == ("no load_weights", "Linear")
        assert torch.equal(model.weight, before)


@pytest.mark.parametrize("transactional", [False, True])
def test_an_empty_call_returns_an_empty_set_whatever_the_model(transactional):
    # CONTRACT §1.3: an empty call is neither dense nor sparse and makes no call, so the
    # model is not looked at: no load_weights, not even a module, is needed
    for model in (object(), torch.nn.Linear(2, 2)):
        got = patchkit.load_checkpoint_weight_patches(model, [], transactional=transactional)
        assert got == set()


@pytest.mark.parametrize("helper", ["stage", "split_patch"])
def test_a_lone_patch_helper_names_the_patch_but_no_position(helper):
    # stage(p) and split_patch(p, n) validated [p] and said "patch 0": called on
    # patches[7], that points at the wrong patch. (density_map already said "patch 'w'")
    run = {"stage": patchkit.stage, "split_patch": lambda p: patchkit.split_patch(p, 2)}[helper]
    bad = [
        CWP("w", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([9])),
        CWP("w", (4,), torch.float32, torch.ones(3)),
        CWP("w", (4,), torch.int8, torch.tensor([1.0]), torch.tensor([1])),
    ]
    for p in bad:
        with pytest.raises(PatchError) as info:
            run(p)
        e = info.value
        assert (e.position, e.name) == (None, "w")
        assert str(e).startswith("patch 'w': ")


@pytest.mark.parametrize("helper", ["changed_fraction", "sparse_patches_from_diff"])
def test_weights_named_on_one_side_only_are_listed_in_the_message(helper):
    # changed_fraction said only "before and after name different weights", its names in
    # .value alone; sparse_patches_from_diff listed them all, however many
    from patchkit.build import changed_fraction

    run = {"changed_fraction": changed_fraction,
           "sparse_patches_from_diff": sparse_patches_from_diff}[helper]
    t = torch.zeros(2)
    with pytest.raises(PatchValueError) as info:
        run({"a": t, "c": t}, {"b": t, "c": t})
    e = info.value
    assert "only in before: ['a']; only in after: ['b']" in str(e)
    assert (e.name, e.reason, e.value) == ("a", "names differ", (["a"], ["b"]))
    many = {f"w{i}": t for i in range(8)}
    with pytest.raises(PatchValueError) as info:
        run(many, {})
    assert "only in before: ['w0', 'w1', 'w2', 'w3', 'w4'] and 3 more; only in after: []" in (
        str(info.value))
    assert len(info.value.value[0]) == 8


def test_a_whole_fraction_beyond_floats_range_is_a_budget():
    # float(Fraction(10**400)) raised a bare OverflowError; the docstring takes any whole
    # number, and a fraction of it is still refused as one
    from fractions import Fraction

    from patchkit.patch import check_max_chunk_bytes

    assert check_max_chunk_bytes(Fraction(10**400)) == 10**400
    assert check_max_chunk_bytes(Fraction(8, 2)) == 4
    ps = [_p("a"), _p("b")]
    assert [c.positions for c in plan_chunks(ps, Fraction(10**400))] == [(0, 1)]
    for bad in (Fraction(3, 2), Fraction(2 * 10**400 + 1, 2)):
        with pytest.raises(PatchValueError, match="whole number of bytes"):
            check_max_chunk_bytes(bad)


def test_a_fraction_budget_is_shown_as_a_number_in_its_message():
    # (max_chunk_bytes is shown by its str, as before errors.brief: 3/2, not Fraction(3, 2))
    from fractions import Fraction

    from patchkit.patch import check_max_chunk_bytes

    with pytest.raises(PatchValueError, match=r"whole number of bytes, got 3/2$"):
        check_max_chunk_bytes(Fraction(3, 2))
    with pytest.raises(PatchValueError, match=r"^max_chunk_bytes must be positive, got -1$"):
        check_max_chunk_bytes(Fraction(-1))


def test_brief_cuts_at_its_limit_and_never_raises_for_a_failing_repr():
    from patchkit.errors import brief, where

    assert brief("x" * 98) == repr("x" * 98)  # (100 characters with the quotes: whole)
    assert brief("x" * 99) == repr("x" * 99)[:100] + "..."
    assert brief(list(range(1000)), most=10) == "[0, 1, 2, ..."

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no")

    assert brief(Unprintable()) == "<a Unprintable>"
    assert where(2, Unprintable()) == "patch 2 (<a Unprintable>)"
    assert brief(np.arange(10**6)).startswith("array([") and len(brief(np.arange(10**6))) <= 103


# -- pins found by mutation testing of patch.py, staging.py and errors.py ----------------


def test_one_plain_5_tuple_where_a_list_is_expected_says_to_pass_a_list():
    # a plain tuple is a patch as a load takes it (PatchLike): given alone, it was read
    # as five patches ("patch 0: expected a CheckpointWeightPatch ..., got str") with the
    # check dropped and every test passing
    m = PlainModel({"a": (4,)})
    alone = ("a", (4,), torch.float32, torch.ones(4), None)
    with pytest.raises(PatchTypeError, match=r"got one patch \('a'\): pass \[patch\]"):
        patchkit.load_checkpoint_weight_patches(m, alone)
    with pytest.raises(PatchTypeError, match=r"got one patch \('a'\): pass \[patch\]"):
        validate_patches(alone)
    assert m.a.tolist() == [0.0] * 4
    assert patchkit.load_checkpoint_weight_patches(m, [alone]) == {"a"}


@pytest.mark.parametrize(("patch", "reason", "value"), [
    (CWP("", (4,), torch.float32, torch.ones(4)), "empty name", ""),
    (CWP("w", (3, -2), torch.float32, torch.ones(4)), "negative dimension", -2),
    (CWP("w", (2, 3), torch.float32, torch.ones(5)), "dense count", 5),
    (CWP("w", (8,), torch.float32, torch.ones(2), torch.tensor([0, 1, 2])), "length mismatch", 3),
], ids=["empty name", "negative dimension", "dense count", "length mismatch"])
def test_a_malformed_patchs_error_carries_its_offending_value(patch, reason, value):
    # PatchError.value is "one offending value": the negative dim (not the whole shape),
    # the count of values given (not prod(shape)), the count of indices, the empty name;
    # each could be another value with every test passing
    with pytest.raises(PatchValueError) as e:
        validate_patches([CWP("ok", (1,), torch.float32, torch.ones(1)), patch])
    assert (e.value.position, e.value.reason, e.value.value) == (1, reason, value)
    assert type(e.value.value) is type(value)


@pytest.mark.parametrize(("dims", "shown", "why"), [
    ((2**40,) * 8, "(" + ", ".join(["1099511627776"] * 8) + ")", "its bytes"),
    ((1, 2, 3, 4, 5, 6, 7, 8, 2**62), "(1, 2, 3, 4, 5, 6, 7, ..., 4611686018427387904; 9 dims)",
     "its bytes"),
    ((2**63,), "(9223372036854775808,)", "each dimension"),
    ((2**63, 1), "(9223372036854775808, 1)", "each dimension"),
], ids=["8 dims whole", "9 dims: 7 and the last", "a dim of 2**63", "2**63 beside 1"])
def test_a_shape_too_large_is_shown_as_it_is_up_to_eight_dims(dims, shown, why):
    # up to eight dims are printed whole, dims up to 64 bits in decimal, and a dim of
    # exactly 2**63 is said to be one (not "its bytes"): each of these could change with
    # every test passing
    with pytest.raises(PatchValueError) as e:
        validate_patches([CWP("w", dims, torch.uint8, torch.ones(1))])
    assert str(e.value) == (f"patch 0 ('w'): shape {shown} of torch.uint8 is more than a "
                            f"tensor can hold ({why} must stay below 2**63)")


def test_an_out_of_range_index_is_said_with_the_shape_and_its_element_count():
    p = CWP("w", (2, 3), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([5, 6]))
    with pytest.raises(PatchValueError) as e:
        validate_patches([p])
    assert str(e.value) == "patch 0 ('w'): out-of-range index 6 for shape (2, 3) (6 elements)"


def test_a_nan_budget_is_said_to_be_not_positive():
    # (it went on to "must be a whole number of bytes" with the check as `<= 0`)
    with pytest.raises(PatchValueError, match=r"^max_chunk_bytes must be positive, got nan$"):
        validate_patches([_p()], max_chunk_bytes=float("nan"))


@pytest.mark.parametrize("name", [5, None, b"w"], ids=repr)
def test_a_lone_patch_whose_name_is_no_str_is_named_as_a_name_not_a_position(name):
    # errors.where(None, 5) reads "patch (name 5)": "patch 5" would point at a position
    with pytest.raises(PatchTypeError) as e:
        patchkit.stage(CWP(name, (2,), torch.float32, torch.ones(2)))
    assert str(e.value).startswith(f"patch (name {name!r}): name must be a str")
    assert (e.value.position, e.value.reason) == (None, "name type")


@pytest.mark.parametrize("shape", [np.array([2, 3]), range(2, 4), (np.int64(2), np.int32(3))],
                         ids=["ndarray", "range", "numpy ints"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_stage_and_a_load_take_a_shape_validation_takes(shape, sparse):
    # validation takes any ordered iterable of ints (numpy's too); staging handed it to
    # torch as it was, which takes no ndarray or range: a raw TypeError from
    # reshape()/empty() had the conversion been dropped, with every test passing
    if sparse:
        p = CWP("w", shape, torch.float32, torch.tensor([7.0]), torch.tensor([4]))
        want = [[0.0, 0.0, 0.0], [0.0, 7.0, 0.0]]
    else:
        p = CWP("w", shape, torch.float32, torch.arange(6.0))
        want = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    staged = patchkit.stage(p)
    assert staged.shape == (2, 3)
    assert torch.nan_to_num(staged, nan=0.0).tolist() == want
    m = PlainModel({"w": (2, 3)})
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    assert m.w.tolist() == want


def test_a_nan_value_is_said_with_its_index_and_its_place_in_values():
    # the index and the position in values differ here: both are named
    p = CWP("w", (4,), torch.float32, torch.tensor([1.0, float("nan")]), torch.tensor([3, 0]))
    with pytest.raises(PatchValueError) as e:
        validate_patches([p])
    assert str(e.value).startswith("patch 0 ('w'): NaN value at index 0, values[1] (")
    assert (e.value.reason, e.value.value) == ("NaN", 0)


@pytest.mark.parametrize("indices", [[0, 0], [1, 0], [3, 3, 1]], ids=repr)
def test_a_sparse_patch_of_an_empty_shape_with_several_indices_is_out_of_range(indices):
    # every index of an empty tensor is out of range; with the duplicate check marking
    # a tensor of no elements, torch raised a raw RuntimeError ("setStorage: ... out of
    # bounds") instead, and every test passed
    p = CWP("w", (0, 4), torch.float32, torch.ones(len(indices)), torch.tensor(indices))
    with pytest.raises(PatchValueError) as e:
        validate_patches([p])
    assert (e.value.reason, e.value.value) == ("out-of-range", indices[0])


@pytest.mark.parametrize("kind", ["dense", "sparse", "transactional", "inspect"])
def test_a_model_class_passed_for_a_model_is_refused_naming_the_class(kind):
    # load_checkpoint_weight_patches(MyModel, ...) (the class, not an instance) passed the
    # module check, whose methods a class has too, unbound, and failed with torch's bare
    # "named_parameters() missing 1 required positional argument: 'self'"; inspect_load
    # said "model type is not a torch.nn.Module"
    class MyModel(torch.nn.Module):
        calls = 0

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def load_weights(self, weights):
            MyModel.calls += 1
            return {n for n, _ in weights}

    if kind == "sparse":
        p = CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([2]))
    else:
        p = CWP("w", (4,), torch.float32, torch.ones(4))
    if kind == "inspect":
        pytest.importorskip("pandas")
        run = lambda: patchkit.inspect_load(MyModel, [p])  # noqa: E731
    else:
        run = lambda: patchkit.load_checkpoint_weight_patches(  # noqa: E731
            MyModel, [p], transactional=kind == "transactional")
    with pytest.raises(TypeError, match=r"model MyModel is a class, not a model: pass an "
                                        r"instance of it \(MyModel\(\.\.\.\)\)") as info:
        run()
    e = info.value
    assert isinstance(e, patchkit.PatchTypeError)
    assert (e.reason, e.value, MyModel.calls) == ("model is a class", "MyModel", 0)


def test_a_huge_argument_is_shown_cut_short_in_the_message():
    """An argument given a huge list or string, or an int too long to print, is refused
    with a short message naming the argument (not the value's whole repr, nor Python's
    own ValueError for printing an int of over 4300 digits); ``.value`` keeps it whole."""
    huge = [0.5] * 100_000
    model = PlainModel({"a": (4,)})
    ok = [CWP("a", (4,), torch.float32, torch.ones(4))]
    calls = [
        (lambda: patchkit.load_checkpoint_weight_patches(model, ok, max_chunk_bytes=huge),
         PatchTypeError, "max_chunk_bytes type", r"^max_chunk_bytes must be a positive int, "
         r"got list: \[0\.5, 0\.5"),
        (lambda: patchkit.load_checkpoint_weight_patches(model, ok,
                                                         validate_unique_indices=huge),
         PatchTypeError, "validate_unique_indices type", r"^validate_unique_indices must be"),
        (lambda: patchkit.load_checkpoint_weight_patches(model, ok, transactional=huge),
         PatchTypeError, "transactional type", r"^transactional must be True or False"),
        (lambda: patchkit.load_checkpoint_weight_patches(model, ok[0]._replace(name="x" * 10**5)),
         PatchTypeError, "not a list", r"^patches must be a list of patches, got one patch "
         r"\('xxx"),
        (lambda: plan_chunks(ok, -(10**5000)), PatchValueError, "max_chunk_bytes",
         r"^max_chunk_bytes must be positive, got <a 16610-bit int>$"),
        (lambda: plan_chunks(ok, positions=[huge]), PatchTypeError, "positions",
         r"^positions\[0\] must be an int, got list \[0\.5"),
        (lambda: plan_chunks(ok, positions=[-(10**5000)]), PatchValueError, "positions",
         r"^positions\[0\] is negative: <a 16610-bit int>$"),
        (lambda: patchkit.random_sparse_patch("w", (4,), torch.float32, 0.5, device=huge),
         PatchTypeError, "device type", r"^device must be a str or torch\.device, got list"),
        (lambda: patchkit.random_sparse_patch("w", (4,), torch.float32, 0.5,
                                              device="x" * 10**5),
         PatchValueError, "bad device", r"^device 'xxx.*\.\.\. is not a torch device"),
        (lambda: inspect_load(model, ok, progress=huge), PatchTypeError, "progress type",
         r"^progress must be True"),
        (lambda: inspect_load(model, ok, loader=huge), PatchTypeError, "loader type",
         r"^loader must be a callable"),
    ]
    for call, kind, reason, pattern in calls:
        with pytest.raises(kind) as e:
            call()
        assert re.search(pattern, str(e.value)), str(e.value)[:300]
        assert len(str(e.value)) < 400
        assert e.value.reason == reason
    for bad in (huge, "x" * 10**5):
        with pytest.raises(TypeError, match=r"^format_bytes: n must be a number") as e:
            format_bytes(bad)
        assert len(str(e.value)) < 300
    assert model.a.tolist() == [0.0] * 4
