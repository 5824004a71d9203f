"""CONTRACT §2: which patches share one ``load_weights`` call.

A (4,) float32 tensor costs 16 bytes; the budgets below are chosen around that.
"""

from __future__ import annotations

import pytest
import torch

import patchkit
from patchkit import plan_chunks

from ._models import RecordingModel, SinkModel, reference_chunks

F4 = torch.zeros(4)


def four_weights() -> RecordingModel:
    return RecordingModel({n: torch.zeros(4) for n in "abcd"} | {"big": torch.zeros(16)})


def calls(load, patches, budget, make_model=four_weights):
    m = make_model()
    load(m, patches, max_chunk_bytes=budget)
    return m.names_per_call()


def test_patches_within_budget_share_one_call(load, mk):
    patches = [mk.dense(n, F4) for n in "abc"]
    assert calls(load, patches, 1 << 20) == [["a", "b", "c"]]


def test_budget_flushes_before_a_patch_that_would_exceed_it(load, mk):
    patches = [mk.dense(n, F4) for n in "abcd"]
    assert calls(load, patches, 32) == [["a", "b"], ["c", "d"]]
    assert calls(load, patches, 47) == [["a", "b"], ["c", "d"]]


def test_patch_that_exactly_fills_the_budget_joins_the_chunk(load, mk):
    patches = [mk.dense(n, F4) for n in "abc"]
    assert calls(load, patches, 48) == [["a", "b", "c"]]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_tensor_larger_than_the_budget_travels_alone(load, mk, kind):
    def patch(name, n):
        if kind == "dense":
            return mk.dense(name, torch.ones(n))
        return mk.sparse(name, (n,), [0], [1.0])

    patches = [patch("a", 4), patch("big", 16), patch("b", 4), patch("c", 4)]
    assert calls(load, patches, 32) == [["a"], ["big"], ["b", "c"]]
    assert calls(load, patches[1:], 32) == [["big"], ["b", "c"]]
    assert calls(load, patches[:2], 32) == [["a"], ["big"]]


def test_sparse_patch_costs_its_full_checkpoint_tensor(load, mk):
    # One index each, but each staging tensor is a full (4,) float32: 16 bytes.
    patches = [mk.sparse(n, (4,), [1], [2.0]) for n in "ab"]
    assert calls(load, patches, 31) == [["a"], ["b"]]
    assert calls(load, patches, 32) == [["a", "b"]]


def test_cost_uses_the_patch_dtype_not_the_values_dtype(load, mk):
    # bfloat16 checkpoint tensors of 4 elements cost 8 bytes even with float32 values.
    patches = [mk.dense(n, F4, torch.bfloat16, values_dtype=torch.float32) for n in "abcd"]

    def m():
        return RecordingModel({n: torch.zeros(4, dtype=torch.bfloat16) for n in "abcd"})

    assert calls(load, patches, 32, m) == [["a", "b", "c", "d"]]
    assert calls(load, patches, 31, m) == [["a", "b", "c"], ["d"]]


def test_repeated_name_starts_a_new_loader_call(load, mk):
    patches = [mk.dense("a", F4), mk.dense("b", F4), mk.dense("a", F4 + 1), mk.dense("c", F4)]
    assert calls(load, patches, 1 << 20) == [["a", "b"], ["a", "c"]]


def test_repeated_name_splits_even_when_both_reasons_apply(load, mk):
    patches = [mk.dense("a", F4), mk.dense("a", F4)]
    assert calls(load, patches, 16) == [["a"], ["a"]]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_patches_for_one_weight_apply_in_input_order_and_later_wins(load, mk, kind):
    m = RecordingModel({"w": torch.zeros(5)})
    if kind == "sparse":
        patches = [
            mk.sparse("w", (5,), [0, 1, 2], [1.0, 1.0, 1.0]),
            mk.sparse("w", (5,), [2, 3], [2.0, 2.0]),
            mk.sparse("w", (5,), [3, 4], [3.0, 3.0]),
        ]
        expected = [1.0, 1.0, 2.0, 3.0, 3.0]
    else:
        patches = [mk.dense("w", torch.full((5,), float(k))) for k in (1, 2, 3)]
        expected = [3.0] * 5
    load(m, patches)
    assert m.names_per_call() == [["w"], ["w"], ["w"]]
    assert m.w.detach().tolist() == expected


