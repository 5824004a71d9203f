"""inspect_load: the report's tables agree with what the loader really did."""

from __future__ import annotations

import contextlib
import math
import pickle
import re
import typing

import pytest
import torch
from _torch_features import needs_fp4_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, patch_summary, plan_chunks
from patchkit.bitwise import bits
from patchkit.errors import ContractViolation, PatchTypeError, PatchValueError
from patchkit.toymodels import FailingModel, PlainModel


class Packed(torch.nn.Module):
    """q, k, v (4x4 each) packed into one (12, 4) parameter; a norm of 4."""

    SLOT: typing.ClassVar[dict[str, int]] = {"q": 0, "k": 4, "v": 8}

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # On the tests' default device (--device), like the patches the tests build.
        qkv = torch.randn(12, 4, generator=g).to(dtype).to(torch.get_default_device())
        self.qkv = torch.nn.Parameter(qkv, False)
        self.norm = torch.nn.Parameter(torch.ones(4, dtype=dtype), False)
        self.calls: list[list[str]] = []

    def load_weights(self, weights):
        names = []
        for name, t in weights:
            names.append(name)
            if name == "norm":
                self.norm.data.copy_(t)
            else:
                off = self.SLOT[name]
                self.qkv.data.narrow(0, off, 4).copy_(t)
        self.calls.append(names)
        return set(names)


def dense(name, t):
    return CheckpointWeightPatch(name, tuple(t.shape), t.dtype, t.reshape(-1).clone())


def sparse(name, shape, idx, vals, dtype=torch.float32):
    return CheckpointWeightPatch(
        name, shape, dtype, torch.tensor(vals, dtype=dtype), torch.tensor(idx, dtype=torch.int64)
    )


def test_writes_table_places_each_checkpoint_tensor_in_its_packed_slice():
    m = Packed()
    g = torch.Generator().manual_seed(1)
    ps = [dense(n, torch.randn(4, 4, generator=g)) for n in "qkv"]
    r = inspect_load(m, ps)
    w = r.writes.set_index("name")
    assert list(w.index) == ["q", "k", "v"]
    assert list(w["target"]) == ["qkv"] * 3
    assert list(w["target_offset"]) == [0, 16, 32]
    assert list(w["target_region"]) == ["[0:4, :]", "[4:8, :]", "[8:12, :]"]
    assert list(w["checkpoint_region"]) == ["[:, :]"] * 3
    assert list(w["position"]) == [0, 1, 2]
    assert (w["elements"] == 16).all()


def test_deltas_count_exactly_the_elements_whose_bits_changed():
    m = Packed()
    before = m.qkv.detach().clone()
    # Three values into k: one equal to the current value (no change), two different.
    k_now = before[4:8].reshape(-1)
    p = sparse("k", (4, 4), [0, 5, 15], [float(k_now[0]), 123.0, -7.5])
    r = inspect_load(m, [p])
    assert r.deltas.loc["qkv", "changed"] == 2
    # The loader copies the whole k slice, but a NaN-merged copy writes 3 elements.
    assert r.writes["elements"].tolist() == [16]
    assert r.deltas.loc["qkv", "elements"] == 3
    assert r.writes["changed"].tolist() == [2]
    truth = int((bits(before) != bits(m.qkv.detach())).sum())
    assert truth == 2
    assert r.deltas.loc["qkv", "max_abs"] == max(
        abs(123.0 - float(k_now[5])), abs(-7.5 - float(k_now[15]))
    )


def test_before_and_after_rebuild_the_runtime_tensor_around_the_load():
    m = Packed()
    before = m.qkv.detach().clone()
    ps = [sparse("v", (4, 4), [1], [9.0]), sparse("v", (4, 4), [1, 2], [10.0, 11.0])]
    r = inspect_load(m, ps)
    assert torch.equal(bits(r.before("qkv")), bits(before.cpu()))
    assert torch.equal(bits(r.after("qkv")), bits(m.qkv.detach().cpu()))
    assert r.after("qkv")[8, 1] == 10.0  # later patch wins
    # Element 1 was written twice: counted once in elements, changed against the start.
    assert r.deltas.loc["qkv", "elements"] == 2
    assert r.deltas.loc["qkv", "changed"] == 2
    assert r.writes["changed"].tolist() == [1, 2]


def test_before_and_after_are_copies_that_neither_follow_nor_touch_the_model():
    m = PlainModel({"w": (2, 2)}, device="cpu")  # (where to("cpu") alone copies nothing)
    r = inspect_load(m, [dense("w", torch.full((2, 2), 3.0))])
    before, after = r.before("w"), r.after("w")
    after += 1.0  # the caller's tensors: writing them leaves the model as it is
    before += 1.0
    assert m.w.detach().tolist() == [[3.0, 3.0], [3.0, 3.0]]
    with torch.no_grad():
        m.w.mul_(2.0)  # and a later step leaves what the caller holds as it was
    assert after.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    assert r.after("w").tolist() == [[6.0, 6.0], [6.0, 6.0]]  # (the tensor now)


def test_overlapping_regions_of_one_tensor_count_each_element_once():
    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(8), False)

        def load_weights(self, weights):
            for name, t in weights:
                lo = 0 if name == "a" else 2  # a writes 0:6, b writes 2:8
                self.w.data[lo : lo + 6].copy_(t)
            return {n for n, _ in weights}

    m = Halves()
    ps = [dense("a", torch.ones(6)), dense("b", torch.full((6,), 2.0))]
    r = inspect_load(m, ps)
    assert r.deltas.loc["w", "elements"] == 8
    assert r.deltas.loc["w", "changed"] == 8
    assert torch.equal(r.before("w"), torch.zeros(8, device="cpu"))


class _Scattered(torch.nn.Module):
    """One matrix written by a loader in many pieces, in a shuffled order, and then in a
    few more through a uint8 view of the same bytes (which the report does not follow:
    the pieces measured before that such a write reaches are read again after the load).
    ``crossing``: the pieces are single rows, column slices and blocks that cross earlier
    ones; else blocks of whole rows side by side, each written once."""

    def __init__(self, seed: int, crossing: bool):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(48, 16, generator=g), False)
        self.g, self.crossing = g, crossing

    def _pieces(self):
        g = self.g
        if not self.crossing:
            cuts = sorted(torch.randperm(47, generator=g)[:15].add(1).tolist())
            rows = list(zip([0, *cuts], [*cuts, 48]))
            return [(rows[i], (0, 16)) for i in torch.randperm(len(rows), generator=g)]
        pieces = []
        for _ in range(40):
            kind = int(torch.randint(0, 3, (1,), generator=g))
            r0 = int(torch.randint(0, 47, (1,), generator=g))
            r1 = r0 + 1 + int(torch.randint(0, 48 - r0 - 1, (1,), generator=g)) * (kind > 0)
            c0 = int(torch.randint(0, 15, (1,), generator=g)) * (kind > 1)
            c1 = 16 if kind < 2 else c0 + 1 + int(torch.randint(0, 16 - c0 - 1, (1,), generator=g))
            pieces.append(((r0, r1), (c0, c1)))
        return pieces

    def load_weights(self, weights):
        for _, t in weights:
            w = self.w.data
            for (r0, r1), (c0, c1) in self._pieces():
                w[r0:r1, c0:c1].copy_(t[r0:r1, c0:c1])
            for _ in range(3):
                r0 = int(torch.randint(0, 47, (1,), generator=self.g))
                src = t[r0:r0 + 1] + 1  # (bits the loader made: not the patch's)
                w[r0:r0 + 1].view(torch.uint8).copy_(src.view(torch.uint8))
        return {n for n, _ in weights}


_nothing = contextlib.nullcontext


@pytest.mark.parametrize("crossing", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_deltas_of_a_matrix_written_piecewise_in_any_order_match_the_snapshot(seed, crossing):
    # What the load wrote, found by hand: the pieces' union, and before/after bits there.
    g = torch.Generator().manual_seed(100 + seed)
    new = torch.randn(48, 16, generator=g)
    for disabled in (False, True):
        m = _Scattered(seed, crossing)
        start = m.w.detach().clone()
        new_here = torch.where(torch.rand(48, 16, generator=g) < 0.5, start, new)  # half kept
        with patchkit.native.disabled() if disabled else _nothing():
            r = inspect_load(m, [dense("w", new_here)])
        written = r.written("w")
        after = m.w.detach()
        d = (after - start)[written].double()
        row = r.deltas.loc["w"]
        assert row["elements"] == int(written.sum()) == (768 if not crossing else row["elements"])
        assert row["changed"] == int((bits(after) != bits(start))[written].sum())
        assert row["max_abs"] == pytest.approx(float(d.abs().max()), rel=1e-6)
        assert row["mean_abs"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
        ref = float(d.norm() / start[written].double().norm())
        assert row["rel_l2"] == pytest.approx(ref, rel=1e-5)
        assert torch.equal(bits(r.before("w")), bits(start))


def test_the_sweep_for_overlapping_saves_agrees_with_testing_every_pair():
    from patchkit._regions import _span_of
    from patchkit.inspect import _any_overlap
    from patchkit.intercept import Region

    g = torch.Generator().manual_seed(3)
    w = torch.zeros(40, 12)
    for _ in range(300):
        views = []
        for _ in range(int(torch.randint(2, 7, (1,), generator=g))):
            r0, c0 = (int(x) for x in torch.randint(0, 11, (2,), generator=g))
            r1 = r0 + 1 + int(torch.randint(0, 3, (1,), generator=g))
            c1 = c0 + 1 + int(torch.randint(0, 12 - c0, (1,), generator=g))
            views.append(w[r0 * 3:r1 * 3, c0:c1])  # rows far apart, or column slices
        regions = [typing.cast(typing.Any, type("S", (), {"region": Region.of(v)})) for v in views]
        ext = [_span_of(v)[:3] for v in views]
        pairs = any(regions[i].region.overlaps(regions[j].region)
                    for i in range(len(views)) for j in range(i))
        assert _any_overlap(regions, ext) == pairs


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_the_garbage_collector_is_paused_for_the_load_and_restored_after(enabled, fails):
    import gc

    seen = []

    class Watches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4), False)

        def load_weights(self, weights):
            seen.append(gc.isenabled())
            if fails:
                raise RuntimeError("the loader failed")
            for _, t in weights:
                self.w.data.copy_(t)
            return {n for n, _ in weights}

    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError) if fails else _nothing():
            inspect_load(Watches(), [dense("w", torch.ones(4))])
        assert seen == [False]
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("first_ends", ["first", "second"])
@pytest.mark.parametrize("other", ["report", "sparse load", "transactional load"])
def test_the_collector_stays_paused_until_the_last_of_two_threads_loads_ends(
    enabled, first_ends, other
):
    # (was: each load put back what it found, so the load that paused it turned the
    # collector on while the other thread's load still ran)
    import gc
    import threading

    wait = 20  # seconds a thread waits for the other before the test gives up
    inside = {"report": threading.Event(), "other": threading.Event()}
    go = {"report": threading.Event(), "other": threading.Event()}
    seen: dict[str, bool] = {}
    errors: list[BaseException] = []

    class Meets(PlainModel):
        def __init__(self, who):
            super().__init__({"w": (4,)}, fill=1.0)
            self.who = who

        def load_weights(self, weights):
            weights = list(weights)
            inside[self.who].set()
            assert go[self.who].wait(wait)
            seen[self.who] = gc.isenabled()  # (the other load ended by now, or not begun)
            return super().load_weights(weights)

    def run(who):
        try:
            m = Meets(who)
            if who == "report":
                inspect_load(m, [dense("w", torch.full((4,), 2.0))])
            elif other == "sparse load":
                patchkit.load_checkpoint_weight_patches(m, [CheckpointWeightPatch(
                    "w", (4,), torch.float32, torch.ones(1) * 3, torch.tensor([1]))])
            else:
                patchkit.load_checkpoint_weight_patches(
                    m, [dense("w", torch.full((4,), 3.0))], transactional=True)
        except BaseException as exc:  # (shown by the assert below)
            errors.append(exc)

    first, second = ("report", "other") if first_ends == "first" else ("other", "report")
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        threads = {who: threading.Thread(target=run, args=(who,)) for who in inside}
        for who in (first, second):  # both inside their loads: both paused it
            threads[who].start()
            assert inside[who].wait(wait)
        go[first].set()
        threads[first].join(wait)
        go[second].set()
        threads[second].join(wait)
        assert not any(t.is_alive() for t in threads.values()), "a thread hung"
        assert errors == []
        assert seen == {first: False, second: False}
        assert gc.isenabled() is enabled
    finally:
        for event in go.values():
            event.set()
        (gc.enable if was else gc.disable)()


def test_chunks_table_is_the_plan_and_calls_table_is_what_the_loader_did():
    m = Packed()
    g = torch.Generator().manual_seed(2)
    ps = [dense(n, torch.randn(4, 4, generator=g)) for n in ["q", "k", "q", "v"]]
    r = inspect_load(m, ps, max_chunk_bytes=100)
    plan = plan_chunks(ps, 100)
    assert r.chunks["chunk"].tolist() == [c.index for c in plan for _ in c.positions]
    assert r.chunks.groupby("chunk")["closed_by"].first().tolist() == [c.closed_by for c in plan]
    assert [list(n) for n in r.calls["names"]] == m.calls == [list(c.names) for c in plan]
    assert r.calls["writes"].tolist() == [len(c.positions) for c in plan]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(st.sampled_from(["q", "k", "v", "norm"]), min_size=1, max_size=8),
    budget=st.integers(min_value=1, max_value=300),
)
def test_reported_chunks_and_calls_agree_with_the_loaders_real_calls(names, budget):
    m = Packed()
    ps = [
        dense(n, torch.full((4,) if n == "norm" else (4, 4), float(i)))
        for i, n in enumerate(names)
    ]
    r = inspect_load(m, ps, max_chunk_bytes=budget)
    plain = Packed()
    patchkit.load_checkpoint_weight_patches(plain, ps, max_chunk_bytes=budget)
    assert [list(x) for x in r.calls["names"]] == m.calls == plain.calls
    per_chunk = r.chunks.groupby("chunk")["name"].apply(list).tolist()
    assert per_chunk == m.calls
    assert torch.equal(m.qkv, plain.qkv) and torch.equal(m.norm, plain.norm)


def test_patch_summary_reports_density_and_bytes():
    ps = [
        dense("norm", torch.ones(4)),
        sparse("k", (4, 4), [0, 3], [1.0, 2.0], dtype=torch.bfloat16),
    ]
    df = patch_summary(ps)
    assert df["kind"].tolist() == ["dense", "sparse"]
    assert df["nnz"].tolist() == [4, 2]
    assert df["density"].tolist() == [1.0, 2 / 16]
    assert df["staged_bytes"].tolist() == [16, 32]
    assert df["wire_bytes"].tolist() == [16, 2 * 2 + 2 * 8]


def test_patch_summary_columns_row_by_row():
    # numel is the tensor's elements and nnz what the patch writes: they differ for a
    # sparse patch (here with a repeated index, counted once) and agree for a dense one
    ps = [
        sparse("k", (3, 5), [14, 2, 2], [1.0, 2.0, 3.0], dtype=torch.float16),
        dense("scale", torch.tensor(1.5, dtype=torch.bfloat16)),
        sparse("e", (2, 0), [], []),
    ]
    df = patch_summary(ps)
    assert list(df.columns) == ["position", "name", "kind", "shape", "dtype", "numel", "nnz",
                                "density", "wire_bytes", "staged_bytes"]
    assert df.to_dict("records") == [
        {"position": 0, "name": "k", "kind": "sparse", "shape": (3, 5), "dtype": "float16",
         "numel": 15, "nnz": 2, "density": 2 / 15, "wire_bytes": 3 * 2 + 3 * 8,
         "staged_bytes": 30},
        {"position": 1, "name": "scale", "kind": "dense", "shape": (), "dtype": "bfloat16",
         "numel": 1, "nnz": 1, "density": 1.0, "wire_bytes": 2, "staged_bytes": 2},
        {"position": 2, "name": "e", "kind": "sparse", "shape": (2, 0), "dtype": "float32",
         "numel": 0, "nnz": 0, "density": 0.0, "wire_bytes": 0, "staged_bytes": 0},
    ]


def test_patch_summary_refuses_an_index_outside_the_tensor_as_a_load_would():
    ok = sparse("a", (4, 4), [0, 3], [1.0, 2.0])
    for idx, bad in (([2, 99], 99), ([-1, 2], -1), ([16], 16)):
        p = sparse("w", (4, 4), idx, [1.0] * len(idx))
        with pytest.raises(PatchValueError,
                           match=rf"patch 1 \('w'\): out-of-range index {bad}") as e:
            patch_summary([ok, p])
        assert (e.value.position, e.value.reason, e.value.value) == (1, "out-of-range", bad)
        with pytest.raises(PatchValueError, match=rf"out-of-range index {bad}"):
            patchkit.load_checkpoint_weight_patches(PlainModel({"a": (4, 4), "w": (4, 4)}),
                                                    [ok, p])
    # an int32 index against a tensor of more elements than int32 holds
    big = CheckpointWeightPatch("b", (2**32,), torch.float32, torch.ones(2),
                                torch.tensor([-5, 3], dtype=torch.int32))
    with pytest.raises(PatchValueError, match=r"out-of-range index -5 at indices\[0\]"):
        patch_summary([big])
    # what a summary takes that a load refuses: NaN, a repeated index, dense with sparse
    nan = sparse("n", (4,), [1, 1], [float("nan"), 2.0])
    assert patch_summary([nan, dense("d", torch.ones(2))])["nnz"].tolist() == [1, 2]


