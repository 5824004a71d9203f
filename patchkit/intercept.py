"""Seeing and shaping the writes a ``load_weights`` call makes (CONTRACT.md §4-5).

A :class:`WriteSession` spans one load. For each sparse ``load_weights`` call it enters a
:class:`torch.utils._python_dispatch.TorchDispatchMode`. Dispatch modes live on a
per-thread stack, so the interception is active only on the calling thread and only for
the duration of the call; ``torch.Tensor.copy_`` itself is never replaced. The mode sees
every ATen op, so it sees every way a loader can write: ``copy_`` on a slice, slice
assignment (``param.data[0:2] = w`` is ``slice`` + ``copy_``), ``index_put_``, ``fill_``,
``out=`` ops.

A dense call that is observed (a report, ``transactional=True``) enters a function mode
instead (:class:`_DenseMode`, also per thread), which sees the same writes at less cost:
views and attribute reads pass it by, it handles a plain ``copy_`` into a runtime tensor
itself, and it runs every other call under the dispatch mode. Most of a loader's ops are
views (``param.data``, ``narrow``), and the dispatch mode costs a few microseconds for
each: on a model of 291 small tensors the function mode's own cost is 1.3x a plain load,
the dispatch mode's 2.1x. The price: a loader that writes inside
``torch._C.DisableTorchFunction()`` writes unseen, in a dense call only.

On the CPU the session does the writes it sees in compiled loops (:mod:`patchkit.native`)
that write memory directly, except when another dispatch mode is active below its own
(a loader's that merges NaN itself, a caller's tool that watches writes): then each
write goes on to that mode as a torch op, and is measured around it.

A write matters when it mutates a *runtime tensor*: storage owned by one of the model's
parameters or buffers (:class:`RuntimeIndex`). Inside a sparse call such a write is
either a same-shaped floating-point ``copy_``, which is NaN-merged, or it is rejected
before it writes. Every runtime write can also be saved before it happens (for
``transactional=True`` and before/after deltas) and reported to a recorder (for
inspection); observing never changes a value.

What the session builds on lives beside it: the runtime tensors and who owns each piece
of storage in :mod:`patchkit._runtime_index`, where views sit in their storage and which
regions meet in :mod:`patchkit._regions`, and what each ATen op does with a sparse
patch's NaN marks in :mod:`patchkit._marks`. The public names of all four
(:class:`Region`, :class:`RuntimeIndex`, :class:`SavedRegion`, :class:`WriteEvent`,
:class:`WriteRecorder`, :class:`WriteSession`) are importable from here.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode

from . import native
from ._marks import (
    _CASTS_KEEP_NUMBERS,
    _COPY,
    _FILLS,
    _FOREACH_COPY,
    _FUNCTIONAL_PUTS,
    _MOVES,
    _PUTS,
    _REINTERPRETED_FIX,
    _REINTERPRETED_HOW,
    _aten,
    _box_in_units,
    _casts_lose_numbers,
    _element_wise,
    _foreach_kind,
    _in_elements_of,
    _inputs,
    _is_view,
    _keep_in,
    _listed,
    _lost_in_cast,
    _LostMarks,
    _may_be_masked,
    _misaligned,
    _mixed_from,
    _op_name,
    _out_args,
    _owner_units,
    _Provenance,
    _reinterpreted_words,
    _Sliced,
    _Source,
    _unravel,
)
from ._regions import (
    Region,
    _byte_span,
    _cut_at_owners,
    _element_bytes,
    _flat_storage,
    _holds,
    _PutBack,
    _region_key,
    _RegionIndex,
    _span_in,
    _span_of,
    _storage_key,
    _storage_offsets,
)
from ._runtime_index import _DATA_PTR, _IS_CUDA, RuntimeIndex, _lazy_kind, _named_now, named_tensors
from .bitwise import (
    _PLAIN,
    bits,
    changed_mask,
    count_true,
    has_numbers,
    host_waits,
    nan_mask,
    per_element,
    select,
    squares_on_device,
)
from .errors import ContractViolation, PatchValueError, add_note, quoted, where
from .units import _count

__all__ = [
    "Region",
    "RuntimeIndex",
    "SavedRegion",
    "WriteEvent",
    "WriteRecorder",
    "WriteSession",
]


@dataclass
class WriteEvent:
    """One write into a runtime tensor, as the session saw it.

    ``chunk`` is the load's call number; ``op`` the ATen op (``"aten::copy_"``);
    ``target`` and ``target_offset`` the runtime tensor and the flat element offset of the
    written view in it; ``shape`` and ``elements`` the written view. When the source is
    (a view of) a staged patch tensor, ``position``/``name`` name that patch and
    ``checkpoint_offset`` is the flat element offset of the source view in the checkpoint
    tensor; otherwise they are ``None``. A view of another element size than its
    tensor's is given in that tensor's elements (the box of those its bytes touch), the
    target's by the view recorded, the source's by ``source_shape``/``source_stride``.
    ``changed`` counts elements whose bits changed, when the session was asked to
    count. ``written``: the elements that took the
    source's value, where fewer than ``elements`` (a NaN-merge writes only where its
    source is not NaN); ``None`` for all of them.
    """

    chunk: int
    op: str
    target: str
    target_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    elements: int
    position: int | None = None
    name: str | None = None
    checkpoint_offset: int | None = None
    changed: int | None = None
    source_shape: tuple[int, ...] | None = None
    source_stride: tuple[int, ...] | None = None
    written: int | None = None


@dataclass
class SavedRegion:
    """Runtime elements as they were before a write of the load changed them.

    ``view`` is the written view of the runtime tensor. Without ``index`` the whole view
    was saved and ``before`` has its shape. Otherwise ``index`` holds the storage element
    offsets of the saved elements and ``before`` their values:

    - a NaN-merged (sparse) write saves the elements it writes, those where its source
      is not NaN, so its save costs memory in proportion to the patch, not to the view.
      When it wrote from its patch's staged tensor on the CPU, ``index`` is ``None`` and
      ``positions`` says how to recompute the offsets from the patch: the save then
      costs exactly the bytes the write wrote;
    - a plain dense copy compared with its source first (``whole_view=True``) writes the
      whole view but saves only the elements it changes: the others keep their bits.
    """

    target: str
    target_offset: int
    view: torch.Tensor = field(repr=False)
    before: torch.Tensor = field(repr=False)
    index: torch.Tensor | None = field(default=None, repr=False)
    whole_view: bool = False
    # Sum of squares of the finite values the write wrote over, before it (the whole view
    # of a compared copy, the written elements of a compiled NaN-merge; when reporting):
    # the statistics need it for ||before||.
    view_sum_squares: float | None = None
    # ``(changed, sum |after - before|, sum of its squares, max |after - before|)`` over
    # the written elements, measured while writing (the compiled paths, when reporting),
    # so that the statistics need not read them again.
    diff_stats: tuple[int, float, float, float] | None = None
    positions: PatchPositions | None = field(default=None, repr=False)
    # ``(storage key, start, end, element size)`` of :attr:`view` (the byte extent of
    # _byte_span), where the write had it: the statistics match regions to runtime
    # tensors by it. ``None``: taken from the view when needed.
    span: tuple | None = field(default=None, repr=False, compare=False)
    # ``(shape, strides, storage offset)`` of :attr:`view` when it was saved: a loader may
    # change that tensor's own view in place afterwards (``resize_``, ``unsqueeze_``,
    # ``t_``, ``as_strided_``, an ``out=`` op that resizes it), which moves no element of
    # the storage; a rollback writes back through the view as it was (:meth:`_as_saved`).
    viewed_as: tuple | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.viewed_as is None:
            v = self.view
            self.viewed_as = (tuple(v.shape), v.stride(), v.storage_offset())

    def rehome(self, home: torch.Tensor) -> None:
        """Point :attr:`view` at the storage of runtime tensor ``home`` (its
        :attr:`target`), viewed as it was saved: the loader bound the tensor it wrote
        through to other memory since (``alias = param.data; alias.copy_(w);
        alias.set_(x)``), so a write back through it would miss the model."""
        shape, stride, offset = self.viewed_as
        self.view = torch.empty(0, dtype=self.view.dtype, device=home.device).set_(
            home.untyped_storage(), offset, shape, stride)
        self.__dict__.pop("region", None)  # (a cached_property of the view)

    def _as_saved(self) -> torch.Tensor:
        """:attr:`view` viewing its storage as it did when it was saved."""
        v, at = self.view, self.viewed_as
        if at is None or (tuple(v.shape), v.stride(), v.storage_offset()) == at:
            return v
        return v.as_strided(*at)

    @cached_property
    def region(self) -> Region:
        """Where :attr:`view` sits in its storage (taken once: a view never moves)."""
        return Region.of(self.view)

    def _storage(self) -> torch.Tensor:
        return _flat_storage(self.view)

    def _offsets(self) -> torch.Tensor | None:
        """The saved elements' storage offsets, ``None`` when the whole view was saved."""
        if self.index is not None:
            return self.index
        if self.positions is not None:
            view = self._as_saved()
            return _storage_offsets(view, self.positions.view_positions(view))
        return None

    def current(self) -> torch.Tensor:
        """The saved elements' values now (1-D, in the order of ``before``)."""
        index = self._offsets()
        if index is None:
            return self.view.reshape(-1)
        return select(self._storage(), index)

    def flat_before(self) -> torch.Tensor:
        """The saved values (1-D)."""
        return self.before.reshape(-1)

    def changed_now(self) -> int:
        """How many of the saved elements differ now, bit for bit, from their saved
        values (one host wait on a GPU)."""
        ne = bits(self.current()) != bits(self.flat_before())
        return int(count_true(per_element(ne, self.before.is_complex())))

    def restore(self) -> None:
        """Write the saved values back (outside any interception; an inference tensor in
        inference mode, where torch allows its writes)."""
        if self.view.is_inference() and not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                self.restore()
            return
        index = self._offsets()
        if index is None:
            self._as_saved().copy_(self.before)
        else:
            # On the bits: exact, and index_copy_ has no float8 or uint32 kernels on the CPU.
            bits(self._storage()).index_copy_(0, index, bits(self.before))

    def storage_index(self) -> torch.Tensor:
        """Storage element offsets of the saved elements (1-D, in the order of ``before``)."""
        index = self._offsets()
        return _storage_offsets(self.view, None) if index is None else index

    def written_count(self) -> int:
        """How many elements the write wrote: the whole view, or the saved elements of a
        NaN-merge."""
        if self.whole_view or (self.index is None and self.positions is None):
            return self.view.numel()
        return self.before.numel()

    def written_index(self) -> torch.Tensor:
        """Storage element offsets of every element the write wrote (1-D)."""
        if self.whole_view:
            return _storage_offsets(self.view, None)
        return self.storage_index()

    @classmethod
    def elements(
        cls, target: str, offset: int, view: torch.Tensor, index: torch.Tensor, **kw: Any
    ) -> SavedRegion:
        """Save the elements of ``view``'s storage at ``index`` (their current values)."""
        before = select(_flat_storage(view), index)  # a new tensor: a copy
        return cls(target, offset, view, before, index, **kw)


