"""How a dense report and a dense transactional load see the loader's writes.

Dense calls are seen through a function mode that lets views and attribute reads pass
and handles a plain ``copy_`` into a runtime tensor itself; every other call runs under
the dispatch mode that sparse calls use (``patchkit.intercept``). These tests hold the
two to the same results: every kind of write is seen, saved and restored; views keep the
patch a copy came from; the rest of torch (autograd, other modes, parameter subclasses,
other threads) sees what it would see without a report.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import threading
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, native
from patchkit.bitwise import bits

WAIT = 10.0


def dense(name, t):
    return CheckpointWeightPatch(name, tuple(t.shape), t.dtype, t.reshape(-1).clone())


class Two(torch.nn.Module):
    """Parameters ``a`` (4, 4) and ``b`` (8,); ``write(self, name, w)`` does the loading."""

    def __init__(self, write, param=torch.nn.Parameter) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = param(torch.randn(4, 4, generator=g), requires_grad=False)
        self.b = param(torch.randn(8, generator=g), requires_grad=False)
        self.write = write

    def load_weights(self, weights):
        names = set()
        for name, w in weights:
            self.write(self, name, w)
            names.add(name)
        return names


def patches():
    g = torch.Generator().manual_seed(1)
    return [dense("a", torch.randn(4, 4, generator=g)), dense("b", torch.randn(8, generator=g))]


def _out_add(m, name, w):
    target = getattr(m, name).data
    torch.add(w, 1.0, out=target)


# Each way a loader may write a runtime tensor, and the op the report names.
WRITES = {
    "copy_": (lambda m, n, w: getattr(m, n).data.copy_(w), "aten::copy_"),
    "slice copy_": (lambda m, n, w: getattr(m, n).data.narrow(0, 1, 2).copy_(w[1:3]),
                    "aten::copy_"),
    "setitem": (lambda m, n, w: getattr(m, n).data.__setitem__(slice(0, 2), w[:2]),
                "aten::copy_"),
    "fill_": (lambda m, n, w: getattr(m, n).data.fill_(float(w.reshape(-1)[0])),
              "aten::fill_.Scalar"),
    "add_": (lambda m, n, w: getattr(m, n).data.add_(w), "aten::add_.Tensor"),
    "index_copy_": (lambda m, n, w: getattr(m, n).data.index_copy_(
        0, torch.tensor([2, 0]), w[:2]), "aten::index_copy_"),
    "advanced setitem": (lambda m, n, w: getattr(m, n).data.__setitem__(
        torch.tensor([3, 1]), w[:2]), "aten::index_put_"),
    "out=": (_out_add, "aten::add.out"),
}


@pytest.mark.parametrize("kind", list(WRITES))
def test_every_kind_of_dense_write_is_reported_and_counted(kind):
    write, op = WRITES[kind]
    m = Two(write)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    r = inspect_load(m, patches())
    assert set(r.writes["target"]) == {"a", "b"}
    assert set(r.writes["op"]) == {op}
    for n, p in m.named_parameters():
        changed = int((bits(p.detach()) != bits(start[n])).sum())
        assert changed > 0
        assert int(r.deltas.loc[n, "changed"]) == changed
        assert torch.equal(bits(r.before(n)), bits(start[n]))
        assert torch.equal(bits(r.after(n)), bits(p.detach()))


def _fill_then_copy(m, name, w):
    t = getattr(m, name).data
    t.fill_(1.0)
    t.copy_(w)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("transactional", [False, True])
def test_a_copy_into_a_view_another_write_saved_whole_is_still_reported(
    transactional, compiled
):
    # The fill_ saves its view whole; a load that saves only for its rollback then skips
    # saving the copy_ into that view again (CONTRACT §5: saved before the first write).
    # A report must still see that copy as a write, with the elements it changed.
    m = Two(_fill_then_copy)
    ps = patches()
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(m, ps, transactional=transactional)
    assert r.writes[["target", "op", "changed"]].values.tolist() == [
        ["a", "aten::fill_.Scalar", 16], ["a", "aten::copy_", 16],
        ["b", "aten::fill_.Scalar", 8], ["b", "aten::copy_", 8],
    ]
    for p in ps:
        assert torch.equal(bits(getattr(m, p.name).detach().reshape(-1)), bits(p.values))


class Boom(Exception):
    pass


@pytest.mark.parametrize("kind", list(WRITES))
def test_a_failed_dense_transactional_load_puts_back_every_kind_of_write(kind):
    write, _ = WRITES[kind]

    def write_then_fail(m, name, w):
        write(m, name, w)
        if name == "b":
            raise Boom()

    m = Two(write_then_fail)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(Boom):
        patchkit.load_checkpoint_weight_patches(m, patches(), transactional=True)
    for n, p in m.named_parameters():
        assert torch.equal(bits(p.detach()), bits(start[n])), n


def test_a_copy_through_views_and_a_cast_keeps_its_patch():
    # Views pass the mode by; a copy that torch makes (a clone, a cast) is followed back
    # to its patch.
    def write(m, name, w):
        if name == "a":
            m.a.data.copy_(w.clone().view(16).narrow(0, 0, 16).view(4, 4))
        else:
            m.b.data.copy_(w.double().float())

    r = inspect_load(Two(write), patches())
    assert r.writes["name"].tolist() == ["a", "b"]
    assert r.writes["position"].tolist() == [0, 1]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_report_moves_autograd_version_counters_as_a_plain_load_does(compiled):
    # torch ops (a GPU's path) moved the counters twice per write: once by the mode, once
    # by the copy_ itself
    def write(m, name, w):
        getattr(m, name).copy_(w)  # the parameter itself (``.data`` has its own counter)

    plain, reported = Two(write), Two(write)
    v0 = {n: p._version for n, p in plain.named_parameters()}
    patchkit.load_checkpoint_weight_patches(plain, patches())
    with contextlib.nullcontext() if compiled else native.disabled():
        inspect_load(reported, patches())
    for n, p in reported.named_parameters():
        moved = plain.get_parameter(n)._version - v0[n]
        assert moved > 0
        assert p._version - v0[n] == moved


def test_a_copy_autograd_refuses_is_refused_under_a_report_too():
    # A loader that turns grad mode on and copies into a leaf that requires grad: torch
    # raises before writing, with or without a report.
    def write(m, name, w):
        with torch.enable_grad():
            getattr(m, name).copy_(w)

    for run in (patchkit.load_checkpoint_weight_patches, inspect_load):
        m = Two(write)
        m.a.requires_grad_(True)
        start = m.a.detach().clone()
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            run(m, patches())
        assert torch.equal(bits(m.a.detach()), bits(start))


class CountingMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def test_a_function_mode_of_the_caller_still_sees_every_copy():
    def write(m, name, w):
        getattr(m, name).data.copy_(w)

    seen = {}
    for label, run in (("plain", patchkit.load_checkpoint_weight_patches),
                       ("report", inspect_load)):
        mode = CountingMode()
        with mode:
            out = run(Two(write), patches())
        seen[label] = mode.copies
        if label == "report":
            assert out.writes["target"].tolist() == ["a", "b"]
            assert out.deltas["changed"].sum() == 24
    assert seen["report"] == seen["plain"] >= 2


class Announced(torch.nn.Parameter):
    """A parameter class with its own ``__torch_function__`` (as some engines have)."""

    copies = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            Announced.copies += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_a_parameter_class_of_its_own_still_sees_its_copies():
    def write(m, name, w):
        getattr(m, name).copy_(w)  # the parameter itself, under the loader's no_grad

    Announced.copies = 0
    m = Two(write, param=Announced)
    patchkit.load_checkpoint_weight_patches(m, patches())
    plain = Announced.copies
    Announced.copies = 0
    r = inspect_load(Two(write, param=Announced), patches())
    assert Announced.copies == plain == 2
    assert r.writes["target"].tolist() == ["a", "b"]


def test_another_threads_writes_during_a_dense_report_are_not_in_it():
    inside, done = threading.Event(), threading.Event()

    def write(m, name, w):
        if name == "a":
            inside.set()
            assert done.wait(WAIT), "the other thread never wrote"
            m.a.data.copy_(w)

    m = Two(write)
    errors = []

    def other():
        try:
            assert inside.wait(WAIT)
            with torch.no_grad():
                m.b.copy_(torch.full((8,), 3.0))  # a runtime tensor, during the report
                m.b.add_(1.0)
        except BaseException as e:  # surfaced below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    r = inspect_load(m, patches())
    t.join(WAIT)
    assert not errors
    assert r.writes["target"].tolist() == ["a"]
    assert list(r.deltas.index) == ["a"]
    assert m.b.detach().tolist() == [4.0] * 8


def test_sparse_calls_see_writes_made_with_torch_function_handling_off():
    # The documented difference: only dense calls are watched through a function mode.
    def write(m, name, w):
        with torch._C.DisableTorchFunction():
            getattr(m, name).data.copy_(w)

    m = Two(write)
    start = m.b.detach().clone()
    p = CheckpointWeightPatch("b", (8,), torch.float32, torch.tensor([5.0]),
                              torch.tensor([3], dtype=torch.int64))
    r = inspect_load(m, [p])
    expected = start.clone()
    expected[3] = 5.0
    assert torch.equal(bits(m.b.detach()), bits(expected))  # NaN-merged, not overwritten
    assert r.writes["target"].tolist() == ["b"]
    assert int(r.deltas.loc["b", "changed"]) == 1


class NanMerge(TorchDispatchMode):
    """A loader's own way to NaN-merge: a dispatch mode that keeps the destination's
    value where a copy's source is NaN (as an engine might write it)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dest, src = args[0], args[1]
            merged = torch.where(torch.isnan(src), dest, src.to(dest.dtype))
            return func(dest, merged, *args[2:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def mode_merging_loader(model, patches, **kwargs):
    """A foreign loader that stages sparse patches NaN-filled and merges them through a
    dispatch mode of its own, entered around ``model.load_weights``."""
    staged = []
    for p in patches:
        t = torch.full(p.shape, float("nan"), dtype=p.dtype)
        t.view(-1)[p.indices.long()] = p.values.to(p.dtype)
        staged.append((p.name, t))
    with NanMerge():
        return model.load_weights(staged)


def test_observing_a_loader_that_merges_in_its_own_dispatch_mode_changes_nothing():
    def write(m, name, w):
        getattr(m, name).data.copy_(w)

    ps = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.tensor([9.0, -9.0]),
                                torch.tensor([1, 6])),
          CheckpointWeightPatch("b", (8,), torch.float32, torch.tensor([5.0]),
                                torch.tensor([3]))]
    alone, observed = Two(write), Two(write)
    mode_merging_loader(alone, ps)
    r = inspect_load(observed, ps, loader=mode_merging_loader)
    for n, p in observed.named_parameters():
        assert torch.equal(bits(p.detach()), bits(alone.get_parameter(n).detach())), n
    assert not any(torch.isnan(p).any() for p in observed.parameters())
    assert r.deltas["changed"].to_dict() == {"a": 2, "b": 1}
    assert torch.equal(bits(r.after("a")), bits(alone.a.detach()))


