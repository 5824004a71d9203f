"""Is a figure legible? What a drawn figure's text boxes say about it.

:func:`legibility_problems` draws a figure (on the Agg canvas it has, or one made for
it: pyplot is never touched) and lists, from the renderer's window extents:

(a) two visible Text artists that overlap: titles, the suptitle, axis labels, tick
    labels, offset texts, texts and annotations, legend texts and titles, anywhere on
    the figure (tick labels of one axis against one another too);
(b) a visible text that reaches past an edge of the figure;
(c) an axes whose frame overlaps another axes' title, axis labels, tick labels or
    legend texts.

:func:`assert_legible` fails with that list. A box is shrunk by ``slack`` pixels on
each side before comparing (boxes that only touch are no overlap: a glyph's box holds
its font's whole ascent and descent), and a text an axes clips is taken as far as its
clip box reaches.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure, SubFigure
from matplotlib.legend import Legend
from matplotlib.text import Annotation, Text
from matplotlib.transforms import Bbox

SLACK = 0.5  # pixels


def _drawn_renderer(fig: Figure):
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _shown(artist) -> bool:
    while artist is not None:
        if not artist.get_visible():
            return False
        artist = getattr(artist, "_parent_figure", None) if isinstance(artist, SubFigure) \
            else None
    return True


def _tick_labels(ax: Axes) -> Iterator[tuple[str, Text]]:
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        if not axis.get_visible():
            continue
        for tick in axis._update_ticks():  # (the ticks the draw drew: in view)
            if not tick.get_visible():
                continue
            for label in (tick.label1, tick.label2):
                yield f"{name} tick label", label
        yield f"{name} offset text", axis.offsetText


def _axes_labels(ax: Axes) -> Iterator[tuple[str, Text]]:
    """The texts an axes puts around itself: its titles, axis labels and ticks."""
    yield "title", ax.title
    yield "left title", ax._left_title
    yield "right title", ax._right_title
    if ax.xaxis.get_visible():
        yield "x label", ax.xaxis.label
    if ax.yaxis.get_visible():
        yield "y label", ax.yaxis.label
    yield from _tick_labels(ax)


def _legend_texts(legend: Legend | None) -> Iterator[tuple[str, Text]]:
    if legend is None or not legend.get_visible():
        return
    yield "legend title", legend.get_title()
    for t in legend.get_texts():
        yield "legend text", t


def _figures(fig: Figure) -> Iterator[Figure]:
    yield fig
    for sub in fig.subfigs:
        yield from _figures(sub)


def _texts(fig: Figure) -> Iterator[tuple[str, Text, Axes | None]]:
    """Every Text artist of the figure, named, with the axes it belongs to (or None)."""
    for f in _figures(fig):
        for t in f.texts:  # (suptitle, supxlabel, supylabel and fig.text)
            yield "figure text", t, None
        for lg in f.legends:
            for what, t in _legend_texts(lg):
                yield what, t, None
    for ax in fig.get_axes():
        if not ax.get_visible():
            continue
        if not ax.axison:  # (set_axis_off: no ticks, labels drawn; titles are)
            for what, t in (("title", ax.title), ("left title", ax._left_title),
                            ("right title", ax._right_title)):
                yield what, t, ax
        else:
            for what, t in _axes_labels(ax):
                yield what, t, ax
        for t in ax.texts:
            yield ("annotation" if isinstance(t, Annotation) else "text"), t, ax
        for what, t in _legend_texts(ax.get_legend()):
            yield what, t, ax


def _box(t: Text, renderer) -> Bbox | None:
    """Where ``t`` is drawn, or None where nothing of it is."""
    if not t.get_visible() or not t.get_text().strip():
        return None
    if isinstance(t, Annotation) and not t._check_xy(renderer):
        return None
    box = t.get_window_extent(renderer)
    if t.get_clip_on():
        clip = t.get_clip_box()
        if clip is not None:
            box = Bbox.intersection(box, clip)
            if box is None:
                return None
    if box.width <= 0 or box.height <= 0:
        return None
    return box


def _shrunk(box: Bbox, slack: float) -> Bbox:
    return Bbox.from_extents(box.x0 + slack, box.y0 + slack, box.x1 - slack, box.y1 - slack)


def _say(what: str, t: Text) -> str:
    return f"{what} {t.get_text()!r}"


def legibility_problems(fig: Figure, slack: float = SLACK) -> list[str]:
    """What keeps ``fig`` from being read, once drawn: see the module's docstring."""
    renderer = _drawn_renderer(fig)
    seen: set[int] = set()
    boxes: list[tuple[str, Text, Axes | None, Bbox]] = []
    for what, t, ax in _texts(fig):
        if id(t) in seen:  # (a legend is both the axes' and in a figure's list)
            continue
        seen.add(id(t))
        box = _box(t, renderer)
        if box is not None:
            boxes.append((what, t, ax, _shrunk(box, slack)))
    problems = []
    # (a) overlapping texts
    for (w1, t1, _, b1), (w2, t2, _, b2) in itertools.combinations(boxes, 2):
        if b1.overlaps(b2):
            problems.append(f"overlap: {_say(w1, t1)} and {_say(w2, t2)}")
    # (b) text past the figure's edges
    edge = fig.bbox
    for what, t, _, b in boxes:
        if b.x0 < edge.x0 or b.y0 < edge.y0 or b.x1 > edge.x1 or b.y1 > edge.y1:
            problems.append(f"past the figure's edge: {_say(what, t)} at "
                            f"{tuple(round(v, 1) for v in b.extents)} of "
                            f"{tuple(round(v, 1) for v in edge.extents)}")
    # (c) an axes over another axes' titles and labels
    labels = {id(t) for ax in fig.get_axes()
              for _, t in (*_axes_labels(ax), *_legend_texts(ax.get_legend()))}
    for ax in fig.get_axes():
        if not ax.get_visible() or not ax.axison:  # (no frame drawn)
            continue
        frame = _shrunk(ax.get_window_extent(renderer), slack)
        for what, t, owner, b in boxes:
            if owner is not None and owner is not ax and id(t) in labels \
                    and frame.overlaps(b):
                problems.append(f"an axes ({ax.get_label() or type(ax).__name__} at "
                                f"{tuple(round(v) for v in frame.extents)}) covers another "
                                f"axes' {_say(what, t)}")
    return problems


def assert_legible(fig: Figure, slack: float = SLACK) -> None:
    """Fail, listing every problem, unless ``fig`` is legible (see the module)."""
    problems = legibility_problems(fig, slack)
    assert not problems, "figure not legible:\n  " + "\n  ".join(problems)
