"""inspect_load(progress=...): one step per load_weights call, shown or passed on."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import torch

import patchkit
from patchkit import LoadProgress, inspect_load
from patchkit import progress as progress_mod
from patchkit.build import AdamLikeTrainer, dense_patches, sparse_patches_from_diff
from patchkit.errors import PatchTypeError
from patchkit.patch import staged_nbytes
from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

BUDGET = 1 << 14  # small: a few dozen calls for the 4-layer model


@pytest.fixture()
def setup():
    cfg = TinyLlamaConfig(num_layers=4)
    ckpt = tiny_llama_checkpoint(cfg)
    model = TinyLlamaRuntime(cfg, tp_rank=0, tp_size=2, device=torch.get_default_device())
    patchkit.load_checkpoint_weight_patches(model, dense_patches(ckpt))
    after = AdamLikeTrainer(ckpt, lr=1e-2).step()
    return model, ckpt, after


def test_callable_gets_one_step_per_call_with_the_plans_bytes(setup):
    model, ckpt, after = setup
    seen: list[LoadProgress] = []
    report = inspect_load(model, sparse_patches_from_diff(ckpt, after),
                          max_chunk_bytes=BUDGET, progress=seen.append)
    per_call = report.chunks.groupby("chunk")["bytes"].sum().tolist()
    assert len(seen) == len(report.calls) == len(per_call) > 3
    assert [p.calls_done for p in seen] == list(range(1, len(per_call) + 1))
    assert all(p.calls == len(per_call) for p in seen)
    running = 0
    for p, nbytes, names in zip(seen, per_call, report.calls["names"]):
        running += nbytes
        assert p.bytes_done == running
        assert p.total_bytes == sum(per_call)
        assert p.names == tuple(names)
        assert not p.failed
    assert seen[-1].fraction == 1.0
    assert 0 < seen[0].fraction < 1
    assert [p.seconds for p in seen] == sorted(p.seconds for p in seen)


def test_observed_loader_steps_too(setup):
    model, _ckpt, after = setup
    seen: list[LoadProgress] = []
    report = inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET,
                          loader=patchkit.load_checkpoint_weight_patches, progress=seen.append)
    assert len(seen) == len(report.calls) > 3
    assert seen[-1].bytes_done == seen[-1].total_bytes == int(report.chunks["bytes"].sum())


def test_a_callable_that_raises_stops_the_load_and_a_transactional_one_rolls_back(setup):
    model, ckpt, after = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def stop(p: LoadProgress) -> None:
        if p.calls_done == 3:
            raise KeyboardInterrupt("enough")

    with pytest.raises(KeyboardInterrupt) as info:
        inspect_load(model, sparse_patches_from_diff(ckpt, after), max_chunk_bytes=BUDGET,
                     transactional=True, progress=stop)
    report = info.value.report
    assert len(report.calls) == 3 and report.rolled_back
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stderr_of(fn, monkeypatch, terminal: bool = False) -> str:
    """What ``fn`` writes to stderr: a terminal's, or (by default) a log file's."""
    buf = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    fn()
    return buf.getvalue()


def _loaded(model, after, monkeypatch, progress, terminal: bool = False):
    """``(stderr, report)`` of ``inspect_load`` of ``after``'s dense patches in calls of
    ``BUDGET`` bytes, with ``progress``, writing to a terminal or a log file."""
    reports = []
    out = _stderr_of(lambda: reports.append(inspect_load(
        model, dense_patches(after), max_chunk_bytes=BUDGET, progress=progress)),
        monkeypatch, terminal)
    return out, reports[0]


def test_true_shows_nothing_for_a_load_shorter_than_show_after(setup, monkeypatch):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", float("inf"))
    out = _stderr_of(lambda: inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET,
                                          progress=True), monkeypatch)
    assert out == ""


def test_true_draws_one_rewriting_line_that_ends_with_the_totals(setup, monkeypatch):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    out, report = _loaded(model, after, monkeypatch, True, terminal=True)
    calls = len(report.calls)
    assert calls == len(patchkit.plan_chunks(dense_patches(after), BUDGET)) > 3
    assert out.startswith("\rinspect_load: 1/") and out.endswith("\n")
    assert out.count("\n") == 1  # one line, rewritten with \r
    last = out.rsplit("\r", 1)[1]
    assert last.startswith(f"inspect_load: {calls}/{calls} calls, ")
    assert "failed" not in last


class _FailsOnThirdCall(TinyLlamaRuntime):
    def load_weights(self, weights):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 3:
            raise RuntimeError("third call fails")
        return super().load_weights(weights)


def test_a_failed_load_ends_the_line_with_failed(monkeypatch):
    cfg = TinyLlamaConfig(num_layers=2)
    ckpt = tiny_llama_checkpoint(cfg)
    model = _FailsOnThirdCall(cfg, device=torch.get_default_device())
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    seen: list[LoadProgress] = []

    def run():
        with pytest.raises(RuntimeError, match="third call"):
            inspect_load(model, dense_patches(ckpt), max_chunk_bytes=BUDGET, progress=True)
        with pytest.raises(RuntimeError, match="third call"):
            model.n = 0
            inspect_load(model, dense_patches(ckpt), max_chunk_bytes=BUDGET,
                         progress=seen.append)

    out = _stderr_of(run, monkeypatch, terminal=True)
    assert out.rsplit("\r", 1)[1].startswith("inspect_load: 3/")
    assert out.endswith(", failed\n")
    assert [p.failed for p in seen] == [False, False, True]

    def run_logged():
        model.n = 0
        with pytest.raises(RuntimeError, match="third call"):
            inspect_load(model, dense_patches(ckpt), max_chunk_bytes=BUDGET, progress=True)

    log = _stderr_of(run_logged, monkeypatch)
    assert log.startswith("inspect_load: 3/") and log.endswith(", failed\n")
    assert "\r" not in log and log.count("\n") == 1


def test_off_a_terminal_a_short_load_writes_its_final_status_once(setup, monkeypatch):
    # (a log file: no carriage returns, one line)
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    out, report = _loaded(model, after, monkeypatch, True)
    calls = len(report.calls)
    assert calls > 3
    assert "\r" not in out and out.count("\n") == 1 and out.endswith("\n")
    assert out.startswith(f"inspect_load: {calls}/{calls} calls, ")


def test_off_a_terminal_a_long_load_writes_a_line_at_a_time_and_the_end_once(
        setup, monkeypatch):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)  # (a line for every call)
    monkeypatch.setattr(progress_mod, "_EVERY", 0.0)
    out, report = _loaded(model, after, monkeypatch, True)
    calls = len(report.calls)
    lines = out.splitlines()
    assert "\r" not in out and out.endswith("\n")
    assert [line.split(" calls, ")[0] for line in lines] == [
        f"inspect_load: {k}/{calls}" for k in range(1, calls + 1)]  # the last one once


def test_in_a_kernel_a_widget_bar_is_shown_and_finished(setup, monkeypatch):
    pytest.importorskip("ipywidgets")
    import IPython.display

    model, _ckpt, after = setup
    shown = []
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "_in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", shown.append)
    out = _stderr_of(lambda: inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET,
                                          progress=True), monkeypatch)
    assert out == ""  # the bar, not the text line
    (box,) = shown
    bar, label = box.children
    assert bar.value == 1.0 and bar.bar_style == "success"
    assert label.value.endswith(" s") and "calls" in label.value
    done, planned = label.value.split(" calls, ")[0].split("/")  # (the label is the bar's)
    assert done == planned == str(len(patchkit.plan_chunks(dense_patches(after), BUDGET)))


@pytest.mark.parametrize("bad", [3, "yes", [print]])
def test_a_bad_progress_is_a_type_error_before_anything_loads(setup, bad):
    model, _ckpt, after = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchTypeError, match="progress must be") as info:
        inspect_load(model, dense_patches(after), progress=bad)
    assert info.value.reason == "progress type"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _two(a, b):
    return None


class _Calls:
    def __call__(self):
        return None


@pytest.mark.parametrize("bad", [LoadProgress, lambda: None, _two, _Calls()])
def test_a_progress_callable_of_the_wrong_signature_is_refused_before_anything_loads(
        setup, bad):
    # (it stopped the load after its first call with a TypeError, the model half updated)
    model, _ckpt, after = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchTypeError, match=r"progress must be a callable taking one "
                                             r"argument .* nothing was loaded") as info:
        inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=bad)
    assert info.value.reason == "progress signature"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    seen = []  # one that takes one argument (or more, with defaults) is fine
    inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET,
                 progress=lambda p, extra=None: seen.append(p.calls_done))
    assert seen == list(range(1, len(seen) + 1)) and len(seen) > 1


def test_load_progress_text_and_fraction():
    p = LoadProgress(calls_done=3, calls=12, bytes_done=3 << 29, total_bytes=6 << 30,
                     seconds=4.06, names=("a",))
    assert p.text() == "inspect_load: 3/12 calls, 1.5 GiB of 6 GiB staged, 4.1 s"
    assert p.fraction == 0.25
    empty = LoadProgress(calls_done=1, calls=2, bytes_done=0, total_bytes=0, seconds=0.0,
                         names=())
    assert empty.fraction == 0.5


class _WriteOnly:
    """A stderr with write() and nothing else (as some log redirectors are)."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> int:
        self.text += s
        return len(s)


