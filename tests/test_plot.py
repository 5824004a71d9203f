"""patchkit.plot: the figures hold the data of the load they draw.

Figures are checked headless through what sits on their axes (rectangles, lines,
annotations, image arrays), never through pixels.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from torch import nn

from patchkit import CheckpointWeightPatch, Chunk, plan_chunks
from patchkit.density import density_map
from patchkit.inspect import inspect_load
from patchkit.patch import staged_nbytes
from patchkit.plot import (
    MAX_BINS,
    MAX_RECTS,
    plot_chunks,
    plot_delta,
    plot_density,
    plot_placement,
    pool_mean,
    region_rects,
    to_png,
    view_rects,
)
from patchkit.toymodels import PlainModel, TinyLlamaConfig, TinyLlamaRuntime
from patchkit.units import format_bytes


@pytest.fixture(autouse=True, scope="module")
def _headless():
    matplotlib.use("Agg")


class Shards(nn.Module):
    """A vLLM-like loader on tensor-parallel rank ``rank`` of 2.

    - ``q``, ``k``, ``v`` (4 × 8 each) are packed into the rows of ``qkv`` (12 × 8);
    - ``o`` (8 × 8) is row-parallel: this rank keeps input columns ``[4r, 4r + 4)``;
    - ``a`` and ``c`` (6 × 4) are packed side by side into the columns of ``w`` (6 × 8);
    - ``e`` (10,) is copied into a flat range of ``w`` that is not a box;
    - ``norm`` (8,) is copied whole.
    """

    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.rank = rank
        self.qkv = nn.Parameter(torch.randn(12, 8, generator=g), requires_grad=False)
        self.o = nn.Parameter(torch.randn(8, 4, generator=g), requires_grad=False)
        self.w = nn.Parameter(torch.randn(6, 8, generator=g), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(8), requires_grad=False)

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, 4 * "qkv".index(name), 4).copy_(t)
            elif name == "o":
                self.o.data.copy_(t.narrow(1, 4 * self.rank, 4))
            elif name == "a":
                self.w.data[:, 0:4].copy_(t)
            elif name == "c":
                self.w.data[:, 4:8].copy_(t)
            elif name == "e":
                self.w.data.view(-1)[3:13].copy_(t)
            elif name == "norm":
                self.norm.data.copy_(t)
            names.add(name)
        return names


SHAPES = {"q": (4, 8), "k": (4, 8), "v": (4, 8), "o": (8, 8), "a": (6, 4), "c": (6, 4),
          "e": (10,), "norm": (8,)}


def dense(name: str, seed: int) -> CheckpointWeightPatch:
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    return CheckpointWeightPatch(name, shape, torch.float32, torch.randn(n, generator=g))


def sparse(name: str, idx: list[int], vals: list[float]) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(
        name, SHAPES[name], torch.float32, torch.tensor(vals), torch.tensor(idx)
    )


def load(names: str | list[str], rank: int = 0, **kw):
    names = names.split() if isinstance(names, str) else names
    patches = [dense(n, i) for i, n in enumerate(names)]
    return inspect_load(Shards(rank), patches, **kw), patches


def rects_by_gid(fig: Figure, prefix: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for ax in fig.axes:
        for p in ax.patches:
            gid = p.get_gid()
            if gid and gid.startswith(prefix):
                out.setdefault(gid, []).append(p)
    return out


def extent(rect) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of a Rectangle."""
    x, y = rect.get_xy()
    return (x, x + rect.get_width(), y, y + rect.get_height())


# -- plot_chunks ---------------------------------------------------------------------------


def chunk_patches() -> list[CheckpointWeightPatch]:
    # q, k, v: 128 B each; o: 256 B; norm: 32 B. At 300 B: [q k] closed by the repeated
    # q, [q] and [o] by the budget, [v norm] by the end.
    return [dense(n, i) for i, n in enumerate(["q", "k", "q", "o", "v", "norm"])]


def bar_totals(fig: Figure) -> dict[int, int]:
    totals: dict[int, int] = {}
    for gid, rects in rects_by_gid(fig, "segment ").items():
        call = int(gid.split()[1])
        totals[call] = totals.get(call, 0) + sum(r.get_height() for r in rects)
    return totals


def test_bar_heights_are_the_staged_bytes_of_each_loader_call():
    ps = chunk_patches()
    plan = plan_chunks(ps, 300)
    fig = plot_chunks(ps, max_chunk_bytes=300)
    assert isinstance(fig, Figure)
    assert bar_totals(fig) == {c.index: c.bytes for c in plan}
    segments = rects_by_gid(fig, "segment ")
    for c in plan:
        for pos in c.positions:
            (rect,) = segments[f"segment {c.index} {pos}"]
            assert rect.get_height() == staged_nbytes(ps[pos])


def test_budget_line_is_drawn_at_max_chunk_bytes():
    fig = plot_chunks(chunk_patches(), max_chunk_bytes=300)
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "budget"]
    assert list(line.get_ydata()) == [300, 300]
    assert line.get_linestyle() == "--"
    # in view, not on the axes' top edge, above bars well under it
    ax = plot_chunks(chunk_patches(), max_chunk_bytes=1000).axes[0]
    assert max(bar_totals(ax.figure).values()) < 600 < 1000 < ax.get_ylim()[1]


def test_each_call_is_annotated_with_why_it_closed():
    ps = chunk_patches()
    plan = plan_chunks(ps, 300)
    fig = plot_chunks(ps, max_chunk_bytes=300)
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "closed_by"]
    assert texts == [c.closed_by for c in plan]
    assert {"budget", "repeated name", "end"} <= set(texts)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "closed by repeated name" in legend and "closed by budget" in legend


def test_every_bar_is_in_view_and_the_legend_names_only_what_the_plan_holds():
    # a load that made every call, none over budget: no "not sent", no "over budget" in
    # the legend; the x limits hold the first bar's left edge and the last one's right
    ps = chunk_patches()
    plan = plan_chunks(ps, 300)
    assert not any(c.over_budget for c in plan)
    fig = plot_chunks(ps, max_chunk_bytes=300)
    ax = fig.axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["closed by budget", "closed by repeated name", "closed by end",
                      "max_chunk_bytes (300 B)"]
    lo, hi = ax.get_xlim()
    xs = [extent(r)[:2] for rects in rects_by_gid(fig, "segment ").values() for r in rects]
    assert lo < min(x0 for x0, _ in xs) and max(x1 for _, x1 in xs) < hi


def test_a_patch_larger_than_the_budget_is_flagged_over_budget():
    ps = chunk_patches()
    plan = plan_chunks(ps, 200)  # o (256 B) travels alone, over budget
    over = [c.index for c in plan if c.over_budget]
    assert over
    fig = plot_chunks(ps, max_chunk_bytes=200)
    flagged = [t for t in fig.axes[0].texts if t.get_gid() == "over_budget"]
    assert [round(t.xy[0]) for t in flagged] == over
    (rect,) = rects_by_gid(fig, f"segment {over[0]} ")[f"segment {over[0]} 3"]
    assert rect.get_hatch() == "xx"


def test_report_plan_is_drawn_and_a_new_budget_replans_what_was_sent():
    report, ps = load("q k v o", max_chunk_bytes=300)
    fig = report.plot_chunks()
    assert bar_totals(fig) == {c.index: c.bytes for c in report.plan}
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "budget"]
    assert line.get_ydata()[0] == 300
    fig = plot_chunks(report, max_chunk_bytes=10_000)
    assert bar_totals(fig) == {0: sum(staged_nbytes(p) for p in ps)}


def test_bytes_axis_reads_in_binary_units():
    big = [CheckpointWeightPatch(f"w{i}", (1024, 256), torch.float32, torch.zeros(1024 * 256))
           for i in range(3)]  # 1 MiB each
    fig = plot_chunks(big, max_chunk_bytes=2 << 20)
    fig.draw_without_rendering()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert any(lab.endswith("MiB") for lab in labels), labels
    assert "1 MiB" in labels and "2 MiB" in labels


def test_empty_patch_list_draws_an_empty_plan():
    fig = plot_chunks([], max_chunk_bytes=100)
    assert bar_totals(fig) == {}
    assert any(t.get_text() == "no patches" for t in fig.axes[0].texts)


def test_a_report_rejected_before_planning_says_so_and_replans_at_a_valid_budget():
    ps = chunk_patches()
    with pytest.raises(ValueError, match="max_chunk_bytes must be positive") as info:
        inspect_load(Shards(), ps, max_chunk_bytes=0)
    report = info.value.report
    fig = plot_chunks(report)
    assert bar_totals(fig) == {}
    (note,) = fig.axes[0].texts
    assert note.get_text().startswith("6 patches, none planned: the load raised PatchValueError")
    assert bar_totals(plot_chunks(report, max_chunk_bytes=300)) == {
        c.index: c.bytes for c in plan_chunks(ps, 300)
    }


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), None, "512MiB", 1.5, True])
def test_a_report_rejected_for_a_budget_that_is_no_int_draws_it_as_given(budget):
    # (vLLM takes max_chunk_bytes=inf: code ported from it meets this refusal first)
    ps = chunk_patches()
    with pytest.raises((TypeError, ValueError)) as info:
        inspect_load(Shards(), ps, max_chunk_bytes=budget)
    report = info.value.report
    fig = plot_chunks(report)
    assert bar_totals(fig) == {}
    assert fig.axes[0].get_title().endswith(f"max_chunk_bytes = {budget!r} (refused)")
    (note,) = fig.axes[0].texts
    assert note.get_text().startswith("6 patches, none planned: the load raised Patch")
    assert bar_totals(plot_chunks(report, max_chunk_bytes=300)) == {
        c.index: c.bytes for c in plan_chunks(ps, 300)
    }


def test_a_rejected_report_of_one_patch_says_patch_not_patches():
    with pytest.raises(ValueError, match="max_chunk_bytes must be positive") as info:
        inspect_load(Shards(), chunk_patches()[:1], max_chunk_bytes=0)
    (note,) = plot_chunks(info.value.report).axes[0].texts
    assert note.get_text().startswith("1 patch, none planned: the load raised PatchValueError")


def test_a_call_a_foreign_loader_ended_is_drawn_with_its_own_legend_entry():
    report, _ = load("q k v")
    observed = [Chunk(0, (0, 1), ("q", "k"), 256, "loader"), Chunk(1, (2,), ("v",), 128, "end")]
    fig = plot_chunks(dataclasses.replace(report, plan=observed))
    assert bar_totals(fig) == {0: 256, 1: 128}
    texts = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "closed_by"]
    assert texts == ["loader", "end"]
    assert "closed by loader" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_a_call_staging_bytes_of_its_own_shares_them_among_its_patches():
    # q, k, v: 128 B each. A loader that staged q and k as 512 B (cast to a wider dtype):
    # 256 B each; names it sent that match no patch (position -1) share equally what the
    # known patches do not account for, and nothing where they account for more.
    report, _ = load("q k v")
    observed = [Chunk(0, (0, 1), ("q", "k"), 512, "loader"),
                Chunk(1, (2, -1, -1), ("v", "x", "y"), 328, "loader"),
                Chunk(2, (0, -1), ("q", "x"), 100, "end")]
    fig = plot_chunks(dataclasses.replace(report, plan=observed))
    heights = {gid: [r.get_height() for r in rects]
               for gid, rects in rects_by_gid(fig, "segment ").items()}
    assert heights == {"segment 0 0": [256], "segment 0 1": [256],
                       "segment 1 2": [128], "segment 1 -1": [100, 100],
                       "segment 2 0": [100], "segment 2 -1": [0]}
    assert bar_totals(fig) == {0: 512, 1: 328, 2: 100}


def test_patches_too_thin_to_see_are_labelled_with_how_many_share_their_rectangle():
    big = CheckpointWeightPatch("big", (1024, 256), torch.float32, torch.zeros(1024 * 256))
    tiny = [CheckpointWeightPatch(f"t{i}", (640,), torch.float32, torch.zeros(640))
            for i in range(100)]  # 2560 B each: under a pixel, 250 KiB together
    fig = plot_chunks([big, *tiny])
    assert sorted(rects_by_gid(fig, "segment ")) == ["segment 0 0", "segment 0 1..100"]
    labels = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "segment label"]
    assert labels == ["big", "100 patches"]


@pytest.mark.parametrize(("calls", "annotated"), [(60, True), (61, False)])
def test_calls_are_annotated_with_why_they_closed_up_to_60_calls(calls, annotated):
    fig = plot_chunks([dense("q", i) for i in range(calls)])
    closed = [t.get_text() for t in fig.axes[0].texts if t.get_gid() == "closed_by"]
    assert closed == (["repeated name"] * (calls - 1) + ["end"] if annotated else [])


def test_plot_chunks_names_an_argument_that_is_neither_a_report_nor_patches():
    with pytest.raises(TypeError, match=r"plot_chunks: expected a LoadReport .*got int: 3"):
        plot_chunks(3)
    with pytest.raises(TypeError, match=r"got str: 'ab'"):
        plot_chunks("ab")
    with pytest.raises(TypeError, match=r"plot_chunks: patch 1 must be a CheckpointWeightPatch, "
                                        r"got int: 3"):
        plot_chunks([dense("q", 0), 3])
    ps = chunk_patches()
    assert bar_totals(plot_chunks(iter(ps), 300)) == bar_totals(plot_chunks(ps, 300))


def test_report_figures_name_a_report_argument_of_the_wrong_type():
    for draw in (lambda: plot_delta(3, "a"), lambda: plot_placement(3),
                 lambda: plot_delta(chunk_patches(), "q")):
        with pytest.raises(TypeError, match=r"report must be a LoadReport .*got (int|list)"):
            draw()


