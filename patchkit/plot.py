"""Figures of a load: chunk plans, patch density, placement, before/after deltas.

Imports matplotlib (``import patchkit`` does not; :class:`~patchkit.inspect.LoadReport`
imports this module on the first call of a ``plot_*`` method).

How the figures display. Every function returns a :class:`matplotlib.figure.Figure`
built *without* pyplot (:class:`ReportFigure`, a ``Figure`` subclass): nothing is
registered with pyplot, nothing is ever shown by patchkit, no GUI window opens in a
script, and no figure is left open behind the caller's back. In a notebook a figure that
is the cell's last expression appears exactly once: IPython renders it through
:meth:`ReportFigure._repr_png_` (or through the inline backend's own formatter for
figures, when pyplot has already activated it; IPython uses one or the other, never
both). A plain ``Figure`` made without pyplot would show as ``<Figure size ...>`` text in
a fresh kernel, and a pyplot figure that is not closed would be drawn a second time by
the inline backend at the end of the cell. A figure that is not the last expression is
not shown: call ``display(fig)``, or ``fig.savefig(path)`` to write it.

Everything is deterministic (no timestamps, no randomness) and uses the user's words:
checkpoint vs runtime coordinates, patch, chunk, staged bytes, write, delta. Big tensors
are downsampled to a bounded number of pixels; density maps come from the indices
(O(nnz)), never from a materialised tensor, and before/after figures read a tensor a
band of rows at a time.
"""

from __future__ import annotations

import io
import math
import numbers
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

try:
    import matplotlib  # noqa: F401
except ImportError as e:  # (the figures are an extra; the loader and the tables are not)
    raise ImportError(
        "patchkit.plot (the figures: plot_*, report.plot_*) needs matplotlib: "
        "pip install 'patchkit[notebooks]'"
    ) from e
from matplotlib import colormaps, rcParams
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.layout_engine import PlaceHolderLayoutEngine
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.patheffects import withStroke
from matplotlib.textpath import text_to_path
from matplotlib.ticker import FuncFormatter, Locator, LogFormatter, MaxNLocator

from .bitwise import changed_mask, difference, has_numbers
from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, plan_chunks
from .density import _as_bins, _density, _dims, grid_shape
from .errors import PatchTypeError, brief
from .inspect import _unknown_target
from .patch import (
    _STATE_DICT_HINT,
    CheckpointWeightPatch,
    PatchLike,
    _check_structure,
    _ordered,
    check_flag,
    numel,
    refuse_unordered_repeats,
    staged_nbytes,
)
from .patch import (
    _as_patch as _as_record,
)
from .units import _count, _percent_digits, format_bytes, shown_name

if TYPE_CHECKING:
    from .inspect import LoadReport

__all__ = [
    "MAX_BINS",
    "MAX_RECTS",
    "ReportFigure",
    "plot_chunks",
    "plot_delta",
    "plot_density",
    "plot_placement",
    "pool_max_abs",
    "pool_mean",
    "region_rects",
    "to_png",
    "view_rects",
    "written_mask",
]

MAX_BINS = 1024
"""Most blocks per axis of any heat map: images stay under a million pixels."""

MAX_TARGETS = 6
"""Runtime tensors :func:`plot_placement` draws when not told how many."""

_MOST_TARGETS = 32  # (a row each: a bigger figure takes seconds a row to draw)
# plot_placement's layout: a row of _ROW_INCHES a runtime tensor, in one column of
# _CELL_INCHES while the figure stays under _MOST_INCHES tall (rows shrink down to
# _LEAST_ROW_INCHES first), else in two columns side by side, rows shrunk to fit.
_ROW_INCHES, _LEAST_ROW_INCHES, _CELL_INCHES, _MOST_INCHES = 2.6, 1.8, 13.0, 30.0
_TOP_INCHES = 0.8  # (the suptitle)
_MOST_HIST_BINS = MAX_BINS  # (a Δ histogram's bars: more than its panel has pixels)

# The line plot_delta adds to its title when the model changed after the load.
_STALE_WARNING = (
    "warning: the model changed after this load: the images show its current values, "
    "the numbers are the load's"
)

# What plot_delta's title says of a tensor the load wrote and its rollback put back.
_ROLLED_BACK = "written by this load, then put back as it was by its transactional rollback"

_MAX_WRITES = 64  # writes drawn per runtime tensor; the rest are counted in a note
_MAX_SOURCES = 8  # checkpoint tensors drawn beside one runtime tensor
_MAX_LEGEND = 12
_MAX_ANNOTATED_CALLS = 60
_MAX_SEGMENT_ARTISTS = 1000  # past this, plot_chunks draws its segments as collections

_NOT_SENT = "0.8"  # a planned call the load never made (it raised before)
_REASON_STYLE = {
    # colour, hatch: distinguishable in greyscale and for colour-blind readers
    "budget": ("#4C72B0", ""),
    "repeated name": ("#DD8452", "\\\\"),
    "end": ("#55A868", ".."),
    "loader": ("#8172B3", "++"),  # a call a loader under inspection ended on its own
}
_OVER_BUDGET = "#C44E52"


class ReportFigure(Figure):
    """A :class:`~matplotlib.figure.Figure` that renders itself once in a notebook.

    It is an ordinary ``Figure`` (``savefig``, ``axes``, ``get_axes`` all work); the only
    addition is :meth:`_repr_png_`, which IPython calls to display it.
    """

    def _repr_png_(self) -> bytes:
        return to_png(self)


