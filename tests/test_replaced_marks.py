"""Sparse loads whose loaders replace the staged NaN ("keep") with a number before the
copy into the model (``w.nan_to_num()``, ``torch.where(w.isnan(), 0.0, w)``,
``w.masked_fill(w.isnan(), 0.0)``, ``fmax``, an index put at the NaN): the copy holds no
NaN, so the NaN-merge writes every element, and the constant lands where the patch keeps.
vLLM writes that without a word; patchkit refuses the copy before it writes
(``ContractViolation``, reason ``"replaced NaN marks"``, naming the patch and the op that
replaced them), and an observed loader's copy is named once it has finished. A loader
that merges on purpose puts the runtime tensor's own values there
(``torch.where(w.isnan(), param, w)``, ``param.masked_scatter(~w.isnan(), ...)``), which
the value compare lets through bit for bit, as it does ops that keep NaN NaN."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_mixing_loaders import CWP, _h, _load, _merged, _merging_loader, _Mixing, _patches

import patchkit
from patchkit import intercept, native
from patchkit.bitwise import bits, device_passes
from patchkit.errors import ContractViolation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import host_waits_of


def _nan_put(w):
    a = w["a.w"]
    a[a.isnan()] = 0.0  # (an index put, in place into the staged tensor)
    return a


def _nan_to_num_in_place(w):
    return w["a.w"].clone().nan_to_num_()


def _masked_fill_in_place(w):
    a = w["a.w"]
    return a.masked_fill_(a.isnan(), 0.0)


def _nan_to_num_out(w):
    buf = torch.empty(4, 8, device=w["a.w"].device)
    return torch.nan_to_num(w["a.w"], out=buf)


def _scratch_copy(w):
    buf = torch.empty(4, 8, device=w["a.w"].device)
    buf.copy_(w["a.w"].nan_to_num())  # (into the loader's own tensor first)
    return buf


def _scratch_columns(w):
    buf = torch.zeros(4, 16, device=w["a.w"].device)
    buf[:, 4:12].copy_(w["a.w"].nan_to_num())  # (not followed element for element)
    return buf[:, 4:12]


def _scratch_transposed(w):
    buf = torch.zeros(8, 4, device=w["a.w"].device)
    buf.t().copy_(w["a.w"].nan_to_num())
    return buf.t()


def _scattered_into_zeros(w):
    a = w["a.w"]
    return torch.zeros_like(a).masked_scatter(~a.isnan(), a[~a.isnan()])


def _low(w):
    return torch.full((4, 8), -1e4, device=w["a.w"].device)


# name -> (the loader's source, the op named)
_REPLACING = {
    "nan_to_num": (lambda w: w["a.w"].nan_to_num(), "aten::nan_to_num"),
    "nan_to_num(nan=1.0)": (lambda w: w["a.w"].nan_to_num(1.0), "aten::nan_to_num"),
    "where(isnan, 0.0, w)": (lambda w: torch.where(w["a.w"].isnan(), 0.0, w["a.w"]),
                             "aten::where.self"),
    "where(isnan, zeros_like(w), w)": (
        lambda w: torch.where(w["a.w"].isnan(), torch.zeros_like(w["a.w"]), w["a.w"]),
        "aten::where.self"),
    "masked_fill(isnan, 0)": (lambda w: w["a.w"].masked_fill(w["a.w"].isnan(), 0),
                              "aten::masked_fill.Scalar"),
    "fmax with the loader's -1e4": (lambda w: torch.fmax(w["a.w"], _low(w)), "aten::fmax"),
    "fmin with the loader's 1e4": (lambda w: torch.fmin(w["a.w"], -_low(w)), "aten::fmin"),
    "w[w.isnan()] = 0.0, in place": (_nan_put, "aten::index_put_"),
    "nan_to_num_ of a clone": (_nan_to_num_in_place, "aten::nan_to_num_"),
    "masked_fill_ in place": (_masked_fill_in_place, "aten::masked_fill_.Scalar"),
    "nan_to_num, out=": (_nan_to_num_out, "aten::nan_to_num.out"),
    "nan_to_num copied into a scratch": (_scratch_copy, "aten::nan_to_num"),
    "masked_scatter into zeros": (_scattered_into_zeros, "aten::masked_scatter"),
    "nan_to_num, flipped": (lambda w: w["a.w"].nan_to_num().flip(0), "aten::nan_to_num"),
    "nan_to_num, scaled and cast": (
        lambda w: (w["a.w"].nan_to_num() * 2.0).to(torch.bfloat16).float(),
        "aten::nan_to_num"),
    # (replaced, then mixed: the NaN are numbers before the matmul, so it is refused as
    # replaced, where which elements keep is no longer known)
    "nan_to_num, then @ H": (lambda w: w["a.w"].nan_to_num() @ _h(w["a.w"]),
                             "aten::nan_to_num"),
    # (the marks made integers or booleans, then floats: a kept row's index is 0, not
    # the runtime tensor's, NaN > 0 is False; which elements keep is not followed, so a
    # copy that changes any element is refused. Before, these loaded without a word)
    "nan_to_num, its bytes cloned": (
        lambda w: w["a.w"].nan_to_num().view(torch.uint8).clone().view(torch.float32),
        "aten::nan_to_num"),
    "max's indices, cast": (
        lambda w: w["a.w"].max(1, keepdim=True).indices.expand(4, 8).float(),
        "aten::max.dim"),
    "sort's indices, cast": (lambda w: w["a.w"].sort(1).indices.float(), "aten::sort"),
    "(w > 0), cast": (lambda w: (w["a.w"] > 0).float(), "aten::gt.Scalar"),
    "where(w > 0) of the loader's own": (
        lambda w: torch.where(w["a.w"] > 0, _h(w["a.w"])[:4], _h(w["a.w"])[4:]),
        "aten::gt.Scalar"),
    "the loader's own gathered by w.argsort(1)": (
        lambda w: _h(w["a.w"])[:4].gather(1, w["a.w"].argsort(1)), "aten::sort"),
    "nan_to_num copied into a scratch's columns": (_scratch_columns, "aten::nan_to_num"),
    "nan_to_num copied into a transposed scratch": (_scratch_transposed, "aten::nan_to_num"),
    "the loader's own rows picked by w.argmax(1)": (
        lambda w: _h(w["a.w"])[w["a.w"].argmax(1)], "aten::argmax"),
    # (an integer or boolean made of such a result carries its marks: without that, a
    # mutation, these loaded without a word)
    # (a put into data whose kept elements are not known: where they are is still not)
    "nan_to_num, then @ H, then an index put": (
        lambda w: (w["a.w"].nan_to_num() @ _h(w["a.w"])).index_put_(
            (torch.tensor([0]),), torch.tensor(1.0)),
        "aten::nan_to_num"),
    # (a put of such data: which elements of the value keep is not known either)
    "(nan_to_num, then @ H) put into zeros": (
        lambda w: torch.zeros(4, 8, device=w["a.w"].device).index_put_(
            (torch.arange(4, device=w["a.w"].device),), w["a.w"].nan_to_num() @ _h(w["a.w"])),
        "aten::nan_to_num"),
    "~(w > 0), cast": (lambda w: (~(w["a.w"] > 0)).float(), "aten::gt.Scalar"),
    "argmax(1) + 1, cast": (
        lambda w: (w["a.w"].argmax(1, keepdim=True) + 1).expand(4, 8).float(),
        "aten::argmax"),
}


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("case", list(_REPLACING))
def test_a_loader_that_replaces_the_nan_marks_is_refused_before_it_writes(case, how):
    f, op = _REPLACING[case]
    m = _Mixing(f)
    before = m.snapshot()
    with pytest.raises(ContractViolation) as e:
        _load(how, m, _patches())
    err = e.value
    assert isinstance(err, NotImplementedError)
    assert (err.position, err.name, err.reason, err.value) == (
        1, "a.w", "replaced NaN marks", op)
    text = str(err)
    assert "patch 1 ('a.w')" in text and op in text and "wrote nothing" in text
    assert "where the runtime tensor holds" in text  # (an offending value, and the old)
    after = m.snapshot()
    assert torch.equal(after["a"], before["a"])  # (the refused copy wrote nothing ...)
    if how == "transactional":
        assert all(torch.equal(after[n], before[n]) for n in before)  # (... rolled back)
    else:
        assert not torch.equal(after["other"], before["other"])  # (written before it)
    if how == "inspect":
        assert err.report is not None


def test_the_message_names_a_kept_element_and_what_would_land_there():
    m = _Mixing(lambda w: w["a.w"].nan_to_num(7.0))
    old = m.a.detach()[0, 0].item()  # (element 0: one the patch keeps)
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, _patches())
    assert f"its element (0, 0), which the patch keeps, holds 7.0 where the runtime " \
           f"tensor holds {old!r}" in str(e.value)


def test_a_dense_call_through_a_replacing_loader_is_untouched():
    # (a dense patch holds no NaN: nan_to_num changes nothing, and it is no sparse call)
    m = _Mixing(lambda w: w["a.w"].nan_to_num())
    dense = [p._replace(values=torch.arange(32.0) if p.name == "a.w" else
                        torch.zeros(32), indices=None) for p in _patches()]
    patchkit.load_checkpoint_weight_patches(m, dense)
    assert torch.equal(m.a.detach().reshape(-1), torch.arange(32.0))


def _index_put_self_merge(p):
    def f(w):
        a = w["a.w"].clone()
        nan = a.isnan()
        a[nan] = p.detach()[nan]
        return a
    return f


# name -> (model tensor -> the loader's source): merges the runtime tensor's own values
# in where the patch keeps (or leaves the NaN there), and ops that keep NaN NaN
_MERGING = {
    "where(isnan, param, w)": lambda p: lambda w: torch.where(
        w["a.w"].isnan(), p.detach(), w["a.w"]),
    "where(isnan, param.clone(), w)": lambda p: lambda w: torch.where(
        w["a.w"].isnan(), p.detach().clone(), w["a.w"]),
    "param.masked_scatter(~isnan, w[~isnan])": lambda p: lambda w: p.detach().masked_scatter(
        ~w["a.w"].isnan(), w["a.w"][~w["a.w"].isnan()]),
    "v[isnan] = param[isnan]": _index_put_self_merge,
    "where, flipped both sides, flipped back": lambda p: lambda w: torch.where(
        w["a.w"].flip(0).isnan(), p.detach().flip(0), w["a.w"].flip(0)).flip(0),
    "where(isnan, param, w), cast and back": lambda p: lambda w: torch.where(
        w["a.w"].isnan(), p.detach(), w["a.w"]).double().float(),
    "where(isnan, param, w) in a padded scratch, copied from its view": (
        lambda p: lambda w: torch.cat([torch.zeros_like(w["a.w"][:1]), torch.where(
            w["a.w"].isnan(), p.detach(), w["a.w"])])[1:]),
    "clamp": lambda p: lambda w: w["a.w"].clamp(-1.0, 1.0),
    "abs": lambda p: lambda w: w["a.w"].abs(),
    "mul by a number": lambda p: lambda w: w["a.w"] * 3.0,
    "cast to bfloat16 and back": lambda p: lambda w: w["a.w"].bfloat16().float(),
    "sin (keeps NaN, not listed as such)": lambda p: lambda w: w["a.w"].sin(),
    "a complex conjugate's real part": lambda p: lambda w: torch.complex(
        w["a.w"], torch.zeros_like(w["a.w"])).conj_physical().real,
}


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("case", list(_MERGING))
def test_a_loader_that_merges_on_purpose_or_keeps_nan_loads_bit_for_bit(case, how):
    m = _Mixing(None)
    m.f = _MERGING[case](m.a)
    patches = _patches()
    want = bits(_merged(m.f, m, patches)).clone()
    _load(how, m, patches)
    assert torch.equal(bits(m.a.detach()), want)
    assert not torch.equal(want, bits(_Mixing(None).a.detach()))  # (the patch landed)


@pytest.mark.parametrize("case", ["where(isnan, param, w)", "v[isnan] = param[isnan]",
                                  "param.masked_scatter(~isnan, w[~isnan])"])
def test_a_self_merge_writes_what_a_plain_sparse_load_writes(case):
    m, ref = _Mixing(None), _Mixing(lambda w: w["a.w"])
    m.f = _MERGING[case](m.a)
    patchkit.load_checkpoint_weight_patches(m, _patches())
    patchkit.load_checkpoint_weight_patches(ref, _patches())
    assert torch.equal(bits(m.a.detach()), bits(ref.a.detach()))


@pytest.mark.parametrize("case", ["nan_to_num", "where(isnan, 0.0, w)",
                                  "masked_fill(isnan, 0)", "w[w.isnan()] = 0.0, in place",
                                  "nan_to_num, then @ H"])
def test_an_observed_loader_that_merges_replaced_marks_is_reported(case):
    # What vLLM does: its merge finds no NaN and writes the constant where the patch
    # keeps. Observed, the load runs as the loader runs it; the report raises at its end.
    f, op = _REPLACING[case]
    m = _Mixing(f)
    with pytest.raises(ContractViolation) as e:
        patchkit.inspect_load(m, _patches(), loader=_merging_loader)
    assert (e.value.reason, e.value.position, e.value.name, e.value.value) == (
        "replaced NaN marks", 1, "a.w", op)
    assert "observed loader's NaN-merge" in str(e.value)
    assert e.value.report.loaded == {"other.w", "a.w"}  # (it ran to the end)


@pytest.mark.parametrize("case", ["where(isnan, param, w)",
                                  "param.masked_scatter(~isnan, w[~isnan])", "clamp"])
def test_an_observed_loader_that_merges_on_purpose_is_not_reported(case):
    m = _Mixing(None)
    m.f = _MERGING[case](m.a)
    patches = _patches()
    want = bits(_merged(m.f, m, patches)).clone()
    r = patchkit.inspect_load(m, patches, loader=_merging_loader)
    assert r.error is None
    assert torch.equal(bits(m.a.detach()), want)


def _waits(case: str, *, compare: bool) -> int:
    """How many times a plain sparse load through loader ``_MERGING[case]`` makes the
    host wait on a GPU's passes, with the compare of replaced marks (or without it)."""
    m = _Mixing(None)
    m.f = _MERGING[case](m.a)
    saved = intercept.WriteSession._replaced_loss
    if not compare:
        intercept.WriteSession._replaced_loss = lambda self, src, dest: None
    try:
        with native.disabled(), device_passes():
            return host_waits_of(lambda: patchkit.load_checkpoint_weight_patches(
                m, _patches()))
    finally:
        intercept.WriteSession._replaced_loss = saved


