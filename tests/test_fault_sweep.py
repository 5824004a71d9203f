"""Faults injected at every point of a load: the N-th ``load_weights`` call, the N-th
ATen op the model's loader makes (a dispatch mode pushed inside its ``load_weights``,
above patchkit's own; or a SIGINT sent after it), the N-th staging of a patch, the N-th
save a watched write allocates, and the N-th region a rollback writes back; each a
``RuntimeError``, a ``KeyboardInterrupt`` or ``torch.OutOfMemoryError``. After each
failed load: the error that reaches the caller is the one injected; a transactional load
(a report's too) left every runtime tensor's bits, registration and ``requires_grad`` as
before, and a plain one left each element at its value from before or the one the load
meant; no mode, signal handler, held signal, grad mode, default device or paused
collector is left behind; a report attached to the error agrees with the model; and the
same patches then load cleanly.

A seeded slice of a sweep that was run over every N (see ``test_sweep_slice``), plus the
defects that sweep found (each test below it failed before its fix)."""

from __future__ import annotations

import gc
import random
import signal

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import patchkit
import patchkit.intercept as intercept
import patchkit.loader as loader_mod
import patchkit.native as native
from patchkit import CheckpointWeightPatch as CWP
from patchkit.bitwise import bits
from patchkit.build import dense_patches, random_sparse_patch
from patchkit.toymodels import PlainModel, TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's own SIGINT handler for each test (the "signal" fault raises a real
    SIGINT, which must become KeyboardInterrupt): a process started in the background of
    a shell script (``cmd &``), or under nohup or some runners, inherits SIGINT ignored,
    and Python then installs no handler of its own; the sweep's signal points failed
    there. As in test_interrupts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Injected(RuntimeError):
    pass


class InjectedInterrupt(KeyboardInterrupt):
    pass


class _Points:
    """Counts the points one kind of fault may strike at; the ``n``-th raises ``error``,
    or sends a SIGINT for ``error=signal.SIGINT`` (``n=0``: none does, the points are
    only counted)."""

    def __init__(self, n: int, error: type[BaseException]) -> None:
        self.n, self.error, self.count, self.fired = n, error, 0, None

    def strike(self) -> None:
        self.count += 1
        if self.count == self.n:
            if self.error is signal.SIGINT:  # a real Ctrl-C: its handler raises
                self.fired = signal.SIGINT
                signal.raise_signal(signal.SIGINT)
                return
            self.fired = self.error(f"injected at point {self.n}")
            raise self.fired


class _RaiseAtOp(TorchDispatchMode):
    """Pushed inside the model's ``load_weights``: sees the loader's ATen ops first (and,
    in a watched dense call, the ops of patchkit's handling of its copies)."""

    def __init__(self, points: _Points, after: bool) -> None:
        super().__init__()
        self.points, self.after = points, after

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.after:
            self.points.strike()
        out = func(*args, **(kwargs or {}))
        if self.after:
            self.points.strike()
        return out


def _llama(kind: str, experts: int = 0):
    config = (TinyLlamaConfig(num_experts=experts, intermediate_size=32) if experts
              else TinyLlamaConfig())
    start, target = tiny_llama_checkpoint(config, seed=0), tiny_llama_checkpoint(config, seed=1)

    def model() -> nn.Module:
        m = TinyLlamaRuntime(config, tp_rank=0, tp_size=2)  # packed qkv, TP shards
        patchkit.load_checkpoint_weight_patches(m, dense_patches(start))
        return m

    names = [n for n in target if ".0." in n or "embed" in n][:: 2 if experts else 1][:9]
    if kind == "dense":
        patches = dense_patches({n: target[n] for n in names}, clone=True)
    else:
        g = torch.Generator().manual_seed(3)
        patches = [random_sparse_patch(n, target[n].shape, target[n].dtype, 0.05, generator=g)
                   for n in names]
    return model, patches, 12 << 10


def _plain(kind: str):
    shapes = {"a.w": (8, 16), "a.b": (16,), "b.w": (32, 8), "c": (64,)}
    g = torch.Generator().manual_seed(5)
    if kind == "dense":
        patches = [CWP(n, s, torch.float32, torch.randn(s, generator=g).flatten())
                   for n, s in shapes.items()]
    else:
        patches = [random_sparse_patch(n, s, torch.float32, 0.2, generator=g)
                   for n, s in shapes.items()]
    return lambda: PlainModel(shapes, fill=0.5), patches, 600


SETUPS = {
    "llama-sparse": lambda: _llama("sparse"),
    "moe-dense": lambda: _llama("dense", experts=4),
    "plain-dense": lambda: _plain("dense"),
    "plain-sparse": lambda: _plain("sparse"),
}


def _state(model: nn.Module):
    tensors = {**{"p:" + n: t for n, t in model.named_parameters(remove_duplicate=False)},
               **{"b:" + n: t for n, t in model.named_buffers(remove_duplicate=False)}}
    values = {n: bits(t.detach()).clone() for n, t in tensors.items()}
    kept = {n: (id(t), t.data_ptr(), tuple(t.shape), t.stride(), t.requires_grad)
            for n, t in tensors.items()}
    return values, kept


