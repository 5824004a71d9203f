"""Staging (CONTRACT.md §3): the checkpoint-shaped tensor handed to ``load_weights``."""

from __future__ import annotations

import torch

from . import native
from .bitwise import bits
from .patch import CheckpointWeightPatch, PatchLike, _as_patch, resolved, validate_patches

__all__ = ["stage"]


def stage(patch: PatchLike) -> torch.Tensor:
    """Return the checkpoint-shaped tensor for one patch, as a load stages it.

    - Dense: ``values`` cast to ``dtype`` and viewed as ``shape`` (no copy when ``values``
      already has that dtype and is contiguous).
    - Sparse: a tensor of ``shape`` and ``dtype`` filled with NaN, with ``values`` (cast to
      ``dtype``) written at ``indices``; positions left NaN mean "keep the runtime value".

    The staged tensor lives on the device of ``values``. The patch is checked first, as a
    load checks it (:func:`~patchkit.patch.validate_patches`: ``PatchTypeError`` /
    ``PatchValueError`` naming it, e.g. for an index out of range or a NaN value).
    """
    patch = _as_patch(patch)  # (a plain 5-tuple too, as a load takes it)
    validate_patches([patch], positions=[None])  # (a lone patch: no position to name)
    return _stage(resolved(patch))


def _stage(patch: CheckpointWeightPatch) -> torch.Tensor:
    """:func:`stage` of a patch validation has passed, its tensors plain
    (:func:`~patchkit.patch.resolved`): what the loader calls."""
    _, shape, dtype, values, indices = patch
    if type(shape) is not tuple:
        # (validation has checked the dims of a tuple; torch reads them as they are)
        shape = tuple(int(d) for d in shape)
    if indices is None:
        return (values if values.dtype == dtype else values.to(dtype)).reshape(shape)
    # Fresh memory, written whole at once: on huge pages where Linux has them.
    staged = native.fresh_empty(shape, dtype, values.device)
    try:
        staged.fill_(float("nan"))
    except (RuntimeError, NotImplementedError):  # (float8 on the CPU before torch 2.6)
        bits(staged).fill_(int(bits(torch.tensor([float("nan")]).to(dtype))[0]))
    if indices.numel():
        # (a conversion that changes nothing is not asked for: each is a torch call, and
        # a small patch's staging is little else)
        idx = (indices if indices.dtype == torch.int64 and indices.device == values.device
               else indices.to(device=values.device, dtype=torch.int64))
        # Scatter the bits, not the numbers: the same for every float dtype, and it works
        # for dtypes whose index_copy_ kernel is missing on some devices (float8 on CPU).
        bits(staged).view(-1).index_copy_(
            0, idx, bits(values if values.dtype == dtype else values.to(dtype)))
    return staged