@pytest.mark.parametrize("stderr", ["None", "write only"])
@pytest.mark.parametrize("long_load", [False, True])
def test_a_display_that_fails_never_stops_or_fails_the_load(setup, monkeypatch, stderr,
                                                              long_load):
    model, ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    if long_load:  # (a line at every call, not only at the end)
        monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)
        monkeypatch.setattr(progress_mod, "_EVERY", 0.0)
    monkeypatch.setattr(sys, "stderr", None if stderr == "None" else _WriteOnly())
    report = inspect_load(model, sparse_patches_from_diff(ckpt, after),
                          max_chunk_bytes=BUDGET, progress=True, transactional=True)
    assert len(report.calls) > 3 and report.error is None and not report.rolled_back
    assert report.summary()["elements changed"] > 0  # loaded, and not rolled back:
    assert patchkit.same_state({n: report.after(n) for n in report.deltas.index},
                               {n: t for n, t in model.state_dict().items()
                                if n in report.deltas.index})


def test_a_callback_that_raises_when_told_of_a_failed_call_leaves_the_loads_error(
        monkeypatch):
    cfg = TinyLlamaConfig(num_layers=2)
    ckpt = tiny_llama_checkpoint(cfg)
    model = _FailsOnThirdCall(cfg, device=torch.get_default_device())
    told = []

    def callback(p: LoadProgress) -> None:
        told.append(p.failed)
        if p.failed:
            raise KeyError("callback")

    with pytest.raises(RuntimeError, match="third call") as e:
        inspect_load(model, dense_patches(ckpt), max_chunk_bytes=BUDGET, progress=callback)
    assert told == [False, False, True]
    assert e.value.report.summary()["error"].startswith("RuntimeError: third call")
    assert e.value.__notes__ == [
        "(raised in load_weights call 2, sent patch 4 "
        "('model.layers.0.self_attn.o_proj.weight'))",
        "(the progress callback, told of the failed call, raised too: KeyError: "
        "'callback')"]


