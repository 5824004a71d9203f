"""Bit-exactness and dtype casts (CONTRACT §3, §4 and "things the contract does not promise").

``-0.0``, infinities and subnormals travel bit-exact, sparse and dense; untouched
positions keep their bits (NaN payloads and ``-0.0`` included). A cast behaves like
``param.copy_(value)``: the patch values are cast to the patch dtype when staged, then to
the parameter dtype by the copy.
"""

from __future__ import annotations

import pytest
import torch

from ._models import RecordingModel, bits, same_bits

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def specials(dtype: torch.dtype) -> torch.Tensor:
    """-0.0, ±inf, ±max, smallest normal, subnormals (smallest, mid, negative) in ``dtype``."""
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps  # the smallest positive subnormal
    vals = [-0.0, float("inf"), float("-inf"), fi.max, -fi.max, fi.smallest_normal,
            tiny, -tiny, fi.smallest_normal / 2, 3 * tiny]
    out = torch.tensor(vals, dtype=torch.float64).to(dtype)
    sub = out[6:]
    assert (sub != 0).all() and (sub.abs() < fi.smallest_normal).all(), "not subnormal"
    assert bits(out[0]).item() != 0, "-0.0 lost its sign"
    return out


def nan_with_payload(dtype: torch.dtype) -> torch.Tensor:
    """A quiet NaN with a non-default payload, and a negative one."""
    size = torch.empty((), dtype=dtype).element_size()
    quiet = torch.tensor(float("nan"), dtype=dtype).view(_INT[size]).item()
    payloads = torch.tensor([quiet | 1, quiet | 3], dtype=_INT[size]).view(dtype)
    payloads[1] = -payloads[1]
    return payloads


def runtime_start(dtype: torch.dtype, n: int) -> torch.Tensor:
    """+0.0 everywhere except NaN payloads and -0.0 at positions no patch touches."""
    t = torch.zeros(n, dtype=dtype)
    t[-3:-1] = nan_with_payload(dtype)
    t[-1] = -0.0
    return t


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", FLOATS)
def test_sparse_special_values_travel_bit_exact(load, mk, dtype, index_dtype):
    vals = specials(dtype)
    n = 2 * len(vals) + 3
    m = RecordingModel({"w": runtime_start(dtype, n)})
    before = m.w.detach().clone()
    idx = list(range(0, 2 * len(vals), 2))
    load(m, [mk.sparse("w", (n,), idx, vals, dtype, index_dtype=index_dtype)])
    expected = before.clone()
    expected[idx] = vals
    assert same_bits(m.w.detach(), expected)
    assert same_bits(m.w.detach()[-3:], before[-3:])  # NaN payloads and -0.0 kept


@pytest.mark.parametrize("dtype", FLOATS)
def test_dense_special_values_travel_bit_exact(load, mk, dtype):
    vals = torch.cat([specials(dtype), nan_with_payload(dtype)])
    m = RecordingModel({"w": torch.ones(len(vals), dtype=dtype)})
    load(m, [mk.dense("w", vals)])
    assert same_bits(m.w.detach(), vals)


@pytest.mark.parametrize("dtype", FLOATS)
def test_negative_zero_overwrites_positive_zero_and_back(load, mk, dtype):
    m = RecordingModel({"w": torch.tensor([0.0, -0.0], dtype=dtype)})
    load(m, [mk.sparse("w", (2,), [0, 1], [-0.0, 0.0], dtype)])
    assert same_bits(m.w.detach(), torch.tensor([-0.0, 0.0], dtype=dtype))


CASTS = [
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32),
]


def cast_values(patch_dtype: torch.dtype) -> torch.Tensor:
    """Values that need rounding in narrower types, one that overflows bf16/fp16, subnormals."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(20, generator=g, dtype=torch.float64) * 3
    extra = torch.tensor([1 + 2.0**-9, 70000.0, 3.3e38, 1e-39, -1e-41, -0.0], dtype=torch.float64,
                         device=v.device)
    fi = torch.finfo(patch_dtype)
    extra = extra.clamp(-fi.max, fi.max)
    return torch.cat([v, extra]).to(patch_dtype)


def _as_copy(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What ``param.copy_(value)`` writes into a ``dtype`` parameter."""
    return torch.empty(value.shape, dtype=dtype).copy_(value)


