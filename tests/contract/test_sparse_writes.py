"""CONTRACT §4: what a sparse (NaN-masked) ``load_weights`` call may write, and how.

A same-shaped floating-point ``copy_`` into a runtime tensor keeps the runtime value
wherever the (cast) source is NaN; everything else that writes runtime storage is
rejected before it writes.
"""

from __future__ import annotations

import math

import pytest
import torch

from ._models import (
    RecordingModel,
    SinkModel,
    TensorParallelModel,
    assert_untouched,
    same_bits,
    snapshot,
)


def start() -> torch.Tensor:
    return torch.arange(12.0).reshape(3, 4) + 100


def merged(indices, values) -> torch.Tensor:
    out = start().reshape(-1)
    out[list(indices)] = torch.tensor(values)
    return out.reshape(3, 4)


IDX, VALS = [0, 5, 6, 11], [-1.0, -2.0, -3.0, -4.0]


# -- NaN merging ------------------------------------------------------------------------------


# A slice assignment (``param.data[:] = w``) copies at the ATen level without calling
# ``Tensor.copy_``: patchkit merges it as the copy it is; a loader that watches only
# Python's ``Tensor.copy_`` (vLLM's) writes the NaN into the model. CONTRACT §4 speaks of
# ``copy_`` only, so those cases are patchkit's (README: where patchkit and vLLM differ).
@pytest.mark.parametrize("via", ["copy_", "data",
                                 pytest.param("slice", marks=pytest.mark.patchkit_only)])
def test_sparse_copy_keeps_runtime_values_where_staged_is_nan(load, mk, via):
    m = RecordingModel({"w": start()}, via=via)
    assert load(m, [mk.sparse("w", (3, 4), IDX, VALS)]) == {"w"}
    assert same_bits(m.w.detach(), merged(IDX, VALS))


def test_sparse_copy_into_a_float_buffer_is_merged(load, mk):
    m = RecordingModel({"w": start()}, buffers=["w"])
    load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w, merged(IDX, VALS))


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda p, w: torch.Tensor.copy_(p.data, w), id="Tensor.copy_"),
        pytest.param(lambda p, w: p.data.view(-1).copy_(w.reshape(-1)), id="flat view"),
        pytest.param(lambda p, w: p.data.t().copy_(w.t()), id="transposed views"),
        pytest.param(lambda p, w: p.detach().copy_(w), id="detach"),
        pytest.param(
            lambda p, w: [p.data[r].copy_(w[r]) for r in range(3)], id="row by row"
        ),
        pytest.param(
            lambda p, w: (p.data[:, :2].copy_(w[:, :2]), p.data[:, 2:].copy_(w[:, 2:])),
            id="column blocks",
        ),
        pytest.param(
            lambda p, w: (
                p.data.view(-1)[0::2].copy_(w.reshape(-1)[0::2]),
                p.data.view(-1)[1::2].copy_(w.reshape(-1)[1::2]),
            ),
            id="interleaved strided views",
        ),
        pytest.param(lambda p, w: p.copy_(w, non_blocking=True), id="non_blocking"),
    ],
)
def test_every_way_of_copying_into_runtime_storage_is_merged(load, mk, write):
    class Writer(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                write(self.w, w)
            return {"w"}

    m = Writer({"w": start()})
    load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w.detach(), merged(IDX, VALS))


