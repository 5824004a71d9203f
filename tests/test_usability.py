"""What a new user meets first: the errors, warnings and help texts of everyday mistakes
(from a review that used patchkit as a newcomer would, 2026-12-06)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit.patch import validate_patches
from patchkit.toymodels import PlainModel


@pytest.mark.parametrize("inspect", [False, True])
def test_a_patch_whose_staging_runs_out_of_memory_is_named_in_the_error(inspect):
    m = PlainModel({"a": (4,), "b": (4,)}, device="cpu")
    good = CWP("a", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    # a shape mistyped by orders of magnitude: 1 PiB staged, past any address space
    huge = CWP("b", (2**24, 2**24), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    load = patchkit.inspect_load if inspect else patchkit.load_checkpoint_weight_patches
    with pytest.raises(RuntimeError) as info:
        load(m, [good, huge], max_chunk_bytes=16)
    (note,) = info.value.__notes__
    assert note == ("(raised staging patch 1 ('b') for load_weights call 1, before that "
                    "call: a sparse patch of shape (16777216, 16777216) torch.float32 "
                    "stages 1 PiB)")
    assert m.a.tolist() == [1.0, 0.0, 0.0, 0.0]  # (call 0 ran; not transactional)
    if inspect:
        assert info.value.report.calls["names"].tolist() == [("a",)]


def test_the_out_of_memory_note_of_a_shape_of_many_dims_is_short():
    # 1000 ones and 50 twos: 4 PiB staged, and a shape that printed whole is 3 kB
    m = PlainModel({"b": (4,)}, device="cpu")
    huge = CWP("b", (1,) * 1000 + (2,) * 50, torch.float32, torch.tensor([1.0]),
               torch.tensor([0]))
    with pytest.raises(RuntimeError) as info:
        patchkit.load_checkpoint_weight_patches(m, [huge])
    (note,) = info.value.__notes__
    assert "(1, 1, 1, 1, 1, 1, 1, ..., 2; 1050 dims) torch.float32 stages 4 PiB)" in note
    assert len(note) < 300


class _KnowsOnly(PlainModel):
    """A model's own loader, strict as most are: a name it lacks is its own KeyError, and
    a shape it cannot take torch's RuntimeError; neither names the call or the patches."""

    def load_weights(self, weights):
        for name, w in weights:
            self._parameters[name].data.copy_(w)  # (KeyError for an unknown name)
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["dense", "sparse", "transactional", "inspect"])
def test_an_error_of_the_models_own_loader_is_noted_with_the_call_and_its_patches(how):
    m = _KnowsOnly({"a": (16,), **{n: (2,) for n in "bcdef"}}, device="cpu")
    sparse = how == "sparse"

    def patch(name, n=2):
        n = 16 if name == "a" else n
        return (CWP(name, (n,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
                if sparse else CWP(name, (n,), torch.float32, torch.ones(n)))

    # a budget of 64 B: call 0: a; call 1: b, c, the misspelt "dd", d, e, f; call 2: a again
    ps = [patch(n) for n in ("a", "b", "c", "dd", "d", "e", "f", "a")]
    load = patchkit.inspect_load if how == "inspect" else patchkit.load_checkpoint_weight_patches
    kw = {"transactional": True} if how == "transactional" else {}
    with pytest.raises(KeyError, match="dd") as info:
        load(m, ps, max_chunk_bytes=64, **kw)
    assert info.value.__notes__ == [
        "(raised in load_weights call 1, sent patch 1 ('b'), patch 2 ('c'), patch 3 ('dd'), "
        "patch 4 ('d'), patch 5 ('e'), and 1 more)"]
    assert info.value.args == ("dd",)  # (the error itself as the loader raised it)
    # A call of one patch; torch's shape error
    # (a sparse load refuses that copy itself, before torch sees it: patchkit's own error,
    # which names its patch, and no note)
    m = _KnowsOnly({"a": (16,), "b": (2, 3)}, device="cpu")
    with pytest.raises(patchkit.ContractViolation if sparse else RuntimeError) as info:
        load(m, [patch("a"), patch("b")], max_chunk_bytes=64, **kw)
    assert getattr(info.value, "__notes__", []) == (
        [] if sparse else ["(raised in load_weights call 1, sent patch 1 ('b'))"])


def test_patchkits_own_errors_from_inside_a_call_get_no_note_of_the_call():
    # (they name their patch already: a return value outside the contract, here)
    class ReturnsANumber(PlainModel):
        def load_weights(self, weights):
            return 7

    with pytest.raises(patchkit.ContractViolation) as info:
        patchkit.load_checkpoint_weight_patches(
            ReturnsANumber({"a": (4,)}, device="cpu"),
            [CWP("a", (4,), torch.float32, torch.ones(4))])
    assert not getattr(info.value, "__notes__", [])


class _FailsOn(PlainModel):
    """A loader that takes a weak reference to every tensor it is sent, copies them in
    order and fails at ``"c"``: raising its own ``KeyError`` there (``how="raise"``), or
    writing it with ``add_``, which a sparse load refuses inside the call
    (``how="refused"``); or copies them all and returns a number, which patchkit refuses
    once it has returned (``how="returns"``)."""

    def __init__(self, shapes, how):
        super().__init__(shapes, device="cpu")
        self.how, self.refs = how, []

    def load_weights(self, weights):
        self.refs += [weakref.ref(w) for _, w in weights]
        for name, w in weights:
            if name == "c" and self.how == "raise":
                raise KeyError(name)
            if name == "c" and self.how == "refused":
                self._parameters[name].data.add_(w)
            self._parameters[name].data.copy_(w)
        return 7 if self.how == "returns" else {n for n, _ in weights}


@pytest.mark.parametrize(("kind", "how"), [
    ("sparse", "raise"), ("sparse", "refused"), ("sparse", "returns"),
    ("dense cast", "raise"), ("dense cast", "returns"),  # (a dense load allows add_)
    ("transactional", "raise"), ("transactional", "refused"),
    ("inspect", "raise"), ("inspect", "refused"),
])
def test_a_kept_error_of_a_failed_call_does_not_keep_its_staged_tensors(kind, how):
    # Jupyter keeps the last error and its traceback, whose frames (patchkit's and the
    # loader's) held the list patchkit passed to load_weights and so every tensor staged
    # for the call (up to max_chunk_bytes of fresh memory, a GPU's on a GPU)
    m = _FailsOn({"a": (64,), "b": (64,), "c": (64,), "d": (64,)}, how)
    if kind == "dense cast":  # (a cast staged as a copy patchkit made)
        ps = [CWP(n, (64,), torch.float32, torch.ones(64, dtype=torch.float64)) for n in "abcd"]
    else:
        ps = [CWP(n, (64,), torch.float32, torch.tensor([1.0]), torch.tensor([3]))
              for n in "abcd"]
    load = patchkit.inspect_load if kind == "inspect" else patchkit.load_checkpoint_weight_patches
    kw = {"transactional": True} if kind == "transactional" else {}
    try:
        load(m, ps, **kw)
    except (KeyError, patchkit.ContractViolation) as exc:
        kept = exc  # (as sys.last_value keeps it)
    gc.collect()
    # (what the loader's own frame holds stays: the entry it failed at, its w)
    alive = [n for n, r in zip("abcd", m.refs) if r() is not None]
    assert alive == ([] if how == "returns" else ["c"])
    assert type(kept) is (KeyError if how == "raise" else patchkit.ContractViolation)
    # (a post-mortem debugger still walks patchkit's frames and the loader's)
    tb, frames = kept.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert {"run_load", "_called"} <= set(frames)
    assert ("load_weights" in frames) == (how != "returns")
    if how == "raise":
        assert kept.__notes__ == [
            "(raised in load_weights call 0, sent patch 0 ('a'), patch 1 ('b'), patch 2 "
            "('c'), patch 3 ('d'))"]
    for p in ps:  # (the caller's patches are left as they were)
        assert p.values.tolist() == ([1.0] * 64 if kind == "dense cast" else [1.0])


@pytest.mark.parametrize("how", ["raise", "refused"])
def test_a_kept_error_of_an_observed_load_does_not_keep_its_staged_tensors(how):
    # inspect_load(loader=...) passes the model a copy of each call's list and watches
    # its entries: both were left in the wrapper's frame, which the kept error's
    # traceback holds, so every tensor of the failed call stayed alive (all four here)
    m = _FailsOn({"a": (64,), "b": (64,), "c": (64,), "d": (64,)}, how)
    ps = [CWP(n, (64,), torch.float32, torch.tensor([1.0]), torch.tensor([3])) for n in "abcd"]
    try:
        patchkit.inspect_load(m, ps, loader=patchkit.load_checkpoint_weight_patches)
    except (KeyError, patchkit.ContractViolation) as exc:
        kept = exc
    gc.collect()
    assert [n for n, r in zip("abcd", m.refs) if r() is not None] == ["c"]
    assert type(kept) is (KeyError if how == "raise" else patchkit.ContractViolation)
    assert kept.report.calls["error"].tolist() == [True]
    assert [p.values.tolist() for p in ps] == [[1.0]] * 4


@pytest.mark.parametrize("loader", [None, patchkit.load_checkpoint_weight_patches])
def test_a_failed_load_passed_the_last_report_does_not_keep_it(loader):
    # A loop that passes each step's report on (reuse=) and keeps the report a failed
    # load attaches to its error: inspect_load's frame, in that error's traceback, held
    # the report passed as reuse=, so each failed step kept the one before it, its
    # patches and its own failed predecessor: a chain that grew by one report a step
    m = _FailsOn({"a": (64,), "b": (64,), "c": (64,), "d": (64,)}, "raise")
    report, refs = None, []
    for step in range(4):
        ps = [CWP(n, (64,), torch.float32, torch.tensor([float(step)]), torch.tensor([3]))
              for n in "abcd"]
        try:
            report = patchkit.inspect_load(m, ps, reuse=report, transactional=True,
                                           loader=loader)
        except KeyError as exc:
            report = exc.report
        refs.append((weakref.ref(report), weakref.ref(ps[0].values)))
        del ps
    gc.collect()
    assert report.rolled_back and report.handed_over is False
    assert [r() is not None for r, _ in refs] == [False, False, False, True]
    assert [v() is not None for _, v in refs] == [False, False, False, True]


def test_an_observed_call_whose_error_the_loader_caught_keeps_its_list():
    # a model that keeps the list it is sent and writes it in its next call, and a
    # loader that catches the first call's error and goes on: the load does not fail,
    # so the list the model kept is left as it was sent
    class Deferred(PlainModel):
        pending: tuple | list = ()

        def load_weights(self, weights):
            for name, w in self.pending:
                self._parameters[name].data.copy_(w)
            self.pending = weights
            if not self.pending:
                return set()
            raise KeyError("later")

    def loader(model, patches, **kwargs):
        with pytest.raises(KeyError):
            model.load_weights([(p.name, p.values) for p in patches])
        model.load_weights([])
        return {p.name for p in patches}

    m = Deferred({"a": (4,)}, device="cpu")
    patchkit.inspect_load(m, [CWP("a", (4,), torch.float32, torch.full((4,), 2.0))],
                          loader=loader)
    assert m.a.tolist() == [2.0] * 4


def _watched_staging(monkeypatch, stop: type[BaseException] | None = None) -> list:
    """Weak references to the tensors the loader stages from now on (``_stage``
    monkeypatched), the list they are added to; with ``stop``, the staging of patch "c"
    raises it."""
    from patchkit import loader

    staged = []
    stage_as_before = loader._stage

    def stage(patch):
        if stop is not None and patch.name == "c":
            raise stop
        t = stage_as_before(patch)
        staged.append(weakref.ref(t))
        return t

    monkeypatch.setattr(loader, "_stage", stage)
    return staged


def test_a_kept_error_of_a_failed_staging_does_not_keep_the_calls_tensors_staged_before(
        monkeypatch):
    staged = _watched_staging(monkeypatch)
    m = PlainModel({"a": (64,), "b": (64,), "c": (4,)}, device="cpu")
    ps = [CWP(n, (64,), torch.float32, torch.tensor([1.0]), torch.tensor([0])) for n in "ab"]
    # a shape mistyped by orders of magnitude: 1 PiB staged, past any address space
    ps.append(CWP("c", (2**24, 2**24), torch.float32, torch.tensor([1.0]), torch.tensor([0])))
    try:
        patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=2**60)
    except RuntimeError as exc:
        kept = exc
    gc.collect()
    assert len(staged) == 2 and [r() for r in staged] == [None, None]
    assert kept.__traceback__ is not None
    assert m.a.tolist() == [0.0] * 64  # (no call was made)


def test_a_failed_staging_leaves_the_list_an_earlier_call_was_sent():
    # a model that keeps the list it is sent for later: only the failed call's own list
    # (here: none, its staging failed) is emptied, not the one the call before was sent
    class Keeps(PlainModel):
        kept: tuple | list = ()

        def load_weights(self, weights):
            self.kept = weights
            return super().load_weights(weights)

    m = Keeps({"a": (4,), "c": (4,)}, device="cpu")
    ps = [CWP("a", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0])),
          CWP("c", (2**24, 2**24), torch.float32, torch.tensor([1.0]), torch.tensor([0]))]
    with pytest.raises(RuntimeError, match=r"petabyte|memory|alloc"):
        patchkit.load_checkpoint_weight_patches(m, ps, max_chunk_bytes=16)
    assert [n for n, _ in m.kept] == ["a"] and m.a.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_ctrl_c_while_staging_frees_the_calls_tensors_and_gets_no_staging_note(monkeypatch):
    staged = _watched_staging(monkeypatch, KeyboardInterrupt)
    m = PlainModel({"a": (64,), "b": (64,), "c": (4,)}, device="cpu")
    ps = [CWP(n, (64,), torch.float32, torch.tensor([1.0]), torch.tensor([0])) for n in "ab"]
    ps.append(CWP("c", (4,), torch.float32, torch.tensor([1.0]), torch.tensor([0])))
    try:
        patchkit.load_checkpoint_weight_patches(m, ps)
    except KeyboardInterrupt as exc:
        kept = exc
    gc.collect()
    assert len(staged) == 2 and [r() for r in staged] == [None, None]
    assert not getattr(kept, "__notes__", [])  # (the note is for a staging out of memory)