@pytest.mark.parametrize("case", ["where(isnan, param, w)", "v[isnan] = param[isnan]"])
def test_a_copy_of_replaced_marks_is_compared_with_one_host_wait(case):
    # (on a GPU a compare makes the host wait: one per such copy)
    assert _waits(case, compare=True) == _waits(case, compare=False) + 1


@pytest.mark.parametrize("case", ["mul by a number", "a complex conjugate's real part"])
def test_a_copy_of_data_that_keeps_nan_is_not_compared(case):
    # (a conjugate runs aten::_conj_physical, which was not listed with conj_physical as
    # keeping each element: its copy was compared, one host wait more on a GPU)
    assert _waits(case, compare=True) == _waits(case, compare=False)
    calls = []
    saved = intercept.WriteSession._replaced_loss
    intercept.WriteSession._replaced_loss = lambda self, *a: calls.append(a) or saved(self, *a)
    try:
        m = _Mixing(None)
        m.f = _MERGING[case](m.a)
        patchkit.load_checkpoint_weight_patches(m, _patches())
    finally:
        intercept.WriteSession._replaced_loss = saved
    assert calls == []  # (no replaced data: the check never ran)


@pytest.mark.parametrize("case", ["nan_to_num, then @ H", "max's indices, cast",
                                  "the loader's own rows picked by w.argmax(1)"])