class _BrokenView:
    """A shown bar whose front end is gone: every update and the finish raise."""

    opened = 0

    @classmethod
    def open(cls, label):
        cls.opened += 1
        return cls()

    def update(self, state, label):
        raise RuntimeError("the front end is gone")

    finish = update


@pytest.mark.parametrize("broken", ["opening", "updating"])
def test_a_bar_that_fails_to_show_stops_showing_and_the_load_goes_on(setup, monkeypatch,
                                                                     broken):
    model, ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "_EVERY", 0.0)
    _BrokenView.opened = 0
    if broken == "opening":
        def fail(label):
            _BrokenView.opened += 1
            raise RuntimeError("no display")
        monkeypatch.setattr(progress_mod._View, "open", staticmethod(fail))
    else:
        monkeypatch.setattr(progress_mod._View, "open", _BrokenView.open)
    report = inspect_load(model, sparse_patches_from_diff(ckpt, after),
                          max_chunk_bytes=BUDGET, progress=True, transactional=True)
    assert len(report.calls) > 3 and report.error is None and not report.rolled_back
    assert _BrokenView.opened == 1  # (tried once, then left alone)


def _fails_after_its_calls(model, patches, **kw):
    patchkit.load_checkpoint_weight_patches(model, patches, **kw)
    raise RuntimeError("fails after its last call")