@pytest.fixture(scope="module")
def tp_report():
    from patchkit.build import dense_patches
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    cfg = TinyLlamaConfig()
    model = TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2)
    return patchkit.inspect_load(model, dense_patches(tiny_llama_checkpoint(cfg)))


K = "model.layers.0.self_attn.k_proj.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize("call", ["before", "after", "written", "plot_delta", "plot_placement"])
def test_a_checkpoint_name_where_a_runtime_one_belongs_says_where_it_went(tp_report, call):
    pytest.importorskip("matplotlib")
    fn = getattr(tp_report, call)
    with pytest.raises(KeyError) as info:
        fn([K]) if call == "plot_placement" else fn(K)
    assert isinstance(info.value, patchkit.inspect.ReportKeyError)
    # (printed as written: no quotes around the message, as KeyError's own str gives)
    assert str(info.value) == (
        f"{K!r} is not a runtime tensor of this report: it is a checkpoint name (a "
        f"patch's), and its writes went to the runtime tensor {QKV!r} (report.writes "
        "says where)")


def test_an_unknown_name_lists_some_known_ones(tp_report):
    with pytest.raises(KeyError, match=r"^'nope' is not a runtime tensor of this report "
                       r"\(some are: 'model.embed_tokens.weight', "):
        tp_report.after("nope")


