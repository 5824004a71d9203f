"""Numbers a cast into float8 made NaN (lost numbers, ``_marks._LostMarks``) followed
through the ops that held the last holes: complex round trips, ``torch._foreach_*``
ops, puts that add or reduce and the functional forms of puts, fills of a 0-d tensor,
writes through a wider view of a one-byte scratch, and copies whose source is their
destination. Each loader scales its patch by 2 and casts it into float8_e4m3fnuz
(largest 240): 2e6 is lost; the merge would read its NaN as "keep"."""

from __future__ import annotations

import pytest
import torch
from _torch_features import needs_foreach_clone
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP

_F8 = torch.float8_e4m3fnuz


class _Copies(nn.Module):
    """A 2 x 4 float8 weight (rows 2-3 of a 4 x 4 checkpoint one) that copies
    ``how(t)`` of its patch."""

    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
        self.how = how

    def load_weights(self, weights):
        for _, t in weights:
            self.w.copy_(self.how(t))
        return {n for n, _ in weights}


def _lost(t):
    """``t`` scaled by 2, cast to float8 (2e6 lost), read back in float32."""
    return (t * 2).to(_F8).float()


def _at(t, *values):
    return torch.tensor(values, device=t.device)


def _loads_or_refuses(how):
    """``how``'s load refuses 2e6 at checkpoint index 13 (element 5 of its source: the
    scaling leaves its place in the patch unknown), writing nothing; 3.0 there loads."""
    m = _Copies(how)
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(ValueError, match=r"value 2000000\.0 at element 5 of the source") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        0, "w", "NaN in the runtime dtype", 5)
    assert m.w.detach().float().eq(1).all()
    ok = p._replace(values=torch.tensor([2.0, 3.0]))
    assert patchkit.load_checkpoint_weight_patches(m, [ok]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 4.0, 1.0, 1.0, 1.0, 6.0, 1.0, 1.0]


def _float8_refilled(fill):
    """Float8 ``a`` and ``b`` loaded through one float32 scratch: ``a`` scaled, cast into
    it (its 1e6 at index 1 lost, in a row ``a``'s copy does not read), then the scratch
    refilled for ``b`` by ``fill(buf, t)``, whose NaN at index 1 is b's "keep"."""

    class Refilled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            buf = torch.empty(4, 4)
            for n, t in weights:
                if n == "a":
                    buf.copy_(_lost(t))
                    self.a.copy_(buf[2:])
                else:
                    fill(buf, t)
                    self.b.copy_(buf[:2])
            return {n for n, _ in weights}

    a = CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    b = CWP("b", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([0]))
    m = Refilled()
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


# -- 1. complex round trips --------------------------------------------------------------


def _zeros(t):
    return torch.zeros(2, 4, device=t.device)


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: torch.view_as_real(torch.complex(_lost(t)[2:], _zeros(t)))[..., 0],
                 id="complex, view_as_real, real part"),
    pytest.param(lambda t: torch.complex(_zeros(t), _lost(t)[2:]).imag, id="complex, imag"),
    pytest.param(lambda t: torch.view_as_complex(
        torch.stack([_zeros(t), _lost(t)[2:]], -1)).clone().imag, id="view_as_complex, imag"),
    pytest.param(lambda t: torch.view_as_real(torch.view_as_complex(
        torch.stack([_zeros(t), _lost(t)[2:]], -1)) * 1)[..., 1],
                 id="view_as_complex, scaled, view_as_real"),
    pytest.param(lambda t: torch.view_as_real(torch.complex(_lost(t), _lost(t) * 0).to(
        torch.complex128)[2:]).float()[..., 0], id="complex, cast, real part"),
    # (the marks of a complex tensor read by a pointwise op, whose imaginary part alone
    # holds the lost number: what the mark says comes from that part)
    pytest.param(lambda t: (torch.complex(_zeros(t), _lost(t)[2:]) * 1).imag,
                 id="complex, scaled, imag"),
    # (a complex cast into a real dtype keeps the real part, and its marks)
    pytest.param(lambda t: torch.complex(_lost(t)[2:], _zeros(t)).to(torch.float32),
                 id="complex, cast to real",
                 marks=pytest.mark.filterwarnings("ignore:Casting complex values")),
    # (a conjugate view read by a pointwise op: its parts are the storage's own)
    pytest.param(lambda t: (torch.complex(_lost(t)[2:], _zeros(t)).conj() * 1).real,
                 id="complex, conj, scaled, real part"),
])
def test_a_lost_number_is_followed_through_complex_round_trips(how):
    # torch.complex is not tagged pointwise: its output took no mark; a complex element's
    # mark sat at its real part's place, so its imaginary part (.imag, view_as_real's
    # [..., 1]) was never marked, and 2e6 arrived as a "keep" without a word
    _loads_or_refuses(how)