def drawn(fig: Figure):
    """Draw ``fig`` once with Agg, as a notebook shows it; the renderer, to measure texts."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def test_bars_too_narrow_for_an_edge_are_drawn_without_one():
    ps = [CheckpointWeightPatch(f"layers.{i}.w", (16, 16), torch.float32, torch.zeros(256))
          for i in range(600)]  # 1 KiB each: one call per patch at a 1 KiB budget
    fig = plot_chunks(ps, max_chunk_bytes=1024)
    assert bar_totals(fig) == dict.fromkeys(range(600), 1024)
    segments = [r for rs in rects_by_gid(fig, "segment ").values() for r in rs]
    assert len(segments) == 600
    assert all(r.get_linewidth() == 0 for r in segments)  # a white edge would wash them out
    few = rects_by_gid(plot_chunks(ps[:3], max_chunk_bytes=1024), "segment ").values()
    assert all(r.get_linewidth() > 0 and tuple(r.get_edgecolor()[:3]) == (1, 1, 1)
               for rs in few for r in rs)


def test_patches_too_thin_to_see_share_one_rectangle():
    big = CheckpointWeightPatch("big", (1024, 256), torch.float32, torch.zeros(1024 * 256))
    tiny = [CheckpointWeightPatch(f"t{i}", (1,), torch.float32, torch.zeros(1))
            for i in range(2000)]  # 4 B each beside 1 MiB: far under a pixel
    ps = [tiny[0], big, *tiny[1:]]
    (call,) = plan_chunks(ps, 512 << 20)
    fig = plot_chunks(ps)
    rects = rects_by_gid(fig, "segment ")
    assert sorted(rects) == ["segment 0 0", "segment 0 1", "segment 0 2..2000"]
    assert [r.get_height() for (r,) in (rects[g] for g in sorted(rects))] == [4, 1 << 20, 1999 * 4]
    assert bar_totals(fig) == {0: call.bytes}
    assert all(r.get_linewidth() == 0 for g in ("segment 0 0", "segment 0 2..2000")
               for r in rects[g])


def bytes_allocated_by_lines(fn, *args):
    """``fn(*args)`` and the bytes its own lines allocate, summed line by line (each line's
    peak of traced memory over what was held as it began: what it asked for, also what it
    freed again before the next line). A count of work, not of time."""
    import tracemalloc

    allocated = 0

    def tracer(frame, event, arg):
        nonlocal allocated
        if frame.f_code is not fn.__code__:
            return None
        allocated += tracemalloc.get_traced_memory()[1] - tracer.held
        tracemalloc.reset_peak()
        tracer.held = tracemalloc.get_traced_memory()[0]
        return tracer

    tracemalloc.start()
    tracer.held = tracemalloc.get_traced_memory()[0]
    previous = sys.gettrace()  # (coverage's, in a coverage run: it is given back after)
    sys.settrace(tracer)
    try:
        out = fn(*args)
    finally:
        sys.settrace(previous)
        tracemalloc.stop()
    return out, allocated


def test_counting_allocations_gives_back_the_trace_function_it_found():
    # (it set None after: under `coverage run` no test after this one was traced, so
    # progress.py, widgets.py and the test files after test_plot.py read as untested)
    def found(frame, event, arg):
        return None

    before = sys.gettrace()
    sys.settrace(found)
    try:
        out, _ = bytes_allocated_by_lines(lambda n: [0] * n, 3)
        assert out == [0, 0, 0] and sys.gettrace() is found
    finally:
        sys.settrace(before)


def test_thin_patches_of_one_call_share_a_rectangle_in_work_in_proportion_to_them():
    # (each thin patch copied the run's list of positions so far: a call of n such patches
    # allocated n * n / 2 list slots, 16 MB at 2000 patches, 1.9 s to plot at 32000)
    from patchkit.plot import _bar_pieces

    big = CheckpointWeightPatch("big", (1024, 256), torch.float32, torch.zeros(1024 * 256))
    per_patch = {}
    for n in (500, 2000):
        ps = [big, *(CheckpointWeightPatch(f"t{i}", (1,), torch.float32, torch.zeros(1))
                     for i in range(n))]
        (call,) = plan_chunks(ps, 512 << 20)
        pieces, allocated = bytes_allocated_by_lines(_bar_pieces, call, ps, 1e4)
        assert [(p[0], len(p), h) for p, _, h in pieces] == [(0, 1, 1 << 20), (1, n, 4 * n)]
        per_patch[n] = allocated / n
    # (about 400 B a patch at both sizes now; before, 2400 B at 500 and 8750 B at 2000)
    assert per_patch[2000] < 1.5 * per_patch[500], per_patch


def ones_at(name: str, shape: tuple[int, ...], positions: list[int]) -> CheckpointWeightPatch:
    return CheckpointWeightPatch(name, shape, torch.bfloat16,
                                 torch.ones(len(positions), dtype=torch.bfloat16),
                                 torch.tensor(positions))


LABEL_CASES = {
    # three calls under a budget far above them: the "(above this scale)" note is drawn
    "budget off scale": lambda: plot_chunks([
        ones_at("q", (64, 64), [0, 1, 2]), ones_at("norm", (64,), [0, 1]),
        ones_at("q", (64, 64), [2, 3]), ones_at("down", (64, 128), [5]),
        ones_at("down", (64, 128), [6]), ones_at("norm", (64,), [1, 2])]),
    "budget in view": lambda: plot_chunks(chunk_patches(), max_chunk_bytes=300),
    "one call": lambda: plot_chunks(chunk_patches(), max_chunk_bytes=10_000),
    "40 calls": lambda: plot_chunks([dense("q", i) for i in range(40)]),
}


@pytest.mark.parametrize("case", LABEL_CASES)
def test_closed_by_labels_stay_inside_the_axes_clear_of_the_title_and_the_note(case):
    fig = LABEL_CASES[case]()
    renderer = drawn(fig)
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_gid() == "closed_by"]
    assert labels
    others = [ax.title] + [t for t in ax.texts if "above this scale" in t.get_text()]
    assert len(others) == 2 or case == "budget in view"
    for label in labels:
        box = label.get_window_extent(renderer)
        assert box.y1 <= ax.bbox.y1, (label.get_text(), box, ax.bbox)
        for other in others:
            assert not box.overlaps(other.get_window_extent(renderer)), other.get_text()


@pytest.mark.parametrize("n", [1, 4, 8, 20])
def test_every_call_has_a_whole_number_tick_up_to_20_calls(n):
    ps = [dense("q", i) for i in range(n)]  # a repeated name: one call per patch
    ax = plot_chunks(ps, max_chunk_bytes=10_000).axes[0]
    assert list(ax.get_xticks()) == list(range(n))


def test_more_calls_have_whole_number_ticks():
    ax = plot_chunks([dense("q", i) for i in range(50)], max_chunk_bytes=10_000).axes[0]
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert len(ticks) >= 3 and all(t == int(t) for t in ticks)


# -- plot_density --------------------------------------------------------------------------


def test_density_image_is_the_density_map_in_checkpoint_coordinates():
    idx = [0, 1, 2, 9, 40, 41, 63]
    p = CheckpointWeightPatch("w", (8, 8), torch.float32, torch.ones(len(idx)),
                              torch.tensor(idx))
    fig = plot_density(p, bins=(4, 2))
    im = fig.axes[0].images[0]
    np.testing.assert_array_equal(im.get_array(), density_map(p, (4, 2)).numpy())
    assert im.get_extent() == [0.0, 8.0, 8.0, 0.0]  # real checkpoint rows and columns
    assert len(fig.axes) == 2  # the heat map and its colorbar
    assert fig.axes[1].get_ylabel() == "fraction of elements the patch writes per block"
    title = fig.axes[0].get_title()
    assert "w" in title and "(8, 8)" in title and "writes 7 of 64 elements" in title


def test_density_bins_are_capped_to_a_bounded_image():
    n = 3000 * 2000
    p = CheckpointWeightPatch("big", (3000, 2000), torch.float32, torch.ones(3),
                              torch.tensor([0, n // 2, n - 1]))
    fig = plot_density(p, bins=(5000, 5000))
    # at most MAX_BINS, and no more blocks than the panel has pixels (360 x 440)
    assert fig.axes[0].images[0].get_array().shape == (360, 440)
    assert max(360, 440) <= MAX_BINS
    small = CheckpointWeightPatch("s", (3, 5), torch.float32, torch.zeros(15))
    assert plot_density(small, bins=(64, 64)).axes[0].images[0].get_array().shape == (3, 5)


def test_density_of_a_128256_by_2560_patch_at_one_percent():
    n = 128256 * 2560
    idx = torch.arange(0, n, 100)  # exactly 1 % of the elements, spread evenly
    p = CheckpointWeightPatch("embed_tokens.weight", (128256, 2560), torch.bfloat16,
                              torch.ones(idx.numel(), dtype=torch.bfloat16), idx)
    fig = plot_density(p)
    img = np.asarray(fig.axes[0].images[0].get_array())
    assert img.shape == (128, 128)
    np.testing.assert_allclose(img, 0.01, atol=1e-3)
    assert "128256" in fig.axes[0].get_title()


def test_density_of_something_not_a_patch_names_what_it_got():
    with pytest.raises(TypeError, match=r"plot_density: patch must be a CheckpointWeightPatch, "
                                        r"got str: 'a'; .*report.plot_density\(name\)"):
        plot_density("a")
    with pytest.raises(TypeError, match=r"got int: 0"):
        plot_density(0)
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(2), torch.tensor([0, 5]))
    plain = tuple(p)  # (name, shape, dtype, values, indices), as a load accepts it
    np.testing.assert_array_equal(plot_density(plain, bins=2).axes[0].images[0].get_array(),
                                  density_map(p, (2, 2)).numpy())


def test_density_of_a_patch_the_loader_refuses_raises_as_density_map_does():
    truncated = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(2),
                                      torch.tensor([1.7, 15.9]))
    with pytest.raises(TypeError, match=r"patch 'w': indices must be int32 or int64"):
        plot_density(truncated)
    negative = CheckpointWeightPatch("w", (-4, 4), torch.float32, torch.ones(2),
                                     torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"patch 'w': shape has a negative dimension"):
        plot_density(negative)


def test_every_figure_that_takes_ax_names_an_ax_that_is_not_axes():
    report, patches = load("q")
    p = sparse("q", [0, 5], [1.0, 2.0])
    for fn, draw in (("plot_chunks", lambda ax: plot_chunks(patches, ax=ax)),
                     ("plot_chunks", lambda ax: report.plot_chunks(ax=ax)),
                     ("plot_density", lambda ax: plot_density(p, ax=ax)),
                     ("plot_density", lambda ax: report.plot_density("q", ax=ax))):
        for bad in ("x", 0, Figure()):
            with pytest.raises(TypeError, match=rf"{fn}: ax must be a matplotlib Axes .*"
                                                rf"got {type(bad).__name__}"):
                draw(bad)
        fig = Figure()
        assert draw(fig.add_subplot()) is fig


def test_pool_mean_and_max_abs_check_their_array_and_blocks():
    from patchkit.plot import pool_max_abs, pool_mean

    x = np.arange(12.0).reshape(3, 4)
    for pool in (pool_mean, pool_max_abs):
        name = pool.__name__
        for args, error, match in (
            ((x, 0, 2), ValueError, "br must be at least 1, got 0"),
            ((x, 2, -1), ValueError, "bc must be at least 1, got -1"),
            ((x, True, 2), TypeError, "br must be a positive int, got bool"),
            ((x, 2, 1.0), TypeError, "bc must be a positive int, got float"),
            ((x.ravel(), 1, 2), ValueError, r"x must be a 2-D numpy array, got shape \(12,\)"),
            ((x.tolist(), 1, 2), TypeError, "x must be a 2-D numpy array, got list"),
            ((x + 1j, 1, 2), TypeError, "x must hold real numbers .* got dtype complex128"),
            ((x.astype(str), 1, 2), TypeError, "x must hold real numbers"),
        ):
            with pytest.raises(error, match=f"{name}: {match}"):
                pool(*args)
        # no rows or no columns: no blocks along that side (was ZeroDivisionError, or
        # one block row made of no rows)
        for shape, blocks in (((0, 4), (0, 2)), ((4, 0), (2, 0)), ((0, 0), (0, 0))):
            got = pool(np.ones(shape), 2, 2)
            assert (got.shape, got.dtype) == (blocks, np.float64), (name, shape)
        np.testing.assert_array_equal(pool(x > 4, 3, 4), (x > 4).astype(np.float64))
        # more blocks than rows or columns: one row or column per block
        np.testing.assert_array_equal(pool(x, 5, 9), x)
        np.testing.assert_array_equal(pool(x, 5, np.int64(2)), pool(x, 3, 2))
    assert pool_mean(x, 1, 2).tolist() == [[4.5, 6.5]]
    # the largest magnitude keeps its sign; where +v and -v tie, the positive one shows
    y = np.array([[-3.0, 2.0, -2.0, 2.0], [1.0, -1.0, 0.5, -0.25]])
    assert pool_max_abs(y, 1, 2).tolist() == [[-3.0, 2.0]]
    assert pool_max_abs(y, 2, 2).tolist() == [[-3.0, 2.0], [1.0, 0.5]]


def test_density_bins_are_checked_and_one_int_means_both_axes():
    p = CheckpointWeightPatch("w", (8, 8), torch.float32, torch.ones(3), torch.tensor([0, 9, 63]))
    np.testing.assert_array_equal(plot_density(p, bins=4).axes[0].images[0].get_array(),
                                  density_map(p, (4, 4)).numpy())
    with pytest.raises(TypeError, match="bins"):
        plot_density(p, bins="ab")
    with pytest.raises(ValueError, match=r"bins must be positive, got \(0, 4\)"):
        plot_density(p, bins=(0, 4))
    bad = p._replace(indices=torch.tensor([0, 64, 3]))
    with pytest.raises(ValueError, match=r"patch 'w': out-of-range index 64 at indices\[1\]"):
        plot_density(bad)


def test_density_of_a_patch_with_no_elements_says_there_is_nothing_to_draw():
    empty = [CheckpointWeightPatch("e", (0, 5), torch.float32, torch.ones(0)),
             CheckpointWeightPatch("e", (0, 5), torch.float32, torch.ones(0),
                                   torch.zeros(0, dtype=torch.int64))]
    for p in empty:
        fig = plot_density(p)
        (ax,) = fig.axes  # no colorbar
        assert not ax.images and not ax.axison
        (note,) = ax.texts
        assert note.get_gid() == "empty"
        assert note.get_text() == "e  (0, 5) float32: no elements, nothing to draw"
    fig = Figure()
    mine = fig.add_subplot()
    assert plot_density(empty[0], ax=mine) is fig
    assert not mine.images and [t.get_gid() for t in mine.texts] == ["empty"]
    with pytest.raises(TypeError, match="bins"):
        plot_density(empty[0], bins="ab")


def test_density_says_the_patch_writes_not_that_it_changes():
    # 1.0 written over 1.0: every element written, none changed; the map counts writes
    model = PlainModel({"w": (8, 8)}, fill=1.0)
    same = CheckpointWeightPatch("w", (8, 8), torch.float32, torch.ones(16), torch.arange(16))
    report = inspect_load(model, [same])
    assert report.deltas.loc["w", "changed"] == 0
    fig = report.plot_density("w", bins=(8, 8))
    assert float(fig.axes[0].images[0].get_array().max()) == 1.0
    label, title = fig.axes[1].get_ylabel(), fig.axes[0].get_title()
    assert label == "fraction of elements the patch writes per block"
    assert "writes 16 of 64 elements (25 %)" in title
    assert "changed" not in label + title


# -- plot_placement ------------------------------------------------------------------------


def test_region_rects_reads_slice_notation_into_view_rectangles():
    assert region_rects("[0:4, :]", (12, 8)) == ([(0, 4, 0, 8)], True)
    assert region_rects("[:, 4:8]", (6, 8)) == ([(0, 6, 4, 8)], True)
    assert region_rects("[2:5]", (10,)) == ([(0, 1, 2, 5)], True)
    assert region_rects("[]", ()) == ([(0, 1, 0, 1)], True)
    # 3-D: rows fold the leading dims; a box over the middle dim is one run per outer index
    assert region_rects("[1:2, :, 0:2]", (2, 3, 4)) == ([(3, 6, 0, 2)], True)
    assert region_rects("[:, 1:3, :]", (2, 3, 4)) == ([(1, 3, 0, 4), (4, 6, 0, 4)], True)
    # a box that steps: a rectangle for each row or column it holds
    assert region_rects("[1:8:2, :]", (8, 4)) == (
        [(1, 2, 0, 4), (3, 4, 0, 4), (5, 6, 0, 4), (7, 8, 0, 4)], True
    )
    assert region_rects("[2:4, 0:4:3]", (8, 4)) == ([(2, 4, 0, 1), (2, 4, 3, 4)], True)
    # not a box: the flat range, flagged as such
    assert region_rects("10 elements from 3", (6, 8)) == (
        [(0, 1, 3, 8), (1, 2, 0, 5)], False
    )
    assert region_rects(None, (4, 4)) == ([], False)


@pytest.mark.parametrize("text", ["[-3:4, :]", "[0:-1, :]", "[2:9, :]", "[:, -2:4]",
                                  "[0:4:2:7, :]", "[1:3:0, :]", "[3:1, :]", "[2, :]",
                                  "[0:4]", "[a:b, :]"])
def test_region_rects_gives_nothing_for_text_no_region_of_the_shape_has(text):
    # a negative start raised view_rects' error about a (7, 4) shape, a box past the
    # last row came back as exact rectangles outside the grid, a fourth field was dropped
    assert region_rects(text, (4, 4)) == ([], False)


@pytest.mark.parametrize(("shape", "error", "match"), [
    ("ab", TypeError, "shape must be a sequence of ints, got 'ab'"),
    (None, TypeError, "shape must be a sequence of ints, got None"),
    ((2.5, 4), TypeError, r"shape must be a sequence of ints, got \(2.5, 4\)"),  # (was 2)
    ((-1, 4), ValueError, "shape has a negative dimension"),
    (iter((4, 4)), TypeError, "shape must be a sequence of ints"),
])
def test_a_bad_shape_is_refused_by_name_by_region_rects_and_grid_shape(shape, error, match):
    # (int()'s "invalid literal", or "'NoneType' object is not iterable"; a float dim was
    # truncated)
    from patchkit.density import grid_shape

    with pytest.raises(error, match=f"region_rects: {match}"):
        region_rects("[0:2, :]", shape)
    with pytest.raises(error, match=f"grid_shape: {match}"):
        grid_shape(shape)
    with pytest.raises(ValueError, match="view_rects: limit must not be negative, got -1"):
        view_rects(0, (2,), (1,), 4, limit=-1)
    assert view_rects(0, (2,), (1,), 4, limit=0) == ([(0, 1, 0, 2)], False)  # (the extent)


def test_placement_puts_q_k_v_into_row_bands_of_the_packed_qkv():
    report, _ = load("q k v")
    fig = plot_placement(report)
    runtime = rects_by_gid(fig, "write ")
    writes = report.writes
    for i, w in writes.iterrows():
        slot = "qkv".index(w["name"])
        (rt,) = runtime[f"write {i} runtime"]
        assert extent(rt) == (0, 8, 4 * slot, 4 * slot + 4)
        (ck,) = runtime[f"write {i} checkpoint"]  # whole q/k/v read: a full unit square
        x0, x1, y0, y1 = extent(ck)
        assert (x0, x1, y1 - y0) == (0, 1, 1)
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["#0 q [:, :] → [0:4, :]", "#1 k [:, :] → [4:8, :]",
                      "#2 v [:, :] → [8:12, :]"]
    # row 0 on top on both sides: the runtime rows run downwards, and each checkpoint
    # tensor's name sits at the middle of its unit square
    ax_ck, ax_rt = fig.axes[0], fig.axes[1]
    assert ax_rt.get_ylim() == (12, 0) and ax_ck.get_ylim() == (3.5, 0)
    squares = sorted(p.get_y() + p.get_height() / 2 for p in ax_ck.patches
                     if p.get_gid() is None)
    assert list(ax_ck.get_yticks()) == squares == [0.5, 1.75, 3.0]
    assert [t.get_text().split()[0] for t in ax_ck.get_yticklabels()] == ["q", "k", "v"]


def test_placement_legend_lists_twelve_writes_then_how_many_more():
    ps = [CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(1), torch.tensor([k]))
          for k in range(15)]  # (a repeated name: 15 calls, 15 writes into a)
    fig = plot_placement(inspect_load(PlainModel({"a": (8, 8)}), ps))
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert len(legend) == 13 and legend[-1] == "… 3 more writes"


@pytest.mark.parametrize("rank", [0, 1])
def test_placement_shows_a_row_parallel_shard_as_a_column_band_of_the_checkpoint(rank):
    report, _ = load("o", rank=rank)
    (i,) = report.writes.index
    fig = plot_placement(report)
    rects = rects_by_gid(fig, "write ")
    (ck,) = rects[f"write {i} checkpoint"]
    assert extent(ck) == (0.5 * rank, 0.5 * rank + 0.5, 0.0, 1.0)  # columns 4r:4r+4 of 8
    (rt,) = rects[f"write {i} runtime"]
    assert extent(rt) == (0, 4, 0, 8)  # fills this rank's (8, 4) shard


def test_placement_shows_column_slices_as_vertical_bands_of_the_runtime_tensor():
    report, _ = load("a c")
    fig = plot_placement(report)
    rects = rects_by_gid(fig, "write ")
    bands = [extent(rects[f"write {i} runtime"][0]) for i in report.writes.index]
    assert bands == [(0, 4, 0, 6), (4, 8, 0, 6)]


def test_placement_draws_a_flat_range_that_wraps_rows_as_exactly_its_elements():
    report, _ = load("e")
    (i,) = report.writes.index
    assert report.writes.loc[i, "target_region"] == "10 elements from 3"
    rects = rects_by_gid(plot_placement(report), "write ")[f"write {i} runtime"]
    assert sorted(extent(r) for r in rects) == [(0, 5, 1, 2), (3, 8, 0, 1)]  # rows 1 and 0
    assert not any(r.get_hatch() for r in rects)  # not a box, but drawn exactly


def cells(rects) -> set[tuple[int, int]]:
    """The (row, column) cells a list of Rectangles (or Rect tuples) covers, each once."""
    out: set[tuple[int, int]] = set()
    for r in rects:
        x0, x1, y0, y1 = extent(r) if not isinstance(r, tuple) else (r[2], r[3], r[0], r[1])
        new = {(y, x) for y in range(int(y0), int(y1)) for x in range(int(x0), int(x1))}
        assert not out & new  # rectangles do not overlap
        out |= new
    return out


def test_placement_draws_interleaved_rows_and_a_transposed_box_where_they_landed(
    interleaved,
):
    m = interleaved
    shapes = {"gate": (4, 4), "up": (4, 4), "x": (2, 6)}
    patches = [CheckpointWeightPatch(n, s, torch.float32, torch.full((int(np.prod(s)),), k + 1.0))
               for k, (n, s) in enumerate(shapes.items())]
    report = inspect_load(m, patches)
    rects = rects_by_gid(plot_placement(report), "write ")
    after = {"gate_up": m.gate_up.data, "v": m.v.data}
    for i, w in report.writes.iterrows():
        landed = {tuple(rc) for rc in (after[w["target"]] == w["position"] + 1)
                  .nonzero().tolist()}
        drawn = rects[f"write {i} runtime"]
        assert cells(drawn) == landed, w["name"]
        assert not any(r.get_hatch() for r in drawn)
    assert len(rects["write 1 runtime"]) == 4  # up: one rectangle for each of its rows
    assert [extent(r) for r in rects["write 2 runtime"]] == [(1, 3, 0, 6)]  # v[:, 1:3]


def test_view_rects_cover_exactly_the_elements_of_a_view():
    base = torch.arange(6 * 8).reshape(6, 8)
    views = [base[1::2], base[:, 1:7:3], base.t()[2:5], base.view(-1)[5:30],
             base.view(-1)[::9], base[1:5].reshape(4, 2, 4)[:, :, 1:3], base[2, 3:4],
             base.view(-1)[4:].as_strided((5, 6), (8, 1), 4)]  # wraps into the next row
    for v in views:
        want = {divmod(int(p), 8) for p in v.reshape(-1)}
        rects, exact = view_rects(v.storage_offset(), tuple(v.shape), v.stride(), 8)
        assert exact and cells(rects) == want, (tuple(v.shape), v.stride())
    assert view_rects(0, (0, 8), (8, 1), 8) == ([], True)


def test_a_view_past_the_rectangle_limit_is_drawn_as_its_extent_and_says_so():
    # every other column: one rectangle a column, over the limit: the bounding box
    assert view_rects(1, (3, 4), (8, 2), 8, limit=3) == ([(0, 3, 1, 8)], False)
    assert view_rects(1, (3, 4), (8, 2), 8, limit=4)[1]
    # not rows by columns: the flat range from the first element to the last
    assert view_rects(3, (4,), (9,), 8, limit=3) == (
        [(0, 1, 3, 8), (1, 3, 0, 8), (3, 4, 0, 7)], False  # elements 3 to 30
    )

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 2 * MAX_RECTS + 2), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data[:, ::2].copy_(t)
            return {n for n, _ in weights}

    n = MAX_RECTS + 1
    report = inspect_load(Wide(), [CheckpointWeightPatch("w", (2, n), torch.float32,
                                                         torch.ones(2 * n))])
    assert report.writes.loc[0, "target_region"] == f"[:, 0:{2 * n}:2]"
    fig = plot_placement(report)
    (rect,) = rects_by_gid(fig, "write ")["write 0 runtime"]
    assert extent(rect) == (0, 2 * n - 1, 0, 2) and rect.get_hatch() == "//"
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend[-1] == "hatched: a write drawn as its extent, not element by element"


def test_placement_draws_one_row_per_target_and_caps_the_default():
    report, _ = load("q o a norm")
    fig = plot_placement(report)
    assert len(fig.axes) == 2 * 4
    assert [ax.get_title().split()[1] for ax in fig.axes[1::2]] == ["qkv", "o", "w", "norm"]
    fig = plot_placement(report, max_targets=2)
    assert len(fig.axes) == 4
    assert "showing 2 of 4 runtime tensors" in fig.get_suptitle()
    fig = plot_placement(report, targets=["norm"])
    assert fig.axes[1].get_title().startswith("runtime norm (8,)")


def test_placement_takes_one_target_name_given_as_a_string():
    model = PlainModel({"ab": (4, 4), "a": (4,), "b": (4,)})
    patches = [CheckpointWeightPatch(n, s, torch.float32, torch.ones(int(np.prod(s))))
               for n, s in model.checkpoint_shapes.items()]
    report = inspect_load(model, patches)
    fig = plot_placement(report, targets="ab")
    assert len(fig.axes) == 2  # one row: "ab", not "a" and "b"
    assert fig.axes[1].get_title().startswith("runtime ab (4, 4): 1 write")


def test_placement_title_counts_the_elements_written_not_those_of_the_views():
    # a sparse k writes 2 of the 32 elements of its (4, 8) view of qkv
    report = inspect_load(Shards(), [sparse("k", [0, 9], [1.0, 2.0])])
    title = plot_placement(report).axes[1].get_title()
    assert title.endswith(": 1 write, 2 elements written of 32 in its view")
    report, _ = load("q k v")  # dense: every element of the views, said once
    title = plot_placement(report).axes[1].get_title()
    assert title == "runtime qkv (12, 8): 3 writes, 96 elements written"
    report = inspect_load(Shards(), [sparse("k", [3], [1.0]), sparse("v", [0, 1], [1.0, 1.0])])
    title = plot_placement(report).axes[1].get_title()
    assert title.endswith(": 2 writes, 3 elements written of 64 in their views")
    report = inspect_load(Shards(), [sparse("norm", [3], [1.0])])
    assert plot_placement(report).axes[1].get_title().endswith(
        ": 1 write, 1 element written of 8 in its view")


def test_placement_of_an_unknown_target_names_it():
    report, _ = load("q")
    with pytest.raises(KeyError, match="nope"):
        plot_placement(report, targets=["nope"])


# -- plot_delta ----------------------------------------------------------------------------


def test_delta_images_are_before_after_and_their_difference():
    report, _ = load("q k")
    before, after = report.before("qkv").numpy(), report.after("qkv").numpy()
    fig = plot_delta(report, "qkv")
    b, a, d = (np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images)
    np.testing.assert_array_equal(b, before)
    np.testing.assert_array_equal(a, after)
    exact = after - before  # (in float32, as the tensor: no overflow here)
    np.testing.assert_array_equal(d, exact)
    assert not np.all(d[8:] != 0)  # v was not written: its rows did not change
    lo, hi = [ax for ax in fig.axes if ax.images][2].images[0].get_clim()
    assert lo == -hi and hi == np.abs(exact).max()


def test_delta_of_int64_weights_beyond_2_53_is_exact():
    # float64 holds no int64 above 2**53 exactly: the difference is taken in integers
    x = torch.full((2, 3), 2**60, dtype=torch.int64) + torch.arange(6).reshape(2, 3)
    m = PlainModel({"w": (2, 3)}, dtype=torch.int64)
    m.load_weights([("w", x)])
    report = inspect_load(m, [CheckpointWeightPatch("w", (2, 3), torch.int64,
                                                    (x + 1).reshape(-1))])
    fig = plot_delta(report, "w")
    d = [np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images][2]
    np.testing.assert_array_equal(d, np.ones((2, 3)))
    assert "max |Δ| 1" in fig.get_suptitle()
    assert report.deltas.loc["w", ["changed", "max_abs", "mean_abs"]].tolist() == [6, 1.0, 1.0]


def _blocks(n: int, b: int) -> np.ndarray:
    return (np.arange(n) * b) // n  # block of each row, as density_map cuts them


def test_delta_of_a_big_tensor_is_pooled_by_the_density_map_blocks():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Parameter(torch.zeros(300, 200), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.emb.data.copy_(t)
            return {"emb"}

    idx = torch.tensor([0, 5, 201, 30_000, 59_999])
    vals = torch.tensor([1.0, -3.0, 2.0, 0.5, -0.25])
    p = CheckpointWeightPatch("emb", (300, 200), torch.float32, vals, idx)
    report = inspect_load(Big(), [p])
    fig = plot_delta(report, "emb", bins=(16, 16))
    images = [np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images]
    assert [im.shape for im in images] == [(16, 16)] * 3
    delta = (report.after("emb") - report.before("emb")).numpy()
    rb, cb = _blocks(300, 16), _blocks(200, 16)
    want = np.zeros((16, 16))
    mean = np.zeros((16, 16))
    for i in range(16):
        for j in range(16):
            block = delta[np.ix_(rb == i, cb == j)]
            want[i, j] = block.flat[np.argmax(np.abs(block))]
            mean[i, j] = report.after("emb").numpy()[np.ix_(rb == i, cb == j)].mean(
                dtype=np.float64
            )
    np.testing.assert_array_equal(images[2], want)
    np.testing.assert_allclose(images[1], mean, rtol=1e-12)
    assert images[2][0, 0] == -3.0  # the larger of the two changes in block (0, 0)


@pytest.mark.parametrize("band", [500, 300, 150])
def test_delta_reads_the_tensor_a_band_at_a_time_and_draws_the_numbers_of_the_whole(
    monkeypatch, band
):
    # plot_delta made float copies of the whole before, after and Δ, and full-size masks:
    # at 128256 × 2560 bfloat16 it took 41 s and 7 GB more memory. Now it reads a band
    # at a time: here two rows (cutting blocks of rows in two), one row (a band of under
    # two rows), or 150 elements of a row of 200 (cutting blocks of columns), and never
    # calls the whole-tensor copies.
    from patchkit import inspect as pk_inspect
    from patchkit import plot

    g = torch.Generator().manual_seed(0)
    model = PlainModel({"w": (300, 200)})
    with torch.no_grad():
        model.w.copy_(torch.randn(300, 200, generator=g))
    idx = torch.randperm(60_000, generator=g)[:6000].sort().values
    report = inspect_load(model, [CheckpointWeightPatch(
        "w", (300, 200), torch.float32, torch.randn(6000, generator=g), idx)])
    before, after = report.before("w").numpy(), report.after("w").numpy()
    delta, written = after - before, report.written("w").numpy()

    reads = []
    read = pk_inspect._BeforeAfter.read
    monkeypatch.setattr(pk_inspect._BeforeAfter, "read",
                        lambda self, lo, hi: reads.append(hi - lo) or read(self, lo, hi))
    for whole in ("before", "after", "written"):
        monkeypatch.setattr(pk_inspect.LoadReport, whole, None)
    monkeypatch.setattr(plot, "_BAND", band)
    fig = plot_delta(report, "w", bins=(16, 16))
    assert max(reads) <= band and sum(reads) == 60_000  # every element once

    rb, cb = _blocks(300, 16), _blocks(200, 16)
    want_b, want_a, want_d = (np.zeros((16, 16)) for _ in range(3))
    for i in range(16):
        for j in range(16):
            at = np.ix_(rb == i, cb == j)
            want_b[i, j] = before[at].mean(dtype=np.float64)
            want_a[i, j] = after[at].mean(dtype=np.float64)
            want_d[i, j] = delta[at].flat[np.argmax(np.abs(delta[at]))]
    b, a, d = (np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images)
    np.testing.assert_allclose(b, want_b, rtol=1e-12)
    np.testing.assert_allclose(a, want_a, rtol=1e-12)
    np.testing.assert_array_equal(d, want_d)
    # one colour scale for before and after: their finite values' range
    both = np.concatenate([b.ravel(), a.ravel()])
    assert fig.axes[0].images[0].get_clim() == fig.axes[1].images[0].get_clim() == (
        both.min(), both.max())
    heights = [p.get_height() for p in fig.axes[3].patches]
    np.testing.assert_array_equal(heights, np.histogram(delta.reshape(-1)[written.reshape(-1)],
                                                        bins=60)[0])
    # the counts and largest |Δ| of all the bands, not of the last: no stale warning
    assert "warning" not in fig.get_suptitle()

    # As many Δ values as it keeps: one pass; more: counted into the same bins on a second.
    monkeypatch.setattr(plot, "_HIST_KEEP", 6000)
    reads.clear()
    fig = plot_delta(report, "w", bins=(16, 16))
    assert sum(reads) == 60_000
    monkeypatch.setattr(plot, "_HIST_KEEP", 100)
    reads.clear()
    fig = plot_delta(report, "w", bins=(16, 16))
    assert sum(reads) == 2 * 60_000
    assert [p.get_height() for p in fig.axes[3].patches] == heights
    assert "warning" not in fig.get_suptitle()
    # the model changed since (the first written element put back): said, whichever
    # band it is in
    with torch.no_grad():
        model.w.view(-1)[int(idx[0])] = float(before.reshape(-1)[int(idx[0])])
    assert "warning" in plot_delta(report, "w", bins=(16, 16)).get_suptitle()


def _marks(ax):
    """Centres of the ``×`` that mark NaN/±inf on a heat map."""
    return [tuple(xy) for c in ax.collections if c.get_gid() == "non-finite"
            for xy in c.get_offsets()]


def test_delta_draws_nan_and_inf_in_a_colour_of_their_own_and_pools_around_them():
    # The colour maps' bad colour was transparent (white, like Δ = 0), and one NaN made
    # its whole block NaN: a NaN in the model looked like "no change".
    model = PlainModel({"w": (100, 100)})
    with torch.no_grad():
        model.w.zero_()
        model.w[50, 50] = float("nan")
        model.w[0:10, 90:100] = float("inf")  # a whole block (0, 9) of ±inf
        model.w[95, 5] = -float("inf")
    idx = torch.arange(10_000)
    idx = idx[idx != 9505]  # element (95, 5) is not written: it stays -inf
    report = inspect_load(model, [CheckpointWeightPatch(
        "w", (100, 100), torch.float32, torch.full((9999,), 2.0), idx)])
    fig = plot_delta(report, "w", bins=(10, 10))
    maps = [ax for ax in fig.axes if ax.images]
    b, a, d = (np.ma.filled(np.ma.asarray(ax.images[0].get_array()), -1.0) for ax in maps)
    assert b[5, 5] == 0.0 and a[5, 5] == 2.0 and d[5, 5] == 2.0  # the 99 finite ones
    assert b[9, 0] == 0.0 and a[9, 0] == 2.0 and d[9, 0] == 2.0
    assert b[0, 9] == -1.0 and a[0, 9] == 2.0 and d[0, 9] == -1.0  # nothing finite: masked
    for ax in maps:
        cmap, norm = ax.images[0].cmap, ax.images[0].norm
        assert cmap.get_bad().tolist() == [1.0, 0.0, 1.0, 1.0]  # magenta, opaque
        assert not np.allclose(cmap.get_bad(), cmap(norm(0.0)))
        assert np.isfinite(ax.images[0].get_clim()).all()
    # a × at the centre (column, row) of each block holding one, and a line in the title
    assert sorted(_marks(maps[0])) == [(5.0, 95.0), (55.0, 55.0), (95.0, 5.0)]
    assert sorted(_marks(maps[1])) == [(5.0, 95.0)]
    assert sorted(_marks(maps[2])) == [(5.0, 95.0), (55.0, 55.0), (95.0, 5.0)]
    assert maps[0].get_title().endswith("\nNaN/±inf (magenta, ×): 102 elements in 3 blocks")
    assert maps[1].get_title().endswith("\nNaN/±inf (magenta, ×): 1 element in 1 block")
    assert maps[2].get_title().endswith("\nNaN/±inf (magenta, ×): 102 elements in 3 blocks")
    assert "\n(101 NaN/±inf left out)" in fig.axes[3].get_title()

    # Unpooled, an image holds the values as they are, and marks the elements.
    fig = plot_delta(report, "w", bins=(100, 100))
    b = np.asarray(fig.axes[0].images[0].get_array().data)
    assert np.isnan(b[50, 50]) and b[95, 5] == -np.inf and b[0, 0] == 0.0
    assert len(_marks(fig.axes[0])) == 102
    assert fig.axes[0].get_title() == "before\nNaN/±inf (magenta, ×): 102 elements"
    # A tensor with none: no marks and no line.
    report, _ = load("q k")
    fig = plot_delta(report, "qkv")
    assert not any(_marks(ax) for ax in fig.axes)
    assert not any("NaN" in ax.get_title() for ax in fig.axes)


@pytest.mark.parametrize("band", [30, 250])
def test_nan_and_inf_read_a_band_at_a_time_are_marked_as_when_read_at_once(monkeypatch, band):
    # pieces of a row longer than the band (30), and bands of whole rows (250): the
    # blocks marked and the counts in the titles are those of the tensor read at once
    from patchkit import plot

    model = PlainModel({"w": (100, 100)})
    with torch.no_grad():
        model.w.zero_()
        model.w[50, 50] = float("nan")
        model.w[0:10, 90:100] = float("inf")
        model.w[95, 5] = -float("inf")
    idx = torch.arange(10_000)
    idx = idx[idx != 9505]
    report = inspect_load(model, [CheckpointWeightPatch(
        "w", (100, 100), torch.float32, torch.full((9999,), 2.0), idx)])
    at_once = plot_delta(report, "w", bins=(10, 10))
    monkeypatch.setattr(plot, "_BAND", band)
    banded = plot_delta(report, "w", bins=(10, 10))
    for whole, part in zip(at_once.axes[:4], banded.axes[:4]):
        assert part.get_title() == whole.get_title()
        assert sorted(_marks(part)) == sorted(_marks(whole))
    assert sorted(_marks(banded.axes[0])) == [(5.0, 95.0), (55.0, 55.0), (95.0, 5.0)]
    for whole, part in zip(at_once.axes[:3], banded.axes[:3]):
        np.testing.assert_array_equal(np.ma.filled(part.images[0].get_array(), -1.0),
                                      np.ma.filled(whole.images[0].get_array(), -1.0))


def test_block_means_of_numbers_near_float64s_largest_do_not_overflow(recwarn):
    # two of 1e308 summed to inf: pool_mean gave inf, and plot_delta drew each block of a
    # float64 tensor of such numbers in the colour kept for NaN and inf, with no x
    x = np.array([[1e308, 1e308, 1.7e308, -1.7e308]])
    assert pool_mean(x, 1, 2).tolist() == [[1e308, 0.0]]
    big = np.full((600, 4), 1.5e308)
    big[7, 1] = np.nan  # (left out, as before)
    means = pool_mean(big, 7, 2)
    assert np.isfinite(means).all() and np.allclose(means, 1.5e308, rtol=1e-12, atol=0)
    # the rescaled sums are exact where the first ones were: the same bits
    rng = np.random.default_rng(0)
    small = rng.standard_normal((37, 53)) * 1e300
    from patchkit import plot
    assert np.array_equal(plot._pooled(small, 5, 7, scaled=True).mean(), pool_mean(small, 5, 7))
    model = PlainModel({"w": (600, 4)}, dtype=torch.float64, fill=1.5e308)
    report = inspect_load(model, [CheckpointWeightPatch(
        "w", (600, 4), torch.float64, torch.full((2400,), 1.4e308, dtype=torch.float64))])
    fig = plot_delta(report, "w")
    b, a = (np.ma.filled(np.ma.asarray(ax.images[0].get_array()), np.nan) for ax in fig.axes[:2])
    assert b.shape[0] < 600  # (pooled)
    assert np.allclose(b, 1.5e308, rtol=1e-12, atol=0)
    assert np.allclose(a, 1.4e308, rtol=1e-12, atol=0)
    assert not any(_marks(ax) for ax in fig.axes)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def _float64_report(before: list[float], after: list[float]):
    model = PlainModel({"w": (len(before),)}, dtype=torch.float64)
    model.w.data.copy_(torch.tensor(before, dtype=torch.float64))
    return inspect_load(model, [CheckpointWeightPatch(
        "w", (len(after),), torch.float64, torch.tensor(after, dtype=torch.float64))])


def test_delta_refuses_a_colour_scale_matplotlib_cannot_draw_with_a_clear_error():
    # A single change of 1e308 (values and Δ spanning 1e308, under float64's largest)
    # needs a Δ scale from -1e308 to 1e308: matplotlib raised "Axis limits cannot be NaN
    # or Inf" from its colorbar; values 1.6e308 apart, or a change of 8e307 (a scale 1.6e308
    # wide), were drawn until to_png, which raised "arange: cannot compute length" from a
    # tick locator.
    big = float(np.finfo(np.float64).max)
    for before, after, what in [([0.0, 1.0], [1e308, 1.0], "its before and after"),
                                ([0.0, 1.0], [-0.45 * big, 1.0], "its Δ need"),
                                ([-0.9 * big, 1.0], [-0.9 * big, 2.0], "its before and after")]:
        report = _float64_report(before, after)
        with pytest.raises(ValueError, match="wider than half of float64's largest") as info:
            to_png(plot_delta(report, "w"))
        assert str(info.value).startswith(f"plot_delta: 'w' (2,) float64: {what}")
    # up to half of float64's largest: drawn
    for before, after in [([0.0, 1.0], [0.25 * big, 1.0]), ([-0.5 * big, 1.0], [-0.5 * big, 2.0]),
                          ([0.0, 0.0], [0.25 * big, -0.25 * big])]:
        fig = plot_delta(_float64_report(before, after), "w")
        assert to_png(fig).startswith(b"\x89PNG")
        assert fig.axes[2].images[0].get_array().tolist() == [
            [a - b for a, b in zip(after, before)]]


def test_delta_histogram_counts_the_written_elements_each_once():
    model = Shards()
    keep = float(model.qkv[4, 0])  # k's first element: written with its own value
    patches = [sparse("k", [0, 5, 31], [keep, 2.0, -1.0]), sparse("q", [3], [7.0])]
    report = inspect_load(model, patches)
    row = report.deltas.loc["qkv"]
    # A NaN-merged write writes the patched elements only: 3 of k and 1 of q.
    assert (row["elements"], row["changed"]) == (4, 3)
    fig = plot_delta(report, "qkv")
    hist = fig.axes[3]
    assert sum(p.get_height() for p in hist.patches) == 4
    assert hist.get_yscale() == "log"
    fig = plot_delta(report, "qkv", changed_only=True)
    assert sum(p.get_height() for p in fig.axes[3].patches) == 3
    assert "3 changed elements" in fig.axes[3].get_title()


def test_delta_histogram_is_numpys_histogram_of_the_deltas_in_their_own_dtype(monkeypatch):
    # float32 Δ: numpy makes the bars' edges in float32, the 7th of 60 from 0 to 3 at
    # float32(0.35), below 0.35 in float64: a Δ of float32(0.35) is in bar 7, not 6
    from patchkit import plot

    after = torch.tensor([0.0, 3.0, 0.35, 0.7, 1.0, 2.5], dtype=torch.float32)
    model = PlainModel({"w": (6,)}, fill=0.0)
    report = inspect_load(model, [CheckpointWeightPatch("w", (6,), torch.float32, after)])
    want = np.histogram(after.numpy(), bins=60)[0]
    assert want[7] == 1 and want[6] == 0
    hist = plot_delta(report, "w").axes[3]
    assert [p.get_height() for p in hist.patches] == want.tolist()
    monkeypatch.setattr(plot, "_HIST_KEEP", 2)  # (counted on a second pass)
    hist = plot_delta(report, "w").axes[3]
    assert [p.get_height() for p in hist.patches] == want.tolist()
    # float32 Δ from -3e38 to 3e38, a range whose width float32 cannot hold: counted
    model = PlainModel({"w": (2,)})
    with torch.no_grad():
        model.w.copy_(torch.tensor([1.5e38, -1.5e38]))
    report = inspect_load(model, [CheckpointWeightPatch(
        "w", (2,), torch.float32, torch.tensor([-1.5e38, 1.5e38]))])
    fig = plot_delta(report, "w", hist_bins=4)
    bars = fig.axes[3].patches
    assert [p.get_height() for p in bars] == [1, 0, 0, 1]
    assert math.isclose(bars[0].get_x(), -3e38, rel_tol=1e-6)
    assert math.isclose(bars[-1].get_x() + bars[-1].get_width(), 3e38, rel_tol=1e-6)
    assert to_png(fig).startswith(b"\x89PNG")


def test_delta_changed_only_is_a_bool():
    report, _ = load("q")
    for bad in (None, "no", 1):
        with pytest.raises(TypeError, match=r"changed_only must be True or False"):
            plot_delta(report, "qkv", changed_only=bad)
        with pytest.raises(TypeError, match=r"changed_only must be True or False"):
            report.plot_delta("qkv", changed_only=bad)


def test_delta_hist_bins_is_a_positive_int_named_as_such():
    report, _ = load("q")
    for bad, error, match in ((0, ValueError, "hist_bins must be at least 1, got 0"),
                              (-3, ValueError, "hist_bins must be at least 1, got -3"),
                              (True, TypeError, "hist_bins must be a positive int, got bool"),
                              (2.5, TypeError, "hist_bins must be a positive int, got float"),
                              ("60", TypeError, "hist_bins must be a positive int, got str")):
        with pytest.raises(error, match=f"plot_delta: {match}"):
            plot_delta(report, "qkv", hist_bins=bad)
        with pytest.raises(error, match=f"plot_delta: {match}"):
            report.plot_delta("qkv", hist_bins=bad)
    hist = plot_delta(report, "qkv", hist_bins=np.int64(5)).axes[3]
    assert len(hist.patches) == 5


def test_delta_histogram_of_no_elements_does_not_claim_a_log_scale():
    report, _ = load("q")
    assert "norm" not in report.deltas.index
    hist = plot_delta(report, "norm").axes[3]
    assert not hist.patches and hist.get_yscale() == "linear"
    assert hist.get_ylabel() == "elements"  # it said "elements (log scale)"
    hist = plot_delta(report, "qkv").axes[3]
    assert hist.get_yscale() == "log" and hist.get_ylabel() == "elements (log scale)"


def test_delta_of_an_unknown_target_names_it():
    report, _ = load("q")
    with pytest.raises(KeyError, match="nope"):
        plot_delta(report, "nope")


def test_delta_of_a_tensor_with_no_elements_draws_a_note_and_no_images():
    model = PlainModel({"z": (0, 5), "e": (0,), "a": (4,)})
    patches = [CheckpointWeightPatch("z", (0, 5), torch.float32, torch.ones(0)),
               CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))]
    report = inspect_load(model, patches)
    for target, shape in (("z", "(0, 5)"), ("e", "(0,)")):
        fig = plot_delta(report, target)
        (ax,) = fig.axes
        assert not ax.images and not ax.patches and not ax.axison
        assert [t.get_text() for t in ax.texts] == [
            f"{target} {shape} float32: no elements, nothing to draw"
        ]
    with pytest.raises(ValueError, match="bins must be positive"):
        plot_delta(report, "z", bins=0)


def tied_report():
    """A tied-embedding TinyLlama patched through the alias ``lm_head.weight``."""
    model = TinyLlamaRuntime(TinyLlamaConfig(tie_word_embeddings=True), dtype=torch.float32)
    shape = tuple(model.model.embed_tokens.weight.shape)
    p = CheckpointWeightPatch("lm_head.weight", shape, torch.float32,
                              torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 70, 1000]))
    return inspect_load(model, [p]), shape


def test_delta_of_a_tied_alias_draws_the_tensor_it_is_tied_to():
    report, shape = tied_report()
    emb = "model.embed_tokens.weight"
    assert "lm_head.weight" not in report.targets
    fig = plot_delta(report, "lm_head.weight", bins=shape)
    b, a, d = (np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images)
    np.testing.assert_array_equal(b, report.before(emb).numpy())
    np.testing.assert_array_equal(a, report.after(emb).numpy())
    assert np.count_nonzero(d) == 3
    assert sum(p.get_height() for p in fig.axes[3].patches) == 3
    title = fig.get_suptitle()
    assert title.startswith(f"lm_head.weight (tied to {emb}) (256, 64) float32: 3 elements")


def test_placement_of_a_tied_alias_draws_the_tensor_it_is_tied_to():
    report, _ = tied_report()
    fig = plot_placement(report, targets=["lm_head.weight"])
    assert fig.axes[1].get_title() == (
        "runtime lm_head.weight (tied to model.embed_tokens.weight) (256, 64):\n"
        "1 write, 3 elements written of 16,384 in its view"
    )
    (i,) = report.writes.index
    assert rects_by_gid(fig, "write ")[f"write {i} runtime"]


def test_delta_ticks_are_whole_rows_and_columns():
    model = PlainModel({"w": (3, 5)})
    report = inspect_load(model, [CheckpointWeightPatch("w", (3, 5), torch.float32,
                                                        torch.ones(15))])
    maps = [ax for ax in plot_delta(report, "w").axes if ax.images]
    assert len(maps) == 3
    for ax in maps:
        for ticks, (lo, hi) in ((ax.get_xticks(), ax.get_xlim()),
                                (ax.get_yticks(), sorted(ax.get_ylim()))):
            shown = [t for t in ticks if lo <= t <= hi]
            assert len(shown) >= 2 and all(t == int(t) for t in shown), shown


@pytest.mark.parametrize("rows, cols, row_at, col_at", [
    (128, 64, 64, 32),      # (decimal steps gave 0, 15, 30, ...: no tick at 64, gate | up)
    (96, 3072, 32, 1024),   # (3 * 1024 columns: 0, 400, 800, ... before)
    (100, 7, None, None),   # (no power of two divides 100 often enough: decimal steps)
])
def test_heat_map_ticks_fall_on_multiples_of_a_power_of_two_where_the_size_is_one(
        rows, cols, row_at, col_at):
    model = PlainModel({"w": (rows, cols)})
    p = CheckpointWeightPatch("w", (rows, cols), torch.float32, torch.ones(rows * cols))
    report = inspect_load(model, [p])
    for fig in (plot_delta(report, "w"), plot_density(p, bins=(rows, cols)),
                plot_placement(report)):
        drawn(fig)
        maps = [ax for ax in fig.axes if ax.images or ax.get_xlabel() == "runtime column"]
        assert maps
        for ax in maps:
            for ticks, (lo, hi), n, at in (
                    (ax.get_yticks(), sorted(ax.get_ylim()), rows, row_at),
                    (ax.get_xticks(), ax.get_xlim(), cols, col_at)):
                shown = [int(t) for t in ticks if lo <= t <= hi]
                if at is None:  # matplotlib's: 0, 20, ... rows; 0, 1, ... columns
                    assert all(t % 10 == 0 for t in shown) if n == 100 else shown == list(
                        range(n + 1)), shown
                    continue
                # 0 to n in steps of a power of two (as many as the panel has room for),
                # with a tick at ``at`` (a packing boundary)
                step = shown[1] - shown[0]
                assert step & (step - 1) == 0 and shown == list(range(0, n + 1, step)), shown
                assert at in shown, shown


def test_power_of_two_ticks_take_the_smallest_step_that_fits_and_none_where_none_divides():
    from patchkit.plot import _power_of_two_ticks

    assert _power_of_two_ticks(0, 128, 9) == [float(t) for t in range(0, 129, 16)]
    assert _power_of_two_ticks(128, 0, 4) == [0.0, 32.0, 64.0, 96.0, 128.0]  # (y inverted)
    assert _power_of_two_ticks(0, 2560, 9) == [float(t) for t in range(0, 2561, 512)]
    # a vocabulary of 128,256 = 501 * 256 rows; a view not from 0; 6 rows at step 2 is
    # fine, 8 rows at step 1 is not a power-of-two step (matplotlib's then)
    assert _power_of_two_ticks(0, 128256, 9) is None
    assert _power_of_two_ticks(16, 128, 9) is None
    assert _power_of_two_ticks(0, 6, 3) == [0.0, 2.0, 4.0, 6.0]
    assert _power_of_two_ticks(0, 8, 9) is None


def test_tall_tensors_number_their_rows_in_full_without_a_1e6_multiplier():
    n = 1_000_000
    model = PlainModel({"col": (n, 1)})
    p = CheckpointWeightPatch("col", (n, 1), torch.float32, torch.ones(3),
                              torch.tensor([0, n // 2, n - 1]))
    report = inspect_load(model, [p])
    for fig in (plot_density(p), plot_delta(report, "col"), plot_placement(report)):
        drawn(fig)
        rows = [ax for ax in fig.axes if ax.get_ylabel().endswith(" row")]
        assert rows
        for ax in rows:
            assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e6" over the axes
            assert "1,000,000" in [t.get_text() for t in ax.get_yticklabels()]


LONG = "model." + ".".join(f"block_with_a_rather_long_name_{i}" for i in range(8)) + ".weight"


def test_long_names_are_cut_to_their_tail_keeping_shape_and_numbers_on_the_figure():
    model = PlainModel({LONG: (32, 48)})
    p = CheckpointWeightPatch(LONG, (32, 48), torch.float32, torch.ones(3),
                              torch.tensor([0, 100, 1535]))
    report = inspect_load(model, [p])
    density, delta, placement = plot_density(p), plot_delta(report, LONG), plot_placement(report)
    suptitle = next(t for t in delta.texts if t.get_text() == delta.get_suptitle())
    for fig, titles in ((density, [density.axes[0].title]), (delta, [suptitle]),
                        (placement, [ax.title for ax in placement.axes])):
        renderer = drawn(fig)
        for t in titles:
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (t.get_text(), box)
    ck, rt = placement.axes[0].title, placement.axes[1].title  # renderer: placement's
    assert not ck.get_window_extent(renderer).overlaps(rt.get_window_extent(renderer))

    tail = "long_name_7.weight"
    title = density.axes[0].get_title()
    assert title.startswith("…") and f"{tail}  (32, 48) float32\n" in title
    assert "sparse: writes 3 of 1,536 elements" in title
    head = delta.get_suptitle()
    assert head.startswith("…") and f"{tail} (32, 48) float32:\n3 elements written" in head
    title = rt.get_text()
    counts = "1 write, 3 elements written of 1,536 in its view"
    assert title.startswith("runtime …") and f"{tail} (32, 48):\n{counts}" in title
    assert LONG not in title + head  # cut: the whole name would run off the figure


def test_placement_rows_of_long_names_differing_only_in_the_cut_part_are_titled_apart():
    # six names of 111 characters that differ only in the layer number: each row's title
    # was cut to the same tail, "runtime …n_block.some_long…weight", so the rows looked
    # alike; now each keeps its head through the layer number, and still fits
    tail = "cross_attention_block.some_long_submodule_name.another_long_part.last_part.weight"
    names = [f"model.decoder.layers.{i}.{tail}" for i in range(6)]
    model = PlainModel(dict.fromkeys(names, (8, 8)))
    ps = [CheckpointWeightPatch(n, (8, 8), torch.float32, torch.ones(3), torch.tensor([0, 9, 63]))
          for n in names]
    fig = plot_placement(inspect_load(model, ps))
    titles = [ax.title for ax in fig.axes[1::2]]
    firsts = [t.get_text().split("\n")[0] for t in titles]
    for i, first in enumerate(firsts):
        assert first.startswith(f"runtime model.decoder.layers.{i}.…") and first.endswith(
            ".last_part.weight (8, 8):"), first
        assert names[i] not in first  # still cut
    renderer = drawn(fig)
    for t in titles:
        box = t.get_window_extent(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (t.get_text(), box)
    # a name that is the only long one keeps the cut to its tail (see the test above)
    (one,) = plot_placement(inspect_load(model, ps[:1])).axes[1::2]
    assert one.get_title().startswith("runtime …")


def test_placement_names_a_rows_sources_that_share_a_tail_apart():
    # fused experts: six checkpoint tensors into one runtime tensor; the checkpoint
    # side's names and the labels on the runtime side were cut to their last two parts,
    # "…gate_proj.weight" three times over
    from patchkit.toymodels import OverlappingDestinationsModel

    names = [f"model.layers.0.mlp.experts.{e}.{w}.weight"
             for e in range(3) for w in ("gate_proj", "up_proj")]
    model = OverlappingDestinationsModel(dict.fromkeys(names, (4, 4)))
    fig = plot_placement(inspect_load(model, [
        CheckpointWeightPatch(n, (4, 4), torch.float32, torch.ones(16)) for n in names]))
    ax_ck, ax_rt = fig.axes
    want = [f"…{e}.{w}.weight" for e in range(3) for w in ("gate_proj", "up_proj")]
    assert [t.get_text().split("\n")[0] for t in ax_ck.get_yticklabels()] == want
    assert [t.get_text() for t in ax_rt.texts] == want


def test_placement_escapes_a_rows_names_once_not_once_per_label(monkeypatch):
    # A row of 64 writes labels each one (region, legend) apart from the row's other
    # names: those names were escaped for drawing (a name read from a file may hold a
    # \r) again for every label, 64 x 64 x 2 escapes of a name as long as the file made
    # it, where one per write does (a 10,000-character name: 0.4 s -> 3.8 s)
    import patchkit.plot as pk_plot

    name = "model." + "lay\rer" * 50 + ".q_proj.weight"
    model = PlainModel({name: (8, 8)})
    report = inspect_load(model, [CheckpointWeightPatch(name, (8, 8), torch.float32,
                                                        torch.ones(1), torch.tensor([i]))
                                  for i in range(64)])
    calls = []
    escape = pk_plot._drawable
    monkeypatch.setattr(pk_plot, "_drawable", lambda t: calls.append(t) or escape(t))
    fig = plot_placement(report)
    assert len(calls) < 4 * 64, len(calls)  # (a few per write, not one per pair of them)
    ax_rt = fig.axes[1]
    assert "\\r" in ax_rt.get_title() and "\r" not in ax_rt.get_title()


def test_placement_cuts_realistic_names_to_their_last_parts_as_before():
    model = TinyLlamaRuntime(TinyLlamaConfig(), dtype=torch.float32)
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
              "self_attn.v_proj": (32, 64)}
    ps = [CheckpointWeightPatch(f"model.layers.{i}.{m}.weight", shape, torch.float32,
                                torch.ones(3), torch.tensor([0, 5, 9]))
          for i in range(2) for m, shape in shapes.items()]
    fig = plot_placement(inspect_load(model, ps))
    for i, (ax_ck, ax_rt) in enumerate(zip(fig.axes[::2], fig.axes[1::2], strict=True)):
        assert ax_rt.get_title().startswith(f"runtime model.layers.{i}.self_attn.qkv_proj.weight")
        legend = [t.get_text().split(" [")[0] for t in ax_rt.get_legend().get_texts()]
        assert legend == [f"#{3 * i + k} …self_attn.{x}_proj.weight" for k, x in enumerate("qkv")]
        assert [t.get_text() for t in ax_rt.texts] == [f"…{x}_proj.weight" for x in "qkv"]
        assert [t.get_text().split("\n")[0] for t in ax_ck.get_yticklabels()] == [
            f"…{x}_proj.weight" for x in "qkv"]


@pytest.mark.parametrize(("name", "other", "n", "shown"), [
    # the whole name fits: drawn whole rather than cut
    ("a.b.c", "x.b.c", 24, "a.b.c"),
    # another name that is the tail itself ends with it: a longer tail
    ("model.layers.3.gate.weight", "3.gate.weight", 24, "…layers.3.gate.weight"),
    # "13.gate.weight" does not end with the dotted tail "3.gate.weight"
    ("model.layers.3.gate.weight", "model.layers.13.gate.weight", 24, "…3.gate.weight"),
    ("model.layers.13.gate.weight", "model.layers.3.gate.weight", 24, "…13.gate.weight"),
    # the own tail exactly fills the n characters
    ("model.layers.0.mlp.experts.10.gate_proj.weight",
     "model.layers.0.mlp.experts.11.gate_proj.weight", 20, "…10.gate_proj.weight"),
    # no own tail fits: the own head, "…" and the longest tail that fills the n characters
    ("m.1.some_long_module_name.another_long_part.weight",
     "m.2.some_long_module_name.another_long_part.weight", 24, "m.1.…er_long_part.weight"),
    # no dotted part tells them apart: the cut, still within n
    ("a" * 30 + "x" + "b" * 30, "a" * 30 + "y" + "b" * 30, 24, "…" + "b" * 23),
])
def test_a_cut_name_keeps_what_tells_it_from_the_names_beside_it(name, other, n, shown):
    # (mutation testing: drawing the cut where the whole name fits, dropping the "o ==
    # tail" or the dot of the dotted-tail check, "<" for "<=" at either fit, one more
    # character of room, one less of tail, and the whole name where nothing fits passed
    # every plot test; each case here fails with one of them and passes on the code)
    import patchkit.plot as pk_plot

    assert pk_plot._short(name, n, parts=2, among=[name, other]) == shown
    assert len(shown) <= n


def test_fitting_a_name_apart_keeps_the_head_within_half_the_width_and_the_cut_within_it():
    import patchkit.plot as pk_plot

    def row(i):
        return f"model.decoder.layers.{i}." + "tail_part." * 10 + "weight"

    head = pk_plot._text_width("model.decoder.layers.1.", 9)
    for width, keeps_head in ((1.9 * head, False), (2.4 * head, True)):
        shown = pk_plot._fit(row(1), 9, width, among=[row(1), row(2)])
        # (the head took more than half the width where only the width bounded it)
        assert shown.startswith("model.decoder.layers.1.…") == keeps_head, (width, shown)
        assert pk_plot._text_width(shown, 9) <= width
    # where the head, "…" and one character do not fit, the plain cut
    assert pk_plot._fit("i.xxxxxxxx.W", 9, 20.0, among=["j.xxxxxxxx.W"]) == "…W"


def test_cutting_names_apart_measures_only_what_can_fit():
    # a name of 3,000 parts whose own tail starts 9,000 characters from its end: walking
    # the tails past what fits, or measuring the whole name, measured 9,000 characters
    import patchkit.plot as pk_plot

    name, other = ("layer." * 1500 + f"{c}." + "layer." * 1500 + "weight" for c in "ab")
    measured = []

    def size(text):
        measured.append(len(text))
        return len(text)

    assert pk_plot._apart(name, "…" + name[-29:], [other], size, 30, 30) == "…" + name[-29:]
    assert max(measured, default=0) <= 31


def test_a_tied_title_cuts_each_half_apart_from_the_other_rows():
    # (mutation testing: cutting the tied half of a title without the other rows' names
    # passed every plot test; the rows' titles then read the same)
    import patchkit.plot as pk_plot

    tail = "cross_attention_block.some_long_submodule_name.another_long_part.weight"
    rows = [f"model.decoder.layers.{i}.{tail}" for i in range(2)]
    tied = "model.embed_tokens.weight"
    width = 2 * 250.0 + pk_plot._text_width(" (tied to )", 9)
    titles = [pk_plot._shown_name(r, tied, 9, width, [*rows, tied]) for r in rows]
    assert titles[0] != titles[1]
    assert all(t.startswith(f"model.decoder.layers.{i}.…") for i, t in enumerate(titles))
    assert all(pk_plot._text_width(t, 9) <= width for t in titles)


def test_placement_legend_names_a_rows_sources_that_share_their_last_three_parts_apart():
    # (mutation testing: the legend's cut without the row's other names passed every plot
    # test: the three entries read "#k …w.gate_proj.weight")
    from patchkit.toymodels import OverlappingDestinationsModel

    names = [f"model.layers.0.mlp.experts.{e}.w.gate_proj.weight" for e in range(3)]
    model = OverlappingDestinationsModel(dict.fromkeys(names, (4, 4)))
    fig = plot_placement(inspect_load(model, [
        CheckpointWeightPatch(n, (4, 4), torch.float32, torch.ones(16)) for n in names]))
    legend = [t.get_text().split(" [")[0] for t in fig.axes[1].get_legend().get_texts()]
    assert legend[:3] == [f"#{e} …{e}.w.gate_proj.weight" for e in range(3)]


@pytest.mark.parametrize("name", ["layer$_{0}$.weight", "price$\\notacommand$.weight"])
def test_names_with_dollar_signs_are_drawn_as_written_not_as_mathtext(name):
    model = PlainModel({name: (8, 8)})
    p = CheckpointWeightPatch(name, (8, 8), torch.float32, torch.ones(40), torch.arange(40))
    report = inspect_load(model, [p])
    tag = name.removesuffix(".weight")
    for fig, shown in ((plot_density(p), name), (plot_chunks(report), tag),
                       (plot_placement(report), name), (plot_delta(report, name), name)):
        drawn(fig)  # "price$\notacommand$" as mathtext raises ValueError here
        texts = [*fig.texts]
        for ax in fig.axes:
            legend = ax.get_legend()
            texts += [ax.title, *ax.texts, *ax.get_yticklabels(),
                      *(legend.get_texts() if legend else [])]
        named = [t for t in texts if "$" in t.get_text()]
        assert any(shown in t.get_text() for t in named)
        assert not any(t.get_parse_math() for t in named)


STALE = ("\nwarning: the model changed after this load: the images show its current values, "
         "the numbers are the load's")


def test_delta_warns_once_the_model_changed_after_the_load():
    model = Shards()
    report = inspect_load(model, [sparse("q", [0, 1, 2], [1.0, 2.0, 3.0])])
    head = plot_delta(report, "qkv").get_suptitle()
    assert "3 elements written, 3 changed" in head and "warning" not in head
    assert "warning" not in plot_delta(report, "qkv").get_suptitle()  # drawing changes nothing
    inspect_load(model, [sparse("q", [0, 1, 2], [4.0, -5.0, 6.0])])  # new values, same elements
    head = plot_delta(report, "qkv").get_suptitle()
    assert head.endswith(STALE) and "3 elements written, 3 changed" in head


def test_delta_warns_once_another_load_put_back_what_the_load_changed():
    model = Shards()
    old = float(model.qkv[0, 0])
    report = inspect_load(model, [sparse("q", [0, 1, 2], [1.0, 20.0, 3.0])])
    assert not plot_delta(report, "qkv").get_suptitle().endswith(STALE)
    # Element 0 put back: 2 of the 3 differ now, the largest |Δ| (element 1's) is the same.
    inspect_load(model, [sparse("q", [0], [old])])
    assert plot_delta(report, "qkv").get_suptitle().endswith(STALE)


def test_delta_of_a_tensor_a_rollback_put_back_says_so(unrestorable):
    # the title said "not written by this load" of a tensor the load wrote and its
    # transactional rollback then restored
    from patchkit.toymodels import FailingModel

    ps = [CheckpointWeightPatch(n, (4, 4), torch.float32, torch.ones(16)) for n in "abc"]
    with pytest.raises(RuntimeError) as info:
        inspect_load(FailingModel({"a": (4, 4), "b": (4, 4), "c": (4, 4)}, fail_on="c"), ps,
                     max_chunk_bytes=64, transactional=True)
    report = info.value.report
    assert report.rolled_back and "a" not in report.deltas.index
    fig = plot_delta(report, "a")
    assert fig.get_suptitle() == (
        "a (4, 4) float32: written by this load, then put back as it was by its "
        "transactional rollback")
    assert [t.get_text() for t in fig.axes[3].texts] == ["written, then put back by the rollback"]

    # A rollback that could not put "b" back: "a" was put back, "b" keeps its row.
    unrestorable("b")
    with pytest.raises(RuntimeError, match="rollback incomplete") as info:
        inspect_load(FailingModel({"a": (4, 4), "b": (4, 4), "c": (4, 4)}, fail_on="c"), ps,
                     max_chunk_bytes=64, transactional=True)
    report = info.value.report
    assert not report.rolled_back
    assert "then put back" in plot_delta(report, "a").get_suptitle()
    assert plot_delta(report, "b").get_suptitle().startswith(
        "b (4, 4) float32: 16 elements written, 16 changed")
    # A tensor the load never wrote is still "not written".
    assert plot_delta(report, "c").get_suptitle().endswith("not written by this load")


def test_delta_after_an_observed_loaders_own_rollback_says_so_as_after_patchkits():
    # loader=: a loader that is itself transactional undid its writes and raised; the
    # report reads as after patchkit's own rollback, so its figure says the same
    from patchkit import load_checkpoint_weight_patches
    from patchkit.toymodels import FailingModel

    def transactional_loader(model, patches, **kw):
        return load_checkpoint_weight_patches(model, patches, **{**kw, "transactional": True})

    ps = [CheckpointWeightPatch(n, (4, 4), torch.float32, torch.ones(16)) for n in "ac"]
    titles = []
    for kw in ({"transactional": True}, {"loader": transactional_loader}):
        with pytest.raises(RuntimeError) as info:
            inspect_load(FailingModel({"a": (4, 4), "c": (4, 4)}, fail_on="c"), ps, **kw)
        report = info.value.report
        assert report.rolled_back
        titles.append(plot_delta(report, "a").get_suptitle())
    assert titles[0] == titles[1] and "then put back" in titles[0]


# -- display -------------------------------------------------------------------------------


def test_figures_render_as_png_once_and_stay_out_of_pyplot():
    import matplotlib.pyplot as plt

    from patchkit.plot import ReportFigure

    report, _ = load("q k")
    open_before = plt.get_fignums()
    figs = [report.plot_chunks(), report.plot_density("q"), report.plot_placement(),
            report.plot_delta("qkv")]
    assert plt.get_fignums() == open_before  # nothing for the inline backend to re-show
    assert all(isinstance(fig, ReportFigure) for fig in figs)
    png = figs[0]._repr_png_()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert png == report.plot_chunks()._repr_png_()  # deterministic: no time, no seed


def test_plotting_never_imports_pyplot(monkeypatch):
    # With pyplot made unimportable, every figure must still build and render.
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    report, _ = load("q k")
    figs = [report.plot_chunks(), report.plot_density("q"), report.plot_placement(),
            report.plot_delta("qkv")]
    assert len(figs) == 4
    assert figs[0]._repr_png_().startswith(b"\x89PNG")


class Tied(nn.Module):
    """``head`` is ``embed``'s tied alias (one Parameter, two names)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(4), False)
        self.head = self.embed

    def load_weights(self, weights):
        for _, t in weights:
            self.embed.data.copy_(t)
        return {n for n, _ in weights}


