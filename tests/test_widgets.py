"""patchkit.widgets: moving a control redraws the output from the new state."""

from __future__ import annotations

import base64
import math

import pytest
import torch
from torch import nn

import patchkit.plot
from patchkit import (
    CheckpointWeightPatch,
    PatchTypeError,
    format_bytes,
    inspect_load,
    native,
    plan_chunks,
    widgets,
)
from patchkit.toymodels import PlainModel
from patchkit.widgets import ChunkPlanner, ReportExplorer, chunk_planner, explore, plan_text

PNG = b"\x89PNG\r\n\x1a\n"


class Packed(nn.Module):
    """q, k, v (4 × 8) packed into the rows of ``qkv`` (12 × 8); ``norm`` (8,) as is."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.qkv = nn.Parameter(torch.randn(12, 8, generator=g), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(8), requires_grad=False)

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            if name == "norm":
                self.norm.data.copy_(t)
            else:
                self.qkv.data.narrow(0, 4 * "qkv".index(name), 4).copy_(t)
            names.add(name)
        return names


def dense(name: str, seed: int) -> CheckpointWeightPatch:
    shape = (8,) if name == "norm" else (4, 8)
    g = torch.Generator().manual_seed(seed)
    return CheckpointWeightPatch(name, shape, torch.float32,
                                 torch.randn(math.prod(shape), generator=g))


def patches() -> list[CheckpointWeightPatch]:
    return [dense(n, i) for i, n in enumerate(["q", "k", "v", "norm"])]  # 128 B ×3, 32 B


def texts(out) -> str:
    return "".join(o["text"] for o in out.outputs if o["output_type"] == "stream")


def images(out) -> list[bytes]:
    return [base64.b64decode(o["data"]["image/png"]) for o in out.outputs
            if o["output_type"] == "display_data"]


# -- chunk_planner -------------------------------------------------------------------------


def test_planner_redraws_the_plan_when_the_budget_slider_moves():
    ps = patches()
    w = chunk_planner(ps, max_chunk_bytes=1024)
    assert isinstance(w, ChunkPlanner)
    assert "→ 1 load_weights call\n" in texts(w.output)
    first = images(w.output)
    assert len(first) == 1 and first[0].startswith(PNG)

    w.slider.value = 200
    assert w.max_chunk_bytes == 200
    assert w.plan == plan_chunks(ps, 200)
    assert len(w.plan) == 3
    text = texts(w.output)
    assert "max_chunk_bytes = 200 B" in text and "→ 3 load_weights calls" in text
    assert "call 0: 1 patch (q), 128 B, closed by budget" in text
    assert "call 2: 2 patches (v, norm), 160 B, closed by end" in text
    assert images(w.output) != first
    assert w.readout.value == "200 B"


def test_planner_flags_a_patch_over_the_budget():
    w = chunk_planner(patches(), max_chunk_bytes=1024)
    w.slider.value = 100
    assert "over budget (travels alone)" in texts(w.output)


def test_planner_names_one_patch_not_in_a_list():
    # (it read the patch's five fields as patches: "patch 0 must be a
    # CheckpointWeightPatch, got str: 'q'; to draw a patch of a report by name ...")
    with pytest.raises(PatchTypeError, match=r"chunk_planner: expected a LoadReport or a "
                       r"list of CheckpointWeightPatch, got one patch \('q'\): pass \[patch\]$"):
        chunk_planner(patches()[0])


def test_planner_slider_spans_half_the_smallest_patch_to_twice_the_total():
    w = chunk_planner(patches())
    assert 2**w.slider.min == pytest.approx(32 / 2)  # norm: 8 float32
    assert 2**w.slider.max == pytest.approx(2 * (3 * 128 + 32))
    # no budget given: the default (512 MiB) clipped into range, which plans the same calls
    assert w.max_chunk_bytes == 2 * (3 * 128 + 32)
    assert [c.positions for c in w.plan] == [(0, 1, 2, 3)]


def test_planner_of_a_report_starts_from_the_report_plan():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = chunk_planner(report)
    assert w.max_chunk_bytes == 300
    assert w.plan == report.plan
    assert f"→ {len(report.plan)} load_weights calls" in texts(w.output)


# -- explore -------------------------------------------------------------------------------


def test_explore_shows_a_patch_density_map_and_its_summary_row():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    assert isinstance(w, ReportExplorer)
    assert w.dropdown.value == ("patch", 0)
    assert [o["output_type"] for o in w.output.outputs] == ["display_data", "stream"]
    assert " q " in texts(w.output) and "budget" in texts(w.output)
    first = images(w.output)

    w.dropdown.value = ("patch", 3)
    assert " norm " in texts(w.output) and " q " not in texts(w.output)
    assert images(w.output) != first


def test_explore_shows_placement_delta_and_rows_of_a_runtime_tensor():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    labels = [label for label, _ in w.dropdown.options]
    assert labels == ["patch 0: q", "patch 1: k", "patch 2: v", "patch 3: norm",
                      "runtime: qkv", "runtime: norm"]
    w.dropdown.value = ("runtime", "qkv")
    kinds = [o["output_type"] for o in w.output.outputs]
    assert kinds == ["display_data", "display_data", "stream"]  # placement, delta, rows
    assert all(png.startswith(PNG) for png in images(w.output))
    text = texts(w.output)
    assert "writes into qkv" in text and "[8:12, :]" in text
    assert "delta:" in text and "96" in text  # 3 × 32 elements written


def test_explore_of_a_report_handed_to_a_later_load_says_its_delta_figure_is_gone():
    model = Packed()
    report = inspect_load(model, patches(), max_chunk_bytes=300)
    assert not report.handed_over
    inspect_load(model, [dense(n, 10 + i) for i, n in enumerate("qkv")], reuse=report)
    assert report.handed_over
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    kinds = [o["output_type"] for o in w.output.outputs]
    assert kinds == ["display_data", "stream", "stream"]  # placement, a note, rows
    assert "handed to a later load" in texts(w.output)
    assert "writes into qkv" in texts(w.output)


def test_explore_of_a_rolled_back_load_says_the_rollback_put_the_tensor_back():
    # it said the tensor "the load registered has no values before it": it was written,
    # then put back by the transactional rollback
    from patchkit.toymodels import FailingModel

    model = FailingModel({"a": (4, 4), "b": (4, 4)}, fail_on="b")
    ps = [CheckpointWeightPatch(n, (4, 4), torch.float32, torch.ones(16)) for n in "ab"]
    with pytest.raises(RuntimeError) as info:
        inspect_load(model, ps, max_chunk_bytes=64, transactional=True)
    report = info.value.report
    assert report.rolled_back
    w = explore(report)
    w.dropdown.value = ("runtime", "a")
    assert texts(w.output).splitlines()[-1] == (
        "delta: none (written, then put back as it was by the load's transactional "
        "rollback: no change)")


def test_explore_planner_moves_independently_of_the_dropdown():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    before = w.output.outputs
    w.planner.slider.value = 800  # more than the 416 B staged in all
    assert w.planner.plan == plan_chunks(report.patches, 800)
    assert "→ 1 load_weights call\n" in texts(w.planner.output)
    assert w.output.outputs == before
    assert format_bytes(w.planner.max_chunk_bytes) == w.planner.readout.value


def test_widgets_have_a_short_stable_text_repr():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    assert repr(w) == "ReportExplorer(patches=4, runtime tensors=2)"
    assert repr(w.planner) == "ChunkPlanner(max_chunk_bytes=300, calls=2)"


# -- bad input and rejected loads ----------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -1])
def test_planner_rejects_a_budget_that_is_not_positive(budget):
    with pytest.raises(ValueError, match=f"max_chunk_bytes must be positive, got {budget}"):
        chunk_planner(patches(), max_chunk_bytes=budget)
    with pytest.raises(TypeError, match="max_chunk_bytes must be a positive int, got str"):
        chunk_planner(patches(), max_chunk_bytes="1 KiB")


def test_planner_and_explorer_name_an_argument_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"chunk_planner: expected a LoadReport .*got int: 3"):
        chunk_planner(3)
    with pytest.raises(TypeError, match=r"chunk_planner: patch 0 must be a CheckpointWeightPatch"):
        chunk_planner(["q"])
    with pytest.raises(TypeError, match=r"explore: report must be a LoadReport .*got list"):
        explore(patches())


def rejected(ps, **kw):
    with pytest.raises(ValueError) as info:
        inspect_load(Packed(), ps, **kw)
    return info.value.report


def test_explore_of_a_load_rejected_for_an_index_outside_the_tensor():
    bad = CheckpointWeightPatch("q", (4, 8), torch.float32, torch.ones(1), torch.tensor([100]))
    report = rejected([bad, dense("norm", 1)])
    w = explore(report)
    assert "the load raised PatchValueError" in w.children[0].value
    assert w.dropdown.value == ("patch", 0)
    assert [o["output_type"] for o in w.output.outputs] == ["stream", "stream"]
    text = texts(w.output)
    assert ("density map: not drawn: PatchValueError: patch 'q': out-of-range index 100 at "
            "indices[0]") in text
    assert " q " in text  # its report.chunks row
    w.dropdown.value = ("patch", 1)
    assert images(w.output) and " norm " in texts(w.output)
    w.planner.slider.value = 100
    assert w.planner.plan == plan_chunks(report.patches, 100)
    assert "→ 2 load_weights calls" in texts(w.planner.output)


def test_explore_of_a_load_rejected_for_max_chunk_bytes_0_plans_its_patches():
    report = rejected(patches(), max_chunk_bytes=0)
    assert report.plan == []
    w = explore(report)
    assert "max_chunk_bytes must be positive, got 0" in w.children[0].value
    assert w.planner.max_chunk_bytes == 2 * (3 * 128 + 32)  # the default, clipped into range
    assert w.planner.plan == plan_chunks(report.patches, w.planner.max_chunk_bytes)
    w.planner.slider.value = 200
    assert w.planner.plan == plan_chunks(report.patches, 200)
    assert "→ 3 load_weights calls" in texts(w.planner.output)
    w.dropdown.value = ("patch", 3)
    assert images(w.output) and " norm " in texts(w.output)


# -- errors in a redraw --------------------------------------------------------------------


@pytest.mark.skipif(
    not native.status().startswith("compiled"),
    reason="only the compiled merge saves a recipe of the patch's indices, which a change "
    "of them after the load breaks",
)
def test_explore_shows_why_a_figure_cannot_be_drawn_in_place_of_it():
    model = PlainModel({"a": (8, 8), "b": (8, 8)})
    pa = CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    pb = CheckpointWeightPatch("b", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    w = explore(inspect_load(model, [pa, pb]))
    w.dropdown.value = ("runtime", "a")
    pb.indices[0] = 5  # changed after the load: report.before("b") raises ValueError
    w.dropdown.value = ("runtime", "b")  # what a click does: an exception would be lost
    assert [o["output_type"] for o in w.output.outputs] == ["display_data", "stream", "stream"]
    text = texts(w.output)
    assert "before/after figure: not drawn: ValueError: patch 1 ('b'): its indices" in text
    assert "writes into b" in text and "writes into a" not in text


def test_a_patch_changed_in_place_after_the_load_is_not_drawn_as_the_load_wrote_it():
    # (the explorer's patch view and report.plot_density drew the new indices, under a
    # title counting the load's writes, without a word)
    import pickle

    model = PlainModel({"a": (8, 8), "b": (8, 8)})
    pa = CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    pb = CheckpointWeightPatch("b", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    report = inspect_load(model, [pa, pb])
    kept = pickle.loads(pickle.dumps(report))
    w = explore(report)
    pb.indices.copy_(torch.tensor([60, 61, 62]))  # a transport reusing its buffers
    for name, what in (("b", "indices"), ("a", None)):
        if what is None:
            assert report.plot_density(name).axes[0].images  # (a: unchanged, drawn)
        else:
            with pytest.raises(ValueError, match=rf"^patch 1 \('b'\): its {what} changed in "
                                                 "place after the load"):
                report.plot_density(name)
    pa.values.mul_(2)
    with pytest.raises(ValueError, match=r"^patch 0 \('a'\): its values changed in place"):
        report.plot_density(pa)
    w.dropdown.value = ("patch", 1)
    assert [o["output_type"] for o in w.output.outputs] == ["stream", "stream"]
    assert "density map: not drawn: ValueError: patch 1 ('b'): its indices changed" in texts(
        w.output)
    # a pickled copy keeps its own patches: the changes above are not its
    assert kept.plot_density("b").axes[0].images
    # the patch itself draws as it is now
    assert patchkit.plot.plot_density(pb).axes[0].images


def test_explore_shows_how_many_elements_each_write_wrote():
    # ("elements" of a sparse write is its view's; "written", the elements the merge
    # wrote, was left out, so "elements 64, changed 3" did not add up)
    model = PlainModel({"a": (8, 8)})
    pa = CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    w = explore(inspect_load(model, [pa]))
    w.dropdown.value = ("runtime", "a")
    rows = texts(w.output).split("writes into a:\n")[1].splitlines()
    head, first = rows[0].split(), rows[1].split()
    assert head[-3:] == ["elements", "written", "changed"] and first[-3:] == ["64", "3", "3"]


def test_explore_shows_any_error_of_a_figure_in_place_of_it(monkeypatch):
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)

    def fails(*_a, **_k):
        raise RuntimeError("no figure today")

    monkeypatch.setattr(patchkit.plot, "plot_density", fails)
    w.dropdown.value = ("patch", 3)
    assert [o["output_type"] for o in w.output.outputs] == ["stream", "stream"]
    assert "density map: not drawn: RuntimeError: no figure today\n" in texts(w.output)
    assert " norm " in texts(w.output)


def test_explore_replaces_the_whole_output_when_its_views_cannot_be_made(monkeypatch):
    w = explore(inspect_load(Packed(), patches(), max_chunk_bytes=300))
    monkeypatch.setattr(w, "report", object())  # no tables: every view raises
    w.dropdown.value = ("patch", 1)
    (out,) = w.output.outputs
    assert out["output_type"] == "stream"
    assert out["text"].startswith("views of ('patch', 1): not drawn: AttributeError: ")


def test_planner_shows_why_its_figure_or_plan_cannot_be_made(monkeypatch):
    w = chunk_planner(patches(), max_chunk_bytes=1024)

    def fails(*_a, **_k):
        raise RuntimeError("no figure today")

    monkeypatch.setattr(widgets, "_plot_chunks", fails)
    w.slider.value = 200
    assert [o["output_type"] for o in w.output.outputs] == ["stream", "stream"]
    text = texts(w.output)
    assert "chunk plan figure: not drawn: RuntimeError: no figure today\n" in text
    # where: the frame that raised, not the widget's call into it
    assert "  (raised in test_widgets.py, line " in text and ", in fails)\n" in text
    assert "max_chunk_bytes = 200 B" in text and len(w.plan) == 3

    monkeypatch.setattr(widgets, "_plan_for", fails)
    w.slider.value = 300
    (out,) = w.output.outputs
    assert out["text"].startswith("chunk plan at 300 B: not drawn: RuntimeError: no figure today")
    assert w.plan == []


def test_plan_text_and_explorer_heading_count_in_the_singular_for_one():
    import torch

    from patchkit import CheckpointWeightPatch, inspect_load, plan_chunks
    from patchkit.toymodels import PlainModel
    from patchkit.widgets import plan_text

    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))
    assert ": 1 patch, 16 B staged → 1 load_weights call" in plan_text(plan_chunks([p]), 1024)
    r = inspect_load(PlainModel({"w": (4,)}), [p])
    head = r.explore().children[0].value
    assert "1 patch, 1 load_weights call, 1 runtime write" in head


def test_planner_rounds_the_slider_to_the_nearest_whole_byte():
    # a log slider stops between whole bytes: 255.6 B is a budget of 256 B, which sends
    # q and k (128 B each) together; 255 B would not
    w = chunk_planner(patches(), max_chunk_bytes=1024)
    w.slider.value = 255.6
    assert w.max_chunk_bytes == 256
    assert w.plan == plan_chunks(patches(), 256)
    assert w.plan[0].positions == (0, 1)
    assert w.readout.value == "256 B"


class _OddNames(nn.Module):
    """Parameters named with a lone surrogate and with a carriage return (a patch file's
    JSON header may hold either), loaded by name."""

    NAMES = ("w\ud800", "cr\rret")

    def __init__(self):
        super().__init__()
        for n in self.NAMES:
            self.register_parameter(n, nn.Parameter(torch.zeros(3, 4), requires_grad=False))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for n, t in weights:
            params[n].data.copy_(t)
        return {n for n, _ in weights}


def _sent_as_json(obj) -> None:
    """What a Jupyter kernel does with a display message: JSON, then strict UTF-8 (a lone
    surrogate raises UnicodeEncodeError there)."""
    import json

    json.dumps(obj, ensure_ascii=False).encode("utf-8")


def test_names_with_a_lone_surrogate_or_a_control_character_reach_a_notebook_escaped():
    from patchkit.widgets import plan_text

    patches = [CheckpointWeightPatch(n, (3, 4), torch.float32, torch.ones(12))
               for n in _OddNames.NAMES]
    report = inspect_load(_OddNames(), patches)
    for text in (repr(report), report._repr_html_()):
        _sent_as_json(text)
        assert "w\\ud800" in text
    explorer = explore(report)
    labels = [label for label, _ in explorer.dropdown.options]
    assert "patch 0: w\\ud800" in labels and "runtime: cr\\rret" in labels
    _sent_as_json(explorer.dropdown.get_state())
    for _, value in explorer.dropdown.options:
        explorer.dropdown.value = value
        _sent_as_json(list(explorer.output.outputs))
        text = "".join(o.get("text", "") for o in explorer.output.outputs)
        assert "\r" not in text and "\ud800" not in text
    planner = chunk_planner(report.patches, 48)
    _sent_as_json(list(planner.output.outputs))
    shown = plan_text(planner.plan, 48)
    assert "(cr\\rret)" in shown and "\r" not in shown


def test_a_very_long_name_is_cut_in_its_dropdown_label_not_in_the_tables():
    name = "model." + "x" * 10_000 + ".weight"
    patches = [CheckpointWeightPatch(name, (2,), torch.float32, torch.ones(2))]
    report = inspect_load(_LongNamed(name), patches)
    labels = [label for label, _ in explore(report).dropdown.options]
    assert len(labels) == 2 and all(len(label) <= 130 for label in labels)
    assert labels[0].startswith("patch 0: model.xxx") and labels[0].endswith("xxx.weight")
    assert "…" in labels[0] and labels[1].startswith("runtime: model_xx")
    assert report.chunks["name"].iloc[0] == name  # (the whole name, where it is data)


def test_the_explorers_tables_are_whole_up_to_100_characters_and_in_blocks_past_that():
    # (pandas writes " position", a name column as wide as its longest name, "elements")
    import pandas as pd

    from patchkit.widgets import _table_text

    def table(n):
        return pd.DataFrame({"position": [1, 2], "name": ["n" * n, "m"], "elements": [3, 40]})

    def widths(text):
        return [max(map(len, block.splitlines())) for block in text.split("\n\n")]

    assert widths(_table_text(table(80), index=False, key="position")) == [100]
    # (one character more: the name and its position, then the position and the rest)
    wider = _table_text(table(81), index=False, key="position")
    assert widths(wider) == [91, 19]
    assert [b.split()[:2] for b in wider.split("\n\n")] == [["position", "name"],
                                                             ["position", "elements"]]
    # (a block of exactly 100 characters fits: two blocks, not three)
    assert widths(_table_text(table(90), index=False, key="position")) == [100, 19]


def test_the_explorers_tables_write_a_name_over_60_characters_whole():
    # (the labels cut a long name, the tables show it whole: written in blocks of columns,
    # they took the text repr's 60-character cut of a cell, "...lin_w..." and the name
    # was nowhere whole)
    name = "model.language_model.layers.10.mlp.experts.63.gate_up_proj.w" + "x" * 14
    patches = [CheckpointWeightPatch(name, (2,), torch.float32, torch.ones(2))]
    report = inspect_load(_LongNamed(name), patches)
    explorer = explore(report)
    shown = {}
    for label, value in explorer.dropdown.options:
        explorer.dropdown.value = value
        shown[label.split(":")[0]] = texts(explorer.output)
    assert len(name) == 74 and set(shown) == {"patch 0", "runtime"}
    runtime = name.replace(".", "_")
    # (the patch's row, and the writes and the delta of the runtime tensor)
    assert name in shown["patch 0"]
    assert name in shown["runtime"] and runtime in shown["runtime"]
    assert "..." not in shown["patch 0"] + shown["runtime"]


class _LongNamed(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(2), False))
        self.key = name.replace(".", "_")

    def load_weights(self, weights):
        for _, t in weights:
            getattr(self, self.key).data.copy_(t)
        return {n for n, _ in weights}


# -- what the widgets say, for every kind of report ----------------------------------------


class _ByName(nn.Module):
    """Zero float32 parameters of the given shapes; ``load_weights`` copies each weight
    into the parameter of its name (a ``model.`` prefix, as vLLM maps names, dropped)."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        for n, shape in shapes.items():
            setattr(self, n, nn.Parameter(torch.zeros(shape), requires_grad=False))

    def load_weights(self, weights):
        for n, t in weights:
            getattr(self, n.removeprefix("model.")).data.copy_(t)
        return {n for n, _ in weights}