def test_nnz_counts_an_index_given_twice_once_as_density_map_does():
    # 6 entries over 3 distinct positions read nnz 6 (density 0.15) in patch_summary and
    # chunks, while density_map counted each position once
    p = sparse("w", (40,), [3, 7, 3, 9, 7, 3], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    unsorted = sparse("u", (40,), [9, 3, 7], [1.0, 2.0, 3.0])  # unique, not sorted
    r = inspect_load(PlainModel({"w": (40,), "u": (40,)}), [p, unsorted],
                     validate_unique_indices=False)
    for df in (patch_summary([p, unsorted]), r.chunks):
        assert df["nnz"].tolist() == [3, 3]
        assert df["density"].tolist() == [3 / 40, 3 / 40]
    assert float(patchkit.density_map(p, bins=(1, 1))) == pytest.approx(3 / 40)  # float32
    assert r.deltas.loc["w", "elements"] == 3


def test_a_failed_load_raises_with_the_partial_report_attached():
    m = Packed()
    ps = [dense("q", torch.ones(4, 4)), dense("nope", torch.ones(4, 4))]
    try:
        inspect_load(m, ps, max_chunk_bytes=64)
    except KeyError as exc:
        report = exc.report
    else:
        raise AssertionError("the load should have raised")
    assert report.error is not None
    assert report.calls["error"].tolist() == [False, True]
    assert report.writes["name"].tolist() == ["q"]
    assert (m.qkv[0:4] == 1).all()  # not transactional: the first chunk stays


def test_transactional_report_restores_and_says_so():
    m = Packed()
    before = m.qkv.detach().clone()
    ps = [dense("q", torch.ones(4, 4)), dense("nope", torch.ones(4, 4))]
    try:
        inspect_load(m, ps, max_chunk_bytes=64, transactional=True)
    except KeyError as exc:
        assert exc.report.writes["name"].tolist() == ["q"]
    assert torch.equal(bits(m.qkv.detach()), bits(before))


def test_report_renders_in_a_terminal_and_a_notebook_without_timings():
    m = Packed()
    r = inspect_load(m, [sparse("q", (4, 4), [0], [5.0])])
    text = repr(r)
    assert "LoadReport(" in text and "load_weights calls=1" in text
    html = r._repr_html_()
    assert "<table" in html and "seconds" not in html
    assert r.summary()["elements changed"] == 1
    # the headline rows are summary()'s, less those of no value (no error: no error row)
    assert r.summary()["error"] is None
    headline = html.split("</table>")[0]  # (the calls table has an error column)
    assert ">error<" not in headline and "None" not in headline and "error=" not in text


def test_html_summary_escapes_what_the_load_was_given():
    class Refuses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            raise KeyError(f"unknown {weights[0][0]}")

    evil = "w<script>alert(1)</script>&"
    with pytest.raises(KeyError) as info:
        inspect_load(Refuses(), [dense(evil, torch.ones(4))])
    page = info.value.report._repr_html_()
    assert "<script>" not in page
    assert "w&lt;script&gt;alert(1)&lt;/script&gt;&amp;" in page


def test_html_says_how_many_rows_a_table_has_and_reprs_cut_long_cells():
    n = 12
    long = "model.language_model.layers.31.block_sparse_moe.experts.127.w2.weight"
    shapes = {f"{long}.{i}": (2,) for i in range(n)}
    m = PlainModel(shapes)
    r = inspect_load(m, [dense(k, torch.full((2,), 1.0)) for k in shapes])
    page = r._repr_html_()
    assert f"chunks (first 8 of {n} rows)" in page and "deltas (first 8 of 12 rows)" in page
    assert "calls (1 row)" in page
    chunks_part, deltas_part = page.split("deltas (")
    assert long not in chunks_part and long[:40] in chunks_part  # cut to 60, with "..."
    # (the index, deltas' names, was not cut: a name of 10**6 characters went whole)
    assert long not in deltas_part and long[:40] in deltas_part
    text = repr(r).split("deltas:")[0]
    assert long not in text and long[:40] in text


def test_html_shows_a_table_of_exactly_its_row_limit_whole():
    # 8 rows (the HTML limit) are all shown: "(8 rows)", not "(first 8 of 8 rows)"
    shapes = {f"w{i}": (2,) for i in range(8)}
    r = inspect_load(PlainModel(shapes), [dense(k, torch.full((2,), 1.0)) for k in shapes])
    page = r._repr_html_()
    assert "chunks (8 rows)" in page and "deltas (8 rows)" in page
    assert "first 8" not in page


def test_reprs_write_names_that_would_read_alike_or_blank_as_their_repr():
    # (a name "a\\nb" and one "a\nb" read the same, "a\nb", and " " and "  " as blanks)
    names = ["a\nb", "a\\nb", " ", "  ", "'w'", "plain.weight"]
    m = PlainModel({n: (2,) for n in names})
    r = inspect_load(m, [dense(n, torch.ones(2)) for n in names])
    chunks_text, deltas_text = repr(r).split("deltas:")
    shown = [repr(n) for n in names[:5]] + ["plain.weight"]
    # (the first block of the chunks table's columns: chunk, position, name, ...)
    rows = chunks_text.split("chunks:\n")[1].split("\n\n")[0].splitlines()[1:]
    assert [re.match(r"\s*0\s+\d\s+(.*?)\s+dense ", row).group(1) for row in rows] == shown
    rows = deltas_text.strip().splitlines()[-len(names):]
    assert [re.match(r"(.*?)\s+2\s+2\s", row).group(1) for row in rows] == shown
    page = r._repr_html_()
    for n in ("<td>'a\\nb'</td>", "<td>'a\\\\nb'</td>", "<td>' '</td>",
              "<th>'a\\nb'</th>", "<th>' '</th>", "<td>plain.weight</td>"):
        assert n in page
    assert r.chunks["name"].tolist() == names  # (the tables keep the names as they are)


def test_reprs_escape_what_in_an_error_message_would_rewrite_the_line():
    class Refuses(PlainModel):
        def load_weights(self, weights):
            raise RuntimeError("disk\u202e gone")

    with pytest.raises(RuntimeError) as info:
        inspect_load(Refuses({"w": (2,)}), [dense("w", torch.ones(2))])
    report = info.value.report
    assert "error=RuntimeError: disk\\u202e gone" in repr(report)
    assert "RuntimeError: disk\\u202e gone" in report._repr_html_()
    assert "\u202e" not in repr(report) + report._repr_html_()


def test_both_reprs_escape_a_lone_surrogate_that_reaches_them_unquoted():
    """A name of a str subclass is written by its own __repr__ (in both reprs, and in the
    HTML's calls table, whose tuple of names is written as its repr where a name is not
    plain): a lone surrogate there would make the repr unprintable (no Jupyter message
    or UTF-8 terminal takes it)."""
    class Name(str):
        def __repr__(self) -> str:
            return f"Name({str.__str__(self)})"

    report = inspect_load(PlainModel({"w\ud800": (2,), "v\ud800": (2,)}), [
        dense("w\ud800", torch.ones(2)), dense(Name("v\ud800"), torch.ones(2))])
    text, page = repr(report), report._repr_html_()
    text.encode("utf-8")  # (neither raises)
    page.encode("utf-8")
    assert "\ud800" not in text + page
    assert "Name(v\\ud800)" in text and "Name(v\\ud800)" in page
    assert "('w\\ud800', Name(v\\ud800))" in page  # (the calls table's tuple of names)


def test_report_figure_methods_show_their_arguments():
    import inspect as pyinspect

    from patchkit import LoadReport

    def params(f):
        return list(pyinspect.signature(f).parameters)

    assert params(LoadReport.plot_chunks) == ["self", "max_chunk_bytes", "ax"]
    assert params(LoadReport.plot_density) == ["self", "patch_or_name", "bins", "ax"]
    assert params(LoadReport.plot_placement) == ["self", "targets", "max_targets"]
    assert params(LoadReport.plot_delta) == ["self", "target", "bins", "changed_only",
                                             "hist_bins"]
    assert params(LoadReport) == ["patches", "plan", "max_chunk_bytes", "loaded", "error",
                                  "rolled_back"]


def test_report_figure_methods_pass_their_arguments_on():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = Packed()
    r = inspect_load(m, [dense(n, torch.full((4, 4), 2.0)) for n in "qkv"] +
                     [dense("norm", torch.ones(4))], max_chunk_bytes=64)
    fig = r.plot_placement(["norm"])
    assert [a.get_title() for a in fig.axes if "norm" in a.get_title()]
    assert not [a.get_title() for a in fig.axes if "qkv" in a.get_title()]
    plt.close(fig)
    fig = r.plot_placement(max_targets=1)
    assert not [a.get_title() for a in fig.axes if "norm" in a.get_title()]
    plt.close(fig)
    assert "4 load_weights calls" in r.plot_chunks().axes[0].get_title()
    assert "1 load_weights call\n" in r.plot_chunks(1 << 20).axes[0].get_title()
    fig = r.plot_delta("qkv", 4, changed_only=True, hist_bins=7)
    assert len(fig.axes[3].patches) == 7
    plt.close("all")


# -- observing another loader -------------------------------------------------------------


def vllm_style_loader(
    model, patches, *, max_chunk_bytes=512 << 20, validate_unique_indices=True,
    transactional=False,
):
    """A stand-in for vLLM 0.33's approach, written for this test: while a sparse chunk
    loads, ``torch.Tensor.copy_`` is replaced process-wide by a NaN-merging copy."""
    patches = list(patches)
    is_sparse = bool(patches) and patches[0].indices is not None
    names = set()
    for chunk in plan_chunks(patches, max_chunk_bytes):
        staged = []
        for pos in chunk.positions:
            p = patches[pos]
            if p.indices is None:
                staged.append((p.name, p.values.to(p.dtype).reshape(p.shape)))
            else:
                t = torch.full(p.shape, float("nan"), dtype=p.dtype)
                t.view(-1)[p.indices.long()] = p.values.to(p.dtype)
                staged.append((p.name, t))
        original = torch.Tensor.copy_

        def merging_copy(dst, src, non_blocking=False, original=original):
            src = src.to(dst.dtype)
            return original(dst, torch.where(torch.isnan(src), dst, src), non_blocking)

        if is_sparse:
            torch.Tensor.copy_ = merging_copy
        try:
            out = model.load_weights(staged)
        finally:
            torch.Tensor.copy_ = original
        names |= set(out or ())
    return names


def test_observing_a_foreign_loader_agrees_with_the_builtin_loader():
    ps = [
        sparse("q", (4, 4), [0, 7], [1.5, -2.0]),
        sparse("v", (4, 4), [3], [4.0]),
        sparse("q", (4, 4), [7, 8], [3.0, 5.0]),
    ]
    ours_model, theirs_model = Packed(), Packed()
    ours = inspect_load(ours_model, ps, max_chunk_bytes=128)
    theirs = inspect_load(theirs_model, ps, max_chunk_bytes=128, loader=vllm_style_loader)
    assert torch.equal(bits(ours_model.qkv.detach()), bits(theirs_model.qkv.detach()))
    assert theirs.calls["names"].tolist() == ours.calls["names"].tolist()
    assert theirs.deltas["changed"].to_dict() == ours.deltas["changed"].to_dict()
    assert theirs.writes[["chunk", "target", "target_region", "changed"]].equals(
        ours.writes[["chunk", "target", "target_region", "changed"]]
    )
    assert "load_weights" not in vars(theirs_model)  # the wrapper is gone


def test_written_mask_and_targets_describe_the_runtime_side():
    m = Packed()
    r = inspect_load(m, [sparse("k", (4, 4), [0], [5.0])])
    assert r.targets == {"qkv": (12, 4), "norm": (4,)}
    mask = r.written("qkv")
    assert mask.shape == (12, 4)
    assert mask[4, 0] and int(mask.sum()) == 1  # the one element the sparse patch wrote
    assert not r.written("norm").any()
    dense_report = inspect_load(m, [dense("v", torch.ones(4, 4))])
    written = dense_report.written("qkv")
    assert written[8:12].all() and int(written.sum()) == 16  # a dense copy writes its view


def test_region_text_names_boxes_also_when_the_view_drops_a_dimension():
    from patchkit.density import region_text

    assert region_text((8, 4), 8, (2, 4), (4, 1)) == "[2:4, :]"
    assert region_text((8, 4), 2, (8, 2), (4, 1)) == "[:, 2:4]"
    assert region_text((8, 4), 12, (4,), (1,)) == "[3:4, :]"  # w[3]
    assert region_text((8, 4), 13, (2,), (1,)) == "[3:4, 1:3]"  # w[3, 1:3]
    assert region_text((8, 4), 2, (3,), (4,)) == "[0:3, 2:3]"  # w[0:3, 2]
    assert region_text((8, 4), 3, (5,), (1,)) == "5 elements from 3"  # wraps a row


def test_writes_name_interleaved_rows_and_a_transposed_box_as_slices(interleaved):
    r = inspect_load(interleaved, [
        dense("gate", torch.ones(4, 4)), dense("up", 2 * torch.ones(4, 4)),
        dense("x", 3 * torch.ones(2, 6)),
    ])
    got = dict(zip(r.writes["name"], r.writes["target_region"]))
    assert got == {"gate": "[0:8:2, :]", "up": "[1:8:2, :]", "x": "[:, 1:3]"}


def test_tiny_llama_tp2_writes_land_in_each_ranks_slices():
    from patchkit import dense_patches
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    cfg = TinyLlamaConfig()  # q 64 rows, k and v 32 rows each, hidden 64, intermediate 128
    ckpt = tiny_llama_checkpoint(cfg)
    patches = dense_patches({k: v for k, v in ckpt.items() if ".layers.0." in k})
    for rank in (0, 1):
        r = inspect_load(TinyLlamaRuntime(cfg, tp_rank=rank, tp_size=2), patches)
        w = r.writes.set_index("name")
        attn = "model.layers.0.self_attn."
        qkv = attn + "qkv_proj.weight"
        # q, k, v: rank r reads its half of the checkpoint rows and packs them q, k, v.
        for proj, rows, at in (("q", 64, 0), ("k", 32, 32), ("v", 32, 48)):
            row = w.loc[f"{attn}{proj}_proj.weight"]
            half = rows // 2
            assert row["checkpoint_region"] == f"[{rank * half}:{(rank + 1) * half}, :]"
            assert row["target"] == qkv
            assert row["target_region"] == f"[{at}:{at + half}, :]"
        # o_proj and down_proj are row-parallel: each rank reads a band of columns.
        o = w.loc[attn + "o_proj.weight"]
        assert o["checkpoint_region"] == f"[:, {rank * 32}:{(rank + 1) * 32}]"
        assert o["target_region"] == "[:, :]"
        down = w.loc["model.layers.0.mlp.down_proj.weight"]
        assert down["checkpoint_region"] == f"[:, {rank * 64}:{(rank + 1) * 64}]"
        assert r.deltas.loc[qkv, "elements"] == 64 * 64


@pytest.mark.parametrize("tp_size", [4, 8])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_tiny_llama_with_more_ranks_than_kv_heads_reads_one_kv_head_a_rank(tp_size, kind):
    # 8 query heads, 2 kv heads, head_dim 8, hidden 64: k and v are 16 rows each; rank r
    # of tp_size reads kv head 0 (rows 0:8) in the first half of the ranks, else head 1
    from patchkit import dense_patches
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    cfg = TinyLlamaConfig(num_heads=8, num_kv_heads=2)
    ckpt = tiny_llama_checkpoint(cfg, seed=5)
    attn = "model.layers.1.self_attn."
    names = [attn + "k_proj.weight", attn + "v_proj.weight"]
    if kind == "dense":
        patches = dense_patches({n: ckpt[n] for n in names})
    else:  # one element in each head of k and of v
        patches = [sparse(n, (16, 64), [3 * 64 + 1, 12 * 64 + 9], [2.0, -3.0],
                          dtype=torch.bfloat16) for n in names]
    q_rows = 64 // tp_size
    regions = {}
    for rank in range(tp_size):
        r = inspect_load(TinyLlamaRuntime(cfg, tp_rank=rank, tp_size=tp_size), patches)
        w = r.writes.set_index("name")
        head = 0 if rank < tp_size // 2 else 1
        for proj, at in (("k", q_rows), ("v", q_rows + 8)):
            row = w.loc[f"{attn}{proj}_proj.weight"]
            assert row["checkpoint_region"] == f"[{8 * head}:{8 * head + 8}, :]"
            assert int(row["checkpoint_offset"]) == 8 * head * 64
            assert row["target"] == attn + "qkv_proj.weight"
            assert row["target_region"] == f"[{at}:{at + 8}, :]"
            assert int(row["target_offset"]) == at * 64
            assert int(row["elements"]) == 8 * 64
            assert int(row["written"]) == (8 * 64 if kind == "dense" else 1)
        regions[rank] = r.after(attn + "qkv_proj.weight")[q_rows:].clone()
    # the ranks of a group hold replicas: the same bits in their k and v rows
    half = tp_size // 2
    for rank in range(tp_size):
        lead = 0 if rank < half else half
        assert torch.equal(regions[rank].view(torch.int16), regions[lead].view(torch.int16))
    assert not torch.equal(regions[0].view(torch.int16), regions[half].view(torch.int16))


def test_inspect_accepts_what_the_loader_accepts_and_keeps_its_errors():
    m = Packed()
    r = inspect_load(m, [("norm", (4,), torch.float32, torch.full((4,), 3.0), None)])
    assert r.chunks["name"].tolist() == ["norm"] and m.norm.tolist() == [3.0] * 4
    bad = ("norm", (4,), "float32", torch.ones(4), None)  # dtype as a string
    try:
        inspect_load(m, [bad])
    except TypeError as exc:
        assert "dtype must be a torch.dtype" in str(exc)
    else:
        raise AssertionError("a bad dtype must raise the loader's TypeError")


def test_before_and_written_follow_strided_and_shared_storage():
    class Strided(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(6.0).reshape(3, 2).t(), False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t)
            return {n for n, _ in weights}

    m = Strided()
    before = m.w.detach().clone()
    r = inspect_load(m, [sparse("w", (2, 3), [1], [100.0])])
    assert torch.equal(r.before("w"), before.cpu())
    assert r.written("w").tolist() == [[False, True, False], [False, False, False]]

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = torch.arange(8.0)
            self.a = torch.nn.Parameter(self.flat[:4], False)
            self.b = torch.nn.Parameter(self.flat[4:], False)

        def load_weights(self, weights):
            for _, t in weights:
                self.a.data.as_strided((8,), (1,), 0).copy_(t)  # one copy over both
            return {n for n, _ in weights}

    f = Flat()
    r = inspect_load(f, [sparse("flat", (8,), [1, 6], [100.0, 600.0])])
    assert r.deltas["changed"].to_dict() == {"a": 1, "b": 1}
    assert r.written("b").tolist() == [False, False, True, False]
    assert r.before("b").tolist() == [4.0, 5.0, 6.0, 7.0]


def test_a_tensor_rebound_during_the_load_keeps_the_numbers_of_its_write():
    class Rebinds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4), False)
            self.b = torch.nn.Parameter(torch.zeros(4), False)

        def load_weights(self, weights):
            for name, t in weights:
                getattr(self, name).copy_(t)
            self.a.data = torch.full((4,), 7.0)  # a new storage, after the write
            return {n for n, _ in weights}

    m = Rebinds()
    r = inspect_load(m, [dense("a", torch.ones(4)), dense("b", torch.ones(4))])
    # a's row is what the load did to a: zeros before, the rebound sevens after (its
    # write of ones was overwritten by the rebinding, which counts as a write of all of a)
    assert r.deltas.to_dict("index") == {
        "a": {"elements": 4, "changed": 4, "max_abs": 7.0, "mean_abs": 7.0, "rel_l2": math.inf},
        "b": {"elements": 4, "changed": 4, "max_abs": 1.0, "mean_abs": 1.0, "rel_l2": math.inf},
    }
    assert r.writes["target"].tolist() == ["a", "b", "a"]  # the write itself was seen
    assert r.writes["op"].tolist()[2] == "rebind"
    assert r.before("a").tolist() == [0.0] * 4 and r.after("a").tolist() == [7.0] * 4


def test_a_loader_returning_a_generator_is_reported_with_its_names():
    class Gen(Packed):
        def load_weights(self, weights):
            names = super().load_weights(weights)
            return (n for n in names)

    r = inspect_load(Gen(), [sparse("q", (4, 4), [0], [5.0])])
    assert r.loaded == {"q"} and r.calls["returned"].tolist() == [("q",)]


def test_a_call_that_returns_none_is_told_from_one_that_returns_no_names():
    # calls.returned is None where the loader returned None (which adds nothing to
    # loaded), an empty tuple where it returned an empty set
    class Returns(Packed):
        def load_weights(self, weights):
            super().load_weights(weights)
            return None if weights[0][0] == "q" else set()

    r = inspect_load(Returns(), [sparse("q", (4, 4), [0], [5.0]),
                                 sparse("k", (4, 4), [0], [5.0])], max_chunk_bytes=64)
    assert r.calls["returned"].tolist() == [None, ()]
    assert r.loaded == set()


def test_an_observed_generator_function_loader_is_watched_while_it_loads():
    # (its writes ran after the observation ended: 0 calls, 0 writes, the model changed)
    def lazy_loader(model, patches, **kw):
        yield from patchkit.load_checkpoint_weight_patches(model, patches, **kw)

    m = PlainModel({"a": (4,)})
    r = inspect_load(m, [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))],
                     loader=lazy_loader)
    assert m.a.tolist() == [1.0] * 4
    assert (len(r.calls), len(r.writes), r.loaded) == (1, 1, {"a"})
    assert int(r.deltas.loc["a", "changed"]) == 4


