"""``load_checkpoint_weight_patches``: validate → canonicalise → plan → stage → load."""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from ._regions import _span_of
from ._runtime_index import RuntimeIndex, _registers_twice, named_tensors
from .bitwise import bits
from .chunking import DEFAULT_MAX_CHUNK_BYTES, Chunk, plan_chunks
from .errors import (
    LOAD_WEIGHTS_DOES,
    ContractViolation,
    PatchError,
    PatchTypeError,
    PatchValueError,
    add_note,
    where,
)
from .intercept import _DEFERRAL, WriteRecorder, WriteSession, _patches_named, _returned_text
from .patch import (
    CheckpointWeightPatch,
    PatchLike,
    _as_patch,
    _shape_dims,
    _shape_text,
    check_flag,
    patch_list,
    resolved,
    staged_nbytes,
    validate_patches,
)
from .staging import _stage
from .units import _count, format_bytes

__all__ = ["canonicalize_tied", "load_checkpoint_weight_patches"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# What a model that is not an nn.Module needs to be loaded as one: its tensors are found
# through these (a test's duck-typed holder has them).
_MODULE_API = ("named_modules", "named_parameters", "named_buffers")


def load_checkpoint_weight_patches(
    model: torch.nn.Module,
    patches: Iterable[PatchLike],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    validate_unique_indices: bool = True,
    transactional: bool = False,
) -> set[str]:
    """Apply checkpoint-coordinate patches through ``model.load_weights``.

    The contract (``CONTRACT.md``), in short:

    1. ``patches`` (any iterable, read once) is validated completely before the first
       loader call; a failure raises :class:`ValueError`/:class:`TypeError` naming the
       patch (position and name), the reason and one offending value, and the model is
       untouched. Dense and sparse patches cannot be mixed in one call.
       **[patchkit]** A ``set`` (or ``frozenset``) in which two patches share a name is
       refused (reason ``"unordered"``): which of them wins depends on the set's order,
       which can change from run to run.
    2. Patches are grouped into ``load_weights`` calls in input order by
       :func:`~patchkit.plan_chunks`: a chunk closes before a patch that would push it past
       ``max_chunk_bytes`` (staged bytes) or that repeats a name already in it.
    3. Each patch is staged as a checkpoint-shaped tensor of its dtype on the device of
       its values: dense values viewed as ``shape`` (a view when the dtype matches: a
       loader that writes into the tensor it is given changes the caller's values, even
       in a transactional load that is rolled back); sparse values written into a
       NaN-filled tensor. Each chunk is one ``model.load_weights([(name, tensor), ...])``,
       its patches staged just before it (where memory for one runs out, torch's error
       comes with a note naming the patch, the call and the bytes it stages).
       **[patchkit]** Where the load fails during a call (or while staging one), that
       call's list, the one patchkit made and passed to ``load_weights``, is emptied
       before the error leaves the load, so a kept error (Jupyter keeps the last one,
       and its traceback's frames) does not keep the call's staged tensors alive
       through it. A post-mortem debugger still shows patchkit's frames and the
       loader's, where ``weights`` then reads ``[]`` (the error's note names what was
       sent); what the loader's own locals hold (the entry it was at) it keeps.
    4. During sparse calls, and only on this thread, same-shaped floating-point ``copy_``
       into the model's parameters and buffers keeps the runtime value wherever the source
       is NaN; any other write into runtime storage, overlapping destinations within one
       call, or a call that reports names without writing raise
       :class:`NotImplementedError` before that write happens; a copy in which a number
       of a patch arrives as NaN (an infinity or an out-of-range value, made NaN by the
       cast into a float8 ``fnuz`` or ``e8m0fnu`` parameter, or by a cast the loader
       made before: ``.to()``, a copy into a tensor of its own, a detour through another
       dtype), which would read as "keep", raises :class:`ValueError` (reason ``"NaN in
       the runtime dtype"``), writing nothing of that copy. (A number the loader's own
       cast made NaN is followed from that cast, in the call or a later one of the load,
       through views, casts, clones, ``copy_``, puts into tensors of the loader's own
       (``index_put_``, as ``buf[rows] = x``, ``index_copy_``, ``masked_scatter_``,
       ``scatter_``, ``put_``, ``index_fill_``, and those that add or reduce,
       ``index_add_``, ``scatter_add_``, ``scatter_reduce_``) and their functional forms
       (``slice_scatter`` among them), ``cat``, ``stack``, indexing, ``take``,
       ``masked_select``, ``repeat``, ``roll``, ``flip`` and ``gather``, complex round
       trips (``torch.complex``, ``view_as_real``, ``view_as_complex``), and through
       pointwise ops (arithmetic, ``clamp``, ``where``, ``masked_fill``, in place or
       not, and each tensor's op in a ``torch._foreach_*`` one), through which a NaN
       stays NaN (a ``where`` or a ``masked_fill`` only from the side it takes), so a
       loader may scale, cast and shard in any order; a fill (``fill_``, ``zero_``,
       ``masked_fill_``; of a 0-d tensor, with its number's trail) or an ``out=`` op
       writes its elements anew, and a pointwise op that makes a number of the NaN
       (``nan_to_num``) ends its trail there; other ops on it (a matmul, a
       reduction) lose the trail, and the copy's own cast is what is checked.) A copy
       whose source an op that mixes elements (a matmul, a reduction such as the
       ``amax`` of a scale, a sort, a ``cumsum``, a softmax: any op that is not a view,
       a copy, pointwise or an element move; a put that adds, ``index_add_``, only where
       an index repeats, a reduction only over a dim longer than 1; a reduction, scan,
       softmax, sort or matmul only where a slice it reduces both keeps and updates, or
       its result is not NaN exactly where its slices keep; an
       element-wise op, in place or ``out=`` too, only where it pairs different elements
       of patches' data that do not keep alike, ``w - w[0]``, ``w + w.flip(0)``, or data
       without NaN of a patch's own place, of a patch sent whole, made from patches'
       data by moves, copies and ops that keep NaN alone, or of a part of a tensor the
       loader made with data that holds NaN, ``w * s``, ``a * b.abs()[0]``,
       ``x - x[0]``) made
       from a patch's data while that data held NaN, or that was computed from such a
       result, raises :class:`NotImplementedError` (reason
       ``"mixed elements"``, naming the op), writing nothing of that copy: the staged NaN
       has spread over elements the patch updates. So does a copy whose source an op that
       may make a number of a NaN (``nan_to_num``, ``fmax``, a ``where``, ``masked_fill``
       or index put by a condition taken from patches' data) made from a patch's data,
       or that was computed from such a result, where at an element the patch keeps it
       would write a number other than the runtime tensor's own bits (reason
       ``"replaced NaN marks"``, naming the op): a merge on purpose,
       ``torch.where(w.isnan(), param, w)``, writes those bits and loads. A call that
       rebinds a
       runtime tensor (``param.data = w``), registers a new one in its place
       (``module.w = nn.Parameter(w)``, under any of a tied tensor's names) or registers
       one under a name the model did not have is caught when it returns: the original is
       put back, a new name removed, and :class:`NotImplementedError` raised. A call that
       raises instead has them put back too (they may hold the staged NaN), and its own
       exception propagates with a note saying so (on Python 3.10, whose traceback shows
       no notes, a warning too); its
       copies stay, as item 5 says. Writes the loader makes on
       another thread, or with torch's dispatch modes switched off (its private
       ``_disable_current_modes()``, ``torch._C._DisableTorchDispatch()``), are not seen:
       a sparse load's NaN can then reach the model.
    5. ``transactional=False`` (the default, as in vLLM): a loader failure leaves the
       writes made so far in place and propagates unchanged (**[patchkit]** an error the
       model's ``load_weights`` raised, its own ``KeyError`` for a name it lacks, torch's
       for a shape, gets a note (``__notes__``, on 3.10 too) naming the call and the
       patches it was sent: ``(raised in load_weights call 1, sent patch 3 ('x'))``, and in
       a call of several, where a function the error passed through was handed one patch's staged
       tensor, that patch first: ``(raised in load_weights call 1 at patch 9 ('y'); sent
       ...)``; patchkit's own errors name their patch already). **[patchkit]**
       ``transactional=True``: every runtime region is saved before its first write, and
       any exception restores them all bit for bit before it propagates, a signal's too
       (Ctrl-C, a SIGTERM handler that raises): on the main thread a signal that comes
       while a write is being saved has its handler wait until it is, and so does one
       that comes while the finished load lets its saves go, its last step: that one
       finds the load done, and it stands (as after a Ctrl-C just after the call). The
       extra memory kept is at most the size of the regions written (a dense copy from a
       same-shaped source of the same dtype and device saves only the elements it
       changes; a NaN-merge through torch ops, its whole view where that is smaller than
       its written elements with their int64 offsets). Through torch ops (a GPU; on the
       CPU, dtypes the compiled path does not cover, float8 among them) a dense copy
       also takes a transient 1-byte mask of its view, and the positions of its
       changes, while it is compared, so the peak of a load that writes
       one tensor can pass that tensor's bytes: measured, 1.8 times a float8 view's where
       a tenth of it changes, 1.7 times a bfloat16 view's where a fifth does. Dense
       calls are watched through a torch function mode: a write the loader makes inside
       ``torch._C.DisableTorchFunction()`` or through a storage there is not seen, so not
       restored; nor is one made on another thread. A rollback warns of the calls that
       returned names (or ``None``) without a write it saw (a ``UserWarning``): what
       they wrote, if anything, stays. The module tree's registrations are
       put back as they were when the load began, another thread's changes to them
       meanwhile included (serialize loads into one model): a rebound or newly
       registered runtime tensor gets its original back; a name the model did not have
       is removed; submodules, empty slots such as ``bias=None``, buffers' persistence,
       the order of names and each runtime tensor's ``requires_grad`` (a loader's
       ``p.requires_grad_(False)``) are restored.
       Should a region fail to be written back, the others still are, and a
       ``RuntimeError`` naming the targets left unrestored propagates instead, with the
       load's own error as its ``__context__``.
    6. **[patchkit]** A patch naming the alias of a tied parameter is renamed to the
       canonical (first registered) name, or dropped when the canonical name is patched
       in the same call.

    With ``validate_unique_indices=False`` and a sparse patch that repeats an index,
    which of its values lands there is unspecified (torch's ``index_copy_`` does not
    order duplicates; on the CPU with several threads it varies from run to run).

    Returns the union of the names the ``load_weights`` calls returned (a call returning
    ``None`` adds nothing). An empty ``patches`` makes no call and returns ``set()``.
    Runs under :func:`torch.no_grad`.

    ``model`` must be a :class:`torch.nn.Module` (or have its ``named_modules``,
    ``named_parameters`` and ``named_buffers``) with a ``load_weights`` method, and
    ``max_chunk_bytes`` a positive whole number of bytes (``1.5`` or ``inf`` is refused:
    pass a large int for no limit): :class:`~patchkit.PatchTypeError` /
    :class:`~patchkit.PatchValueError` otherwise, before any ``load_weights`` call.
    ``validate_unique_indices`` and ``transactional`` must be ``True`` or ``False``:
    anything else (``None``, ``0``, ``"no"``) raises :class:`~patchkit.PatchTypeError`
    once ``patches`` is read (the contract reads it first), before any patch is checked
    or loaded.
    """
    return run_load(
        model,
        patches,
        max_chunk_bytes=max_chunk_bytes,
        validate_unique_indices=validate_unique_indices,
        transactional=transactional,
    )


def refuse_model_class(model: object) -> None:
    """:class:`~patchkit.errors.PatchTypeError` (reason ``"model is a class"``, value
    the class's name) when ``model`` is a class, ``MyModel`` where ``MyModel(...)`` was
    meant: its methods are there, unbound, so it would pass for a module until the
    first of them is called without ``self``."""
    if isinstance(model, type):
        raise PatchTypeError(
            f"model {model.__name__} is a class, not a model: pass an instance of it "
            f"({model.__name__}(...))",
            reason="model is a class", value=model.__name__,
        )


def run_load(
    model: torch.nn.Module,
    patches: Iterable[PatchLike],
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    validate_unique_indices: bool = True,
    transactional: bool = False,
    recorder: WriteRecorder | None = None,
    save_regions: bool = False,
    session_out: list | None = None,
    planned: tuple[list, list, list] | None = None,
    index: RuntimeIndex | None = None,
) -> set[str]:
    """The loader with its observation hooks (used by :mod:`patchkit.inspect`).

    ``recorder`` is told of every call and runtime write; ``save_regions`` keeps the
    before-values of every written region (``transactional`` implies it);
    ``session_out``, when given, receives the :class:`~patchkit.intercept.WriteSession`
    so the caller can read the saved regions after the load; ``planned``, when given, is
    ``(kept, positions, chunks)`` as :func:`canonicalize_tied` and
    :func:`~patchkit.chunking.plan_chunks` make them for these patches, model and budget
    (a caller that has them already), used once the patches are valid; ``index``, when
    given, is a :class:`~patchkit._runtime_index.RuntimeIndex` of ``model`` as it is now (the
    caller's, built for the same load), which a watched load uses instead of its own.
    """
    with torch.no_grad():
        # (read first, as CONTRACT says; a lazily negated tensor made plain)
        patches = [resolved(_as_patch(p)) for p in patch_list(patches)]
        check_flag(transactional, "transactional")  # (validate_patches checks the other)
        kind = validate_patches(
            patches,
            max_chunk_bytes=max_chunk_bytes,
            validate_unique_indices=validate_unique_indices,
        )
        if kind is None:
            return set()
        refuse_model_class(model)
        lacks = [a for a in _MODULE_API if not callable(getattr(model, a, None))]
        if lacks and not isinstance(model, torch.nn.Module):
            # (its tensors are found as a module's: tied names, a sparse load's watch; a
            # model without them failed later with a bare AttributeError)
            raise PatchTypeError(
                f"model {type(model).__name__} is not a torch.nn.Module (it has no "
                f"{lacks[0]}); the contract loads patches into a module's parameters and "
                "buffers, through its load_weights",
                reason="not a module", value=type(model).__name__,
            )
        _check_meta(model, patches)
        load_weights = getattr(model, "load_weights", None)
        if not callable(load_weights):
            raise PatchTypeError(
                f"model {type(model).__name__} has no load_weights(weights) method; the "
                "contract applies patches through the model's own checkpoint loader: give "
                f"it one that {LOAD_WEIGHTS_DOES}",
                reason="no load_weights", value=type(model).__name__,
            )
        sparse = kind == "sparse"
        watched = sparse or transactional or recorder is not None or save_regions
        # A watched load makes a few objects per runtime tensor and per write: Python's
        # cyclic collector, set off by them, cost two thirds of a sparse load's time on a
        # model of 100 k tensors. It is off for the load (and for any other thread's
        # paused load still running), as it was after.
        pause = object() if watched else None
        session = None
        try:
            if pause is not None:  # (inside the try: a signal right after it still resumes)
                _pause_collector(pause)
            if watched and index is None:
                # (the session's index, built first: it knows the tied parameters, so the
                # module tree is walked once)
                index = RuntimeIndex(model)
            if watched:
                index.refuse_wrappers("an inspected load" if recorder is not None
                                      else "a sparse load" if sparse else "a transactional load")
            alias_of = _tied_aliases(model) if index is None else index.tied_parameters
            if planned is not None:
                kept, positions, chunks = planned
            else:
                kept, positions = _canonicalized(patches, alias_of)
                chunks = plan_chunks(kept, max_chunk_bytes, positions=positions)
            by_position = dict(zip(positions, kept))
            session = None
            if watched:
                session = WriteSession(
                    model,
                    save_regions=transactional or save_regions,
                    recorder=recorder,
                    count_changes=recorder is not None,
                    index=index,
                )
                if session_out is not None:
                    session_out.append(session)
            loaded: set[str] = set()
            if transactional and session is not None:
                # Transactional loads also undo `param.data = w` (no write, nothing saved).
                session.bindings = session.index.bindings()
                # (and the requires_grad flags, which a loader may turn: no write shows it)
                session.grad_flags = session.index.grad_flags()
            # the patches CONTRACT §6 renamed, and those of a canonical name whose alias
            # patch it dropped: each is checked against what its call returned (a loader
            # that skips the canonical name loses the update either way)
            renamed = {p for p in positions if by_position[p].name != patches[p].name}
            dropped = {patches[i].name for i in set(range(len(patches))).difference(positions)}
            if dropped:
                absorbing = {alias_of[name] for name in dropped}
                renamed.update(p for p in positions if by_position[p].name in absorbing)
            aliases_of: dict[str, list[str]] = {}  # first name -> its aliases, in order
            if renamed:  # (built once: a scan of every alias per checked patch was quadratic)
                for alias, first in alias_of.items():
                    aliases_of.setdefault(first, []).append(alias)
            finished = False  # the saves are let go: no rollback can run from here
            staged = None  # (the list of the call in progress, emptied where it fails)
            try:
                for chunk in chunks:
                    staged = _staged(chunk, by_position)
                    if session is None:
                        returned = _called(load_weights, staged, chunk)
                    else:
                        with session.call(
                            chunk.index, staged, chunk.positions, sparse=sparse,
                            patches=[by_position[p] for p in chunk.positions],
                        ) as r:
                            # Read the names inside the interception: a generator-function
                            # loader does its copies only while it is iterated.
                            r.returned = returned = _called(load_weights, staged, chunk)
                    if returned is not None:
                        loaded.update(returned)
                        if renamed:
                            _warn_if_renamed_not_loaded(
                                sorted(renamed.intersection(chunk.positions)), patches,
                                by_position, returned, alias_of, aliases_of, dropped)
                    staged = None
                if transactional and session is not None and not save_regions:
                    # A signal after the last call (until here) rolls the load back, as any
                    # error before the call returns does; one while the saves are let go
                    # waits for that, and then finds a finished load.
                    with _DEFERRAL.holding():
                        finished = True
                        session.discard()
            except BaseException as exc:
                try:
                    if session is not None:
                        session.end_calls()  # (a call a signal left open: its modes go first)
                    if transactional and session is not None and not finished:
                        with _DEFERRAL.holding():  # (a second Ctrl-C waits for the rollback)
                            _roll_back(session, exc)
                finally:
                    if staged is not None:
                        # The list patchkit made and passed to load_weights, emptied: the
                        # error's traceback (which Jupyter keeps) holds this frame and the
                        # loader's, and through the list every tensor staged for the call.
                        staged.clear()
                raise
            return loaded
        finally:
            try:
                if session is not None:
                    session.end_calls()
            finally:  # (a signal in end_calls still finds the collector back on)
                # The session and the index (thousands of objects of this load, made with
                # the collector off) are let go while it is still off: the collection that
                # the next allocation sets off once it is back on walked them all first,
                # 0.4 ms of a transactional load of 291 small tensors. (A caller that
                # passed them in, or took the session, keeps its own.)
                session = index = None
                if pause is not None:  # (written out: see _pause_collector)
                    with _PAUSE_LOCK:
                        counted, resume = pause in _paused_by, _resume_after
                        try:
                            _paused_by.discard(pause)
                        finally:
                            if counted and resume and not _paused_by:
                                gc.enable()


# The loads (and reports) running with Python's cyclic collector paused, process-wide:
# the first to begin pauses it, the last to end turns it back on where it was on when
# the first began. (Each load restoring what it found let the first of two loads on two
# threads turn the collector on while the other still ran, its collections mid-load
# again.) A token per load: only a pause that was counted is taken off, so a signal
# before or inside _pause_collector leaves nothing behind. The end of a pause (the block
# in run_load's ``finally``) is written out where a pause ends, not called:
# a Python signal handler may run at the start of a function, and raising there would
# leave the token counted for good; inside the block a signal is handled only after
# ``discard`` returns, and the inner ``finally`` still turns the collector on. An RLock:
# a signal handler may run a load while this thread holds it.
_PAUSE_LOCK = threading.RLock()
_paused_by: set[object] = set()
_resume_after = False  # the collector was on when the first of _paused_by began


def _collector_after_fork() -> None:
    """In a child forked while loads ran on other threads of the parent: the child has
    the forking thread only, so those loads never end there, and their pauses are taken
    off now (the collector back on where it was on when the first began). Their tokens
    kept it off for good: a child forked during a weight sync on a background thread (a
    ``DataLoader`` worker) ran without its cyclic collector, its own loads included. A
    fresh lock too: one another thread held at the fork is held for good in the child.
    (A load of the forking thread itself goes on in the child with the collector on.)"""
    global _PAUSE_LOCK
    _PAUSE_LOCK = threading.RLock()
    if _paused_by:
        _paused_by.clear()
        if _resume_after:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_collector_after_fork)


