"""Dry runs: a model on the meta device loads, and inspect_load reports where it wrote."""

from __future__ import annotations

import importlib.util
import pickle

import matplotlib
import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, load_checkpoint_weight_patches
from patchkit._regions import _storage_key
from patchkit.build import AdamLikeTrainer, dense_patches, sparse_patches_from_diff
from patchkit.toymodels import PlainModel, TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

META = torch.device("meta")
# Where a write landed: every column of ``writes`` but the counts.
PLACEMENT = ["chunk", "position", "name", "checkpoint_offset", "checkpoint_region", "target",
             "target_offset", "target_region", "shape", "elements", "op",
             "checkpoint_stride", "target_stride"]


@pytest.fixture(autouse=True)
def _headless():
    backend = matplotlib.get_backend()
    matplotlib.use("Agg")
    yield
    import matplotlib.pyplot as plt

    plt.close("all")
    matplotlib.use(backend)


def _on_meta(patches):
    return [p._replace(values=p.values.to(META),
                       indices=None if p.indices is None else p.indices.to(META))
            for p in patches]


@pytest.fixture(scope="module")
def steps():
    cfg = TinyLlamaConfig()
    start = tiny_llama_checkpoint(cfg, dtype=torch.bfloat16)
    step = AdamLikeTrainer(start, lr=1e-3).step()
    return cfg, start, {"dense": dense_patches(step),
                        "sparse": sparse_patches_from_diff(start, step)}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("meta_patches", [False, True])
def test_a_dry_run_places_every_write_where_the_real_load_does(steps, rank, kind, meta_patches):
    cfg, start, patches = steps
    real = TinyLlamaRuntime(cfg, tp_rank=rank, tp_size=2, dtype=torch.bfloat16)
    load_checkpoint_weight_patches(real, dense_patches(start))
    dry = TinyLlamaRuntime(cfg, tp_rank=rank, tp_size=2, dtype=torch.bfloat16, device=META)
    ps = patches[kind]
    ours = inspect_load(real, ps, max_chunk_bytes=8 << 10)
    theirs = inspect_load(dry, _on_meta(ps) if meta_patches else ps, max_chunk_bytes=8 << 10)
    assert len(ours.writes) > 10
    assert theirs.writes[PLACEMENT].equals(ours.writes[PLACEMENT])
    assert theirs.calls["names"].tolist() == ours.calls["names"].tolist()
    assert theirs.loaded == ours.loaded
    # what a tensor with no numbers cannot say
    assert theirs.writes["changed"].isna().all() and ours.writes["changed"].notna().all()
    if kind == "dense":
        assert theirs.writes["written"].equals(theirs.writes["elements"])
    else:
        assert theirs.writes["written"].isna().all()
    assert len(theirs.deltas) == 0 and len(ours.deltas) > 0
    assert theirs.dry_run and not ours.dry_run
    s = theirs.summary()
    assert s["elements written"] is None and s["elements changed"] is None
    targets = theirs.writes["target"].nunique()
    assert s["dry run"] == f"{targets} runtime tensors written on the meta device"
    assert "dry run" not in ours.summary()
    assert f"dry run={targets} runtime tensors" in repr(theirs)
    assert "elements changed" not in repr(theirs) and "dry run" in theirs._repr_html_()


def test_a_dry_run_has_no_values_to_show():
    m = PlainModel({"a": (4,), "b": (2, 3)}, device=META)
    r = inspect_load(m, [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(4))])
    assert r.dry_run and r.summary()["dry run"] == "1 runtime tensor written on the meta device"
    for target in ("a", "b"):  # written, and not
        for read in (r.before, r.after, r.written, r.plot_delta):
            with pytest.raises(ValueError, match=f"'{target}' is on the meta device"):
                read(target)
    fig = r.plot_placement()
    assert fig.axes and any(ax.patches for ax in fig.axes)
    r.plot_chunks()
    copy = pickle.loads(pickle.dumps(r))
    assert copy.dry_run and copy.summary() == r.summary()


def test_the_explorer_of_a_dry_run_says_why_it_draws_no_delta():
    pytest.importorskip("ipywidgets")  # (the notebooks extra: the rest runs without it)
    from patchkit.widgets import explore

    m = PlainModel({"a": (4,)}, device=META)
    r = inspect_load(m, [CheckpointWeightPatch("a", (4,), torch.float32, torch.ones(2),
                                               torch.tensor([0, 3]))])
    w = explore(r)
    w.dropdown.value = ("runtime", "a")
    text = "".join(o["text"] for o in w.output.outputs if o["output_type"] == "stream")
    assert "before/after figure: none, the tensor is on the meta device" in text
    assert "delta: none (on the meta device" in text
    assert "not drawn" not in text  # (no error stands in for a view)


