"""Making patches: dense from a state dict, sparse from a bit-level diff, random sparse
patches of a given density, splitting one patch into several, and a realistic
optimizer-step generator for RL weight-sync experiments.

Imports torch only. Every function returns :class:`~patchkit.CheckpointWeightPatch`
records that pass :func:`patchkit.patch.validate_patches`.

Choices a caller can rely on:

- A bit-level diff treats an element as changed when its bits differ, so ``0.0 -> -0.0``
  is a change and two NaNs with the same payload are equal.
- Sparse patches carry *new absolute values* (never deltas) and sorted, unique indices.
- A weight whose changed elements include a NaN cannot travel sparsely (NaN means
  "unchanged" in a staged tensor): :func:`sparse_patches_from_diff` raises and says to
  send those weights dense.
- Index dtype: :func:`sparse_patches_from_diff` gives ``torch.int32`` by default,
  :func:`random_sparse_patch` ``torch.int64``, and :func:`split_patch` keeps a sparse
  patch's own (int32 where it fits for the parts of a dense one); asking for int32 for
  a tensor whose largest flat position does not fit (more than ``2**31`` elements)
  raises :class:`~patchkit.errors.PatchValueError`; ``index_dtype=None`` picks int32
  where it fits and int64 elsewhere.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import torch

from .bitwise import (
    _not_plain,
    bits,
    changed_mask,
    count_true,
    has_numbers,
    nan_mask,
    select,
)
from .density import _is_int, grid_shape
from .errors import PatchTypeError, PatchValueError, brief, quoted, where
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _check_size,
    _check_structure,
    _checked_device,
    _shape_dims,
    _shape_text,
    check_flag,
    not_a_patch,
    numel,
    patch_list,
    validate_patches,
)
from .units import _count

__all__ = [
    "AdamLikeTrainer",
    "changed_fraction",
    "dense_patches",
    "random_sparse_patch",
    "sparse_patches_from_diff",
    "split_patch",
    "wire_bytes",
]

_INT32_MAX = 2**31 - 1


Pattern = Literal["uniform", "rows", "blocks"]
_PATTERNS = ("uniform", "rows", "blocks")


# --------------------------------------------------------------------------- helpers


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous 1-D tensor (a view when ``t`` is already contiguous)."""
    return t.detach().contiguous().reshape(-1)