def test_a_runtime_name_given_to_plot_density_points_to_plot_delta(tp_report):
    pytest.importorskip("matplotlib")
    with pytest.raises(KeyError, match=r"^no patch named .*qkv_proj.weight' in this report: "
                       r"it is a runtime tensor's name; report.plot_delta\(name\)"):
        tp_report.plot_density(QKV)


def test_plot_chunks_and_the_planner_given_a_state_dict_say_how_to_make_patches():
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipywidgets")
    from patchkit.plot import plot_chunks
    from patchkit.widgets import chunk_planner

    for fn in (plot_chunks, chunk_planner):
        with pytest.raises(TypeError, match=r"got dict: .*\(a state dict\? "
                           r"patchkit.build.dense_patches makes patches of one\)") as info:
            fn({"a": torch.zeros(3)})
        assert isinstance(info.value, patchkit.PatchTypeError)


@pytest.mark.parametrize("transactional", [False, True])
def test_an_observed_loader_that_cannot_take_the_call_is_refused_before_it_runs(transactional):
    m = PlainModel({"a": (4,)}, device="cpu")
    ran = []

    def two_args(model, patches, transactional=False):
        ran.append(1)

    patch = CWP("a", (4,), torch.float32, torch.ones(4))
    with pytest.raises(patchkit.PatchTypeError, match=(
            r"loader .*two_args cannot take the call inspect_load makes, loader\(model, "
            r"patches, max_chunk_bytes=\.\.\., validate_unique_indices=\.\.\.(, "
            r"transactional=\.\.\.)?\) .*unexpected keyword argument 'max_chunk_bytes'")):
        patchkit.inspect_load(m, [patch], loader=two_args, transactional=transactional)
    assert not ran and m.a.tolist() == [0.0] * 4

    def any_keywords(model, patches, **kw):
        ran.append(kw)

    patchkit.inspect_load(m, [patch], loader=any_keywords, transactional=transactional)
    assert len(ran) == 1