def test_density_of_a_report_patch_the_load_dropped_or_renamed_says_so_in_its_title():
    def patch(name, i):
        return CheckpointWeightPatch(name, (4,), torch.float32, torch.tensor([5.0]),
                                     torch.tensor([i]))

    with pytest.warns(UserWarning, match="patch 1 .* is not loaded"):
        r = inspect_load(Tied(), [patch("embed", 1), patch("head", 2)])
    title = r.plot_density("head").axes[0].get_title()
    assert "(dropped: tied alias of a weight patched in the same call)" in title
    assert "dropped" not in r.plot_density("embed").axes[0].get_title()
    r = inspect_load(Tied(), [patch("head", 2)])
    assert "(renamed from 'head' (tied alias))" in r.plot_density(r.patches[0]).axes[0].get_title()
    # named as chunks shows it, the name it was sent under, as well as by its own
    assert r.chunks["name"].tolist() == ["embed"]
    for name in ("embed", "head"):
        assert "(renamed from 'head'" in r.plot_density(name).axes[0].get_title()


# -- audit cases ---------------------------------------------------------------------------


def test_segments_of_one_call_are_stacked_one_on_another():
    ps = chunk_patches()
    plan = plan_chunks(ps, 300)
    fig = plot_chunks(ps, max_chunk_bytes=300)
    segments = rects_by_gid(fig, "segment ")
    for c in plan:
        bottom = 0
        for pos in c.positions:
            (rect,) = segments[f"segment {c.index} {pos}"]
            assert rect.get_y() == bottom
            bottom += staged_nbytes(ps[pos])


