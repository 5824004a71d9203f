"""Edge cases a mutation audit of the suite found untested: each test here fails when the
line it names is changed in a plausible way (an off-by-one, a dropped check)."""

from __future__ import annotations

import contextlib
import re
import warnings

import pandas as pd
import pytest
import torch
from _torch_features import (
    E8M0,
    NO_E8M0,
    needs_float8_fill,
    needs_float8_index,
    needs_fp4_copy,
)
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import inspect_load, patch_summary
from patchkit.build import changed_fraction, random_sparse_patch
from patchkit.errors import PatchValueError
from patchkit.toymodels import PlainModel


def _dev():
    return torch.get_default_device()


# -- validation (patch.py) -------------------------------------------------------------


def test_more_indices_than_values_is_refused_naming_the_patch():
    p = CWP("w", (8,), torch.float32, torch.ones(2), torch.tensor([0, 1, 2]))
    m = PlainModel({"w": (8,)})
    with pytest.raises(ValueError, match="patch 0 \\('w'\\)") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert isinstance(info.value, PatchValueError)


def test_duplicates_that_are_not_adjacent_are_found():
    p = CWP("w", (8,), torch.float32, torch.ones(3), torch.tensor([3, 1, 3]))
    m = PlainModel({"w": (8,)})
    before = m.w.detach().clone()
    with pytest.raises(ValueError, match="duplicate") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert info.value.value == 3
    assert torch.equal(m.w.detach(), before)


# -- observed loaders' chunks (inspect.py) ---------------------------------------------


def _sends(calls):
    """A loader that sends the patches in the calls given (lists of positions)."""
    def loader(model, patches, **kw):
        patches = list(patches)
        loaded = set()
        for call in calls:
            staged = [(patches[i].name, patches[i].values.view(patches[i].shape)) for i in call]
            loaded |= set(model.load_weights(staged))
        return loaded
    return loader


def _four():
    shapes = {n: (4,) for n in "abcd"}
    ps = [CWP(n, (4,), torch.float32, torch.full((4,), float(i + 1), device=_dev()))
          for i, n in enumerate("abcd")]
    return PlainModel(shapes, device=_dev()), ps


def test_observed_calls_close_by_repeated_name_when_the_next_starts_with_a_held_name():
    m, ps = _four()
    ps = [ps[0], ps[1], ps[0]._replace(values=ps[0].values + 1)]  # a, b, a again
    r = inspect_load(m, ps, loader=_sends([[0], [2, 1]]))  # [a], then [a, b]
    assert r.chunks["closed_by"].tolist()[0] == "repeated name"
    m, ps = _four()
    r = inspect_load(m, ps[:3], loader=_sends([[0], [2, 0], [1]]))  # [a], [c, a], [b]
    by_call = dict(zip(r.chunks["chunk"], r.chunks["closed_by"]))
    assert by_call[0] == "loader"  # c starts the next call: not a repeat, not the budget


def test_observed_budget_reason_needs_the_budget_passed_not_just_reached():
    m, ps = _four()
    # 16 bytes a patch: [a] then [b]: 16 + 16 == 32 is not past a budget of 32
    r = inspect_load(m, ps[:2], max_chunk_bytes=32, loader=_sends([[0], [1]]))
    assert r.chunks["closed_by"].tolist() == ["loader", "end"]
    r = inspect_load(m, ps[:2], max_chunk_bytes=31, loader=_sends([[0], [1]]))
    assert r.chunks["closed_by"].tolist() == ["budget", "end"]


def test_a_patch_an_observed_loader_sends_twice_is_charged_to_its_first_call():
    m, ps = _four()
    r = inspect_load(m, ps[:2], loader=_sends([[0], [1], [0]]))
    assert r.chunks.set_index("name")["chunk"].to_dict() == {"a": 0, "b": 1}
    assert len(r.calls) == 3


# -- summaries -------------------------------------------------------------------------


def test_summary_counts_changed_elements_not_written_ones():
    m = PlainModel({"w": (4,)}, device=_dev(), fill=1.0)
    values = torch.tensor([1.0, 1.0, 5.0, 1.0], device=_dev())  # one element changes
    r = inspect_load(m, [CWP("w", (4,), torch.float32, values)])
    s = r.summary()
    assert (s["elements written"], s["elements changed"]) == (4, 1)


def test_a_transactional_load_rejected_before_any_call_is_not_rolled_back():
    m = PlainModel({"w": (4,)}, device=_dev())
    bad = CWP("w", (4,), torch.float32, torch.ones(3, device=_dev()))  # 3 values for 4
    with pytest.raises(ValueError) as info:
        inspect_load(m, [bad], transactional=True)
    assert info.value.report.rolled_back is False
    assert "rolled back" not in info.value.report.summary()


def test_patch_summary_of_an_empty_patch_has_density_zero():
    p = CWP("e", (0, 4), torch.float32, torch.ones(0), torch.zeros(0, dtype=torch.int64))
    assert patch_summary([p])["density"].tolist() == [0.0]


def test_changed_fraction_of_nothing_is_zero():
    assert changed_fraction({}, {}) == 0.0


def test_changed_fraction_counts_elements_so_an_empty_weight_adds_none():
    # ("fraction of elements over all weights"): one of two elements changed is 0.5,
    # whatever empty weights sit beside them; only empty weights: 0.0
    before = {"e": torch.zeros(0), "w": torch.zeros(2), "f": torch.zeros(3, 0)}
    after = {"e": torch.zeros(0), "w": torch.tensor([1.0, 0.0]), "f": torch.zeros(3, 0)}
    assert changed_fraction(before, after) == 0.5
    empty = {"e": torch.zeros(0)}
    assert changed_fraction(empty, {"e": torch.zeros(0)}) == 0.0


# -- the runtime regions of reports ----------------------------------------------------


