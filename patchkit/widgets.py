"""ipywidgets explorers of a load, built on :mod:`patchkit.plot`.

Imports ipywidgets and matplotlib (``import patchkit`` does not; ``report.explore()``
imports this module on first use).

How the widgets write their output: each redraw *sets* the ``outputs`` of an
:class:`ipywidgets.Output` (a PNG ``display_data`` per figure, a ``stdout`` stream for
text) instead of capturing prints with ``with out:`` or calling ``clear_output()``,
which route through the kernel's current message and behave differently between
JupyterLab, Notebook, Voilà and a test run. Setting the model state behaves the same
everywhere, replaces the previous view in one update (no flicker), and leaves the
result readable from code: ``w.output.outputs``.
"""

from __future__ import annotations

import base64
import html
import math
import os
import traceback
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

try:
    import ipywidgets as W
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "patchkit.widgets needs ipywidgets: pip install 'patchkit[notebooks]'"
    ) from exc

import torch

from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk
from .patch import (
    PatchLike,
    _check_metadata,
    _given_name,
    check_max_chunk_bytes,
    staged_nbytes,
)
from .plot import (
    _as_source,
    _check_report,
    _is_report,
    _plan_for,
    _plot_chunks,
    plot_delta,
    plot_placement,
    to_png,
)
from .units import _count, format_bytes, message_of, shown_name, shown_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .inspect import LoadReport

__all__ = [
    "ChunkPlanner",
    "ReportExplorer",
    "chunk_planner",
    "explore",
    "figure_output",
    "plan_text",
    "text_output",
]

_MAX_CALL_LINES = 40
# The explorer's drop-down lists at most _MAX_OPTIONS entries: past that (a whole model's
# report: thousands of patches and runtime tensors) a filter box above it picks which.
_MAX_OPTIONS = 200
# The explorer keeps the views it drew, so that choosing an entry again draws nothing:
# at most this many bytes of their outputs (PNGs as base64 text), the least recently
# shown dropped first. A runtime tensor's two figures take 140-430 KB (its placement
# about 50 KB, its delta 85-210 KB on TinyLlama's tensors, 380 KB for a 1024 x 1024
# tensor of random values all replaced), a patch's density map about 55 KB: 16 MiB
# keeps the views of 38 runtime tensors or more.
_CACHE_BYTES = 16 << 20
# The explorer's text tables are at most this many characters wide, in blocks of their
# columns where wider (a front end wraps a longer stdout line where its output ends:
# JupyterLab beside its file browser broke a writes row of a mixture-of-experts tensor,
# 124 characters, inside its last column, each row's last number on a line of its own).
# 100 characters of JupyterLab's 13 px monospace take about 780 px: an output beside the
# file browser on a 1280 px wide screen; the writes of a name of up to 23 characters fit
# whole.
_TABLE_WIDTH = 100
# (the bytes a fingerprint reads at a time: a band of a tensor on another device is
# copied to the CPU to be read)
_FINGERPRINT_BAND = 64 << 20


def figure_output(fig: Figure) -> dict[str, Any]:
    """A figure as one ``display_data`` output (PNG, base64, as notebooks store it): a
    dict with ``output_type``, ``data`` (``image/png`` and ``text/plain``) and
    ``metadata``. ``fig`` must be a matplotlib Figure (``TypeError``, from
    :func:`~patchkit.plot.to_png`)."""
    return {
        "output_type": "display_data",
        "data": {
            "image/png": base64.b64encode(to_png(fig)).decode("ascii"),
            "text/plain": repr(fig),
        },
        "metadata": {},
    }


def text_output(text: str) -> dict[str, Any]:
    """Text as one ``stdout`` stream output (a lone surrogate, which no Jupyter message
    carries, written as its escape). ``text`` must be a str (``TypeError``)."""
    if not isinstance(text, str):
        raise TypeError(f"text_output: text must be a str, got {type(text).__name__}")
    return {"output_type": "stream", "name": "stdout", "text": shown_text(text)}


