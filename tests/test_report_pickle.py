"""A report pickles: its tables, numbers, error and patches cross a process boundary (a
worker's report, or its exception with the report attached); the model's tensors and the
saved before-values do not."""

from __future__ import annotations

import copy
import inspect
import io
import pickle
import subprocess
import sys
import textwrap
import types

import pandas as pd
import pytest
import torch

import patchkit
import patchkit.inspect as pk_inspect
from patchkit import CheckpointWeightPatch, inspect_load, same_bits
from patchkit.build import AdamLikeTrainer, sparse_patches_from_diff
from patchkit.toymodels import (
    PlainModel,
    TinyLlamaConfig,
    TinyLlamaRuntime,
    tiny_llama_checkpoint,
)

QKV = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def loaded():
    """A sparse step loaded into rank 0 of a tiny Llama, reported; and the model."""
    config = TinyLlamaConfig()
    start = tiny_llama_checkpoint(config, seed=0)
    step = AdamLikeTrainer(start, lr=1e-4, seed=0).step()
    model = TinyLlamaRuntime(config, tp_rank=0, tp_size=2)
    patchkit.load_checkpoint_weight_patches(
        model, [CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.flatten())
                for n, t in start.items()])
    patches = sparse_patches_from_diff(start, step)
    return model, patches, patchkit.inspect_load(model, patches, max_chunk_bytes=64 << 10)


def test_a_pickled_report_keeps_its_tables_numbers_and_patches(loaded):
    _, patches, report = loaded
    copy = pickle.loads(pickle.dumps(report))
    for table in ("chunks", "calls", "writes", "deltas"):
        pd.testing.assert_frame_equal(getattr(copy, table), getattr(report, table))
    assert copy.summary() == report.summary()
    assert repr(copy) == repr(report)
    assert copy._repr_html_() == report._repr_html_()
    assert copy.targets == report.targets and QKV in copy.targets
    assert copy.loaded == report.loaded and copy.error is None
    assert [p.name for p in copy.patches] == [p.name for p in patches]
    assert all(torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
               for a, b in zip(copy.patches, patches))


def test_a_pickled_report_draws_what_needs_no_tensors(loaded):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, patches, report = loaded
    copy = pickle.loads(pickle.dumps(report))
    for draw in (lambda r: r.plot_chunks(), lambda r: r.plot_placement(QKV),
                 lambda r: r.plot_density(patches[1].name, bins=(8, 8))):
        mine, theirs = draw(copy), draw(report)
        assert [ax.get_title() for ax in mine.axes] == [ax.get_title() for ax in theirs.axes]
        assert [len(ax.patches) + len(ax.images) for ax in mine.axes] == [
            len(ax.patches) + len(ax.images) for ax in theirs.axes]
        plt.close(mine)
        plt.close(theirs)


def test_a_pickled_report_holds_no_tensor_of_the_model(loaded):
    model, _, report = loaded
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # what the report holds reaches the model's tensors; what its pickle holds does not
    assert ours <= _storages(dict(report.__dict__))
    blob = io.BytesIO()
    pickler = _Spy(blob)
    pickler.dump(report)
    assert pickler.tensors and not ours & {
        t.untyped_storage().data_ptr() for t in pickler.tensors}
    copy = pickle.loads(blob.getvalue())
    assert copy._runtime == {} and copy._saved == [] and copy._rebound == {}
    for method in ("before", "after", "written"):
        with pytest.raises(ValueError, match="unpickled"):
            getattr(copy, method)(QKV)
    with pytest.raises(ValueError, match="unpickled"):
        copy.plot_delta(QKV)
    # the report itself keeps all of it, and a pickle of the copy is the same again
    assert report.before(QKV).shape == report.after(QKV).shape == report.written(QKV).shape
    again = pickle.loads(pickle.dumps(copy))
    pd.testing.assert_frame_equal(again.deltas, report.deltas)
    assert again.targets == report.targets


class _Spy(pickle.Pickler):
    """A pickler that lists the tensors it pickles."""

    def __init__(self, file) -> None:
        super().__init__(file)
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
        return NotImplemented