def _one_call_loader(model, weights, max_chunk_bytes=None, **kw):
    """An observed loader that sends every patch in one call, whatever the budget."""
    model.load_weights([(p.name, p.values.reshape(p.shape)) for p in weights])


def test_planner_of_an_observed_report_shows_plans_at_every_budget_its_own_included():
    # At exactly the report's budget it showed the loader's 1 call, and plan_chunks' 2
    # at any other value: the planner shows plans, not calls.
    ps = patches()
    report = inspect_load(Packed(), ps, max_chunk_bytes=300, loader=_one_call_loader)
    assert len(report.plan) == 1  # (the loader's own call)
    w = chunk_planner(report)
    for budget in (299, 300, 301):
        w.slider.value = budget
        want = plan_chunks(ps, budget)
        assert [c.positions for c in w.plan] == [c.positions for c in want], budget
        assert f"→ {len(want)} load_weights calls" in texts(w.output)
    # the report's own figure still draws the calls the loader made
    assert len(report.plot_chunks().axes[0].get_xticks()) == 1


def test_an_observed_call_that_staged_another_dtype_has_bars_that_add_up_to_it():
    def widening(model, weights, max_chunk_bytes=None, **kw):
        model.load_weights([(p.name, p.values.reshape(p.shape).float()) for p in weights])

    ps = [CheckpointWeightPatch("a", (16, 16), torch.bfloat16, torch.ones(256).bfloat16()),
          CheckpointWeightPatch("b", (16,), torch.bfloat16, torch.ones(16).bfloat16())]
    report = inspect_load(_ByName(a=(16, 16), b=(16,)), ps, max_chunk_bytes=256, loader=widening)
    assert report.summary()["staged bytes"] == 4 * 272  # float32, as the loader staged
    fig = report.plot_chunks()
    heights = [r.get_height() for r in fig.axes[0].patches
               if (r.get_gid() or "").startswith("segment")]
    assert sum(heights) == 4 * 272 and heights == [1024, 64]