def _shown(name: str | None, most: int = 120) -> str:
    """A name as a label shows it (``None``: an item with no str name): escaped (see
    :func:`~patchkit.units.shown_name`), and past ``most`` characters its start and end
    around an ellipsis (a label is drawn on one line; the whole name is in the tables)."""
    if name is None:
        return "None"
    text = shown_name(name)
    if len(text) <= most:
        return text
    half = (most - 1) // 2
    return text[:half] + "…" + text[len(text) - (most - 1 - half):]


def _told_apart(options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Dropdown ``options`` whose labels are made distinct: a label that several carry
    (long names cut to the same start and end, see :func:`_shown`) gains `` (2)``,
    `` (3)``, ... on its second and later uses."""
    seen: dict[str, int] = {}
    used = {label for label, _ in options}
    out = []
    for label, value in options:
        k = seen[label] = seen.get(label, 0) + 1
        if k > 1:
            while f"{label} ({k})" in used:  # (a label of its own may read so already)
                k += 1
            seen[label] = k
            label = f"{label} ({k})"
            used.add(label)
        out.append((label, value))
    return out


def plan_text(plan: Sequence[Chunk], budget: int) -> str:
    """The plan in words: one line per ``load_weights`` call and why it closed.

    ``plan`` is a list of :class:`~patchkit.Chunk` (as :func:`~patchkit.plan_chunks`
    makes it) and ``budget`` the ``max_chunk_bytes`` it was planned for
    (``TypeError`` / ``ValueError`` otherwise)."""
    budget = check_max_chunk_bytes(budget)
    if isinstance(plan, str | bytes) or not isinstance(plan, Sequence):
        raise TypeError("plan_text: plan must be a list of Chunk (as plan_chunks makes it), "
                        f"got {type(plan).__name__}")
    for i, c in enumerate(plan):
        if not isinstance(c, Chunk):
            raise TypeError(f"plan_text: plan[{i}] must be a Chunk (as plan_chunks makes "
                            f"them), got {type(c).__name__}")
    n = sum(len(c.positions) for c in plan)
    total = sum(c.bytes for c in plan)
    head = (
        f"max_chunk_bytes = {format_bytes(budget)}: {n} patch{'es' if n != 1 else ''}, "
        f"{format_bytes(total)} staged "
        f"→ {len(plan)} load_weights call{'s' if len(plan) != 1 else ''}"
    )
    lines = [head]
    for c in plan[:_MAX_CALL_LINES]:
        names = ", ".join(map(shown_name, c.names[:4])) + (
            f", … (+{len(c.names) - 4})" if len(c.names) > 4 else "")
        over = ", over budget (travels alone)" if c.over_budget else ""
        lines.append(
            f"  call {c.index}: {len(c.positions)} patch{'es' if len(c.positions) != 1 else ''}"
            f" ({names}), {format_bytes(c.bytes)}, closed by {c.closed_by}{over}"
        )
    if len(plan) > _MAX_CALL_LINES:
        lines.append(f"  … {len(plan) - _MAX_CALL_LINES} more calls")
    return "\n".join(lines) + "\n"


def _error_output(what: str, exc: BaseException) -> dict[str, Any]:
    """Why ``what`` is not shown, as one ``stdout`` stream output: ``"<what>: not drawn:
    <exception type>: <message>"``, then where it was raised (file, line, function)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = (
        f"  (raised in {os.path.basename(frames[-1].filename)}, line {frames[-1].lineno}, "
        f"in {frames[-1].name})\n" if frames else ""
    )
    return text_output(f"{what}: not drawn: {type(exc).__name__}: {exc}\n{where}")


def _figure_or_note(what: str, draw: Callable[[], Figure]) -> dict[str, Any]:
    """The figure ``draw()`` makes, or, whatever it raised (a patch the load rejected, a
    report whose model changed after the load), :func:`_error_output` saying why."""
    try:
        return figure_output(draw())
    except Exception as exc:
        return _error_output(what, exc)