def _real_float(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating-point dtype torch computes with: not the packed
    ``float4_e2m1fn_x2``, which has no NaN (so no sparse patch: the loader refuses it)
    and no arithmetic (so nothing to train)."""
    return dtype.is_floating_point and has_numbers(dtype)


def _sparse_dtype_text(dtype: object) -> str:
    """Why ``dtype`` cannot be a sparse patch's dtype, for a message."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return f"{dtype} is a packed format with no NaN"
    return f"got {brief(dtype)}"


def _index_dtype_for(n: int, index_dtype: torch.dtype | None, name: str) -> torch.dtype:
    """The index dtype for a tensor of ``n`` elements (see the module docstring)."""
    fits32 = n - 1 <= _INT32_MAX
    if index_dtype is None:
        return torch.int32 if fits32 else torch.int64
    if index_dtype == torch.int32 and not fits32:
        raise PatchValueError(
            f"weight {quoted(name)} has {n} elements: its flat positions do not fit in int32; "
            "pass index_dtype=torch.int64 (or None to use int64 only where needed)",
            name=name, reason="index dtype", value=n,
        )
    return index_dtype


def _check_index_dtype(index_dtype: object, *, allow_none: bool) -> None:
    ok = index_dtype in (torch.int32, torch.int64) or (allow_none and index_dtype is None)
    if not ok:
        raise PatchTypeError(
            f"index_dtype must be torch.int32 or torch.int64"
            f"{' or None' if allow_none else ''}, got {brief(index_dtype)}",
            reason="index dtype", value=index_dtype,
        )


def _as_patch(p: object) -> object:
    """A plain 5-tuple becomes a CheckpointWeightPatch; anything else is left for validation."""
    if isinstance(p, tuple) and not isinstance(p, CheckpointWeightPatch) and len(p) == 5:
        return CheckpointWeightPatch(*p)
    return p


def _check_name(name: object, what: str = "name") -> str:
    """A patch name: a non-empty str (``PatchTypeError`` / ``PatchValueError`` otherwise)."""
    if not isinstance(name, str):
        raise PatchTypeError(f"{what} must be a str, got {type(name).__name__}: {brief(name)}",
                             reason="name type", value=name)
    if not name:
        raise PatchValueError(f"{what} is empty", reason="empty name", value=name)
    return name


def _check_same_names(before: Mapping[str, torch.Tensor],
                      after: Mapping[str, torch.Tensor], shown: int = 5) -> None:
    """``PatchValueError`` (reason ``"names differ"``, ``name`` the first such weight,
    ``value`` both lists in full) when ``before`` and ``after`` name different weights;
    the message lists the first ``shown`` of each side."""
    missing = [k for k in before if k not in after]
    extra = [k for k in after if k not in before]
    if not (missing or extra):
        return

    def listed(names: list[str]) -> str:
        more = len(names) - shown
        return f"[{', '.join(map(quoted, names[:shown]))}]" + (
            f" and {more} more" if more > 0 else "")

    raise PatchValueError(
        "before and after name different weights: "
        f"only in before: {listed(missing)}; only in after: {listed(extra)}",
        name=(missing or extra)[0], reason="names differ", value=(missing, extra),
    )


def _check_mapping(d: object, what: str, *, plain: bool = False) -> Mapping[str, torch.Tensor]:
    """``d`` as a mapping of names to tensors, every key a non-empty str and every value
    a tensor (``PatchTypeError`` / ``PatchValueError`` naming the entry otherwise); with
    ``plain``, every tensor also a plain (strided, not nested) one (:func:`_check_layout`)."""
    if not isinstance(d, Mapping):
        raise PatchTypeError(
            f"{what} must be a mapping of names to tensors (a state dict), got "
            f"{type(d).__name__}", reason=f"{what} type", value=type(d).__name__,
        )
    for name, t in d.items():
        _check_name(name, f"a key of {what}")
        if not isinstance(t, torch.Tensor):
            raise PatchTypeError(
                f"{what}[{quoted(name)}] must be a torch.Tensor, got {type(t).__name__}",
                name=name, reason="values type", value=type(t).__name__,
            )
        if plain:
            _check_layout(name, f"{what}[{quoted(name)}]", t)
    return d


def _check_layout(name: str, what: str, t: torch.Tensor) -> None:
    """``PatchTypeError`` naming ``what`` (the weight ``name``'s tensor) when ``t`` is not
    a plain strided tensor: a nested one, or torch.sparse / mkldnn layouts."""
    got = _not_plain(t)
    if got is not None:
        raise PatchTypeError(
            f"weight {quoted(name)}: {what} is {got}; only plain (strided) tensors are taken "
            "(for torch.sparse, pass t.to_dense())",
            name=name, reason="layout", value=t.layout,
        )


def _check_same_kind(name: str, b: torch.Tensor, a: torch.Tensor) -> None:
    """Weight ``name``'s tensors ``b`` (before) and ``a`` (after) must have one shape and
    one dtype: ``PatchValueError`` (reason ``"shape differs"`` or ``"dtype differs"``)
    naming the weight and both otherwise."""
    if tuple(b.shape) != tuple(a.shape):
        raise PatchValueError(
            f"weight {quoted(name)} changed shape: before {tuple(b.shape)}, "
            f"after {tuple(a.shape)}",
            name=name, reason="shape differs", value=(tuple(b.shape), tuple(a.shape)),
        )
    if b.dtype != a.dtype:
        raise PatchValueError(
            f"weight {quoted(name)} changed dtype: before {b.dtype}, after {a.dtype}",
            name=name, reason="dtype differs", value=(b.dtype, a.dtype),
        )


def _check_comparable(before: Mapping[str, torch.Tensor],
                      after: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of the two dicts must have values to compare: a plain (strided,
    non-nested) tensor not on the meta device (``PatchTypeError`` for another layout,
    ``PatchValueError`` for meta, naming the weight and the dict)."""
    for what, d in (("before", before), ("after", after)):
        for name, t in d.items():
            _check_layout(name, what, t)
            if t.is_meta:
                raise PatchValueError(
                    f"weight {quoted(name)}: {what} is on the meta device, which holds no values "
                    "to compare",
                    name=name, reason="meta device", value=t.device,
                )


_DIFF_BLOCK = 1 << 22


def _pieces(b: torch.Tensor, a: torch.Tensor) -> Iterator[tuple[int, torch.Tensor,
                                                                torch.Tensor]]:
    """``(flat offset, piece of b, piece of a)`` covering two same-shape tensors in
    row-major order, at most ``_DIFF_BLOCK`` elements a piece (flat ranges of contiguous
    tensors; otherwise blocks of whole rows, or each row in pieces where one row is
    longer), so that a diff's masks and positions are held for one piece at a time,
    never for the whole tensor."""
    n = a.numel()
    if n <= _DIFF_BLOCK:
        yield 0, b, a
        return
    if a.is_contiguous() and b.is_contiguous():
        fa, fb = a.reshape(-1), b.reshape(-1)
        for lo in range(0, n, _DIFF_BLOCK):
            yield lo, fb[lo : lo + _DIFF_BLOCK], fa[lo : lo + _DIFF_BLOCK]
        return
    per_row = n // a.shape[0]
    if per_row > _DIFF_BLOCK:  # rows too long for one piece: each row in pieces
        for r in range(a.shape[0]):
            for lo, pb, pa in _pieces(b[r], a[r]):
                yield r * per_row + lo, pb, pa
        return
    step = _DIFF_BLOCK // per_row
    for r in range(0, a.shape[0], step):
        yield r * per_row, b[r : r + step], a[r : r + step]


def _check_shape(shape: object, name: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0 (``PatchTypeError`` for anything but an iterable
    of ints, ``PatchValueError`` for a negative dimension)."""
    try:
        dims = _shape_dims(shape)
    except TypeError:
        raise PatchTypeError(f"weight {quoted(name)}: shape must be a tuple of ints, got "
                             f"{brief(shape)}", name=name, reason="shape type",
                             value=shape) from None
    if any(d < 0 for d in dims):
        raise PatchValueError(f"weight {quoted(name)}: shape has a negative dimension: "
                              f"{_shape_text(dims)}",
                              name=name, reason="negative dimension", value=dims)
    return dims


def _check_int(value: object, what: str, minimum: int, below: int | None = None) -> int:
    """``value`` as an int (a numpy int too, not a bool) in ``[minimum, below)``:
    ``PatchTypeError`` for anything else, ``PatchValueError`` out of range."""
    if not _is_int(value):
        raise PatchTypeError(
            f"{what} must be an int, got {type(value).__name__}", reason=what, value=value
        )
    value = int(value)
    if value < minimum:
        raise PatchValueError(f"{what} must be >= {minimum}, got {brief(value)}", reason=what,
                              value=value)
    if below is not None and value >= below:
        raise PatchValueError(f"{what} must be < {below}, got {brief(value)}", reason=what,
                              value=value)
    return value


def _check_real(value: object, what: str, minimum: float, *, strict: bool = False,
                below: float | None = None) -> float:
    """``value`` as a finite float >= ``minimum`` (> with ``strict``; < ``below`` when
    given); ``PatchTypeError`` for a non-number, ``PatchValueError`` out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PatchTypeError(f"{what} must be a number, got {type(value).__name__}: {brief(value)}",
                             reason=what, value=value)
    try:
        v = float(value)
    except OverflowError:  # (an int or fraction beyond float's range: no finite float)
        v = math.inf
    bad = not math.isfinite(v) or v < minimum or (strict and v == minimum) or (
        below is not None and v >= below)
    if bad:
        want = f"{'>' if strict else '>='} {minimum}" + (f" and < {below}" if below else "")
        raise PatchValueError(f"{what} must be a finite number {want}, got {brief(value)}",
                              reason=what, value=value)
    return v


# --------------------------------------------------------------------------- dense


def dense_patches(
    state_dict: Mapping[str, torch.Tensor], *, clone: bool = False
) -> list[CheckpointWeightPatch]:
    """One dense patch per entry of ``state_dict``, in the dict's order.

    Each patch has the tensor's shape and dtype and its values flattened row-major. The
    values are a view of the tensor when it is contiguous (no copy) unless ``clone`` is
    True; pass ``clone=True`` when the tensors will be modified in place before the patches
    are used. Tensors keep their device.

    ``state_dict`` must be a mapping of non-empty str names to tensors:
    :class:`~patchkit.errors.PatchTypeError` / :class:`~patchkit.errors.PatchValueError`
    name the entry otherwise, before any patch is made; ``clone`` must be a bool
    (``PatchTypeError``).
    """
    check_flag(clone, "clone")
    _check_mapping(state_dict, "state_dict", plain=True)
    out: list[CheckpointWeightPatch] = []
    for name, t in state_dict.items():
        values = _flat(t)
        if clone:
            values = values.clone()
        out.append(CheckpointWeightPatch(name, tuple(t.shape), t.dtype, values))
    return out


# --------------------------------------------------------------------------- sparse diff


def sparse_patches_from_diff(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    *,
    index_dtype: torch.dtype | None = torch.int32,
) -> list[CheckpointWeightPatch]:
    """Sparse patches that turn ``before`` into ``after``, found by comparing bits.

    What a caller can rely on:

    - An element is changed when its bits differ (tensors are viewed as same-width
      integers): ``0.0 -> -0.0`` is a change; equal values with equal bits are not; two
      NaNs with the same payload are equal. Infinities and subnormals travel bit-exact.
    - One patch per weight that has at least one changed element, in ``after``'s key
      order. Its values are the new values (taken from ``after``, in ``after``'s dtype) and
      its indices the sorted flat positions of the changed elements.
    - ``index_dtype`` (default ``torch.int32``): int32 for a tensor with more than
      ``2**31`` elements raises :class:`~patchkit.errors.PatchValueError` (before any
      diff is computed); ``None`` picks int32 where it fits, int64 elsewhere.
    - ``before`` is moved to the device of ``after`` where they differ (a piece at a
      time); patches live on ``after``'s device.
    - Memory: beyond the patches themselves, a weight's diff holds scratch for about
      4 M elements at a time (a mask and its positions: under 40 MiB), whatever its size
      or layout, and its patch twice while the pieces' parts are joined; a transposed or
      sliced view is never copied whole.

    ``before`` and ``after`` must be mappings of non-empty str names to plain tensors
    (:class:`~patchkit.errors.PatchTypeError` / ``PatchValueError`` name the entry
    otherwise, before any diff is computed: a torch.sparse or nested tensor, or one on
    the meta device, which has no values). Raises
    :class:`~patchkit.errors.PatchValueError` (a ``ValueError``) when the two
    dicts name different weights, or a weight's shape or dtype differs (naming the weight
    and both values), and when changed elements have NaN as their new value (NaN is the
    "unchanged" sentinel of a sparse load): the message names every such weight with its
    count and says to send those weights dense. Raises
    :class:`~patchkit.errors.PatchTypeError` (a ``TypeError``) when a weight with a
    non-floating dtype (an integer buffer, say) or the packed ``float4_e2m1fn_x2``
    changed: a sparse patch needs a dtype that has NaN, so send it dense. Unchanged
    weights of such dtypes are skipped silently.

    Warns (``UserWarning``) when every weight of ``before`` shares memory with the same
    weight of ``after``: the diff is then empty whatever the trainer did (a trainer that
    updates its tensors in place, with ``prev = new`` kept as a reference, not a copy).
    Some weights shared and others not (``{**before, name: new_weight}``) is no such
    mistake: no warning.
    """
    _check_index_dtype(index_dtype, allow_none=True)
    _check_mapping(before, "before")
    _check_mapping(after, "after")
    _check_same_names(before, after)
    _check_comparable(before, after)
    plan: list[tuple[str, torch.Tensor, torch.Tensor, torch.dtype]] = []
    for name, a in after.items():
        b = before[name]
        _check_same_kind(name, b, a)
        idx_dtype = _index_dtype_for(a.numel(), index_dtype, name)
        plan.append((name, b, a, idx_dtype))
    filled = [(name, b, a) for name, b, a, _ in plan if a.numel()]
    shared = [name for name, b, a in filled
              if b.device == a.device and b.data_ptr() == a.data_ptr() and b.stride() == a.stride()]
    if shared and len(shared) == len(filled):
        warnings.warn(
            f"sparse_patches_from_diff: before and after share memory for {len(shared)} "
            f"weight(s) (first: {shared[0]!r}), so nothing can differ there; keep a copy "
            "of the previous weights (clone) if the trainer updates them in place",
            UserWarning, stacklevel=2,
        )

    patches: list[CheckpointWeightPatch] = []
    nan_counts: dict[str, int] = {}
    not_float: dict[str, int] = {}
    for name, b, a, idx_dtype in plan:
        real = _real_float(a.dtype)
        idx_parts: list[torch.Tensor] = []
        value_parts: list[torch.Tensor] = []
        nnz = n_nan = 0
        for lo, pb, pa in _pieces(b, a.detach()):
            # a lazy conjugate or negative view has no bits of its own to gather: the
            # values it shows, resolved a piece at a time
            pa = pa.resolve_conj().resolve_neg()
            shown = changed_mask(pb, pa)  # (pb moved to pa's device a piece at a time)
            part = torch.nonzero(shown.reshape(-1)).reshape(-1)  # ascending
            if not part.numel():
                continue
            nnz += part.numel()
            if not real:
                continue  # (only counted: such a weight is refused below)
            if pa.is_contiguous():
                values = select(pa.reshape(-1), part)  # (float8 too, before torch 2.8)
            else:
                # gathered through the mask (row-major, as ``part``), as same-width
                # integers, which every dtype has: no contiguous copy of the piece
                values = bits(pa)[shown].view(pa.dtype)
            n_nan += int(nan_mask(values).sum())
            value_parts.append(values)
            idx_parts.append((part + lo if lo else part).to(idx_dtype))
        if nnz == 0:
            continue
        if not real:
            not_float[name] = nnz
            continue
        if n_nan:
            nan_counts[name] = n_nan
            continue
        values, idx = (value_parts[0], idx_parts[0]) if len(idx_parts) == 1 else (
            torch.cat(value_parts), torch.cat(idx_parts))
        patches.append(CheckpointWeightPatch(name, tuple(a.shape), a.dtype, values, idx))

    def listing(counts: dict[str, int], what: str) -> str:
        return ", ".join(f"{n!r} ({c} {what})" for n, c in counts.items())

    if not_float:
        first = next(iter(not_float))
        extra_nan = (
            f"; also NaN new values in {listing(nan_counts, 'NaN')}" if nan_counts else ""
        )
        changed = ", ".join(f"{n!r} ({c} changed, {after[n].dtype})"
                            for n, c in not_float.items())
        raise PatchTypeError(
            "a sparse patch needs a floating-point dtype that holds NaN (NaN marks "
            f"'unchanged'), but these weights of other dtypes changed: {changed}; send "
            f"them dense (dense_patches){extra_nan}",
            name=first, reason="sparse dtype", value=dict(not_float),
        )
    if nan_counts:
        first = next(iter(nan_counts))
        raise PatchValueError(
            "changed elements with a NaN new value cannot be sent sparsely (NaN means "
            f"'unchanged'): {listing(nan_counts, 'NaN')}; send those weights dense "
            "(dense_patches)",
            name=first, reason="NaN", value=dict(nan_counts),
        )
    return patches


def changed_fraction(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
) -> float:
    """Fraction of elements (over all weights of ``after``) whose bits changed from
    ``before`` to ``after``, two state dicts of the same names, shapes and dtypes.

    The same notion of change as :func:`sparse_patches_from_diff`, but it never raises
    for NaN or non-floating weights. Names, shapes and dtypes must match (else
    :class:`~patchkit.errors.PatchValueError`; a value that is not a tensor, or a
    torch.sparse or nested one, :class:`~patchkit.errors.PatchTypeError`; a meta tensor,
    ``PatchValueError``). Returns 0.0 for dicts with no elements. Compares about 4 M
    elements at a time, as :func:`sparse_patches_from_diff` does.
    """
    _check_mapping(before, "before")
    _check_mapping(after, "after")
    _check_same_names(before, after)
    _check_comparable(before, after)
    changed = total = 0
    for name, a in after.items():
        b = before[name]
        _check_same_kind(name, b, a)
        changed += sum(int(count_true(changed_mask(pb, pa)))
                       for _, pb, pa in _pieces(b, a.detach()))
        total += a.numel()
    return changed / total if total else 0.0


# --------------------------------------------------------------------------- random


def _distinct_positions(n: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` distinct positions in ``[0, n)``, uniformly at random, sorted (int64, CPU)."""
    if 8 * k >= n:
        return torch.sort(torch.randperm(n, generator=generator, device="cpu")[:k]).values
    # Sparse case: sample with replacement and deduplicate; O(k log k), never O(n).
    found = torch.empty(0, dtype=torch.int64, device="cpu")
    while found.numel() < k:
        need = k - found.numel()
        draw = torch.randint(0, n, (need + need // 4 + 16,), generator=generator, device="cpu")
        found = torch.unique(torch.cat((found, draw)))
    if found.numel() > k:
        keep = torch.randperm(found.numel(), generator=generator, device="cpu")[:k]
        found = found[torch.sort(keep).values]
    return found


def _meta_count(pattern: str, density: float, n: int, rows: int, cols: int, bh: int, bw: int,
                generator: torch.Generator | None) -> int:
    """How many positions :func:`random_sparse_patch` picks, without picking them: exact
    for ``"uniform"`` and ``"rows"``; for ``"blocks"``, whose edge blocks are smaller, the
    same blocks the CPU path draws first from ``generator`` (O(blocks), no mask)."""
    if pattern == "uniform":
        return round(density * n)
    if pattern == "rows":
        return round(density * rows) * cols
    gr, gc = -(-rows // bh), -(-cols // bw)
    chosen = torch.randperm(gr * gc, generator=generator, device="cpu")[:round(density * gr * gc)]
    r, c = chosen // gc, chosen % gc
    heights = torch.where(r == gr - 1, rows - (gr - 1) * bh, bh)
    widths = torch.where(c == gc - 1, cols - (gc - 1) * bw, bw)
    return int((heights * widths).sum())


def random_sparse_patch(
    name: str,
    shape: Iterable[int],
    dtype: torch.dtype,
    density: float,
    *,
    pattern: Pattern = "uniform",
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    index_dtype: torch.dtype | None = torch.int64,
    block: int = 16,
    std: float = 1.0,
) -> CheckpointWeightPatch:
    """A random sparse patch of roughly ``density``, for density experiments.

    Changed positions, by ``pattern``, on the 2-D view that :func:`patchkit.density_map`
    and the figures use, rows × last dimension (``(prod(shape[:-1]), shape[-1])``; a 1-D
    tensor of length n is viewed as ``(1, n)``, a scalar as ``(1, 1)``):

    - ``"uniform"``: exactly ``round(density * numel)`` distinct positions (Python's
      ``round``: halves go to the even neighbour), uniformly at random. Costs O(nnz)
      memory below a density of 1/8 (measured: about 54 bytes a chosen position at the
      peak), and from 1/8 up a permutation of every position (8 bytes an element) plus
      about 24 bytes a chosen position to sort them (12.8 bytes an element at 0.2).
    - ``"rows"``: ``round(density * rows)`` whole rows of the 2-D view.
    - ``"blocks"``: the view is tiled by ``min(block, rows) x min(block, cols)`` blocks
      (edge blocks are cut short) and ``round(density * number_of_blocks)`` of them
      change. The changed fraction equals the block fraction exactly when both
      dimensions are multiples of the block size. Costs O(numel) memory for a mask.

    A density above 0 that rounds to no position (0.3 of a 1-D tensor's one row) gives
    an empty patch, with a ``UserWarning`` saying so; a shape with no elements
    (``(0, 5)``) gives an empty patch at any density, without one.

    Values are ``std``-scaled standard normal numbers drawn from ``generator`` on the CPU
    (``None``: torch's global CPU generator) in float32 (in float64 for a float64 patch),
    cast to ``dtype`` and then moved with the
    indices to ``device``; a value whose cast is NaN (a format without infinities,
    e.g. ``float8_e4m3fnuz``, far out of range) is replaced by 0, so values are never
    NaN. Indices are sorted, distinct, of ``index_dtype`` (int64 by default; ``None``:
    int32 where the positions fit, as elsewhere in this module). The same generator state
    gives the same patch.

    On the meta device (a patch to plan a dry run with, for a model bigger than the
    machine) nothing is drawn but the count: the patch has as many (meta) values and
    indices as the same generator state gives elsewhere, at no cost beyond the blocks
    of ``"blocks"`` (which of them change, drawn as on the CPU), never O(numel).

    Raises :class:`~patchkit.errors.PatchValueError` for an empty name, a negative
    dimension, a shape whose bytes reach 2**63 (more than a tensor can hold, as
    :func:`~patchkit.patch.validate_patches` says), a density outside [0, 1], a ``std``
    that is negative or not finite, an unknown pattern, a tensor too large for int32
    indices, or a ``device`` torch does not parse or this machine does not have;
    :class:`~patchkit.errors.PatchTypeError` for a name that is not a str, a shape that
    is not a tuple of ints (an int, or a float that would be truncated), a ``density`` or
    ``std`` that is not a real number (numpy scalars are), a non-floating or packed
    (``float4_e2m1fn_x2``) ``dtype`` (a sparse patch needs NaN), or a ``generator`` that
    is not a :class:`torch.Generator` (a seed such as ``42`` is not one: pass
    ``torch.Generator().manual_seed(42)``).
    """
    name = _check_name(name)
    shape = _check_shape(shape, name)
    if not isinstance(dtype, torch.dtype) or not _real_float(dtype):
        raise PatchTypeError(
            "a sparse patch needs a floating-point dtype that holds NaN (NaN marks "
            f"'unchanged'): {_sparse_dtype_text(dtype)}",
            name=name, reason="sparse dtype", value=dtype,
        )
    _check_size(f"weight {quoted(name)}", None, name, shape, dtype)  # (as validate_patches does)
    if isinstance(density, bool) or not isinstance(density, numbers.Real):
        raise PatchTypeError(
            f"density must be a number in [0, 1], got {type(density).__name__} {brief(density)}",
            name=name, reason="density type", value=density,
        )
    if not 0 <= density <= 1:  # (exact: an int beyond float's range is no density either)
        raise PatchValueError(f"density must be a number in [0, 1], got {brief(density)}",
                              name=name, reason="density", value=density)
    density = float(density)
    std = _check_real(std, "std", 0.0)
    device = _checked_device(device, allow_meta=True)  # (meta: a patch to plan with)
    if pattern not in _PATTERNS:
        raise PatchValueError(f"pattern must be one of {_PATTERNS}, got {brief(pattern)}",
                              name=name, reason="pattern", value=pattern)
    _check_index_dtype(index_dtype, allow_none=True)
    block = _check_int(block, "block", 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise PatchTypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}: "
            f"{brief(generator)} (for a seed, pass torch.Generator().manual_seed(seed))",
            name=name, reason="generator type", value=generator,
        )
    n = math.prod(shape)
    idx_dtype = _index_dtype_for(n, index_dtype, name)
    rows, cols = grid_shape(shape)

    bh, bw = max(1, min(block, rows)), max(1, min(block, cols))
    gr, gc = -(-rows // bh), -(-cols // bw)
    units, total = {"uniform": ("elements", n), "rows": ("rows", rows),
                    "blocks": ("blocks", gr * gc)}[pattern]
    nothing = n == 0 or round(density * total) == 0
    if nothing and n and density > 0:
        warnings.warn(
            f"random_sparse_patch({quoted(name)}): density {density:g} of "
            f"{_count(total, units[:-1])} rounds to no {units}: the patch is empty"
            + ("" if pattern == "uniform" else " (pattern='uniform' picks single elements)"),
            UserWarning, stacklevel=2,
        )
    if device.type == "meta":  # (no numbers to hold: only how many, none drawn)
        k = 0 if nothing else _meta_count(pattern, density, n, rows, cols, bh, bw, generator)
        return CheckpointWeightPatch(
            name, shape, dtype, torch.empty(k, dtype=dtype, device=device),
            torch.empty(k, dtype=idx_dtype, device=device),
        )
    if nothing:  # (no position chosen: none made, not a row or a mask of them for nothing)
        idx = torch.empty(0, dtype=torch.int64)
    elif pattern == "uniform":
        idx = _distinct_positions(n, round(density * n), generator)
    elif pattern == "rows":
        r = round(density * rows)
        chosen = torch.sort(torch.randperm(rows, generator=generator, device="cpu")[:r]).values
        idx = (chosen[:, None] * cols + torch.arange(cols, device="cpu")[None, :]).reshape(-1)
    else:
        k = round(density * gr * gc)
        grid = torch.zeros(gr * gc, dtype=torch.bool, device="cpu")
        grid[torch.randperm(gr * gc, generator=generator, device="cpu")[:k]] = True
        mask = grid.reshape(gr, gc).repeat_interleave(bh, 0)[:rows]
        mask = mask.repeat_interleave(bw, 1)[:, :cols]
        idx = torch.nonzero(mask.reshape(-1)).reshape(-1)

    # drawn in float32, or float64 for a float64 patch (so its values use its precision
    # and a tiny std such as 1e-50 does not round them all to 0)
    draw = torch.float64 if dtype == torch.float64 else torch.float32
    drawn = torch.randn(idx.numel(), generator=generator, device="cpu", dtype=draw) * std
    values = drawn.to(dtype)
    nan = torch.isnan(values.to(draw))  # (float8's isnan and where came in torch 2.7)
    if bool(nan.any()):
        values = torch.where(nan, torch.zeros((), dtype=draw), drawn).to(dtype)
    return CheckpointWeightPatch(
        name, shape, dtype, values.to(device), idx.to(idx_dtype).to(device)
    )


# --------------------------------------------------------------------------- split


def split_patch(
    patch: PatchLike, parts: int, *, index_dtype: torch.dtype | None = None
) -> list[CheckpointWeightPatch]:
    """Split one patch into same-name **sparse** patches; applying them in order (one
    ``load_checkpoint_weight_patches`` call, where each repeated name starts a new
    ``load_weights`` call) has the same effect as applying ``patch``.

    - Sparse ``patch``: its (indices, values) pairs, in their stored order, are cut into
      ``parts`` contiguous groups whose sizes differ by at most one; index and value
      dtypes are kept. ``parts == 1`` returns ``[patch]``.
    - Dense ``patch``: its flat positions ``0..numel-1`` are cut into ``parts``
      contiguous ranges, each becoming a sparse patch (indices ``arange(start, stop)`` of
      ``index_dtype``; ``None`` = int32 where it fits), so the parts of several dense
      patches can go in one call (a call cannot mix dense and sparse). This needs a
      floating-point dtype that holds NaN (:class:`~patchkit.errors.PatchTypeError`
      otherwise, for the packed ``float4_e2m1fn_x2`` too) and values
      that are not NaN once cast to ``dtype`` (:class:`~patchkit.errors.PatchValueError`:
      such a weight must stay dense; meta values, which hold no numbers, are not checked).
    - Empty parts are dropped: with ``parts`` larger than the number of elements you get
      one part per element. A patch with no elements gives one (empty, sparse) part, so
      the result is never empty.

    Parts share memory with ``patch.values``/``patch.indices`` where possible (slices).
    ``parts`` must be an int >= 1. The patch is validated first
    (:func:`~patchkit.patch.validate_patches`).
    """
    parts = _check_int(parts, "parts", 1)
    _check_index_dtype(index_dtype, allow_none=True)
    patch = _as_patch(patch)
    validate_patches([patch], positions=[None])  # (a lone patch: no position to name)
    name, _, dtype, values, indices = patch
    if indices is not None:
        if parts == 1:
            return [patch]
        nnz = values.numel()
        if nnz == 0:
            return [patch]
        parts = min(parts, nnz)  # (more would only add empty parts, then drop them)
        groups = zip(torch.tensor_split(values, parts), torch.tensor_split(indices, parts))
        return [patch._replace(values=v, indices=i) for v, i in groups if v.numel()]

    if not _real_float(dtype):
        raise PatchTypeError(
            f"{where(None, name)}: splitting a dense patch makes sparse parts, which need a "
            "floating-point dtype that holds NaN (NaN marks 'unchanged'): "
            f"{_sparse_dtype_text(dtype)}",
            name=name, reason="sparse dtype", value=dtype,
        )
    n = numel(patch)
    # (meta values hold no numbers, as for the loader's checks: a dry run's split)
    cast_nan = int(nan_mask(values.to(dtype)).sum()) if n and not values.is_meta else 0
    if cast_nan:
        raise PatchValueError(
            f"{where(None, name)}: {cast_nan} values are NaN (as {dtype}); NaN cannot be sent "
            "sparsely, so this weight cannot be split: send it dense",
            name=name, reason="NaN", value=cast_nan,
        )
    idx_dtype = _index_dtype_for(n, index_dtype, name)
    if n == 0:
        empty = torch.empty(0, dtype=idx_dtype, device=values.device)
        return [patch._replace(indices=empty)]
    parts = min(parts, n)  # (more would only add empty parts)
    # (parts <= n: each part holds at least n // parts >= 1 elements, none is empty)
    bounds = [(n * j) // parts for j in range(parts + 1)]
    out = []
    for start, stop in itertools.pairwise(bounds):
        idx = torch.arange(start, stop, dtype=idx_dtype, device=values.device)
        out.append(patch._replace(values=values[start:stop], indices=idx))
    return out


# --------------------------------------------------------------------------- wire bytes


def wire_bytes(patches: PatchLike | Iterable[PatchLike]) -> int:
    """Bytes a transport carries for ``patches`` (one patch or an iterable of them).

    Dense: ``values.numel() * values.element_size()``. Sparse: that plus the same for
    ``indices``. Counts the tensors actually held (their dtypes), not the checkpoint
    dtype, and no per-patch framing (names, shapes). A plain 5-tuple counts as a patch,
    as a load takes it; anything else raises :class:`~patchkit.errors.PatchTypeError`
    naming its position (a patch given alone, by its name alone). Each patch gets the
    checks a load makes of its structure
    (name, shape, dtypes, a dense patch's value count, a sparse one's index count:
    :class:`~patchkit.errors.PatchTypeError` / :class:`~patchkit.errors.PatchValueError`
    naming it), so a patch no load would take has no size; its numbers (NaN, indices out
    of range or repeated) are not read (:func:`~patchkit.patch.validate_patches` does).
    """
    one = isinstance(patches, CheckpointWeightPatch) or (
        isinstance(patches, tuple) and len(patches) == 5 and isinstance(patches[0], str))
    # (one patch, a CheckpointWeightPatch or a plain 5-tuple, named by its name alone: a
    # CheckpointWeightPatch of a bad name was read as a list of its five fields)
    items = [(None, patches)] if one else enumerate(patch_list(patches, ordered=False))
    total = 0
    for i, p in items:
        if not (isinstance(p, tuple) and len(p) == 5):
            raise not_a_patch(i, p)
        _check_structure(i, p)
        values, indices = p[3], p[4]
        total += values.numel() * values.element_size()
        if indices is not None:
            total += indices.numel() * indices.element_size()
    return total


# --------------------------------------------------------------------------- trainer


def _same_tensor_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same values in memory: one object, or two views
    of one storage with the same offset, shape, strides and dtype, neither of them a
    conjugate or negative view of the other (``state_dict()`` hands out a fresh
    ``detach()`` per name of a tied parameter). Tensors without plain memory to compare
    (meta, empty, torch.sparse) are the same only as one object."""
    if not isinstance(t, torch.Tensor) or t.is_meta or t.layout is not torch.strided \
            or t.numel() == 0:
        return ("object", id(t))
    return ("view", t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), t.stride(), t.dtype, t.is_conj(), t.is_neg())


class AdamLikeTrainer:
    """A deterministic stand-in for an RL trainer: Adam on fp32 master weights.

    Holds fp32 master copies of the floating-point tensors of ``state_dict`` (usually
    bf16; a float64 tensor keeps float64 masters, so that nothing is lost before the
    first step), Adam moments ``m`` and ``v``, and a seeded CPU generator. Each :meth:`step`
    draws a pseudo-gradient ``grad_std * N(0, 1)`` per tensor from that generator (on the
    CPU, in ``state_dict`` order, then moved to the tensor's device), applies

    ``m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g``
    ``w -= lr * (m / (1-b1**t)) / (sqrt(v / (1-b2**t)) + eps) + lr * weight_decay * w``

    and returns a new state dict: the master weights cast back to each tensor's original
    dtype, in the original key order (non-floating tensors, and those of the packed
    ``float4_e2m1fn_x2``, which has no arithmetic, are returned unchanged and never
    trained). The returned tensors are fresh (the trainer never writes into them),
    so consecutive results can be diffed.

    Why this is realistic: each master weight moves by about ``lr`` per step, but a bf16
    element changes only when the master crosses a bf16 rounding boundary, so at small
    learning rates only a small share of bf16 elements change per step, as reported for
    real RL runs (1-3 %). On ``tiny_llama_checkpoint()`` weights, over the first ten
    steps: 0.6 % falling to 0.3 % at the default ``lr=1e-6``; 4.7-5.6 % for the first two
    steps at ``1e-5``, then about 3 %; about a third for the first two steps at ``1e-4``,
    falling to a fifth (Adam's moments grow, so later steps move less). Two trainers
    built with the same arguments produce the same steps.

    Attributes a caller may read: ``master`` (name -> master weight; a tied tensor's
    first name only), ``step_count`` (the steps taken), and the arguments as checked,
    ``lr``, ``betas``, ``eps``, ``weight_decay``, ``grad_std``. Changing ``lr`` between
    steps takes effect at the next step, as an optimizer's learning-rate schedule does.

    Tensors that ``state_dict`` lists under several names (tied weights: a Hugging Face
    ``state_dict()`` lists ``lm_head.weight`` and ``model.embed_tokens.weight`` as two
    views of one storage; a plain dict may hold one tensor twice) stay one: one master
    weight, one gradient per step, and every name of it gets the same new values, as a
    real optimizer of a tied model gives.

    Arguments are checked when the trainer is made (``PatchTypeError`` /
    ``PatchValueError``): ``state_dict`` a mapping of names to tensors; ``lr``,
    ``weight_decay`` and ``grad_std`` finite numbers >= 0; ``eps`` a finite number > 0;
    ``betas`` two numbers in [0, 1) (a beta of 1 would divide by zero in the bias
    correction and turn every weight NaN); ``seed`` an int in ``[0, 2**32)`` (torch's CPU
    generator reads a seed's low 32 bits: a seed beyond would repeat one inside).
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor],
        *,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_std: float = 1.0,
        seed: int = 0,
    ) -> None:
        _check_mapping(state_dict, "state_dict", plain=True)
        self.lr = _check_real(lr, "lr", 0.0)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise PatchTypeError(f"betas must be two numbers, got {brief(betas)}",
                                 reason="betas", value=betas) from None
        self.betas = (_check_real(b1, "betas[0]", 0.0, below=1.0),
                      _check_real(b2, "betas[1]", 0.0, below=1.0))
        self.eps = _check_real(eps, "eps", 0.0, strict=True)
        self.weight_decay = _check_real(weight_decay, "weight_decay", 0.0)
        self.grad_std = _check_real(grad_std, "grad_std", 0.0)
        self.step_count = 0
        # (torch's CPU generator takes a 64-bit seed and draws from its low 32 bits)
        seed = _check_int(seed, "seed", 0, below=1 << 32)
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._dtypes = {k: t.dtype for k, t in state_dict.items()}
        self._fixed: dict[str, torch.Tensor] = {}
        self.master: dict[str, torch.Tensor] = {}
        self._m: dict[str, torch.Tensor] = {}
        self._v: dict[str, torch.Tensor] = {}
        self._tied: dict[str, str] = {}  # a later name of a tensor -> its first name
        first: dict[tuple, str] = {}
        for k, t in state_dict.items():
            key = _same_tensor_key(t)
            if key in first:
                self._tied[k] = first[key]
                continue
            first[key] = k
            if _real_float(t.dtype):
                keep = torch.float64 if t.dtype == torch.float64 else torch.float32
                self.master[k] = t.detach().to(keep, copy=True)
                self._m[k] = torch.zeros_like(self.master[k])
                self._v[k] = torch.zeros_like(self.master[k])
            else:
                self._fixed[k] = t.detach().clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights in their original dtypes and key order (fresh tensors; a
        tensor given under several names is one tensor under those names here too)."""
        out: dict[str, torch.Tensor] = {}
        for k, dtype in self._dtypes.items():
            if k in self._tied:
                out[k] = out[self._tied[k]]  # one tensor under both names, as given
            elif k in self.master:
                out[k] = self.master[k].to(dtype, copy=True)
            else:
                out[k] = self._fixed[k].clone()
        return out

    @torch.no_grad()
    def step(self) -> dict[str, torch.Tensor]:
        """Apply one Adam-like update and return the new state dict (see the class doc):
        fresh tensors, each name's original dtype, in the original key order;
        ``step_count`` goes up by one."""
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        for k, w in self.master.items():
            g = torch.randn(w.shape, generator=self._generator, dtype=torch.float32, device="cpu")
            g = (g * self.grad_std).to(device=w.device, dtype=w.dtype)
            m, v = self._m[k], self._v[k]
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            update = (m / bc1) / ((v / bc2).sqrt_().add_(self.eps))
            if self.weight_decay:
                update.add_(w, alpha=self.weight_decay)
            w.sub_(update, alpha=self.lr)
        return self.state_dict()