def test_explorer_repr_counts_the_runtime_tensors_it_lists():
    class Boom(Packed):
        def load_weights(self, weights):
            super().load_weights(weights)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError) as e:
        inspect_load(Boom(), patches(), transactional=True)
    report = e.value.report
    w = explore(report)
    listed = [v for _, v in w.dropdown.options if v[0] == "runtime"]
    assert len(listed) == 2 and repr(w) == "ReportExplorer(patches=4, runtime tensors=2)"


def test_a_budget_past_floats_range_is_planned_and_drawn():
    huge = 2**1024
    report = inspect_load(Packed(), patches(), max_chunk_bytes=huge)
    assert len(report.plot_chunks().axes[0].get_xticks()) == 1
    w = chunk_planner(patches(), max_chunk_bytes=huge)
    assert len(w.plan) == 1 and w.plan == plan_chunks(patches(), w.max_chunk_bytes)
    explore(report)


def test_long_names_cut_to_the_same_label_are_told_apart():
    stem = "model." + "segment" * 40
    names = [f"{stem}.{i}.{stem}.weight" for i in range(3)]
    model = PlainModel({n: (2,) for n in names})
    report = inspect_load(model, [CheckpointWeightPatch(n, (2,), torch.float32, torch.ones(2))
                                  for n in names])
    labels = [label for label, _ in explore(report).dropdown.options]
    assert len(set(labels)) == len(labels) == 6
    assert labels[4].endswith(" (2)") and labels[5].endswith(" (3)")


