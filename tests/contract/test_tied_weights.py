"""CONTRACT §6 **[patchkit]**: one Parameter under two names (tied embedding and lm_head).

The first registered name is canonical. A patch naming the alias is renamed to it, or
dropped when a patch for the canonical name is in the same call.
"""

from __future__ import annotations

import pytest
import torch

from patchkit import plan_chunks

from ._models import TiedModel, same_bits

pytestmark = pytest.mark.patchkit_only

CANON, ALIAS = "embed_tokens.weight", "lm_head.weight"
SHAPE = (5, 3)


def start() -> torch.Tensor:
    return TiedModel().embed_tokens.weight.detach().clone()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_alias_is_renamed_to_the_canonical_name(load, mk, kind):
    m = TiedModel()
    if kind == "dense":
        patch = mk.dense(ALIAS, torch.full(SHAPE, 2.0))
    else:
        patch = mk.sparse(ALIAS, SHAPE, [0, 14], [-1.0, -2.0])
    assert load(m, [patch]) == {CANON}
    assert m.calls == [[CANON]]
    expected = start()
    if kind == "dense":
        expected.fill_(2.0)
    else:
        expected.view(-1)[[0, 14]] = torch.tensor([-1.0, -2.0])
    assert same_bits(m.embed_tokens.weight.detach(), expected)
    assert m.lm_head.weight is m.embed_tokens.weight


@pytest.mark.parametrize("alias_first", [True, False])
def test_alias_is_dropped_when_the_canonical_name_is_in_the_same_call(load, mk, alias_first):
    m = TiedModel()
    canon = mk.sparse(CANON, SHAPE, [1], [7.0])
    alias = mk.sparse(ALIAS, SHAPE, [2], [9.0])
    patches = [alias, canon] if alias_first else [canon, alias]
    with pytest.warns(UserWarning, match=f"patch {int(not alias_first)} .* is not loaded"):
        assert load(m, patches) == {CANON}
    assert m.calls == [[CANON]]  # one call, one entry: no overlapping writes
    expected = start()
    expected.view(-1)[1] = 7.0
    assert same_bits(m.embed_tokens.weight.detach(), expected)


def test_alias_is_dropped_even_when_the_budget_would_separate_them(load, mk):
    m = TiedModel()
    patches = [
        mk.dense(CANON, torch.ones(SHAPE)),
        mk.dense("norm", torch.zeros(3)),
        mk.dense(ALIAS, torch.full(SHAPE, 5.0)),
    ]
    with pytest.warns(UserWarning, match="patch 2 .* is not loaded"):
        load(m, patches, max_chunk_bytes=60)
    assert m.calls == [[CANON], ["norm"]]
    assert m.embed_tokens.weight.detach().eq(1.0).all()


def test_repeated_alias_patches_chunk_as_one_name(load, mk):
    m = TiedModel()
    patches = [
        mk.sparse(ALIAS, SHAPE, [0], [1.0]),
        mk.sparse("norm", (3,), [0], [0.5]),
        mk.sparse(ALIAS, SHAPE, [0], [2.0]),
    ]
    load(m, patches)
    assert m.calls == [[CANON, "norm"], [CANON]]
    assert m.embed_tokens.weight[0, 0].item() == 2.0


def test_chunk_plan_of_the_kept_patches_keeps_caller_positions(load, mk):
    from patchkit.loader import canonicalize_tied

    m = TiedModel()
    patches = [
        mk.sparse("norm", (3,), [0], [0.5]),
        mk.sparse(ALIAS, SHAPE, [0], [1.0]),
        mk.sparse(CANON, SHAPE, [1], [2.0]),
    ]
    kept, positions = canonicalize_tied(m, patches, warn=False)
    assert positions == [0, 2]
    assert [p.name for p in kept] == ["norm", CANON]
    chunks = plan_chunks(kept, 1 << 20, positions=positions)
    assert [c.positions for c in chunks] == [(0, 2)]
    with pytest.warns(UserWarning, match="patch 1 .* is not loaded"):
        load(m, patches)
    assert m.calls == [["norm", CANON]]


def test_alias_patches_are_still_validated(load, mk):
    m = TiedModel()
    before = start()
    with pytest.raises(ValueError) as excinfo:
        load(m, [mk.sparse(CANON, SHAPE, [1], [7.0]), mk.sparse(ALIAS, SHAPE, [99], [1.0])])
    assert excinfo.value.position == 1
    assert m.calls == []
    assert same_bits(m.embed_tokens.weight.detach(), before)


