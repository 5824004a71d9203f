"""The runtime index: which tensors a model has, and where each sits in its storage.

``named_tensors`` walks the module tree itself where it may; these tests hold it to
torch's own listing (names, tensors and order) on models that exercise every rule of that
listing, and check the fallback to torch where a module lists its tensors its own way.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from _torch_features import MODULES_KEEP_DICTS

from patchkit._regions import _byte_span, _storage_key
from patchkit._runtime_index import named_tensors
from patchkit.intercept import RuntimeIndex
from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime


@pytest.fixture(autouse=True, params=["columns", "one tensor at a time"])
def _index_path(request, monkeypatch):
    """Every test here runs on both of the ways a RuntimeIndex is built: in columns
    (``_index_plain``, the way for a tree of ``_COLUMNS_FROM`` modules or more whose
    tensors are all plain) and one tensor at a time (``_index_listed``, for a smaller
    tree, and for any tree the columns decline)."""
    import patchkit._runtime_index as runtime_index

    monkeypatch.setattr(runtime_index, "_COLUMNS_FROM",
                        0 if request.param == "columns" else sys.maxsize)
    return request.param


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


def _torch_aliases(model):
    first, aliases = {}, {}
    for n, t in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(t), n) != n:
            aliases[n] = first[id(t)]
    return aliases


def _deep(depth):
    model = node = torch.nn.Module()
    for _ in range(depth):
        node.child = torch.nn.Module()
        node = node.child
    node.w = torch.nn.Parameter(torch.ones(1))
    return model


def _tied_models():
    models = dict(_models())
    a = _Everything()
    a.blocks[1].lin.bias = a.blocks[0].lin.bias  # (tied below the root, beside None slots)
    models["tied in a list"] = a
    b = _Everything()
    b.head.weight = torch.nn.Parameter(b.head.weight.detach().clone())  # (untied)
    models["tied by a shared module alone (the embedding untied)"] = b
    c = torch.nn.Linear(2, 2)
    c._parameters["again"] = c.weight  # (one module's registry, two keys)
    models["two keys of one registry"] = c
    d = torch.nn.Linear(2, 2)
    del d.__dict__["_modules"]  # (a walk of such a tree goes on)
    models["registry deleted"] = d
    for name, tied in (("hiding", _Hiding()), ("own modules", _Outer(_OwnModules()))):
        tied.extra = next(tied.parameters())
        models[f"lists its tensors its own way, {name}"] = tied
    # (the limit as it is when the test runs: torch's inductor, compiling with a cold
    # cache, raises it to 2000 for good, and a tree 1100 deep then raised nowhere)
    models["deeper than the recursion limit"] = _deep(sys.getrecursionlimit() + 100)
    models["untied, empty slots"] = torch.nn.Sequential(
        torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False), _Block())
    return models


@pytest.mark.parametrize("name", [n for n in _tied_models()  # (those an index is built of)
                                  if not n.startswith(("deeper", "registry deleted"))])
def test_the_columns_the_index_checks_a_tree_by_are_its_slots(name):
    # (what unchanged() compares, as one column per kind: each registry, key and the
    # tensor the index holds under that name, or under an alias's first name)
    index = RuntimeIndex(_tied_models()[name])
    slots = [(reg, key, index.tensors[n]) for n, reg, key in index._slots or ()]
    aliases = [(reg, key, index.tensors[index.aliases[n]]) for n, reg, key in index._alias_slots]
    expected = (tuple(zip(*index._links)) or ((), (), ()), tuple(zip(*slots)) or ((), (), ()),
                tuple(zip(*index._empty_slots)) or ((), ()), tuple(zip(*aliases)) or ((), (), ()))
    got = index._columns
    assert [list(map(len, kind)) for kind in got] == [list(map(len, kind)) for kind in expected]
    assert all(a is b for kind, want in zip(got, expected)
               for column, wanted in zip(kind, want) for a, b in zip(column, wanted))
    assert index.unchanged() is (index._slots is not None)


@pytest.mark.parametrize("name", list(_tied_models()))
def test_the_tied_parameters_a_dense_load_finds_are_torchs(name, monkeypatch):
    # a dense load tells a model with no tied parameter by their ids alone, without names
    # (a walk that builds names cost a dense load 1 us per tensor)
    import patchkit.loader as loader
    from patchkit.loader import _tied_aliases

    model = _tied_models()[name]
    if name.startswith("untied, empty") or name.startswith("one parameter"):
        def named(*args, **kwargs):
            raise AssertionError("a model with no tied parameter was walked for names")

        monkeypatch.setattr(loader, "named_tensors", named)  # (no names built: the ids do)
    if name.startswith("deeper"):  # (torch itself cannot list it: both raise)
        with pytest.raises(RecursionError):
            _torch_aliases(model)
        with pytest.raises(RecursionError):
            _tied_aliases(model)
        return
    if name == "registry deleted":  # (torch's walk raises; patchkit's walks go on)
        assert _tied_aliases(model) == {} and "weight" in named_tensors(model)[0][0]
        return
    assert _tied_aliases(model) == _torch_aliases(model)
    assert bool(_torch_aliases(model)) == (  # (the models meant to hold a tie do)
        name.startswith(("tied", "two keys", "lists", "every rule")))


@pytest.mark.parametrize("links", [1, 2, 3])
def test_a_module_tree_that_loops_raises_as_torch_does(links):
    # (with two links back, each level of the tied-name search was twice the last: it ran
    # out of memory where torch raises at once)
    from patchkit._runtime_index import _registers_twice
    from patchkit.loader import _tied_aliases

    model = torch.nn.Linear(1, 1)
    for k in range(links):
        model.add_module(f"me{k}", model)
    with pytest.raises(RecursionError):
        _torch_listing(model)
    with pytest.raises(RecursionError):
        named_tensors(model)
    assert _registers_twice(model) is not False  # (left to torch's walk, which raises)
    with pytest.raises(RecursionError):
        _tied_aliases(model)
    # a loop of modules with no parameters, below the root: no tensor repeats to stop the
    # search, only the depth (past the number of modules: no tree is that deep)
    inner = torch.nn.Sequential(torch.nn.Sequential())
    for k in range(links):
        inner[0].add_module(f"up{k}", inner)
    assert _registers_twice(torch.nn.Sequential(inner)) is None
    with pytest.raises(RecursionError):
        _tied_aliases(torch.nn.Sequential(inner))


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
    import patchkit._runtime_index as runtime_index

    model = _with_slots()
    if fallback:  # (as for a model whose modules list their tensors their own way)
        monkeypatch.setattr(runtime_index, "_module_tree", lambda m: None)
    before = _listing(model)
    index = RuntimeIndex(model)
    assert index.added() == []
    add, names = _ADDITIONS[how]
    add(model)
    assert index.added() == names
    index.undo()
    assert _listing(model) == before
    assert [n for n, _ in model.named_modules()] == ["", "lin"]  # (a new submodule left)
    assert model.lin.bias is None and "bias" in model.lin._parameters  # (the slot stays)
    assert index.added() == []


_MOVES = {  # a tensor kept under its name, in the other registry
    "parameter into the buffers": (
        lambda m: m.lin._buffers.update(weight=m.lin._parameters.pop("weight")), "lin.weight"),
    "buffer into the parameters": (
        lambda m: m._parameters.update(steps=m._buffers.pop("steps")), "steps"),
    # (a Parameter may be registered as a buffer: put back as the buffer it was)
    "parameter object registered as a buffer into the parameters": (
        lambda m: m._parameters.update(frozen=m._buffers.pop("frozen")), "frozen"),
}


@pytest.mark.parametrize("move", list(_MOVES))
@pytest.mark.parametrize("fallback", [False, True], ids=["tree", "torch-walk"])
def test_a_tensor_moved_to_the_other_registry_is_replaced_on_either_path(move, fallback,
                                                                         monkeypatch):
    # the torch walk lists parameters and then buffers as one list: a tensor moved from
    # one to the other under its own name looked unchanged there (the tree path saw it)
    import patchkit._runtime_index as runtime_index

    model = _with_slots()
    model.register_buffer("frozen", torch.nn.Parameter(torch.ones(1), requires_grad=False))
    if fallback:
        monkeypatch.setattr(runtime_index, "_module_tree", lambda m: None)
    before = _tree(model)
    index = RuntimeIndex(model)
    do, name = _MOVES[move]
    do(model)
    assert index.replaced() == [name] and index.added() == []
    index.undo()
    assert _tree(model) == before and index.replaced() == []


class _ListsABufferAsParameter(torch.nn.Module):
    """Its own listing yields its buffer ``scale`` among its parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("scale", torch.ones(1))

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        yield from super().named_parameters(prefix, recurse, remove_duplicate)
        yield prefix + "scale", self.scale