class _Flat(nn.Module):
    """Two parameters that are halves of one flat buffer."""

    def __init__(self):
        super().__init__()
        buf = torch.zeros(8, device=_dev())
        self.a = nn.Parameter(buf[:4], requires_grad=False)
        self.b = nn.Parameter(buf[4:], requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            getattr(self, n).data.copy_(w)
        return {n for n, _ in weights}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_write_into_one_half_of_a_flat_buffer_is_not_charged_to_the_other(kind):
    m = _Flat()
    if kind == "dense":
        p = CWP("a", (4,), torch.float32, torch.arange(1.0, 5.0, device=_dev()))
    else:
        p = CWP("a", (4,), torch.float32, torch.tensor([9.0], device=_dev()),
                torch.tensor([3], device=_dev()))
    r = inspect_load(m, [p])
    assert r.deltas.index.tolist() == ["a"]


class _AcrossTheSeam(nn.Module):
    """``a`` and ``b``, halves of one flat buffer; the loader writes its one patch over the
    last two elements of ``a`` and all of ``b`` in one copy."""

    def __init__(self):
        super().__init__()
        self.buf = torch.zeros(8, device=_dev())  # (not a runtime tensor)
        self.a = nn.Parameter(self.buf[:4], requires_grad=False)
        self.b = nn.Parameter(self.buf[4:], requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            self.buf[2:].copy_(w)
        return {n for n, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
def test_a_change_just_past_a_tensors_end_is_the_next_tensors(compiled):
    # Two of the six elements change: a[3] and b[0], the element right after a's last
    # (the torch-ops path saves just those two, with their storage offsets). Each tensor's
    # row, before() and written() take its own elements only.
    from patchkit import native

    new = torch.tensor([0.0, 5.0, 7.0, 0.0, 0.0, 0.0], device=_dev())
    m = _AcrossTheSeam()
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(m, [CWP("ab", (6,), torch.float32, new)])
    assert r.deltas.loc["a", ["elements", "changed", "max_abs"]].tolist() == [2, 1, 5.0]
    assert r.deltas.loc["b", ["elements", "changed", "max_abs"]].tolist() == [4, 1, 7.0]
    assert r.before("a").tolist() == [0.0] * 4 and r.before("b").tolist() == [0.0] * 4
    assert r.written("a").tolist() == [False, False, True, True]
    assert r.written("b").all()


class _Transposed(nn.Module):
    """A runtime weight kept transposed (a non-contiguous parameter)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(8, 4, device=_dev()).t(), requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            self.w.data[1:3].copy_(w[1:3])
        return {n for n, _ in weights}


def test_the_target_region_of_a_write_into_a_transposed_parameter():
    m = _Transposed()
    r = inspect_load(m, [CWP("w", (4, 8), torch.float32, torch.ones(32, device=_dev()))])
    assert r.writes["target_region"].tolist() == ["[1:3, :]"]
    assert r.deltas.loc["w", "elements"] == 16


# -- the compiled path ------------------------------------------------------------------


def test_a_dense_copy_from_a_strided_source_copies_the_right_elements():
    class Strided(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 4, device=_dev()), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.w.data.copy_(w[:, ::2])  # every other column of an (4, 8) tensor
            return {n for n, _ in weights}

    values = torch.arange(32.0, device=_dev())
    m = Strided()
    r = inspect_load(m, [CWP("w", (4, 8), torch.float32, values)])
    assert torch.equal(m.w.detach(), values.view(4, 8)[:, ::2])
    assert r.deltas.loc["w", "changed"] == 15  # all but the 0 at [0, 0]


def test_max_abs_is_the_largest_over_every_part_of_a_parallel_write(monkeypatch):
    from patchkit import native

    if not native.status().startswith("compiled"):
        pytest.skip("the compiled path is not available here")
    monkeypatch.setattr(native, "_threads", lambda: 2)
    n = 1 << 19  # two parts
    m = PlainModel({"w": (n,)}, device="cpu")
    values = m.w.detach().clone()
    values[-1] += 1000.0  # the largest change sits in the last part
    values[:100] += 1.0
    r = inspect_load(m, [CWP("w", (n,), torch.float32, values)])
    assert r.deltas.loc["w", "max_abs"] == pytest.approx(1000.0, rel=1e-3)


@pytest.mark.parametrize("written", [False, True])
def test_a_non_finite_old_value_adds_nothing_to_the_norm_of_before(written):
    # CONTRACT of deltas: a non-finite old value counts as 0 in ||before||
    m = PlainModel({"w": (64,)}, device="cpu", fill=1.0)
    m.w.data[5] = float("inf")
    idx = [5, 10] if written else [10]
    p = CWP("w", (64,), torch.float32, torch.full((len(idx),), 3.0), torch.tensor(idx))
    r = inspect_load(m, [p])
    row = r.deltas.loc["w"]
    assert row["changed"] == len(idx)
    assert row["rel_l2"] == pytest.approx(2.0)  # ||3 - 1|| / ||1||: the inf adds nothing


# -- builders ---------------------------------------------------------------------------


def test_blocks_of_a_wide_tensor_are_as_tall_as_its_rows_and_block_wide():
    g = torch.Generator().manual_seed(0)
    p = random_sparse_patch("w", (4, 64), torch.float32, 0.25, pattern="blocks", block=16,
                            generator=g)
    mask = torch.zeros(4 * 64, dtype=torch.bool)
    mask[p.indices] = True
    tiles = mask.view(4, 4, 16).sum(dim=(0, 2))  # 4 tiles of 4 x 16
    assert sorted(tiles.tolist()) == [0, 0, 0, 64]


def test_rows_rounds_to_the_nearest_count():
    g = torch.Generator().manual_seed(0)
    p = random_sparse_patch("w", (10, 4), torch.float32, 0.29, pattern="rows", generator=g)
    assert p.indices.numel() == 3 * 4  # round(2.9) rows, not int(2.9)


# -- the mutation audit, second round ---------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_the_first_bad_patch_is_named_whichever_device_group_holds_it():
    # Patches are checked per device (one host wait each); the error still names the
    # first bad patch in input order, not the first one of the first device checked.
    def p(name, device):
        return CWP(name, (4,), torch.float32, torch.ones(1, device=device),
                   torch.tensor([9], device=device))  # index 9: out of range

    ok = CWP("ok", (4,), torch.float32, torch.ones(1), torch.tensor([0]))
    from patchkit.patch import validate_patches

    with pytest.raises(PatchValueError, match=r"patch 1 \('on_cuda'\)") as info:
        validate_patches([ok, p("on_cuda", "cuda"), p("on_cpu", "cpu")])
    assert info.value.position == 1


class _Halves(nn.Module):
    """A float32 parameter and a float16 buffer over the same bytes; the loader writes
    two halves that do not start on a float32 element."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, device=_dev()), requires_grad=False)
        self.register_buffer("halves", self.w.detach().view(torch.float16))

    def load_weights(self, weights):
        for _, t in weights:
            self.halves[1:3].copy_(t[1:3])
        return {n for n, _ in weights}


def test_a_write_that_starts_inside_an_element_of_the_first_owner_is_the_other_owners():
    m = _Halves()
    p = CWP("halves", (8,), torch.float16, torch.arange(1.0, 9.0, device=_dev()).half())
    row = inspect_load(m, [p]).writes.iloc[0]
    # bytes 2..6: half 1 and 2 of the buffer; they start in the middle of w[0]
    assert (row["target"], row["target_offset"], row["target_region"]) == ("halves", 1, "[1:3]")


class _Reinterpreted(nn.Module):
    """An int16 parameter ``h`` over the bytes of a float32 buffer ``w`` (from w's
    fifth element on). The loader copies columns 0:2 of ``w`` (measured while copying),
    then zeroes half-words of ``h`` that fall on column 0 of w's rows 1 to 3."""

    def __init__(self):
        super().__init__()
        w = torch.zeros(4, 8, device=_dev())
        self.h = nn.Parameter(w.view(torch.int16).view(-1)[8:].view(7, 8), requires_grad=False)
        self.register_buffer("w", w)

    def load_weights(self, weights):
        for _, t in weights:
            self.w[:, :2].copy_(t[:, :2])
            self.h[:, 0:2].zero_()  # rows 16 bytes apart, w's 32: not w's columns
        return {n for n, _ in weights}


def test_numbers_measured_while_copying_are_dropped_when_a_view_of_another_size_rewrites_them():
    m = _Reinterpreted()
    before = m.w.detach().clone()
    r = inspect_load(m, [CWP("w", (4, 8), torch.float32, torch.ones(32, device=_dev()))])
    now = m.w.detach()
    assert torch.equal(now[:, 0], torch.tensor([1.0, 0.0, 0.0, 0.0], device=now.device))
    changed = int((now[:, :2] != before[:, :2]).sum())
    assert changed == 5
    assert r.deltas.loc["w", "changed"] == changed
    assert r.deltas.loc["w", "mean_abs"] == pytest.approx(changed / 8)


class _Scratch(nn.Module):
    """``a`` is copied from its staged tensor (a cast of the patch's values: memory the
    load frees after the call); ``b`` from a scratch tensor the loader makes, which the
    allocator often puts at the address the freed staged tensor had."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4096), requires_grad=False)
        self.b = nn.Parameter(torch.ones(4096), requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            if n == "a":
                self.a.data.copy_(w)
            else:
                self.b.data.copy_(torch.zeros(4096))
        return {n for n, _ in weights}


def test_a_staged_tensor_of_an_earlier_call_does_not_name_a_later_calls_scratch():
    pa = CWP("a", (4096,), torch.float32, torch.arange(4096.0, dtype=torch.float64))
    pb = CWP("b", (4096,), torch.float32, torch.zeros(4096))
    for _ in range(20):  # the allocator reuses the address in about half of the tries
        r = inspect_load(_Scratch(), [pa, pb], max_chunk_bytes=1 << 14)  # a call each
        assert len(r.calls) == 2
        row = r.writes.set_index("target").loc["b"]
        assert pd.isna(row["position"]) and pd.isna(row["name"]), "untraced: not a's"


class _Broadcast(nn.Module):
    """The loader copies row 0 of the staged tensor into both rows of a scratch buffer,
    then the scratch into the parameter (a same-shaped copy, NaN-merged)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(8.0, device=_dev()).view(2, 4), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            scratch = torch.empty(2, 4, device=t.device)
            scratch.copy_(t[0])  # broadcast: row 1 of scratch is row 0 of the patch
            self.w.data.copy_(scratch)
        return {n for n, _ in weights}


def test_a_broadcast_copy_of_a_staged_row_is_saved_where_it_was_written():
    # The patch writes indices 1 and 6; the loader's broadcast writes 1 and 5 instead (as
    # many): where the merge wrote cannot be recomputed from the patch.
    m = _Broadcast()
    start = m.w.detach().clone()
    p = CWP("w", (2, 4), torch.float32, torch.tensor([10.0, 60.0], device=_dev()),
            torch.tensor([1, 6], device=_dev()))
    r = inspect_load(m, [p])
    want = start.clone()
    want[:, 1] = 10.0
    assert torch.equal(m.w.detach(), want)
    assert torch.equal(r.before("w"), start)
    assert (r.deltas.loc["w", "elements"], r.deltas.loc["w", "changed"]) == (2, 2)
    assert r.deltas.loc["w", "max_abs"] == 9.0  # 1 -> 10 and 5 -> 10


class _Expanded(nn.Module):
    """A buffer that is ``w[2]`` expanded to four elements (stride 0)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(4.0, device=_dev()), requires_grad=False)
        self.register_buffer("third", self.w.detach()[2:3].expand(4))

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(t)
        return {n for n, _ in weights}


def test_before_of_an_expanded_buffer_reads_only_the_element_it_repeats():
    m = _Expanded()
    r = inspect_load(m, [CWP("w", (4,), torch.float32, torch.arange(10.0, 14.0, device=_dev()))])
    assert r.after("third").tolist() == [12.0] * 4
    # every element of ``third`` is w[2]: before the load 2.0 (12.0 where not restored);
    # never w[3]'s old 3.0, the next storage element
    assert set(r.before("third").tolist()) <= {2.0, 12.0}
    assert r.deltas.loc["third", ["elements", "changed"]].tolist() == [1, 1]


def test_an_observed_loader_leaves_an_instance_load_weights_in_place():
    m, ps = _four()
    plain = m.load_weights
    seen = []

    def mine(weights):
        seen.append([n for n, _ in weights])
        return plain(weights)

    m.load_weights = mine  # on the instance, not the class
    inspect_load(m, ps[:2], loader=_sends([[0, 1]]))
    assert m.load_weights is mine and "load_weights" in vars(m)
    assert seen == [["a", "b"]]


def test_an_observed_loader_that_stops_early_is_drawn_as_the_calls_it_made():
    m, ps = _four()
    # planned as [a], [b] (16 B each); the loader sends [a] only and returns normally
    r = inspect_load(m, ps[:2], max_chunk_bytes=16, loader=_sends([[0]]))
    assert [c.positions for c in r.plan] == [(0,)]
    notes = r.chunks.set_index("name")["note"].to_dict()
    assert notes == {"a": "", "b": "not sent by the observed loader"}


def test_names_of_a_call_that_broke_the_contract_are_not_counted_as_loaded():
    from patchkit.errors import ContractViolation

    m = PlainModel({"a": (4,), "b": (4,)}, device=_dev())
    plain = m.load_weights

    def forgets_b(weights):
        weights = list(weights)
        plain([(n, t) for n, t in weights if n != "b"])
        return {n for n, _ in weights}  # says b is loaded without writing it

    m.load_weights = forgets_b
    ps = [CWP(n, (4,), torch.float32, torch.tensor([5.0], device=_dev()),
              torch.tensor([1], device=_dev())) for n in "ab"]
    with pytest.raises(ContractViolation, match="without copying") as info:
        inspect_load(m, ps, max_chunk_bytes=16)  # a call each
    r = info.value.report
    assert [sorted(n) for n in r.calls["returned"]] == [["a"], ["b"]]
    assert r.calls["error"].tolist() == [False, True]
    assert r.loaded == {"a"} and r.summary()["names loaded"] == 1


def test_the_duplicate_named_is_the_repeated_index_not_the_first_one():
    # 5 repeats, apart; 1 comes first but appears once
    p = CWP("w", (8,), torch.float32, torch.ones(4), torch.tensor([1, 5, 3, 5]))
    with pytest.raises(PatchValueError, match="duplicate index 5 ") as info:
        patchkit.load_checkpoint_weight_patches(PlainModel({"w": (8,)}), [p])
    assert (info.value.reason, info.value.value) == ("duplicate", 5)


class _Unsigned(nn.Module):
    """One unsigned integer parameter; a name "boom" makes its loader raise."""

    def __init__(self, dtype, n):
        super().__init__()
        self.w = nn.Parameter(torch.arange(n, dtype=torch.int64).to(dtype), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name == "boom":
                raise RuntimeError("boom")
            self.w.data.copy_(t)
        return {name for name, _ in weights}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])
@pytest.mark.parametrize("n", [64, 1 << 16])  # saved whole, and compact (offsets kept)
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_tensors_are_reported_and_rolled_back_bit_for_bit(dtype, n, compiled):
    # torch has no index kernels for uint16/32/64: the saves go through their bits
    import contextlib

    from patchkit import native

    off = contextlib.nullcontext() if compiled else native.disabled()
    new = torch.arange(n, dtype=torch.int64).to(dtype)
    new[::7] = 3
    changed = int((torch.arange(n)[::7] != 3).sum())
    with off:
        m = _Unsigned(dtype, n)
        old = m.w.detach().clone()
        r = inspect_load(m, [CWP("w", (n,), dtype, new)])
        assert int(r.deltas.loc["w", "changed"]) == changed
        assert patchkit.bitwise.same_bits(r.before("w"), old)
        assert patchkit.bitwise.same_bits(r.after("w"), new)

        m = _Unsigned(dtype, n)
        with pytest.raises(RuntimeError, match="boom"):
            patchkit.load_checkpoint_weight_patches(
                m, [CWP("w", (n,), dtype, new), CWP("boom", (1,), dtype, new[:1])],
                transactional=True, max_chunk_bytes=1)
        assert patchkit.bitwise.same_bits(m.w, old)


def test_bits_of_unsigned_types_are_signed_views_of_the_same_bits():
    from patchkit.bitwise import bits, select

    x = torch.tensor([0, 1, 2**32 - 1], dtype=torch.int64).to(torch.uint32)
    assert bits(x).dtype == torch.int32
    assert bits(x).data_ptr() == x.data_ptr()  # a view
    assert bits(x).tolist() == [0, 1, -1]
    picked = select(x, torch.tensor([2, 0]))
    assert picked.dtype == torch.uint32 and picked.to(torch.int64).tolist() == [2**32 - 1, 0]


def test_a_region_that_cannot_be_restored_does_not_stop_the_rest(unrestorable):
    from patchkit.toymodels import PlainModel

    class Boom(PlainModel):
        def load_weights(self, weights):
            weights = list(weights)
            for name, _ in weights:
                if name == "boom":
                    raise KeyError("boom")
            return super().load_weights(weights)

    m = Boom({"a": (4,), "b": (4,), "c": (4,)}, fill=1.0)
    unrestorable("b")
    patches = [CWP(n, (4,), torch.float32, torch.full((4,), 5.0)) for n in "abc"]
    with pytest.raises(RuntimeError, match=r"rollback incomplete: 1 of 3 .*'b' keep") as e:
        patchkit.load_checkpoint_weight_patches(
            m, [*patches, CWP("boom", (1,), torch.float32, torch.ones(1))],
            transactional=True, max_chunk_bytes=16)
    assert isinstance(e.value.__cause__, OSError)
    assert isinstance(e.value.__context__, KeyError)  # the load's own error
    assert m.get_parameter("a").tolist() == [1.0] * 4  # restored after b failed
    assert m.get_parameter("c").tolist() == [1.0] * 4
    assert m.get_parameter("b").tolist() == [5.0] * 4


def test_a_report_of_an_incomplete_rollback_is_not_rolled_back(monkeypatch, unrestorable):
    from patchkit import intercept
    from patchkit.toymodels import PlainModel

    class Boom(PlainModel):
        def load_weights(self, weights):
            weights = list(weights)
            if any(name == "boom" for name, _ in weights):
                raise KeyError("boom")
            return super().load_weights(weights)

    sessions = []
    real_discard = intercept.WriteSession.discard
    kept = []
    real_restore_all = intercept.WriteSession.restore

    def restore_all(self):
        try:
            real_restore_all(self)
        finally:
            kept.append(self)

    def discard(self):
        sessions.append(self)
        real_discard(self)

    unrestorable("b")
    monkeypatch.setattr(intercept.WriteSession, "discard", discard)
    monkeypatch.setattr(intercept.WriteSession, "restore", restore_all)
    m = Boom({"a": (4,), "b": (4,)}, fill=1.0)
    ps = [CWP(n, (4,), torch.float32, torch.full((4,), 5.0)) for n in "ab"]
    with pytest.raises(RuntimeError, match="rollback incomplete") as e:
        inspect_load(m, [*ps, CWP("boom", (1,), torch.float32, torch.ones(1))],
                     transactional=True, max_chunk_bytes=16)
    report = e.value.report
    assert report.rolled_back is False
    assert report.loaded == {"b"}  # b keeps what the load wrote, a was restored
    assert m.get_parameter("b").tolist() == [5.0] * 4
    assert report.deltas.index.tolist() == ["b"]
    assert report.deltas.loc["b", ["changed", "max_abs"]].tolist() == [4, 4.0]
    assert report.before("b").tolist() == [1.0] * 4 and report.written("b").all()
    # the error keeps only the saves of what it left (no copy of the restored regions)
    assert sessions == []  # not discarded: b's saves are the report's before-values
    assert [{r.target for r in k.saved} for k in kept] == [{"b"}]


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64, torch.int32, torch.uint32,
                                   torch.int16, torch.uint8])
def test_a_difference_of_integers_is_the_exact_one_rounded_once(dtype):
    from patchkit.bitwise import difference

    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(3)
    n = 2000
    # the edges and numbers near them, and random ones over the whole range
    edge = [info.min, info.min + 1, info.max - 1, info.max, 0, 2**53 + 1, -(2**53) - 1]
    edge = [v for v in edge if info.min <= v <= info.max]
    span = info.max - info.min
    rand = [info.min + int(torch.randint(0, 2**62, (), generator=g)) * span // 2**62
            for _ in range(n)]
    xs = edge + rand
    ys = list(reversed(edge)) + rand[1:] + rand[:1]

    def tensor(vs):
        if dtype == torch.uint64:  # (torch.tensor takes no Python int of 2**63 or more)
            return torch.tensor([v - 2**64 if v >= 2**63 else v for v in vs]).view(dtype)
        return torch.tensor(vs, dtype=torch.int64).to(dtype)

    got = difference(tensor(xs), tensor(ys)).tolist()
    assert got == [float(x - y) for x, y in zip(xs, ys)]


@pytest.mark.parametrize(("da", "db"), [(torch.int64, torch.int32), (torch.int32, torch.int64),
                                        (torch.uint64, torch.int8), (torch.uint32, torch.int64),
                                        (torch.bool, torch.uint8)])
def test_a_difference_of_integers_of_two_dtypes_is_exact(da, db):
    # (a loader that rebinds param.data to a tensor of another dtype: before and after
    # then differ in dtype)
    from patchkit.bitwise import difference

    def tensor(vs, dtype):
        if dtype == torch.uint64:
            return torch.tensor([v - 2**64 if v >= 2**63 else v for v in vs]).view(dtype)
        return torch.tensor(vs, dtype=torch.int64).to(dtype)

    xs = [1, 0, 5, torch.iinfo(da).max] if da != torch.bool else [1, 0, 1, 1]
    ys = [0, 1, -1 if db != torch.bool and torch.iinfo(db).min < 0 else 0,
          torch.iinfo(db).min if db != torch.bool else 0]
    got = difference(tensor(xs, da), tensor(ys, db)).tolist()
    assert got == [float(x - y) for x, y in zip(xs, ys)]


def test_a_difference_of_bfloat16_values_near_its_largest_is_finite():
    # bfloat16 has float32's range: two of its numbers near the largest, of opposite
    # signs, differ by more than float32 holds, so they are subtracted in float64
    from patchkit.bitwise import difference

    big = torch.finfo(torch.bfloat16).max
    a = torch.tensor([big, -big, 1.0], dtype=torch.bfloat16)
    got = difference(a, -a)
    assert got.dtype == torch.float64
    assert got.tolist() == [2 * big, -2 * big, 2.0]


@pytest.mark.parametrize(("a", "b"), [
    pytest.param(torch.ones(3), torch.ones(3).view(torch.int32), id="float32 and its int32 view"),
    pytest.param(torch.ones(3, dtype=torch.float16),
                 torch.ones(3, dtype=torch.float16).view(torch.bfloat16),
                 id="float16 and the same bits as bfloat16"),
])
def test_same_bits_is_false_for_the_same_bits_of_two_dtypes(a, b):
    # ("the same shape, dtype and bits": bits alone read the same here)
    assert torch.equal(patchkit.bitwise.bits(a), patchkit.bitwise.bits(b))
    assert not patchkit.same_bits(a, b) and not patchkit.same_bits(b, a)
    assert not patchkit.same_state({"w": a}, {"w": b})


# -- bitwise helpers: pins found by mutation testing ------------------------------------


def test_a_difference_of_float16_values_is_taken_in_float32_not_in_float16():
    # "two float16 ... tensors in float32": subtracted in float16, 65504 - (-65504)
    # overflowed to inf (and small differences rounded to float16's precision)
    from patchkit.bitwise import difference

    a = torch.tensor([65504.0, 1.0], dtype=torch.float16)
    b = torch.tensor([-65504.0, 1.0 - 2.0**-11], dtype=torch.float16)
    got = difference(a, b)
    assert got.dtype == torch.float32
    assert got.tolist() == [131008.0, 2.0**-11]


def test_a_difference_of_two_float_dtypes_is_taken_in_float64():
    # "other floats in float64": a float16 beside a float64 is not narrowed to float32,
    # where 1 - 1e-10 reads 1
    from patchkit.bitwise import difference

    got = difference(torch.tensor([1.0], dtype=torch.float16),
                     torch.tensor([1e-10], dtype=torch.float64))
    assert got.dtype == torch.float64 and got.tolist() == [1.0 - 1e-10]


def test_bits_of_a_bool_tensor_are_uint8():
    # "reinterpreted as integers of the same width": a bool tensor came back as itself
    t = torch.tensor([True, False])
    got = patchkit.bitwise.bits(t)
    assert got.dtype == torch.uint8 and got.tolist() == [1, 0]
    got[1] = 1  # (a view: no copy)
    assert t.tolist() == [True, True]


def test_changed_mask_reads_a_lazily_negated_after_by_the_values_it_shows():
    # (complex.conj().imag is a view with torch's negative bit: it shows [-1, 3] while
    # its memory holds [1, -3]; only the first element differs from [1, 3])
    from patchkit.bitwise import changed_mask

    after = torch.tensor([1 + 1j, 2 - 3j]).conj().imag
    assert after.is_neg() and after.tolist() == [-1.0, 3.0]
    assert changed_mask(torch.tensor([1.0, 3.0]), after).tolist() == [True, False]


def test_sum_squares_of_complex_values_squares_their_parts_without_overflow():
    # "complex: of real and imaginary parts" in float64: |3e38 + 3e38j| is past float32's
    # range, so squaring the complex64 magnitude gave inf (then 0 without it)
    from patchkit.bitwise import sum_squares

    x = torch.tensor([3e38 + 3e38j, 3 + 4j], dtype=torch.complex64)
    part = float(torch.tensor(3e38, dtype=torch.float32))
    assert sum_squares(x) == 2 * part * part + 25.0


def test_same_state_is_false_when_either_dict_has_a_name_the_other_lacks():
    # ("the same names": a name only in b, whose a is a part of it, is a difference too)
    w = torch.ones(3)
    part, more = {"w": w}, {"w": w.clone(), "extra": torch.zeros(2)}
    assert not patchkit.same_state(part, more) and not patchkit.same_state(more, part)
    assert patchkit.same_state(more, dict(reversed(list(more.items()))))  # (order is no name)


class _TiedRegistersAliasAnew(PlainModel):
    """``b`` is ``a`` (tied); the loader registers a new Parameter under ``b``, then
    raises at ``z``."""

    def __init__(self):
        super().__init__({"a": (4, 4), "z": (1,)})
        self.b = self.a

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            self.b = torch.nn.Parameter(w.clone().view(4, 4) * 3, requires_grad=False)
        return {n for n, _ in weights}


def test_a_transactional_rollback_ties_an_alias_registered_anew_again():
    # the index kept where only a tied tensor's first name was registered: the rollback
    # left ``b`` as the loader registered it, untied, and said it had rolled back
    model = _TiedRegistersAliasAnew()
    tied = model.a
    patches = [CWP("a", (4, 4), torch.float32, torch.ones(16)),
               CWP("z", (1,), torch.float32, torch.ones(1))]
    with pytest.raises(RuntimeError, match="no z today"):
        patchkit.load_checkpoint_weight_patches(model, patches, transactional=True,
                                                max_chunk_bytes=64)
    assert model.b is tied and model.a is tied
    assert float(model.b.abs().sum()) == 0.0


class _Unties(PlainModel):
    """``b`` is ``a`` (tied). For each weight the loader registers a new Parameter under
    ``b`` holding the staged tensor (``"untie"``), does that and copies into ``a``
    (``"untie and copy"``), or does that and raises (``"untie and fail"``)."""

    def __init__(self, how: str):
        super().__init__({"a": (4,)})
        self.b = self.a
        self.how = how

    def load_weights(self, weights):
        for _, w in weights:
            self.b = torch.nn.Parameter(w.clone(), requires_grad=False)
            if self.how == "untie and copy":
                self.a.copy_(w)
            elif self.how == "untie and fail":
                raise RuntimeError("no more today")
        return {n for n, _ in weights}


@pytest.mark.parametrize("observed", [False, True], ids=["own", "observed"])
def test_an_alias_the_loader_unties_is_a_target_of_its_own_in_the_report(observed):
    # the report resolved ``b`` to ``a``: no row, and after("b") showed a's tensor
    model = _Unties("untie")
    kw = {"loader": patchkit.load_checkpoint_weight_patches} if observed else {}
    r = inspect_load(model, [CWP("a", (4,), torch.float32, torch.full((4,), 2.0))], **kw)
    assert model.b is not model.a
    assert r.targets == {"a": (4,), "b": (4,)}
    assert r.writes[["target", "op", "changed"]].values.tolist() == [["b", "rebind", 4]]
    assert list(r.deltas.index) == ["b"] and r.deltas.loc["b", "max_abs"] == 2.0
    assert r.after("b").tolist() == [2.0] * 4 and r.after("a").tolist() == [0.0] * 4
    assert r.before("b").tolist() == [0.0] * 4
    assert r.written("b").all() and not r.written("a").any()
    # rolled back: tied again, and no longer a target of its own
    model = _Unties("untie and fail")
    tied = model.a
    with pytest.raises(RuntimeError, match="no more today") as info:
        inspect_load(model, [CWP("a", (4,), torch.float32, torch.ones(4))], transactional=True,
                     **kw)
    r = info.value.report
    assert model.b is tied and model.a is tied
    assert r.targets == {"a": (4,)} and r.deltas.empty
    assert r.after("b").tolist() == [0.0] * 4


@pytest.mark.parametrize("how", ["untie", "untie and copy"])
def test_a_sparse_call_that_registers_a_new_tensor_under_an_alias_is_refused(how):
    # an alias was not checked: the staged NaN reached the model through ``b`` (with a
    # "without copying" error, or with no error at all when the call also copied)
    from patchkit.errors import ContractViolation

    model = _Unties(how)
    tied = model.a
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0, 8.0]), torch.tensor([0, 2]))
    with pytest.raises(ContractViolation, match=r"runtime tensor 'b' \(a tied name of 'a'\)"):
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert model.b is tied
    assert not torch.isnan(model.b).any()


def _put_back_warned_on_3_10(words):
    """Python 3.10's traceback shows no exception notes: the note of a failed sparse
    call's put-back (in ``__notes__`` there too) comes also as a UserWarning with the same
    words, which this expects there (nothing on 3.11+, where the traceback shows the
    note)."""
    return (contextlib.nullcontext() if hasattr(BaseException, "add_note")
            else pytest.warns(UserWarning, match=re.escape(words)))


@pytest.mark.parametrize("observed", [False, True], ids=["own", "observed"])
@pytest.mark.parametrize("rebinding", ["anew", ".data"])
def test_a_failed_sparse_call_has_its_rebinding_put_back(rebinding, observed):
    # a sparse call that raised left what it rebound or registered, holding the staged
    # NaN (a call that returns has it undone and refused); the call's copies stay
    class Rebinds(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                # a copy: it stays (merged on purpose; a nan_to_num's numbers where the
                # patch keeps are refused, reason 'replaced NaN marks')
                self.b.data.copy_(torch.where(w.isnan(), self.b.detach(), w))
                if rebinding == "anew":
                    self.a = torch.nn.Parameter(w.clone(), requires_grad=False)
                else:
                    self.a.data = w.clone()
                raise RuntimeError("no more today")

    model = Rebinds({"a": (4,), "b": (4,)})
    original = model.a
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0, 8.0]), torch.tensor([0, 2]))
    kw = {"loader": patchkit.load_checkpoint_weight_patches} if observed else {}

    def said():
        return _put_back_warned_on_3_10("raised after it rebound or registered runtime "
                                        "tensors ('a'), which may hold the staged NaN")

    with said(), pytest.raises(RuntimeError, match="no more today") as info:
        inspect_load(model, [patch], **kw)
    assert model.a is original and model.a.tolist() == [0.0] * 4
    assert model.b.tolist() == [7.0, 0.0, 8.0, 0.0]
    assert info.value.__notes__ == [
        "(raised in load_weights call 0, sent patch 0 ('a'))",
        "(patchkit: load_weights call 0 of a sparse load raised after it rebound or "
        "registered runtime tensors ('a'), which may hold the staged NaN; that was put "
        "back as it was; the call's copies stay)"]
    r = info.value.report
    # (an observed loader's report logs each call as it ends: the rebinding, which the
    # observed loader, patchkit's own, then put back; deltas and after() are the model's)
    assert r.writes[["target", "op", "changed"]].values.tolist() == (
        [["b", "aten::copy_", 2]] + [["a", "rebind", 4]] * observed)
    assert list(r.deltas.index) == ["b"] and r.after("a").tolist() == [0.0] * 4
    with said(), pytest.raises(RuntimeError, match="no more today") as info:
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert model.a is original and model.a.tolist() == [0.0] * 4


def test_a_failed_sparse_call_puts_back_each_tensor_it_changed_and_the_tree():
    class Meddles(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a.data = w.clone()
                self.c = torch.nn.Parameter(w.clone(), requires_grad=False)
                self.extra = torch.nn.Parameter(w.clone(), requires_grad=False)
            raise KeyError("stop")

    model = Meddles({"a": (4,), "c": (4,)})
    tensors = dict(model.named_parameters())
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))
    said = "rebound or registered runtime tensors ('a', 'c', 'extra')"
    with _put_back_warned_on_3_10(said), pytest.raises(KeyError) as info:
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert dict(model.named_parameters()) == tensors
    assert not any(torch.isnan(t).any() for t in tensors.values())
    assert said in info.value.__notes__[1]
    # transactional: the rollback puts back all of it, with no note of the call's
    # changes (only the one naming the call, which any loader's own error gets), nor a
    # warning of them (Python 3.10's stand-in for that note)
    model = Meddles({"a": (4,), "c": (4,)})
    tensors = dict(model.named_parameters())
    with warnings.catch_warnings(record=True) as caught, pytest.raises(KeyError) as info:
        warnings.simplefilter("always")
        patchkit.load_checkpoint_weight_patches(model, [patch], transactional=True)
    assert [str(w.message) for w in caught] == []
    assert dict(model.named_parameters()) == tensors
    assert not any(torch.isnan(t).any() for t in tensors.values())
    assert info.value.__notes__ == ["(raised in load_weights call 0, sent patch 0 ('a'))"]


@pytest.mark.parametrize("raises", [False, True])
def test_a_sparse_call_that_adds_no_tensor_keeps_what_it_added(raises):
    # a submodule with no tensor, an empty slot and a known tensor tied under a new name
    # hold no staged values: a call that returns keeps them, and one that raises did not
    class Adds(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                self.get_parameter(name).data.copy_(w)
            self.helper = torch.nn.Identity()
            self.register_buffer("cache", None)
            self.again = self.a
            if raises:
                raise KeyError("stop")
            return {n for n, _ in weights}

    model = Adds({"a": (4,)})
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))
    with pytest.raises(KeyError) if raises else contextlib.nullcontext() as info:
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert isinstance(model.helper, torch.nn.Identity) and "cache" in model._buffers
    assert model.again is model.a and model.a.tolist() == [0.0, 7.0, 0.0, 0.0]
    # (only the note naming the call, which any loader's own error gets)
    assert getattr(getattr(info, "value", None), "__notes__", []) == (
        ["(raised in load_weights call 0, sent patch 0 ('a'))"]
        if raises else [])


def test_a_sparse_call_that_raises_after_swapping_a_registry_says_what_it_did():
    class Swaps(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self._parameters = {"a": torch.nn.Parameter(w.clone(), requires_grad=False)}
            raise KeyError("stop")

    model = Swaps({"a": (4,)})
    original = model.a
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))
    said = "raised after it replaced registry '_parameters' of the module tree"
    with _put_back_warned_on_3_10(said), pytest.raises(KeyError) as info:
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert model.a is original and model.a.tolist() == [0.0] * 4
    called, note = info.value.__notes__
    assert called == "(raised in load_weights call 0, sent patch 0 ('a'))"
    assert said in note and "that was put back as it was" in note


class _NoNotes(Exception):
    """An exception type whose ``add_note`` is not there: Python 3.10's, on 3.11+."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_the_note_of_an_undone_sparse_call_never_replaces_the_loaders_error(monkeypatch):
    # Python 3.10 has no notes: a warning says it, and where warnings are errors the
    # loader's own error still propagates (an exception type without add_note stands in)
    class Rebinds(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a.data = w.clone()
            raise _NoNotes("the loader's own")

    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))
    model = Rebinds({"a": (4,)})
    with (pytest.warns(UserWarning, match="rebound or registered runtime tensors") as caught,
          pytest.raises(_NoNotes)):
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(_NoNotes, match="the loader's own"):
            patchkit.load_checkpoint_weight_patches(model, [patch])
    assert model.a.tolist() == [0.0] * 4


def test_add_note_puts_the_note_in_notes_without_add_note_too():
    # Python 3.10 has no add_note: the note goes into __notes__, as 3.11's add_note puts
    # it (an exception type whose add_note is not there stands in for 3.10 on 3.11+)
    from patchkit.errors import add_note

    class NoAttributes(_NoNotes):
        def __setattr__(self, name, value):
            raise TypeError("read-only")

    for exc in (KeyError("k"), _NoNotes("n")):
        add_note(exc, "first")
        add_note(exc, "second")
        assert exc.__notes__ == ["first", "second"]
    # where no note can go, none does, and no error of its own replaces the one raised
    refuses = NoAttributes("r")
    add_note(refuses, "dropped")
    assert not hasattr(refuses, "__notes__")
    odd = _NoNotes("o")
    odd.__notes__ = ("not", "a list")
    add_note(odd, "dropped")
    assert odd.__notes__ == ("not", "a list")


class _Deletes(PlainModel):
    """``b`` is ``a`` (tied), ``c`` is on its own; the loader copies each weight into its
    parameter, then deletes ``gone`` from the model."""

    def __init__(self, gone: str):
        super().__init__({"a": (4,), "c": (4,)})
        self.b = self.a
        self.gone = gone

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
        delattr(self, self.gone)
        return {n for n, _ in weights}


@pytest.mark.parametrize("gone", ["a", "b", "c"])
def test_a_name_the_load_removed_is_not_a_target_any_more(gone):
    # targets listed the tensors the model held before the load, a removed name too
    patches = [CWP("a", (4,), torch.float32, torch.ones(4)),
               CWP("c", (4,), torch.float32, torch.full((4,), 2.0))]
    model = _Deletes(gone)
    r = inspect_load(model, patches)
    now = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert gone not in now
    # by first name: with ``a`` gone, its tensor goes by ``b``
    assert r.targets == {"a": {"c": (4,), "b": (4,)}, "b": {"a": (4,), "c": (4,)},
                         "c": {"a": (4,)}}[gone]
    assert r.summary()["removed"] == [gone]
    # the tables and values still know the name: it held the tensor when the load wrote it
    # (a tied tensor's deltas row goes by its name now)
    assert list(r.deltas.index) == (["b", "c"] if gone == "a" else ["a", "c"])
    assert r.after(gone).tolist() == [1.0 if gone != "c" else 2.0] * 4
    assert r.before(gone).tolist() == [0.0] * 4
    # nothing removed: no entry
    r = inspect_load(PlainModel({"a": (4,), "c": (4,)}), patches)
    assert "removed" not in r.summary() and r.targets == {"a": (4,), "c": (4,)}


class _DeletesLater(PlainModel):
    """Copies each weight into its parameter; the call that loads ``c`` then deletes
    ``b`` (tied to ``a``) from the model."""

    def __init__(self):
        super().__init__({"a": (4,), "c": (4,)})
        self.b = self.a

    def load_weights(self, weights):
        for name, w in weights:
            self.get_parameter(name).data.copy_(w)
            if name == "c":
                del self.b
        return {n for n, _ in weights}


def _load_then_delete(model, patches, **kwargs):
    """An observed loader: patchkit's, then ``del model.b`` after its last call."""
    loaded = patchkit.load_checkpoint_weight_patches(model, patches, **kwargs)
    del model.b
    return loaded


@pytest.mark.parametrize("when", ["in the last call", "after the last call"])
def test_a_name_removed_late_in_a_load_is_seen_by_the_report(when):
    # the report skips its look at the module tree where patchkit's own loader's look
    # after its last call found it unchanged: a look after an earlier call, or one before
    # an observed loader went on, says nothing of the tree as the load left it
    patches = [CWP("a", (4,), torch.float32, torch.ones(4)),
               CWP("c", (4,), torch.float32, torch.full((4,), 2.0))]
    if when == "in the last call":
        model = _DeletesLater()
        r = inspect_load(model, patches, max_chunk_bytes=16)  # (a call per patch)
        assert len(r.calls) == 2
    else:
        model = PlainModel({"a": (4,), "c": (4,)})
        model.b = model.a
        r = inspect_load(model, patches, loader=_load_then_delete)
    assert "b" not in dict(model.named_parameters(remove_duplicate=False))
    assert r.summary()["removed"] == ["b"]
    assert r.targets == {"a": (4,), "c": (4,)}


class _RegistersNew(PlainModel):
    """Copies each weight into ``a``, then registers what ``how`` says under names the
    model did not have; raises at ``z``."""

    def __init__(self, how: str):
        super().__init__({"a": (4,), "z": (1,)})
        self.lin = nn.Linear(4, 4, bias=False)
        self.how = how

    def load_weights(self, weights):
        for name, w in weights:
            if name == "z":
                raise RuntimeError("no z today")
            self.a.copy_(w)
            if self.how == "parameter":  # the staged tensor: NaN where a sparse patch is
                self.extra = nn.Parameter(w.clone(), requires_grad=False)
            elif self.how == "buffer":
                self.register_buffer("kept", w.clone())
            elif self.how == "empty slot":
                self.lin.bias = nn.Parameter(w.clone(), requires_grad=False)
            elif self.how == "new registry":  # the empty slot filled in a dict of its own
                self.lin._parameters = {
                    **self.lin._parameters, "bias": nn.Parameter(w.clone(), requires_grad=False)
                }
            else:
                self.sub = nn.Linear(4, 1)
        return {n for n, _ in weights}


_NEW = {"parameter": ["extra"], "buffer": ["kept"], "empty slot": ["lin.bias"],
        "new registry": ["lin.bias"], "submodule": ["sub.weight", "sub.bias"]}


@pytest.mark.parametrize("how", list(_NEW))
def test_a_sparse_call_that_registers_a_new_tensor_is_refused_and_undone(how):
    # nothing looked for names the model did not have: the staged NaN reached it there
    from patchkit.errors import ContractViolation

    model = _RegistersNew(how)
    names = [n for n, _ in patchkit.intercept.named_tensors(model)]
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0, 8.0]), torch.tensor([0, 2]))
    said = ("replaced registry 'lin._parameters'" if how == "new registry" else
            f"a new runtime tensor '{_NEW[how][0]}'")
    with pytest.raises(ContractViolation, match=said):
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert [n for n, _ in patchkit.intercept.named_tensors(model)] == names
    assert not any(torch.isnan(t).any() for t in model.state_dict().values())
    assert model.lin.bias is None
    assert model.a.tolist() == [7.0, 0.0, 8.0, 0.0]  # (the call's merge stays, as documented)