def test_untied_models_keep_every_name(load, mk):
    m = TiedModel()
    m.lm_head.weight = torch.nn.Parameter(torch.zeros(SHAPE))  # untie
    load(m, [mk.sparse(CANON, SHAPE, [1], [7.0]), mk.sparse(ALIAS, SHAPE, [2], [9.0])])
    assert m.calls == [[CANON, ALIAS]]
    assert m.lm_head.weight.view(-1)[2].item() == 9.0


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_dropped_alias_whose_values_differ_is_named_in_a_warning(load, mk, kind):
    m = TiedModel()
    if kind == "dense":
        patches = [mk.dense(CANON, torch.ones(SHAPE)), mk.dense(ALIAS, torch.full(SHAPE, 2.0))]
    else:  # the same values at another index
        patches = [mk.sparse(CANON, SHAPE, [1], [7.0]), mk.sparse(ALIAS, SHAPE, [2], [7.0])]
    with pytest.warns(UserWarning) as caught:
        load(m, patches)
    (w,) = [w for w in caught if "tied alias" in str(w.message)]
    assert str(w.message).startswith(f"patch 1 ('{ALIAS}') is not loaded")
    assert "(patch 0)" in str(w.message)
    assert w.filename == __file__  # the caller's line, whatever the depth of the load


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_dropped_alias_reading_other_elements_of_the_same_memory_is_named_in_a_warning(
        load, Patch, kind):
    # the alias's values (or indices) start at the same address as the canonical patch's,
    # but read every other element: other numbers, however alike the two tensors look
    m = TiedModel()
    if kind == "dense":
        base = torch.arange(30.0)
        patches = [Patch(CANON, SHAPE, torch.float32, base[:15]),
                   Patch(ALIAS, SHAPE, torch.float32, base[::2])]
    else:
        base, values = torch.arange(8), torch.tensor([7.0, 8.0, 9.0, 10.0])
        patches = [Patch(CANON, SHAPE, torch.float32, values, base[:4]),
                   Patch(ALIAS, SHAPE, torch.float32, values, base[::2])]
    with pytest.warns(UserWarning, match=f"patch 1 \\('{ALIAS}'\\) is not loaded"):
        load(m, patches)
    assert m.calls == [[CANON]]


def test_a_dropped_alias_that_carries_the_canonical_values_loads_without_a_warning(load, mk):
    import warnings

    m = TiedModel()
    canon = mk.dense(CANON, torch.ones(SHAPE))
    equal = canon._replace(name=ALIAS, values=canon.values.double().clone())  # other tensor
    for alias in (canon._replace(name=ALIAS), equal):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load(m, [canon, alias])
    assert m.calls == [[CANON], [CANON]]


def test_tied_parts_split_alike_are_compared_part_for_part(load, monkeypatch):
    # each dropped alias part was compared with every canonical part until one matched,
    # after a scan of all patches: 1600 parts of each name took 7.7 s to plan
    import warnings

    import patchkit
    import patchkit.loader as pl

    compared = []
    same_content = pl._same_content
    monkeypatch.setattr(pl, "_same_content",
                        lambda a, b: compared.append(1) or same_content(a, b))
    m = TiedModel()
    values = torch.arange(15.0)
    canon = patchkit.CheckpointWeightPatch(CANON, SHAPE, torch.float32, values)
    parts = 5
    patches = (patchkit.split_patch(canon, parts)
               + patchkit.split_patch(canon._replace(name=ALIAS, values=values.clone()), parts))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (each alias part matches: no warning)
        load(m, patches)
    assert len(compared) == parts
    assert m.embed_tokens.weight.flatten().tolist() == values.tolist()


@pytest.mark.parametrize("observed", [False, True])
def test_a_report_warns_of_a_dropped_alias_once(mk, observed):
    import patchkit

    patches = [mk.sparse(CANON, SHAPE, [1], [7.0]), mk.sparse(ALIAS, SHAPE, [2], [9.0])]
    loader = patchkit.load_checkpoint_weight_patches if observed else None
    with pytest.warns(UserWarning) as caught:
        patchkit.inspect_load(TiedModel(), patches, loader=loader)
    assert sum("tied alias" in str(w.message) for w in caught) == 1


