"""Sparse loads whose loaders mix a patch's elements before the copy into the model (a
rotation, a scale taken from the whole tensor or a block, a sort, a cumsum, a softmax):
the staged NaN ("keep") spreads over the patched elements and numbers move to other
elements, so the NaN-merge would keep elements it should update, or write numbers where
they do not belong, without a word. Such a copy is refused before it writes
(``ContractViolation``, reason ``"mixed elements"``, naming the patch and the op); loaders
that only look like it (a NaN check, an index, a statistic never written, views and
copies) load as before; a reduction, sort, scan or matmul over slices the patch keeps or
updates whole loads too (see test_mixing_slices.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit.bitwise import bits
from patchkit.errors import ContractViolation

# (loaders below call torch's beta index_reduce_ and scatter(reduce=), and resize an out=
# tensor, which warn)
pytestmark = pytest.mark.filterwarnings(
    r"ignore:index_reduce\(\) is in beta:UserWarning",
    "ignore:An output with one or more elements was resized:UserWarning",
    "ignore:The reduce argument of torch.scatter:UserWarning",
)

_FP8 = torch.float8_e4m3fn


def _rotation():
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=g))
    return q


_H = _rotation()


def _h(t):
    """The rotation, on ``t``'s device (made at import, on the CPU: under ``--device
    cuda`` the staged tensors are on the GPU)."""
    return _H.to(t.device)


class _Mixing(nn.Module):
    """Two (4, 8) parameters: ``other.w`` (float32), copied as sent, then ``a.w``
    (``dtype``), copied from ``f(weights)``, ``weights`` the call's staged tensors by
    name (an ``f`` may also leave the source in ``self.kept``)."""

    def __init__(self, f, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        here = torch.get_default_device()  # (a CPU generator draws on the CPU)
        self.other = nn.Parameter(torch.randn(4, 8, generator=g).to(here),
                                  requires_grad=False)
        self.a = nn.Parameter(torch.randn(4, 8, generator=g).to(here, dtype),
                              requires_grad=False)
        self.f = f

    def load_weights(self, weights):
        w = dict(weights)
        names = set()
        if "other.w" in w:
            self.other.data.copy_(w["other.w"])
            names.add("other.w")
        if "a.w" in w:
            self.a.data.copy_(self.f(w))
            names.add("a.w")
        return names

    def snapshot(self):
        return {n: bits(p.detach()).clone() for n, p in self.named_parameters()}


def _patches(full=False):
    """Patch 0 ('other.w') and patch 1 ('a.w'), sparse (``full``: every element of
    'a.w' sent, a dense update as a sparse patch, which holds no NaN)."""
    a_idx = torch.arange(32) if full else torch.tensor([1, 9, 20, 30])
    a_val = torch.linspace(-2.0, 2.0, a_idx.numel())
    return [CWP("other.w", (4, 8), torch.float32, torch.tensor([0.5, -0.75]),
                torch.tensor([3, 17])),
            CWP("a.w", (4, 8), torch.float32, a_val, a_idx)]


def _load(how, model, patches):
    if how == "plain":
        return patchkit.load_checkpoint_weight_patches(model, patches)
    if how == "transactional":
        return patchkit.load_checkpoint_weight_patches(model, patches, transactional=True)
    return patchkit.inspect_load(model, patches)


def _scratch_copy(w):
    buf = torch.empty(4, 8)
    buf.copy_(w["a.w"] @ _h(w["a.w"]))  # (mixed into the loader's own tensor: let through)
    buf.mul_(1.0)
    return buf  # (the write into the model, a later op, is refused)


def _scratch_cumsum_in_place(w):
    buf = torch.empty(4, 8)
    buf.copy_(w["a.w"])
    buf.cumsum_(1)
    return buf


def _scratch_mm_out(w):
    buf = torch.zeros(4, 8)
    torch.mm(w["a.w"], _h(w["a.w"]), out=buf)
    return buf


def _block_quantiser(w):
    # float8 with one absmax scale per block of 4 (as fp8 and bitsandbytes-style
    # quantisers take): the scale of every block that holds a staged NaN is NaN
    blocks = w["a.w"].reshape(-1, 4)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 448.0
    return (blocks / scale).to(_FP8).reshape(4, 8)


def _rows(a, *rows):
    return torch.tensor(rows, device=a.device)


def _index_put_accumulating_at_a_repeated_row(w):
    # rows 0 and 1 of the update summed into row 0, rows 2 and 3 into row 1
    a = w["a.w"]
    buf = torch.zeros(4, 8, device=a.device)
    buf.index_put_((_rows(a, 0, 0, 1, 1),), a, accumulate=True)
    return buf


def _index_add_at_a_repeated_row(w):
    a = w["a.w"]
    return torch.zeros(4, 8, device=a.device).index_add_(0, _rows(a, 3, 2, 3, 0), a)


def _scatter_add_at_a_repeated_column(w):
    a = w["a.w"]
    idx = (torch.arange(8, device=a.device) // 2).expand(4, 8)  # (columns 2k, 2k+1 -> k)
    return torch.zeros(4, 8, device=a.device).scatter_add_(1, idx, a)


def _put_accumulating_at_a_repeated_place(w):
    a = w["a.w"]
    buf = torch.zeros(32, device=a.device)
    buf.put_(torch.arange(32, device=a.device) % 16, a.reshape(-1), accumulate=True)
    return buf.reshape(4, 8)


def _mixed_scratch_first_and_last_rows_zeroed(w):
    buf = w["a.w"] @ _h(w["a.w"])
    buf[::3].zero_()  # (a strided fill: rows 1 and 2, between, still hold mixed data)
    return buf


def _rotation_then_cumsum(w):
    return (w["a.w"] @ _h(w["a.w"])).cumsum(1)  # (the first op that mixed is named)


def _nan_aware(w):
    a = w["a.w"]
    return (a - a.nanmean()) / a.nansum().abs().clamp(min=1.0) + a.nanmedian() * 0.0


# (the schema is written out: torch 2.4 infers none from the string annotations that
# ``from __future__ import annotations`` makes; later torch evaluates them)
@torch.library.custom_op("patchkit_tests::rotate", mutates_args=(),
                         schema="(Tensor w, Tensor h) -> Tensor")
def _rotate(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """An op of a library's own (a kernel's repacking, say): what it does is not known."""
    return w @ h


# name -> (f, op named, runtime dtype of a.w)
_MIXING = {
    "rotation": (lambda w: w["a.w"] @ _h(w["a.w"]), "aten::mm", torch.float32),
    "amax scale": (lambda w: w["a.w"] / w["a.w"].abs().amax(), "aten::amax", torch.float32),
    "sort values": (lambda w: w["a.w"].sort(dim=1).values, "aten::sort", torch.float32),
    "cumsum": (lambda w: w["a.w"].cumsum(1), "aten::cumsum", torch.float32),
    "softmax": (lambda w: w["a.w"].softmax(-1), "aten::_softmax", torch.float32),
    "block absmax quantiser": (_block_quantiser, "aten::amax", _FP8),
    "mixed scalar broadcast": (lambda w: w["a.w"] * w["a.w"].mean(), "aten::mean",
                               torch.float32),
    "through a scratch copy_": (_scratch_copy, "aten::mm", torch.float32),
    "cumsum_ in a scratch": (_scratch_cumsum_in_place, "aten::cumsum_", torch.float32),
    "mm into a scratch (out=)": (_scratch_mm_out, "aten::mm.out", torch.float32),
    "index_put_ accumulating at a repeated row": (_index_put_accumulating_at_a_repeated_row,
                                                  "aten::index_put_", torch.float32),
    "index_add_ at a repeated row": (_index_add_at_a_repeated_row, "aten::index_add_",
                                     torch.float32),
    "scatter_add_ at a repeated column": (_scatter_add_at_a_repeated_column,
                                          "aten::scatter_add_", torch.float32),
    "put_ accumulating at a repeated place": (_put_accumulating_at_a_repeated_place,
                                              "aten::put_", torch.float32),
    "mixed scratch, first and last rows zeroed": (_mixed_scratch_first_and_last_rows_zeroed,
                                                  "aten::mm", torch.float32),
    "rotation then cumsum": (_rotation_then_cumsum, "aten::mm", torch.float32),
    "an op of a library's own": (lambda w: _rotate(w["a.w"], _h(w["a.w"])),
                                 "patchkit_tests::rotate", torch.float32),
    # (NaN-aware: a sum or mean of the updates only, a number where the patch keeps some
    # elements, written into every element; was let through, a silent loss)
    "NaN-aware reductions": (_nan_aware, "aten::nansum", torch.float32),
}


def _diff_of_columns(w):
    a = w["a.w"]
    return torch.cat([a[:, :1], a[:, 1:] - a[:, :-1]], 1)  # (torch.diff's own ops)


def _python_sum_of_rows(w):
    a = w["a.w"]
    return sum(a[i] for i in range(4)).expand(4, 8)


def _sub_in_place_of_row_0(w):
    buf = w["a.w"].clone()
    return buf.sub_(w["a.w"][0])  # (in place, into a copy of the update)


def _other_added_onto_a_copy_of_a(w):
    buf = w["a.w"].clone()
    return buf.add_(w["other.w"])


def _sub_out_of_a_flip(w):
    a = w["a.w"]
    buf = torch.empty(4, 8, device=a.device)
    return torch.sub(a, a.flip(0), out=buf)


# Element-wise arithmetic between *different* elements of patches' data: each element of
# the result combines two elements, so a NaN ("keep") in either makes it NaN and numbers
# land at other elements. name -> (f, op named, runtime dtype of a.w)
_PAIRING = {
    "w[:, 1:] - w[:, :-1]": (_diff_of_columns, "aten::sub.Tensor", torch.float32),
    "torch.diff": (lambda w: torch.cat([w["a.w"][:, :1], torch.diff(w["a.w"], dim=1)], 1),
                   "aten::sub.Tensor", torch.float32),
    "w - w[0]": (lambda w: w["a.w"] - w["a.w"][0], "aten::sub.Tensor", torch.float32),
    "outer of a column and a row": (lambda w: torch.outer(w["a.w"][:, 0], w["a.w"][0]),
                                    "aten::mul.Tensor", torch.float32),
    "w + w.flip(0)": (lambda w: w["a.w"] + w["a.w"].flip(0), "aten::add.Tensor",
                      torch.float32),
    "a Python sum of rows": (_python_sum_of_rows, "aten::add.Tensor", torch.float32),
    "w * w.roll(1, 0)": (lambda w: w["a.w"] * w["a.w"].roll(1, 0), "aten::mul.Tensor",
                         torch.float32),
    "even plus odd columns": (
        lambda w: (w["a.w"][:, ::2] + w["a.w"][:, 1::2]).repeat(1, 2), "aten::add.Tensor",
        torch.float32),
    "two patches multiplied": (lambda w: w["a.w"] * w["other.w"], "aten::mul.Tensor",
                               torch.float32),
    "sub_ of row 0, in place": (_sub_in_place_of_row_0, "aten::sub_.Tensor", torch.float32),
    "other.w added onto a copy of a.w, in place": (_other_added_onto_a_copy_of_a,
                                                   "aten::add_.Tensor", torch.float32),
    "sub of a flip, out=": (_sub_out_of_a_flip, "aten::sub.out", torch.float32),
    "sub of a flip, out= a tensor of another shape (resized)": (
        lambda w: torch.sub(w["a.w"], w["a.w"].flip(0),
                            out=torch.empty(3, device=w["a.w"].device)),
        "aten::sub.out", torch.float32),
    "floor_divide of w and w.flip(0) (not tagged pointwise)": (
        lambda w: torch.floor_divide(w["a.w"], w["a.w"].flip(0)), "aten::floor_divide",
        torch.float32),
    "heaviside_ of a copy by w.flip(0), in place (tagged only in its functional form)": (
        lambda w: w["a.w"].clone().heaviside_(w["a.w"].flip(0)), "aten::heaviside_",
        torch.float32),
    "fmax of w and w.flip(1) (NaN-aware)": (
        lambda w: torch.fmax(w["a.w"], w["a.w"].flip(1)), "aten::fmax", torch.float32),
}


def _foreach_add_in_place_of_a_flip(w):
    a = w["a.w"]
    buf = a.clone()
    torch._foreach_add_([buf], [a.flip(0)])
    return buf


def _foreach_add_at_the_second_place(w):
    # (other.w with itself at place 0, a.w with its flip at place 1)
    a, o = w["a.w"], w["other.w"]
    return torch._foreach_add([o, a], [o, a.flip(0)])[1]


# A _foreach_ op pairs the tensors at each place of its lists as the op it names does
# (these loaded without a word: the check saw no pairing inside a list op).
_FOREACH_PAIRING = {
    "_foreach_add of [w] and [w.flip(0)]": (
        lambda w: torch._foreach_add([w["a.w"]], [w["a.w"].flip(0)])[0],
        "aten::_foreach_add.List", torch.float32),
    "_foreach_mul of [w] and [w.roll(1, 0)]": (
        lambda w: torch._foreach_mul([w["a.w"]], [w["a.w"].roll(1, 0)])[0],
        "aten::_foreach_mul.List", torch.float32),
    "_foreach_add_ of w.flip(0) into a copy of w, in place": (
        _foreach_add_in_place_of_a_flip, "aten::_foreach_add_.List", torch.float32),
    "_foreach_lerp of [w] towards [w.flip(0)]": (
        lambda w: torch._foreach_lerp([w["a.w"]], [w["a.w"].flip(0)], 0.5)[0],
        "aten::_foreach_lerp.Scalar", torch.float32),
    "_foreach_mul of [w] by an element of w (a tensor not in a list)": (
        lambda w: torch._foreach_mul([w["a.w"]], w["a.w"][0, 0])[0],
        "aten::_foreach_mul.Tensor", torch.float32),
    "_foreach_pow of [w] by [w.flip(1)]": (
        lambda w: torch._foreach_pow([w["a.w"]], [w["a.w"].flip(1)])[0],
        "aten::_foreach_pow.List", torch.float32),
    "_foreach_add of two places, the second a pairing": (
        _foreach_add_at_the_second_place, "aten::_foreach_add.List", torch.float32),
}

_REFUSED = {**_MIXING, **_PAIRING, **_FOREACH_PAIRING}


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_loader_that_mixes_a_sparse_patchs_elements_is_refused_before_it_writes(case, how):
    f, op, dtype = _REFUSED[case]
    m = _Mixing(f, dtype)
    before = m.snapshot()
    with pytest.raises(ContractViolation) as e:
        _load(how, m, _patches())
    err = e.value
    assert isinstance(err, NotImplementedError)
    assert (err.position, err.name, err.reason, err.value) == (1, "a.w", "mixed elements", op)
    text = str(err)
    assert "patch 1 ('a.w')" in text and op in text and "send this weight dense" in text
    assert "wrote nothing" in text
    after = m.snapshot()
    # the refused copy wrote nothing ...
    assert torch.equal(after["a"], before["a"])
    if how == "transactional":
        assert all(torch.equal(after[n], before[n]) for n in before)  # ... and rolled back
    else:
        assert not torch.equal(after["other"], before["other"])  # (written before it)
    if how == "inspect":
        assert err.report is not None


def test_the_patch_named_is_the_one_whose_data_was_mixed():
    # a.w scaled by a statistic of patch 0's data (which holds NaN): patch 0's NaN
    # spread into a.w's update
    m = _Mixing(lambda w: w["a.w"] / w["other.w"].abs().amax())
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, _patches())
    assert (e.value.position, e.value.name, e.value.value) == (0, "other.w", "aten::amax")


@pytest.mark.parametrize("how", [
    pytest.param(lambda a, b: a * b, id="a * b"),
    # (the whole patch's data at a place not known: made by a pointwise op or a move, as
    # a reciprocal of a scale is; it holds no NaN, so no NaN mask shows the pairing, and
    # these loaded, the whole patch's update lost where the other keeps)
    pytest.param(lambda a, b: a * b.abs(), id="a * b.abs()"),
    pytest.param(lambda a, b: a * (b * 1.0), id="a * (b * 1.0)"),
    pytest.param(lambda a, b: a * b.reciprocal(), id="a * b.reciprocal()"),
    pytest.param(lambda a, b: a * b.flip(0), id="a * b.flip(0)"),
    pytest.param(lambda a, b: a.abs() * b.t().contiguous().t(), id="a.abs() * b, copied"),
])
@pytest.mark.parametrize("full", ["a.w", "other.w"])
def test_pairing_a_sparse_patch_with_a_fully_sent_one_is_refused(full, how):
    # One of the two patches sent whole (a sparse patch of every element: no NaN), the
    # other with NaN: where the latter keeps, the product is NaN, so the merge keeps the
    # runtime value and the whole one's update of that element is lost. The patch named
    # is the one whose NaN did it.
    g = torch.Generator().manual_seed(5)
    patches = []
    for name in ("other.w", "a.w"):
        idx = torch.arange(32) if name == full else torch.tensor([2, 11, 25])
        patches.append(CWP(name, (4, 8), torch.float32, torch.randn(idx.numel(), generator=g),
                           idx))
    m = _Mixing(lambda w: how(w["a.w"], w["other.w"]))
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, patches)
    sparse = "a.w" if full == "other.w" else "other.w"
    assert (e.value.reason, e.value.name, e.value.value) == ("mixed elements", sparse,
                                                             "aten::mul.Tensor")


def test_pairing_a_fully_updated_row_of_a_sparse_patch_with_another_patchs_nan_is_refused():
    # other.w is sparse, but its row 0 is all updated (no NaN there): a.w * other.w[0]
    # pairs those numbers with a.w's NaN, so other.w's row-0 update would be lost
    # wherever a.w keeps (its place is known: a view of the staged tensor)
    patches = [CWP("other.w", (4, 8), torch.float32, torch.linspace(1.0, 2.0, 8),
                   torch.arange(8)), _patches()[1]]
    m = _Mixing(lambda w: w["a.w"] * w["other.w"][0])
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, patches)
    assert (e.value.reason, e.value.name, e.value.value) == ("mixed elements", "a.w",
                                                             "aten::mul.Tensor")


def test_an_observed_loader_pairing_a_dense_patch_with_a_sparse_one_is_reported():
    # other.w sent dense (no NaN), its data at a place not known (abs) times a.w's NaN:
    # other.w's update is lost wherever a.w keeps
    patches = [CWP("other.w", (4, 8), torch.float32, torch.linspace(1.0, 2.0, 32)),
               _patches()[1]]
    m = _Mixing(lambda w: w["a.w"] * w["other.w"].abs())
    with pytest.raises(ContractViolation) as e:
        patchkit.inspect_load(m, patches, loader=_merging_loader)
    assert (e.value.reason, e.value.name, e.value.value) == ("mixed elements", "a.w",
                                                             "aten::mul.Tensor")


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
def test_pairing_two_patches_that_keep_the_same_elements_is_not_refused(how):
    # a.w + other.w, both updating elements 1, 9, 20 and 30: where both keep, the runtime
    # value (the sum of the two kept) stays right; where both update, the new sum lands.
    # (Refused at first, as any pairing of two patches' data.)
    idx = torch.tensor([1, 9, 20, 30])
    patches = [CWP("other.w", (4, 8), torch.float32, torch.tensor([0.5, -0.75, 0.25, 1.0]), idx),
               CWP("a.w", (4, 8), torch.float32, torch.linspace(-2.0, 2.0, 4), idx)]
    m = _Mixing(lambda w: w["a.w"] + w["other.w"])
    want = bits(_merged(m.f, m, patches)).clone()
    _load(how, m, patches)
    assert torch.equal(bits(m.a.detach()), want)
    assert not torch.equal(want, bits(_Mixing(None).a.detach()))  # (the patch landed)
    # one element apart, they keep different elements: refused
    shifted = [patches[0]._replace(indices=torch.tensor([1, 9, 20, 31])), patches[1]]
    with pytest.raises(ContractViolation) as e:
        _load(how, _Mixing(m.f), shifted)
    assert (e.value.reason, e.value.value) == ("mixed elements", "aten::add.Tensor")


def test_pairing_two_fully_sent_patches_is_not_refused():
    # no NaN in either: the product is numbers only, written whole
    g = torch.Generator().manual_seed(6)
    patches = [CWP(n, (4, 8), torch.float32, torch.randn(32, generator=g), torch.arange(32))
               for n in ("other.w", "a.w")]
    f = _REFUSED["two patches multiplied"][0]
    m = _Mixing(f)
    staged = {p.name: patchkit.stage(p) for p in patches}
    want = bits(f(staged)).cpu()
    patchkit.load_checkpoint_weight_patches(m, patches)
    assert torch.equal(bits(m.a.detach()).cpu(), want)


def _merged(f, model, patches):
    """What the NaN-merge of ``f``'s source into ``a.w`` gives: the runtime value where
    the source is NaN, the source elsewhere (a reference computed without any load)."""
    staged = {p.name: patchkit.stage(p) for p in patches}
    src = f(staged).to(model.a.dtype)
    return torch.where(src.float().isnan(), model.a.detach(), src)


def _checked_then_plain(w):
    assert bool(w["a.w"].isnan().any())  # (a loader that checks for NaN: bool results)
    return w["a.w"]


def _argsort_round_trip(w):
    a = w["a.w"]
    perm = torch.argsort(a, dim=1)  # (int64: index tensors are never mixed)
    inv = torch.argsort(perm, dim=1)
    return a.gather(1, perm).gather(1, inv)


def _statistic_never_written(w):
    print("mean of the update:", w["a.w"].mean(), (w["a.w"] @ _h(w["a.w"])).abs().amax())
    return w["a.w"]


def _scale_after_nan_to_num(w):
    return w["a.w"] / w["a.w"].nan_to_num().abs().amax()


def _views_and_copies(w):
    a = w["a.w"]
    b = a.reshape(8, 4).t().contiguous().t().reshape(4, 8)  # (a transposed copy)
    c = b.permute(1, 0).contiguous().permute(1, 0)
    d = c.t().reshape(-1).reshape(8, 4).t()  # (reshape of a transposed view: a clone)
    buf = torch.empty(8, 4)
    buf.copy_(d.t())  # (a transposed copy into a scratch)
    return buf.t().to(torch.float64).to(torch.float32)


def _where_keeps_old(self_a):
    return lambda w: torch.where(w["a.w"].isnan(), self_a.detach(), w["a.w"])


def _mixed_scratch_overwritten(w):
    buf = w["a.w"] @ _h(w["a.w"])  # (mixed, then overwritten whole by a plain copy)
    buf.copy_(w["a.w"])
    return buf


def _mixed_scratch_filled_then_added(w):
    buf = torch.empty(4, 8, device=w["a.w"].device)
    torch.mm(w["a.w"], _h(w["a.w"]), out=buf)  # (mixed, then filled anew)
    buf.zero_().add_(w["a.w"])
    return buf


def _nan_mask_of_mixed_data(w):
    lost = (w["a.w"] @ _h(w["a.w"])).isnan()  # (bool: never mixed)
    return torch.where(lost & ~lost, w["a.w"] * 2.0, w["a.w"])


def _element_wise_untagged(w):
    # element-wise ops some of whose overloads torch does not tag pointwise
    a = w["a.w"]
    z = torch.complex(a, torch.zeros_like(a))
    return torch.where(a < 0, a.abs().neg(), torch.fmod(z.real, 1e6))


def _adds_at_distinct_rows(w):
    # puts that add into (or reduce with) what is there, no index repeated: each element
    # of the result is one element of the update (with the scratch's own), as an add is
    a = w["a.w"]
    perm = _rows(a, 2, 0, 3, 1)  # (row i of the update to row perm[i])
    added = torch.zeros(4, 8, device=a.device).index_add_(0, perm, a)
    reduced = torch.zeros(4, 8, device=a.device).index_reduce_(
        0, perm, a, "amax", include_self=False)
    return ((added + reduced) / 2.0)[perm]


def _scatters_at_distinct_columns(w):
    a = w["a.w"]
    idx = torch.arange(8, device=a.device).flip(0).expand(4, 8)
    summed = torch.zeros(4, 8, device=a.device).scatter_add_(1, idx, a)
    big = torch.full((4, 8), -1e30, device=a.device).scatter_reduce(1, idx, a, "amax")
    return (summed + big.scatter(1, idx, a, reduce="add") * 0.0).flip(1)


def _accumulating_puts_at_distinct_places(w):
    a = w["a.w"]
    places = torch.arange(32, device=a.device)
    moved = torch.zeros(32, device=a.device).put_(places, a.reshape(-1))  # (no accumulate)
    added = torch.zeros(32, device=a.device)
    added.put_(places.flip(0), a.reshape(-1), accumulate=True)
    flat = (moved + added.flip(0)) / 2.0  # (each element: one of the update's, twice)
    buf = torch.zeros(4, 8, device=a.device)
    buf.index_put_((_rows(a, 1, 0, 3, 2),), flat.reshape(4, 8), accumulate=True)
    return buf[_rows(a, 1, 0, 3, 2)]


def _reduced_over_a_dim_of_one(w):
    # a stack of the one shard there is, summed (a tensor-parallel merge at tp 1), and a
    # mean over a dim of size 1: each element of the result is one element of the update
    a = w["a.w"]
    return torch.stack([a]).sum(0) + a.reshape(4, 1, 8).mean(1, keepdim=False) * 0.0


def _fused_weight_moves(w):
    # a fused q/k/v weight split, k replicated for grouped-query attention and cut back,
    # gate/up chunks put back, a pad cut off, a relu-like where with a scalar
    a = w["a.w"]
    q, k, v = a.split([2, 1, 1], 0)
    k = k.repeat_interleave(2, dim=0)[:1]
    gate, up = q.chunk(2, 1)
    fused = torch.cat([torch.cat([gate, up], 1), torch.stack([k[0], v[0]])], 0)
    padded = F.pad(fused, (0, 2))[:, :8]
    return torch.where(padded > 0, padded, 0.0) + torch.where(padded > 0, 0.0, padded)


def _in_place_pointwise_on_a_scratch(w):
    a = w["a.w"]
    buf = torch.empty(4, 8, device=a.device)
    buf.copy_(a)
    return buf.mul_(-1.0).abs_().mul_(a.sign())  # (abs_: torch tags only abs pointwise)


def _nan_mask_of_mixed_data_as_float(w):
    lost = (w["a.w"] @ _h(w["a.w"])).isnan().float()  # (0 or 1: none of the patch's numbers)
    return w["a.w"] + lost * 0.0


def _one_row_put_twice(w):
    # a put (no accumulate) at a repeated row, of the same values: the row is moved
    a = w["a.w"]
    rows = _rows(a, 0, 1, 1, 2, 3)
    buf = torch.zeros(4, 8, device=a.device)
    buf[rows] = a[rows]
    return buf


def _mm_out_over_a_copy_of_the_update(w):
    # a mixing op whose out= is a scratch that held the update: it reads none of it
    a = w["a.w"]
    buf = a.clone()
    torch.mm(torch.eye(4, device=a.device), torch.zeros(4, 8, device=a.device), out=buf)
    return buf + a


def _where_picks_w_or_its_flip(w):
    # each element taken from one place of the update, as a mask picks: a move, no pair
    a = w["a.w"]
    pick = (torch.arange(8, device=a.device) % 2 == 0).expand(4, 8)
    return torch.where(pick, a, a.flip(1))


def _where_with_the_models_tensor(self_a):
    return lambda w: torch.where(self_a.detach() > 0, w["a.w"], self_a.detach()) * 1.5


def _scaled_by_a_tensor_of_the_loaders(w):
    scale = torch.linspace(0.5, 2.0, 8, device=w["a.w"].device)  # (not a patch's data)
    return w["a.w"] * scale * 2.0


def _each_patch_on_its_own(w):
    # both patches' data in the same ops, each with its own elements only (patch 0's is
    # computed and dropped; the model writes it as sent)
    print("other.w squared:", w["other.w"] * w["other.w"].clone())
    return w["a.w"] * 2.0 - 1.0


def _product_with_its_own_pointwise_results(w):
    a = w["a.w"]
    return a.sign() * a.abs().sqrt() * a.abs().sqrt() + a * 0.0  # (the same elements)


def _same_strided_view_twice(w):
    a = w["a.w"]
    even = a[:, ::2] * a[:, ::2] + a[:, ::2]  # (two views of the same elements)
    return torch.cat([even, a[:, 1::2]], 1)


def _in_place_product_with_a_copy(w):
    a = w["a.w"]
    buf = a.clone()
    return buf.mul_(a).add_(a.float()).sub_(a.clone())  # (the same elements throughout)


def _scratch_of_other_zeroed_by_foreach_then_added(w):
    # a scratch reused: it held other.w's data, then a _foreach_zero_ fills it anew (as
    # zero_ does), so the add_ of a.w pairs a.w with zeros, no patch's data (was refused
    # as other.w's numbers paired with a.w's NaN)
    buf = w["other.w"].clone()
    torch._foreach_zero_([buf])
    return buf.add_(w["a.w"])


def _foreach_add_in_place_of_each_own(w):
    # each scratch, a copy of its patch's data, added to by that data: the same elements
    a, o = w["a.w"], w["other.w"]
    bufs = [o.clone(), a.clone()]
    torch._foreach_add_(bufs, [o, a])
    return bufs[1]


def _foreach_copied_then_added_to_its_source(w):
    a, o = w["a.w"], w["other.w"]
    bufs = [torch.empty(4, 8, device=a.device), torch.empty(4, 8, device=a.device)]
    torch._foreach_copy_(bufs, [o, a])
    return bufs[1] + a


_NOT_MIXING = {
    "w * w": lambda w: w["a.w"] * w["a.w"],
    "masked_fill with a 0-d element of w (a pick)": (
        lambda w: w["a.w"].masked_fill(torch.arange(8, device=w["a.w"].device) < 2,
                                       w["a.w"][0, 1])),
    "_foreach_mul of [w, other.w] by itself (each with its own elements)": (
        lambda w: torch._foreach_mul([w["a.w"], w["other.w"]], [w["a.w"], w["other.w"]])[0]),
    "_foreach_mul of [w] by 2.0": lambda w: torch._foreach_mul([w["a.w"]], 2.0)[0],
    "_foreach_add of [w] and [w]": lambda w: torch._foreach_add([w["a.w"]], [w["a.w"]])[0],
    "_foreach_add_ of each patch into a copy of it, in place": (
        _foreach_add_in_place_of_each_own),
    "_foreach_copy_ into scratches, then one added to its source": (
        _foreach_copied_then_added_to_its_source),
    # (was refused as 'mixed elements': _foreach_pow.List names pow.Tensor_Tensor)
    "_foreach_pow of [w.abs()] by [w]": (
        lambda w: torch._foreach_pow([w["a.w"].abs()], [w["a.w"]])[0]),
    "one row, broadcast, plus that row expanded": (
        lambda w: w["a.w"][:1] + w["a.w"][0].expand(4, -1)),
    "a scratch of other.w, _foreach_zero_, then a.w added": (
        _scratch_of_other_zeroed_by_foreach_then_added),
    "gelu_backward into grad_input= (an out= op not named so)": (
        lambda w: torch.ops.aten.gelu_backward.grad_input(
            w["a.w"], w["a.w"], grad_input=torch.empty(4, 8, device=w["a.w"].device))),
    "w + w.clone()": lambda w: w["a.w"] + w["a.w"].clone(),
    "w * 2 and w * a loader's tensor": _scaled_by_a_tensor_of_the_loaders,
    "where(model's mask, w, model's tensor)": "where with the model's tensor",
    "where picking w or w.flip(1)": _where_picks_w_or_its_flip,
    "one row expanded": lambda w: w["a.w"][0].expand(4, -1),
    "one row repeated, plus that row": (
        lambda w: w["a.w"][:1].repeat(4, 1) + w["a.w"][0]),
    "each patch computed on its own": _each_patch_on_its_own,
    "products with its own pointwise results": _product_with_its_own_pointwise_results,
    "the same strided view twice": _same_strided_view_twice,
    "in place, with copies of the same elements": _in_place_product_with_a_copy,
    "isnan().any() check": _checked_then_plain,
    "argsort indices": _argsort_round_trip,
    "statistic never written": _statistic_never_written,
    "nan_to_num then amax": _scale_after_nan_to_num,
    "views, reshape, permute, contiguous, transposed copies": _views_and_copies,
    "where(isnan, old, w)": "where",
    "mixed scratch overwritten by a plain copy": _mixed_scratch_overwritten,
    "mixed scratch zeroed, then added to": _mixed_scratch_filled_then_added,
    "NaN mask of mixed data": _nan_mask_of_mixed_data,
    "element-wise ops without torch's pointwise tag": _element_wise_untagged,
    "index_add_ and index_reduce_ at distinct rows": _adds_at_distinct_rows,
    "scatter_add_, scatter_reduce at distinct columns": _scatters_at_distinct_columns,
    "put_ and index_put_ accumulating at distinct places": _accumulating_puts_at_distinct_places,
    "a reduction over a dim of size 1": _reduced_over_a_dim_of_one,
    "fused weight: split, chunk, cat, stack, repeat_interleave, pad, where": (
        _fused_weight_moves),
    "in-place pointwise ops on a scratch (abs_)": _in_place_pointwise_on_a_scratch,
    "NaN mask of mixed data, as float": _nan_mask_of_mixed_data_as_float,
    "a put (no accumulate) of one row twice": _one_row_put_twice,
    "mm out= a scratch that held the update": _mm_out_over_a_copy_of_the_update,
}


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("case", list(_NOT_MIXING))
def test_a_loader_that_does_not_mix_loads_as_before(case, how, capsys):
    m = _Mixing(None)
    f = _NOT_MIXING[case]
    m.f = (_where_keeps_old(m.a) if f == "where"
           else _where_with_the_models_tensor(m.a) if f == "where with the model's tensor"
           else f)
    patches = _patches()
    want = bits(_merged(m.f, m, patches)).clone()
    ref = _Mixing(lambda w: w["a.w"])  # (the same patch loaded plainly: 'other.w')
    patchkit.load_checkpoint_weight_patches(ref, patches)
    _load(how, m, patches)
    assert torch.equal(bits(m.a.detach()), want)
    assert torch.equal(bits(m.other.detach()), bits(ref.other.detach()))
    assert not torch.equal(want, bits(_Mixing(None).a.detach()))  # (the patch landed)


@pytest.mark.parametrize("case", ["rotation", "amax scale", "sort values", "cumsum",
                                  "softmax", "through a scratch copy_", "w - w[0]",
                                  "w + w.flip(0)", "sub_ of row 0, in place"])
def test_a_sparse_patch_without_nan_is_not_refused(case):
    # every element of a.w sent as a sparse patch: no NaN to spread, so the mixing op's
    # result is a plain copy of numbers, written whole
    f, _, dtype = _REFUSED[case]
    m = _Mixing(f, dtype)
    patches = _patches(full=True)
    staged = {p.name: patchkit.stage(p) for p in patches}
    want = bits(f(staged)).cpu()
    patchkit.load_checkpoint_weight_patches(m, patches)
    assert torch.equal(bits(m.a.detach()).cpu(), want)


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_dense_call_through_a_mixing_loader_is_untouched(case):
    # a dense patch has no NaN marks: the loader's result is written as it is
    f, _, dtype = _REFUSED[case]
    m = _Mixing(f, dtype)
    g = torch.Generator().manual_seed(3)
    values = torch.randn(32, generator=g).to(torch.get_default_device())
    other = torch.randn(32, generator=g).to(torch.get_default_device())
    patches = [CWP("other.w", (4, 8), torch.float32, other, None),
               CWP("a.w", (4, 8), torch.float32, values, None)]
    want = bits(f({p.name: p.values.reshape(4, 8) for p in patches})).cpu()
    patchkit.load_checkpoint_weight_patches(m, patches)
    assert torch.equal(bits(m.a.detach()).cpu(), want)


def _merging_loader(model, patches, **kwargs):
    """An observed loader written for these tests, as vLLM 0.33 merges: it stages each
    sparse patch NaN-masked (a dense one whole, as an engine's own loader may), one call
    for all, and has ``torch.Tensor.copy_`` replaced by a NaN-merging copy while the
    call runs."""
    patches = list(patches)
    staged = []
    for p in patches:
        if p.indices is None:
            t = p.values.to(p.dtype).reshape(p.shape).clone()
        else:
            t = torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.values.device)
            t.view(-1)[p.indices.long()] = p.values.to(p.dtype)
        staged.append((p.name, t))
    original = torch.Tensor.copy_

    def merging_copy(dst, src, non_blocking=False):
        src = src.to(dst.dtype)
        return original(dst, torch.where(torch.isnan(src), dst, src), non_blocking)

    torch.Tensor.copy_ = merging_copy
    try:
        return set(model.load_weights(staged) or ())
    finally:
        torch.Tensor.copy_ = original


@pytest.mark.parametrize("case", ["rotation", "amax scale", "sort values", "w - w[0]",
                                  "w + w.flip(0)", "two patches multiplied",
                                  "_foreach_add of [w] and [w.flip(0)]",
                                  # (in place into a scratch: not seen when observed at
                                  # first; a cumsum_ of a scratch copied into is not here,
                                  # since this loader's copy_ merges into the scratch too)
                                  "mm into a scratch (out=)",
                                  "sub_ of row 0, in place",
                                  "_foreach_add_ of w.flip(0) into a copy of w, in place"])
def test_an_observed_loader_that_merges_mixed_data_is_reported(case):
    # What vLLM does with such a loader: it merges what the mixing op made, keeping
    # elements the patch updates, without a word. Observed (``loader=``), the load runs as
    # the loader runs it, and the report raises when it finishes, naming the patch and op.
    f, op, _ = _REFUSED[case]
    m = _Mixing(f)
    with pytest.raises(ContractViolation) as e:
        patchkit.inspect_load(m, _patches(), loader=_merging_loader)
    assert (e.value.reason, e.value.position, e.value.name) == ("mixed elements", 1, "a.w")
    assert e.value.value == op
    assert "observed loader's NaN-merge" in str(e.value)
    assert e.value.report.loaded == {"other.w", "a.w"}  # (it ran to the end)


@pytest.mark.parametrize("case", ["isnan().any() check", "argsort indices",
                                  "w * w", "one row expanded",
                                  "products with its own pointwise results"])
def test_an_observed_loader_that_does_not_mix_is_not_reported(case):
    m = _Mixing(_NOT_MIXING[case])
    patches = _patches()
    want = bits(_merged(m.f, m, patches)).clone()
    r = patchkit.inspect_load(m, patches, loader=_merging_loader)
    assert r.error is None
    assert torch.equal(bits(m.a.detach()), want)


# name -> (the loader's source, the dtype it reads the patch's bytes as, the reason
# patchkit's own sparse call refuses it for: an integer source is no same-shaped
# floating-point copy at all)
_REINTERPRETING = {
    "int32 view, cast": (lambda w: w["a.w"].view(torch.int32).float(), torch.int32,
                         "reinterpreted source"),
    "int32 view, copied as it is": (lambda w: w["a.w"].view(torch.int32), torch.int32,
                                    "same-shaped floating-point"),
    "bytes moved by one": (
        lambda w: torch.cat([w["a.w"].reshape(-1).view(torch.uint8)[1:-3].clone()
                             .view(torch.float32), w["a.w"].reshape(-1)[:1]]).reshape(4, 8),
        torch.float32, "reinterpreted source"),
}


@pytest.mark.parametrize("case", list(_REINTERPRETING))
def test_an_observed_loader_that_merges_a_reinterpreted_source_is_reported(case):
    # The staged NaN read as other numbers (2143289344.0, the bits of a float32 NaN as an
    # int32): the observed loader's merge writes them into the model where the patch
    # keeps. patchkit's own sparse call refuses such a copy ("reinterpreted source");
    # observed, it went unreported. Now the report raises when the loader finishes.
    f, read, refused = _REINTERPRETING[case]
    m = _Mixing(f)
    with pytest.raises(ContractViolation) as e:
        patchkit.inspect_load(m, _patches(), loader=_merging_loader)
    assert (e.value.reason, e.value.position, e.value.name) == ("reinterpreted source", 1,
                                                                 "a.w")
    assert e.value.value == (torch.float32, read)
    assert "observed loader's NaN-merge" in str(e.value)
    assert e.value.report.loaded == {"other.w", "a.w"}  # (it ran to the end)
    with pytest.raises(ContractViolation) as own:  # (patchkit's own load: refused)
        patchkit.load_checkpoint_weight_patches(_Mixing(f), _patches())
    assert own.value.reason == refused


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
def test_one_patch_paired_at_two_places_that_keep_alike_loads_right(how):
    # Even and odd columns of a.w, added: the patch updates columns 2 and 3 of row 0 and
    # 4 and 5 of row 2, so each pair keeps or updates both. Where both keep, the runtime
    # value (the sum of the two kept) stays right; where both update, the new sum lands.
    # (Refused at first, as any pairing of one patch at two places.)
    idx = torch.tensor([2, 3, 20, 21])
    patches = [_patches()[0], CWP("a.w", (4, 8), torch.float32, torch.linspace(-2.0, 2.0, 4),
                                  idx)]

    def f(w):
        return torch.cat([w["a.w"][:, ::2] + w["a.w"][:, 1::2]] * 2, 1)

    m = _Mixing(f)
    want = bits(_merged(f, m, patches)).clone()
    _load(how, m, patches)
    assert torch.equal(bits(m.a.detach()), want)
    assert not torch.equal(want, bits(_Mixing(None).a.detach()))  # (the patch landed)
    # one column apart, a pair keeps one and updates the other: refused
    apart = [patches[0], patches[1]._replace(indices=torch.tensor([2, 3, 20, 22]))]
    with pytest.raises(ContractViolation) as e:
        _load(how, _Mixing(f), apart)
    assert (e.value.reason, e.value.name, e.value.value) == ("mixed elements", "a.w",
                                                             "aten::add.Tensor")


def test_rows_of_one_patch_all_updated_paired_with_rows_that_keep_are_refused():
    # rows 2-3 of a.w all sent (no NaN), times rows 0-1 (NaN but at 1 and 9): where rows
    # 0-1 keep, the product is NaN and the merge keeps it, losing rows 2-3's update
    idx = torch.cat([torch.tensor([1, 9]), torch.arange(16, 32)])
    patches = [_patches()[0], CWP("a.w", (4, 8), torch.float32,
                                  torch.linspace(-2.0, 2.0, idx.numel()), idx)]
    m = _Mixing(lambda w: torch.cat([w["a.w"][2:] * w["a.w"][:2]] * 2))
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, patches)
    assert (e.value.reason, e.value.name, e.value.value) == ("mixed elements", "a.w",
                                                             "aten::mul.Tensor")
    assert torch.equal(bits(m.a.detach()), bits(_Mixing(None).a.detach()))


def _flip_minus_its_row_0(w):
    x = w["a.w"].flip(0)
    return x - x[0]


def _roll_minus_its_row_0(w):
    x = w["a.w"].roll(1, 0)
    return x - x[0]


def _outer_of_a_flips_column_and_row(w):
    x = w["a.w"].flip(0)
    return torch.outer(x[:, 0], x[0])


def _refused_with_a_loss(f, patches, how):
    """Load ``patches`` through ``f`` into a model whose ``a.w`` starts as ``f`` of its
    old values (as loaded from the old checkpoint), after checking that the plain
    NaN-merge would lose an update there (it differs from ``f`` of the new values); the
    load must be refused as "mixed elements", naming a.w. Returns the model, the
    ``pytest.raises`` record and a.w's bits before the load."""
    m = _Mixing(f)
    old = {"a.w": m.a.detach().clone(), "other.w": m.other.detach().clone()}
    new = {n: t.clone() for n, t in old.items()}
    for p in patches:
        here = new[p.name].device
        new[p.name].view(-1)[p.indices.to(here)] = p.values.to(here)
    m.a.data.copy_(f(old))
    assert not torch.equal(bits(_merged(f, m, patches)), bits(f(new)))  # (a loss)
    before = bits(m.a.detach()).clone()
    with pytest.raises(ContractViolation) as e:
        _load(how, m, patches)
    assert (e.value.reason, e.value.name) == ("mixed elements", "a.w")
    return m, e, before


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("f", [_flip_minus_its_row_0, _roll_minus_its_row_0,
                               _outer_of_a_flips_column_and_row])
def test_a_fully_updated_row_of_a_moved_patch_paired_with_its_nan_is_refused(f, how):
    # (found by tests/test_mixing_fuzz.py) a.w's row 3 all updated, one element of row 0
    # too: x = a.w.flip(0) (a move: its data's place in a.w is not known) holds no NaN in
    # its row 0, which x - x[0] pairs with the NaN of x's other rows, so row 3's update
    # is lost wherever they keep. It loaded without a word: a NaN-free input at no known
    # place in its patch was let through, though here it is a view of the very tensor
    # whose NaN it is paired with.
    idx = torch.cat([torch.tensor([1]), torch.arange(24, 32)])
    patches = [_patches()[0], CWP("a.w", (4, 8), torch.float32,
                                  torch.linspace(-2.0, 2.0, idx.numel()), idx)]
    m, e, before = _refused_with_a_loss(f, patches, how)
    assert e.value.value in ("aten::sub.Tensor", "aten::mul.Tensor")
    assert torch.equal(bits(m.a.detach()), before)


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("f", [
    pytest.param(lambda w: w["a.w"] * w["other.w"].flip(1)[0], id="a * b.flip(1)[0]"),
    pytest.param(lambda w: w["a.w"] * w["other.w"][[0]], id="a * b[[0]]"),
    pytest.param(lambda w: w["a.w"] - w["other.w"].roll(1, 1).clone()[0],
                 id="a - b.roll(1, 1).clone()[0]"),
    pytest.param(lambda w: w["a.w"] + torch.cat([w["other.w"][:1], w["a.w"]])[0],
                 id="a + cat([b[:1], a])[0]"),
    pytest.param(lambda w: torch.cat([w["a.w"][2:].flip(0) * w["a.w"][:2]] * 2),
                 id="a[2:].flip(0) * a[:2], rows 2-3 of a all updated"),
    # (through an element-wise op that keeps NaN NaN: abs, a scale, a clamp; seeds 275
    # and 546, a * (b * 2.0)[0]; let through at first as any element-wise op's result,
    # which may have made numbers of the NaN: sign, nan_to_num)
    pytest.param(lambda w: w["a.w"] * w["other.w"].abs()[0], id="a * b.abs()[0]"),
    pytest.param(lambda w: w["a.w"] * (w["other.w"] * 2.0)[0], id="a * (b * 2.0)[0]"),
    pytest.param(lambda w: w["a.w"] - w["other.w"].flip(1).abs().clamp(0.0, 1.5)[0],
                 id="a - b.flip(1).abs().clamp(0.0, 1.5)[0]"),
    pytest.param(lambda w: torch.cat([w["a.w"][2:].abs() * w["a.w"][:2]] * 2),
                 id="a[2:].abs() * a[:2], rows 2-3 of a all updated"),
])
def test_a_fully_updated_row_moved_then_paired_with_nan_is_refused(f, how):
    # (found by tests/test_mixing_fuzz.py, seed 1005: a * b.flip(1)[0]) other.w's row 0
    # all updated (and a.w's rows 2-3 for the last case): a move of it (a flip, an index,
    # a cat: data at no known place in its patch) holds no NaN there, and pairing it with
    # a.w's NaN loses that update wherever a.w keeps. It loaded without a word: a NaN-free
    # input at no known place was let through, as a scratch whose NaN the loader replaced
    # is; a move replaces no NaN.
    patches = [CWP("other.w", (4, 8), torch.float32, torch.linspace(1.0, 2.0, 8),
                   torch.arange(8)),
               CWP("a.w", (4, 8), torch.float32, torch.linspace(-2.0, 2.0, 20),
                   torch.cat([torch.tensor([1, 9, 12, 14]), torch.arange(16, 32)]))]
    m, e, before = _refused_with_a_loss(f, patches, how)
    assert e.value.value in ("aten::sub.Tensor", "aten::mul.Tensor", "aten::add.Tensor")
    assert torch.equal(bits(m.a.detach()), before)
