"""Where a patch writes, without materialising the tensor (torch only)."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterator, Sequence

import torch

from .errors import PatchTypeError, PatchValueError, brief, where
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _check_structure,
    _shape_dims,
    _shape_text,
    numel,
)

__all__ = ["density_map", "grid_shape", "region_text"]


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view patchkit draws a tensor as: rows × last dimension.

    ``()`` and ``(n,)`` are one row; higher ranks fold their leading dimensions into rows.
    ``shape``: an ordered sequence of ints (numpy ints too), none negative
    (``TypeError`` / ``ValueError`` otherwise, naming it).
    """
    shape = _dims(shape, "grid_shape")
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return (rows, shape[-1])


def _dims(shape: object, who: str, label: str | None = None) -> tuple[int, ...]:
    """``shape``'s dims as ints: ``TypeError`` for what is no ordered sequence of ints
    (a float, ``4.0`` too, as a patch's shape refuses it; a str, a set, an iterator),
    ``ValueError`` for a negative one; the message names ``who`` and the argument
    (``label``, when given, names both: ``"shape of 'w'"``)."""
    label = label or f"{who}: shape"
    try:
        if isinstance(shape, Iterator):
            raise TypeError  # (used up by one reading)
        dims = _shape_dims(shape)
    except TypeError:
        raise TypeError(f"{label} must be a sequence of ints, got {brief(shape)}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{label} has a negative dimension: {brief(shape)}")
    return dims


def density_map(
    patch: PatchLike, bins: int | tuple[int, int] = (64, 64)
) -> torch.Tensor:
    """Fraction of the elements of each block of the patch's 2-D view that it writes
    (float32, CPU).

    The tensor is viewed as ``grid_shape(patch.shape)`` (``R`` rows × ``C`` columns) and
    cut into at most ``bins`` blocks (fewer when the tensor has fewer rows or columns:
    ``br = min(bins[0], R)`` and ``bc = min(bins[1], C)``, at least 1). Row ``r`` falls in
    block row ``floor(r * br / R)``, so block row ``i`` covers rows
    ``[ceil(i * R / br), ceil((i + 1) * R / br))`` (block sizes differ by at most one
    row), and likewise for columns. The result is ``br × bc``, one value in ``[0, 1]`` per
    block: the indices that fall in the block over the block's element count. These are
    the elements the patch writes, whatever their values: writing the value already
    there counts too (whether a write changed anything depends on the model, see
    ``LoadReport.deltas``, ``changed``). Computed
    from the indices in O(nnz + bins) time, never by building the full tensor or anything
    of its size, so a 128256 × 2560 patch is cheap and a 2**40-element one works; the
    indices are taken a million at a time, so for indices in increasing order (as
    patchkit's builders make them) the memory beyond the patch's own is a few tens of MiB
    whatever its nnz (others are sorted first, into a copy of them). An index given more
    than once (a patch loaded with ``validate_unique_indices=False``) counts once;
    indices that are not strictly increasing are sorted for that first (O(nnz log nnz); patches from
    :func:`~patchkit.build.sparse_patches_from_diff` and
    :func:`~patchkit.build.random_sparse_patch` are sorted). A dense patch writes every
    element: its map is all ones; a patch with no elements gives zeros.

    ``patch`` is a :class:`~patchkit.CheckpointWeightPatch` (or a plain 5-tuple);
    anything else raises ``TypeError``. The patch must pass the checks the loader makes
    of each patch on its own (:func:`~patchkit.patch.validate_patches`: a str name, a
    shape of ints none negative, 1-D tensors of values and of int32/int64 indices of one
    length, ...), which raise :class:`~patchkit.PatchTypeError` /
    :class:`~patchkit.PatchValueError` as the loader's do, and every index must lie in
    ``[0, numel)`` (``ValueError`` naming the patch and the first index that does not;
    checked with one min/max over the indices; indices on the meta device, which hold no
    values, raise ``ValueError`` too, unless there are none: nothing is written). NaN
    values are not looked at, and a repeated index is allowed (see above). ``bins`` is a
    pair of positive ints ``(rows, columns)``, or one int ``b`` meaning ``(b, b)``:
    anything else raises ``TypeError`` (not ints) or ``ValueError`` (not positive).

    >>> import torch
    >>> p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(2), torch.tensor([0, 5]))
    >>> density_map(p, bins=(2, 2)).tolist()
    [[0.5, 0.0], [0.0, 0.0]]
    """
    if type(patch) is tuple and len(patch) == 5:
        patch = CheckpointWeightPatch(*patch)  # a plain 5-tuple, as a load takes it
    if not all(hasattr(patch, f) for f in CheckpointWeightPatch._fields):
        raise PatchTypeError(
            f"density_map: patch must be a CheckpointWeightPatch, got {type(patch).__name__}",
            reason="not a patch", value=type(patch).__name__,
        )
    _check_structure(None, patch)
    return _density(patch, bins)[0]