def test_a_budget_above_the_scale_is_still_drawn_at_max_chunk_bytes():
    ps = chunk_patches()
    fig = plot_chunks(ps, max_chunk_bytes=100_000)  # far above the tallest call (800 B)
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.lines if ln.get_gid() == "budget"]
    assert list(line.get_ydata()) == [100_000, 100_000]
    assert ax.get_ylim()[1] < 100_000  # above the visible range, as the note says
    assert any("(above this scale)" in t.get_text() for t in ax.texts)


def test_the_legend_lists_the_budget_line_only_where_it_is_in_view():
    ps = chunk_patches()
    for budget, in_view in ((100_000, False), (300, True)):
        ax = plot_chunks(ps, max_chunk_bytes=budget).axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        listed = [t for t in legend if t.startswith("max_chunk_bytes")]
        note = [t.get_text() for t in ax.texts if "(above this scale)" in t.get_text()]
        # (off the scale, the legend listed a dashed line the figure did not show)
        assert listed == ([f"max_chunk_bytes ({format_bytes(budget)})"] if in_view else [])
        assert note == ([] if in_view else [f"max_chunk_bytes = {format_bytes(budget)} "
                                            "(above this scale)"])
        assert any(t.startswith("closed by") for t in legend)


def test_chunk_plan_title_counts_the_patches_the_plan_sends():
    ps = [CheckpointWeightPatch(n, (4,), torch.float32, torch.tensor([5.0]), torch.tensor([i]))
          for i, n in enumerate(["embed", "head"])]
    with pytest.warns(UserWarning, match="patch 1 .* is not loaded"):
        r = inspect_load(Tied(), ps)  # head is embed's tied alias: dropped from the call
    assert [c.positions for c in r.plan] == [(0,)]
    title = r.plot_chunks().axes[0].get_title()
    assert title.startswith("Chunk plan: 1 patch, ")  # the sent one, in the singular