@pytest.mark.parametrize("observed", [False, True], ids=["own", "observed"])
@pytest.mark.parametrize("how", list(_NEW))
def test_a_dense_call_that_registers_a_new_tensor_shows_it_and_a_rollback_removes_it(
    how, observed
):
    # the report knew only the tensors the model had: the new one was in no table, and a
    # transactional rollback left it in the model
    kw = {"loader": patchkit.load_checkpoint_weight_patches} if observed else {}
    a = CWP("a", (4,), torch.float32, torch.full((4,), 2.0))
    model = _RegistersNew(how)
    r = inspect_load(model, [a], **kw)
    new = _NEW[how]
    assert all(n in r.targets for n in new)
    tensors = dict(patchkit.intercept.named_tensors(model))
    rows = r.writes[r.writes["op"] == "register"]
    assert rows["target"].tolist() == new
    assert rows["changed"].tolist() == [tensors[n].numel() for n in new]
    assert list(r.deltas.index) == ["a"]  # (a new tensor has no before to compare with)
    assert patchkit.same_bits(r.after(new[-1]), tensors[new[-1]].detach())
    assert r.written(new[0]).all()
    with pytest.raises(KeyError, match="registered by the load"):
        r.before(new[0])
    # rolled back: the new names are gone again, an empty slot empty again
    model = _RegistersNew(how)
    names = [n for n, _ in patchkit.intercept.named_tensors(model)]
    with pytest.raises(RuntimeError, match="no z today") as info:
        inspect_load(model, [a, CWP("z", (1,), torch.float32, torch.ones(1))],
                     transactional=True, max_chunk_bytes=16, **kw)
    assert [n for n, _ in patchkit.intercept.named_tensors(model)] == names
    assert model.lin.bias is None and float(model.a.abs().sum()) == 0.0
    r = info.value.report
    assert not any(n in r.targets for n in new)
    assert r.writes[r.writes["op"] == "register"]["target"].tolist() == new  # (it happened)


def test_a_sparse_call_that_rebinds_in_two_ways_has_both_undone():
    # the check raised at the first kind it found: a name registered anew was put back,
    # and the storage of another tensor, rebound to the staged NaN, stayed so
    from patchkit.errors import ContractViolation

    class TwoWays(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a = nn.Parameter(w.clone(), requires_grad=False)
                self.c.data = w.clone()
            return {n for n, _ in weights}

    model = TwoWays({"a": (4,), "c": (4,)})
    a, c = model.a, model.c
    c_storage = c.untyped_storage().data_ptr()
    patch = CWP("a", (4,), torch.float32, torch.tensor([7.0, 8.0]), torch.tensor([0, 2]))
    with pytest.raises(ContractViolation, match="registered a new tensor as runtime tensor 'a'"):
        patchkit.load_checkpoint_weight_patches(model, [patch])
    assert model.a is a and model.c is c
    assert model.c.untyped_storage().data_ptr() == c_storage
    assert not torch.isnan(model.c).any() and not torch.isnan(model.a).any()


class _Changes(PlainModel):
    """``a`` (tied to ``b``) and ``c`` filled with 1.0; the loader copies each weight into
    its parameter, then does ``how`` (``max_chunk_bytes=16``: one weight a call)."""

    def __init__(self, how: str):
        super().__init__({"a": (4,), "c": (4,)}, fill=1.0)
        self.b = self.a
        self.how = how

    def load_weights(self, weights):
        for name, w in weights:
            if self.how == "first anew" and name == "a":
                self.a = nn.Parameter(w.clone(), requires_grad=False)  # b keeps the original
                continue
            self.get_parameter(name).data.copy_(w)
            if self.how == "tie":
                self.again = self.c
            elif self.how == "register, then .data" and name == "a":
                self.extra = nn.Parameter(torch.zeros(4), requires_grad=False)
            elif self.how == "register, then .data":
                self.extra.data = torch.full((4,), 5.0)
            elif self.how == "register, then remove" and name == "a":
                self.extra = nn.Parameter(w.clone(), requires_grad=False)
            elif self.how == "register, then remove":
                del self.extra
            elif self.how == "rebind, then remove" and name == "a":
                self.a = nn.Parameter(torch.full((8,), 5.0), requires_grad=False)
            elif self.how == "rebind, then remove":
                del self.a
        return {n for n, _ in weights}


def _changes_report(how):
    model = _Changes(how)
    patches = [CWP("a", (4,), torch.float32, torch.full((4,), 2.0)),
               CWP("c", (4,), torch.float32, torch.full((4,), 3.0))]
    return model, inspect_load(model, patches, max_chunk_bytes=16)


def test_a_known_tensor_tied_under_a_new_name_is_an_alias_not_a_write():
    # it was a 'register' write of 4 changed elements with no before(), and a sparse call
    # refused it as a tensor that may hold the staged NaN
    model, r = _changes_report("tie")
    assert model.again is model.c
    assert r.targets == {"a": (4,), "c": (4,)}
    assert "register" not in set(r.writes["op"])
    assert r.before("again").tolist() == [1.0] * 4 and r.after("again").tolist() == [3.0] * 4
    sparse = CWP("c", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))
    model = _Changes("tie")
    patchkit.load_checkpoint_weight_patches(model, [sparse])  # no error
    assert model.again is model.c and model.c.tolist() == [1.0, 7.0, 1.0, 1.0]


def test_after_of_a_registered_tensor_reads_it_as_the_model_holds_it_now():
    # it read the data the tensor had when registered, before a later call rebound it
    model, r = _changes_report("register, then .data")
    assert model.extra.tolist() == [5.0] * 4
    assert r.after("extra").tolist() == [5.0] * 4


