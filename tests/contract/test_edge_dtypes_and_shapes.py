"""Edges of the dtype and shape space: float8, casts that make NaN, empty tensors, tuples."""

from __future__ import annotations

import pytest
import torch

from patchkit.bitwise import bits
from patchkit.toymodels import PlainModel

# (dtypes newer than the oldest torch patchkit takes: float8_e8m0fnu from torch 2.7,
# float4_e2m1fn_x2 from 2.8; older torch cannot name them)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
FP4 = getattr(torch, "float4_e2m1fn_x2", None)
needs_e8m0 = pytest.mark.skipif(
    E8M0 is None, reason="this torch has no float8_e8m0fnu (torch 2.7 has it)")
needs_fp4 = pytest.mark.skipif(
    FP4 is None, reason="this torch has no float4_e2m1fn_x2 (torch 2.8 has it)")


def test_sparse_float8_patch_loads_bit_exact_on_cpu(load, Patch):
    # The model is on the CPU, where float8 has no index or where kernels; the patch is
    # on the test's default device (--device).
    m = PlainModel({"w": (6,)}, dtype=torch.float8_e4m3fn)
    before = m.w.detach().clone()
    vals = torch.tensor([0.5, -2.0], dtype=torch.float8_e4m3fn)
    load(m, [Patch("w", (6,), torch.float8_e4m3fn, vals, torch.tensor([1, 4]))])
    want = bits(before).clone()  # (through the bits: torch 2.4 has no float8 index_put)
    want[torch.tensor([1, 4], device="cpu")] = bits(vals.cpu())
    assert torch.equal(bits(m.w.detach()), want)