def test_labels_are_told_apart_even_where_a_suffix_is_taken():
    from patchkit.widgets import _told_apart

    got = _told_apart([("a", 1), ("a (2)", 2), ("a", 3), ("a", 4)])
    assert [label for label, _ in got] == ["a", "a (2)", "a (3)", "a (4)"]
    assert [v for _, v in got] == [1, 2, 3, 4]


def test_a_loader_that_renames_names_is_planned_as_its_patches_are_given():
    # The sent names match no patch (position -1), and the planner took patches[-1],
    # the last patch, for each: 32 B planned for a 16400 B call.
    ps = [CheckpointWeightPatch("big", (64, 64), torch.float32, torch.ones(4096)),
          CheckpointWeightPatch("small", (4,), torch.float32, torch.ones(4))]

    def renaming(model, patches, max_chunk_bytes=None, **kw):
        model.load_weights([("model." + p.name, p.values.reshape(p.shape)) for p in patches])

    report = inspect_load(_ByName(big=(64, 64), small=(4,)), ps, loader=renaming)
    assert report.plan[0].positions == (-1, -1) and report.plan[0].bytes == 16400
    w = chunk_planner(report)
    assert w.plan == plan_chunks(ps, w.max_chunk_bytes) and w.plan[0].bytes == 16400
    fig = report.plot_chunks()
    heights = [r.get_height() for r in fig.axes[0].patches
               if (r.get_gid() or "").startswith("segment")]
    assert sum(heights) == 16400


def test_the_explorer_of_an_unpickled_report_says_so_in_words():
    import pickle

    report = pickle.loads(pickle.dumps(inspect_load(Packed(), patches(), max_chunk_bytes=300)))
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    text = texts(w.output)
    assert "this report was unpickled" in text and "raised in" not in text


class _NoStr(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be written")


def test_explore_of_a_load_whose_error_cannot_be_written():
    # (explore() raised the RuntimeError of the error's __str__)
    class Refuses(PlainModel):
        def load_weights(self, weights):
            raise _NoStr()

    with pytest.raises(_NoStr) as info:
        inspect_load(Refuses({"w": (2,)}), [CheckpointWeightPatch(
            "w", (2,), torch.float32, torch.ones(2))])
    w = explore(info.value.report)
    assert "the load raised _NoStr: &lt;exception str() failed&gt;" in w.children[0].value


def test_plan_text_and_explorer_heading_count_patches_calls_writes_and_what_is_left_out():
    from patchkit.widgets import plan_text

    # four patches in one call, four writes: each count is its own
    report = inspect_load(Packed(), patches(), max_chunk_bytes=1024)
    assert plan_text(plan_chunks(patches(), 1024), 1024).startswith(
        "max_chunk_bytes = 1 KiB: 4 patches, 416 B staged → 1 load_weights call\n")
    assert "4 patches, 1 load_weights call, 4 runtime writes" in explore(report).children[0].value
    # 45 patches of one name: 45 calls (a repeated name closes each) and 45 writes into it;
    # 40 calls are listed, then how many are not, and 20 writes, then how many are not
    ps = [CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(1), torch.tensor([k]))
          for k in range(45)]
    text = plan_text(plan_chunks(ps, 1024), 1024)
    assert text.count("  call ") == 40 and text.endswith("\n  … 5 more calls\n")
    w = explore(inspect_load(PlainModel({"a": (8, 8)}), ps, max_chunk_bytes=1024))
    w.dropdown.value = ("runtime", "a")
    rows = texts(w.output).split("writes into a:\n")[1].split("\ndelta:")[0]
    assert len(rows.splitlines()) == 1 + 20 + 1 and rows.endswith("… 25 more writes\n")
    # (one left out is one write, not "1 more writes")
    w = explore(inspect_load(PlainModel({"a": (8, 8)}), ps[:21], max_chunk_bytes=1024))
    w.dropdown.value = ("runtime", "a")
    rows = texts(w.output).split("writes into a:\n")[1].split("\ndelta:")[0]
    assert len(rows.splitlines()) == 1 + 20 + 1 and rows.endswith("… 1 more write\n")