def _output_bytes(output: dict[str, Any]) -> int:
    """About the bytes an output takes: its PNG (base64) and text."""
    data = output.get("data", {})
    return sum(len(v) for v in (output.get("text", ""), *data.values()) if isinstance(v, str))


def _fingerprint(t: object) -> Hashable | None:
    """What a drawing of tensor ``t`` depends on: its device, dtype and layout, where its
    memory is, and a CRC-32 of the bytes its elements span, read a band at a time (a
    band of a tensor on another device is copied to the CPU to be read). ``None`` where
    that cannot be read (no tensor, a tensor with no strided memory): a view drawn from
    it is then not kept."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        t = t.detach()
        head = (str(t.device), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if t.is_meta or t.numel() == 0:
            return head
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        raw = t.as_strided((span,), (1,)).view(torch.uint8)
        crc = 0
        for lo in range(0, raw.numel(), _FINGERPRINT_BAND):
            crc = zlib.crc32(raw[lo:lo + _FINGERPRINT_BAND].cpu().numpy(), crc)
        return (*head, t.data_ptr(), crc)
    except (RuntimeError, TypeError, ValueError):  # (no strided memory, a packed dtype)
        return None


def _patch_state(p: object) -> Hashable | None:
    """What a patch's density map depends on: its name, shape and dtype, and its values'
    and indices' contents and version counters (a report refuses a patch whose counters
    moved since the load). ``None`` where any cannot be read."""
    from .inspect import _versions

    try:
        name, shape, dtype, values, indices = p[0], p[1], p[2], p[3], p[4]  # type: ignore[index]
        head = (name, tuple(int(d) for d in shape), str(dtype), _versions(p))
    except (TypeError, IndexError, KeyError, ValueError):  # (no patch: a refused load's item)
        return None
    if not isinstance(name, str):
        return None
    parts = (_fingerprint(values), () if indices is None else _fingerprint(indices))
    return None if None in parts else (head, parts)


def _delta_state(report: LoadReport, target: str) -> Hashable | None:
    """What ``plot_delta(report, target)`` reads: the tensor now and the one holding its
    values before the load (its own, or the storage a call rebound), and the patches
    whose sparse saves on either are read back from the patch (their indices and NaNs
    say where). ``None`` where these cannot be read (``plot_delta`` then raises)."""
    from .inspect import _sharing

    try:
        now, old = report._tensor(target), report._original(target)
    except Exception:  # (plot_delta raises the same: its note is drawn, not kept)
        return None
    tensors = [now] if old is now else [now, old]
    prints = [_fingerprint(t) for t in tensors]
    seen: set[int] = set()
    for t in tensors:
        for s in _sharing(report._saved, t):
            if s.positions is not None and id(s.positions) not in seen:
                seen.add(id(s.positions))
                prints += [s.positions.position, _fingerprint(s.positions.indices),
                           _fingerprint(s.positions.values)]
    return None if any(p is None for p in prints) else tuple(prints)


def _valid_budget(v: object) -> bool:
    try:
        check_max_chunk_bytes(v)
    except (ValueError, TypeError):
        return False
    return True


def _slider_range(
    sizes: Sequence[int], wanted: int | None
) -> tuple[float, float, float]:
    """(low, high, start) in bytes for the budget slider."""
    positive = [s for s in sizes if s > 0]
    low = max(1.0, min(positive) / 2) if positive else 1.0
    high = max(2.0 * sum(positive), 4.0 * low)
    if wanted is not None:
        # (past float's range, 2**1024 say: 2**1023, which plans as it does, at or above
        # the total)
        at = float(min(wanted, 2**1023))
        low, high = min(low, at), max(high, at)
        return low, high, at
    # Any budget at or above the total gives the plan the default gives, so the default is
    # clipped into range without changing the plan.
    return low, high, min(float(DEFAULT_MAX_CHUNK_BYTES), high)


def _close_tree(root: W.Widget) -> None:
    """Close ``root`` and every widget it holds (its children, their layouts and styles,
    and so on down). ipywidgets keeps each widget open, and so alive, until it is closed,
    and ``close()`` closes that one widget only: the children of an explorer observe it,
    so closing the box alone kept its report, and through it the model, alive for good."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        w = stack.pop()
        if id(w) in seen:
            continue
        seen.add(id(w))
        for key in w.keys:
            v = getattr(w, key, None)
            stack.extend(x for x in (v if isinstance(v, (tuple, list)) else (v,))
                         if isinstance(x, W.Widget))
        W.Widget.close(w)


