"""See what a load did: :func:`inspect_load` runs a real load and records it.

Imports pandas (on first use of this module; ``import patchkit`` does not load it).

What a report costs: the load runs with write interception on (dense calls too), and
what each write changes is saved before it happens (the same mechanism as
``transactional=True``), never a copy of the whole model:

- a NaN-merged sparse write saves the elements its source lets through, and counts
  those whose bits it changes. On the CPU that is the compiled pass that merges
  (:func:`patchkit.native.merge`), which also measures the ``deltas`` numbers and, when
  the source is the patch's staged tensor, keeps only the old values: where they were is
  recomputed from the patch's own indices when needed (``before()``, ``written()``, a
  transactional restore). The report holds references to the patch's tensors (no
  copies), so leave them unchanged while it is in use: a changed patch is detected and
  raises ``ValueError`` where the report reads it (``before()``, ``written()`` and a
  restore check what the load wrote; ``plot_density`` refuses a patch whose tensors an
  in-place torch op changed since). Elsewhere it keeps
  storage offsets with the values;
- a dense ``copy_`` from a same-shaped source of the same dtype and device saves only
  the elements it changes (or its whole view, when offsets would cost more than the
  values). On the CPU, :mod:`patchkit.native` compares, saves, counts, measures the
  ``deltas`` numbers and copies in one compiled pass; elsewhere (CUDA, no C compiler,
  views it does not cover) torch ops compare before the copy. Other dense writes save
  their whole view once per region.

Extra memory is the saved values (at most the bytes written) and, where kept, their
int64 storage offsets: none for a whole-view save or a compiled sparse save from a
staged patch (the saves then cost exactly the bytes written); a dense save chooses offsets
only when they cost less than the whole view (the compiled path keeps the room it set
aside for them, about 1.25 times the share of changes a sample of the view found plus a
margin, until the report is dropped; views under 65536 elements are counted first, and
get exactly that room; views under 128 KiB are saved whole on that path, in one pass, since
offsets would spare little there); a sparse save through torch ops adds 8 bytes per
written element. Transient: 1-byte masks of the view being written (torch ops) and
scratch for the statistics, which work in blocks of 262144 elements (a few MiB), plus
scratch in proportion to the elements saved with their offsets. Reading the saves back
(the statistics, ``before()``, ``written()``, ``plot_delta``) finds the elements of a
view saved or written whole (rows, a block of columns, every other row, a transposed
view) in a contiguous tensor by arithmetic, with no index, so that bound holds also
where writes into one tensor overlap (a name sent twice: its old values are rebuilt a
block at a time); ``before()`` costs the copy it returns, ``written()`` its mask. Where
the tensor is not contiguous (a parameter kept transposed, say), or a strided view
reaches outside its tensor, the saves there are read through int64 storage offsets
instead (a few 8-byte arrays of the tensor's or the view's size); on a GPU, overlapping
writes into one tensor are rebuilt whole (a copy of it, a 1-byte mask, and torch's
8-byte positions of the written elements). The tables are pandas DataFrames built on
first read; every number in them is taken when the load ends.
Python's cyclic garbage collector is paused while a report's load runs
(process-wide, as ``gc.disable()`` is; its state is restored after, also on error, once
no report or watched load runs on another thread either; in a child forked meanwhile,
at the fork): the
report's own objects would set off collections mid-load that cost more than the writes
on a model of many small tensors.

In a loop that reports every step, ``inspect_load(..., reuse=last_report)`` writes the
new saves into the last report's buffers (where one fits: a save may then sit in a buffer
up to twice its size) instead of fresh memory: the loop's memory stays flat, and the saves
skip the page faults that fresh memory costs.
``benchmarks/bench_inspect.py`` measures time and memory against a plain load.
"""

from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import html
import inspect as _pyinspect
import io
import itertools
import math
import pickle
import textwrap
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, overload

import numpy as np
import pandas as pd
import torch

from . import native
from ._regions import _Owner, _RegionIndex, _span_of, _storage_key, _storage_offsets
from ._runtime_index import RuntimeIndex, named_tensors
from .bitwise import (
    _INT_OF_SIZE,
    _masked,
    bits,
    block_size,
    changed_mask,
    count_true,
    difference,
    has_numbers,
    host_waits,
    per_element,
    squares_on_device,
    sum_squares,
)
from .build import wire_bytes
from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, plan_chunks
from .density import (
    _check_range,
    _row_major_strides,
    density_map,
    distinct_indices,
    region_text,
)
from .errors import LOAD_WEIGHTS_DOES, PatchTypeError, add_note, brief, quoted, where
from .intercept import _DEFERRAL, SavedRegion, WriteEvent, WriteSession, _saved_region, rollbacks
from .loader import (
    _canonicalized,
    _names,
    _read_names,
    _roll_back,
    collector_paused,
    refuse_model_class,
    run_load,
)
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _as_patch,
    _check_structure,
    _given_name,
    check_flag,
    check_max_chunk_bytes,
    numel,
    patch_list,
    resolved,
    staged_nbytes,
)
from .progress import LoadProgress, Tracker, check_progress
from .units import _count, distinct_name, format_bytes, message_of, shown_name, shown_text

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .widgets import ReportExplorer

__all__ = ["LoadReport", "ReportKeyError", "density_map", "inspect_load", "patch_summary"]


def _kind(p: CheckpointWeightPatch) -> str:
    return "dense" if p.indices is None else "sparse"


def _nnz(p: CheckpointWeightPatch) -> int:
    """Elements ``p`` writes: all of a dense patch's; a sparse patch's distinct indices
    (see :func:`~patchkit.density.distinct_indices`: a sort only where they are not
    strictly increasing). Indices on the meta device hold no numbers: counted as given."""
    if p.indices is None:
        return numel(p)
    idx = p.indices.reshape(-1)
    return int(idx.numel() if idx.is_meta else distinct_indices(idx).numel())


def _versions(p: object) -> tuple[int | None, int | None]:
    """The version counters of a patch's values and indices (``None`` for one that is
    no tensor, or an inference tensor, which keeps none)."""
    try:
        values, indices = p[3], p[4]  # type: ignore[index]
    except (TypeError, IndexError, KeyError):
        return None, None  # (an item that is no patch: a refused load's input)
    return _version(values), None if indices is None else _version(indices)


def _version(t: object) -> int | None:
    try:
        return t._version  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # (no tensor; an inference tensor keeps none)
        return None


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def patch_summary(patches: Iterable[PatchLike]) -> pd.DataFrame:
    """One row per patch, in input order: what it is and what it costs.

    Columns: ``position``, ``name``, ``kind`` (dense/sparse), ``shape``, ``dtype``,
    ``numel``, ``nnz`` (elements written: all of them for dense; for sparse, its distinct
    indices, so an index given twice, as ``validate_unique_indices=False`` allows, counts
    once, as in :func:`density_map`; indices that are not strictly increasing cost a sort
    to count), ``density`` (``nnz / numel``), ``wire_bytes`` (values plus indices as
    held), ``staged_bytes`` (the full checkpoint-shaped tensor). Needs no model and loads
    nothing.

    Each item must be a patch (a plain 5-tuple is taken as one) that passes the checks
    the loader makes of each patch on its own (:func:`~patchkit.patch.validate_patches`:
    types, shape, lengths, dtypes) and whose indices all lie in ``[0, numel)`` (one
    min/max over each sparse patch's indices; indices on the meta device hold no numbers
    and are not checked). The first that does not raises
    :class:`~patchkit.PatchTypeError` / :class:`~patchkit.PatchValueError` naming its
    position, as the loader would, before any row is built. What a summary does not
    refuse, though a load would: dense and sparse patches in one list, NaN values, a
    repeated index (counted once in ``nnz``) and integer values out of their dtype's range.
    """
    patches = [_as_patch(p) for p in patch_list(patches, ordered=False)]
    for i, p in enumerate(patches):
        _check_structure(i, p)
    for i, p in enumerate(patches):
        if p.indices is not None and not p.indices.is_meta:
            _check_range(p, p.indices, numel(p), position=i)
    return _frame(_summary_columns(patches), samples=_SUMMARY_SAMPLES)


def _frame(
    cols: dict[str, Any], index: pd.Index | None = None, samples: dict[str, Any] | None = None
) -> pd.DataFrame:
    """A frame of ``cols`` (lists or pandas arrays, all of one length). An empty column
    gets the dtype pandas infers for its value in ``samples`` (so a table with no rows
    has the column types of one with rows, and the tables of many loads concatenate
    without turning numbers into objects), else ``object``."""
    samples = samples or {}
    return pd.DataFrame({
        k: pd.array([], dtype=pd.Series([samples[k]]).dtype if k in samples else object)
        if isinstance(v, list) and not v else v
        for k, v in cols.items()
    }, index=index)


# A value of each table column that pandas infers a type for (the type of a table with
# rows), for the tables of loads that wrote nothing; the other columns hold tuples.
_SUMMARY_SAMPLES = {
    "position": 0, "name": "", "kind": "", "dtype": "", "numel": 0, "nnz": 0, "density": 0.0,
    "wire_bytes": 0, "staged_bytes": 0, "bytes": 0, "closed_by": "", "note": "",
}
_CALLS_SAMPLES = {"chunk": 0, "writes": 0, "seconds": 0.0, "error": False}
_WRITES_SAMPLES = {
    "chunk": 0, "name": "", "checkpoint_region": "", "target": "", "target_offset": 0,
    "target_region": "", "elements": 0, "written": 0, "changed": 0, "op": "",
}
_DELTAS_SAMPLES = {"elements": 0, "changed": 0, "max_abs": 0.0, "mean_abs": 0.0, "rel_l2": 0.0}


def _summary_columns(patches: Iterable[CheckpointWeightPatch],
                     malformed: dict[int, str] | None = None) -> dict[str, list]:
    """:func:`patch_summary`'s columns, in order. A frame built from columns costs a
    fraction of one built from rows, or changed column by column afterwards.
    ``malformed``: positions of items that are no valid patch (the input of a refused
    load), whose row holds only its name, where it has a str one."""
    cols: dict[str, list] = {
        k: [] for k in ("position", "name", "kind", "shape", "dtype", "numel", "nnz",
                        "density", "wire_bytes", "staged_bytes")
    }
    for i, p in enumerate(patches):
        cols["position"].append(i)
        if malformed and i in malformed:
            cols["name"].append(_given_name(p))
            for k in ("kind", "shape", "dtype", "numel", "nnz", "density", "wire_bytes",
                      "staged_bytes"):
                cols[k].append(None)
            continue
        n = numel(p)
        nnz = _nnz(p)
        cols["name"].append(p.name)
        cols["kind"].append(_kind(p))
        cols["shape"].append(tuple(int(d) for d in p.shape))
        cols["dtype"].append(_dtype(p.dtype))
        cols["numel"].append(n)
        cols["nnz"].append(nnz)
        cols["density"].append((nnz / n) if n else 0.0)
        cols["wire_bytes"].append(wire_bytes(p))
        cols["staged_bytes"].append(staged_nbytes(p))
    if malformed:  # (counts stay integers beside the missing ones: <NA>, not NaN)
        for k in ("numel", "nnz", "wire_bytes", "staged_bytes"):
            cols[k] = pd.array(cols[k], dtype="Int64")
    return cols


def _malformed(patches: Sequence[object]) -> dict[int, str]:
    """Positions of the items that fail the loader's checks of a patch on its own
    (:func:`~patchkit.patch._check_structure`), each with the message it raises: what a
    report of a refused load shows in place of their numbers."""
    out = {}
    for i, p in enumerate(patches):
        try:
            _check_structure(i, p)
        except (TypeError, ValueError) as e:
            out[i] = str(e)
    return out