def test_a_lost_number_in_one_part_of_a_complex_element_leaves_the_other_part_a_keep():
    # (the staged rows 0-1, whose NaN are "keep", as real parts beside the cast rows 2-3
    # as imaginary ones: element 5's real part is a "keep", its imaginary part 320, lost
    # (160 fits float8, twice 160 does not); the real parts are copied, and load)
    m = _Copies(lambda t: torch.complex(t[:2], _lost(t)[2:]).real)
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 160.0]), torch.tensor([1, 13]))
    assert patchkit.load_checkpoint_weight_patches(m, [p]) == {"w"}
    assert m.w.detach().float().reshape(-1).tolist() == [1.0, 2.0] + [1.0] * 6
    # (the imaginary parts hold it: refused)
    m = _Copies(lambda t: torch.complex(t[:2], _lost(t)[2:]).imag)
    with pytest.raises(ValueError, match=r"value 320\.0 at element 5 of the source"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()


@pytest.mark.parametrize("refill", [
    pytest.param(lambda z, t: z.index_put_((torch.arange(2, device=t.device),),
                                           torch.complex(t[:2], t[:2])), id="index_put_"),
    pytest.param(lambda z, t: torch.complex(t[:2], t[:2], out=z[:2]), id="torch.complex, out="),
])
def test_a_complex_scratch_refilled_forgets_the_numbers_lost_in_both_parts(refill):
    # a's 1e6 (index 1) lost in both parts of a complex scratch, in a row a's copy does
    # not read; the scratch's rows 0-1 refilled for b, whose NaN at index 1 is b's "keep"
    # (the imaginary part kept a's mark, and b's good load was refused naming 'a')

    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            z = torch.zeros(4, 4, dtype=torch.complex64)
            for n, t in weights:
                if n == "a":
                    z.copy_(torch.complex(_lost(t), _lost(t)))
                    self.a.copy_(z[2:].imag)
                else:
                    refill(z, t)
                    self.b.copy_(z[:2].imag)
            return {n for n, _ in weights}

    a = CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    b = CWP("b", (4, 4), torch.float32, torch.tensor([0.5]), torch.tensor([0]))
    m = Complex()
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


# -- 2. torch._foreach_* -----------------------------------------------------------------


def _foreach_copied(t, into, src):
    buf = torch.zeros(2, 4, dtype=into, device=t.device)
    torch._foreach_copy_([_zeros(t), buf], [_zeros(t), src])
    return buf


def _foreach_added_in_place(t):
    ts = [_zeros(t), _zeros(t)]
    torch._foreach_add_(ts, [_zeros(t), _lost(t)[2:]])
    return ts[1]


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: torch._foreach_mul([_zeros(t), _lost(t)[2:]], 1.0)[1],
                 id="_foreach_mul"),
    pytest.param(lambda t: torch._foreach_add([_lost(t)[2:]], [_zeros(t)])[0],
                 id="_foreach_add of lists"),
    pytest.param(lambda t: torch._foreach_add([_lost(t)[2:]], torch.tensor(0.0))[0],
                 id="_foreach_add of a tensor"),
    pytest.param(lambda t: torch._foreach_clamp_min([_lost(t)[2:]], [-1e9])[0],
                 id="_foreach_clamp_min"),
    pytest.param(lambda t: torch._foreach_clone([_lost(t)[2:]])[0], id="_foreach_clone",
                 marks=needs_foreach_clone),
    # (_foreach_pow.List, whose op on each tensor is pow.Tensor_Tensor, was taken for an op
    # that mixes elements, and refused so)
    pytest.param(lambda t: torch._foreach_pow([_lost(t)[2:]], [_zeros(t) + 1])[0],
                 id="_foreach_pow of lists"),
    pytest.param(_foreach_added_in_place, id="_foreach_add_ into scratches"),
    pytest.param(lambda t: _foreach_copied(t, torch.float32, _lost(t)[2:]),
                 id="_foreach_copy_ (float32)"),
    # (the foreach copy's own cast into float8 loses the number)
    pytest.param(lambda t: _foreach_copied(t, _F8, t[2:] * 2), id="_foreach_copy_ (float8)"),
])
def test_a_lost_number_is_followed_through_foreach_ops(how):
    # (the marks went through none of them: a list op is no pointwise op, a copy_ or a
    # cast; _foreach_add of lists was even refused as an op that mixes elements)
    _loads_or_refuses(how)