@dataclass
class PatchPositions:
    """Where a NaN-merged write wrote, kept as a recipe instead of storage offsets: the
    entries of sparse patch ``position`` (``name``) whose value is not NaN and whose
    checkpoint index lies in the source view, rows of ``rows[0]`` contiguous elements
    ``rows[2]`` apart from checkpoint element ``start`` on; the destination view's element
    at the same row-major position took each. ``indices`` and ``values`` are the patch's
    own tensors (referenced, not copied); ``count`` and ``checksums`` (see
    :func:`patchkit.native.patch_entries`) were taken at the write, so a patch changed
    since is noticed instead of misread; ``position_sums``, the entries' positions in the
    view summed (see :class:`patchkit.native.PatchEntries`), let the write check that
    the merge wrote there."""

    position: int
    name: str
    indices: torch.Tensor = field(repr=False)
    values: torch.Tensor = field(repr=False)
    start: int
    rows: tuple[int, int, int]
    count: int
    checksums: tuple[int, int]
    position_sums: tuple[int, int] | None = field(default=None, repr=False)

    def view_positions(self, view: torch.Tensor) -> torch.Tensor:
        """Row-major positions in ``view`` (the written view) of the written elements, in
        increasing order (the merge's order). O(nnz log nnz) work and memory.

        Raises ``ValueError`` when the patch's indices, or which of its values are NaN,
        changed since the load (the positions read from them; other value changes do not
        move a position and are not seen).
        """
        length, _, srs = self.rows
        i = self.indices.to(torch.int64)[~torch.isnan(self.values)]
        rel = i - self.start
        row = torch.div(rel, srs, rounding_mode="floor")
        col = rel - row * srs
        inside = (rel >= 0) & (row < view.numel() // length) & (col < length)
        i, row, col = i[inside], row[inside], col[inside]
        sums = (int((i & 0x7FFFFFFF).sum()), int((i % 65521 * 40503 % 65521).sum()))
        if i.numel() != self.count or sums != self.checksums:
            now = (f"it now has {i.numel()}" if i.numel() != self.count
                   else "it still has as many, at other positions")
            raise ValueError(
                f"{where(self.position, self.name)}: its indices or values changed after the "
                "load, so where the load wrote it can no longer be recomputed (a report keeps "
                "the patch's tensors, not copies of them: leave them unchanged while the "
                f"report is in use); the load wrote {self.count} of its entries here, {now}"
            )
        return (row * length + col).sort().values


def _comparable_copy(args, kwargs, targets) -> bool:
    """``copy_(dest, src)`` into one runtime tensor from a separate same-shaped source of
    the same dtype on the same device: its result is ``src``'s bits, known in advance."""
    if len(targets) != 1 or len(args) < 2 or kwargs.get("non_blocking"):
        return False
    dest, src = args[0], args[1]
    return (targets[0][0] is dest and dest.element_size() == targets[0][1][1].element_size()
            and _comparable_source(dest, src, _storage_key(dest)) is not None)


def _comparable_source(dest: torch.Tensor, src: Any, key: tuple) -> tuple | None:
    """``src``'s storage key when ``src`` is a tensor of ``dest``'s shape, dtype and
    device in another storage (``dest``'s is ``key``), of a dtype the compared copy
    covers; else ``None``."""
    if not isinstance(src, torch.Tensor):
        return None
    skey = _storage_key(src)  # (its device, compared with the one in dest's key)
    if src.shape != dest.shape or src.dtype != dest.dtype or skey[0] != key[0]:
        return None
    if src.dtype.is_complex or src.element_size() not in (1, 2, 4, 8):
        return None
    # A source sharing storage with the destination would change while being copied.
    return None if skey == key else skey


class WriteRecorder(Protocol):
    """What an observer of a load implements (``patchkit.inspect`` is one). Its methods
    are called on the loading thread, in this order for each ``load_weights`` call:
    ``on_call_start``, ``on_write`` once per write seen, ``on_call_end``. An optional
    ``on_staged(name, staged)`` is called for each entry of an observed call that hands
    the model an iterator, as the model takes it (see :meth:`WriteSession.stage_more`)."""

    def on_call_start(self, chunk: int, staged: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Before call ``chunk`` (its number in the load, from 0) runs: ``staged`` is the
        ``(name, tensor)`` list it is sent (empty where an iterator is sent, each entry
        then coming to ``on_staged``). Work queued on a GPU before the call has finished
        when it is timed."""

    def on_write(self, event: WriteEvent) -> None:
        """One write into a runtime tensor during the current call, as it was seen (see
        :class:`WriteEvent`), in the order the writes were made."""

    def on_call_end(self, chunk: int, returned: Any, seconds: float, error: bool) -> None:
        """After call ``chunk``, also where it raised (``error`` True, ``returned`` then
        ``None``): what ``load_weights`` returned, and its wall time in seconds (a GPU's
        copies waited for)."""


_saved_region = operator.attrgetter("region")  # (a SavedRegion's Region, for _RegionIndex)


# (position, name) of the one patch an op's arguments come from, or None
_Who = tuple[int | None, str] | None


def _is_own(mode: object, session: WriteSession) -> bool:
    """Whether ``mode`` is one of ``session``'s interception modes."""
    return isinstance(mode, _Mode | _DenseMode) and mode.s is session


@contextlib.contextmanager
def _no_modes() -> Iterator[None]:
    """No dispatch mode and no function mode in effect inside (both put back after):
    a rollback's writes are not another load's to watch. Torch's default-device mode
    goes too; a rollback makes no tensor without naming its device."""
    from torch.utils._python_dispatch import _disable_current_modes

    if not (torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()):
        yield
        return
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


# Ops whose output is an element-for-element copy of their first input (``.to()``,
# ``.clone()``, ``.contiguous()`` reach the dispatcher as these), told by identity (an
# op's hash is a Python call, and the test runs for every op of a call).
_TO_COPY_OP, _CLONE_OP = _aten._to_copy.default, _aten.clone.default


# An op's schema never changes: which of its arguments it writes is worked out once per
# process, not once per load.
_MUTATED: dict = {}

# In-place ops that change only the view's own shape, strides or offset (or its autograd
# metadata, ``detach_``) and write no element. Their schema marks ``self`` written
# (``Tensor(a!)``), but they leave every byte of the storage as it was; a later write
# through the changed alias is an op of its own, seen and handled as any other. torch
# tags them ``inplace_view``, but that tag also covers ``resize_``, ``resize_as_`` and
# ``set_``, which may reallocate a storage (growing it for every tensor sharing it) or
# bind the tensor to another one: those stay writes (refused in a sparse load). So only
# the tagged ops named here are let through, and an op torch adds to the tag later is
# a write until it is known to be safe.
_METADATA_ONLY = frozenset({
    "aten::as_strided_", "aten::detach_", "aten::squeeze_", "aten::swapaxes_",
    "aten::swapdims_", "aten::t_", "aten::transpose_", "aten::unsqueeze_",
})


def _mutated_args(func: torch._ops.OpOverload) -> tuple:
    """``(index, name)`` of each argument whose elements ``func`` may write in place:
    those its schema marks written, none for an op that changes only a view's metadata
    (see ``_METADATA_ONLY``)."""
    got = _MUTATED.get(func)
    if got is None:
        if (torch.Tag.inplace_view in func.tags
                and func._schema.name in _METADATA_ONLY):
            got = _MUTATED[func] = ()
        else:
            got = _MUTATED[func] = tuple(
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
    return got


class _Mode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps __torch_dispatch__ in a dynamo "disable", which imports
        # torch._dynamo (about 3 s on these CPUs) the first time a mode is used. Loaders do
        # not compile inside load_weights, so the first sparse load skips that import.
        return False

    def __init__(self, session: WriteSession) -> None:
        super().__init__()
        self.s = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        mutated = _mutated_args(func)
        if not mutated:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                copies = func is _TO_COPY_OP or func is _CLONE_OP  # (an element-wise copy)
                if s.track_sources and s.provenance:
                    derived = copies and s.provenance.derive(args[0], out, whole=True)
                    if not derived and not _is_view(func):
                        # A new tensor made from one patch's data (a cat, a gather, a flip,
                        # the copy of a transposed view): that patch's, at no known offset;
                        # from several patches' (a cat of q and k), theirs, kept for its
                        # dtype. (Its source is looked up here only: most ops of a loader
                        # are views.) In a sparse call, an op that mixes elements of a
                        # patch's data holding NaN makes mixed data (see mixed_by).
                        s.provenance.taint(out, args, kwargs, func)
                if s._sparse:
                    if copies:
                        if s.lost or _casts_lose_numbers(out.dtype):
                            s._note_copied(args[0], out, whole=True)
                    elif s.lost and func in _MOVES:
                        s.lost.moved(func, args, kwargs, out)
                    elif s.lost and func in _FUNCTIONAL_PUTS:
                        s.lost.put(func, args, kwargs, out)
                    elif s.lost and _element_wise(func):
                        s.lost.pointwise(func, [*args, *kwargs.values()], out)
            else:
                if (s.track_sources and isinstance(out, tuple | list) and s.provenance
                        and not _is_view(func)):
                    # (an op of several results, a sort's values: each holds data of its
                    # input; a _foreach_ op's, ``_foreach_norm``'s too, the data of its
                    # inputs at its place)
                    if isinstance(out, list) and (_foreach_kind(func)
                                                  or "::_foreach_" in func._schema.name):
                        s.provenance.taint_each(func, args, kwargs, out)
                    else:
                        for o in out:
                            if isinstance(o, torch.Tensor):
                                s.provenance.taint(o, args, kwargs, func)
                if s._sparse and isinstance(out, list) and _foreach_kind(func):
                    # (``torch._foreach_mul(ts, 2.0)``: each result from its inputs)
                    s._note_foreach(func, args, kwargs, out)
            return out
        targets = []
        others = []
        for i, argname in mutated:
            v = args[i] if i < len(args) else kwargs.get(argname)
            for t in _listed(v):
                if isinstance(t, torch.Tensor) and t.numel():
                    own = s.index.owner(t)
                    if own is not None:
                        targets.append((t, own))
                    else:
                        others.append(t)
        if not targets:
            # (an op that mixes elements in place, ``buf.cumsum_(0)``, reads its inputs
            # before it runs; in a sparse call, or an observed one of NaN-masked patches)
            mixed = (s.provenance.mixed_in_place(func, args, kwargs)
                     if s.provenance.mixing and func is not _COPY and others
                     and s.provenance else None)
            # (an op that may make numbers of a patch's NaN in place, ``w.nan_to_num_()``:
            # which tensors it writes, and where they lie, read before it runs)
            replacing = (s.provenance.replacing_in_place(func, args, kwargs, others)
                         if s.provenance.mixing and func is not _COPY and others
                         and s.provenance else None)
            out = func(*args, **kwargs)
            if isinstance(mixed, _Sliced):  # (``buf.cumsum_(1)``: decided by what it wrote)
                mixed = s.provenance.settled(mixed, others)
            if s.track_sources:
                for t in others:  # a staged tensor (or a copy of one) written in place
                    s.provenance.written(t)
                if func is _COPY:
                    s.provenance.derive(args[1], args[0], whole=False)
                elif func in _FILLS or _foreach_kind(func) == "fill":
                    for t in others:  # (``_foreach_zero_``: each tensor of its list)
                        s.provenance.filled(t)
                elif s.provenance and _foreach_kind(func):
                    # (``_foreach_add_(bufs, ws)``: each from the tensors at its place)
                    s.provenance.written_each(func, args, kwargs, mixed)
                elif s.provenance:
                    # (a scratch tensor written from a patch's data by another op:
                    # ``buf[idx] = w``, ``torch.cat([q, k], out=buf)``, ``buf.add_(w)``)
                    for t in others:
                        s.provenance.written_from(t, args, kwargs)
                        if mixed is not None:
                            s.provenance.mix(t, mixed)
                if replacing:
                    s.provenance.replaced_in_place(replacing)
            if s._sparse and (s.lost or (func is _COPY
                                         and _casts_lose_numbers(args[0].dtype))
                              or (func is _FOREACH_COPY and any(
                                  _casts_lose_numbers(t.dtype) for t in others))):
                s._note_own_write(func, args, kwargs)
            return out
        # the one patch this op's arguments come from (an error of a sparse call names it),
        # looked up only where one asks: a copy whose source is traced names that source's
        # patch, so most writes never need it (nothing the write's checks do before they
        # ask changes what it finds for these arguments)
        who = functools.partial(s.provenance.source_of, args, kwargs) if s._sparse else None
        return s._runtime_write(func, args, kwargs, targets, who)


def _tensor_funcs(*names: str) -> set:
    return {getattr(torch._C.TensorBase, n) for n in names}


# What a dense call's function mode passes on without the dispatch mode: views and
# metadata, which write nothing and copy nothing the dispatch mode would follow back to a
# patch (it follows casts and clones). ``reshape``, ``flatten`` and ``contiguous`` are not
# among them: they may clone. Indexing may gather, a copy no mode follows.
_PASS_ON = _tensor_funcs(
    "narrow", "view", "view_as", "select", "squeeze", "unsqueeze", "t", "transpose",
    "permute", "expand", "expand_as", "chunk", "split", "unbind", "detach", "size",
    "stride", "dim", "numel", "element_size", "storage_offset", "data_ptr", "is_contiguous",
    "__getitem__",
)
_TENSOR_COPY = torch._C.TensorBase.copy_
_GETITEM = torch._C.TensorBase.__getitem__
_COPY_NAME = _op_name(_COPY)


_increment_version = torch.autograd.graph.increment_version


def _is_getter(func) -> bool:
    """A tensor attribute read (``.data``, ``.shape``, ``.dtype``, ``.T``, ...), which
    torch hands to a function mode as the descriptor's ``__get__``."""
    owner = getattr(func, "__self__", None)
    return (
        getattr(func, "__name__", None) == "__get__"
        and getattr(owner, "__objclass__", None) is torch._C.TensorBase
    )


_PASS, _HANDLE, _BELOW = 0, 1, 2
# How _DenseMode treats each function it has met (a process meets a bounded set).
_ROUTE: dict = {_TENSOR_COPY: _HANDLE}


def _route(func) -> int:
    try:
        route = _PASS if func in _PASS_ON or _is_getter(func) else _BELOW
    except TypeError:  # not hashable
        return _BELOW
    if not isinstance(getattr(func, "__self__", None), torch.Tensor):  # keeps no tensor
        _ROUTE[func] = route
    return route


_dynamo_told = False


def _keep_dynamo_out() -> None:
    """Where torch.compile's dynamo is loaded, have it skip patchkit's own code.

    A loader compiled with ``torch.compile`` runs its ops through this module's modes
    while dynamo traces it; traced into, the watch's bookkeeping was compiled along with
    the loader (dynamo warned of its caches, failed on a property, and left half-made
    objects whose cleanup printed errors). Skipped, each of the watch's frames runs as
    plain Python: the loader's graph breaks there, as at any code dynamo does not trace.
    Nothing is imported for it: a process without dynamo loaded is asked again at the
    next watched call (a dict lookup), and told once it has."""
    global _dynamo_told
    rules = sys.modules.get("torch._dynamo.trace_rules")
    if rules is None:
        return
    _dynamo_told = True
    # (torch's own list of folders dynamo never traces; private, so a torch whose list
    # has moved or fails keeps tracing the watch, as before, and the load goes on)
    with contextlib.suppress(Exception):
        rules.add(__package__)


class _DenseMode(TorchFunctionMode):
    """A dense call's interception: the same writes as :class:`_Mode`, at less cost.

    A dispatch mode costs a few microseconds for every ATen op, and most ops of a loader
    are views (``narrow``, ``param.data``) that write nothing. This mode sees the calls
    at the Python level, one level up: views, metadata and attribute reads go straight
    on; a plain ``copy_`` into a runtime tensor is handled here as the dispatch mode
    would handle it; every other call runs under :class:`_Mode`, which sees its ATen
    ops. Function modes also live on a per-thread stack."""

    def __init__(self, session: WriteSession) -> None:
        super().__init__()
        self.s = session
        # The dispatch mode for the calls this one does not handle, made when the first
        # such call comes (a loader that only takes views and copies makes none).
        self._below: _Mode | None = None
        # Under torch.set_default_device (a function mode, which would place the
        # session's own buffers), the session's work runs with function modes off.
        self.shield = torch._C._len_torch_function_stack() > 0

    @staticmethod
    def fits() -> bool:
        """Whether this mode can stand in for :class:`_Mode` on this thread now: no
        function mode is active other than torch's default-device one, so no other
        mode would miss a ``copy_`` this mode handles."""
        return not torch._C._len_torch_function_stack() or all(
            isinstance(m, DeviceContext) for m in torch.overrides._get_current_function_mode_stack()
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        route = _ROUTE.get(func)
        if route is None:
            route = _route(func)
        if route == _PASS:
            out = func(*args, **(kwargs or {}))
            if func is _GETITEM and self.s.provenance and isinstance(out, torch.Tensor):
                # ``w[idx]`` with a tensor or list index gathers into a new tensor
                # (a slice is a view, which the storage already names)
                prov = self.s.provenance
                prov.taint(out, args, kwargs)
            return out
        if route == _HANDLE:
            if self.shield:
                with torch._C.DisableTorchFunction():
                    out = self.s._plain_copy(args, kwargs)
            else:
                out = self.s._plain_copy(args, kwargs)
            if out is not None:
                return out
        # (a plain attribute, made here: no property, which torch.compile's dynamo,
        # tracing a compiled loader's op into this method, fails on with an
        # AssertionError, "cls_source must not be None for MRO walk")
        below = self._below
        if below is None:
            below = self._below = _Mode(self.s)
        with below:
            return func(*args, **(kwargs or {}))


class _SignalDeferral:
    """Python signal handlers held back while a compiled write is not yet saved.

    The compiled paths (:mod:`patchkit.native`) copy and save in one C call, and the
    save is registered in :attr:`WriteSession.saved` by the Python after it. A signal
    that arrives meanwhile (Ctrl-C, a SIGTERM handler that raises ``SystemExit``) has its
    Python handler run at the first bytecode after the C call returns: its exception
    would leave a write that no rollback knows of. While a session's calls run on the
    main thread (where Python runs signal handlers), each signal of ``_HELD`` that has a
    Python handler goes through :meth:`_handler`, which runs the handler at once outside
    a write and holds it back to the end of one (:meth:`leave`). Between calls, and on
    other threads, nothing changes.
    """

    def __init__(self) -> None:
        self.depth = 0  # writes in progress whose saves are not registered yet
        self._pending: list[int] = []  # signals held back, in order of arrival, once each
        self._handlers: dict[int, Any] = {}  # signal -> the handler it had: taken over now
        # The handlers taken over, by signal, oldest first (the last _KNOWN): _handler
        # runs the newest. A handler set during a load may call the one it found, which
        # was _handler, during the load and after it; and a later load may take it over
        # in turn. So a call that comes back from the handler _handler called (with the
        # same frame) runs the one before it, and so does a call while a handler that
        # is in place calls it: never the caller again.
        self._known: dict[int, list[Any]] = {}
        self._chains: dict[int, tuple[Any, int]] = {}  # signal -> (frame, depth) running
        self._uses = 0

    def install(self) -> bool:
        """Take over the Python signal handlers (once, however many sessions nest);
        False off the main thread, where there is nothing to hold back."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self._uses == 0:
            for sig in _HELD:
                try:
                    handler = _sig.getsignal(sig)
                    if callable(handler) and handler != self._handler:
                        # (recorded first: a signal that comes in between finds it)
                        self._handlers[sig] = handler
                        known = self._known.setdefault(sig, [])
                        if handler in known:
                            known.remove(handler)
                        known.append(handler)
                        del known[:-_KNOWN]  # (a fresh closure each step: not kept forever)
                        _sig.signal(sig, self._handler)
                except (OSError, ValueError, RuntimeError):  # (one Python cannot set)
                    self._handlers.pop(sig, None)
        self._uses += 1
        return True

    def uninstall(self) -> None:
        """The end of a session's call: the last one puts the handlers back; then what
        was held back runs, where no write is in progress."""
        self._uses -= 1
        if self._uses == 0:
            self.depth += 1  # (a signal that comes meanwhile waits: the handlers first)
            try:
                for sig, handler in self._handlers.items():
                    try:
                        if _sig.getsignal(sig) == self._handler:  # (not one set since)
                            _sig.signal(sig, handler)
                    except (OSError, ValueError, RuntimeError):
                        continue
                self._handlers = {}
            finally:
                self.depth -= 1
        if self.depth == 0 and self._pending:
            self._deliver()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.depth:
            if signum not in self._pending:  # (as the OS does: one pending of a kind)
                self._pending.append(signum)
            return
        known = self._known.get(signum, [])
        installed = _sig.getsignal(signum)
        if installed != self._handler and installed in known:
            # Called by the handler in place, which found this one: the ones before it.
            known = known[:known.index(installed)]
        chain = self._chains.get(signum)
        # Called back, with its frame, by the handler this one called: the next older
        # one. Else a signal of its own (one that came while a handler ran, say).
        level = chain[1] + 1 if chain is not None and chain[0] is frame else 0
        handler = known[-1 - level] if level < len(known) else None
        self._chains[signum] = (frame, level)
        try:
            if callable(handler):
                handler(signum, frame)
            elif signum == signal.SIGINT:  # (never swallowed)
                signal.default_int_handler(signum, frame)
        finally:
            if chain is None:
                self._chains.pop(signum, None)
            else:
                self._chains[signum] = chain

    def _deliver(self) -> None:
        """Raise the held-back signals again, for their handlers to run now as Python
        runs them: each in turn, and where one raises, the others at the next chance
        (blocked while raised, where the platform can, so that all are pending when
        one handler runs)."""
        pending, self._pending = self._pending, []
        mask = getattr(signal, "pthread_sigmask", None)
        if mask is None or len(pending) == 1:
            for signum in pending:
                signal.raise_signal(signum)
            return
        before = mask(signal.SIG_BLOCK, pending)
        try:
            for signum in pending:
                signal.raise_signal(signum)
        finally:
            mask(signal.SIG_SETMASK, before)  # (all delivered here)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block (a rollback), on the main thread, signals wait for its end: a
        second Ctrl-C does not stop a rollback halfway."""
        installed = self.install()
        if installed:
            self.depth += 1
        try:
            yield
        finally:
            if installed:
                self.depth -= 1
                self.uninstall()  # (what was held back runs here)

    def leave(self) -> None:
        """The end of a write whose save is registered: run what was held back."""
        self.depth -= 1
        if self._pending and not self.depth:
            self._deliver()


_KNOWN = 8  # handlers remembered per signal (see _SignalDeferral._known)

# The signals held back: those a Python program handles, and whose handler may raise
# (Ctrl-C, termination and hang-up, timers, the user's); looking at all 64 would cost a
# report 30 us more after a garbage collection.
_HELD = tuple(int(getattr(signal, name)) for name in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGUSR1",
    "SIGUSR2") if hasattr(signal, name))

try:  # the C module under ``signal``: the same calls, without its enums (20x faster)
    import _signal as _sig
except ImportError:  # pragma: no cover - not CPython
    _sig = signal  # type: ignore[misc]

_DEFERRAL = _SignalDeferral()


def _main_thread_forks() -> None:
    global _forked_by_main
    _forked_by_main = threading.current_thread() is threading.main_thread()


def _deferral_after_fork() -> None:
    """In a child forked by another thread while loads on the parent's main thread held
    the signal handlers: those loads never end in the child (it has the forking thread
    only, now its main thread), so the handlers they took over are put back, and what
    they held back is dropped, not run: those were the parent's signals, which the
    parent runs where its hold ends (the child's own, later, run as they come). Their
    state kept the child's handlers taken over for good, and a child forked mid-write (a
    report's or a transactional load's) held back every Ctrl-C, and every signal a
    Python handler stops it with, forever. (A child forked by a load's own thread goes
    on with that load, which ends as it does in the parent.)"""
    if _forked_by_main or not _DEFERRAL._uses:
        return
    d = _DEFERRAL
    for sig, handler in d._handlers.items():
        try:
            if _sig.getsignal(sig) == d._handler:
                _sig.signal(sig, handler)
        except (OSError, ValueError, RuntimeError):
            continue
    d._handlers, d._pending, d._chains = {}, [], {}
    d.depth = d._uses = 0


_forked_by_main = True
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_main_thread_forks, after_in_child=_deferral_after_fork)


class WriteSession:
    """The interception state of one load.

    - ``sparse`` calls NaN-merge same-shaped floating-point ``copy_`` into runtime tensors
      and reject every other runtime write, overlapping destinations within a call, and
      a call that reports names without writing (CONTRACT §4).
    - ``save_regions``: save each runtime region before its first write of the load;
      :meth:`restore` puts every saved region back bit for bit (``transactional=True``).
    - ``recorder``: told of every call and every runtime write (inspection).
    - ``count_changes``: count the elements whose bits each write changed.
    - ``violations``: what an observed call (``call(..., observed=True)``) did against the
      contract without being stopped: an observer lets the loader finish and its caller
      raises the first of them afterwards.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        save_regions: bool = False,
        recorder: WriteRecorder | None = None,
        count_changes: bool = False,
        index: RuntimeIndex | None = None,
    ) -> None:
        # (``index``: one of ``model`` as it is now, where the caller has built it)
        self.index = RuntimeIndex(model) if index is None else index
        self.save_regions = save_regions
        self.recorder = recorder
        self.count_changes = count_changes
        # Knowing which patch fed a write costs a set lookup per op; errors and reports
        # both name the patch, so it is always on.
        self.track_sources = True
        self.provenance = _Provenance()
        # numbers the loader's own casts made NaN in sparse calls (kept for the whole
        # load: a loader may cast in one call and copy in a later one)
        self.lost = _LostMarks()
        self.provenance.lost = self.lost  # (read by _Provenance._sliced)
        self.saved: list[SavedRegion] = []
        # Saves whose statistics were measured while writing, by storage (an index of
        # their spans), until a later write reaches one and makes its numbers stale (see
        # _forget_measured).
        self._measured: dict[tuple, _RegionIndex] = {}
        # The views saved whole, as _region_key()s (see _unguarded_compared_copy).
        self._saved_regions: set[tuple] = set()
        # The saves by the id of the tensor they were saved through (the view, alive in
        # the save), for _note_rebinding: indexed up to _by_view_upto of ``saved``, as
        # the saves come (a list that ``saved`` no longer is is indexed anew).
        self._by_view: dict[int, list[SavedRegion]] = {}
        self._by_view_of: list[SavedRegion] | None = None
        self._by_view_upto = 0
        self._sparse = False
        self._nan_masked = False
        self.violations: list[ContractViolation] = []
        self._chunk = -1
        # The regions this call wrote, by storage: only those of one storage can overlap.
        self._call_regions: dict[tuple, _RegionIndex] = {}
        self._call_writes = 0
        # Watched dense calls that returned names (or None) with something staged but in
        # which no write was seen: their indices (see _note_if_quiet); and the first one
        # in words, with what it returned
        self.quiet_calls: list[int] = []
        # A report's quiet call that came while a tensor an earlier call rebound or
        # registered was in the model: it may have written into that one, unwatched (a
        # rollback puts that back with the tensor)
        self.quiet_after_rebinding = False
        self.first_quiet: tuple[str, list[str] | None] | None = None
        # (position, name) of each patch of the call in progress (position None: an
        # observed name that matches no patch)
        self._call_patches: tuple[tuple[int | None, str], ...] = ()
        self._observed_call = (False, False)  # (observed, maybe_sparse) of the call
        # runtime tensor name -> the patch of the last copy into it in this call (None:
        # not traced), which an error that names no patch reports as a fact
        self._call_fed: dict[str, tuple[int | None, str] | None] = {}
        self._patches: dict[int, Any] = {}
        # (patch position, dtype) -> whether a value of that patch becomes NaN in that
        # dtype (see _loses_numbers)
        self._lossy: dict[tuple[int, torch.dtype], bool] = {}
        self._bindings: dict[str, torch.Tensor] | None = None
        self._model_gpus: set[torch.device] | None = None  # (see _gpus)
        # the targets a restore() could not write back (keeping what the load wrote)
        self.unrestored: list[str] = []
        self.rolled_back = False  # restore() ran (a transactional rollback began)
        # a transactional load's registrations before its first call (its rollback's)
        self.bindings: dict[str, torch.Tensor] | None = None
        # ... and each runtime tensor's requires_grad then (RuntimeIndex.grad_flags)
        self.grad_flags: list[bool] | None = None
        # Watched dense calls: runtime tensors the loader rebound (``param.data = w``) or
        # registered anew, by name -> the tensor now (see _note_rebinding).
        self.rebound: dict[str, torch.Tensor] = {}
        # ... and under names the model did not have: name -> the tensor registered,
        # recorded as a "register" write of the whole tensor; or a known tensor tied
        # under a new name: name -> the tensor's first name (no write)
        self.registered: dict[str, torch.Tensor] = {}
        self.ties: dict[str, str] = {}
        self._binding_ptrs: list[int] | None = None  # (see _note_rebinding)
        # the data pointer of each of the index's tensors as last looked at: its binding's,
        # or where a later call rebound it (see _note_rebinding)
        self._looked_ptrs: list[int] | None = None
        # True when the look at the module tree after the last call found it as the
        # index found it (RuntimeIndex.unchanged): a caller that knows nothing has
        # touched the tree since need not look again.
        self.tree_as_found = False
        # The signal deferral while a call runs on the main thread, else None (see
        # _SignalDeferral): the compiled writes hold signals back until saved.
        self._guard: _SignalDeferral | None = None
        # The generators of the calls' blocks (see call()), innermost last: one that a
        # signal stopped at its edge is never resumed, and end_calls() ends it.
        self._open_calls: list[Any] = []

    # -- one load_weights call -------------------------------------------------------

    def call(self, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager[_CallResult]:
        """:meth:`_call` (see there), remembered so that :meth:`end_calls` can end it
        (none is ended here). Calls of one session do not nest: an observed load passes
        a ``load_weights`` that calls itself straight on, its writes the outer call's."""
        scope = self._call(*args, **kwargs)
        self._open_calls = [g for g in self._open_calls if g.gi_frame is not None]
        self._open_calls.append(scope.gen)  # type: ignore[attr-defined]
        return scope

    def end_calls(self) -> None:
        """End the calls' blocks that did not end: a signal (Ctrl-C, a handler that
        raises) that lands in ``contextlib``'s ``__exit__`` before it resumes a block
        leaves the block suspended, its interception modes in place and its signal
        handlers installed; the exception still propagates. Closing the block runs its
        ``finally`` (as an error of the call). The loader calls this before a rollback
        and when a load ends, where no call of it runs; a no-op otherwise."""
        opened, self._open_calls = self._open_calls, []
        for gen in reversed(opened):  # (innermost first)
            if gen.gi_frame is not None and not gen.gi_running:
                gen.close()
        self._pop_own_modes()

    def _pop_own_modes(self) -> None:
        """Take this session's interception modes off the top of this thread's mode
        stacks: ones a signal left there, landing inside torch's own ``__enter__`` or
        ``__exit__`` of a mode (a window no ``finally`` of patchkit's covers). Another's
        mode above them stays, and so do they."""
        from torch.utils._python_dispatch import _pop_mode

        while (n := torch._C._len_torch_dispatch_stack()) and _is_own(
                torch._C._get_dispatch_stack_at(n - 1), self):
            _pop_mode()
        while (n := torch._C._len_torch_function_stack()) and _is_own(
                torch._C._get_function_stack_at(n - 1), self):
            torch._C._pop_torch_function_stack()

    @contextlib.contextmanager
    def _call(
        self,
        chunk: int,
        staged: Sequence[tuple[str, torch.Tensor]],
        positions: Sequence[int],
        *,
        sparse: bool,
        patches: Sequence[Any] | None = None,
        observed: bool = False,
        maybe_sparse: bool = False,
    ) -> Iterator[_CallResult]:
        """Intercept the writes of one ``load_weights`` call made inside the block.

        The caller stores the call's return value in the yielded object's ``returned``.
        ``patches``: the call's patches (in the order of ``staged``), which lets a saved
        sparse write recompute where it wrote from its patch instead of keeping offsets.
        ``observed``: another loader staged this call (``sparse`` is then False: nothing
        is merged here). A ``copy_`` from a NaN-masked sparse patch's staged tensor is then
        taken for the NaN-merge the contract asks of the loader: only the elements whose
        source is not NaN count as written and are saved, and an element that turns NaN
        where the source was NaN is recorded in :attr:`violations`. A call's patch that is
        ``None`` (a name the observer could not match) may be sparse when
        ``maybe_sparse``: its copies are then checked as well.
        """
        self._sparse = sparse
        self._observed_call = (observed, maybe_sparse)  # (what stage_more needs of them)
        self._patches = dict(zip(positions, patches)) if patches is not None else {}
        self.provenance.patches = self._patches
        self._nan_masked = observed and any(
            _may_be_masked(p, maybe_sparse) for p in self._patches.values())
        # (an observed loader merges NaN-masked patches itself: a copy of data an op mixed
        # is recorded as a violation, :meth:`_note_mixed`)
        self.provenance.mixing = sparse or self._nan_masked
        self._chunk = chunk
        self._call_regions = {}
        self._call_writes = 0
        self._call_patches = tuple(
            (pos if pos >= 0 else None, name) for pos, (name, _) in zip(positions, staged))
        self._call_fed = {}
        # (each staged tensor's storage key, taken once: the provenance keeps it too)
        keys = [_storage_key(t) if isinstance(t, torch.Tensor) and t.numel() else None
                for _, t in staged]
        self.tree_as_found = False
        if sparse:
            # What earlier calls staged stays traced while the loader keeps it (a loader
            # that holds q until k and v come, in later calls, then packs them): its
            # NaN are a sparse patch's "keep" still, its dtype its own.
            self.provenance.prune()
        else:
            self.provenance.clear()
        if self.track_sources:
            for pos, (name, t), key in zip(positions, staged, keys):
                # (a negative position: an observed name that matches no patch)
                self.provenance.add_staged(pos if pos >= 0 else None, name, t, key)
        result = _CallResult()
        watch = not sparse and self.recorder is not None
        if (sparse or watch) and self._bindings is None:
            # Once per load: a sparse call that rebinds is undone (the originals bound
            # again); a watched dense one is recorded (see _note_rebinding).
            self._bindings = self.index.bindings()
        bindings = self._bindings if sparse else None
        if self.recorder is not None:
            self.recorder.on_call_start(chunk, staged)
            gpus = self._gpus(staged)
            _wait_for(gpus)  # (work queued before the call is not the call's)
        t0 = time.perf_counter()
        error = True
        guarded = self.save_regions and _DEFERRAL.install()
        self._guard = _DEFERRAL if guarded else None
        if not _dynamo_told:
            _keep_dynamo_out()
        try:
            try:
                with _Mode(self) if sparse or not _DenseMode.fits() else _DenseMode(self):
                    yield result
            except BaseException as exc:
                if sparse:
                    self._undo_after_raise(bindings, exc)
                raise
            if sparse:
                self._check_after_sparse_call(bindings, result.returned, staged, positions)
            error = False
        finally:
            try:
                # (a sparse call has its rebindings undone: refused above when it returns,
                # put back when it raised; what could not be put back, a tensor the model
                # keeps outside nn.Module's registries, a report shows)
                if watch or (sparse and error and self.recorder is not None):
                    self._note_rebinding()
                if not sparse and not error and self.save_regions:
                    self._note_if_quiet(result.returned, staged, positions)
                if self.recorder is not None:
                    _wait_for(gpus)  # a GPU's copies run after their launch returns
                    self.recorder.on_call_end(
                        chunk, result.returned, time.perf_counter() - t0, error)
                if sparse:
                    self.provenance.keep_past_call(keys, staged)
                self._sparse = False
                self.provenance.mixing = False
                self._nan_masked = False
            finally:
                if guarded:
                    self._guard = None
                    _DEFERRAL.uninstall()  # (a signal held back runs here at the latest)

    def stage_more(self, position: int, name: str, staged: torch.Tensor,
                   patch: Any | None) -> None:
        """One more entry of the observed call in progress (see :meth:`_call`), known only
        now: a loader that hands ``load_weights`` an iterator (a generator that stages
        each patch as the model asks for it) has its entries taken one by one, as the
        model takes them, so that what each one holds when the model reads it is what
        is written. ``position``: the patch it was matched to (negative: none), whose
        record is ``patch``. The caller keeps its own lists of the call's entries (the
        ones it passed to :meth:`call`), which the call's end reads."""
        observed, maybe_sparse = self._observed_call
        pos = position if position >= 0 else None
        key = _storage_key(staged) if staged.numel() else None
        self._call_patches += ((pos, name),)
        self._patches[position] = patch
        if observed and _may_be_masked(patch, maybe_sparse):
            self._nan_masked = True
            self.provenance.mixing = True
        if self.track_sources:
            self.provenance.add_staged(pos, name, staged, key)
        on_staged = getattr(self.recorder, "on_staged", None)
        if on_staged is not None:
            on_staged(name, staged)

    def _gpus(self, staged: Sequence[tuple[str, torch.Tensor]]) -> set[torch.device]:
        """The CUDA devices of the model's tensors (found once per load) and of ``staged``:
        those a recorded call's time waits for. (``is_cuda`` first: a tensor's ``device``
        is a new object each time it is read.)"""
        if self._model_gpus is None:
            tensors = self.index.tensors.values()
            self._model_gpus = ({t.device for t in tensors if t.is_cuda}
                                if any(map(_IS_CUDA, tensors)) else set())
        if not any(_IS_CUDA(t) for _, t in staged):
            return self._model_gpus
        return self._model_gpus | {t.device for _, t in staged if t.is_cuda}

    def _note_rebinding(self) -> None:
        """After a watched dense call: a runtime tensor whose storage the call replaced
        (``param.data = w``) or that it registered anew (``module.w = nn.Parameter(w)``)
        was written whole by no op a mode sees. Record that as one write of the whole
        tensor (op ``"rebind"``, its source the new data: a staged tensor names its
        patch) and keep the tensor now in :attr:`rebound`; its values before the load are
        those of the original storage, which the bindings still hold."""
        tensors = self.index.tensors
        binding_ptrs = self._bound_ptrs()
        # (the original storages are alive in the bindings: new data has another address)
        ptrs = list(map(_DATA_PTR, tensors.values()))
        # Address 0 (the meta device of a dry run, an empty tensor) tells nothing: those
        # are compared by storage (a meta model's param.data = w was seen as no change).
        moved_at_0 = set() if 0 not in ptrs else {
            n for (n, t), p in zip(tensors.items(), ptrs)
            if p == 0 and _storage_key(t) != _storage_key(self._bindings[n])}
        if ptrs == binding_ptrs and not moved_at_0 and self.index.unchanged():
            self.tree_as_found = True
            return  # (the common case: nothing rebound, replaced or registered)
        # The tensors rebound since the last look: a tensor rebound in an earlier call
        # and left there was looked at then (looking at each again after every call, in
        # Python, made a load of one rebinding per call quadratic in its tensors).
        if self._looked_ptrs is None:
            self._looked_ptrs = list(binding_ptrs)
        looked = self._looked_ptrs
        since = set(itertools.compress(range(len(ptrs)), map(operator.ne, ptrs, looked)))
        names = list(tensors)
        if moved_at_0:
            since.update(i for i, n in enumerate(names) if n in moved_at_0)
        rebound = {names[i]: tensors[names[i]] for i in sorted(since)
                   if ptrs[i] != binding_ptrs[i] or names[i] in moved_at_0}
        for i in since:
            looked[i] = ptrs[i]
        found = dict(rebound)
        with self.index.one_look():
            replaced = self.index.replaced()
            # A tied tensor's other name registered anew (``model.lm_head.weight =
            # nn.Parameter(w)``): untied, it is a runtime tensor of its own from now on,
            # whose values before the load were the tied tensor's.
            untied = self.index.replaced_aliases()
            added = self.index.added(replaced + untied)
        if replaced or untied or added:
            now = dict(named_tensors(self.index.model))
            # (a tensor moved to the other registry under its name: nothing written)
            found.update({n: now[n] for n in replaced
                          if n in now and now[n] is not self.index.tensors[n]})
            for n in untied:
                if n in now and now[n] is not self.index.tensors[self.index.aliases[n]]:
                    found[n] = now[n]
                    self._bindings.setdefault(n, self._bindings[self.index.aliases[n]])
            ties = self.index.ties_among((n, now[n]) for n in added) if added else {}
            for n in added:
                t = now[n]
                if n in ties:  # a known tensor under a new name: a tie, nothing written
                    self.ties[n] = ties[n]
                    self.registered.pop(n, None)
                    continue
                self.ties.pop(n, None)
                if self.registered.get(n) is t:
                    continue  # registered in an earlier call, and recorded then
                self.registered[n] = t
                self._call_writes += 1
                self._record("register", t.data, n, 0, t.data,
                             None if t.is_meta else t.numel())  # (a dry run: not known)
        new = {}
        for name, t in found.items():
            last = self.rebound.get(name)
            if last is not None and _storage_key(last) == _storage_key(t) and (
                last.shape == t.shape
            ):
                continue  # rebound in an earlier call, and recorded then
            new[name] = t
        # A save whose view was a Parameter this call rebound (``param.copy_(t)`` before
        # ``param.data = w``) now reads the new storage: point it at the original one,
        # where it was written.
        # (the saves are found by the id of their view, indexed as they come: going
        # through every save after each call that rebinds made a load of one rebinding
        # per call quadratic in its saves)
        moved = {id(t): self._bindings[n] for n, t in rebound.items() if n in new}
        if moved:
            by_view = self._saves_by_view()
            for key, original in moved.items():
                for s in by_view.pop(key, ()):
                    s.view = original
                    s.__dict__.pop("region", None)  # (a cached_property of the view)
                    by_view.setdefault(id(original), []).append(s)
        for name, t in new.items():
            # (.data, not detach(): a Parameter made in inference mode and rebound outside
            # it holds data whose detach() raises "Inference tensors do not track version
            # counter")
            t = t.data
            self.rebound[name] = t
            old = self._bindings[name]
            if old.is_meta or t.is_meta:
                changed = None  # (a dry run: no numbers to compare)
            elif old.shape == t.shape and old.dtype == t.dtype:
                changed = int(count_true(changed_mask(old.reshape(-1).to(t.device),
                                                      t.reshape(-1))))
            else:
                changed = t.numel()
            self._call_writes += 1
            self._record("rebind", t, name, 0, t, changed)

    def _saves_by_view(self) -> dict[int, list[SavedRegion]]:
        """:attr:`saved` by the id of each save's view (which the save keeps alive), in
        save order: the saves made since the last look are added to the index, which is
        made anew where :attr:`saved` is another list or shorter than what was indexed.
        (A save leaves the list in place only in :meth:`_refused_after_writing`: its op's
        own, made in the call under way, so after every save indexed, which this reads
        at a call's end.)"""
        saved = self.saved
        if saved is not self._by_view_of or self._by_view_upto > len(saved):
            self._by_view, self._by_view_of, self._by_view_upto = {}, saved, 0
        by_view = self._by_view
        for s in itertools.islice(saved, self._by_view_upto, None):
            by_view.setdefault(id(s.view), []).append(s)
        self._by_view_upto = len(saved)
        return by_view

    def _bound_ptrs(self) -> list[int]:
        """The data pointers of the load's bindings, in the order of the index's tensors:
        read once per load (the bindings keep those storages alive, so they stay put)."""
        if self._binding_ptrs is None:
            self._binding_ptrs = list(map(_DATA_PTR, map(self._bindings.get,
                                                         self.index.tensors)))
        return self._binding_ptrs

    def forget_undone_rebindings(self) -> None:
        """When the load ends: drop from :attr:`rebound` the names bound to their
        original tensor again (by the loader itself, or a rollback: this load's own or
        one the session did not see), and follow the ones bound to yet another tensor.
        A name is bound to its original again when the model holds the very object it
        held before the load, viewing the original storage the same way."""
        if not self.rebound and not self.registered and not self.ties:
            return
        # what the model holds now (the index keeps the tensors registered when it was
        # built: a name registered anew still has its original one there)
        now = dict(named_tensors(self.index.model))
        for name, t in list(self.registered.items()):
            live = now.get(name)
            if live is None:
                del self.registered[name]  # removed again (by the loader, or a rollback)
            elif live is not t:
                self.registered[name] = live
        for name, first in list(self.ties.items()):
            if now.get(name) is not self.index.tensors[first]:
                del self.ties[name]  # (removed again)
        for name, t in list(self.rebound.items()):
            live = now.get(name)
            if live is None:
                continue
            original = self.index.tensors.get(self.index.aliases.get(name, name))
            if live is original and _same_view(live, self._bindings[name]):
                del self.rebound[name]
            elif not _same_view(live, t):
                self.rebound[name] = live.data

    def _note_if_quiet(self, returned, staged, positions) -> None:
        """After a dense call whose writes are saved (a transactional load, a report): a
        call that returned names (or ``None``) with something staged, yet in which no
        write was seen, goes into :attr:`quiet_calls`. Either it wrote nothing (a loader
        that skips weights another rank holds, or ones whose bits it already has) or it
        wrote where no mode sees: on another thread, through a storage or numpy, with
        torch function handling off, in TorchScript. Those writes are not saved, so a
        rollback cannot put them back; it says so when it runs (a warning), and a report
        lists such calls in its summary. Not an error: the first kind of call is a
        correct one. A report's call that rebound or registered a tensor has that as a
        write (:meth:`_note_rebinding`); a transactional load without a report looks only
        at the runtime tensors the call names (:meth:`_renamed_or_rebound`: a pass over
        every tensor after each call would make a load of many calls quadratic), and its
        rollback says when the load rebound or registered any."""
        if self._call_writes or (returned is not None and not returned) or all(
                t.numel() == 0 for _, t in staged):
            return
        if self.recorder is None and self.bindings is not None:
            names = [n for n, _ in staged]
            if returned is not None and len(returned) <= 4 * len(names):
                names += returned  # (not a loader's every name so far: that is quadratic)
            if self._renamed_or_rebound(names):
                return
        self.quiet_calls.append(self._chunk)
        if self.rebound or self.registered:
            self.quiet_after_rebinding = True
        if self.first_quiet is None:
            self.first_quiet = (_call_named(self._chunk, positions, staged),
                                None if returned is None else sorted(returned))

    def _renamed_or_rebound(self, names) -> bool:
        """Whether one of the runtime tensors ``names`` (runtime names, or tied names of
        them) now holds other storage than when the load began, or is no longer what its
        module holds under its name: a call that rebound or registered it wrote no element
        a mode sees, and a rollback puts it back."""
        tensors, aliases, bindings = self.index.tensors, self.index.aliases, self.bindings
        model, tied = self.index.model, self.index.tied_names
        for n in names:
            n = aliases.get(n, n)
            t = tensors.get(n)
            if t is None or n not in bindings:
                continue  # (a checkpoint name only, such as q_proj of a packed qkv_proj)
            if _storage_key(t) != _storage_key(bindings[n]):
                return True
            for name in (n, *tied.get(n, ())):
                path, _, attr = name.rpartition(".")
                try:
                    if getattr(model.get_submodule(path), attr) is not t:
                        return True
                except AttributeError:
                    return True  # (removed)
        return False

    def _put_back(self, bindings: dict[str, torch.Tensor]) -> _PutBack:
        """After a sparse call: undo what it changed past its copies, each of which may
        hold the staged NaN (a registry swapped, a tensor rebound, registered anew under a
        name, a tied tensor's other name included, removed, or moved between a module's
        parameters and buffers, a new one registered), and say what that was. A known
        tensor tied under a new name, and a submodule or slot with no tensor, hold no
        staged values and stay. Nothing is looked at closer when the tree is as the index
        found it, the common case, at the cost of one look."""
        index = self.index
        # (bindings is this load's own: its pointers, read once, are kept)
        rebound = index.rebound(
            bindings, self._bound_ptrs() if bindings is self._bindings else None)
        changed = index.structure_changed()
        replaced: list[str] = []
        added: list[str] = []
        ties: dict[str, str] = {}
        gone: set[str] = set()
        moved: set[str] = set()
        held = {n: index.tensors[n].data for n in rebound}
        if changed is None:
            # (structure_changed() found every module holding its registry dicts: the
            # looks below need not read them again)
            with index.one_look(registries=True):
                same = index.unchanged()
                if not same:
                    replaced = index.replaced() + index.replaced_aliases()
                    named = index.added_tensors(replaced)
            if same:
                self.tree_as_found = True
            else:
                ties = index.ties_among(named) if named else {}
                added = [n for n, _ in named if n not in ties]
                held.update((n, t) for n, t in named if n not in ties)
                if replaced or added:
                    now, _ = _named_now(index.model)
                    held.update((n, now[n]) for n in replaced if now.get(n) is not None)
                    gone = set(replaced) - now.keys()
                    # (the same tensor under its name, in the other registry)
                    moved = {n for n in replaced
                             if now.get(n) is index.tensors[index.aliases.get(n, n)]}
        if changed is not None or replaced or added:
            # (a module's own registry dicts go back first, then the rest of the tree)
            index.undo()
        left = index.not_undone() if changed is not None or replaced else []
        for n in rebound:
            index.tensors[n].data = bindings[n]  # the original storage put back
        return _PutBack(changed, rebound, replaced, added, ties, gone, moved, left, held)

    def _undo_after_raise(self, bindings: dict[str, torch.Tensor], exc: BaseException) -> None:
        """A sparse call that raised: what it rebound (``param.data = w``), registered
        (``module.w = nn.Parameter(w)``) or changed in the module tree may hold the staged
        NaN, so it is put back (:meth:`_put_back`), as after a call that returns (where it
        is refused); the copies it made stay (CONTRACT §5). ``exc`` propagates, with a
        note that says what was put back (on Python 3.10, whose traceback shows no notes,
        in ``__notes__`` and as a warning too). A transactional load's rollback puts back
        all of it, and its copies too: nothing to do here."""
        if self.bindings is not None:
            return
        back = self._put_back(bindings)
        names = list(dict.fromkeys([*back.rebound, *back.replaced, *back.added]))
        if back.changed is None and not names:
            return
        shown = ", ".join(map(repr, names[:3])) + (f" and {len(names) - 3} more"
                                                    if len(names) > 3 else "")
        did = " and ".join(
            ([f"rebound or registered runtime tensors ({shown})"] if names else [])
            + ([back.changed] if back.changed is not None else []))
        note = (f"(patchkit: load_weights call {self._chunk} of a sparse load raised after it "
                f"{did}, which may hold the staged NaN; that was put back as it was" + (
                    "" if not back.left else f", except {back.left[0]!r}, which the model "
                    "does not keep in nn.Module's registries") + "; the call's copies stay)")
        native = hasattr(exc, "add_note")  # (before add_note: False on Python 3.10)
        add_note(exc, note)  # (on 3.10 into __notes__, which its own traceback omits)
        if native:
            return
        from .loader import _outside_patchkit  # (Python 3.10; loader imports this module)

        with contextlib.suppress(Warning):  # (warnings as errors: the loader's error stays)
            warnings.warn(note, UserWarning, stacklevel=_outside_patchkit())

    def _check_after_sparse_call(self, bindings, returned, staged, positions) -> None:
        # (named only where a message is raised: the checks run after every sparse call)
        call = functools.partial(_call_named, self._chunk, positions, staged)
        # What a whole call did wrong names its patch where the call had one (the
        # message lists the first few), else where the tensor it put in the model is traced
        # to one (``param.data = w``, a clone of it); which of several patches a missing
        # copy served is not known.
        one = ((positions[0] if positions[0] >= 0 else None, staged[0][0])
               if len(staged) == 1 else (None, None))
        pos, name = one
        # Each change may hold the staged NaN: all are undone before the first is raised.
        back = self._put_back(bindings)
        left = back.left
        if back.changed is not None:
            # A registry dict of a module's own (``m._parameters = {...}``), or none, or an
            # attribute that shadows a registered name: what it holds is the loader's.
            undone = ("The module tree was put back as it was" if not left else
                      f"The module tree was put back, but {left[0]!r} could not be registered "
                      "again (the model does not keep it in nn.Module's registries), so the "
                      "model may hold the staged NaN")
            raise ContractViolation(
                f"{call()} {back.changed}; a sparse load needs same-shaped floating-point copy_ "
                f"into the existing storage. {undone}",
                position=pos, name=name, reason="rebinding",
                value=back.changed,
            )
        if back.ties and self.recorder is not None:
            self.ties.update(back.ties)  # (a report knows the new name)
        replaced, rebound, added = back.replaced, back.rebound, back.added
        culprit = (replaced or rebound or added or [None])[0]
        if culprit is not None and len(staged) > 1:
            t = back.held.get(culprit)
            hit = self.provenance.lookup(t) if isinstance(t, torch.Tensor) else None
            if hit is not None:
                pos, name = hit[0], hit[1]
        if replaced:
            first = self.index.aliases.get(replaced[0])
            tied = f" (a tied name of {first!r})" if first is not None else ""
            did = (f"removed runtime tensor {replaced[0]!r}{tied} (e.g. `del module.weight`)"
                   if replaced[0] in back.gone else
                   f"moved runtime tensor {replaced[0]!r}{tied} between the module's parameters "
                   "and buffers" if replaced[0] in back.moved else
                   f"registered a new tensor as runtime tensor {replaced[0]!r}{tied} (e.g. "
                   "`module.weight = nn.Parameter(w)`) instead of copying into the existing one")
            undone = ("The original tensor was registered again" if not left else
                      f"The original tensor could not be registered again ({left[0]!r}: the "
                      "model does not keep it in nn.Module's registries), so the model may "
                      "hold the staged NaN")
            raise ContractViolation(
                f"{call()} {did}; a sparse load needs same-shaped floating-point copy_ into the "
                f"existing storage. {undone}",
                position=pos, name=name, reason="rebinding", value=replaced[0],
            )
        if rebound:
            raise ContractViolation(
                f"{call()} replaced the storage of runtime tensor {rebound[0]!r} (e.g. "
                "`param.data = w`) instead of copying into it; a sparse load needs same-shaped "
                "floating-point copy_ into the existing storage. The original storage was put "
                "back",
                position=pos, name=name, reason="rebinding", value=rebound[0],
            )
        if added:
            raise ContractViolation(
                f"{call()} registered a new runtime tensor {added[0]!r} (e.g. "
                "`module.extra = nn.Parameter(w)`), which may hold the staged NaN; a sparse "
                "load needs same-shaped floating-point copy_ into the existing storage. It "
                "was removed again",
                position=pos, name=name, reason="new runtime tensor",
                value=added[0],
            )
        nothing_to_write = all(t.numel() == 0 for _, t in staged)
        if (
            self._call_writes == 0
            and not nothing_to_write
            and (returned is None or len(returned) > 0)
        ):
            said = ("returned None" if returned is None
                    else f"returned {_returned_text(sorted(returned))}")
            pos, name = one
            raise ContractViolation(
                f"{call()} {said} "
                "without copying into any runtime parameter or buffer; a sparse load cannot "
                "tell what it did. A loader that owns none of these weights returns an empty "
                "collection. (A loader that copies on another thread is not watched: its "
                "copies may have put the staged NaN into the model, which no rollback "
                f"sees{self._nan_holders()})",
                position=pos, name=name, reason="without copying",
                value=None if returned is None else tuple(sorted(returned)),
            )

    def _nan_holders(self, most: int = 3) -> str:
        """For a refusal that says the staged NaN may be in the model: which runtime
        tensors hold NaN now, with how many (the first ``most``), as a clause; empty when
        none does. Reads every floating-point tensor of the model once (an error path)."""
        found = []
        for name, t in self.index.tensors.items():
            try:
                if t.is_floating_point() and not t.is_meta and t.numel():
                    n = int(torch.isnan(t.detach()).sum())
                    if n:
                        found.append((name, n))
            except (RuntimeError, NotImplementedError):  # (no isnan for some dtypes)
                continue
        if not found:
            return ""
        shown = ", ".join(f"{n!r} ({_count(k, 'element')})" for n, k in found[:most])
        more = f" and {_count(len(found) - most, 'more tensor')}" if len(found) > most else ""
        return f"; runtime tensors that hold NaN now: {shown}{more}"

    # -- a write into runtime storage --------------------------------------------------

    def _plain_copy(self, args, kwargs) -> torch.Tensor | None:
        """``dest.copy_(src)`` seen by :class:`_DenseMode`: into a runtime tensor, of
        plain tensors, where autograd has nothing to record, written as
        :meth:`_runtime_write` writes it (the version counter bumped as torch would).
        ``None``: not such a copy, and nothing done."""
        if kwargs or len(args) != 2:
            if len(args) != 3 or args[2] is not False or kwargs:
                return None
            args = args[:2]
        dest, src = args
        if type(dest) not in _PLAIN or type(src) not in _PLAIN:
            return None
        if src.is_neg() or src.is_conj() or dest.is_neg() or dest.is_conj():
            return None  # (the general path: it makes the source plain, refuses the view)
        if (dest.requires_grad or src.requires_grad) and torch.is_grad_enabled():
            return None
        if not dest.numel():
            return None
        key = _storage_key(dest)
        own = self.index.owner(dest, key)
        if own is None:
            return None
        # (a storage of one runtime tensor, the common case: no cut into pieces to look
        # for, _pieces_by_owner finds none; owner() has listed the storage's tensors)
        alone = len(self.index._owners[key]) == 1
        size = dest.element_size()
        # The version counter moves once, as torch's copy_ moves it: a write done by torch
        # ops moves it itself, one done by the compiled path (outside torch) does not.
        version = None if dest.is_inference() else dest._version  # (no counter to move)
        try:
            # The common case, decided as _runtime_write decides it, with the keys taken
            # once: a same-shaped copy from another storage, saved, no dispatch mode below.
            if (self.save_regions and not self._sparse and not self._nan_masked
                    and size == own[1].element_size()
                    and not torch._C._len_torch_dispatch_stack()):
                skey = _comparable_source(dest, src, key)
                if skey is not None and (
                        alone or self._pieces_by_owner(dest, src, own, key) is None):
                    if not dest.is_contiguous():
                        self._refuse_self_overlap(_COPY_NAME, [(dest, own)], src)
                    if self._measured.get(key):  # (none of this storage: nothing to forget)
                        self._forget_measured_in(dest, key)
                    target = (dest, own)
                    if self._guard is None:  # (what _compared_copy does, one call less)
                        return self._unguarded_compared_copy(
                            _COPY, _COPY_NAME, args, {}, target, key, skey)
                    return self._compared_copy(_COPY, _COPY_NAME, args, {}, target, key, skey)
            return self._runtime_write(_COPY, args, {}, [(dest, own)])
        finally:
            if version is not None and dest._version == version:
                _increment_version(dest)

    def _pieces_by_owner(self, dest: torch.Tensor, src: Any, own: tuple,
                         key: tuple | None = None
                         ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Where copy view ``dest`` (whose owner, as :meth:`RuntimeIndex.owner` found it,
        is ``own``) runs past that runtime tensor into others of its storage: ``dest``
        and ``src`` cut into views, in order, each of which lies in one runtime tensor
        (:func:`_cut_at_owners`). ``None`` (the common case, found at once where the
        storage has one runtime tensor): ``dest`` lies in its owner, or cannot be cut so
        (some of it lies in no runtime tensor, or the tensors' extents interleave).
        ``key``: ``dest``'s storage key, where the caller has it."""
        if not isinstance(src, torch.Tensor):
            return None
        beyond = self._beyond_owner(dest, own, key)
        return None if beyond is None else self._cut(dest, src, beyond)

    def _beyond_owner(self, dest: torch.Tensor, own: tuple, key: tuple | None = None
                      ) -> tuple[tuple, int, int] | None:
        """``(storage key, first byte, end byte)`` of write view ``dest`` where it reaches
        past ``own`` (its owner, as :meth:`RuntimeIndex.owner` found it) into other bytes
        of a storage that several runtime tensors share; ``None`` (the common case, found
        at once where the storage has one runtime tensor) where it lies in its owner. A
        view of another element size than a strided owner's (a float32 view of a
        bfloat16 column slice of a fused matrix, whose extent holds the other slices'
        columns too) is taken to reach past it unless it is shown to lie in its elements
        (:func:`_in_elements_of`): :meth:`_straddled` finds which tensors they reach."""
        if dest.dim() == 0:
            return None
        if key is None:
            key = _storage_key(dest)
        owners = self.index._owners_of(key)
        if owners is None or len(owners) < 2:
            return None
        lo, hi = _byte_span(dest)
        o0, o1 = _byte_span(own[1])
        if o0 <= lo and hi <= o1 and (dest.element_size() == own[1].element_size()
                                      or own[1].is_contiguous()
                                      or _in_elements_of(dest, own[1])):
            return None
        return key, lo, hi

    def _cut(self, dest: torch.Tensor, src: torch.Tensor, beyond: tuple[tuple, int, int]
             ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:func:`_cut_at_owners` of ``dest`` (which :meth:`_beyond_owner` found reaches
        past its owner, ``beyond``) among the runtime tensors its bytes meet."""
        key, lo, hi = beyond
        return _cut_at_owners(dest, src, self.index.overlapping(key, lo, hi))

    def _straddled(self, dest: torch.Tensor, targets: list, beyond: tuple[tuple, int, int]
                   ) -> tuple[list, bool]:
        """``(targets, straddles)``: ``targets`` (``dest`` with the one runtime tensor it
        starts in, which :meth:`_beyond_owner` found it reaches past: ``beyond``), and the
        others of its storage that ``dest``'s elements reach, where no cut into pieces of
        one tensor each was found (:meth:`_cut`) and the write's save in the first
        tensor's elements would miss them: an element of ``dest`` straddles two of them
        (``straddles``: a float32 view over two bfloat16 parameters of one flat buffer,
        cut at an odd element; a strided view, ``[1::2]`` of it, one of whose elements
        does), or ``dest`` has another element size than that tensor's and reaches the
        buffer's space beside the tensors too, or runs backward (a transposed view). The
        write is one, and each tensor records and saves the part of it in its own
        elements (:meth:`_owner_pieces`)."""
        own = targets[0][1]
        if not dest.numel():
            return targets, False
        key, lo, hi = beyond
        size = dest.element_size()
        meet = self.index.overlapping(key, lo, hi)
        near = [o for o in meet if o.dense and not (o.start <= lo and hi <= o.end)]
        # (column slices of one matrix: their extents interleave, no bound cuts them)
        strided = [o for o in meet if not o.dense]
        cuts = {b - b % size for o in near for b in (o.start, o.end) if lo < b < hi and b % size}
        other_size = size != own[1].element_size()
        if not cuts and not other_size:
            return targets, False  # (no element of dest holds parts of two)
        straddles = bool(cuts)
        if strided:
            # Which tensor holds each byte of each of dest's elements (-1: none)?
            every = (_element_bytes(dest)[:, None] + torch.arange(size)).reshape(-1)
            who = torch.full_like(every, -1)
            for i, o in enumerate(near + strided):
                who[_holds(o.tensor, every // o.step) if not o.dense
                    else (every >= o.start) & (every < o.end)] = i
            who = who.view(-1, size)
            straddles = bool((who != who[:, :1]).any())
            held = set(who.unique().tolist())
            near = [o for i, o in enumerate(near + strided) if i in held]
        elif not dest.is_contiguous():
            # A strided view's extent holds bytes of its own elements and others: does
            # one of its elements hold a boundary, and which tensors do they reach?
            at = _element_bytes(dest)
            straddles = straddles and bool(torch.isin(at, torch.tensor(sorted(cuts))).any())
            if not straddles and not other_size:
                return targets, False
            near = [o for o in near if bool(((at < o.end) & (at + size > o.start)).any())]
        more = [(dest, (o.name, o.tensor, (lo - o.start) // o.step))
                for o in near if o.name != own[0]]
        return (targets + more if more else targets), straddles

    def _owner_pieces(self, dest: torch.Tensor, straddled: list) -> list:
        """The write of view ``dest`` whose elements straddle the runtime tensors of
        ``straddled`` (:meth:`_straddled`), as views in those tensors' own elements, each
        in one of them: the elements of their size that ``dest``'s bytes touch
        (:func:`_box_in_units`), put in storage order and cut at the tensors' bounds
        (:func:`_cut_at_owners`), each tensor's part exactly (a strided view's, a few
        boxes). ``straddled`` itself where no such cut exists (the tensors differ in
        element size, or the elements touched make no box or reach the buffer's space
        outside them): each tensor then saves and records the span of its elements that
        ``dest``'s bytes reach (:func:`_owner_units`), every byte the write may change."""
        size = straddled[0][1][1].element_size()
        if any(own[1].element_size() != size for _, own in straddled):
            return straddled
        box = _box_in_units(dest, size)
        if box is None:
            return straddled
        first, shape, stride = box
        order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)
        units = straddled[0][1][1].detach().as_strided(
            [shape[d] for d in order], [stride[d] for d in order], first)
        key = _storage_key(dest)
        pieces = _cut_at_owners(units, units, self.index.overlapping(key, *_byte_span(units)))
        if pieces is None:
            return straddled
        out = []
        for d, _ in pieces:
            own = self.index.owner(d, key)
            if own is None:
                return straddled
            out.append((d, own))
        return out

    def _runtime_write(self, func, args, kwargs, targets, source=None):
        """A write op into runtime tensors (``targets``: each written view with its
        owner's ``(name, owner, offset)``); ``source``: a function that finds the one patch
        the op's arguments come from (see :meth:`_fed_by`; an error of a sparse call
        names it), or ``None``: none given. Signals wait until
        the write is saved and recorded (see :class:`_SignalDeferral`)."""
        return self._guarded(self._unguarded_write, func, args, kwargs, targets, source)

    def _guarded(self, write, *args):
        """``write(*args)``, with signals held back until it returns where this call
        takes them over (see :class:`_SignalDeferral`)."""
        guard = self._guard
        if guard is None:
            return write(*args)
        guard.depth += 1
        try:
            return write(*args)
        finally:
            guard.leave()

    def _unguarded_write(self, func, args, kwargs, targets, source=None, checked=False):
        op = _op_name(func)
        is_copy = func is _COPY
        self._refuse_lazy_views(op, targets, args, source)
        if is_copy and len(args) > 1:
            plain = self._plain_source(args[1])
            if plain is not args[1]:
                args = (args[0], plain, *args[2:])
        self._refuse_self_overlap(op, targets, args[1] if is_copy and len(args) > 1 else None,
                                  source)
        if self._measured:
            self._forget_measured(targets)
        # Another dispatch mode under this one (a loader's own, say) still has to see the
        # write and may change what it writes: then the op goes on to it, and the write
        # is measured around it, never done here.
        alone = not torch._C._len_torch_dispatch_stack()
        if self._sparse and not checked:
            self._check_sparse_write(func, op, args, targets, source)
        straddling = None
        beyond = (self._beyond_owner(args[0], targets[0][1])
                  if is_copy and len(targets) == 1 and not checked and len(args) > 1
                  else None)  # (None at once where a storage holds one runtime tensor)
        if beyond is not None:
            pieces = (self._cut(args[0], args[1], beyond)
                      if isinstance(args[1], torch.Tensor) else None)
            if pieces is not None:
                # A copy whose view runs from one runtime tensor into the next (q and k,
                # views of one flat buffer, written by one copy_ over the end of q and the
                # start of k): written as one copy per runtime tensor, each saved and
                # recorded as its own (a sparse one checked whole, above: refused before
                # any piece is written)
                for d, piece in pieces:
                    own = self.index.owner(d)
                    if self._sparse:
                        self._call_fed[own[0]] = self._call_fed.get(targets[0][1][0])
                    self._unguarded_write(func, (d, piece, *args[2:]), kwargs, [(d, own)],
                                          source, checked=True)
                return args[0]
            straddled, straddles = self._straddled(args[0], targets, beyond)
            if straddles and self._sparse:
                self._refuse_straddling(op, straddled, args[1], source)
            if len(straddled) > 1:
                if self._nan_masked:
                    straddling = straddled  # (an observed merge's mask: see below)
                elif self._sparse:  # (each saves the elements of its own the merge writes)
                    targets = straddled
                else:
                    targets = self._owner_pieces(args[0], straddled)
        if (not self._sparse and is_copy and self.save_regions and alone
                and not self._nan_masked and _comparable_copy(args, kwargs, targets)):
            return self._compared_copy(func, op, args, kwargs, targets[0])
        write = None
        kept_nan = None  # an observed copy from a NaN-masked patch: NaN where it keeps
        if self._nan_masked and is_copy:
            write, kept_nan = self._observed_mask(args, targets)
            if straddling is not None:
                # (a plain copy, the observed loader's merge made before it: each
                # tensor's part, as a dense call's; a copy taken for the merge: each
                # saves the elements of its own that it writes)
                targets = (self._owner_pieces(args[0], straddling) if write is None
                           else straddling)
            self._note_reinterpreted(args[1], targets[0][1][0])
            if self.provenance.mixed_seen:
                self._note_mixed(args[1], targets[0][1][0])
            if self.provenance.replaced_seen:
                self._note_replaced(args[1], args[0], targets[0][1][0])
        if self._sparse:
            dest, src = args[0], args[1]
            # (a cast that changes nothing, most loaders' copies, is no torch call)
            cast = (src if type(src) in _PLAIN and src.dtype == dest.dtype
                    and src.device == dest.device
                    else src.to(device=dest.device, dtype=dest.dtype))
            if (alone and _storage_key(cast) != _storage_key(dest)
                    and dest.element_size() == targets[0][1][1].element_size()):
                # On the CPU: merge (and save what it writes) in one compiled pass.
                recipe = self._patch_positions(dest, src) if self.save_regions else None
                owner = targets[0][1][1]
                fast = native.merge(
                    dest, cast, save=self.save_regions,
                    known_count=None if recipe is None else recipe.count,
                    # a report's numbers, measured while merging (reading the owner's dtype)
                    stats=self.save_regions and self.recorder is not None
                    and dest.dtype == owner.dtype,
                )
                if fast is not None:
                    if fast.index is not None:
                        recipe = None  # the count differed: the offsets were kept
                    elif recipe is not None and fast.position_sums != recipe.position_sums:
                        # As many elements written as the patch has entries here, but not
                        # where its entries are: the staged tensor was changed where no
                        # torch op shows it (through numpy, say). Where it wrote is where
                        # the source (as the merge read it, nothing ran since) is not NaN.
                        fast.index = _storage_offsets(dest, torch.nonzero(
                            ~nan_mask(cast)
                            .reshape(-1)).reshape(-1))
                        recipe = None
                    return self._merged(op, dest, src, targets[0][1], fast, recipe)
            # True where the source is not NaN: the elements this write changes. One mask
            # serves the merge and the save (a second, inverted one would double it).
            write = nan_mask(cast)
            write.logical_not_()
        # Before the write: save what it may change, and what counting changes needs.
        # A region saved just now holds exactly its current values; only a second write
        # into a saved dense region needs a transient copy.
        reinterpreted_written = None
        if any(t.element_size() != own[1].element_size() for t, own in targets):
            targets, saved, reinterpreted_written = self._save_in_owner_units(targets, write)
        else:
            saved = [self._save(t, tname, off, write) for t, (tname, _, off) in targets]
        befores = None
        # A dry run (a model on the meta device) holds no numbers: its writes are recorded
        # with where they landed, but with no count of what they wrote or changed.
        dry = (self.count_changes or self.recorder is not None) and any(
            t.is_meta for t, _ in targets)
        if self.count_changes and not dry:
            befores = [
                bits(sr.before) if sr is not None else bits(t).clone()
                for sr, (t, _) in zip(saved, targets)
            ]
        if self._sparse:
            # Merge on the bits, in place: exact for every float dtype (payloads, -0.0,
            # subnormals), no float kernels needed where a dtype lacks them (float8 on
            # CPU), and no destination-sized temporary beyond the 1-byte mask.
            torch.where(write, bits(cast), bits(dest), out=bits(dest))
            out = dest
        else:
            try:
                out = func(*args, **kwargs)
            except BaseException:
                src = args[1] if is_copy and len(args) > 1 else None
                for k, (sr, (t, target)) in enumerate(zip(saved, targets)):
                    # (a whole-view save of this op's own put its region in _saved_regions)
                    added = sr is not None and write is None
                    if sr is None and befores is not None:  # (saved by an earlier write)
                        sr = SavedRegion(target[0], target[2], t, befores[k])
                    if sr is not None:
                        self._refused_after_writing(op, t, target, src, sr,
                                                    region_added=added)
                raise
        if kept_nan is not None:
            self._check_kept(args[0], write, kept_nan, targets[0][1][0], args[1])
        self._call_writes += 1
        if self.recorder is not None:
            src = args[1] if is_copy else None
            written = None
            if reinterpreted_written is not None:
                written = reinterpreted_written  # (one count per target)
            elif write is not None and not dry:
                one = saved[0] if len(saved) == 1 else None
                if one is not None and one.index is not None:
                    written = one.before.numel()  # saved at nonzero(write): no count to read
                else:
                    written = int(count_true(write))
            changed: list[int | None] = [None] * len(targets)
            if befores is not None:
                # every target's count in one read (one host wait on a GPU)
                counts = []
                for sr, (t, _), before in zip(saved, targets, befores):
                    now = bits(sr.current() if sr is not None and sr.index is not None else t)
                    ne = now.reshape(before.shape) != before
                    counts.append(count_true(per_element(ne, t.is_complex())))
                if len({c.device for c in counts}) == 1:
                    changed = torch.stack(counts).tolist()
                else:  # (a foreach copy over tensors of several devices)
                    changed = [int(c) for c in counts]
            who = None
            if not is_copy and self.provenance:
                # index_copy_, index_put_ (``param[idx] = w``), an out= op: the one patch
                # its other arguments come from, if one (where in it, no view says)
                who = (source() if source is not None
                       else self.provenance.source_of(args, kwargs))
            for k, (t, (tname, _, off)) in enumerate(targets):
                self._record(op, t, tname, off, src, changed[k], who=who,
                             written=written if reinterpreted_written is None
                             else reinterpreted_written[k])
        return out

    def _save_in_owner_units(self, targets, write):
        """Saves of a write through a view of another element size than its runtime
        tensor's (fp8 values packed four to an int32 word, say), made in the runtime
        tensor's own elements, so that the report, ``before()`` and a rollback read them as
        its other saves: a dense write saves the elements its bytes touch (as a box of
        them, :func:`_owner_units`: their span where they make none); a NaN-merge saves
        the elements that hold a byte it writes (each of them, where an element it writes
        is wider than the tensor's: a float32 view of a bfloat16 one; of this tensor's
        own, where its view reaches others of the storage, :meth:`_straddled`), and says
        how many. Returns ``(targets in those units, saves, None or, for a NaN-merge, the
        elements each target's merge reaches)``."""
        mapped, saved = [], []
        written: list | None = None if write is None else []
        for t, (tname, owner, off) in targets:
            # (one of the tensor's size that a view reaching others of another size
            # reaches too, :meth:`_straddled`: its own elements, as the others')
            if t.element_size() == owner.element_size() and _span_in(t, owner):
                mapped.append((t, (tname, owner, off)))
                saved.append(self._save(t, tname, off, write))
                if written is not None:
                    written.append(None if t.is_meta else int(count_true(write)))
                continue
            u, uoff = _owner_units(t, owner)
            mapped.append((u, (tname, owner, uoff)))
            if write is None or u.is_meta:
                saved.append(self._save(u, tname, uoff, None))
                if written is not None:
                    written.append(None)
                continue
            at = _storage_offsets(t, torch.nonzero(write.reshape(-1)).reshape(-1))
            a, o = t.element_size(), owner.element_size()
            reached = at * a // o
            if a > o:  # (each of the tensor's elements a wider one holds)
                reached = (reached[:, None] + torch.arange(a // o, device=at.device)).reshape(-1)
            if owner.is_contiguous():  # (this tensor's part: a view may reach past it)
                first = owner.storage_offset()
                reached = reached[(reached >= first) & (reached < first + owner.numel())]
            else:  # (a column slice's: its extent holds its neighbours' columns too)
                reached = reached[_holds(owner, reached)]
            reached = torch.unique(reached)
            written.append(int(reached.numel()))
            if self.save_regions:
                sr = SavedRegion.elements(tname, uoff, u, reached)
                self.saved.append(sr)
                saved.append(sr)
            else:
                saved.append(None)
        return mapped, saved, written

    def _observed_mask(self, args, targets) -> tuple[torch.Tensor | None, int | None]:
        """For an observed ``copy_`` (see :meth:`call`) into one runtime view from a
        NaN-masked sparse patch's staged tensor, or from a source holding NaN that is not
        traced to a dense patch (built by ``torch.cat`` or a gather, say): the mask of the
        elements a NaN-merge writes (source not NaN), and how many of the others are NaN
        now; else ``(None, None)``."""
        if len(targets) != 1 or len(args) < 2:
            return None, None
        dest, src = args[0], args[1]
        if (not isinstance(src, torch.Tensor) or src.shape != dest.shape
                or not src.is_floating_point() or not dest.is_floating_point()
                or dest.is_meta):  # (a dry run: no NaN to find, nothing to count)
            return None, None
        hit = self.provenance.lookup(src)
        patch = self._patches.get(hit[0]) if hit is not None else None
        if patch is not None and patch.indices is None:
            return None, None  # a dense patch's values: a plain copy
        cast = src.to(device=dest.device, dtype=dest.dtype)
        write = nan_mask(cast).logical_not_()
        if patch is None and bool(write.all()):
            # Not traced to a sparse patch (a cat or gather of one, a renamed one) and no
            # NaN in it: a plain copy. With NaN, it is taken for the NaN-merge as well.
            return None, None
        return write, _nan_outside(dest, write)

    def _note_mixed(self, src: Any, tname: str) -> None:
        """An observed copy into runtime tensor ``tname`` from ``src``, data an op that
        mixes elements made from a NaN-masked patch's data (see :class:`_Source`), is
        recorded in :attr:`violations`: whatever the observed loader's NaN-merge made of
        it, the staged NaN spread over elements the patch updates, or its numbers moved
        to other elements (what a sparse call of patchkit's own refuses before it writes,
        :meth:`_refuse_mixed`)."""
        mixed = self.provenance.mixed_in(src) if isinstance(src, torch.Tensor) else None
        if mixed is None:
            return
        pos, name, op = mixed
        made = _mixed_from(pos, name)
        self.violations.append(ContractViolation(
            f"load_weights (call {self._chunk}, {where(pos, name)}, runtime tensor "
            f"{quoted(tname)}) copied data that {op}, an op that mixes elements, made from "
            f"{made} while it held NaN, a sparse patch's 'keep' marks: the NaN "
            "spread over elements the patch updates and numbers moved to other elements, "
            "so the observed loader's NaN-merge kept elements it should have updated or "
            "wrote numbers where they do not belong. Those updates are lost; send this "
            "weight dense",
            position=pos, name=name, reason="mixed elements", value=op,
        ))

    def _check_kept(self, dest, write, kept_nan, tname, src) -> None:
        """After an observed copy from a NaN-masked patch: an element the patch keeps
        (source NaN) that is NaN now and was not before means the loader copied the NaN
        mask into the model instead of merging it (CONTRACT §4)."""
        turned = _nan_outside(dest, write) - kept_nan
        if turned <= 0:
            return
        hit = self.provenance.lookup(src)
        pos, name = (hit[0], hit[1]) if hit else (None, None)
        self.violations.append(ContractViolation(
            f"load_weights (call {self._chunk}, {where(pos, name)}, runtime tensor "
            f"{quoted(tname)}) copied a NaN-masked sparse patch with a plain copy: {turned} "
            "elements that the patch leaves unchanged (NaN in its staged tensor) are NaN in "
            "the model now. The observed loader does not NaN-merge sparse patches; those "
            "elements are lost",
            position=pos, name=name, reason="NaN copied", value=turned,
        ))

    def _forget_measured(self, targets) -> None:
        """A write that reaches a region whose statistics were measured while copying
        makes those numbers stale (a write through a view of another element size, say):
        the report reads that region again when the load ends, as torch ops would. Only
        the regions of the written storage are looked at, so a load of many tensors
        costs a look-up per write, not a scan of every earlier write; and only those
        whose byte span meets the write's get the exact test."""
        for t, _ in targets:
            self._forget_measured_in(t, _storage_key(t))

    def _forget_measured_in(self, t: torch.Tensor, key: tuple) -> None:
        """:meth:`_forget_measured` for one written view ``t`` of storage ``key``.

        The storage's measured regions are kept in a :class:`_RegionIndex`: only those it
        says may meet the write are looked at (a loader that writes a tensor row by row,
        or column by column, pays a bisection per write, not a scan of every region it
        wrote before)."""
        regions = self._measured.get(key)
        if not regions:
            return
        lo, hi = _byte_span(t)
        met = regions.meeting(lo, hi, functools.partial(Region.of, t))
        if not met:
            return
        written = Region.of(t)
        for sr in met:
            if not sr.region.columns_apart(written):
                sr.diff_stats = None
                regions.discard(sr, sr.span[1])

    def _measure(self, saved: SavedRegion, key: tuple | None = None) -> None:
        """Keep ``saved`` (whose statistics were measured while writing) for
        :meth:`_forget_measured`, with the span of its view (of storage ``key``, where the
        caller has it), which the report's statistics use again."""
        if saved.span is None:
            saved.span = _span_of(saved.view, key)
        key, a0, a1, _ = saved.span
        regions = self._measured.get(key)
        if regions is None:
            regions = self._measured[key] = _RegionIndex(_saved_region)
        regions.add(saved, a0, a1)

    def _patch_positions(self, dest, src) -> PatchPositions | None:
        """How a merge from ``src`` could recompute where it wrote from its sparse patch
        (see :class:`PatchPositions`), or ``None`` (then the merge keeps the offsets): the
        source must be a view of a staged patch's storage. A cast to the destination's
        dtype keeps NaN where the source has NaN and only there, except where
        it turns a value into NaN (float8): then the merge writes fewer elements than the
        patch entries found, and keeps the offsets."""
        hit = self.provenance.lookup(src, exact=True)
        patch = self._patches.get(hit[0]) if hit is not None else None
        if patch is None or patch.indices is None or hit[2] is None:
            return None
        found = native.patch_entries(patch.indices, patch.values, hit[2], dest, src)
        if found is None:
            return None
        return PatchPositions(hit[0], hit[1], patch.indices, patch.values, hit[2], found.rows,
                              found.count, found.checksums, found.position_sums)

    def _merged(self, op, dest, src, target, fast, recipe) -> torch.Tensor:
        """Book-keeping of a NaN-merge that :func:`patchkit.native.merge` did."""
        tname, _, off = target
        if self.save_regions:
            measured = fast.squares is not None
            saved = SavedRegion(
                tname, off, dest, fast.before, fast.index, positions=recipe,
                view_sum_squares=fast.squares,
                diff_stats=(fast.changed, fast.sum_abs, fast.sum_sq_diff, fast.max_abs)
                if measured else None,
            )
            self.saved.append(saved)
            if measured:
                self._measure(saved)
        self._call_writes += 1
        if self.recorder is not None:
            self._record(op, dest, tname, off, src, fast.changed, written=fast.written)
        return dest

    def _record(self, op, t, tname, off, src, changed, skey=None, written=None,
                who=None, same_shape=False) -> None:
        """Tell the recorder of one write into runtime tensor ``tname`` (``changed`` is
        kept only when the session counts changes; ``skey``: ``src``'s storage key, where
        the caller has it; ``written``: the elements that took the source's value, where
        fewer than the view's; ``who``: ``(position, name)`` of the one patch an op other
        than a copy wrote from, at no offset a view tells; ``same_shape``: ``src`` has
        ``t``'s shape, known to the caller)."""
        hit = self.provenance.locate(src, key=skey) if isinstance(src, torch.Tensor) else None
        shape = tuple(t.shape)
        if hit is None:
            position = name = checkpoint_offset = source_shape = source_stride = None
            if who is not None:
                position, name = who
        else:
            # (in checkpoint elements: a view of the patch's bytes as another element size,
            # ``w.view(torch.uint8)[rows]``, as the rows of ``w`` it reads)
            position, name, checkpoint_offset, source_shape, source_stride = hit
            if source_shape is None:
                source_shape = shape if same_shape else tuple(src.shape)
                source_stride = tuple(src.stride())
        # (positional, in the order of WriteEvent's fields: a report records one per write,
        # and keywords cost more than the rest of the event)
        self.recorder.on_write(WriteEvent(
            self._chunk, op, tname, off, shape, tuple(t.stride()), t.numel(),
            position, name, checkpoint_offset, changed if self.count_changes else None,
            source_shape, source_stride, written,
        ))

    def _compared_copy(self, func, op, args, kwargs, target, key=None, skey=None):
        """A dense ``copy_`` whose source has the destination's shape, dtype and device:
        save only what the copy changes (or the whole view, when most of it changes), and
        count it, without a second pass after the write. ``key``, ``skey``: the storage
        keys of the destination and the source, where the caller has them.

        On the CPU the compiled path (:mod:`patchkit.native`) compares, saves, counts and
        copies in one pass; otherwise torch ops compare first, save, then copy. Signals
        wait until the write is saved and recorded (see :class:`_SignalDeferral`)."""
        return self._guarded(self._unguarded_compared_copy, func, op, args, kwargs, target,
                             key, skey)

    def _unguarded_compared_copy(self, func, op, args, kwargs, target, key, skey):
        dest, src = args[0], args[1]
        tname, owner, off = target[1]
        region = None
        if self.recorder is None and self._saved_regions:
            region = _region_key(dest, key)
            if region in self._saved_regions:
                # Saving for a rollback only (nothing counts this write's changes), into
                # a view saved whole earlier in this load: that save already holds what
                # the view held before the load (a rollback restores newest first). A
                # second save would only cost memory: a name sent n times with full
                # replacements would keep n copies of its tensor (CONTRACT §5: saved
                # before the first write).
                self._call_writes += 1
                return func(*args, **kwargs)
        # Statistics read the bits as the owner's dtype: a loader may write through a
        # reinterpreting view (of the same element size; other sizes are not followed).
        # A packed dtype (float4_e2m1fn_x2) has no numbers: its changes are counted only.
        stats = (self.recorder is not None and dest.element_size() == owner.element_size()
                 and has_numbers(owner.dtype))
        # An inference tensor outside inference mode: torch allows some writes into it
        # (through ``.data``) and refuses others (into the parameter, or a view of it),
        # so torch's own copy_ writes it, not the compiled path.
        fast = None if dest.is_inference() and not torch.is_inference_mode_enabled() else (
            # (_compared_copy's callers found src of dest's shape and dtype: unchecked)
            native._compare_copy(dest, src, owner.dtype if stats else None)
        )
        if fast is not None:
            n_changed = fast.changed
            diff = span = None
            if stats:
                diff = (fast.changed, fast.sum_abs, fast.sum_sq_diff, fast.max_abs)
                if key is not None and dest.is_contiguous():
                    # the span _span_of gives a contiguous view (every element of its
                    # extent), without its calls: a report makes one per write
                    step = dest.element_size()
                    a0 = dest.storage_offset() * step
                    span = (key, a0, a0 + dest.numel() * step, step)
            # (positional, in the order of SavedRegion's fields: one per write; the view's
            # geometry from its region where that was taken)
            saved = SavedRegion(tname, off, dest, fast.before, fast.index,
                                fast.index is not None, fast.squares, diff, None, span,
                                None if region is None else
                                (region[2], region[3], region[1] // region[4]))
            self.saved.append(saved)
            if diff is not None:
                self._measure(saved, key)
            if self.recorder is None and fast.index is None:  # saved whole (see above)
                self._saved_regions.add(_region_key(dest, key) if region is None else region)
            out = dest
        elif dest.is_meta:  # a dry run: nothing to save or count
            n_changed, out = None, func(*args, **kwargs)
        else:
            saves = len(self.saved)
            try:
                n_changed, out = self._compared_copy_torch(
                    func, args, kwargs, tname, owner, off, stats
                )
            except BaseException:
                if len(self.saved) > saves:  # saved, then the copy raised: it may have written
                    self._refused_after_writing(op, dest, target[1], src, self.saved[-1], skey)
                raise
        self._call_writes += 1
        if self.recorder is not None:
            self._record(op, dest, tname, off, src, n_changed, skey, same_shape=True)
        return out

    def _refused_after_writing(self, op, t, target, src, saved, skey=None, *,
                               region_added: bool = False) -> None:
        """A write op that raised after its save: torch makes some writes and then refuses
        them (``copy_`` into an inference tensor outside inference mode raises when it
        moves the version counter, after the copy). What it changed stays in the model
        (a rollback puts it back), so it is a write of the load, recorded with the
        elements it changed; an op that changed nothing is not (most ops that raise check
        their arguments first: a ``copy_`` of another shape, an ``index_copy_`` of another
        dtype, which a loader may catch to try another way), and a report forgets the
        save made for it: its elements were not written, so ``deltas`` and ``written()``
        do not count them (``region_added``: the save was of the whole view and put its
        region in ``_saved_regions``, which it leaves too, so that a later write into the
        region is saved before it)."""
        changed = saved.changed_now()
        if not changed:
            if self.recorder is not None:
                for k in range(len(self.saved) - 1, -1, -1):
                    if self.saved[k] is saved:
                        del self.saved[k]
                        if region_added:
                            self._saved_regions.discard(_region_key(t))
                        break
            return
        self._call_writes += 1
        if self.recorder is not None:
            tname, _, off = target
            self._record(op, t, tname, off, src, changed, skey)

    def _compared_copy_torch(self, func, args, kwargs, tname, owner, off, stats):
        """:meth:`_compared_copy` with torch ops. On a GPU it waits for the device once
        per write (the count of changes, read with the view's sum of squares), a second
        time only where the view holds a non-finite value; the offsets of a compact save
        are taken at the known count, which needs no wait."""
        dest, src = args[0], args[1]
        diff = bits(dest) != bits(src)
        count = count_true(diff)
        squares = None
        if stats:
            viewed = dest if dest.dtype == owner.dtype else dest.view(owner.dtype)
            n, squares = torch.stack([count.double(), squares_on_device(viewed)]).tolist()
            n_changed = int(n)  # (exact: a view has fewer than 2**53 elements)
            if not math.isfinite(squares):
                squares = float(squares_on_device(viewed, finite_only=True))
        else:
            n_changed = int(count)
        s = dest.element_size()
        if n_changed * (s + 8) <= dest.numel() * s:
            flat = _changed_offsets(diff.reshape(-1), n_changed)
            del diff
            saved = SavedRegion.elements(tname, off, dest, _storage_offsets(dest, flat),
                                         whole_view=True, view_sum_squares=squares)
        else:
            del diff  # before the clone: the two never need to exist at once
            saved = SavedRegion(tname, off, dest, dest.clone(), view_sum_squares=squares)
            if self.recorder is None:
                self._saved_regions.add(_region_key(dest))  # saved whole: see _compared_copy
        self.saved.append(saved)
        return n_changed, func(*args, **kwargs)

    def _check_sparse_write(self, func, op, args, targets, source=None) -> None:
        """CONTRACT §4 strict checks, before the write: raise and nothing is written.

        The error names a patch (``position``, ``name``) only where it is known to be
        the one the refused op served: the patch its source (a copy's source, else the
        op's tensor arguments, ``source``) was traced to, else the call's only patch.
        Otherwise both are ``None`` and the message says that no patch was the op's
        source (and, as a fact, not a verdict, which patch the call last copied into that
        runtime tensor): earlier ops of the call say nothing about which patch a later op
        serves (a loader may zero a packed tensor before copying the next patch into it)."""
        dest, (tname, _, toff) = targets[0]
        src = args[1] if func is _COPY and len(args) > 1 else None
        pos, name = self._fed_by(src, source)
        if func is not _COPY:
            hint = ""
            if op.startswith(("aten::fill_", "aten::zero_")):
                hint = (". Loaders that fill (vLLM's padded vocabulary embedding zeroes its "
                        "padding rows, its default loader fills 1-element weights) take "
                        "such a weight only as a dense patch: send it dense")
            raise ContractViolation(
                f"{self._write_at(pos, name, tname)} wrote with {op}; a sparse (NaN-masked) "
                "load supports only "
                "same-shaped floating-point copy_ into parameters and buffers. This op "
                f"wrote nothing{hint}{self._no_source_note(name, tname)}",
                position=pos, name=name, reason="unsupported op", value=op,
            )
        if (
            not isinstance(src, torch.Tensor)
            or src.shape != dest.shape
            or not src.is_floating_point()
            or not dest.is_floating_point()
            or not has_numbers(dest.dtype)  # (float4_e2m1fn_x2: no NaN to keep by)
        ):
            got = (
                f"{tuple(src.shape)} {src.dtype}"
                if isinstance(src, torch.Tensor)
                else type(src).__name__
            )
            packed = ("" if has_numbers(dest.dtype) else
                      f", and {dest.dtype} elements are no numbers, with no NaN to keep by")
            raise ContractViolation(
                f"{self._write_at(pos, name, tname)} copied a {got} source into a "
                f"{tuple(dest.shape)} {dest.dtype} view; "
                "a sparse load needs same-shaped floating-point copy_ (no broadcasting, no "
                f"integer storage{packed}). This copy wrote nothing"
                f"{self._no_source_note(name, tname)}",
                position=pos, name=name, reason="same-shaped floating-point",
                value=(tuple(src.shape) if isinstance(src, torch.Tensor) else None,
                       tuple(dest.shape)),
            )
        self._refuse_reinterpreted(src, pos, name, tname)
        if self.provenance.mixed_seen:
            self._refuse_mixed(src, pos, name, tname)
        if self.provenance.replaced_seen:
            self._refuse_replaced(src, dest, pos, name, tname)
        self._refuse_lost_numbers(src, dest.dtype, pos, name, tname)
        if self.lost:
            self._refuse_marked(src, dest.dtype, pos, name, tname)
        region = Region.of(dest)
        earliers = self._call_regions.get(region.key)
        if earliers is None:
            earliers = self._call_regions[region.key] = _RegionIndex()
        a0, a1 = _byte_span(dest)  # (region.extent(), without its cached properties)
        for earlier in earliers.meeting(a0, a1, region):
            if region.overlaps(earlier):
                raise ContractViolation(
                    f"{self._write_at(pos, name, tname)} wrote a {tuple(dest.shape)} view at "
                    f"element {toff} that overlaps "
                    "a view written earlier in the same call: overlapping runtime views "
                    "cannot be NaN-merged. The first write stays applied; this one wrote "
                    f"nothing{self._no_source_note(name, tname)}",
                    position=pos, name=name, reason="overlapping runtime views", value=toff,
                )
        earliers.add(region, a0, a1)
        self._call_fed[tname] = (pos, name) if name is not None else None

    def _refuse_mixed(self, src: torch.Tensor, pos: int | None, name: str | None,
                      tname: str) -> None:
        """A sparse copy from ``src`` refused where its data were mixed (see
        :class:`_Source`): an op that mixes elements (a rotation ``w @ h``, a scale from
        the whole tensor ``w / w.abs().amax()``, a sort, a cumsum, a softmax, a block
        quantiser's absmax) ran on a patch's data while it held NaN, the "keep" marks, so
        the NaN spread over elements the patch updates (which the merge would keep) and
        numbers moved to other elements (which it would write there)."""
        mixed = self.provenance.mixed_in(src)
        if mixed is None:
            return
        self._refuse_made_by(
            src, pos, name, tname, mixed, "mixed elements",
            "an op that mixes elements, while that data held NaN, a sparse patch's 'keep' "
            "marks (the source is that op's result, or was computed from it): the NaN "
            "spreads over elements the patch updates and numbers move to other elements, "
            "so the NaN-merge would keep elements it should update or write numbers where "
            "they do not belong. A sparse (NaN-masked) load cannot support a loader that "
            "mixes a patch's elements before its copy_ (a matmul, a scale taken from a "
            "whole tensor or block, a sort, a cumsum, a softmax, arithmetic between "
            "different elements such as w - w[0]) except over rows (slices) that the "
            "patch keeps or updates whole: send this weight dense")

    def _refuse_made_by(self, src: torch.Tensor, pos: int | None, name: str | None,
                        tname: str, made: tuple, reason: str, why: str) -> None:
        """Refuse a sparse copy from ``src`` into runtime tensor ``tname`` before it
        writes, its data made from a patch's by an op that lost the patch's updates:
        ``made`` is ``(position, name, op)`` of that patch and op (the patch named where
        known, else the call's ``pos`` and ``name``), ``why`` what the op did and what to
        do instead, ``reason`` the error's."""
        mpos, mname, op = made
        if mname is not None:
            pos, name = mpos, mname
        raise ContractViolation(
            f"{self._write_at(pos, name, tname)} copied a {tuple(src.shape)} {src.dtype} "
            f"source made from {_mixed_from(mpos, mname)} by {op}, {why}. This copy wrote "
            f"nothing{self._no_source_note(name, tname)}",
            position=pos, name=name, reason=reason, value=op,
        )

    def _replaced_loss(self, src: Any, dest: torch.Tensor) -> tuple | None:
        """Where a copy from ``src`` into ``dest`` (same shapes), whose data an op may
        have made numbers of a patch's NaN in (:attr:`_Source.replaced`), would write a
        number the NaN-merge takes over an element the patch keeps with other bits than
        it holds: ``(position, name, op, what)`` (the patch whose NaN, the op, and what
        it would write, as a message says it), or ``None``: where that patch keeps, the
        source is NaN or the runtime tensor's own bits (a loader that merges on purpose,
        ``torch.where(w.isnan(), param, w)``). Where the stretch says which of the
        source's elements keep (:func:`_keep_in`), those are compared; elsewhere (after
        a matmul of such data, or a source of several stretches) any element it changes
        may be one: refused unless it changes none. Read only for such sources, once
        each (one host wait on a GPU)."""
        if (not isinstance(src, torch.Tensor) or src.is_meta or dest.is_meta
                or not src.numel() or src.shape != dest.shape):
            return None
        hits = self.provenance.stretches(src)
        rep = next((e.replaced for e in hits if e.replaced is not None), None)
        if rep is None:
            return None
        rpos, rname, op, _ = rep
        cast = src.to(device=dest.device, dtype=dest.dtype)  # (what the merge reads)
        changed = nan_mask(cast).logical_not_()
        changed &= bits(cast) != bits(dest)
        keep = _keep_in(hits[0], src) if len(hits) == 1 else None
        if keep is None:
            # (which elements keep is not followed here: the op's result was mixed, a
            # matmul of it, or copied where its elements cannot be followed)
            n = int(count_true(changed))  # (the one host wait)
            if not n:
                return None
            flat = int(torch.nonzero(changed.reshape(-1))[0])
            return rpos, rname, op, (
                f"which of its elements the patch keeps is not known at this copy (an op "
                f"after {op} mixed them, as a matmul does, or moved them where they were "
                f"not followed), and it changes {n} elements of the runtime tensor (its "
                f"element {_unravel(flat, src.shape)} holds "
                f"{float(cast.reshape(-1)[flat])!r} where the runtime tensor holds "
                f"{float(dest.reshape(-1)[flat])!r}), any of which may be one it keeps")
        lost = changed & keep.to(dest.device)
        if not bool(lost.any()):  # (the one host wait)
            return None
        flat = int(torch.nonzero(lost.reshape(-1))[0])
        return rpos, rname, op, (
            f"its element {_unravel(flat, src.shape)}, which the patch keeps, holds "
            f"{float(cast.reshape(-1)[flat])!r} where the runtime tensor holds "
            f"{float(dest.reshape(-1)[flat])!r}")

    def _refuse_replaced(self, src: torch.Tensor, dest: torch.Tensor, pos: int | None,
                         name: str | None, tname: str) -> None:
        """A sparse copy from ``src`` into ``dest`` refused before it writes where an op
        made numbers of a patch's NaN, its "keep" marks, on the way (``w.nan_to_num()``,
        ``torch.where(w.isnan(), 0.0, w)``) and the NaN-merge would write one over an
        element the patch keeps (see :meth:`_replaced_loss`)."""
        got = self._replaced_loss(src, dest)
        if got is None:
            return
        *made, what = got
        self._refuse_made_by(
            src, pos, name, tname, tuple(made), "replaced NaN marks",
            "an op that may make a number of a NaN, a sparse patch's 'keep' mark (the "
            "source is that op's result, or was computed from it), and the NaN-merge would "
            f"write numbers where the patch keeps: {what}. Those elements would be lost "
            "without a word (vLLM writes them). A loader that merges on purpose writes the "
            "runtime value there (torch.where(w.isnan(), param, w)); else let the NaN "
            "reach the copy_, or send this weight dense")

    def _note_replaced(self, src: Any, dest: torch.Tensor, tname: str) -> None:
        """An observed copy into runtime tensor ``tname`` from ``src``, data whose NaN an
        op made numbers of on the way, that would write one over an element the patch
        keeps (:meth:`_replaced_loss`, read before the write), is recorded in
        :attr:`violations` (what a sparse call of patchkit's own refuses,
        :meth:`_refuse_replaced`)."""
        got = self._replaced_loss(src, dest)
        if got is None:
            return
        pos, name, op, what = got
        self.violations.append(ContractViolation(
            f"load_weights (call {self._chunk}, {where(pos, name)}, runtime tensor "
            f"{quoted(tname)}) copied data that {op}, an op that may make a number of a "
            f"NaN, made from {_mixed_from(pos, name)} while it held NaN, a sparse patch's "
            f"'keep' marks, so the observed loader's NaN-merge wrote numbers where the "
            f"patch keeps: {what}. Those elements are lost; a loader that merges on "
            "purpose writes the runtime value there, else send this weight dense",
            position=pos, name=name, reason="replaced NaN marks", value=op,
        ))

    def _write_at(self, pos: int | None, name: str | None, tname: str) -> str:
        """Where a refused sparse write happened, as its message begins: the call, the
        patch it served (``name`` ``None``: none known) and the runtime tensor. (Made only
        for an error: most writes pass.)"""
        who = f"{where(pos, name)}, " if name is not None else ""
        return f"load_weights (call {self._chunk}, {who}runtime tensor {quoted(tname)})"

    def _reinterpretation(self, src: torch.Tensor
                          ) -> tuple[str, torch.dtype, torch.dtype] | None:
        """How ``src`` reads a patch's bytes as other numbers than they hold, as
        ``(kind, held, read)``: ``"view"``, as another dtype than they hold
        (``w.view(torch.float64)`` of a float32 staged tensor, or of a copy of it:
        :class:`_Provenance` keeps that dtype); ``"cast"``, a cast of such a view
        (``w.view(torch.bfloat16).to(torch.float8_e4m3fnuz)``, ``w.view(torch.int32).float()``:
        :attr:`_Source.misread`), whose elements hold no staged NaN where the patch keeps,
        whatever dtype reads them; ``"shifted"``, as their own dtype with elements that
        straddle two of the patch's, the bytes moved by no whole number of elements
        (``w.view(torch.uint8)[1:13].clone().view(torch.float32)``:
        :attr:`_Source.shift`), or anything made from one. ``None``: none of these. The
        staged NaN ("keep") is a bit pattern of its own dtype only: two float32 NaN read
        as one float64 are a number, a float16 NaN read as bfloat16 is one too. A complex
        dtype's bytes count as its real dtype's."""
        if not self.provenance or self.provenance.read_as(src, src.dtype):
            return None
        for e in self.provenance.stretches(src):
            if e.misread is None and _misaligned(e, src):
                e = e._replace(misread=(e.dtype, src.dtype))
            if e.misread is not None:
                held, read = e.misread
                same = held.to_real() == read.to_real()
                return ("shifted" if same else "cast"), held, read
            # (a complex tensor's bytes are its real dtype's: ``torch.complex(0, w).imag``
            # reads w's own float32 elements)
            if e.dtype is not None and e.dtype.to_real() != src.dtype:
                return "view", e.dtype, src.dtype
        return None

    def _refuse_reinterpreted(self, src: torch.Tensor, pos: int | None, name: str | None,
                              tname: str) -> None:
        """A sparse copy from ``src`` that reads a patch's bytes as other numbers than
        they hold (:meth:`_reinterpretation`) is refused before it writes: the merge
        would write the staged NaN bits into the model (and keep runtime values where the
        patch has a value)."""
        found = self._reinterpretation(src)
        if found is None:
            return
        kind, held, read = found
        raise ContractViolation(
            f"{self._write_at(pos, name, tname)} copied a {tuple(src.shape)} {src.dtype} "
            f"source {_reinterpreted_words(kind, held, read, src.dtype)}, so the merge "
            f"would write the staged NaN bits{_REINTERPRETED_HOW[kind]} into the model. "
            f"{_REINTERPRETED_FIX[kind].format(dtype=src.dtype)} "
            f"This copy wrote nothing{self._no_source_note(name, tname)}",
            position=pos, name=name, reason="reinterpreted source", value=(held, read),
        )

    def _note_reinterpreted(self, src: Any, tname: str) -> None:
        """An observed copy into runtime tensor ``tname`` from ``src``, which reads a
        NaN-masked patch's bytes as other numbers than they hold
        (:meth:`_reinterpretation`), is recorded in :attr:`violations`: the staged NaN
        ("keep") read as numbers, so the observed loader's NaN-merge wrote them into the
        model (what a sparse call of patchkit's own refuses before it writes,
        :meth:`_refuse_reinterpreted`)."""
        found = self._reinterpretation(src) if isinstance(src, torch.Tensor) else None
        if found is None:
            return
        kind, held, read = found
        hit = self.provenance.lookup(src)
        pos, name = (hit[0], hit[1]) if hit else (None, None)
        fix = _REINTERPRETED_FIX[kind].format(dtype=src.dtype)
        self.violations.append(ContractViolation(
            f"load_weights (call {self._chunk}, {where(pos, name)}, runtime tensor "
            f"{quoted(tname)}) copied a {tuple(src.shape)} {src.dtype} source "
            f"{_reinterpreted_words(kind, held, read, src.dtype)}, so the observed "
            f"loader's NaN-merge wrote the staged NaN bits{_REINTERPRETED_HOW[kind]} into "
            f"the model where the patch keeps. Those elements are lost; {fix[0].lower()}"
            f"{fix[1:]}",
            position=pos, name=name, reason="reinterpreted source", value=(held, read),
        ))

    def _loses_numbers(self, pos: int | None, dtype: torch.dtype) -> bool:
        """Whether a value of the call's patch at ``pos`` (staged in its dtype) becomes
        NaN in ``dtype`` (one without infinities): read from its values (its nnz, not its
        staged tensor), once per patch and dtype in a load. ``True`` where the patch is
        not known (an observed name that matched none: its entries are read); ``False``
        for values on the meta device (a dry run has no numbers)."""
        p = self._patches.get(pos)
        if p is None:
            return True
        found = self._lossy.get((pos, dtype))
        if found is None:
            v = p.values.detach()
            if v.is_meta:
                found = False
            else:
                staged = v if v.dtype == p.dtype else v.to(p.dtype)
                found = bool(_lost_in_cast(staged, staged.to(dtype)).any())
            self._lossy[(pos, dtype)] = found
        return found

    def _refuse_lost_numbers(self, src: torch.Tensor, dtype: torch.dtype, pos: int | None,
                             name: str | None, tname: str) -> None:
        """A sparse copy from ``src`` into a runtime view of ``dtype`` (a floating dtype
        without infinities: float8 ``e4m3fn``, ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``):
        refused where a number of a patch reaches it as NaN, which the merge would read
        as "keep", losing the update without a word: an infinity or a value out of the
        dtype's range, made NaN by this copy's cast or by one the loader made before
        (``.to()``, a copy into a tensor of its own, a detour through another dtype).
        Where ``src``'s elements are followed to their patch (a view of the staged tensor,
        or of element-for-element copies of its parts: :class:`_Provenance`), that
        patch's entries in it are read there; staged values as staged (exact stretches of
        the staged dtype, :meth:`_keeps_numbers`) are not read at all when none of their
        patch's values (its nnz, checked once per dtype) is lost in ``dtype`` (a staged
        tensor the loader scaled in place is read). Elsewhere (a source an op made from a
        patch at unknown places: a scaled one, a gather), this copy's own cast is checked
        here, and the NaN that a cast the loader made before put in it by
        :meth:`_refuse_marked`."""
        if dtype in _CASTS_KEEP_NUMBERS or not dtype.is_floating_point or src.is_meta:
            return
        # (the message's start, made only for a refusal: most float8 writes pass)
        at = functools.partial(self._write_at, pos, name, tname)
        s = src.detach()
        rows = Region.of(s)._rows()
        followed = [e for e in self.provenance.stretches(s)
                    if e.base is not None and e.position in self._patches] if rows else []
        if followed:
            if self._keeps_numbers(s, dtype):
                return  # (the staged values as staged, none of which is lost)
            for e in followed:
                self._refuse_lost_entries(s, dtype, e, rows, at, tname)
            return  # (the rest of s holds no patch's numbers)
        if s.dtype == dtype:
            return
        lost = _lost_in_cast(s, s.to(dtype))
        if not bool(lost.any()):
            return
        first = torch.nonzero(lost.reshape(-1))[:1].reshape(-1)
        index, traced = self._checkpoint_index(s, first, pos, name)
        raise self._lost_error(float(s.reshape(-1)[first].float()), index, traced, s.dtype,
                               dtype, pos, name, at, tname)

    def _refuse_lost_entries(self, s: torch.Tensor, dtype: torch.dtype, e: _Source,
                             rows: tuple[int, int], at: Callable[[], str], tname: str
                             ) -> None:
        """:meth:`_refuse_lost_numbers` for the part of a source ``s`` (rows of ``L``
        elements ``S`` apart: ``rows``) in stretch ``e``, whose storage element ``k`` holds
        checkpoint element ``k - e.base`` of its patch: the patch's entries there that
        are elements of ``s`` are read, cast to ``dtype``, and the first that is NaN is
        refused (naming the patch's own value)."""
        p = self._patches[e.position]
        if p is None or p.indices is None or p.values.is_meta:
            return
        length, stride = rows
        size = s.element_size()
        off = p.indices.to(device=s.device, dtype=torch.int64) + e.base
        rel = off - s.storage_offset()
        row = torch.div(rel, stride, rounding_mode="floor")
        col = rel - row * stride
        inside = ((off * size >= e.lo) & (off * size < e.hi) & (rel >= 0)
                  & (row < s.numel() // max(length, 1)) & (col < length))
        sel = torch.nonzero(inside).reshape(-1)
        if not sel.numel():
            return
        storage = s.as_strided((s.untyped_storage().nbytes() // size,), (1,), 0)
        got = select(storage, off[sel]).to(dtype)  # (float8's indexing: torch 2.10)
        bad = torch.nonzero(nan_mask(got))
        if not bad.numel():
            return
        k = sel[bad[0, 0]]
        raise self._lost_error(float(p.values[k].float()), int(p.indices[k]), True, s.dtype,
                               dtype, e.position, e.name, at, tname)

    def _note_own_write(self, func: Any, args: Sequence[Any], kwargs: dict) -> None:
        """A sparse call's in-place op on tensors of the loader's own (no runtime
        tensor), for the lost-number marks (:class:`_LostMarks`): a ``copy_`` is a copy
        (:meth:`_note_copied`), a put of ``_PUTS`` moves marked elements, a fill
        (``fill_``, ``zero_``, ``masked_fill_``) writes what it fills anew (with the mark
        of a 0-d tensor it fills with), an ``out=`` op
        all of its ``out`` (``torch.cat(ts, out=buf)`` leaves no mark of what ``buf``
        held; a pointwise one's ``out`` takes its inputs' marks), and an in-place
        pointwise op (``buf.add_(x)``) keeps the marks of its tensor and adds its
        inputs'; other ops leave the marks as they are."""
        if func is _COPY:
            self._note_copied(args[1], args[0], whole=False)
        elif _foreach_kind(func):
            self._note_foreach(func, args, kwargs, None)
        elif func in _PUTS:
            self.lost.put(func, args, kwargs, args[0])
        elif func in _FILLS:
            self.lost.filled(args[0], args[1] if len(args) > 1 else None)
        elif func in (_aten.masked_fill_.Scalar, _aten.masked_fill_.Tensor):
            # (the elements filled are written anew; the others keep their marks)
            self.lost.filled(args[0], args[2], args[1])
        elif (outs := [t for i, argname in _out_args(func)
                       for t in _listed(args[i] if i < len(args) else kwargs.get(argname))
                       if isinstance(t, torch.Tensor)]):
            if _element_wise(func):  # (``torch.mul(x, s, out=buf)``: buf takes x's marks)
                inputs = _inputs(func, args, kwargs)
                for t in outs:
                    self.lost.pointwise(func, inputs, t, anew=True)
            else:
                for t in outs:
                    self.lost.unmark(t)
        elif _element_wise(func) and isinstance(args[0], torch.Tensor):
            # (``buf.add_(x)``: each element stays NaN where it was, and where x's is)
            self.lost.pointwise(func, [*args[1:], *kwargs.values()], args[0])

    def _note_foreach(self, func: Any, args: Sequence[Any], kwargs: dict,
                      outs: Sequence[Any] | None) -> None:
        """A sparse call's ``torch._foreach_*`` op (see :meth:`_LostMarks.foreach`) on
        tensors of the loader's own: read where marks exist, or where it copies into a
        dtype whose casts may lose numbers (``_foreach_copy_`` into float8 scratches)."""
        if not self.lost and not (_foreach_kind(func) == "copy" and any(
                isinstance(t, torch.Tensor) and _casts_lose_numbers(t.dtype)
                for t in (outs if outs is not None else _listed(args[0])))):
            return
        self.lost.foreach(func, args, kwargs, outs, self.provenance)

    def _note_copied(self, src: Any, out: torch.Tensor, *, whole: bool) -> None:
        """A sparse call's element-for-element copy of ``src`` into ``out`` (see
        :meth:`_LostMarks.copied`), marked where it loses a number. Not read where it
        cannot: no marks yet, and ``src`` all a staged tensor's values in their own
        dtype (an exact stretch, :class:`_Provenance`), none of whose patch's numbers
        (its nnz, checked once per dtype) is lost in ``out``'s dtype: a loader's plain
        ``t.to(dtype)`` reads no tensor."""
        if not self.lost and isinstance(src, torch.Tensor) and self._keeps_numbers(
                src, out.dtype):
            return
        self.lost.copied(src, out, self.provenance, whole=whole)

    def _keeps_numbers(self, src: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether every element of ``src`` is known to be a staged element of a patch of
        this call (in the staged dtype) none of whose values becomes NaN in ``dtype``."""
        if not src.numel():
            return True
        lo, hi = _byte_span(src)
        at = lo
        for e in self.provenance.stretches(src):
            # (in the staged dtype itself: a cast of the staged values to bfloat16 rounds
            # 247.99 to 248, which float8 cannot hold, though it holds the patch's 247.99)
            p = self._patches.get(e.position)
            if (e.lo > at or not e.exact or e.base is None or p is None
                    or e.dtype != src.dtype or e.dtype != p.dtype
                    or self._loses_numbers(e.position, dtype)):
                return False
            at = e.hi
        return at >= hi

    def _refuse_marked(self, src: torch.Tensor, dtype: torch.dtype, pos: int | None,
                       name: str | None, tname: str) -> None:
        """A sparse copy from ``src`` (into a view of ``dtype``) refused where an element
        of ``src`` is NaN because a cast the loader made earlier in the load turned a
        number into NaN (see :class:`_LostMarks`), which the merge would read as "keep":
        the message names the number, the patch it was a number of (where the cast's
        source was traced to one: a copy made in a later call, or from a ``cat`` of two
        patches, is traced to no patch itself) and its checkpoint index where known,
        else the element of the source that holds it."""
        got = self.lost.of(src.detach())
        if got is None:
            return
        marked, what = got
        bad = torch.nonzero((marked & nan_mask(src.detach())).reshape(-1))
        if not bad.numel():
            return
        k = int(bad[0, 0])
        value, of, index = what.reshape(-1, 3)[k].tolist()
        if of >= 0:  # (the patch whose number it was, which the copy may not be traced to)
            pos, name = int(of), self.lost.names[int(of)]
        raise self._lost_error(value, int(index) if index >= 0 else k, index >= 0,
                               src.dtype, dtype, pos, name,
                               functools.partial(self._write_at, pos, name, tname), tname)

    def _checkpoint_index(self, src: torch.Tensor, flat: torch.Tensor, pos: int | None,
                          name: str | None) -> tuple[int, bool]:
        """The checkpoint index of ``src``'s element at row-major position ``flat`` (a
        1-element tensor): ``(index, True)`` where ``src`` is traced to patch
        ``(pos, name)`` at a known offset, else ``(that position, False)``."""
        hit = self.provenance.lookup(src)
        if hit is not None and hit[2] is not None and hit[:2] == (pos, name):
            return int(_storage_offsets(src, flat)[0]) - src.storage_offset() + hit[2], True
        return int(flat[0]), False

    def _lost_error(self, value: float, index: int, traced: bool, src_dtype: torch.dtype,
                    dtype: torch.dtype, pos: int | None, name: str | None,
                    at: Callable[[], str], tname: str) -> PatchValueError:
        where_ = f"checkpoint index {index}" if traced else f"element {index} of the source"
        return PatchValueError(
            f"{at()} copied a {src_dtype} source into a {dtype} view, where the value "
            f"{value!r} at {where_} arrives as NaN (the runtime dtype, or a cast the loader "
            "made before, cannot hold it), which a sparse load reads as 'keep', so this "
            "update would be lost. Send this weight dense, or with values the runtime dtype "
            f"can hold. This copy wrote nothing{self._no_source_note(name, tname)}",
            position=pos, name=name, reason="NaN in the runtime dtype", value=index,
        )

    def _fed_by(self, src: object, source: Callable[[], _Who] | None
                ) -> tuple[int | None, str | None]:
        """``(position, name)`` of the patch an op served, for its error: the one its
        source (``src``, a copy's) was traced to, else ``source`` (traced from the op's
        other arguments: a function that traces them, called only here), else the call's
        only patch; ``(None, None)`` where none is known (see :meth:`_check_sparse_write`)."""
        hit = self.provenance.lookup(src) if isinstance(src, torch.Tensor) else None
        if hit is not None:
            return hit[0], hit[1]
        found = source() if source is not None else None
        if found is not None:
            return found
        if len(self._call_patches) == 1:
            return self._call_patches[0]
        return None, None

    def _plain_source(self, src: object) -> object:
        """``src`` as a tensor whose memory holds its values: a lazily negated or
        conjugated one (``conj().imag``, ``torch._neg_view``) resolved into a new tensor,
        which keeps the patch it came from; anything else as it is. The compiled paths and
        the bit comparisons read memory as it is."""
        if not isinstance(src, torch.Tensor) or not (src.is_neg() or src.is_conj()):
            return src
        with torch._C.DisableTorchFunction():
            out = src.resolve_conj().resolve_neg()
        if self.provenance:
            self.provenance.taint(out, (src,))
        return out

    def _refuse_lazy_views(self, op: str, targets, args, source=None) -> None:
        """``ContractViolation`` before a write through a lazily negated or conjugated
        view of a runtime tensor (``p.conj().copy_(w)``, ``z.conj().imag``): torch writes
        the negated or conjugated values, which a save, a merge or a count of its memory
        would take for others. Nothing is written. (A runtime tensor that is such a view
        itself is refused before the load: :meth:`RuntimeIndex.refuse_wrappers`.)"""
        for dest, (tname, _, _) in targets:
            if not (dest.is_neg() or dest.is_conj()):
                continue
            src = args[1] if op == _COPY_NAME and len(args) > 1 else None
            pos, name = self._fed_by(src, source)
            raise ContractViolation(
                f"{self._write_at(pos, name, tname)} wrote "
                f"with {op} through a lazily {_lazy_kind(dest)} view of it (torch's flag, "
                "as .conj() or .conj().imag set it): a sparse, transactional or inspected "
                "load saves, merges and counts memory bit for bit, which such a view "
                "writes negated or conjugated; write into the tensor itself. This op wrote "
                f"nothing{self._no_source_note(name, tname)}",
                position=pos, name=name, reason="lazy view", value=tname,
            )

    def _refuse_self_overlap(self, op: str, targets, src: object, source=None) -> None:
        """``ContractViolation`` before a write through a view whose elements share
        memory (``Tensor.unfold`` with a step below its size, an ``as_strided`` view):
        which of the values written to one address stays is up to the order torch writes
        them in, and a save, a NaN-merge or a count of such a write would take one memory
        element for several. Nothing is written."""
        for dest, (tname, _, _) in targets:
            if dest.is_contiguous() or not _overlaps_itself(dest):
                continue
            pos, name = self._fed_by(src, source)
            raise ContractViolation(
                f"{self._write_at(pos, name, tname)} wrote "
                f"with {op} through a {tuple(dest.shape)} view of strides "
                f"{tuple(dest.stride())} whose elements share memory (overlapping windows, "
                "as Tensor.unfold or as_strided make): which value stays where they meet "
                "is up to the order torch writes them in, and a sparse, transactional or "
                "inspected load can neither save, merge nor count such a write. This op "
                f"wrote nothing{self._no_source_note(name, tname)}",
                position=pos, name=name, reason="self-overlapping view",
                value=tuple(dest.stride()),
            )

    def _refuse_straddling(self, op: str, targets, src: object, source=None) -> None:
        """``ContractViolation`` before a sparse write through a view one of whose
        elements straddles two runtime tensors of one storage (``targets``: the view with
        each tensor it reaches, :meth:`_straddled`): the NaN-merge takes the view's
        elements whole, and its save and count would each need both tensors' parts of
        one element. Nothing is written."""
        dest = targets[0][0]
        names = [own[0] for _, own in targets]
        pos, name = self._fed_by(src, source)
        raise ContractViolation(
            f"{self._write_at(pos, name, names[0])} wrote with {op} through a "
            f"{tuple(dest.shape)} {dest.dtype} view whose elements straddle runtime "
            f"tensors {' and '.join(quoted(n) for n in names[:2])} of one storage (an "
            "element holds the end of one and the start of the next): a sparse load can "
            "neither NaN-merge nor save such a write tensor by tensor. Copy into each "
            "tensor through a view of its own elements, or send the weight dense. This op "
            f"wrote nothing{self._no_source_note(name, names[0])}",
            position=pos, name=name, reason="straddling view", value=tuple(names),
        )

    def _no_source_note(self, name: str | None, tname: str, shown: int = 5) -> str:
        """What a refused op's error adds when it names no patch (``name`` is ``None``):
        the op had none as its source, and which of the call's patches (the first
        ``shown``) it served is not known; and which patch the call last copied into
        runtime tensor ``tname``, where one did. Nothing when it names one."""
        if name is not None:
            return ""
        first = self._call_patches[:shown]
        listed = _patches_named([p for p, _ in first], [n for _, n in first],
                                len(self._call_patches), shown)
        fed = self._call_fed.get(tname)
        last = (f" (before this op, the call last copied {where(*fed)} into runtime tensor "
                f"{quoted(tname)})" if fed is not None else "")
        return (". No patch is named: the op had no patch as its source, and which of "
                f"the call's {len(self._call_patches)} patches ({listed}) it served is not "
                f"known{last}")

    def _save(
        self, t: torch.Tensor, target: str, offset: int, write: torch.Tensor | None
    ) -> SavedRegion | None:
        """Save what a write into ``t`` may change; return the new record, else None.

        Dense writes save their whole view once per region. A NaN-merged write saves the
        elements its source writes (``write``: not NaN; without a report, the whole view
        where that is smaller), every time: two sparse writes into one region change
        different elements.
        """
        if not self.save_regions or t.is_meta:  # (a dry run's tensors hold nothing to keep)
            return None
        if write is None:
            region = _region_key(t)
            if region in self._saved_regions:
                return None
            self._saved_regions.add(region)
            saved = SavedRegion(target, offset, t, t.clone())
        else:
            # (reading the count is the one host wait; the positions are then taken at it)
            count = int(count_true(write))
            if self.recorder is None and _whole_is_smaller(t, count):
                # Only a rollback reads this save: where the written elements with their
                # int64 offsets (and the offsets' scratch) would take more bytes than the
                # view, the view is saved whole (a merge of more than an eighth of a
                # contiguous bfloat16 view's elements, a sixteenth of a float8 one's), so
                # that a rollback's saves stay within the bytes of the regions written
                # (CONTRACT §5).
                saved = SavedRegion(target, offset, t, t.clone())
            else:
                index = _storage_offsets(t, _changed_offsets(write.reshape(-1), count))
                saved = SavedRegion.elements(target, offset, t, index)
        self.saved.append(saved)
        return saved

    # -- the whole load ------------------------------------------------------------------

    def restore(self) -> None:
        """Put every saved region back as it was before the load's first write into it.

        Regions are restored newest first, so where two saved regions overlap the older
        (earlier) contents win. Runs outside any interception: its callers end this
        session's calls first (:meth:`end_calls`), and the dispatch and function modes in
        place (an enclosing load's, when this load runs inside its loader) are off while
        it writes. A region that cannot be
        written back does not stop the others: every other region is restored, then a
        ``RuntimeError`` names the targets left as the load wrote them (raised from the
        first such failure; the load's own error is its ``__context__``).
        """
        failed: list[tuple[SavedRegion, BaseException]] = []
        self.unrestored = []
        self.rolled_back = True
        _ROLLBACKS[0] += 1
        tensors = self.index.tensors
        with torch.no_grad(), _no_modes():
            for saved in reversed(self.saved):
                try:
                    home = tensors.get(saved.target)
                    if (home is not None and saved.viewed_as is not None
                            and _storage_key(saved.view) != _storage_key(home)):
                        saved.rehome(home)
                    saved.restore()
                except Exception as e:  # reported below, after the rest
                    failed.append((saved, e))
        if failed:
            targets = sorted({s.target for s, _ in failed})
            self.unrestored = targets
            raise RuntimeError(
                f"transactional rollback incomplete: {len(failed)} of {len(self.saved)} "
                f"saved regions could not be written back, so {', '.join(map(repr, targets))} "
                f"keep what the load wrote there (every other region was restored); first "
                f"failure: {failed[0][1]!r}"
            ) from failed[0][1]

    def discard(self) -> None:
        """Forget the saved regions (the load succeeded)."""
        self.saved.clear()
        self._measured.clear()
        self._saved_regions.clear()
        self._by_view.clear()


# How many rollbacks (WriteSession.restore) this process began: a report that observes
# a loader sees none of a rollback's writes, and checks this to know one happened.
_ROLLBACKS = [0]


def rollbacks() -> int:
    """How many transactional rollbacks this process has begun (see ``_ROLLBACKS``)."""
    return _ROLLBACKS[0]


def _overlaps_itself(t: torch.Tensor) -> bool:
    """True when two elements of the view ``t`` share memory (exact). Decided from the
    strides alone when each dimension, taken from the smallest stride up, steps past
    all the inner ones reach (every view that slicing, ``narrow``, ``transpose`` or
    ``permute`` make); a view of more elements than the addresses it spans overlaps;
    otherwise by listing the element offsets (``t.numel()`` int64s, at most as many as
    the addresses spanned: only for views such as ``unfold``'s, which may overlap)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 1  # elements spanned by the dimensions taken so far
    for st, n in dims:
        if st < reach:
            break
        reach += st * (n - 1)
    else:
        return False
    span = 1 + sum(st * (n - 1) for st, n in dims)  # addresses from the first to the last
    if t.numel() > span:  # more elements than addresses: some share one
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    flat = offsets.reshape(-1)
    return torch.unique(flat).numel() < flat.numel()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` view the same elements of the same storage the same way."""
    return a.dtype == b.dtype and Region.of(a) == Region.of(b)


def _wait_for(devices: set[torch.device]) -> None:
    """Wait until the work queued on each of ``devices`` (CUDA) has run."""
    for d in devices:
        torch.cuda.synchronize(d)


_STATIC_NONZERO: dict[str, bool] = {}  # device type -> torch.nonzero_static works there


def _whole_is_smaller(view: torch.Tensor, count: int) -> bool:
    """Whether saving ``count`` elements of ``view`` with their storage offsets costs more
    bytes than a copy of the whole view, counting the offsets' scratch at its peak: the
    positions and the offsets at once (8 bytes an element each), and for a view that is
    not contiguous three more such arrays while the offsets are computed
    (:func:`_storage_offsets`)."""
    size = view.element_size()
    scratch = 8 * count * (2 if view.is_contiguous() else 5)
    return max(count * (size + 8), scratch) > view.numel() * size


def _changed_offsets(flat_mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the ``count`` True elements of the 1-D bool ``flat_mask``
    (int64, ascending). Where the host waits for the device, ``nonzero_static`` takes them
    at the known count, without the wait ``nonzero`` makes to size its result."""
    if not count:
        return torch.empty(0, dtype=torch.int64, device=flat_mask.device)
    if (host_waits(flat_mask.device) and count < 2**31 - 1
            and _STATIC_NONZERO.get(flat_mask.device.type, True)):
        try:
            return torch.nonzero_static(flat_mask, size=count).reshape(-1)
        except torch.cuda.OutOfMemoryError:  # (a RuntimeError, but no missing kernel)
            raise
        except (NotImplementedError, RuntimeError, AttributeError):
            # no kernel for this device in this torch (CUDA has one from torch 2.6, MPS
            # from later): nonzero from now on, which waits to size its result
            _STATIC_NONZERO[flat_mask.device.type] = False
    return torch.nonzero(flat_mask).reshape(-1)


def _nan_outside(t: torch.Tensor, write: torch.Tensor) -> int:
    """How many elements of ``t`` are NaN where ``write`` is False."""
    nan = nan_mask(t)
    return int(count_true(nan.logical_and_(write.logical_not())))


class _CallResult:
    __slots__ = ("returned",)

    def __init__(self) -> None:
        self.returned: Any = None


def _patches_named(positions: Sequence[int | None], names: Sequence[str], count: int,
                   most: int = 5) -> str:
    """``"patch 4 ('a'), patch 5 ('b'), and 3 more"``: how every message names the patches
    of a call (``count`` of them; ``positions`` and ``names`` of at least its first
    ``most``), by its first ``most``, then how many more (a call may carry thousands). A
    position that is ``None`` or negative (an observed name no patch has) is left out:
    ``"patch 'a'"``."""
    named = [where(p if p is not None and p >= 0 else None, n)
             for p, n in zip(positions[:most], names)]
    if count > most:
        named.append(f"and {count - most} more")
    return ", ".join(named)


def _call_named(chunk: int, positions: Sequence[int], staged: Sequence[tuple[str, Any]],
                most: int = 5) -> str:
    """``"load_weights (call 2, patch 4 ('a'), patch 5 ('b'))"``: how a message names a
    call, by its first ``most`` patches (:func:`_patches_named`)."""
    named = _patches_named(positions, [n for n, _ in staged[:most]], len(positions), most)
    return f"load_weights (call {chunk}, {named})"


def _returned_text(names: Sequence[str], most: int = 5) -> str:
    """A loader's returned names as a message shows them: the list when it has at most
    ``most``, else ``"5000 names, ['a', 'b', ...]"`` (the first ``most``)."""
    shown = ", ".join(map(quoted, names[:most]))
    return f"[{shown}]" if len(names) <= most else f"{len(names)} names, [{shown}, ...]"
