"""The chunk walk (CONTRACT.md §2): which patches share one ``load_weights`` call.

This is the only place the walk exists. The loader and every inspection helper call
:func:`plan_chunks`, so what a notebook shows is what the loader does.

``DEFAULT_MAX_CHUNK_BYTES`` (``512 << 20``, 512 MiB, the contract's default) is the
budget of a call that gives no ``max_chunk_bytes``: of
:func:`~patchkit.load_checkpoint_weight_patches`, :func:`~patchkit.inspect_load`,
:func:`plan_chunks` and :func:`patchkit.io.print_patch_file_summary` (``python -m
patchkit inspect``); ``patchkit.plot.plot_chunks`` of a list of patches plans with it
where its ``max_chunk_bytes`` is ``None``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .errors import PatchTypeError, PatchValueError, brief
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _check_metadata,
    _numel_below,
    _ordered,
    check_max_chunk_bytes,
    patch_list,
)

__all__ = ["DEFAULT_MAX_CHUNK_BYTES", "Chunk", "plan_chunks"]

DEFAULT_MAX_CHUNK_BYTES = 512 << 20
"""512 MiB, the contract's default budget for one ``load_weights`` call."""

ClosedBy = Literal["budget", "repeated name", "end", "loader"]


@dataclass(frozen=True)
class Chunk:
    """One ``load_weights`` call of a load.

    - ``index``: 0-based position of the call in the load.
    - ``positions``: the patches it carries, as positions in the caller's input order.
    - ``names``: their checkpoint names, in the same order.
    - ``bytes``: staged bytes of the call (sum of ``prod(shape) * itemsize``).
    - ``closed_by``: why the chunk ended: ``"budget"`` (the next patch would have pushed
      it past ``max_chunk_bytes``), ``"repeated name"`` (the next patch names a weight this
      chunk already holds; reported first when both apply, because it closes the chunk
      whatever the budget) or ``"end"`` (the last chunk). :func:`plan_chunks` gives only
      these three; ``"loader"`` marks a call that a loader observed by
      :func:`patchkit.inspect_load` (``loader=``) ended for reasons of its own.
    - ``over_budget``: True for a single patch larger than the budget, which travels alone.
    """

    index: int
    positions: tuple[int, ...]
    names: tuple[str, ...]
    bytes: int
    closed_by: ClosedBy
    over_budget: bool = False


def _checked_positions(positions: object, n: int) -> Sequence[int]:
    """``positions`` for ``n`` patches, checked (see :func:`plan_chunks`)."""
    if positions is None:
        return range(n)
    try:
        if isinstance(positions, Iterator):
            raise TypeError  # (used up by the first reading: not a list)
        if isinstance(positions, torch.Tensor):
            positions = positions.tolist()
        positions = list(_ordered(positions))
    except TypeError:
        raise PatchTypeError(
            f"positions must be a list of ints (one per patch), got {type(positions).__name__}",
            reason="positions", value=type(positions).__name__,
        ) from None
    if len(positions) != n:
        raise PatchValueError(
            f"positions has {len(positions)} entries for {n} patches (one each)",
            reason="positions", value=len(positions),
        )
    for i, p in enumerate(positions):
        if type(p) is not int and (isinstance(p, bool) or not isinstance(p, numbers.Integral)):
            raise PatchTypeError(
                f"positions[{i}] must be an int, got {type(p).__name__} {brief(p)}",
                reason="positions", value=p,
            )
        if p < 0:
            raise PatchValueError(f"positions[{i}] is negative: {brief(p, text=True)}",
                                  reason="positions", value=p)
    return [int(p) for p in positions]


def plan_chunks(
    patches: Iterable[PatchLike],
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    *,
    positions: Sequence[int] | None = None,
) -> list[Chunk]:
    """Return the ``load_weights`` calls a load of ``patches`` makes, in order.

    Walks the patches in input order; before adding a patch the current chunk is closed if
    it is non-empty and either its bytes plus the patch's staged bytes exceed
    ``max_chunk_bytes`` or it already holds a patch with the same name. A patch larger
    than the budget therefore travels alone, and a repeated name always starts a new call.

    Needs only each patch's ``name``, ``shape`` and ``dtype``: nothing is staged or moved.
    ``positions`` relabels the patches (the loader passes the caller's positions after
    dropping tied aliases); it defaults to ``0..len-1`` and must have one entry per patch
    (:class:`~patchkit.errors.PatchValueError` otherwise), each an int >= 0
    (``PatchTypeError`` for a non-int, or a ``positions`` that is no sequence: a str, a
    set, an iterator; ``PatchValueError`` for a negative one; one may repeat, as an
    observed loader that sent a patch twice has it). ``patches`` must be a list of
    patches (or plain 5-tuples, as a load takes them) and each item a patch with a valid
    name, shape and dtype:
    :class:`~patchkit.errors.PatchTypeError` / ``PatchValueError`` name the first one
    that is not (at its position in ``positions``).

    >>> import torch
    >>> p = CheckpointWeightPatch("w", (4,), torch.float32, torch.zeros(4))
    >>> [(c.positions, c.closed_by) for c in plan_chunks([p, p], max_chunk_bytes=1024)]
    [((0,), 'repeated name'), ((1,), 'end')]
    """
    max_chunk_bytes = check_max_chunk_bytes(max_chunk_bytes)
    patches = patch_list(patches)
    positions = _checked_positions(positions, len(patches))
    chunks: list[Chunk] = []
    cur_pos: list[int] = []
    cur_names: list[str] = []
    cur_seen: set[str] = set()
    cur_bytes = 0

    def close(reason: ClosedBy) -> None:
        nonlocal cur_pos, cur_names, cur_seen, cur_bytes
        chunks.append(
            Chunk(
                index=len(chunks),
                positions=tuple(cur_pos),
                names=tuple(cur_names),
                bytes=cur_bytes,
                closed_by=reason,
                over_budget=cur_bytes > max_chunk_bytes,
            )
        )
        cur_pos, cur_names, cur_seen, cur_bytes = [], [], set(), 0

    for pos, patch in zip(positions, patches):
        if type(patch) is tuple and len(patch) == 5:
            patch = CheckpointWeightPatch(*patch)  # a plain 5-tuple, as a load takes it
        shape = patch.shape if type(patch) is CheckpointWeightPatch else None
        name = patch.name if shape is not None else None
        if ((type(shape) is tuple or type(shape) is torch.Size) and type(name) is str and name
                and type(patch.dtype) is torch.dtype
                and all(type(d) is int and d >= 0 for d in shape)):
            # (the common case, checked in one pass: a tuple (or a torch.Size, as
            # ``t.shape`` gives) of ints none negative, a name, a dtype; anything else gets
            # every check of _check_metadata)
            size = patch.dtype.itemsize
            n = _numel_below(shape, (1 << 63) // size)
            if n is None:  # (a shape no tensor holds: no big-integer product of it)
                _check_metadata(pos, patch)  # (raises, naming it)
        else:
            dims = _check_metadata(pos, patch)  # (raises, naming what is wrong)
            name, size, n = patch[0], patch[2].itemsize, math.prod(dims)
        nbytes = n * size
        if cur_pos:
            if name in cur_seen:
                close("repeated name")
            elif cur_bytes + nbytes > max_chunk_bytes:
                close("budget")
        cur_pos.append(pos)
        cur_names.append(name)
        cur_seen.add(name)
        cur_bytes += nbytes
    if cur_pos:
        close("end")
    return chunks