# -- the slider's range at its edges, and what a redraw writes -----------------------------


def test_planner_slider_range_at_its_edges():
    # no patches: 1 B to 4 B (log2(0) would raise), a plan of no calls
    w = chunk_planner([])
    assert (2**w.slider.min, 2**w.slider.max) == (1, 4) and w.plan == []
    assert "0 patches, 0 B staged → 0 load_weights calls" in texts(w.output)
    # a 1-byte patch: half of it is under a byte, the slider starts at 1 B
    one = torch.ones(1, dtype=torch.int8)
    w = chunk_planner([CheckpointWeightPatch("b", (1,), torch.int8, one)])
    assert 2**w.slider.min == 1 and w.max_chunk_bytes == 4
    # a patch of no elements stages nothing: half the smallest *non-empty* one (norm, 32 B)
    w = chunk_planner([CheckpointWeightPatch("e", (0,), torch.float32, torch.ones(0)),
                       dense("norm", 1)])
    assert (2**w.slider.min, 2**w.slider.max) == (16, 64)


@pytest.mark.parametrize("budget", [4, 1024])
def test_planner_widens_its_slider_to_a_budget_outside_the_patches_range(budget):
    # (below half the smallest patch, 16 B, or above twice the total, 832 B)
    w = chunk_planner(patches(), max_chunk_bytes=budget)
    assert w.max_chunk_bytes == budget and w.readout.value == format_bytes(budget)
    assert 2 ** (w.slider.min if budget < 16 else w.slider.max) == pytest.approx(budget)
    assert f"max_chunk_bytes = {format_bytes(budget)}:" in texts(w.output)


def test_planner_without_a_budget_starts_at_the_default_when_it_is_in_range(monkeypatch):
    monkeypatch.setattr(widgets, "DEFAULT_MAX_CHUNK_BYTES", 200)
    w = chunk_planner(patches())
    assert w.max_chunk_bytes == 200 and len(w.plan) == 3


def test_planner_of_a_report_takes_a_budget_given_over_the_report_own():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = chunk_planner(report, max_chunk_bytes=200)
    assert w.max_chunk_bytes == 200 and w.plan == plan_chunks(report.patches, 200)


def test_planner_redraws_once_the_slider_is_let_go_figure_then_text():
    # each redraw renders a PNG: redrawing at every step of a drag would queue dozens
    w = chunk_planner(patches(), max_chunk_bytes=1024)
    assert w.slider.continuous_update is False
    w.slider.value = 200
    assert [o["output_type"] for o in w.output.outputs] == ["display_data", "stream"]


def test_plan_text_lists_four_names_of_a_call_then_how_many_more():
    ps = [dense(n, i) for i, n in enumerate(["q", "k", "v", "norm"])]
    assert "(q, k, v, norm)," in plan_text(plan_chunks(ps, 1024), 1024)
    ps.append(CheckpointWeightPatch("x", (2,), torch.float32, torch.ones(2)))
    assert "(q, k, v, norm, … (+1))," in plan_text(plan_chunks(ps, 1024), 1024)


# -- what each choice of the explorer shows --------------------------------------------------


def test_a_name_is_cut_in_a_label_only_past_120_characters_keeping_more_of_its_end():
    from patchkit.widgets import _shown

    assert _shown("n" * 120) == "n" * 120
    name = "a" * 60 + "b" * 61  # 121: the first 59, an ellipsis, the last 60
    assert _shown(name) == "a" * 59 + "…" + "b" * 60


class _FirstCallFails(Packed):
    def load_weights(self, weights):
        raise RuntimeError("boom")


def _first_call_fails():
    """The report of a load of ``patches()`` in two calls whose first one raised."""
    with pytest.raises(RuntimeError) as info:
        inspect_load(_FirstCallFails(), patches(), max_chunk_bytes=300)
    return info.value.report


def test_explore_shows_a_patch_row_note_on_a_line_of_its_own():
    report = _first_call_fails()
    note = report.chunks["note"].iloc[3]
    assert note  # (norm, in the second call, was never sent)
    w = explore(report)
    w.dropdown.value = ("patch", 3)
    table, *notes = texts(w.output).split("\nnote: ")
    assert notes == [note + "\n"]
    assert "note" not in table.splitlines()[0].split()  # the column is the line below


def test_explore_draws_the_placement_of_the_chosen_tensor_alone(monkeypatch):
    drawn = []

    def placement(report, **kw):
        drawn.append(kw)
        return patchkit.plot.plot_placement(report, **kw)

    monkeypatch.setattr(widgets, "plot_placement", placement)
    w = explore(inspect_load(Packed(), patches(), max_chunk_bytes=300))
    w.dropdown.value = ("runtime", "norm")
    assert drawn == [{"targets": ["norm"]}]


def test_explore_of_a_report_of_no_patches_says_so():
    w = explore(inspect_load(PlainModel({"a": (4,)}), []))
    assert w.dropdown.options == () and w.dropdown.value is None
    assert texts(w.output) == "nothing to show: the report has no patches\n"


def test_explore_says_why_a_tensor_the_load_registered_has_no_delta():
    class Registers(PlainModel):
        def load_weights(self, weights):
            names = super().load_weights(weights)
            self.extra = nn.Parameter(torch.ones(2), requires_grad=False)
            return names

    w = explore(inspect_load(Registers({"a": (4,)}),
                             [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))]))
    w.dropdown.value = ("runtime", "extra")
    assert texts(w.output).endswith(
        "\ndelta: none (a tensor the load registered has no values before it)\n")


def test_the_planner_figure_of_an_observed_report_draws_the_plan_not_the_loader_calls(
        monkeypatch):
    drawn = []

    def recorded(*a, **kw):
        drawn.append(fig := widgets_plot_chunks(*a, **kw))
        return fig

    widgets_plot_chunks = widgets._plot_chunks
    monkeypatch.setattr(widgets, "_plot_chunks", recorded)
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300, loader=_one_call_loader)
    w = chunk_planner(report)  # at 300 B: the loader sent 1 call, plan_chunks makes 2
    assert len(w.plan) == 2 and len(drawn[-1].axes[0].get_xticks()) == 2