def _density(patch: CheckpointWeightPatch, bins: object) -> tuple[torch.Tensor, int]:
    """``(density_map(patch, bins), elements the patch writes)``: each element once, an
    index given twice too. ``patch`` must have passed ``_check_structure``; its indices
    are checked to be in range here."""
    want_r, want_c = _as_bins(bins)
    rows, cols = grid_shape(patch.shape)
    br = max(1, min(want_r, rows))
    bc = max(1, min(want_c, cols))
    n = numel(patch)
    idx = None if patch.indices is None else patch.indices.reshape(-1)
    if idx is not None and idx.is_meta and idx.numel():
        raise PatchValueError(
            f"{where(None, patch.name)}: its indices are on the meta device (a dry run), "
            f"which holds no values: there is no map of where {idx.numel()} indices sit",
            name=patch.name, reason="meta device", value=idx.numel(),
        )
    if idx is not None:
        _check_range(patch, idx, n)
    if n == 0:
        return torch.zeros((br, bc), dtype=torch.float32, device="cpu"), 0
    if idx is None:
        return torch.ones((br, bc), dtype=torch.float32, device="cpu"), n
    if not _increasing(idx):
        idx = torch.unique(idx)  # (an index given twice counts once: sorted, then once each)
    rs, cs = _block_starts(rows, br), _block_starts(cols, bc)
    counts = torch.zeros(br * bc, dtype=torch.int64, device="cpu")
    # In pieces of _PIECE indices: the temporaries (int64 rows, columns, blocks) are a
    # few tens of MiB, not ~40 bytes per index of the patch.
    for k in range(0, idx.numel(), _PIECE):
        part = idx[k:k + _PIECE].to("cpu", torch.int64)
        r = part // cols
        c = part - r * cols  # (not in place: part may be a view of the patch's indices)
        rb = _block_of(r, rows, br, rs)  # (a new tensor: changed in place below)
        counts += torch.bincount(rb.mul_(bc).add_(_block_of(c, cols, bc, cs)),
                                 minlength=br * bc)
    rows_per = (rs[1:] - rs[:-1]).to(torch.float64)
    cols_per = (cs[1:] - cs[:-1]).to(torch.float64)
    sizes = rows_per[:, None] * cols_per[None, :]
    return (counts.reshape(br, bc).to(torch.float64) / sizes).to(torch.float32), int(idx.numel())


_PIECE = 1 << 20  # indices a density map handles at a time


def _increasing(idx: torch.Tensor) -> bool:
    """Whether the 1-D ``idx`` is strictly increasing, checked in pieces of
    :data:`_PIECE` on ``idx``'s own device (a bool temporary per piece, not per index)."""
    n = idx.numel()
    for k in range(0, n - 1, _PIECE):
        part = idx[k:k + _PIECE + 1]  # (one past the piece: the next piece's first)
        if not bool((part[1:] > part[:-1]).all()):
            return False
    return True


def distinct_indices(idx: torch.Tensor) -> torch.Tensor:
    """The flat indices ``idx`` (1-D) with each index once: ``idx`` itself when it is
    strictly increasing, as patches from :func:`~patchkit.build.sparse_patches_from_diff`
    and :func:`~patchkit.build.random_sparse_patch` are (one pass to check, on ``idx``'s
    device), else sorted by :func:`torch.unique` (O(nnz log nnz)): an index may repeat
    (``validate_unique_indices=False``), and an element written twice is still one
    element."""
    return idx if _increasing(idx) else torch.unique(idx)


def _as_bins(bins: object) -> tuple[int, int]:
    """``bins`` as ``(rows, columns)``: a pair of positive ints, or one int for both.

    Raises ``TypeError`` (a :class:`~patchkit.errors.PatchTypeError`) for anything that is
    not an int or a pair of ints (``bool`` included), ``ValueError`` for a value below 1.
    """
    pair = (bins, bins) if _is_int(bins) else bins
    if not isinstance(pair, Sequence) or len(pair) != 2 or not all(map(_is_int, pair)):
        raise PatchTypeError(
            f"bins must be a pair of positive ints (rows, columns) or one int, got "
            f"{brief(bins)}",
            reason="bins type", value=bins,
        )
    out = (operator.index(pair[0]), operator.index(pair[1]))
    if min(out) < 1:
        raise PatchValueError(
            f"bins must be positive, got {brief(bins)}", reason="bins", value=bins
        )
    return out


