"""Numbers a cast into float8 made NaN (lost numbers, ``intercept._LostMarks``) followed
through the ops that held the last holes: complex round trips. Each loader scales its
patch by 2 and casts it into float8_e4m3fnuz (largest 240): 2e6 is lost; the merge
would read its NaN as "keep"."""

from __future__ import annotations

import pytest
import torch
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