@pytest.mark.parametrize("sparse", [False, True])
def test_a_transactional_dry_run_loads(sparse):
    m = PlainModel({"w": (4,)}, device=META)
    p = (CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([3.0]), torch.tensor([1]))
         if sparse else CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4)))
    assert load_checkpoint_weight_patches(m, [p], transactional=True) == {"w"}
    assert load_checkpoint_weight_patches(m, _on_meta([p]), transactional=True) == {"w"}


def test_meta_storages_are_told_apart():
    a, b = torch.empty(4, 4, device=META), torch.empty(4, 4, device=META)
    assert _storage_key(a) != _storage_key(b)
    assert _storage_key(a) == _storage_key(a[1:]) == _storage_key(a.t())
    # (and real ones by their address, as before)
    c = torch.zeros(4)
    assert _storage_key(c) == (c.device, c.untyped_storage().data_ptr())


def test_observing_a_loader_on_a_meta_model():
    cfg = TinyLlamaConfig()
    ps = dense_patches(tiny_llama_checkpoint(cfg, dtype=torch.bfloat16))
    real = TinyLlamaRuntime(cfg, tp_rank=1, tp_size=2, dtype=torch.bfloat16)
    dry = TinyLlamaRuntime(cfg, tp_rank=1, tp_size=2, dtype=torch.bfloat16, device=META)
    ours = inspect_load(real, ps, loader=patchkit.load_checkpoint_weight_patches)
    theirs = inspect_load(dry, _on_meta(ps), loader=patchkit.load_checkpoint_weight_patches)
    assert theirs.dry_run
    assert theirs.writes[PLACEMENT].equals(ours.writes[PLACEMENT])


def test_the_placement_of_a_sparse_dry_run_counts_views_not_writes():
    m = PlainModel({"a": (4, 4)}, device=META)
    p = CheckpointWeightPatch("a", (4, 4), torch.float32, torch.ones(2), torch.tensor([0, 5]))
    fig = inspect_load(m, [p]).plot_placement()
    titles = [ax.get_title() for ax in fig.axes]
    assert any("1 write into 16 elements of its view" in t for t in titles), titles
    assert not any("elements written" in t for t in titles)


@pytest.mark.parametrize("meta_patches", [False, True])
def test_observing_a_loader_of_sparse_patches_on_a_meta_model(meta_patches):
    m = PlainModel({"a": (4, 4)}, device=META)
    ps = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.ones(2), torch.tensor([0, 5]))]
    r = inspect_load(m, _on_meta(ps) if meta_patches else ps,
                     loader=patchkit.load_checkpoint_weight_patches)
    assert r.error is None and r.dry_run
    assert r.writes["target_region"].tolist() == ["[:, :]"]
    assert r.writes["changed"].isna().all() and r.writes["written"].isna().all()


def test_a_foreach_copy_into_a_real_and_a_meta_tensor_counts_neither():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.b = torch.nn.Parameter(torch.zeros(4, device=META), requires_grad=False)

        def load_weights(self, weights):
            ws = dict(weights)
            torch._foreach_copy_([self.a, self.b], [ws["a"], ws["b"]])
            return set(ws)

    ps = [CheckpointWeightPatch(n, (4,), torch.float32, torch.ones(4)) for n in "ab"]
    r = inspect_load(Mixed(), ps)
    assert r.error is None and r.dry_run
    assert sorted(r.writes["target"]) == ["a", "b"] and r.writes["changed"].isna().all()


class _Rebinding(PlainModel):
    def load_one(self, name, param, w):
        param.data = w.clone()


class _Registering(PlainModel):
    def load_one(self, name, param, w):
        module, attr = name.rsplit(".", 1) if "." in name else ("", name)
        setattr(self.get_submodule(module), attr,
                torch.nn.Parameter(w.clone(), requires_grad=False))


# (param.data = w of a CPU tensor into a meta parameter is refused by torch itself)
@pytest.mark.parametrize(("cls", "meta_patches"),
                         [(_Rebinding, True), (_Registering, False), (_Registering, True)])