def test_undo_registers_a_name_in_the_registry_that_held_it_not_the_listing():
    # the undo once went by the listing of a module's own (a buffer listed as a parameter was
    # put back into _parameters)
    model = _ListsABufferAsParameter()
    before = _tree(model)
    index = RuntimeIndex(model)
    assert index.aliases == {}  # (listed twice, one name: no alias of itself)
    model._buffers["scale"] = torch.zeros(1)  # (a new tensor under the name)
    assert index.replaced() == ["scale"]
    index.undo()
    assert _tree(model) == before and list(model._parameters) == ["weight"]


@pytest.mark.parametrize("change", ["a parameter moved into the buffers",
                                    "an alias moved into the buffers"])
def test_a_tensor_moved_to_the_other_registry_is_no_write_in_a_report(change):
    # (a rebind row of every element, none changed, where nothing was written)
    import patchkit

    model = _Changes(change)
    r = patchkit.inspect_load(model, [patchkit.CheckpointWeightPatch(
        "steps", (1,), torch.float32, torch.ones(1))])
    assert r.writes["op"].tolist() == ["aten::copy_"] and list(r.deltas.index) == ["steps"]


def _tree(model: torch.nn.Module) -> list:
    """What undo() must put back: every module object, and in each, its registries (the
    dict objects themselves), their keys in order with the object each holds, and its
    buffers left out of the state dict (the set object and its names)."""
    def reg(m, attr):  # (a loader may have deleted it: none)
        return vars(m).get(attr, {})

    return [
        (prefix, id(m), id(vars(m)), [id(vars(m).get(a)) for a in (
            "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")],
         [(k, id(v) if v is not None else None) for k, v in reg(m, "_parameters").items()],
         [(k, id(v) if v is not None else None) for k, v in reg(m, "_buffers").items()],
         [(k, id(v) if v is not None else None) for k, v in reg(m, "_modules").items()],
         sorted(vars(m).get("_non_persistent_buffers_set", ())),
         # (a plain attribute under a registered name shadows it)
         sorted(k for k in vars(m) if k in reg(m, "_parameters") or k in reg(m, "_buffers")
                or k in reg(m, "_modules")))
        for prefix, m in model.named_modules(remove_duplicate=False)
    ]


def _undo_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.emb = torch.nn.Linear(2, 2, bias=False)
    model.emb.register_buffer("mask", None)  # (an empty buffer slot)
    model.head = torch.nn.Linear(2, 2, bias=False)
    model.head.weight = model.emb.weight  # tied
    model.act = torch.nn.Identity()  # a submodule without tensors
    model.register_buffer("rope", torch.zeros(2), persistent=False)
    model.register_buffer("steps", torch.zeros(1))
    return model


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((2,), float("nan")))


def _holder(**tensors) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, t in tensors.items():
        setattr(m, k, t)
    return m