@pytest.mark.patchkit_only  # (see test_sparse_copy_keeps_runtime_values_where_staged_is_nan)
def test_slice_assignment_is_merged_and_leaves_the_rest(load, mk):
    class TopRows(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.w.data[0:2] = w[0:2]
            return {"w"}

    m = TopRows({"w": start()})
    load(m, [mk.sparse("w", (3, 4), IDX, VALS)])  # index 11 is in row 2: not copied
    assert same_bits(m.w.detach(), merged(IDX[:3], VALS[:3]))


@pytest.mark.parametrize("scratch_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_loader_going_through_a_scratch_buffer_is_merged(load, mk, scratch_dtype):
    scratches = []

    class ViaScratch(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                buf = torch.empty(w.shape, dtype=scratch_dtype)
                buf.copy_(w)  # not runtime storage: an ordinary copy, NaNs included
                scratches.append(buf)
                self.w.copy_(buf)
            return {"w"}

    m = ViaScratch({"w": start()})
    load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w.detach(), merged(IDX, VALS))
    [buf] = scratches
    flat = buf.reshape(-1)
    assert torch.isnan(flat).sum() == 12 - len(IDX)
    assert flat[IDX].tolist() == VALS


def test_loader_going_through_clone_and_to_is_merged(load, mk):
    class ViaDerived(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.w.copy_(w.to(torch.float64).clone().contiguous())
            return {"w"}

    m = ViaDerived({"w": start()})
    load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w.detach(), merged(IDX, VALS))


# -- tensor parallel and packed parameters ------------------------------------------------------


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = TensorParallelModel.checkpoint_shapes()
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _build(rank: int, tp: int, ckpt: dict[str, torch.Tensor]) -> TensorParallelModel:
    m = TensorParallelModel(rank, tp)
    with torch.no_grad():
        m.load_weights(list(ckpt.items()))
    m.calls.clear()
    return m


@pytest.mark.parametrize("budget", [512 << 20, 1], ids=["one call", "one call per patch"])
@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_tensor_parallel_and_packed_loaders_land_patches_in_runtime_coordinates(
    load, mk, kind, rank, tp, budget
):
    ckpt = _checkpoint(0)
    model = _build(rank, tp, ckpt)
    before = snapshot(model)
    g = torch.Generator().manual_seed(1)
    new = {n: t.clone() for n, t in ckpt.items()}
    patches = []
    for name, full in ckpt.items():
        n = full.numel()
        if kind == "dense":
            new[name] = torch.randn(full.shape, generator=g)
            patches.append(mk.dense(name, new[name]))
        else:
            idx = torch.randperm(n, generator=g)[: max(1, n // 3)]
            vals = torch.randn(idx.numel(), generator=g)
            new[name].view(-1)[idx] = vals
            patches.append(mk.sparse(name, full.shape, idx, vals))
    returned = load(model, patches, max_chunk_bytes=budget)
    assert returned == {
        "attn.qkv_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "norm.weight"
    }
    expected = _build(rank, tp, new)
    for name, p in expected.named_parameters():
        assert same_bits(model.get_parameter(name), p), name
        assert not same_bits(before[name], p), f"{name}: the patches changed nothing here"
    assert sum(map(len, model.calls)) == len(patches)


@pytest.mark.parametrize("rank", [0, 1])
def test_patch_on_another_ranks_rows_leaves_this_rank_untouched(load, mk, rank):
    model = _build(rank, 2, _checkpoint(0))
    before = snapshot(model)
    other = 1 - rank
    # up_proj (6, 4): the other rank owns rows 3*other .. 3*other+2; down_proj (4, 6): its
    # columns 3*other .. 3*other+2; q_proj (4, 4): its rows 2*other, 2*other+1.
    patches = [
        mk.sparse("mlp.up_proj.weight", (6, 4), [4 * 3 * other + 1], [9.0]),
        mk.sparse("mlp.down_proj.weight", (4, 6), [6 * 2 + 3 * other + 2], [9.0]),
        mk.sparse("attn.q_proj.weight", (4, 4), [4 * 2 * other + 3], [9.0]),
    ]
    load(model, patches)
    assert_untouched(model, before)


def test_packed_shards_land_in_their_slices(load, mk):
    model = _build(0, 1, _checkpoint(0))
    before = model.attn.qkv_proj.weight.detach().clone()
    patches = [
        mk.sparse("attn.q_proj.weight", (4, 4), [0], [1.0]),
        mk.sparse("attn.k_proj.weight", (2, 4), [5], [2.0]),
        mk.sparse("attn.v_proj.weight", (2, 4), [7], [3.0]),
    ]
    load(model, patches)
    expected = before.clone()
    expected[0, 0], expected[4 + 1, 1], expected[6 + 1, 3] = 1.0, 2.0, 3.0
    assert same_bits(model.attn.qkv_proj.weight.detach(), expected)


# -- copies the contract rejects ------------------------------------------------------------------


class OneWrite(RecordingModel):
    """Copies ``a`` normally, then does ``write(b, staged)`` for the patch named ``b``."""

    def __init__(self, write, **kwargs):
        super().__init__({"a": start(), "b": start() - 50}, **kwargs)
        self.write = write

    def load_weights(self, weights):
        for name, w in weights:
            if name == "a":
                self.a.copy_(w)
            else:
                self.write(self, w)
        return {n for n, _ in weights}


def _rejected(load, mk, write, match, *, names="ab", **kwargs):
    m = OneWrite(write)
    m.register_buffer("counts", torch.zeros(3, 4, dtype=torch.int32))
    before = snapshot(m)
    patches = [mk.sparse(n, (3, 4), IDX, VALS) for n in names]
    with pytest.raises(NotImplementedError, match=match) as excinfo:
        load(m, patches, **kwargs)
    after = snapshot(m)
    if "a" in names:  # written before the rejected op, in the same call: it stays
        assert same_bits(after["a"], merged(IDX, VALS))
    assert same_bits(after["b"], before["b"]), "the rejected op wrote into b"
    assert same_bits(after["counts"], before["counts"])
    return excinfo.value


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda m, w: m.b.copy_(w[0]), id="broadcast row"),
        pytest.param(lambda m, w: m.b.copy_(w[0:1]), id="broadcast (1, 4)"),
        pytest.param(lambda m, w: m.b.data[0:2].copy_(w[0]), id="broadcast into slice"),
        pytest.param(lambda m, w: m.b.copy_(w[0, 0]), id="broadcast scalar"),
        pytest.param(lambda m, w: m.counts.copy_(w), id="integer destination"),
        pytest.param(lambda m, w: m.b.copy_(torch.ones(3, 4, dtype=torch.int64)), id="int source"),
        pytest.param(lambda m, w: m.b.copy_(torch.ones(3, 4, dtype=torch.bool)), id="bool source"),
    ],
)
def test_copy_that_is_not_same_shaped_floating_point_is_rejected_before_writing(load, mk, write):
    _rejected(load, mk, write, "same-shaped floating-point")


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("write", "op"),
    [
        pytest.param(lambda m, w: m.b.fill_(1.0), "fill_", id="fill_"),
        pytest.param(lambda m, w: m.b.data.zero_(), "zero_", id="zero_"),
        pytest.param(lambda m, w: m.b.add_(w), "add_", id="add_"),
        pytest.param(lambda m, w: m.b.mul_(2.0), "mul_", id="mul_"),
        pytest.param(lambda m, w: m.b.clamp_(0, 1), "clamp_", id="clamp_"),
        pytest.param(
            lambda m, w: m.b.index_put_((torch.tensor([0, 2]),), w[[0, 2]]),
            "index_put_",
            id="index_put_",
        ),
        pytest.param(
            lambda m, w: m.b.data.__setitem__(torch.tensor([0, 2]), w[[0, 2]]),
            "index_put_",
            id="advanced-index setitem",
        ),
        pytest.param(
            lambda m, w: m.b.data.__setitem__(~torch.isnan(w), w[~torch.isnan(w)]),
            "index_put_",
            id="boolean-mask setitem",
        ),
        pytest.param(lambda m, w: m.b.data.__setitem__(0, 5.0), "fill_", id="scalar setitem"),
        pytest.param(
            lambda m, w: m.b.data.index_copy_(0, torch.tensor([1]), w[1:2]),
            "index_copy_",
            id="index_copy_",
        ),
        pytest.param(lambda m, w: torch.add(w, 1.0, out=m.b.data), "add", id="out= add"),
        pytest.param(
            lambda m, w: torch.nan_to_num(w, out=m.b.data), "nan_to_num", id="out= nan_to_num"
        ),
        pytest.param(
            lambda m, w: torch.where(w.isnan(), m.b, w, out=m.b.data), "where", id="out= where"
        ),
    ],
)
def test_other_in_place_writes_are_rejected_naming_the_op(load, mk, write, op):
    err = _rejected(load, mk, write, op)
    assert not isinstance(err, ValueError)
    # (the attributes name it too: the ATen op, with its overload)
    assert err.reason == "unsupported op" and err.value.startswith(f"aten::{op}")