def test_a_report_built_by_hand_says_it_has_no_tables():
    r = patchkit.LoadReport([], [])
    assert repr(r) == "LoadReport(<not made by inspect_load: no tables>, 0 patches)"
    assert r._repr_html_() == (
        "<pre>LoadReport(&lt;not made by inspect_load: no tables&gt;, 0 patches)</pre>")
    one = patchkit.LoadReport([CWP("w", (2,), torch.float32, torch.ones(2))], [])
    assert repr(one) == "LoadReport(<not made by inspect_load: no tables>, 1 patch)"
    for read in (r.summary, lambda: r.writes, lambda: r.deltas):
        with pytest.raises(ValueError, match=r"has no (chunks|writes|deltas) table: it was "
                           r"not made by patchkit\.inspect_load"):
            read()
    # a report of a load of nothing is made by a load: it has (empty) tables
    empty = patchkit.inspect_load(PlainModel({"a": (4,)}, device="cpu"), [])
    assert len(empty.writes) == 0 and "not made" not in repr(empty)


@pytest.mark.parametrize(("shape", "density", "pattern", "text"), [
    ((64,), 0.3, "rows", "density 0.3 of 1 row rounds to no rows"),
    ((16,), 0.3, "blocks", "density 0.3 of 1 block rounds to no blocks"),
    ((4, 4), 0.1, "rows", "density 0.1 of 4 rows rounds to no rows"),
])
def test_a_random_patch_that_rounds_to_nothing_warns(shape, density, pattern, text):
    with pytest.warns(UserWarning) as seen:
        p = patchkit.random_sparse_patch("w", shape, torch.float32, density, pattern=pattern)
    assert p.values.numel() == 0
    assert [str(w.message) for w in seen] == [
        f"random_sparse_patch('w'): {text}: the patch is empty (pattern='uniform' picks "
        "single elements)"]
    # a density that picks something: no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patchkit.random_sparse_patch("w", (64, 64), torch.float32, 0.5,
                                            pattern=pattern).values.numel() > 0