_CHANGES = {  # what a loader may do to the tree, and whether it adds a name
    "a tensorless submodule replaced by one with a tensor":
        (lambda m: setattr(m, "act", _holder(extra=_param())), True),
    "a submodule rewrapped with its tensor and a new one":
        (lambda m: setattr(m, "emb", _holder(weight=m.emb.weight, extra=_param())), True),
    "an empty slot deleted, a name added in its place":
        (lambda m: (delattr(m.emb, "bias"), setattr(m.emb, "scale", _param())), True),
    "an alias deleted, a name added in its place":
        (lambda m: (delattr(m.head, "weight"), setattr(m.head, "extra", _param())), True),
    "a submodule deleted": (lambda m: delattr(m, "head"), False),
    "a submodule replaced": (lambda m: setattr(m, "emb", torch.nn.Linear(2, 2)), True),
    "an empty slot deleted": (lambda m: delattr(m.emb, "bias"), False),
    "a buffer out of the state dict added":
        (lambda m: m.register_buffer("cache", torch.zeros(2), persistent=False), True),
    "a buffer out of the state dict registered anew in it":
        (lambda m: (delattr(m, "rope"), m.register_buffer("rope", torch.ones(2))), False),
    "a name deleted and registered again, last": (lambda m: m._buffers.update(
        rope=m._buffers.pop("rope")), False),
    # a registry dict replaced wholesale: every check compared the old dict's contents
    "a parameter registry replaced, a name in it anew":
        (lambda m: setattr(m.emb, "_parameters", {"weight": _param(), "bias": None}), False),
    "a parameter registry replaced, a name added":
        (lambda m: setattr(m.emb, "_parameters", {**m.emb._parameters, "extra": _param()}),
         True),
    "a buffer registry replaced, a name in it anew":
        (lambda m: setattr(m, "_buffers", {**m._buffers, "steps": torch.ones(1)}), False),
    "a submodule registry replaced, a submodule in it anew":
        (lambda m: setattr(m, "_modules", {**m._modules, "act": _holder(extra=_param())}), True),
    "a registry replaced by an equal one":
        (lambda m: setattr(m.head, "_parameters", dict(m.head._parameters)), False),
    "a registry deleted, a tensor under its name a plain attribute": (lambda m: (
        vars(m.emb).pop("_parameters"), vars(m.emb).update(weight=_param())), False),
    "a module's attributes replaced, with a registry of its own": (lambda m: setattr(
        m.emb, "__dict__", {**vars(m.emb), "_buffers": {"extra": _param()}}), True),
    "a parameter registry swapped for one without it, a buffer under its name":
        (lambda m: (setattr(m.emb, "_parameters", {"bias": None}),
                    m.emb.register_buffer("weight", torch.full((2, 2), float("nan")))), False),
    "a buffer under a parameter's name": (lambda m: m.emb._buffers.update(weight=_param()),
                                          False),
    "a parameter moved into the buffers":
        (lambda m: m.emb._buffers.update(weight=m.emb._parameters.pop("weight")), False),
    "an alias moved into the buffers":
        (lambda m: m.head._buffers.update(weight=m.head._parameters.pop("weight")), False),
    # what a second review found: a shadowing attribute, a module's attributes without
    # its state, a tensor beside a name in a registry of the same size, a dotted key
    "a plain attribute shadowing a registered name":
        (lambda m: vars(m.emb).update(weight=_param()), False),
    "a plain attribute shadowing a submodule":
        (lambda m: vars(m).update(emb=_holder(weight=_param())), False),
    "a module's attributes replaced by its registries alone": (lambda m: setattr(
        m.emb, "__dict__", {k: vars(m.emb)[k] for k in ("_parameters", "_buffers",
                                                        "_modules")}), False),
    "a buffer beside a parameter, an empty slot of the same registry deleted":
        (lambda m: (m.emb._buffers.pop("mask"), m.emb._buffers.update(weight=_param())), False),
    "a dotted key that spells a known name":
        (lambda m: m._parameters.update({"emb.weight": _param()}), False),
    "the set of buffers out of the state dict replaced":
        (lambda m: setattr(m, "_non_persistent_buffers_set", set()), False),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_undo_puts_the_tree_back_as_it_was(change):
    # undo missed names in a replaced submodule, in the room a deleted empty slot or
    # alias left, crashed on a deleted submodule (and left the rest undone), kept a
    # replaced submodule object, and lost empty slots, persistence and order
    model = _undo_model()
    before = _tree(model)
    index = RuntimeIndex(model)
    do, adds = _CHANGES[change]
    do(model)
    assert bool(index.added()) == adds
    assert _tree(model) != before
    assert index.undo()  # (it put something back)
    assert _tree(model) == before
    assert index.added() == [] and index.replaced() == [] and index.replaced_aliases() == []
    assert not index.undo()  # (nothing left to put back)


class _Changes(torch.nn.Module):
    """``_undo_model``'s tree; the loader copies ``steps`` and makes one of ``_CHANGES``,
    then raises at ``z`` (a later call)."""

    def __init__(self, change: str) -> None:
        super().__init__()
        for k, v in _undo_model()._modules.items():
            self.add_module(k, v)
        self.head.weight = self.emb.weight
        self.register_buffer("rope", torch.zeros(2), persistent=False)
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("z", torch.zeros(1))
        self.change = change

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            self.steps.copy_(w)
            _CHANGES[self.change][0](self)
        return {n for n, _ in weights}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_sparse_call_or_a_rollback_puts_the_tree_back(change):
    # the same cases end to end: a sparse call that makes them is refused, a failed
    # transactional load rolled back, and the tree is as it was either way
    import patchkit
    from patchkit.errors import ContractViolation

    model = _Changes(change)
    before = _tree(model)
    sparse = patchkit.CheckpointWeightPatch("steps", (1,), torch.float32, torch.ones(1),
                                            torch.tensor([0]))
    if change in ("an empty slot deleted", "a name deleted and registered again, last",
                  "the set of buffers out of the state dict replaced"):
        # (no tensor changed hands: nothing for a sparse call to refuse, nor to undo)
        patchkit.load_checkpoint_weight_patches(model, [sparse])
    else:
        said = ("moved" if "moved" in change else "shadows" if "shadowing" in change else
                "replaced a module's attributes" if "registries alone" in change else
                "replaced registry" if "registry" in change and "same registry" not in change
                else r"registered|removed")
        with pytest.raises(ContractViolation, match=said):
            patchkit.load_checkpoint_weight_patches(model, [sparse])
        assert _tree(model) == before
    model = _Changes(change)
    before = _tree(model)
    dense = [patchkit.CheckpointWeightPatch("steps", (1,), torch.float32, torch.ones(1)),
             patchkit.CheckpointWeightPatch("z", (1,), torch.float32, torch.ones(1))]
    with pytest.raises(RuntimeError, match="no z today"):
        patchkit.load_checkpoint_weight_patches(model, dense, transactional=True,
                                                max_chunk_bytes=4)
    assert _tree(model) == before and float(model.steps) == 0.0


@pytest.mark.parametrize("change", list(_CHANGES))
def test_the_index_says_unchanged_only_of_a_tree_its_closer_looks_find_as_it_was(change):
    # unchanged() spares a load the closer looks after each call: where it says so, they
    # must find nothing replaced, untied or added
    model = _undo_model()
    index = RuntimeIndex(model)
    assert index.unchanged()
    _CHANGES[change][0](model)
    if index.unchanged():
        assert index.replaced() == [] and index.replaced_aliases() == []
        assert index.added() == []
    index.undo()
    assert index.unchanged()


@pytest.mark.parametrize("name", [*_models(), "a parameter also a buffer", "its own walk"])
def test_the_index_knows_the_tied_parameters_canonicalize_tied_renames(name):
    # a load builds its index first and takes the tied names from it, so that the module
    # tree is walked once: the same renames and drops as canonicalize_tied's own walk
    from patchkit.loader import _canonicalized, canonicalize_tied
    from patchkit.patch import CheckpointWeightPatch

    if name == "a parameter also a buffer":  # (a buffer alias is no tied parameter)
        model = _Everything()
        model.register_buffer("shadow", model.embed.weight)
        model.extra = model.blocks[0].lin.weight
    elif name == "its own walk":
        model = _Hiding()
        model.again = model.kept
    else:
        model = _models()[name]
    patches = [CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.detach().reshape(-1))
               for n, t in named_tensors(model)]
    patches += patches[::-1]  # (an alias whose first name is sent too: dropped)

    def names(canonicalized):
        kept, positions = canonicalized
        return [p.name for p in kept], positions

    assert names(_canonicalized(patches, RuntimeIndex(model).tied_parameters, warn=False)) == (
        names(canonicalize_tied(model, patches, warn=False)))
    assert not name.startswith("a parameter") or "shadow" not in RuntimeIndex(
        model).tied_parameters