def test_an_observed_loader_may_give_load_weights_its_weights_by_keyword():
    # (the wrapper took them as a positional ``weights``: a model whose parameter has
    # another name, called by keyword, failed under observation with a TypeError naming
    # patchkit's wrapper, and loaded nothing)
    class ItsOwnName(PlainModel):
        def load_weights(self, weights_iter, *, strict=True):
            assert strict is False
            return super().load_weights(weights_iter)

    def by_keyword(model, patches, **kw):
        return model.load_weights(
            strict=False, weights_iter=[(p.name, p.values.view(p.shape)) for p in patches])

    m = ItsOwnName({"a": (4,)})
    r = inspect_load(m, [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))],
                     loader=by_keyword)
    assert m.a.tolist() == [1.0] * 4 and r.loaded == {"a"}
    assert [tuple(n) for n in r.calls["names"]] == [("a",)]
    assert r.writes["name"].tolist() == ["a"]
    assert "load_weights" not in vars(m)


def test_a_load_weights_that_calls_itself_is_one_observed_call_with_each_write_once():
    # (each inner call was recorded as a call of its own inside the outer one: every
    # write showed twice in ``writes``, and the outer call's row named only the last
    # inner call's weights)
    class OneAtATime(PlainModel):
        def load_weights(self, weights):
            weights = list(weights)
            if len(weights) == 1:
                return super().load_weights(weights)
            return set().union(*(self.load_weights([w]) for w in weights))

    sent: list[tuple[str, ...]] = []

    def loader(model, patches, **kw):
        sent.append(tuple(p.name for p in patches))
        return model.load_weights([(p.name, p.values.view(p.shape)) for p in patches])

    m = OneAtATime({"a": (4,), "b": (4,)})
    ps = [CheckpointWeightPatch(n, (4,), torch.float32, torch.full((4,), v))
          for n, v in (("a", 1.0), ("b", 2.0))]
    r = inspect_load(m, ps, loader=loader)
    assert [tuple(n) for n in r.calls["names"]] == sent == [("a", "b")]
    assert r.calls["writes"].tolist() == [2]
    assert r.writes[["chunk", "position", "name", "target"]].values.tolist() == [
        [0, 0, "a", "a"], [0, 1, "b", "b"]]
    assert r.deltas["changed"].tolist() == [4, 4]
    assert r.chunks["chunk"].tolist() == [0, 0] and r.loaded == {"a", "b"}


def _staged_into_one_buffer(stop_at=None):
    """A foreign loader that hands load_weights a generator staging each dense patch into
    one reused buffer as the model asks for it; its staging fails at patch ``stop_at``."""
    def loader(model, patches, **kw):
        buf = torch.empty(4)

        def entries():
            for i, p in enumerate(patches):
                if i == stop_at:
                    raise RuntimeError("staging failed")
                buf.copy_(p.values)
                yield p.name, buf

        return model.load_weights(entries())

    return loader