def test_no_more_line_at_exactly_40_calls_or_20_writes():
    ps = [CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(1), torch.tensor([k]))
          for k in range(40)]
    text = plan_text(plan_chunks(ps, 1024), 1024)
    assert text.count("  call ") == 40 and "more calls" not in text
    w = explore(inspect_load(PlainModel({"a": (8, 8)}), ps[:20], max_chunk_bytes=1024))
    w.dropdown.value = ("runtime", "a")
    rows = texts(w.output).split("writes into a:\n")[1].split("\ndelta:")[0]
    assert len(rows.splitlines()) == 1 + 20 and "more writes" not in rows


def test_a_handed_over_report_says_so_without_trying_to_draw():
    model = Packed()
    report = inspect_load(model, patches(), max_chunk_bytes=300)
    inspect_load(model, [dense(n, 10 + i) for i, n in enumerate("qkv")], reuse=report)
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    assert w.output.outputs[1]["text"] == (
        "before/after figure: none, this report's before-values were handed to a later "
        "load (reuse=)\n")


# -- what each control offers, and where it sits -------------------------------------------


def test_planner_offers_a_base_2_log_slider_of_fine_steps_read_out_in_human_bytes():
    w = chunk_planner(patches(), max_chunk_bytes=300)
    s = w.slider
    assert isinstance(s, widgets.W.FloatLogSlider) and s.base == 2
    assert s.description == "max_chunk_bytes"
    # the budget reads in the Label beside it, in human bytes, not as the slider's float
    assert s.readout is False and w.readout.value == "300 B"
    # neighbouring stops differ by a few percent at most: any budget can be neared
    assert 2 ** s.step < 1.05
    (row, out) = w.children
    assert row.children == (s, w.readout) and out is w.output


def test_planner_redraws_only_when_the_budget_changes():
    w = chunk_planner(patches(), max_chunk_bytes=300)
    w.output.outputs = ()  # (a redraw would fill it again)
    w.slider.value = w.slider.value
    w.slider.description = "budget"
    w.slider.step = w.slider.step / 2
    assert w.output.outputs == ()
    w.slider.value = 200
    assert len(w.output.outputs) == 2


def test_explorer_offers_a_show_dropdown_above_its_output_and_the_planner_below():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    head, dropdown, output, title, planner = w.children
    assert dropdown is w.dropdown and dropdown.description == "show"
    assert output is w.output and planner is w.planner
    assert title.value == "<b>chunk plan</b>"
    assert head.value.startswith("<b>LoadReport</b>: 4 patches")


def _many_tensors(n: int):
    """A report of ``n`` one-element tensors: ``n`` patches and ``n`` runtime tensors."""
    names = [f"layers.{i}.w" for i in range(n)]
    model = PlainModel({name: (1,) for name in names})
    return inspect_load(model, [CheckpointWeightPatch(name, (1,), torch.float32,
                                                      torch.ones(1)) for name in names])


def test_explorer_of_thousands_of_entries_lists_a_few_hundred_and_finds_the_rest():
    # (a whole model's report listed every patch and runtime tensor: 4000 lines, 171 kB
    # of labels sent to the browser at each display, for 2000 tensors, with no way to
    # search them)
    report = _many_tensors(1500)
    w = explore(report)
    assert len(w.dropdown.options) == 200 < 3000
    _, find, dropdown, *_ = w.children
    assert find.children == (w.filter, w.filter_note) and dropdown is w.dropdown
    assert w.filter.continuous_update is False  # (narrowed on Enter, not per keystroke)
    assert w.filter_note.value == ("showing the first 200 of 3000 entries: type words of a "
                                   "name to find others")
    redraws = []
    redraw = w.redraw
    w.redraw = lambda: (redraws.append(w.dropdown.value), redraw())[1]

    w.filter.value = "Runtime layers.1499."  # every word, case-insensitively
    assert w.dropdown.options == (("runtime: layers.1499.w", ("runtime", "layers.1499.w")),)
    assert redraws == [("runtime", "layers.1499.w")]  # one redraw per change
    assert "writes into layers.1499.w" in texts(w.output)
    assert w.filter_note.value == "1 of 3000 matches"

    w.filter.value = "layers.149"  # the choice still listed: kept, not redrawn
    assert len(w.dropdown.options) == 22 and w.dropdown.value == ("runtime", "layers.1499.w")
    assert len(redraws) == 1 and w.filter_note.value == "22 of 3000 match"

    w.filter.value = "no such tensor"
    assert w.dropdown.options == () and len(redraws) == 2
    assert texts(w.output) == ("nothing matches the filter 'no such tensor': change it to "
                               "list entries\n")
    assert w.filter_note.value == "no entry of 3000 matches"

    w.filter.value = "runtime"
    assert len(w.dropdown.options) == 200 and len(redraws) == 3
    assert w.dropdown.value == ("runtime", "layers.0.w")
    assert w.filter_note.value == "1500 of 3000 match: showing the first 200"


def test_explorer_of_a_few_hundred_entries_lists_them_all_without_a_filter():
    w = explore(_many_tensors(100))
    assert len(w.dropdown.options) == 200 and w.filter is None
    assert w.children[1] is w.dropdown


def test_explorer_says_when_nothing_is_chosen():
    w = explore(inspect_load(Packed(), patches(), max_chunk_bytes=300))
    w.dropdown.value = None
    assert texts(w.output) == "nothing chosen: pick a patch or a runtime tensor above\n"


def test_explorer_heading_counts_the_calls_made_not_those_planned():
    report = _first_call_fails()
    assert (len(report.calls), len(report.plan)) == (1, 2)
    assert "4 patches, 1 load_weights call, 0 runtime writes" in explore(report).children[0].value


# -- what a redraw writes, as a notebook stores it ------------------------------------------


def test_outputs_are_a_png_display_data_and_a_stdout_stream():
    w = chunk_planner(patches(), max_chunk_bytes=300)
    fig, text = w.output.outputs
    assert set(fig) == {"output_type", "data", "metadata"} and fig["metadata"] == {}
    assert set(fig["data"]) == {"image/png", "text/plain"}
    assert " size " in fig["data"]["text/plain"] and "Axes" in fig["data"]["text/plain"]
    assert text == {"output_type": "stream", "name": "stdout", "text": plan_text(w.plan, 300)}


def test_explorer_labels_an_item_with_no_str_name_and_tells_apart_twice_taken_suffixes():
    from patchkit.widgets import _told_apart

    with pytest.raises(TypeError) as info:
        inspect_load(PlainModel({"a": (4,)}), [(5, (4,), torch.float32, torch.ones(4), None)])
    assert [label for label, _ in explore(info.value.report).dropdown.options] == [
        "patch 0: None"]
    got = _told_apart([("a", 1), ("a (2)", 2), ("a (3)", 3), ("a", 4)])
    assert [label for label, _ in got] == ["a", "a (2)", "a (3)", "a (4)"]


def test_explore_shows_each_write_column_and_the_chosen_tensor_delta_row_alone():
    w = explore(inspect_load(Packed(), patches(), max_chunk_bytes=300))
    w.dropdown.value = ("runtime", "norm")
    text = texts(w.output)
    rows, delta = text.split("writes into norm:\n")[1].split("\ndelta:\n")
    assert rows.splitlines()[0].split() == [
        "chunk", "position", "name", "checkpoint_region", "target_region", "elements",
        "written", "changed"]
    assert rows.splitlines()[1].split()[:3] == ["1", "3", "norm"]
    assert [line.split()[0] for line in delta.splitlines()] == ["elements", "target", "norm"]


