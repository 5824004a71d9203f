"""Small models whose ``load_weights`` behaves like a vLLM model's, on CPU and GPU alike.

vLLM does not run on a CPU-only machine, so the tutorials, tests and the command line
use these stand-ins. Each one is an :class:`torch.nn.Module` with a
``load_weights(weights) -> set[str]`` method that takes ``(checkpoint name, tensor)``
pairs, maps every checkpoint tensor to its runtime place and copies it there with
``copy_``, the way vLLM's loaders do (but for one case: vLLM's ``default_weight_loader``
fills a one-element parameter with ``fill_(w.item())``, which a sparse load refuses;
these models copy it).

- :class:`PlainModel`: checkpoint name == parameter name, ``param.data.copy_(w)``.
- :class:`TinyLlamaRuntime`: a Llama-shaped model laid out as vLLM lays it out on one
  tensor-parallel rank (packed ``qkv_proj`` and ``gate_up_proj``, column- and
  row-parallel shards, vocabulary-parallel embedding and ``lm_head``, optionally tied),
  loading Hugging Face checkpoint names made by :func:`tiny_llama_checkpoint`;
  :func:`gather_checkpoint` turns the runtimes of all ranks back into that checkpoint.
  With ``TinyLlamaConfig(num_experts=E)`` its MLPs are mixtures of experts, laid out
  as vLLM's fused-experts layer lays them out (per layer ``mlp.experts.w13_weight`` and
  ``mlp.experts.w2_weight`` holding every expert, a replicated router ``mlp.gate``),
  loading per-expert checkpoint names; with ``expert_parallel=True`` each rank holds
  ``E / tp_size`` whole experts instead and its loader skips the others' weights.
- Loaders that break the sparse-load contract (CONTRACT.md §4), one per clause, in
  :data:`BROKEN_LOADERS`, and :class:`FailingModel`, a loader that raises part-way (for
  partial-update and ``transactional=True`` demonstrations).

Everything here is deterministic and imports torch only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import torch
from torch import nn

from .bitwise import has_numbers
from .density import _dims, _is_int
from .errors import PatchValueError, brief, quoted
from .patch import _checked_device

__all__ = [
    "BROKEN_LOADERS",
    "FailingModel",
    "OverlappingDestinationsModel",
    "PlainModel",
    "ReportsWithoutWritingModel",
    "ShapeMismatchModel",
    "TinyLlamaConfig",
    "TinyLlamaRuntime",
    "UnknownWeightError",
    "WritesThenFillsModel",
    "WritesTwiceModel",
    "gather_checkpoint",
    "tiny_llama_checkpoint",
    "tiny_llama_shapes",
]

DeviceLike: TypeAlias = torch.device | str | int


class UnknownWeightError(KeyError):
    """A checkpoint name that a toy model's ``load_weights`` does not know.

    A :class:`KeyError` (as a failed lookup in vLLM's ``params_dict[name]`` is, for a
    name under ``model.``; vLLM's ``AutoWeightsLoader`` raises ``ValueError`` for an
    unknown top-level module) whose message reads as plain text; ``.name`` is the
    offending checkpoint name. It pickles.
    """

    def __init__(self, name: str, model: str = "model", hint: str = "") -> None:
        self.name = name
        self.model = model
        self.hint = hint
        self.message = f"{model}.load_weights: unknown checkpoint weight {quoted(name)}" + (
            f"; {hint}" if hint else ""
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # (and its attributes: what was attached to it, a failed load's report included)
        return (type(self), (self.name, self.model, self.hint), self.__dict__)


# --------------------------------------------------------------------------------------
# Building modules from dotted names
# --------------------------------------------------------------------------------------


def _register(root: nn.Module, dotted: str, param: nn.Parameter) -> None:
    """Register ``param`` under the dotted name ``dotted``, creating plain parent modules.

    ``named_parameters()`` then reports exactly ``dotted``.
    """
    parts = dotted.split(".")
    if any(p == "" for p in parts):
        raise ValueError(f"parameter name {quoted(dotted)} has an empty part")
    module = root
    for i, part in enumerate(parts[:-1]):
        child = module._modules.get(part)
        if child is None:
            if part in module._parameters or hasattr(module, part):
                raise ValueError(
                    f"parameter name {quoted(dotted)}: {quoted('.'.join(parts[: i + 1]))} is "
                    "already a parameter or attribute, so it cannot also be a module"
                )
            child = nn.Module()
            module.add_module(part, child)
        module = child
    leaf = parts[-1]
    if leaf in module._parameters or leaf in module._modules or hasattr(module, leaf):
        raise ValueError(
            f"parameter name {quoted(dotted)} clashes with an existing parameter, module or "
            "attribute of that name"
        )
    module.register_parameter(leaf, param)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _full(shape: Sequence[int], fill: float, dtype: torch.dtype,
          device: torch.device | None) -> torch.Tensor:
    """``torch.full``, and for a dtype torch has no fill for here (float8 on the CPU
    before torch 2.6) the same number cast from float64 (a Python float's own
    precision: rounded once, as torch.full rounds it)."""
    try:
        return torch.full(shape, fill, dtype=dtype, device=device)
    except (RuntimeError, NotImplementedError) as e:
        if not dtype.is_floating_point or "not implemented" not in str(e):
            raise
    # (torch.full's own check: a finite fill past the dtype's largest, or an infinite one
    # where the dtype has no infinity, overflows)
    one = torch.tensor([float(fill)], dtype=torch.float64).to(dtype).to(torch.float64)
    if (math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max) or (
            math.isinf(fill) and not bool(torch.isinf(one).all())):
        raise RuntimeError(f"value cannot be converted to type {dtype} without overflow")
    return torch.full(shape, fill, dtype=torch.float64, device=device).to(dtype)


def _has_iinfo(dtype: torch.dtype) -> bool:
    try:
        torch.iinfo(dtype)
    except TypeError:  # (a dtype torch gives no integer limits for)
        return False
    return True


def _check_fill(fill: object, dtype: object) -> None:
    """``fill`` is a real number that ``dtype`` (a :class:`torch.dtype`) holds
    (``TypeError`` / ``ValueError``, before any parameter is made)."""
    if isinstance(fill, bool) or not isinstance(fill, numbers.Real):
        raise TypeError(f"PlainModel: fill must be a real number, got {type(fill).__name__} "
                        f"{brief(fill)}")
    if not isinstance(dtype, torch.dtype):  # (torch.full's own error named its argument)
        raise TypeError(f"PlainModel: dtype must be a torch.dtype, got {type(dtype).__name__} "
                        f"{brief(dtype)}")
    if not (dtype.is_floating_point or dtype.is_complex):
        # (torch.full truncates 2.5 to 2 in an int tensor, wraps -1 to 255 in a uint8 one,
        # and makes True of 0.5 or 2)
        whole = isinstance(fill, numbers.Integral) or float(fill).is_integer()
        low, high = ((0, 1) if dtype == torch.bool else
                     (torch.iinfo(dtype).min, torch.iinfo(dtype).max) if _has_iinfo(dtype)
                     else (None, None))
        if not whole or (low is not None and not low <= fill <= high):
            raise ValueError(f"PlainModel: fill {brief(fill)} is not a value of {dtype}"
                             + (f" (a whole number in [{low}, {high}])" if low is not None
                                else " (not a whole number)"))
    try:
        _full((2,), fill, dtype, None)  # (torch checks a fill of one element less)
    except (RuntimeError, OverflowError) as e:
        reason = str(e).splitlines()[0]
        try:
            _full((2,), 0, dtype, None)
        except (RuntimeError, OverflowError):  # (no fill at all: torch refuses the dtype)
            raise ValueError(f"PlainModel: torch cannot make a tensor of dtype {dtype} "
                             f"(fill {brief(fill)}: {reason})") from None
        raise ValueError(f"PlainModel: fill {brief(fill)} is not a value of {dtype} "
                         f"({reason})") from None


def _check_mapping(value: object, what: str, of: str) -> None:
    """``TypeError`` (``what`` must be a mapping of names to ``of``) for a non-mapping."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping of names to {of}, got "
                        f"{type(value).__name__}")