@pytest.mark.parametrize("stop_at", [None, 2], ids=["all staged", "staging fails"])
def test_an_observed_loaders_generator_is_read_as_the_model_reads_it(stop_at):
    # (the wrapper listed the generator before the model saw it: every entry was the
    # reused buffer as the last patch left it, so the model was loaded with the last
    # patch's values everywhere; and where staging failed, nothing of that call was
    # written, where the loader unobserved writes the entries before the failure)
    ps = [CheckpointWeightPatch(n, (4,), torch.float32, torch.full((4,), v))
          for n, v in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
    plain, observed = (PlainModel({"a": (4,), "b": (4,), "c": (4,)}) for _ in range(2))
    fails = pytest.raises(RuntimeError, match="staging failed")
    with fails if stop_at is not None else contextlib.nullcontext():
        _staged_into_one_buffer(stop_at)(plain, ps)
    with fails if stop_at is not None else contextlib.nullcontext():
        r = inspect_load(observed, ps, loader=_staged_into_one_buffer(stop_at))
    if stop_at is not None:
        r = fails.excinfo.value.report
    assert patchkit.same_state(plain.state_dict(), observed.state_dict())
    assert observed.a.tolist() == [1.0] * 4 and observed.b.tolist() == [2.0] * 4
    sent = ("a", "b", "c")[:stop_at]
    assert [tuple(n) for n in r.calls["names"]] == [sent]
    assert r.writes[["position", "name", "target", "changed"]].values.tolist() == [
        [i, n, n, 4] for i, n in enumerate(sent)]
    assert list(r.deltas.index) == list(sent)


def test_a_tied_alias_names_the_same_runtime_tensor_in_a_report():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Parameter(torch.zeros(4), False)
            self.head = self.embed

        def load_weights(self, weights):
            for _, t in weights:
                self.embed.data.copy_(t)
            return {n for n, _ in weights}

    r = inspect_load(Tied(), [sparse("head", (4,), [2], [5.0])])
    assert r.chunks["name"].tolist() == ["embed"]  # renamed to the canonical name
    assert r.after("head").tolist() == r.after("embed").tolist() == [0.0, 0.0, 5.0, 0.0]
    assert r.before("head").tolist() == [0.0] * 4


class _TiedByName(torch.nn.Module):
    """``emb`` (6, 4) and ``head``, one tied Parameter (``emb`` registered first): each
    weight is copied into the parameter its name gives."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.zeros(6, 4), False)
        self.head = self.emb

    def load_weights(self, weights):
        for n, t in weights:
            getattr(self, n).data.copy_(t)
        return {n for n, _ in weights}


class _TiedSkips(_TiedByName):
    """:class:`_TiedByName` whose loader takes every weight and writes none (as one that
    leaves a weight another rank holds)."""

    def load_weights(self, weights):
        list(weights)
        return set()


def test_a_renamed_tied_alias_keeps_its_rename_note_when_no_write_came_from_it():
    # The note column holds one note. That the patch went under another name is the one
    # only this note says (the name column shows the name it went under); that no write
    # came from it the writes table shows too.
    from patchkit.inspect import NO_WRITE_NOTE

    ps = [dense("head", torch.ones(6, 4)), dense("other", torch.ones(4))]
    with pytest.warns(UserWarning, match="was sent as 'emb'"):
        r = inspect_load(_TiedSkips(), ps)
    assert r.chunks["name"].tolist() == ["emb", "other"]
    assert r.chunks["note"].tolist() == ["renamed from 'head' (tied alias)", NO_WRITE_NOTE]
    assert len(r.writes) == 0


def _one_load_per_patch(model, patches, **kwargs):
    """A foreign loader that runs patchkit's own load once per patch: each call renames a
    tied alias to its first name (CONTRACT §6), and none drops one."""
    names = set()
    for p in patches:
        names |= patchkit.load_checkpoint_weight_patches(model, [p])
    return names


def _reversed_in_one_call(model, patches, **kwargs):
    """A foreign loader that sends every patch in one call, last first, under its own name
    (dense patches only: it does no NaN-merging)."""
    return model.load_weights([(p.name, _staged(p)) for p in reversed(patches)])


@pytest.mark.parametrize("head_first", [False, True], ids=["emb-head", "head-emb"])
def test_an_observed_loader_that_sends_a_tied_alias_is_credited_with_it(head_first):
    # a loader that sent the alias (renamed to emb) had it reported dropped, and its write
    # credited to the emb patch
    emb = sparse("emb", (6, 4), [0, 1], [1.0, 2.0])
    head = sparse("head", (6, 4), [5, 6, 7], [3.0, 4.0, 5.0])
    ps = [head, emb] if head_first else [emb, head]
    at = {"emb": ps.index(emb), "head": ps.index(head)}
    m = _TiedByName()
    r = inspect_load(m, ps, loader=_one_load_per_patch)
    assert m.emb.view(-1)[:8].tolist() == [1, 2, 0, 0, 0, 3, 4, 5]
    assert r.calls["names"].tolist() == [("emb",), ("emb",)]
    assert r.chunks["chunk"].tolist() == [0, 1]
    assert r.chunks["name"].tolist() == ["emb", "emb"]
    assert r.chunks["note"][at["head"]] == "renamed from 'head' (tied alias)"
    assert r.chunks["note"][at["emb"]] == ""
    assert r.writes["position"].tolist() == [0, 1]
    assert r.writes["written"].tolist() == [len(ps[0].values), len(ps[1].values)]
    # Each name sent under itself, in another order: matched by what each call holds.
    dense_ps = [dense(p.name, torch.full((6, 4), float(k + 1))) for k, p in enumerate(ps)]
    m = _TiedByName()
    r = inspect_load(m, dense_ps, loader=_reversed_in_one_call)
    assert (m.emb == 1).all()
    assert r.calls["names"].tolist() == [(ps[1].name, ps[0].name)]
    assert r.chunks["chunk"].tolist() == [0, 0] and r.chunks["note"].tolist() == ["", ""]
    assert r.writes["position"].tolist() == [1, 0]
    assert r.writes["name"].tolist() == [ps[1].name, ps[0].name]
    # patchkit's own loader, observed, really drops the alias: the report says so, as the
    # report of the load itself does.
    with pytest.warns(UserWarning, match=r"patch \d \('head'\) is not loaded"):
        own = inspect_load(_TiedByName(), ps)
    with pytest.warns(UserWarning, match=r"patch \d \('head'\) is not loaded"):
        r = inspect_load(_TiedByName(), ps, loader=patchkit.load_checkpoint_weight_patches)
    for rep in (own, r):
        assert rep.chunks["chunk"].tolist()[at["emb"]] == 0
        assert rep.chunks["note"][at["head"]].startswith("dropped: tied alias")
        assert rep.writes["position"].tolist() == [at["emb"]]


def _copies_staged(model, patches, **kwargs):
    """A foreign loader that runs patchkit's own load on copies of the patches' values:
    its calls follow the plan, but no staged tensor is the storage of a patch passed in."""
    copies = [p._replace(values=p.values.clone()) for p in patches]
    return patchkit.load_checkpoint_weight_patches(model, copies, **kwargs)


def test_an_observed_loader_credits_a_tied_patch_by_storage_then_by_the_plan():
    # lm_head (an alias of embed_tokens) and embed_tokens patched with equal values: the
    # observed built-in loader, which drops lm_head and sends embed_tokens' own storage,
    # was reported to send lm_head renamed, and embed_tokens not at all
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    cfg = TinyLlamaConfig(tie_word_embeddings=True)
    ck = tiny_llama_checkpoint(cfg, seed=0)
    e = ck["model.embed_tokens.weight"]
    ps = [dense("lm_head.weight", e), dense("model.norm.weight", ck["model.norm.weight"]),
          dense("model.embed_tokens.weight", e)]
    columns = ["chunk", "position", "name", "note"]
    reports = [inspect_load(TinyLlamaRuntime(cfg), ps, loader=loader)
               for loader in (None, patchkit.load_checkpoint_weight_patches, _copies_staged)]
    for r in reports:
        assert r.chunks["note"][0].startswith("dropped: tied alias")
        assert r.chunks["note"].tolist()[1:] == ["", ""]
        assert r.chunks["chunk"].isna().tolist() == [True, False, False]
        assert r.chunks["chunk"].tolist()[1:] == [0, 0]
        assert r.writes["position"].tolist() == [1, 2]
        assert r.writes["name"].tolist() == ["model.norm.weight", "model.embed_tokens.weight"]
        assert r.chunks[columns].equals(reports[0].chunks[columns])
    # Equal values, one sent under each name: each credited to the patch it is the
    # storage of, whichever comes first.
    ps = [dense("emb", torch.ones(6, 4)), dense("head", torch.ones(6, 4))]
    r = inspect_load(_TiedByName(), ps, loader=_reversed_in_one_call)
    assert r.calls["names"].tolist() == [("head", "emb")]
    assert r.writes["position"].tolist() == [1, 0]


# -- dense copies that change only part of what they write ---------------------------------
# A dense copy is compared with its source before it runs and saves only the elements it
# changes (or its whole view, when most change). The report must read the same either way.


class Views(torch.nn.Module):
    """One (6, 8) parameter; checkpoint tensor ``name`` is copied into ``self.VIEWS[name]``
    (row blocks, column blocks that are strided views, and overlapping ones)."""

    VIEWS: typing.ClassVar[dict[str, tuple[slice, slice]]] = {
        "top": (slice(0, 3), slice(None)),
        "bottom": (slice(3, 6), slice(None)),
        "left": (slice(None), slice(0, 4)),
        "middle": (slice(1, 5), slice(2, 6)),
    }

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.clone(), False)

    def load_weights(self, weights):
        for name, t in weights:
            self.w.data[self.VIEWS[name]].copy_(t)
        return {n for n, _ in weights}


def _reference(start: torch.Tensor, end: torch.Tensor, written: torch.Tensor) -> dict:
    b, a = start[written].double(), end[written].double()
    diff = bits(start[written]) != bits(end[written])
    d = (a - b).abs()[diff]
    return {
        "elements": int(written.sum()),
        "changed": int(diff.sum()),
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "mean_abs": float(d.sum()) / max(1, int(written.sum())),
        "rel_l2": float(d.square().sum().sqrt() / b.square().sum().sqrt()),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(sorted(Views.VIEWS)),
                  st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]), st.integers(0, 99)),
        min_size=1, max_size=4,
    ),
    budget=st.sampled_from([1, 10_000]),
)
def test_dense_copies_that_change_part_of_their_view_report_like_full_saves(steps, budget):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(6, 8, generator=g)
    start[0, 0] = -0.0  # a source of +0.0 here changes bits, not value
    m = Views(start)
    written = torch.zeros(6, 8, dtype=torch.bool, device="cpu")
    ps = []
    for name, frac, seed in steps:
        view = Views.VIEWS[name]
        gen = torch.Generator().manual_seed(seed)
        src = m.w.detach()[view].clone()  # the view's value when the load starts...
        change = torch.rand(src.shape, generator=gen) < frac
        src[change] = torch.randn(src.shape, generator=gen)[change]
        if name == "top":
            src[0, 0] = 0.0
        ps.append(dense(name, src))
        written[view] = True
    r = inspect_load(m, ps, max_chunk_bytes=budget)
    end = m.w.detach()
    assert torch.equal(bits(r.before("w")), bits(start))
    assert torch.equal(r.written("w"), written)
    got = r.deltas.loc["w"]
    want = _reference(start, end, written)
    assert (got["elements"], got["changed"]) == (want["elements"], want["changed"])
    for col in ("max_abs", "mean_abs"):  # float64 sums
        assert math.isclose(got[col], want[col], rel_tol=1e-9, abs_tol=1e-12), col
    # ||before|| is a float32 BLAS dot (for float32 tensors)
    assert math.isclose(got["rel_l2"], want["rel_l2"], rel_tol=1e-5)
    # Each write's count is against what the view held just before that write.
    assert r.writes["elements"].tolist() == [
        Views(start).w[Views.VIEWS[n]].numel() for n, _, _ in steps
    ]
    assert (r.writes["changed"] <= r.writes["elements"]).all()


def test_a_dense_copy_that_changes_a_few_elements_saves_only_those():
    # (views of fewer than native._WHOLE_BELOW bytes are saved whole: this one is bigger)
    g = torch.Generator().manual_seed(3)
    rows = 8192  # (the view: rows x 8 float32, 256 KiB)
    start = torch.randn(2 * rows, 8, generator=g)

    class Tall(Views):
        VIEWS: typing.ClassVar = {"top": (slice(0, rows), slice(None))}

    m = Tall(start)
    assert rows * 8 * 4 > patchkit.native._WHOLE_BELOW
    src = start[:rows].clone()
    src[1, 2] = 5.0
    src[2, 7] = -5.0
    r = inspect_load(m, [dense("top", src)])
    (saved,) = r._saved
    assert saved.whole_view and saved.before.numel() == 2
    assert r.writes["changed"].tolist() == [2] and r.writes["elements"].tolist() == [8 * rows]
    assert r.deltas.loc["w", "elements"] == 8 * rows and r.deltas.loc["w", "changed"] == 2
    assert torch.equal(r.before("w"), start)
    written = torch.zeros(2 * rows, 8, dtype=torch.bool, device="cpu")
    written[:rows] = True
    want = _reference(start, m.w.detach(), written)
    for col in ("max_abs", "mean_abs", "rel_l2"):
        assert math.isclose(r.deltas.loc["w", col], want[col], rel_tol=1e-5), col


def test_a_failed_transactional_dense_load_restores_partly_changed_views():
    class Fails(Views):
        def load_weights(self, weights):
            super().load_weights(weights)
            raise RuntimeError("after the copies")

    g = torch.Generator().manual_seed(4)
    start = torch.randn(6, 8, generator=g)
    m = Fails(start)
    top = start[:3].clone()
    top[0, 1] = 9.0
    left = start[:, :4].clone()
    left[5, 3] = -9.0
    try:
        inspect_load(m, [dense("top", top), dense("left", left)], transactional=True)
    except RuntimeError as exc:
        assert "after the copies" in str(exc)
    else:
        raise AssertionError("the loader's error must propagate")
    assert torch.equal(bits(m.w.detach()), bits(start))


def test_tables_are_built_on_first_read_with_the_numbers_of_the_load_end():
    m = Packed()
    r = inspect_load(m, [sparse("k", (4, 4), [0, 5], [50.0, 60.0])])
    assert not any(k.startswith("_frame_") for k in vars(r))  # no pandas work yet
    with torch.no_grad():
        m.qkv.add_(1.0)  # the model moves on before anyone looks at the report
    assert r.deltas.loc["qkv", "changed"] == 2
    assert r.deltas.loc["qkv", "elements"] == 2
    assert r.deltas is r.deltas  # built once, then kept
    assert r.writes["changed"].tolist() == [2]
    assert {k for k in vars(r) if k.startswith("_frame_")} == {"_frame_deltas", "_frame_writes"}


class OneTensor(torch.nn.Module):
    """``w``; ``load_weights`` copies each tensor into it whole, optionally through a
    view of another dtype of the same size (``through``)."""

    def __init__(self, w: torch.Tensor, through: torch.dtype | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.clone(), False)
        self.through = through

    def load_weights(self, weights):
        for _, t in weights:
            if self.through is None:
                self.w.data.copy_(t)
            else:
                self.w.data.view(self.through).copy_(t.view(self.through))
        return {n for n, _ in weights}


def _direct_rel_l2(b: torch.Tensor, a: torch.Tensor) -> float:
    b, a = b.double(), a.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_rel_l2_when_a_few_small_elements_become_large(dtype):
    # ||before|| must not come from ||after||^2 - ||changed after||^2 + ...: with two huge
    # new values among small ones that difference cancels (and once went negative).
    # (more than native._WHOLE_BELOW bytes, so that only the changed elements are saved)
    w = torch.ones(65536, dtype=dtype, device="cpu")
    if dtype.is_floating_point:
        w *= 1e-3
    new = w.clone()
    new[:6] = 2**31 - 1 if dtype == torch.int32 else 2e4
    r = inspect_load(OneTensor(w), [dense("w", new)])
    assert r._saved[0].whole_view  # the changed-only save
    assert math.isclose(r.deltas.loc["w", "rel_l2"], _direct_rel_l2(w, new), rel_tol=1e-9)


def test_bfloat16_differences_near_the_top_of_the_range_do_not_overflow():
    w = torch.tensor([3e38, 1.0, 2.0, 3.0], device="cpu").to(torch.bfloat16)
    new = w.clone()
    new[0] = -new[0]
    r = inspect_load(OneTensor(w), [dense("w", new)])
    d = 2 * float(w[0])
    assert math.isclose(r.deltas.loc["w", "max_abs"], d, rel_tol=1e-12)
    assert math.isclose(r.deltas.loc["w", "mean_abs"], d / 4, rel_tol=1e-12)
    assert math.isclose(r.deltas.loc["w", "rel_l2"], _direct_rel_l2(w, new), rel_tol=1e-9)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_write_through_a_reinterpreting_view_is_reported_in_the_tensors_dtype(compiled):
    # (the torch-ops path keeps the int32 view's changed elements: they are read as
    # float32, the tensor's dtype, not as integers)
    from patchkit import native

    w = torch.tensor([1.5, -2.25, 3.0, 0.5, 7.0, 8.0, 9.0, 10.0], device="cpu")
    new = w.clone()
    new[2] = 100.0
    m = OneTensor(w, through=torch.int32)
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(m, [dense("w", new)])
    assert torch.equal(r.before("w"), w)
    assert r.deltas.loc["w", "max_abs"] == 97.0 and r.deltas.loc["w", "changed"] == 1
    # ||before|| too is of the float32 values, not of their bits read as int32
    assert math.isclose(r.deltas.loc["w", "rel_l2"], _direct_rel_l2(w, new), rel_tol=1e-9)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_non_finite_old_value_adds_nothing_to_before_norm_of_a_compared_copy(compiled):
    # (the docstring: "a non-finite old value in ||before||" counts as 0; torch ops sum
    # the squares of the view before the copy, and sum them again without it when the
    # first sum is not finite)
    from patchkit import native

    w = torch.tensor([1.5, float("inf"), 3.0, 0.5, 7.0, float("nan"), 9.0, 10.0])
    new = w.clone()
    new[2] = 100.0
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(OneTensor(w), [dense("w", new)])
    finite = w[torch.isfinite(w)].double()
    assert r.deltas.loc["w", "changed"] == 1
    assert math.isclose(r.deltas.loc["w", "rel_l2"], 97.0 / float(finite.norm()),
                        rel_tol=1e-9)


def test_a_report_of_no_patches_has_every_table_with_its_columns_and_no_rows():
    r = inspect_load(Packed(), [])
    expected = {
        "chunks": ["chunk", "position", "name", "kind", "shape", "dtype", "numel", "nnz",
                   "density", "bytes", "closed_by", "note"],
        "calls": ["chunk", "names", "returned", "writes", "seconds", "error"],
        "writes": ["chunk", "position", "name", "checkpoint_offset", "checkpoint_region",
                   "target", "target_offset", "target_region", "shape", "elements",
                   "written", "changed", "op", "checkpoint_stride", "target_stride"],
        "deltas": ["elements", "changed", "max_abs", "mean_abs", "rel_l2"],
    }
    for table, columns in expected.items():
        frame = getattr(r, table)
        assert list(frame.columns) == columns, table
        assert len(frame) == 0, table
    assert r.deltas.index.name == "target"
    assert str(r.chunks["chunk"].dtype) == "Int64"
    assert str(r.writes["position"].dtype) == "Int64"
    assert list(patch_summary([]).columns) == [
        "position", "name", "kind", "shape", "dtype", "numel", "nnz", "density",
        "wire_bytes", "staged_bytes"]
    # The same column types as the tables of a load that wrote: per-step tables of a
    # training loop concatenate without turning numbers into objects.
    full = inspect_load(Packed(), [dense("norm", torch.full((4,), 2.0)),
                                   dense("k", torch.zeros(4, 4))], max_chunk_bytes=64)
    for table in expected:
        empty, rows = getattr(r, table), getattr(full, table)
        assert len(rows) > 0, table
        assert dict(empty.dtypes) == dict(rows.dtypes), table
    assert dict(patch_summary([]).dtypes) == dict(patch_summary(full.patches).dtypes)


# -- what a demanding user met (review of the inspection helpers) --------------------------


def _staged(p):
    """A patch staged as the contract stages it: dense values, or NaN where sparse keeps."""
    if p.indices is None:
        return p.values.to(p.dtype).reshape(p.shape)
    t = torch.full(p.shape, float("nan"), dtype=p.dtype)
    t.view(-1)[p.indices.long()] = p.values.to(p.dtype)
    return t


def one_per_call_loader(model, patches, **kwargs):
    """A foreign loader, written for these tests, that sends each patch in a call of its
    own, whatever the budget, and does no NaN-merging of its own."""
    names = set()
    for p in patches:
        names |= set(model.load_weights([(p.name, _staged(p))]) or ())
    return names


def test_an_observed_loader_that_chunks_otherwise_is_reported_call_by_call():
    ps = [dense("a", torch.ones(4, 4)), dense("b", torch.full((4,), 2.0)),
          dense("a", torch.full((4, 4), 3.0))]
    m = PlainModel({"a": (4, 4), "b": (4,)})
    r = inspect_load(m, ps, loader=one_per_call_loader)
    # patchkit's plan would send [a, b] then [a]: the table shows the three real calls.
    assert r.calls["names"].tolist() == [("a",), ("b",), ("a",)]
    assert r.chunks["chunk"].tolist() == [0, 1, 2]
    assert r.chunks["closed_by"].tolist() == ["loader", "loader", "end"]
    assert [c.positions for c in r.plan] == [(0,), (1,), (2,)]
    # each write is credited to the patch that fed it: the second a is position 2
    assert r.writes["position"].tolist() == [0, 1, 2]
    assert r.writes["checkpoint_offset"].tolist() == [0, 0, 0]
    assert (m.a == 3).all()
    # A loader that follows the contract's walk keeps patchkit's plan and its reasons.
    r = inspect_load(PlainModel({"a": (4, 4), "b": (4,)}), ps, max_chunk_bytes=64,
                     loader=one_per_call_loader)
    assert r.chunks["closed_by"].tolist() == ["budget", "budget", "end"]
    assert r.plan == plan_chunks(ps, 64)


def test_observing_many_calls_compares_each_with_the_plan_once(monkeypatch):
    # each call compared every call so far with the plan: 8000 calls took 5.9 s
    import patchkit.inspect as pi

    looked = []
    as_planned = pi._as_planned

    def counted(calls, plan, complete=False):
        looked.append(len(calls))
        return as_planned(calls, plan, complete)

    monkeypatch.setattr(pi, "_as_planned", counted)
    ps = [dense("a", torch.full((4,), float(i))) for i in range(200)]
    r = inspect_load(PlainModel({"a": (4,)}), ps, loader=patchkit.load_checkpoint_weight_patches)
    assert len(r.calls) == 200 and r.chunks["closed_by"].tolist()[:2] == ["repeated name"] * 2
    assert sum(looked) <= 2 * len(ps), looked[:5]


def test_an_observed_sparse_load_reports_what_patchkits_own_load_reports():
    p = sparse("a", (100,), [7], [5.0])
    ours_model = PlainModel({"a": (100,)}, fill=1.0)
    theirs_model = PlainModel({"a": (100,)}, fill=1.0)
    ours = inspect_load(ours_model, [p])
    # patchkit's own loader, observed: its NaN-merge runs below the observer
    theirs = inspect_load(theirs_model, [p], loader=patchkit.load_checkpoint_weight_patches)
    assert torch.equal(theirs_model.a, ours_model.a)
    for r in (ours, theirs):
        assert r.deltas.loc["a"].to_dict() == {
            "elements": 1, "changed": 1, "max_abs": 4.0, "mean_abs": 4.0, "rel_l2": 4.0}
        assert int(r.written("a").sum()) == 1
        assert r.writes[["elements", "written", "changed"]].values.tolist() == [[100, 1, 1]]
        assert torch.equal(r.before("a"), torch.ones(100))


def test_an_observed_loader_that_copies_the_nan_mask_into_the_model_is_named():
    p = sparse("a", (10,), [2, 5], [5.0, 6.0])
    m = PlainModel({"a": (10,)}, fill=1.0)
    with pytest.raises(ContractViolation, match="NaN-masked sparse patch") as info:
        inspect_load(m, [p], loader=one_per_call_loader)
    exc = info.value
    assert (exc.reason, exc.value, exc.position, exc.name) == ("NaN copied", 8, 0, "a")
    assert torch.isnan(m.a).sum() == 8  # the observer changed nothing: the loader did it
    assert exc.report.error is exc and exc.report.calls["error"].tolist() == [False]


def test_an_observed_call_of_sparse_and_dense_patches_copies_the_dense_one_plainly():
    # (a foreign loader may send both kinds in one call: the call's copies are then
    # NaN-checked, but a dense patch's own NaN is a value it writes, not a "keep")
    def all_in_one(model, patches, **kwargs):
        return set(model.load_weights([(p.name, _staged(p)) for p in patches]) or ())

    class MergesSparse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.ones(4), requires_grad=False)
            self.b = torch.nn.Parameter(torch.ones(4), requires_grad=False)

        def load_weights(self, weights):
            for n, t in weights:
                own = getattr(self, n)
                own.copy_(torch.where(t.isnan(), own, t) if n == "a" else t)
            return {n for n, _ in weights}

    m = MergesSparse()
    ps = [sparse("a", (4,), [1], [5.0]), dense("b", torch.tensor([1.0, math.nan, 3.0, 4.0]))]
    r = inspect_load(m, ps, loader=all_in_one)
    assert r.calls["names"].tolist() == [("a", "b")]
    assert r.writes[["name", "written", "changed"]].values.tolist() == [["a", 4, 1], ["b", 4, 3]]
    assert m.a.tolist() == [1.0, 5.0, 1.0, 1.0]
    assert torch.equal(bits(m.b.detach()), bits(torch.tensor([1.0, math.nan, 3.0, 4.0])))


def test_an_observed_loader_staging_sparse_patches_in_a_generator_is_checked_the_same():
    # (entries of a generator are taken as the model reads them: a sparse one among them
    # makes the call's copies NaN-checked, as a list's does from the start)
    def generator_loader(model, patches, **kwargs):
        return set(model.load_weights((p.name, _staged(p)) for p in patches) or ())

    p = sparse("a", (10,), [2, 5], [5.0, 6.0])
    m = PlainModel({"a": (10,)}, fill=1.0)
    with pytest.raises(ContractViolation, match="NaN-masked sparse patch") as info:
        inspect_load(m, [p], loader=generator_loader)
    assert (info.value.reason, info.value.value, info.value.position) == ("NaN copied", 8, 0)
    assert torch.isnan(m.a).sum() == 8


def test_an_observed_loader_that_copies_a_nan_mask_it_rebuilt_into_the_model_is_named():
    # A source rebuilt from the staged tensor where torch does not see it (through numpy)
    # is traced to no patch, but holds its NaN: the copy is taken for the NaN-merge it
    # should have been, and the NaN it copied are found.
    class Rebuilds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.ones(10), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.a.data.copy_(torch.from_numpy(t.numpy().copy()))
            return {n for n, _ in weights}

    m = Rebuilds()
    with pytest.raises(ContractViolation, match="NaN-masked sparse patch") as info:
        inspect_load(m, [sparse("a", (10,), [2, 5], [5.0, 6.0])], loader=one_per_call_loader)
    assert (info.value.reason, info.value.value) == ("NaN copied", 8)
    assert torch.isnan(m.a).sum() == 8


def test_a_failed_load_says_what_stayed_loaded_and_what_was_never_sent():
    ps = [dense("a", torch.ones(4)), dense("b", torch.ones(4)), dense("c", torch.ones(4))]
    with pytest.raises(RuntimeError) as info:
        inspect_load(FailingModel({"a": (4,), "b": (4,), "c": (4,)}, fail_on="b"), ps,
                     max_chunk_bytes=16)
    r = info.value.report
    assert r.loaded == {"a"} and not r.rolled_back
    assert r.chunks["note"].tolist() == ["", "", "not sent: the load stopped in call 1"]
    assert r.summary()["error"].startswith("RuntimeError: ")
    assert "rolled back" not in r.summary()
    with pytest.raises(RuntimeError) as info:
        inspect_load(FailingModel({"a": (4,), "b": (4,), "c": (4,)}, fail_on="b"), ps,
                     max_chunk_bytes=16, transactional=True)
    r = info.value.report
    assert r.loaded == set() and r.rolled_back and r.summary()["rolled back"] is True
    assert "rolled back=True" in repr(r)


def test_a_rejected_mixed_load_is_summarised_as_mixed():
    ps = [dense("q", torch.ones(4, 4)), sparse("k", (4, 4), [1], [5.0])]
    with pytest.raises(ValueError, match="mixed") as info:
        inspect_load(Packed(), ps)
    s = info.value.report.summary()
    assert s["kind"] == "mixed"
    assert s["error"].startswith("PatchValueError: patch 1 ('k'): dense and sparse")


def test_a_long_report_prints_its_first_rows_and_says_how_many_more():
    m = PlainModel({f"w{i}": (2,) for i in range(50)})
    r = inspect_load(m, [dense(f"w{i}", torch.full((2,), float(i + 1))) for i in range(50)])
    text = repr(r)
    assert text.count("more rows") == 2 and "... 30 more rows" in text
    assert len(text.splitlines()) < 60
    r = inspect_load(m, [dense(f"w{i}", torch.zeros(2)) for i in range(40)])
    assert "more rows" not in repr(r)  # up to 40 rows a table prints whole


def test_reports_compare_by_identity():
    m = Packed()
    r1 = inspect_load(m, [dense("norm", torch.ones(4))])
    r2 = inspect_load(m, [dense("norm", torch.ones(4))])
    assert r1 == r1 and r1 != r2 and r2 in [r1, r2]
    assert len({r1, r2}) == 2


def test_bad_arguments_raise_type_errors_that_say_what_was_given():
    p = dense("w", torch.ones(2))
    for model in (None, torch.nn.Linear(2, 2)):
        for loader in (None, patchkit.load_checkpoint_weight_patches):
            with pytest.raises(TypeError, match="load_weights"):
                inspect_load(model, [p], loader=loader)
    with pytest.raises(TypeError, match=r"loader must be a callable.*int"):
        inspect_load(Packed(), [p], loader=3)
    r = inspect_load(Packed(), [dense("norm", torch.ones(4))])
    with pytest.raises(TypeError, match="int: 0"):
        r.plot_density(0)
    with pytest.raises(KeyError, match="some are: 'norm'"):
        r.plot_density("nope")
    with pytest.raises(PatchTypeError) as info:
        patch_summary([p, 3])
    assert (info.value.position, info.value.reason) == (1, "not a patch")


# -- writes through a view of another element size ----------------------------------------


class PackedFp8(torch.nn.Module):
    """fp8 values kept four to an int32 word, written through ``.view(float8)``."""

    def __init__(self):
        super().__init__()
        self.packed = torch.nn.Parameter(torch.zeros(8, 3, dtype=torch.int32),
                                         requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            if n != "packed":
                raise KeyError(n)
            self.packed.data.view(torch.float8_e4m3fn).copy_(w.to(torch.float8_e4m3fn))
        return {n for n, _ in weights}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_write_through_a_view_of_another_element_size_is_reported_in_its_own_elements(kind):
    m = PackedFp8()
    g = torch.Generator().manual_seed(0)
    start = torch.randn(96, generator=g).bfloat16()
    patchkit.load_checkpoint_weight_patches(
        m, [CheckpointWeightPatch("packed", (8, 12), torch.bfloat16, start)])
    before = m.packed.detach().clone()
    idx, vals = torch.tensor([0, 13, 95]), torch.tensor([3.0, -2.0, 5.0]).bfloat16()
    if kind == "sparse":
        p = CheckpointWeightPatch("packed", (8, 12), torch.bfloat16, vals, idx)
    else:
        full = before.view(torch.float8_e4m3fn).to(torch.bfloat16).reshape(-1).clone()
        full[idx] = vals
        p = CheckpointWeightPatch("packed", (8, 12), torch.bfloat16, full)
    r = inspect_load(m, [p])
    changed_words = int((before != m.packed).sum())
    assert changed_words == 3
    w = r.writes.iloc[0]
    assert (w["target"], w["target_offset"], w["elements"]) == ("packed", 0, 24)
    assert w["written"] == (3 if kind == "sparse" else 24)
    assert r.deltas.loc["packed", "changed"] == changed_words
    assert r.deltas.loc["packed", "elements"] == (3 if kind == "sparse" else 24)
    assert torch.equal(r.before("packed"), before)
    assert int(r.written("packed").sum()) == (3 if kind == "sparse" else 24)


def test_a_sparse_write_of_several_bytes_of_one_word_counts_the_word_once():
    # Entries 0, 1 and 2 are three fp8 bytes of int32 word 0, entry 13 a byte of word 3:
    # the merge writes two of the tensor's own elements, not four.
    m = PackedFp8()
    before = m.packed.detach().clone()
    idx, vals = torch.tensor([0, 1, 2, 13]), torch.tensor([3.0, -2.0, 5.0, 1.0]).bfloat16()
    r = inspect_load(m, [CheckpointWeightPatch("packed", (8, 12), torch.bfloat16, vals, idx)])
    assert int((before != m.packed).sum()) == 2
    assert r.writes.iloc[0]["written"] == 2
    assert r.deltas.loc["packed", "elements"] == 2
    assert int(r.written("packed").sum()) == 2
    assert torch.equal(r.before("packed"), before)


class Float4(torch.nn.Module):
    """A float4_e2m1fn_x2 buffer (two fp4 numbers a byte, which torch reads no numbers
    from) next to a float32 one."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("a", torch.zeros(4))
        self.register_buffer("w", torch.full((n,), 0x22, dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2))

    def load_weights(self, weights):
        for n, w in weights:
            getattr(self, n).copy_(w)
        return {n for n, _ in weights}


@pytest.mark.parametrize("path", ["compiled", "torch ops", "device passes"])
@pytest.mark.parametrize("n", [6, 300_000])
@needs_fp4_copy
def test_a_report_of_a_packed_dtype_counts_its_changes_and_has_no_numbers(n, path):
    from patchkit import native
    from patchkit.bitwise import device_passes

    fp4 = torch.float4_e2m1fn_x2
    new = torch.full((n,), 0x22, dtype=torch.uint8)
    new[1::3] = 0x13  # a third of the bytes change
    m = Float4(n)
    ps = [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4)),
          CheckpointWeightPatch("w", (n,), fp4, new.view(fp4))]
    paths = {"compiled": contextlib.nullcontext, "torch ops": native.disabled,
             "device passes": device_passes}
    with paths[path]():
        r = inspect_load(m, ps, max_chunk_bytes=16)  # (was: a raw NotImplementedError, half loaded)
    assert torch.equal(m.w.view(torch.uint8), new)
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"]) == (n, len(range(1, n, 3)))
    assert all(math.isnan(row[c]) for c in ("max_abs", "mean_abs", "rel_l2"))
    assert r.deltas.loc["a", "max_abs"] == 1.0  # the float32 neighbour keeps its numbers
    assert bool((r.before("w").view(torch.uint8) == 0x22).all())
    assert int(r.writes.set_index("target").loc["w", "changed"]) == len(range(1, n, 3))
    with pytest.raises(ValueError, match="'w' is float4_e2m1fn_x2, a packed dtype"):
        r.plot_delta("w")


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_rollback_restores_a_write_through_a_view_of_another_element_size(kind):
    m = PackedFp8()
    before = m.packed.detach().clone()
    if kind == "sparse":
        ps = [CheckpointWeightPatch(n, (8, 12), torch.bfloat16, torch.tensor([3.0]).bfloat16(),
                                    torch.tensor([5])) for n in ("packed", "boom")]
    else:
        ones = torch.ones(96, dtype=torch.bfloat16)
        ps = [CheckpointWeightPatch(n, (8, 12), torch.bfloat16, ones) for n in ("packed", "boom")]
    with pytest.raises(KeyError):
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True)
    assert torch.equal(m.packed, before)


