"""patchkit: update model weights in place through a model's own checkpoint loader.

The loader (:func:`load_checkpoint_weight_patches`) and its record
(:class:`CheckpointWeightPatch`) follow the contract of the function of the same name in
vLLM; :func:`plan_chunks` shows which patches share a ``load_weights`` call. Everything
here imports torch only: plotting, tables and widgets load on first use.
"""

from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, plan_chunks
from .errors import ContractViolation, PatchError, PatchTypeError, PatchValueError
from .loader import load_checkpoint_weight_patches
from .patch import CheckpointWeightPatch

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "CheckpointWeightPatch",
    "Chunk",
    "ContractViolation",
    "PatchError",
    "PatchTypeError",
    "PatchValueError",
    "load_checkpoint_weight_patches",
    "plan_chunks",
]