def test_a_load_that_fails_between_or_after_its_calls_ends_failed_too(setup, monkeypatch):
    # (every call returned: the status said success while the load raised, and the
    # widget bar turned green)
    pytest.importorskip("ipywidgets")

    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)

    def run():
        with pytest.raises(RuntimeError, match="after its last call"):
            inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=True,
                         loader=_fails_after_its_calls)

    log = _stderr_of(run, monkeypatch)
    assert log.count("\n") == 1 and log.endswith(", failed\n")
    calls = len(patchkit.plan_chunks(dense_patches(after), BUDGET))
    assert log.startswith(f"inspect_load: {calls}/{calls} calls, ")
    line = _stderr_of(run, monkeypatch, terminal=True)
    assert line.endswith(", failed\n")

    bar, label = _kernel_bar(run, monkeypatch)
    assert bar.bar_style == "danger" and label.value.endswith(", failed")


def _kernel_bar(run, monkeypatch):
    """``(bar, label)``: the widget bar ``run()`` shows, as in a kernel."""
    import IPython.display

    shown = []
    monkeypatch.setattr(progress_mod, "_in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", shown.append)
    _stderr_of(run, monkeypatch)
    (box,) = shown
    return box.children


def _catches_its_last_calls_error(model, patches, **kw):
    patchkit.load_checkpoint_weight_patches(model, patches, **kw)
    with contextlib.suppress(KeyError):  # (tried, and let go: the load returns)
        model.load_weights([("no.such.weight", torch.zeros(1))])


def test_a_load_whose_loader_caught_its_last_calls_error_does_not_end_failed(
        setup, monkeypatch):
    # (the final status took the last call's: ', failed' and a red bar for a load that
    # returned)
    pytest.importorskip("ipywidgets")

    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    seen: list[LoadProgress] = []
    report = inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET,
                          progress=seen.append, loader=_catches_its_last_calls_error)
    assert report.error is None
    assert seen[-1].failed and not any(p.failed for p in seen[:-1])  # (the call's own)

    def run():
        inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=True,
                     loader=_catches_its_last_calls_error)

    calls = len(seen)
    for terminal in (False, True):
        out = _stderr_of(run, monkeypatch, terminal=terminal)
        assert out.endswith("\n") and "failed" not in out, out
        assert out.rsplit("\r", 1)[-1].startswith(f"inspect_load: {calls}/{calls} calls, ")
    bar, label = _kernel_bar(run, monkeypatch)
    assert bar.bar_style == "success" and not label.value.endswith(", failed")


class _FalsyCallable(list):
    def __call__(self, state):
        self.append(state)


def test_a_callable_progress_is_called_even_when_it_is_falsy(setup):
    model, _ckpt, after = setup
    seen = _FalsyCallable()
    assert not seen and callable(seen)
    report = inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=seen)
    assert len(seen) == len(report.calls) > 3


def _one_call_a_patch(model, weights, max_chunk_bytes=None, **kw):
    """An observed loader that sends each (dense) patch in a call of its own."""
    for p in weights:
        model.load_weights([(p.name, p.values.reshape(p.shape))])


def test_a_loader_that_makes_more_calls_than_planned_grows_the_calls(setup):
    model, _ckpt, after = setup
    patches = dense_patches(after)
    planned = len(patchkit.plan_chunks(patches, BUDGET))
    assert planned < len(patches)
    seen: list[LoadProgress] = []
    inspect_load(model, patches, max_chunk_bytes=BUDGET, loader=_one_call_a_patch,
                 progress=seen.append)
    assert [p.calls_done for p in seen] == list(range(1, len(patches) + 1))
    assert [p.calls for p in seen] == [max(planned, k) for k in range(1, len(patches) + 1)]
    assert seen[-1].text().startswith(f"inspect_load: {len(patches)}/{len(patches)} calls, ")


def _in_float64(model, weights, max_chunk_bytes=None, **kw):
    """An observed loader that stages every (dense) patch in float64, in one call."""
    model.load_weights([(p.name, p.values.reshape(p.shape).double()) for p in weights])


def test_a_loader_that_stages_more_bytes_than_planned_grows_the_total(setup):
    model, _ckpt, after = setup
    patches = dense_patches(after)
    planned = sum(staged_nbytes(p) for p in patches)
    seen: list[LoadProgress] = []
    inspect_load(model, patches, max_chunk_bytes=BUDGET, loader=_in_float64,
                 progress=seen.append)
    (last,) = seen
    assert last.bytes_done == last.total_bytes > planned and last.fraction == 1.0


