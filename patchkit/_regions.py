"""Where a view's elements sit in its storage, and which regions of storage meet.

:class:`Region` is a view's place in its storage (byte offset, shape, element strides,
itemsize), keyed by :func:`_storage_key`: the storage's device and start address (the
storage object's own address for one with no memory). :class:`_RegionIndex` holds many
regions and finds the ones a given region may meet without comparing it with each. The
functions measure views (:func:`_byte_span`, :func:`_span_of`, :func:`_storage_offsets`,
:func:`_position_of`) and cut a copy at the bounds of the runtime tensors its bytes meet
(:class:`_Owner`, :func:`_cut_at_owners`).

Nothing here knows of a load or a session: each is a function of tensors' storage,
offsets, shapes and strides. :class:`Region` is public API, importable from
:mod:`patchkit.intercept` as before.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch

from . import native


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
    """What :meth:`~patchkit.intercept.WriteSession._put_back` undid after a sparse
    call: a change of the module tree's structure
    (:meth:`~patchkit._runtime_index.RuntimeIndex.structure_changed`, or ``None``), the
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


_START = operator.itemgetter(0)