class HeadFirst(torch.nn.Module):
    """A tied embedding whose ``lm_head`` is registered first (so ``lm_head.weight`` is the
    canonical name), with vLLM's usual loader, which skips ``lm_head.weight`` when the
    embedding is tied: a patch of the embedding, renamed to ``lm_head.weight``, is not
    written."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
        self.embed_tokens = torch.nn.Embedding(*SHAPE)
        self.lm_head.weight = self.embed_tokens.weight
        self.skip = True

    def load_weights(self, weights):
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, w in weights:
            if name == ALIAS and self.skip:
                continue
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded


@pytest.mark.parametrize("report", [False, True])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_renamed_patch_the_loader_did_not_load_is_named_in_a_warning(load, mk, kind, report):
    import patchkit

    m = HeadFirst()
    before = m.embed_tokens.weight.detach().clone()
    patch = (mk.dense(CANON, torch.full(SHAPE, 2.0)) if kind == "dense"
             else mk.sparse(CANON, SHAPE, [0, 14], [-1.0, -2.0]))
    with pytest.warns(UserWarning) as caught:
        if report:
            patchkit.inspect_load(m, [patch])
        else:
            assert load(m, [patch]) == set()
    (w,) = [w for w in caught if "was sent as" in str(w.message)]
    assert str(w.message).startswith(f"patch 0 ('{CANON}') was sent as '{ALIAS}'")
    assert "returned no name of that Parameter" in str(w.message)
    assert w.filename == __file__  # the caller's line
    assert same_bits(m.embed_tokens.weight.detach(), before)  # (what the warning is about)


@pytest.mark.parametrize("report", [False, True])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_patch_whose_dropped_alias_the_loader_did_not_load_is_named_in_a_warning(
        load, mk, kind, report):
    # Both names sent with the same values (dense_patches of a tied model's state dict):
    # the embedding's patch is dropped as the alias of lm_head.weight, which this loader
    # skips, so nothing is written; the model's own loader, given both, writes it.
    import patchkit

    m = HeadFirst()
    before = m.embed_tokens.weight.detach().clone()
    if kind == "dense":
        patches = [mk.dense(n, torch.full(SHAPE, 2.0)) for n in (CANON, ALIAS)]
    else:
        patches = [mk.sparse(n, SHAPE, [0, 14], [-1.0, -2.0]) for n in (CANON, ALIAS)]
    with pytest.warns(UserWarning) as caught:
        if report:
            patchkit.inspect_load(m, patches)
        else:
            assert load(m, patches) == set()
    (w,) = [w for w in caught if "returned no name" in str(w.message)]
    assert str(w.message).startswith(
        f"patch 1 ('{ALIAS}') names the tied Parameter whose patch under '{CANON}' this "
        "load dropped")
    assert w.filename == __file__  # the caller's line
    assert not any("was sent as" in str(x.message) for x in caught)
    assert same_bits(m.embed_tokens.weight.detach(), before)  # (what the warning is about)


def test_a_patch_whose_dropped_alias_the_loader_loaded_raises_no_warning(load, mk):
    import warnings

    m = HeadFirst()
    m.skip = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(m, [mk.dense(n, torch.full(SHAPE, 2.0)) for n in (CANON, ALIAS)]) == {
            ALIAS}
    assert bool((m.embed_tokens.weight == 2.0).all())


def test_a_renamed_patch_is_checked_against_its_own_call_only(load, mk):
    # the alias's patch, renamed, is loaded by call 0; call 1 (the norm's) returns no name
    # of the tied Parameter, and that says nothing of a patch it did not carry
    import warnings

    m = TiedModel()
    patches = [mk.dense(ALIAS, torch.full(SHAPE, 2.0)), mk.dense("norm", torch.ones(3))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(m, patches, max_chunk_bytes=60) == {CANON, "norm"}
    assert m.calls == [[CANON], ["norm"]]


def test_a_renamed_patch_the_loader_loaded_raises_no_warning(load, mk):
    import warnings

    m = HeadFirst()
    m.skip = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(m, [mk.dense(CANON, torch.full(SHAPE, 2.0))]) == {ALIAS}
    assert bool((m.embed_tokens.weight == 2.0).all())
