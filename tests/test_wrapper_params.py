"""Runtime tensors that are wrapper subclasses (a quantized weight, a DTensor): their
values live in inner tensors that a load's interception does not see. Loads that must see
their writes (sparse, transactional, inspected) are refused before anything is written;
a plain dense load goes through; the compiled path never touches their (absent) memory."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import patchkit
from patchkit import CheckpointWeightPatch, ContractViolation, inspect_load, native

aten = torch.ops.aten


class Int8Bare(torch.Tensor):
    """A float32 tensor stored as int8 values and one scale (as a quantized weight is),
    with no ``__tensor_flatten__``: it dispatches its ops itself, and has no memory."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32,
                                                   device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale):
        self.qdata, self.scale = qdata, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and isinstance(args[0], Int8Bare):
            dst, src = args
            src = src.qdata.float() * src.scale if isinstance(src, Int8Bare) else src
            dst.qdata.copy_((src / dst.scale).round().clamp(-128, 127).to(torch.int8))
            return dst
        if func in (aten.detach.default, aten.alias.default):
            return type(args[0])(args[0].qdata, args[0].scale)

        def plain(t):
            return t.qdata.float() * t.scale if isinstance(t, Int8Bare) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


class Int8W(Int8Bare):
    """:class:`Int8Bare`, traceable (``__tensor_flatten__``, as a DTensor is)."""

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return Int8W(inner["qdata"], inner["scale"])


class Quantized(nn.Module):
    def __init__(self, wrapper=Int8W, device="cpu"):
        super().__init__()
        self.w = nn.Parameter(wrapper(torch.arange(16, dtype=torch.int8, device=device).view(4, 4),
                                      torch.tensor(0.5, device=device)), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            getattr(self, name).data.copy_(w)
        return {name for name, _ in weights}

    def state(self):
        return self.w.qdata.clone(), self.b.detach().clone()


DENSE_W = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.full((16,), 2.0))
SPARSE_B = CheckpointWeightPatch("b", (4,), torch.float32, torch.tensor([1.0]),
                                 torch.tensor([2]))


def _watched_load(how: str, model, *, sparse, dense, sparse_inspected: bool = False):
    """A load that must see its writes (``how``): sparse, transactional, inspected (of
    the sparse patch with ``sparse_inspected``), or inspected through an observed loader."""
    if how == "sparse":
        return patchkit.load_checkpoint_weight_patches(model, [sparse])
    if how == "transactional":
        return patchkit.load_checkpoint_weight_patches(model, [dense], transactional=True)
    if how == "inspect":
        return inspect_load(model, [sparse if sparse_inspected else dense])
    return inspect_load(model, [dense], loader=patchkit.load_checkpoint_weight_patches)


@pytest.mark.parametrize("wrapper", [Int8W, Int8Bare], ids=["traceable", "bare"])
@pytest.mark.parametrize("how", ["sparse", "transactional", "inspect", "inspect observed"])
def test_a_load_that_must_see_its_writes_is_refused_before_writing(how, wrapper):
    model = Quantized(wrapper)
    before = model.state()
    with pytest.raises(ContractViolation) as e:
        _watched_load(how, model, sparse=SPARSE_B, dense=DENSE_W)
    assert e.value.reason == "tensor subclass" and e.value.value == "w"
    assert ("refused before anything is written: runtime tensor 'w' is a "
            f"{wrapper.__name__}") in str(e.value)
    after = model.state()
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_a_plain_dense_load_goes_through():
    model = Quantized()
    patchkit.load_checkpoint_weight_patches(model, [DENSE_W])
    assert model.w.qdata.tolist() == [[4] * 4] * 4  # 2.0 at a scale of 0.5


def test_the_compiled_path_leaves_a_tensor_with_no_memory_of_its_own_to_torch():
    dest = Quantized().w
    assert dest.data_ptr() == 0
    assert native._prepare(dest, torch.ones(4, 4)) is None
    assert native._prepare(torch.zeros(4, 4), dest) is None  # (nor as the source)
    assert native.compare_copy(torch.zeros(4, 4), dest, torch.float32) is None
    if native._library() is not None:  # (and a plain one of the same shape goes to C)
        assert native._prepare(torch.zeros(4, 4), torch.ones(4, 4)) is not None


def test_parameter_subclasses_with_their_own_storage_are_not_refused():
    # (vLLM's parameters are nn.Parameter subclasses carrying a weight_loader: plain memory)
    class ModelWeightParameter(nn.Parameter):
        pass

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = ModelWeightParameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
            return {"w"}

    m = M()
    patchkit.load_checkpoint_weight_patches(m, [CheckpointWeightPatch(
        "w", (4,), torch.float32, torch.tensor([3.0]), torch.tensor([1]))])
    assert m.w.tolist() == [0.0, 3.0, 0.0, 0.0]
    r = inspect_load(m, [CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4))])
    assert r.deltas.loc["w", "changed"] == 4  # (all four: 3.0 too)


def test_a_dry_run_of_a_model_holding_a_traceable_wrapper_is_refused_too():
    # (on the meta device nothing holds values, but a write into the wrapper's inner
    # tensors would still be missing from the report: refused, not shown incomplete)
    model = Quantized(Int8W, device="meta")
    b = CheckpointWeightPatch("b", (4,), torch.float32, torch.empty(4, device="meta"))
    with pytest.raises(ContractViolation, match="runtime tensor 'w' is a Int8W"):
        inspect_load(model, [b])


