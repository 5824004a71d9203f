"""The runtime index: which tensors a model has, and where each sits in its storage.

``named_tensors`` walks the module tree itself where it may; these tests hold it to
torch's own listing (names, tensors and order) on models that exercise every rule of that
listing, and check the fallback to torch where a module lists its tensors its own way.
"""

from __future__ import annotations

import pytest
import torch

from patchkit.intercept import RuntimeIndex, _byte_span, _storage_key, named_tensors
from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime


def _torch_listing(model, buffers=True):
    named = list(model.named_parameters(remove_duplicate=False))
    if buffers:
        named += list(model.named_buffers(remove_duplicate=False))
    return [(n, id(t)) for n, t in named]


def _listing(model, buffers=True):
    return [(n, id(t)) for n, t in named_tensors(model, buffers=buffers)]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.register_buffer("unset", None)
        self.register_parameter("missing", None)


class _Everything(torch.nn.Module):
    """Tied weights, a submodule under two parents, an empty child, containers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 2)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        shared = _Block()
        self.left = torch.nn.Sequential(shared, torch.nn.ReLU())
        self.right = torch.nn.ModuleDict({"again": shared, "norm": torch.nn.LayerNorm(2)})
        self.head = torch.nn.Linear(2, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, two names
        self.register_module("nothing", None)
        self.empty = torch.nn.Parameter(torch.empty(0))


def _models():
    return {
        "tiny llama, rank 1 of 2": TinyLlamaRuntime(TinyLlamaConfig(), tp_rank=1, tp_size=2),
        "every rule of the listing": _Everything(),
        "one parameter, no children": torch.nn.Linear(2, 2),
        "no tensors at all": torch.nn.ReLU(),
    }


@pytest.mark.parametrize("name", list(_models()))
@pytest.mark.parametrize("buffers", [True, False])
def test_the_walk_lists_what_torch_lists_in_its_order(name, buffers):
    model = _models()[name]
    assert _listing(model, buffers) == _torch_listing(model, buffers)


def test_the_walk_keeps_aliases_under_every_path():
    model = _Everything()
    names = [n for n, _ in named_tensors(model)]
    # the shared block is listed under both parents, and the tied weight under both names
    assert "left.0.lin.weight" in names and "right.again.lin.weight" in names
    assert "embed.weight" in names and "head.weight" in names
    index = RuntimeIndex(model)
    assert index.aliases["head.weight"] == "embed.weight"
    assert index.aliases["right.again.lin.weight"] == "left.0.lin.weight"
    assert index.aliases["right.again.steps"] == "left.0.steps"


class _Hiding(torch.nn.Module):
    """Lists its tensors its own way: hides one parameter from named_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = torch.nn.Parameter(torch.ones(2))
        self.hidden = torch.nn.Parameter(torch.ones(3))

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for n, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if not n.endswith("hidden"):
                yield n, p


class _Outer(torch.nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.w = torch.nn.Parameter(torch.ones(1))


class _OwnModules(torch.nn.Module):
    """A child that lists its submodules its own way: it leaves one out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(1, 1)
        self.b = torch.nn.Linear(1, 1)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        for n, m in super().named_modules(memo, prefix, remove_duplicate):
            if not n.endswith(".b"):
                yield n, m


@pytest.mark.parametrize("model", [_Hiding(), _Outer(_OwnModules())], ids=["root", "child"])
def test_a_module_that_lists_its_tensors_its_own_way_gets_torchs_answer(model):
    # (what torch says is the reference, whatever the override does with it)
    assert _listing(model) == _torch_listing(model)


def test_a_module_tree_that_loops_raises_as_torch_does():
    model = torch.nn.Linear(1, 1)
    model.add_module("me", model)
    with pytest.raises(RecursionError):
        _torch_listing(model)
    with pytest.raises(RecursionError):
        named_tensors(model)


def test_the_index_keeps_each_tensors_place_in_its_storage():
    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.arange(24.0)
            self.a = torch.nn.Parameter(flat[:8].view(2, 4), False)  # contiguous
            self.b = torch.nn.Parameter(flat[8:].view(4, 4)[:, 1:3], False)  # strided
            self.c = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16), False)
            self.register_buffer("empty", torch.empty(0))

    model = Fused()
    index = RuntimeIndex(model)
    assert list(index.tensors) == ["a", "b", "c", "empty"]
    for name in ("a", "b", "c"):
        t = index.tensors[name]
        (owner,) = [o for o in index.sharing(_storage_key(t)) if o.name == name]
        assert owner.tensor is t
        assert (owner.start, owner.end) == _byte_span(t)
        assert owner.step == t.element_size()
        assert owner.dense == t.is_contiguous()
    shared = index.sharing(_storage_key(model.a))
    assert [o.name for o in shared] == ["a", "b"]  # one storage, in the listing's order
    assert index.sharing((torch.device("cpu"), -1)) == []
    # owner(): the tensor that holds a view's first element, and where in it
    assert index.owner(model.a[1]) == ("a", model.a, 4)
    assert index.owner(model.b[2:]) == ("b", model.b, 4)
    assert index.owner(model.c[1:]) == ("c", model.c, 1)
    assert index.owner(torch.zeros(2)) is None


def _with_slots() -> torch.nn.Module:
    model = torch.nn.Module()
    model.lin = torch.nn.Linear(2, 2, bias=False)  # an empty slot: lin.bias is None
    model.register_buffer("steps", torch.zeros(1))
    return model


_ADDITIONS = {
    "parameter": (lambda m: setattr(m, "extra", torch.nn.Parameter(torch.ones(2))), ["extra"]),
    "buffer": (lambda m: m.register_buffer("kept", torch.ones(2)), ["kept"]),
    "empty slot": (lambda m: setattr(m.lin, "bias", torch.nn.Parameter(torch.ones(2))),
                   ["lin.bias"]),
    "submodule": (lambda m: setattr(m, "sub", torch.nn.Linear(2, 1)), ["sub.weight", "sub.bias"]),
    "nested": (lambda m: setattr(m.lin, "inner", torch.nn.Linear(1, 1, bias=False)),
               ["lin.inner.weight"]),
    "tie": (lambda m: setattr(m, "again", m.lin.weight), ["again"]),
    "replaced and added": (
        lambda m: (setattr(m.lin, "weight", torch.nn.Parameter(torch.ones(2, 2))),
                   setattr(m, "extra", torch.nn.Parameter(torch.ones(2)))), ["extra"]),
}


@pytest.mark.parametrize("how", list(_ADDITIONS))
@pytest.mark.parametrize("fallback", [False, True], ids=["tree", "torch-walk"])
def test_the_index_finds_names_registered_after_it_and_removes_them(how, fallback, monkeypatch):
    # a name registered during a load was not known: a sparse call's NaN reached the model
    # through it, and a rollback left it
    import patchkit.intercept as intercept

    model = _with_slots()
    if fallback:  # (as for a model whose modules list their tensors their own way)
        monkeypatch.setattr(intercept, "_module_tree", lambda m: None)
    before = _listing(model)
    index = RuntimeIndex(model)
    assert index.added() == []
    add, names = _ADDITIONS[how]
    add(model)
    assert index.added() == names
    index.remove_added(index.added())
    index.put_back(index.replaced())
    assert _listing(model) == before
    assert [n for n, _ in model.named_modules()] == ["", "lin"]  # (a new submodule left)
    assert model.lin.bias is None and "bias" in model.lin._parameters  # (the slot stays)
    assert index.added() == []