class ChunkPlanner(W.VBox):
    """A ``max_chunk_bytes`` slider over a list of patches, redrawing the chunk plan.

    Attributes a caller can use: ``slider`` (a :class:`ipywidgets.FloatLogSlider` over
    bytes; set ``slider.value`` to move it), ``readout`` (a Label with the budget in
    human bytes), ``output`` (an :class:`ipywidgets.Output` whose ``outputs`` are the plan
    figure of :func:`~patchkit.plot.plot_chunks` and the text of :func:`plan_text`),
    ``plan`` (the current list of :class:`~patchkit.Chunk`) and ``max_chunk_bytes`` (the
    slider's value as an int). Nothing is staged or loaded. Every redraw replaces the
    output: a figure that cannot be drawn is replaced by a line with the error (type and
    message), and a plan that cannot be made leaves ``plan`` empty and the output that
    line alone, so the output never shows an earlier budget's view.

    ``max_chunk_bytes``, when given, must be a positive whole number of bytes, as for a
    load (an int; a whole float such as ``1e9`` is taken too, ``1.5`` or ``inf`` is not:
    ``TypeError`` / ``ValueError``); anything but a report or a list of patches
    raises ``TypeError``. A report whose own budget was rejected (its load raised for
    ``max_chunk_bytes=0``) starts at the default budget, planning its patches as given.
    Like every ipywidgets widget, a planner stays open, and keeps its patches (or report)
    alive, until it is closed: :meth:`close` closes it and every widget in it.
    """

    def __init__(
        self,
        patches: LoadReport | Sequence[PatchLike],
        max_chunk_bytes: int | None = None,
    ) -> None:
        if max_chunk_bytes is not None:
            check_max_chunk_bytes(max_chunk_bytes)
        self.source = _as_source(patches, "chunk_planner")
        if _is_report(self.source):
            # (a refused load's report may hold items that are no patch: left out here)
            sizes = _staged_sizes(self.source.patches, strict=False)
            wanted = max_chunk_bytes
            if wanted is None and _valid_budget(self.source.max_chunk_bytes):
                wanted = self.source.max_chunk_bytes
        else:
            sizes = _staged_sizes(self.source, strict=True)
            wanted = max_chunk_bytes
        low, high, start = _slider_range(sizes, wanted)
        lo_exp, hi_exp = math.log2(low), math.log2(high)
        self.slider = W.FloatLogSlider(
            value=start, base=2, min=lo_exp, max=hi_exp, step=(hi_exp - lo_exp) / 200,
            description="max_chunk_bytes", readout=False, continuous_update=False,
            style={"description_width": "initial"}, layout=W.Layout(width="60%"),
        )
        self.readout = W.Label()
        self.output = W.Output()
        self.plan: list[Chunk] = []
        super().__init__([W.HBox([self.slider, self.readout]), self.output])
        self.slider.observe(self._on_change, names="value")
        self.redraw()

    def __repr__(self) -> str:
        # Short and stable: a notebook stores it as the widget's text/plain output (the
        # default would spell out every child, PNG data included).
        return f"ChunkPlanner(max_chunk_bytes={self.max_chunk_bytes}, calls={len(self.plan)})"

    def close(self) -> None:
        """Close the planner and every widget in it (the slider, its readout, the output:
        see the class docstring)."""
        _close_tree(self)

    @property
    def max_chunk_bytes(self) -> int:
        """The budget the slider shows, in whole bytes (at least 1)."""
        return max(1, round(self.slider.value))

    def _on_change(self, _change: Any) -> None:
        self.redraw()

    def redraw(self) -> None:
        """Re-plan at the slider's budget and replace the output (figure, then text); an
        error replaces what it stops (see the class docstring) instead of escaping, since
        a widget callback's exception would only reach the kernel's log."""
        budget = self.max_chunk_bytes
        self.readout.value = format_bytes(budget)
        try:
            _, self.plan, budget = _plan_for(self.source, budget, replan=True)
            text = text_output(plan_text(self.plan, budget))
        except Exception as exc:
            self.plan = []
            self.output.outputs = (_error_output(f"chunk plan at {format_bytes(budget)}", exc),)
            return
        self.output.outputs = (
            _figure_or_note("chunk plan figure",
                            lambda: _plot_chunks(self.source, budget, None, replan=True)),
            text,
        )