def test_planner_of_a_report_refused_for_a_budget_that_is_no_int_starts_at_the_default():
    with pytest.raises(TypeError) as info:
        inspect_load(Packed(), patches(), max_chunk_bytes="1 KiB")
    w = chunk_planner(info.value.report)
    assert w.max_chunk_bytes == 2 * (3 * 128 + 32)  # the default, clipped into range
    assert w.plan == plan_chunks(patches(), w.max_chunk_bytes)


def test_the_explorers_tables_write_names_and_numbers_as_the_reports_reprs_do():
    # Each choice's text tables (its chunks row, its writes, its deltas row) wrote names
    # raw, so a right-to-left override reversed the rest of its row and 'w ' read as
    # 'w', and floats with pandas' six decimals ('1.000000e-07', '0.684144'); the
    # report's own reprs escape such names (distinct_name) and write 4 significant digits.
    names = ["rtl\u202eevil", "w ", "w"]
    report = inspect_load(PlainModel({n: (4,) for n in names}),
                          [CheckpointWeightPatch(n, (4,), torch.float32,
                                                 torch.tensor([1e-7, 0.0, 0.0, 0.0]))
                           for n in names])
    explorer = explore(report)
    shown = {}
    for label, value in explorer.dropdown.options:
        explorer.dropdown.value = value
        shown[label] = texts(explorer.output)
    for label, text in shown.items():
        assert "\u202e" not in text, label
        assert "e-07" in text or label.startswith("patch"), label
        assert "000000" not in text, label
    assert "'rtl\\u202eevil'" in shown["patch 0: rtl\\u202eevil"]
    assert "'rtl\\u202eevil'" in shown["runtime: rtl\\u202eevil"]
    # ('w ' and 'w' told apart in the tables, as repr(report) tells them apart)
    assert "'w '" in shown["patch 1: w "] and "'w '" in shown["runtime: w "]
    assert "'w '" not in shown["runtime: w"]
    assert " 1e-07 " in shown["runtime: w"]  # (max_abs and mean_abs of the deltas row)


def test_the_explorers_patch_row_writes_a_tiny_density_in_four_significant_digits():
    big = CheckpointWeightPatch("big", (1024, 1024), torch.float32, torch.tensor([1.0]),
                                torch.tensor([7]))
    report = inspect_load(PlainModel({"big": (1024, 1024)}), [big])
    explorer = explore(report)
    text = texts(explorer.output)  # (patch 0 is the first choice)
    assert " 9.537e-07 " in text and "9.536743e-07" not in text


# -- the views kept: choosing an entry again draws nothing ---------------------------------


def _counting_figures(monkeypatch) -> list[str]:
    """Patch widgets.figure_output to record each figure it renders (its suptitle)."""
    drawn: list[str] = []
    render = widgets.figure_output

    def counted(fig):
        drawn.append(fig._suptitle.get_text() if fig._suptitle else "")
        return render(fig)

    monkeypatch.setattr(widgets, "figure_output", counted)
    return drawn


def test_choosing_an_entry_again_draws_no_figure_and_shows_what_it_showed(monkeypatch):
    # (each choice redrew its figures: 0.5-0.7 s a runtime tensor on a CPU, each time a
    # user went back to it)
    drawn = _counting_figures(monkeypatch)
    w = explore(inspect_load(Packed(), patches(), max_chunk_bytes=300))
    assert len(drawn) == 1 + 1  # (the planner's plan, patch 0's density map)
    shown = {}
    for choice in [("runtime", "qkv"), ("patch", 2), ("runtime", "norm")]:
        w.dropdown.value = choice
        shown[choice] = w.output.outputs
    assert len(drawn) == 2 + 2 + 1 + 2
    for choice in [("runtime", "qkv"), ("patch", 2), ("runtime", "norm"), ("patch", 0)]:
        w.dropdown.value = choice
        if choice in shown:
            assert w.output.outputs == shown[choice]
    assert len(drawn) == 7  # nothing drawn again


def test_a_patch_of_no_elements_is_kept_and_not_drawn_again(monkeypatch):
    drawn = _counting_figures(monkeypatch)
    empty = CheckpointWeightPatch("e", (0, 4), torch.float32, torch.zeros(0))
    full = CheckpointWeightPatch("w", (2, 4), torch.float32, torch.ones(8))
    w = explore(inspect_load(PlainModel({"e": (0, 4), "w": (2, 4)}), [empty, full]))
    assert w.dropdown.value == ("patch", 0) and len(drawn) == 2  # (plan, e's density map)
    shown = w.output.outputs
    w.dropdown.value = ("runtime", "w")
    assert len(drawn) == 4
    w.dropdown.value = ("patch", 0)
    assert len(drawn) == 4 and w.output.outputs == shown  # nothing drawn again


def test_a_kept_view_equals_the_view_of_a_new_explorer():
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    for choice in [("runtime", "qkv"), ("patch", 1), ("runtime", "qkv"), ("patch", 1)]:
        w.dropdown.value = choice
        fresh = explore(report)
        fresh.dropdown.value = choice
        assert w.output.outputs == fresh.output.outputs