def test_a_first_name_registered_anew_leaves_its_alias_with_the_original_tensor():
    # the alias still resolved to the first name: after("b") showed the new tensor
    model, r = _changes_report("first anew")
    assert model.b is not model.a and model.b.tolist() == [1.0] * 4
    assert r.targets == {"a": (4,), "b": (4,), "c": (4,)}
    assert r.after("b").tolist() == [1.0] * 4 and r.after("a").tolist() == [2.0] * 4
    assert r.before("b").tolist() == [1.0] * 4 and not r.written("b").any()
    # written, rebound to another shape, then removed: b holds the original as written,
    # not the (8,) tensor
    model, r = _changes_report("rebind, then remove")
    assert r.targets == {"b": (4,), "c": (4,)} and r.summary()["removed"] == ["a"]
    assert r.after("b").tolist() == [2.0] * 4 and r.before("b").tolist() == [1.0] * 4
    assert r.deltas.loc["b", "changed"] == 4


def test_figures_take_every_name_the_report_knows():
    # names removed, or registered and removed again, were in the writes table, but the
    # figures took only targets: plot_placement() raised KeyError, plot_delta too
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from patchkit import plot

    _, r = _changes_report("register, then remove")
    assert "extra" in set(r.writes["target"]) and "extra" not in r.targets
    plt.close(plot.plot_placement(r))
    plt.close(plot.plot_placement(r, "extra"))
    with pytest.raises(KeyError, match="registered by the load and removed again"):
        r.after("extra")
    _, r = _changes_report("rebind, then remove")
    plt.close(plot.plot_placement(r))
    plt.close(plot.plot_delta(r, "b"))
    plt.close(plot.plot_delta(r, "c"))


def test_placement_draws_a_write_with_no_checkpoint_region_next_to_one_with_one():
    # pandas 3 makes the missing region NaN in a column of text: region_rects raised
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from patchkit import plot

    class Scaled(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a.copy_(w)
                self.extra = nn.Parameter(w.clone() * 3, requires_grad=False)
            return {n for n, _ in weights}

    r = inspect_load(Scaled({"a": (4,)}), [CWP("a", (4,), torch.float32, torch.ones(4))])
    fig = plot.plot_placement(r)
    labels = [t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert labels and not any("nan" in t for t in labels)
    plt.close(fig)


def test_the_explorer_offers_a_registered_tensor():
    # it listed the deltas rows only: a tensor registered by the load (no deltas row)
    # could not be picked
    pytest.importorskip("ipywidgets")
    _, r = _changes_report("register, then .data")
    labels = [label for label, _ in r.explore().dropdown.options]
    assert "runtime: extra" in labels and "runtime: a" in labels


def test_what_review_three_found_in_the_undo_and_the_reports():
    # a rollback lost a buffer's persistence when the loader registered the same tensor
    # again with the other one; a tie made in a sparse call was unknown to its report;
    # plot_delta of a tensor rebound to another shape raised a broadcasting error
    import matplotlib

    matplotlib.use("Agg")
    from patchkit import plot

    class Flips(PlainModel):
        def __init__(self):
            super().__init__({"a": (4,)})
            self.register_buffer("stats", torch.zeros(4))
            self.register_buffer("cache", torch.zeros(4), persistent=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.a.copy_(w)
            self.register_buffer("stats", self.stats, persistent=False)
            self.register_buffer("cache", self.cache, persistent=True)
            self.again = self.a
            raise RuntimeError("no more today")

    for patch in (CWP("a", (4,), torch.float32, torch.full((4,), 2.0)),
                  CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))):
        model = Flips()
        with pytest.raises(RuntimeError, match="no more today"):
            patchkit.load_checkpoint_weight_patches(model, [patch], transactional=True)
        assert sorted(model.state_dict()) == ["a", "stats"] and not hasattr(model, "again")

    class Ties(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a.copy_(w)
                self.again = self.a
            return {n for n, _ in weights}

    r = inspect_load(Ties({"a": (4,)}),
                     [CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))])
    assert r.after("again").tolist() == [0.0, 7.0, 0.0, 0.0]

    class Reshapes(PlainModel):
        def load_weights(self, weights):
            for _ in weights:
                self.a = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
            return {n for n, _ in weights}

    r = inspect_load(Reshapes({"a": (2, 3)}), [CWP("a", (2, 3), torch.float32, torch.ones(6))])
    with pytest.raises(ValueError, match="another shape"):
        plot.plot_delta(r, "a")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.complex64])
def test_plot_delta_of_a_tensor_rebound_to_another_dtype_says_there_is_no_delta(dtype):
    # report.deltas has no numbers for it (another tensor altogether), yet plot_delta
    # drew one, under a title of NaNs and a false "the model changed after this load";
    # real to complex raised torch's broadcasting error from changed_mask
    import matplotlib

    matplotlib.use("Agg")

    class Rebinds(PlainModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.a.data = w
            return {n for n, _ in weights}

    r = inspect_load(Rebinds({"a": (2, 2)}, fill=1.0),
                     [CWP("a", (2, 2), dtype, torch.ones(4, dtype=dtype))])
    assert r.deltas.loc["a", "changed"] == 4 and r.deltas.loc["a", ["max_abs"]].isna().all()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"another dtype \(\(2, 2\) float32 before the load, "
                                         rf"\(2, 2\) {name} after\)"):
        r.plot_delta("a")
    assert r.before("a").dtype == torch.float32 and r.after("a").dtype == dtype


def test_a_model_outside_nn_modules_registries_is_told_what_could_not_be_undone():
    # the refusal said "the original tensor was registered again" while the staged NaN
    # stayed in the model; a rollback said nothing
    class Holder:  # (without nn.Module's _named_members: the walks died on it)
        def __init__(self):
            self.store = {"a": nn.Parameter(torch.zeros(4), requires_grad=False)}

        def named_modules(self, *a, **k):
            return iter([("", self)])

        def named_parameters(self, *a, **k):
            return iter(list(self.store.items()))

        def named_buffers(self, *a, **k):
            return iter(())

        def load_weights(self, weights):
            for n, w in weights:
                self.store[n] = nn.Parameter(w.clone(), requires_grad=False)
            if getattr(self, "fail", False):
                raise RuntimeError("no more today")
            return {n for n, _ in weights}

    from patchkit.errors import ContractViolation

    with pytest.raises(ContractViolation, match="could not be registered again"):
        patchkit.load_checkpoint_weight_patches(
            Holder(), [CWP("a", (4,), torch.float32, torch.tensor([7.0]), torch.tensor([1]))])
    h = Holder()
    h.fail = True
    with pytest.raises(RuntimeError, match="could not register runtime tensor 'a'"):
        patchkit.load_checkpoint_weight_patches(
            h, [CWP("a", (4,), torch.float32, torch.ones(4))], transactional=True)
    h = Holder()  # (a plain dense load: the search for tied names died on it too)
    patchkit.load_checkpoint_weight_patches(h, [CWP("a", (4,), torch.float32, torch.ones(4))])
    assert h.store["a"].tolist() == [1.0] * 4


def test_writes_into_a_tied_tensor_before_its_first_name_let_go_name_its_heir():
    # the writes row kept the first name, its region read against the new tensor, and
    # the placement figure drew it there
    class Lets(PlainModel):
        def __init__(self):
            super().__init__({"a": (4,)})
            self.b = self.a

        def load_weights(self, weights):
            for _, w in weights:
                self.a[1:3].copy_(w[1:3])
                self.a = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
            return {n for n, _ in weights}

    r = inspect_load(Lets(), [CWP("a", (4,), torch.float32, torch.ones(4))])
    assert r.writes[["target", "op", "target_region"]].values.tolist() == [
        ["b", "aten::copy_", "[1:3]"], ["a", "rebind", "[:, :]"]]
    assert r.written("b").tolist() == [False, True, True, False]


def test_the_explorer_shows_a_registered_tensor_writes_and_undo_drops_new_empty_slots():
    pytest.importorskip("ipywidgets")
    _, r = _changes_report("register, then .data")
    ex = r.explore()
    ex.dropdown.value = ("runtime", "extra")
    text = "".join(o.get("text", "") for o in ex.output.outputs)
    assert "writes into extra" in text and "delta: none" in text

    class Slots(PlainModel):
        def load_weights(self, weights):
            self.register_parameter("extra", None)
            self.register_buffer("cache", None, persistent=False)
            raise RuntimeError("no more today")

    model = Slots({"a": (4,)})
    with pytest.raises(RuntimeError, match="no more today"):
        patchkit.load_checkpoint_weight_patches(
            model, [CWP("a", (4,), torch.float32, torch.ones(4))], transactional=True)
    assert list(model._parameters) == ["a"] and not model._buffers
    assert not model._non_persistent_buffers_set


@pytest.mark.parametrize("shape, changed", [((), 0), ((2, 3), 0), ((1000,), 1),
                                            ((1000,), 600)])
@pytest.mark.parametrize("transactional", [False, True])
@needs_fp4_copy
def test_a_packed_float4_tensor_is_inspected_and_rolled_back(shape, changed, transactional):
    # the compact save selected the changed elements with index_select, which has no
    # float4_e2m1fn_x2 kernel: a bare NotImplementedError where a plain load worked
    fp4 = torch.float4_e2m1fn_x2

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(shape, dtype=torch.uint8).view(fp4),
                                  requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
            if transactional:
                raise RuntimeError("fails after writing")
            return {"w"}

    m = Model()
    n = m.w.numel()
    raw = torch.zeros(n, dtype=torch.uint8)
    raw[:changed] = 0x21  # (two packed fp4 values: 0.5 and 1.0)
    p = CWP("w", shape, fp4, raw.view(fp4))
    if transactional:
        with pytest.raises(RuntimeError, match="fails after writing") as e:
            inspect_load(m, [p], transactional=True)
        r = e.value.report
        assert int(m.w.view(torch.uint8).count_nonzero()) == 0
        assert r.rolled_back and "w" not in r.deltas.index
    else:
        r = inspect_load(m, [p])
        assert int(m.w.view(torch.uint8).count_nonzero()) == changed
        assert int(r.before("w").view(torch.uint8).count_nonzero()) == 0
        assert r.deltas.loc["w", ["elements", "changed"]].tolist() == [n, changed]


@pytest.mark.parametrize("dtype", [torch.bits8, torch.bits16, torch.bits1x8, torch.bits4x2])
@pytest.mark.parametrize("how", ["plain", "transactional", "report", "compare"])
def test_the_bits_dtypes_are_compared_bit_for_bit(dtype, how):
    # bits() handed a bits* tensor back as it was, and torch has no comparison kernel for
    # them: same_bits, changed_fraction and a transactional load (which a plain one
    # loads) raised a bare NotImplementedError ('"ne_cpu" not implemented for Bits8')
    raw = torch.int16 if dtype == torch.bits16 else torch.uint8
    start = torch.arange(6, dtype=raw)
    new = start.clone()
    new[[1, 4]] += 9

    if how == "compare":
        a, b = start.view(dtype), new.view(dtype)
        assert patchkit.same_bits(a, a.clone()) and not patchkit.same_bits(a, b)
        assert patchkit.same_state({"w": a}, {"w": a.clone()})
        assert changed_fraction({"w": a}, {"w": b}) == pytest.approx(2 / 6)
        return

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", start.clone().view(dtype))

        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t)
            if how == "transactional":
                raise RuntimeError("fails after writing")
            return {"w"}

    m = Model()
    p = CWP("w", (6,), dtype, new.view(dtype))
    if how == "plain":
        assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    elif how == "transactional":
        with pytest.raises(RuntimeError, match="fails after writing"):
            patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
        assert torch.equal(m.w.view(raw), start)
        return
    else:
        r = inspect_load(m, [p])
        assert r.deltas.loc["w", ["elements", "changed"]].tolist() == [6, 2]
        assert r.writes["changed"].tolist() == [2]
        assert torch.equal(r.before("w").view(raw), start)
    assert torch.equal(m.w.view(raw), new)


def test_a_sparse_refusal_without_copying_names_the_tensors_that_hold_nan_now():
    # A loader that copies on another thread puts the staged NaN into the model before
    # the call is refused; the refusal said it "may" have, and not where
    import threading

    from patchkit.errors import ContractViolation

    class OnAThread(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                t = threading.Thread(target=getattr(self, name).data.copy_, args=(w,))
                t.start()
                t.join(10.0)
            return {n for n, _ in weights}

    class Stashes(PlainModel):
        def load_weights(self, weights):
            return {n for n, _ in weights}  # (writes nothing: nothing holds NaN)

    shapes = {"a": (4, 4), "b": (8,)}
    p = CWP("a", (4, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([0, 5]))
    m = OnAThread(shapes)
    with torch.no_grad():
        m.b[3] = float("nan")  # (a NaN of the model's own counts too: a fact, not a guess)
    with pytest.raises(ContractViolation, match="without copying") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert "runtime tensors that hold NaN now: 'a' (14 elements), 'b' (1 element))" in str(
        info.value)
    with pytest.raises(ContractViolation, match="without copying") as info:
        patchkit.load_checkpoint_weight_patches(Stashes(shapes), [p])
    assert "hold NaN now" not in str(info.value)


# -- errors about a whole sparse call (intercept.py) ------------------------------------


class _RebindsB(PlainModel):
    def load_one(self, name, param, w):
        if name == "b":
            param.data = w.clone()
        else:
            super().load_one(name, param, w)


class _RebindsBToZeros(PlainModel):
    def load_one(self, name, param, w):
        if name == "b":
            param.data = torch.zeros_like(param)
        else:
            super().load_one(name, param, w)


@pytest.mark.parametrize("model", ["rebinds", "rebinds to zeros", "stashes"])
def test_a_whole_call_error_names_the_patch_at_fault_or_none(model):
    # Rebinding b (or copying nothing at all) is the call's fault, not patch 0's: a call
    # of two patches blamed 'a', which loaded fine. The patch is named where the tensor
    # put in the model is traced to it (a clone of b's staged tensor), or where the call
    # had only that one; otherwise neither is named.
    from patchkit.toymodels import ReportsWithoutWritingModel

    make = {"rebinds": _RebindsB, "rebinds to zeros": _RebindsBToZeros,
            "stashes": ReportsWithoutWritingModel}[model]
    reason = "without copying" if model == "stashes" else "rebinding"
    a = CWP("a", (2,), torch.float32, torch.ones(1), torch.tensor([0]))
    b = CWP("b", (2,), torch.float32, torch.ones(1), torch.tensor([1]))
    m = make({"a": (2,), "b": (2,)})
    with pytest.raises(NotImplementedError) as info:
        patchkit.load_checkpoint_weight_patches(m, [a, b])
    e = info.value
    named = (1, "b") if model == "rebinds" else (None, None)
    assert (e.position, e.name, e.reason) == (*named, reason)
    assert "patch 0 ('a'), patch 1 ('b')" in str(e)
    one = "a" if model == "stashes" else "b"
    m = make({"a": (2,), "b": (2,)})
    with pytest.raises(NotImplementedError) as info:
        patchkit.load_checkpoint_weight_patches(m, [a, b], max_chunk_bytes=8)
    e = info.value
    assert (e.position, e.name, e.reason) == ({"a": 0, "b": 1}[one], one, reason)


def test_a_call_that_copies_nothing_is_refused_though_one_of_its_patches_is_empty():
    # Only a call whose staged tensors are all empty has nothing to copy: one empty patch
    # beside one with an entry must not excuse a loader that reports both without copying
    from patchkit.toymodels import ReportsWithoutWritingModel

    z = CWP("z", (0,), torch.float32, torch.ones(0), torch.zeros(0, dtype=torch.int64))
    a = CWP("a", (2,), torch.float32, torch.ones(1), torch.tensor([0]))
    m = ReportsWithoutWritingModel({"z": (0,), "a": (2,)})
    with pytest.raises(NotImplementedError, match="without copying") as info:
        patchkit.load_checkpoint_weight_patches(m, [z, a])
    assert info.value.reason == "without copying"
    assert "patch 0 ('z'), patch 1 ('a')" in str(info.value)
    # (a call of empty patches only copies nothing, and is fine)
    assert patchkit.load_checkpoint_weight_patches(m, [z]) == {"z"}


@pytest.mark.parametrize(("write", "op"), [
    pytest.param(lambda w, t: w.resize_(2, 2), "aten::resize_", id="resize_ smaller"),
    pytest.param(lambda w, t: w.resize_(40), "aten::resize_", id="resize_ larger"),
    pytest.param(lambda w, t: w.data.set_(w.untyped_storage(), 4, (2, 4)).copy_(t[:2]),
                 "aten::set_", id="set_ to another view"),
])
def test_resize_and_set_on_a_runtime_tensor_are_refused_in_a_sparse_load(write, op):
    # torch tags them as in-place view ops, like t_ or squeeze_, but they may reallocate
    # or rebind the storage: were they let through as metadata, a shrink would leave the
    # parameter (2, 2) and the load would return as if it had merged
    class Resizes(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, 4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                write(self.w, t)
            return {n for n, _ in weights}

    m = Resizes()
    p = CWP("w", (3, 4), torch.float32, torch.tensor([-1.0]), torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="a sparse \\(NaN-masked\\) load") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert info.value.reason == "unsupported op" and info.value.value.startswith(op)
    assert m.w.shape == (3, 4) and m.w.detach().eq(1).all()


def test_an_unsupported_op_from_one_of_a_calls_patches_is_refused_naming_that_patch():
    # (mutation testing: the patch an op's arguments come from left unlooked-up for a
    # sparse write passed every test; with two patches in the call and no copy_ source,
    # the message then named no patch)
    class IndexCopies(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(4), requires_grad=False)
            self.b = nn.Parameter(torch.ones(4), requires_grad=False)

        def load_weights(self, weights):
            for name, t in weights:
                if name == "a":
                    self.a.data.copy_(t)
                else:
                    self.b.data.index_copy_(0, torch.arange(4, device=t.device), t)
            return {n for n, _ in weights}

    ps = [CWP("a", (4,), torch.float32, torch.tensor([2.0]), torch.tensor([0])),
          CWP("b", (4,), torch.float32, torch.tensor([3.0]), torch.tensor([1]))]
    with pytest.raises(NotImplementedError) as info:
        patchkit.load_checkpoint_weight_patches(IndexCopies(), ps)
    e = info.value
    assert (e.reason, e.position, e.name) == ("unsupported op", 1, "b")
    assert str(e).startswith("load_weights (call 0, patch 1 ('b'), runtime tensor 'b') wrote "
                             "with aten::index_copy_")


# -- storage beside the runtime tensors (_runtime_index.py, RuntimeIndex.owner) ----------------


class _FlatScratch(nn.Module):
    """w is elements 10-19 of a flat buffer the loader also uses, outside w, as scratch."""

    def __init__(self, scratch=slice(0, 5)):
        super().__init__()
        self.flat = torch.zeros(30)  # (not registered: the loader's own)
        self.w = nn.Parameter(self.flat[10:20], requires_grad=False)
        self.scratch = scratch

    def load_weights(self, weights):
        for _, w in weights:
            self.flat[self.scratch].fill_(3.0)
            self.w.data.copy_(w)
        return {"w"}


class _FusedGap(nn.Module):
    """a and b are columns 0-3 and 6-9 of a fused buffer; the loader zeroes columns 4-5."""

    def __init__(self):
        super().__init__()
        self.fused = torch.ones(4, 10)
        self.a = nn.Parameter(self.fused[:, 0:4], requires_grad=False)
        self.b = nn.Parameter(self.fused[:, 6:10], requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            self.fused[:, 4:6].zero_()
            getattr(self, n).data.copy_(w)
        return {n for n, _ in weights}


@pytest.mark.parametrize("make", [_FlatScratch, _FusedGap])
def test_writes_into_storage_beside_every_runtime_tensor_are_scratch(make):
    # A write whose elements lie in no runtime tensor, though their storage is shared
    # with one, was taken for a write into the first runtime tensor of that storage: a
    # sparse load refused it ("runtime tensor 'w' wrote with aten::fill_"), a report
    # listed it in writes (target_offset -10), a transactional load saved and restored it
    name = "w" if make is _FlatScratch else "a"
    m = make()
    assert patchkit.load_checkpoint_weight_patches(
        m, [CWP(name, (10,) if name == "w" else (4, 4), torch.float32, torch.tensor([2.0]),
                torch.tensor([3]))]) == {name}
    assert getattr(m, name).detach().reshape(-1)[3] == 2.0
    m = make()
    n = 10 if name == "w" else 16
    r = inspect_load(m, [CWP(name, (n,) if name == "w" else (4, 4), torch.float32,
                             torch.full((n,), 5.0))])
    assert r.writes[["op", "target", "target_offset", "elements"]].values.tolist() == [
        ["aten::copy_", name, 0, n]]
    assert list(r.deltas.index) == [name]


def test_a_write_that_runs_from_scratch_space_into_a_runtime_tensor_is_still_watched():
    # (the other side of the test above: elements 5-14 reach into w's 10-19)
    m = _FlatScratch(slice(5, 15))
    with pytest.raises(NotImplementedError, match=r"runtime tensor 'w'\) wrote with aten::fill_"):
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("w", (10,), torch.float32, torch.tensor([2.0]), torch.tensor([3]))])
    assert m.w.detach().tolist() == [0.0] * 10

    class Fails(_FlatScratch):
        def load_weights(self, weights):
            super().load_weights(weights)
            raise RuntimeError("after writing")

    m = Fails(slice(5, 15))
    with pytest.raises(RuntimeError, match="after writing"):
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("w", (10,), torch.float32, torch.ones(10))], transactional=True)
    assert m.flat.tolist() == [0.0] * 30