def _storages(obj, seen=None) -> set[int]:
    """The data pointers of the storages of every tensor reachable from ``obj`` through
    dicts, lists, tuples, sets and objects' ``__dict__``."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return set()
    out: set[int] = set()
    for item in items:
        out |= _storages(item, seen)
    return out


class Refusing(torch.nn.Module):
    """One 4 x 4 weight ``w``; any other name raises ``error(name)`` (default a
    ``KeyError``) after ``w`` was written (a load that fails in its second call)."""

    def __init__(self, error=lambda name: KeyError(f"no weight {name!r}")):
        super().__init__()
        self.error = error
        self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            if name != "w":
                raise self.error(name)
            self.w.copy_(t)
        return {n for n, _ in weights}


class _Strict:
    """Pickler and Unpickler instances that refuse ``persistent_id``/``persistent_load``
    assigned to them, as Python 3.13's do."""

    def __setattr__(self, name, value):
        if name in ("persistent_id", "persistent_load"):
            raise AttributeError(f"'{type(self).__name__}' object attribute {name!r} "
                                 "is read-only")
        super().__setattr__(name, value)


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_load_s_error_pickles_with_its_report(strict, monkeypatch):
    if strict:
        # (Python 3.13: a report's pickle that assigned them raised AttributeError for
        # every failed load's report or error; patchkit's own use only is made strict,
        # since torch's pickles of tensors subclass the real ones)
        ns = types.SimpleNamespace(**vars(pickle))
        ns.Pickler = type("Pickler", (_Strict, pickle.Pickler), {})
        ns.Unpickler = type("Unpickler", (_Strict, pickle.Unpickler), {})
        monkeypatch.setattr(pk_inspect, "pickle", ns)
    patches = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16)),
               CheckpointWeightPatch("x", (4, 4), torch.float32, torch.ones(16))]
    with pytest.raises(KeyError) as info:
        patchkit.inspect_load(Refusing(), patches, max_chunk_bytes=64)
    sent = pickle.loads(pickle.dumps(info.value))
    assert type(sent) is KeyError and sent.args == info.value.args
    assert sent.report.error is sent  # (the report's error is the exception itself)
    assert sent.report.summary() == info.value.report.summary()
    assert list(sent.report.writes["target"]) == ["w"]


def test_a_report_s_pickle_reads_its_state_once_though_its_error_refers_to_it(monkeypatch):
    # (the check that the error pickles on its own pickled the error's report again, whose
    # state checked the error again, and so on: about a hundred nested pickles of the
    # report, each held in memory at once, until the recursion limit ended them)
    patches = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16)),
               CheckpointWeightPatch("x", (4, 4), torch.float32, torch.ones(16))]
    with pytest.raises(KeyError) as info:
        patchkit.inspect_load(Refusing(), patches, max_chunk_bytes=64)
    states = []
    real = patchkit.LoadReport.__getstate__
    monkeypatch.setattr(patchkit.LoadReport, "__getstate__",
                        lambda self: states.append(self) or real(self))
    for what in (info.value, info.value.report):
        states.clear()
        sent = pickle.loads(pickle.dumps(what))
        assert states == [info.value.report]
        assert sent.report.error is sent if what is info.value else sent.error.report is sent