@pytest.mark.patchkit_only
def test_a_value_that_becomes_nan_in_the_cast_is_rejected_before_loading(load, Patch):
    # 1e6 overflows float8_e4m3fnuz, whose overflow value is NaN: staged, it would mean
    # "unchanged" and the element would silently keep its old value.
    m = PlainModel({"w": (4,)}, dtype=torch.float32)
    p = Patch("w", (4,), torch.float8_e4m3fnuz, torch.tensor([1.0, 1e6]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="becomes NaN when cast") as info:
        load(m, [p])
    assert info.value.reason == "NaN" and info.value.value == 2
    assert torch.equal(m.w.detach(), torch.zeros(4, device=m.w.device))


def test_sparse_patch_of_a_zero_size_weight_is_a_no_op(load, Patch):
    m = PlainModel({"e": (0, 3), "w": (2,)})
    empty = torch.zeros(0, dtype=torch.int64)
    assert load(m, [Patch("e", (0, 3), torch.float32, torch.zeros(0), empty)]) == {"e"}


@pytest.mark.patchkit_only
def test_plain_five_tuples_are_accepted_as_patches(load):
    m = PlainModel({"w": (3,)})
    load(m, [("w", (3,), torch.float32, torch.tensor([1.0, 2.0, 3.0]), None)])
    assert m.w.tolist() == [1.0, 2.0, 3.0]
    load(m, [("w", (3,), torch.float32, torch.tensor([9.0]), torch.tensor([1]))])
    assert m.w.tolist() == [1.0, 9.0, 3.0]


@pytest.mark.patchkit_only
@pytest.mark.parametrize("sparse", [True, False])
def test_a_shape_too_large_for_any_tensor_is_rejected_by_name(load, Patch, sparse):
    # 2**64 elements: prod(shape) does not fit torch's int64 sizes (it raised OverflowError
    # from a comparison with the indices, which is not a ValueError)
    m = PlainModel({"w": (2,)})
    shape = (2**32, 2**32)
    if sparse:
        p = Patch("w", shape, torch.float32, torch.zeros(1), torch.tensor([1]))
    else:
        p = Patch("w", shape, torch.float32, torch.zeros(1), None)
    with pytest.raises(ValueError, match=r"more than a tensor can") as info:
        load(m, [p])
    assert (info.value.position, info.value.name, info.value.reason) == (0, "w", "shape too large")
    assert m.w.tolist() == [0.0, 0.0]


@pytest.mark.patchkit_only
def test_an_integer_value_that_becomes_nan_in_the_cast_is_rejected_too(load, Patch):
    # int 1000 overflows float8_e4m3fnuz to NaN just as a float 1000.0 does
    m = PlainModel({"w": (4,)}, dtype=torch.float32, fill=7.0)
    p = Patch("w", (4,), torch.float8_e4m3fnuz, torch.tensor([1000, 1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="becomes NaN when cast") as info:
        load(m, [p])
    assert (info.value.reason, info.value.value) == ("NaN", 0)
    assert m.w.tolist() == [7.0] * 4


@pytest.mark.patchkit_only
def test_the_nan_message_quotes_the_entry_that_is_nan_when_its_index_repeats(load, Patch):
    # validate_unique_indices=False lets index 3 appear twice: the message must quote the
    # entry that is NaN (the second), not the first entry of that index (1.0, fine in bf16)
    m = PlainModel({"w": (6,)}, dtype=torch.bfloat16)
    p = Patch("w", (6,), torch.bfloat16, torch.tensor([1.0, float("nan")]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="NaN value at index 3") as info:
        load(m, [p], validate_unique_indices=False)
    assert "1.0" not in str(info.value) and "becomes NaN" not in str(info.value)
    # a value that only the cast makes NaN is still quoted, from its own entry
    p = Patch("w", (6,), torch.float8_e4m3fnuz, torch.tensor([1.0, 1e6]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match=r"1000000\.0 becomes NaN when cast"):
        load(m, [p], validate_unique_indices=False)
    assert m.w.float().tolist() == [0.0] * 6


class _RowShard(torch.nn.Module):
    """Rows 2-3 of a 4 x 4 checkpoint weight, as a tensor-parallel rank holds them."""

    def __init__(self, dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 4).to(dtype), requires_grad=False)
        self.b = torch.nn.Parameter(torch.ones(4).to(dtype), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            getattr(self, name).copy_(t.narrow(0, 2, 2) if name == "w" else t)
        return {name for name, _ in weights}


@pytest.mark.patchkit_only
@pytest.mark.parametrize("runtime", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                     pytest.param(E8M0, marks=needs_e8m0)])
@pytest.mark.parametrize("number", [float("inf"), -1e6])
def test_a_value_that_becomes_nan_in_the_runtime_dtype_is_refused_not_kept(
        load, Patch, runtime, number):
    # The patch's own dtype (float32) holds the number, so validation passes; the copy
    # into the model's dtype makes it NaN, which the merge would read as "keep": the
    # element would silently stay stale (e8m0fnu has no sign: -1e6 becomes 2**20, kept
    # as a number, so only the infinity is lost there).
    lost = not (runtime == E8M0 and number == -1e6)
    m = _RowShard(runtime)
    before = {n: bits(t.detach()).clone() for n, t in m.named_parameters()}
    b = Patch("b", (4,), torch.float32, torch.tensor([2.0]), torch.tensor([1]))
    # checkpoint index 13 (row 3, column 1) is the rank's element 5
    w = Patch("w", (4, 4), torch.float32, torch.tensor([0.5, 2.0, number]),
              torch.tensor([1, 8, 13]))
    if not lost:
        load(m, [b, w])
        assert m.w.detach().float().reshape(-1).tolist()[5] == 2.0**20
        return
    with pytest.raises(ValueError, match=r"into a torch\.float8_\w+ view, where the value") as info:
        load(m, [b, w])
    e = info.value
    assert (e.position, e.name, e.reason, e.value) == (1, "w", "NaN in the runtime dtype", 13)
    assert f"{number!r} at checkpoint index 13" in str(e) and "wrote nothing" in str(e)
    # (the copy into w wrote nothing; b, copied before it in the same call, stays)
    assert torch.equal(bits(m.w.detach()), before["w"])


@pytest.mark.patchkit_only
@pytest.mark.parametrize("runtime", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_runtime_dtypes_that_hold_every_number_take_it_as_a_dense_load_would(
        load, Patch, runtime):
    # e4m3fn saturates (inf -> 448), e5m2 and bf16 have infinities: no number is lost in
    # the cast, so the sparse load writes what a dense load of the same values writes.
    sparse, dense = _RowShard(runtime), _RowShard(runtime)
    values = torch.tensor([float("inf"), -1e6, 3.0])
    idx = torch.tensor([9, 13, 14])
    if values.to(runtime).float().isnan().any():
        # (torch before 2.13 casts a float out of e4m3fn's range to NaN, not 448: there
        # the number is lost in the cast, and the sparse load is refused as for fnuz)
        with pytest.raises(ValueError, match=r"value inf at checkpoint index 9 arrives as"
                           ) as info:
            load(sparse, [Patch("w", (4, 4), torch.float32, values, idx)])
        assert info.value.reason == "NaN in the runtime dtype"
        assert sparse.w.detach().float().eq(1).all()
        return
    load(sparse, [Patch("w", (4, 4), torch.float32, values, idx)])
    full = torch.ones(4, 4)
    full.reshape(-1)[idx] = values
    load(dense, [Patch("w", (4, 4), torch.float32, full.reshape(-1), None)])
    assert torch.equal(bits(sparse.w.detach()), bits(dense.w.detach()))


class _CastsFirst(_RowShard):
    """Casts its rank's rows to the runtime dtype itself, then copies (same dtypes)."""

    def load_weights(self, weights):
        for name, t in weights:
            rows = t.narrow(0, 2, 2) if name == "w" else t
            getattr(self, name).copy_(rows.to(torch.float8_e4m3fnuz))
        return {name for name, _ in weights}


@pytest.mark.patchkit_only
def test_a_loader_that_casts_before_it_copies_loses_no_number_either(load, Patch):
    # The copy then sees a source of its own dtype; the NaN the cast made reached the
    # merge as "keep", and the update at checkpoint index 13 was silently lost
    m = _CastsFirst(torch.float8_e4m3fnuz)
    w = Patch("w", (4, 4), torch.bfloat16, torch.tensor([0.5, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"1000000\.0 at checkpoint index 13 arrives as") as info:
        load(m, [w])
    e = info.value
    assert (e.position, e.name, e.reason, e.value) == (0, "w", "NaN in the runtime dtype", 13)
    assert m.w.detach().float().eq(1).all()
    # (numbers the dtype holds still load)
    load(m, [w._replace(values=torch.tensor([0.5, 2.0]))])
    assert m.w.detach().float().reshape(-1)[[1, 5]].tolist() == [0.5, 2.0]


@pytest.mark.patchkit_only
@needs_fp4
def test_a_sparse_copy_into_a_packed_float4_tensor_is_refused_by_the_contract(load, Patch):
    # float4_e2m1fn_x2 is "floating point" to torch but has no NaN: torch's bare
    # NotImplementedError ("copy_" not implemented) came from inside patchkit's check
    class F4(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(
                torch.zeros(4, dtype=torch.uint8).view(FP4),
                requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t)
            return {n for n, _ in weights}

    m = F4()
    with pytest.raises(NotImplementedError, match="no NaN to keep by") as info:
        load(m, [Patch("w", (4,), torch.bfloat16, torch.tensor([1.0]), torch.tensor([1]))])
    assert (info.value.position, info.value.reason) == (0, "same-shaped floating-point")
    assert m.w.detach().view(torch.uint8).eq(0).all()