def test_an_observed_loader_that_sends_lists_is_watched_not_broken():
    # inspect_load(loader=...) read .numel() of every entry a call sent: a loader that
    # sends plain lists (outside the contract, but it loads) failed inside patchkit's
    # wrapper with AttributeError, before the model's load_weights ran
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                self.w.data.copy_(torch.as_tensor(w))
            return {n for n, _ in weights}

    def lists(model, patches, max_chunk_bytes=None, validate_unique_indices=True):
        return model.load_weights([(p.name, p.values.tolist()) for p in patches])

    m = Model()
    r = inspect_load(m, [CWP("w", (2,), torch.float32, torch.tensor([1.0, 2.0]))],
                     loader=lists)
    assert m.w.tolist() == [1.0, 2.0]
    assert r.calls[["names", "returned", "writes"]].values.tolist() == [[("w",), ("w",), 1]]
    assert r.writes[["target", "elements", "changed"]].values.tolist() == [["w", 2, 2]]
    assert r.writes["position"].isna().all()  # (a list is traced to no patch)


@pytest.mark.parametrize("how", ["sparse", "transactional", "report", "empty report"])
def test_a_registry_entry_that_is_not_a_tensor_is_named_by_a_watched_load(how):
    # RuntimeIndex read .layout of it: a bare AttributeError ('str' object has no
    # attribute 'layout'), from a sparse load, a transactional one and any report
    m = PlainModel({"w": (2,)})
    m._parameters["junk"] = "not a tensor"
    dense = [CWP("w", (2,), torch.float32, torch.ones(2))]
    run = {
        "sparse": lambda: patchkit.load_checkpoint_weight_patches(
            m, [CWP("w", (2,), torch.float32, torch.ones(1), torch.tensor([0]))]),
        "transactional": lambda: patchkit.load_checkpoint_weight_patches(
            m, dense, transactional=True),
        "report": lambda: inspect_load(m, dense),
        "empty report": lambda: inspect_load(m, []),
    }[how]
    with pytest.raises(TypeError, match="parameter 'junk' is a str, not a tensor") as info:
        run()
    assert (info.value.reason, info.value.value) == ("not a tensor", "junk")
    assert m.w.tolist() == [0.0, 0.0]
    # (a plain dense load watches nothing, and loads)
    assert patchkit.load_checkpoint_weight_patches(m, dense) == {"w"}


# -- numbers a narrower runtime dtype makes NaN (_marks.py: _LostMarks, _lost_in_cast) -


class _Fp8Rows(nn.Module):
    """Rows 2-3 of a 4 x 4 checkpoint weight in float8_e4m3fnuz, loaded by ``how``."""

    def __init__(self, how, device=None):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, 4, device=device).to(torch.float8_e4m3fnuz),
                              requires_grad=False)
        self.how = how

    def load_weights(self, weights):
        for _, t in weights:
            if self.how == "cast whole, then narrow":
                self.w.copy_(t.to(self.w.dtype).narrow(0, 2, 2))
            elif self.how == "copy into scratch":
                tmp = torch.empty(2, 4, dtype=self.w.dtype, device=t.device)
                tmp.copy_(t.narrow(0, 2, 2))
                self.w.copy_(tmp)
            elif self.how == "cast to the device":
                self.w.copy_(t.narrow(0, 2, 2).to(self.w.device, self.w.dtype))
            elif self.how == "cast, then clone":
                self.w.copy_(t.narrow(0, 2, 2).to(self.w.dtype).clone())
            elif self.how == "through bfloat16":  # (float32 -> bf16 -> the runtime dtype)
                self.w.copy_(t.narrow(0, 2, 2).to(torch.bfloat16))
            elif self.how == "scratch row by row, then a second scratch":
                a = torch.empty(2, 4, dtype=self.w.dtype)
                a[0].copy_(t[2])
                a[1].copy_(t[3])
                b = torch.empty_like(a)
                b.copy_(a)
                self.w.copy_(b)
            else:  # it casts a tensor of its own too: an inf, no patch's, not refused
                torch.full((4,), float("inf")).to(self.w.dtype)
                self.w.copy_(t.narrow(0, 2, 2).to(self.w.dtype))
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["cast whole, then narrow", "copy into scratch",
                                 "cast to the device", "own tensor", "cast, then clone",
                                 "through bfloat16",
                                 "scratch row by row, then a second scratch"])
def test_a_number_a_loader_cast_lost_is_refused_only_where_it_reaches_the_model(how):
    # Refused at the cast, a number in another rank's rows (checkpoint index 1) stopped a
    # load that never used it; a copy_ into a tensor of the loader's own was not checked
    # at all, so the update at index 13 was lost without a word
    elsewhere = CWP("w", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    m = _Fp8Rows(how)
    assert patchkit.load_checkpoint_weight_patches(m, [elsewhere]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0] * 5 + [2.0, 1.0, 1.0]
    here = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    m = _Fp8Rows(how)
    with pytest.raises(ValueError, match=r"1000000\.0 at checkpoint index 13 arrives as NaN") as e:
        patchkit.load_checkpoint_weight_patches(m, [here])
    assert (e.value.position, e.value.reason, e.value.value) == (0, "NaN in the runtime dtype", 13)
    assert m.w.detach().float().eq(1).all()


def test_a_dry_run_of_a_float8_model_is_not_checked_for_lost_numbers():
    # (a meta tensor holds no numbers: the check read one and failed)
    with torch.device("meta"):
        m = _Fp8Rows("cast to the device")
    for values in (torch.tensor([2.0, 1e6]), torch.tensor([2.0, 1e6], device="meta")):
        p = CWP("w", (4, 4), torch.float32, values, torch.tensor([9, 13]).to(values.device))
        assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}


def test_a_scratch_tensor_reused_by_two_patches_of_a_call_is_followed_to_each():
    # (q, then k, through one float8 scratch into a packed tensor: the cast that lost k's
    # number was traced to two patches, so to none, and the loss went unseen)
    fp8 = torch.float8_e4m3fnuz

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Parameter(torch.ones(4, 4).to(fp8), requires_grad=False)

        def load_weights(self, weights):
            buf = torch.empty(2, 4, dtype=fp8)
            for n, t in weights:
                buf.copy_(t)
                at = {"q": 0, "k": 2}[n]
                self.qk[at:at + 2].copy_(buf)
            return {n for n, _ in weights}

    q = CWP("q", (2, 4), torch.float32, torch.tensor([2.0]), torch.tensor([0]))
    k = CWP("k", (2, 4), torch.float32, torch.tensor([0.5, 1e6]), torch.tensor([1, 6]))
    m = Packed()
    with pytest.raises(ValueError, match=r"1000000\.0 at checkpoint index 6 arrives as NaN") as e:
        patchkit.load_checkpoint_weight_patches(m, [q, k])
    assert (e.value.position, e.value.name, e.value.value) == (1, "k", 6)
    # (q's copy stays, as a failed call's earlier writes do)
    assert m.qk.detach().float()[0, 0] == 2.0 and m.qk.detach().float()[2:].eq(1).all()


def test_a_source_not_followed_to_its_patch_is_checked_on_its_own_cast():
    # (a loader that scales while it copies: the product holds the patch's data at no
    # known place, so its own cast is what is checked, and the message can only say
    # where in the source the number is)
    class Scales(_Fp8Rows):
        def load_weights(self, weights):
            for _, t in weights:
                self.w.copy_(t.narrow(0, 2, 2) * 2)
            return {n for n, _ in weights}

    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    m = Scales("")
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.value) == (0, "w", 5)
    assert m.w.detach().float().eq(1).all()
    # (numbers that survive the scaling and the cast load)
    patchkit.load_checkpoint_weight_patches(m, [p._replace(values=torch.tensor([2.0, 4.0]))])
    assert m.w.detach().float().reshape(-1)[[1, 5]].tolist() == [4.0, 8.0]


class _Fp8Copies(nn.Module):
    """A float8 weight of ``shape`` (``dtype``) that copies ``how(t)`` of its patch."""

    def __init__(self, how, shape, dtype=torch.float8_e4m3fnuz):
        super().__init__()
        self.w = nn.Parameter(torch.ones(*shape).to(dtype), requires_grad=False)
        self.how = how

    def load_weights(self, weights):
        for _, t in weights:
            self.w.copy_(self.how(t))
        return {n for n, _ in weights}


@pytest.mark.parametrize(("how", "shape", "lost_at", "kept_at"), [
    # (rows 0-1: the lost number is in row 3, after the shard's last row)
    pytest.param(lambda t: t.narrow(0, 0, 2), (2, 4), 13, 1, id="rows 0-1"),
    # (columns 0-1: the lost number is in column 2, just past the shard's rows)
    pytest.param(lambda t: t.narrow(1, 0, 2), (4, 2), 2, 1, id="columns 0-1"),
])
def test_a_lost_number_just_past_a_shard_does_not_refuse_its_copy(how, shape, lost_at, kept_at):
    # The entries of a shard's copy are found by row and column: counting a row too far,
    # or a column too far, would refuse a rank's copy for a number that never reaches it
    p = CWP("w", (4, 4), torch.float32, torch.tensor([0.5, float("inf")]),
            torch.tensor([kept_at, lost_at]))
    m = _Fp8Copies(how, shape)
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    want = torch.ones(shape)
    want.reshape(-1)[1] = 0.5  # (checkpoint index 1 is element 1 in both shards)
    assert torch.equal(m.w.detach().float(), want)


def test_a_lost_number_in_a_transposed_source_is_named_by_its_checkpoint_index():
    # ``w.t()`` is no rows of the staged tensor: its own cast is checked, and the error
    # still names the entry by its checkpoint index (1: row 0, column 1), not by where the
    # transposed source holds it (its element 4)
    p = CWP("w", (4, 4), torch.float32, torch.tensor([0.5, float("inf")]), torch.tensor([0, 1]))
    m = _Fp8Copies(lambda t: t.t(), (4, 4))
    with pytest.raises(ValueError, match=r"value inf at checkpoint index 1 arrives as NaN") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        0, "w", "NaN in the runtime dtype", 1)
    assert m.w.detach().float().eq(1).all()


def test_a_number_lost_in_a_narrower_cast_before_the_copy_is_refused():
    # 300.0 is a number in the runtime dtype (float8_e5m2fnuz), so none of the patch's
    # values is lost there; but the loader casts to float8_e4m3fnuz first (largest 240),
    # whose NaN the merge would read as "keep": the update at index 5 would be lost
    # without a word, were the copy's entries not read where the loader's cast put them
    p = CWP("w", (4, 4), torch.float32, torch.tensor([0.5, 300.0]), torch.tensor([1, 5]))
    m = _Fp8Copies(lambda t: t.to(torch.float8_e4m3fnuz), (4, 4), torch.float8_e5m2fnuz)
    with pytest.raises(ValueError, match=r"300\.0 at checkpoint index 5 arrives as NaN") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.reason, e.value.value) == (0, "NaN in the runtime dtype", 5)
    assert m.w.detach().float().eq(1).all()
    # (through that cast, numbers both dtypes hold load)
    patchkit.load_checkpoint_weight_patches(m, [p._replace(values=torch.tensor([0.5, 2.0]))])
    assert m.w.detach().float().reshape(-1)[[1, 5]].tolist() == [0.5, 2.0]


# -- the collector's pause, the returned names, staging notes, tied aliases -----------------

_F8 = torch.float8_e4m3fnuz