def _check_name(name: object, who: str = "") -> None:
    """``TypeError`` (``who`` before it) for a checkpoint name that is no str."""
    if not isinstance(name, str):
        raise TypeError(f"{who}a checkpoint name must be a str, got {type(name).__name__} "
                        f"{brief(name)}")


def _check_tensor(model: str, name: str, w: object) -> None:
    """``TypeError`` naming the weight for a ``load_weights`` entry that is no tensor."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{model}.load_weights: checkpoint weight {quoted(name)} must be a "
                        f"torch.Tensor, got {type(w).__name__}")


def _check_count(value: object, what: str) -> int:
    """``value`` as an int >= 1 (``TypeError`` for a float, a bool or a str, which
    made torch's or Python's own errors, or a float-sized model, further in; ``ValueError``
    below 1), ``what`` naming it in the message."""
    if not _is_int(value):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {brief(value)}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {brief(value)}")
    return int(value)


def _as_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    _check_name(name)
    return _dims(shape, "", f"shape of {quoted(name)}")


# --------------------------------------------------------------------------------------
# The plain model
# --------------------------------------------------------------------------------------


def _model_device(device: object) -> torch.device:
    """``device`` as a :class:`torch.device` this machine has, checked before any tensor
    is made, with the error every other entry point gives
    (:func:`patchkit.patch._checked_device`: ``"cuda"`` on a machine without CUDA is a
    :class:`~patchkit.PatchValueError` saying it "is not available here", not torch's
    ``AssertionError``). ``"meta"`` is taken (a model to plan with); an int is an index
    of the current accelerator, as ``torch.device(0)`` reads it; ``None`` is torch's
    default device, as for torch's own layers (``with torch.device("meta"):`` makes a
    model to plan with)."""
    if device is None:
        # (what a factory function makes a tensor on: torch.get_default_device() reads a
        # ``with torch.device(...):`` block only from torch 2.8 on)
        device = torch.empty(0).device
    if isinstance(device, int) and not isinstance(device, bool):
        try:
            device = torch.device(device)
        except RuntimeError as e:
            raise PatchValueError(
                f"device {brief(device)} (an index of the current accelerator) is not available "
                f"here: {e}",
                reason="device unavailable", value=device,
            ) from None
    return _checked_device(device, allow_meta=True)


class PlainModel(nn.Module):
    """Checkpoint name == parameter name; ``load_weights`` does ``param.data.copy_(w)``.

    ``shapes`` maps checkpoint names (dots allowed: ``"model.layers.0.mlp.weight"``) to
    shapes. Every parameter is created with ``dtype`` on ``device``, filled with ``fill``,
    ``requires_grad=False``, in the order of ``shapes``, inside plain parent modules made
    from the dotted names; ``named_parameters()`` reports exactly the checkpoint names.
    Their order is ``nn.Module`` order (a module's own parameters before its
    submodules'), which is the order of ``shapes`` whenever ``shapes`` is itself in module
    order, as a ``state_dict()`` is. A name that is a prefix module of
    another (``"a"`` and ``"a.b"``) or clashes with an ``nn.Module`` attribute raises
    :class:`ValueError`.

    ``load_weights(weights)`` copies each ``(name, tensor)`` into the parameter of that
    name (one ``copy_`` per tensor; ``copy_`` casts dtype and device; the shapes must be
    equal, else :class:`ValueError`) and returns the set of names it loaded. An unknown
    name raises :class:`UnknownWeightError` (a :class:`KeyError`) before anything of that
    entry is written; entries before it in the same call stay written.

    ``device`` defaults to torch's default device, as torch's own layers do: the CPU,
    or what ``torch.set_default_device`` or a ``with torch.device(...):`` block around
    the model's construction sets (``"meta"``: a dry-run model, see
    :func:`patchkit.inspect_load`).
    A ``device`` this machine does not have (``"cuda"`` without CUDA) raises
    :class:`~patchkit.PatchValueError` ("is not available here"), one that is not a
    device :class:`~patchkit.PatchTypeError`, before any parameter is made (here and in
    every model of this module).
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike | None = None,
        fill: float = 0.0,
    ) -> None:
        super().__init__()
        _check_mapping(shapes, "PlainModel: shapes", "shapes (e.g. {'w': (4, 8)})")
        device = _model_device(device)
        self.checkpoint_shapes: dict[str, tuple[int, ...]] = {
            name: _as_shape(name, s) for name, s in shapes.items()
        }
        _check_fill(fill, dtype)
        self._by_name: dict[str, nn.Parameter] = {}
        for name, shape in self.checkpoint_shapes.items():
            param = _frozen(
                _full(self._runtime_shape(shape), fill, dtype, device)
            )
            _register(self, name, param)
            self._by_name[name] = param

    @classmethod
    def from_state_dict(
        cls,
        state: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        device: DeviceLike | None = None,
    ) -> PlainModel:
        """A model with ``state``'s names and shapes, holding a copy of its values.

        ``dtype``/``device`` default to those of the first tensor. ``TypeError`` for a
        ``state`` that is not a mapping of str to tensors.
        """
        _check_mapping(state, "PlainModel.from_state_dict: state", "tensors")
        for n, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"PlainModel.from_state_dict: state[{quoted(n)}] must be a "
                                f"torch.Tensor, got {type(t).__name__}")
        first = next(iter(state.values()), None)
        if dtype is None:
            dtype = first.dtype if first is not None else torch.float32
        if device is None and first is not None:
            device = first.device
        model = cls({n: tuple(t.shape) for n, t in state.items()}, dtype=dtype, device=device)
        with torch.no_grad():
            model.load_weights(state.items())
        return model

    def _runtime_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The runtime parameter shape for a checkpoint shape (the identity here)."""
        return shape

    def _param(self, name: str) -> nn.Parameter:
        param = self._by_name.get(name)
        if param is None:
            names = list(self._by_name)
            known = ", ".join(quoted(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise UnknownWeightError(name, type(self).__name__, f"known names: {known}")
        return param

    def _check_shape(self, name: str, w: torch.Tensor) -> None:
        _check_tensor(type(self).__name__, name, w)
        want = self.checkpoint_shapes[name]
        if tuple(w.shape) != want:
            raise ValueError(
                f"{type(self).__name__}.load_weights: checkpoint weight {quoted(name)} has shape "
                f"{tuple(w.shape)}, expected {want}"
            )

    def load_one(self, name: str, param: nn.Parameter, w: torch.Tensor) -> None:
        """Write one checkpoint tensor into its parameter (subclasses change this)."""
        param.data.copy_(w)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each ``(name, tensor)`` into the parameter of that name; return the names."""
        loaded: set[str] = set()
        for name, w in weights:
            param = self._param(name)
            self._check_shape(name, w)
            self.load_one(name, param, w)
            loaded.add(name)
        return loaded


# --------------------------------------------------------------------------------------
# Loaders that break the sparse contract (CONTRACT.md §4), and one that fails
# --------------------------------------------------------------------------------------


class WritesTwiceModel(PlainModel):
    """Copies every checkpoint tensor into its parameter twice in one call.

    Breaks CONTRACT §4: "Two copies within one ``load_weights`` call whose destinations
    overlap in memory → ``NotImplementedError`` ("overlapping runtime views") at the
    second; the first stays applied." Dense loads give the same result as
    :class:`PlainModel`.
    """

    CLAUSE: ClassVar[str] = (
        "[patchkit, also in later vLLM revisions] "
        "Two copies within one load_weights call whose destinations overlap in memory "
        '→ NotImplementedError ("overlapping runtime views") at the second; the first '
        "stays applied."
    )
    REASON: ClassVar[str] = "overlapping runtime views"

    def load_one(self, name: str, param: nn.Parameter, w: torch.Tensor) -> None:
        """Copy ``w`` into ``param`` twice (the second copy overlaps the first)."""
        param.data.copy_(w)
        param.data.copy_(w)  # e.g. a loader that "re-applies" after a post-processing hook


