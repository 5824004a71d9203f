"""Reports of loaders that write through a view of another element size than the
runtime tensor's (``p.data.view(torch.uint8)[rows].copy_(w.view(torch.uint8)[rows])``,
float32 written as float16 halves, 8-bit values written four at a time as int32 words),
or copy from such a view of the staged patch: ``writes`` gives offsets, shapes and
counts in the elements of the runtime tensor (``target_*``) and of the checkpoint tensor
(``checkpoint_offset``, ``checkpoint_region``), and ``deltas`` counts and measures
runtime elements. Where whole elements are written, the rows are checked by
``test_report_oracle``'s brute-force replay; a write of part of an element (one byte of
a float32) is reported as the element it touches, counted once.

And a sparse load whose loader casts a reinterpreted view of a patch
(``w.view(torch.bfloat16).to(torch.float8_e4m3fnuz)``, ``w.view(torch.int32).float()``):
the cast's elements hold no staged NaN where the patch keeps, so the copy is refused as
a reinterpreted source, as a copy of the view itself is.
"""

from __future__ import annotations

import collections

import pandas as pd
import pytest
import torch
from test_report_oracle import check, logged_load

import patchkit
from patchkit import CheckpointWeightPatch as P
from patchkit.bitwise import bits
from patchkit.errors import ContractViolation

U8, I16, I32, F16, BF16, F32 = (torch.uint8, torch.int16, torch.int32, torch.float16,
                                torch.bfloat16, torch.float32)
F8 = torch.float8_e4m3fn