def _pause_collector(token: object) -> None:
    """Pause the cyclic collector for a load, ``token`` (a fresh ``object()``) standing
    for it until the end of its pause (``_paused_by`` no longer holding it), written out
    in the load's ``finally`` as :func:`run_load`'s is (see above; ``resume`` read first:
    a signal handler's load after the discard sets ``_resume_after`` anew, to off)."""
    global _resume_after
    with _PAUSE_LOCK:
        if not _paused_by:
            _resume_after = gc.isenabled()
        _paused_by.add(token)
        gc.disable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused for the block, process-wide; as it was once the
    last block paused on any thread ends (see :func:`_pause_collector`)."""
    token = object()
    try:
        _pause_collector(token)
        yield
    finally:
        with _PAUSE_LOCK:
            counted, resume = token in _paused_by, _resume_after
            try:
                _paused_by.discard(token)
            finally:
                if counted and resume and not _paused_by:
                    gc.enable()


def _roll_back(session: WriteSession, exc: BaseException) -> None:
    """A transactional load's rollback after ``exc``: the module tree's registrations as
    they were (tensors registered anew under any of a tied tensor's names, names removed
    or new, submodules replaced); then the storage of tensors whose ``.data`` was
    rebound, and the view (shape, strides, offset) of those the load changed in place
    (``resize_``, ``unsqueeze_``, ``t_``, an ``out=`` op that resized one), and each
    runtime tensor's ``requires_grad`` where the load turned it; then the saved
    values, each through its view as it was saved. Raises what stops it."""
    registrations_undone = session.index.undo()
    left = session.index.not_undone()
    bindings = session.bindings
    rebound = session.index.rebound(bindings)
    # (and the view of a tensor the load changed in place: resize_, unsqueeze_, t_, an
    # out= op that resized it; the saved regions are written through their own views)
    rebound += [n for n in session.index.reshaped(bindings) if n not in rebound]
    for name in rebound:
        session.index.tensors[name].data = bindings[name]
    if session.grad_flags is not None:  # (p.requires_grad_(False) in load_weights)
        session.index.restore_grad_flags(session.grad_flags)
    # (a call with no write seen may have rebound or registered a tensor, which this
    # rollback put back; only a report's calls looked, each as it ended: one of those
    # may still have written, unwatched, into a tensor an earlier call rebound)
    tree_changed = (registrations_undone or bool(rebound)) and (
        session.recorder is None or session.quiet_after_rebinding)
    try:
        session.restore()
    except BaseException:
        # Keep only what a report of it needs: the saves of the targets left as the load
        # wrote them (the error's traceback holds the session).
        unrestored = set(session.unrestored)
        session.saved = [r for r in session.saved if r.target in unrestored]
        raise
    session.discard()
    _warn_if_quiet_calls(session, exc, tree_changed)
    if left:
        raise RuntimeError(
            f"the rollback could not register runtime tensor {left[0]!r} again "
            f"(of {len(left)} the load registered anew): the model does not keep "
            "it in nn.Module's registries, so it holds the tensor the loader "
            "gave it; the saved values were restored"
        ) from exc


def _warn_if_quiet_calls(session: WriteSession, exc: BaseException, tree_changed: bool
                         ) -> None:
    """After a rollback: warn of the load's calls that returned names (or ``None``) but
    made no write the session saw (:attr:`WriteSession.quiet_calls`). What such a call
    wrote, if anything, was written where no interception sees and stays in the model.
    ``tree_changed``: the load rebound or registered a tensor, which the rollback put
    back, and which a quiet call of a load without a report may have been; or a quiet
    call (a report's too) came after an earlier call rebound or registered one, and may
    have written into it (unwatched: the new tensor is no storage the load began with),
    which the rollback put back with it. The warning also says that such a call may have
    written nothing at all (a loader that skips weights another rank holds, experts under
    expert parallelism say, and returns their names anyway), which loses nothing. Where warnings
    are errors, the warning goes onto ``exc`` as a note (``__notes__``) instead: the
    load's own error stays the one raised."""
    if session.first_quiet is None:
        return
    call, returned = session.first_quiet
    said = "returned None" if returned is None else f"returned {_returned_text(returned)}"
    more = len(session.quiet_calls) - 1
    others = f" (and {_count(more, 'other call')} alike)" if more else ""
    unless = (" (unless they rebound or registered tensors, or wrote into ones an earlier "
              "call rebound or registered, which the rollback put back: the load did)"
              if tree_changed else "")
    try:
        warnings.warn(
            f"the rollback put back every write it saw, but {call} {said} without a write "
            f"it saw{others}: a loader that writes on another thread, through a storage "
            "(untyped_storage().copy_) or numpy, with torch function handling off or inside "
            f"TorchScript is not watched, and what it wrote there stays in the model{unless}; "
            "a call that wrote nothing (a loader that skips weights another rank holds yet "
            "returns their names) left nothing to put back",
            UserWarning,
            stacklevel=_outside_patchkit(),
        )
    except Warning as w:
        add_note(exc, str(w))


def _check_meta(model: Any, patches: Sequence[CheckpointWeightPatch]) -> None:
    """Patches on the meta device hold no numbers: only a dry run, a model with tensors on
    the meta device, can load them. Refused before the first call, naming the first
    such patch, for a model with no tensor on the meta device. (Which runtime tensor a
    patch lands in is known only once the loader runs, so a meta patch for a real tensor
    of a partly meta model still fails in the loader, as torch refuses the copy.)"""
    pos = next((i for i, p in enumerate(patches)
                if p.values.is_meta or (p.indices is not None and p.indices.is_meta)), None)
    if pos is None or not isinstance(model, torch.nn.Module):
        return
    tensors = (*model.parameters(), *model.buffers())
    if not tensors or any(t.is_meta for t in tensors):
        return
    p = patches[pos]
    what = "values" if p.values.is_meta else "indices"
    raise PatchValueError(
        f"{where(pos, p.name)}: {what} are on the meta device, which holds no numbers to "
        f"load; only a model with tensors on the meta device loads such patches (this "
        f"one's are on {tensors[0].device})",
        position=pos, name=p.name, reason="meta device", value=tensors[0].device,
    )


def canonicalize_tied(
    model: torch.nn.Module, patches: Sequence[CheckpointWeightPatch], *, warn: bool = True
) -> tuple[list[CheckpointWeightPatch], list[int]]:
    """CONTRACT §6: rename or drop patches that name the alias of a tied parameter.

    A Parameter registered under several names (a tied input embedding and ``lm_head``)
    has its first registered name as canonical. A patch naming an alias becomes a patch
    for the canonical name, unless a patch for the canonical name is in the same call,
    in which case it is dropped (the shared storage is written once). Returns the kept
    patches and their positions in the input.

    [patchkit] A dropped alias patch that would have changed what the load writes (its
    shape, dtype, indices or values differ from every patch of the canonical name) is
    not loaded silently: with ``warn``, a :class:`UserWarning` names it. A tied trainer's
    state dict, whose two names hold one tensor, costs no comparison.
    """
    return _canonicalized(patches, _tied_aliases(model), warn=warn)


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Each alias of a Parameter registered under several names -> its first name.

    A model with no tensor registered twice (most) is told by
    :func:`~patchkit._runtime_index._registers_twice`, a walk that builds no names (at 1000
    modules, less than half of a named walk's cost, which every dense load paid); a
    model that has one pays for the names too, after that walk stops at the first
    repeat (which a tied ``lm_head`` beside ``model.embed_tokens`` reaches early)."""
    if _registers_twice(model) is False:
        return {}
    canonical: dict[int, str] = {}
    alias_of: dict[str, str] = {}
    for name, p in named_tensors(model, buffers=False):
        first = canonical.setdefault(id(p), name)
        if first != name:
            alias_of[name] = first
    return alias_of


def _canonicalized(
    patches: Sequence[CheckpointWeightPatch], alias_of: dict[str, str], *, warn: bool = True
) -> tuple[list[CheckpointWeightPatch], list[int]]:
    """:func:`canonicalize_tied` with the model's tied parameters known already
    (``alias_of``: each alias's first name, as a :class:`~patchkit._runtime_index.RuntimeIndex`
    has them in ``tied_parameters``), so that a load that builds an index walks the
    module tree once."""
    if not alias_of:
        return list(patches), list(range(len(patches)))
    names = {p.name for p in patches}
    kept: list[CheckpointWeightPatch] = []
    positions: list[int] = []
    by_name: dict[str, list[int]] | None = None  # name -> its patches' positions
    rank: collections.Counter[str] = collections.Counter()  # patches of a name so far
    for i, p in enumerate(patches):
        target = alias_of.get(p.name)
        if target is None:
            kept.append(p)
        elif target in names:
            if warn:
                if by_name is None:  # (built once: a scan per dropped patch was quadratic)
                    by_name = {}
                    for j, q in enumerate(patches):
                        by_name.setdefault(q.name, []).append(j)
                _warn_if_dropped_differs(i, p, target, patches, by_name[target], rank[p.name])
                rank[p.name] += 1
            continue
        else:
            kept.append(p._replace(name=target))
        positions.append(i)
    return kept, positions


def _warn_if_dropped_differs(
    i: int, p: CheckpointWeightPatch, target: str, patches: Sequence[CheckpointWeightPatch],
    same: list[int], rank: int,
) -> None:
    """Warn that alias patch ``i`` is dropped when no patch of ``target`` (the canonical
    name; ``same``: their positions) carries what it carries. ``rank``: how many patches
    of ``p``'s name came before it. The canonical patch of that rank is compared first:
    a tensor and its tied copy split alike (``split_patch``) match part for part, so a
    load of such parts makes one comparison per part, not one per pair."""
    compared = True
    if rank < len(same):  # (the rest only when it differs: no copy of ``same`` per part)
        first = same[rank]
        order: Iterable[int] = itertools.chain((first,), (j for j in same if j != first))
    else:
        order = same
    for j in order:
        same_content = _same_content(p, patches[j])
        if same_content:
            return
        compared = compared and same_content is not None
    # (a meta tensor, a dry run's, holds no values to compare)
    how = ("Its values differ from those" if compared else
           "Its values could not be compared with those (a meta tensor holds none)")
    warnings.warn(
        f"{where(i, p.name)} is not loaded: it names the tied alias of {target!r}, which "
        f"this load also patches ({'patches' if len(same) > 1 else 'patch'} "
        f"{', '.join(map(str, same))}), and CONTRACT §6 writes the shared storage once, from "
        f"the canonical name's patches. {how}; send one name per tied tensor",
        UserWarning,
        stacklevel=_outside_patchkit(),
    )


def _called(load_weights: Any, staged: list[tuple[str, torch.Tensor]], chunk: Chunk
            ) -> set[str] | None:
    """One call of the model's ``load_weights``, its return read as names
    (:func:`_names`); what it raises gets :func:`_note_the_call`'s note."""
    try:
        return _names(load_weights(staged), chunk)
    except BaseException as exc:
        _note_the_call(exc, chunk, staged)
        raise


def _note_the_call(exc: BaseException, chunk: Chunk,
                   staged: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Add to an error the model's ``load_weights`` raised (its own ``KeyError`` for a
    name it lacks, torch's for a shape it cannot take, a Ctrl-C) a note (its ``__notes__``)
    naming the call and the patches it was sent: ``"(raised in load_weights call 2, sent
    patch 4 ('a'), patch 5 ('b'))"``, the first five and how many more; and, in a call
    of several, where :func:`_patch_at_fault` finds the patch the model was at (a
    ``weight_loader(param, loaded_weight)`` that asserts the shape, as vLLM's do, names
    no weight), that one first: ``"(raised in load_weights call 2 at patch 9 ('x'); sent
    patch 4 ('a'), ...)"``. The error is otherwise as raised. patchkit's own errors (a
    :class:`~patchkit.errors.PatchError`: a write refused inside the call, a return
    value outside the contract) name their patch already and get none."""
    if isinstance(exc, PatchError):
        return
    sent = _patches_named(chunk.positions, chunk.names, len(chunk.positions))
    try:
        k = _patch_at_fault(exc, staged) if len(chunk.positions) > 1 else None
    except Exception:  # (a search that fails only leaves the patch at fault out: never
        k = None  # an error of its own in place of the model's)
    at = "," if k is None else f" at {where(chunk.positions[k], chunk.names[k])};"
    add_note(exc, f"(raised in load_weights call {chunk.index}{at} sent {sent})")


def _patch_at_fault(exc: BaseException, staged: Sequence[tuple[str, torch.Tensor]]
                    ) -> int | None:
    """The entry of ``staged`` (a failed call's list) that the code raising ``exc`` was
    handling, or ``None``: found in the innermost frame of its traceback (below the
    caller's own, the first) whose arguments hold a staged tensor or a view into one,
    directly or in a tuple or list argument, where they hold one entry's only (an
    argument whose ``__class__`` or iteration raises, a lazy proxy's, is passed over). Only
    arguments, not other locals: a loop's variable still holds the last entry after
    its loop, when a later check may raise."""
    spans: dict[tuple, list[tuple[int, int, int]]] = {}
    for k, (_, t) in enumerate(staged):
        span = _span(t)
        if span is not None:
            spans.setdefault(span[0], []).append((span[1], span[2], k))
    if not spans:
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames[1:]):
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04)
        local = frame.f_locals
        found: set[int] = set()
        for name in code.co_varnames[:n]:
            try:
                found.update(_entries_in(local.get(name), spans))
            except Exception:  # (one whose ``__class__`` or ``__iter__`` raises: not read)
                continue
        if found:
            return found.pop() if len(found) == 1 else None
    return None


def _entries_in(arg: object, spans: dict[tuple, list[tuple[int, int, int]]]
                ) -> set[int]:
    """The entries of :func:`_patch_at_fault`'s ``spans`` whose memory holds ``arg``'s, a
    tensor or each tensor of a tuple or list."""
    found: set[int] = set()
    for t in arg if isinstance(arg, (tuple, list)) else (arg,):
        span = _span(t) if isinstance(t, torch.Tensor) else None
        if span is not None:
            found.update(k for lo, hi, k in spans.get(span[0], ())
                         if lo <= span[1] and span[2] <= hi)
    return found


def _span(t: torch.Tensor) -> tuple[tuple, int, int] | None:
    """``(storage key, first byte, end byte)`` of the memory ``t``'s elements lie in
    (:func:`~patchkit._regions._span_of`), or ``None`` (no memory: empty, meta, a
    wrapper subclass)."""
    try:
        if t.numel() == 0 or t.is_meta:
            return None
        key, lo, hi, _ = _span_of(t)
        return key, lo, hi
    except Exception:  # (a tensor subclass that has no storage to read)
        return None


def _staged(
    chunk: Chunk, by_position: dict[int, CheckpointWeightPatch]
) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, staged tensor)`` pairs of one call. Staging a sparse patch allocates
    its whole checkpoint-shaped tensor (and a dense one whose values need a cast, a copy):
    where that fails (out of memory, a shape mistyped by orders of magnitude), the error
    is torch's own (``RuntimeError``, ``torch.OutOfMemoryError``), raised before this
    call's ``load_weights``, with a note (its ``__notes__``) naming the patch, the call and
    its staged size."""
    out = []
    for p in chunk.positions:
        patch = by_position[p]
        try:
            out.append((patch.name, _stage(patch)))
        except BaseException as exc:
            out.clear()  # (the call's tensors staged so far: not held by the traceback)
            if not isinstance(exc, (RuntimeError, MemoryError)):
                raise
            kind = "dense" if patch.indices is None else "sparse"
            staged = format_bytes(staged_nbytes(patch))
            add_note(exc, (
                f"(raised staging {where(p, patch.name)} for load_weights call "
                f"{chunk.index}, before that call: a {kind} patch of shape "
                f"{_shape_text(_shape_dims(patch.shape))} {patch.dtype} stages {staged})"
            ))
            raise
    return out


def _warn_if_renamed_not_loaded(
    positions: Sequence[int], patches: Sequence[CheckpointWeightPatch],
    sent: dict[int, CheckpointWeightPatch], returned: set[str], alias_of: dict[str, str],
    aliases_of: dict[str, list[str]], dropped: set[str],
) -> None:
    """[patchkit] Warn for each patch at ``positions`` (of this call) that CONTRACT §6
    renamed (``sent``) to its tied Parameter's first registered name, or that names that
    first name while a patch of an alias was dropped (``dropped``: their names), when the
    loader returned no name
    of that Parameter: a loader that skips the name it was sent
    (vLLM's skip ``lm_head.weight`` when the embedding is tied; a model that registers
    ``lm_head`` first makes that the canonical name) leaves the update unwritten, and
    says so only by what it returns. ``aliases_of``: each first name's aliases, as
    ``alias_of`` has them (built once per load, so a load checking many patches against
    many aliases does not scan every alias for each)."""
    returned_first: set[str] | None = None  # the first names of what was returned
    for pos in positions:
        name, asked = sent[pos].name, patches[pos].name
        if name in returned:
            continue
        if returned_first is None:
            returned_first = {alias_of.get(r, r) for r in returned}
        if name in returned_first:
            continue
        aliases = aliases_of.get(name, [])
        how = (f"was sent as {name!r}, the first registered name of the tied Parameter it "
               "names (CONTRACT §6)" if name != asked else
               f"names the tied Parameter whose patch under "
               f"{_names_text([a for a in aliases if a in dropped])} this load dropped "
               "(CONTRACT §6 writes the shared storage once, from the first registered name)")
        warnings.warn(
            f"{where(pos, asked)} {how}, and the loader's call returned no name of that "
            f"Parameter (of the {_count(len(returned), 'name')} it returned): it may not "
            f"have written the update. A loader that skips {name!r} loads a tied weight "
            "only under the other name: register that module first",
            UserWarning,
            stacklevel=_outside_patchkit(),
        )


def _names_text(names: Sequence[str]) -> str:
    return " or ".join(map(repr, names))


def _outside_patchkit() -> int:
    """The ``stacklevel`` of a warning raised here that names the caller's line: the
    first frame outside this package (a load's depth differs by entry point) and outside
    ``contextlib`` (whose frames lie between a call's block and its end)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                 or frame.f_code.co_filename == contextlib.__file__):
        level, frame = level + 1, frame.f_back
    return level


def _same_content(a: CheckpointWeightPatch, b: CheckpointWeightPatch) -> bool | None:
    """Whether two (valid) patches write the same: the same shape, dtype and indices,
    and values that stage to the same bits (one tensor: no comparison at all); on two
    devices, compared on the first one's. ``None`` where the values cannot be compared
    (either is on the meta device)."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if (a.indices is None) != (b.indices is None):
        return False
    if _same_tensor(a.values, b.values) and (
            a.indices is None or _same_tensor(a.indices, b.indices)):
        return True
    if any(t is not None and t.is_meta for t in (a.values, b.values, a.indices, b.indices)):
        return None
    if a.indices is not None and not _same_tensor(a.indices, b.indices):
        if a.indices.shape != b.indices.shape:
            return False
        if not torch.equal(a.indices.to(torch.int64),
                           b.indices.to(device=a.indices.device, dtype=torch.int64)):
            return False
    if _same_tensor(a.values, b.values):
        return True
    if a.values.shape != b.values.shape:
        return False
    return torch.equal(bits(a.values.to(a.dtype)),
                       bits(b.values.to(device=a.values.device, dtype=a.dtype)))


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same elements of the same memory, read the same way (on the meta device,
    where every address is 0, only the same tensor)."""
    return x is y or (
        not x.is_meta and x.dtype == y.dtype and x.device == y.device
        and x.data_ptr() == y.data_ptr()
        and x.shape == y.shape and x.stride() == y.stride()
    )


def _read_names(returned: Any) -> tuple[set[str] | None, Any, tuple[Any, ...]]:
    """A loader's return value (not ``None``) read as names: ``(names, shown, stray)``.
    ``names``: the set, where it is an iterable of str, else ``None``; ``shown``: what a
    message shows of it (an iterator is read here, and shows as the items it gave: what
    it raises propagates as it is); ``stray``: ``(item,)`` where it is an iterable with an
    item that is no str, else ``()``."""
    shown, items = returned, None
    if not isinstance(returned, str | bytes):
        try:
            it = iter(returned)
        except TypeError:  # (not iterable)
            it = None
        if it is not None:
            items = list(it)  # (the loader's own errors propagate from here)
            if it is returned:  # (an iterator, used up: what it gave is what to show)
                shown = items
    names = None
    if items is not None:
        with contextlib.suppress(TypeError):  # (an item not hashable)
            names = set(items)
    if names is None:
        return None, shown, ()
    stray = next((n for n in names if not isinstance(n, str)), _NO_STRAY)
    return (names, shown, ()) if stray is _NO_STRAY else (None, shown, (stray,))


_NO_STRAY = object()


def _names(returned: Any, chunk: Chunk | None = None) -> set[str] | None:
    """A loader's return value as a set of names (``None`` stays ``None``). Anything but
    ``None`` or an iterable of str (a str itself, a number, names that are not str) is a
    loader outside the contract: ``NotImplementedError`` naming the call (``chunk``: the
    call's plan, which names its patches) and what it returned. An iterator is read
    here (a generator-function loader does its copies meanwhile): what it raises
    propagates as it is."""
    if returned is None:
        return None
    names, shown, stray = _read_names(returned)
    if names is not None:
        return names
    bad = stray[0] if stray else shown
    what = (f"a {type(bad).__name__} among its names, {bad!r}"[:80] if stray
            else f"{shown!r}"[:80])
    call = ("load_weights" if chunk is None else f"load_weights (call {chunk.index}, "
            f"{_patches_named(chunk.positions, chunk.names, len(chunk.positions))})")
    # (the call's patch, where it carried one)
    one = chunk is not None and len(chunk.positions) == 1 and chunk.positions[0] >= 0
    raise ContractViolation(
        f"{call} returned {what} ({type(returned).__name__}): a loader of the contract "
        "returns the names it loaded (an iterable of str, e.g. a set) or None; the call's "
        "writes stay, unless transactional=True put them back",
        position=chunk.positions[0] if one else None, name=chunk.names[0] if one else None,
        # (a value that pickles, as the error must, with its report: not a generator)
        reason="returned names",
        value=bad if isinstance(bad, int | float | str | bytes) else f"{bad!r}"[:80],
    )