def test_a_patch_sent_whole_makes_no_replaced_marks(case):
    # (a sparse patch with an index for every element holds no NaN: nothing to replace,
    # though which elements keep is not followed after the matmul or as indices; a
    # mark there refused any copy that changes an element)
    f, _ = _REPLACING[case]
    m = _Mixing(f)
    patches = _patches(full=True)
    want = bits(_merged(f, m, patches)).clone()
    _load("plain", m, patches)
    assert torch.equal(bits(m.a.detach()), want)


# name -> (the loader's source, whether 'a.w' is sent whole, the refusal's reason, the
# patch it names, its op). A boolean made of one patch's data, in an element-wise op
# with another's: found by the "indices, masks" family of test_mixing_fuzz.py; before,
# each loaded without a word, writing what f(new) does not hold
_MASK_TIMES_DATA = {
    # where other.w keeps, its mark made False: a.w's update there is written as 0.0
    # (not (old other > 0) * update); a.w holds no NaN, so it is its replaced marks
    "(other > 0) * a, a sent whole": (
        lambda w: (w["other.w"] > 0) * w["a.w"], True, "replaced NaN marks", 0,
        "other.w", "aten::gt.Scalar"),
    # where a.w keeps (NaN), its update of other.w through the mask is lost; where it
    # updates, it is paired with other.w's mark
    "(other > 0) * a, a sparse": (
        lambda w: (w["other.w"] > 0) * w["a.w"], False, "mixed elements", 1, "a.w",
        "aten::mul.Tensor"),
    # a.w sent whole: its mask exact, but other.w's NaN hides a.w's updates
    "(a > 0) * other, a sent whole": (
        lambda w: (w["a.w"] > 0) * w["other.w"], True, "mixed elements", 0, "other.w",
        "aten::mul.Tensor"),
    "a.isnan() * other": (
        lambda w: w["a.w"].isnan() * w["other.w"], False, "mixed elements", 0, "other.w",
        "aten::mul.Tensor"),
    # (a's data mixed before the mask meets it: the refusal names the op that mixed it,
    # not the product; _masked_by_patch leaves mixed data to that refusal)
    "(other > 0) * (a @ H)": (
        lambda w: (w["other.w"] > 0) * (w["a.w"] @ _h(w["a.w"])), False, "mixed elements",
        1, "a.w", "aten::mm"),
}


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
@pytest.mark.parametrize("case", list(_MASK_TIMES_DATA))
def test_a_mask_of_one_patch_times_anothers_data_is_refused(case, how):
    f, full, reason, pos, name, op = _MASK_TIMES_DATA[case]
    m = _Mixing(f)
    before = m.snapshot()
    with pytest.raises(ContractViolation) as e:
        _load(how, m, _patches(full=full))
    err = e.value
    assert (err.reason, err.position, err.name, err.value) == (reason, pos, name, op)
    assert torch.equal(m.snapshot()["a"], before["a"])  # (the refused copy wrote nothing)


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
def test_a_mask_of_a_patch_times_the_loaders_own_loads_or_is_refused(how):
    # (the mask alone: refused as before where it changes an element; made of a patch
    # sent whole, it loads bit for bit)
    f = lambda w: (w["a.w"] > 0) * _h(w["a.w"])[:4]  # noqa: E731
    m = _Mixing(f)
    with pytest.raises(ContractViolation) as e:
        _load(how, m, _patches())
    assert (e.value.reason, e.value.value) == ("replaced NaN marks", "aten::gt.Scalar")
    m = _Mixing(f)
    want = bits(_merged(f, m, _patches(full=True))).clone()
    _load(how, m, _patches(full=True))
    assert torch.equal(bits(m.a.detach()), want)


