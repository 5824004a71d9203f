"""The passes a report takes on a GPU, run on the CPU (``bitwise.device_passes`` with the
compiled path off): they give the CPU passes' numbers, and they make the host wait for
the device a fixed number of times per write and per report, not once or more per block
of a tensor (a 16 M-element bf16 report on a GPU waited 257 times; CUDA-only checks of
the same are in ``test_cuda.py``)."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, bitwise, inspect_load, native
from patchkit.bitwise import block_size, count_true, device_passes, host_waits, sum_squares
from patchkit.toymodels import PlainModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import host_waits_of

CPU = torch.device("cpu")


@pytest.fixture
def small_blocks(monkeypatch):
    """Device blocks of 4 K elements, so that a test-sized tensor spans many of them."""
    monkeypatch.setattr(bitwise, "_DEVICE_BLOCK", 1 << 12)
    monkeypatch.setattr(bitwise, "_SQUARES_BLOCK", 1 << 10)
    # (count_true counts a mask of more than this in blocks on a device: none was)
    monkeypatch.setattr(bitwise, "_COUNT_BLOCK", 1 << 10)


def _values(dtype, n, seed, *, specials=True):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        x = torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g))
    elif dtype.is_floating_point:
        x = torch.randn(n, generator=g) * 4
    else:
        x = torch.randint(-1000, 1000, (n,), generator=g)
    x = x.to(dtype)
    if specials and dtype.is_floating_point:
        x[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e30])
    return x


def _changed(x, share, seed):
    """``x`` with ``share`` of its elements changed (and, for floats, a NaN kept, an
    infinity turned finite and 0.0 turned -0.0)."""
    g = torch.Generator().manual_seed(seed)
    y = x.clone()
    n = x.numel()
    pos = torch.randperm(n, generator=g)[: max(1, int(n * share))]
    if x.dtype.is_complex or x.dtype.is_floating_point:
        y[pos] = (y[pos] * 2 + 1).to(x.dtype)
        y[1], y[4] = 7.0, -0.0
    else:
        y[pos] = y[pos] + 3
    return y


_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64,
           torch.int32]


def _report(model_values, patches, passes):
    model = PlainModel({n: tuple(v.shape) for n, v in model_values.items()},
                       dtype=next(iter(model_values.values())).dtype)
    with torch.no_grad():
        for n, v in model_values.items():
            model.get_parameter(n).copy_(v)
    with native.disabled(), passes():
        return inspect_load(model, patches)


def _same_numbers(a, b):
    assert a.index.tolist() == b.index.tolist()
    for col in ("elements", "changed"):
        assert a[col].tolist() == b[col].tolist(), col
    for col in ("max_abs", "mean_abs", "rel_l2"):
        for x, y in zip(a[col], b[col]):
            assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-12), col


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("share", [0.02, 1.0], ids=["2%", "all"])
def test_dense_reports_on_the_device_passes_give_the_cpu_numbers(dtype, share, small_blocks):
    n = 40_000  # ten 4 K device blocks
    before = {"a": _values(dtype, n, 1).reshape(200, 200),
              "b": _values(dtype, 300, 2, specials=False).reshape(3, 100)}
    after = {k: _changed(v.reshape(-1), share, 5).reshape(v.shape) for k, v in before.items()}
    patches = [CheckpointWeightPatch(k, tuple(v.shape), dtype, v.reshape(-1))
               for k, v in after.items()]
    host = _report(before, patches, lambda: native.disabled())  # (a no-op second context)
    dev = _report(before, patches, device_passes)
    want = [int(bitwise.changed_mask(before[k], after[k]).sum()) for k in ("a", "b")]
    assert host.deltas["changed"].tolist() == want and 0 < want[0] < 40_000 + 1
    _same_numbers(host.deltas, dev.deltas)
    assert host.writes["changed"].tolist() == dev.writes["changed"].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_sparse_reports_on_the_device_passes_give_the_cpu_numbers(dtype, small_blocks):
    g = torch.Generator().manual_seed(3)
    before = {"a": _values(dtype, 30_000, 4).reshape(150, 200)}
    idx = torch.randperm(30_000, generator=g)[:9_000]
    vals = (torch.randn(9_000, generator=g) * 3).to(dtype)
    vals[:3] = torch.tensor([float("inf"), 0.0, -0.0])
    patches = [CheckpointWeightPatch("a", (150, 200), dtype, vals, idx)]
    host = _report(before, patches, lambda: native.disabled())
    dev = _report(before, patches, device_passes)
    _same_numbers(host.deltas, dev.deltas)
    assert host.writes[["elements", "changed"]].values.tolist() == \
        dev.writes[["elements", "changed"]].values.tolist()
    assert int(host.deltas["elements"].iloc[0]) == 9_000


def test_a_dense_report_on_the_device_passes_waits_once_per_write_and_once_at_the_end(
    small_blocks,
):
    shapes = {"a": (512, 512), "b": (64, 1024), "c": (7, 5)}  # 64, 16 and 1 device blocks

    def load(share):
        model = PlainModel(shapes, dtype=torch.bfloat16, fill=0.5)
        patches = [
            CheckpointWeightPatch(n, s, torch.bfloat16, _changed(
                model.get_parameter(n).detach().reshape(-1), share, k))
            for k, (n, s) in enumerate(shapes.items())
        ]
        return lambda: inspect_load(model, patches)

    for share in (0.02, 1.0):  # compact saves, whole saves
        with native.disabled(), device_passes():
            # (and the two synchronizes around its one load_weights call)
            assert host_waits_of(load(share)) == len(shapes) + 1 + 2, share
        # the CPU's own passes read a block's numbers as they go
        with native.disabled():
            assert host_waits_of(load(share)) > 3 * len(shapes)


def test_a_sparse_report_on_the_device_passes_waits_a_fixed_number_of_times_per_patch(
    small_blocks,
):
    shapes = {f"w{i}": (256, 256) for i in range(4)}
    model = PlainModel(shapes, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    patches = [CheckpointWeightPatch(n, s, torch.float32, torch.randn(6_000, generator=g),
                                     torch.randperm(65_536, generator=g)[:6_000])
               for n, s in shapes.items()]
    with native.disabled(), device_passes():
        plain = host_waits_of(lambda: patchkit.load_checkpoint_weight_patches(model, patches))
        report = host_waits_of(lambda: inspect_load(model, patches))
    # per patch: where it writes (nonzero) and what it changed; once at the end: the numbers
    assert report - plain == 2 * len(patches) + 1 + 2  # (+ the call's two synchronizes)


def test_block_sizes_and_device_passes():
    cuda = torch.device("cuda")
    assert block_size(CPU, 10**9) == bitwise._SQUARES_BLOCK
    assert block_size(CPU, 10**9, host=7) == 7
    assert block_size(cuda, 10**9) == bitwise._DEVICE_BLOCK
    assert block_size(cuda, 1000) == 1000 and block_size(cuda, 0) == 1
    assert host_waits(cuda) and not host_waits(CPU)
    with device_passes():
        assert host_waits(CPU)
        with device_passes():
            assert host_waits(CPU)
        assert host_waits(CPU)
    assert not host_waits(CPU)
    with pytest.raises(KeyError), device_passes():
        raise KeyError("inside")
    assert not host_waits(CPU)


def test_counts_and_squares_on_the_device_passes_agree_with_the_cpu(small_blocks):
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(50_001, generator=g) < 0.3
    x = torch.randn(50_001, generator=g).to(torch.bfloat16)
    x[17] = float("nan")
    host = (int(count_true(mask)), sum_squares(x))
    with device_passes():
        dev = (int(count_true(mask)), sum_squares(x))
    assert dev[0] == host[0] == int(mask.sum())
    assert math.isclose(dev[1], host[1], rel_tol=1e-12)
    assert math.isfinite(host[1])


def test_changed_offsets_at_a_known_count_are_nonzeros():
    from patchkit.intercept import _changed_offsets

    g = torch.Generator().manual_seed(4)
    mask = torch.rand(10_000, generator=g) < 0.05
    want = torch.nonzero(mask).reshape(-1)
    assert torch.equal(_changed_offsets(mask, int(mask.sum())), want)
    with device_passes():
        assert torch.equal(_changed_offsets(mask, int(mask.sum())), want)  # nonzero_static
        assert _changed_offsets(mask, 0).numel() == 0


def test_squares_pending_on_a_device_keep_nothing_of_their_values():
    # an overlapping target's before-values are a fresh copy: held until the report's one
    # read, every target's copy was alive at once (a model-sized copy)
    import gc
    import weakref

    from patchkit.inspect import _Stats

    acc = _Stats()
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[3] = float("inf")
    want = float(torch.cat([x[:3], x[4:]]).square().sum())
    alive = weakref.ref(x)
    with device_passes():
        acc.add_squares(x)
    del x
    gc.collect()
    assert alive() is None
    _Stats.settle([acc])
    assert math.isclose(acc.sum_b2, want, rel_tol=1e-12) and acc.pending == []


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_reports_and_transactional_loads_of_inference_tensors(compiled):
    # an inference tensor has no version counter: reading it raised
    with torch.inference_mode():
        patches = [CheckpointWeightPatch("w", (4, 4), torch.float32,
                                         torch.arange(16, dtype=torch.float32))]
        with contextlib.nullcontext() if compiled else native.disabled():
            r = inspect_load(PlainModel({"w": (4, 4)}), patches)
            model = PlainModel({"w": (4, 4)})
            patchkit.load_checkpoint_weight_patches(model, patches, transactional=True)
    assert r.deltas["changed"].tolist() == [15]  # 0.0 stays 0.0
    assert torch.equal(model.w.reshape(-1), torch.arange(16, dtype=torch.float32))


def test_a_device_without_nonzero_static_falls_back_to_nonzero(monkeypatch):
    from patchkit import intercept

    def no_kernel(*_a, **_k):
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from "
                                  "the 'CUDA' backend")

    monkeypatch.setattr(torch, "nonzero_static", no_kernel)
    monkeypatch.setattr(intercept, "_STATIC_NONZERO", {})
    w = torch.zeros(4096)
    w[:10] = 1.0  # 10 of 4096 change: a compact save
    patches = [CheckpointWeightPatch("w", (64, 64), torch.float32, w)]
    with native.disabled(), device_passes():
        r = inspect_load(PlainModel({"w": (64, 64)}), patches)
        model = PlainModel({"w": (64, 64)}, fill=2.0)
        patchkit.load_checkpoint_weight_patches(model, patches, transactional=True)
    assert r.deltas["changed"].tolist() == [10]
    assert torch.equal(r.before("w"), torch.zeros(64, 64))
    assert intercept._STATIC_NONZERO == {"cpu": False}  # tried once, then nonzero


def test_nonzero_static_out_of_memory_propagates_and_keeps_nonzero_static(monkeypatch):
    # a GPU out of memory in nonzero_static was taken for a missing kernel: nonzero_static
    # was switched off for the device type for the rest of the process (a wait more per
    # write from then on), and nonzero retried at the same size
    from patchkit import intercept

    def out_of_memory(*_a, **_k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    retried = []
    monkeypatch.setattr(torch, "nonzero_static", out_of_memory)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: retried.append(1))
    monkeypatch.setattr(intercept, "_STATIC_NONZERO", {})
    mask = torch.zeros(64, dtype=torch.bool)
    mask[:3] = True
    with device_passes(), pytest.raises(torch.cuda.OutOfMemoryError):
        intercept._changed_offsets(mask, 3)
    assert intercept._STATIC_NONZERO == {} and not retried


def test_validating_sorted_sparse_patches_on_the_device_passes_waits_once():
    # the check for strictly increasing indices, a shortcut where reading costs nothing,
    # read one answer per patch: a GPU would have waited once per patch
    from patchkit.patch import validate_patches

    g = torch.Generator().manual_seed(6)
    patches = [CheckpointWeightPatch(f"w{i}", (100, 100), torch.float32,
                                     torch.randn(500, generator=g),
                                     torch.randperm(10_000, generator=g)[:500].sort().values)
               for i in range(6)]
    with device_passes():
        assert host_waits_of(lambda: validate_patches(patches)) == 1
    assert host_waits_of(lambda: validate_patches(patches)) == 1 + len(patches)  # (CPU)


def test_validating_short_sparse_patches_on_the_device_passes_waits_once():
    # (a short index list is read as Python ints on the CPU, where reading costs nothing;
    # on a device that makes the host wait, that read would wait once per patch)
    from patchkit.patch import validate_patches

    g = torch.Generator().manual_seed(7)
    patches = [CheckpointWeightPatch(f"w{i}", (16, 16), torch.float32,
                                     torch.randn(8, generator=g),
                                     torch.randperm(256, generator=g)[:8])
               for i in range(6)]
    with device_passes():
        assert host_waits_of(lambda: validate_patches(patches)) == 1
    bad = [*patches[:3], patches[3]._replace(indices=patches[3].indices.flip(0).clone()
                                             .index_fill_(0, torch.tensor([0]), 999))]
    with device_passes(), pytest.raises(ValueError, match="out-of-range index 999") as e:
        validate_patches(bad)
    assert (e.value.position, e.value.reason) == (3, "out-of-range")