class WritesThenFillsModel(PlainModel):
    """Pads every weight with ``pad_rows`` extra rows and zero-fills them after copying.

    This is what a vocabulary-parallel embedding with a padded vocabulary does: copy the
    checkpoint rows into the first rows, then ``fill_(0)`` the padding rows. Runtime
    parameters have shape ``(rows + pad_rows, *rest)``; scalar weights are not padded (and
    not filled). Breaks CONTRACT §4: "Any other in-place write into runtime storage
    (``fill_``, ``zero_``, ...) → ``NotImplementedError`` naming the op; it writes
    nothing." In a sparse load the copy is applied and the ``fill_`` is rejected.
    """

    CLAUSE: ClassVar[str] = (
        "[patchkit, also in later vLLM revisions] "
        "Any other in-place write into runtime storage (fill_, zero_, add_, index_put_/"
        "__setitem__ with advanced indexing, an out= op, ...) → NotImplementedError naming "
        "the op; it writes nothing."
    )
    REASON: ClassVar[str] = "unsupported op"

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike | None = None,
        fill: float = 0.0,
        *,
        pad_rows: int = 1,
    ) -> None:
        self.pad_rows = _check_count(pad_rows, "WritesThenFillsModel: pad_rows")
        super().__init__(shapes, dtype=dtype, device=device, fill=fill)

    def _runtime_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            return shape
        return (shape[0] + self.pad_rows, *shape[1:])

    def load_one(self, name: str, param: nn.Parameter, w: torch.Tensor) -> None:
        """Copy ``w`` into the leading rows of ``param``, then ``fill_(0)`` the padding
        rows (a 0-d weight is only copied)."""
        if w.ndim == 0:
            param.data.copy_(w)
            return
        rows = w.shape[0]
        param.data.narrow(0, 0, rows).copy_(w)
        param.data.narrow(0, rows, self.pad_rows).fill_(0)


class ShapeMismatchModel(PlainModel):
    """Keeps every weight with an extra leading dimension of 1 and copies by broadcasting.

    Runtime parameters have shape ``(1, *checkpoint_shape)``; ``load_weights`` does
    ``param.data.copy_(w)``, which broadcasts the checkpoint tensor. Breaks CONTRACT §4:
    "A ``copy_`` into a runtime tensor whose shape differs from the source's, or where
    either side is not floating point → ``NotImplementedError`` ("same-shaped
    floating-point"), raised before that copy writes anything." Dense loads work.
    """

    CLAUSE: ClassVar[str] = (
        "A copy_ into a runtime tensor whose shape differs from the source's, or where "
        'either side is not floating point → NotImplementedError ("same-shaped '
        'floating-point"), raised before that copy writes anything.'
    )
    REASON: ClassVar[str] = "same-shaped floating-point"

    def _runtime_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1, *shape)


class ReportsWithoutWritingModel(PlainModel):
    """Stashes the checkpoint tensors to apply later and reports them as loaded.

    ``load_weights`` keeps a clone of each tensor in ``pending`` (no runtime write) and
    returns the names; :meth:`apply_pending` copies them into the parameters afterwards.
    Breaks CONTRACT §4: "A loader call that returns ``None`` or some names but copied
    nothing into runtime storage → ``NotImplementedError`` ("without copying")." (In a
    sparse load the stash would hold NaN-filled tensors, and applying them later would
    write NaN everywhere the patch did not touch.)
    """

    CLAUSE: ClassVar[str] = (
        "[patchkit, also in later vLLM revisions] "
        "A loader call that returns None or some names but copied nothing into runtime "
        'storage → NotImplementedError ("without copying").'
    )
    REASON: ClassVar[str] = "without copying"

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike | None = None,
        fill: float = 0.0,
    ) -> None:
        super().__init__(shapes, dtype=dtype, device=device, fill=fill)
        self.pending: dict[str, torch.Tensor] = {}

    def load_one(self, name: str, param: nn.Parameter, w: torch.Tensor) -> None:
        """Stash a copy of ``w`` under ``name`` for :meth:`apply_pending`; write nothing."""
        self.pending[name] = w.clone()

    def apply_pending(self) -> set[str]:
        """Copy every stashed tensor into its parameter, empty the stash, return the names."""
        done = set(self.pending)
        with torch.no_grad():
            for name, w in self.pending.items():
                self._by_name[name].data.copy_(w)
        self.pending.clear()
        return done


class OverlappingDestinationsModel(nn.Module):
    """Packs every weight into one flat parameter, with offsets that overlap.

    All checkpoint weights live in one 1-D parameter ``flat_weight``; weight ``i`` is the
    view of ``numel(shape_i)`` elements starting ``overlap`` elements before weight
    ``i - 1`` ends (an off-by-``overlap`` offset bug in a packing table). Two different
    checkpoint names therefore land in overlapping views of one parameter. Breaks
    CONTRACT §4: "Two copies within one ``load_weights`` call whose destinations overlap
    in memory → ``NotImplementedError`` ("overlapping runtime views") at the second."
    A sparse load of a single weight per call is not rejected (nothing overlaps within
    the call); dense loads work and the later weight wins on the shared elements.

    Every weight but the last needs at least ``overlap`` elements (:class:`ValueError`
    otherwise).
    :meth:`view` returns the runtime view of a checkpoint name.
    """

    CLAUSE: ClassVar[str] = WritesTwiceModel.CLAUSE
    REASON: ClassVar[str] = "overlapping runtime views"

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike | None = None,
        fill: float = 0.0,
        *,
        overlap: int = 1,
    ) -> None:
        super().__init__()
        _check_mapping(shapes, "OverlappingDestinationsModel: shapes",
                       "shapes (e.g. {'w': (4, 8)})")
        device = _model_device(device)
        overlap = _check_count(overlap, "OverlappingDestinationsModel: overlap")
        self.overlap = overlap
        self.checkpoint_shapes = {name: _as_shape(name, s) for name, s in shapes.items()}
        self.offsets: dict[str, int] = {}
        offset = 0
        end = 0
        names = list(self.checkpoint_shapes)
        for name, shape in self.checkpoint_shapes.items():
            n = math.prod(shape)
            if n < overlap and name != names[-1]:
                raise ValueError(
                    f"weight {quoted(name)} has {n} elements; OverlappingDestinationsModel needs "
                    f"at least overlap={overlap} in every weight but the last"
                )
            self.offsets[name] = offset
            end = max(end, offset + n)
            offset = offset + n - overlap
        self.flat_weight = _frozen(_full((end,), fill, dtype, device))

    def view(self, name: str) -> torch.Tensor:
        """The runtime view (of ``flat_weight.data``) that checkpoint weight ``name`` fills."""
        if name not in self.offsets:
            raise UnknownWeightError(name, type(self).__name__)
        shape = self.checkpoint_shapes[name]
        return self.flat_weight.data.narrow(0, self.offsets[name], math.prod(shape)).view(shape)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each tensor into its (overlapping) view of ``flat_weight``; return the names."""
        loaded: set[str] = set()
        for name, w in weights:
            dest = self.view(name)
            _check_tensor(type(self).__name__, name, w)
            if tuple(w.shape) != tuple(dest.shape):
                raise ValueError(
                    f"OverlappingDestinationsModel.load_weights: {quoted(name)} has shape "
                    f"{tuple(w.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(w)
            loaded.add(name)
        return loaded


class FailingModel(PlainModel):
    """A :class:`PlainModel` whose loader raises ``RuntimeError`` when it meets ``fail_on``.

    Entries before ``fail_on`` in the same call (and earlier calls) are copied normally;
    the entry named ``fail_on`` raises before it writes anything. This breaks no clause
    of the contract: it shows partial updates (CONTRACT §5) and ``transactional=True``.
    ``calls`` counts the ``load_weights`` calls made.
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        dtype: torch.dtype = torch.float32,
        device: DeviceLike | None = None,
        fill: float = 0.0,
        *,
        fail_on: str,
    ) -> None:
        super().__init__(shapes, dtype=dtype, device=device, fill=fill)
        _check_name(fail_on, "FailingModel: fail_on: ")
        if fail_on not in self.checkpoint_shapes:
            raise ValueError(f"fail_on={quoted(fail_on)} is not one of the model's weights")
        self.fail_on = fail_on
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Like :meth:`PlainModel.load_weights`, raising ``RuntimeError`` at ``fail_on``."""
        self.calls += 1
        loaded: set[str] = set()
        for name, w in weights:
            param = self._param(name)
            if name == self.fail_on:
                raise RuntimeError(
                    f"FailingModel.load_weights: simulated failure at {quoted(name)} (after "
                    f"loading {brief(sorted(loaded), 200)} in this call)"
                )
            self._check_shape(name, w)
            self.load_one(name, param, w)
            loaded.add(name)
        return loaded


BROKEN_LOADERS: dict[
    str,
    type[WritesTwiceModel] | type[WritesThenFillsModel] | type[ShapeMismatchModel]
    | type[ReportsWithoutWritingModel] | type[OverlappingDestinationsModel],
] = {
    "writes_twice": WritesTwiceModel,
    "writes_then_fills": WritesThenFillsModel,
    "shape_mismatch": ShapeMismatchModel,
    "reports_without_writing": ReportsWithoutWritingModel,
    "overlapping_destinations": OverlappingDestinationsModel,
}
"""One loader per way of breaking the sparse contract: short name → class.