def _rows():
    return torch.tensor([2, 3])  # (made when used: on the test's device)


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: (t.narrow(0, 2, 2) * 2).to(_F8), id="scale, then cast"),
    pytest.param(lambda t: (t.narrow(0, 2, 2) * 2).to(_F8).to(torch.float32),
                 id="scale, cast, then back to float32"),
    pytest.param(lambda t: (t * 2).to(_F8).narrow(0, 2, 2), id="scale, cast whole, narrow"),
    pytest.param(lambda t: (t * 2).narrow(1, 0, 4).t().to(_F8).t()[2:],
                 id="cast a transposed view"),
    pytest.param(lambda t: torch.cat([(t[2:3] * 2).to(_F8), (t[3:4] * 2).to(_F8)]),
                 id="cat of casts"),
    pytest.param(lambda t: torch.stack([(t[2] * 2).to(_F8), (t[3] * 2).to(_F8)]),
                 id="stack of casts"),
    pytest.param(lambda t: (t * 2).to(_F8)[_rows().to(t.device)], id="index",
                 marks=needs_float8_index),
    pytest.param(lambda t: (t * 2).to(_F8).index_select(0, _rows().to(t.device)),
                 id="index_select"),
    pytest.param(lambda t: (t * 2).to(_F8).roll(-2, 0)[:2], id="roll"),
    pytest.param(lambda t: (t[2:] * 2).to(_F8).repeat(2, 1)[2:], id="repeat"),
    pytest.param(lambda t: (t * 2).to(_F8).flip(0)[:2].flip(0), id="flip"),
    pytest.param(lambda t: (t * 2).to(_F8).float().gather(
        0, _rows().to(t.device)[:, None].expand(2, 4)), id="gather"),
    pytest.param(lambda t: (t * 2).to(_F8).narrow_copy(0, 2, 2), id="narrow_copy"),
    pytest.param(lambda t: torch.empty(2, 4, dtype=_F8, device=t.device).copy_(
        t.narrow(0, 2, 2) * 2), id="scaled into a float8 scratch"),
    pytest.param(lambda t: torch.empty(4, 4, dtype=_F8, device=t.device).copy_(
        t * 2).clone()[2:], id="scratch, clone, narrow"),
    # arithmetic after the cast, read back in float32 (float8 has no arithmetic of its
    # own): the NaN the cast made stays NaN through each of these ops
    pytest.param(lambda t: (t * 2).to(_F8).float().clamp(-1e4, 1e4)[2:], id="clamp after"),
    pytest.param(lambda t: (t[2:] * 2).to(_F8).float() * 1.0, id="scaled after"),
    pytest.param(lambda t: torch.where(torch.ones(2, 4, dtype=torch.bool, device=t.device),
                                       (t[2:] * 2).to(_F8).float(), 0.0), id="where"),
    pytest.param(lambda t: (t[2:] * 2).to(_F8).float().masked_fill(
        torch.zeros(2, 4, dtype=torch.bool, device=t.device), 0.0), id="masked_fill"),
    pytest.param(lambda t: (t[2:] * 2).to(_F8).float().masked_fill(
        torch.zeros(2, 4, dtype=torch.bool, device=t.device),
        torch.tensor(0.0, device=t.device)), id="masked_fill of a tensor"),
    pytest.param(lambda t: torch.zeros(2, 4, device=t.device).add_(
        (t[2:] * 2).to(_F8).float()), id="added into a scratch"),
    # (two inputs marked there: the first's number is named)
    pytest.param(lambda t: (t[2:] * 2).to(_F8).float() + (t[2:] * 3).to(_F8).float() * 0,
                 id="sum of two casts"),
    # (the bits of the float8 through an integer op: no NaN an integer shows, its marks
    # stay)
    pytest.param(lambda t: ((t[2:] * 2).to(_F8).view(torch.uint8) | 0).view(_F8),
                 id="or-ed as bytes"),
    # (where picks its other side where its condition is false)
    pytest.param(lambda t: torch.where(torch.zeros(2, 4, dtype=torch.bool, device=t.device),
                                       0.0, (t[2:] * 2).to(_F8).float()), id="where, other"),
    # (torch tags neither as pointwise: the trail was lost, and the update with it)
    pytest.param(lambda t: torch.where(
        torch.ones(2, 4, dtype=torch.bool, device=t.device), (t[2:] * 2).to(_F8).float(),
        torch.zeros(2, 4, device=t.device), out=torch.empty(2, 4, device=t.device)),
        id="where, out="),
    pytest.param(lambda t: torch.rsub((t[2:] * 2).to(_F8).float(),
                                      torch.zeros(2, 4, device=t.device)).neg(),
                 id="rsub of a tensor"),
])
def test_a_number_the_loaders_own_cast_lost_after_scaling_is_refused(how):
    # Scaled, the values are at no known place in their patch, and the copy's source is
    # already float8, so the copy's own cast could not see the NaN that the loader's cast
    # made of 2e6: the update at checkpoint index 13 (row 3, element 5 of rows 2-3) was
    # lost without a word. The cast now marks it, and the mark follows it to the copy.
    m = _Fp8Copies(how, (2, 4))
    here = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source "
                       r"arrives as NaN") as e:
        patchkit.load_checkpoint_weight_patches(m, [here])
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        0, "w", "NaN in the runtime dtype", 5)
    assert m.w.detach().float().eq(1).all()
    # (a number lost in rows this rank does not load, checkpoint index 1, stops nothing)
    elsewhere = here._replace(values=torch.tensor([1e6, 2.0]), indices=torch.tensor([1, 13]))
    assert patchkit.load_checkpoint_weight_patches(m, [elsewhere]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    # (two lost: the first in the source is named)
    two = here._replace(values=torch.tensor([3e6, 1e6]))
    with pytest.raises(ValueError, match=r"value 6000000\.0 at element 1 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [two])
    assert e.value.value == 1


def test_a_sum_keeps_the_lost_numbers_of_each_input_where_only_it_is_marked():
    # (a cast of a constant loses 1e6 in row 0 of the sum, the patch's cast its 2e6 in
    # row 1: the sum holds both marks, and the copy of row 1 is refused for the patch's)
    def how(t):
        elsewhere = torch.tensor([1e6, 0.0], device=t.device).to(_F8).float()[:, None]
        return (elsewhere + (t[2:] * 2).to(_F8).float())[1:]

    m = _Fp8Copies(how, (1, 4))
    here = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 1 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [here])
    assert m.w.detach().float().eq(1).all()


def test_a_number_lost_in_casts_of_the_staged_rows_is_followed_through_a_cat():
    # Each row cast on its own is an exact copy of staged values: its cast is not read
    # where none of the patch's values is lost in float8, but here 1e6 is, so the casts
    # mark it, and the cat, which no trace to the patch survives, carries the mark (with
    # the patch and the checkpoint index the cast's source was traced to)
    m = _Fp8Copies(lambda t: torch.cat([t[2:3].to(_F8), t[3:4].to(_F8)]), (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 1000000\.0 at checkpoint index 13 ") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.value) == (0, "w", 13)
    assert m.w.detach().float().eq(1).all()
    # (values float8 holds: no cast is read, and the load writes them)
    patchkit.load_checkpoint_weight_patches(m, [p._replace(values=torch.tensor([2.0, 3.0]))])
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 2.0] + [1.0] * 3 + [3.0, 1.0, 1.0]


@pytest.mark.parametrize("via", [torch.bfloat16, torch.float16])
def test_a_number_lost_only_through_a_cast_of_a_cast_is_followed_through_a_cat(via):
    # 247.99 is 240 in float8 (no value of the patch is lost there), but 248 in bfloat16
    # or float16, which float8 cannot hold: cast through either first, it is NaN. The
    # row casts were taken for plain casts of staged values (not read), so no mark was
    # made and the cat lost the number without a word.
    m = _Fp8Copies(lambda t: torch.cat([t[2:3].to(via).to(_F8), t[3:4].to(via).to(_F8)]),
                   (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 247.99]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 248\.0 at checkpoint index 13 ") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.value) == (0, "w", 13)
    assert m.w.detach().float().eq(1).all()
    # (straight from float32, 247.99 is 240: the load writes it)
    direct = _Fp8Copies(lambda t: torch.cat([t[2:3].to(_F8), t[3:4].to(_F8)]), (2, 4))
    assert patchkit.load_checkpoint_weight_patches(direct, [p]) == {"w"}
    assert direct.w.detach().float().reshape(-1).tolist() == [1.0, 2.0] + [1.0] * 3 + [
        240.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2, torch.float8_e5m2fnuz,
                                   pytest.param(E8M0, marks=pytest.mark.skipif(
                                       E8M0 is None, reason=NO_E8M0))])
def test_nan_mask_of_a_one_byte_float_reads_every_bit_pattern_as_float32_does(dtype):
    # (one or two NaN patterns are compared byte for byte; e5m2's six go through float32)
    from patchkit.bitwise import nan_mask

    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    want = torch.isnan(every.float())
    assert torch.equal(nan_mask(every), want)
    grid, wants = every.reshape(16, 16), want.reshape(16, 16)
    assert torch.equal(nan_mask(grid.t()), wants.t())
    assert torch.equal(nan_mask(grid[1:, ::3]), wants[1:, ::3])


def test_a_staged_tensor_the_loader_scaled_in_place_is_read_for_lost_numbers():
    # (its storage is the staged one, and none of the patch's values, 150.0 among them,
    # is lost in float8: that was taken to mean none of its elements is, and the 300.0
    # that t.mul_(2) made arrived as NaN, a "keep", without a word)
    class ScalesInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                t.mul_(2)
                self.w.copy_(t)
            return {n for n, _ in weights}

    m = ScalesInPlace()
    p = CWP("w", (4,), torch.float32, torch.tensor([2.5, 150.0]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"value 150\.0 at checkpoint index 2 arrives as NaN"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()
    # (values that still fit once doubled load)
    patchkit.load_checkpoint_weight_patches(m, [p._replace(values=torch.tensor([2.5, 60.0]))])
    assert m.w.detach().float().tolist() == [5.0, 1.0, 120.0, 1.0]


def test_a_scratch_reused_for_the_next_patch_forgets_the_numbers_lost_in_it():
    # A float8 scratch that held a lost number (in rows this rank does not load) is
    # overwritten by the next patch's values, whose NaN there is a "keep": refusing it
    # for the first patch's number would stop a good load.
    class TwoFromOneScratch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            buf = torch.empty(4, 4, dtype=_F8)
            for n, t in weights:
                buf.copy_(t * 2)
                getattr(self, n).copy_(buf[:2] if n == "b" else buf[2:])
            return {n for n, _ in weights}

    a = CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    b = CWP("b", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([0]))
    m = TwoFromOneScratch()
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [1.0] + [1.0] * 7
    # (b at checkpoint index 1, where a's number was lost: b's 0.5 lands)
    b1 = b._replace(indices=torch.tensor([1]))
    assert patchkit.load_checkpoint_weight_patches(m, [a, b1]) == {"a", "b"}
    assert m.b.detach().float().reshape(-1)[1] == 1.0


def _all():
    return torch.arange(4)  # (made when used: on the test's device)


class _Refilled(nn.Module):
    """Float8 ``a`` and ``b`` loaded through one float32 scratch: ``a`` scaled by 2 and
    cast into it (its rows 2-3 copied), then the scratch refilled for ``b`` by
    ``fill(buf, t)`` (its rows 0-1 copied)."""

    def __init__(self, fill):
        super().__init__()
        self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
        self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
        self.fill = fill

    def load_weights(self, weights):
        buf = torch.empty(4, 4)
        for n, t in weights:
            if n == "a":
                buf.copy_((t * 2).to(_F8))
                self.a.copy_(buf[2:])
            else:
                self.fill(buf, t)
                self.b.copy_(buf[:2])
        return {n for n, _ in weights}


def _refilled():
    # (a's 1e6, index 1, is lost by its cast in a row a's copy never reads; b's NaN there
    # keeps)
    return (CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13])),
            CWP("b", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([0])))


@pytest.mark.parametrize("put", [
    pytest.param(lambda buf, x: buf.__setitem__(_all(), x), id="buf[rows] = x"),
    pytest.param(lambda buf, x: buf.__setitem__(torch.ones(4, 4, dtype=torch.bool),
                                                x.reshape(-1)), id="buf[mask] = x"),
    pytest.param(lambda buf, x: buf.t().__setitem__(_all(), x.t()), id="transposed"),
    pytest.param(lambda buf, x: buf.index_copy_(0, _all(), x), id="index_copy_"),
    pytest.param(lambda buf, x: buf.masked_scatter_(torch.ones(4, 4, dtype=torch.bool), x),
                 id="masked_scatter_"),
    pytest.param(lambda buf, x: buf.scatter_(0, _all()[:, None].expand(4, 4), x),
                 id="scatter_"),
])
def test_a_scratch_refilled_by_a_put_forgets_the_numbers_lost_in_it(put):
    # A scratch that holds a's number lost by the loader's cast (in rows this rank does
    # not load) is filled for b by a put (``buf[rows] = x``), not a copy_: b's NaN there
    # is a "keep", and the copy of b's rows was refused for a's number (naming 'a').
    # The put now takes the marks of what it overwrites away, and brings its value's.
    a, b = _refilled()
    m = _Refilled(lambda buf, t: put(buf, t.to(_F8).float()))
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7
    # (b's own number lost by its cast before the put: refused, naming b's entry)
    lost = b._replace(values=torch.tensor([0.5, 1e6]), indices=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"value 1000000\.0 at checkpoint index 2 ") as e:
        patchkit.load_checkpoint_weight_patches(m, [a, lost])
    assert (e.value.position, e.value.name, e.value.value) == (1, "b", 2)
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


@pytest.mark.parametrize("fill", [
    pytest.param(lambda buf, x: torch.cat([x[:2], x[2:]], out=buf), id="cat"),
    pytest.param(lambda buf, x: torch.index_select(x, 0, _all(), out=buf), id="index_select"),
    pytest.param(lambda buf, x: torch.mul(x, 1.0, out=buf), id="mul"),
])
def test_a_scratch_refilled_by_an_out_op_forgets_the_numbers_lost_in_it(fill):
    # (as with a put: ``torch.cat(ts, out=buf)`` writes all of the scratch anew, and b's
    # NaN there is a "keep", not a's number lost; it was refused naming 'a')
    a, b = _refilled()
    m = _Refilled(fill)
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


def _first_of(buf, x):
    buf.view(-1)[0] = x.reshape(-1)[0]  # (b's one value, at checkpoint index 0)


@pytest.mark.parametrize("fill", [
    pytest.param(lambda buf, x: (buf.fill_(float("nan")), _first_of(buf, x)), id="fill_"),
    pytest.param(lambda buf, x: buf.zero_().add_(x), id="zero_, then add_"),
    pytest.param(lambda buf, x: (buf.masked_fill_(torch.ones(4, 4, dtype=torch.bool),
                                                  float("nan")), _first_of(buf, x)),
                 id="masked_fill_"),
    pytest.param(lambda buf, x: torch.add(x, 0.0, out=buf), id="add, out="),
    # (nan_to_num makes a number of the NaN: its mark goes, and the NaN that b's add_
    # puts there later is b's "keep")
    pytest.param(lambda buf, x: buf.nan_to_num_(0.0).mul_(0.0).add_(x),
                 id="nan_to_num_, then mul_ and add_"),
    pytest.param(lambda buf, x: torch.nan_to_num(buf, 0.0, out=buf).mul_(0.0).add_(x),
                 id="nan_to_num, out=, then mul_ and add_"),
    pytest.param(lambda buf, x: buf.copy_(buf.nan_to_num(0.0) * 0.0 + x),
                 id="nan_to_num, then scaled and added"),
    # (b's rows picked by a where, or a's filled with NaN: the mark of a's number, in
    # row 0, where b keeps, is on the side the op did not take)
    pytest.param(lambda buf, x: buf.copy_(torch.where(
        torch.arange(4, device=buf.device)[:, None] < 2, x, buf)), id="where picks b's rows"),
    pytest.param(lambda buf, x: (buf.copy_(buf.masked_fill(torch.ones(4, 1, dtype=torch.bool),
                                                           float("nan"))), _first_of(buf, x)),
                 id="masked_fill"),
])
def test_a_scratch_refilled_by_a_fill_forgets_the_numbers_lost_in_it(fill):
    # A fill writes the scratch anew: the NaN it leaves where a's number was lost (index
    # 1) is b's "keep". The marks stayed, and b's copy was refused naming 'a'.
    a, b = _refilled()
    m = _Refilled(fill)
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


def test_a_masked_fill_keeps_the_lost_numbers_it_does_not_fill():
    # (masked_fill_ writes only where its mask is: a number lost elsewhere stays marked)
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                buf = torch.empty(2, 4)
                buf.copy_((t[2:] * 2).to(_F8))
                mask = torch.zeros(2, 4, dtype=torch.bool, device=buf.device)
                mask[0] = True
                self.w.copy_(buf.masked_fill_(mask, 3.0))
            return {n for n, _ in weights}

    here = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    m = Partly()
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [here])
    assert m.w.detach().float().eq(1).all()
    # (lost in the row it fills: its 3.0 lands, and no mark is left to refuse)
    there = here._replace(values=torch.tensor([1e6, 2.0]), indices=torch.tensor([9, 13]))
    assert patchkit.load_checkpoint_weight_patches(m, [there]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [3.0] * 4 + [1.0, 4.0, 1.0, 1.0]


def test_a_number_lost_before_a_put_into_a_scratch_is_refused():
    # (``buf[rows] = x`` of a scaled cast, then the scratch's rows copied: the put moves
    # the elements unchanged, and their marks with them; before, it lost the trail and
    # 2e6 was lost without a word)
    def how(t):
        buf = torch.zeros(4, 4)
        back = torch.tensor([3, 2, 1, 0])
        buf[back] = (t * 2).to(_F8).float()[back]
        return buf[2:]

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.value) == (0, "w", 5)
    assert m.w.detach().float().eq(1).all()
    ok = p._replace(values=torch.tensor([2.0, 3.0]))
    assert patchkit.load_checkpoint_weight_patches(m, [ok]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 4.0, 1.0, 1.0, 1.0, 6.0, 1.0, 1.0]


def test_a_scratch_reused_for_the_next_patchs_plain_copy_forgets_the_numbers_lost_in_it():
    # (as above, but b's staged values are copied into the scratch as they are: a plain
    # copy of staged values is not read for lost numbers, yet it overwrites the marks)
    class TwoFromOneScratch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            buf = torch.empty(4, 4, dtype=_F8)
            for n, t in weights:
                buf.copy_(t if n == "b" else t * 2)
                getattr(self, n).copy_(buf[:2] if n == "b" else buf[2:])
            return {n for n, _ in weights}

    a = CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    b = CWP("b", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([5]))
    m = TwoFromOneScratch()
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.b.detach().float().reshape(-1).tolist() == [1.0] * 5 + [0.5, 1.0, 1.0]


@pytest.mark.parametrize("write", [
    pytest.param(lambda buf: buf[1].copy_(torch.zeros(4)), id="copy_"),
    pytest.param(lambda buf: buf.__setitem__(torch.tensor([1]), torch.zeros(1, 4)),
                 id="buf[rows] = x"),
])
def test_a_partial_write_of_a_float32_scratch_keeps_the_lost_numbers_it_does_not_overwrite(write):
    # A float32 scratch holds 2e6, lost by the loader's float8 cast, at element 1 (byte
    # 4); the loader then writes row 1 (elements 4-7) and copies rows 0-1: the mark of
    # element 1 stays (an unmark by element, not byte, offsets, or of the whole scratch,
    # dropped it, and the update was lost without a word)
    def how(t):
        buf = torch.empty(4, 4)
        buf.copy_((t * 2).to(_F8))
        write(buf)
        return buf[:2]

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 1 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.value) == (0, 1)
    assert m.w.detach().float().eq(1).all()


