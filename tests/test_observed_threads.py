"""``inspect_load(..., loader=...)`` on a model that other threads load at the same time,
and what an observed loader may return.

An observed load routes ``model.load_weights`` through a recorder while it runs. Each
thread's calls go to its own observed load (or, on a thread observing nothing, to the
model's own ``load_weights``, unwatched), and the last observed load to end puts
``load_weights`` back as it was.
"""

from __future__ import annotations

import threading

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import inspect_load
from patchkit.errors import PatchTypeError
from patchkit.toymodels import PlainModel

WAIT = 20  # seconds a thread waits for the other before the test gives up


def _dense(name: str, value: float, n: int = 8) -> CWP:
    return CWP(name, (n,), torch.float32, torch.full((n,), value))


def _sends_as_one_call(model, patches, **kwargs):
    return model.load_weights([(p.name, p.values.view(p.shape)) for p in patches])


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a thread hung"


def test_another_threads_load_during_an_observed_load_is_not_in_its_report():
    # (the other thread's call went through the observed load's recorder: its name and
    # writes showed in that report as the observed loader's own)
    m = PlainModel({"a": (8,), "b": (8,)}, fill=1.0)
    inside, other_done = threading.Event(), threading.Event()
    out: dict[str, object] = {}

    def waits_for_the_other(model, patches, **kwargs):
        inside.set()
        assert other_done.wait(WAIT)
        return _sends_as_one_call(model, patches)

    def observed():
        out["report"] = inspect_load(m, [_dense("a", 2.0)], loader=waits_for_the_other)

    def plain():
        assert inside.wait(WAIT)
        try:
            out["plain"] = patchkit.load_checkpoint_weight_patches(m, [_dense("b", 3.0)])
        finally:
            other_done.set()

    _run([threading.Thread(target=observed), threading.Thread(target=plain)])
    r = out["report"]
    assert [tuple(n) for n in r.calls["names"]] == [("a",)]
    assert list(r.deltas.index) == ["a"]
    assert set(r.writes["target"]) == {"a"}
    assert out["plain"] == {"b"}
    assert m.a.tolist() == [2.0] * 8 and m.b.tolist() == [3.0] * 8
    assert "load_weights" not in vars(m)


class _MeetsInLoad(PlainModel):
    """A model whose ``load_weights`` waits until two calls are inside it at once."""

    def __init__(self, shapes, **kwargs):
        super().__init__(shapes, **kwargs)
        self.meet = threading.Barrier(2)

    def load_weights(self, weights):
        weights = list(weights)
        self.meet.wait(WAIT)
        return super().load_weights(weights)


@pytest.mark.parametrize("other_observed", [True, False], ids=["both observed", "one observed"])
def test_two_threads_inside_one_models_load_weights_each_see_their_own(other_observed):
    # (both observed: the first to end removed the other's recorder and the other put the
    # first's back, left on the model for good, its session saving every later write;
    # either way one of them could die on torch's "pop from empty mode stack")
    m = _MeetsInLoad({"a": (8,), "b": (8,)}, fill=1.0)
    reports: dict[str, object] = {}
    errors: list[BaseException] = []

    def load(name, value, observed):
        try:
            if observed:
                reports[name] = inspect_load(m, [_dense(name, value)], loader=_sends_as_one_call)
            else:
                reports[name] = patchkit.load_checkpoint_weight_patches(m, [_dense(name, value)])
        except BaseException as exc:  # (shown by the assert below)
            errors.append(exc)

    _run([threading.Thread(target=load, args=("a", 2.0, True)),
          threading.Thread(target=load, args=("b", 3.0, other_observed))])
    assert errors == []
    assert [tuple(n) for n in reports["a"].calls["names"]] == [("a",)]
    assert list(reports["a"].deltas.index) == ["a"]
    if other_observed:
        assert [tuple(n) for n in reports["b"].calls["names"]] == [("b",)]
        assert list(reports["b"].deltas.index) == ["b"]
    else:
        assert reports["b"] == {"b"}
    assert m.a.tolist() == [2.0] * 8 and m.b.tolist() == [3.0] * 8
    assert "load_weights" not in vars(m)  # (nothing left: later loads are plain ones)
    m.meet = threading.Barrier(1)
    again = inspect_load(m, [_dense("a", 4.0)], loader=_sends_as_one_call)
    assert list(again.deltas.index) == ["a"] and "load_weights" not in vars(m)


def test_an_observed_load_inside_another_on_one_thread_is_seen_by_both():
    # (the inner one's calls pass on to the outer one's recorder, then to the model)
    m = PlainModel({"a": (8,), "b": (8,)}, fill=1.0)
    inner: list[object] = []

    def outer_loader(model, patches, **kwargs):
        inner.append(inspect_load(model, [_dense("b", 3.0)], loader=_sends_as_one_call))
        return _sends_as_one_call(model, patches)

    outer = inspect_load(m, [_dense("a", 2.0)], loader=outer_loader)
    assert [tuple(n) for n in inner[0].calls["names"]] == [("b",)]
    assert [tuple(n) for n in outer.calls["names"]] == [("b",), ("a",)]
    assert "load_weights" not in vars(m)