def _process():
    return (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack(),
            torch.is_grad_enabled(), str(torch.get_default_device()),
            signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), gc.isenabled(),
            len(loader_mod._paused_by), intercept._DEFERRAL.depth,
            list(intercept._DEFERRAL._pending), intercept._DEFERRAL._uses)


def _load(model, patches, how: str, budget: int):
    kw = {"max_chunk_bytes": budget, "transactional": how.endswith("transactional")}
    if how.startswith("inspect"):
        return patchkit.inspect_load(model, patches, **kw)
    return patchkit.load_checkpoint_weight_patches(model, patches, **kw)


def _save_point() -> tuple[object, str]:
    """Where a watched write allocates its save: the compiled path's buffers
    (``native._empty``), or, on the torch-ops path (a GPU, ``PATCHKIT_NATIVE=0``), the
    record made of the copy it has just taken, before the write."""
    if torch.get_default_device().type == "cpu" and native._library() is not None:
        return native, "_empty"
    return intercept.SavedRegion, "__init__"


def _inject(fault: str, model: nn.Module, points: _Points, monkeypatch, calls: int):
    """Arm ``points`` at the fault's place; returns the rollback trigger, if any."""
    if fault in ("op", "op-after", "signal"):
        real = model.load_weights

        def load_weights(weights):
            with _RaiseAtOp(points, after=fault != "op"):
                return real(weights)
        model.load_weights = load_weights
    elif fault in ("call", "call-after"):
        real = model.load_weights

        def load_weights(weights):
            if fault == "call":
                points.strike()
            out = real(weights)
            if fault == "call-after":
                points.strike()
            return out
        model.load_weights = load_weights
    elif fault in ("stage", "save"):
        module, attr = (loader_mod, "_stage") if fault == "stage" else _save_point()
        real = getattr(module, attr)

        def allocate(*a, **k):
            points.strike()
            return real(*a, **k)
        monkeypatch.setattr(module, attr, allocate)
    elif fault == "restore":
        # the last call raises after its writes; the N-th region written back raises
        trigger = _Points(calls, Injected)
        _inject("call-after", model, trigger, monkeypatch, calls)
        real = intercept.SavedRegion.restore

        def restore(self):
            points.strike()
            return real(self)
        monkeypatch.setattr(intercept.SavedRegion, "restore", restore)
        return trigger
    else:
        raise ValueError(fault)
    return None


def _check_failed_load(patches, how, fault, n, error, budget, reference, monkeypatch):
    """Run one load with the ``n``-th point of ``fault`` raising ``error``; check the
    invariants. Returns False when the load ended before its ``n``-th point."""
    make, _, _ = reference["setup"]
    model = make()
    before, kept = _state(model)
    process = _process()
    rollbacks = intercept.rollbacks()
    points = _Points(n, error)
    with monkeypatch.context() as mp:
        trigger = _inject(fault, model, points, mp, reference["calls"])
        try:
            _load(model, patches, how, budget)
            raised = None
        except BaseException as e:
            raised = e
    vars(model).pop("load_weights", None)
    at = f"{how}, {fault} at point {n}"
    assert _process() == process, at
    if points.fired is None:
        assert fault == "restore" or raised is None, (at, raised)
        return False
    transactional = how.endswith("transactional")
    unrestored: set[str] = set()
    if fault == "restore":
        assert isinstance(raised, RuntimeError) and "rollback incomplete" in str(raised), at
        assert raised.__cause__ is points.fired and raised.__context__ is trigger.fired, at
        named = {k for k in kept if f"'{k[2:]}'" in str(raised).split("keep what")[0]}
        same = {kept[k][0] for k in named}
        unrestored = {k for k in kept if kept[k][0] in same}
        assert unrestored, at
    elif fault == "signal":
        assert isinstance(raised, KeyboardInterrupt), (at, raised)
    else:
        assert raised is points.fired, (at, raised)
    after, kept_after = _state(model)
    assert kept_after == kept, at  # registrations, views, requires_grad
    for name, b in before.items():
        a = after[name]
        if transactional and name not in unrestored:
            assert torch.equal(a, b), (at, name)
        else:  # each element as before, or as the load meant it
            assert not ((a != b) & (a != reference["after"][name])).any(), (at, name)
    moved = intercept.rollbacks() - rollbacks
    assert moved in ((0, 1) if transactional else (0,)), at
    if how.startswith("inspect"):
        report = raised.report
        assert report.error is raised, at
        assert report.rolled_back == (transactional and moved == 1 and not unrestored), at
        report.summary(), repr(report), report.writes, report.chunks, report.calls
        tensors = dict(model.named_parameters())
        for target, row in report.deltas.iterrows():
            was = bits(report.before(target))
            assert torch.equal(was, before["p:" + target]), (at, target)
            now = bits(tensors[target].detach())
            assert int((now != was).sum()) == row["changed"], (at, target)
    patchkit.load_checkpoint_weight_patches(model, patches, max_chunk_bytes=budget)
    again, _ = _state(model)
    assert all(torch.equal(again[k], v) for k, v in reference["after"].items()), at
    return True