def test_density_colour_scale_runs_to_the_densest_block():
    # a quarter of the first block's elements at most: the scale tops out at 0.25
    p = CheckpointWeightPatch("w", (8, 8), torch.float32, torch.ones(4),
                              torch.tensor([0, 1, 8, 9]))
    im = plot_density(p, bins=(2, 2)).axes[0].images[0]
    assert float(np.asarray(im.get_array()).max()) == 0.25
    assert im.get_clim() == (0.0, 0.25)
    # from 0 whatever the sparsest block: a dense patch's scale is 0 to 1
    full = CheckpointWeightPatch("w", (8, 8), torch.float32, torch.ones(64))
    fig = plot_density(full, bins=(2, 2))
    assert fig.axes[0].images[0].get_clim() == (0.0, 1.0)
    assert fig.axes[1].get_ylim() == (0.0, 1.0)  # (the colour bar)


def test_density_bins_on_a_callers_large_axes_are_capped_at_max_bins():
    p = CheckpointWeightPatch("w", (2048, 2048), torch.float32, torch.tensor([5.0]),
                              torch.tensor([7]))
    mine = Figure(figsize=(30, 30), dpi=100)
    FigureCanvasAgg(mine)
    ax = mine.add_subplot()
    assert min(ax.get_window_extent().height, 0.8 * ax.get_window_extent().width) > 1024
    plot_density(p, bins=2000, ax=ax)
    assert ax.images[0].get_array().shape == (1024, 1024)
    assert "1024 × 1024 blocks" in ax.get_title()


