"""Edge cases a mutation audit of the suite found untested: each test here fails when the
line it names is changed in a plausible way (an off-by-one, a dropped check)."""

from __future__ import annotations

import pytest
import torch
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