# -- what a watched load costs per call and per write (counted, not timed) --------------


def test_the_overlap_check_of_a_sparse_call_compares_a_write_with_its_neighbours_only(
        monkeypatch):
    # (each copy was compared with every earlier one into the tensor: 16 k row slices of
    # one tensor took 136 s)
    import patchkit
    import patchkit.intercept as pk_intercept

    class Slices(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.w = torch.nn.Parameter(torch.zeros(4 * k, 3), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                order = list(range(self.k))
                order = order[::2] + order[1::2]  # (not in storage order)
                for i in order:
                    self.w.data[4 * i:4 * i + 4].copy_(t[4 * i:4 * i + 4])
            return {"w"}

    compared = []
    real = pk_intercept.Region.overlaps

    def counted(self, other):
        compared.append(1)
        return real(self, other)

    monkeypatch.setattr(pk_intercept.Region, "overlaps", counted)
    k = 2000
    m = Slices(k)
    idx = torch.arange(0, 12 * k, 5)
    p = patchkit.CheckpointWeightPatch("w", (4 * k, 3), torch.float32,
                                       torch.ones(idx.numel()), idx)
    patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.view(-1)[idx].eq(1).all() and int(m.w.ne(0).sum()) == idx.numel()
    assert len(compared) <= 2 * k  # (was k * (k - 1) / 2)


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("how", ["sparse", "inspected"])
def test_a_loader_writing_by_columns_has_each_write_compared_with_few(monkeypatch, how,
                                                                      width):
    # (every column's extent meets every other's: each write was compared with every
    # earlier one, in the sparse call's overlap check, in the forgetting of measured
    # statistics and in the report's overlap sweep; 1000 columns took 4.5 s sparse)
    import patchkit
    import patchkit.intercept as pk_intercept

    class Columns(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(6, k), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                for j in range(0, t.shape[1], width):
                    self.w.data[:, j:j + width].copy_(t[:, j:j + width])
            return {"w"}

    compared = []
    for method in ("overlaps", "columns_apart"):
        real = getattr(pk_intercept.Region, method)
        monkeypatch.setattr(pk_intercept.Region, method,
                            lambda self, other, real=real: compared.append(1)
                            or real(self, other))
    k = 1200
    m = Columns(k)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(6 * k, generator=g)[:k].sort().values
    vals = torch.randn(k, generator=g)
    sparse = patchkit.CheckpointWeightPatch("w", (6, k), torch.float32, vals, idx)
    if how == "sparse":
        patchkit.load_checkpoint_weight_patches(m, [sparse])
    else:
        dense = torch.zeros(6 * k)
        dense[idx] = vals
        report = patchkit.inspect_load(
            m, [patchkit.CheckpointWeightPatch("w", (6, k), torch.float32, dense)])
        assert report.deltas.loc["w", "changed"] == int(vals.ne(0).sum())
        assert report.deltas.loc["w", "max_abs"] == pytest.approx(float(vals.abs().max()))
    assert torch.equal(m.w.view(-1)[idx], vals) and int(m.w.ne(0).sum()) == k
    assert len(compared) <= 4 * k  # (was about k * k / width ** 2)


def _random_views(rng, base, n):
    """``n`` views of ``base`` (64 x 16) of every kind a loader writes: row blocks,
    column slices, single columns, every k-th row, tiles, runs of the flat storage
    (aligned to rows or not), a transposed block, a view of another element size, and
    empty ones."""
    flat = base.view(-1)
    views = []
    for _ in range(n):
        kind = rng.choice(["rows", "cols", "col", "every k", "tile", "run", "row run",
                           "transposed", "other size", "empty"])
        if kind == "rows":
            a = rng.randrange(64)
            views.append(base[a:a + rng.randint(1, 8)])
        elif kind == "cols":
            a = rng.randrange(16)
            views.append(base[:, a:a + rng.randint(1, 4)])
        elif kind == "col":
            a, r = rng.randrange(16), rng.randrange(64)
            views.append(base[r:r + rng.randint(1, 64), a])
        elif kind == "every k":
            k = rng.randint(2, 4)
            views.append(base[rng.randrange(k)::k])
        elif kind == "tile":
            r, c = rng.randrange(0, 64, 8), rng.randrange(0, 16, 4)
            views.append(base[r:r + 8, c:c + 4])
        elif kind == "run":
            a = rng.randrange(1024)
            views.append(flat[a:a + rng.randint(1, 40)])
        elif kind == "row run":
            a = 16 * rng.randrange(64)
            views.append(flat[a:a + 16 * rng.randint(1, 3)])
        elif kind == "transposed":
            r, c = rng.randrange(60), rng.randrange(12)
            views.append(base[r:r + 4, c:c + 4].t())
        elif kind == "other size":
            a = rng.randrange(1024)
            views.append(flat.view(torch.int16)[2 * a + 1:2 * a + 1 + rng.randint(1, 9)])
        else:
            views.append(base[3:3])
    return views


def test_a_region_index_offers_every_region_that_meets_a_new_one():
    # (what the overlap checks rely on: a region the index leaves out is never compared)
    import random

    from patchkit._regions import _RegionIndex
    from patchkit.intercept import Region

    base = torch.zeros(64, 16)
    rng = random.Random(0)
    for _ in range(300):
        views = _random_views(rng, base, rng.randint(1, 16))
        index = _RegionIndex()
        kept: list = []
        for v in views:
            r = Region.of(v)
            a0, a1 = r.extent()
            brute = {id(e) for e in kept if r.overlaps(e)}
            offered = {id(e) for e in index.meeting(a0, a1, lambda r=r: r)}
            assert brute <= offered, (v.shape, v.stride(), v.storage_offset())
            assert len(offered) <= len(kept)
            index.add(r, a0, a1)
            if r.numel:
                kept.append(r)
            if kept and rng.random() < 0.2:  # (a measured region forgotten)
                gone = kept.pop(rng.randrange(len(kept)))
                index.discard(gone, gone.extent()[0])
            assert len(index) == len(kept)


def test_a_region_index_of_columns_offers_only_the_columns_a_region_meets():
    from patchkit._regions import _RegionIndex
    from patchkit.intercept import Region

    base = torch.zeros(8, 500)
    index = _RegionIndex()
    for j in range(0, 500, 2):
        r = Region.of(base[:, j])
        index.add(r, *r.extent())
    assert not index.apart  # (every column's extent meets every other's)
    r = Region.of(base[:, 301])
    assert index.meeting(*r.extent(), r) == []
    r = Region.of(base[3:, 300])
    assert [e.byte_offset // 4 for e in index.meeting(*r.extent(), r)] == [300]
    r = Region.of(base[2:5, 10:13])  # meets columns 10 and 12 only
    assert sorted(e.byte_offset // 4 for e in index.meeting(*r.extent(), r)) == [10, 12]
    r = Region.of(base.view(-1)[1000:1500])  # row 2: meets every column
    assert len(index.meeting(*r.extent(), r)) == 250


def test_a_call_that_rebinds_nothing_reads_no_storage_keys(monkeypatch):
    import patchkit._regions as regions
    import patchkit._runtime_index as runtime_index
    from patchkit.toymodels import PlainModel

    m = PlainModel({f"w{i}": (4,) for i in range(50)})
    index = runtime_index.RuntimeIndex(m)
    bindings = index.bindings()
    keys = []
    real = runtime_index._storage_key
    for module in (runtime_index, regions):  # (the index's own reads, and its helpers')
        monkeypatch.setattr(module, "_storage_key", lambda t: keys.append(1) or real(t))
    assert index.rebound(bindings) == [] and keys == []
    m.w7.data = torch.ones(4)  # rebound: found, by its key
    assert index.rebound(bindings) == ["w7"] and 0 < len(keys) <= 2


def test_a_watched_load_runs_with_the_cyclic_collector_off_and_puts_it_back():
    import gc

    import patchkit
    from patchkit.toymodels import PlainModel

    seen = []

    class Watch(PlainModel):
        def load_weights(self, weights):
            seen.append(gc.isenabled())
            return super().load_weights(weights)

    p = patchkit.CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(1),
                                       torch.tensor([2]))
    assert gc.isenabled()
    patchkit.load_checkpoint_weight_patches(Watch({"w": (4,)}), [p])  # sparse: watched
    dense = p._replace(values=torch.ones(4), indices=None)
    patchkit.load_checkpoint_weight_patches(Watch({"w": (4,)}), [dense], transactional=True)
    patchkit.load_checkpoint_weight_patches(Watch({"w": (4,)}), [dense])  # plain: not watched
    assert seen == [False, False, True] and gc.isenabled()


@pytest.mark.parametrize("kind", ["sparse", "transactional"])
def test_a_watched_load_lets_go_of_its_session_and_index_before_the_collector_resumes(
        kind, monkeypatch):
    # The collection that the collector's return sets off walks every young object still
    # alive: the load's session and index (thousands of objects on a model of many small
    # tensors) were, until the load's frame returned.
    import gc
    import weakref

    import patchkit
    import patchkit.intercept as pk_intercept
    from patchkit.toymodels import PlainModel

    made = []
    for cls in (pk_intercept.WriteSession, pk_intercept.RuntimeIndex):
        real_init = cls.__init__

        def init(self, *a, _real=real_init, **k):
            made.append(weakref.ref(self))
            _real(self, *a, **k)
        monkeypatch.setattr(cls, "__init__", init)
    alive_at_enable = []
    real_enable = gc.enable

    def enable():
        alive_at_enable.append([r() is not None for r in made])
        real_enable()
    monkeypatch.setattr(gc, "enable", enable)
    p = patchkit.CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(1),
                                       torch.tensor([2]))
    if kind == "transactional":
        p = p._replace(values=torch.ones(4), indices=None)
    assert gc.isenabled()
    patchkit.load_checkpoint_weight_patches(PlainModel({"w": (4,)}), [p],
                                            transactional=kind == "transactional")
    assert gc.isenabled() and len(made) == 2
    assert alive_at_enable == [[False, False]]


def test_a_sparse_load_reads_its_bindings_pointers_once_not_at_every_call(monkeypatch):
    # (after each call every runtime tensor's data pointer is read, to see a rebinding;
    # the pointers of the bindings it compares with do not move: read once per load)
    import patchkit
    import patchkit._runtime_index as runtime_index
    import patchkit.intercept as pk_intercept
    from patchkit.toymodels import PlainModel

    n, calls = 40, 10
    m = PlainModel({f"w{i}": (4,) for i in range(n)})
    ps = [patchkit.CheckpointWeightPatch(f"w{i}", (4,), torch.float32, torch.ones(1),
                                         torch.tensor([1])) for i in range(calls)]
    reads = []
    real = pk_intercept._DATA_PTR
    for module in (pk_intercept, runtime_index):  # (where it is read: the session, the index)
        monkeypatch.setattr(module, "_DATA_PTR", lambda t: reads.append(1) or real(t))
    patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=16)  # one call each
    assert all(m.get_parameter(f"w{i}")[1] == 1 for i in range(calls))
    assert len(reads) <= n * (calls + 1) + 4 * calls  # (was 2 n per call)


class _Flat(torch.nn.Module):
    """``n`` parameters that are views of one flat buffer: each its own 16 elements
    (``interleaved``: column slices of one (16, n) buffer, whose extents all meet)."""

    def __init__(self, n: int, interleaved: bool = False):
        super().__init__()
        flat = torch.zeros(16 * n)
        for i in range(n):
            view = flat.view(16, n)[:, i] if interleaved else flat[16 * i:16 * (i + 1)]
            self.register_parameter(f"w{i}", torch.nn.Parameter(view, requires_grad=False))


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_owners_of_a_shared_storage_are_found_as_a_scan_finds_them(interleaved):
    import random

    model = _Flat(40, interleaved)
    index = RuntimeIndex(model)
    key = _storage_key(model.w0)
    owners = index.sharing(key)
    assert len(owners) == 40
    rng = random.Random(0)
    for _ in range(300):
        a0 = rng.randrange(-8, 16 * 40 * 4 + 8)
        a1 = a0 + rng.choice([1, 2, 4, 64, 1000])
        assert index.overlapping(key, a0, a1) == [
            o for o in owners if a0 < o.end and o.start < a1]
    for i in range(40):  # each view is found to be its own tensor's
        name, _, offset = index.owner(getattr(model, f"w{i}")[3:])
        assert (name, offset) == (f"w{i}", 3)


def test_a_write_into_one_of_many_tensors_of_a_flat_buffer_scans_none_of_the_others():
    # every write looked through every tensor of its storage: a load of 10000 such
    # tensors, one patch each, took 5.1 s transactional and 10.2 s inspected
    model = _Flat(200)
    index = RuntimeIndex(model)
    key = _storage_key(model.w0)
    scans = []

    class Counted(list):
        def __iter__(self):
            scans.append(len(self))
            return super().__iter__()

    index.sharing(key)
    index._owners[key] = Counted(index._owners[key])
    for i in range(200):
        assert index.owner(getattr(model, f"w{i}"))[0] == f"w{i}"
    assert scans == []


def test_owner_of_views_beside_inside_and_across_runtime_tensors():
    # (owner() gave the storage's first runtime tensor, at a negative offset, for a view
    # in none; the first fix of that gave another tensor for a view of another element
    # size that starts inside one)
    m = torch.nn.Module()
    buf = torch.zeros(24)
    m.register_buffer("p0", buf[16:20])  # registered first
    m.register_buffer("p1", buf[:16].view(2, 8)[:, :4])  # elements 0-3 and 8-11
    index = RuntimeIndex(m)

    def owner(view):
        found = index.owner(view)
        return found and (found[0], found[2])

    assert owner(buf[1:3]) == ("p1", 1)
    assert owner(buf[16:18]) == ("p0", 0)
    assert owner(buf[4:8]) is None  # (the gap between p1's rows: scratch)
    assert owner(buf[20:24]) is None  # (after p0: scratch)
    assert owner(buf[12:16].view(2, 2)) is None
    assert owner(buf[5:10])[0] == "p1"  # (from the gap into p1's second row)
    # a view of half-words starting inside p1's element 1 (byte 6)
    assert owner(buf.view(torch.bfloat16)[3:40]) == ("p1", 1)


def test_owner_of_views_around_a_lone_runtime_tensor_of_a_larger_storage():
    # (mutation testing: a view that starts where the storage's one runtime tensor ends
    # could be taken for its, and one that starts before it and runs into it for scratch
    # space, with every test passing)
    m = torch.nn.Module()
    buf = torch.zeros(20)
    m.register_buffer("p", buf[5:15])  # the storage's only runtime tensor
    index = RuntimeIndex(m)

    def owner(view):
        found = index.owner(view)
        return found and (found[0], found[2])

    assert owner(buf[5:15]) == ("p", 0)
    assert owner(buf[14:15]) == ("p", 9)
    assert owner(buf[15:18]) is None  # (starts where p ends: scratch)
    assert owner(buf[0:5]) is None  # (ends where p starts: scratch)
    # starts before p and runs into it: p's, at the position its first element would have
    assert owner(buf[0:8]) == ("p", -5)


def test_owner_of_a_flat_buffer_registered_beside_views_of_it():
    # a write of the whole buffer (or of its second half) is the buffer's, not that of
    # the parameter at its start; a view that starts inside an element of one of them
    # is the tensor's whose element starts there (mutation testing: '<=' for '<' on the
    # last byte, and a byte inside an element taken for that element, passed every test)
    m = torch.nn.Module()
    flat = torch.zeros(12)
    m.a = torch.nn.Parameter(flat[:6], requires_grad=False)
    m.b = torch.nn.Parameter(flat[6:], requires_grad=False)
    m.register_buffer("flat", flat)
    index = RuntimeIndex(m)
    assert index.owner(flat)[0::2] == ("flat", 0)
    assert index.owner(flat[:6])[0::2] == ("a", 0)
    assert index.owner(flat[6:])[0::2] == ("b", 0)
    assert index.owner(flat[:8])[0::2] == ("flat", 0)

    raw = torch.zeros(16, dtype=torch.uint8)
    m = torch.nn.Module()
    m.register_buffer("f", raw.view(torch.float32))  # (bytes 0-15, as 4 float32)
    m.register_buffer("raw", raw)
    index = RuntimeIndex(m)
    assert index.owner(raw[4:8])[0::2] == ("f", 1)
    assert index.owner(raw[1:5])[0::2] == ("raw", 1)  # (inside f's element 0)


def test_names_added_leave_out_the_empty_tensors_the_index_left_out():
    # (mutation testing: the index's unindexed names counted as added passed every test)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.zeros(2))
    m.register_buffer("odd", torch.zeros(0, 3).to_sparse())  # (empty: not indexed)
    index = RuntimeIndex(m)
    assert "odd" not in index.tensors and index.added() == []
    m.extra = torch.nn.Parameter(torch.ones(2))
    assert index.added() == ["extra"]
    m.again = m.a  # (a new name for a tensor the index knows: a new tie)
    assert index.ties_among(index.added_tensors()) == {"again": "a"}


def test_what_a_loader_changed_past_the_registries_names_the_module():
    # (mutation testing: a message without the module's prefix, or naming the last of
    # several registries replaced, passed every test)
    model = _undo_model()
    index = RuntimeIndex(model)
    vars(model.emb).update(weight=_param())
    assert index.structure_changed() == (
        "set a plain attribute 'emb.weight' that shadows the registered one (e.g. "
        "`module.__dict__['weight'] = w`)")
    index.undo()
    assert index.structure_changed() is None
    model.head._parameters = dict(model.head._parameters)
    model.emb._buffers = {}
    assert index.swapped_registries() == ["emb._buffers", "head._parameters"]
    assert index.structure_changed().startswith("replaced registry 'emb._buffers' of the")


def test_a_plain_attribute_shadowing_a_name_of_the_root_module_is_found():
    # (the root's own registries come first in the index: dropping them from where it looks
    # for a shadowing attribute passed every test)
    model = _undo_model()
    model.w = torch.nn.Parameter(torch.ones(2))
    index = RuntimeIndex(model)
    vars(model).update(w=_param())
    assert index.structure_changed() == (
        "set a plain attribute 'w' that shadows the registered one (e.g. "
        "`module.__dict__['weight'] = w`)")
    index.undo()
    assert index.structure_changed() is None and model.w is model._parameters["w"]


class _Subclassed(torch.nn.Parameter):
    """A Parameter subclass that keeps its values in its own storage (as vLLM's do)."""


def _nested() -> torch.Tensor:
    with warnings.catch_warnings():  # (torch: nested tensors are a prototype)
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


class _Dispatching(torch.Tensor):
    """A subclass that answers ops itself (a wrapper that may hold no memory of its own)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Flattening(torch.Tensor):
    """A subclass that says its values live in inner tensors (``__tensor_flatten__``)."""

    def __tensor_flatten__(self):
        return [], None


def _column_models():
    """Trees for the two ways of building an index: (model, whether the columns take it).
    The columns take plain dicts only: on a torch whose modules keep their registries in
    OrderedDicts (2.4) they decline every tree, and the tensor at a time way builds it."""
    plain = MODULES_KEEP_DICTS

    def everything(change=None, shared=False):
        m = _Everything()
        if not shared:  # (else one block is listed under two parents)
            m.right.again = _Block()
        m.register_buffer("flat", torch.zeros(8))
        m.v1 = torch.nn.Parameter(m.flat[:4])  # (views of one storage, beside the buffer)
        m.v2 = torch.nn.Parameter(m.flat[4:])
        m.meta = torch.nn.Linear(2, 2, device="meta")
        if change is not None:
            change(m)
        return m

    def swap_registry(m, d):
        m.blocks[0].lin.__dict__["_parameters"] = d

    return {
        "every rule of the listing": (everything(shared=True), plain),
        "every rule but a module listed twice": (everything(), plain),
        "tiny llama, rank 0 of 2": (TinyLlamaRuntime(TinyLlamaConfig(), tp_rank=0, tp_size=2),
                                    plain),
        "tiny llama with experts": (TinyLlamaRuntime(
            TinyLlamaConfig(num_experts=4), tp_rank=1, tp_size=2), plain),
        "no tensors at all": (torch.nn.ReLU(), plain),
        "a Parameter subclass of its own storage": (everything(
            lambda m: setattr(m, "sub", _Subclassed(torch.ones(2)))), plain),
        "complex, not conjugated": (everything(
            lambda m: m.register_buffer("c", torch.ones(2, dtype=torch.cfloat))), plain),
        "one tensor as parameter and buffer of one name": (everything(
            lambda m: m._buffers.update(empty=m.empty)), plain),
        "two tensors under one name": (everything(
            lambda m: m._buffers.update(empty=torch.ones(1))), plain),
        "a dotted key beside the module it names": (everything(
            lambda m: m._parameters.update({"head.weight": torch.nn.Parameter(
                torch.ones(1))})), plain),
        "a tensor registered twice as a buffer": (everything(
            lambda m: m.register_buffer("again", m.flat)), plain),
        "one parameter registry in two modules": (everything(
            lambda m: m.right.norm.__dict__.update(_parameters=m.blocks[1].lin._parameters)),
            plain),
        # (the root's buffers in the head too: paired with the head's parameters, as the
        # last module listing them; no parameter registry is listed twice)
        "one buffer registry in two modules": (everything(
            lambda m: m.head.__dict__.update(_buffers=m._buffers)), plain),
        # (the columns decline these: the tensor at a time way builds them)
        "a conjugated view": (everything(
            lambda m: m.register_buffer("c", torch.ones(2, dtype=torch.cfloat).conj())), False),
        "a negated view": (everything(
            lambda m: m.register_buffer("n", torch._neg_view(torch.ones(2)))), False),
        "a lazy module": (everything(lambda m: setattr(m, "lazy", torch.nn.LazyLinear(2))),
                          False),
        "a sparse buffer": (everything(
            lambda m: m.register_buffer("sp", torch.ones(2).to_sparse())), False),
        "a nested buffer": (everything(lambda m: m.register_buffer("nt", _nested())), False),
        "a subclass that dispatches ops itself": (everything(lambda m: m.register_buffer(
            "d", torch.Tensor._make_subclass(_Dispatching, torch.ones(2)))), False),
        "a subclass that flattens into inner tensors": (everything(lambda m: m.register_buffer(
            "f", torch.Tensor._make_subclass(_Flattening, torch.ones(2)))), False),
        "a registry that is an OrderedDict": (everything(
            lambda m: swap_registry(m, __import__("collections").OrderedDict(
                m.blocks[0].lin._parameters))), False),
    }


def _same(x, y, top=False):
    """Equal containers holding the same objects: the index's own dicts, lists and sets
    (``top``) by their contents, everything they hold that is not a string, number or
    container of those by identity (a registry dict, a module's attributes, a tensor)."""
    if isinstance(x, (str, int, float, bool, type(None))):
        return type(x) is type(y) and x == y
    if type(x) is not type(y):
        return False
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if top and isinstance(x, dict):
        return list(x) == list(y) and all(_same(x[k], y[k]) for k in x)
    if top and isinstance(x, set):
        return x == y
    return x is y


@pytest.mark.parametrize("name", list(_column_models()))
def test_both_ways_build_the_same_index(name, monkeypatch):
    # the columns (``_index_plain``) are the tensor at a time way (``_index_listed``) done
    # with C loops: every attribute equal, item for item, lazy ones included; where they
    # decline a tree, they set nothing
    import patchkit._runtime_index as runtime_index

    model, taken = _column_models()[name]
    built = {}
    for way, start in (("columns", 0), ("one tensor at a time", sys.maxsize)):
        monkeypatch.setattr(runtime_index, "_COLUMNS_FROM", start)
        index = built[way] = RuntimeIndex(model)
        for lazy in ("_shadow_places", "_columns", "tied_names"):
            getattr(index, lazy)
    columns, listed = built["columns"], built["one tensor at a time"]
    assert vars(columns).keys() == vars(listed).keys()
    for attr, value in vars(listed).items():
        if attr == "_persistence":  # (the set of each module, and a copy of it)
            assert _same([(m, now) for m, now, _ in vars(columns)[attr]],
                         [(m, now) for m, now, _ in value])
            assert [then for *_, then in vars(columns)[attr]] == [then for *_, then in value]
            continue
        assert _same(vars(columns)[attr], value, top=True), attr
    # (where a plain attribute would shadow a name: as the registries say, unchanged since)
    shadows = [(a, k) for a, d in zip(listed._registry_places[0], listed._registries)
               for k in d]
    assert _same(listed._shadow_places, tuple(zip(*shadows)) or ((), ()))
    mods = runtime_index._module_tree(model)
    bare = RuntimeIndex.__new__(RuntimeIndex)
    assert bare._index_plain(mods) is taken
    assert taken or vars(bare) == {}


def test_an_entry_that_is_not_a_tensor_is_refused_by_name_either_way():
    # (the columns decline a registry holding something else; the old way names it)
    from patchkit.errors import PatchTypeError

    model = _undo_model()
    model.emb._parameters["junk"] = "not a tensor"
    with pytest.raises(PatchTypeError, match=r"parameter 'emb\.junk' is a str, not a tensor"):
        RuntimeIndex(model)


def test_a_module_without_its_set_of_non_persistent_buffers_raises_as_torch_does():
    # (nn.Module keeps the set in its attributes; the columns decline a module without it,
    # and reading it raises torch's AttributeError, not a TypeError of the columns)
    model = _undo_model()
    del model.emb.__dict__["_non_persistent_buffers_set"]
    with pytest.raises(AttributeError, match="_non_persistent_buffers_set"):
        RuntimeIndex(model)


def test_the_walk_lists_no_children_of_a_module_whose_modules_are_not_a_dict():
    import patchkit._runtime_index as runtime_index

    model = _undo_model()
    model.emb.__dict__["_modules"] = [torch.nn.Linear(1, 1)]  # (not a dict, not empty)
    listed = runtime_index._module_tree(model)
    assert [p for p, _ in listed] == ["", "emb", "head", "act"]
    assert listed[1][1] is model.emb


def test_a_name_deleted_and_set_as_a_plain_attribute_is_found_and_undone():
    # (where a shadowing attribute may stand is worked out when a check first asks, after
    # the loader's call: from the registries as the index found them, not as they are)
    model = _undo_model()
    index = RuntimeIndex(model)
    w = model.emb.weight
    del model.emb._parameters["weight"]
    vars(model.emb).update(weight=_param())
    assert index.structure_changed() == (
        "set a plain attribute 'emb.weight' that shadows the registered one (e.g. "
        "`module.__dict__['weight'] = w`)")
    assert index.undo()
    assert "weight" not in vars(model.emb) and model.emb.weight is w
    assert index.structure_changed() is None and index.unchanged()