def test_a_worker_process_s_failed_load_reaches_the_parent_as_itself(tmp_path):
    # (multiprocessing pickles a worker's exception, and with it the report attached: a
    # report that did not pickle replaced the load's own error by a pickling error)
    script = tmp_path / "worker.py"
    head = textwrap.dedent("""
        import concurrent.futures as cf, multiprocessing as mp
        import torch, patchkit
        from patchkit import CheckpointWeightPatch
    """)
    script.write_text(head + "\n\n" + inspect.getsource(Refusing) + textwrap.dedent("""

        def job(fail):
            ps = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16))]
            if fail:
                ps.append(CheckpointWeightPatch("x", (4, 4), torch.float32, torch.ones(16)))
            return patchkit.inspect_load(Refusing(), ps, max_chunk_bytes=64)

        if __name__ == "__main__":
            with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
                r = ex.submit(job, False).result()
                print("report", r.summary()["elements changed"])
                try:
                    ex.submit(job, True).result()
                except KeyError as e:
                    print("error", e.args[0], list(e.report.writes["target"]))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path)
    assert done.stdout.splitlines() == ["report 16", "error no weight 'x' ['w']"], (
        done.stdout + done.stderr[-3000:])


@pytest.mark.parametrize("dtype, sparse", [
    (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True), (torch.float8_e5m2, True),
    (torch.uint16, False), (torch.uint32, False), (torch.uint64, False)])
def test_a_report_of_a_dtype_torchs_pickle_cannot_rebuild_unpickles(dtype, sparse):
    # it pickled, then failed to unpickle ("UntypedStorage has no attribute 'dtype'"):
    # torch writes float8 and uint16/32/64 tensors but cannot read them back
    m = PlainModel({"w": (2, 4)}, dtype=dtype)
    values = torch.arange(1, 9).to(dtype)
    if sparse:
        p = CheckpointWeightPatch("w", (2, 4), dtype, values[:3], torch.tensor([0, 5, 7]))
    else:
        p = CheckpointWeightPatch("w", (2, 4), dtype, values[1::2].repeat(2))  # (strided)
    r = inspect_load(m, [p])
    back = pickle.loads(pickle.dumps(r))
    (q,) = back.patches
    assert q.dtype == dtype and q.values.dtype == p.values.dtype
    assert same_bits(q.values, p.values)
    assert q.indices is None if not sparse else same_bits(q.indices, p.indices)
    assert back.deltas.equals(r.deltas) and back.writes.equals(r.writes)
    assert same_bits(copy.deepcopy(r).patches[0].values, p.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_pickled_report_of_patch_parts_holds_each_part_once(dtype):
    # torch's pickle writes a view's whole storage: 1600 split_patch parts of one 2 MiB
    # tensor made a 1.6 GiB pickle
    # (clamped to the dtype's largest, as torch 2.13's float8 cast saturates: torch before
    # 2.13 casts a float past e4m3fn's range to NaN, which split_patch rightly refuses)
    values = torch.arange(4096.0).clamp(max=torch.finfo(dtype).max).to(dtype)
    whole = CheckpointWeightPatch("w", (64, 64), dtype, values)
    parts = patchkit.split_patch(whole, 32)
    assert all(p.values.untyped_storage().nbytes() == values.untyped_storage().nbytes()
               for p in parts)  # (views of the whole: what the pickle must not repeat)
    r = inspect_load(PlainModel({"w": (64, 64)}, dtype=dtype), parts)
    data = pickle.dumps(r)
    held = 4096 * (values.element_size() + 8)  # (the parts' values and int64 indices)
    assert len(data) < 4 * held  # (32 times it before)
    back = pickle.loads(data)
    assert [same_bits(q.values, p.values) for q, p in zip(back.patches, parts)] == [True] * 32
    assert [same_bits(q.indices, p.indices) for q, p in zip(back.patches, parts)] == [True] * 32
    assert parts[3].values.untyped_storage().nbytes() == values.untyped_storage().nbytes()


class _TwoArgError(Exception):
    """An exception whose __init__ takes other arguments than its args: it pickles, and
    fails to unpickle (a common pattern in loaders' own errors)."""

    def __init__(self, name, detail):
        super().__init__(f"{name}: {detail}")


def test_a_report_whose_error_cannot_be_unpickled_keeps_everything_else():
    # (the report's pickle failed to load as a whole, tables and all)
    patches = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16)),
               CheckpointWeightPatch("x", (4, 4), torch.float32, torch.ones(16))]
    with pytest.raises(_TwoArgError) as info:
        patchkit.inspect_load(Refusing(lambda name: _TwoArgError(name, "disk gone")),
                              patches, max_chunk_bytes=64)
    report = info.value.report
    copy = pickle.loads(pickle.dumps(report))
    assert type(copy.error) is RuntimeError
    assert str(copy.error).startswith("_TwoArgError: x: disk gone (the load's exception, "
                                      "which a pickle could not keep: TypeError: ")
    assert list(copy.writes["target"]) == ["w"] and copy.calls.equals(report.calls)
    assert copy.summary()["error"].startswith("RuntimeError: _TwoArgError: x: disk gone")
    assert report.error is info.value  # (the report itself is untouched)
    # (a message of up to 400 characters is kept whole: the repr's cut is 160)
    long = "d" * 300
    with pytest.raises(_TwoArgError) as info:
        patchkit.inspect_load(Refusing(lambda name: _TwoArgError(name, long)),
                              patches, max_chunk_bytes=64)
    kept = str(pickle.loads(pickle.dumps(info.value.report)).error)
    assert kept.startswith(f"_TwoArgError: x: {long} (the load's exception")


def test_a_report_whose_error_fails_to_pickle_in_any_way_keeps_everything_else():
    # (not only a TypeError: a class defined in a function cannot be pickled by reference,
    # AttributeError or PicklingError by the Python version, and a __reduce__ may raise
    # anything; the report's pickle raised it)
    class LocalError(Exception):
        pass

    class Unreducible(Exception):
        def __reduce__(self):
            raise ValueError("no pickle for this one")

    patches = [CheckpointWeightPatch("w", (4, 4), torch.float32, torch.ones(16)),
               CheckpointWeightPatch("x", (4, 4), torch.float32, torch.ones(16))]
    for error in (LocalError, Unreducible):
        with pytest.raises(error) as info:
            patchkit.inspect_load(Refusing(lambda name, error=error: error(f"{name}: gone")),
                                  patches, max_chunk_bytes=64)
        copy = pickle.loads(pickle.dumps(info.value.report))
        assert type(copy.error) is RuntimeError
        assert str(copy.error).startswith(f"{error.__name__}: x: gone (the load's exception, "
                                          "which a pickle could not keep: ")
        assert list(copy.writes["target"]) == ["w"]


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_a_copied_report_says_it_is_a_copy_when_asked_for_tensors(loaded, how):
    # (a copy is the pickle's copy: its refusal said "this report was unpickled", which a
    # report made by copy.copy never was)
    _, _, report = loaded
    dup = how(report)
    assert dup.summary() == report.summary()
    with pytest.raises(ValueError, match=r"unpickled or copied \(copy\.copy, copy\.deepcopy\)"):
        dup.before(QKV)
    assert report.before(QKV).shape == report.after(QKV).shape