def _is_int(v: object) -> bool:
    """An int or a numpy int, not a bool (nor a 0-d tensor, which ``operator.index``
    takes: the builders' counts refuse one too)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_range(patch: CheckpointWeightPatch, idx: torch.Tensor, n: int,
                 position: int | None = None) -> None:
    """Every flat index of ``idx`` (1-D, integers, any device) in ``[0, n)``; else
    ``ValueError`` naming the patch (at ``position``, when given) and the first index that
    is not. One min/max over the indices (a host wait on an accelerator)."""
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo >= 0 and hi < n:
        return
    idx = idx.to(torch.int64)  # (the failure path: n may not be an int32)
    k = int(torch.nonzero((idx < 0) | (idx >= n))[0, 0])
    bad = int(idx[k])
    raise PatchValueError(
        f"{where(position, patch.name)}: out-of-range index {bad} at indices[{k}] for shape "
        f"{_shape_text(_shape_dims(patch.shape))} ({n} elements; valid: [0, {n}))",
        position=position, name=patch.name, reason="out-of-range", value=bad,
    )


def _block_starts(n: int, b: int) -> torch.Tensor:
    """``b + 1`` int64 bounds: block ``i`` of ``b`` over ``n`` covers ``[s[i], s[i + 1])``.

    ``s[i] = ceil(i * n / b)``, the first ``k`` with ``floor(k * b / n) == i``, computed
    as ``i * (n // b) + ceil(i * (n % b) / b)`` so that nothing overflows.
    """
    i = torch.arange(b + 1, dtype=torch.int64, device="cpu")
    q, m = divmod(n, b)
    return i * q + (i * m + b - 1) // b


def _block_of(k: torch.Tensor, n: int, b: int, starts: torch.Tensor) -> torch.Tensor:
    """``floor(k * b / n)`` for each ``k`` in ``[0, n)`` (exact, even where ``k * b``
    would overflow int64: then found in ``starts`` instead)."""
    if (n - 1) * b < 2**63:
        return (k * b) // n
    return torch.searchsorted(starts, k, right=True) - 1


def region_text(
    full_shape: tuple[int, ...],
    offset: int,
    view_shape: tuple[int, ...],
    view_stride: tuple[int, ...] | None,
) -> str:
    """Describe a written region of a tensor in slice notation, e.g. ``"[32:48, :]"``.

    ``full_shape`` is the tensor's shape; ``offset`` the flat element offset of the
    region's first element in the full (contiguous, row-major) tensor; ``view_shape``
    the shape of the view written; ``view_stride`` its element strides in that same
    row-major numbering (``None``: unknown). A region that is a box of the full tensor is
    written as one slice per dimension (``:`` for a whole dimension), whatever the order
    of the view's dimensions (the transpose ``w.t()[1:3]`` of an ``(8, 4)`` ``w`` is
    ``"[:, 1:3]"``), and whatever the number of its dimensions: two that step along one
    dimension of the tensor in one run (a view of int32 words of a float8 tensor, each
    word four elements) are read as the one they make (:func:`_merged_dims`). A box that
    steps over every ``k``-th index of a dimension writes that
    dimension as ``start:stop:k``, a Python slice that selects exactly the indices
    written (``w[1::2]`` of an ``(8, 4)`` ``w`` is ``"[1:8:2, :]"``), ``stop`` being the
    dimension's end where the last index steps past it. A view that reshapes
    (``w.view(-1)[6:18]`` of a ``(4, 6)`` ``w``, whose elements are one flat range) is
    written as the box that range covers where it is one (``"[1:3, :]"``). Anything else
    (a range that wraps rows partly, a diagonal) is ``"<n> elements from <offset>"``.
    """
    full_shape = tuple(int(d) for d in full_shape)
    view_shape = tuple(int(d) for d in view_shape)
    n = 1
    for d in view_shape:
        n *= d
    strides = _row_major_strides(full_shape)
    steps = (
        _box_steps(full_shape, strides,
                   *_merged_dims(full_shape, strides, view_shape, view_stride))
        if view_stride is not None else None
    )
    if steps is not None:
        start, rest = [], offset
        for fs in strides:
            start.append(rest // fs if fs else 0)
            rest = rest % fs if fs else rest
        # (inside the tensor at both ends: an offset before it, which floor division
        # reads as a negative start, is no box either)
        if offset >= 0 and all(b + (v - 1) * k < d
                               for b, (v, k), d in zip(start, steps, full_shape)):
            parts = []
            for b, (v, k), d in zip(start, steps, full_shape):
                if k == 1:
                    parts.append(":" if (b == 0 and v == d) else f"{b}:{b + v}")
                else:
                    parts.append(f"{b}:{min(d, b + v * k)}:{k}")
            return "[" + ", ".join(parts) + "]"
    if full_shape == () and n == 1:
        return "[]"
    if (n and view_stride is not None and offset >= 0 and offset + n <= math.prod(full_shape)
            and _runs_flat(view_shape, view_stride)):
        # a view that reshapes (``w.view(-1)[6:18]``): its elements are one flat range,
        # which may still be a box of the full tensor
        box = _flat_box(full_shape, offset, offset + n)
        if box is not None:
            return box
    return f"{n} elements from {offset}"


def _merged_dims(
    full_shape: tuple[int, ...],
    full_strides: tuple[int, ...],
    view_shape: tuple[int, ...],
    view_stride: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The view's dimensions, those that make one run along one full dimension merged
    into one: where a dimension steps by exactly the span of another (``m`` elements of
    stride ``s``, and one of stride ``m * s``) and :func:`_box_steps` reads both as steps
    along the same full dimension, both are one of ``m`` times as many elements of stride
    ``s``. The same elements: a box of int32 words of a float8 tensor, each word four
    float8 elements (``p.view(torch.int32)[:, 1:3].t()`` of a ``(4, 16)`` ``p``: shape
    ``(2, 4, 4)``, strides ``(4, 16, 1)`` in float8 elements), is columns ``4:12`` of
    ``p``, a box of two dimensions, where unmerged its two dimensions along the columns
    would make it none."""
    def along(st: int) -> int | None:
        return next((j for j, (d, fs) in enumerate(zip(full_shape, full_strides))
                     if d > 1 and fs > 0 and st > 0 and st % fs == 0), None)

    dims = sorted((int(st), int(n)) for n, st in zip(view_shape, view_stride) if n != 1)
    merged: list[list[int]] = []
    for st, n in dims:
        if merged:
            s0, n0 = merged[-1]
            if st == s0 * n0 and along(st) is not None and along(st) == along(s0):
                merged[-1][1] = n0 * n
                continue
        merged.append([st, n])
    return tuple(n for _, n in merged), tuple(st for st, _ in merged)