def test_delta_title_gives_the_largest_change_of_the_row():
    report, _ = load("q k")
    row = report.deltas.loc["qkv"]
    assert f"{row['max_abs']:.3g}" != f"{row['mean_abs']:.3g}"
    title = plot_delta(report, "qkv").get_suptitle()
    assert f"max |Δ| {row['max_abs']:.3g}, relative L2 change {row['rel_l2']:.3g}" in title


def test_placement_names_a_write_only_inside_a_region_big_enough_for_its_label():
    class Corner(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(16, 16), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                if name == "small":
                    self.w.data[0:1, 0:1].copy_(t[0:1, 0:1])  # 1/16 of the rows
                else:
                    self.w.data[4:12, 4:12].copy_(t[4:12, 4:12])  # half the rows and columns
            return {n for n, _ in weights}

    for name, labelled in (("small", False), ("big", True)):
        p = CheckpointWeightPatch(name, (16, 16), torch.float32, torch.ones(256))
        fig = plot_placement(inspect_load(Corner(), [p]))
        labels = [t.get_text() for t in fig.axes[1].texts]
        assert (name in labels) == labelled, (name, labels)


# -- labels a reader can read ----------------------------------------------------------


def _long_named_plan():
    """Six calls (narrow bars) at a budget of 4 KiB: the first holds one tall 3 KiB
    segment with a name too long to fit across its bar, and a short 64-B one."""
    big = CheckpointWeightPatch("model.embed_tokens.weight", (768,), torch.float32,
                                torch.zeros(768))
    tiny = CheckpointWeightPatch("model.layers.0.input_layernorm.weight", (16,),
                                 torch.float32, torch.zeros(16))
    rest = [CheckpointWeightPatch(f"w{i}", (1024,), torch.float32, torch.zeros(1024))
            for i in range(5)]
    return [big, tiny, *rest]


def test_a_tall_segment_too_narrow_for_its_name_is_labelled_upright():
    ps = _long_named_plan()
    fig = plot_chunks(ps, max_chunk_bytes=4096)
    labels = {t.get_text(): t for t in fig.axes[0].texts if t.get_gid() == "segment label"}
    assert "embed_tokens" in labels and labels["embed_tokens"].get_rotation() == 90
    # the short one is too short for its name either way: no label rather than overflow
    assert "input_layernorm" not in labels
    # names that fit across stay across
    assert all(labels[f"w{i}"].get_rotation() == 0 for i in range(1, 5) if f"w{i}" in labels)
    assert any(f"w{i}" in labels for i in range(5))


def test_closing_reasons_sit_on_a_box_that_hides_the_budget_line_behind_them():
    fig = plot_chunks(chunk_patches(), max_chunk_bytes=300)
    labels = [t for t in fig.axes[0].texts if t.get_gid() == "closed_by"]
    assert labels
    for t in labels:
        box = t.get_bbox_patch()
        assert box is not None and box.get_facecolor()[:3] == (1.0, 1.0, 1.0)
        line = next(ln for ln in fig.axes[0].lines if ln.get_gid() == "budget")
        assert t.get_zorder() > line.get_zorder()  # drawn over it


def test_a_label_on_a_hatched_bar_has_a_stroke_of_the_bars_colour():
    fig = plot_chunks(chunk_patches(), max_chunk_bytes=300)
    ax = fig.axes[0]
    hatched = {int(gid.split()[1]) for gid, rects in rects_by_gid(fig, "segment ").items()
               if rects[0].get_hatch()}
    seen = 0
    for t in ax.texts:
        if t.get_gid() != "segment label":
            continue
        effects = t.get_path_effects()
        if round(t.get_position()[0]) in hatched:
            assert effects and effects[0]._gc["foreground"] is not None
            seen += 1
        else:
            assert not effects
    assert seen  # the repeated-name and end bars are hatched and labelled


def test_density_title_counts_an_index_given_twice_once():
    # (loadable with validate_unique_indices=False): the heat map counts it once, so does
    # the title
    p = CheckpointWeightPatch("w", (2,), torch.float32, torch.tensor([1.0, 2.0, 3.0]),
                              torch.tensor([0, 0, 0]))
    title = plot_density(p).axes[0].get_title()
    assert "writes 1 of 2 elements (50" in title


def test_density_title_says_a_dense_patch_writes_every_element():
    p = CheckpointWeightPatch("w", (3, 4), torch.float32, torch.zeros(12))
    title = plot_density(p).axes[0].get_title()
    assert "dense: writes 12 of 12 elements (100 %)" in title


class _AnyName(nn.Module):
    """One runtime tensor ``w`` that every patch, whatever its name, is copied into."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(t)
        return {"w"}


@pytest.mark.parametrize("name, escaped, raw", [
    # (a patch file's JSON header may hold "\ud800": matplotlib's font code raised
    # TypeError when the figure was drawn, and `inspect --out` crashed)
    ("model.w\ud800.weight", "\\ud800", "\ud800"),
    # ("\r" in a name cut the title and legend entry it was in, "Glyph missing" besides)
    ("model.cr\rret\n.weight", "cr\\rret\\n", "\r"),
], ids=["lone surrogate", "control characters"])
def test_a_name_that_is_not_printable_is_drawn_escaped(name, escaped, raw):
    import io

    dense = CheckpointWeightPatch(name, (4, 4), torch.float32, torch.ones(16))
    sparse = CheckpointWeightPatch(name, (4, 4), torch.float32, torch.ones(2),
                                   torch.tensor([1, 5]))
    figs = [plot_chunks([dense, sparse], 64), plot_density(sparse)]
    for p in (dense, sparse):
        r = inspect_load(_AnyName(), [p])
        figs += [r.plot_placement(), r.plot_delta("w"), r.plot_chunks()]
    texts = []
    for fig in figs:
        fig.savefig(io.BytesIO(), format="png")  # (drawn: the font code sees every text)
        texts += [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert any(escaped in t for t in texts)
    assert not any(raw in t for t in texts)


def test_fitting_a_very_long_name_measures_only_what_can_fit(monkeypatch):
    # (a 1.6 M-character name took 34 s: every probe measured up to the whole name)
    import patchkit.plot as pk_plot

    widths = []
    real = pk_plot._text_width

    def measured(text, size):
        widths.append(len(text))
        return real(text, size)

    monkeypatch.setattr(pk_plot, "_text_width", measured)
    name = "layer." * 200_000 + "q_proj.weight"
    shown = pk_plot._fit(name, 10, 300.0)
    assert shown.startswith("…") and shown.endswith("q_proj.weight")
    assert real(shown, 10) <= 300.0
    assert max(widths) <= 300 / 2 + 2 and len(widths) <= 20


def collection_segments(fig: Figure) -> dict[str, tuple[float, float, float, str]]:
    """The segments that plot_chunks drew as collections: gid -> (x0, bottom, height,
    hatch), read from the paths of the collections with gid "segments"."""
    out = {}
    for coll in fig.axes[0].collections:
        if coll.get_gid() != "segments":
            continue
        for gid, path in zip(coll.segment_gids, coll.get_paths(), strict=True):
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            assert round(x1 - x0, 9) == 0.8
            out[gid] = (x0, y0, y1 - y0, coll.get_hatch() or "")
    return out


def test_thousands_of_calls_are_drawn_as_collections_with_the_same_segments():
    # 1500 calls of two 1 KiB patches each, every 100th patch over budget on its own
    ps = [CheckpointWeightPatch(f"layers.{i}.w", (16, 16 if i % 100 else 48), torch.float32,
                                torch.zeros(256 if i % 100 else 768)) for i in range(3000)]
    plan = plan_chunks(ps, 2048)
    assert len(plan) > 1000 and any(c.over_budget for c in plan)
    fig = plot_chunks(ps, max_chunk_bytes=2048)
    assert not rects_by_gid(fig, "segment ")  # no Rectangle per segment
    segs = collection_segments(fig)
    want = {f"segment {c.index} {p}" for c in plan for p in c.positions}
    assert set(segs) == want
    totals: dict[int, float] = {}
    for gid, (x0, _y0, h, _) in segs.items():
        call, pos = map(int, gid.split()[1:])
        assert round(x0 + 0.4, 9) == call and h == staged_nbytes(ps[pos])
        totals[call] = totals.get(call, 0) + h
    assert totals == {c.index: c.bytes for c in plan}
    # stacked: within a call, each segment starts where the one below it ends
    for c in plan:
        tops = [0.0]
        for p in c.positions:
            x0, y0, h, _ = segs[f"segment {c.index} {p}"]
            assert y0 == tops[-1]
            tops.append(y0 + h)
    # bars this narrow carry no hatch, and nothing is annotated past 60 calls; an
    # over-budget call is filled red, with no edge (a red edge as wide as before spilt
    # over its neighbours: 57 % of calls over budget drew as 98 % red)
    assert all(hatch == "" for *_, hatch in segs.values())
    ax = fig.axes[0]
    assert not [t for t in ax.texts if t.get_gid() in ("closed_by", "over_budget")]
    (coll,) = [c for c in ax.collections if c.get_gid() == "segments"]
    over = {f"segment {c.index} {c.positions[0]}" for c in plan if c.over_budget}
    red = matplotlib.colors.to_rgba("#C44E52")
    faces = dict(zip(coll.segment_gids, map(tuple, coll.get_facecolors())))
    assert {g for g, f in faces.items() if f[:3] == red[:3]} == over
    widths = dict(zip(coll.segment_gids, coll.get_linewidths()))
    assert all(widths[g] == 0 for g in over)
    legend = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(),
                                               ax.get_legend().legend_handles)}
    assert legend["one patch over budget (travels alone)"].get_facecolor()[:3] == red[:3]
    FigureCanvasAgg(fig).draw()  # and it draws


def test_an_over_budget_bar_too_narrow_for_its_hatch_is_filled_red():
    # 150 calls, every other one a patch over budget: bars about 4 pt wide, drawn one
    # Rectangle a segment. Their 2-pt red edges spilt over the bars beside them (57 % of
    # the calls over budget drew as 66 % red); they are filled red, with no edge
    ps = [CheckpointWeightPatch(f"w{i}", (16, 16 if i % 2 else 48), torch.float32,
                                torch.zeros(256 if i % 2 else 768)) for i in range(150)]
    plan = plan_chunks(ps, 2048)
    fig = plot_chunks(ps, max_chunk_bytes=2048)
    red = matplotlib.colors.to_rgba("#C44E52")[:3]
    rects = {g: rs[0] for g, rs in rects_by_gid(fig, "segment ").items()}
    over = {f"segment {c.index} {c.positions[0]}" for c in plan if c.over_budget}
    assert len(rects) == len(plan) and 0 < len(over) < len(plan)
    assert {g for g, r in rects.items() if r.get_facecolor()[:3] == red} == over
    assert all(rects[g].get_linewidth() == 0 and rects[g].get_hatch() in ("", None)
               for g in over)


def test_a_bar_too_narrow_for_a_hatch_is_drawn_without_one():
    ps = chunk_patches()
    wide = plot_chunks(ps, max_chunk_bytes=300)
    assert any(r.get_hatch() for rs in rects_by_gid(wide, "segment ").values() for r in rs)
    # the same plan on axes 20 points wide: bars a few points wide
    fig = Figure(figsize=(6, 3))
    ax = fig.add_axes((0.1, 0.1, 20 / 432, 0.8))
    plot_chunks(ps, max_chunk_bytes=300, ax=ax)
    rects = [r for rs in rects_by_gid(fig, "segment ").values() for r in rs]
    assert rects and not any(r.get_hatch() for r in rects)


def test_one_element_is_counted_in_the_singular():
    r = inspect_load(PlainModel({"s": ()}), [CheckpointWeightPatch("s", (), torch.float32,
                                                                   torch.ones(1))])
    fig = r.plot_delta("s")
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert any("1 element written" in t for t in texts)
    assert any("Δ over 1 written element" in t for t in texts)
    assert not any("1 elements" in t for t in texts)


def _overlapping_x_labels(fig) -> int:
    """Pairs of neighbouring x tick labels whose boxes overlap, once drawn."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    bad = 0
    for ax in fig.axes:
        boxes = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels()
                        if t.get_visible() and t.get_text()), key=lambda b: b.x0)
        bad += sum(a.x1 > b.x0 for a, b in itertools.pairwise(boxes))
    return bad


@pytest.mark.parametrize("shape", [(4, 4096), (2, 128256), (3_000_000,)], ids=str)
def test_column_numbers_never_run_into_each_other(shape):
    # (a 4096-column delta read "0 5001,0001,5002,000...": nine labels on a 3-inch panel)
    n = math.prod(shape)
    p = CheckpointWeightPatch("w", shape, torch.float32, torch.ones(3), torch.tensor([0, 7, n - 1]))
    r = inspect_load(PlainModel({"w": shape}), [p])
    for fig in (r.plot_delta("w"), r.plot_placement(), plot_density(p)):
        assert _overlapping_x_labels(fig) == 0
        labels = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
        assert len(labels) >= 2  # still numbered


# --------------------------------------------------------------------------- Δ at the edges


def _one_write(dtype, start, new, shape=(4, 5), at=7):
    """A report of a dense load into a ``shape`` tensor of ``start`` whose element ``at``
    becomes ``new``."""
    m = PlainModel({"w": shape}, dtype=dtype)
    x = torch.full(shape, start, dtype=dtype)
    m.load_weights([("w", x)])
    y = x.clone().reshape(-1)
    y[at] = new
    return inspect_load(m, [CheckpointWeightPatch("w", shape, dtype, y)])


def test_delta_of_a_complex_tensor_draws_moduli_and_the_modulus_of_the_change():
    # It drew the real parts: a change of the imaginary part left every panel blank
    # while the title said 1 changed, max |Δ| 1.
    report = _one_write(torch.complex64, 0, 1j)
    fig = plot_delta(report, "w")
    b, a, d = (np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images)
    want = np.zeros((4, 5))
    want[1, 2] = 1.0
    np.testing.assert_array_equal(b, np.zeros((4, 5)))
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(d, want)
    images = [ax for ax in fig.axes if ax.images]
    assert images[2].images[0].get_clim() == (0.0, 1.0)  # |Δ| >= 0: a one-sided scale
    assert "|Δ|" in images[2].get_title() and "|z|" in images[0].get_title()
    hist = fig.axes[3]
    assert [p.get_height() for p in hist.patches if p.get_height()] == [19, 1]
    assert hist.patches[-1].get_x() < 1.0 <= hist.patches[-1].get_x() + hist.patches[-1].get_width()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_finite_delta_beyond_float32s_range_is_drawn_and_counted(dtype):
    # 3e38 - (-3e38) overflowed float32: the one change was drawn magenta as NaN/±inf
    # and left out of the histogram, which said "0 written elements".
    m = PlainModel({"w": (4, 5)}, dtype=dtype)
    x = torch.full((20,), -3e38).to(dtype)
    m.load_weights([("w", x.reshape(4, 5))])
    y = x.clone()
    y[7] = torch.tensor(3e38).to(dtype)
    report = inspect_load(m, [CheckpointWeightPatch("w", (4, 5), dtype, y)])
    fig = plot_delta(report, "w")
    d = [np.asarray(ax.images[0].get_array()) for ax in fig.axes if ax.images][2]
    want = float(y[7].double()) - float(x[7].double())
    assert d[1, 2] == want and np.isfinite(d).all()
    assert not [c for ax in fig.axes for c in ax.collections if c.get_gid() == "non-finite"]
    assert fig.axes[3].get_title() == "Δ over 20 written elements"
    assert sum(p.get_height() for p in fig.axes[3].patches) == 20


@pytest.mark.parametrize(("dtype", "new"), [(torch.float32, 3e5), (torch.float32, 1e6),
                                            (torch.int64, 2**60), (torch.float64, 1e300),
                                            (torch.float32, torch.finfo(torch.float32).max),
                                            (torch.float32, 1.4e-45)])  # (a subnormal step)
def test_a_histogram_of_one_large_value_is_drawn(dtype, new):
    # numpy widened a one-value range by ±0.5, which float32 (or float64 past 2**47)
    # cannot cut into 60 bars: ValueError, and no figure.
    report = _one_write(dtype, 0, new)
    fig = plot_delta(report, "w", changed_only=True)
    bars = [p for p in fig.axes[3].patches if p.get_height()]
    assert len(bars) == 1 and bars[0].get_height() == 1
    x0, w = bars[0].get_x(), bars[0].get_width()
    assert x0 <= float(new) <= x0 + w
    # with the unchanged elements too: 0 and the one value, however close together
    fig = plot_delta(report, "w")
    assert sum(p.get_height() for p in fig.axes[3].patches) == 20