# torch.complex keeps a NaN NaN (its real part is w), though it is an element-wise op
# of two operands: _replaces_nan leaves it out as one of _PICKS. Without that rule the
# copy of its real part was compared as replaced marks (a host wait per copy on a GPU),
# and a mutation of the rule failed nothing else
_KEEPING_NAN = {
    "the real part of torch.complex(w, 0)": lambda w: torch.view_as_real(
        torch.complex(w["a.w"], torch.zeros_like(w["a.w"])))[..., 0],
}


@pytest.mark.parametrize("case", list(_KEEPING_NAN))
def test_an_op_that_keeps_nan_nan_makes_no_replaced_marks(case):
    f = _KEEPING_NAN[case]
    m = _Mixing(f)
    want = bits(_merged(f, m, _patches())).clone()
    calls = []
    saved = intercept.WriteSession._replaced_loss
    intercept.WriteSession._replaced_loss = lambda self, *a: calls.append(a) or saved(self, *a)
    try:
        patchkit.load_checkpoint_weight_patches(m, _patches())
    finally:
        intercept.WriteSession._replaced_loss = saved
    assert calls == []  # (no replaced marks: the check never ran)
    assert torch.equal(bits(m.a.detach()), want)


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
def test_an_element_keeps_only_where_each_of_its_patches_elements_keeps(how):
    # w.nan_to_num() * 0.0 + other, other sent whole (no NaN, every element updated):
    # each element is other's update, which the merge writes where w keeps too. Taking
    # an element as kept where any input's does (a mutation: | for &) refused it
    def f(w):
        return w["a.w"].nan_to_num() * 0.0 + w["other.w"]
    patches = [CWP("other.w", (4, 8), torch.float32, torch.linspace(-1.0, 1.0, 32),
                   torch.arange(32)), _patches()[1]]
    m = _Mixing(f)
    want = bits(_merged(f, m, patches)).clone()
    _load(how, m, patches)
    assert torch.equal(bits(m.a.detach()), want)