class HoldsStorageless(nn.Module):
    """A plain weight ``a`` that loads take, beside a runtime tensor ``odd`` with no strided
    memory of its own that no load touches."""

    def __init__(self, kind: str):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        if kind == "uninitialized parameter":
            self.odd = nn.UninitializedParameter(requires_grad=False)
        elif kind == "uninitialized buffer":
            # (registered by name: torch before 2.5 keeps one assigned as a plain attribute)
            self.register_buffer("odd", nn.UninitializedBuffer())
        elif kind == "sparse_coo":
            self.register_buffer("odd", torch.eye(3).to_sparse())
        else:
            with warnings.catch_warnings():  # (torch's "beta" and "prototype" notices)
                warnings.simplefilter("ignore", UserWarning)
                self.register_buffer("odd", {
                    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
                    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
                    "jagged": lambda: torch.nested.nested_tensor(
                        [torch.ones(2), torch.ones(3)], layout=torch.jagged),
                }[kind]())

    def load_weights(self, weights):
        for name, w in weights:
            getattr(self, name).data.copy_(w)
        return {name for name, _ in weights}


STORAGELESS = {
    "uninitialized parameter": "an UninitializedParameter (a lazy module's tensor",
    "uninitialized buffer": "an UninitializedBuffer (a lazy module's tensor",
    "sparse_coo": "a tensor of layout sparse_coo",
    "sparse_csr": "a tensor of layout sparse_csr",
    "nested": "a nested tensor",
    "jagged": "a nested tensor",
}
DENSE_A = CheckpointWeightPatch("a", (4, 4), torch.float32, torch.arange(16.0))
SPARSE_A = CheckpointWeightPatch("a", (4, 4), torch.float32, torch.tensor([7.0]),
                                 torch.tensor([3]))


@pytest.mark.parametrize("kind", list(STORAGELESS))
@pytest.mark.parametrize("how", ["sparse", "transactional", "inspect", "inspect observed"])
def test_a_runtime_tensor_without_strided_memory_refuses_a_watched_load_by_name(how, kind):
    # (these raised torch's own ValueError or RuntimeError from inside patchkit; a nested
    # buffer let an inspected load write, then failed building its report)
    model = HoldsStorageless(kind)
    with pytest.raises(ContractViolation) as e:
        _watched_load(how, model, sparse=SPARSE_A, dense=DENSE_A, sparse_inspected=True)
    assert (e.value.reason, e.value.value) == ("no strided memory", "odd")
    assert (f"before anything is written: runtime tensor 'odd' is {STORAGELESS[kind]}"
            in str(e.value))
    assert "patchkit saves, NaN-merges and restores strided memory only" in str(e.value)
    assert torch.equal(model.a, torch.zeros(4, 4))


@pytest.mark.parametrize("kind", list(STORAGELESS))
def test_a_runtime_tensor_without_strided_memory_lets_a_plain_dense_load_through(kind):
    model = HoldsStorageless(kind)
    patchkit.load_checkpoint_weight_patches(model, [DENSE_A])
    assert torch.equal(model.a.flatten(), torch.arange(16.0))
    report = inspect_load(model, [])  # (nothing loaded: a report of the model all the same)
    assert report.writes.empty and "odd" not in report.deltas.index
    assert list(report.targets) == ["a"]
    with pytest.raises(KeyError, match=f"'odd' is {STORAGELESS[kind][:12]}.*no report holds"):
        report.after("odd")


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_an_empty_runtime_tensor_without_strided_memory_refuses_nothing(layout):
    # (an empty one holds nothing to write, as an empty strided tensor, which loads skip)
    model = HoldsStorageless("uninitialized buffer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.odd = {
            "sparse_coo": lambda: torch.zeros(0, 3).to_sparse(),
            "sparse_csr": lambda: torch.zeros(0, 3).to_sparse_csr(),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(0), torch.ones(0)]),
        }[layout]()
    assert model.odd.numel() == 0
    patchkit.load_checkpoint_weight_patches(model, [SPARSE_A])
    patchkit.load_checkpoint_weight_patches(model, [DENSE_A], transactional=True)
    assert torch.equal(model.a.flatten(), torch.arange(16.0))
    report = inspect_load(model, [SPARSE_A])
    assert report.deltas["changed"].to_dict() == {"a": 1}


class Dispatching(torch.Tensor):
    """A subclass that dispatches its ops itself but keeps its values in its own
    storage, as a plain tensor does (building an index runs none of its ops)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} reached a tensor no op should reach here")


def test_a_subclass_that_dispatches_its_ops_is_a_wrapper_only_without_memory_of_its_own():
    # (mutation testing: every such subclass taken for a wrapper, and one on the meta
    # device, whose data pointer reads 0 too, taken for one without memory, passed every
    # test)
    from patchkit.intercept import RuntimeIndex

    def holding(t):
        m = nn.Module()
        m.register_buffer("w", t)
        return RuntimeIndex(m).wrappers

    assert holding(torch.Tensor._make_subclass(Dispatching, torch.zeros(4))) == []
    assert holding(torch.Tensor._make_subclass(Dispatching, torch.empty(4, device="meta"))) == []
    assert holding(Int8Bare(torch.zeros(2, 2, dtype=torch.int8), torch.tensor(1.0))) == ["w"]


def test_a_refusal_names_the_first_such_tensor_and_counts_the_others():
    # (mutation testing: a count from the third such tensor on, or the last one named as
    # the error's value, passed every test)
    model = Quantized(Int8Bare)
    model.v = nn.Parameter(Int8Bare(torch.zeros(2, 2, dtype=torch.int8), torch.tensor(1.0)),
                           requires_grad=False)
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(model, [SPARSE_B])
    assert (e.value.reason, e.value.value) == ("tensor subclass", "w")
    assert "runtime tensor 'w' (and 1 more) is a Int8Bare" in str(e.value)