def test_an_instance_load_weights_is_put_back_after_observed_loads_on_two_threads():
    m = _MeetsInLoad({"a": (8,), "b": (8,)}, fill=1.0)
    own = m.load_weights
    m.load_weights = own  # (an instance attribute: the object put back must be this one)
    _run([threading.Thread(target=inspect_load, args=(m, [_dense(n, 2.0)]),
                           kwargs={"loader": _sends_as_one_call}) for n in ("a", "b")])
    assert vars(m)["load_weights"] is own
    assert m.a.tolist() == [2.0] * 8 and m.b.tolist() == [2.0] * 8


class _PropertyLoadWeights(PlainModel):
    """A model whose ``load_weights`` is a property giving its own method (or, in the
    subclass with a setter, the replacement set through it)."""

    def __init__(self, shapes, **kwargs):
        super().__init__(shapes, **kwargs)
        self.given = None

    @property
    def load_weights(self):
        return self.given or super().load_weights


class _SettableLoadWeights(_PropertyLoadWeights):
    @_PropertyLoadWeights.load_weights.setter
    def load_weights(self, fn):
        self.given = fn


@pytest.mark.parametrize("cls", [_PropertyLoadWeights, _SettableLoadWeights],
                         ids=["no setter", "setter"])
def test_a_model_whose_load_weights_is_a_property_is_refused_before_anything_runs(cls):
    # (no setter: a bare AttributeError from inside patchkit, the loader never run; a
    # setter: the wrapper was set through it and never taken off, left on the model)
    m = cls({"a": (8,)}, fill=1.0)
    ran = []

    def loader(model, patches, **kwargs):
        ran.append(True)
        return _sends_as_one_call(model, patches)

    with pytest.raises(PatchTypeError, match="property") as info:
        inspect_load(m, [_dense("a", 2.0)], loader=loader)
    assert info.value.reason == "load_weights property"
    assert ran == [] and m.a.tolist() == [1.0] * 8
    assert m.given is None and m.load_weights.__func__ is PlainModel.load_weights


@pytest.mark.parametrize("returned, shown", [
    ("a", "'a' (str)"),  # (read as a set of its characters before)
    (3, "3 (int)"),  # (a bare "'int' object is not iterable" before)
    (["a", 7], "7 (int) among its names"),
])
def test_what_an_observed_loader_returns_is_names_or_a_clear_error(returned, shown):
    m = PlainModel({"a": (8,)}, fill=1.0)

    def loader(model, patches, **kwargs):
        _sends_as_one_call(model, patches)
        return returned

    with pytest.raises(PatchTypeError, match="returned") as info:
        inspect_load(m, [_dense("a", 2.0)], loader=loader)
    assert shown in str(info.value) and "'loader'" in str(info.value)
    assert info.value.reason == "loader returned"
    assert m.a.tolist() == [2.0] * 8  # (its writes stay, as the message says)
    assert list(info.value.report.deltas.index) == ["a"]


@pytest.mark.parametrize("returned", [None, (n for n in ["a"]), ["a"], {"a": 1}],
                         ids=["None", "generator", "list", "dict"])
def test_an_observed_loaders_names_may_come_as_any_iterable_of_str(returned):
    m = PlainModel({"a": (8,)}, fill=1.0)

    def loader(model, patches, **kwargs):
        _sends_as_one_call(model, patches)
        return returned

    r = inspect_load(m, [_dense("a", 2.0)], loader=loader)
    assert r.loaded == (set() if returned is None else {"a"})


def test_a_call_the_loader_makes_on_a_worker_thread_passes_unwatched():
    # (as its writes were already: the watch is per thread. Its patch reads as not sent,
    # and the names the loader returns are still what the report says it loaded.)
    m = PlainModel({"a": (8,)}, fill=1.0)

    def on_a_worker(model, patches, **kwargs):
        out: list[set[str]] = []
        t = threading.Thread(target=lambda: out.append(_sends_as_one_call(model, patches)))
        t.start()
        t.join(WAIT)
        return out[0]

    r = inspect_load(m, [_dense("a", 2.0)], loader=on_a_worker)
    assert len(r.calls) == 0 and len(r.writes) == 0
    assert r.chunks["note"].tolist() == ["not sent by the observed loader"]
    assert r.loaded == {"a"} and m.a.tolist() == [2.0] * 8
    assert "load_weights" not in vars(m)


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_an_observed_loader_that_makes_no_call_sent_nothing_or_stopped(raises):
    # (one that returned was said to have stopped before its first call)
    m = PlainModel({"a": (8,)}, fill=1.0)

    def no_call(model, patches, **kwargs):
        if raises:
            raise RuntimeError("before any call")
        return set()

    if raises:
        with pytest.raises(RuntimeError) as info:
            inspect_load(m, [_dense("a", 2.0)], loader=no_call)
        r = info.value.report
    else:
        r = inspect_load(m, [_dense("a", 2.0)], loader=no_call)
    assert r.chunks["note"].tolist() == [
        "not sent: the load stopped before its first call" if raises
        else "not sent by the observed loader"]
    assert m.a.tolist() == [1.0] * 8