class _Recorder:
    """Collects calls and writes from a :class:`~patchkit.intercept.WriteSession`."""

    def __init__(self, tracker: Tracker | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.events: list[WriteEvent] = []
        self._sent: list[str] = []
        self._writes_at_start = 0
        self._tracker = tracker if tracker is not None and tracker.active else None
        self._staged_bytes = 0

    def on_call_start(self, chunk: int, staged: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._sent = [n for n, _ in staged]
        self._writes_at_start = len(self.events)
        if self._tracker is not None:
            self._staged_bytes = sum(t.numel() * t.element_size() for _, t in staged)

    def on_staged(self, name: str, staged: torch.Tensor) -> None:
        """One more entry of the call in progress (an observed call's iterator, taken
        as the model takes it: see WriteSession.stage_more)."""
        self._sent.append(name)
        if self._tracker is not None:
            self._staged_bytes += staged.numel() * staged.element_size()

    def on_write(self, event: WriteEvent) -> None:
        self.events.append(event)

    def on_call_end(self, chunk: int, returned: Any, seconds: float, error: bool) -> None:
        self.calls.append(
            {
                "chunk": chunk,
                "names": tuple(self._sent),
                "returned": None if returned is None else tuple(sorted(returned)),
                "writes": len(self.events) - self._writes_at_start,
                "seconds": seconds,
                "error": error,
            }
        )
        if self._tracker is not None:
            self._tracker.call_end(tuple(self._sent), self._staged_bytes, error)


class _Table:
    """A report table: its numbers are fixed when the load ends (``deltas`` included, read
    from the model right then); the pandas DataFrame is built on first access and kept,
    so a report nobody looks at costs no pandas work."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc  # (what help(LoadReport.writes) shows)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> _Table: ...

    @overload
    def __get__(self, obj: LoadReport, objtype: type | None = None) -> pd.DataFrame: ...

    def __get__(self, obj: LoadReport | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        key = "_frame_" + self.name
        frame = obj.__dict__.get(key)
        if frame is None:
            make = obj._tables.get(self.name)
            if make is None:
                raise ValueError(
                    f"this LoadReport has no {self.name} table: it was not made by "
                    "patchkit.inspect_load (a report comes from inspect_load, or from "
                    "unpickling one)"
                )
            frame = make()
            obj.__dict__[key] = frame
        return frame


# Taken while a report's saves are handed to a load (reuse=): a report passed to two
# loads on two threads at once gave both the same buffers, so that one load's saves
# overwrote the other's (a rollback then wrote the other model's values).
_HANDING_OVER = threading.Lock()


@dataclass(eq=False)
class LoadReport:
    """What one load did, as pandas tables (and figures, through its ``plot_*`` methods).

    In short (the rest of this text is the detail)::

        report = patchkit.inspect_load(model, patches)
        report                # a summary; a table in a notebook
        report.chunks         # one row per patch: its call, and why the call ended
        report.calls          # one row per load_weights call
        report.writes         # one row per write: which patch, which runtime region
        report.deltas         # one row per runtime tensor: changed, max_abs, rel_l2
        report.plot_delta(runtime_name)   # before, after and their difference
        report.explore()      # widgets to browse all of it

    Figures and ``before``/``after``/``written`` take *runtime* names (the
    ``target`` column of ``writes``: ``...qkv_proj.weight``); ``plot_density`` takes a
    patch's checkpoint name, or the patch itself.

    - ``chunks``: one row per input patch, in input order: ``chunk`` (the ``load_weights``
      call that carried it, ``<NA>`` for a dropped tied alias), ``position``, ``name``
      (as sent), ``kind``, ``shape``, ``dtype``, ``numel``, ``nnz``, ``density``,
      ``bytes`` (its staged bytes as patchkit stages it, in the patch's dtype; for a
      dropped or not-sent patch, what it would have staged; an observed loader that
      stages its own tensors, cast to another dtype say, may stage other bytes, which
      ``summary()`` counts where its calls leave the plan), ``closed_by`` (why its
      chunk ended: ``budget``,
      ``repeated name``, ``end``; ``loader`` for a call that an observed loader ended for
      reasons of its own), ``note`` (tied-weight renames and drops; ``not sent`` for a
      patch whose call never ran because the load stopped first; ``no write from it
      seen`` for one whose call returned without a write from it, as a loader returns
      when it skips a weight another rank holds, an expert under expert parallelism, say:
      no ``writes`` row names it). Taken from
      :func:`~patchkit.plan_chunks`, the function the loader itself uses. With
      ``loader=``, the calls the observed loader really made, when they differ from that
      plan (see :func:`inspect_load`).
    - ``calls``: one row per ``load_weights`` call: ``chunk``, ``names`` sent,
      ``returned`` names (``None`` when the loader returned None), ``writes`` into runtime
      tensors, ``seconds`` (wall time of the call, the report's own work in it included;
      on CUDA the clock starts and stops with the model's and the staged tensors' devices
      idle, so a copy still queued counts in its own call), ``error`` (the call raised,
      or patchkit refused it as it returned: a sparse call that rebound or registered a
      runtime tensor, or returned names without copying; its ``returned`` names are then
      not in ``loaded``).
    - ``writes``: one row per write into a runtime tensor (a ``copy_`` whose view runs
      from one runtime tensor into the next of one storage, over the end of ``q`` and
      the start of ``k`` where both are views of one flat buffer, is a row for each
      tensor it reaches; where a tensor's end falls inside a row of a view that is not
      contiguous, one for its whole rows and one for the part of the next; where it
      falls inside one of the view's elements, a float32 view over two bfloat16
      tensors cut at an odd element (contiguous, strided or transposed), rows for each
      tensor, of its own elements that the view's bytes reach, which a sparse call
      refuses, reason ``"straddling view"``):
      ``chunk``,
      ``position`` and
      ``name`` of the patch that fed it (``None`` when the source could not be traced to
      one staged tensor: made by an op from two patches, say), ``checkpoint_offset``
      (flat element offset of the source region in the checkpoint tensor, also where
      the source is a cast or clone of a strided view of the patch, a column slice
      ``w[:, 2:5].to(torch.bfloat16)`` or a transposed view, or a view of such a copy
      that is a box of it; ``None`` when an op moved the patch's elements first: a
      ``torch.cat``, a gather ``w[idx]``, a flip; where a view of such a copy runs over
      the ends of its rows, ``w[:, 2:5].float().reshape(-1)``, which is no box of the
      checkpoint tensor; or when the write is an op other than a copy,
      ``index_copy_``, ``param[idx] = w``, an ``out=`` op, which names its patch but
      follows no view of it), ``checkpoint_region`` (slice notation),
      ``target`` (the
      runtime parameter or buffer), ``target_offset``, ``target_region`` (slice
      notation, as :func:`~patchkit.density.region_text` writes it: ``"[32:48, :]"``; a
      box in any order of dimensions, a transposed view's included, is written as one;
      every other row ``"[1:8:2, :]"``; a region that is no box, ``"<n> elements from
      <offset>"``), ``shape``,
      ``elements`` (of the written view: ``shape``'s product), ``written`` (the elements
      that took the source's value: all of them for a dense copy, only those whose
      source is not NaN for a NaN-merged one; for a dense write other than a copy, such
      as ``p[rows] = w[rows]`` (``aten::index_put_``), ``fill_`` or an ``out=`` op, the
      whole view it was given, since which of its elements the op wrote is not
      followed), ``changed`` (elements whose bits changed), ``op`` (``"rebind"`` for a
      runtime tensor a call rebound, ``param.data = w``, or registered anew: a write of
      the whole tensor, whose ``before()`` is the original's; it stands for the writes
      into the new data too, later in that call or in later calls, which get no rows of
      their own: the report watches the storages the model held when the load began,
      and its ``deltas`` compare the tensor as it ends with the original (the row's own
      ``changed`` is counted when the call that rebound it ends: a later call's writes
      into the new data show in ``deltas`` alone, and that call, where it made no other
      write, among :meth:`summary`'s ``calls with no write seen``); a new tensor
      registered under a tied tensor's other name unties it, and that name is then a
      target of its own, and where the first name is registered anew or removed the alias that still
      holds the original tensor names it from then on; ``"register"`` for a tensor
      registered under a name the model did not have, which is then a target: written
      whole, with no ``deltas`` row and no ``before()`` (a tensor the model has, tied
      under a new name, is one more alias and no write); a sparse call's rebindings and
      registrations are undone, refused when it returns and put back when it raises, so
      only a dense call's show, and a sparse one's that could not be put back; a report
      of another loader logs each call as it ends, before that loader puts anything
      back), and the
      element strides of both views in memory, as ``view.stride()`` gives them
      (``checkpoint_stride``, ``target_stride``). Offsets count elements row-major in
      the tensor's own indexing (``t.flatten()[target_offset]`` is the view's first
      element), whatever its layout: for a target stored row-major (contiguous, as
      checkpoint tensors are staged) offset and strides go together
      (``t.view(-1).as_strided(shape, target_stride, target_offset)`` is the written
      view); for one that is not (a transposed or column-sliced parameter) the strides
      are not steps of the offset's indexing, and ``target_region`` says where the view
      is. A write through a view of another element size than its
      runtime tensor's (``p.data.view(torch.uint8)[rows]``, float16 halves of a float32,
      fp8 values packed four to an int32 word, written through
      ``.view(torch.float8_e4m3fn)``) is given in the runtime tensor's own elements:
      ``target_offset``, ``shape``, ``target_stride`` and ``elements`` are those of the
      box of the elements its bytes touch, each counted once, whole or in part (a write
      of one byte of a float32 is a write of that float32: one element, ``changed`` if
      its bits changed; the low float16 halves of a row are a write of that row), and for
      a NaN-merge, ``written`` counts the elements that hold a byte it wrote; where those
      elements make no box (a stride that is no whole number of them), the flat span its
      bytes reach. Likewise a source that reads a patch's bytes as another element size
      (``w.view(torch.uint8)[rows]``) is given in the checkpoint tensor's elements, the
      box of those its bytes touch: ``checkpoint_offset``, ``checkpoint_region`` and
      ``checkpoint_stride`` (``None`` for the offset where they make no box). These
      describe the source's own box, which has another shape than ``shape`` where the
      write packs checkpoint elements into runtime elements of another size (a bfloat16
      patch cast to float16 and written as the halves of float32 rows: 12 checkpoint
      elements a row, 6 runtime ones); where the two element sizes are the same (a
      float32 patch into a float32 tensor, both read as bytes), the box is the same.
    - ``deltas``: indexed by runtime tensor name, one row per touched tensor:
      ``elements`` written, each counted once (a dense copy writes its whole view, a
      NaN-merged copy only the elements its source lets through), ``changed`` (bitwise,
      against the value before the load), ``max_abs``, ``mean_abs`` (over the written
      elements) and ``rel_l2`` (``||after - before|| / ||before||`` over the written
      elements), all read as the runtime tensor's own dtype (packed int32 words as
      integers, whatever view wrote them); NaN for a packed dtype torch reads no numbers
      from (``float4_e2m1fn_x2``: only ``changed`` is counted), and for a tensor a call
      rebound to one of another shape or dtype (``param.data = w``: another tensor
      altogether, every element counted as changed). For bfloat16 on x86 CPUs
      the compiled path
      measures partly in float32: ``rel_l2`` always, and ``max_abs`` and ``mean_abs``
      where most of a write changed, can be off by up to 1e-6 relative (see
      :class:`patchkit.native.CopyResult`). Non-finite values are counted in
      ``changed`` but add nothing to ``max_abs``, ``mean_abs`` and ``rel_l2`` (a
      difference that is NaN or infinite counts as 0, and so does a non-finite old value
      in ``||before||``): a load that writes NaN or inf shows as changed elements with
      small or zero numbers. Check ``torch.isfinite(report.after(target))`` where that
      matters. Sums are taken in float64: float64 weights of magnitude above about
      1e154 give an infinite or NaN ``rel_l2``; differences that add up past float64's
      largest (about 1.8e308 in all) an infinite ``mean_abs``; and a difference that
      itself overflows float64 (a sign flip of 1e308) counts as 0 in ``max_abs``,
      ``mean_abs`` and ``rel_l2``, as a non-finite one does. A tensor that shares its
      storage with the one written, but at another element size (a uint8 buffer of
      which a float32 parameter is a view), gets no row of its own: such writes are
      followed only through tensors of the written view's element size.
    - ``error``: the exception the load raised, or ``None``; ``rolled_back``: True when
      that load was ``transactional=True`` and put every write back (False when a region
      could not be written back: the error then says which; the ``writes``
      table still says what the load did before it failed; ``deltas`` compares with the
      model as it is after the rollback). With ``loader=``, the observed loader's own
      rollback is read from the model when the load raised: the loader undid a target
      when its calls' own writes had left it changed and every element they wrote there
      holds its value from before the load again, bit for bit. What the writes had left
      is read when the last call ends, where that call raised (so a target that a later
      write of the load itself put back is no undo); where the loader raised after its
      last call returned, every target one of its writes changed counts as left changed.
      When every element its calls wrote holds its value from before the load again,
      ``rolled_back`` is True where the load was ``transactional=True`` or the loader
      undid a target (a load whose writes changed nothing, or put their targets back
      themselves, not asked to be transactional, shows no rollback); ``loaded``,
      ``deltas`` and ``written()`` are then those of patchkit's own rollback. Where it
      undid some targets and not others, it is False and the report reads as after an
      incomplete rollback of patchkit's own: only the targets it did not undo keep their
      saves (``deltas`` rows, ``written()``).
    - ``loaded``: the names the loader reported loaded. After a failure without
      rollback, those of the calls that returned before it (after an incomplete one,
      those of them that wrote into a target it did not restore).
    - ``patches``: the list of patches the load was given, in input order (a plain
      5-tuple as a :class:`~patchkit.CheckpointWeightPatch`; in a load refused for an
      item that is no patch, that item as given); ``plan``: the list of
      :class:`~patchkit.Chunk` behind ``chunks`` (:func:`~patchkit.plan_chunks` of the
      patches left after tied aliases are dropped; with ``loader=``, the calls the
      observed loader made where they differ from it; empty for a load refused before
      it was planned); ``max_chunk_bytes``: the budget the load was given.

    The four tables are built when first read (their numbers were all taken when the load
    ended), so that a report in a training loop costs no pandas work until it is looked
    at. Reports come from :func:`inspect_load` (or from unpickling one): one built with
    this class's constructor has no tables, and reading one raises ``ValueError``.

    ``after(target)`` gives the runtime tensor as it is now, and ``before(target)`` as it
    was before the load, rebuilt from the saves and its value now (CPU copies): the load's
    before and after until the model changes again (another load, a training step), so
    read them first; the tables' numbers stay the load's.

    A report pickles (to a file, or back from a worker process: ``multiprocessing``, a
    Ray task, and an exception raised with the report attached; ``copy.copy`` and
    ``copy.deepcopy`` make the same copy): the pickle keeps the four tables (built
    then), the numbers, ``error`` and the patches (their values and indices), so
    ``summary()``, both reprs, ``plot_chunks``, ``plot_placement`` and ``plot_density``
    work on the copy. It does not keep the model's tensors nor the saved before-values:
    the copy's ``before()``, ``after()``, ``written()`` and ``plot_delta`` raise
    ``ValueError``. To send only the
    numbers, send ``report.summary()`` or the tables. An ``error`` that does not survive
    a pickle and unpickle in the process that pickles it (a class whose ``__init__``
    takes other arguments than its ``args``, say) is kept as a ``RuntimeError`` giving
    its type and message; one whose class the reading process cannot import (defined in
    a worker's ``__main__``) still fails the whole pickle there, as any pickle of it
    would.
    """

    chunks: ClassVar[_Table] = _Table(
        "One row per input patch, in input order: chunk (the load_weights call that "
        "carried it), position, name, kind, shape, dtype, numel, nnz, density, bytes "
        "(staged), closed_by (budget, repeated name, end; loader), note. A pandas "
        "DataFrame, built on first read; LoadReport's docstring says more of each column.")
    calls: ClassVar[_Table] = _Table(
        "One row per load_weights call: chunk, names (sent), returned, writes (into "
        "runtime tensors), seconds, error. A pandas DataFrame, built on first read; "
        "LoadReport's docstring says more of each column.")
    writes: ClassVar[_Table] = _Table(
        "One row per write into a runtime tensor: chunk, position and name (the patch "
        "that fed it), checkpoint_offset, checkpoint_region, target (the runtime "
        "parameter or buffer), target_offset, target_region, shape, elements, written, "
        "changed, op, checkpoint_stride, target_stride. A pandas DataFrame, built on "
        "first read; LoadReport's docstring says more of each column.")
    deltas: ClassVar[_Table] = _Table(
        "One row per runtime tensor the load wrote, indexed by its name: elements "
        "(written, each once), changed (bitwise), max_abs, mean_abs, rel_l2 (over the "
        "written elements). A pandas DataFrame, built on first read; LoadReport's "
        "docstring says more of each column.")

    patches: list[CheckpointWeightPatch] = field(repr=False)
    plan: list[Chunk] = field(repr=False)
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
    loaded: set[str] = field(default_factory=set)
    error: BaseException | None = None
    rolled_back: bool = False
    # Set by inspect_load after construction (not arguments: help() shows only the above).
    _saved: list[SavedRegion] = field(default_factory=list, repr=False, init=False)
    _runtime: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, init=False)
    _aliases: dict[str, str] = field(default_factory=dict, repr=False, init=False)
    # Runtime tensors a dense call rebound or registered anew: name -> the original
    # storage's tensor, whose values (with the saves on it) are the ones before the load.
    _rebound: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, init=False)
    _tables: dict[str, Callable[[], pd.DataFrame]] = field(
        default_factory=dict, repr=False, init=False)
    _handed_over: bool = field(default=False, repr=False, init=False)
    # The version counters of each patch's values and indices when the load ended (see
    # _patch_changed); None: not known (a pickled report's copies).
    _patch_versions: list[tuple[int | None, int | None]] | None = field(
        default=None, repr=False, init=False)
    # Names the load removed from the model (``del module.w``): not targets any more.
    _removed: tuple[str, ...] = field(default=(), repr=False, init=False)
    # Names the load registered that the model did not have: no values before it.
    _registered: tuple[str, ...] = field(default=(), repr=False, init=False)
    # Calls that returned names (or None), with something staged, in which no write was
    # seen (WriteSession.quiet_calls): their indices.
    _quiet: tuple[int, ...] = field(default=(), repr=False, init=False)
    # runtime tensors with no strided memory of their own, each with what it is (see
    # patchkit._runtime_index.RuntimeIndex.storageless): only a load that did not watch sees one
    _storageless: dict[str, str] = field(default_factory=dict, repr=False, init=False)
    # Runtime tensors the load wrote and its transactional rollback put back as they were
    # (their saves went with the rollback: no deltas row, nothing written()).
    _restored: tuple[str, ...] = field(default=(), repr=False, init=False)
    # Runtime tensors on the meta device: they hold no numbers, so their writes have no
    # counts and they have no before or after; and how many of them the load wrote into
    # (a dry run, where any).
    _meta: frozenset[str] = field(default=frozenset(), repr=False, init=False)
    _dry: int = field(default=0, repr=False, init=False)
    # Every runtime tensor the report knows (targets, names removed, tensors registered
    # and removed again) and its shape: what the figures accept.
    _shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, init=False)
    # Their element strides as the load left them (what the writes' strides step through).
    _strides: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False, init=False)
    # A copy made by unpickling (see the class docstring): its targets, as the load left
    # them; it has no tensors.
    _detached: ClassVar[bool] = False
    # Runtime tensors on the meta device before the load that a call replaced with ones
    # that hold memory (a dry-run model a loader materialises): no before-values.
    _was_meta: ClassVar[frozenset[str]] = frozenset()
    _kept_targets: ClassVar[dict[str, tuple[int, ...]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle of this report keeps: the tables (built now), the numbers, the
        error and the patches; not the model's tensors or the saved before-values."""
        state = dict(self.__dict__)
        for name, attr in vars(LoadReport).items():
            if isinstance(attr, _Table):  # (each table built now, kept as its frame)
                state["_frame_" + name] = getattr(self, name)
        state.update(_tables={}, _saved=[], _runtime={}, _rebound={}, _detached=True,
                     _kept_targets=self.targets)
        state["patches"] = [_picklable_patch(p) for p in self.patches]
        state["_patch_versions"] = None  # (the copies a reader gets start counting anew)
        kept = None if self.error is None else _KeptError.of(self.error, self)
        if kept is not None:
            state["error"] = kept
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        error = state.get("error")
        if isinstance(error, _KeptError):
            state = {**state, "error": error.restore()}
        self.__dict__.update(state)

    def _patch_changed(self, position: int) -> str | None:
        """What of patch ``position`` changed in place since the load (``"values"``,
        ``"indices"`` or both: their version counters moved, as any in-place torch op
        moves them), or ``None``."""
        if self._patch_versions is None:
            return None
        now = _versions(self.patches[position])
        then = self._patch_versions[position]
        moved = [what for what, a, b in zip(("values", "indices"), then, now)
                 if a is not None and a != b]
        return " and ".join(moved) or None

    # -- values ----------------------------------------------------------------------

    @property
    def targets(self) -> dict[str, tuple[int, ...]]:
        """Every runtime tensor of the model (parameters and buffers) and its shape, by
        first name, as the load left them. A name the load removed (``del module.w``) is
        not one (a tied tensor then goes by its next name), though the tables, ``after()``
        and ``before()`` still know it: it held that tensor while the load wrote it. Nor
        is a tensor with no strided memory of its own (a lazy module's
        ``UninitializedParameter``, a sparse or nested tensor), which only a report of a
        load that wrote nothing can meet: a load that watches its writes refuses such a
        model."""
        if self._detached:
            return dict(self._kept_targets)
        removed = set(self._removed)
        return {n: tuple(t.shape) for n, t in self._runtime.items() if n not in removed}

    def _tensor(self, target: str) -> torch.Tensor:
        _check_target(target)
        self._check_attached()
        target = self._aliases.get(target, target)  # a tied alias names the same tensor
        try:
            return self._runtime[target]
        except KeyError:
            if target in self._shapes:
                raise ReportKeyError(
                    f"{target!r} was registered by the load and removed again: the report "
                    "keeps its writes rows, not the tensor"
                ) from None
            if target in self._storageless:
                raise ReportKeyError(
                    f"{target!r} is {self._storageless[target]}, with no strided memory of "
                    "its own: no report holds its values (a load that watches its writes "
                    "refuses this model)"
                ) from None
            raise _unknown_target(self, target) from None

    @property
    def handed_over(self) -> bool:
        """True once this report was passed to a later load as ``reuse=``: its save
        buffers went to that load, so ``before()``, ``written()`` and ``plot_delta`` raise
        ``ValueError``; the tables, numbers and other figures stay."""
        return self._handed_over

    @property
    def dry_run(self) -> bool:
        """True when the load wrote into runtime tensors on the meta device (a model made
        under ``torch.device("meta")``, to see where a big model's patches land without
        its memory): the ``writes`` table says where each write landed, but not what it
        changed (``changed`` is ``None``, and so is ``written`` for a NaN-merged write);
        such tensors have no ``deltas`` row, and ``before()``, ``after()``, ``written()``
        and ``plot_delta`` of them raise ``ValueError``. Also True when a call replaced
        a meta tensor with one that holds memory (a loader that materialises the model,
        ``module.w = nn.Parameter(w)``): that tensor's ``after()`` and ``written()`` work,
        its ``before()`` and ``plot_delta`` raise ``ValueError``."""
        return self._dry > 0 or bool(self._was_meta)

    def _hand_over(self) -> list[torch.UntypedStorage]:
        """Give up the saves (for ``inspect_load(..., reuse=self)``): the storages of the
        CPU save buffers that nothing outside this report uses, to be written over."""
        with _HANDING_OVER:  # (one report passed to two loads at once: one gets its saves)
            if self._handed_over:
                return []
            saved, self._saved = self._saved, []
            self._handed_over = True
        storages = {
            st.data_ptr(): st
            for st in (
                t.untyped_storage()
                for s in saved
                for t in (s.before, s.index)
                if t is not None and t.device.type == "cpu"
                and t.numel() * t.element_size() >= native._REUSE_MIN
            )
        }  # (a comprehension: no loop variable keeps a save alive below)
        del saved
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:
            return []  # no way to tell that nothing else holds them
        # Now that this report dropped its saves, each storage must have no user left but
        # the storage object above: a view of it held anywhere else keeps it out.
        try:
            return [st for st in storages.values() if use_count(st._cdata) == 1]
        except (AttributeError, TypeError, RuntimeError):  # a torch that counts otherwise
            return []

    def _check_attached(self) -> None:
        if self._detached:
            raise ValueError(
                "this report was unpickled or copied (copy.copy, copy.deepcopy): it keeps "
                "its tables, numbers and patches, not the model's tensors or the "
                "before-values, so before(), after(), written() and plot_delta need the "
                "report the load returned"
            )

    def _check_numbers(self, target: str) -> None:
        """Refuse a runtime tensor on the meta device: it holds no values to show."""
        _check_target(target)
        if self._aliases.get(target, target) in self._meta:
            raise ValueError(
                f"{target!r} is on the meta device (as in a dry run): it holds "
                "no numbers, so the report knows where the load wrote into it (the writes "
                "table, plot_placement), not what it wrote or changed"
            )

    def _check_saves(self) -> None:
        self._check_attached()
        if self._handed_over:
            raise ValueError(
                "this report's before-values were handed to a later load "
                "(inspect_load(..., reuse=<this report>)): its tables and numbers stay, "
                "before() and written() are gone"
            )

    def written(self, target: str) -> torch.Tensor:
        """Bool mask shaped like ``target`` (CPU): True where the load wrote.

        Dense writes count their whole view; NaN-merged (sparse) writes count only the
        elements their source did not keep. After a rollback that put the tensor back
        (``rolled_back``), all False: the model holds none of the load's values there
        (the ``writes`` table still lists what the load did before it failed). Read
        against the tensor as the model holds it now, as :meth:`before` is: once
        ``target`` is bound to other storage after the load (``param.data = w``, another
        load's rebinding), the mask is shaped like that tensor and all False (the
        ``deltas`` row keeps the load's count). Raises ``ValueError`` once the report was
        passed to a later load as ``reuse=``.
        """
        self._check_saves()
        self._check_numbers(target)
        t = self._tensor(target)
        mask = torch.zeros(t.numel(), dtype=torch.bool, device="cpu")
        if self._written_whole(target):
            return mask.fill_(True).view(t.shape)  # rebound or new: written whole
        self._check_followed(target, t)
        _mark_written(mask, t, _sharing(self._saved, t))
        return mask.view(t.shape)

    def after(self, target: str) -> torch.Tensor:
        """The runtime tensor ``target`` as it is now (a CPU copy): the load's result until
        the model changes again (another load, a training step). It still works once the
        report was passed on as ``reuse=``.

        ``target`` is a runtime name (as ``deltas.index`` and ``writes["target"]`` list
        them): :class:`ReportKeyError` (a ``KeyError``) for a name the report does not
        know, ``TypeError`` for one that is not a str; ``ValueError`` for a report of a
        dry run (meta tensors hold no values) or an unpickled or copied report (it keeps
        no tensors)."""
        t = self._tensor(target)
        self._check_numbers(target)
        return t.detach().to("cpu", copy=True)

    def before(self, target: str) -> torch.Tensor:
        """The runtime tensor ``target`` as it was before the load (a CPU copy).

        Rebuilt from the tensor's current value and the elements the load saved (newest
        first, so where saved regions overlap the oldest contents win). A report saves
        only what the load changed, so every other element, written-but-unchanged or
        never written, is read from the tensor now: call this before the model changes
        again (another load, a training step). The ``deltas`` numbers are fixed when the
        load ends and do not have this limit. A tensor that a call rebound
        (``param.data = w``) or registered anew gives the original tensor's values (and
        shape). Raises ``ValueError`` once the report was passed to a later load as
        ``reuse=``, or where the load wrote into ``target``'s storage through another
        registered tensor of another element size (a float32 parameter that is a view
        of a uint8 buffer: such writes are not followed, so the answer is not known;
        :meth:`written` and :func:`~patchkit.plot.plot_delta` raise alike), and
        ``KeyError`` for a name the load registered (new in the model).
        """
        return _rebuilt(self._original(target), self._saved)

    def _original(self, target: str) -> torch.Tensor:
        """The tensor whose values, with the saves on it, were ``target``'s before the
        load: its own, or the original storage's where a call rebound it. Raises as
        :meth:`before` does."""
        self._check_saves()
        t = self._tensor(target)
        self._check_numbers(target)
        if target in self._registered:
            raise ReportKeyError(
                f"{target!r} was registered by the load (a name the model did not have): it "
                "has no values before the load"
            )
        if self._aliases.get(target, target) in self._was_meta:
            raise ValueError(
                f"{target!r} was on the meta device before the load, and a call put a tensor "
                "that holds memory in its place: it had no values before the load (after() "
                "and written() have the ones now)"
            )
        old = self._rebound.get(self._aliases.get(target, target), t)
        self._check_followed(target, old)
        return old

    def _check_followed(self, target: str, t: torch.Tensor) -> None:
        """``ValueError`` where the load wrote into ``t``'s storage through a registered
        tensor of another element size (a float32 parameter that is a view of a uint8
        buffer): the saves are read with ``t``'s element size only (see
        :func:`_sharing`), so ``t``'s before-values and written elements are not known,
        and a rebuilt answer would be wrong without a word."""
        key, size = _storage_key(t), t.element_size()
        other = next((s for s in self._saved
                      if s.region.key == key and s.view.element_size() != size), None)
        if other is not None:
            raise ValueError(
                f"{target!r} ({t.dtype}) shares its storage with {other.target!r}, which this "
                f"load wrote as {other.view.dtype}: a report follows writes into a storage "
                "only through tensors of one element size, so what "
                f"{target!r} held before the load, and which of its elements it wrote, are "
                f"not known (the writes table lists the write into {other.target!r})"
            )

    def _written_whole(self, target: str) -> bool:
        """Whether the load wrote every element of ``target``: a tensor a call rebound or
        registered anew."""
        return self._aliases.get(target, target) in self._rebound or target in self._registered

    def _before_after(self, target: str) -> _BeforeAfter:
        """:meth:`before`, :meth:`after` and :meth:`written` of ``target``, to be read a
        range of elements at a time (see :class:`_BeforeAfter`: no copy of the whole
        tensor). Raises as :meth:`before` does."""
        old = self._original(target)
        return _BeforeAfter(old, self._tensor(target), self._saved,
                            self._written_whole(target))

    # -- summaries ---------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Headline numbers: patches, their kind (``dense``, ``sparse``, or ``mixed`` for a
        load the contract rejects), calls, staged bytes (of the calls that were made: a
        dropped tied alias, or a patch whose call never ran, stages nothing), elements
        written and changed, names loaded, and for a failed load its error (type and first
        line of the message) and whether a transactional load rolled it back; ``removed``
        lists the names the load removed from the model, where it removed any;
        ``calls with no write seen`` lists the calls that returned names (or ``None``)
        with something staged but made no write the report saw, where there are any:
        either they wrote nothing (a loader that skips weights another rank holds, or
        ones it finds unchanged) or they wrote where no interception sees (on another
        thread, through a storage, with torch function handling off, in TorchScript),
        and the report misses those writes, or they wrote into a tensor that an earlier
        call rebound (``param.data = w``: its ``rebind`` row stands for those writes).
        A dry run (:attr:`dry_run`) gives no element counts (``None``) and says how many
        runtime tensors on the meta device the load wrote (``"dry run"``)."""
        kinds = sorted(set(self.chunks["kind"].dropna()))  # (none for a malformed item)
        out = {
            "patches": len(self.patches),
            "kind": None if not kinds else kinds[0] if len(kinds) == 1 else "mixed",
            "load_weights calls": len(self.calls),
            # what the calls that ran staged: not a dropped alias, nor a call never made
            "staged bytes": sum(c.bytes for c in self.plan if c.index < len(self.calls)),
            "max_chunk_bytes": self.max_chunk_bytes,
            "runtime writes": len(self.writes),
        }
        if self._dry or self._was_meta:
            # (counts of tensors that hold no numbers: not known, so none are given)
            out.update({"elements written": None, "elements changed": None,
                        "dry run": "; ".join(filter(None, (
                            self._dry and f"{_count(self._dry, 'runtime tensor')} written "
                                          "on the meta device",
                            self._was_meta and f"{_count(len(self._was_meta), 'meta tensor')} "
                                               "each replaced by a tensor with memory")))})
        else:
            out.update({
                "elements written":
                    int(self.deltas["elements"].sum()) if len(self.deltas) else 0,
                "elements changed":
                    int(self.deltas["changed"].sum()) if len(self.deltas) else 0,
            })
        out.update({"names loaded": len(self.loaded),
                    "error": None if self.error is None else _error_text(self.error)})
        if self.rolled_back:
            out["rolled back"] = True
        if self._removed:
            out["removed"] = list(self._removed)
        if self._quiet:
            # (a loader that skips what another rank holds writes nothing: that is fine;
            # one that writes on another thread is not watched: its writes are missing)
            out["calls with no write seen"] = list(self._quiet)
        return out

    def _made_by_hand(self) -> bool:
        """Whether this report was built by its constructor, not by a load (nor
        unpickled): it has no tables."""
        return not self._tables and "_frame_chunks" not in self.__dict__

    def __repr__(self) -> str:
        if self._made_by_hand():
            return (f"LoadReport(<not made by inspect_load: no tables>, "
                    f"{_count(len(self.patches), 'patch', 'patches')})")
        s = self.summary()
        # (a lone surrogate in a name, which no terminal or Jupyter message takes, escaped
        # before the lines are measured: its escape is what they show)
        items = [shown_text(f"{k}={_human(k, v)}") for k, v in s.items() if v is not None]
        parts = [_wrapped_call("LoadReport", items)]
        # (every column, in blocks of columns that fit _REPR_WIDTH: to_string takes no
        # display options)
        parts.append("chunks:\n" + _head_text(
            _names_shown(self.chunks.drop(columns=["note"])), False, _FLOATS,
            key="position"))
        if len(self.deltas):
            parts.append("deltas:\n" + _head_text(_names_shown(self.deltas), True, _FLOATS))
        return "\n\n".join(parts)

    def _repr_html_(self) -> str:
        if self._made_by_hand():
            return f"<pre>{html.escape(repr(self))}</pre>"
        s = self.summary()
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
            f"<td>{html.escape(_human(k, v))}</td></tr>"
            for k, v in s.items()
            if v is not None
        )
        out = [f"<div><b>LoadReport</b><table>{rows}</table>"]
        # No timings here: a rendered report must be the same on every run and machine
        # (notebook outputs are compared); ``report.calls.seconds`` has them.
        tables = (
            ("chunks", _names_shown(self.chunks)),
            ("calls", _name_tuples_shown(self.calls.drop(columns=["seconds"]))),
            ("deltas", _names_shown(self.deltas)),
        )
        for title, df in tables:
            if len(df):
                n = len(df)
                shown = f"first {_HTML_ROWS} of {n} rows" if n > _HTML_ROWS else (
                    f"{n} row" + ("s" if n != 1 else ""))
                out.append(f"<details open><summary>{title} ({shown})</summary>")
                out.append(_cut(df.head(_HTML_ROWS)).to_html(
                    index=title == "deltas", float_format=_FLOATS))
                out.append("</details>")
        out.append("</div>")
        return shown_text("".join(out))

    # -- figures (matplotlib on first use) ---------------------------------------------------

    def plot_chunks(self, max_chunk_bytes: int | None = None, *, ax: Axes | None = None
                    ) -> Figure:
        """Staged bytes per ``load_weights`` call and why each ended:
        :func:`patchkit.plot.plot_chunks` of this report (``max_chunk_bytes``: re-plan
        the patches it sent for another budget; ``ax``: draw into these axes)."""
        from . import plot

        return plot.plot_chunks(self, max_chunk_bytes, ax=ax)

    def plot_density(
        self, patch_or_name: PatchLike | str,
        bins: int | tuple[int, int] = (128, 128), *, ax: Axes | None = None,
    ) -> Figure:
        """Where a patch writes, as a heat map: :func:`patchkit.plot.plot_density` (``bins``
        per axis, ``ax``). A patch of this report is named by its name (the first patch
        of that name; a tied alias the load renamed, by the name it was sent under too,
        as ``chunks`` shows it) or given itself; when the load dropped it (a tied alias),
        renamed it or never sent it, the title says so (the ``note`` of ``chunks``).
        Raises ``ValueError`` for a patch of this report whose values or indices an
        in-place op changed since the load (their version counters moved): the map would
        show the new ones (:func:`patchkit.plot.plot_density` of the patch draws those)."""
        from . import plot

        kw = {"bins": bins, "ax": ax}

        if isinstance(patch_or_name, str):
            matches = [p for p in self.patches if _given_name(p) == patch_or_name] or [
                # (else the name it was sent under: a tied alias the load renamed)
                self.patches[i] for i, n in zip(self.chunks["position"], self.chunks["name"])
                if n == patch_or_name]
            if not matches:
                # (the names of the items that are patches: a load refused for an item
                # that is none keeps that item, which has no name)
                named = [n for n in map(_given_name, self.patches) if n is not None]
                known = ", ".join(map(quoted, named[:8]))
                from .plot import _known, _resolve

                hint = (
                    ": it is a runtime tensor's name; report.plot_delta(name) draws its "
                    "before, after and change"
                    if _resolve(self, patch_or_name) in _known(self)
                    else f" (some are: {known})" if known else " (it has no patches)"
                )
                raise ReportKeyError(f"no patch named {quoted(patch_or_name)} in this "
                                     f"report{hint}")
            patch_or_name = matches[0]
        elif not (isinstance(patch_or_name, tuple) and len(patch_or_name) == 5):
            raise TypeError(
                "plot_density takes a patch of this report or its name, got "
                f"{type(patch_or_name).__name__}: {brief(patch_or_name)}"
            )
        at = next((i for i, p in enumerate(self.patches) if p is patch_or_name), None)
        changed = self._patch_changed(at) if at is not None else None
        if changed:
            raise ValueError(
                f"{where(at, _given_name(patch_or_name))}: its {changed} changed in place "
                "after the load, so its map would show the new ones, not where this load "
                "wrote (a report keeps the patch's tensors, not copies of them: leave them "
                "unchanged while the report is in use); patchkit.plot.plot_density(patch) "
                "draws the patch as it is now"
            )
        fig = plot.plot_density(patch_or_name, **kw)
        note = self.chunks["note"].iloc[at] if at is not None else ""
        if note:
            ax = ax or fig.axes[0]
            ax.set_title(f"{ax.get_title()}\n({note})", fontsize=10)
        return fig

    def plot_placement(
        self, targets: str | Sequence[str] | None = None, *, max_targets: int | None = None
    ) -> Figure:
        """Checkpoint regions → runtime regions: :func:`patchkit.plot.plot_placement`
        (``targets``: the runtime tensors to draw, default those written, at most
        ``max_targets``; ``None``, the default, is that function's own default, 6)."""
        from . import plot

        kw = {} if max_targets is None else {"max_targets": max_targets}
        return plot.plot_placement(self, targets, **kw)

    def plot_delta(
        self, target: str, bins: int | tuple[int, int] = (128, 128), *,
        changed_only: bool = False, hist_bins: int = 60,
    ) -> Figure:
        """Before / after / Δ heat maps and a Δ histogram of one runtime tensor:
        :func:`patchkit.plot.plot_delta` (``bins`` per axis; ``changed_only``: the
        histogram counts only the elements whose bits changed; ``hist_bins``: its bars)."""
        from . import plot

        return plot.plot_delta(self, target, bins, changed_only=changed_only,
                               hist_bins=hist_bins)

    def explore(self) -> ReportExplorer:
        """An ipywidgets explorer of this report: :func:`patchkit.widgets.explore`
        (a :class:`~patchkit.widgets.ReportExplorer`; display it in a notebook).
        ``ImportError`` without ipywidgets (``pip install 'patchkit[notebooks]'``)."""
        from . import widgets

        return widgets.explore(self)


# A text repr prints a table whole up to _REPR_MAX rows, else its first _REPR_ROWS and a
# line saying how many more (the tables themselves have them all).
_REPR_MAX, _REPR_ROWS = 40, 20
# The HTML summary shows a table's first _HTML_ROWS; both reprs cut a cell's text (a long
# tensor name, a tuple of names) to _COLWIDTH characters, ending it with "...".
_HTML_ROWS = 8
_COLWIDTH = 60
# The text repr's lines are at most _REPR_WIDTH characters (a terminal's 80 columns).
_REPR_WIDTH = 80
# How both reprs (and the explorer's tables) write a float: 4 significant digits (a 3e-7
# step of a small learning rate is not 0.0, nor a density of 1e-9).
_FLOATS = "{:.4g}".format


def _head_text(df: pd.DataFrame, index: bool, floats: Any = None, *,
               key: str | None = None) -> str:
    """``df`` as text: whole, or its first rows and a line saying how many more
    (``floats``: how float cells are written, pandas' own format otherwise), in lines of
    at most ``_REPR_WIDTH`` characters: its cells (the index too) cut to ``_COLWIDTH``
    as :func:`_cut` cuts them, and a table wider than that written as blocks of its
    columns, one under the other, each beginning with the rows' labels (the index, or
    the column ``key``), as pandas wraps a wide frame on a terminal. A table of no rows
    is ``"(no rows)"`` (pandas' own text for it lists the columns on one line)."""
    if not len(df):
        return "(no rows)"
    if len(df) <= _REPR_MAX:
        return _blocks_text(_cut(df), index, floats, key)
    more = len(df) - _REPR_ROWS
    return (_blocks_text(_cut(df.head(_REPR_ROWS)), index, floats, key)
            + f"\n... {more} more rows")


def _blocks_text(df: pd.DataFrame, index: bool, floats: Any, key: str | None,
                 width_limit: int = _REPR_WIDTH, colwidth: int | None = _COLWIDTH) -> str:
    """``df`` (rows, cells cut) as :func:`_head_text` writes it: whole where it fits
    ``width_limit`` characters (``_REPR_WIDTH``; the explorer's tables take another),
    else in the fewest blocks of consecutive columns that fit (a block holds the labels
    and one column at least: with cells of ``_COLWIDTH`` characters at most, that always
    fits), split where the widest block is narrowest (no block of one last column under
    a full one), separated by blank lines. ``colwidth``: where pandas cuts a cell
    (``None``: nowhere, for the explorer's tables, which write names whole; a block
    with a longer name is as wide as it needs)."""
    def text(columns: list[str]) -> str:
        return shown_text(df[columns].to_string(index=index, max_colwidth=colwidth,
                                                float_format=floats))

    def width(columns: list[str]) -> int:
        return max(map(len, text(columns).splitlines()))

    columns = list(df.columns)
    whole = text(columns)
    if max(map(len, whole.splitlines())) <= width_limit or len(columns) < 2:
        return whole
    # pandas sets each column (and the labels) to a width of its own, so a block's width
    # is the labels' plus its columns': measured once a column, not once a block
    labels = width(columns[:1]) + width(columns[1:2]) - width(columns[:2])
    own = {c: width([c]) - labels for c in columns}

    def lead(block: Sequence[str]) -> list[str]:  # (the key column, where a block lacks it)
        return [key] if key is not None and key not in block else []

    def wide(blocks: list[list[str]]) -> int:
        return max(labels + sum(own[c] for c in (lead(b) if i else []) + b)
                   for i, b in enumerate(blocks))

    for count in range(2, len(columns) + 1):
        cuts = itertools.combinations(range(1, len(columns)), count - 1)
        ways = [[columns[a:b] for a, b in zip((0, *cut), (*cut, len(columns)))]
                for cut in cuts]
        best = min(ways, key=wide)
        if wide(best) <= width_limit:
            break
    return "\n\n".join(text((lead(b) if i else []) + b) for i, b in enumerate(best))


def _wrapped_call(name: str, items: list[str]) -> str:
    """``name(a, b, c)`` in lines of at most ``_REPR_WIDTH`` characters: the items
    filled in order, joined by ``", "``, each one that does not fit where a line ends
    beginning the next line (indented 4), and one longer than a line broken at its
    blanks (a word longer than a line, inside it). Nothing is cut: joining the lines
    gives the one-line form back, but for the blanks at a break."""
    pieces = [f"{item}," for item in items[:-1]] + [f"{items[-1] if items else ''})"]
    pieces[0] = f"{name}({pieces[0]}"
    indent = " " * 4
    lines: list[str] = []
    line = None  # (the line being filled; None before the first)
    for piece in pieces:
        joined = piece if line is None else f"{line} {piece}"
        if len(joined) <= _REPR_WIDTH:
            line = joined
            continue
        if line is not None:
            lines.append(line)
        first = indent if line is not None else ""
        *full, line = textwrap.wrap(piece, _REPR_WIDTH, initial_indent=first,
                                    subsequent_indent=indent, break_on_hyphens=False)
        lines.extend(full)
    lines.append(line or "")
    return "\n".join(lines)


def _names_shown(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` (``chunks`` or ``deltas``) with its names, the ``name`` column or the index
    of runtime names, as both reprs write them: a plain name as it is, any other (blank
    at an end, or all blank; a newline or another character that is not printable; a
    backslash; a quote first) as its ``repr``, so that no two names read the same (a
    name ``"w "`` and ``"w"``, ``"a\\nb"`` and ``"a\nb"``) and none is lost in the
    table's blanks. The tables themselves keep the names as they are."""
    def shown(v: Any) -> Any:
        return distinct_name(v) if isinstance(v, str) else v

    out = df.copy()
    if "name" in out.columns:
        out["name"] = pd.Series([shown(v) for v in out["name"]], index=out.index,
                                dtype=object)
    else:
        out.index = pd.Index([shown(v) for v in out.index], name=out.index.name,
                             dtype=object)
    return out


def _name_tuples_shown(df: pd.DataFrame) -> pd.DataFrame:
    """``calls`` with its ``names`` and ``returned`` tuples as the HTML writes them:
    pandas' own ``(a, b)`` where every name is plain, else the tuple's ``repr``, each name
    quoted and escaped (``('a, b', 'c\u202e')``), so that a name holding ``", "`` does not
    read as two and one holding a character that is not printable (a right-to-left
    override, a lone surrogate) is not written raw. The table keeps the names as they are."""
    def plain(name: Any) -> bool:
        return (isinstance(name, str) and distinct_name(name) == name
                and not any(c in name for c in ",()"))

    def shown(v: Any) -> Any:
        if isinstance(v, tuple) and not all(plain(n) for n in v):
            return repr(v)
        return v

    out = df.copy()
    for c in ("names", "returned"):
        if c in out.columns:
            out[c] = pd.Series([shown(v) for v in out[c]], index=out.index, dtype=object)
    return out


def _cut(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with each text cell longer than ``_COLWIDTH`` characters cut to that, ending
    in "..." (``to_html`` does not cut, as ``to_string(max_colwidth=)`` does), its index
    (``deltas``' runtime names) too."""
    def cut(v: Any) -> Any:
        if isinstance(v, str | tuple | list | set | frozenset):
            text = v if isinstance(v, str) else str(v)
            if len(text) > _COLWIDTH:
                return text[: _COLWIDTH - 3] + "..."
        return v

    out = df.copy()
    for c in out.columns:
        if out[c].dtype == object or pd.api.types.is_string_dtype(out[c].dtype):
            out[c] = pd.Series([cut(v) for v in out[c]], index=out.index, dtype=object)
    if out.index.dtype == object:
        out.index = pd.Index([cut(v) for v in out.index], name=out.index.name, dtype=object)
    return out


class _KeptError:
    """What a report's pickle keeps of an error that does not survive a pickle (a
    class whose ``__init__`` takes other arguments than its ``args``, one holding a lock):
    its type and message, for a ``RuntimeError`` that stands in for it when the report
    is read back, so that such an exception costs itself and not the whole report. An
    error that survives is kept as it is (it stays the very exception whose ``report``
    is the report)."""

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why

    @classmethod
    def of(cls, error: BaseException, report: LoadReport) -> _KeptError | None:
        """``None`` when ``error`` pickles and unpickles here (its ``report``, and any
        reference to ``report``, taken as given), else what stands in for it."""
        out = io.BytesIO()
        try:
            _ReportByReference(out, report).dump(error)
            _ReportByReference.Reader(io.BytesIO(out.getvalue()), report).load()
        except Exception as e:  # (any: a user's exception's pickle can raise anything)
            return cls(_error_text(error, 400), f"{type(e).__name__}: {e}")
        return None

    def restore(self) -> RuntimeError:
        return RuntimeError(f"{self.text} (the load's exception, which a pickle could not "
                            f"keep: {self.why})")


class _ReportByReference(pickle.Pickler):
    """A pickler that writes ``report`` as a reference (its own pickle is not tried
    again), and :class:`Reader`, which reads that reference back as ``report``. (As
    methods of subclasses: Python 3.13 made ``persistent_id`` and ``persistent_load``
    read-only on the picklers' instances, where assigning them worked before.)"""

    def __init__(self, file: io.BytesIO, report: LoadReport) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.report = report

    def persistent_id(self, obj: object) -> str | None:
        return "report" if obj is self.report else None

    class Reader(pickle.Unpickler):
        def __init__(self, file: io.BytesIO, report: LoadReport) -> None:
            super().__init__(file)
            self.report = report

        def persistent_load(self, pid: object) -> LoadReport:
            return self.report


def _error_text(error: BaseException, limit: int = 160) -> str:
    """``"ValueError: first line of the message"``, cut to ``limit`` characters; an
    exception whose ``str()`` raises gives ``<exception str() failed>`` as its message,
    as Python's own traceback writes it."""
    lines = message_of(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool | None:
    """Whether ``fn`` takes a keyword argument ``name`` (or any, through ``**kwargs``);
    ``None`` where its signature cannot be read."""
    try:
        params = _pyinspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (
        p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)) for p in params)


def _check_loader_call(loader: Callable[..., Any], transactional: bool) -> None:
    """:class:`~patchkit.PatchTypeError` where ``loader``'s signature (when it can be read)
    does not take the call ``inspect_load`` makes: ``loader(model, patches,
    max_chunk_bytes=..., validate_unique_indices=...)``, and ``transactional=True`` where
    asked, as ``load_checkpoint_weight_patches`` and vLLM's function take them."""
    try:
        signature = _pyinspect.signature(loader)
    except (TypeError, ValueError):
        return  # (a callable whose signature cannot be read: the call itself says)
    kwargs: dict[str, Any] = {"max_chunk_bytes": 1, "validate_unique_indices": True}
    if transactional:
        kwargs["transactional"] = True
    try:
        signature.bind(None, None, **kwargs)
    except TypeError as exc:
        asked = ", ".join(f"{k}=..." for k in kwargs)
        raise PatchTypeError(
            f"loader {_callable_name(loader)} cannot take the call inspect_load makes, "
            f"loader(model, patches, {asked}) (the signature of "
            f"load_checkpoint_weight_patches, and vLLM's): {exc}",
            reason="loader signature", value=_callable_name(loader),
        ) from None


def _check_wrappable(model: torch.nn.Module) -> None:
    """:class:`~patchkit.PatchTypeError` where ``model.load_weights`` is a property (a
    data descriptor of its class): an observed load wraps ``model.load_weights`` by
    setting it on the instance, which a property without a setter refuses (an
    ``AttributeError`` from inside the load, the loader never run) and one with a setter
    takes and keeps (the wrapper left on the model for good, its getter's own answer
    gone): neither can be put back as it was."""
    found = _pyinspect.getattr_static(type(model), "load_weights", None)
    if hasattr(type(found), "__set__") or hasattr(type(found), "__delete__"):
        raise PatchTypeError(
            f"model {type(model).__name__}'s load_weights is a {type(found).__name__} of "
            "its class: inspect_load(loader=...) observes a load by setting a wrapper as "
            "the model's load_weights for the load and removing it after, which it cannot "
            "do to a property; make load_weights a method, or inspect patchkit's own load "
            "(loader=None)",
            reason="load_weights property", value=type(found).__name__,
        )


def _callable_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if name and module else repr(fn)


def _human(key: str, v: Any) -> str:
    if "bytes" in key and isinstance(v, int):
        return format_bytes(v)
    if isinstance(v, list) and len(v) > _LIST_SHOWN:
        # (summary() has them all: calls with no write seen may be thousands)
        head = ", ".join(map(repr, v[:_LIST_SHOWN - 2]))
        return f"[{head}, ..., {v[-1]!r}] ({len(v)})"
    if isinstance(v, str):
        # (an error's message: a "\r" or a U+202E in it would rewrite or reverse the line)
        return shown_name(v)
    return str(v)


_LIST_SHOWN = 8  # items of a list a repr shows (the first six, the last, and the count)


# ------------------------------------------------------------------------------------------


def inspect_load(
    model: torch.nn.Module,
    patches: Iterable[PatchLike],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    validate_unique_indices: bool = True,
    transactional: bool = False,
    loader: Callable[..., Any] | None = None,
    reuse: LoadReport | None = None,
    progress: bool | Callable[[LoadProgress], Any] | None = False,
) -> LoadReport:
    """Run a real load of ``patches`` into ``model`` and return what happened.

    With ``loader=None`` the load is patchkit's own
    :func:`~patchkit.load_checkpoint_weight_patches`, with the same arguments and the same
    effect on the model. With ``loader=`` any callable of that signature (vLLM's, say)
    runs instead, called as ``loader(model, patches, max_chunk_bytes=...,
    validate_unique_indices=...)`` with this call's values, and ``transactional=True``
    where asked for (vLLM's function takes no ``transactional``: with it, a loader
    whose signature has none is refused, :class:`~patchkit.PatchTypeError`, before
    anything runs, as is one whose signature cannot take that call at all); a
    ``functools.partial`` that fixes one of them is overridden, so pass it here instead,
    and patchkit only observes it: ``model.load_weights`` is wrapped for
    the duration to record each call made on this thread (a call that the model's
    ``load_weights`` makes into itself is part of the call it runs in: its writes are
    that call's; an iterator the loader gives it, a generator that stages each patch as
    the model asks for it, is handed on as such, each entry recorded as the model takes
    it), and writes into runtime tensors are watched on this thread, never changed. A
    call made on another thread (another thread's own load into the same model, or a
    worker thread of the loader's) passes
    to the model's own ``load_weights`` unwatched, and an observed load on another thread
    sees only its own calls; the last observed load to end puts ``load_weights`` back as
    it was (a model whose ``load_weights`` is a property, which cannot be wrapped and
    put back so, is refused before anything runs: :class:`~patchkit.PatchTypeError`,
    ``reason="load_weights property"``). The loader returns the names it loaded (an
    iterable of str) or ``None``: anything else (a str, a number) raises
    :class:`~patchkit.PatchTypeError` (``reason="loader returned"``) once it has
    returned, its writes kept. Its calls
    are watched through a torch function mode (see :mod:`patchkit.intercept`), so a
    loader that turns torch function handling off (``torch._C.DisableTorchFunction``)
    while it writes hides those writes from the report (patchkit's own loader watches
    its sparse calls at the ATen level, which sees them). What an observed load reports:

    - ``chunks``: patchkit's plan while the loader's calls follow it; when they do not, the
      calls the loader made, each patch in the call that sent it (``closed_by`` inferred
      by the contract's rules, ``loader`` where none applies);
    - a sent name is matched to the first patch of that name not sent yet, so a patch
      list that names one weight twice is followed call by call; for a tied tensor, to
      the first not sent yet of any of its names (a loader that renames the alias to the
      first name, CONTRACT §6, sent that patch: ``note`` says it was renamed, and its
      writes are its own), and where patches of two of its names wait, to the one whose
      own storage the staged tensor is (a dense patch's values, staged as CONTRACT §3
      says), else to one whose values it holds bit for bit; among equals (patches of
      equal values), to the one patchkit's plan sends there while the calls follow it,
      else to the first. The plan's drop of a tied alias applies only to a loader that
      did not send it;
    - a ``copy_`` from a sparse patch's staged tensor counts as the NaN-merge the contract
      asks for: only the elements whose source is not NaN are written and saved, as with
      patchkit's loader. A loader that instead copies the NaN into the model (it does not
      support sparse patches) is let finish, and then :class:`~patchkit.ContractViolation`
      (``reason="NaN copied"``) is raised with the report attached. A source built from
      a sparse patch by an op (``torch.cat``, a gather) counts the same way when it holds
      NaN. A loader that merges *before* its ``copy_`` (it replaces ``Tensor.copy_`` with
      a NaN-aware one, say) copies sources without NaN, which nothing tells from plain
      dense copies: its writes show as whole views written. A loader whose model mixes a
      sparse patch's elements before the copy (``w @ H``, a scale from the whole tensor:
      see :func:`~patchkit.load_checkpoint_weight_patches`, item 4) is let finish too,
      and then :class:`~patchkit.ContractViolation` (``reason="mixed elements"``, naming
      the op) is raised with the report attached: whatever its merge made of such data,
      the updates it carried are lost. So is a copy from a patch's bytes read as other
      numbers than they hold (``w.view(torch.int32).float()``, bytes moved by no whole
      number of elements), whose staged NaN the merge writes as numbers
      (``reason="reinterpreted source"``, as patchkit's own sparse call refuses it), and
      a copy from data whose NaN an op made numbers of (``w.nan_to_num()``), which the
      merge writes where the patch keeps with other bits than the model holds there
      (``reason="replaced NaN marks"``).

    Failures: if the load raises, the exception propagates unchanged with the partial
    report attached as ``exc.report`` (the writes made so far stay, unless
    ``transactional=True`` restored them). The report pickles with the exception, so a
    worker process's failed load reaches its parent as itself (see :class:`LoadReport`
    for what a pickled report keeps). Where making the report itself raises (out of
    memory) after a load that finished without ``transactional=True``, or after one that
    failed, that error propagates with no report, a note saying whether the load had
    finished (its writes stay) or failed, and the load's own error as its
    ``__context__``. (After a transactional load that finished, patchkit's loader rolls
    it back and raises that error with a report, as for a signal below.)

    Memory: see the module docstring (the bytes written, never the whole model).

    Signals, with ``transactional=True`` and patchkit's own loader (on the main thread;
    an observed ``loader=`` rolls back what it rolls back): from the load's end until
    the report is made, a signal's handler waits; one that raises then (Ctrl-C) rolls the
    load back, as during the load, and its exception carries the report, whose
    ``rolled_back`` is True. One that comes as the call returns, the report made, leaves
    the load standing, as one just after the call does.

    A dry run: a model made on the meta device (``with torch.device("meta"):``, to see
    where a big model's patches land without its memory; patches on the meta device, or
    real ones) gives a report of where each write landed (``chunks``, ``calls``,
    ``writes``, ``plot_placement``), not of what it changed, which no tensor there
    holds: see :attr:`LoadReport.dry_run`.

    A report holds references to its patches (their values and indices) and to the
    model's tensors for as long as it is kept, also after it was passed on as
    ``reuse=``: in a loop that keeps numbers for logging, keep ``report.deltas`` or
    ``report.summary()``, not the reports.

    ``reuse``: an earlier report whose before-values you no longer need (last step's, in
    a training loop: ``report = inspect_load(model, patches, reuse=report)``). Its save
    buffers are handed to this load, which writes its own saves into them where one fits
    (see :func:`patchkit.native.reusing`) instead of asking for fresh memory: the loop's
    memory stays flat, and a save skips the page faults of fresh memory (on the CPU, for a
    full replacement, about as long as the copy itself). The earlier report keeps its
    tables, numbers and figures, but its ``before()`` and ``written()`` (and so
    ``plot_delta``) raise ``ValueError`` from then on. Only the compiled CPU path reuses
    buffers, and only those that nothing else holds.

    ``progress``: ``True`` shows how far a long load is, one step per ``load_weights``
    call (a bar in a Jupyter kernel with ipywidgets, else a line on stderr: rewritten in
    place on a terminal; in a log, the final status, after a line every 10 s of a long
    load), once it has run half a second, so a short load shows nothing, and a display
    that fails (no stderr) stops showing without stopping the load; a callable is called
    with a :class:`~patchkit.LoadProgress` after every call instead (an exception it
    raises stops the load like the loader's own would; after a call that raised, it is
    told so, ``failed=True``, and what it raises then is added to the load's error as a
    note, not raised in its place). See :mod:`patchkit.progress`.

    ``validate_unique_indices`` and ``transactional`` must be ``True`` or ``False``, with
    ``loader=`` too (:class:`~patchkit.PatchTypeError` before anything is read or run).
    """
    check_progress(progress)
    check_flag(validate_unique_indices, "validate_unique_indices")
    check_flag(transactional, "transactional")
    if reuse is not None and not isinstance(reuse, LoadReport):
        raise PatchTypeError(f"reuse must be a LoadReport or None, got {type(reuse).__name__}",
                             reason="reuse type", value=type(reuse).__name__)
    if loader is not None and not callable(loader):
        raise PatchTypeError(
            "loader must be a callable of load_checkpoint_weight_patches' signature, or None; "
            f"got {type(loader).__name__}: {brief(loader)}",
            reason="loader type", value=loader,
        )
    if transactional and loader is not None and _takes_keyword(loader, "transactional") is False:
        raise PatchTypeError(
            f"transactional=True: the loader {_callable_name(loader)} takes no transactional "
            "argument (vLLM's does not), and patchkit cannot make another loader's load "
            "transactional; observe it without, or load with patchkit's own loader",
            reason="loader not transactional", value=_callable_name(loader),
        )
    if loader is not None:
        _check_loader_call(loader, transactional)
    refuse_model_class(model)
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "load_weights", None)):
        raise PatchTypeError(
            f"model {type(model).__name__} is not a torch.nn.Module with a "
            "load_weights(weights) method; the contract applies patches through the model's "
            "own checkpoint loader, and a report watches that module's tensors: give it one "
            f"that {LOAD_WEIGHTS_DOES}",
            reason="no load_weights", value=type(model).__name__,
        )
    if loader is not None:
        _check_wrappable(model)
    lent = reuse._hand_over() if reuse is not None else []
    # This frame is in a failed load's traceback, which its report keeps (``error``): a
    # reference to the earlier report here would keep it, its patches and its own failed
    # load's report alive, one more report per failed step of a loop that passes each on.
    del reuse
    # What the load runs in: the buffers lent for reuse, the collector paused. Closed
    # by _inspect_load once the report is made, before a transactional load's held
    # signals go (one raised in the closing of a ``with`` here, after the report was
    # made, would leave the load standing and give no report); else here.
    scope = contextlib.ExitStack()
    try:
        scope.enter_context(native.reusing(lent))
        # Python's cyclic collector paused for the load, as it was after (once no other
        # thread's watched load still runs): a report records a few objects per write (a
        # save, an event, the tensors they hold), and on a model of many small tensors
        # the collections they set off mid-load (a full one every few dozen loads, 100 ms
        # and more in a process that imported torch and pandas) cost more than the
        # writes; after the load, one collection of the young objects is due.
        scope.enter_context(collector_paused())
        del lent  # the pool holds them now: what the load does not take is freed after it
        return _inspect_load(model, patches, max_chunk_bytes, validate_unique_indices,
                             transactional, loader, progress, scope)
    finally:
        scope.close()


def _inspect_load(
    model, patches, max_chunk_bytes, validate_unique_indices, transactional, loader,
    progress, scope: contextlib.ExitStack,
) -> LoadReport:
    patches = [resolved(_as_patch(p)) for p in patch_list(patches)]
    # As an int, when valid; when not, the load below raises the error that names it.
    with contextlib.suppress(TypeError, ValueError):
        max_chunk_bytes = check_max_chunk_bytes(max_chunk_bytes)
    sessions: list[WriteSession] = []
    planned = None
    index = None
    try:
        # The load's index of the model (its session's, and the report's), built first:
        # it knows the tied parameters, so the module tree is walked once.
        index = RuntimeIndex(model)
        # (an observed loader warns of a dropped alias itself, where it drops one)
        kept, positions = _canonicalized(patches, index.tied_parameters, warn=loader is None)
        plan = plan_chunks(kept, max_chunk_bytes, positions=positions)
        planned = (kept, positions, plan)  # the load's own: planned once
    except Exception:  # bad input: the load below raises the error that names it
        kept, positions, plan = list(patches), list(range(len(patches))), []
    # (``is True``: a callable may be falsy, an empty list subclass say, and is still called)
    tracker = (Tracker(progress, [c.bytes for c in plan])
               if progress is True or callable(progress) else None)
    rec = _Recorder(tracker)
    error: BaseException | None = None
    loaded: set[str] = set()
    observed: list[Chunk] = []
    failed: list[tuple[int, set[str]]] = []  # (calls made, targets left) where one raised
    rollbacks_before = rollbacks()
    # A transactional load's signals wait from its end until its report is built: one
    # that comes meanwhile then rolls the load back (its saves are the report's), as
    # one during the load does (see _report_of).
    hold = contextlib.ExitStack()
    try:
        if loader is None:
            loaded = run_load(
                model,
                patches,
                max_chunk_bytes=max_chunk_bytes,
                validate_unique_indices=validate_unique_indices,
                transactional=transactional,
                recorder=rec,
                save_regions=True,
                session_out=sessions,
                planned=planned,
                index=index,
            )
            if transactional and sessions:  # (a load of no patches makes no session)
                hold.enter_context(_DEFERRAL.holding())
        else:
            # (``transactional`` only when asked for: vLLM's function has no such
            # argument, and inspect_load refused it above for a loader without one)
            loaded = _observe_foreign(
                model, patches, plan, rec, sessions, loader, observed, failed, index,
                max_chunk_bytes=max_chunk_bytes,
                validate_unique_indices=validate_unique_indices,
                **({"transactional": True} if transactional else {}),
            )
    except BaseException as exc:
        error = exc
        if tracker is not None and tracker.suppressed is not None:
            add_note(exc, "(the progress callback, told of the failed call, raised too: "
                     f"{type(tracker.suppressed).__name__}: {tracker.suppressed})")
    finally:
        for session in sessions:
            session.end_calls()  # (a call a signal left open: its modes go first)
        if tracker is not None:
            try:
                tracker.close(failed=error is not None)
            except BaseException:
                hold.close()  # (not left holding signals: a Ctrl-C would wait for good)
                raise
    if (error is not None and transactional and loader is None and rec.calls
            and not any(s.rolled_back for s in sessions)):
        # A signal after the load's last call, before the signals were held: roll back
        # as the load itself would have (what stops the rollback replaces the error).
        error, loaded = _late_rollback(sessions, error), set()
    report_of = functools.partial(
        _report_of, model, patches, transactional, loader, rec, sessions, kept, positions,
        plan, observed, failed, rollbacks_before, max_chunk_bytes, index)
    try:
        try:
            report = report_of(error=error, loaded=loaded)
        finally:
            scope.close()
            hold.close()  # (what waited is delivered here)
    except BaseException as late:
        if error is not None or not transactional or loader is not None or not sessions:
            if error is not None and late.__context__ is None:
                late.__context__ = error  # (shown first in the traceback, not lost)
            add_note(late, (
                "(raised while inspect_load made its report, after the load itself "
                + ("had finished: what it wrote stays in the model" if error is None
                   else f"had failed with {type(error).__name__}, this error's "
                   "__context__") + "; no report was made)"))
            raise
        # What a signal raised once the load had ended (a KeyboardInterrupt while the
        # report was made): the load is rolled back, and the report says so.
        error = _late_rollback(sessions, late)
        with _DEFERRAL.holding():
            report = report_of(error=error, loaded=set())
    if error is not None:
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


class _ViewedAs:
    """A tensor that pickles as its bits and its dtype, and unpickles as the tensor
    itself: torch's pickle writes float8, uint16/32/64, complex32 and the packed dtypes
    but cannot read them back ("UntypedStorage has no attribute 'dtype'", torch 2.13)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self):
        raw = self.t.detach().view(_INT_OF_SIZE[self.t.element_size()])
        return (_view_as, (raw, self.t.dtype))


def _view_as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return raw.view(dtype)


@functools.cache
def _pickles(dtype: torch.dtype) -> bool:
    """Whether torch's pickle rebuilds a tensor of ``dtype`` (tried once per dtype)."""
    try:
        pickle.loads(pickle.dumps(torch.zeros(8, dtype=torch.uint8).view(dtype)))
    except Exception:
        return False
    return True


def _picklable_patch(p: Any) -> Any:
    """``p`` with each tensor that views part of a larger storage copied out (torch's
    pickle writes a view's whole storage: a report of 1600 ``split_patch`` parts of one
    2 MiB tensor pickled to 1.6 GiB), and each of a dtype torch's pickle cannot rebuild
    wrapped in :class:`_ViewedAs` (a report of a float8 load pickled, then failed to
    unpickle)."""
    if not isinstance(p, CheckpointWeightPatch):
        return p
    fix = {}
    for f in ("values", "indices"):
        t = getattr(p, f)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        out = t
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            out = t.clone(memory_format=torch.contiguous_format)
        if t.element_size() in _INT_OF_SIZE and not _pickles(t.dtype):
            out = _ViewedAs(out)
        if out is not t:
            fix[f] = out
    return p._replace(**fix) if fix else p


def _late_rollback(sessions: list[WriteSession], error: BaseException) -> BaseException:
    """Roll back a transactional load that ended before ``error`` came (its saves are
    intact: a report keeps them); return the error to raise: ``error``, or what stopped
    the rollback."""
    (session,) = sessions
    try:
        with _DEFERRAL.holding():  # (a second Ctrl-C waits for the rollback)
            _roll_back(session, error)
    except BaseException as e:
        return e
    return error


def _names_into(events, kept: Callable[[str], bool]) -> set[str]:
    """The names a loader may have returned for writes into the targets ``kept`` keeps:
    each such write's patch name (a loader that returns checkpoint names) and the
    target's own name (one that returns runtime names, as vLLM's model loaders do:
    ``qkv_proj`` for ``q_proj``)."""
    hit = [e for e in events if kept(e.target)]
    return {e.name for e in hit} | {e.target for e in hit}


def _report_of(model, patches, transactional, loader, rec, sessions, kept, positions, plan,
               observed, failed, rollbacks_before, max_chunk_bytes, index, *,
               error: BaseException | None, loaded: set[str]) -> LoadReport:
    """The report of a load that ended (``error``: what it raised, or ``None``)."""
    rolled_back = (error is not None and transactional and loader is None
                   and any(s.rolled_back for s in sessions)
                   and not any(s.unrestored for s in sessions))
    restored: tuple[str, ...] = ()
    # Whether numbers measured while writing (the compiled path's) may count changes
    # that are gone, so the tensors are read again (see below)
    remeasure = False
    if error is not None and transactional and loader is None and any(
            s.rolled_back for s in sessions):
        # The rollback put back what the load wrote, but for the targets it could not.
        left = {t for s in sessions for t in s.unrestored}
        restored = _targets_outside(rec.events, left)
        # (an incomplete rollback keeps the saves of the targets it left, some of whose
        # regions it did write back)
        remeasure = bool(left)
    if error is not None and not rolled_back:
        # What the calls that returned before the failure reported loaded stays loaded;
        # after an incomplete rollback, only the names that wrote into a target it left.
        loaded = {n for c in rec.calls if not c["error"] and c["returned"] for n in c["returned"]}
        left = {t for s in sessions for t in s.unrestored}
        if left:
            loaded &= _names_into(rec.events, lambda t: t in left)
    if loader is not None and error is not None and rec.calls:
        # An observed loader may undo its writes itself (a transactional one) and raise:
        # what it left as written, compared with what its calls' own writes had left
        # when the last of them ended, says what it undid and what stayed loaded.
        saved = [s for session in sessions for s in session.saved]
        left = _left_as_written(saved)
        undone = _left_by_calls(rec.events, saved, failed, len(observed)) - left
        if (transactional and not left) or undone:
            # Every element back as before the load: read as patchkit's own rollback. Else
            # only the targets it undid lose their saves; one whose own writes put it
            # back keeps them, as after a failure without rollback.
            rolled_back = not left
            gone = ({e.target for e in rec.events} | {s.target for s in saved}
                    if rolled_back else undone)
            loaded &= _names_into(rec.events, lambda t: t not in gone)
            restored = tuple(t for t in _targets_outside(rec.events, set()) if t in gone)
            for session in sessions:  # (as patchkit's own rollback keeps them)
                session.saved = [r for r in session.saved if r.target not in gone]
    if remeasure or (loader is not None
                     and (error is not None or rollbacks() != rollbacks_before)):
        # An observed loader may have undone its writes unseen (patchkit's own loader with
        # transactional=True restores outside any interception, then raises, or returns
        # where its caller catches), and an incomplete rollback of our own left some
        # regions put back: numbers measured while writing would show changes that are
        # gone. Read the tensors again.
        for session in sessions:
            for saved in session.saved:
                saved.diff_stats = None
    for session in sessions:
        # A rollback (this load's own, or one it did not see) or the loader itself may
        # have bound original tensors again: those are no longer rebound.
        session.forget_undone_rebindings()
    # (a load refused before its first call may have been given items that are no patch)
    malformed = _malformed(patches) if error is not None and not rec.calls else {}
    sent_name = dict(zip(positions, (
        _given_name(p) if i in malformed else p.name for i, p in zip(positions, kept))))
    observed_calls = loader is not None and not _as_planned(
        observed, plan, complete=error is None)
    if observed_calls:
        # The observed loader chunked otherwise: the table shows the calls it made, under
        # the names it sent (what the plan would drop, a tied alias, it may have sent).
        plan = _reasons(observed, patches, max_chunk_bytes)
        sent_name = {p: n for c in plan for p, n in zip(c.positions, c.names) if p >= 0}
    try:
        with torch.no_grad():  # (statistics of tensors that require grad: no graphs)
            report = _build_report(
                model, patches, sent_name, observed_calls, plan, rec, sessions,
                max_chunk_bytes, loaded, error, index, own_loader=loader is None,
                malformed=malformed,
            )
    except Exception:
        if error is not None:
            raise error from None  # bad input: the load's own error says what is wrong
        raise
    report.rolled_back = rolled_back
    report._restored = restored
    return report


class ReportKeyError(KeyError):
    """The ``KeyError`` a :class:`LoadReport` raises for a name it does not know (a
    runtime tensor's, a patch's): catch ``KeyError``. Its message prints as written
    (``KeyError`` itself prints the repr of its argument: the message in quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _unknown_target(report: LoadReport, asked: str) -> ReportKeyError:
    """The ``KeyError`` for a runtime tensor name ``report`` does not know. A checkpoint
    name (a patch's: ``...k_proj.weight``, written into a fused ``qkv_proj``) is the
    likely mistake: the message then says which runtime tensors its writes went to."""
    hint = ""
    # (_given_name: a report of a load refused for a malformed item keeps that item)
    if any(_given_name(p) == asked for p in report.patches):
        try:
            writes = report.writes
            into = list(dict.fromkeys(writes["target"][writes["name"] == asked]))
        except Exception:  # (a report whose tables cannot be read: no hint, the error stands)
            into = []
        shown = ", ".join(map(quoted, into[:4])) + (", ..." if len(into) > 4 else "")
        hint = (f": it is a checkpoint name (a patch's), and its writes went to the runtime "
                f"tensor{'s' if len(into) > 1 else ''} {shown} (report.writes says where)"
                if into else ": it is a checkpoint name (a patch's), and the report saw no "
                "write of it")
    if not hint:
        known = ", ".join(map(quoted, list(report.targets)[:8]))
        hint = (f" (some are: {known})" if known else
                " (it knows none: the model had no parameters or buffers, or it was not "
                "made by a load)")
    return ReportKeyError(f"{quoted(asked)} is not a runtime tensor of this report{hint}")


def _check_target(target: object) -> None:
    """``TypeError`` unless ``target`` is a str (a runtime tensor's name), saying what it
    got (a list or a tensor would otherwise fail as ``unhashable type``)."""
    if not isinstance(target, str):
        raise TypeError(
            f"a runtime tensor is named by a str (as report.deltas.index and "
            f"report.writes['target'] list them), got {type(target).__name__}: {target!r}"[:300]
        )


def _targets_outside(events: Sequence[WriteEvent], left: set[str]) -> tuple[str, ...]:
    """The targets ``events`` wrote, in order, once each, but those in ``left`` (what a
    rollback put back: every target written but the ones it left as written)."""
    return tuple(dict.fromkeys(e.target for e in events if e.target not in left))


def _left_by_calls(events: Sequence[WriteEvent], saved: list[SavedRegion],
                   failed: list[tuple[int, set[str]]], calls: int) -> set[str]:
    """The targets the observed calls' own writes left changed when the last call ended:
    what :func:`_left_as_written` read then, where that call raised (``failed``'s last
    entry was taken after ``calls`` calls). Where it returned (the loader raised later),
    that was not read: every saved target a write changed counts as left changed (so a
    target whose own later write put its values back reads as undone by the loader)."""
    if failed and failed[-1][0] == calls:
        return failed[-1][1]
    return {e.target for e in events if e.changed} & {s.target for s in saved}


def _observe_foreign(
    model, patches, plan, rec, sessions, loader, observed, failed, index, **kwargs
) -> set[str]:
    """Run ``loader`` with ``model.load_weights`` wrapped to record each call; the calls,
    as :class:`Chunk` records with a provisional ``closed_by``, go to ``observed``. When a
    call raises, ``(calls made, targets its writes left changed)`` goes to ``failed``
    before the loader sees the error (and may undo writes unseen). ``index``: the model's
    :class:`~patchkit._runtime_index.RuntimeIndex`, where the caller built it (else ``None``).
    Where the load fails, the lists of the calls that raised (the copy of a call's list
    this wrapper passed on, and the entries it watched) are emptied before the error
    leaves it, as :func:`~patchkit.loader.run_load` empties its own: a kept error's
    traceback holds these frames, and through the lists every tensor staged for the
    call. (A call whose error the loader caught keeps its list while the load goes on.)"""
    session = WriteSession(model, save_regions=True, recorder=rec, count_changes=True,
                           index=index)
    raised: list[list] = []  # the lists of the calls that raised, emptied if the load fails
    session.index.refuse_wrappers("an inspected load")
    sessions.append(session)
    sent = _SentPositions(patches, session.index.aliases)
    # A call whose names match no patch (a loader that renames them) may carry a sparse
    # one: its copies are checked for NaN as well.
    any_sparse = any(getattr(p, "indices", None) is not None for p in patches)
    # Whether the calls so far sent what the plan's first calls send (_as_planned of
    # them), kept as they come: asking anew at each call made a load of many calls
    # quadratic.
    following = _as_planned(observed, plan)

    depth = 0  # this load's calls in progress (on this thread: the recorder's only one)

    def recording_load_weights(*args, **kwargs):
        nonlocal following, depth
        weights, weights_at = _weights_given(args, kwargs, weights_name)
        if depth or weights_at is None:
            # A call that the model's load_weights makes into itself is part of the
            # call it is made in (its writes are that call's, traced to the patches that
            # call was given); a call that gives no weights is the model's to refuse.
            return passed_on(*args, **kwargs)
        try:
            it = iter(weights)
        except TypeError:  # (not iterable: the model's own load_weights says what is wrong)
            return passed_on(*args, **kwargs)
        i = len(observed)
        staged = None  # (patchkit's copy of a list or tuple the call was given)
        if it is not weights:  # (a list, a tuple: what it holds is known now)
            staged = list(it)
            names = tuple(n for n, _ in staged)
            planned = (plan[i].positions if following and i < len(plan)
                       and plan[i].names == names else None)
            if planned is not None and not sent.ambiguous(names):
                pos = list(planned)
            else:  # (a call that follows the plan keeps its positions where staged agrees)
                pos = list(sent.match(names, [t for _, t in staged], planned))
            sent.mark(names, pos)
            # A loader outside the contract may send something else than a tensor (a
            # list, an array): the call is watched all the same, that entry counted as
            # no bytes and traced to no patch (the loader gets what it sent).
            watched = [(n, _watched(t)) for n, t in staged]
            given: Any = staged
        else:
            # An iterator (a generator that stages each patch as the model asks for it,
            # into one reused buffer, say): its entries are taken as the model takes
            # them, each recorded then; listing it first would hand the model every
            # entry as it is once the last was staged, and would run the loader's
            # staging of a call ahead of that call's writes.
            names, pos, watched = [], [], []
            on_plan = following and i < len(plan)

            def take(n: str, t: Any) -> None:
                nonlocal on_plan
                k = len(names)
                want = None
                if on_plan and k < len(plan[i].names) and plan[i].names[k] == n:
                    want = plan[i].positions[k]
                else:
                    on_plan = False
                if want is not None and not sent.ambiguous((n,)):
                    p = want
                    sent.mark((n,), (p,))
                else:
                    (p,) = sent.match((n,), (t,), None if want is None else (want,))
                names.append(n)
                pos.append(p)
                watched.append((n, _watched(t)))
                session.stage_more(p, n, watched[-1][1], patches[p] if p >= 0 else None)

            def entries() -> Iterator[Any]:
                for item in it:
                    if calls_open:  # (read after its call ended: passed on unrecorded)
                        n, t = item
                        take(n, t)
                    yield item

            calls_open = True
            given = entries()
        nbytes = sum(t.numel() * t.element_size() for _, t in watched)
        observed.append(Chunk(i, tuple(pos), tuple(names), nbytes, "end"))
        call_patches = [patches[p] if p >= 0 else None for p in pos]
        depth += 1
        try:
            with session.call(i, watched, pos, sparse=False, patches=call_patches,
                              maybe_sparse=any_sparse,
                              observed=True) as r:
                try:
                    a, kw = _with_weights(args, kwargs, weights_at, given)
                    out = passed_on(*a, **kw)
                finally:
                    if it is weights:  # (what the model took of the iterator)
                        calls_open = False
                        nbytes = sum(t.numel() * t.element_size() for _, t in watched)
                        observed[i] = Chunk(i, tuple(pos), tuple(names), nbytes, "end")
                if isinstance(out, collections.abc.Iterator):
                    out = list(out)  # a generator: run it while the writes are watched
                r.returned = _names(out, observed[i])
        except BaseException:
            # What the calls' own writes left (read once, on failure only): a target
            # whose values are back as before the load only because of the loader's
            # later writes is then no rollback of its own.
            with contextlib.suppress(Exception):
                failed.append((len(observed), _left_as_written(session.saved)))
            raised.extend(x for x in (staged, watched) if x is not None)
            raise
        finally:
            depth -= 1
            following = following and i < len(plan) and (
                plan[i].names == observed[i].names
                and plan[i].positions == observed[i].positions)
        return out

    passed_on, weights_name = _Observers.attach(model, recording_load_weights)
    try:
        with torch.no_grad():
            # (read inside the observation: a generator-function loader loads only while
            # it is iterated)
            loaded = _loader_names(loader(model, patches, **kwargs), loader)
        if session.violations:
            raise session.violations[0]  # the loader finished; what it broke is known now
        return loaded
    except BaseException:
        for entries_of_call in raised:
            entries_of_call.clear()
        raise
    finally:
        _Observers.detach(model, recording_load_weights)


def _watched(t: Any) -> torch.Tensor:
    """What an observed call's entry is watched as: the tensor, or for something else
    (a list, an array: a loader outside the contract) no tensor, counted as no bytes and
    traced to no patch (the model gets what was sent)."""
    return t if isinstance(t, torch.Tensor) else _NOT_A_TENSOR


def _weights_given(args: tuple, kwargs: dict[str, Any],
                   name: str | None) -> tuple[Any, int | str | None]:
    """The weights a ``load_weights`` call was given, and where: ``0`` (the first
    positional argument), the keyword it came as (``name``: the first parameter of the
    model's own ``load_weights``, where it has one a keyword can give), or ``None``
    where the call gives none (the model's own ``load_weights`` then says what is
    wrong)."""
    if args:
        return args[0], 0
    if name is not None and name in kwargs:
        return kwargs[name], name
    return None, None


def _with_weights(args: tuple, kwargs: dict[str, Any], at: int | str,
                  weights: Any) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of a call as it came, with ``weights`` where its weights were
    (``at``, as :func:`_weights_given` found it)."""
    if at == 0:
        return (weights, *args[1:]), kwargs
    return args, {**kwargs, at: weights}


def _loader_names(result: Any, loader: Callable[..., Any]) -> set[str]:
    """What an observed ``loader`` returned, as the set of names it loaded: ``None`` is no
    names; anything but an iterable of str (a str itself, a number) is refused, as
    :func:`~patchkit.loader._names` refuses it from ``load_weights`` (a str would
    otherwise be read as a set of its characters)."""
    if result is None:
        return set()
    names, shown, stray = _read_names(result)
    if names is not None:
        return names
    bad = stray[0] if stray else shown
    what = (f"{bad!r} ({type(bad).__name__}) among its names"[:80] if stray
            else f"{shown!r}"[:80])
    named = getattr(loader, "__name__", None)
    raise PatchTypeError(
        f"inspect_load's loader {(named if isinstance(named, str) else loader)!r} returned "
        f"{what} ({type(result).__name__}): a loader returns the names it loaded (an "
        "iterable of str, as load_checkpoint_weight_patches returns a set) or None; its "
        "writes stay",
        reason="loader returned",
        value=bad if isinstance(bad, int | float | str | bytes) else f"{bad!r}"[:80],
    )


class _Observers:
    """The observed loads of each model, by thread: while any runs, the model's
    ``load_weights`` is one dispatcher that passes a call to the recorder of the thread it
    is made on (the innermost, where an observed load runs inside another on the same
    thread), and a call from a thread observing nothing (another thread's own load, or a
    worker thread of the loader's) to what ``load_weights`` was before, unwatched, as that
    thread's writes are. The last observed load to end puts ``load_weights`` back as it
    was (an instance attribute, or none). One model's observed loads on two threads each
    see only their own calls; stacking a wrapper per load let one thread's calls into the
    other's report, and let the first to end remove the other's wrapper, which the
    other then put back for good."""

    _lock = threading.Lock()
    _by_model: ClassVar[dict[int, _Observers]] = {}

    def __init__(self, model: torch.nn.Module) -> None:
        self.had_attr = "load_weights" in vars(model)
        self.attr = vars(model).get("load_weights")
        self.bare = model.load_weights
        # The keyword its weights may come as (a call ``load_weights(weights=...)``):
        # its first parameter's name, where a keyword can give it.
        self.weights_name = _first_keyword(self.bare)
        self.stacks: dict[int, list[Callable[..., Any]]] = {}
        stacks, bare = self.stacks, self.bare

        def load_weights(*args: Any, **kwargs: Any) -> Any:
            stack = stacks.get(threading.get_ident())
            return (stack[-1] if stack else bare)(*args, **kwargs)

        self.dispatch = load_weights

    @classmethod
    def attach(cls, model: torch.nn.Module,
               recorder: Callable[..., Any]) -> tuple[Callable[..., Any], str | None]:
        """Route this thread's ``load_weights`` calls on ``model`` to ``recorder``; returns
        what the recorder passes each call on to (the recorder of an observed load this
        one runs inside, on this thread, else the model's own ``load_weights``), and the
        keyword the model's own ``load_weights`` takes its weights as (``None``: none)."""
        with cls._lock:
            entry = cls._by_model.get(id(model))
            if entry is None:
                entry = cls._by_model[id(model)] = cls(model)
                model.load_weights = entry.dispatch
            stack = entry.stacks.setdefault(threading.get_ident(), [])
            below = stack[-1] if stack else entry.bare
            stack.append(recorder)
            return below, entry.weights_name

    @classmethod
    def detach(cls, model: torch.nn.Module, recorder: Callable[..., Any]) -> None:
        with cls._lock:
            entry = cls._by_model[id(model)]
            tid = threading.get_ident()
            stack = entry.stacks[tid]
            stack.remove(recorder)
            if not stack:
                del entry.stacks[tid]
            if entry.stacks:
                return
            del cls._by_model[id(model)]
            if entry.had_attr:
                model.load_weights = entry.attr
            else:
                with contextlib.suppress(AttributeError):
                    del model.load_weights


def _first_keyword(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s first parameter where a call may give it by keyword, else
    ``None`` (positional only, ``*args``, or a signature that cannot be read)."""
    try:
        first = next(iter(_pyinspect.signature(fn).parameters.values()), None)
    except (TypeError, ValueError):
        return None
    return first.name if first is not None and first.kind is first.POSITIONAL_OR_KEYWORD else None


def _as_planned(calls: list[Chunk], plan: list[Chunk], complete: bool = False) -> bool:
    """True when ``calls`` sent what the first calls of ``plan`` send (the same names from
    the same positions); with ``complete``, every call of the plan."""
    if len(calls) > len(plan) or (complete and len(calls) != len(plan)):
        return False
    return all(c.names == p.names and c.positions == p.positions for c, p in zip(calls, plan))


class _SentPositions:
    """Which input positions an observed loader's calls sent, matched by name.

    A sent name is the first patch not sent yet of that name or, for a tied tensor, of
    any of its names (a loader renames an alias to its first name, CONTRACT §6, so a
    patch for ``head`` arrives as ``embed``). Where patches of two names of one tied
    tensor both wait, the staged tensor tells which was sent: first the one whose own
    storage it is (a dense patch's values viewed as its shape, as CONTRACT §3 stages
    them), else one whose values it holds bit for bit (a sparse patch's at its indices);
    among equals (two patches of equal values, or none held: a loader that transformed
    them), the one the plan sends there when the call follows the plan, else the first
    in input order. A name sent again once all its patches were sent is the position it
    was sent from last; a name no patch has, -1.
    """

    def __init__(self, patches: Sequence[CheckpointWeightPatch],
                 aliases: dict[str, str] | None = None) -> None:
        self._patches = patches
        self._first = dict(aliases or {})  # tied alias -> the tensor's first name
        self._unsent: dict[str, collections.deque[int]] = {}
        # a tensor's first name -> the names its patches use (two or more: a tied tensor
        # patched under several of its names)
        self._names: dict[str, list[str]] = {}
        for i, p in enumerate(patches):
            name = _given_name(p)  # (None, which no call sends, for an item with no name)
            if name not in self._unsent:
                first = self._first.get(name, name)
                self._names.setdefault(first, []).append(name)
            self._unsent.setdefault(name, collections.deque()).append(i)
        self._taken: set[int] = set()
        self._last: dict[str, int] = {}

    def ambiguous(self, names: Sequence[str]) -> bool:
        """True when one of ``names`` names a tied tensor whose patches use more than one
        of its names: which of them a call sent is then not told by its names alone (the
        plan drops an alias patched with its first name; a loader may send both)."""
        return any(len(self._names.get(self._first.get(n, n), ())) > 1 for n in names)

    def match(self, names: Sequence[str], staged: Sequence[Any] | None = None,
              planned: Sequence[int] | None = None) -> tuple[int, ...]:
        """The positions of one call's ``names`` (marked sent as they are matched);
        ``staged``: the tensors sent with them, which tell the patches of a tied tensor's
        names apart; ``planned``: the positions the plan sends these names from, for a
        call that follows the plan (preferred where ``staged`` does not tell)."""
        out = []
        for k, n in enumerate(names):
            waiting = []
            for m in self._names.get(self._first.get(n, n), [n]):
                queue = self._unsent.get(m)
                while queue and queue[0] in self._taken:
                    queue.popleft()  # sent already (a call that followed the plan)
                if queue:
                    waiting.append(queue[0])
            waiting.sort()
            if len(waiting) > 1:
                want = planned[k] if planned is not None else -1
                held = ([_holds(staged[k], self._patches[i]) for i in waiting]
                        if staged is not None else [0] * len(waiting))
                # the most surely held; among equals the planned one, then input order
                pos = max(zip(held, (i == want for i in waiting), (-i for i in waiting)))
                pos = -pos[2]
            else:
                pos = waiting[0] if waiting else self._last.get(n, -1)
            self.mark((n,), (pos,))
            out.append(pos)
        return tuple(out)

    def mark(self, names: Sequence[str], positions: Sequence[int]) -> None:
        """Record that ``names`` were sent from ``positions``."""
        for n, p in zip(names, positions):
            if p >= 0:
                self._taken.add(p)
            self._last[n] = p


_NOT_A_TENSOR = torch.empty(0)  # (what an observed call's non-tensor entry is watched as)


def _holds(staged: Any, p: CheckpointWeightPatch) -> int:
    """How surely ``staged`` is what CONTRACT §3 stages for ``p``: 2 when it is a dense
    patch's own storage (its values viewed as its shape), 1 when it holds the patch's
    values bit for bit (a dense patch's everywhere, a sparse patch's at its indices,
    compared there only), 0 when not: a tensor of another shape or dtype, or one it
    cannot compare."""
    if not isinstance(staged, torch.Tensor) or not isinstance(p.values, torch.Tensor):
        return 0
    try:
        if tuple(staged.shape) != tuple(int(d) for d in p.shape) or staged.dtype != p.dtype:
            return 0
        values = p.values if p.values.dtype == p.dtype else p.values.to(p.dtype)
        if p.indices is None:
            if (values is p.values and staged.device == values.device
                    and staged.data_ptr() == values.data_ptr()
                    and staged.is_contiguous() and values.is_contiguous()):
                return 2  # (same dtype, shape's numel and start: the very same elements)
            same = torch.equal(bits(staged.reshape(-1)),
                               bits(values.reshape(-1).to(staged.device)))
        else:
            idx = p.indices.to(device=staged.device, dtype=torch.int64)
            same = torch.equal(bits(staged.reshape(-1)[idx]), bits(values.to(staged.device)))
        return 1 if same else 0
    except (RuntimeError, TypeError, ValueError):
        return 0


def _reasons(calls: list[Chunk], patches, max_chunk_bytes: int) -> list[Chunk]:
    """Observed calls with ``closed_by`` inferred by the contract's rules (CONTRACT §2):
    ``repeated name`` when the next call starts with a name this one holds, ``budget``
    when this call plus the next call's first patch would pass ``max_chunk_bytes``,
    ``end`` for the last call, else ``loader`` (the loader's own reason)."""
    out = []
    for k, c in enumerate(calls):
        reason = "end"
        if k + 1 < len(calls) and calls[k + 1].names:
            nxt = calls[k + 1]
            first = nxt.positions[0]
            first_bytes = staged_nbytes(patches[first]) if first >= 0 else 0
            if nxt.names[0] in c.names:
                reason = "repeated name"
            elif c.bytes + first_bytes > max_chunk_bytes:
                reason = "budget"
            else:
                reason = "loader"
        out.append(Chunk(c.index, c.positions, c.names, c.bytes, reason,
                         over_budget=len(c.positions) == 1 and c.bytes > max_chunk_bytes))
    return out


def _left_as_written(saved: list[SavedRegion]) -> set[str]:
    """The targets of ``saved`` (in the order saved) where an element a write saved does
    not hold its value from before the load now, bit for bit: where saves overlap, an
    element's value before the load is its oldest save's. Reads each saved element once
    (one host wait per save on a GPU); only where that finds a difference are overlapping
    saves told apart, with a second pass over them (one sort of the storage offsets of
    each storage's saves: O(n log n) in the saved elements, however many saves). Reads
    under ``torch.no_grad()``: a saved view a loader took of a parameter under
    ``no_grad`` (``param[:2]``) and wrote in place cannot be viewed again with grad mode
    on (torch raises)."""
    with torch.no_grad():
        return _left_as_written_now(saved)


def _left_as_written_now(saved: list[SavedRegion]) -> set[str]:
    if all(s.changed_now() == 0 for s in saved):
        return set()
    left: set[str] = set()
    groups: dict[tuple, list[SavedRegion]] = {}  # the saves of each storage (and dtype)
    for s in saved:
        groups.setdefault((s.region.key, s.view.dtype), []).append(s)
    for group in groups.values():
        differs = [per_element(bits(s.current()) != bits(s.flat_before()),
                               s.before.is_complex()) for s in group]
        if len(group) == 1:
            if bool(differs[0].any()):
                left.add(group[0].target)
            continue
        # Where saves overlap, an element's oldest save holds its value from before the
        # load: one stable sort of all their storage offsets finds each element's first
        # save (testing each save against the offsets of all before it took a pass over
        # those per save: seconds for a thousand rows of one tensor written one by one).
        index = torch.cat([s.storage_index() for s in group])
        differ = torch.cat([d.to(index.device) for d in differs])
        owner = torch.repeat_interleave(
            torch.arange(len(group), device=index.device),
            torch.tensor([d.numel() for d in differs], device=index.device))
        ordered, order = torch.sort(index, stable=True)
        oldest = torch.ones_like(ordered, dtype=torch.bool)
        oldest[1:] = ordered[1:] != ordered[:-1]
        first = order[oldest]  # each element's first place in the saves, in save order
        for k in owner[first[differ[first]]].unique().tolist():
            left.add(group[k].target)
    return left


def _rebuilt(t: torch.Tensor, saved: list[SavedRegion]) -> torch.Tensor:
    """``t`` as it was before the load (a contiguous CPU copy): its values now with the
    saved elements of its storage put back, newest first (so the oldest win). Memory
    beyond the copy: see :func:`_put_back`."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    _put_back(out.view(-1), t, _sharing(saved, t)[::-1])
    return out


def _put_back(flat: torch.Tensor, t: torch.Tensor, saves: Sequence[SavedRegion]) -> None:
    """Write the saved values of ``saves`` (saves in ``t``'s storage) that lie in ``t``
    into ``flat``, ``t``'s elements in row-major order (1-D, contiguous, any device), in
    the order given: where saves overlap, the last one's value stays.

    A view saved whole is addressed as a :class:`_Box` of ``t`` where it is one (a
    contiguous ``t``): O(its elements) work and no index. The other saves (compact ones,
    NaN-merges) go through their storage offsets, 8 bytes per saved element (in
    proportion to what the load changed); so does every save of a ``t`` that is not
    contiguous, a view saved whole included (8 bytes per element of the view, and a
    sorted copy of ``t``'s offsets: see :func:`_positions`)."""
    raw = _raw(flat)
    memo: dict = {}
    for s in saves:
        box = _box_of(s.view, t) if _saved_whole(s) else None
        if box is not None:
            # (saved in the dtype of the view written: read as ``t``'s, as the statistics do)
            box.put(raw, box.take(_raw(_as_dtype_of(s.before, t))))
            continue
        pos, valid = _positions(t, s.storage_index(), memo)
        # (masked as bits: a packed dtype such as float4_e2m1fn_x2 has no index kernel)
        values = _raw(_as_dtype_of(s.flat_before(), t))[valid]
        raw[pos.to(flat.device)] = values.to(flat.device)


def _mark_written(mask: torch.Tensor, t: torch.Tensor, saves: Sequence[SavedRegion]) -> None:
    """Set ``mask`` (bool, ``t``'s elements in row-major order, 1-D, any device) True at
    every element of ``t`` that the writes of ``saves`` wrote. A view written whole (a
    dense write) is filled as a :class:`_Box` of ``t`` where it is one, with no index;
    the rest through storage offsets, as :func:`_put_back` reads them."""
    memo: dict = {}
    for s in saves:
        box = _box_of(s.view, t) if _wrote_view(s) else None
        if box is not None:
            box.fill(mask)
            continue
        pos, _ = _positions(t, s.written_index(), memo)
        mask[pos.to(mask.device)] = True


def _saved_whole(s: SavedRegion) -> bool:
    """Whether ``s`` saved its whole view (its values only, no offsets kept)."""
    return s.index is None and s.positions is None


def _wrote_view(s: SavedRegion) -> bool:
    """Whether the write of ``s`` wrote its whole view (a dense write)."""
    return s.whole_view or _saved_whole(s)


class _BeforeAfter:
    """A runtime tensor before and after the load, and where the load wrote it, read a
    range of its elements (in row-major order) at a time: :meth:`read` gives the values
    ``before(target)``, ``after(target)`` and ``written(target)`` give there, bit for
    bit, without a copy of the whole tensor.

    Memory: for a contiguous tensor, nothing per element for a view saved or written
    whole (a dense write: a block of rows or columns, every other row, a transposed
    view, a part of a flat storage shared with other tensors), whose elements a read
    finds by arithmetic (see :class:`_Box`); 8 bytes per element for the positions of the
    elements saved or written otherwise (a compact save, a NaN-merge: in proportion to
    what the load changed, kept sorted). A tensor that is not contiguous is read from a
    contiguous CPU copy of it, and then every save and write costs its positions, whole
    views included. On another device than the CPU it keeps a CPU copy of the saved
    values (what the load wrote, in proportion). ``before_shape`` / ``before_dtype`` and
    ``shape`` / ``dtype`` are the tensor's before and after the load (they differ only
    for a tensor a call rebound to another; :meth:`read` then means nothing).
    """

    def __init__(self, old: torch.Tensor, now: torch.Tensor, saved: Sequence[SavedRegion],
                 whole: bool) -> None:
        self.shape, self.dtype = tuple(now.shape), now.dtype
        self.before_shape, self.before_dtype = tuple(old.shape), old.dtype
        self._now = _flat_view(now)
        self._old = self._now if old is now else _flat_view(old)
        mine = _sharing(saved, old)
        memo_old: dict = {}  # (see _positions; ``now`` has its own where it is another)
        memo_now = memo_old if old is now else {}
        runs = {id(s): _saved_run(old, s, memo_old) for s in mine}
        # the saves to put back, in the order _rebuilt puts them (the oldest last)
        self._saves = _runs([runs[id(s)] for s in reversed(mine)])
        self._written: list[_Run] | None = None
        if not whole:
            written = []
            for s in _sharing(saved, now):
                run = runs.get(id(s)) if old is now and not s.whole_view else None
                # (where a save holds exactly what its write wrote: the same positions)
                written.append(_written_run(now, s, memo_now) if run is None or run[1] is None
                               else (None, run[1], None))
            self._written = [(b, torch.unique_consecutive(p), e) if p is not None
                             else (b, p, e) for b, p, e in _runs(written)]
        # where each run's elements lie, so that a read visits only the runs that meet its
        # range (visiting every run per read made reading a tensor written row by row
        # quadratic in its rows)
        self._saves_at = _extents(self._saves)
        self._written_at = _extents(self._written) if self._written is not None else None

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(before, after, written)`` of elements ``[lo, hi)``: ``before`` and
        ``after`` as 1-D CPU tensors of the tensor's dtypes (``after`` may be a view of
        the tensor itself: read it, never write it), ``written`` the positions in
        ``[0, hi - lo)`` of the elements the load wrote (int64, increasing), ``None``
        where it wrote them all. Scratch: O(hi - lo)."""
        after = self._now[lo:hi].to("cpu")
        before = self._old[lo:hi].to("cpu", copy=True)
        flat = _raw(before)
        for k in _meeting(self._saves_at, lo, hi):
            box, pos, values = self._saves[k]
            if box is not None:
                box.put(flat, values, lo)
            else:
                a, b = _between(pos, lo, hi)
                flat[pos[a:b] - lo] = values[a:b]
        if self._written is None:
            return before, after, None
        boxes, parts = [], []
        for k in _meeting(self._written_at, lo, hi):
            box, pos, _ = self._written[k]
            if box is not None:
                n = box.count(lo, hi)
                if n == hi - lo:
                    return before, after, None
                if n:
                    boxes.append(box)
            else:
                a, b = _between(pos, lo, hi)
                if a < b:
                    parts.append(pos[a:b] - lo)
        if not boxes and len(parts) == 1:
            return before, after, parts[0]
        mask = np.zeros(hi - lo, dtype=bool)
        for box in boxes:
            box.fill(torch.from_numpy(mask), lo)  # (the same memory)
        for part in parts:
            mask[part.numpy()] = True
        return before, after, torch.from_numpy(np.flatnonzero(mask))


def _extents(runs: Sequence[_Run]) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)``: the first position of each run's elements and one past its last
    (``0, 0`` for a run of none), for :func:`_meeting`."""
    starts = np.zeros(len(runs), dtype=np.int64)
    ends = np.zeros(len(runs), dtype=np.int64)
    for k, (box, pos, _) in enumerate(runs):
        if box is not None:
            starts[k], ends[k] = box.offset, box.end
        elif pos.numel():
            starts[k], ends[k] = int(pos[0]), int(pos[-1]) + 1
    return starts, ends


def _meeting(extents: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> list[int]:
    """The indices, in order, of the runs whose :func:`_extents` meet positions
    ``[lo, hi)``: the others hold no element there."""
    starts, ends = extents
    return np.flatnonzero((starts < hi) & (ends > lo)).tolist()


def _between(pos: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
    """``(a, b)``: ``pos[a:b]`` are the entries of sorted ``pos`` in ``[lo, hi)``."""
    ends = torch.tensor([lo, hi], dtype=pos.dtype, device=pos.device)
    a, b = torch.searchsorted(pos, ends).tolist()
    return a, b


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order, 1-D: a view of a contiguous tensor (on any
    device), else a contiguous CPU copy."""
    t = t.detach()
    return t.reshape(-1) if t.is_contiguous() else t.to("cpu").contiguous().reshape(-1)


def _raw(x: torch.Tensor) -> torch.Tensor:
    """``x`` as integers of its width (:func:`~patchkit.bitwise.bits`: copies move its
    bits unchanged), a complex tensor as it is (its elements have no integer of their
    width; a copy within one dtype moves them unchanged as well)."""
    return x if x.is_complex() else bits(x)


class _Box:
    """Where the elements of a view (saved or written whole) lie in a contiguous tensor
    ``t`` of the same storage and element size, with no index: in a flat buffer laid out
    like ``t`` (position ``k``: ``t``'s element ``k`` in row-major order) they are
    ``buf.as_strided(shape, stride, offset)``, and :meth:`take` arranges a tensor shaped
    like the view (its saved values, or the view itself) in the same order.

    The dimensions run from the largest stride down, each stride past the reach of the
    dimensions inside it, so that positions grow in the box's row-major order: its
    elements in a range of positions are at most two boxes per dimension, found by
    arithmetic (:meth:`pieces`). Made by :func:`_box_of`; every method costs O(1) memory
    besides what it is given, and O(elements it touches) work."""

    __slots__ = ("_cut", "_keep", "_order", "_view_shape", "end", "offset", "shape", "stride")

    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...], offset: int, *,
                 cut: tuple[int, int] | None = None, order: tuple[int, ...] = (),
                 view_shape: tuple[int, ...] = ()) -> None:
        self.shape, self.stride, self.offset = shape, stride, offset
        # one past the last position (``offset`` when empty)
        self.end = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(
            shape) else offset
        self._cut = cut  # a contiguous view: its flat elements [lo, hi) are the box
        self._view_shape = view_shape
        keep = [d for d, n in enumerate(view_shape) if n > 1]
        self._keep = tuple(slice(None) if n > 1 else 0 for n in view_shape)
        self._order = tuple(keep.index(d) for d in order)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, a tensor of the view's shape (or its elements, 1-D), arranged as the box:
        a view of ``x`` (no copy where ``x`` is the view or its contiguous save)."""
        if self._cut is not None:
            lo, hi = self._cut
            return x.reshape(-1)[lo:hi]
        return x.reshape(self._view_shape)[self._keep].permute(self._order)

    def _below(self, x: int) -> int:
        """How many of the box's elements lie at positions below ``x``."""
        x -= self.offset
        count, last = 0, len(self.shape) - 1
        for k, (n, st) in enumerate(zip(self.shape, self.stride)):
            if x <= 0:
                break
            q = min(n, -(-x // st))  # indices along k that start below x
            if k == last:
                return count + q
            count += (q - 1) * math.prod(self.shape[k + 1:])
            x -= (q - 1) * st
        return count

    def count(self, lo: int, hi: int) -> int:
        """How many of the box's elements lie at positions ``[lo, hi)``."""
        if hi <= self.offset or lo >= self.end:
            return 0
        return self._below(hi) - self._below(lo)

    def pieces(self, lo: int, hi: int) -> list[tuple[tuple[slice, ...], tuple[int, ...], int]]:
        """``(index, shape, position)`` of the boxes that together hold the box's elements
        at positions ``[lo, hi)``: ``take(x)[index]`` are their values, ``shape`` their
        shape (strides: the box's), ``position`` that of their first element."""
        if hi <= self.offset or lo >= self.end:
            return []
        out = []
        for index in _box_slices(self.shape, self._below(lo), self._below(hi)):
            at = self.offset + sum(i.start * st for i, st in zip(index, self.stride))
            out.append((index, tuple(i.stop - i.start for i in index), at))
        return out

    def put(self, buf: torch.Tensor, values: torch.Tensor, lo: int = 0) -> None:
        """Copy ``values`` (arranged as the box, any device) into 1-D contiguous ``buf``,
        which holds positions ``[lo, lo + len(buf))``: the box's elements there."""
        for index, shape, at in self.pieces(lo, lo + buf.numel()):
            _at(buf, shape, self.stride, at - lo).copy_(values[index])

    def fill(self, mask: torch.Tensor, lo: int = 0) -> None:
        """Set True the box's elements in bool ``mask``, laid out as :meth:`put`'s ``buf``."""
        for _, shape, at in self.pieces(lo, lo + mask.numel()):
            _at(mask, shape, self.stride, at - lo).fill_(True)


def _at(buf: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], k: int) -> torch.Tensor:
    """The elements of 1-D contiguous ``buf`` at ``shape`` / ``stride`` from its ``k``-th."""
    return buf.as_strided(shape, stride, buf.storage_offset() + k)


def _box_of(view: torch.Tensor, t: torch.Tensor) -> _Box | None:
    """The elements of ``view`` that lie in ``t`` as a :class:`_Box`, where no index is
    needed: ``t`` contiguous, and ``view`` either contiguous (cut to ``t``'s elements:
    a write over ``t`` and its neighbours in one flat storage gives ``t``'s part, maybe
    none), or lying wholly in ``t`` with strides that never make two elements meet or
    cross (a block of columns, every other row, a transposed view: what a write can be
    given). A view whose extent misses ``t``'s (of any ``t``) gives an empty box. ``None``
    otherwise. ``view`` must share ``t``'s storage and element size."""
    off = view.storage_offset() - t.storage_offset()
    if not view.numel() or off + _reach(view) < 0 or off > _reach(t) or not t.numel():
        return _Box((0,), (1,), 0, cut=(0, 0))  # no element of view lies in t
    if not t.is_contiguous():
        return None
    n = t.numel()
    if view.is_contiguous():
        lo = max(off, 0)
        hi = max(lo, min(off + view.numel(), n))
        return _Box((hi - lo,), (1,), lo, cut=(lo - off, hi - off))
    dims = sorted((d for d in range(view.dim()) if view.shape[d] > 1), key=view.stride,
                  reverse=True)
    shape = tuple(view.shape[d] for d in dims)
    stride = tuple(view.stride(d) for d in dims)
    reach = 0  # of the dimensions inside the one at hand
    for size, st in zip(reversed(shape), reversed(stride)):
        if st <= reach:
            return None
        reach += (size - 1) * st
    if off < 0 or off + reach >= n:
        return None
    return _Box(shape, stride, off, order=tuple(dims), view_shape=tuple(view.shape))


def _reach(x: torch.Tensor) -> int:
    """How far past its first element the last element of ``x`` lies in its storage."""
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride()))


def _box_slices(shape: tuple[int, ...], i0: int, i1: int) -> list[tuple[slice, ...]]:
    """Indices of the boxes that together hold the elements at row-major positions
    ``[i0, i1)`` of a box of ``shape``, in order: at most two per dimension."""
    if i0 >= i1:
        return []
    if len(shape) == 1:
        return [(slice(i0, i1),)]
    inner = math.prod(shape[1:])
    a, ra = divmod(i0, inner)
    b, rb = divmod(i1, inner)
    if a == b:
        return [(slice(a, a + 1), *rest) for rest in _box_slices(shape[1:], ra, rb)]
    out = []
    if ra:
        out += [(slice(a, a + 1), *rest) for rest in _box_slices(shape[1:], ra, inner)]
        a += 1
    if a < b:
        out.append((slice(a, b), *(slice(0, n) for n in shape[1:])))
    if rb:
        out += [(slice(b, b + 1), *rest) for rest in _box_slices(shape[1:], 0, rb)]
    return out


def _flat_range(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``x.reshape(-1)[lo:hi]`` (a copy of those elements alone, for a strided ``x``)."""
    parts = [x[index].reshape(-1) for index in _box_slices(tuple(x.shape), lo, hi)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# Elements of one tensor, as _BeforeAfter keeps them: ``(box, None, x)`` for the elements
# of a :class:`_Box` (``x``: their saved bits, arranged as :meth:`_Box.take` arranges
# them, or ``None``), or ``(None, positions, x)`` for the elements at sorted
# ``positions`` (``x``: their saved bits, or ``None``).
_Run = tuple["_Box | None", "torch.Tensor | None", "torch.Tensor | None"]


def _saved_run(t: torch.Tensor, s: SavedRegion, memo: dict | None = None) -> _Run:
    """The elements of ``t`` that save ``s`` holds, with their saved bits (CPU);
    ``memo``: see :func:`_positions`."""
    box = _box_of(s.view, t) if _saved_whole(s) else None
    if box is not None:
        return box, None, box.take(_raw(_as_dtype_of(s.before, t))).cpu()
    pos, valid = _positions(t, s.storage_index(), memo)
    values = s.flat_before()
    if not bool(valid.all()):
        values = values[valid]
    return _sorted_run(pos, _raw(_as_dtype_of(values, t)))


def _written_run(t: torch.Tensor, s: SavedRegion, memo: dict | None = None) -> _Run:
    """The elements of ``t`` that the write of save ``s`` wrote; ``memo``: see
    :func:`_positions`."""
    box = _box_of(s.view, t) if _wrote_view(s) else None
    if box is not None:
        return box, None, None
    pos, _ = _positions(t, s.written_index(), memo)
    return _sorted_run(pos, None)


def _sorted_run(pos: torch.Tensor, values: torch.Tensor | None) -> _Run:
    pos = pos.cpu()
    values = values.cpu() if values is not None else None
    if pos.numel() > 1 and not bool((pos[1:] >= pos[:-1]).all()):
        pos, order = torch.sort(pos, stable=True)
        values = values[order] if values is not None else None
    return None, pos, values


def _runs(runs: list[_Run]) -> list[_Run]:
    """``runs`` with each stretch of consecutive runs at positions merged into one (what
    putting them in order would leave: where two give one position, the later's bits),
    so that a read looks up one."""
    out: list[_Run] = []
    group: list[_Run] = []

    def flush() -> None:
        if len(group) == 1:
            out.append(group[0])
        elif group:
            pos = torch.cat([p for _, p, _ in group])
            if group[0][2] is None:
                out.append((None, pos.sort().values, None))
            else:
                values = torch.cat([v for _, _, v in group])
                pos, order = torch.sort(pos, stable=True)
                values = values[order]
                last = torch.ones_like(pos, dtype=torch.bool)  # the last of equal positions
                last[:-1] = pos[1:] != pos[:-1]
                out.append((None, pos[last], values[last]))
        group.clear()

    for run in runs:
        if run[1] is None:
            flush()
            out.append(run)
        else:
            group.append(run)
    flush()
    return out


def _rebound_row(name: str, old: torch.Tensor, now: torch.Tensor,
                 saved: list[SavedRegion]) -> dict[str, Any]:
    """The ``deltas`` row of a runtime tensor a dense call rebound or registered anew:
    written whole, compared with the original tensor's values before the load."""
    acc = _Stats()
    acc.elements = now.numel()
    if old.shape != now.shape or old.dtype != now.dtype:
        acc.changed = now.numel()  # another tensor altogether: no element-wise numbers
        row = acc.row(name)
        row.update(max_abs=math.nan, mean_abs=math.nan, rel_l2=math.nan)
        return row
    before = _rebuilt(old, saved).reshape(-1)
    acc.add_pairs(before, now.detach().cpu().reshape(-1))
    acc.add_squares(before)
    return acc.row(name)


def _build_report(
    model, patches, sent_name, observed_calls, plan, rec, sessions, max_chunk_bytes, loaded,
    error, index=None, own_loader=False, malformed=None,
) -> LoadReport:
    # (``index``: the load's, built before it ran, where building one did not fail;
    # ``own_loader``: patchkit's loader ran, which touches no module tree after its last
    # call but to put it back as the index found it)
    index = sessions[0].index if sessions else index
    if index is None and isinstance(model, torch.nn.Module):
        index = RuntimeIndex(model)  # no session (an empty or rejected load): the targets
    runtime = dict(index.tensors) if index is not None else {}
    session = sessions[0] if sessions else None
    saved = session.saved if session is not None else []
    rebound = dict(session.rebound) if session is not None else {}
    originals = {n: session._bindings[n] for n in rebound}
    runtime.update(rebound)
    registered = {n: t.data for n, t in session.registered.items()} if session is not None else {}
    runtime.update(registered)
    # Tied names: an alias the load untied (a new tensor under it) names a tensor of its
    # own; a known tensor the load tied under a new name is one more alias.
    aliases = dict(index.aliases) if index is not None else {}
    for a in rebound:
        aliases.pop(a, None)
    if session is not None:
        aliases.update(session.ties)
    removed: tuple[str, ...] = ()
    heirs: dict[str, str] = {}  # first name -> the alias that holds its original tensor now
    if index is not None:
        # (nothing to walk when empty; one look when the tree is as the index found it,
        # none where the session's look after patchkit's last call found it so)
        looked = own_loader and session is not None and session.tree_as_found
        gone = ([] if looked or index.unchanged()
                else index.replaced() + index.replaced_aliases())
        if gone:
            now = dict(named_tensors(model))
            removed = tuple(n for n in gone if n not in now)
            # A first name registered anew, or removed, while an alias still holds the
            # original tensor: that alias is the tensor's name now (and its other
            # aliases are tied to it).
            for a, first in list(aliases.items()):
                original = index.tensors.get(first)
                if original is None or now.get(a) is not original or now.get(first) is original:
                    continue
                heir = heirs.setdefault(first, a)
                if heir == a:
                    del aliases[a]
                    runtime[a] = original
                else:
                    aliases[a] = heir
    # The numbers that depend on the model's state are taken now; the rest of the report
    # is a record of the load, turned into DataFrames on first use.
    delta_rows = _delta_rows(saved, index) if index is not None else []
    for r in delta_rows:
        if r["target"] in heirs:  # (the row of the original tensor: its name now)
            r["target"] = heirs[r["target"]]
    if rebound:
        # (each rebound tensor reads the saves of its original storage only, grouped
        # once: each going through every save made a load of one rebinding per call
        # quadratic in its saves)
        by_storage: dict[tuple, list[SavedRegion]] = {}
        for s in saved:
            by_storage.setdefault(s.region.key, []).append(s)
        delta_rows = [r for r in delta_rows if r["target"] not in rebound] + [
            _rebound_row(n, originals[n], t, by_storage.get(_storage_key(originals[n]), []))
            for n, t in rebound.items()
            # (a dry run's tensor, then or now, holds no numbers: no deltas row)
            if not (t.is_meta or originals[n].is_meta)
        ]
    calls = list(rec.calls)
    events = list(rec.events)
    if heirs:
        # Writes into the original tensor before its first name let it go (the rebind row,
        # or all of them where the name was removed) were writes into the heir's tensor.
        let_go: dict[str, int] = {}
        for k, e in enumerate(events):
            if e.op == "rebind" and e.target in heirs:
                let_go.setdefault(e.target, k)
        events = [dataclasses.replace(e, target=heirs[e.target])
                  if e.target in heirs and k < let_go.get(e.target, len(events)) else e
                  for k, e in enumerate(events)]
    shapes = {n: tuple(t.shape) for n, t in runtime.items()}
    strides = {n: tuple(t.stride()) for n, t in runtime.items()}
    for e in events:  # (a tensor registered and removed again: as it was written)
        if e.target not in shapes:
            shapes[e.target], strides[e.target] = e.shape, e.stride
    meta = frozenset(n for n, t in runtime.items() if t.is_meta)
    report = LoadReport(
        patches=patches,
        plan=plan,
        max_chunk_bytes=max_chunk_bytes,
        loaded=set(loaded),
        error=error,
    )
    report._saved = list(saved)
    report._runtime = runtime
    report._shapes = shapes
    report._strides = strides
    report._removed = removed
    report._rebound = originals
    report._registered = tuple(registered)
    report._quiet = tuple(session.quiet_calls) if session is not None else ()
    report._aliases = aliases
    report._meta = meta
    report._was_meta = frozenset(n for n, t in originals.items()
                                 if t.is_meta and not rebound[n].is_meta)
    report._storageless = dict(index.storageless) if index is not None else {}
    report._dry = len({e.target for e in events} & meta)
    report._patch_versions = [_versions(p) for p in patches]
    report._tables = {
        "chunks": lambda: _chunks_frame(patches, sent_name, plan, len(calls), observed_calls,
                                        malformed, failed=error is not None,
                                        writes_seen=_unwritten(calls, events)),
        "calls": lambda: _frame({
            c: [row[c] for row in calls]
            for c in ("chunk", "names", "returned", "writes", "seconds", "error")
        }, samples=_CALLS_SAMPLES),
        "writes": lambda: _writes_frame(events, patches, shapes, strides, meta),
        "deltas": lambda: _deltas_frame(delta_rows),
    }
    return report


# The chunks table's note on a patch whose call returned with no write traced to it.
NO_WRITE_NOTE = ("no write from it seen: the loader skipped it (a weight another rank "
                 "holds, say) or wrote it where no watch sees")


def _unwritten(calls: list[dict[str, Any]], events: list[WriteEvent]
               ) -> tuple[frozenset[int], frozenset[int]]:
    """What the chunks table's :data:`NO_WRITE_NOTE` is read from: the positions of the
    patches that some write came from, and the calls that returned (did not raise) with
    every write traced to a patch (a write from an op of two patches, ``torch.cat`` say,
    may hold any of its call's). A patch of such a call from which no write came was
    taken by the loader and not written from: a loader that skips a weight (one another
    rank holds, under expert or tensor parallelism; a rotary cache) does that."""
    untraced = {e.chunk for e in events if e.position is None}
    returned = frozenset(c["chunk"] for c in calls if not c["error"]) - untraced
    return frozenset(e.position for e in events), returned


def _chunks_frame(patches, sent_name: dict[int, str], plan, ran: int,
                  observed_calls: bool = False,
                  malformed: dict[int, str] | None = None,
                  failed: bool = True,
                  writes_seen: tuple[frozenset[int], frozenset[int]] | None = None
                  ) -> pd.DataFrame:
    """The ``chunks`` table. ``sent_name``: the name each input position was (to be) sent
    under; ``ran``: how many ``load_weights`` calls were made; ``observed_calls``: ``plan``
    is the calls an observed loader made, so a position it did not send was not sent,
    never dropped as a tied alias (that is the plan's rule, CONTRACT §6); ``malformed``:
    positions of items that are no valid patch, with why (see :func:`_malformed`);
    ``failed``: the load raised (an observed loader that made no call and returned did
    not stop: it sent nothing); ``writes_seen``: :func:`_unwritten` of the load, for
    :data:`NO_WRITE_NOTE` (none without it)."""
    malformed = malformed or {}
    traced, clean = writes_seen if writes_seen is not None else (frozenset(), frozenset())
    chunk_of: dict[int, Chunk] = {}
    for c in plan:
        for p in c.positions:
            if p >= 0:
                chunk_of.setdefault(p, c)
    stopped = (f"not sent: the load stopped in call {ran - 1}" if ran
               else "not sent: the load stopped before its first call")
    notes = []
    for i, p in enumerate(patches):
        if i in malformed:
            notes.append(f"not a valid patch: {malformed[i]}")
        elif i not in sent_name and not observed_calls:
            notes.append("dropped: tied alias of a weight patched in the same call")
        elif i not in chunk_of:
            notes.append("not sent by the observed loader" if ran or not failed else stopped)
        elif chunk_of[i].index >= ran:
            notes.append(stopped)
        elif sent_name[i] != p.name:
            notes.append(f"renamed from {p.name!r} (tied alias)")
        elif (chunk_of[i].index in clean and i not in traced
              and math.prod(p.shape) > 0):  # (a copy of no elements is no write)
            notes.append(NO_WRITE_NOTE)
        else:
            notes.append("")
    summary = _summary_columns(patches, malformed)
    del summary["wire_bytes"]
    summary["bytes"] = summary.pop("staged_bytes")
    # (not sent_name.get(i, p.name): a malformed item may have no name to read)
    summary["name"] = [sent_name[i] if i in sent_name else p.name  # noqa: SIM401
                       for i, p in enumerate(patches)]
    chunk = [chunk_of[i].index if i in chunk_of else None for i in range(len(patches))]
    return _frame({
        "chunk": pd.array(chunk, dtype="Int64"),
        **summary,
        "closed_by": [chunk_of[i].closed_by if i in chunk_of else None
                      for i in range(len(patches))],
        "note": notes,
    }, samples=_SUMMARY_SAMPLES)


def _writes_frame(
    events: list[WriteEvent],
    patches: list[CheckpointWeightPatch],
    shapes: dict[str, tuple[int, ...]],
    strides: dict[str, tuple[int, ...]],
    meta: frozenset[str] = frozenset(),
) -> pd.DataFrame:
    """The ``writes`` table. ``meta``: targets on the meta device (a dry run), where only a
    dense patch's copy says how many elements it wrote (all of its view)."""
    shapes_by_pos = {i: tuple(int(d) for d in patches[i].shape)
                     for i in {ev.position for ev in events}
                     if i is not None and 0 <= i < len(patches)}
    names = (
        "chunk", "position", "name", "checkpoint_offset", "checkpoint_region", "target",
        "target_offset", "target_region", "shape", "elements", "written", "changed", "op",
        "checkpoint_stride", "target_stride",
    )
    cols: dict[str, list] = {k: [] for k in names}
    for ev in events:
        ck_region = None
        if (ev.position is not None and ev.position in shapes_by_pos
                and ev.checkpoint_offset is not None):
            ck_region = region_text(
                shapes_by_pos[ev.position], ev.checkpoint_offset,
                ev.source_shape or ev.shape, ev.source_stride,
            )
        tgt = shapes.get(ev.target)
        tg_region = None
        if tgt is not None:
            step = _in_target(ev.shape, ev.stride, tgt, strides[ev.target])
            tg_region = region_text(tgt, ev.target_offset, ev.shape, step)  # (None: no box)
        written = ev.elements if ev.written is None else ev.written
        if ev.target in meta and (ev.position is None or ev.position not in shapes_by_pos
                                  or patches[ev.position].indices is not None):
            written = None  # (a NaN-merge, or a source not traced: no numbers to count)
        for k, v in zip(names, (
            ev.chunk, ev.position, ev.name, ev.checkpoint_offset, ck_region, ev.target,
            ev.target_offset, tg_region, ev.shape, ev.elements, written, ev.changed, ev.op,
            ev.source_stride, ev.stride,
        )):
            cols[k].append(v)
    for k in ("position", "checkpoint_offset"):
        cols[k] = pd.array(cols[k], dtype="Int64")
    return _frame(cols, samples=_WRITES_SAMPLES)


def _in_target(
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    target_shape: tuple[int, ...],
    target_stride: tuple[int, ...],
) -> tuple[int, ...] | None:
    """A written view's element strides in its target's own row-major coordinates, which
    is what :func:`~patchkit.density.region_text` reads; ``None`` where they cannot be
    told. The same strides for a contiguous target; for a strided one (a column slice of
    a fused buffer, say) each storage stride is read as ``k`` steps of the target
    dimension of the largest storage stride that divides it, and mapped to ``k`` times
    that dimension's row-major stride: right for a view that stays inside that dimension,
    which is what ``region_text`` checks before it names a box. ``None`` when a stride
    divides by no dimension's (or two dimensions step alike, so no single reading
    holds)."""
    row_major = _row_major_strides(target_shape)
    if tuple(target_stride) == row_major:
        return tuple(stride)
    by_step: dict[int, int] = {}
    for n, st, rm in zip(target_shape, target_stride, row_major):
        if n > 1:
            if st in by_step or st <= 0:
                return None  # two dimensions step alike: no single reading
            by_step[st] = rm
    mapped = []
    for n, st in zip(shape, stride):
        if n == 1:
            mapped.append(0)
            continue
        own = max((s for s in by_step if st > 0 and st % s == 0), default=None)
        if own is None:
            return None
        mapped.append(st // own * by_step[own])
    return tuple(mapped)


_BLOCK = 1 << 18  # elements per step of the delta statistics: bounds their scratch memory


def _delta_rows(saved: list[SavedRegion], index: RuntimeIndex) -> list[dict[str, Any]]:
    """Per touched runtime tensor: elements written once each, bitwise changes, |Δ| stats.

    Each saved element is credited to the runtime tensor that owns it (a write can span
    several tensors that share one flat storage). Where saved regions overlap, the oldest
    saved value is an element's "before". Regions that do not overlap are read where they
    are: a dense write that saved only the elements it changed costs a pass over the
    changed elements and one read of its view (for ``||before||``). Works block by block,
    so the scratch memory of the statistics is bounded whatever the size of the writes.
    """
    # Each saved region is matched against the runtime tensors of its own storage only
    # (the index keeps them by storage: a load of n tensors costs O(n), not O(n^2)), by
    # their byte extents.
    regions_of: dict[str, list[tuple[SavedRegion, tuple]]] = {}
    owner_of: dict[str, _Owner] = {}
    for s in saved:
        key, a0, a1, step = s.span if s.span is not None else _span_of(s.view)
        for o in index.overlapping(key, a0, a1):
            if step == o.step:
                regions_of.setdefault(o.name, []).append((s, (key, a0, a1)))
                owner_of[o.name] = o
    accs: list[tuple[str, _Stats]] = []
    for target, entries in regions_of.items():
        o = owner_of[target]
        t = o.tensor
        regions, ext = zip(*entries)
        kept: dict = {}  # (see _contained)
        contained = [_contained(s.view, e, o, kept) for s, e in entries]
        overlapping = (len(regions) > 1 and _any_overlap(regions, ext)) or any(
            s.whole_view and (s.view_sum_squares is None or not inside)
            for s, inside in zip(regions, contained)
        )
        acc = _Stats()
        if overlapping:
            _add_overlapping(acc, t, regions)
        else:
            memo: dict = {}  # (see _positions)
            for s, inside in zip(regions, contained):
                _add_region(acc, t, s, inside, memo)
        if acc.elements:
            accs.append((target, acc))
    _Stats.settle([acc for _, acc in accs])
    return [acc.row(target) for target, acc in accs]


def _any_overlap(regions: Sequence[SavedRegion], ext: Sequence[tuple]) -> bool:
    """Whether two of ``regions`` (of one storage; ``ext``: their ``(key, start, end)``
    byte extents) share an element. Each is compared only with those a
    :class:`~patchkit._regions._RegionIndex` of the ones before it says it may meet, so
    regions side by side (a tensor written row by row) or column slices of one matrix
    cost O(n log n), not a test of every pair."""
    if all(e[2] <= f[1] for e, f in itertools.pairwise(ext)):
        # (the common case, the shards of a fused weight written one after another: byte
        # extents in storage order, each ending where or before the next starts, share no
        # byte, let alone an element)
        return False
    seen = _RegionIndex(_saved_region)
    for s, (_, a0, a1) in zip(regions, ext):
        # (a region's Region is made only where an extent meets its own)
        met = seen.meeting(a0, a1, functools.partial(_saved_region, s))
        if met and any(s.region.overlaps(o.region) for o in met):
            return True
        seen.add(s, a0, a1)
    return False


def _deltas_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    cols = ("elements", "changed", "max_abs", "mean_abs", "rel_l2")
    index = pd.Index([r["target"] for r in rows], name="target")
    return _frame({c: [r[c] for r in rows] for c in cols}, index=index, samples=_DELTAS_SAMPLES)


class _Stats:
    """Running sums for one row of ``deltas``."""

    def __init__(self) -> None:
        self.elements = self.changed = 0
        self.max_abs = self.sum_abs = self.sum_d2 = self.sum_b2 = 0.0
        self.numbers = True  # False once a packed dtype's pairs came: changes counted only
        # sums on a device, not read yet: (changed, sum |d|, sum d^2, max |d|, sum b^2)
        self.pending: list[torch.Tensor] = []

    @staticmethod
    def settle(accs: Sequence[_Stats]) -> None:
        """Read the pending device sums of ``accs`` into their numbers: one host wait per
        device for all of them (a report of a thousand GPU tensors waits once here)."""
        by_device: dict[torch.device, list[tuple[_Stats, torch.Tensor]]] = {}
        for acc in accs:
            for t in acc.pending:
                by_device.setdefault(t.device, []).append((acc, t))
            acc.pending = []
        for entries in by_device.values():
            read = torch.stack([t for _, t in entries]).tolist()
            for (acc, _), (n_changed, sum_abs, sum_d2, max_abs, sum_b2) in zip(entries, read):
                acc.changed += int(n_changed)  # (exact in float64 below 2**53)
                acc.sum_abs += sum_abs
                acc.sum_d2 += sum_d2
                acc.max_abs = max(acc.max_abs, max_abs)
                acc.sum_b2 += sum_b2

    def add_squares(self, values: torch.Tensor) -> None:
        """Add the sum of squares of the finite elements of ``values`` to ||before||^2.
        On a device it is pending until :meth:`settle`, taken in one pass that leaves the
        non-finite elements out (no second pass to decide on, and nothing of ``values``
        kept until then)."""
        if not has_numbers(values.dtype):
            return
        if not host_waits(values.device):
            self.sum_b2 += sum_squares(values)
            return
        total = squares_on_device(values, finite_only=True)
        self.pending.append(torch.cat([total.new_zeros(4), total.reshape(1)]))

    def add_pairs(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """Elements (1-D before/after values) whose changes are counted.

        |after - before| is taken in float32 for float16 and the 8-bit floats (half the
        traffic of float64, and exact for nearly every pair), in float64 for bfloat16,
        float32, float64 and integers, in complex128 for complex; sums are float64;
        non-finite differences count as 0 in the sums and the maximum.

        On the CPU it works a cache-sized block at a time, on the changed elements of
        each; on a device the host waits for (CUDA), :meth:`_add_pairs_on_device`.
        """
        if not has_numbers(after.dtype):
            # a packed dtype (float4_e2m1fn_x2): its changes are counted, bit for bit
            self.numbers = False
            for lo in range(0, after.numel(), _BLOCK):
                self.changed += int(count_true(
                    changed_mask(before[lo : lo + _BLOCK], after[lo : lo + _BLOCK])))
            return
        if host_waits(after.device):
            self._add_pairs_on_device(before, after)
            return
        for lo in range(0, before.numel(), _BLOCK):
            b = before[lo : lo + _BLOCK]
            a = after[lo : lo + _BLOCK]
            diff = changed_mask(b, a)
            n_changed = int(count_true(diff))
            self.changed += n_changed
            if not n_changed:
                continue
            if n_changed < b.numel():
                a, b = _masked(a, diff), _masked(b, diff)
            d = _abs_diff(a, b)
            total = float(d.sum(dtype=torch.float64))
            if not math.isfinite(total):
                d = torch.nan_to_num_(d, nan=0.0, posinf=0.0, neginf=0.0)
                total = float(d.sum(dtype=torch.float64))
            self.sum_abs += total
            self.max_abs = max(self.max_abs, float(d.max()))
            self.sum_d2 += sum_squares(d)

    def _add_pairs_on_device(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """:meth:`add_pairs` with no host wait: big blocks (of
        :func:`~patchkit.bitwise.block_size`), each taken whole (picking out the changed
        elements would wait for their count), the sums kept on the device in
        :attr:`pending` until :meth:`settle` reads them. An element whose bits did not
        change adds a difference of 0, or NaN (a NaN or an infinity kept), which counts
        as 0 as every non-finite difference does: the numbers are those of the CPU's
        pass, up to the order of the float64 additions."""
        n = before.numel()
        if not n:
            return
        dev = after.device
        changed = torch.zeros((), dtype=torch.int64, device=dev)
        sums = torch.zeros(3, dtype=torch.float64, device=dev)  # sum |d|, sum d^2, max |d|
        step = block_size(dev, n)
        for lo in range(0, n, step):
            b = before[lo : lo + step]
            a = after[lo : lo + step]
            changed += count_true(changed_mask(b, a))
            d = torch.nan_to_num_(_abs_diff(a, b), nan=0.0, posinf=0.0, neginf=0.0).double()
            sums[0] += d.sum()
            sums[1] += torch.dot(d, d)
            torch.maximum(sums[2], d.max(), out=sums[2])
        self.pending.append(torch.cat([changed.double().reshape(1), sums, sums.new_zeros(1)]))

    def row(self, target: str) -> dict[str, Any]:
        if self.pending:
            _Stats.settle([self])
        row = {"target": target, "elements": self.elements, "changed": self.changed}
        if not self.numbers:  # a packed dtype: no numbers to take differences of
            return row | dict.fromkeys(("max_abs", "mean_abs", "rel_l2"), math.nan)
        dn, bn = math.sqrt(self.sum_d2), math.sqrt(self.sum_b2)
        return row | {
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / self.elements if self.elements else 0.0,
            "rel_l2": dn / bn if bn > 0 else (0.0 if dn == 0 else math.inf),
        }


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| as a real 1-D tensor (see :func:`~patchkit.bitwise.difference` for the
    precision)."""
    d = difference(a, b)
    return d.abs() if d.is_complex() else d.abs_()


def _as_dtype_of(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Saved values read as ``t``'s dtype: a loader may write through a reinterpreting
    view (``param.view(torch.int32).copy_(...)``) of the same element size."""
    return x if x.dtype == t.dtype else x.view(t.dtype)


def _add_region(acc: _Stats, t: torch.Tensor, s: SavedRegion, contained: bool,
                memo: dict | None = None) -> None:
    """One saved region that no other region of ``t`` overlaps (``contained``: every
    element of its view is an element of ``t``, see :func:`_contained`).

    Reads the saved values and the values now, pair by pair: a strided view saved whole
    (a transposed one, say) a block of ``_BLOCK`` elements at a time on the CPU, never
    copied whole. A region reaching outside ``t`` is cut to ``t``'s elements: a view
    saved whole as a :class:`_Box` of ``t`` where it is one (no index), else through
    storage offsets (8 bytes per saved element; ``memo``: see :func:`_positions`)."""
    if contained and s.diff_stats is not None and s.view_sum_squares is not None:
        # Measured while writing (patchkit.native): nothing to read again.
        changed, sum_abs, sum_d2, max_abs = s.diff_stats
        acc.elements += s.written_count()
        acc.changed += changed
        acc.sum_abs += sum_abs
        acc.sum_d2 += sum_d2
        acc.max_abs = max(acc.max_abs, max_abs)
        acc.sum_b2 += s.view_sum_squares
        return
    whole = _saved_whole(s)
    box = None
    if contained or _within(s.view, t):  # every saved element lies in ``t``
        b, a = (s.before, s.view) if whole else (s.flat_before(), s.current())
    elif whole and (box := _box_of(s.view, t)) is not None:
        b, a = box.take(s.before), box.take(s.view)
    else:
        _, valid = _positions(t, s.storage_index(), memo)
        b, a = s.flat_before()[valid], s.current()[valid]
    b, a = _as_dtype_of(b, t), _as_dtype_of(a, t)
    # A compared dense copy that saved only what it changed summed the squares of its
    # whole view before it wrote (the caller checked that the view lies in ``t``); the
    # other saves hold exactly the written elements (a whole view, or NaN-merged).
    compact = s.index is not None and s.whole_view
    measured = compact or (contained and s.view_sum_squares is not None)
    for bp, ap in _flat_pairs(b, a):
        acc.add_pairs(bp, ap)
        if not measured:
            acc.add_squares(bp)
    acc.elements += s.view.numel() if compact else b.numel()
    if measured:
        acc.sum_b2 += float(s.view_sum_squares)


def _flat_pairs(b: torch.Tensor, a: torch.Tensor):
    """``b`` and ``a`` (one shape) as pairs of 1-D tensors, in row-major order: whole
    where both flatten without a copy, or on a device (whose passes take big blocks);
    else ``_BLOCK`` elements at a time, so that a strided view is never copied whole."""
    if (b.is_contiguous() and a.is_contiguous()) or host_waits(a.device):
        yield b.reshape(-1), a.reshape(-1)
        return
    n = b.numel()
    for lo in range(0, n, _BLOCK):
        hi = min(n, lo + _BLOCK)
        yield _flat_range(b, lo, hi), _flat_range(a, lo, hi)


def _add_overlapping(acc: _Stats, t: torch.Tensor, regions: Sequence[SavedRegion]) -> None:
    """Regions of ``t`` that overlap: ``t``'s values before the load (where saves
    overlap, the oldest save's) and where the load wrote it, then the numbers over the
    written elements.

    Scratch: for a contiguous ``t`` on the CPU, ``_BLOCK`` elements at a time (a few MiB,
    read through :class:`_BeforeAfter`), whatever the size of ``t``, plus the positions
    of the elements saved or written other than as whole views (compact saves,
    NaN-merges: about 8 bytes per saved element, in proportion to what the load
    changed); a view saved or written whole costs nothing per element. On a device (see
    :func:`~patchkit.bitwise.host_waits`), or for a ``t`` that is not contiguous, a copy
    of ``t`` and a 1-byte mask of its elements, plus the storage offsets that
    :func:`_put_back` takes there."""
    n = t.numel()
    if t.is_contiguous() and not host_waits(t.device):
        reader = _BeforeAfter(t, t, regions, whole=False)
        for lo in range(0, n, _BLOCK):
            b, a, written = reader.read(lo, min(n, lo + _BLOCK))
            if written is not None:
                b, a = _masked(b, written), _masked(a, written)
            acc.elements += b.numel()
            acc.add_squares(b)
            acc.add_pairs(b, a)
        return
    flat_now = t.detach().reshape(-1)
    before = flat_now.clone()
    written = torch.zeros(n, dtype=torch.bool, device=t.device)
    _put_back(before, t, regions[::-1])
    _mark_written(written, t, regions)
    b, a = _masked(before, written), _masked(flat_now, written)
    acc.elements += b.numel()
    acc.add_squares(b)
    acc.add_pairs(b, a)


def _sharing(saved: list[SavedRegion], t: torch.Tensor) -> list[SavedRegion]:
    """The saved regions that live in ``t``'s storage (they may reach into ``t``), read
    with ``t``'s element size (a write through a view of another element size, say
    bytes of a float tensor, is not followed)."""
    key = _storage_key(t)
    return [
        s for s in saved
        if s.region.key == key and s.view.element_size() == t.element_size()
    ]


def _positions(t: torch.Tensor, storage_index: torch.Tensor, memo: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major positions in ``t`` of the storage offsets that fall inside ``t``.

    Returns ``(positions, valid)``: ``valid`` marks which of ``storage_index`` belong to
    ``t``; ``positions`` are their positions. Works for strided tensors and for tensors
    that share one flat storage with others. A strided ``t`` costs a sorted copy of its
    storage offsets (16 bytes per element); ``memo``, a dict a caller passes with every
    save of one ``t``, keeps that copy from the first call on (sorting it once per save
    took minutes for a few hundred rows written one by one into a column slice).
    """
    if t.is_contiguous():
        pos = storage_index - t.storage_offset()
        valid = (pos >= 0) & (pos < t.numel())
        return pos[valid], valid
    got = memo.get("sorted") if memo is not None else None
    if got is None:
        offsets = _storage_offsets(t, None)
        order = torch.argsort(offsets)
        got = offsets[order], order
        if memo is not None:
            memo["sorted"] = got
    ordered, order = got
    at = torch.searchsorted(ordered, storage_index).clamp(max=ordered.numel() - 1)
    valid = ordered[at] == storage_index
    return order[at[valid]], valid


def _contained(view: torch.Tensor, extent: tuple[tuple, int, int], o: _Owner,
               memo: dict | None = None) -> bool:
    """True when every element of ``view`` is an element of runtime tensor ``o.tensor``,
    so numbers measured over the view are its own. Exact: a strided tensor (a column
    slice of a fused buffer, say) does not own the gaps of its extent. ``extent``: the
    view's storage key and byte extent ``[a0, a1)``, which the caller has. ``memo``: a
    dict a caller passes with every view it asks about for one ``o``, which keeps the
    mask of a strided tensor's elements (a byte per element of its span) from the first
    call on."""
    key, a0, a1 = extent
    b0, b1 = o.start, o.end
    if key != o.key or not (b0 <= a0 and a1 <= b1):
        return False
    if o.dense:
        return True
    step = o.step
    if view.element_size() != step or (a0 - b0) % step:
        return False
    # Mark t's elements in a scratch mask over its span, then look for all of view's.
    mask = memo.get("mask") if memo is not None else None
    if mask is None:
        t = o.tensor
        mask = torch.zeros((b1 - b0) // step, dtype=torch.bool, device="cpu")
        mask.as_strided(t.shape, t.stride(), 0).fill_(True)
        if memo is not None:
            memo["mask"] = mask
    return bool(mask.as_strided(view.shape, view.stride(), (a0 - b0) // step).all())


def _within(view: torch.Tensor, t: torch.Tensor) -> bool:
    """True when every element of ``view`` lies in contiguous ``t``, in the same order
    (so ``view.reshape(-1)`` lines up with a slice of ``t``'s elements)."""
    if not (t.is_contiguous() and view.is_contiguous()):
        return False
    lo = view.storage_offset() * view.element_size()
    hi = lo + view.numel() * view.element_size()
    t_lo = t.storage_offset() * t.element_size()
    return t_lo <= lo and hi <= t_lo + t.numel() * t.element_size()