def test_a_cast_that_loses_more_numbers_keeps_the_marks_of_those_lost_before():
    # 2e6 is lost in float8_e5m2fnuz (largest 57344); the whole tensor is then cast to
    # float8_e4m3fnuz (largest 240), which loses 300 in row 0, which this rank does not
    # load: the mark of 2e6 (row 3) must stay, with its number, beside the new one
    m = _Fp8Copies(lambda t: (t * 2).to(torch.float8_e5m2fnuz).to(_F8)[2:], (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([150.0, 1e6]), torch.tensor([1, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.value) == (0, 5)
    assert m.w.detach().float().eq(1).all()


def test_a_copy_of_a_lost_number_into_a_float32_scratch_carries_its_mark():
    # (the scratch's dtype has infinities, so no copy into it loses a number, but the
    # NaN it receives is one: its mark comes with it, or the copy into the float8 model
    # sees only a NaN, "keep")
    def how(t):
        buf = torch.empty(2, 4)
        buf.copy_((t[2:] * 2).to(_F8))
        return buf

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_a_number_the_loader_wrote_beside_the_patchs_rows_and_lost_is_refused():
    # (a scratch whose rows 0-1 are the patch's staged rows, copied as they are, and rows
    # 2-3 the loader's own 1e6: the cast of the scratch is not a plain cast of staged
    # values, and float8 loses 1e6, which the merge would read as "keep")
    def how(t):
        buf = torch.full((4, 4), 1e6)
        buf[:2].copy_(t[2:])
        return buf.to(_F8)

    m = _Fp8Copies(how, (4, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0]), torch.tensor([9]))
    with pytest.raises(ValueError, match=r"value 1000000\.0 at element 8 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_a_number_lost_in_a_cast_of_values_no_trace_reaches_is_refused():
    # (the patch's values through numpy: a tensor no trace reaches, whose cast holds no
    # staged values that are known to fit, so it is read, and 1e6 is marked)
    m = _Fp8Copies(lambda t: torch.from_numpy(t.numpy().copy()).to(_F8)[2:], (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 1000000\.0 at element 5 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_a_number_lost_after_the_loader_scaled_the_staged_tensor_in_place_is_refused():
    # (t.mul_(2) on the staged tensor: its casts are no plain casts of the patch's values
    # any more, though they keep its trace; 200 fits float8, 400 does not)
    def how(t):
        t.mul_(2)
        return torch.cat([t[2:3].to(_F8), t[3:4].to(_F8)])

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 200.0]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 400\.0 at "):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_an_accumulating_put_keeps_the_lost_numbers_it_adds_to():
    # (buf.index_put_(rows, x, accumulate=True) adds: a NaN it meets stays NaN, and lost)
    def how(t):
        buf = torch.empty(4, 4)
        buf.copy_((t * 2).to(_F8))
        buf.index_put_((torch.tensor([2, 3]),), torch.ones(2, 4), accumulate=True)
        return buf[2:]

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_numbers_lost_in_a_freed_storage_are_not_read_at_its_address_reused():
    # A storage the loader's cast marked, freed; a new storage over the same memory
    # (torch.frombuffer of one reused buffer, filled outside torch) starts at the same
    # address: the old marks are not its, and its NaN where a mark was is a "keep"
    class Reused(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            mem = bytearray(16)
            for _, t in weights:
                old = torch.frombuffer(mem, dtype=torch.uint8).view(_F8).view(4, 4)
                old.copy_(torch.full((4, 4), 1e9))  # (all 16 lost, and marked)
                del old
                mem[:] = t.to(_F8).view(torch.uint8).reshape(-1).tolist()
                self.w.copy_(torch.frombuffer(mem, dtype=torch.uint8).view(_F8).view(4, 4)[2:])
            return {n for n, _ in weights}

    m = Reused()
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0]), torch.tensor([9]))
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 2.0] + [1.0] * 6


def test_a_number_lost_into_a_transposed_scratch_is_found_by_its_place():
    # (a copy into buf.t() marks its elements in the view's order, storage elements 9
    # then 6: the marks are kept sorted, or element 6 was not found in rows 0-1)
    def how(t):
        buf = torch.empty(4, 4, dtype=_F8)
        buf.t().copy_((t * 2).t())
        return buf[:2]

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([1e6, 1e6]), torch.tensor([6, 9]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 6 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


def test_a_lost_number_in_a_packed_float32_scratch_names_its_own_patch():
    # q and k copied into one float32 scratch (stretches of bytes 0-31 and 32-63), the
    # scratch cast whole and its halves cat: the number lost is k's, at k's checkpoint
    # index 6 (scratch element 14), told apart by byte, not element, offsets
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Parameter(torch.ones(4, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            got = dict(weights)
            buf = torch.empty(4, 4)
            buf[:2].copy_(got["q"])
            buf[2:].copy_(got["k"])
            x = buf.to(_F8)
            self.qk.copy_(torch.cat([x[:2], x[2:]]))
            return set(got)

    q = CWP("q", (2, 4), torch.float32, torch.tensor([2.0]), torch.tensor([0]))
    k = CWP("k", (2, 4), torch.float32, torch.tensor([0.5, 1e6]), torch.tensor([1, 6]))
    with pytest.raises(ValueError, match=r"value 1000000\.0 at checkpoint index 6 ") as e:
        patchkit.load_checkpoint_weight_patches(Packed(), [q, k])
    assert (e.value.position, e.value.name, e.value.value) == (1, "k", 6)


def test_a_lost_number_cast_in_one_call_is_refused_where_a_later_call_copies_it():
    # (a loader that casts what it is sent and copies it when the next name comes: the
    # marks are kept for the whole load, not only the call that made them)
    class Deferred(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.held = None

        def load_weights(self, weights):
            done = set()
            for n, t in weights:
                if n == "w":
                    self.held = (t * 2).to(_F8)  # (nothing copied yet: it reports none)
                else:
                    self.w.copy_(self.held[2:])
                    done.add("w")
            return done

    w = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    go = CWP("go", (1,), torch.float32, torch.tensor([0.0]), torch.tensor([0]))
    m = Deferred()
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5") as e:
        patchkit.load_checkpoint_weight_patches(m, [w, go], max_chunk_bytes=64)
    # (the patch whose number it was, not the one the later call loads)
    assert str(e.value).startswith("load_weights (call 1, patch 0 ('w'), runtime tensor 'w')")
    assert (e.value.position, e.value.name, e.value.reason) == (
        0, "w", "NaN in the runtime dtype")
    assert m.w.detach().float().eq(1).all()


def test_a_lost_number_in_a_cat_of_two_patches_names_the_patch_it_came_from():
    # (q and k, each scaled and cast, copied as one: the copy's source is traced to no
    # single patch, so only the mark can say that the number was k's)
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = nn.Parameter(torch.ones(4, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            got = dict(weights)
            self.qk.copy_(torch.cat([(got["q"] * 2).to(_F8), (got["k"] * 2).to(_F8)]))
            return set(got)

    q = CWP("q", (2, 4), torch.float32, torch.tensor([2.0]), torch.tensor([0]))
    k = CWP("k", (2, 4), torch.float32, torch.tensor([0.5, 1e6]), torch.tensor([1, 6]))
    m = Packed()
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 14 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [q, k])
    assert (e.value.position, e.value.name, e.value.value) == (1, "k", 14)
    assert m.qk.detach().float().eq(1).all()


@needs_float8_fill
def test_a_lost_number_overwritten_before_the_copy_stops_nothing():
    # A marked element that holds a number again (the loader zeroed the row) is no
    # "keep": the copy writes it
    def how(t):
        x = (t * 2).to(_F8)
        x[3].fill_(0)
        return x[2:]

    m = _Fp8Copies(how, (2, 4))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 4.0] + [1.0] * 2 + [0.0] * 4


def test_a_number_the_loaders_cast_lost_is_refused_in_a_report_and_rolled_back():
    m = _Fp8Copies(lambda t: (t.narrow(0, 2, 2) * 2).to(_F8), (2, 4))
    first = CWP("w", (4, 4), torch.float32, torch.tensor([3.0]), torch.tensor([8]))
    lost = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    for run in (patchkit.load_checkpoint_weight_patches, inspect_load):
        with pytest.raises(ValueError, match=r"2000000\.0 at element 5") as e:
            run(m, [first, lost], transactional=True)
        assert (e.value.position, e.value.reason) == (1, "NaN in the runtime dtype")
        assert m.w.detach().float().eq(1).all()  # (the first call's 6.0 rolled back)


def _pause_interrupted(*args):
    raise KeyboardInterrupt  # (a signal before the pause was counted)


def test_a_pause_of_the_collector_never_counted_turns_nothing_back_on(monkeypatch):
    # A signal before or inside _pause_collector leaves the load's (or the block's) token
    # uncounted: its end must not turn the collector on, even where the last pause found it
    # on (``_resume_after`` still True), since this one never turned it off.
    import gc

    from patchkit import loader

    sparse = CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([2]))
    monkeypatch.setattr(loader, "_resume_after", True)
    monkeypatch.setattr(loader, "_pause_collector", _pause_interrupted)
    was = gc.isenabled()
    try:
        gc.disable()
        with pytest.raises(KeyboardInterrupt):
            patchkit.load_checkpoint_weight_patches(PlainModel({"w": (4,)}), [sparse])
        assert not gc.isenabled()
        with pytest.raises(KeyboardInterrupt), loader.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


class _Returns(nn.Module):
    def __init__(self, returns):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.returns = returns

    def load_weights(self, weights):
        for _, t in weights:
            self.w.copy_(t)
        return self.returns()


def test_a_generator_of_unhashable_names_is_shown_as_what_it_gave():
    from patchkit.errors import ContractViolation

    m = _Returns(lambda: (x for x in [["w"]]))
    with pytest.raises(ContractViolation, match=r"returned \[\['w'\]\] \(generator\)") as e:
        patchkit.load_checkpoint_weight_patches(m, [CWP("w", (4,), torch.float32,
                                                        torch.ones(4))])
    # (the error's value is text, not the list: an error must pickle, with its report)
    assert e.value.value == "[['w']]"
    m = _Returns(object)
    with pytest.raises(ContractViolation, match=r"returned <object object at") as e:
        patchkit.load_checkpoint_weight_patches(m, [CWP("w", (4,), torch.float32,
                                                        torch.ones(4))])
    assert type(e.value.value) is str and e.value.value.startswith("<object object at")


def test_a_memory_error_staging_a_patch_gets_the_note_naming_it(monkeypatch):
    from patchkit import loader

    def no_memory(patch):
        raise MemoryError

    monkeypatch.setattr(loader, "_stage", no_memory)
    with pytest.raises(MemoryError) as e:
        patchkit.load_checkpoint_weight_patches(
            PlainModel({"w": (4,)}), [CWP("w", (4,), torch.float32, torch.ones(4))])
    # (on Python 3.10 too, which has no add_note: in __notes__, as 3.11's add_note puts it)
    assert e.value.__notes__ == [
        "(raised staging patch 0 ('w') for load_weights call 0, before that call: a dense "
        "patch of shape (4,) torch.float32 stages 16 B)"]


class _TiedReturnsAlias(nn.Module):
    """``a`` registered first, ``b`` its tied alias; the loader writes what it is sent and
    returns the alias's name, as a loader that maps names back may."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = self.a

    def load_weights(self, weights):
        for _, t in weights:
            self.a.copy_(t)
        return {"b"}


def test_a_renamed_patch_whose_tied_alias_name_was_returned_raises_no_warning():
    m = _TiedReturnsAlias()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patchkit.load_checkpoint_weight_patches(
            m, [CWP("b", (4,), torch.float32, torch.ones(4))]) == {"b"}
    assert m.a.eq(1).all()


def test_a_dropped_alias_of_another_dtype_is_named_in_a_warning():
    # the same values tensor, but a bfloat16 checkpoint tensor where the canonical patch's
    # is float32: what the alias would have written differs, so dropping it is told
    m = _TiedReturnsAlias()
    v = torch.full((4,), 1.1)
    patches = [CWP("a", (4,), torch.float32, v), CWP("b", (4,), torch.bfloat16, v)]
    with pytest.warns(UserWarning, match=r"patch 1 \('b'\) is not loaded: it names the tied "
                      r"alias of 'a'.*Its values differ"):
        patchkit.load_checkpoint_weight_patches(m, patches)


class _ManyTied(nn.Module):
    """``n`` parameters, each registered as ``t{i}`` (its first name: a module's own
    parameters come before its children's) and in ``ws``; its loader writes nothing and
    returns the names it was sent."""

    def __init__(self, n: int):
        super().__init__()
        self.ws = nn.ParameterList(
            [nn.Parameter(torch.zeros(2), requires_grad=False) for _ in range(n)])
        for i in range(n):
            setattr(self, f"t{i}", self.ws[i])

    def load_weights(self, weights):
        return {name for name, _ in weights}


def test_a_load_dropping_many_tied_aliases_reads_the_alias_map_once(monkeypatch):
    # (each patch of a first name whose alias patch was dropped scanned every alias after
    # its call, to see whether the loader returned one: 8 k tied pairs took 1.2 s)
    from patchkit import loader

    n = 64
    read: list[str] = []

    class Counted(dict):
        def items(self):
            for kv in super().items():
                read.append(kv[0])
                yield kv

    real = loader._tied_aliases
    monkeypatch.setattr(loader, "_tied_aliases", lambda model: Counted(real(model)))
    patches = [CWP(f"{pre}{i}", (2,), torch.float32, torch.ones(2))
               for pre in ("t", "ws.") for i in range(n)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patchkit.load_checkpoint_weight_patches(_ManyTied(n), patches) == {
            f"t{i}" for i in range(n)}
    assert len(read) <= n  # (each alias once; n * n before)


def test_tied_parts_split_alike_are_compared_part_for_part_without_a_scan(monkeypatch):
    # (a dropped alias part was compared with its own rank's part first, but every part of
    # the first name was copied into a list before that comparison, for each dropped part:
    # 8 k parts of a tensor and as many of its tied alias took 2.2 s to canonicalise)
    from patchkit import loader

    k = 64
    visited: list[int] = []

    class Counted(list):
        def __iter__(self):
            for j in super().__iter__():
                visited.append(j)
                yield j

    real = loader._warn_if_dropped_differs
    monkeypatch.setattr(loader, "_warn_if_dropped_differs",
                        lambda i, p, target, patches, same, rank: real(
                            i, p, target, patches, Counted(same), rank))
    patches = [CWP(name, (2,), torch.float32, torch.full((2,), float(i)))
               for name in ("t0", "ws.0") for i in range(k)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept, positions = loader.canonicalize_tied(_ManyTied(1), patches)
    assert positions == list(range(k)) and [p.name for p in kept] == ["t0"] * k
    assert len(visited) <= k  # (k * k before)
    # (an alias part that matches no part of its rank is still compared with every part)
    visited.clear()
    with pytest.warns(UserWarning, match=r"patch 2 \('ws.0'\) is not loaded.*Its values differ"):
        loader.canonicalize_tied(_ManyTied(1), [*patches[:2], CWP(
            "ws.0", (2,), torch.float32, torch.full((2,), 9.0))])
    assert set(visited) == {0, 1}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_transactional_report_keeps_the_deltas_a_plain_one_has(kind):
    # (a report saves every written region; a transactional load that succeeds lets its
    # saves go at its end, but not a report's, whose deltas are read from them)
    p = (CWP("w", (4,), torch.float32, torch.tensor([0.0, 2.0, 0.0, 0.0])) if kind == "dense"
         else CWP("w", (4,), torch.float32, torch.tensor([2.0]), torch.tensor([1])))
    reports = [inspect_load(PlainModel({"w": (4,)}), [p], transactional=t)
               for t in (False, True)]
    for r in reports:
        assert r.deltas.loc["w", ["elements", "changed", "max_abs"]].tolist() == [
            1 if kind == "sparse" else 4, 1, 2.0]
    assert reports[1].deltas.equals(reports[0].deltas)
    assert not reports[1].rolled_back


@pytest.mark.parametrize("kind", ["sparse", "transactional"])
def test_a_refused_model_is_named_with_the_kind_of_load_refused(kind):
    # (a sparse tensor holds no strided memory: a sparse or a transactional load, which
    # must see its writes, is refused, and the message says which of them was)
    from patchkit.errors import ContractViolation

    m = PlainModel({"w": (4,)})
    m.register_buffer("s", torch.zeros(4).to_sparse())
    if kind == "sparse":
        p, kw = CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([1])), {}
    else:
        p, kw = CWP("w", (4,), torch.float32, torch.ones(4)), {"transactional": True}
    with pytest.raises(ContractViolation, match=f"^a {kind} load into this model is refused "
                       "before anything is written: runtime tensor 's'"):
        patchkit.load_checkpoint_weight_patches(m, [p], **kw)
    assert m.w.eq(0).all()


class _QuietUntil(PlainModel):
    """Returns each call's names and writes nothing patchkit sees, until a call is sent
    weight ``fail``: that call raises ``KeyError(fail)``."""

    def __init__(self, shapes, fail: str) -> None:
        super().__init__(shapes)
        self.fail = fail

    def load_weights(self, weights):
        names = [name for name, _ in weights]
        if self.fail in names:
            raise KeyError(self.fail)
        return names


def test_a_rollback_counts_the_other_calls_that_returned_names_without_a_write():
    # two calls return their names and write nothing patchkit sees; the third raises: the
    # rollback's warning names the first of them and counts the other
    m = _QuietUntil({n: (4,) for n in "abc"}, "c")
    ps = [CWP(n, (4,), torch.float32, torch.ones(4)) for n in "abc"]
    with pytest.warns(UserWarning, match=r"load_weights \(call 0, patch 0 \('a'\)\) returned "
                      r"\['a'\] without a write it saw \(and 1 other call alike\): "), \
            pytest.raises(KeyError):
        patchkit.load_checkpoint_weight_patches(m, ps, transactional=True, max_chunk_bytes=16)


def test_a_rollback_goes_on_past_a_flag_torch_will_not_set_back():
    # A loader that, under torch.enable_grad(), copies a tensor that requires grad into a
    # buffer makes it a non-leaf with requires_grad=True; torch refuses to turn that flag
    # off, and that refusal stopped the rollback before any value was put back.
    class GradCopy(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                self.get_parameter(name).copy_(w)
                with torch.enable_grad():
                    self.b.copy_(torch.full((3,), 5.0, requires_grad=True))
            raise KeyError("stop")

    model = GradCopy({"w": (3,)})
    model.register_buffer("b", torch.zeros(3))
    with pytest.raises(KeyError, match="stop"):
        patchkit.load_checkpoint_weight_patches(
            model, [CWP("w", (3,), torch.float32, torch.ones(3))], transactional=True)
    assert model.w.tolist() == [0.0] * 3 and model.b.tolist() == [0.0] * 3


class _ThreeNames(nn.Module):
    """One Parameter registered as ``a`` (first), ``b`` and ``c``; the loader writes
    nothing and returns no name."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = self.a
        self.c = self.a

    def load_weights(self, weights):
        return set()


def test_a_patch_whose_dropped_alias_was_not_loaded_names_only_the_aliases_dropped():
    # (of a Parameter with two aliases, only the one whose patch this load dropped: 'c'
    # was never sent)
    patches = [CWP(n, (4,), torch.float32, torch.ones(4)) for n in ("a", "b")]
    with pytest.warns(UserWarning) as caught:
        patchkit.load_checkpoint_weight_patches(_ThreeNames(), patches)
    (w,) = [w for w in caught if "returned no name" in str(w.message)]
    assert str(w.message).startswith(
        "patch 0 ('a') names the tied Parameter whose patch under 'b' this load dropped ")


class _SharedBuffer(nn.Module):
    """A buffer registered under two names (``rope.cache`` first, ``attn.cache``), as a
    shared rotary table is; the loader copies what it is sent into the buffer the name
    names and returns the names it was sent."""

    def __init__(self):
        super().__init__()
        self.rope, self.attn = nn.Module(), nn.Module()
        self.rope.register_buffer("cache", torch.zeros(4))
        self.attn.register_buffer("cache", self.rope.cache)
        self.sent: list[str] = []

    def load_weights(self, weights):
        for name, w in weights:
            self.sent.append(name)
            self.get_buffer(name).copy_(w)
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["plain", "transactional", "sparse", "report"])
def test_a_buffer_registered_under_two_names_is_sent_under_the_name_patched(how):
    # CONTRACT §6 renames the aliases of a Parameter; a buffer's second name is sent as
    # it is, by every kind of load alike (a watched one looked the name up among all the
    # index's aliases, buffers included, and renamed it where a plain one did not)
    m = _SharedBuffer()
    if how == "sparse":
        patch = CWP("attn.cache", (4,), torch.float32, torch.tensor([1.0]),
                    torch.tensor([2]))
    else:
        patch = CWP("attn.cache", (4,), torch.float32, torch.ones(4))
    if how == "report":
        patchkit.inspect_load(m, [patch])
    else:
        patchkit.load_checkpoint_weight_patches(m, [patch], transactional=how == "transactional")
    assert m.sent == ["attn.cache"]
    assert m.rope.cache.tolist() == ([0.0, 0.0, 1.0, 0.0] if how == "sparse" else [1.0] * 4)


def test_a_call_named_in_a_message_names_an_unmatched_entry_by_name_alone():
    # (an observed call's entry no patch has sits at position -1: "patch 'x'", as the
    # loader's notes name it, not "patch -1 ('x')")
    from patchkit.intercept import _call_named

    staged = [("a", None), ("x", None)]
    assert _call_named(2, [4, -1], staged) == "load_weights (call 2, patch 4 ('a'), patch 'x')"
    many = [(f"w{i}", None) for i in range(7)]
    assert _call_named(0, list(range(7)), many) == (
        "load_weights (call 0, " + ", ".join(f"patch {i} ('w{i}')" for i in range(5))
        + ", and 2 more)")


def test_a_call_of_many_patches_that_wrote_nothing_is_named_by_its_first_few():
    """A call of thousands of small patches whose loader returns their names and writes
    nothing patchkit sees: the sparse load's ContractViolation, and a rollback's warning,
    name the call by its first 5 patches and 5 returned names and count the rest, not
    every patch and name (a message of 100 KB for 5000 patches)."""
    from patchkit import ContractViolation

    n = 2000

    shapes = {f"w{i:04d}": (2,) for i in range(n)}
    m = _QuietUntil(shapes, "last")
    sparse = [CWP(k, (2,), torch.float32, torch.ones(1), torch.tensor([0])) for k in shapes]
    call = (r"load_weights \(call 0, patch 0 \('w0000'\), patch 1 \('w0001'\), patch 2 "
            r"\('w0002'\), patch 3 \('w0003'\), patch 4 \('w0004'\), and 1995 more\) returned "
            r"2000 names, \['w0000', 'w0001', 'w0002', 'w0003', 'w0004', \.\.\.\] without ")
    with pytest.raises(ContractViolation, match="^" + call + "copying into any runtime") as e:
        patchkit.load_checkpoint_weight_patches(m, sparse)
    assert len(str(e.value)) < 1000
    m = _QuietUntil({**shapes, "last": (2,)}, "last")
    dense = [CWP(k, (2,), torch.float32, torch.ones(2)) for k in [*shapes, "last"]]
    with pytest.warns(UserWarning, match=call + "a write it saw") as w, pytest.raises(KeyError):
        patchkit.load_checkpoint_weight_patches(m, dense, transactional=True,
                                                max_chunk_bytes=8 * n)
    assert max(len(str(x.message)) for x in w) < 1000
    assert all(t.eq(0).all() for t in m.state_dict().values())


def test_a_call_of_exactly_five_patches_is_named_by_all_five():
    # (at the limit: no 'and 0 more', and the five returned names as a list)
    class Quiet(PlainModel):
        def load_weights(self, weights):
            return [name for name, _ in weights]

    names = [f"w{i}" for i in range(5)]
    m = Quiet({n: (2,) for n in names})
    ps = [CWP(n, (2,), torch.float32, torch.ones(1), torch.tensor([0])) for n in names]
    with pytest.raises(patchkit.ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, ps)
    assert str(e.value).startswith(
        "load_weights (call 0, " + ", ".join(f"patch {i} ('w{i}')" for i in range(5))
        + ") returned ['w0', 'w1', 'w2', 'w3', 'w4'] without copying")


# -- a sparse write's refusals name where they happened (intercept.py) -----------------


class _TwoCopies(nn.Module):
    """One weight ``w`` of ``shape`` and ``dtype``; ``first`` and ``second``: ``(into,
    src)``, a copy of ``src(t)`` into ``into(w)``. A patch named ``w`` makes both copies
    (``second`` ``None``: the first only), a patch of another name the first only."""

    def __init__(self, shape, dtype, first, second=None):
        super().__init__()
        self.w = nn.Parameter(torch.ones(*shape).to(dtype), requires_grad=False)
        self.first, self.second = first, second

    def load_weights(self, weights):
        for n, t in weights:
            for how in (self.first, self.second) if n == "w" else (self.first,):
                if how is not None:
                    into, src = how
                    into(self.w.data).copy_(src(t))
        return {n for n, _ in weights}


@pytest.mark.parametrize(("shape", "how", "shapes"), [
    # (as many elements as the view, but another shape: a broadcast that copies 4 into 4)
    pytest.param((1, 4), (lambda w: w, lambda t: t.reshape(-1)), ((4,), (1, 4)), id="(4,)->(1,4)"),
    # (the same first dimension, but another second one: a broadcast of a column)
    pytest.param((2, 3), (lambda w: w, lambda t: t[:, :1]), ((2, 1), (2, 3)), id="(2,1)->(2,3)"),
])
def test_a_sparse_copy_that_is_not_same_shaped_is_refused_whatever_its_element_count(
        shape, how, shapes):
    # A broadcast copy merges no NaN-masked patch element for element, even where it
    # copies as many elements as the view holds, or keeps the view's first dimension
    m = _TwoCopies(shape, torch.float32, how)
    p = CWP("w", shape, torch.float32, torch.tensor([2.0]), torch.tensor([1]))
    with pytest.raises(patchkit.ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert str(e.value).startswith(
        f"load_weights (call 0, patch 0 ('w'), runtime tensor 'w') copied a {shapes[0]} "
        f"torch.float32 source into a {shapes[1]} torch.float32 view")
    assert (e.value.reason, e.value.value) == ("same-shaped floating-point", shapes)
    assert m.w.detach().eq(1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_runtime_views_that_share_one_element_are_refused_naming_the_patch(dtype):
    # (elements 0-2, then 2-4: they meet in element 2 only, which for a one-byte dtype is
    # one byte; the error names the patch and the tensor, as every refused write does)
    m = _TwoCopies((8,), dtype, (lambda w: w[0:3], lambda t: t[0:3]),
                   (lambda w: w[2:5], lambda t: t[2:5]))
    other = CWP("v", (8,), dtype, torch.tensor([3.0]), torch.tensor([0]))
    p = CWP("w", (8,), dtype, torch.tensor([2.0, 0.5]), torch.tensor([1, 3]))
    with pytest.raises(patchkit.ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, [other, p], max_chunk_bytes=8)
    assert str(e.value).startswith(
        "load_weights (call 1, patch 1 ('w'), runtime tensor 'w') wrote a (3,) view at "
        "element 2 that overlaps a view written earlier in the same call")
    assert (e.value.position, e.value.name, e.value.reason) == (
        1, "w", "overlapping runtime views")
    # (the first load and the first view of the second stay, as a failed call's writes do)
    assert m.w.detach().float().tolist() == [3.0, 2.0] + [1.0] * 6


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: t.narrow(0, 2, 2), id="rows of the staged tensor"),
    pytest.param(lambda t: t.narrow(0, 2, 2) * 2, id="a source of no known offset"),
])
def test_a_number_lost_in_the_runtime_dtype_is_refused_naming_the_patch_and_tensor(how):
    # (its message starts as every refused sparse write's does: the call, the patch, the
    # runtime tensor; the patch is named though the call loads two)
    m = _Fp8Copies(how, (2, 4))
    other = CWP("v", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([0]))
    p = CWP("w", (4, 4), torch.float32, torch.tensor([0.5, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError) as e:
        patchkit.load_checkpoint_weight_patches(m, [other, p], max_chunk_bytes=64)
    assert str(e.value).startswith(
        "load_weights (call 1, patch 1 ('w'), runtime tensor 'w') copied a torch.float32 "
        "source into a torch.float8_e4m3fnuz view, where the value")
    assert (e.value.position, e.value.name, e.value.reason) == (1, "w", "NaN in the runtime dtype")


# -- the sparse value checks of long index lists (patch.py, _sparse_flags) ---------------
# On the CPU up to _READ_AS_INTS (128) indices are checked as Python ints; longer lists go
# through torch ops: a strictly-increasing shortcut, then a sort or a mark per element
# (whichever costs less for the tensor's size). Each case runs on both sides of 128.


def _index_case(case, count):
    """(numel, indices, expected (reason, value) or None) of one case with ``count``
    indices."""
    up = torch.arange(count)
    down = torch.arange(count).flip(0)
    if case == "index == numel":
        return 1000, torch.cat([up[:-1], torch.tensor([1000])]), ("out-of-range", 1000)
    if case == "index -1":
        return 1000, torch.cat([torch.tensor([-1]), up[1:]]), ("out-of-range", -1)
    if case == "sorted, one repeat":
        return 1000, torch.cat([up[:3], torch.tensor([2]), up[4:]]), ("duplicate", 2)
    if case in ("unsorted, one repeat, sorted to check", "unsorted, one repeat, marked"):
        n = 100_000 if case.endswith("sorted to check") else 300
        return n, torch.cat([down[:-1], torch.tensor([1])]), ("duplicate", 1)
    assert case == "unsorted, distinct, up to the last element"
    return 300, torch.arange(300 - count, 300).flip(0), None


@pytest.mark.parametrize("count", [5, 200])
@pytest.mark.parametrize("case", [
    "index == numel", "index -1", "sorted, one repeat",
    "unsorted, one repeat, sorted to check", "unsorted, one repeat, marked",
    "unsorted, distinct, up to the last element",
])
def test_a_long_index_list_is_checked_as_a_short_one_is(case, count):
    from patchkit.patch import validate_patches

    n, idx, expected = _index_case(case, count)
    assert idx.numel() == count
    p = CWP("w", (n,), torch.float32, torch.ones(count), idx)
    if expected is None:
        assert validate_patches([p]) == "sparse"
        return
    with pytest.raises(PatchValueError) as info:
        validate_patches([CWP("ok", (4,), torch.float32, torch.ones(1), torch.tensor([0])), p])
    assert (info.value.position, info.value.name) == (1, "w")
    assert (info.value.reason, info.value.value) == expected


@pytest.mark.parametrize("count", [5, 200])
def test_repeated_indices_pass_unchecked_long_or_short_when_asked(count):
    # validate_unique_indices=False skips only the repeat check, on both sides of 128
    # indices: a repeat passes, an index out of range is still refused
    from patchkit.patch import validate_patches

    idx = torch.cat([torch.arange(count - 1), torch.tensor([0])])  # (0 twice)
    repeat = CWP("w", (1000,), torch.float32, torch.ones(count), idx)
    assert validate_patches([repeat], validate_unique_indices=False) == "sparse"
    with pytest.raises(PatchValueError) as info:
        validate_patches([repeat])
    assert (info.value.reason, info.value.value) == ("duplicate", 0)
    out = CWP("w", (1000,), torch.float32, torch.ones(count), torch.cat(
        [idx[:-1], torch.tensor([1000])]))
    with pytest.raises(PatchValueError) as info:
        validate_patches([out], validate_unique_indices=False)
    assert (info.value.reason, info.value.value) == ("out-of-range", 1000)


# On the CPU the values of small patches held in their own dtype are read for NaN together
# (a group per dtype and 128 patches); a NaN found there has each patch checked on its
# own, so the first offending patch is named as before, whatever its group.


@pytest.mark.parametrize("bad_at", [3, 1500, 2099])
def test_a_nan_among_many_small_patches_names_its_patch(bad_at):
    from patchkit.patch import validate_patches

    patches = []
    for i in range(2100):
        dtype = torch.bfloat16 if i % 3 else torch.float32  # two groups, several parts each
        values = torch.full((3,), 0.5, dtype=dtype)
        if i in (bad_at, 2099):
            values[1] = float("nan")
        patches.append(CWP(f"w{i}", (8,), dtype, values, torch.tensor([0, 4, 7])))
    with pytest.raises(PatchValueError) as info:
        validate_patches(patches)
    assert (info.value.position, info.value.name) == (bad_at, f"w{bad_at}")
    assert (info.value.reason, info.value.value) == ("NaN", 4)


@pytest.mark.parametrize("bad_at", [0, 127, 128, 255, 256, 299])
def test_a_lone_nan_in_the_first_or_last_patch_of_any_group_is_found(bad_at):
    # (the one NaN of the load, at either end of a group of 128 patches, or in the last,
    # shorter group: every patch of every group is read)
    from patchkit.patch import validate_patches

    patches = [CWP(f"w{i}", (8,), torch.bfloat16, torch.full((2,), 0.5, dtype=torch.bfloat16),
                   torch.tensor([1, 6])) for i in range(300)]
    patches[bad_at].values[1] = float("nan")
    with pytest.raises(PatchValueError) as info:
        validate_patches(patches)
    assert (info.value.position, info.value.reason, info.value.value) == (bad_at, "NaN", 6)


def test_a_lone_nan_among_small_patches_of_three_dtypes_is_found_in_each():
    # (one check per dtype: the clean groups of the other dtypes hide nothing)
    from patchkit.patch import validate_patches

    patches = [CWP(f"w{i}", (8,), dtype, torch.full((2,), 0.5, dtype=dtype), torch.tensor([1, 6]))
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 5)]
    for bad_at in range(3):
        sent = list(patches)
        sent[bad_at] = sent[bad_at]._replace(
            values=torch.tensor([0.5, float("nan")], dtype=sent[bad_at].dtype))
        with pytest.raises(PatchValueError) as info:
            validate_patches(sent)
        assert (info.value.position, info.value.reason) == (bad_at, "NaN")


def test_int32_indices_into_a_weight_of_2_31_elements_or_more_are_read_as_int64():
    # Compared as int32 with a numel of 2**31 or more (which int32 wraps), every index
    # of a long list would read as out of range. Nothing here allocates the weight.
    from patchkit.patch import validate_patches

    idx = torch.arange(200, dtype=torch.int32) * 1000
    ok = CWP("w", ((1 << 31) + 8,), torch.bfloat16, torch.ones(200, dtype=torch.bfloat16), idx)
    assert validate_patches([ok]) == "sparse"
    assert validate_patches([ok._replace(indices=idx.flip(0))]) == "sparse"
    with pytest.raises(PatchValueError) as info:
        validate_patches([ok._replace(indices=torch.cat([idx[:199], idx[5:6]]))])
    assert (info.value.reason, info.value.value) == ("duplicate", 5000)


def test_an_earlier_patch_out_of_range_is_named_before_a_later_nan_read_in_a_group():
    from patchkit.patch import validate_patches

    patches = [CWP(f"w{i}", (8,), torch.float32, torch.ones(2), torch.tensor([1, 2]))
               for i in range(50)]
    patches[40] = patches[40]._replace(values=torch.tensor([1.0, float("nan")]))
    patches[7] = patches[7]._replace(indices=torch.tensor([1, 8]))  # (its values no NaN)
    patches[9] = patches[9]._replace(  # a cast makes this one's NaN: checked on its own
        dtype=torch.float8_e4m3fnuz, values=torch.tensor([1.0, 1e6]))
    with pytest.raises(PatchValueError) as info:
        validate_patches(patches)
    assert (info.value.position, info.value.reason, info.value.value) == (7, "out-of-range", 8)
    patches[7] = patches[6]
    with pytest.raises(PatchValueError) as info:
        validate_patches(patches)
    assert (info.value.position, info.value.reason, info.value.value) == (9, "NaN", 2)


# -- staging where torch cannot fill a float8 tensor (staging.py) ------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_is_staged_nan_filled_where_torch_has_no_fill_for_it(monkeypatch, dtype):
    # torch before 2.6 had no CPU fill_ for float8; staging then writes NaN's bits through
    # an integer view. Simulated here: fill_ refuses a float8 tensor, as that torch did.
    fill = torch.Tensor.fill_

    def old_fill(self, value):
        if self.dtype == dtype:
            raise NotImplementedError(f'"fill_cpu" not implemented for {dtype}')
        return fill(self, value)

    monkeypatch.setattr(torch.Tensor, "fill_", old_fill)
    p = CWP("w", (2, 3), dtype, torch.tensor([0.5, -2.0]), torch.tensor([4, 0]))
    staged = patchkit.stage(p)
    monkeypatch.undo()
    assert (staged.shape, staged.dtype) == ((2, 3), dtype)
    got = staged.float().flatten()
    assert got[[0, 4]].tolist() == [-2.0, 0.5]
    assert torch.isnan(got[[1, 2, 3, 5]]).all()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_sparse_complex_patch_is_refused_before_the_first_call(dtype):
    # complex holds NaN, but is no floating-point dtype (CONTRACT §1.2): refused as one,
    # not by the interception inside load_weights, whose copy_ takes floating point only.
    m = PlainModel({"w": (4,)})
    before = m.w.detach().clone()
    p = CWP("w", (4,), dtype, torch.ones(1, dtype=dtype), torch.tensor([1]))
    with pytest.raises(TypeError, match=r"patch 0 \('w'\): a sparse patch needs a "
                       "floating-point dtype") as info:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (info.value.reason, info.value.value) == ("sparse dtype", dtype)
    assert torch.equal(m.w.detach(), before)