class Viewed(torch.nn.Module):
    """One parameter ``w`` of ``shape`` and ``dtype`` (2-d), held row-major, as a column
    slice of a wider buffer (``layout="columns"``) or as every other row of a taller one
    (``"rows"``); ``load_weights`` hands it and each staged tensor to ``write``."""

    def __init__(self, shape, dtype, write, seed=0, layout="contiguous"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        start = torch.randn(shape, generator=g).to(dtype)
        if layout == "columns":  # (4 elements each side: int32 words stay aligned)
            start = torch.zeros(shape[0], shape[1] + 8, dtype=dtype)[:, 4:-4].copy_(start)
        elif layout == "rows":
            start = torch.zeros(2 * shape[0], shape[1], dtype=dtype)[::2].copy_(start)
        self.w = torch.nn.Parameter(start, requires_grad=False)
        self.write = write

    def load_weights(self, weights):
        for _, t in weights:
            self.write(self.w, t)
        return {n for n, _ in weights}


# Whole elements written through views of another element size, the checkpoint and
# runtime dtypes the same: name -> (shape, dtype, write).
WHOLE = {
    "uint8 rows of float32": ((4, 6), F32, lambda p, w: p.data.view(U8)[1:3].copy_(
        w.view(U8)[1:3])),
    "uint8 view of all of a float32": ((4, 6), F32, lambda p, w: p.data.view(U8).copy_(
        w.view(U8))),
    "uint8 part of a float32 row": ((4, 6), F32, lambda p, w: p.data.view(U8)[2, 8:20].copy_(
        w.view(U8)[2, 8:20])),
    "uint8 narrow columns of float32": ((4, 6), F32, lambda p, w: p.data.view(U8)[:, 4:12]
                                        .copy_(w.view(U8)[:, 4:12])),
    "uint8 rows of bfloat16": ((5, 4), BF16, lambda p, w: p.data.view(U8)[2:].copy_(
        w.view(U8)[2:])),
    "uint8 every other row of bfloat16": ((6, 4), BF16, lambda p, w: p.data.view(U8)[::2]
                                          .copy_(w.view(U8)[::2])),
    "int16 block of bfloat16 (same size)": ((4, 6), BF16, lambda p, w: p.data.view(I16)[
        1:3, 2:5].copy_(w.view(I16)[1:3, 2:5])),
    "float16 halves of float32 rows": ((4, 6), F32, lambda p, w: p.data.view(F16)[1:3]
                                       .copy_(w.view(F16)[1:3])),
    "float16 halves of float32 columns": ((4, 6), F32, lambda p, w: p.data.view(F16)[
        :, 2:8].copy_(w.view(F16)[:, 2:8])),
    "int32 words of float8 rows": ((4, 16), F8, lambda p, w: p.data.view(I32)[1:3].copy_(
        w.view(I32)[1:3])),
    "int32 words of float8 columns": ((4, 16), F8, lambda p, w: p.data.view(I32)[:, 1:3]
                                      .copy_(w.view(I32)[:, 1:3])),
    "int32 words of float8, one": ((4, 16), F8, lambda p, w: p.data.view(I32)[3, 2:3].copy_(
        w.view(I32)[3, 2:3])),
}


def _new_values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    new = torch.randn(shape, generator=g).to(dtype)
    keep = torch.rand(shape, generator=g) < 0.3  # (some elements unchanged)
    return new, keep


def _kept(keep, start, new):
    """``start`` where ``keep``, ``new`` elsewhere, chosen by bits (torch 2.4 has no
    float8 ``where`` on the CPU)."""
    return torch.where(keep, bits(start), bits(new)).view(start.dtype)


@pytest.mark.parametrize("how", list(WHOLE))
@pytest.mark.parametrize("twice", [False, True], ids=["once", "sent twice"])
@pytest.mark.parametrize("layout", ["contiguous", "columns", "rows"])
def test_writes_through_views_of_another_element_size_replay_to_the_model(how, twice,
                                                                           layout):
    # Before, the checkpoint side was counted in the view's elements (checkpoint_offset
    # 24 for rows 1:3 of a (4, 6) float32 read as bytes, and its region "48 elements
    # from 24"), the runtime side given as the flat span the bytes reach (narrow columns:
    # 20 elements where 8 were written, and deltas counted all 20).
    shape, dtype, write = WHOLE[how]
    m = Viewed(shape, dtype, write, layout=layout)
    start = m.w.detach().clone()
    patches = []
    for k in range(1 + twice):
        new, keep = _new_values(shape, dtype, 10 + k)
        new = _kept(keep, start, new) if k == 0 else new
        patches.append(P("w", shape, dtype, new.flatten()))
    L = logged_load(m, patches)
    assert not bits(L["after"]["w"]).equal(bits(start))  # (the load changed something)
    seen: collections.Counter = collections.Counter()
    assert check(L, seen) == []
    assert seen["dense writes"] == len(patches)
    assert seen["writes into non-contiguous tensors"] == len(patches) * (layout != "contiguous")
    # in the elements of the tensors themselves: the view's shape, never more elements
    # than the tensors have, and the regions as boxes
    w = L["report"].writes
    numel = L["before"]["w"].numel()
    assert (w["elements"] <= numel).all()
    assert not w["target_region"].str.contains("elements from").any()
    assert not w["checkpoint_region"].str.contains("elements from").any()


@pytest.mark.parametrize("layout", ["contiguous", "columns", "rows"])
def test_a_transposed_view_of_int32_words_of_float8_replays_to_the_model(layout):
    # (each word of the transposed view is no row of it, but four float8 elements: the
    # box's last dimension. Its words and their elements step along the columns, a
    # box of two dimensions of the tensor: its regions are "[:, 4:12]")
    shape = (4, 16)
    m = Viewed(shape, F8, lambda p, w: p.data.view(I32)[:, 1:3].t().copy_(
        w.view(I32)[:, 1:3].t()), layout=layout)
    start = m.w.detach().clone()
    new, keep = _new_values(shape, F8, 10)
    L = logged_load(m, [P("w", shape, F8, _kept(keep, start, new).flatten())])
    assert not bits(L["after"]["w"]).equal(bits(start))
    assert check(L, collections.Counter()) == []
    row = L["report"].writes.iloc[0]
    assert (tuple(row["shape"]), row["elements"]) == ((2, 4, 4), 32)
    assert (row["target_region"], row["checkpoint_region"]) == ("[:, 4:12]", "[:, 4:12]")
    assert L["report"].deltas.loc["w", "elements"] == 32


def test_the_rows_of_a_byte_view_of_float32_read_as_rows():
    m = Viewed((4, 6), F32, WHOLE["uint8 rows of float32"][2])
    new = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    r = patchkit.inspect_load(m, [P("w", (4, 6), F32, new.flatten())])
    row = r.writes.iloc[0]
    assert (row["checkpoint_offset"], row["checkpoint_region"]) == (6, "[1:3, :]")
    assert (row["target_offset"], row["target_region"]) == (6, "[1:3, :]")
    assert (tuple(row["shape"]), row["elements"], row["written"]) == ((2, 6), 12, 12)
    assert tuple(row["checkpoint_stride"]) == tuple(row["target_stride"]) == (6, 1)
    assert r.deltas.loc["w", "elements"] == 12


# Parts of elements: bytes 1:3 of each float32 of column 1 (two of its four bytes), one
# byte of one element, and the low float16 half of each element of row 2.
PARTIAL = {
    "two bytes of each element of a column": (
        lambda p, w: p.data.view(U8)[:, 5:7].copy_(w.view(U8)[:, 5:7]),
        "[:, 1:2]", (4, 1)),
    "one byte": (lambda p, w: p.data.view(U8)[1, 13:14].copy_(w.view(U8)[1, 13:14]),
                 "[1:2, 3:4]", (1,)),
    "low halves of a row": (lambda p, w: p.data.view(F16)[2, ::2].copy_(w.view(F16)[2, ::2]),
                            "[2:3, :]", (6,)),
    # (a column of bytes read down the rows, as a row: its size-1 first dimension steps
    # by one byte, no whole element, and takes no step)
    "one byte of each element of a column, transposed": (
        lambda p, w: p.data.view(U8)[:, 6:7].t().copy_(w.view(U8)[:, 6:7].t()),
        "[:, 1:2]", (1, 4)),
}


@pytest.mark.parametrize("how", list(PARTIAL))
def test_a_write_of_part_of_each_element_is_reported_as_the_elements_it_touches(how):
    write, region, shape = PARTIAL[how]
    m = Viewed((4, 6), F32, write)
    start = m.w.detach().clone()
    new = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    r = patchkit.inspect_load(m, [P("w", (4, 6), F32, new.flatten())])
    after = m.w.detach()
    probe = Viewed((4, 6), F32, write)  # the same write from zeros into all-ones bits
    probe.w.data.view(I32).fill_(-1)
    probe.write(probe.w, torch.zeros(4, 6))
    touched = bits(probe.w.detach()) != -1
    want = touched & (bits(after) != bits(start))
    n = int(touched.sum())
    row = r.writes.iloc[0]
    assert row["target_region"] == row["checkpoint_region"] == region
    assert tuple(row["shape"]) == shape
    assert row["elements"] == row["written"] == n
    assert row["changed"] == int(want.sum()) == int((bits(after) != bits(start)).sum())
    assert int(row["target_offset"]) == int(row["checkpoint_offset"]) == int(
        torch.nonzero(touched.flatten())[0])
    d = r.deltas.loc["w"]
    assert (d["elements"], d["changed"]) == (n, int(want.sum()))
    diff = (after.double() - start.double())[touched].abs()
    assert d["max_abs"] == pytest.approx(float(diff.max()))
    assert d["mean_abs"] == pytest.approx(float(diff.mean()))
    assert torch.equal(r.written("w"), touched)
    assert torch.equal(bits(r.before("w")), bits(start))


def test_rows_of_bytes_across_elements_are_reported_as_the_span_they_reach():
    # (rows of four bytes that start two bytes into an element: each touches two
    # elements, and the second row's first is the first row's last, so they make no box
    # of elements: the span they reach is given, each element once, and no checkpoint
    # offset)
    def write(p, w):
        p.data.view(U8).reshape(-1)[2:10].view(2, 4).copy_(
            w.view(U8).reshape(-1)[2:10].view(2, 4))

    m = Viewed((4, 6), F32, write)
    start = m.w.detach().clone()
    r = patchkit.inspect_load(m, [P("w", (4, 6), F32, torch.randn(24) + 5)])
    row = r.writes.iloc[0]
    assert (row["target_offset"], row["target_region"], tuple(row["shape"])) == (
        0, "[0:1, 0:3]", (3,))
    assert (row["elements"], row["changed"]) == (3, 3)
    assert (row["checkpoint_offset"] is pd.NA, row["checkpoint_region"]) == (True, None)
    assert r.deltas.loc["w", "elements"] == 3
    touched = torch.zeros(4, 6, dtype=torch.bool)
    touched[0, :3] = True
    assert torch.equal(r.written("w"), touched)
    assert torch.equal(bits(r.before("w")), bits(start))


def test_bytes_written_past_the_end_of_a_tensor_are_not_counted_as_its_elements():
    # (a and b are halves of one storage: 8 bytes from a's last element on reach b's
    # first. a's part is its last element, once; the box of both, which a's view would
    # extend past a, is not a's)
    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            flat = torch.zeros(16)
            self.a = torch.nn.Parameter(flat[:8].view(2, 4), requires_grad=False)
            self.b = torch.nn.Parameter(flat[8:].view(2, 4), requires_grad=False)

        def load_weights(self, weights):
            self.a.data.view(U8).as_strided((8,), (1,), 28).copy_(torch.arange(1, 9, dtype=U8))
            return {"a"}

    r = patchkit.inspect_load(Halves(), [P("a", (2, 4), F32, torch.randn(8))])
    row = r.writes.iloc[0]
    assert (row["target"], row["target_offset"], row["target_region"]) == ("a", 7, "[1:2, 3:4]")
    assert row["elements"] == 1
    last = torch.zeros(2, 4, dtype=torch.bool)
    last[1, 3] = True
    assert torch.equal(r.written("a"), last)


def test_float32_written_as_float16_halves_cast_from_a_bfloat16_patch():
    # The checkpoint's elements (bf16, 12 a row) land two to a runtime float32: the
    # checkpoint side in its own elements, the runtime side in the float32's.
    def write(p, w):
        p.data.view(F16)[1:3].copy_(w[1:3].to(F16))

    m = Viewed((4, 6), F32, write)
    start = m.w.detach().clone()
    new = torch.randn(4, 12, generator=torch.Generator().manual_seed(3)).to(BF16)
    r = patchkit.inspect_load(m, [P("w", (4, 12), BF16, new.flatten())])
    row = r.writes.iloc[0]
    assert (row["checkpoint_offset"], row["checkpoint_region"]) == (12, "[1:3, :]")
    assert (row["target_offset"], row["target_region"]) == (6, "[1:3, :]")
    assert (tuple(row["shape"]), row["elements"]) == ((2, 6), 12)
    assert tuple(row["checkpoint_stride"]) == (12, 1)
    assert torch.equal(m.w.detach().view(F16)[1:3], new.view(4, 12)[1:3].to(F16))
    d = r.deltas.loc["w"]
    assert (d["elements"], d["changed"]) == (12, int((bits(m.w.detach()) != bits(start)).sum()))
    assert torch.equal(bits(r.before("w")), bits(start))


# Copies the loader made of a byte view of the patch first: a clone moves the bits (its
# rows are still the checkpoint's rows), a cast makes one number of each byte (no
# checkpoint element is in its place: no offset). Before, the clone's rows were counted
# in bytes ("48 elements from 24"), and the cast's said checkpoint rows 0:2.
COPIED = {
    "a clone of the byte view": (lambda p, w: p.data.view(U8)[1:3].copy_(
        w.view(U8).clone()[1:3]), 6, "[1:3, :]"),
    "a clone of the byte view, viewed back": (lambda p, w: p.data[1:3].copy_(
        w.view(U8).clone().view(F32)[1:3]), 6, "[1:3, :]"),
    "a cast of the bytes": (lambda p, w: p.data[1:3].copy_(
        w.view(U8).float().reshape(-1)[:12].reshape(2, 6)), None, None),
    # (a clone of rows 1: of the bytes: its byte 0 is checkpoint element 6)
    "a clone of the byte view's rows 1:": (lambda p, w: p.data.view(U8)[1:3].copy_(
        w.view(U8)[1:].clone()[:2]), 6, "[1:3, :]"),
    # (the bytes copied one byte into a scratch: no checkpoint element starts where a
    # float32 of the scratch does, and its rows 1:3 are no checkpoint rows)
    "the bytes one byte into a scratch": (lambda p, w: p.data.view(U8)[1:3].copy_(
        _one_byte_in(w)[24:72].view(2, 24)), None, None),
}


def _one_byte_in(w):
    scratch = torch.zeros(w.numel() * 4 + 4, dtype=U8)
    scratch[1:-3].copy_(w.view(U8).reshape(-1))
    return scratch


@pytest.mark.parametrize("how", list(COPIED))
def test_a_copy_the_loader_made_of_a_byte_view_keeps_checkpoint_rows_or_none(how):
    write, offset, region = COPIED[how]
    m = Viewed((4, 6), F32, write)
    r = patchkit.inspect_load(m, [P("w", (4, 6), F32, torch.randn(24))])
    row = r.writes.iloc[0]
    assert (row["position"], row["name"], row["target_region"]) == (0, "w", "[1:3, :]")
    got = None if row["checkpoint_offset"] is pd.NA else int(row["checkpoint_offset"])
    assert (got, row["checkpoint_region"]) == (offset, region)


# NaN-merges through a view of another element size (the source a cast of the patch, as
# a sparse load needs: a reinterpreted source is refused).
SPARSE = {
    # float32 rows 1:3 written as float16 halves from a float16 patch of (4, 12)
    "float16 halves of float32 rows": ((4, 6), F32, (4, 12), F16,
                                       lambda p, w: p.data.view(F16)[1:3].copy_(w[1:3]),
                                       "[1:3, :]", "[1:3, :]"),
    # column 1 of (4, 3) int32 words holding float8 (4, 12), from a bfloat16 patch
    "float8 in int32 words, a column": ((4, 3), I32, (4, 12), BF16,
                                        lambda p, w: p.data.view(F8)[:, 4:8].copy_(
                                            w.to(F8)[:, 4:8]),
                                        "[:, 1:2]", "[:, 4:8]"),
}


@pytest.mark.parametrize("how", list(SPARSE))
def test_a_nan_merge_through_a_view_of_another_element_size_counts_runtime_elements(how):
    shape, dtype, ck_shape, ck_dtype, write, tregion, cregion = SPARSE[how]
    m = Viewed(shape, dtype, write)
    if dtype == I32:
        m.w.data.copy_(torch.randint(-2**31, 2**31 - 1, shape,
                                     generator=torch.Generator().manual_seed(4)))
    start = m.w.detach().clone()
    g = torch.Generator().manual_seed(5)
    numel = ck_shape[0] * ck_shape[1]
    idx = torch.randperm(numel, generator=g)[:20].sort().values
    vals = torch.randn(20, generator=g).to(ck_dtype)
    r = patchkit.inspect_load(m, [P("w", ck_shape, ck_dtype, vals, idx)])
    after = m.w.detach()
    staged = torch.full((numel,), float("nan"), dtype=ck_dtype)
    staged[idx] = vals
    # which runtime elements a written (not-NaN) entry lands in: write ones, read back
    mark = Viewed(shape, dtype, write)
    mark.w.data.view(U8).fill_(0)
    lit = torch.where(staged.isnan(), torch.zeros_like(staged), torch.ones_like(staged))
    write(mark.w, lit.view(ck_shape))
    written = mark.w.detach().view(U8).reshape(*shape, -1).ne(0).any(-1)
    row = r.writes.iloc[0]
    assert (row["target_region"], row["checkpoint_region"]) == (tregion, cregion)
    assert row["written"] == int(written.sum()) > 0
    assert row["changed"] == int((bits(after) != bits(start)).sum())
    d = r.deltas.loc["w"]
    assert (d["elements"], d["changed"]) == (int(written.sum()), row["changed"])
    assert torch.equal(r.written("w"), written)
    assert torch.equal(bits(r.before("w")), bits(start))


# ------------------------------------------------------------- casts of reinterpreted views

class _Cast(torch.nn.Module):
    def __init__(self, n, dtype, make):
        super().__init__()
        self.h = torch.nn.Parameter((torch.arange(float(n)) + 0.25).to(dtype),
                                    requires_grad=False)
        self.make = make

    def load_weights(self, weights):
        for _, w in weights:
            self.h.data.copy_(self.make(w))
        return {"h"}


FNUZ = torch.float8_e4m3fnuz
CASTS = {
    # the bf16 halves of the float32 staged tensor (a NaN's low half is 0.0), cast to fp8:
    # refused as "NaN in the runtime dtype" before, for a value that is no NaN
    "bfloat16 halves cast to float8_e4m3fnuz": (8, FNUZ, 4, lambda w: w.view(BF16).to(FNUZ)),
    # the staged NaN's bits as an integer, cast back: before, 2.14e9 written into the model
    # where the patch keeps, with no error
    "int32 bits cast to float32": (4, F32, 4, lambda w: w.view(I32).to(F32)),
    "int32 bits cast to float64": (4, torch.float64, 4, lambda w: w.view(I32).double()),
    "int32 bits cast twice": (4, FNUZ, 4, lambda w: w.view(I32).to(F32).to(FNUZ)),
    "bfloat16 halves cast, then cloned": (8, F32, 4, lambda w: w.view(BF16).float().clone()),
    # (a strided view: its cast is no element-for-element copy of the patch's elements)
    "every other bfloat16 half cast to float32": (4, F32, 4,
                                                  lambda w: w.view(BF16)[0::2].float()),
    # a cat whose first part is the patch's own values, its second a cast of int32 bits:
    # only the first part's stretch was read, and the staged NaN's bits went into the model
    "int32 bits cast, after a plain part in a cat": (
        4, F32, 4, lambda w: torch.cat([w[:2].clone(), w[2:].view(I32).float()])),
}


@pytest.mark.parametrize("how", list(CASTS))
@pytest.mark.parametrize("inspected", [False, True])
def test_a_cast_of_a_reinterpreted_view_of_a_sparse_patch_is_refused_as_reinterpreted(
        how, inspected):
    n, dtype, ck, make = CASTS[how]
    m = _Cast(n, dtype, make)
    before = bits(m.h.detach()).clone()
    ps = [P("w", (ck,), F32, torch.tensor([1.0]), torch.tensor([1]))]
    with pytest.raises(ContractViolation, match="another dtype") as e:
        if inspected:
            patchkit.inspect_load(m, ps)
        else:
            patchkit.load_checkpoint_weight_patches(m, ps)
    assert (e.value.position, e.value.name, e.value.reason) == (0, "w", "reinterpreted source")
    assert e.value.value[0] == F32
    assert "patch 0 ('w')" in str(e.value)
    assert torch.equal(bits(m.h.detach()), before)


def test_a_cast_of_a_complex_view_of_a_patch_still_merges():
    # (a complex64 view of float32 pairs reads the patch's own float32 elements: cast to
    # complex128 and read back as float64, each NaN is still NaN)
    m = _Cast(4, torch.float64, lambda w: torch.view_as_real(
        torch.view_as_complex(w.view(2, 2)).to(torch.complex128)).reshape(-1))
    want = m.h.detach().clone()
    want[1] = 1.0
    patchkit.load_checkpoint_weight_patches(
        m, [P("w", (4,), F32, torch.tensor([1.0]), torch.tensor([1]))])
    assert torch.equal(bits(m.h.detach()), bits(want))


class _ComplexScratch(torch.nn.Module):
    """Casts patches "a" and "b" to complex64 into one scratch of 8, then copies the real
    part of each half into its own parameter."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.arange(4.0) + 10.5, requires_grad=False)
        self.b = torch.nn.Parameter(torch.arange(4.0) + 0.5, requires_grad=False)

    def load_weights(self, weights):
        w = dict(weights)
        buf = torch.zeros(8, dtype=torch.complex64)
        buf[:4].copy_(w["a"])
        buf[4:].copy_(w["b"])
        self.a.data.copy_(buf[:4].real)
        self.b.data.copy_(buf[4:].real)
        return {"a", "b"}


def test_the_real_parts_of_a_complex_scratch_of_two_patches_still_merge():
    # (the scratch holds two stretches, so each read is searched: a complex64 stretch
    # read as float32 reads its parts' own numbers, each NaN still NaN)
    m = _ComplexScratch()
    want = [m.a.detach().clone(), m.b.detach().clone()]
    want[0][1], want[1][1:3] = 9.0, torch.tensor([7.0, -3.0])
    patchkit.load_checkpoint_weight_patches(m, [
        P("a", (4,), F32, torch.tensor([9.0]), torch.tensor([1])),
        P("b", (4,), F32, torch.tensor([7.0, -3.0]), torch.tensor([1, 2]))])
    assert torch.equal(bits(m.a.detach()), bits(want[0]))
    assert torch.equal(bits(m.b.detach()), bits(want[1]))


@pytest.mark.parametrize("make", [lambda w: w.to(BF16).to(FNUZ),
                                  lambda w: w.view(I32).view(F32).to(FNUZ),
                                  lambda w: w.view(I32).clone().view(F32).to(FNUZ)],
                         ids=["cast twice", "viewed back", "cloned bits viewed back"])
def test_casts_of_a_patch_read_as_its_own_dtype_still_merge(make):
    m = _Cast(4, FNUZ, make)
    want = m.h.detach().clone()
    want[1].copy_(torch.tensor(1.0))  # (torch 2.4 has no float8 fill on the CPU)
    r = patchkit.inspect_load(m, [P("w", (4,), F32, torch.tensor([1.0]), torch.tensor([1]))])
    assert torch.equal(bits(m.h.detach()), bits(want))
    assert r.writes["written"].tolist() == [1]
    assert r.writes["checkpoint_offset"].tolist() == [0]


# Boxes of int32 words whose dimensions step along one dimension of the tensor twice
# (each word is several elements): name -> (shape, dtype, write, region).
WORD_BOXES = {
    "float8 columns, transposed": ((4, 16), F8, lambda p, w: p.data.view(I32)[:, 1:3].t()
                                   .copy_(w.view(I32)[:, 1:3].t()), "[:, 4:12]"),
    "bfloat16 rows taken in pairs": ((4, 8), BF16, lambda p, w: p.data.view(I32).view(
        2, 2, 4)[:, :, 1:3].copy_(w.view(I32).view(2, 2, 4)[:, :, 1:3]), "[:, 2:6]"),
    "3-d bfloat16, rows and columns swapped": (
        (2, 4, 8), BF16, lambda p, w: p.data.view(I32)[:, :, 1:3].transpose(1, 2).copy_(
            w.view(I32)[:, :, 1:3].transpose(1, 2)), "[:, :, 2:6]"),
    "3-d float8, permuted": ((2, 4, 16), F8, lambda p, w: p.data.view(I32)[:, :, 1:3]
                             .permute(2, 0, 1).copy_(w.view(I32)[:, :, 1:3].permute(2, 0, 1)),
                             "[:, :, 4:12]"),
}


@pytest.mark.parametrize("how", list(WORD_BOXES))
def test_a_box_of_int32_words_reads_as_the_box_of_the_tensor_it_is(how):
    # Before, a box whose words and their elements step along one dimension of the
    # tensor (the first: shape (2, 4, 4), strides (4, 16, 1) in float8 elements) was
    # written "32 elements from 4", as if it were a flat run of the tensor.
    shape, dtype, write, region = WORD_BOXES[how]
    m = Viewed(shape, dtype, write)
    start = m.w.detach().clone()
    new, keep = _new_values(shape, dtype, 10)
    L = logged_load(m, [P("w", shape, dtype, _kept(keep, start, new).flatten())])
    assert check(L, collections.Counter()) == []
    row = L["report"].writes.iloc[0]
    assert (row["target_region"], row["checkpoint_region"]) == (region, region)