_FAULTS = [("call", InjectedInterrupt), ("call-after", Injected), ("op", Injected),
           ("op-after", InjectedInterrupt), ("signal", signal.SIGINT),
           ("stage", torch.OutOfMemoryError), ("save", torch.OutOfMemoryError),
           ("restore", Injected)]
_HOWS = ["plain", "transactional", "inspect", "inspect transactional"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("setup", list(SETUPS))
def test_sweep_slice(setup, monkeypatch):
    """Every fault kind, at its first and last point and at six more drawn with a
    fixed seed, for each way of loading."""
    make, patches, budget = SETUPS[setup]()
    model = make()
    patchkit.load_checkpoint_weight_patches(model, patches, max_chunk_bytes=budget)
    reference = {"setup": (make, patches, budget), "after": _state(model)[0],
                 "calls": len(patchkit.inspect_load(make(), patches, max_chunk_bytes=budget)
                              .calls)}
    draw = random.Random(f"fault sweep {setup}")
    swept = 0
    for how in _HOWS:
        for fault, error in _FAULTS:
            if fault == "restore" and not how.endswith("transactional"):
                continue
            # how many points the load passes (a run whose point never comes)
            counting = _Points(0, error)
            m = make()
            with monkeypatch.context() as mp:
                _inject(fault, m, counting, mp, reference["calls"])
                try:
                    _load(m, patches, how, budget)
                except Injected:
                    assert fault == "restore"  # (its trigger: no region failed)
            total = counting.count
            if total == 0:  # (a plain load saves nothing)
                assert (fault, how) == ("save", "plain"), (fault, how)
                continue
            chosen = {1, total, *draw.sample(range(1, total + 1), min(6, total))}
            for n in sorted(chosen):
                assert _check_failed_load(patches, how, fault, n, error, budget, reference,
                                          monkeypatch)
                swept += 1
            assert not _check_failed_load(patches, how, fault, total + 1, error, budget,
                                          reference, monkeypatch)
    assert swept > 40


# -- what the sweep found ----------------------------------------------------------------


class _Packed(nn.Module):
    """q and k packed into one runtime tensor, as ``qkv_proj``; the loader raises after
    its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Parameter(torch.zeros(4, 3), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            self.qk.data[{"q": slice(0, 2), "k": slice(2, 4)}[name]].copy_(w)
        raise RuntimeError("the loader fails after its writes")


def test_deltas_after_an_incomplete_rollback_count_what_the_model_holds(monkeypatch):
    """A rollback that writes back one of a target's regions and fails on another left
    the target half restored, but the report's ``deltas`` (on the compiled path, which
    measures while writing) still counted both regions' changes: 12 changed where the
    model held 6. README: ``deltas`` compares with the model as it is after the
    rollback."""
    m = _Packed()
    patches = [CWP(n, (2, 3), torch.float32, torch.ones(6)) for n in ("q", "k")]
    real = intercept.SavedRegion.restore
    failures = []

    def restore(self):
        if not failures:  # the first region written back (the newest: k's) fails
            failures.append(self.target)
            raise RuntimeError("cannot write back")
        return real(self)

    monkeypatch.setattr(intercept.SavedRegion, "restore", restore)
    with pytest.raises(RuntimeError, match="rollback incomplete") as info:
        patchkit.inspect_load(m, patches, transactional=True)
    report = info.value.report
    assert m.qk.tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2  # q put back, k not
    assert report.rolled_back is False
    row = report.deltas.loc["qk"]
    assert (row["elements"], row["changed"]) == (12, 6)
    assert row["max_abs"] == 1.0 and row["mean_abs"] == 0.5


@pytest.mark.parametrize("fails", [False, True])
def test_an_error_while_the_report_is_made_says_what_became_of_the_load(monkeypatch, fails):
    # (the report's own failure, an out-of-memory say, reached the caller saying nothing
    # of the load: whether its writes stand, or that the load had failed first)
    import patchkit.inspect as inspect_mod

    def no_report(*args, **kwargs):
        raise RuntimeError("out of memory while making the report")

    monkeypatch.setattr(inspect_mod, "_report_of", no_report)
    m = PlainModel({"w": (4,)})
    if fails:
        m.load_weights = lambda weights: {}["unknown name"]
    p = CWP("w", (4,), torch.float32, torch.tensor([2.0]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="out of memory") as e:
        patchkit.inspect_load(m, [p])
    note = " ".join(e.value.__notes__)
    if fails:
        assert "had failed with KeyError, this error's __context__" in note
        assert isinstance(e.value.__context__, KeyError)
    else:
        assert "had finished: what it wrote stays in the model" in note
        assert m.w.detach().tolist() == [0.0, 2.0, 0.0, 0.0]