def test_a_dry_run_records_a_loader_that_swaps_in_new_tensors(cls, meta_patches):
    # (on the meta device every address is 0: param.data = w was seen as no change, and
    # a new Parameter crashed the report on counting changes between meta tensors)
    shapes = {"a.weight": (4, 3), "b": (5,)}
    patches = [CheckpointWeightPatch(n, s, torch.float32, torch.ones(torch.Size(s).numel()))
               for n, s in shapes.items()]
    real = inspect_load(cls(shapes), patches)
    with torch.device("meta"):
        model = cls(shapes)
    report = inspect_load(model, _on_meta(patches) if meta_patches else patches)
    want = real.writes[["target", "op", "elements"]].values.tolist()
    assert sorted(want) == [["a.weight", "rebind", 12], ["b", "rebind", 5]]
    assert report.writes[["target", "op", "elements"]].values.tolist() == want
    assert report.dry_run and report.writes["changed"].isna().all()
    assert report.deltas.empty and report.summary()["elements written"] is None
    if meta_patches:  # (the model stays on the meta device)
        with pytest.raises(ValueError, match=r"'a\.weight' is on the meta device"):
            report.before("a.weight")
    else:  # (a loader that materialises it: real tensors now, none before)
        assert report.summary()["dry run"] == "2 meta tensors each replaced by a tensor with memory"
        for read in (report.before, report.plot_delta):
            with pytest.raises(ValueError, match=r"'a\.weight' was on the meta device before"):
                read("a.weight")
        assert report.after("a.weight").eq(1).all() and report.written("a.weight").all()
        if importlib.util.find_spec("ipywidgets") is not None:
            from patchkit.widgets import explore

            # (the explorer said only "report.deltas has no row for it")
            w = explore(report)
            w.dropdown.value = ("runtime", "a.weight")
            text = "".join(o.get("text", "") for o in w.output.outputs)
            assert "delta: none (on the meta device before the load" in text
    assert report.plot_placement().axes


def test_a_dropped_alias_patch_of_a_dry_run_is_not_said_to_differ():
    # a tied alias patch whose values sit on the meta device (or beside a meta one) was
    # said to carry values that "differ" from the canonical patch's: nothing was compared
    import warnings

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
            self.b = self.a

        def load_weights(self, weights):
            for n, w in weights:
                getattr(self, n).data.copy_(w.reshape(2, 3))
            return {n for n, _ in weights}

    with torch.device("meta"):
        model = Tied()
    a = CheckpointWeightPatch("a", (2, 3), torch.float32, torch.ones(6, device="meta"))
    for b_values in (torch.ones(6), torch.ones(6, device="meta")):
        b = CheckpointWeightPatch("b", (2, 3), torch.float32, b_values)
        with pytest.warns(UserWarning, match="could not be compared with those") as caught:
            load_checkpoint_weight_patches(model, [a, b])
        assert not any("differ" in str(w.message) for w in caught)
    # (real values on the CPU are compared as before: equal ones load without a word)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        real = Tied()
        a, b = (CheckpointWeightPatch(n, (2, 3), torch.float32, torch.ones(6)) for n in "ab")
        assert load_checkpoint_weight_patches(real, [a, b]) == {"a"}


@pytest.mark.parametrize("transactional", [False, True])
def test_meta_indices_beside_real_values_are_refused_before_the_first_call(transactional):
    # Staged on the values' device, such a patch needs positions its indices do not
    # hold: it passed validation, an earlier call wrote the model's real tensor, and its
    # staging then failed with torch's bare "Cannot copy out of meta tensor".
    class PartlyMeta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.real = torch.nn.Parameter(torch.zeros(4))
            self.m = torch.nn.Parameter(torch.empty(2, 4, device=META))
            self.calls = 0

        def load_weights(self, weights):
            self.calls += 1
            for name, t in weights:
                getattr(self, name).copy_(t)
            return {name for name, _ in weights}

    model = PartlyMeta()
    patches = [
        CheckpointWeightPatch("real", (4,), torch.float32, torch.ones(1), torch.tensor([1])),
        CheckpointWeightPatch("m", (2, 4), torch.float32, torch.ones(2),
                              torch.tensor([1, 6], device=META)),
    ]
    with pytest.raises(patchkit.PatchValueError, match=r"^patch 1 \('m'\): indices are on "
                       "the meta device.*values are on cpu") as e:
        load_checkpoint_weight_patches(model, patches, max_chunk_bytes=16,
                                       transactional=transactional)
    assert (e.value.position, e.value.reason, e.value.value) == (1, "meta device", META)
    assert model.calls == 0 and model.real.tolist() == [0.0] * 4
    with pytest.raises(patchkit.PatchValueError, match="indices are on the meta device"):
        patchkit.stage(patches[1])
    # meta values beside real indices stage on the meta device, as a dry run does
    ok = patches[1]._replace(values=torch.ones(2, device=META),
                             indices=torch.tensor([1, 6]))
    assert load_checkpoint_weight_patches(model, [ok]) == {"m"}
