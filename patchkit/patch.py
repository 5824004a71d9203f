"""The patch record and its validation (CONTRACT.md §1).

Everything here runs before the first ``load_weights`` call: a patch list that fails
any check leaves the model untouched.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import typing
import warnings
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple, TypeAlias

import torch

from . import native
from .bitwise import _PLAIN, count_true, host_waits, nan_mask
from .errors import PatchTypeError, PatchValueError, brief, where

__all__ = [
    "CheckpointWeightPatch",
    "PatchLike",
    "check_flag",
    "check_max_chunk_bytes",
    "is_sparse",
    "numel",
    "patch_list",
    "staged_nbytes",
    "validate_patches",
]


class CheckpointWeightPatch(NamedTuple):
    """One update of one checkpoint weight, in checkpoint coordinates.

    - ``name``: the checkpoint weight name handed to ``model.load_weights``.
    - ``shape``: the full checkpoint tensor shape (``()`` is a scalar).
    - ``dtype``: the checkpoint dtype; the staged tensor has this dtype.
    - ``values``: 1-D. Dense: the whole tensor flattened row-major. Sparse: the new
      values at ``indices``.
    - ``indices``: ``None`` for a dense replacement, else a 1-D int32/int64 tensor of flat
      positions into the full tensor.

    ``values`` may have another dtype than ``dtype``: it is cast when the patch is staged
    (complex values into a real dtype are refused, and a dense integer weight's values
    must fit its dtype). The staged tensor lives on the device of ``values``; ``indices``
    are moved there. A sparse patch needs a floating-point ``dtype``, indices in
    ``[0, prod(shape))``, each once (unless a load is given
    ``validate_unique_indices=False``), and no NaN among its values (NaN marks
    "unchanged").
    Nothing is checked when a patch is made: a load checks every patch before its first
    ``load_weights`` call (:func:`~patchkit.patch.validate_patches`), as do
    :func:`~patchkit.stage` and :func:`~patchkit.save_patches`.

    An immutable NamedTuple: positional construction, ``._replace`` and unpacking work.

    >>> p = CheckpointWeightPatch("w", (2, 2), torch.float32, torch.zeros(4))
    >>> p.indices is None
    True
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


# The fields' types as objects, not the strings this module's postponed annotations made
# of them: help() and inspect.signature then show ``name: str``, not ForwardRef('str').
CheckpointWeightPatch.__new__.__annotations__ = typing.get_type_hints(CheckpointWeightPatch)


PatchLike: TypeAlias = (
    CheckpointWeightPatch
    | tuple[str, tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor | None]
)
"""What the functions that read patches take, as a load takes them (and as their type
annotations say): a :class:`CheckpointWeightPatch`, or a plain 5-tuple of its fields in
its order (vLLM's function needs the NamedTuple)."""


def is_sparse(patch: CheckpointWeightPatch) -> bool:
    """True when the patch carries ``indices`` (a NaN-masked sparse update)."""
    return patch.indices is not None


def numel(patch: CheckpointWeightPatch) -> int:
    """Elements of the full checkpoint tensor (``prod(shape)``; 1 for a scalar)."""
    return math.prod(int(d) for d in patch.shape)


def staged_nbytes(patch: CheckpointWeightPatch) -> int:
    """Bytes of the staged checkpoint tensor: ``prod(shape) * itemsize(dtype)``.

    A sparse patch costs the same as a dense one: its staging tensor is full size.
    """
    return numel(patch) * patch.dtype.itemsize


def _as_patch(p: Any) -> Any:
    """A plain 5-tuple becomes a :class:`CheckpointWeightPatch`; anything else is kept
    as it is (another implementation's NamedTuple, or a bad value validation reports)."""
    if type(p) is tuple and len(p) == 5:
        return CheckpointWeightPatch(*p)
    return p


def resolved(patch: Any) -> Any:
    """``patch`` with any lazily negated ``values`` or ``indices`` (torch's negative bit,
    as ``complex.conj().imag`` gives) made plain: the same numbers in memory of their own.

    The loader's byte-level paths (the native copy, the bit comparisons, staging's bit
    scatter) read memory as it is, and a view with the negative bit holds the numbers
    un-negated there. Anything that is not a patch with tensors is returned as it is,
    for validation to name; a patch with nothing to resolve is returned itself.
    """
    values, indices = getattr(patch, "values", None), getattr(patch, "indices", None)
    # (the common case, nothing to resolve, decided without building anything: a load
    # asks once per patch, a report twice)
    neg_values = isinstance(values, torch.Tensor) and values.is_neg()
    neg_indices = isinstance(indices, torch.Tensor) and indices.is_neg()
    if not (neg_values or neg_indices) or not hasattr(patch, "_replace"):
        return patch
    fix = {}
    if neg_values:
        fix["values"] = values.resolve_neg()
    if neg_indices:
        fix["indices"] = indices.resolve_neg()
    return patch._replace(**fix)


# What an error says where a state dict came in place of patches.
_STATE_DICT_HINT = " (a state dict? patchkit.build.dense_patches makes patches of one)"