def _staged_sizes(patches: Sequence[Any], strict: bool) -> list[int]:
    """The staged bytes of each patch whose name, shape and dtype pass the loader's checks;
    where one does not, ``strict`` raises the error that names it, else it is left out."""
    sizes = []
    for i, p in enumerate(patches):
        try:
            _check_metadata(i, p)
        except (TypeError, ValueError):
            if strict:
                raise
            continue
        sizes.append(staged_nbytes(p))
    return sizes


def chunk_planner(
    patches: LoadReport | Sequence[PatchLike],
    max_chunk_bytes: int | None = None,
) -> ChunkPlanner:
    """A widget to try ``max_chunk_bytes`` values on ``patches`` (see :class:`ChunkPlanner`).

    The slider is logarithmic, from half the smallest patch's staged bytes to twice the
    total (widened to include ``max_chunk_bytes`` when given; with ``None`` it starts at
    the default budget clipped to that range, which plans the same calls). A
    :class:`~patchkit.inspect.LoadReport` may be passed instead of patches: the patches
    its load sent are planned, tied aliases dropped as the loader drops them.
    """
    return ChunkPlanner(patches, max_chunk_bytes)


class ReportExplorer(W.VBox):
    """Pick a patch or a runtime tensor of a report and see its figures and table rows.

    Attributes: ``dropdown`` (values ``("patch", position)`` and ``("runtime", name)``;
    labels ``"patch 3: name"`` and ``"runtime: name"``), ``filter`` (``None`` where the
    drop-down lists every entry, see below), ``output`` (an
    :class:`ipywidgets.Output`: for a patch its density map and its ``report.chunks``
    row; for a runtime tensor its placement and delta figures, its ``report.writes`` rows
    and its ``report.deltas`` row), ``planner`` (a :class:`ChunkPlanner` over the
    report's patches) and ``report``.

    A report of more than 200 entries (patches plus runtime tensors: a whole model's
    load) is not listed whole, which would make a drop-down of thousands of lines sent
    to the browser on every display: a ``filter`` text box (an :class:`ipywidgets.Text`,
    applied on Enter) sits above the drop-down, which lists the first 200 entries whose
    label holds every word typed, case-insensitively (``"runtime qkv"``: the runtime
    tensors named ``...qkv...``; ``"patch 12:"``: patch 12), and ``filter_note`` (a
    Label) says how many match. Empty, the filter lists the first 200 entries. A new
    filter keeps the chosen entry where it still matches (nothing is redrawn), else
    chooses the first match (one redraw), and where none matches the output says so.
    ``dropdown.value`` takes only a listed entry: set ``filter.value`` first to list one.

    The report of a load that raised (``error.report``) shows what it can: the error
    under the heading, a line saying why in place of a figure that cannot be drawn (the
    density map of a patch with an index outside its tensor), and a planner over its
    patches as given when the load was rejected before it was planned. Whatever a figure
    raises (e.g. the delta of a report whose patches changed after the load), the output
    shows a line with the error's type and message in its place; an error outside the
    figures replaces the whole output with that line. The output never keeps showing an
    earlier choice. Anything but a report raises ``TypeError``.

    Choosing an entry again shows what it showed without drawing it again: the explorer
    keeps the figures and rows it made, up to 16 MiB of them (a runtime tensor's take
    140-430 KB, a patch's about 55 KB), dropping the least recently shown first. The
    delta figure, which reads the model as it is now, is drawn again where the tensor's
    bytes or memory changed since (or the indices of a patch its saves are read back
    from), and a density map where its patch changed; a line saying why a figure is not
    drawn is never kept. The placement and the rows are the load's record, kept as
    they are.

    Like every ipywidgets widget, an explorer stays open until it is closed, and with it
    its report and so the model and the tensors the report holds: dropping the last
    reference is not enough. :meth:`close` closes it and every widget in it (the planner
    included); the report and the model then go once nothing else refers to them.
    """

    def __init__(self, report: LoadReport) -> None:
        _check_report(report, "explore")
        self.report = report
        options: list[tuple[str, tuple[str, Any]]] = [
            (f"patch {i}: {_shown(_given_name(p))}", ("patch", i))
            for i, p in enumerate(report.patches)
        ]
        # (the tensors with a deltas row, then those written without one: registered)
        runtime = dict.fromkeys([*report.deltas.index,
                                 *(t for t in report.writes["target"] if t is not None)])
        options += [(f"runtime: {_shown(t)}", ("runtime", t)) for t in runtime]
        self._runtime = len(runtime)
        self._options = _told_apart(options)
        self._lowered = [label.lower() for label, _ in self._options]
        self.filter: W.Text | None = None
        self.filter_note: W.Label | None = None
        self.dropdown = W.Dropdown(
            options=self._options[:_MAX_OPTIONS], description="show",
            layout=W.Layout(width="60%"),
        )
        self.output = W.Output()
        # (the views drawn, see _kept: key -> (state drawn in, output, its bytes))
        self._cache: OrderedDict[Hashable, tuple[Hashable, dict[str, Any], int]] = OrderedDict()
        self._cache_bytes = 0
        self.planner = ChunkPlanner(report)
        error = getattr(report, "error", None)
        rejected = (
            "" if error is None else
            f"<br>the load raised {type(error).__name__}: "
            f"{html.escape(shown_text(message_of(error)))}"
        )
        head = W.HTML(
            f"<b>LoadReport</b>: {_count(len(report.patches), 'patch', 'patches')}, "
            f"{_count(len(report.calls), 'load_weights call')}, "
            f"{_count(len(report.writes), 'runtime write')}{rejected}"
        )
        find: list[W.Widget] = []
        if len(self._options) > _MAX_OPTIONS:
            self.filter = W.Text(
                value="", description="filter", continuous_update=False,
                placeholder="words of a label, e.g. runtime qkv_proj (Enter)",
                layout=W.Layout(width="60%"),
            )
            self.filter_note = W.Label(self._filter_text(len(self._options)))
            find = [W.HBox([self.filter, self.filter_note])]
            self.filter.observe(self._on_filter, names="value")
        super().__init__([head, *find, self.dropdown, self.output,
                          W.HTML("<b>chunk plan</b>"), self.planner])
        self.dropdown.observe(self._on_change, names="value")
        self.redraw()

    def _filter_text(self, matched: int) -> str:
        words = self.filter.value.split() if self.filter is not None else []
        total = len(self._options)
        if not words:
            return (f"showing the first {_MAX_OPTIONS} of {total} entries: type words of a "
                    "name to find others")
        if not matched:
            return f"no entry of {total} matches"
        return (f"{matched} of {total} match" + ("es" if matched == 1 else "")
                + (f": showing the first {_MAX_OPTIONS}" if matched > _MAX_OPTIONS else ""))

    def _on_filter(self, _change: Any) -> None:
        assert self.filter is not None and self.filter_note is not None
        words = self.filter.value.lower().split()
        matched = [o for o, low in zip(self._options, self._lowered)
                   if all(w in low for w in words)]
        shown = matched[:_MAX_OPTIONS]
        before = self.dropdown.value
        # (new options select their first entry: the choice is put back where it is still
        # listed, and redrawn once, here, where it is not; never once per step)
        self.dropdown.unobserve(self._on_change, names="value")
        try:
            self.dropdown.options = shown
            if any(v == before for _, v in shown):
                self.dropdown.value = before
            elif shown and self.dropdown.value is None:  # (after none matched: none chosen)
                self.dropdown.index = 0
        finally:
            self.dropdown.observe(self._on_change, names="value")
        self.filter_note.value = self._filter_text(len(matched))
        if self.dropdown.value != before or not shown:
            self.redraw()

    def __repr__(self) -> str:
        return (
            f"ReportExplorer(patches={len(self.report.patches)}, "
            f"runtime tensors={self._runtime})"
        )

    def close(self) -> None:
        """Close the explorer and every widget in it (its drop-down, filter, outputs and
        planner: see the class docstring)."""
        _close_tree(self)

    def _on_change(self, _change: Any) -> None:
        self.redraw()

    def redraw(self) -> None:
        """Replace the output with the views of the dropdown's current choice (an error
        replaces what it stops, see the class docstring, instead of escaping: a widget
        callback's exception would only reach the kernel's log)."""
        choice = self.dropdown.value
        try:
            self.output.outputs = self._views(choice)
        except Exception as exc:
            self.output.outputs = (_error_output(f"views of {choice}", exc),)

    def _views(self, choice: tuple[str, Any] | None) -> tuple[dict[str, Any], ...]:
        r = self.report
        if choice is None:
            if not self._options:
                return (text_output("nothing to show: the report has no patches\n"),)
            if not self.dropdown.options and self.filter is not None:
                return (text_output(f"nothing matches the filter {self.filter.value!r}: "
                                    "change it to list entries\n"),)
            return (text_output("nothing chosen: pick a patch or a runtime tensor above\n"),)
        kind, key = choice
        if kind == "patch":

            def chunk_row() -> dict[str, Any]:
                row = r.chunks[r.chunks["position"] == key]
                return text_output(_table_text(row.drop(columns=["note"]), index=False,
                                               key="position") + "\n"
                                   + "".join(f"note: {n}\n" for n in row["note"] if n))

            return (
                # (the report's own: it refuses a patch changed in place since the load)
                self._kept(("density", key), _patch_state(r.patches[key]), lambda: (
                    _figure_or_note("density map", lambda: r.plot_density(r.patches[key])))),
                self._kept(("chunks", key), (), chunk_row),
            )
        if r._detached:
            delta = text_output("before/after figure: none, this report was unpickled or "
                                "copied (a copy keeps the tables, not the model's "
                                "tensors)\n")
        elif r.handed_over:
            delta = text_output("before/after figure: none, this report's before-values were "
                                "handed to a later load (reuse=)\n")
        elif key in r._meta:
            delta = text_output("before/after figure: none, the tensor is on the meta device "
                                "(a dry run: no numbers)\n")
        else:
            # (drawn from the model as it is now: kept while that and the saves read back
            # are as they were)
            delta = self._kept(("delta", key), _delta_state(r, key), lambda: (
                _figure_or_note("before/after figure", lambda: plot_delta(r, key))))

        def rows() -> dict[str, Any]:
            writes = r.writes[r.writes["target"] == key]
            cols = ["chunk", "position", "name", "checkpoint_region", "target_region",
                    "elements", "written", "changed"]
            return text_output(
                f"writes into {shown_name(key)}:\n"
                f"{_table_text(writes[cols].head(20), index=False, key='position')}\n"
                + (f"… {_count(len(writes) - 20, 'more write')}\n" if len(writes) > 20 else "")
                + _delta_text(r, key)
            )

        return (
            # (the placement and the rows are the load's record: they never change)
            self._kept(("placement", key), (), lambda: (
                _figure_or_note("placement figure", lambda: plot_placement(r, targets=[key])))),
            delta,
            self._kept(("rows", key), (), rows),
        )

    def _kept(self, key: Hashable, state: Hashable | None,
              make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The output ``make()`` gives for ``key`` (a view of a choice) while what it is
        drawn from is in ``state``: the one kept when it was last made in an equal
        state, else made now and kept (``None``: a state not known, made each time;
        a line saying why a figure is not drawn is made each time too). What is kept
        is bounded by :data:`_CACHE_BYTES`, the least recently shown dropped first."""
        hit = self._cache.get(key)
        if hit is not None and state is not None and hit[0] == state:
            self._cache.move_to_end(key)
            return hit[1]
        out = make()
        if hit is not None:
            self._forget(key)
        if state is None or _is_note(out):
            return out
        size = _output_bytes(out)
        if size <= _CACHE_BYTES:
            self._cache[key] = (state, out, size)
            self._cache_bytes += size
            while self._cache_bytes > _CACHE_BYTES:
                self._forget(next(iter(self._cache)))
        return out

    def _forget(self, key: Hashable) -> None:
        self._cache_bytes -= self._cache.pop(key)[2]


def _is_note(output: dict[str, Any]) -> bool:
    """Whether ``output`` is :func:`_error_output`'s line (a figure that was not drawn)."""
    return output["output_type"] == "stream" and ": not drawn: " in output["text"]


def _table_text(df: Any, index: bool, key: str | None = None) -> str:
    """Rows of a report's table as the report's text repr writes them: names that are
    not plain as their ``repr`` (a right-to-left override escaped, ``'w '`` told from
    ``w``: :func:`~patchkit.units.distinct_name`), floats in 4 significant digits
    (pandas' own format writes a tiny density as ``9.536743e-07``), and a table wider
    than :data:`_TABLE_WIDTH` characters written as blocks of its columns, one under the
    other, each beginning with the rows' labels (the index, or the column ``key``);
    names whole."""
    from .inspect import _FLOATS, _blocks_text, _names_shown

    if not len(df):
        return _names_shown(df).to_string(index=index, float_format=_FLOATS)
    return _blocks_text(_names_shown(df), index, _FLOATS, key, _TABLE_WIDTH, colwidth=None)


def _delta_text(report: LoadReport, target: str) -> str:
    """The ``report.deltas`` row of ``target`` as text, or why it has none."""
    if target in report.deltas.index:
        return f"\ndelta:\n{_table_text(report.deltas.loc[[target]], index=True)}\n"
    if target in getattr(report, "_restored", ()):
        why = ("written, then put back as it was by the load's transactional rollback: "
               "no change")
    elif target in getattr(report, "_meta", ()):
        why = "on the meta device: a dry run writes no numbers"
    elif report._aliases.get(target, target) in getattr(report, "_was_meta", ()):
        why = ("on the meta device before the load, which put a tensor that holds memory in "
               "its place: it had no values before")
    elif target in getattr(report, "_registered", ()):
        why = "a tensor the load registered has no values before it"
    else:
        why = "report.deltas has no row for it"
    return f"\ndelta: none ({why})\n"


def explore(report: LoadReport) -> ReportExplorer:
    """An explorer of ``report`` (see :class:`ReportExplorer`); display it in a notebook.

    ``report`` must be a :class:`~patchkit.LoadReport` (``TypeError`` otherwise)."""
    return ReportExplorer(report)