Every class is built as ``cls(shapes, dtype=..., device=..., fill=...)``, has a
``load_weights`` that works for dense loads (except ``reports_without_writing``, whose
writes wait for its ``apply_pending()``: a dense load reports every name loaded and
changes nothing until then), and carries ``CLAUSE`` (the sentence of
CONTRACT.md §4 it breaks, with its marker where the contract marks it as patchkit's:
vLLM's revision ``3db6ef6`` lets those loaders through, see the README) and ``REASON``
(the ``.reason`` of the :class:`~patchkit.ContractViolation` a sparse load raises). The
overlapping-destinations loader is rejected only when at least two of its weights
travel in one call.
"""


# --------------------------------------------------------------------------------------
# The tiny Llama: configuration and checkpoint
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Shape of a tiny Llama-style decoder. The defaults load in milliseconds.

    ``vocab_size`` rows of the embedding (and of ``lm_head``); ``hidden_size`` the
    model's width; ``intermediate_size`` the MLP's (``gate_proj``/``up_proj`` rows,
    ``down_proj`` columns); ``num_layers`` decoder layers; ``num_heads`` query heads and
    ``num_kv_heads`` key/value heads (grouped-query attention where fewer);
    ``tie_word_embeddings``: ``lm_head.weight`` is the embedding's tensor, as Hugging
    Face ties it (a checkpoint then lists it once, under the embedding's name).
    ``num_experts``: 0 (the default) for a dense MLP; ``E >= 1`` makes every layer's MLP
    a mixture of ``E`` experts, as Qwen3-MoE and Mixtral have: a router
    ``mlp.gate.weight`` (``E`` rows of ``hidden_size``) and per expert ``e``
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, each of an expert MLP of
    ``intermediate_size`` (no shared experts, no dense layers between). ``head_dim`` is
    ``hidden_size // num_heads``. Construction raises :class:`ValueError`
    when a size is not a positive int, ``num_experts`` not an int >= 0,
    ``num_heads`` does not divide ``hidden_size`` or ``num_kv_heads`` does not divide
    ``num_heads``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    tie_word_embeddings: bool = False
    num_experts: int = 0

    def __post_init__(self) -> None:
        for field_name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
        ):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"TinyLlamaConfig.{field_name} must be a positive int, got {brief(v)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                "TinyLlamaConfig.tie_word_embeddings must be a bool, got "
                f"{brief(self.tie_word_embeddings)}"
            )
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(
                "TinyLlamaConfig.num_experts must be an int >= 0 (0: a dense MLP), got "
                f"{brief(e)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyLlamaConfig: num_heads={brief(self.num_heads)} must divide "
                f"hidden_size={brief(self.hidden_size)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyLlamaConfig: num_kv_heads={brief(self.num_kv_heads)} must divide "
                f"num_heads={brief(self.num_heads)} (grouped-query attention)"
            )

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Rows of ``q_proj``: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of ``k_proj`` and of ``v_proj``: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim


def tiny_llama_shapes(config: TinyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face checkpoint names → full shapes, in Hugging Face module order.

    Order: ``model.embed_tokens.weight``; per layer ``self_attn.{q,k,v,o}_proj.weight``,
    ``mlp.{gate,up,down}_proj.weight`` (with ``num_experts``: ``mlp.gate.weight``, the
    router, then for each expert ``e`` in order ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
    as Qwen3-MoE's checkpoints name them), ``input_layernorm.weight``,
    ``post_attention_layernorm.weight``; ``model.norm.weight``; ``lm_head.weight`` unless
    ``tie_word_embeddings``.
    """
    if not isinstance(config, TinyLlamaConfig):
        raise TypeError(
            f"tiny_llama_shapes: config must be a TinyLlamaConfig, got {type(config).__name__}"
        )
    c = config
    h = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, c.q_size)
        mlps = [p + "mlp."]
        if c.num_experts:
            shapes[p + "mlp.gate.weight"] = (c.num_experts, h)
            mlps = [f"{p}mlp.experts.{e}." for e in range(c.num_experts)]
        for m in mlps:
            shapes[m + "gate_proj.weight"] = (c.intermediate_size, h)
            shapes[m + "up_proj.weight"] = (c.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, c.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


# vLLM pads a vocabulary to a multiple of this many rows before it splits it over ranks
# (its DEFAULT_VOCAB_PADDING_SIZE); a multiple of it needs no padding.
_VOCAB_PADDING = 64


def _check_float_dtype(dtype: object, who: str) -> None:
    """Refuse a ``dtype`` that is not a floating-point :class:`torch.dtype` (weights are
    floats; an integer checkpoint would round them to zeros, and an integer runtime
    cannot take a sparse patch)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{who}: dtype must be a torch.dtype, got {type(dtype).__name__} "
                        f"{brief(dtype)}")
    if not dtype.is_floating_point:
        raise ValueError(f"{who}: dtype must be a floating-point dtype, got {dtype}")
    if not has_numbers(dtype):  # (float4_e2m1fn_x2: packed, no casts, no NaN)
        raise ValueError(f"{who}: dtype must be a floating-point dtype that holds numbers "
                         f"(torch casts to and from it), got the packed {dtype}")


def tiny_llama_checkpoint(
    config: TinyLlamaConfig | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """A full checkpoint with Hugging Face Llama names, on the CPU, in ``dtype``.

    Keys and order are :func:`tiny_llama_shapes`. Values are drawn in float32 from a CPU
    :class:`torch.Generator` seeded with ``seed`` (in key order) and cast to ``dtype``:
    the same ``(config, seed, dtype)`` gives bit-identical tensors, different seeds give
    different tensors. ``seed``: an int in ``[0, 2**32)`` (``TypeError`` for another
    type, ``ValueError`` outside it: torch's CPU generator reads a seed's low 32 bits, so
    a seed beyond would repeat one inside).
    Norm weights are ``1 + 0.1 * N(0, 1)``; every other weight is ``N(0, 1) /
    sqrt(fan_in)`` (embedding: ``0.02 * N(0, 1)``). Every tensor is contiguous and owns
    its storage.
    """
    config = TinyLlamaConfig() if config is None else config
    if not isinstance(config, TinyLlamaConfig):
        raise TypeError(f"config must be a TinyLlamaConfig, got {type(config).__name__}")
    _check_float_dtype(dtype, "tiny_llama_checkpoint")
    if not _is_int(seed):
        raise TypeError(f"tiny_llama_checkpoint: seed must be an int, got "
                        f"{type(seed).__name__} {brief(seed)}")
    if not 0 <= seed < 1 << 32:
        # (torch's CPU generator draws from a seed's low 32 bits: 2**32 gave seed 0's
        # checkpoint, and -1 that of 2**32 - 1)
        raise ValueError(f"tiny_llama_checkpoint: seed must be in [0, 2**32), got {brief(seed)}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for name, shape in tiny_llama_shapes(config).items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu")
        if len(shape) == 1:
            x = 1.0 + 0.1 * x
        elif name == "model.embed_tokens.weight":
            x = 0.02 * x
        else:
            x = x / math.sqrt(shape[1])
        out[name] = x.to(dtype)
    return out


# --------------------------------------------------------------------------------------
# The tiny Llama runtime: one tensor-parallel rank, vLLM layout
# --------------------------------------------------------------------------------------


class _Weight(nn.Module):
    """A module holding one ``weight`` parameter (a linear layer, a norm, an embedding)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class _Attention(nn.Module):
    def __init__(self, qkv: nn.Parameter, o: nn.Parameter) -> None:
        super().__init__()
        self.qkv_proj = _Weight(qkv)
        self.o_proj = _Weight(o)


class _MLP(nn.Module):
    def __init__(self, gate_up: nn.Parameter, down: nn.Parameter) -> None:
        super().__init__()
        self.gate_up_proj = _Weight(gate_up)
        self.down_proj = _Weight(down)


class _FusedExperts(nn.Module):
    """Every expert of one layer in two parameters, as vLLM's ``FusedMoE`` holds them."""

    def __init__(self, w13: nn.Parameter, w2: nn.Parameter) -> None:
        super().__init__()
        self.w13_weight = w13
        self.w2_weight = w2


class _SparseMoE(nn.Module):
    def __init__(self, router: nn.Parameter, w13: nn.Parameter, w2: nn.Parameter) -> None:
        super().__init__()
        self.gate = _Weight(router)
        self.experts = _FusedExperts(w13, w2)


class _DecoderLayer(nn.Module):
    def __init__(self, make: _ParamFactory) -> None:
        super().__init__()
        self.self_attn = _Attention(make.qkv(), make.row_parallel("o"))
        if make.rt.config.num_experts:
            self.mlp: nn.Module = _SparseMoE(make.router(), make.w13(), make.w2())
        else:
            self.mlp = _MLP(make.gate_up(), make.row_parallel("down"))
        self.input_layernorm = _Weight(make.replicated())
        self.post_attention_layernorm = _Weight(make.replicated())


class _Model(nn.Module):
    def __init__(self, make: _ParamFactory, num_layers: int) -> None:
        super().__init__()
        self.embed_tokens = _Weight(make.vocab_parallel())
        self.layers = nn.ModuleList(_DecoderLayer(make) for _ in range(num_layers))
        self.norm = _Weight(make.replicated())


class _ParamFactory:
    """Makes one rank's parameters, each with the ``weight_loader`` vLLM would attach."""

    def __init__(self, rt: TinyLlamaRuntime, dtype: torch.dtype, device: DeviceLike) -> None:
        self.rt = rt
        self.dtype = dtype
        self.device = device

    def _new(self, shape: tuple[int, ...], loader) -> nn.Parameter:
        p = _frozen(torch.zeros(shape, dtype=self.dtype, device=self.device))
        p.weight_loader = loader  # type: ignore[attr-defined]
        return p

    def vocab_parallel(self) -> nn.Parameter:
        rt = self.rt
        return self._new((rt.vocab_per_rank, rt.config.hidden_size), rt._load_output_shard)

    def qkv(self) -> nn.Parameter:
        rt = self.rt
        rows = rt.q_per_rank + 2 * rt.kv_per_rank
        return self._new((rows, rt.config.hidden_size), rt._load_qkv)

    def gate_up(self) -> nn.Parameter:
        rt = self.rt
        return self._new((2 * rt.intermediate_per_rank, rt.config.hidden_size), rt._load_gate_up)

    def row_parallel(self, which: str) -> nn.Parameter:
        rt = self.rt
        cols = rt.q_per_rank if which == "o" else rt.intermediate_per_rank
        return self._new((rt.config.hidden_size, cols), rt._load_input_shard)

    def replicated(self) -> nn.Parameter:
        rt = self.rt
        return self._new((rt.config.hidden_size,), rt._load_replicated)

    def router(self) -> nn.Parameter:
        c = self.rt.config
        return self._new((c.num_experts, c.hidden_size), self.rt._load_replicated)

    def w13(self) -> nn.Parameter:
        rt = self.rt
        return self._new((len(rt.local_experts), 2 * rt.intermediate_per_rank,
                          rt.config.hidden_size), rt._load_expert)

    def w2(self) -> nn.Parameter:
        rt = self.rt
        return self._new((len(rt.local_experts), rt.config.hidden_size,
                          rt.intermediate_per_rank), rt._load_expert)


def _check_full(param: nn.Parameter, loaded_weight: object, want: tuple[int, ...]) -> None:
    """The checkpoint tensor a weight loader takes has the full checkpoint shape ``want``."""
    if not isinstance(loaded_weight, torch.Tensor):
        raise TypeError(
            f"weight_loader: loaded_weight must be a torch.Tensor, got "
            f"{type(loaded_weight).__name__}"
        )
    if tuple(loaded_weight.shape) != tuple(want):
        raise ValueError(
            f"weight_loader: the checkpoint tensor for a parameter of shape "
            f"{tuple(param.shape)} on this rank must have shape {tuple(want)}, got "
            f"{tuple(loaded_weight.shape)}"
        )


def _shard_id_message(param: str, shard_id: object, allowed: str) -> str:
    extra = (
        " (vLLM reads shard_id None as a checkpoint that stores the packed tensor fused; "
        "this toy does not model fused checkpoints)" if shard_id is None else ""
    )
    return f"weight_loader of {param}: shard_id must be {allowed}, got {brief(shard_id)}{extra}"


# (runtime parameter part, checkpoint part, shard id): vLLM's "stacked params mapping".
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


# An expert's checkpoint part -> (its fused runtime parameter, vLLM's shard id): vLLM's
# "expert params mapping" (w1 = gate, w3 = up into w13; w2 = down).
_EXPERT_PARAMS = {
    "gate_proj": ("w13_weight", "w1"),
    "up_proj": ("w13_weight", "w3"),
    "down_proj": ("w2_weight", "w2"),
}


class TinyLlamaRuntime(nn.Module):
    """One tensor-parallel rank of a tiny Llama, with vLLM's parameter layout and loader.

    Parameters (names as :meth:`named_parameters` reports them; ``*`` = per layer
    ``model.layers.{i}``), each ``requires_grad=False``, zero-initialised, in ``dtype`` on
    ``device`` (torch's default device where not given, as for :class:`PlainModel`):

    ========================================  ==============================================
    ``model.embed_tokens.weight``             rows ``[r*V/T, (r+1)*V/T)`` of the embedding
    ``*.self_attn.qkv_proj.weight``           ``[q shard r; k shard s; v shard s]`` (rows):
                                              ``s = r`` where ``T <= num_kv_heads``; else
                                              one kv head, ``s = r // (T / num_kv_heads)``,
                                              the same on ``T / num_kv_heads`` ranks
    ``*.self_attn.o_proj.weight``             columns shard ``r`` of ``o_proj`` (row-parallel)
    ``*.mlp.gate_up_proj.weight``             ``[gate shard r; up shard r]`` (rows)
    ``*.mlp.down_proj.weight``                columns shard ``r`` of ``down_proj``
    ``*.mlp.gate.weight``                     with ``num_experts``, in place of the two
                                              above: the router, replicated
    ``*.mlp.experts.w13_weight``              with ``num_experts`` (``E``): shape
                                              ``(E, 2 * I/T, hidden_size)``; ``[e]`` is
                                              ``[gate shard r; up shard r]`` (rows) of
                                              expert ``e``
    ``*.mlp.experts.w2_weight``               ``(E, hidden_size, I/T)``; ``[e]`` is columns
                                              shard ``r`` of expert ``e``'s ``down_proj``
    ``*.input_layernorm.weight``, ``*.post_attention_layernorm.weight``, ``model.norm.weight``
                                              replicated
    ``lm_head.weight``                        rows shard ``r`` (vocabulary-parallel); with
                                              ``tie_word_embeddings`` the same Parameter as
                                              ``model.embed_tokens.weight``, registered
                                              after it
    ========================================  ==============================================

    ``tp_size`` must divide ``num_heads``, ``intermediate_size`` and ``vocab_size``, and
    either divide ``num_kv_heads`` or be a multiple of it (:class:`ValueError` otherwise).
    Where ``tp_size > num_kv_heads`` each rank holds one kv head (``head_dim`` rows of k
    and of v), rank ``r`` head ``r // num_kv_head_replicas`` with
    ``num_kv_head_replicas = tp_size // num_kv_heads``, so the ranks of one group hold
    replicas of it, as vLLM lays it out. ``vocab_size`` must be a
    multiple of 64: vLLM pads any other vocabulary to one and zero-fills the padding rows
    on every load, which is not modelled (:class:`ValueError` saying so).
    ``tp_size`` and ``tp_rank`` that are not ints raise :class:`TypeError`, and so does a
    ``dtype`` that is not a :class:`torch.dtype`; one that is not floating point raises
    :class:`ValueError`, and so does a ``device`` this machine does not have
    (:class:`~patchkit.PatchValueError`, as for :class:`PlainModel`). Each parameter carries a
    ``weight_loader(param, loaded_weight, shard_id=None)`` attribute, as in vLLM: it takes
    the full checkpoint tensor (:class:`ValueError` for another shape, before writing, as
    vLLM's asserts refuse it) and, for ``qkv_proj``, ``shard_id`` ``'q'``, ``'k'`` or
    ``'v'``, for ``gate_up_proj`` 0 or 1 (:class:`ValueError` otherwise; vLLM's ``None``,
    a checkpoint storing the packed tensor fused, is not modelled). The norms' loader
    stands in for vLLM's ``default_weight_loader``, which vLLM's norms fall back to.

    The experts are tensor-parallel, as vLLM's ``FusedMoE`` splits them without expert
    parallelism: every rank holds every expert, rows ``[r*I/T, (r+1)*I/T)`` of its
    ``gate_proj`` and ``up_proj`` and those columns of its ``down_proj`` (``I``:
    ``intermediate_size``, ``T``: ``tp_size``). ``w13_weight`` and ``w2_weight`` share
    one loader, vLLM's signature: ``weight_loader(param, loaded_weight, weight_name,
    shard_id, expert_id)``, ``shard_id`` ``'w1'`` (gate), ``'w3'`` (up) or ``'w2'``
    (down), ``expert_id`` an int in ``[0, E)`` (:class:`ValueError` otherwise, and for a
    ``w1``/``w3`` sent to ``w2_weight`` or the reverse, before writing). It returns
    ``True`` when it wrote (always, here), ``False`` when the expert is not on this rank
    (with ``expert_parallel``).

    ``expert_parallel=True`` (vLLM's ``--enable-expert-parallel``, here with one
    data-parallel rank, so the expert-parallel group is the tensor-parallel one:
    ``ep_size == tp_size``, ``ep_rank == tp_rank``) splits the experts instead of their
    matrices: rank ``r`` holds experts ``[r*E/T, (r+1)*E/T)`` (vLLM's default, linear
    placement; :attr:`local_experts`) whole, so ``w13_weight`` is ``(E/T, 2*I,
    hidden_size)`` and ``w2_weight`` ``(E/T, hidden_size, I)``, and ``[j]`` is global
    expert ``r*E/T + j``. Attention, embeddings and the router stay as above. ``tp_size``
    must then divide ``num_experts`` (but not ``intermediate_size``), and the config
    must have experts (:class:`ValueError` otherwise; :class:`TypeError` for a
    non-bool). The experts' loader maps the global ``expert_id`` to its local slot;
    for an expert another rank holds it writes nothing and returns ``False`` (after the
    same checks of ``shard_id``, ``expert_id`` and the tensor's shape as for a local
    one, so a bad weight fails on every rank alike), and :meth:`load_weights` then
    leaves that name out of the set it returns, as vLLM's MoE loaders do: a call whose
    every weight is another rank's expert writes nothing and returns an empty set.
    """

    def __init__(
        self,
        config: TinyLlamaConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: DeviceLike | None = None,
        *,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        config = TinyLlamaConfig() if config is None else config
        if not isinstance(config, TinyLlamaConfig):
            raise TypeError(f"config must be a TinyLlamaConfig, got {type(config).__name__}")
        for arg, v in (("tp_size", tp_size), ("tp_rank", tp_rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{arg} must be an int, got {type(v).__name__} {brief(v)}")
        if not isinstance(expert_parallel, bool):
            raise TypeError(f"expert_parallel must be a bool, got "
                            f"{type(expert_parallel).__name__} {brief(expert_parallel)}")
        _check_float_dtype(dtype, "TinyLlamaRuntime")
        device = _model_device(device)
        if config.vocab_size % _VOCAB_PADDING:
            padded = -(-config.vocab_size // _VOCAB_PADDING) * _VOCAB_PADDING
            raise ValueError(
                f"vocab_size={brief(config.vocab_size)} is not a multiple of "
                f"{_VOCAB_PADDING}: vLLM would pad the vocabulary to {brief(padded)} rows, "
                "split those over the ranks and "
                "zero-fill the padding rows on every load, which this toy does not model "
                "(WritesThenFillsModel shows that fill); use a multiple of "
                f"{_VOCAB_PADDING}"
            )
        if tp_size < 1:
            raise ValueError(f"tp_size must be at least 1, got {brief(tp_size)}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {brief(tp_size)}), got {brief(tp_rank)}")
        if config.num_heads % tp_size:
            raise ValueError(f"tp_size={brief(tp_size)} must divide num_heads="
                             f"{brief(config.num_heads)}")
        kv_heads = config.num_kv_heads
        if tp_size <= kv_heads and kv_heads % tp_size:
            raise ValueError(
                f"tp_size={brief(tp_size)} must divide num_kv_heads={brief(kv_heads)}"
            )
        if tp_size > kv_heads and tp_size % kv_heads:
            raise ValueError(
                f"tp_size={brief(tp_size)} is more than num_kv_heads={brief(kv_heads)} and "
                "not a multiple of it: each rank then holds one kv head, and each head is "
                "replicated on tp_size // num_kv_heads ranks (as in vLLM), which needs the "
                "same number of ranks for every head; use a tp_size that divides "
                "num_kv_heads or is a multiple of it"
            )
        if expert_parallel and not config.num_experts:
            raise ValueError(
                "expert_parallel=True needs a mixture of experts to split over the ranks; "
                "this config has a dense MLP (num_experts=0): use "
                "TinyLlamaConfig(num_experts=E)")
        if expert_parallel and config.num_experts % tp_size:
            raise ValueError(
                f"with expert_parallel=True, tp_size={brief(tp_size)} must divide "
                f"num_experts={brief(config.num_experts)}: each rank holds the same number "
                "of whole experts")
        # (with expert parallelism the experts are whole, and there is no dense MLP: no
        # matrix is cut along intermediate_size)
        split = ("vocab_size",) if expert_parallel else ("intermediate_size", "vocab_size")
        for field_name in split:
            v = getattr(config, field_name)
            if v % tp_size:
                raise ValueError(f"tp_size={brief(tp_size)} must divide {field_name}={brief(v)}")
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        #: How many ranks hold each kv head (vLLM's ``num_kv_head_replicas``): 1 where
        #: ``tp_size <= num_kv_heads``, else ``tp_size // num_kv_heads``.
        self.num_kv_head_replicas = max(1, tp_size // kv_heads)
        #: Rows of this rank's q shard / k (and v) shard, columns of its o_proj shard.
        #: k and v are cut into ``tp_size // num_kv_head_replicas`` shards, of which this
        #: rank holds shard ``tp_rank // num_kv_head_replicas`` (one head where replicated).
        self.q_per_rank = config.q_size // tp_size
        self.kv_per_rank = config.kv_size // (tp_size // self.num_kv_head_replicas)
        #: Rows of this rank's gate (and up) shard, columns of its down_proj shard (with
        #: ``expert_parallel``, all ``intermediate_size``: the experts are whole).
        self.intermediate_per_rank = config.intermediate_size // (
            1 if expert_parallel else tp_size)
        #: Whether the experts are split over the ranks whole (see the class docstring).
        self.expert_parallel = expert_parallel
        #: The expert-parallel group: the tensor-parallel ranks with ``expert_parallel``,
        #: else one rank (``ep_size`` 1, ``ep_rank`` 0) that holds a slice of every expert.
        self.ep_size = tp_size if expert_parallel else 1
        self.ep_rank = tp_rank if expert_parallel else 0
        #: The global ids of the experts this rank holds, in the order of their slots in
        #: ``w13_weight`` and ``w2_weight`` (all of them without ``expert_parallel``; none
        #: for a dense MLP).
        per_rank = config.num_experts // self.ep_size
        self.local_experts = range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
        #: Rows of this rank's embedding and lm_head shards.
        self.vocab_per_rank = config.vocab_size // tp_size

        make = _ParamFactory(self, dtype, device)
        self.model = _Model(make, config.num_layers)
        if config.tie_word_embeddings:
            self.lm_head = _Weight(self.model.embed_tokens.weight)
        else:
            self.lm_head = _Weight(make.vocab_parallel())
        self._shapes = tiny_llama_shapes(config)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the parameters (all share one)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """The device of the parameters (all share one)."""
        return self.model.embed_tokens.weight.device

    # -- weight loaders: each narrows the checkpoint tensor and makes exactly one copy_ --
    # Each checks what vLLM's asserts check (the shard's shape, the shard id) and raises
    # ValueError before writing anything, where a copy_ would broadcast or a narrow wrap.

    def _load_output_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Rows (output dim) shard ``tp_rank``: embedding, lm_head."""
        size = param.shape[0]
        _check_full(param, loaded_weight, (size * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))

    def _load_input_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Columns (input dim) shard ``tp_rank``: row-parallel o_proj, down_proj."""
        size = param.shape[1]
        _check_full(param, loaded_weight, (param.shape[0], size * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def _load_replicated(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """The whole tensor: norms (vLLM's ``default_weight_loader``)."""
        _check_full(param, loaded_weight, tuple(param.shape))
        param.data.copy_(loaded_weight)

    def _load_qkv(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Shard ``tp_rank`` of q, or shard ``tp_rank // num_kv_head_replicas`` of k or v
        (``shard_id``), into its rows of ``qkv_proj``."""
        q, kv = self.q_per_rank, self.kv_per_rank
        r, t, replicas = self.tp_rank, self.tp_size, self.num_kv_head_replicas
        # (first row in qkv_proj, rows, this rank's shard, shards of the checkpoint tensor)
        where = {"q": (0, q, r, t), "k": (q, kv, r // replicas, t // replicas),
                 "v": (q + kv, kv, r // replicas, t // replicas)}
        if not isinstance(shard_id, str) or shard_id not in where:
            raise ValueError(_shard_id_message("qkv_proj", shard_id, "'q', 'k' or 'v'"))
        offset, size, shard, shards = where[shard_id]
        _check_full(param, loaded_weight, (size * shards, param.shape[1]))
        src = loaded_weight.narrow(0, shard * size, size)
        param.data.narrow(0, offset, size).copy_(src)

    def _load_gate_up(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Shard ``tp_rank`` of gate (``shard_id`` 0) or up (1) into its rows of
        ``gate_up_proj``."""
        if (isinstance(shard_id, bool) or not isinstance(shard_id, numbers.Integral)
                or shard_id not in (0, 1)):  # (1.0 is not an id: narrow() takes ints only)
            raise ValueError(_shard_id_message("gate_up_proj", shard_id, "0 or 1"))
        shard_id = int(shard_id)
        size = self.intermediate_per_rank
        _check_full(param, loaded_weight, (size * self.tp_size, param.shape[1]))
        src = loaded_weight.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, shard_id * size, size).copy_(src)

    def _load_expert(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "",
        shard_id: object = None, expert_id: object = None,
    ) -> bool:
        """Expert ``expert_id``'s gate (``shard_id`` ``'w1'``) or up (``'w3'``) rows into
        its slot of ``w13_weight``, or its down_proj columns (``'w2'``) into its slot of
        ``w2_weight`` (vLLM's fused-experts loader; ``weight_name``, the checkpoint name,
        only names the weight in an error): shard ``tp_rank`` of them, or with
        ``expert_parallel`` all of them. Returns ``True`` when it wrote; ``False``, writing
        nothing, for an expert another rank holds (after the same checks)."""
        c = self.config
        size = self.intermediate_per_rank
        shards, shard = (1, 0) if self.expert_parallel else (self.tp_size, self.tp_rank)
        which = f" ({quoted(weight_name)})" if weight_name else ""
        if not isinstance(shard_id, str) or shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"weight_loader of the experts{which}: shard_id must be 'w1' "
                             f"(gate), 'w3' (up) or 'w2' (down), got {brief(shard_id)}")
        if (isinstance(expert_id, bool) or not isinstance(expert_id, numbers.Integral)
                or not 0 <= expert_id < c.num_experts):
            raise ValueError(f"weight_loader of the experts{which}: expert_id must be an int "
                             f"in [0, {c.num_experts}), got {brief(expert_id)}")
        h = c.hidden_size
        local = len(self.local_experts)
        want = (local, h, size) if shard_id == "w2" else (local, 2 * size, h)
        if tuple(param.shape) != want:
            raise ValueError(
                f"weight_loader of the experts{which}: shard_id {quoted(shard_id)} goes into "
                f"{'w2_weight' if shard_id == 'w2' else 'w13_weight'}, of shape {want} on "
                f"this rank, got a parameter of shape {tuple(param.shape)}")
        _check_full(param, loaded_weight,
                    (h, size * shards) if shard_id == "w2" else (size * shards, h))
        if int(expert_id) not in self.local_experts:
            return False  # (another rank's expert: vLLM's expert map gives it no slot)
        e = int(expert_id) - self.local_experts.start
        if shard_id == "w2":
            param.data[e].copy_(loaded_weight.narrow(1, shard * size, size))
            return True
        src = loaded_weight.narrow(0, shard * size, size)
        param.data[e].narrow(0, 0 if shard_id == "w1" else size, size).copy_(src)
        return True

    # -- the loader ------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named checkpoint tensors into this rank's parameters.

        For each ``(name, tensor)`` (full checkpoint shape, any floating dtype, any
        device): ``q/k/v_proj`` go into their slice of ``qkv_proj`` and ``gate/up_proj``
        into theirs of ``gate_up_proj`` (the stacked-params mapping), every other name
        into the parameter of the same name, through that parameter's ``weight_loader``,
        which narrows the checkpoint tensor to this rank's shard and makes exactly one
        ``copy_`` into a view of the parameter (``copy_`` casts dtype and device).

        With ``num_experts``, expert ``e``'s ``mlp.experts.{e}.gate_proj``, ``up_proj``
        and ``down_proj`` go through the fused experts' loader (vLLM's expert params
        mapping) with ``shard_id`` ``'w1'``, ``'w3'``, ``'w2'`` and ``expert_id=e``; with
        ``expert_parallel``, one of an expert another rank holds is checked, then skipped
        (not written, not returned), as vLLM skips it when the loader returns ``False``.

        Returns the set of **runtime parameter names** written, as vLLM's Llama loader
        does: ``q_proj``, ``k_proj`` and ``v_proj`` of a layer all report
        ``...self_attn.qkv_proj.weight``, ``gate_proj`` and ``up_proj``
        ``...mlp.gate_up_proj.weight``, an expert's ``gate_proj`` and ``up_proj``
        ``...mlp.experts.w13_weight`` and its ``down_proj`` ``...mlp.experts.w2_weight``
        (as vLLM's Qwen3-MoE and Mixtral loaders do); the other names are their own. So what a load
        returns is not the set of names it was sent (a full checkpoint of ``L`` layers
        returns ``3 * L`` fewer names than it has).

        Skipped, not written and not returned, as vLLM skips them: ``lm_head.weight`` when
        the embeddings are tied; rotary caches (names containing ``rotary_emb.inv_freq``,
        ``rotary_emb.cos_cached`` or ``rotary_emb.sin_cached``); and a ``.bias`` name the
        model has no parameter for (vLLM skips those for GPTQ checkpoints). Any other name
        the model does not have raises :class:`UnknownWeightError` (a :class:`KeyError`);
        a tensor of the wrong shape raises :class:`ValueError`; both before that entry
        writes anything (earlier entries stay written).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, w in weights:
            _check_name(name, "TinyLlamaRuntime.load_weights: ")  # (not a bare TypeError)
            if (tied and name == "lm_head.weight") or _skipped_as_vllm_does(name):
                continue
            _check_tensor("TinyLlamaRuntime", name, w)
            want = self._shapes.get(name)
            if want is None:
                raise UnknownWeightError(
                    name,
                    "TinyLlamaRuntime",
                    f"the checkpoint of this config has the names of tiny_llama_shapes() "
                    f"({len(self._shapes)} weights, {self.config.num_layers} layers)",
                )
            if tuple(w.shape) != want:
                raise ValueError(
                    f"TinyLlamaRuntime.load_weights: checkpoint weight {quoted(name)} has shape "
                    f"{tuple(w.shape)}, expected {want}"
                )
            parts = name.split(".")
            if "experts" in parts:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
                at = parts.index("experts")
                fused, shard_id = _EXPERT_PARAMS[parts[at + 2]]
                param_name = ".".join([*parts[:at + 1], fused])
                param = params[param_name]
                if param.weight_loader(param, w, name, shard_id=shard_id,
                                       expert_id=int(parts[at + 1])):
                    loaded.add(param_name)
                continue
            for param_part, ckpt_part, shard_id in _STACKED_PARAMS:
                if ckpt_part in parts:
                    parts[parts.index(ckpt_part)] = param_part
                    param_name = ".".join(parts)
                    param = params[param_name]
                    param.weight_loader(param, w, shard_id)
                    break
            else:
                param_name = name
                param = params[name]
                param.weight_loader(param, w)
            loaded.add(param_name)
        return loaded


def _skipped_as_vllm_does(name: str) -> bool:
    """Checkpoint names vLLM's Llama loader passes over without writing or returning them:
    rotary caches, and (for GPTQ checkpoints) biases of layers that have none. No layer of
    :class:`TinyLlamaRuntime` has a bias, and the real checkpoint names never end so."""
    return (
        any(f"rotary_emb.{c}" in name for c in ("inv_freq", "cos_cached", "sin_cached"))
        or name.endswith(".bias")
    )


def gather_checkpoint(runtimes: Sequence[TinyLlamaRuntime]) -> dict[str, torch.Tensor]:
    """Reassemble the full checkpoint from the runtimes of all tensor-parallel ranks.

    ``runtimes`` are :class:`TinyLlamaRuntime` s (:class:`TypeError` otherwise), ranks
    ``0..T-1`` of one ``tp_size == T``, in rank order, with one config and one dtype
    (:class:`ValueError` otherwise). The result has the keys and
    order of :func:`tiny_llama_checkpoint` for that config, full checkpoint shapes, the
    runtimes' dtype, on the CPU, in fresh tensors (no storage shared with a runtime). A
    replicated weight (the norms) must be bit-identical on every rank, else
    :class:`ValueError` names it and the first rank that differs; so must a kv head on
    the ranks that replicate it (``tp_size > num_kv_heads``: it is read from the first
    rank of each group of ``num_kv_head_replicas``). With ``num_experts``, each expert's
    ``gate_proj``/``up_proj``/``down_proj`` is put back together from its slices of
    ``w13_weight`` and ``w2_weight`` on every rank, and the router, replicated, must be
    bit-identical on every rank as the norms must; with ``expert_parallel`` (on every
    runtime alike, else :class:`ValueError`) each expert is read whole from the one rank
    that holds it.
    """
    rts = list(runtimes)
    if not rts:
        raise ValueError("gather_checkpoint needs the runtimes of all ranks, got none")
    first = rts[0]
    for i, rt in enumerate(rts):
        if not isinstance(rt, TinyLlamaRuntime):
            raise TypeError(f"runtimes[{i}] is a {type(rt).__name__}, not a TinyLlamaRuntime")
        if rt.config != first.config:
            raise ValueError(f"runtimes[{i}] has a different config: {brief(rt.config, 300)} vs "
                             f"{brief(first.config, 300)}")
        if rt.dtype != first.dtype:
            raise ValueError(f"runtimes[{i}] has dtype {rt.dtype}, runtimes[0] has {first.dtype}")
        if rt.expert_parallel != first.expert_parallel:
            raise ValueError(f"runtimes[{i}] has expert_parallel={rt.expert_parallel}, "
                             f"runtimes[0] has expert_parallel={first.expert_parallel}")
        if rt.tp_size != len(rts):
            raise ValueError(
                f"runtimes[{i}] has tp_size={rt.tp_size} but {len(rts)} runtimes were given; "
                "pass every rank once, in rank order"
            )
        if rt.tp_rank != i:
            raise ValueError(
                f"runtimes[{i}] is rank {rt.tp_rank}; pass every rank once, in rank order"
            )
    c = first.config
    per_rank = [
        {n: p.detach().to("cpu") for n, p in rt.named_parameters(remove_duplicate=False)}
        for rt in rts
    ]

    def rows(pname: str, start: int, size: int, replicas: int = 1) -> torch.Tensor:
        # (a shard replicated on `replicas` consecutive ranks, as k and v are where
        # tp_size > num_kv_heads: taken from the first rank of each group, and every
        # other rank of the group must hold the same bits)
        shards = [ps[pname].narrow(0, start, size) for ps in per_rank]
        for r in range(len(shards)):
            lead = r - r % replicas
            if r != lead and not torch.equal(shards[r].view(_int_dtype(shards[r])),
                                             shards[lead].view(_int_dtype(shards[lead]))):
                raise ValueError(
                    f"the replicated kv head in rows [{start}:{start + size}] of "
                    f"{quoted(pname)} differs between rank {lead} and rank {r}"
                )
        return torch.cat(shards[::replicas], dim=0)

    def cols(pname: str) -> torch.Tensor:
        return torch.cat([ps[pname] for ps in per_rank], dim=1)

    def expert(pname: str, e: int, dim: int, start: int, size: int) -> torch.Tensor:
        # (expert e's slice on every rank: rows [start, start + size) of w13_weight[e],
        # or columns of w2_weight[e]; each rank holds its own part, none replicated.
        # With expert parallelism: the whole expert, from the one rank that holds it)
        if first.expert_parallel:
            owner = next(r for r, rt in enumerate(rts) if e in rt.local_experts)
            slot = e - rts[owner].local_experts.start
            return per_rank[owner][pname][slot].narrow(dim, start, size).clone()
        return torch.cat([ps[pname][e].narrow(dim, start, size) for ps in per_rank], dim=dim)

    def replicated(name: str) -> torch.Tensor:
        base = per_rank[0][name]
        for r, ps in enumerate(per_rank[1:], start=1):
            if not torch.equal(ps[name].view(_int_dtype(base)), base.view(_int_dtype(base))):
                raise ValueError(
                    f"replicated weight {quoted(name)} differs between rank 0 and rank {r}"
                )
        return base.clone()

    q, kv, inter = first.q_per_rank, first.kv_per_rank, first.intermediate_per_rank
    kv_replicas = first.num_kv_head_replicas
    out: dict[str, torch.Tensor] = {}
    for name in tiny_llama_shapes(c):
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = rows(name, 0, first.vocab_per_rank)
            continue
        if parts[-2] in ("norm", "input_layernorm", "post_attention_layernorm") or (
                parts[-3:-1] == ["mlp", "gate"]):  # (the norms and the MoE router)
            out[name] = replicated(name)
            continue
        prefix = ".".join(parts[:3])
        kind = parts[-2]
        if parts[3:5] == ["mlp", "experts"]:
            e = int(parts[5])
            if kind == "down_proj":
                out[name] = expert(f"{prefix}.mlp.experts.w2_weight", e, 1, 0, inter)
            else:
                out[name] = expert(f"{prefix}.mlp.experts.w13_weight", e, 0,
                                   0 if kind == "gate_proj" else inter, inter)
            continue
        if kind == "q_proj":
            out[name] = rows(f"{prefix}.self_attn.qkv_proj.weight", 0, q)
        elif kind == "k_proj":
            out[name] = rows(f"{prefix}.self_attn.qkv_proj.weight", q, kv, kv_replicas)
        elif kind == "v_proj":
            out[name] = rows(f"{prefix}.self_attn.qkv_proj.weight", q + kv, kv, kv_replicas)
        elif kind == "gate_proj":
            out[name] = rows(f"{prefix}.mlp.gate_up_proj.weight", 0, inter)
        elif kind == "up_proj":
            out[name] = rows(f"{prefix}.mlp.gate_up_proj.weight", inter, inter)
        else:  # o_proj, down_proj: row-parallel, sharded on columns
            out[name] = cols(name)
    return out


def _int_dtype(t: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