def test_default_budget_is_512_mib(load, Patch):
    # Meta tensors: shapes and dtypes without memory. 2**27 float32 = exactly 512 MiB.
    def meta(name, n):
        return Patch(name, (n,), torch.float32, torch.empty(n, device="meta"))

    m = SinkModel()
    load(m, [meta("half1", 1 << 26), meta("half2", 1 << 26)])
    assert m.names_per_call() == [["half1", "half2"]]
    m = SinkModel()
    load(m, [meta("full", 1 << 27), meta("one", 1)])
    assert m.names_per_call() == [["full"], ["one"]]


def test_loader_calls_follow_the_contract_walk(load, mk):
    sizes = {"a": 4, "b": 2, "c": 8, "d": 1, "e": 3}
    patches = [mk.dense(n, torch.ones(sizes[n])) for n in "abcadbeec"]
    m = RecordingModel({n: torch.zeros(s) for n, s in sizes.items()})
    load(m, patches, max_chunk_bytes=40)
    expected = [[patches[i].name for i in chunk] for chunk in reference_chunks(patches, 40)]
    assert m.names_per_call() == expected
    assert len(expected) > 3


# -- [patchkit] plan_chunks ---------------------------------------------------------------


@pytest.mark.patchkit_only
def test_plan_chunks_reports_positions_bytes_and_closing_reasons(mk):
    patches = [
        mk.dense("a", F4),  # 0
        mk.dense("b", F4),  # 1
        mk.dense("a", F4),  # 2: repeated name
        mk.dense("big", torch.zeros(16)),  # 3: 64 bytes > 40
        mk.dense("c", F4),  # 4
        mk.dense("d", F4),  # 5
        mk.dense("e", F4),  # 6: budget
    ]
    chunks = plan_chunks(patches, 40)
    got = [(c.index, c.positions, c.names, c.bytes, c.closed_by, c.over_budget) for c in chunks]
    assert got == [
        (0, (0, 1), ("a", "b"), 32, "repeated name", False),
        (1, (2,), ("a",), 16, "budget", False),
        (2, (3,), ("big",), 64, "budget", True),
        (3, (4, 5), ("c", "d"), 32, "budget", False),
        (4, (6,), ("e",), 16, "end", False),
    ]


@pytest.mark.patchkit_only
def test_plan_chunks_reports_repeated_name_when_both_reasons_apply(mk):
    chunks = plan_chunks([mk.dense("a", F4), mk.dense("a", F4)], 16)
    assert [c.closed_by for c in chunks] == ["repeated name", "end"]


@pytest.mark.patchkit_only
def test_plan_chunks_relabels_positions_and_reads_any_iterable(mk):
    patches = [mk.dense(n, F4) for n in "abc"]
    chunks = plan_chunks((p for p in patches), 32, positions=[3, 7, 9])
    assert [c.positions for c in chunks] == [(3, 7), (9,)]


@pytest.mark.patchkit_only
def test_plan_chunks_needs_no_values(Patch):
    patches = [Patch(n, (4,), torch.float32, None) for n in "aab"]
    assert [c.names for c in plan_chunks(patches, 1024)] == [("a",), ("a", "b")]


@pytest.mark.patchkit_only
def test_plan_chunks_of_nothing_is_empty():
    assert plan_chunks([], 16) == []


@pytest.mark.patchkit_only
@pytest.mark.parametrize(("budget", "error"),
                         [(0, ValueError), (-1, ValueError), (2.5, ValueError), ("2", TypeError)])
def test_plan_chunks_rejects_a_bad_budget(mk, budget, error):
    with pytest.raises(error):
        plan_chunks([mk.dense("a", F4)], budget)


@pytest.mark.patchkit_only
def test_default_budget_constant_is_512_mib(Patch):
    assert patchkit.DEFAULT_MAX_CHUNK_BYTES == 512 * 1024 * 1024
    half = Patch("h", (1 << 26,), torch.float32, None)
    assert len(plan_chunks([half, half._replace(name="i")])) == 1


@pytest.mark.patchkit_only
def test_loader_makes_exactly_the_calls_plan_chunks_shows(load, mk):
    sizes = {"a": 4, "b": 2, "c": 8, "d": 1}
    patches = [mk.sparse(n, (sizes[n],), [0], [1.0]) for n in "abcadbcc"]
    m = RecordingModel({n: torch.zeros(s) for n, s in sizes.items()})
    load(m, patches, max_chunk_bytes=24)
    assert m.names_per_call() == [list(c.names) for c in plan_chunks(patches, 24)]