def test_a_rollback_restores_a_sparse_write_through_a_half_width_view():
    # bfloat16 element 5 is the upper half of float32 element 2 (not 5 // 4 = 1: the
    # offset is taken in bytes before it is divided by the runtime element's size)
    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(5)),
                                        requires_grad=False)

        def load_weights(self, weights):
            for n, t in weights:
                if n != "w":
                    raise KeyError(n)
                self.w.data.view(torch.bfloat16).copy_(t)
            return {n for n, _ in weights}

    ps = [CheckpointWeightPatch(n, (16,), torch.bfloat16, torch.tensor([3.0]).bfloat16(),
                                torch.tensor([5])) for n in ("w", "boom")]
    m = Halves()
    before = m.w.detach().clone()
    with pytest.raises(KeyError):
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True)
    assert torch.equal(bits(m.w.detach()), bits(before))
    r = inspect_load(Halves(), ps[:1])
    assert r.writes["written"].tolist() == [1] and r.deltas.loc["w", "changed"] == 1
    assert torch.equal(bits(r.before("w")), bits(before))


# -- a dense call that rebinds, an empty load (a differential audit) -----------------------


def _rebinding(kind):
    class Rebinds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(6.0).view(2, 3), False)

        def load_weights(self, weights):
            for _, t in weights:
                if kind == "data":
                    self.w.data = t.clone()
                elif kind == "staged":
                    self.w.data = t  # the staged tensor itself: its patch is named
                else:
                    self.w = torch.nn.Parameter(t.clone(), False)
            return {n for n, _ in weights}

    return Rebinds()


@pytest.mark.parametrize("kind", ["data", "staged", "new parameter"])
def test_a_dense_call_that_rebinds_is_reported_as_a_write_of_the_whole_tensor(kind):
    m = _rebinding(kind)
    r = inspect_load(m, [dense("w", torch.tensor([0.0, 1.0, 7.0, 7.0, 7.0, 7.0]).view(2, 3))])
    now = dict(m.named_parameters())["w"].detach()
    assert now.flatten().tolist() == [0.0, 1.0, 7.0, 7.0, 7.0, 7.0]
    assert r.before("w").flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert torch.equal(r.after("w"), now)
    assert r.written("w").all()
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"]) == (6, 4)
    assert row["max_abs"] == 5.0 and row["mean_abs"] == pytest.approx((5 + 4 + 3 + 2) / 6)
    # ||after - before|| / ||before||, before being the original tensor 0..5
    assert row["rel_l2"] == pytest.approx(math.sqrt((25 + 16 + 9 + 4) / 55))
    (w,) = r.writes.itertuples()
    assert (w.op, w.target, w.elements, w.changed) == ("rebind", "w", 6, 4)
    if kind == "staged":
        assert (w.position, w.name) == (0, "w")


def test_a_tensor_rebound_to_another_shape_counts_every_new_element_as_changed():
    # another tensor altogether: its deltas row counts the new tensor's 12 elements,
    # every one changed (not the original's 6), and has no element-wise numbers
    class Grows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(6.0).view(2, 3), False)

        def load_weights(self, weights):
            for _ in weights:
                self.w.data = torch.ones(3, 4)
            return {n for n, _ in weights}

    r = inspect_load(Grows(), [dense("w", torch.zeros(2, 3))])
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"]) == (12, 12)
    assert all(math.isnan(row[c]) for c in ("max_abs", "mean_abs", "rel_l2"))
    assert r.summary()["elements changed"] == 12


def test_rebinding_inside_a_transactional_report_is_still_undone():
    m = _rebinding("new parameter")
    original = m.w
    plain = m.load_weights

    def then_fails(weights):
        plain(list(weights))
        raise RuntimeError("after the rebinding")

    m.load_weights = then_fails
    with pytest.raises(RuntimeError) as info:
        inspect_load(m, [dense("w", torch.full((2, 3), 9.0))], transactional=True)
    assert m.w is original and m.w.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert info.value.report.rolled_back


def test_an_empty_load_reports_the_model_s_tensors():
    m = PlainModel({"w": (2, 3)})
    r = inspect_load(m, [])
    assert r.targets == {"w": (2, 3)}
    assert torch.equal(r.before("w"), torch.zeros(2, 3))
    assert torch.equal(r.after("w"), torch.zeros(2, 3))
    with pytest.raises(ValueError) as info:  # rejected before any call
        inspect_load(m, [CheckpointWeightPatch("w", (2, 3), torch.float32, torch.ones(5))])
    assert info.value.report.targets == {"w": (2, 3)}


def test_statistics_of_parameters_that_require_grad_build_no_graph(recwarn):
    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3, bias=False)

        def load_weights(self, ws):
            for _, w in ws:
                self.lin.weight.copy_(w)  # the Parameter itself, under the load's no_grad
            return {n for n, _ in ws}

    with patchkit.native.disabled():  # the torch-ops statistics
        r = inspect_load(Lin(), [dense("lin.weight", torch.ones(3, 4))])
    assert r.deltas.loc["lin.weight", "elements"] == 12
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]


def test_a_recorded_call_on_a_gpu_is_timed_between_two_device_waits(monkeypatch):
    # CUDA copies run after their launch returns: calls.seconds waits for the devices
    # before and after each call (here a stand-in device, as this test runs on the CPU)
    from patchkit import intercept
    from patchkit.toymodels import PlainModel

    events = []
    fake = torch.device("cuda", 3)
    monkeypatch.setattr(intercept.WriteSession, "_gpus", lambda self, staged: {fake})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: events.append(("sync", d)))

    class Logged(PlainModel):
        def load_weights(self, weights):
            events.append("call")
            return super().load_weights(weights)

    m = Logged({"a": (4,), "b": (4,)})
    ps = [CheckpointWeightPatch(n, (4,), torch.float32, torch.ones(4)) for n in "ab"]
    r = patchkit.inspect_load(m, ps, max_chunk_bytes=16)
    assert events == [("sync", fake), "call", ("sync", fake)] * 2
    assert len(r.calls) == 2
    events.clear()
    patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=16)
    assert events == ["call", "call"]  # a plain load times nothing, waits for nothing


class _ThroughView(torch.nn.Module):
    """One weight its loader writes through a view of another dtype of the same size
    (``overlap``: rows 0-29 first, then rows 20-49, which meet the first write)."""

    def __init__(self, dtype, view, overlap):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = (torch.rand(50, 40, generator=g) < 0.5 if dtype == torch.bool
             else torch.randn(50, 40, generator=g).to(dtype))
        self.w = torch.nn.Parameter(w, requires_grad=False)
        self.view, self.overlap = view, overlap

    def load_weights(self, weights):
        for _, src in weights:
            src = src.view(50, 40)
            if self.overlap:
                for rows in (slice(0, 30), slice(20, 50)):
                    self.w.data[rows].view(self.view).copy_(src[rows].view(self.view))
            else:
                self.w.data.view(self.view).copy_(src.view(self.view))
        return {"w"}


@pytest.mark.parametrize("overlap", [False, True], ids=["once", "overlapping"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize(("dtype", "view"), [(torch.complex64, torch.int64),
                                             (torch.complex64, torch.float64),
                                             (torch.bool, torch.int8)], ids=str)
def test_before_of_a_weight_written_through_a_view_of_another_dtype(dtype, view, compiled,
                                                                    overlap):
    # saved in the view's dtype, the values were put back as the weight's bits: before()
    # raised (complex64 through int64: bits of shape [n, 2] against [n]; bool through int8)
    import contextlib

    from patchkit import native

    model = _ThroughView(dtype, view, overlap)
    old = model.w.detach().clone()
    new = old.clone().reshape(-1)
    new[::7] = ~new[::7] if dtype == torch.bool else new[::7] * 2 + 1
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(model, [CheckpointWeightPatch("w", (50, 40), dtype, new)])
    assert patchkit.same_bits(r.before("w"), old)
    assert patchkit.same_bits(r.after("w"), new.view(50, 40))
    want = int(patchkit.bitwise.changed_mask(old, new.view(50, 40)).sum())
    assert r.deltas.loc["w", "changed"] == want > 0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_an_observed_loader_that_rolls_back_unseen_shows_no_change_left(compiled):
    # patchkit's own loader, observed, restores outside any interception when it fails:
    # the compiled path's numbers, measured while writing, showed 4096 changes still there
    import contextlib

    from patchkit import native

    model = FailingModel({"a": (64, 64), "b": (8,)}, fail_on="b")
    patches = [CheckpointWeightPatch("a", (64, 64), torch.float32, torch.ones(4096)),
               CheckpointWeightPatch("b", (8,), torch.float32, torch.ones(8))]
    with contextlib.nullcontext() if compiled else native.disabled(), \
            pytest.raises(RuntimeError) as info:
        inspect_load(model, patches, transactional=True,
                     loader=patchkit.load_checkpoint_weight_patches)
    r = info.value.report
    assert float(model.a.abs().sum()) == 0.0  # the observed loader rolled back
    # ... and the report says so, as patchkit's own rollback reads: no change left
    assert r.rolled_back and list(r.deltas.index) == [] and r.loaded == set()
    assert r.writes["changed"].tolist()[0] == 4096  # what the write itself did


class _SliceThenFails(torch.nn.Module):
    """Copies each tensor into a slice of a parameter that requires grad (a view taken
    under the loader's ``no_grad``); its second call raises."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("second call fails")
        for _, t in weights:
            self.w[:2].copy_(t)
        return {n for n, _ in weights}


@pytest.mark.parametrize("transactional", [True, False])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_failed_observed_load_into_a_slice_of_a_parameter_keeps_its_error(kind,
                                                                            transactional):
    # reading what the observed calls left ran with grad mode on: torch refused to view
    # the saved slice again ("A view was created in no_grad mode ..."), and that error
    # replaced the loader's, with no report attached
    p = (dense("w", torch.tensor([1.0, 2.0])) if kind == "dense"
         else sparse("w", (2,), [0], [1.0]))
    model = _SliceThenFails()
    with pytest.raises(RuntimeError, match="second call fails") as info:
        inspect_load(model, [p, p], transactional=transactional,
                     loader=patchkit.load_checkpoint_weight_patches)
    r = info.value.report
    assert r.rolled_back == transactional
    if transactional:
        assert model.w.detach().tolist() == [0.0, 0.0, 0.0, 0.0]
        assert len(r.deltas) == 0
    else:
        assert model.w.detach().tolist()[0] == 1.0
        assert r.deltas.loc["w", "changed"] == (2 if kind == "dense" else 1)


def _undoes_only(undo):
    """A foreign loader: one call per patch; when a call raises, it writes back the values
    from before the load of the weights named in ``undo`` (unseen: outside the calls) and
    raises again."""
    def loader(model, patches, **kwargs):
        old = {n: model.get_parameter(n).detach().clone() for n in undo}
        names = set()
        try:
            for p in patches:
                names |= set(model.load_weights([(p.name, _staged(p))]) or ())
        except RuntimeError:
            for n, t in old.items():
                model.get_parameter(n).data.copy_(t)
            raise
        return names
    return loader


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_an_observed_loader_that_rolls_back_and_raises_is_reported_rolled_back(compiled):
    # the report said rolled_back=False and loaded=['a', 'b'], with deltas rows and
    # written elements for a and b, though the observed loader had restored them
    import contextlib

    from patchkit import native

    shapes = {"a": (4, 4), "b": (8,), "c": (4, 4)}
    ps = [dense(n, torch.ones(s)) for n, s in shapes.items()]
    ps.insert(1, dense("a", torch.full((4, 4), 2.0)))  # a written twice: saves overlap
    reports = {}
    for loader in (None, patchkit.load_checkpoint_weight_patches):
        model = FailingModel(shapes, fail_on="c")
        with contextlib.nullcontext() if compiled else native.disabled(), \
                pytest.raises(RuntimeError) as info:
            inspect_load(model, ps, transactional=True, max_chunk_bytes=1, loader=loader)
        assert all(float(t.abs().sum()) == 0 for t in model.parameters())
        reports[loader] = info.value.report
    for r in reports.values():
        assert r.rolled_back and r.summary()["rolled back"] is True
        assert r.loaded == set() and len(r.deltas) == 0
        assert int(r.written("a").sum()) == int(r.written("b").sum()) == 0
        assert r.writes["target"].tolist() == ["a", "a", "b"]  # what the load did
    # A loader that undoes a only: b stays loaded, as after an incomplete rollback.
    model = FailingModel(shapes, fail_on="c")
    with pytest.raises(RuntimeError) as info:
        inspect_load(model, ps, max_chunk_bytes=1, loader=_undoes_only(["a"]))
    r = info.value.report
    assert float(model.a.abs().sum()) == 0 and (model.b == 1).all()
    assert not r.rolled_back and r.loaded == {"b"}
    assert list(r.deltas.index) == ["b"] and r.deltas.loc["b", "changed"] == 8
    assert int(r.written("a").sum()) == 0 and int(r.written("b").sum()) == 8
    # One that undoes nothing: everything it wrote stays loaded.
    model = FailingModel(shapes, fail_on="c")
    with pytest.raises(RuntimeError) as info:
        inspect_load(model, ps, max_chunk_bytes=1, loader=_undoes_only([]))
    r = info.value.report
    assert not r.rolled_back and r.loaded == {"a", "b"}
    assert list(r.deltas.index) == ["a", "b"]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_failed_load_keeps_the_runtime_names_a_vllm_style_loader_returned(compiled):
    # TinyLlamaRuntime returns runtime names (qkv_proj for q_proj), as vLLM's loaders do.
    # After a failure that an observed loader partly undid, the report kept only the names
    # that were also patch names: qkv_proj and gate_up_proj of every layer were dropped.
    from patchkit import native
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    class FailsAtNorm(TinyLlamaRuntime):
        def load_weights(self, weights):
            out = set()
            for name, w in weights:
                if name == "model.norm.weight":
                    raise RuntimeError("simulated failure")
                out |= super().load_weights([(name, w)])
            return out

    config = TinyLlamaConfig()
    ckpt = tiny_llama_checkpoint(config, seed=3)
    ps = patchkit.dense_patches(ckpt)
    undone = "model.layers.0.self_attn.qkv_proj.weight"
    with contextlib.nullcontext() if compiled else native.disabled():
        r = _failed_report(FailsAtNorm(config, tp_size=2), ps, loader=_undoes_only([undone]))
        own = _failed_report(FailsAtNorm(config, tp_size=2), ps)
    sent = list(ckpt)[: list(ckpt).index("model.norm.weight")]
    packed = {n.replace(".q_proj.", ".qkv_proj.").replace(".k_proj.", ".qkv_proj.")
              .replace(".v_proj.", ".qkv_proj.").replace(".gate_proj.", ".gate_up_proj.")
              .replace(".up_proj.", ".gate_up_proj.") for n in sent}
    assert "model.layers.1.self_attn.qkv_proj.weight" in packed
    assert not r.rolled_back and r.loaded == packed - {undone}
    assert own.loaded == packed  # (no rollback, nothing undone: every returned name)
    assert undone not in r.deltas.index and undone in own.deltas.index


def _failed_report(model, ps, **kw):
    with pytest.raises(RuntimeError) as info:
        inspect_load(model, ps, max_chunk_bytes=1, **kw)
    return info.value.report


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_failed_observed_load_whose_own_writes_put_a_target_back_is_no_rollback(compiled):
    # a written 0 -> 1, then back to 0 by the load's own later write: observed, the report
    # took a for undone by the loader (loaded=[], no deltas row, nothing written()), though
    # no rollback happened and the load itself reports it loaded
    from patchkit import native

    shapes = {"a": (4,), "b": (4,), "d": (4,), "c": (4,)}
    ps = [dense("a", torch.ones(4)), dense("a", torch.zeros(4)), dense("b", torch.ones(4)),
          dense("d", torch.ones(4)), dense("c", torch.ones(4))]  # FailingModel raises at c
    with contextlib.nullcontext() if compiled else native.disabled():
        reports = [_failed_report(FailingModel(shapes, fail_on="c"), ps, loader=loader)
                   for loader in (None, patchkit.load_checkpoint_weight_patches,
                                  _undoes_only([]))]
        # A loader that undoes b (unseen) undid b only: a, put back by the load's own
        # write, keeps its saves, as d does.
        model = FailingModel(shapes, fail_on="c")
        partial = _failed_report(model, ps, loader=_undoes_only(["b"]))
    for r in reports:
        assert not r.rolled_back and r.loaded == {"a", "b", "d"}
        assert list(r.deltas.index) == ["a", "b", "d"]
        assert r.deltas.loc["a", "elements"] == 4 and r.deltas.loc["a", "changed"] == 0
        assert r.written("a").tolist() == [True] * 4
    assert float(model.b.abs().sum()) == 0 and (model.d == 1).all()
    assert not partial.rolled_back and partial.loaded == {"a", "d"}
    assert list(partial.deltas.index) == ["a", "d"]
    assert partial.written("a").tolist() == [True] * 4
    assert partial.written("b").tolist() == [False] * 4
    # A real rollback is still read as one, the target put back by its own writes too.
    for loader in (None, patchkit.load_checkpoint_weight_patches):
        model = FailingModel(shapes, fail_on="c")
        with contextlib.nullcontext() if compiled else native.disabled():
            r = _failed_report(model, ps, loader=loader, transactional=True)
        assert all(float(t.abs().sum()) == 0 for t in model.parameters())
        assert r.rolled_back and r.loaded == set() and len(r.deltas) == 0
        assert r.written("a").tolist() == r.written("b").tolist() == [False] * 4


class _RebindsThenFails(PlainModel):
    """Copies into ``a`` then rebinds its ``.data`` to three times the weight; raises at
    the weight ``z``."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            p = self.get_parameter(name)
            p.data.copy_(w)
            p.data = w.clone() * 3
        return {n for n, _ in weights}


def _catching(model, patches, **kw):
    """A loader that runs patchkit's transactional load and swallows its error: the
    rollback happens, unseen by a report that observes it, and the load returns."""
    try:
        return patchkit.load_checkpoint_weight_patches(model, patches, transactional=True)
    except RuntimeError:
        return set()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("case", ["returns", "rebinds"])
def test_an_observed_loader_that_rolls_back_unseen_and_returns_or_rebinds(compiled, case):
    # the numbers measured while writing were dropped only when the observed load raised:
    # one that caught its error showed the rolled-back changes (compiled path); a rebinding
    # the rollback put back stayed in the report (every path)
    import contextlib

    from patchkit import native

    ctx = contextlib.nullcontext() if compiled else native.disabled()
    z = CheckpointWeightPatch("z", (4,), torch.float32, torch.ones(4))
    a = CheckpointWeightPatch("a", (64, 64), torch.float32, torch.ones(4096))
    if case == "returns":
        model = FailingModel({"a": (64, 64), "z": (4,)}, fail_on="z")
        with ctx:
            r = inspect_load(model, [a, z], loader=_catching)
    else:
        model = _RebindsThenFails({"a": (64, 64), "z": (4,)})
        with ctx, pytest.raises(RuntimeError, match="no z today") as info:
            inspect_load(model, [a, z], transactional=True,
                         loader=patchkit.load_checkpoint_weight_patches,
                         max_chunk_bytes=4096 * 4)
        r = info.value.report
    assert float(model.a.abs().sum()) == 0.0  # rolled back
    assert patchkit.same_bits(r.after("a"), model.a.detach())
    if case == "returns":
        assert r.deltas.loc["a", "changed"] == 0 and r.deltas.loc["a", "max_abs"] == 0.0
    else:  # (raised: read as patchkit's own rollback, which leaves no deltas row)
        assert r.rolled_back and list(r.deltas.index) == []


class _IntoTheParameter(PlainModel):
    """``param.copy_(w)`` (not ``param.data``): what torch refuses for an inference tensor
    outside inference mode."""

    def load_weights(self, weights):
        for name, w in weights:
            p = self.get_parameter(name)
            p.copy_(w.view(p.shape))
        return {n for n, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_refused_write_that_changed_nothing_is_not_a_row_of_the_report(compiled):
    # torch refuses ``param.copy_`` into an inference tensor after copying; a copy of the
    # values the parameter already holds changed nothing, so the load wrote nothing.
    import contextlib

    from patchkit import native

    with torch.inference_mode():
        model = _IntoTheParameter({"a": (4, 4)})
    patches = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.zeros(16))]
    with (contextlib.nullcontext() if compiled else native.disabled(),
          pytest.raises(RuntimeError, match="Inplace update to inference tensor") as e):
        inspect_load(model, patches)
    assert len(e.value.report.writes) == 0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_inference_tensors_written_outside_inference_mode_are_refused_as_torch_refuses(
    compiled,
):
    # the compiled path wrote into the parameter (outside torch) where torch raises; a
    # write through ``.data``, which torch allows, is still recorded and rolled back
    import contextlib

    from patchkit import native

    patches = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.ones(16))]
    with contextlib.nullcontext() if compiled else native.disabled():
        with torch.inference_mode():
            model = _IntoTheParameter({"a": (4, 4)})
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            patchkit.load_checkpoint_weight_patches(model, patches)
        with torch.inference_mode():
            model = _IntoTheParameter({"a": (4, 4)})
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            inspect_load(model, patches)
        with torch.inference_mode():
            model = _IntoTheParameter({"a": (4, 4)})
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            patchkit.load_checkpoint_weight_patches(model, patches, transactional=True)
        assert float(model.a.abs().sum()) == 0.0  # rolled back (in inference mode)
        with torch.inference_mode():
            model = FailingModel({"a": (4, 4), "z": (1,)}, fail_on="z")  # param.data
        r = inspect_load(model, patches)
        assert r.deltas.loc["a", "changed"] == 16
        z = CheckpointWeightPatch("z", (1,), torch.float32, torch.ones(1))
        with pytest.raises(RuntimeError, match="z"):
            patchkit.load_checkpoint_weight_patches(
                model, [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.full((16,), 2.0)),
                        z], transactional=True, max_chunk_bytes=64)
        assert torch.equal(model.a, torch.ones(4, 4))  # rolled back to the first load's