def test_a_band_whose_delta_overflows_float32_is_counted_on_the_second_pass(monkeypatch):
    # Only that band's Δ is float64; the second pass counted the float32 bands with
    # edges made in float32, where -6e38 is -inf: ValueError, no figure.
    from patchkit import plot

    m = PlainModel({"w": (60, 50)})
    x = torch.ones(60, 50)
    x[0, 0] = 3e38
    m.load_weights([("w", x)])
    y = torch.full((60, 50), 2.0)
    y[0, 0] = -3e38
    report = inspect_load(m, [CheckpointWeightPatch("w", (60, 50), torch.float32,
                                                    y.reshape(-1))])
    monkeypatch.setattr(plot, "_BAND", 500)  # (10 rows a band: one band overflows)
    monkeypatch.setattr(plot, "_HIST_KEEP", 100)  # (a second pass)
    fig = plot_delta(report, "w")
    heights = [p.get_height() for p in fig.axes[3].patches]
    assert sum(heights) == 3000 and heights[0] == 1 and heights[-1] == 2999
    assert fig.axes[3].patches[0].get_x() <= -6e38


def test_a_nearly_full_patch_is_not_titled_100_percent():
    from patchkit.plot import _pct

    assert _pct(999_999 / 1_000_000) == ">99.9 %" and _pct(1.0) == "100 %"
    assert _pct(0.5) == "50 %" and _pct(0.0) == "0 %"
    p = CheckpointWeightPatch("w", (1000, 1000), torch.float32, torch.ones(999_999),
                              torch.arange(999_999))
    assert "(>99.9 %)" in plot_density(p).axes[0].get_title()


@pytest.mark.filterwarnings("ignore:Tight layout not applied")  # (3 x 3 axes in 3 x 2 in)
def test_heat_maps_have_no_more_blocks_than_their_panels_have_pixels():
    # With bins above a panel's pixel count a renderer draws a sample of the blocks:
    # the one block holding a single change vanished from plot_delta's Δ panel 12 times
    # in 12 at bins=1024 (and a block a pixel high at the edge hid under the frame).
    m = PlainModel({"w": (2048, 2048)})
    p = CheckpointWeightPatch("w", (2048, 2048), torch.float32, torch.tensor([5.0]),
                              torch.tensor([2048 * 2047 + 5]))  # the last row's edge
    report = inspect_load(m, [p])
    fig = plot_delta(report, "w", bins=(1024, 1024))
    fig.canvas.draw()
    for ax in [ax for ax in fig.axes if ax.images]:
        img = ax.images[0]
        rows, cols = np.asarray(img.get_array()).shape
        box = ax.get_window_extent()
        assert (rows, cols) == (300, 200) and rows <= box.height and cols <= box.width
        assert img.get_zorder() > max(s.get_zorder() for s in ax.spines.values())
    d = np.asarray([ax for ax in fig.axes if ax.images][2].images[0].get_array())
    assert d[-1, 0] == 5.0  # (max |Δ| per block: the change is its block's value)
    fig = plot_density(p, bins=1024)
    fig.canvas.draw()
    ax = fig.axes[0]
    rows, cols = ax.images[0].get_array().shape
    assert rows <= ax.get_window_extent().height and cols <= ax.get_window_extent().width
    assert f"{rows} × {cols} blocks" in ax.get_title()
    # on a caller's axes: what the axes will have once its colorbar and labels are in
    for size, layout, grid in itertools.product([(3, 2), (4, 3), (6, 4)],
                                                [None, "constrained", "tight"], [1, 2, 3]):
        mine = Figure(figsize=size, dpi=100, layout=layout)
        FigureCanvasAgg(mine)
        ax = mine.subplots(grid, grid, squeeze=False)[0, 0]
        plot_density(p, bins=1024, ax=ax)
        ax.axhline(1000, color="red")  # a caller's line: over the heat map, not under
        mine.canvas.draw()
        rows, cols = ax.images[0].get_array().shape
        box = ax.get_window_extent()
        assert rows <= box.height and cols <= box.width, (size, layout, grid)
        if layout is None:  # (nothing moves the axes but its colorbar: no room is kept
            # for labels, as it was, which left a 3 x 3 grid's panel 4 x 1 blocks)
            assert rows >= 0.9 * box.height and cols >= 0.9 * box.width, (size, grid)
        assert ax.lines[0].get_zorder() > ax.images[0].get_zorder()
        assert max(s.get_zorder() for s in ax.spines.values()) < ax.images[0].get_zorder()
    # a layout engine switched off (a placeholder is left) lays nothing out either
    mine = Figure(figsize=(6, 4), dpi=100, layout="constrained")
    mine.set_layout_engine("none")
    FigureCanvasAgg(mine)
    ax = mine.subplots(3, 3, squeeze=False)[0, 0]
    plot_density(p, bins=1024, ax=ax)
    mine.canvas.draw()
    rows, cols = ax.images[0].get_array().shape
    box = ax.get_window_extent()
    assert 0.9 * box.height <= rows <= box.height and 0.9 * box.width <= cols <= box.width
    # the default is not capped
    assert plot_density(p).axes[0].images[0].get_array().shape == (128, 128)


def test_a_styles_grid_is_drawn_under_the_heat_maps():
    # Drawing the frame under the map first put the map at zorder 0, under the grid a
    # style (ggplot, seaborn's darkgrid) turns on: white lines across one-pixel blocks.
    import matplotlib.pyplot as plt

    p = CheckpointWeightPatch("w", (64, 64), torch.float32, torch.ones(64 * 64))
    with plt.style.context("ggplot"):
        fig = plot_density(p)
        m = PlainModel({"w": (64, 64)})
        delta = plot_delta(inspect_load(m, [p]), "w")
    for ax in [fig.axes[0], *[a for a in delta.axes if a.images]]:
        assert ax.xaxis.get_gridlines()[0].get_visible()  # (the style's grid is on)
        z = ax.images[0].get_zorder()
        assert ax.xaxis.get_zorder() < z and ax.yaxis.get_zorder() < z
        assert max(sp.get_zorder() for sp in ax.spines.values()) < z < 2  # under lines


def test_a_placement_of_more_targets_than_max_targets_draws_the_first_with_a_note():
    # an explicit list ignored max_targets: 300 targets made a 781-inch figure (190 s)
    shapes = {f"w{i}": (2, 2) for i in range(10)}
    ps = [CheckpointWeightPatch(n, (2, 2), torch.float32, torch.ones(4)) for n in shapes]
    r = inspect_load(PlainModel(shapes), ps)
    fig = plot_placement(r, targets=list(shapes), max_targets=3)
    assert len(fig.axes) == 6  # (two axes a row)
    assert "showing 3 of 10 targets asked for" in fig._suptitle.get_text()
    assert "showing 2 of 10 runtime tensors written" in plot_placement(
        r, max_targets=2)._suptitle.get_text()
    with pytest.raises(ValueError, match="from 1 to 32"):
        plot_placement(r, max_targets=33)


class _RowsOfTargets(nn.Module):
    """Runtime tensors ``t0`` ... of (rows, 8); a patch ``t<i>.r<j>`` of (8,) is row j
    of ``t<i>``: each tensor has ``rows`` writes from as many checkpoint tensors."""

    def __init__(self, targets: int, rows: int) -> None:
        super().__init__()
        for i in range(targets):
            self.register_parameter(f"t{i}", nn.Parameter(torch.zeros(rows, 8),
                                                          requires_grad=False))

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            target, row = name.split(".")
            getattr(self, target).data[int(row[1:])].copy_(w)
            loaded.add(target)
        return loaded


@pytest.mark.parametrize("targets", [32, 16])
def test_a_placement_of_many_targets_stays_under_30_inches_with_every_label_readable(
        targets):
    # a row of 2.6 inches a target made 32 targets a 13 x 84-inch figure (16: 42 inches)
    rows = 10
    ps = [CheckpointWeightPatch(f"t{i}.r{j}", (8,), torch.float32, torch.ones(8))
          for i in range(targets) for j in range(rows)]
    report = inspect_load(_RowsOfTargets(targets, rows), ps)
    fig = plot_placement(report, max_targets=32)
    width, height = fig.get_size_inches()
    assert width <= 30 and height <= 30
    # every target drawn, in order: its title, and each of its writes where it landed
    assert len(fig.axes) == 2 * targets
    assert [ax.get_title().split()[1] for ax in fig.axes[1::2]] == [
        f"t{i}" for i in range(targets)]
    runtime = rects_by_gid(fig, "write ")
    for i, w in report.writes.iterrows():
        target = int(w["target"][1:])
        (rect,) = runtime[f"write {i} runtime"]
        assert rect.axes is fig.axes[2 * target + 1]
        assert extent(rect) == (0, 8, i % rows, i % rows + 1)
    renderer = drawn(fig)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert min(t.get_fontsize() for t in texts) >= 6
    # no row runs into another (a legend or the sources' labels past its row's height),
    # and none past the figure's edges
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert i // 2 == j // 2 or not a.overlaps(b)  # (each target's two axes: a row)
    page = fig.bbox
    assert all(page.x0 <= b.x0 and b.x1 <= page.x1 and page.y0 <= b.y0 and b.y1 <= page.y1
               for b in boxes)
    # nor a row number into the next on a shorter panel (ten rows were ticked 0 to 10)
    for ax in fig.axes[1::2]:
        ticks = [t.get_window_extent(renderer) for t in ax.get_yticklabels()
                 if t.get_visible() and t.get_text()]
        assert len(ticks) >= 2
        for a, b in itertools.combinations(ticks, 2):
            assert not a.overlaps(b)
    # nor a checkpoint tensor's label into the next: a shorter row draws fewer of them
    # (mutation testing: drawing all eight in every row passed this test)
    for ax in fig.axes[::2]:
        labels = [t.get_window_extent(renderer) for t in ax.get_yticklabels()
                  if t.get_visible() and t.get_text()]
        for a, b in itertools.combinations(labels, 2):
            assert not a.overlaps(b)
    # what a shorter row leaves out is counted: the legend's writes, the sources drawn
    for ck, rt in zip(fig.axes[::2], fig.axes[1::2]):
        legend = [t.get_text() for t in rt.get_legend().get_texts()]
        listed = len(legend) - 1
        assert legend[-1] == f"… {rows - listed} more writes" and listed >= 3
        shown = len(ck.get_yticks())
        assert 2 <= shown < rows and ck.get_title().endswith(f"({shown} of {rows} shown)")


def test_a_delta_histogram_has_at_most_as_many_bars_as_its_panel_has_pixels():
    # hist_bins=10**5 drew 10**5 bars (50 s)
    report, _ = load("q")
    with pytest.raises(ValueError, match="at most 1024"):
        plot_delta(report, "qkv", hist_bins=10**5)
    assert len(plot_delta(report, "qkv", hist_bins=1024).axes[3].patches) == 1024


# -------------------------------------------------- failed loads, layouts, odd arguments


def _drawn_extents(fig: Figure):
    """The titles, annotations and legend entries of ``fig`` (not its tick labels, some
    of which lie outside the view and are not drawn) with their extents in pixels,
    after one Agg draw."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = []
    for ax in fig.axes:
        legend = ax.get_legend()
        texts += [ax.title, *ax.texts, *(legend.get_texts() if legend else [])]
    return renderer, [(t, t.get_window_extent(renderer)) for t in texts
                      if t.get_visible() and t.get_text()]


def _d(name: str, shape: tuple[int, ...], seed: int = 0) -> CheckpointWeightPatch:
    values = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(seed))
    return CheckpointWeightPatch(name, shape, torch.float32, values)


def _s(name: str, shape: tuple[int, ...], idx: list[int], vals: list[float]):
    return CheckpointWeightPatch(name, shape, torch.float32, torch.tensor(vals),
                                 torch.tensor(idx))


def _failed(model, patches, **kw):
    with pytest.raises(Exception) as info:
        inspect_load(model, patches, **kw)
    return info.value.report


def test_a_load_refused_before_its_first_call_draws_its_calls_as_not_sent():
    ps = [_d("a", (4, 8)), _s("b", (4, 8), [0, 1], [1.0, 2.0])]  # mixed: refused, no call made
    model = PlainModel({"a": (4, 8), "b": (4, 8)})
    report = _failed(model, ps)
    assert len(report.calls) == 0
    ax = report.plot_chunks().axes[0]
    assert "the load raised PatchValueError after 0 calls made" in ax.get_title()
    closed = [t.get_text() for t in ax.texts if t.get_gid() == "closed_by"]
    assert closed == ["not sent"] * len(report.plan)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "not sent (the load raised first)" in legend


def test_a_load_that_raised_in_a_call_marks_that_call_and_the_unsent_ones():
    from patchkit.toymodels import FailingModel

    model = FailingModel({"a": (4, 8), "b": (4, 8), "c": (4, 8)}, fail_on="b")
    report = _failed(model, [_d("a", (4, 8)), _d("b", (4, 8), 1), _d("c", (4, 8), 2)],
                     max_chunk_bytes=128)
    assert len(report.plan) == 3 and list(report.calls["error"]) == [False, True]
    ax = report.plot_chunks().axes[0]
    closed = [t.get_text() for t in ax.texts if t.get_gid() == "closed_by"]
    assert closed == ["budget", "raised", "not sent"]
    colours = [t.get_color() for t in ax.texts if t.get_gid() == "closed_by"]
    assert colours == ["black", "#C44E52", "black"]  # "raised" in red
    assert "after 2 calls made" in ax.get_title()
    # the plan at another budget is a plan, not the load's calls: nothing marked
    other = report.plot_chunks(max_chunk_bytes=1 << 20).axes[0]
    assert "raised" not in other.get_title()
    assert [t.get_text() for t in other.texts if t.get_gid() == "closed_by"] == ["end"]


def test_a_numpy_integer_budget_is_a_budget():
    ps = chunk_patches()
    title = plot_chunks(ps, np.int64(200)).axes[0].get_title()
    assert "refused" not in title
    assert title == plot_chunks(ps, 200).axes[0].get_title()


def test_axes_in_a_subfigure_take_the_figures():
    fig = Figure(figsize=(16, 5), layout="constrained")
    left, right = fig.subfigures(1, 2)
    assert plot_chunks(chunk_patches(), 200, ax=left.add_subplot()) is left
    patch = _s("w", (4, 8), [0, 5, 9], [1.0, 2.0, 3.0])
    assert plot_density(patch, ax=right.add_subplot()) is right
    _drawn_extents(fig)  # (and it draws)


def test_a_plan_with_bars_over_budget_keeps_its_title_and_labels_clear():
    ps = [CheckpointWeightPatch(f"model.layers.{i}.mlp.gate_up_proj.weight", (64, 64),
                                torch.bfloat16, torch.zeros(4096, dtype=torch.bfloat16))
          for i in range(3)]
    fig = plot_chunks(ps, 1000)
    _, texts = _drawn_extents(fig)
    width, height = fig.bbox.width, fig.bbox.height
    for t, box in texts:  # all inside the figure: the title was cut at its left edge
        assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, \
            t.get_text()
    ax = fig.axes[0]
    over = [box for t, box in texts if t.get_gid() == "over_budget"]
    names = [box for t, box in texts if t.get_gid() == "segment label"]
    assert len(over) == 3 and len(names) == 3
    frame = ax.get_window_extent()
    for box in over:
        assert box.y0 >= frame.y0 and not any(box.overlaps(n) for n in names)


def test_a_bar_too_short_for_the_over_budget_box_goes_without_it():
    # one patch 100x the rest, over a tiny budget: the small ones' bars are a few points
    # tall, too short for the upright box; the tall one keeps it
    ps = [ones_at("big", (64, 64), [0])._replace(indices=None, values=torch.ones(4096)),
          *[ones_at(f"s{i}", (2, 2), [0])._replace(indices=None, values=torch.ones(4))
            for i in range(2)]]
    plan = plan_chunks(ps, 4)
    assert [c.over_budget for c in plan] == [True, True, True]  # (8 B each, 8 KiB)
    fig = plot_chunks(ps, 4)
    _, texts = _drawn_extents(fig)
    frame = fig.axes[0].get_window_extent()
    flagged = [(t, box) for t, box in texts if t.get_gid() == "over_budget"]
    assert [round(t.xy[0]) for t, _ in flagged] == [0]
    assert all(frame.y0 <= box.y0 and box.y1 <= frame.y1 for _, box in flagged)


def test_the_delta_histograms_tick_labels_do_not_run_into_each_other():
    model = PlainModel({"w": (32, 32)})
    values = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 123456.0
    report = inspect_load(model, [CheckpointWeightPatch("w", (32, 32), torch.float32, values)])
    fig = report.plot_delta("w")
    renderer, _ = _drawn_extents(fig)
    labels = [t for t in fig.axes[3].get_xticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert len(boxes) >= 2
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


def test_placement_of_a_rolled_back_load_says_its_writes_were_put_back():
    from patchkit.toymodels import FailingModel

    model = FailingModel({"a": (4, 8), "c": (2, 3)}, fail_on="c")
    report = _failed(model, [_d("a", (4, 8)), _d("c", (2, 3))], transactional=True,
                     max_chunk_bytes=128)
    assert report.rolled_back
    fig = report.plot_placement()
    assert "rolled back" in fig._suptitle.get_text()
    assert "put back by the rollback" in fig.axes[1].get_title()


def test_placement_counts_elements_written_twice_once():
    a = _s("w", (4, 8), [0, 1, 2], [1.0, 2.0, 3.0])
    b = _s("w", (4, 8), [1, 31], [10.0, 20.0])
    report = inspect_load(PlainModel({"w": (4, 8)}), [a, b])
    assert int(report.deltas.loc["w", "elements"]) == 4
    fig = report.plot_placement()
    title = fig.axes[1].get_title()
    assert "4 elements written (5 element writes, of 64 in their views)" in title
    labels = [t for t in fig.axes[1].texts if t.get_text() == "w"]
    assert len(labels) == 1  # the two writes of one region: one label


def test_placement_draws_a_tensor_named_twice_once():
    report, _ = load("q k v o")
    fig = plot_placement(report, targets=["qkv", "o", "qkv"])
    titles = [ax.get_title() for ax in fig.axes[1::2]]
    assert len(titles) == 2 and titles[0].startswith("runtime qkv") and "runtime o" in titles[1]


def test_an_item_that_is_no_patch_is_patchkits_type_error_naming_its_position():
    # plot_chunks/plot_density/chunk_planner refused a non-patch with a bare TypeError
    # (no .position, .reason, .value), where the loader, density_map and the same
    # functions' state-dict check raise PatchTypeError
    from patchkit import PatchTypeError

    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))
    with pytest.raises(PatchTypeError, match=r"plot_chunks: patch 1 must be") as info:
        plot_chunks([p, 5])
    assert (info.value.position, info.value.reason, info.value.value) == (1, "not a patch", "int")
    with pytest.raises(PatchTypeError, match=r"plot_density: patch must be") as info:
        plot_density("w")
    e = info.value
    assert (e.position, e.reason, e.value) == (None, "not a patch", "str")


@pytest.mark.parametrize("one", ["patch", "5-tuple"])
def test_one_patch_not_in_a_list_is_named_as_one_patch(one):
    # plot_chunks(p) read a patch's five fields as five patches and said "patch 0 must be
    # a CheckpointWeightPatch, got str: 'w'; to draw a patch of a report by name use
    # report.plot_density(name)", where the loader, plan_chunks and patch_summary say
    # "got one patch ('w'): pass [patch]"
    from patchkit import PatchTypeError

    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))
    item = p if one == "patch" else tuple(p)
    with pytest.raises(PatchTypeError) as info:
        plot_chunks(item)
    e = info.value
    assert str(e) == ("plot_chunks: expected a LoadReport or a list of "
                      "CheckpointWeightPatch, got one patch ('w'): pass [patch]")
    assert (e.position, e.name, e.reason) == (None, "w", "not a list")


def _texts_outside(fig: Figure) -> list[str]:
    """The drawn texts (titles, labels, tick labels of ticks in view, notes) that reach
    past the figure's edges, as drawn once with Agg."""
    renderer = drawn(fig)
    box = fig.bbox
    out = []
    for ax in fig.axes:
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted((lo, hi))
            for tick in axis.get_major_ticks():
                if lo <= tick.get_loc() <= hi:
                    texts.append(tick.label1)
        for t in texts:
            if not (t.get_visible() and t.get_text()):
                continue
            e = t.get_window_extent(renderer)
            if e.x0 < box.x0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y0 < box.y0 - 0.5 \
                    or e.y1 > box.y1 + 0.5:
                out.append(t.get_text())
    return out


