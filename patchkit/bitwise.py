"""Bit-level views and comparisons: what "bit for bit" means everywhere in patchkit."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping

import torch

__all__ = ["bits", "block_size", "changed_mask", "count_true", "device_passes", "difference",
           "has_numbers", "host_waits", "nan_mask", "per_element", "same_bits", "same_state",
           "select", "squares_on_device", "sum_squares"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The unsigned types wider than a byte have no index kernels in torch (index_select,
# index_copy_, index_put_ raise NotImplementedError): their bits go as the signed type.
_SIGNED_OF_UNSIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32,
                       torch.uint64: torch.int64}
# torch's own tensor types, and no subclass (which may answer an op its own way): where
# ``type(t) in _PLAIN``, the loader may skip a call whose result it knows (a cast that
# changes nothing); any other type goes through it.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width (a view, no copy).

    ``bits(a) != bits(b)`` counts ``0.0`` vs ``-0.0`` as different and two NaNs with the
    same payload as equal, unlike ``a != b``. Complex tensors gain a trailing dimension of
    2 (real, imaginary); signed integer and uint8 tensors come back as they are, uint16,
    uint32 and uint64 ones as the signed type of their width (torch has index kernels for
    those), and the packed ``bits*`` dtypes as the int of their width.
    """
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    signed = _SIGNED_OF_UNSIGNED.get(t.dtype)
    if signed is not None:
        return t.view(signed)
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    if t.dtype.is_floating_point or not has_numbers(t.dtype):
        # (the bits* dtypes too: torch has no comparison kernels for them)
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    """``torch.isnan(t)``, float8 included (float8's own ``isnan`` came in torch 2.7, and
    patchkit supports 2.4): a one-byte float whose dtype has one or two NaN bit patterns
    (``e4m3fn``, the ``fnuz`` types, ``e8m0fnu``) is compared byte for byte, four times
    faster than reading it through float32, which the others are."""
    if t.element_size() > 1:
        return torch.isnan(t)
    found = _nan_bytes(t.dtype) if t.dtype.is_floating_point else None
    if found is None:
        return torch.isnan(t.float())
    b = t.view(torch.uint8)
    return b == found[0] if len(found) == 1 else (b == found[0]) | (b == found[1])


@functools.cache
def _nan_bytes(dtype: torch.dtype) -> tuple[int, ...] | None:
    """The bytes that are NaN in a one-byte floating ``dtype`` where there are one or two
    (``None``: more, as in ``float8_e5m2``, or none, or no numbers: the packed
    ``float4_e2m1fn_x2``), found once by reading all 256."""
    if not has_numbers(dtype):
        return None
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    found = tuple(int(b) for b in torch.nonzero(torch.isnan(every)).reshape(-1))
    return found if 1 <= len(found) <= 2 else None


