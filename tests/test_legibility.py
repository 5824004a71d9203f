"""Every figure patchkit draws is legible: no text runs into another text, past the
figure's edges, or under another axes (``_legibility.assert_legible``), over a spread of
models, numbers of patches, names and shapes."""

from __future__ import annotations

import functools
import re
from html.parser import HTMLParser

import ipywidgets as W
import matplotlib
import pytest
import torch
from _legibility import assert_legible, legibility_problems
from matplotlib.figure import Figure
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch
from patchkit.build import dense_patches, random_sparse_patch
from patchkit.plot import plot_chunks, plot_density
from patchkit.toymodels import PlainModel, TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

LONG = "model.layers.31.mlp.experts.w13_weight"
W13 = "model.layers.0.mlp.experts.w13_weight"


@pytest.fixture(autouse=True, scope="module")
def _headless():
    matplotlib.use("Agg")


def sparse(checkpoint, density=0.02, seed=0):
    """A random sparse patch of each tensor, of at least one element."""
    g = torch.Generator().manual_seed(seed)
    return [random_sparse_patch(n, t.shape, t.dtype, max(density, 1 / t.numel()), generator=g)
            for n, t in checkpoint.items()]


def weights(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


@functools.cache
def moe_report(kind: str, rank: int = 0):
    config = TinyLlamaConfig(num_experts=8)
    ckpt = tiny_llama_checkpoint(config, seed=0, dtype=torch.bfloat16)
    patches = dense_patches(ckpt) if kind == "dense" else sparse(ckpt)
    model = TinyLlamaRuntime(config, tp_rank=rank, tp_size=2, dtype=torch.bfloat16)
    return patchkit.inspect_load(model, patches)


@functools.cache
def llama_report(tp: int, kind: str):
    config = TinyLlamaConfig()
    ckpt = tiny_llama_checkpoint(config, seed=0)
    patches = dense_patches(ckpt) if kind == "dense" else sparse(ckpt)
    return patchkit.inspect_load(TinyLlamaRuntime(config, tp_rank=0, tp_size=tp), patches)


@functools.cache
def plain_report(shapes: tuple, kind: str):
    shapes = dict(shapes)
    ckpt = weights(shapes)
    patches = dense_patches(ckpt) if kind == "dense" else sparse(ckpt, 0.01)
    return patchkit.inspect_load(PlainModel(shapes), patches), patches


# -- the helper itself ---------------------------------------------------------------------


def test_the_helper_finds_overlapping_texts_text_past_the_edge_and_axes_over_labels():
    fig = Figure(figsize=(4, 3), layout="constrained")
    a, b = fig.subplots(1, 2)
    a.set_title("a title")
    b.set_ylabel("a label")
    assert legibility_problems(fig) == []
    a.text(0.5, 0.5, "one", transform=a.transAxes)
    a.text(0.5, 0.5, "two", transform=a.transAxes)
    fig.text(0.99, 0.5, "past the right edge")
    problems = legibility_problems(fig)
    assert problems[0] == "overlap: text 'one' and text 'two'"
    assert problems[1].startswith("past the figure's edge: figure text 'past the right edge'")
    assert len(problems) == 2
    with pytest.raises(AssertionError, match="not legible"):
        assert_legible(fig)
    # axes placed by hand, the right one's labels under the left one
    fig = Figure(figsize=(4, 3))
    fig.add_axes((0.1, 0.1, 0.4, 0.8))
    fig.add_axes((0.52, 0.1, 0.4, 0.8)).set_ylabel("under the left axes")
    problems = legibility_problems(fig)
    assert any("covers another axes' y label 'under the left axes'" in p for p in problems)
    assert any("covers another axes' y tick label" in p for p in problems)
    # a legend put beside its axes, over the next one
    fig = Figure(figsize=(6, 3))
    a = fig.add_axes((0.1, 0.1, 0.35, 0.8))
    fig.add_axes((0.6, 0.1, 0.35, 0.8))
    a.plot([0, 1], label="a line")
    a.legend(loc="upper left", bbox_to_anchor=(1.5, 1.0))
    problems = legibility_problems(fig)
    assert problems and all("covers another axes' legend text 'a line'" in p
                            for p in problems)


def test_the_helper_skips_what_is_not_drawn():
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.subplots()
    ax.text(0.5, 0.5, "shown", transform=ax.transAxes)
    ax.text(0.5, 0.5, "hidden", transform=ax.transAxes, visible=False)
    ax.text(0.5, 0.5, "", transform=ax.transAxes)
    ax.text(5.0, 5.0, "clipped away", clip_on=True)  # (outside the data limits 0..1)
    assert legibility_problems(fig) == []


# -- placement: what failed ----------------------------------------------------------------


def test_placement_of_many_3d_tensors_keeps_each_rows_y_label_within_its_row():
    # "runtime row (dims 0–1 flattened)" on one line was taller than a row's panel: in
    # rows shrunk to fit 14 tensors it ran into the next row's label
    shapes = {f"model.layers.{i}.mlp.experts.w13_weight": (4, 16, 8) for i in range(14)}
    report, _ = plain_report(tuple(shapes.items()), "dense")
    assert_legible(report.plot_placement(max_targets=32))


def test_mixture_of_experts_placement_keeps_the_y_label_off_the_title_line():
    # notebook 07's model: the fused w13_weight's y label reached the title line, into
    # the checkpoint side's title "checkpoint tensors: region read (8 of 16 shown)"
    assert_legible(moe_report("dense").plot_placement())


class _Packed(nn.Module):
    """Runtime tensors ``model.layers.<i>.mlp.experts.w13_weight`` of (rows, 8); a patch
    ``model.layers.<i>.mlp.experts.<j>.up_proj.weight`` of (1, 8) is row j of tensor i."""

    def __init__(self, targets: int, rows: int) -> None:
        super().__init__()
        self.names = [f"model.layers.{i}.mlp.experts.w13_weight" for i in range(targets)]
        self.rows = nn.ParameterList(
            nn.Parameter(torch.zeros(rows, 8), requires_grad=False) for _ in range(targets))

    def named_parameters(self, *args, **kwargs):  # (the long names, not rows.<i>)
        yield from zip(self.names, self.rows)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            parts = name.split(".")
            i, j = int(parts[2]), int(parts[5])
            self.rows[i].data[j : j + 1].copy_(w)
            loaded.add(self.names[i])
        return loaded


def packed_report(targets: int, rows: int):
    patches = [CheckpointWeightPatch(f"model.layers.{i}.mlp.experts.{j}.up_proj.weight",
                                     (1, 8), torch.float32, torch.tensor([1.0]),
                                     torch.tensor([3]))
               for i in range(targets) for j in range(rows)]
    return patchkit.inspect_load(_Packed(targets, rows), patches)


@pytest.mark.parametrize("case", ["moe sparse", "packed"])
def test_a_full_placement_row_of_eight_checkpoint_tensors_labels_each_clear_of_the_next(
        case):
    # eight two-line labels of 7-point text need about 1.9 inches; a row of 2.6 inches
    # with its title on two lines had a panel of 1.8: each label ran into the next
    report = moe_report("sparse") if case == "moe sparse" else packed_report(6, 12)
    fig = report.plot_placement()
    assert max(len(ax.get_yticks()) for ax in fig.axes[::2]) == 8
    assert_legible(fig)


def test_a_placement_in_two_columns_cuts_each_runtime_title_to_its_own_column():
    # past 16 tensors the rows are laid out in two columns, but a title took room from
    # the whole figure's width, so a long one ran into the next column's titles
    fig = moe_report("sparse").plot_placement(max_targets=32)
    assert fig.get_size_inches()[0] == 26
    assert_legible(fig)


# -- HTML: readable on JupyterLab's dark theme as on its light one ------------------------

_FOREGROUND, _BACKGROUND = {"color"}, {"background", "background-color"}
_THEMED = re.compile(r"^\s*(inherit|currentcolor|transparent|var\(--jp-[\w-]+\s*,.+\))\s*$",
                     re.IGNORECASE)


def _declarations(css: str) -> dict[str, str]:
    out = {}
    for part in css.split(";"):
        prop, _, value = part.partition(":")
        if value.strip():
            out[prop.strip().lower()] = value.strip()
    return out


def _unpaired(decls: dict[str, str]) -> str | None:
    """Why a set of declarations is unreadable on one of the themes, or None: a colour
    fixed for the text and none for its background (or the other way round), unless the
    colour follows the theme (a JupyterLab variable with a fallback, inherit)."""
    fixed = {p for p, v in decls.items()
             if p in _FOREGROUND | _BACKGROUND and not _THEMED.match(v)}
    if fixed & _FOREGROUND and not decls.keys() & _BACKGROUND:
        return f"a text colour without a background: {decls}"
    if fixed & _BACKGROUND and not decls.keys() & _FOREGROUND:
        return f"a background without a text colour: {decls}"
    return None


class _Colours(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._in_style = tag == "style"
        for old in ("bgcolor", "color", "text"):  # (<td bgcolor>, <font color>, <body text>)
            if attrs.get(old):
                self.problems.append(f"<{tag} {old}={attrs[old]!r}>: a fixed colour")
        why = _unpaired(_declarations(attrs.get("style") or ""))
        if why:
            self.problems.append(f"<{tag}>: {why}")

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:  # (a <style> sheet: each rule's declarations)
            for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", data):
                why = _unpaired(_declarations(body))
                if why:
                    self.problems.append(f"{selector.strip()}: {why}")


def colour_problems(text: str) -> list[str]:
    """Colours set in ``text`` (HTML) that a light or a dark theme cannot read."""
    parser = _Colours()
    parser.feed(text)
    parser.close()
    return parser.problems


def test_the_colour_check_finds_a_colour_set_without_its_pair():
    assert colour_problems("<div style='color: #333'>x</div>")
    assert colour_problems("<td style='background-color:#f5f5f5'>x</td>")
    assert colour_problems("<td bgcolor='#eee'>x</td>")
    assert colour_problems("<style>.pk th { background: white }</style>")
    assert not colour_problems("<div style='color: #333; background: #fff'>x</div>")
    assert not colour_problems(
        "<div style='color: var(--jp-ui-font-color1, #000)'>x</div>")
    assert not colour_problems("<th style='text-align:left'>x</th>")


def _widget_html(widget) -> list[str]:
    """The HTML a widget and its children show: HTML and Label values, and the
    ``text/html`` of its outputs."""
    out = []
    if isinstance(widget, W.HTML | W.Label):
        out.append(widget.value)
    for o in getattr(widget, "outputs", ()):
        html = o.get("data", {}).get("text/html")
        if html:
            out.append(html if isinstance(html, str) else "".join(html))
    for child in getattr(widget, "children", ()):
        out.extend(_widget_html(child))
    return out


@pytest.mark.parametrize("case", ["llama dense", "moe sparse", "failed load"])
def test_a_reports_html_and_its_widgets_set_no_colour_a_dark_theme_cannot_read(case):
    from patchkit.widgets import ChunkPlanner, ReportExplorer

    if case == "failed load":
        from patchkit.toymodels import FailingModel

        shapes = {"a.weight": (3, 4), "b.weight": (4,), "c.weight": (4,)}
        ps = dense_patches(weights(shapes))
        with pytest.raises(RuntimeError) as info:
            patchkit.inspect_load(FailingModel(shapes, fail_on="c.weight"), ps)
        report = info.value.report
    else:
        report = llama_report(2, "dense") if case == "llama dense" else moe_report("sparse")
    pages = [report._repr_html_()]
    explorer = ReportExplorer(report)
    pages += _widget_html(explorer) + _widget_html(ChunkPlanner(report))
    explorer.close()
    assert len(pages) > 3
    for page in pages:
        assert colour_problems(page) == []


# -- a spread of the others ----------------------------------------------------------------

QKV = "model.layers.0.self_attn.qkv_proj.weight"
SHAPES = {
    "1x1": ((LONG, (1, 1)),),
    "1x100000": ((LONG, (1, 100000)),),
    "100000": ((LONG, (100000,)),),
    "128256x64": (("model.embed_tokens.weight", (128256, 64)),),
    "10 mixed": (*((f"model.layers.{i}.mlp.experts.w13_weight", (8, 16)) for i in range(8)),
                 ("tiny", (1, 1)), ("model.very_long_component_name.weight", (1, 5000))),
    "300 small": tuple((f"model.layers.{i}.self_attn.q_proj.weight", (4, 4))
                       for i in range(300)),
}


def _llama(tp, kind, fn):
    report = llama_report(tp, kind)
    return {
        "chunks": lambda: report.plot_chunks(),
        "chunks 4 KiB": lambda: report.plot_chunks(4096),
        "placement": lambda: report.plot_placement(),
        "placement 32": lambda: report.plot_placement(max_targets=32),
        "delta qkv": lambda: report.plot_delta(QKV),
        "delta norm": lambda: report.plot_delta("model.layers.0.input_layernorm.weight"),
        "density": lambda: report.plot_density("model.layers.0.self_attn.k_proj.weight"),
    }[fn]()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("fn", ["chunks", "chunks 4 KiB", "placement", "placement 32",
                                "delta qkv", "delta norm", "density"])
def test_tiny_llama_figures_are_legible(tp, kind, fn):
    assert_legible(_llama(tp, kind, fn))


@pytest.mark.parametrize("fn", ["chunks", "delta w13", "delta w2", "placement w13",
                                "placement w2", "density"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_mixture_of_experts_figures_are_legible(kind, fn):
    report = moe_report(kind, rank=1)
    w2 = "model.layers.0.mlp.experts.w2_weight"
    assert_legible({
        "chunks": lambda: report.plot_chunks(16 << 10),
        "delta w13": lambda: report.plot_delta(W13),
        "delta w2": lambda: report.plot_delta(w2),
        "placement w13": lambda: report.plot_placement(W13),
        "placement w2": lambda: report.plot_placement([w2, W13]),
        "density": lambda: report.plot_density("model.layers.0.mlp.experts.3.up_proj.weight"),
    }[fn]())


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_plain_model_figures_of_tiny_wide_tall_and_many_tensors_are_legible(shapes, kind):
    report, patches = plain_report(SHAPES[shapes], kind)
    first, last = patches[0].name, patches[-1].name
    figures = [report.plot_chunks(), plot_chunks(patches, 256),
               report.plot_placement(max_targets=32 if len(patches) > 6 else 6),
               report.plot_delta(first), report.plot_delta(last),
               plot_density(patches[0]), report.plot_density(last)]
    for fig in figures:
        assert_legible(fig)


# -- saved to files ------------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["chunks", "placement", "delta qkv", "density"])
def test_figures_save_as_png_and_svg_with_nothing_past_their_edges(fn, tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    fig = _llama(2, "sparse", fn)
    for fmt in ("png", "svg"):
        for tight in (None, "tight"):
            path = tmp_path / f"f-{tight}.{fmt}"
            fig.savefig(path, bbox_inches=tight)
            assert path.stat().st_size > 1000
    with Image.open(tmp_path / "f-None.png") as im:
        assert im.size == (round(fig.get_figwidth() * fig.dpi),
                           round(fig.get_figheight() * fig.dpi))
    # a tight box no bigger than the figure: nothing is cut off at its edges
    FigureCanvasAgg(fig).draw()
    tight, page = fig.get_tightbbox(), fig.bbox_inches
    assert page.x0 - 0.01 <= tight.x0 and tight.x1 <= page.x1 + 0.01
    assert page.y0 - 0.01 <= tight.y0 and tight.y1 <= page.y1 + 0.01