@pytest.mark.patchkit_only
def test_rejected_op_as_first_write_of_the_call_writes_nothing(load, mk):
    _rejected(load, mk, lambda m, w: m.b.fill_(0.0), "fill_", names="b")


# A staged tensor read as another dtype (``w.view(torch.float64)``) no longer holds NaN
# where the patch means "keep": two float32 NaN read as one float64 are a number, a
# float16 NaN read as bfloat16 is one too. Copied into a view of the runtime tensor of
# that dtype, the merge would write those "numbers", the staged NaN bits, into the model.
@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("dtype", "as_dtype"),
    [
        (torch.float32, torch.float64),
        (torch.float16, torch.float32),
        (torch.float16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
@pytest.mark.parametrize("route", ["view", "scratch copy"])
def test_a_copy_from_the_staged_tensor_read_as_another_dtype_is_refused_before_writing(
    load, mk, dtype, as_dtype, route
):
    class Reinterprets(RecordingModel):
        def load_weights(self, weights):
            for name, w in weights:
                if route == "scratch copy":  # (a copy of the staged bits, read otherwise)
                    w = torch.empty_like(w).copy_(w)
                getattr(self, name).view(as_dtype).copy_(w.view(as_dtype))
            return {n for n, _ in weights}

    m = Reinterprets({"w": (start() + 0.3).to(dtype)})
    before = snapshot(m)
    with pytest.raises(NotImplementedError, match="another dtype") as excinfo:
        load(m, [mk.sparse("w", (3, 4), IDX, VALS, dtype)])
    assert (excinfo.value.position, excinfo.value.name) == (0, "w")
    assert_untouched(m, before)


# What the strict checks' errors name: the patch a refused op served, where it is known.
UNTRACED = [
    pytest.param(lambda m, w: m.b.data.zero_(), "zero_", id="zero_"),
    pytest.param(lambda m, w: m.b.mul_(2.0), "mul_", id="mul_"),
    pytest.param(lambda m, w: m.b.copy_(torch.ones(4)), "same-shaped floating-point",
                 id="broadcast copy of a new tensor"),
]


@pytest.mark.patchkit_only
@pytest.mark.parametrize(("write", "match"), UNTRACED)
def test_a_refused_op_with_no_patch_as_source_names_no_patch_of_a_call_of_several(
    load, mk, write, match
):
    # Patch 0 ('a') was copied earlier in the call, then the op on 'b' was refused: that
    # the call last read patch 0 says nothing about which patch the op served.
    err = _rejected(load, mk, write, match)
    assert (err.position, err.name) == (None, None)
    assert "load_weights (call 0, runtime tensor 'b')" in str(err)
    assert "no patch as its source" in str(err)
    assert "2 patches (patch 0 ('a'), patch 1 ('b'))" in str(err)


@pytest.mark.patchkit_only
def test_a_refused_op_after_a_copy_into_its_tensor_tells_that_copy_but_names_no_patch(load, mk):
    # A padded embedding copies its rows, then fills the padding: the fill came after a
    # copy of patch 1 into 'b', but a packed tensor filled before its next patch's copy
    # looks the same, so the error states the copy and blames no patch.
    def copy_then_fill(m, w):
        m.b.data[:2].copy_(w[:2])
        m.b.data[2:].fill_(0.0)

    m = OneWrite(copy_then_fill)
    with pytest.raises(NotImplementedError, match="fill_") as excinfo:
        load(m, [mk.sparse(n, (3, 4), IDX, VALS) for n in "ab"])
    err = excinfo.value
    assert (err.position, err.name) == (None, None)
    assert "no patch as its source" in str(err)
    assert "the call last copied patch 1 ('b') into runtime tensor 'b'" in str(err)


@pytest.mark.patchkit_only
@pytest.mark.parametrize(("write", "match"), UNTRACED)
def test_a_refused_op_with_no_patch_as_source_names_the_only_patch_of_its_call(
    load, mk, write, match
):
    err = _rejected(load, mk, write, match, max_chunk_bytes=1)  # a call per patch
    assert (err.position, err.name) == (1, "b")
    assert "load_weights (call 1, patch 1 ('b'), runtime tensor 'b')" in str(err)
    assert "no patch as its source" not in str(err)


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    "second",
    [
        pytest.param(lambda p, w: p.data[1:3].copy_(w[1:3]), id="rows 1:3 after 0:2"),
        pytest.param(lambda p, w: p.data[0:2].copy_(w[0:2]), id="same rows twice"),
        pytest.param(lambda p, w: p.data[:, 1].copy_(w[:, 1]), id="a column crossing them"),
        pytest.param(lambda p, w: p.copy_(w), id="the whole tensor"),
    ],
)
def test_overlapping_runtime_views_in_one_call_are_rejected_first_stays(load, mk, second):
    class Overlapping(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.w.data[0:2].copy_(w[0:2])
                second(self.w, w)
            return {"w"}

    m = Overlapping({"w": start()})
    with pytest.raises(NotImplementedError, match="overlapping runtime views"):
        load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w.detach(), merged(IDX[:3], VALS[:3]))


@pytest.mark.patchkit_only
def test_two_patches_writing_one_region_in_one_call_are_rejected(load, mk):
    class Aliasing(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:  # "x" and "y" both land in w
                self.w.copy_(w)
            return {"w"}

    m = Aliasing({"w": start()})
    with pytest.raises(NotImplementedError, match="overlapping runtime views"):
        load(m, [mk.sparse("x", (3, 4), [0], [1.0]), mk.sparse("y", (3, 4), [1], [2.0])])
    assert same_bits(m.w.detach(), merged([0], [1.0]))


def test_same_region_in_separate_calls_is_fine(load, mk):
    m = RecordingModel({"w": start()})
    load(m, [mk.sparse("w", (3, 4), [0], [1.0]), mk.sparse("w", (3, 4), [0, 1], [3.0, 4.0])])
    assert same_bits(m.w.detach(), merged([0, 1], [3.0, 4.0]))


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("returns", "scratch"),
    [("names", False), ("none", False), ("names", True), ("none", True)],
)
def test_loader_that_reports_without_copying_is_rejected(load, mk, returns, scratch):
    class Lazy(RecordingModel):
        def load_weights(self, weights):
            if scratch:  # copies, but only into a buffer that is not runtime storage
                for _, w in weights:
                    torch.empty_like(w).copy_(w)
            return {"names": {n for n, _ in weights}, "none": None}[returns]

    m = Lazy({"w": start()})
    with pytest.raises(NotImplementedError, match="without copying"):
        load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert same_bits(m.w.detach(), start())


def test_loader_owning_none_of_the_weights_returns_an_empty_set(load, mk):
    m = SinkModel()
    assert load(m, [mk.sparse("elsewhere", (3, 4), IDX, VALS)]) == set()
    assert m.names_per_call() == [["elsewhere"]]


@pytest.mark.patchkit_only
def test_rebinding_a_parameter_is_rejected_and_the_storage_put_back(load, mk):
    class Rebinding(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.w.data = w.clone()
            return {"w"}

    m = Rebinding({"w": start()})
    param, ptr = m.w, m.w.data_ptr()
    with pytest.raises(NotImplementedError, match=r"rebinding|replaced the storage") as excinfo:
        load(m, [mk.sparse("w", (3, 4), IDX, VALS)])
    assert excinfo.value.reason == "rebinding"
    assert m.w is param and m.w.data_ptr() == ptr
    assert same_bits(m.w.detach(), start())
    assert not math.isnan(m.w.sum().item())


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("write", "op"),
    [(lambda m, w: m.b.fill_(1.0), "fill_"), (lambda m, w: m.b.data.zero_(), "zero_")],
)
def test_a_fill_tells_the_caller_to_send_that_weight_dense(load, mk, write, op):
    err = _rejected(load, mk, write, op)
    assert "send it dense" in str(err)


@pytest.mark.patchkit_only
def test_other_rejected_ops_carry_no_fill_hint(load, mk):
    err = _rejected(load, mk, lambda m, w: m.b.mul_(2.0), "mul_")
    assert "send it dense" not in str(err)


# -- in-place ops that change only a view's metadata -----------------------------------------


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    "reshape",
    [
        pytest.param(lambda d: (d.unsqueeze_(0), d.squeeze_(0)), id="unsqueeze_ squeeze_"),
        pytest.param(lambda d: (d.unsqueeze_(1), d.squeeze_()), id="squeeze_ all"),
        pytest.param(lambda d: (d.t_(), d.t_()), id="t_ twice"),
        pytest.param(lambda d: (d.transpose_(0, 1), d.swapdims_(1, 0)), id="transpose_ swapdims_"),
        pytest.param(lambda d: d.as_strided_((3, 4), (4, 1), d.storage_offset()), id="as_strided_"),
    ],
)
def test_in_place_ops_that_only_reshape_an_alias_write_nothing_and_are_allowed(load, mk, reshape):
    # CONTRACT §4 refuses in-place *writes into runtime storage*: these change the alias's
    # shape or strides and no element; the copy through the alias is merged as any other.
    class Reshaping(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                d = self.w.data
                reshape(d)
                d.copy_(w)
            return {n for n, _ in weights}

    m = Reshaping({"w": start()})
    assert load(m, [mk.sparse("w", (3, 4), IDX, VALS)]) == {"w"}
    assert same_bits(m.w.detach(), merged(IDX, VALS))
    assert m.w.shape == (3, 4) and m.w.stride() == (4, 1)
