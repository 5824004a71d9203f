"""Sparse loads whose loaders move a patch's data into tensors of their own before a copy
reads it: the staged NaN ("keep") must stay recognisable, or the load refused, wherever
the data went."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit.bitwise import bits
from patchkit.errors import ContractViolation

# Ways a loader puts a (6, 4) float32 checkpoint tensor's data, or that of two (3, 4)
# ones, into a (6, 4) float32 tensor of its own. None of them can be followed element
# for element (a transposed or column-sliced copy, a gather, data of two patches), so
# the result was once taken for data of no patch at all.


def _transposed_into_scratch(w):
    buf = torch.empty(6, 4)
    buf.copy_(w["a"].reshape(4, 6).t())  # (a checkpoint kept transposed)
    return buf


def _into_a_transposed_scratch(w):
    buf = torch.empty(4, 6)
    buf.t().copy_(w["a"])
    return buf.t().contiguous()


def _flipped_into_scratch(w):
    buf = torch.empty(6, 4)
    buf.copy_(w["a"].flip(0))
    return buf


def _columns_into_scratch(w):
    buf = torch.zeros(6, 4)
    buf[:, :2].copy_(w["a"][:, 2:])
    return buf


def _cat_of_two(w):
    return torch.cat([w["a"], w["b"]])


def _cat_of_two_into_scratch(w):
    buf = torch.empty(6, 4)
    torch.cat([w["a"], w["b"]], out=buf)
    return buf


def _cat_of_two_as_integers(w):
    # (the bits moved as int32: data, though no floating-point tensor is traced)
    return torch.cat([w["a"].view(torch.int32), w["b"].view(torch.int32)]).view(torch.float32)


def _rows_put_into_scratch(w):
    buf = torch.empty(6, 4)
    buf[torch.tensor([5, 4, 3, 2, 1, 0])] = w["a"]
    return buf


def _added_into_zeros(w):
    buf = torch.zeros(6, 4)
    buf.add_(w["a"])
    return buf


def _cloned_after_padding(w):
    # (rows of padding first: the clone starts where no patch's data is)
    buf = torch.zeros(8, 4)
    buf[2:].copy_(w["a"])
    return buf.clone()[2:]


def _sorted(w):
    # (an op of two results: values and indices)
    return torch.sort(w["a"], dim=0, stable=True).values


_MOVES = {
    "transposed into scratch": (_transposed_into_scratch, 1),
    "into a transposed scratch": (_into_a_transposed_scratch, 1),
    "flipped into scratch": (_flipped_into_scratch, 1),
    "columns into scratch": (_columns_into_scratch, 1),
    "cat of two patches": (_cat_of_two, 2),
    "cat of two patches, out=": (_cat_of_two_into_scratch, 2),
    "cat of two patches as integers": (_cat_of_two_as_integers, 2),
    "rows put into scratch": (_rows_put_into_scratch, 1),
    "added into zeros": (_added_into_zeros, 1),
    "cloned after padding": (_cloned_after_padding, 1),
    "sorted": (_sorted, 1),
}


def _patches(count):
    if count == 1:
        return [CWP("a", (6, 4), torch.float32, torch.tensor([1.5, -2.5, 3.5]),
                    torch.tensor([3, 7, 18]))]
    return [CWP(n, (3, 4), torch.float32, torch.tensor([1.5 + k, -2.5]),
                torch.tensor([1, 6 + k])) for k, n in enumerate("ab")]


class _Words(nn.Module):
    """Moves the staged data with ``move``, then copies it as 8-byte words (float64)
    into its float32 parameter of ``shape``, or, with ``words=False``, as the float32 it
    is."""

    def __init__(self, move, words, shape=(6, 4)):
        super().__init__()
        n = math.prod(shape)
        self.h = nn.Parameter(torch.arange(float(n)).reshape(shape) + 0.25,
                              requires_grad=False)
        self.move, self.words = move, words

    def load_weights(self, weights):
        moved = self.move(dict(weights))
        if self.words:
            self.h.data.view(torch.float64).copy_(moved.view(torch.float64))
        else:
            self.h.data.copy_(moved)
        return {"h"}


@pytest.mark.parametrize("how", list(_MOVES))
@pytest.mark.parametrize("inspected", [False, True])
def test_patch_data_moved_into_a_loaders_own_tensor_then_read_as_another_dtype_is_refused(
        how, inspected):
    # Two float32 NaN read as one float64 are a number (0x7FC00000_7FC00000), so a merge
    # of those words writes the staged NaN bits into the model. Before, a loader that
    # moved the patch's data as above first left it untraced, and 20-odd NaN landed in
    # the model without an error.
    move, count = _MOVES[how]
    m = _Words(move, words=True)
    before = bits(m.h.detach()).clone()
    with pytest.raises(ContractViolation, match="another dtype") as e:
        if inspected:
            patchkit.inspect_load(m, _patches(count))
        else:
            patchkit.load_checkpoint_weight_patches(m, _patches(count))
    assert (e.value.reason, e.value.value) == (
        "reinterpreted source", (torch.float32, torch.float64))
    # one patch named where one fed it; data of two patches names none
    assert (e.value.position, e.value.name) == ((0, "a") if count == 1 else (None, None))
    assert torch.equal(bits(m.h.detach()), before)
    assert not torch.isnan(m.h).any()


@pytest.mark.parametrize("how", [h for h in _MOVES if h != "sorted"])
def test_patch_data_moved_into_a_loaders_own_tensor_and_copied_as_itself_still_merges(how):
    # The same moves, read back as the float32 they are: merged as before, the runtime
    # value kept wherever the moved data is NaN. (Not the sort: a sort of a patch's data
    # holding NaN puts its numbers at other elements, and such a copy is refused since,
    # reason "mixed elements": tests/test_mixing_loaders.py.)
    move, count = _MOVES[how]
    m = _Words(move, words=False)
    staged = {p.name: patchkit.stage(p) for p in _patches(count)}
    moved = move(staged)
    want = torch.where(moved.isnan(), m.h.detach(), moved)
    patchkit.load_checkpoint_weight_patches(m, _patches(count))
    assert torch.equal(bits(m.h.detach()), bits(want))


def test_a_clone_of_a_scratch_buffer_of_two_patches_names_each_patchs_writes():
    # The loader copies patches a and b into one scratch buffer, clones it, and copies
    # each half into a parameter. The clone was credited whole to the patch where it
    # starts: the report said p2's write came from patch a, at checkpoint offset 8 of
    # its 8 elements.
    class Halves(nn.Module):
        def __init__(self):
            super().__init__()
            self.p1 = nn.Parameter(torch.zeros(8), requires_grad=False)
            self.p2 = nn.Parameter(torch.zeros(8), requires_grad=False)

        def load_weights(self, weights):
            w = dict(weights)
            buf = torch.empty(16)
            buf[:8].copy_(w["a"])
            buf[8:].copy_(w["b"])
            c = buf.clone()
            self.p1.copy_(c[:8])
            self.p2.copy_(c[8:])
            return {"p1", "p2"}

    ps = [CWP(n, (8,), torch.float32, torch.tensor([1.0 + k]), torch.tensor([2 + k]))
          for k, n in enumerate("ab")]
    m = Halves()
    r = patchkit.inspect_load(m, ps)
    w = r.writes
    assert w["target"].tolist() == ["p1", "p2"]
    assert w["position"].tolist() == [0, 1]
    assert w["name"].tolist() == ["a", "b"]
    assert w["checkpoint_offset"].tolist() == [0, 0]
    assert w["written"].tolist() == [1, 1]
    assert m.p1.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert m.p2.tolist() == [0, 0, 0, 2, 0, 0, 0, 0]


class _Holds(nn.Module):
    """Keeps what each call stages until both halves have come (one call or two), then
    copies them into its parameter: as 8-byte words (``words``) or as themselves."""

    def __init__(self, words, keep=None):
        super().__init__()
        self.h = nn.Parameter(torch.arange(24.0).reshape(6, 4) + 0.25, requires_grad=False)
        self.words = words
        self.keep = keep  # (what of a staged tensor it keeps: the tensor itself, or this)
        self.held = {}

    def load_weights(self, weights):
        self.held.update((n, t if self.keep is None else self.keep(t)) for n, t in weights)
        if len(self.held) < 2:
            return set()  # (nothing of its own loaded yet)
        for k, n in enumerate("ab"):
            dst = self.h.data[3 * k:3 * k + 3]
            if self.words:
                dst.view(torch.float64).copy_(self.held[n].view(torch.float64))
            else:
                dst.copy_(self.held[n])
        self.held.clear()
        return {"h"}


@pytest.mark.parametrize("budget", [48, 1 << 20], ids=["a call each", "one call"])
def test_patch_data_a_loader_keeps_for_a_later_call_read_as_another_dtype_is_refused(budget):
    # What a call staged was traced for that call only: patch a, kept by the loader for
    # the next call and read there as float64, went unrefused (11 NaN in the model).
    m = _Holds(words=True)
    before = bits(m.h.detach()).clone()
    ps = [CWP(n, (3, 4), torch.float32, torch.tensor([5.0 + k]), torch.tensor([1 + k]))
          for k, n in enumerate("ab")]
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=budget)
    assert (e.value.position, e.value.name, e.value.reason) == (0, "a", "reinterpreted source")
    assert torch.equal(bits(m.h.detach()), before)


@pytest.mark.parametrize("budget", [48, 1 << 20], ids=["a call each", "one call"])
def test_patch_data_a_loader_keeps_for_a_later_call_still_merges_and_is_named(budget):
    m = _Holds(words=False)
    want = m.h.detach().clone()
    want.view(-1)[1], want.view(-1)[12 + 2] = 5.0, 6.0
    ps = [CWP(n, (3, 4), torch.float32, torch.tensor([5.0 + k]), torch.tensor([1 + k]))
          for k, n in enumerate("ab")]
    r = patchkit.inspect_load(m, ps, max_chunk_bytes=budget)
    assert torch.equal(bits(m.h.detach()), bits(want))
    assert r.writes["name"].tolist() == ["a", "b"]
    assert r.writes["written"].tolist() == [1, 1]


# A scratch buffer that holds patch a, whose first elements the loader then overwrites
# with patch b's data: the rest still holds a's data. A write over part of a stretch once
# dropped all of it, so a's data in the rest was taken for data of no patch.


def _a_then_b_added_into_its_head(w):
    buf = w["a"].clone()
    buf[:4].add_(w["b"][:4])
    return buf[8:]


def _a_then_b_copied_into_its_head(w):
    buf = w["a"].clone()
    buf[:4].copy_(w["b"][:4])
    return buf[8:]


def _a_then_a_clone_of_b_into_its_head(w):
    buf = torch.empty(16)
    buf.copy_(w["a"])
    buf[:4].copy_(w["b"][:4].clone())
    return buf[8:]


def _a_then_untraced_data_into_its_middle(w):
    buf = torch.empty(16)
    buf.copy_(w["a"])
    buf[2:6].copy_(torch.ones(4))
    return buf[8:]


_HEADS = {
    "b added into its head": _a_then_b_added_into_its_head,
    "b copied into its head": _a_then_b_copied_into_its_head,
    "a clone of b into its head": _a_then_a_clone_of_b_into_its_head,
    "untraced data into its middle": _a_then_untraced_data_into_its_middle,
}


class _Tail(nn.Module):
    """Copies what ``body`` makes of the staged data into the second half of its
    parameter: as 8-byte words (``words``) or as the float32 it is."""

    def __init__(self, body, words):
        super().__init__()
        self.h = nn.Parameter(torch.arange(16.0) + 0.25, requires_grad=False)
        self.body, self.words = body, words

    def load_weights(self, weights):
        src = self.body(dict(weights))
        if self.words:
            self.h.data[8:].view(torch.float64).copy_(src.view(torch.float64))
        else:
            self.h.data[8:].copy_(src)
        return {"h"}


def _two_of_16():
    return [CWP(n, (16,), torch.float32, torch.tensor([5.0 + k, 7.0 + k]),
                torch.tensor([1 + k, 9 + k])) for k, n in enumerate("ab")]


@pytest.mark.parametrize("how", list(_HEADS))
def test_the_rest_of_a_scratch_buffer_partly_overwritten_keeps_its_patch(how):
    # Read as float64, a's rest was not refused (7 NaN landed in the model); copied as
    # itself, the report named no patch for its write.
    m = _Tail(_HEADS[how], words=True)
    before = bits(m.h.detach()).clone()
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, _two_of_16())
    assert (e.value.position, e.value.name, e.value.reason) == (0, "a", "reinterpreted source")
    assert torch.equal(bits(m.h.detach()), before)
    m = _Tail(_HEADS[how], words=False)
    want = m.h.detach().clone()
    want[9] = 7.0  # (a's entry at checkpoint index 9; the rest of a is NaN: kept)
    r = patchkit.inspect_load(m, _two_of_16())
    assert torch.equal(bits(m.h.detach()), bits(want))
    assert r.writes["name"].tolist() == ["a"]
    assert r.writes["checkpoint_offset"].tolist() == [8]


_KEPT = {"a detach() of it": torch.Tensor.detach, "its .data": lambda t: t.data}


@pytest.mark.parametrize("keep", list(_KEPT))
def test_patch_data_a_loader_keeps_only_an_alias_of_for_a_later_call_stays_traced(keep):
    # A loader that keeps w.detach() (or w.data), not w, lets the staged tensor go while
    # its storage lives on: a's stretch was forgotten before the next call, so read as
    # float64 there it went unrefused until b's copy (a's NaN written first), and the
    # report named no patch for a's write.
    ps = [CWP(n, (3, 4), torch.float32, torch.tensor([5.0 + k]), torch.tensor([1 + k]))
          for k, n in enumerate("ab")]
    m = _Holds(words=True, keep=_KEPT[keep])
    before = bits(m.h.detach()).clone()
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=48)
    assert (e.value.position, e.value.name, e.value.reason) == (0, "a", "reinterpreted source")
    assert torch.equal(bits(m.h.detach()), before)
    m = _Holds(words=False, keep=_KEPT[keep])
    r = patchkit.inspect_load(m, ps, max_chunk_bytes=48)
    assert r.writes["name"].tolist() == ["a", "b"]
    assert r.writes["checkpoint_offset"].tolist() == [0, 0]
    assert r.writes["written"].tolist() == [1, 1]


# Patch b's data moved by indices or a mask made from patch a (an argsort of a, a NaN
# mask of a): the result is b's data, in a's order. The indices were counted as data, so
# it was taken for data of two patches and named none.


def _order_of_a(w):
    return torch.argsort(w["a"].nan_to_num(), stable=True)


_ORDERED = {
    "gathered": lambda w: w["b"][_order_of_a(w)],
    "put": lambda w: torch.empty(16).index_put_((_order_of_a(w),), w["b"]),
    "index_copy_": lambda w: torch.empty(16).index_copy_(0, _order_of_a(w), w["b"]),
    "where": lambda w: torch.where(w["a"].isnan(), w["b"], w["b"] * 2),
    "gathered as complex": lambda w: torch.view_as_real(torch.view_as_complex(
        w["b"].reshape(8, 2))[torch.argsort(w["a"][:8].nan_to_num(), stable=True)]
    ).reshape(16),
}


@pytest.mark.parametrize("how", list(_ORDERED))
def test_patch_data_moved_by_indices_or_a_mask_from_another_patch_names_its_own(how):
    m = _Words(_ORDERED[how], words=True, shape=(16,))
    before = bits(m.h.detach()).clone()
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, _two_of_16())
    assert (e.value.position, e.value.name, e.value.reason) == (1, "b", "reinterpreted source")
    assert torch.equal(bits(m.h.detach()), before)
    m = _Words(_ORDERED[how], words=False, shape=(16,))
    staged = {p.name: patchkit.stage(p) for p in _two_of_16()}
    moved = _ORDERED[how](staged)
    want = torch.where(moved.isnan(), m.h.detach(), moved)
    r = patchkit.inspect_load(m, _two_of_16())
    assert torch.equal(bits(m.h.detach()), bits(want))
    assert r.writes["position"].tolist() == [1]
    assert r.writes["name"].tolist() == ["b"]


def test_a_sparse_write_by_indices_from_another_patch_is_refused_naming_its_data():
    # index_copy_ into a parameter is refused in a sparse load; its error names the
    # patch the op's data came from (b), not the one its indices were sorted from.
    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.Parameter(torch.zeros(16), requires_grad=False)

        def load_weights(self, weights):
            w = dict(weights)
            self.h.data.index_copy_(0, _order_of_a(w), w["b"])
            return {"h"}

    with pytest.raises(ContractViolation, match="index_copy") as e:
        patchkit.load_checkpoint_weight_patches(Indexed(), _two_of_16())
    assert (e.value.position, e.value.name, e.value.reason) == (1, "b", "unsupported op")


# Scratch copies a loader makes of patches a and b (8 elements each), two 4-element views
# of which it copies into its two parameters: what the report names for each write.
# (Ways a mutation pass of the provenance found untested.)


def _two_of_8():
    return [CWP("a", (8,), torch.float32, torch.tensor([1.0, 3.0]), torch.tensor([1, 5])),
            CWP("b", (8,), torch.float32, torch.tensor([2.0]), torch.tensor([1]))]


def _cast_of_two(w):
    buf = torch.empty(16)
    buf[:8].copy_(w["a"])
    buf[8:].copy_(w["b"])
    c = buf.to(torch.float64)  # (read back as float64: b's half at c[8:])
    return c[4:8], c[8:12]


def _padding_and_a_into_a_buffer_of_b(w):
    scratch = torch.zeros(12)
    scratch[4:].copy_(w["a"])
    buf = torch.empty(16)
    buf[8:].copy_(w["b"])
    buf[:8].copy_(scratch[:8])  # (4 of padding, then a's first 4: b's half untouched)
    return buf[4:8], buf[8:12]


def _padding_then_a_over_b(w):
    buf = w["b"].clone()
    scratch = torch.zeros(8)
    scratch[4:].copy_(w["a"][:4])
    buf.copy_(scratch)  # (b's data gone: padding, then a's first 4)
    return buf[:4], buf[4:]


def _a_scaled_in_place(w):
    buf = w["a"].clone()
    buf.mul_(1.0)  # (a's data still, in its place)
    return buf[:4], buf[4:]


def _b_put_into_a(w):
    # (an add of b onto a copy of a pairs two patches' elements, refused: see
    # tests/test_mixing_loaders.py; a put moves b's elements in)
    buf = w["a"].clone()
    at = torch.tensor([2, 6])
    buf.index_copy_(0, at, w["b"][at])
    return buf[:4], buf[4:]


def _flip_of_two(w):
    buf = torch.empty(16)
    buf[:8].copy_(w["a"])
    buf[8:].copy_(w["b"])
    f = buf.flip(0)
    return f[:4], f[12:]


_SCRATCH = {
    "a cast of a buffer of two patches": (_cast_of_two, ["a", "b"], [4, 0]),
    "padding and a into a buffer of b": (_padding_and_a_into_a_buffer_of_b, ["a", "b"], [0, 0]),
    "padding then a over b": (_padding_then_a_over_b, [None, "a"], [None, 0]),
    "a scaled in place": (_a_scaled_in_place, ["a", "a"], [0, 4]),
    "b put into a": (_b_put_into_a, [None, None], [None, None]),
    "a flip of a buffer of two patches": (_flip_of_two, [None, None], [None, None]),
}


class _Pair(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.p1 = nn.Parameter(torch.arange(4.0) + 0.5, requires_grad=False)
        self.p2 = nn.Parameter(torch.arange(4.0) + 10.5, requires_grad=False)
        self.body = body

    def load_weights(self, weights):
        s1, s2 = self.body(dict(weights))
        self.p1.copy_(s1)
        self.p2.copy_(s2)
        return {"p1", "p2"}


@pytest.mark.parametrize("how", list(_SCRATCH))
def test_what_a_scratch_copy_of_two_patches_names(how):
    body, names, offsets = _SCRATCH[how]
    m = _Pair(body)
    staged = {p.name: patchkit.stage(p) for p in _two_of_8()}
    want = [torch.where(s.isnan(), p.detach(), s.float())
            for s, p in zip(body(staged), (m.p1, m.p2))]
    r = patchkit.inspect_load(m, _two_of_8())
    assert torch.equal(bits(m.p1.detach()), bits(want[0]))
    assert torch.equal(bits(m.p2.detach()), bits(want[1]))
    w = r.writes
    assert w["target"].tolist() == ["p1", "p2"]
    assert [None if n is None or n != n else n for n in w["name"].tolist()] == names
    assert [None if o is pd.NA else o for o in w["checkpoint_offset"].tolist()] == offsets


def test_data_of_two_patches_of_two_calls_is_refused_naming_the_calls_patch():
    # The loader keeps a (call 0) and, in call 1 (b's), copies a cat of both as float64:
    # refused, the error naming the one patch of the call (no source names one).
    class CatHeld(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.Parameter(torch.arange(16.0) + 0.25, requires_grad=False)
            self.held = []

        def load_weights(self, weights):
            self.held.extend(t for _, t in weights)
            if len(self.held) < 2:
                return set()
            both = torch.cat(self.held)
            self.h.data.view(torch.float64).copy_(both.view(torch.float64))
            return {"h"}

    ps = [CWP(n, (8,), torch.float32, torch.tensor([5.0 + k]), torch.tensor([1 + k]))
          for k, n in enumerate("ab")]
    m = CatHeld()
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=32)
    assert (e.value.position, e.value.name, e.value.reason) == (1, "b", "reinterpreted source")
    assert "call 1" in str(e.value)