@pytest.mark.parametrize(("patch_dtype", "param_dtype"), CASTS)
def test_sparse_cast_equals_param_copy_semantics(load, mk, patch_dtype, param_dtype):
    vals = cast_values(patch_dtype)
    n = len(vals) + 5
    m = RecordingModel({"w": runtime_start(param_dtype, n)})
    before = m.w.detach().clone()
    idx = torch.randperm(len(vals) + 2, generator=torch.Generator().manual_seed(4))[: len(vals)]
    load(m, [mk.sparse("w", (n,), idx, vals, patch_dtype)])
    expected = before.clone()
    expected[idx] = _as_copy(vals, param_dtype)
    assert same_bits(m.w.detach(), expected)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[idx] = False
    assert same_bits(m.w.detach()[untouched], before[untouched])


@pytest.mark.parametrize(("patch_dtype", "param_dtype"), CASTS)
def test_dense_cast_equals_param_copy_semantics(load, mk, patch_dtype, param_dtype):
    vals = cast_values(patch_dtype)
    m = RecordingModel({"w": torch.zeros(len(vals), dtype=param_dtype)})
    load(m, [mk.dense("w", vals)])
    assert same_bits(m.w.detach(), _as_copy(vals, param_dtype))


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_values_are_cast_to_the_patch_dtype_at_staging(load, mk, kind):
    # float64 values, float32 checkpoint, float64 parameter: the float32 rounding shows.
    vals = torch.tensor([0.1, 1 / 3, 1e-40, 2.0**-1000], dtype=torch.float64)
    m = RecordingModel({"w": torch.zeros(4, dtype=torch.float64)})
    if kind == "sparse":
        patch = mk.sparse("w", (4,), [0, 1, 2, 3], vals, torch.float32, values_dtype=torch.float64)
    else:
        patch = mk.dense("w", vals, torch.float32)
    assert patch.values.dtype == torch.float64 and patch.dtype == torch.float32
    load(m, [patch])
    [[(_, staged)]] = m.calls
    assert staged.dtype == torch.float32
    expected = vals.to(torch.float32).to(torch.float64)
    assert same_bits(m.w.detach(), expected)
    assert not torch.equal(m.w.detach(), vals)


@pytest.mark.parametrize("kind", ["sparse", "dense"])
def test_casts_compose_values_to_patch_dtype_then_to_param_dtype(load, mk, kind):
    vals = torch.tensor([1 + 2.0**-8 + 2.0**-20, 3.14159, -2.71828, 1e-3], dtype=torch.float64)
    m = RecordingModel({"w": torch.zeros(4, dtype=torch.float32)})
    if kind == "sparse":
        patch = mk.sparse(
            "w", (4,), [0, 1, 2, 3], vals, torch.bfloat16, values_dtype=torch.float64
        )
    else:
        patch = mk.dense("w", vals, torch.bfloat16)
    load(m, [patch])
    via_bf16 = vals.to(torch.bfloat16).to(torch.float32)
    assert same_bits(m.w.detach(), via_bf16)
    assert not torch.equal(via_bf16, vals.to(torch.float32))


def test_integer_values_with_a_float_patch_dtype_are_cast(load, mk, Patch):
    m = RecordingModel({"w": torch.zeros(3), "v": torch.zeros(3)})
    load(m, [Patch("w", (3,), torch.float32, torch.tensor([1, -2, 3]))])
    load(m, [Patch("v", (3,), torch.float32, torch.tensor([7, 8]), torch.tensor([2, 0]))])
    assert m.w.detach().tolist() == [1.0, -2.0, 3.0]
    assert m.v.detach().tolist() == [8.0, 0.0, 7.0]