def test_the_views_kept_are_bounded_and_the_least_recently_shown_go_first(monkeypatch):
    report = inspect_load(Packed(), patches(), max_chunk_bytes=300)
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    one = sum(widgets._output_bytes(o) for o in w.output.outputs)
    # room for one runtime tensor's views, not two
    monkeypatch.setattr(widgets, "_CACHE_BYTES", one + one // 4)
    w = explore(report)
    drawn = _counting_figures(monkeypatch)
    for choice in [("runtime", "qkv"), ("runtime", "norm"), ("runtime", "norm")]:
        w.dropdown.value = choice
        assert w._cache_bytes <= widgets._CACHE_BYTES
    assert len(drawn) == 4  # qkv's two figures, norm's two, norm kept
    w.dropdown.value = ("runtime", "qkv")  # dropped to make room for norm: drawn again
    assert len(drawn) == 6
    assert w._cache_bytes <= widgets._CACHE_BYTES
    w.dropdown.value = ("runtime", "qkv")
    assert len(drawn) == 6
    # a view bigger than all the room is shown, not kept
    monkeypatch.setattr(widgets, "_CACHE_BYTES", 100)
    w = explore(report)
    w.dropdown.value = ("runtime", "norm")
    assert images(w.output) and w._cache_bytes <= 100


def test_a_kept_view_after_a_reuse_handover_says_its_delta_figure_is_gone(monkeypatch):
    model = Packed()
    report = inspect_load(model, patches(), max_chunk_bytes=300)
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    assert len(images(w.output)) == 2  # placement, delta
    w.dropdown.value = ("runtime", "norm")
    inspect_load(model, [dense(n, 10 + i) for i, n in enumerate("qkv")], reuse=report)
    drawn = _counting_figures(monkeypatch)
    w.dropdown.value = ("runtime", "qkv")
    assert [o["output_type"] for o in w.output.outputs] == ["display_data", "stream", "stream"]
    assert "handed to a later load" in texts(w.output)
    assert drawn == []  # (the placement, the load's record, is kept)
    fresh = explore(report)
    fresh.dropdown.value = ("runtime", "qkv")
    assert w.output.outputs == fresh.output.outputs


def test_a_kept_delta_is_drawn_again_once_the_model_changed(monkeypatch):
    # (plot_delta reads the model as it is now: a write through .data moves no version
    # counter, so the kept figure is checked against the tensor's bytes)
    model = Packed()
    report = inspect_load(model, patches(), max_chunk_bytes=300)
    w = explore(report)
    w.dropdown.value = ("runtime", "qkv")
    before = w.output.outputs
    w.dropdown.value = ("runtime", "norm")
    model.qkv.data[9, 3] += 100.0  # another write after the load
    drawn = _counting_figures(monkeypatch)
    w.dropdown.value = ("runtime", "qkv")
    assert len(drawn) == 1 and "the model changed after this load" in drawn[0]
    assert w.output.outputs[0] == before[0] and w.output.outputs[1] != before[1]
    fresh = explore(report)
    fresh.dropdown.value = ("runtime", "qkv")
    assert w.output.outputs == fresh.output.outputs
    model.qkv.data = model.qkv.data.clone()  # same values, other memory: drawn again
    w.dropdown.value = ("runtime", "norm")
    del drawn[:]
    w.dropdown.value = ("runtime", "qkv")
    assert len(drawn) == 1


def test_a_kept_density_map_is_not_shown_once_its_patch_changed_in_place():
    model = PlainModel({"a": (8, 8), "b": (8, 8)})
    pa = CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    pb = CheckpointWeightPatch("b", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    w = explore(inspect_load(model, [pa, pb]))
    w.dropdown.value = ("patch", 1)
    assert images(w.output)
    w.dropdown.value = ("patch", 0)
    pb.indices.copy_(torch.tensor([60, 61, 62]))
    w.dropdown.value = ("patch", 1)
    assert "density map: not drawn: ValueError: patch 1 ('b'): its indices changed" in texts(
        w.output)


@pytest.mark.skipif(
    not native.status().startswith("compiled"),
    reason="only the compiled merge saves a recipe of the patch's indices, which a change "
    "of them after the load breaks",
)
def test_a_kept_delta_is_not_shown_once_the_indices_it_reads_back_changed():
    # (a sparse save finds where it sits from its patch's indices: changed through .data,
    # which moves no version counter, the delta cannot be drawn any more)
    model = PlainModel({"a": (8, 8), "b": (8, 8)})
    pa = CheckpointWeightPatch("a", (8, 8), torch.float32, torch.ones(3), torch.tensor([1, 2, 3]))
    w = explore(inspect_load(model, [pa]))
    w.dropdown.value = ("runtime", "a")
    assert len(images(w.output)) == 2
    w.dropdown.value = ("patch", 0)
    pa.indices.data[0] = 5
    w.dropdown.value = ("runtime", "a")
    assert "before/after figure: not drawn: ValueError: patch 0 ('a'): its indices" in texts(
        w.output)


# -- lifetime: closing a widget lets its report and the model go -------------------------


def _many_patches() -> list[CheckpointWeightPatch]:
    # more than 200 entries: the explorer gets its filter box too
    return [CheckpointWeightPatch(f"w{i}", (2, 2), torch.float32, torch.full((4,), 1.0 + i))
            for i in range(210)]


@pytest.mark.parametrize("entries", ["few", "many"])
def test_closing_an_explorer_frees_its_report_and_the_model(entries):
    # ipywidgets keeps every widget until it is closed; the explorer's children (its
    # drop-down, outputs, planner, their layouts) observe it, so closing the box alone
    # kept the report, and through it the model and its tensors, alive for good.
    import gc
    import weakref

    import ipywidgets

    open_before = len(ipywidgets.widgets.widget._instances)
    if entries == "few":
        model, sent = Packed(), patches()
    else:
        model, sent = PlainModel({f"w{i}": (2, 2) for i in range(210)}), _many_patches()
    w = explore(inspect_load(model, sent, max_chunk_bytes=300))
    if w.filter is not None:
        w.filter.value = "w20"
    w.dropdown.value = w.dropdown.options[-1][1]
    w.planner.slider.value = w.planner.slider.value / 2
    alive = [weakref.ref(x) for x in (model, next(model.parameters()), w.report, w.planner)]
    w.close()
    del w, model, sent
    gc.collect()
    assert [ref() is None for ref in alive] == [True] * 4
    assert len(ipywidgets.widgets.widget._instances) == open_before


def test_closing_a_planner_frees_its_patches():
    import gc
    import weakref

    import ipywidgets

    open_before = len(ipywidgets.widgets.widget._instances)
    sent = patches()
    w = chunk_planner(sent)
    w.slider.value = w.slider.value / 2
    alive = weakref.ref(sent[0].values)
    w.close()
    del w, sent
    gc.collect()
    assert alive() is None
    assert len(ipywidgets.widgets.widget._instances) == open_before


def test_the_explorers_tables_of_long_names_fit_100_columns_in_blocks_of_columns():
    # (a writes row of a mixture-of-experts tensor, "model.layers.0.mlp.experts.0.
    # gate_proj.weight", took 124 characters: JupyterLab beside its file browser wrapped
    # it inside its last column, each row's last number on a line of its own; the tables
    # are now written as the report's text repr writes them, in blocks of columns)
    names = [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(3)]

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w13_weight = nn.Parameter(torch.zeros(3, 4, 8), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                self.w13_weight.data[names.index(name)].copy_(t)
            return {"w13_weight"}

    report = inspect_load(Experts(), [
        CheckpointWeightPatch(n, (4, 8), torch.float32, torch.tensor([2.0, 3.0]),
                              torch.tensor([1, 5])) for n in names])
    explorer = explore(report)
    shown = {}
    for label, value in explorer.dropdown.options:
        explorer.dropdown.value = value
        shown[label] = texts(explorer.output)
        assert max(map(len, shown[label].splitlines())) <= 100, label
    rows = shown["runtime: w13_weight"].split("writes into w13_weight:\n")[1].split(
        "\ndelta:")[0]
    first, second = rows.strip("\n").split("\n\n")
    # each block begins with the patch's position, names whole, every column once
    assert first.splitlines()[0].split()[:3] == ["chunk", "position", "name"]
    assert first.splitlines()[2].split() == ["0", "1", names[1]]
    assert second.splitlines()[0].split()[0] == "position"
    assert " ".join(second.splitlines()[2].split()) == "1 [:, :] [1:2, :, :] 32 2 2"
    patch_rows = shown[f"patch 2: {names[2]}"]
    assert names[2] in patch_rows and " closed_by" in patch_rows
    # (the patch's own row in blocks too, each beginning with its position)
    blocks = patch_rows.split("\n\n")
    assert len(blocks) == 2 and blocks[0].split()[:2] == ["chunk", "position"]
    assert blocks[1].split()[0] == "position"
