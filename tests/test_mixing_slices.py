"""Sparse loads whose loaders mix a patch's elements within slices (a reduction over a
dim, a scan, a softmax or a sort along one, a matmul over its contracted dim), where
the patch keeps or updates each slice whole: the "mixed elements" check decides by the
NaN pattern, not by the op. Each element of such an op's result then comes from kept
elements only (NaN: the merge keeps the runtime value, made by the same op of the same
elements) or updated ones only (the new value), so the load is right, and loads. Where
a slice both keeps and updates, or the result is not NaN exactly where its slices keep
(``nansum``, a matmul with an infinity), the copy is still refused before it writes.

Each "loads" case is checked against a dense load of the same update, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import _marks, native
from patchkit.bitwise import bits, device_passes
from patchkit.build import random_sparse_patch
from patchkit.errors import ContractViolation

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import host_waits_of

pytestmark = pytest.mark.filterwarnings(
    "ignore:An output with one or more elements was resized:UserWarning")

ROWS, COLS = 4, 8
HOWS = ["plain", "inspect", "transactional"]


def _dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.get_default_device())


def _fixed(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


_H = _fixed(11, COLS, COLS)  # (a loader's rotation)
_K = _fixed(12, ROWS, ROWS)
_X = _fixed(13, 3, COLS)  # (a loader's input to a linear layer)


class _Sliced(nn.Module):
    """``w`` (copied as sent) and the loader's outputs ``f(weights)`` (a tensor, or a
    tuple of them), each copied into a parameter of its own; made as loaded from ``old``
    by that loader."""

    def __init__(self, f, old: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.f = f
        self.w = nn.Parameter(_dev(old["w"]).clone(), requires_grad=False)
        outs = self._outs({n: _dev(v) for n, v in old.items()})
        self.outs = nn.ParameterList(
            [nn.Parameter(o.clone(), requires_grad=False) for o in outs])

    def _outs(self, w: dict) -> tuple[torch.Tensor, ...]:
        got = self.f(w)
        return got if isinstance(got, tuple) else (got,)

    def load_weights(self, weights):
        w = dict(weights)
        self.w.data.copy_(w["w"])
        for p, o in zip(self.outs, self._outs(w)):
            p.data.copy_(o)
        return set(w)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: bits(p.detach()).clone() for n, p in self.named_parameters()}


def _old() -> dict[str, torch.Tensor]:
    return {"w": _fixed(1, ROWS, COLS)}


def _patch(pattern: str) -> CWP:
    """A sparse patch of ``w``: ``rows`` updates rows 1 and 3 whole (as
    ``random_sparse_patch(..., pattern="rows")`` makes), ``mixed`` four elements of
    different rows, ``tail`` the last four elements of row 1 only."""
    if pattern == "rows":
        p = random_sparse_patch("w", (ROWS, COLS), torch.float32, 0.5, pattern="rows",
                                generator=torch.Generator().manual_seed(5))
        return CWP(p.name, p.shape, p.dtype, _dev(p.values), _dev(p.indices))
    if pattern == "rows with a zero":  # (rows 1 and 3, w[1, 1] updated to 0.0)
        values = torch.linspace(-2.0, 2.0, 2 * COLS)
        values[1] = 0.0
        return CWP("w", (ROWS, COLS), torch.float32, _dev(values),
                   _dev(torch.cat([torch.arange(COLS, 2 * COLS),
                                   torch.arange(3 * COLS, 4 * COLS)])))
    idx = {"mixed": [1, 9, 20, 30], "tail": [12, 13, 14, 15]}[pattern]
    return CWP("w", (ROWS, COLS), torch.float32, _dev(torch.linspace(-2.0, 2.0, 4)),
               _dev(torch.tensor(idx)))


def _load(how: str, model: nn.Module, patches: list[CWP]) -> None:
    if how == "inspect":
        patchkit.inspect_load(model, patches)
    else:
        patchkit.load_checkpoint_weight_patches(model, patches,
                                                transactional=how == "transactional")


def _dense_twin(f, patch: CWP) -> _Sliced:
    """A model loaded from the old checkpoint, then given the same update dense."""
    twin = _Sliced(f, _old())
    full = _dev(_old()["w"]).reshape(-1).clone()
    full[patch.indices] = patch.values
    patchkit.load_checkpoint_weight_patches(
        twin, [CWP("w", (ROWS, COLS), torch.float32, full, None)])
    return twin


def _loads_right(f, pattern: str, how: str) -> None:
    patch = _patch(pattern)
    m = _Sliced(f, _old())
    before = m.snapshot()
    _load(how, m, [patch])
    got, want = m.snapshot(), _dense_twin(f, patch).snapshot()
    assert got.keys() == want.keys()
    for n in got:
        assert torch.equal(got[n], want[n]), n
    assert any(not torch.equal(got[n], before[n]) for n in got if n != "w")  # (it landed)


def _refused(f, pattern: str, how: str, op: str) -> None:
    m = _Sliced(f, _old())
    before = m.snapshot()
    with pytest.raises(ContractViolation) as e:
        _load(how, m, [_patch(pattern)])
    err = e.value
    assert (err.position, err.name, err.reason, err.value) == (0, "w", "mixed elements", op)
    after = m.snapshot()
    outs = [n for n in after if n != "w"]
    assert all(torch.equal(after[n], before[n]) for n in outs)  # (the copy wrote nothing)
    if how == "transactional":
        assert torch.equal(after["w"], before["w"])


# the per-output-channel quantizer: one scale per row, both copied into the model
def _quantizer(w):
    scale = w["w"].abs().amax(dim=1, keepdim=True)
    return w["w"] / scale, scale


def _cumsum_in_place(w):
    buf = torch.empty(ROWS, COLS, device=w["w"].device)
    buf.copy_(w["w"])
    return buf.cumsum_(1)


def _sum_out(w):
    buf = torch.empty(ROWS, 1, device=w["w"].device)
    return torch.sum(w["w"], 1, keepdim=True, out=buf)


def _mm_out(w):
    buf = torch.empty(ROWS, COLS, device=w["w"].device)
    return torch.mm(w["w"], _dev(_H), out=buf)


def _with_zero_column(w):
    h = _dev(_H).clone()
    h[:, 2] = 0.0  # (a kept row times 0: NaN still)
    return w["w"] @ h


def _with_inf(w):
    h = _dev(_H).clone()
    h[1, 2] = float("inf")  # (an updated row's 0.0 times inf: NaN, where it updates)
    return w["w"] @ h


def _complex_sum(w):
    z = torch.view_as_complex(w["w"].reshape(ROWS, COLS // 2, 2).contiguous())
    return torch.view_as_real(z.sum(1, keepdim=True)).reshape(ROWS, 2)


def _complex_of_two_rows_rotated(w):
    # each element's parts from two rows (row 0's real part kept, its imaginary part
    # updated), then a complex matmul, which mixes the parts
    z = torch.complex(w["w"], w["w"].flip(0))
    h = torch.complex(_dev(_H), _dev(_H).flip(0))
    return torch.view_as_real(z @ h).reshape(ROWS, 2 * COLS)


def _complex_rows_rotated(w):
    z = torch.view_as_complex(w["w"].reshape(ROWS, COLS // 2, 2).contiguous())
    h = torch.complex(_dev(_H[:4, :4]), _dev(_H[4:, 4:]))
    return torch.view_as_real(z @ h).reshape(ROWS, COLS)


def _foreach_norms(w):
    return torch.stack(torch._foreach_norm([w["w"][0], w["w"][1]]))


# name -> f; each loads with a patch that updates rows 1 and 3 whole
_LOADS = {
    "per-channel quantizer (amax over rows, keepdim, then w / scale)": _quantizer,
    "sum(1)": lambda w: w["w"].sum(1),
    "amax(1, keepdim=True)": lambda w: w["w"].amax(1, keepdim=True),
    "sort(1) values": lambda w: w["w"].sort(1).values,
    "cumsum(1)": lambda w: w["w"].cumsum(1),
    "softmax(1)": lambda w: w["w"].softmax(1),
    "log_softmax(1)": lambda w: F.log_softmax(w["w"], 1),
    "topk(3, 1) values": lambda w: w["w"].topk(3, 1).values,
    "max(1) values (with indices)": lambda w: w["w"].max(1).values,
    "var(1) and mean(1)": lambda w: torch.var_mean(w["w"], 1),
    "w - w.mean(1, keepdim=True) (broadcast after keepdim)": (
        lambda w: w["w"] - w["w"].mean(1, keepdim=True)),
    "sums of a kept and an updated row (reductions to a scalar)": (
        lambda w: torch.stack([w["w"][0].sum(), w["w"][1].sum()])),
    "w @ H (mm)": lambda w: w["w"] @ _dev(_H),
    "bmm of w's row pairs": lambda w: (w["w"].reshape(2, 2, COLS) @ _dev(_H)).reshape(
        ROWS, COLS),
    "linear(x, w) (mm of w.t())": lambda w: F.linear(_dev(_X), w["w"]),
    "linear(x, w, bias) (addmm)": lambda w: F.linear(_dev(_X), w["w"], _dev(_X[0, :ROWS])),
    "linear(x, w, w[:, 0]) (addmm whose bias keeps where w's rows do)": (
        lambda w: F.linear(_dev(_X), w["w"], w["w"][:, 0])),
    "median of single elements (0-d) of a kept and an updated row": lambda w: torch.stack(
        [w["w"][0, 0].median(), w["w"][1, 0].median()]),
    "addbmm of w as one batch (sums over the batch too)": lambda w: torch.addbmm(
        _dev(torch.zeros(ROWS, COLS)), w["w"].unsqueeze(0), _dev(_H).unsqueeze(0)),
    "einsum('ij,kj->ik', x, w)": lambda w: torch.einsum("ij,kj->ik", _dev(_X), w["w"]),
    "matmul whose other operand has a zero column": _with_zero_column,
    "cumsum_ in place on a scratch": _cumsum_in_place,
    "sum(1, out=) a scratch": _sum_out,
    "mm(out=) a scratch": _mm_out,
    "_foreach_norm of a kept and an updated row": _foreach_norms,
    "sum of a complex view of rows": _complex_sum,
    "complex matmul of a complex view of rows": _complex_rows_rotated,
}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", list(_LOADS))
def test_an_op_over_rows_the_patch_keeps_or_updates_whole_loads_right(case, how):
    _loads_right(_LOADS[case], "rows", how)


# name -> (f, op named, pattern): each refused, the slices keep and update both or the
# result not NaN exactly where they keep
_REFUSED = {
    "per-channel quantizer, uniformly sparse": (_quantizer, "aten::amax", "mixed"),
    "sum(1), mixed rows": (lambda w: w["w"].sum(1), "aten::sum.dim_IntList", "mixed"),
    "amax(1, keepdim=True), mixed rows": (lambda w: w["w"].amax(1, keepdim=True),
                                          "aten::amax", "mixed"),
    "sort(1) values, mixed rows": (lambda w: w["w"].sort(1).values, "aten::sort", "mixed"),
    "cumsum(1), mixed rows": (lambda w: w["w"].cumsum(1), "aten::cumsum", "mixed"),
    "cumsum(1) of a row updated in its tail only (its prefixes)": (
        lambda w: w["w"].cumsum(1), "aten::cumsum", "tail"),
    "softmax(1), mixed rows": (lambda w: w["w"].softmax(1), "aten::_softmax", "mixed"),
    "w @ H, mixed rows": (lambda w: w["w"] @ _dev(_H), "aten::mm", "mixed"),
    "K @ w (contracts w's columns, which rows cut)": (
        lambda w: _dev(_K) @ w["w"], "aten::mm", "rows"),
    "sum(0) (columns, which rows cut)": (lambda w: w["w"].sum(0), "aten::sum.dim_IntList",
                                         "rows"),
    "amax of the whole tensor (one slice)": (lambda w: w["w"] / w["w"].abs().amax(),
                                             "aten::amax", "rows"),
    "w @ w.t() (kept row i with updated row j)": (lambda w: w["w"] @ w["w"].t(), "aten::mm",
                                                  "rows"),
    "nansum(1) (a kept row sums to 0, a number)": (lambda w: w["w"].nansum(1),
                                                   "aten::nansum", "rows"),
    "matmul whose other operand has an infinity (NaN where it updates)": (
        _with_inf, "aten::mm", "rows with a zero"),
    "cumsum_ in place on a scratch, mixed rows": (_cumsum_in_place, "aten::cumsum_",
                                                  "mixed"),
    "sum(1, out=) a scratch, mixed rows": (_sum_out, "aten::sum.IntList_out", "mixed"),
    "_foreach_norm of two rows, mixed": (_foreach_norms, "aten::_foreach_norm.Scalar",
                                         "mixed"),
    "complex matmul of elements whose parts keep differently": (
        _complex_of_two_rows_rotated, "aten::mm", "rows"),
}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", list(_REFUSED))
def test_an_op_over_slices_that_keep_and_update_is_refused(case, how):
    f, op, pattern = _REFUSED[case]
    _refused(f, pattern, how, op)


def test_each_refused_case_would_lose_an_update():
    # (the refusals above are no false ones: the plain NaN-merge of each loader's result
    # differs from what a dense load of the same update leaves)
    for case, (f, _, pattern) in _REFUSED.items():
        patch = _patch(pattern)
        m = _Sliced(f, _old())
        staged = {"w": patchkit.stage(patch)}
        got = m._outs(staged)
        want = _dense_twin(f, patch)
        merged = [torch.where(o.isnan(), p.detach(), o) for o, p in zip(got, m.outs)]
        assert any(not torch.equal(bits(a), bits(b.detach()))
                   for a, b in zip(merged, want.outs)), case


def test_an_op_over_rows_reads_the_nan_pattern_in_one_host_wait():
    # on a device, the decision is one read of the NaN pattern per such op (with its
    # result's), as the NaN check it replaces was: cumsum(1) or an in-place cumsum_ waits
    # once more than an element-wise op of the same data
    def waits(f):
        m = _Sliced(f, _old())
        patch = _patch("rows")
        with native.disabled(), device_passes():
            return host_waits_of(lambda: patchkit.load_checkpoint_weight_patches(m, [patch]))

    plain = waits(lambda w: w["w"].abs())
    assert waits(lambda w: w["w"].cumsum(1)) == plain + 1
    assert waits(_cumsum_in_place) == plain + 1
    assert waits(lambda w: w["w"] @ _dev(_H)) == plain + 1


def test_a_row_a_cast_made_nan_is_no_keep_for_a_sum_over_rows():
    # row 1, updated whole, cast to a float8 without infinities: its out-of-range
    # numbers become NaN, a lost update, not "keep"; summed over the row, that NaN is at
    # no place a mark follows, so the sum is refused as mixed (its merge would keep the
    # old row's sum where the dense load writes NaN)
    fnuz = torch.float8_e4m3fnuz

    def f(w):
        return w["w"].to(fnuz).float().sum(1)

    values = torch.full((COLS,), 1e6)
    patch = CWP("w", (ROWS, COLS), torch.float32, _dev(values),
                _dev(torch.arange(COLS, 2 * COLS)))
    m = _Sliced(f, _old())
    before = m.snapshot()
    with pytest.raises(ContractViolation) as e:
        patchkit.load_checkpoint_weight_patches(m, [patch])
    assert (e.value.reason, e.value.value) == ("mixed elements", "aten::sum.dim_IntList")
    assert torch.equal(m.snapshot()["outs.0"], before["outs.0"])


@pytest.mark.parametrize("case", ["a sum over a dim of one element", "sum(1), mixed rows"])
def test_a_reduction_is_told_on_a_torch_that_tags_none(monkeypatch, case):
    # torch 2.4 has no torch.Tag.reduction: patchkit read it for every op that mixes, and
    # a sparse load through any such op raised AttributeError; there a reduction is told
    # by its name, and loads or is refused as where torch tags it (ops decided afresh)
    monkeypatch.delattr(torch.Tag, "reduction", raising=False)
    monkeypatch.setattr(_marks, "_MIXES", {})
    if case == "sum(1), mixed rows":
        _refused(lambda w: w["w"].sum(1), "mixed", "plain", "aten::sum.dim_IntList")
    else:
        # (a reduction that mixes no two elements: each output element is one input's)
        _loads_right(lambda w: torch.stack([w["w"]]).sum(0), "mixed", "plain")
    assert _marks._MIXES[torch.ops.aten.sum.dim_IntList] == _marks._REDUCES


def test_the_reductions_told_by_name_are_those_torch_tags():
    # (each name of the fallback is one torch tags a reduction where it has the tag; newer
    # torch tags ops 2.4 lacks, such as 2.14's _linalg__powsum: those need no name)
    tag = getattr(torch.Tag, "reduction", None)
    if tag is None:
        pytest.skip("this torch tags no op a reduction (torch 2.4)")
    tagged = set()
    for qualified in torch._C._dispatch_get_all_op_names():  # (every op, loaded or not)
        space, _, name = qualified.partition("::")
        if space != "aten":
            continue
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default", None)
        if op is not None and tag in op.tags:
            tagged.add(_marks._base_name(op))
    assert tagged >= _marks._REDUCTIONS