class _WritesInferenceTensors(PlainModel):
    """Writes an inference Parameter outside inference mode in one of four ways, each of
    which torch makes and then refuses (it raises when it moves the version counter)."""

    def __init__(self, how: str) -> None:
        with torch.inference_mode():
            super().__init__({"w": (4, 4)})
        self.how = how

    def load_weights(self, weights):
        for _, t in weights:
            t = t.view(4, 4)
            if self.how == "copy":
                self.w.copy_(t)
            elif self.how == "broadcast":
                self.w.copy_(t[0])
            elif self.how == "second":  # .data is allowed; the second write is not
                self.w.data.copy_(t)
                self.w.copy_(t * 2)
            elif self.how == "second broadcast":  # (the first write saved the region)
                self.w.data.copy_(t[0])
                self.w.copy_(t[0] * 2)
            else:
                self.w[1].copy_(t[1])
        return {n for n, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("how", ["copy", "broadcast", "second", "second broadcast", "row"])
def test_a_write_torch_makes_and_then_refuses_has_its_row(how, compiled):
    # the write stays in the model and in ``deltas``; ``writes`` had no row for it (the
    # op raised before it was recorded), so the summary said 0 runtime writes
    import contextlib

    from patchkit import native

    patch = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.arange(1.0, 17.0))
    values = patch.values.view(4, 4)
    expected = {"copy": values, "broadcast": values[0].expand(4, 4), "second": values * 2,
                "second broadcast": values[0].expand(4, 4) * 2,
                "row": torch.zeros(4, 4).index_copy(0, torch.tensor([1]), values[1:2])}[how]
    # ("second broadcast": the refused write goes into a region an earlier write of the
    # load saved, so it has no save of its own; it still has its row and its count)
    rows = {"copy": [16], "broadcast": [16], "second": [16, 16], "second broadcast": [16, 16],
            "row": [4]}[how]
    with contextlib.nullcontext() if compiled else native.disabled():
        for transactional in (False, True):
            model = _WritesInferenceTensors(how)
            with pytest.raises(RuntimeError, match="Inplace update to inference tensor") as info:
                inspect_load(model, [patch], transactional=transactional)
            r = info.value.report
            assert r.writes["changed"].tolist() == rows
            assert r.writes["target"].tolist() == ["w"] * len(rows)
            assert r.summary()["runtime writes"] == len(rows)
            if transactional:
                assert float(model.w.abs().sum()) == 0.0  # rolled back
                # (written back in inference mode: outside it, torch writes the values
                # back and then raises, and the rollback said it had left them)
                assert r.rolled_back and "rollback incomplete" not in str(info.value)
            else:
                assert torch.equal(model.w, expected)
                assert r.deltas.loc["w", "changed"] == int((expected != 0).sum())
                assert patchkit.same_bits(r.after("w"), expected)


class _CatchesTheRefusal(_WritesInferenceTensors):
    """``_WritesInferenceTensors``, catching the error torch raises after it wrote."""

    def load_weights(self, weights):
        with contextlib.suppress(RuntimeError):
            super().load_weights(weights)
        return {n for n, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("how", ["copy", "broadcast"])
def test_a_call_whose_only_write_torch_refused_after_writing_is_no_quiet_call(how, compiled):
    # the write stays in the model, so the call wrote what a mode saw: it is not one of
    # the calls "with no write seen" (which would tell the reader that it wrote nothing
    # or wrote where patchkit does not watch)
    from patchkit import native

    patch = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.arange(1.0, 17.0))
    with contextlib.nullcontext() if compiled else native.disabled():
        model = _CatchesTheRefusal(how)
        r = inspect_load(model, [patch])
    assert r.error is None and r.writes["changed"].tolist() == [16]
    assert "calls with no write seen" not in r.summary()
    assert float(model.w.abs().sum()) > 0  # (the write stayed)


def test_a_foreach_copy_torch_refuses_forgets_the_save_of_each_target_it_left_unchanged():
    # torch._foreach_copy_ writes its targets in turn and raises at one of another shape:
    # a target it wrote with the values it held is no write of the load, whichever
    # target it is (the saves of one op are several, that target's not the last).
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
            self.b = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                with contextlib.suppress(RuntimeError):  # (b: 5 elements for 4)
                    torch._foreach_copy_([self.a.data, self.b.data],
                                         [torch.zeros(3), torch.ones(5)])
                self.b.data.copy_(t)
            return {n for n, _ in weights}

    r = inspect_load(M(), [CheckpointWeightPatch("b", (4,), torch.float32, torch.ones(4))])
    assert not bool(r.written("a").any())
    assert "a" not in r.deltas.index and r.deltas.loc["b", "changed"] == 4


def test_a_compared_copy_that_fails_before_its_save_is_no_write(monkeypatch):
    # Through torch ops a copy is compared with its source, then saved, then done: one
    # that fails while comparing (out of memory, say) wrote nothing, and the save of an
    # earlier write is not taken for its own (which changed elements it never wrote).
    from patchkit import intercept, native

    real, armed = intercept.count_true, []

    def count_true(x):
        if armed:
            armed.clear()
            raise MemoryError("no memory left to compare")
        return real(x)

    monkeypatch.setattr(intercept, "count_true", count_true)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                if name == "again":
                    armed.append(True)
                    self.w.data.copy_(t.view(4, 4) * 2)
                else:
                    self.w.data.copy_(t.view(4, 4))
            return {n for n, _ in weights}

    m = M()
    m.again = torch.nn.Parameter(torch.zeros(16), requires_grad=False)
    ps = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.arange(1.0, 17.0)),
          CheckpointWeightPatch("again", (16,), torch.float32, torch.arange(1.0, 17.0))]
    with native.disabled(), pytest.raises(MemoryError, match="no memory left") as info:
        inspect_load(m, ps, max_chunk_bytes=64)  # (a call each)
    r = info.value.report
    assert r.writes["target"].tolist() == ["w"] and r.writes["changed"].tolist() == [16]
    assert r.summary()["runtime writes"] == 1


def test_a_complex_write_torch_makes_and_then_refuses_counts_elements_not_parts():
    # (a complex element's bits are two numbers: one that changes in both parts is one
    # changed element, as the report counts every other write)
    class W(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.inference_mode():
                self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64), False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t)
            return {n for n, _ in weights}

    values = torch.tensor([1 + 1j, 0, 2j, 3], dtype=torch.complex64)
    patch = CheckpointWeightPatch("w", (4,), torch.complex64, values)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor") as info:
        inspect_load(W(), [patch])
    assert info.value.report.writes["changed"].tolist() == [3]


