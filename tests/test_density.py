"""patchkit.density.density_map: exact block fractions from the indices alone."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from patchkit import CheckpointWeightPatch
from patchkit.density import density_map, grid_shape, region_text
from patchkit.errors import PatchTypeError, PatchValueError


def brute_force(patch: CheckpointWeightPatch, bins: tuple[int, int]) -> np.ndarray:
    """The map from the full written mask: element (r, c) is in block
    (floor(r * br / R), floor(c * bc / C)); each block's mean of the mask."""
    rows, cols = grid_shape(patch.shape)
    br, bc = max(1, min(bins[0], rows)), max(1, min(bins[1], cols))
    n = math.prod(patch.shape)
    mask = np.zeros(n, dtype=np.float64)
    if patch.indices is None:
        mask[:] = 1.0
    else:
        mask[patch.indices.numpy()] = 1.0
    mask = mask.reshape(rows, cols)
    rb = (np.arange(rows) * br) // rows
    cb = (np.arange(cols) * bc) // cols
    out = np.zeros((br, bc))
    for i in range(br):
        for j in range(bc):
            block = mask[np.ix_(rb == i, cb == j)]
            out[i, j] = block.mean() if block.size else 0.0
    return out.astype(np.float32)


SHAPES = [(), (1,), (7,), (5, 3), (13, 11), (3, 4, 5), (100, 7), (129, 3), (1, 1)]
BINS = [(1, 1), (2, 3), (3, 5), (7, 2), (4, 100), (64, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_density_map_equals_the_dense_block_means_on_odd_shapes(shape):
    g = torch.Generator().manual_seed(len(shape) * 1000 + sum(shape))
    n = math.prod(shape)
    for bins in BINS:
        for nnz in sorted({1, n // 3, n}):
            idx = torch.randperm(n, generator=g)[:nnz]
            p = CheckpointWeightPatch("w", shape, torch.float32, torch.ones(nnz), idx)
            got = density_map(p, bins).numpy()
            np.testing.assert_array_equal(got, brute_force(p, bins), err_msg=f"{bins} {nnz}")
        dense = CheckpointWeightPatch("w", shape, torch.float32, torch.zeros(n))
        np.testing.assert_array_equal(density_map(dense, bins).numpy(),
                                      brute_force(dense, bins))


def test_blocks_split_rows_by_floor_of_row_times_bins_over_rows():
    # 5 rows in 2 blocks: rows 0-2 (floor(2r/5) == 0) and 3-4, as the docstring says.
    p = CheckpointWeightPatch("w", (5, 1), torch.float32, torch.ones(1), torch.tensor([2]))
    assert density_map(p, bins=(2, 1)).tolist() == [[pytest.approx(1 / 3)], [0.0]]


def test_density_of_a_2_to_the_40_element_patch_never_builds_anything_of_its_size():
    n = 2**40  # an 8 TiB index range: any O(numel) tensor would fail to allocate
    p = CheckpointWeightPatch("huge", (n,), torch.float32, torch.ones(3),
                              torch.tensor([0, n // 2, n - 1]))
    got = density_map(p, bins=(64, 64))
    assert got.shape == (1, 64)
    want = torch.zeros(1, 64)
    want[0, [0, 32, 63]] = 64 / n  # one element of each 2**34-element block
    assert torch.equal(got, want)


def test_density_where_index_times_bins_would_overflow_int64():
    n = 2**62  # (of a 1-byte dtype: a tensor of 2**62 float32 is one no load can stage)
    p = CheckpointWeightPatch("huge", (n,), torch.float8_e4m3fn, torch.ones(3),
                              torch.tensor([0, n // 2 - 1, n - 1]))
    got = density_map(p, bins=(1, 64))
    assert got.nonzero()[:, 1].tolist() == [0, 31, 63]
    assert got[0, 0].item() == pytest.approx(64 / n)


@pytest.mark.parametrize("n, b", [
    (2**61 + 1, 4),  # the largest index times bins is exactly 2**63: one past int64's max
    (2**62, 3),  # between 2**63 and 2**64: an unsigned 64-bit product would still fit
])
def test_density_where_the_largest_index_times_bins_just_overflows_int64(n, b):
    def block(k):  # floor(k * b / n), exact in Python's ints
        return k * b // n

    def start(i):  # first index of block i: ceil(i * n / b)
        return -(-i * n // b)

    s1 = start(1)
    idx = [0, s1 - 1, s1, n - 2, n - 1]
    p = CheckpointWeightPatch("huge", (n,), torch.float8_e4m3fn, torch.ones(len(idx)),
                              torch.tensor(idx))
    got = density_map(p, bins=(1, b))
    assert got.shape == (1, b)
    counts = [0] * b
    for k in idx:
        counts[block(k)] += 1
    assert [block(k) for k in idx] == [0, 0, 1, b - 1, b - 1]
    want = [c / (start(i + 1) - start(i)) for i, c in enumerate(counts)]
    assert got[0].tolist() == pytest.approx(want, rel=1e-6, abs=0)


def test_bins_may_be_one_int_for_both_axes():
    p = CheckpointWeightPatch("w", (6, 6), torch.float32, torch.ones(3), torch.tensor([0, 7, 35]))
    assert torch.equal(density_map(p, 3), density_map(p, (3, 3)))
    assert torch.equal(density_map(p, [2, 3]), density_map(p, (2, 3)))
    assert torch.equal(density_map(p, np.int32(3)), density_map(p, (3, 3)))  # numpy ints too


@pytest.mark.parametrize("bins", [3.0, "ab", (2,), (2, 2, 2), (True, 2), (2, 2.5), None,
                                  torch.tensor(2), (2, torch.tensor(3)), np.bool_(True)])
def test_bins_that_are_not_ints_raise_type_error_naming_bins(bins):
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(1), torch.tensor([0]))
    with pytest.raises(TypeError, match="bins") as info:
        density_map(p, bins)
    assert repr(bins) in str(info.value)


@pytest.mark.parametrize("bins", [0, (0, 4), (4, -1)])
def test_bins_below_one_raise_value_error(bins):
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(1), torch.tensor([0]))
    with pytest.raises(ValueError, match=re.escape(f"bins must be positive, got {bins!r}")):
        density_map(p, bins)


@pytest.mark.parametrize(
    ("idx", "k", "bad"), [([0, 5, 101, 3], 2, 101), ([3, -1, 200], 1, -1), ([16], 0, 16)]
)
def test_an_index_outside_the_tensor_names_the_patch_and_the_first_bad_index(idx, k, bad):
    p = CheckpointWeightPatch("emb.weight", (4, 4), torch.float32, torch.ones(len(idx)),
                              torch.tensor(idx))
    with pytest.raises(ValueError, match=f"out-of-range index {bad} at indices\\[{k}\\]") as info:
        density_map(p, bins=(4, 4))
    msg = str(info.value)
    assert msg.startswith("patch 'emb.weight': ") and "(4, 4) (16 elements" in msg
    assert (info.value.name, info.value.value, info.value.reason) == (
        "emb.weight", bad, "out-of-range"
    )


def test_empty_and_dense_patches():
    empty = CheckpointWeightPatch("e", (0, 5), torch.float32, torch.ones(0),
                                  torch.zeros(0, dtype=torch.int64))
    assert density_map(empty, (4, 4)).tolist() == [[0.0] * 4]
    # no columns: still at least one block column ("at least 1"), as no rows is one block row
    no_columns = CheckpointWeightPatch("c", (5, 0), torch.float32, torch.ones(0),
                                       torch.zeros(0, dtype=torch.int64))
    assert density_map(no_columns, (4, 4)).tolist() == [[0.0]] * 4
    none = CheckpointWeightPatch("n", (3, 3), torch.float32, torch.ones(0),
                                 torch.zeros(0, dtype=torch.int64))
    assert density_map(none, (2, 2)).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    dense = CheckpointWeightPatch("d", (3, 3), torch.float32, torch.zeros(9))
    assert density_map(dense, (2, 2)).tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_density_counts_the_elements_written_whatever_their_values():
    # The map knows the patch only: writing zeros or the value already there counts the
    # same. The docstring must say "writes", not "changes" (the figures read it).
    idx = torch.tensor([0, 1, 2, 3])
    zeros = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.zeros(4), idx)
    assert density_map(zeros, (1, 1)).tolist() == [[0.25]]
    summary = " ".join(density_map.__doc__.split("\n\n")[0].split())
    assert summary.startswith("Fraction of the elements of each block") and "writes" in summary
    assert "changes" not in summary


def test_a_negative_index_among_indices_inside_the_tensor_is_refused():
    # every index below numel: the minimum alone shows the bad one
    p = CheckpointWeightPatch("emb.weight", (4, 4), torch.float32, torch.ones(3),
                              torch.tensor([2, -1, 5]))
    with pytest.raises(ValueError, match=r"out-of-range index -1 at indices\[1\]") as info:
        density_map(p, bins=(2, 2))
    assert (info.value.value, info.value.reason) == (-1, "out-of-range")


BAD_PATCHES = [
    # (what is wrong, patch, error type, reason): each one the loader refuses too
    ("float indices", ((4, 4), torch.ones(2), torch.tensor([1.7, 15.9])), TypeError,
     "indices dtype"),
    ("int16 indices", ((4, 4), torch.ones(2), torch.tensor([1, 2], dtype=torch.int16)),
     TypeError, "indices dtype"),
    ("numpy indices", ((4, 4), torch.ones(2), np.array([1, 2])), TypeError, "indices type"),
    ("negative dim", ((-4, 4), torch.ones(2), torch.tensor([1, 2])), ValueError,
     "negative dimension"),
    ("2-D values", ((4, 4), torch.ones(1, 2), torch.tensor([1, 2])), ValueError,
     "values not 1-D"),
    ("lengths", ((4, 4), torch.ones(3), torch.tensor([1, 2])), ValueError, "length mismatch"),
]


@pytest.mark.parametrize(("what", "parts", "error", "reason"), BAD_PATCHES,
                         ids=[b[0] for b in BAD_PATCHES])
def test_a_patch_the_loader_refuses_is_refused_as_the_loader_refuses_it(
        what, parts, error, reason):
    from patchkit.patch import validate_patches

    shape, values, indices = parts
    p = CheckpointWeightPatch("w", shape, torch.float32, values, indices)
    with pytest.raises(error) as loader:
        validate_patches([p])
    with pytest.raises(error) as info:
        density_map(p, 4)
    assert info.value.reason == loader.value.reason == reason
    assert str(info.value).startswith("patch 'w': ")
    assert str(info.value).removeprefix("patch 'w': ") == str(loader.value).removeprefix(
        "patch 0 ('w'): ")


def test_region_text_ignores_the_stride_of_a_dimension_of_size_one():
    from patchkit.density import region_text

    # Row 1 of an (8, 4) tensor, as the transpose of a (4, 1) column: its dimension of
    # size 1 has stride 1 (torch keeps any stride there), which steps no dimension.
    row = torch.zeros(8, 4)[1].reshape(4, 1).t()
    assert (tuple(row.shape), row.stride()) == ((1, 4), (1, 1))
    assert region_text((8, 4), 4, tuple(row.shape), row.stride()) == "[1:2, :]"
    assert region_text((8, 4), 4, (1, 4), (4, 1)) == "[1:2, :]"  # the usual strides


def _selected(text: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A bool mask of ``shape``: True where ``w[<text>]`` selects (slice notation)."""
    parts = [p.strip() for p in text.strip("[]").split(",")]
    index = tuple(slice(*(int(x) if x else None for x in p.split(":"))) for p in parts)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[index] = True
    return mask


def test_region_text_names_transposed_and_stepped_boxes_as_the_slices_they_are():
    from patchkit.density import region_text

    w = torch.zeros(8, 4)
    views = {
        "[0:8:2, :]": w[0::2],  # gate rows of an interleaved gate_up
        "[1:8:2, :]": w[1::2],
        "[:, 1:3]": w.t()[1:3],  # a transposed destination: still a box
        "[:, 0:4:2]": w[:, ::2],
        "[2:8:3, 1:2]": w[2::3, 1],
        "[3:7, 0:4:3]": w[3:7].t()[::3],
    }
    for text, v in views.items():
        got = region_text((8, 4), v.storage_offset(), tuple(v.shape), v.stride())
        assert got == text
        written = torch.zeros(8, 4, dtype=torch.bool)
        written.view(-1)[torch.as_strided(torch.arange(32), v.shape, v.stride(),
                                          v.storage_offset()).reshape(-1)] = True
        assert torch.equal(_selected(got, (8, 4)), written), text
    # not boxes: a diagonal, two view dimensions along one row-major dimension that
    # leave a row out between them (rows 0, 1, 3 and 4 of column 0)
    assert region_text((8, 4), 0, (4,), (5,)) == "4 elements from 0"
    assert region_text((8, 4), 0, (2, 2), (12, 4)) == "4 elements from 0"
    # ... where they make one run (rows 0 to 3 of column 0: the second steps by the
    # span of the first), a box: a view of int32 words of a float8 tensor, each word
    # four elements, steps so along its columns
    assert region_text((8, 4), 0, (2, 2), (8, 4)) == "[0:4, 0:1]"
    assert region_text((4, 16), 4, (2, 4, 4), (4, 16, 1)) == "[:, 4:12]"
    assert torch.equal(_selected("[:, 4:12]", (4, 16)), torch.zeros(4, 16, dtype=torch.bool)
                       .view(-1).index_fill_(0, torch.as_strided(
                           torch.arange(64), (2, 4, 4), (4, 16, 1), 4).reshape(-1), True)
                       .view(4, 16))
    # (a dimension of one element between them, whatever its stride, changes nothing)
    assert region_text((4, 16), 4, (2, 1, 4, 4), (4, 2, 16, 1)) == "[:, 4:12]"
    assert region_text((8, 4), 3, (2, 2), (4, 1)) == "4 elements from 3"  # wraps rows
    # a broadcast source (row 1 expanded over 3 rows: stride 0), which a slice with a
    # step of 0 cannot select, and an empty view
    row = w[1:2].expand(3, 4)
    assert region_text((8, 4), 4, tuple(row.shape), row.stride()) == "12 elements from 4"
    assert region_text((8, 4), 0, (0, 4), (4, 1)) == "0 elements from 0"


@pytest.mark.parametrize("order", ["increasing", "shuffled", "repeated at a piece's edge"])
def test_density_taken_in_pieces_equals_the_block_means(monkeypatch, order):
    import patchkit.density as density

    monkeypatch.setattr(density, "_PIECE", 7)  # many pieces, and edges between them
    g = torch.Generator().manual_seed(3)
    shape = (37, 23)
    idx = torch.randperm(math.prod(shape), generator=g)[:200].sort().values
    if order == "shuffled":
        idx = idx[torch.randperm(200, generator=g)]
    elif order == "repeated at a piece's edge":
        idx[7] = idx[6]  # increasing within each piece, not across the first edge
    for dtype in (torch.int32, torch.int64):  # (int64: the pieces are views of the patch's)
        p = CheckpointWeightPatch("w", shape, torch.float32, torch.ones(200), idx.to(dtype))
        for bins in [(5, 4), (37, 23), (64, 64)]:
            want = brute_force(p._replace(indices=idx.to(torch.int64)), bins)
            np.testing.assert_array_equal(density_map(p, bins).numpy(), want)
        assert torch.equal(p.indices, idx.to(dtype))  # left as they were


def test_density_makes_no_temporary_of_the_patchs_size():
    from torch.utils._python_dispatch import TorchDispatchMode

    import patchkit.density as density

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in () if func.is_view else out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    nnz = 3 * density._PIECE + 5
    step = 7
    idx = torch.arange(nnz, dtype=torch.int32) * step  # increasing, int32: converted too
    p = CheckpointWeightPatch("w", (nnz, step), torch.bfloat16,
                              torch.ones(nnz, dtype=torch.bfloat16), idx)
    with Largest():
        got = density_map(p, bins=(4, 7))
    assert Largest.most <= density._PIECE
    assert torch.equal(got, torch.tensor([[1.0] + [0.0] * 6] * 4))


def test_a_density_map_of_indices_on_the_meta_device_is_refused_by_name():
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(2, device="meta"),
                              torch.tensor([0, 5], device="meta"))
    with pytest.raises(ValueError, match=r"patch 'w'.*meta device") as e:
        density_map(p)
    assert e.value.reason == "meta device"


@pytest.mark.parametrize("full, offset, view, stride, text", [
    ((4, 6), 6, (12,), (1,), "[1:3, :]"),         # w.view(-1)[6:18]: rows 1 and 2
    ((24,), 0, (4, 6), (6, 1), "[:]"),            # a (24,) w written as w.view(4, 6)
    ((4, 6), 0, (24,), (1,), "[:, :]"),
    ((2, 3, 4), 12, (12,), (1,), "[1:2, :, :]"),
    ((2, 3, 4), 16, (8,), (1,), "[1:2, 1:3, :]"),
    ((2, 3, 4), 13, (3,), (1,), "[1:2, 0:1, 1:4]"),
    ((2, 3, 4), 13, (1, 3), (3, 1), "[1:2, 0:1, 1:4]"),  # (a size-1 dim, any stride)
    ((4, 6), 7, (12,), (1,), "12 elements from 7"),  # wraps rows partly: no box
    ((4, 6), 0, (4,), (7,), "4 elements from 0"),  # a diagonal: no box, no flat run
    ((4, 6), 24, (6,), (1,), "6 elements from 24"),  # beyond the tensor: as it is told
    ((4, 6), 0, (48,), (1,), "48 elements from 0"),
    ((0, 4), 0, (2,), (1,), "2 elements from 0"),
])
def test_a_reshaping_view_that_covers_a_box_is_written_as_that_box(
        full, offset, view, stride, text):
    # a write through w.view(-1)[6:18] was "12 elements from 6", not "[1:3, :]"
    assert region_text(full, offset, view, stride) == text


def test_a_density_map_divides_by_the_exact_element_count_of_a_block():
    # one index in a block of 2**24 + 1 rows: float32 block sizes would read 2**24 rows
    rows = 2**24 + 1
    p = CheckpointWeightPatch("w", (rows, 1), torch.float32, torch.ones(1), torch.tensor([5]))
    got = density_map(p, bins=(1, 1))
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert got.item() == torch.tensor(1 / rows, dtype=torch.float32).item() != 2.0**-24


def test_a_meta_patch_with_no_indices_is_mapped_as_writing_nothing():
    # no indices, so nothing the meta device lacks: zeros, as for an empty patch on the CPU
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(0, device="meta"),
                              torch.zeros(0, dtype=torch.int64, device="meta"))
    assert density_map(p, bins=(2, 2)).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_an_index_outside_the_tensor_says_which_indices_are_valid():
    p = CheckpointWeightPatch("w", (2, 3), torch.float32, torch.ones(1), torch.tensor([6]))
    with pytest.raises(ValueError) as info:
        density_map(p)
    assert str(info.value).endswith("for shape (2, 3) (6 elements; valid: [0, 6))")


def test_region_text_names_no_box_for_a_region_that_starts_before_the_tensor():
    # (as for one that ends past it: "<n> elements from <offset>". A box view's start was
    # read by floor division as row -1, "[-1:0, :]", and a flat run of whole rows was
    # named the box it would cover counted from the end, "[2:4, :]")
    assert region_text((4, 6), -6, (6,), (1,)) == "6 elements from -6"
    assert region_text((4, 6), -6, (2, 6), (6, 1)) == "12 elements from -6"
    assert region_text((4, 6), -12, (12,), (1,)) == "12 elements from -12"
    assert region_text((4, 6), -24, (24,), (1,)) == "24 elements from -24"
    assert region_text((4, 6), 24, (6,), (1,)) == "6 elements from 24"  # (past the end)
    assert region_text((4, 6), 0, (6,), (1,)) == "[0:1, :]"  # (the first row: a box)


def test_region_text_of_a_scalar_with_unknown_strides_is_the_empty_box():
    assert region_text((), 0, (), None) == "[]"
    assert region_text((), 0, (), ()) == "[]"


def test_a_box_inside_the_third_dimension_names_the_outer_indices_in_order():
    # rows 1:3 of w[1, 2] of a (2, 3, 4, 5) w, written through a flat view: its outer
    # indices are 1 then 2, not 2 then 1
    full = (2, 3, 4, 5)
    offset = 1 * 60 + 2 * 20 + 1 * 5
    got = region_text(full, offset, (10,), (1,))
    assert got == "[1:2, 2:3, 1:3, :]"
    written = torch.zeros(full, dtype=torch.bool)
    written.view(-1)[offset:offset + 10] = True
    assert torch.equal(_selected(got, full), written)


def test_a_flat_run_ignores_the_stride_of_a_dimension_of_size_one():
    # w.view(1, -1)[:, 6:18] of a (4, 6) w with the size-1 dimension's stride arbitrary
    # (torch keeps any stride there): still rows 1 and 2
    assert region_text((4, 6), 6, (1, 12), (5, 1)) == "[1:3, :]"
    assert region_text((4, 6), 6, (1, 12), (12, 1)) == "[1:3, :]"


def test_huge_bins_are_shown_cut_short():
    """``bins`` given a huge list, or an int too long to print, is refused with a short
    message (not its whole repr, nor Python's ValueError for printing it)."""
    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16))
    with pytest.raises(PatchTypeError, match=r"^bins must be a pair .*, got \[0\.5, ") as e:
        density_map(p, bins=[0.5] * 100_000)
    assert len(str(e.value)) < 300
    with pytest.raises(PatchValueError, match=r"^bins must be positive, got <a 16610-bit int>$"):
        density_map(p, bins=-(10**5000))