def test_off_a_terminal_a_load_that_fails_after_its_calls_adds_a_failed_line(
        setup, monkeypatch):
    # (a line for every call: the last one said k/k calls, and the end, failed, differs
    # from it only in that)
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "LOG_EVERY", 0.0)
    monkeypatch.setattr(progress_mod, "_EVERY", 0.0)

    def run():
        with pytest.raises(RuntimeError, match="after its last call"):
            inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=True,
                         loader=_fails_after_its_calls)

    lines = _stderr_of(run, monkeypatch).splitlines()
    calls = len(patchkit.plan_chunks(dense_patches(after), BUDGET))
    assert len(lines) == calls + 1
    assert [ln.split(" calls, ")[0] for ln in lines[-2:]] == [
        f"inspect_load: {calls}/{calls}"] * 2
    assert not lines[-2].endswith(", failed") and lines[-1].endswith(", failed")


class _Clock:
    """A stand-in for ``time.perf_counter`` in patchkit.progress: the load's start reads
    0, then each read gives the next of ``times`` (and after them, +0.25 s a read), so
    that when a line is shown does not depend on how fast this machine is."""

    def __init__(self, *times: float) -> None:
        self._times = [0.0, *times]

    def perf_counter(self) -> float:
        if len(self._times) == 1:
            self._times.append(self._times[0] + 0.25)
        return self._times.pop(0)


def _frames(out: str) -> list[str]:
    """The successive contents of a rewritten line: what each ``\\r`` starts."""
    return [f.rstrip(" \n") for f in out.split("\r")[1:]]


def test_a_bar_shows_from_show_after_and_is_redrawn_at_most_every_so_often(setup,
                                                                          monkeypatch):
    # (one read of the clock a call, 0.25 s apart: shown from the call at 0.5 s,
    # SHOW_AFTER; then redrawn when 0.5 s, _EVERY here, have passed since it last was,
    # and once at the end)
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "time", _Clock())
    monkeypatch.setattr(progress_mod, "_EVERY", 0.5)
    out, report = _loaded(model, after, monkeypatch, True, terminal=True)
    calls = len(report.calls)
    assert calls > 5
    shown = [f.split(" calls, ")[0] for f in _frames(out)]
    assert shown == [f"inspect_load: {k}/{calls}" for k in range(2, calls + 1, 2)] + [
        f"inspect_load: {calls}/{calls}"]
    assert out.endswith("\n") and out.count("\n") == 1


def test_off_a_terminal_lines_come_log_every_seconds_from_the_start_and_the_end_once(
        setup, monkeypatch):
    # (the first call ends at exactly LOG_EVERY: its line is written; the others come
    # 0.25 s apart, too soon for another, and the final status, which differs, follows)
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "time", _Clock(progress_mod.LOG_EVERY))
    out, report = _loaded(model, after, monkeypatch, True)
    calls = len(report.calls)
    assert calls > 3
    assert "\r" not in out
    assert [ln.split(" calls, ")[0] for ln in out.splitlines()] == [
        f"inspect_load: 1/{calls}", f"inspect_load: {calls}/{calls}"]


def test_a_terminal_line_that_gets_shorter_is_blanked_to_its_old_width(monkeypatch):
    buf = _Terminal()
    monkeypatch.setattr(sys, "stderr", buf)
    view = progress_mod._TextView()
    # ("1023 B" then "1 KiB": the line loses a character)
    long = LoadProgress(calls_done=10, calls=10, bytes_done=1023, total_bytes=2000,
                        seconds=1.0, names=())
    short = LoadProgress(calls_done=10, calls=10, bytes_done=1024, total_bytes=2000,
                         seconds=1.0, names=())
    assert len(short.text()) < len(long.text())
    view.update(long, "inspect_load")
    view.finish(short, "inspect_load")
    pad = " " * (len(long.text()) - len(short.text()))
    assert buf.getvalue() == "\r" + long.text() + "\r" + short.text() + pad + "\n"