@functools.cache
def has_numbers(dtype: torch.dtype) -> bool:
    """Whether torch reads ``dtype``'s elements as numbers (casts them to float64, or
    complex128): every float, integer, bool and complex dtype but the packed ones
    (``float4_e2m1fn_x2``, the ``bits*`` dtypes), whose elements only compare bit for
    bit. Found once per dtype by casting one CPU element."""
    wide = torch.complex128 if dtype.is_complex else torch.float64
    try:
        torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype).to(wide)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` (a copy) for every dtype: uint16/32/64 selected as
    the signed type of their width, and a dtype with no ``index_select`` kernel here
    (``float4_e2m1fn_x2``, the ``bits*`` dtypes) as the int of its element size: the
    same bits."""
    signed = _SIGNED_OF_UNSIGNED.get(t.dtype)
    if signed is None:
        try:
            return t.index_select(0, index)
        except (NotImplementedError, RuntimeError):  # (torch before 2.8: a RuntimeError,
            signed = _INT_OF_SIZE.get(t.element_size())  # float8's "not implemented")
            if signed is None or t.is_complex():
                raise
    return t.view(signed).index_select(0, index).view(t.dtype)


def _masked(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t[mask]`` (a copy) for every dtype, as :func:`select` for an index: as the
    bits' ints where torch has no masked index of the dtype (float8 on the CPU before
    torch 2.10)."""
    try:
        return t[mask]
    except (RuntimeError, NotImplementedError):
        return bits(t)[mask].view(t.dtype)


def difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` elementwise, as a float tensor (complex128 when either is complex) wide
    enough to hold it: two float16 or two 8-bit-float tensors in float32 (exact unless
    their exponents are more than 13 apart), other floats in float64; integers and bools
    of any dtypes exactly, then rounded once to float64 (int64 values beyond 2**53 too,
    which a cast to float64 first would round to equal numbers)."""
    if a.is_complex() or b.is_complex():
        return a.to(torch.complex128) - b.to(torch.complex128)
    if a.is_floating_point() or b.is_floating_point():
        if a.dtype == b.dtype and a.element_size() <= 2 and a.dtype != torch.bfloat16:
            return torch.sub(a.float(), b.float())
        return torch.sub(a.double(), b.double())  # (bfloat16 has float32's range)
    # each as hi * 2**32 + lo (lo in [0, 2**32)): the two partial differences are exact
    # in int64 and in float64, and their sum is rounded once
    (hi_a, lo_a), (hi_b, lo_b) = _halves(a), _halves(b)
    return (hi_a - hi_b).double().mul_(2.0**32).add_((lo_a - lo_b).double())


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An integer or bool tensor as int64 ``(hi, lo)`` with ``t == hi * 2**32 + lo`` and
    ``0 <= lo < 2**32`` (uint64's upper half unsigned)."""
    if t.dtype == torch.uint64:
        s = bits(t)
        return (s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF
    x = t if t.dtype == torch.int64 else t.to(torch.int64)
    return x >> 32, x & 0xFFFFFFFF


def per_element(ne: torch.Tensor, complex_: bool) -> torch.Tensor:
    """A comparison of :func:`bits` views per element of the tensors compared: a complex
    element's bits are two numbers (a trailing dimension of 2), and it differs when
    either does."""
    return ne.any(dim=-1) if complex_ else ne


def changed_mask(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Bool tensor shaped like ``after``: True where the bits differ from ``before``.
    A lazy conjugate or negative view (``x.conj()``, ``torch._neg_view``) is compared by
    the values it shows (resolved first, a copy of that tensor only)."""
    before = before.to(after.device).resolve_conj().resolve_neg()
    ne = bits(before) != bits(after.resolve_conj().resolve_neg())
    return per_element(ne, after.dtype.is_complex)


_COUNT_BLOCK = 1 << 20
_SQUARES_BLOCK = 1 << 18
# On a device whose values the host reads only by waiting for it (CUDA), a blockwise pass
# takes blocks of up to _DEVICE_BLOCK elements: big enough that each kernel outlasts its
# launch (4 M elements are about 10 us of a GPU's memory bandwidth in float64), and a
# bound on the scratch whatever the tensor's size: 32 MiB per float64 temporary, 100 MiB
# for a block of the report's statistics (float64 differences), up to 230 MiB for int64
# or complex ones.
_DEVICE_BLOCK = 1 << 22


_DEVICE_PASSES = [False]  # set by device_passes(): the CPU takes the device passes too


def host_waits(device: torch.device) -> bool:
    """True where reading a tensor's value on the host waits for ``device`` (every
    device but the CPU, and the CPU too inside :func:`device_passes`): passes there keep
    their running sums on the device, take big blocks, and read the sums once."""
    return device.type != "cpu" or _DEVICE_PASSES[0]


@contextlib.contextmanager
def device_passes() -> Iterator[None]:
    """Inside the block, the CPU takes the passes a GPU takes (see :func:`host_waits`):
    with :func:`patchkit.native.disabled`, a CPU machine runs what a GPU runs, so tests
    check those passes' numbers and the benchmark counts their host waits. Not
    thread-safe; results agree with the CPU's own passes up to the order of float
    additions."""
    saved = _DEVICE_PASSES[0]
    _DEVICE_PASSES[0] = True
    try:
        yield
    finally:
        _DEVICE_PASSES[0] = saved


def block_size(device: torch.device, numel: int, host: int | None = None) -> int:
    """Elements per step of a blockwise pass over ``numel`` elements on ``device``:
    ``host`` on the CPU (default ``_SQUARES_BLOCK``: blocks that stay in cache), up to
    ``_DEVICE_BLOCK`` elsewhere (the whole tensor below it), so that a pass on a GPU is a
    few kernels per 4 M elements and its waits do not grow with the tensor."""
    if not host_waits(device):
        return _SQUARES_BLOCK if host is None else host
    return max(1, min(numel, _DEVICE_BLOCK))


def sum_squares(x: torch.Tensor) -> float:
    """Sum of squares of the finite elements of ``x`` (complex: of real and imaginary
    parts), accumulated in float64 a block at a time, so neither a float32 overflow nor
    a tensor-sized float64 copy happens. The sum stays on ``x``'s device until the end:
    one host wait on CUDA (two when ``x`` holds a non-finite value), not one per block."""
    s = float(squares_on_device(x))
    if math.isfinite(s):
        return s
    # A NaN or infinity somewhere: sum again without the non-finite elements.
    return float(squares_on_device(x, finite_only=True))


def squares_on_device(x: torch.Tensor, *, finite_only: bool = False) -> torch.Tensor:
    """The sum of squares of ``x``'s elements as a 0-dim float64 tensor on its device
    (no host wait): NaN or infinite where ``x`` holds a non-finite value, unless
    ``finite_only`` leaves those out (a second pass, which :func:`sum_squares` makes only
    when the first sum is not finite)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    flat = x.reshape(-1)
    step = block_size(flat.device, flat.numel())
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for lo in range(0, flat.numel(), step):
        part = flat[lo : lo + step].double()
        if finite_only:
            part = torch.where(torch.isfinite(part), part, 0)
        total += torch.dot(part, part)
    return total


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """How many elements of the bool tensor ``mask`` are True: a 0-dim int64 tensor on
    ``mask``'s device (no host wait; ``int()`` it to read it).

    On CUDA, ``torch.count_nonzero`` widens the whole mask to int64 before it adds (8 bytes
    of scratch per element: 512 MiB for 64 M elements); this counts in blocks (of
    :func:`block_size`), so the scratch stays at 32 MiB.
    """
    flat = mask.reshape(-1)
    if not host_waits(flat.device) or flat.numel() <= _COUNT_BLOCK:
        return torch.count_nonzero(flat)
    step = block_size(flat.device, flat.numel(), _COUNT_BLOCK)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo in range(0, flat.numel(), step):
        total += torch.count_nonzero(flat[lo : lo + step])
    return total


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and bits (any devices).

    Both must be plain (strided, not nested) :class:`torch.Tensor` s with values, so not
    on the meta device (a numpy array is not compared: convert it with
    ``torch.from_numpy``; a torch.sparse one with ``.to_dense()``): anything else raises
    ``TypeError`` naming the argument (``ValueError`` for meta).
    """
    _check_comparable(a, "same_bits: a")
    _check_comparable(b, "same_bits: b")
    return _same_bits(a, b)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # (a lazy conjugate or negative view has no bits of its own to view: resolved first)
    return torch.equal(bits(a.detach().cpu().resolve_conj().resolve_neg()),
                       bits(b.detach().cpu().resolve_conj().resolve_neg()))


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """True when two state dicts have the same names and every tensor the same bits.

    ``a`` and ``b`` must be mappings (a ``dict``, a ``state_dict()``) and the values
    compared tensors as :func:`same_bits` takes them: anything else raises ``TypeError``
    (``ValueError`` for meta) naming it (the values of dicts whose names differ are not
    looked at: the answer is False).
    """
    for what, state in (("a", a), ("b", b)):
        if not isinstance(state, Mapping):
            raise TypeError(
                f"same_state: {what} must be a mapping of names to tensors (a state dict), "
                f"got {type(state).__name__}"
            )
    if a.keys() != b.keys():
        return False
    for k in a:
        _check_comparable(a[k], f"same_state: a[{k!r}]")
        _check_comparable(b[k], f"same_state: b[{k!r}]")
    return all(_same_bits(a[k], b[k]) for k in a)


def _check_tensor(t: object, what: str) -> None:
    """``TypeError`` saying that ``what`` must be a tensor, unless ``t`` is one."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")


def _check_comparable(t: object, what: str) -> None:
    """``t`` is a tensor whose bits :func:`same_bits` can read: a plain (strided, not
    nested) one (``TypeError`` otherwise), not on the meta device (``ValueError``)."""
    _check_tensor(t, what)
    got = _not_plain(t)
    if got is not None:
        got = got if t.is_nested else f"of {got}"
        raise TypeError(f"{what} is {got}; only plain (strided) tensors are compared "
                        "(for torch.sparse, pass t.to_dense())")
    if t.is_meta:
        raise ValueError(f"{what} is on the meta device, which holds no bits to compare")


def _not_plain(t: torch.Tensor) -> str | None:
    """What makes ``t`` no plain (strided, not nested) tensor, for a message (``"a nested
    tensor"``, ``"layout torch.sparse_coo"``), or ``None`` for a plain one."""
    if t.is_nested:
        return "a nested tensor"
    return None if t.layout is torch.strided else f"layout {t.layout}"