class SeesWrites(TorchDispatchMode):
    """A caller's dispatch mode that notes the storage of every tensor an op writes."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor):
                    self.storages.add(v.untyped_storage().data_ptr())
        return func(*args, **kwargs)


@pytest.mark.parametrize("kind", ["dense report", "sparse load", "sparse report"])
def test_a_dispatch_mode_of_the_caller_sees_the_writes(kind):
    # The compiled paths write memory directly; under another dispatch mode the write
    # goes through torch ops, which that mode sees, and the results stay the same.
    def write(m, name, w):
        getattr(m, name).data.copy_(w)

    if kind == "dense report":
        ps = patches()
    else:
        ps = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.tensor([9.0, -9.0]),
                                    torch.tensor([1, 6])),
              CheckpointWeightPatch("b", (8,), torch.float32, torch.tensor([5.0]),
                                    torch.tensor([3]))]
    run = patchkit.load_checkpoint_weight_patches if kind == "sparse load" else inspect_load
    alone, watched = Two(write), Two(write)
    run(alone, ps)
    mode = SeesWrites()
    with mode:
        out = run(watched, ps)
    for n, p in watched.named_parameters():
        assert p.untyped_storage().data_ptr() in mode.storages, n
        assert torch.equal(bits(p.detach()), bits(alone.get_parameter(n).detach())), n
    if kind == "dense report":
        assert out.deltas["changed"].to_dict() == {"a": 16, "b": 8}
    elif kind == "sparse report":
        assert out.deltas["changed"].to_dict() == {"a": 2, "b": 1}


def _shift_within(m, name, w):
    """Load ``w``, then copy one part of the runtime tensor into another part of it."""
    t = getattr(m, name).data.reshape(-1)
    t.copy_(w.reshape(-1))
    t[4:8].copy_(t[0:4])  # the same storage, apart


def _shift_overlapping(m, name, w):
    t = getattr(m, name).data.reshape(-1)
    t.copy_(w.reshape(-1))
    t[1:5].copy_(t[0:4])  # torch refuses a copy between overlapping views


@pytest.mark.parametrize("transactional", [False, True])
def test_a_copy_within_one_runtime_tensor_is_done_and_refused_as_torch_does(transactional):
    # A copy whose source is runtime storage too goes through torch, not the compiled
    # compare-and-copy (which reads the source while writing the destination).
    def load(m, *, observed):
        if not observed:
            return patchkit.load_checkpoint_weight_patches(m, patches())
        if transactional:
            return patchkit.load_checkpoint_weight_patches(m, patches(), transactional=True)
        return inspect_load(m, patches())

    plain, seen = Two(_shift_within), Two(_shift_within)
    load(plain, observed=False)
    r = load(seen, observed=True)
    for n in ("a", "b"):
        assert torch.equal(bits(getattr(seen, n)), bits(getattr(plain, n)))
    if not transactional:
        assert r.writes["target_offset"].tolist() == [0, 4, 0, 4]
        names = r.writes["name"]
        assert names.isna().tolist() == [False, True, False, True]  # not from a patch
        assert names.dropna().tolist() == ["a", "b"]
    with pytest.raises(RuntimeError, match="single memory location") as plain_error:
        load(Two(_shift_overlapping), observed=False)
    m = Two(_shift_overlapping)
    before = {n: getattr(m, n).detach().clone() for n in ("a", "b")}
    with pytest.raises(RuntimeError) as seen_error:
        load(m, observed=True)
    assert str(seen_error.value) == str(plain_error.value)
    if transactional:
        for n in ("a", "b"):
            assert torch.equal(getattr(m, n), before[n])


class _Sink(torch.nn.Module):
    """One fp32 parameter ``w``; each staged tensor is copied into all of it, and the
    loader raises after the writes of call ``fail_at``."""

    def __init__(self, n: int, fail_at: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
        self.fail_at, self.calls = fail_at, 0
        self.sessions: list = []
        self.held: list = []

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            self.w.copy_(t)
            names.add(name)
        self.calls += 1
        if self.calls == self.fail_at:
            if self.sessions:  # what the load holds to roll back, just before it does
                self.held = list(self.sessions[0].saved)
            raise RuntimeError("loader fails after writing")
        return names


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_transactional_load_saves_a_region_once_however_often_a_name_rewrites_it(compiled):
    # CONTRACT §5: a region is saved before its *first* write of the call. A name sent
    # six times (a repeated name starts a new call each time) with full replacements kept
    # six copies of the tensor; the rollback must still give back the bits from before.
    from patchkit.loader import run_load

    n = 50_000
    m = _Sink(n, fail_at=6)
    before = bits(m.w.detach()).clone()
    small = m.w.detach().clone()
    small[::50] += 1.0  # first a 2 % change (a compact save), then full replacements
    values = [small] + [torch.full((n,), float(k)) for k in range(1, 6)]
    patches = [CheckpointWeightPatch("w", (n,), torch.float32, v) for v in values]
    with (contextlib.nullcontext() if compiled else native.disabled(),
          warnings.catch_warnings(record=True) as said,
          pytest.raises(RuntimeError, match="loader fails after writing")):
        warnings.simplefilter("always")
        run_load(m, patches, max_chunk_bytes=1 << 30, validate_unique_indices=True,
                 transactional=True, session_out=m.sessions, save_regions=True)
    assert torch.equal(bits(m.w.detach()), before)  # rolled back, bit for bit
    # the calls whose write needed no save of its own still wrote where a mode saw
    assert not [w for w in said if "without a write it saw" in str(w.message)]
    saved = m.held
    held = sum(s.before.numel() * s.before.element_size()
               + (0 if s.index is None else s.index.numel() * s.index.element_size())
               for s in saved)
    # the compact save of the 2 % change, then one whole save: not one per write
    assert len(saved) == 2, [None if s.index is None else s.index.numel() for s in saved]
    assert held <= n * 4 + (n // 50) * 12


class _ZeroThenAdd(_Sink):
    """``_Sink`` writing each staged tensor with two in-place ops over all of ``w``."""

    def load_weights(self, weights):
        for _, t in weights:
            self.w.zero_()
            self.w.add_(t)
        return super().load_weights([])


def test_a_transactional_load_saves_a_region_once_whatever_ops_rewrite_it():
    # The ops other than a copy from a tensor of the view's shape (zero_, add_) save the
    # region before its first write of the load only: three calls of two writes each
    # keep one copy of the tensor, not six, and the rollback still gives back its bits.
    from patchkit.loader import run_load

    n = 1000
    m = _ZeroThenAdd(n, fail_at=3)
    before = bits(m.w.detach()).clone()
    patches = [CheckpointWeightPatch("w", (n,), torch.float32, torch.full((n,), float(k)))
               for k in range(1, 4)]  # (a repeated name: a call each)
    with pytest.raises(RuntimeError, match="loader fails after writing"):
        run_load(m, patches, max_chunk_bytes=1 << 30, validate_unique_indices=True,
                 transactional=True, session_out=m.sessions, save_regions=True)
    assert torch.equal(bits(m.w.detach()), before)
    assert len(m.held) == 1 and m.held[0].index is None
    assert torch.equal(bits(m.held[0].before), before)


def _reshape_then_copy(m, name, w):
    d = getattr(m, name).data
    if d.dim() == 2:
        d.t_()
        d.transpose_(0, 1)
    d.unsqueeze_(0)
    d.squeeze_(0)
    d.copy_(w)


@pytest.mark.parametrize("transactional", [False, True])
def test_in_place_ops_that_only_reshape_an_alias_are_not_writes_of_a_dense_load(transactional):
    # unsqueeze_, t_, transpose_ change a `.data` alias's shape or strides and write no
    # element: a report lists only the copies, and a load that saves what it writes saves
    # what the copies alone would save (no whole copy of the tensor for a reshaping op).
    from patchkit.loader import run_load

    def saves(write):
        m = Two(write)
        sessions = []
        run_load(m, ps, transactional=transactional, save_regions=True, session_out=sessions)
        for n, p in m.named_parameters():
            assert p.shape == start[n].shape and p.is_contiguous()
            assert torch.equal(bits(p.detach()), bits(ps["ab".index(n)].values.reshape(p.shape)))
        return [(s.target, s.index is None, s.before.numel()) for s in sessions[0].saved]

    start = {n: p.detach().clone() for n, p in Two(None).named_parameters()}
    ps = [dense(n, start[n] + (torch.arange(start[n].numel()).reshape(start[n].shape) == 1))
          for n in ("a", "b")]  # one element of each changes
    r = inspect_load(Two(_reshape_then_copy), ps)
    assert r.writes["op"].tolist() == ["aten::copy_", "aten::copy_"]
    assert r.writes["target"].tolist() == ["a", "b"]
    assert saves(_reshape_then_copy) == saves(WRITES["copy_"][0])


# --------------------------------------------------------------------------- overlapping views


class _Windows(torch.nn.Module):
    """A 10-element parameter that ``load_weights`` writes through ``view_of(p.data)``."""

    def __init__(self, view_of) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.arange(10, dtype=torch.float32), requires_grad=False)
        self.view_of = view_of

    def load_weights(self, weights):
        for _, w in weights:
            self.view_of(self.p.data).copy_(w)
        return {n for n, _ in weights}


_UNFOLD = (lambda t: t.unfold(0, 4, 2), (4, 4))  # windows overlapping by 2
_AS_STRIDED = (lambda t: t.as_strided((3, 3), (2, 1)), (3, 3))  # rows overlap by 1


@pytest.mark.parametrize("view", [_UNFOLD, _AS_STRIDED], ids=["unfold", "as_strided"])
@pytest.mark.parametrize("mode", ["inspected", "transactional", "sparse", "torch ops"])
def test_a_write_through_a_view_that_overlaps_itself_is_refused_before_it_writes(view, mode):
    # The values that stay where windows meet depend on the order torch writes them in; a
    # save of such a view took one memory element for several (a rollback left written
    # values, before() showed them, deltas counted 16 elements of a 10-element tensor).
    view_of, shape = view
    m = _Windows(view_of)
    start = m.p.detach().clone()
    n = shape[0] * shape[1]
    if mode == "sparse":
        patch = CheckpointWeightPatch("w", shape, torch.float32, torch.tensor([50.0, 60.0]),
                                      torch.tensor([2, 4]))
    else:
        patch = CheckpointWeightPatch("w", shape, torch.float32,
                                      torch.arange(100, 100 + n, dtype=torch.float32))
    with contextlib.ExitStack() as stack:
        if mode == "torch ops":
            stack.enter_context(native.disabled())
        with pytest.raises(patchkit.ContractViolation, match="share memory") as e:
            if mode in ("inspected", "torch ops"):
                inspect_load(m, [patch])
            else:
                patchkit.load_checkpoint_weight_patches(
                    m, [patch], transactional=mode == "transactional")
    assert e.value.reason == "self-overlapping view" and e.value.name == "w"
    assert e.value.position == 0 and e.value.value == tuple(view_of(m.p.data).stride())
    assert torch.equal(bits(m.p.detach()), bits(start))  # nothing written


def test_a_plain_dense_load_through_an_overlapping_view_is_left_to_torch():
    m = _Windows(_UNFOLD[0])
    w = torch.arange(100, 116, dtype=torch.float32)
    patchkit.load_checkpoint_weight_patches(m, [CheckpointWeightPatch("w", (4, 4),
                                                                      torch.float32, w)])
    assert not torch.equal(m.p.detach(), torch.arange(10, dtype=torch.float32))


@pytest.mark.parametrize("view_of", [
    lambda t: t.view(2, 5)[:, ::2], lambda t: t.view(5, 2).t(), lambda t: t[1::3],
    lambda t: t.as_strided((2, 2), (5, 2), 1), lambda t: t.view(2, 5)[:, 1:4].t(),
], ids=["columns", "transposed", "stepped", "as_strided apart", "box transposed"])
def test_strided_views_that_do_not_overlap_are_written_and_recorded(view_of):
    m = _Windows(view_of)
    dest = view_of(m.p.data)
    shape = tuple(dest.shape)
    k = dest.numel()
    w = torch.arange(100, 100 + k, dtype=torch.float32)
    r = inspect_load(m, [CheckpointWeightPatch("w", shape, torch.float32, w)])
    assert torch.equal(view_of(m.p.data), w.reshape(shape))
    assert int(r.deltas.loc["p", "elements"]) == k and int(r.deltas.loc["p", "changed"]) == k


def test_overlaps_itself_agrees_with_listing_every_offset():
    from patchkit.intercept import _overlaps_itself

    g = torch.Generator().manual_seed(7)
    base = torch.zeros(400)
    seen = {True: 0, False: 0}
    for _ in range(400):
        ndim = int(torch.randint(1, 4, (1,), generator=g))
        shape = tuple(int(x) for x in torch.randint(1, 5, (ndim,), generator=g))
        stride = tuple(int(x) for x in torch.randint(0, 9, (ndim,), generator=g))
        v = base.as_strided(shape, stride)
        offsets = [sum(i * s for i, s in zip(idx, stride))
                   for idx in itertools.product(*(range(n) for n in shape))]
        want = len(set(offsets)) < len(offsets)
        assert _overlaps_itself(v) == want, (shape, stride)
        seen[want] += 1
    assert seen[True] > 50 and seen[False] > 50  # both kinds were drawn
    # more elements than addresses: told without listing 16 M offsets
    assert _overlaps_itself(torch.zeros(2**18).unfold(0, 64, 1))


def _on_another_thread(m, name, w):
    t = threading.Thread(target=lambda: getattr(m, name).data.copy_(w))
    t.start()
    t.join(WAIT)


def _through_the_storage(m, name, w):
    getattr(m, name).data.untyped_storage().copy_(w.contiguous().untyped_storage())


UNSEEN = {
    "another thread": _on_another_thread,
    "a storage": _through_the_storage,
    "function handling off": lambda m, name, w: _with_torch_function_off(m, name, w),
}


def _with_torch_function_off(m, name, w):
    with torch._C.DisableTorchFunction():
        getattr(m, name).data.copy_(w)


def _a_then(write_b):
    """``write(m, name, w)``: ``a`` copied as usual, ``b`` by ``write_b``, and any other
    name raises (a load that fails after them)."""
    def write(m, name, w):
        if name == "a":
            m.a.data.copy_(w)
        elif name == "b":
            write_b(m, name, w)
        else:
            raise KeyError(name)
    return write


@pytest.mark.parametrize("how", list(UNSEEN))
def test_a_rollback_warns_of_a_call_with_no_write_it_saw(how):
    # A rollback put back what it saw and said nothing of b, which the loader wrote where
    # no mode sees: the model kept b's new values after "rolling back"
    m = Two(_a_then(UNSEEN[how]))
    a0 = bits(m.a.detach()).clone()
    ps = [*patches(), dense("c", torch.ones(16))]  # (a call each)
    said = (r"put back every write it saw, but load_weights \(call 1, patch 1 \('b'\)\) "
            r"returned \['b'\] without a write it saw: a loader that writes on another "
            r"thread.* stays in the model")
    with pytest.warns(UserWarning, match=said), pytest.raises(KeyError, match="c"):
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=64)
    assert torch.equal(bits(m.a.detach()), a0)  # the write seen, put back
    assert torch.equal(m.b.detach(), ps[1].values)  # the unseen one stays, as said


@pytest.mark.parametrize("how", list(UNSEEN))
def test_a_report_lists_the_calls_with_no_write_it_saw(how):
    # the report showed a load that changed a and nothing else, and said nothing of b
    m = Two(_a_then(UNSEEN[how]))
    r = inspect_load(m, patches(), max_chunk_bytes=64)
    assert r.summary()["calls with no write seen"] == [1]
    assert "calls with no write seen=[1]" in repr(r)
    assert "calls with no write seen" in r._repr_html_()
    assert r.writes["target"].tolist() == ["a"]


class _Walked(Two):
    """A model whose ``named_parameters`` is its own (as wrappers have): patchkit leaves
    walking its module tree to torch."""

    def named_parameters(self, *args, **kwargs):
        yield from super().named_parameters(*args, **kwargs)


@pytest.mark.parametrize("model", ["an earlier call rebinds", "named_parameters of its own"])
def test_a_rollback_warns_of_a_quiet_call_after_a_rebinding_and_on_any_model(model):
    # The warning was given up for the rest of the load once a call had rebound a tensor,
    # and for every model whose tree torch walks; and each call without a write seen
    # looked over every tensor (4000 such calls on 4000 tensors: 0.1 s -> 3.7 s). A call
    # that only rebinds is no quiet call.
    def rebinds_a(m, name, w):
        m.a.data = w.clone().view(4, 4)

    first = rebinds_a if model == "an earlier call rebinds" else (
        lambda m, name, w: m.a.data.copy_(w))
    write = _a_then(_on_another_thread)
    cls = _Walked if model == "named_parameters of its own" else Two
    m = cls(lambda m, name, w: (first if name == "a" else write)(m, name, w))
    a0 = bits(m.a.detach()).clone()
    ps = [*patches(), dense("c", torch.ones(16))]  # (a call each)
    # (call 0, which rebound a, is no quiet call: it names a, whose storage changed)
    with pytest.warns(UserWarning, match=r"but load_weights \(call 1, patch 1 \('b'\)\) "
                      r"returned \['b'\] without a write it saw: .* stays in the model"
                      ) as seen, pytest.raises(KeyError, match="c"):
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=64)
    hedged = "unless they rebound or registered tensors" in str(seen[0].message)
    assert hedged == (model == "an earlier call rebinds")
    assert torch.equal(bits(m.a.detach()), a0)
    assert torch.equal(m.b.detach(), ps[1].values)


@pytest.mark.parametrize("order", ["rebinding first", "quiet call first"])
def test_a_reports_rollback_warning_is_hedged_only_after_a_rebinding(order):
    # A report looks at each call's rebindings as it ends (a rebinding is a write of its
    # call), so a quiet call before any rebinding is known to be quiet: no hedge there.
    # One after a rebinding may have written into the new tensor, which no watch sees
    # (its storage is none the load began with) and which the rollback puts back with
    # it: the warning said flatly that what that call wrote "stays in the model".
    def write(m, name, w):
        if name == "a":
            m.a.data = w.clone().view(4, 4)
        elif name == "b" and order == "rebinding first":
            m.a.data[1:3].copy_(w.view(2, 4))  # (into the data call 0 bound)
        elif name == "b":
            _on_another_thread(m, name, w)
        else:
            raise KeyError(name)

    m = Two(write)
    a0, b0 = bits(m.a.detach()).clone(), m.b.detach().clone()
    storage = m.a.untyped_storage().data_ptr()
    a, b = patches()
    ps = [a, b, dense("c", torch.ones(16))] if order == "rebinding first" else [
        b, a, dense("c", torch.ones(16))]
    quiet = 1 if order == "rebinding first" else 0
    with pytest.warns(UserWarning, match=rf"but load_weights \(call {quiet}, .* stays in "
                      "the model") as seen, pytest.raises(KeyError, match="c"):
        inspect_load(m, ps, transactional=True, max_chunk_bytes=64)
    hedged = "wrote into ones an earlier call rebound" in str(seen[0].message)
    assert hedged == (order == "rebinding first")
    assert torch.equal(bits(m.a.detach()), a0)  # (the write into the new data put back too)
    assert m.a.untyped_storage().data_ptr() == storage
    if order == "quiet call first":  # (written on another thread: it stays, as said)
        assert torch.equal(m.b.detach(), b.values) and not torch.equal(b.values, b0)


def test_warnings_as_errors_leave_the_loads_own_error_raised():
    # Under -W error the rollback's warning became the exception raised, and the load's
    # KeyError only its __context__ (a Ctrl-C would have turned into a UserWarning)
    import warnings

    m = Two(_a_then(_on_another_thread))
    a0 = bits(m.a.detach()).clone()
    ps = [*patches(), dense("c", torch.ones(16))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError, match="c") as info:
            patchkit.load_checkpoint_weight_patches(m, ps, transactional=True,
                                                    max_chunk_bytes=64)
    assert torch.equal(bits(m.a.detach()), a0)
    assert any("without a write it saw" in n for n in info.value.__notes__)


def test_a_report_of_many_quiet_calls_shows_a_few_in_its_repr():
    class Skips(Two):
        def load_weights(self, weights):
            return {n for n, _ in weights}  # (this rank holds none of them)

    ps = [dense("a", torch.ones(4, 4)) for _ in range(12)]  # (a repeated name: a call each)
    r = inspect_load(Skips(None), ps)
    assert r.summary()["calls with no write seen"] == list(range(12))
    assert "calls with no write seen=[0, 1, 2, 3, 4, 5, ..., 11] (12)" in repr(r)
    assert "[0, 1, 2, 3, 4, 5, ..., 11] (12)" in r._repr_html_()


def test_calls_that_write_nothing_are_no_error_and_a_load_that_ends_well_no_warning():
    # A call may rightly write nothing while returning names (a rank that skips experts
    # another rank holds, a weight found unchanged): no error, and no warning unless a
    # rollback runs (a write of no elements writes nothing either). A rebinding or an
    # empty return is no quiet call at all.
    import warnings

    def skips_b(m, name, w):
        pass

    def empty(m, name, w):
        m.b.data[:0].copy_(w[:0])

    def rebinds(m, name, w):
        m.b.data = w.clone()

    for write_b, quiet in [(skips_b, [1]), (empty, [1]), (rebinds, None),
                           (_on_another_thread, [1])]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert patchkit.load_checkpoint_weight_patches(
                Two(_a_then(write_b)), patches(), transactional=True, max_chunk_bytes=64
            ) == {"a", "b"}
            r = inspect_load(Two(_a_then(write_b)), patches(), max_chunk_bytes=64,
                             transactional=True)
        assert r.error is None and r.summary().get("calls with no write seen") == quiet

    class Nothing(Two):
        def load_weights(self, weights):
            return set()

    r = inspect_load(Nothing(None), patches())
    assert "calls with no write seen" not in r.summary()


def _registers_b(m, name, w):
    m.b = torch.nn.Parameter(w.clone(), requires_grad=False)


def _removes_b(m, name, w):
    del m.b


@pytest.mark.parametrize("write_b", [_registers_b, _removes_b], ids=["registers", "removes"])
def test_a_call_that_only_registers_or_removes_its_tensor_is_no_quiet_call(write_b):
    # Without a report, a call is no quiet call when a tensor it names is no longer what
    # its module holds under that name (a new Parameter registered there, or none): the
    # rollback puts that back, so it warns of nothing it could not see.
    m = Two(_a_then(write_b))
    a0, b0 = bits(m.a.detach()).clone(), bits(m.b.detach()).clone()
    ps = [*patches(), dense("c", torch.ones(16))]  # (a call each)
    with warnings.catch_warnings(record=True) as said, pytest.raises(KeyError, match="c"):
        warnings.simplefilter("always")
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=64)
    assert not [w for w in said if "without a write it saw" in str(w.message)]
    assert torch.equal(bits(m.a.detach()), a0) and torch.equal(bits(m.b.detach()), b0)


class _PacksB(Two):
    """Copies ``a``; binds ``b`` to a tensor made of checkpoint weight ``b_part`` twice
    (no copy) and returns ``b``, the runtime name; raises at ``c``."""

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "c":
                raise KeyError(name)
            if name == "b_part":
                self.b.data = torch.cat([w, w])
                loaded.add("b")
            else:
                self.a.data.copy_(w)
                loaded.add(name)
        return loaded


def test_a_call_that_rebinds_a_runtime_tensor_it_returns_is_no_quiet_call():
    # Without a report, the runtime names a call returns are looked at too (a packed
    # loader returns qkv_proj for q_proj): it rebound b, which the rollback puts back.
    m = _PacksB(None)
    a0, b0 = bits(m.a.detach()).clone(), bits(m.b.detach()).clone()
    ps = [patches()[0], dense("b_part", torch.ones(4)), dense("c", torch.ones(16))]
    with warnings.catch_warnings(record=True) as said, pytest.raises(KeyError, match="c"):
        warnings.simplefilter("always")
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=64)
    assert not [w for w in said if "without a write it saw" in str(w.message)]
    assert torch.equal(bits(m.a.detach()), a0) and torch.equal(bits(m.b.detach()), b0)


def test_a_call_with_an_empty_patch_first_and_no_write_seen_is_still_quiet():
    # "with something staged": one staged tensor with elements is enough, wherever it is
    class Skips(Two):
        def __init__(self):
            super().__init__(None)
            self.e = torch.nn.Parameter(torch.zeros(0), requires_grad=False)

        def load_weights(self, weights):
            return {n for n, _ in weights}  # (this rank holds none of them)

    ps = [dense("e", torch.zeros(0)), dense("b", torch.ones(8))]
    r = inspect_load(Skips(), ps, max_chunk_bytes=1 << 20)
    assert len(r.calls) == 1 and r.summary()["calls with no write seen"] == [0]


@pytest.mark.skipif(torch.__version__ < "2.6", reason=(
    "this torch's dynamo does not hand a compiled loader's writes to the watch "
    "(torch 2.6 does: the README says so)"))
def test_a_loader_compiled_with_torch_compile_is_watched_through_graph_breaks():
    # What the README says of torch.compile: the watch breaks the graph at the writes it
    # handles, and sees them (with fullgraph=True dynamo refuses that, in torch's words)
    import warnings

    m = Two(None)

    def load(weights):
        for name, w in weights:
            getattr(m, name).data.copy_(w)
        return [name for name, _ in weights]

    ps = patches()
    limit = sys.getrecursionlimit()
    try:
        with warnings.catch_warnings():
            # (dynamo's notes on the graph breaks; torch's own deprecations as it loads)
            warnings.simplefilter("ignore")
            m.load_weights = torch.compile(load)
            r = inspect_load(m, ps)
    finally:
        # (inductor, compiling with a cold cache, raises the process's recursion limit to
        # 2000 for good: a later test of a tree deeper than the limit then failed)
        sys.setrecursionlimit(limit)
    assert r.error is None and r.loaded == {"a", "b"}
    assert r.writes["target"].tolist() == ["a", "b"]
    assert r.deltas["elements"].to_dict() == {"a": 16, "b": 8}
    assert torch.equal(m.b.detach(), ps[1].values)


@pytest.mark.skipif(torch.__version__ < "2.6", reason=(
    "this torch's dynamo does not hand a compiled loader's writes to the watch "
    "(torch 2.6 does: the README says so)"))
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_compiled_loader_that_computes_before_its_copy_is_watched_too(kind):
    # (dynamo traced the op w * 2 into the dense watch's __torch_function__, where the
    # watch's dispatch mode was read through a property, and failed there with an
    # AssertionError, "cls_source must not be None for MRO walk": a compiled loader
    # that did anything but views and copy_ broke every report and transactional load,
    # where a plain dense load ran it. Once past that, dynamo still traced the watch's
    # own code, warned of its caches and builtins, and left half-made StorageWeakRefs
    # whose __del__ failed (an unraisable exception) in the dense and the sparse watch:
    # patchkit is now on dynamo's list of folders it never traces. backend="eager": the
    # failure is dynamo's tracing, which every backend shares, and it compiles nothing)
    m = Two(None)

    def load(weights):
        for name, w in weights:
            getattr(m, name).data.copy_(w * 2)
        return [name for name, _ in weights]

    ps = patches() if kind == "dense" else [
        CheckpointWeightPatch("a", (4, 4), torch.float32, torch.tensor([5.0, 6.0]),
                              torch.tensor([3, 9])),
        CheckpointWeightPatch("b", (8,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))]
    unraisable, hook = [], sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            torch._dynamo.reset()
            try:
                m.load_weights = torch.compile(load, backend="eager")
                r = inspect_load(m, ps)
            finally:
                torch._dynamo.reset()
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [str(w.message) for w in said] == []
    assert [repr(u.exc_value) for u in unraisable] == []
    assert r.error is None and r.loaded == {"a", "b"}
    assert r.writes["target"].tolist() == ["a", "b"]
    if kind == "dense":
        assert r.deltas["elements"].to_dict() == {"a": 16, "b": 8}
        assert torch.equal(m.b.detach(), ps[1].values * 2)
    else:
        assert m.a.detach().flatten()[[3, 9]].tolist() == [10.0, 12.0]
        assert m.b.detach()[1].item() == 14.0


@pytest.mark.parametrize("view", ["whole", "part"])
def test_a_copy_through_a_view_of_another_element_size_is_reported_in_the_tensors_elements(
        view):
    # (mutation testing: the copy_ the function mode handles itself, let through without
    # comparing element sizes, saved the half-word view as if it were the float32
    # tensor's elements: before() showed the values written, and no element changed)
    def write(m, name, w):
        src = w.reshape(-1).view(torch.int16)
        dest = getattr(m, name).data.view(-1).view(torch.int16)
        if view == "part":  # (half-words 2-9: elements 1-4)
            src, dest = src[2:10], dest[2:10]
        dest.copy_(src)

    m = Two(write)
    start = {n: p.detach().clone() for n, p in m.named_parameters()}
    r = inspect_load(m, patches())
    assert r.writes["elements"].tolist() == ([16, 8] if view == "whole" else [4, 4])
    for n, p in m.named_parameters():
        assert torch.equal(bits(r.before(n)), bits(start[n]))
        assert torch.equal(bits(r.after(n)), bits(p.detach()))
        changed = int((bits(p.detach()) != bits(start[n])).sum())
        assert int(r.deltas.loc[n, "changed"]) == changed > 0


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_complex_copy_counts_and_saves_elements_not_their_parts(compiled):
    # A complex element's bits are two numbers: compared per part, a change of both parts
    # would count twice and its storage offsets point past the view (the compared copy
    # leaves complex tensors to the plain save).
    class C(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(8) * (1 + 0.5j), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
            return {"w"}

    new = (torch.arange(8) * (1 + 0.5j)).to(torch.complex64)
    new[1], new[5] = 1 + 1j, complex(5.0, 9.0)  # both parts, then one part, changed
    m = C()
    start = m.w.detach().clone()
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(m, [dense("w", new)])
    assert r.writes["changed"].tolist() == [2]
    assert torch.equal(bits(r.before("w")), bits(start))
    assert torch.equal(bits(m.w.detach()), bits(new))


class _TiedAB(torch.nn.Module):
    """``a`` (8,) first, ``b`` its tied alias; the loader does ``how(self, name, w)``
    for each weight and returns ``returns(name)``; it raises at ``c``."""

    def __init__(self, how, returns=lambda name: name) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.arange(8.0), requires_grad=False)
        self.b = self.a
        self.how, self.returns = how, returns

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name == "c":
                raise KeyError(name)
            self.how(self, name, w)
            loaded.add(self.returns(name))
        return loaded


def _unties_b(m, name, w):
    m.b = torch.nn.Parameter(w.clone(), requires_grad=False)


def _rebinds_a(m, name, w):
    m.a.data = torch.cat([w, w])


@pytest.mark.parametrize("case", ["unties the alias", "returns the alias it rebound"])
def test_a_call_that_only_changes_a_tied_tensor_under_its_other_name_is_no_quiet_call(case):
    # Without a report, a call is no quiet call when a tensor it names (or returns) is no
    # longer what the model holds under one of its tied names, or holds other storage: a
    # call that only unties lm_head from the embedding (registers a new Parameter under
    # the alias), or that rebinds the tied tensor and returns its alias's name, wrote no
    # element a mode sees, and the rollback puts that back: nothing to warn of.
    if case == "unties the alias":
        m = _TiedAB(_unties_b)
        first = dense("a", torch.ones(8))
    else:
        m = _TiedAB(_rebinds_a, returns=lambda name: "b")
        first = dense("a_part", torch.ones(4))  # (a checkpoint name only)
    ps = [first, dense("c", torch.ones(8))]  # (a call each)
    with warnings.catch_warnings(record=True) as said, pytest.raises(KeyError, match="c"):
        warnings.simplefilter("always")
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=32)
    assert not [w for w in said if "without a write it saw" in str(w.message)]
    assert m.b is m.a and m.a.tolist() == [float(i) for i in range(8)]


class _CopiesTwice(torch.nn.Module):
    """Copies each weight with ``copy_(t, *args, **kwargs)``, then writes the same
    parameter again with ``second`` (a tensor; of another shape: a copy that raises)."""

    def __init__(self, second, *args, **kwargs):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.second, self.args, self.kwargs = second, args, kwargs

    def load_weights(self, weights):
        for _, t in weights:
            self.w.copy_(t, *self.args, **self.kwargs)
            if self.second is not None:
                self.w.copy_(self.second)
        return {n for n, _ in weights}


@pytest.mark.parametrize("inspected", [False, True])
def test_a_second_copy_into_a_saved_region_that_raises_is_rolled_back(inspected):
    # (the failed copy's region was saved by the first one: the rollback has to use that
    # save, with or without a report counting changes)
    m = _CopiesTwice(torch.ones(3))
    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.arange(1.0, 5.0))
    load = inspect_load if inspected else patchkit.load_checkpoint_weight_patches
    with pytest.raises(RuntimeError, match="must match the size") as info:
        load(m, [p], transactional=True)
    assert m.w.tolist() == [0.0] * 4
    if inspected:
        assert info.value.report.rolled_back


@pytest.mark.parametrize(("args", "kwargs"), [((False,), {}), ((), {"non_blocking": False}),
                                              ((True,), {})])
@pytest.mark.parametrize("inspected", [False, True])
def test_a_copy_given_non_blocking_is_watched_as_a_copy(args, kwargs, inspected):
    # (``copy_(t, False)``: three arguments, taken for the plain copy they are)
    m = _CopiesTwice(None, *args, **kwargs)
    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.arange(1.0, 5.0))
    if inspected:
        r = inspect_load(m, [p])
        assert r.writes[["name", "written", "changed"]].values.tolist() == [["w", 4, 4]]
        assert r.before("w").tolist() == [0.0] * 4
    else:
        assert patchkit.load_checkpoint_weight_patches(m, [p], transactional=True) == {"w"}
    assert m.w.tolist() == [1.0, 2.0, 3.0, 4.0]
