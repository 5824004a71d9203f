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
"""

from __future__ import annotations

import bisect
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode

from . import native
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
from .errors import (
    ContractViolation,
    PatchTypeError,
    PatchValueError,
    add_note,
    quoted,
    where,
)
from .units import _count

__all__ = [
    "Region",
    "RuntimeIndex",
    "SavedRegion",
    "WriteEvent",
    "WriteRecorder",
    "WriteSession",
]

_aten = torch.ops.aten
_COPY = _aten.copy_.default
_FOREACH_COPY = getattr(getattr(_aten, "_foreach_copy_", None), "default", None)

_WRAP_KINDS: dict[type, int] = {}  # a tensor subclass -> _may_wrap(it)


def _may_wrap(cls: type) -> int:
    """Whether a tensor of subclass ``cls`` may hold its values in inner tensors: 2 when
    it always does (``__tensor_flatten__``: a DTensor, a traceable wrapper), 1 when it
    dispatches ops itself (a wrapper that may have no memory of its own), 0 when not (a
    Parameter subclass as vLLM's: its storage is its own). Once per class."""
    if hasattr(cls, "__tensor_flatten__"):
        return 2
    return 0 if cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ else 1


_UNINITIALIZED = torch.nn.parameter.UninitializedTensorMixin
_STRIDED = torch.strided


def _storageless_kind(t: torch.Tensor) -> str:
    """What a runtime tensor with no strided memory of its own is, for a message."""
    if isinstance(t, _UNINITIALIZED):
        return (f"an {type(t).__name__} (a lazy module's tensor, not materialized yet: "
                "its first forward pass does that)")
    if t.is_nested:
        return "a nested tensor, whose elements are no single strided view of its memory"
    return f"a tensor of layout {str(t.layout).removeprefix('torch.')}"


def _holds_no_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` (not empty) reads as data pointer 0 off the meta device: a tensor
    subclass with no memory of its own."""
    try:
        return not t.is_meta and t.data_ptr() == 0
    except RuntimeError:  # ("has no storage": the same thing, said otherwise)
        return True


def _inexact(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype holds NaN (a floating-point or complex dtype): the tensors
    that can carry a sparse patch's marks, and whose results a patch's marks can reach."""
    return t.is_floating_point() or t.is_complex()


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    """Which storage ``t`` views: its device and the address where the storage starts
    (``t``'s own address less its offset: the same number as
    ``t.untyped_storage().data_ptr()``, without building a storage object). Storages
    with no memory (every storage on the meta device, and empty ones) all start at
    address 0: those are told apart by the storage object's own address instead."""
    start = t.data_ptr() - t.storage_offset() * t.element_size()
    return (t.device, start) if start else (t.device, t.untyped_storage()._cdata)


def _region_key(t: torch.Tensor, key: tuple | None = None) -> tuple:
    """:meth:`Region.of` ``t``'s fields as a plain tuple, which hashes and compares as that
    Region does (``key``: ``t``'s storage key, where the caller has it). The set of
    regions a load saved whole takes one per dense write: a frozen dataclass cost five
    times as much to make and to hash."""
    size = t.element_size()
    return (_storage_key(t) if key is None else key, t.storage_offset() * size,
            tuple(t.shape), t.stride(), size)


@dataclass(frozen=True)
class Region:
    """Where a view sits in its storage: byte offset, shape, element strides, itemsize."""

    key: tuple
    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Region:
        return cls(
            _storage_key(t),
            t.storage_offset() * t.element_size(),
            tuple(t.shape),
            tuple(t.stride()),
            t.element_size(),
        )

    @cached_property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @cached_property
    def _extent(self) -> tuple[int, int]:
        if self.numel == 0:
            return (self.byte_offset, self.byte_offset)
        last = 0
        for d, s in zip(self.shape, self.stride):
            last += (d - 1) * s
        return (self.byte_offset, self.byte_offset + (last + 1) * self.itemsize)

    def extent(self) -> tuple[int, int]:
        """``[start, end)`` in bytes: the smallest byte range holding every element
        (taken once per region)."""
        return self._extent

    def _rows(self) -> tuple[int, int] | None:
        """``(L, S)`` when the view is rows of ``L`` contiguous elements ``S`` elements
        apart (one row: ``S == L``; a single column: ``L == 1``), else ``None``."""
        return self._row_shape

    @cached_property
    def _row_shape(self) -> tuple[int, int] | None:
        rows = native._rows_of(self.shape, self.stride, self.stride)
        if rows is not None:
            return rows[:2]
        strided = [(d, s) for d, s in zip(self.shape, self.stride) if d != 1]
        if len(strided) == 1 and strided[0][1] > 1:
            return (1, strided[0][1])  # one element per row: a column
        return None

    def columns_apart(self, other: Region) -> bool:
        """True when the two views are rows the same distance apart in one storage, with
        elements of one size, that occupy different columns of those rows (two column
        slices of one matrix, say): then they share no element. Cheap; ``False`` means
        "not shown apart", not "overlapping"."""
        if self.key != other.key or self.itemsize != other.itemsize:
            return False
        a, b = self._rows(), other._rows()
        if a is None or b is None or a[1] != b[1] or a[0] == a[1] or b[0] == b[1]:
            return False
        step, width = self.itemsize, a[1]
        if self.byte_offset % step or other.byte_offset % step:
            return False
        ca, cb = self.byte_offset // step % width, other.byte_offset // step % width
        if ca + a[0] > width or cb + b[0] > width:
            return False  # a row wraps into the next one
        return ca + a[0] <= cb or cb + b[0] <= ca

    def overlaps(self, other: Region) -> bool:
        """True when the two views share at least one byte of memory (exact)."""
        if self.key != other.key or self.numel == 0 or other.numel == 0:
            return False
        a0, a1 = self.extent()
        b0, b1 = other.extent()
        if a1 <= b0 or b1 <= a0:
            return False
        if self == other:
            return True
        step = self.itemsize
        if step != other.itemsize or (self.byte_offset - other.byte_offset) % step:
            return True  # reinterpreted storage: the extents overlap, call it an overlap
        if self.columns_apart(other):
            return False
        # Extents meet (e.g. two column slices of one matrix): mark one view's elements in
        # a scratch mask over the shared extent and look for the other's.
        lo = min(a0, b0) // step
        mask = torch.zeros(max(a1, b1) // step - lo, dtype=torch.bool, device="cpu")
        mask.as_strided(self.shape, self.stride, self.byte_offset // step - lo).fill_(True)
        theirs = mask.as_strided(other.shape, other.stride, other.byte_offset // step - lo)
        return bool(theirs.any())


class _Band:
    """The members of a :class:`_RegionIndex` grid that cover one column interval, as
    ``(first row, end row, start byte, end byte, item)``, sorted by first row, with the
    tallest one's height: those a row interval meets are found by bisection."""

    __slots__ = ("c0", "c1", "entries", "tallest")

    def __init__(self, c0: int, c1: int) -> None:
        self.c0, self.c1 = c0, c1
        self.entries: list[tuple] = []
        self.tallest = 0

    def add(self, entry: tuple) -> None:
        if not self.entries or entry[0] >= self.entries[-1][0]:
            self.entries.append(entry)  # (rows written in order)
        else:
            self.entries.insert(bisect.bisect_right(self.entries, entry[0], key=_START), entry)
        self.tallest = max(self.tallest, entry[1] - entry[0])

    def meeting(self, r0: int, r1: int, out: list) -> None:
        entries = self.entries
        first = bisect.bisect_right(entries, r0 - self.tallest, key=_START)
        last = bisect.bisect_left(entries, r1, lo=first, key=_START)
        out.extend(e[4] for e in entries[first:last] if e[1] > r0)

    def discard(self, r0: int, item: object) -> None:
        entries = self.entries
        k = bisect.bisect_left(entries, r0, key=_START)
        while entries[k][4] is not item:
            k += 1
        del entries[k]


class _Grid:
    """The members of a :class:`_RegionIndex` that are rectangles of one matrix: rows of
    elements ``stride`` apart (its key: that stride and the element size). Its bands are
    sorted by first column, with the widest one's width: the bands a column interval
    meets are found by bisection, then the rows of each."""

    __slots__ = ("bands", "by_columns", "c0s", "widest")

    def __init__(self) -> None:
        self.bands: list[_Band] = []
        self.c0s: list[int] = []
        self.by_columns: dict[tuple[int, int], _Band] = {}
        self.widest = 0

    def band(self, c0: int, c1: int) -> _Band:
        band = self.by_columns.get((c0, c1))
        if band is None:
            band = self.by_columns[c0, c1] = _Band(c0, c1)
            k = bisect.bisect_right(self.c0s, c0)
            self.c0s.insert(k, c0)
            self.bands.insert(k, band)
            self.widest = max(self.widest, c1 - c0)
        return band

    def meeting(self, rect: tuple[int, int, int, int], out: list) -> None:
        r0, r1, c0, c1 = rect
        first = bisect.bisect_right(self.c0s, c0 - self.widest)
        for band in self.bands[first:bisect.bisect_left(self.c0s, c1, lo=first)]:
            if band.c1 > c0 and band.entries:
                band.meeting(r0, r1, out)

    def meeting_bytes(self, a0: int, a1: int, out: list) -> None:
        for band in self.bands:
            out.extend(e[4] for e in band.entries if e[2] < a1 and a0 < e[3])


class _RegionIndex:
    """Regions of one storage (``items``, each with the byte extent it was added with),
    for finding those a new region may share an element with: :meth:`meeting` returns
    every added item that does (and perhaps some that do not: callers test those).

    While the added extents are apart (a tensor written row block by row block, experts
    one by one), the ones a new extent meets are found by bisection. Once two extents
    meet, each item whose view is rows of elements a fixed stride apart (column slices of
    a matrix, single columns, interleaved rows, whole rows) is kept as a rectangle of the
    matrix of that row stride, in bands of one column interval sorted by row: a region
    meets the rectangles its own meets, found by bisection on columns and then rows, so a
    loader writing a tensor column by column costs O(k log k), not a test of every pair.
    Anything else (a view of another element size, a row that wraps) is compared with
    every item whose extent meets its own, as before. ``region_of`` gives an item's
    :class:`Region` (the item itself by default), asked only once two extents met."""

    __slots__ = ("_grids", "_loose", "_region_of", "_where", "apart", "ends", "items",
                 "starts")

    def __init__(self, region_of: Callable[[Any], Region] | None = None) -> None:
        # (one per written storage, made on each dense write's first save: the grids,
        # loose items and locations are made only once two extents meet)
        self._region_of = region_of
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.items: list[Any] = []
        self.apart = True

    def __len__(self) -> int:
        return len(self.items) if self.apart else len(self._where)

    def add(self, item: Any, a0: int, a1: int) -> None:
        """Add ``item``, whose view spans bytes ``[a0, a1)`` (nothing, when empty)."""
        if a0 == a1:
            return  # (an empty view shares no byte with any)
        if self.apart:
            ends = self.ends
            if not ends or a0 >= ends[-1]:  # (written in storage order)
                self.starts.append(a0)
                ends.append(a1)
                self.items.append(item)
                return
            k = bisect.bisect_right(ends, a0)
            if k < len(self.starts) and self.starts[k] < a1:
                self._unpart()
                self._place(item, a0, a1)
                return
            self.starts.insert(k, a0)
            ends.insert(k, a1)
            self.items.insert(k, item)
            return
        self._place(item, a0, a1)

    def meeting(self, a0: int, a1: int, region: Region | Callable[[], Region]) -> list:
        """The items that may share an element with ``region`` (spanning ``[a0, a1)``;
        a callable is asked for it only when needed)."""
        if self.apart:
            return self.items[bisect.bisect_right(self.ends, a0):
                              bisect.bisect_left(self.starts, a1)]
        if not isinstance(region, Region):
            region = region()
        out: list = []
        for key, grid in self._grids.items():
            rect = _rect_in(region, key)
            if rect is None:
                grid.meeting_bytes(a0, a1, out)
            else:
                grid.meeting(rect, out)
        out.extend(item for b0, b1, item in self._loose if b0 < a1 and a0 < b1)
        return out

    def discard(self, item: Any, a0: int) -> None:
        """Take out ``item``, added with extent start ``a0``."""
        if self.apart:
            k = bisect.bisect_left(self.starts, a0)
            while self.items[k] is not item:
                k += 1
            del self.starts[k], self.ends[k], self.items[k]
            return
        where = self._where.pop(id(item))
        if where[0] is None:
            self._loose = [e for e in self._loose if e[2] is not item]
        else:
            self._grids[where[0]].by_columns[where[1]].discard(where[2], item)

    def _unpart(self) -> None:
        self.apart = False
        self._grids: dict[tuple[int, int], _Grid] = {}
        self._loose: list[tuple[int, int, Any]] = []
        self._where: dict[int, tuple] = {}  # id(item) -> its grid and band
        for item, a0, a1 in zip(self.items, self.starts, self.ends):
            self._place(item, a0, a1)
        self.starts, self.ends, self.items = [], [], []

    def _fit(self, region: Region) -> tuple[tuple[int, int], tuple] | None:
        """``(grid key, rectangle)`` for ``region``: rows ``S`` apart in the grid of
        stride ``S``; one run of elements in any grid it fits, else as a row of the grid
        of its own length; ``None`` when it is no rectangle."""
        rows = region._rows()
        if rows is None:
            return None
        length, step = rows
        keys = ([(step, region.itemsize)] if length < step
                else [*self._grids, (length, region.itemsize)])
        for key in keys:
            rect = _rect_in(region, key)
            if rect is not None:
                return key, rect
        return None

    def _place(self, item: Any, a0: int, a1: int) -> None:
        found = self._fit(item if self._region_of is None else self._region_of(item))
        if found is None:
            self._loose.append((a0, a1, item))
            self._where[id(item)] = (None,)
            return
        key, (r0, r1, c0, c1) = found
        grid = self._grids.get(key)
        if grid is None:
            grid = self._grids[key] = _Grid()
        grid.band(c0, c1).add((r0, r1, a0, a1, item))
        self._where[id(item)] = (key, (c0, c1), r0)


def _rect_in(region: Region, grid: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """``(first row, end row, first column, end column)``: ``region``'s elements as a
    rectangle of the matrix of rows ``grid[0]`` elements apart (of ``grid[1]``-byte
    elements, from the storage's start), or ``None`` when they are none."""
    stride, itemsize = grid
    if region.itemsize != itemsize or region.byte_offset % itemsize or region.numel == 0:
        return None
    rows = region._rows()
    if rows is None:
        return None
    length, step = rows
    row, col = divmod(region.byte_offset // itemsize, stride)
    if length < step:
        if step != stride or col + length > stride:
            return None
        return (row, row + region.numel // length, col, col + length)
    n = region.numel  # one run of n elements
    if col + n <= stride:
        return (row, row + 1, col, col + n)
    if col == 0 and not n % stride:
        return (row, row + n // stride, 0, stride)
    return None


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)``: the bytes of its storage that non-empty ``t`` spans, its extent
    (for a strided tensor, a column slice of a fused buffer say, wider than its numel
    elements; a contiguous one owns every element of it)."""
    step = t.element_size()
    start = t.storage_offset() * step
    if t.is_contiguous():
        return start, start + t.numel() * step
    return start, Region.of(t).extent()[1]


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The first storage byte of each element of ``t``, in row-major order: its
    :func:`_storage_offsets` in bytes, on the CPU (worked out from its shape and
    strides alone, whatever its device)."""
    return _storage_offsets(t, torch.arange(t.numel())) * t.element_size()


def _holds(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Whether each of storage elements ``x`` (offsets in elements of ``t``'s size) is
    an element of view ``t``: :func:`_position_of`, for many at once (exact where the
    strides nest, as a parameter's do: a column slice of a fused matrix)."""
    rel = x - t.storage_offset()
    ok = rel >= 0
    if not t.numel():
        return ok & False
    for s, n in sorted(((s, n) for n, s in zip(t.shape, t.stride()) if n > 1 and s > 0),
                       reverse=True):
        rel = rel - (rel // s).clamp(0, n - 1) * s
    return ok & (rel == 0)


def _span_in(t: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether view ``t``'s byte extent lies in ``owner``'s."""
    lo, hi = _byte_span(t)
    o0, o1 = _byte_span(owner)
    return o0 <= lo and hi <= o1


def _span_of(view: torch.Tensor, key: tuple | None = None) -> tuple[tuple, int, int, int]:
    """``(storage key, start, end, element size)``: where ``view`` sits in its storage
    (the byte extent of :func:`_byte_span`); ``key``: its storage key, where the caller
    has it."""
    return (_storage_key(view) if key is None else key, *_byte_span(view), view.element_size())


def _owner(name: str, t: torch.Tensor, key: tuple) -> _Owner:
    """``t``'s :class:`_Owner` (of storage ``key``): :func:`_span_of` taken inline, with
    the contiguity it reads (a report makes one per storage it writes)."""
    step = t.element_size()
    start = t.storage_offset() * step
    if t.is_contiguous():
        return _Owner(name, t, key, start, start + t.numel() * step, step, True)
    return _Owner(name, t, key, start, Region.of(t).extent()[1], step, False)


class _Owner(NamedTuple):
    """A runtime tensor and where it sits in its storage: the storage's key, the bytes
    ``[start, end)`` of its extent (see :func:`_byte_span`), its element size, and whether
    it is contiguous (then it owns every element of its extent)."""

    name: str
    tensor: torch.Tensor
    key: tuple
    start: int
    end: int
    step: int
    dense: bool


class _PutBack(NamedTuple):
    """What :meth:`WriteSession._put_back` undid after a sparse call: a change of the
    module tree's structure (:meth:`RuntimeIndex.structure_changed`, or ``None``), the
    names rebound, replaced and added (not tied: ``ties``, which stay), which replaced
    names were gone or moved, the names it could not register again, and what the
    rebound, replaced and added names held before they were put back (where known)."""

    changed: str | None
    rebound: list[str]
    replaced: list[str]
    added: list[str]
    ties: dict[str, str]
    gone: set[str]
    moved: set[str]
    left: list[str]
    held: dict[str, torch.Tensor]


_REGISTRY_NAMES = ("_parameters", "_buffers", "_modules")
_SCAN_MAX = 16  # owners of one storage looked through one by one; more are bisected
# Tensor methods as plain functions, for checks over every runtime tensor that run as C
# loops (``map``) and not as Python ones.
_DETACH = torch.Tensor.detach
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_CUDA = operator.attrgetter("is_cuda")
_ATTRIBUTES = operator.attrgetter("__dict__")
_MODULE_WALK = (
    torch.nn.Module.named_modules,
    torch.nn.Module.named_parameters,
    torch.nn.Module.named_buffers,
    torch.nn.Module._named_members,
)


def _module_tree(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]] | None:
    """``(prefix, module)`` in the order ``named_modules(remove_duplicate=False)`` visits
    them, or ``None`` where a module overrides torch's ways of listing its tensors (or
    the tree is deeper than the recursion limit): then only torch's own walk is right."""
    mods: list[tuple[str, torch.nn.Module]] = []
    stack = [("", model, 0)]
    deepest = sys.getrecursionlimit()
    plain: set[type] = set()  # (module classes seen to list their tensors as torch does)
    while stack:
        prefix, m, depth = stack.pop()
        if depth > deepest:
            return None
        kind = type(m)
        if kind not in plain:
            if not _lists_as_torch(kind):
                return None
            plain.add(kind)
        mods.append((prefix, m))
        below = m.__dict__.get("_modules")  # (as _registry reads it, without its call)
        if isinstance(below, dict) and below:  # (most modules are leaves: nothing to list)
            children = [(f"{prefix}.{k}" if prefix else k, c, depth + 1)
                        for k, c in below.items() if c is not None]
            children.reverse()
            stack += children
    return mods


def _lists_as_torch(kind: type) -> bool:
    """Whether module class ``kind`` lists its tensors and submodules as ``nn.Module``
    does (a duck-typed class without one of those methods does not)."""
    return tuple(getattr(kind, a, None) for a in _WALK_NAMES) == _MODULE_WALK


_WALK_NAMES = ("named_modules", "named_parameters", "named_buffers", "_named_members")


def _registers_twice(model: torch.nn.Module) -> bool | None:
    """Whether a parameter that ``named_parameters(remove_duplicate=False)`` lists is
    listed twice (tied, or under a submodule registered twice), without building a name:
    ``True`` at the first one found. ``None`` where :func:`_module_tree` is (a module
    that lists its tensors its own way, a tree deeper than the recursion limit, or one
    that loops): only torch's own walk is right there."""
    seen: set[int] = set()
    listed = 0
    empty = id(None)  # (an empty slot, ``bias=None``)
    level = [model]
    modules: set[int] = set()
    plain: set[type] = set()  # (module classes seen to list their tensors as torch does)
    for depth in range(sys.getrecursionlimit() + 1):  # (a level per depth)
        modules.update(map(id, level))
        if depth > len(modules):  # (deeper than a tree of its modules can be: a loop)
            return None
        ids: list[int] = []
        below: list = []
        for m in level:
            kind = type(m)
            if kind not in plain:
                if not _lists_as_torch(kind):
                    return None
                plain.add(kind)
            attributes = m.__dict__  # (as _registry reads them, without its calls)
            params, children = attributes.get("_parameters"), attributes.get("_modules")
            if isinstance(params, dict):
                ids += map(id, params.values())
            if isinstance(children, dict):
                below += children.values()
        # (checked a level at a time: the sets and counts of C loops, not Python ones)
        seen.update(ids)
        seen.discard(empty)
        listed += len(ids) - ids.count(empty)
        if len(seen) < listed:
            return True
        level = [c for c in below if c is not None]
        if not level:
            return False
    return None


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_LAYOUT = operator.attrgetter("layout")
_IS_NESTED = operator.attrgetter("is_nested")
_IS_NEG = torch.Tensor.is_neg
_IS_CONJ = torch.Tensor.is_conj
_DTYPE = operator.attrgetter("dtype")
_COLUMNS_FROM = 20  # (modules: from about this many, RuntimeIndex._index_plain is the quicker)


def _entries(
    dicts: list[dict], sizes: Sequence[int], prefixes: Sequence[str] | None = None,
    partners: Sequence[dict] | None = None,
) -> tuple[list[dict], list, list, list | None, list | None]:
    """Every entry of ``dicts`` (of ``sizes``) as columns, in order: the dict holding
    it, its key, its value, and (given each dict's module ``prefixes``) its qualified
    name, as :func:`_tensors_of` makes it, and (given them) its dict's ``partners``.
    Empty dicts are passed over first (most of a module tree's registries)."""
    if not all(sizes):
        dicts = list(itertools.compress(dicts, sizes))
        prefixes = None if prefixes is None else itertools.compress(prefixes, sizes)
        partners = None if partners is None else itertools.compress(partners, sizes)
    names = None if prefixes is None else [
        f"{p}.{k}" if p else k for p, d in zip(prefixes, dicts) for k in d]
    return (_each(dicts, dicts), list(itertools.chain.from_iterable(dicts)),
            list(itertools.chain.from_iterable(map(dict.values, dicts))), names,
            None if partners is None else _each(partners, dicts))


def _each(items: Iterable, dicts: Iterable[dict]) -> list:
    """Each of ``items`` once for every entry of its dict of ``dicts``, in order."""
    return [x for x, d in zip(items, dicts) for _ in d]


def _not_none(values: list) -> list[bool] | None:
    """Which of ``values`` are not ``None`` (by identity: a tensor is never compared),
    or ``None`` where all are not."""
    kept = list(map(operator.is_not, values, itertools.repeat(None)))
    return None if all(kept) else kept


def _kept(mask: list, *columns: list) -> tuple[list, ...]:
    """``columns``, each cut to the places where ``mask`` is true."""
    return tuple(list(itertools.compress(c, mask)) for c in columns)


def _registry(m: torch.nn.Module, attr: str) -> dict:
    """``m._parameters`` (``attr``), or an empty dict where a loader deleted it from the
    module's attributes (a walk of such a tree goes on)."""
    d = m.__dict__.get(attr)
    return d if isinstance(d, dict) else {}


def _listed_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``named_modules(remove_duplicate=False)`` as torch lists it (for a tree that
    :func:`_module_tree` leaves to torch); empty for what is not an ``nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        return []
    return list(model.named_modules(remove_duplicate=False))


def _tensors_of(
    mods: list[tuple[str, torch.nn.Module]], buffers: bool | None, registries: bool = False
) -> list[tuple]:
    """``(name, tensor)`` of each parameter (then buffer, with ``buffers``; ``None``: the
    buffers alone) of ``mods``, in torch's order; with ``registries``, ``(name, tensor,
    the dict that registers it, its key there)``."""
    def of(attr: str) -> list[tuple]:
        if registries:
            return [(f"{prefix}.{k}" if prefix else k, t, d, k)
                    for prefix, m in mods for d in (_registry(m, attr),) for k, t in d.items()
                    if t is not None]
        return [(f"{prefix}.{k}" if prefix else k, t)
                for prefix, m in mods for k, t in _registry(m, attr).items() if t is not None]

    if buffers is None:  # (the buffers alone)
        return of("_buffers")
    return of("_parameters") + of("_buffers") if buffers else of("_parameters")


def named_tensors(
    model: torch.nn.Module, *, buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """``model.named_parameters(remove_duplicate=False)`` followed by
    ``named_buffers(remove_duplicate=False)`` (with ``buffers``), as one list: the same
    names and tensors in the same order.

    Where no module of the model overrides torch's ways of listing them, the module tree
    is walked here, in the order ``named_modules`` visits it, at less than half the cost
    of torch's nested generators (on a model of 300 modules, 0.3 ms against 0.7 ms; a
    load pays it once: a watched load's :class:`RuntimeIndex` walks the tree, and knows
    the tied parameters a plain one finds with this; more only where a loader changed the
    tree). A module that overrides one gets torch's own answer.
    """
    mods = _module_tree(model)
    if mods is None:  # torch's own walk (which raises RecursionError on a tree that loops)
        named = list(model.named_parameters(remove_duplicate=False))
        return named + list(model.named_buffers(remove_duplicate=False)) if buffers else named
    return _tensors_of(mods, buffers)


def _named_now(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """:func:`named_tensors` as a dict, and which of its names are parameters (a tensor
    moved to the other registry under its own name keeps its place in the dict). A name
    listed twice for two tensors (a buffer beside the parameter of that name, a dotted key
    ``root._parameters["lin.weight"]``) maps to ``None``: it names no one tensor."""
    mods = _module_tree(model)
    if mods is None:
        params = list(model.named_parameters(remove_duplicate=False))
        named = params + list(model.named_buffers(remove_duplicate=False))
    else:
        params = _tensors_of(mods, False)
        named = params + _tensors_of(mods, None)
    now = dict(named)
    if len(now) < len(named):
        for n, t in named:
            if now[n] is not t:
                now[n] = None
    return now, {n for n, _ in params}


class RuntimeIndex:
    """Which parameter or buffer owns a piece of storage: the one lookup patchkit has.

    Built from ``model.named_parameters(remove_duplicate=False)`` and
    ``named_buffers(remove_duplicate=False)`` (as :func:`named_tensors` lists them); a
    tensor registered under several names (tied weights) is reported under the first.
    Tensors that share one storage at different offsets (a flat weight buffer) are told
    apart by byte range.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._owners: dict[tuple, list[_Owner]] = {}
        # For overlapping(): a storage's owners sorted by start, where it has many
        self._spans: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
        self._by_key: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        # The aliases among the parameters alone, each with the parameter's first name:
        # what CONTRACT §6 renames (see patchkit.loader.canonicalize_tied).
        self.tied_parameters: dict[str, str] = {}
        # Tensors whose values live in inner tensors of their own (a DTensor, a quantized
        # wrapper subclass): writes into those are not seen, see refuse_wrappers().
        self.wrappers: list[str] = []
        # Runtime tensors that are lazy views (torch's negative or conjugate bit): their
        # memory does not hold their values, see refuse_wrappers().
        self.lazy: list[str] = []
        # Runtime tensors with no strided memory of their own (a lazy module's
        # UninitializedParameter, a sparse or nested tensor, not empty), each with what it
        # is: left out of the index and of tensors (nothing can be looked up in them), see
        # refuse_wrappers().
        self.storageless: dict[str, str] = {}
        self._unindexed: set[str] = set()  # those and the empty ones of their kinds
        mods = _module_tree(model)
        # Where each tensor is registered, and the tree's links, for replaced(): checked
        # by identity after each sparse call instead of walking the tree again.
        self._slots: list[tuple[str, dict, str]] | None = None
        self._alias_slots: list[tuple[str, dict, str]] = []  # the same, of aliases
        # For added(): every registry of the tree (``_parameters``, ``_buffers``,
        # ``_modules`` of each module) and its size, and its empty slots (``bias=None``),
        # which a registration can fill without changing a size. For undo(): each
        # registry's keys in order, and the buffers left out of the state dict. All of it
        # is built in columns where it may (a tree of _COLUMNS_FROM modules or more, its
        # tensors all plain), else one tensor at a time (a small tree is quicker so).
        if mods is None or len(mods) < _COLUMNS_FROM or not self._index_plain(mods):
            self._index_listed(model, mods)

    def _index_listed(
        self, model: torch.nn.Module, mods: list[tuple[str, torch.nn.Module]] | None
    ) -> None:
        """The index's tensors and registries, as :meth:`__init__` describes them, one
        tensor at a time: for any tree (``mods``: :func:`_module_tree`'s listing, or
        ``None`` where torch's own walk is the right one)."""
        first: dict[int, str] = {}
        listed = mods if mods is not None else _listed_modules(model)
        self._links = [(m._modules, k, c) for _, m in listed
                       for k, c in m._modules.items() if c is not None]
        self._registries = [d for _, m in listed for d in (m._parameters, m._buffers, m._modules)]
        # The registries by kind (the module objects, then each module's dict of each kind):
        # a loader may put a new dict in a module's place of one (``m._parameters = {...}``),
        # which every check below, reading the dicts the index holds, would miss.
        self._holders = tuple(m for _, m in listed)
        self._holder_names = tuple(p for p, _ in listed)
        # Each module's attributes (the dict object, which undo() puts back where a loader
        # replaced it), and the places of its registries in them, one per registry.
        self._attributes = tuple(m.__dict__ for m in self._holders)
        self._registry_places = (
            tuple(a for a in self._attributes for _ in _REGISTRY_NAMES),
            _REGISTRY_NAMES * len(self._holders),
        )
        self._sizes = tuple(map(len, self._registries))
        # For undo(): each registry's items in order, as the index found them.
        self._items = [tuple(d.items()) for d in self._registries]
        self._persistence = [(m, m._non_persistent_buffers_set, set(m._non_persistent_buffers_set))
                             for _, m in listed]
        if mods is None:
            params = list(model.named_parameters(remove_duplicate=False))
            self._parameter_names = {n for n, _ in params}
            params = [(n, t, None, None) for n, t in params]
            buffers = [(n, t, None, None) for n, t in model.named_buffers(remove_duplicate=False)]
            held = None
        else:
            params = _tensors_of(mods, False, registries=True)
            buffers = _tensors_of(mods, None, registries=True)
            self._parameter_names = None  # (read from the slots' registries when needed)
            self._slots = []
            held = len(params) + len(buffers) + len(self._links)
        self._empty_slots: list[tuple[dict, str]] = (
            [] if sum(self._sizes) == held  # (no slot is None: nothing to look for)
            else [(d, k) for d in self._registries for k, v in d.items() if v is None]
        )
        for k, (name, t, registry, key) in enumerate(itertools.chain(params, buffers)):
            if id(t) in first:
                if first[id(t)] == name:  # (listed twice, by a listing of a module's own)
                    continue
                self.aliases[name] = first[id(t)]
                if k < len(params):  # (parameters come first: its first name is one too)
                    self.tied_parameters[name] = first[id(t)]
                if self._slots is not None:
                    self._alias_slots.append((name, registry, key))
                continue
            cls = type(t)
            plain = cls is torch.Tensor or cls is torch.nn.Parameter
            if not plain and not isinstance(t, torch.Tensor):
                kind = "parameter" if k < len(params) else "buffer"
                raise PatchTypeError(
                    f"model {type(model).__name__}: {kind} {name!r} is a {cls.__name__}, not "
                    "a tensor (put in a module's registry by hand?); a watched load (sparse, "
                    "transactional or inspected) needs each registered entry to be a tensor "
                    "or None",
                    reason="not a tensor", value=name,
                )
            uninitialized = not plain and issubclass(cls, _UNINITIALIZED)
            if uninitialized or t.layout is not _STRIDED or t.is_nested:
                # (nothing to index: left out; a watched load refuses the model unless the
                # tensor is empty, as an empty strided one is never written)
                self._unindexed.add(name)
                if not uninitialized and t.numel() == 0:
                    continue
                self.storageless[name] = _storageless_kind(t)
                continue
            first[id(t)] = name
            self.tensors[name] = t
            if self._slots is not None:
                self._slots.append((name, registry, key))
            if t.numel() == 0:
                continue
            if not plain:
                kind = _WRAP_KINDS.get(cls)  # (a dict, not a call: 100 k tensors of a
                if kind is None:             # Parameter subclass as vLLM's are common)
                    kind = _WRAP_KINDS[cls] = _may_wrap(cls)
                if kind == 2 or (kind == 1 and _holds_no_memory(t)):
                    self.wrappers.append(name)
            if t.is_neg() or t.is_conj():
                self.lazy.append(name)
            # Each tensor's place in its storage is worked out when a write first reaches
            # that storage (most loads write a few of a model's tensors).
            self._by_key.setdefault(_storage_key(t), []).append((name, t))
        # For _same_sizes(): each slot's key and its module's other registry (the buffers
        # of a parameter), where a tensor under the same name would stand beside it.
        other = {}
        for i in range(0, len(self._registries), 3):
            params, buffers = self._registries[i], self._registries[i + 1]
            other[id(params)], other[id(buffers)] = buffers, params
        beside = [(other[id(reg)], key) for _, reg, key in (self._slots or []) + self._alias_slots
                  if id(reg) in other]
        self._beside_places = tuple(zip(*beside)) or ((), ())

    def _index_plain(self, mods: list[tuple[str, torch.nn.Module]]) -> bool:
        """:meth:`_index_listed`'s work for the common tree, with C loops (``map``,
        ``zip``, ``itertools``) over columns of its registries and tensors where that
        loops in Python over each, and nothing done for an empty registry (most of a
        tree's): the same attributes, equal item for item. (Built one tensor at a time,
        the index took 2.9 ms of a 4.2 ms sparse load of one patch into a PlainModel of
        1000 tensors; in columns, 1.8 ms.)
        Returns ``False``, and sets nothing, where the tree is not that common one: a
        registry not a plain dict in its module's attributes, a registered entry that is
        not a tensor, or a tensor that is not indexed as a plain one is (one with no
        strided memory of its own, a lazy module's, a tensor subclass that may wrap
        inner tensors, a lazily negated or conjugated view): :meth:`_index_listed` then
        does it (and raises what it raises)."""
        holders = tuple(map(_SECOND, mods))
        attributes = tuple(map(_ATTRIBUTES, holders))
        # (each module's registries, read from its attributes as nn.Module keeps them)
        params = list(map(dict.get, attributes, itertools.repeat("_parameters")))
        buffers = list(map(dict.get, attributes, itertools.repeat("_buffers")))
        children = list(map(dict.get, attributes, itertools.repeat("_modules")))
        persistence = list(map(dict.get, attributes,
                               itertools.repeat("_non_persistent_buffers_set")))
        registries = list(itertools.chain.from_iterable(zip(params, buffers, children)))
        if set(map(type, registries)) != {dict} or set(map(type, persistence)) != {set}:
            return False
        sizes = tuple(map(len, registries))
        prefixes = tuple(map(_FIRST, mods))
        # (each entry of a module's parameters, then buffers, with its module's other
        # registry, where a tensor of the same name would stand beside it)
        p_regs, p_keys, p_vals, p_names, p_others = _entries(
            params, sizes[0::3], prefixes, buffers)
        b_regs, b_keys, b_vals, b_names, b_others = _entries(
            buffers, sizes[1::3], prefixes, params)
        c_regs, c_keys, c_vals, _, _ = _entries(children, sizes[2::3])
        held_p, held_b = _not_none(p_vals), _not_none(b_vals)
        if held_p is not None:  # (an empty slot, ``bias=None``: left out)
            p_regs, p_keys, p_vals, p_names, p_others = _kept(
                held_p, p_regs, p_keys, p_vals, p_names, p_others)
        if held_b is not None:
            b_regs, b_keys, b_vals, b_names, b_others = _kept(
                held_b, b_regs, b_keys, b_vals, b_names, b_others)
        held_c = _not_none(c_vals)
        if held_c is not None:
            c_regs, c_keys, c_vals = _kept(held_c, c_regs, c_keys, c_vals)
        tensors = p_vals + b_vals
        for cls in set(map(type, tensors)).difference(_PLAIN):
            if not issubclass(cls, torch.Tensor) or issubclass(cls, _UNINITIALIZED):
                return False
            kind = _WRAP_KINDS.get(cls)
            if kind is None:
                kind = _WRAP_KINDS[cls] = _may_wrap(cls)
            if kind:
                return False
        if (set(map(_LAYOUT, tensors)).difference((_STRIDED,)) or any(map(_IS_NESTED, tensors))
                or any(map(_IS_NEG, tensors))):
            return False
        # (torch sets the conjugate bit on complex tensors only)
        if any(d.is_complex for d in set(map(_DTYPE, tensors))) and any(map(_IS_CONJ, tensors)):
            return False
        regs = p_regs + b_regs
        keys = p_keys + b_keys
        names = p_names + b_names
        others = p_others + b_others
        ids = list(map(id, tensors))
        aliases: dict[str, str] = {}
        tied: dict[str, str] = {}
        alias_slots: list[tuple[str, dict, str]] = []
        alias_others: list[dict] = []
        if len(set(ids)) < len(ids):  # (a tensor listed again: tied, or listed twice)
            first_at = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
            firsts = list(map(first_at.__getitem__, ids))
            for i in [i for i, f in enumerate(firsts) if f != i]:
                first = names[firsts[i]]
                if first == names[i]:  # (under its own name again: nothing more)
                    continue
                aliases[names[i]] = first
                if i < len(p_vals):  # (parameters come first: its first name is one too)
                    tied[names[i]] = first
                alias_slots.append((names[i], regs[i], keys[i]))
                alias_others.append(others[i])
            names, tensors, regs, keys, others = _kept(
                list(map(operator.eq, firsts, itertools.count())),
                names, tensors, regs, keys, others)
        # (an empty tensor: listed, never written, not indexed by storage)
        filled = list(map(torch.Tensor.numel, tensors))
        named = _kept(filled, names, tensors) if 0 in filled else (names, tensors)
        storage = list(map(_storage_key, named[1]))
        by_key = dict(zip(storage, map(list, zip(zip(*named)))))
        if len(by_key) < len(storage):  # (a storage that several tensors share)
            by_key = {}
            for key, name, t in zip(storage, *named):
                by_key.setdefault(key, []).append((name, t))
        # Nothing can fail from here: the index takes what was found.
        self.tensors = dict(zip(names, tensors))
        self.aliases, self.tied_parameters = aliases, tied
        self._slots = list(zip(names, regs, keys))
        self._alias_slots = alias_slots
        self._by_key = by_key
        self._links = list(zip(c_regs, c_keys, c_vals))
        self._registries = registries
        self._holders = holders
        self._holder_names = prefixes
        self._attributes = attributes
        self._registry_places = (
            tuple(itertools.chain.from_iterable(zip(attributes, attributes, attributes))),
            _REGISTRY_NAMES * len(holders),
        )
        self._sizes = sizes
        self._items = [tuple(d.items()) if d else () for d in registries]
        self._persistence = list(zip(holders, persistence, map(set, persistence)))
        self._parameter_names = None  # (read from the slots' registries when needed)
        self._empty_slots = (
            [] if sum(sizes) == len(p_vals) + len(b_vals) + len(c_vals)  # (no slot is None)
            else [(d, k) for d in registries for k, v in d.items() if v is None]
        )
        # For _same_sizes(): each slot's module's other registry. _index_listed pairs each
        # registry dict with its partner in the last module that lists it: the same one,
        # unless a dict with names is listed twice (a module listed twice, or one dict
        # in two modules): then as it does.
        held = [*itertools.compress(params, sizes[0::3]),
                *itertools.compress(buffers, sizes[1::3])]
        if len(set(map(id, held))) < len(held):
            other = dict(zip(
                itertools.chain.from_iterable(zip(map(id, params), map(id, buffers))),
                itertools.chain.from_iterable(zip(buffers, params)),
            ))
            placed = regs + [reg for _, reg, _ in alias_slots]
            others, alias_others = list(map(other.__getitem__, map(id, placed))), []
        beside = (tuple(others + alias_others),
                  tuple(keys + [key for _, _, key in alias_slots]))
        self._beside_places = beside if beside[1] else ((), ())
        return True

    def refuse_wrappers(self, what: str) -> None:
        """``ContractViolation`` (before anything is written) when the model holds a
        runtime tensor with no strided memory of its own (:attr:`storageless`: a lazy
        module's tensor not yet materialized, a sparse or nested tensor), one with
        torch's lazy negative or conjugate bit (:attr:`lazy`), or a
        tensor subclass whose values live in inner tensors (:attr:`wrappers`): a write
        into it, or into what it wraps (``param.to_local().copy_(w)``), reaches storage
        this index does not know, so a load that must see its writes (``what``: a
        sparse, transactional or inspected one) could neither NaN-merge, record nor
        restore it."""
        if self.storageless:
            names = list(self.storageless)
            _refuse_before_load(
                what, names,
                f"{self.storageless[names[0]]}: patchkit saves, NaN-merges and restores "
                "strided memory only", "no strided memory")
        if self.lazy:
            name = self.lazy[0]
            _refuse_before_load(
                what, self.lazy,
                f"a lazily {_lazy_kind(self.tensors[name])} view (torch's flag, as z.conj() "
                "or torch._neg_view set it), whose memory does not hold its values, and "
                "patchkit saves, merges and compares runtime memory bit for bit; make it "
                "plain where the model is built (t.resolve_conj().resolve_neg())",
                "lazy view")
        if self.wrappers:
            _refuse_before_load(
                what, self.wrappers,
                f"a {type(self.tensors[self.wrappers[0]]).__name__}, a tensor subclass whose "
                "values live in inner tensors (a DTensor, a quantized wrapper), whose writes "
                "patchkit cannot see, NaN-merge or restore", "tensor subclass")

    def sharing(self, key: tuple) -> list[_Owner]:
        """The runtime tensors of the storage ``key`` (see :func:`_storage_key`), in the
        order of ``named_parameters`` then ``named_buffers`` (empty: none)."""
        return self._owners_of(key) or []

    def overlapping(self, key: tuple, a0: int, a1: int) -> list[_Owner]:
        """The runtime tensors of the storage ``key`` whose byte extents meet the bytes
        ``[a0, a1)``, in the order of :meth:`sharing`. A storage that many tensors share
        (views of one flat buffer) is searched by bisection, not scanned: a load of n
        writes into n such tensors costs O(n log n), not O(n^2)."""
        owners = self._owners_of(key)
        if not owners:
            return []
        if len(owners) <= _SCAN_MAX:
            return [o for o in owners if a0 < o.end and o.start < a1]
        spans = self._spans.get(key)
        if spans is None:
            order = sorted(range(len(owners)), key=lambda i: owners[i].start)
            starts = [owners[i].start for i in order]
            # (the furthest end of the owners up to each one: where a walk back stops)
            reach = list(itertools.accumulate((owners[i].end for i in order), max))
            spans = self._spans[key] = (order, starts, reach)
        order, starts, reach = spans
        found = []
        i = bisect.bisect_left(starts, a1) - 1  # (the last owner that starts before a1)
        while i >= 0 and reach[i] > a0:
            if owners[order[i]].end > a0:
                found.append(order[i])
            i -= 1
        found.sort()
        return [owners[j] for j in found]

    def _owners_of(self, key: tuple) -> list[_Owner] | None:
        owners = self._owners.get(key)
        if owners is None:
            named = self._by_key.get(key)
            if named is None:
                return None
            owners = self._owners[key] = [_owner(name, t, key) for name, t in named]
        return owners

    def bindings(self) -> dict[str, torch.Tensor]:
        """A detached view of every runtime tensor's current storage (no copy).

        Compare with :meth:`rebound` after a loader call to notice ``param.data = w``.
        """
        return dict(zip(self.tensors, map(_DETACH, self.tensors.values())))

    def grad_flags(self) -> list[bool]:
        """Every runtime tensor's ``requires_grad``, in the order of :attr:`tensors` (one
        C loop: a transactional load reads them beside its :meth:`bindings`, since a
        loader may turn a flag off, ``p.requires_grad_(False)``, which no write shows)."""
        return list(map(_REQUIRES_GRAD, self.tensors.values()))

    def restore_grad_flags(self, flags: list[bool]) -> list[str]:
        """Set each runtime tensor's ``requires_grad`` back to ``flags`` (as
        :meth:`grad_flags` read them) where it differs; returns the names set back. A
        tensor whose flag torch will not set (one an in-place op under
        ``torch.enable_grad()`` made a non-leaf) is left as it is: the rollback of the
        values goes on."""
        now = self.grad_flags()
        if now == flags:
            return []
        back = []
        for (n, t), was, is_ in zip(self.tensors.items(), flags, now):
            if was != is_:
                try:
                    t.requires_grad_(was)
                except RuntimeError:  # (not a leaf: torch keeps its flag)
                    continue
                back.append(n)
        return back

    def rebound(self, bindings: dict[str, torch.Tensor],
                then: list[int] | None = None) -> list[str]:
        """Names whose storage is no longer the one recorded in ``bindings``.

        A load checks after each call: the data pointers first, in one C loop (the
        storages recorded are alive, so a new one has another address), and the storage
        keys only where a pointer moved or is 0 (an empty or meta tensor). ``then``: the
        data pointers of ``bindings`` in the order of :attr:`tensors`, where the caller
        keeps them (they do not change while the bindings live)."""
        now = list(map(_DATA_PTR, self.tensors.values()))
        if then is None:
            then = list(map(_DATA_PTR, map(bindings.__getitem__, self.tensors)))
        if now == then and 0 not in now:
            return []
        return [
            n
            for (n, t), p, q in zip(self.tensors.items(), now, then)
            if (p != q or p == 0) and _storage_key(t) != _storage_key(bindings[n])
        ]

    def reshaped(self, bindings: dict[str, torch.Tensor]) -> list[str]:
        """Names whose tensor views its storage with another shape, strides or offset
        than it did when ``bindings`` were taken: the loader changed the tensor's own
        view in place (``resize_``, ``unsqueeze_``, ``t_``, ``as_strided_``, an ``out=``
        op that resized it, ``set_`` to another part of its storage). (:meth:`rebound`
        sees one bound to other storage.)"""
        return [n for n, t in self.tensors.items()
                if (t.shape, t.stride(), t.storage_offset()) != (
                    (b := bindings[n]).shape, b.stride(), b.storage_offset())]

    @cached_property
    def _columns(self) -> tuple:
        """The slots as columns, for checks that run as C loops (``map``) and not as
        Python ones: (link registries, keys, children), (tensor registries, keys,
        tensors), (empty-slot registries, keys), (alias registries, keys, the tensor each
        alias names)."""
        links = tuple(zip(*self._links)) or ((), (), ())
        names, regs, keys = tuple(zip(*self._slots or ())) or ((), (), ())
        slots = (regs, keys, tuple(map(self.tensors.__getitem__, names)))
        empty = tuple(zip(*self._empty_slots)) or ((), ())
        names, regs, keys = tuple(zip(*self._alias_slots)) or ((), (), ())
        aliases = (regs, keys, tuple(map(self.tensors.__getitem__,
                                         map(self.aliases.__getitem__, names))))
        return links, slots, empty, aliases

    def unchanged(self) -> bool:
        """Whether the module tree is as the index found it, in all that
        :meth:`replaced`, :meth:`replaced_aliases` and :meth:`added` look at: the
        same module attributes and registry dicts, every submodule, tensor and alias in
        its slot, every registry of its size, every empty slot empty. Then all three are
        empty, known at the cost of one look (a load checks after each call, and most
        calls change nothing); ``False`` only says that they have to look closer (always,
        for a tree :func:`_module_tree` leaves to torch)."""
        if self._slots is None:
            return False
        _, slots, empty, aliases = self._columns
        return (
            self._same_tree()
            and self._same_sizes()
            and all(map(operator.is_, map(dict.get, slots[0], slots[1]), slots[2]))
            and all(map(operator.is_, map(dict.get, aliases[0], aliases[1]), aliases[2]))
            # (a key gone reads as its registry: not None)
            and list(map(dict.get, empty[0], empty[1], empty[0])).count(None) == len(empty[1])
        )

    def _same_registries(self) -> bool:
        """Every module the index listed holds the registry dicts it held (no
        ``m._parameters = {...}``)."""
        if self._registries_seen is not None:
            return self._registries_seen
        # (the module's attributes as the index found them, the dict object: a loader may
        # replace it too)
        if not all(map(operator.is_, map(_ATTRIBUTES, self._holders), self._attributes)):
            return False
        try:
            return all(map(operator.is_, map(operator.getitem, *self._registry_places),
                           self._registries))
        except KeyError:  # (a registry deleted outright)
            return False

    _registries_seen: bool | None = None

    @cached_property
    def _shadow_places(self) -> tuple[tuple[dict, ...], tuple[str, ...]]:
        """A plain attribute under a registered name shadows the registry for every read
        of ``m.name`` (``m.__dict__["weight"] = w``): where to look for one, as columns
        (each registered name's module attributes, the name), from the registries as the
        index found them (:attr:`_items`; only a sparse call's check and :meth:`undo`
        read them)."""
        named = self._sizes  # (the registries with names, the rest passed over)
        return (tuple(_each(itertools.compress(self._registry_places[0], named),
                            itertools.compress(self._items, named))),
                tuple(map(_FIRST, itertools.chain.from_iterable(self._items))))

    def structure_changed(self) -> str | None:
        """What a loader changed in the module tree past its registries' contents, or
        ``None``: a module's attributes or a registry dict replaced or deleted (one of
        :meth:`swapped_registries`), or a plain attribute that shadows a registered name
        (``m.__dict__["weight"] = w``, which every read of ``m.weight`` then gets)."""
        if not self._same_registries():
            swapped = self.swapped_registries()
            return (f"replaced registry {swapped[0]!r} of the module tree with a dict of its "
                    "own, or deleted it (e.g. `module._parameters = {...}`)" if swapped else
                    "replaced a module's attributes (`module.__dict__`)")
        attrs, keys = self._shadow_places
        if any(map(operator.contains, attrs, keys)):
            a, k = next((a, k) for a, k in zip(attrs, keys) if k in a)
            prefix = self._holder_names[self._attributes.index(a)]
            name = f"{prefix}.{k}" if prefix else k
            return (f"set a plain attribute {name!r} that shadows the registered one (e.g. "
                    "`module.__dict__['weight'] = w`)")
        return None

    def swapped_registries(self) -> list[str]:
        """The registries a module no longer holds, as ``"prefix._parameters"``: a loader
        replaced (``m._parameters = {...}``) or deleted them. :meth:`undo` puts them
        back."""
        return [f"{prefix}.{attr}" if prefix else attr
                for prefix, m, d, attr in zip(
                    (p for p in self._holder_names for _ in _REGISTRY_NAMES),
                    (m for m in self._holders for _ in _REGISTRY_NAMES),
                    self._registries, self._registry_places[1])
                if m.__dict__.get(attr) is not d]

    @contextlib.contextmanager
    def one_look(self, registries: bool | None = None) -> Iterator[None]:
        """Checks made in the block (:meth:`replaced`, :meth:`replaced_aliases`,
        :meth:`added`) look at the module tree's structure once: for a caller that makes
        several in a row and changes nothing in between (``registries``: whether every
        module holds its registry dicts, where the caller has just looked)."""
        self._registries_seen = self._same_registries() if registries is None else registries
        self._tree_seen = self._same_tree()
        self._sizes_seen = self._same_sizes()
        try:
            yield
        finally:
            self._tree_seen = self._sizes_seen = self._registries_seen = None

    _tree_seen: bool | None = None
    _sizes_seen: bool | None = None

    def _same_sizes(self) -> bool:
        """Every registry of the tree holds as many names as it held, and no name it
        registers stands in its module's other registry too (a buffer beside the
        parameter of that name)."""
        if self._sizes_seen is not None:
            return self._sizes_seen
        return tuple(map(len, self._registries)) == self._sizes and not any(
            map(operator.contains, *self._beside_places)
        )

    def _same_tree(self) -> bool:
        """Every submodule is the object it was, in its slot, and every registry holds
        what it held: each name then lives in the registry it lived in."""
        if self._tree_seen is not None:
            return self._tree_seen
        if self._slots is None:
            return False
        dicts, keys, children = self._columns[0]
        return all(map(operator.is_, map(dict.get, dicts, keys), children)) and (
            self._same_registries()
        )

    def replaced(self) -> list[str]:
        """Names (of :attr:`tensors`) no longer registered to the tensor they named when
        the index was built: ``module.w = nn.Parameter(w)`` or ``register_buffer`` with
        a new tensor, or the name gone, or a new tensor under the name in the other
        registry (a buffer beside the parameter: the state dict lists the last). (:meth:`rebound`
        sees ``param.data = w``.)"""
        if self._same_tree() and self._same_sizes():
            dicts, keys, tensors = self._columns[1]
            now = list(map(dict.get, dicts, keys))
            if all(map(operator.is_, now, tensors)):
                return []
            return [n for (n, _, _), t, held in zip(self._slots, now, tensors) if t is not held]
        now, params = _named_now(self.model)
        was = self._were_parameters()
        return [n for n, t in self.tensors.items()
                if now.get(n) is not t or (n in params) != (n in was)]

    @cached_property
    def tied_names(self) -> dict[str, list[str]]:
        """A tied tensor's first name -> its other names (:attr:`aliases` turned round)."""
        out: dict[str, list[str]] = {}
        for alias, first in self.aliases.items():
            out.setdefault(first, []).append(alias)
        return out

    def replaced_aliases(self) -> list[str]:
        """Aliases (the other names of a tied tensor, see :attr:`aliases`) no longer
        registered to it: ``module.lm_head.weight = nn.Parameter(w)`` unties them, ``del``
        removes them."""
        if not self.aliases:
            return []
        if self._same_tree() and self._same_sizes():
            return [n for n, reg, key in self._alias_slots
                    if reg.get(key) is not self.tensors[self.aliases[n]]]
        now, params = _named_now(self.model)
        was = self._were_parameters()
        return [n for n, first in self.aliases.items()
                if now.get(n) is not self.tensors[first] or (n in params) != (n in was)]

    def _were_parameters(self) -> set[str]:
        """The names (first names and aliases) listed as parameters when the index was
        built, not as buffers."""
        if self._parameter_names is None:
            params = set(map(id, self._registries[0::3]))  # (the dicts as they were)
            self._parameter_names = {
                n for n, reg, _ in (self._slots or []) + self._alias_slots if id(reg) in params
            }
        return self._parameter_names

    def added(self, replaced: Sequence[str] | None = None) -> list[str]:
        """Names registered since the index was built that it does not know (a new
        ``module.extra = nn.Parameter(w)``, a buffer, a submodule with tensors), in
        :func:`named_tensors` order. Found without a walk of the model when the module
        tree is the same, no registry of it changed size or emptied or filled an empty
        slot, and no name (nor alias) was :meth:`replaced` (``replaced``: both lists, where
        the caller has them)."""
        return [n for n, _ in self.added_tensors(replaced)]

    def ties_among(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """Of names added (``(name, tensor)``, see :meth:`added_tensors`), those that hold a
        tensor the index knows (``model.again = model.c``: a new tie, no new values), each
        with the first name of that tensor."""
        first = {id(t): n for n, t in self.tensors.items()}
        return {n: first[id(t)] for n, t in named if id(t) in first}

    def added_tensors(
        self, replaced: Sequence[str] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """:meth:`added` with the tensor each name holds."""
        if replaced is None:
            replaced = self.replaced() + self.replaced_aliases()
        if not replaced and self._same_tree() and self._same_sizes():
            dicts, keys = self._columns[2]
            # (a key gone reads as its registry: not None)
            if list(map(dict.get, dicts, keys, dicts)).count(None) == len(keys):
                return []
        known = self.tensors.keys() | self.aliases.keys() | self._unindexed
        return [(n, t) for n, t in named_tensors(self.model) if n not in known]

    def undo(self) -> bool:
        """Put the module tree's registrations back as the index found them: each
        submodule in its slot, each name registered to its original tensor again (as the
        parameter or buffer it was, in or out of the state dict), each empty slot empty,
        names the model did not have removed, every registry in its order. (The storage of
        a tensor rebound with ``param.data = w`` is the caller's: see :meth:`rebound`.) A
        registry dict the loader put in a module's place of one (``m._parameters = {...}``)
        gives way to the module's own again (and a module's attributes, where the loader
        replaced its ``__dict__``), and a plain attribute under a registered name (which
        shadows it) is removed. Every registry of the tree then holds what it held, in its
        order: a submodule the model did not have is gone too. Returns whether it put
        anything back."""
        changed = False
        for m, attrs in zip(self._holders, self._attributes):
            if m.__dict__ is not attrs:  # (the module's attributes replaced: its own back)
                object.__setattr__(m, "__dict__", attrs)
                changed = True
        for attrs, attr, d in zip(*self._registry_places, self._registries):
            if attrs.get(attr) is not d:
                attrs[attr] = d  # (past nn.Module.__setattr__: the dict itself)
                changed = True
        for d, items in zip(self._registries, self._items):
            # Each registry as it was, in its order: names registered anew back to their
            # tensors, submodules to their slots, names and empty slots the model did not
            # have gone, empty slots it had back, a tensor moved between registries back.
            if len(d) != len(items) or not all(
                k2 == k and v2 is v for (k2, v2), (k, v) in zip(d.items(), items)
            ):
                d.clear()
                d.update(items)
                changed = True
        for attrs, k in zip(*self._shadow_places):
            if k in attrs:
                # A plain attribute under a registered name (``m.__dict__["weight"] = w``)
                # shadows the registry for every read of ``m.weight``: gone.
                del attrs[k]
                changed = True
        for m, now, then in self._persistence:  # (a buffer registered again, as it was)
            if m.__dict__.get("_non_persistent_buffers_set") is not now:
                m.__dict__["_non_persistent_buffers_set"] = now
                changed = True
            if now != then:
                now.clear()
                now.update(then)
                changed = True
        return changed

    def not_undone(self) -> list[str]:
        """After :meth:`undo`: names still not registered to their original tensor (a
        model that does not keep its tensors in ``nn.Module``'s registries, which undo()
        cannot reach)."""
        return self.replaced() + self.replaced_aliases()

    def owner(
        self, t: torch.Tensor, key: tuple | None = None
    ) -> tuple[str, torch.Tensor, int] | None:
        """``(name, runtime tensor, element offset of t in it)`` or ``None``.

        ``None`` means ``t`` is not runtime storage (a scratch buffer, a staged tensor).
        ``key``: ``t``'s storage key, where the caller has it already.
        """
        key = _storage_key(t) if key is None else key
        owners = self._owners_of(key)
        if not owners:
            return None
        b = t.storage_offset() * t.element_size()
        if len(owners) == 1:  # a storage of its own: the common case, decided at once
            o = owners[0]
            if o.dense and o.start <= b < o.end:
                return o.name, o.tensor, (b - o.start) // o.step
        near = self.overlapping(key, b, b + 1)
        if len(near) > 1 or (near and not near[0].dense):
            # Strided tensors that share a storage (column slices of one fused buffer)
            # have byte ranges that interleave: prefer the one that holds t's first
            # element, and give its row-major position in it. Where several hold it
            # (a flat buffer registered beside parameters that are views of it), the
            # first whose extent also holds t's last byte: a write of the whole buffer
            # is the buffer's, not that of the parameter at its start.
            first_holder = None
            end = None
            for o in near:
                at = _position_of(o.tensor, b)
                if at is None:
                    continue
                if first_holder is None:
                    first_holder = o.name, o.tensor, at
                    if len(near) == 1:
                        break
                if end is None:
                    end = _byte_span(t)[1] if t.numel() else b
                if end <= o.end:
                    return o.name, o.tensor, at
            if first_holder is not None:
                return first_holder
        # No runtime tensor holds t's first element as one of its own (a view of another
        # element size may start inside one). t is runtime storage only where its
        # elements reach into one: the one whose extent holds t's first byte, else the
        # first that t meets (a write that starts before a parameter and runs into it),
        # at the position t's first element would have; else it is scratch space beside
        # them (a loader's own area of a flat buffer, the gap columns of a fused one),
        # which a load leaves alone.
        region = Region.of(t)
        if near and (near[0].dense or region.overlaps(Region.of(near[0].tensor))):
            return near[0].name, near[0].tensor, (b - near[0].start) // near[0].step
        for o in self.overlapping(key, *region.extent()):
            if region.overlaps(Region.of(o.tensor)):
                return o.name, o.tensor, (b - o.start) // o.step
        return None


def _cut_at_owners(dest: torch.Tensor, src: torch.Tensor, near: list[_Owner]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``dest`` (a copy's destination, ``src`` its source) cut into views that each lie
    in one of the runtime tensors ``near`` (those its bytes meet), in row-major order:
    one per tensor where ``dest`` is contiguous and ``src`` (broadcast to its shape) can
    be flattened, or where the tensors' bounds fall between slabs of ``dest`` (rows of a
    matrix), else a few boxes per tensor (:func:`_row_major_boxes`). ``None`` where no
    such cut exists: the tensors' extents overlap or are strided (column slices of a
    fused buffer, whose extents interleave), ``dest``'s elements do not run forward
    through its storage (a transposed view), an element of ``dest`` straddles two
    tensors or lies in none (the loader's own space between them)."""
    size = dest.element_size()
    spans = sorted({(o.start, o.end) for o in near})
    if len(spans) < 2 or not all(o.dense for o in near) or any(
            a[1] > b[0] for a, b in itertools.pairwise(spans)):
        return None
    if any(a % size or b % size for a, b in spans):
        return None
    shape, stride = dest.shape, dest.stride()
    inner = 0  # the span of the dims inside each: a dim must step past it
    for n, st in zip(reversed(shape), reversed(stride)):
        if n > 1:
            if st <= inner:
                return None
            inner += st * (n - 1)
    first = dest.storage_offset()
    ranges = [(_count_below(first, shape, stride, a // size),
               _count_below(first, shape, stride, b // size)) for a, b in spans]
    ranges = [(a, b) for a, b in ranges if b > a]
    if sum(b - a for a, b in ranges) != dest.numel():
        return None
    try:
        whole = src.expand(dest.shape)
    except RuntimeError:
        return None
    cuts = [_row_major_boxes(tuple(shape), a, b) for a, b in ranges]
    if any(len(c) > 1 for c in cuts) and dest.is_contiguous():
        try:
            flat = whole.view(-1)
        except RuntimeError:
            flat = None
        if flat is not None:
            d = dest.view(-1)
            return [(d[a:b], flat[a:b]) for a, b in ranges]
    return [(dest[i], whole[i]) for c in cuts for i in c]


def _count_below(offset: int, shape: Sequence[int], stride: Sequence[int], x: int) -> int:
    """How many elements of the view ``(offset, shape, stride)`` (in elements of its
    storage; each dim steps past all the dims inside it, so its row-major order runs
    forward through the storage) lie before storage element ``x``."""
    if offset >= x:
        return 0
    if not shape:
        return 1
    n, s = shape[0], stride[0]
    rest = math.prod(shape[1:])
    span = sum((m - 1) * t for m, t in zip(shape[1:], stride[1:]))
    if offset + (n - 1) * s + span < x:
        return n * rest
    # the slabs that end before x, whole; then the part of the next that does
    full = 0 if n == 1 else max(0, -(-(x - offset - span) // s))
    return full * rest + _count_below(offset + full * s, shape[1:], stride[1:], x)


def _row_major_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple]:
    """Indices (ints and slices) whose views of a tensor of ``shape`` hold, in order,
    its elements ``[a, b)`` in row-major order: the fewest such boxes, whole slabs
    of the first dim where they may."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(slice(a, b),)] if shape else [()]
    rest = math.prod(shape[1:])
    i0, r0 = divmod(a, rest)
    i1, r1 = divmod(b, rest)
    if i0 == i1:
        return [(i0, *k) for k in _row_major_boxes(shape[1:], r0, r1)]
    out: list[tuple] = []
    if r0:
        out += [(i0, *k) for k in _row_major_boxes(shape[1:], r0, rest)]
        i0 += 1
    if i1 > i0:
        out.append((slice(i0, i1),))
    if r1:
        out += [(i1, *k) for k in _row_major_boxes(shape[1:], 0, r1)]
    return out


def _position_of(t: torch.Tensor, byte: int) -> int | None:
    """The row-major position in ``t`` of the element that starts at storage byte
    ``byte``, or ``None`` when no element of ``t`` starts there. Exact for views whose
    strides nest (each at least the span of the smaller ones: slices, transposes and
    permutes of a dense tensor), which is what a parameter or buffer is."""
    step = t.element_size()
    rel, odd = divmod(byte - t.storage_offset() * step, step)
    if rel < 0 or odd or t.numel() == 0:
        return None
    index = [0] * t.dim()
    dims = sorted(((s, d) for d, (n, s) in enumerate(zip(t.shape, t.stride()))
                   if n > 1 and s > 0), reverse=True)
    for stride, d in dims:
        index[d] = min(rel // stride, t.shape[d] - 1)
        rel -= index[d] * stride
    if rel:
        return None
    at = 0
    for k, n in zip(index, t.shape):
        at = at * n + k
    return at


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


def _flat_storage(view: torch.Tensor) -> torch.Tensor:
    """All of ``view``'s storage as a 1-D tensor of its dtype (storage offset 0)."""
    span = view.untyped_storage().nbytes() // view.element_size()
    return view.as_strided((span,), (1,), 0)


def _storage_offsets(view: torch.Tensor, flat_positions: torch.Tensor | None) -> torch.Tensor:
    """Storage element offsets of ``view``'s elements (all, or those at ``flat_positions``,
    positions in the view's row-major order): O(len) work, the view is never copied."""
    if flat_positions is None:
        flat_positions = torch.arange(view.numel(), device=view.device)
    if view.is_contiguous():
        return flat_positions + view.storage_offset()
    out = torch.full_like(flat_positions, view.storage_offset())
    rest = flat_positions
    for d, st in zip(reversed(view.shape), reversed(view.stride())):
        out += (rest % d) * st
        rest = rest // d
    return out


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


class _Source(NamedTuple):
    """One stretch of a storage whose elements came from one staged patch: the bytes
    ``[lo, hi)``, the patch's position and name, ``base`` (the offset in the storage of
    checkpoint element 0, in elements of ``dtype``'s size: the stretch's checkpoint
    elements, :func:`_unit`), whether it is *exact* (see :class:`_Provenance`),
    and, for a storage an op made during the call, a weak reference that says when it
    was freed (``None`` for a staged tensor, which lives as long as the call), and
    ``dtype``, the dtype whose elements its bytes are: the staged dtype, a cast's, or, for
    data an op moved without changing its dtype (a clone of ``w.view(torch.int32)``), the
    dtype its input's bytes were (``None``: not known). NaN, a sparse patch's "keep", is a
    bit pattern of that dtype: a view of these bytes as another dtype does not read it as
    NaN (see :meth:`WriteSession._refuse_reinterpreted`). ``name`` ``None`` (``position``
    too): data of several patches (a ``torch.cat`` of two), kept for its ``dtype`` only:
    :meth:`_Provenance.lookup` and :meth:`_Provenance.source_of` find no patch there.
    ``mixed``: ``(position, name, op)`` where these floating-point bytes are data that an
    op which mixes elements (``op``: a matmul, a reduction, a sort, a cumsum) made, in a
    sparse call, from that patch's data while it held NaN, or anything made from such
    data since (see :meth:`_Provenance.mixed_by`); ``None`` otherwise."""

    lo: int
    hi: int
    position: int | None
    name: str | None
    base: int | None  # None: made from the patch's data by an op that moves elements
    exact: bool
    ref: Any = None
    dtype: torch.dtype | None = None
    # ``(held, read as)``: the stretch was made by a cast of a view that read the patch's
    # bytes (of dtype ``held``) as another dtype (``w.view(torch.int32).float()``): its
    # elements hold no staged NaN where the patch keeps, whatever dtype reads them; or
    # ``(held, held)``: made from a read of its own dtype whose elements straddle two of
    # the patch's (see ``shift``), garbage whatever dtype reads it
    misread: tuple[torch.dtype, torch.dtype] | None = None
    mixed: tuple[int | None, str | None, str] | None = None
    # where ``base`` is None: the byte offset, modulo the size of ``dtype``, at which the
    # stretch's elements begin in the storage, where an op moved a patch's bytes to an
    # offset of no whole element (a clone of ``w.view(torch.uint8)[1:13]``): each element
    # of ``dtype`` there straddles two of the patch's (:func:`_misaligned`). 0: aligned,
    # or not known.
    shift: int = 0
    # where ``base`` is None: ``(checkpoint offset, shape, checkpoint strides, strides,
    # start)`` of the strided view of the patch's own elements that a cast or clone
    # copied into this stretch, all of a new storage (``w[:, 2:5].to(torch.bfloat16)``,
    # or ``w.t().clone()``, which keeps the view's order of dimensions), and the strides
    # and storage offset of the copy: each element of the copy is the checkpoint element
    # of the view at the same index (:func:`_in_layout`)
    layout: tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int] | None = None
    # where ``base`` is None, in a sparse call: no NaN of patches' staged data was
    # replaced by a number on the way here, so a part of the stretch without NaN is made
    # of updates only (see :meth:`_Provenance._paired`): it was made by element moves
    # and copies (``w.flip(0)``, ``b[[0]]``, a cat of two patches) with no tensor of the
    # loader's among their inputs, or by element-wise ops that keep NaN NaN
    # (``w.abs()``, ``w * 2.0``, :data:`_NAN_KEEPING`), from staged data at a known place
    # or such data. Not set where an op wrote it in place since (``buf.nan_to_num_()``).
    nan_kept: bool = False
    # in a sparse call: ``(position, name, op, at)`` where these floating-point bytes are
    # data that an op which may make a number of a NaN (``op``: ``nan_to_num``, ``fmax``,
    # a ``where`` or ``masked_fill`` whose condition comes from patches' data, a put at
    # places it does: :func:`_replaces_nan`) made from that patch's data, or anything
    # made from such data since: the staged NaN, "keep", may be numbers here, which a
    # NaN-merge writes (see :meth:`WriteSession._refuse_replaced`). ``at``: which of
    # the stretch's elements hold a patch's "keep" (NaN before the op, or a number made
    # of one), as ``(mask, first, size)``: a flat boolean mask over the storage's
    # elements of ``size`` bytes from element ``first`` on, which a view of the stretch
    # reads with its own strides (:func:`_keep_in`); ``None`` where not known (after an
    # op that mixes elements: ``w.nan_to_num() @ h``)
    replaced: tuple[int | None, str | None, str, tuple | None] | None = None


def _unchanged(e: _Source) -> bool:
    """Whether stretch ``e`` holds its patches' staged elements unchanged: at a known
    place (``base``, ``layout``), or no NaN of them replaced (:attr:`_Source.nan_kept`);
    not misread, shifted, nor mixed."""
    return (e.misread is None and e.mixed is None and not e.shift
            and (e.base is not None or e.layout is not None or e.nan_kept))


def _trimmed(got: list[_Source], first: int, after: int, lo: int, hi: int,
             between: tuple[_Source, ...]) -> tuple[_Source, ...]:
    """What replaces ``got[first:after]``, the stretches that meet ``[lo, hi)`` (bytes
    now written with ``between``): ``between``, with the parts of the first and the last
    that lie outside ``[lo, hi)`` kept, since those bytes still hold their data (a scratch
    buffer that holds patch a, its first rows then overwritten with b, holds a's data in
    the rest)."""
    if first == after:
        return between
    head, tail = got[first], got[after - 1]
    if head.lo < lo:
        between = (head._replace(hi=lo), *between)
    if tail.hi > hi:
        between = (*between, tail._replace(lo=hi))
    return between


_LO = operator.attrgetter("lo")
_HI = operator.attrgetter("hi")
_START = operator.itemgetter(0)
_saved_region = operator.attrgetter("region")  # (a SavedRegion's Region, for _RegionIndex)


def _refuse_before_load(what: str, names: list[str], why: str, reason: str) -> None:
    """``ContractViolation``: a watched load (``what``) refused for the runtime tensors
    ``names`` (the first named, the rest counted), each being ``why``."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    raise ContractViolation(
        f"{what} into this model is refused before anything is written: runtime tensor "
        f"{names[0]!r}{more} is {why}; a plain dense load (load_checkpoint_weight_patches, "
        "not transactional) goes through",
        reason=reason, value=names[0],
    )


def _lazy_kind(t: torch.Tensor) -> str:
    """What lazy flag ``t`` carries, for a message."""
    return ("conjugated and negated" if t.is_conj() and t.is_neg()
            else "conjugated" if t.is_conj() else "negated")


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


class _Provenance:
    """Which staged patch a tensor's elements came from, and at what element offset.

    Kept per storage as byte ranges, so that staged tensors that share one storage (dense
    patches whose values were cut from one flat bucket, a loader that stages a whole call
    in one buffer) are told apart by where a view starts. A storage made during the call
    (a cast, a clone) is forgotten once it is freed: the allocator may hand its address
    to an unrelated tensor.

    A stretch is *exact* while every element of it is known to be that patch's staged
    element at checkpoint index (element offset - base): a staged tensor, or a cast or
    clone of (a contiguous part of) one, never written to since. Only an exact source
    lets a saved NaN-merge recompute where it wrote from its patch
    (:class:`PatchPositions`); any name is good enough for the ``writes`` table.
    """

    def __init__(self) -> None:
        self._by_key: dict[tuple, list[_Source]] = {}
        # whether ops that mix elements make mixed data (a sparse call's NaN marks "keep";
        # set by WriteSession._call), and whether any stretch is mixed (else a sparse write
        # looks for none)
        self.mixing = False
        self.mixed_seen = False
        # whether any stretch holds data an op may have made numbers of its NaN in (see
        # :attr:`_Source.replaced`; else a sparse write compares none)
        self.replaced_seen = False
        # the storages whose stretches include one an op made (that may expire)
        self._weak: set[tuple] = set()
        # the staged tensors of the call that ended last (storage key, weak reference to
        # the storage): what the loader still holds of them is kept traced into the next
        # call
        self._ended: list[tuple[tuple, Any]] = []
        # the patches of the call in progress by position (the session's: see
        # :meth:`sent_whole`)
        self.patches: dict[int, Any] = {}
        # the session's marks of numbers a cast made NaN (see :class:`_LostMarks`): NaN
        # there is no "keep", which :meth:`_sliced` must not take one for
        self.lost: _LostMarks | None = None

    def clear(self) -> None:
        self._by_key.clear()
        self._weak.clear()
        self.mixed_seen = False
        self.replaced_seen = False

    def keep_past_call(self, keys: Sequence[tuple | None], staged: Sequence[tuple[str, Any]]
                       ) -> None:
        """The call that staged ``staged`` (whose storage keys are ``keys``) ends. Its
        staged tensors' stretches lived as long as the call; :meth:`prune`, before the
        next call, keeps those of the storages the loader still holds (a staged tensor it
        keeps for a later call, to pack it with others, or only a ``detach()`` or
        ``.data`` of one), as long as they live. (A weak reference to each storage, not
        to the tensor: a loader that keeps ``w.detach()`` lets the staged tensor go.)"""
        self._ended = [(key, _weak_storage(t)) for key, (_, t) in zip(keys, staged)
                       if key is not None]

    def prune(self) -> None:
        """Before a call: forget every stretch whose storage was freed, and the staged
        tensors of the call before it whose storages nothing holds any more."""
        ended, self._ended = self._ended, []
        for key, held in ended:
            got = self._by_key.get(key)
            if got is None or held.expired():
                continue  # (freed: the pass below forgets its stretches)
            self._by_key[key] = [e if e.ref is not None else e._replace(ref=held)
                                 for e in got]
            self._weak.add(key)
        for key in list(self._by_key):
            alive = [e for e in self._by_key[key]
                     if e.ref is not None and not e.ref.expired()]
            if alive:
                self._by_key[key] = alive
            else:
                del self._by_key[key]
                self._weak.discard(key)

    def add_staged(self, position: int | None, name: str, staged: torch.Tensor,
                   key: tuple | None = None) -> None:
        """Record ``staged`` as patch ``position``'s (``key``: its storage key, where the
        caller has it)."""
        if staged.numel():
            lo, hi = _byte_span(staged)
            self._put(_storage_key(staged) if key is None else key,
                      _Source(lo, hi, position, name, staged.storage_offset(), True,
                              dtype=staged.dtype))

    def _put(self, key: tuple, src: _Source) -> None:
        """Record ``src``, in place of what its bytes held before (and, where the storage
        holds stretches of storages an op made, of those that were freed).

        A storage's stretches never overlap and are sorted by ``lo``, so by ``hi`` too:
        the ones ``src`` replaces are found by bisection, and a call that stages many
        patches in one bucket pays O(log n) a patch, not O(n)."""
        if src.mixed is not None:
            self.mixed_seen = True
        if src.replaced is not None:
            self.replaced_seen = True
        got = self._by_key.get(key)
        if got is None:
            self._by_key[key] = [src]
            if src.ref is not None:
                self._weak.add(key)
            return
        if key in self._weak or src.ref is not None:
            got = [e for e in got if e.ref is None or not e.ref.expired()]
            if any(e.ref is not None for e in got) or src.ref is not None:
                self._weak.add(key)
            else:
                self._weak.discard(key)
            self._by_key[key] = got
        first = bisect.bisect_right(got, src.lo, key=_HI)  # the first that ends past lo
        after = bisect.bisect_left(got, src.hi, key=_LO, lo=first)  # the first at/after hi
        got[first:after] = _trimmed(got, first, after, src.lo, src.hi, (src,))

    def _find(self, t: torch.Tensor, key: tuple) -> _Source | None:
        """The stretch where ``t`` starts, if ``t``'s storage has one that is alive."""
        got = self._by_key.get(key)
        if got is None:
            return None
        first = t.storage_offset() * t.element_size()
        at = bisect.bisect_right(got, first, key=_LO) - 1  # the last that starts by first
        hit = got[at] if at >= 0 and first < got[at].hi else None
        if hit is not None and hit.ref is not None and hit.ref.expired():
            # The storage an op made was freed, and its address is in use again.
            alive = [e for e in got if e.ref is None or not e.ref.expired()]
            if alive:
                self._by_key[key] = alive
            else:
                del self._by_key[key]
            return None
        return hit

    def lookup(
        self, t: torch.Tensor, *, exact: bool = False, key: tuple | None = None
    ) -> tuple[int, str, int] | None:
        """``(position, name, checkpoint offset of t's first element)``, or ``None``;
        with ``exact``, only for an exact stretch (see the class docstring). ``key``:
        ``t``'s storage key, where the caller has it already. The offset is ``None`` where
        it is not known, and where ``t``'s elements are no checkpoint elements (a view of
        the stretch's bytes as another element size: :meth:`locate` gives its box)."""
        hit = self._find(t, _storage_key(t) if key is None else key)
        if hit is None or hit.name is None or (exact and not hit.exact):
            return None
        if hit.base is None or t.element_size() != _unit(hit, t):
            return hit.position, hit.name, None
        return hit.position, hit.name, t.storage_offset() - hit.base

    def locate(self, t: torch.Tensor, key: tuple | None = None
               ) -> tuple[int, str, int | None, tuple[int, ...] | None,
                          tuple[int, ...] | None] | None:
        """:meth:`lookup`, with the checkpoint elements ``t`` reads: ``(position, name,
        checkpoint offset, shape, strides)``, the last two ``None`` where they are ``t``'s
        own (its elements are the checkpoint's, or their place is not known), else in the
        checkpoint's elements: the box of those that ``t``'s bytes touch
        (:func:`_box_in_units`: rows of ``w.view(torch.uint8)`` are rows of ``w``). The
        offset is ``None`` where not known, or where those elements make no box."""
        hit = self._find(t, _storage_key(t) if key is None else key)
        if hit is None or hit.name is None:
            return None
        if hit.base is None:
            box = None if hit.layout is None else _in_layout(hit, t)
            if box is None:
                return hit.position, hit.name, None, None, None
            return hit.position, hit.name, *box
        unit = _unit(hit, t)
        if t.element_size() == unit:
            return hit.position, hit.name, t.storage_offset() - hit.base, None, None
        box = _box_in_units(t, unit)
        if box is None:
            return hit.position, hit.name, None, None, None
        first, shape, stride = box
        return hit.position, hit.name, first - hit.base, shape, stride

    def stretches(self, t: torch.Tensor) -> list[_Source]:
        """The live stretches that ``t``'s bytes reach into, in storage order (a scratch
        tensor filled a row at a time holds one per row, each with its own ``base``)."""
        got = self._by_key.get(_storage_key(t))
        if not got:
            return []
        lo, hi = _byte_span(t)
        at = max(bisect.bisect_right(got, lo, key=_LO) - 1, 0)
        out = []
        for e in got[at:]:
            if e.lo >= hi:
                break
            if e.hi > lo and (e.ref is None or not e.ref.expired()):
                out.append(e)
        return out

    def read_as(self, t: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``t``'s storage holds no stretch, or one only, whose bytes are of
        ``dtype`` (a complex dtype's counting as its real one's) or of no known dtype:
        then no part of ``t`` reads a patch's bytes as another dtype, without a search of
        :meth:`stretches` (a staged tensor's storage holds one stretch). ``False`` says
        nothing: a search answers."""
        got = self._by_key.get(_storage_key(t))
        if not got:
            return True
        if len(got) > 1:
            return False
        held = got[0].dtype
        return (got[0].misread is None and not got[0].shift
                and (held is None or held.to_real() == dtype))

    def derive(self, src: torch.Tensor, out: torch.Tensor, *, whole: bool) -> bool:
        """``out`` is an element-for-element copy of ``src`` (a cast, a clone, a scratch
        copy); ``whole``: ``out`` is all of a new storage (an op's result), not a part of
        one that may hold other data. ``out`` no longer holds what it held before: an
        untraced source makes it untraced."""
        if not out.numel():
            return False
        okey = _storage_key(out)
        hit = self._find(src, _storage_key(src)) if self._by_key else None
        follow = (src.numel() == out.numel()  # (not a broadcast)
                  and src.is_contiguous() and out.is_contiguous())
        if (follow and hit is not None and hit.base is not None
                and _byte_span(src)[1] <= hit.hi):  # (the common case: one stretch)
            lo, hi = _byte_span(out)
            misread = _misread(hit, src, out)
            self._put(okey, _Source(lo, hi, hit.position, hit.name,
                                    _carried_base(hit, src, out),
                                    hit.exact and whole and misread is None,
                                    _weak_storage(out), _bits_dtype(hit, src, out), misread,
                                    None if hit.mixed is None else _mixed_for(out, hit.mixed),
                                    _carried_shift(hit, src, out),
                                    replaced=_carried_replaced(hit, src, out)))
            return True
        box = None
        if (whole and hit is not None and hit.name is not None and hit.misread is None
                and (hit.base is None) is not (hit.layout is None) and not (
                    follow and hit.base is not None)
                and out.shape == src.shape and src.element_size() == _unit(hit, src)
                and _byte_span(src)[1] <= hit.hi and _packed(out)):
            # A cast or clone of a strided view of one patch's own elements (a column
            # slice, ``w[:, 2:5].to(torch.bfloat16)``; a transposed view, whose copy keeps
            # its order of dimensions), or of a view of such a copy: each element of
            # ``out`` is the checkpoint element of ``src`` at the same index; no ``base``
            # says where, but the view's place in the checkpoint does.
            if hit.base is not None:
                box = src.storage_offset() - hit.base, tuple(src.stride())
            else:
                found_box = _in_layout(hit, src)
                if found_box is not None:
                    box = found_box[0], found_box[2]
        if box is not None:
            lo, hi = _byte_span(out)
            self._put(okey, _Source(
                lo, hi, hit.position, hit.name, None, False, _weak_storage(out),
                _bits_dtype(hit, src, out), None,
                None if hit.mixed is None else _mixed_for(out, hit.mixed),
                layout=(box[0], tuple(src.shape), box[1], tuple(out.stride()),
                        out.storage_offset()), nan_kept=_unchanged(hit),
                replaced=_carried_replaced(hit, src, out)))
            return True
        found = self.stretches(src) if self._by_key else []
        if follow and found:
            # A source that reaches several stretches, or starts where none is (a scratch
            # buffer of two patches, or padding then a patch): each stretch is followed
            # to the elements of ``out`` it becomes, the rest of ``out`` holds none.
            lo, hi = _byte_span(out)
            if not whole and okey in self._by_key:
                self._forget(okey, lo, hi)
            ss, os_ = src.element_size(), out.element_size()
            s0 = src.storage_offset()
            ref = _weak_storage(out)
            for e in found:
                k0 = max(e.lo - s0 * ss, 0) // ss
                k1 = -(-(min(e.hi, _byte_span(src)[1]) - s0 * ss) // ss)
                misread = _misread(e, src, out)
                self._put(okey, _Source(
                    lo + k0 * os_, lo + k1 * os_, e.position, e.name,
                    _carried_base(e, src, out), e.exact and whole and misread is None,
                    ref, _bits_dtype(e, src, out), misread,
                    None if e.mixed is None else _mixed_for(out, e.mixed),
                    _carried_shift(e, src, out), nan_kept=misread is None and _unchanged(e),
                    replaced=_carried_replaced(e, src, out)))
            return True
        if not whole:
            # A copy into a tensor of the loader's own (a scratch buffer) that cannot be
            # followed element for element (a transposed or column-sliced source or
            # destination): ``out`` holds ``src``'s data now, at offsets nobody knows, its
            # bytes of the dtype they were (so that a view of them as another dtype is
            # refused as it is for ``src``).
            self._moved_into(out, [(src, e) for e in found],
                             nan_kept=self.mixing and self._all_unchanged((src,)))
        return False

    def source_of(self, args: Sequence[Any], kwargs: dict) -> tuple[int | None, str] | None:
        """``(position, name)`` of the one patch that the tensor arguments of an op (lists
        of tensors too) come from, or ``None``: none traced, or more than one patch."""
        if not self._by_key:
            return None
        found = None
        for _, hit in self._traced_data((*args, *kwargs.values())):
            if hit.name is None:  # (data of several patches already)
                return None
            who = (hit.position, hit.name)
            if found is not None and found != who:
                return None
            found = who
        return found

    def _traced(self, args: Iterable[Any]) -> Iterator[tuple[torch.Tensor, _Source]]:
        """Each tensor among ``args`` (lists and tuples of tensors too) that holds a
        patch's data, with each stretch it reaches (not only the one where it starts: a
        scratch buffer whose first rows are padding holds a patch's data further on)."""
        for a in args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if isinstance(t, torch.Tensor) and t.numel():
                    for hit in self.stretches(t):
                        yield t, hit

    def _traced_data(self, args: Iterable[Any]) -> list[tuple[torch.Tensor, _Source]]:
        """:meth:`_traced`, less the integer and boolean tensors where a floating-point
        one is traced too: those are an op's indices or mask (``w[order]``, a gather, a
        ``where``), which say where the data goes, not what it is (an ``argsort`` of patch
        a that orders patch b's rows: the result is b's data)."""
        found = list(self._traced(args))
        if len(found) > 1:
            data = [f for f in found if _inexact(f[0])]
            if data:  # (none: bits moved as integers, ``w.view(torch.int32)``'s)
                return data
        return found

    def taint(self, out: torch.Tensor, args: Sequence[Any], kwargs: dict | None = None,
              func: Any = None) -> None:
        """``out``, a new tensor an op made from ``args`` (and ``kwargs``' values), holds
        the data of the patches they are traced to, at offsets nobody knows: one patch's
        (named), or several patches' (a ``torch.cat`` of two: kept for its dtype only).
        ``func``: the op, which in a sparse call may mix those data (see :meth:`mixed_by`)."""
        if not out.numel() or not self._by_key:
            return
        okey = _storage_key(out)
        for a in args:  # an op that hands back its input: no new data
            if isinstance(a, torch.Tensor) and _storage_key(a) == okey:
                return
        if self.mixing and func is not None and _makes_anew(func):
            # (``torch.zeros_like(w)``: a tensor of the loader's own, none of w's numbers;
            # in a sparse call, no element of it keeps: where it replaces a NaN,
            # ``torch.where(w.isnan(), torch.zeros_like(w), w)``, the constant is the
            # loader's)
            if okey in self._by_key:
                self._forget(okey, *_byte_span(out))
            return
        found = self._traced_data((*args, *kwargs.values()) if kwargs else args)
        if found:
            kept = False  # (whether no NaN of the patches' data is replaced in out)
            if self.mixing:
                if func is None or _rearranges(func):
                    kept = self._all_unchanged(args)
                elif _keeps_nan(func):
                    kept = _traced_unchanged(found)
            floating = _inexact(out)
            mixed = (self.mixed_by(func, found, args, kwargs or {}, out.numel(), out)
                     if func is not None and self.mixing and floating else None)
            if (mixed is None and not kept and self.mixing and floating
                    and func is not None and _slices_of(func)):
                # (a sum of rows kept or updated whole: where it holds no NaN, updates
                # only, as an element-wise op's that keeps NaN NaN)
                kept = _traced_unchanged(found)
            self._moved_into(out, found, mixed, nan_kept=kept,
                             replaced=(self._replaced_by(func, args, kwargs or {}, found, out)
                                       if floating else self._counted_marks(func, found))
                             if self.mixing else None)

    def _all_unchanged(self, args: Sequence[Any]) -> bool:
        """Whether every floating-point tensor among ``args`` (lists of tensors too) lies
        in one stretch whose elements are its patches' staged ones, unchanged
        (:func:`_unchanged`): an element move of them makes :attr:`_Source.nan_kept` data.
        A tensor of the loader's (untraced) among them: ``False``."""
        seen = False
        for a in args:
            for t in _listed(a):
                if not isinstance(t, torch.Tensor) or not _inexact(t) or not t.numel():
                    continue
                got = self.stretches(t)
                if len(got) != 1 or not _unchanged(got[0]):
                    return False
                if not _inside(t, got[0]):
                    return False
                seen = True
        return seen

    def _replaced_by(self, func: Any, args: Sequence[Any], kwargs: dict,
                     found: list[tuple[torch.Tensor, _Source]], out: torch.Tensor
                     ) -> tuple[int | None, str | None, str, tuple | None] | None:
        """What :attr:`_Source.replaced` says of ``out``, the floating-point result of op
        ``func`` (``None``: a copy or cast) of ``args`` and ``kwargs`` in a sparse call,
        whose inputs traced to patches' data are ``found`` (each with a stretch it
        reaches): carried from an input that says one, or made by ``func`` where it may
        make a number of a NaN of a patch that may hold NaN (:meth:`_replacing`);
        ``None`` otherwise. Which of its elements keep: :meth:`_keep_made`."""
        got = (next((e.replaced for _, e in found if e.replaced is not None), None)
               if self.replaced_seen else None)
        if got is None and self.replaced_seen and func is not None and _pairs(func):
            # (an integer or boolean operand made of a patch's marks, which found leaves
            # out as a mask: ``(a > 0) * b`` of a ``b`` all updated, where ``a`` keeps,
            # writes 0.0 or b, not known which is right)
            got = next((e.replaced for _, e in self._mask_operands(func, args, kwargs)
                        if e.replaced is not None), None)
            if got is not None:
                return (*got[:3], None)
        if got is None:
            if func is None or not _replaces_nan(func):
                return None  # (most ops: no search)
            who = self._replacing(func, _inputs(func, args, kwargs), found)
            if who is None:
                return None
            got = (*who, _op_name(func), None)
        keep = self._keep_made(func, args, kwargs, out)
        return (*got[:3], None if keep is None else _keep_at(keep, out))

    def _counted_marks(self, func: Any, found: list[tuple[torch.Tensor, _Source]]
                       ) -> tuple[int | None, str | None, str, None] | None:
        """:attr:`_Source.replaced` of an integer or boolean result of op ``func``
        (``None``: a copy or cast) in a sparse call, whose inputs traced to patches' data
        are ``found``: an op that reads a patch's floating-point data not sent whole
        makes numbers of its NaN, the "keep" marks, as ``argmax``, ``w > 0``, a sort's or
        a ``max``'s indices do (a kept row's index is 0, not the runtime tensor's; ``NaN
        > 0`` is ``False``), at places not known; made from such a result, the same
        (``~(w > 0)``). ``isnan`` and ``isfinite`` say where the marks are and make
        none. A copy into the model of it, or of what a cast, a ``where`` or a pick of
        the loader's own data by it makes, is refused where it changes an element
        (:meth:`WriteSession._replaced_loss`); as the indices of a move of a patch's
        data (``w.gather(1, perm)``) it is none of the result's data
        (:meth:`_keep_made`)."""
        for t, e in found:
            if (func is not None and _inexact(t)
                    and _base_name(func) not in _EXACT_MARKS
                    and (e.name is None or not self.sent_whole(e.position, e.name))):
                return e.position, e.name, _op_name(func), None
        return next(((*e.replaced[:3], None) for _, e in found if e.replaced is not None),
                    None)

    def _replacing(self, func: Any, inputs: Sequence[Any],
                   found: list[tuple[torch.Tensor, _Source]]
                   ) -> tuple[int | None, str | None] | None:
        """``(position, name)`` of the patch whose NaN op ``func`` may make numbers of,
        reading ``inputs`` (``found``: those traced to patches' data, with a stretch
        each): a floating-point one of a patch not sent whole (``None, None``: of data of
        several patches), where ``func`` is one of :func:`_replaces_nan` (a pick or put
        only where its condition, mask or index is traced to patches' data); else
        ``None``."""
        kind = _replaces_nan(func)
        if not kind:
            return None
        if kind is _SELECTS and not any(
                not _inexact(t) for t, _ in self._traced(inputs)):
            return None  # (a mask of the loader's own picks, as a move does)
        for t, e in found:
            if _inexact(t) and e.mixed is None and (
                    e.name is None or not self.sent_whole(e.position, e.name)):
                return e.position, e.name
        return None

    def _keep_of(self, t: Any) -> torch.Tensor | bool | None:
        """Which elements of ``t``, an input of an op, hold a patch's "keep": where it
        is data an op made numbers of NaN in, the stretch's mask (:func:`_keep_in`);
        other patches' data, its NaN; ``None`` where it holds no patch's data (a tensor
        of the loader's or the model's own, a number); ``False`` where not known."""
        if not isinstance(t, torch.Tensor):
            return None
        if not _inexact(t):
            # (indices or a mask made of the marks, :meth:`_counted_marks`: not known)
            return (False if t.numel() and any(e.replaced is not None
                                               for e in self.stretches(t)) else None)
        hits = self.stretches(t) if t.numel() else []
        if not hits:
            return None
        if all(e.replaced is None for e in hits):
            return False if t.is_meta else nan_mask(t.detach())
        got = _keep_in(hits[0], t) if len(hits) == 1 else None
        return False if got is None else got

    def _keep_made(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor
                   ) -> torch.Tensor | None:
        """Which elements of ``out`` hold a patch's "keep", ``out`` made (or, in place,
        about to be written: read before) by ``func`` of ``args`` and ``kwargs``: an
        element-wise op's, where an input's element at that place does (broadcast; a
        ``where``'s too: ``torch.where(w.isnan(), param, w)`` holds ``param``'s values
        where ``w`` keeps); a move's (``flip``, ``cat``, indexing), the same move of its
        inputs' masks; a put's, its destination's (all of one of the loader's own, which
        holds no update), with the value's where it puts a patch's data. ``None``: not
        known (a matmul's, a reduction's), or ``func`` is none of these. An element
        made of several patches' elements keeps where all of them keep (where one
        updates, the merge should write it: ``buf.nan_to_num_().mul_(0.0).add_(b)``
        holds b's updates where a kept); the pairing check sees the others
        (:meth:`_paired`). An input whose mask is not known constrains none (a scale
        made of them, ``w / w.nan_to_num().abs().amax()``), unless all are such."""
        if func is None or out.is_meta or not out.numel():
            return None
        try:
            if func in _PUT_VALUES:
                dest = self._keep_of(args[0] if args else None)
                if dest is False:
                    return None
                keep = (torch.ones(out.shape, dtype=torch.bool, device=out.device)
                        if dest is None else dest.to(out.device).expand(out.shape).clone())
                value = _arg(func, args, kwargs, _PUT_VALUES[func])
                put = self._keep_of(value)
                if put is False:
                    return None
                if put is not None:
                    _put_again(func, args, kwargs)(keep, put.to(out.device))
                return keep
            if _element_wise(func):
                keep, unknown = None, False
                for t in _inputs(func, args, kwargs):
                    got = self._keep_of(t)
                    if got is False and _pairs(func) and not _inexact(t):
                        return None  # (``(w > 0) * b``: b's update, times which w's mark?)
                    if got is False:
                        unknown = True
                    elif got is not None:
                        got = got.to(out.device)
                        keep = got if keep is None else keep & got
                if keep is None:
                    return None if unknown else torch.zeros(
                        out.shape, dtype=torch.bool, device=out.device)
                return keep.expand(out.shape)
            if func in _MOVES:
                first = args[0]
                ins = list(first) if isinstance(first, list | tuple) else [first]
                masks = []
                for t in ins:
                    got = self._keep_of(t)
                    if got is False:
                        return None
                    masks.append(torch.zeros(t.shape, dtype=torch.bool, device=t.device)
                                 if got is None else got)
                if all(self._keep_of(t) is None for t in ins) and any(
                        self._keep_of(i) is False for a in (*args[1:], *kwargs.values())
                        for i in (a if isinstance(a, list | tuple) else (a,))):
                    # (``h.gather(1, w.argsort(1))``, ``h[w.argmax(1)]``: picked by the
                    # marks)
                    return None
                return func(masks if isinstance(first, list | tuple) else masks[0],
                            *args[1:], **kwargs).to(out.device)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None  # (an op the masks cannot replay: not known)
        return None

    def replacing_in_place(self, func: Any, args: Sequence[Any], kwargs: dict,
                           written: Sequence[torch.Tensor]) -> list | None:
        """Before op ``func`` writes ``written`` (tensors of the loader's own, or staged
        ones) in place or as its ``out=``, in a sparse call: ``(tensor, replaced)`` for
        each floating-point one of them, where ``func`` may make a number of a NaN of a
        patch's data among its inputs (see :meth:`_replacing`; ``buf.nan_to_num_()``,
        ``w.masked_fill_(w.isnan(), 0.0)``, ``w[w.isnan()] = 0.0``), or an input holds
        such data already (``buf.mul_(2.0)`` of one), each with which of its elements
        keep (:meth:`_keep_made`) read now; ``None`` where neither. Handed to
        :meth:`replaced_in_place` once the op has run."""
        if not self.replaced_seen and not _replaces_nan(func):
            return None  # (``buf.mul_(2.0)`` before any such op: no search)
        inputs = _inputs(func, args, kwargs)
        found = self._traced_data(inputs)
        got = next((e.replaced for _, e in found if e.replaced is not None), None)
        if got is None:
            if not _replaces_nan(func):
                return None
            who = self._replacing(func, inputs, found)
            if who is None:
                return None
            got = (*who, _op_name(func), None)
        out = []
        for t in written:
            if _inexact(t):
                keep = self._keep_made(func, args, kwargs, t)
                out.append((t, (*got[:3], None if keep is None else _keep_at(keep, t))))
        return out

    def replaced_in_place(self, marks: list) -> None:
        """Each tensor of ``marks`` (from :meth:`replacing_in_place`) holds, from now on,
        data whose NaN an op may have made numbers of: its stretches say so (with which
        of its elements keep, read before the op)."""
        for t, r in marks:
            key = _storage_key(t)
            got = self._by_key.get(key)
            if not got:
                continue
            lo, hi = _byte_span(t)
            self._by_key[key] = [e._replace(replaced=r) if e.lo < hi and lo < e.hi
                                 and e.mixed is None else e for e in got]
            self.replaced_seen = True

    def mixed_by(self, func: Any, found: list[tuple[torch.Tensor, _Source]],
                 args: Sequence[Any], kwargs: dict, size: int,
                 out: torch.Tensor | None = None
                 ) -> tuple[int | None, str | None, str] | _Sliced | None:
        """``(position, name, op)`` where ``func``, an op that makes a floating-point
        output, mixes elements (see :func:`_mixes`) and one of its floating-point inputs
        ``found`` (each with a stretch it reaches) is traced to a patch's data and holds
        NaN, a sparse patch's "keep": the output holds that NaN spread over elements the
        patch updates, or its numbers at other places, which a NaN-merge would take
        element by element. Read only at such ops (rare in loaders); ``None`` otherwise
        (a mixed input is carried by :meth:`_moved_into` itself). ``args`` and ``kwargs``:
        the op's arguments; ``size``: the number of elements of its (first) output. A put
        that adds or reduces (:data:`_COMBINING_PUTS`) mixes only where it puts two
        elements at one place; a reduction (``torch.Tag.reduction``) only where it reduces
        a dim longer than 1 (an input of ``size`` elements: ``torch.stack([w]).sum(0)``);
        an op over slices (:func:`_slices_of`: a reduction, a scan, a softmax, a sort, a
        matmul) only where a slice both keeps and updates, or its result ``out`` (``None``:
        in place, decided once it has run) is not NaN exactly where they keep
        (:meth:`_sliced`).
        An element-wise op (:func:`_pairs`) mixes where it pairs different elements of
        patches' data (see :meth:`_paired`)."""
        kind = _mixes(func)
        if not kind:
            if _pairs(func):
                masked = self._masked_by_patch(func, found, args, kwargs)
                if masked is not None:
                    return masked
            if len(found) > 1 and _pairs(func):
                return self._paired(func, found)
            return None
        if kind is _PUT and not _combines(func, args, kwargs):
            return None
        read: list[tuple[torch.Tensor, _Source]] = []
        for t, e in found:
            if (e.mixed is not None or t.is_meta
                    or not _inexact(t)
                    or (kind is _REDUCES and t.numel() == size)
                    or any(t is r for r, _ in read)):
                continue
            read.append((t, e))
        if read and kind is not _PUT and _slices_of(func):
            return self._sliced(func, read, args, kwargs, out)
        for t, e in read:
            if bool(nan_mask(t).any()):
                if kind is _PUT and not _puts_repeat(func, args, kwargs):
                    return None
                return e.position, e.name, _op_name(func)
        return None

    def _mask_operands(self, func: Any, args: Sequence[Any], kwargs: dict
                       ) -> list[tuple[torch.Tensor, _Source]]:
        """The integer and boolean tensors among op ``func``'s inputs that hold a
        patch's data (``w > 0``, ``w.argmax(1)``), each with a stretch it reaches: what
        :meth:`_traced_data` leaves out as an op's mask or indices. Most element-wise ops
        (``w * scale``) have none, found without a look-up."""
        masks = [t for a in _inputs(func, args, kwargs)
                 for t in (a if isinstance(a, list | tuple) else (a,))
                 if isinstance(t, torch.Tensor) and not _inexact(t)]
        return list(self._traced(masks)) if masks else []

    def _masked_by_patch(self, func: Any, found: list[tuple[torch.Tensor, _Source]],
                         args: Sequence[Any], kwargs: dict
                         ) -> tuple[int | None, str | None, str] | None:
        """``(position, name, op)`` where element-wise op ``func`` pairs an integer or
        boolean operand made of a patch's data (``w > 0``, ``w.isnan()``, of any patch,
        sent whole too) with floating-point data of patches ``found`` that holds NaN:
        ``(a > 0) * b`` is NaN where ``b`` keeps, so an update of ``a`` there is lost,
        and where ``b`` updates it is paired with an element of ``a``'s that may keep
        (as :meth:`_paired` refuses ``a * b``). ``None`` where there is none such."""
        if not found or not self._mask_operands(func, args, kwargs):
            return None
        for t, e in found:
            if (not t.is_meta and _inexact(t)
                    and e.mixed is None and bool(nan_mask(t).any())):
                return e.position, e.name, _op_name(func)
        return None

    def _sliced(self, func: Any, read: list[tuple[torch.Tensor, _Source]],
                args: Sequence[Any], kwargs: dict, out: torch.Tensor | None
                ) -> tuple[int | None, str | None, str] | _Sliced | None:
        """:meth:`mixed_by` for op ``func`` of :func:`_slices_of`, whose floating-point
        inputs traced to patches' data are ``read`` (each tensor once, with a stretch it
        reaches): it mixes (``(position, name, op)``, of the first that holds NaN) where
        one holds NaN and, for an element of its result ``out``, the elements of all of
        them it is computed from (its slices: a row of ``w.sum(1)``, ``w.amax(1,
        keepdim=True)``, ``w.sort(1)``, ``w.cumsum(1)``, ``w.softmax(1)``, ``w @ h``; the
        whole of ``w`` for ``w.amax()``; row i of ``a`` and column j of ``b`` for
        element (i, j) of ``a @ b``) both keep (NaN) and update (none), or ``out`` is not
        NaN exactly where they all keep, or a complex input's parts do not keep alike.
        Otherwise the merge keeps the runtime value where they all keep, made by the
        same op of the same kept elements, and writes the others, made of updates only
        (so not ``nansum``'s sum of a kept row, a number, nor a matmul whose other
        operand holds an infinity, which makes NaN of an update). One host wait.
        ``out`` ``None`` (an in-place or ``out=`` op, read before it runs): what was
        read, for :meth:`settled`."""
        keeps = [nan_mask(t) for t, _ in read]
        lo = hi = None
        exact = False
        try:
            for (t, _), keep in zip(read, keeps):
                got = _slice_masks(func, args, kwargs, t, keep)
                if got is None:
                    lo = hi = None
                    break
                exact = exact or got[2]
                lo = got[0] if lo is None else lo & got[0]
                hi = got[1] if hi is None else hi | got[1]
        except (RuntimeError, TypeError, IndexError, ValueError):
            lo = hi = None  # (masks that do not broadcast together: mixed)
        op = _op_name(func)
        if lo is not None and self.lost and any(self.lost.of(t) is not None for t, _ in read):
            lo = None  # (a number a cast made NaN: no "keep", a lost update; rare)
        if lo is None:
            for (_, e), keep in zip(read, keeps):
                if bool(keep.any()):
                    return e.position, e.name, op
            return None
        device = keeps[0].device
        parts = torch.ones((), dtype=torch.bool, device=device)
        for t, _ in read:
            if t.is_complex():
                parts = parts & (torch.isnan(t.real) == torch.isnan(t.imag)).all().to(device)
        holds = torch.stack([k.any().to(device) for k in keeps])
        got = _Sliced([(e.position, e.name, op) for _, e in read], holds, parts,
                      (lo, hi, exact))
        return got if out is None else self.settled(got, [out])

    def settled(self, sliced: _Sliced, outs: Sequence[Any]
                ) -> tuple[int | None, str | None, str] | None:
        """What :meth:`_sliced` read (``sliced``), decided now that the op has made (or
        written) ``outs``: ``None`` where no input held NaN, or where each
        floating-point tensor of ``outs`` is NaN exactly where its slices keep
        (:func:`_slices_agree`); else what it mixes. One host wait."""
        ok = sliced.parts
        try:
            for o in outs:
                if isinstance(o, torch.Tensor) and _inexact(o):
                    ok = ok & _slices_agree(sliced.masks, o).to(ok.device)
        except (RuntimeError, TypeError, IndexError, ValueError):
            ok = torch.zeros((), dtype=torch.bool, device=ok.device)
        *holds, ok = torch.cat([sliced.holds, ok.reshape(1)]).tolist()
        if ok:
            return None
        return next((who for who, h in zip(sliced.mixed, holds) if h), None)

    def sent_whole(self, position: int | None, name: str | None) -> bool:
        """Whether patch ``position`` (named ``name``) of the call in progress is sent
        whole: dense, or sparse with an index for every element (its staged tensor holds
        no NaN)."""
        p = self.patches.get(position) if position is not None else None
        if p is None or p.name != name:
            return False
        return p.indices is None or p.indices.numel() >= math.prod(p.shape)

    def _paired(self, func: Any, found: list[tuple[torch.Tensor, _Source]]
                ) -> tuple[int | None, str | None, str] | None:
        """``(position, name, op)`` where element-wise op ``func`` pairs different
        elements of patches' data, one of them holding NaN (a sparse patch's "keep"):
        ``w - w[0]``, ``w[:, 1:] - w[:, :-1]``, ``w + w.flip(0)``, ``q * k``. Each output
        element then combines two patch elements, so a NaN in either makes it NaN (the
        merge keeps it, and the other element's update is lost) and numbers land at
        other elements' places. ``found``: its floating-point inputs traced to patches'
        data (two or more), each with a stretch it reaches.

        Inputs that map every element of their broadcast shape (their output's, less the
        dims only other inputs add) to the same element of the same patch pair nothing
        (``w * w``, ``w + w.clone()``, ``w[0] + w[0]``), and are decided without a read.
        Otherwise their NaN is read (rare in loaders): none holds any, none mixes. An
        input that holds none of the NaN mixes where it is at a known place in its patch
        (offset and strides), or at any place where its patch was sent whole
        (``w * scale``, ``w * scale.abs()`` of a scale sent whole, ``w[2:] * w[:2]``
        where rows 2-3 are all updated), where it is made from patches' staged elements
        by moves, copies and element-wise ops that keep NaN NaN, so that no NaN was
        replaced (:attr:`_Source.nan_kept`: ``a * b.flip(1)[0]``, ``a * b.abs()[0]``),
        or where it is a
        part of a stretch of a patch's
        data the loader made (a move's result, ``x = w.flip(0)``) that another input,
        holding NaN, lies in too (``x - x[0]``, :func:`_place_in_stretch`): its update
        is lost wherever another keeps.
        Else the NaN masks decide: two inputs that hold NaN at different places
        (broadcast) mix (``w - w[0]``, ``w + w.flip(0)``, two patches that keep
        different elements); NaN at the same places is let through, since the result is
        then right: where all keep, the runtime value made of the kept elements stays,
        and where all update, the new one lands (``a + b`` of two patches that keep the
        same elements, ``w[:, ::2] + w[:, 1::2]`` where even and odd columns keep alike,
        ``w * w.abs()``). So is NaN in one input only where the others' place is not
        known and their patches were not sent whole (a scratch the loader made anew from
        an earlier patch's data, ``buf.copy_(x.nan_to_num())``, then added to)."""
        if any(e.mixed is not None for _, e in found):
            return None  # (mixed already: carried, the op that mixed first named)
        data: list[tuple[torch.Tensor, list[_Source]]] = []  # (each tensor once)
        for t, e in found:
            if t.is_meta or not _inexact(t):
                continue  # (a meta tensor has no values to read)
            got = next((hits for d, hits in data if d is t), None)
            if got is None:
                data.append((t, [e]))
            else:
                got.append(e)  # (a tensor that reaches two stretches: no one place)
        if len(data) < 2:
            return None
        try:
            shape = torch.broadcast_shapes(*(t.shape for t, _ in data))
        except RuntimeError:
            return None  # (inputs that do not broadcast together: not paired so)
        places = [_place_in_patch(t, hits[0], shape) if len(hits) == 1 else None
                  for t, hits in data]
        if places[0] is not None and all(p == places[0] for p in places[1:]):
            return None  # (the same elements of one patch: ``w * w.clone()``)
        nan = [nan_mask(t) for t, _ in data]
        holds = [bool(m.any()) for m in nan]
        if not any(holds):
            return None
        first = holds.index(True)
        who = data[first][1][0]
        op = _op_name(func)
        # (a patch's numbers, lost where another input's NaN are: at a known place, or,
        # where not known, of a patch sent whole, so that no NaN was replaced there, or
        # beside that NaN in one stretch the loader made, ``x - x[0]`` of ``x =
        # w.flip(0)``: no NaN was replaced in a part of what holds NaN in another)
        near = [_place_in_stretch(t, hits[0]) if p is None and len(hits) == 1 else None
                for (t, hits), p in zip(data, places)]
        nan_near = {n for n, h in zip(near, holds) if h and n is not None}
        if any(not h and (p is not None or n in nan_near or _kept_whole(t, hits) or all(
                e.name is not None and self.sent_whole(e.position, e.name) for e in hits))
               for p, n, h, (t, hits) in zip(places, near, holds, data)):
            return who.position, who.name, op
        masks = [m for m, h in zip(nan, holds) if h]
        if len(masks) > 1:
            device = masks[0].device
            ref = masks[0].expand(shape)
            if any(not torch.equal(ref, m.to(device).expand(shape)) for m in masks[1:]):
                return who.position, who.name, op
        return None

    def mixed_in_place(self, func: Any, args: Sequence[Any], kwargs: dict
                       ) -> tuple[int | None, str | None, str] | list | None:
        """:meth:`mixed_by` for an op that writes tensors of the loader's own in place
        (``buf.cumsum_(0)``, ``torch.mm(w, h, out=buf)``), read before it runs: its inputs
        are its arguments less its ``out=`` ones, whose old values it does not read. For
        a ``_foreach_`` op of element-wise ops (``_foreach_add_(bufs, xs)``), a list: what
        each tensor it writes is mixed by, from the inputs at its place (see
        :meth:`written_each`)."""
        kind = _mixes(func) if self._by_key else False
        if not kind:
            # (``buf.mul_(2)``, an element-wise op of one tensor, is common: no search)
            if not _pairs(func):
                return None
            if _foreach_kind(func):
                written = _foreach_written(func, args, kwargs)
                n = len(written)
                inputs = _inputs(func, args, kwargs)
                return [self.mixed_by(func, self._traced_data(_nth(inputs, i, n)), (), {},
                                      t.numel()) if isinstance(t, torch.Tensor) else None
                        for i, t in enumerate(written)]
            if _tensors_in(_inputs(func, args, kwargs)) < 2:
                return None
        elif kind is _PUT and not _combines(func, args, kwargs):
            return None  # (``buf[idx] = w``, a put that moves, is common: no search)
        outs = _out_args(func)
        written = args[0] if args else None
        if outs:
            i, n = outs[0]
            written = args[i] if i < len(args) else kwargs.get(n)
        size = written.numel() if isinstance(written, torch.Tensor) else -1
        return self.mixed_by(func, self._traced_data(_inputs(func, args, kwargs)), args,
                             kwargs, size)

    def taint_each(self, func: Any, args: Sequence[Any], kwargs: dict, outs: list) -> None:
        """:meth:`taint` for the results ``outs`` of a functional ``_foreach_`` op: each
        made from the arguments at its place in the lists (``torch._foreach_add(ws,
        others)``: ``ws[i] + others[i]``, paired as that add is)."""
        n = len(outs)
        keys = list(kwargs)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self.taint(o, _nth(args, i, n), dict(zip(keys, _nth(list(kwargs.values()), i, n))),
                           func)

    def written_each(self, func: Any, args: Sequence[Any], kwargs: dict,
                     mixed: list | None) -> None:
        """:meth:`written_from` (and :meth:`mix`, where ``mixed``, a list from
        :meth:`mixed_in_place`, says so) for each tensor a ``_foreach_`` op wrote in place
        (or into its ``out=`` list), from the arguments at its place in the lists."""
        written = _foreach_written(func, args, kwargs)
        n = len(written)
        keys = list(kwargs)
        for i, t in enumerate(written):
            if isinstance(t, torch.Tensor) and t.numel():
                self.written_from(t, _nth(args, i, n),
                                  dict(zip(keys, _nth(list(kwargs.values()), i, n))))
                if mixed is not None and mixed[i] is not None:
                    self.mix(t, mixed[i])

    def mix(self, t: torch.Tensor, mixed: tuple[int | None, str | None, str]) -> None:
        """``t``, a tensor of the loader's own, was written by an op that mixed its
        inputs' elements (``mixed``, see :meth:`mixed_by`): all it holds is mixed."""
        got = self.stretches(t)
        if got:
            self._moved_into(t, [(t, e) for e in got], mixed)

    def mixed_in(self, t: torch.Tensor) -> tuple[int | None, str | None, str] | None:
        """The first ``mixed`` (see :class:`_Source`) among the stretches ``t`` reaches."""
        for e in self.stretches(t):
            if e.mixed is not None:
                return e.mixed
        return None

    def written_from(self, t: torch.Tensor, args: Sequence[Any], kwargs: dict) -> None:
        """``t``, a tensor that is no runtime tensor, was written in place by an op other
        than a copy (an index put, an ``out=`` op, an ``add_``) whose arguments are
        ``args`` and ``kwargs``: where another of them holds a patch's data, ``t`` holds
        it too from now on, at offsets nobody knows, with what it held itself."""
        key = _storage_key(t)
        found = [(a, e) for a, e in self._traced_data((*args, *kwargs.values()))
                 if _storage_key(a) != key]
        if found:
            self._moved_into(t, [(t, e) for e in self.stretches(t)] + found)

    def _moved_into(self, out: torch.Tensor, found: list[tuple[torch.Tensor, _Source]],
                    mixed: tuple[int | None, str | None, str] | None = None,
                    nan_kept: bool = False, replaced: tuple | None = None) -> None:
        """``out``'s bytes hold, from now on, the data of the stretches in ``found`` (each
        with the tensor that read it), at offsets nobody knows: one patch's, named, or
        several patches', kept for their dtype only (the first says what it is); none:
        ``out`` holds no patch's data. They are mixed (see :class:`_Source`) where
        ``mixed`` says so or a stretch of ``found`` is, and ``out`` is floating-point.
        Any of them misread (:attr:`_Source.misread`) makes all of it misread: a cat of a
        patch's own values and a cast of its bits read as another dtype holds no staged
        NaN in its second part. ``nan_kept``: no NaN of theirs was replaced in ``out``
        (:attr:`_Source.nan_kept`). ``replaced``: what :attr:`_Source.replaced` says of
        ``out``; ``None``: that of the first stretch of ``found`` that says one, where
        ``out`` is floating-point (with no place: ``out`` holds it at offsets nobody
        knows)."""
        okey = _storage_key(out)
        lo, hi = _byte_span(out)
        if not found:
            if okey in self._by_key:
                self._forget(okey, lo, hi)
            return
        t, first = found[0]
        who = (first.position, first.name)
        for _, e in found:
            if e.name is None or (e.position, e.name) != who:
                who = (None, None)
            if mixed is None and e.mixed is not None:
                mixed = e.mixed
        if mixed is not None:
            mixed = _mixed_for(out, mixed)
        misread = next((m for m in (_misread(e, a, out) for a, e in found) if m is not None),
                       None)
        if replaced is None and _inexact(out):
            replaced = next(((*e.replaced[:3], None) for _, e in found
                             if e.replaced is not None), None)
        self._put(okey, _Source(lo, hi, who[0], who[1], None, False, _weak_storage(out),
                                _bits_dtype(first, t, out), misread, mixed,
                                nan_kept=nan_kept and misread is None and mixed is None,
                                replaced=replaced))

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def _forget(self, key: tuple, lo: int, hi: int) -> None:
        """``[lo, hi)`` of storage ``key`` holds no patch's data any more (the bytes of a
        stretch outside it still hold what they held)."""
        got = self._by_key[key]
        first = bisect.bisect_right(got, lo, key=_HI)
        after = bisect.bisect_left(got, hi, key=_LO, lo=first)
        kept = [*got[:first], *_trimmed(got, first, after, lo, hi, ()), *got[after:]]
        if kept:
            self._by_key[key] = kept
        else:
            del self._by_key[key]

    def filled(self, t: torch.Tensor) -> None:
        """``t``, a tensor of the loader's own, was filled with a constant (``fill_``,
        ``zero_``): a contiguous one's bytes hold no patch's data any more (nor data an op
        mixed: see :class:`_Source`). A strided one keeps its stretches (they reach the
        bytes between its elements too), as does a staged tensor filled in place (only
        its exactness goes, :meth:`written`)."""
        key = _storage_key(t)
        got = self._by_key.get(key)
        if got is None or not t.numel() or not t.is_contiguous():
            return
        lo, hi = _byte_span(t)
        if any(e.ref is None and e.lo < hi and lo < e.hi for e in got):
            return
        self._forget(key, lo, hi)

    def written(self, t: torch.Tensor) -> None:
        """``t`` was written in place: its bytes no longer hold what was staged (they
        keep the patch's name, as derived from it)."""
        key = _storage_key(t)
        got = self._by_key.get(key)
        if got is None:
            return
        lo, hi = _byte_span(t)
        self._by_key[key] = [
            e._replace(exact=False, nan_kept=False) if (e.exact or e.nan_kept) and e.lo < hi
            and lo < e.hi else e for e in got
        ]


class _LostMarks:
    """The elements, by storage, that a cast the loader made during a sparse call turned
    from a number into NaN: a value out of range, or an infinity, cast into a floating
    dtype without infinities (float8 ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``). NaN there
    is an update lost, not a patch's "keep", and a sparse copy whose source holds one is
    refused (:meth:`WriteSession._refuse_marked`), wherever the loader's arithmetic
    left the elements' place in their patch unknown.

    A mark is the byte offset of an element in its storage, with the number it held
    (float64), so it follows the element through every view of that storage. It is
    carried to the output of an element-for-element copy (a cast, a clone,
    ``.contiguous()``, a ``copy_`` into a tensor of the loader's own) and of the ops in
    ``_MOVES`` (``cat``, ``stack``, indexing, ``repeat``, ``roll``, ``flip``, ``gather``,
    ``narrow_copy``, ``take``, ``masked_select``), which move elements without changing
    them, of pointwise ops (arithmetic, ``clamp``, ``where``, ``masked_fill``: a NaN
    stays NaN through them, in its place; a floating element such an op makes a number
    of, ``nan_to_num``'s, loses its mark) and of ``torch._foreach_*`` ops, tensor by
    tensor (:meth:`foreach`), of the functional puts of
    ``_FUNCTIONAL_PUTS`` (``index_copy``, ``slice_scatter``, ``index_add``...), and into
    a tensor of the loader's own by the puts of ``_PUTS`` (``buf[rows] = x``,
    ``index_copy_``, ``masked_scatter_``, ``scatter_``, ``put_``, ``index_fill_``, and
    those that add or reduce: ``index_add_``, ``scatter_add_``, an accumulating
    ``index_put_``), by a fill of a 0-d tensor (``buf.fill_(x[k])``) and by in-place
    pointwise ops (``buf.add_(x)``); a ``copy_``, a put that replaces or a fill
    (``fill_``, ``zero_``, ``masked_fill_``) into a marked tensor of the loader's own
    takes the marks of the elements it overwrote away, and an ``out=`` op all of its
    ``out``'s (a pointwise one's then takes its inputs'). Other ops drop them (a number made from a
    NaN by a matmul or a reduction is NaN, but at a place no mark follows). A mark whose
    element no longer holds NaN counts for nothing. A complex element's marks are on its
    parts (each a real element of ``view_as_real``), so they follow it through
    ``view_as_real``, ``view_as_complex``, ``.real`` and ``.imag``; ``torch.complex``
    gives each part the marks of its own input. An element written takes away the marks
    of every byte it covers (a float32 write through a view of a float8 scratch those
    of four float8 elements), and a ``copy_`` reads its source's marks before it takes
    its destination's away (``buf.copy_(buf)`` keeps them; a source that partly
    overlaps its destination torch refuses before it writes).

    Storages are held by weak reference: a freed one's marks are dropped when its
    address is next looked up, since the allocator may hand it to an unrelated tensor."""

    def __init__(self) -> None:
        # storage key -> (weak storage ref, sorted byte offsets of elements, what each
        # mark says: rows of (number, patch position, checkpoint index), float64, -1
        # where not known)
        self._by_key: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.names: dict[int, str] = {}  # patch position -> name, of the marks' patches

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def _get(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        got = self._by_key.get(key)
        if got is None:
            return None
        if got[0].expired():
            del self._by_key[key]
            return None
        return got[1], got[2]

    def of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(marked, what)``: which of ``t``'s elements are marked (shaped like ``t``),
        and what each marked one's mark says (shaped like ``t`` plus a last dim of 3:
        the number it held, its patch's position and its checkpoint index, ``-1`` where
        not known; anything where not marked); ``None`` where no element is marked."""
        if not self._by_key or not t.numel() or t.is_meta:
            return None
        if t.is_complex():  # (marked where either part is: the real part's mark first)
            got = self.of(_parts(t))
            if got is None:
                return None
            m, w = got
            return m.any(-1), torch.where(m[..., :1], w[..., 0, :], w[..., 1, :])
        got = self._get(_storage_key(t))
        if got is None:
            return None
        offs, what = got
        here = _storage_offsets(t, None) * t.element_size()
        at = torch.searchsorted(offs, here).clamp_(max=offs.numel() - 1)
        marked = offs[at] == here
        if not bool(marked.any()):
            return None
        return marked.reshape(t.shape), what[at].reshape(*t.shape, 3)

    def unmark(self, t: torch.Tensor, flat: torch.Tensor | None = None) -> None:
        """``t``'s elements (all, or those at row-major positions ``flat``) were
        overwritten: their marks go."""
        key = _storage_key(t)
        got = self._get(key) if self._by_key else None
        if got is None or not t.numel():
            return
        if t.is_complex():  # (both parts of each element)
            self.unmark(_parts(t), None if flat is None else torch.stack(
                [flat * 2, flat * 2 + 1], -1).reshape(-1))
            return
        offs, what = got
        size = t.element_size()
        starts = _storage_offsets(t, flat) * size
        if size == 1:
            keep = ~torch.isin(offs, starts)
        else:
            # (every byte an element covers: a float32 write over a float8 view's marks
            # takes those of its bytes 1-3 away too)
            starts = torch.sort(starts.reshape(-1)).values
            at = torch.searchsorted(starts, offs, right=True) - 1
            keep = (at < 0) | (offs >= starts[at.clamp(min=0)] + size)
        if bool(keep.all()):
            return
        if bool(keep.any()):
            self._by_key[key] = (self._by_key[key][0], offs[keep], what[keep])
        else:
            del self._by_key[key]

    def mark(self, t: torch.Tensor, marked: torch.Tensor, what: torch.Tensor) -> None:
        """Mark ``t``'s elements where ``marked`` (shaped like ``t``), each with what
        its mark says in ``what`` (shaped like ``t`` plus 3: see :meth:`of`). A complex
        ``t`` is marked by parts, where a marked element's part is NaN."""
        if t.is_complex():
            parts = _parts(t)
            self.mark(parts, marked.unsqueeze(-1) & nan_mask(parts.detach()).to(marked.device),
                      what.unsqueeze(-2).expand(*t.shape, 2, 3))
            return
        flat = torch.nonzero(marked.reshape(-1)).reshape(-1)
        if not flat.numel():
            return
        offs = _storage_offsets(t, flat) * t.element_size()
        what = what.reshape(-1, 3)[flat].to(torch.float64)
        key = _storage_key(t)
        got = self._get(key)
        if got is not None:
            offs = torch.cat([got[0], offs])
            what = torch.cat([got[1], what])
        # (sorted, one mark per element: the last made wins)
        offs, order = torch.sort(offs, stable=True)
        what = what[order]
        last = torch.ones_like(offs, dtype=torch.bool)
        last[:-1] = offs[1:] != offs[:-1]
        self._by_key[key] = (_weak_storage(t), offs[last], what[last])

    def copied(self, src: Any, out: torch.Tensor, provenance: _Provenance, *,
               whole: bool) -> None:
        """``out`` is an element-for-element copy of ``src`` (broadcast to its shape),
        made by a cast, a clone or a ``copy_`` (``whole``: ``out`` is a new tensor, which
        held no marks): ``out`` takes ``src``'s marks, and new ones where this copy's own
        cast made a number NaN, each naming the patch and checkpoint index where
        ``provenance`` traces that element of ``src``."""
        readable = (isinstance(src, torch.Tensor) and out.numel() and not out.is_meta
                    and not src.is_meta)
        carried = None
        if readable:
            src = src.detach().expand(out.shape)
            if src.is_complex():  # (part by part; into a real dtype, the real part)
                src = _parts(src) if out.is_complex() else _parts(src)[..., 0]
                out = _parts(out) if out.is_complex() else out
            # (read before ``out``'s marks go: ``buf.copy_(buf)`` copies the same ones)
            carried = self.of(src)
        if not whole:
            self.unmark(out)
        if not readable:
            return
        lost = None
        if (out.dtype != src.dtype and src.dtype.is_floating_point
                and _casts_lose_numbers(out.dtype)):
            made = _lost_in_cast(src.to(out.device), out)
            if bool(made.any()):
                lost = made
        if carried is None and lost is None:
            return
        if lost is None:
            marked, what = (c.to(out.device) for c in carried)  # type: ignore[union-attr]
            self.mark(out, marked, what)
            return
        what = self._origins(src, provenance).to(out.device)
        if carried is not None:
            marked, held = (c.to(out.device) for c in carried)
            what = torch.where(marked.unsqueeze(-1), held, what)
            lost = lost | marked
        self.mark(out, lost, what)

    def _origins(self, src: torch.Tensor, provenance: _Provenance) -> torch.Tensor:
        """What a mark made at each element of ``src`` says (see :meth:`of`): its number,
        and, where ``provenance`` traces it to a patch, that patch's position and, where
        the element's place in it is known, its checkpoint index."""
        what = torch.full((*src.shape, 3), -1.0, dtype=torch.float64, device=src.device)
        what[..., 0] = src
        found = [e for e in provenance.stretches(src) if e.position is not None]
        if not found:
            return what
        at = _storage_offsets(src, None).reshape(src.shape)
        size = src.element_size()
        for e in found:
            inside = (at * size >= e.lo) & (at * size < e.hi)
            what[..., 1][inside] = e.position
            self.names[e.position] = e.name
            if e.base is not None and e.dtype == src.dtype:
                what[..., 2][inside] = (at[inside] - e.base).to(torch.float64)
        return what

    def put(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> None:
        """``func``, a put of ``_PUTS`` (in place: ``out`` is ``args[0]``, a tensor of the
        loader's own) or of ``_FUNCTIONAL_PUTS`` (``out`` a new tensor, a copy of
        ``args[0]`` written so), wrote elements of its value argument, each unchanged (or a
        fill value), at places its other arguments pick: the marks of the elements it
        overwrote go (a scratch filled with ``buf[rows] = x`` for the next patch keeps no
        mark of the last one's numbers), and the value's marks come with its elements. A
        put that adds or reduces (``index_add_``, ``scatter_add_``, an accumulating
        ``put_``) keeps the marks it adds to (a NaN stays NaN), and brings the value's
        where the result is NaN. (Done again on masks, by the put that replaces: which
        elements were written, and which of those are marked.)"""
        dest = args[0] if args else None
        if (not isinstance(dest, torch.Tensor) or not isinstance(out, torch.Tensor)
                or out.is_meta or not out.numel()):
            return
        value = _arg(func, args, kwargs, _PUT_VALUES[func])
        again = _put_again(func, args, kwargs)
        combines = _put_combines(func, args, kwargs)
        replaces = not combines or (_base_name(func) in ("scatter_reduce", "index_reduce")
                                    and not _arg(func, args, kwargs, "include_self"))
        in_place = out is dest
        # (read before any mark goes: the value may be a view of the destination)
        carried = self.of(value.detach()) if isinstance(value, torch.Tensor) else None
        held = None if in_place else self.of(dest.detach())

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(out.shape, dtype=dtype, device=out.device)

        written = None
        if replaces:
            written = again(zeros(torch.bool), torch.ones(
                value.shape, dtype=torch.bool, device=out.device)
                if isinstance(value, torch.Tensor) else True)
            if in_place:
                self.unmark(out, torch.nonzero(written.reshape(-1)).reshape(-1))
        marked = what = None
        if held is not None:
            marked, what = (h.to(out.device) for h in held)
            if written is not None:
                marked = marked & ~written
        if carried is not None:
            m, w = (c.to(out.device) for c in carried)
            moved = again(zeros(torch.bool), m)
            brought = torch.stack([again(zeros(torch.float64), w[..., c]) for c in range(3)], -1)
            if marked is None:
                marked, what = moved, brought
            else:
                what = torch.where(moved.unsqueeze(-1), brought, what)
                marked = marked | moved
        if marked is None:
            return
        if _inexact(out):
            marked = marked & nan_mask(out.detach())
        self.mark(out, marked, what)

    def filled(self, t: torch.Tensor, value: Any = None, where: torch.Tensor | None = None
               ) -> None:
        """``t``, a tensor of the loader's own, was filled (all of it, or where ``where``
        is true, broadcast) with ``value`` (a number, or a 0-d tensor): the marks of what
        it held there go, and a 0-d ``value``'s mark comes to each element filled with
        its NaN (``buf.fill_(x[k])`` of a lost number)."""
        got = (self.of(value.detach()) if isinstance(value, torch.Tensor) and not value.is_meta
               else None)  # (read first: the value may be an element of ``t``)
        if where is None:
            self.unmark(t)
        else:
            self.unmark(t, torch.nonzero(where.expand(t.shape).reshape(-1)).reshape(-1).to(
                t.device))
        if got is None or t.is_meta or not t.numel():
            return
        m, w = (g.to(t.device) for g in got)
        if not bool((m & nan_mask(value.detach()).to(t.device)).all()):
            return
        marked = (torch.ones(t.shape, dtype=torch.bool, device=t.device) if where is None
                  else where.to(t.device).bool().expand(t.shape))
        self.mark(t, marked, w.expand(*t.shape, 3))

    def foreach(self, func: Any, args: Sequence[Any], kwargs: dict, outs: Sequence[Any] | None,
                provenance: _Provenance) -> None:
        """``func``, a ``torch._foreach_*`` op of :func:`_foreach_kind`, made ``outs``
        (its result, a list) or, where ``None``, wrote the tensors of its first argument
        in place (or of its ``out=`` list, anew): each of them as the op it names would
        from the tensors at its place in the lists among its arguments (a tensor or
        number that is not in a list is used for each), copied, filled or made pointwise
        (see :meth:`copied`, :meth:`filled`, :meth:`pointwise`)."""
        kind = _foreach_kind(func)
        inputs = _inputs(func, args, kwargs)
        anew = False
        if outs is None:
            given = _out_args(func)
            if given:
                i, name = given[0]
                outs, anew = (args[i] if i < len(args) else kwargs.get(name)), True
            else:
                outs, inputs = args[0], inputs[1:]  # (in place: ``_foreach_add_(ts, xs)``)
                if kind == "copy":
                    inputs = inputs[:1]
        elif kind == "copy" and _base_name(func) == "copy":
            inputs = inputs[1:2]  # (``_foreach_copy(ts, srcs)``: srcs, cast into ts' dtypes)
        outs = list(outs or ())
        n = len(outs)

        def nth(a: Any, i: int) -> Any:
            return a[i] if isinstance(a, list | tuple) and len(a) == n else a

        for i, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                continue
            each = [nth(a, i) for a in inputs]
            if kind == "fill":
                self.filled(out)
            elif kind == "copy":
                self.copied(each[0] if each else None, out, provenance,
                            whole=not (anew or out is nth(args[0], i)))
            else:
                self.pointwise(None, each, out, anew=anew)

    def pointwise(self, func: Any, inputs: Sequence[Any], out: torch.Tensor, *,
                  anew: bool = False) -> None:
        """``out`` was made (or, in place, written) by ``func``, a pointwise op of
        ``inputs`` (its arguments but ``out``): each element of it from the elements at
        its place in the tensors among them (broadcast). A NaN stays NaN through
        arithmetic and ``clamp``, so an element made from a marked one takes its mark
        (the first input's, where several are marked there); a ``where`` or a
        ``masked_fill`` takes each element from one side only, and only that side's mark
        (:func:`_pointwise_sides`). A floating ``out``'s elements that are numbers now
        keep no mark (``nan_to_num``: the NaN the next patch's values put there later is
        theirs). ``anew``: ``out`` is an ``out=`` argument, written whole: the marks it
        held go (after its inputs' are read: an input may be ``out`` itself)."""
        if out.is_meta or not out.numel():
            return
        if func in _COMPLEX and len(inputs) >= 2:
            # (``torch.complex(re, im)``: each part from one input, and only its marks)
            if anew:
                self.unmark(out)
            parts = _parts(out)
            self.pointwise(None, inputs[:1], parts[..., 0])
            self.pointwise(None, inputs[1:2], parts[..., 1])
            return
        marked = what = None
        for t, picked in _pointwise_sides(func, inputs):
            if not isinstance(t, torch.Tensor):
                continue
            got = self.of(t.detach())
            if got is None:
                continue
            m, w = (g.to(out.device) for g in got)
            m, w = m.expand(out.shape), w.expand(*out.shape, 3)
            if picked is not None:
                m = m & picked.to(out.device).expand(out.shape)
            if marked is None:
                marked, what = m, w
            else:
                what = torch.where((m & ~marked).unsqueeze(-1), w, what)
                marked = marked | m
        if anew:
            self.unmark(out)
        if _inexact(out):
            held = _storage_key(out) in self._by_key
            if held or marked is not None:
                nan = nan_mask(out.detach())
                if held:
                    self.unmark(out, torch.nonzero(~nan.reshape(-1)).reshape(-1))
                if marked is not None:
                    marked = marked & nan
        if marked is not None:
            self.mark(out, marked, what)

    def moved(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> None:
        """``out`` was made by ``func``, one of ``_MOVES``, from ``args[0]`` (a tensor or
        a list of them): each of its elements is an element of those, unchanged, so the
        same op on their marks says which of ``out``'s are marked."""
        first = args[0]
        inputs = list(first) if isinstance(first, list | tuple) else [first]
        found = [self.of(t) if isinstance(t, torch.Tensor) else None for t in inputs]
        if all(f is None for f in found) or out.is_meta:
            return
        marks = [f[0] if f is not None else torch.zeros(t.shape, dtype=torch.bool,
                                                         device=t.device)
                 for f, t in zip(found, inputs)]
        what = [f[1] if f is not None else torch.zeros((*t.shape, 3), dtype=torch.float64,
                                                        device=t.device)
                for f, t in zip(found, inputs)]

        def again(ins: list[torch.Tensor]) -> torch.Tensor:
            head = ins if isinstance(first, list | tuple) else ins[0]
            return func(head, *args[1:], **kwargs)

        self.mark(out, again(marks),
                  torch.stack([again([w[..., c] for w in what]) for c in range(3)], -1))


def _listed(v: Any) -> tuple | list:
    """``v`` itself where it is a list or tuple, else ``(v,)``."""
    return v if isinstance(v, list | tuple) else (v,)


def _inputs(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict) -> list:
    """The arguments of a call of ``func`` (positional, then keyword values) less its
    ``out=`` ones, whose old values it does not read."""
    outs = _out_args(func)
    if not outs:
        return [*args, *kwargs.values()]
    at = {i for i, _ in outs}
    names = {n for _, n in outs}
    return [*(a for i, a in enumerate(args) if i not in at),
            *(v for k, v in kwargs.items() if k not in names)]


def _pointwise_sides(func: Any, inputs: Sequence[Any]) -> list[tuple[Any, Any]]:
    """``(input, where)`` for each of pointwise op ``func``'s ``inputs``: where (a mask,
    broadcast to the output) its elements go into the output, ``None`` everywhere. A
    ``where``'s condition and a ``masked_fill``'s mask pick elements, and put none of
    their own."""
    if func in _WHERES and len(inputs) >= 3 and isinstance(inputs[0], torch.Tensor):
        cond = inputs[0].bool()
        return [(inputs[1], cond), (inputs[2], ~cond)]
    if func in _MASKED_FILLS and len(inputs) >= 3 and isinstance(inputs[1], torch.Tensor):
        mask = inputs[1].bool()
        return [(inputs[0], ~mask), (inputs[2], mask)]
    return [(t, None) for t in inputs]


_ELEMENT_WISE_OPS: dict = {}


def _element_wise(func: Any) -> bool:
    """Whether ATen op ``func`` computes each element of its result(s) from the elements
    at that place of its tensor arguments (broadcast), and nothing else: an op torch tags
    pointwise, one whose functional form it tags so (an in-place ``heaviside_``, an
    ``out=`` ``add.Scalar_out``: see :func:`_functional_form`), or one of
    ``_ELEMENT_WISE``, which it does not tag (``floor_divide``, ``polar``, ``where``);
    not a view, nor a ``_foreach_`` op (see :func:`_foreach_kind`). The one notion of
    the checks that follow an element by its place: the lost-number marks
    (:meth:`_LostMarks.pointwise`), the mixed-elements refusal (:func:`_mixes`) and the
    pairing check (:func:`_pairs`, less the picks of ``_PICKS``). Once per op."""
    got = _ELEMENT_WISE_OPS.get(func)
    if got is None:
        got = _ELEMENT_WISE_OPS[func] = _element_wise_of(func)
    return got


def _element_wise_of(func: Any) -> bool:
    name = func._schema.name
    if "::_foreach_" in name or _is_view(func):
        return False
    if torch.Tag.pointwise in func.tags:
        return True  # (of a library's own too: its author says so)
    returns = func._schema.returns
    if (not name.startswith("aten::") or not returns
            or any(str(r.type) != "Tensor" for r in returns)):
        return False  # (``where(cond)``: a list of the places of its true elements)
    if _base_name(func) in _ELEMENT_WISE:
        return True
    functional = _functional_form(func)
    return functional is not None and torch.Tag.pointwise in functional.tags


def _functional_form(func: Any) -> Any:
    """The overload that computes what in-place or ``out=`` op ``func`` writes, into a
    new tensor: of the op named without the in-place ``_``, with the arguments of
    ``func`` less its ``out=`` ones, by name (``heaviside_`` -> ``heaviside``,
    ``add.Scalar_out`` -> ``add.Scalar``, ``threshold_backward.grad_input`` ->
    ``threshold_backward``, ``_foreach_add_.List`` -> ``_foreach_add.List``); ``None``
    where there is none, or ``func`` writes nothing."""
    args = func._schema.arguments
    name = func._schema.name.partition("::")[2]
    in_place = name.endswith("_") and not name.endswith("__")
    if not in_place and not any(a.is_out for a in args):
        return None
    packet = getattr(_aten, name[:-1] if in_place else name, None)
    if packet is None:
        return None
    names = [a.name for a in args if not a.is_out]
    for overload in packet.overloads():
        other = getattr(packet, overload)
        if (other is not func and not other._schema.is_mutable
                and [a.name for a in other._schema.arguments] == names):
            return other
    return None


def _casts_lose_numbers(dtype: torch.dtype) -> bool:
    """Whether a cast into ``dtype`` can turn a number into NaN: a floating dtype
    without infinities (float8 ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``, and
    ``e4m3fn``, whose casts torch may saturate instead)."""
    return dtype.is_floating_point and dtype not in _CASTS_KEEP_NUMBERS


# Ops that make a new tensor of elements of their first argument (a tensor, or a list
# of them), each unchanged: a mark of :class:`_LostMarks` goes where its element goes.
_MOVES = frozenset({
    _aten.cat.default, _aten.stack.default, _aten.index_select.default,
    _aten.index.Tensor, _aten.repeat.default, _aten.roll.default, _aten.flip.default,
    _aten.gather.default, _aten.narrow_copy.default, _aten.take.default,
    _aten.masked_select.default,
})

# ``torch.complex(real, imag)``: each part of its output from one input
_COMPLEX = frozenset({_aten.complex.default, _aten.complex.out})

# Pointwise ops that take each element from one of their inputs, as a condition or mask
# picks: see :func:`_pointwise_sides`
# (every overload of each: ``where.ScalarOther``, ``masked_fill.Scalar_out``; not
# ``where(cond)``, which is not element-wise)
_WHERES = frozenset(getattr(_aten.where, o) for o in _aten.where.overloads()
                    if o != "default")
_MASKED_FILLS = frozenset(getattr(_aten.masked_fill, o) for o in _aten.masked_fill.overloads())

# Ops that write all of their first argument anew, from no tensor: a scratch filled so
# keeps no mark of what it held
_FILLS = frozenset({_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default})


def _put_values() -> dict:
    """Puts, by op, with the name of the argument whose elements (or fill value) each
    writes into places of (a copy of) its first argument that its other arguments pick,
    each element unchanged or added to (or reduced with) what is there: see
    :meth:`_LostMarks.put`. Ops this torch lacks are left out."""
    table = {}
    for base, value, overloads in (
        ("index_put", "values", ("default",)), ("_index_put_impl", "values", ("default",)),
        ("index_copy", "source", ("default",)), ("masked_scatter", "source", ("default",)),
        ("scatter", "src", ("src", "reduce")), ("scatter", "value", ("value", "value_reduce")),
        ("scatter_add", "src", ("default",)), ("scatter_reduce", "src", ("two",)),
        ("index_add", "source", ("default",)), ("index_reduce", "source", ("default",)),
        ("put", "source", ("default",)), ("index_fill", "value", ("int_Scalar", "int_Tensor")),
        ("slice_scatter", "src", ("default",)), ("select_scatter", "src", ("default",)),
        ("diagonal_scatter", "src", ("default",)), ("as_strided_scatter", "src", ("default",)),
    ):
        for name in (base, base + "_"):
            packet = getattr(_aten, name, None)
            for overload in overloads:
                f = getattr(packet, overload, None) if packet is not None else None
                if f is not None:
                    table[f] = value
    return table


_PUT_VALUES = _put_values()
# The in-place puts (into a tensor of the loader's own), and the functional ones, which
# make a new tensor
_PUTS = frozenset(f for f in _PUT_VALUES if f._schema.name.endswith("_"))
_FUNCTIONAL_PUTS = frozenset(f for f in _PUT_VALUES if not f._schema.name.endswith("_"))


def _put_again(func: Any, args: Sequence[Any], kwargs: dict) -> Callable:
    """``again(into, values)``: put ``func`` done on ``into`` (a tensor shaped like its
    output) with ``values`` (shaped like its value argument, or a number) by the put that
    replaces what is there, with its other arguments: where each of the values goes
    (see :meth:`_LostMarks.put`)."""
    base = _base_name(func)

    def a(name: str) -> Any:
        return _arg(func, args, kwargs, name)

    if base in ("index_copy", "index_add", "index_reduce"):
        return lambda into, v: _aten.index_copy_.default(into, a("dim"), a("index"), v)
    if base in ("scatter", "scatter_add", "scatter_reduce"):
        return lambda into, v: (
            _aten.scatter_.src(into, a("dim"), a("index"), v) if isinstance(v, torch.Tensor)
            else _aten.scatter_.value(into, a("dim"), a("index"), v))
    if base == "put":
        return lambda into, v: _aten.put_.default(into, a("index"), v)
    if base in ("index_put", "_index_put_impl"):
        return lambda into, v: _aten.index_put_.default(into, a("indices"), v)
    if base == "masked_scatter":
        return lambda into, v: _aten.masked_scatter_.default(into, a("mask"), v)
    if base == "index_fill":
        return lambda into, v: (
            _aten.index_fill_.int_Tensor(into, a("dim"), a("index"), v)
            if isinstance(v, torch.Tensor)
            else _aten.index_fill_.int_Scalar(into, a("dim"), a("index"), v))
    op = getattr(_aten, base).default  # (slice_scatter and its kin: functional already)
    rest = [x.name for x in op._schema.arguments[2:]]
    return lambda into, v: op(into, v, *[a(n) for n in rest])


_FOREACH_KINDS: dict = {}
# A ``_foreach_`` op's overload, as the op it does on each tensor names it
_FOREACH_OVERLOADS = {"List": "Tensor", "ScalarList": "Scalar", "ScalarAndTensor": "Scalar"}


def _foreach_kind(func: Any) -> str | None:
    """What ``torch._foreach_*`` op ``func`` does to each tensor of its lists: ``"copy"``
    (``_foreach_copy_``, ``_foreach_clone``), ``"fill"`` (``_foreach_zero_``),
    ``"pointwise"`` (``_foreach_add``, ``_foreach_mul_``, ``_foreach_lerp``...: the op
    it does on each is tagged pointwise); ``None`` for any other op (``_foreach_norm``,
    a reduction, among them). Once per op."""
    got = _FOREACH_KINDS.get(func, False)
    if got is False:
        got = _FOREACH_KINDS[func] = _foreach_kind_of(func)
    return got


def _foreach_kind_of(func: Any) -> str | None:
    if not func._schema.name.startswith("aten::_foreach_"):
        return None
    base = _base_name(func)
    if base in ("copy", "clone"):
        return "copy"
    if base == "zero":
        return "fill"
    functional = _functional_form(func)  # (``_foreach_max.out``: as ``_foreach_max``)
    if functional is not None:
        return _foreach_kind(functional)
    each = _foreach_each(func)
    return "pointwise" if each is not None and _element_wise(each) else None


def _foreach_each(func: Any) -> Any:
    """The op that functional ``_foreach_`` op ``func`` does on the tensors at each place
    of its lists: its overload named so (``List`` -> ``Tensor``, ``ScalarList`` ->
    ``Scalar``), the default one, or the one whose arguments are named as ``func``'s
    (``_foreach_pow.List`` -> ``pow.Tensor_Tensor``); ``None`` where none is."""
    packet = getattr(_aten, _base_name(func), None)
    if packet is None:
        return None
    over = func._overloadname
    for name in (_FOREACH_OVERLOADS.get(over, over), "default"):
        each = getattr(packet, name, None)
        if each is not None:
            return each
    names = [a.name for a in func._schema.arguments]
    for overload in packet.overloads():
        each = getattr(packet, overload)
        if [a.name for a in each._schema.arguments] == names:
            return each
    return None


def _nth(args: Sequence[Any], i: int, n: int) -> list:
    """``args`` of a ``_foreach_`` op with each list of ``n`` (tensors, numbers) in
    place of its ``i``-th element: the arguments of the op it does at place ``i`` (a
    tensor or number not in a list is used at each)."""
    return [a[i] if isinstance(a, list | tuple) and len(a) == n else a for a in args]


def _foreach_written(func: Any, args: Sequence[Any], kwargs: dict) -> list:
    """The tensors an in-place or ``out=`` ``_foreach_`` op writes: its ``out=`` list,
    or its first."""
    outs = _out_args(func)
    if outs:
        i, name = outs[0]
        return list(_listed(args[i] if i < len(args) else kwargs.get(name)))
    return list(_listed(args[0])) if args else []


def _put_combines(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether put ``func`` adds its values to (or reduces them with) what is there:
    ``index_add``, ``index_reduce``, ``scatter_add``, ``scatter_reduce``, a ``scatter``
    with a ``reduce``, an accumulating ``put`` or ``index_put``."""
    base = _base_name(func)
    if base in ("index_add", "index_reduce", "scatter_add", "scatter_reduce"):
        return True
    if base == "scatter":
        return "reduce" in func._overloadname
    if base in ("put", "index_put", "_index_put_impl"):
        return bool(_arg(func, args, kwargs, "accumulate"))
    return False


def _mixed_from(position: int | None, name: str | None) -> str:
    """Whose data an op mixed, as a message says it (see :attr:`_Source.mixed`)."""
    return f"{where(position, name)}'s data" if name is not None else "the data of several patches"


def _mixed_for(out: torch.Tensor, mixed: tuple[int | None, str | None, str]
               ) -> tuple[int | None, str | None, str] | None:
    """``mixed`` where ``out`` is floating-point (or complex): an integer or boolean result
    (``w.isnan()``, ``argsort(w)``) holds no patch's numbers, and is never mixed."""
    return mixed if _inexact(out) else None


# Ops (ATen base names) that make a new tensor of none of their input's numbers, only of
# its shape and dtype
_ANEW = frozenset({
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
})

# Ops (ATen names, without the in-place ``_`` or the ``_foreach_`` prefix) whose floating
# output a NaN-merge can still take element by element, though they are not element-wise
# (:func:`_element_wise`): copies and casts, ops that move elements whole (each output
# element is one input element, unchanged, or a constant: ``_MOVES``, ``_PUTS``, pads,
# triangles; ``index_put``, ``put`` and ``scatter`` are in ``_COMBINING_PUTS``), ops
# whose output holds none of their input's numbers (``zeros_like``, ``fill_``), and
# ``nan_to_num``, ``isnan`` (the replaced-marks and integer checks see them).
_KEEPS_ELEMENTS = frozenset({
    # copies, casts and the copying forms of views
    "copy", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy",
    "_unsafe_view", "contiguous", "resolve_conj", "resolve_neg", "conj_physical",
    "_conj_physical", "_conj_copy", "_neg_view_copy", "alias_copy", "detach_copy", "view_copy",
    "_reshape_copy", "_reshape_alias_copy", "permute_copy", "t_copy", "transpose_copy",
    "expand_copy", "squeeze_copy", "unsqueeze_copy", "slice_copy", "select_copy",
    "diagonal_copy", "as_strided_copy", "unfold_copy", "split_copy",
    "split_with_sizes_copy", "unbind_copy", "view_as_real_copy", "view_as_complex_copy",
    "narrow_copy", "_pin_memory",
    # element moves and puts
    "cat", "stack", "hstack", "vstack", "index_select", "index", "repeat", "roll", "flip",
    "gather", "take", "take_along_dim", "masked_select", "repeat_interleave", "tile",
    "rot90", "index_copy", "masked_scatter", "index_fill", "slice_scatter",
    "select_scatter", "diagonal_scatter", "as_strided_scatter", "constant_pad_nd",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d",
    "tril", "triu", "diag", "diag_embed", "block_diag", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "native_channel_shuffle", "im2col", "embedding", "lift",
    # no numbers of the input in the output (_ANEW, and:)
    *_ANEW,
    "fill", "zero", "resize", "resize_as", "set", "random", "uniform", "normal",
    "bernoulli", "exponential", "geometric", "cauchy", "log_normal",
    # element-wise and NaN-aware (``nan_to_num``: see :func:`_replaces_nan`), or no
    # numbers (nanmean and nanquantile are made of other ops before a dispatch mode sees
    # them; ``nansum`` and ``nanmedian`` skip the staged NaN of a slice, so that the sum
    # of a row that keeps some elements is written as a number: see :data:`_REDUCES_OVER`)
    "nanmean", "nanquantile", "nan_to_num", "isnan",
})

# Puts (ATen names, as for ``_KEEPS_ELEMENTS``) that may combine what they put with what
# is there (an add, a reduce): where no index repeats, each element of the result is one
# element put, with the destination's own (as an add of two tensors is); where one
# repeats, several elements put are combined into one, which mixes them (see
# :func:`_puts_repeat`). ``put``, ``index_put`` and ``scatter`` combine only with
# ``accumulate=True`` or a ``reduce`` of a tensor (:func:`_combines`); else they move
# elements, unchanged.
_COMBINING_PUTS = frozenset({
    "index_add", "index_reduce", "scatter_add", "scatter_reduce", "scatter", "put",
    "index_put", "_index_put_impl",
})

# What :func:`_mixes` says of an op besides ``True`` (mixes) and ``False`` (keeps each
# element): a put of ``_COMBINING_PUTS``, and a reduction, which mixes only where it
# reduces a dim longer than 1
_PUT = "put"
_REDUCES = "reduces"

_MIXES: dict = {}


def _mixes(func: Any) -> bool | str:
    """Whether op ``func`` may mix its inputs' elements (a matmul, a reduction, a sort, a
    cumsum, a softmax, an op torch does not describe): none of a view, an element-wise op
    (:func:`_element_wise`), a ``_foreach_`` op of :func:`_foreach_kind`, nor one of
    ``_KEEPS_ELEMENTS``; ``_PUT`` for a put of ``_COMBINING_PUTS``, ``_REDUCES``
    for a reduction (:func:`_is_reduction`; see :meth:`_Provenance.mixed_by`). Once per op."""
    got = _MIXES.get(func)
    if got is None:
        got = _MIXES[func] = _mixes_elements(func)
    return got


_ARG_AT: dict = {}


def _arg(func: Any, args: Sequence[Any], kwargs: dict, name: str) -> Any:
    """Argument ``name`` of a call of ``func`` (by its schema), or its default."""
    at = _ARG_AT.get(func)
    if at is None:
        at = _ARG_AT[func] = {a.name: (i, a) for i, a in enumerate(func._schema.arguments)}
    i, a = at[name]
    if i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    return a.default_value if a.has_default_value() else None


_BASE_NAMES: dict = {}


def _base_name(func: Any) -> str:
    """``func``'s ATen name less its namespace, its ``_foreach_`` and in-place ``_``."""
    got = _BASE_NAMES.get(func)
    if got is None:
        op = func._schema.name.partition("::")[2].removeprefix("_foreach_")
        got = _BASE_NAMES[func] = op[:-1] if op.endswith("_") and not op.endswith("__") else op
    return got


def _combines(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether a put of ``_COMBINING_PUTS`` combines what it puts with what is there:
    ``put`` and ``index_put`` with ``accumulate=True``, ``scatter`` with a ``reduce`` of
    a tensor (of a scalar, ``scatter.value_reduce``, it combines no two elements put);
    the others always."""
    base = _base_name(func)
    if base == "scatter":
        return func._overloadname.startswith("reduce")
    if base in ("put", "index_put", "_index_put_impl"):
        return bool(_arg(func, args, kwargs, "accumulate"))
    return True


def _puts_repeat(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether a put of ``_COMBINING_PUTS`` puts two elements at one place of its
    destination: the same put, of ones into zeros, counts them (read only where a
    patch's data with NaN in it is put). An argument it cannot count: ``True``."""
    base = _base_name(func)
    try:
        dest = _arg(func, args, kwargs, "self")
        counts = torch.zeros(dest.shape, dtype=torch.float32, device=dest.device)

        def ones(t: torch.Tensor) -> torch.Tensor:
            return torch.ones(t.shape, dtype=torch.float32, device=dest.device)

        if base in ("index_add", "index_reduce"):
            counts.index_add_(_arg(func, args, kwargs, "dim"),
                              _arg(func, args, kwargs, "index"),
                              ones(_arg(func, args, kwargs, "source")))
        elif base == "put":
            index = _arg(func, args, kwargs, "index")
            counts.put_(index, ones(index), accumulate=True)
        elif base in ("index_put", "_index_put_impl"):
            counts.index_put_(_arg(func, args, kwargs, "indices"),
                              ones(_arg(func, args, kwargs, "values")), accumulate=True)
        else:  # (scatter_add, scatter_reduce, scatter with a reduce: index says where)
            index = _arg(func, args, kwargs, "index")
            counts.scatter_add_(_arg(func, args, kwargs, "dim"), index, ones(index))
        return bool((counts > 1).any())
    except Exception:  # (a put torch would refuse itself, a meta tensor)
        return True


# Element-wise ops whose result takes each element from one input only, as a condition
# or mask picks (``where``, ``masked_fill``), or each part of a complex element from one
# (``torch.complex(re, im)``, a stack of the two): they move elements and pair none
_PICKS = frozenset({"where", "masked_fill", "complex"})

# Element-wise ops (ATen names, as for ``_KEEPS_ELEMENTS``) some or all of whose
# overloads (functional ones too) torch does not tag pointwise: see :func:`_element_wise`
_ELEMENT_WISE = frozenset({
    "polar", "copysign", "frexp", "ldexp", "fmod", "remainder", "floor_divide",
    "true_divide", "rsub", "fmax", "fmin", "nextafter", "hypot", "atan2", "xlogy",
    "complex", "where", "masked_fill", "isclose", "dropout", "native_dropout",
    "alpha_dropout", "feature_dropout", "_masked_scale",
})

_PAIRS: dict = {}


def _pairs(func: Any) -> bool:
    """Whether op ``func`` computes each element of its result from the elements at that
    place of its tensor inputs (broadcast), so that two of them, taken from different
    elements of patches' data, are paired (see :meth:`_Provenance._paired`): an
    element-wise op (:func:`_element_wise`) but a pick (``_PICKS``), or a ``_foreach_`` op
    of such ops (``_foreach_add``, ``_foreach_lerp_``), which pairs the tensors at each
    place of its lists (and a tensor not in a list with each): its callers hand
    :meth:`_Provenance.mixed_by` the inputs of one place at a time. Once per op."""
    got = _PAIRS.get(func)
    if got is None:
        got = _PAIRS[func] = _pairs_elements(func)
    return got


def _pairs_elements(func: Any) -> bool:
    if _foreach_kind(func):
        return _foreach_kind(func) == "pointwise"
    return _element_wise(func) and _base_name(func) not in _PICKS


def _tensors_in(args: Sequence[Any]) -> int:
    """How many of ``args`` are tensors."""
    return sum(isinstance(a, torch.Tensor) for a in args)


def _place_in_patch(t: torch.Tensor, e: _Source, shape: Sequence[int]) -> tuple | None:
    """Which elements of which patch ``t`` (of stretch ``e``) puts at each element of an
    output of ``shape`` it is broadcast to: ``(position, name, checkpoint offset of its
    first element, its strides broadcast to shape)``, in checkpoint elements; ``None``
    where not known (data of several patches, at no known offset, a view of its bytes as
    another element size, or ``t`` not all in the stretch)."""
    if e.name is None or e.base is None or t.element_size() != _unit(e, t):
        return None
    if not _inside(t, e):
        return None
    lead = len(shape) - t.dim()
    if lead < 0:
        return None
    strides = tuple(
        0 if d < lead or shape[d] == 1 or t.shape[d - lead] == 1 else t.stride(d - lead)
        for d in range(len(shape)))
    return e.position, e.name, t.storage_offset() - e.base, strides


def _inside(t: torch.Tensor, e: _Source) -> bool:
    """Whether all of ``t``'s bytes lie in stretch ``e``."""
    lo, hi = _byte_span(t)
    return e.lo <= lo and hi <= e.hi


def _traced_unchanged(found: list[tuple[torch.Tensor, _Source]]) -> bool:
    """Whether each floating-point tensor of ``found`` (an op's inputs traced to
    patches' data, each with a stretch it reaches) lies in one stretch whose elements
    are its patches' staged ones, unchanged (:func:`_unchanged`)."""
    seen: list[torch.Tensor] = []
    for t, e in found:
        if not _inexact(t) or any(t is d for d in seen):
            return False  # (an integer view of the bits; a tensor that reaches two)
        seen.append(t)
        if not _unchanged(e) or not _inside(t, e):
            return False
    return bool(seen)


# Element-wise ops (ATen names, as for ``_KEEPS_ELEMENTS``, not in place) whose result
# is NaN wherever an input is: a number there comes from numbers only (not ``sign``,
# ``nan_to_num``, ``pow``, ``fmax``, ``where``, which may make a number of a NaN)
_NAN_KEEPING = frozenset({
    "abs", "neg", "mul", "div", "add", "sub", "clamp", "clamp_min", "clamp_max", "tanh",
    "sigmoid", "exp", "reciprocal", "sqrt", "rsqrt",
})


def _functional_aten_in(names: frozenset) -> Callable[[Any], bool]:
    """A test, cached per op, of whether an op is an ATen op of one of ``names`` (ATen
    names, as for ``_KEEPS_ELEMENTS``), not in place."""
    cache: dict = {}

    def test(func: Any) -> bool:
        got = cache.get(func)
        if got is None:
            name = func._schema.name
            got = cache[func] = (name.partition("::")[0] == "aten" and not name.endswith("_")
                                 and _base_name(func) in names)
        return got

    return test


# Whether an op is one of :data:`_NAN_KEEPING` (not in place)
_keeps_nan = _functional_aten_in(_NAN_KEEPING)


def _kept_whole(t: torch.Tensor, hits: list[_Source]) -> bool:
    """Whether ``t`` lies in one stretch of :attr:`_Source.nan_kept` data (made at no
    known place from its patches' staged elements, no NaN of them replaced)."""
    return len(hits) == 1 and hits[0].nan_kept and _inside(t, hits[0])


# Ops (ATen names, as for ``_KEEPS_ELEMENTS``) whose result holds elements of their
# tensor inputs only, each unchanged: element moves, copies and casts (no pad, fill,
# pick with a number, put into another tensor: those hold the loader's own too)
_REARRANGES = frozenset({
    "cat", "stack", "hstack", "vstack", "index_select", "index", "repeat", "roll", "flip",
    "gather", "take", "take_along_dim", "masked_select", "repeat_interleave", "tile",
    "rot90", "narrow_copy", "clone", "_to_copy", "contiguous", "_unsafe_view",
    "permute_copy", "t_copy", "transpose_copy", "expand_copy", "slice_copy", "select_copy",
    "view_copy", "_reshape_copy", "alias_copy", "detach_copy", "lift_fresh_copy",
    "unbind_copy", "split_copy", "split_with_sizes_copy", "diagonal_copy", "unfold_copy",
})

# Whether an op is one of :data:`_REARRANGES` (not in place)
_rearranges = _functional_aten_in(_REARRANGES)

# Whether an op makes a new tensor of none of its input's numbers, only of its shape and
# dtype (ATen names, not in place)
_makes_anew = _functional_aten_in(_ANEW)


def _place_in_stretch(t: torch.Tensor, e: _Source) -> tuple | None:
    """Which stretch of a patch's data, at no known place in the patch (``e``, made by an
    op that moved or computed it), ``t`` lies in: ``(storage key, its first byte)``, or
    ``None`` where ``e`` is no one patch's, or has a known place (``base``), or ``t``
    reaches past it. Two inputs of an element-wise op in one such stretch are parts of
    one tensor the loader made (``x`` and ``x[0]``)."""
    if e.name is None or e.base is not None or e.mixed is not None:
        return None
    if not _inside(t, e):
        return None
    return _storage_key(t), e.lo


# Picks and puts (ATen names, as for ``_KEEPS_ELEMENTS``) whose result takes each
# element from one of their inputs, unchanged, at places a condition, mask or index
# says: they make a number of a patch's NaN only where that condition comes from the
# patch's data (``torch.where(w.isnan(), 0.0, w)``, ``w[w.isnan()] = 0.0``); one of the
# loader's own picks as a move does (``torch.where(mask, w, old)``)
_SELECTING = frozenset({
    "where", "masked_fill", "index_put", "_index_put_impl", "masked_scatter", "index_copy",
    "index_fill", "scatter", "put", "index_add", "index_reduce", "scatter_add",
    "scatter_reduce",
})

# Ops (ATen base names) whose boolean result says where a patch's "keep" marks are and
# makes no number of them (:meth:`_Provenance._counted_marks`): a ``where`` by it is a
# merge on purpose, or a replacement :func:`_replaces_nan` follows
_EXACT_MARKS = frozenset({"isnan", "isfinite"})

# What :func:`_replaces_nan` says of a pick or put of ``_SELECTING``
_SELECTS = "selects"

_REPLACES: dict = {}


def _replaces_nan(func: Any) -> bool | str:
    """Whether op ``func`` may make a number of a NaN of its floating-point input, so that
    a sparse patch's "keep" mark reaches the copy as a number the NaN-merge writes: an
    element-wise op (:func:`_element_wise`, in place too) that is not one of
    :data:`_NAN_KEEPING` nor a copy or cast (``nan_to_num``, ``fmax``, ``pow``,
    ``heaviside``, ``dropout``); ``_SELECTS`` for a pick or put of :data:`_SELECTING`
    (which does only where the condition, mask or index it picks by comes from patches'
    data). Not a view, a move or a ``copy_``, a fill, an op that mixes elements (which
    holds the NaN, or is refused for mixing them; what it makes of such data carries the
    mark, :meth:`_Provenance._replaced_by`), nor a NaN-aware reduction (a statistic,
    ``nansum``, which places no number at a kept element). Once per op."""
    got = _REPLACES.get(func)
    if got is None:
        got = _REPLACES[func] = _replaces_nan_of(func)
    return got


def _replaces_nan_of(func: Any) -> bool | str:
    # (views, _foreach_ ops and copy_ are none of these: _element_wise leaves out the
    # first two and every op of _REARRANGES, copy_ is one of _KEEPS_ELEMENTS, and no name
    # below is one of theirs)
    if not func._schema.name.startswith("aten::"):
        return False
    base = _base_name(func)
    if base in _SELECTING:
        return _SELECTS
    if base == "nan_to_num":
        return True  # (element-wise, though one of _KEEPS_ELEMENTS for the mixing check)
    return (_element_wise(func) and base not in _NAN_KEEPING and base not in _PICKS
            and base not in _KEEPS_ELEMENTS)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The index, in a tensor of ``shape``, of its row-major element ``flat``."""
    at = []
    for n in reversed(shape):
        at.append(flat % n)
        flat //= n
    return tuple(reversed(at))


def _keep_at(keep: torch.Tensor, out: torch.Tensor) -> tuple | None:
    """The ``at`` of :attr:`_Source.replaced` for ``out``, whose elements that hold a
    patch's "keep" are those of mask ``keep`` (broadcast to ``out``'s shape); ``None``
    where ``out``'s elements overlap. A complex ``out``'s mask is of its parts (each part
    of an element keeping as the element does), which its real views read."""
    if out.is_complex():
        return _keep_at(keep.to(out.device).expand(out.shape).unsqueeze(-1).expand(
            *out.shape, 2), _parts(out))
    span = 1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride()))
    flat = torch.zeros(span, dtype=torch.bool, device=out.device)
    try:
        flat.as_strided(out.shape, out.stride()).copy_(keep.to(out.device).expand(out.shape))
    except RuntimeError:
        return None
    return flat, out.storage_offset(), out.element_size()


def _keep_in(e: _Source, t: torch.Tensor) -> torch.Tensor | None:
    """Which elements of ``t``, a view of stretch ``e``'s bytes, hold a patch's "keep"
    (:attr:`_Source.replaced`), shaped like ``t``; ``None`` where not known (nor where
    ``t`` reads them as another element size or reaches past them)."""
    at = e.replaced[3] if e.replaced is not None else None
    if at is not None and t.is_complex() and t.element_size() == 2 * at[2]:
        got = _keep_in(e, _parts(t))  # (an element keeps where its parts do)
        return None if got is None else got.all(-1)
    if at is None or t.element_size() != at[2] or not _inside(t, e):
        return None
    off = t.storage_offset() - at[1]
    if off < 0:
        return None
    try:
        return at[0].as_strided(t.shape, t.stride(), off)
    except RuntimeError:
        return None  # (past the mask's end)


def _carried_replaced(e: _Source, src: torch.Tensor, out: torch.Tensor) -> tuple | None:
    """:attr:`_Source.replaced` of what ``out``, an element-for-element copy of ``src``
    (of stretch ``e``), holds: ``e``'s, with ``out``'s mask of the elements that keep."""
    r = e.replaced
    if r is None:
        return None
    if not _inexact(out):
        return (*r[:3], None)  # (its bytes as integers: which keep is not followed)
    keep = _keep_in(e, src)
    if keep is not None and keep.shape != out.shape:
        keep = keep.reshape(out.shape) if keep.numel() == out.numel() else None
    return (*r[:3], None if keep is None or out.is_meta else _keep_at(keep, out))


def _mixes_elements(func: Any) -> bool | str:
    if _is_view(func) or _element_wise(func) or _foreach_kind(func):
        return False
    if func._schema.name.partition("::")[0] != "aten":
        return True  # (an op of a library's own: what it does is not known)
    base = _base_name(func)
    if base in _COMBINING_PUTS:
        return False if base == "scatter" and not func._overloadname.startswith(
            "reduce") else _PUT
    if base in _KEEPS_ELEMENTS:
        return False
    if _is_reduction(func, base):
        return _REDUCES
    return True


# The ATen reductions by base name (:func:`_base_name`): those of which torch 2.13 and
# 2.14 tag an overload ``torch.Tag.reduction``, for a torch without that tag (2.4)
_REDUCTIONS = frozenset({
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero",
    "linalg_vector_norm", "logsumexp", "max", "mean", "min", "nansum", "norm", "prod",
    "std", "std_mean", "sum", "var", "var_mean",
})


def _is_reduction(func: Any, base: str) -> bool:
    """Whether torch tags op ``func`` (base name ``base``) a reduction; on a torch that has
    no such tag, whether it is one of ``_REDUCTIONS`` (an ``out=`` overload too, which
    torch leaves untagged: a reduction over dims of one element mixes none either way)."""
    tag = getattr(torch.Tag, "reduction", None)
    return tag in func.tags if tag is not None else base in _REDUCTIONS


# Ops (ATen base names, see :func:`_base_name`) that mix elements only within slices of
# their one input, each output element computed from one slice, and which a sparse
# call lets through where each slice is all "keep" (NaN) or all "update" (none), and the
# result is NaN exactly where its slices keep (see :meth:`_Provenance._sliced`): the
# reductions over the dims of their ``dim`` (all where none is given: ``w.amax()``,
# ``_foreach_norm``), keeping them as size 1 where ``keepdim`` says so ...
_REDUCES_OVER = frozenset({
    "sum", "mean", "amax", "amin", "prod", "max", "min", "norm", "linalg_vector_norm",
    "var", "std", "var_mean", "std_mean", "logsumexp", "median", "nanmedian", "mode",
    "kthvalue", "aminmax", "nansum",
})
# ... the ops along one ``dim`` whose result keeps that dim (a scan, which reads a
# prefix: its slice is the whole row; a softmax; a sort's values; a ``topk``'s) ...
_ALONG = frozenset({
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "_softmax", "_log_softmax",
    "softmax", "log_softmax", "sort", "topk",
})
# ... and the products, by the argument holding the patch's data: the dims of it each
# output element is summed over (``None``: all), whether they stay as size 1 in the
# result (else dropped), and how many leading dims of that are then dropped (a batch
# ``addbmm`` sums over); an ``add``'s own term (``self``) is read element by element
_CONTRACTS: dict[tuple[str, str], tuple[tuple[int, ...] | None, bool, int]] = {
    ("mm", "self"): ((1,), True, 0), ("mm", "mat2"): ((0,), True, 0),
    ("addmm", "mat1"): ((1,), True, 0), ("addmm", "mat2"): ((0,), True, 0),
    ("bmm", "self"): ((2,), True, 0), ("bmm", "mat2"): ((1,), True, 0),
    ("baddbmm", "batch1"): ((2,), True, 0), ("baddbmm", "batch2"): ((1,), True, 0),
    ("addbmm", "batch1"): ((0, 2), True, 1), ("addbmm", "batch2"): ((0, 1), True, 1),
    ("mv", "self"): ((1,), False, 0), ("mv", "vec"): (None, False, 0),
    ("addmv", "mat"): ((1,), False, 0), ("addmv", "vec"): (None, False, 0),
    ("dot", "self"): (None, False, 0), ("dot", "tensor"): (None, False, 0),
    ("vdot", "self"): (None, False, 0), ("vdot", "other"): (None, False, 0),
    ("addmm", "self"): ((), True, 0), ("addmv", "self"): ((), True, 0),
    ("baddbmm", "self"): ((), True, 0), ("addbmm", "self"): ((), True, 0),
}
_CONTRACTING = frozenset(op for op, _ in _CONTRACTS)


_SLICES: dict = {}


def _slices_of(func: Any) -> bool:
    """Whether op ``func`` mixes elements within slices of one input only (see
    :data:`_REDUCES_OVER`, :data:`_ALONG`, :data:`_CONTRACTS`). Once per op: a sparse
    call asks it of most ops whose result is floating-point."""
    got = _SLICES.get(func)
    if got is None:
        base = _base_name(func)
        # (an op of a library's own is none of these, whatever its name)
        got = _SLICES[func] = func._schema.name.startswith("aten::") and (
            base in _REDUCES_OVER or base in _ALONG or base in _CONTRACTING)
    return got


def _arg_or(func: Any, args: Sequence[Any], kwargs: dict, name: str, default: Any) -> Any:
    """:func:`_arg`, or ``default`` where ``func`` has no argument ``name``."""
    try:
        got = _arg(func, args, kwargs, name)
    except KeyError:
        return default
    return default if got is None else got


def _slice_masks(func: Any, args: Sequence[Any], kwargs: dict, t: torch.Tensor,
                 keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """For op ``func`` of ``_slices_of`` reading ``t`` (among ``args`` and ``kwargs``),
    whose "keep" marks are ``keep``: ``(all, any, exact)``, for each element of its
    result (broadcast to it, or of its shape exactly where ``exact``), whether all, and
    whether any, of the elements of ``t`` it is computed from keep. On ``t``'s device,
    no host wait. ``None``: an argument it cannot read so (then the op mixes)."""
    base = _base_name(func)
    k = keep.to(torch.uint8)  # (amin and amax over several dims: no bool kernels)
    if base in _REDUCES_OVER:
        if t is not _arg_or(func, args, kwargs, "self", None):
            return None
        dims = _arg_or(func, args, kwargs, "dim", None)
        dims = (() if dims is None else (dims,) if isinstance(dims, int) else tuple(dims))
        keepdim = bool(_arg_or(func, args, kwargs, "keepdim", False))
        if not dims:  # (no dim: the whole tensor is one slice)
            dims = tuple(range(t.dim()))
        if t.dim() == 0:
            return keep, keep, True
        return k.amin(dims, keepdim=keepdim).bool(), k.amax(dims, keepdim=keepdim).bool(), True
    if base in _ALONG:
        if t is not _arg_or(func, args, kwargs, "self", None):
            return None
        dim = _arg_or(func, args, kwargs, "dim", -1)
        if t.dim() == 0:
            return keep, keep, False
        return k.amin(dim, keepdim=True).bool(), k.amax(dim, keepdim=True).bool(), False
    at = next((a.name for i, a in enumerate(func._schema.arguments)
               if (args[i] if i < len(args) else kwargs.get(a.name)) is t), None)
    rule = _CONTRACTS.get((base, at))
    if rule is None:
        return None
    dims, keepdim, drop = rule
    if dims == ():  # (an add's own term: element by element)
        return keep, keep, False
    dims = tuple(range(t.dim())) if dims is None else dims
    lo, hi = k.amin(dims, keepdim=keepdim), k.amax(dims, keepdim=keepdim)
    for _ in range(drop):
        lo, hi = lo.squeeze(0), hi.squeeze(0)
    return lo.bool(), hi.bool(), False


def _slices_agree(masks: tuple[torch.Tensor, torch.Tensor, bool], out: torch.Tensor
                  ) -> torch.Tensor:
    """A 0-dim bool tensor on ``out``'s device (no host wait): whether ``out``, the
    result of an op whose :func:`_slice_masks` are ``masks``, is NaN exactly where its
    slices all keep, and no slice both keeps and updates. Raises where the masks do not
    fit ``out``'s shape (the caller then takes the op as mixing)."""
    lo, hi, exact = masks
    if exact and lo.shape != out.shape:
        raise ValueError("not the result's shape")
    nan = nan_mask(out)
    lo, hi = lo.to(nan.device).expand(nan.shape), hi.to(nan.device).expand(nan.shape)
    return ((nan == lo) & (nan == hi)).all()


class _Sliced(NamedTuple):
    """What :meth:`_Provenance._sliced` read of the inputs that hold patches' data of an
    op of :func:`_slices_of` (before it ran, where it writes in place or ``out=``), for
    :meth:`_Provenance.settled` to decide once the op has made or written its result:
    what it mixes where each input holds NaN (``mixed``, one an input), whether each does
    (``holds``, a bool tensor of one element each), whether complex ones' parts keep
    alike (``parts``, 0-dim) and their :func:`_slice_masks` combined (all: ``&``; any:
    ``|``)."""

    mixed: list[tuple[int | None, str | None, str]]
    holds: torch.Tensor
    parts: torch.Tensor
    masks: tuple[torch.Tensor, torch.Tensor, bool]


def _may_be_masked(patch: Any | None, maybe_sparse: bool) -> bool:
    """Whether an observed call's staged tensor of ``patch`` may hold NaN meaning "keep":
    a sparse patch's, or one the observer matched to no patch (``None``) where the load
    has sparse patches (``maybe_sparse``)."""
    return maybe_sparse if patch is None else patch.indices is not None


def _bits_dtype(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> torch.dtype | None:
    """The dtype whose elements ``out``'s bytes are, ``out`` made from ``src`` (whose
    bytes are stretch ``hit``'s): ``hit``'s where the op kept ``src``'s dtype (it moved
    the bits: a clone of ``w.view(torch.int32)`` still holds float32 elements), else
    ``out``'s own (a cast: NaN stays NaN)."""
    return hit.dtype if out.dtype == src.dtype else out.dtype


def _misread(hit: _Source, src: torch.Tensor, out: torch.Tensor
             ) -> tuple[torch.dtype, torch.dtype] | None:
    """:attr:`_Source.misread` of ``out`` made from ``src`` (whose bytes are stretch
    ``hit``'s): ``hit``'s, or, for a cast of a ``src`` that reads ``hit``'s bytes as
    another dtype (``w.view(torch.bfloat16).to(torch.float8_e4m3fnuz)`` of a float32
    ``w``), ``(hit's dtype, src's)``. An op that moves the bits (``out`` of ``src``'s
    dtype) needs no mark: its stretch keeps ``hit``'s dtype, which a read as another one
    is refused by. A ``src`` of ``hit``'s own dtype whose elements straddle two of the
    patch's (:func:`_misaligned`) reads garbage, whatever the op makes of it: marked
    ``(hit's dtype, src's)`` as well, two dtypes of one size."""
    if hit.misread is not None or hit.dtype is None:
        return hit.misread
    if src.dtype.to_real() == hit.dtype.to_real():
        return (hit.dtype, src.dtype) if _misaligned(hit, src) else None
    return None if out.dtype == src.dtype else (hit.dtype, src.dtype)


def _reinterpreted_words(kind: str, held: torch.dtype, read: torch.dtype,
                         dtype: torch.dtype) -> str:
    """What a source of :meth:`WriteSession._reinterpretation`'s ``kind`` does with a
    patch's bytes (held as ``held``, read as ``read``; the source is of ``dtype``), and
    why its staged NaN is lost, for a message."""
    if kind == "shifted":
        return (f"made from patch data held as {held} moved by a number of bytes that is "
                f"no multiple of its {held.itemsize}-byte elements (such as "
                "`w.view(torch.uint8)[1:13].clone().view(torch.float32)`): each "
                f"{read} element it reads holds the end of one of the patch's elements and "
                "the start of the next, so the NaN that marks 'keep' in a sparse patch "
                "reads as numbers")
    if kind == "cast":
        return (f"cast from a view that reads patch data held as {held} as another dtype "
                f"(such as `w.view({read}).to({dtype})`): the NaN that marks 'keep' in a "
                f"sparse patch is a {held} bit pattern, which {read} does not read as NaN, "
                "and a cast of what it reads keeps none of it")
    return (f"that reads patch data held as {held} as another dtype (a view such as "
            f"`w.view({read})`): the NaN that marks 'keep' in a sparse patch is a {held} "
            f"bit pattern, which {read} does not read as NaN")


# How the staged NaN bits reach the model, and what to do instead, by kind
_REINTERPRETED_HOW = {"shifted": ", shifted,", "cast": ", cast,", "view": ""}
_REINTERPRETED_FIX = {
    "shifted": "Move a patch's values by whole elements.",
    "cast": "Cast the patch's values from their own dtype (`w.to({dtype})` keeps NaN).",
    "view": "Copy the patch's values as their own dtype (a cast, `.to()`, keeps NaN).",
}


def _misaligned(hit: _Source, t: torch.Tensor) -> bool:
    """Whether ``t``'s elements begin where stretch ``hit``'s elements do not (see
    :attr:`_Source.shift`): each then holds the end of one of the patch's elements and
    the start of the next (the staged NaN "keep", shifted, reads as a number)."""
    return bool(hit.shift) and (
        t.storage_offset() * t.element_size() - hit.shift) % _unit(hit, t) != 0


def _carried_shift(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> int:
    """:attr:`_Source.shift` of the stretch that contiguous ``out`` gets, made element
    for element from contiguous ``src`` (whose bytes are stretch ``hit``'s): where an op
    moved the bits (``out`` of ``src``'s dtype), the patch's elements move with them, by
    as many bytes as ``out`` lies from ``src`` (``w.view(torch.uint8)[1:13].clone()``:
    by one byte, so they begin 3 bytes into a float32 of the clone). A cast makes new
    elements (:func:`_misread` marks one of misaligned bytes); 0 where not known."""
    if out.dtype != src.dtype or hit.dtype is None or (hit.base is None and not hit.shift):
        return 0
    unit = hit.dtype.itemsize
    at = (out.storage_offset() - src.storage_offset()) * src.element_size() + (
        hit.shift if hit.base is None else hit.base * unit)
    return at % unit


def _in_layout(hit: _Source, t: torch.Tensor
               ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """Where view ``t`` of stretch ``hit``, the copy of a strided view of a patch's
    elements (:attr:`_Source.layout`), reads in the checkpoint: ``(offset of its first
    element, shape, strides)`` in checkpoint elements, or ``None`` where no such box
    tells it (``t`` reads the bytes as another element size, or a dimension of ``t``
    steps past the end of the copy's dimension it steps along, wrapping into the next:
    ``w[:, 2:5].float().reshape(-1)``)."""
    size = t.element_size()
    if hit.layout is None or hit.dtype is None or hit.dtype.itemsize != size:
        return None
    first, shape, cstride, ostride, start = hit.layout
    # the copy's dimensions, outermost first (each stride the product of the sizes of
    # those inside it: the copy fills its storage)
    order = sorted((d for d in range(len(shape)) if shape[d] > 1),
                   key=lambda d: -ostride[d])
    k = t.storage_offset() - start
    if k < 0:
        return None
    at = [0] * len(shape)
    for d in order:
        at[d], k = divmod(k, ostride[d])
    if k or any(i >= n for i, n in zip(at, shape)):
        return None
    offset = first + sum(i * c for i, c in zip(at, cstride))
    out, used = [], set()
    for n, st in zip(t.shape, t.stride()):
        d = next((d for d in order if st > 0 and st % ostride[d] == 0), None)
        if n == 1:
            out.append(0 if d is None else st // ostride[d] * cstride[d])
            continue
        if d is None or d in used or at[d] + (n - 1) * (st // ostride[d]) >= shape[d]:
            return None
        used.add(d)
        out.append(st // ostride[d] * cstride[d])
    return offset, tuple(t.shape), tuple(out)


def _packed(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its extent, one element at each place, in some order of its
    dimensions (contiguous, or a transposed or permuted contiguous tensor)."""
    acc = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st != acc:
            return False
        acc *= n
    return True


def _unit(hit: _Source, t: torch.Tensor) -> int:
    """The size in bytes of stretch ``hit``'s checkpoint elements (``t``'s own element
    size where its dtype is not known)."""
    return t.element_size() if hit.dtype is None else hit.dtype.itemsize


def _carried_base(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> int | None:
    """``base`` (see :class:`_Source`) of the stretch that contiguous ``out`` gets, made
    element for element from contiguous ``src`` (whose bytes are stretch ``hit``'s):
    where an op moved the bits (``out`` of ``src``'s dtype, which keeps ``hit``'s), the
    checkpoint elements keep their bytes; a cast makes one element of each of ``src``'s,
    which are checkpoint elements only where ``src`` reads them in their own size.
    ``None``: not known, or no whole checkpoint element in its place."""
    if hit.base is None:
        return None
    unit, size = _unit(hit, src), src.element_size()
    if out.dtype == src.dtype:
        at = (out.storage_offset() - src.storage_offset()) * size + hit.base * unit
        return at // unit if at % unit == 0 else None
    return out.storage_offset() - src.storage_offset() + hit.base if size == unit else None


_IS_VIEW: dict = {}


def _is_view(func: Any) -> bool:
    """Whether an op returns a view of its input (cached per op)."""
    got = _IS_VIEW.get(func)
    if got is None:
        got = _IS_VIEW[func] = bool(getattr(func, "is_view", False))
    return got


def _box_in_units(t: torch.Tensor, size: int
                  ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """The elements of ``size`` bytes that view ``t`` (of another element size) touches,
    as a box of them: ``(storage offset, shape, strides)`` in elements of ``size``. Where
    ``t``'s rows are whole such elements (rows or columns of ``x.view(torch.uint8)`` for a
    float32 ``x``, float16 halves of float32 rows, int32 words of an 8-bit tensor), that
    is ``t.view(dtype)`` for a dtype of ``size``; where they cover part of an element (one
    byte of a float32, the low float16 half of each), the element they touch, once.
    ``None`` where those elements make no box: a stride of ``t`` that is no whole number
    of them, or boxes of neighbouring rows that would share an element."""
    a = t.element_size()
    b0 = t.storage_offset() * a
    shape, stride = list(t.shape), list(t.stride())
    # the bytes each innermost step covers: a row of t, where its last dimension is
    # contiguous (or of one element), else one element of t
    row = bool(shape) and (shape[-1] == 1 or stride[-1] == 1)
    run = shape.pop() * a if row else a
    if row:
        stride.pop()
    out = []
    for n, s in zip(shape, stride):
        if n > 1 and (s * a) % size:
            return None
        out.append(s * a // size)
    first, skip = divmod(b0, size)
    k = -(-(skip + run) // size)  # the elements a row's bytes touch
    if row or k > 1:
        shape.append(k)
        out.append(1)
    reach = 0  # the last element the smaller strides reach: each stride must pass it
    for s, n in sorted((s, n) for s, n in zip(out, shape) if n > 1):
        if s <= reach:
            return None
        reach += s * (n - 1)
    return first, tuple(shape), tuple(out)


def _in_elements_of(t: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether every byte of view ``t`` (of another element size) lies in ``owner``'s
    elements, decided on the box of :func:`_box_in_units` alone: each of its dimensions
    one of ``owner``'s, of the same stride, and within its bounds (``t.view(torch.int32)``
    of a bfloat16 column slice of a fused matrix). ``False`` where that is not shown."""
    size = owner.element_size()
    box = _box_in_units(t, size)
    if box is None:
        return False
    first, shape, stride = box
    at = _position_of(owner, first * size)
    if at is None:
        return False
    index = []
    for n in reversed(owner.shape):
        at, k = divmod(at, n)
        index.append(k)
    index.reverse()
    dims = {s: d for d, (n, s) in enumerate(zip(owner.shape, owner.stride())) if n > 1}
    for n, s in zip(shape, stride):
        if n > 1 and (s not in dims or index[dims[s]] + n > owner.shape[dims[s]]):
            return False
    return True


def _owner_units(t: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of runtime tensor ``owner`` that view ``t`` (of another element size)
    writes, as a view of ``owner`` (of its dtype) and its row-major offset in ``owner``:
    the box of :func:`_box_in_units` (each element ``t`` touches, once), or, where they
    make no box inside ``owner``, the span :func:`_owner_span` gives."""
    size = owner.element_size()
    box = _box_in_units(t, size)
    if box is not None:
        first, shape, stride = box
        at = _position_of(owner, first * size)
        if at is not None:
            u = owner.detach().as_strided(shape, stride, first)
            lo, hi = _byte_span(owner)
            u0, u1 = _byte_span(u)
            # (a column slice's extent holds its neighbours' columns too)
            if lo <= u0 and u1 <= hi and (owner.is_contiguous() or bool(
                    _holds(owner, _storage_offsets(u, None)).all())):
                return u, at
    return _owner_span(t, owner)


def _owner_span(t: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of runtime tensor ``owner`` that view ``t``'s bytes reach, as a view
    of ``owner`` (of its dtype) and its row-major offset in ``owner``: a flat slice of a
    contiguous ``owner``, else all of it."""
    if not owner.is_contiguous():
        return owner.detach(), 0
    s = owner.element_size()
    a0, a1 = _byte_span(t)
    o0 = owner.storage_offset() * s
    e0 = max(0, (a0 - o0) // s)
    e1 = min(owner.numel(), -(-(a1 - o0) // s))
    return owner.detach().reshape(-1)[e0:e1], e0


def _lost_in_cast(src: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """Where ``cast`` (``src`` cast to another dtype, on its device) is NaN and ``src``
    is not: a number the cast made NaN."""
    return nan_mask(cast) & ~nan_mask(src)


def _parts(t: torch.Tensor) -> torch.Tensor:
    """A complex ``t``'s real and imaginary parts, as a real view (a last dim of 2) of its
    storage: a lost number's mark is on the part that holds it."""
    return torch.view_as_real(t.conj() if t.is_conj() else t)


def _weak_storage(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage (``expired()`` once it is freed)."""
    return StorageWeakRef(t.untyped_storage())


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


_OUT_ARGS: dict = {}


def _out_args(func: torch._ops.OpOverload) -> tuple:
    """``(index, name)`` of each ``out=`` argument of ``func``, which it writes whole."""
    got = _OUT_ARGS.get(func)
    if got is None:
        got = _OUT_ARGS[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.is_out)
    return got


_OP_NAMES: dict = {}


def _op_name(func: torch._ops.OpOverload) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = func._schema.name + (
            "" if func._overloadname == "default" else "." + func._overloadname
        )
    return name


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
# Floating dtypes with infinities: a cast into them turns no number into NaN (a sparse
# copy into any other floating dtype is checked for numbers lost that way).
_CASTS_KEEP_NUMBERS = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2})
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