def patch_list(patches: object, what: str = "patches", *, ordered: bool = True) -> list:
    """``patches`` as a list (its items unchecked), or
    :class:`~patchkit.errors.PatchTypeError` when it is not a collection of patches:
    ``None`` or another non-iterable, a ``str``, a mapping (a state dict: see
    :func:`~patchkit.build.dense_patches`), or one patch on its own (pass ``[patch]``).
    ``what`` names the argument in the message.

    With ``ordered`` (for a caller whose result depends on the order: a load, a chunk
    plan, a file), a ``set`` or ``frozenset`` in which two patches share a name is a
    :class:`~patchkit.errors.PatchValueError` (reason ``"unordered"``): a later patch
    wins where two touch the same element, and a set's order is that of its items'
    hashes, which for tensors are their addresses, so it can change from run to run. A
    set of distinct names loads the same in any order and is taken.
    """
    if isinstance(patches, CheckpointWeightPatch) or (  # (whatever its name holds)
            isinstance(patches, tuple) and len(patches) == 5 and isinstance(patches[0], str)):
        raise PatchTypeError(
            f"{what} must be a list of patches, got one patch ({brief(patches[0])}): pass [patch]",
            reason="not a list", value=type(patches).__name__,
        )
    hint = ""
    if hasattr(patches, "keys") and hasattr(patches, "items"):
        hint = _STATE_DICT_HINT
    elif not isinstance(patches, str | bytes):
        try:
            listed = list(patches)  # type: ignore[call-overload]
        except TypeError:
            pass
        else:
            if ordered:
                refuse_unordered_repeats(patches, listed, what)
            return listed
    raise PatchTypeError(
        f"{what} must be a list of patches, got {type(patches).__name__}{hint}",
        reason="not a list", value=type(patches).__name__,
    )


def refuse_unordered_repeats(source: object, listed: list, what: str) -> None:
    """:func:`patch_list`'s check of order: where ``source`` is a ``set`` or
    ``frozenset`` (``listed``: its items, in the order it gave them), a
    :class:`~patchkit.errors.PatchValueError` (reason ``"unordered"``) at the first item
    whose name an earlier one has; ``what`` names ``source`` in the message. Anything
    else passes unread."""
    if not isinstance(source, set | frozenset):
        return
    kind = type(source).__name__
    first: dict[str, int] = {}
    for i, p in enumerate(listed):
        # (a patch, or a plain 5-tuple, with a str name: validation names the others)
        name = _given_name(p) if isinstance(p, tuple) and len(p) == 5 else None
        if name is None:
            continue
        j = first.setdefault(name, i)
        if j != i:
            raise PatchValueError(
                f"{where(i, name)}: {what} came as a {kind}, which has no order, and "
                f"patch {j} has the same name; which of them a load applies last, and so "
                f"which wins where both write, depends on that order, which can change from "
                f"run to run: pass a list, in the order to apply them",
                position=i, name=name, reason="unordered", value=kind,
            )