def to_png(fig: Figure, dpi: float = 100) -> bytes:
    """The figure as PNG bytes (no version or time metadata in the file).

    Drawn once at the figure's size: patchkit's figures use constrained layout, which
    already fits their contents, so a "tight" bounding box (a second draw) is not needed.
    """
    if not isinstance(fig, Figure):
        raise TypeError(f"to_png: fig must be a matplotlib Figure, got {_what(fig)}")
    if isinstance(dpi, bool) or not isinstance(dpi, numbers.Real):
        raise TypeError(f"to_png: dpi must be a positive number, got {_what(dpi)}")
    if not (math.isfinite(dpi) and dpi > 0):
        raise ValueError(f"to_png: dpi must be a positive number, got {_what(dpi)}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _new_figure(width: float, height: float) -> ReportFigure:
    # A fixed dpi keeps the text/plain repr ("<ReportFigure size WxH ...>") the same
    # whatever rcParams a notebook has set, so stored notebook outputs stay comparable.
    return ReportFigure(figsize=(width, height), dpi=100, layout="constrained")


# -- shared helpers ------------------------------------------------------------------------


class _BytesLocator(Locator):
    """Ticks at round numbers of the largest binary unit below the top (KiB, MiB, ...)."""

    def __call__(self) -> Sequence[float]:
        vmin, vmax = self.axis.get_view_interval()
        return self.tick_values(vmin, vmax)

    def tick_values(self, vmin: float, vmax: float) -> Sequence[float]:
        top = max(abs(vmin), abs(vmax), 1.0)
        k = 0
        while k < 3 and top >= 1024 ** (k + 1):
            k += 1
        unit = 1024**k
        # Under five units a step can be a fraction of a unit: 0.2 or 0.4 of one is not a
        # round number of the unit below (204.8 B, 410 KiB), a quarter or a half is.
        steps = [1, 2.5, 5, 10] if k and top < 5 * unit else [1, 2, 2.5, 4, 5, 10]
        inner = MaxNLocator(nbins=6, steps=steps)
        return inner.tick_values(vmin / unit, vmax / unit) * unit


def _bytes_tick(v: float, _pos: Any = None) -> str:
    return format_bytes(v).replace(".0 ", " ")


def _drawable(text: str) -> str:
    """``text`` with each lone surrogate and control character written as its escape,
    ``\\ud800``, ``\\r`` (a name read from a file may hold one; matplotlib's font code
    refuses a surrogate, ``TypeError``, and a ``\\r`` cuts the title it is in): see
    :func:`~patchkit.units.shown_name`."""
    return shown_name(text)


def _short(name: str, n: int = 24, parts: int = 3, among: Iterable[str] = ()) -> str:
    """A checkpoint name cut to its last ``parts`` dotted components and ``n`` characters.

    ``model.layers.0.self_attn.q_proj.weight`` → ``…self_attn.q_proj.weight``: the tail
    says what the tensor is; the layer prefix is shared by its neighbours. Where another
    name of ``among`` (the names drawn beside it, as drawn: see :func:`_drawn`) ends with
    that same tail, the cut keeps what tells them apart instead (see :func:`_apart`),
    still within ``n`` characters.
    """
    pieces = _drawable(name).split(".")
    whole = ".".join(pieces)
    name = whole
    if len(pieces) > parts:
        name = "…" + ".".join(pieces[-parts:])
    cut = name if len(name) <= n else "…" + name[-(n - 1) :]
    return _apart(whole, cut, among, len, n, n)


def _apart(name: str, cut: str, among: Iterable[str], size: Callable[[str], float],
           room: float, most: int) -> str:
    """``cut`` (``name`` cut to ``…`` and its tail), unless another name of ``among`` ends
    with that same tail: then ``…`` and the shortest dotted tail of ``name`` that no other
    name of ``among`` ends with, where that fits in ``room`` (as ``size`` measures text);
    else the shortest dotted head no other name starts with, ``…`` and the longest tail
    that fits (the head taking at most half the room): rows named ``model.layers.{i}.``
    and one long tail keep their layer number. Names of ``among`` each drawn so differ
    whenever the names do, where the part that tells them apart fits (and no name holds
    a ``…`` of its own); where it does not, ``cut``. ``name`` and the names of ``among``
    are as drawn (:func:`_drawable`: see :func:`_drawn`, which escapes a row's names once,
    not once a label); no text longer than ``most`` characters fits in ``room``, which
    bounds the work whatever the names' lengths."""
    if cut == name or not cut.startswith("…"):
        return cut
    others = {o for o in among if o != name}
    if not any(o.endswith(cut[1:]) for o in others):
        return cut
    if len(name) <= most and size(name) <= room:  # (cut to its last parts: none needed)
        return name
    pieces = name.split(".")
    tail = pieces[-1]
    for j in range(len(pieces) - 2, 0, -1):  # the shortest tail that is its own
        tail = pieces[j] + "." + tail
        if len(tail) >= most:
            break
        if not any(o == tail or o.endswith("." + tail) for o in others):
            if size("…" + tail) <= room:
                return "…" + tail
            break
    head = ""
    for k in range(len(pieces) - 1):  # the shortest head that is its own
        head += pieces[k] + "."
        if 2 * len(head) > most or 2 * size(head) > room:
            break
        if any(o.startswith(head) for o in others):
            continue
        rest = name[len(head):]
        if size(head + "…" + rest[-1:]) > room:
            break
        lo, hi = 1, max(1, min(len(rest), most - len(head)))
        while lo < hi:  # the longest tail of the rest that fits beside the head
            mid = (lo + hi + 1) // 2
            if size(head + "…" + rest[-mid:]) <= room:
                lo = mid
            else:
                hi = mid - 1
        return head + "…" + rest[-lo:]
    return cut


def _drawn(names: Iterable[str]) -> frozenset[str]:
    """``names`` as drawn (:func:`_drawable`), once each: the ``among`` of :func:`_short`
    and :func:`_fit`, made once for all the labels of a row or figure (escaping a long
    name costs its length; a row labels up to 64 writes)."""
    return frozenset(map(_drawable, names))


def _text_width(text: str, size: float) -> float:
    """Width in points of ``text`` drawn as plain text at font ``size`` in the current
    default font (measured from the glyphs: no renderer, no draw)."""
    width, _, _ = text_to_path.get_text_width_height_descent(
        text, FontProperties(size=size), ismath=False
    )
    return float(width)


def _fit(name: str, size: float, width: float, among: Iterable[str] = ()) -> str:
    """``name`` as is when it fits in ``width`` points at font ``size``; else ``…`` and
    the longest tail of it that fits (at least one character): the tail of a dotted name
    says what the tensor is; where another name of ``among`` (the names drawn beside it,
    as drawn: see :func:`_drawn`) ends with that same tail, what tells them apart instead
    (see :func:`_apart`). Work
    bounded by what fits, whatever the name's length (no glyph is narrower than a fifth
    of the font size: a longer name cannot fit)."""
    name = _drawable(name)
    most = max(1, int(width / (0.2 * size)))
    if len(name) <= most and _text_width(name, size) <= width:
        return name
    lo, hi = 1, max(1, min(len(name) - 1, most))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _text_width("…" + name[-mid:], size) <= width:
            lo = mid
        else:
            hi = mid - 1
    return _apart(name, "…" + name[-lo:], among, lambda t: _text_width(t, size), width, most)


def _tag(name: str) -> str:
    """The most telling dotted component: ``model.layers.0.mlp.up_proj.weight`` → ``up_proj``."""
    pieces = _drawable(name).split(".")
    if len(pieces) > 1 and pieces[-1] in ("weight", "bias"):
        pieces = pieces[:-1]
    return pieces[-1]


def _elements(n: int) -> str:
    """``"element"`` for one, else ``"elements"`` (the count is written beside it)."""
    return "element" if n == 1 else "elements"


def _pct(x: float) -> str:
    """``x`` (a fraction) as a percentage of 3 significant digits, never "100 %" for
    less than all of it."""
    return _percent_digits(x) + " %"


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + (",)" if len(shape) == 1 else ")")


def _cap_bins(bins: int | Sequence[int], rows: int, cols: int,
              most: tuple[int, int] = (MAX_BINS, MAX_BINS)) -> tuple[int, int]:
    """``bins`` capped at :data:`MAX_BINS`, at ``most`` (a panel's pixels) and at the
    tensor's ``rows`` and ``cols``."""
    want_r, want_c = _as_bins(bins)  # a pair of positive ints (or one int): else raises
    br = max(1, min(want_r, MAX_BINS, most[0], max(rows, 1)))
    bc = max(1, min(want_c, MAX_BINS, most[1], max(cols, 1)))
    return br, bc


# Pixels (rows, columns) a heat map of patchkit's own figures has at their 100 dpi, less
# a margin for a longer title: plot_density's panel is about 400 x 465, each of
# plot_delta's 339 x 224. More blocks than pixels would be drawn as a subset of them (a
# renderer samples), and a block with the only change in it could vanish.
_DENSITY_PX = (360, 440)
_DELTA_PX = (300, 200)


_MAP_Z = 1.6
"""A heat map's zorder: over a grid a style turns on (axis at 0.5, or 1.5 with
``axes.axisbelow: "line"``), under lines, patches and text (2 and up)."""


def _frame_under(ax: Axes) -> None:
    """Draw ``ax``'s frame (spines) under its heat map (see :data:`_MAP_Z`), whose
    outermost blocks, a pixel wide at the most bins, would be hidden under the frame's
    line otherwise; what else is drawn on the axes (a caller's lines, the NaN/±inf
    marks) stays over the map."""
    for spine in ax.spines.values():
        spine.set_zorder(-1)


def _pixels(ax: Axes) -> tuple[int, int]:
    """About how many pixels (rows, columns) a caller's axes will have for its heat map at
    its figure's dpi: as laid out now, less the fifth of its width a colorbar takes
    (fraction 0.15 and pad 0.05); in a figure with a layout engine (``layout=
    "constrained"`` or ``"tight"``), less also the points the labels, ticks and title
    the engine will make room for. A figure without one keeps its axes where they are,
    whatever their labels: a small axes in a grid of subplots keeps its pixels."""
    box = ax.get_window_extent()
    cols = 0.8 * box.width  # (the colorbar's fifth of the width)
    engine = ax.figure.get_layout_engine()
    # (one switched off, set_layout_engine("none") after another, is a placeholder)
    if engine is None or isinstance(engine, PlaceHolderLayoutEngine):
        return (max(1, int(box.height)), max(1, int(cols)))
    pt = ax.figure.dpi / 72  # (pixels a point)
    # what the colorbar's ticks and label, the y ticks and label, the x ticks and label
    # and a two-line title take in a layout: fixed sizes
    return (max(1, int(box.height - 75 * pt)), max(1, int(cols - 100 * pt)))


def _what(obj: object) -> str:
    """``int: 3``: an argument's type and its repr as :func:`~patchkit.errors.brief` shows
    it (cut past 60 characters), for error messages."""
    return f"{type(obj).__name__}: {brief(obj, 60)}"


_REPORT_ATTRS = ("patches", "plan", "max_chunk_bytes", "targets", "before", "after")


def _is_report(obj: object) -> bool:
    """Whether ``obj`` has what the figures read from a :class:`LoadReport` (no table is
    built to find out)."""
    return all(hasattr(obj, a) for a in _REPORT_ATTRS)


def _check_report(report: object, fn: str) -> None:
    """``TypeError`` naming the argument unless ``report`` is a load report."""
    if not _is_report(report):
        raise TypeError(
            f"{fn}: report must be a LoadReport (from patchkit.inspect_load), "
            f"got {_what(report)}"
        )


def _check_ax(ax: object, fn: str) -> None:
    """``TypeError`` naming the argument unless ``ax`` is ``None`` or a matplotlib
    :class:`~matplotlib.axes.Axes` to draw into."""
    if ax is not None and not isinstance(ax, Axes):
        raise TypeError(
            f"{fn}: ax must be a matplotlib Axes (e.g. fig.add_subplot()) or None, "
            f"got {_what(ax)}"
        )


def _check_count(value: object, what: str, fn: str, most: int | None = None) -> int:
    """``value`` as an int when it is a positive whole number (numpy ints too), at most
    ``most`` where given; ``TypeError`` naming the argument for ``bool`` and
    non-integers, ``ValueError`` for one below 1 or above ``most``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {what} must be a positive int, got {_what(value)}")
    if value < 1:
        raise ValueError(f"{fn}: {what} must be at least 1, got {brief(value, text=True)}")
    if most is not None and value > most:
        raise ValueError(f"{fn}: {what} must be at most {most}, got {brief(value, text=True)}")
    return int(value)


def _as_patch(patch: Any, fn: str, position: int | None = None) -> Any:
    """``patch`` as a patch record (a plain 5-tuple ``(name, shape, dtype, values,
    indices)`` becomes a :class:`CheckpointWeightPatch`, as a load takes it); else
    :class:`~patchkit.errors.PatchTypeError` (a ``TypeError``) naming the argument, with
    ``position`` and ``reason`` ``"not a patch"``."""
    patch = _as_record(patch)
    if not all(hasattr(patch, f) for f in CheckpointWeightPatch._fields):
        at = "patch" if position is None else f"patch {position}"
        hint = (
            "; to draw a patch of a report by name use report.plot_density(name)"
            if isinstance(patch, str) else ""
        )
        raise PatchTypeError(
            f"{fn}: {at} must be a CheckpointWeightPatch, got {_what(patch)}{hint}",
            position=position, reason="not a patch", value=type(patch).__name__,
        )
    return patch


def _known(report: LoadReport) -> dict[str, tuple[int, ...]]:
    """Every runtime tensor the report knows and its shape: its targets, and names the
    load removed or registered and removed again, which its tables still name."""
    return getattr(report, "_shapes", None) or report.targets


def _resolve(report: LoadReport, target: str) -> str:
    """The runtime tensor ``target`` names: a tied alias (``lm_head.weight`` tied to the
    embedding) resolves as :meth:`LoadReport.before` resolves it; other names as given.
    (Every caller has checked that ``target`` is a str.)"""
    aliases = getattr(report, "_aliases", None) or {}
    return aliases.get(target, target)


def _shown_name(
    target: str, runtime: str, size: float | None = None, width: float = math.inf,
    among: Iterable[str] = (),
) -> str:
    """How a figure names a runtime tensor asked for as ``target``; with a font ``size``,
    each name is cut (see :func:`_fit`, apart from the names of ``among``, as drawn) so that the
    whole fits in ``width`` points."""
    target, runtime = _drawable(target), _drawable(runtime)
    shown = target if target == runtime else f"{target} (tied to {runtime})"
    if size is None or _text_width(shown, size) <= width:
        return shown
    if target == runtime:
        return _fit(target, size, width, among)
    room = (width - _text_width(" (tied to )", size)) / 2
    return f"{_fit(target, size, room, among)} (tied to {_fit(runtime, size, room, among)})"


def _power_of_two_ticks(vmin: float, vmax: float, most: int) -> list[float] | None:
    """Ticks at the multiples of a power of two on an axis from 0 to a whole ``n``
    (either way round), where ``n`` is such a multiple and at most ``most`` + 1 ticks
    are needed: a tensor's sizes and the boundaries a loader packs at (``q | k | v``,
    ``gate | up``, a rank's shard) are mostly multiples of powers of two, which decimal
    steps miss (``0, 15, 30, …`` on 128 rows; ``0, 16, 32, …`` here, 64 among them).
    The smallest such step is taken (the most ticks); ``None`` where there is none (a
    vocabulary of 128,256 rows: only steps of at most 256 divide it), and the caller
    keeps decimal steps."""
    lo, hi = sorted((vmin, vmax))
    n = round(hi)
    if lo != 0 or hi != n or n < 4 or most < 2:
        return None
    step = 1
    while n % (step * 2) == 0 and n // step > most:
        step *= 2
    if step < 2 or n // step > most:
        return None
    return [float(t) for t in range(0, n + 1, step)]


class _WholeLocator(MaxNLocator):
    """Whole-number ticks along y (heat maps' rows): on an axis from 0 to ``n`` rows, at
    the multiples of a power of two where ``n`` is one (:func:`_power_of_two_ticks`), as
    many as the axis has room for; else matplotlib's decimal steps, at most as many as
    it has room for too (a short panel's ten rows were ticked 0 to 10, each label over
    the next)."""

    def __call__(self) -> Sequence[float]:
        axis = self.axis
        if axis is not None and axis.axes is not None:
            vmin, vmax = axis.get_view_interval()
            room = axis.get_tick_space()
            ticks = _power_of_two_ticks(vmin, vmax, min(room, 9))
            if ticks is not None:
                return ticks
            # (10: MaxNLocator's own; steps of 1, 2 or 5 times a power of ten, where
            # its own steps for fewer bins take 15 too: 0, 15, 30, ...)
            self.set_params(nbins=max(1, min(room, 10)), steps=[1, 2, 5, 10])
        return super().__call__()


class _FittingLocator(MaxNLocator):
    """Whole-number ticks along x, as many as fit side by side: their count is set when
    the axes are drawn, from the axes' width and the widest label (``"128,256"`` beside
    ``"0"``), so that no two labels run into each other on a narrow panel; at the
    multiples of a power of two where the axis runs from 0 to a multiple of one
    (:func:`_power_of_two_ticks`)."""

    def __call__(self) -> Sequence[float]:
        axis = self.axis
        if axis is not None and axis.axes is not None:
            vmin, vmax = axis.get_view_interval()
            chars = len(f"{round(max(abs(vmin), abs(vmax))):,}") + (vmin < 0 or vmax < 0)
            size = FontProperties(size=rcParams["xtick.labelsize"]).get_size_in_points()
            width = axis.axes.bbox.width * 72 / axis.axes.figure.dpi  # (points)
            # a digit or comma is about 0.6 em wide; a label needs its own width and
            # about one em of space beside it
            nbins = max(1, int(width // ((0.6 * chars + 1.0) * size)))
            self.set_params(nbins=nbins)
            ticks = _power_of_two_ticks(vmin, vmax, min(nbins, 9))
            if ticks is not None:
                return ticks
        return super().__call__()


class _FittingRealLocator(MaxNLocator):
    """Ticks along x for real numbers (a Δ histogram), as many as fit side by side with
    their labels as the axis formats them (``-0.075``, ``-400000``): fewer bins until the
    labels, each with about one em of space, fit the axes' width."""

    def __call__(self) -> Sequence[float]:
        axis = self.axis
        if axis is None or axis.axes is None:
            return super().__call__()
        vmin, vmax = sorted(axis.get_view_interval())
        size = FontProperties(size=rcParams["xtick.labelsize"]).get_size_in_points()
        width = axis.axes.bbox.width * 72 / axis.axes.figure.dpi  # (points)
        for nbins in range(9, 1, -1):
            self.set_params(nbins=nbins)
            ticks = [t for t in self.tick_values(vmin, vmax) if vmin <= t <= vmax]
            labels = axis.major.formatter.format_ticks(ticks) if ticks else []
            widest = max((_text_width(text, size) for text in labels), default=0.0)
            if len(ticks) * (widest + size) <= width:
                break
        return super().__call__()


def _integer_ticks(ax: Axes, ndim: int) -> None:
    """Whole row and column numbers on a heat map's axes (at multiples of a power of two
    where the size is one: :func:`_power_of_two_ticks`), written out in full
    (``2,000,000``: no ``1e6`` multiplier over the axes, where it runs into the title);
    no row ticks for a tensor of fewer than two dimensions (it is one row)."""
    whole = FuncFormatter(lambda v, _pos=None: f"{round(v):,}")
    ax.xaxis.set_major_locator(_FittingLocator(integer=True))
    ax.xaxis.set_major_formatter(whole)
    if ndim < 2:
        ax.set_yticks([])
    else:
        ax.yaxis.set_major_locator(_WholeLocator(integer=True))
        ax.yaxis.set_major_formatter(whole)


def _axis_words(ndim: int, side: str) -> tuple[str, str]:
    """(x label, y label) of the 2-D view :func:`~patchkit.density.grid_shape` draws."""
    if ndim == 0:
        return f"{side} scalar", ""
    if ndim == 1:
        return f"{side} element", ""
    if ndim == 2:
        return f"{side} column", f"{side} row"
    return f"{side} column (dim {ndim - 1})", f"{side} row (dims 0–{ndim - 2} flattened)"


def _extent(rows: int, cols: int) -> tuple[float, float, float, float]:
    return (0.0, float(max(cols, 1)), float(max(rows, 1)), 0.0)


# -- chunk plans ---------------------------------------------------------------------------


def _plan_for(
    source: LoadReport | Sequence[PatchLike], max_chunk_bytes: int | None,
    *, replan: bool = False,
) -> tuple[list[CheckpointWeightPatch], list[Chunk], int]:
    """(patches by input position, plan, budget) for a report or a list of patches.

    A report's own plan (its calls) is used unless another ``max_chunk_bytes`` is asked
    for, or ``replan`` (a planner, which shows plans, not calls: an observed loader's
    calls may follow no plan); then the patches the report's load actually sent (tied
    aliases dropped or renamed) are planned again with :func:`~patchkit.plan_chunks`,
    exactly as the loader would, at that budget or the report's. A report whose
    load was rejected before it was planned (no chunk carries any of its patches) has
    its patches planned as given. Anything but a report or a list of patches raises
    ``TypeError``.
    """
    source = _as_source(source, "plot_chunks")
    max_chunk_bytes = _whole_budget(max_chunk_bytes)
    if _is_report(source):
        patches = list(source.patches)
        budget = _report_budget(source)
        if _own_calls(source, max_chunk_bytes, replan):
            return patches, list(source.plan), budget  # (a budget refused: its calls, none)
        if max_chunk_bytes is None:
            max_chunk_bytes = budget
        positions = [p for c in source.plan for p in c.positions]
        names = [n for c in source.plan for n in c.names]
        if patches and not positions and getattr(source, "error", None) is not None:
            return patches, plan_chunks(patches, max_chunk_bytes), max_chunk_bytes
        if any(p < 0 for p in positions):
            # An observed loader sent names that match no patch (it renamed them): what it
            # would send at another budget is not known, so the patches are planned as
            # given, as patchkit's loader would send them.
            return patches, plan_chunks(patches, max_chunk_bytes), max_chunk_bytes
        sent = [patches[i]._replace(name=n) for i, n in zip(positions, names)]
        return patches, plan_chunks(sent, max_chunk_bytes, positions=positions), max_chunk_bytes
    patches = list(source)
    budget = DEFAULT_MAX_CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes
    return patches, plan_chunks(patches, budget), budget


def _report_budget(report: LoadReport) -> Any:
    """A report's ``max_chunk_bytes`` as an int, or as given where it is none (a load
    rejected for its budget: ``inf``, ``None``, ``"512MiB"``, ``1.5``), which the title
    then shows as it was given."""
    budget = report.max_chunk_bytes
    if isinstance(budget, bool):
        return budget
    try:
        return operator.index(budget)
    except TypeError:
        return budget


def _own_calls(report: LoadReport, max_chunk_bytes: Any, replan: bool) -> bool:
    """Whether :func:`_plan_for` draws ``report``'s own calls (not a plan made again): no
    other budget asked for, and no ``replan`` but for a budget the load refused."""
    own = max_chunk_bytes is None or _whole_budget(max_chunk_bytes) == report.max_chunk_bytes
    budget = _report_budget(report)
    return own and (not replan or not isinstance(budget, int) or isinstance(budget, bool))


def _calls_made(source: Any, plan: Sequence[Chunk], max_chunk_bytes: Any,
                replan: bool) -> tuple[int, set[int], BaseException | None]:
    """``(calls made, indices of the calls that raised, the load's error)`` where ``plan``
    is the calls of a report whose load raised; else ``(len(plan), set(), None)`` (a list
    of patches, a plan made again, a load that did not raise)."""
    error = getattr(source, "error", None) if _is_report(source) else None
    if error is None or not plan or not _own_calls(source, max_chunk_bytes, replan):
        return len(plan), set(), None
    calls = source.calls
    return len(calls), {int(k) for k in calls.loc[calls["error"].astype(bool), "chunk"]}, error


def _whole_budget(budget: Any) -> Any:
    """A budget given as any integral number (``numpy.int64(200)``, which the loader
    takes) as a plain ``int``; anything else as it came (refused where it is used)."""
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        return operator.index(budget)
    return budget


def _budget_text(budget: Any) -> str:
    return (format_bytes(budget) if isinstance(budget, int) and not isinstance(budget, bool)
            else f"{budget!r} (refused)")


def _as_source(source: Any, fn: str) -> Any:
    """A report as is, or the patches of any other iterable as a list; ``TypeError``
    naming the argument for anything else (a string, a number, an item not a patch)."""
    if _is_report(source):
        return source
    if isinstance(source, CheckpointWeightPatch) or (
            isinstance(source, tuple) and len(source) == 5 and isinstance(source[0], str)):
        # (one patch on its own, whose five fields would read as five patches)
        raise PatchTypeError(
            f"{fn}: expected a LoadReport or a list of CheckpointWeightPatch, got one patch "
            f"({brief(source[0])}): pass [patch]",
            name=source[0] if isinstance(source[0], str) else None,
            reason="not a list", value=type(source).__name__,
        )
    if hasattr(source, "keys") and hasattr(source, "items"):
        raise PatchTypeError(
            f"{fn}: expected a LoadReport or a list of CheckpointWeightPatch, got "
            f"{_what(source)}{_STATE_DICT_HINT}",
            reason="not a list", value=type(source).__name__,
        )
    try:
        if isinstance(source, str | bytes):
            raise TypeError
        patches = list(source)
    except TypeError:
        raise PatchTypeError(
            f"{fn}: expected a LoadReport or a list of CheckpointWeightPatch, "
            f"got {_what(source)}",
            reason="not a list", value=type(source).__name__,
        ) from None
    refuse_unordered_repeats(source, patches, f"{fn}'s patches")  # (a plan depends on the order)
    return [_as_patch(p, fn, i) for i, p in enumerate(patches)]


def _root(fig: Any) -> Figure:
    """The figure that holds ``fig``: itself, or the one a ``SubFigure`` is drawn in (a
    subfigure has no size of its own)."""
    return fig if isinstance(fig, Figure) else getattr(fig, "figure", fig)


def _axes_points(ax: Axes, own: bool) -> tuple[float, float]:
    """(width, height) of ``ax`` in points, estimated before layout (no draw): on
    :func:`plot_chunks`' own figure its title, labels and legend take about 2.8 in of the
    width and 0.9 in of the height; a caller's axes keep their current position."""
    fig = _root(ax.figure)
    if own:
        return 72 * (fig.get_figwidth() - 2.8), 72 * (fig.get_figheight() - 0.9)
    pos = ax.get_position()
    return 72 * pos.width * fig.get_figwidth(), 72 * pos.height * fig.get_figheight()


def _chunk_top(plan: Sequence[Chunk], budget: int, off_scale: bool, height: float,
               rotate: bool | None) -> float:
    """The top of the bytes axis: every bar with its ``closed_by`` label above it
    (``rotate``: turned upright; ``None``: no labels) inside the axes of ``height``
    points, below the "(above this scale)" note when ``off_scale``, and the budget line
    in view unless ``off_scale``."""
    reserve = 4.0 + (0.02 * height + 11.0 if off_scale else 0.0)
    top = 0.0 if off_scale else 1.05 * budget
    for c in plan:
        label = 0.0
        if rotate is not None:
            w, h, _ = text_to_path.get_text_width_height_descent(
                c.closed_by, FontProperties(size=8), ismath=False
            )
            label = 3.0 + 1.1 * (w if rotate else h + 2.0)  # 3-pt offset, then the text
        free = max(0.25, 1.0 - (reserve + label) / max(height, 1.0))
        top = max(top, c.bytes / free)
    return top or 1.0


def _bar_pieces(
    c: Chunk, patches: Sequence[CheckpointWeightPatch], thin: float
) -> list[tuple[list[int], str, int]]:
    """The rectangles of one bar, bottom up: ``(positions, name, height)``. One per patch,
    except that consecutive patches each under ``thin`` bytes share one. The heights add
    up to the call's bytes: where an observed loader staged tensors of its own (another
    dtype, say), its call's bytes are shared among the patches in proportion to what
    patchkit would stage for each."""
    # (a name an observed loader sent that matches no patch, position -1: its share of
    # what the call staged beyond the known patches' sizes)
    own: list[float] = [staged_nbytes(patches[pos]) if pos >= 0 else 0 for pos in c.positions]
    unknown = [k for k, pos in enumerate(c.positions) if pos < 0]
    if unknown:
        rest = max(0, c.bytes - sum(own)) / len(unknown)
        for k in unknown:
            own[k] = rest
    total = sum(own)
    scale = c.bytes / total if total and c.bytes and c.bytes != total else 1
    pieces: list[tuple[list[int], str, float, bool]] = []
    for pos, name, mine in zip(c.positions, c.names, own):
        height = mine * scale
        if height < thin and pieces and pieces[-1][3]:
            # (the run's own list, grown in place: a copy per patch made a call of
            # thousands of thin patches quadratic)
            ps, first, total, _ = pieces[-1]
            ps.append(pos)
            pieces[-1] = (ps, first, total + height, True)
        else:
            pieces.append(([pos], name, height, height < thin))
    return [(ps, name, height) for ps, name, height, _ in pieces]


def _draw_segments(ax: Axes, segments: Sequence[tuple]) -> None:
    """Draw :func:`plot_chunks`' segments: one :class:`~matplotlib.patches.Rectangle`
    each, or past :data:`_MAX_SEGMENT_ARTISTS` one
    :class:`~matplotlib.collections.PolyCollection` per hatch (gid ``"segments"``, its
    paths the segments in call order, bottom up, and ``segment_gids`` their gids)."""
    if len(segments) <= _MAX_SEGMENT_ARTISTS:
        for gid, x0, y0, h, face, alpha, edge, lw, hatch in segments:
            # add_artist, not add_patch: the limits are set by the caller, and add_patch's
            # per-patch update of the data limits dominates the cost of thousands of bars.
            ax.add_artist(Rectangle((x0, y0), 0.8, h, facecolor=face, alpha=alpha,
                                    edgecolor=edge, linewidth=lw, hatch=hatch, gid=gid))
        return
    by_hatch: dict[str, list[tuple]] = {}
    for s in segments:
        by_hatch.setdefault(s[8], []).append(s)
    for hatch, group in by_hatch.items():
        verts = [((x0, y0), (x0 + 0.8, y0), (x0 + 0.8, y0 + h), (x0, y0 + h))
                 for _, x0, y0, h, *_ in group]
        coll = PolyCollection(
            verts, facecolors=[to_rgba(s[4], s[5]) for s in group],
            edgecolors=[to_rgba(s[6]) for s in group], linewidths=[s[7] for s in group],
            hatch=hatch or None, gid="segments",
        )
        coll.segment_gids = [s[0] for s in group]  # type: ignore[attr-defined]
        ax.add_collection(coll, autolim=False)


def plot_chunks(
    report_or_patches: LoadReport | Sequence[PatchLike],
    max_chunk_bytes: int | None = None,
    *,
    ax: Axes | None = None,
) -> Figure:
    """Staged bytes per ``load_weights`` call, and why each call ended.

    ``report_or_patches`` is a :class:`~patchkit.inspect.LoadReport` (its plan and budget;
    a different ``max_chunk_bytes`` re-plans the patches it sent) or a list of patches
    (planned with :func:`~patchkit.plan_chunks` and ``max_chunk_bytes``, default 512 MiB;
    nothing is staged or loaded).

    What the figure holds, for a caller that reads it back: one stacked bar per call at
    x = call index, made of :class:`~matplotlib.patches.Rectangle` s whose heights add up
    to the call's staged bytes: one per patch, gid ``"segment <call> <position>"`` and
    height its staged bytes (an observed loader that staged tensors of its own, cast to
    another dtype say: its call's bytes, shared in proportion to the patches' own; a
    name it sent that matches no patch, position ``-1``: an equal share of the bytes
    the known patches do not account for),
    except that consecutive patches of a call each too thin to
    see (under about a pixel) share one rectangle, gid ``"segment <call> <first>..<last>"``
    (the positions of the first and last of them), height their total. Past 1000
    segments (thousands of calls: a slider move of :func:`~patchkit.widgets.chunk_planner`
    then redraws in a fraction of a second, not tens of seconds) they are drawn instead
    by :class:`~matplotlib.collections.PolyCollection` s, gid ``"segments"``, one per
    hatch, whose paths are the same rectangles, bottom up in call order, and whose
    ``segment_gids`` attribute lists the gids above, one per path. Segments too
    small for a white edge (under about 4 pixels, 3 points, wide or tall) are drawn
    without one (their hatch white, as every other segment's), and bars under 6 points
    wide without a hatch (the colour carries the reason). The dashed budget
    line (gid ``"budget"``, y = ``max_chunk_bytes``; above the visible range when the
    budget dwarfs every call, with a note saying so in place of the line's legend
    entry); one annotation per call (gid
    ``"closed_by"``, text ``budget`` / ``repeated name`` / ``end``) for up to 60 calls,
    inside the axes and clear of the title and the note, beyond which the bar colours and
    hatches (see the legend) carry the reason; an ``"over budget"`` annotation (gid
    ``"over_budget"``) on a single patch larger than the budget, in those same up to 60
    calls, upright inside its bar (below the patch's name where the bar has one; left out
    where the bar is too short to hold it: beyond 60 calls and there, its red edge and
    the legend mark it: an edge at most a quarter of the
    bar's width, so that it does not spill onto the bars beside it; bars under 6 points
    wide (hundreds of calls) are filled red instead, with no edge, and the legend says
    so). A segment carries its
    patch's short name (gid ``"segment label"``: ``up_proj`` for
    ``model.layers.0.mlp.up_proj.weight``) across the bar where it fits, upright where
    only that fits, and none where neither does; the closing reasons sit on a white box
    that hides the budget line behind them. The x axis has a tick
    at every call up to 20 calls, at whole call numbers beyond. Names are shown as
    written (no mathtext). Returns ``ax.figure`` when ``ax`` is given, else a new
    :class:`ReportFigure`. A report whose load raised draws its calls as they were
    planned: the call that raised annotated ``raised`` (in red), the ones never made
    ``not sent`` (grey bars, with a legend entry), and the title's second line says
    which error and how many calls were made (a plan at another ``max_chunk_bytes`` is
    a plan, and marks none). A report whose load was rejected before it was planned (e.g.
    for ``max_chunk_bytes=0``) draws no bars and a note with the load's error; pass a
    valid ``max_chunk_bytes`` to plan its patches as given. Anything but a report or a
    list of patches raises ``TypeError`` naming what it got, and so does an ``ax`` that is
    not a matplotlib ``Axes``.
    """
    return _plot_chunks(report_or_patches, max_chunk_bytes, ax, replan=False)


def _plot_chunks(report_or_patches: Any, max_chunk_bytes: int | None, ax: Axes | None, *,
                 replan: bool) -> Figure:
    """:func:`plot_chunks`; ``replan``: a report's patches planned at its own budget too,
    not its calls (see :func:`_plan_for`)."""
    _check_ax(ax, "plot_chunks")
    patches, plan, budget = _plan_for(report_or_patches, max_chunk_bytes, replan=replan)
    made, raised, error = _calls_made(report_or_patches, plan, max_chunk_bytes, replan)
    n_sent = sum(len(c.positions) for c in plan)
    total = sum(c.bytes for c in plan)
    calls = _count(len(plan), "load_weights call")
    sent = _count(n_sent, "patch", "patches")
    title = [f"Chunk plan: {sent}, {format_bytes(total)} staged → {calls}",
             f"max_chunk_bytes = {_budget_text(budget)}"]
    if error is not None:
        title[1] += (f"; the load raised {type(error).__name__} after "
                     f"{_count(made, 'call')} made")
    own = ax is None
    if ax is None:
        # wide enough for the title centred over the axes, beside the legend
        need = math.ceil(10 * (max(_text_width(line, 10) for line in title) / 72 + 2.9)) / 10
        fig: Figure = _new_figure(max(6.0, min(14.0, 3.0 + 0.45 * len(plan)), need), 4.2)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    ax.set_title("\n".join(title), fontsize=10, parse_math=False)
    ax.set_xlabel("load_weights call")
    ax.set_ylabel("staged bytes")
    if not plan:
        error = getattr(report_or_patches, "error", None)
        text = "no patches"
        if patches and error is not None:  # a report whose load was rejected unplanned
            why = str(error) if len(str(error)) <= 80 else str(error)[:77] + "..."
            text = (f"{_count(len(patches), 'patch', 'patches')}, none planned: the load "
                    f"raised {type(error).__name__}\n{why}")
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center",
                parse_math=False)
        return fig

    tallest = max(c.bytes for c in plan) or 1
    budget_off_scale = budget > 8 * tallest
    # Sizes in points from the axes' expected size: a bar is 0.8 of a call's width.
    width_pt, height_pt = _axes_points(ax, own)
    bar_pt = 0.8 * width_pt / (len(plan) + 0.4)
    annotated = len(plan) <= _MAX_ANNOTATED_CALLS
    rotate = bar_pt < 60
    top = _chunk_top(plan, budget, budget_off_scale, height_pt, rotate if annotated else None)
    thin = 0.75 / (height_pt / top)  # bytes drawn under about a pixel (0.75 pt) tall
    edge_min = 3.0 / (height_pt / top)  # bytes drawn under about 4 pixels tall
    # Label a segment with its patch name only where the 7-pt text (~4.5 pt a character)
    # fits inside it: across the bar, or else upright in a segment tall enough for it.
    label_chars = int(bar_pt / 4.5)
    label_min = 0.07 * top
    pt_per_byte = height_pt / top
    # Each segment as (gid, x0, bottom, height, facecolor, alpha, edgecolor, linewidth,
    # hatch): drawn as Rectangles, or past _MAX_SEGMENT_ARTISTS as collections (a
    # Rectangle costs about 0.3 ms to make and draw, a collection's path a few µs).
    segments: list[tuple] = []
    # An over-budget bar's red edge and cross-hatch: the edge 2 pt on a wide bar, a
    # quarter of its width on a narrower one, so that the half of the stroke outside the
    # bar stays in the gap beside it. Under 6 pt no hatch is drawn, and an edge alone
    # either hides in a thin bar or, as wide as before, covers its neighbours (3000
    # calls, 57 % of them over budget, drew 98 % red): the bar is filled red instead.
    hatched = bar_pt >= 6.0
    box_pt = 1.1 * _text_width("over budget", 7) + 6.0  # (the upright "over budget" box)
    for c in plan:
        colour, hatch = _REASON_STYLE[c.closed_by]
        unsent = c.index >= made  # planned, never made: the load raised before it
        if unsent:
            colour, hatch = _NOT_SENT, ""
        over_edge = None  # (an over-budget call's edge colour and width)
        if c.over_budget:
            if hatched:
                over_edge = (_OVER_BUDGET, min(2.0, bar_pt / 4))
            else:
                colour, over_edge = _OVER_BUDGET, ("none", 0.0)
        bottom = 0
        label_pt = 0.0  # (the height of the label of the bar's last segment, if it has one)
        for k, (positions, name, height) in enumerate(_bar_pieces(c, patches, thin)):
            merged = len(positions) > 1
            edge = not merged and bar_pt >= 3.0 and height >= edge_min
            segments.append((
                f"segment {c.index} "
                + (f"{positions[0]}..{positions[-1]}" if merged else str(positions[0])),
                c.index - 0.4, bottom, height, colour, 0.95 if k % 2 == 0 else 0.7,
                # (no edge: a white one of no width, for the hatch takes the edge's
                # colour; with none, matplotlib draws it black, like a dashed line)
                *(over_edge or (("white", 0.8) if edge else ("white", 0.0))),
                # (a hatch in a bar under 6 pt wide shows as noise, and drawing it costs
                # more than the rest of the figure: the colour carries the reason there)
                ("xx" if c.over_budget else hatch) if hatched else "",
            ))
            tag = f"{len(positions)} patches" if merged else _tag(name)
            across = len(tag) <= label_chars and height >= label_min
            upright = not across and bar_pt >= 10.0 and (
                height * pt_per_byte >= 4.5 * len(tag) + 6.0
            )
            label_pt = 0.0 if not (across or upright) else (
                4.5 * len(tag) + 6.0 if upright else 9.0)
            if across or upright:
                # (over hatching, a stroke of the bar's colour keeps the white text legible)
                ax.text(
                    c.index, bottom + height / 2, tag,
                    ha="center", va="center", fontsize=7, color="0.2" if unsent else "white",
                    clip_on=True, rotation=90 if upright else 0, gid="segment label",
                    parse_math=False,
                    path_effects=[withStroke(linewidth=2.0, foreground=colour)] if hatch else None,
                )
            bottom += height
        if annotated:
            ax.annotate(
                "not sent" if unsent else "raised" if c.index in raised else c.closed_by,
                xy=(c.index, c.bytes), xytext=(0, 3), textcoords="offset points",
                ha="center", va="bottom", fontsize=8, rotation=90 if rotate else 0,
                color=_OVER_BUDGET if c.index in raised else "black", gid="closed_by",
                # drawn over the budget line, which would otherwise strike through it
                bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none",
                      "alpha": 0.85},
            )
        # "over budget" upright inside the bar: below the patch's name where the bar has
        # room for both, in the middle where it has no name, not at all where it is too
        # short (its red edge and the legend say it)
        shown_pt = min(c.bytes, top) * pt_per_byte
        if c.over_budget and annotated and (
                (shown_pt - label_pt) / 2 if label_pt else shown_pt) >= box_pt + 4.0:
            ax.annotate(
                "over budget",
                xy=(c.index, ((box_pt / 2 + 2.0) / pt_per_byte) if label_pt
                    else min(c.bytes, top) / 2), ha="center", va="center",
                fontsize=7, color=_OVER_BUDGET, fontweight="bold", rotation=90,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white",
                      "edgecolor": _OVER_BUDGET},
                gid="over_budget",
            )
    _draw_segments(ax, segments)
    ax.update_datalim([(-0.4, 0.0), (len(plan) - 0.6, tallest)])
    # (a budget past float's range, 2**1024 say: drawn at 2**1023, off the scale as it is)
    ax.axhline(min(budget, 2.0**1023), linestyle="--", color="0.15", linewidth=1.2,
               gid="budget")
    if budget_off_scale:
        ax.text(
            0.99, 0.98, f"max_chunk_bytes = {format_bytes(budget)} (above this scale)",
            transform=ax.transAxes, ha="right", va="top", fontsize=8, color="0.15",
        )
    ax.set_xlim(-0.7, len(plan) - 0.3)
    ax.set_ylim(0, top)
    ax.yaxis.set_major_locator(_BytesLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(_bytes_tick))
    if len(plan) <= 20:
        ax.set_xticks(range(len(plan)))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    reasons = [r for r in _REASON_STYLE if any(c.closed_by == r for c in plan)]
    handles: list[Any] = [
        # (a white edge of width 0: the hatch white, as on the bars, with no edge drawn)
        Patch(facecolor=_REASON_STYLE[r][0], hatch=_REASON_STYLE[r][1], edgecolor="white",
              linewidth=0, label=f"closed by {r}")
        for r in reasons
    ]
    if not budget_off_scale:  # (off the scale, the note says where the budget is)
        handles.append(
            Line2D([], [], linestyle="--", color="0.15",
                   label=f"max_chunk_bytes ({format_bytes(budget)})")
        )
    if made < len(plan):
        handles.append(Patch(facecolor=_NOT_SENT, label="not sent (the load raised first)"))
    if any(c.over_budget for c in plan):
        handles.append(
            Patch(facecolor="white", edgecolor=_OVER_BUDGET, hatch="xx", linewidth=2,
                  label="one patch over budget (travels alone)") if hatched else
            Patch(facecolor=_OVER_BUDGET, label="one patch over budget (travels alone)")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    return fig


# -- density -------------------------------------------------------------------------------


def plot_density(
    patch: PatchLike,
    bins: int | tuple[int, int] = (128, 128),
    *,
    ax: Axes | None = None,
) -> Figure:
    """Where a patch writes: a heat map of :func:`~patchkit.density.density_map`.

    The tensor is drawn as its 2-D view (rows × last dimension) in checkpoint coordinates:
    the image's extent is the real row and column range, so tick labels are whole checkpoint
    row and column numbers (blocks are drawn equally sized: where ``bins`` does not divide
    the rows or columns, a block's drawn edges are off its real ones by under a row or
    column). ``bins`` is capped at :data:`MAX_BINS` per axis, at the tensor's
    rows/columns, and at the panel's pixels, so that every block is drawn at least one pixel
    wide and high (more blocks than pixels are drawn as a sample of them, and a block
    holding the only change may vanish): 360 × 440 on this function's own figure, or about
    what ``ax`` measures when it is called, less room for its colorbar (the frame is drawn
    under the map; what a caller draws on ``ax`` afterwards, over it); the title gives the
    blocks drawn, and
    :func:`~patchkit.density.density_map` gives finer grids. The single image
    (``ax.images[0]``) holds exactly ``density_map(patch, capped bins)``: per block, the
    fraction of its elements the patch writes, whether or not a write changes the value (a
    load's ``changed`` counts say which did); colour scale from 0 to the densest block, with
    a colorbar. The title gives the patch's name (cut to its tail, after ``…``, when too
    long to fit; shown as written, no mathtext), shape, dtype and how many elements it
    writes. Cost is that of :func:`density_map`: O(nnz), plus a bounded image; for a 128256
    × 2560 bf16 patch at 1 % density, ``benchmarks/bench_inspect.py`` measured 0.02-0.03 s
    for ``density_map`` and 0.03-0.04 s for ``plot_density`` on the 2-core machine patchkit
    is developed on (a measurement, not a promise). A dense patch is uniformly 1. ``bins``
    may be one int for both axes. A patch of no elements (shape ``(0, 5)``) draws no image:
    axes turned off, with a note (gid ``"empty"``) giving its name and shape and saying
    there is nothing to draw. Raises ``TypeError`` when ``patch`` is not a patch (a name:
    use :meth:`LoadReport.plot_density <patchkit.inspect.LoadReport.plot_density>`) or
    ``bins`` is not a pair of ints, ``ValueError`` as :func:`density_map` does (bins below
    1, an index outside the tensor), and for a patch the loader refuses on its own (indices
    not an int32/int64 tensor, a negative dimension, ...) the loader's
    ``PatchTypeError``/``PatchValueError``, as :func:`density_map` does, before anything is
    drawn. An ``ax`` that is not a matplotlib ``Axes`` (or ``None``: a figure of its own)
    raises ``TypeError``.
    """
    _check_ax(ax, "plot_density")
    patch = _as_patch(patch, "plot_density")
    _check_structure(None, patch)  # (the index range: in _density)
    rows, cols = grid_shape(patch.shape)
    br, bc = _cap_bins(bins, rows, cols, _DENSITY_PX if ax is None else _pixels(ax))
    dmap, nnz = _density(patch, (br, bc))  # (an index given twice: one element)
    dmap = dmap.numpy()
    own = ax is None
    n = numel(patch)
    what = f"{_shape_text(patch.shape)} {str(patch.dtype).removeprefix('torch.')}"
    if n == 0:  # nothing to map: a note instead of a map of nothing
        if ax is None:
            fig: Figure = _new_figure(8, 2.5)
            ax = fig.add_subplot()
        else:
            fig = ax.figure
        ax.set_axis_off()
        tail = f"  {what}: no elements, nothing to draw"
        room = 0.95 * 72 * _root(fig).get_figwidth() * (1.0 if own else ax.get_position().width)
        name = _fit(str(patch.name), 10, room - _text_width(tail, 10))
        ax.text(0.5, 0.5, name + tail, transform=ax.transAxes, ha="center", va="center",
                gid="empty", parse_math=False)
        return fig
    if ax is None:
        fig = _new_figure(7.5, 5.2)
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    top = float(dmap.max()) if dmap.size else 0.0
    im = ax.imshow(
        dmap, cmap="viridis", vmin=0.0, vmax=top if top > 0 else 1.0,
        interpolation="nearest", aspect="auto", extent=_extent(rows, cols), zorder=_MAP_Z,
    )
    _frame_under(ax)
    # Written, not changed: a patch that writes the value already there counts too.
    fig.colorbar(im, ax=ax, label="fraction of elements the patch writes per block")
    kind = "dense" if patch.indices is None else "sparse"
    # The title is centred over the heat map; on patchkit's own figure it may spread
    # over most of the figure's width, on a caller's axes over the axes' width.
    fig_pt = 72 * _root(fig).get_figwidth()
    room = 0.8 * fig_pt if own else fig_pt * ax.get_position().width
    name = _fit(str(patch.name), 10, room - _text_width(f"  {what}", 10))
    ax.set_title(
        f"{name}  {what}\n"
        f"{kind}: writes {nnz:,} of {n:,} {_elements(n)} ({_pct(nnz / n if n else 0.0)}); "
        f"{br} × {bc} blocks",
        fontsize=10, parse_math=False,
    )
    xlabel, ylabel = _axis_words(len(patch.shape), "checkpoint")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _integer_ticks(ax, len(patch.shape))
    return fig


# -- placement -----------------------------------------------------------------------------

_BOX = re.compile(r"^\[(.*)\]$")
_SPAN = re.compile(r"^(\d+) elements from (\d+)$")
Rect = tuple[int, int, int, int]  # row0, row1, col0, col1 in the 2-D view

MAX_RECTS = 512
"""Rectangles one region is drawn with, at most: past that, its extent (see
:func:`region_rects`)."""

_MAX_LISTED = 1 << 20  # runs of a region listed (numpy) on the way to its rectangles


def _span_rects(offset: int, n: int, cols: int) -> list[Rect]:
    """A contiguous flat range of a row-major grid as at most three rectangles."""
    if n <= 0 or cols <= 0:
        return []
    r0, c0 = divmod(offset, cols)
    r1, c1 = divmod(offset + n, cols)
    if r0 == r1:
        return [(r0, r0 + 1, c0, c1)]
    out = []
    if c0:
        out.append((r0, r0 + 1, c0, cols))
        r0 += 1
    if r1 > r0:
        out.append((r0, r1, 0, cols))
    if c1:
        out.append((r1, r1 + 1, 0, c1))
    return out


def _runs(base: int, dims: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray] | None:
    """The integers ``base + Σ i_k·s_k`` (``0 <= i_k < n_k``, ``dims`` the ``(n_k, s_k)``,
    every ``s_k > 0``) as sorted, disjoint runs ``[start, stop)``, none abutting the
    next; ``None`` when more than ``_MAX_LISTED`` runs would have to be listed."""
    merged: list[tuple[int, int]] = []  # dims that step as one are one dim
    for n, s in sorted(dims, key=lambda d: -d[1]):
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    length = 1
    if merged and merged[-1][1] == 1:
        length = merged.pop()[0]
    if math.prod(n for n, _ in merged) > _MAX_LISTED:
        return None
    starts = np.full(1, base, dtype=np.int64)
    for n, s in merged:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
    starts = np.sort(starts)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > starts[:-1] + length
    last = np.append(np.flatnonzero(new)[1:] - 1, len(starts) - 1)
    return starts[new], starts[last] + length


def _row_pieces(starts: np.ndarray, stops: np.ndarray, cols: int) -> list[Rect]:
    """Flat runs of a row-major grid with ``cols`` columns as rectangles: each run cut
    into its rows, then rectangles of equal columns in consecutive rows merged."""
    ra, ca = np.divmod(starts, cols)
    rb, cb = np.divmod(stops, cols)  # (stops are exclusive: cb == 0 ends a row)
    one = ra == rb
    head = ~one & (ca > 0)
    body0 = np.where(head, ra + 1, ra)
    body = ~one & (rb > body0)
    tail = ~one & (cb > 0)
    full = np.full(len(starts), cols, dtype=np.int64)
    zero = np.zeros(len(starts), dtype=np.int64)
    r0 = np.concatenate([ra[one], ra[head], body0[body], rb[tail]])
    r1 = np.concatenate([ra[one] + 1, ra[head] + 1, rb[body], rb[tail] + 1])
    c0 = np.concatenate([ca[one], ca[head], zero[body], zero[tail]])
    c1 = np.concatenate([cb[one], full[head], full[body], cb[tail]])
    order = np.lexsort((r0, c1, c0))
    r0, r1, c0, c1 = r0[order], r1[order], c0[order], c1[order]
    new = np.ones(len(r0), dtype=bool)
    new[1:] = (c0[1:] != c0[:-1]) | (c1[1:] != c1[:-1]) | (r0[1:] != r1[:-1])
    last = np.append(np.flatnonzero(new)[1:] - 1, len(r0) - 1)
    out = zip(r0[new].tolist(), r1[last].tolist(), c0[new].tolist(), c1[new].tolist())
    return sorted(out, key=lambda r: (r[0], r[2]))


def _view_int(v: object, what: str) -> int:
    """An int argument of :func:`view_rects` (numpy ints too): ``TypeError`` for a bool or
    a non-integer, ``ValueError`` for one beyond int64 (no tensor has such a view)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"view_rects: {what} must be an int, got {_what(v)}")
    if not -(1 << 63) <= v < 1 << 63:
        raise ValueError(f"view_rects: {what} {brief(v, text=True)} is beyond int64: no tensor "
                         "has such a view")
    return int(v)


def _view_ints(vs: object, what: str) -> list[int]:
    """A sequence of ints argument of :func:`view_rects` (a shape, strides)."""
    try:
        if isinstance(vs, Iterator):
            raise TypeError
        items = list(_ordered(vs.tolist() if isinstance(vs, torch.Tensor | np.ndarray) else vs))
    except TypeError:
        raise TypeError(f"view_rects: {what} must be a sequence of ints, got {_what(vs)}"
                        ) from None
    return [_view_int(v, f"{what} entry") for v in items]


def view_rects(
    offset: int, shape: Sequence[int], stride: Sequence[int], cols: int,
    limit: int = MAX_RECTS,
) -> tuple[list[Rect], bool]:
    """Rectangles ``(row0, row1, col0, col1)`` of exactly the elements a view holds.

    The view's elements are the flat positions ``offset + Σ i_k·stride_k`` of a
    row-major grid with ``cols`` columns (the 2-D view of a contiguous tensor: offset and
    strides in its row-major element numbering). They come back as runs of columns per
    row, the runs of consecutive rows with the same columns merged into one rectangle,
    and ``True``: every other row of a tensor is one rectangle a row, a transposed
    view's box one rectangle. Where that takes more than ``limit`` rectangles, the
    region's extent instead, and ``False``: its bounding box where the view is a grid of
    whole rows by whole columns, else its flat range from first to last element (at most
    three rectangles). A view with no elements gives ``([], True)``. ``limit``: an int
    >= 0 (0: the extent always).
    """
    offset, cols, limit = (_view_int(v, what) for v, what in
                           ((offset, "offset"), (cols, "cols"), (limit, "limit")))
    shape, stride = _view_ints(shape, "shape"), _view_ints(stride, "stride")
    if limit < 0:
        raise ValueError(f"view_rects: limit must not be negative, got {limit}")
    if len(shape) != len(stride):
        raise ValueError(f"view_rects: shape {tuple(shape)} and stride {tuple(stride)} "
                         "differ in length")
    if offset < 0 or any(n < 0 for n in shape):
        raise ValueError(f"view_rects: offset and shape must not be negative, got offset "
                         f"{offset}, shape {tuple(shape)}")
    dims = [(n, s) for n, s in zip(shape, stride) if n != 1]
    if cols <= 0 or any(n == 0 for n, _ in dims):
        return [], True
    if any(s < 0 for _, s in dims):  # (no torch view steps backwards)
        raise ValueError(f"view_rects: negative stride in {tuple(stride)}")
    dims = [(n, s) for n, s in dims if s > 0]  # (a stride of 0 repeats the same elements)
    r0, c0 = divmod(int(offset), cols)
    row_dims = [(n, s // cols) for n, s in dims if s % cols == 0]
    col_dims = [(n, s) for n, s in dims if s % cols]
    c_last = c0 + sum((n - 1) * s for n, s in col_dims)
    if c_last < cols:  # whole rows by whole columns: the rows times the columns
        rows, columns = _runs(r0, row_dims), _runs(c0, col_dims)
        if rows is not None and columns is not None and len(rows[0]) * len(columns[0]) <= limit:
            return [(a, b, c, d) for a, b in zip(rows[0].tolist(), rows[1].tolist())
                    for c, d in zip(columns[0].tolist(), columns[1].tolist())], True
        r_last = r0 + sum((n - 1) * t for n, t in row_dims)
        return [(r0, r_last + 1, c0, c_last + 1)], False
    runs = _runs(int(offset), dims)
    if runs is not None:
        rects = _row_pieces(*runs, cols)
        if len(rects) <= limit:
            return rects, True
    last = int(offset) + sum((n - 1) * s for n, s in dims)
    return _span_rects(int(offset), last - int(offset) + 1, cols), False


def region_rects(text: str | None, shape: Sequence[int]) -> tuple[list[Rect], bool]:
    """Rectangles ``(row0, row1, col0, col1)`` of a region in the 2-D view of ``shape``.

    ``text`` is :func:`~patchkit.density.region_text` notation. A box (``"[0:4, :]"``,
    ``"[:, 4:8]"``, ``"[2:6]"``, ``"[]"``, and with steps, ``"[1:8:2, :]"``) gives its
    exact rectangles and ``True``, as :func:`view_rects` draws them (past
    :data:`MAX_RECTS` rectangles, its bounding box and ``False``). Text of the form
    ``"<n> elements from <offset>"`` (a region that is not a box) gives the rectangles
    of the flat range ``[offset, offset + n)`` and ``False``: exact when the region was
    contiguous, an outline of where it starts and ends otherwise. ``None`` or
    unreadable text gives ``([], False)``.
    """
    dims = _dims(shape, "region_rects")
    cols = grid_shape(dims)[1]
    if text is None:
        return [], False
    m = _SPAN.match(text)
    if m:
        return _span_rects(int(m.group(2)), int(m.group(1)), cols), False
    m = _BOX.match(text)
    if m is None:
        return [], False
    inner = m.group(1).strip()
    parts = [p.strip() for p in inner.split(",")] if inner else []
    if len(parts) != len(dims):
        return [], False
    offset, view, steps = 0, [], []
    for part, d, fs in zip(parts, dims, _row_major(dims)):
        if part == ":":
            a, b, k = 0, d, 1
        else:
            fields = part.split(":")  # ("a:b" or "a:b:k", as region_text writes them)
            if len(fields) not in (2, 3):
                return [], False
            try:
                a, b, k = (int(x) for x in (*fields, "1")[:3])
            except ValueError:
                return [], False
        if k < 1 or not 0 <= a <= b <= d:  # (a region of this shape only)
            return [], False
        offset += a * fs
        view.append(len(range(a, b, k)))
        steps.append(k * fs)
    return view_rects(offset, view, steps, cols)


def _row_major(shape: Sequence[int]) -> list[int]:
    """The element strides of a contiguous tensor of ``shape``."""
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _write_colour(k: int) -> Any:
    return colormaps["tab10"](k % 10)


def plot_placement(
    report: LoadReport,
    targets: str | Sequence[str] | None = None,
    *,
    max_targets: int = MAX_TARGETS,
) -> Figure:
    """Checkpoint regions → runtime regions: where each write landed, in 2-D.

    One row per runtime tensor (default: the tensors written, in the order first
    written, at most ``max_targets``, with a note naming how many were left out), 2.6
    inches tall; past 11 rows they shrink to fit a figure 30 inches tall, down to 1.8
    inches, and past 16 the tensors are laid out in two columns, the first filled top to
    bottom, then the second (32 tensors: 26 by 30 inches, where one column was 84 inches
    tall); a shrunk row lists fewer writes in its legend and draws fewer checkpoint
    tensors, those that fit its height (its notes count the rest; a full row's eight are
    labelled in 6-point type, fewer in 7-point). Right:
    the runtime tensor in its own (row, column) coordinates, one rectangle per write
    (gid ``"write <i> runtime"``, ``i`` the row label of ``report.writes``), so packed
    q/k/v show as horizontal bands of ``qkv_proj`` and column slices as vertical bands.
    Left: each checkpoint tensor that fed it, drawn as a unit square (so tensors of any
    size are legible) with the region read filled in the write's colour (gid
    ``"write <i> checkpoint"``, coordinates as fractions of that tensor's rows and
    columns): a row-parallel shard narrowed on the input dimension shows as a vertical
    band. The legend gives each write as ``#position name [checkpoint region] → [runtime
    region]``. The runtime rectangles of a write cover exactly the elements of the view
    it wrote, worked out from its ``target_offset``, ``shape`` and ``target_stride``
    (:func:`view_rects`): every other row of an interleaved ``gate_up`` is one
    rectangle a row, a transposed view's box one rectangle. A write that would take more
    than :data:`MAX_RECTS` rectangles is drawn as its extent, hatched and dashed, and
    the legend's last entry says so; so is one into a target not laid out row-major
    whose region is no box (from its ``target_region`` text, see :func:`region_rects`).
    The checkpoint side is drawn from ``checkpoint_region`` (:func:`region_rects`),
    hatched and dashed where that is no box. At most 64 writes per tensor and 8
    checkpoint tensors per row are drawn (fewer in a shrunk row), and at most 12 writes
    listed in the legend; a note counts the rest. A runtime title
    counts the tensor's writes and the elements they wrote (the ``written`` column of
    ``report.writes``, summed: a NaN-merged write writes only its entries that are not
    NaN), and where those are fewer, the elements of the views written: ``"1 write, 2
    elements written of 1,024 in its view"``. Names are shown as written (no mathtext);
    a runtime title too long for one line gets its counts on a second line and its name
    cut to its tail after ``…``. Checkpoint names in the legend, the labels and the
    checkpoint side are cut to their last dotted parts (``…self_attn.q_proj.weight``).
    Where a cut name's tail is also the tail of another name drawn beside it (another
    row's, for a title; another source of the row, for a checkpoint name), the cut keeps
    what tells them apart: a longer dotted tail (``…3.gate_proj.weight``), or the head
    through the first part no other name starts with, ``…`` and a tail
    (``model.layers.7.…weight``), where that fits. Runtime row and column ticks are
    whole numbers.

    ``targets`` is a list of runtime tensor names, or one name as a string (a tensor
    named twice, or by a tied alias beside its own name, is drawn once, at its first
    mention); of a list longer than ``max_targets`` (at most 32) the first
    ``max_targets`` are drawn, with the note. A tied alias
    (``lm_head.weight`` where it is the embedding's Parameter) names the tensor it is
    tied to, as in :meth:`LoadReport.before`; its row's title gives both names. An
    unknown name raises ``KeyError``; a ``report`` that is not a load report, a name that
    is not a str or a ``max_targets`` that is not an int, ``TypeError``; an empty
    ``targets`` or a ``max_targets`` outside 1 to 32, ``ValueError``.
    """
    _check_report(report, "plot_placement")
    if isinstance(max_targets, bool) or not isinstance(max_targets, numbers.Integral):
        raise TypeError(f"plot_placement: max_targets must be an int, got {_what(max_targets)}")
    if not 1 <= max_targets <= _MOST_TARGETS:
        raise ValueError(f"plot_placement: max_targets must be from 1 to {_MOST_TARGETS} "
                         f"(a row each), got {brief(max_targets, text=True)}")
    writes = report.writes
    written = list(dict.fromkeys(t for t in writes["target"] if t is not None))
    if targets is None:
        chosen = written[:max_targets]
        left_out = len(written) - len(chosen)
        note = "runtime tensors written; pass targets=[...] for others"
    else:
        if not isinstance(targets, str) and (
                isinstance(targets, bytes | bytearray) or not isinstance(targets, Iterable)):
            raise TypeError("plot_placement: targets must be a runtime tensor's name (str) or "
                            f"a list of names, got {_what(targets)}")
        chosen = [targets] if isinstance(targets, str) else list(targets)
        left_out = 0
        if not chosen:
            raise ValueError("plot_placement: targets is empty; name at least one runtime "
                             "tensor, or leave it None for the tensors written")
        odd = next((t for t in chosen if not isinstance(t, str)), None)
        if odd is not None:
            raise TypeError(f"plot_placement: targets must be names (str), got {_what(odd)}")
        unknown = [t for t in chosen if _resolve(report, t) not in _known(report)]
        if unknown:
            raise _unknown_target(report, unknown[0])
        # a name given twice (or a tied alias beside its tensor's name): one row
        first = {}
        for t in chosen:
            first.setdefault(_resolve(report, t), t)
        chosen = list(first.values())
        # (a list longer than max_targets: its first ones, as for the tensors written)
        left_out = max(len(chosen) - max_targets, 0)
        chosen = chosen[:max_targets]
        note = f"targets asked for; pass max_targets= (up to {_MOST_TARGETS}) for more"
    if not chosen:
        fig = _new_figure(8, 2.5)
        ax = fig.add_subplot()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no runtime writes recorded", ha="center", va="center")
        return fig

    columns, rows, row_inches = _placement_grid(len(chosen))
    fig = _new_figure(_CELL_INCHES * columns, _TOP_INCHES + row_inches * rows)
    grid = fig.add_gridspec(rows, 2 * columns, width_ratios=[1.0, 2.4] * columns)
    # (in the order of the targets, checkpoint then runtime axes: fig.axes[1::2] are the
    # runtime tensors in order, whatever the columns)
    cells = [(k % rows, 2 * (k // rows)) for k in range(len(chosen))]
    axes = [(fig.add_subplot(grid[r, c]), fig.add_subplot(grid[r, c + 1])) for r, c in cells]
    fits = _row_fits(row_inches)
    title = "Placement: checkpoint regions → runtime regions"
    if getattr(report, "rolled_back", False):
        title += "\n(the load raised and was rolled back: every write shown was put back)"
    elif getattr(report, "_restored", None):
        title += "\n(the load raised; the writes of tensors marked \"put back\" were undone)"
    if left_out:
        title += (
            f"\n(showing {len(chosen)} of {len(chosen) + left_out} {note})"
        )
    fig.suptitle(title, fontsize=11)
    shapes = {i: tuple(int(d) for d in report.patches[i].shape)
              for i in {int(k) for k in writes["position"].dropna()}}
    # (each row's title names its tensor apart from the other rows' names)
    names = _drawn([*chosen, *(_resolve(report, t) for t in chosen)])
    for row, target in enumerate(chosen):
        _draw_target(axes[row][0], axes[row][1], target, report, writes, shapes, names,
                     *fits, row_inches=row_inches)
    return fig


def _placement_grid(n: int) -> tuple[int, int, float]:
    """How :func:`plot_placement` lays out ``n`` runtime tensors: columns, rows a
    column, and the inches of a row."""
    room = _MOST_INCHES - _TOP_INCHES
    columns = 1 if n * _LEAST_ROW_INCHES <= room else 2
    rows = -(-n // columns)
    return columns, rows, min(_ROW_INCHES, room / rows)


def _row_fits(row_inches: float) -> tuple[int, int]:
    """The checkpoint tensors and the legend entries (writes listed) a row of
    ``row_inches`` holds: all of :data:`_MAX_SOURCES` and :data:`_MAX_LEGEND` in a row
    of 2.6 inches; in a shorter one, those whose labels fit beside the axes (a source's
    two lines of 7-point text take about 0.3 inches, a legend entry 0.15, and the
    titles, ticks and axis labels about 0.8 of the row)."""
    if row_inches >= _ROW_INCHES:
        return _MAX_SOURCES, _MAX_LEGEND
    inside = row_inches - 0.8
    return (max(1, min(_MAX_SOURCES, int(inside / 0.3))),
            max(1, min(_MAX_LEGEND, int((row_inches - 0.45) / 0.15) - 2)))


def _draw_target(ax_ck: Axes, ax_rt: Axes, asked: str, report: LoadReport, writes: Any,
                 shapes: dict[int, tuple[int, ...]], row_names: Sequence[str] = (),
                 most_sources: int = _MAX_SOURCES, most_legend: int = _MAX_LEGEND, *,
                 row_inches: float = _ROW_INCHES) -> None:
    target = _resolve(report, asked)
    tshape = tuple(int(d) for d in _known(report)[target])
    rows, cols = grid_shape(tshape)
    mine = writes[writes["target"] == target]
    shown = mine.iloc[:_MAX_WRITES]

    # Sources: one colour per patch position, in order of first write.
    sources: list[Any] = list(dict.fromkeys(
        None if pd.isna(p) else int(p) for p in shown["position"]
    ))
    colour = {pos: _write_colour(k) for k, pos in enumerate(sources)}
    traced = [p for p in sources if p is not None and p in shapes]
    slot = {pos: k for k, pos in enumerate(traced[:most_sources])}
    sent = _drawn(_name_of(w) for _, w in shown.iterrows())  # (cut apart from each other)

    ax_rt.add_patch(Rectangle((0, 0), max(cols, 1), max(rows, 1), facecolor="0.94",
                              edgecolor="0.3", linewidth=1.0))
    # The writes' offsets and strides count the target's elements in row-major order
    # where the target is laid out so (dimensions of size 1 step nowhere).
    tstride = getattr(report, "_strides", {}).get(target)
    row_major = tstride is not None and all(
        st == rm for d, st, rm in zip(tshape, tstride, _row_major(tshape)) if d > 1
    )
    approximate = False
    handles: list[Any] = []
    labelled: dict[tuple, Any] = {}  # one label a region (a name sent twice: the last)
    for i, w in shown.iterrows():
        pos = None if pd.isna(w["position"]) else int(w["position"])
        # (a missing region is None, or NaN where pandas fills one in a column of text)
        ck_region = None if pd.isna(w["checkpoint_region"]) else w["checkpoint_region"]
        c = colour[pos]
        rects, exact = _runtime_rects(w, tshape, row_major)
        approximate = approximate or (bool(rects) and not exact)
        style = {} if exact else {"hatch": "//", "linestyle": "--"}
        for r0, r1, c0, c1 in rects:
            ax_rt.add_patch(Rectangle(
                (c0, r0), c1 - c0, r1 - r0, facecolor=(*c[:3], 0.55), edgecolor=c,
                linewidth=1.2, gid=f"write {i} runtime", **style,
            ))
        label = _short(_name_of(w), 24, parts=2, among=sent)
        if rects and _big_enough(rects[0], rows, cols):
            # (a later write of the same region: its label replaces the earlier one's,
            # which the legend still lists)
            r0, r1, c0, c1 = rects[0]
            if rects[0] in labelled:
                labelled[rects[0]].remove()
            labelled[rects[0]] = ax_rt.text(
                (c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8,
                clip_on=True, parse_math=False)
        if len(handles) < most_legend:
            src = ("untraced source" if pos is None
                   else f"#{pos} {_short(_name_of(w), 30, among=sent)}")
            handles.append(Patch(facecolor=(*c[:3], 0.55), edgecolor=c, **style,
                                 label=f"{src} {ck_region or ''}"
                                 f" → {w['target_region']}"))
        if pos in slot:
            ck_rects, ck_exact = region_rects(ck_region, shapes[pos])
            ck_rows, ck_cols = grid_shape(shapes[pos])
            y0 = slot[pos] * 1.25
            for r0, r1, c0, c1 in ck_rects:
                ax_ck.add_patch(Rectangle(
                    (c0 / max(ck_cols, 1), y0 + r0 / max(ck_rows, 1)),
                    (c1 - c0) / max(ck_cols, 1), (r1 - r0) / max(ck_rows, 1),
                    facecolor=(*c[:3], 0.55), edgecolor=c, linewidth=1.2,
                    gid=f"write {i} checkpoint",
                    **({} if ck_exact else {"hatch": "//", "linestyle": "--"}),
                ))
    extra = len(mine) - len(shown)
    listed = len(handles)
    if len(mine) > listed:
        handles.append(Patch(facecolor="none", edgecolor="none",
                             label=f"… {_count(len(mine) - listed, 'more write')}"
                             + (f" ({extra} not drawn)" if extra else "")))
    if approximate:
        handles.append(Patch(facecolor="none", edgecolor="0.3", hatch="//", linestyle="--",
                             label="hatched: a write drawn as its extent, "
                             "not element by element"))

    ax_rt.set_xlim(0, max(cols, 1))
    ax_rt.set_ylim(max(rows, 1), 0)
    xlabel, ylabel = _axis_words(len(tshape), "runtime")
    ax_rt.set_xlabel(xlabel)
    # (a row's panel is 1 to 2 inches tall: "runtime row (dims 0–1 flattened)" on one
    # line is taller, up into the titles above it and the row above)
    ax_rt.set_ylabel(ylabel.replace(" (", "\n(", 1))
    _integer_ticks(ax_rt, len(tshape))
    distinct = (int(report.deltas.loc[target, "elements"])
                if target in report.deltas.index else None)
    counts = _write_counts(mine, distinct)
    if target in getattr(report, "_restored", ()):
        counts += ", put back by the rollback"
    # The title may spread past the axes, up to the checkpoint column's title: about
    # 0.48 of the width of a column of rows (the figure's, or half of it in two columns)
    # with the widest legend. Too long for one line, the counts get their own.
    columns = ax_rt.get_subplotspec().get_gridspec().ncols // 2
    room = 0.48 * 72 * ax_rt.figure.get_figwidth() / columns
    title = f"runtime {_shown_name(asked, target)} {_shape_text(tshape)}: {counts}"
    if _text_width(title, 9) > room:
        shape = f" {_shape_text(tshape)}:"
        shown = _shown_name(asked, target, 9, room - _text_width("runtime " + shape, 9),
                            row_names)
        title = f"runtime {shown}{shape}\n{counts}"
    ax_rt.set_title(title, fontsize=9, parse_math=False)
    if handles:
        legend = ax_rt.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                              fontsize=7, frameon=False)
        for text in legend.get_texts():
            text.set_parse_math(False)
    else:
        ax_rt.text(0.5, 0.5, "not written", transform=ax_rt.transAxes, ha="center",
                   va="center", color="0.3")

    # Checkpoint side: one unit square per source tensor, stacked top to bottom.
    for k in slot.values():
        ax_ck.add_patch(Rectangle((0, k * 1.25), 1, 1, facecolor="0.94", edgecolor="0.3",
                                  linewidth=1.0, zorder=0.5))
    n_src = max(len(slot), 1)
    ax_ck.set_xlim(0, 1)
    ax_ck.set_ylim(n_src * 1.25 - 0.25, 0)
    ax_ck.set_yticks([k * 1.25 + 0.5 for k in slot.values()])
    # A label (name and shape) is two lines, 0.25 inches of 7-point text, 0.215 of
    # 6-point; the panel is about 0.85 inches shorter than its row (a title of two lines
    # above, ticks and a label below), and n labels 1.25 units apart on n * 1.25 - 0.25
    # units fit where n - 0.2 of them do: eight in a row of 2.6 inches only at 6 points.
    ax_ck.set_yticklabels(
        [f"{_short(report.patches[p].name, 24, parts=2, among=sent)}\n{_shape_text(shapes[p])}"
         for p in slot],
        fontsize=7 if (len(slot) - 0.2) * 0.25 <= row_inches - 0.85 else 6, parse_math=False,
    )
    ax_ck.set_xticks([0, 0.5, 1])
    ax_ck.set_xticklabels(["0", "½", "all"], fontsize=7)
    ax_ck.set_xlabel("checkpoint columns (fraction)", fontsize=8)
    ax_ck.set_title("checkpoint tensors: region read", fontsize=9)
    if len(traced) > len(slot):
        ax_ck.set_title(
            f"checkpoint tensors: region read ({len(slot)} of {len(traced)} shown)", fontsize=9
        )
    if not slot:
        ax_ck.text(0.5, 0.5, "no traced source", transform=ax_ck.transAxes, ha="center",
                   va="center", color="0.3")


def _write_counts(mine: Any, distinct: int | None = None) -> str:
    """``"2 writes, 64 elements written"``: the writes and the elements they wrote (a
    NaN-merged write only those whose source is not NaN), and where that is fewer than
    the elements of the views written, those too; where that number is not known (a
    dry run's NaN-merges), ``"2 writes into 64 elements of their views"``. ``distinct``:
    the elements written counted once each (``deltas.elements``), where known: where the
    writes overlap (a name sent twice) their sum counts some twice, and the title says
    ``"2 writes, 4 elements written (5 element writes, of 64 in their views)"``."""
    n_views = int(mine["elements"].sum()) if len(mine) else 0
    writes = _count(len(mine), "write")
    if len(mine) and mine["written"].isna().any():
        # (a dry run's NaN-merges: how many elements they let through is not known)
        return (f"{writes} into {n_views:,} element{'s' if n_views != 1 else ''} of "
                f"{'its view' if len(mine) == 1 else 'their views'}")
    n_written = int(mine["written"].sum()) if len(mine) else 0
    views = 'its view' if len(mine) == 1 else 'their views'
    if distinct is not None and distinct < n_written:
        return (f"{writes}, {distinct:,} element{'s' if distinct != 1 else ''} written "
                f"({n_written:,} element writes, of {n_views:,} in {views})")
    counts = f"{writes}, {n_written:,} element{'s' if n_written != 1 else ''} written"
    if n_written != n_views:
        counts += f" of {n_views:,} in {views}"
    return counts


def _runtime_rects(write: Any, tshape: tuple[int, ...], row_major: bool
                   ) -> tuple[list[Rect], bool]:
    """Where one write landed in its runtime tensor: the elements of the view it wrote
    (its offset, shape and strides) where they count the target's elements row-major,
    else what its ``target_region`` text says (:func:`region_rects`)."""
    shape, stride = write["shape"], write["target_stride"]
    if row_major and isinstance(shape, tuple) and isinstance(stride, tuple) \
            and len(shape) == len(stride) and not pd.isna(write["target_offset"]):
        return view_rects(int(write["target_offset"]), shape, stride, grid_shape(tshape)[1])
    region = None if pd.isna(write["target_region"]) else write["target_region"]
    return region_rects(region, tshape)


def _name_of(write: Any) -> str:
    return "?" if pd.isna(write["name"]) else str(write["name"])


def _big_enough(rect: Rect, rows: int, cols: int) -> bool:
    r0, r1, c0, c1 = rect
    return (r1 - r0) / max(rows, 1) >= 0.12 and (c1 - c0) / max(cols, 1) >= 0.08


# -- deltas --------------------------------------------------------------------------------


_BAND = 1 << 22
"""Elements :func:`plot_delta` reads at a time: its scratch is a few float copies of this
many (tens of MiB), whatever the size of the tensor."""

_HIST_KEEP = 1 << 23
"""Δ values :func:`plot_delta` keeps for its histogram; with more, it reads the tensor a
second time to count them into the bins instead."""


def _as_float(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a float numpy array (float64, int64 and int32 as float64, other
    dtypes as float32; complex: the modulus, in float64)."""
    if t.is_complex():
        return t.to(torch.complex128).abs().numpy()
    t = t.to(torch.float64) if t.dtype in (torch.float64, torch.int64, torch.int32) else t.float()
    return t.numpy()


def _starts(n: int, b: int) -> np.ndarray:
    """First index of each of ``b`` blocks over ``n`` (as :func:`density_map` cuts them)."""
    return (np.arange(b, dtype=np.int64) * n + b - 1) // b


def _cut(n: int, starts: np.ndarray, most: int) -> Iterator[tuple[int, int]]:
    """``[a, b)`` spans covering ``range(n)`` in order: as many whole blocks (``starts``:
    where each begins) as fit in ``most``, or ``most`` of one block taller than that."""
    ends = np.append(starts[1:], n)
    a = 0
    while a < n:
        k = int(np.searchsorted(ends, a + most, side="right")) - 1  # last block end in reach
        b = int(ends[k]) if k >= 0 and ends[k] > a else min(a + most, n)
        yield a, b
        a = b


def _pieces(rows: int, cols: int, rs: np.ndarray, cs: np.ndarray
            ) -> Iterator[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)``: pieces of a ``rows`` × ``cols`` grid of about :data:`_BAND`
    elements, in row-major order, each a run of the flat elements: bands of whole rows
    (whole blocks of rows, ``rs`` where each begins, where they fit), or, where one row
    is longer than that, pieces of one row (whole blocks of columns, ``cs``, where they
    fit)."""
    if cols <= _BAND:
        for r0, r1 in _cut(rows, rs, max(1, _BAND // cols)):
            yield r0, r1, 0, cols
        return
    for r in range(rows):
        for c0, c1 in _cut(cols, cs, _BAND):
            yield r, r + 1, c0, c1


class _Blocks:
    """Statistics per block of a ``rows`` × ``cols`` array cut into ``br`` × ``bc``
    blocks (as :func:`~patchkit.density.density_map` cuts them), taken from the pieces
    :func:`_pieces` cuts, fed in its order: sums (float64), largest and smallest values
    of the finite elements, and how many are not finite (NaN, ±inf).

    A block's sum adds its rows in order, then the sums of its columns, as
    ``np.add.reduceat`` over rows, then columns, adds them: where the rows are whole
    (a row of at most :data:`_BAND` elements), the numbers are those of the whole array
    at once, bit for bit; pieces of a longer row add their partial sums (the last bits
    of a mean may differ). With ``(br, bc) == (rows, cols)`` the blocks are the elements
    themselves (as float64, non-finite ones as they are).

    Sums of finite float64 numbers near their largest can overflow (two of 1e308). Then
    :meth:`mean` gives ``None``, and the pieces are to be fed again to blocks made with
    ``scaled=True``: those add each element times a power of two that keeps any block's
    sum finite (the block's size at most; exact for all but numbers below about 1e-290,
    which lose bits, the smallest subnormals all of them), and undo it in the means.
    """

    def __init__(self, rows: int, cols: int, br: int, bc: int, *, sums: bool = True,
                 extremes: bool = False, scaled: bool = False) -> None:
        self.shape = (rows, cols)
        self.rs, self.cs = _starts(rows, br), _starts(cols, bc)
        # (2**-scale times a block's size is at most 1: no sum of its elements overflows)
        largest = (int(np.diff(np.append(self.rs, rows)).max(initial=1))
                   * int(np.diff(np.append(self.cs, cols)).max(initial=1)))
        self._scale = (largest - 1).bit_length() if scaled else 0
        if scaled and (extremes or not sums):
            raise ValueError("_Blocks: scaled=True scales sums, and only sums")
        self._row_ends = np.append(self.rs[1:], rows)
        self.identity = (br, bc) == (rows, cols)
        self._values = np.empty((rows, cols)) if self.identity else None
        # (-0.0 + x is x for every x, -0.0 included: an empty sum that changes nothing)
        self._sums = np.full((br, bc), -0.0) if sums and not self.identity else None
        self._hi = self._lo = None
        if extremes and not self.identity:
            self._hi, self._lo = np.full((br, bc), -np.inf), np.full((br, bc), np.inf)
        self._carry: np.ndarray | None = None  # row sums so far of a block cut in two
        self.nonfinite = np.zeros((br, bc), dtype=np.int64)
        """Per block, how many of its elements are NaN or ±inf."""

    def add(self, r0: int, c0: int, x: np.ndarray) -> None:
        """Take the piece ``x`` whose first element is at row ``r0``, column ``c0``."""
        with np.errstate(over="ignore", invalid="ignore"):  # (an overflow: see mean())
            self._add(r0, c0, x)

    def _add(self, r0: int, c0: int, x: np.ndarray) -> None:
        n, w = x.shape
        finite = np.isfinite(x)
        bad = None if finite.all() else ~finite
        if self._values is not None:
            self._values[r0:r0 + n, c0:c0 + w] = x
            if bad is not None:
                self.nonfinite[r0:r0 + n, c0:c0 + w] += bad
            return
        if bad is not None:
            x = np.where(finite, x, 0)  # (a 0 changes no sum, nor a largest |value|)
        if self._scale:  # (exact: a power of two)
            x = np.ldexp(x.astype(np.float64, copy=False), -self._scale)
        if w < self.shape[1]:
            self._add_row_piece(r0, c0, x[0], None if bad is None else bad[0])
            return
        i0 = int(np.searchsorted(self.rs, r0, side="right")) - 1
        i1 = int(np.searchsorted(self.rs, r0 + n - 1, side="right")) - 1
        sums, his, los, bads = [], [], [], []
        for i in range(i0, i1 + 1):
            at = slice(max(int(self.rs[i]) - r0, 0), min(int(self._row_ends[i]) - r0, n))
            seg = x[at]
            if self._sums is not None:
                rows = seg
                if self._carry is not None:  # the rest of a block cut in two: add on
                    rows = np.concatenate([self._carry[None, :], seg.astype(np.float64)])
                    self._carry = None
                part = np.add.reduce(rows, axis=0, dtype=np.float64)
                if self._row_ends[i] > r0 + n:
                    self._carry = part
                else:
                    sums.append(part)
            if self._hi is not None:
                his.append(seg.max(axis=0))
                los.append(seg.min(axis=0))
            if bad is not None:
                bads.append(np.add.reduce(bad[at], axis=0, dtype=np.int64))
        if sums:
            self._sums[i0:i0 + len(sums)] = np.add.reduceat(np.stack(sums), self.cs, axis=1)
        at = slice(i0, i1 + 1)
        if his:
            self._hi[at] = np.maximum(self._hi[at], np.maximum.reduceat(np.stack(his), self.cs,
                                                                          axis=1))
            self._lo[at] = np.minimum(self._lo[at], np.minimum.reduceat(np.stack(los), self.cs,
                                                                          axis=1))
        if bads:
            self.nonfinite[at] += np.add.reduceat(np.stack(bads), self.cs, axis=1)

    def _add_row_piece(self, r: int, c0: int, row: np.ndarray, bad: np.ndarray | None
                       ) -> None:
        i = int(np.searchsorted(self.rs, r, side="right")) - 1
        j0 = int(np.searchsorted(self.cs, c0, side="right")) - 1
        j1 = int(np.searchsorted(self.cs, c0 + row.shape[0] - 1, side="right")) - 1
        at = np.maximum(self.cs[j0:j1 + 1], c0) - c0
        js = slice(j0, j1 + 1)
        if self._sums is not None:
            self._sums[i, js] += np.add.reduceat(row, at, dtype=np.float64)
        if self._hi is not None:
            self._hi[i, js] = np.maximum(self._hi[i, js], np.maximum.reduceat(row, at))
            self._lo[i, js] = np.minimum(self._lo[i, js], np.minimum.reduceat(row, at))
        if bad is not None:
            self.nonfinite[i, js] += np.add.reduceat(bad, at, dtype=np.int64)

    def _finite(self) -> np.ndarray:
        rows, cols = self.shape
        sizes = np.outer(np.diff(np.append(self.rs, rows)), np.diff(np.append(self.cs, cols)))
        return sizes - self.nonfinite

    def mean(self) -> np.ndarray | None:
        """Block means of the finite elements (float64; NaN for a block with none), or
        ``None`` where a sum overflowed (finite numbers near float64's largest): feed the
        pieces again to blocks made with ``scaled=True``, whose means are all finite."""
        if self._values is not None:
            return self._values
        if not self._scale and not np.isfinite(self._sums).all():
            return None  # (non-finite elements were added as 0: only an overflow)
        n = self._finite()
        out = np.divide(self._sums, n, out=np.full(n.shape, np.nan), where=n > 0)
        return np.ldexp(out, self._scale) if self._scale else out

    def max_abs(self) -> np.ndarray:
        """Per block, the finite value of largest magnitude, signed (float64; the
        positive one where two tie; NaN for a block with none)."""
        if self._values is not None:
            return self._values
        out = np.where(np.abs(self._hi) >= np.abs(self._lo), self._hi, self._lo)
        out[self._finite() == 0] = np.nan
        return out


def _pooled(x: np.ndarray, br: int, bc: int, **kw: bool) -> _Blocks:
    blocks = _fed(_Blocks(*x.shape, br, bc, **kw), x)
    if kw.get("sums", True) and blocks.mean() is None:  # (a sum overflowed: add scaled)
        blocks = _fed(_Blocks(*x.shape, br, bc, **kw, scaled=True), x)
    return blocks


def _fed(blocks: _Blocks, x: np.ndarray) -> _Blocks:
    rows, cols = x.shape
    for r0, r1, c0, c1 in _pieces(rows, cols, blocks.rs, blocks.cs):
        blocks.add(r0, c0, x[r0:r1, c0:c1])
    return blocks


def _pool_blocks(x: object, br: object, bc: object, fn: str) -> tuple[int, int]:
    """The blocks :func:`pool_mean` and :func:`pool_max_abs` cut ``x`` into: ``br`` and
    ``bc`` (positive ints) capped at its rows and columns (0 along a side it has none
    of). ``TypeError`` for an ``x`` that is not a numpy array of real numbers or blocks
    that are not ints, ``ValueError`` for an ``x`` that is not 2-D or blocks below 1."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{fn}: x must be a 2-D numpy array, got {_what(x)}")
    if x.ndim != 2:
        raise ValueError(f"{fn}: x must be a 2-D numpy array, got shape {x.shape}")
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{fn}: x must hold real numbers (bool, int or float), got dtype "
                        f"{x.dtype}")
    br, bc = _check_count(br, "br", fn), _check_count(bc, "bc", fn)
    rows, cols = x.shape
    return min(br, rows), min(bc, cols)  # (no rows or columns: no blocks along that side)


def pool_mean(x: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Block means of a 2-D array over ``br`` × ``bc`` blocks (identity when not smaller).

    NaN and ±inf are left out of a block's mean; a block holding nothing else is NaN.
    ``x`` is a 2-D numpy array of real numbers; ``br`` and ``bc`` are positive ints,
    capped at its rows and columns (``TypeError`` / ``ValueError`` otherwise, see
    :func:`pool_max_abs`). An ``x`` with no rows or no columns gives an empty result.
    """
    br, bc = _pool_blocks(x, br, bc, "pool_mean")
    if (br, bc) == x.shape or not x.size:
        return x.astype(np.float64)[:br, :bc]
    return _pooled(x, br, bc).mean()


def pool_max_abs(x: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Per block, the signed value of largest magnitude (identity when not smaller).

    Unlike a mean, a single large change in a big block stays visible. NaN and ±inf are
    left out; a block holding nothing else is NaN.

    ``x`` must be a 2-D numpy array of real numbers: bool, int or float (``TypeError``
    for anything else, complex included, ``ValueError`` for another number of
    dimensions); ``br`` and ``bc``, positive ints (numpy ints too; ``TypeError`` for
    ``bool`` and non-integers, ``ValueError`` below 1). More blocks than ``x`` has rows
    (columns) mean one row (column) per block, as :func:`~patchkit.density.density_map`
    caps them; an ``x`` with no rows (columns) gives a result with none.
    """
    br, bc = _pool_blocks(x, br, bc, "pool_max_abs")
    if (br, bc) == x.shape or not x.size:
        return x.astype(np.float64)[:br, :bc]
    return _pooled(x, br, bc, sums=False, extremes=True).max_abs()


_NONFINITE = "#FF00FF"  # magenta: in neither viridis nor RdBu_r, and not white


def _mark_nonfinite(ax: Axes, pool: _Blocks, rows: int, cols: int) -> str:
    """Mark the blocks of a heat map that hold NaN or ±inf with a magenta ``×`` (a
    scatter, gid ``"non-finite"``); the line to add to its title that says so, or
    ``""`` when there are none."""
    bad = pool.nonfinite
    if not bad.any():
        return ""
    i, j = np.nonzero(bad)
    r_end, c_end = np.append(pool.rs[1:], rows), np.append(pool.cs[1:], cols)
    # a marker about the size of a block (the panel is about 200 × 200 points)
    size = float(np.clip(0.8 * min(200 / bad.shape[0], 200 / bad.shape[1]), 4, 10))
    ax.scatter((pool.cs[j] + c_end[j]) / 2, (pool.rs[i] + r_end[i]) / 2, s=size**2,
               marker="x", color=_NONFINITE, linewidths=1.0, gid="non-finite", zorder=3)
    n = int(bad.sum())
    where = "" if pool.identity else f" in {i.size:,} block{'s' if i.size != 1 else ''}"
    return f"\nNaN/±inf (magenta, ×): {n:,} element{'s' if n != 1 else ''}{where}"


def _largest_finite(d: torch.Tensor) -> float:
    """Largest finite |d| in float64 (complex: the modulus); 0 for none."""
    d = np.abs(d.numpy())
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


class _DeltaValues:
    """The Δ values a histogram counts, gathered a band at a time: the finite ones kept
    (up to :data:`_HIST_KEEP` of them, else only their range), the others counted."""

    def __init__(self) -> None:
        self.kept: list[np.ndarray] | None = []
        self.finite = 0
        self.nonfinite = 0
        self.range: tuple[Any, Any] | None = None  # numpy scalars of the values' dtype

    def add(self, d: np.ndarray) -> None:
        fin = np.isfinite(d)
        if not fin.all():
            self.nonfinite += int(d.size - np.count_nonzero(fin))
            d = d[fin]
        if not d.size:
            return
        self.finite += d.size
        lo, hi = d.min(), d.max()
        self.range = (lo, hi) if self.range is None else (
            min(self.range[0], lo), max(self.range[1], hi))
        if self.kept is not None and self.finite > _HIST_KEEP:
            self.kept = None
        elif self.kept is not None:
            self.kept.append(d)


def _hist_range(found: tuple[Any, Any], bins: int) -> tuple[tuple[float, float], Any]:
    """The histogram's range for Δ values from ``found[0]`` to ``found[1]`` (numpy
    scalars), and the dtype to count them in, in which numpy makes the bars' edges:
    float32 where the values are float32 and the range's ends and width are finite in
    it, else float64. The range is the values', or, where they are too close together
    for ``bins`` bars of a width that dtype tells apart (one value, as one changed
    element gives), a range around them that is (numpy's own ±0.5 is below float32's
    resolution from about 2**18 on, float64's from 2**47, and raised)."""
    lo, hi = float(found[0]), float(found[1])
    dtype = np.result_type(found[0], found[1], np.float32)
    for _ in range(2):
        info = np.finfo(dtype)  # (bars 16 units in the last place, or subnormal steps)
        need = max(max(abs(lo), abs(hi)) * float(info.eps), float(info.smallest_subnormal)) \
            * 16 * bins
        if hi - lo >= need and hi > lo:
            span = (lo, hi)
        else:
            half = max(need, 0.5)
            mid = lo / 2 + hi / 2  # (no overflow near the largest float)
            span = (mid - half, mid + half)
        # (numpy takes the range's width in the edges' dtype: it must be finite there)
        if dtype == np.float64 or max(abs(span[0]), abs(span[1])) < \
                float(np.finfo(np.float32).max) / 4:
            return span, dtype
        dtype = np.dtype(np.float64)
    return span, dtype


def _delta_pass(
    reader: Any, rows: int, cols: int, pieces: list[tuple[int, int, int, int]],
    floating: bool, changed_only: bool, pools: tuple[_Blocks, _Blocks, _Blocks] | None,
) -> Iterator[tuple[np.ndarray, int, float]]:
    """One pass over the tensor ``reader`` reads, a piece at a time: feeds the before,
    after and Δ values to ``pools`` (when given) and yields, per piece, the Δ of the
    elements the histogram counts, how many written elements' bits differ now, and the
    largest finite |after − before| among them (float64, as ``report.deltas`` measures
    it)."""
    for r0, r1, c0, c1 in pieces:
        lo = r0 * cols + c0
        before, after, written = reader.read(lo, lo + (r1 - r0) * (c1 - c0))
        b, a = _as_float(before), _as_float(after)
        # |after − before| for complex, exactly for integers (int64 beyond 2**53 too), as
        # the deltas table measures; for floats in their own precision, or in float64
        # where that overflows (two float32 or bfloat16 values 3e38 apart: a finite 6e38)
        if after.is_complex():
            d = difference(after, before).abs().numpy()
        elif floating:
            try:
                with np.errstate(invalid="ignore", over="raise"):  # (inf − inf: NaN, as it is)
                    d = a - b
            except FloatingPointError:
                with np.errstate(invalid="ignore", over="ignore"):
                    d = a.astype(np.float64) - b
        else:
            d = difference(after, before).numpy()
        if pools is not None:
            for pool, x in zip(pools, (b, a, d)):
                pool.add(r0, c0, x.reshape(r1 - r0, c1 - c0))
        at = written  # (positions in the piece; None: all of it)
        bw, aw = (before, after) if at is None else (before[at], after[at])
        mask = changed_mask(bw, aw)
        differs = mask.numpy()
        n = int(np.count_nonzero(differs))
        largest = _largest_finite(difference(aw[mask], bw[mask])) if n else 0.0
        if changed_only:
            at = np.flatnonzero(differs) if at is None else at.numpy()[differs]
        elif at is not None:
            at = at.numpy()
        yield (d if at is None else d[at]), n, largest


_WIDEST_SCALE = float(np.finfo(np.float64).max) / 2
"""The widest colour scale :func:`plot_delta` draws: matplotlib's colorbar and tick
arithmetic (and a histogram's range) overflow float64 past about 1.4e308."""


def written_mask(report: LoadReport, target: str) -> torch.Tensor:
    """Flat bool mask over ``target``'s elements: True where the load wrote (CPU).
    ``report`` must be a load report (``TypeError``); ``target`` as
    :meth:`~patchkit.inspect.LoadReport.written` takes it."""
    _check_report(report, "written_mask")
    return report.written(target).reshape(-1)


def plot_delta(
    report: LoadReport,
    target: str,
    bins: int | tuple[int, int] = (128, 128),
    *,
    changed_only: bool = False,
    hist_bins: int = 60,
) -> Figure:
    """Before, after and Δ = after − before of one runtime tensor, and a Δ histogram.

    Heat maps are in runtime (row, column) coordinates of the tensor's 2-D view; a tensor
    with more rows or columns than ``bins`` (capped at 300 × 200, about each panel's
    pixels, so that every block is drawn: more blocks than pixels are drawn as a sample of
    them, and a block holding the only change may vanish) is cut into
    blocks as :func:`~patchkit.density.density_map` cuts them. ``axes[0..2].images[0]``
    hold: before and after as block means (:func:`pool_mean`, one shared colour scale),
    and Δ as the signed largest-magnitude value per block (:func:`pool_max_abs`) on a
    symmetric diverging scale; unpooled (the exact values) when the tensor fits.
    ``axes[3]`` is a histogram (log y) of Δ over the elements the load wrote, each
    counted once (so its counts total ``report.deltas.loc[target, "elements"]``), or over
    those whose bits changed with ``changed_only=True``. Δ is taken in float32 for
    float32 and narrower dtypes, in float64 for a band of the tensor where float32
    overflows (two values 3e38 apart are a finite 6e38) and for float64, and exactly for
    integers, as ``report.deltas`` measures it. A complex tensor is drawn as
    moduli: before and after as ``|z|``, and ``|Δ| = |after − before|`` on a one-sided
    scale from 0 (a change of the imaginary part shows), the histogram too. A histogram
    of a single value (one changed element) is one bar around it, up to float32's
    largest value. A colour scale is at most half of float64's largest number wide
    (about 9e307: matplotlib's scale and tick arithmetic overflows past about 1.4e308): a
    float64 or complex128 tensor whose finite before and after values (moduli) span more
    than that, or whose Δ scale would be wider (a real Δ's is symmetric: a change of
    1e308 needs one from -1e308 to 1e308), raises ``ValueError`` saying so, before
    anything is drawn (``report.deltas`` has its numbers).

    NaN and ±inf are drawn in magenta (the colour maps' "bad" colour; Δ = 0 is
    near-white): an unpooled image holds them as they are; a block's mean, or its
    largest |Δ|, leaves them out, so that its finite elements still show (a block with
    nothing else is NaN, magenta). A magenta ``×`` (a scatter of gid ``"non-finite"``)
    marks every block, or element, that holds any, and the panel's title then says how
    many elements, in how many blocks. The colour scales span the finite values only.
    The histogram leaves non-finite Δ out and says how many in its title; one of no
    elements (none changed with ``changed_only=True``, a tensor a rollback put back) is
    a note on a panel without ticks.

    Draws the values :meth:`LoadReport.before` / :meth:`LoadReport.after` /
    :meth:`LoadReport.written` give, read a band of about 4 million elements (whole rows
    where a row fits) at a time, never the whole tensor at once: the scratch memory is
    a few float copies of a band, plus the positions of the elements the load saved and
    wrote (in proportion to what it wrote), the Δ values the histogram counts (up to 8
    million; more are counted on a second pass), and one copy of a tensor that is not
    contiguous. Those read the model as it is now, while the title's numbers
    (``report.deltas``) are the load's: when the written elements whose bits differ now
    are not as many as the load changed, or their largest finite |Δ| is not the load's
    ``max_abs`` to within 1e-5 relative (the precision of the load's own bfloat16
    measure; the model changed since, e.g. another load), the title says so in a line
    of its own ("the model changed after this load ..."). A change that keeps both goes
    unnoticed: one to elements the load wrote without changing them, or never wrote
    (:meth:`LoadReport.before` reads those from the model now, so they draw as Δ 0),
    one that leaves the largest |Δ| and the count of changed elements as they were, and
    one too small to move that largest |Δ| by 1e-5 of it. Row and column ticks are whole
    numbers. The title names the tensor as written (no mathtext), cut to its tail after
    ``…`` when the line would not fit, the numbers then on a line of their own.

    A tied alias (``lm_head.weight`` where it is the embedding's Parameter) draws the
    tensor it is tied to, as :meth:`LoadReport.before` reads it; the title gives both
    names. A tensor with no elements draws one empty axes with a note saying so (no
    images). An unknown ``target`` raises ``KeyError``, and so does one the load
    registered (a name the model did not have: it had no values before, see
    :meth:`~patchkit.inspect.LoadReport.before`; ``plot_placement`` draws its writes, and
    ``after()`` holds its values); a ``target`` that is not a str, a
    ``report`` that is not a load report, or a ``changed_only`` that is not a bool,
    ``TypeError``; ``bins`` as in
    :func:`plot_density`. ``hist_bins``, the histogram's number of bars, is an int from
    1 to 1024 (``TypeError`` for ``bool`` and non-integers, ``ValueError`` outside: more
    bars than the panel has pixels only cost time).
    """
    _check_report(report, "plot_delta")
    check_flag(changed_only, "changed_only")
    hist_bins = _check_count(hist_bins, "hist_bins", "plot_delta", most=_MOST_HIST_BINS)
    if not isinstance(target, str):
        raise TypeError(f"plot_delta: target must be a runtime tensor's name (str), "
                        f"got {_what(target)}")
    asked, target = target, _resolve(report, target)
    if target not in _known(report):
        raise _unknown_target(report, asked)
    reader = report._before_after(target)
    if reader.before_shape != reader.shape or reader.before_dtype != reader.dtype:
        # (report.deltas has no numbers for it either: another tensor altogether)
        raise ValueError(
            f"plot_delta: {asked!r} was rebound to a tensor of another "
            f"{'shape' if reader.before_shape != reader.shape else 'dtype'} ("
            f"{_shape_text(reader.before_shape)} "
            f"{str(reader.before_dtype).removeprefix('torch.')} before the load, "
            f"{_shape_text(reader.shape)} {str(reader.dtype).removeprefix('torch.')} after): "
            "there is no element-wise Δ to draw; report.before() and report.after() give both"
        )
    shape = reader.shape
    dtype = str(reader.before_dtype).removeprefix("torch.")
    if not has_numbers(reader.before_dtype):
        raise ValueError(
            f"plot_delta: {asked!r} is {dtype}, a packed dtype torch reads no numbers from "
            "(its elements compare only bit for bit): report.deltas counts its changed "
            "elements, and report.before() and report.after() give its bits"
        )
    form = f"{_shape_text(shape)} {dtype}"
    if math.prod(shape) == 0:
        _as_bins(bins)  # bad bins raise whatever the tensor
        fig = _new_figure(8, 2.5)
        ax = fig.add_subplot()
        ax.set_axis_off()
        tail = f" {form}: no elements, nothing to draw"
        shown = _shown_name(asked, target, 10, 0.95 * 72 * 8 - _text_width(tail, 10))
        ax.text(0.5, 0.5, shown + tail, ha="center", va="center", gid="empty",
                parse_math=False)
        return fig
    rows, cols = grid_shape(shape)
    br, bc = _cap_bins(bins, rows, cols, _DELTA_PX)
    pooled = (br, bc) != (rows, cols)
    # Δ in floats for floating and complex tensors, exactly for integers
    floating = reader.before_dtype.is_floating_point or reader.before_dtype.is_complex
    for scaled in (False, True):
        # (scaled: a second pass, where a block's sum of values near float64's largest
        # overflowed in the first; see _Blocks)
        pools = (_Blocks(rows, cols, br, bc, scaled=scaled),
                 _Blocks(rows, cols, br, bc, scaled=scaled),
                 _Blocks(rows, cols, br, bc, sums=False, extremes=True))
        pieces = list(_pieces(rows, cols, pools[0].rs, pools[0].cs))
        values = _DeltaValues()
        n_now, largest = 0, 0.0
        for dw, n, big in _delta_pass(reader, rows, cols, pieces, floating, changed_only,
                                      pools):
            values.add(dw)
            n_now += n
            largest = max(largest, big)
        b_img, a_img, d_img = pools[0].mean(), pools[1].mean(), pools[2].max_abs()
        if b_img is not None and a_img is not None:
            break

    both = np.concatenate([b_img.ravel(), a_img.ravel()])
    both = both[np.isfinite(both)]
    lo, hi = (float(both.min()), float(both.max())) if both.size else (0.0, 1.0)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    finite_d = d_img[np.isfinite(d_img)]
    m = float(np.abs(finite_d).max()) if finite_d.size else 0.0
    m = m if m > 0 else 1.0
    cplx = reader.before_dtype.is_complex  # (moduli, and |Δ| on a one-sided scale)
    with np.errstate(over="ignore"):  # (a width past float64's largest: inf, too wide)
        too_wide = [(what, a, b) for what, a, b in (
            ("before and after values", lo, hi), ("Δ", 0.0 if cplx else -m, m))
            if not b - a <= _WIDEST_SCALE]
    if too_wide:  # (matplotlib's colorbar, ticks and histogram take the width)
        what, a, b = too_wide[0]
        raise ValueError(
            f"plot_delta: {asked!r} {form}: its {what} need a colour scale from {a:.4g} "
            f"to {b:.4g}, wider than half of float64's largest number "
            f"({_WIDEST_SCALE:.4g}), which matplotlib cannot draw; report.deltas has its "
            "numbers, and report.before() and report.after() its values"
        )
    fig = _new_figure(17.0, 4.4)
    # (more room between panels than constrained layout's default: a colorbar's label
    # sat against the next panel's y label, the third's "Δ" against the histogram's)
    fig.get_layout_engine().set(w_pad=10 / 72)
    axes = fig.subplots(1, 4, width_ratios=[1, 1, 1, 1.1])
    xlabel, ylabel = _axis_words(len(shape), "runtime")
    how = f" ({br} × {bc} block means)" if pooled else ""
    value = "|z|" if cplx else "value"
    delta = "|Δ| = |after − before|" if cplx else "Δ = after − before"
    panels = [
        (b_img, f"before{' |z|' if cplx else ''}{how}", "viridis", lo, hi, value),
        (a_img, f"after{' |z|' if cplx else ''}{how}", "viridis", lo, hi, value),
        (d_img, delta + (" (largest |Δ| per block)" if pooled else ""),
         *(("Reds", 0.0, m, "|Δ|") if cplx else ("RdBu_r", -m, m, "Δ"))),
    ]
    for ax, pool, (img, title, cmap, vmin, vmax, label) in zip(axes[:3], pools, panels):
        im = ax.imshow(img, cmap=colormaps[cmap].with_extremes(bad=_NONFINITE), vmin=vmin,
                       vmax=vmax, interpolation="nearest", aspect="auto",
                       extent=_extent(rows, cols), zorder=_MAP_Z)
        _frame_under(ax)
        with np.errstate(over="ignore"):  # (matplotlib's midpoints of a scale near 1e308)
            fig.colorbar(im, ax=ax, label=label, shrink=0.9)
        title += _mark_nonfinite(ax, pool, rows, cols)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        _integer_ticks(ax, len(shape))

    ax = axes[3]
    what = "changed" if changed_only else "written"
    if values.finite:
        span, dtype = _hist_range(values.range, hist_bins)
        if values.kept is not None:
            ax.hist(np.concatenate(values.kept).astype(dtype, copy=False), bins=hist_bins,
                    range=span, log=True, color="#4C72B0")
        else:  # too many to keep: counted into the bins on a second pass
            counts, edges = 0, None
            for dw, _, _ in _delta_pass(reader, rows, cols, pieces, floating, changed_only,
                                        None):
                n, edges = np.histogram(dw[np.isfinite(dw)].astype(dtype, copy=False),
                                        bins=hist_bins, range=span)
                counts = counts + n
            ax.hist(edges[:-1], bins=edges, weights=counts, log=True, color="#4C72B0")
    else:
        empty = ("written, then put back by the rollback"
                 if target in getattr(report, "_restored", ()) else f"no {what} elements")
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center",
                color="0.3")
        # No scale on a panel of no data: its default 0 to 1 would put labels on its
        # edges, "1.0" past the figure's right edge (constrained layout measures the
        # ticks of a narrower axes, where no label sits at the edge).
        ax.set_xticks([])
        ax.set_yticks([])
    note = f"\n({values.nonfinite:,} NaN/±inf left out)" if values.nonfinite else ""
    if values.finite:
        # Counts, not powers of ten: plain labels on major and minor ticks, none below 1.
        ax.set_ylim(bottom=0.8)
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_title(f"{'|Δ|' if cplx else 'Δ'} over {values.finite:,} {what} "
                 f"{_elements(values.finite)}{note}", fontsize=9)
    ax.set_xlabel(delta)
    ax.set_ylabel("elements (log scale)" if values.finite else "elements")
    if values.finite:
        ax.xaxis.set_major_locator(_FittingRealLocator())

    stale = False
    if target in report.deltas.index:
        row = report.deltas.loc[target]
        stats = (
            f"{int(row['elements']):,} {_elements(int(row['elements']))} written, "
            f"{int(row['changed']):,} changed, "
            f"max |Δ| {row['max_abs']:.3g}, relative L2 change {row['rel_l2']:.3g}"
        )
        # before() and after() read the model as it is now, the numbers were fixed at the
        # load: the written elements whose bits differ now should be as many as it changed
        # (another load put some back otherwise), with the same largest |Δ| (it wrote new
        # values otherwise; the load measured bfloat16 to 1e-6, see LoadReport.deltas).
        stale = n_now != int(row["changed"]) or not math.isclose(
            largest, float(row["max_abs"]), rel_tol=1e-5, abs_tol=1e-300
        )
    elif target in getattr(report, "_restored", ()):
        stats = _ROLLED_BACK
    else:
        stats = "not written by this load"
    room = 0.95 * 72 * _root(fig).get_figwidth()
    head = f"{_shown_name(asked, target)} {form}: {stats}"
    if _text_width(head, 10) > room:  # the name, cut to fit, then the numbers below it
        shown = _shown_name(asked, target, 10, room - _text_width(f" {form}:", 10))
        head = f"{shown} {form}:\n{stats}"
    if stale:
        head += f"\n{_STALE_WARNING}"
    fig.suptitle(head, fontsize=10, parse_math=False)
    return fig
