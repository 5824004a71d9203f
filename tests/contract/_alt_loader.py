"""A stand-in for "another implementation": forwards to patchkit with vLLM's signature.

Used to check that ``--loader``/``PATCHKIT_LOADER`` select the loader under test, e.g.::

    pytest tests/contract --loader=tests.contract._alt_loader:load_checkpoint_weight_patches

runs every test that is not ``patchkit_only`` against this wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import patchkit
from patchkit import CheckpointWeightPatch

__all__ = ["CheckpointWeightPatch", "load_checkpoint_weight_patches"]


def load_checkpoint_weight_patches(
    model: torch.nn.Module,
    patches: Iterable[CheckpointWeightPatch],
    *,
    max_chunk_bytes: int = 512 << 20,
    validate_unique_indices: bool = True,
) -> set[str]:
    return patchkit.load_checkpoint_weight_patches(
        model,
        patches,
        max_chunk_bytes=max_chunk_bytes,
        validate_unique_indices=validate_unique_indices,
    )