def _checked_device(device: object, *, allow_meta: bool = False) -> torch.device:
    """``device`` as a :class:`torch.device` this process can put tensors on.

    Raises :class:`~patchkit.errors.PatchTypeError` for a value that is not a ``str`` or
    ``torch.device``, and :class:`~patchkit.errors.PatchValueError` (``reason`` and
    ``value`` set, the message naming the device) for a string torch does not parse,
    ``"meta"`` (no memory to hold values; accepted with ``allow_meta``) and an
    accelerator this machine does not have (e.g. ``"cuda"`` where
    ``torch.cuda.is_available()`` is False, ``"cuda:3"`` with two GPUs, or a device type
    this torch build cannot make tensors on: ``"hip"`` on a CUDA build, ``"xla"``
    without torch_xla).
    """
    if not isinstance(device, (str, torch.device)):
        raise PatchTypeError(
            f"device must be a str or torch.device, got {type(device).__name__} {brief(device)}",
            reason="device type", value=device,
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise PatchValueError(
            f"device {brief(str(device))} is not a torch device ({_first_sentence(e)})",
            reason="bad device", value=device,
        ) from None
    if dev.type == "meta" and not allow_meta:
        raise PatchValueError(
            f"device {brief(str(device))}: the meta device holds no data and patches need "
            "real memory; use 'cpu' or an accelerator",
            reason="meta device", value=device,
        )
    if dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        is_available = getattr(backend, "is_available", None)
        if callable(is_available) and not is_available():
            raise PatchValueError(
                f"device {brief(str(device))} is not available here: "
                f"torch.{dev.type}.is_available() is False",
                reason="device unavailable", value=device,
            )
        device_count = getattr(backend, "device_count", None)
        if dev.index is not None and callable(device_count) and dev.index >= device_count():
            raise PatchValueError(
                f"device {brief(str(device))} is not available here: this machine has "
                f"{device_count()} {dev.type} device(s)",
                reason="device unavailable", value=device,
            )
        try:  # (a device type torch parses but this build or machine cannot hold tensors on:
            # "hip", "xla", "lazy", "hpu", ...; allocates nothing)
            torch.empty(0, device=dev)
        except Exception as e:
            raise PatchValueError(
                f"device {brief(str(device))} is not available here: torch cannot make a tensor "
                f"on it ({type(e).__name__}: {_first_sentence(e)})",
                reason="device unavailable", value=device,
            ) from None
    return dev


def _first_sentence(e: BaseException, most: int = 200) -> str:
    """The first sentence of ``e``'s message (torch's dispatcher errors run to pages),
    cut to ``most`` characters."""
    text = " ".join(str(e).split())
    head = text.split(". ", 1)[0]
    return head if len(head) <= most else head[: most - 3] + "..."


def _given_name(p: object) -> str | None:
    """The name of an item given as a patch, where it has a str one (a malformed patch's
    may be anything, or missing)."""
    name = p[0] if isinstance(p, tuple) and p else None
    return name if isinstance(name, str) else None


def not_a_patch(position: int | None, item: object) -> PatchTypeError:
    """The error for an item of a patch list that is no 5-tuple. A tuple of another
    length is named by its first field where that is a str, and counted: a plain tuple
    needs all five fields (a dense patch written without its ``indices``, which only the
    NamedTuple defaults), and a ``(name, tensor)`` pair is what ``load_weights`` takes,
    not a patch."""
    if not isinstance(item, tuple):
        at = "patch" if position is None else f"patch {position}"
        return PatchTypeError(
            f"{at}: expected a CheckpointWeightPatch "
            f"(name, shape, dtype, values, indices), got {type(item).__name__}",
            position=position, reason="not a patch", value=type(item).__name__,
        )
    name = _given_name(item)
    at = where(position, name) if name is not None else (
        "patch" if position is None else f"patch {position}")
    if len(item) == 2 and isinstance(item[1], torch.Tensor):
        got = ("a (name, tensor) pair, what load_weights takes; "
               "patchkit.dense_patches(dict(pairs)) makes dense patches of such pairs")
    else:
        got = (f"a tuple of {len(item)} items; a plain tuple needs all five (indices None "
               "for a dense patch): pass CheckpointWeightPatch(*item)")
    return PatchTypeError(
        f"{at}: expected a CheckpointWeightPatch (name, shape, dtype, values, indices), "
        f"got {got}",
        position=position, name=name, reason="not a patch", value=len(item),
    )


_NO_FIELD = object()


def _check_metadata(position: int | None, patch: object, *,
                    size: bool = True) -> tuple[int, ...]:
    """The checks of :func:`_check_structure` that read a patch's name, shape and dtype
    only (what :func:`~patchkit.plan_chunks` needs): it is a 5-tuple, the name a non-empty
    str, the dtype a ``torch.dtype``, the shape ints none negative whose bytes stay below
    2**63 (that last one only with ``size``). Returns the shape's dims as ints."""
    if not isinstance(patch, tuple) or len(patch) != 5:
        raise not_a_patch(position, patch)
    if type(patch) is not CheckpointWeightPatch and type(patch) is not tuple and any(
            getattr(patch, f, _NO_FIELD) is not patch[i]
            for i, f in enumerate(CheckpointWeightPatch._fields)):
        # Another 5-tuple (a namedtuple of other fields, a tuple subclass): the loader
        # reads a patch's fields by name, which such a tuple does not have in this order.
        at = "patch" if position is None else f"patch {position}"
        fields = getattr(type(patch), "_fields", None)
        has = f" (its fields: {', '.join(map(str, fields))})" if fields else ""
        raise PatchTypeError(
            f"{at}: expected a CheckpointWeightPatch "
            f"(name, shape, dtype, values, indices), got {type(patch).__name__}{has}; "
            "pass CheckpointWeightPatch(*item) or a plain tuple",
            position=position,
            reason="not a patch",
            value=type(patch).__name__,
        )
    name, shape, dtype = patch[0], patch[1], patch[2]
    if (type(shape) is tuple and type(name) is str and name and type(dtype) is torch.dtype
            and all(type(d) is int and d >= 0 for d in shape)):
        # (the common case, checked in one pass as plan_chunks checks it: a tuple of ints
        # none negative, a name, a dtype; anything else gets each check below in turn)
        if size:
            _check_size(where(position, name), position, name, shape, dtype)
        return shape
    at = where(position, name)
    if not isinstance(name, str):
        raise PatchTypeError(
            f"{at}: name must be a str, got {type(name).__name__}",
            position=position, name=None, reason="name type", value=name,
        )
    if name == "":
        raise PatchValueError(
            f"{at}: name is empty", position=position, name=name, reason="empty name", value=name
        )
    if not isinstance(dtype, torch.dtype):
        raise PatchTypeError(
            f"{at}: dtype must be a torch.dtype, got {brief(dtype)} ({type(dtype).__name__})"
            f"{_dtype_hint(dtype)}",
            position=position, name=name, reason="dtype type", value=dtype,
        )
    if isinstance(shape, Iterator):
        raise PatchTypeError(
            f"{at}: shape must be a tuple of ints, got a {type(shape).__name__} (an iterator "
            "is used up by the first reading of it)",
            position=position, name=name, reason="shape type", value=type(shape).__name__,
        )
    try:
        dims = _shape_dims(shape)
    except TypeError:
        raise PatchTypeError(
            f"{at}: shape must be a tuple of ints, got {brief(shape)}",
            position=position, name=name, reason="shape type", value=shape,
        ) from None
    for d in dims:
        if d < 0:
            raise PatchValueError(
                f"{at}: shape has a negative dimension: {_shape_text(dims)}",
                position=position, name=name, reason="negative dimension", value=d,
            )
    if size:
        _check_size(at, position, name, dims, dtype)
    return dims


def _dtype_hint(dtype: object) -> str:
    """``"; pass torch.bfloat16"`` for a dtype given as its name (``"bfloat16"``,
    ``"torch.bfloat16"``), the commonest way to get it wrong; else nothing."""
    if isinstance(dtype, str):
        attr = dtype.removeprefix("torch.")
        if attr.isidentifier() and isinstance(getattr(torch, attr, None), torch.dtype):
            return f"; pass torch.{attr}"
    return ""


def _as_tensor_hint(value: object) -> str:
    """How to make a tensor of what was given: a list, a tuple or an array (numpy's,
    anything with ``__array__``) converts with ``torch.as_tensor``; else nothing."""
    if isinstance(value, list | tuple) or hasattr(value, "__array__"):
        return " (convert it: torch.as_tensor(...))"
    return ""


def _shape_dims(shape: object) -> tuple[int, ...]:
    """``shape``'s dims as ints (numpy ints too), or :class:`TypeError` when it is no
    ordered iterable of ints (:func:`_ordered`; a ``bool`` is no dim)."""
    dims = tuple(_ordered(shape))
    if any(isinstance(d, bool) for d in dims):
        raise TypeError("bool")
    return tuple(operator.index(d) for d in dims)


def _ordered(shape: object) -> Any:
    """``shape`` itself, or :class:`TypeError` when it is iterable but no shape: a set or
    mapping (no order to its dims) or text (``str``/``bytes``, whose characters or bytes
    would read as dims)."""
    if type(shape) is tuple or type(shape) is torch.Size:  # (the common case, at once)
        return shape
    if isinstance(shape, str | bytes | bytearray | memoryview | AbstractSet | Mapping):
        raise TypeError(type(shape).__name__)
    return shape


def _check_size(at: str, position: int | None, name: str, dims: tuple[int, ...],
                dtype: torch.dtype) -> None:
    if _numel_below(dims, (1 << 63) // dtype.itemsize) is None:
        # torch indexes elements and bytes with int64: no tensor this big can be staged
        why = ("each dimension must stay below 2**63" if any(d >= 1 << 63 for d in dims)
               else "its bytes must stay below 2**63")
        raise PatchValueError(
            f"{at}: shape {_shape_text(dims)} of {dtype} is more than a tensor can hold "
            f"({why})",
            position=position, name=name, reason="shape too large", value=dims,
        )


def _check_structure(position: int | None, patch: object) -> None:
    """CONTRACT §1.2: the cheap per-patch checks, on metadata only (no device work).

    ``position`` names the patch in messages (``None``: a patch on its own, named by its
    name only, as :func:`~patchkit.density.density_map` takes one). The checks of its
    numbers (NaN, out-of-range or duplicate indices, integers that fit) are
    :func:`validate_patches`'."""
    dims = _check_metadata(position, patch, size=False)  # (the size after the values)
    name, _, dtype, values, indices = patch
    at = where(position, name)
    if not isinstance(values, torch.Tensor):
        raise PatchTypeError(
            f"{at}: values must be a torch.Tensor, got {type(values).__name__}"
            f"{_as_tensor_hint(values)}",
            position=position, name=name, reason="values type", value=type(values).__name__,
        )
    if values.is_nested:  # (before its shape: a nested tensor has none to print)
        _refuse_layout(at, position, name, "values", values)
    if values.ndim != 1:
        raise PatchValueError(
            f"{at}: values must be 1-D, got shape {tuple(values.shape)}: a dense patch's "
            "values are the whole tensor flattened row-major (t.flatten()), a sparse one's "
            "the new values at its indices",
            position=position, name=name, reason="values not 1-D", value=tuple(values.shape),
        )
    if values.layout is not torch.strided:
        _refuse_layout(at, position, name, "values", values)
    _check_size(at, position, name, dims, dtype)
    n = math.prod(dims)
    if indices is None:
        if values.numel() != n:
            raise PatchValueError(
                f"{at}: a dense patch needs prod(shape) = {n} values for shape "
                f"{_shape_text(dims)}, got {values.numel()}",
                position=position, name=name, reason="dense count", value=values.numel(),
            )
        if _STAGEABLE.get((values.dtype, dtype, False)) is not True:
            _check_stageable(at, position, name, values.dtype, dtype, sparse=False)
        return
    if not dtype.is_floating_point:
        raise PatchTypeError(
            f"{at}: a sparse patch needs a floating-point dtype (NaN marks 'unchanged'), "
            f"got {dtype}; send this weight dense",
            position=position, name=name, reason="sparse dtype", value=dtype,
        )
    if not isinstance(indices, torch.Tensor):
        raise PatchTypeError(
            f"{at}: indices must be a torch.Tensor or None, got {type(indices).__name__}"
            f"{_as_tensor_hint(indices)}",
            position=position, name=name, reason="indices type", value=type(indices).__name__,
        )
    if indices.is_nested:
        _refuse_layout(at, position, name, "indices", indices)
    if indices.ndim != 1:
        raise PatchValueError(
            f"{at}: indices must be 1-D, got shape {tuple(indices.shape)}: they are flat "
            "positions into the whole tensor, row-major (element [r, c] of a 2-D weight "
            "is r * shape[1] + c)",
            position=position, name=name, reason="indices not 1-D", value=tuple(indices.shape),
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise PatchTypeError(
            f"{at}: indices must be int32 or int64, got {indices.dtype}",
            position=position, name=name, reason="indices dtype", value=indices.dtype,
        )
    if indices.layout is not torch.strided:
        _refuse_layout(at, position, name, "indices", indices)
    if indices.numel() != values.numel():
        raise PatchValueError(
            f"{at}: {indices.numel()} indices but {values.numel()} values",
            position=position, name=name, reason="length mismatch", value=indices.numel(),
        )
    if _STAGEABLE.get((values.dtype, dtype, True)) is not True:
        _check_stageable(at, position, name, values.dtype, dtype, sparse=True)
    if indices.is_meta and not values.is_meta:
        # Staged on the values' device, the patch needs its positions, which meta indices
        # do not hold (meta values with real indices stage on the meta device: a dry run).
        raise PatchValueError(
            f"{at}: indices are on the meta device, which holds no positions, but values "
            f"are on {values.device}, where the patch is staged; put both on the meta "
            "device for a dry run",
            position=position, name=name, reason="meta device", value=indices.device,
        )


def _refuse_layout(at: str, position: int, name: str, what: str, t: torch.Tensor) -> None:
    """A patch tensor must be a plain strided tensor, not a torch.sparse or nested one.
    (Meta tensors pass: a model on the meta device loads them, e.g. to plan chunks.)"""
    got = f"a nested tensor (layout {t.layout})" if t.is_nested else f"layout {t.layout}"
    raise PatchTypeError(
        f"{at}: {what} must be a dense (strided) tensor, got {got}",
        position=position, name=name, reason=f"{what} layout", value=t.layout,
    )


def _is_integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _numel_below(dims: Sequence[int], limit: int) -> int | None:
    """The product of ``dims`` when it is below ``limit``, else ``None``; it stops as soon
    as the product reaches the limit (a long list of dims costs no big-integer work).
    A dimension of ``2**63`` or more is ``None`` too, even beside a 0: torch keeps each
    size in an int64, so no tensor has that shape, empty or not."""
    if 0 in dims:
        return None if any(d >= 1 << 63 for d in dims) else 0
    n = 1
    for d in dims:
        n *= d
        if n >= limit:
            return None
    return n


def _int_text(d: int) -> str:
    """``d`` in decimal, or its size in bits when it has more than 64 (Python refuses to
    print ints of more than 4300 digits)."""
    return str(d) if d.bit_length() <= 64 else f"<a {d.bit_length()}-bit int>"


def _shape_text(shape: Sequence[int], most: int = 8) -> str:
    """A shape (of ints) as a message shows it: a tuple, shortened: at most ``most`` dims
    are printed (the first ones and the last, with the count of dims), huge dims by
    their size in bits."""
    if len(shape) <= most:
        dims = [_int_text(d) for d in shape]
        return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
    dims = [_int_text(d) for d in shape[: most - 1]]
    return f"({', '.join(dims)}, ..., {_int_text(shape[-1])}; {len(shape)} dims)"


def _may_not_fit(values: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether values of dtype ``values`` can hold numbers that integer ``dtype`` cannot
    (floating values; integers of a wider or differently signed range)."""
    if values.is_floating_point:
        return True
    if not _is_integral(values) or values == dtype:
        return False
    have, want = torch.iinfo(values), torch.iinfo(dtype)
    return have.min < want.min or have.max > want.max


def _check_fits_integers(position: int, patch: CheckpointWeightPatch) -> None:
    """The values of an integer patch must be numbers its dtype holds: a cast does not
    refuse the others, it writes an arbitrary integer (NaN, infinity or 1e20 into int32
    is -2147483648) or wraps (3e9 into int32 is -1294967296, 300 into uint8 is 44).
    Floating values are truncated toward zero, as a cast does; they must be finite and
    truncate into ``[min, max]`` of the dtype (``(min - 1, max + 1)``: int8 takes -128.5
    and 127.5). One pass, only for values that may not fit."""
    info = torch.iinfo(patch.dtype)
    v = patch.values
    if v.is_floating_point():
        if v.element_size() == 1:
            v = v.float()  # the 8-bit floats have no comparison kernels: exact in float32
        # (min and max + 1 are powers of two: exact in every float dtype that reaches them)
        fits = torch.isfinite(v) & (torch.trunc(v) >= info.min) & (v < float(info.max) + 1.0)
    elif v.dtype == torch.uint64:
        # no comparison kernels for uint64: its bits as int64, where the numbers from 2**63
        # on read negative (and fit no other integer dtype: only uint64 holds them)
        as_signed = v.view(torch.int64)
        fits = (as_signed >= 0) & (as_signed <= min(info.max, 2**63 - 1))
    else:
        if v.dtype in (torch.uint16, torch.uint32):
            v = v.to(torch.int64)  # exact; torch compares neither
        # bounds inside the values' own range, so that each scalar is one of its numbers
        have = torch.iinfo(v.dtype)
        fits = (v >= max(info.min, have.min)) & (v <= min(info.max, have.max))
    if bool(fits.all()):
        return
    k = int(torch.nonzero(~fits.reshape(-1))[0, 0])
    bad = v.reshape(-1)[k].item()
    finite = not v.is_floating_point() or math.isfinite(bad)
    why = (f"is outside {patch.dtype}'s range [{info.min}, {info.max}]" if finite
           else f"has no {patch.dtype} value")
    raise PatchValueError(
        f"{where(position, patch.name)}: value {bad} at values[{k}] {why} (the cast would "
        "write an arbitrary integer)",
        position=position, name=patch.name, reason="out-of-range" if finite else "not finite",
        value=bad,
    )


# (values dtype, patch dtype, sparse) -> True, or why such values cannot be staged: found
# once per combination by staging one CPU element (see _check_stageable).
_STAGEABLE: dict[tuple[torch.dtype, torch.dtype, bool], bool | str] = {}


def _check_stageable(at: str, position: int, name: str, src: torch.dtype, dst: torch.dtype,
                     *, sparse: bool) -> None:
    """The values' dtype must cast to the patch's (quantized, bit and packed float4
    dtypes do not; complex values do not cast to a real dtype, which would drop their
    imaginary part; a sparse patch's dtype must also hold NaN), checked before any load
    so that no call is made first."""
    why = _STAGEABLE.get((src, dst, sparse))
    if why is None and src.is_complex and not dst.is_complex:
        why = "the cast would drop the imaginary part"
        _STAGEABLE[(src, dst, sparse)] = why
    if why is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized dtypes warn before they fail
                torch.zeros(1, dtype=src, device="cpu").to(dst)
                if sparse and not torch.isnan(  # (float8's full came in torch 2.6)
                        torch.tensor([float("nan")], device="cpu").to(dst).to(torch.float32)).all():
                    raise TypeError(f"{dst} holds no NaN")
            why = True
        except (RuntimeError, NotImplementedError, TypeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        _STAGEABLE[(src, dst, sparse)] = why
    if why is not True:
        raise PatchTypeError(
            f"{at}: values of dtype {src} cannot be staged as a {dst} tensor ({why})",
            position=position, name=name, reason="unstageable dtype", value=dst,
        )


# Per-patch flags computed on the device in one pass; the host reads them once per device.
_NAN, _OOB, _DUP = 0, 1, 2
_REASONS = ("NaN", "out-of-range", "duplicate")


def _sparse_flags(patch: CheckpointWeightPatch, unique: bool, nan_free: bool = False
                  ) -> torch.Tensor:
    """Three booleans (NaN, out-of-range, duplicate) on the device of ``patch.values``.

    No host synchronisation happens here on an accelerator: the caller stacks the flags
    of all patches on one device and reads them with a single transfer. ``nan_free``: the
    caller found no NaN in the values of the CPU patches that :func:`_nan_free_at_once`
    reads, this one's among them if it is one of those.
    """
    values, indices = patch.values, patch.indices
    device = values.device
    n = numel(patch)
    # Asynchronous only towards an accelerator: a device-to-host copy must be waited for.
    # (Not asked for where it changes nothing: a torch call, on every small patch.)
    idx = (indices if indices.dtype == torch.int64 and indices.device == device else
           indices.to(device=device, dtype=torch.int64, non_blocking=device.type != "cpu"))
    if nan_free and _read_at_once(patch):
        # (read with the other patches' values; a patch read so has few indices, on the
        # CPU: it takes the path of a list of ints below, which reads this as a bool)
        has_nan = False
    else:
        # Check the values as they will be staged: a finite value (an integer too) can
        # become NaN in the cast (float8 "fnuz" types overflow to NaN) and would then
        # silently mean "keep". (A sparse patch's dtype is floating point: integer or
        # bool values are always cast.)
        cast = values if values.dtype == patch.dtype else values.to(patch.dtype)
        has_nan = nan_mask(cast).any()
    if not host_waits(device) and idx.numel() <= _READ_AS_INTS:
        # On the CPU a short index list costs less read as Python ints than checked with
        # torch ops (a few microseconds each, most of a small patch's check): the same
        # flags (a duplicate is looked for only where no index is out of range, which is
        # the flag that reports first).
        ints = idx.tolist()
        oob = bool(ints) and (min(ints) < 0 or max(ints) >= n)
        dup = unique and not oob and len(set(ints)) != len(ints)
        return _flag_row(bool(has_nan), oob, dup)
    oob = ((idx < 0) | (idx >= n)).any()
    if not unique or idx.numel() < 2 or n == 0:
        # n == 0: every index is out of range (flagged above); nothing to mark.
        dup = torch.zeros((), dtype=torch.bool, device=device)
    elif not host_waits(device) and bool((idx[1:] > idx[:-1]).all()):
        # Strictly increasing (as torch.nonzero and most builders give them): no
        # duplicate, seen in one pass over the indices instead of a sort or a mark per
        # element of the tensor. (On the CPU reading the answer costs no wait; on a GPU
        # it would cost one per patch.)
        dup = torch.zeros((), dtype=torch.bool, device=device)
    elif _sort_is_cheaper(idx.numel(), n):
        s = torch.sort(idx).values
        dup = (s[1:] == s[:-1]).any()
    else:
        # A mark per element of the full tensor: O(numel) bytes, no sort. Indices are
        # clamped so that an out-of-range index (already flagged) cannot fault a kernel.
        marks = native.fresh_empty((n,), torch.bool, device).zero_()  # huge pages on CPU
        # index_fill_ takes the scalar as is; `marks[i] = True` would copy a host tensor
        # holding True to the device for every patch, and that copy waits for the device.
        marks.index_fill_(0, idx.clamp(0, n - 1), True)
        dup = count_true(marks) != idx.numel()  # bool .sum() would upcast
    return torch.stack((has_nan, oob, dup))


# Up to this many indices, the CPU checks them as a list of ints (see _sparse_flags).
_READ_AS_INTS = 128
# The value dtypes whose NaN check the CPU makes for many small patches at once (torch's
# cat and isnan take them in every torch patchkit supports), and how many patches' values
# one such check joins: at most 16384 values, below the size at which torch splits an op
# over threads (whose OpenMP workers then spin, taking a core from the load meanwhile).
_AT_ONCE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_AT_ONCE_PATCHES = 16384 // _READ_AS_INTS


def _read_at_once(patch: CheckpointWeightPatch) -> bool:
    """Whether :func:`_nan_free_at_once` reads this (CPU) patch's values: a plain tensor
    of at most ``_READ_AS_INTS`` values held in the patch's own dtype, one of
    ``_AT_ONCE_DTYPES`` (where a cast, and its NaN, would come first, each is checked
    on its own)."""
    v = patch.values
    return (v.dtype == patch.dtype and v.dtype in _AT_ONCE_DTYPES
            and type(v) in _PLAIN and v.numel() <= _READ_AS_INTS)


def _nan_free_at_once(patches: Sequence[CheckpointWeightPatch]) -> bool:
    """Whether no NaN is among the values of the (CPU) ``patches`` that
    :func:`_read_at_once` takes, read with one ``isnan`` per dtype and
    ``_AT_ONCE_PATCHES`` patches: a check per patch costs a few microseconds of torch
    overhead, most of a small patch's checks. ``False`` where one holds a NaN: each patch
    is then checked on its own, which finds it."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in patches:
        if _read_at_once(p):
            by_dtype.setdefault(p.values.dtype, []).append(p.values)
    return not any(
        bool(torch.isnan(torch.cat(vs[k:k + _AT_ONCE_PATCHES])).any())
        for vs in by_dtype.values() for k in range(0, len(vs), _AT_ONCE_PATCHES))


@functools.cache
def _flag_row(has_nan: bool, oob: bool, dup: bool) -> torch.Tensor:
    """The CPU tensor of :func:`_sparse_flags` for flags known on the host (one of eight,
    made once, on the CPU whatever the default device: the caller only stacks it)."""
    return torch.tensor((has_nan, oob, dup), device="cpu")


def _sort_is_cheaper(nnz: int, n: int) -> bool:
    # Sorting costs ~nnz*log2(nnz) element moves; marking costs a pass over all n elements
    # (fill, scatter, reduce). The constant favours marking: a sort moves 8-byte keys.
    return nnz * max(1, nnz.bit_length()) * 4 < n


def _first_nan_entry(patch: CheckpointWeightPatch) -> int:
    """The failure path only: the position in ``values`` of the first entry that is NaN in
    the patch's dtype (its index may repeat at other, non-NaN entries)."""
    cast = patch.values.to(patch.dtype).float()
    return int(torch.nonzero(torch.isnan(cast))[0, 0])


def _first_offending_index(patch: CheckpointWeightPatch, reason: str) -> int:
    """The failure path only: find one offending index (or value position) of ``reason``."""
    values, indices = patch.values, patch.indices
    idx = indices.to(device=values.device, dtype=torch.int64)
    if reason == "NaN":
        return int(idx[_first_nan_entry(patch)])
    if reason == "out-of-range":
        pos = int(torch.nonzero((idx < 0) | (idx >= numel(patch)))[0, 0])
        return int(idx[pos])
    s = torch.sort(idx).values
    pos = int(torch.nonzero(s[1:] == s[:-1])[0, 0])
    return int(s[pos])


def check_max_chunk_bytes(max_chunk_bytes: object) -> int:
    """CONTRACT §1.1: the budget, as an int, when it is a positive whole number of bytes.

    A number that is not positive raises ``ValueError`` (the contract's case, whatever
    its type: ``0``, ``-1.0``); ``bool`` and non-numbers raise ``TypeError``. Any other
    integer (a numpy ``int64``, say) and a float of whole value (``1e9``) are taken, as
    vLLM's loader takes them; a fraction (``1.5``), infinity and NaN raise ``ValueError``.
    """
    if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, numbers.Real):
        raise PatchTypeError(
            f"max_chunk_bytes must be a positive int, got {type(max_chunk_bytes).__name__}: "
            f"{brief(max_chunk_bytes)}",
            reason="max_chunk_bytes type", value=max_chunk_bytes,
        )
    if not max_chunk_bytes > 0:  # (NaN too)
        raise PatchValueError(
            f"max_chunk_bytes must be positive, got {brief(max_chunk_bytes, text=True)}",
            reason="max_chunk_bytes", value=max_chunk_bytes,
        )
    if isinstance(max_chunk_bytes, numbers.Integral):
        return int(max_chunk_bytes)
    if isinstance(max_chunk_bytes, numbers.Rational) and max_chunk_bytes.denominator == 1:
        return int(max_chunk_bytes.numerator)  # (exact: Fraction(10**400) has no float)
    try:
        as_float = float(max_chunk_bytes)
    except OverflowError:  # a whole or fractional number beyond float's range
        as_float = math.inf if max_chunk_bytes == math.floor(max_chunk_bytes) else math.nan
    if not (math.isfinite(as_float) and as_float.is_integer()):
        hint = " (for no limit, pass an int larger than the patches, e.g. 1 << 62)" if (
            as_float == math.inf) else ""
        raise PatchValueError(
            f"max_chunk_bytes must be a whole number of bytes, got "
            f"{brief(max_chunk_bytes, text=True)}{hint}",
            reason="max_chunk_bytes", value=max_chunk_bytes,
        )
    return int(as_float)


def check_flag(value: object, what: str) -> bool:
    """``value`` when it is a ``bool``; else :class:`~patchkit.errors.PatchTypeError`
    naming the argument ``what`` (``reason`` ``"<what> type"``, ``value`` the value).

    A flag is ``True`` or ``False`` only: ``None``, ``0``/``1``, a string (``"no"`` is
    truthy) and numpy's ``bool_`` raise, so that a misspelt value cannot pick a mode
    silently. Callers check their flags before they read or change anything.
    """
    if isinstance(value, bool):
        return value
    raise PatchTypeError(
        f"{what} must be True or False, got {type(value).__name__}: {brief(value)}",
        reason=f"{what} type", value=value,
    )


def validate_patches(
    patches: Sequence[CheckpointWeightPatch],
    *,
    max_chunk_bytes: int | None = None,
    validate_unique_indices: bool = True,
    positions: Sequence[int | None] | None = None,
) -> str | None:
    """Run every check of CONTRACT §1, in the contract's order; return the call's kind.

    Returns ``"dense"``, ``"sparse"`` or ``None`` for an empty list. Raises
    :class:`~patchkit.errors.PatchValueError` / :class:`~patchkit.errors.PatchTypeError`
    naming the first offending patch (its position in ``positions``, default the input
    order; ``None`` names it by name only), the reason and one offending value. The
    sparse value checks (NaN, out-of-range, duplicate) run on the device that holds each
    patch's values, and the host waits once per device; the search for an offending
    index happens only after that combined check has failed. Patches whose values or
    indices are on the meta device (a dry run: they hold no numbers) pass the checks of
    their values unchecked.
    ``validate_unique_indices`` must be a bool (:func:`check_flag`); ``patches`` a
    collection of patches (one patch on its own, a ``str`` or a mapping is refused as
    :func:`patch_list` says).
    """
    check_flag(validate_unique_indices, "validate_unique_indices")
    if not isinstance(patches, list):
        patches = patch_list(patches)
    if positions is None:
        positions = range(len(patches))
    if max_chunk_bytes is not None:
        check_max_chunk_bytes(max_chunk_bytes)
    for pos, patch in zip(positions, patches):
        _check_structure(pos, patch)
    if not patches:
        return None
    sparse = [is_sparse(p) for p in patches]
    if any(sparse) and not all(sparse):
        first_dense = next(i for i, s in enumerate(sparse) if not s)
        first_sparse = next(i for i, s in enumerate(sparse) if s)
        i = max(first_dense, first_sparse)
        kind = "dense" if i == first_dense else "sparse"
        raise PatchValueError(
            f"{where(positions[i], patches[i].name)}: dense and sparse patches cannot be "
            f"mixed in one call (patch {positions[min(first_dense, first_sparse)]} is "
            f"{'sparse' if kind == 'dense' else 'dense'}, this one is {kind}); "
            "split them into two calls",
            position=positions[i], name=patches[i].name, reason="mixed", value=kind,
        )
    if not sparse[0]:
        for pos, p in zip(positions, patches):
            if (_is_integral(p.dtype) and _may_not_fit(p.values.dtype, p.dtype)
                    and not p.values.is_meta):
                _check_fits_integers(pos, p)
        return "dense"

    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(patches):
        if not (p.values.is_meta or p.indices.is_meta):
            by_device.setdefault(p.values.device, []).append(i)
    first_bad: tuple[int, str] | None = None
    for device, members in by_device.items():
        # (on the CPU, small patches' values are read for NaN together first)
        nan_free = not host_waits(device) and _nan_free_at_once([patches[i] for i in members])
        flags = torch.stack([_sparse_flags(patches[i], validate_unique_indices, nan_free)
                             for i in members])
        flags = flags.cpu()  # the one host wait for this device
        if not bool(flags.any()):
            continue
        for row, i in enumerate(members):
            hit = flags[row].nonzero()
            if hit.numel():
                cand = (i, _REASONS[int(hit[0, 0])])
                if first_bad is None or cand[0] < first_bad[0]:
                    first_bad = cand
                break
    if first_bad is not None:
        i, reason = first_bad
        p = patches[i]
        bad = _first_offending_index(p, reason)
        nan_text = ""
        if reason == "NaN":
            entry = _first_nan_entry(p)
            nan_text = f"NaN value at index {bad}, values[{entry}]"
            if p.values.dtype != p.dtype:
                v = p.values[entry]
                if not bool(torch.isnan(v.float())):
                    nan_text += f": {float(v)!r} becomes NaN when cast to {p.dtype}"
        text = {
            "NaN": f"{nan_text} (NaN means 'unchanged', so it cannot be sent sparsely; "
            "send this weight dense)",
            "out-of-range": f"out-of-range index {bad} for shape "
            f"{_shape_text(_shape_dims(p.shape))} "
            f"({numel(p)} elements)",
            "duplicate": f"duplicate index {bad} (it appears more than once)",
        }[reason]
        raise PatchValueError(
            f"{where(positions[i], p.name)}: {text}",
            position=positions[i], name=p.name, reason=reason, value=bad,
        )
    return "sparse"