@pytest.mark.parametrize("fill", [
    pytest.param(lambda buf, t: torch._foreach_copy_([buf], [t]), id="_foreach_copy_"),
    pytest.param(lambda buf, t: (torch._foreach_zero_([buf]), buf.add_(t)),
                 id="_foreach_zero_, then add_"),
])
def test_a_scratch_refilled_by_a_foreach_op_forgets_the_numbers_lost_in_it(fill):
    # (the marks of a's number stayed, and b's "keep" at index 1 was refused naming 'a')
    _float8_refilled(fill)


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: torch.floor_divide(_lost(t)[2:], 1.0), id="floor_divide"),
    pytest.param(lambda t: torch.floor_divide(_lost(t)[2:], torch.ones(2, 4, device=t.device),
                                              out=torch.empty(2, 4, device=t.device)),
                 id="floor_divide, out="),
    pytest.param(lambda t: torch.polar(_lost(t)[2:], _zeros(t)).real, id="polar, real part"),
    # (in place, the lost number in its other argument: heaviside(0, x) is x)
    pytest.param(lambda t: _zeros(t).heaviside_(_lost(t)[2:]), id="heaviside_ of zeros"),
])
def test_a_lost_number_is_followed_through_element_wise_ops_torch_does_not_tag(how):
    # (torch tags none of these pointwise: floor_divide and polar in no form, heaviside_
    # only in its functional one; the marks went through none of them, and 2e6 arrived
    # as a "keep" without a word)
    _loads_or_refuses(how)


# -- 3. puts -----------------------------------------------------------------------------


def _scratch(t):
    return torch.zeros(4, 4, device=t.device)


def _rows(t):
    return torch.arange(4, device=t.device)


def _grid(t):
    return _rows(t)[:, None].expand(4, 4)


@pytest.mark.parametrize("how", [
    pytest.param(lambda t: _scratch(t).index_add_(0, _rows(t), _lost(t))[2:], id="index_add_"),
    pytest.param(lambda t: _scratch(t).index_add(0, _rows(t), _lost(t))[2:], id="index_add"),
    pytest.param(lambda t: _scratch(t).index_reduce_(0, _rows(t), _lost(t), "amax")[2:],
                 id="index_reduce_", marks=pytest.mark.filterwarnings("ignore:index_reduce")),
    pytest.param(lambda t: _scratch(t).scatter_add_(0, _grid(t), _lost(t))[2:],
                 id="scatter_add_"),
    pytest.param(lambda t: _scratch(t).scatter_reduce_(0, _grid(t), _lost(t), "sum")[2:],
                 id="scatter_reduce_"),
    pytest.param(lambda t: _scratch(t).scatter_(0, _grid(t), _lost(t), reduce="add")[2:],
                 id="scatter_ with a reduce",
                 marks=pytest.mark.filterwarnings("ignore:The reduce argument")),
    pytest.param(lambda t: _scratch(t).put_(torch.arange(16, device=t.device),
                                            _lost(t).reshape(-1))[2:], id="put_"),
    # (the lost number already in the scratch, a reduce adding zeros onto it: still NaN)
    pytest.param(lambda t: _lost(t).scatter_(0, _grid(t), _scratch(t), reduce="add")[2:],
                 id="scatter_ with a reduce, onto it",
                 marks=pytest.mark.filterwarnings("ignore:The reduce argument")),
    pytest.param(lambda t: _scratch(t).put_(torch.arange(16, device=t.device),
                                            _lost(t).reshape(-1), accumulate=True)[2:],
                 id="put_, accumulating"),
    pytest.param(lambda t: _scratch(t).index_put_((_rows(t),), _lost(t), accumulate=True)[2:],
                 id="index_put_, accumulating"),
    pytest.param(lambda t: _scratch(t).index_copy(0, _rows(t), _lost(t))[2:], id="index_copy"),
    pytest.param(lambda t: _scratch(t).scatter(0, _grid(t), _lost(t))[2:], id="scatter"),
    pytest.param(lambda t: _scratch(t).masked_scatter(
        torch.ones(4, 4, dtype=torch.bool, device=t.device), _lost(t))[2:], id="masked_scatter"),
    pytest.param(lambda t: _scratch(t).index_put((_rows(t),), _lost(t))[2:], id="index_put"),
    pytest.param(lambda t: _scratch(t).slice_scatter(_lost(t)[2:], 0, 2)[2:],
                 id="slice_scatter"),
    pytest.param(lambda t: (t * 2).select_scatter(_lost(t)[3], 0, 3)[2:],
                 id="select_scatter"),
    pytest.param(lambda t: _lost(t).index_fill(0, _at(t, 0), 0.0)[2:], id="index_fill"),
    pytest.param(lambda t: _lost(t).take(torch.arange(8, 16, device=t.device)).reshape(2, 4),
                 id="take"),
    pytest.param(lambda t: _lost(t).masked_select(
        torch.arange(16, device=t.device).reshape(4, 4) >= 8).reshape(2, 4), id="masked_select"),
])
def test_a_lost_number_is_followed_through_puts_and_their_functional_forms(how):
    # (an adding put kept the marks it added to, and took none from what it added; a
    # functional put, or a take, made a new tensor with no marks at all)
    _loads_or_refuses(how)