def test_a_builtin_whose_signature_cannot_be_read_is_taken_as_progress(setup):
    # (inspect.signature(dir) raises ValueError: the call will tell, as documented)
    model, _ckpt, after = setup
    report = inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=dir)
    assert report.error is None and len(report.calls) > 3


def test_a_callable_progress_shows_nothing_itself(setup, monkeypatch):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    seen: list[LoadProgress] = []
    for terminal in (False, True):
        out = _stderr_of(lambda: inspect_load(model, dense_patches(after),
                                              max_chunk_bytes=BUDGET, progress=seen.append),
                         monkeypatch, terminal=terminal)
        assert out == ""
    assert len(seen) > 3


def test_in_a_kernel_without_ipywidgets_the_line_rewrites_itself(setup, monkeypatch):
    # (a kernel's stderr is no terminal, but its output area takes \r)
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "_in_kernel", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # (its import: ImportError)
    out, report = _loaded(model, after, monkeypatch, True)
    calls = len(report.calls)
    assert out.startswith("\rinspect_load: ") and out.endswith("\n")
    assert _frames(out)[-1].startswith(f"inspect_load: {calls}/{calls} calls, ")


class _Shell:
    """An IPython shell, of a terminal (no ``kernel``) or of a kernel."""

    def __init__(self, kernel: object | None) -> None:
        if kernel is not None:
            self.kernel = kernel


def test_an_ipython_terminal_is_no_kernel(monkeypatch):
    import types

    fake = types.ModuleType("IPython")
    monkeypatch.setitem(sys.modules, "IPython", fake)
    fake.get_ipython = lambda: None  # (IPython imported, no shell running)
    assert not progress_mod._in_kernel()
    fake.get_ipython = lambda: _Shell(kernel=None)
    assert not progress_mod._in_kernel()
    fake.get_ipython = lambda: _Shell(kernel=object())
    assert progress_mod._in_kernel()


def test_a_stderr_without_isatty_gets_plain_lines(setup, monkeypatch):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    stderr = _WriteOnly()
    monkeypatch.setattr(sys, "stderr", stderr)
    report = inspect_load(model, dense_patches(after), max_chunk_bytes=BUDGET, progress=True)
    calls = len(report.calls)
    assert "\r" not in stderr.text and stderr.text.count("\n") == 1
    assert stderr.text.startswith(f"inspect_load: {calls}/{calls} calls, ")


def _one_generator_call(model, weights, max_chunk_bytes=None, **kw):
    """An observed loader that hands load_weights a generator of every (dense) patch."""
    model.load_weights((p.name, p.values.reshape(p.shape)) for p in weights)


def test_a_loader_that_hands_a_generator_has_its_entries_bytes_counted(setup):
    model, _ckpt, after = setup
    patches = dense_patches(after)
    seen: list[LoadProgress] = []
    inspect_load(model, patches, max_chunk_bytes=BUDGET, loader=_one_generator_call,
                 progress=seen.append)
    (last,) = seen
    assert last.names == tuple(p.name for p in patches)
    assert last.bytes_done == sum(staged_nbytes(p) for p in patches) > 0


def test_a_widget_bar_is_labelled_and_filled_by_the_share_of_bytes(monkeypatch):
    # (a load that fails at its third call leaves the bar where it stopped: the bytes of
    # three calls of the plan's, not three calls of its count)
    pytest.importorskip("ipywidgets")
    import IPython.display

    cfg = TinyLlamaConfig(num_layers=2)
    ckpt = tiny_llama_checkpoint(cfg)
    model = _FailsOnThirdCall(cfg, device=torch.get_default_device())
    plan = [c.bytes for c in patchkit.plan_chunks(dense_patches(ckpt), BUDGET)]
    share = sum(plan[:3]) / sum(plan)
    assert abs(share - 3 / len(plan)) > 0.01
    shown = []
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    monkeypatch.setattr(progress_mod, "_in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", shown.append)
    with pytest.raises(RuntimeError, match="third call"):
        inspect_load(model, dense_patches(ckpt), max_chunk_bytes=BUDGET, progress=True)
    (box,) = shown
    bar, label = box.children
    assert bar.description == "inspect_load"
    assert bar.value == pytest.approx(share) and bar.bar_style == "danger"
    assert label.value.startswith(f"3/{len(plan)} calls, ")