class _TriesThenFallsBack(torch.nn.Module):
    """Tries a write that torch refuses before writing (a ``copy_`` of another shape, an
    ``index_copy_`` of another dtype), catches the error and copies ``rows`` only."""

    def __init__(self, how: str, rows: int = 1) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.how = how
        self.rows = rows

    def load_weights(self, weights):
        for name, t in weights:
            if name == "z":
                raise RuntimeError("no z today")
            try:
                if self.how == "shape":
                    self.w.data.copy_(t.reshape(3, 4))
                else:
                    self.w.data.index_copy_(0, torch.arange(4), t.double())
            except RuntimeError:
                self.w.data[:self.rows].copy_(t[:self.rows].double())  # (a cast)
        return {n for n, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("how", ["shape", "index_copy"])
def test_a_write_torch_refuses_before_writing_counts_no_elements(how, compiled):
    # the refused op's save stayed: ``deltas`` said 12 elements written and
    # ``written()`` marked the whole tensor, where the load wrote row 0 alone (its one
    # ``writes`` row, 3 elements)
    from patchkit import native

    patch = CheckpointWeightPatch("w", (4, 3), torch.float32, torch.ones(12))
    with contextlib.nullcontext() if compiled else native.disabled():
        model = _TriesThenFallsBack(how)
        r = inspect_load(model, [patch])
        assert r.writes["written"].tolist() == [3]
        assert r.deltas.loc["w", ["elements", "changed"]].tolist() == [3, 3]
        expected = torch.zeros(4, 3, dtype=torch.bool)
        expected[0] = True
        assert torch.equal(r.written("w"), expected)
        assert torch.equal(r.before("w"), torch.zeros(4, 3))
        # the region the refused op saved (the whole tensor) is saved again by the next
        # write into it, which a rollback puts back
        model = _TriesThenFallsBack(how, rows=4)
        z = CheckpointWeightPatch("z", (1,), torch.float32, torch.ones(1))
        with pytest.raises(RuntimeError, match="no z today") as info:
            inspect_load(model, [patch, z], transactional=True, max_chunk_bytes=48)
        assert info.value.report.rolled_back
        assert torch.equal(model.w, torch.zeros(4, 3))


class _RegistersAnewThenFails(PlainModel):
    """Registers a new Parameter for ``a`` (three times the weight); raises at ``z``."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            self.a = torch.nn.Parameter(w.clone().view(4, 4) * 3, requires_grad=False)
        return {n for n, _ in weights}


@pytest.mark.parametrize("observed", [False, True], ids=["own", "observed"])
def test_a_failed_load_keeps_a_tensor_registered_anew_in_its_report(observed):
    # after the load failed, the report checked its rebindings against the tensors the
    # index was built with, took the new Parameter for the original one and dropped it
    model = _RegistersAnewThenFails({"a": (4, 4), "z": (1,)})
    patches = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.ones(16)),
               CheckpointWeightPatch("z", (1,), torch.float32, torch.ones(1))]
    kw = {"loader": patchkit.load_checkpoint_weight_patches} if observed else {}
    with pytest.raises(RuntimeError, match="no z today") as info:
        inspect_load(model, patches, max_chunk_bytes=64, **kw)
    r = info.value.report
    assert float(model.a.sum()) == 48.0
    assert float(r.after("a").sum()) == 48.0 and list(r.deltas.index) == ["a"]
    assert r.deltas.loc["a", "changed"] == 16


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference-made"])
def test_a_rolled_back_rebinding_is_not_in_the_report_of_the_own_loader(inference):
    # patchkit's own transactional rollback bound the original tensor again, but the
    # report still showed the rebound one (after() three times the weight, 4096 changed);
    # a model made in inference mode crashed the report at the rebinding
    if inference:
        with torch.inference_mode():
            model = _RebindsThenFails({"a": (64, 64), "z": (4,)})
    else:
        model = _RebindsThenFails({"a": (64, 64), "z": (4,)})
    patches = [CheckpointWeightPatch("a", (64, 64), torch.float32, torch.ones(4096)),
               CheckpointWeightPatch("z", (4,), torch.float32, torch.ones(4))]
    with pytest.raises(RuntimeError, match="no z today") as info:
        inspect_load(model, patches, transactional=True, max_chunk_bytes=4096 * 4)
    r = info.value.report
    assert r.rolled_back and float(model.a.abs().sum()) == 0.0
    assert patchkit.same_bits(r.after("a"), model.a.detach())
    assert "a" not in r.deltas.index or r.deltas.loc["a", "changed"] == 0


class _RebindsAndBindsBack(PlainModel):
    """Call with ``a``: rebinds ``a.data`` to three times the weight; call with ``b``: binds
    ``a``'s original tensor back (and writes nothing into ``b``)."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "a":
                self._original = self.a.data
                self.a.data = w.clone().view(4, 4) * 3
            else:
                self.a.data = self._original
        return {n for n, _ in weights}


class _TransposesAnewThenFails(PlainModel):
    """Copies into ``a``, registers a new Parameter on its storage, transposed; raises at
    ``z``."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            self.a.data.copy_(w.view(4, 4))
            self.a = torch.nn.Parameter(self.a.data.t(), requires_grad=False)
        return {n for n, _ in weights}


@pytest.mark.parametrize("observed", [False, True], ids=["own", "observed"])
def test_the_report_follows_rebindings_the_loader_undid_or_made_on_the_same_storage(observed):
    # a rebinding the loader itself undid stayed in the report (after() three times the
    # weight, 16 changed); a new Parameter on the original storage, transposed, was taken
    # for the original one after a failed load (after() untransposed)
    kw = {"loader": patchkit.load_checkpoint_weight_patches} if observed else {}
    model = _RebindsAndBindsBack({"a": (4, 4), "b": (4, 4)})
    patches = [CheckpointWeightPatch(n, (4, 4), torch.float32, torch.full((16,), 1.0))
               for n in ("a", "b")]
    r = inspect_load(model, patches, max_chunk_bytes=64, **kw)
    assert patchkit.same_bits(r.after("a"), model.a.detach())
    assert "a" not in r.deltas.index or r.deltas.loc["a", "changed"] == 0

    model = _TransposesAnewThenFails({"a": (4, 4), "z": (1,)})
    patches = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.arange(16.0)),
               CheckpointWeightPatch("z", (1,), torch.float32, torch.ones(1))]
    with pytest.raises(RuntimeError, match="no z today") as info:
        inspect_load(model, patches, max_chunk_bytes=64, **kw)
    assert patchkit.same_bits(info.value.report.after("a"), model.a.detach())


def test_a_loader_with_vllms_signature_is_observed_without_transactional():
    # (vLLM's function takes max_chunk_bytes and validate_unique_indices, no transactional)
    def vllm_signature(model, patches, *, max_chunk_bytes=512 << 20,
                       validate_unique_indices=True):
        return patchkit.load_checkpoint_weight_patches(
            model, patches, max_chunk_bytes=max_chunk_bytes,
            validate_unique_indices=validate_unique_indices)

    ps = [sparse("q", (4, 4), [0, 7], [1.5, -2.0]), dense("norm", torch.ones(4) * 3)]
    ours_model, theirs_model = Packed(), Packed()
    ours = inspect_load(ours_model, ps[:1], max_chunk_bytes=128)
    theirs = inspect_load(theirs_model, ps[:1], max_chunk_bytes=128, loader=vllm_signature)
    assert theirs.error is None
    assert theirs.deltas["changed"].to_dict() == ours.deltas["changed"].to_dict()
    before = bits(theirs_model.qkv.detach()).clone()
    with pytest.raises(PatchTypeError, match="takes no transactional argument") as e:
        inspect_load(theirs_model, ps[1:], transactional=True, loader=vllm_signature)
    assert e.value.reason == "loader not transactional"
    assert torch.equal(bits(theirs_model.qkv.detach()), before)  # nothing ran
    assert float(theirs_model.norm[0]) == 1.0


def test_write_offsets_count_row_major_and_strides_are_the_views_in_memory():
    # What the writes table's docstring says the two columns are: for a row-major target
    # they rebuild the written view; for a transposed one the offset still counts its own
    # indexing and target_region names the box.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(4, 6).t(), requires_grad=False)
            self.q = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)

        def load_weights(self, weights):
            for n, w in weights:
                getattr(self, n).data[2:5, 1:2].copy_(w[2:5, 1:2])
            return {n for n, _ in weights}

    patches = [CheckpointWeightPatch(n, (6, 4), torch.float32, torch.arange(24.0) + 1)
               for n in ("p", "q")]
    m = M()
    r = inspect_load(m, patches)
    rows = r.writes.set_index("target")
    for n in ("p", "q"):
        t = getattr(m, n).detach()
        assert int(rows.loc[n, "target_offset"]) == 9  # [2, 1] of a (6, 4) tensor
        assert t.flatten()[9] == 10.0 and rows.loc[n, "target_region"] == "[2:5, 1:2]"
        assert rows.loc[n, "target_stride"] == t[2:5, 1:2].stride()
    q = rows.loc["q"]
    view = m.q.detach().view(-1).as_strided(q["shape"], q["target_stride"],
                                            int(q["target_offset"]))
    assert view.flatten().tolist() == [10.0, 14.0, 18.0]


def test_a_broadcast_copy_names_the_checkpoint_region_it_read_not_the_target_view():
    # copy_ broadcasts one row of the patch over every row of the target: the
    # checkpoint_region is that row of the checkpoint tensor (the source's own shape and
    # strides), while the target side is the whole (4, 6) view it wrote.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t.view(3, 6)[1])
            return {n for n, _ in weights}

    r = inspect_load(M(), [CheckpointWeightPatch("w", (3, 6), torch.float32,
                                                 torch.arange(18.0))])
    row = r.writes.iloc[0]
    assert (int(row["checkpoint_offset"]), row["checkpoint_region"]) == (6, "[1:2, :]")
    assert row["checkpoint_stride"] == (1,)
    assert (row["target_region"], row["shape"], row["elements"]) == ("[:, :]", (4, 6), 24)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_element_changed_in_both_parts_counts_once_in_writes(dtype):
    # writes.changed counted the real and the imaginary part of each element: 32 of 16.
    m = PlainModel({"z": (4, 4)}, dtype=dtype)
    new = torch.full((16,), 1 + 1j, dtype=dtype)
    new[:3] = 0  # (3 unchanged)
    r = inspect_load(m, [CheckpointWeightPatch("z", (4, 4), dtype, new)])
    row = r.writes.iloc[0]
    assert (row["elements"], row["written"], row["changed"]) == (16, 16, 13)
    assert int(r.deltas.loc["z", "changed"]) == 13


def test_the_text_repr_writes_small_deltas_as_numbers_not_zero():
    m = PlainModel({"w": (4, 4)})
    m.load_weights([("w", torch.ones(4, 4))])
    r = inspect_load(m, [CheckpointWeightPatch("w", (4, 4), torch.float32,
                                               torch.ones(16) + 3e-7)])
    text = repr(r).split("deltas:")[1]
    assert "3.576e-07" in text and " 0.0 " not in text


class _FlatBesideViews(torch.nn.Module):
    """A flat buffer registered beside two parameters that are views of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("flat", torch.arange(12.0))
        self.a = torch.nn.Parameter(self.flat[:6].view(2, 3))
        self.b = torch.nn.Parameter(self.flat[6:].view(3, 2))

    def load_weights(self, weights):
        for name, t in weights:
            getattr(self, name).copy_(t)
        return {n for n, _ in weights}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_write_of_a_flat_buffer_is_the_buffers_not_the_parameter_at_its_start(kind):
    # the write of all of flat was given to a, the first tensor holding its first element:
    # target "a", target_region "12 elements from 0" of a 6-element tensor (and the one
    # element a sparse patch wrote, which lies in b, counted as a's)
    ps = ([dense("a", torch.full((2, 3), 7.0)), dense("flat", torch.ones(12))]
          if kind == "dense" else
          [sparse("a", (2, 3), [0, 5], [7.0, 7.0]), sparse("flat", (12,), [7], [9.0])])
    r = inspect_load(_FlatBesideViews(), ps, max_chunk_bytes=1)
    rows = r.writes[["target", "target_region", "elements", "written"]].values.tolist()
    assert rows == [["a", "[:, :]", 6, 6 if kind == "dense" else 2],
                    ["flat", "[:]", 12, 12 if kind == "dense" else 1]]
    # (each tensor's deltas count the elements of it written, as before)
    assert r.deltas["elements"].to_dict() == (
        {"a": 6, "flat": 12, "b": 6} if kind == "dense" else {"a": 2, "flat": 3, "b": 1})


class _RebindsThenCopies(torch.nn.Module):
    """Call of "new" rebinds ``w`` to a copy of its tensor; call of "half" copies into the
    first two elements of the (new) data."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def load_weights(self, weights):
        for name, t in weights:
            if name == "new":
                self.w.data = t.clone()
            else:
                self.w[:2].copy_(t)
        return {n for n, _ in weights}


def test_writes_into_rebound_data_are_the_rebind_rows_and_deltas_see_them():
    # (documented: the report watches the storages the model held when the load began;
    # the rebind row stands for later writes into the new data, and deltas compare the
    # tensor as it ends with the original)
    model = _RebindsThenCopies()
    r = inspect_load(model, [dense("new", torch.ones(4)), dense("half", torch.full((2,), 5.0))],
                     max_chunk_bytes=16)
    assert r.writes[["chunk", "name", "target", "op"]].values.tolist() == [
        [0, "new", "w", "rebind"]]
    assert r.calls["writes"].tolist() == [1, 0]
    assert r.summary()["calls with no write seen"] == [1]
    assert model.w.detach().tolist() == [5.0, 5.0, 1.0, 1.0]
    assert r.before("w").tolist() == [0.0] * 4
    assert r.written("w").tolist() == [True] * 4
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"], row["max_abs"], row["mean_abs"]) == (4, 4, 5.0, 3.0)


class _NoStr(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be written")


def test_a_report_whose_error_cannot_be_written_still_renders():
    # (summary(), both reprs and the pickle raised the RuntimeError of the error's __str__)
    class Refuses(PlainModel):
        def load_weights(self, weights):
            raise _NoStr()

    with pytest.raises(_NoStr) as info:
        inspect_load(Refuses({"w": (2,)}), [dense("w", torch.ones(2))])
    report = info.value.report
    assert report.summary()["error"] == "_NoStr: <exception str() failed>"
    assert "error=_NoStr: <exception str() failed>" in repr(report)
    assert "_NoStr: &lt;exception str() failed&gt;" in report._repr_html_()
    assert pickle.loads(pickle.dumps(report)).summary() == report.summary()


class _StrNotStr(Exception):
    def __str__(self):
        return None  # (str() of it raises TypeError: __str__ returned non-string)


def test_a_report_shows_any_error_its_error_s_str_raises_but_lets_an_interrupt_through():
    # (an exception whose __str__ fails in a way other than a RuntimeError is written as
    # Python's traceback writes it too; a KeyboardInterrupt or SystemExit raised there is
    # no failure to write the error, it stops the program)
    class Refuses(PlainModel):
        def load_weights(self, weights):
            raise self.error

    model = Refuses({"w": (2,)})
    model.error = _StrNotStr()
    with pytest.raises(_StrNotStr) as info:
        inspect_load(model, [dense("w", torch.ones(2))])
    report = info.value.report
    assert report.summary()["error"] == "_StrNotStr: <exception str() failed>"
    assert "error=_StrNotStr: <exception str() failed>" in repr(report)

    class Interrupts(Exception):
        def __str__(self):
            raise KeyboardInterrupt

    model.error = Interrupts()
    with pytest.raises(Interrupts) as info:
        inspect_load(model, [dense("w", torch.ones(2))])
    with pytest.raises(KeyboardInterrupt):
        info.value.report.summary()


def test_a_report_of_a_load_refused_for_an_item_that_is_no_patch_names_an_unknown_target():
    # (after()/before()/written() of a name not in the model raised AttributeError: 'str'
    # object has no attribute 'name', reading the report's patches for a hint)
    with pytest.raises(PatchTypeError) as info:
        inspect_load(PlainModel({"w": (2,)}), [dense("w", torch.ones(2)), "junk"])
    report = info.value.report
    for read in (report.after, report.before, report.written):
        with pytest.raises(KeyError, match="'zz' is not a runtime tensor of this report "
                                           r"\(some are: 'w'\)"):
            read("zz")
    # (plot_density's hint listed the item as None: "some are: 'w', None")
    with pytest.raises(KeyError, match=r"no patch named 'zz' in this report \(some are: 'w'\)$"):
        report.plot_density("zz")


def test_a_name_asked_of_a_report_that_knows_none_says_so():
    # (the hints read "(some are: )": a list of nothing)
    report = inspect_load(PlainModel({}), [])
    with pytest.raises(KeyError, match=r"'w' is not a runtime tensor of this report \(it "
                                       "knows none: the model had no parameters or buffers"):
        report.after("w")
    with pytest.raises(KeyError, match=r"no patch named 'w' in this report \(it has no "
                                       r"patches\)"):
        report.plot_density("w")


# -- what the reprs and summary() promise (mutation testing of the rendering) -------------


def test_the_headline_numbers_count_what_the_load_did():
    # (mutation testing: the kind of a load of no patches given as "dense", and
    # max_chunk_bytes given as the default budget, passed every test; so did bytes
    # written as plain numbers in the repr)
    ps = [dense("a", torch.ones(4)), dense("a", torch.full((4,), 2.0)),
          dense("b", torch.tensor([0.0, 0.0, 1.0, 1.0])), dense("c", torch.ones(4)),
          dense("d", torch.ones(4))]
    with pytest.raises(RuntimeError) as info:
        inspect_load(FailingModel({n: (4,) for n in "abcd"}, fail_on="c"), ps,
                     max_chunk_bytes=16)
    r = info.value.report
    s = r.summary()
    # one call a patch; c's call raised and d's never ran: its bytes are not staged ones
    assert s == {"patches": 5, "kind": "dense", "load_weights calls": 4, "staged bytes": 64,
                 "max_chunk_bytes": 16, "runtime writes": 3, "elements written": 8,
                 "elements changed": 6, "names loaded": 2, "error": s["error"]}
    assert "staged bytes=64 B, max_chunk_bytes=16 B, runtime writes=3" in " ".join(
        repr(r).split())  # (the headline's lines joined)
    assert "<td>64 B</td>" in r._repr_html_()
    assert inspect_load(PlainModel({}), []).summary()["kind"] is None


@pytest.mark.parametrize(("message", "shown"), [
    ("\n  disk gone\nsee the log", "RuntimeError: disk gone"),
    ("x" * 300, "RuntimeError: " + "x" * 145 + "…"),
    ("", "RuntimeError"), (" \n ", "RuntimeError"),  # (no message: the type alone)
])
def test_a_reports_error_is_the_first_line_of_its_message_cut_to_160_characters(message,
                                                                                  shown):
    class Refuses(PlainModel):
        def load_weights(self, weights):
            raise RuntimeError(message)

    with pytest.raises(RuntimeError) as info:
        inspect_load(Refuses({"w": (2,)}), [dense("w", torch.ones(2))])
    report = info.value.report
    assert report.summary()["error"] == shown and len(shown) <= 160
    # (the headline's lines joined: the long message is broken inside its word)
    assert f"error={shown}" in repr(report).replace("\n    ", "")


class _Quiet(PlainModel):
    """Returns the names it is sent and writes nothing."""

    def load_weights(self, weights):
        return [n for n, _ in weights]


@pytest.mark.parametrize(("calls", "shown"), [
    (8, "[0, 1, 2, 3, 4, 5, 6, 7]"),
    (9, "[0, 1, 2, 3, 4, 5, ..., 8] (9)"),
])
def test_reprs_show_a_list_of_up_to_eight_whole_and_a_longer_one_by_its_ends(calls, shown):
    r = inspect_load(_Quiet({"w": (4,)}),
                     [dense("w", torch.ones(4)) for _ in range(calls)])
    assert r.summary()["calls with no write seen"] == list(range(calls))
    assert f"calls with no write seen={shown}" in repr(r)
    # a load that wrote nothing has no deltas: neither repr shows an empty table
    assert "deltas" not in repr(r) and "deltas (" not in r._repr_html_()


def test_the_html_tables_show_eight_rows_without_a_row_index_and_four_digits():
    # (mutation testing: every row shown, a row index on chunks and calls, pandas' own
    # six digits, each passed every test)
    shapes = {f"row_{i:02}": (3,) for i in range(12)}
    ps = [sparse(n, (3,), [1], [1.0 / 3]) for n in shapes]
    page = inspect_load(PlainModel(shapes, fill=1.0), ps)._repr_html_()
    chunks_part = page.split("<summary>calls")[0]
    assert "row_07" in chunks_part and "row_08" not in page
    assert "<td>0.3333</td>" in chunks_part and "0.333333" not in page  # density 1/3
    calls_part = page.split("<summary>calls")[1].split("<summary>deltas")[0]
    for part in (chunks_part, calls_part):
        assert "<th></th>" not in part  # (no column of the frame's 0, 1, ... index)
    assert "<th>row_00</th>" in page  # (deltas are indexed by their runtime names)


def test_both_reprs_cut_a_cell_past_sixty_characters_to_sixty_ending_in_dots():
    whole, cut = "w" * 59 + "1", "w" * 60 + "2"
    r = inspect_load(PlainModel({whole: (2,), cut: (2,)}),
                     [dense(whole, torch.ones(2)), dense(cut, torch.ones(2))])
    for text in (r._repr_html_(), repr(r)):
        assert whole in text and "w" * 57 + "..." in text and "w" * 58 not in text.replace(
            whole, "")
    # the text repr leaves out the note column, which the table has
    assert "note" not in repr(r) and "note" in r.chunks.columns


def test_the_text_repr_writes_the_chunks_density_in_four_significant_digits():
    # it wrote the chunks table with pandas' own float format, so one tiny density put
    # the whole column in seven-digit scientific notation ('2.384186e-07' beside
    # '1.000000e+00'), where the HTML and the deltas table write 4 significant digits
    ps = [CheckpointWeightPatch("big", (4096, 1024), torch.float32, torch.tensor([1.0]),
                                torch.tensor([7])),
          CheckpointWeightPatch("small", (3,), torch.float32, torch.ones(3),
                                torch.arange(3)),
          CheckpointWeightPatch("third", (3,), torch.float32, torch.ones(1),
                                torch.tensor([1]))]
    r = inspect_load(PlainModel({"big": (4096, 1024), "small": (3,), "third": (3,)}), ps)
    # (the density in the second block of the chunks table's columns, by position)
    first, second = repr(r).split("chunks:\n")[1].split("\n\ndeltas:")[0].split("\n\n")
    names = {line.split()[1]: line.split()[2] for line in first.splitlines()[1:]}
    rows = {names[line.split()[0]]: line.split()[-3] for line in second.splitlines()[1:]}
    assert rows == {"big": "2.384e-07", "small": "1", "third": "0.3333"}
    assert r.chunks["density"][2] == 1 / 3  # (the table keeps the number as it is)


def test_a_patch_no_call_carried_has_no_chunk_and_no_closed_by():
    # (mutation testing: closed_by "" for it, beside the <NA> chunk, passed every test)
    def first_only(model, patches, **kwargs):
        first = patches[0]
        return model.load_weights([(first.name, first.values.reshape(first.shape))])

    ps = [dense("a", torch.ones(2)), dense("b", torch.ones(2))]
    r = inspect_load(PlainModel({"a": (2,), "b": (2,)}), ps, loader=first_only)
    assert r.chunks["chunk"].isna().tolist() == [False, True] and r.chunks["chunk"][0] == 0
    assert r.chunks["closed_by"][0] == "end" and r.chunks["closed_by"].isna().tolist() == [
        False, True]
    assert r.chunks["note"].tolist() == ["", "not sent by the observed loader"]


def test_the_calls_table_gives_the_returned_names_sorted_and_each_calls_seconds():
    # (mutation testing: the names in the order the loader gave them, and seconds scaled
    # to milliseconds, passed every test)
    import time

    class Slow(PlainModel):
        def load_weights(self, weights):
            weights = list(weights)
            super().load_weights(weights)
            time.sleep(0.01)
            return [n for n, _ in weights][::-1]

    start = time.perf_counter()
    r = inspect_load(Slow({"a": (2,), "b": (2,)}), [dense("a", torch.ones(2)),
                                                     dense("b", torch.ones(2))])
    took = time.perf_counter() - start
    assert r.calls["returned"].tolist() == [("a", "b")]
    assert r.calls["names"].tolist() == [("a", "b")]
    # (the call's own wall time, in seconds: within the whole inspect_load's)
    assert 0 < r.calls["seconds"].iloc[0] <= took


def test_patch_summary_gives_dtypes_without_torch_and_shapes_of_python_ints():
    # (mutation testing: "torch.float32", and the shape as given, passed every test)
    import numpy as np

    p = CheckpointWeightPatch("w", (np.int64(2), np.int64(3)), torch.bfloat16,
                              torch.ones(6, dtype=torch.bfloat16))
    df = patch_summary([dense("n", torch.ones(4)), p])
    assert df["dtype"].tolist() == ["float32", "bfloat16"]
    assert df["shape"].tolist() == [(4,), (2, 3)]
    assert all(type(d) is int for d in df["shape"][1])


def test_the_text_repr_ignores_the_callers_pandas_display_options():
    # the tables are written with to_string (every column, in blocks that fit 80
    # characters, the report's own float format), so a notebook's display settings do
    # not change what a report says
    pd = pytest.importorskip("pandas")
    m = PlainModel({"a": (4, 30), "b": (3,)})
    g = torch.Generator().manual_seed(0)
    r = inspect_load(m, [CheckpointWeightPatch("a", (4, 30), torch.float32,
                                               torch.randn(120, generator=g)),
                         CheckpointWeightPatch("b", (3,), torch.float32,
                                               torch.randn(3, generator=g))])
    plain = repr(r)
    with pd.option_context("display.width", 30, "display.max_columns", 3,
                           "display.max_colwidth", 5, "display.precision", 1,
                           "display.max_rows", 1):
        assert repr(r) == plain
    assert "closed_by" in plain and "rel_l2" in plain and "..." not in plain


# -- the text repr fits a terminal: lines of 80 characters at most --------------------------


def _shown_cell(name):
    """A name as the text repr's tables write it: plain, or its repr, cut past 60."""
    from patchkit.units import distinct_name

    text = distinct_name(name)
    return text if len(text) <= 60 else text[:57] + "..."


def _table_blocks(section):
    """The blocks of columns a table of the text repr was written in: for each, its
    header's column names and its rows (the lines after the header, and after the
    index's name line where it has one)."""
    out = []
    for block in section.split("\n\n"):
        lines = [x for x in block.splitlines() if not x.startswith("... ")]
        header, rows = lines[0].split(), lines[1:]
        if rows and rows[0].split() == ["target"]:  # (deltas: the index's name)
            rows = rows[1:]
        out.append((header, rows))
    return out


def _check_report_text(r):
    """Every line of ``repr(r)`` fits 80 columns and nothing the one-line headline and
    the whole tables said is lost: each summary item, every column of both tables, and
    each row's name and numbers."""
    from patchkit.inspect import _human

    text = repr(r)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    if r._made_by_hand():
        return text
    squeezed = "".join(text.split("\n\n")[0].split())  # (broken at blanks, or in a word)
    for k, v in r.summary().items():
        if v is not None:
            assert "".join(f"{k}={_human(k, v)}".split()) in squeezed
    chunks_part = text.split("\nchunks:\n", 1)[1].split("\n\ndeltas:\n")[0]
    rows = r.chunks.head(20) if len(r.chunks) > 40 else r.chunks
    blocks = _table_blocks(chunks_part)
    columns = [c for c in r.chunks.columns if c != "note"]
    assert all(h[0] == "position" for h, _ in blocks[1:])
    assert blocks[0][0] + [c for h, _ in blocks[1:] for c in h[1:]] == columns
    for i, row in enumerate(rows.itertuples()):
        lines = [b[i] for _, b in blocks]
        assert all(len(b) == len(rows) for _, b in blocks)
        assert _shown_cell(row.name) in lines[0]
        assert all(x.split()[0] == str(row.position) for x in lines[1:])
        cells = " ".join(lines)
        for value in (row.numel, row.nnz, row.bytes, row.dtype, row.kind, row.closed_by):
            assert str(value) in cells.split()
        assert str(row.shape) in cells
    if len(r.deltas):
        deltas_part = text.split("\n\ndeltas:\n", 1)[1]
        blocks = _table_blocks(deltas_part)
        assert [c for h, _ in blocks for c in h] == list(r.deltas.columns)
        for i, (target, row) in enumerate(r.deltas.head(40).iterrows()):
            for _, lines in blocks:
                assert lines[i].startswith(_shown_cell(target) + " ")
            cells = " ".join(b[i] for _, b in blocks).split()
            assert str(int(row["elements"])) in cells and str(int(row["changed"])) in cells
    return text


def _tiny_llama_reports():
    from patchkit.build import random_sparse_patch
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    cfg = TinyLlamaConfig()
    ckpt = tiny_llama_checkpoint(cfg, seed=0)
    full = [dense(n, t) for n, t in ckpt.items()]
    g = torch.Generator().manual_seed(0)
    sparse_ps = [random_sparse_patch(n, tuple(t.shape), t.dtype, 0.02, generator=g)
                 for n, t in ckpt.items()]
    yield "dense", inspect_load(TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2), full,
                                max_chunk_bytes=64 << 10)
    yield "sparse", inspect_load(TinyLlamaRuntime(cfg, tp_rank=1, tp_size=2), sparse_ps,
                                 max_chunk_bytes=64 << 10)
    unknown = "model.layers.0.self_attn.a_projection_this_checkpoint_does_not_have.weight"
    with pytest.raises(KeyError) as info:
        inspect_load(TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2),
                     [*full[:3], dense(unknown, torch.ones(4, 4))], max_chunk_bytes=16 << 10)
    yield "failed", info.value.report
    with torch.device("meta"):
        on_meta = TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2)
    yield "dry run", inspect_load(on_meta, full)
    yield "by hand", patchkit.LoadReport(full, plan_chunks(full, 64 << 10))