def _runs_flat(view_shape: tuple[int, ...], view_stride: Sequence[int]) -> bool:
    """Whether a view of these strides holds consecutive elements, row-major."""
    want = _row_major_strides(view_shape)
    return all(int(s) == w for d, s, w in zip(view_shape, view_stride, want) if d != 1)


def _flat_box(shape: tuple[int, ...], a: int, b: int) -> str | None:
    """The flat range ``[a, b)`` of a row-major tensor of ``shape`` as a box in slice
    notation (``[1:3, :]`` for rows 1 and 2 of a ``(4, 6)`` tensor), or ``None`` when it
    is none (it wraps a row partly)."""
    k = len(shape)
    for j in range(k + 1):
        block = math.prod(shape[j:])  # elements under one index of dimension j - 1
        if a % block or b % block:
            continue
        lo, hi = a // block, b // block
        if j == 0:
            return "[" + ", ".join(":" for _ in shape) + "]"
        size = shape[j - 1]
        if lo // size != (hi - 1) // size:
            continue  # (it spans more than one index of a dimension before j - 1)
        fixed, rest = [], lo // size
        for d in reversed(shape[: j - 1]):
            fixed.append(rest % d)
            rest //= d
        parts = [f"{i}:{i + 1}" for i in reversed(fixed)]
        first, last = lo % size, (hi - 1) % size + 1
        parts.append(":" if (first, last) == (0, size) else f"{first}:{last}")
        parts += [":"] * (k - j)
        return "[" + ", ".join(parts) + "]"
    return None


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))


def _box_steps(
    full_shape: tuple[int, ...],
    full_strides: tuple[int, ...],
    view_shape: tuple[int, ...],
    view_stride: Sequence[int],
) -> list[tuple[int, int]] | None:
    """Per full dimension, ``(extent, step)`` of the view along it, when each view
    dimension longer than 1 steps along a full dimension of its own (``step`` indices at a
    time), in any order; ``None`` otherwise. Full dimensions the view does not step along
    (``w[3]`` drops one) get ``(1, 1)``. Whether the box lies inside the tensor is the
    caller's to check.

    A view stride is read as a step along the dimension of the largest row-major stride
    that divides it: along a smaller one, a single step would already leave that
    dimension.
    """
    out = [(1, 1)] * len(full_strides)
    used: set[int] = set()
    for v, st in zip(view_shape, view_stride):
        if v == 1:
            continue
        if v == 0 or st <= 0:
            return None
        j = next((j for j, (d, fs) in enumerate(zip(full_shape, full_strides))
                  if d > 1 and fs > 0 and st % fs == 0), None)
        if j is None or j in used:
            return None
        used.add(j)
        out[j] = (v, st // full_strides[j])
    return out
