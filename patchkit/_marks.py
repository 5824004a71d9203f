"""What an op does with a sparse patch's NaN marks: the rules a sparse call traces by.

Inside a sparse ``load_weights`` call NaN in a staged patch means "keep the runtime
value". :class:`_Provenance` follows which staged patch each stretch of a storage came
from (through casts, clones, moves and puts) so that a NaN-merged write can name its
patch and, where the stretch is exact, recompute where it wrote. :class:`_LostMarks`
follows the elements a cast turned from a number into NaN, which are no "keep": a
sparse copy whose source holds one is refused where its place in the patch is unknown.
Which ops keep elements, move them, mix them or make a tensor anew is told by the ATen
op tables here (``_ANEW``, ``_KEEPS_ELEMENTS``, ``_MOVES``, ``_PUTS``, ``_MIXES``,
``_REDUCES``, ...) and the predicates over them (:func:`_element_wise`, :func:`_mixes`,
:func:`_replaces_nan`), worked out once per op and cached for the process.

Everything here is private to patchkit; :class:`~patchkit.intercept.WriteSession` is
its one user.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._regions import _byte_span, _holds, _position_of, _storage_key, _storage_offsets
from .bitwise import nan_mask
from .errors import where

_aten = torch.ops.aten
_COPY = _aten.copy_.default
_FOREACH_COPY = getattr(getattr(_aten, "_foreach_copy_", None), "default", None)


def _inexact(t: torch.Tensor) -> bool:
    """Whether ``t``'s dtype holds NaN (a floating-point or complex dtype): the tensors
    that can carry a sparse patch's marks, and whose results a patch's marks can reach."""
    return t.is_floating_point() or t.is_complex()


class _Source(NamedTuple):
    """One stretch of a storage whose elements came from one staged patch: the bytes
    ``[lo, hi)``, the patch's position and name, ``base`` (the offset in the storage of
    checkpoint element 0, in elements of ``dtype``'s size: the stretch's checkpoint
    elements, :func:`_unit`), whether it is *exact* (see :class:`_Provenance`),
    and, for a storage an op made during the call, a weak reference that says when it
    was freed (``None`` for a staged tensor, which lives as long as the call), and
    ``dtype``, the dtype whose elements its bytes are: the staged dtype, a cast's, or, for
    data an op moved without changing its dtype (a clone of ``w.view(torch.int32)``), the
    dtype its input's bytes were (``None``: not known). NaN, a sparse patch's "keep", is a
    bit pattern of that dtype: a view of these bytes as another dtype does not read it as
    NaN (see :meth:`~patchkit.intercept.WriteSession._refuse_reinterpreted`). ``name``
    ``None`` (``position`` too): data of several patches (a ``torch.cat`` of two), kept
    for its ``dtype`` only: :meth:`_Provenance.lookup` and :meth:`_Provenance.source_of`
    find no patch there. ``mixed``: ``(position, name, op)`` where these floating-point
    bytes are data that an op which mixes elements (``op``: a matmul, a reduction, a
    sort, a cumsum) made, in a sparse call, from that patch's data while it held NaN, or
    anything made from such data since (see :meth:`_Provenance.mixed_by`); ``None``
    otherwise."""

    lo: int
    hi: int
    position: int | None
    name: str | None
    base: int | None  # None: made from the patch's data by an op that moves elements
    exact: bool
    ref: Any = None
    dtype: torch.dtype | None = None
    # ``(held, read as)``: the stretch was made by a cast of a view that read the patch's
    # bytes (of dtype ``held``) as another dtype (``w.view(torch.int32).float()``): its
    # elements hold no staged NaN where the patch keeps, whatever dtype reads them; or
    # ``(held, held)``: made from a read of its own dtype whose elements straddle two of
    # the patch's (see ``shift``), garbage whatever dtype reads it
    misread: tuple[torch.dtype, torch.dtype] | None = None
    mixed: tuple[int | None, str | None, str] | None = None
    # where ``base`` is None: the byte offset, modulo the size of ``dtype``, at which the
    # stretch's elements begin in the storage, where an op moved a patch's bytes to an
    # offset of no whole element (a clone of ``w.view(torch.uint8)[1:13]``): each element
    # of ``dtype`` there straddles two of the patch's (:func:`_misaligned`). 0: aligned,
    # or not known.
    shift: int = 0
    # where ``base`` is None: ``(checkpoint offset, shape, checkpoint strides, strides,
    # start)`` of the strided view of the patch's own elements that a cast or clone
    # copied into this stretch, all of a new storage (``w[:, 2:5].to(torch.bfloat16)``,
    # or ``w.t().clone()``, which keeps the view's order of dimensions), and the strides
    # and storage offset of the copy: each element of the copy is the checkpoint element
    # of the view at the same index (:func:`_in_layout`)
    layout: tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int] | None = None
    # where ``base`` is None, in a sparse call: no NaN of patches' staged data was
    # replaced by a number on the way here, so a part of the stretch without NaN is made
    # of updates only (see :meth:`_Provenance._paired`): it was made by element moves
    # and copies (``w.flip(0)``, ``b[[0]]``, a cat of two patches) with no tensor of the
    # loader's among their inputs, or by element-wise ops that keep NaN NaN
    # (``w.abs()``, ``w * 2.0``, :data:`_NAN_KEEPING`), from staged data at a known place
    # or such data. Not set where an op wrote it in place since (``buf.nan_to_num_()``).
    nan_kept: bool = False
    # in a sparse call: ``(position, name, op, at)`` where these floating-point bytes are
    # data that an op which may make a number of a NaN (``op``: ``nan_to_num``, ``fmax``,
    # a ``where`` or ``masked_fill`` whose condition comes from patches' data, a put at
    # places it does: :func:`_replaces_nan`) made from that patch's data, or anything
    # made from such data since: the staged NaN, "keep", may be numbers here, which a
    # NaN-merge writes (see :meth:`~patchkit.intercept.WriteSession._refuse_replaced`).
    # ``at``: which of the stretch's elements hold a patch's "keep" (NaN before the op,
    # or a number made of one), as ``(mask, first, size)``: a flat boolean mask over the
    # storage's elements of ``size`` bytes from element ``first`` on, which a view of
    # the stretch reads with its own strides (:func:`_keep_in`); ``None`` where not
    # known (after an op that mixes elements: ``w.nan_to_num() @ h``)
    replaced: tuple[int | None, str | None, str, tuple | None] | None = None


def _unchanged(e: _Source) -> bool:
    """Whether stretch ``e`` holds its patches' staged elements unchanged: at a known
    place (``base``, ``layout``), or no NaN of them replaced (:attr:`_Source.nan_kept`);
    not misread, shifted, nor mixed."""
    return (e.misread is None and e.mixed is None and not e.shift
            and (e.base is not None or e.layout is not None or e.nan_kept))


def _trimmed(got: list[_Source], first: int, after: int, lo: int, hi: int,
             between: tuple[_Source, ...]) -> tuple[_Source, ...]:
    """What replaces ``got[first:after]``, the stretches that meet ``[lo, hi)`` (bytes
    now written with ``between``): ``between``, with the parts of the first and the last
    that lie outside ``[lo, hi)`` kept, since those bytes still hold their data (a scratch
    buffer that holds patch a, its first rows then overwritten with b, holds a's data in
    the rest)."""
    if first == after:
        return between
    head, tail = got[first], got[after - 1]
    if head.lo < lo:
        between = (head._replace(hi=lo), *between)
    if tail.hi > hi:
        between = (*between, tail._replace(lo=hi))
    return between


_LO = operator.attrgetter("lo")
_HI = operator.attrgetter("hi")


class _Provenance:
    """Which staged patch a tensor's elements came from, and at what element offset.

    Kept per storage as byte ranges, so that staged tensors that share one storage (dense
    patches whose values were cut from one flat bucket, a loader that stages a whole call
    in one buffer) are told apart by where a view starts. A storage made during the call
    (a cast, a clone) is forgotten once it is freed: the allocator may hand its address
    to an unrelated tensor.

    A stretch is *exact* while every element of it is known to be that patch's staged
    element at checkpoint index (element offset - base): a staged tensor, or a cast or
    clone of (a contiguous part of) one, never written to since. Only an exact source
    lets a saved NaN-merge recompute where it wrote from its patch
    (:class:`~patchkit.intercept.PatchPositions`); any name is good enough for the
    ``writes`` table.
    """

    def __init__(self) -> None:
        self._by_key: dict[tuple, list[_Source]] = {}
        # whether ops that mix elements make mixed data (a sparse call's NaN marks "keep";
        # set by WriteSession._call), and whether any stretch is mixed (else a sparse write
        # looks for none)
        self.mixing = False
        self.mixed_seen = False
        # whether any stretch holds data an op may have made numbers of its NaN in (see
        # :attr:`_Source.replaced`; else a sparse write compares none)
        self.replaced_seen = False
        # the storages whose stretches include one an op made (that may expire)
        self._weak: set[tuple] = set()
        # the staged tensors of the call that ended last (storage key, weak reference to
        # the storage): what the loader still holds of them is kept traced into the next
        # call
        self._ended: list[tuple[tuple, Any]] = []
        # the patches of the call in progress by position (the session's: see
        # :meth:`sent_whole`)
        self.patches: dict[int, Any] = {}
        # the session's marks of numbers a cast made NaN (see :class:`_LostMarks`): NaN
        # there is no "keep", which :meth:`_sliced` must not take one for
        self.lost: _LostMarks | None = None

    def clear(self) -> None:
        self._by_key.clear()
        self._weak.clear()
        self.mixed_seen = False
        self.replaced_seen = False

    def keep_past_call(self, keys: Sequence[tuple | None], staged: Sequence[tuple[str, Any]]
                       ) -> None:
        """The call that staged ``staged`` (whose storage keys are ``keys``) ends. Its
        staged tensors' stretches lived as long as the call; :meth:`prune`, before the
        next call, keeps those of the storages the loader still holds (a staged tensor it
        keeps for a later call, to pack it with others, or only a ``detach()`` or
        ``.data`` of one), as long as they live. (A weak reference to each storage, not
        to the tensor: a loader that keeps ``w.detach()`` lets the staged tensor go.)"""
        self._ended = [(key, _weak_storage(t)) for key, (_, t) in zip(keys, staged)
                       if key is not None]

    def prune(self) -> None:
        """Before a call: forget every stretch whose storage was freed, and the staged
        tensors of the call before it whose storages nothing holds any more."""
        ended, self._ended = self._ended, []
        for key, held in ended:
            got = self._by_key.get(key)
            if got is None or held.expired():
                continue  # (freed: the pass below forgets its stretches)
            self._by_key[key] = [e if e.ref is not None else e._replace(ref=held)
                                 for e in got]
            self._weak.add(key)
        for key in list(self._by_key):
            alive = [e for e in self._by_key[key]
                     if e.ref is not None and not e.ref.expired()]
            if alive:
                self._by_key[key] = alive
            else:
                del self._by_key[key]
                self._weak.discard(key)

    def add_staged(self, position: int | None, name: str, staged: torch.Tensor,
                   key: tuple | None = None) -> None:
        """Record ``staged`` as patch ``position``'s (``key``: its storage key, where the
        caller has it)."""
        if staged.numel():
            lo, hi = _byte_span(staged)
            self._put(_storage_key(staged) if key is None else key,
                      _Source(lo, hi, position, name, staged.storage_offset(), True,
                              dtype=staged.dtype))

    def _put(self, key: tuple, src: _Source) -> None:
        """Record ``src``, in place of what its bytes held before (and, where the storage
        holds stretches of storages an op made, of those that were freed).

        A storage's stretches never overlap and are sorted by ``lo``, so by ``hi`` too:
        the ones ``src`` replaces are found by bisection, and a call that stages many
        patches in one bucket pays O(log n) a patch, not O(n)."""
        if src.mixed is not None:
            self.mixed_seen = True
        if src.replaced is not None:
            self.replaced_seen = True
        got = self._by_key.get(key)
        if got is None:
            self._by_key[key] = [src]
            if src.ref is not None:
                self._weak.add(key)
            return
        if key in self._weak or src.ref is not None:
            got = [e for e in got if e.ref is None or not e.ref.expired()]
            if any(e.ref is not None for e in got) or src.ref is not None:
                self._weak.add(key)
            else:
                self._weak.discard(key)
            self._by_key[key] = got
        first = bisect.bisect_right(got, src.lo, key=_HI)  # the first that ends past lo
        after = bisect.bisect_left(got, src.hi, key=_LO, lo=first)  # the first at/after hi
        got[first:after] = _trimmed(got, first, after, src.lo, src.hi, (src,))

    def _find(self, t: torch.Tensor, key: tuple) -> _Source | None:
        """The stretch where ``t`` starts, if ``t``'s storage has one that is alive."""
        got = self._by_key.get(key)
        if got is None:
            return None
        first = t.storage_offset() * t.element_size()
        at = bisect.bisect_right(got, first, key=_LO) - 1  # the last that starts by first
        hit = got[at] if at >= 0 and first < got[at].hi else None
        if hit is not None and hit.ref is not None and hit.ref.expired():
            # The storage an op made was freed, and its address is in use again.
            alive = [e for e in got if e.ref is None or not e.ref.expired()]
            if alive:
                self._by_key[key] = alive
            else:
                del self._by_key[key]
            return None
        return hit

    def lookup(
        self, t: torch.Tensor, *, exact: bool = False, key: tuple | None = None
    ) -> tuple[int, str, int] | None:
        """``(position, name, checkpoint offset of t's first element)``, or ``None``;
        with ``exact``, only for an exact stretch (see the class docstring). ``key``:
        ``t``'s storage key, where the caller has it already. The offset is ``None`` where
        it is not known, and where ``t``'s elements are no checkpoint elements (a view of
        the stretch's bytes as another element size: :meth:`locate` gives its box)."""
        hit = self._find(t, _storage_key(t) if key is None else key)
        if hit is None or hit.name is None or (exact and not hit.exact):
            return None
        if hit.base is None or t.element_size() != _unit(hit, t):
            return hit.position, hit.name, None
        return hit.position, hit.name, t.storage_offset() - hit.base

    def locate(self, t: torch.Tensor, key: tuple | None = None
               ) -> tuple[int, str, int | None, tuple[int, ...] | None,
                          tuple[int, ...] | None] | None:
        """:meth:`lookup`, with the checkpoint elements ``t`` reads: ``(position, name,
        checkpoint offset, shape, strides)``, the last two ``None`` where they are ``t``'s
        own (its elements are the checkpoint's, or their place is not known), else in the
        checkpoint's elements: the box of those that ``t``'s bytes touch
        (:func:`_box_in_units`: rows of ``w.view(torch.uint8)`` are rows of ``w``). The
        offset is ``None`` where not known, or where those elements make no box."""
        hit = self._find(t, _storage_key(t) if key is None else key)
        if hit is None or hit.name is None:
            return None
        if hit.base is None:
            box = None if hit.layout is None else _in_layout(hit, t)
            if box is None:
                return hit.position, hit.name, None, None, None
            return hit.position, hit.name, *box
        unit = _unit(hit, t)
        if t.element_size() == unit:
            return hit.position, hit.name, t.storage_offset() - hit.base, None, None
        box = _box_in_units(t, unit)
        if box is None:
            return hit.position, hit.name, None, None, None
        first, shape, stride = box
        return hit.position, hit.name, first - hit.base, shape, stride

    def stretches(self, t: torch.Tensor) -> list[_Source]:
        """The live stretches that ``t``'s bytes reach into, in storage order (a scratch
        tensor filled a row at a time holds one per row, each with its own ``base``)."""
        got = self._by_key.get(_storage_key(t))
        if not got:
            return []
        lo, hi = _byte_span(t)
        at = max(bisect.bisect_right(got, lo, key=_LO) - 1, 0)
        out = []
        for e in got[at:]:
            if e.lo >= hi:
                break
            if e.hi > lo and (e.ref is None or not e.ref.expired()):
                out.append(e)
        return out

    def read_as(self, t: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether ``t``'s storage holds no stretch, or one only, whose bytes are of
        ``dtype`` (a complex dtype's counting as its real one's) or of no known dtype:
        then no part of ``t`` reads a patch's bytes as another dtype, without a search of
        :meth:`stretches` (a staged tensor's storage holds one stretch). ``False`` says
        nothing: a search answers."""
        got = self._by_key.get(_storage_key(t))
        if not got:
            return True
        if len(got) > 1:
            return False
        held = got[0].dtype
        return (got[0].misread is None and not got[0].shift
                and (held is None or held.to_real() == dtype))

    def derive(self, src: torch.Tensor, out: torch.Tensor, *, whole: bool) -> bool:
        """``out`` is an element-for-element copy of ``src`` (a cast, a clone, a scratch
        copy); ``whole``: ``out`` is all of a new storage (an op's result), not a part of
        one that may hold other data. ``out`` no longer holds what it held before: an
        untraced source makes it untraced."""
        if not out.numel():
            return False
        okey = _storage_key(out)
        hit = self._find(src, _storage_key(src)) if self._by_key else None
        follow = (src.numel() == out.numel()  # (not a broadcast)
                  and src.is_contiguous() and out.is_contiguous())
        if (follow and hit is not None and hit.base is not None
                and _byte_span(src)[1] <= hit.hi):  # (the common case: one stretch)
            lo, hi = _byte_span(out)
            misread = _misread(hit, src, out)
            self._put(okey, _Source(lo, hi, hit.position, hit.name,
                                    _carried_base(hit, src, out),
                                    hit.exact and whole and misread is None,
                                    _weak_storage(out), _bits_dtype(hit, src, out), misread,
                                    None if hit.mixed is None else _mixed_for(out, hit.mixed),
                                    _carried_shift(hit, src, out),
                                    replaced=_carried_replaced(hit, src, out)))
            return True
        box = None
        if (whole and hit is not None and hit.name is not None and hit.misread is None
                and (hit.base is None) is not (hit.layout is None) and not (
                    follow and hit.base is not None)
                and out.shape == src.shape and src.element_size() == _unit(hit, src)
                and _byte_span(src)[1] <= hit.hi and _packed(out)):
            # A cast or clone of a strided view of one patch's own elements (a column
            # slice, ``w[:, 2:5].to(torch.bfloat16)``; a transposed view, whose copy keeps
            # its order of dimensions), or of a view of such a copy: each element of
            # ``out`` is the checkpoint element of ``src`` at the same index; no ``base``
            # says where, but the view's place in the checkpoint does.
            if hit.base is not None:
                box = src.storage_offset() - hit.base, tuple(src.stride())
            else:
                found_box = _in_layout(hit, src)
                if found_box is not None:
                    box = found_box[0], found_box[2]
        if box is not None:
            lo, hi = _byte_span(out)
            self._put(okey, _Source(
                lo, hi, hit.position, hit.name, None, False, _weak_storage(out),
                _bits_dtype(hit, src, out), None,
                None if hit.mixed is None else _mixed_for(out, hit.mixed),
                layout=(box[0], tuple(src.shape), box[1], tuple(out.stride()),
                        out.storage_offset()), nan_kept=_unchanged(hit),
                replaced=_carried_replaced(hit, src, out)))
            return True
        found = self.stretches(src) if self._by_key else []
        if follow and found:
            # A source that reaches several stretches, or starts where none is (a scratch
            # buffer of two patches, or padding then a patch): each stretch is followed
            # to the elements of ``out`` it becomes, the rest of ``out`` holds none.
            lo, hi = _byte_span(out)
            if not whole and okey in self._by_key:
                self._forget(okey, lo, hi)
            ss, os_ = src.element_size(), out.element_size()
            s0 = src.storage_offset()
            ref = _weak_storage(out)
            for e in found:
                k0 = max(e.lo - s0 * ss, 0) // ss
                k1 = -(-(min(e.hi, _byte_span(src)[1]) - s0 * ss) // ss)
                misread = _misread(e, src, out)
                self._put(okey, _Source(
                    lo + k0 * os_, lo + k1 * os_, e.position, e.name,
                    _carried_base(e, src, out), e.exact and whole and misread is None,
                    ref, _bits_dtype(e, src, out), misread,
                    None if e.mixed is None else _mixed_for(out, e.mixed),
                    _carried_shift(e, src, out), nan_kept=misread is None and _unchanged(e),
                    replaced=_carried_replaced(e, src, out)))
            return True
        if not whole:
            # A copy into a tensor of the loader's own (a scratch buffer) that cannot be
            # followed element for element (a transposed or column-sliced source or
            # destination): ``out`` holds ``src``'s data now, at offsets nobody knows, its
            # bytes of the dtype they were (so that a view of them as another dtype is
            # refused as it is for ``src``).
            self._moved_into(out, [(src, e) for e in found],
                             nan_kept=self.mixing and self._all_unchanged((src,)))
        return False

    def source_of(self, args: Sequence[Any], kwargs: dict) -> tuple[int | None, str] | None:
        """``(position, name)`` of the one patch that the tensor arguments of an op (lists
        of tensors too) come from, or ``None``: none traced, or more than one patch."""
        if not self._by_key:
            return None
        found = None
        for _, hit in self._traced_data((*args, *kwargs.values())):
            if hit.name is None:  # (data of several patches already)
                return None
            who = (hit.position, hit.name)
            if found is not None and found != who:
                return None
            found = who
        return found

    def _traced(self, args: Iterable[Any]) -> Iterator[tuple[torch.Tensor, _Source]]:
        """Each tensor among ``args`` (lists and tuples of tensors too) that holds a
        patch's data, with each stretch it reaches (not only the one where it starts: a
        scratch buffer whose first rows are padding holds a patch's data further on)."""
        for a in args:
            for t in a if isinstance(a, list | tuple) else (a,):
                if isinstance(t, torch.Tensor) and t.numel():
                    for hit in self.stretches(t):
                        yield t, hit

    def _traced_data(self, args: Iterable[Any]) -> list[tuple[torch.Tensor, _Source]]:
        """:meth:`_traced`, less the integer and boolean tensors where a floating-point
        one is traced too: those are an op's indices or mask (``w[order]``, a gather, a
        ``where``), which say where the data goes, not what it is (an ``argsort`` of patch
        a that orders patch b's rows: the result is b's data)."""
        found = list(self._traced(args))
        if len(found) > 1:
            data = [f for f in found if _inexact(f[0])]
            if data:  # (none: bits moved as integers, ``w.view(torch.int32)``'s)
                return data
        return found

    def taint(self, out: torch.Tensor, args: Sequence[Any], kwargs: dict | None = None,
              func: Any = None) -> None:
        """``out``, a new tensor an op made from ``args`` (and ``kwargs``' values), holds
        the data of the patches they are traced to, at offsets nobody knows: one patch's
        (named), or several patches' (a ``torch.cat`` of two: kept for its dtype only).
        ``func``: the op, which in a sparse call may mix those data (see :meth:`mixed_by`)."""
        if not out.numel() or not self._by_key:
            return
        okey = _storage_key(out)
        for a in args:  # an op that hands back its input: no new data
            if isinstance(a, torch.Tensor) and _storage_key(a) == okey:
                return
        if self.mixing and func is not None and _makes_anew(func):
            # (``torch.zeros_like(w)``: a tensor of the loader's own, none of w's numbers;
            # in a sparse call, no element of it keeps: where it replaces a NaN,
            # ``torch.where(w.isnan(), torch.zeros_like(w), w)``, the constant is the
            # loader's)
            if okey in self._by_key:
                self._forget(okey, *_byte_span(out))
            return
        found = self._traced_data((*args, *kwargs.values()) if kwargs else args)
        if found:
            kept = False  # (whether no NaN of the patches' data is replaced in out)
            if self.mixing:
                if func is None or _rearranges(func):
                    kept = self._all_unchanged(args)
                elif _keeps_nan(func):
                    kept = _traced_unchanged(found)
            floating = _inexact(out)
            mixed = (self.mixed_by(func, found, args, kwargs or {}, out.numel(), out)
                     if func is not None and self.mixing and floating else None)
            if (mixed is None and not kept and self.mixing and floating
                    and func is not None and _slices_of(func)):
                # (a sum of rows kept or updated whole: where it holds no NaN, updates
                # only, as an element-wise op's that keeps NaN NaN)
                kept = _traced_unchanged(found)
            self._moved_into(out, found, mixed, nan_kept=kept,
                             replaced=(self._replaced_by(func, args, kwargs or {}, found, out)
                                       if floating else self._counted_marks(func, found))
                             if self.mixing else None)

    def _all_unchanged(self, args: Sequence[Any]) -> bool:
        """Whether every floating-point tensor among ``args`` (lists of tensors too) lies
        in one stretch whose elements are its patches' staged ones, unchanged
        (:func:`_unchanged`): an element move of them makes :attr:`_Source.nan_kept` data.
        A tensor of the loader's (untraced) among them: ``False``."""
        seen = False
        for a in args:
            for t in _listed(a):
                if not isinstance(t, torch.Tensor) or not _inexact(t) or not t.numel():
                    continue
                got = self.stretches(t)
                if len(got) != 1 or not _unchanged(got[0]):
                    return False
                if not _inside(t, got[0]):
                    return False
                seen = True
        return seen

    def _replaced_by(self, func: Any, args: Sequence[Any], kwargs: dict,
                     found: list[tuple[torch.Tensor, _Source]], out: torch.Tensor
                     ) -> tuple[int | None, str | None, str, tuple | None] | None:
        """What :attr:`_Source.replaced` says of ``out``, the floating-point result of op
        ``func`` (``None``: a copy or cast) of ``args`` and ``kwargs`` in a sparse call,
        whose inputs traced to patches' data are ``found`` (each with a stretch it
        reaches): carried from an input that says one, or made by ``func`` where it may
        make a number of a NaN of a patch that may hold NaN (:meth:`_replacing`);
        ``None`` otherwise. Which of its elements keep: :meth:`_keep_made`."""
        got = (next((e.replaced for _, e in found if e.replaced is not None), None)
               if self.replaced_seen else None)
        if got is None and self.replaced_seen and func is not None and _pairs(func):
            # (an integer or boolean operand made of a patch's marks, which found leaves
            # out as a mask: ``(a > 0) * b`` of a ``b`` all updated, where ``a`` keeps,
            # writes 0.0 or b, not known which is right)
            got = next((e.replaced for _, e in self._mask_operands(func, args, kwargs)
                        if e.replaced is not None), None)
            if got is not None:
                return (*got[:3], None)
        if got is None:
            if func is None or not _replaces_nan(func):
                return None  # (most ops: no search)
            who = self._replacing(func, _inputs(func, args, kwargs), found)
            if who is None:
                return None
            got = (*who, _op_name(func), None)
        keep = self._keep_made(func, args, kwargs, out)
        return (*got[:3], None if keep is None else _keep_at(keep, out))

    def _counted_marks(self, func: Any, found: list[tuple[torch.Tensor, _Source]]
                       ) -> tuple[int | None, str | None, str, None] | None:
        """:attr:`_Source.replaced` of an integer or boolean result of op ``func``
        (``None``: a copy or cast) in a sparse call, whose inputs traced to patches' data
        are ``found``: an op that reads a patch's floating-point data not sent whole
        makes numbers of its NaN, the "keep" marks, as ``argmax``, ``w > 0``, a sort's or
        a ``max``'s indices do (a kept row's index is 0, not the runtime tensor's; ``NaN
        > 0`` is ``False``), at places not known; made from such a result, the same
        (``~(w > 0)``). ``isnan`` and ``isfinite`` say where the marks are and make
        none. A copy into the model of it, or of what a cast, a ``where`` or a pick of
        the loader's own data by it makes, is refused where it changes an element
        (:meth:`~patchkit.intercept.WriteSession._replaced_loss`); as the indices of a
        move of a patch's data (``w.gather(1, perm)``) it is none of the result's data
        (:meth:`_keep_made`)."""
        for t, e in found:
            if (func is not None and _inexact(t)
                    and _base_name(func) not in _EXACT_MARKS
                    and (e.name is None or not self.sent_whole(e.position, e.name))):
                return e.position, e.name, _op_name(func), None
        return next(((*e.replaced[:3], None) for _, e in found if e.replaced is not None),
                    None)

    def _replacing(self, func: Any, inputs: Sequence[Any],
                   found: list[tuple[torch.Tensor, _Source]]
                   ) -> tuple[int | None, str | None] | None:
        """``(position, name)`` of the patch whose NaN op ``func`` may make numbers of,
        reading ``inputs`` (``found``: those traced to patches' data, with a stretch
        each): a floating-point one of a patch not sent whole (``None, None``: of data of
        several patches), where ``func`` is one of :func:`_replaces_nan` (a pick or put
        only where its condition, mask or index is traced to patches' data); else
        ``None``."""
        kind = _replaces_nan(func)
        if not kind:
            return None
        if kind is _SELECTS and not any(
                not _inexact(t) for t, _ in self._traced(inputs)):
            return None  # (a mask of the loader's own picks, as a move does)
        for t, e in found:
            if _inexact(t) and e.mixed is None and (
                    e.name is None or not self.sent_whole(e.position, e.name)):
                return e.position, e.name
        return None

    def _keep_of(self, t: Any) -> torch.Tensor | bool | None:
        """Which elements of ``t``, an input of an op, hold a patch's "keep": where it
        is data an op made numbers of NaN in, the stretch's mask (:func:`_keep_in`);
        other patches' data, its NaN; ``None`` where it holds no patch's data (a tensor
        of the loader's or the model's own, a number); ``False`` where not known."""
        if not isinstance(t, torch.Tensor):
            return None
        if not _inexact(t):
            # (indices or a mask made of the marks, :meth:`_counted_marks`: not known)
            return (False if t.numel() and any(e.replaced is not None
                                               for e in self.stretches(t)) else None)
        hits = self.stretches(t) if t.numel() else []
        if not hits:
            return None
        if all(e.replaced is None for e in hits):
            return False if t.is_meta else nan_mask(t.detach())
        got = _keep_in(hits[0], t) if len(hits) == 1 else None
        return False if got is None else got

    def _keep_made(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor
                   ) -> torch.Tensor | None:
        """Which elements of ``out`` hold a patch's "keep", ``out`` made (or, in place,
        about to be written: read before) by ``func`` of ``args`` and ``kwargs``: an
        element-wise op's, where an input's element at that place does (broadcast; a
        ``where``'s too: ``torch.where(w.isnan(), param, w)`` holds ``param``'s values
        where ``w`` keeps); a move's (``flip``, ``cat``, indexing), the same move of its
        inputs' masks; a put's, its destination's (all of one of the loader's own, which
        holds no update), with the value's where it puts a patch's data. ``None``: not
        known (a matmul's, a reduction's), or ``func`` is none of these. An element
        made of several patches' elements keeps where all of them keep (where one
        updates, the merge should write it: ``buf.nan_to_num_().mul_(0.0).add_(b)``
        holds b's updates where a kept); the pairing check sees the others
        (:meth:`_paired`). An input whose mask is not known constrains none (a scale
        made of them, ``w / w.nan_to_num().abs().amax()``), unless all are such."""
        if func is None or out.is_meta or not out.numel():
            return None
        try:
            if func in _PUT_VALUES:
                dest = self._keep_of(args[0] if args else None)
                if dest is False:
                    return None
                keep = (torch.ones(out.shape, dtype=torch.bool, device=out.device)
                        if dest is None else dest.to(out.device).expand(out.shape).clone())
                value = _arg(func, args, kwargs, _PUT_VALUES[func])
                put = self._keep_of(value)
                if put is False:
                    return None
                if put is not None:
                    _put_again(func, args, kwargs)(keep, put.to(out.device))
                return keep
            if _element_wise(func):
                keep, unknown = None, False
                for t in _inputs(func, args, kwargs):
                    got = self._keep_of(t)
                    if got is False and _pairs(func) and not _inexact(t):
                        return None  # (``(w > 0) * b``: b's update, times which w's mark?)
                    if got is False:
                        unknown = True
                    elif got is not None:
                        got = got.to(out.device)
                        keep = got if keep is None else keep & got
                if keep is None:
                    return None if unknown else torch.zeros(
                        out.shape, dtype=torch.bool, device=out.device)
                return keep.expand(out.shape)
            if func in _MOVES:
                first = args[0]
                ins = list(first) if isinstance(first, list | tuple) else [first]
                masks = []
                for t in ins:
                    got = self._keep_of(t)
                    if got is False:
                        return None
                    masks.append(torch.zeros(t.shape, dtype=torch.bool, device=t.device)
                                 if got is None else got)
                if all(self._keep_of(t) is None for t in ins) and any(
                        self._keep_of(i) is False for a in (*args[1:], *kwargs.values())
                        for i in (a if isinstance(a, list | tuple) else (a,))):
                    # (``h.gather(1, w.argsort(1))``, ``h[w.argmax(1)]``: picked by the
                    # marks)
                    return None
                return func(masks if isinstance(first, list | tuple) else masks[0],
                            *args[1:], **kwargs).to(out.device)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None  # (an op the masks cannot replay: not known)
        return None

    def replacing_in_place(self, func: Any, args: Sequence[Any], kwargs: dict,
                           written: Sequence[torch.Tensor]) -> list | None:
        """Before op ``func`` writes ``written`` (tensors of the loader's own, or staged
        ones) in place or as its ``out=``, in a sparse call: ``(tensor, replaced)`` for
        each floating-point one of them, where ``func`` may make a number of a NaN of a
        patch's data among its inputs (see :meth:`_replacing`; ``buf.nan_to_num_()``,
        ``w.masked_fill_(w.isnan(), 0.0)``, ``w[w.isnan()] = 0.0``), or an input holds
        such data already (``buf.mul_(2.0)`` of one), each with which of its elements
        keep (:meth:`_keep_made`) read now; ``None`` where neither. Handed to
        :meth:`replaced_in_place` once the op has run."""
        if not self.replaced_seen and not _replaces_nan(func):
            return None  # (``buf.mul_(2.0)`` before any such op: no search)
        inputs = _inputs(func, args, kwargs)
        found = self._traced_data(inputs)
        got = next((e.replaced for _, e in found if e.replaced is not None), None)
        if got is None:
            if not _replaces_nan(func):
                return None
            who = self._replacing(func, inputs, found)
            if who is None:
                return None
            got = (*who, _op_name(func), None)
        out = []
        for t in written:
            if _inexact(t):
                keep = self._keep_made(func, args, kwargs, t)
                out.append((t, (*got[:3], None if keep is None else _keep_at(keep, t))))
        return out

    def replaced_in_place(self, marks: list) -> None:
        """Each tensor of ``marks`` (from :meth:`replacing_in_place`) holds, from now on,
        data whose NaN an op may have made numbers of: its stretches say so (with which
        of its elements keep, read before the op)."""
        for t, r in marks:
            key = _storage_key(t)
            got = self._by_key.get(key)
            if not got:
                continue
            lo, hi = _byte_span(t)
            self._by_key[key] = [e._replace(replaced=r) if e.lo < hi and lo < e.hi
                                 and e.mixed is None else e for e in got]
            self.replaced_seen = True

    def mixed_by(self, func: Any, found: list[tuple[torch.Tensor, _Source]],
                 args: Sequence[Any], kwargs: dict, size: int,
                 out: torch.Tensor | None = None
                 ) -> tuple[int | None, str | None, str] | _Sliced | None:
        """``(position, name, op)`` where ``func``, an op that makes a floating-point
        output, mixes elements (see :func:`_mixes`) and one of its floating-point inputs
        ``found`` (each with a stretch it reaches) is traced to a patch's data and holds
        NaN, a sparse patch's "keep": the output holds that NaN spread over elements the
        patch updates, or its numbers at other places, which a NaN-merge would take
        element by element. Read only at such ops (rare in loaders); ``None`` otherwise
        (a mixed input is carried by :meth:`_moved_into` itself). ``args`` and ``kwargs``:
        the op's arguments; ``size``: the number of elements of its (first) output. A put
        that adds or reduces (:data:`_COMBINING_PUTS`) mixes only where it puts two
        elements at one place; a reduction (``torch.Tag.reduction``) only where it reduces
        a dim longer than 1 (an input of ``size`` elements: ``torch.stack([w]).sum(0)``);
        an op over slices (:func:`_slices_of`: a reduction, a scan, a softmax, a sort, a
        matmul) only where a slice both keeps and updates, or its result ``out`` (``None``:
        in place, decided once it has run) is not NaN exactly where they keep
        (:meth:`_sliced`).
        An element-wise op (:func:`_pairs`) mixes where it pairs different elements of
        patches' data (see :meth:`_paired`)."""
        kind = _mixes(func)
        if not kind:
            if _pairs(func):
                masked = self._masked_by_patch(func, found, args, kwargs)
                if masked is not None:
                    return masked
            if len(found) > 1 and _pairs(func):
                return self._paired(func, found)
            return None
        if kind is _PUT and not _combines(func, args, kwargs):
            return None
        read: list[tuple[torch.Tensor, _Source]] = []
        for t, e in found:
            if (e.mixed is not None or t.is_meta
                    or not _inexact(t)
                    or (kind is _REDUCES and t.numel() == size)
                    or any(t is r for r, _ in read)):
                continue
            read.append((t, e))
        if read and kind is not _PUT and _slices_of(func):
            return self._sliced(func, read, args, kwargs, out)
        for t, e in read:
            if bool(nan_mask(t).any()):
                if kind is _PUT and not _puts_repeat(func, args, kwargs):
                    return None
                return e.position, e.name, _op_name(func)
        return None

    def _mask_operands(self, func: Any, args: Sequence[Any], kwargs: dict
                       ) -> list[tuple[torch.Tensor, _Source]]:
        """The integer and boolean tensors among op ``func``'s inputs that hold a
        patch's data (``w > 0``, ``w.argmax(1)``), each with a stretch it reaches: what
        :meth:`_traced_data` leaves out as an op's mask or indices. Most element-wise ops
        (``w * scale``) have none, found without a look-up."""
        masks = [t for a in _inputs(func, args, kwargs)
                 for t in (a if isinstance(a, list | tuple) else (a,))
                 if isinstance(t, torch.Tensor) and not _inexact(t)]
        return list(self._traced(masks)) if masks else []

    def _masked_by_patch(self, func: Any, found: list[tuple[torch.Tensor, _Source]],
                         args: Sequence[Any], kwargs: dict
                         ) -> tuple[int | None, str | None, str] | None:
        """``(position, name, op)`` where element-wise op ``func`` pairs an integer or
        boolean operand made of a patch's data (``w > 0``, ``w.isnan()``, of any patch,
        sent whole too) with floating-point data of patches ``found`` that holds NaN:
        ``(a > 0) * b`` is NaN where ``b`` keeps, so an update of ``a`` there is lost,
        and where ``b`` updates it is paired with an element of ``a``'s that may keep
        (as :meth:`_paired` refuses ``a * b``). ``None`` where there is none such."""
        if not found or not self._mask_operands(func, args, kwargs):
            return None
        for t, e in found:
            if (not t.is_meta and _inexact(t)
                    and e.mixed is None and bool(nan_mask(t).any())):
                return e.position, e.name, _op_name(func)
        return None

    def _sliced(self, func: Any, read: list[tuple[torch.Tensor, _Source]],
                args: Sequence[Any], kwargs: dict, out: torch.Tensor | None
                ) -> tuple[int | None, str | None, str] | _Sliced | None:
        """:meth:`mixed_by` for op ``func`` of :func:`_slices_of`, whose floating-point
        inputs traced to patches' data are ``read`` (each tensor once, with a stretch it
        reaches): it mixes (``(position, name, op)``, of the first that holds NaN) where
        one holds NaN and, for an element of its result ``out``, the elements of all of
        them it is computed from (its slices: a row of ``w.sum(1)``, ``w.amax(1,
        keepdim=True)``, ``w.sort(1)``, ``w.cumsum(1)``, ``w.softmax(1)``, ``w @ h``; the
        whole of ``w`` for ``w.amax()``; row i of ``a`` and column j of ``b`` for
        element (i, j) of ``a @ b``) both keep (NaN) and update (none), or ``out`` is not
        NaN exactly where they all keep, or a complex input's parts do not keep alike.
        Otherwise the merge keeps the runtime value where they all keep, made by the
        same op of the same kept elements, and writes the others, made of updates only
        (so not ``nansum``'s sum of a kept row, a number, nor a matmul whose other
        operand holds an infinity, which makes NaN of an update). One host wait.
        ``out`` ``None`` (an in-place or ``out=`` op, read before it runs): what was
        read, for :meth:`settled`."""
        keeps = [nan_mask(t) for t, _ in read]
        lo = hi = None
        exact = False
        try:
            for (t, _), keep in zip(read, keeps):
                got = _slice_masks(func, args, kwargs, t, keep)
                if got is None:
                    lo = hi = None
                    break
                exact = exact or got[2]
                lo = got[0] if lo is None else lo & got[0]
                hi = got[1] if hi is None else hi | got[1]
        except (RuntimeError, TypeError, IndexError, ValueError):
            lo = hi = None  # (masks that do not broadcast together: mixed)
        op = _op_name(func)
        if lo is not None and self.lost and any(self.lost.of(t) is not None for t, _ in read):
            lo = None  # (a number a cast made NaN: no "keep", a lost update; rare)
        if lo is None:
            for (_, e), keep in zip(read, keeps):
                if bool(keep.any()):
                    return e.position, e.name, op
            return None
        device = keeps[0].device
        parts = torch.ones((), dtype=torch.bool, device=device)
        for t, _ in read:
            if t.is_complex():
                parts = parts & (torch.isnan(t.real) == torch.isnan(t.imag)).all().to(device)
        holds = torch.stack([k.any().to(device) for k in keeps])
        got = _Sliced([(e.position, e.name, op) for _, e in read], holds, parts,
                      (lo, hi, exact))
        return got if out is None else self.settled(got, [out])

    def settled(self, sliced: _Sliced, outs: Sequence[Any]
                ) -> tuple[int | None, str | None, str] | None:
        """What :meth:`_sliced` read (``sliced``), decided now that the op has made (or
        written) ``outs``: ``None`` where no input held NaN, or where each
        floating-point tensor of ``outs`` is NaN exactly where its slices keep
        (:func:`_slices_agree`); else what it mixes. One host wait."""
        ok = sliced.parts
        try:
            for o in outs:
                if isinstance(o, torch.Tensor) and _inexact(o):
                    ok = ok & _slices_agree(sliced.masks, o).to(ok.device)
        except (RuntimeError, TypeError, IndexError, ValueError):
            ok = torch.zeros((), dtype=torch.bool, device=ok.device)
        *holds, ok = torch.cat([sliced.holds, ok.reshape(1)]).tolist()
        if ok:
            return None
        return next((who for who, h in zip(sliced.mixed, holds) if h), None)

    def sent_whole(self, position: int | None, name: str | None) -> bool:
        """Whether patch ``position`` (named ``name``) of the call in progress is sent
        whole: dense, or sparse with an index for every element (its staged tensor holds
        no NaN)."""
        p = self.patches.get(position) if position is not None else None
        if p is None or p.name != name:
            return False
        return p.indices is None or p.indices.numel() >= math.prod(p.shape)

    def _paired(self, func: Any, found: list[tuple[torch.Tensor, _Source]]
                ) -> tuple[int | None, str | None, str] | None:
        """``(position, name, op)`` where element-wise op ``func`` pairs different
        elements of patches' data, one of them holding NaN (a sparse patch's "keep"):
        ``w - w[0]``, ``w[:, 1:] - w[:, :-1]``, ``w + w.flip(0)``, ``q * k``. Each output
        element then combines two patch elements, so a NaN in either makes it NaN (the
        merge keeps it, and the other element's update is lost) and numbers land at
        other elements' places. ``found``: its floating-point inputs traced to patches'
        data (two or more), each with a stretch it reaches.

        Inputs that map every element of their broadcast shape (their output's, less the
        dims only other inputs add) to the same element of the same patch pair nothing
        (``w * w``, ``w + w.clone()``, ``w[0] + w[0]``), and are decided without a read.
        Otherwise their NaN is read (rare in loaders): none holds any, none mixes. An
        input that holds none of the NaN mixes where it is at a known place in its patch
        (offset and strides), or at any place where its patch was sent whole
        (``w * scale``, ``w * scale.abs()`` of a scale sent whole, ``w[2:] * w[:2]``
        where rows 2-3 are all updated), where it is made from patches' staged elements
        by moves, copies and element-wise ops that keep NaN NaN, so that no NaN was
        replaced (:attr:`_Source.nan_kept`: ``a * b.flip(1)[0]``, ``a * b.abs()[0]``),
        or where it is a
        part of a stretch of a patch's
        data the loader made (a move's result, ``x = w.flip(0)``) that another input,
        holding NaN, lies in too (``x - x[0]``, :func:`_place_in_stretch`): its update
        is lost wherever another keeps.
        Else the NaN masks decide: two inputs that hold NaN at different places
        (broadcast) mix (``w - w[0]``, ``w + w.flip(0)``, two patches that keep
        different elements); NaN at the same places is let through, since the result is
        then right: where all keep, the runtime value made of the kept elements stays,
        and where all update, the new one lands (``a + b`` of two patches that keep the
        same elements, ``w[:, ::2] + w[:, 1::2]`` where even and odd columns keep alike,
        ``w * w.abs()``). So is NaN in one input only where the others' place is not
        known and their patches were not sent whole (a scratch the loader made anew from
        an earlier patch's data, ``buf.copy_(x.nan_to_num())``, then added to)."""
        if any(e.mixed is not None for _, e in found):
            return None  # (mixed already: carried, the op that mixed first named)
        data: list[tuple[torch.Tensor, list[_Source]]] = []  # (each tensor once)
        for t, e in found:
            if t.is_meta or not _inexact(t):
                continue  # (a meta tensor has no values to read)
            got = next((hits for d, hits in data if d is t), None)
            if got is None:
                data.append((t, [e]))
            else:
                got.append(e)  # (a tensor that reaches two stretches: no one place)
        if len(data) < 2:
            return None
        try:
            shape = torch.broadcast_shapes(*(t.shape for t, _ in data))
        except RuntimeError:
            return None  # (inputs that do not broadcast together: not paired so)
        places = [_place_in_patch(t, hits[0], shape) if len(hits) == 1 else None
                  for t, hits in data]
        if places[0] is not None and all(p == places[0] for p in places[1:]):
            return None  # (the same elements of one patch: ``w * w.clone()``)
        nan = [nan_mask(t) for t, _ in data]
        holds = [bool(m.any()) for m in nan]
        if not any(holds):
            return None
        first = holds.index(True)
        who = data[first][1][0]
        op = _op_name(func)
        # (a patch's numbers, lost where another input's NaN are: at a known place, or,
        # where not known, of a patch sent whole, so that no NaN was replaced there, or
        # beside that NaN in one stretch the loader made, ``x - x[0]`` of ``x =
        # w.flip(0)``: no NaN was replaced in a part of what holds NaN in another)
        near = [_place_in_stretch(t, hits[0]) if p is None and len(hits) == 1 else None
                for (t, hits), p in zip(data, places)]
        nan_near = {n for n, h in zip(near, holds) if h and n is not None}
        if any(not h and (p is not None or n in nan_near or _kept_whole(t, hits) or all(
                e.name is not None and self.sent_whole(e.position, e.name) for e in hits))
               for p, n, h, (t, hits) in zip(places, near, holds, data)):
            return who.position, who.name, op
        masks = [m for m, h in zip(nan, holds) if h]
        if len(masks) > 1:
            device = masks[0].device
            ref = masks[0].expand(shape)
            if any(not torch.equal(ref, m.to(device).expand(shape)) for m in masks[1:]):
                return who.position, who.name, op
        return None

    def mixed_in_place(self, func: Any, args: Sequence[Any], kwargs: dict
                       ) -> tuple[int | None, str | None, str] | list | None:
        """:meth:`mixed_by` for an op that writes tensors of the loader's own in place
        (``buf.cumsum_(0)``, ``torch.mm(w, h, out=buf)``), read before it runs: its inputs
        are its arguments less its ``out=`` ones, whose old values it does not read. For
        a ``_foreach_`` op of element-wise ops (``_foreach_add_(bufs, xs)``), a list: what
        each tensor it writes is mixed by, from the inputs at its place (see
        :meth:`written_each`)."""
        kind = _mixes(func) if self._by_key else False
        if not kind:
            # (``buf.mul_(2)``, an element-wise op of one tensor, is common: no search)
            if not _pairs(func):
                return None
            if _foreach_kind(func):
                written = _foreach_written(func, args, kwargs)
                n = len(written)
                inputs = _inputs(func, args, kwargs)
                return [self.mixed_by(func, self._traced_data(_nth(inputs, i, n)), (), {},
                                      t.numel()) if isinstance(t, torch.Tensor) else None
                        for i, t in enumerate(written)]
            if _tensors_in(_inputs(func, args, kwargs)) < 2:
                return None
        elif kind is _PUT and not _combines(func, args, kwargs):
            return None  # (``buf[idx] = w``, a put that moves, is common: no search)
        outs = _out_args(func)
        written = args[0] if args else None
        if outs:
            i, n = outs[0]
            written = args[i] if i < len(args) else kwargs.get(n)
        size = written.numel() if isinstance(written, torch.Tensor) else -1
        return self.mixed_by(func, self._traced_data(_inputs(func, args, kwargs)), args,
                             kwargs, size)

    def taint_each(self, func: Any, args: Sequence[Any], kwargs: dict, outs: list) -> None:
        """:meth:`taint` for the results ``outs`` of a functional ``_foreach_`` op: each
        made from the arguments at its place in the lists (``torch._foreach_add(ws,
        others)``: ``ws[i] + others[i]``, paired as that add is)."""
        n = len(outs)
        keys = list(kwargs)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self.taint(o, _nth(args, i, n), dict(zip(keys, _nth(list(kwargs.values()), i, n))),
                           func)

    def written_each(self, func: Any, args: Sequence[Any], kwargs: dict,
                     mixed: list | None) -> None:
        """:meth:`written_from` (and :meth:`mix`, where ``mixed``, a list from
        :meth:`mixed_in_place`, says so) for each tensor a ``_foreach_`` op wrote in place
        (or into its ``out=`` list), from the arguments at its place in the lists."""
        written = _foreach_written(func, args, kwargs)
        n = len(written)
        keys = list(kwargs)
        for i, t in enumerate(written):
            if isinstance(t, torch.Tensor) and t.numel():
                self.written_from(t, _nth(args, i, n),
                                  dict(zip(keys, _nth(list(kwargs.values()), i, n))))
                if mixed is not None and mixed[i] is not None:
                    self.mix(t, mixed[i])

    def mix(self, t: torch.Tensor, mixed: tuple[int | None, str | None, str]) -> None:
        """``t``, a tensor of the loader's own, was written by an op that mixed its
        inputs' elements (``mixed``, see :meth:`mixed_by`): all it holds is mixed."""
        got = self.stretches(t)
        if got:
            self._moved_into(t, [(t, e) for e in got], mixed)

    def mixed_in(self, t: torch.Tensor) -> tuple[int | None, str | None, str] | None:
        """The first ``mixed`` (see :class:`_Source`) among the stretches ``t`` reaches."""
        for e in self.stretches(t):
            if e.mixed is not None:
                return e.mixed
        return None

    def written_from(self, t: torch.Tensor, args: Sequence[Any], kwargs: dict) -> None:
        """``t``, a tensor that is no runtime tensor, was written in place by an op other
        than a copy (an index put, an ``out=`` op, an ``add_``) whose arguments are
        ``args`` and ``kwargs``: where another of them holds a patch's data, ``t`` holds
        it too from now on, at offsets nobody knows, with what it held itself."""
        key = _storage_key(t)
        found = [(a, e) for a, e in self._traced_data((*args, *kwargs.values()))
                 if _storage_key(a) != key]
        if found:
            self._moved_into(t, [(t, e) for e in self.stretches(t)] + found)

    def _moved_into(self, out: torch.Tensor, found: list[tuple[torch.Tensor, _Source]],
                    mixed: tuple[int | None, str | None, str] | None = None,
                    nan_kept: bool = False, replaced: tuple | None = None) -> None:
        """``out``'s bytes hold, from now on, the data of the stretches in ``found`` (each
        with the tensor that read it), at offsets nobody knows: one patch's, named, or
        several patches', kept for their dtype only (the first says what it is); none:
        ``out`` holds no patch's data. They are mixed (see :class:`_Source`) where
        ``mixed`` says so or a stretch of ``found`` is, and ``out`` is floating-point.
        Any of them misread (:attr:`_Source.misread`) makes all of it misread: a cat of a
        patch's own values and a cast of its bits read as another dtype holds no staged
        NaN in its second part. ``nan_kept``: no NaN of theirs was replaced in ``out``
        (:attr:`_Source.nan_kept`). ``replaced``: what :attr:`_Source.replaced` says of
        ``out``; ``None``: that of the first stretch of ``found`` that says one, where
        ``out`` is floating-point (with no place: ``out`` holds it at offsets nobody
        knows)."""
        okey = _storage_key(out)
        lo, hi = _byte_span(out)
        if not found:
            if okey in self._by_key:
                self._forget(okey, lo, hi)
            return
        t, first = found[0]
        who = (first.position, first.name)
        for _, e in found:
            if e.name is None or (e.position, e.name) != who:
                who = (None, None)
            if mixed is None and e.mixed is not None:
                mixed = e.mixed
        if mixed is not None:
            mixed = _mixed_for(out, mixed)
        misread = next((m for m in (_misread(e, a, out) for a, e in found) if m is not None),
                       None)
        if replaced is None and _inexact(out):
            replaced = next(((*e.replaced[:3], None) for _, e in found
                             if e.replaced is not None), None)
        self._put(okey, _Source(lo, hi, who[0], who[1], None, False, _weak_storage(out),
                                _bits_dtype(first, t, out), misread, mixed,
                                nan_kept=nan_kept and misread is None and mixed is None,
                                replaced=replaced))

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def _forget(self, key: tuple, lo: int, hi: int) -> None:
        """``[lo, hi)`` of storage ``key`` holds no patch's data any more (the bytes of a
        stretch outside it still hold what they held)."""
        got = self._by_key[key]
        first = bisect.bisect_right(got, lo, key=_HI)
        after = bisect.bisect_left(got, hi, key=_LO, lo=first)
        kept = [*got[:first], *_trimmed(got, first, after, lo, hi, ()), *got[after:]]
        if kept:
            self._by_key[key] = kept
        else:
            del self._by_key[key]

    def filled(self, t: torch.Tensor) -> None:
        """``t``, a tensor of the loader's own, was filled with a constant (``fill_``,
        ``zero_``): a contiguous one's bytes hold no patch's data any more (nor data an op
        mixed: see :class:`_Source`). A strided one keeps its stretches (they reach the
        bytes between its elements too), as does a staged tensor filled in place (only
        its exactness goes, :meth:`written`)."""
        key = _storage_key(t)
        got = self._by_key.get(key)
        if got is None or not t.numel() or not t.is_contiguous():
            return
        lo, hi = _byte_span(t)
        if any(e.ref is None and e.lo < hi and lo < e.hi for e in got):
            return
        self._forget(key, lo, hi)

    def written(self, t: torch.Tensor) -> None:
        """``t`` was written in place: its bytes no longer hold what was staged (they
        keep the patch's name, as derived from it)."""
        key = _storage_key(t)
        got = self._by_key.get(key)
        if got is None:
            return
        lo, hi = _byte_span(t)
        self._by_key[key] = [
            e._replace(exact=False, nan_kept=False) if (e.exact or e.nan_kept) and e.lo < hi
            and lo < e.hi else e for e in got
        ]


class _LostMarks:
    """The elements, by storage, that a cast the loader made during a sparse call turned
    from a number into NaN: a value out of range, or an infinity, cast into a floating
    dtype without infinities (float8 ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``). NaN there
    is an update lost, not a patch's "keep", and a sparse copy whose source holds one is
    refused (:meth:`~patchkit.intercept.WriteSession._refuse_marked`), wherever the
    loader's arithmetic left the elements' place in their patch unknown.

    A mark is the byte offset of an element in its storage, with the number it held
    (float64), so it follows the element through every view of that storage. It is
    carried to the output of an element-for-element copy (a cast, a clone,
    ``.contiguous()``, a ``copy_`` into a tensor of the loader's own) and of the ops in
    ``_MOVES`` (``cat``, ``stack``, indexing, ``repeat``, ``roll``, ``flip``, ``gather``,
    ``narrow_copy``, ``take``, ``masked_select``), which move elements without changing
    them, of pointwise ops (arithmetic, ``clamp``, ``where``, ``masked_fill``: a NaN
    stays NaN through them, in its place; a floating element such an op makes a number
    of, ``nan_to_num``'s, loses its mark) and of ``torch._foreach_*`` ops, tensor by
    tensor (:meth:`foreach`), of the functional puts of
    ``_FUNCTIONAL_PUTS`` (``index_copy``, ``slice_scatter``, ``index_add``...), and into
    a tensor of the loader's own by the puts of ``_PUTS`` (``buf[rows] = x``,
    ``index_copy_``, ``masked_scatter_``, ``scatter_``, ``put_``, ``index_fill_``, and
    those that add or reduce: ``index_add_``, ``scatter_add_``, an accumulating
    ``index_put_``), by a fill of a 0-d tensor (``buf.fill_(x[k])``) and by in-place
    pointwise ops (``buf.add_(x)``); a ``copy_``, a put that replaces or a fill
    (``fill_``, ``zero_``, ``masked_fill_``) into a marked tensor of the loader's own
    takes the marks of the elements it overwrote away, and an ``out=`` op all of its
    ``out``'s (a pointwise one's then takes its inputs'). Other ops drop them (a number made from a
    NaN by a matmul or a reduction is NaN, but at a place no mark follows). A mark whose
    element no longer holds NaN counts for nothing. A complex element's marks are on its
    parts (each a real element of ``view_as_real``), so they follow it through
    ``view_as_real``, ``view_as_complex``, ``.real`` and ``.imag``; ``torch.complex``
    gives each part the marks of its own input. An element written takes away the marks
    of every byte it covers (a float32 write through a view of a float8 scratch those
    of four float8 elements), and a ``copy_`` reads its source's marks before it takes
    its destination's away (``buf.copy_(buf)`` keeps them; a source that partly
    overlaps its destination torch refuses before it writes).

    Storages are held by weak reference: a freed one's marks are dropped when its
    address is next looked up, since the allocator may hand it to an unrelated tensor."""

    def __init__(self) -> None:
        # storage key -> (weak storage ref, sorted byte offsets of elements, what each
        # mark says: rows of (number, patch position, checkpoint index), float64, -1
        # where not known)
        self._by_key: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self.names: dict[int, str] = {}  # patch position -> name, of the marks' patches

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def _get(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        got = self._by_key.get(key)
        if got is None:
            return None
        if got[0].expired():
            del self._by_key[key]
            return None
        return got[1], got[2]

    def of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(marked, what)``: which of ``t``'s elements are marked (shaped like ``t``),
        and what each marked one's mark says (shaped like ``t`` plus a last dim of 3:
        the number it held, its patch's position and its checkpoint index, ``-1`` where
        not known; anything where not marked); ``None`` where no element is marked."""
        if not self._by_key or not t.numel() or t.is_meta:
            return None
        if t.is_complex():  # (marked where either part is: the real part's mark first)
            got = self.of(_parts(t))
            if got is None:
                return None
            m, w = got
            return m.any(-1), torch.where(m[..., :1], w[..., 0, :], w[..., 1, :])
        got = self._get(_storage_key(t))
        if got is None:
            return None
        offs, what = got
        here = _storage_offsets(t, None) * t.element_size()
        at = torch.searchsorted(offs, here).clamp_(max=offs.numel() - 1)
        marked = offs[at] == here
        if not bool(marked.any()):
            return None
        return marked.reshape(t.shape), what[at].reshape(*t.shape, 3)

    def unmark(self, t: torch.Tensor, flat: torch.Tensor | None = None) -> None:
        """``t``'s elements (all, or those at row-major positions ``flat``) were
        overwritten: their marks go."""
        key = _storage_key(t)
        got = self._get(key) if self._by_key else None
        if got is None or not t.numel():
            return
        if t.is_complex():  # (both parts of each element)
            self.unmark(_parts(t), None if flat is None else torch.stack(
                [flat * 2, flat * 2 + 1], -1).reshape(-1))
            return
        offs, what = got
        size = t.element_size()
        starts = _storage_offsets(t, flat) * size
        if size == 1:
            keep = ~torch.isin(offs, starts)
        else:
            # (every byte an element covers: a float32 write over a float8 view's marks
            # takes those of its bytes 1-3 away too)
            starts = torch.sort(starts.reshape(-1)).values
            at = torch.searchsorted(starts, offs, right=True) - 1
            keep = (at < 0) | (offs >= starts[at.clamp(min=0)] + size)
        if bool(keep.all()):
            return
        if bool(keep.any()):
            self._by_key[key] = (self._by_key[key][0], offs[keep], what[keep])
        else:
            del self._by_key[key]

    def mark(self, t: torch.Tensor, marked: torch.Tensor, what: torch.Tensor) -> None:
        """Mark ``t``'s elements where ``marked`` (shaped like ``t``), each with what
        its mark says in ``what`` (shaped like ``t`` plus 3: see :meth:`of`). A complex
        ``t`` is marked by parts, where a marked element's part is NaN."""
        if t.is_complex():
            parts = _parts(t)
            self.mark(parts, marked.unsqueeze(-1) & nan_mask(parts.detach()).to(marked.device),
                      what.unsqueeze(-2).expand(*t.shape, 2, 3))
            return
        flat = torch.nonzero(marked.reshape(-1)).reshape(-1)
        if not flat.numel():
            return
        offs = _storage_offsets(t, flat) * t.element_size()
        what = what.reshape(-1, 3)[flat].to(torch.float64)
        key = _storage_key(t)
        got = self._get(key)
        if got is not None:
            offs = torch.cat([got[0], offs])
            what = torch.cat([got[1], what])
        # (sorted, one mark per element: the last made wins)
        offs, order = torch.sort(offs, stable=True)
        what = what[order]
        last = torch.ones_like(offs, dtype=torch.bool)
        last[:-1] = offs[1:] != offs[:-1]
        self._by_key[key] = (_weak_storage(t), offs[last], what[last])

    def copied(self, src: Any, out: torch.Tensor, provenance: _Provenance, *,
               whole: bool) -> None:
        """``out`` is an element-for-element copy of ``src`` (broadcast to its shape),
        made by a cast, a clone or a ``copy_`` (``whole``: ``out`` is a new tensor, which
        held no marks): ``out`` takes ``src``'s marks, and new ones where this copy's own
        cast made a number NaN, each naming the patch and checkpoint index where
        ``provenance`` traces that element of ``src``."""
        readable = (isinstance(src, torch.Tensor) and out.numel() and not out.is_meta
                    and not src.is_meta)
        carried = None
        if readable:
            src = src.detach().expand(out.shape)
            if src.is_complex():  # (part by part; into a real dtype, the real part)
                src = _parts(src) if out.is_complex() else _parts(src)[..., 0]
                out = _parts(out) if out.is_complex() else out
            # (read before ``out``'s marks go: ``buf.copy_(buf)`` copies the same ones)
            carried = self.of(src)
        if not whole:
            self.unmark(out)
        if not readable:
            return
        lost = None
        if (out.dtype != src.dtype and src.dtype.is_floating_point
                and _casts_lose_numbers(out.dtype)):
            made = _lost_in_cast(src.to(out.device), out)
            if bool(made.any()):
                lost = made
        if carried is None and lost is None:
            return
        if lost is None:
            marked, what = (c.to(out.device) for c in carried)  # type: ignore[union-attr]
            self.mark(out, marked, what)
            return
        what = self._origins(src, provenance).to(out.device)
        if carried is not None:
            marked, held = (c.to(out.device) for c in carried)
            what = torch.where(marked.unsqueeze(-1), held, what)
            lost = lost | marked
        self.mark(out, lost, what)

    def _origins(self, src: torch.Tensor, provenance: _Provenance) -> torch.Tensor:
        """What a mark made at each element of ``src`` says (see :meth:`of`): its number,
        and, where ``provenance`` traces it to a patch, that patch's position and, where
        the element's place in it is known, its checkpoint index."""
        what = torch.full((*src.shape, 3), -1.0, dtype=torch.float64, device=src.device)
        what[..., 0] = src
        found = [e for e in provenance.stretches(src) if e.position is not None]
        if not found:
            return what
        at = _storage_offsets(src, None).reshape(src.shape)
        size = src.element_size()
        for e in found:
            inside = (at * size >= e.lo) & (at * size < e.hi)
            what[..., 1][inside] = e.position
            self.names[e.position] = e.name
            if e.base is not None and e.dtype == src.dtype:
                what[..., 2][inside] = (at[inside] - e.base).to(torch.float64)
        return what

    def put(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> None:
        """``func``, a put of ``_PUTS`` (in place: ``out`` is ``args[0]``, a tensor of the
        loader's own) or of ``_FUNCTIONAL_PUTS`` (``out`` a new tensor, a copy of
        ``args[0]`` written so), wrote elements of its value argument, each unchanged (or a
        fill value), at places its other arguments pick: the marks of the elements it
        overwrote go (a scratch filled with ``buf[rows] = x`` for the next patch keeps no
        mark of the last one's numbers), and the value's marks come with its elements. A
        put that adds or reduces (``index_add_``, ``scatter_add_``, an accumulating
        ``put_``) keeps the marks it adds to (a NaN stays NaN), and brings the value's
        where the result is NaN. (Done again on masks, by the put that replaces: which
        elements were written, and which of those are marked.)"""
        dest = args[0] if args else None
        if (not isinstance(dest, torch.Tensor) or not isinstance(out, torch.Tensor)
                or out.is_meta or not out.numel()):
            return
        value = _arg(func, args, kwargs, _PUT_VALUES[func])
        again = _put_again(func, args, kwargs)
        combines = _put_combines(func, args, kwargs)
        replaces = not combines or (_base_name(func) in ("scatter_reduce", "index_reduce")
                                    and not _arg(func, args, kwargs, "include_self"))
        in_place = out is dest
        # (read before any mark goes: the value may be a view of the destination)
        carried = self.of(value.detach()) if isinstance(value, torch.Tensor) else None
        held = None if in_place else self.of(dest.detach())

        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(out.shape, dtype=dtype, device=out.device)

        written = None
        if replaces:
            written = again(zeros(torch.bool), torch.ones(
                value.shape, dtype=torch.bool, device=out.device)
                if isinstance(value, torch.Tensor) else True)
            if in_place:
                self.unmark(out, torch.nonzero(written.reshape(-1)).reshape(-1))
        marked = what = None
        if held is not None:
            marked, what = (h.to(out.device) for h in held)
            if written is not None:
                marked = marked & ~written
        if carried is not None:
            m, w = (c.to(out.device) for c in carried)
            moved = again(zeros(torch.bool), m)
            brought = torch.stack([again(zeros(torch.float64), w[..., c]) for c in range(3)], -1)
            if marked is None:
                marked, what = moved, brought
            else:
                what = torch.where(moved.unsqueeze(-1), brought, what)
                marked = marked | moved
        if marked is None:
            return
        if _inexact(out):
            marked = marked & nan_mask(out.detach())
        self.mark(out, marked, what)

    def filled(self, t: torch.Tensor, value: Any = None, where: torch.Tensor | None = None
               ) -> None:
        """``t``, a tensor of the loader's own, was filled (all of it, or where ``where``
        is true, broadcast) with ``value`` (a number, or a 0-d tensor): the marks of what
        it held there go, and a 0-d ``value``'s mark comes to each element filled with
        its NaN (``buf.fill_(x[k])`` of a lost number)."""
        got = (self.of(value.detach()) if isinstance(value, torch.Tensor) and not value.is_meta
               else None)  # (read first: the value may be an element of ``t``)
        if where is None:
            self.unmark(t)
        else:
            self.unmark(t, torch.nonzero(where.expand(t.shape).reshape(-1)).reshape(-1).to(
                t.device))
        if got is None or t.is_meta or not t.numel():
            return
        m, w = (g.to(t.device) for g in got)
        if not bool((m & nan_mask(value.detach()).to(t.device)).all()):
            return
        marked = (torch.ones(t.shape, dtype=torch.bool, device=t.device) if where is None
                  else where.to(t.device).bool().expand(t.shape))
        self.mark(t, marked, w.expand(*t.shape, 3))

    def foreach(self, func: Any, args: Sequence[Any], kwargs: dict, outs: Sequence[Any] | None,
                provenance: _Provenance) -> None:
        """``func``, a ``torch._foreach_*`` op of :func:`_foreach_kind`, made ``outs``
        (its result, a list) or, where ``None``, wrote the tensors of its first argument
        in place (or of its ``out=`` list, anew): each of them as the op it names would
        from the tensors at its place in the lists among its arguments (a tensor or
        number that is not in a list is used for each), copied, filled or made pointwise
        (see :meth:`copied`, :meth:`filled`, :meth:`pointwise`)."""
        kind = _foreach_kind(func)
        inputs = _inputs(func, args, kwargs)
        anew = False
        if outs is None:
            given = _out_args(func)
            if given:
                i, name = given[0]
                outs, anew = (args[i] if i < len(args) else kwargs.get(name)), True
            else:
                outs, inputs = args[0], inputs[1:]  # (in place: ``_foreach_add_(ts, xs)``)
                if kind == "copy":
                    inputs = inputs[:1]
        elif kind == "copy" and _base_name(func) == "copy":
            inputs = inputs[1:2]  # (``_foreach_copy(ts, srcs)``: srcs, cast into ts' dtypes)
        outs = list(outs or ())
        n = len(outs)

        def nth(a: Any, i: int) -> Any:
            return a[i] if isinstance(a, list | tuple) and len(a) == n else a

        for i, out in enumerate(outs):
            if not isinstance(out, torch.Tensor):
                continue
            each = [nth(a, i) for a in inputs]
            if kind == "fill":
                self.filled(out)
            elif kind == "copy":
                self.copied(each[0] if each else None, out, provenance,
                            whole=not (anew or out is nth(args[0], i)))
            else:
                self.pointwise(None, each, out, anew=anew)

    def pointwise(self, func: Any, inputs: Sequence[Any], out: torch.Tensor, *,
                  anew: bool = False) -> None:
        """``out`` was made (or, in place, written) by ``func``, a pointwise op of
        ``inputs`` (its arguments but ``out``): each element of it from the elements at
        its place in the tensors among them (broadcast). A NaN stays NaN through
        arithmetic and ``clamp``, so an element made from a marked one takes its mark
        (the first input's, where several are marked there); a ``where`` or a
        ``masked_fill`` takes each element from one side only, and only that side's mark
        (:func:`_pointwise_sides`). A floating ``out``'s elements that are numbers now
        keep no mark (``nan_to_num``: the NaN the next patch's values put there later is
        theirs). ``anew``: ``out`` is an ``out=`` argument, written whole: the marks it
        held go (after its inputs' are read: an input may be ``out`` itself)."""
        if out.is_meta or not out.numel():
            return
        if func in _COMPLEX and len(inputs) >= 2:
            # (``torch.complex(re, im)``: each part from one input, and only its marks)
            if anew:
                self.unmark(out)
            parts = _parts(out)
            self.pointwise(None, inputs[:1], parts[..., 0])
            self.pointwise(None, inputs[1:2], parts[..., 1])
            return
        marked = what = None
        for t, picked in _pointwise_sides(func, inputs):
            if not isinstance(t, torch.Tensor):
                continue
            got = self.of(t.detach())
            if got is None:
                continue
            m, w = (g.to(out.device) for g in got)
            m, w = m.expand(out.shape), w.expand(*out.shape, 3)
            if picked is not None:
                m = m & picked.to(out.device).expand(out.shape)
            if marked is None:
                marked, what = m, w
            else:
                what = torch.where((m & ~marked).unsqueeze(-1), w, what)
                marked = marked | m
        if anew:
            self.unmark(out)
        if _inexact(out):
            held = _storage_key(out) in self._by_key
            if held or marked is not None:
                nan = nan_mask(out.detach())
                if held:
                    self.unmark(out, torch.nonzero(~nan.reshape(-1)).reshape(-1))
                if marked is not None:
                    marked = marked & nan
        if marked is not None:
            self.mark(out, marked, what)

    def moved(self, func: Any, args: Sequence[Any], kwargs: dict, out: torch.Tensor) -> None:
        """``out`` was made by ``func``, one of ``_MOVES``, from ``args[0]`` (a tensor or
        a list of them): each of its elements is an element of those, unchanged, so the
        same op on their marks says which of ``out``'s are marked."""
        first = args[0]
        inputs = list(first) if isinstance(first, list | tuple) else [first]
        found = [self.of(t) if isinstance(t, torch.Tensor) else None for t in inputs]
        if all(f is None for f in found) or out.is_meta:
            return
        marks = [f[0] if f is not None else torch.zeros(t.shape, dtype=torch.bool,
                                                         device=t.device)
                 for f, t in zip(found, inputs)]
        what = [f[1] if f is not None else torch.zeros((*t.shape, 3), dtype=torch.float64,
                                                        device=t.device)
                for f, t in zip(found, inputs)]

        def again(ins: list[torch.Tensor]) -> torch.Tensor:
            head = ins if isinstance(first, list | tuple) else ins[0]
            return func(head, *args[1:], **kwargs)

        self.mark(out, again(marks),
                  torch.stack([again([w[..., c] for w in what]) for c in range(3)], -1))


def _listed(v: Any) -> tuple | list:
    """``v`` itself where it is a list or tuple, else ``(v,)``."""
    return v if isinstance(v, list | tuple) else (v,)


def _inputs(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict) -> list:
    """The arguments of a call of ``func`` (positional, then keyword values) less its
    ``out=`` ones, whose old values it does not read."""
    outs = _out_args(func)
    if not outs:
        return [*args, *kwargs.values()]
    at = {i for i, _ in outs}
    names = {n for _, n in outs}
    return [*(a for i, a in enumerate(args) if i not in at),
            *(v for k, v in kwargs.items() if k not in names)]


def _pointwise_sides(func: Any, inputs: Sequence[Any]) -> list[tuple[Any, Any]]:
    """``(input, where)`` for each of pointwise op ``func``'s ``inputs``: where (a mask,
    broadcast to the output) its elements go into the output, ``None`` everywhere. A
    ``where``'s condition and a ``masked_fill``'s mask pick elements, and put none of
    their own."""
    if func in _WHERES and len(inputs) >= 3 and isinstance(inputs[0], torch.Tensor):
        cond = inputs[0].bool()
        return [(inputs[1], cond), (inputs[2], ~cond)]
    if func in _MASKED_FILLS and len(inputs) >= 3 and isinstance(inputs[1], torch.Tensor):
        mask = inputs[1].bool()
        return [(inputs[0], ~mask), (inputs[2], mask)]
    return [(t, None) for t in inputs]


_ELEMENT_WISE_OPS: dict = {}


def _element_wise(func: Any) -> bool:
    """Whether ATen op ``func`` computes each element of its result(s) from the elements
    at that place of its tensor arguments (broadcast), and nothing else: an op torch tags
    pointwise, one whose functional form it tags so (an in-place ``heaviside_``, an
    ``out=`` ``add.Scalar_out``: see :func:`_functional_form`), or one of
    ``_ELEMENT_WISE``, which it does not tag (``floor_divide``, ``polar``, ``where``);
    not a view, nor a ``_foreach_`` op (see :func:`_foreach_kind`). The one notion of
    the checks that follow an element by its place: the lost-number marks
    (:meth:`_LostMarks.pointwise`), the mixed-elements refusal (:func:`_mixes`) and the
    pairing check (:func:`_pairs`, less the picks of ``_PICKS``). Once per op."""
    got = _ELEMENT_WISE_OPS.get(func)
    if got is None:
        got = _ELEMENT_WISE_OPS[func] = _element_wise_of(func)
    return got


def _element_wise_of(func: Any) -> bool:
    name = func._schema.name
    if "::_foreach_" in name or _is_view(func):
        return False
    if torch.Tag.pointwise in func.tags:
        return True  # (of a library's own too: its author says so)
    returns = func._schema.returns
    if (not name.startswith("aten::") or not returns
            or any(str(r.type) != "Tensor" for r in returns)):
        return False  # (``where(cond)``: a list of the places of its true elements)
    if _base_name(func) in _ELEMENT_WISE:
        return True
    functional = _functional_form(func)
    return functional is not None and torch.Tag.pointwise in functional.tags


def _functional_form(func: Any) -> Any:
    """The overload that computes what in-place or ``out=`` op ``func`` writes, into a
    new tensor: of the op named without the in-place ``_``, with the arguments of
    ``func`` less its ``out=`` ones, by name (``heaviside_`` -> ``heaviside``,
    ``add.Scalar_out`` -> ``add.Scalar``, ``threshold_backward.grad_input`` ->
    ``threshold_backward``, ``_foreach_add_.List`` -> ``_foreach_add.List``); ``None``
    where there is none, or ``func`` writes nothing."""
    args = func._schema.arguments
    name = func._schema.name.partition("::")[2]
    in_place = name.endswith("_") and not name.endswith("__")
    if not in_place and not any(a.is_out for a in args):
        return None
    packet = getattr(_aten, name[:-1] if in_place else name, None)
    if packet is None:
        return None
    names = [a.name for a in args if not a.is_out]
    for overload in packet.overloads():
        other = getattr(packet, overload)
        if (other is not func and not other._schema.is_mutable
                and [a.name for a in other._schema.arguments] == names):
            return other
    return None


def _casts_lose_numbers(dtype: torch.dtype) -> bool:
    """Whether a cast into ``dtype`` can turn a number into NaN: a floating dtype
    without infinities (float8 ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``, and
    ``e4m3fn``, whose casts torch may saturate instead)."""
    return dtype.is_floating_point and dtype not in _CASTS_KEEP_NUMBERS


# Ops that make a new tensor of elements of their first argument (a tensor, or a list
# of them), each unchanged: a mark of :class:`_LostMarks` goes where its element goes.
_MOVES = frozenset({
    _aten.cat.default, _aten.stack.default, _aten.index_select.default,
    _aten.index.Tensor, _aten.repeat.default, _aten.roll.default, _aten.flip.default,
    _aten.gather.default, _aten.narrow_copy.default, _aten.take.default,
    _aten.masked_select.default,
})

# ``torch.complex(real, imag)``: each part of its output from one input
_COMPLEX = frozenset({_aten.complex.default, _aten.complex.out})

# Pointwise ops that take each element from one of their inputs, as a condition or mask
# picks: see :func:`_pointwise_sides`
# (every overload of each: ``where.ScalarOther``, ``masked_fill.Scalar_out``; not
# ``where(cond)``, which is not element-wise)
_WHERES = frozenset(getattr(_aten.where, o) for o in _aten.where.overloads()
                    if o != "default")
_MASKED_FILLS = frozenset(getattr(_aten.masked_fill, o) for o in _aten.masked_fill.overloads())

# Ops that write all of their first argument anew, from no tensor: a scratch filled so
# keeps no mark of what it held
_FILLS = frozenset({_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default})


def _put_values() -> dict:
    """Puts, by op, with the name of the argument whose elements (or fill value) each
    writes into places of (a copy of) its first argument that its other arguments pick,
    each element unchanged or added to (or reduced with) what is there: see
    :meth:`_LostMarks.put`. Ops this torch lacks are left out."""
    table = {}
    for base, value, overloads in (
        ("index_put", "values", ("default",)), ("_index_put_impl", "values", ("default",)),
        ("index_copy", "source", ("default",)), ("masked_scatter", "source", ("default",)),
        ("scatter", "src", ("src", "reduce")), ("scatter", "value", ("value", "value_reduce")),
        ("scatter_add", "src", ("default",)), ("scatter_reduce", "src", ("two",)),
        ("index_add", "source", ("default",)), ("index_reduce", "source", ("default",)),
        ("put", "source", ("default",)), ("index_fill", "value", ("int_Scalar", "int_Tensor")),
        ("slice_scatter", "src", ("default",)), ("select_scatter", "src", ("default",)),
        ("diagonal_scatter", "src", ("default",)), ("as_strided_scatter", "src", ("default",)),
    ):
        for name in (base, base + "_"):
            packet = getattr(_aten, name, None)
            for overload in overloads:
                f = getattr(packet, overload, None) if packet is not None else None
                if f is not None:
                    table[f] = value
    return table


_PUT_VALUES = _put_values()
# The in-place puts (into a tensor of the loader's own), and the functional ones, which
# make a new tensor
_PUTS = frozenset(f for f in _PUT_VALUES if f._schema.name.endswith("_"))
_FUNCTIONAL_PUTS = frozenset(f for f in _PUT_VALUES if not f._schema.name.endswith("_"))


def _put_again(func: Any, args: Sequence[Any], kwargs: dict) -> Callable:
    """``again(into, values)``: put ``func`` done on ``into`` (a tensor shaped like its
    output) with ``values`` (shaped like its value argument, or a number) by the put that
    replaces what is there, with its other arguments: where each of the values goes
    (see :meth:`_LostMarks.put`)."""
    base = _base_name(func)

    def a(name: str) -> Any:
        return _arg(func, args, kwargs, name)

    if base in ("index_copy", "index_add", "index_reduce"):
        return lambda into, v: _aten.index_copy_.default(into, a("dim"), a("index"), v)
    if base in ("scatter", "scatter_add", "scatter_reduce"):
        return lambda into, v: (
            _aten.scatter_.src(into, a("dim"), a("index"), v) if isinstance(v, torch.Tensor)
            else _aten.scatter_.value(into, a("dim"), a("index"), v))
    if base == "put":
        return lambda into, v: _aten.put_.default(into, a("index"), v)
    if base in ("index_put", "_index_put_impl"):
        return lambda into, v: _aten.index_put_.default(into, a("indices"), v)
    if base == "masked_scatter":
        return lambda into, v: _aten.masked_scatter_.default(into, a("mask"), v)
    if base == "index_fill":
        return lambda into, v: (
            _aten.index_fill_.int_Tensor(into, a("dim"), a("index"), v)
            if isinstance(v, torch.Tensor)
            else _aten.index_fill_.int_Scalar(into, a("dim"), a("index"), v))
    op = getattr(_aten, base).default  # (slice_scatter and its kin: functional already)
    rest = [x.name for x in op._schema.arguments[2:]]
    return lambda into, v: op(into, v, *[a(n) for n in rest])


_FOREACH_KINDS: dict = {}
# A ``_foreach_`` op's overload, as the op it does on each tensor names it
_FOREACH_OVERLOADS = {"List": "Tensor", "ScalarList": "Scalar", "ScalarAndTensor": "Scalar"}


def _foreach_kind(func: Any) -> str | None:
    """What ``torch._foreach_*`` op ``func`` does to each tensor of its lists: ``"copy"``
    (``_foreach_copy_``, ``_foreach_clone``), ``"fill"`` (``_foreach_zero_``),
    ``"pointwise"`` (``_foreach_add``, ``_foreach_mul_``, ``_foreach_lerp``...: the op
    it does on each is tagged pointwise); ``None`` for any other op (``_foreach_norm``,
    a reduction, among them). Once per op."""
    got = _FOREACH_KINDS.get(func, False)
    if got is False:
        got = _FOREACH_KINDS[func] = _foreach_kind_of(func)
    return got


def _foreach_kind_of(func: Any) -> str | None:
    if not func._schema.name.startswith("aten::_foreach_"):
        return None
    base = _base_name(func)
    if base in ("copy", "clone"):
        return "copy"
    if base == "zero":
        return "fill"
    functional = _functional_form(func)  # (``_foreach_max.out``: as ``_foreach_max``)
    if functional is not None:
        return _foreach_kind(functional)
    each = _foreach_each(func)
    return "pointwise" if each is not None and _element_wise(each) else None


def _foreach_each(func: Any) -> Any:
    """The op that functional ``_foreach_`` op ``func`` does on the tensors at each place
    of its lists: its overload named so (``List`` -> ``Tensor``, ``ScalarList`` ->
    ``Scalar``), the default one, or the one whose arguments are named as ``func``'s
    (``_foreach_pow.List`` -> ``pow.Tensor_Tensor``); ``None`` where none is."""
    packet = getattr(_aten, _base_name(func), None)
    if packet is None:
        return None
    over = func._overloadname
    for name in (_FOREACH_OVERLOADS.get(over, over), "default"):
        each = getattr(packet, name, None)
        if each is not None:
            return each
    names = [a.name for a in func._schema.arguments]
    for overload in packet.overloads():
        each = getattr(packet, overload)
        if [a.name for a in each._schema.arguments] == names:
            return each
    return None


def _nth(args: Sequence[Any], i: int, n: int) -> list:
    """``args`` of a ``_foreach_`` op with each list of ``n`` (tensors, numbers) in
    place of its ``i``-th element: the arguments of the op it does at place ``i`` (a
    tensor or number not in a list is used at each)."""
    return [a[i] if isinstance(a, list | tuple) and len(a) == n else a for a in args]


def _foreach_written(func: Any, args: Sequence[Any], kwargs: dict) -> list:
    """The tensors an in-place or ``out=`` ``_foreach_`` op writes: its ``out=`` list,
    or its first."""
    outs = _out_args(func)
    if outs:
        i, name = outs[0]
        return list(_listed(args[i] if i < len(args) else kwargs.get(name)))
    return list(_listed(args[0])) if args else []


def _put_combines(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether put ``func`` adds its values to (or reduces them with) what is there:
    ``index_add``, ``index_reduce``, ``scatter_add``, ``scatter_reduce``, a ``scatter``
    with a ``reduce``, an accumulating ``put`` or ``index_put``."""
    base = _base_name(func)
    if base in ("index_add", "index_reduce", "scatter_add", "scatter_reduce"):
        return True
    if base == "scatter":
        return "reduce" in func._overloadname
    if base in ("put", "index_put", "_index_put_impl"):
        return bool(_arg(func, args, kwargs, "accumulate"))
    return False


def _mixed_from(position: int | None, name: str | None) -> str:
    """Whose data an op mixed, as a message says it (see :attr:`_Source.mixed`)."""
    return f"{where(position, name)}'s data" if name is not None else "the data of several patches"


def _mixed_for(out: torch.Tensor, mixed: tuple[int | None, str | None, str]
               ) -> tuple[int | None, str | None, str] | None:
    """``mixed`` where ``out`` is floating-point (or complex): an integer or boolean result
    (``w.isnan()``, ``argsort(w)``) holds no patch's numbers, and is never mixed."""
    return mixed if _inexact(out) else None


# Ops (ATen base names) that make a new tensor of none of their input's numbers, only of
# its shape and dtype
_ANEW = frozenset({
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
})

# Ops (ATen names, without the in-place ``_`` or the ``_foreach_`` prefix) whose floating
# output a NaN-merge can still take element by element, though they are not element-wise
# (:func:`_element_wise`): copies and casts, ops that move elements whole (each output
# element is one input element, unchanged, or a constant: ``_MOVES``, ``_PUTS``, pads,
# triangles; ``index_put``, ``put`` and ``scatter`` are in ``_COMBINING_PUTS``), ops
# whose output holds none of their input's numbers (``zeros_like``, ``fill_``), and
# ``nan_to_num``, ``isnan`` (the replaced-marks and integer checks see them).
_KEEPS_ELEMENTS = frozenset({
    # copies, casts and the copying forms of views
    "copy", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy",
    "_unsafe_view", "contiguous", "resolve_conj", "resolve_neg", "conj_physical",
    "_conj_physical", "_conj_copy", "_neg_view_copy", "alias_copy", "detach_copy", "view_copy",
    "_reshape_copy", "_reshape_alias_copy", "permute_copy", "t_copy", "transpose_copy",
    "expand_copy", "squeeze_copy", "unsqueeze_copy", "slice_copy", "select_copy",
    "diagonal_copy", "as_strided_copy", "unfold_copy", "split_copy",
    "split_with_sizes_copy", "unbind_copy", "view_as_real_copy", "view_as_complex_copy",
    "narrow_copy", "_pin_memory",
    # element moves and puts
    "cat", "stack", "hstack", "vstack", "index_select", "index", "repeat", "roll", "flip",
    "gather", "take", "take_along_dim", "masked_select", "repeat_interleave", "tile",
    "rot90", "index_copy", "masked_scatter", "index_fill", "slice_scatter",
    "select_scatter", "diagonal_scatter", "as_strided_scatter", "constant_pad_nd",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d",
    "tril", "triu", "diag", "diag_embed", "block_diag", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "native_channel_shuffle", "im2col", "embedding", "lift",
    # no numbers of the input in the output (_ANEW, and:)
    *_ANEW,
    "fill", "zero", "resize", "resize_as", "set", "random", "uniform", "normal",
    "bernoulli", "exponential", "geometric", "cauchy", "log_normal",
    # element-wise and NaN-aware (``nan_to_num``: see :func:`_replaces_nan`), or no
    # numbers (nanmean and nanquantile are made of other ops before a dispatch mode sees
    # them; ``nansum`` and ``nanmedian`` skip the staged NaN of a slice, so that the sum
    # of a row that keeps some elements is written as a number: see :data:`_REDUCES_OVER`)
    "nanmean", "nanquantile", "nan_to_num", "isnan",
})

# Puts (ATen names, as for ``_KEEPS_ELEMENTS``) that may combine what they put with what
# is there (an add, a reduce): where no index repeats, each element of the result is one
# element put, with the destination's own (as an add of two tensors is); where one
# repeats, several elements put are combined into one, which mixes them (see
# :func:`_puts_repeat`). ``put``, ``index_put`` and ``scatter`` combine only with
# ``accumulate=True`` or a ``reduce`` of a tensor (:func:`_combines`); else they move
# elements, unchanged.
_COMBINING_PUTS = frozenset({
    "index_add", "index_reduce", "scatter_add", "scatter_reduce", "scatter", "put",
    "index_put", "_index_put_impl",
})

# What :func:`_mixes` says of an op besides ``True`` (mixes) and ``False`` (keeps each
# element): a put of ``_COMBINING_PUTS``, and a reduction, which mixes only where it
# reduces a dim longer than 1
_PUT = "put"
_REDUCES = "reduces"

_MIXES: dict = {}


def _mixes(func: Any) -> bool | str:
    """Whether op ``func`` may mix its inputs' elements (a matmul, a reduction, a sort, a
    cumsum, a softmax, an op torch does not describe): none of a view, an element-wise op
    (:func:`_element_wise`), a ``_foreach_`` op of :func:`_foreach_kind`, nor one of
    ``_KEEPS_ELEMENTS``; ``_PUT`` for a put of ``_COMBINING_PUTS``, ``_REDUCES``
    for a reduction (:func:`_is_reduction`; see :meth:`_Provenance.mixed_by`). Once per op."""
    got = _MIXES.get(func)
    if got is None:
        got = _MIXES[func] = _mixes_elements(func)
    return got


_ARG_AT: dict = {}


def _arg(func: Any, args: Sequence[Any], kwargs: dict, name: str) -> Any:
    """Argument ``name`` of a call of ``func`` (by its schema), or its default."""
    at = _ARG_AT.get(func)
    if at is None:
        at = _ARG_AT[func] = {a.name: (i, a) for i, a in enumerate(func._schema.arguments)}
    i, a = at[name]
    if i < len(args):
        return args[i]
    if name in kwargs:
        return kwargs[name]
    return a.default_value if a.has_default_value() else None


_BASE_NAMES: dict = {}


def _base_name(func: Any) -> str:
    """``func``'s ATen name less its namespace, its ``_foreach_`` and in-place ``_``."""
    got = _BASE_NAMES.get(func)
    if got is None:
        op = func._schema.name.partition("::")[2].removeprefix("_foreach_")
        got = _BASE_NAMES[func] = op[:-1] if op.endswith("_") and not op.endswith("__") else op
    return got


def _combines(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether a put of ``_COMBINING_PUTS`` combines what it puts with what is there:
    ``put`` and ``index_put`` with ``accumulate=True``, ``scatter`` with a ``reduce`` of
    a tensor (of a scalar, ``scatter.value_reduce``, it combines no two elements put);
    the others always."""
    base = _base_name(func)
    if base == "scatter":
        return func._overloadname.startswith("reduce")
    if base in ("put", "index_put", "_index_put_impl"):
        return bool(_arg(func, args, kwargs, "accumulate"))
    return True


def _puts_repeat(func: Any, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether a put of ``_COMBINING_PUTS`` puts two elements at one place of its
    destination: the same put, of ones into zeros, counts them (read only where a
    patch's data with NaN in it is put). An argument it cannot count: ``True``."""
    base = _base_name(func)
    try:
        dest = _arg(func, args, kwargs, "self")
        counts = torch.zeros(dest.shape, dtype=torch.float32, device=dest.device)

        def ones(t: torch.Tensor) -> torch.Tensor:
            return torch.ones(t.shape, dtype=torch.float32, device=dest.device)

        if base in ("index_add", "index_reduce"):
            counts.index_add_(_arg(func, args, kwargs, "dim"),
                              _arg(func, args, kwargs, "index"),
                              ones(_arg(func, args, kwargs, "source")))
        elif base == "put":
            index = _arg(func, args, kwargs, "index")
            counts.put_(index, ones(index), accumulate=True)
        elif base in ("index_put", "_index_put_impl"):
            counts.index_put_(_arg(func, args, kwargs, "indices"),
                              ones(_arg(func, args, kwargs, "values")), accumulate=True)
        else:  # (scatter_add, scatter_reduce, scatter with a reduce: index says where)
            index = _arg(func, args, kwargs, "index")
            counts.scatter_add_(_arg(func, args, kwargs, "dim"), index, ones(index))
        return bool((counts > 1).any())
    except Exception:  # (a put torch would refuse itself, a meta tensor)
        return True


# Element-wise ops whose result takes each element from one input only, as a condition
# or mask picks (``where``, ``masked_fill``), or each part of a complex element from one
# (``torch.complex(re, im)``, a stack of the two): they move elements and pair none
_PICKS = frozenset({"where", "masked_fill", "complex"})

# Element-wise ops (ATen names, as for ``_KEEPS_ELEMENTS``) some or all of whose
# overloads (functional ones too) torch does not tag pointwise: see :func:`_element_wise`
_ELEMENT_WISE = frozenset({
    "polar", "copysign", "frexp", "ldexp", "fmod", "remainder", "floor_divide",
    "true_divide", "rsub", "fmax", "fmin", "nextafter", "hypot", "atan2", "xlogy",
    "complex", "where", "masked_fill", "isclose", "dropout", "native_dropout",
    "alpha_dropout", "feature_dropout", "_masked_scale",
})

_PAIRS: dict = {}


def _pairs(func: Any) -> bool:
    """Whether op ``func`` computes each element of its result from the elements at that
    place of its tensor inputs (broadcast), so that two of them, taken from different
    elements of patches' data, are paired (see :meth:`_Provenance._paired`): an
    element-wise op (:func:`_element_wise`) but a pick (``_PICKS``), or a ``_foreach_`` op
    of such ops (``_foreach_add``, ``_foreach_lerp_``), which pairs the tensors at each
    place of its lists (and a tensor not in a list with each): its callers hand
    :meth:`_Provenance.mixed_by` the inputs of one place at a time. Once per op."""
    got = _PAIRS.get(func)
    if got is None:
        got = _PAIRS[func] = _pairs_elements(func)
    return got


def _pairs_elements(func: Any) -> bool:
    if _foreach_kind(func):
        return _foreach_kind(func) == "pointwise"
    return _element_wise(func) and _base_name(func) not in _PICKS


def _tensors_in(args: Sequence[Any]) -> int:
    """How many of ``args`` are tensors."""
    return sum(isinstance(a, torch.Tensor) for a in args)


def _place_in_patch(t: torch.Tensor, e: _Source, shape: Sequence[int]) -> tuple | None:
    """Which elements of which patch ``t`` (of stretch ``e``) puts at each element of an
    output of ``shape`` it is broadcast to: ``(position, name, checkpoint offset of its
    first element, its strides broadcast to shape)``, in checkpoint elements; ``None``
    where not known (data of several patches, at no known offset, a view of its bytes as
    another element size, or ``t`` not all in the stretch)."""
    if e.name is None or e.base is None or t.element_size() != _unit(e, t):
        return None
    if not _inside(t, e):
        return None
    lead = len(shape) - t.dim()
    if lead < 0:
        return None
    strides = tuple(
        0 if d < lead or shape[d] == 1 or t.shape[d - lead] == 1 else t.stride(d - lead)
        for d in range(len(shape)))
    return e.position, e.name, t.storage_offset() - e.base, strides


def _inside(t: torch.Tensor, e: _Source) -> bool:
    """Whether all of ``t``'s bytes lie in stretch ``e``."""
    lo, hi = _byte_span(t)
    return e.lo <= lo and hi <= e.hi


def _traced_unchanged(found: list[tuple[torch.Tensor, _Source]]) -> bool:
    """Whether each floating-point tensor of ``found`` (an op's inputs traced to
    patches' data, each with a stretch it reaches) lies in one stretch whose elements
    are its patches' staged ones, unchanged (:func:`_unchanged`)."""
    seen: list[torch.Tensor] = []
    for t, e in found:
        if not _inexact(t) or any(t is d for d in seen):
            return False  # (an integer view of the bits; a tensor that reaches two)
        seen.append(t)
        if not _unchanged(e) or not _inside(t, e):
            return False
    return bool(seen)


# Element-wise ops (ATen names, as for ``_KEEPS_ELEMENTS``, not in place) whose result
# is NaN wherever an input is: a number there comes from numbers only (not ``sign``,
# ``nan_to_num``, ``pow``, ``fmax``, ``where``, which may make a number of a NaN)
_NAN_KEEPING = frozenset({
    "abs", "neg", "mul", "div", "add", "sub", "clamp", "clamp_min", "clamp_max", "tanh",
    "sigmoid", "exp", "reciprocal", "sqrt", "rsqrt",
})


def _functional_aten_in(names: frozenset) -> Callable[[Any], bool]:
    """A test, cached per op, of whether an op is an ATen op of one of ``names`` (ATen
    names, as for ``_KEEPS_ELEMENTS``), not in place."""
    cache: dict = {}

    def test(func: Any) -> bool:
        got = cache.get(func)
        if got is None:
            name = func._schema.name
            got = cache[func] = (name.partition("::")[0] == "aten" and not name.endswith("_")
                                 and _base_name(func) in names)
        return got

    return test


# Whether an op is one of :data:`_NAN_KEEPING` (not in place)
_keeps_nan = _functional_aten_in(_NAN_KEEPING)


def _kept_whole(t: torch.Tensor, hits: list[_Source]) -> bool:
    """Whether ``t`` lies in one stretch of :attr:`_Source.nan_kept` data (made at no
    known place from its patches' staged elements, no NaN of them replaced)."""
    return len(hits) == 1 and hits[0].nan_kept and _inside(t, hits[0])


# Ops (ATen names, as for ``_KEEPS_ELEMENTS``) whose result holds elements of their
# tensor inputs only, each unchanged: element moves, copies and casts (no pad, fill,
# pick with a number, put into another tensor: those hold the loader's own too)
_REARRANGES = frozenset({
    "cat", "stack", "hstack", "vstack", "index_select", "index", "repeat", "roll", "flip",
    "gather", "take", "take_along_dim", "masked_select", "repeat_interleave", "tile",
    "rot90", "narrow_copy", "clone", "_to_copy", "contiguous", "_unsafe_view",
    "permute_copy", "t_copy", "transpose_copy", "expand_copy", "slice_copy", "select_copy",
    "view_copy", "_reshape_copy", "alias_copy", "detach_copy", "lift_fresh_copy",
    "unbind_copy", "split_copy", "split_with_sizes_copy", "diagonal_copy", "unfold_copy",
})

# Whether an op is one of :data:`_REARRANGES` (not in place)
_rearranges = _functional_aten_in(_REARRANGES)

# Whether an op makes a new tensor of none of its input's numbers, only of its shape and
# dtype (ATen names, not in place)
_makes_anew = _functional_aten_in(_ANEW)


def _place_in_stretch(t: torch.Tensor, e: _Source) -> tuple | None:
    """Which stretch of a patch's data, at no known place in the patch (``e``, made by an
    op that moved or computed it), ``t`` lies in: ``(storage key, its first byte)``, or
    ``None`` where ``e`` is no one patch's, or has a known place (``base``), or ``t``
    reaches past it. Two inputs of an element-wise op in one such stretch are parts of
    one tensor the loader made (``x`` and ``x[0]``)."""
    if e.name is None or e.base is not None or e.mixed is not None:
        return None
    if not _inside(t, e):
        return None
    return _storage_key(t), e.lo


# Picks and puts (ATen names, as for ``_KEEPS_ELEMENTS``) whose result takes each
# element from one of their inputs, unchanged, at places a condition, mask or index
# says: they make a number of a patch's NaN only where that condition comes from the
# patch's data (``torch.where(w.isnan(), 0.0, w)``, ``w[w.isnan()] = 0.0``); one of the
# loader's own picks as a move does (``torch.where(mask, w, old)``)
_SELECTING = frozenset({
    "where", "masked_fill", "index_put", "_index_put_impl", "masked_scatter", "index_copy",
    "index_fill", "scatter", "put", "index_add", "index_reduce", "scatter_add",
    "scatter_reduce",
})

# Ops (ATen base names) whose boolean result says where a patch's "keep" marks are and
# makes no number of them (:meth:`_Provenance._counted_marks`): a ``where`` by it is a
# merge on purpose, or a replacement :func:`_replaces_nan` follows
_EXACT_MARKS = frozenset({"isnan", "isfinite"})

# What :func:`_replaces_nan` says of a pick or put of ``_SELECTING``
_SELECTS = "selects"

_REPLACES: dict = {}


def _replaces_nan(func: Any) -> bool | str:
    """Whether op ``func`` may make a number of a NaN of its floating-point input, so that
    a sparse patch's "keep" mark reaches the copy as a number the NaN-merge writes: an
    element-wise op (:func:`_element_wise`, in place too) that is not one of
    :data:`_NAN_KEEPING` nor a copy or cast (``nan_to_num``, ``fmax``, ``pow``,
    ``heaviside``, ``dropout``); ``_SELECTS`` for a pick or put of :data:`_SELECTING`
    (which does only where the condition, mask or index it picks by comes from patches'
    data). Not a view, a move or a ``copy_``, a fill, an op that mixes elements (which
    holds the NaN, or is refused for mixing them; what it makes of such data carries the
    mark, :meth:`_Provenance._replaced_by`), nor a NaN-aware reduction (a statistic,
    ``nansum``, which places no number at a kept element). Once per op."""
    got = _REPLACES.get(func)
    if got is None:
        got = _REPLACES[func] = _replaces_nan_of(func)
    return got


def _replaces_nan_of(func: Any) -> bool | str:
    # (views, _foreach_ ops and copy_ are none of these: _element_wise leaves out the
    # first two and every op of _REARRANGES, copy_ is one of _KEEPS_ELEMENTS, and no name
    # below is one of theirs)
    if not func._schema.name.startswith("aten::"):
        return False
    base = _base_name(func)
    if base in _SELECTING:
        return _SELECTS
    if base == "nan_to_num":
        return True  # (element-wise, though one of _KEEPS_ELEMENTS for the mixing check)
    return (_element_wise(func) and base not in _NAN_KEEPING and base not in _PICKS
            and base not in _KEEPS_ELEMENTS)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The index, in a tensor of ``shape``, of its row-major element ``flat``."""
    at = []
    for n in reversed(shape):
        at.append(flat % n)
        flat //= n
    return tuple(reversed(at))


def _keep_at(keep: torch.Tensor, out: torch.Tensor) -> tuple | None:
    """The ``at`` of :attr:`_Source.replaced` for ``out``, whose elements that hold a
    patch's "keep" are those of mask ``keep`` (broadcast to ``out``'s shape); ``None``
    where ``out``'s elements overlap. A complex ``out``'s mask is of its parts (each part
    of an element keeping as the element does), which its real views read."""
    if out.is_complex():
        return _keep_at(keep.to(out.device).expand(out.shape).unsqueeze(-1).expand(
            *out.shape, 2), _parts(out))
    span = 1 + sum((n - 1) * st for n, st in zip(out.shape, out.stride()))
    flat = torch.zeros(span, dtype=torch.bool, device=out.device)
    try:
        flat.as_strided(out.shape, out.stride()).copy_(keep.to(out.device).expand(out.shape))
    except RuntimeError:
        return None
    return flat, out.storage_offset(), out.element_size()


def _keep_in(e: _Source, t: torch.Tensor) -> torch.Tensor | None:
    """Which elements of ``t``, a view of stretch ``e``'s bytes, hold a patch's "keep"
    (:attr:`_Source.replaced`), shaped like ``t``; ``None`` where not known (nor where
    ``t`` reads them as another element size or reaches past them)."""
    at = e.replaced[3] if e.replaced is not None else None
    if at is not None and t.is_complex() and t.element_size() == 2 * at[2]:
        got = _keep_in(e, _parts(t))  # (an element keeps where its parts do)
        return None if got is None else got.all(-1)
    if at is None or t.element_size() != at[2] or not _inside(t, e):
        return None
    off = t.storage_offset() - at[1]
    if off < 0:
        return None
    try:
        return at[0].as_strided(t.shape, t.stride(), off)
    except RuntimeError:
        return None  # (past the mask's end)


def _carried_replaced(e: _Source, src: torch.Tensor, out: torch.Tensor) -> tuple | None:
    """:attr:`_Source.replaced` of what ``out``, an element-for-element copy of ``src``
    (of stretch ``e``), holds: ``e``'s, with ``out``'s mask of the elements that keep."""
    r = e.replaced
    if r is None:
        return None
    if not _inexact(out):
        return (*r[:3], None)  # (its bytes as integers: which keep is not followed)
    keep = _keep_in(e, src)
    if keep is not None and keep.shape != out.shape:
        keep = keep.reshape(out.shape) if keep.numel() == out.numel() else None
    return (*r[:3], None if keep is None or out.is_meta else _keep_at(keep, out))


def _mixes_elements(func: Any) -> bool | str:
    if _is_view(func) or _element_wise(func) or _foreach_kind(func):
        return False
    if func._schema.name.partition("::")[0] != "aten":
        return True  # (an op of a library's own: what it does is not known)
    base = _base_name(func)
    if base in _COMBINING_PUTS:
        return False if base == "scatter" and not func._overloadname.startswith(
            "reduce") else _PUT
    if base in _KEEPS_ELEMENTS:
        return False
    if _is_reduction(func, base):
        return _REDUCES
    return True


# The ATen reductions by base name (:func:`_base_name`): those of which torch 2.13 and
# 2.14 tag an overload ``torch.Tag.reduction``, for a torch without that tag (2.4)
_REDUCTIONS = frozenset({
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero",
    "linalg_vector_norm", "logsumexp", "max", "mean", "min", "nansum", "norm", "prod",
    "std", "std_mean", "sum", "var", "var_mean",
})


def _is_reduction(func: Any, base: str) -> bool:
    """Whether torch tags op ``func`` (base name ``base``) a reduction; on a torch that has
    no such tag, whether it is one of ``_REDUCTIONS`` (an ``out=`` overload too, which
    torch leaves untagged: a reduction over dims of one element mixes none either way)."""
    tag = getattr(torch.Tag, "reduction", None)
    return tag in func.tags if tag is not None else base in _REDUCTIONS


# Ops (ATen base names, see :func:`_base_name`) that mix elements only within slices of
# their one input, each output element computed from one slice, and which a sparse
# call lets through where each slice is all "keep" (NaN) or all "update" (none), and the
# result is NaN exactly where its slices keep (see :meth:`_Provenance._sliced`): the
# reductions over the dims of their ``dim`` (all where none is given: ``w.amax()``,
# ``_foreach_norm``), keeping them as size 1 where ``keepdim`` says so ...
_REDUCES_OVER = frozenset({
    "sum", "mean", "amax", "amin", "prod", "max", "min", "norm", "linalg_vector_norm",
    "var", "std", "var_mean", "std_mean", "logsumexp", "median", "nanmedian", "mode",
    "kthvalue", "aminmax", "nansum",
})
# ... the ops along one ``dim`` whose result keeps that dim (a scan, which reads a
# prefix: its slice is the whole row; a softmax; a sort's values; a ``topk``'s) ...
_ALONG = frozenset({
    "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "_softmax", "_log_softmax",
    "softmax", "log_softmax", "sort", "topk",
})
# ... and the products, by the argument holding the patch's data: the dims of it each
# output element is summed over (``None``: all), whether they stay as size 1 in the
# result (else dropped), and how many leading dims of that are then dropped (a batch
# ``addbmm`` sums over); an ``add``'s own term (``self``) is read element by element
_CONTRACTS: dict[tuple[str, str], tuple[tuple[int, ...] | None, bool, int]] = {
    ("mm", "self"): ((1,), True, 0), ("mm", "mat2"): ((0,), True, 0),
    ("addmm", "mat1"): ((1,), True, 0), ("addmm", "mat2"): ((0,), True, 0),
    ("bmm", "self"): ((2,), True, 0), ("bmm", "mat2"): ((1,), True, 0),
    ("baddbmm", "batch1"): ((2,), True, 0), ("baddbmm", "batch2"): ((1,), True, 0),
    ("addbmm", "batch1"): ((0, 2), True, 1), ("addbmm", "batch2"): ((0, 1), True, 1),
    ("mv", "self"): ((1,), False, 0), ("mv", "vec"): (None, False, 0),
    ("addmv", "mat"): ((1,), False, 0), ("addmv", "vec"): (None, False, 0),
    ("dot", "self"): (None, False, 0), ("dot", "tensor"): (None, False, 0),
    ("vdot", "self"): (None, False, 0), ("vdot", "other"): (None, False, 0),
    ("addmm", "self"): ((), True, 0), ("addmv", "self"): ((), True, 0),
    ("baddbmm", "self"): ((), True, 0), ("addbmm", "self"): ((), True, 0),
}
_CONTRACTING = frozenset(op for op, _ in _CONTRACTS)


_SLICES: dict = {}


def _slices_of(func: Any) -> bool:
    """Whether op ``func`` mixes elements within slices of one input only (see
    :data:`_REDUCES_OVER`, :data:`_ALONG`, :data:`_CONTRACTS`). Once per op: a sparse
    call asks it of most ops whose result is floating-point."""
    got = _SLICES.get(func)
    if got is None:
        base = _base_name(func)
        # (an op of a library's own is none of these, whatever its name)
        got = _SLICES[func] = func._schema.name.startswith("aten::") and (
            base in _REDUCES_OVER or base in _ALONG or base in _CONTRACTING)
    return got


def _arg_or(func: Any, args: Sequence[Any], kwargs: dict, name: str, default: Any) -> Any:
    """:func:`_arg`, or ``default`` where ``func`` has no argument ``name``."""
    try:
        got = _arg(func, args, kwargs, name)
    except KeyError:
        return default
    return default if got is None else got


def _slice_masks(func: Any, args: Sequence[Any], kwargs: dict, t: torch.Tensor,
                 keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """For op ``func`` of ``_slices_of`` reading ``t`` (among ``args`` and ``kwargs``),
    whose "keep" marks are ``keep``: ``(all, any, exact)``, for each element of its
    result (broadcast to it, or of its shape exactly where ``exact``), whether all, and
    whether any, of the elements of ``t`` it is computed from keep. On ``t``'s device,
    no host wait. ``None``: an argument it cannot read so (then the op mixes)."""
    base = _base_name(func)
    k = keep.to(torch.uint8)  # (amin and amax over several dims: no bool kernels)
    if base in _REDUCES_OVER:
        if t is not _arg_or(func, args, kwargs, "self", None):
            return None
        dims = _arg_or(func, args, kwargs, "dim", None)
        dims = (() if dims is None else (dims,) if isinstance(dims, int) else tuple(dims))
        keepdim = bool(_arg_or(func, args, kwargs, "keepdim", False))
        if not dims:  # (no dim: the whole tensor is one slice)
            dims = tuple(range(t.dim()))
        if t.dim() == 0:
            return keep, keep, True
        return k.amin(dims, keepdim=keepdim).bool(), k.amax(dims, keepdim=keepdim).bool(), True
    if base in _ALONG:
        if t is not _arg_or(func, args, kwargs, "self", None):
            return None
        dim = _arg_or(func, args, kwargs, "dim", -1)
        if t.dim() == 0:
            return keep, keep, False
        return k.amin(dim, keepdim=True).bool(), k.amax(dim, keepdim=True).bool(), False
    at = next((a.name for i, a in enumerate(func._schema.arguments)
               if (args[i] if i < len(args) else kwargs.get(a.name)) is t), None)
    rule = _CONTRACTS.get((base, at))
    if rule is None:
        return None
    dims, keepdim, drop = rule
    if dims == ():  # (an add's own term: element by element)
        return keep, keep, False
    dims = tuple(range(t.dim())) if dims is None else dims
    lo, hi = k.amin(dims, keepdim=keepdim), k.amax(dims, keepdim=keepdim)
    for _ in range(drop):
        lo, hi = lo.squeeze(0), hi.squeeze(0)
    return lo.bool(), hi.bool(), False


def _slices_agree(masks: tuple[torch.Tensor, torch.Tensor, bool], out: torch.Tensor
                  ) -> torch.Tensor:
    """A 0-dim bool tensor on ``out``'s device (no host wait): whether ``out``, the
    result of an op whose :func:`_slice_masks` are ``masks``, is NaN exactly where its
    slices all keep, and no slice both keeps and updates. Raises where the masks do not
    fit ``out``'s shape (the caller then takes the op as mixing)."""
    lo, hi, exact = masks
    if exact and lo.shape != out.shape:
        raise ValueError("not the result's shape")
    nan = nan_mask(out)
    lo, hi = lo.to(nan.device).expand(nan.shape), hi.to(nan.device).expand(nan.shape)
    return ((nan == lo) & (nan == hi)).all()


class _Sliced(NamedTuple):
    """What :meth:`_Provenance._sliced` read of the inputs that hold patches' data of an
    op of :func:`_slices_of` (before it ran, where it writes in place or ``out=``), for
    :meth:`_Provenance.settled` to decide once the op has made or written its result:
    what it mixes where each input holds NaN (``mixed``, one an input), whether each does
    (``holds``, a bool tensor of one element each), whether complex ones' parts keep
    alike (``parts``, 0-dim) and their :func:`_slice_masks` combined (all: ``&``; any:
    ``|``)."""

    mixed: list[tuple[int | None, str | None, str]]
    holds: torch.Tensor
    parts: torch.Tensor
    masks: tuple[torch.Tensor, torch.Tensor, bool]


def _may_be_masked(patch: Any | None, maybe_sparse: bool) -> bool:
    """Whether an observed call's staged tensor of ``patch`` may hold NaN meaning "keep":
    a sparse patch's, or one the observer matched to no patch (``None``) where the load
    has sparse patches (``maybe_sparse``)."""
    return maybe_sparse if patch is None else patch.indices is not None


def _bits_dtype(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> torch.dtype | None:
    """The dtype whose elements ``out``'s bytes are, ``out`` made from ``src`` (whose
    bytes are stretch ``hit``'s): ``hit``'s where the op kept ``src``'s dtype (it moved
    the bits: a clone of ``w.view(torch.int32)`` still holds float32 elements), else
    ``out``'s own (a cast: NaN stays NaN)."""
    return hit.dtype if out.dtype == src.dtype else out.dtype


def _misread(hit: _Source, src: torch.Tensor, out: torch.Tensor
             ) -> tuple[torch.dtype, torch.dtype] | None:
    """:attr:`_Source.misread` of ``out`` made from ``src`` (whose bytes are stretch
    ``hit``'s): ``hit``'s, or, for a cast of a ``src`` that reads ``hit``'s bytes as
    another dtype (``w.view(torch.bfloat16).to(torch.float8_e4m3fnuz)`` of a float32
    ``w``), ``(hit's dtype, src's)``. An op that moves the bits (``out`` of ``src``'s
    dtype) needs no mark: its stretch keeps ``hit``'s dtype, which a read as another one
    is refused by. A ``src`` of ``hit``'s own dtype whose elements straddle two of the
    patch's (:func:`_misaligned`) reads garbage, whatever the op makes of it: marked
    ``(hit's dtype, src's)`` as well, two dtypes of one size."""
    if hit.misread is not None or hit.dtype is None:
        return hit.misread
    if src.dtype.to_real() == hit.dtype.to_real():
        return (hit.dtype, src.dtype) if _misaligned(hit, src) else None
    return None if out.dtype == src.dtype else (hit.dtype, src.dtype)


def _reinterpreted_words(kind: str, held: torch.dtype, read: torch.dtype,
                         dtype: torch.dtype) -> str:
    """What a source of :meth:`~patchkit.intercept.WriteSession._reinterpretation`'s
    ``kind`` does with a patch's bytes (held as ``held``, read as ``read``; the source
    is of ``dtype``), and why its staged NaN is lost, for a message."""
    if kind == "shifted":
        return (f"made from patch data held as {held} moved by a number of bytes that is "
                f"no multiple of its {held.itemsize}-byte elements (such as "
                "`w.view(torch.uint8)[1:13].clone().view(torch.float32)`): each "
                f"{read} element it reads holds the end of one of the patch's elements and "
                "the start of the next, so the NaN that marks 'keep' in a sparse patch "
                "reads as numbers")
    if kind == "cast":
        return (f"cast from a view that reads patch data held as {held} as another dtype "
                f"(such as `w.view({read}).to({dtype})`): the NaN that marks 'keep' in a "
                f"sparse patch is a {held} bit pattern, which {read} does not read as NaN, "
                "and a cast of what it reads keeps none of it")
    return (f"that reads patch data held as {held} as another dtype (a view such as "
            f"`w.view({read})`): the NaN that marks 'keep' in a sparse patch is a {held} "
            f"bit pattern, which {read} does not read as NaN")


# How the staged NaN bits reach the model, and what to do instead, by kind
_REINTERPRETED_HOW = {"shifted": ", shifted,", "cast": ", cast,", "view": ""}
_REINTERPRETED_FIX = {
    "shifted": "Move a patch's values by whole elements.",
    "cast": "Cast the patch's values from their own dtype (`w.to({dtype})` keeps NaN).",
    "view": "Copy the patch's values as their own dtype (a cast, `.to()`, keeps NaN).",
}


def _misaligned(hit: _Source, t: torch.Tensor) -> bool:
    """Whether ``t``'s elements begin where stretch ``hit``'s elements do not (see
    :attr:`_Source.shift`): each then holds the end of one of the patch's elements and
    the start of the next (the staged NaN "keep", shifted, reads as a number)."""
    return bool(hit.shift) and (
        t.storage_offset() * t.element_size() - hit.shift) % _unit(hit, t) != 0


def _carried_shift(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> int:
    """:attr:`_Source.shift` of the stretch that contiguous ``out`` gets, made element
    for element from contiguous ``src`` (whose bytes are stretch ``hit``'s): where an op
    moved the bits (``out`` of ``src``'s dtype), the patch's elements move with them, by
    as many bytes as ``out`` lies from ``src`` (``w.view(torch.uint8)[1:13].clone()``:
    by one byte, so they begin 3 bytes into a float32 of the clone). A cast makes new
    elements (:func:`_misread` marks one of misaligned bytes); 0 where not known."""
    if out.dtype != src.dtype or hit.dtype is None or (hit.base is None and not hit.shift):
        return 0
    unit = hit.dtype.itemsize
    at = (out.storage_offset() - src.storage_offset()) * src.element_size() + (
        hit.shift if hit.base is None else hit.base * unit)
    return at % unit


def _in_layout(hit: _Source, t: torch.Tensor
               ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """Where view ``t`` of stretch ``hit``, the copy of a strided view of a patch's
    elements (:attr:`_Source.layout`), reads in the checkpoint: ``(offset of its first
    element, shape, strides)`` in checkpoint elements, or ``None`` where no such box
    tells it (``t`` reads the bytes as another element size, or a dimension of ``t``
    steps past the end of the copy's dimension it steps along, wrapping into the next:
    ``w[:, 2:5].float().reshape(-1)``)."""
    size = t.element_size()
    if hit.layout is None or hit.dtype is None or hit.dtype.itemsize != size:
        return None
    first, shape, cstride, ostride, start = hit.layout
    # the copy's dimensions, outermost first (each stride the product of the sizes of
    # those inside it: the copy fills its storage)
    order = sorted((d for d in range(len(shape)) if shape[d] > 1),
                   key=lambda d: -ostride[d])
    k = t.storage_offset() - start
    if k < 0:
        return None
    at = [0] * len(shape)
    for d in order:
        at[d], k = divmod(k, ostride[d])
    if k or any(i >= n for i, n in zip(at, shape)):
        return None
    offset = first + sum(i * c for i, c in zip(at, cstride))
    out, used = [], set()
    for n, st in zip(t.shape, t.stride()):
        d = next((d for d in order if st > 0 and st % ostride[d] == 0), None)
        if n == 1:
            out.append(0 if d is None else st // ostride[d] * cstride[d])
            continue
        if d is None or d in used or at[d] + (n - 1) * (st // ostride[d]) >= shape[d]:
            return None
        used.add(d)
        out.append(st // ostride[d] * cstride[d])
    return offset, tuple(t.shape), tuple(out)


def _packed(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its extent, one element at each place, in some order of its
    dimensions (contiguous, or a transposed or permuted contiguous tensor)."""
    acc = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st != acc:
            return False
        acc *= n
    return True


def _unit(hit: _Source, t: torch.Tensor) -> int:
    """The size in bytes of stretch ``hit``'s checkpoint elements (``t``'s own element
    size where its dtype is not known)."""
    return t.element_size() if hit.dtype is None else hit.dtype.itemsize


def _carried_base(hit: _Source, src: torch.Tensor, out: torch.Tensor) -> int | None:
    """``base`` (see :class:`_Source`) of the stretch that contiguous ``out`` gets, made
    element for element from contiguous ``src`` (whose bytes are stretch ``hit``'s):
    where an op moved the bits (``out`` of ``src``'s dtype, which keeps ``hit``'s), the
    checkpoint elements keep their bytes; a cast makes one element of each of ``src``'s,
    which are checkpoint elements only where ``src`` reads them in their own size.
    ``None``: not known, or no whole checkpoint element in its place."""
    if hit.base is None:
        return None
    unit, size = _unit(hit, src), src.element_size()
    if out.dtype == src.dtype:
        at = (out.storage_offset() - src.storage_offset()) * size + hit.base * unit
        return at // unit if at % unit == 0 else None
    return out.storage_offset() - src.storage_offset() + hit.base if size == unit else None


_IS_VIEW: dict = {}


def _is_view(func: Any) -> bool:
    """Whether an op returns a view of its input (cached per op)."""
    got = _IS_VIEW.get(func)
    if got is None:
        got = _IS_VIEW[func] = bool(getattr(func, "is_view", False))
    return got


def _box_in_units(t: torch.Tensor, size: int
                  ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """The elements of ``size`` bytes that view ``t`` (of another element size) touches,
    as a box of them: ``(storage offset, shape, strides)`` in elements of ``size``. Where
    ``t``'s rows are whole such elements (rows or columns of ``x.view(torch.uint8)`` for a
    float32 ``x``, float16 halves of float32 rows, int32 words of an 8-bit tensor), that
    is ``t.view(dtype)`` for a dtype of ``size``; where they cover part of an element (one
    byte of a float32, the low float16 half of each), the element they touch, once.
    ``None`` where those elements make no box: a stride of ``t`` that is no whole number
    of them, or boxes of neighbouring rows that would share an element."""
    a = t.element_size()
    b0 = t.storage_offset() * a
    shape, stride = list(t.shape), list(t.stride())
    # the bytes each innermost step covers: a row of t, where its last dimension is
    # contiguous (or of one element), else one element of t
    row = bool(shape) and (shape[-1] == 1 or stride[-1] == 1)
    run = shape.pop() * a if row else a
    if row:
        stride.pop()
    out = []
    for n, s in zip(shape, stride):
        if n > 1 and (s * a) % size:
            return None
        out.append(s * a // size)
    first, skip = divmod(b0, size)
    k = -(-(skip + run) // size)  # the elements a row's bytes touch
    if row or k > 1:
        shape.append(k)
        out.append(1)
    reach = 0  # the last element the smaller strides reach: each stride must pass it
    for s, n in sorted((s, n) for s, n in zip(out, shape) if n > 1):
        if s <= reach:
            return None
        reach += s * (n - 1)
    return first, tuple(shape), tuple(out)


def _in_elements_of(t: torch.Tensor, owner: torch.Tensor) -> bool:
    """Whether every byte of view ``t`` (of another element size) lies in ``owner``'s
    elements, decided on the box of :func:`_box_in_units` alone: each of its dimensions
    one of ``owner``'s, of the same stride, and within its bounds (``t.view(torch.int32)``
    of a bfloat16 column slice of a fused matrix). ``False`` where that is not shown."""
    size = owner.element_size()
    box = _box_in_units(t, size)
    if box is None:
        return False
    first, shape, stride = box
    at = _position_of(owner, first * size)
    if at is None:
        return False
    index = []
    for n in reversed(owner.shape):
        at, k = divmod(at, n)
        index.append(k)
    index.reverse()
    dims = {s: d for d, (n, s) in enumerate(zip(owner.shape, owner.stride())) if n > 1}
    for n, s in zip(shape, stride):
        if n > 1 and (s not in dims or index[dims[s]] + n > owner.shape[dims[s]]):
            return False
    return True


def _owner_units(t: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of runtime tensor ``owner`` that view ``t`` (of another element size)
    writes, as a view of ``owner`` (of its dtype) and its row-major offset in ``owner``:
    the box of :func:`_box_in_units` (each element ``t`` touches, once), or, where they
    make no box inside ``owner``, the span :func:`_owner_span` gives."""
    size = owner.element_size()
    box = _box_in_units(t, size)
    if box is not None:
        first, shape, stride = box
        at = _position_of(owner, first * size)
        if at is not None:
            u = owner.detach().as_strided(shape, stride, first)
            lo, hi = _byte_span(owner)
            u0, u1 = _byte_span(u)
            # (a column slice's extent holds its neighbours' columns too)
            if lo <= u0 and u1 <= hi and (owner.is_contiguous() or bool(
                    _holds(owner, _storage_offsets(u, None)).all())):
                return u, at
    return _owner_span(t, owner)


def _owner_span(t: torch.Tensor, owner: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The elements of runtime tensor ``owner`` that view ``t``'s bytes reach, as a view
    of ``owner`` (of its dtype) and its row-major offset in ``owner``: a flat slice of a
    contiguous ``owner``, else all of it."""
    if not owner.is_contiguous():
        return owner.detach(), 0
    s = owner.element_size()
    a0, a1 = _byte_span(t)
    o0 = owner.storage_offset() * s
    e0 = max(0, (a0 - o0) // s)
    e1 = min(owner.numel(), -(-(a1 - o0) // s))
    return owner.detach().reshape(-1)[e0:e1], e0


def _lost_in_cast(src: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
    """Where ``cast`` (``src`` cast to another dtype, on its device) is NaN and ``src``
    is not: a number the cast made NaN."""
    return nan_mask(cast) & ~nan_mask(src)


def _parts(t: torch.Tensor) -> torch.Tensor:
    """A complex ``t``'s real and imaginary parts, as a real view (a last dim of 2) of its
    storage: a lost number's mark is on the part that holds it."""
    return torch.view_as_real(t.conj() if t.is_conj() else t)


def _weak_storage(t: torch.Tensor) -> Any:
    """A weak reference to ``t``'s storage (``expired()`` once it is freed)."""
    return StorageWeakRef(t.untyped_storage())


_OUT_ARGS: dict = {}


def _out_args(func: torch._ops.OpOverload) -> tuple:
    """``(index, name)`` of each ``out=`` argument of ``func``, which it writes whole."""
    got = _OUT_ARGS.get(func)
    if got is None:
        got = _OUT_ARGS[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.is_out)
    return got


_OP_NAMES: dict = {}


def _op_name(func: torch._ops.OpOverload) -> str:
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = func._schema.name + (
            "" if func._overloadname == "default" else "." + func._overloadname
        )
    return name


# Floating dtypes with infinities: a cast into them turns no number into NaN (a sparse
# copy into any other floating dtype is checked for numbers lost that way).
_CASTS_KEEP_NUMBERS = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e5m2})