def test_the_text_repr_fits_80_columns_and_keeps_every_fact_of_a_tiny_llama_load():
    # its headline was one line of ~190 characters (350 with an error), its chunks table
    # ~120 wide: a terminal wrapped them into unreadable text
    seen = {}
    for kind, r in _tiny_llama_reports():
        seen[kind] = _check_report_text(r)
    assert seen["by hand"] == "LoadReport(<not made by inspect_load: no tables>, 21 patches)"
    assert "dry run=15 runtime tensors written on the meta device" in seen["dry run"]
    assert "\n\ndeltas:\n" not in seen["dry run"]
    for kind in ("dense", "sparse", "failed"):
        assert "\n\ndeltas:\n" in seen[kind]
    failed = seen["failed"].split("\n\n")[0]
    assert "error=UnknownWeightError: TinyLlamaRuntime.load_weights: unknown" in failed
    assert "model.layers.0.self_attn.a_projection_this_checkpoint_does_not_have" in failed
    # the chunks table in two blocks of its columns, each as wide as can be, and the
    # second opening with each row's position
    chunks = seen["dense"].split("chunks:\n")[1].split("\n\ndeltas:")[0].split("\n\n")
    assert len(chunks) == 2 and chunks[1].split()[0] == "position"


class _LoadsThenRaises(PlainModel):
    def __init__(self, shapes, message):
        super().__init__(shapes)
        self.message = message

    def load_weights(self, weights):
        super().load_weights(weights)
        if self.message is not None:
            raise RuntimeError(self.message)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    names=st.lists(st.text(st.sampled_from("ab0_ \n\u202e\\'"), min_size=1, max_size=90)
                   | st.text("wx_", min_size=150, max_size=250),
                   min_size=1, max_size=6, unique=True),
    shape=st.sampled_from([(2,), (3, 5), (1, 2, 1, 2, 1, 2, 1, 2, 1, 2)]),
    message=st.none() | st.text(st.sampled_from("ab y\u202e"), max_size=300),
)
def test_the_text_repr_of_any_names_and_error_fits_80_columns_losing_nothing(
        names, shape, message):
    m = _LoadsThenRaises({n: shape for n in names}, message)
    ps = [dense(n, torch.ones(shape)) for n in names]
    if message is None:
        r = inspect_load(m, ps)
    else:
        with pytest.raises(RuntimeError) as info:
            inspect_load(m, ps)
        r = info.value.report
    _check_report_text(r)


def test_the_html_calls_table_quotes_names_that_are_not_plain():
    # pandas writes a tuple of names unquoted: a name "a, b" read as two, and a
    # right-to-left override went into the page raw and reversed the cell. Plain names
    # keep pandas' own "(a, b)" (as the notebooks show them).
    names = ["a, b", "c\u202ed", "w"]
    report = inspect_load(PlainModel({n: (2,) for n in names}),
                          [dense(n, torch.ones(2)) for n in names])
    page = report._repr_html_()
    calls = page[page.index("<summary>calls"):]
    calls = calls[:calls.index("</details>")]
    assert calls.count("<td>('a, b', 'c\\u202ed', 'w')</td>") == 2  # names and returned
    assert "\u202e" not in page and "<td>(a, b, " not in page
    assert report.calls.names[0] == tuple(names)  # (the table keeps them as they are)
    plain = inspect_load(PlainModel({"x.w": (2,), "y": (2,)}),
                         [dense("x.w", torch.ones(2)), dense("y", torch.ones(2))])
    assert "<td>(x.w, y)</td>" in plain._repr_html_()


# -- the read paths of a report: cases no other test reaches (mutation testing) ----------


def test_a_sparse_write_of_a_flat_buffer_at_a_parameters_end_reaches_only_that_parameter():
    # flat elements 5 and 6 are a's last element and b's first: a's positions stop at
    # its 6 elements (position 6, one past its end, is b's)
    r = inspect_load(_FlatBesideViews(), [sparse("flat", (12,), [5, 6], [9.0, 8.0])])
    assert r.deltas["elements"].to_dict() == {"a": 1, "b": 1, "flat": 2}
    assert r.deltas.loc["a", "max_abs"] == 4.0 and r.deltas.loc["b", "max_abs"] == 2.0
    assert r.written("a").reshape(-1).tolist() == [False] * 5 + [True]
    assert r.written("b").reshape(-1).tolist() == [True] + [False] * 5
    assert r.before("a").reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert r.before("b").reshape(-1).tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]


class _OneByteHalves(torch.nn.Module):
    """A float8 buffer of 8; "lo" is copied into elements 0-2, "hi" into 2-4."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.zeros(8, dtype=torch.float8_e4m3fn))

    def load_weights(self, weights):
        for name, t in weights:
            (self.w[0:3] if name == "lo" else self.w[2:5]).copy_(t)
        return {n for n, _ in weights}


def test_two_writes_of_one_byte_elements_that_share_one_element_count_it_once():
    # the views' byte extents [0, 3) and [2, 5) overlap by one byte: one element
    f8 = torch.float8_e4m3fn
    ps = [CheckpointWeightPatch("lo", (3,), f8, torch.ones(3).to(f8)),
          CheckpointWeightPatch("hi", (3,), f8, torch.full((3,), 2.0).to(f8))]
    r = inspect_load(_OneByteHalves(), ps, max_chunk_bytes=1)
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"]) == (5, 5)
    assert row["mean_abs"] == pytest.approx(8.0 / 5)
    assert int(r.written("w").sum()) == 5


class _ZeroParam(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.w.copy_(t)
        return {n for n, _ in weights}


def test_rel_l2_over_a_zero_before_is_0_when_nothing_changed_and_inf_when_it_did():
    same = inspect_load(_ZeroParam(), [dense("w", torch.zeros(4))]).deltas.loc["w"]
    assert (same["elements"], same["changed"], same["rel_l2"]) == (4, 0, 0.0)
    moved = inspect_load(_ZeroParam(), [dense("w", torch.ones(4))]).deltas.loc["w"]
    assert (moved["changed"], moved["rel_l2"]) == (4, math.inf)


class _RegistersExtra(torch.nn.Module):
    """Copies "w" into ``w``; registers any other name as a new buffer (twice the
    weight)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                self.w.copy_(t)
            else:
                self.register_buffer(name, t.clone() * 2)
        return {n for n, _ in weights}


def test_a_tensor_the_load_registered_reads_as_written_whole():
    r = inspect_load(_RegistersExtra(), [dense("w", torch.ones(4)), dense("extra", torch.ones(3))])
    assert r.written("extra").tolist() == [True, True, True]
    assert r.after("extra").tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(KeyError, match="registered by the load"):
        r.before("extra")


class _RebindsToFloat64(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data = t.to(torch.float64)
        return {n for n, _ in weights}


def test_a_tensor_rebound_to_another_dtype_of_the_same_shape_has_no_element_wise_numbers():
    # (documented: another shape or dtype is another tensor altogether, every element
    # changed, NaN numbers)
    r = inspect_load(_RebindsToFloat64(), [dense("w", torch.tensor([0.0, 1.0, 0.0, 2.0]))])
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"]) == (4, 4)
    assert all(math.isnan(row[c]) for c in ("max_abs", "mean_abs", "rel_l2"))
    with pytest.raises(ValueError, match="rebound to a tensor of another dtype"):
        r.plot_delta("w")


def test_one_element_merged_twice_at_position_0_is_counted_once_with_its_oldest_before():
    # two NaN-merges of element 0 alone: their saves overlap, each a run of one position
    # (0), which a read of positions [0, n) must meet
    r = inspect_load(PlainModel({"w": (4,)}),
                     [sparse("w", (4,), [0], [5.0]), sparse("w", (4,), [0], [7.0])],
                     max_chunk_bytes=1)
    row = r.deltas.loc["w"]
    assert (row["elements"], row["changed"], row["max_abs"]) == (1, 1, 7.0)
    assert r.written("w").tolist() == [True, False, False, False]
    assert r.before("w").tolist() == [0.0] * 4


class _RowAndEveryFifth(_FlatBesideViews):
    """"a0" is copied into ``a``'s first row, "fifths" into ``flat[::5]`` (elements 0, 5
    and 10: two of ``a``'s and one of ``b``'s)."""

    def load_weights(self, weights):
        for name, t in weights:
            (self.a[0] if name == "a0" else self.flat[::5]).copy_(t)
        return {n for n, _ in weights}


def test_overlapping_writes_of_a_row_and_of_a_strided_view_past_the_tensor_count_both():
    # a's row 0 (a view written whole, within a) and flat[::5] (which reaches past a:
    # a's elements 0 and 5 are read by their offsets) overlap at element 0; the written
    # elements of a are 0, 1, 2 and 5
    ps = [dense("a0", torch.full((3,), 20.0)), dense("fifths", torch.tensor([30.0, 40.0, 50.0]))]
    r = inspect_load(_RowAndEveryFifth(), ps, max_chunk_bytes=1)
    row = r.deltas.loc["a"]
    assert (row["elements"], row["changed"], row["max_abs"]) == (4, 4, 35.0)
    assert row["mean_abs"] == pytest.approx((30.0 + 19.0 + 18.0 + 35.0) / 4)
    assert r.written("a").reshape(-1).tolist() == [True] * 3 + [False, False, True]
    assert r.before("a").reshape(-1).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_an_observed_loader_that_undoes_part_of_a_tensor_leaves_it_loaded():
    # the loader put back a's first two elements when c failed, not the other two: a is
    # still partly written, so the load is not rolled back and a stays loaded
    def undoes_half(model, patches, **kwargs):
        old = model.a.detach().clone()
        try:
            for p in patches:
                model.load_weights([(p.name, _staged(p))])
        except RuntimeError:
            model.a.data[:2].copy_(old[:2])
            raise
        return set()

    model = FailingModel({"a": (4,), "c": (4,)}, fail_on="c")
    with pytest.raises(RuntimeError) as info:
        inspect_load(model, [dense("a", torch.ones(4)), dense("c", torch.ones(4))],
                     max_chunk_bytes=1, loader=undoes_half)
    r = info.value.report
    assert model.a.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert not r.rolled_back
    assert r.deltas.loc["a", "changed"] == 2


def test_a_tensor_sharing_storage_with_one_written_at_another_element_size_is_refused():
    # A uint8 buffer of which a float32 parameter is a view: a write into the parameter
    # is saved as float32, and the buffer's reads follow saves of its own element size
    # only, so before("raw") gave the bytes as they are now and written("raw") all False,
    # without a word. Both now say the answer is not known; the parameter's own reads
    # are as before.
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("raw", torch.zeros(16, dtype=torch.uint8))
            self.f = torch.nn.Parameter(self.raw[8:].view(torch.float32),
                                        requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.f.copy_(t)
            return {n for n, _ in weights}

    import matplotlib

    matplotlib.use("Agg")
    model = Mixed()
    report = inspect_load(
        model, [CheckpointWeightPatch("f", (2,), torch.float32, torch.tensor([1.0, 2.0]))])
    assert report.before("f").tolist() == [0.0, 0.0]
    assert report.written("f").tolist() == [True, True]
    for read in (report.before, report.written, report.plot_delta):
        with pytest.raises(ValueError, match=r"'raw' \(torch.uint8\) shares its storage with "
                           r"'f', which this load wrote as torch.float32"):
            read("raw")


def test_report_plot_density_shows_a_huge_argument_cut_short():
    """``report.plot_density`` given neither a patch nor a name (a huge list) says so in a
    short message, not with the list's whole repr."""
    report = inspect_load(PlainModel({"a": (4,)}),
                          [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))])
    with pytest.raises(TypeError, match=r"^plot_density takes a patch of this report or its "
                       r"name, got list: \[0\.5, ") as e:
        report.plot_density([0.5] * 100_000)
    assert len(str(e.value)) < 300


def _forked_status(child, seconds):
    """Fork; in the child run ``child()`` and exit 0 where it returns True (1 where it
    returns anything else or raises; SIGALRM after ``seconds``, where it hangs). The
    child's exit status, as ``os.waitstatus_to_exitcode`` gives it (-14: it hung)."""
    import os
    import signal
    import warnings

    with warnings.catch_warnings():  # (3.12: "multi-threaded, use of fork()")
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        ok = False
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(seconds)  # (a child that hangs dies of it)
            ok = child() is True
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_child_forked_during_another_threads_load_has_its_collector_as_before(enabled):
    # (was: the other thread's pause never ended in the child, which has no such thread,
    # so the child ran without its cyclic collector for good, its own loads included)
    import gc
    import os
    import threading

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    inside, go = threading.Event(), threading.Event()

    class Waits(PlainModel):
        def load_weights(self, weights):
            weights = list(weights)
            inside.set()
            assert go.wait(20)
            return super().load_weights(weights)

    errors: list[BaseException] = []

    def run():
        try:
            inspect_load(Waits({"w": (4,)}), [dense("w", torch.ones(4))])
        except BaseException as exc:  # (shown by the assert below)
            errors.append(exc)

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    thread = threading.Thread(target=run)
    try:
        thread.start()
        assert inside.wait(20)
        assert not gc.isenabled()  # (paused by the thread's load)

        def child():  # (its collector as it was before, also after a report of its own)
            seen = [gc.isenabled()]
            inspect_load(PlainModel({"a": (4,)}), [dense("a", torch.ones(4))])
            seen.append(gc.isenabled())
            return seen == [enabled, enabled]

        status = _forked_status(child, 30)
    finally:
        go.set()
        thread.join(20)
        (gc.enable if was else gc.disable)()
    assert not thread.is_alive() and errors == []
    assert status == 0  # (-14: SIGALRM, it hung)


def test_a_child_forked_while_another_thread_holds_the_pause_lock_can_load():
    # (mutation testing: a child that kept the parent's pause lock, held by a thread it
    # does not have, hung in its first report; no test saw it)
    import os
    import threading

    from patchkit import loader

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    held, done = threading.Event(), threading.Event()

    def hold():
        with loader._PAUSE_LOCK:
            held.set()
            done.wait(20)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(20)

        def child():  # (its report ran)
            r = inspect_load(PlainModel({"a": (4,)}), [dense("a", torch.ones(4))])
            return int(r.deltas.loc["a", "changed"]) == 4

        status = _forked_status(child, 10)
    finally:
        done.set()
        thread.join(20)
    assert status == 0  # (-14: SIGALRM, it hung)


def test_the_text_repr_of_a_load_of_no_patches_says_its_chunks_have_no_rows():
    # (mutation testing: pandas' own text for no rows, "Empty DataFrame" and its columns
    # on one line, passed every test)
    text = repr(inspect_load(PlainModel({"a": (4,)}), []))
    assert text.endswith("\n\nchunks:\n(no rows)")
    assert max(map(len, text.splitlines())) <= 80


def test_the_text_repr_uses_the_whole_80_columns_and_breaks_only_at_blanks():
    # A line of exactly 80 stays one line, a table of exactly 80 one block, and an item
    # too long for its line breaks at a blank, not after a hyphen (mutation testing: 79
    # columns, and breaks after hyphens, passed every test)
    import pandas as pd

    from patchkit.inspect import _blocks_text, _wrapped_call

    one = _wrapped_call("LoadReport", ["a" * 30, "b" * 36])
    assert one == f"LoadReport({'a' * 30}, {'b' * 36})" and len(one) == 80
    items = ["patches=1", "error=AssertionError: " + "x" * 40
             + " alpha-beta-gamma-delta-epsilon-zeta-eta-theta-iota ok"]
    text = _wrapped_call("LoadReport", items)
    assert max(map(len, text.splitlines())) <= 80 and len(text.splitlines()) == 3
    assert " ".join(line.strip() for line in text.splitlines()) == (
        f"LoadReport({', '.join(items)})")

    def table(k):
        return pd.DataFrame({"name": ["n" * 50], "kind": ["k" * k]})

    k = next(k for k in range(1, 60)  # (kind as wide as makes the table 80 wide)
             if max(map(len, table(k).to_string(index=False).splitlines())) >= 80)
    df = table(k)
    whole = df.to_string(index=False)
    assert max(map(len, whole.splitlines())) == 80
    assert _blocks_text(df, False, None, None) == whole


class _SkipsSome(torch.nn.Module):
    """``a`` and ``b`` (4 each); the loader writes ``a``, skips ``skip`` (a weight it
    takes and leaves, as one another rank holds), writes ``cat0``+``cat1`` joined into
    ``b`` (a write traced to no one patch) and raises at ``boom``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4), False)
        self.b = torch.nn.Parameter(torch.zeros(4), False)

    def load_weights(self, weights):
        weights = dict(weights)
        if "boom" in weights:
            raise KeyError("boom")
        if "a" in weights:
            self.a.data.copy_(weights["a"])
        if "cat0" in weights:
            self.b.data.copy_(torch.cat([weights["cat0"], weights["cat1"]]))
        return {n for n in ("a", "b") if n in weights or (n == "b" and "cat0" in weights)}


def test_the_chunks_note_names_a_patch_its_call_took_and_wrote_nothing_from():
    # a loader that skips a weight (another rank's expert, say) writes nothing from it;
    # its chunks row had an empty note, like a patch that was written, and plot_density
    # drew it with no word of it
    from patchkit.inspect import NO_WRITE_NOTE

    ones = torch.ones(4)
    ps = [dense("a", ones), dense("skip", ones), sparse("skip2", (4,), [1], [2.0])]
    r = inspect_load(_SkipsSome(), ps[:2], max_chunk_bytes=1 << 20)
    assert r.chunks["note"].tolist() == ["", NO_WRITE_NOTE]
    assert NO_WRITE_NOTE.startswith("no write from it seen")
    r = inspect_load(_SkipsSome(), [ps[2]])  # (sparse too: the call returned nothing)
    assert r.chunks["note"].tolist() == [NO_WRITE_NOTE]
    assert r.calls["returned"].tolist() == [()]
    # Not where a write of the call is traced to no one patch (it may hold any of them),
    # nor in a call that raised, nor for a patch of no elements.
    halves = [dense("cat0", torch.ones(2)), dense("cat1", torch.ones(2))]
    r = inspect_load(_SkipsSome(), [*halves, dense("skip", ones)])
    assert r.writes["position"].isna().all() and len(r.writes) == 1
    assert r.chunks["note"].tolist() == ["", "", ""]
    with pytest.raises(KeyError) as info:
        inspect_load(_SkipsSome(), [dense("skip", ones), dense("boom", ones)])
    assert info.value.report.chunks["note"].tolist() == ["", ""]
    r = inspect_load(_SkipsSome(), [dense("a", ones), dense("skip", torch.ones(0))])
    assert r.chunks["note"].tolist() == ["", ""]
    # plot_density says it under the map's title
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = inspect_load(_SkipsSome(), ps[:2])
    fig = r.plot_density("skip")
    assert NO_WRITE_NOTE in fig.axes[0].get_title()
    assert "no write" not in r.plot_density("a").axes[0].get_title()
    plt.close("all")


def test_an_observed_call_given_weights_that_are_not_iterable_gets_the_models_own_error():
    # (the model's load_weights says what is wrong, not patchkit's recorder)
    class SaysSo(PlainModel):
        def load_weights(self, weights):
            if not isinstance(weights, list | tuple):
                raise ValueError(f"SaysSo.load_weights: weights must be a list, got {weights!r}")
            return super().load_weights(weights)

    def hands_over_none(model, patches, **kwargs):
        return model.load_weights(None)

    with pytest.raises(ValueError, match=r"SaysSo\.load_weights: weights must be a list, got None"):
        inspect_load(SaysSo({"w": (4,)}), [dense("w", torch.ones(4))], loader=hands_over_none)
