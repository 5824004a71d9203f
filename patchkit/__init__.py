"""patchkit: update model weights in place through a model's own checkpoint loader.

The loader (:func:`load_checkpoint_weight_patches`) and its record
(:class:`CheckpointWeightPatch`) follow the contract of the function of the same name in
vLLM (``docs/CONTRACT.md``); :func:`plan_chunks` shows which patches share a
``load_weights`` call. :func:`inspect_load` runs a load and reports what it did.
Patches are made by :func:`dense_patches`, :func:`sparse_patches_from_diff`,
:func:`random_sparse_patch` and :func:`split_patch`, and stored by :func:`save_patches`;
small vLLM-style models to load into live in :mod:`patchkit.toymodels`.

``import patchkit`` imports torch only: pandas (for :func:`inspect_load`,
:class:`LoadReport`, :func:`patch_summary`), matplotlib (``patchkit.plot``) and
ipywidgets (``patchkit.widgets``) load on first use: those submodules (and
``patchkit.toymodels``) are attributes of the package once first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import native as native
from .bitwise import same_bits, same_state
from .build import (
    AdamLikeTrainer,
    changed_fraction,
    dense_patches,
    random_sparse_patch,
    sparse_patches_from_diff,
    split_patch,
    wire_bytes,
)
from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, plan_chunks
from .density import density_map
from .errors import ContractViolation, PatchError, PatchTypeError, PatchValueError
from .io import load_patches, read_patch_metadata, save_patches
from .loader import load_checkpoint_weight_patches
from .patch import CheckpointWeightPatch
from .progress import LoadProgress
from .staging import stage
from .units import format_bytes

__version__ = "0.1.0"

if TYPE_CHECKING:
    # What a type checker (mypy, pyright: an editor's completions and hovers) sees of the
    # names below, which the module __getattr__ serves at run time; never run, so
    # ``import patchkit`` still loads neither pandas, matplotlib nor ipywidgets.
    from . import inspect as inspect
    from . import plot as plot
    from . import toymodels as toymodels
    from . import widgets as widgets
    from .inspect import LoadReport, inspect_load, patch_summary

# Public names that live in modules with heavier imports: loaded on first access.
_LAZY = {
    "inspect_load": "inspect",
    "LoadReport": "inspect",
    "patch_summary": "inspect",
}

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "AdamLikeTrainer",
    "CheckpointWeightPatch",
    "Chunk",
    "ContractViolation",
    "LoadProgress",
    "LoadReport",
    "PatchError",
    "PatchTypeError",
    "PatchValueError",
    "changed_fraction",
    "dense_patches",
    "density_map",
    "format_bytes",
    "inspect_load",
    "load_checkpoint_weight_patches",
    "load_patches",
    "patch_summary",
    "plan_chunks",
    "random_sparse_patch",
    "read_patch_metadata",
    "same_bits",
    "same_state",
    "save_patches",
    "sparse_patches_from_diff",
    "split_patch",
    "stage",
    "wire_bytes",
]


# Submodules with heavier imports, there as attributes once first read
# (``patchkit.plot.plot_chunks`` works after a plain ``import patchkit``).
_LAZY_MODULES = ("inspect", "plot", "toymodels", "widgets")


if not TYPE_CHECKING:  # (a type checker reads the imports above: a name that is not
    # there, a misspelt one, is then an error to it, not Any)
    def __getattr__(name: str) -> Any:
        return _lazy(name)


def _lazy(name: str) -> Any:
    if name in _LAZY_MODULES:
        try:
            return importlib.import_module(f".{name}", __name__)
        except ImportError as e:  # an optional extra missing: no such attribute here
            raise AttributeError(f"patchkit.{name} is not available: {e}") from e
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'patchkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