def test_a_nan_value_is_named_by_its_index_and_its_entry_in_values():
    m = PlainModel({"w": (8,)}, device="cpu")
    # index 2 at entries 0 and 2 (the NaN is the second); the checkpoint index alone
    # would not say which entry of values holds it
    p = CWP("w", (8,), torch.float32, torch.tensor([1.0, 2.0, float("nan")]),
            torch.tensor([2, 6, 5]))
    with pytest.raises(ValueError, match=r"^patch 0 \('w'\): NaN value at index 5, "
                       r"values\[2\] \(NaN means 'unchanged'"):
        patchkit.load_checkpoint_weight_patches(m, [p])
    cast = CWP("w", (8,), torch.float8_e4m3fnuz, torch.tensor([1.0, 1e6]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"NaN value at index 3, values\[1\]: 1000000\.0 "
                       r"becomes NaN when cast to torch\.float8_e4m3fnuz"):
        validate_patches([cast])


def test_help_shows_the_patch_fields_types_and_each_tables_columns(tp_report):
    import inspect as pyinspect
    import re

    assert str(pyinspect.signature(CWP)) == (
        "(name: str, shape: tuple[int, ...], dtype: torch.dtype, values: torch.Tensor, "
        "indices: torch.Tensor | None = None)")
    for table in ("chunks", "calls", "writes", "deltas"):
        doc = getattr(patchkit.LoadReport, table).__doc__
        named = set(re.findall(r"[a-z_0-9]+", doc))
        assert set(getattr(tp_report, table).columns) <= named, table


class _AssertsLikeVllm(PlainModel):
    """A loader whose parameters' ``weight_loader(param, loaded_weight)`` asserts the shape
    as vLLM's do: the message gives both shapes and no name."""

    def load_weights(self, weights):
        for name, w in weights:
            self._load_one(self._parameters[name], w)
        return {n for n, _ in weights}

    @staticmethod
    def _load_one(param, loaded_weight):
        assert param.shape == loaded_weight.shape, (
            f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
        param.data.copy_(loaded_weight)


@pytest.mark.parametrize("how", ["dense", "sparse", "transactional", "inspect", "one buffer"])
def test_a_models_error_that_names_no_weight_is_noted_with_the_patch_it_was_loading(how):
    # A trainer's patch with a wrong shape on one rank, in a call of eight: the model's
    # message gives shapes only, and the note named the call's first five patches, not
    # the sixth that failed
    names = [f"w{i}" for i in range(8)]
    m = _AssertsLikeVllm({n: (4, 6) for n in names}, device="cpu")
    shapes = [(6, 4) if n == "w6" else (4, 6) for n in names]
    if how == "sparse":
        ps = [CWP(n, s, torch.float32, torch.tensor([1.0]), torch.tensor([5]))
              for n, s in zip(names, shapes)]
    elif how == "one buffer":  # (dense patches that are views of one received buffer)
        flat = torch.arange(8 * 24, dtype=torch.float32)
        ps = [CWP(n, s, torch.float32, flat[24 * i: 24 * (i + 1)])
              for i, (n, s) in enumerate(zip(names, shapes))]
    else:
        ps = [CWP(n, s, torch.float32, torch.ones(24)) for n, s in zip(names, shapes)]
    load = patchkit.inspect_load if how == "inspect" else patchkit.load_checkpoint_weight_patches
    kw = {"transactional": True} if how == "transactional" else {}
    with pytest.raises(AssertionError, match=r"load weight \(torch.Size\(\[6, 4\]") as info:
        load(m, ps, **kw)
    assert info.value.__notes__ == [
        "(raised in load_weights call 0 at patch 6 ('w6'); sent patch 0 ('w0'), patch 1 "
        "('w1'), patch 2 ('w2'), patch 3 ('w3'), patch 4 ('w4'), and 3 more)"]


class _ChecksAfterItsLoop(PlainModel):
    """Loads every entry, then raises: its loop's ``w`` still holds the last entry, and
    ``_fuse`` was handed two entries' tensors; neither is the patch at fault."""

    def __init__(self, shapes, how):
        super().__init__(shapes, device="cpu")
        self.how = how

    def load_weights(self, weights):
        for name, w in weights:
            self._parameters[name].data.copy_(w)
        if self.how == "after":
            self._check_all_present()
        else:
            self._fuse([w for _, w in weights[:2]])
        return {n for n, _ in weights}

    def _check_all_present(self):
        raise RuntimeError("a fused weight lacks a part")

    @staticmethod
    def _fuse(parts):
        raise RuntimeError("cannot fuse")


@pytest.mark.parametrize("how", ["after", "two"])
def test_a_models_error_not_at_one_patch_is_noted_without_one(how):
    m = _ChecksAfterItsLoop({"a": (4,), "b": (4,), "c": (4,)}, how)
    ps = [CWP(n, (4,), torch.float32, torch.ones(4)) for n in "abc"]
    with pytest.raises(RuntimeError) as info:
        patchkit.load_checkpoint_weight_patches(m, ps)
    assert info.value.__notes__ == [
        "(raised in load_weights call 0, sent patch 0 ('a'), patch 1 ('b'), patch 2 ('c'))"]


class _Unreadable:
    """An argument whose ``__class__`` raises (a lazy proxy's, a mock's): ``isinstance``
    on it raises too."""

    @property
    def __class__(self):  # type: ignore[override]
        raise RuntimeError("a proxy of nothing yet")


class _UnreadableList(list):
    def __iter__(self):
        raise RuntimeError("not iterable yet")


def _a_then_b_of_a_wrong_shape():
    """Two patches for a model of 4-element ``a`` and ``b``: ``b``'s shape is (2, 2)."""
    return [CWP("a", (4,), torch.float32, torch.ones(4)),
            CWP("b", (2, 2), torch.float32, torch.ones(4))]


@pytest.mark.parametrize("extra", [_Unreadable, _UnreadableList])
def test_a_models_error_stays_its_own_where_an_argument_cannot_be_read(extra):
    # (was: the search for the patch at fault read each argument of the traceback's frames,
    # and one whose __class__ or iteration raised replaced the model's AssertionError by
    # that RuntimeError, with no note)
    class Model(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                self._load_one(self._parameters[name], w, extra())
            return {n for n, _ in weights}

        @staticmethod
        def _load_one(param, loaded_weight, proxy):
            assert param.shape == loaded_weight.shape, "shapes differ"
            param.data.copy_(loaded_weight)

    m = Model({"a": (4,), "b": (4,)}, device="cpu")
    ps = _a_then_b_of_a_wrong_shape()
    with pytest.raises(AssertionError, match="shapes differ") as info:
        patchkit.load_checkpoint_weight_patches(m, ps)
    assert info.value.__notes__ == [
        "(raised in load_weights call 0 at patch 1 ('b'); sent patch 0 ('a'), patch 1 ('b'))"]


@pytest.mark.parametrize("shapes", [((0,), (0, 3)), ((0,), (4,))], ids=["all empty", "one"])
def test_the_patch_at_fault_is_found_past_empty_patches_or_left_out(shapes):
    # an empty staged tensor has no memory to find in a frame: with every one empty the
    # note names no patch at fault; one that is not is still found
    class Model(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                self._load_one(name, self._parameters[name], w)
            return {n for n, _ in weights}

        @staticmethod
        def _load_one(name, param, loaded_weight):
            if name == "w":
                raise ValueError("refused")

    m = Model({"e": shapes[0], "w": shapes[1]}, device="cpu")
    ps = [CWP("e", shapes[0], torch.float32, torch.ones(0)),
          CWP("w", shapes[1], torch.float32, torch.ones(4 if shapes[1] == (4,) else 0))]
    with pytest.raises(ValueError, match="refused") as info:
        patchkit.load_checkpoint_weight_patches(m, ps)
    at = " at patch 1 ('w');" if shapes[1] == (4,) else ","
    assert info.value.__notes__ == [
        f"(raised in load_weights call 0{at} sent patch 0 ('e'), patch 1 ('w'))"]


def test_a_models_error_stays_its_own_where_the_search_for_its_patch_fails(monkeypatch):
    # (the search reads frames and tensors it does not own: whatever it raises, the model's
    # error leaves the load as raised, with the note of the call, only not of the patch)
    import patchkit.loader as loader

    def broken(exc, staged):
        raise RuntimeError("the search failed")

    monkeypatch.setattr(loader, "_patch_at_fault", broken)
    m = PlainModel({"a": (4,), "b": (4,)}, device="cpu")
    ps = _a_then_b_of_a_wrong_shape()
    with pytest.raises(ValueError, match="'b' has shape") as info:
        patchkit.load_checkpoint_weight_patches(m, ps)
    assert info.value.__notes__ == [
        "(raised in load_weights call 0, sent patch 0 ('a'), patch 1 ('b'))"]


class _LoadsThrough(PlainModel):
    """Loads each entry through a helper that hands its tensor on as ``how`` says; the
    helper raises on entry ``bad``."""

    def __init__(self, shapes, how):
        super().__init__(shapes, device="cpu")
        self.how = how

    def load_weights(self, weights):
        done = []
        for name, w in weights:
            param = self._parameters[name]
            if self.how == "varargs":
                self._check(param, w)
            elif self.how == "list":
                self._check_parts(param, [w])
            elif self.how == "fused at the last":  # (handed one entry, fails on two)
                self._done = done
                self._last(param, w) if len(done) == len(weights) - 1 else None
            else:  # "scale": vLLM's per-tensor scale loader asserts the shape
                self._load_one(param, w)
            param.data.copy_(w.reshape(param.shape))
            done.append(w)
        return {n for n, _ in weights}

    @staticmethod
    def _check(*tensors):
        assert tensors[0].shape == tensors[1].shape, "shapes differ"

    @staticmethod
    def _load_one(param, loaded_weight):
        assert param.shape == loaded_weight.shape, "shapes differ"

    @staticmethod
    def _check_parts(param, parts):
        assert all(p.shape == param.shape for p in parts), "shapes differ"

    def _last(self, param, w):
        self._fuse([self._done[0], self._done[1]])

    @staticmethod
    def _fuse(parts):
        raise AssertionError("shapes differ: cannot fuse")


@pytest.mark.parametrize("how, at", [
    ("varargs", 1), ("list", 1), ("scale", 1),
    # (the innermost frame handed a staged tensor was handed two: no patch, though the
    # frame around it was handed one, the last)
    ("fused at the last", None),
])
def test_a_models_error_is_noted_with_the_patch_its_innermost_frame_was_handed(how, at):
    # (mutation testing: reading no *args, no list argument, ranges one element too long
    # per dimension, or the outer frames first or past an innermost frame of two patches
    # passed every test)
    flat = torch.arange(25, dtype=torch.float32)
    if how == "scale":  # a weight and its 0-d scale, views of one received buffer
        m = _LoadsThrough({"w": (4, 6), "s": (1,)}, how)
        ps = [CWP("w", (4, 6), torch.float32, flat[:24]), CWP("s", (), torch.float32, flat[24:])]
    else:
        m = _LoadsThrough({"a": (4, 6), "b": (4, 6), "c": (4, 6)}, how)
        ps = [CWP("a", (4, 6), torch.float32, flat[:24]),
              CWP("b", (6, 4), torch.float32, torch.ones(24)),
              CWP("c", (4, 6), torch.float32, torch.ones(24))]
    with pytest.raises(AssertionError, match="shapes differ") as info:
        patchkit.load_checkpoint_weight_patches(m, ps)
    sent = ", ".join(f"patch {i} ({p.name!r})" for i, p in enumerate(ps))
    at_text = "," if at is None else f" at patch {at} ({ps[at].name!r});"
    assert info.value.__notes__ == [f"(raised in load_weights call 0{at_text} sent {sent})"]