@pytest.mark.parametrize("fill", [
    pytest.param(lambda buf, t: buf.put_(torch.arange(16, device=t.device), t.reshape(-1)),
                 id="put_"),
    pytest.param(lambda buf, t: buf.index_fill_(0, _rows(t), 0.0).add_(t),
                 id="index_fill_, then add_"),
    pytest.param(lambda buf, t: buf.copy_(buf.slice_scatter(t[:2], 0, 0, 2)), id="slice_scatter"),
    pytest.param(lambda buf, t: buf.copy_(buf.index_copy(0, _rows(t), t)), id="index_copy"),
])
def test_a_scratch_refilled_by_a_put_forgets_the_numbers_lost_where_it_put(fill):
    _float8_refilled(fill)


# -- 4. fills of a 0-d tensor --------------------------------------------------------------


def _filled_at_5(fill):
    """Rows whose element 5 is ``fill(zeros, v)``'s, ``v`` the 0-d element of the
    loader's cast that holds the lost number, and the others the cast's own."""

    def how(t):
        v = _lost(t)[3, 1]
        at5 = torch.arange(8, device=t.device).reshape(2, 4) == 5
        return torch.where(at5, fill(_zeros(t), v, at5), _lost(t)[2:])

    return how


@pytest.mark.parametrize("fill", [
    pytest.param(lambda z, v, at5: z.fill_(v), id="fill_"),
    pytest.param(lambda z, v, at5: z.masked_fill_(at5, v), id="masked_fill_"),
    pytest.param(lambda z, v, at5: z.index_fill_(1, torch.tensor([1], device=z.device), v),
                 id="index_fill_"),
    pytest.param(lambda z, v, at5: z.index_fill(1, torch.tensor([1], device=z.device), v),
                 id="index_fill"),
])
def test_a_fill_of_a_lost_number_marks_what_it_fills(fill):
    # (the fill took the marks of what it overwrote away and brought none of its value's:
    # the element the loader filled with the lost number held a "keep")
    _loads_or_refuses(_filled_at_5(fill))


# -- 5. a wider write over one-byte marks ------------------------------------------------


def test_a_float32_write_over_float8_marks_forgets_each_byte_it_wrote():
    # A uint8 pool holds a's float8 cast (its 1e6 at index 1, byte 1, lost); b's float8
    # staged bytes are then written into it four at a time (as float32 words). Marks are
    # by the byte each element starts at: the write took the mark at byte 0 away but not
    # the one at byte 1, where b's "keep" was then refused naming 'a'.
    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)
            self.b = nn.Parameter(torch.ones(2, 4).to(_F8), requires_grad=False)

        def load_weights(self, weights):
            pool = torch.empty(16, dtype=torch.uint8)
            f8 = pool.view(_F8).view(4, 4)
            for n, t in weights:
                if n == "a":
                    f8.copy_(t * 2)
                    self.a.copy_(f8[2:])
                else:
                    pool.view(torch.float32).copy_(t.reshape(-1).view(torch.float32))
                    self.b.copy_(f8[:2])
            return {n for n, _ in weights}

    a = CWP("a", (4, 4), torch.float32, torch.tensor([1e6, 2.0]), torch.tensor([1, 13]))
    b = CWP("b", (4, 4), _F8, torch.tensor([0.5]), torch.tensor([0]))
    m = Pool()
    assert patchkit.load_checkpoint_weight_patches(m, [a, b]) == {"a", "b"}
    assert m.a.detach().float().reshape(-1).tolist() == [1.0] * 5 + [4.0, 1.0, 1.0]
    assert m.b.detach().float().reshape(-1).tolist() == [0.5] + [1.0] * 7


# -- 6. a copy_ whose source is its destination -----------------------------------------


def test_a_copy_of_a_scratch_onto_itself_keeps_its_marks():
    # (copy_ took the destination's marks away before it read the source's: the same
    # marks, so a self-copy dropped them all)
    def how(t):
        buf = _lost(t)[2:].clone()
        buf.copy_(buf)
        buf.view(8).copy_(buf.view(8))
        return buf

    _loads_or_refuses(how)


def test_a_copy_whose_source_partly_overlaps_it_is_torchs_own_error():
    # (torch refuses it before it writes: no mark is read or changed, and the error is
    # torch's, with the model unchanged)
    def how(t):
        buf = _lost(t)
        buf[1:].copy_(buf[:-1])
        return buf[2:]

    m = _Copies(how)
    p = CWP("w", (4, 4), torch.float32, torch.tensor([2.0, 1e6]), torch.tensor([9, 13]))
    with pytest.raises(RuntimeError, match="single memory location"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert m.w.detach().float().eq(1).all()