def test_a_widget_bar_gives_its_label_the_width_it_needs(monkeypatch):
    # (in JupyterLab the bar's description got ipywidgets' default width, about 80 px,
    # and "inspect_load" showed as "inspect_lo…": seen in a browser, not in any output)
    pytest.importorskip("ipywidgets")
    cfg = TinyLlamaConfig(num_layers=1)
    model = TinyLlamaRuntime(cfg, device=torch.get_default_device())
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)

    def run():
        inspect_load(model, dense_patches(tiny_llama_checkpoint(cfg)), progress=True)

    bar, _label = _kernel_bar(run, monkeypatch)
    assert bar.description == "inspect_load"
    assert bar.style.description_width == "initial"


def test_a_callable_that_raises_an_ordinary_error_stops_the_load_with_it():
    # (only the error raised when told of a *failed* call is set aside: after a call that
    # returned, whatever the callback raises stops the load, a ValueError as a Ctrl-C)
    cfg = TinyLlamaConfig(num_layers=2)
    model = TinyLlamaRuntime(cfg, device=torch.get_default_device())

    def stop(p: LoadProgress) -> None:
        if p.calls_done == 2:
            raise ValueError("stop here")

    with pytest.raises(ValueError, match="stop here") as info:
        inspect_load(model, dense_patches(tiny_llama_checkpoint(cfg)), max_chunk_bytes=BUDGET,
                     progress=stop)
    assert len(info.value.report.calls) == 2


def test_a_load_progress_fraction_stays_within_0_and_1():
    # (a LoadProgress a caller builds may count past its plan; one of no calls is done)
    def made(done: int, calls: int, nbytes: int, total: int) -> LoadProgress:
        return LoadProgress(calls_done=done, calls=calls, bytes_done=nbytes,
                            total_bytes=total, seconds=0.0, names=())

    assert made(1, 1, 30, 20).fraction == 1.0
    assert made(3, 2, 0, 0).fraction == 1.0
    assert made(0, 0, 0, 0).fraction == 1.0


def test_off_a_terminal_the_final_status_follows_calls_that_staged_no_bytes(monkeypatch):
    # (calls of no staged bytes after the last line written: the count of calls still
    # differs, so the final status is written)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    view = progress_mod._LogView()

    def at(done: int, seconds: float) -> LoadProgress:
        return LoadProgress(calls_done=done, calls=3, bytes_done=100, total_bytes=100,
                            seconds=seconds, names=())

    view.update(at(1, progress_mod.LOG_EVERY), "inspect_load")
    view.finish(at(3, progress_mod.LOG_EVERY + 1), "inspect_load")
    assert [ln.split(" calls, ")[0] for ln in buf.getvalue().splitlines()] == [
        "inspect_load: 1/3", "inspect_load: 3/3"]


def test_an_ipython_whose_shell_cannot_be_read_is_no_kernel(monkeypatch):
    import types

    def broken():
        raise RuntimeError("no shell")

    fake = types.ModuleType("IPython")
    fake.get_ipython = broken
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert not progress_mod._in_kernel()


def test_in_a_kernel_an_ipywidgets_that_fails_to_import_gets_the_rewriting_line(
        monkeypatch):
    # (installed but broken: an ImportError that is no ModuleNotFoundError, as a
    # 'cannot import name' of mismatched versions is)
    import types

    broken = types.ModuleType("ipywidgets")

    def getattr_(name: str):
        raise ImportError(f"cannot import name {name!r} from 'ipywidgets'")

    broken.__getattr__ = getattr_
    monkeypatch.setitem(sys.modules, "ipywidgets", broken)
    monkeypatch.setattr(progress_mod, "_in_kernel", lambda: True)
    assert isinstance(progress_mod._View.open("inspect_load"), progress_mod._TextView)


@pytest.mark.parametrize("off", [False, None])
def test_false_or_none_shows_nothing(setup, monkeypatch, off):
    model, _ckpt, after = setup
    monkeypatch.setattr(progress_mod, "SHOW_AFTER", 0.0)
    out, report = _loaded(model, after, monkeypatch, off, terminal=True)
    assert out == "" and report.error is None and len(report.calls) > 3


def test_without_ipython_imported_there_is_no_kernel(monkeypatch):
    # (a script: IPython never imported, and not imported to find out)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert progress_mod._in_kernel() is False
    assert "IPython" not in sys.modules
