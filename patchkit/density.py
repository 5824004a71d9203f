"""Where a patch's changes sit, without materialising the tensor (torch only)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .patch import CheckpointWeightPatch, numel

__all__ = ["density_map", "grid_shape", "region_text"]


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view patchkit draws a tensor as: rows × last dimension.

    ``()`` and ``(n,)`` are one row; higher ranks fold their leading dimensions into rows.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return (rows, shape[-1])


def density_map(
    patch: CheckpointWeightPatch, bins: tuple[int, int] = (64, 64)
) -> torch.Tensor:
    """Fraction of elements each block of the patch's 2-D view changes (float32, CPU).

    The tensor is viewed as ``grid_shape(patch.shape)`` and cut into at most ``bins``
    blocks (fewer when the tensor has fewer rows or columns); block ``(i, j)`` covers rows
    ``[i*R//br, (i+1)*R//br)`` and likewise columns. The result has one value in
    ``[0, 1]`` per block. Computed from the indices in O(nnz + bins) time and memory,
    never by building the full tensor, so a 128256 × 2560 patch is cheap. A dense patch
    writes every element: its map is all ones.

    >>> import torch
    >>> p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(2), torch.tensor([0, 5]))
    >>> density_map(p, bins=(2, 2)).tolist()
    [[0.5, 0.0], [0.0, 0.0]]
    """
    rows, cols = grid_shape(patch.shape)
    br = max(1, min(int(bins[0]), rows))
    bc = max(1, min(int(bins[1]), cols))
    if numel(patch) == 0:
        return torch.zeros((br, bc), dtype=torch.float32, device="cpu")
    if patch.indices is None:
        return torch.ones((br, bc), dtype=torch.float32, device="cpu")
    idx = patch.indices.to("cpu", torch.int64)
    r = idx // cols
    c = idx % cols
    # Block of row r is floor(r * br / rows): blocks differ in size by at most one row.
    rb = (r * br) // rows
    cb = (c * bc) // cols
    counts = torch.bincount(rb * bc + cb, minlength=br * bc).reshape(br, bc).to(torch.float64)
    cpu = torch.device("cpu")
    rows_per = torch.bincount((torch.arange(rows, device=cpu) * br) // rows, minlength=br)
    cols_per = torch.bincount((torch.arange(cols, device=cpu) * bc) // cols, minlength=bc)
    sizes = rows_per.to(torch.float64)[:, None] * cols_per.to(torch.float64)[None, :]
    return (counts / sizes).to(torch.float32)


def region_text(
    full_shape: tuple[int, ...],
    offset: int,
    view_shape: tuple[int, ...],
    view_stride: tuple[int, ...] | None,
) -> str:
    """Describe a written region of a tensor in slice notation, e.g. ``"[32:48, :]"``.

    ``offset`` is the flat element offset of the region's first element in the full
    (contiguous, row-major) tensor; ``view_stride`` its element strides. A region that is
    a box of the full tensor is written as one slice per dimension (``:`` for a whole
    dimension); anything else as ``"<n> elements from <offset>"``.
    """
    full_shape = tuple(int(d) for d in full_shape)
    view_shape = tuple(int(d) for d in view_shape)
    n = 1
    for d in view_shape:
        n *= d
    strides = _row_major_strides(full_shape)
    sizes = _box_sizes(strides, view_shape, view_stride) if view_stride is not None else None
    if sizes is not None:
        start, rest = [], offset
        for fs in strides:
            start.append(rest // fs if fs else 0)
            rest = rest % fs if fs else rest
        if all(b + v <= d for b, v, d in zip(start, sizes, full_shape)):
            parts = []
            for b, v, d in zip(start, sizes, full_shape):
                parts.append(":" if (b == 0 and v == d) else f"{b}:{b + v}")
            return "[" + ", ".join(parts) + "]"
    if full_shape == () and n == 1:
        return "[]"
    return f"{n} elements from {offset}"


def _row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))


def _box_sizes(
    full_strides: tuple[int, ...], view_shape: tuple[int, ...], view_stride: Sequence[int]
) -> list[int] | None:
    """Per full dimension, the view's extent, when the view is a box of the full tensor.

    Each view dimension longer than 1 must step like one full dimension, in order; full
    dimensions the view does not step along (``w[3]`` drops one) get extent 1.
    """
    sizes = [1] * len(full_strides)
    j = 0
    for v, st in zip(view_shape, view_stride):
        if v == 1:
            continue
        while j < len(full_strides) and full_strides[j] != st:
            j += 1
        if j == len(full_strides):
            return None
        sizes[j] = v
        j += 1
    return sizes
