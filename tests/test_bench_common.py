"""The benchmarks' timing helpers: rounds in shuffled order, ratios taken round by round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _common
from _common import fmt_ratio, interleaved_times, paired_ratio

CPU = torch.device("cpu")


def test_every_function_runs_once_a_round_in_an_order_shuffled_each_round(monkeypatch):
    monkeypatch.setattr(_common.gc, "collect", lambda: 0)  # (a full collection each call)
    calls: list[str] = []
    fns = [lambda name=name: calls.append(name) for name in "abcd"]
    times = interleaved_times(fns, CPU, repeats=30, seed=3)
    assert [len(t) for t in times] == [30] * 4
    assert calls[:4] == list("abcd")  # the warm-up, in the given order
    rounds = [tuple(calls[4 + 4 * r: 8 + 4 * r]) for r in range(30)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len(set(rounds)) > 5  # not one fixed order
    calls.clear()
    interleaved_times(fns, CPU, repeats=30, seed=3)
    assert [tuple(calls[4 + 4 * r: 8 + 4 * r]) for r in range(30)] == rounds  # seeded


def test_a_paired_ratio_is_taken_round_by_round():
    # a machine that slows down tenfold in the middle rounds slows both loads alike
    base = [1.0, 1.0, 10.0, 10.0, 10.0, 1.0, 1.0]
    times = [1.5 * b for b in base]
    assert paired_ratio(times, base) == pytest.approx((1.5, 1.5, 1.5))
    mid, lo, hi = paired_ratio([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5)
    assert (mid, lo, hi) == pytest.approx((3.0, 1.5, 4.5))
    assert fmt_ratio([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5) == "3.00x"
    assert fmt_ratio([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5, spread=True) == "3.00x (1.50-4.50)"
    assert paired_ratio([2.0], [1.0]) == (2.0, 2.0, 2.0)  # one round (--quick)


@pytest.mark.parametrize("kept", [None, []], ids=["fresh", "kept"])
def test_the_save_reference_saves_each_destination_before_it_is_written(kept):
    # (the whole-model table's "save ref" and "kept ref": a reference that saved nothing,
    # or saved after the write, would measure less than a report of this design must do)
    from bench_inspect import _SaveEachCopy

    w = torch.arange(6.0).reshape(2, 3)
    for step in range(2):  # (the second load reuses the kept buffers)
        new = torch.full((2, 3), 10.0 + step)
        was = w.clone()
        with _SaveEachCopy(kept) as mode:
            w[0].copy_(new[0])
            w.narrow(0, 1, 1).copy_(new[1:])
        assert [s.tolist() for s in mode.saves] == [was[0].tolist(), was[1:].tolist()]
        assert torch.equal(w, new)
        if kept is not None:
            assert [s.data_ptr() for s in mode.saves] == [b.data_ptr() for b in kept]


@pytest.mark.parametrize("kept", [None, []], ids=["fresh", "kept"])
def test_the_save_reference_keeps_every_calls_saves_to_the_end_of_its_load(kept):
    # (a load of several load_weights calls, as one over max_chunk_bytes is: a report
    # keeps every call's saves until the load ends, so the reference must too, and each
    # of its kept buffers serves one save)
    from bench_inspect import _saving_load

    import patchkit
    from patchkit.toymodels import PlainModel

    model = PlainModel({"a": (3,), "b": (3,)})
    for step in range(2):
        was = {n: p.detach().clone() for n, p in model.named_parameters()}
        patches = [patchkit.CheckpointWeightPatch(n, (3,), torch.float32,
                                                  torch.full((3,), 5.0 + step)) for n in "ab"]
        saves = _saving_load(model, model.load_weights, patches, kept, max_chunk_bytes=12)
        assert [s.tolist() for s in saves] == [was["a"].tolist(), was["b"].tolist()]
        assert "load_weights" not in vars(model)  # (the instance attribute is gone)
        if kept is not None:
            assert len({s.data_ptr() for s in saves}) == 2
            assert [s.data_ptr() for s in saves] == [b.data_ptr() for b in kept]


def test_the_target_table_judges_each_row_by_its_own_numbers():
    # (table 6 of bench_inspect: a row meets the time target at or under 1.5x, and the
    # memory target when the report's extra bytes, torch's and Python's together, are at
    # most the bytes written; the tables' ratio and the kept-copy reference are shown, not
    # judged)
    from bench_inspect import _Target, _target_table

    mib = 2**20
    out = _target_table([
        _Target("under", 1.49, 3.1, 1.2, mib, 0, 2 * mib),
        _Target("over", 1.97, None, 1.31, 2 * mib, 1, 2 * mib),
        _Target("at", 1.5, 2.0, 1.7, mib, mib, 2 * mib),
        _Target("sparse", 1.51, None, None, 0, mib // 2, mib),
    ])
    head, *lines = out.splitlines()
    assert "time within 1.5x in 2 of 4 rows" in head
    assert "extra memory within the bytes written in 3 of 4" in head
    assert "cold caches" in head
    cells = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
             for ln in lines[2:]}
    assert cells["under"] == ["1.49x", "yes", "3.10x", "1.20x", "1.00", "0.00", "2.00", "yes"]
    # (one byte of Python over the bytes written is over)
    assert cells["over"] == ["1.97x", "no", "-", "1.31x", "2.00", "0.00", "2.00", "no"]
    assert cells["at"][1] == "yes" and cells["at"][-1] == "yes"
    assert cells["sparse"][1:4] == ["no", "-", "-"] and cells["sparse"][-1] == "yes"


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_the_whole_model_rows_load_patches_of_one_size_in_turn(kind):
    # (table 3 of bench_inspect times a plain load against a report on whichever patch
    # list comes next, and reads "written" off a third load: the two lists of a pair must
    # write the same elements, and each load must change the model, or a row compares
    # loads of different sizes; sparse diffs of two consecutive steps from the start once
    # differed in size by up to a quarter)
    from bench_inspect import _step_pairs

    import patchkit
    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime

    config = TinyLlamaConfig(num_layers=2)
    first, kinds = _step_pairs(config, 1e-3, torch.bfloat16)
    back, forth = kinds[kind]
    model = TinyLlamaRuntime(config, tp_rank=0, tp_size=2, dtype=torch.bfloat16)
    patchkit.load_checkpoint_weight_patches(model, first)
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    sizes = []
    for patches in (forth, back, forth):  # (pair[1] first, as the benchmark's turn)
        r = patchkit.inspect_load(model, patches)
        sizes.append((int(r.deltas["elements"].sum()), int(r.deltas["changed"].sum())))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert len(set(sizes)) == 1, sizes  # every load writes and changes as much
    assert sizes[0][1] > 0  # (and changes something)
    if kind == "sparse":
        assert sizes[0][0] == sizes[0][1]  # a diff writes only what changes
    for k in states[0]:  # step 1 -> step 2 -> step 1 -> step 2, bit for bit
        assert torch.equal(states[0][k].view(torch.int16), states[2][k].view(torch.int16)), k
        assert torch.equal(states[1][k].view(torch.int16), states[3][k].view(torch.int16)), k


def test_the_python_heap_of_a_call_is_measured_with_its_result_kept():
    from bench_inspect import _python_peak

    assert _python_peak(lambda: [0] * 200_000) >= 200_000 * 8
    assert _python_peak(lambda: None) < 64 * 1024


def test_threads_sets_torchs_thread_count_for_the_run():
    from _common import bench_args

    before = torch.get_num_threads()
    try:
        bench_args("x", ["--threads", "1", "--quick"])
        assert torch.get_num_threads() == 1
        with pytest.raises(SystemExit):
            bench_args("x", ["--threads", "0"])
    finally:
        torch.set_num_threads(before)


def test_host_waits_count_a_reports_synchronizes_around_each_call():
    # (a report synchronizes the model's GPUs before and after every load_weights call;
    # the count left them out, which on the CPU leave no trace)
    import patchkit
    from patchkit.toymodels import PlainModel

    model = PlainModel({"a": (4,), "b": (4,)})
    patches = [patchkit.CheckpointWeightPatch(n, (4,), torch.float32, torch.ones(4))
               for n in "ab"]

    def waits(budget):
        with torch.no_grad():  # (each measured load changes the model alike: on the
            for p in model.parameters():  # torch-ops path a write's waits depend on that)
                p.zero_()
        return _common.host_waits_of(
            lambda: patchkit.inspect_load(model, patches, max_chunk_bytes=budget))

    assert waits(16) - waits(1 << 20) == 2  # (two calls against one: two more waits)
    assert _common.host_waits_of(
        lambda: patchkit.load_checkpoint_weight_patches(model, patches, max_chunk_bytes=16)) == 0