def test_an_empty_delta_histogram_has_no_scale_and_no_label_past_the_figure():
    # The histogram of no elements kept matplotlib's 0 to 1 scale, its "1.0" on the
    # panel's right edge drawn 7 pixels past the figure's (clipped in the PNG).
    from patchkit.toymodels import FailingModel

    ps = [CheckpointWeightPatch(n, (64, 64), torch.float32, torch.ones(4096)) for n in "abc"]
    with pytest.raises(RuntimeError) as info:
        inspect_load(FailingModel({n: (64, 64) for n in "abc"}, fail_on="c"), ps,
                     max_chunk_bytes=1 << 14, transactional=True)
    unchanged = inspect_load(PlainModel({"w": (64, 64)}),
                             [CheckpointWeightPatch("w", (64, 64), torch.float32,
                                                    torch.zeros(4096))])
    for fig, note in ((plot_delta(info.value.report, "a"),
                       "written, then put back by the rollback"),
                      (plot_delta(unchanged, "w", changed_only=True),
                       "no changed elements")):
        hist = fig.axes[3]
        assert [t.get_text() for t in hist.texts] == [note]
        assert _texts_outside(fig) == []
        assert list(hist.get_xticks()) == [] and list(hist.get_yticks()) == []


def _hatch_rgb(artist) -> tuple[float, float, float]:
    colour = artist.get_hatchcolor() if hasattr(artist, "get_hatchcolor") else None
    if colour is None:  # (matplotlib before 3.10: the hatch takes the edge's colour)
        colour = artist._hatch_color
    return tuple(float(c) for c in np.asarray(colour, dtype=float).ravel()[:3])


def test_a_hatched_segment_too_thin_for_an_edge_has_a_white_hatch_as_the_others():
    # A segment drawn without an edge (edgecolor "none") had its hatch drawn in
    # matplotlib's black: a row of black strokes across the top of the bar, like the
    # dashed budget line. [a b] is closed by the repeated a, [a c] by the end; b and c
    # are too thin for an edge.
    ps = [CheckpointWeightPatch(n, (k,), torch.float32, torch.zeros(k))
          for n, k in (("a", 2048), ("b", 8), ("a", 2048), ("c", 4))]
    rects = {g: r for g, (r,) in rects_by_gid(plot_chunks(ps), "segment ").items()}
    assert set(rects) == {"segment 0 0", "segment 0 1", "segment 1 2", "segment 1 3"}
    for gid in ("segment 0 1", "segment 1 3"):
        assert rects[gid].get_linewidth() == 0 and rects[gid].get_hatch()
    assert {_hatch_rgb(r) for r in rects.values()} == {(1.0, 1.0, 1.0)}


def test_the_legends_hatches_are_white_as_the_bars_are():
    # (the legend's "closed by repeated name" and "closed by end" swatches had black
    # hatches beside the bars' white ones)
    ps = [CheckpointWeightPatch(n, (k,), torch.float32, torch.zeros(k))
          for n, k in (("a", 2048), ("b", 8), ("a", 2048), ("c", 4))]
    fig = plot_chunks(ps)
    legend = fig.axes[0].get_legend()
    swatches = {t.get_text(): p for t, p in zip(legend.get_texts(), legend.get_patches())}
    hatched = {k: p for k, p in swatches.items() if p.get_hatch()}
    assert set(hatched) == {"closed by repeated name", "closed by end"}
    assert {_hatch_rgb(p) for p in hatched.values()} == {(1.0, 1.0, 1.0)}


def test_plot_chunks_refuses_what_is_no_list_of_patches_with_patchkits_error():
    """What is neither a report nor patches (a number, a str, a state dict) is refused as
    patches are everywhere: a PatchTypeError (a TypeError), reason ``"not a list"``, so
    that ``except PatchError`` catches each of them, not the state dict only."""
    from patchkit import PatchTypeError

    for source in (3, "ab", None, {"w": torch.zeros(2)}):
        with pytest.raises(PatchTypeError, match=r"^plot_chunks: expected a LoadReport") as e:
            plot_chunks(source)
        assert (e.value.reason, e.value.value) == ("not a list", type(source).__name__)


# -- what the argument errors show: errors.brief's cut, never an error of its own ---------


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_an_argument_whose_repr_fails_is_shown_by_its_type():
    # (plot's _what called repr itself: the argument's own RuntimeError escaped in place
    # of the TypeError naming the argument)
    with pytest.raises(TypeError, match=r"^to_png: fig must be a matplotlib Figure, got "
                                        r"_NoRepr: <a _NoRepr>$"):
        to_png(_NoRepr())
    with pytest.raises(TypeError, match=r"^plot_chunks: .* got _NoRepr: <a _NoRepr>"):
        plot_chunks(_NoRepr())


def test_a_long_argument_is_cut_as_errors_brief_cuts_it():
    with pytest.raises(TypeError) as info:
        to_png("f" * 10**6)
    assert str(info.value) == f"to_png: fig must be a matplotlib Figure, got str: '{'f' * 59}..."


def test_an_int_too_long_to_print_is_shown_by_its_size_in_the_plot_errors():
    # (printed with str(): Python's "Exceeds the limit (4300 digits)" ValueError escaped in
    # place of plot's own message)
    huge = 10**5000
    report = inspect_load(PlainModel({"w": (4,)}),
                          [CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))])
    with pytest.raises(ValueError, match=r"max_targets must be from 1 to \d+ \(a row each\), "
                                         r"got <a 16610-bit int>$"):
        plot_placement(report, max_targets=huge)
    with pytest.raises(ValueError, match=r"^view_rects: offset <a 16610-bit int> is beyond int64"):
        view_rects(huge, (1,), (1,), 4)
    with pytest.raises(ValueError, match=r"hist_bins must be at most \d+, got <a 16610-bit int>$"):
        plot_delta(report, "w", hist_bins=huge)
    with pytest.raises(ValueError, match=r"hist_bins must be at least 1, got -5$"):
        plot_delta(report, "w", hist_bins=-5)
    # (mutation testing: one below 1 printed with str() passed every test)
    with pytest.raises(ValueError, match=r"hist_bins must be at least 1, got <a 16610-bit int>$"):
        plot_delta(report, "w", hist_bins=-huge)


@pytest.mark.parametrize("rank", [0, 3])
def test_placement_shows_a_replicated_kv_head_as_its_band_of_k_and_v(rank):
    # 8 query heads, 2 kv heads of 8 rows, tp 4: rank r reads kv head r // 2 (rows 0:8 or
    # 8:16 of the 16-row k and v) into the 8 rows after its 16 q rows and the 8 after those
    model = TinyLlamaRuntime(TinyLlamaConfig(num_heads=8, num_kv_heads=2), tp_rank=rank,
                             tp_size=4, dtype=torch.float32)
    ps = [CheckpointWeightPatch(f"model.layers.0.self_attn.{x}_proj.weight", (16, 64),
                                torch.float32, torch.ones(16 * 64)) for x in "kv"]
    report = inspect_load(model, ps)
    fig = plot_placement(report)
    assert len(fig.axes) == 2
    ax_ck, ax_rt = fig.axes
    assert ax_rt.get_title().startswith("runtime model.layers.0.self_attn.qkv_proj.weight "
                                        "(32, 64)")
    rects = rects_by_gid(fig, "write ")
    head = rank // 2
    squares = sorted((p.get_y(), p.get_height()) for p in ax_ck.patches if p.get_gid() is None)
    assert len(squares) == 2
    for i, at in enumerate((16, 24)):  # k, then v
        (rt,) = rects[f"write {i} runtime"]
        assert extent(rt) == (0, 64, at, at + 8)
        (ck,) = rects[f"write {i} checkpoint"]  # half of its unit square: one head of two
        y0, h = squares[i]
        assert extent(ck) == pytest.approx((0, 1, y0 + h * head / 2, y0 + h * (head + 1) / 2))
    legend = [t.get_text() for t in ax_rt.get_legend().get_texts()]
    rows = f"[{8 * head}:{8 * head + 8}, :]"
    assert [t.split(" ", 2)[2] for t in legend] == [f"{rows} → [16:24, :]",
                                                   f"{rows} → [24:32, :]"]


def test_a_placement_of_17_targets_fills_two_columns_top_to_bottom():
    # (mutation testing: one column of 17 rows, a row too few a column for an odd count,
    # and the targets laid out left to right each passed every test)
    targets = 17
    ps = [CheckpointWeightPatch(f"t{i}.r0", (8,), torch.float32, torch.ones(8))
          for i in range(targets)]
    report = inspect_load(_RowsOfTargets(targets, 2), ps)
    fig = plot_placement(report, max_targets=32)
    assert tuple(fig.get_size_inches()) == pytest.approx((26.0, 0.8 + 9 * 2.6))
    assert len(fig.axes) == 2 * targets
    assert [ax.get_title().split()[1] for ax in fig.axes[1::2]] == [
        f"t{i}" for i in range(targets)]
    boxes = [ax.get_position() for ax in fig.axes]
    for k in range(targets):  # t0..t8 down the left column, t9..t16 down the right
        ck, rt = boxes[2 * k], boxes[2 * k + 1]
        assert ck.x1 <= rt.x0 and (rt.x1 <= 0.5 if k < 9 else ck.x0 >= 0.5)
        assert ck.y0 == pytest.approx(rt.y0)
        if k not in (0, 9):
            assert rt.y1 <= boxes[2 * k - 1].y0  # (below the one before it)
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)


def test_a_placement_row_of_full_height_draws_eight_checkpoint_tensors():
    # a figure of up to 11 targets is as it was: 8 checkpoint tensors a row, 12 writes in
    # its legend (mutation testing: a row of exactly 2.6 inches taken for a shrunk one,
    # 6 tensors and the same 12 writes, passed every test)
    ps = [CheckpointWeightPatch(f"t0.r{j}", (8,), torch.float32, torch.ones(8))
          for j in range(13)]
    fig = plot_placement(inspect_load(_RowsOfTargets(1, 13), ps))
    ck, rt = fig.axes
    assert len(ck.get_yticks()) == 8 and ck.get_title().endswith("(8 of 13 shown)")
    legend = [t.get_text() for t in rt.get_legend().get_texts()]
    assert len(legend) == 13 and legend[-1] == "… 1 more write"


# -- branches the coverage audit found unpinned ---------------------------------------------


def test_region_rects_of_a_flat_range_within_one_row_from_a_row_start_or_empty():
    assert region_rects("5 elements from 2", (4, 8)) == ([(0, 1, 2, 7)], False)
    assert region_rects("16 elements from 8", (4, 8)) == ([(1, 3, 0, 8)], False)
    assert region_rects("12 elements from 8", (4, 8)) == ([(1, 2, 0, 8), (2, 3, 0, 4)], False)
    assert region_rects("10 elements from 0", (4, 8)) == ([(0, 1, 0, 8), (1, 2, 0, 2)], False)
    assert region_rects("0 elements from 3", (4, 8)) == ([], False)
    assert region_rects("not a region", (4, 4)) == ([], False)


@pytest.mark.parametrize(("args", "error", "match"), [
    ((-1, (2,), (1,), 4), ValueError,
     r"offset and shape must not be negative, got offset -1, shape \(2,\)"),
    ((0, (-2,), (1,), 4), ValueError,
     r"offset and shape must not be negative, got offset 0, shape \(-2,\)"),
    ((0, (2, 2), (1, -1), 4), ValueError, r"negative stride in \(1, -1\)"),
    ((0, iter((2,)), (1,), 4), TypeError, "shape must be a sequence of ints, got tuple_iterator"),
    ((0, (2,), iter((1,)), 4), TypeError, "stride must be a sequence of ints, got tuple_iterator"),
])
def test_view_rects_refuses_a_view_no_tensor_has_by_name(args, error, match):
    with pytest.raises(error, match=f"view_rects: {match}"):
        view_rects(*args)


def test_a_view_of_more_runs_than_are_listed_is_drawn_as_its_span_without_listing_them():
    # every other element of a 4-column grid, 2**20 + 2 of them: a run each, more than
    # plot lists, so the flat span from first to last, and no list of a million runs
    n = (1 << 20) + 2
    (rects, exact), allocated = bytes_allocated_by_lines(view_rects, 0, (n,), (2,), 4)
    assert not exact
    row, col = divmod(2 * (n - 1), 4)  # (the last element)
    assert rects == [(0, row, 0, 4), (row, row + 1, 0, col + 1)]
    assert allocated < 1 << 20  # (listing the runs takes 16 MiB or more)


def test_placement_of_a_load_a_loader_partly_undid_says_which_writes_were_put_back():
    from patchkit.toymodels import FailingModel

    def undoes_a(model, patches, **kwargs):  # (a loader that puts a back when a call raises)
        old = model.a.detach().clone()
        try:
            for p in patches:
                model.load_weights([(p.name, p.values.reshape(p.shape))])
        except RuntimeError:
            model.a.data.copy_(old)
            raise
        return {p.name for p in patches}

    model = FailingModel({"a": (4, 8), "b": (4, 8), "c": (2, 3)}, fail_on="c")
    report = _failed(model, [_d("a", (4, 8)), _d("b", (4, 8), 1), _d("c", (2, 3))],
                     loader=undoes_a)
    assert not report.rolled_back
    fig = report.plot_placement()
    assert 'the writes of tensors marked "put back" were undone' in fig._suptitle.get_text()
    titles = {ax.get_title().split()[1]: ax.get_title() for ax in fig.axes[1::2]}
    assert "put back by the rollback" in titles["a"]
    assert "put back" not in titles["b"]


def test_placement_of_a_target_asked_for_that_was_not_written_says_so():
    report, _ = load("q k v")
    fig = plot_placement(report, ["qkv", "o"])
    notes = [[t.get_text() for t in ax.texts] for ax in fig.axes[1::2]]
    assert "not written" not in notes[0]
    assert notes[1] == ["not written"]
    assert not [p for p in fig.axes[3].patches if (p.get_gid() or "").startswith("write")]


def test_placement_into_a_tensor_laid_out_column_major_draws_the_rows_written():
    class Transposed(nn.Module):  # w: (4, 8) stored as the transpose of an (8, 4) tensor
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 4).t(), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data[1:3].copy_(t[1:3])  # rows 1 and 2 only
            return {"w"}

    report = inspect_load(Transposed(), [_d("w", (4, 8))])
    assert report.writes["target_stride"].tolist() == [(1, 4)]
    (rt,) = rects_by_gid(plot_placement(report), "write ")["write 0 runtime"]
    assert extent(rt) == (0, 8, 1, 3)  # (x0, x1, y0, y1): every column of rows 1 and 2
    assert rt.get_hatch() is None  # (exact)


def test_to_png_refuses_a_dpi_that_is_no_number():
    fig = Figure()
    for dpi in (True, "100", None):
        with pytest.raises(TypeError, match="to_png: dpi must be a positive number, got"):
            to_png(fig, dpi=dpi)
